//! Lease mode for global token-bucket rules: the proxy reserves a batch of a
//! bucket's tokens from the gateway and its workers spend them through one
//! slot in shared data, so most requests need no callout.
//!
//! Accuracy: a proxy never holds more than one lease's worth of unspent tokens
//! per bucket (a refill asks for `size − held`), and every token it spends was
//! charged in Redis first. So at any moment the tokens admitted across proxies
//! are at most what the gateway alone would admit plus `instances × size`.
//!
//! Slots are direct-mapped (`max_leases` keys): a bucket whose slot another
//! bucket holds with a live lease is checked per request instead, so the state
//! stays bounded whatever the number of clients.
//!
//! A slot's deadlines are read bounded by their spans from now (the batch: its
//! ttl; a callout: its timeout; the empty pool and the limits' resets: the
//! gateway's clamp of twice the longest period), and a bounded slot is written
//! back. With the filter's monotonic time the bound never binds; if the clock
//! stepped back, an empty pool is refused for at most what the gateway said,
//! counted from the step, not for the step on top.

use crate::limits::algorithm::Algorithm;
use crate::limits::limiter::{LimitError, Report, Seen, MAX_ATTEMPTS};
use crate::limits::store::SharedStore;
use crate::limits::update::update;
use crate::policy::plan::{GlobalBucket, LeasePlan, Plan};

/// Where one global bucket's lease lives, and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Shared-data key of the slot.
    pub slot_key: String,
    /// Identity of the bucket in the slot.
    pub fingerprint: u64,
    /// Tokens per batch.
    pub size: u64,
    /// The bucket, for the callout body and the reports.
    pub bucket: GlobalBucket,
    /// How far from now each of the slot's deadlines can be.
    pub spans: Spans,
}

/// The longest a slot's deadlines reach past the moment they are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spans {
    /// A batch's life (`ttl_ms`).
    pub ttl_ns: u64,
    /// A lease callout's timeout (`max_wait_ms`).
    pub wait_ns: u64,
    /// An empty pool's wait and a limit's reset: twice the longest period, as
    /// the gateway's answer is clamped (`callout.rs`).
    pub gateway_ns: u64,
}

/// A slot's content: one bucket's unspent batch and what the gateway last said.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slot {
    /// The bucket holding the slot; 0 for none.
    pub fingerprint: u64,
    /// Unspent tokens.
    pub tokens: u64,
    /// After this the batch may no longer be spent.
    pub expires_ns: u64,
    /// A callout for this slot is in flight until then.
    pub fetching_until_ns: u64,
    /// The gateway had no token to give until then: deny without asking again.
    pub empty_until_ns: u64,
    /// Per limit: tokens the gateway had left at the last grant, and when that limit is full again.
    pub limits: Vec<(u64, u64)>,
}

const MAGIC: u8 = b'L';
const MAX_LIMITS: usize = 8;
/// Fixed words before the per-limit pairs.
const WORDS: usize = 5;

impl Slot {
    /// The bytes stored in shared data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + 8 * (WORDS + 2 * self.limits.len()));
        out.push(MAGIC);
        out.push(self.limits.len().min(MAX_LIMITS) as u8);
        for v in [
            self.fingerprint,
            self.tokens,
            self.expires_ns,
            self.fetching_until_ns,
            self.empty_until_ns,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for (remaining, reset_at) in self.limits.iter().take(MAX_LIMITS) {
            out.extend_from_slice(&remaining.to_le_bytes());
            out.extend_from_slice(&reset_at.to_le_bytes());
        }
        out
    }

    /// Reads stored bytes; `None` for anything that is not a slot.
    pub fn decode(bytes: &[u8]) -> Option<Slot> {
        let (&magic, rest) = bytes.split_first()?;
        let (&n, rest) = rest.split_first()?;
        let n = usize::from(n);
        if magic != MAGIC || n > MAX_LIMITS || rest.len() != 8 * (WORDS + 2 * n) {
            return None;
        }
        let mut words = rest
            .chunks_exact(8)
            .map(|c| c.try_into().map(u64::from_le_bytes).unwrap_or_default());
        let mut next = || words.next().unwrap_or_default();
        let mut slot = Slot {
            fingerprint: next(),
            tokens: next(),
            expires_ns: next(),
            fetching_until_ns: next(),
            empty_until_ns: next(),
            limits: Vec::with_capacity(n),
        };
        for _ in 0..n {
            let remaining = next();
            slot.limits.push((remaining, next()));
        }
        Some(slot)
    }

