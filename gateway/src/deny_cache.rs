//! The gateway's over-limit cache: a bucket that Redis denied is answered
//! denied from memory until Redis's wait is over, so that a client over its
//! limit costs no Redis call per request. It serves the callers that keep no
//! cache of their own: Envoy's native rate limit filter (`crate::rls`) and the
//! HTTP API; the wasm filter keeps one per proxy as well.
//!
//! An entry is one bucket, named by its resolved Redis keys (one per limit:
//! domain, tag, key, limit index and the limit itself, so a policy reload
//! that changes a limit names other keys and misses), and the cost that was
//! denied: only a request for exactly those keys, of that cost or more, is
//! answered from it. Its waits are Redis's, counted on this process's
//! monotonic clock from before the Redis call (the earliest moment Redis can
//! have answered), so an entry never outlasts Redis's own wait; only a refund
//! (a cluster group given back, a lease returned) can free a token earlier,
//! and then the cache errs on the strict side until the remembered time.
//!
//! Bounded: `--deny-cache-entries` slots, direct-mapped by a randomly keyed
//! hash of the keys (a client cannot aim at another's slot); a newer denial
//! takes its slot over.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::redis::script::LimitVerdict;

/// One remembered denial.
#[derive(Debug, Clone)]
struct Entry {
    /// The bucket's Redis keys, one per limit.
    keys: Vec<String>,
    /// The cost that was denied.
    cost: u64,
    /// When a request of `cost` can pass again: the longest wait of a denied limit.
    until: Instant,
    /// Per limit: Redis's verdict, and when it was asked.
    limits: Vec<LimitVerdict>,
    since: Instant,
}

/// The cache; with no slots it remembers nothing.
#[derive(Debug)]
pub struct DenyCache {
    slots: Vec<Mutex<Option<Entry>>>,
    hasher: RandomState,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl DenyCache {
    /// A cache of `entries` slots; 0 turns it off.
    pub fn new(entries: usize) -> DenyCache {
        DenyCache {
            slots: (0..entries).map(|_| Mutex::new(None)).collect(),
            hasher: RandomState::new(),
        }
    }

    /// Whether the cache is on.
    pub fn enabled(&self) -> bool {
        !self.slots.is_empty()
    }

    fn slot(&self, keys: &[String]) -> Option<&Mutex<Option<Entry>>> {
        if self.slots.is_empty() {
            return None;
        }
        let h = self.hasher.hash_one(keys);
        let len = self.slots.len() as u64;
        self.slots.get(usize::try_from(h % len).ok()?)
    }

    /// The verdicts of the bucket named by `keys` for a request of `cost` at
    /// `now`, when a denial of it is remembered and its wait is not over: as
    /// Redis would answer now (a denied limit has nothing left; the waits and
    /// resets less the time gone by).
    pub fn lookup(&self, keys: &[String], cost: u64, now: Instant) -> Option<Vec<LimitVerdict>> {
        let slot = self.slot(keys)?;
        let guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        let e = guard.as_ref()?;
        if e.keys != keys || cost < e.cost || now < e.since || now >= e.until {
            return None;
        }
        let gone = ms(now - e.since);
        Some(
            e.limits
                .iter()
                .map(|l| LimitVerdict {
                    allowed: l.allowed,
                    remaining: if l.allowed { l.remaining } else { 0 },
                    reset_ms: l.reset_ms.saturating_sub(gone),
                    retry_after_ms: if l.allowed {
                        0
                    } else {
                        // At least 1 ms while denied: the entry lives until the longest wait.
                        l.retry_after_ms.saturating_sub(gone).max(1)
                    },
                })
                .collect(),
        )
    }

    /// Remembers the bucket named by `keys` when Redis denied a request of
    /// `cost` in one of its `limits`, asked at `since`.
    pub fn remember(&self, keys: &[String], cost: u64, limits: &[LimitVerdict], since: Instant) {
        let Some(wait) = limits
            .iter()
            .filter(|l| !l.allowed)
            .map(|l| l.retry_after_ms)
            .max()
        else {
            return;
        };
        let Some(slot) = self.slot(keys) else {
            return;
        };
        let entry = Entry {
            keys: keys.to_vec(),
            cost,
            until: since + Duration::from_millis(wait),
            limits: limits.to_vec(),
            since,
        };
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &str) -> Vec<String> {
        vec![format!("rl:{{d|t}}|{k}|0"), format!("rl:{{d|t}}|{k}|1")]
    }

    fn verdict(allowed: bool, remaining: u64, retry_after_ms: u64) -> LimitVerdict {
        LimitVerdict {
            allowed,
            remaining,
            reset_ms: 60_000,
            retry_after_ms,
        }
    }

    #[test]
    fn a_denial_answers_as_redis_would_less_the_time_gone_by_until_its_wait() {
        let c = DenyCache::new(64);
        let t0 = Instant::now();
        c.remember(
            &keys("a"),
            2,
            &[verdict(true, 7, 0), verdict(false, 1, 1500)],
            t0,
        );
        let at = t0 + Duration::from_millis(400);
        assert_eq!(
            c.lookup(&keys("a"), 2, at),
            Some(vec![
                LimitVerdict {
                    allowed: true,
                    remaining: 7,
                    reset_ms: 59_600,
                    retry_after_ms: 0
                },
                LimitVerdict {
                    allowed: false,
                    remaining: 0,
                    reset_ms: 59_600,
                    retry_after_ms: 1100
                },
            ])
        );
        assert!(c
            .lookup(&keys("a"), 5, t0 + Duration::from_millis(1499))
            .is_some());
        assert_eq!(
            c.lookup(&keys("a"), 2, t0 + Duration::from_millis(1500)),
            None
        );
        // A smaller cost may fit; other keys (another bucket, a changed limit) miss.
        assert_eq!(c.lookup(&keys("a"), 1, at), None);
        assert_eq!(c.lookup(&keys("b"), 2, at), None);
        assert_eq!(c.lookup(&keys("a")[..1], 2, at), None);
    }

    #[test]
    fn allowed_answers_are_not_kept_one_slot_holds_the_latest_and_zero_is_off() {
        let t0 = Instant::now();
        let c = DenyCache::new(1);
        c.remember(&keys("a"), 1, &[verdict(true, 3, 0)], t0);
        assert_eq!(c.lookup(&keys("a"), 1, t0), None);
        c.remember(&keys("a"), 1, &[verdict(false, 0, 900)], t0);
        c.remember(&keys("b"), 1, &[verdict(false, 0, 900)], t0);
        assert_eq!(c.lookup(&keys("a"), 1, t0), None);
        assert!(c.lookup(&keys("b"), 1, t0).is_some());
        let off = DenyCache::new(0);
        assert!(!off.enabled());
        off.remember(&keys("a"), 1, &[verdict(false, 0, 900)], t0);
        assert_eq!(off.lookup(&keys("a"), 1, t0), None);
    }
}
