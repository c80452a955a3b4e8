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
//! A request charged from its response settles against the slot it spent
//! from ([`settle`]): a response that cost more takes the difference from the
//! unspent tokens, and what they cannot cover becomes the slot's debt, paid
//! from the next batch before anything is spent from it and refused meanwhile
//! for as long as the rule's refill takes to cover it, as a local bucket in
//! debt; a response that cost less gives the difference back to the same
//! batch while it lives.
//!
//! A slot's deadlines are read bounded by their spans from now (the batch: its
//! ttl; a callout: its timeout; the empty pool and the limits' resets: the
//! gateway's clamp of twice the longest period; a debt's wait: the refill of
//! the most debt it may hold), and a bounded slot is written back. With the
//! filter's monotonic time the bound never binds; if the clock stepped back,
//! an empty pool is refused for at most what the gateway said, counted from
//! the step, not for the step on top.

use crate::limits::algorithm::Algorithm;
use crate::limits::limiter::{LimitError, Report, Seen, MAX_ATTEMPTS};
use crate::limits::store::SharedStore;
use crate::limits::token_bucket::Limit;
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
    /// How much debt a settlement may leave, and how fast it is covered.
    pub debt: DebtTerms,
}

/// The bound and the pace of a slot's debt: the rule's slowest limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebtTerms {
    /// Most tokens owed ([`crate::limits::token_bucket::Limit::debt`]:
    /// `DEBT_OVERRUNS` responses of `max`; 0 for a rule charged up front).
    pub cap: u64,
    /// The slowest limit: `capacity` tokens refill in `period_ns`.
    pub capacity: u64,
    /// See `capacity`.
    pub period_ns: u64,
}

impl DebtTerms {
    /// Nanoseconds (rounded up) the refill takes to cover `tokens`.
    pub fn wait_ns(&self, tokens: u64) -> u64 {
        let ns = (u128::from(tokens) * u128::from(self.period_ns))
            .div_ceil(u128::from(self.capacity.max(1)));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }
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
    /// A debt's wait: the refill of the most debt the slot may hold.
    pub debt_ns: u64,
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
    /// Tokens owed to the bucket: settlements past the unspent tokens. Paid
    /// from the next grant before anything is spent; never beside unspent
    /// tokens (one of the two is 0).
    pub debt: u64,
    /// While `debt` is owed, the refill has covered it at this time; 0 without debt.
    pub debt_until_ns: u64,
    /// Per limit: tokens the gateway had left at the last grant, and when that limit is full again.
    pub limits: Vec<(u64, u64)>,
}

