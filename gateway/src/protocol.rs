//! The wire protocol between the filter and the gateway (version 1).
//!
//! `POST /v1/check` takes a [`CheckRequest`] and answers 200 with a
//! [`CheckResponse`], 400 with an [`ErrorBody`] naming the field at fault, or
//! 503 with an [`ErrorBody`] when Redis fails or times out. `POST /v1/lease`
//! takes a [`LeaseRequest`] and answers 200 with a [`LeaseResponse`], or 400
//! and 503 as a check does.

use serde::{Deserialize, Serialize};

/// The only protocol version.
pub const VERSION: u32 = 1;
/// Most buckets in one request.
pub const MAX_BUCKETS: usize = 64;
/// Most limits in one bucket.
pub const MAX_LIMITS: usize = 8;
/// Most quotas in one request.
pub const MAX_QUOTAS: usize = 64;
/// Largest quota `limit` (the filter's `MAX_QUOTA`).
pub const MAX_QUOTA_LIMIT: u64 = 1 << 50;
/// Longest `domain`, `key` or `tag`, in bytes.
pub const MAX_NAME_BYTES: usize = 512;
/// Largest `requests × window_ms` (and `cost`): the Lua script's doubles stay
/// exact integers up to 2^53.
pub const MAX_EXACT: u64 = 1 << 53;

/// How a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// GCRA token bucket: bursts up to `requests`, refilled continuously over `window_ms`.
    TokenBucket,
    /// Sliding-window counter: about `requests` in any `window_ms`.
    SlidingWindow,
}

impl Algorithm {
    /// The name on the wire, in Redis keys and in the Lua script.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::SlidingWindow => "sliding_window",
        }
    }
}

/// One limit of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    /// Requests allowed per window (bucket capacity for the token bucket).
    pub requests: u64,
    /// Window length (time to refill an empty token bucket), in ms.
    pub window_ms: u64,
    /// How to count.
    pub algorithm: Algorithm,
}

/// A calendar period of a quota, in UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Period {
    /// A clock minute.
    Minute,
    /// A clock hour.
    Hour,
    /// A UTC day.
    Day,
    /// A UTC calendar month.
    Month,
}

impl Period {
    /// The name on the wire, in Redis keys and in the Lua script.
    pub fn name(self) -> &'static str {
        match self {
            Period::Minute => "minute",
            Period::Hour => "hour",
            Period::Day => "day",
            Period::Month => "month",
        }
    }
}

/// One quota counter: an amount per calendar period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaSpec {
    /// The counter's identity within the domain (quota and client).
    pub key: String,
    /// The cluster hash tag, as for buckets.
    pub tag: String,
    /// Amount allowed per period; 0: the quota is spent.
    pub limit: u64,
    /// The calendar period (UTC) after which the count starts again.
    pub period: Period,
    /// What this request counts against the quota.
    pub amount: u64,
}

/// One bucket: a client key and the limits that apply to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketSpec {
    /// The bucket's identity within the domain (rule and client).
    pub key: String,
    /// The cluster hash tag: every key with the same domain and tag lands in one slot.
    pub tag: String,
    /// Tokens this request spends in this bucket's limits (a rule's own
    /// cost); absent: the request's `cost`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    /// The limits, checked together.
    pub limits: Vec<LimitSpec>,
}

/// `POST /v1/check` request body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckRequest {
    /// Must be [`VERSION`].
    pub version: u32,
    /// Namespace of the keys (the filter's configured domain).
    pub domain: String,
    /// Tokens this request spends in every limit (unless a bucket has its own).
    pub cost: u64,
    /// The buckets, all charged or none (with the quotas).
    pub buckets: Vec<BucketSpec>,
    /// The quotas, charged together with the buckets, all or none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<QuotaSpec>,
}

impl BucketSpec {
    /// The cost charged in this bucket.
    pub fn cost_in(&self, request_cost: u64) -> u64 {
        self.cost.unwrap_or(request_cost)
    }
}

