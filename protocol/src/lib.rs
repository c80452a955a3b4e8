//! The wire protocol between the `ratelimit-wasm` filter and
//! `ratelimit-gateway` (version 2), written once for both: the filter
//! (wasm32) writes requests and reads answers with these types, the gateway
//! reads requests and writes answers with them.
//!
//! A request names only identifiers: the domain, and per bucket the rule, the
//! key, the limits variant and the cost; per quota the quota, the key, the
//! variant and the amount. Limits, windows, algorithms, quota amounts and
//! periods are the gateway's: it resolves them from its policy (the same
//! plugin configuration the filters load) and says in the answer which limits
//! it enforced.
//!
//! `POST /v1/check` takes a [`CheckRequest`] and answers 200 with a
//! [`CheckResponse`]; `POST /v1/lease` takes a [`LeaseRequest`] and answers
//! 200 with a [`LeaseResponse`]; `POST /v1/settle` takes a
//! [`SettleRequest`] and answers 200 with a [`SettleResponse`]. All answer
//! 400 with an [`ErrorBody`] naming the field at fault, and 503 when Redis
//! fails.
//!
//! Version 3 adds the batched check: `POST /v3/check` takes a
//! [`BatchRequest`] (version [`BATCH_VERSION`]) of up to [`MAX_BATCH`]
//! checks of one domain and answers 200 with a [`BatchResponse`], one
//! [`CheckResult`] per check in order, each what `POST /v1/check` would
//! have answered for it alone. A body over [`MAX_BATCH_BYTES`] or with more
//! than [`MAX_BATCH`] checks gets 413; any check the policy cannot resolve
//! refuses the whole batch (400), and nothing is written.
//!
//! Settlement: a check that names a `reservation` id has the gateway keep,
//! when it is allowed, a record of what it charged. A later settlement of
//! that id moves each named bucket and quota from what the check charged to
//! the cost the response showed (at most the policy's `cost_from.max`), and
//! deletes the record: a settlement replayed, or of an id never reserved,
//! finds no record and changes nothing.
//!
//! How a bucket is held is the policy's alone, never the request's: an
//! answer's bucket may say it is watched ([`Watch`]: a shadow rule, a soft
//! client; its denial denies nothing) and the graduated [`Stage`] it
//! reached. Both fields are optional and absent for a plain bucket, so
//! version 2 still reads an older gateway's answers.
//!
//! The answers are generic over their figures: the gateway writes `u64`; the
//! filter reads `f64`, so that a negative or huge figure is clamped and
//! counted instead of failing the whole answer.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]
#![warn(missing_docs)]

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub mod grpc;

/// The protocol version; a request of another version gets 400 naming `version`.
pub const VERSION: u32 = 2;

/// The version of a batched check ([`BatchRequest`], `POST /v3/check`).
/// Leases and settlements keep [`VERSION`]; version 2's single check
/// (`POST /v1/check`) is still served.
pub const BATCH_VERSION: u32 = 3;
pub use ratelimit_config::bounds::{
    MAX_BATCH, MAX_BATCH_BYTES, MAX_BUCKETS, MAX_EXACT, MAX_LIMITS, MAX_NAME_BYTES, MAX_QUOTAS,
    MAX_QUOTA_LIMIT, MAX_SETTLEMENTS, RESERVATION_ID_BYTES,
};
pub use ratelimit_config::{Algorithm, Period};

/// Which set of limits (or which quota amount) applies to a client: the
/// rule's own, its tier's, or the client's override. On the wire a string:
/// `default`, `tier:<tier name>` or `client:<client id>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The rule's `limits` (the quota's `limit`).
    Default,
    /// `rules[].tiers.<name>` (the quota's `tiers.<name>`).
    Tier(String),
    /// `identity.clients.<id>.limits.<rule>` (`.quotas.<quota>`).
    Client(String),
    /// `rules[].limits_by.sets.<name>` (a quota has none).
    Set(String),
}

impl Variant {
    /// The wire form.
    pub fn encode(&self) -> String {
        match self {
            Variant::Default => "default".to_string(),
            Variant::Tier(t) => format!("tier:{t}"),
            Variant::Client(c) => format!("client:{c}"),
            Variant::Set(n) => format!("set:{n}"),
        }
    }

    /// Reads the wire form.
    pub fn decode(s: &str) -> Result<Variant, String> {
        if s == "default" {
            return Ok(Variant::Default);
        }
        let named = |rest: &str, make: fn(String) -> Variant| {
            if rest.is_empty() {
                Err(format!("`{s}` names no tier, client or set"))
            } else {
                Ok(make(rest.to_string()))
            }
        };
        if let Some(rest) = s.strip_prefix("tier:") {
            return named(rest, Variant::Tier);
        }
        if let Some(rest) = s.strip_prefix("client:") {
            return named(rest, Variant::Client);
        }
        if let Some(rest) = s.strip_prefix("set:") {
            return named(rest, Variant::Set);
        }
        Err(format!(
            "unknown variant `{s}`, expected `default`, `tier:<name>`, `client:<id>` or `set:<name>`"
        ))
    }
}

impl Serialize for Variant {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.encode())
    }
}

impl<'de> Deserialize<'de> for Variant {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Variant, D::Error> {
        let s = String::deserialize(d)?;
        Variant::decode(&s).map_err(serde::de::Error::custom)
    }
}

