//! The counts a worker keeps between two flushes. No request makes a metric
//! host call: its decision, its body and its response add here, and the
//! root context's tick hands the sums to the host ([`Tally::drain`]), so a
//! counter in Envoy is at most one tick behind.
//!
//! Besides the decisions' [`Counts`], a decision counts per rule (allowed,
//! denied, shadow-denied, near its limit) and per quota (spent), read from
//! its [`Outcome`]: the labels come from the configuration, never from a
//! client, so their number stays the configuration's.

use super::{Counts, Outcome, Verdict};
use crate::limits::limiter::Report;
use crate::metrics::{Background, BodyMetric, Metric, RuleMetric};
use crate::policy::plan::Plan;

/// A rule's or a quota's part in refusing one request, for the per-rule
/// counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Rule `n` (an index into [`Plan::rules`]) refused it.
    Denied(u32),
    /// Rule `n` would have refused it, but only watches.
    ShadowDenied(u32),
    /// Quota `n` (an index into [`Plan::quotas`]) was spent.
    Spent(u32),
}

/// A counter the drained sums go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// A decision's counter.
    Decision(Metric),
    /// A request body's counter.
    Body(BodyMetric),
    /// The root context's own.
    Background(Background),
    /// A counter of rule `n` (a rule of the configuration, never a stand-in).
    Rule(usize, RuleMetric),
    /// The spent counter of quota `n`.
    Quota(usize),
}

/// One worker's counts since the last flush.
#[derive(Debug, Default)]
pub struct Tally {
    decisions: [u64; Metric::ALL.len()],
    body: [u64; BodyMetric::ALL.len()],
    background: [u64; Background::ALL.len()],
    rules: Vec<[u64; RuleMetric::ALL.len()]>,
    quotas: Vec<u64>,
    /// Per rule of the plan, the rule its counts go to: a global rule's
    /// local stand-in counts as its global rule.
    owner: Vec<usize>,
    near_limit: f64,
    /// Something was added since the last drain.
    dirty: bool,
}

impl Tally {
    /// Empty counts for `plan`'s rules and quotas.
    pub fn new(plan: &Plan) -> Tally {
        let mut owner: Vec<usize> = (0..plan.rules.len()).collect();
        for (i, r) in plan.rules.iter().enumerate() {
            if let Some(slot) = r.fallback.and_then(|f| owner.get_mut(f)) {
                *slot = i;
            }
        }
        Tally {
            rules: vec![[0; RuleMetric::ALL.len()]; plan.rules.len()],
            quotas: vec![0; plan.quotas.len()],
            owner,
            near_limit: plan.near_limit,
            ..Tally::default()
        }
    }

    /// Adds a decision's (or a response phase's) counts.
    pub fn counts(&mut self, c: &Counts) {
        for (i, n) in c.counted() {
            if let Some(v) = self.decisions.get_mut(i) {
                *v = v.saturating_add(n);
                self.dirty = true;
            }
        }
    }

    /// Adds one to each of a request body's `metrics`.
    pub fn body(&mut self, metrics: &[BodyMetric]) {
        for m in metrics {
            if let Some(v) = self.body.get_mut(m.index()) {
                *v = v.saturating_add(1);
                self.dirty = true;
            }
        }
    }

    /// Adds `n` to one of the root context's counters.
    pub fn background(&mut self, m: Background, n: u64) {
        let i = Background::ALL.iter().position(|x| *x == m);
        if let Some(v) = i.and_then(|i| self.background.get_mut(i)) {
            *v = v.saturating_add(n);
            self.dirty |= n > 0;
        }
    }

    /// Adds a decision's counts and its per-rule and per-quota counts.
    pub fn outcome(&mut self, plan: &Plan, o: &Outcome) {
        self.counts(&o.counts);
        if let Verdict::Pass(p) | Verdict::Delay { headers: p, .. } = &o.verdict {
            self.admitted(plan, &p.reports);
        }
        for r in &o.refusals {
            match *r {
                Refusal::Denied(n) => self.rule(n as usize, RuleMetric::Denied),
                Refusal::ShadowDenied(n) => self.rule(n as usize, RuleMetric::ShadowDenied),
                Refusal::Spent(n) => {
                    if let Some(v) = self.quotas.get_mut(n as usize) {
                        *v = v.saturating_add(1);
                        self.dirty = true;
                    }
                }
            }
        }
    }

    /// An admitted request: each rule that reported counts it allowed
    /// once, and near its limit once when one of its limits is.
    fn admitted(&mut self, plan: &Plan, reports: &[Report]) {
        // A rule's reports are adjacent: one per limit of its bucket.
        let mut i = 0;
        while let Some(first) = reports.get(i) {
            let rule = first.rule;
            let run = reports
                .get(i..)
                .unwrap_or_default()
                .iter()
                .take_while(|r| r.rule == rule);
            let mut n = 0;
            let mut near = false;
            for r in run {
                n += 1;
                near |= self.is_near(plan, r);
            }
            if first.check.allowed {
                self.rule(rule, RuleMetric::Allowed);
            }
            if near {
                self.rule(rule, RuleMetric::NearLimit);
            }
            i += n;
        }
    }

    /// Whether an allowed limit has used at least the near-limit share.
    fn is_near(&self, plan: &Plan, r: &Report) -> bool {
        let capacity = match r.enforced {
            Some(e) => e.requests,
            None => plan
                .limits(r.rule, r.variant)
                .get(r.limit)
                .map_or(0, |(l, _)| l.capacity),
        };
        r.check.allowed
            && capacity > 0
            && r.check.remaining as f64 <= (1.0 - self.near_limit) * capacity as f64
    }

    fn rule(&mut self, rule: usize, m: RuleMetric) {
        let owner = self.owner.get(rule).copied().unwrap_or(rule);
        if let Some(v) = self.rules.get_mut(owner).and_then(|c| c.get_mut(m.index())) {
            *v = v.saturating_add(1);
            self.dirty = true;
        }
    }

    /// Hands every sum above 0 to `add` and starts again from 0; nothing
    /// when nothing was added since the last drain.
    pub fn drain(&mut self, mut add: impl FnMut(Counter, u64)) {
        if !std::mem::take(&mut self.dirty) {
            return;
        }
        let mut each = |counter: Counter, v: &mut u64| {
            let n = std::mem::take(v);
            if n > 0 {
                add(counter, n);
            }
        };
        for (m, v) in Metric::ALL.iter().zip(&mut self.decisions) {
            each(Counter::Decision(*m), v);
        }
        for (m, v) in BodyMetric::ALL.iter().zip(&mut self.body) {
            each(Counter::Body(*m), v);
        }
        for (m, v) in Background::ALL.iter().zip(&mut self.background) {
            each(Counter::Background(*m), v);
        }
        for (rule, counts) in self.rules.iter_mut().enumerate() {
            for (m, v) in RuleMetric::ALL.iter().zip(counts) {
                each(Counter::Rule(rule, *m), v);
            }
        }
        for (quota, v) in self.quotas.iter_mut().enumerate() {
            each(Counter::Quota(quota), v);
        }
    }
}
