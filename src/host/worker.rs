//! What a worker's contexts share, and how a request's decision is carried
//! out: from the request's own callbacks, or from the root context when it
//! answers the request's part of a batch.

use super::calls::{reset_request, resume_or_reset, send_local_response, set_property, HostStore};
use crate::decide::{self, Outcome, Reply, Stream, Tally, Verdict};
use crate::global::circuit::Transition;
use crate::global::coalesce::Coalescer;
use crate::global::lease::{Lease, Watched};
use crate::global::outbox::Outbox;
use crate::metrics::{Background, Metric};
use crate::policy::plan::Plan;
use crate::vm::timers::Delays;
use crate::vm::{Jitter, LogGates};
use proxy_wasm::types::Action;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// One per worker: the root makes it, each request holds it.
#[derive(Default)]
pub(super) struct Worker {
    /// What this worker counted since the last tick.
    pub tally: RefCell<Tally>,
    pub logs: LogGates,
    /// Requests a graduated rule holds; the tick resumes them.
    pub delays: RefCell<Delays>,
    /// Leases this worker's requests used lately.
    pub leases: RefCell<Watched>,
    pub jitter: RefCell<Jitter>,
    /// Settlements this worker's streams left for the gateway.
    pub outbox: RefCell<Outbox>,
    /// Checks waiting for a batch, and the batches in flight.
    pub coalescer: RefCell<Coalescer>,
    /// The streams of requests whose check is in a batch, by context id:
    /// the root carries out their answers there, and each takes its own
    /// back at its next callback.
    pub parked: RefCell<HashMap<u32, Parked>>,
    /// The root context's id: the batches' calls are made as the root, so
    /// that no request's end cancels one.
    pub root_id: Cell<u32>,
    /// The queue that wakes the root to post a batch.
    pub wake_queue: Cell<Option<u32>>,
}

/// A request's stream while its check is in a batch.
pub(super) struct Parked {
    pub stream: Stream,
    /// The root carried out its answer: the request may take it back.
    pub answered: bool,
}

/// A request's stream with its worker.
pub(super) struct Req<'a> {
    pub id: u32,
    pub w: &'a Worker,
    pub stream: &'a mut Stream,
}

impl Req<'_> {
    pub fn watch(&self, lease: &Lease, now: u64) {
        self.w.leases.borrow_mut().touch(lease, now);
    }

    /// The gateway's reply, or none, for the waiting request.
    pub fn answer(&mut self, plan: &Plan, reply: Reply, sent_at: u64, paused: bool) -> Action {
        let now = super::calls::now_ns();
        let latency = now.saturating_sub(sent_at);
        if self
            .stream
            .gateway_answer(plan, reply, latency, &HostStore, now)
        {
            // A failed check's release of the slots it may hold.
            self.queue_settlement();
            self.conclude(plan, now, paused)
        } else {
            Action::Continue
        }
    }

    /// Reports the stream's decision and carries out its verdict; `paused`
    /// says whether the request waits for a resume.
    pub fn conclude(&mut self, plan: &Plan, now: u64, paused: bool) -> Action {
        let Some(outcome) = self.stream.outcome() else {
            return Action::Continue;
        };
        report(self.w, plan, outcome, now);
        if plan.filter_state {
            leave_for_the_access_log(plan, outcome);
        }
        if let Some(l) = &outcome.lease {
            self.watch(l, now);
        }
        match outcome.verdict {
            Verdict::Delay { ms, .. } => {
                let delay = ms.saturating_mul(1_000_000);
                self.w
                    .delays
                    .borrow_mut()
                    .hold(self.id, super::calls::now_ns(), delay);
                Action::Pause
            }
            Verdict::Pass(_) => {
                if paused {
                    resume_or_reset("the request");
                }
                Action::Continue
            }
            Verdict::Reject { .. } => {
                self.send_answer();
                Action::Pause
            }
        }
    }

    /// Sends the filter's own answer. Fails closed: a denial whose answer
    /// cannot be sent resets the stream; resuming would admit it, and leaving
    /// it paused would hold it until Envoy's stream timeout.
    fn send_answer(&mut self) {
        let Some(a) = self.stream.take_answer() else {
            return;
        };
        if let Err(rc) = send_local_response(a.status, &a.headers, a.body.as_bytes()) {
            log::error!(
                "ratelimit-wasm: could not send the {} response (status {rc}); resetting the request",
                a.status
            );
            if let Err(rc) = reset_request() {
                log::error!("ratelimit-wasm: could not reset the request either (status {rc})");
            }
        }
    }

    /// Queues the settlement the stream's response completed, if any, for
    /// the root's tick to post, and counts what settling against a lease
    /// could not apply.
    pub fn queue_settlement(&mut self) {
        let left = self.stream.take_lease_left();
        let mut tally = self.w.tally.borrow_mut();
        tally.background(Background::LeaseUnreturned, left.unreturned);
        tally.background(Background::LeaseDebtDropped, left.dropped);
        let Some(s) = self.stream.take_remote() else {
            return;
        };
        if !self.w.outbox.borrow_mut().push(s) {
            tally.background(Background::GlobalSettleFailed, 1);
        }
    }
}

