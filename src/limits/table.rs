//! The bounded bucket table in shared data.
//!
//! Shared-data keys can never be deleted, so buckets live in a fixed number of
//! *sets* (one shared-data key each). A set holds up to [`WAYS`] entries; an
//! entry is one (rule, key) bucket: a fingerprint and one TAT per limit. A whole
//! set is read and written with one compare-and-swap, so finding, claiming and
//! updating an entry is atomic and a bucket can never exist twice.

use super::store::KEY_PREFIX;

/// Entries per set before one must be evicted.
pub const WAYS: usize = 4;

/// Where a domain's buckets live: how many sets, and their shared-data keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Number of sets (shared-data keys) in the table.
    pub sets: u64,
    /// Prefix of the set keys, ending in `/`.
    pub key_prefix: String,
}

impl Layout {
    /// The table of `domain` holding about `max_buckets` buckets (at least one set).
    pub fn new(domain: &str, max_buckets: u64) -> Layout {
        let sets = (max_buckets / WAYS as u64).max(1);
        Layout {
            sets,
            // The set count is part of the key: a resized table starts fresh
            // instead of reading sets laid out for another size.
            key_prefix: format!("{KEY_PREFIX}set/{domain}/{sets}/"),
        }
    }

    /// The set that holds a bucket whose placement hash is `hash`.
    pub fn set_of(&self, hash: u64) -> u64 {
        hash % self.sets
    }

    /// The shared-data key of set `index`.
    pub fn set_key(&self, index: u64) -> String {
        super::store::numbered_key(&self.key_prefix, index)
    }
}

const VERSION: u8 = 1;
/// Bytes of an entry before its TATs: fingerprint, full-at, count of TATs.
const HEAD: usize = 17;
/// Bytes of one TAT.
const TAT: usize = 16;

/// One bucket, decoded: all limits of one rule for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Keyed hash of domain, rule, limits and key.
    pub fingerprint: u64,
    /// When every limit of the bucket is full again (ns); an entry past this holds no state worth keeping.
    pub full_at_ns: u64,
    /// Theoretical arrival time per limit, in that limit's scaled units.
    pub tats: Vec<u128>,
}

/// One set, kept as the bytes stored in shared data and read and changed in
/// place: version, count, then per entry its fingerprint, full-at, count of
/// TATs and the TATs (little-endian). A charge reads a field or two of a set
/// and writes a field or two; decoding it into vectors and encoding it again
/// cost more than the rest of the check.
#[derive(Debug, Clone)]
pub struct Set {
    /// Always a valid encoding: [`Set::from_bytes`] checks it, and every
    /// change keeps it.
    bytes: Vec<u8>,
    /// Times an entry changed size and moved those after it: an [`At`]
    /// taken before a move is stale.
    moves: u32,
}

impl PartialEq for Set {
    fn eq(&self, other: &Set) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Set {}

impl Default for Set {
    fn default() -> Self {
        Set::from_valid(vec![VERSION, 0])
    }
}

/// Where a placed entry starts in its set's bytes. Reading or writing through
/// it skips the walk to the entry, unless an entry has changed size since
/// (and moved those after it); then it walks to the entry's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct At {
    index: usize,
    start: usize,
    moves: u32,
}

/// The entries of a set that one request has claimed, which its later
/// buckets must not evict: a bit per entry (a set holds at most 255). A
/// `Vec` per set read cost an allocation per request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pinned([u64; 4]);

impl Pinned {
    /// Every entry in `entries`.
    pub fn of(entries: &[usize]) -> Pinned {
        let mut p = Pinned::default();
        for &e in entries {
            p.insert(e);
        }
        p
    }

    /// Pins entry `i`; an index past 255 (an unstored bucket) pins nothing.
    pub fn insert(&mut self, i: usize) {
        if let Some(word) = self.0.get_mut(i / 64) {
            *word |= 1 << (i % 64);
        }
    }

    /// Whether entry `i` is pinned.
    pub fn contains(&self, i: usize) -> bool {
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
}

/// A set value that could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

/// How a bucket was found or made room for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The bucket was there.
    Found(usize),
    /// A new, full bucket took a free way or an idle, full entry.
    Fresh(usize),
    /// A new bucket replaced one that still held state: that client's bucket is
    /// forgotten and starts full next time.
    Evicted(usize),
    /// A new bucket found the set at its most entries (255), all claimed by
    /// the same request: it counts as full and is not stored.
    Unstored,
}

