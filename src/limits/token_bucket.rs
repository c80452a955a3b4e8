//! Token-bucket arithmetic, stated as a GCRA (generic cell rate algorithm).
//!
//! A bucket is one number: its theoretical arrival time (TAT). Time is kept in
//! *scaled* units of `1 / capacity` nanoseconds so that the emission interval
//! `period / capacity` is an exact integer and no rounding can ever admit more
//! than the limit.

/// One limit: `capacity` requests per `period_ns`, refilled continuously.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    /// The limit: requests per period, and the bucket size.
    pub capacity: u64,
    /// Time to refill `capacity` tokens, in nanoseconds.
    pub period_ns: u64,
    /// The most that can be spent at once; above `capacity` only for a
    /// graduated rule, whose requests past 100% are delayed, not denied.
    /// Remaining counts only up to `capacity`.
    pub burst: u64,
    /// Tokens a settlement from the response may leave the bucket owing
    /// (0 for a rule charged only up front). A bucket in debt denies until
    /// the debt and the next request's cost have refilled.
    pub debt: u64,
}

/// What one check of one bucket found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    /// Whether `cost` tokens were available.
    pub allowed: bool,
    /// The TAT to store if the request goes ahead (equal to the old one when denied).
    pub new_state: u128,
    /// Whole tokens left after this request (before it, when denied).
    pub remaining: u64,
    /// Nanoseconds until the bucket is full again.
    pub reset_ns: u64,
    /// Nanoseconds until `cost` tokens are available; 0 when allowed.
    pub retry_after_ns: u64,
}

impl Limit {
    /// `capacity` per `period_ns`, with a burst of `capacity`.
    pub fn new(capacity: u64, period_ns: u64) -> Limit {
        Limit {
            capacity,
            period_ns,
            burst: capacity,
            debt: 0,
        }
    }

    /// The current time in scaled units.
    pub fn scaled(&self, now_ns: u64) -> u128 {
        mul_wide(now_ns, self.capacity)
    }

    /// Scaled time one token takes to refill.
    fn interval(&self) -> u128 {
        u128::from(self.period_ns)
    }

    /// Scaled length of a full bucket.
    fn tolerance(&self) -> u128 {
        mul_wide(self.period_ns, self.burst.max(self.capacity))
    }

    /// Share of the limit in use for a bucket at `state`, counted in whole
    /// tokens (a token partly refilled still counts as used), so that a stage
    /// set on a whole request count, such as 80% of 5, is reached by the 4th
    /// request however much has trickled back since the first.
    pub fn used_share(&self, state: u128, now_ns: u64) -> f64 {
        let used = state.saturating_sub(self.scaled(now_ns));
        let tokens = div_ceil(used, self.interval().max(1));
        tokens as f64 / self.capacity.max(1) as f64
    }

    /// Scaled time that spending `cost` tokens adds to the TAT.
    pub fn increment(&self, cost: u64) -> u128 {
        mul_wide(self.period_ns, cost)
    }

    /// Checks whether `cost` tokens are available at `now_ns` in a bucket whose
    /// TAT is `tat` (`None` for a bucket never used, which is full).
    pub fn check(&self, tat: Option<u128>, now_ns: u64, cost: u64) -> Check {
        let now = self.scaled(now_ns);
        let tolerance = self.tolerance();
        // A TAT more than a full bucket and the debt bound ahead only comes
        // from a clock that stepped back: it reads as an empty bucket in the
        // most debt it may hold, never as emptier than that.
        let tat = tat.map_or(now, |t| t.clamp(now, self.ceiling(now)));
        let used = tat - now;
        let need = used + self.increment(cost);
        if need <= tolerance {
            Check {
                allowed: true,
                new_state: now + need,
                remaining: self.tokens_left(need),
                reset_ns: self.unscale_ceil(need),
                retry_after_ns: 0,
            }
        } else {
            // A cost above the bucket can never pass; report a full period.
            let retry = if cost > self.burst.max(self.capacity) {
                u128::from(self.period_ns)
            } else {
                self.unscale_ceil_u128(need - tolerance)
            };
            Check {
                allowed: false,
                new_state: tat,
                remaining: self.tokens_left(used),
                reset_ns: self.unscale_ceil(used),
                retry_after_ns: u64::try_from(retry).unwrap_or(u64::MAX),
            }
        }
    }

