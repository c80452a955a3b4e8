//! The gateway protocol, filter side: the `POST /v1/check` and `/v1/lease`
//! bodies for a request's global buckets and quotas (identifiers only, in
//! the types of `ratelimit-protocol`), and a distrustful reading of the
//! answers, whose limits (the gateway's policy) are the ones shown.

use crate::global::lease::Lease;
use crate::limits::limiter::{Enforced, Report, Seen};
use crate::policy::plan::{GlobalBucket, Plan, QuotaBucket, RulePlan};
use ratelimit_protocol::{
    Algorithm, BatchResponse, BucketRef, Check, CheckRequest, CheckResponse, LeaseRequest,
    LeaseResponse, QuotaRef, Stage, BATCH_VERSION, MAX_DELAY_MS, MAX_LIMITS, MAX_QUOTA_LIMIT,
    MAX_SHARE,
};

/// Protocol version spoken by this filter.
pub const VERSION: u32 = ratelimit_protocol::VERSION;

/// The JSON body asking the gateway to check and charge every bucket at its
/// cost, and every quota by its amount, all or nothing; under `reservation`
/// the gateway keeps what it charged for the request's settlement.
pub fn encode_request(
    plan: &Plan,
    global: &[GlobalBucket],
    quotas: &[QuotaBucket],
    reservation: Option<&str>,
) -> Vec<u8> {
    let c = check(plan, global, quotas, reservation);
    let body = CheckRequest {
        version: VERSION,
        domain: plan.domain.clone(),
        buckets: c.buckets,
        quotas: c.quotas,
        reservation: c.reservation,
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

/// One check of a batch (protocol version 3): what [`encode_request`]
/// asks, without the version and domain the batch gives once. The host
/// joins these into a batch body ([`crate::global::coalesce`]).
pub fn encode_check(
    plan: &Plan,
    global: &[GlobalBucket],
    quotas: &[QuotaBucket],
    reservation: Option<&str>,
) -> Vec<u8> {
    serde_json::to_vec(&check(plan, global, quotas, reservation)).unwrap_or_default()
}

/// The wire form of a check of `global` and `quotas`.
fn check(
    plan: &Plan,
    global: &[GlobalBucket],
    quotas: &[QuotaBucket],
    reservation: Option<&str>,
) -> Check {
    Check {
        buckets: global
            .iter()
            .filter_map(|g| bucket_ref(plan, g, g.cost))
            .collect(),
        quotas: quotas
            .iter()
            .filter_map(|q| quota_ref(plan, q, q.amount))
            .collect(),
        reservation: reservation.map(str::to_string),
    }
}

/// The wire form of a global bucket at `cost`; `None` (left out) for a
/// bucket of an unknown rule or variant.
pub fn bucket_ref(plan: &Plan, g: &GlobalBucket, cost: u64) -> Option<BucketRef> {
    let rule = plan.rules.get(g.rule)?;
    Some(BucketRef {
        rule: rule.name.clone(),
        key: g.key.clone(),
        tag: g.tag.clone(),
        variant: rule.variants.get(g.variant)?.wire.clone(),
        cost,
    })
}

/// The wire form of a quota counting `amount`; `None` for an unknown quota.
pub fn quota_ref(plan: &Plan, q: &QuotaBucket, amount: u64) -> Option<QuotaRef> {
    Some(QuotaRef {
        quota: plan.quotas.get(q.quota)?.name.clone(),
        key: q.key.clone(),
        tag: q.tag.clone(),
        variant: q.variant.clone(),
        amount,
    })
}

/// Why an answer was not usable; each is a gateway failure for the failure mode.
#[derive(Debug, Clone, PartialEq)]
pub enum AnswerError {
    /// No answer: timeout, reset, or the cluster is unknown.
    NoAnswer,
    /// An HTTP status other than 200.
    Status(String),
    /// The body is not the expected JSON.
    Garbled(String),
    /// Another protocol version.
    Version(u32),
    /// Buckets or limits do not line up with what was asked, or `allowed` contradicts them.
    Inconsistent(String),
    /// The gateway could not decide this check of a batch (its own words,
    /// e.g. the domain's key budget).
    Refused(String),
}

impl std::fmt::Display for AnswerError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            AnswerError::NoAnswer => write!(f, "no answer (timeout or connection failure)"),
            AnswerError::Status(s) => write!(f, "HTTP status {s}"),
            AnswerError::Garbled(e) => write!(f, "unreadable answer: {e}"),
            AnswerError::Version(v) => write!(f, "protocol version {v}, expected {VERSION}"),
            AnswerError::Inconsistent(e) => write!(f, "inconsistent answer: {e}"),
            AnswerError::Refused(e) => write!(f, "check not decided: {e:.200}"),
        }
    }
}