/// One bucket of a check: which rule, whose key, which limits, what cost.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketRef {
    /// A global rule of the domain's policy.
    pub rule: String,
    /// The bucket's identity within the domain (`<rule>/<key parts>`).
    pub key: String,
    /// The cluster hash tag: every key with the same domain and tag lands in one slot.
    pub tag: String,
    /// Which limits of the rule apply.
    pub variant: Variant,
    /// Tokens this request spends in the bucket's limits (at most what the
    /// policy's `costs` and the rule's `cost` can give).
    pub cost: u64,
}

/// One quota of a check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaRef {
    /// A quota of the domain's policy.
    pub quota: String,
    /// The counter's identity within the domain (`<quota>/<key parts>`).
    pub key: String,
    /// The cluster hash tag, as for buckets.
    pub tag: String,
    /// Which amount per period applies.
    pub variant: Variant,
    /// What this request counts: 1, or its cost for `count: cost`.
    pub amount: u64,
}

/// `POST /v1/check` request body: every bucket and quota charged together, all or nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckRequest {
    /// Must be [`VERSION`].
    pub version: u32,
    /// The policy's `domain`.
    pub domain: String,
    /// The buckets (each rule at most once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<BucketRef>,
    /// The quotas (each quota at most once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<QuotaRef>,
    /// When given, an allowed check keeps a record of its charges under this
    /// id (16 to 64 bytes of `[0-9A-Za-z_-]`) for one [`SettleRequest`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<String>,
}

/// One check of a batch: a [`CheckRequest`] without the version and the
/// domain, which the batch gives once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Check {
    /// The buckets (each rule at most once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<BucketRef>,
    /// The quotas (each quota at most once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<QuotaRef>,
    /// As [`CheckRequest::reservation`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<String>,
}

/// `POST /v3/check` request body: checks of one domain, decided one after
/// the other in this order, each all or nothing over its own buckets and
/// quotas, each answered as if it had come alone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// Must be [`BATCH_VERSION`].
    pub version: u32,
    /// The policy's `domain`, for every check.
    pub domain: String,
    /// 1 to [`MAX_BATCH`] checks. Read up to one past [`MAX_BATCH`]: the
    /// checks after that are skipped unread into memory, so a body of 10^5
    /// checks holds no more than that one over the bound.
    #[serde(deserialize_with = "checks_past_the_bound")]
    pub checks: Vec<Check>,
}

/// The checks of a batch, at most [`MAX_BATCH`] + 1 kept (the one more
/// tells [`parse_batch`] that the bound was passed).
fn checks_past_the_bound<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Check>, D::Error> {
    struct Checks;
    impl<'de> serde::de::Visitor<'de> for Checks {
        type Value = Vec<Check>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an array of checks")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Vec<Check>, A::Error> {
            let mut kept = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_BATCH + 1));
            loop {
                if kept.len() <= MAX_BATCH {
                    match seq.next_element::<Check>()? {
                        Some(c) => kept.push(c),
                        None => break,
                    }
                } else if seq.next_element::<serde::de::IgnoredAny>()?.is_none() {
                    break;
                }
            }
            Ok(kept)
        }
    }
    d.deserialize_seq(Checks)
}

/// One request's settlement: the real cost of each bucket and quota its
/// check reserved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settlement {
    /// The check's `reservation`.
    pub reservation: String,
    /// The buckets, `cost` the real cost (0 gives the whole charge back).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<BucketRef>,
    /// The quotas, `amount` the real amount.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<QuotaRef>,
}

/// `POST /v1/settle` request body: settlements of one domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleRequest {
    /// Must be [`VERSION`].
    pub version: u32,
    /// The policy's `domain`.
    pub domain: String,
    /// 1 to [`MAX_SETTLEMENTS`] settlements.
    pub settlements: Vec<Settlement>,
}

/// `POST /v1/settle` 200 answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleResponse {
    /// Always [`VERSION`].
    pub version: u32,
    /// One per settlement, in order: whether its reservation was found and
    /// settled (false: already settled, expired, or never made).
    pub settled: Vec<bool>,
}

/// `POST /v1/lease` request body: reserve up to `want` tokens of one token
/// bucket (the bucket a [`BucketRef`] with the same rule, key, tag and
/// variant names), after giving back `return` unspent tokens this caller holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Must be [`VERSION`].
    pub version: u32,
    /// The policy's `domain`.
    pub domain: String,
    /// A global token-bucket rule of the domain.
    pub rule: String,
    /// The bucket's identity, as [`BucketRef::key`].
    pub key: String,
    /// The cluster hash tag, as [`BucketRef::tag`].
    pub tag: String,
    /// Which limits of the rule apply.
    pub variant: Variant,
    /// Tokens asked for (1..=2^53); the gateway grants at most the policy's
    /// `lease.fraction` of the smallest limit.
    pub want: u64,
    /// Unspent tokens of this caller's previous lease on this bucket
    /// (0..=2^53); the gateway takes back at most what the caller holds.
    #[serde(default, rename = "return")]
    pub returned: u64,
}

/// One limit as the gateway's policy defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// Requests allowed per window (bucket capacity for the token bucket).
    pub requests: u64,
    /// Window length (time to refill an empty token bucket), in ms.
    pub window_ms: u64,
    /// How to count.
    pub algorithm: Algorithm,
    /// A concurrency limit (`{"concurrent": N}`): at most `requests`
    /// requests in flight, each slot held at most `window_ms`; `algorithm`
    /// does not apply.
    #[serde(default, skip_serializing_if = "is_false")]
    pub in_flight: bool,
}

