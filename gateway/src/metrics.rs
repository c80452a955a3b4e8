//! Prometheus metrics, in a registry of their own (one per server, so that
//! several servers can run in one test process).

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
    TextEncoder,
};

/// Results of `/v1/check` (`allowed`, `denied`), `/v1/lease` (`lease`,
/// whatever it granted) and of each settlement of `/v1/settle` (`settled`;
/// `unsettled`: its reservation was not there, already settled or expired),
/// and of all when answered 400, 404 or 503 (`error`), as the `result` label.
pub const RESULTS: [&str; 6] = [
    "allowed",
    "denied",
    "lease",
    "settled",
    "unsettled",
    "error",
];
/// Error kinds, as the `kind` label (`unknown_domain`: a 404, a domain no
/// policy names).
pub const ERROR_KINDS: [&str; 10] = [
    "bad_request",
    "unknown_domain",
    "timeout",
    "redis",
    "not_connected",
    "reply",
    "refund",
    "oom",
    "readonly",
    "key_budget",
];
/// Kinds of the warnings callers can cause (a 400, or a 503 of this error
/// kind, or a 404 of an unknown domain), as the `kind` label of the
/// suppressed log lines (`crate::logging`).
pub const WARNING_KINDS: [&str; 9] = [
    "bad_request",
    "unknown_domain",
    "timeout",
    "redis",
    "not_connected",
    "reply",
    "oom",
    "readonly",
    "key_budget",
];
/// Redis operations, as the `op` label (`batch`: one `batch.lua` call,
/// every check of a `/v3/check` batch of one cluster slot).
pub const OPS: [&str; 10] = [
    "check",
    "batch",
    "peek",
    "refund",
    "settle",
    "lease",
    "ping",
    "load",
    "health",
    "fixed_window",
];
/// How limits count, as the `algorithm` label: the algorithms, and
/// concurrency limits ([`ratelimit_protocol::Limit::counter`]).
// Destructured: a new algorithm fails the build here until it is listed.
pub const ALGORITHMS: [&str; 3] = {
    let [bucket, window] = ratelimit_config::Algorithm::NAMES;
    [bucket, window, ratelimit_protocol::IN_FLIGHT]
};
/// Quota periods, as the `period` label.
pub const PERIODS: [&str; 4] = ["minute", "hour", "day", "month"];
/// What a reload reads (`crate::reload`), as the `what` label.
pub const RELOADED: [&str; 3] = ["policy", "auth_tokens", "rls_config"];
/// Why a call to `/v1/*` was refused (`crate::auth::REASONS`), as the `reason` label.
pub use crate::auth::REASONS as AUTH_REASONS;
/// What a 503 may have followed a committed charge after, as the `reason` label:
/// `timeout` (the Redis round trip timed out after the script may have run),
/// `reply` (the script ran, its reply was unreadable), `client_gone` (the
/// caller left while or after the charge was made, so it never read the answer).
pub const CHARGE_FAILURES: [&str; 3] = ["timeout", "reply", "client_gone"];
/// Which read took too long, as the `phase` label: `handshake` (TLS),
/// `header`, `body`.
pub const TIMEOUT_PHASES: [&str; 3] = ["handshake", "header", "body"];

/// The buckets (upper bounds) of `ratelimit_gateway_batch_checks`, up to
/// [`ratelimit_protocol::MAX_BATCH`].
pub const BATCH_SIZES: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, ratelimit_protocol::MAX_BATCH];

/// The `listener` label values of `connections_refused_total`.
pub const LISTENERS: [&str; 2] = ["http", "grpc"];