/// One quota's state after the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaReport {
    /// Index into [`Plan::quotas`].
    pub quota: usize,
    /// The request fits in the quota.
    pub allowed: bool,
    /// Amount left in the period.
    pub remaining: u64,
    /// Milliseconds until the period ends.
    pub reset_ms: u64,
}

/// A usable answer: one report per limit of every global bucket, one per
/// quota, and how many figures were out of range and clamped.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// Reports, in the order of the request's global buckets and their limits.
    pub reports: Vec<Report>,
    /// Quota reports, in the order of the request's quotas.
    pub quotas: Vec<QuotaReport>,
    /// Figures outside what the limit allows, clamped.
    pub clamped: u64,
    /// The gateway enforced other limits (or quota amounts, periods) than
    /// this filter's configuration: its own apply, and are shown.
    pub mismatch: bool,
    /// What the gateway's policy holds apart, as it said; empty for most
    /// answers.
    pub apart: Apart,
}

/// The buckets of an answer that the gateway's policy holds apart from
/// plain enforcement, and the graduated stage they reached.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Apart {
    /// Rules (plan indexes) whose buckets the gateway watches (a shadow
    /// rule, a soft client): their denials deny nothing.
    pub watched: Vec<usize>,
    /// Rules whose buckets are watched or graduated: never remembered by the
    /// deny cache (a graduated bucket counts every request's demand).
    pub uncached: Vec<usize>,
    /// The longest delay a graduated stage asks, in ms.
    pub delay_ms: u64,
    /// The rule and share in use of the highest warning a stage asks.
    pub warn: Option<(usize, f64)>,
}

impl Apart {
    /// Whether `rule`'s denials deny nothing.
    pub fn watches(&self, rule: usize) -> bool {
        self.watched.contains(&rule)
    }

    /// Notes a bucket of `rule` the gateway holds as `watched` or with
    /// `stage` (figures as the answer gave them; the first limit of
    /// `requests` is the stage's); returns whether its first report is a
    /// block, and the share in use.
    fn note(
        &mut self,
        rule: usize,
        watched: bool,
        stage: Option<&Stage<f64>>,
        requests: u64,
        clamped: &mut u64,
    ) -> (bool, f64) {
        if watched {
            self.watched.push(rule);
        }
        if !watched && stage.is_none() {
            return (false, 0.0);
        }
        self.uncached.push(rule);
        let Some(stage) = stage else {
            return (false, 0.0);
        };
        let most = (requests as f64 * MAX_SHARE) as u64;
        let used = clamp(stage.used, most, clamped);
        let share = used as f64 / requests.max(1) as f64;
        self.delay_ms = self
            .delay_ms
            .max(clamp(stage.delay_ms, MAX_DELAY_MS, clamped));
        if stage.warn && self.warn.is_none_or(|(_, u)| share > u) {
            self.warn = Some((rule, share));
        }
        (stage.blocked, share)
    }
}

/// Longest calendar period (a 31-day month), for clamping quota resets.
const MAX_PERIOD_MS: u64 = 31 * 86_400_000;

