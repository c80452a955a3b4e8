//! `--rls-config`: envoyproxy/ratelimit's YAML, read unchanged, and its
//! descriptor matching.
//!
//! A file holds one `domain` and a tree of `descriptors`, each with a `key`,
//! an optional `value` (a trailing `*` makes it a prefix: `value: foo*`), an
//! optional `rate_limit` and nested `descriptors`. Matching is theirs
//! (`GetLimit` of their `config_impl.go`): level by level, the entry
//! `<key>_<value>` first, then a wildcard of that level whose prefix the
//! `<key>_<value>` string starts with, then the key-only entry; a limit
//! applies only when it sits at the request descriptor's last entry.
//!
//! What this gateway adds to a `rate_limit`, both optional:
//! * `algorithm`: `fixed_window` (theirs, the default), `token_bucket` or
//!   `sliding_window` (the gateway's exact buckets, with `requests_per_unit`
//!   per `unit`);
//! * `shared`: count in the bucket of a global rule of the `--policy` domain
//!   of the same name as the file's, the very Redis key a wasm filter of that
//!   policy writes (see [`Shared`]).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use serde::Deserialize;

use crate::reload::Source;

/// The unit of a `rate_limit`, as envoyproxy/ratelimit counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3600 s.
    Hour,
    /// 86 400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days (theirs: a fixed 30-day window, not a calendar month).
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// Every unit, shortest first.
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// The window length in seconds (their `UnitToDivider`).
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// The value of `RateLimitResponse.RateLimit.Unit` in the protocol.
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    /// The unit of a protocol value (a descriptor's limit override).
    pub fn from_proto(v: i32) -> Option<Unit> {
        Unit::ALL.into_iter().find(|u| u.proto() == v)
    }

    /// The unit whose window is `window_ms` exactly.
    pub fn of_window_ms(window_ms: u64) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|u| u.seconds().saturating_mul(1000) == window_ms)
    }

    /// Reads a unit name as theirs does: any case.
    fn parse(s: &str) -> Option<Unit> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }
}

/// How a `rate_limit` counts: the configuration crate's vocabulary, whose
/// exact algorithms are the filter's own.
pub use ratelimit_config::RlsAlgorithm;

/// `a, b or c`: a list for an error message.
fn one_or_other(names: &[&str]) -> String {
    match names.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// `rate_limit.shared`: the descriptor counts in the bucket of a global rule
/// of the gateway's policy, the one a wasm filter with that plugin
/// configuration charges, so native-filter and wasm-filter proxies share it.
///
/// Only a rule of the file's own domain: a caller's token names one domain
/// (`--auth-tokens`), and a descriptor of that domain must not reach the
/// buckets of another; a `shared.domain` naming another is refused at load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shared {
    /// The domain: this file's (a domain of `--policy` too).
    pub domain: String,
    /// A global rule of that domain; its limits and algorithm apply.
    pub rule: String,
    /// For each key part of the rule, in order, the descriptor entry whose
    /// value it is (e.g. `[user]` for a rule keyed on `["header:x-user"]`).
    pub entries: Vec<String>,
    /// For each of `entries`, its position in a matching request
    /// descriptor: the level of the configuration path that has this key
    /// (the first, when several do). A matching descriptor has exactly the
    /// path's entries, so the value is read from the parsed entry at that
    /// position, never searched for in bytes the caller wrote.
    pub positions: Vec<usize>,
}

/// One `rate_limit` of the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    /// `requests_per_unit` (0 denies every hit, as theirs).
    pub requests_per_unit: u32,
    /// `unit`; `None` only when `unlimited` or `shared`.
    pub unit: Option<Unit>,
    /// `unlimited: true`: answered OK at once, nothing counted.
    pub unlimited: bool,
    /// `name`, for `replaces`.
    pub name: Option<String>,
    /// The names this limit replaces when both match one request.
    pub replaces: Vec<String>,
    /// `shadow_mode` of the descriptor: over the limit still answers OK.
    pub shadow_mode: bool,
    /// The extension `algorithm`.
    pub algorithm: RlsAlgorithm,
    /// The extension `shared`.
    pub shared: Option<Shared>,
    /// The metrics label: the descriptor's key path in the configuration
    /// (`key_value.key2`, their stats key without the domain), bounded by
    /// the configuration, never a request's value.
    pub path: String,
}

