//! What an admitted request settles once its response is known: a rule
//! with `charge_on` gives its charge back for a status it does not charge
//! (or a stream that ended before its response), and a charge read from the
//! response (`cost_from`) moves from the reservation to the real cost, at
//! most `max`: the difference is charged, which may leave the bucket in
//! debt, or refunded. The response's headers and body are never held for it:
//! the body is scanned chunk by chunk as it passes. What the gateway
//! reserved settles the same way, at once when everything is known, as one
//! settlement for the gateway (`remote`); what a request spent from a lease
//! settles against the lease's slot (`lease::settle`) as a local bucket does.

use super::remote::{Open, Reserved};
use super::*;
use crate::config::StatusMatch;
use crate::global::lease::Settled;
use crate::policy::plan::MeterSource;
use crate::usage::{Framing, Scan, Usage};

/// The response's headers as the host has them.
pub trait ResponseHeaders {
    /// The value of header `name` (lower-case; `:status` for the status).
    fn header(&self, name: &str) -> Option<Vec<u8>>;
}

/// A request's charges still open to settlement, from its admission to the
/// end of its stream.
#[derive(Debug)]
pub struct Settlement {
    lines: Vec<Line>,
    at_ns: u64,
    /// The body scans under way: a meter's index and its scan.
    scans: Vec<(usize, Scan)>,
    phase: Phase,
    /// What the gateway reserved, while its real cost is not all known.
    remote: Option<Open>,
    /// The gateway's settlement, once made, until the host takes it.
    outbox: Option<ratelimit_protocol::Settlement>,
    /// The lease batch the request spent from.
    leased: Option<LeaseLine>,
    /// What settling against the lease could not apply, until the host counts it.
    lease_left: Settled,
}

/// One bucket the request was charged, and how it settles.
#[derive(Debug)]
struct Line {
    bucket: Bucket,
    /// The meter reading its real cost; `None` for a cost fixed up front.
    meter: Option<usize>,
    settled: bool,
}

/// The lease a request spent its global rule's cost from, and how it settles.
#[derive(Debug)]
struct LeaseLine {
    lease: Box<Lease>,
    /// As [`Line::meter`].
    meter: Option<usize>,
    settled: bool,
}

/// How a bucket of `rule` settles: `Some(meter)` reads its real cost (the
/// rule's `cost_from`, or the `costs` entry's `cost_meter` for a rule
/// without a cost of its own), `Some(None)` only gives it back for a status
/// its `charge_on` leaves out; `None` when it keeps what it was charged.
fn settles_from_response(
    plan: &Plan,
    rule: usize,
    cost_meter: Option<usize>,
) -> Option<Option<usize>> {
    let meter = plan.meter_of(rule, cost_meter);
    let charge_on = plan.rules.get(rule).is_some_and(|r| r.charge_on.is_some());
    (meter.is_some() || charge_on).then_some(meter)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No response yet.
    Waiting,
    /// The body is being scanned.
    Body,
    /// Everything is settled.
    Done,
}

impl Settlement {
    /// The settlement of an admitted request's charge `held` and of what it
    /// spent from `leased`, or `None` when none of it settles from the response.
    pub fn new(plan: &Plan, held: &Held, leased: Option<&Lease>) -> Option<Box<Settlement>> {
        let lines: Vec<Line> = held
            .buckets
            .iter()
            .filter_map(|b| {
                let meter = settles_from_response(plan, b.rule, held.cost_meter())?;
                Some(Line {
                    bucket: *b,
                    meter,
                    settled: false,
                })
            })
            .collect();
        let remote = held.remote().cloned().map(Open::new);
        let leased = leased.and_then(|l| {
            let meter = settles_from_response(plan, l.bucket.rule, held.cost_meter())?;
            Some(LeaseLine {
                lease: Box::new(l.clone()),
                meter,
                settled: false,
            })
        });
        (!lines.is_empty() || remote.is_some() || leased.is_some()).then(|| {
            Box::new(Settlement {
                lines,
                at_ns: held.at_ns,
                scans: Vec::new(),
                phase: Phase::Waiting,
                remote,
                outbox: None,
                leased,
                lease_left: Settled::default(),
            })
        })
    }

