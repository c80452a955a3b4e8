//! One `/v1/check`: all or nothing over every limit of every bucket and every
//! quota.
//!
//! On a single Redis (or when every key hashes to one cluster slot) this is
//! one `EVALSHA` of `check.lua`, atomic by itself. When the keys span several
//! cluster slots, the slot groups are checked and charged in order; if a later
//! group denies, the groups already charged are refunded with `refund.lua`,
//! the groups not yet checked are evaluated without charging (so that every
//! limit and quota has an answer), and the answer is "denied".
//!
//! One `/v1/lease` is one `EVALSHA` of `lease.lua`: the keys of one bucket
//! and the caller's ledger share a hash tag, so they are always one slot.
//!
//! Requests come here resolved from the policy ([`crate::policy`]): the
//! answers carry the limits, amounts and periods enforced.
//!
//! A check with a bucket that Redis denied lately, its wait not over, is a
//! denial without a charge ([`crate::deny_cache`]): the cached bucket answers
//! from memory, and only the other buckets and quotas, if any, are read
//! (`Mode::Peek`) so that every limit and quota still has an answer. Both
//! front ends (`/v1/check` and the gRPC rate limit service) check here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use redis::cluster_routing::Slot;

use crate::deny_cache::DenyCache;
use crate::keys::{self, Group};
use crate::logging::Escaped;
use crate::metrics::Metrics;
use crate::policy::{Resolved, ResolvedLease};
use crate::protocol::{
    BucketResult, CheckResponse, LeaseLimitResult, LeaseResponse, LimitResult, QuotaResult, VERSION,
};
use crate::redis_store::{Store, StoreError};
use crate::script::{self, CheckReply, LimitVerdict, Mode, QuotaVerdict};

/// The check logic over a [`Store`].
pub struct Limiter {
    store: Store,
    prefix: String,
    metrics: Metrics,
    deny: DenyCache,
    key_budget: u64,
    /// Ledgers of live keys found per (domain, slot) on a cluster; at most
    /// 16,384 per domain of the policy.
    ledgers: Arc<Mutex<HashMap<(String, Slot), String>>>,
}

impl Limiter {
    /// A limiter writing keys under `prefix`, remembering denials in `deny`.
    pub fn new(store: Store, prefix: String, metrics: Metrics, deny: DenyCache) -> Self {
        Limiter {
            store,
            prefix,
            metrics,
            deny,
            key_budget: crate::flags::DEFAULT_KEY_BUDGET,
            ledgers: Arc::default(),
        }
    }

    /// The most live keys one domain may hold (`--key-budget`; on a cluster
    /// per slot, [`keys::slot_budget`]); 0: no budget. A check that would
    /// create a key past it is refused (a Redis error of kind `key_budget`,
    /// answered 503) for that domain only; its existing keys keep working.
    pub fn with_key_budget(mut self, budget: u64) -> Self {
        self.key_budget = budget;
        self
    }

    /// The store, for health checks.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Checks a resolved request, with time from Redis.
    pub async fn check(&self, req: &Resolved) -> Result<CheckResponse, StoreError> {
        self.check_at(req, None).await
    }

    /// Checks a validated request. `now_ms` is the **test-only** time
    /// override handed to the scripts (`None` in the service): the scripts
    /// then take it instead of Redis `TIME` for every limit and every quota
    /// period (so a test can step into the next minute, day or month) and
    /// write keys without an expiry. Nothing reachable over HTTP sets it.
    pub async fn check_at(
        &self,
        req: &Resolved,
        now_ms: Option<u64>,
    ) -> Result<CheckResponse, StoreError> {
        let answer = self.check_groups(req, now_ms).await;
        if let Err(e) = &answer {
            if e.kind() == "key_budget" {
                // The domain is the policy's (resolved), so the label's values are bounded.
                self.metrics
                    .key_budget_refusals
                    .with_label_values(&[req.domain.as_str()])
                    .inc();
            }
        }
        answer
    }

