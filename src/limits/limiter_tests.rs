//! Unit tests of the all-or-nothing charge, over a compiled plan.

use super::*;
use crate::config;
use crate::limits::store::MemoryStore;
use crate::policy::plan::Plan;
use std::cell::Cell;

const SEC: u64 = 1_000_000_000;
const T0: u64 = 1_700_000_000 * SEC;

fn plan(json: &str) -> Plan {
    Plan::compile(&config::parse(json.as_bytes()).unwrap(), [1; 16])
}

fn bucket(rule: usize, fp: u64, set: u64) -> Bucket {
    Bucket {
        rule,
        variant: 0,
        fingerprint: fp,
        set,
        cost: 1,
    }
}

fn allowed(d: &Decision) -> bool {
    matches!(d, Decision::Allowed(_))
}

const TWO_RULES: &str = r#"{"domain":"t","max_buckets":64,"rules":[
    {"name":"a","limits":[{"requests":10,"per":"1h"}]},
    {"name":"b","limits":[{"requests":3,"per":"1h"}]}]}"#;

#[test]
fn exact_count_then_deny_and_denials_charge_nothing() {
    let p = plan(TWO_RULES);
    let s = MemoryStore::default();
    let mut st = Stats::default();
    let both = [bucket(0, 1, 0), bucket(1, 2, 5)];
    let n = (0..10)
        .filter(|_| allowed(&check_and_consume(&s, &p, &both, T0, 0.0, &mut st).unwrap()))
        .count();
    assert_eq!(n, 3, "rule b holds three");
    // Rule a was charged only for the three admitted requests.
    let only_a = [bucket(0, 1, 0)];
    let m = (0..20)
        .filter(|_| allowed(&check_and_consume(&s, &p, &only_a, T0, 0.0, &mut st).unwrap()))
        .count();
    assert_eq!(m, 7);
    assert_eq!(st, Stats::default());
}

#[test]
fn reports_cover_every_limit() {
    let p = plan(
        r#"{"domain":"t","rules":[{"name":"r","limits":[{"requests":60,"per":"1m"},{"requests":10,"per":"1s"}]}]}"#,
    );
    let s = MemoryStore::default();
    let d = check_and_consume(&s, &p, &[bucket(0, 9, 3)], T0, 0.0, &mut Stats::default()).unwrap();
    let Decision::Allowed(r) = d else {
        panic!("denied")
    };
    assert_eq!(
        r.iter()
            .map(|r| (r.limit, r.check.remaining))
            .collect::<Vec<_>>(),
        [(0, 59), (1, 9)]
    );
}

/// A store that runs `change` (another worker) just before the first
/// `sets` compare-and-sets, or just before its read number `read` (from 1).
struct Racing<'a> {
    inner: &'a MemoryStore,
    change: Box<dyn Fn(&MemoryStore) + 'a>,
    sets: Cell<u32>,
    read: u32,
    reads: Cell<u32>,
}

impl<'a> Racing<'a> {
    fn before_sets(inner: &'a MemoryStore, sets: u32, change: impl Fn(&MemoryStore) + 'a) -> Self {
        Racing {
            inner,
            change: Box::new(change),
            sets: Cell::new(sets),
            read: 0,
            reads: Cell::new(0),
        }
    }

    fn before_read(inner: &'a MemoryStore, read: u32, change: impl Fn(&MemoryStore) + 'a) -> Self {
        Racing {
            read,
            ..Racing::before_sets(inner, 0, change)
        }
    }
}

impl SharedStore for Racing<'_> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.reads.set(self.reads.get() + 1);
        if self.reads.get() == self.read {
            (self.change)(self.inner);
        }
        self.inner.get(key)
    }
    fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError> {
        if self.sets.get() > 0 {
            self.sets.set(self.sets.get() - 1);
            (self.change)(self.inner);
        }
        self.inner.compare_and_set(key, value, cas)
    }
}

