//! Bounded concurrency slots in shared data: at most N requests in flight per
//! key across every worker of one proxy (the `concurrent` limit kind).
//!
//! A request takes one slot of each of its keys when it starts and gives
//! them back when its stream ends. Every slot carries a deadline (its start
//! plus `max_in_flight`); any writer drops the slots past their deadline, so
//! a crashed or reloaded VM that never releases leaks a slot only until then.
//!
//! Like the bucket [`table`](super::table), keys live in a fixed number of
//! *sets* (shared-data keys can never be deleted), each written whole with
//! one compare-and-swap through [`update`]. A set holds at most [`WAYS`] keys;
//! a new key in a full set evicts the key whose last slot ends first, and
//! that key loses its count (as an evicted bucket starts full again).
//!
//! Encoding of a set: a version byte, then entries until the end; an entry
//! is a fingerprint (u64), a count of slots (u16) and the slots, each a
//! deadline in ns (u64) and the holder's id (u32), all little-endian.

use super::limiter::{LimitError, MAX_ATTEMPTS};
use super::store::{SharedStore, KEY_PREFIX};
use super::update::update;

/// Keys per set before one must be evicted.
pub const WAYS: usize = 4;

/// The most slots one key can have (the configuration's bound on
/// `concurrent`): a larger limit is clamped to it, which bounds a set's size
/// (see [`MAX_SET_BYTES`]).
pub const MAX_CONCURRENT: u32 = crate::config::MAX_CONCURRENT;

const VERSION: u8 = 1;
/// Bytes of an entry before its slots: fingerprint, count.
const ENTRY_HEAD: usize = 10;
/// Bytes of one slot: deadline, id.
const SLOT: usize = 12;

/// The largest a set's value can be: [`WAYS`] keys of [`MAX_CONCURRENT`] slots (under 64 KiB).
pub const MAX_SET_BYTES: usize = 1 + WAYS * (ENTRY_HEAD + SLOT * MAX_CONCURRENT as usize);
// A larger WAYS or MAX_CONCURRENT must not break the bound silently.
const _: () = assert!(MAX_SET_BYTES < 64 * 1024);

/// Where a domain's in-flight slots live: a fixed number of sets (shared-data keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlightLayout {
    /// Number of sets, at least 1.
    pub sets: u64,
    /// Prefix of the set keys, ending in `/`.
    pub key_prefix: String,
}

impl InFlightLayout {
    /// Room for about `max_keys` keys' slots for `domain` (at least one set).
    pub fn new(domain: &str, max_keys: u64) -> InFlightLayout {
        let sets = (max_keys / WAYS as u64).max(1);
        InFlightLayout {
            sets,
            // The set count is part of the key: a resized layout starts fresh
            // instead of reading sets placed for another size.
            key_prefix: format!("{KEY_PREFIX}inflight/{domain}/{sets}/"),
        }
    }

    /// The set of a key whose placement hash is `hash`.
    pub fn set_of(&self, hash: u64) -> u64 {
        hash % self.sets.max(1)
    }

    /// `index` within the layout (see [`InFlightLayout::set_key`]), so that
    /// keys naming the same set key are written in one compare-and-swap.
    fn set_of_index(&self, index: u64) -> u64 {
        index % self.sets.max(1)
    }

    /// The shared-data key of set `index`; an index past the layout wraps,
    /// so no caller can make the store grow past `sets` keys.
    pub fn set_key(&self, index: u64) -> String {
        let mut n = itoa::Buffer::new();
        format!("{}{}", self.key_prefix, n.format(self.set_of_index(index)))
    }
}

/// One key's slot to take: which set, the key's fingerprint, its limit N.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotKey {
    /// Which set holds the key ([`InFlightLayout::set_of`]).
    pub set: u64,
    /// Identity of the key inside its set (a keyed hash of rule and key).
    pub fingerprint: u64,
    /// Requests in flight allowed; clamped to [`MAX_CONCURRENT`].
    pub limit: u32,
}

/// A slot held: what the release needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The key whose slot it is.
    pub key: SlotKey,
    /// The holder's id, so that a release removes its own slot and not
    /// another's with the same deadline.
    pub id: u32,
    /// When the slot is reclaimed if never released.
    pub deadline_ns: u64,
}

/// One key's slot taken by [`acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// What [`release`] needs.
    pub held: Held,
    /// The key's slots in flight, this one included.
    pub in_flight: u32,
}

/// What [`acquire`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// One slot of every key is held, in the order of the keys.
    Taken(Vec<Taken>),
    /// `keys[key]` had no free slot: nothing is held.
    Full {
        /// Index of the full key in the keys asked for.
        key: usize,
        /// Its slots in flight.
        in_flight: u32,
        /// When its first slot ends at the latest (`u64::MAX` for a limit of 0).
        earliest_deadline_ns: u64,
    },
    /// `keys[key]` found its set's [`WAYS`] entries all held for this same
    /// request's other keys: it counts as full and nothing is held.
    Crowded {
        /// Index of the key with no room, in the keys asked for.
        key: usize,
    },
}