/// One limit's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitResult {
    /// Whether this limit alone lets `cost` through.
    pub allowed: bool,
    /// Whole tokens left after the request (before it, when this limit denies).
    pub remaining: u64,
    /// Ms until the limit no longer holds anything back (bucket full again /
    /// the current counts no longer weigh).
    pub reset_ms: u64,
    /// Ms until `cost` would pass this limit; 0 when allowed.
    pub retry_after_ms: u64,
}

/// One quota's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaResult {
    /// Whether this quota alone lets `amount` through (`count + amount ≤ limit`).
    pub allowed: bool,
    /// `limit − count` after the request when the whole check is allowed,
    /// before it otherwise; never negative.
    pub remaining: u64,
    /// Ms until the period ends (and the count starts again from 0).
    pub reset_ms: u64,
}

/// One bucket's answers, in the order of its limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketResult {
    /// One per limit of the request's bucket.
    pub limits: Vec<LimitResult>,
}

/// `POST /v1/check` 200 answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckResponse {
    /// Always [`VERSION`].
    pub version: u32,
    /// True only when every limit of every bucket and every quota passed;
    /// then all were charged.
    pub allowed: bool,
    /// One per bucket of the request, in order.
    pub buckets: Vec<BucketResult>,
    /// One per quota of the request, in order (absent when it had none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<QuotaResult>,
}

/// `POST /v1/lease` request body: reserve up to `want` tokens of one token
/// bucket at once, after giving back `return` unspent tokens of the
/// caller's previous lease. The bucket (domain, tag, key, limits) is the one
/// a [`BucketSpec`] of a check names: same Redis keys, one bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Must be [`VERSION`].
    pub version: u32,
    /// Namespace of the keys, as in a check.
    pub domain: String,
    /// The bucket's identity within the domain, as [`BucketSpec::key`].
    pub key: String,
    /// The cluster hash tag, as [`BucketSpec::tag`].
    pub tag: String,
    /// The bucket's limits, all `token_bucket`, charged together.
    pub limits: Vec<LimitSpec>,
    /// Tokens asked for (1..=2^53); capped at the smallest `requests`.
    pub want: u64,
    /// Unspent tokens of the previous lease on this bucket (0..=2^53), given
    /// back before granting; absent: 0.
    #[serde(default, rename = "return")]
    pub returned: u64,
}

/// One limit's answer to a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseLimitResult {
    /// Whole tokens left in this limit after the grant.
    pub remaining: u64,
    /// Ms until this limit is full again.
    pub reset_ms: u64,
    /// 0 when something was granted; else ms until 1 token is free in this
    /// limit (0 when one already is and another limit held the grant back).
    pub retry_after_ms: u64,
}

/// `POST /v1/lease` 200 answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseResponse {
    /// Always [`VERSION`].
    pub version: u32,
    /// Tokens granted, charged in every limit; 0 when some limit has no
    /// whole token free (then nothing is charged).
    pub granted: u64,
    /// One per limit of the request, in order.
    pub limits: Vec<LeaseLimitResult>,
}

/// The `error` of every 503: what failed in Redis (script SHA and line,
/// Redis' own message) is for the gateway's log, not for the caller.
pub const STORE_UNAVAILABLE: &str = "redis: unavailable";

/// 400 and 503 answer body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// Always [`VERSION`].
    pub version: u32,
    /// For 400: `<field path>: <reason>`; for 503: [`STORE_UNAVAILABLE`].
    pub error: String,
}

impl ErrorBody {
    /// An error body of this version.
    pub fn new(error: impl Into<String>) -> Self {
        ErrorBody {
            version: VERSION,
            error: error.into(),
        }
    }
}

/// `GET /healthz` answer body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// `ok` when Redis is up, else `unavailable`.
    pub status: String,
    /// `up` or `down`.
    pub redis: String,
}

/// Parses and validates a request body; the error is `<field path>: <reason>`.
pub fn parse(body: &[u8]) -> Result<CheckRequest, String> {
    let req: CheckRequest = decode(body)?;
    validate(&req)?;
    Ok(req)
}

/// Parses and validates a `POST /v1/lease` body; the error is
/// `<field path>: <reason>`, as for [`parse`].
pub fn parse_lease(body: &[u8]) -> Result<LeaseRequest, String> {
    let req: LeaseRequest = decode(body)?;
    validate_lease(&req)?;
    Ok(req)
}