/// One configuration level: entries by `<key>` or `<key>_<value>`.
#[derive(Debug, Default)]
struct Level {
    entries: HashMap<String, Node>,
    /// The entries whose composite key ends with `*`, in file order.
    wildcards: Vec<String>,
}

#[derive(Debug)]
struct Node {
    limit: Option<RateLimit>,
    /// `share_threshold`: every value matching this wildcard counts in one
    /// counter (the pattern stands for the value in the key).
    share_threshold: bool,
    children: Level,
}

/// Every domain of `--rls-config`.
#[derive(Debug, Default)]
pub struct RlsConfig {
    domains: HashMap<String, Level>,
}

/// A limit found for a request descriptor.
#[derive(Debug, Clone, Copy)]
pub struct Found<'a> {
    /// The limit.
    pub limit: &'a RateLimit,
    /// Per entry of the descriptor: the wildcard value its counter is keyed
    /// on instead of the request's value (`share_threshold`), else `None`.
    pub shared_values: [Option<&'a str>; MAX_ENTRIES],
}

/// Most entries in a request descriptor (Envoy's actions make a handful).
pub const MAX_ENTRIES: usize = 16;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRoot {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
    rate_limit: Option<YamlRateLimit>,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    /// Accepted as theirs; the metrics' labels stay the configuration's key
    /// path either way (bounded label values).
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
    /// Accepted as theirs; see `detailed_metric`.
    #[serde(default)]
    #[allow(dead_code)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    #[serde(default)]
    requests_per_unit: u32,
    #[serde(default)]
    unit: String,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: String,
    #[serde(default)]
    replaces: Vec<YamlReplaces>,
    algorithm: Option<String>,
    shared: Option<YamlShared>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    #[serde(default)]
    name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlShared {
    domain: Option<String>,
    rule: String,
    entries: Vec<String>,
}

/// Parses every file; errors are `<file>: <field path>: <reason>`. A domain
/// defined by two files is refused (theirs, without `MERGE_DOMAIN_CONFIG`).
pub fn parse(sources: &[Source]) -> Result<RlsConfig, String> {
    let mut config = RlsConfig::default();
    let mut from: HashMap<String, PathBuf> = HashMap::new();
    for s in sources {
        let file = s.path.display();
        // serde_norway's errors name the field path and the line already.
        let root: YamlRoot =
            serde_norway::from_slice(&s.bytes).map_err(|e| format!("{file}: {e}"))?;
        if root.domain.is_empty() {
            return Err(format!("{file}: domain: must not be empty"));
        }
        if let Some(first) = from.get(&root.domain) {
            return Err(format!(
                "{file}: domain: `{}` is already defined by {}",
                root.domain,
                first.display()
            ));
        }
        let level = load_level(&root.descriptors, "descriptors", "", &[], &root.domain)
            .map_err(|e| format!("{file}: {e}"))?;
        from.insert(root.domain.clone(), s.path.clone());
        config.domains.insert(root.domain, level);
    }
    Ok(config)
}

fn load_level(
    descriptors: &[YamlDescriptor],
    at: &str,
    parent: &str,
    keys: &[&str],
    domain: &str,
) -> Result<Level, String> {
    let mut level = Level::default();
    for (i, d) in descriptors.iter().enumerate() {
        let at = format!("{at}[{i}]");
        if d.key.is_empty() {
            return Err(format!("{at}.key: descriptor has empty key"));
        }
        let composite = if d.value.is_empty() {
            d.key.clone()
        } else {
            format!("{}_{}", d.key, d.value)
        };
        let path = if parent.is_empty() {
            composite.clone()
        } else {
            format!("{parent}.{composite}")
        };
        if level.entries.contains_key(&composite) {
            return Err(format!(
                "{at}: duplicate descriptor composite key '{domain}.{path}'"
            ));
        }
        let wildcard = composite.ends_with('*');
        if d.share_threshold && !wildcard {
            return Err(format!(
                "{at}.share_threshold: can only be used with wildcard values (ending with '*')"
            ));
        }
        let mut keys = keys.to_vec();
        keys.push(&d.key);
        let limit = match &d.rate_limit {
            Some(r) => Some(load_limit(
                r,
                &format!("{at}.rate_limit"),
                d,
                &Path {
                    path: &path,
                    keys: &keys,
                },
                domain,
            )?),
            None => None,
        };
        let children = load_level(
            &d.descriptors,
            &format!("{at}.descriptors"),
            &path,
            &keys,
            domain,
        )?;
        if wildcard {
            level.wildcards.push(composite.clone());
        }
        level.entries.insert(
            composite,
            Node {
                limit,
                share_threshold: d.share_threshold,
                children,
            },
        );
    }
    Ok(level)
}

/// Where a `rate_limit` sits: its key path (the metrics label) and the
/// descriptor keys from the top level down to its own.
struct Path<'a> {
    path: &'a str,
    keys: &'a [&'a str],
}