impl Limit {
    /// How the limit counts, as the Lua scripts, the Redis keys and the
    /// gateway's `algorithm` label name it: the algorithm's name, or
    /// [`IN_FLIGHT`] for a concurrency limit.
    pub fn counter(&self) -> &'static str {
        if self.in_flight {
            IN_FLIGHT
        } else {
            self.algorithm.name()
        }
    }
}

/// The name of a concurrency limit's counting in the Lua scripts, the Redis
/// keys and the gateway's `algorithm` label (beside [`Algorithm::NAMES`]).
pub const IN_FLIGHT: &str = "concurrent";

// `skip_serializing_if` takes a reference.
#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_false(b: &bool) -> bool {
    !*b
}

/// One limit's answer, with the limit the gateway enforced.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LimitResult<N = u64> {
    /// The enforced limit's `requests`.
    pub requests: N,
    /// The enforced limit's window, in ms.
    pub window_ms: N,
    /// The enforced limit's algorithm.
    pub algorithm: Algorithm,
    /// A concurrency limit ([`Limit::in_flight`]).
    #[serde(default, skip_serializing_if = "is_false")]
    pub in_flight: bool,
    /// Whether this limit alone lets the cost through.
    pub allowed: bool,
    /// Whole tokens left after the request (before it, when this limit denies).
    pub remaining: N,
    /// Ms until the limit no longer holds anything back.
    pub reset_ms: N,
    /// Ms until the cost would pass this limit; 0 when allowed.
    pub retry_after_ms: N,
}

/// One quota's answer, with the amount and period the gateway enforced.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QuotaResult<N = u64> {
    /// The enforced amount per period.
    pub limit: N,
    /// The enforced period.
    pub period: Period,
    /// Whether this quota alone lets the amount through (`count + amount ≤ limit`).
    pub allowed: bool,
    /// `limit − count` after the request when the whole check is allowed,
    /// before it otherwise; never negative.
    pub remaining: N,
    /// Ms until the period ends.
    pub reset_ms: N,
}

/// One bucket's answers, in the order of the policy's limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketResult<N = u64> {
    /// One per limit the gateway enforced.
    pub limits: Vec<LimitResult<N>>,
    /// How the gateway's policy holds the bucket. Absent: enforced (what a
    /// gateway that predates the field means too). A watched bucket's
    /// limits say what they would have done; they never make the check
    /// denied, and the bucket is charged only when the check is allowed
    /// and every watched bucket has room.
    #[serde(default, skip_serializing_if = "Watch::is_enforced")]
    pub watch: Watch,
    /// The graduated stage the bucket reached, for a rule with
    /// `graduated` stages in the gateway's policy; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<Stage<N>>,
}

/// Whether a bucket's denial denies the check, as the gateway's policy
/// decides it: the caller never names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Watch {
    /// The rule enforces.
    #[default]
    Enforce,
    /// The rule is `mode: shadow`: counted, never denying.
    Shadow,
    /// The bucket's key is a soft client's (`identity.clients.<id>.soft`):
    /// counted, never denying.
    Soft,
}

impl Watch {
    /// The bucket denies when its limits do.
    pub fn is_enforced(&self) -> bool {
        *self == Watch::Enforce
    }
}

/// A graduated rule's stage for one check, decided by the gateway from its
/// policy's shares of the rule's (single) limit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stage<N = u64> {
    /// Whole tokens of the limit in use (after the request when it was
    /// allowed, before it otherwise), at most [`MAX_SHARE`] × `requests`;
    /// the share in use is `used / requests`.
    pub used: N,
    /// The share in use reached `warn_at`: the response carries the warning.
    #[serde(default, skip_serializing_if = "is_false")]
    pub warn: bool,
    /// Ms the request is held (the share in use is past `delay_at`); 0: no
    /// delay. At most [`MAX_DELAY_MS`].
    #[serde(default)]
    pub delay_ms: N,
    /// The client is blocked (`block_at`): the limit's `retry_after_ms` is
    /// the block's rest.
    #[serde(default, skip_serializing_if = "is_false")]
    pub blocked: bool,
}

/// The longest delay a graduated stage holds a request (`delay_ms`).
pub const MAX_DELAY_MS: u64 = 60_000;
pub use ratelimit_config::MAX_SHARE;

/// `POST /v1/check` 200 answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckResponse<N = u64> {
    /// Always [`VERSION`].
    pub version: u32,
    /// True only when every limit of every bucket and every quota passed;
    /// then all were charged.
    pub allowed: bool,
    /// One per bucket of the request, in order.
    #[serde(default)]
    pub buckets: Vec<BucketResult<N>>,
    /// One per quota of the request, in order (absent when it had none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<QuotaResult<N>>,
}