/// Every metric the gateway exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// `ratelimit_gateway_checks_total{result}`: answered checks and leases.
    pub checks: IntCounterVec,
    /// `ratelimit_gateway_denials_total{algorithm}`: limits that denied a check.
    pub denials: IntCounterVec,
    /// `ratelimit_gateway_quota_denials_total{period}`: quotas that denied a check.
    pub quota_denials: IntCounterVec,
    /// `ratelimit_gateway_redis_duration_seconds{op}`: Redis round trips.
    pub redis_latency: HistogramVec,
    /// `ratelimit_gateway_errors_total{kind}`.
    pub errors: IntCounterVec,
    /// `ratelimit_gateway_script_reloads_total`: SCRIPT LOADs after NOSCRIPT.
    pub script_reloads: IntCounter,
    /// `ratelimit_gateway_refunds_total`: slot groups refunded after a later group denied.
    pub refunds: IntCounter,
    /// `ratelimit_gateway_log_suppressed_total{kind}`: caller-caused warnings
    /// left out of the log by its rate limit.
    pub log_suppressed: IntCounterVec,
    /// `ratelimit_gateway_reloads_total{what}`: files reloaded and put in force.
    pub reloads: IntCounterVec,
    /// `ratelimit_gateway_reload_failures_total{what}`: reloads that failed
    /// (the previous value stayed in force).
    pub reload_failures: IntCounterVec,
    /// `ratelimit_gateway_auth_failures_total{reason}`: calls to `/v1/*` refused 401 or 403.
    pub auth_failures: IntCounterVec,
    /// `ratelimit_gateway_shed_total`: `/v1/*` calls answered 503 because
    /// `--max-in-flight` were being served.
    pub shed: IntCounter,
    /// `ratelimit_gateway_charged_then_failed_total{reason}`: answers that
    /// may have followed a committed charge without reaching the caller as 200.
    pub charged_then_failed: IntCounterVec,
    /// `ratelimit_gateway_read_timeouts_total{phase}`: connections closed
    /// because a TLS handshake, headers or a body took too long.
    pub read_timeouts: IntCounterVec,
    /// `ratelimit_gateway_connections_refused_total{listener}`: connections
    /// closed at accept because `--max-connections` were open on that
    /// listener (`http` or `grpc`).
    pub connections_refused: IntCounterVec,
    /// `ratelimit_gateway_deny_cache_hits_total`: checks answered denied
    /// from the deny cache, without charging Redis.
    pub deny_cache_hits: IntCounter,
    /// `ratelimit_gateway_key_budget_refusals_total{domain}`: checks refused
    /// because they would create a key past the key budget of a hash tag of
    /// the domain (the domain is the policy's).
    pub key_budget_refusals: IntCounterVec,
    /// `ratelimit_gateway_batch_checks`: checks per `/v3/check` batch
    /// decided (resolved by the policy; a refused batch is not observed).
    pub batch_checks: Histogram,
}

