//! `explain`'s account of charging from the response: what each rule (and
//! each `costs[]` entry) with `cost_from` reserves when the request arrives
//! and how it settles, each rule's `charge_on`; and, for a sample response,
//! what the filter would settle. The sample is read by the filter's own
//! code: its compiled plan (`Plan::compile`, `plan.meters`), its framing and
//! header reading (`decide::framing`, `decide::header_usage`) and its
//! streaming scanner (`usage::Scan`), so what is printed is what it does.

use ratelimit_config::{Config, CostFrom, Rule, StatusMatch};
use ratelimit_wasm::decide::{framing, header_usage, ResponseHeaders};
use ratelimit_wasm::policy::plan::{MeterSource, Plan};
use ratelimit_wasm::usage::{Framing, Meter, Scan, Usage};

/// A sample response: status, headers (names lower-case) and body.
pub struct Sample {
    /// The status code.
    pub status: u16,
    /// Headers, names lower-case, in the order given.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl ResponseHeaders for Sample {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        if name == ":status" {
            return Some(self.status.to_string().into_bytes());
        }
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone().into_bytes())
    }
}

/// Reads `name: value`.
pub fn parse_header(text: &str) -> Result<(String, String), String> {
    match text.split_once(':') {
        Some((n, v)) if !n.trim().is_empty() => {
            Ok((n.trim().to_ascii_lowercase(), v.trim().to_string()))
        }
        _ => Err(format!(
            "--response-header {text:?}: expected 'name: value'"
        )),
    }
}

/// The section on charging from the response; empty when nothing is.
pub fn describe(c: &Config) -> String {
    let mut out = String::new();
    for rule in &c.rules {
        match (&rule.cost_from, &rule.charge_on) {
            (Some(from), _) => {
                out.push_str(&format!("rule {:?}: {}\n", rule.name, summary(from)));
                out.push_str(&details(from));
            }
            (None, Some(_)) => out.push_str(&format!(
                "rule {:?}: {}, charged when the request arrives\n",
                rule.name,
                fixed(rule)
            )),
            (None, None) => continue,
        }
        if let Some(on) = &rule.charge_on {
            out.push_str(&format!(
                "  charge_on: {} ({})\n",
                statuses(on),
                "another status, or no response, gives the charge back"
            ));
        }
    }
    for (i, cost) in c.costs.iter().enumerate() {
        if let Some(from) = &cost.cost_from {
            out.push_str(&format!(
                "costs[{i}] (for rules without a cost of their own, on the requests it matches): {}\n",
                summary(from)
            ));
            out.push_str(&details(from));
        }
    }
    if out.is_empty() {
        return out;
    }
    format!("\ncharged from the response:\n{out}")
}

fn summary(from: &CostFrom) -> String {
    format!(
        "reserve {} when the request arrives; settles when the response ends to the cost it reports, at most max {}",
        from.reserve, from.max
    )
}

fn details(from: &CostFrom) -> String {
    let mut out = format!("  source: {}\n", source(from));
    if from.header.is_some() {
        out.push_str("  scan_limit: not used (the body is not read)\n");
    } else {
        out.push_str(&format!(
            "  scan_limit: {} bytes (a longer body keeps the reserve)\n",
            from.scan_limit
        ));
    }
    out
}

fn source(from: &CostFrom) -> String {
    if let Some(h) = &from.header {
        return format!(
            "response header {} (a decimal integer)",
            h.to_ascii_lowercase()
        );
    }
    if let Some(terms) = &from.json {
        let terms: Vec<String> = terms
            .iter()
            .map(|t| format!("{} × {}", t.pointer, t.weight))
            .collect();
        return format!("JSON body or SSE events: {}", terms.join(" + "));
    }
    if let Some(p) = from.preset {
        let terms: Vec<String> = p
            .terms()
            .iter()
            .map(|(pointers, weight)| {
                let at = if pointers.len() == 1 {
                    pointers.join("")
                } else {
                    format!("(first of {})", pointers.join(", "))
                };
                format!("{at} × {weight}")
            })
            .collect();
        return format!("preset {}: {}", p.name(), terms.join(" + "));
    }
    "none".into()
}