fn load_limit(
    r: &YamlRateLimit,
    at: &str,
    d: &YamlDescriptor,
    place: &Path<'_>,
    domain: &str,
) -> Result<RateLimit, String> {
    let path = place.path;
    let unit = if r.unit.is_empty() {
        None
    } else {
        Some(
            Unit::parse(&r.unit)
                .ok_or_else(|| format!("{at}.unit: invalid rate limit unit '{}'", r.unit))?,
        )
    };
    let algorithm = match r.algorithm.as_deref() {
        None => RlsAlgorithm::default(),
        Some(name) => RlsAlgorithm::from_name(name).ok_or_else(|| {
            let names: Vec<&str> = RlsAlgorithm::ALL.iter().map(|a| a.name()).collect();
            format!(
                "{at}.algorithm: unknown algorithm '{name}', expected {}",
                one_or_other(&names)
            )
        })?,
    };
    let shared = match &r.shared {
        Some(s) => Some(load_shared(s, &format!("{at}.shared"), place.keys, domain)?),
        None => None,
    };
    if r.unlimited {
        if unit.is_some() {
            return Err(format!(
                "{at}.unit: should not specify rate limit unit when unlimited"
            ));
        }
        if shared.is_some() || r.algorithm.is_some() {
            return Err(format!(
                "{at}.unlimited: an unlimited descriptor counts nothing: no algorithm or shared"
            ));
        }
    } else if let Some(s) = &shared {
        if unit.is_some() || r.requests_per_unit != 0 || r.algorithm.is_some() {
            return Err(format!(
                "{at}.shared: the limits and algorithm are those of rule `{}` in the policy: \
                 give no unit, requests_per_unit or algorithm",
                s.rule
            ));
        }
    } else if unit.is_none() {
        return Err(format!("{at}.unit: invalid rate limit unit ''"));
    } else if algorithm != RlsAlgorithm::FixedWindow && r.requests_per_unit == 0 {
        return Err(format!(
            "{at}.requests_per_unit: a {} needs at least 1 (0 denies all only in a fixed_window)",
            algorithm.name()
        ));
    } else if algorithm != RlsAlgorithm::FixedWindow
        && unit.is_some_and(|u| {
            u64::from(r.requests_per_unit).saturating_mul(u.seconds() * 1000)
                > ratelimit_protocol::MAX_EXACT
        })
    {
        return Err(format!(
            "{at}.requests_per_unit: requests_per_unit × unit must stay under 2^53 milliseconds \
             in a {} (the gateway's arithmetic is exact only below it)",
            algorithm.name()
        ));
    }
    let mut replaces = Vec::with_capacity(r.replaces.len());
    for (j, rep) in r.replaces.iter().enumerate() {
        if rep.name.is_empty() {
            return Err(format!(
                "{at}.replaces[{j}].name: should not have an empty replaces entry"
            ));
        }
        if rep.name == r.name {
            return Err(format!(
                "{at}.replaces[{j}].name: replaces should not contain name of same descriptor"
            ));
        }
        replaces.push(rep.name.clone());
    }
    Ok(RateLimit {
        requests_per_unit: r.requests_per_unit,
        unit,
        unlimited: r.unlimited,
        name: (!r.name.is_empty()).then(|| r.name.clone()),
        replaces,
        shadow_mode: d.shadow_mode,
        algorithm,
        shared,
        path: path.to_string(),
    })
}

