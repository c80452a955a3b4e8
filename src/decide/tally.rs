//! The counts a worker keeps between two flushes. No request makes a metric
//! host call: its decision, its body and its response add here, and the
//! root context's tick hands the sums to the host ([`Tally::drain`]), so a
//! counter in Envoy is at most one tick behind.
//!
//! Besides the decisions' [`Counts`], a decision counts per rule (allowed,
//! denied, shadow-denied, near its limit) and per quota (spent), read from
//! its [`Outcome`]: the labels come from the configuration, never from a
//! client, so their number stays the configuration's. The host defines a
//! global rule's local stand-in with its global rule's counters.

use super::{Counts, Outcome, Verdict};
use crate::limits::limiter::Report;
use crate::metrics::{Background, BodyMetric, Metric, RuleMetric};
use crate::policy::plan::Plan;

/// A rule's or a quota's part in refusing one request, for the per-rule
/// counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Rule `n` (an index into [`Plan::rules`]) refused it.
    Denied(u32, Left),
    /// Rule `n` would have refused it, but only watches.
    ShadowDenied(u32, Left),
    /// Quota `n` (an index into [`Plan::quotas`]) was spent.
    Spent(u32, Left),
}

/// What the refusing limit (or quota) held and what the request asked of
/// it, for the access log ([`super::why`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Left {
    /// Tokens (or quota amount) left, before the request.
    pub remaining: u64,
    /// What the request asked.
    pub cost: u64,
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
    /// A counter of rule `n` of the plan (a stand-in's are its global
    /// rule's).
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
    /// Per rule of the plan (a stand-in too: the host counts it under its
    /// global rule), [`RuleMetric::ALL`] counts in a row.
    rules: Vec<u64>,
    quotas: Vec<u64>,
    near_limit: f64,
    /// The most tokens left with which one of the plan's limits is near.
    nearest: u64,
    /// Something was added since the last drain.
    dirty: bool,
}

impl Tally {
    /// Empty counts for `plan`'s rules and quotas.
    pub fn new(plan: &Plan) -> Tally {
        Tally {
            rules: vec![0; plan.rules.len() * RuleMetric::ALL.len()],
            quotas: vec![0; plan.quotas.len()],
            near_limit: plan.near_limit,
            nearest: plan
                .rules
                .iter()
                .flat_map(|r| &r.variants)
                .flat_map(|v| &v.limits)
                .filter(|(l, _)| l.capacity > 0)
                .map(|(l, _)| ((1.0 - plan.near_limit) * l.capacity as f64) as u64)
                .max()
                .unwrap_or(0),
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
                Refusal::Denied(n, _) => self.rule(n as usize, RuleMetric::Denied),
                Refusal::ShadowDenied(n, _) => self.rule(n as usize, RuleMetric::ShadowDenied),
                Refusal::Spent(n, _) => {
                    if let Some(v) = self.quotas.get_mut(n as usize) {
                        *v = v.saturating_add(1);
                        self.dirty = true;
                    }
                }
            }
        }
    }

    /// An admitted request: each rule that reported counts it allowed
    /// once, and near its limit once when one of its limits is (a rule's
    /// reports are adjacent: one per limit of its bucket).
    fn admitted(&mut self, plan: &Plan, reports: &[Report]) {
        let (mut seen, mut near) = (usize::MAX, usize::MAX);
        for r in reports {
            if r.rule != seen {
                seen = r.rule;
                if r.check.allowed {
                    self.rule(r.rule, RuleMetric::Allowed);
                }
            }
            if r.rule != near && self.is_near(plan, r) {
                near = r.rule;
                self.rule(r.rule, RuleMetric::NearLimit);
            }
        }
    }

    /// Whether an allowed limit has used at least the near-limit share.
    fn is_near(&self, plan: &Plan, r: &Report) -> bool {
        let capacity = match r.enforced {
            Some(e) => e.requests,
            // More left than any of this filter's limits is near with: not near.
            None if r.check.remaining > self.nearest => return false,
            None => plan
                .limits(r.rule, r.variant)
                .get(r.limit)
                .map_or(0, |(l, _)| l.capacity),
        };
        r.check.allowed && capacity > 0 && near(r.check.remaining, capacity, self.near_limit)
    }

    fn rule(&mut self, rule: usize, m: RuleMetric) {
        let i = rule * RuleMetric::ALL.len() + m.index();
        if let Some(v) = self.rules.get_mut(i) {
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
        let per_rule = RuleMetric::ALL.iter().cycle();
        for (i, (m, v)) in per_rule.zip(&mut self.rules).enumerate() {
            each(Counter::Rule(i / RuleMetric::ALL.len(), *m), v);
        }
        for (quota, v) in self.quotas.iter_mut().enumerate() {
            each(Counter::Quota(quota), v);
        }
    }
}

/// Whether `remaining` of `capacity` is at least `share` used.
fn near(remaining: u64, capacity: u64, share: f64) -> bool {
    remaining as f64 <= (1.0 - share) * capacity as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        let json = r#"{"domain":"d","metrics":{"near_limit":0.75},"rules":[
            {"name":"a","limits":[{"requests":8,"per":"1m"}]},
            {"name":"b","limits":[{"requests":100,"per":"1h"}]}]}"#;
        Plan::compile(&crate::config::parse(json.as_bytes()).unwrap(), [0; 16])
    }

    fn drained(t: &mut Tally) -> Vec<(Counter, u64)> {
        let mut out = Vec::new();
        t.drain(|c, n| out.push((c, n)));
        out
    }

    #[test]
    fn near_is_at_least_the_share_used_and_the_fast_bound_is_the_largest_limits() {
        assert!(near(2, 8, 0.75));
        assert!(!near(3, 8, 0.75));
        assert!(near(0, 1, 0.8));
        let t = Tally::new(&plan());
        // 25 of 100 left is near; nothing past it is, for any limit.
        assert_eq!(t.nearest, 25);
    }

    #[test]
    fn drain_hands_each_sum_once_then_nothing() {
        let p = plan();
        let mut t = Tally::new(&p);
        assert!(drained(&mut t).is_empty());
        t.body(&[BodyMetric::ReserveRead, BodyMetric::ReserveRead]);
        t.background(Background::GlobalSettled, 3);
        t.background(Background::GlobalSettleFailed, 0);
        t.rule(1, RuleMetric::Denied);
        t.rule(1, RuleMetric::Denied);
        t.rule(9, RuleMetric::Denied); // no such rule: ignored
        assert_eq!(
            drained(&mut t),
            [
                (Counter::Body(BodyMetric::ReserveRead), 2),
                (Counter::Background(Background::GlobalSettled), 3),
                (Counter::Rule(1, RuleMetric::Denied), 2),
            ]
        );
        assert!(drained(&mut t).is_empty());
    }
}
