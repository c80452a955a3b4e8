//! One request's life in the filter, from its request headers to the end of
//! its stream. Each phase the host sees (request headers, the request body
//! when a reservation is read from it, the gateway's answer, response
//! headers, the end) is a method here over the state the
//! earlier phases left: what the request waits for, the headers its response
//! gets, and the local charge it holds. The host layer only fetches what a
//! phase reads and carries out what it returns.

use super::*;
use crate::global::lease::Settled;

/// A request's state between the host's callbacks.
#[derive(Debug, Default)]
pub struct Stream {
    state: State,
    /// What an admitted request settles from its response, when anything does.
    settlement: Option<Box<Settlement>>,
}

// The large variant is the point: the stream is the outcome's one home.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Default)]
enum State {
    /// Not decided yet (or nothing to decide: no plan).
    #[default]
    Fresh,
    /// Waiting for the request body, nothing charged yet.
    Body(Box<BodyWait>),
    /// Waiting for the gateway's answer.
    Waiting(Box<Pending>),
    /// Decided: let through (now or after a delay) with the headers its
    /// response gets and the local charge it holds, or answered by the
    /// filter. Kept in place: the host reads it where it lies, since moving
    /// an outcome through each layer cost c1 hundreds of instructions.
    Decided(Outcome),
}

/// What the host does after the request-headers phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Carry out [`Stream::outcome`].
    Decided,
    /// Post [`Stream::callout`] to the gateway, then call [`Stream::gateway_answer`].
    Call,
    /// Let the headers go on, hold the body until it has ended or reached
    /// [`Stream::body_limit`], then call [`Stream::request_body`]. (Envoy
    /// hands a filter whose headers paused none of the body until it
    /// resumes them, so the decision cannot hold the headers too.)
    Body,
}

/// A callout to make: the body, the gateway's path and the timeout.
#[derive(Debug, PartialEq)]
pub struct Callout<'a> {
    /// Body of the `POST`.
    pub body: &'a [u8],
    /// The gateway's endpoint: the check or the lease.
    pub method: Method,
    /// How long to wait for the answer.
    pub timeout_ms: u64,
}

/// A denial the filter answers itself: status, header map and body.
pub struct LocalAnswer {
    /// HTTP status.
    pub status: u32,
    /// The headers, as the host's map.
    pub headers: Vec<u8>,
    /// The body.
    pub body: String,
}

impl Stream {
    /// Request headers: decides the request, or says to call the gateway.
    #[inline(always)]
    pub fn request_headers(
        &mut self,
        plan: &Plan,
        req: &RequestInfo,
        store: &impl SharedStore,
        now_ns: u64,
        random: u64,
    ) -> Next {
        match start(plan, req, store, now_ns, random) {
            Step::Done(outcome) => {
                self.state = State::Decided(outcome);
                if plan.settling {
                    self.open_settlement(plan);
                }
                Next::Decided
            }
            Step::Call(pending) => {
                self.state = State::Waiting(pending);
                Next::Call
            }
        }
    }

    /// Request headers of a plan that reads request bodies
    /// ([`Plan::reads_request_body`]): a request matching a `cost_from` that
    /// reads the body waits for it (`end_of_stream`: there is none, and the
    /// defaults apply); any other is decided as [`Stream::request_headers`]
    /// does. Out of line: the plans that read no body keep the one copy of
    /// the first step inlined in [`Stream::request_headers`].
    #[inline(never)]
    pub fn request_headers_reading_body(
        &mut self,
        plan: &Plan,
        req: &RequestInfo,
        store: &impl SharedStore,
        now_ns: u64,
        random: u64,
        end_of_stream: bool,
    ) -> (Next, BodyRead) {
        let eval = plan.evaluate(req);
        let meters = plan.body_meters(&eval);
        if meters.is_empty() {
            let step = start_evaluated(plan, eval, store, now_ns, random);
            return (self.take_step(plan, step), BodyRead::default());
        }
        let wait = BodyWait::new(plan, eval, random, meters);
        if end_of_stream {
            let (eval, random, read) = wait.absent(plan);
            let step = start_evaluated(plan, eval, store, now_ns, random);
            return (self.take_step(plan, step), read);
        }
        self.state = State::Body(Box::new(wait));
        (Next::Body, BodyRead::default())
    }

