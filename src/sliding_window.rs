//! The sliding-window counter: strict-window semantics in O(1) memory.
//!
//! It keeps the current and the previous fixed window's counts and weighs the
//! previous one by how much of it still overlaps the sliding window:
//! `estimate = prev × (W − elapsed) / W + cur`. A request passes when
//! `estimate + cost ≤ N`. The estimate is exact when the previous window's
//! traffic was spread evenly; how far it can be off otherwise is in the README.
//!
//! State (one `u128`): window index in the high 64 bits, `cur` in the next 32,
//! `prev` in the low 32.

use crate::token_bucket::{Check, Limit};

fn unpack(state: u128) -> (u64, u64, u64) {
    (
        (state >> 64) as u64,
        ((state >> 32) as u32).into(),
        (state as u32).into(),
    )
}

fn pack(window: u64, cur: u64, prev: u64) -> u128 {
    let c = u32::try_from(cur).unwrap_or(u32::MAX);
    let p = u32::try_from(prev).unwrap_or(u32::MAX);
    (u128::from(window) << 64) | (u128::from(c) << 32) | u128::from(p)
}

/// Checks `cost` against `limit.capacity` requests per sliding `limit.period_ns`.
pub fn check(limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> Check {
    let w = limit.period_ns.max(1);
    let n = u128::from(limit.capacity);
    let k = now_ns / w;
    let elapsed = now_ns - k * w;
    let (cur, prev) = match state.map(unpack) {
        Some((sk, c, p)) if sk == k => (c, p),
        Some((sk, c, _)) if sk.checked_add(1) == Some(k) => (0, c),
        _ => (0, 0),
    };
    let (w128, cost128) = (u128::from(w), u128::from(cost));
    // Everything is multiplied by W to stay in integers.
    let prev_weight = u128::from(prev) * u128::from(w - elapsed);
    let budget = n * w128;
    let used_after = prev_weight + (u128::from(cur) + cost128) * w128;
    let window_end = ((k + 1) * w).saturating_sub(now_ns);
    if used_after <= budget {
        let new_cur = cur + cost;
        Check {
            allowed: true,
            new_state: pack(k, new_cur, prev),
            remaining: u64::try_from((budget - used_after) / w128).unwrap_or(u64::MAX),
            reset_ns: window_end + w,
            retry_after_ns: 0,
        }
    } else {
        let used = prev_weight + u128::from(cur) * w128;
        Check {
            allowed: false,
            new_state: pack(k, cur, prev),
            remaining: u64::try_from(budget.saturating_sub(used) / w128).unwrap_or(u64::MAX),
            reset_ns: if cur > 0 {
                window_end + w
            } else if prev > 0 {
                window_end
            } else {
                0
            },
            retry_after_ns: retry_after(limit, cur, prev, elapsed, cost),
        }
    }
}

/// Earliest wait after which `cost` passes: later in this window as `prev`
/// fades, or in the next one, where `cur` becomes the fading `prev`.
fn retry_after(limit: &Limit, cur: u64, prev: u64, elapsed: u64, cost: u64) -> u64 {
    let w = limit.period_ns.max(1);
    let n = limit.capacity;
    if cost > n {
        return w;
    }
    // The elapsed time in a window from which `fading × (W − e) ≤ room × W`.
    let from = |fading: u64, room: u64| -> u64 {
        if fading == 0 {
            return 0;
        }
        let allowed_weight = u128::from(room) * u128::from(w) / u128::from(fading);
        u64::try_from(u128::from(w).saturating_sub(allowed_weight)).unwrap_or(w)
    };
    if let Some(room) = n.checked_sub(cur + cost) {
        let e = from(prev, room);
        if e < w {
            return e.saturating_sub(elapsed).max(1);
        }
    }
    (w - elapsed) + from(cur, n - cost)
}

/// When a bucket with this state no longer weighs on anything (ns).
pub fn full_at_ns(limit: &Limit, state: u128) -> u64 {
    let (k, _, _) = unpack(state);
    k.saturating_add(2).saturating_mul(limit.period_ns)
}

/// Gives back `cost` charged in `state`'s current window.
pub fn refund(state: u128, cost: u64) -> u128 {
    let (k, cur, prev) = unpack(state);
    pack(k, cur.saturating_sub(cost), prev)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    fn lim(n: u64, secs: u64) -> Limit {
        Limit::new(n, secs * SEC)
    }

    #[test]
    fn counts_within_a_window() {
        let l = lim(3, 10);
        let t = 1000 * SEC;
        let mut s = None;
        for left in [2, 1, 0] {
            let c = check(&l, s, t, 1);
            assert!(c.allowed);
            assert_eq!(c.remaining, left);
            assert_eq!(c.reset_ns, 20 * SEC);
            s = Some(c.new_state);
        }
        let d = check(&l, s, t, 1);
        assert!(!d.allowed);
        // 3 in the current window: in the next they weigh 3×(W−e)/W, passing once that is ≤ 2.
        assert_eq!(d.retry_after_ns, 10 * SEC + 10 * SEC / 3 + 1);
    }

    #[test]
    fn the_fixed_window_flaw_is_impossible() {
        // N just before a boundary, N just after: the second burst is refused.
        let l = lim(10, 60);
        let boundary = 6000 * SEC;
        let mut s = None;
        let mut before = 0;
        for _ in 0..10 {
            let c = check(&l, s, boundary - 1, 1);
            if c.allowed {
                before += 1;
                s = Some(c.new_state);
            }
        }
        let mut after = 0;
        for _ in 0..10 {
            let c = check(&l, s, boundary + 1, 1);
            if c.allowed {
                after += 1;
                s = Some(c.new_state);
            }
        }
        assert_eq!((before, after), (10, 0));
        // Half a window later half of the old burst has faded.
        let mut later = 0;
        for _ in 0..10 {
            let c = check(&l, s, boundary + 30 * SEC, 1);
            if c.allowed {
                later += 1;
                s = Some(c.new_state);
            }
        }
        assert_eq!(later, 5);
    }

    #[test]
    fn an_old_window_is_forgotten() {
        let l = lim(1, 1);
        let a = check(&l, None, 10 * SEC, 1);
        assert!(!check(&l, Some(a.new_state), 10 * SEC + SEC / 2, 1).allowed);
        assert!(check(&l, Some(a.new_state), 12 * SEC, 1).allowed);
    }

    #[test]
    fn refund_and_full_at() {
        let l = lim(5, 10);
        let c = check(&l, None, 95 * SEC, 3);
        let r = refund(c.new_state, 3);
        assert_eq!(check(&l, Some(r), 95 * SEC, 5).remaining, 0);
        assert_eq!(full_at_ns(&l, c.new_state), 110 * SEC);
    }

    proptest! {
        #[test]
        fn retry_after_is_exactly_when_it_passes(
            n in 1u64..50, secs in 1u64..20, steps in proptest::collection::vec((0u64..3 * SEC, 1u64..5), 1..60)
        ) {
            let l = lim(n, secs);
            let mut now = 500 * SEC;
            let mut s = None;
            for (dt, cost) in steps {
                now += dt;
                let c = check(&l, s, now, cost);
                if c.allowed {
                    s = Some(c.new_state);
                } else if cost <= n {
                    prop_assert!(check(&l, s, now + c.retry_after_ns, cost).allowed);
                    prop_assert!(!check(&l, s, now + c.retry_after_ns - 1, cost).allowed);
                }
                prop_assert!(c.remaining <= n);
            }
        }

        #[test]
        fn never_more_than_n_per_fixed_window_and_under_2n_per_sliding_window(
            n in 1u64..30, steps in proptest::collection::vec(0u64..SEC / 2, 1..400)
        ) {
            let l = lim(n, 10);
            let mut now = 100 * SEC;
            let mut s = None;
            let mut admitted: Vec<u64> = Vec::new();
            for dt in steps {
                now += dt;
                let c = check(&l, s, now, 1);
                if c.allowed {
                    s = Some(c.new_state);
                    admitted.push(now);
                }
            }
            for (i, &t) in admitted.iter().enumerate() {
                let in_window = admitted[i..].iter().take_while(|&&u| u < t + l.period_ns).count() as u64;
                prop_assert!(in_window < 2 * n, "{} in a window from {}", in_window, t);
            }
            for k in 0..=(now / l.period_ns) {
                let fixed = admitted.iter().filter(|&&u| u / l.period_ns == k).count() as u64;
                prop_assert!(fixed <= n);
            }
        }
    }
}
