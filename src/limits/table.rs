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
        let mut n = itoa::Buffer::new();
        let index = n.format(index);
        let mut key = String::with_capacity(self.key_prefix.len() + index.len());
        key.push_str(&self.key_prefix);
        key.push_str(index);
        key
    }
}

const VERSION: u8 = 1;

/// One bucket: all limits of one rule for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Keyed hash of domain, rule, limits and key.
    pub fingerprint: u64,
    /// When every limit of the bucket is full again (ns); an entry past this holds no state worth keeping.
    pub full_at_ns: u64,
    /// Theoretical arrival time per limit, in that limit's scaled units.
    pub tats: Vec<u128>,
}

/// The decoded value of one set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Set {
    /// The set's buckets.
    pub entries: Vec<Entry>,
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
}

impl Placement {
    /// The entry's index in the set.
    pub fn index(self) -> usize {
        match self {
            Placement::Found(i) | Placement::Fresh(i) | Placement::Evicted(i) => i,
        }
    }
}

impl Set {
    /// Serialises the set: version, count, then per entry fingerprint, full-at, count of TATs and the TATs.
    pub fn encode(&self) -> Vec<u8> {
        // Sized exactly: growing it reallocated for entries of two or more limits.
        let entries = self.entries.iter().take(usize::from(u8::MAX));
        let size = 2 + entries
            .clone()
            .map(|e| 17 + 16 * e.tats.len().min(usize::from(u8::MAX)))
            .sum::<usize>();
        let mut out = Vec::with_capacity(size);
        out.push(VERSION);
        out.push(u8::try_from(self.entries.len()).unwrap_or(u8::MAX));
        for e in entries {
            out.extend_from_slice(&e.fingerprint.to_le_bytes());
            out.extend_from_slice(&e.full_at_ns.to_le_bytes());
            out.push(u8::try_from(e.tats.len()).unwrap_or(u8::MAX));
            for t in e.tats.iter().take(usize::from(u8::MAX)) {
                out.extend_from_slice(&t.to_le_bytes());
            }
        }
        out
    }

    /// Parses what [`Set::encode`] wrote; an empty value is an empty set.
    pub fn decode(bytes: &[u8]) -> Result<Set, Corrupt> {
        if bytes.is_empty() {
            return Ok(Set::default());
        }
        let mut r = Reader(bytes);
        if r.u8()? != VERSION {
            return Err(Corrupt);
        }
        let n = r.u8()?;
        let mut entries = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            let fingerprint = u64::from_le_bytes(r.array()?);
            let full_at_ns = u64::from_le_bytes(r.array()?);
            let k = r.u8()?;
            let mut tats = Vec::with_capacity(usize::from(k));
            for _ in 0..k {
                tats.push(u128::from_le_bytes(r.array()?));
            }
            entries.push(Entry {
                fingerprint,
                full_at_ns,
                tats,
            });
        }
        if !r.0.is_empty() {
            return Err(Corrupt);
        }
        Ok(Set { entries })
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
        pinned: &[usize],
    ) -> Placement {
        // Built only when needed: a found bucket (the common case) allocates nothing.
        let fresh = || Entry {
            fingerprint,
            full_at_ns: 0,
            tats: vec![0; limits],
        };
        if let Some(i) = self
            .entries
            .iter()
            .position(|e| e.fingerprint == fingerprint)
        {
            if let Some(e) = self.entries.get_mut(i) {
                if e.tats.len() != limits {
                    *e = fresh();
                    return Placement::Fresh(i);
                }
            }
            return Placement::Found(i);
        }
        if self.entries.len() < WAYS {
            self.entries.push(fresh());
            return Placement::Fresh(self.entries.len() - 1);
        }
        let victim = self
            .entries
            .iter()
            .enumerate()
            .filter(|(i, _)| !pinned.contains(i))
            .min_by_key(|(_, e)| e.full_at_ns)
            .map(|(i, e)| (i, e.full_at_ns <= now_ns));
        match victim {
            Some((i, idle)) => {
                if let Some(slot) = self.entries.get_mut(i) {
                    *slot = fresh();
                }
                if idle {
                    Placement::Fresh(i)
                } else {
                    Placement::Evicted(i)
                }
            }
            None => {
                self.entries.push(fresh());
                Placement::Fresh(self.entries.len() - 1)
            }
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u8(&mut self) -> Result<u8, Corrupt> {
        let (&b, rest) = self.0.split_first().ok_or(Corrupt)?;
        self.0 = rest;
        Ok(b)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Corrupt> {
        let (head, rest) = self.0.split_first_chunk::<N>().ok_or(Corrupt)?;
        self.0 = rest;
        Ok(*head)
    }
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

    #[test]
    fn round_trips() {
        let s = Set {
            entries: vec![entry(1, 10), entry(u64::MAX, u64::MAX)],
        };
        assert_eq!(Set::decode(&s.encode()).unwrap(), s);
        assert_eq!(Set::decode(b"").unwrap(), Set::default());
    }

    #[test]
    fn garbage_is_corrupt_not_a_panic() {
        assert_eq!(Set::decode(&[9]), Err(Corrupt));
        assert_eq!(Set::decode(&[VERSION, 1, 0, 0]), Err(Corrupt));
        let mut long = Set {
            entries: vec![entry(1, 1)],
        }
        .encode();
        long.push(0);
        assert_eq!(Set::decode(&long), Err(Corrupt));
    }

    #[test]
    fn placement_prefers_found_then_free_then_idle_then_nearest_full() {
        let mut s = Set::default();
        for fp in 1..=4 {
            assert_eq!(s.place(fp, 2, 100, &[]), Placement::Fresh(fp as usize - 1));
            s.entries[fp as usize - 1].full_at_ns = 1000 + fp;
        }
        assert_eq!(s.place(3, 2, 100, &[]), Placement::Found(2));
        // All four hold state at t=100: the one full soonest goes.
        assert_eq!(s.place(9, 2, 100, &[]), Placement::Evicted(0));
        assert_eq!(s.entries[0].fingerprint, 9);
        s.entries[0].full_at_ns = 5000;
        // At t=1003, fp 2 (full at 1002) is idle: replacing it evicts nothing.
        assert_eq!(s.place(10, 2, 1003, &[]), Placement::Fresh(1));
        // Pinned entries survive; with all pinned the set grows.
        assert_eq!(s.place(11, 2, 0, &[0, 1, 2, 3]), Placement::Fresh(4));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Set::decode(&bytes);
        }
    }
}