fn report(w: &Worker, plan: &Plan, outcome: &Outcome, now: u64) {
    w.tally.borrow_mut().outcome(plan, outcome);
    // Once per VM: every answer of a drifted policy would say it again.
    static MISMATCH_LOGGED: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    if outcome.counts.get(Metric::PolicyMismatch) > 0
        && !MISMATCH_LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        log::warn!(
            "ratelimit-wasm: the gateway enforces other limits than this configuration of domain {:?}; \
             the gateway's apply and are shown (render both from one file); \
             counted in ratelimit_wasm_policy_mismatch, logged once",
            plan.domain
        );
    }
    if let Some(e) = &outcome.error {
        log::warn!(
            "ratelimit-wasm: shared state failed, on_error={:?}: {e}",
            plan.on_error
        );
    }
    if let Some(e) = &outcome.gateway_error {
        if let Some(more) = w.logs.gateway.open(now) {
            let mode = plan.global.as_ref().map(|g| g.failure_mode);
            log::warn!(
                "ratelimit-wasm: gateway failed, failure_mode={mode:?}: {e} (+{more} not logged)"
            );
        }
    }
    log_transition(outcome.circuit);
    if !outcome.bad_input.is_empty() {
        if let Some(more) = w.logs.bad_input.open(now) {
            log::warn!(
                "ratelimit-wasm: bad input in request identity: {:?} (+{more} not logged)",
                outcome.bad_input
            );
        }
    }
    let shadow = outcome.shadow_denied(plan);
    if !shadow.is_empty() {
        if let Some(more) = w.logs.shadow.open(now) {
            log::info!(
                "ratelimit-wasm: shadow: {shadow:?} would have denied this request (+{more} not logged)"
            );
        }
    }
}

/// Logs the circuit opening or closing.
pub(super) fn log_transition(t: Transition) {
    match t {
        Transition::Opened => log::warn!("ratelimit-wasm: circuit to the gateway opened"),
        Transition::Closed => log::info!("ratelimit-wasm: circuit to the gateway closed"),
        Transition::None => {}
    }
}

/// Sets the decision as filter state for Envoy's access log (before a
/// local reply: the log reads the state its stream holds at the end).
#[inline(never)]
fn leave_for_the_access_log(plan: &Plan, outcome: &Outcome) {
    let Some(why) = decide::why::why(plan, outcome) else {
        return;
    };
    if let Err(rc) = set_property(decide::why::FILTER_STATE, why.line().as_bytes()) {
        log::debug!("ratelimit-wasm: the host refused the access log's filter state (status {rc})");
    }
}
