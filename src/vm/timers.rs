//! The root context's timers, as pure code: the queue of requests a
//! graduated rule holds, and the schedule of the lease top-ups. The host
//! layer's tick only reads the clock and resumes what these say is due.

use std::time::Duration;

/// How often the root context looks for delayed requests to resume.
pub const TICK: Duration = Duration::from_millis(5);
/// How often the root context flushes the counters when nothing else needs
/// its tick: a counter in Envoy is at most this far behind (10 wakeups a
/// second per worker).
pub const FLUSH_TICK: Duration = Duration::from_millis(100);
/// How often the root context looks for leases running low.
pub const REFRESH_EVERY_NS: u64 = 20_000_000;

/// Requests held by a graduated rule's delay, one queue per worker.
#[derive(Debug, Default)]
pub struct Delays {
    /// (context id, resume at ns, the delay in ns).
    held: Vec<(u32, u64, u64)>,
}

impl Delays {
    /// Holds request `id` for `delay_ns` from `now_ns`.
    pub fn hold(&mut self, id: u32, now_ns: u64, delay_ns: u64) {
        self.held
            .push((id, now_ns.saturating_add(delay_ns), delay_ns));
    }

    /// Takes the requests whose delay is over at `now_ns`. A release further
    /// off than its delay means the clock stepped back (wall clock only):
    /// no request is held longer than its delay from now.
    pub fn due(&mut self, now_ns: u64) -> Vec<u32> {
        for (_, at, delay) in self.held.iter_mut() {
            *at = (*at).min(now_ns.saturating_add(*delay));
        }
        let due = self
            .held
            .iter()
            .filter(|(_, at, _)| *at <= now_ns)
            .map(|(id, _, _)| *id)
            .collect();
        self.held.retain(|(_, at, _)| *at > now_ns);
        due
    }

    /// Whether request `id` is held.
    pub fn holds(&self, id: u32) -> bool {
        self.held.iter().any(|(d, _, _)| *d == id)
    }

    /// Forgets request `id`: its stream is done and must never be resumed.
    pub fn forget(&mut self, id: u32) {
        self.held.retain(|(d, _, _)| *d != id);
    }
}

/// When the lease top-ups next run.
#[derive(Debug, Default)]
pub struct RefreshSchedule {
    next_ns: u64,
}

impl RefreshSchedule {
    /// Whether the top-ups run at `now_ns`; if so, the next run is
    /// [`REFRESH_EVERY_NS`] later.
    pub fn due(&mut self, now_ns: u64) -> bool {
        if now_ns < self.next_ns {
            return false;
        }
        self.next_ns = now_ns.saturating_add(REFRESH_EVERY_NS);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn delayed_requests_are_due_after_their_delay_and_forgotten_ones_never() {
        let mut d = Delays::default();
        d.hold(1, 1000 * MS, 50 * MS);
        d.hold(2, 1000 * MS, 10 * MS);
        d.hold(3, 1000 * MS, 10 * MS);
        d.forget(3);
        assert_eq!(d.due(1009 * MS), Vec::<u32>::new());
        assert_eq!(d.due(1010 * MS), vec![2]);
        assert_eq!(d.due(1049 * MS), Vec::<u32>::new());
        assert_eq!(d.due(1050 * MS), vec![1]);
        assert_eq!(d.due(2000 * MS), Vec::<u32>::new());
    }

    #[test]
    fn a_clock_stepped_back_holds_no_request_longer_than_its_delay() {
        let mut d = Delays::default();
        d.hold(7, 5000 * MS, 20 * MS);
        // The wall clock steps back 3 s: still released 20 ms from the new now.
        assert_eq!(d.due(2000 * MS), Vec::<u32>::new());
        assert_eq!(d.due(2019 * MS), Vec::<u32>::new());
        assert_eq!(d.due(2020 * MS), vec![7]);
    }

    #[test]
    fn lease_top_ups_run_every_20_ms() {
        let mut r = RefreshSchedule::default();
        assert!(r.due(100 * MS));
        assert!(!r.due(119 * MS));
        assert!(r.due(120 * MS));
        assert!(!r.due(121 * MS));
    }
}
