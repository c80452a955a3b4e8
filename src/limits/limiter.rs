//! Check-and-consume across every bucket of a request, all or nothing, over
//! shared data with compare-and-swap.
//!
//! Reads every set the request touches, decides, and writes only when every
//! limit passes. Each write is a CAS on the version that was read; if one fails
//! the sets already written are refunded and the whole request is retried, so a
//! conflict can cost a retry or (briefly) a too-strict answer, never an extra
//! admission.

use super::algorithm::{Algorithm, Counting};
use super::store::{SharedStore, StoreError, CREATE_ONLY};
use super::table::{At, Pinned, Placement, Set};
use super::token_bucket::{Check, Limit};
use super::update::{update, UpdateError};

/// Whole-request attempts before giving up under contention.
pub const MAX_ATTEMPTS: u32 = 32;

/// One bucket a request must pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// Index of the rule in the plan.
    pub rule: usize,
    /// Index into the rule's variants.
    pub variant: usize,
    /// Identity of the bucket inside its set.
    pub fingerprint: u64,
    /// Which set (shared-data key) holds it.
    pub set: u64,
    /// Tokens the request spends in it.
    pub cost: u64,
}

/// Graduated stages of a rule, as shares of its (single) limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraduatedPlan {
    /// Warn from this share used.
    pub warn_at: Option<f64>,
    /// Delay beyond this share used.
    pub delay_at: Option<f64>,
    /// How long to delay.
    pub delay_ms: u64,
    /// Demand share that blocks the client.
    pub block_at: Option<f64>,
    /// How long a block lasts (ns).
    pub block_for_ns: u64,
}

impl GraduatedPlan {
    /// Whether a limit with `share` of it used holds the request `delay_ms`.
    #[inline(always)]
    pub fn delays(&self, share: f64) -> bool {
        self.delay_at.is_some_and(|d| share > d + 1e-9)
    }
}

/// What the charge needs of one rule's variant.
#[derive(Debug, Clone, Copy)]
pub struct RuleLimits<'a> {
    /// How the limits count.
    pub algorithm: Algorithm,
    /// `requests` per `per` for each limit, and `per` in seconds.
    pub limits: &'a [(Limit, u64)],
    /// Warn, delay and block stages.
    pub graduated: Option<&'a GraduatedPlan>,
}

impl RuleLimits<'_> {
    /// Number of states a bucket keeps: one per limit, plus the demand and
    /// the end of a block for a graduated rule.
    pub fn states(&self) -> usize {
        self.limits.len() + if self.graduated.is_some() { 2 } else { 0 }
    }
}

/// What the limiter reads of the compiled configuration. The policy's plan
/// implements it; counting does not depend on how rules are compiled.
pub trait Rules {
    /// The limits of `rule`'s `variant` (an unknown variant has none);
    /// `None` for an unknown rule.
    fn rule(&self, rule: usize, variant: usize) -> Option<RuleLimits<'_>>;
    /// Share of random spread on block releases, upwards only.
    fn retry_jitter(&self) -> f64;
    /// The shared-data key of bucket set `index`.
    fn set_key(&self, index: u64) -> String;
}

/// One limit's result, for headers and problem bodies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// Index of the rule in the plan.
    pub rule: usize,
    /// The rule's variant (tier or client override).
    pub variant: usize,
    /// Index of the limit in the variant.
    pub limit: usize,
    /// The bucket arithmetic's answer, as the response shows it.
    pub check: Seen,
    /// Share of the limit in use after the request (graduated rules only; else 0).
    pub used_share: f64,
    /// The client is blocked (graduated `block_at`); `check.retry_after_ns` is the block's rest.
    pub blocked: bool,
    /// Tokens the request asked of this limit.
    pub cost: u64,
    /// The limit the gateway enforced (its policy's), for a gateway
    /// answer; `None`: this filter's own limit.
    pub enforced: Option<Enforced>,
}

/// What a report keeps of a [`Check`]: all but the new state, which only the
/// write needs. Its `u128` made every report 112 bytes and 16-byte aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// Whether `cost` tokens were available.
    pub allowed: bool,
    /// Whole tokens left after this request (before it, when denied).
    pub remaining: u64,
    /// Nanoseconds until the bucket is full again.
    pub reset_ns: u64,
    /// Nanoseconds until `cost` tokens are available; 0 when allowed.
    pub retry_after_ns: u64,
}