/// One check's answer in a batch: what `POST /v1/check` would have
/// answered for it alone, or the error that kept the gateway from deciding
/// it (then `allowed` is false, there are no results, and nothing was
/// charged for it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "N: Deserialize<'de> + Default"))]
pub struct CheckResult<N = u64> {
    /// As [`CheckResponse::allowed`].
    pub allowed: bool,
    /// As [`CheckResponse::buckets`]; empty with an `error`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<BucketResult<N>>,
    /// As [`CheckResponse::quotas`]; empty with an `error`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<QuotaResult<N>>,
    /// Why this check was not decided (e.g. the domain's key budget, or
    /// Redis failing for its cluster slot), in general terms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `POST /v3/check` 200 answer: one result per check, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "N: Deserialize<'de> + Default"))]
pub struct BatchResponse<N = u64> {
    /// Always [`BATCH_VERSION`].
    pub version: u32,
    /// One per check of the request, in its order.
    pub results: Vec<CheckResult<N>>,
}

/// One limit's answer to a lease, with the limit the gateway enforced.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LeaseLimitResult<N = u64> {
    /// The enforced limit's `requests` (a lease's limits are token buckets).
    pub requests: N,
    /// The enforced limit's window, in ms.
    pub window_ms: N,
    /// Whole tokens left in this limit after the grant.
    pub remaining: N,
    /// Ms until this limit is full again.
    pub reset_ms: N,
    /// 0 when something was granted; else ms until 1 token is free in this
    /// limit (0 when one already is and another limit held the grant back).
    pub retry_after_ms: N,
}

/// `POST /v1/lease` 200 answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseResponse<N = u64> {
    /// Always [`VERSION`].
    pub version: u32,
    /// Tokens granted, charged in every limit; 0 when some limit has no
    /// whole token free (then nothing is charged).
    pub granted: N,
    /// One per limit the gateway enforced, in order.
    pub limits: Vec<LeaseLimitResult<N>>,
}

/// 400 and 503 answer body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// Always [`VERSION`].
    pub version: u32,
    /// For 400: `<field path>: <reason>`; for 503: what failed, in general terms.
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

/// Parses and validates a `POST /v1/check` body; the error is `<field path>: <reason>`.
pub fn parse_check(body: &[u8]) -> Result<CheckRequest, String> {
    let req: CheckRequest = decode(body, VERSION)?;
    validate_check(&req)?;
    Ok(req)
}

/// Why a `POST /v3/check` body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchError {
    /// More than [`MAX_BATCH`] checks (answered 413, as a body over
    /// [`MAX_BATCH_BYTES`]): `checks: ...`.
    TooManyChecks(String),
    /// Anything else (answered 400): `<field path>: <reason>`.
    Invalid(String),
}

impl std::fmt::Display for BatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchError::TooManyChecks(m) | BatchError::Invalid(m) => f.write_str(m),
        }
    }
}

/// Parses and validates a `POST /v3/check` body.
pub fn parse_batch(body: &[u8]) -> Result<BatchRequest, BatchError> {
    let req: BatchRequest = decode(body, BATCH_VERSION).map_err(BatchError::Invalid)?;
    version_is(req.version, BATCH_VERSION).map_err(BatchError::Invalid)?;
    if req.checks.len() > MAX_BATCH {
        return Err(BatchError::TooManyChecks(format!(
            "checks: more than {MAX_BATCH} checks"
        )));
    }
    validate_batch(&req).map_err(BatchError::Invalid)?;
    Ok(req)
}

/// Parses and validates a `POST /v1/settle` body; the error is `<field path>: <reason>`.
pub fn parse_settle(body: &[u8]) -> Result<SettleRequest, String> {
    let req: SettleRequest = decode(body, VERSION)?;
    validate_settle(&req)?;
    Ok(req)
}

/// Parses and validates a `POST /v1/lease` body; the error is `<field path>: <reason>`.
pub fn parse_lease(body: &[u8]) -> Result<LeaseRequest, String> {
    let req: LeaseRequest = decode(body, VERSION)?;
    validate_lease(&req)?;
    Ok(req)
}

/// Deserializes a body of protocol version `expected`. A body that does
/// not decode is told first of a version other than `expected` (rather than
/// of the first field it does not know), else of the field at fault; the
/// field's path is traced only then, on a second pass, so that a good body
/// is read once.
fn decode<T: serde::de::DeserializeOwned>(body: &[u8], expected: u32) -> Result<T, String> {
    serde_json::from_slice(body).or_else(|_| {
        check_version_is(body, expected)?;
        Err(decode_error::<T>(body))
    })
}

/// The version of a body that did not decode, against `expected`.
fn check_version_is(body: &[u8], expected: u32) -> Result<(), String> {
    #[derive(Deserialize)]
    struct Versioned {
        version: Option<serde_json::Value>,
    }
    if let Ok(Versioned { version: Some(v) }) = serde_json::from_slice::<Versioned>(body) {
        if v.as_u64() != Some(u64::from(expected)) {
            return Err(format!(
                "version: unsupported version {v}, expected {expected}"
            ));
        }
    }
    Ok(())
}

/// Why a body does not decode, naming the field at fault.
fn decode_error<T: serde::de::DeserializeOwned>(body: &[u8]) -> String {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let e = match serde_path_to_error::deserialize::<_, T>(&mut *de) {
        // The value decodes, so what follows it is what `from_slice` refused.
        Ok(_) => {
            return de.end().map_or_else(
                |e| format!("body: {}", strip_position(&e)),
                |()| "body: does not decode".to_string(),
            )
        }
        Err(e) => e,
    };
    let path = e.path().to_string();
    let reason = strip_position(&e.into_inner());
    if path == "." || path == "?" || path.is_empty() {
        format!("body: {reason}")
    } else {
        format!("{path}: {reason}")
    }
}

/// serde_json's message without its " at line L column C" suffix.
fn strip_position(e: &serde_json::Error) -> String {
    let full = e.to_string();
    match full.rfind(" at line ") {
        Some(i) if e.line() > 0 => full.get(..i).unwrap_or(&full).to_string(),
        _ => full,
    }
}

