//! One request from headers to the end of its stream: match, key, limit,
//! what to send, and what the request holds until it ends. Pure: the host
//! layer only fetches what a phase reads, makes the callout when told to,
//! holds delayed requests, and carries out the verdict.
//!
//! Local rules are charged first; a local denial skips the callout. When the
//! gateway then denies, the local charge is refunded, so a denied request
//! consumes nothing anywhere. Shadow rules (and every rule, for a soft client)
//! are charged as if enforced but never reject.
//!
//! `stream` holds a request's state across the host's callbacks and calls
//! the phases: `body` (a request whose reservation is read from its body,
//! or whose body asks a stream for its usage, waits for it), `local` (the
//! first step: the local charge, the lease, the circuit; `start` and
//! `abandon`), `answer` (the gateway's answer:
//! `finish`); `refresh` is the root timer's lease top-ups and `counts` the
//! metric increments. This file holds what the phases share: the verdict
//! and the context that charges, refunds and words the answers.

mod answer;
mod body;
mod counts;
mod in_flight;
mod local;
mod refresh;
mod remote;
mod settle;
mod stream;
mod tally;
pub mod why;

pub use answer::{finish, finish_reply};
pub use body::{BodyRead, BodyWait};
pub use counts::Counts;
pub use local::{abandon, start, start_evaluated};
pub use refresh::{refresh_finish, refresh_start, Refresh};
pub use settle::{framing, header_usage, ResponseHeaders, Settlement};
pub use stream::{Callout, Next, Stream};
pub use tally::{Counter, Left, Refusal, Tally};

use crate::config::{FailureMode, OnError};
use crate::global::callout::{self, Answer, AnswerError, Apart, QuotaReport};
use crate::global::circuit::{self, CallResult, Gate, Transition};
use crate::global::deny_cache;
use crate::global::lease::{self, Claim, Lease, Take};
use crate::limits::limiter::Bucket;
use crate::limits::limiter::{self, Decision, LimitError, Report, Stats};
use crate::limits::store::SharedStore;
use crate::metrics::Metric;
use crate::policy::key::BadInput;
use crate::policy::plan::{Evaluation, GlobalBucket, GlobalPlan, Plan, QuotaBucket};
use crate::policy::request::RequestInfo;
use crate::respond::headers;
use crate::respond::problem;
use ratelimit_protocol::grpc::Method;
use ratelimit_protocol::CheckResponse;

pub use crate::respond::headers::{HeaderLines, LocalHeaders, Passing};

/// What the filter does with the request.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Let it through and add these headers to the response.
    Pass(Passing),
    /// Hold it `ms` milliseconds, then let it through with these headers.
    Delay {
        /// How long to hold the request.
        ms: u64,
        /// Headers for the response.
        headers: Passing,
    },
    /// Answer it here.
    Reject {
        /// HTTP status.
        status: u32,
        /// Response headers.
        headers: LocalHeaders,
        /// Response body.
        body: String,
    },
}

impl Counts {
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
    /// The rules and quotas that refused it, and the rules that would have
    /// but only watch (shadow rules, soft clients): for the per-rule
    /// counters ([`Tally::outcome`]) and the log.
    pub refusals: Vec<Refusal>,
    /// Odd input seen while building keys.
    pub bad_input: Vec<BadInput>,
    /// The lease the request spent from: for the timer to keep topped up,
    /// and for its response to settle against. Boxed: inline it made every
    /// outcome 96 bytes larger, and every decision moves its outcome (81
    /// wasm instructions for c1).
    pub lease: Option<Box<Lease>>,
    /// What an admitted request still holds of the local charge: what the
    /// response phases settle. Empty for a refused request (refunded).
    pub held: Held,
}

impl Outcome {
    /// The names of the rules that would have denied but only watch, for
    /// the log.
    pub fn shadow_denied<'p>(&self, plan: &'p Plan) -> Vec<&'p str> {
        self.refusals
            .iter()
            .filter_map(|r| match *r {
                Refusal::ShadowDenied(n, _) => plan.rules.get(n as usize),
                Refusal::Denied(..) | Refusal::Spent(..) => None,
            })
            .map(|r| r.name.as_str())
            .collect()
    }
}