fn statuses(on: &[StatusMatch]) -> String {
    on.iter()
        .map(|m| match m {
            StatusMatch::Class(c) => format!("{c}xx"),
            StatusMatch::Code(code) => code.to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A rule's fixed charge, as words.
fn fixed(rule: &Rule) -> String {
    rule.cost
        .map_or("the request's cost (costs, default 1)".into(), |c| {
            format!("cost {c}")
        })
}

/// What the filter would settle for `sample`, one line per rule with
/// `cost_from` or `charge_on` and per `costs[]` entry with `cost_from`.
pub fn settle(c: &Config, sample: &Sample) -> String {
    // The seed keys bucket hashes only; nothing here reaches a bucket.
    let plan = Plan::compile(c, [0; 16]);
    let framed = framing(sample);
    let mut out = format!(
        "\nsample response: status {}, {}, body {} bytes\n",
        sample.status,
        match framed {
            Some(Framing::Json) => "read as JSON".to_string(),
            Some(Framing::Sse) => "read as server-sent events".to_string(),
            None => format!(
                "content-encoding {}: the body is not scanned",
                sample
                    .header("content-encoding")
                    .map_or(String::new(), |v| {
                        String::from_utf8_lossy(&v).into_owned()
                    })
            ),
        },
        sample.body.len()
    );
    for (r, rule) in c.rules.iter().enumerate() {
        let meter = plan.rules.get(r).and_then(|p| p.meter);
        let kept = rule
            .charge_on
            .as_ref()
            .map(|on| (on, on.iter().any(|m| m.matches(sample.status))));
        let line = match (meter, kept) {
            (None, None) => continue,
            // The filter gives the charge back before it reads any usage.
            (Some(m), Some((_, false))) => {
                let reserved = plan.meters.get(m).map_or(0, |p| p.reserve);
                format!(
                    "reserved {reserved}, reported not read, charged 0, settlement {}",
                    minus(reserved)
                )
            }
            (None, Some((_, false))) => match rule.cost {
                Some(n) => format!("reserved {n} (a fixed cost), charged 0, settlement {}", minus(n)),
                None => "reserved the request's cost (costs, default 1), charged 0, settlement all of it back".into(),
            },
            (Some(m), _) => outcome(&plan, m, sample),
            (None, Some(_)) => match rule.cost {
                Some(n) => format!("reserved {n} (a fixed cost), charged {n}, settlement 0"),
                None => "reserved the request's cost (costs, default 1), charged it, settlement 0".into(),
            },
        };
        let on = kept.map_or(String::new(), |(on, keeps)| {
            format!(
                "; charge_on {}: status {} {}",
                statuses(on),
                sample.status,
                if keeps {
                    "keeps the charge"
                } else {
                    "gives the charge back"
                }
            )
        });
        out.push_str(&format!("rule {:?}: {line}{on}\n", rule.name));
    }
    // The costs entries' meters follow the rules' own in `plan.meters`.
    let mut m = plan.rules.iter().filter(|r| r.meter.is_some()).count();
    for (i, cost) in c.costs.iter().enumerate() {
        if cost.cost_from.is_some() {
            out.push_str(&format!("costs[{i}]: {}\n", outcome(&plan, m, sample)));
            m += 1;
        }
    }
    out
}

fn minus(n: u64) -> String {
    if n == 0 {
        "0".into()
    } else {
        format!("-{n}")
    }
}

/// What meter `m` settles for `sample`: reserved, reported, charged, settlement.
fn outcome(plan: &Plan, m: usize, sample: &Sample) -> String {
    let Some(mp) = plan.meters.get(m) else {
        return "no such meter".into();
    };
    let reserved = mp.reserve;
    // The reported usage uncapped (the same reading with no max), and the
    // one the filter settles on.
    let (reported, usage) = match &mp.source {
        MeterSource::Header(name) => match sample.header(name) {
            Some(v) => (header_usage(&v, u64::MAX), header_usage(&v, mp.max)),
            None => (Usage::Missing, Usage::Missing),
        },
        MeterSource::Body(meter) => match framing(sample) {
            None => {
                return format!(
                    "reserved {reserved}, reported compressed (not scanned), charged {reserved} (the reserve), settlement 0"
                )
            }
            Some(f) => {
                let uncapped = Meter {
                    max: u64::MAX,
                    ..meter.clone()
                };
                (
                    scan(&uncapped, f, &sample.body),
                    scan(meter, f, &sample.body),
                )
            }
        },
    };
    match (reported, usage) {
        (Usage::Found { cost: u, .. }, Usage::Found { cost, capped }) => {
            let settlement = if cost >= reserved {
                if cost == reserved {
                    "0".into()
                } else {
                    format!("+{}", cost - reserved)
                }
            } else {
                minus(reserved - cost)
            };
            format!(
                "reserved {reserved}, reported {u}, charged {cost}{}, settlement {settlement}",
                if capped { " (max)" } else { "" }
            )
        }
        (_, Usage::OverLimit) => format!(
            "reserved {reserved}, reported over scan_limit ({} bytes > {}), charged {reserved} (the reserve), settlement 0",
            sample.body.len(),
            match &mp.source {
                MeterSource::Body(meter) => meter.scan_limit,
                MeterSource::Header(_) => 0,
            }
        ),
        _ => format!(
            "reserved {reserved}, reported missing, charged {reserved} (the reserve), settlement 0"
        ),
    }
}

/// The filter's scan of `body`, fed in chunks as a stream arrives.
fn scan(meter: &Meter, f: Framing, body: &[u8]) -> Usage {
    let mut s = Scan::new(meter, f);
    for chunk in body.chunks(16 * 1024) {
        s.feed(meter, chunk);
    }
    s.finish(meter)
}