    /// The slot with no deadline further from `now_ns` than its span.
    fn bounded(mut self, now_ns: u64, spans: &Spans) -> Slot {
        let bound = |t: &mut u64, span: u64| *t = (*t).min(now_ns.saturating_add(span));
        bound(&mut self.expires_ns, spans.ttl_ns);
        bound(&mut self.fetching_until_ns, spans.wait_ns);
        bound(&mut self.empty_until_ns, spans.gateway_ns);
        for (_, reset_at) in &mut self.limits {
            bound(reset_at, spans.gateway_ns);
        }
        self
    }

    fn live(&self, now_ns: u64) -> bool {
        self.expires_ns > now_ns
    }

    fn fetching(&self, now_ns: u64) -> bool {
        self.fetching_until_ns > now_ns
    }
}

/// The lease of `g`, when lease mode is on and its rule can lease (token
/// bucket; a concurrency rule's slots are taken per request).
pub fn locate(plan: &Plan, g: &GlobalBucket) -> Option<Lease> {
    let lp = plan.global.as_ref()?.lease.as_ref()?;
    let rule = plan.rules.get(g.rule)?;
    if rule.algorithm != Algorithm::TokenBucket || rule.in_flight {
        return None;
    }
    let limits = rule.limits(g.variant);
    let smallest = limits.iter().map(|(l, _)| l.capacity).min()?;
    let longest = limits.iter().map(|(l, _)| l.period_ns).max()?;
    let size = ((smallest as f64 * lp.fraction).floor() as u64).clamp(1, smallest.max(1));
    let placed = lp.slots.place(&[g.key.as_bytes()]);
    Some(Lease {
        slot_key: placed.key,
        fingerprint: placed.fingerprint,
        size,
        bucket: g.clone(),
        spans: Spans {
            ttl_ns: lp.ttl_ns,
            wait_ns: lp.max_wait_ms.saturating_mul(1_000_000),
            gateway_ns: longest.saturating_mul(2),
        },
    })
}

/// What spending from a lease gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// The tokens were spent; the slot as written.
    Taken(Slot),
    /// Not enough in the lease, and no callout in flight: fetch a batch.
    Short,
    /// The slot is another bucket's, or a callout for it is in flight: check per request.
    Busy,
    /// The gateway said the pool is empty for this long yet: deny here.
    Empty {
        /// Nanoseconds until the gateway expects a token.
        wait_ns: u64,
    },
}

/// Read-modify-write of a slot ([`update`]); `change` returns the new slot
/// and a result, or only a result to leave the slot as it is. A slot never
/// written reads as empty. With `now_ns`, `change` sees the slot bounded at
/// that time, and a slot the bound changed is written back even when `change`
/// leaves it, so that the bound counts from the clock step instead of sliding
/// with the clock.
fn update_slot<T>(
    store: &impl SharedStore,
    lease: &Lease,
    now_ns: Option<u64>,
    mut change: impl FnMut(Slot) -> (Option<Slot>, T),
) -> Result<T, LimitError> {
    let out = update(store, &lease.slot_key, MAX_ATTEMPTS, |bytes| {
        let stored = bytes.and_then(Slot::decode).unwrap_or_default();
        let slot = match now_ns {
            Some(now) => stored.clone().bounded(now, &lease.spans),
            None => stored.clone(),
        };
        let bounded = slot != stored;
        let (new, out) = change(slot.clone());
        let new = new.or_else(|| bounded.then_some(slot));
        (new.map(|s| s.encode()), out)
    })?;
    Ok(out)
}