impl From<Check> for Seen {
    fn from(c: Check) -> Seen {
        Seen {
            allowed: c.allowed,
            remaining: c.remaining,
            reset_ns: c.reset_ns,
            retry_after_ns: c.retry_after_ns,
        }
    }
}

/// A limit as the gateway's answer states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enforced {
    /// Requests per window.
    pub requests: u64,
    /// The window, in ms.
    pub window_ms: u64,
}

impl Enforced {
    /// The limit as the filter's arithmetic takes it.
    pub fn limit(self) -> crate::limits::token_bucket::Limit {
        crate::limits::token_bucket::Limit {
            capacity: self.requests,
            period_ns: self.window_ms.saturating_mul(1_000_000),
            burst: self.requests,
            debt: 0,
        }
    }

    /// The window in whole seconds, rounded up, for the headers.
    pub fn window_secs(self) -> u64 {
        self.window_ms.div_ceil(1000)
    }
}

impl Report {
    /// The report as if this limit had not been charged: for a request denied
    /// elsewhere, so that its headers say what is left now.
    pub fn uncharged(mut self, limit: &crate::limits::token_bucket::Limit) -> Report {
        if self.check.allowed {
            self.check.remaining = (self.check.remaining + self.cost).min(limit.capacity);
            let per_token = limit.period_ns / limit.capacity.max(1);
            self.check.reset_ns = self
                .check
                .reset_ns
                .saturating_sub(per_token.saturating_mul(self.cost));
        }
        self
    }
}

/// The decision for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Every limit passed and was charged.
    Allowed(Vec<Report>),
    /// At least one limit failed; nothing was charged.
    Denied(Vec<Report>),
}

/// Why no decision could be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitError {
    /// The host's shared data failed.
    Store(StoreError),
    /// Every attempt lost a CAS race.
    Contention,
    /// A set read for this request was not found among those read: a
    /// guard that never fires, kept instead of indexing.
    Vanished,
}

impl std::fmt::Display for LimitError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            LimitError::Store(e) => write!(f, "{e}"),
            LimitError::Contention => {
                write!(f, "gave up after {MAX_ATTEMPTS} compare-and-swap conflicts")
            }
            LimitError::Vanished => write!(f, "a bucket set read for this request went missing"),
        }
    }
}

impl From<StoreError> for LimitError {
    fn from(e: StoreError) -> Self {
        LimitError::Store(e)
    }
}

impl From<UpdateError> for LimitError {
    fn from(e: UpdateError) -> Self {
        match e {
            UpdateError::Store(e) => LimitError::Store(e),
            UpdateError::Contention => LimitError::Contention,
        }
    }
}

/// Counts of what happened on the way, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// CAS conflicts that forced a retry.
    pub cas_retries: u64,
    /// Active buckets evicted to make room (their clients start full next time).
    pub evictions: u64,
    /// Set values that could not be decoded and were reset.
    pub corrupt_sets: u64,
}

struct SetWork {
    index: u64,
    key: String,
    cas: u32,
    set: Set,
    pinned: Pinned,
    /// A state of the set changed: it must be written.
    touched: bool,
}

/// Checks every bucket at its cost and charges all of them, or none.
/// `spread` (in `[0, 1)`) places a new block's end within `retry_jitter`.
pub fn check_and_consume(
    store: &impl SharedStore,
    plan: &impl Rules,
    buckets: &[Bucket],
    now_ns: u64,
    spread: f64,
    stats: &mut Stats,
) -> Result<Decision, LimitError> {
    // Writes go into the sets as each check is made. A denial stores only
    // graduated demand and blocks (and a bound on a stepped-back clock): when
    // it has any, the sets are read again and only those written. A pending
    // `Write` list applied at the end cost c4 800 instructions more
    // (BENCHMARKS.md, instructions per decision).
    let mut only_always = false;
    let mut conflicts = 0;
    while conflicts < MAX_ATTEMPTS {
        let mut work: Vec<SetWork> = Vec::with_capacity(buckets.len());
        let attempt = check_all(
            store,
            plan,
            buckets,
            now_ns,
            spread,
            only_always,
            &mut work,
            stats,
        )?;
        match attempt.next(only_always) {
            AfterChecks::Deny => return Ok(Decision::Denied(attempt.reports)),
            AfterChecks::Again(only) => {
                only_always = only;
                continue;
            }
            AfterChecks::Conflict(only) => only_always = only,
            AfterChecks::Write => {
                let refundable = if attempt.denied { &[][..] } else { buckets };
                if write_all(store, plan, &work, refundable, now_ns)? {
                    stats.evictions += attempt.evictions;
                    return Ok(attempt.decision());
                }
            }
        }
        conflicts += 1;
        stats.cas_retries += 1;
    }
    Err(LimitError::Contention)
}

