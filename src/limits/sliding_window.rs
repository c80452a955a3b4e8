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

use crate::limits::token_bucket::{Check, Limit};

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
///
/// A clock behind the stored window (it stepped back) counts as that window's
/// start: the counts are kept, never forgotten, and reset and retry-after are
/// measured from the real `now_ns`, so they include the wait for the clock to
/// catch up.
pub fn check(limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> Check {
    let w = limit.period_ns.max(1);
    let n = u128::from(limit.capacity);
    let stored = state.map(unpack);
    let now = match stored.and_then(|(sk, _, _)| sk.checked_mul(w)) {
        Some(start) if start > now_ns => start,
        _ => now_ns,
    };
    let behind = now - now_ns;
    let k = now / w;
    let elapsed = now - k * w;
    let (cur, prev) = match stored {
        Some((sk, c, p)) if sk == k => (c, p),
        Some((sk, c, _)) if sk.checked_add(1) == Some(k) => (0, c),
        _ => (0, 0),
    };
    let (w128, cost128) = (u128::from(w), u128::from(cost));
    // Everything is multiplied by W to stay in integers.
    let prev_weight = u128::from(prev) * u128::from(w - elapsed);
    let budget = n * w128;
    let used_after = prev_weight + (u128::from(cur) + cost128) * w128;
    let window_end = (w - elapsed).saturating_add(behind);
    if used_after <= budget {
        let new_cur = cur + cost;
        Check {
            allowed: true,
            new_state: pack(k, new_cur, prev),
            remaining: u64::try_from((budget - used_after) / w128).unwrap_or(u64::MAX),
            reset_ns: window_end.saturating_add(w),
            retry_after_ns: 0,
        }
    } else {
        let used = prev_weight + u128::from(cur) * w128;
        Check {
            allowed: false,
            new_state: pack(k, cur, prev),
            remaining: u64::try_from(budget.saturating_sub(used) / w128).unwrap_or(u64::MAX),
            reset_ns: if cur > 0 {
                window_end.saturating_add(w)
            } else if prev > 0 {
                window_end
            } else {
                0
            },
            retry_after_ns: retry_after(limit, cur, prev, elapsed, cost).saturating_add(behind),
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

/// The state after `cost` more is counted whatever the window holds (a
/// settlement of a response that cost more than was reserved): counted in the
/// window of `now_ns`, so the estimate may pass the limit, and requests are
/// denied until the overdraft has faded.
pub fn force(limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> u128 {
    // A check of nothing moves the state to the window of `now_ns`.
    let (k, cur, prev) = unpack(check(limit, state, now_ns, 0).new_state);
    pack(k, cur.saturating_add(cost), prev)
}

/// When a bucket with this state no longer weighs on anything (ns).
pub fn full_at_ns(limit: &Limit, state: u128) -> u64 {
    let (k, _, _) = unpack(state);
    k.saturating_add(2).saturating_mul(limit.period_ns)
}

/// Gives back `cost` charged at `charged_at_ns`, only in the window that holds
/// that charge: `cur` while it is still the stored window, `prev` once a later
/// window was written, nothing after that (the charge no longer weighs). A
/// charge that a step-back clock counted in a later window is given back from
/// `prev` or not at all: stricter, never more than was taken (as `refund.lua`).
pub fn refund(limit: &Limit, state: u128, cost: u64, charged_at_ns: u64) -> u128 {
    let (sk, cur, prev) = unpack(state);
    let k = charged_at_ns / limit.period_ns.max(1);
    if sk == k {
        pack(sk, cur.saturating_sub(cost), prev)
    } else if k.checked_add(1) == Some(sk) {
        pack(sk, cur, prev.saturating_sub(cost))
    } else {
        state
    }
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
    fn a_forced_charge_counts_past_the_limit_until_it_fades() {
        let l = lim(10, 60);
        let c = check(&l, None, 0, 8);
        assert!(c.allowed);
        let state = force(&l, Some(c.new_state), SEC, 7);
        // 15 counted in this window: denied for the rest of it.
        assert!(!check(&l, Some(state), 59 * SEC, 1).allowed);
        // In the next window the 15 fade: 1 passes once 15 × (60 − e) / 60 ≤ 9.
        assert!(!check(&l, Some(state), 60 * SEC + 23 * SEC, 1).allowed);
        assert!(check(&l, Some(state), 60 * SEC + 24 * SEC, 1).allowed);
        let wait = check(&l, Some(state), 59 * SEC, 1).retry_after_ns;
        assert_eq!(wait, SEC + 24 * SEC);
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
        let r = refund(&l, c.new_state, 3, 95 * SEC);
        assert_eq!(check(&l, Some(r), 95 * SEC, 5).remaining, 0);
        assert_eq!(full_at_ns(&l, c.new_state), 110 * SEC);
    }

    /// Charges `tries` requests of cost 1 at `now`, threading the state; returns how many passed.
    fn burst(l: &Limit, s: &mut Option<u128>, now: u64, tries: u64) -> u64 {
        let mut passed = 0;
        for _ in 0..tries {
            let c = check(l, *s, now, 1);
            if c.allowed {
                *s = Some(c.new_state);
                passed += 1;
            }
        }
        passed
    }

    #[test]
    fn a_refund_frees_room_only_in_the_window_it_was_charged_in() {
        // 4 charged in window 100, 10 in window 102, then the
        // 4 refunded; they must not free room in window 102 (was: 4 more, 14).
        let l = lim(10, 1);
        let mut s = None;
        assert_eq!(burst(&l, &mut s, 100 * SEC, 4), 4);
        assert_eq!(burst(&l, &mut s, 102 * SEC, 10), 10);
        for _ in 0..4 {
            s = s.map(|st| refund(&l, st, 1, 100 * SEC));
        }
        assert_eq!(burst(&l, &mut s, 102 * SEC + SEC / 2, 10), 0);
    }

    #[test]
    fn a_clock_step_back_across_a_boundary_admits_nothing_more() {
        // N = 3 at boundary + 1 ns, boundary − 1 ns and
        // boundary + 2 ns (was: 6 within 2 ns, the forward window forgotten).
        let l = lim(3, 10);
        let b = 1000 * SEC;
        let mut s = None;
        let admitted = [b + 1, b - 1, b + 2].map(|t| burst(&l, &mut s, t, 3));
        assert_eq!(admitted, [3, 0, 0]);
    }

    proptest! {
        #[test]
        fn retry_after_is_exactly_when_it_passes(
            n in 1u64..50, secs in 1u64..20,
            steps in proptest::collection::vec((0u64..3 * SEC, any::<bool>(), 1u64..5), 1..60)
        ) {
            // Some steps go back in time: the retry then includes the wait
            // for the clock to reach the stored window again.
            let l = lim(n, secs);
            let mut now = 500 * SEC;
            let mut s = None;
            for (dt, back, cost) in steps {
                now = if back { now - dt / 2 } else { now + dt };
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

        /// Charges of any cost, refunds of earlier
        /// charges, the clock stepping forward and back, several W and N. The
        /// limiter's clock is the wall clock, never earlier than the start of
        /// the window last charged; on it, every fixed window holds at most N
        /// and every sliding window ending at t = kW + e at most
        /// `N + prev × e / W` (prev: what window k − 1 kept), the README's bound.
        #[test]
        fn the_readme_bounds_hold_under_refunds_and_clock_steps(
            n in 1u64..12,
            w in prop_oneof![Just(3u64), Just(1000), Just(10 * SEC), Just(3600 * SEC + 7)],
            ops in proptest::collection::vec((0u8..10, 0u64..1000, 1u64..5), 1..300)
        ) {
            let l = Limit::new(n, w);
            let mut now = 50 * w + 10 * SEC;
            let mut s = None;
            let mut last_window: Option<u64> = None;
            // (time on the limiter's clock, cost, wall time of the charge, refunded)
            let mut admitted: Vec<(u64, u64, u64, bool)> = Vec::new();
            for (kind, x, cost) in ops {
                match kind {
                    0..=5 => now += x * w / 400 + x % 5,
                    6 => now -= x * w / 300 + x % 7,
                    7 | 8 => {
                        let live: Vec<usize> = (0..admitted.len()).filter(|&i| !admitted[i].3).collect();
                        if let Some(&i) = live.get(x as usize % live.len().max(1)) {
                            let (_, c, at, _) = admitted[i];
                            s = s.map(|st| refund(&l, st, c, at));
                            admitted[i].3 = true;
                        }
                        continue;
                    }
                    _ => {}
                }
                let c = check(&l, s, now, cost);
                if c.allowed {
                    let clock = last_window.map_or(now, |k| now.max(k * w));
                    s = Some(c.new_state);
                    last_window = Some(clock / w);
                    admitted.push((clock, cost, now, false));
                }
            }
            let live: Vec<(u64, u64)> = admitted.iter().filter(|a| !a.3).map(|a| (a.0, a.1)).collect();
            let in_window = |k: u64| -> u64 { live.iter().filter(|a| a.0 / w == k).map(|a| a.1).sum() };
            for &(t, _) in &live {
                let (k, e) = (t / w, t % w);
                prop_assert!(in_window(k) <= n, "{} in fixed window {}", in_window(k), k);
                let sliding: u64 = live.iter().filter(|a| a.0 <= t && a.0 + w > t).map(|a| a.1).sum();
                let prev = if k > 0 { in_window(k - 1) } else { 0 };
                prop_assert!(
                    u128::from(sliding) * u128::from(w) <= u128::from(n) * u128::from(w) + u128::from(prev) * u128::from(e),
                    "{} in the sliding window ending at {} (prev {}, e {})", sliding, t, prev, e
                );
            }
        }
    }
}
