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
use super::store::{numbered_key, SharedStore, KEY_PREFIX};
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
        numbered_key(&self.key_prefix, self.set_of_index(index))
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

impl Held {
    /// The slot as stored.
    fn slot(&self) -> Slot {
        Slot {
            deadline_ns: self.deadline_ns,
            id: self.id,
        }
    }
}

/// One key's slot taken by [`acquire`]: what [`release`] gives back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// The slot.
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

/// One slot: when it ends, and its holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    deadline_ns: u64,
    id: u32,
}

impl Slot {
    /// The slot stored in `chunk` ([`SLOT`] bytes; a shorter one reads as zeros,
    /// which [`index`] never hands over).
    fn read(chunk: &[u8]) -> Slot {
        let deadline = chunk.first_chunk::<8>().copied().unwrap_or_default();
        let id = chunk
            .get(8..)
            .and_then(|c| c.first_chunk::<4>())
            .copied()
            .unwrap_or_default();
        Slot {
            deadline_ns: u64::from_le_bytes(deadline),
            id: u32::from_le_bytes(id),
        }
    }

    fn write(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.deadline_ns.to_le_bytes());
        out.extend_from_slice(&self.id.to_le_bytes());
    }
}

/// One key of a set, read in place: where its slots are in the stored
/// value, what of them is live at the time of the read, and what this
/// write adds. Sets are read and rewritten without decoding into
/// allocations: a request takes and gives back its slots on the hot path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Way {
    fingerprint: u64,
    /// Earliest and latest deadline of the live slots (`u64::MAX`, 0 without any).
    earliest_ns: u64,
    latest_ns: u64,
    /// Offset of its first stored slot in the value.
    start: u32,
    /// Its slots stored, those of them live, and those this write adds
    /// (each at most [`MAX_CONCURRENT`]).
    stored: u16,
    live: u16,
    added: u16,
}

impl Way {
    /// A key new to its set (or in place of an evicted one).
    const fn fresh(fingerprint: u64) -> Way {
        Way {
            fingerprint,
            earliest_ns: u64::MAX,
            latest_ns: 0,
            start: 0,
            stored: 0,
            live: 0,
            added: 0,
        }
    }

    /// Its slots once written.
    fn in_flight(&self) -> u32 {
        u32::from(self.live) + u32::from(self.added)
    }
}

/// A set value that could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Corrupt;

/// Checks a stored set and hands `keep` each of its keys in order, with
/// its slots live at `now_ns` counted; an empty value is an empty set.
fn index(bytes: &[u8], now_ns: u64, mut keep: impl FnMut(Way)) -> Result<(), Corrupt> {
    let Some((&version, _)) = bytes.split_first() else {
        return Ok(());
    };
    if version != VERSION {
        return Err(Corrupt);
    }
    let (mut seen, mut keys) = ([0u64; WAYS], 0);
    let mut at = 1;
    while at < bytes.len() {
        let way = index_way(bytes, at, now_ns)?;
        // One key twice, or more keys than ways, is no set this module wrote.
        if seen
            .get(..keys)
            .unwrap_or_default()
            .contains(&way.fingerprint)
        {
            return Err(Corrupt);
        }
        *seen.get_mut(keys).ok_or(Corrupt)? = way.fingerprint;
        keys += 1;
        at = way.start as usize + usize::from(way.stored) * SLOT;
        keep(way);
    }
    Ok(())
}

/// The key stored at offset `at` of `bytes` (a set is under 64 KiB).
fn index_way(bytes: &[u8], at: usize, now_ns: u64) -> Result<Way, Corrupt> {
    let rest = bytes.get(at..).ok_or(Corrupt)?;
    let (fp, rest) = rest.split_first_chunk::<8>().ok_or(Corrupt)?;
    let (count, rest) = rest.split_first_chunk::<2>().ok_or(Corrupt)?;
    let count = u16::from_le_bytes(*count);
    if u32::from(count) > MAX_CONCURRENT {
        return Err(Corrupt);
    }
    let slots = rest.get(..usize::from(count) * SLOT).ok_or(Corrupt)?;
    let mut way = Way::fresh(u64::from_le_bytes(*fp));
    way.start = u32::try_from(at + ENTRY_HEAD).map_err(|_| Corrupt)?;
    way.stored = count;
    for slot in slots.chunks_exact(SLOT).map(Slot::read) {
        if slot.deadline_ns > now_ns {
            way.live += 1;
            way.earliest_ns = way.earliest_ns.min(slot.deadline_ns);
            way.latest_ns = way.latest_ns.max(slot.deadline_ns);
        }
    }
    Ok(way)
}

