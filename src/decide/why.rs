//! A decision as Envoy's access log reads it: one line of `key=value`
//! fields, in a fixed order, that the host sets as the filter state
//! [`FILTER_STATE`] (`%FILTER_STATE(wasm.ratelimit:PLAIN)%` in an access
//! log format). Every value is a word of the vocabularies below, a number,
//! or a rule's or quota's name from the configuration (plain names:
//! letters, digits and `-_.:`), never text from the request; `-` stands
//! for a field that does not apply.
//!
//! `outcome=denied rule=per-client remaining=0 cost=1 source=local`

use super::{Outcome, Refusal, Verdict};
use crate::limits::limiter::Report;
use crate::metrics::Metric;
use crate::policy::plan::Plan;
use crate::respond::headers;

/// The property the host sets; Envoy keeps it as filter state
/// `wasm.ratelimit`.
pub const FILTER_STATE: &str = "ratelimit";

/// What happened to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Said {
    /// Let through.
    Allowed,
    /// Let through after a graduated rule's `delay_ms`.
    Delayed,
    /// Let through, though a rule that only watches (a shadow rule, or any
    /// rule for a soft client) would have refused it.
    ShadowDenied,
    /// 429: a limit refused it.
    Denied,
    /// 403: a quota is spent.
    QuotaExhausted,
    /// 503: the gateway failed under `failure_mode: closed`.
    Unavailable,
}

/// What answered the request's global rules and quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// This proxy alone: the request has no global rule or quota, or a
    /// local rule refused it before the gateway was asked.
    Local,
    /// A lease batch, without a callout.
    Lease,
    /// The deny cache, without a callout.
    DenyCache,
    /// The gateway's answer.
    Gateway,
    /// No usable answer (or the circuit open): `failure_mode: open`.
    FailureOpen,
    /// No usable answer (or the circuit open): `failure_mode: closed`.
    FailureClosed,
    /// No usable answer (or the circuit open): `failure_mode: local`.
    FailureLocal,
}

impl Said {
    /// Every outcome, in the order of the docs.
    pub const ALL: [Said; 6] = [
        Said::Allowed,
        Said::Delayed,
        Said::ShadowDenied,
        Said::Denied,
        Said::QuotaExhausted,
        Said::Unavailable,
    ];

    /// The outcome's word in the line.
    pub fn name(self) -> &'static str {
        match self {
            Said::Allowed => "allowed",
            Said::Delayed => "delayed",
            Said::ShadowDenied => "shadow_denied",
            Said::Denied => "denied",
            Said::QuotaExhausted => "quota_exhausted",
            Said::Unavailable => "unavailable",
        }
    }
}

impl Source {
    /// Every source, in the order of the docs.
    pub const ALL: [Source; 7] = [
        Source::Local,
        Source::Lease,
        Source::DenyCache,
        Source::Gateway,
        Source::FailureOpen,
        Source::FailureClosed,
        Source::FailureLocal,
    ];

    /// The source's word in the line.
    pub fn name(self) -> &'static str {
        match self {
            Source::Local => "local",
            Source::Lease => "lease",
            Source::DenyCache => "deny_cache",
            Source::Gateway => "gateway",
            Source::FailureOpen => "failure_open",
            Source::FailureClosed => "failure_closed",
            Source::FailureLocal => "failure_local",
        }
    }
}

/// One decision's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Why<'p> {
    /// What happened.
    pub outcome: Said,
    /// The deciding rule (or quota): the refusing one, the one that
    /// delayed, or for an allowed request the one whose limit is closest
    /// to exhaustion (the one the headers show).
    pub rule: Option<&'p str>,
    /// Tokens (or quota amount) that rule's limit had left: after the
    /// request when it was let through, before it when it was refused.
    pub remaining: Option<u64>,
    /// What the request asked of that limit.
    pub cost: Option<u64>,
    /// What answered the global rules.
    pub source: Source,
}