    /// The most bytes of the request body to hold, while the request waits
    /// for it; `None` otherwise (the body passes untouched).
    pub fn body_limit(&self) -> Option<usize> {
        match &self.state {
            State::Body(w) => Some(w.limit()),
            _ => None,
        }
    }

    /// Whether the body the request waits for may be rewritten
    /// (`ensure_stream_usage`): its length is then not known up front.
    pub fn body_rewritten(&self) -> bool {
        matches!(&self.state, State::Body(w) if w.rewrites())
    }

    /// Whether the rest of a body must wait: the request was decided while
    /// its body came in and waits for the gateway, or was refused.
    pub fn holds_body(&self) -> bool {
        match &self.state {
            State::Waiting(_) => true,
            State::Decided(o) => matches!(o.verdict, Verdict::Reject { .. }),
            State::Fresh | State::Body(_) => false,
        }
    }

    /// The request body (`None`: longer than [`Stream::body_limit`]): sets
    /// the reservations from it and decides, or says to call the gateway.
    /// What the host carries out besides: the rewritten body, the counts.
    #[inline(never)]
    pub fn request_body(
        &mut self,
        plan: &Plan,
        bytes: Option<&[u8]>,
        store: &impl SharedStore,
        now_ns: u64,
    ) -> (Next, BodyRead) {
        if !matches!(self.state, State::Body(_)) {
            return (Next::Decided, BodyRead::default());
        }
        let State::Body(wait) = std::mem::take(&mut self.state) else {
            return (Next::Decided, BodyRead::default());
        };
        let (eval, random, read) = wait.read(plan, bytes);
        let step = start_evaluated(plan, eval, store, now_ns, random);
        (self.take_step(plan, step), read)
    }

    /// The request's trailers came before its body ended (a body of none,
    /// or one Envoy already holds): decided on the defaults, so that no
    /// request waiting for its body goes on without a decision.
    #[inline(never)]
    pub fn request_trailers(
        &mut self,
        plan: &Plan,
        store: &impl SharedStore,
        now_ns: u64,
    ) -> (Next, BodyRead) {
        if !matches!(self.state, State::Body(_)) {
            return (Next::Decided, BodyRead::default());
        }
        let State::Body(wait) = std::mem::take(&mut self.state) else {
            return (Next::Decided, BodyRead::default());
        };
        let (eval, random, read) = wait.absent(plan);
        let step = start_evaluated(plan, eval, store, now_ns, random);
        (self.take_step(plan, step), read)
    }

    /// Keeps the first step's result, as [`Stream::request_headers`] does
    /// (out of line: the requests that read no body never come here).
    #[inline(never)]
    fn take_step(&mut self, plan: &Plan, step: Step) -> Next {
        match step {
            Step::Done(outcome) => {
                self.state = State::Decided(outcome);
                if plan.settling {
                    self.open_settlement(plan);
                }
                Next::Decided
            }
            Step::Call(pending) => {
                self.state = State::Waiting(pending);
                Next::Call
            }
        }
    }

    /// Whether the waiting request's check goes in a batch.
    pub fn batched(&self, plan: &Plan) -> bool {
        matches!(&self.state, State::Waiting(p) if p.batched(plan))
    }

    /// The waiting request's check, taken out for its batch (the batch
    /// carries it from then on; nothing reads it here again).
    pub fn take_check(&mut self) -> Vec<u8> {
        match &mut self.state {
            State::Waiting(p) => std::mem::take(&mut p.body),
            _ => Vec::new(),
        }
    }