impl Placement {
    /// The entry's index in the set; `None` for an unstored bucket.
    pub fn index(self) -> Option<usize> {
        match self {
            Placement::Found(i) | Placement::Fresh(i) | Placement::Evicted(i) => Some(i),
            Placement::Unstored => None,
        }
    }
}

impl Set {
    /// An empty set with room for one entry of `limits` TATs: a new set's
    /// first entry then takes no second allocation and copy.
    pub fn with_room(limits: usize) -> Set {
        let mut bytes = Vec::with_capacity(2 + entry_len(limits));
        bytes.extend_from_slice(&[VERSION, 0]);
        Set::from_valid(bytes)
    }

    fn from_valid(bytes: Vec<u8>) -> Set {
        Set { bytes, moves: 0 }
    }

    /// Takes a stored value, checking that it is a valid set; an empty value
    /// is an empty set.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Set, Corrupt> {
        if bytes.is_empty() {
            return Ok(Set::default());
        }
        let (&version, rest) = bytes.split_first().ok_or(Corrupt)?;
        let (&n, mut rest) = rest.split_first().ok_or(Corrupt)?;
        if version != VERSION {
            return Err(Corrupt);
        }
        for _ in 0..n {
            let k = usize::from(*rest.get(HEAD - 1).ok_or(Corrupt)?);
            rest = rest.get(HEAD + TAT * k..).ok_or(Corrupt)?;
        }
        if !rest.is_empty() {
            return Err(Corrupt);
        }
        Ok(Set::from_valid(bytes))
    }

    /// Decodes a set from borrowed bytes (see [`Set::from_bytes`]).
    pub fn decode(bytes: &[u8]) -> Result<Set, Corrupt> {
        Set::from_bytes(bytes.to_vec())
    }

    /// The value to store.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Takes the value to store.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        usize::from(self.bytes.get(1).copied().unwrap_or(0))
    }

    /// True when the set holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every entry, decoded (for tests and diagnostics; the charge reads in place).
    pub fn entries(&self) -> Vec<Entry> {
        (0..self.len())
            .filter_map(|i| {
                let (fingerprint, full_at_ns, tats) = self.entry(i)?;
                Some(Entry {
                    fingerprint,
                    full_at_ns,
                    tats: tats
                        .chunks_exact(TAT)
                        .filter_map(|c| c.try_into().ok().map(u128::from_le_bytes))
                        .collect(),
                })
            })
            .collect()
    }

    /// Where each entry starts, in order: one walk over the set.
    fn starts(&self) -> impl Iterator<Item = usize> + '_ {
        let mut at = 2;
        (0..self.len()).map_while(move |_| {
            let start = at;
            at += HEAD + TAT * usize::from(*self.bytes.get(at + HEAD - 1)?);
            Some(start)
        })
    }

    /// Byte range of the entry starting at `start`.
    fn span_at(&self, start: usize) -> Option<std::ops::Range<usize>> {
        let k = usize::from(*self.bytes.get(start.checked_add(HEAD - 1)?)?);
        Some(start..start.checked_add(HEAD + TAT * k)?)
    }

    /// Byte range of entry `i`.
    fn span(&self, i: usize) -> Option<std::ops::Range<usize>> {
        self.span_at(self.starts().nth(i)?)
    }

    /// The fingerprint of the entry starting at `start`.
    fn fingerprint_at(&self, start: usize) -> Option<u64> {
        let b = self.bytes.get(start..start.checked_add(8)?)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    }

    /// The full-at of the entry starting at `start`.
    fn full_at(&self, start: usize) -> Option<u64> {
        self.fingerprint_at(start.checked_add(8)?)
    }

    /// Entry `i`: fingerprint, full-at and the bytes of its TATs.
    fn entry(&self, i: usize) -> Option<(u64, u64, &[u8])> {
        let span = self.span(i)?;
        let e = self.bytes.get(span)?;
        let (fp, rest) = e.split_first_chunk::<8>()?;
        let (full_at, rest) = rest.split_first_chunk::<8>()?;
        let tats = rest.get(1..)?;
        Some((u64::from_le_bytes(*fp), u64::from_le_bytes(*full_at), tats))
    }

    /// The TATs of entry `i`, as stored: `count × 16` bytes.
    pub fn tats(&self, i: usize) -> &[u8] {
        self.entry(i).map_or(&[], |(_, _, t)| t)
    }

    /// TAT `state` of stored TATs `tats` (see [`Set::tats`]).
    pub fn tat(tats: &[u8], state: usize) -> Option<u128> {
        let at = state.checked_mul(TAT)?;
        let b = tats.get(at..at.checked_add(TAT)?)?;
        Some(u128::from_le_bytes(b.try_into().ok()?))
    }

    /// Stores `value` as TAT `state` of entry `i` and raises its full-at to
    /// at least `full_at_ns`; false when there is no such TAT.
    pub fn write(&mut self, i: usize, state: usize, value: u128, full_at_ns: u64) -> bool {
        let start = self.starts().nth(i);
        start.is_some_and(|start| self.write_from(start, state, value, full_at_ns))
    }

    /// [`Set::write`] to the entry placed at `at`.
    pub fn write_at(&mut self, at: At, state: usize, value: u128, full_at_ns: u64) -> bool {
        if at.moves == self.moves {
            self.write_from(at.start, state, value, full_at_ns)
        } else {
            self.write(at.index, state, value, full_at_ns)
        }
    }

    /// [`Set::write`] to the entry starting at byte `start`.
    fn write_from(&mut self, start: usize, state: usize, value: u128, full_at_ns: u64) -> bool {
        let Some((head, tats)) = self
            .bytes
            .get_mut(start..)
            .and_then(|e| e.split_first_chunk_mut::<HEAD>())
        else {
            return false;
        };
        if state >= usize::from(head.last().copied().unwrap_or(0)) {
            return false;
        }
        let Some(t) = tats.get_mut(state * TAT..(state + 1) * TAT) else {
            return false;
        };
        t.copy_from_slice(&value.to_le_bytes());
        if let Some(f) = head.get_mut(8..16) {
            let old = u64::from_le_bytes(f.try_into().unwrap_or([0; 8]));
            f.copy_from_slice(&old.max(full_at_ns).to_le_bytes());
        }
        true
    }

    /// The index of bucket `fingerprint`, if the set holds it.
    pub fn find(&self, fingerprint: u64) -> Option<usize> {
        self.find_at(fingerprint).map(|(i, _)| i)
    }

    /// The index and start of bucket `fingerprint`, if the set holds it.
    fn find_at(&self, fingerprint: u64) -> Option<(usize, usize)> {
        self.starts()
            .enumerate()
            .find(|&(_, start)| self.fingerprint_at(start) == Some(fingerprint))
    }

    /// Finds the bucket `fingerprint`, or makes room for it: a free way first,
    /// then the idle full entry, then the entry nearest to full. Entries listed
    /// in `pinned` (claimed by the same request) are never evicted; when all are
    /// pinned the set grows past [`WAYS`].
    pub fn place(
        &mut self,
        fingerprint: u64,
        limits: usize,
        now_ns: u64,
        pinned: &Pinned,
    ) -> Placement {
        self.claim(fingerprint, limits, now_ns, pinned).0
    }

    /// [`Set::place`], with where the entry starts, for [`Set::write_at`] and
    /// [`Set::tats_at`]. An unstored bucket's `At` writes nowhere.
    pub fn claim(
        &mut self,
        fingerprint: u64,
        limits: usize,
        now_ns: u64,
        pinned: &Pinned,
    ) -> (Placement, At) {
        let (placement, start) = self.claim_start(fingerprint, limits, now_ns, pinned);
        let at = At {
            index: placement.index().unwrap_or(usize::MAX),
            start,
            moves: self.moves,
        };
        (placement, at)
    }

    fn claim_start(
        &mut self,
        fingerprint: u64,
        limits: usize,
        now_ns: u64,
        pinned: &Pinned,
    ) -> (Placement, usize) {
        if let Some((i, start)) = self.find_at(fingerprint) {
            // Sized as `push` and `replace` size it: a rule's changed count of limits starts over.
            if self.span_at(start).map(|s| s.len()) != Some(entry_len(limits)) {
                return (Placement::Fresh(i), self.replace(i, fingerprint, limits));
            }
            return (Placement::Found(i), start);
        }
        let n = self.len();
        if n < WAYS {
            return self.push(fingerprint, limits);
        }
        let victim = self
            .starts()
            .enumerate()
            .filter(|&(i, _)| !pinned.contains(i))
            .filter_map(|(i, start)| Some((i, self.full_at(start)?)))
            .min_by_key(|&(_, full_at)| full_at);
        match victim {
            Some((i, full_at)) => {
                let start = self.replace(i, fingerprint, limits);
                if full_at <= now_ns {
                    (Placement::Fresh(i), start)
                } else {
                    (Placement::Evicted(i), start)
                }
            }
            None => self.push(fingerprint, limits),
        }
    }

    /// The TATs of the entry placed at `at` (see [`Set::tats`]).
    pub fn tats_at(&self, at: At) -> &[u8] {
        if at.moves != self.moves {
            return self.tats(at.index);
        }
        self.span_at(at.start)
            .and_then(|s| self.bytes.get(s.start + HEAD..s.end))
            .unwrap_or(&[])
    }

    /// Appends a new, full entry, unless the count is at its most; with
    /// where it starts.
    fn push(&mut self, fingerprint: u64, limits: usize) -> (Placement, usize) {
        let n = self.len();
        let Some(count) = self.bytes.get_mut(1).filter(|c| **c < u8::MAX) else {
            return (Placement::Unstored, usize::MAX);
        };
        *count += 1;
        let start = self.bytes.len();
        // One exact allocation and zeroes, then the head: pushing the entry
        // byte by byte cost more than the bucket arithmetic. A set read from
        // the host has no spare room, and `Vec`'s amortized growth through
        // `realloc` cost more than a new block and a copy.
        let end = start + entry_len(limits);
        if self.bytes.capacity() < end {
            let mut grown = Vec::with_capacity(end);
            grown.extend_from_slice(&self.bytes);
            self.bytes = grown;
        }
        self.bytes.resize(end, 0);
        self.fill_fresh(start, fingerprint, limits);
        (Placement::Fresh(n), start)
    }

    /// Makes entry `i` a new, full entry of `fingerprint`; returns where it starts.
    fn replace(&mut self, i: usize, fingerprint: u64, limits: usize) -> usize {
        let Some(span) = self.span(i) else {
            return usize::MAX;
        };
        let len = entry_len(limits);
        if span.len() == len {
            if let Some(e) = self.bytes.get_mut(span.clone()) {
                e.fill(0);
            }
        } else {
            // The rule's count of limits changed: the entry changes size.
            self.bytes.splice(span.clone(), std::iter::repeat_n(0, len));
            self.moves = self.moves.wrapping_add(1);
        }
        self.fill_fresh(span.start, fingerprint, limits);
        span.start
    }

    /// Writes the head of a new entry over zeroes at `start`.
    fn fill_fresh(&mut self, start: usize, fingerprint: u64, limits: usize) {
        if let Some(fp) = self.bytes.get_mut(start..start + 8) {
            fp.copy_from_slice(&fingerprint.to_le_bytes());
        }
        if let Some(k) = self.bytes.get_mut(start + HEAD - 1) {
            *k = u8::try_from(limits).unwrap_or(u8::MAX);
        }
    }
}