/// The slot's layout version: `M` holds the debt, `L` (read, never written) did not.
const MAGIC: u8 = b'M';
const MAGIC_V1: u8 = b'L';
const MAX_LIMITS: usize = 8;
/// Fixed words before the per-limit pairs (`WORDS_V1` in a slot written as `L`).
const WORDS: usize = 7;
const WORDS_V1: usize = 5;

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
            self.debt,
            self.debt_until_ns,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for (remaining, reset_at) in self.limits.iter().take(MAX_LIMITS) {
            out.extend_from_slice(&remaining.to_le_bytes());
            out.extend_from_slice(&reset_at.to_le_bytes());
        }
        out
    }

    /// Reads stored bytes; `None` for anything that is not a slot. A slot
    /// of the layout before the debt (a filter upgraded in place) reads
    /// without debt, so that its batch is not lost.
    pub fn decode(bytes: &[u8]) -> Option<Slot> {
        let (&magic, rest) = bytes.split_first()?;
        let (&n, rest) = rest.split_first()?;
        let n = usize::from(n);
        let words = match magic {
            MAGIC => WORDS,
            MAGIC_V1 => WORDS_V1,
            _ => return None,
        };
        if n > MAX_LIMITS || rest.len() != 8 * (words + 2 * n) {
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
            debt: 0,
            debt_until_ns: 0,
            limits: Vec::with_capacity(n),
        };
        if magic == MAGIC {
            slot.debt = next();
            slot.debt_until_ns = next();
        }
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
        bound(&mut self.debt_until_ns, spans.debt_ns);
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

    /// A debt whose wait is not over: the slot is in use even with its batch
    /// expired, so another bucket cannot take it and drop the debt.
    fn owing(&self, now_ns: u64) -> bool {
        self.debt > 0 && self.debt_until_ns > now_ns
    }

    /// While in debt, how long a request of `cost` waits: until the refill
    /// has covered the debt and the request's own cost, as a local bucket in
    /// debt answers. `None` once that is over (or without debt).
    pub fn debt_wait_ns(&self, terms: &DebtTerms, cost: u64, now_ns: u64) -> Option<u64> {
        if self.debt == 0 {
            return None;
        }
        let until = self.debt_until_ns.saturating_add(terms.wait_ns(cost));
        (until > now_ns).then(|| until - now_ns)
    }

    /// Charges `n` tokens past what a request spent: from the unspent tokens,
    /// and what they cannot cover as debt, at most `terms.cap` in all. The
    /// debt's wait grows by the refill of what it added. Returns the tokens
    /// past the cap, forgiven.
    fn charge(&mut self, terms: &DebtTerms, n: u64, now_ns: u64) -> u64 {
        let from_batch = n.min(self.tokens);
        self.tokens -= from_batch;
        let rest = n - from_batch;
        let added = rest.min(terms.cap.saturating_sub(self.debt));
        if added > 0 {
            self.debt += added;
            self.debt_until_ns = self
                .debt_until_ns
                .max(now_ns)
                .saturating_add(terms.wait_ns(added));
        }
        rest - added
    }

    /// Pays the debt from `n` tokens (its wait shrinks by their refill);
    /// returns what is left of them.
    fn pay(&mut self, terms: &DebtTerms, n: u64) -> u64 {
        let paid = n.min(self.debt);
        self.debt -= paid;
        self.debt_until_ns = if self.debt == 0 {
            0
        } else {
            self.debt_until_ns.saturating_sub(terms.wait_ns(paid))
        };
        n - paid
    }

    /// Gives `n` tokens back: to the debt first, then to a live batch up to
    /// one lease (`size`). Returns what found no place: tokens of an expired
    /// batch, or past one lease, are not returned (Redis charged them; they
    /// come back through its refill).
    fn give(&mut self, lease: &Lease, n: u64, now_ns: u64) -> u64 {
        let rest = self.pay(&lease.debt, n);
        if !self.live(now_ns) {
            return rest;
        }
        let added = rest.min(lease.size.saturating_sub(self.tokens));
        self.tokens += added;
        rest - added
    }
}

/// The lease of `g`, when lease mode is on and its rule can lease (token
/// bucket; a concurrency rule's slots are taken per request).
pub fn locate(plan: &Plan, g: &GlobalBucket) -> Option<Lease> {
    let lp = plan.global.as_ref()?.lease.as_ref()?;
    let rule = plan.rules.get(g.rule)?;
    // A shadow or graduated rule is checked per request: a batch would
    // skip its stages, its block and its never-deny.
    if rule.algorithm != Algorithm::TokenBucket
        || rule.in_flight
        || rule.shadow
        || rule.graduated.is_some()
    {
        return None;
    }
    let limits = rule.limits(g.variant);
    let smallest = limits.iter().map(|(l, _)| l.capacity).min()?;
    let longest = limits.iter().map(|(l, _)| l.period_ns).max()?;
    let size = ((smallest as f64 * lp.fraction).floor() as u64).clamp(1, smallest.max(1));
    let debt = debt_terms(limits)?;
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
            debt_ns: debt.wait_ns(debt.cap),
        },
        debt,
    })
}