/// The local buckets a request was charged, and when: a refund finds the
/// sliding window holding the charge by its time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Held {
    /// The buckets charged.
    pub buckets: Vec<Bucket>,
    /// When they were charged.
    pub at_ns: u64,
    /// What only some requests hold; boxed so that the others move 16
    /// bytes less through every step.
    pub more: Option<Box<HeldMore>>,
}

/// What a request holds for its response phases beyond its buckets.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeldMore {
    /// The `costs` entry's `cost_from` that set the request's cost, for the
    /// buckets of rules without their own ([`Plan::meter_of`]).
    pub cost_meter: Option<usize>,
    /// The slots of its concurrency rules, given back when its stream ends.
    pub slots: Vec<in_flight::Slot>,
    /// What the gateway reserved for it, to settle from its response.
    pub remote: Option<Box<remote::Reserved>>,
}

impl Held {
    /// The `costs` entry's meter (see [`HeldMore::cost_meter`]).
    pub fn cost_meter(&self) -> Option<usize> {
        self.more.as_ref().and_then(|m| m.cost_meter)
    }

    /// The concurrency slots, taken out to be given back.
    pub fn take_slots(&mut self) -> Vec<in_flight::Slot> {
        self.more
            .as_mut()
            .map(|m| std::mem::take(&mut m.slots))
            .unwrap_or_default()
    }

    /// What the gateway reserved (see [`HeldMore::remote`]).
    pub fn remote(&self) -> Option<&remote::Reserved> {
        self.more.as_ref().and_then(|m| m.remote.as_deref())
    }

    /// The concurrency slots held.
    pub fn slots(&self) -> &[in_flight::Slot] {
        self.more.as_ref().map_or(&[], |m| m.slots.as_slice())
    }
}

/// A request waiting for the gateway.
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    /// Body of the `POST` to the gateway.
    pub body: Vec<u8>,
    /// This call is the half-open circuit's probe.
    pub probe: bool,
    held: Held,
    local_reports: Vec<Report>,
    eval: Evaluation,
    random: u64,
    counts: Counts,
    error: Option<LimitError>,
    refusals: Vec<Refusal>,
    lease: Option<(Lease, Claim)>,
    /// The id the check reserves under, when it has anything to settle.
    reservation: Option<String>,
}

impl Pending {
    /// The lease this callout fetches a batch for.
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref().map(|(l, _)| l)
    }

    /// Debt of another bucket that this callout's claim dropped.
    pub fn dropped_debt(&self) -> u64 {
        self.lease.as_ref().map_or(0, |(_, c)| c.dropped_debt)
    }

    /// Whether this check goes in a batch: coalescing is on and it is not
    /// a lease fetch (then `body` is one [`callout::encode_check`]).
    pub fn batched(&self, plan: &Plan) -> bool {
        self.lease.is_none() && plan.batch().is_some()
    }

    /// Endpoint and timeout of this callout: the lease endpoint for a lease.
    pub fn route(&self, plan: &Plan) -> Option<(Method, u64)> {
        let g = plan.global.as_ref()?;
        match (&self.lease, &g.lease) {
            (Some(_), Some(lp)) => Some((Method::Lease, lp.max_wait_ms)),
            _ => Some((Method::Check, g.timeout_ms)),
        }
    }
}

/// What reached a request waiting for the gateway.
#[derive(Debug)]
pub enum Reply<'a> {
    /// The answer to its own call (a version 2 check, a lease fetch):
    /// status (`None`: none came, or the call never left) and body.
    Own {
        /// The HTTP status.
        status: Option<&'a [u8]>,
        /// The body.
        body: &'a [u8],
    },
    /// Its part of a batch's answer ([`callout::read_batch`]); the host
    /// counted the batch call in the circuit once.
    Part(Result<CheckResponse<f64>, AnswerError>),
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
    refusals: Vec<Refusal>,
}

impl<'a, S> Ctx<'a, S> {
    fn new(plan: &'a Plan, store: &'a S, now_ns: u64, random: u64) -> Self {
        Ctx {
            plan,
            store,
            now_ns,
            random,
            counts: Counts::default(),
            error: None,
            refusals: Vec::new(),
        }
    }

