//! Redis key layout and cluster slot grouping.
//!
//! One key per limit (a lease names the same keys as a check of the same
//! bucket, [`lease_keys`]):
//! `<prefix>{<domain>|<tag>}|<key>|<limit index>|<algorithm>|<requests>|<window_ms>`
//! (a concurrency limit's `algorithm` part is `concurrent`, its `requests`
//! the slots, its `window_ms` the longest hold: a sorted set of slots).
//! The `{…}` hash tag puts every key of one domain and tag in one cluster
//! slot; the limit's parameters in the name make a changed limit start a
//! fresh key. `domain`, `tag` and `key` are escaped (`%` → `%25`, `|` → `%7C`,
//! `{` → `%7B`, `}` → `%7D`) so that no two different requests can name the
//! same key and a `}` in a tag cannot end the hash tag early.
//!
//! One key per quota and period:
//! `<prefix>{<domain>|<tag>}|q|<key>|<period>|<period start, epoch s>`. The
//! gateway passes the key without its last part ([`quota_base_key`], which
//! routes the script to the right slot); the script appends the start of the
//! current period, which only it knows (time comes from Redis `TIME`). The
//! limit is not in the name: a client moved to another tier keeps its count.
//! A quota key never equals a limit key: its fourth part is a period name,
//! where a limit key has an algorithm name.
//!
//! A graduated limit has two more keys beside its own ([`Graduated`]):
//! `<limit key>|demand`, the client's demand (a token bucket's state), and
//! `<limit key>|block`, the end of its block (ms), expiring with it. Same
//! hash tag, so the same slot; eight `|` parts, where a limit key has seven.
//! Both are counted in the domain's key budget.
//!
//! One lease ledger per caller and bucket ([`ledger_key`]): the bucket's
//! first limit key, then `|held|<caller>`: what the caller was granted and has
//! not given back, which caps what it may give back. Same hash tag, so the
//! same slot as the bucket; it has more `|` parts than any limit or quota key.
//! The limits come from the policy, so a changed policy starts fresh keys
//! (and ledgers), never keys a request chose.

use redis::cluster_routing::Slot;
use std::collections::HashMap;

use crate::policy::{Resolved, ResolvedLease};
use crate::protocol::{Limit as LimitSpec, Period};

/// One limit of one bucket, with its Redis key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitKey {
    /// Index of the bucket in the request.
    pub bucket: usize,
    /// Index of the limit in the bucket.
    pub limit: usize,
    /// The Redis key.
    pub key: String,
    /// The limit.
    pub spec: LimitSpec,
    /// What the request costs in this limit (its bucket's cost).
    pub cost: u64,
    /// Tokens of debt a settlement may leave (its bucket's).
    pub debt: u64,
    /// The bucket is watched: its denial does not deny the check.
    pub watched: bool,
    /// The keys and stages of a graduated limit (its rule's one limit).
    pub graduated: Option<Box<Graduated>>,
}

/// A graduated limit's keys beside its own, and its stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Graduated {
    /// The client's demand: `<limit key>|demand`.
    pub demand: String,
    /// The end of the client's block: `<limit key>|block`.
    pub block: String,
    /// The policy's stages for the limit.
    pub stages: crate::policy::Stages,
}

/// One quota of the request, with the base of its Redis key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaKey {
    /// Index of the quota in the request.
    pub quota: usize,
    /// The key without the period start ([`quota_base_key`]).
    pub base: String,
    /// The calendar period.
    pub period: Period,
    /// Amount per period.
    pub limit: u64,
    /// What this request counts.
    pub amount: u64,
}

/// Keys that share one cluster slot, in request order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Group {
    /// The limits of this group.
    pub limits: Vec<LimitKey>,
    /// The quotas of this group.
    pub quotas: Vec<QuotaKey>,
}

