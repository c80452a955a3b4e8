//! Unit tests of the in-flight slots, over the in-memory store.

use super::*;
use crate::limits::store::{MemoryStore, StoreError};
use proptest::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// One key's slots, decoded: what the tests compare.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    fingerprint: u64,
    slots: Vec<Slot>,
}

/// Every key stored in a set's value, with all its slots.
fn decode(bytes: &[u8]) -> Result<Vec<Entry>, Corrupt> {
    let mut entries = Vec::new();
    index(bytes, 0, |w| {
        entries.push(Entry {
            fingerprint: w.fingerprint,
            slots: stored_slots(bytes, &w).map(Slot::read).collect(),
        })
    })?;
    Ok(entries)
}

/// A set's value holding `entries`, as the module writes it.
fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = vec![VERSION];
    for e in entries {
        out.extend_from_slice(&e.fingerprint.to_le_bytes());
        out.extend_from_slice(&(e.slots.len() as u16).to_le_bytes());
        for s in &e.slots {
            s.write(&mut out);
        }
    }
    out
}

const SEC: u64 = 1_000_000_000;
const T0: u64 = 1_700_000_000 * SEC;
const MAX: u64 = 300 * SEC;

fn layout() -> InFlightLayout {
    InFlightLayout::new("d", 64)
}

fn key(fingerprint: u64, set: u64, limit: u32) -> SlotKey {
    SlotKey {
        set,
        fingerprint,
        limit,
    }
}

fn take(store: &impl SharedStore, keys: &[SlotKey], now_ns: u64, id: u32) -> Acquired {
    acquire(store, &layout(), keys, now_ns, MAX, id)
        .unwrap()
        .acquired
}

fn held(a: &Acquired) -> Vec<Taken> {
    match a {
        Acquired::Taken(t) => t.clone(),
        other => panic!("not taken: {other:?}"),
    }
}

/// Slots of `key` alive at `now_ns`, as stored.
fn live(store: &MemoryStore, layout: &InFlightLayout, key: SlotKey, now_ns: u64) -> usize {
    let Some((bytes, _)) = store.get(&layout.set_key(key.set)).unwrap() else {
        return 0;
    };
    decode(&bytes)
        .unwrap()
        .iter()
        .filter(|e| e.fingerprint == key.fingerprint)
        .flat_map(|e| &e.slots)
        .filter(|s| s.deadline_ns > now_ns)
        .count()
}

/// Every set's value and version.
fn snapshot(store: &MemoryStore, layout: &InFlightLayout) -> Vec<Option<(Vec<u8>, u32)>> {
    (0..layout.sets)
        .map(|i| store.get(&layout.set_key(i)).unwrap())
        .collect()
}

#[test]
fn the_layout_names_a_bounded_number_of_sets() {
    let l = InFlightLayout::new("api", 64);
    assert_eq!(l.sets, 16);
    assert_eq!(l.set_key(3), "ratelimit-wasm/inflight/api/16/3");
    assert_eq!(l.set_key(19), l.set_key(3));
    assert!(l.set_of(u64::MAX) < 16);
    assert_eq!(InFlightLayout::new("api", 0).sets, 1);
}

#[test]
fn a_limit_of_three_takes_three_and_refuses_the_fourth_until_one_is_released() {
    let store = MemoryStore::default();
    let k = key(7, 1, 3);
    let mut holders = Vec::new();
    for id in 1..=3 {
        let a = take(&store, &[k], T0, id);
        let Acquired::Taken(t) = &a else {
            panic!("{a:?}")
        };
        assert_eq!(t.first().map(|t| t.in_flight), Some(id));
        holders.push(held(&a));
    }
    let full = take(&store, &[k], T0 + SEC, 4);
    assert_eq!(
        full,
        Acquired::Full {
            key: 0,
            in_flight: 3,
            earliest_deadline_ns: T0 + MAX
        }
    );
    release(&store, &layout(), &holders[1], T0 + SEC).unwrap();
    assert!(matches!(
        take(&store, &[k], T0 + SEC, 5),
        Acquired::Taken(_)
    ));
    assert!(matches!(
        take(&store, &[k], T0 + SEC, 6),
        Acquired::Full { .. }
    ));
    assert_eq!(live(&store, &layout(), k, T0 + SEC), 3);
}