    /// The furthest a TAT may lie ahead of `now` (scaled): a full bucket's
    /// worth, plus the debt a settlement may leave.
    fn ceiling(&self, now: u128) -> u128 {
        now.saturating_add(self.tolerance())
            .saturating_add(self.increment(self.debt))
    }

    /// The TAT after `cost` more tokens are spent whatever the bucket holds
    /// (a settlement of a response that cost more than was reserved): the
    /// bucket may go into debt, up to [`Limit::debt`] tokens.
    pub fn force(&self, tat: Option<u128>, now_ns: u64, cost: u64) -> u128 {
        let now = self.scaled(now_ns);
        let ceiling = self.ceiling(now);
        let from = tat.map_or(now, |t| t.clamp(now, ceiling));
        from.saturating_add(self.increment(cost)).min(ceiling)
    }

    /// Nanoseconds (rounded up) at which a bucket with this TAT is full again.
    pub fn full_at_ns(&self, tat: u128) -> u64 {
        self.unscale_ceil(tat)
    }

    /// Whole tokens left in a bucket of which `used` (scaled, at most the
    /// tolerance) is spent, counted up to `capacity`. The free part is
    /// `tolerance − used`, a multiple of the interval minus `used`, so its
    /// whole intervals are `burst − ⌈used / interval⌉`: a division of the
    /// small spent part, where dividing the free part (over 2^64 for a
    /// limit of 10⁹ per minute) took the slow 128-bit path.
    fn tokens_left(&self, used: u128) -> u64 {
        let all = if self.period_ns == 0 {
            // No interval to divide by: a zero tolerance, nothing free.
            0
        } else {
            let spent = u64::try_from(div_ceil(used, self.interval())).unwrap_or(u64::MAX);
            self.burst.max(self.capacity).saturating_sub(spent)
        };
        all.saturating_sub(self.burst.saturating_sub(self.capacity))
    }

    fn unscale_ceil_u128(&self, scaled: u128) -> u128 {
        div_ceil(scaled, u128::from(self.capacity.max(1)))
    }

    fn unscale_ceil(&self, scaled: u128) -> u64 {
        u64::try_from(self.unscale_ceil_u128(scaled)).unwrap_or(u64::MAX)
    }
}

/// `a × b`, exactly, from four 32-bit products: wasm has no 64 × 64 → 128
/// multiply, and the runtime's `__multi3` (a full 128 × 128 one) is a call
/// of several dozen instructions, three per check of a limit. Two factors
/// below 2^32 (a period under 4.3 s and a cost or capacity) take one u64
/// multiply.
fn mul_wide(a: u64, b: u64) -> u128 {
    const LOW: u64 = 0xffff_ffff;
    if (a | b) <= LOW {
        return u128::from(a * b);
    }
    let (a1, a0) = (a >> 32, a & LOW);
    let (b1, b0) = (b >> 32, b & LOW);
    let (p00, p01, p10, p11) = (a0 * b0, a0 * b1, a1 * b0, a1 * b1);
    // Each term is below 2^32, so the sum cannot overflow.
    let mid = (p00 >> 32) + (p01 & LOW) + (p10 & LOW);
    let lo = (p00 & LOW) | (mid << 32);
    let hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
    (u128::from(hi) << 64) | u128::from(lo)
}