/// Counts of what happened on the way, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InFlightStats {
    /// Keys evicted with live slots (their count is forgotten).
    pub evictions: u64,
    /// Set values that could not be decoded and were rewritten as empty.
    pub corrupt_sets: u64,
    /// Compare-and-swap conflicts that forced a set's change to run again.
    pub cas_retries: u64,
}

impl InFlightStats {
    fn add(&mut self, other: InFlightStats) {
        self.evictions += other.evictions;
        self.corrupt_sets += other.corrupt_sets;
        self.cas_retries += other.cas_retries;
    }
}

/// The result of [`acquire`]: the outcome and the counts for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireResult {
    /// Taken or refused.
    pub acquired: Acquired,
    /// What happened on the way (rolled-back sets included).
    pub stats: InFlightStats,
}

/// One slot, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    deadline_ns: u64,
    id: u32,
}

/// One key's slots, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    fingerprint: u64,
    slots: Vec<Slot>,
}

impl Entry {
    /// The slot that ends last; an entry with none sorts first for eviction.
    fn latest_deadline(&self) -> u64 {
        self.slots.iter().map(|s| s.deadline_ns).max().unwrap_or(0)
    }
}

/// A set value that could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Corrupt;

/// Reads a stored set; an empty value or a missing key is an empty set.
fn decode(bytes: &[u8]) -> Result<Vec<Entry>, Corrupt> {
    let Some((&version, mut rest)) = bytes.split_first() else {
        return Ok(Vec::new());
    };
    if version != VERSION {
        return Err(Corrupt);
    }
    let mut entries: Vec<Entry> = Vec::new();
    while !rest.is_empty() {
        let (entry, tail) = decode_entry(rest)?;
        // More keys than ways, or one key twice, is no set this module wrote.
        if entries.len() >= WAYS || entries.iter().any(|e| e.fingerprint == entry.fingerprint) {
            return Err(Corrupt);
        }
        entries.push(entry);
        rest = tail;
    }
    Ok(entries)
}

/// One entry from the front of `bytes`, and the bytes after it.
fn decode_entry(bytes: &[u8]) -> Result<(Entry, &[u8]), Corrupt> {
    let (fp, rest) = bytes.split_first_chunk::<8>().ok_or(Corrupt)?;
    let (count, mut rest) = rest.split_first_chunk::<2>().ok_or(Corrupt)?;
    let count = u16::from_le_bytes(*count);
    if u32::from(count) > MAX_CONCURRENT {
        return Err(Corrupt);
    }
    let mut slots = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let (deadline, tail) = rest.split_first_chunk::<8>().ok_or(Corrupt)?;
        let (id, tail) = tail.split_first_chunk::<4>().ok_or(Corrupt)?;
        slots.push(Slot {
            deadline_ns: u64::from_le_bytes(*deadline),
            id: u32::from_le_bytes(*id),
        });
        rest = tail;
    }
    let fingerprint = u64::from_le_bytes(*fp);
    Ok((Entry { fingerprint, slots }, rest))
}