/// What one attempt's checks found. The flags are returned by value from
/// each step and kept in locals: reached through a pointer, as fields of a
/// struct the steps share, they cost c1 about 170 wasm instructions.
struct Attempt {
    reports: Vec<Report>,
    /// A limit or a block denied the request.
    denied: bool,
    /// A write that a denial stores too (demand, block, bound) was made.
    any_always: bool,
    /// Active buckets evicted to make room.
    evictions: u64,
}

/// What follows an attempt's checks.
enum AfterChecks {
    /// Denied with nothing to store: answer now.
    Deny,
    /// Check again, writing only what a denial stores (`true`), or everything.
    Again(bool),
    /// The sets changed between two attempts: count a conflict, then check
    /// again in this mode.
    Conflict(bool),
    /// Write the sets.
    Write,
}

impl Attempt {
    #[inline(always)]
    fn next(&self, only_always: bool) -> AfterChecks {
        if self.denied && !self.any_always {
            return AfterChecks::Deny;
        }
        match (self.denied, only_always) {
            // Denied: again, writing demand and blocks only.
            (true, false) => AfterChecks::Again(true),
            // Allowed where a denial was seen: the sets changed in between.
            (false, true) => AfterChecks::Conflict(false),
            _ => AfterChecks::Write,
        }
    }

    #[inline(always)]
    fn decision(self) -> Decision {
        match self.denied {
            true => Decision::Denied(self.reports),
            false => Decision::Allowed(self.reports),
        }
    }
}

/// One attempt's pass over the request: reads each set once (into `work`)
/// and checks every bucket in it, writing into the sets as it goes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn check_all(
    store: &impl SharedStore,
    plan: &impl Rules,
    buckets: &[Bucket],
    now_ns: u64,
    spread: f64,
    only_always: bool,
    work: &mut Vec<SetWork>,
    stats: &mut Stats,
) -> Result<Attempt, LimitError> {
    // Sized up front: growing it from empty cost more than the check itself.
    let limits: usize = buckets
        .iter()
        .filter_map(|b| plan.rule(b.rule, b.variant))
        .map(|r| r.states())
        .sum();
    let mut reports = Vec::with_capacity(limits);
    let (mut denied, mut any_always, mut evictions) = (false, false, 0);
    for b in buckets {
        let Some(rule) = plan.rule(b.rule, b.variant) else {
            continue;
        };
        let states = rule.states();
        let sw = set_of(store, plan, work, b.set, states, stats)?;
        let (placement, at) = sw.set.claim(b.fingerprint, states, now_ns, &sw.pinned);
        // An unstored bucket is checked as full and its writes go nowhere.
        // One match rather than `Placement::index` and two `matches!`: c4
        // 24 fewer instructions.
        let (index, found) = match placement {
            Placement::Found(i) => (i, true),
            Placement::Fresh(i) => (i, false),
            Placement::Evicted(i) => {
                evictions += 1;
                (i, false)
            }
            Placement::Unstored => (usize::MAX, false),
        };
        sw.pinned.insert(index);
        if let Some(g) = rule.graduated {
            // Its own entry: one lent to a call out of line would keep the
            // limits' entry in memory instead of locals.
            let entry = Entry {
                sw: &mut *sw,
                at,
                found,
                only_always,
            };
            let gate = graduated(plan, entry, b, rule.limits, g, now_ns, spread);
            any_always |= gate.wrote;
            if let Some(r) = gate.blocked {
                denied = true;
                reports.push(r);
                continue;
            }
        }
        let entry = Entry {
            sw,
            at,
            found,
            only_always,
        };
        let (d, a) = check_limits(entry, b, &rule, now_ns, &mut reports);
        denied |= d;
        any_always |= a;
    }
    Ok(Attempt {
        reports,
        denied,
        any_always,
        evictions,
    })
}

