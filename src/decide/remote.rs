//! What a request's check reserved on the gateway, and its settlement: the
//! global buckets and quotas that settle from the response (a rule's
//! `cost_from` or `charge_on`, a `costs[]` entry's `cost_from` for rules
//! without a cost of their own and quotas that count cost), each moved from
//! what the check charged to the real cost once the response is known, and
//! sent to the gateway as one [`ratelimit_protocol::Settlement`] under the
//! check's reservation id. A global concurrency rule's slot is a line too:
//! reserved 1, settled to 0 when the stream ends, so the settlement that
//! holds a slot is sent then.

use crate::global::callout;
use crate::policy::plan::{Evaluation, GlobalBucket, Plan, QuotaBucket};
use ratelimit_protocol::{BucketRef, QuotaRef, Settlement};

/// The reservation id of a request: 16 hex digits of its random draw (from
/// a generator seeded per worker from the host's randomness).
pub fn reservation_id(random: u64) -> String {
    format!("{random:016x}")
}

/// Whether `eval`'s check has anything to settle on the gateway.
pub fn settles(plan: &Plan, eval: &Evaluation) -> bool {
    eval.global
        .iter()
        .any(|g| bucket_meter(plan, eval, g).is_some())
        || eval
            .quotas
            .iter()
            .any(|q| quota_meter(plan, eval, q).is_some())
}

/// How a global bucket settles: `Some(meter)` reads its real cost,
/// `Some(None)` only gives it back: for a status its rule's `charge_on`
/// leaves out, or, for a concurrency rule, when the stream ends.
fn bucket_meter(plan: &Plan, eval: &Evaluation, g: &GlobalBucket) -> Option<Option<usize>> {
    let rule = plan.rules.get(g.rule)?;
    let meter = plan.meter_of(g.rule, eval.cost_meter);
    (meter.is_some() || rule.charge_on.is_some() || rule.in_flight).then_some(meter)
}

/// A quota that counts cost settles by the `costs[]` entry's meter.
fn quota_meter(plan: &Plan, eval: &Evaluation, q: &QuotaBucket) -> Option<usize> {
    let counts_cost = plan.quotas.get(q.quota).is_some_and(|p| p.counts_cost());
    counts_cost.then_some(eval.cost_meter).flatten()
}

/// A reservation the gateway holds for an admitted request.
#[derive(Debug, Clone, PartialEq)]
pub struct Reserved {
    id: String,
    buckets: Vec<(GlobalBucket, Option<usize>)>,
    quotas: Vec<(QuotaBucket, usize)>,
}

impl Reserved {
    /// What `eval`'s allowed check, made under `id`, has to settle.
    pub fn new(plan: &Plan, eval: &Evaluation, id: String) -> Option<Reserved> {
        let buckets: Vec<_> = eval
            .global
            .iter()
            .filter_map(|g| Some((g.clone(), bucket_meter(plan, eval, g)?)))
            .collect();
        let quotas: Vec<_> = eval
            .quotas
            .iter()
            .filter_map(|q| Some((q.clone(), quota_meter(plan, eval, q)?)))
            .collect();
        (!buckets.is_empty() || !quotas.is_empty()).then_some(Reserved {
            id,
            buckets,
            quotas,
        })
    }
}

/// A reservation on its way to its settlement: the real cost of each line,
/// once known.
#[derive(Debug)]
pub struct Open {
    reserved: Reserved,
    /// Per bucket, then per quota: the real cost, once known.
    real: Vec<Option<u64>>,
}

impl Open {
    /// Nothing known yet.
    pub fn new(reserved: Reserved) -> Open {
        let n = reserved.buckets.len() + reserved.quotas.len();
        Open {
            reserved,
            real: vec![None; n],
        }
    }