/// The debt terms of a rule's limits: its debt bound, and its slowest limit
/// (the longest time per token), whose refill covers a debt last.
fn debt_terms(limits: &[(Limit, u64)]) -> Option<DebtTerms> {
    let (slowest, _) = limits.iter().max_by(|(a, _), (b, _)| {
        let a_pace = u128::from(a.period_ns) * u128::from(b.capacity);
        a_pace.cmp(&(u128::from(b.period_ns) * u128::from(a.capacity)))
    })?;
    Some(DebtTerms {
        cap: limits.iter().map(|(l, _)| l.debt).max().unwrap_or(0),
        capacity: slowest.capacity,
        period_ns: slowest.period_ns,
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
    /// The slot is in debt and its wait is not over: deny here.
    InDebt {
        /// Nanoseconds until the refill covers the debt and the request's cost.
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
        if let Some(wait_ns) = s.debt_wait_ns(&lease.debt, cost, now_ns).filter(|_| ours) {
            return (None, Take::InDebt { wait_ns });
        }
        if ours && s.live(now_ns) && s.tokens >= cost {
            s.tokens -= cost;
            let written = s.clone();
            return (Some(s), Take::Taken(written));
        }
        if ours && s.empty_until_ns > now_ns {
            let wait_ns = s.empty_until_ns - now_ns;
            return (None, Take::Empty { wait_ns });
        }
        let free = !ours && !s.live(now_ns) && !s.fetching(now_ns) && !s.owing(now_ns);
        if (ours && !s.fetching(now_ns)) || free {
            (None, Take::Short)
        } else {
            (None, Take::Busy)
        }
    })
}

/// Gives `tokens` back to the lease (a request it served was denied
/// elsewhere): to a debt a settlement left meanwhile first, so that unspent
/// tokens never stand beside a debt.
pub fn give_back(store: &impl SharedStore, lease: &Lease, tokens: u64) -> Result<(), LimitError> {
    update_slot(store, lease, None, |mut s| {
        if s.fingerprint != lease.fingerprint {
            return (None, ());
        }
        let rest = s.pay(&lease.debt, tokens);
        s.tokens = s.tokens.saturating_add(rest);
        (Some(s), ())
    })
}

/// What a settlement against a slot could not apply.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Tokens not given back: the batch expired, changed hands, or holds a lease already.
    pub unreturned: u64,
    /// Tokens of debt dropped: the slot is another bucket's, or the debt is at its cap.
    pub dropped: u64,
}

impl Settled {
    /// Adds `other`'s tokens.
    pub fn add(&mut self, other: Settled) {
        self.unreturned = self.unreturned.saturating_add(other.unreturned);
        self.dropped = self.dropped.saturating_add(other.dropped);
    }
}