/// Reads `rate_limit.shared` at `at`, for a descriptor whose path has
/// `keys`, in the file of `domain`.
fn load_shared(s: &YamlShared, at: &str, keys: &[&str], domain: &str) -> Result<Shared, String> {
    if let Some(other) = s.domain.as_deref().filter(|d| *d != domain) {
        return Err(format!(
            "{at}.domain: `{other}` is not this file's domain `{domain}`: a descriptor shares \
             only a rule of its own domain (a caller's token reaches one domain)"
        ));
    }
    if s.rule.is_empty() {
        return Err(format!("{at}.rule: must not be empty"));
    }
    if s.entries.is_empty() || s.entries.len() > MAX_ENTRIES {
        return Err(format!(
            "{at}.entries: name 1 to {MAX_ENTRIES} descriptor entries, one per key part of the rule"
        ));
    }
    let mut positions = Vec::with_capacity(s.entries.len());
    for (j, want) in s.entries.iter().enumerate() {
        let Some(p) = keys.iter().position(|k| k == want) else {
            return Err(format!(
                "{at}.entries[{j}]: `{want}` is not a key of this descriptor's path ({})",
                keys.join(".")
            ));
        };
        positions.push(p);
    }
    Ok(Shared {
        domain: domain.to_string(),
        rule: s.rule.clone(),
        entries: s.entries.clone(),
        positions,
    })
}

impl RlsConfig {
    /// The domains, sorted (for the log).
    pub fn domains(&self) -> Vec<&str> {
        let mut d: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        d.sort_unstable();
        d
    }

    /// Whether `domain` is configured.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The limit of one request descriptor (`entries`: its key/value pairs),
    /// as envoyproxy/ratelimit finds it; `None` when nothing matches, the
    /// domain is unknown, or the descriptor has more than [`MAX_ENTRIES`].
    pub fn find<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Option<Found<'a>> {
        let mut level = self.domains.get(domain)?;
        if entries.is_empty() || entries.len() > MAX_ENTRIES {
            return None;
        }
        let mut found = None;
        let mut shared_values: [Option<&'a str>; MAX_ENTRIES] = [None; MAX_ENTRIES];
        let last = entries.len() - 1;
        for (i, (key, value)) in entries.iter().enumerate() {
            let composite = format!("{key}_{value}");
            let mut node = level.entries.get(&composite);
            if node.is_none() {
                // Their prefix test runs on the `<key>_<value>` string.
                for w in &level.wildcards {
                    if composite.starts_with(w.trim_end_matches('*')) {
                        node = level.entries.get(w);
                        if node.is_some_and(|n| n.share_threshold) {
                            let pattern = w.strip_prefix(&format!("{key}_")).unwrap_or(w);
                            if let Some(slot) = shared_values.get_mut(i) {
                                *slot = Some(pattern);
                            }
                        }
                        break;
                    }
                }
            }
            if node.is_none() {
                node = level.entries.get(*key);
            }
            let Some(n) = node else {
                break;
            };
            if let Some(limit) = &n.limit {
                if i == last {
                    found = Some(limit);
                }
            }
            if n.children.entries.is_empty() {
                break;
            }
            level = &n.children;
        }
        found.map(|limit| Found {
            limit,
            shared_values,
        })
    }
}

