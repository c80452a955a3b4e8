//! The `budget` check: service-wide global limits of several services sharing
//! one paid upstream must sum to under the provider's limit, with headroom.
//!
//! Only a global rule without key parts bounds a service's total traffic; a
//! keyed rule bounds each client, not the sum, so it is listed as unbounded.

use crate::load;
use ratelimit_wasm::config::duration;
use ratelimit_wasm::config::Scope;

/// Parses `<requests>/<duration>` into requests per second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
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
    Ok(n as f64 / secs as f64)
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

/// Prints the budget and fails when the services' sum exceeds the allowance.
pub fn run(files: &[String], provider: &str, headroom: &str) -> Result<(), String> {
    let provider_rate = parse_rate(provider)?;
    let share = parse_share(headroom)?;
    let allowance = provider_rate * (1.0 - share);
    let mut total = 0.0;
    let mut unbounded = Vec::new();
    println!("{:<32} {:<24} {:>12}", "service", "rule", "requests/s");
    for f in files {
        let c = load(f)?;
        // The tightest service-wide global limit bounds the service.
        let mut bound: Option<(String, f64)> = None;
        for rule in c.rules.iter().filter(|r| r.scope == Scope::Global) {
            if !rule.key.is_empty() {
                unbounded.push(format!(
                    "{f}: rule {:?} is per {:?}, so it does not bound the total",
                    rule.name, rule.key
                ));
                continue;
            }
            let all = std::iter::once(&rule.limits).chain(rule.tiers.values());
            for limit in all.flatten() {
                let rate = limit.requests as f64 / limit.per.0 as f64;
                if bound.as_ref().is_none_or(|(_, b)| rate < *b) {
                    bound = Some((rule.name.clone(), rate));
                }
            }
        }
        match bound {
            Some((rule, rate)) => {
                println!("{f:<32} {rule:<24} {rate:>12.3}");
                total += rate;
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
    println!("{:<32} {:<24} {total:>12.3}", "total", "");
    println!(
        "{:<32} {:<24} {allowance:>12.3}",
        "allowance",
        format!("{provider} - {:.0}%", share * 100.0)
    );
    if total <= allowance {
        println!(
            "ok: {:.1}% of the allowance",
            100.0 * total / allowance.max(f64::MIN_POSITIVE)
        );
        Ok(())
    } else {
        Err(format!(
            "over budget: {total:.3} requests/s exceed the allowance of {allowance:.3}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_shares() {
        assert_eq!(parse_rate("600/1m").unwrap(), 10.0);
        assert_eq!(parse_rate("5/1s").unwrap(), 5.0);
        assert!(parse_rate("600").is_err());
        assert!(parse_rate("x/1m").is_err());
        assert!(parse_rate("1/0s").is_err());
        assert_eq!(parse_share("10%").unwrap(), 0.1);
        assert_eq!(parse_share("0.25").unwrap(), 0.25);
        assert!(parse_share("100%").is_err());
        assert!(parse_share("abc").is_err());
    }
}
