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
//! A check that names a reservation has each charged group keep a record of
//! its charges beside the group's ledger ([`keys::record_key`]); a group
//! refunded after a later denial deletes its record with the refund. One
//! settlement is one `EVALSHA` of `settle.lua` per slot group, each reading
//! and deleting its slot's record.
//!
//! One `/v1/lease` is one `EVALSHA` of `lease.lua`: the keys of one bucket
//! and the caller's ledger share a hash tag, so they are always one slot.
//!
//! Requests come here resolved from the policy ([`crate::policy`]): the
//! answers carry the limits, amounts and periods enforced.
//!
//! A watched bucket (a shadow rule's, a soft client's) never makes a check
//! denied, and is charged only with the rest (`check.lua`); a graduated
//! one gets its stage in the answer. Neither is remembered by, nor answered
//! from, the deny cache: a shadow denial is no denial, and a graduated
//! bucket counts every request's demand.
//!
//! A check with a bucket that Redis denied lately, its wait not over, is a
//! denial without a charge ([`crate::deny_cache`]): the cached bucket answers
//! from memory, and only the other buckets and quotas, if any, are read
//! (`Mode::Peek`) so that every limit and quota still has an answer. Both
//! front ends (`/v1/check` and the gRPC rate limit service) check here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures_util::future::join_all;
use redis::cluster_routing::Slot;

use crate::clock::{Clock, RedisTime};
use crate::deny_cache::DenyCache;
use crate::logging::Escaped;
use crate::metrics::Metrics;
use crate::policy::{Resolved, ResolvedBucket, ResolvedLease};
use crate::protocol::{
    BucketResult, CheckResponse, LeaseLimitResult, LeaseResponse, LimitResult, QuotaResult, Stage,
    VERSION,
};
use crate::redis::keys::{self, Group, LimitKey, QuotaKey};
use crate::redis::script::{
    self, BatchEntry, CheckReply, LimitVerdict, Mode, QuotaVerdict, StageVerdict,
};
use crate::redis::store::{Store, StoreError};

/// The check logic over a [`Store`].
pub struct Limiter {
    store: Arc<Store>,
    prefix: String,
    metrics: Metrics,
    deny: DenyCache,
    key_budget: u64,
    /// The time the scripts run at: Redis `TIME` unless built [`Limiter::with_clock`].
    clock: Arc<dyn Clock>,
    /// Each domain's ledgers of live keys on a cluster (one per slot), found
    /// once per domain of the policy.
    ledgers: Arc<Mutex<HashMap<String, Arc<keys::LiveLedgers>>>>,
    /// How long a reservation record waits for its settlement, in ms.
    record_ms: u64,
}

/// How the groups of one check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Every group passed and was charged.
    Allowed,
    /// A group denied: nothing stays charged.
    Denied,
    /// A bucket of the deny cache answered: nothing was charged.
    Cached,
}

/// A check before its decision ([`Limiter::prepare`]).
struct Prepared {
    /// Each bucket's keys for the deny cache ([`Limiter::bucket_keys`]).
    bucket_keys: Vec<Vec<String>>,
    /// What the deny cache answers for each bucket.
    cached: Vec<Option<Vec<LimitVerdict>>>,
    /// Its keys: one group on a single Redis, one per slot on a cluster.
    groups: Vec<Group>,
    /// When it was asked, for the deny cache.
    asked_at: Instant,
}

impl Prepared {
    /// Whether the deny cache answers it (denied, without a charge).
    fn is_cached(&self) -> bool {
        self.cached.iter().any(Option::is_some)
    }
}

/// The verdicts gathered so far, in the request's order.
struct Verdicts {
    limits: Vec<Vec<Option<LimitVerdict>>>,
    quotas: Vec<Option<QuotaVerdict>>,
    /// Per bucket, the stage of its special limit (watched or graduated).
    stages: Vec<Option<StageVerdict>>,
}