/// Checks the bounds of a check request that serde cannot express (the
/// policy's own bounds are the gateway's).
pub fn validate_check(req: &CheckRequest) -> Result<(), String> {
    version(req.version)?;
    at(|| "domain".into(), name(&req.domain, false))?;
    validate_items(
        &String::new,
        &req.buckets,
        &req.quotas,
        req.reservation.as_deref(),
    )
}

/// Checks the bounds of a batched check request: its version, its domain,
/// 1 to [`MAX_BATCH`] checks, and each check as [`validate_check`] does.
pub fn validate_batch(req: &BatchRequest) -> Result<(), String> {
    version_is(req.version, BATCH_VERSION)?;
    at(|| "domain".into(), name(&req.domain, false))?;
    let n = req.checks.len();
    if !(1..=MAX_BATCH).contains(&n) {
        return Err(format!(
            "checks: must hold 1 to {MAX_BATCH} checks, got {n}"
        ));
    }
    for (c, check) in req.checks.iter().enumerate() {
        validate_items(
            &|| format!("checks[{c}]."),
            &check.buckets,
            &check.quotas,
            check.reservation.as_deref(),
        )?;
    }
    Ok(())
}

/// The bounds of one check's buckets, quotas and reservation; `prefix`
/// writes what comes before each field path (`""`, or `checks[3].` in a
/// batch), only for a refusal.
fn validate_items(
    prefix: &dyn Fn() -> String,
    buckets: &[BucketRef],
    quotas: &[QuotaRef],
    reservation_id: Option<&str>,
) -> Result<(), String> {
    // A request may carry only quotas; then it needs no bucket.
    let min_buckets = usize::from(quotas.is_empty());
    if buckets.len() < min_buckets || buckets.len() > MAX_BUCKETS {
        return Err(format!(
            "{}buckets: must hold {min_buckets} to {MAX_BUCKETS} buckets, got {}",
            prefix(),
            buckets.len()
        ));
    }
    for (b, bucket) in buckets.iter().enumerate() {
        bucket_fields(prefix, b, bucket, 1)?;
    }
    if quotas.len() > MAX_QUOTAS {
        return Err(format!(
            "{}quotas: must hold at most {MAX_QUOTAS} quotas, got {}",
            prefix(),
            quotas.len()
        ));
    }
    for (q, quota) in quotas.iter().enumerate() {
        quota_fields(prefix, q, quota, 1)?;
    }
    if let Some(id) = reservation_id {
        at(|| format!("{}reservation", prefix()), reservation(id))?;
    }
    Ok(())
}

/// The fields of `buckets[b]`, its cost at least `min_cost`.
fn bucket_fields(
    prefix: &dyn Fn() -> String,
    b: usize,
    bucket: &BucketRef,
    min_cost: u64,
) -> Result<(), String> {
    let path = |field: &str| format!("{}buckets[{b}].{field}", prefix());
    at(|| path("rule"), name(&bucket.rule, false))?;
    at(|| path("key"), name(&bucket.key, false))?;
    at(|| path("tag"), name(&bucket.tag, true))?;
    at(|| path("variant"), variant(&bucket.variant))?;
    at(|| path("cost"), exact(bucket.cost, min_cost))
}

/// The fields of `quotas[q]`, its amount at least `min_amount`.
fn quota_fields(
    prefix: &dyn Fn() -> String,
    q: usize,
    quota: &QuotaRef,
    min_amount: u64,
) -> Result<(), String> {
    let path = |field: &str| format!("{}quotas[{q}].{field}", prefix());
    at(|| path("quota"), name(&quota.quota, false))?;
    at(|| path("key"), name(&quota.key, false))?;
    at(|| path("tag"), name(&quota.tag, true))?;
    at(|| path("variant"), variant(&quota.variant))?;
    at(|| path("amount"), exact(quota.amount, min_amount))
}

/// Checks the bounds of a settle request that serde cannot express.
pub fn validate_settle(req: &SettleRequest) -> Result<(), String> {
    version(req.version)?;
    at(|| "domain".into(), name(&req.domain, false))?;
    let n = req.settlements.len();
    if !(1..=MAX_SETTLEMENTS).contains(&n) {
        return Err(format!(
            "settlements: must hold 1 to {MAX_SETTLEMENTS} settlements, got {n}"
        ));
    }
    for (s, settlement) in req.settlements.iter().enumerate() {
        let prefix = || format!("settlements[{s}].");
        at(
            || format!("{}reservation", prefix()),
            reservation(&settlement.reservation),
        )?;
        let items = settlement.buckets.len() + settlement.quotas.len();
        if items == 0 || settlement.buckets.len() > MAX_BUCKETS {
            return Err(format!(
                "{}buckets: must hold 0 to {MAX_BUCKETS} buckets, and a bucket or a quota",
                prefix()
            ));
        }
        if settlement.quotas.len() > MAX_QUOTAS {
            return Err(format!(
                "{}quotas: must hold at most {MAX_QUOTAS} quotas, got {}",
                prefix(),
                settlement.quotas.len()
            ));
        }
        // A real cost of 0 is a settlement too (nothing used, a slot given back).
        for (b, bucket) in settlement.buckets.iter().enumerate() {
            bucket_fields(&prefix, b, bucket, 0)?;
        }
        for (q, quota) in settlement.quotas.iter().enumerate() {
            quota_fields(&prefix, q, quota, 0)?;
        }
    }
    Ok(())
}

