//! One request from headers to answer: match, key, limit, then what to send.
//! Pure: the host layer only fetches the request, makes the callout when told
//! to, holds delayed requests, and carries out the verdict.
//!
//! Local rules are charged first; a local denial skips the callout. When the
//! gateway then denies, the local charge is refunded, so a denied request
//! consumes nothing anywhere. Shadow rules (and every rule, for a soft client)
//! are charged as if enforced but never reject.

use crate::config::{FailureMode, OnError};
use crate::global::callout::{self, Answer, AnswerError, QuotaReport};
use crate::global::circuit::{self, CallResult, Gate, Transition};
use crate::global::lease::{self, Claim, Lease, Take};
use crate::limits::limiter::Bucket;
use crate::limits::limiter::{self, Decision, LimitError, Report, Stats};
use crate::limits::store::SharedStore;
use crate::metrics::Metric;
use crate::policy::key::BadInput;
use crate::policy::plan::{Evaluation, GlobalPlan, Plan};
use crate::policy::request::RequestInfo;
use crate::respond::headers;
use crate::respond::problem;

/// Header lines to send.
pub type HeaderLines = Vec<(&'static str, String)>;

/// What the filter does with the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Let it through and add these headers to the response.
    Pass(HeaderLines),
    /// Hold it `ms` milliseconds, then let it through with these headers.
    Delay {
        /// How long to hold the request.
        ms: u64,
        /// Headers for the response.
        headers: HeaderLines,
    },
    /// Answer it here.
    Reject {
        /// HTTP status.
        status: u32,
        /// Response headers.
        headers: HeaderLines,
        /// Response body.
        body: String,
    },
}

/// Increments per [`Metric`], indexed by [`Metric::index`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts(pub [u64; Metric::ALL.len()]);

impl Counts {
    fn add(&mut self, m: Metric, n: u64) {
        if let Some(c) = self.0.get_mut(m.index()) {
            *c += n;
        }
    }

    /// The count of one metric.
    pub fn get(&self, m: Metric) -> u64 {
        self.0.get(m.index()).copied().unwrap_or(0)
    }

    fn stats(&mut self, s: &Stats) {
        self.add(Metric::CasRetries, s.cas_retries);
        self.add(Metric::Evictions, s.evictions);
        self.add(Metric::CorruptState, s.corrupt_sets);
    }
}

/// The verdict and what to count and log about it.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// What to do.
    pub verdict: Verdict,
    /// Metric increments.
    pub counts: Counts,
    /// A shared-data failure that `on_error` decided.
    pub error: Option<LimitError>,
    /// A gateway failure that the failure mode decided.
    pub gateway_error: Option<AnswerError>,
    /// What the circuit breaker did.
    pub circuit: Transition,
    /// Rules that would have denied but only watch (shadow rules, soft clients).
    pub shadow_denied: Vec<String>,
    /// Odd input seen while building keys.
    pub bad_input: Vec<BadInput>,
    /// The lease that served the request, for the timer to keep topped up.
    pub lease: Option<Lease>,
}

/// A request waiting for the gateway.
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    /// Body of the `POST` to the gateway.
    pub body: Vec<u8>,
    /// This call is the half-open circuit's probe.
    pub probe: bool,
    charged: Vec<Bucket>,
    /// When `charged` was charged: a refund finds the sliding window holding it.
    charged_at_ns: u64,
    local_reports: Vec<Report>,
    eval: Evaluation,
    random: u64,
    counts: Counts,
    error: Option<LimitError>,
    shadow_denied: Vec<String>,
    lease: Option<(Lease, Claim)>,
}

impl Pending {
    /// The lease this callout fetches a batch for.
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref().map(|(l, _)| l)
    }

    /// Path and timeout of this callout: the lease endpoint for a lease.
    pub fn route<'a>(&self, plan: &'a Plan) -> Option<(&'a str, u64)> {
        let g = plan.global.as_ref()?;
        match (&self.lease, &g.lease) {
            (Some(_), Some(lp)) => Some((lp.path.as_str(), lp.max_wait_ms)),
            _ => Some((g.path.as_str(), g.timeout_ms)),
        }
    }
}

/// The first step for a request.
// `Done` is the common case; boxing it would allocate on every request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Decided without the gateway.
    Done(Outcome),
    /// Call the gateway, then [`finish`].
    Call(Box<Pending>),
}

/// Two uniform numbers in `[0, 1)` from one random `u64`: one spreads
/// `Retry-After`, the other places a block's end.
fn units(random: u64) -> (f64, f64) {
    let hi = (random >> 32) as f64 / 4_294_967_296.0;
    let lo = (random & 0xffff_ffff) as f64 / 4_294_967_296.0;
    (hi, lo)
}

struct Ctx<'a, S> {
    plan: &'a Plan,
    store: &'a S,
    now_ns: u64,
    random: u64,
    counts: Counts,
    error: Option<LimitError>,
    shadow_denied: Vec<String>,
}

