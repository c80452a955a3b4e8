//! The `budget` check: service-wide global limits of several services sharing
//! one paid upstream must sum to under the provider's limit, with headroom.
//!
//! What is summed is the most each service can send in one window of the
//! provider's limit, everything that counts on its own at once:
//! * only a global rule without key parts and without `match` bounds a
//!   service's total (a keyed rule bounds each client, a matching rule only
//!   the requests it matches); of several, the tightest bounds the service;
//! * a rule's counters: its own limits, each tier with limits of its own,
//!   each client override: each is a bucket of its own, so they add up;
//! * a set of limits admits, in a window of `w` seconds, at most the least
//!   over its limits of `requests × (1 + w / per)`: a full bucket at once,
//!   then its refill;
//! * an unlimited tier or client, or a soft client, leaves the total unbounded;
//! * a cost read from the response (`cost_from`) is not a number of requests:
//!   it lies between `reserve` and `max` per request, known only when the
//!   response ends. Only local rules and `costs[]` entries may have one (the
//!   gateway does not settle), so it never enters the sum; a note says so
//!   rather than counting such a request as 1.

use crate::load;
use ratelimit_config::{duration, Config, LimitSpec, Rule, Scope};

/// A provider's limit: `requests` per `window_s` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Provider {
    /// Requests per window.
    pub requests: u64,
    /// The window, in seconds.
    pub window_s: u64,
}

/// Parses `<requests>/<duration>`.
pub fn parse_provider(text: &str) -> Result<Provider, String> {
    let (n, per) = text.split_once('/').ok_or_else(|| {
        format!("--provider-limit {text:?}: expected <requests>/<duration>, e.g. 1000/1m")
    })?;
    let requests: u64 = n
        .trim()
        .parse()
        .map_err(|_| format!("--provider-limit {text:?}: {n:?} is not a whole number"))?;
    let window_s = duration::parse(per)
        .filter(|s| *s > 0)
        .ok_or_else(|| format!("--provider-limit {text:?}: {per:?} is not a duration"))?;
    Ok(Provider { requests, window_s })
}

/// Parses `10%` (or `0.1`) into a share.
pub fn parse_share(text: &str) -> Result<f64, String> {
    let share = match text.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|p| p / 100.0),
        None => text.trim().parse::<f64>(),
    }
    .map_err(|_| format!("--headroom {text:?}: expected a percentage such as 10%"))?;
    if !(0.0..1.0).contains(&share) {
        return Err(format!(
            "--headroom {text:?}: must be at least 0% and below 100%"
        ));
    }
    Ok(share)
}

/// What one counter, or a sum of them, can admit.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Bound {
    /// Requests per second, sustained.
    pub rate: f64,
    /// The most admitted in one window of the provider's limit.
    pub window_max: f64,
}

impl std::ops::Add for Bound {
    type Output = Bound;
    fn add(self, o: Bound) -> Bound {
        Bound {
            rate: self.rate + o.rate,
            window_max: self.window_max + o.window_max,
        }
    }
}

/// The bound of one set of limits, all of which apply.
pub fn set_bound(limits: &[LimitSpec], window_s: u64) -> Bound {
    let mut b = Bound {
        rate: f64::INFINITY,
        window_max: f64::INFINITY,
    };
    for l in limits {
        let rate = l.requests as f64 / l.per.0.max(1) as f64;
        b.rate = b.rate.min(rate);
        b.window_max = b.window_max.min(l.requests as f64 + rate * window_s as f64);
    }
    b
}

/// The bound of rule `r` over all its counters (own limits, tiers with
/// limits, `limits_by` sets, client overrides) and how many there are; `Err` names what
/// leaves it unbounded.
pub fn rule_bound(c: &Config, r: &Rule, window_s: u64) -> Result<(Bound, usize), String> {
    if let Some((t, _)) = c.tiers.iter().find(|(_, t)| t.unlimited) {
        return Err(format!("tier {t:?} is unlimited"));
    }
    if let Some((id, _)) = c
        .identity
        .clients
        .iter()
        .find(|(_, s)| s.unlimited || s.soft)
    {
        return Err(format!("client {id:?} is unlimited or soft"));
    }
    let overrides = c
        .identity
        .clients
        .values()
        .filter_map(|s| s.limits.get(&r.name));
    let sets = std::iter::once(&r.limits)
        .chain(r.tiers.values())
        .chain(r.limits_by.iter().flat_map(|b| b.sets.values()))
        .chain(overrides);
    let (mut total, mut counters) = (Bound::default(), 0);
    for set in sets {
        total = total + set_bound(set, window_s);
        counters += 1;
    }
    Ok((total, counters))
}