/// The stored slots of `way`, as bytes.
fn stored_slots<'a>(bytes: &'a [u8], way: &Way) -> std::slice::ChunksExact<'a, u8> {
    let start = way.start as usize;
    let end = start + usize::from(way.stored) * SLOT;
    bytes.get(start..end).unwrap_or_default().chunks_exact(SLOT)
}

/// A set as read for a write at `now_ns`: its keys with live slots, in
/// stored order (a corrupt value as empty, counted). Slots past their
/// deadline, and keys left with none, are not written back.
struct Set<'a> {
    bytes: &'a [u8],
    now_ns: u64,
    ways: [Way; WAYS],
    len: usize,
    /// Something read is not written back: worth writing even with no other change.
    changed: bool,
    stats: InFlightStats,
}

impl<'a> Set<'a> {
    /// Reads a set for a write at `now_ns` (see [`Set`]).
    fn read(bytes: Option<&'a [u8]>, now_ns: u64) -> Set<'a> {
        let bytes = bytes.unwrap_or_default();
        let mut set = Set {
            bytes,
            now_ns,
            ways: [Way::fresh(0); WAYS],
            len: 0,
            changed: false,
            stats: InFlightStats::default(),
        };
        let (mut ways, mut len, mut changed) = ([Way::fresh(0); WAYS], 0, false);
        let indexed = index(bytes, now_ns, |way| {
            changed |= way.live != way.stored;
            if let (true, Some(w)) = (way.live > 0, ways.get_mut(len)) {
                *w = way;
                len += 1;
            }
        });
        match indexed {
            Ok(()) => (set.ways, set.len, set.changed) = (ways, len, changed),
            Err(Corrupt) => {
                set.bytes = &[];
                set.changed = true;
                set.stats.corrupt_sets = 1;
            }
        }
        set
    }

    /// The keys held, in order.
    fn ways(&self) -> &[Way] {
        self.ways.get(..self.len).unwrap_or_default()
    }

    /// Finds `fingerprint`'s key or makes room for it, never evicting a key
    /// this write adds a slot to (the request's own).
    fn place(&mut self, fingerprint: u64) -> Option<&mut Way> {
        let found = self
            .ways()
            .iter()
            .position(|w| w.fingerprint == fingerprint);
        let at = match found {
            Some(i) => i,
            None if self.len < WAYS => {
                self.len += 1;
                self.len - 1
            }
            None => {
                // Every key left has live slots (`read` dropped the others):
                // the one whose last slot ends first loses the least.
                let (i, _) = (self.ways().iter().enumerate())
                    .filter(|(_, w)| w.added == 0)
                    .min_by_key(|(_, w)| w.latest_ns)?;
                self.stats.evictions += 1;
                i
            }
        };
        let way = self.ways.get_mut(at)?;
        if found.is_none() {
            *way = Way::fresh(fingerprint);
        }
        Some(way)
    }

    /// The offset among `way`'s stored slots of the first live one equal to `slot`.
    fn find(&self, way: &Way, slot: Slot) -> Option<usize> {
        (stored_slots(self.bytes, way).map(Slot::read))
            .position(|s| s == slot && s.deadline_ns > self.now_ns)
    }

    /// The value to store: each key's live slots, less the one at the
    /// offset `removed` names for it, then `added` copies of `slot`.
    fn write(&self, slot: Slot, removed: &[Option<usize>; WAYS]) -> Vec<u8> {
        let len: usize = (self.ways().iter())
            .map(|w| ENTRY_HEAD + SLOT * w.in_flight() as usize)
            .sum();
        let mut out = Vec::with_capacity(1 + len);
        out.push(VERSION);
        for (way, removed) in self.ways().iter().zip(removed) {
            let head = out.len();
            out.extend_from_slice(&way.fingerprint.to_le_bytes());
            out.extend_from_slice(&[0, 0]);
            let mut count = 0u16;
            for (i, chunk) in stored_slots(self.bytes, way).enumerate() {
                if Slot::read(chunk).deadline_ns > self.now_ns && *removed != Some(i) {
                    out.extend_from_slice(chunk);
                    count += 1;
                }
            }
            for _ in 0..way.added {
                slot.write(&mut out);
                count += 1;
            }
            match out.get_mut(head + 8..head + ENTRY_HEAD) {
                // A key with no slot left is not kept.
                _ if count == 0 => out.truncate(head),
                Some(c) => c.copy_from_slice(&count.to_le_bytes()),
                None => {}
            }
        }
        out
    }
}

/// Takes a slot of each of `keys` in set `set`, all or nothing, writing
/// each one's [`Taken`] at its index in `taken`; the set's new value, or
/// the refusal that leaves it as it was.
fn take_in_set(
    bytes: Option<&[u8]>,
    group: SetGroup<'_>,
    taken: &mut [Taken],
    now_ns: u64,
    slot: Slot,
) -> (Option<Vec<u8>>, Result<(), Acquired>, InFlightStats) {
    let mut set = Set::read(bytes, now_ns);
    for (index, key) in group.members() {
        let Some(way) = set.place(key.fingerprint) else {
            let crowded = Acquired::Crowded { key: index };
            return (None, Err(crowded), set.stats);
        };
        if let Some(full) = full(way, key, index, slot) {
            return (None, Err(full), set.stats);
        }
        way.added += 1;
        let held = Held {
            key,
            id: slot.id,
            deadline_ns: slot.deadline_ns,
        };
        if let Some(t) = taken.get_mut(index) {
            *t = Taken {
                held,
                in_flight: way.in_flight(),
            };
        }
    }
    let value = set.write(slot, &[None; WAYS]);
    (Some(value), Ok(()), set.stats)
}

/// The refusal of `key` (index `index` in those asked for) when its way
/// has no free slot: a limit lowered since may leave it over.
fn full(way: &Way, key: SlotKey, index: usize, slot: Slot) -> Option<Acquired> {
    let in_flight = way.in_flight();
    if in_flight < key.limit.min(MAX_CONCURRENT) {
        return None;
    }
    let mut earliest = way.earliest_ns;
    if way.added > 0 {
        earliest = earliest.min(slot.deadline_ns);
    }
    Some(Acquired::Full {
        key: index,
        in_flight,
        earliest_deadline_ns: earliest,
    })
}

/// The keys of one set among those asked for (a request's few), so that
/// each set is written once, its keys in the order asked.
#[derive(Clone, Copy)]
struct SetGroup<'a> {
    keys: &'a [SlotKey],
    layout: &'a InFlightLayout,
    set: u64,
}