/// A store where, before chosen writes, another worker acquires first.
struct Interleaved<'a> {
    inner: &'a MemoryStore,
    rival_turns: Cell<u32>,
    rival: SlotKey,
    rival_got: RefCell<Vec<Acquired>>,
}

impl SharedStore for Interleaved<'_> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.inner.get(key)
    }
    fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError> {
        if self.rival_turns.get() > 0 {
            self.rival_turns.set(self.rival_turns.get() - 1);
            let id = 1000 + self.rival_got.borrow().len() as u32;
            let got = take(self.inner, &[self.rival], T0, id);
            self.rival_got.borrow_mut().push(got);
        }
        self.inner.compare_and_set(key, value, cas)
    }
}

#[test]
fn two_workers_interleaved_between_read_and_write_never_exceed_the_limit() {
    let store = MemoryStore::default();
    let k = key(9, 2, 5);
    let worker = Interleaved {
        inner: &store,
        rival_turns: Cell::new(0),
        rival: k,
        rival_got: RefCell::new(Vec::new()),
    };
    let mut mine = 0;
    for id in 1..=8 {
        // The rival writes between this worker's read and its write.
        worker.rival_turns.set(1);
        if let Acquired::Taken(_) = take(&worker, &[k], T0, id) {
            mine += 1;
        }
    }
    let theirs = worker
        .rival_got
        .borrow()
        .iter()
        .filter(|a| matches!(a, Acquired::Taken(_)))
        .count();
    assert!(mine > 0 && theirs > 0, "{mine} {theirs}");
    assert_eq!(mine + theirs, 5);
    assert_eq!(live(&store, &layout(), k, T0), 5);
}

#[test]
fn a_slot_never_released_is_reclaimed_at_its_deadline_not_before() {
    let store = MemoryStore::default();
    let k = key(3, 0, 1);
    let first = take(&store, &[k], T0, 1);
    assert_eq!(
        held(&first).first().map(|h| h.held.deadline_ns),
        Some(T0 + MAX)
    );
    let before = take(&store, &[k], T0 + MAX - 1, 2);
    assert!(
        matches!(before, Acquired::Full { in_flight: 1, .. }),
        "{before:?}"
    );
    let at = take(&store, &[k], T0 + MAX, 3);
    assert!(matches!(at, Acquired::Taken(_)), "{at:?}");
    assert_eq!(live(&store, &layout(), k, T0 + MAX), 1);
}

#[test]
fn releasing_an_unknown_or_expired_slot_writes_nothing() {
    let store = MemoryStore::default();
    let k = key(3, 0, 4);
    let a = held(&take(&store, &[k], T0, 1));
    let before = snapshot(&store, &layout());
    let slot = |key, id| Taken {
        held: Held {
            key,
            id,
            deadline_ns: T0 + MAX,
        },
        in_flight: 1,
    };
    let (unknown, elsewhere) = (slot(k, 99), slot(key(4, 5, 4), 1));
    release(&store, &layout(), &[unknown, elsewhere], T0 + SEC).unwrap();
    assert_eq!(snapshot(&store, &layout()), before);
    // Past its deadline the slot is gone whoever writes: its release only drops it.
    release(&store, &layout(), &a, T0 + MAX).unwrap();
    release(&store, &layout(), &a, T0 + MAX).unwrap();
    assert_eq!(live(&store, &layout(), k, T0), 0);
    let after = snapshot(&store, &layout());
    release(&store, &layout(), &a, T0 + MAX + 1).unwrap();
    assert_eq!(snapshot(&store, &layout()), after);
}

#[test]
fn a_double_release_removes_only_the_holders_slot() {
    let store = MemoryStore::default();
    let k = key(3, 0, 4);
    // Same deadline, different holders.
    let a = held(&take(&store, &[k], T0, 1));
    let _b = held(&take(&store, &[k], T0, 2));
    release(&store, &layout(), &a, T0).unwrap();
    release(&store, &layout(), &a, T0).unwrap();
    assert_eq!(live(&store, &layout(), k, T0), 1);
}