impl Metrics {
    /// A fresh registry with every metric registered and every label value present.
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let checks = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_checks_total",
                "Checks and leases answered, by result (lease: a lease answered 200).",
            ),
            &["result"],
        )?;
        let denials = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_denials_total",
                "Limits that denied a check, by algorithm.",
            ),
            &["algorithm"],
        )?;
        let quota_denials = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_quota_denials_total",
                "Quotas that denied a check (the amount did not fit in what was left), by period.",
            ),
            &["period"],
        )?;
        let redis_latency = HistogramVec::new(
            HistogramOpts::new(
                "ratelimit_gateway_redis_duration_seconds",
                "Redis round trips (including a NOSCRIPT reload), by operation.",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25,
            ]),
            &["op"],
        )?;
        let errors = IntCounterVec::new(
            Opts::new("ratelimit_gateway_errors_total", "Errors, by kind."),
            &["kind"],
        )?;
        let script_reloads = IntCounter::new(
            "ratelimit_gateway_script_reloads_total",
            "Scripts loaded again after Redis answered NOSCRIPT.",
        )?;
        let refunds = IntCounter::new(
            "ratelimit_gateway_refunds_total",
            "Slot groups refunded because a later group of the same check denied.",
        )?;
        let log_suppressed = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_log_suppressed_total",
                "Warnings caused by callers (bad requests, Redis failures) left out of the log \
                 by its rate limit, by kind.",
            ),
            &["kind"],
        )?;
        let reloads = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_reloads_total",
                "Reloads put in force (SIGHUP or a changed file), by what was read.",
            ),
            &["what"],
        )?;
        let reload_failures = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_reload_failures_total",
                "Reloads that failed to read or validate; the previous value stays in force.",
            ),
            &["what"],
        )?;
        let auth_failures = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_auth_failures_total",
                "Calls to /v1/* refused: 401 (missing, malformed, unknown token) or 403 \
                 (wrong_domain), by reason.",
            ),
            &["reason"],
        )?;
        let shed = IntCounter::new(
            "ratelimit_gateway_shed_total",
            "Calls to /v1/* answered 503 with Retry-After because --max-in-flight were served.",
        )?;
        let charged_then_failed = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_charged_then_failed_total",
                "Answers other than 200 (or no answer) that may follow a committed charge, by reason.",
            ),
            &["reason"],
        )?;
        let read_timeouts = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_read_timeouts_total",
                "Connections closed because the TLS handshake, the headers or the body took too long.",
            ),
            &["phase"],
        )?;
        let connections_refused = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_connections_refused_total",
                "Connections closed at accept because --max-connections were open on the listener.",
            ),
            &["listener"],
        )?;
        let deny_cache_hits = IntCounter::new(
            "ratelimit_gateway_deny_cache_hits_total",
            "Checks answered denied from the deny cache (--deny-cache-entries): a bucket \
             Redis denied, its wait not over; nothing was charged.",
        )?;
        registry.register(Box::new(deny_cache_hits.clone()))?;
        let key_budget_refusals = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_key_budget_refusals_total",
                "Checks refused because they would create a key past a hash tag's key budget, by domain.",
            ),
            &["domain"],
        )?;
        registry.register(Box::new(key_budget_refusals.clone()))?;
        let batch_checks = Histogram::with_opts(
            HistogramOpts::new(
                "ratelimit_gateway_batch_checks",
                "Checks per /v3/check batch decided.",
            )
            .buckets(BATCH_SIZES.iter().map(|&b| b as f64).collect()),
        )?;
        registry.register(Box::new(batch_checks.clone()))?;
        registry.register(Box::new(auth_failures.clone()))?;
        registry.register(Box::new(shed.clone()))?;
        registry.register(Box::new(charged_then_failed.clone()))?;
        registry.register(Box::new(read_timeouts.clone()))?;
        registry.register(Box::new(connections_refused.clone()))?;
        for l in LISTENERS {
            connections_refused.with_label_values(&[l]);
        }
        for r in AUTH_REASONS {
            auth_failures.with_label_values(&[r]);
        }
        for r in CHARGE_FAILURES {
            charged_then_failed.with_label_values(&[r]);
        }
        for p in TIMEOUT_PHASES {
            read_timeouts.with_label_values(&[p]);
        }
        registry.register(Box::new(reloads.clone()))?;
        registry.register(Box::new(reload_failures.clone()))?;
        for w in RELOADED {
            reloads.with_label_values(&[w]);
            reload_failures.with_label_values(&[w]);
        }
        registry.register(Box::new(checks.clone()))?;
        registry.register(Box::new(denials.clone()))?;
        registry.register(Box::new(quota_denials.clone()))?;
        registry.register(Box::new(redis_latency.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(script_reloads.clone()))?;
        registry.register(Box::new(refunds.clone()))?;
        registry.register(Box::new(log_suppressed.clone()))?;
        for r in RESULTS {
            checks.with_label_values(&[r]);
        }
        for a in ALGORITHMS {
            denials.with_label_values(&[a]);
        }
        for p in PERIODS {
            quota_denials.with_label_values(&[p]);
        }
        for o in OPS {
            redis_latency.with_label_values(&[o]);
        }
        for k in ERROR_KINDS {
            errors.with_label_values(&[k]);
        }
        for k in WARNING_KINDS {
            log_suppressed.with_label_values(&[k]);
        }
        Ok(Metrics {
            registry,
            checks,
            denials,
            quota_denials,
            redis_latency,
            errors,
            script_reloads,
            refunds,
            log_suppressed,
            reloads,
            reload_failures,
            auth_failures,
            shed,
            charged_then_failed,
            read_timeouts,
            connections_refused,
            deny_cache_hits,
            key_budget_refusals,
            batch_checks,
        })
    }

    /// The registry, for the metrics of the rate limit service (`crate::rls`).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Counts one check by result.
    pub fn check(&self, result: &str) {
        self.checks.with_label_values(&[result]).inc();
    }

    /// Counts one error by kind.
    pub fn error(&self, kind: &str) {
        self.errors.with_label_values(&[kind]).inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }
}