    /// The lines still open: (index, rule for a bucket, meter, reserved).
    fn lines(&self) -> impl Iterator<Item = (usize, Option<usize>, Option<usize>, u64)> + '_ {
        let buckets = self
            .reserved
            .buckets
            .iter()
            .map(|(g, m)| (Some(g.rule), *m, g.cost));
        let quotas = self
            .reserved
            .quotas
            .iter()
            .map(|(q, m)| (None, Some(*m), q.amount));
        buckets
            .chain(quotas)
            .enumerate()
            .filter(|(i, _)| self.real.get(*i).is_some_and(Option::is_none))
            .map(|(i, (rule, meter, reserved))| (i, rule, meter, reserved))
    }

    fn set(&mut self, lines: Vec<usize>, real: impl Fn(u64) -> u64) {
        for i in lines {
            let reserved = self.reserved_at(i);
            if let Some(slot) = self.real.get_mut(i) {
                *slot = Some(real(reserved));
            }
        }
    }

    fn reserved_at(&self, i: usize) -> u64 {
        let n = self.reserved.buckets.len();
        match self.reserved.buckets.get(i) {
            Some((g, _)) => g.cost,
            None => self
                .reserved
                .quotas
                .get(i.saturating_sub(n))
                .map_or(0, |(q, _)| q.amount),
        }
    }

    /// The meters of the lines still open.
    pub fn meters(&self) -> impl Iterator<Item = usize> + '_ {
        self.lines().filter_map(|(_, _, meter, _)| meter)
    }

    /// The buckets of rules `uncharged` says the response does not charge
    /// give their whole charge back.
    pub fn refund_uncharged(&mut self, uncharged: impl Fn(usize) -> bool) {
        let lines = self
            .lines()
            .filter(|(_, rule, _, _)| rule.is_some_and(&uncharged))
            .map(|(i, ..)| i)
            .collect();
        self.set(lines, |_| 0);
    }

    /// The open lines of concurrency rules: the slots still held.
    fn slots<'a>(&'a self, plan: &'a Plan) -> impl Iterator<Item = usize> + 'a {
        self.lines()
            .filter(|(_, rule, _, _)| {
                rule.and_then(|r| plan.rules.get(r))
                    .is_some_and(|r| r.in_flight)
            })
            .map(|(i, ..)| i)
    }

    /// Whether a concurrency slot is still held: the settlement then waits
    /// for the end of the stream.
    pub fn holds_slots(&self, plan: &Plan) -> bool {
        self.slots(plan).next().is_some()
    }

    /// The stream ended: its concurrency slots are released (real cost 0).
    pub fn release_slots(&mut self, plan: &Plan) {
        let lines = self.slots(plan).collect();
        self.set(lines, |_| 0);
    }

    /// The lines of meter `m` cost `real` (`None`: what they reserved).
    pub fn settle(&mut self, m: usize, real: Option<u64>) {
        let lines = self
            .lines()
            .filter(|(_, _, meter, _)| *meter == Some(m))
            .map(|(i, ..)| i)
            .collect();
        self.set(lines, |reserved| real.unwrap_or(reserved));
    }

    /// The settlement to send: every line still open keeps what it
    /// reserved. Every line is named, a real cost equal to its reservation
    /// too: the gateway then deletes the record (found in the slot of the
    /// keys named) instead of keeping it for `--reservation-ttl`.
    pub fn close(self, plan: &Plan) -> Option<Settlement> {
        let n = self.reserved.buckets.len();
        let real =
            |i: usize, reserved: u64| self.real.get(i).copied().flatten().unwrap_or(reserved);
        let buckets: Vec<BucketRef> = self
            .reserved
            .buckets
            .iter()
            .enumerate()
            .filter_map(|(i, (g, _))| callout::bucket_ref(plan, g, real(i, g.cost)))
            .collect();
        let quotas: Vec<QuotaRef> = self
            .reserved
            .quotas
            .iter()
            .enumerate()
            .filter_map(|(j, (q, _))| callout::quota_ref(plan, q, real(n + j, q.amount)))
            .collect();
        (!buckets.is_empty() || !quotas.is_empty()).then_some(Settlement {
            reservation: self.reserved.id,
            buckets,
            quotas,
        })
    }
}