    /// Notes a step's shared-data failure for the log and the metrics.
    fn failed(&mut self, e: LimitError) {
        self.counts.add(Metric::Errors, 1);
        self.error = Some(e);
    }
}

impl<'a, S: SharedStore> Ctx<'a, S> {
    /// Charges `buckets`: `Ok(Some(reports))` when allowed and charged,
    /// `Ok(None)` when shared data failed and `on_error: allow` lets the
    /// request through uncharged, `Err(verdict)` when it must be refused.
    fn charge(&mut self, buckets: &[Bucket]) -> Result<Option<Vec<Report>>, Verdict> {
        if buckets.is_empty() {
            return Ok(Some(Vec::new()));
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
            Ok(Decision::Allowed(reports)) => Ok(Some(reports)),
            Ok(Decision::Denied(reports)) => Err(self.too_many(&reports)),
            Err(e) => {
                self.failed(e);
                match self.plan.on_error {
                    OnError::Allow => Ok(None),
                    OnError::Deny => {
                        let body = problem::too_many_after(
                            &self.plan.too_many_head,
                            1,
                            std::iter::empty(),
                        );
                        Err(reject(429, LocalHeaders::default(), Some(1), body))
                    }
                }
            }
        }
    }

    /// Charges buckets that only watch and adds their reports to `into`;
    /// what they would have denied is noted. Most requests have none: that
    /// case returns here, inlined, since the call cost c1 53 instructions.
    #[inline(always)]
    fn watch(&mut self, buckets: &[Bucket], into: &mut Vec<Report>) -> bool {
        !buckets.is_empty() && self.watch_charge(buckets, into)
    }