/// The set `index` among those this attempt has read, read now if it is
/// not: each set is read (and later written) once per attempt.
#[inline(always)]
fn set_of<'w>(
    store: &impl SharedStore,
    plan: &impl Rules,
    work: &'w mut Vec<SetWork>,
    index: u64,
    room: usize,
    stats: &mut Stats,
) -> Result<&'w mut SetWork, LimitError> {
    let w = match work.iter().position(|w| w.index == index) {
        Some(w) => w,
        None => {
            work.push(read_set(store, plan, index, room, stats)?);
            work.len() - 1
        }
    };
    work.get_mut(w).ok_or(LimitError::Vanished)
}

/// One bucket's entry in its set while it is checked.
struct Entry<'a> {
    sw: &'a mut SetWork,
    at: At,
    /// The bucket was stored before: else it is checked as full.
    found: bool,
    /// This attempt writes only what a denial stores.
    only_always: bool,
}

impl Entry<'_> {
    /// State `i` as stored; read before this bucket's own write to it.
    #[inline(always)]
    fn state(&self, i: usize) -> Option<u128> {
        match self.found {
            true => Set::tat(self.sw.set.tats_at(self.at), i),
            false => None,
        }
    }

    /// Writes state `i` unless the attempt writes only what a denial stores
    /// and this is not such a write (`always`); marks the set for writing.
    #[inline(always)]
    fn write(&mut self, i: usize, value: u128, full_at_ns: u64, always: bool) {
        if (always || !self.only_always) && self.sw.set.write_at(self.at, i, value, full_at_ns) {
            self.sw.touched = true;
        }
    }
}

/// Checks and charges each limit of the bucket's rule, reporting every one,
/// so that the headers can show the closest. Returns whether one denied and
/// whether a write that a denial stores too was made.
#[inline(always)]
fn check_limits(
    mut entry: Entry,
    b: &Bucket,
    rule: &RuleLimits,
    now_ns: u64,
    reports: &mut Vec<Report>,
) -> (bool, bool) {
    let (mut denied, mut any_always) = (false, false);
    for (l, (limit, _)) in rule.limits.iter().enumerate() {
        let stored = entry.state(l);
        let check = rule.algorithm.check(limit, stored, now_ns, b.cost);
        denied |= !check.allowed;
        let used_share = match (&rule.graduated, check.allowed) {
            (None, _) => 0.0,
            (Some(_), true) => limit.used_share(check.new_state, now_ns),
            (Some(_), false) => stored.map_or(0.0, |t| limit.used_share(t, now_ns)),
        };
        reports.push(Report {
            rule: b.rule,
            variant: b.variant,
            limit: l,
            check: check.into(),
            used_share,
            blocked: false,
            cost: b.cost,
            enforced: None,
        });
        // A token bucket's TAT is `now × capacity` plus what `reset_ns`
        // rounds up, so it is full at `now + reset_ns`: the same figure
        // without a 128-bit division (proptest `full_at_is_now_plus_reset`).
        let full_at_ns = match rule.algorithm {
            Algorithm::TokenBucket if limit.capacity > 0 => now_ns.saturating_add(check.reset_ns),
            _ => rule.algorithm.full_at_ns(limit, check.new_state),
        };
        // A denial whose TAT the check bounded (the clock stepped back) stores
        // the bound, so that the bucket refills from the step on.
        let bounded = rule.algorithm == Algorithm::TokenBucket
            && !check.allowed
            && stored.is_some_and(|t| t > check.new_state);
        any_always |= bounded;
        entry.write(l, check.new_state, full_at_ns, bounded);
    }
    (denied, any_always)
}

/// What a graduated rule's block and demand decided for a bucket.
struct Gate {
    /// The client is blocked: this report denies it, and its limits are
    /// not checked.
    blocked: Option<Report>,
    /// A block or demand was written (a denial stores them too).
    wrote: bool,
}

/// A graduated rule's block and demand, checked before its limits. Out of
/// line: most rules are not graduated.
#[inline(never)]
fn graduated(
    plan: &impl Rules,
    mut entry: Entry,
    b: &Bucket,
    limits: &[(Limit, u64)],
    g: &GraduatedPlan,
    now_ns: u64,
    spread: f64,
) -> Gate {
    if let Some(gate) = still_blocked(plan, &mut entry, b, limits.len() + 1, g, now_ns) {
        return gate;
    }
    demand(plan, &mut entry, b, limits, g, now_ns, spread)
}