/// Spends `lease.bucket.cost` tokens from the lease.
pub fn take(store: &impl SharedStore, lease: &Lease, now_ns: u64) -> Result<Take, LimitError> {
    let cost = lease.bucket.cost;
    update_slot(store, lease, Some(now_ns), |mut s| {
        let ours = s.fingerprint == lease.fingerprint;
        if ours && s.live(now_ns) && s.tokens >= cost {
            s.tokens -= cost;
            let written = s.clone();
            return (Some(s), Take::Taken(written));
        }
        if ours && s.empty_until_ns > now_ns {
            let wait_ns = s.empty_until_ns - now_ns;
            return (None, Take::Empty { wait_ns });
        }
        let free = !ours && !s.live(now_ns) && !s.fetching(now_ns);
        if (ours && !s.fetching(now_ns)) || free {
            (None, Take::Short)
        } else {
            (None, Take::Busy)
        }
    })
}

/// Gives `tokens` back to the lease (a request it served was denied elsewhere).
pub fn give_back(store: &impl SharedStore, lease: &Lease, tokens: u64) -> Result<(), LimitError> {
    update_slot(store, lease, None, |mut s| {
        if s.fingerprint != lease.fingerprint {
            return (None, ());
        }
        s.tokens = s.tokens.saturating_add(tokens);
        (Some(s), ())
    })
}

/// Takes the slot for one callout; `Some(claim)` when this caller must make
/// it: what to ask for, and the unspent tokens of an expired batch to give
/// back to the gateway. `refresh` claims only a live batch running low (the
/// root timer).
pub fn claim(
    store: &impl SharedStore,
    lease: &Lease,
    lp: &LeasePlan,
    now_ns: u64,
    refresh: bool,
) -> Result<Option<Claim>, LimitError> {
    let until = now_ns.saturating_add(lp.max_wait_ms.saturating_mul(1_000_000));
    update_slot(store, lease, Some(now_ns), |mut s| {
        let ours = s.fingerprint == lease.fingerprint;
        if s.fetching(now_ns) || (!ours && s.live(now_ns)) {
            return (None, None);
        }
        let low = ours && s.live(now_ns) && s.tokens.saturating_mul(2) <= lease.size;
        if refresh && (!low || s.empty_until_ns > now_ns) {
            return (None, None);
        }
        let claim = if ours && s.live(now_ns) {
            // A live batch keeps its tokens: ask only for the rest of a lease.
            Claim {
                returned: 0,
                want: lease.size.saturating_sub(s.tokens).max(lease.bucket.cost),
            }
        } else {
            // Expired (or another bucket's, expired): give back what is unspent.
            let returned = if ours { s.tokens } else { 0 };
            if !ours {
                s.limits.clear();
            }
            s.fingerprint = lease.fingerprint;
            s.tokens = 0;
            s.expires_ns = 0;
            Claim {
                returned,
                want: lease.size.max(lease.bucket.cost),
            }
        };
        s.fetching_until_ns = until;
        (Some(s), Some(claim))
    })
}

/// A callout this caller owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// Unspent tokens of an expired batch, given back.
    pub returned: u64,
    /// Tokens to ask for.
    pub want: u64,
}

/// Stores a grant: `granted` tokens arrive, the caller spends `spend` of them
/// at once, and the batch may be spent until `ttl` from now. `empty_ns` > 0
/// says the gateway has no token for that long.
#[allow(clippy::too_many_arguments)]
pub fn store_grant(
    store: &impl SharedStore,
    lease: &Lease,
    lp: &LeasePlan,
    granted: u64,
    spend: u64,
    limits: &[(u64, u64)],
    empty_ns: u64,
    now_ns: u64,
) -> Result<Slot, LimitError> {
    update_slot(store, lease, Some(now_ns), |mut s| {
        if s.fingerprint != lease.fingerprint {
            // Another bucket took the slot meanwhile: the rest is lost, which errs on the strict side.
            return (None, s);
        }
        let held = if s.live(now_ns) { s.tokens } else { 0 };
        s.tokens = held.saturating_add(granted).saturating_sub(spend);
        s.expires_ns = now_ns.saturating_add(lp.ttl_ns);
        s.fetching_until_ns = 0;
        s.empty_until_ns = now_ns.saturating_add(empty_ns);
        s.limits = limits
            .iter()
            .map(|(remaining, reset_ms)| (*remaining, now_ns.saturating_add(reset_ms * 1_000_000)))
            .collect();
        let written = s.clone();
        (Some(s), written)
    })
}