    /// Whether the waiting request's call is the half-open circuit's probe.
    pub fn probe(&self) -> bool {
        matches!(&self.state, State::Waiting(p) if p.probe)
    }

    /// The callout a waiting request makes, and the lease it fetches for.
    pub fn callout<'a>(&'a self, plan: &'a Plan) -> Option<(Callout<'a>, Option<&'a Lease>)> {
        let State::Waiting(pending) = &self.state else {
            return None;
        };
        let (method, timeout_ms) = pending.route(plan)?;
        let callout = Callout {
            body: &pending.body,
            method,
            timeout_ms,
        };
        Some((callout, pending.lease()))
    }

    /// The gateway's answer (`status` `None`: none came, or the callout never
    /// left): whether it decided a request waiting for one (then carry out
    /// [`Stream::outcome`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gateway_answer(
        &mut self,
        plan: &Plan,
        reply: Reply,
        latency_ns: u64,
        store: &impl SharedStore,
        now_ns: u64,
    ) -> bool {
        let Some(pending) = self.take_pending() else {
            return false;
        };
        // A failed check may still have taken its slots (a timeout after
        // the gateway's commit): they are released at once.
        let failed = match &reply {
            Reply::Own { status, .. } => status.is_none_or(|s| s != b"200"),
            Reply::Part(part) => part.is_err(),
        };
        let release = failed.then(|| release_of(plan, &pending)).flatten();
        let outcome = finish_reply(plan, *pending, reply, latency_ns, store, now_ns);
        self.state = State::Decided(outcome);
        if plan.settling {
            self.open_settlement(plan);
        }
        if let Some(release) = release {
            match &mut self.settlement {
                Some(s) => s.send_also(release),
                None => self.settlement = Some(Settlement::sending(release)),
            }
        }
        true
    }

    /// Keeps what an admitted request settles from its response.
    #[inline(never)]
    fn open_settlement(&mut self, plan: &Plan) {
        let leased = self.outcome().and_then(|o| o.lease.as_deref());
        self.settlement = self.held().and_then(|h| Settlement::new(plan, h, leased));
    }

    /// Whether the response phases have anything to settle: only then need
    /// the host read the response's headers and body for it.
    pub fn settles(&self) -> bool {
        self.settlement.is_some()
    }

    /// Whether [`Stream::end`] reads the clock: a settlement or a slot to
    /// give back (the others spare the host a clock hostcall).
    #[inline(never)]
    pub fn ends_on_the_clock(&self) -> bool {
        self.settlement.is_some()
            || matches!(&self.state, State::Decided(o) if !o.held.slots().is_empty())
    }

    /// Whether the host should pass the response body to [`Stream::response_body`].
    pub fn wants_body(&self) -> bool {
        self.settlement.as_ref().is_some_and(|s| s.wants_body())
    }

    /// Response headers, for the settlement: the status and what
    /// `cost_from` reads. What to count.
    pub fn response_started(
        &mut self,
        plan: &Plan,
        head: &impl ResponseHeaders,
        store: &impl SharedStore,
        now_ns: u64,
    ) -> Counts {
        match &mut self.settlement {
            Some(s) => s.response_headers(plan, head, store, now_ns),
            None => Counts::default(),
        }
    }

    /// A chunk of the response body (`end`: the last), for the settlement.
    pub fn response_body(
        &mut self,
        plan: &Plan,
        chunk: &[u8],
        end: bool,
        store: &impl SharedStore,
        now_ns: u64,
    ) -> Counts {
        match &mut self.settlement {
            Some(s) => s.body(plan, chunk, end, store, now_ns),
            None => Counts::default(),
        }
    }

    /// A settlement for the gateway, once the response told everything it
    /// reserved (taken once): the host queues it for the root's tick.
    pub fn take_remote(&mut self) -> Option<ratelimit_protocol::Settlement> {
        self.settlement.as_mut()?.take_outbox()
    }

    /// What settling against a lease could not apply since the last call,
    /// for the host to count.
    pub fn take_lease_left(&mut self) -> Settled {
        self.settlement
            .as_mut()
            .map_or_else(Settled::default, |s| s.take_lease_left())
    }

    /// Debt of another bucket that this request's lease claim dropped when
    /// it took the slot over, for the host to count.
    pub fn dropped_debt(&self) -> u64 {
        match &self.state {
            State::Waiting(p) => p.dropped_debt(),
            _ => 0,
        }
    }

    /// The decision, once there is one.
    pub fn outcome(&self) -> Option<&Outcome> {
        match &self.state {
            State::Decided(o) => Some(o),
            _ => None,
        }
    }

    /// The answer of a request the filter refused, taken to be sent (once).
    pub fn take_answer(&mut self) -> Option<LocalAnswer> {
        let State::Decided(o) = &mut self.state else {
            return None;
        };
        let Verdict::Reject {
            status,
            headers,
            body,
        } = &mut o.verdict
        else {
            return None;
        };
        // Left in place once taken (dropping the outcome here would cost
        // every 429 the drop now rather than with its context).
        if headers.is_taken() {
            return None;
        }
        Some(LocalAnswer {
            status: *status,
            headers: headers.take_map(),
            body: std::mem::take(body),
        })
    }

    /// Response headers: the rate-limit headers the response gets, unless
    /// the filter answered the request itself.
    pub fn response_headers(&self) -> Option<&Passing> {
        match &self.outcome()?.verdict {
            Verdict::Pass(headers) | Verdict::Delay { headers, .. } => Some(headers),
            Verdict::Reject { .. } => None,
        }
    }

    /// The end of the stream: a request still waiting for the gateway (its
    /// client left) gives its local charge back and releases the global
    /// concurrency slots its check may take, and says what to count. A
    /// decided request keeps what it was charged (an admitted one reached
    /// the upstream, a refused one was refunded when it was refused), but
    /// for what its settlement still owes or is owed.
    pub fn end(&mut self, plan: &Plan, store: &impl SharedStore, now_ns: u64) -> Option<Counts> {
        if let Some(pending) = self.take_pending() {
            self.settlement = release_of(plan, &pending).map(Settlement::sending);
            return Some(abandon(plan, *pending, store));
        }
        let mut counts = self.settlement.as_mut().map(|s| s.end(plan, store, now_ns));
        if let State::Decided(o) = &mut self.state {
            if !o.held.slots().is_empty() {
                let slots = o.held.take_slots();
                let released = super::in_flight::release(plan, store, &slots, now_ns);
                counts.get_or_insert_with(Counts::default).merge(&released);
            }
        }
        counts
    }

    /// The request waiting for the gateway, taken out; any other state stays
    /// as it is (checked in place: taking a decided state out would drop its
    /// outcome, and moving it costs a decision instructions).
    fn take_pending(&mut self) -> Option<Box<Pending>> {
        if !matches!(self.state, State::Waiting(_)) {
            return None;
        }
        match std::mem::take(&mut self.state) {
            State::Waiting(pending) => Some(pending),
            State::Fresh | State::Body(_) | State::Decided(_) => None,
        }
    }

    /// The local charge an admitted request holds.
    pub fn held(&self) -> Option<&Held> {
        let o = self.outcome()?;
        match o.verdict {
            Verdict::Pass(_) | Verdict::Delay { .. } => Some(&o.held),
            Verdict::Reject { .. } => None,
        }
    }
}

/// What releases the global concurrency slots `pending`'s check may take,
/// for a request that will not settle them when its stream ends.
fn release_of(plan: &Plan, pending: &Pending) -> Option<ratelimit_protocol::Settlement> {
    let id = pending.reservation.clone()?;
    let reserved = super::remote::Reserved::new(plan, &pending.eval, id)?;
    Settlement::release_of(plan, reserved)
}