    /// What settling against the lease could not apply since the last call
    /// (tokens not given back, debt dropped), for the host to count.
    pub fn take_lease_left(&mut self) -> Settled {
        std::mem::take(&mut self.lease_left)
    }

    /// The gateway's settlement, once every line of it is known (taken once).
    pub fn take_outbox(&mut self) -> Option<ratelimit_protocol::Settlement> {
        self.outbox.take()
    }

    /// Everything is known: what the gateway reserved is settled, unless it
    /// holds a concurrency slot, settled with it when the stream ends.
    fn done(&mut self, plan: &Plan) {
        self.phase = Phase::Done;
        if self.remote.as_ref().is_some_and(|o| o.holds_slots(plan)) {
            return;
        }
        if let Some(open) = self.remote.take() {
            self.outbox = open.close(plan);
        }
    }

    /// What releases the concurrency slots a check under `reserved` may
    /// have taken, for a request that will not settle them at its stream's
    /// end (its stream ended while the check was on its way, or the check
    /// failed); the gateway finds no record if the check took none. `None`
    /// without slots.
    pub fn release_of(plan: &Plan, reserved: Reserved) -> Option<ratelimit_protocol::Settlement> {
        let mut open = Open::new(reserved);
        if !open.holds_slots(plan) {
            return None;
        }
        open.release_slots(plan);
        open.close(plan)
    }

    /// A settlement with nothing left to do but send `release`.
    pub fn sending(release: ratelimit_protocol::Settlement) -> Box<Settlement> {
        Box::new(Settlement {
            lines: Vec::new(),
            at_ns: 0,
            scans: Vec::new(),
            phase: Phase::Done,
            remote: None,
            outbox: Some(release),
            leased: None,
            lease_left: Settled::default(),
        })
    }

    /// Sends `release` too, at once (a check that failed has nothing else
    /// for the gateway).
    pub fn send_also(&mut self, release: ratelimit_protocol::Settlement) {
        if self.outbox.is_none() && self.remote.is_none() {
            self.outbox = Some(release);
        }
    }

    /// Whether the response body should be fed to [`Settlement::body`].
    pub fn wants_body(&self) -> bool {
        self.phase == Phase::Body
    }