/// The fields of `o`, decided under `plan`; `None` when no rule or quota
/// applied to the request (nothing to say).
pub fn why<'p>(plan: &'p Plan, o: &Outcome) -> Option<Why<'p>> {
    if o.counts.get(Metric::Allowed) == 0 && o.counts.get(Metric::Denied) == 0 {
        return None;
    }
    let (outcome, rule, left) = match &o.verdict {
        Verdict::Reject { status: 503, .. } => (Said::Unavailable, None, None),
        Verdict::Reject { status: 403, .. } => refused(plan, o, Said::QuotaExhausted),
        Verdict::Reject { .. } => refused(plan, o, Said::Denied),
        Verdict::Delay { headers: h, .. } => {
            let r = delaying(plan, &h.reports);
            (
                Said::Delayed,
                r.and_then(|r| name(plan, r.rule)),
                r.map(left_of),
            )
        }
        Verdict::Pass(h) => match refused(plan, o, Said::ShadowDenied) {
            (said, Some(rule), left) => (said, Some(rule), left),
            _ => {
                let r = headers::closest_report(&h.reports);
                (
                    Said::Allowed,
                    r.and_then(|r| name(plan, r.rule)),
                    r.map(left_of),
                )
            }
        },
    };
    Some(Why {
        outcome,
        rule,
        remaining: left.map(|l| l.0),
        cost: left.map(|l| l.1),
        source: source(plan, o, outcome),
    })
}

/// The first refusal of the kind `said` names: its rule's (or quota's)
/// name and what it had left.
fn refused<'p>(
    plan: &'p Plan,
    o: &Outcome,
    said: Said,
) -> (Said, Option<&'p str>, Option<(u64, u64)>) {
    let found = o.refusals.iter().find_map(|r| match (*r, said) {
        (Refusal::Denied(n, l), Said::Denied)
        | (Refusal::ShadowDenied(n, l), Said::ShadowDenied) => Some((name(plan, n as usize), l)),
        (Refusal::Spent(n, l), Said::QuotaExhausted) => {
            Some((plan.quotas.get(n as usize).map(|q| q.name.as_str()), l))
        }
        _ => None,
    });
    match found {
        Some((rule, l)) => (said, rule, Some((l.remaining, l.cost))),
        None => (said, None, None),
    }
}

fn name(plan: &Plan, rule: usize) -> Option<&str> {
    plan.rules.get(rule).map(|r| r.name.as_str())
}

fn left_of(r: &Report) -> (u64, u64) {
    (r.check.remaining, r.cost)
}

/// The report whose graduated rule set the request's delay: the longest
/// `delay_ms` among the limits past their `delay_at`.
fn delaying<'r>(plan: &Plan, reports: &'r [Report]) -> Option<&'r Report> {
    reports
        .iter()
        .filter_map(|r| {
            let g = plan.rules.get(r.rule)?.graduated.as_ref()?;
            g.delays(r.used_share).then_some((r, g.delay_ms))
        })
        .max_by_key(|(_, ms)| *ms)
        .map(|(r, _)| r)
}

/// What answered: the deny cache and a lease first (each decides without a
/// callout), then a failure mode, then the gateway; a refusal by a rule
/// that is neither global nor a global rule's stand-in is this proxy's own.
fn source(plan: &Plan, o: &Outcome, outcome: Said) -> Source {
    let c = &o.counts;
    let local_refusal = matches!(outcome, Said::Denied | Said::ShadowDenied)
        && o.refusals
            .iter()
            .find_map(|r| match *r {
                Refusal::Denied(n, _) | Refusal::ShadowDenied(n, _) => plan.rules.get(n as usize),
                Refusal::Spent(..) => None,
            })
            .is_some_and(|r| r.scope == crate::config::Scope::Local && !r.stand_in);
    if c.get(Metric::DenyCacheHits) > 0 {
        Source::DenyCache
    } else if local_refusal {
        Source::Local
    } else if c.get(Metric::LeaseServed) > 0 {
        Source::Lease
    } else if c.get(Metric::FailClosed) > 0 {
        Source::FailureClosed
    } else if c.get(Metric::FailOpen) > 0 {
        Source::FailureOpen
    } else if c.get(Metric::FallbackLocal) > 0 {
        Source::FailureLocal
    } else if c.get(Metric::GlobalCalls) > 0 {
        Source::Gateway
    } else {
        Source::Local
    }
}