#[test]
fn a_full_second_key_releases_the_first_and_leaves_the_store_as_it_was() {
    let store = MemoryStore::default();
    let first = key(1, 0, 3);
    let second = key(2, 1, 1);
    let other = key(3, 0, 3);
    held(&take(&store, &[second, other], T0, 1));
    let before: Vec<_> = snapshot(&store, &layout())
        .into_iter()
        .map(|v| v.map(|(bytes, _)| bytes))
        .collect();
    let a = take(&store, &[first, second], T0 + SEC, 2);
    assert_eq!(
        a,
        Acquired::Full {
            key: 1,
            in_flight: 1,
            earliest_deadline_ns: T0 + MAX
        }
    );
    let after: Vec<_> = snapshot(&store, &layout())
        .into_iter()
        .map(|v| v.map(|(bytes, _)| bytes))
        .collect();
    assert_eq!(after, before);
    assert_eq!(live(&store, &layout(), first, T0 + SEC), 0);
}

#[test]
fn keys_of_one_set_are_taken_in_one_write_in_the_order_asked() {
    let store = MemoryStore::default();
    let keys = [key(5, 1, 2), key(6, 0, 2), key(7, 1, 2)];
    let a = acquire(&store, &layout(), &keys, T0, MAX, 1).unwrap();
    assert_eq!(a.stats, InFlightStats::default());
    let got: Vec<_> = held(&a.acquired).iter().map(|h| h.held.key).collect();
    assert_eq!(got, keys);
    // One write per set (versions count every write of the store): set 1
    // was written once for both its keys.
    assert_eq!(store.len(), 2);
    let mut versions: Vec<u32> = (0..2)
        .map(|i| store.get(&layout().set_key(i)).unwrap().unwrap().1)
        .collect();
    versions.sort();
    assert_eq!(versions, vec![1, 2]);
}

/// A store whose writes to one key lose to another writer `lost` times.
struct Racing {
    inner: MemoryStore,
    contended: String,
    lost: Cell<u32>,
}

impl SharedStore for Racing {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.inner.get(key)
    }
    fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError> {
        if key == self.contended && self.lost.get() > 0 {
            self.lost.set(self.lost.get() - 1);
            // The other writer rewrites what it read: same value, new version.
            let current = self.inner.get(key)?.map(|(v, _)| v).unwrap_or_default();
            self.inner.compare_and_set(key, &current, 0)?;
        }
        self.inner.compare_and_set(key, value, cas)
    }
}

#[test]
fn lost_races_are_retried() {
    let store = Racing {
        inner: MemoryStore::default(),
        contended: layout().set_key(0),
        lost: Cell::new(2),
    };
    let k = key(1, 0, 2);
    let a = acquire(&store, &layout(), &[k], T0, MAX, 1).unwrap();
    assert!(matches!(a.acquired, Acquired::Taken(_)));
    assert_eq!(a.stats.cas_retries, 2);
    assert_eq!(live(&store.inner, &layout(), k, T0), 1);
}

#[test]
fn contention_past_the_attempts_is_an_error_and_holds_no_slot() {
    let store = Racing {
        inner: MemoryStore::default(),
        contended: layout().set_key(1),
        lost: Cell::new(u32::MAX),
    };
    let first = key(1, 0, 2);
    let second = key(2, 1, 2);
    let r = acquire(&store, &layout(), &[first, second], T0, MAX, 1);
    assert_eq!(r, Err(LimitError::Contention));
    assert_eq!(live(&store.inner, &layout(), first, T0), 0);
    assert_eq!(live(&store.inner, &layout(), second, T0), 0);
}

#[test]
fn a_new_key_in_a_full_set_evicts_the_key_whose_last_slot_ends_first() {
    let store = MemoryStore::default();
    let keys: Vec<_> = (1..=WAYS as u64).map(|fp| key(fp, 0, 4)).collect();
    for (i, k) in keys.iter().enumerate() {
        // Key 2 (index 1) starts first, so its only slot ends first.
        let at = if i == 1 { T0 } else { T0 + SEC };
        held(&take(&store, &[*k], at, 1));
    }
    let newcomer = key(100, 0, 4);
    let a = acquire(&store, &layout(), &[newcomer], T0 + 2 * SEC, MAX, 2).unwrap();
    assert!(matches!(a.acquired, Acquired::Taken(_)));
    assert_eq!(a.stats.evictions, 1);
    let entries = decode(&store.get(&layout().set_key(0)).unwrap().unwrap().0).unwrap();
    let fps: Vec<_> = entries.iter().map(|e| e.fingerprint).collect();
    assert_eq!(fps, vec![1, 100, 3, 4]);
}

