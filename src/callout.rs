//! The gateway protocol, filter side: the `POST /v1/check` body for a
//! request's global buckets, and a distrustful reading of the answer.

use crate::lease::Lease;
use crate::limiter::Report;
use crate::plan::{GlobalBucket, Plan, QuotaBucket};
use crate::token_bucket::Check;
use serde::{Deserialize, Serialize};

/// Protocol version spoken by this filter.
pub const VERSION: u32 = 1;

#[derive(Serialize)]
struct CheckRequest<'a> {
    version: u32,
    domain: &'a str,
    cost: u64,
    buckets: Vec<RequestBucket<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    quotas: Vec<RequestQuota<'a>>,
}

#[derive(Serialize)]
struct RequestBucket<'a> {
    key: &'a str,
    tag: &'a str,
    cost: u64,
    limits: Vec<RequestLimit>,
}

#[derive(Serialize)]
struct RequestQuota<'a> {
    key: &'a str,
    tag: &'a str,
    limit: u64,
    period: &'static str,
    amount: u64,
}

#[derive(Serialize)]
struct RequestLimit {
    requests: u64,
    window_ms: u64,
    algorithm: &'static str,
}

/// The limits of a global bucket as the gateway takes them.
fn request_limits(plan: &Plan, g: &GlobalBucket) -> Vec<RequestLimit> {
    let Some(rule) = plan.rules.get(g.rule) else {
        return Vec::new();
    };
    rule.limits(g.variant)
        .iter()
        .map(|(l, secs)| RequestLimit {
            requests: l.capacity,
            window_ms: secs * 1000,
            algorithm: rule.algorithm.name(),
        })
        .collect()
}

/// The JSON body asking the gateway to check and charge every bucket at its
/// cost, and every quota by its amount, all or nothing.
pub fn encode_request(
    plan: &Plan,
    cost: u64,
    global: &[GlobalBucket],
    quotas: &[QuotaBucket],
) -> Vec<u8> {
    let buckets = global
        .iter()
        .filter_map(|g| {
            // A bucket of an unknown rule is left out, not sent without limits.
            plan.rules.get(g.rule)?;
            Some(RequestBucket {
                key: &g.key,
                tag: &g.tag,
                cost: g.cost,
                limits: request_limits(plan, g),
            })
        })
        .collect();
    let quotas = quotas
        .iter()
        .filter_map(|q| {
            let quota = plan.quotas.get(q.quota)?;
            Some(RequestQuota {
                key: &q.key,
                tag: &q.tag,
                limit: q.limit,
                period: quota.period.name(),
                amount: q.amount,
            })
        })
        .collect();
    let body = CheckRequest {
        version: VERSION,
        domain: &plan.domain,
        cost,
        buckets,
        quotas,
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

#[derive(Deserialize)]
struct CheckAnswer {
    version: u32,
    allowed: bool,
    buckets: Vec<AnswerBucket>,
    #[serde(default)]
    quotas: Vec<AnswerQuota>,
}

#[derive(Deserialize)]
struct AnswerQuota {
    allowed: bool,
    remaining: f64,
    reset_ms: f64,
}

#[derive(Deserialize)]
struct AnswerBucket {
    limits: Vec<AnswerLimit>,
}

#[derive(Deserialize)]
struct AnswerLimit {
    allowed: bool,
    remaining: f64,
    reset_ms: f64,
    retry_after_ms: f64,
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
}

impl std::fmt::Display for AnswerError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            AnswerError::NoAnswer => write!(f, "no answer (timeout or connection failure)"),
            AnswerError::Status(s) => write!(f, "HTTP status {s}"),
            AnswerError::Garbled(e) => write!(f, "unreadable answer: {e}"),
            AnswerError::Version(v) => write!(f, "protocol version {v}, expected {VERSION}"),
            AnswerError::Inconsistent(e) => write!(f, "inconsistent answer: {e}"),
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

/// A 200 answer's body as `T` in this protocol version; anything else is an error.
fn read_body<T: serde::de::DeserializeOwned>(
    status: Option<&[u8]>,
    body: &[u8],
    version: fn(&T) -> u32,
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
        VERSION => Ok(answer),
        v => Err(AnswerError::Version(v)),
    }
}

/// Reads the gateway's answer to a request for `global`. Figures are clamped to
/// what the configured limit makes possible: remaining within 0..=requests,
/// waits within two windows.
pub fn parse_answer(
    plan: &Plan,
    global: &[GlobalBucket],
    quotas: &[QuotaBucket],
    status: Option<&[u8]>,
    body: &[u8],
) -> Result<Answer, AnswerError> {
    let answer: CheckAnswer = read_body(status, body, |a: &CheckAnswer| a.version)?;
    if answer.buckets.len() != global.len() {
        return Err(AnswerError::Inconsistent(format!(
            "{} buckets for {} asked",
            answer.buckets.len(),
            global.len()
        )));
    }
    let mut reports = Vec::new();
    let mut clamped = 0;
    let mut all_allowed = true;
    for (asked, got) in global.iter().zip(&answer.buckets) {
        let rule = plan
            .rules
            .get(asked.rule)
            .ok_or_else(|| AnswerError::Inconsistent("unknown rule".into()))?;
        let limits = rule.limits(asked.variant);
        if got.limits.len() != limits.len() {
            return Err(AnswerError::Inconsistent(format!(
                "{} limits for rule {:?} with {}",
                got.limits.len(),
                rule.name,
                limits.len()
            )));
        }
        for (i, ((limit, _), l)) in limits.iter().zip(&got.limits).enumerate() {
            let window_ms = limit.period_ns / MS;
            let remaining = clamp(l.remaining, limit.capacity, &mut clamped);
            let reset_ms = clamp(l.reset_ms, 2 * window_ms, &mut clamped);
            let mut retry_ms = clamp(l.retry_after_ms, 2 * window_ms, &mut clamped);
            if !l.allowed && retry_ms == 0 {
                retry_ms = 1;
            }
            all_allowed &= l.allowed;
            reports.push(Report {
                rule: asked.rule,
                variant: asked.variant,
                limit: i,
                used_share: 0.0,
                blocked: false,
                cost: asked.cost,
                check: Check {
                    allowed: l.allowed,
                    new_state: 0,
                    remaining,
                    reset_ns: reset_ms * MS,
                    retry_after_ns: if l.allowed { 0 } else { retry_ms * MS },
                },
            });
        }
    }
    if answer.quotas.len() != quotas.len() {
        return Err(AnswerError::Inconsistent(format!(
            "{} quotas for {} asked",
            answer.quotas.len(),
            quotas.len()
        )));
    }
    let quota_reports: Vec<QuotaReport> = quotas
        .iter()
        .zip(&answer.quotas)
        .map(|(asked, got)| {
            all_allowed &= got.allowed;
            QuotaReport {
                quota: asked.quota,
                allowed: got.allowed,
                remaining: clamp(got.remaining, asked.limit, &mut clamped),
                reset_ms: clamp(got.reset_ms, MAX_PERIOD_MS, &mut clamped),
            }
        })
        .collect();
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
    })
}

