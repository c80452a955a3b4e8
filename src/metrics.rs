//! The filter's counters. Envoy shows each as `wasmcustom.<name>` in `/stats`
//! and as the bare `<name>` in `/stats/prometheus`, summed over workers.
//!
//! The per-rule and per-quota counters carry their domain and rule (or
//! quota) in the name, as Istio's own stats do: `ratelimit_domain=.=<d>;.;`
//! and `ratelimit_rule=.=<r>;.;` before the metric's name. The stats tags
//! of the shipped Envoy configuration (and Istio's `extraStatTags`) take
//! them out as the labels `ratelimit_domain` and `ratelimit_rule`, so that
//! Prometheus sees `ratelimit_wasm_rule_denied{ratelimit_domain="api",
//! ratelimit_rule="per-client"}`. Their number is the configuration's rules
//! and quotas, whatever the clients.

/// One counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Requests that matched a rule and were let through.
    Allowed,
    /// Requests the filter answered itself: 429, or 503 in `failure_mode: closed`.
    Denied,
    /// Compare-and-swap conflicts that forced a retry.
    CasRetries,
    /// Shared-data failures or contention past the retry budget (then `on_error` applies).
    Errors,
    /// Active buckets evicted from a full set of the bounded table.
    Evictions,
    /// Requests with an oversized key part, a garbled trusted `X-Forwarded-For` or no peer address.
    BadInput,
    /// Set values that could not be decoded and were reset.
    CorruptState,
    /// Callouts made to the gateway.
    GlobalCalls,
    /// Callouts that failed: no answer, timeout, non-200, garbled or inconsistent.
    GlobalFailures,
    /// Requests let through without the gateway's word (`failure_mode: open`).
    FailOpen,
    /// Requests answered 503 because the gateway failed (`failure_mode: closed`).
    FailClosed,
    /// Global rules decided locally at a proxy's share of the limit (`failure_mode: local`).
    FallbackLocal,
    /// Times the circuit breaker opened.
    CircuitOpened,
    /// Requests that skipped the callout because the circuit was open.
    CircuitOpenSkips,
    /// Figures in gateway answers outside what the limit allows, clamped.
    GatewayClamped,
    /// Requests a shadow rule (or any rule, for a soft client) would have denied.
    ShadowDenied,
    /// Requests answered 429 because the client is blocked (graduated `block_at`).
    Blocked,
    /// Requests answered 403 because a quota is spent.
    QuotaExhausted,
    /// Responses that carried the graduated warning header.
    Warned,
    /// Requests held `delay_ms` by a graduated rule.
    Delayed,
    /// Requests of unlimited clients or tiers.
    Unlimited,
    /// Global requests served from a lease, without a callout.
    LeaseServed,
    /// Lease callouts (by requests and by the timer).
    LeaseFetches,
    /// Gateway answers whose enforced limits (or quota amounts, periods)
    /// differ from this filter's configuration; the gateway's apply.
    PolicyMismatch,
    /// Requests answered 429 from the deny cache: the gateway had denied
    /// their bucket and its wait was not over, so no callout was made.
    DenyCacheHits,
    /// Responses whose real cost was read (`cost_from`) and settled against the reservation.
    UsageSettled,
    /// Responses whose real cost was above `cost_from.max`: charged `max`.
    UsageCapped,
    /// Responses without a readable usage (field absent, not an integer,
    /// malformed body, stream ended early): charged `reserve`.
    UsageMissing,
    /// Response bodies longer than `cost_from.scan_limit`: charged `reserve`.
    UsageOverScanLimit,
    /// Compressed response bodies, not scanned: charged `reserve`.
    UsageCompressed,
    /// Requests refunded because their response's status is not in `charge_on`
    /// (or the stream ended before a response).
    ChargeRefunded,
    /// Matches of a `limits_by` rule that got the rule's own limits: the
    /// metadata held no name, or one not among the sets.
    LimitsByDefault,
}

impl Metric {
    /// Every counter, in a fixed order.
    pub const ALL: [Metric; 32] = [
        Metric::Allowed,
        Metric::Denied,
        Metric::CasRetries,
        Metric::Errors,
        Metric::Evictions,
        Metric::BadInput,
        Metric::CorruptState,
        Metric::GlobalCalls,
        Metric::GlobalFailures,
        Metric::FailOpen,
        Metric::FailClosed,
        Metric::FallbackLocal,
        Metric::CircuitOpened,
        Metric::CircuitOpenSkips,
        Metric::GatewayClamped,
        Metric::ShadowDenied,
        Metric::Blocked,
        Metric::QuotaExhausted,
        Metric::Warned,
        Metric::Delayed,
        Metric::Unlimited,
        Metric::LeaseServed,
        Metric::LeaseFetches,
        Metric::PolicyMismatch,
        Metric::DenyCacheHits,
        Metric::UsageSettled,
        Metric::UsageCapped,
        Metric::UsageMissing,
        Metric::UsageOverScanLimit,
        Metric::UsageCompressed,
        Metric::ChargeRefunded,
        Metric::LimitsByDefault,
    ];