fn clamp(v: f64, max: u64, clamped: &mut u64) -> u64 {
    if !v.is_finite() || v < 0.0 || v > max as f64 {
        *clamped += 1;
    }
    if v.is_finite() && v > 0.0 {
        (v as u64).min(max)
    } else {
        0
    }
}

const MS: u64 = 1_000_000;

/// A gRPC call's outcome as the HTTP status it stands for, as the answer
/// readers take a status: `None` for no answer (the call's timeout, or a
/// status no route of the gateway gives).
pub fn grpc_outcome(grpc_status: u32) -> Option<Vec<u8>> {
    ratelimit_protocol::grpc::http_status(grpc_status).map(|s| s.to_string().into_bytes())
}

/// A 200 answer of this version, read as `T`, or why not.
pub(crate) fn read_body<T: serde::de::DeserializeOwned>(
    status: Option<&[u8]>,
    body: &[u8],
    version: fn(&T) -> u32,
) -> Result<T, AnswerError> {
    read_versioned(status, body, version, VERSION)
}

/// A 200 answer of version `expected`, read as `T`, or why not.
fn read_versioned<T: serde::de::DeserializeOwned>(
    status: Option<&[u8]>,
    body: &[u8],
    version: fn(&T) -> u32,
    expected: u32,
) -> Result<T, AnswerError> {
    match status {
        None => return Err(AnswerError::NoAnswer),
        Some(b"200") => {}
        Some(other) => {
            return Err(AnswerError::Status(
                String::from_utf8_lossy(other).into_owned(),
            ))
        }
    }
    let answer: T =
        serde_json::from_slice(body).map_err(|e| AnswerError::Garbled(e.to_string()))?;
    match version(&answer) {
        v if v == expected => Ok(answer),
        v => Err(AnswerError::Version(v)),
    }
}

/// A batch answer split into its checks' answers, in the order asked: the
/// whole batch fails (each check by its own failure mode) when the call
/// did, or when the answer is not one result per check asked.
pub fn read_batch(
    status: Option<&[u8]>,
    body: &[u8],
    asked: usize,
) -> Result<Vec<Result<CheckResponse<f64>, AnswerError>>, AnswerError> {
    let batch: BatchResponse<f64> = read_versioned(
        status,
        body,
        |b: &BatchResponse<f64>| b.version,
        BATCH_VERSION,
    )?;
    if batch.results.len() != asked {
        return Err(AnswerError::Inconsistent(format!(
            "{} results for {asked} checks",
            batch.results.len()
        )));
    }
    let one = |r: ratelimit_protocol::CheckResult<f64>| match r.error {
        Some(e) => Err(AnswerError::Refused(e)),
        None => Ok(CheckResponse {
            version: VERSION,
            allowed: r.allowed,
            buckets: r.buckets,
            quotas: r.quotas,
        }),
    };
    Ok(batch.results.into_iter().map(one).collect())
}

/// The longest window a configuration can give, in ms (366 days): waits of
/// twice that stay far within a u64 of nanoseconds.
const MAX_WINDOW_MS: u64 = crate::config::duration::MAX_SECONDS * 1000;

/// An enforced limit as the answer states it, or why it is unusable: a
/// limit no configuration could give (0, a fraction, more than
/// `MAX_REQUESTS` per window, a window over 366 days).
fn enforced(requests: f64, window_ms: f64) -> Result<Enforced, AnswerError> {
    let whole = |v: f64, max: u64| v.is_finite() && v >= 1.0 && v <= max as f64 && v.fract() == 0.0;
    if !whole(requests, crate::config::MAX_REQUESTS) || !whole(window_ms, MAX_WINDOW_MS) {
        return Err(AnswerError::Inconsistent(format!(
            "enforced limit {requests} per {window_ms} ms"
        )));
    }
    Ok(Enforced {
        requests: requests as u64,
        window_ms: window_ms as u64,
    })
}

