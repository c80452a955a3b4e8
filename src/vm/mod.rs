//! What the host layer keeps per VM (one per worker), as pure code tested on
//! the host: the log gate that keeps a flood of one kind of line out of
//! Envoy's log, the per-worker jitter source, the two values every worker of
//! a proxy must agree on through shared data (the hash seed and the clock's
//! epoch offset), and the root context's timers (`timers`).

pub mod timers;

use crate::limits::store::SharedStore;
use crate::limits::update::{update, UpdateError};
use crate::policy::plan::Plan;
use std::cell::Cell;

/// Shared-data key of the hash seed, shared by every worker of the proxy.
pub const SEED_KEY: &str = "ratelimit-wasm/seed";
/// Shared-data key of the clock's epoch offset, shared by every worker of the proxy.
pub const CLOCK_KEY: &str = "ratelimit-wasm/clock";
/// Least time between two log lines of one kind from one worker: a flood of
/// bad input, gateway failures or shadow denials must not flood the log.
pub const LOG_EVERY_NS: u64 = 1_000_000_000;
/// Attempts at settling a shared value before `on_configure` gives up.
const SETTLE_ATTEMPTS: u32 = 4;

/// Lets one log line of a kind through per [`LOG_EVERY_NS`], counting the rest.
#[derive(Debug, Default)]
pub struct LogGate {
    last_ns: Cell<u64>,
    suppressed: Cell<u64>,
}

impl LogGate {
    /// `Some(lines suppressed since the last one)` when a line may be written now.
    pub fn open(&self, now: u64) -> Option<u64> {
        if self.last_ns.get() != 0 && now.saturating_sub(self.last_ns.get()) < LOG_EVERY_NS {
            self.suppressed.set(self.suppressed.get() + 1);
            return None;
        }
        self.last_ns.set(now);
        Some(self.suppressed.replace(0))
    }
}

/// The per-worker log gates.
#[derive(Debug, Default)]
pub struct LogGates {
    /// Odd input seen while building keys.
    pub bad_input: LogGate,
    /// Gateway failures.
    pub gateway: LogGate,
    /// Shadow denials.
    pub shadow: LogGate,
}

/// Per-worker random numbers for jitter: splitmix64 seeded once from the
/// host, so a request costs no `random_get` hostcall. Jitter only needs spread,
/// not secrecy.
#[derive(Debug, Default)]
pub struct Jitter(Cell<u64>);

impl Jitter {
    /// A source starting from `seed`.
    pub fn new(seed: u64) -> Jitter {
        Jitter(Cell::new(seed))
    }