/// The longest line: every word and number at its longest, a rule's name
/// at the 64 bytes a plain name may have.
pub const MAX_LINE: usize = 176;

impl Why<'_> {
    /// The line: `outcome=… rule=… remaining=… cost=… source=…`. A
    /// `String` sized once: a zeroed buffer on the stack cost c1 about 290
    /// instructions more (the zeroing and the move).
    pub fn line(&self) -> String {
        let mut out = String::with_capacity(MAX_LINE);
        let mut num = itoa::Buffer::new();
        out.push_str("outcome=");
        out.push_str(self.outcome.name());
        out.push_str(" rule=");
        out.push_str(self.rule.unwrap_or("-"));
        out.push_str(" remaining=");
        out.push_str(self.remaining.map_or("-", |n| num.format(n)));
        out.push_str(" cost=");
        out.push_str(self.cost.map_or("-", |n| num.format(n)));
        out.push_str(" source=");
        out.push_str(self.source.name());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field is present, in order, and a field that does not apply
    /// reads `-`.
    #[test]
    fn the_line_has_every_field_in_order() {
        let w = Why {
            outcome: Said::Denied,
            rule: Some("per-client"),
            remaining: Some(0),
            cost: Some(1),
            source: Source::Local,
        };
        assert_eq!(
            w.line(),
            "outcome=denied rule=per-client remaining=0 cost=1 source=local"
        );
        let w = Why {
            outcome: Said::Unavailable,
            rule: None,
            remaining: None,
            cost: None,
            source: Source::FailureClosed,
        };
        assert_eq!(
            w.line(),
            "outcome=unavailable rule=- remaining=- cost=- source=failure_closed"
        );
        let w = Why {
            remaining: Some(u64::MAX),
            cost: Some(1_000_000),
            ..w
        };
        assert_eq!(
            w.line(),
            "outcome=unavailable rule=- remaining=18446744073709551615 cost=1000000 source=failure_closed"
        );
    }

    /// The longest line fits: nothing is cut.
    #[test]
    fn the_longest_line_fits() {
        let longest = |words: &[&str]| words.iter().map(|w| w.len()).max().unwrap_or(0);
        let outcome = Said::ALL
            .iter()
            .max_by_key(|s| s.name().len())
            .copied()
            .unwrap();
        let source = Source::ALL
            .iter()
            .max_by_key(|s| s.name().len())
            .copied()
            .unwrap();
        let rule = "r".repeat(64);
        let w = Why {
            outcome,
            rule: Some(&rule),
            remaining: Some(u64::MAX),
            cost: Some(u64::MAX),
            source,
        };
        let line = w.line();
        assert!(
            line.ends_with(&format!(" source={}", source.name())),
            "{line}"
        );
        assert_eq!(
            line.len(),
            "outcome= rule= remaining= cost= source=".len()
                + longest(&Said::ALL.map(Said::name))
                + 64
                + 2 * 20
                + longest(&Source::ALL.map(Source::name))
        );
        assert!(line.len() <= MAX_LINE);
    }

    /// The words are distinct and plain: a log parser can split the line
    /// on spaces and `=`.
    #[test]
    fn the_words_are_distinct_and_plain() {
        let words: Vec<&str> = Said::ALL
            .iter()
            .map(|s| s.name())
            .chain(Source::ALL.iter().map(|s| s.name()))
            .collect();
        for w in &words {
            assert!(
                w.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{w}"
            );
        }
        let mut sorted = words.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), words.len());
    }
}