/// Settles a request that spent `reserved` from the lease and whose response
/// cost `real` (at most `max`, 0 for a status `charge_on` leaves out): the
/// difference is charged to the slot (its unspent tokens, then its debt) or
/// given back to it (its debt, then a live batch).
pub fn settle(
    store: &impl SharedStore,
    lease: &Lease,
    reserved: u64,
    real: u64,
    now_ns: u64,
) -> Result<Settled, LimitError> {
    if real == reserved {
        return Ok(Settled::default());
    }
    update_slot(store, lease, Some(now_ns), |mut s| {
        if s.fingerprint != lease.fingerprint {
            // Another bucket holds the slot: nothing of this one is left to settle with.
            let out = Settled {
                unreturned: reserved.saturating_sub(real),
                dropped: real.saturating_sub(reserved),
            };
            return (None, out);
        }
        let before = s.clone();
        let out = if real > reserved {
            Settled {
                dropped: s.charge(&lease.debt, real - reserved, now_ns),
                unreturned: 0,
            }
        } else {
            Settled {
                unreturned: s.give(lease, reserved - real, now_ns),
                dropped: 0,
            }
        };
        ((s != before).then_some(s), out)
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
        if s.fetching(now_ns) || (!ours && (s.live(now_ns) || s.owing(now_ns))) {
            return (None, None);
        }
        let low = ours && s.live(now_ns) && s.tokens.saturating_mul(2) <= lease.size;
        // A debt is paid by the first request after its wait, not ahead of it.
        if refresh && (!low || s.empty_until_ns > now_ns || s.debt > 0) {
            return (None, None);
        }
        let claim = if ours && s.live(now_ns) {
            // A live batch keeps its tokens: ask only for the rest of a lease,
            // and for the debt the grant pays first.
            Claim {
                returned: 0,
                want: lease
                    .size
                    .saturating_sub(s.tokens)
                    .max(lease.bucket.cost)
                    .saturating_add(s.debt),
                dropped_debt: 0,
            }
        } else {
            // Expired (or another bucket's, expired): give back what is
            // unspent. Another bucket's debt goes with it: nothing of that
            // bucket is left here to pay it from.
            let returned = if ours { s.tokens } else { 0 };
            let mut dropped_debt = 0;
            if !ours {
                s.limits.clear();
                dropped_debt = std::mem::take(&mut s.debt);
                s.debt_until_ns = 0;
            }
            s.fingerprint = lease.fingerprint;
            s.tokens = 0;
            s.expires_ns = 0;
            Claim {
                returned,
                want: lease.size.max(lease.bucket.cost).saturating_add(s.debt),
                dropped_debt,
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
    /// Debt of the bucket whose slot this claim took over, dropped.
    pub dropped_debt: u64,
}

/// Stores a grant: `granted` tokens arrive, pay the slot's debt first, the
/// caller then spends `spend` of what is left when it covers them (the
/// returned flag says whether it did), and the batch may be spent until
/// `ttl` from now. `empty_ns` > 0 says the gateway has no token for that
/// long. A debt the grant leaves waits again for the refill from now.
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
) -> Result<(Slot, bool), LimitError> {
    update_slot(store, lease, Some(now_ns), |mut s| {
        if s.fingerprint != lease.fingerprint {
            // Another bucket took the slot meanwhile: the request spends from
            // the grant, the rest is lost, which errs on the strict side.
            return (None, (s, granted >= spend));
        }
        let held = if s.live(now_ns) { s.tokens } else { 0 };
        let left = s.pay(&lease.debt, held.saturating_add(granted));
        if s.debt > 0 {
            let wait = lease.debt.wait_ns(s.debt);
            s.debt_until_ns = s.debt_until_ns.max(now_ns.saturating_add(wait));
        }
        let spent = left >= spend;
        s.tokens = if spent { left - spend } else { left };
        s.expires_ns = now_ns.saturating_add(lp.ttl_ns);
        s.fetching_until_ns = 0;
        s.empty_until_ns = now_ns.saturating_add(empty_ns);
        s.limits = limits
            .iter()
            .map(|(remaining, reset_ms)| (*remaining, now_ns.saturating_add(reset_ms * 1_000_000)))
            .collect();
        let written = s.clone();
        (Some(s), (written, spent))
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

/// Reports for a request the slot refuses (an empty pool, a debt): nothing
/// left, and the wait.
pub fn refused_reports(plan: &Plan, lease: &Lease, slot_wait_ns: u64, now_ns: u64) -> Vec<Report> {
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
            debt: 15,
            debt_until_ns: 17,
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
                want: 5,
                dropped_debt: 0
            }
        );
        // While the callout is in flight, others check per request.
        assert_eq!(take(&s, &l, T0).unwrap(), Take::Busy);
        assert_eq!(claim(&s, &l, lp(&p), T0, false).unwrap(), None);
        let (slot, _) = store_grant(&s, &l, lp(&p), 5, 1, &[(90, 6000)], 0, T0).unwrap();
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
                want: 5,
                dropped_debt: 0
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
                want: 5,
                dropped_debt: 0
            }
        );
        let (slot, _) = store_grant(&s, &l, lp(&p), 5, 0, &[(75, 1)], 0, T0 + MS).unwrap();
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
            debt: 0,
            debt_until_ns: 0,
            limits: vec![(98, T0 + 500 * MS)],
        };
        let r = reports(&p, &l, &slot, T0);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].check.remaining, 100);
        assert_eq!(r[0].check.reset_ns, 500 * MS);
    }

    /// `g` (100 a minute: 600 ms a token) in batches of 5, each response's
    /// cost read from `x-u` (at most 40, 2 reserved): 40 × 1,024 of debt.
    fn settling_plan() -> Plan {
        let json = r#"{"domain":"d","global":{"cluster":"gw","lease":{"fraction":0.05,"ttl_ms":1000,"max_wait_ms":20}},
            "rules":[{"name":"g","scope":"global","key":["header:x-k"],"limits":[{"requests":100,"per":"1m"}],
                      "cost_from":{"header":"x-u","max":40,"reserve":2}}]}"#;
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [3; 16])
    }

    /// A slot holding a live batch of `l` with `tokens` unspent, as written at T0.
    fn granted_slot(s: &MemoryStore, p: &Plan, l: &Lease, tokens: u64) {
        claim(s, l, lp(p), T0, false).unwrap().unwrap();
        let (slot, spent) = store_grant(s, l, lp(p), tokens, 0, &[(90, 1)], 0, T0).unwrap();
        assert_eq!((slot.tokens, spent), (tokens, true));
    }

    fn stored(s: &MemoryStore, l: &Lease) -> Slot {
        let (bytes, _) = s.get(&l.slot_key).unwrap().unwrap();
        Slot::decode(&bytes).unwrap()
    }

    #[test]
    fn a_slot_of_the_layout_before_the_debt_reads_without_debt() {
        let mut v1 = vec![MAGIC_V1, 1];
        for w in [7u64, 3, 9, 11, 13, 5, 6] {
            v1.extend_from_slice(&w.to_le_bytes());
        }
        let slot = Slot::decode(&v1).unwrap();
        assert_eq!(
            (slot.fingerprint, slot.tokens, slot.empty_until_ns),
            (7, 3, 13)
        );
        assert_eq!((slot.debt, slot.debt_until_ns), (0, 0));
        assert_eq!(slot.limits, vec![(5, 6)]);
        // Written back in the current layout only.
        assert_eq!(slot.encode()[0], MAGIC);
        v1[0] = b'X';
        assert_eq!(Slot::decode(&v1), None);
    }

    #[test]
    fn the_debt_is_paced_by_the_slowest_limit_and_bounded_by_the_rules_debt() {
        let json = r#"{"domain":"d","global":{"cluster":"gw","lease":{"fraction":0.5}},
            "rules":[{"name":"g","scope":"global","key":["header:x-k"],
                      "limits":[{"requests":10,"per":"1s"},{"requests":100,"per":"1m"}],
                      "cost_from":{"header":"x-u","max":3}}]}"#;
        let p = Plan::compile(&config::parse(json.as_bytes()).unwrap(), [3; 16]);
        let l = lease(&p, "a", 1);
        // 100 a minute refills a token in 600 ms, slower than 10 a second.
        assert_eq!(
            l.debt,
            DebtTerms {
                cap: 3 * 1024,
                capacity: 100,
                period_ns: 60_000 * MS
            }
        );
        assert_eq!(l.debt.wait_ns(5), 3_000 * MS);
        assert_eq!(l.spans.debt_ns, 3 * 1024 * 600 * MS);
        // A rule charged up front owes nothing.
        assert_eq!(lease(&plan(0.05), "a", 1).debt.cap, 0);
    }

    #[test]
    fn an_overrun_takes_the_unspent_tokens_then_owes_and_denies_until_the_refill_covers_it() {
        let p = settling_plan();
        let s = MemoryStore::default();
        let l = lease(&p, "a", 2);
        granted_slot(&s, &p, &l, 5);
        assert!(matches!(take(&s, &l, T0).unwrap(), Take::Taken(_)));
        // Reserved 2, cost 10: the 3 unspent tokens, then 5 owed.
        let left = settle(&s, &l, 2, 10, T0).unwrap();
        assert_eq!(left, Settled::default());
        let slot = stored(&s, &l);
        assert_eq!((slot.tokens, slot.debt), (0, 5));
        assert_eq!(slot.debt_until_ns, T0 + 3_000 * MS);
        // The next reservation of 2 waits for 5 + 2 tokens: 4.2 s.
        assert_eq!(
            take(&s, &l, T0).unwrap(),
            Take::InDebt {
                wait_ns: 4_200 * MS
            }
        );
        assert_eq!(
            take(&s, &l, T0 + 4_199 * MS).unwrap(),
            Take::InDebt { wait_ns: MS }
        );
        // The timer does not pay it ahead; the first request after the wait does.
        assert_eq!(claim(&s, &l, lp(&p), T0 + 500 * MS, true).unwrap(), None);
        let later = T0 + 4_200 * MS;
        assert_eq!(take(&s, &l, later).unwrap(), Take::Short);
        let c = claim(&s, &l, lp(&p), later, false).unwrap().unwrap();
        assert_eq!(
            c,
            Claim {
                returned: 0,
                want: 10,
                dropped_debt: 0
            }
        );
        // The grant pays the 5 owed first; 2 of the rest are spent.
        let (slot, spent) = store_grant(&s, &l, lp(&p), 10, 2, &[(80, 1)], 0, later).unwrap();
        assert!(spent);
        assert_eq!((slot.tokens, slot.debt, slot.debt_until_ns), (3, 0, 0));
    }

    #[test]
    fn a_grant_smaller_than_the_debt_pays_what_it_can_and_the_rest_waits_again() {
        let p = settling_plan();
        let s = MemoryStore::default();
        let l = lease(&p, "a", 2);
        granted_slot(&s, &p, &l, 0);
        settle(&s, &l, 2, 40, T0).unwrap();
        assert_eq!(stored(&s, &l).debt, 38);
        let later = T0 + 40 * 600 * MS;
        assert_eq!(take(&s, &l, later).unwrap(), Take::Short);
        let c = claim(&s, &l, lp(&p), later, false).unwrap().unwrap();
        assert_eq!(c.want, 43);
        // The gateway grants one batch (5): 33 still owed, nothing spent.
        let (slot, spent) = store_grant(&s, &l, lp(&p), 5, 2, &[(0, 1)], 0, later).unwrap();
        assert!(!spent);
        assert_eq!((slot.tokens, slot.debt), (0, 33));
        assert_eq!(slot.debt_until_ns, later + 33 * 600 * MS);
        assert_eq!(slot.debt_wait_ns(&l.debt, 2, later), Some(35 * 600 * MS));
    }

    #[test]
    fn a_cheaper_response_gives_back_to_the_debt_then_to_its_live_batch_up_to_one_lease() {
        let p = settling_plan();
        let s = MemoryStore::default();
        let l = lease(&p, "a", 2);
        granted_slot(&s, &p, &l, 1);
        // 1 unspent, then 3 owed: the debt waits 1.8 s.
        settle(&s, &l, 2, 6, T0).unwrap();
        assert_eq!(stored(&s, &l).debt, 3);
        // Reserved 2, cost 0: 2 of the debt paid, and 1.2 s less to wait.
        assert_eq!(settle(&s, &l, 2, 0, T0).unwrap(), Settled::default());
        let slot = stored(&s, &l);
        assert_eq!(
            (slot.tokens, slot.debt, slot.debt_until_ns),
            (0, 1, T0 + 600 * MS)
        );
        // 2 more: the last of the debt, then 1 to the batch.
        settle(&s, &l, 2, 0, T0).unwrap();
        let slot = stored(&s, &l);
        assert_eq!((slot.tokens, slot.debt, slot.debt_until_ns), (1, 0, 0));
        // Past one lease (5), the rest is not returned.
        let left = settle(&s, &l, 40, 34, T0).unwrap();
        assert_eq!(
            left,
            Settled {
                unreturned: 2,
                dropped: 0
            }
        );
        assert_eq!(stored(&s, &l).tokens, 5);
        // A response that cost its reservation changes nothing.
        assert_eq!(settle(&s, &l, 2, 2, T0).unwrap(), Settled::default());
        // Once the batch expired, nothing goes back to it.
        let expired = T0 + 1_000 * MS;
        let left = settle(&s, &l, 2, 0, expired).unwrap();
        assert_eq!(
            left,
            Settled {
                unreturned: 2,
                dropped: 0
            }
        );
        assert_eq!(stored(&s, &l).tokens, 5);
    }

    #[test]
    fn the_debt_is_capped_and_a_slot_taken_over_drops_what_its_bucket_owed() {
        let p = settling_plan();
        let s = MemoryStore::default();
        let a = lease(&p, "a", 2);
        granted_slot(&s, &p, &a, 0);
        // 40 × 1,024 = 40,960 at most; 2,000 responses of 40 on reservations of 2 owe 76,000.
        let mut left = Settled::default();
        for _ in 0..2_000 {
            left.add(settle(&s, &a, 2, 40, T0).unwrap());
        }
        assert_eq!(stored(&s, &a).debt, 40_960);
        assert_eq!(
            left,
            Settled {
                unreturned: 0,
                dropped: 76_000 - 40_960
            }
        );
        // Another bucket in the same slot waits while the debt does (checked per request) …
        let mut b = lease(&p, "b", 2);
        b.slot_key = a.slot_key.clone();
        let owed_until = stored(&s, &a).debt_until_ns;
        assert_eq!(owed_until, T0 + 40_960 * 600 * MS);
        assert_eq!(take(&s, &b, owed_until - 1).unwrap(), Take::Busy);
        assert_eq!(claim(&s, &b, lp(&p), owed_until - 1, false).unwrap(), None);
        // … then takes the slot over, and a's debt is dropped with it.
        assert_eq!(take(&s, &b, owed_until).unwrap(), Take::Short);
        let c = claim(&s, &b, lp(&p), owed_until, false).unwrap().unwrap();
        assert_eq!(
            c,
            Claim {
                returned: 0,
                want: 5,
                dropped_debt: 40_960
            }
        );
        assert_eq!((stored(&s, &b).debt, stored(&s, &b).debt_until_ns), (0, 0));
        // a's settlements now find another bucket's slot: nothing moves.
        let over = settle(&s, &a, 2, 12, owed_until).unwrap();
        assert_eq!(
            over,
            Settled {
                unreturned: 0,
                dropped: 10
            }
        );
        let under = settle(&s, &a, 2, 0, owed_until).unwrap();
        assert_eq!(
            under,
            Settled {
                unreturned: 2,
                dropped: 0
            }
        );
        assert_eq!(stored(&s, &b).fingerprint, b.fingerprint);
    }

    #[test]
    fn a_clock_step_back_bounds_a_debts_wait_by_the_refill_of_the_most_debt() {
        let p = settling_plan();
        let s = MemoryStore::default();
        let l = lease(&p, "a", 2);
        granted_slot(&s, &p, &l, 0);
        settle(&s, &l, 2, 12, T0).unwrap();
        // 10 owed: 6 s, read 10 hours back in time as at most 40,960 × 600 ms
        // (6.8 h) from then.
        let back = T0 - 36_000_000 * MS;
        match take(&s, &l, back).unwrap() {
            Take::InDebt { wait_ns } => assert_eq!(wait_ns, l.spans.debt_ns + 1_200 * MS),
            other => panic!("{other:?}"),
        }
        assert_eq!(stored(&s, &l).debt_until_ns, back + l.spans.debt_ns);
    }

    #[test]
    fn a_token_given_back_after_a_refusal_elsewhere_pays_a_debt_first() {
        let p = settling_plan();
        let s = MemoryStore::default();
        let l = lease(&p, "a", 2);
        granted_slot(&s, &p, &l, 2);
        assert!(matches!(take(&s, &l, T0).unwrap(), Take::Taken(_)));
        // Meanwhile a settlement leaves 3 owed; the 2 given back pay 2 of them.
        settle(&s, &l, 2, 5, T0).unwrap();
        give_back(&s, &l, 2).unwrap();
        let slot = stored(&s, &l);
        assert_eq!(
            (slot.tokens, slot.debt, slot.debt_until_ns),
            (0, 1, T0 + 600 * MS)
        );
    }
}