    async fn check_groups(
        &self,
        req: &Resolved,
        now_ms: Option<u64>,
    ) -> Result<CheckResponse, StoreError> {
        let limits = keys::limit_keys(&self.prefix, req);
        let quotas = keys::quota_keys(&self.prefix, req);
        // A bucket Redis denied lately whose wait is not over makes the answer
        // a denial whatever the rest says: nothing is charged, and the rest is
        // only read (the deny cache; not with a test's time override).
        let asked_at = Instant::now();
        let bucket_keys: Vec<Vec<String>> = if now_ms.is_none() && self.deny.enabled() {
            (0..req.buckets.len())
                .map(|b| {
                    let of_b = limits.iter().filter(|l| l.bucket == b);
                    of_b.map(|l| l.key.clone()).collect()
                })
                .collect()
        } else {
            Vec::new()
        };
        let cached: Vec<Option<Vec<LimitVerdict>>> = bucket_keys
            .iter()
            .zip(&req.buckets)
            .map(|(k, b)| self.deny.lookup(k, b.cost, asked_at))
            .collect();
        let hit = cached.iter().any(Option::is_some);
        let groups = if self.store.is_cluster() {
            keys::group_by_slot(limits, quotas)
        } else {
            vec![Group { limits, quotas }]
        };
        let mut answers: Vec<BucketResult> = req
            .buckets
            .iter()
            .map(|b| BucketResult {
                limits: Vec::with_capacity(b.limits.len()),
            })
            .collect();
        let mut slots: Vec<Vec<Option<LimitVerdict>>> = req
            .buckets
            .iter()
            .map(|b| vec![None; b.limits.len()])
            .collect();
        let mut quota_slots: Vec<Option<QuotaVerdict>> = vec![None; req.quotas.len()];

        let mut charged: Vec<(usize, u64)> = Vec::new();
        let mut denied_at = None;
        if hit {
            self.metrics.deny_cache_hits.inc();
            for (b, verdicts) in cached.iter().enumerate() {
                for (l, v) in verdicts.iter().flatten().enumerate() {
                    if let Some(slot) = slots.get_mut(b).and_then(|s| s.get_mut(l)) {
                        *slot = Some(*v);
                    }
                }
            }
            for group in &groups {
                let rest = Group {
                    limits: group
                        .limits
                        .iter()
                        .filter(|l| cached.get(l.bucket).is_some_and(Option::is_none))
                        .cloned()
                        .collect(),
                    quotas: group.quotas.clone(),
                };
                if !rest.limits.is_empty() || !rest.quotas.is_empty() {
                    let reply = self.run(&rest, Mode::Peek, now_ms, &req.domain).await?;
                    place(&mut slots, &mut quota_slots, &rest, &reply);
                }
            }
        } else {
            for (gi, group) in groups.iter().enumerate() {
                match self.run(group, Mode::Charge, now_ms, &req.domain).await {
                    Ok(reply) => {
                        place(&mut slots, &mut quota_slots, group, &reply);
                        if reply.allowed {
                            charged.push((gi, reply.now_ms));
                        } else {
                            denied_at = Some(gi);
                            break;
                        }
                    }
                    Err(e) => {
                        self.refund_all(&groups, &charged, now_ms).await;
                        return Err(e);
                    }
                }
            }
        }
        let allowed = denied_at.is_none() && !hit;
        if let Some(d) = denied_at {
            self.refund_all(&groups, &charged, now_ms).await;
            for group in groups.iter().skip(d + 1) {
                let reply = self.run(group, Mode::Peek, now_ms, &req.domain).await?;
                place(&mut slots, &mut quota_slots, group, &reply);
            }
            // The groups charged before were refunded: their quotas report
            // what they had before the request, like every quota of a denied
            // answer (they passed, so before = after + amount exactly).
            for &(gi, _) in &charged {
                for qk in groups.get(gi).map_or(&[][..], |g| &g.quotas) {
                    if let Some(Some(r)) = quota_slots.get_mut(qk.quota) {
                        r.remaining = r.remaining.saturating_add(qk.amount);
                    }
                }
            }
        }
        for ((answer, bucket), spec) in answers.iter_mut().zip(slots).zip(&req.buckets) {
            for (r, limit) in bucket.into_iter().zip(&spec.limits) {
                let Some(r) = r else {
                    return Err(StoreError::Reply("a limit got no answer".to_string()));
                };
                answer.limits.push(LimitResult {
                    requests: limit.requests,
                    window_ms: limit.window_ms,
                    algorithm: limit.algorithm,
                    allowed: r.allowed,
                    remaining: r.remaining,
                    reset_ms: r.reset_ms,
                    retry_after_ms: r.retry_after_ms,
                });
            }
        }
        if !allowed && !hit {
            // Counted from before the call: never longer than Redis's own wait.
            for ((keys, answer), spec) in bucket_keys.iter().zip(&answers).zip(&req.buckets) {
                let verdicts: Vec<LimitVerdict> = answer
                    .limits
                    .iter()
                    .map(|r| LimitVerdict {
                        allowed: r.allowed,
                        remaining: r.remaining,
                        reset_ms: r.reset_ms,
                        retry_after_ms: r.retry_after_ms,
                    })
                    .collect();
                self.deny.remember(keys, spec.cost, &verdicts, asked_at);
            }
        }
        let mut quotas = Vec::with_capacity(quota_slots.len());
        for (r, spec) in quota_slots.into_iter().zip(&req.quotas) {
            let Some(r) = r else {
                return Err(StoreError::Reply("a quota got no answer".to_string()));
            };
            quotas.push(QuotaResult {
                limit: spec.limit,
                period: spec.period,
                allowed: r.allowed,
                remaining: r.remaining,
                reset_ms: r.reset_ms,
            });
        }
        if !allowed {
            for (r, q) in quotas.iter().zip(&req.quotas) {
                if !r.allowed {
                    self.metrics
                        .quota_denials
                        .with_label_values(&[q.period.name()])
                        .inc();
                }
            }
            for (bucket, spec) in answers.iter().zip(&req.buckets) {
                for (r, l) in bucket.limits.iter().zip(&spec.limits) {
                    if !r.allowed {
                        self.metrics
                            .denials
                            .with_label_values(&[l.algorithm.name()])
                            .inc();
                    }
                }
            }
        }
        Ok(CheckResponse {
            version: VERSION,
            allowed,
            buckets: answers,
            quotas,
        })
    }