/// Ends a failed callout: the slot may be claimed again at once.
pub fn release(store: &impl SharedStore, lease: &Lease) -> Result<(), LimitError> {
    update_slot(store, lease, None, |mut s| {
        if s.fingerprint != lease.fingerprint || s.fetching_until_ns == 0 {
            return (None, ());
        }
        s.fetching_until_ns = 0;
        (Some(s), ())
    })
}

/// Reports for a request the empty pool refuses: nothing left, and the wait.
pub fn empty_reports(plan: &Plan, lease: &Lease, slot_wait_ns: u64, now_ns: u64) -> Vec<Report> {
    let mut reports = reports(plan, lease, &Slot::default(), now_ns);
    for r in &mut reports {
        r.check.allowed = false;
        r.check.remaining = 0;
        r.check.retry_after_ns = slot_wait_ns.max(1);
    }
    reports
}

/// Reports for a request served from the lease. `remaining` estimates the
/// whole pool: what the gateway had left at the last grant plus this proxy's
/// unspent batch, never above the limit.
pub fn reports(plan: &Plan, lease: &Lease, slot: &Slot, now_ns: u64) -> Vec<Report> {
    let g = &lease.bucket;
    plan.limits(g.rule, g.variant)
        .iter()
        .enumerate()
        .map(|(i, (limit, _))| {
            let (pool, reset_at) = slot.limits.get(i).copied().unwrap_or((0, now_ns));
            Report {
                rule: g.rule,
                variant: g.variant,
                limit: i,
                used_share: 0.0,
                blocked: false,
                cost: g.cost,
                enforced: None,
                check: Seen {
                    allowed: true,
                    remaining: pool.saturating_add(slot.tokens).min(limit.capacity),
                    reset_ns: reset_at.saturating_sub(now_ns),
                    retry_after_ns: 0,
                },
            }
        })
        .collect()
}

/// Most leases one worker's timer keeps topped up.
pub const WATCHED: usize = 32;

/// The leases a worker used lately, for its timer to top up: bounded, the
/// least recently used goes first, and a lease idle for a whole `ttl` is let go.
#[derive(Debug, Default)]
pub struct Watched {
    entries: Vec<(Lease, u64)>,
}