/// `n / d` and `n % d` for `d` ≥ 1. Wasm has no 128-bit division (the
/// runtime's `__udivti3` is hundreds of instructions, several per check):
/// operands that fit in u64 divide as u64, and a divisor below 2^32 divides
/// a wider `n` in 32-bit steps of u64 division, exactly.
fn div_rem(n: u128, d: u128) -> (u128, u128) {
    let Ok(d64) = u64::try_from(d) else {
        return (n / d, n % d);
    };
    if let Ok(n64) = u64::try_from(n) {
        return (u128::from(n64 / d64), u128::from(n64 % d64));
    }
    if d64 > u64::from(u32::MAX) {
        // A period of over 4.3 s: the high word first, then the remainder
        // with the low word in 32-bit digits.
        let (hi, lo) = ((n >> 64) as u64, n as u64);
        let (q1, r) = (hi / d64, hi % d64);
        let (q0, r) = div_wide(r, lo, d64);
        return ((u128::from(q1) << 64) | u128::from(q0), u128::from(r));
    }
    let (hi, lo) = ((n >> 64) as u64, n as u64);
    let (q2, r) = (hi / d64, hi % d64);
    // r < d < 2^32: each step's dividend fits in u64 and its quotient in 32 bits.
    let x = (r << 32) | (lo >> 32);
    let (q1, r) = (x / d64, x % d64);
    let y = (r << 32) | (lo & 0xffff_ffff);
    let (q0, r) = (y / d64, y % d64);
    let q = (u128::from(q2) << 64) | (u128::from(q1) << 32) | u128::from(q0);
    (q, u128::from(r))
}

/// `(u1 · 2^64 + u0) / v` and its remainder, for `u1 < v` and `v ≥ 2^32`
/// (so that the quotient fits in u64): Knuth's algorithm D in two 32-bit
/// digits, as Hacker's Delight writes it (`divlu`), in u64 operations only.
fn div_wide(u1: u64, u0: u64, v: u64) -> (u64, u64) {
    const B: u64 = 1 << 32;
    // Normalised so that the divisor's top bit is set; v ≥ 2^32 keeps s < 32.
    let s = v.leading_zeros();
    let v = v << s;
    let (vn1, vn0) = (v >> 32, v & (B - 1));
    let un32 = if s == 0 {
        u1
    } else {
        (u1 << s) | (u0 >> (64 - s))
    };
    let un10 = u0 << s;
    let (un1, un0) = (un10 >> 32, un10 & (B - 1));
    // Each digit's estimate is at most 2 too high; the loops correct it.
    // `rhat < B` wherever `rhat << 32` is taken, and `q < B` wherever `q * vn0` is.
    let mut q1 = un32 / vn1;
    let mut rhat = un32 - q1 * vn1;
    while q1 >= B || q1 * vn0 > (rhat << 32) + un1 {
        q1 -= 1;
        rhat += vn1;
        if rhat >= B {
            break;
        }
    }
    // Exact modulo 2^64: the true value is below v.
    let un21 = (un32 << 32)
        .wrapping_add(un1)
        .wrapping_sub(q1.wrapping_mul(v));
    let mut q0 = un21 / vn1;
    let mut rhat = un21 - q0 * vn1;
    while q0 >= B || q0 * vn0 > (rhat << 32) + un0 {
        q0 -= 1;
        rhat += vn1;
        if rhat >= B {
            break;
        }
    }
    let r = (un21 << 32)
        .wrapping_add(un0)
        .wrapping_sub(q0.wrapping_mul(v))
        >> s;
    ((q1 << 32) + q0, r)
}

/// `n / d` rounded up, for `d` ≥ 1 (see [`div_rem`]). Inlined for the
/// common operands that fit in u64: a call returning u128 goes through
/// memory, and cost more than the division.
#[inline(always)]
fn div_ceil(n: u128, d: u128) -> u128 {
    match (u64::try_from(n), u64::try_from(d)) {
        (Ok(n), Ok(d)) if d > 0 => u128::from(n.div_ceil(d)),
        _ => div_ceil_wide(n, d),
    }
}

#[inline(never)]
fn div_ceil_wide(n: u128, d: u128) -> u128 {
    let (q, r) = div_rem(n, d);
    q + u128::from(r > 0)
}