    /// Leases tokens for a resolved lease request made by `caller` (the
    /// identity its ledger is kept under: `crate::auth::Caller::id`), with
    /// time from Redis.
    pub async fn lease(
        &self,
        req: &ResolvedLease,
        caller: &str,
    ) -> Result<LeaseResponse, StoreError> {
        self.lease_at(req, caller, None).await
    }

    /// Leases tokens for a validated lease request. `now_ms` is the
    /// **test-only** time override, as for [`Limiter::check_at`]: the script
    /// takes it instead of Redis `TIME` and writes keys without an expiry.
    /// Nothing reachable over HTTP sets it.
    pub async fn lease_at(
        &self,
        req: &ResolvedLease,
        caller: &str,
        now_ms: Option<u64>,
    ) -> Result<LeaseResponse, StoreError> {
        let mut keys = keys::lease_keys(&self.prefix, req);
        keys.push(keys::ledger_key(&self.prefix, req, caller));
        let args = script::lease_args(req, now_ms);
        let reply: Vec<i64> = self
            .store
            .eval(script::lease(), &keys, &args, "lease")
            .await?;
        let reply =
            script::parse_lease_reply(&reply, req.limits.len()).map_err(StoreError::Reply)?;
        Ok(LeaseResponse {
            version: VERSION,
            granted: reply.granted,
            limits: reply
                .limits
                .iter()
                .zip(&req.limits)
                .map(|(r, l)| LeaseLimitResult {
                    requests: l.requests,
                    window_ms: l.window_ms,
                    remaining: r.remaining,
                    reset_ms: r.reset_ms,
                    retry_after_ms: r.retry_after_ms,
                })
                .collect(),
        })
    }

    async fn run(
        &self,
        group: &Group,
        mode: Mode,
        now_ms: Option<u64>,
        domain: &str,
    ) -> Result<CheckReply, StoreError> {
        let (ledger, budget) = self.ledger(group, domain);
        let (keys, args) = script::check_args(group, mode, now_ms, &ledger, budget);
        let op = match mode {
            Mode::Charge => "check",
            Mode::Peek => "peek",
        };
        let reply: Vec<i64> = self.store.eval(script::check(), &keys, &args, op).await?;
        script::parse_check_reply(&reply, group.limits.len(), group.quotas.len())
            .map_err(StoreError::Reply)
    }

    /// The domain's ledger of live keys for `group` and its budget: one per
    /// domain on a single Redis; on a cluster one per domain and slot (the
    /// script's keys share a slot), with [`keys::slot_budget`].
    fn ledger(&self, group: &Group, domain: &str) -> (String, u64) {
        if !self.store.is_cluster() {
            return (keys::live_ledger(&self.prefix, domain), self.key_budget);
        }
        let first = group
            .limits
            .first()
            .map(|l| l.key.as_str())
            .or_else(|| group.quotas.first().map(|q| q.base.as_str()))
            .unwrap_or_default();
        let slot = Slot::for_key(first.as_bytes());
        let mut cache = self.ledgers.lock().unwrap_or_else(|e| e.into_inner());
        let ledger = cache
            .entry((domain.to_string(), slot))
            .or_insert_with(|| keys::live_ledger_in_slot(&self.prefix, domain, slot))
            .clone();
        (ledger, keys::slot_budget(self.key_budget))
    }

    /// Gives back every charged group; failures are logged and counted (the
    /// client is then over-charged until its keys refill, never under-charged).
    async fn refund_all(&self, groups: &[Group], charged: &[(usize, u64)], now_ms: Option<u64>) {
        for &(gi, at) in charged {
            let Some(group) = groups.get(gi) else {
                continue;
            };
            let (keys, args) = script::refund_args(group, at, now_ms);
            self.metrics.refunds.inc();
            if let Err(e) = self
                .store
                .eval::<i64>(script::refund(), &keys, &args, "refund")
                .await
            {
                self.metrics.error("refund");
                tracing::warn!(error = %Escaped(&e), keys = keys.len(), "refund failed; the client stays charged until its keys refill");
            }
        }
    }
}

fn place(
    slots: &mut [Vec<Option<LimitVerdict>>],
    quota_slots: &mut [Option<QuotaVerdict>],
    group: &Group,
    reply: &CheckReply,
) {
    for (lk, r) in group.limits.iter().zip(&reply.limits) {
        if let Some(slot) = slots.get_mut(lk.bucket).and_then(|b| b.get_mut(lk.limit)) {
            *slot = Some(*r);
        }
    }
    for (qk, r) in group.quotas.iter().zip(&reply.quotas) {
        if let Some(slot) = quota_slots.get_mut(qk.quota) {
            *slot = Some(*r);
        }
    }
}