#[test]
fn keys_of_one_request_do_not_evict_each_other() {
    let store = MemoryStore::default();
    let keys: Vec<_> = (1..=WAYS as u64 + 1).map(|fp| key(fp, 0, 4)).collect();
    let a = take(&store, &keys, T0, 1);
    assert_eq!(a, Acquired::Crowded { key: WAYS });
    assert!(store.is_empty());
    // One key fewer fits.
    assert!(matches!(
        take(&store, &keys[..WAYS], T0, 1),
        Acquired::Taken(_)
    ));
}

#[test]
fn a_million_keys_stay_within_the_sets_and_the_byte_bound() {
    let store = MemoryStore::default();
    let l = layout();
    let mut evictions = 0;
    for i in 0..1_000_000u64 {
        let hash = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let k = key(hash, l.set_of(hash), 2);
        let a = acquire(&store, &l, &[k], T0 + i, MAX, 1).unwrap();
        assert!(matches!(a.acquired, Acquired::Taken(_)));
        evictions += a.stats.evictions;
    }
    assert!(evictions > 999_000, "{evictions}");
    assert!(store.len() as u64 <= l.sets);
    for v in snapshot(&store, &l).into_iter().flatten() {
        assert!(v.0.len() <= MAX_SET_BYTES);
        assert!(decode(&v.0).unwrap().len() <= WAYS);
    }
}

#[test]
fn a_set_at_its_most_slots_is_max_set_bytes_and_limits_are_clamped() {
    let store = MemoryStore::default();
    for fp in 1..=WAYS as u64 {
        let k = key(fp, 0, u32::MAX);
        for id in 0..MAX_CONCURRENT {
            assert!(matches!(take(&store, &[k], T0, id), Acquired::Taken(_)));
        }
        let full = take(&store, &[k], T0, MAX_CONCURRENT);
        assert!(matches!(
            full,
            Acquired::Full {
                in_flight: MAX_CONCURRENT,
                ..
            }
        ));
    }
    let (bytes, _) = store.get(&layout().set_key(0)).unwrap().unwrap();
    assert_eq!(bytes.len(), MAX_SET_BYTES);
}

#[test]
fn a_limit_of_zero_is_always_full() {
    let store = MemoryStore::default();
    let a = take(&store, &[key(1, 0, 0)], T0, 1);
    assert_eq!(
        a,
        Acquired::Full {
            key: 0,
            in_flight: 0,
            earliest_deadline_ns: u64::MAX
        }
    );
    assert!(store.is_empty());
}

#[test]
fn corrupt_set_bytes_are_taken_as_empty_and_rewritten() {
    let l = layout();
    let k = key(1, 0, 1);
    let one = encode(&[Entry {
        fingerprint: 1,
        slots: vec![Slot {
            deadline_ns: T0 + MAX,
            id: 1,
        }],
    }]);
    let mut truncated = one.clone();
    truncated.pop();
    let mut twice = one.clone();
    twice.extend_from_slice(&one[1..]);
    for bad in [vec![9], vec![VERSION, 1, 2], truncated, twice] {
        let store = MemoryStore::default();
        store.compare_and_set(&l.set_key(0), &bad, 0).unwrap();
        let a = acquire(&store, &l, &[k], T0, MAX, 7).unwrap();
        assert!(matches!(a.acquired, Acquired::Taken(_)), "{bad:?}");
        assert_eq!(a.stats.corrupt_sets, 1);
        assert_eq!(live(&store, &l, k, T0), 1);
        // A corrupt set is rewritten by a release too.
        store.compare_and_set(&l.set_key(0), &bad, 0).unwrap();
        let r = release(&store, &l, &held(&a.acquired), T0).unwrap();
        assert_eq!(r.corrupt_sets, 1);
        assert_eq!(store.get(&l.set_key(0)).unwrap().unwrap().0, vec![VERSION]);
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A request of one of two workers takes a slot of each key in the mask.
    Acquire { worker: u32, mask: u8 },
    /// A request, still held or not, gives its slots back.
    Release { pick: usize },
    /// Time moves on.
    Advance { secs: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..2, 1u8..8).prop_map(|(worker, mask)| Op::Acquire { worker, mask }),
        2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => (0u64..120).prop_map(|secs| Op::Advance { secs }),
    ]
}