/// The names of `replaces` across the found limits: a found limit whose
/// `name` is among them is dropped (theirs: only when both match one request).
pub fn replaced<'a>(found: impl IntoIterator<Item = &'a RateLimit>) -> HashSet<&'a str> {
    found
        .into_iter()
        .flat_map(|l| l.replaces.iter().map(String::as_str))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_one(yaml: &str) -> Result<RlsConfig, String> {
        parse(&[Source {
            path: "c.yaml".into(),
            bytes: yaml.as_bytes().to_vec(),
        }])
    }

    fn find_path(c: &RlsConfig, domain: &str, entries: &[(&str, &str)]) -> Option<String> {
        c.find(domain, entries).map(|f| f.limit.path.clone())
    }

    #[test]
    fn matching_follows_theirs() {
        let c = parse_one(
            "domain: d\ndescriptors:\n\
             - key: remote_address\n  rate_limit: {unit: second, requests_per_unit: 10}\n\
             - key: remote_address\n  value: 50.0.0.5\n  rate_limit: {unit: second, requests_per_unit: 0}\n\
             - key: message_type\n  value: marketing\n  descriptors:\n\
             \x20 - key: to_number\n    rate_limit: {unit: day, requests_per_unit: 5}\n\
             - key: k\n  value: value*\n  rate_limit: {unit: MINUTE, requests_per_unit: 20}\n",
        )
        .unwrap();
        assert_eq!(
            find_path(&c, "d", &[("remote_address", "1.2.3.4")]).as_deref(),
            Some("remote_address")
        );
        assert_eq!(
            find_path(&c, "d", &[("remote_address", "50.0.0.5")]).as_deref(),
            Some("remote_address_50.0.0.5")
        );
        // A placeholder without a limit; the nested level decides.
        assert_eq!(find_path(&c, "d", &[("message_type", "marketing")]), None);
        assert_eq!(
            find_path(
                &c,
                "d",
                &[("message_type", "marketing"), ("to_number", "1")]
            )
            .as_deref(),
            Some("message_type_marketing.to_number")
        );
        // More entries than the configuration is deep: no limit.
        assert_eq!(
            find_path(&c, "d", &[("remote_address", "1"), ("x", "y")]),
            None
        );
        assert_eq!(
            find_path(&c, "d", &[("k", "value_1")]).as_deref(),
            Some("k_value*")
        );
        assert_eq!(find_path(&c, "d", &[("k", "other")]), None);
        assert_eq!(find_path(&c, "other", &[("k", "value_1")]), None);
        assert_eq!(
            c.find("d", &[("k", "value1")]).unwrap().limit.unit,
            Some(Unit::Minute)
        );
    }

    #[test]
    fn errors_name_the_file_and_field() {
        let cases = [
            ("descriptors: []\n", "c.yaml: domain: must not be empty"),
            (
                "domain: d\ndescriptors:\n- key: ''\n",
                "c.yaml: descriptors[0].key: descriptor has empty key",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n  rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
                "c.yaml: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n  rate_limit: {unlimited: true, unit: second}\n",
                "c.yaml: descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n- key: a\n",
                "c.yaml: descriptors[1]: duplicate descriptor composite key 'd.a'",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n  rate_limit: {unit: second, requests_per_unit: 1, name: x, replaces: [{name: x}]}\n",
                "c.yaml: descriptors[0].rate_limit.replaces[0].name: replaces should not contain name of same descriptor",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n  rate_limit: {unit: second, requests_per_unit: 0, algorithm: token_bucket}\n",
                "c.yaml: descriptors[0].rate_limit.requests_per_unit: a token_bucket needs at least 1 (0 denies all only in a fixed_window)",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n  rate_limit: {unit: year, requests_per_unit: 300000, algorithm: token_bucket}\n",
                "c.yaml: descriptors[0].rate_limit.requests_per_unit: requests_per_unit × unit must stay under 2^53 milliseconds in a token_bucket (the gateway's arithmetic is exact only below it)",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n  rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n",
                "c.yaml: descriptors[0].rate_limit.algorithm: unknown algorithm 'leaky', expected fixed_window, token_bucket or sliding_window",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n  rate_limit: {unit: second, requests_per_unit: 1, shared: {rule: r, entries: [a]}}\n",
                "c.yaml: descriptors[0].rate_limit.shared: the limits and algorithm are those of rule `r` in the policy: give no unit, requests_per_unit or algorithm",
            ),
            (
                "domain: d\ndescriptors:\n- key: a\n  rate_limit: {shared: {domain: other, rule: r, entries: [a]}}\n",
                "c.yaml: descriptors[0].rate_limit.shared.domain: `other` is not this file's domain `d`: \
                 a descriptor shares only a rule of its own domain (a caller's token reaches one domain)",
            ),
            (
                "domain: d\ndescriptors:\n- key: t\n  descriptors:\n  - key: a\n    rate_limit: {shared: {rule: r, entries: [a, b]}}\n",
                "c.yaml: descriptors[0].descriptors[0].rate_limit.shared.entries[1]: `b` is not a key of this descriptor's path (t.a)",
            ),
        ];
        for (yaml, want) in cases {
            assert_eq!(parse_one(yaml).unwrap_err(), want, "{yaml}");
        }
        // Its own domain, spelt out or not; the values are read by position.
        for yaml in [
            "domain: d\ndescriptors:\n- key: t\n  descriptors:\n  - key: a\n    rate_limit: {shared: {domain: d, rule: r, entries: [a, t]}}\n",
            "domain: d\ndescriptors:\n- key: t\n  descriptors:\n  - key: a\n    rate_limit: {shared: {rule: r, entries: [a, t]}}\n",
        ] {
            let c = parse_one(yaml).unwrap();
            let shared = c.find("d", &[("t", "1"), ("a", "2")]).unwrap().limit.shared.clone();
            assert_eq!(
                shared.map(|s| (s.domain, s.positions)),
                Some(("d".to_string(), vec![1, 0]))
            );
        }
        let e = parse_one("domain: d\ndescriptors:\n- key: a\n  bogus: 1\n").unwrap_err();
        assert!(
            e.starts_with("c.yaml: descriptors[0]: unknown field `bogus`"),
            "{e}"
        );
    }
}