/// A client whose block (stored in state `blocks`) has not ended.
fn still_blocked(
    plan: &impl Rules,
    entry: &mut Entry,
    b: &Bucket,
    blocks: usize,
    g: &GraduatedPlan,
    now_ns: u64,
) -> Option<Gate> {
    let stored_until = entry
        .state(blocks)
        .map_or(0, |t| u64::try_from(t).unwrap_or(u64::MAX));
    // A block longer than its longest span (block_for plus the most jitter)
    // only comes from a clock that stepped back: bounded and stored, it ends
    // at most that span after the step.
    let longest = g
        .block_for_ns
        .saturating_add((g.block_for_ns as f64 * plan.retry_jitter().max(0.0)) as u64);
    let blocked_until = stored_until.min(now_ns.saturating_add(longest));
    if blocked_until <= now_ns {
        return None;
    }
    let wrote = blocked_until < stored_until;
    if wrote {
        entry.write(blocks, u128::from(blocked_until), blocked_until, true);
    }
    Some(Gate {
        blocked: Some(blocked_report(b, blocked_until - now_ns)),
        wrote,
    })
}

/// Counts the request as demand (denied ones included) against `block_at`
/// of the first limit, and blocks the client when it reaches it.
fn demand(
    plan: &impl Rules,
    entry: &mut Entry,
    b: &Bucket,
    limits: &[(Limit, u64)],
    g: &GraduatedPlan,
    now_ns: u64,
    spread: f64,
) -> Gate {
    let (Some(block_at), Some((limit, _))) = (g.block_at, limits.first()) else {
        return Gate {
            blocked: None,
            wrote: false,
        };
    };
    let demand_limit = Limit {
        burst: ((limit.capacity as f64) * block_at).ceil() as u64,
        ..*limit
    };
    let d_index = limits.len();
    let d = demand_limit.check(entry.state(d_index), now_ns, b.cost);
    let demand = if d.allowed {
        d.new_state
    } else {
        demand_limit.scaled(now_ns) + demand_limit.increment(demand_limit.burst)
    };
    if demand_limit.used_share(demand, now_ns) >= block_at {
        let spread_ns = (g.block_for_ns as f64 * plan.retry_jitter() * spread) as u64;
        let until = now_ns
            .saturating_add(g.block_for_ns)
            .saturating_add(spread_ns);
        entry.write(d_index, 0, until, true);
        entry.write(d_index + 1, u128::from(until), until, true);
        return Gate {
            blocked: Some(blocked_report(b, until - now_ns)),
            wrote: true,
        };
    }
    entry.write(d_index, demand, demand_limit.full_at_ns(demand), true);
    Gate {
        blocked: None,
        wrote: true,
    }
}

/// The report of a bucket a block denies: nothing left until it ends.
fn blocked_report(b: &Bucket, wait_ns: u64) -> Report {
    Report {
        rule: b.rule,
        variant: b.variant,
        limit: 0,
        check: Seen {
            allowed: false,
            remaining: 0,
            reset_ns: wait_ns,
            retry_after_ns: wait_ns,
        },
        used_share: 0.0,
        blocked: true,
        cost: b.cost,
        enforced: None,
    }
}

/// Reads a set. A set never written reads as empty (with `room` for an
/// entry of that many states), to be written create-only: of two workers
/// creating it at once, the second loses the swap and charges again on the
/// first one's set (creating an empty set first cost two more host calls
/// per new set).
fn read_set(
    store: &impl SharedStore,
    plan: &impl Rules,
    index: u64,
    room: usize,
    stats: &mut Stats,
) -> Result<SetWork, LimitError> {
    let key = plan.set_key(index);
    let (set, cas) = match store.get(&key)? {
        Some((bytes, cas)) => {
            let set = Set::from_bytes(bytes).unwrap_or_else(|_| {
                stats.corrupt_sets += 1;
                Set::default()
            });
            (set, cas)
        }
        None => (Set::with_room(room), CREATE_ONLY),
    };
    Ok(SetWork {
        index,
        key,
        cas,
        set,
        pinned: Pinned::default(),
        touched: false,
    })
}

