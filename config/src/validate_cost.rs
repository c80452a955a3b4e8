//! Validation of costs against capacities: a request whose cost is above
//! the capacity of a rule it matches is a 429 for ever, so a configuration
//! where a cost can meet such a rule is refused, naming both fields.
//!
//! Two matches "can meet" unless they provably cannot: different exact
//! paths, path prefixes neither of which starts the other, disjoint method
//! lists, or one header required with two different values. Anything else
//! is taken as overlapping, so the check errs on refusing. Only a rule's
//! own `limits` are held to it: a tier's or a client's smaller limit is the
//! operator's choice, and its requests get a 429 that says it can never
//! pass (`respond::problem::never_passes`), without a `Retry-After`.

use super::*;

impl Config {
    pub(super) fn validate_costs_fit(&self) -> Result<(), ConfigError> {
        for (i, rule) in self.rules.iter().enumerate() {
            // A request holds one slot of a concurrency rule, whatever it costs.
            if rule.mode == Mode::Shadow || rule.is_concurrent() {
                continue;
            }
            let Some((k, smallest)) = smallest_limit(&rule.limits) else {
                continue;
            };
            let too_big = |cost: u64, field: String| {
                ConfigError::field(
                    field,
                    format!(
                        "{cost} is above rules[{i}].limits[{k}].requests ({smallest}), the \
                         capacity of rule {:?}, which it can match: such a request could never pass",
                        rule.name
                    ),
                )
            };
            if let Some(cost) = rule.cost {
                if cost > smallest {
                    return Err(too_big(cost, format!("rules[{i}].cost")));
                }
                continue;
            }
            if let Some(from) = &rule.cost_from {
                if from.reserve.upfront() > smallest {
                    return Err(too_big(
                        from.reserve.upfront(),
                        from.reserve.field(&format!("rules[{i}].cost_from")),
                    ));
                }
                continue;
            }
            let everything = Match::default();
            let rule_match = rule.matches.as_ref().unwrap_or(&everything);
            for (c, cost) in self.costs.iter().enumerate() {
                let (upfront, field) = match (&cost.cost_from, cost.cost) {
                    (Some(from), _) => (
                        from.reserve.upfront(),
                        from.reserve.field(&format!("costs[{c}].cost_from")),
                    ),
                    (None, n) => (n.unwrap_or(1), format!("costs[{c}].cost")),
                };
                if upfront > smallest && may_meet(rule_match, &cost.matches) {
                    return Err(too_big(upfront, field));
                }
            }
        }
        Ok(())
    }
}

/// The index and `requests` of the smallest of `limits`.
fn smallest_limit(limits: &[LimitSpec]) -> Option<(usize, u64)> {
    limits
        .iter()
        .enumerate()
        .map(|(k, l)| (k, l.requests))
        .min_by_key(|&(_, r)| r)
}

/// Whether one request could satisfy both `a` and `b`.
pub(super) fn may_meet(a: &Match, b: &Match) -> bool {
    paths_may_meet(a, b) && methods_may_meet(a, b) && headers_may_meet(a, b)
}

fn paths_may_meet(a: &Match, b: &Match) -> bool {
    let starts = |path: &str, prefix: &Option<String>| {
        prefix.as_ref().is_none_or(|p| path.starts_with(p.as_str()))
    };
    match (&a.path_exact, &b.path_exact) {
        (Some(x), Some(y)) => x == y,
        (Some(x), None) => starts(x, &b.path_prefix),
        (None, Some(y)) => starts(y, &a.path_prefix),
        (None, None) => match (&a.path_prefix, &b.path_prefix) {
            (Some(x), Some(y)) => x.starts_with(y.as_str()) || y.starts_with(x.as_str()),
            _ => true,
        },
    }
}

fn methods_may_meet(a: &Match, b: &Match) -> bool {
    match (&a.methods, &b.methods) {
        (Some(x), Some(y)) => x
            .iter()
            .any(|m| y.iter().any(|n| m.eq_ignore_ascii_case(n))),
        _ => true,
    }
}

fn headers_may_meet(a: &Match, b: &Match) -> bool {
    a.headers
        .iter()
        .all(|(name, value)| b.headers.get(name).is_none_or(|v| v == value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(json: &str) -> Match {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn matches_meet_unless_provably_disjoint() {
        let any = m("{}");
        let export = m(r#"{"path_prefix":"/export"}"#);
        assert!(may_meet(&any, &export));
        assert!(may_meet(&m(r#"{"path_prefix":"/ex"}"#), &export));
        assert!(!may_meet(&m(r#"{"path_prefix":"/upload"}"#), &export));
        assert!(!may_meet(&m(r#"{"path_exact":"/exp"}"#), &export));
        assert!(may_meet(&m(r#"{"path_exact":"/export/all"}"#), &export));
        assert!(!may_meet(
            &m(r#"{"path_exact":"/a"}"#),
            &m(r#"{"path_exact":"/b"}"#)
        ));
        assert!(!may_meet(
            &m(r#"{"methods":["POST"]}"#),
            &m(r#"{"methods":["GET","HEAD"]}"#)
        ));
        assert!(may_meet(
            &m(r#"{"methods":["post"]}"#),
            &m(r#"{"methods":["POST"]}"#)
        ));
        assert!(!may_meet(
            &m(r#"{"headers":{"x-a":"1"}}"#),
            &m(r#"{"headers":{"x-a":"2"}}"#)
        ));
        assert!(may_meet(
            &m(r#"{"headers":{"x-a":"1"}}"#),
            &m(r#"{"headers":{"x-b":"2"}}"#)
        ));
    }
}