/// A reservation id: it names a Redis key, so only a bounded, plain alphabet.
fn reservation(id: &str) -> Result<(), String> {
    let plain = id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !RESERVATION_ID_BYTES.contains(&id.len()) || !plain {
        return Err(format!(
            "must be {} to {} bytes of [0-9A-Za-z_-]",
            RESERVATION_ID_BYTES.start(),
            RESERVATION_ID_BYTES.end()
        ));
    }
    Ok(())
}

/// Checks the bounds of a lease request that serde cannot express.
pub fn validate_lease(req: &LeaseRequest) -> Result<(), String> {
    version(req.version)?;
    at(|| "domain".into(), name(&req.domain, false))?;
    at(|| "rule".into(), name(&req.rule, false))?;
    at(|| "key".into(), name(&req.key, false))?;
    at(|| "tag".into(), name(&req.tag, true))?;
    at(|| "variant".into(), variant(&req.variant))?;
    at(|| "want".into(), exact(req.want, 1))?;
    at(|| "return".into(), exact(req.returned, 0))
}

fn version(v: u32) -> Result<(), String> {
    version_is(v, VERSION)
}

fn version_is(v: u32, expected: u32) -> Result<(), String> {
    if v != expected {
        return Err(format!(
            "version: unsupported version {v}, expected {expected}"
        ));
    }
    Ok(())
}

/// `check`'s reason prefixed with the field's path, which is written only
/// for a refusal: a good request formats no path.
fn at(path: impl FnOnce() -> String, check: Result<(), String>) -> Result<(), String> {
    check.map_err(|why| format!("{}: {why}", path()))
}

fn exact(v: u64, min: u64) -> Result<(), String> {
    if !(min..=MAX_EXACT).contains(&v) {
        return Err(format!("must be between {min} and 2^53, got {v}"));
    }
    Ok(())
}

fn variant(v: &Variant) -> Result<(), String> {
    match v {
        Variant::Default => Ok(()),
        Variant::Tier(n) | Variant::Client(n) | Variant::Set(n) => name(n, false),
    }
}

