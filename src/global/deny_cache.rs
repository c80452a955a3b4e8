//! The deny cache: when the gateway denies a bucket in per-request mode,
//! every worker of the proxy answers that bucket's requests 429 itself until
//! the gateway's wait is over, so that a client over its global limit costs
//! no callout (and no Redis call) per request.
//!
//! An entry names one bucket (its key and variant, through the fingerprint of
//! a direct-mapped slot, [`Slots`]) and the cost that was denied: only a
//! request of that bucket, of that cost or more, is denied by it. Another
//! rule, variant, quota or client, or a bucket that shares the slot, asks the
//! gateway as before. The wait counts from the callout, the earliest moment
//! Redis can have answered, so an entry never outlasts the gateway's wait:
//! after it a token was free (unless taken meanwhile) and the next request
//! asks the gateway. Only a refund or a policy reload on the gateway's side
//! can free a token earlier; the entry then errs on the strict side, and only
//! until its time.
//!
//! Times are the filter's monotonic epoch time: a wall-clock step cannot
//! stretch an entry. An entry read before it was written (the clock went
//! back) or reaching further than the gateway can say (twice the window, the
//! gateway's declared window bounded by the rule's own longest) is not
//! trusted, and the gateway is asked.

use crate::limits::limiter::{Enforced, LimitError, Report, Seen, MAX_ATTEMPTS};
use crate::limits::slots::{Placed, Slots};
use crate::limits::store::SharedStore;
use crate::limits::update::update;
use crate::policy::plan::{GlobalBucket, Plan};
use ratelimit_protocol::Variant;

const MS: u64 = 1_000_000;
const MAGIC: u8 = b'D';
const WORDS: usize = 8;

/// One remembered denial: the bucket, and its binding limit as the gateway said.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    /// The bucket in the slot ([`Placed::fingerprint`]); 0 for none.
    pub fingerprint: u64,
    /// The cost that was denied: a request of this cost or more is denied.
    pub cost: u64,
    /// When the callout was made.
    pub since_ns: u64,
    /// When the gateway expected `cost` tokens again.
    pub until_ns: u64,
    /// When the binding limit is full again.
    pub reset_at_ns: u64,
    /// Index of the binding limit in the bucket.
    pub limit: u64,
    /// The binding limit as the gateway enforced it: requests per window.
    pub requests: u64,
    /// Its window, in ms.
    pub window_ms: u64,
}