#[derive(Serialize)]
struct LeaseRequest<'a> {
    version: u32,
    domain: &'a str,
    key: &'a str,
    tag: &'a str,
    limits: Vec<RequestLimit>,
    want: u64,
    #[serde(rename = "return")]
    returned: u64,
}

/// The JSON body of `POST /v1/lease`: reserve up to `want` tokens of the
/// bucket of `lease`, after giving back `returned` unspent ones.
pub fn encode_lease(plan: &Plan, lease: &Lease, want: u64, returned: u64) -> Vec<u8> {
    let g = &lease.bucket;
    let body = LeaseRequest {
        version: VERSION,
        domain: &plan.domain,
        key: &g.key,
        tag: &g.tag,
        limits: request_limits(plan, g),
        want,
        returned,
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

#[derive(Deserialize)]
struct LeaseAnswerBody {
    version: u32,
    granted: f64,
    limits: Vec<LeaseAnswerLimit>,
}

#[derive(Deserialize)]
struct LeaseAnswerLimit {
    remaining: f64,
    reset_ms: f64,
    retry_after_ms: f64,
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
}

/// Reads the gateway's answer to a lease of `want` tokens for `lease`.
pub fn parse_lease_answer(
    plan: &Plan,
    lease: &Lease,
    want: u64,
    status: Option<&[u8]>,
    body: &[u8],
) -> Result<LeaseAnswer, AnswerError> {
    let answer: LeaseAnswerBody = read_body(status, body, |a: &LeaseAnswerBody| a.version)?;
    let limits = plan.limits(lease.bucket.rule, lease.bucket.variant);
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
    };
    for ((limit, _), l) in limits.iter().zip(&answer.limits) {
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
    use crate::request::RequestInfo;

    fn setup() -> (Plan, Vec<GlobalBucket>) {
        let json = r#"{"domain":"demo","global":{"cluster":"gw","lease":{"fraction":0.5}},"rules":[
            {"name":"g","scope":"global","key":["client"],"limits":[{"requests":10,"per":"1m"},{"requests":2,"per":"1s"}]}]}"#;
        let plan = Plan::compile(&config::parse(json.as_bytes()).unwrap(), [0; 16]);
        let headers = plan
            .header_names
            .iter()
            .map(|n| match n.as_str() {
                ":path" => Some(b"/".to_vec()),
                "x-client-id" => Some(b"alice".to_vec()),
                _ => None,
            })
            .collect();
        let eval = plan.evaluate(&RequestInfo {
            headers,
            ..RequestInfo::default()
        });
        (plan, eval.global)
    }

    #[test]
    fn request_names_keys_limits_and_cost() {
        let (plan, global) = setup();
        let body: serde_json::Value =
            serde_json::from_slice(&encode_request(&plan, 1, &global, &[])).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"version":1,"domain":"demo","cost":1,"buckets":[{"key":"g/c=alice","tag":"c=alice","cost":1,"limits":[
                {"requests":10,"window_ms":60000,"algorithm":"token_bucket"},
                {"requests":2,"window_ms":1000,"algorithm":"token_bucket"}]}]})
        );
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
        let a = answer(
            serde_json::json!({"version":1,"allowed":false,"buckets":[{"limits":[
            {"allowed":true,"remaining":7,"reset_ms":18000,"retry_after_ms":0},
            {"allowed":false,"remaining":0,"reset_ms":1000,"retry_after_ms":400}]}]}),
        )
        .unwrap();
        assert_eq!(a.clamped, 0);
        assert_eq!(a.reports.len(), 2);
        assert_eq!(a.reports[1].check.retry_after_ns, 400 * MS);
        assert_eq!(a.reports[0].check.remaining, 7);
    }

    #[test]
    fn out_of_range_figures_are_clamped_and_counted() {
        let a = answer(
            serde_json::json!({"version":1,"allowed":true,"buckets":[{"limits":[
            {"allowed":true,"remaining":1e12,"reset_ms":-5,"retry_after_ms":0},
            {"allowed":true,"remaining":-3,"reset_ms":99999999,"retry_after_ms":0}]}]}),
        )
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
            answer(serde_json::json!({"version":2,"allowed":true,"buckets":[]})),
            Err(AnswerError::Version(2))
        );
        assert!(matches!(
            answer(serde_json::json!({"version":1,"allowed":true,"buckets":[]})),
            Err(AnswerError::Inconsistent(_))
        ));
        assert!(matches!(
            answer(
                serde_json::json!({"version":1,"allowed":true,"buckets":[{"limits":[
                {"allowed":false,"remaining":0,"reset_ms":1,"retry_after_ms":1},
                {"allowed":true,"remaining":0,"reset_ms":1,"retry_after_ms":0}]}]})
            ),
            Err(AnswerError::Inconsistent(_))
        ));
    }

    #[test]
    fn lease_bodies_and_answers_are_read_distrustfully() {
        use serde_json::json;
        let (plan, global) = setup();
        let l = crate::lease::locate(&plan, &global[0]).unwrap();
        let body: serde_json::Value =
            serde_json::from_slice(&encode_lease(&plan, &l, 1, 2)).unwrap();
        assert_eq!(
            body,
            json!({"version": 1, "domain": "demo", "key": "g/c=alice", "tag": "c=alice",
                   "limits": [{"requests": 10, "window_ms": 60_000, "algorithm": "token_bucket"},
                              {"requests": 2, "window_ms": 1000, "algorithm": "token_bucket"}],
                   "want": 1, "return": 2})
        );
        let read = |v: serde_json::Value| {
            parse_lease_answer(&plan, &l, 1, Some(b"200"), v.to_string().as_bytes())
        };
        let limit =
            |r: f64, t: f64, w: f64| json!({"remaining": r, "reset_ms": t, "retry_after_ms": w});
        let a = read(json!({"version": 1, "granted": 1,
                            "limits": [limit(8.0, 12_000.0, 0.0), limit(1.0, 500.0, 0.0)]}))
        .unwrap();
        assert_eq!(
            (a.granted, a.limits.clone(), a.clamped),
            (1, vec![(8, 12_000), (1, 500)], 0)
        );
        // More than asked, negative or out-of-window figures are clamped and counted.
        let a = read(json!({"version": 1, "granted": 5,
                            "limits": [limit(-1.0, 1e12, 0.0), limit(3.0, 1.0, 9e9)]}))
        .unwrap();
        assert_eq!(
            (a.granted, a.limits.clone()),
            (1, vec![(0, 120_000), (2, 1)])
        );
        assert_eq!((a.retry_after_ms.clone(), a.clamped), (vec![0, 2000], 5));
        assert!(matches!(
            read(json!({"version": 1, "granted": 1, "limits": [limit(1.0, 1.0, 0.0)]})),
            Err(AnswerError::Inconsistent(_))
        ));
        assert!(matches!(
            read(json!({"version": 2, "granted": 1, "limits": []})),
            Err(AnswerError::Version(2))
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
}