#[test]
fn a_racing_writer_costs_a_retry_not_an_admission() {
    let p = plan(r#"{"domain":"t","rules":[{"name":"r","limits":[{"requests":5,"per":"1h"}]}]}"#);
    let mem = MemoryStore::default();
    let b = [bucket(0, 42, 1)];
    let other = |m: &MemoryStore| {
        check_and_consume(m, &p, &b, T0, 0.0, &mut Stats::default()).unwrap();
    };
    let racing = Racing::before_sets(&mem, 3, other);
    let mut st = Stats::default();
    let mut admitted_here = 0;
    for _ in 0..5 {
        if allowed(&check_and_consume(&racing, &p, &b, T0, 0.0, &mut st).unwrap()) {
            admitted_here += 1;
        }
    }
    // Three racing requests were admitted by "the other worker" in between.
    assert_eq!(admitted_here, 2);
    assert!(st.cas_retries >= 2, "{st:?}");
    assert!(!allowed(
        &check_and_consume(&mem, &p, &b, T0, 0.0, &mut st).unwrap()
    ));
}

#[test]
fn first_insert_race_loses_nothing() {
    // The other worker creates the set and charges it between our "missing"
    // read and our create-only write of the set.
    let p = plan(r#"{"domain":"t","rules":[{"name":"r","limits":[{"requests":2,"per":"1h"}]}]}"#);
    let mem = MemoryStore::default();
    let b = [bucket(0, 42, 1)];
    let other = |m: &MemoryStore| {
        assert!(allowed(
            &check_and_consume(m, &p, &b, T0, 0.0, &mut Stats::default()).unwrap()
        ));
    };
    let racing = Racing::before_sets(&mem, 1, other);
    let mut st = Stats::default();
    assert!(allowed(
        &check_and_consume(&racing, &p, &b, T0, 0.0, &mut st).unwrap()
    ));
    // Our create-only write lost to theirs, and the retry charged their set.
    assert_eq!(st.cas_retries, 1);
    assert!(!allowed(
        &check_and_consume(&mem, &p, &b, T0, 0.0, &mut st).unwrap()
    ));
}

#[test]
fn conflict_on_the_second_set_refunds_the_first() {
    let p = plan(TWO_RULES);
    let mem = MemoryStore::default();
    let both = [bucket(0, 1, 0), bucket(1, 2, 5)];
    // Prime both sets so that both exist.
    check_and_consume(&mem, &p, &both, T0, 0.0, &mut Stats::default()).unwrap();
    let set5 = p.set_key(5);
    let calls = Cell::new(0);
    let bump = |m: &MemoryStore| {
        calls.set(calls.get() + 1);
        if calls.get() == 2 {
            // Touch set 5 (without charging) just before our write to it.
            let (v, cas) = m.get(&set5).unwrap().unwrap();
            assert!(m.compare_and_set(&set5, &v, cas).unwrap());
        }
    };
    let racing = Racing::before_sets(&mem, 2, bump);
    let mut st = Stats::default();
    assert!(allowed(
        &check_and_consume(&racing, &p, &both, T0, 0.0, &mut st).unwrap()
    ));
    assert_eq!(st.cas_retries, 1);
    // Two admissions in all: rule a has 8 left, rule b 1.
    let only_a = [bucket(0, 1, 0)];
    let d = check_and_consume(&mem, &p, &only_a, T0, 0.0, &mut st).unwrap();
    let Decision::Allowed(r) = d else { panic!() };
    assert_eq!(r[0].check.remaining, 7);
}

#[test]
fn corrupt_sets_are_reset_not_fatal() {
    let p = plan(r#"{"domain":"t","rules":[{"name":"r","limits":[{"requests":1,"per":"1h"}]}]}"#);
    let mem = MemoryStore::default();
    mem.compare_and_set(&p.set_key(3), b"\x09garbage", 0)
        .unwrap();
    let mut st = Stats::default();
    assert!(allowed(
        &check_and_consume(&mem, &p, &[bucket(0, 5, 3)], T0, 0.0, &mut st).unwrap()
    ));
    assert_eq!(st.corrupt_sets, 1);
    assert!(!allowed(
        &check_and_consume(&mem, &p, &[bucket(0, 5, 3)], T0, 0.0, &mut st).unwrap()
    ));
}

#[test]
fn table_stays_bounded_and_a_drained_client_is_never_the_one_evicted() {
    let p = plan(
        r#"{"domain":"t","max_buckets":64,"rules":[{"name":"r","key":["client"],"limits":[{"requests":5,"per":"1h"}]}]}"#,
    );
    let mem = MemoryStore::default();
    let mut st = Stats::default();
    let hot = [bucket(0, u64::MAX, 0)];
    let mut hot_admitted = 0;
    for _ in 0..6 {
        if allowed(&check_and_consume(&mem, &p, &hot, T0, 0.0, &mut st).unwrap()) {
            hot_admitted += 1;
        }
    }
    for i in 0..20_000u64 {
        if i % 100 == 0
            && allowed(&check_and_consume(&mem, &p, &hot, T0 + i, 0.0, &mut st).unwrap())
        {
            hot_admitted += 1;
        }
        let b = [bucket(0, i, i % p.table.sets)];
        assert!(allowed(
            &check_and_consume(&mem, &p, &b, T0 + i, 0.0, &mut st).unwrap()
        ));
    }
    assert_eq!(
        mem.len() as u64,
        p.table.sets,
        "one key per set, whatever the number of clients"
    );
    // Sets evict the bucket nearest to full: the hot client, drained for an
    // hour, outlives the thousands of one-request clients that share its set.
    assert_eq!(hot_admitted, 5);
    assert!(st.evictions > 19_000, "{st:?}");
}

const GRADUATED_AND_PLAIN: &str = r#"{"domain":"t","max_buckets":64,"rules":[
    {"name":"a","limits":[{"requests":10,"per":"1h"}],
     "graduated":{"block_at":3.0,"block_for":"5m"}},
    {"name":"b","limits":[{"requests":1,"per":"1h"}]}]}"#;

/// The stored TATs of bucket `fp` in set `set`.
fn stored_tats(mem: &MemoryStore, p: &Plan, set: u64, fp: u64) -> Vec<u128> {
    let (bytes, _) = mem.get(&p.set_key(set)).unwrap().unwrap();
    let s = Set::from_bytes(bytes).unwrap();
    s.entries()
        .into_iter()
        .find(|e| e.fingerprint == fp)
        .map(|e| e.tats)
        .unwrap()
}

#[test]
fn a_denial_stores_graduated_demand_and_no_charge() {
    let p = plan(GRADUATED_AND_PLAIN);
    let mem = MemoryStore::default();
    let mut st = Stats::default();
    let both = [bucket(0, 1, 0), bucket(1, 2, 5)];
    let hour = u128::from(3600 * SEC);
    let now = u128::from(T0) * 10;
    assert!(allowed(
        &check_and_consume(&mem, &p, &both, T0, 0.0, &mut st).unwrap()
    ));
    // Rule b denies; rule a passed its own check, but only its demand is stored.
    assert!(!allowed(
        &check_and_consume(&mem, &p, &both, T0, 0.0, &mut st).unwrap()
    ));
    assert_eq!(stored_tats(&mem, &p, 0, 1), [now + hour, now + 2 * hour, 0]);
    let d = check_and_consume(&mem, &p, &both[..1], T0, 0.0, &mut st).unwrap();
    let Decision::Allowed(r) = d else {
        panic!("denied")
    };
    assert_eq!(
        r[0].check.remaining, 8,
        "a was charged twice in three requests"
    );
    assert_eq!(st, Stats::default());
}

#[test]
fn a_denial_gone_when_the_sets_are_read_again_is_charged() {
    let p = plan(GRADUATED_AND_PLAIN);
    let mem = MemoryStore::default();
    let both = [bucket(0, 1, 0), bucket(1, 2, 5)];
    check_and_consume(&mem, &p, &both, T0, 0.0, &mut Stats::default()).unwrap();
    // Between the denying pass and the pass that writes only demand, rule b's
    // set is emptied (as by another worker's eviction): that pass admits, so
    // the request goes round again and is charged in full.
    let set5 = p.set_key(5);
    let emptied = |m: &MemoryStore| {
        let (_, cas) = m.get(&set5).unwrap().unwrap();
        assert!(m
            .compare_and_set(&set5, Set::default().bytes(), cas)
            .unwrap());
    };
    let store = Racing::before_read(&mem, 4, emptied);
    let mut st = Stats::default();
    assert!(allowed(
        &check_and_consume(&store, &p, &both, T0, 0.0, &mut st).unwrap()
    ));
    assert_eq!(st.cas_retries, 1);
    assert_eq!(store.reads.get(), 6, "three passes of two sets");
    let hour = u128::from(3600 * SEC);
    let now = u128::from(T0) * 10;
    assert_eq!(
        stored_tats(&mem, &p, 0, 1),
        [now + 2 * hour, now + 2 * hour, 0]
    );
    assert_eq!(stored_tats(&mem, &p, 5, 2), [u128::from(T0) + hour]);
}