/// CAS-writes every touched set; on a conflict refunds the charges (made at
/// `now_ns`) in those already written and returns false.
fn write_all(
    store: &impl SharedStore,
    plan: &impl Rules,
    work: &[SetWork],
    refundable: &[Bucket],
    now_ns: u64,
) -> Result<bool, LimitError> {
    let sets = || work.iter().filter(|sw| sw.touched);
    for (done, sw) in sets().enumerate() {
        if !store.compare_and_set(&sw.key, sw.set.bytes(), sw.cas)? {
            for written in sets().take(done) {
                refund_set(store, plan, written.index, refundable, now_ns)?;
            }
            return Ok(false);
        }
    }
    Ok(true)
}

/// Gives back a charge made by an allowed [`check_and_consume`], when a later
/// check of the same request (the gateway) denied it. `charged_at_ns` is the
/// `now_ns` of that charge: a sliding window gives back only in its window.
pub fn refund(
    store: &impl SharedStore,
    plan: &impl Rules,
    buckets: &[Bucket],
    charged_at_ns: u64,
) -> Result<(), LimitError> {
    let mut sets: Vec<u64> = buckets.iter().map(|b| b.set).collect();
    sets.sort_unstable();
    sets.dedup();
    for set in sets {
        refund_set(store, plan, set, buckets, charged_at_ns)?;
    }
    Ok(())
}

/// Charges `bucket.cost` more to each of `buckets` at `now_ns`, whatever
/// they hold: a settlement of a response that cost more than was reserved,
/// which may leave a bucket in debt (up to its limits' `debt`). A bucket
/// evicted since the request was charged is not charged again: its debt is
/// lost with it, as a refund would be.
pub fn charge_more(
    store: &impl SharedStore,
    plan: &impl Rules,
    buckets: &[Bucket],
    now_ns: u64,
) -> Result<(), LimitError> {
    let mut sets: Vec<u64> = buckets.iter().map(|b| b.set).collect();
    sets.sort_unstable();
    sets.dedup();
    for set_index in sets {
        let key = plan.set_key(set_index);
        update(store, &key, MAX_ATTEMPTS, |bytes| {
            let Some(Ok(mut set)) = bytes.map(Set::decode) else {
                return (None, ());
            };
            for b in buckets.iter().filter(|b| b.set == set_index) {
                let (Some(rule), Some(e)) = (plan.rule(b.rule, b.variant), set.find(b.fingerprint))
                else {
                    continue;
                };
                for (l, (limit, _)) in rule.limits.iter().enumerate() {
                    let state = Set::tat(set.tats(e), l);
                    let more = rule.algorithm.force(limit, state, now_ns, b.cost);
                    let full_at = rule.algorithm.full_at_ns(limit, more);
                    set.write(e, l, more, full_at);
                }
            }
            (Some(set.into_bytes()), ())
        })?;
    }
    Ok(())
}

/// Gives back one request's charge in one set. Refunding never admits more
/// than was admitted; a refund lost to a bucket eviction is simply dropped.
fn refund_set(
    store: &impl SharedStore,
    plan: &impl Rules,
    set_index: u64,
    buckets: &[Bucket],
    charged_at_ns: u64,
) -> Result<(), LimitError> {
    let key = plan.set_key(set_index);
    update(store, &key, MAX_ATTEMPTS, |bytes| {
        // A set never written, or unreadable, holds no charge to give back.
        let Some(Ok(mut set)) = bytes.map(Set::decode) else {
            return (None, ());
        };
        for b in buckets.iter().filter(|b| b.set == set_index) {
            let Some(rule) = plan.rule(b.rule, b.variant) else {
                continue;
            };
            let Some(e) = set.find(b.fingerprint) else {
                continue;
            };
            for (l, (limit, _)) in rule.limits.iter().enumerate() {
                if let Some(tat) = Set::tat(set.tats(e), l) {
                    let back = rule.algorithm.refund(limit, tat, b.cost, charged_at_ns);
                    // A refund never raises when the bucket is full again.
                    set.write(e, l, back, 0);
                }
            }
        }
        (Some(set.into_bytes()), ())
    })?;
    Ok(())
}

#[cfg(test)]
#[path = "limiter_tests.rs"]
mod tests;