/// Whether the gateway enforced what this filter's configuration says for
/// limit `i` of `rule`'s `variant`: the same figures, and the same algorithm
/// for a rate limit, or a concurrency limit for a concurrency rule.
fn agrees(
    rule: &RulePlan,
    variant: usize,
    i: usize,
    e: Enforced,
    (algorithm, in_flight): (Algorithm, bool),
) -> bool {
    rule.limits(variant).get(i).is_some_and(|(l, _)| {
        l.capacity == e.requests
            && l.period_ns == e.window_ms.saturating_mul(MS)
            && rule.in_flight == in_flight
            && (in_flight || rule.algorithm == algorithm)
    })
}

/// Reads the gateway's answer to a request for `global`. The limits are the
/// ones the gateway enforced (its policy); where they differ from this
/// filter's, `Answer::mismatch` says so. Figures are clamped to what the
/// enforced limit makes possible: remaining within 0..=requests, waits
/// within two windows.
pub fn parse_answer(
    plan: &Plan,
    global: &[GlobalBucket],
    quotas: &[QuotaBucket],
    status: Option<&[u8]>,
    body: &[u8],
) -> Result<Answer, AnswerError> {
    let answer = read_body(status, body, |a: &CheckResponse<f64>| a.version)?;
    interpret(plan, global, quotas, answer)
}

/// Reads one check's answer, as [`parse_answer`] does past the body.
pub fn interpret(
    plan: &Plan,
    global: &[GlobalBucket],
    quotas: &[QuotaBucket],
    answer: CheckResponse<f64>,
) -> Result<Answer, AnswerError> {
    if answer.buckets.len() != global.len() {
        return Err(AnswerError::Inconsistent(format!(
            "{} buckets for {} asked",
            answer.buckets.len(),
            global.len()
        )));
    }
    let mut reports = Vec::new();
    let mut clamped = 0;
    let mut mismatch = false;
    let mut all_allowed = true;
    let mut apart = Apart::default();
    for (asked, got) in global.iter().zip(&answer.buckets) {
        let rule = plan
            .rules
            .get(asked.rule)
            .ok_or_else(|| AnswerError::Inconsistent("unknown rule".into()))?;
        if got.limits.is_empty() || got.limits.len() > MAX_LIMITS {
            return Err(AnswerError::Inconsistent(format!(
                "{} limits for rule {:?}",
                got.limits.len(),
                rule.name
            )));
        }
        mismatch |= got.limits.len() != rule.limits(asked.variant).len();
        let watched = !got.watch.is_enforced();
        let first = reports.len();
        for (i, l) in got.limits.iter().enumerate() {
            let e = enforced(l.requests, l.window_ms)?;
            mismatch |= !agrees(rule, asked.variant, i, e, (l.algorithm, l.in_flight));
            let remaining = clamp(l.remaining, e.requests, &mut clamped);
            let reset_ms = clamp(l.reset_ms, 2 * e.window_ms, &mut clamped);
            let mut retry_ms = clamp(l.retry_after_ms, 2 * e.window_ms, &mut clamped);
            if !l.allowed && retry_ms == 0 {
                retry_ms = 1;
            }
            all_allowed &= l.allowed || watched;
            reports.push(Report {
                rule: asked.rule,
                variant: asked.variant,
                limit: i,
                used_share: 0.0,
                blocked: false,
                cost: asked.cost,
                enforced: Some(e),
                check: Seen {
                    allowed: l.allowed,
                    remaining,
                    reset_ns: reset_ms * MS,
                    retry_after_ns: if l.allowed { 0 } else { retry_ms * MS },
                },
            });
        }
        if watched || got.stage.is_some() {
            let requests = reports
                .get(first)
                .and_then(|r| r.enforced)
                .map_or(0, |e| e.requests);
            let (blocked, share) = apart.note(
                asked.rule,
                watched,
                got.stage.as_ref(),
                requests,
                &mut clamped,
            );
            if let Some(r) = reports.get_mut(first) {
                r.blocked = blocked && !r.check.allowed;
                r.used_share = share;
            }
        }
    }
    if answer.quotas.len() != quotas.len() {
        return Err(AnswerError::Inconsistent(format!(
            "{} quotas for {} asked",
            answer.quotas.len(),
            quotas.len()
        )));
    }
    let mut quota_reports = Vec::with_capacity(quotas.len());
    for (asked, got) in quotas.iter().zip(&answer.quotas) {
        all_allowed &= got.allowed;
        let limit = clamp(got.limit, MAX_QUOTA_LIMIT, &mut clamped);
        let period = plan.quotas.get(asked.quota).map(|q| q.period);
        mismatch |= limit != asked.limit || period != Some(got.period);
        quota_reports.push(QuotaReport {
            quota: asked.quota,
            allowed: got.allowed,
            remaining: clamp(got.remaining, limit, &mut clamped),
            reset_ms: clamp(got.reset_ms, MAX_PERIOD_MS, &mut clamped),
        });
    }
    if answer.allowed != all_allowed {
        return Err(AnswerError::Inconsistent(format!(
            "allowed is {} but the limits say {all_allowed}",
            answer.allowed
        )));
    }
    Ok(Answer {
        reports,
        quotas: quota_reports,
        clamped,
        mismatch,
        apart,
    })
}