impl<S: SharedStore> Ctx<'_, S> {
    /// Charges `buckets`; `Ok(reports)` when allowed, `Err(verdict)` when the request must be refused.
    fn charge(&mut self, buckets: &[Bucket]) -> Result<Vec<Report>, Verdict> {
        if buckets.is_empty() {
            return Ok(Vec::new());
        }
        let mut stats = Stats::default();
        let spread = units(self.random).1;
        let result = limiter::check_and_consume(
            self.store,
            self.plan,
            buckets,
            self.now_ns,
            spread,
            &mut stats,
        );
        self.counts.stats(&stats);
        match result {
            Ok(Decision::Allowed(reports)) => Ok(reports),
            Ok(Decision::Denied(reports)) => Err(self.too_many(&reports)),
            Err(e) => {
                self.counts.add(Metric::Errors, 1);
                self.error = Some(e);
                match self.plan.on_error {
                    OnError::Allow => Ok(Vec::new()),
                    OnError::Deny => {
                        let body = problem::too_many_requests(&self.plan.problem_type, 1, &[]);
                        Err(reject(429, Vec::new(), Some(1), body))
                    }
                }
            }
        }
    }

    /// Charges buckets that only watch; what they would have denied is noted.
    fn watch(&mut self, buckets: &[Bucket]) -> Vec<Report> {
        if buckets.is_empty() {
            return Vec::new();
        }
        let mut stats = Stats::default();
        let result = limiter::check_and_consume(
            self.store,
            self.plan,
            buckets,
            self.now_ns,
            0.0,
            &mut stats,
        );
        self.counts.stats(&stats);
        match result {
            Ok(Decision::Allowed(reports)) => reports,
            Ok(Decision::Denied(reports)) => {
                self.note_shadow(&reports);
                reports
            }
            Err(e) => {
                self.counts.add(Metric::Errors, 1);
                self.error = Some(e);
                Vec::new()
            }
        }
    }

    fn note_shadow(&mut self, reports: &[Report]) {
        self.counts.add(Metric::ShadowDenied, 1);
        for name in headers::violated(self.plan, reports) {
            self.shadow_denied.push(name.to_string());
        }
    }

    fn give_back(&mut self, l: &Lease) {
        if let Err(e) = lease::give_back(self.store, l, l.bucket.cost) {
            self.counts.add(Metric::Errors, 1);
            self.error = Some(e);
        }
    }

    fn refund(&mut self, buckets: &[Bucket], charged_at_ns: u64) {
        if let Err(e) = limiter::refund(self.store, self.plan, buckets, charged_at_ns) {
            self.counts.add(Metric::Errors, 1);
            self.error = Some(e);
        }
    }

    fn too_many(&mut self, reports: &[Report]) -> Verdict {
        let shown = headers::binding(self.plan, reports);
        let retry = shown.as_ref().map_or(1, |s| s.retry_after_secs);
        let blocked = reports.iter().any(|r| r.blocked && !r.check.allowed);
        // A block's end is already spread when the block starts; spreading its
        // Retry-After again would stretch it twice.
        let retry = if blocked {
            self.counts.add(Metric::Blocked, 1);
            retry
        } else {
            headers::jittered(retry, self.plan.retry_jitter, units(self.random).0)
        };
        let lines = shown
            .as_ref()
            .map(|s| headers::render(self.plan.header_style, s))
            .unwrap_or_default();
        let body = problem::too_many_requests(
            &self.plan.problem_type,
            retry,
            &headers::violated(self.plan, reports),
        );
        reject(429, lines, Some(retry), body)
    }

    fn quota_exhausted(&mut self, quotas: &[QuotaReport], shown: &[Report]) -> Verdict {
        self.counts.add(Metric::QuotaExhausted, 1);
        let spent: Vec<(&str, &str)> = quotas
            .iter()
            .filter(|q| !q.allowed)
            .filter_map(|q| self.plan.quotas.get(q.quota))
            .map(|q| (q.name.as_str(), q.upgrade_url.as_str()))
            .collect();
        let renews_secs = quotas
            .iter()
            .filter(|q| !q.allowed)
            .map(|q| q.reset_ms.div_ceil(1000))
            .max()
            .unwrap_or(0);
        let url = spent.first().map_or("", |(_, u)| *u);
        let names: Vec<&str> = spent.iter().map(|(n, _)| *n).collect();
        // Nothing was charged: show what is left now.
        let shown: Vec<Report> = shown
            .iter()
            .map(
                |r| match (r.enforced, self.plan.limits(r.rule, r.variant).get(r.limit)) {
                    (Some(e), _) => r.uncharged(&e.limit()),
                    (None, Some((limit, _))) => r.uncharged(limit),
                    (None, None) => *r,
                },
            )
            .collect();
        let mut lines = headers::closest(self.plan, &shown)
            .map(|s| headers::render(self.plan.header_style, &s))
            .unwrap_or_default();
        lines.push(("link", format!("<{url}>; rel=\"payment\"")));
        let body =
            problem::quota_exhausted(&self.plan.quota_problem_type, &names, url, renews_secs);
        reject(403, lines, None, body)
    }

    /// Lets the request through with the headers of the tightest limit, after
    /// the longest delay and with the warning of a graduated rule, if any.
    fn pass(&mut self, reports: &[Report]) -> Verdict {
        let mut lines = headers::closest(self.plan, reports)
            .map(|s| headers::render(self.plan.header_style, &s))
            .unwrap_or_default();
        let mut delay_ms = 0;
        let mut warn: Option<(&str, f64)> = None;
        for r in reports {
            let Some(rule) = self.plan.rules.get(r.rule) else {
                continue;
            };
            let Some(g) = &rule.graduated else { continue };
            if g.delay_at.is_some_and(|d| r.used_share > d + 1e-9) {
                delay_ms = delay_ms.max(g.delay_ms);
            }
            if g.warn_at.is_some_and(|w| r.used_share + 1e-9 >= w)
                && warn.is_none_or(|(_, u)| r.used_share > u)
            {
                warn = Some((&rule.name, r.used_share));
            }
        }
        if let Some((name, share)) = warn {
            self.counts.add(Metric::Warned, 1);
            lines.push(headers::warning(name, share));
        }
        if delay_ms > 0 {
            self.counts.add(Metric::Delayed, 1);
            return Verdict::Delay {
                ms: delay_ms,
                headers: lines,
            };
        }
        Verdict::Pass(lines)
    }

    fn unavailable(&self) -> Verdict {
        let retry = self
            .plan
            .global
            .as_ref()
            .map_or(1, |g| circuit::retry_after_secs(&g.circuit));
        reject(
            503,
            Vec::new(),
            Some(retry),
            problem::service_unavailable(retry),
        )
    }

    fn done(
        self,
        verdict: Verdict,
        bad_input: Vec<BadInput>,
        gateway_error: Option<AnswerError>,
        circuit: Transition,
    ) -> Outcome {
        let mut counts = self.counts;
        match &verdict {
            Verdict::Pass(_) | Verdict::Delay { .. } => counts.add(Metric::Allowed, 1),
            Verdict::Reject { .. } => counts.add(Metric::Denied, 1),
        }
        Outcome {
            verdict,
            counts,
            error: self.error,
            gateway_error,
            circuit,
            shadow_denied: self.shadow_denied,
            bad_input,
            lease: None,
        }
    }
}