/// Bytes of an entry of `limits` TATs (at most 255).
fn entry_len(limits: usize) -> usize {
    HEAD + TAT * limits.min(usize::from(u8::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(fp: u64, full_at: u64) -> Entry {
        Entry {
            fingerprint: fp,
            full_at_ns: full_at,
            tats: vec![u128::from(full_at) * 3, 7],
        }
    }

    /// A set of `entries`, written through `place` and `write`.
    fn set_of(entries: &[Entry]) -> Set {
        let mut s = Set::default();
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(
                s.place(e.fingerprint, e.tats.len(), 0, &Pinned::default())
                    .index(),
                Some(i)
            );
            for (k, &t) in e.tats.iter().enumerate() {
                assert!(s.write(i, k, t, e.full_at_ns));
            }
        }
        s
    }

    #[test]
    fn round_trips() {
        let entries = vec![entry(1, 10), entry(u64::MAX, u64::MAX)];
        let s = set_of(&entries);
        assert_eq!(s.entries(), entries);
        assert_eq!(Set::decode(s.bytes()).unwrap(), s);
        assert_eq!(Set::decode(b"").unwrap(), Set::default());
        assert_eq!(Set::default().bytes(), [VERSION, 0]);
        assert_eq!(Set::with_room(3), Set::default());
    }

    #[test]
    fn the_stored_layout_is_version_count_then_entries() {
        let s = set_of(&[Entry {
            fingerprint: 0x0102,
            full_at_ns: 5,
            tats: vec![9],
        }]);
        let mut expected = vec![
            VERSION, 1, 2, 1, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 1, 9,
        ];
        expected.extend([0; 15]);
        assert_eq!(s.bytes(), expected);
    }

    #[test]
    fn garbage_is_corrupt_not_a_panic() {
        assert_eq!(Set::decode(&[9]), Err(Corrupt));
        assert_eq!(Set::decode(&[VERSION]), Err(Corrupt));
        assert_eq!(Set::decode(&[VERSION, 1, 0, 0]), Err(Corrupt));
        let mut long = set_of(&[entry(1, 1)]).into_bytes();
        long.push(0);
        assert_eq!(Set::decode(&long), Err(Corrupt));
    }

    #[test]
    fn a_write_changes_one_tat_and_only_raises_full_at() {
        let mut s = set_of(&[entry(1, 10), entry(2, 20)]);
        assert!(s.write(1, 1, 99, 5));
        assert_eq!(
            s.entries(),
            vec![
                entry(1, 10),
                Entry {
                    tats: vec![60, 99],
                    ..entry(2, 20)
                }
            ]
        );
        assert!(s.write(0, 0, 4, 50));
        assert_eq!(
            s.entries()[0],
            Entry {
                fingerprint: 1,
                full_at_ns: 50,
                tats: vec![4, 7]
            }
        );
        assert!(!s.write(0, 2, 1, 1) && !s.write(2, 0, 1, 1));
        assert_eq!(Set::tat(s.tats(1), 1), Some(99));
        assert_eq!(Set::tat(s.tats(1), 2), None);
    }

    #[test]
    fn placement_prefers_found_then_free_then_idle_then_nearest_full() {
        let mut s = Set::default();
        for fp in 1..=4 {
            assert_eq!(
                s.place(fp, 2, 100, &Pinned::default()),
                Placement::Fresh(fp as usize - 1)
            );
            assert!(s.write(fp as usize - 1, 0, 0, 1000 + fp));
        }
        assert_eq!(s.place(3, 2, 100, &Pinned::default()), Placement::Found(2));
        // All four hold state at t=100: the one full soonest goes.
        assert_eq!(
            s.place(9, 2, 100, &Pinned::default()),
            Placement::Evicted(0)
        );
        assert_eq!(
            s.entries()[0],
            Entry {
                fingerprint: 9,
                full_at_ns: 0,
                tats: vec![0, 0]
            }
        );
        assert!(s.write(0, 0, 0, 5000));
        // At t=1003, fp 2 (full at 1002) is idle: replacing it evicts nothing.
        assert_eq!(
            s.place(10, 2, 1003, &Pinned::default()),
            Placement::Fresh(1)
        );
        // Pinned entries survive; with all pinned the set grows.
        assert_eq!(
            s.place(11, 2, 0, &Pinned::of(&[0, 1, 2, 3])),
            Placement::Fresh(4)
        );
        // A bucket whose rule changed its number of limits starts fresh.
        assert!(s.write(2, 0, 7, 7));
        assert_eq!(s.place(3, 3, 0, &Pinned::default()), Placement::Fresh(2));
        assert_eq!(
            s.entries()[2],
            Entry {
                fingerprint: 3,
                full_at_ns: 0,
                tats: vec![0; 3]
            }
        );
        assert_eq!(s.entries()[4].fingerprint, 11);
        assert_eq!(Set::decode(s.bytes()).unwrap(), s);
    }

    #[test]
    fn a_set_of_255_entries_all_claimed_stores_no_more() {
        let mut s = Set::default();
        let all = Pinned::of(&(0..255).collect::<Vec<_>>());
        for fp in 0..255u64 {
            assert_eq!(s.place(fp, 1, 0, &all), Placement::Fresh(fp as usize));
        }
        let before = s.clone();
        assert_eq!(s.place(1000, 1, 0, &all), Placement::Unstored);
        assert_eq!(s, before);
    }

    /// The set as decoded entries, placed as the table did before it kept
    /// its bytes: the model the in-place set must match.
    fn model_place(
        entries: &mut Vec<Entry>,
        fingerprint: u64,
        limits: usize,
        now_ns: u64,
        pinned: &[usize],
    ) -> Placement {
        let fresh = || Entry {
            fingerprint,
            full_at_ns: 0,
            tats: vec![0; limits],
        };
        if let Some(i) = entries.iter().position(|e| e.fingerprint == fingerprint) {
            if entries[i].tats.len() != limits {
                entries[i] = fresh();
                return Placement::Fresh(i);
            }
            return Placement::Found(i);
        }
        if entries.len() < WAYS {
            entries.push(fresh());
            return Placement::Fresh(entries.len() - 1);
        }
        let victim = entries
            .iter()
            .enumerate()
            .filter(|(i, _)| !pinned.contains(i))
            .min_by_key(|(_, e)| e.full_at_ns)
            .map(|(i, e)| (i, e.full_at_ns <= now_ns));
        match victim {
            Some((i, idle)) => {
                entries[i] = fresh();
                if idle {
                    Placement::Fresh(i)
                } else {
                    Placement::Evicted(i)
                }
            }
            None => {
                entries.push(fresh());
                Placement::Fresh(entries.len() - 1)
            }
        }
    }

    proptest! {
        /// Any run of placements and writes leaves the stored bytes holding
        /// exactly what the decoded model holds, through a store round trip.
        #[test]
        fn the_set_in_place_matches_the_decoded_model(
            ops in proptest::collection::vec(
                (0u64..8, 1usize..4, 0u64..100, proptest::collection::vec(0usize..6, 0..4),
                 0usize..4, any::<u128>(), 0u64..200),
                1..60,
            ),
        ) {
            let mut set = Set::default();
            let mut model: Vec<Entry> = Vec::new();
            for (fp, limits, now, pinned, state, value, full_at) in ops {
                let placed = set.place(fp, limits, now, &Pinned::of(&pinned));
                prop_assert_eq!(placed, model_place(&mut model, fp, limits, now, &pinned));
                let i = placed.index().unwrap_or(usize::MAX);
                let wrote = set.write(i, state, value, full_at);
                let expected = model.get_mut(i).and_then(|e| {
                    let t = e.tats.get_mut(state)?;
                    *t = value;
                    e.full_at_ns = e.full_at_ns.max(full_at);
                    Some(())
                });
                prop_assert_eq!(wrote, expected.is_some());
                set = Set::from_bytes(set.into_bytes()).expect("a set's own bytes decode");
                prop_assert_eq!(set.entries(), model.clone());
                prop_assert_eq!(set.find(fp), model.iter().position(|e| e.fingerprint == fp));
            }
        }

        /// A write through where an entry was placed lands where a write to
        /// its index does, even after later placements moved it.
        #[test]
        fn a_write_at_a_placement_matches_a_write_by_index(
            start in proptest::collection::vec((0u64..8, 1usize..4), 0..6),
            claims in proptest::collection::vec((0u64..8, 1usize..4), 1..6),
            state in 0usize..4,
            value in any::<u128>(),
        ) {
            let mut set = Set::default();
            for (fp, limits) in start {
                set.place(fp, limits, 0, &Pinned::default());
            }
            let mut pinned = Pinned::default();
            let mut placed = Vec::new();
            for (fp, limits) in claims {
                let (placement, at) = set.claim(fp, limits, 0, &pinned);
                pinned.insert(placement.index().unwrap_or(usize::MAX));
                prop_assert_eq!(
                    set.tats_at(at),
                    placement.index().map_or(&[][..], |i| set.tats(i))
                );
                placed.push((placement, at));
            }
            for (placement, at) in placed {
                let mut by_index = set.clone();
                let wrote = set.write_at(at, state, value, 7);
                let i = placement.index().unwrap_or(usize::MAX);
                prop_assert_eq!(wrote, by_index.write(i, state, value, 7));
                prop_assert_eq!(set.bytes(), by_index.bytes());
            }
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(s) = Set::decode(&bytes) {
                // What decodes is read whole: every entry it counts.
                prop_assert_eq!(s.entries().len(), s.len());
            }
        }
    }
}
