//! The rate limit service's metrics, as envoyproxy/ratelimit keeps them per
//! descriptor (`total_hits`, `over_limit`, `near_limit`, `within_limit`,
//! `shadow_mode`), labelled by `domain` and `descriptor`: the descriptor's key
//! path in `--rls-config` (`key_value.key2`), or [`OVERRIDE_DESCRIPTOR`] for
//! every descriptor that brought its own `limit`; never a key or value from
//! a request, so the label values are bounded by the configuration.

use std::collections::HashMap;
use std::sync::Mutex;

use prometheus::{IntCounter, IntCounterVec, Opts};

/// Answers of `ShouldRateLimit`, as the `code` label.
pub const CODES: [&str; 6] = [
    "ok",
    "over_limit",
    "error",
    "unauthenticated",
    "permission_denied",
    "invalid",
];

/// The `descriptor` label of every descriptor counted under its own `limit`
/// (Envoy's override, `--rls-allow-overrides`): one series per domain
/// whatever keys the request sent. A configuration key path is never empty
/// and has no parentheses unless a key does.
pub const OVERRIDE_DESCRIPTOR: &str = "(override)";

/// Most (domain, descriptor) pairs a [`RlsMetrics`] keeps resolved; past
/// it the cache starts over (it only grows with configuration reloads).
pub const MAX_CACHED_LABELS: usize = 4096;

/// One descriptor's counters, each resolved from its vector on first use
/// (as before, a series appears once it is counted): looking a label pair up
/// in a prometheus vector hashes it, takes the vector's lock and clones and
/// drops a shared reference, up to three times per call otherwise.
#[derive(Default)]
struct Counters {
    total_hits: Option<IntCounter>,
    over_limit: Option<IntCounter>,
    near_limit: Option<IntCounter>,
    within_limit: Option<IntCounter>,
    shadow_mode: Option<IntCounter>,
}

/// Adds `n` to the counter in `slot`, resolving it from `vec` first.
fn add(slot: &mut Option<IntCounter>, vec: &IntCounterVec, labels: &[&str; 2], n: u64) {
    slot.get_or_insert_with(|| vec.with_label_values(labels))
        .inc_by(n);
}

/// Every metric of the rate limit service. A clone shares the metrics and
/// starts its own cache of resolved counters (one per worker thread, so the
/// cache's lock is never contended).
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
    /// `requests{code="ok"}` and `requests{code="over_limit"}`, resolved.
    ok: IntCounter,
    over: IntCounter,
    /// Resolved counters by domain, then descriptor key path.
    cache: Mutex<HashMap<String, HashMap<String, Counters>>>,
}

impl Clone for RlsMetrics {
    fn clone(&self) -> Self {
        RlsMetrics {
            requests: self.requests.clone(),
            total_hits: self.total_hits.clone(),
            over_limit: self.over_limit.clone(),
            near_limit: self.near_limit.clone(),
            within_limit: self.within_limit.clone(),
            shadow_mode: self.shadow_mode.clone(),
            ok: self.ok.clone(),
            over: self.over.clone(),
            cache: Mutex::new(HashMap::new()),
        }
    }
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
            ok: requests.with_label_values(&["ok"]),
            over: requests.with_label_values(&["over_limit"]),
            cache: Mutex::new(HashMap::new()),
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
        let [domain, path] = *labels;
        let mut cache = self
            .cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !cache
            .get(domain)
            .is_some_and(|paths| paths.contains_key(path))
        {
            if cache.values().map(HashMap::len).sum::<usize>() >= MAX_CACHED_LABELS {
                cache.clear();
            }
            cache
                .entry(domain.to_string())
                .or_default()
                .insert(path.to_string(), Counters::default());
        }
        let Some(c) = cache.get_mut(domain).and_then(|paths| paths.get_mut(path)) else {
            return; // inserted just above
        };
        add(&mut c.total_hits, &self.total_hits, labels, hits);
        if over {
            if before >= limit {
                add(&mut c.over_limit, &self.over_limit, labels, hits);
            } else {
                let over_by = after.saturating_sub(limit);
                add(&mut c.over_limit, &self.over_limit, labels, over_by);
                let near_by = limit.saturating_sub(near.max(before));
                add(&mut c.near_limit, &self.near_limit, labels, near_by);
            }
            if shadow {
                add(&mut c.shadow_mode, &self.shadow_mode, labels, hits);
            }
        } else {
            if after > near {
                let n = if before >= near {
                    hits
                } else {
                    after.saturating_sub(near)
                };
                add(&mut c.near_limit, &self.near_limit, labels, n);
            }
            add(&mut c.within_limit, &self.within_limit, labels, hits);
        }
    }

    /// Counts one answered call: `OVER_LIMIT` or `OK`.
    pub fn answered(&self, over_limit: bool) {
        if over_limit {
            self.over.inc();
        } else {
            self.ok.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(registry: &prometheus::Registry, name: &str) -> Option<u64> {
        registry
            .gather()
            .iter()
            .find(|f| f.name() == name)
            .and_then(|f| {
                f.get_metric()
                    .first()
                    .map(|m| m.get_counter().get_value() as u64)
            })
    }

    #[test]
    fn cached_counters_count_into_the_shared_series_and_create_them_only_when_counted() {
        let registry = prometheus::Registry::new();
        let m = RlsMetrics::new(&registry).unwrap();
        let labels = ["d", "key.sub"];
        // Within the limit of 10, near past 8: hits 5 (count 0 -> 5), then 4 (5 -> 9).
        m.count(&labels, 5, 0, 5, 10, 8, false, false);
        let other = m.clone();
        other.count(&labels, 4, 5, 9, 10, 8, false, false);
        // Over: 9 -> 12.
        m.count(&labels, 3, 9, 12, 10, 8, true, false);
        m.answered(false);
        other.answered(true);
        assert_eq!(
            value(&registry, "ratelimit_gateway_rls_total_hits_total"),
            Some(12)
        );
        assert_eq!(
            value(&registry, "ratelimit_gateway_rls_within_limit_total"),
            Some(9)
        );
        assert_eq!(
            value(&registry, "ratelimit_gateway_rls_near_limit_total"),
            Some(1 + 1)
        );
        assert_eq!(
            value(&registry, "ratelimit_gateway_rls_over_limit_total"),
            Some(2)
        );
        // Never counted: no series, as with the vectors alone.
        assert_eq!(
            value(&registry, "ratelimit_gateway_rls_shadow_mode_total"),
            None
        );
        assert_eq!(m.requests.with_label_values(&["ok"]).get(), 1);
        assert_eq!(m.requests.with_label_values(&["over_limit"]).get(), 1);
    }
}