/// Deserializes a body, naming the field at fault in the error.
fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let reason = strip_position(&inner);
        if path == "." || path == "?" || path.is_empty() {
            format!("body: {reason}")
        } else {
            format!("{path}: {reason}")
        }
    })
}

/// serde_json's message without its " at line L column C" suffix.
fn strip_position(e: &serde_json::Error) -> String {
    let full = e.to_string();
    match full.rfind(" at line ") {
        Some(i) if e.line() > 0 => full[..i].to_string(),
        _ => full,
    }
}

/// Checks the bounds serde cannot express.
pub fn validate(req: &CheckRequest) -> Result<(), String> {
    if req.version != VERSION {
        return Err(format!(
            "version: unsupported version {}, expected {VERSION}",
            req.version
        ));
    }
    name("domain", &req.domain, false)?;
    if !(1..=MAX_EXACT).contains(&req.cost) {
        return Err(format!(
            "cost: must be between 1 and 2^53, got {}",
            req.cost
        ));
    }
    // A request may carry only quotas; then it needs no bucket.
    let min_buckets = usize::from(req.quotas.is_empty());
    if req.buckets.len() < min_buckets || req.buckets.len() > MAX_BUCKETS {
        return Err(format!(
            "buckets: must hold {min_buckets} to {MAX_BUCKETS} buckets, got {}",
            req.buckets.len()
        ));
    }
    for (b, bucket) in req.buckets.iter().enumerate() {
        name(&format!("buckets[{b}].key"), &bucket.key, false)?;
        name(&format!("buckets[{b}].tag"), &bucket.tag, true)?;
        if let Some(cost) = bucket.cost {
            if !(1..=MAX_EXACT).contains(&cost) {
                return Err(format!(
                    "buckets[{b}].cost: must be between 1 and 2^53, got {cost}"
                ));
            }
        }
        if bucket.limits.is_empty() || bucket.limits.len() > MAX_LIMITS {
            return Err(format!(
                "buckets[{b}].limits: must hold 1 to {MAX_LIMITS} limits, got {}",
                bucket.limits.len()
            ));
        }
        for (l, limit) in bucket.limits.iter().enumerate() {
            limit_spec(&format!("buckets[{b}].limits[{l}]"), limit)?;
        }
    }
    if req.quotas.len() > MAX_QUOTAS {
        return Err(format!(
            "quotas: must hold at most {MAX_QUOTAS} quotas, got {}",
            req.quotas.len()
        ));
    }
    for (q, quota) in req.quotas.iter().enumerate() {
        name(&format!("quotas[{q}].key"), &quota.key, false)?;
        name(&format!("quotas[{q}].tag"), &quota.tag, true)?;
        if quota.limit > MAX_QUOTA_LIMIT {
            return Err(format!(
                "quotas[{q}].limit: must be at most 2^50 ({MAX_QUOTA_LIMIT}), got {}",
                quota.limit
            ));
        }
        if !(1..=MAX_EXACT).contains(&quota.amount) {
            return Err(format!(
                "quotas[{q}].amount: must be between 1 and 2^53, got {}",
                quota.amount
            ));
        }
    }
    Ok(())
}

/// Checks the bounds of a lease request serde cannot express.
pub fn validate_lease(req: &LeaseRequest) -> Result<(), String> {
    if req.version != VERSION {
        return Err(format!(
            "version: unsupported version {}, expected {VERSION}",
            req.version
        ));
    }
    name("domain", &req.domain, false)?;
    name("key", &req.key, false)?;
    name("tag", &req.tag, true)?;
    if req.limits.is_empty() || req.limits.len() > MAX_LIMITS {
        return Err(format!(
            "limits: must hold 1 to {MAX_LIMITS} limits, got {}",
            req.limits.len()
        ));
    }
    for (l, limit) in req.limits.iter().enumerate() {
        let at = format!("limits[{l}]");
        // Only a token bucket has tokens to hand out ahead of the requests.
        if limit.algorithm != Algorithm::TokenBucket {
            return Err(format!("{at}.algorithm: leases need token_bucket"));
        }
        limit_spec(&at, limit)?;
    }
    if !(1..=MAX_EXACT).contains(&req.want) {
        return Err(format!(
            "want: must be between 1 and 2^53, got {}",
            req.want
        ));
    }
    if req.returned > MAX_EXACT {
        return Err(format!(
            "return: must be at most 2^53, got {}",
            req.returned
        ));
    }
    Ok(())
}

