//! The `RateLimit-Policy` list of every rule's own limits, and the start of
//! each one's `RateLimit` item, written once at configure time. A response
//! checked against a run of those limits (every rule, when no rule has a
//! matcher that left it out) borrows its `RateLimit-Policy` from here
//! instead of copying each item, and reads each `RateLimit` item's start
//! without looking its rule up: wasmtime charges a copy one instruction a
//! byte, and c4's eight items are 321 bytes.

use crate::limits::limiter::Report;
use crate::policy::plan::RulePlan;

/// Every rule's own limits (variant 0) as one `RateLimit-Policy` value, in
/// plan order, with where each item lies in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyList {
    /// The items, `, ` between them.
    text: String,
    /// For each rule, the index in `items` of its first limit.
    first: Vec<usize>,
    /// Each limit listed, in order.
    items: Vec<Item>,
}

/// One limit of [`PolicyList`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    rule: usize,
    limit: usize,
    /// Where its policy item lies in the list's text.
    start: usize,
    end: usize,
    /// The start of its `RateLimit` item after an earlier one, up to the
    /// remaining: `, <name>;r=`.
    state: Box<[u8]>,
}

impl Item {
    /// The start of the limit's `RateLimit` item after an earlier one, up to
    /// the remaining: `, <name>;r=`.
    pub fn listed_state(&self) -> &[u8] {
        &self.state
    }

    /// Whether `r` reports this limit: of this filter's own limits (not one
    /// the gateway stated), of the rule's own variant.
    pub fn lists(&self, r: &Report) -> bool {
        r.rule == self.rule && r.limit == self.limit && r.variant == 0 && r.enforced.is_none()
    }
}

impl PolicyList {
    /// The list of the own limits of `rules`, in order.
    pub fn new(rules: &[RulePlan]) -> PolicyList {
        let mut list = PolicyList::default();
        for (rule, plan) in rules.iter().enumerate() {
            list.first.push(list.items.len());
            let texts = plan.variants.first().map_or(&[][..], |v| &v.texts[..]);
            for (limit, text) in texts.iter().enumerate() {
                if !list.text.is_empty() {
                    list.text.push_str(", ");
                }
                let start = list.text.len();
                list.text.push_str(text.policy());
                list.items.push(Item {
                    rule,
                    limit,
                    start,
                    end: list.text.len(),
                    state: text.listed_state().as_bytes().into(),
                });
            }
        }
        list
    }

    /// The items `reports` are when they are a run of the list, one for
    /// each, from the first report's on; each must still be checked
    /// ([`Item::lists`]), which the caller does as it writes. `None` when
    /// the list has no such run, and for no report.
    pub fn items_from(&self, reports: &[Report]) -> Option<&[Item]> {
        let first = reports.first()?;
        let at = self.first.get(first.rule)?.checked_add(first.limit)?;
        self.items.get(at..at.checked_add(reports.len())?)
    }

    /// The `RateLimit-Policy` value of `items`, a run of this list (bytes:
    /// a `str` would check its ends are on characters, which they are).
    pub fn text_of(&self, items: &[Item]) -> Option<&[u8]> {
        self.text
            .as_bytes()
            .get(items.first()?.start..items.last()?.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::limits::limiter::{Enforced, Seen};
    use crate::policy::plan::Plan;

    fn plan() -> Plan {
        let json = r#"{"domain":"d",
            "identity":{"default_tier":"free"},"tiers":{"free":{},"gold":{}},
            "rules":[
            {"name":"a","limits":[{"requests":60,"per":"1m"},{"requests":10,"per":"1s"}]},
            {"name":"b","limits":[{"requests":5,"per":"1m"}],
             "tiers":{"gold":[{"requests":50,"per":"1m"}]}},
            {"name":"c","limits":[{"concurrent":4}]}]}"#;
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [0; 16])
    }

    /// What the headers send as `RateLimit-Policy` from the list: the text
    /// of the run `reports` are, when they are one.
    fn run<'a>(list: &'a PolicyList, reports: &[Report]) -> Option<&'a str> {
        let items = list.items_from(reports)?;
        let listed = reports.iter().zip(items).all(|(r, item)| item.lists(r));
        let text = listed.then(|| list.text_of(items)).flatten()?;
        std::str::from_utf8(text).ok()
    }

    fn report(rule: usize, limit: usize) -> Report {
        Report {
            rule,
            variant: 0,
            limit,
            check: Seen {
                allowed: true,
                remaining: 1,
                reset_ns: 0,
                retry_after_ns: 0,
            },
            used_share: 0.0,
            blocked: false,
            cost: 1,
            enforced: None,
        }
    }

    #[test]
    fn a_run_of_own_limits_in_plan_order_is_borrowed() {
        let p = plan();
        let list = PolicyList::new(&p.rules);
        let all = [report(0, 0), report(0, 1), report(1, 0), report(2, 0)];
        assert_eq!(
            run(&list, &all),
            Some(
                "\"a\";q=60;w=60, \"a/1\";q=10;w=1, \"b\";q=5;w=60, \
                 \"c\";q=4;qu=\"concurrent-requests\""
            )
        );
        assert_eq!(
            run(&list, &all[1..3]),
            Some("\"a/1\";q=10;w=1, \"b\";q=5;w=60")
        );
        assert_eq!(
            run(&list, &all[3..]),
            Some("\"c\";q=4;qu=\"concurrent-requests\"")
        );
        let items = list.items_from(&all[1..]).unwrap();
        let states: Vec<&[u8]> = items.iter().map(Item::listed_state).collect();
        assert_eq!(states, [&b", \"a/1\";r="[..], b", \"b\";r=", b", \"c\";r="]);
    }

    #[test]
    fn anything_else_is_not_a_run() {
        let p = plan();
        let list = PolicyList::new(&p.rules);
        assert_eq!(run(&list, &[]), None);
        // A gap, another order, a repeat.
        assert_eq!(run(&list, &[report(0, 0), report(1, 0)]), None);
        assert_eq!(run(&list, &[report(1, 0), report(0, 0)]), None);
        assert_eq!(run(&list, &[report(1, 0), report(1, 0)]), None);
        // A tier's limits, a limit the gateway stated.
        let mut gold = report(1, 0);
        gold.variant = 1;
        assert_eq!(run(&list, &[report(0, 1), gold]), None);
        let mut stated = report(1, 0);
        stated.enforced = Some(Enforced {
            requests: 7,
            window_ms: 60_000,
        });
        assert_eq!(run(&list, &[stated]), None);
        // Past the end, a rule or limit the plan does not have.
        assert_eq!(run(&list, &[report(2, 0), report(3, 0)]), None);
        assert_eq!(run(&list, &[report(2, 1)]), None);
        assert_eq!(run(&list, &[report(9, 0)]), None);
    }
}
