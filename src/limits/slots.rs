//! A direct-mapped table of shared-data keys, for state kept per global
//! bucket (the lease slots, the deny cache): a keyed hash of the bucket picks
//! its slot and, from other bits, the fingerprint that says which bucket a
//! slot holds. Bounded whatever the number of clients, and keyed with the
//! proxy's seed so that a client cannot aim at another's slot.

use siphasher::sip::SipHasher13;
use std::hash::Hasher;

/// `count` slots named `<key_prefix><index>`.
#[derive(Debug, Clone)]
pub struct Slots {
    /// Number of slots (shared-data keys), at least 1.
    pub count: u64,
    /// Prefix of the slot keys, ending in `/`.
    pub key_prefix: String,
    hasher: SipHasher13,
}

/// Where one bucket's slot is, and how the slot names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// Shared-data key of the slot.
    pub key: String,
    /// Identity of the bucket in the slot; never 0 (0 is an empty slot).
    pub fingerprint: u64,
}

impl Slots {
    /// A table of `count` (at least 1) slots under `key_prefix`; `keys` is the proxy's seed.
    pub fn new(key_prefix: String, count: u64, keys: (u64, u64)) -> Slots {
        Slots {
            count: count.max(1),
            key_prefix,
            hasher: SipHasher13::new_with_keys(keys.0, keys.1),
        }
    }

    /// The keyed hash of a bucket's identity `parts`, separated by a byte
    /// (0xff) that no UTF-8 text holds, so that parts cannot run together.
    pub fn hash(&self, parts: &[&[u8]]) -> u64 {
        let mut h = self.hasher;
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                h.write_u8(0xff);
            }
            h.write(part);
        }
        h.finish()
    }

    /// The slot of the bucket named by `parts`.
    pub fn place(&self, parts: &[&[u8]]) -> Placed {
        let hash = self.hash(parts);
        // The slot index and the fingerprint come from different bits of one hash.
        Placed {
            key: format!("{}{}", self.key_prefix, (hash >> 32) % self.count),
            fingerprint: hash | 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_do_not_run_together_and_slots_stay_in_range() {
        let s = Slots::new("p/".into(), 3, (1, 2));
        assert_ne!(s.hash(&[b"ab", b"c"]), s.hash(&[b"a", b"bc"]));
        for i in 0..100u32 {
            let p = s.place(&[&i.to_le_bytes()]);
            let index: u64 = p.key.strip_prefix("p/").unwrap().parse().unwrap();
            assert!(index < 3 && p.fingerprint & 1 == 1, "{p:?}");
        }
        let zero = Slots::new("z/".into(), 0, (1, 2));
        assert_eq!(zero.place(&[b"x"]).key, "z/0");
    }
}
