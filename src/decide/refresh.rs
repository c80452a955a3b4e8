//! Lease refreshes made by the root context's timer: a batch running low is
//! topped up ahead of the requests that will need it, so steady traffic finds
//! tokens in the slot and never waits.

use super::answer::lease_answer;
use super::*;

/// A lease callout made by the root timer to top up a batch running low, so
/// that steady traffic finds tokens in the slot and never waits.
#[derive(Debug, Clone, PartialEq)]
pub struct Refresh {
    /// Body of the `POST` to the lease endpoint.
    pub body: Vec<u8>,
    lease: Lease,
    claim: Claim,
    probe: bool,
}

/// Starts a refresh of `l` when its live batch is at half or less and the
/// circuit lets calls through; a shared-data error on the way is counted in
/// the returned counts, as on every other path.
pub fn refresh_start(
    plan: &Plan,
    store: &impl SharedStore,
    l: &Lease,
    now_ns: u64,
) -> (Option<Refresh>, Counts) {
    let mut counts = Counts::default();
    let started = try_refresh(plan, store, l, now_ns, &mut counts);
    (started, counts)
}

/// [`refresh_start`]'s steps.
fn try_refresh(
    plan: &Plan,
    store: &impl SharedStore,
    l: &Lease,
    now_ns: u64,
    counts: &mut Counts,
) -> Option<Refresh> {
    let g = plan.global.as_ref()?;
    let lp = g.lease.as_ref()?;
    let claim = match lease::claim(store, l, lp, now_ns, true) {
        Ok(claim) => claim?,
        Err(_) => {
            counts.add(Metric::Errors, 1);
            return None;
        }
    };
    let longest = longest_timeout_ms(g);
    let probe = match circuit::gate(
        store,
        &g.circuit_key,
        &g.circuit,
        lp.max_wait_ms,
        longest,
        now_ns,
    ) {
        Gate::Call => false,
        Gate::Probe => true,
        Gate::Open => {
            // The requests themselves take the failure mode; a batch in hand is still spent.
            if lease::release(store, l).is_err() {
                counts.add(Metric::Errors, 1);
            }
            return None;
        }
    };
    Some(Refresh {
        body: callout::encode_lease(plan, l, claim.want, claim.returned),
        lease: l.clone(),
        claim,
        probe,
    })
}

/// Stores the answer to a refresh (or its failure to start); what to count,
/// the lease fetch included, and what the circuit did.
pub fn refresh_finish(
    plan: &Plan,
    store: &impl SharedStore,
    r: Refresh,
    status: Option<&[u8]>,
    body: &[u8],
    latency_ns: u64,
    now_ns: u64,
) -> (Counts, Transition, Option<AnswerError>) {
    let mut counts = Counts::default();
    counts.add(Metric::LeaseFetches, 1);
    let Some(g) = plan.global.as_ref() else {
        return (counts, Transition::None, None);
    };
    let mut error = None;
    let mut noted = Noted {
        counts: &mut counts,
        error: &mut error,
    };
    // The timer spends nothing: the whole grant goes to the slot.
    let answer = lease_answer(
        plan, &mut noted, &r.lease, r.claim, 0, status, body, store, now_ns,
    );
    let result = call_result(&answer, latency_ns);
    let transition = circuit::record(store, &g.circuit_key, &g.circuit, now_ns, result, r.probe);
    if transition == Transition::Opened {
        counts.add(Metric::CircuitOpened, 1);
    }
    match answer {
        Ok(a) => {
            counts.add(Metric::GatewayClamped, a.clamped);
            counts.add(Metric::PolicyMismatch, u64::from(a.mismatch));
            (counts, transition, None)
        }
        Err(e) => {
            counts.add(Metric::GlobalFailures, 1);
            (counts, transition, Some(e))
        }
    }
}