/// Escapes the characters that structure a key.
pub fn escape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for ch in part.chars() {
        match ch {
            '%' => out.push_str("%25"),
            '|' => out.push_str("%7C"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

/// The Redis key of limit `index` of a bucket.
pub fn redis_key(
    prefix: &str,
    domain: &str,
    tag: &str,
    key: &str,
    index: usize,
    spec: &LimitSpec,
) -> String {
    format!(
        "{prefix}{{{}|{}}}|{}|{index}|{}|{}|{}",
        escape(domain),
        escape(tag),
        escape(key),
        spec.counter(),
        spec.requests,
        spec.window_ms
    )
}

/// The Redis key of a quota without its last part, the period start:
/// `<prefix>{<domain>|<tag>}|q|<key>|<period>`.
pub fn quota_base_key(prefix: &str, domain: &str, tag: &str, key: &str, period: Period) -> String {
    format!(
        "{prefix}{{{}|{}}}|q|{}|{}",
        escape(domain),
        escape(tag),
        escape(key),
        period.name()
    )
}

/// The full Redis key of a quota in the period starting at `start_s` (epoch
/// seconds, UTC), as the script names it (the tests' check of the layout).
#[cfg(test)]
fn quota_key(
    prefix: &str,
    domain: &str,
    tag: &str,
    key: &str,
    period: Period,
    start_s: u64,
) -> String {
    format!(
        "{}|{start_s}",
        quota_base_key(prefix, domain, tag, key, period)
    )
}

/// Every quota of the request with its key base, in request order.
pub fn quota_keys(prefix: &str, req: &Resolved) -> Vec<QuotaKey> {
    req.quotas
        .iter()
        .enumerate()
        .map(|(q, spec)| QuotaKey {
            quota: q,
            base: quota_base_key(prefix, &req.domain, &spec.tag, &spec.key, spec.period),
            period: spec.period,
            limit: spec.limit,
            amount: spec.amount,
        })
        .collect()
}

/// Every limit of the request with its key, in request order.
pub fn limit_keys(prefix: &str, req: &Resolved) -> Vec<LimitKey> {
    let mut out = Vec::new();
    for (b, bucket) in req.buckets.iter().enumerate() {
        for (l, spec) in bucket.limits.iter().enumerate() {
            let key = redis_key(prefix, &req.domain, &bucket.tag, &bucket.key, l, spec);
            // The stages are shares of the rule's one limit.
            let graduated = bucket.stages.filter(|_| l == 0).map(|stages| {
                Box::new(Graduated {
                    demand: format!("{key}|demand"),
                    block: format!("{key}|block"),
                    stages,
                })
            });
            out.push(LimitKey {
                bucket: b,
                limit: l,
                key,
                spec: *spec,
                cost: bucket.cost,
                debt: bucket.debt,
                watched: !bucket.watch.is_enforced(),
                graduated,
            });
        }
    }
    out
}

/// The Redis keys of a lease's limits, in order: the keys [`limit_keys`]
/// gives a check bucket with the same domain, tag, key and limits, so that
/// leases and checks draw from one bucket. One tag, hence one cluster slot.
pub fn lease_keys(prefix: &str, req: &ResolvedLease) -> Vec<String> {
    req.limits
        .iter()
        .enumerate()
        .map(|(l, spec)| redis_key(prefix, &req.domain, &req.tag, &req.key, l, spec))
        .collect()
}

/// The ledger of what `caller` holds of a lease's bucket: its first limit
/// key (`lease_keys`), then `|held|<caller>` (escaped).
pub fn ledger_key(prefix: &str, req: &ResolvedLease, caller: &str) -> String {
    let first = req
        .limits
        .first()
        .map(|spec| redis_key(prefix, &req.domain, &req.tag, &req.key, 0, spec))
        .unwrap_or_default();
    format!("{first}|held|{}", escape(caller))
}

/// Splits limits and quotas by cluster slot, groups ordered by first
/// appearance (limits first, then quotas).
pub fn group_by_slot(limits: Vec<LimitKey>, quotas: Vec<QuotaKey>) -> Vec<Group> {
    fn group_of(groups: &mut Vec<(Slot, Group)>, key: &str) -> usize {
        let slot = Slot::for_key(key.as_bytes());
        match groups.iter().position(|(s, _)| *s == slot) {
            Some(i) => i,
            None => {
                groups.push((slot, Group::default()));
                groups.len() - 1
            }
        }
    }
    let mut groups: Vec<(Slot, Group)> = Vec::new();
    for lk in limits {
        let i = group_of(&mut groups, &lk.key);
        if let Some((_, g)) = groups.get_mut(i) {
            g.limits.push(lk);
        }
    }
    for qk in quotas {
        let i = group_of(&mut groups, &qk.base);
        if let Some((_, g)) = groups.get_mut(i) {
            g.quotas.push(qk);
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// The reservation record of request `id` beside `ledger`, the domain's
/// ledger of live keys in the slot of the keys it reserves ([`live_ledger`],
/// [`LiveLedgers`]): `<ledger>|r|<id>`. Named by the slot, not by the
/// keys, so that a settlement naming some of a check's buckets finds the
/// record of its slot; no limit, quota or ledger key ends so.
pub fn record_key(ledger: &str, id: &str) -> String {
    format!("{ledger}|r|{id}")
}

/// The ledger of a domain's live keys on a single Redis (or Sentinel
/// master): `<prefix>{<domain>|live}`, a sorted set of key → expiry (ms)
/// that `check.lua` keeps to enforce the key budget. Its hash tag holds a
/// `|` that no escaped tag holds, so it never names a limit or quota key.
pub fn live_ledger(prefix: &str, domain: &str) -> String {
    format!("{prefix}{{{}|live}}", escape(domain))
}

/// A domain's ledgers of live keys on a cluster, one per slot (a script's
/// keys share one slot): `<prefix>{<domain>|live|<n>}` with, for each slot,
/// the first `n` whose hash tag falls in it. Found in one pass over `n`
/// (about 170,000 tries: every slot's first hit), once per domain.
#[derive(Debug)]
pub struct LiveLedgers {
    base: String,
    first: HashMap<Slot, u32>,
}

impl LiveLedgers {
    /// The table of `domain`'s ledgers under `prefix`.
    pub fn new(prefix: &str, domain: &str) -> LiveLedgers {
        let base = format!("{prefix}{{{}|live|", escape(domain));
        let mut first = HashMap::with_capacity(SLOTS);
        let mut key = String::with_capacity(base.len() + 12);
        // 2^24 tries find every slot with certainty in practice; a slot
        // never found gets the last key (the script then fails CROSSSLOT: a 503).
        let mut n: u32 = 0;
        while first.len() < SLOTS && n < 1 << 24 {
            key.clear();
            key.push_str(&base);
            key.push_str(&n.to_string());
            key.push('}');
            first.entry(Slot::for_key(key.as_bytes())).or_insert(n);
            n += 1;
        }
        LiveLedgers { base, first }
    }

    /// The ledger in `slot`.
    pub fn in_slot(&self, slot: Slot) -> String {
        let n = self.first.get(&slot).copied().unwrap_or(1 << 24);
        format!("{}{n}}}", self.base)
    }
}

/// Redis Cluster's hash slots.
const SLOTS: usize = 16_384;

/// The live keys a domain may hold in one cluster slot for a budget of
/// `budget` per domain: four times its even share of the 16,384 slots,
/// rounded up (hashing spreads a domain's keys unevenly), so a domain holds
/// at most 65,536 × ceil(budget / 16,384) keys on a cluster.
pub fn slot_budget(budget: u64) -> u64 {
    budget.div_ceil(16_384).saturating_mul(4)
}

/// A key prefix must not contain a hash-tag brace, or the `{…}` would not be
/// the first one in the key.
pub fn check_prefix(prefix: &str) -> Result<(), String> {
    if prefix.contains(['{', '}']) {
        return Err(format!(
            "key prefix {prefix:?} must not contain '{{' or '}}'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_has_a_ledger_of_its_own_found_in_one_pass() {
        let ledgers = LiveLedgers::new("rl:", "api");
        assert_eq!(ledgers.first.len(), SLOTS);
        for i in [0u16, 1, 5_000, 16_383] {
            let slot = Slot::new(i).unwrap();
            let ledger = ledgers.in_slot(slot);
            assert_eq!(Slot::for_key(ledger.as_bytes()), slot, "{ledger}");
        }
    }

    #[test]
    fn a_domains_ledger_of_live_keys_can_sit_in_any_slot() {
        assert_eq!(live_ledger("rl:", "a|b"), "rl:{a%7Cb|live}");
        for key in [
            "rl:{api|c=1}|q|m/c=1|month",
            "rl:{api|c=2}|x",
            "rl:{api|}|y",
        ] {
            let slot = Slot::for_key(key.as_bytes());
            let ledger = LiveLedgers::new("rl:", "api").in_slot(slot);
            assert!(ledger.starts_with("rl:{api|live|"), "{ledger}");
            assert_eq!(Slot::for_key(ledger.as_bytes()), slot, "{ledger}");
        }
        assert_eq!(
            (slot_budget(0), slot_budget(1), slot_budget(100_000)),
            (0, 4, 28)
        );
    }
    use crate::protocol::Algorithm;

    const TB: LimitSpec = LimitSpec {
        requests: 60,
        window_ms: 60000,
        algorithm: Algorithm::TokenBucket,
        in_flight: false,
    };

    #[test]
    fn layout() {
        assert_eq!(
            redis_key("rl:", "demo", "c=alice", "per-client/c=alice", 0, &TB),
            "rl:{demo|c=alice}|per-client/c=alice|0|token_bucket|60|60000"
        );
        assert_eq!(
            redis_key("rl:", "a|b", "}x{", "k%", 1, &TB),
            "rl:{a%7Cb|%7Dx%7B}|k%25|1|token_bucket|60|60000"
        );
    }

    #[test]
    fn one_tag_is_one_slot() {
        let a = redis_key("rl:", "d", "t", "k1", 0, &TB);
        let b = redis_key("rl:", "d", "t", "other", 3, &TB);
        assert_eq!(Slot::for_key(&a), Slot::for_key(b));
        let q = quota_base_key("rl:", "d", "t", "monthly/c=x", Period::Month);
        assert_eq!(Slot::for_key(&a), Slot::for_key(&q));
        let full = quota_key("rl:", "d", "t", "monthly/c=x", Period::Month, 1_769_904_000);
        assert_eq!(Slot::for_key(&a), Slot::for_key(full));
    }

    #[test]
    fn a_lease_names_the_keys_of_the_same_check_bucket() {
        let limits = vec![
            TB,
            LimitSpec {
                requests: 5,
                window_ms: 1000,
                algorithm: Algorithm::TokenBucket,
                in_flight: false,
            },
        ];
        let lease = ResolvedLease {
            domain: "d|x".to_string(),
            key: "rule/client=abc".to_string(),
            tag: "client=abc}".to_string(),
            limits: limits.clone(),
            want: 3,
            returned: 0,
            ttl_ms: 2000,
        };
        let check = Resolved {
            domain: lease.domain.clone(),
            buckets: vec![crate::policy::ResolvedBucket {
                key: lease.key.clone(),
                tag: lease.tag.clone(),
                cost: 1,
                limits,
                debt: 0,
                ..Default::default()
            }],
            quotas: vec![],
            reservation: None,
        };
        let from_check: Vec<String> = limit_keys("rl:", &check)
            .into_iter()
            .map(|k| k.key)
            .collect();
        assert_eq!(lease_keys("rl:", &lease), from_check);
        assert_eq!(
            from_check,
            [
                "rl:{d%7Cx|client=abc%7D}|rule/client=abc|0|token_bucket|60|60000",
                "rl:{d%7Cx|client=abc%7D}|rule/client=abc|1|token_bucket|5|1000"
            ]
        );
        // The ledger: same slot, a key no check or quota can name.
        let ledger = ledger_key("rl:", &lease, "ip:10.0.0.1|x");
        assert_eq!(
            ledger,
            "rl:{d%7Cx|client=abc%7D}|rule/client=abc|0|token_bucket|60|60000|held|ip:10.0.0.1%7Cx"
        );
        assert_eq!(Slot::for_key(&ledger), Slot::for_key(&from_check[0]));
    }

    #[test]
    fn quota_layout() {
        assert_eq!(
            quota_key(
                "rl:",
                "demo",
                "c=alice",
                "monthly/c=alice",
                Period::Month,
                1_769_904_000
            ),
            "rl:{demo|c=alice}|q|monthly/c=alice|month|1769904000"
        );
        assert_eq!(
            quota_base_key("rl:", "a|b", "}x{", "k%|", Period::Minute),
            "rl:{a%7Cb|%7Dx%7B}|q|k%25%7C|minute"
        );
    }
}