proptest! {
    /// Live slots per key never pass the limit and always equal a model's
    /// count, through random acquires, releases (double ones too) and time.
    #[test]
    fn random_acquires_releases_and_time_keep_every_key_at_the_models_count(
        ops in proptest::collection::vec(op(), 1..80),
        limit in 1u32..4,
    ) {
        let store = MemoryStore::default();
        let l = InFlightLayout::new("p", 8);
        let keys = [key(11, 0, limit), key(12, 0, limit), key(13, 1, limit)];
        let max = 60 * SEC;
        let mut now = T0;
        let mut model: HashMap<u64, Vec<(u64, u32)>> = HashMap::new();
        let mut requests: Vec<Vec<Taken>> = Vec::new();
        let mut next_id = 0u32;
        for op in ops {
            match op {
                Op::Acquire { worker, mask } => {
                    next_id += 1;
                    let id = next_id * 2 + worker;
                    let asked: Vec<SlotKey> = keys
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| mask & (1 << i) != 0)
                        .map(|(_, k)| *k)
                        .collect();
                    let a = acquire(&store, &l, &asked, now, max, id).unwrap();
                    let room = asked.iter().all(|k| {
                        let n = model.get(&k.fingerprint).map_or(0, |s| {
                            s.iter().filter(|(d, _)| *d > now).count()
                        });
                        n < limit as usize
                    });
                    prop_assert_eq!(matches!(a.acquired, Acquired::Taken(_)), room);
                    if let Acquired::Taken(t) = a.acquired {
                        for k in &asked {
                            model.entry(k.fingerprint).or_default().push((now + max, id));
                        }
                        requests.push(t);
                    }
                }
                Op::Release { pick } => {
                    if requests.is_empty() {
                        continue;
                    }
                    let h = &requests[pick % requests.len()];
                    release(&store, &l, h, now).unwrap();
                    for Taken { held: h, .. } in h {
                        let slots = model.entry(h.key.fingerprint).or_default();
                        if let Some(i) = slots.iter().position(|s| *s == (h.deadline_ns, h.id)) {
                            slots.swap_remove(i);
                        }
                    }
                }
                Op::Advance { secs } => now += secs * SEC,
            }
            for k in keys {
                let expected = model
                    .get(&k.fingerprint)
                    .map_or(0, |s| s.iter().filter(|(d, _)| *d > now).count());
                let got = live(&store, &l, k, now);
                prop_assert!(got <= limit as usize);
                prop_assert_eq!(got, expected);
            }
        }
    }

    /// With more keys than one set has ways, evictions forget counts but
    /// never let a key pass its limit, and the set stays within its ways.
    #[test]
    fn evictions_never_let_a_key_pass_its_limit(
        ops in proptest::collection::vec((0u64..8, any::<bool>(), 0u64..30), 1..120),
    ) {
        let store = MemoryStore::default();
        let l = InFlightLayout::new("e", 1);
        let mut now = T0;
        let mut requests: Vec<Vec<Taken>> = Vec::new();
        for (i, (fp, give_back, secs)) in ops.into_iter().enumerate() {
            let k = key(fp, 0, 2);
            let a = acquire(&store, &l, &[k], now, 20 * SEC, i as u32).unwrap();
            if let Acquired::Taken(t) = a.acquired {
                requests.push(t);
            }
            if give_back && !requests.is_empty() {
                let h = requests.swap_remove(i % requests.len());
                release(&store, &l, &h, now).unwrap();
            }
            now += secs * SEC;
            let (bytes, _) = store.get(&l.set_key(0)).unwrap().unwrap_or_default();
            let entries = decode(&bytes).unwrap();
            prop_assert!(entries.len() <= WAYS);
            for fp in 0..8 {
                prop_assert!(live(&store, &l, key(fp, 0, 2), now) <= 2);
            }
        }
    }

    /// What is encoded decodes to the same entries.
    #[test]
    fn a_set_round_trips(
        entries in proptest::collection::vec(
            proptest::collection::vec((any::<u64>(), any::<u32>()), 0..5),
            0..=WAYS,
        ),
    ) {
        let entries: Vec<Entry> = entries
            .into_iter()
            .enumerate()
            .map(|(i, slots)| Entry {
                fingerprint: i as u64,
                slots: slots
                    .into_iter()
                    .map(|(deadline_ns, id)| Slot { deadline_ns, id })
                    .collect(),
            })
            .collect();
        prop_assert_eq!(decode(&encode(&entries)), Ok(entries));
    }

    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode(&bytes);
    }
}