impl<'a> SetGroup<'a> {
    /// The group's keys, with their index in those asked for.
    fn members(self) -> impl Iterator<Item = (usize, SlotKey)> + 'a {
        let SetGroup { keys, layout, set } = self;
        (keys.iter().copied().enumerate()).filter(move |(_, k)| layout.set_of_index(k.set) == set)
    }
}

/// The distinct sets of `sets`, in the order each first appears.
fn distinct_sets(sets: impl Iterator<Item = u64> + Clone) -> impl Iterator<Item = u64> {
    (sets.clone().enumerate()).filter_map(move |(i, set)| {
        let seen = sets.clone().take(i).any(|s| s == set);
        (!seen).then_some(set)
    })
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
    // Filled in by index as each set is written; `in_flight` 0 is not taken yet.
    let none = |key| Taken {
        held: Held {
            key,
            id,
            deadline_ns: slot.deadline_ns,
        },
        in_flight: 0,
    };
    let mut taken: Vec<Taken> = keys.iter().copied().map(none).collect();
    for set in distinct_sets(keys.iter().map(|k| layout.set_of_index(k.set))) {
        let group = SetGroup { keys, layout, set };
        let (outcome, s) = take_set(store, group, &mut taken, now_ns, slot);
        stats.add(s);
        if let Err(refused) = outcome {
            taken.retain(|t| t.in_flight > 0);
            if let Ok(s) = release(store, layout, &taken, now_ns) {
                stats.add(s);
            }
            return match refused {
                Refused::Acquired(acquired) => Ok(AcquireResult { acquired, stats }),
                Refused::Error(e) => Err(e),
            };
        }
    }
    Ok(AcquireResult {
        acquired: Acquired::Taken(taken),
        stats,
    })
}

