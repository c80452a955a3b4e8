//! A decision's metric increments. Kept small on purpose: the counts travel
//! inside every [`super::Outcome`]. As `u64`s (208 bytes in wasm32) they cost
//! an allowed c1 decision 380 more wasm instructions than as `u32`s
//! (issue 14, BENCHMARKS.md).

use crate::metrics::Metric;

const N: usize = Metric::ALL.len();

// One bit of `counted` per metric.
const _: () = assert!(N <= 32);

/// The largest sum the shared-data counters can reach in one decision: a set
/// reread as corrupt on every attempt of the charge and of the fallback
/// charge after a failed callout, each of at most `MAX_RULES` buckets. The
/// gateway's clamped figures are at most three per limit and per quota of
/// the request: reaching `u32::MAX` would take over a billion quotas.
pub const LARGEST_SUM: u64 =
    2 * crate::limits::limiter::MAX_ATTEMPTS as u64 * crate::config::MAX_RULES as u64;
const _: () = assert!(LARGEST_SUM <= u32::MAX as u64);

/// Increments per [`Metric`], indexed by [`Metric::index`], with a mask of
/// the metrics counted: a decision counts two or three of them, and the host
/// reports only those. A `u32` holds every sum a decision can make (see
/// [`LARGEST_SUM`]); past `u32::MAX` a sum would saturate, never wrap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    values: [u32; N],
    counted: u32,
}

impl Counts {
    /// Adds `n` to `m`.
    pub fn add(&mut self, m: Metric, n: u64) {
        let i = m.index();
        let Some(v) = self.values.get_mut(i) else {
            return;
        };
        if n == 0 {
            return;
        }
        self.counted |= 1 << i;
        *v = v.saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
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

    /// The largest sum a decision can make is kept exactly.
    #[test]
    fn the_largest_sum_is_exact() {
        let mut c = Counts::default();
        for _ in 0..LARGEST_SUM / 32 {
            c.add(Metric::CorruptState, 32);
        }
        assert_eq!(c.get(Metric::CorruptState), LARGEST_SUM);
        c.add(Metric::CorruptState, u64::MAX);
        assert_eq!(c.get(Metric::CorruptState), u64::from(u32::MAX));
    }

    proptest! {
        /// Any sequence of increments counts as plain `u64` sums would.
        #[test]
        fn counts_match_u64_sums(adds in proptest::collection::vec((0..N, 0u64..200_000), 0..40)) {
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