impl Entry {
    /// The bytes stored in shared data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 8 * WORDS);
        out.push(MAGIC);
        for v in [
            self.fingerprint,
            self.cost,
            self.since_ns,
            self.until_ns,
            self.reset_at_ns,
            self.limit,
            self.requests,
            self.window_ms,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Reads stored bytes; `None` for anything that is not an entry.
    pub fn decode(bytes: &[u8]) -> Option<Entry> {
        let (&magic, rest) = bytes.split_first()?;
        if magic != MAGIC || rest.len() != 8 * WORDS {
            return None;
        }
        let mut words = rest
            .chunks_exact(8)
            .map(|c| c.try_into().map(u64::from_le_bytes).unwrap_or_default());
        let mut next = || words.next().unwrap_or_default();
        Some(Entry {
            fingerprint: next(),
            cost: next(),
            since_ns: next(),
            until_ns: next(),
            reset_at_ns: next(),
            limit: next(),
            requests: next(),
            window_ms: next(),
        })
    }

    /// Whether this entry denies a request of `cost` at `now_ns`.
    fn denies(&self, cost: u64, now_ns: u64) -> bool {
        let longest = self.window_ms.saturating_mul(2 * MS);
        cost >= self.cost
            && self.since_ns <= now_ns
            && now_ns < self.until_ns
            && self.until_ns - self.since_ns <= longest
    }
}

/// The slot of `g` in the deny cache, when the cache is on; none for a
/// concurrency rule, whose slot may be released any moment.
fn place(plan: &Plan, g: &GlobalBucket) -> Option<Placed> {
    let slots: &Slots = plan.global.as_ref()?.deny_cache.as_ref()?;
    let rule = plan.rules.get(g.rule).filter(|r| !r.in_flight)?;
    let variant = &rule.variants.get(g.variant)?.wire;
    // The wire name of the variant, without allocating it.
    let (kind, name): (&[u8], &[u8]) = match variant {
        Variant::Default => (b"default", b""),
        Variant::Tier(t) => (b"tier", t.as_bytes()),
        Variant::Client(c) => (b"client", c.as_bytes()),
        Variant::Set(n) => (b"set", n.as_bytes()),
    };
    Some(slots.place(&[g.key.as_bytes(), kind, name]))
}

/// The reports of a request that the cache denies: one per denied bucket
/// (its binding limit, nothing left, the gateway's waits less the time gone
/// by), or `None` when no bucket of `global` is denied at `now_ns`. A failed
/// read is `Err`; the caller then asks the gateway.
pub fn lookup(
    plan: &Plan,
    store: &impl SharedStore,
    global: &[GlobalBucket],
    now_ns: u64,
) -> Result<Option<Vec<Report>>, LimitError> {
    let mut reports = Vec::new();
    for g in global {
        let Some(placed) = place(plan, g) else {
            continue;
        };
        let Some((bytes, _)) = store.get(&placed.key)? else {
            continue;
        };
        let Some(e) = Entry::decode(&bytes) else {
            continue;
        };
        if e.fingerprint != placed.fingerprint || !e.denies(g.cost, now_ns) {
            continue;
        }
        reports.push(Report {
            rule: g.rule,
            variant: g.variant,
            limit: usize::try_from(e.limit).unwrap_or(0),
            used_share: 0.0,
            blocked: false,
            cost: g.cost,
            enforced: Some(Enforced {
                requests: e.requests,
                window_ms: e.window_ms,
            }),
            check: Seen {
                allowed: false,
                remaining: 0,
                reset_ns: e.reset_at_ns.saturating_sub(now_ns),
                retry_after_ns: e.until_ns - now_ns,
            },
        });
    }
    Ok((!reports.is_empty()).then_some(reports))
}

/// Remembers every bucket of `global` that the gateway's answer denied
/// (`reports`: one per limit, bucket after bucket, as
/// [`crate::global::callout::parse_answer`] gives them), its waits counted
/// from `sent_ns`, when the callout was made. A newer denial replaces
/// whatever its slot held.
pub fn remember(
    plan: &Plan,
    store: &impl SharedStore,
    global: &[GlobalBucket],
    reports: &[Report],
    sent_ns: u64,
) -> Result<(), LimitError> {
    // A bucket's reports start at its limit 0.
    let starts = reports.iter().enumerate().filter(|(_, r)| r.limit == 0);
    let ends = starts
        .clone()
        .skip(1)
        .map(|(i, _)| i)
        .chain([reports.len()]);
    for ((g, (start, _)), end) in global.iter().zip(starts).zip(ends) {
        let Some(binding) = reports
            .get(start..end)
            .unwrap_or_default()
            .iter()
            .filter(|r| !r.check.allowed)
            .max_by_key(|r| r.check.retry_after_ns)
        else {
            continue;
        };
        let Some(placed) = place(plan, g) else {
            continue;
        };
        let enforced = binding.enforced.unwrap_or_else(|| {
            let own = plan.limits(g.rule, g.variant).get(binding.limit);
            Enforced {
                requests: own.map_or(0, |(l, _)| l.capacity),
                window_ms: own.map_or(0, |(l, _)| l.period_ns / MS),
            }
        });
        // The gateway's window is bounded by the rule's own: an answer
        // declaring a longer one cannot keep a client cached as denied
        // past twice the longest window this proxy's configuration gives.
        let own_ms = plan
            .limits(g.rule, g.variant)
            .iter()
            .map(|(l, _)| l.period_ns / MS)
            .max()
            .unwrap_or(0);
        let entry = Entry {
            fingerprint: placed.fingerprint,
            cost: g.cost,
            since_ns: sent_ns,
            until_ns: sent_ns.saturating_add(binding.check.retry_after_ns),
            reset_at_ns: sent_ns.saturating_add(binding.check.reset_ns),
            limit: binding.limit as u64,
            requests: enforced.requests,
            window_ms: enforced.window_ms.min(own_ms),
        }
        .encode();
        update(store, &placed.key, MAX_ATTEMPTS, |_| {
            (Some(entry.clone()), ())
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::limits::store::MemoryStore;

    const T0: u64 = 1_700_000_000_000 * MS;

    fn plan(slots: u64) -> Plan {
        let json = format!(
            r#"{{"domain":"d","global":{{"cluster":"gw","deny_cache":{slots}}},
            "rules":[{{"name":"g","scope":"global","key":["header:x-k"],"limits":[{{"requests":10,"per":"1m"}},{{"requests":2,"per":"1s"}}]}}]}}"#
        );
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [3; 16])
    }

    fn bucket(key: &str, cost: u64) -> GlobalBucket {
        GlobalBucket {
            rule: 0,
            variant: 0,
            key: format!("g/x-k={key}"),
            tag: format!("x-k={key}"),
            cost,
        }
    }

    /// The gateway's reports for one bucket: limit `i` allowed or waiting `retry_ms[i]`.
    fn answer(retry_ms: &[u64]) -> Vec<Report> {
        retry_ms
            .iter()
            .enumerate()
            .map(|(i, &retry)| Report {
                rule: 0,
                variant: 0,
                limit: i,
                used_share: 0.0,
                blocked: false,
                cost: 1,
                enforced: Some(Enforced {
                    requests: 10,
                    window_ms: 60_000,
                }),
                check: Seen {
                    allowed: retry == 0,
                    remaining: 0,
                    reset_ns: 50_000 * MS,
                    retry_after_ns: retry * MS,
                },
            })
            .collect()
    }

    #[test]
    fn entries_round_trip_and_garbage_is_not_an_entry() {
        let e = Entry {
            fingerprint: 1,
            cost: 2,
            since_ns: 3,
            until_ns: 4,
            reset_at_ns: 5,
            limit: 6,
            requests: 7,
            window_ms: 8,
        };
        assert_eq!(Entry::decode(&e.encode()), Some(e));
        let mut bad = e.encode();
        bad.pop();
        assert_eq!(Entry::decode(&bad), None);
        assert_eq!(Entry::decode(b""), None);
        bad = e.encode();
        bad[0] = b'L';
        assert_eq!(Entry::decode(&bad), None);
    }

    #[test]
    fn the_binding_limit_is_denied_until_its_wait_counted_from_the_callout() {
        let p = plan(16);
        let s = MemoryStore::default();
        let a = [bucket("a", 2)];
        remember(&p, &s, &a, &answer(&[0, 700, 0]), T0).unwrap();
        let r = lookup(&p, &s, &a, T0 + 200 * MS).unwrap().unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].limit, r[0].cost), (1, 2));
        assert_eq!(r[0].check.retry_after_ns, 500 * MS);
        assert_eq!(r[0].check.reset_ns, 49_800 * MS);
        assert_eq!((r[0].check.allowed, r[0].check.remaining), (false, 0));
        assert_eq!(
            r[0].enforced,
            Some(Enforced {
                requests: 10,
                window_ms: 60_000
            })
        );
        assert!(lookup(&p, &s, &a, T0 + 699 * MS).unwrap().is_some());
        assert_eq!(lookup(&p, &s, &a, T0 + 700 * MS).unwrap(), None);
        // Before the callout (a clock that went back): not trusted.
        assert_eq!(lookup(&p, &s, &a, T0 - 1).unwrap(), None);
        // A smaller cost may fit where 2 did not; a larger one cannot.
        assert_eq!(lookup(&p, &s, &[bucket("a", 1)], T0).unwrap(), None);
        assert!(lookup(&p, &s, &[bucket("a", 3)], T0).unwrap().is_some());
    }

    #[test]
    fn only_denied_buckets_are_remembered_and_a_slot_holds_the_latest() {
        let p = plan(1);
        let s = MemoryStore::default();
        let ab = [bucket("a", 1), bucket("b", 1)];
        let mut reports = answer(&[0, 0]);
        reports.extend(answer(&[900, 0]));
        remember(&p, &s, &ab, &reports, T0).unwrap();
        assert_eq!(lookup(&p, &s, &ab[..1], T0).unwrap(), None);
        let r = lookup(&p, &s, &ab, T0).unwrap().unwrap();
        assert_eq!((r.len(), r[0].check.retry_after_ns), (1, 900 * MS));
        // One slot: a's denial replaces b's.
        remember(&p, &s, &ab[..1], &answer(&[300, 0]), T0).unwrap();
        assert_eq!(lookup(&p, &s, &ab[1..], T0).unwrap(), None);
        assert!(lookup(&p, &s, &ab[..1], T0).unwrap().is_some());
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn a_gateway_window_longer_than_the_rules_own_is_not_cached() {
        // A hostile or mismatched gateway declares a 366-day window and a
        // 370-day wait: the rule's own longest window is 1 minute, so the
        // denial holds for that one answer and the next request calls out.
        let p = plan(4);
        let s = MemoryStore::default();
        let a = [bucket("a", 1)];
        let day_ms = 86_400_000;
        let mut hostile = answer(&[370 * day_ms, 0]);
        for r in &mut hostile {
            r.enforced = Some(Enforced {
                requests: 1,
                window_ms: 366 * day_ms,
            });
        }
        remember(&p, &s, &a, &hostile, T0).unwrap();
        assert_eq!(lookup(&p, &s, &a, T0 + MS).unwrap(), None);
        // Within the rule's own bound (twice its longest window), a long
        // declared window still caches the wait.
        let mut long = answer(&[90_000, 0]);
        for r in &mut long {
            r.enforced = Some(Enforced {
                requests: 1,
                window_ms: 366 * day_ms,
            });
        }
        remember(&p, &s, &a, &long, T0).unwrap();
        let r = lookup(&p, &s, &a, T0 + MS).unwrap().unwrap();
        assert_eq!(r[0].check.retry_after_ns, 89_999 * MS);
        assert_eq!(lookup(&p, &s, &a, T0 + 90_000 * MS).unwrap(), None);
    }

    #[test]
    fn an_entry_past_twice_the_window_and_the_cache_turned_off_deny_nothing() {
        let p = plan(4);
        let s = MemoryStore::default();
        let a = [bucket("a", 1)];
        remember(&p, &s, &a, &answer(&[120_001, 0]), T0).unwrap();
        assert_eq!(lookup(&p, &s, &a, T0).unwrap(), None);
        let off = plan(0);
        remember(&off, &s, &a, &answer(&[500]), T0).unwrap();
        assert_eq!(lookup(&off, &s, &a, T0).unwrap(), None);
        assert_eq!(s.len(), 1);
    }
}