/// Checks one limit; `at` is its field path.
fn limit_spec(at: &str, limit: &LimitSpec) -> Result<(), String> {
    if limit.requests < 1 {
        return Err(format!("{at}.requests: must be at least 1"));
    }
    if limit.window_ms < 1 {
        return Err(format!("{at}.window_ms: must be at least 1"));
    }
    match limit.requests.checked_mul(limit.window_ms) {
        Some(p) if p <= MAX_EXACT => Ok(()),
        _ => Err(format!(
            "{at}: requests × window_ms must be at most 2^53 (9007199254740992)"
        )),
    }
}

fn name(path: &str, value: &str, may_be_empty: bool) -> Result<(), String> {
    if value.is_empty() && !may_be_empty {
        return Err(format!("{path}: must not be empty"));
    }
    if value.len() > MAX_NAME_BYTES {
        return Err(format!(
            "{path}: must be at most {MAX_NAME_BYTES} bytes, got {}",
            value.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    fn good() -> serde_json::Value {
        serde_json::json!({
            "version": 1, "domain": "demo", "cost": 1,
            "buckets": [ { "key": "per-client/c=alice", "tag": "c=alice",
                "limits": [ { "requests": 60, "window_ms": 60000, "algorithm": "token_bucket" },
                            { "requests": 10, "window_ms": 1000, "algorithm": "sliding_window" } ] } ]
        })
    }

    fn with_quota() -> serde_json::Value {
        let mut v = good();
        v["quotas"] = serde_json::json!([
            { "key": "monthly/c=alice", "tag": "c=alice", "limit": 10000, "period": "month", "amount": 1 }
        ]);
        v
    }

    #[test]
    fn quotas_parse_and_may_stand_alone() {
        let r = parse(&body(with_quota())).unwrap();
        assert_eq!(r.quotas[0].period, Period::Month);
        assert_eq!(r.quotas[0].limit, 10000);
        // Limit 0 (spent) and the largest limit and amount are valid.
        let mut v = with_quota();
        v["quotas"][0]["limit"] = 0.into();
        v["quotas"][0]["amount"] = (1u64 << 53).into();
        parse(&body(v)).unwrap();
        let mut v = with_quota();
        v["quotas"][0]["limit"] = (1u64 << 50).into();
        parse(&body(v)).unwrap();
        // Only quotas: no bucket needed.
        let mut v = with_quota();
        v["buckets"] = serde_json::json!([]);
        let r = parse(&body(v)).unwrap();
        assert!(r.buckets.is_empty());
        // Neither: still an error.
        let mut v = good();
        v["buckets"] = serde_json::json!([]);
        v["quotas"] = serde_json::json!([]);
        assert!(parse(&body(v))
            .unwrap_err()
            .starts_with("buckets: must hold 1 to 64"));
        // Without quotas the answer carries none.
        let answer = CheckResponse {
            version: VERSION,
            allowed: true,
            buckets: vec![],
            quotas: vec![],
        };
        assert!(!serde_json::to_string(&answer).unwrap().contains("quotas"));
    }

    fn good_lease() -> serde_json::Value {
        serde_json::json!({
            "version": 1, "domain": "d", "key": "rule/client=abc", "tag": "client=abc",
            "limits": [ { "requests": 100, "window_ms": 60000, "algorithm": "token_bucket" } ],
            "want": 5, "return": 0
        })
    }

    #[test]
    fn the_lease_example_parses() {
        let r = parse_lease(&body(good_lease())).unwrap();
        assert_eq!((r.want, r.returned), (5, 0));
        assert_eq!(r.limits[0].requests, 100);
        // `return` is optional; the bounds themselves are valid.
        let mut v = good_lease();
        v.as_object_mut().unwrap().remove("return");
        assert_eq!(parse_lease(&body(v)).unwrap().returned, 0);
        let mut v = good_lease();
        v["want"] = (1u64 << 53).into();
        v["return"] = (1u64 << 53).into();
        v["tag"] = "".into();
        let r = parse_lease(&body(v)).unwrap();
        assert_eq!((r.want, r.returned), (1 << 53, 1 << 53));
        // The wire name is `return` both ways.
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"return\":9007199254740992"), "{text}");
    }

    #[test]
    fn lease_errors_name_the_field() {
        let sliding = serde_json::json!(
            { "requests": 10, "window_ms": 1000, "algorithm": "sliding_window" });
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|v| v["limits"][0]["algorithm"] = "sliding_window".into()),
                "limits[0].algorithm: leases need token_bucket",
            ),
            (
                Box::new(move |v| {
                    v["limits"].as_array_mut().unwrap().push(sliding.clone());
                }),
                "limits[1].algorithm: leases need token_bucket",
            ),
            (
                Box::new(|v| v["want"] = 0.into()),
                "want: must be between 1 and 2^53, got 0",
            ),
            (
                Box::new(|v| v["want"] = ((1u64 << 53) + 1).into()),
                "want: must be between 1 and 2^53, got 9007199254740993",
            ),
            (
                Box::new(|v| v["return"] = ((1u64 << 53) + 1).into()),
                "return: must be at most 2^53, got 9007199254740993",
            ),
            (
                Box::new(|v| v["return"] = (-1).into()),
                "return: invalid value: integer `-1`",
            ),
            (
                Box::new(|v| v["cost"] = 1.into()),
                "cost: unknown field `cost`",
            ),
            (
                Box::new(|v| v["limits"][0]["burst"] = 1.into()),
                "limits[0].burst: unknown field `burst`",
            ),
            (
                Box::new(|v| v["version"] = 2.into()),
                "version: unsupported version 2, expected 1",
            ),
            (
                Box::new(|v| v["limits"] = serde_json::json!([])),
                "limits: must hold 1 to 8 limits, got 0",
            ),
            (
                Box::new(|v| v["limits"] = serde_json::json!(vec![v["limits"][0].clone(); 9])),
                "limits: must hold 1 to 8 limits, got 9",
            ),
            (
                Box::new(|v| v["limits"][0]["requests"] = 0.into()),
                "limits[0].requests: must be at least 1",
            ),
            (
                Box::new(|v| v["limits"][0]["window_ms"] = 0.into()),
                "limits[0].window_ms: must be at least 1",
            ),
            (
                Box::new(|v| v["limits"][0]["requests"] = (1u64 << 40).into()),
                "limits[0]: requests × window_ms must be at most 2^53 (9007199254740992)",
            ),
            (
                Box::new(|v| v["limits"][0]["algorithm"] = "leaky".into()),
                "limits[0].algorithm: unknown variant `leaky`",
            ),
            (Box::new(|v| v["key"] = "".into()), "key: must not be empty"),
            (
                Box::new(|v| v["tag"] = "t".repeat(513).into()),
                "tag: must be at most 512 bytes, got 513",
            ),
            (
                Box::new(|v| v["domain"] = "".into()),
                "domain: must not be empty",
            ),
            (
                Box::new(|v| {
                    v.as_object_mut().unwrap().remove("want");
                }),
                "body: missing field `want`",
            ),
        ];
        for (change, want) in cases {
            let mut v = good_lease();
            change(&mut v);
            let err = parse_lease(&body(v)).unwrap_err();
            assert!(err.starts_with(want), "{err:?} should start with {want:?}");
        }
        // A check body is not a lease body, and the other way round.
        assert!(parse_lease(&body(good()))
            .unwrap_err()
            .starts_with("buckets: unknown field `buckets`"));
        assert!(parse(&body(good_lease()))
            .unwrap_err()
            .starts_with("key: unknown field `key`"));
    }

    #[test]
    fn the_example_parses() {
        let r = parse(&body(good())).unwrap();
        assert_eq!(r.buckets[0].limits[1].algorithm, Algorithm::SlidingWindow);
    }

    type Change = Box<dyn Fn(&mut serde_json::Value)>;

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|v| v["version"] = 2.into()), "version: "),
            (Box::new(|v| v["cost"] = 0.into()), "cost: "),
            (
                Box::new(|v| v["extra"] = 0.into()),
                "extra: unknown field `extra`",
            ),
            (
                Box::new(|v| v["buckets"][0]["limits"][1]["algorithm"] = "leaky".into()),
                "buckets[0].limits[1].algorithm: unknown variant `leaky`",
            ),
            (
                Box::new(|v| v["buckets"][0]["limits"][0]["requests"] = 0.into()),
                "buckets[0].limits[0].requests: must be at least 1",
            ),
            (
                Box::new(|v| v["buckets"][0]["limits"][0]["window_ms"] = (-1).into()),
                "buckets[0].limits[0].window_ms: invalid value",
            ),
            (
                Box::new(|v| v["buckets"][0]["limits"][0]["requests"] = (1u64 << 40).into()),
                "buckets[0].limits[0]: requests × window_ms must be at most 2^53",
            ),
            (
                Box::new(|v| v["buckets"][0]["key"] = "k".repeat(513).into()),
                "buckets[0].key: must be at most 512 bytes",
            ),
            (
                Box::new(|v| {
                    v["buckets"][0].as_object_mut().unwrap().remove("tag");
                }),
                "buckets[0]: missing field `tag`",
            ),
            (
                Box::new(|v| v["buckets"][0]["cost"] = 0.into()),
                "buckets[0].cost: must be between 1 and 2^53, got 0",
            ),
            (
                Box::new(|v| v["buckets"] = serde_json::json!([])),
                "buckets: must hold 1 to 64",
            ),
            (
                Box::new(|v| v["buckets"][0]["limits"] = serde_json::json!([])),
                "buckets[0].limits: must hold 1 to 8",
            ),
        ];
        for (change, want) in cases {
            let mut v = good();
            change(&mut v);
            let err = parse(&body(v)).unwrap_err();
            assert!(err.starts_with(want), "{err:?} should start with {want:?}");
        }
        let quota_cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|v| v["quotas"][0]["period"] = "week".into()),
                "quotas[0].period: unknown variant `week`, expected one of `minute`, `hour`, `day`, `month`",
            ),
            (
                Box::new(|v| v["quotas"][0]["limit"] = ((1u64 << 50) + 1).into()),
                "quotas[0].limit: must be at most 2^50 (1125899906842624), got 1125899906842625",
            ),
            (
                Box::new(|v| v["quotas"][0]["amount"] = 0.into()),
                "quotas[0].amount: must be between 1 and 2^53, got 0",
            ),
            (
                Box::new(|v| v["quotas"][0]["amount"] = ((1u64 << 53) + 1).into()),
                "quotas[0].amount: must be between 1 and 2^53",
            ),
            (
                Box::new(|v| v["quotas"][0]["key"] = "".into()),
                "quotas[0].key: must not be empty",
            ),
            (
                Box::new(|v| v["quotas"][0]["key"] = "k".repeat(513).into()),
                "quotas[0].key: must be at most 512 bytes, got 513",
            ),
            (
                Box::new(|v| v["quotas"][0]["tag"] = "t".repeat(513).into()),
                "quotas[0].tag: must be at most 512 bytes, got 513",
            ),
            (
                Box::new(|v| {
                    v["quotas"][0].as_object_mut().unwrap().remove("period");
                }),
                "quotas[0]: missing field `period`",
            ),
            (
                Box::new(|v| v["quotas"][0]["tier"] = "pro".into()),
                "quotas[0].tier: unknown field `tier`",
            ),
            (
                Box::new(|v| v["quotas"] = serde_json::json!(vec![v["quotas"][0].clone(); 65])),
                "quotas: must hold at most 64 quotas, got 65",
            ),
        ];
        for (change, want) in quota_cases {
            let mut v = with_quota();
            change(&mut v);
            let err = parse(&body(v)).unwrap_err();
            assert!(err.starts_with(want), "{err:?} should start with {want:?}");
        }
        let err = parse(b"{\"version\":1,").unwrap_err();
        assert!(err.starts_with("body: EOF"), "{err}");
        assert!(!err.contains("line"), "{err}");
    }
}