/// Why a set's part of [`acquire`] took nothing.
enum Refused {
    /// A key was full or crowded.
    Acquired(Acquired),
    /// The store failed or stayed contended.
    Error(LimitError),
}

/// One set's part of [`acquire`], through [`update`], with its counts.
fn take_set(
    store: &impl SharedStore,
    group: SetGroup<'_>,
    taken: &mut [Taken],
    now_ns: u64,
    slot: Slot,
) -> (Result<(), Refused>, InFlightStats) {
    let mut stats = InFlightStats::default();
    let mut runs = 0u64;
    let key = group.layout.set_key(group.set);
    let outcome = update(store, &key, MAX_ATTEMPTS, |bytes| {
        runs += 1;
        let (new, outcome, s) = take_in_set(bytes, group, taken, now_ns, slot);
        // Only the last run's counts describe what was written.
        stats = s;
        (new, outcome)
    });
    stats.cas_retries = runs.saturating_sub(1);
    let outcome = match outcome {
        Ok(Ok(())) => Ok(()),
        Ok(Err(acquired)) => Err(Refused::Acquired(acquired)),
        Err(e) => Err(Refused::Error(LimitError::from(e))),
    };
    (outcome, stats)
}

/// Gives the slots back; a missing slot (reclaimed, evicted or released
/// already) is fine. Also drops the slots past their deadline at `now_ns`
/// from each set written. Every set is tried; the first error is returned.
pub fn release(
    store: &impl SharedStore,
    layout: &InFlightLayout,
    taken: &[Taken],
    now_ns: u64,
) -> Result<InFlightStats, LimitError> {
    let mut stats = InFlightStats::default();
    let mut first_error = None;
    let set_of = |t: &Taken| layout.set_of_index(t.held.key.set);
    for set in distinct_sets(taken.iter().map(set_of)) {
        let group = taken.iter().filter(|t| set_of(t) == set);
        let mut runs = 0u64;
        let result = update(store, &layout.set_key(set), MAX_ATTEMPTS, |bytes| {
            runs += 1;
            release_in_set(bytes, group.clone(), now_ns)
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
fn release_in_set<'a>(
    bytes: Option<&[u8]>,
    group: impl Iterator<Item = &'a Taken> + Clone,
    now_ns: u64,
) -> (Option<Vec<u8>>, InFlightStats) {
    let set = Set::read(bytes, now_ns);
    // A request holds one slot per key: the first of its key's slots equal to it.
    let mut removed = [None; WAYS];
    for (way, at) in set.ways().iter().zip(&mut removed) {
        *at = (group.clone())
            .filter(|t| t.held.key.fingerprint == way.fingerprint)
            .find_map(|t| set.find(way, t.held.slot()));
    }
    if !set.changed && removed.iter().all(Option::is_none) {
        return (None, set.stats);
    }
    // Nothing is added: the slot written `added` times is never written.
    let none = Slot {
        deadline_ns: 0,
        id: 0,
    };
    (Some(set.write(none, &removed)), set.stats)
}

#[cfg(test)]
#[path = "in_flight_tests.rs"]
mod tests;