    /// Whether the buckets were charged (they all had room).
    #[inline(never)]
    fn watch_charge(&mut self, buckets: &[Bucket], into: &mut Vec<Report>) -> bool {
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
            Ok(Decision::Allowed(reports)) => {
                into.extend(reports);
                true
            }
            Ok(Decision::Denied(reports)) => {
                self.note_shadow(&reports);
                into.extend(reports);
                false
            }
            Err(e) => {
                self.failed(e);
                false
            }
        }
    }

    fn note_shadow(&mut self, reports: &[Report]) {
        self.counts.add(Metric::ShadowDenied, 1);
        self.note_refusals(reports, Refusal::ShadowDenied);
    }

    fn give_back(&mut self, l: &Lease) {
        if let Err(e) = lease::give_back(self.store, l, l.bucket.cost) {
            self.failed(e);
        }
    }

    /// Gives back what `held` holds (the request was refused after all).
    fn refund(&mut self, held: &mut Held) {
        let buckets = std::mem::take(&mut held.buckets);
        if let Err(e) = limiter::refund(self.store, self.plan, &buckets, held.at_ns) {
            self.failed(e);
        }
        let slots = held.take_slots();
        let counts = in_flight::release(self.plan, self.store, &slots, self.now_ns);
        self.counts.merge(&counts);
    }

    /// Notes each rule with a denying report among `reports` once, as `how`.
    /// With what its first denying limit held and the request asked.
    fn note_refusals(&mut self, reports: &[Report], how: fn(u32, Left) -> Refusal) {
        let mut last = None;
        for r in reports.iter().filter(|r| !r.check.allowed) {
            if last != Some(r.rule) {
                let left = Left {
                    remaining: r.check.remaining,
                    cost: r.cost,
                };
                self.refusals
                    .push(how(u32::try_from(r.rule).unwrap_or(u32::MAX), left));
                last = Some(r.rule);
            }
        }
    }

    fn too_many(&mut self, reports: &[Report]) -> Verdict {
        self.note_refusals(reports, Refusal::Denied);
        let shown = headers::binding(self.plan, reports);
        if let Some(verdict) = never_passes(self.plan, reports, shown.as_ref()) {
            return verdict;
        }
        let retry = shown.as_ref().map_or(1, |s| s.retry_after_secs);
        let blocked = reports.iter().any(|r| r.blocked && !r.check.allowed);
        // A block's end is already spread when the block starts; spreading its
        // Retry-After again would stretch it twice.
        let retry = if blocked {
            self.counts.add(Metric::Blocked, 1);
            retry
        } else if self.plan.any_in_flight && only_slots_deny(self.plan, reports) {
            // A slot frees when a request ends, not on a schedule: no spread.
            retry
        } else {
            headers::jittered(retry, self.plan.retry_jitter, units(self.random).0)
        };
        let lines = LocalHeaders::of(self.plan, shown.as_ref(), reports);
        let body = problem::too_many_after(
            &self.plan.too_many_head,
            retry,
            headers::violated_rules(self.plan, reports).map(|r| r.name_json.as_str()),
        );
        reject(429, lines, Some(retry), body)
    }

    fn quota_exhausted(
        &mut self,
        quotas: &[QuotaReport],
        asked: &[QuotaBucket],
        shown: &[Report],
    ) -> Verdict {
        self.counts.add(Metric::QuotaExhausted, 1);
        for q in quotas.iter().filter(|q| !q.allowed) {
            let n = u32::try_from(q.quota).unwrap_or(u32::MAX);
            let cost = asked
                .iter()
                .find(|b| b.quota == q.quota)
                .map_or(0, |b| b.amount);
            let left = Left {
                remaining: q.remaining,
                cost,
            };
            self.refusals.push(Refusal::Spent(n, left));
        }
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
        // Nothing was charged: the closest is of what is left now.
        let uncharged: Vec<Report> = shown
            .iter()
            .map(|r| headers::uncharged(self.plan, r))
            .collect();
        let closest = headers::closest(self.plan, &uncharged);
        let mut lines = LocalHeaders::of(self.plan, closest.as_ref(), shown);
        lines.push("link", &format!("<{url}>; rel=\"payment\""));
        let body =
            problem::quota_exhausted(&self.plan.quota_problem_type, &names, url, renews_secs);
        reject(403, lines, None, body)
    }

    /// Lets the request through with the headers of the tightest limit, after
    /// the longest delay and with the warning of a graduated rule, if any.
    fn pass(&mut self, reports: Vec<Report>) -> Verdict {
        let (delay_ms, warn) = self.local_stages(&reports);
        self.passing(reports, delay_ms, warn)
    }

    /// [`Ctx::pass`] with the stages the gateway decided for its graduated
    /// rules (`apart`): a gateway's report is staged by the gateway alone.
    fn pass_staged(&mut self, reports: Vec<Report>, apart: &Apart) -> Verdict {
        let (local_delay, mut warn) = self.local_stages(&reports);
        let theirs = apart.warn.and_then(|(rule, share)| {
            let rule = self.plan.rules.get(rule)?;
            Some((rule.name.as_str(), share))
        });
        if let Some((name, share)) = theirs {
            if warn.is_none_or(|(_, u)| share > u) {
                warn = Some((name, share));
            }
        }
        self.passing(reports, local_delay.max(apart.delay_ms), warn)
    }

    /// The delay and the warning (rule, share in use) the reports of this
    /// filter's own graduated rules call for.
    #[inline(always)]
    fn local_stages(&self, reports: &[Report]) -> (u64, Option<(&'a str, f64)>) {
        let mut delay_ms = 0;
        let mut warn: Option<(&str, f64)> = None;
        // Without graduated rules there is nothing to look for (c1: 40 instructions).
        let graduated = if self.plan.any_graduated {
            reports
        } else {
            &[]
        };
        let plan: &'a Plan = self.plan;
        for r in graduated {
            let Some(rule) = plan.rules.get(r.rule) else {
                continue;
            };
            // A gateway's report is staged by the gateway (`pass_staged`).
            let Some(g) = rule.graduated.as_ref().filter(|_| r.enforced.is_none()) else {
                continue;
            };
            if g.delays(r.used_share) {
                delay_ms = delay_ms.max(g.delay_ms);
            }
            if g.warn_at.is_some_and(|w| r.used_share + 1e-9 >= w)
                && warn.is_none_or(|(_, u)| r.used_share > u)
            {
                warn = Some((&rule.name, r.used_share));
            }
        }
        (delay_ms, warn)
    }

    /// The passing verdict: held `delay_ms` when above 0, with the warning.
    #[inline(always)]
    fn passing(
        &mut self,
        reports: Vec<Report>,
        delay_ms: u64,
        warn: Option<(&str, f64)>,
    ) -> Verdict {
        let mut lines = Passing::of(reports);
        if let Some((name, share)) = warn {
            self.counts.add(Metric::Warned, 1);
            lines.extra.push(headers::warning(name, share));
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
            LocalHeaders::default(),
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
            refusals: self.refusals,
            bad_input,
            lease: None,
            held: Held::default(),
        }
    }
}

