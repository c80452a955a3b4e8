//! The `explain` section on what each rule, quota and cost applies to and
//! keys on: its `match` conditions written out (`not` and `any` as
//! such), its key parts, and the request properties (route name, route and
//! dynamic metadata) the filter reads for them, each one host call per
//! request. Printed only when some entry has a match or a key.

use ratelimit_config::{Config, KeyPart, LimitsSource, Match, MetadataPath, ValueMatch};
use std::collections::BTreeSet;

/// The conditions of `m`, joined with `and`; `every request` for none.
fn conditions(m: &Match, props: &mut BTreeSet<String>) -> String {
    let mut out: Vec<String> = Vec::new();
    if let Some(p) = &m.path_prefix {
        out.push(format!("path starts with {p}"));
    }
    if let Some(p) = &m.path_exact {
        out.push(format!("path is {p}"));
    }
    if let Some(ms) = &m.methods {
        out.push(format!("method in {}", ms.join("|")));
    }
    for (n, v) in &m.headers {
        out.push(format!("header {n} is {v:?}"));
    }
    if let Some(h) = &m.host {
        out.push(format!("host is {h} (any case, port stripped)"));
    }
    if let Some(r) = &m.host_regex {
        out.push(format!("host matches {r:?} whole"));
    }
    if let Some(r) = &m.path_regex {
        out.push(format!("path matches {r:?} whole"));
    }
    if let Some(r) = &m.route {
        props.insert("xds.route_name".into());
        out.push(format!("route is {r:?}"));
    }
    for (path, v) in &m.route_metadata {
        props.insert(format!("xds.route_metadata filter_metadata/{path}"));
        out.push(format!("route metadata {path} is {v:?}"));
    }
    for (path, v) in &m.metadata {
        props.insert(format!("metadata filter_metadata/{path}"));
        out.push(format!("metadata {path} is {v:?}"));
    }
    for (kind, tests) in [("query", &m.query), ("cookie", &m.cookie)] {
        for (n, v) in tests {
            out.push(match v {
                ValueMatch::Present => format!("{kind} {n} present"),
                ValueMatch::Exact(s) => format!("{kind} {n} is {s:?} (decoded)"),
            });
        }
    }
    if let Some(not) = &m.not {
        out.push(format!("not ({})", conditions(not, props)));
    }
    if let Some(any) = &m.any {
        let alts: Vec<String> = any
            .iter()
            .map(|m| format!("({})", conditions(m, props)))
            .collect();
        out.push(format!("any of {}", alts.join(" or ")));
    }
    match out.is_empty() {
        true => "every request".into(),
        false => out.join(" and "),
    }
}

/// The key parts of an entry, and the properties they read.
fn key(parts: &[KeyPart], props: &mut BTreeSet<String>) -> String {
    for p in parts {
        match p {
            KeyPart::Route => {
                props.insert("xds.route_name".into());
            }
            KeyPart::Metadata(path) => {
                if let Ok(path) = MetadataPath::parse(path) {
                    props.insert(format!("metadata filter_metadata/{path}"));
                }
            }
            KeyPart::Client
            | KeyPart::Ip
            | KeyPart::Method
            | KeyPart::Path
            | KeyPart::Host
            | KeyPart::IpPrefix { .. }
            | KeyPart::Header(_)
            | KeyPart::Query(_)
            | KeyPart::Cookie(_) => {}
        }
    }
    match parts.is_empty() {
        true => "one bucket".into(),
        false => parts
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// The section, or empty when no entry has a match or a key.
pub fn describe(c: &Config) -> String {
    let mut props = BTreeSet::new();
    let mut lines = Vec::new();
    let rules = c
        .rules
        .iter()
        .map(|r| ("rule", &r.name, &r.matches, &r.key));
    let quotas = c
        .quotas
        .iter()
        .map(|q| ("quota", &q.name, &q.matches, &q.key));
    for (kind, name, matches, parts) in rules.chain(quotas) {
        if matches.is_none() && parts.is_empty() {
            continue;
        }
        let when = matches
            .as_ref()
            .map_or("every request".into(), |m| conditions(m, &mut props));
        let key = key(parts, &mut props);
        lines.push(format!("  {kind} {name}: {when}; key: {key}"));
    }
    for by in c.rules.iter().filter_map(|r| r.limits_by.as_ref()) {
        match by.source() {
            Some((LimitsSource::RouteMetadata, p)) => {
                props.insert(format!("xds.route_metadata filter_metadata/{p}"))
            }
            Some((LimitsSource::Metadata, p)) => {
                props.insert(format!("metadata filter_metadata/{p}"))
            }
            None => false,
        };
    }
    for (i, cost) in c.costs.iter().enumerate() {
        lines.push(format!(
            "  costs[{i}]: {}",
            conditions(&cost.matches, &mut props)
        ));
    }
    if lines.is_empty() {
        return String::new();
    }
    let mut out = String::from("\nwhich requests, keyed how:\n");
    for l in lines {
        out.push_str(&l);
        out.push('\n');
    }
    if !props.is_empty() {
        out.push_str("properties read from Envoy per request (one host call each):\n");
        for p in props {
            out.push_str(&format!("  {p}\n"));
        }
    }
    out
}