    /// The next number; 0 without drawing when the plan has no use for it:
    /// no `retry_jitter` to spread waits by, and no charge to settle on the
    /// gateway, whose reservation id it is.
    pub fn next(&self, plan: &Plan) -> u64 {
        if plan.retry_jitter <= 0.0 && !plan.settling {
            return 0;
        }
        let state = self.0.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        self.0.set(state);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn settle_error(key: &str, e: UpdateError) -> String {
    match e {
        UpdateError::Store(e) => e.to_string(),
        UpdateError::Contention => format!("could not settle the shared key {key}"),
    }
}

/// The seed every worker hashes keys with: created once per proxy from
/// `random`, race-free (a creation never overwrites), and the stored one
/// read by every later worker, so all agree. A value that is not a seed (not
/// ours, or damaged) is replaced, with CAS so that all workers settle on one.
pub fn shared_seed(
    store: &impl SharedStore,
    mut random: impl FnMut() -> Result<[u8; 16], String>,
) -> Result<[u8; 16], String> {
    let seed = update(store, SEED_KEY, SETTLE_ATTEMPTS, |stored| {
        if let Some(seed) = stored.and_then(|b| <[u8; 16]>::try_from(b).ok()) {
            return (None, Ok(seed));
        }
        match random() {
            Ok(seed) => (Some(seed.to_vec()), Ok(seed)),
            Err(e) => (None, Err(e)),
        }
    });
    seed.map_err(|e| settle_error(SEED_KEY, e))?
}

/// The shared offset of the monotonic clock from the epoch: the stored one,
/// or `offset()` (the wall clock minus the monotonic clock, now) stored
/// race-free as the seed is. Every worker then reads the same epoch time.
pub fn shared_epoch_offset(
    store: &impl SharedStore,
    mut offset: impl FnMut() -> u64,
) -> Result<u64, String> {
    let settled = update(store, CLOCK_KEY, SETTLE_ATTEMPTS, |stored| {
        if let Some(o) = stored.and_then(|b| <[u8; 8]>::try_from(b).ok()) {
            return (None, u64::from_le_bytes(o));
        }
        let o = offset();
        (Some(o.to_le_bytes().to_vec()), o)
    });
    settled.map_err(|e| settle_error(CLOCK_KEY, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::limits::store::{MemoryStore, StoreError};

    #[test]
    fn the_shared_keys_are_in_the_filters_namespace() {
        use crate::limits::store::KEY_PREFIX;
        assert!(SEED_KEY.starts_with(KEY_PREFIX) && CLOCK_KEY.starts_with(KEY_PREFIX));
    }

    #[test]
    fn the_log_gate_lets_one_line_a_second_through_and_counts_the_rest() {
        let g = LogGate::default();
        assert_eq!(g.open(5), Some(0));
        assert_eq!(g.open(5 + LOG_EVERY_NS - 1), None);
        assert_eq!(g.open(6), None);
        assert_eq!(g.open(5 + LOG_EVERY_NS), Some(2));
        assert_eq!(g.open(5 + LOG_EVERY_NS + 1), None);
        assert_eq!(g.open(5 + 3 * LOG_EVERY_NS), Some(1));
    }

    fn plan(jitter: f64) -> Plan {
        let json = format!(
            r#"{{"domain":"d","response":{{"retry_jitter":{jitter}}},"rules":[{{"name":"r","key":["client"],"limits":[{{"requests":1,"per":"1s"}}]}}]}}"#
        );
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [0; 16])
    }

    #[test]
    fn jitter_is_splitmix64_and_draws_nothing_without_spread() {
        let j = Jitter::new(0);
        assert_eq!(j.next(&plan(0.0)), 0);
        // splitmix64's first outputs from state 0 (Vigna's reference values).
        let p = plan(0.1);
        assert_eq!(j.next(&p), 0xe220_a839_7b1d_cdaf);
        assert_eq!(j.next(&p), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(j.next(&p), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn workers_agree_on_the_first_seed_and_a_damaged_one_is_replaced() {
        let store = MemoryStore::default();
        let first = shared_seed(&store, || Ok([1; 16])).unwrap();
        let second = shared_seed(&store, || Ok([2; 16])).unwrap();
        assert_eq!((first, second), ([1; 16], [1; 16]));
        store.compare_and_set(SEED_KEY, b"short", 0).unwrap();
        assert_eq!(shared_seed(&store, || Ok([3; 16])).unwrap(), [3; 16]);
        assert_eq!(shared_seed(&store, || Ok([4; 16])).unwrap(), [3; 16]);
        let none = MemoryStore::default();
        assert_eq!(
            shared_seed(&none, || Err("no randomness".into())),
            Err("no randomness".to_string())
        );
        assert!(none.is_empty());
    }

    #[test]
    fn the_epoch_offset_is_stored_once_and_read_by_every_worker() {
        let store = MemoryStore::default();
        assert_eq!(shared_epoch_offset(&store, || 42).unwrap(), 42);
        let mut asked = 0;
        let again = shared_epoch_offset(&store, || {
            asked += 1;
            7
        });
        assert_eq!((again.unwrap(), asked), (42, 0));
    }

    struct Failing;

    impl SharedStore for Failing {
        fn get(&self, _: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            Err(StoreError(3))
        }
        fn compare_and_set(&self, _: &str, _: &[u8], _: u32) -> Result<bool, StoreError> {
            Err(StoreError(3))
        }
    }

    #[test]
    fn a_failing_store_is_an_error_naming_its_status() {
        assert_eq!(
            shared_seed(&Failing, || Ok([1; 16])),
            Err("shared data call failed with status 3".to_string())
        );
        assert_eq!(
            shared_epoch_offset(&Failing, || 1),
            Err("shared data call failed with status 3".to_string())
        );
    }
}
