//! The `explain` table: what each tier (each `limits_by` set, each client
//! override) gets from each rule, with each limit's `RateLimit-Policy` item (a response carries
//! one of them: the limit closest to exhaustion); then what is charged from
//! the response (`cost_from`, `charge_on`), and, given a sample response,
//! what the filter would settle for it (`charging.rs`).

use ratelimit_config::{Config, HeaderStyle, LimitSpec, LimitsSource, Mode, Rule};
use ratelimit_wasm::limits::algorithm::Algorithm;
use ratelimit_wasm::policy::plan::LimitText;
use ratelimit_wasm::respond::headers::{self, Shown};

/// One row per rule × tier (or rule × client override).
pub fn table(c: &Config) -> String {
    let mut rows = vec![[
        "rule",
        "tier",
        "limits",
        "burst",
        "cost",
        "scope",
        "algorithm",
        "mode",
        // Every limit's `RateLimit-Policy` item; a response lists the item
        // of each limit its request was checked against.
        "policy items (a response lists each)",
    ]
    .map(String::from)];
    let cost = if c.costs.is_empty() {
        "1".to_string()
    } else {
        format!("costs ({} entries, default 1)", c.costs.len())
    };
    for rule in &c.rules {
        let mut who: Vec<(String, &[LimitSpec])> = if c.tiers.is_empty() {
            vec![("*".into(), &rule.limits)]
        } else {
            c.tiers
                .keys()
                .map(|t| {
                    let tier_unlimited = c.tiers.get(t).is_some_and(|s| s.unlimited);
                    let limits: &[LimitSpec] = if tier_unlimited {
                        &[]
                    } else {
                        rule.tiers.get(t).map_or(&rule.limits, |l| l)
                    };
                    (t.clone(), limits)
                })
                .collect()
        };
        // A `limits_by` set is one row; the rule's own limits are then the
        // row of a request whose metadata names no set.
        if let Some(by) = &rule.limits_by {
            let at = match by.source() {
                Some((LimitsSource::RouteMetadata, p)) => format!("route metadata {p}"),
                Some((LimitsSource::Metadata, p)) => format!("metadata {p}"),
                None => "?".to_string(),
            };
            for (tier, _) in who.iter_mut() {
                *tier = format!("{tier}, {at} names no set");
            }
            for (name, limits) in &by.sets {
                who.push((format!("{at} is {name:?}"), limits));
            }
        }
        for (id, spec) in &c.identity.clients {
            if spec.unlimited {
                who.push((format!("client {id}"), &[]));
            } else if let Some(l) = spec.limits.get(&rule.name) {
                who.push((format!("client {id}"), l));
            }
        }
        for (tier, limits) in who {
            // A cost read from the response is not a number yet: show its range.
            let cost = match (&rule.cost_from, rule.cost) {
                (Some(f), _) => format!("from response: {}..{}", f.reserve, f.max),
                (None, Some(x)) => x.to_string(),
                (None, None) => cost.clone(),
            };
            rows.push(row(rule, &tier, limits, cost));
        }
    }
    render(&rows)
}

fn row(rule: &Rule, tier: &str, limits: &[LimitSpec], cost: String) -> [String; 9] {
    let reject_at = rule.graduated.as_ref().map_or(1.0, |g| g.reject_at);
    let slots = limits.first().and_then(|l| l.concurrent.map(|n| (n, l)));
    let (shown, burst, policy) = if limits.is_empty() {
        ("unlimited".to_string(), "-".to_string(), "-".to_string())
    } else if let Some((n, l)) = slots {
        (
            format!("{n} in flight (slot held ≤ {}s)", l.max_in_flight_secs()),
            "-".to_string(),
            LimitText::concurrent(&rule.name, n.into())
                .policy()
                .to_owned(),
        )
    } else {
        let shown = limits
            .iter()
            .map(|l| format!("{}/{}s", l.requests, l.per.0))
            .collect::<Vec<_>>();
        let burst = limits
            .iter()
            .map(|l| match rule.algorithm {
                Algorithm::TokenBucket => {
                    (((l.requests as f64) * reject_at).floor() as u64).to_string()
                }
                Algorithm::SlidingWindow => format!("{} per window", l.requests),
            })
            .collect::<Vec<_>>();
        let policy = limits
            .iter()
            .enumerate()
            .map(|(i, l)| policy_item(&rule.name, i, l))
            .collect::<Vec<_>>();
        (shown.join(" + "), burst.join(" + "), policy.join(" | "))
    };
    [
        rule.name.clone(),
        tier.to_string(),
        shown,
        burst,
        cost,
        format!("{:?}", rule.scope).to_lowercase(),
        if slots.is_some() {
            "-".to_string()
        } else {
            rule.algorithm.name().to_string()
        },
        if rule.mode == Mode::Shadow {
            "shadow"
        } else {
            "enforce"
        }
        .to_string(),
        policy,
    ]
}

/// The `RateLimit-Policy` item of limit `l`, the `limit`th of rule `name`,
/// written by the filter's own header code.
fn policy_item(name: &str, limit: usize, l: &LimitSpec) -> String {
    let quota = l.concurrent.map_or(l.requests, u64::from);
    let shown = Shown {
        policy: name,
        limit,
        quota,
        window_secs: l.per.0,
        remaining: quota,
        reset_secs: 0,
        retry_after_secs: 1,
        text: None,
        in_flight: l.is_concurrent(),
    };
    headers::render(HeaderStyle::Ietf, &shown)
        .into_iter()
        .find(|(n, _)| *n == headers::POLICY.as_str())
        .map(|(_, v)| v)
        .unwrap_or_default()
}

fn render(rows: &[[String; 9]]) -> String {
    let mut widths = [0usize; 9];
    for r in rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}