fn reject(status: u32, mut lines: HeaderLines, retry_after: Option<u64>, body: String) -> Verdict {
    if let Some(r) = retry_after {
        lines.push(("retry-after", r.to_string()));
    }
    lines.push(("content-type", problem::CONTENT_TYPE.to_string()));
    Verdict::Reject {
        status,
        headers: lines,
        body,
    }
}

/// The longest timeout of a callout that may claim the circuit's probe.
fn longest_timeout_ms(g: &GlobalPlan) -> u64 {
    g.lease
        .as_ref()
        .map_or(g.timeout_ms, |lp| lp.max_wait_ms.max(g.timeout_ms))
}

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
            verdict: Verdict::Pass(Vec::new()),
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
    reports.extend(ctx.watch(&eval.shadow));
    if watch_fallback {
        reports.extend(ctx.watch(&eval.fallback));
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
            reports.extend(leased.unwrap_or_default());
            let v = ctx.pass(&reports);
            let mut outcome = ctx.done(v, eval.bad_input, None, Transition::None);
            outcome.lease = lease.filter(|_| served);
            Step::Done(outcome)
        }
    }
}

/// Reads the gateway's status and body for `pending` and finishes the decision.
pub fn finish(
    plan: &Plan,
    mut pending: Pending,
    status: Option<&[u8]>,
    body: &[u8],
    latency_ns: u64,
    store: &impl SharedStore,
    now_ns: u64,
) -> Outcome {
    if let Some((l, c)) = pending.lease.take() {
        let cost = l.bucket.cost;
        let mut noted = Noted {
            counts: &mut pending.counts,
            error: &mut pending.error,
        };
        let answer = lease_answer(plan, &mut noted, &l, c, cost, status, body, store, now_ns);
        return finish_with(plan, pending, answer, latency_ns, store, now_ns);
    }
    let answer = callout::parse_answer(
        plan,
        &pending.eval.global,
        &pending.eval.quotas,
        status,
        body,
    );
    finish_with(plan, pending, answer, latency_ns, store, now_ns)
}

/// Where a step notes what to count and the shared-data failure it met.
struct Noted<'a> {
    counts: &'a mut Counts,
    error: &'a mut Option<LimitError>,
}