impl Limiter {
    /// A limiter writing keys under `prefix`, remembering denials in `deny`,
    /// its scripts on Redis `TIME`.
    pub fn new(store: Store, prefix: String, metrics: Metrics, deny: DenyCache) -> Self {
        Limiter {
            store: Arc::new(store),
            prefix,
            metrics,
            deny,
            key_budget: crate::flags::DEFAULT_KEY_BUDGET,
            clock: Arc::new(RedisTime),
            ledgers: Arc::default(),
            record_ms: crate::flags::DEFAULT_RESERVATION_TTL_MS,
        }
    }

    /// This limiter's store, keys, key budget and metrics with its scripts
    /// on `clock` (the differential and quota-period tests step time with a
    /// [`crate::clock::FixedClock`]). It has no deny cache: that remembers
    /// by the system clock, which another clock does not follow.
    pub fn with_clock(&self, clock: Arc<dyn Clock>) -> Limiter {
        Limiter {
            store: Arc::clone(&self.store),
            prefix: self.prefix.clone(),
            metrics: self.metrics.clone(),
            deny: DenyCache::new(0),
            key_budget: self.key_budget,
            clock,
            ledgers: Arc::clone(&self.ledgers),
            record_ms: self.record_ms,
        }
    }

    /// How long a reservation record waits for its settlement
    /// (`--reservation-ttl`): a settlement after it finds nothing, and the
    /// request keeps what its check charged.
    pub fn with_reservation_ttl(mut self, ms: u64) -> Self {
        self.record_ms = ms.max(1);
        self
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

    /// The clock the scripts run at (the rate limit service's fixed window
    /// takes it too).
    pub(crate) fn clock(&self) -> &dyn Clock {
        self.clock.as_ref()
    }

    /// Checks a resolved request, all or nothing, at the limiter's clock.
    pub async fn check(&self, req: &Resolved) -> Result<CheckResponse, StoreError> {
        let prepared = self.prepare(req);
        let mut verdicts = Verdicts::new(req);
        let outcome = self.decide_alone(req, &prepared, &mut verdicts).await;
        self.conclude(req, &prepared, verdicts, outcome)
    }

    /// Checks the resolved checks of one batch (`POST /v3/check`), each
    /// answered as [`Limiter::check`] answers it alone, taken in arrival
    /// order; one answer per check, in order. A check's error (its Redis
    /// call failed, or it would pass the key budget) is its own: the others
    /// are still decided.
    ///
    /// The checks whose keys lie in one group (on a single Redis every
    /// check; on a cluster every check of one slot) and that the deny cache
    /// does not answer go in one `batch.lua` call per slot (the slots' calls
    /// run at once), which decides them in arrival order. The others take
    /// the path of a check alone, after those calls and in arrival order: a
    /// check the deny cache answers (it writes nothing), and on a cluster a
    /// check whose keys span slots (charged slot by slot, with refunds).
    pub async fn check_batch(&self, reqs: &[Resolved]) -> Vec<Result<CheckResponse, StoreError>> {
        self.metrics.batch_checks.observe(reqs.len() as f64);
        let prepared: Vec<Prepared> = reqs.iter().map(|r| self.prepare(r)).collect();
        let mut lots: Vec<(Option<Slot>, Vec<usize>)> = Vec::new();
        for (i, p) in prepared.iter().enumerate() {
            let [group] = p.groups.as_slice() else {
                continue;
            };
            if p.is_cached() {
                continue;
            }
            let slot = self.slot_of(group);
            match lots.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, members)) => members.push(i),
                None => lots.push((slot, vec![i])),
            }
        }
        let calls = lots
            .iter()
            .map(|(_, members)| self.run_lot(reqs, &prepared, members));
        let mut replies: Vec<Option<Result<CheckReply, StoreError>>> =
            reqs.iter().map(|_| None).collect();
        for ((_, members), answers) in lots.iter().zip(join_all(calls).await) {
            for (&i, answer) in members.iter().zip(answers) {
                if let Some(slot) = replies.get_mut(i) {
                    *slot = Some(answer);
                }
            }
        }
        let mut answers = Vec::with_capacity(reqs.len());
        for ((req, p), reply) in reqs.iter().zip(&prepared).zip(replies) {
            let mut verdicts = Verdicts::new(req);
            let outcome = match (reply, p.groups.first()) {
                (Some(Ok(reply)), Some(group)) => {
                    verdicts.place(group, &reply);
                    Ok(if reply.allowed {
                        Outcome::Allowed
                    } else {
                        Outcome::Denied
                    })
                }
                (Some(Err(e)), _) => Err(e),
                _ => self.decide_alone(req, p, &mut verdicts).await,
            };
            answers.push(self.conclude(req, p, verdicts, outcome));
        }
        answers
    }

    /// One `batch.lua` call for the checks `members` of `reqs` (one group
    /// each, all of one slot): each check's reply, or its error (the call's
    /// own for all of them when the call failed).
    async fn run_lot(
        &self,
        reqs: &[Resolved],
        prepared: &[Prepared],
        members: &[usize],
    ) -> Vec<Result<CheckReply, StoreError>> {
        let mut groups = Vec::with_capacity(members.len());
        let mut calls = Vec::with_capacity(members.len());
        for &i in members {
            if let (Some(req), Some(group)) =
                (reqs.get(i), prepared.get(i).and_then(|p| p.groups.first()))
            {
                let reservation = req.reservation.as_deref();
                calls.push(self.call_args(group, Mode::Charge, &req.domain, reservation));
                groups.push(group);
            }
        }
        let (keys, args) = script::batch_args(&calls);
        let entries = self
            .store
            .eval::<Vec<redis::Value>>(script::batch(), &keys, &args, "batch")
            .await
            .and_then(|r| script::parse_batch_reply(r, groups.len()).map_err(StoreError::Reply));
        match entries {
            Err(e) => groups.iter().map(|_| Err(e.clone())).collect(),
            Ok(entries) => entries
                .into_iter()
                .zip(groups)
                .map(|(entry, group)| match entry {
                    BatchEntry::Reply(reply) => read_reply(group, &reply),
                    BatchEntry::Error(text) => Err(StoreError::of_script(&text)),
                })
                .collect(),
        }
    }

    /// What a check needs before it is decided: its keys, what the deny
    /// cache answers, its groups.
    fn prepare(&self, req: &Resolved) -> Prepared {
        let limits = keys::limit_keys(&self.prefix, req);
        let quotas = keys::quota_keys(&self.prefix, req);
        // Counted from before the call: never longer than Redis's own wait.
        let asked_at = Instant::now();
        let bucket_keys = self.bucket_keys(req, &limits);
        let cached: Vec<Option<Vec<LimitVerdict>>> = bucket_keys
            .iter()
            .zip(&req.buckets)
            .map(|(k, b)| match k.is_empty() {
                true => None,
                false => self.deny.lookup(k, b.cost, asked_at),
            })
            .collect();
        let groups = self.groups(limits, quotas);
        Prepared {
            bucket_keys,
            cached,
            groups,
            asked_at,
        }
    }

    /// The steps of one check alone: the deny cache, or the charge in slot
    /// order.
    async fn decide_alone(
        &self,
        req: &Resolved,
        p: &Prepared,
        verdicts: &mut Verdicts,
    ) -> Result<Outcome, StoreError> {
        if p.is_cached() {
            self.metrics.deny_cache_hits.inc();
            verdicts.place_cached(&p.cached);
            self.peek_uncached(&p.groups, &p.cached, verdicts, &req.domain)
                .await?;
            Ok(Outcome::Cached)
        } else {
            self.charge_in_order(&p.groups, verdicts, req).await
        }
    }

    /// A decided check's answer (the deny cache remembering its denial, its
    /// denials counted), or its error (counted when it is the key budget).
    fn conclude(
        &self,
        req: &Resolved,
        p: &Prepared,
        verdicts: Verdicts,
        outcome: Result<Outcome, StoreError>,
    ) -> Result<CheckResponse, StoreError> {
        let answer = outcome.and_then(|outcome| self.answer(req, p, verdicts, outcome));
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

    /// The answer from every verdict of a decided check.
    fn answer(
        &self,
        req: &Resolved,
        p: &Prepared,
        verdicts: Verdicts,
        outcome: Outcome,
    ) -> Result<CheckResponse, StoreError> {
        let buckets = limit_results(req, verdicts.limits, &verdicts.stages)?;
        if outcome == Outcome::Denied {
            self.remember_denial(&p.bucket_keys, &buckets, req, p.asked_at);
        }
        let quotas = quota_results(req, verdicts.quotas)?;
        let allowed = outcome == Outcome::Allowed;
        if !allowed {
            self.count_denials(req, &buckets, &quotas);
        }
        Ok(CheckResponse {
            version: VERSION,
            allowed,
            buckets,
            quotas,
        })
    }

    /// Each bucket's keys, when the deny cache is on (else none: nothing is
    /// looked up or remembered); none for a watched or graduated bucket.
    fn bucket_keys(&self, req: &Resolved, limits: &[LimitKey]) -> Vec<Vec<String>> {
        if !self.deny.enabled() {
            return Vec::new();
        }
        (0..req.buckets.len())
            .map(|b| {
                let mut of_b = limits.iter().filter(|l| l.bucket == b).peekable();
                if of_b
                    .peek()
                    .is_some_and(|l| l.watched || l.graduated.is_some())
                {
                    return Vec::new();
                }
                of_b.map(|l| l.key.clone()).collect()
            })
            .collect()
    }

    /// One group on a single Redis; on a cluster one per slot.
    fn groups(&self, limits: Vec<LimitKey>, quotas: Vec<QuotaKey>) -> Vec<Group> {
        if self.store.is_cluster() {
            keys::group_by_slot(limits, quotas)
        } else {
            vec![Group { limits, quotas }]
        }
    }

    /// A bucket Redis denied lately answered from memory: the other buckets
    /// and the quotas are only read, so every limit and quota has an answer.
    async fn peek_uncached(
        &self,
        groups: &[Group],
        cached: &[Option<Vec<LimitVerdict>>],
        verdicts: &mut Verdicts,
        domain: &str,
    ) -> Result<(), StoreError> {
        for group in groups {
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
                let reply = self.run(&rest, Mode::Peek, domain, None).await?;
                verdicts.place(&rest, &reply);
            }
        }
        Ok(())
    }

    /// Charges the groups in order until one denies. Every group charged is
    /// on the refund list the moment its charge succeeded: a later failed
    /// step or denial gives all of them back.
    async fn charge_in_order(
        &self,
        groups: &[Group],
        verdicts: &mut Verdicts,
        req: &Resolved,
    ) -> Result<Outcome, StoreError> {
        let (domain, reservation) = (req.domain.as_str(), req.reservation.as_deref());
        // Each group charged: its index, its time, and whether its watched
        // limits were charged with it.
        let mut charged: Vec<(usize, u64, bool)> = Vec::new();
        for (gi, group) in groups.iter().enumerate() {
            let reply = match self.run(group, Mode::Charge, domain, reservation).await {
                Ok(reply) => reply,
                Err(e) => {
                    self.refund_all(groups, &charged, req).await;
                    return Err(e);
                }
            };
            verdicts.place(group, &reply);
            if reply.allowed {
                let watched_ok = group
                    .limits
                    .iter()
                    .zip(&reply.limits)
                    .all(|(l, v)| !l.watched || v.allowed);
                charged.push((gi, reply.now_ms, watched_ok));
                continue;
            }
            self.refund_all(groups, &charged, req).await;
            for group in groups.iter().skip(gi + 1) {
                let reply = self.run(group, Mode::Peek, domain, None).await?;
                verdicts.place(group, &reply);
            }
            verdicts.refunded_quotas(groups, &charged);
            return Ok(Outcome::Denied);
        }
        Ok(Outcome::Allowed)
    }

    /// Remembers each bucket of a denied answer in the deny cache.
    fn remember_denial(
        &self,
        bucket_keys: &[Vec<String>],
        buckets: &[BucketResult],
        req: &Resolved,
        asked_at: Instant,
    ) {
        for ((keys, answer), spec) in bucket_keys.iter().zip(buckets).zip(&req.buckets) {
            // A slot may be released any moment: a concurrency denial is never remembered.
            if spec.limits.iter().any(|l| l.in_flight) {
                continue;
            }
            // A watched or graduated bucket has no keys here.
            if keys.is_empty() {
                continue;
            }
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

    /// Counts each limit and quota that denied, by algorithm and period.
    fn count_denials(&self, req: &Resolved, buckets: &[BucketResult], quotas: &[QuotaResult]) {
        for (r, q) in quotas.iter().zip(&req.quotas) {
            if !r.allowed {
                self.metrics
                    .quota_denials
                    .with_label_values(&[q.period.name()])
                    .inc();
            }
        }
        for (bucket, spec) in buckets.iter().zip(&req.buckets) {
            if !spec.watch.is_enforced() {
                continue;
            }
            for (r, l) in bucket.limits.iter().zip(&spec.limits) {
                if !r.allowed {
                    self.metrics.denials.with_label_values(&[l.counter()]).inc();
                }
            }
        }
    }

    /// Leases tokens for a resolved lease request made by `caller` (the
    /// identity its ledger is kept under: `crate::auth::Caller::id`), at the
    /// limiter's clock.
    pub async fn lease(
        &self,
        req: &ResolvedLease,
        caller: &str,
    ) -> Result<LeaseResponse, StoreError> {
        let mut keys = keys::lease_keys(&self.prefix, req);
        keys.push(keys::ledger_key(&self.prefix, req, caller));
        let args = script::lease_args(req, self.clock());
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

    /// Settles one resolved settlement: per slot group, `settle.lua` over the
    /// group's record. Whether any group found its record (false: the
    /// settlement was replayed, or its reservation expired or never was).
    pub async fn settle(&self, s: &Resolved) -> Result<bool, StoreError> {
        let Some(id) = s.reservation.as_deref() else {
            return Ok(false);
        };
        let groups = self.groups(
            keys::limit_keys(&self.prefix, s),
            keys::quota_keys(&self.prefix, s),
        );
        let mut found = false;
        for group in &groups {
            let (ledger, budget) = self.ledger(group, &s.domain);
            let record = keys::record_key(&ledger, id);
            let (keys, args) = script::settle_args(group, self.clock(), &record, (&ledger, budget));
            let reply: Vec<i64> = self
                .store
                .eval(script::settle(), &keys, &args, "settle")
                .await?;
            found |= script::parse_settle_reply(&reply).map_err(StoreError::Reply)?;
        }
        Ok(found)
    }

    async fn run(
        &self,
        group: &Group,
        mode: Mode,
        domain: &str,
        reservation: Option<&str>,
    ) -> Result<CheckReply, StoreError> {
        let (keys, args) = self.call_args(group, mode, domain, reservation);
        let op = match mode {
            Mode::Charge => "check",
            Mode::Peek => "peek",
        };
        let reply: Vec<i64> = self.store.eval(script::check(), &keys, &args, op).await?;
        read_reply(group, &reply)
    }

    /// The keys and arguments of `check.lua` for `group`.
    fn call_args(
        &self,
        group: &Group,
        mode: Mode,
        domain: &str,
        reservation: Option<&str>,
    ) -> (Vec<String>, Vec<String>) {
        let (ledger, budget) = self.ledger(group, domain);
        let record = reservation.map(|id| keys::record_key(&ledger, id));
        let record = record.as_deref().map(|r| (r, self.record_ms));
        script::check_args(
            group,
            mode,
            self.clock(),
            (&ledger, budget),
            record,
            spread(),
        )
    }

    /// The cluster slot of `group`'s keys (they share one); `None` on a
    /// single Redis, where every key is in one place.
    fn slot_of(&self, group: &Group) -> Option<Slot> {
        if !self.store.is_cluster() {
            return None;
        }
        let first = group
            .limits
            .first()
            .map(|l| l.key.as_str())
            .or_else(|| group.quotas.first().map(|q| q.base.as_str()))
            .unwrap_or_default();
        Some(Slot::for_key(first.as_bytes()))
    }

    /// The domain's ledger of live keys for `group` and its budget: one per
    /// domain on a single Redis; on a cluster one per domain and slot (the
    /// script's keys share a slot), with [`keys::slot_budget`].
    fn ledger(&self, group: &Group, domain: &str) -> (String, u64) {
        let Some(slot) = self.slot_of(group) else {
            return (keys::live_ledger(&self.prefix, domain), self.key_budget);
        };
        let table = {
            let mut cache = self.ledgers.lock().unwrap_or_else(|e| e.into_inner());
            let table = cache
                .entry(domain.to_string())
                .or_insert_with(|| Arc::new(keys::LiveLedgers::new(&self.prefix, domain)));
            Arc::clone(table)
        };
        (table.in_slot(slot), keys::slot_budget(self.key_budget))
    }

    /// Gives back every charged group; failures are logged and counted (the
    /// client is then over-charged until its keys refill, never under-charged).
    async fn refund_all(&self, groups: &[Group], charged: &[(usize, u64, bool)], req: &Resolved) {
        for &(gi, at, watched_ok) in charged {
            let Some(group) = groups.get(gi) else {
                continue;
            };
            // Only what the group charged: its watched limits only with them.
            let only_charged;
            let group = if watched_ok || group.limits.iter().all(|l| !l.watched) {
                group
            } else {
                only_charged = Group {
                    limits: group
                        .limits
                        .iter()
                        .filter(|l| !l.watched)
                        .cloned()
                        .collect(),
                    quotas: group.quotas.clone(),
                };
                &only_charged
            };
            let record = req.reservation.as_deref().map(|id| {
                let (ledger, _) = self.ledger(group, &req.domain);
                keys::record_key(&ledger, id)
            });
            let (keys, args) = script::refund_args(group, at, self.clock(), record.as_deref());
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

impl Verdicts {
    /// No verdict yet for any limit or quota of `req`.
    fn new(req: &Resolved) -> Self {
        Verdicts {
            limits: req
                .buckets
                .iter()
                .map(|b| vec![None; b.limits.len()])
                .collect(),
            quotas: vec![None; req.quotas.len()],
            stages: vec![None; req.buckets.len()],
        }
    }

    /// The verdicts of one group's reply, at their limits and quotas.
    fn place(&mut self, group: &Group, reply: &CheckReply) {
        let special = group
            .limits
            .iter()
            .filter(|l| l.watched || l.graduated.is_some());
        for (lk, st) in special.zip(&reply.stages) {
            if let Some(slot) = self.stages.get_mut(lk.bucket) {
                // A bucket's first limit holds its stage (a graduated rule has one).
                if lk.limit == 0 {
                    *slot = Some(*st);
                }
            }
        }
        for (lk, r) in group.limits.iter().zip(&reply.limits) {
            if let Some(slot) = self
                .limits
                .get_mut(lk.bucket)
                .and_then(|b| b.get_mut(lk.limit))
            {
                *slot = Some(*r);
            }
        }
        for (qk, r) in group.quotas.iter().zip(&reply.quotas) {
            if let Some(slot) = self.quotas.get_mut(qk.quota) {
                *slot = Some(*r);
            }
        }
    }

    /// The deny cache's verdicts of the buckets it answered.
    fn place_cached(&mut self, cached: &[Option<Vec<LimitVerdict>>]) {
        for (b, verdicts) in cached.iter().enumerate() {
            for (l, v) in verdicts.iter().flatten().enumerate() {
                if let Some(slot) = self.limits.get_mut(b).and_then(|s| s.get_mut(l)) {
                    *slot = Some(*v);
                }
            }
        }
    }

    /// The groups charged before a denial were refunded: their quotas report
    /// what they had before the request, like every quota of a denied answer
    /// (they passed, so before = after + amount exactly).
    fn refunded_quotas(&mut self, groups: &[Group], charged: &[(usize, u64, bool)]) {
        for &(gi, _, _) in charged {
            for qk in groups.get(gi).map_or(&[][..], |g| &g.quotas) {
                if let Some(Some(r)) = self.quotas.get_mut(qk.quota) {
                    r.remaining = r.remaining.saturating_add(qk.amount);
                }
            }
        }
    }
}

/// A `check.lua` reply for `group`, decoded.
fn read_reply(group: &Group, reply: &[i64]) -> Result<CheckReply, StoreError> {
    let special = script::special_count(&group.limits);
    script::parse_check_reply(reply, group.limits.len(), group.quotas.len(), special)
        .map_err(StoreError::Reply)
}

/// Every limit's answer, in the request's order.
fn limit_results(
    req: &Resolved,
    verdicts: Vec<Vec<Option<LimitVerdict>>>,
    stages: &[Option<StageVerdict>],
) -> Result<Vec<BucketResult>, StoreError> {
    let mut buckets = Vec::with_capacity(req.buckets.len());
    for (b, (bucket, spec)) in verdicts.into_iter().zip(&req.buckets).enumerate() {
        let mut limits = Vec::with_capacity(spec.limits.len());
        for (r, limit) in bucket.into_iter().zip(&spec.limits) {
            let Some(r) = r else {
                return Err(StoreError::Reply("a limit got no answer".to_string()));
            };
            limits.push(LimitResult {
                requests: limit.requests,
                window_ms: limit.window_ms,
                algorithm: limit.algorithm,
                in_flight: limit.in_flight,
                allowed: r.allowed,
                remaining: r.remaining,
                reset_ms: r.reset_ms,
                retry_after_ms: r.retry_after_ms,
            });
        }
        let stage = stage_of(spec, stages.get(b).copied().flatten());
        buckets.push(BucketResult {
            limits,
            watch: spec.watch,
            stage,
        });
    }
    Ok(buckets)
}

/// A graduated bucket's stage from what `check.lua` found: the policy's
/// thresholds over the tokens in use. `None` for a bucket without stages
/// (or one peeked past its block, which has no stage to tell).
fn stage_of(spec: &ResolvedBucket, found: Option<StageVerdict>) -> Option<Stage> {
    let (s, v) = (spec.stages?, found?);
    let reached = |from: Option<u64>| !v.blocked && from.is_some_and(|f| v.used >= f);
    Some(Stage {
        used: v.used,
        warn: reached(s.warn_from),
        delay_ms: if reached(s.delay_from) { s.delay_ms } else { 0 },
        blocked: v.blocked,
    })
}

/// A share in `[0, 1)` for a new block's jitter.
fn spread() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// Every quota's answer, in the request's order.
fn quota_results(
    req: &Resolved,
    verdicts: Vec<Option<QuotaVerdict>>,
) -> Result<Vec<QuotaResult>, StoreError> {
    let mut quotas = Vec::with_capacity(verdicts.len());
    for (r, spec) in verdicts.into_iter().zip(&req.quotas) {
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
    Ok(quotas)
}
