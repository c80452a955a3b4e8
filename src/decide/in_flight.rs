//! A request's slots of the concurrency rules it matches (`{"concurrent":
//! N}`): taken after its local charge, all or nothing, and given back when
//! it is refused or its stream ends. A full key is a 429 with
//! `Retry-After: 1`: a slot frees when any request of that key ends, which no
//! refill time predicts.

use super::*;
use crate::limits::in_flight::{self, Acquired, SlotKey};

/// A slot the request holds (the in-flight table's).
pub use crate::limits::in_flight::Taken as Slot;

/// What a full key's 429 says of the wait: one second.
const RETRY_NS: u64 = 1_000_000_000;

impl<S: SharedStore> Ctx<'_, S> {
    /// Takes a slot of each concurrency rule `eval` matched, adding their
    /// reports to `into`. `Err` is the 429 of a full key; a soft client goes
    /// on without that slot (counted as a shadow denial), and a shared-data
    /// failure follows `on_error`.
    pub(super) fn take_slots(
        &mut self,
        eval: &Evaluation,
        into: &mut Vec<Report>,
    ) -> Result<Vec<Slot>, Verdict> {
        let keys: Vec<SlotKey> = eval
            .in_flight
            .iter()
            .map(|b| SlotKey {
                set: b.set,
                fingerprint: b.fingerprint,
                limit: u32::try_from(self.slots_of(b)).unwrap_or(u32::MAX),
            })
            .collect();
        // One deadline for all: the longest `max_in_flight` of the request's rules.
        let hold_ns = eval
            .in_flight
            .iter()
            .filter_map(|b| self.plan.limits(b.rule, b.variant).first())
            .map(|(l, _)| l.period_ns)
            .max()
            .unwrap_or(0);
        let id = (self.random >> 32) as u32 ^ self.random as u32;
        let result = in_flight::acquire(
            self.store,
            &self.plan.in_flight,
            &keys,
            self.now_ns,
            hold_ns,
            id,
        );
        let taken = match result {
            Ok(r) => {
                self.counts.add(Metric::Evictions, r.stats.evictions);
                self.counts.add(Metric::CorruptState, r.stats.corrupt_sets);
                self.counts.add(Metric::CasRetries, r.stats.cas_retries);
                r.acquired
            }
            Err(e) => {
                self.failed(e);
                return match self.plan.on_error {
                    OnError::Allow => Ok(Vec::new()),
                    OnError::Deny => Err(self.full(eval, 0, into)),
                };
            }
        };
        match taken {
            Acquired::Taken(slots) => {
                for (b, t) in eval.in_flight.iter().zip(&slots) {
                    into.push(self.slot_report(b, t.in_flight.into(), true));
                }
                Ok(slots)
            }
            Acquired::Full { key, .. } | Acquired::Crowded { key } if eval.soft => {
                if let Some(b) = eval.in_flight.get(key) {
                    let r = self.slot_report(b, self.slots_of(b), false);
                    self.note_shadow(std::slice::from_ref(&r));
                }
                Ok(Vec::new())
            }
            Acquired::Full { key, .. } | Acquired::Crowded { key } => {
                Err(self.full(eval, key, into))
            }
        }
    }

    /// The 429 of full key `key` of `eval`, with the reports gathered so far.
    fn full(&mut self, eval: &Evaluation, key: usize, into: &mut Vec<Report>) -> Verdict {
        let mut reports = std::mem::take(into);
        if let Some(b) = eval.in_flight.get(key) {
            reports.push(self.slot_report(b, self.slots_of(b), false));
        }
        self.too_many(&reports)
    }

    /// The slots of bucket `b`'s rule and variant.
    fn slots_of(&self, b: &Bucket) -> u64 {
        self.plan
            .limits(b.rule, b.variant)
            .first()
            .map_or(0, |(l, _)| l.capacity)
    }

    /// What the headers show of a concurrency limit: the slots left, and
    /// for a full one a wait of a second.
    fn slot_report(&self, b: &Bucket, in_flight: u64, allowed: bool) -> Report {
        let slots = self.slots_of(b);
        Report {
            rule: b.rule,
            variant: b.variant,
            limit: 0,
            check: limiter::Seen {
                allowed,
                remaining: slots.saturating_sub(in_flight),
                reset_ns: if allowed { 0 } else { RETRY_NS },
                retry_after_ns: if allowed { 0 } else { RETRY_NS },
            },
            used_share: 0.0,
            blocked: false,
            cost: 1,
            enforced: None,
        }
    }
}

/// Gives the slots back; what to count.
pub fn release(plan: &Plan, store: &impl SharedStore, slots: &[Slot], now_ns: u64) -> Counts {
    let mut counts = Counts::default();
    if slots.is_empty() {
        return counts;
    }
    match in_flight::release(store, &plan.in_flight, slots, now_ns) {
        Ok(stats) => counts.add(Metric::CorruptState, stats.corrupt_sets),
        Err(_) => counts.add(Metric::Errors, 1),
    }
    counts
}