/// Rounds nanoseconds up to whole seconds.
pub fn ceil_secs(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    fn lim(capacity: u64, secs: u64) -> Limit {
        Limit::new(capacity, secs * SEC)
    }

    #[test]
    fn a_burst_above_capacity_admits_more_but_reports_remaining_up_to_capacity() {
        let l = Limit {
            burst: 12,
            ..lim(10, 60)
        };
        let mut tat = None;
        let mut remaining = Vec::new();
        for _ in 0..13 {
            let c = l.check(tat, SEC, 1);
            if c.allowed {
                tat = Some(c.new_state);
                remaining.push(c.remaining);
            }
        }
        assert_eq!(remaining, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0, 0]);
        let share = l.used_share(tat.unwrap(), SEC);
        assert!((share - 1.2).abs() < 1e-9, "{share}");
    }

    #[test]
    fn a_forced_charge_leaves_a_debt_that_denies_until_it_has_refilled() {
        // 1,000 per minute: a token every 60 ms.
        let l = Limit {
            debt: 5000,
            ..lim(1000, 60)
        };
        let c = l.check(None, SEC, 900);
        assert!(c.allowed);
        let tat = l.force(Some(c.new_state), SEC, 200);
        // 100 in debt: a request of 100 waits for 200 tokens.
        let denied = l.check(Some(tat), SEC, 100);
        assert!(!denied.allowed);
        assert_eq!(denied.remaining, 0);
        assert_eq!(denied.retry_after_ns, 200 * 60_000_000);
        assert!(!l.check(Some(tat), SEC + 12 * SEC - 1, 100).allowed);
        let ok = l.check(Some(tat), SEC + 12 * SEC, 100);
        assert!(ok.allowed);
        assert_eq!(ok.remaining, 0);
        // The debt is bounded: a full bucket and `debt` tokens at most.
        let deep = l.force(Some(tat), SEC, 1_000_000);
        assert_eq!(deep, l.scaled(SEC) + l.increment(1000 + 5000));
        // Without a debt bound a forced charge only empties the bucket.
        let plain = lim(1000, 60);
        assert_eq!(
            plain.force(None, SEC, 5000),
            plain.scaled(SEC) + plain.increment(1000)
        );
    }

    /// Runs a sequence, storing the TAT on admission, and returns the admitted cost.
    fn run(limit: Limit, calls: &[(u64, u64)]) -> u64 {
        let mut tat = None;
        let mut admitted = 0;
        for &(now, cost) in calls {
            let c = limit.check(tat, now, cost);
            if c.allowed {
                tat = Some(c.new_state);
                admitted += cost;
            }
        }
        admitted
    }

    #[test]
    fn a_tat_beyond_a_full_bucket_reads_as_empty_after_a_clock_step_back() {
        let l = lim(10, 60);
        let now = 10_000 * SEC;
        let mut tat = None;
        for _ in 0..4 {
            tat = Some(l.check(tat, now, 1).new_state);
        }
        // The clock steps back an hour: empty (one token in 6 s), not an hour emptier.
        let c = l.check(tat, now - 3600 * SEC, 1);
        assert!(!c.allowed);
        assert_eq!(c.retry_after_ns, 6 * SEC);
        assert_eq!(c.reset_ns, 60 * SEC);
        assert_eq!(c.new_state, l.scaled(now - 3600 * SEC) + l.increment(10));
    }

    #[test]
    fn a_fresh_bucket_admits_exactly_its_capacity_at_once() {
        let l = lim(3, 1);
        let calls: Vec<_> = (0..10).map(|_| (100 * SEC, 1)).collect();
        assert_eq!(run(l, &calls), 3);
    }

    #[test]
    fn remaining_counts_down_and_reset_is_time_to_full() {
        let l = lim(10, 60);
        let now = 1_000 * SEC;
        let mut tat = None;
        for expected in (0..10).rev() {
            let c = l.check(tat, now, 1);
            assert!(c.allowed);
            assert_eq!(c.remaining, expected);
            tat = Some(c.new_state);
        }
        let denied = l.check(tat, now, 1);
        assert!(!denied.allowed);
        assert_eq!(denied.remaining, 0);
        assert_eq!(denied.reset_ns, 60 * SEC);
        assert_eq!(denied.retry_after_ns, 6 * SEC);
    }

    #[test]
    fn refills_one_token_per_interval() {
        let l = lim(2, 1);
        let t0 = 50 * SEC;
        let a = l.check(None, t0, 2);
        assert!(a.allowed);
        let b = l.check(Some(a.new_state), t0 + SEC / 2 - 1, 1);
        assert!(!b.allowed);
        assert_eq!(b.retry_after_ns, 1);
        let c = l.check(Some(a.new_state), t0 + SEC / 2, 1);
        assert!(c.allowed);
        assert_eq!(c.remaining, 0);
    }

    #[test]
    fn weighted_costs_spend_several_tokens() {
        let l = lim(10, 3600);
        let a = l.check(None, SEC, 5);
        assert_eq!((a.allowed, a.remaining), (true, 5));
        let b = l.check(Some(a.new_state), SEC, 5);
        assert_eq!((b.allowed, b.remaining), (true, 0));
        let c = l.check(Some(b.new_state), SEC, 5);
        assert!(!c.allowed);
        assert_eq!(c.retry_after_ns, 1800 * SEC);
    }

    #[test]
    fn a_cost_above_capacity_is_denied_with_a_full_period() {
        let l = lim(3, 10);
        let c = l.check(None, SEC, 4);
        assert!(!c.allowed);
        assert_eq!(c.retry_after_ns, 10 * SEC);
        assert_eq!(c.remaining, 3);
    }

    #[test]
    fn odd_capacities_do_not_round_away_a_token() {
        // 1 s / 3 is not a whole number of nanoseconds; the scaled units keep it exact.
        let l = lim(3, 1);
        let calls: Vec<_> = (0..3).map(|_| (SEC, 1)).collect();
        assert_eq!(run(l, &calls), 3);
    }

    #[test]
    fn a_clock_going_backwards_admits_nothing_extra() {
        let l = lim(2, 10);
        let a = l.check(None, 100 * SEC, 2);
        let b = l.check(Some(a.new_state), 90 * SEC, 1);
        assert!(!b.allowed);
    }

    proptest! {
        /// `mul_wide` is u128 multiplication.
        #[test]
        fn mul_wide_is_u128_multiplication(
            a in any::<u64>(),
            b in any::<u64>(),
            small in (0..=u64::from(u32::MAX), 0..=u64::from(u32::MAX)),
        ) {
            prop_assert_eq!(mul_wide(a, b), u128::from(a) * u128::from(b));
            prop_assert_eq!(mul_wide(u64::MAX, b), u128::from(u64::MAX) * u128::from(b));
            // Both below 2^32: the one-multiply path.
            let (x, y) = small;
            prop_assert_eq!(mul_wide(x, y), u128::from(x) * u128::from(y));
            prop_assert_eq!(mul_wide(x, a), u128::from(x) * u128::from(a));
        }

        /// What the limiter stores as a token bucket's full-at time, `now +
        /// reset_ns`, is `full_at_ns` of the state the check returns.
        #[test]
        fn full_at_is_now_plus_reset(
            capacity in prop_oneof![1u64..1000, 1u64..=1_000_000_000, 1u64..1 << 40],
            period_ns in prop_oneof![1u64..1_000_000_000_000, 1u64..],
            extra in 0u64..3,
            now in prop_oneof![any::<u64>(), 0u64..1 << 62],
            tat in proptest::option::of(any::<u128>()),
            cost in prop_oneof![0u64..10, 0u64..=1_000_000],
        ) {
            let l = Limit { capacity, period_ns, burst: capacity.saturating_mul(extra.max(1)), debt: 0 };
            let c = l.check(tat, now, cost);
            prop_assert_eq!(l.full_at_ns(c.new_state), now.saturating_add(c.reset_ns));
        }

        /// `remaining` is the whole intervals in the free part of the bucket,
        /// `(tolerance − used) / interval`, less the burst above capacity
        /// (capacities and costs as far as the configuration allows, and beyond).
        #[test]
        fn remaining_is_the_free_part_in_whole_tokens(
            capacity in prop_oneof![0u64..1000, 1u64..=1_000_000_000, 1u64..1 << 40],
            period_ns in prop_oneof![0u64..3, 1u64..1_000_000_000_000, any::<u64>()],
            extra in 0u64..3,
            now in prop_oneof![any::<u64>(), 0u64..1 << 62],
            tat in proptest::option::of(any::<u128>()),
            cost in prop_oneof![0u64..10, 0u64..=1_000_000],
        ) {
            let l = Limit { capacity, period_ns, burst: capacity.saturating_mul(extra.max(1)), debt: 0 };
            let c = l.check(tat, now, cost);
            let now_s = l.scaled(now);
            let tolerance = l.tolerance();
            let used = tat.map_or(now_s, |t| t.clamp(now_s, now_s.saturating_add(tolerance))) - now_s;
            let used = if c.allowed { used + l.increment(cost) } else { used };
            let whole = (tolerance - used) / u128::from(period_ns.max(1));
            let expected = u64::try_from(whole).unwrap_or(u64::MAX).saturating_sub(l.burst.saturating_sub(capacity));
            prop_assert_eq!(c.remaining, expected);
        }

        /// The u64 paths of `div_rem` are u128 division, whatever the operands.
        #[test]
        fn div_rem_is_u128_division(
            n in prop_oneof![any::<u128>(), any::<u64>().prop_map(u128::from), (any::<u64>(), 0u64..4).prop_map(|(a, b)| (u128::from(b) << 64) | u128::from(a))],
            d in prop_oneof![1u128..4, any::<u32>().prop_map(|d| u128::from(d.max(1))), any::<u64>().prop_map(|d| u128::from(d.max(1))), 1u128.., (1u128 << 32)..(1u128 << 33), (0u128..4).prop_map(|k| u128::from(u64::MAX) - k), (33u32..64).prop_map(|b| 1u128 << b)],
        ) {
            prop_assert_eq!(div_rem(n, d), (n / d, n % d));
            prop_assert_eq!(div_ceil(n, d), n.div_ceil(d));
        }

        #[test]
        fn never_admits_more_than_capacity_plus_refill(
            capacity in 1u64..1000,
            period_s in 1u64..120,
            steps in proptest::collection::vec((0u64..3 * SEC, 1u64..20), 1..300),
        ) {
            let l = lim(capacity, period_s);
            let start = 1_000_000 * SEC;
            let mut now = start;
            let mut tat = None;
            let mut admitted: u128 = 0;
            for (dt, cost) in steps {
                now += dt;
                let c = l.check(tat, now, cost);
                prop_assert!(c.remaining <= capacity);
                if c.allowed {
                    tat = Some(c.new_state);
                    admitted += u128::from(cost);
                }
                // admitted <= capacity + rate * elapsed, in exact integer form.
                let elapsed = u128::from(now - start);
                let bound = u128::from(capacity) * u128::from(l.period_ns) + u128::from(capacity) * elapsed;
                prop_assert!(admitted * u128::from(l.period_ns) <= bound);
            }
        }

        #[test]
        fn denied_requests_pass_exactly_when_retry_after_has_elapsed(
            capacity in 1u64..100,
            period_s in 1u64..60,
            cost in 1u64..100,
        ) {
            prop_assume!(cost <= capacity);
            let l = lim(capacity, period_s);
            let t0 = 10_000 * SEC;
            let full = l.check(None, t0, capacity);
            prop_assert!(full.allowed);
            prop_assert_eq!(full.remaining, 0);
            let denied = l.check(Some(full.new_state), t0, cost);
            prop_assert!(!denied.allowed);
            let later = l.check(Some(full.new_state), t0 + denied.retry_after_ns, cost);
            prop_assert!(later.allowed);
            if denied.retry_after_ns > 0 {
                let early = l.check(Some(full.new_state), t0 + denied.retry_after_ns - 1, cost);
                prop_assert!(!early.allowed);
            }
        }
    }
}
