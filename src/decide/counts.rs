//! A decision's metric increments. Kept small on purpose: the counts travel
//! inside every [`super::Outcome`]. As `u64`s (208 bytes in wasm32) they cost
//! an allowed c1 decision 700 more wasm instructions than as `u16`s, and as
//! `u32`s 312 more (BENCHMARKS.md, instructions per decision).

use crate::config::{MAX_GLOBAL_RULES, MAX_LIMITS_PER_RULE, MAX_QUOTAS, MAX_RULES};
use crate::limits::limiter::MAX_ATTEMPTS;
use crate::metrics::Metric;

const N: usize = Metric::ALL.len();

// One bit of `counted` per metric.
const _: () = assert!(N <= 32);

/// The largest sum of a shared-data counter in one decision. Each rule of
/// the configuration gives a request at most one bucket (local, shadow, or
/// a global rule's fallback), each attempt of a charge reads a bucket's set
/// once, and a charge makes at most `MAX_ATTEMPTS` attempts: a set read as
/// corrupt on every attempt, for every bucket, counts 32 × 1,024. Retries
/// (at most 32 per charge, four charges) and evictions (one per bucket) stay
/// below it.
pub const LARGEST_STORE_SUM: u64 = MAX_ATTEMPTS as u64 * MAX_RULES as u64;

/// The most figures one gateway answer can have clamped: three per limit of
/// each global rule (a bucket's answer holds at most 8 limits, as a rule
/// does) and three per quota.
pub const LARGEST_CLAMPED: u64 =
    3 * (MAX_LIMITS_PER_RULE as u64 * MAX_GLOBAL_RULES as u64 + MAX_QUOTAS as u64);

// Every sum a decision can make fits a `u16`.
const _: () = assert!(LARGEST_STORE_SUM <= u16::MAX as u64);
const _: () = assert!(LARGEST_CLAMPED <= u16::MAX as u64);

/// Increments per [`Metric`], indexed by [`Metric::index`], with a mask of
/// the metrics counted: a decision counts two or three of them, and the host
/// reports only those. A `u16` holds every sum a decision can make (see
/// [`LARGEST_STORE_SUM`] and [`LARGEST_CLAMPED`]); past `u16::MAX` a sum
/// would saturate, never wrap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    values: [u16; N],
    counted: u32,
}

impl Counts {
    /// Adds `n` to `m`.
    pub(super) fn add(&mut self, m: Metric, n: u64) {
        let i = m.index();
        let Some(v) = self.values.get_mut(i) else {
            return;
        };
        if n == 0 {
            return;
        }
        self.counted |= 1 << i;
        *v = v.saturating_add(u16::try_from(n).unwrap_or(u16::MAX));
    }

    /// Adds every count of `other`.
    pub(super) fn merge(&mut self, other: &Counts) {
        for (i, n) in other.counted() {
            if let Some(m) = Metric::ALL.get(i) {
                self.add(*m, n);
            }
        }
    }

    /// The count of one metric.
    pub fn get(&self, m: Metric) -> u64 {
        self.at(m.index())
    }

    fn at(&self, i: usize) -> u64 {
        self.values.get(i).map_or(0, |v| u64::from(*v))
    }

    /// The metrics counted, as (index, count), in index order.
    pub fn counted(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        let mut left = self.counted;
        std::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            let i = left.trailing_zeros() as usize;
            left &= left - 1;
            Some((i, self.at(i)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The host reports exactly the metrics counted, each once, with its sum.
    #[test]
    fn counted_lists_each_counted_metric_once_in_index_order() {
        let mut c = Counts::default();
        c.add(Metric::Denied, 1);
        c.add(Metric::Allowed, 2);
        c.add(Metric::Allowed, 3);
        c.add(Metric::Errors, 0);
        let mut want = vec![(Metric::Allowed.index(), 5), (Metric::Denied.index(), 1)];
        want.sort();
        assert_eq!(c.counted().collect::<Vec<_>>(), want);
        assert_eq!(c.get(Metric::Errors), 0);
        assert_eq!(Counts::default().counted().count(), 0);
    }

    /// The largest sums a decision can make are kept exactly.
    #[test]
    fn the_largest_sums_are_exact() {
        let mut c = Counts::default();
        for _ in 0..MAX_RULES {
            c.add(Metric::CorruptState, MAX_ATTEMPTS.into());
        }
        c.add(Metric::GatewayClamped, LARGEST_CLAMPED);
        assert_eq!(c.get(Metric::CorruptState), 32_768);
        assert_eq!(c.get(Metric::GatewayClamped), 1_728);
        c.add(Metric::CorruptState, u64::MAX);
        assert_eq!(c.get(Metric::CorruptState), u64::from(u16::MAX));
    }

    proptest! {
        /// Any sequence of increments counts as plain `u64` sums would.
        #[test]
        fn counts_match_u64_sums(adds in proptest::collection::vec((0..N, 0u64..2_000), 0..30)) {
            let mut c = Counts::default();
            let mut model = [0u64; N];
            for (i, n) in &adds {
                c.add(Metric::ALL[*i], *n);
                model[*i] += n;
            }
            for (i, m) in Metric::ALL.iter().enumerate() {
                prop_assert_eq!(c.get(*m), model[i]);
            }
            let want: Vec<(usize, u64)> =
                model.iter().enumerate().filter(|(_, v)| **v > 0).map(|(i, v)| (i, *v)).collect();
            prop_assert_eq!(c.counted().collect::<Vec<_>>(), want);
        }
    }
}