/// The value to store.
fn encode(entries: &[Entry]) -> Vec<u8> {
    let len = 1 + entries
        .iter()
        .map(|e| ENTRY_HEAD + SLOT * e.slots.len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(len);
    out.push(VERSION);
    for e in entries {
        // Never more than MAX_CONCURRENT slots: `full` refuses at the clamped limit.
        let count = u16::try_from(e.slots.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&e.fingerprint.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        for s in e.slots.iter().take(usize::from(count)) {
            out.extend_from_slice(&s.deadline_ns.to_le_bytes());
            out.extend_from_slice(&s.id.to_le_bytes());
        }
    }
    out
}

/// A set as read for a write: decoded (a corrupt one as empty, counted)
/// and without the slots past their deadline or the keys left with none.
struct Read {
    entries: Vec<Entry>,
    /// Something was dropped or the value was corrupt: worth writing back.
    changed: bool,
    stats: InFlightStats,
}

/// Reads a set for a write at `now_ns` (see [`Read`]).
fn read(bytes: Option<&[u8]>, now_ns: u64) -> Read {
    let (mut entries, corrupt) = match decode(bytes.unwrap_or_default()) {
        Ok(entries) => (entries, false),
        Err(Corrupt) => (Vec::new(), true),
    };
    let before: usize = entries.iter().map(|e| e.slots.len() + 1).sum();
    for e in &mut entries {
        e.slots.retain(|s| s.deadline_ns > now_ns);
    }
    entries.retain(|e| !e.slots.is_empty());
    let after: usize = entries.iter().map(|e| e.slots.len() + 1).sum();
    Read {
        entries,
        changed: corrupt || before != after,
        stats: InFlightStats {
            corrupt_sets: u64::from(corrupt),
            ..InFlightStats::default()
        },
    }
}

/// Where a key's entry is, once found or made room for.
enum Place {
    /// At this index (found, in a free way, or in place of an evicted key).
    At(usize),
    /// Every way holds a key of the same request.
    Crowded,
}

/// Finds `fingerprint`'s entry or makes room for it, never evicting the
/// `pinned` keys (those this request already took a slot of in this set).
fn place(
    entries: &mut Vec<Entry>,
    fingerprint: u64,
    pinned: &[u64],
    stats: &mut InFlightStats,
) -> Place {
    if let Some(i) = entries.iter().position(|e| e.fingerprint == fingerprint) {
        return Place::At(i);
    }
    let fresh = Entry {
        fingerprint,
        slots: Vec::new(),
    };
    if entries.len() < WAYS {
        entries.push(fresh);
        return Place::At(entries.len() - 1);
    }
    // Every entry left has live slots (`read` dropped the others): the one
    // whose last slot ends first loses the least.
    let victim = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| !pinned.contains(&e.fingerprint))
        .min_by_key(|(_, e)| e.latest_deadline())
        .map(|(i, _)| i);
    match victim.and_then(|i| Some((i, entries.get_mut(i)?))) {
        Some((i, e)) => {
            *e = fresh;
            stats.evictions += 1;
            Place::At(i)
        }
        None => Place::Crowded,
    }
}

/// What one set's change decided.
enum SetOutcome {
    /// A slot of each of the set's keys, with the key's index in those asked for.
    Taken(Vec<(usize, Taken)>),
    /// Refused; the set is left as it was.
    Refused(Acquired),
}

/// Takes a slot of each of `group`'s keys (all in one set) in `bytes`, all
/// or nothing; the set's new value unless refused.
fn take_in_set(
    bytes: Option<&[u8]>,
    group: &[(usize, SlotKey)],
    now_ns: u64,
    slot: Slot,
) -> (Option<Vec<u8>>, SetOutcome, InFlightStats) {
    let Read {
        mut entries,
        stats: mut s,
        ..
    } = read(bytes, now_ns);
    let mut pinned = Vec::with_capacity(group.len());
    let mut taken = Vec::with_capacity(group.len());
    for &(index, key) in group {
        let entry = match place(&mut entries, key.fingerprint, &pinned, &mut s) {
            Place::At(i) => entries.get_mut(i),
            Place::Crowded => None,
        };
        let Some(entry) = entry else {
            let crowded = Acquired::Crowded { key: index };
            return (None, SetOutcome::Refused(crowded), s);
        };
        if let Some(full) = full(entry, key, index) {
            return (None, SetOutcome::Refused(full), s);
        }
        entry.slots.push(slot);
        pinned.push(key.fingerprint);
        let held = Held {
            key,
            id: slot.id,
            deadline_ns: slot.deadline_ns,
        };
        let in_flight = u32::try_from(entry.slots.len()).unwrap_or(u32::MAX);
        taken.push((index, Taken { held, in_flight }));
    }
    (Some(encode(&entries)), SetOutcome::Taken(taken), s)
}

/// The refusal of `key` (index `index` in those asked for) when its entry
/// has no free slot: a limit lowered since may leave it over.
fn full(entry: &Entry, key: SlotKey, index: usize) -> Option<Acquired> {
    let in_flight = u32::try_from(entry.slots.len()).unwrap_or(u32::MAX);
    if in_flight < key.limit.min(MAX_CONCURRENT) {
        return None;
    }
    let earliest = entry.slots.iter().map(|s| s.deadline_ns).min();
    Some(Acquired::Full {
        key: index,
        in_flight,
        earliest_deadline_ns: earliest.unwrap_or(u64::MAX),
    })
}

/// The keys grouped by set, in the order each set first appears; each key
/// with its index in `keys`.
fn by_set<T: Copy>(items: &[T], set: impl Fn(&T) -> u64) -> Vec<(u64, Vec<(usize, T)>)> {
    let mut groups: Vec<(u64, Vec<(usize, T)>)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let s = set(item);
        match groups.iter_mut().find(|(g, _)| *g == s) {
            Some((_, members)) => members.push((i, *item)),
            None => groups.push((s, vec![(i, *item)])),
        }
    }
    groups
}