    /// Response headers: refunds the rules whose `charge_on` leaves this
    /// status out, settles costs read from a header, and starts a scan of
    /// the body for the rest.
    pub fn response_headers(
        &mut self,
        plan: &Plan,
        head: &impl ResponseHeaders,
        store: &impl SharedStore,
        now_ns: u64,
    ) -> Counts {
        let mut counts = Counts::default();
        if self.phase != Phase::Waiting {
            return counts;
        }
        let status = head
            .header(":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok());
        self.refund_uncharged(plan, store, status, now_ns, &mut counts);
        let meters = self.open_meters();
        for m in meters {
            match plan.meters.get(m).map(|p| &p.source) {
                Some(MeterSource::Header(name)) => {
                    let usage = head.header(name).map_or(Usage::Missing, |v| {
                        header_usage(&v, plan.meters.get(m).map_or(0, |p| p.max))
                    });
                    self.settle(plan, m, usage, store, now_ns, &mut counts);
                }
                Some(MeterSource::Body(meter)) => match framing(head) {
                    Some(f) => self.scans.push((m, Scan::new(meter, f))),
                    None => {
                        counts.add(Metric::UsageCompressed, 1);
                        self.keep_reserve(m);
                    }
                },
                None => self.keep_reserve(m),
            }
        }
        if self.scans.is_empty() {
            self.done(plan);
        } else {
            self.phase = Phase::Body;
        }
        counts
    }

    /// A chunk of the response body; `end` when it is the last.
    pub fn body(
        &mut self,
        plan: &Plan,
        chunk: &[u8],
        end: bool,
        store: &impl SharedStore,
        now_ns: u64,
    ) -> Counts {
        if self.phase != Phase::Body {
            return Counts::default();
        }
        let mut all_over = true;
        for (m, scan) in &mut self.scans {
            if let Some(MeterSource::Body(meter)) = plan.meters.get(*m).map(|p| &p.source) {
                scan.feed(meter, chunk);
                all_over &= scan.over_limit(meter);
            }
        }
        // Past every scan limit nothing more is read: settle now, and the
        // host stops handing the VM the rest of the body.
        if end || all_over {
            self.finish_scans(plan, store, now_ns)
        } else {
            Counts::default()
        }
    }

    /// The end of the stream: a request that never saw its response gives
    /// back the charge of its `charge_on` rules; a scan still under way (the
    /// body ended early) settles on what it found; concurrency slots held on
    /// the gateway are released.
    pub fn end(&mut self, plan: &Plan, store: &impl SharedStore, now_ns: u64) -> Counts {
        let mut counts = Counts::default();
        match self.phase {
            Phase::Waiting => {
                self.refund_uncharged(plan, store, None, now_ns, &mut counts);
                let lease_open = self.leased.as_ref().is_some_and(|l| !l.settled);
                if lease_open || self.lines.iter().any(|l| !l.settled) {
                    counts.add(Metric::UsageMissing, 1);
                }
            }
            Phase::Body => counts = self.finish_scans(plan, store, now_ns),
            Phase::Done => {}
        }
        if let Some(open) = &mut self.remote {
            open.release_slots(plan);
        }
        self.done(plan);
        counts
    }

    fn finish_scans(&mut self, plan: &Plan, store: &impl SharedStore, now_ns: u64) -> Counts {
        let mut counts = Counts::default();
        for (m, scan) in std::mem::take(&mut self.scans) {
            let usage = match plan.meters.get(m).map(|p| &p.source) {
                Some(MeterSource::Body(meter)) => scan.finish(meter),
                _ => Usage::Missing,
            };
            self.settle(plan, m, usage, store, now_ns, &mut counts);
        }
        self.done(plan);
        counts
    }

    /// The meters that still have lines to settle, each once.
    fn open_meters(&self) -> Vec<usize> {
        let mut meters: Vec<usize> = self
            .lines
            .iter()
            .filter(|l| !l.settled)
            .filter_map(|l| l.meter)
            .chain(self.remote.iter().flat_map(Open::meters))
            .chain(
                self.leased
                    .iter()
                    .filter(|l| !l.settled)
                    .filter_map(|l| l.meter),
            )
            .collect();
        meters.sort_unstable();
        meters.dedup();
        meters
    }

    /// Gives back the charge of every rule whose `charge_on` does not hold
    /// `status` (`None`: no response came, which no `charge_on` holds).
    fn refund_uncharged(
        &mut self,
        plan: &Plan,
        store: &impl SharedStore,
        status: Option<u16>,
        now_ns: u64,
        counts: &mut Counts,
    ) {
        let uncharged = |rule: usize| {
            plan.rules
                .get(rule)
                .and_then(|r| r.charge_on.as_ref())
                .is_some_and(|on| {
                    !status.is_some_and(|s| on.iter().any(|m: &StatusMatch| m.matches(s)))
                })
        };
        if let Some(open) = &mut self.remote {
            open.refund_uncharged(uncharged);
        }
        let lease_back = self
            .leased
            .as_ref()
            .is_some_and(|l| !l.settled && uncharged(l.lease.bucket.rule));
        if lease_back {
            self.settle_lease(store, 0, now_ns, counts);
        }
        let mut back = Vec::new();
        for line in self
            .lines
            .iter_mut()
            .filter(|l| !l.settled && uncharged(l.bucket.rule))
        {
            line.settled = true;
            back.push(line.bucket);
        }
        if back.is_empty() && !lease_back {
            return;
        }
        counts.add(Metric::ChargeRefunded, 1);
        if !back.is_empty() && limiter::refund(store, plan, &back, self.at_ns).is_err() {
            counts.add(Metric::Errors, 1);
        }
    }

    /// Settles the open lease line at `real` and marks it settled.
    fn settle_lease(
        &mut self,
        store: &impl SharedStore,
        real: u64,
        now_ns: u64,
        counts: &mut Counts,
    ) {
        let Some(line) = self.leased.as_mut().filter(|l| !l.settled) else {
            return;
        };
        line.settled = true;
        match lease::settle(store, &line.lease, line.lease.bucket.cost, real, now_ns) {
            Ok(left) => self.lease_left.add(left),
            Err(_) => counts.add(Metric::Errors, 1),
        }
    }

    /// Whether the lease line is open and read by meter `m`.
    fn lease_metered(&self, m: usize) -> bool {
        self.leased
            .as_ref()
            .is_some_and(|l| !l.settled && l.meter == Some(m))
    }

    /// The lines of meter `m` keep what was reserved.
    fn keep_reserve(&mut self, m: usize) {
        if let Some(open) = &mut self.remote {
            open.settle(m, None);
        }
        if let Some(line) = self.leased.as_mut().filter(|l| l.meter == Some(m)) {
            line.settled = true;
        }
        for line in self.lines.iter_mut().filter(|l| l.meter == Some(m)) {
            line.settled = true;
        }
    }

    /// Moves the lines of meter `m` from their reservation to what `usage`
    /// says the response cost (the reservation when it says nothing).
    fn settle(
        &mut self,
        plan: &Plan,
        m: usize,
        usage: Usage,
        store: &impl SharedStore,
        now_ns: u64,
        counts: &mut Counts,
    ) {
        let cost = match usage {
            Usage::Found { cost, capped } => {
                counts.add(Metric::UsageSettled, 1);
                if capped {
                    counts.add(Metric::UsageCapped, 1);
                }
                cost
            }
            Usage::Missing => {
                counts.add(Metric::UsageMissing, 1);
                return self.keep_reserve(m);
            }
            Usage::OverLimit => {
                counts.add(Metric::UsageOverScanLimit, 1);
                return self.keep_reserve(m);
            }
        };
        if let Some(open) = &mut self.remote {
            open.settle(m, Some(cost));
        }
        if self.lease_metered(m) {
            self.settle_lease(store, cost, now_ns, counts);
        }
        let (mut more, mut back) = (Vec::new(), Vec::new());
        for line in self
            .lines
            .iter_mut()
            .filter(|l| !l.settled && l.meter == Some(m))
        {
            line.settled = true;
            let reserved = line.bucket.cost;
            let delta = Bucket {
                cost: cost.abs_diff(reserved),
                ..line.bucket
            };
            match cost.cmp(&reserved) {
                std::cmp::Ordering::Greater => more.push(delta),
                std::cmp::Ordering::Less => back.push(delta),
                std::cmp::Ordering::Equal => {}
            }
        }
        let charged = more.is_empty() || limiter::charge_more(store, plan, &more, now_ns).is_ok();
        let refunded = back.is_empty() || limiter::refund(store, plan, &back, self.at_ns).is_ok();
        if !(charged && refunded) {
            counts.add(Metric::Errors, 1);
        }
    }
}

/// The cost in a header: a decimal integer, capped at `max`. Public so
/// that `ratelimit explain` reads a sample response as the filter does.
pub fn header_usage(value: &[u8], max: u64) -> Usage {
    let digits = value.trim_ascii();
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Usage::Missing;
    }
    // Saturates: a value past u64 is past any max.
    let n = digits.iter().fold(0u64, |n, d| {
        n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
    });
    Usage::Found {
        cost: n.min(max),
        capped: n > max,
    }
}

/// How the body is framed, from its headers; `None` for a compressed body,
/// which is not scanned. Public so that `ratelimit explain` frames a sample
/// response as the filter does.
pub fn framing(head: &impl ResponseHeaders) -> Option<Framing> {
    if let Some(enc) = head.header("content-encoding") {
        if !enc.trim_ascii().eq_ignore_ascii_case(b"identity") {
            return None;
        }
    }
    let sse = head.header("content-type").is_some_and(|t| {
        let t = t.trim_ascii();
        t.len() >= 17
            && t.get(..17)
                .is_some_and(|p| p.eq_ignore_ascii_case(b"text/event-stream"))
    });
    Some(if sse { Framing::Sse } else { Framing::Json })
}