impl Watched {
    /// Notes that `lease` served a request at `now_ns`.
    pub fn touch(&mut self, lease: &Lease, now_ns: u64) {
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|(l, _)| l.fingerprint == lease.fingerprint && l.slot_key == lease.slot_key)
        {
            e.1 = now_ns;
            return;
        }
        if self.entries.len() >= WATCHED {
            if let Some(oldest) =
                (0..self.entries.len()).min_by_key(|&i| self.entries.get(i).map_or(0, |e| e.1))
            {
                self.entries.swap_remove(oldest);
            }
        }
        self.entries.push((lease.clone(), now_ns));
    }

    /// The leases used within `ttl_ns` of `now_ns`; forgets the others.
    pub fn recent(&mut self, now_ns: u64, ttl_ns: u64) -> Vec<Lease> {
        self.entries
            .retain(|(_, used)| used.saturating_add(ttl_ns) > now_ns);
        self.entries.iter().map(|(l, _)| l.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::limits::store::MemoryStore;

    const MS: u64 = 1_000_000;
    const T0: u64 = 1_700_000_000_000 * MS;

    fn plan(fraction: f64) -> Plan {
        let json = format!(
            r#"{{"domain":"d","global":{{"cluster":"gw","lease":{{"fraction":{fraction},"ttl_ms":1000,"max_wait_ms":20}}}},
            "rules":[{{"name":"g","scope":"global","key":["header:x-k"],"limits":[{{"requests":100,"per":"1m"}}]}}]}}"#
        );
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [3; 16])
    }

    fn lease(plan: &Plan, key: &str, cost: u64) -> Lease {
        let g = GlobalBucket {
            rule: 0,
            variant: 0,
            key: format!("g/x-k={key}"),
            tag: format!("x-k={key}"),
            cost,
        };
        locate(plan, &g).unwrap()
    }

    fn lp(plan: &Plan) -> &LeasePlan {
        plan.global.as_ref().unwrap().lease.as_ref().unwrap()
    }

    #[test]
    fn slots_round_trip_and_garbage_is_not_a_slot() {
        let s = Slot {
            fingerprint: 7,
            tokens: 3,
            expires_ns: 9,
            fetching_until_ns: 11,
            empty_until_ns: 13,
            limits: vec![(5, 6), (7, 8)],
        };
        assert_eq!(Slot::decode(&s.encode()), Some(s.clone()));
        let mut bad = s.encode();
        bad.pop();
        assert_eq!(Slot::decode(&bad), None);
        assert_eq!(Slot::decode(b""), None);
        assert_eq!(Slot::decode(&[MAGIC, 9]), None);
    }

    #[test]
    fn size_is_a_share_of_the_smallest_limit_and_at_least_one() {
        let p = plan(0.05);
        assert_eq!(lease(&p, "a", 1).size, 5);
        let p = plan(0.001);
        assert_eq!(lease(&p, "a", 1).size, 1);
    }

    #[test]
    fn a_batch_is_fetched_once_spent_exactly_and_refetched_with_what_is_left() {
        let p = plan(0.05);
        let s = MemoryStore::default();
        let l = lease(&p, "a", 1);
        assert_eq!(take(&s, &l, T0).unwrap(), Take::Short);
        let c = claim(&s, &l, lp(&p), T0, false).unwrap().unwrap();
        assert_eq!(
            c,
            Claim {
                returned: 0,
                want: 5
            }
        );
        // While the callout is in flight, others check per request.
        assert_eq!(take(&s, &l, T0).unwrap(), Take::Busy);
        assert_eq!(claim(&s, &l, lp(&p), T0, false).unwrap(), None);
        let slot = store_grant(&s, &l, lp(&p), 5, 1, &[(90, 6000)], 0, T0).unwrap();
        assert_eq!(slot.tokens, 4);
        for left in (0..4).rev() {
            match take(&s, &l, T0 + MS).unwrap() {
                Take::Taken(slot) => assert_eq!(slot.tokens, left),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(take(&s, &l, T0 + MS).unwrap(), Take::Short);
        // Expired with 2 unspent: they go back with the next callout.
        give_back(&s, &l, 2).unwrap();
        let later = T0 + 1001 * MS;
        assert_eq!(take(&s, &l, later).unwrap(), Take::Short);
        let c = claim(&s, &l, lp(&p), later, false).unwrap().unwrap();
        assert_eq!(
            c,
            Claim {
                returned: 2,
                want: 5
            }
        );
    }

    #[test]
    fn the_timer_refreshes_only_a_live_batch_at_half_or_less_and_never_past_one_lease() {
        let p = plan(0.1); // size 10
        let s = MemoryStore::default();
        let l = lease(&p, "a", 1);
        assert_eq!(
            claim(&s, &l, lp(&p), T0, true).unwrap(),
            None,
            "nothing to refresh"
        );
        claim(&s, &l, lp(&p), T0, false).unwrap().unwrap();
        store_grant(&s, &l, lp(&p), 10, 1, &[(80, 1)], 0, T0).unwrap();
        assert_eq!(
            claim(&s, &l, lp(&p), T0, true).unwrap(),
            None,
            "9 of 10 left"
        );
        for _ in 0..4 {
            take(&s, &l, T0).unwrap();
        }
        let c = claim(&s, &l, lp(&p), T0, true).unwrap().unwrap();
        assert_eq!(
            c,
            Claim {
                returned: 0,
                want: 5
            }
        );
        let slot = store_grant(&s, &l, lp(&p), 5, 0, &[(75, 1)], 0, T0 + MS).unwrap();
        assert_eq!(slot.tokens, 10, "held never exceeds one lease");
    }

    #[test]
    fn a_failed_callout_releases_the_slot_and_a_live_foreign_lease_is_left_alone() {
        let p = plan(0.05);
        let s = MemoryStore::default();
        let a = lease(&p, "a", 1);
        claim(&s, &a, lp(&p), T0, false).unwrap().unwrap();
        release(&s, &a).unwrap();
        assert!(claim(&s, &a, lp(&p), T0, false).unwrap().is_some());
        store_grant(&s, &a, lp(&p), 5, 0, &[(0, 0)], 0, T0).unwrap();
        // A bucket that collides with a live lease is checked per request.
        let mut b = lease(&p, "b", 1);
        b.slot_key = a.slot_key.clone();
        assert_eq!(take(&s, &b, T0).unwrap(), Take::Busy);
        assert_eq!(claim(&s, &b, lp(&p), T0, false).unwrap(), None);
        // Once it expired, the slot changes hands and a's leftover is not given to b.
        let later = T0 + 2000 * MS;
        assert_eq!(take(&s, &b, later).unwrap(), Take::Short);
        let c = claim(&s, &b, lp(&p), later, false).unwrap().unwrap();
        assert_eq!(c.returned, 0);
        assert_eq!(take(&s, &a, later).unwrap(), Take::Busy);
    }

    #[test]
    fn an_empty_pool_is_refused_here_until_the_gateway_expects_a_token() {
        let p = plan(0.05);
        let s = MemoryStore::default();
        let l = lease(&p, "a", 1);
        claim(&s, &l, lp(&p), T0, false).unwrap().unwrap();
        store_grant(&s, &l, lp(&p), 0, 0, &[(0, 36_000)], 300 * MS, T0).unwrap();
        assert_eq!(
            take(&s, &l, T0 + 100 * MS).unwrap(),
            Take::Empty { wait_ns: 200 * MS }
        );
        assert_eq!(claim(&s, &l, lp(&p), T0 + 100 * MS, true).unwrap(), None);
        assert_eq!(take(&s, &l, T0 + 300 * MS).unwrap(), Take::Short);
    }

    #[test]
    fn a_clock_step_back_refuses_an_empty_pool_two_periods_at_most_counted_from_the_step() {
        let p = plan(0.05);
        let s = MemoryStore::default();
        let l = lease(&p, "a", 1);
        claim(&s, &l, lp(&p), T0, false).unwrap().unwrap();
        store_grant(&s, &l, lp(&p), 0, 0, &[(0, 36_000)], 300_000 * MS, T0).unwrap();
        // The limit is 100/min: the gateway's waits are clamped to 2 min, so is the pool's.
        let back = T0 - 3_600_000 * MS;
        assert_eq!(
            take(&s, &l, back).unwrap(),
            Take::Empty {
                wait_ns: 120_000 * MS
            }
        );
        // Stored: the bound counts from the step, it does not slide with the clock.
        assert_eq!(
            take(&s, &l, back + 60_000 * MS).unwrap(),
            Take::Empty {
                wait_ns: 60_000 * MS
            }
        );
        assert_eq!(take(&s, &l, back + 120_000 * MS).unwrap(), Take::Short);
    }

    #[test]
    fn cost_above_the_batch_asks_for_the_cost() {
        let p = plan(0.05);
        let s = MemoryStore::default();
        let l = lease(&p, "a", 8);
        let c = claim(&s, &l, lp(&p), T0, false).unwrap().unwrap();
        assert_eq!(c.want, 8);
    }

    #[test]
    fn the_watch_list_is_bounded_and_forgets_idle_leases() {
        let p = plan(0.05);
        let mut w = Watched::default();
        for i in 0..100u64 {
            let mut l = lease(&p, &i.to_string(), 1);
            l.slot_key = format!("k{i}");
            w.touch(&l, T0 + i * MS);
        }
        let recent = w.recent(T0 + 100 * MS, 1000 * MS);
        assert_eq!(recent.len(), WATCHED);
        assert!(
            recent.iter().all(|l| l.slot_key != "k0"),
            "the oldest went first"
        );
        assert_eq!(w.recent(T0 + 1068 * MS, 1000 * MS).len(), 31);
        assert!(w.recent(T0 + 2000 * MS, 1000 * MS).is_empty());
    }

    #[test]
    fn reports_estimate_the_pool_within_the_limit() {
        let p = plan(0.05);
        let l = lease(&p, "a", 1);
        let slot = Slot {
            fingerprint: l.fingerprint,
            tokens: 3,
            expires_ns: T0 + 1,
            fetching_until_ns: 0,
            empty_until_ns: 0,
            limits: vec![(98, T0 + 500 * MS)],
        };
        let r = reports(&p, &l, &slot, T0);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].check.remaining, 100);
        assert_eq!(r[0].check.reset_ns, 500 * MS);
    }
}
