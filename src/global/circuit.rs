//! The circuit breaker in front of the gateway, shared by every worker through
//! shared data: after `failures` consecutive failures (or slow answers) it
//! opens for `cooldown_ms`, then lets one probe through (half-open) and closes
//! again when the probe succeeds.
//!
//! Its deadlines are bounded by their own spans from now (open: the cooldown;
//! a probe: the longest callout timeout plus its margin), and a bounded state
//! is written back. On a clock that never steps back (the filter's monotonic
//! time) the bound never binds; if the clock did step back, an open breaker
//! probes at most one cooldown after the step, instead of the step plus the
//! cooldown.

use crate::config::Circuit;
use crate::limits::store::SharedStore;
use crate::limits::update::{update, UpdateError};

const MS: u64 = 1_000_000;
const ATTEMPTS: u32 = 8;
/// How long past its callout's timeout a probe keeps the half-open slot.
const PROBE_MARGIN_NS: u64 = 100 * MS;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct State {
    failures: u32,
    slow: u32,
    open_until_ns: u64,
    probe_until_ns: u64,
}

impl State {
    /// The state with its deadlines no further from `now_ns` than their spans.
    fn bounded(self, now_ns: u64, cooldown_ns: u64, probe_ns: u64) -> State {
        State {
            open_until_ns: self
                .open_until_ns
                .min(now_ns.saturating_add(cooldown_ns).max(1)),
            probe_until_ns: self.probe_until_ns.min(now_ns.saturating_add(probe_ns)),
            ..self
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24);
        out.extend_from_slice(&self.failures.to_le_bytes());
        out.extend_from_slice(&self.slow.to_le_bytes());
        out.extend_from_slice(&self.open_until_ns.to_le_bytes());
        out.extend_from_slice(&self.probe_until_ns.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> State {
        let u32_at = |i: usize| {
            bytes
                .get(i..i + 4)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u32::from_le_bytes)
        };
        let u64_at = |i: usize| {
            bytes
                .get(i..i + 8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        State {
            failures: u32_at(0),
            slow: u32_at(4),
            open_until_ns: u64_at(8),
            probe_until_ns: u64_at(16),
        }
    }
}

/// Whether to call the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Closed: call.
    Call,
    /// Half-open: this request is the one probe.
    Probe,
    /// Open: do not call; apply the failure mode.
    Open,
}

/// How a callout went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    /// A usable answer, after this long.
    Answered {
        /// Time from dispatch to answer.
        latency_ns: u64,
    },
    /// No usable answer.
    Failed,
}

/// A change of the breaker's state, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Nothing changed state.
    None,
    /// The breaker opened.
    Opened,
    /// The breaker closed.
    Closed,
}

/// Decides whether this request may call the gateway. A probe it claims
/// holds the half-open slot for `timeout_ms` plus a margin; `longest_timeout_ms`
/// is the longest any caller claims it for (it bounds a stored claim).
pub fn gate(
    store: &impl SharedStore,
    key: &str,
    cfg: &Circuit,
    timeout_ms: u64,
    longest_timeout_ms: u64,
    now_ns: u64,
) -> Gate {
    let probe_ns = longest_timeout_ms
        .max(timeout_ms)
        .saturating_mul(MS)
        .saturating_add(PROBE_MARGIN_NS);
    let gate = update(store, key, ATTEMPTS, |bytes| {
        let state = bytes.map(State::decode).unwrap_or_default();
        if state.open_until_ns == 0 {
            return (None, Gate::Call);
        }
        // Written back when the bound binds, so that it counts from the clock
        // step and does not slide with now.
        let bounded = state.bounded(now_ns, cfg.cooldown_ms.saturating_mul(MS), probe_ns);
        if now_ns < bounded.open_until_ns || now_ns < bounded.probe_until_ns {
            return ((bounded != state).then(|| bounded.encode()), Gate::Open);
        }
        // Cooldown over and no probe in flight: claim the probe.
        let claimed = State {
            probe_until_ns: now_ns
                .saturating_add(timeout_ms.saturating_mul(MS))
                .saturating_add(PROBE_MARGIN_NS),
            ..bounded
        };
        (Some(claimed.encode()), Gate::Probe)
    });
    match gate {
        Ok(g) => g,
        // Shared data failing says nothing about the gateway: call it.
        Err(UpdateError::Store(_)) => Gate::Call,
        Err(UpdateError::Contention) => Gate::Open,
    }
}

/// Records a callout's result and opens or closes the breaker.
pub fn record(
    store: &impl SharedStore,
    key: &str,
    cfg: &Circuit,
    now_ns: u64,
    result: CallResult,
    probe: bool,
) -> Transition {
    let transition = update(store, key, ATTEMPTS, |bytes| {
        let state = bytes.map(State::decode).unwrap_or_default();
        let was_open = state.open_until_ns != 0;
        let slow = match result {
            CallResult::Answered { latency_ns } => {
                cfg.latency_ms > 0 && latency_ns > cfg.latency_ms.saturating_mul(MS)
            }
            CallResult::Failed => false,
        };
        let mut next = state;
        match result {
            CallResult::Answered { .. } if !slow => next = State::default(),
            CallResult::Answered { .. } => {
                next.failures = 0;
                next.slow = state.slow.saturating_add(1);
            }
            CallResult::Failed => {
                next.slow = 0;
                next.failures = state.failures.saturating_add(1);
            }
        }
        let trips = !matches!(result, CallResult::Answered { .. } if !slow)
            && (probe || next.failures >= cfg.failures || next.slow >= cfg.failures);
        if trips {
            next = State {
                open_until_ns: now_ns.saturating_add(cfg.cooldown_ms.saturating_mul(MS)),
                ..State::default()
            };
        } else if was_open && !probe {
            // A late answer to a call made before the breaker opened changes nothing.
            return (None, Transition::None);
        }
        if next == state {
            return (None, Transition::None);
        }
        let transition = match (trips, was_open) {
            (true, _) => Transition::Opened,
            (false, true) => Transition::Closed,
            (false, false) => Transition::None,
        };
        (Some(next.encode()), transition)
    });
    transition.unwrap_or(Transition::None)
}