/// Takes one slot of each key, all or nothing: a request can match several
/// concurrent rules, and if any key is full nothing is held (slots taken in
/// this call are released before returning). One compare-and-swap per set;
/// a new slot ends at `now_ns + max_in_flight_ns` unless released first.
///
/// On an error the slots already taken are released too; one that cannot
/// be (the store failing again) is reclaimed at its deadline.
pub fn acquire(
    store: &impl SharedStore,
    layout: &InFlightLayout,
    keys: &[SlotKey],
    now_ns: u64,
    max_in_flight_ns: u64,
    id: u32,
) -> Result<AcquireResult, LimitError> {
    let slot = Slot {
        deadline_ns: now_ns.saturating_add(max_in_flight_ns),
        id,
    };
    let mut stats = InFlightStats::default();
    let mut taken: Vec<(usize, Taken)> = Vec::with_capacity(keys.len());
    for (set, group) in by_set(keys, |k| layout.set_of_index(k.set)) {
        let (outcome, s) = take_set(store, layout, set, &group, now_ns, slot);
        stats.add(s);
        match outcome {
            Ok(SetOutcome::Taken(t)) => taken.extend(t),
            Ok(SetOutcome::Refused(acquired)) => {
                roll_back(store, layout, &taken, now_ns, &mut stats);
                return Ok(AcquireResult { acquired, stats });
            }
            Err(e) => {
                roll_back(store, layout, &taken, now_ns, &mut stats);
                return Err(e);
            }
        }
    }
    // Sets were visited in their own order: give the slots in the keys'.
    taken.sort_by_key(|(i, _)| *i);
    let taken = taken.into_iter().map(|(_, t)| t).collect();
    Ok(AcquireResult {
        acquired: Acquired::Taken(taken),
        stats,
    })
}

/// One set's part of [`acquire`], through [`update`], with its counts.
fn take_set(
    store: &impl SharedStore,
    layout: &InFlightLayout,
    set: u64,
    group: &[(usize, SlotKey)],
    now_ns: u64,
    slot: Slot,
) -> (Result<SetOutcome, LimitError>, InFlightStats) {
    let mut stats = InFlightStats::default();
    let mut runs = 0u64;
    let outcome = update(store, &layout.set_key(set), MAX_ATTEMPTS, |bytes| {
        runs += 1;
        let (new, outcome, s) = take_in_set(bytes, group, now_ns, slot);
        // Only the last run's counts describe what was written.
        stats = s;
        (new, outcome)
    });
    stats.cas_retries = runs.saturating_sub(1);
    (outcome.map_err(LimitError::from), stats)
}

/// Gives back the slots of a refused or failed [`acquire`]; a failure here
/// leaves them to their deadline, and the caller has a worse answer to give.
fn roll_back(
    store: &impl SharedStore,
    layout: &InFlightLayout,
    taken: &[(usize, Taken)],
    now_ns: u64,
    stats: &mut InFlightStats,
) {
    let held: Vec<Held> = taken.iter().map(|(_, t)| t.held).collect();
    if let Ok(s) = release(store, layout, &held, now_ns) {
        stats.add(s);
    }
}

/// Gives the slots back; a missing slot (reclaimed, evicted or released
/// already) is fine. Also drops the slots past their deadline at `now_ns`
/// from each set written. Every set is tried; the first error is returned.
pub fn release(
    store: &impl SharedStore,
    layout: &InFlightLayout,
    held: &[Held],
    now_ns: u64,
) -> Result<InFlightStats, LimitError> {
    let mut stats = InFlightStats::default();
    let mut first_error = None;
    for (set, group) in by_set(held, |h| layout.set_of_index(h.key.set)) {
        let mut runs = 0u64;
        let result = update(store, &layout.set_key(set), MAX_ATTEMPTS, |bytes| {
            runs += 1;
            release_in_set(bytes, &group, now_ns)
        });
        stats.cas_retries += runs.saturating_sub(1);
        match result {
            Ok(s) => stats.add(s),
            Err(e) => {
                first_error.get_or_insert(LimitError::from(e));
            }
        }
    }
    first_error.map_or(Ok(stats), Err)
}

/// Removes each of `group`'s slots (all in one set) from `bytes`; the new
/// value when anything changed.
fn release_in_set(
    bytes: Option<&[u8]>,
    group: &[(usize, Held)],
    now_ns: u64,
) -> (Option<Vec<u8>>, InFlightStats) {
    let Read {
        mut entries,
        mut changed,
        stats,
    } = read(bytes, now_ns);
    for (_, h) in group {
        let Some(entry) = entries
            .iter_mut()
            .find(|e| e.fingerprint == h.key.fingerprint)
        else {
            continue;
        };
        let mine = |s: &Slot| s.deadline_ns == h.deadline_ns && s.id == h.id;
        if let Some(i) = entry.slots.iter().position(mine) {
            entry.slots.swap_remove(i);
            changed = true;
        }
    }
    entries.retain(|e| !e.slots.is_empty());
    (changed.then(|| encode(&entries)), stats)
}

#[cfg(test)]
#[path = "in_flight_tests.rs"]
mod tests;
