//! The rate limit service's metrics, as envoyproxy/ratelimit keeps them per
//! descriptor (`total_hits`, `over_limit`, `near_limit`, `within_limit`,
//! `shadow_mode`), labelled by `domain` and `descriptor`: the descriptor's key
//! path in `--rls-config` (`key_value.key2`), never a value from a request,
//! so the label values are bounded by the configuration.

use prometheus::{IntCounterVec, Opts};

/// Answers of `ShouldRateLimit`, as the `code` label.
pub const CODES: [&str; 6] = [
    "ok",
    "over_limit",
    "error",
    "unauthenticated",
    "permission_denied",
    "invalid",
];

/// Every metric of the rate limit service.
#[derive(Clone)]
pub struct RlsMetrics {
    /// `ratelimit_gateway_rls_requests_total{code}`: `ShouldRateLimit` calls by answer.
    pub requests: IntCounterVec,
    /// `ratelimit_gateway_rls_total_hits_total{domain,descriptor}`: hits
    /// (`hits_addend`) on a limit.
    pub total_hits: IntCounterVec,
    /// `ratelimit_gateway_rls_over_limit_total{domain,descriptor}`: hits over the limit.
    pub over_limit: IntCounterVec,
    /// `ratelimit_gateway_rls_near_limit_total{domain,descriptor}`: hits past
    /// `--rls-near-limit-ratio` of the limit and within it.
    pub near_limit: IntCounterVec,
    /// `ratelimit_gateway_rls_within_limit_total{domain,descriptor}`: hits
    /// of answers within the limit.
    pub within_limit: IntCounterVec,
    /// `ratelimit_gateway_rls_shadow_mode_total{domain,descriptor}`: hits
    /// over the limit answered OK because of `shadow_mode`.
    pub shadow_mode: IntCounterVec,
}

impl RlsMetrics {
    /// Registers every metric in `registry`.
    pub fn new(registry: &prometheus::Registry) -> Result<RlsMetrics, prometheus::Error> {
        let per_descriptor = |name: &str, help: &str| -> Result<IntCounterVec, prometheus::Error> {
            let c = IntCounterVec::new(Opts::new(name, help), &["domain", "descriptor"])?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let requests = IntCounterVec::new(
            Opts::new(
                "ratelimit_gateway_rls_requests_total",
                "ShouldRateLimit calls of the rate limit service, by answer (ok, over_limit, \
                 error: Redis failed, unauthenticated, permission_denied, invalid).",
            ),
            &["code"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        for c in CODES {
            requests.with_label_values(&[c]);
        }
        Ok(RlsMetrics {
            requests,
            total_hits: per_descriptor(
                "ratelimit_gateway_rls_total_hits_total",
                "Hits (hits_addend) on a limit of --rls-config, by domain and descriptor key path.",
            )?,
            over_limit: per_descriptor(
                "ratelimit_gateway_rls_over_limit_total",
                "Hits over the limit, by domain and descriptor key path.",
            )?,
            near_limit: per_descriptor(
                "ratelimit_gateway_rls_near_limit_total",
                "Hits past --rls-near-limit-ratio of the limit and within it, by domain and \
                 descriptor key path.",
            )?,
            within_limit: per_descriptor(
                "ratelimit_gateway_rls_within_limit_total",
                "Hits of answers within the limit, by domain and descriptor key path.",
            )?,
            shadow_mode: per_descriptor(
                "ratelimit_gateway_rls_shadow_mode_total",
                "Hits over the limit answered OK because of shadow_mode, by domain and \
                 descriptor key path.",
            )?,
        })
    }

    /// Counts one decided descriptor as envoyproxy/ratelimit does
    /// (`checkOverLimitThreshold` / `checkNearLimitThreshold`): `before` and
    /// `after` are the counts before and after the hits, `limit` the
    /// requests per unit, `near` the near-limit threshold.
    #[allow(clippy::too_many_arguments)]
    pub fn count(
        &self,
        labels: &[&str; 2],
        hits: u64,
        before: u64,
        after: u64,
        limit: u64,
        near: u64,
        over: bool,
        shadow: bool,
    ) {
        self.total_hits.with_label_values(labels).inc_by(hits);
        if over {
            if before >= limit {
                self.over_limit.with_label_values(labels).inc_by(hits);
            } else {
                self.over_limit
                    .with_label_values(labels)
                    .inc_by(after.saturating_sub(limit));
                self.near_limit
                    .with_label_values(labels)
                    .inc_by(limit.saturating_sub(near.max(before)));
            }
            if shadow {
                self.shadow_mode.with_label_values(labels).inc_by(hits);
            }
        } else {
            if after > near {
                let n = if before >= near {
                    hits
                } else {
                    after.saturating_sub(near)
                };
                self.near_limit.with_label_values(labels).inc_by(n);
            }
            self.within_limit.with_label_values(labels).inc_by(hits);
        }
    }
}