/// How long clients should wait while the breaker is open, in whole seconds.
pub fn retry_after_secs(cfg: &Circuit) -> u64 {
    cfg.cooldown_ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::store::MemoryStore;

    const K: &str = "c";
    fn cfg() -> Circuit {
        Circuit {
            failures: 3,
            latency_ms: 5,
            cooldown_ms: 2000,
        }
    }

    #[test]
    fn opens_after_consecutive_failures_then_probes_and_closes() {
        let s = MemoryStore::default();
        let c = cfg();
        let t = 1_000 * 1_000 * MS;
        for i in 0..2 {
            assert_eq!(gate(&s, K, &c, 50, 50, t), Gate::Call);
            assert_eq!(
                record(&s, K, &c, t + i, CallResult::Failed, false),
                Transition::None
            );
        }
        // A success in between resets the count.
        record(&s, K, &c, t, CallResult::Answered { latency_ns: MS }, false);
        for _ in 0..2 {
            record(&s, K, &c, t, CallResult::Failed, false);
        }
        assert_eq!(gate(&s, K, &c, 50, 50, t), Gate::Call);
        assert_eq!(
            record(&s, K, &c, t, CallResult::Failed, false),
            Transition::Opened
        );
        assert_eq!(gate(&s, K, &c, 50, 50, t + 1999 * MS), Gate::Open);
        // After the cooldown exactly one probe goes through.
        assert_eq!(gate(&s, K, &c, 50, 50, t + 2000 * MS), Gate::Probe);
        assert_eq!(gate(&s, K, &c, 50, 50, t + 2001 * MS), Gate::Open);
        assert_eq!(
            record(
                &s,
                K,
                &c,
                t + 2010 * MS,
                CallResult::Answered { latency_ns: MS },
                true
            ),
            Transition::Closed
        );
        assert_eq!(gate(&s, K, &c, 50, 50, t + 2011 * MS), Gate::Call);
    }

    #[test]
    fn a_failed_probe_reopens_and_slow_answers_count() {
        let s = MemoryStore::default();
        let c = cfg();
        let t = 5_000 * 1_000 * MS;
        for _ in 0..3 {
            record(
                &s,
                K,
                &c,
                t,
                CallResult::Answered { latency_ns: 6 * MS },
                false,
            );
        }
        assert_eq!(gate(&s, K, &c, 50, 50, t), Gate::Open);
        let later = t + 2000 * MS;
        assert_eq!(gate(&s, K, &c, 50, 50, later), Gate::Probe);
        assert_eq!(
            record(&s, K, &c, later, CallResult::Failed, true),
            Transition::Opened
        );
        assert_eq!(gate(&s, K, &c, 50, 50, later + 1999 * MS), Gate::Open);
        // A probe lost without an answer frees the slot after its timeout.
        assert_eq!(gate(&s, K, &c, 50, 50, later + 2000 * MS), Gate::Probe);
        assert_eq!(gate(&s, K, &c, 50, 50, later + 2100 * MS), Gate::Open);
        assert_eq!(gate(&s, K, &c, 50, 50, later + 2151 * MS), Gate::Probe);
    }

    #[test]
    fn a_clock_step_back_holds_the_breaker_open_one_cooldown_at_most() {
        let s = MemoryStore::default();
        let c = cfg();
        let t = 9_000 * 1_000 * MS;
        let hour = 3_600_000 * MS;
        for _ in 0..3 {
            record(&s, K, &c, t, CallResult::Failed, false);
        }
        // Opened at t, then the clock reads an hour earlier: one cooldown, not an hour more.
        let back = t - hour;
        assert_eq!(gate(&s, K, &c, 50, 50, back), Gate::Open);
        assert_eq!(gate(&s, K, &c, 50, 50, back + 1999 * MS), Gate::Open);
        assert_eq!(gate(&s, K, &c, 50, 50, back + 2000 * MS), Gate::Probe);
        // The probe is lost and the clock steps back again: another probe one cooldown
        // after the step (the lost probe's claim is bounded too).
        let back2 = back - hour;
        assert_eq!(gate(&s, K, &c, 50, 80, back2), Gate::Open);
        assert_eq!(gate(&s, K, &c, 50, 80, back2 + 1999 * MS), Gate::Open);
        assert_eq!(gate(&s, K, &c, 50, 80, back2 + 2000 * MS), Gate::Probe);
    }

    #[test]
    fn latency_trigger_off_when_zero() {
        let s = MemoryStore::default();
        let c = Circuit {
            latency_ms: 0,
            ..cfg()
        };
        for _ in 0..10 {
            record(
                &s,
                K,
                &c,
                1,
                CallResult::Answered {
                    latency_ns: 999 * MS,
                },
                false,
            );
        }
        assert_eq!(gate(&s, K, &c, 50, 50, 2), Gate::Call);
        assert_eq!(s.len(), 0, "healthy calls write nothing");
    }
}