fn name(value: &str, may_be_empty: bool) -> Result<(), String> {
    if value.is_empty() && !may_be_empty {
        return Err("must not be empty".to_string());
    }
    if value.len() > MAX_NAME_BYTES {
        return Err(format!(
            "must be at most {MAX_NAME_BYTES} bytes, got {}",
            value.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    fn good() -> serde_json::Value {
        json!({
            "version": 2, "domain": "demo",
            "buckets": [ { "rule": "per-client", "key": "per-client/c=alice", "tag": "c=alice",
                           "variant": "default", "cost": 1 } ],
            "quotas": [ { "quota": "monthly", "key": "monthly/c=alice", "tag": "c=alice",
                          "variant": "tier:gold", "amount": 1 } ]
        })
    }

    fn good_lease() -> serde_json::Value {
        json!({ "version": 2, "domain": "d", "rule": "rule", "key": "rule/client=abc",
                "tag": "client=abc", "variant": "client:abc", "want": 5, "return": 0 })
    }

    fn good_batch(n: usize) -> serde_json::Value {
        let check = json!({ "buckets": [ { "rule": "per-client", "key": "per-client/c=alice",
                                           "tag": "c=alice", "variant": "default", "cost": 2 } ] });
        json!({ "version": 3, "domain": "demo", "checks": vec![check; n] })
    }

    #[test]
    fn a_batch_parses_within_its_bounds() {
        let b = parse_batch(&body(good_batch(MAX_BATCH))).unwrap();
        assert_eq!(b.checks.len(), MAX_BATCH);
        assert_eq!(b.checks[0].buckets[0].cost, 2);
        assert_eq!(serde_json::to_value(&b).unwrap(), good_batch(MAX_BATCH));
        // One more than the bound, or 10^5 more: 413's error, the rest skipped.
        for n in [MAX_BATCH + 1, 100_000] {
            assert_eq!(
                parse_batch(&body(good_batch(n))).unwrap_err(),
                BatchError::TooManyChecks(format!("checks: more than {MAX_BATCH} checks"))
            );
        }
        let invalid = |v: serde_json::Value| match parse_batch(&body(v)).unwrap_err() {
            BatchError::Invalid(m) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            invalid(good_batch(0)),
            format!("checks: must hold 1 to {MAX_BATCH} checks, got 0")
        );
        let mut v = good_batch(2);
        v["version"] = json!(2);
        assert_eq!(invalid(v), "version: unsupported version 2, expected 3");
        let mut v = good_batch(5);
        v["checks"][3]["buckets"][0]["variant"] = json!("gold");
        assert!(
            invalid(v).starts_with("checks[3].buckets[0].variant: "),
            "the field path names the check"
        );
        let mut v = good_batch(5);
        v["checks"][4]["buckets"][0]["cost"] = json!(0);
        assert!(invalid(v).starts_with("checks[4].buckets[0].cost: "));
    }

    #[test]
    fn the_examples_parse_and_round_trip() {
        let r = parse_check(&body(good())).unwrap();
        assert_eq!(r.buckets[0].variant, Variant::Default);
        assert_eq!(r.quotas[0].variant, Variant::Tier("gold".into()));
        assert_eq!(serde_json::to_value(&r).unwrap(), good());
        let l = parse_lease(&body(good_lease())).unwrap();
        assert_eq!(l.variant, Variant::Client("abc".into()));
        assert_eq!(serde_json::to_value(&l).unwrap(), good_lease());
        // Quotas alone need no bucket; `return` defaults to 0.
        let mut v = good();
        v.as_object_mut().unwrap().remove("buckets");
        assert!(parse_check(&body(v)).unwrap().buckets.is_empty());
        let mut v = good_lease();
        v.as_object_mut().unwrap().remove("return");
        assert_eq!(parse_lease(&body(v)).unwrap().returned, 0);
        // A client id may hold colons.
        assert_eq!(
            Variant::decode("client:a:b"),
            Ok(Variant::Client("a:b".into()))
        );
    }

    type Change = Box<dyn Fn(&mut serde_json::Value)>;

    #[test]
    fn a_request_cannot_name_limits_windows_or_quota_amounts() {
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|v| {
                    v["buckets"][0]["limits"] =
                        json!([{"requests": 1, "window_ms": 1, "algorithm": "token_bucket"}])
                }),
                "buckets[0].limits: unknown field `limits`",
            ),
            (
                Box::new(|v| v["buckets"][0]["window_ms"] = json!(1u64 << 53)),
                "buckets[0].window_ms: unknown field `window_ms`",
            ),
            (
                Box::new(|v| v["quotas"][0]["limit"] = json!(1_000_000_000_000u64)),
                "quotas[0].limit: unknown field `limit`",
            ),
            (
                Box::new(|v| v["quotas"][0]["period"] = "month".into()),
                "quotas[0].period: unknown field `period`",
            ),
            (
                Box::new(|v| v["cost"] = 1.into()),
                "cost: unknown field `cost`",
            ),
        ];
        for (change, want) in cases {
            let mut v = good();
            change(&mut v);
            let err = parse_check(&body(v)).unwrap_err();
            assert!(err.starts_with(want), "{err:?} should start with {want:?}");
        }
    }

    #[test]
    fn bytes_after_the_body_are_refused() {
        let mut b = body(good());
        b.extend_from_slice(b" {}");
        assert_eq!(parse_check(&b).unwrap_err(), "body: trailing characters");
        let mut batch = body(good_batch(2));
        assert!(parse_batch(&batch).is_ok());
        batch.extend_from_slice(b"x");
        assert_eq!(
            parse_batch(&batch).unwrap_err(),
            BatchError::Invalid("body: trailing characters".into())
        );
        // Whitespace after the value is no trailing character.
        let mut b = body(good());
        b.extend_from_slice(b"\r\n");
        assert!(parse_check(&b).is_ok());
    }

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|v| v["version"] = 1.into()),
                "version: unsupported version 1, expected 2",
            ),
            (
                Box::new(|v| v["buckets"][0]["variant"] = "gold".into()),
                "buckets[0].variant: unknown variant `gold`, expected `default`, `tier:<name>`, `client:<id>` or `set:<name>`",
            ),
            (
                Box::new(|v| v["buckets"][0]["variant"] = "tier:".into()),
                "buckets[0].variant: `tier:` names no tier, client or set",
            ),
            (
                Box::new(|v| v["buckets"][0]["cost"] = 0.into()),
                "buckets[0].cost: must be between 1 and 2^53, got 0",
            ),
            (
                Box::new(|v| v["buckets"][0]["rule"] = "".into()),
                "buckets[0].rule: must not be empty",
            ),
            (
                Box::new(|v| v["buckets"][0]["key"] = "k".repeat(513).into()),
                "buckets[0].key: must be at most 512 bytes, got 513",
            ),
            (
                Box::new(|v| {
                    v["buckets"][0].as_object_mut().unwrap().remove("tag");
                }),
                "buckets[0]: missing field `tag`",
            ),
            (
                Box::new(|v| v["buckets"] = json!(vec![v["buckets"][0].clone(); 65])),
                "buckets: must hold 0 to 64 buckets, got 65",
            ),
            (
                Box::new(|v| v["quotas"] = json!(vec![v["quotas"][0].clone(); 65])),
                "quotas: must hold at most 64 quotas, got 65",
            ),
            (
                Box::new(|v| v["quotas"][0]["amount"] = ((1u64 << 53) + 1).into()),
                "quotas[0].amount: must be between 1 and 2^53, got 9007199254740993",
            ),
            (
                Box::new(|v| v["quotas"][0]["quota"] = "".into()),
                "quotas[0].quota: must not be empty",
            ),
            (
                Box::new(|v| {
                    v.as_object_mut().unwrap().remove("quotas");
                    v["buckets"] = json!([]);
                }),
                "buckets: must hold 1 to 64 buckets, got 0",
            ),
        ];
        for (change, want) in cases {
            let mut v = good();
            change(&mut v);
            let err = parse_check(&body(v)).unwrap_err();
            assert!(err.starts_with(want), "{err:?} should start with {want:?}");
        }
        let lease_cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|v| v["version"] = 1.into()),
                "version: unsupported version 1, expected 2",
            ),
            (
                Box::new(|v| v["want"] = 0.into()),
                "want: must be between 1 and 2^53, got 0",
            ),
            (
                Box::new(|v| v["return"] = ((1u64 << 53) + 1).into()),
                "return: must be between 0 and 2^53, got 9007199254740993",
            ),
            (
                Box::new(|v| v["return"] = (-1).into()),
                "return: invalid value: integer `-1`",
            ),
            (
                Box::new(|v| v["limits"] = json!([])),
                "limits: unknown field `limits`",
            ),
            (Box::new(|v| v["key"] = "".into()), "key: must not be empty"),
        ];
        for (change, want) in lease_cases {
            let mut v = good_lease();
            change(&mut v);
            let err = parse_lease(&body(v)).unwrap_err();
            assert!(err.starts_with(want), "{err:?} should start with {want:?}");
        }
        // A version-1 body is told about its version, whatever else it holds.
        let v1 = json!({"version": 1, "domain": "d", "cost": 1, "buckets": [{"key": "k", "tag": "",
            "limits": [{"requests": 1, "window_ms": 1, "algorithm": "token_bucket"}]}]});
        assert_eq!(
            parse_check(&body(v1)).unwrap_err(),
            "version: unsupported version 1, expected 2"
        );
        let err = parse_check(b"{\"version\":2,").unwrap_err();
        assert!(err.starts_with("body: EOF"), "{err}");
    }

    #[test]
    fn settlements_parse_and_name_the_field_at_fault() {
        let settle = json!({"version": 2, "domain": "d", "settlements": [
            {"reservation": "0123456789abcdef", "buckets": [
                {"rule": "tokens", "key": "tokens/c=a", "tag": "c=a", "variant": "default", "cost": 0}],
             "quotas": [{"quota": "month", "key": "month/c=a", "tag": "c=a",
                         "variant": "default", "amount": 7}]}]});
        let r = parse_settle(&body(settle.clone())).unwrap();
        assert_eq!(r.settlements[0].buckets[0].cost, 0);
        assert_eq!(serde_json::to_value(&r).unwrap(), settle);
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|v| v["settlements"][0]["reservation"] = "short".into()),
                "settlements[0].reservation: must be 16 to 64 bytes of [0-9A-Za-z_-]",
            ),
            (
                Box::new(|v| v["settlements"][0]["reservation"] = "0123456789abcdef|x".into()),
                "settlements[0].reservation: must be 16 to 64 bytes",
            ),
            (
                Box::new(|v| v["settlements"] = json!([])),
                "settlements: must hold 1 to 64 settlements, got 0",
            ),
            (
                Box::new(|v| v["settlements"] = json!(vec![v["settlements"][0].clone(); 65])),
                "settlements: must hold 1 to 64 settlements, got 65",
            ),
            (
                Box::new(|v| v["settlements"][0]["buckets"][0]["cost"] = ((1u64 << 53) + 1).into()),
                "settlements[0].buckets[0].cost: must be between 0 and 2^53",
            ),
            (
                Box::new(|v| v["settlements"][0]["buckets"][0]["limits"] = json!([])),
                "settlements[0].buckets[0].limits: unknown field `limits`",
            ),
            (
                Box::new(|v| {
                    v["settlements"][0] = json!({"reservation": "0123456789abcdef"});
                }),
                "settlements[0].buckets: must hold 0 to 64 buckets, and a bucket or a quota",
            ),
        ];
        for (change, want) in cases {
            let mut v = settle.clone();
            change(&mut v);
            let err = parse_settle(&body(v)).unwrap_err();
            assert!(err.starts_with(want), "{err:?} should start with {want:?}");
        }
        let mut check = good();
        check["reservation"] = "abc".into();
        assert_eq!(
            parse_check(&body(check)).unwrap_err(),
            "reservation: must be 16 to 64 bytes of [0-9A-Za-z_-]"
        );
    }

    #[test]
    fn answers_read_as_floats_for_clamping() {
        let answer = CheckResponse {
            version: VERSION,
            allowed: true,
            buckets: vec![BucketResult {
                limits: vec![LimitResult {
                    requests: 30,
                    window_ms: 60_000,
                    algorithm: Algorithm::TokenBucket,
                    in_flight: false,
                    allowed: true,
                    remaining: 29,
                    reset_ms: 2000,
                    retry_after_ms: 0,
                }],
                watch: Watch::Enforce,
                stage: None,
            }],
            quotas: vec![],
        };
        // A plain bucket says nothing of watching or stages: what a filter
        // of before these fields reads.
        let text = serde_json::to_string(&answer).unwrap();
        assert_eq!(
            text,
            r#"{"version":2,"allowed":true,"buckets":[{"limits":[{"requests":30,"window_ms":60000,"algorithm":"token_bucket","allowed":true,"remaining":29,"reset_ms":2000,"retry_after_ms":0}]}]}"#
        );
        let read: CheckResponse<f64> =
            serde_json::from_str(&text.replace("\"remaining\":29", "\"remaining\":-3")).unwrap();
        assert_eq!(read.buckets[0].limits[0].remaining, -3.0);
        // A watched, graduated bucket names both; false flags stay out.
        let mut held = answer.clone();
        held.buckets[0].watch = Watch::Shadow;
        held.buckets[0].stage = Some(Stage {
            used: 3,
            warn: true,
            delay_ms: 0,
            blocked: false,
        });
        let text = serde_json::to_string(&held.buckets[0]).unwrap();
        assert!(
            text.ends_with(r#""watch":"shadow","stage":{"used":3,"warn":true,"delay_ms":0}}"#),
            "{text}"
        );
        let read: BucketResult<f64> = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (read.watch, read.stage.map(|s| s.used)),
            (Watch::Shadow, Some(3.0))
        );
    }
}
