//! The root context's side of coalesced checks. It posts the queued checks
//! in batches as itself (Envoy cancels a call when the context that made it
//! ends, and any request may leave), and carries out each request's part of
//! the answer in that request's context.

use super::calls::{dispatch, now_ns, HostStore};
use super::worker::{log_transition, Req, Worker};
use crate::decide::{self, Reply};
use crate::global::callout::{self, AnswerError};
use crate::global::coalesce::Member;
use crate::metrics::Background;
use crate::policy::plan::Plan;
use proxy_wasm::hostcalls;
use ratelimit_protocol::grpc::Method;
use ratelimit_protocol::CheckResponse;

/// Posts every queued check, in batches of at most `max_batch`.
pub(super) fn post(w: &Worker, plan: &Plan, now: u64) {
    let Some((g, bp)) = plan
        .global
        .as_ref()
        .and_then(|g| Some((g, g.batch.as_ref()?)))
    else {
        return;
    };
    // After carrying out answers the host still acts for the last request.
    if hostcalls::set_effective_context(w.root_id.get()).is_err() {
        return;
    }
    loop {
        let Some(batch) = w.coalescer.borrow_mut().next_batch(bp) else {
            return;
        };
        // No check waits longer in all than its timeout.
        let waited_ms = now.saturating_sub(batch.oldest_ns()) / 1_000_000;
        let timeout_ms = g.timeout_ms.saturating_sub(waited_ms).max(1);
        match dispatch(plan, &batch.body, Method::CheckBatch, timeout_ms) {
            Some(token) => {
                w.tally
                    .borrow_mut()
                    .background(Background::GlobalBatches, 1);
                w.coalescer.borrow_mut().posted(token, batch.members, now);
            }
            None => {
                answered(w, plan, &batch.members, (None, &[]), now);
                let _ = hostcalls::set_effective_context(w.root_id.get());
            }
        }
    }
}

/// The tick's part: posts the queue when no wake came in time (and asks
/// for wakes again: a wake the host lost would otherwise leave every later
/// check to the tick).
pub(super) fn tick(w: &Worker, plan: &Plan, now: u64) {
    let Some(bp) = plan.batch() else {
        return;
    };
    if w.coalescer.borrow().due(bp, now) {
        w.coalescer.borrow_mut().wake_served();
        post(w, plan, now);
    }
}

/// The answer to a batch call (`status` `None`: none came, or the call
/// never left): counted once in the circuit, then each member's part is
/// carried out in its own context.
pub(super) fn answered(
    w: &Worker,
    plan: &Plan,
    members: &[Member],
    (status, body): (Option<&[u8]>, &[u8]),
    sent_at: u64,
) {
    let now = now_ns();
    let parts = callout::read_batch(status, body, members.len());
    let probe = members.iter().any(|m| {
        w.parked
            .borrow()
            .get(&m.context)
            .is_some_and(|p| p.stream.probe())
    });
    let latency = now.saturating_sub(sent_at);
    let (transition, counts) = decide::record_batch(plan, &HostStore, &parts, latency, probe, now);
    w.tally.borrow_mut().counts(&counts);
    log_transition(transition);
    let parts: Vec<Result<CheckResponse<f64>, AnswerError>> = match parts {
        Ok(parts) => parts,
        Err(e) => members.iter().map(|_| Err(e.clone())).collect(),
    };
    for (m, part) in members.iter().zip(parts) {
        if !m.gone {
            carry_out(w, plan, m.context, part, sent_at);
        }
    }
}

/// Carries out one member's part of a batch's answer in its context, and
/// parks its stream again for the request to take back.
fn carry_out(
    w: &Worker,
    plan: &Plan,
    context: u32,
    part: Result<CheckResponse<f64>, AnswerError>,
    sent_at: u64,
) {
    let Some(mut parked) = w.parked.borrow_mut().remove(&context) else {
        return;
    };
    if hostcalls::set_effective_context(context).is_err() {
        // Gone from the host without its end reaching us: what it held goes back.
        if let Some(counts) = parked.stream.end(plan, &HostStore, now_ns()) {
            w.tally.borrow_mut().counts(&counts);
        }
        return;
    }
    let mut req = Req {
        id: context,
        w,
        stream: &mut parked.stream,
    };
    req.answer(plan, Reply::Part(part), sent_at, true);
    parked.answered = true;
    w.parked.borrow_mut().insert(context, parked);
}
