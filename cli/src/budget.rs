//! The `budget` check: service-wide global limits of several services sharing
//! one paid upstream must sum to under the provider's limit, with headroom.
//!
//! Only a global rule without key parts bounds a service's total traffic; a
//! keyed rule bounds each client, not the sum, so it is listed as unbounded.
//! Each tier and each client with its own limits is a counter of its own, so
//! a rule's bound is their sum; and a full bucket admits its capacity on top
//! of what its rate refills, so the check also holds one provider window
//! with every bucket full against the provider's limit.

use crate::load;
use ratelimit_wasm::config::duration;
use ratelimit_wasm::config::{Config, LimitSpec, Rule, Scope};

/// Parses `<requests>/<duration>` (`--provider-limit`) into requests and seconds.
fn parse_limit(text: &str) -> Result<(u64, u64), String> {
    let (n, per) = text.split_once('/').ok_or_else(|| {
        format!("--provider-limit {text:?}: expected <requests>/<duration>, e.g. 1000/1m")
    })?;
    let n: u64 = n
        .trim()
        .parse()
        .map_err(|_| format!("--provider-limit {text:?}: {n:?} is not a whole number"))?;
    let secs = duration::parse(per)
        .filter(|s| *s > 0)
        .ok_or_else(|| format!("--provider-limit {text:?}: {per:?} is not a duration"))?;
    Ok((n, secs))
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

/// What one counter of a service-wide rule admits at most.
struct Counter {
    /// Sustained requests per second: the tightest of its limits.
    rate: f64,
    /// Requests in one provider window: a full bucket plus what refills.
    window: f64,
}

/// The bound of one counter with `limits`, all of which must pass, over a
/// provider window of `window_secs`.
fn counter(limits: &[LimitSpec], window_secs: f64) -> Option<Counter> {
    let rate = limits
        .iter()
        .map(|l| l.requests as f64 / l.per.0 as f64)
        .min_by(f64::total_cmp)?;
    let window = limits
        .iter()
        .map(|l| l.requests as f64 + l.requests as f64 * window_secs / l.per.0 as f64)
        .min_by(f64::total_cmp)?;
    Some(Counter { rate, window })
}

/// The sum over every counter `rule` keeps: one per tier (or one when the
/// configuration has no tiers) and one per client with its own limits for
/// it. An unlimited tier or client leaves the rule unbounded.
fn rule_bound(c: &Config, rule: &Rule, window_secs: f64) -> Result<Counter, String> {
    let mut sets: Vec<&[LimitSpec]> = Vec::new();
    if c.tiers.is_empty() {
        sets.push(&rule.limits);
    }
    for (name, tier) in &c.tiers {
        if tier.unlimited {
            return Err(format!(
                "rule {:?}: tier {name:?} is unlimited, so it does not bound the total",
                rule.name
            ));
        }
        sets.push(rule.tiers.get(name).unwrap_or(&rule.limits));
    }
    for (id, client) in &c.identity.clients {
        if client.unlimited {
            return Err(format!(
                "rule {:?}: client {id:?} is unlimited, so it does not bound the total",
                rule.name
            ));
        }
        if let Some(limits) = client.limits.get(&rule.name) {
            sets.push(limits);
        }
    }
    let mut sum = Counter {
        rate: 0.0,
        window: 0.0,
    };
    for set in sets {
        if let Some(one) = counter(set, window_secs) {
            sum.rate += one.rate;
            sum.window += one.window;
        }
    }
    Ok(sum)
}

/// Prints the budget and fails when the services' sum exceeds the allowance,
/// either sustained or within one provider window with every bucket full.
pub fn run(files: &[String], provider: &str, headroom: &str) -> Result<(), String> {
    let (provider_requests, provider_secs) = parse_limit(provider)?;
    let provider_rate = provider_requests as f64 / provider_secs as f64;
    let window_secs = provider_secs as f64;
    let share = parse_share(headroom)?;
    let allowance = provider_rate * (1.0 - share);
    let allowance_window = allowance * window_secs;
    let mut total = Counter {
        rate: 0.0,
        window: 0.0,
    };
    let mut unbounded = Vec::new();
    println!(
        "{:<32} {:<24} {:>12} {:>14}",
        "service",
        "rule",
        "requests/s",
        format!("in {provider_secs}s")
    );
    for f in files {
        let c = load(f)?;
        // Every request must pass each rule, so the tightest rule bounds the service.
        let mut bound: Option<(String, Counter)> = None;
        for rule in c.rules.iter().filter(|r| r.scope == Scope::Global) {
            if !rule.key.is_empty() {
                unbounded.push(format!(
                    "{f}: rule {:?} is per {:?}, so it does not bound the total",
                    rule.name, rule.key
                ));
                continue;
            }
            let sum = rule_bound(&c, rule, window_secs).map_err(|e| format!("{f}: {e}"))?;
            if bound.as_ref().is_none_or(|(_, b)| sum.window < b.window) {
                bound = Some((rule.name.clone(), sum));
            }
        }
        match bound {
            Some((rule, b)) => {
                println!("{f:<32} {rule:<24} {:>12.3} {:>14.0}", b.rate, b.window);
                total.rate += b.rate;
                total.window += b.window;
                if let Some(g) = &c.global {
                    if let Some(l) = &g.lease {
                        unbounded.push(format!(
                            "{f}: lease mode: the rate holds, but at any moment up to {} × {:.0}% \
                             of the limit (global.instances × lease.fraction) may be admitted on top",
                            g.instances,
                            l.fraction * 100.0
                        ));
                    }
                }
            }
            None => {
                return Err(format!(
                    "{f}: no service-wide global rule (scope global, no key) bounds its traffic"
                ))
            }
        }
    }
    for u in &unbounded {
        println!("note: {u}");
    }
    println!(
        "{:<32} {:<24} {:>12.3} {:>14.0}",
        "total", "", total.rate, total.window
    );
    println!(
        "{:<32} {:<24} {allowance:>12.3} {allowance_window:>14.0}",
        "allowance",
        format!("{provider} - {:.0}%", share * 100.0)
    );
    // A tiny tolerance keeps an exact fit from failing on rounding.
    let fits = |used: f64, allowed: f64| used <= allowed * (1.0 + 1e-9);
    if fits(total.rate, allowance) && fits(total.window, allowance_window) {
        let used = (total.rate / allowance.max(f64::MIN_POSITIVE))
            .max(total.window / allowance_window.max(f64::MIN_POSITIVE));
        println!("ok: {:.1}% of the allowance", 100.0 * used);
        Ok(())
    } else {
        Err(format!(
            "over budget: {:.3} requests/s ({:.0} in one {provider_secs}s window, bursts included) \
             exceed the allowance of {allowance:.3} ({allowance_window:.0} per window)",
            total.rate, total.window
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_shares() {
        assert_eq!(parse_limit("600/1m").unwrap(), (600, 60));
        assert_eq!(parse_limit("5/1s").unwrap(), (5, 1));
        assert!(parse_limit("600").is_err());
        assert!(parse_limit("x/1m").is_err());
        assert!(parse_limit("1/0s").is_err());
        assert_eq!(parse_share("10%").unwrap(), 0.1);
        assert_eq!(parse_share("0.25").unwrap(), 0.25);
        assert!(parse_share("100%").is_err());
        assert!(parse_share("abc").is_err());
    }
}
