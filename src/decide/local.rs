//! The first step of a request: evaluate the plan, charge the local rules,
//! spend from a lease or gate the callout through the circuit, and decide
//! whatever can be decided without the gateway; and the way back when the
//! client leaves while its request waits.

use super::*;

/// Decides `req` at `now_ns` as far as possible without the gateway.
/// `random` feeds the jitter of `Retry-After` and of block releases.
pub fn start(
    plan: &Plan,
    req: &RequestInfo,
    store: &impl SharedStore,
    now_ns: u64,
    random: u64,
) -> Step {
    let mut eval = plan.evaluate(req);
    let mut ctx = Ctx {
        plan,
        store,
        now_ns,
        random,
        counts: Counts::default(),
        error: None,
        shadow_denied: Vec::new(),
    };
    if !eval.bad_input.is_empty() {
        ctx.counts.add(Metric::BadInput, 1);
    }
    let nothing = eval.buckets.is_empty()
        && eval.shadow.is_empty()
        && eval.global.is_empty()
        && eval.quotas.is_empty();
    if nothing {
        if eval.unlimited {
            ctx.counts.add(Metric::Unlimited, 1);
        }
        return Step::Done(Outcome {
            verdict: Verdict::Pass(Passing::default()),
            counts: ctx.counts,
            error: None,
            gateway_error: None,
            circuit: Transition::None,
            shadow_denied: Vec::new(),
            bad_input: eval.bad_input,
            lease: None,
        });
    }
    // Lease mode serves a request whose gateway part is one token bucket.
    let lease = match (eval.global.as_slice(), eval.quotas.is_empty(), eval.soft) {
        ([g], true, false) => lease::locate(plan, g),
        _ => None,
    };
    let mut leased = None;
    let mut short = false;
    if let Some(l) = &lease {
        match lease::take(store, l, now_ns) {
            Ok(Take::Taken(slot)) => {
                ctx.counts.add(Metric::LeaseServed, 1);
                leased = Some(lease::reports(plan, l, &slot, now_ns));
            }
            Ok(Take::Short) => short = true,
            Ok(Take::Busy) => {}
            Ok(Take::Empty { wait_ns }) => {
                ctx.counts.add(Metric::LeaseServed, 1);
                let v = ctx.too_many(&lease::empty_reports(plan, l, wait_ns, now_ns));
                return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None));
            }
            Err(e) => {
                ctx.counts.add(Metric::Errors, 1);
                ctx.error = Some(e);
            }
        }
    }
    // A bucket the gateway denied and whose wait is not over: 429 here, before
    // any charge (a denied request consumes nothing). A soft client is never denied.
    if leased.is_none() && !eval.soft && !eval.global.is_empty() {
        match deny_cache::lookup(plan, store, &eval.global, now_ns) {
            Ok(Some(reports)) => {
                ctx.counts.add(Metric::DenyCacheHits, 1);
                let v = ctx.too_many(&reports);
                return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None));
            }
            Ok(None) => {}
            // Unread, the cache denies nothing: the gateway decides.
            Err(_) => ctx.counts.add(Metric::Errors, 1),
        }
    }
    let needs_gateway = (!eval.global.is_empty() && leased.is_none()) || !eval.quotas.is_empty();
    let global = plan.global.as_ref().filter(|_| needs_gateway);
    let gate = global.map(|g| {
        let longest = longest_timeout_ms(g);
        circuit::gate(
            store,
            &g.circuit_key,
            &g.circuit,
            g.timeout_ms,
            longest,
            now_ns,
        )
    });
    let mut charge = std::mem::take(&mut eval.buckets);
    let mut watch_fallback = false;
    if let (Some(g), Some(Gate::Open)) = (global, gate) {
        ctx.counts.add(Metric::CircuitOpenSkips, 1);
        match g.failure_mode {
            FailureMode::Closed => {
                ctx.counts.add(Metric::FailClosed, 1);
                let v = ctx.unavailable();
                return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None));
            }
            FailureMode::Open => ctx.counts.add(Metric::FailOpen, 1),
            // Charged together with the local rules: all or nothing in one step.
            FailureMode::Local => {
                ctx.counts.add(Metric::FallbackLocal, 1);
                if eval.soft {
                    watch_fallback = true;
                } else {
                    charge.extend_from_slice(&eval.fallback);
                }
            }
        }
    }
    let mut reports = match ctx.charge(&charge) {
        Ok(r) => r,
        Err(v) => {
            if let (Some(l), Some(_)) = (&lease, &leased) {
                ctx.give_back(l);
            }
            return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None));
        }
    };
    ctx.watch(&eval.shadow, &mut reports);
    if watch_fallback {
        ctx.watch(&eval.fallback, &mut reports);
    }
    match gate {
        Some(Gate::Call) | Some(Gate::Probe) => {
            ctx.counts.add(Metric::GlobalCalls, 1);
            let lease_call = match (lease, global.and_then(|g| g.lease.as_ref())) {
                (Some(l), Some(lp)) if short => match lease::claim(store, &l, lp, now_ns, false) {
                    Ok(Some(c)) => Some((l, c)),
                    Ok(None) => None,
                    Err(e) => {
                        ctx.counts.add(Metric::Errors, 1);
                        ctx.error = Some(e);
                        None
                    }
                },
                _ => None,
            };
            let body = match &lease_call {
                Some((l, c)) => {
                    ctx.counts.add(Metric::LeaseFetches, 1);
                    callout::encode_lease(plan, l, c.want, c.returned)
                }
                None => callout::encode_request(plan, &eval.global, &eval.quotas),
            };
            Step::Call(Box::new(Pending {
                body,
                lease: lease_call,
                probe: gate == Some(Gate::Probe),
                charged: if ctx.error.is_some() {
                    Vec::new()
                } else {
                    charge
                },
                charged_at_ns: now_ns,
                local_reports: reports,
                eval,
                random,
                counts: ctx.counts,
                error: ctx.error,
                shadow_denied: ctx.shadow_denied,
            }))
        }
        _ => {
            let served = leased.is_some();
            if let Some(leased) = leased {
                reports.extend(leased);
            }
            let v = ctx.pass(reports);
            let mut outcome = ctx.done(v, eval.bad_input, None, Transition::None);
            outcome.lease = lease.filter(|_| served).map(Box::new);
            Step::Done(outcome)
        }
    }
}

/// The client left while its request waited for the gateway: gives back the
/// local charge (the request never reached the upstream) and frees a lease
/// claim. A late answer is dropped, so what the gateway charged stays charged:
/// the strict side.
pub fn abandon(plan: &Plan, pending: Pending, store: &impl SharedStore) -> Counts {
    let mut counts = Counts::default();
    if limiter::refund(store, plan, &pending.charged, pending.charged_at_ns).is_err() {
        counts.add(Metric::Errors, 1);
    }
    if let Some((l, _)) = &pending.lease {
        if lease::release(store, l).is_err() {
            counts.add(Metric::Errors, 1);
        }
    }
    counts
}