/// The JSON body of `POST /v1/lease`: reserve up to `want` tokens of the
/// bucket of `lease`, after giving back `returned` unspent ones.
pub fn encode_lease(plan: &Plan, lease: &Lease, want: u64, returned: u64) -> Vec<u8> {
    let g = &lease.bucket;
    let Some(rule) = plan.rules.get(g.rule) else {
        return Vec::new();
    };
    let Some(variant) = rule.variants.get(g.variant) else {
        return Vec::new();
    };
    let body = LeaseRequest {
        version: VERSION,
        domain: plan.domain.clone(),
        rule: rule.name.clone(),
        key: g.key.clone(),
        tag: g.tag.clone(),
        variant: variant.wire.clone(),
        want,
        returned,
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

/// A usable lease answer.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseAnswer {
    /// Tokens reserved for this proxy (never above what was asked).
    pub granted: u64,
    /// Per limit: tokens the gateway has left, and ms until the limit is full.
    pub limits: Vec<(u64, u64)>,
    /// Per limit: ms until one token is free (when nothing was granted).
    pub retry_after_ms: Vec<u64>,
    /// Figures outside what the limit allows, clamped.
    pub clamped: u64,
    /// The gateway enforced other limits than this filter's configuration.
    pub mismatch: bool,
}

/// Reads the gateway's answer to a lease of `want` tokens for `lease`. The
/// batch is kept against this filter's limits (its slot has one pair per
/// limit): an answer with another number of limits is unusable, other
/// figures count as a mismatch.
pub fn parse_lease_answer(
    plan: &Plan,
    lease: &Lease,
    want: u64,
    status: Option<&[u8]>,
    body: &[u8],
) -> Result<LeaseAnswer, AnswerError> {
    let answer: LeaseResponse<f64> = read_body(status, body, |a: &LeaseResponse<f64>| a.version)?;
    let rule = plan
        .rules
        .get(lease.bucket.rule)
        .ok_or_else(|| AnswerError::Inconsistent("unknown rule".into()))?;
    let limits = rule.limits(lease.bucket.variant);
    if answer.limits.len() != limits.len() {
        return Err(AnswerError::Inconsistent(format!(
            "{} limits for a lease on {}",
            answer.limits.len(),
            limits.len()
        )));
    }
    let mut clamped = 0;
    // More than was asked would let this proxy hold more than one lease.
    let granted = clamp(answer.granted, want, &mut clamped);
    let mut out = LeaseAnswer {
        granted,
        limits: Vec::with_capacity(limits.len()),
        retry_after_ms: Vec::with_capacity(limits.len()),
        clamped: 0,
        mismatch: false,
    };
    for (i, ((limit, _), l)) in limits.iter().zip(&answer.limits).enumerate() {
        let e = enforced(l.requests, l.window_ms)?;
        // A lease is only ever of a token bucket.
        out.mismatch |= !agrees(
            rule,
            lease.bucket.variant,
            i,
            e,
            (Algorithm::TokenBucket, false),
        );
        let window_ms = limit.period_ns / MS;
        out.limits.push((
            clamp(l.remaining, limit.capacity, &mut clamped),
            clamp(l.reset_ms, 2 * window_ms, &mut clamped),
        ));
        out.retry_after_ms
            .push(clamp(l.retry_after_ms, 2 * window_ms, &mut clamped));
    }
    out.clamped = clamped;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::policy::request::RequestInfo;

    fn setup() -> (Plan, Vec<GlobalBucket>) {
        let json = r#"{"domain":"demo","global":{"cluster":"gw","lease":{"fraction":0.5}},"rules":[
            {"name":"g","scope":"global","key":["client"],"limits":[{"requests":10,"per":"1m"},{"requests":2,"per":"1s"}]}]}"#;
        let plan = Plan::compile(&config::parse(json.as_bytes()).unwrap(), [0; 16]);
        let eval = plan.evaluate(&RequestInfo::with_headers(
            &plan.header_names,
            &[(":path", b"/"), ("x-client-id", b"alice")],
        ));
        (plan, eval.global)
    }

    #[test]
    fn request_names_identifiers_only() {
        let (plan, global) = setup();
        let body: serde_json::Value =
            serde_json::from_slice(&encode_request(&plan, &global, &[], None)).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"version":2,"domain":"demo","buckets":[
                {"rule":"g","key":"g/c=alice","tag":"c=alice","variant":"default","cost":1}]})
        );
    }

    fn limit(requests: u64, window_ms: u64, v: serde_json::Value) -> serde_json::Value {
        let mut v = v;
        v["requests"] = requests.into();
        v["window_ms"] = window_ms.into();
        v["algorithm"] = "token_bucket".into();
        v
    }

    fn answer(body: serde_json::Value) -> Result<Answer, AnswerError> {
        let (plan, global) = setup();
        parse_answer(
            &plan,
            &global,
            &[],
            Some(b"200"),
            body.to_string().as_bytes(),
        )
    }

    #[test]
    fn good_answers_become_reports() {
        let a = answer(serde_json::json!({"version":2,"allowed":false,"buckets":[{"limits":[
            limit(10, 60_000, serde_json::json!({"allowed":true,"remaining":7,"reset_ms":18000,"retry_after_ms":0})),
            limit(2, 1000, serde_json::json!({"allowed":false,"remaining":0,"reset_ms":1000,"retry_after_ms":400}))]}]}))
        .unwrap();
        assert_eq!((a.clamped, a.mismatch), (0, false));
        assert_eq!(a.reports.len(), 2);
        assert_eq!(a.reports[1].check.retry_after_ns, 400 * MS);
        assert_eq!(a.reports[0].check.remaining, 7);
        assert_eq!(
            a.reports[0].enforced,
            Some(Enforced {
                requests: 10,
                window_ms: 60_000
            })
        );
    }

    #[test]
    fn the_gateways_limits_apply_and_a_difference_is_a_mismatch() {
        // The filter says 10/min and 2/s; the gateway's policy 30/min only.
        let a = answer(serde_json::json!({"version":2,"allowed":true,"buckets":[{"limits":[
            limit(30, 60_000, serde_json::json!({"allowed":true,"remaining":25,"reset_ms":10000,"retry_after_ms":0}))]}]}))
        .unwrap();
        assert!(a.mismatch);
        assert_eq!(a.reports.len(), 1);
        // 25 left is within the enforced 30: not clamped to the filter's 10.
        assert_eq!((a.reports[0].check.remaining, a.clamped), (25, 0));
        let (plan, _) = setup();
        let shown = crate::respond::headers::closest(&plan, &a.reports).unwrap();
        assert_eq!(
            (shown.quota, shown.window_secs, shown.remaining),
            (30, 60, 25)
        );
        // Same count, another window or algorithm: a mismatch too.
        for (window, algorithm) in [(30_000, "token_bucket"), (60_000, "sliding_window")] {
            let mut l = limit(
                10,
                window,
                serde_json::json!({"allowed":true,"remaining":1,"reset_ms":1,"retry_after_ms":0}),
            );
            l["algorithm"] = algorithm.into();
            let a = answer(serde_json::json!({"version":2,"allowed":true,"buckets":[{"limits":[l,
                limit(2, 1000, serde_json::json!({"allowed":true,"remaining":1,"reset_ms":1,"retry_after_ms":0}))]}]}))
            .unwrap();
            assert!(a.mismatch, "{window} {algorithm}");
        }
        // A limit of 0 or a fraction is not a limit: unusable.
        assert!(matches!(
            answer(
                serde_json::json!({"version":2,"allowed":true,"buckets":[{"limits":[
                limit(0, 1000, serde_json::json!({"allowed":true,"remaining":0,"reset_ms":1,"retry_after_ms":0}))]}]})
            ),
            Err(AnswerError::Inconsistent(_))
        ));
    }

    #[test]
    fn out_of_range_figures_are_clamped_and_counted() {
        let a = answer(serde_json::json!({"version":2,"allowed":true,"buckets":[{"limits":[
            limit(10, 60_000, serde_json::json!({"allowed":true,"remaining":1e12,"reset_ms":-5,"retry_after_ms":0})),
            limit(2, 1000, serde_json::json!({"allowed":true,"remaining":-3,"reset_ms":99999999,"retry_after_ms":0}))]}]}))
        .unwrap();
        assert_eq!(a.clamped, 4);
        assert_eq!(a.reports[0].check.remaining, 10);
        assert_eq!(a.reports[1].check.remaining, 0);
        assert_eq!(a.reports[1].check.reset_ns, 2000 * MS);
    }

    #[test]
    fn bad_answers_are_errors_not_panics() {
        let (plan, global) = setup();
        assert_eq!(
            parse_answer(&plan, &global, &[], None, b""),
            Err(AnswerError::NoAnswer)
        );
        assert_eq!(
            parse_answer(&plan, &global, &[], Some(b"503"), b"{}"),
            Err(AnswerError::Status("503".into()))
        );
        assert!(matches!(
            parse_answer(&plan, &global, &[], Some(b"200"), b"\xff garbage"),
            Err(AnswerError::Garbled(_))
        ));
        assert_eq!(
            answer(serde_json::json!({"version":1,"allowed":true,"buckets":[]})),
            Err(AnswerError::Version(1))
        );
        assert!(matches!(
            answer(serde_json::json!({"version":2,"allowed":true,"buckets":[]})),
            Err(AnswerError::Inconsistent(_))
        ));
        assert!(matches!(
            answer(serde_json::json!({"version":2,"allowed":true,"buckets":[{"limits":[]}]})),
            Err(AnswerError::Inconsistent(_))
        ));
        assert!(matches!(
            answer(
                serde_json::json!({"version":2,"allowed":true,"buckets":[{"limits":[
                limit(10, 60_000, serde_json::json!({"allowed":false,"remaining":0,"reset_ms":1,"retry_after_ms":1})),
                limit(2, 1000, serde_json::json!({"allowed":true,"remaining":0,"reset_ms":1,"retry_after_ms":0}))]}]})
            ),
            Err(AnswerError::Inconsistent(_))
        ));
    }

    #[test]
    fn lease_bodies_and_answers_are_read_distrustfully() {
        use serde_json::json;
        let (plan, global) = setup();
        let l = crate::global::lease::locate(&plan, &global[0]).unwrap();
        let body: serde_json::Value =
            serde_json::from_slice(&encode_lease(&plan, &l, 1, 2)).unwrap();
        assert_eq!(
            body,
            json!({"version": 2, "domain": "demo", "rule": "g", "key": "g/c=alice", "tag": "c=alice",
                   "variant": "default", "want": 1, "return": 2})
        );
        let read = |v: serde_json::Value| {
            parse_lease_answer(&plan, &l, 1, Some(b"200"), v.to_string().as_bytes())
        };
        let lim = |c: u64, w: u64, r: f64, t: f64, x: f64| json!({"requests": c, "window_ms": w, "remaining": r, "reset_ms": t, "retry_after_ms": x});
        let a = read(json!({"version": 2, "granted": 1,
                            "limits": [lim(10, 60_000, 8.0, 12_000.0, 0.0), lim(2, 1000, 1.0, 500.0, 0.0)]}))
        .unwrap();
        assert_eq!(
            (a.granted, a.limits.clone(), a.clamped, a.mismatch),
            (1, vec![(8, 12_000), (1, 500)], 0, false)
        );
        // More than asked, negative or out-of-window figures are clamped and counted.
        let a = read(json!({"version": 2, "granted": 5,
                            "limits": [lim(10, 60_000, -1.0, 1e12, 0.0), lim(2, 1000, 3.0, 1.0, 9e9)]}))
        .unwrap();
        assert_eq!(
            (a.granted, a.limits.clone()),
            (1, vec![(0, 120_000), (2, 1)])
        );
        assert_eq!((a.retry_after_ms.clone(), a.clamped), (vec![0, 2000], 5));
        // Other limits than this filter's: a mismatch.
        let a = read(json!({"version": 2, "granted": 1,
                            "limits": [lim(30, 60_000, 8.0, 1.0, 0.0), lim(2, 1000, 1.0, 1.0, 0.0)]}))
        .unwrap();
        assert!(a.mismatch);
        assert!(matches!(
            read(json!({"version": 2, "granted": 1, "limits": [lim(10, 60_000, 1.0, 1.0, 0.0)]})),
            Err(AnswerError::Inconsistent(_))
        ));
        assert!(matches!(
            read(json!({"version": 1, "granted": 1, "limits": []})),
            Err(AnswerError::Version(1))
        ));
        assert_eq!(
            parse_lease_answer(&plan, &l, 1, Some(b"503"), b"{}"),
            Err(AnswerError::Status("503".into()))
        );
        assert_eq!(
            parse_lease_answer(&plan, &l, 1, None, b""),
            Err(AnswerError::NoAnswer)
        );
    }

    #[test]
    fn a_grpc_outcome_reads_as_its_http_status() {
        assert_eq!(grpc_outcome(0).as_deref(), Some(&b"200"[..]));
        assert_eq!(grpc_outcome(3).as_deref(), Some(&b"400"[..]));
        assert_eq!(grpc_outcome(12).as_deref(), Some(&b"404"[..]));
        assert_eq!(grpc_outcome(14).as_deref(), Some(&b"503"[..]));
        assert_eq!(grpc_outcome(4), None, "the call's own timeout");
        assert_eq!(grpc_outcome(99), None);
        // A gateway or Envoy that cannot answer is a failure, not an answer.
        assert_eq!(
            read_batch(grpc_outcome(14).as_deref(), b"", 1),
            Err(AnswerError::Status("503".into()))
        );
        assert_eq!(
            read_batch(grpc_outcome(4).as_deref(), b"", 1),
            Err(AnswerError::NoAnswer)
        );
    }
}