/// A 429 without `Retry-After` when a denying limit holds fewer tokens than
/// the request costs (a tier's or an override's smaller limit, or the
/// gateway's): no wait would let it pass. Out of line: most denials are not.
#[inline(never)]
fn never_passes(
    plan: &Plan,
    reports: &[Report],
    shown: Option<&headers::Shown>,
) -> Option<Verdict> {
    let (r, capacity) = reports.iter().filter(|r| !r.check.allowed).find_map(|r| {
        let capacity = match r.enforced {
            Some(e) => e.requests,
            None => {
                let (l, _) = plan.limits(r.rule, r.variant).get(r.limit)?;
                l.burst.max(l.capacity)
            }
        };
        (r.cost > capacity).then_some((r, capacity))
    })?;
    let rule = plan.rules.get(r.rule)?;
    let violated: Vec<&str> = headers::violated(plan, reports);
    let body = problem::never_passes(&plan.problem_type, r.cost, &rule.name, capacity, &violated);
    Some(reject(
        429,
        LocalHeaders::of(plan, shown, reports),
        None,
        body,
    ))
}

/// Every denying report is a concurrency limit's.
#[inline(never)]
fn only_slots_deny(plan: &Plan, reports: &[Report]) -> bool {
    reports
        .iter()
        .filter(|r| !r.check.allowed)
        .all(|r| plan.rules.get(r.rule).is_some_and(|x| x.in_flight))
}

fn reject(
    status: u32,
    mut headers: LocalHeaders,
    retry_after: Option<u64>,
    body: String,
) -> Verdict {
    if let Some(r) = retry_after {
        // itoa: `to_string` goes through `core::fmt`, several times the instructions.
        headers.push_named(
            headers::RETRY_AFTER,
            itoa::Buffer::new().format(r).as_bytes(),
        );
    }
    headers.push_named(headers::CONTENT_TYPE, problem::MEDIA_TYPE.as_bytes());
    Verdict::Reject {
        status,
        headers,
        body,
    }
}

/// The longest timeout of a callout that may claim the circuit's probe.
fn longest_timeout_ms(g: &GlobalPlan) -> u64 {
    g.lease
        .as_ref()
        .map_or(g.timeout_ms, |lp| lp.max_wait_ms.max(g.timeout_ms))
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

/// Counts a batch call's result in the circuit once for all its checks
/// (`probe`: one of them is the half-open circuit's probe); the counts to
/// add and the circuit's transition.
pub fn record_batch<T>(
    plan: &Plan,
    store: &impl SharedStore,
    answer: &Result<T, AnswerError>,
    latency_ns: u64,
    probe: bool,
    now_ns: u64,
) -> (Transition, Counts) {
    let mut counts = Counts::default();
    let Some(g) = &plan.global else {
        return (Transition::None, counts);
    };
    let t = record_call(g, store, answer, latency_ns, probe, now_ns);
    if t == Transition::Opened {
        counts.add(Metric::CircuitOpened, 1);
    }
    (t, counts)
}

/// Records one call's result in the circuit shared by the workers.
fn record_call<T>(
    g: &GlobalPlan,
    store: &impl SharedStore,
    answer: &Result<T, AnswerError>,
    latency_ns: u64,
    probe: bool,
    now_ns: u64,
) -> Transition {
    let result = call_result(answer, latency_ns);
    circuit::record(store, &g.circuit_key, &g.circuit, now_ns, result, probe)
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

#[cfg(test)]
mod tests;