/// Prints the budget and fails when the services' sum exceeds the allowance.
pub fn run(files: &[String], provider: &str, headroom: &str) -> Result<(), String> {
    let p = parse_provider(provider)?;
    let share = parse_share(headroom)?;
    let allowance = p.requests as f64 * (1.0 - share);
    let window = provider.split_once('/').map_or("", |(_, w)| w.trim());
    let mut total = Bound::default();
    let mut notes = Vec::new();
    println!(
        "{:<32} {:<20} {:>8} {:>12} {:>14}",
        "service",
        "rule",
        "counters",
        "requests/s",
        format!("most in {window}")
    );
    for f in files {
        let c = load(f)?;
        let (rule, bound, counters) = service_bound(f, &c, p.window_s, &mut notes)?;
        println!(
            "{f:<32} {rule:<20} {counters:>8} {:>12.3} {:>14.0}",
            bound.rate, bound.window_max
        );
        total = total + bound;
        if let Some(l) = c
            .global
            .as_ref()
            .and_then(|g| g.lease.as_ref().map(|l| (g, l)))
        {
            notes.push(format!(
                "{f}: lease mode: the rate holds, but at any moment up to {} × {:.0}% \
                 of the limit (global.instances × lease.fraction) may be admitted on top",
                l.0.instances,
                l.1.fraction * 100.0
            ));
        }
    }
    for n in &notes {
        println!("note: {n}");
    }
    println!(
        "{:<32} {:<20} {:>8} {:>12.3} {:>14.0}",
        "total", "", "", total.rate, total.window_max
    );
    println!(
        "{:<32} {:<20} {:>8} {:>12} {allowance:>14.0}",
        "allowance",
        format!("{provider} - {:.0}%", share * 100.0),
        "",
        ""
    );
    if total.window_max <= allowance {
        println!(
            "ok: {:.1}% of the allowance",
            100.0 * total.window_max / allowance.max(f64::MIN_POSITIVE)
        );
        Ok(())
    } else {
        Err(format!(
            "over budget: up to {:.0} requests in {window} exceed the allowance of {allowance:.0} \
             (bursts, tiers and client overrides each count on their own)",
            total.window_max
        ))
    }
}

/// The tightest service-wide rule of `c`: its name, bound and counters.
fn service_bound(
    f: &str,
    c: &Config,
    window_s: u64,
    notes: &mut Vec<String>,
) -> Result<(String, Bound, usize), String> {
    let mut best: Option<(String, Bound, usize)> = None;
    for rule in &c.rules {
        if let Some(n) = rule.limits.first().and_then(|l| l.concurrent) {
            notes.push(format!(
                "{f}: rule {:?} limits requests in flight ({n} per key in each proxy), not a \
                 rate: it does not bound the service's total",
                rule.name
            ));
        }
        if let Some(from) = &rule.cost_from {
            let scope = match rule.scope {
                Scope::Local => "it is local, so it does not bound the service's total",
                Scope::Global => "the gateway settles it, so it counts tokens, not requests",
            };
            notes.push(format!(
                "{f}: rule {:?} is charged from the response, between {} (reserve) and {} (max) \
                 per request; {scope}",
                rule.name, from.reserve, from.max
            ));
        }
    }
    for (i, cost) in c.costs.iter().enumerate() {
        if let Some(from) = &cost.cost_from {
            notes.push(format!(
                "{f}: costs[{i}] is charged from the response, between {} (reserve) and {} (max) \
                 per request, in the rules without a cost of their own and the quotas counting cost",
                from.reserve, from.max
            ));
        }
    }
    for rule in c.rules.iter().filter(|r| r.scope == Scope::Global) {
        if !rule.key.is_empty() {
            notes.push(format!(
                "{f}: rule {:?} is per {:?}, so it does not bound the total",
                rule.name, rule.key
            ));
            continue;
        }
        if rule.matches.is_some() {
            notes.push(format!(
                "{f}: rule {:?} has a match, so it bounds only the requests it matches",
                rule.name
            ));
            continue;
        }
        let (bound, counters) = rule_bound(c, rule, window_s)
            .map_err(|why| format!("{f}: rule {:?}: {why}: the total is unbounded", rule.name))?;
        if best
            .as_ref()
            .is_none_or(|(_, b, _)| bound.window_max < b.window_max)
        {
            best = Some((rule.name.clone(), bound, counters));
        }
    }
    best.ok_or_else(|| {
        format!(
            "{f}: no service-wide global rule (scope global, no key, no match) bounds its traffic"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn providers_and_shares() {
        assert_eq!(
            parse_provider("600/1m").unwrap(),
            Provider {
                requests: 600,
                window_s: 60
            }
        );
        assert!(parse_provider("600").is_err());
        assert!(parse_provider("x/1m").is_err());
        assert!(parse_provider("1/0s").is_err());
        assert_eq!(parse_share("10%").unwrap(), 0.1);
        assert_eq!(parse_share("0.25").unwrap(), 0.25);
        assert!(parse_share("100%").is_err());
        assert!(parse_share("abc").is_err());
    }

    #[test]
    fn a_set_admits_its_burst_then_its_refill() {
        let c = ratelimit_config::parse(
            br#"{"domain":"d","rules":[{"name":"r","limits":[{"requests":60,"per":"1m"},{"requests":5,"per":"1s"}]}]}"#,
        )
        .unwrap();
        let b = set_bound(&c.rules[0].limits, 60);
        // 60/min: 60 + 60 in a minute; 5/s: 5 + 300. The least holds.
        assert_eq!(
            b,
            Bound {
                rate: 1.0,
                window_max: 120.0
            }
        );
    }
}