impl Noted<'_> {
    fn failed(&mut self, e: LimitError) {
        self.counts.add(Metric::Errors, 1);
        *self.error = Some(e);
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

/// Stores a lease answer in the slot, spending `cost` of it at once, and reads
/// it as a check answer: allowed when the batch covers the cost.
#[allow(clippy::too_many_arguments)]
fn lease_answer(
    plan: &Plan,
    p: &mut Noted,
    l: &Lease,
    c: Claim,
    cost: u64,
    status: Option<&[u8]>,
    body: &[u8],
    store: &impl SharedStore,
    now_ns: u64,
) -> Result<Answer, AnswerError> {
    let lp = plan.global.as_ref().and_then(|g| g.lease.as_ref());
    let (lp, a) = match (
        lp,
        callout::parse_lease_answer(plan, l, c.want, status, body),
    ) {
        (Some(lp), Ok(a)) => (lp, a),
        (_, parsed) => {
            if let Err(e) = lease::release(store, l) {
                p.failed(e);
            }
            return Err(parsed.err().unwrap_or(AnswerError::NoAnswer));
        }
    };
    let spend = if a.granted >= cost { cost } else { 0 };
    // Nothing granted: the pool is empty until the gateway expects a token.
    let empty_ns = if a.granted == 0 {
        a.retry_after_ms.iter().max().copied().unwrap_or(0).max(1) * 1_000_000
    } else {
        0
    };
    let slot = match lease::store_grant(store, l, lp, a.granted, spend, &a.limits, empty_ns, now_ns)
    {
        Ok(slot) => slot,
        Err(e) => {
            p.failed(e);
            lease::Slot::default()
        }
    };
    let mut reports = lease::reports(plan, l, &slot, now_ns);
    if a.granted < cost {
        for (r, retry_ms) in reports.iter_mut().zip(&a.retry_after_ms) {
            r.check.allowed = false;
            r.check.retry_after_ns = (*retry_ms).max(1) * 1_000_000;
        }
    }
    Ok(Answer {
        reports,
        quotas: Vec::new(),
        clamped: a.clamped,
        mismatch: a.mismatch,
    })
}

/// A 4xx says the request was refused, not that the gateway is unwell: it
/// takes the failure mode but does not count towards opening the circuit.
fn call_result<T>(answer: &Result<T, AnswerError>, latency_ns: u64) -> CallResult {
    match answer {
        Ok(_) => CallResult::Answered { latency_ns },
        Err(AnswerError::Status(s)) if s.starts_with('4') => CallResult::Answered { latency_ns },
        Err(_) => CallResult::Failed,
    }
}

fn finish_with(
    plan: &Plan,
    p: Pending,
    answer: Result<Answer, AnswerError>,
    latency_ns: u64,
    store: &impl SharedStore,
    now_ns: u64,
) -> Outcome {
    let mut ctx = Ctx {
        plan,
        store,
        now_ns,
        random: p.random,
        counts: p.counts,
        error: p.error,
        shadow_denied: p.shadow_denied,
    };
    let eval = p.eval;
    let Some(g) = &plan.global else {
        let v = ctx.pass(&p.local_reports);
        return ctx.done(v, eval.bad_input, None, Transition::None);
    };
    let result = call_result(&answer, latency_ns);
    let transition = circuit::record(store, &g.circuit_key, &g.circuit, now_ns, result, p.probe);
    if transition == Transition::Opened {
        ctx.counts.add(Metric::CircuitOpened, 1);
    }
    match answer {
        Ok(a) => {
            ctx.counts.add(Metric::GatewayClamped, a.clamped);
            ctx.counts
                .add(Metric::PolicyMismatch, u64::from(a.mismatch));
            let mut all = p.local_reports;
            all.extend_from_slice(&a.reports);
            let rate_denied = a.reports.iter().any(|r| !r.check.allowed);
            let quota_denied = a.quotas.iter().any(|q| !q.allowed);
            let v = if eval.soft && (rate_denied || quota_denied) {
                ctx.note_shadow(&a.reports);
                ctx.pass(&all)
            } else if rate_denied {
                ctx.refund(&p.charged, p.charged_at_ns);
                ctx.too_many(&all)
            } else if quota_denied {
                ctx.refund(&p.charged, p.charged_at_ns);
                ctx.quota_exhausted(&a.quotas, &all)
            } else {
                ctx.pass(&all)
            };
            ctx.done(v, eval.bad_input, None, transition)
        }
        Err(e) => {
            ctx.counts.add(Metric::GlobalFailures, 1);
            let v = match g.failure_mode {
                FailureMode::Open => {
                    ctx.counts.add(Metric::FailOpen, 1);
                    ctx.pass(&p.local_reports)
                }
                FailureMode::Closed => {
                    ctx.counts.add(Metric::FailClosed, 1);
                    ctx.refund(&p.charged, p.charged_at_ns);
                    ctx.unavailable()
                }
                FailureMode::Local if eval.soft => {
                    ctx.counts.add(Metric::FallbackLocal, 1);
                    let mut all = p.local_reports;
                    all.extend(ctx.watch(&eval.fallback));
                    ctx.pass(&all)
                }
                FailureMode::Local => {
                    ctx.counts.add(Metric::FallbackLocal, 1);
                    match ctx.charge(&eval.fallback) {
                        Ok(r) => {
                            let mut all = p.local_reports;
                            all.extend_from_slice(&r);
                            ctx.pass(&all)
                        }
                        Err(v) => {
                            ctx.refund(&p.charged, p.charged_at_ns);
                            v
                        }
                    }
                }
            };
            ctx.done(v, eval.bad_input, Some(e), transition)
        }
    }
}

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
/// circuit lets calls through.
pub fn refresh_start(
    plan: &Plan,
    store: &impl SharedStore,
    l: &Lease,
    now_ns: u64,
) -> Option<Refresh> {
    let g = plan.global.as_ref()?;
    let lp = g.lease.as_ref()?;
    let claim = lease::claim(store, l, lp, now_ns, true).ok()??;
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
            let _ = lease::release(store, l);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::limits::store::{MemoryStore, StoreError};

    const SEC: u64 = 1_000_000_000;
    /// A random value that leaves every wait unjittered.
    const NEUTRAL: u64 = 0;
    const T0: u64 = 1_700_000_000 * SEC;

    fn plan(json: &str) -> Plan {
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [3; 16])
    }

    fn req(plan: &Plan, path: &str, client: Option<&str>) -> RequestInfo {
        let headers = plan
            .header_names
            .iter()
            .map(|n| match n.as_str() {
                ":method" => Some(b"GET".to_vec()),
                ":path" => Some(path.as_bytes().to_vec()),
                "x-client-id" => client.map(|c| c.as_bytes().to_vec()),
                _ => None,
            })
            .collect();
        RequestInfo {
            headers,
            source_address: Some(b"10.0.0.1:4000".to_vec()),
            ..RequestInfo::default()
        }
    }

    fn header<'a>(lines: &'a HeaderLines, name: &str) -> &'a str {
        lines
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or("<absent>")
    }

    fn rejected(o: &Outcome) -> (&u32, &HeaderLines, &String) {
        match &o.verdict {
            Verdict::Reject {
                status,
                headers,
                body,
            } => (status, headers, body),
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    fn passed(o: &Outcome) -> &HeaderLines {
        match &o.verdict {
            Verdict::Pass(h) => h,
            other => panic!("expected a pass, got {other:?}"),
        }
    }

    fn done(step: Step) -> Outcome {
        match step {
            Step::Done(o) => o,
            Step::Call(p) => panic!("unexpected callout {p:?}"),
        }
    }

    fn call(step: Step) -> Pending {
        match step {
            Step::Call(p) => *p,
            Step::Done(o) => panic!("expected a callout, got {o:?}"),
        }
    }

    const FIVE: &str = r#"{"domain":"d","rules":[{"name":"per-client","key":["client"],"limits":[{"requests":5,"per":"1h"}]}],
        "costs":[{"match":{"path_prefix":"/search"},"cost":2}]}"#;

    #[test]
    fn counts_down_then_rejects_with_a_problem() {
        let p = plan(FIVE);
        let s = MemoryStore::default();
        for left in (0..5).rev() {
            let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
            let h = passed(&o);
            assert_eq!(header(h, "x-ratelimit-remaining"), left.to_string());
            assert_eq!(header(h, "ratelimit-policy"), "\"per-client\";q=5;w=3600");
            assert_eq!(o.counts.get(Metric::Allowed), 1);
        }
        let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let (status, headers, body) = rejected(&o);
        assert_eq!(*status, 429);
        assert_eq!(header(headers, "retry-after"), "720");
        assert_eq!(header(headers, "content-type"), "application/problem+json");
        assert_eq!(header(headers, "x-ratelimit-remaining"), "0");
        assert_eq!(header(headers, "ratelimit"), "\"per-client\";r=0;t=3600");
        assert!(
            body.contains("\"detail\":\"Rate limit exceeded. Retry after 720 seconds.\""),
            "{body}"
        );
        assert!(body.contains("\"violated-policies\":[\"per-client\"]"));
        assert_eq!(o.counts.get(Metric::Denied), 1);
        // Another client is untouched; the IP stands in for a client without an id.
        assert!(matches!(
            done(start(&p, &req(&p, "/", Some("b")), &s, T0, NEUTRAL)).verdict,
            Verdict::Pass(_)
        ));
        assert!(matches!(
            done(start(&p, &req(&p, "/", None), &s, T0, NEUTRAL)).verdict,
            Verdict::Pass(_)
        ));
    }

    #[test]
    fn cost_is_weighted() {
        let p = plan(FIVE);
        let s = MemoryStore::default();
        let o = done(start(&p, &req(&p, "/search", Some("a")), &s, T0, NEUTRAL));
        let Verdict::Pass(h) = &o.verdict else {
            panic!()
        };
        assert_eq!(header(h, "x-ratelimit-remaining"), "3");
    }

    #[test]
    fn unmatched_requests_pass_without_headers_or_counts() {
        let p = plan(
            r#"{"domain":"d","rules":[{"name":"u","match":{"path_prefix":"/upload"},"limits":[{"requests":1,"per":1}]}]}"#,
        );
        let o = done(start(
            &p,
            &req(&p, "/other", None),
            &MemoryStore::default(),
            T0,
            NEUTRAL,
        ));
        assert_eq!(o.verdict, Verdict::Pass(Vec::new()));
        assert_eq!(o.counts, Counts::default());
    }

    struct Broken;
    impl SharedStore for Broken {
        fn get(&self, _: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            Err(StoreError(10))
        }
        fn compare_and_set(&self, _: &str, _: &[u8], _: u32) -> Result<bool, StoreError> {
            Err(StoreError(10))
        }
    }

    #[test]
    fn store_failure_takes_on_error() {
        let allow = plan(FIVE);
        let o = done(start(
            &allow,
            &req(&allow, "/", Some("a")),
            &Broken,
            T0,
            NEUTRAL,
        ));
        assert_eq!(o.verdict, Verdict::Pass(Vec::new()));
        assert_eq!(o.counts.get(Metric::Errors), 1);
        assert_eq!(o.error, Some(LimitError::Store(StoreError(10))));
        let deny = plan(&FIVE.replace("\"domain\"", "\"on_error\":\"deny\",\"domain\""));
        let o = done(start(
            &deny,
            &req(&deny, "/", Some("a")),
            &Broken,
            T0,
            NEUTRAL,
        ));
        let Verdict::Reject {
            status, headers, ..
        } = o.verdict
        else {
            panic!()
        };
        assert_eq!((status, header(&headers, "retry-after")), (429, "1"));
    }

    fn global_plan(mode: &str) -> Plan {
        plan(&format!(
            r#"{{"domain":"d","global":{{"cluster":"gw","failure_mode":"{mode}","instances":2,
                 "circuit":{{"failures":2,"cooldown_ms":3000}}}},
               "rules":[{{"name":"local","key":["client"],"limits":[{{"requests":5,"per":"1h"}}]}},
                        {{"name":"shared","scope":"global","key":["client"],"limits":[{{"requests":4,"per":"1m"}}]}}]}}"#
        ))
    }

    fn gw(allowed: bool, remaining: u64) -> Vec<u8> {
        serde_json::json!({"version":2,"allowed":allowed,"buckets":[{"limits":[
            {"requests":4,"window_ms":60000,"algorithm":"token_bucket",
             "allowed":allowed,"remaining":remaining,"reset_ms":15000,"retry_after_ms": if allowed {0} else {15000}}]}]})
        .to_string()
        .into_bytes()
    }

    /// The local bucket of client "a", seen through a plan without the global rule.
    fn local_remaining(s: &MemoryStore) -> String {
        let local = plan(
            r#"{"domain":"d","rules":[{"name":"local","key":["client"],"limits":[{"requests":5,"per":"1h"}]}]}"#,
        );
        let o = done(start(&local, &req(&local, "/", Some("a")), s, T0, NEUTRAL));
        let Verdict::Pass(h) = o.verdict else {
            panic!()
        };
        header(&h, "x-ratelimit-remaining").to_string()
    }

    #[test]
    fn global_answer_decides_and_the_tightest_limit_is_shown() {
        let p = global_plan("local");
        let s = MemoryStore::default();
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let body: serde_json::Value = serde_json::from_slice(&pending.body).unwrap();
        assert_eq!(body["buckets"][0]["key"], "shared/c=a");
        let o = finish(&p, pending, Some(b"200"), &gw(true, 1), SEC / 1000, &s, T0);
        let h = passed(&o);
        assert_eq!(header(h, "ratelimit-policy"), "\"shared\";q=4;w=60");
        assert_eq!(header(h, "x-ratelimit-remaining"), "1");
        assert_eq!(o.counts.get(Metric::GlobalCalls), 1);
    }

    #[test]
    fn global_denial_refunds_the_local_charge() {
        let p = global_plan("local");
        let s = MemoryStore::default();
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let o = finish(&p, pending, Some(b"200"), &gw(false, 0), SEC / 1000, &s, T0);
        let (status, headers, body) = rejected(&o);
        assert_eq!((*status, header(headers, "retry-after")), (429, "15"));
        assert!(body.contains("[\"shared\"]"), "{body}");
        // The local bucket was charged and refunded: the next local request sees 4 left of 5.
        assert_eq!(local_remaining(&s), "4");
    }

    #[test]
    fn a_request_abandoned_while_waiting_gives_its_local_charge_back() {
        let p = global_plan("local");
        let s = MemoryStore::default();
        for _ in 0..3 {
            let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
            assert_eq!(abandon(&p, pending, &s), Counts::default());
        }
        assert_eq!(local_remaining(&s), "4");
    }

    #[test]
    fn a_local_denial_skips_the_callout() {
        let p = global_plan("local");
        let s = MemoryStore::default();
        for _ in 0..5 {
            let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
            finish(&p, pending, Some(b"200"), &gw(true, 3), SEC / 1000, &s, T0);
        }
        let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        assert!(matches!(o.verdict, Verdict::Reject { status: 429, .. }));
        assert_eq!(o.counts.get(Metric::GlobalCalls), 0);
    }

    #[test]
    fn failure_mode_open_allows_and_counts() {
        let p = global_plan("open");
        let s = MemoryStore::default();
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let o = finish(
            &p,
            pending,
            Some(b"200"),
            b"<html>garbage",
            SEC / 1000,
            &s,
            T0,
        );
        let h = passed(&o);
        assert_eq!(header(h, "ratelimit-policy"), "\"local\";q=5;w=3600");
        assert_eq!(o.counts.get(Metric::FailOpen), 1);
        assert_eq!(o.counts.get(Metric::GlobalFailures), 1);
        assert!(matches!(o.gateway_error, Some(AnswerError::Garbled(_))));
    }

    #[test]
    fn failure_mode_closed_answers_503_and_refunds() {
        let p = global_plan("closed");
        let s = MemoryStore::default();
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let o = finish(&p, pending, None, b"", 50 * SEC / 1000, &s, T0);
        let (status, headers, body) = rejected(&o);
        assert_eq!((*status, header(headers, "retry-after")), (503, "3"));
        assert!(body.contains("Service Unavailable"));
        assert_eq!(local_remaining(&s), "4");
    }

    #[test]
    fn failure_mode_local_uses_a_share_of_the_limit_then_the_circuit_opens_and_recovers() {
        let p = global_plan("local");
        let s = MemoryStore::default();
        // Two failures: each decided locally at 4 / 2 instances = 2; the second opens the circuit.
        for expected_left in ["1", "0"] {
            let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
            let o = finish(&p, pending, Some(b"503"), b"", SEC / 1000, &s, T0);
            let h = passed(&o);
            assert_eq!(header(h, "x-ratelimit-remaining"), expected_left);
            assert_eq!(header(h, "ratelimit-policy"), "\"shared\";q=2;w=60");
        }
        // Circuit open: no callout; the local share is spent, so 429 from the stand-in.
        let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0 + SEC, NEUTRAL));
        let Verdict::Reject { status, body, .. } = &o.verdict else {
            panic!("{o:?}")
        };
        assert_eq!(*status, 429);
        assert!(body.contains("[\"shared\"]"));
        assert_eq!(o.counts.get(Metric::CircuitOpenSkips), 1);
        // After the cooldown one probe goes out; its success closes the circuit.
        let probe = call(start(
            &p,
            &req(&p, "/", Some("b")),
            &s,
            T0 + 3 * SEC,
            NEUTRAL,
        ));
        assert!(probe.probe);
        let o = finish(
            &p,
            probe,
            Some(b"200"),
            &gw(true, 3),
            SEC / 1000,
            &s,
            T0 + 3 * SEC,
        );
        assert_eq!(o.circuit, Transition::Closed);
        let next = call(start(
            &p,
            &req(&p, "/", Some("b")),
            &s,
            T0 + 3 * SEC,
            NEUTRAL,
        ));
        assert!(!next.probe);
    }

    const GRADUATED: &str = r#"{"domain":"d","response":{"retry_jitter":0},"rules":[{"name":"api","key":["client"],
        "limits":[{"requests":10,"per":"1m"}],
        "graduated":{"warn_at":0.8,"delay_at":1.0,"delay_ms":100,"reject_at":1.2,"block_at":2.0,"block_for":"5m"}}]}"#;

    #[test]
    fn graduated_warns_delays_rejects_then_blocks() {
        let p = plan(GRADUATED);
        let s = MemoryStore::default();
        let mut seen = Vec::new();
        for _ in 0..21 {
            let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
            seen.push(match &o.verdict {
                Verdict::Pass(h) => format!("pass {}", header(h, "x-ratelimit-warning")),
                Verdict::Delay { ms, headers } => {
                    format!("delay {ms} {}", header(headers, "x-ratelimit-warning"))
                }
                Verdict::Reject {
                    status, headers, ..
                } => format!("{status} {}", header(headers, "retry-after")),
            });
        }
        let mut want: Vec<String> = (0..7).map(|_| "pass <absent>".to_string()).collect();
        want.extend(
            [
                "pass \"api\";used=80",
                "pass \"api\";used=90",
                "pass \"api\";used=100",
            ]
            .map(String::from),
        );
        want.extend(["delay 100 \"api\";used=110", "delay 100 \"api\";used=120"].map(String::from));
        // Rejected from the 13th; demand (denied included) reaches 200% at the 20th: blocked for 5 minutes.
        want.extend((13..20).map(|_| "429 6".to_string()));
        want.extend(["429 300", "429 300"].map(String::from));
        assert_eq!(seen, want);
        let o = done(start(
            &p,
            &req(&p, "/", Some("a")),
            &s,
            T0 + 299 * SEC,
            NEUTRAL,
        ));
        assert!(matches!(o.verdict, Verdict::Reject { status: 429, .. }));
        assert_eq!(o.counts.get(Metric::Blocked), 1);
        // The block is over and the bucket refilled meanwhile.
        let o = done(start(
            &p,
            &req(&p, "/", Some("a")),
            &s,
            T0 + 300 * SEC,
            NEUTRAL,
        ));
        assert!(matches!(o.verdict, Verdict::Pass(_)), "{o:?}");
    }

    #[test]
    fn block_release_and_retry_after_are_jittered_within_bounds() {
        let p = plan(&GRADUATED.replace("\"retry_jitter\":0", "\"retry_jitter\":0.1"));
        let mut blocks = Vec::new();
        for (i, random) in [0u64, u64::MAX, 1 << 63 | 1 << 31].into_iter().enumerate() {
            let s = MemoryStore::default();
            let client = format!("c{i}");
            for _ in 0..19 {
                start(&p, &req(&p, "/", Some(&client)), &s, T0, random);
            }
            let o = done(start(&p, &req(&p, "/", Some(&client)), &s, T0, random));
            let Verdict::Reject { headers, .. } = &o.verdict else {
                panic!("{o:?}")
            };
            blocks.push(header(headers, "retry-after").parse::<u64>().unwrap());
        }
        // The block's end is spread within +10% (300..330 s); its Retry-After is that rest, not spread again.
        for b in &blocks {
            assert!((300..=330).contains(b), "{blocks:?}");
        }
        assert_eq!(blocks[0], 300, "no spread at the low end");
        assert_ne!(blocks[0], blocks[1]);
    }

    #[test]
    fn shadow_rules_and_soft_clients_never_reject_but_count() {
        let p = plan(
            r#"{"domain":"d","identity":{"clients":{"trial":{"soft":true}}},"rules":[
                {"name":"watch","mode":"shadow","key":["client"],"limits":[{"requests":1,"per":"1h"}]},
                {"name":"api","key":["client"],"limits":[{"requests":2,"per":"1h"}]}]}"#,
        );
        let s = MemoryStore::default();
        let first = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        assert!(first.shadow_denied.is_empty());
        let second = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let h = passed(&second);
        assert_eq!(second.shadow_denied, ["watch"]);
        assert_eq!(second.counts.get(Metric::ShadowDenied), 1);
        assert_eq!(header(h, "x-ratelimit-remaining"), "0");
        assert!(matches!(
            done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL)).verdict,
            Verdict::Reject { .. }
        ));
        for _ in 0..5 {
            let o = done(start(&p, &req(&p, "/", Some("trial")), &s, T0, NEUTRAL));
            assert!(matches!(o.verdict, Verdict::Pass(_)));
        }
    }

    #[test]
    fn unlimited_clients_pass_untouched() {
        let p = plan(
            r#"{"domain":"d","tiers":{"free":{},"staff":{"unlimited":true}},
                "identity":{"default_tier":"free","clients":{"ops":{"tier":"staff"}}},
                "rules":[{"name":"api","key":["client"],"limits":[{"requests":1,"per":"1h"}]}]}"#,
        );
        let s = MemoryStore::default();
        for _ in 0..3 {
            let o = done(start(&p, &req(&p, "/", Some("ops")), &s, T0, NEUTRAL));
            assert_eq!(o.verdict, Verdict::Pass(Vec::new()));
            assert_eq!(o.counts.get(Metric::Unlimited), 1);
        }
    }

    const QUOTA: &str = r#"{"domain":"d","global":{"cluster":"gw"},"tiers":{"free":{}},"identity":{"default_tier":"free"},
        "rules":[{"name":"burst","key":["client"],"limits":[{"requests":5,"per":"1h"}]}],
        "quotas":[{"name":"monthly","key":["client"],"period":"month","tiers":{"free":3},"upgrade_url":"https://e.com/up"}]}"#;

    fn quota_answer(quota_ok: bool) -> Vec<u8> {
        serde_json::json!({"version":2,"allowed":quota_ok,"buckets":[],
            "quotas":[{"limit":3,"period":"month","allowed":quota_ok,"remaining":0,"reset_ms":86_400_000}]})
        .to_string()
        .into_bytes()
    }

    #[test]
    fn a_spent_quota_is_a_403_with_the_upgrade_link_and_no_retry_after() {
        let p = plan(QUOTA);
        let s = MemoryStore::default();
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let body: serde_json::Value = serde_json::from_slice(&pending.body).unwrap();
        assert_eq!(
            body["quotas"],
            // The quota and the tier by name: the gateway's policy has the amount.
            serde_json::json!([{"quota":"monthly","key":"monthly/c=a","tag":"c=a","variant":"tier:free","amount":1}])
        );
        let o = finish(
            &p,
            pending,
            Some(b"200"),
            &quota_answer(false),
            SEC / 1000,
            &s,
            T0,
        );
        let (status, headers, body) = rejected(&o);
        assert_eq!(*status, 403);
        assert_eq!(header(headers, "retry-after"), "<absent>");
        assert_eq!(
            header(headers, "link"),
            "<https://e.com/up>; rel=\"payment\""
        );
        assert!(
            body.contains("\"upgrade_url\":\"https://e.com/up\""),
            "{body}"
        );
        assert!(body.contains("tag:ratelimit-wasm,2026:quota-exhausted"));
        assert_eq!(o.counts.get(Metric::QuotaExhausted), 1);
        // The local charge was refunded: 5 local requests still pass the burst rule.
        for _ in 0..5 {
            let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
            let o = finish(
                &p,
                pending,
                Some(b"200"),
                &quota_answer(true),
                SEC / 1000,
                &s,
                T0,
            );
            assert!(matches!(o.verdict, Verdict::Pass(_)), "{o:?}");
        }
        // Out of rate limit: 429, before the gateway is asked.
        let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        assert!(matches!(o.verdict, Verdict::Reject { status: 429, .. }));
    }

    #[test]
    fn a_refused_request_takes_the_failure_mode_but_does_not_open_the_circuit() {
        let p = global_plan("open");
        let s = MemoryStore::default();
        for _ in 0..3 {
            let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
            let o = finish(&p, pending, Some(b"400"), b"{}", SEC / 1000, &s, T0);
            assert!(matches!(o.verdict, Verdict::Pass(_)));
            assert_eq!(o.counts.get(Metric::FailOpen), 1);
            assert_eq!(o.circuit, Transition::None);
        }
        // Still calling: two failures of any other kind would have opened it.
        call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    }

    fn lease_answer_body(granted: u64, retry_after_ms: u64) -> Vec<u8> {
        serde_json::json!({"version": 2, "granted": granted,
            "limits": [{"requests": 100, "window_ms": 60_000,
                        "remaining": 50, "reset_ms": 1000, "retry_after_ms": retry_after_ms}]})
        .to_string()
        .into_bytes()
    }

    #[test]
    fn a_lease_serves_locally_gives_back_on_a_local_denial_and_an_empty_pool_refuses_here() {
        let p = plan(
            r#"{"domain":"d","global":{"cluster":"gw","failure_mode":"closed","lease":{"fraction":0.04}},
               "rules":[{"name":"local","key":["client"],"limits":[{"requests":3,"per":"1h"}]},
                        {"name":"shared","scope":"global","key":["client"],"limits":[{"requests":100,"per":"1m"}]}]}"#,
        );
        let s = MemoryStore::default();
        let r = req(&p, "/", Some("ann"));
        // The first request fetches a batch of 4 and spends 1.
        let pending = call(start(&p, &r, &s, T0, NEUTRAL));
        assert_eq!(pending.route(&p), Some(("/v1/lease", 20)));
        let body: serde_json::Value = serde_json::from_slice(&pending.body).unwrap();
        assert_eq!(
            (body["want"].as_u64(), body["return"].as_u64()),
            (Some(4), Some(0))
        );
        let o = finish(
            &p,
            pending,
            Some(b"200"),
            &lease_answer_body(4, 0),
            0,
            &s,
            T0,
        );
        assert!(matches!(o.verdict, Verdict::Pass(_)), "{o:?}");
        // Two more from the batch, no callout; the local rule (3/h) then denies and the
        // lease token it took goes back.
        for _ in 0..2 {
            let o = done(start(&p, &r, &s, T0, NEUTRAL));
            assert!(matches!(o.verdict, Verdict::Pass(_)), "{o:?}");
            assert_eq!(o.counts.get(Metric::LeaseServed), 1);
        }
        let o = done(start(&p, &r, &s, T0, NEUTRAL));
        assert_eq!(rejected(&o).0, &429);
        let other = req(&p, "/", Some("bob"));
        let pending = call(start(&p, &other, &s, T0, NEUTRAL));
        // Bob's pool is empty for 7 s: refused here, with that wait, without a callout.
        let o = finish(
            &p,
            pending,
            Some(b"200"),
            &lease_answer_body(0, 7000),
            0,
            &s,
            T0,
        );
        assert_eq!(header(rejected(&o).1, "retry-after"), "7");
        let o = done(start(&p, &other, &s, T0 + SEC, NEUTRAL));
        assert_eq!(header(rejected(&o).1, "retry-after"), "6");
        assert_eq!(o.counts.get(Metric::GlobalCalls), 0);
        // Ann's slot still holds the token given back: 1 left.
        let l = crate::global::lease::locate(&p, &p.evaluate(&r).global[0]).unwrap();
        let (bytes, _) = s.get(&l.slot_key).unwrap().unwrap();
        assert_eq!(
            crate::global::lease::Slot::decode(&bytes).unwrap().tokens,
            1
        );
    }
}