    /// The name given to Envoy.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Allowed => "ratelimit_wasm_requests_allowed",
            Metric::Denied => "ratelimit_wasm_requests_denied",
            Metric::CasRetries => "ratelimit_wasm_cas_retries",
            Metric::Errors => "ratelimit_wasm_errors",
            Metric::Evictions => "ratelimit_wasm_bucket_evictions",
            Metric::BadInput => "ratelimit_wasm_bad_input",
            Metric::CorruptState => "ratelimit_wasm_corrupt_state",
            Metric::GlobalCalls => "ratelimit_wasm_global_calls",
            Metric::GlobalFailures => "ratelimit_wasm_global_failures",
            Metric::FailOpen => "ratelimit_wasm_failure_mode_open",
            Metric::FailClosed => "ratelimit_wasm_failure_mode_closed",
            Metric::FallbackLocal => "ratelimit_wasm_failure_mode_local",
            Metric::CircuitOpened => "ratelimit_wasm_circuit_opened",
            Metric::CircuitOpenSkips => "ratelimit_wasm_circuit_open_skips",
            Metric::GatewayClamped => "ratelimit_wasm_gateway_answer_clamped",
            Metric::ShadowDenied => "ratelimit_wasm_shadow_denied",
            Metric::Blocked => "ratelimit_wasm_blocked",
            Metric::QuotaExhausted => "ratelimit_wasm_quota_exhausted",
            Metric::Warned => "ratelimit_wasm_warned",
            Metric::Delayed => "ratelimit_wasm_delayed",
            Metric::Unlimited => "ratelimit_wasm_unlimited",
            Metric::LeaseServed => "ratelimit_wasm_lease_served",
            Metric::LeaseFetches => "ratelimit_wasm_lease_fetches",
            Metric::PolicyMismatch => "ratelimit_wasm_policy_mismatch",
            Metric::DenyCacheHits => "ratelimit_wasm_deny_cache_hits",
            Metric::UsageSettled => "ratelimit_wasm_usage_settled",
            Metric::UsageCapped => "ratelimit_wasm_usage_capped",
            Metric::UsageMissing => "ratelimit_wasm_usage_missing",
            Metric::UsageOverScanLimit => "ratelimit_wasm_usage_over_scan_limit",
            Metric::UsageCompressed => "ratelimit_wasm_usage_compressed",
            Metric::ChargeRefunded => "ratelimit_wasm_charge_refunded",
            Metric::LimitsByDefault => "ratelimit_wasm_limits_by_default",
        }
    }

    /// Position in [`Metric::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The counters of a request body read before the request is decided
/// (`cost_from.reserve` from a pointer, `ensure_stream_usage`). Apart from
/// [`Metric`]: the host counts them itself, so the counts every decision
/// carries (`decide::Counts`) stay as small as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMetric {
    /// Requests whose reservation was read from their body.
    ReserveRead,
    /// Requests that reserved the default: no body, or a JSON body without
    /// a whole number of at least 1 at the pointer.
    ReserveMissing,
    /// Requests that reserved the default: the body is not JSON.
    ReserveNotJson,
    /// Requests that reserved the default: the body is longer than
    /// `request_body_limit`, passed on unread.
    ReserveTooLarge,
    /// Request bodies given `stream_options.include_usage: true`.
    UsageBodyRewritten,
    /// Request bodies `ensure_stream_usage` could not read (longer than
    /// `request_body_limit`, not JSON, a `stream_options` that is not an
    /// object), passed on unchanged.
    UsageBodyUnchanged,
}

impl BodyMetric {
    /// Every counter, in a fixed order.
    pub const ALL: [BodyMetric; 6] = [
        BodyMetric::ReserveRead,
        BodyMetric::ReserveMissing,
        BodyMetric::ReserveNotJson,
        BodyMetric::ReserveTooLarge,
        BodyMetric::UsageBodyRewritten,
        BodyMetric::UsageBodyUnchanged,
    ];

    /// The name given to Envoy.
    pub fn name(self) -> &'static str {
        match self {
            BodyMetric::ReserveRead => "ratelimit_wasm_reserve_from_body",
            BodyMetric::ReserveMissing => "ratelimit_wasm_reserve_default_missing",
            BodyMetric::ReserveNotJson => "ratelimit_wasm_reserve_default_not_json",
            BodyMetric::ReserveTooLarge => "ratelimit_wasm_reserve_default_too_large",
            BodyMetric::UsageBodyRewritten => "ratelimit_wasm_usage_body_rewritten",
            BodyMetric::UsageBodyUnchanged => "ratelimit_wasm_usage_body_unchanged",
        }
    }

    /// Position in [`BodyMetric::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What one rule did, counted per rule (the labels `ratelimit_domain` and
/// `ratelimit_rule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleMetric {
    /// Admitted requests the rule checked and let through.
    Allowed,
    /// Requests the rule refused (429, the deny cache's included).
    Denied,
    /// Requests the rule would have refused but only watches (a shadow
    /// rule, or any rule for a soft client).
    ShadowDenied,
    /// Admitted requests after which one of the rule's limits had used at
    /// least `metrics.near_limit` of its capacity.
    NearLimit,
}

impl RuleMetric {
    /// Every per-rule counter, in a fixed order.
    pub const ALL: [RuleMetric; 4] = [
        RuleMetric::Allowed,
        RuleMetric::Denied,
        RuleMetric::ShadowDenied,
        RuleMetric::NearLimit,
    ];

    /// The metric's name, without its labels.
    pub fn name(self) -> &'static str {
        match self {
            RuleMetric::Allowed => "ratelimit_wasm_rule_allowed",
            RuleMetric::Denied => "ratelimit_wasm_rule_denied",
            RuleMetric::ShadowDenied => "ratelimit_wasm_rule_shadow_denied",
            RuleMetric::NearLimit => "ratelimit_wasm_rule_near_limit",
        }
    }

    /// Position in [`RuleMetric::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Requests refused 403 because the quota was spent, per quota (the labels
/// `ratelimit_domain` and `ratelimit_quota`; the total of every quota is
/// [`Metric::QuotaExhausted`], under a name of its own so that a sum over
/// either never counts a refusal twice).
pub const QUOTA_EXHAUSTED: &str = "ratelimit_wasm_quota_denied";

/// The name given to Envoy of rule `rule`'s counter `m` in `domain`, its
/// labels first (see the module's doc).
pub fn rule_metric_name(domain: &str, rule: &str, m: RuleMetric) -> String {
    format!(
        "ratelimit_domain=.={domain};.;ratelimit_rule=.={rule};.;{}",
        m.name()
    )
}

/// The name given to Envoy of quota `quota`'s [`QUOTA_EXHAUSTED`] counter.
pub fn quota_metric_name(domain: &str, quota: &str) -> String {
    format!("ratelimit_domain=.={domain};.;ratelimit_quota=.={quota};.;{QUOTA_EXHAUSTED}")
}

/// The name of every counter: [`Metric::ALL`], [`BodyMetric::ALL`],
/// [`Background::ALL`], then the per-rule and per-quota ones without labels.
pub fn all_names() -> impl Iterator<Item = &'static str> {
    Metric::ALL
        .iter()
        .map(|m| m.name())
        .chain(BodyMetric::ALL.iter().map(|m| m.name()))
        .chain(Background::ALL.iter().map(|m| m.name()))
        .chain(RuleMetric::ALL.iter().map(|m| m.name()))
        .chain([QUOTA_EXHAUSTED])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_prefixed_and_indexes_match() {
        for (i, m) in Metric::ALL.iter().enumerate() {
            assert!(m.name().starts_with("ratelimit_wasm_"));
            assert_eq!(m.index(), i);
        }
        for (i, m) in BodyMetric::ALL.iter().enumerate() {
            assert!(m.name().starts_with("ratelimit_wasm_"));
            assert_eq!(m.index(), i);
        }
        let mut names: Vec<&str> = all_names().collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a name is given twice");
    }
}

/// Counters outside any request's decision (so outside [`Metric`], whose
/// counts travel in every decision): the root context's own work, and what
/// settling against a lease could not apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Background {
    /// Settlements of global rules and quotas the gateway applied.
    GlobalSettled,
    /// Settlements the gateway had no reservation for: settled already (an
    /// earlier attempt's answer was lost) or past `--reservation-ttl`.
    GlobalSettleUnmatched,
    /// Settlements given up (three failed attempts, a 400 or 404, or a full queue):
    /// the request keeps what its check reserved.
    GlobalSettleFailed,
    /// Tokens a settlement could not give back to the lease batch a request
    /// spent from (expired, taken over, or holding a whole lease already).
    LeaseUnreturned,
    /// Tokens of lease debt dropped: a settlement past the debt's cap or
    /// after another bucket took the slot, or a slot in debt taken over.
    LeaseDebtDropped,
    /// Batch calls posted (coalesced checks): the callouts behind
    /// `ratelimit_wasm_global_calls`' checks.
    GlobalBatches,
}

impl Background {
    /// Every counter, in a fixed order.
    pub const ALL: [Background; 6] = [
        Background::GlobalSettled,
        Background::GlobalSettleUnmatched,
        Background::GlobalSettleFailed,
        Background::LeaseUnreturned,
        Background::LeaseDebtDropped,
        Background::GlobalBatches,
    ];

    /// The name given to Envoy.
    pub fn name(self) -> &'static str {
        match self {
            Background::GlobalSettled => "ratelimit_wasm_global_settled",
            Background::GlobalSettleUnmatched => "ratelimit_wasm_global_settle_unmatched",
            Background::GlobalSettleFailed => "ratelimit_wasm_global_settle_failed",
            Background::LeaseUnreturned => "ratelimit_wasm_lease_unreturned",
            Background::LeaseDebtDropped => "ratelimit_wasm_lease_debt_dropped",
            Background::GlobalBatches => "ratelimit_wasm_global_batches",
        }
    }
}
