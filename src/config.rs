//! The plugin's JSON configuration: parsing, defaults and validation.
//!
//! Field names are a public contract. Unknown fields are refused, and every
//! error names the field path, e.g. `rules[1].limits[0].per: "10x" is not a duration`.

use crate::algorithm::Algorithm;
use crate::duration::Seconds;
use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::fmt;

/// Most rules one configuration may hold; more make every request slower to match.
pub const MAX_RULES: usize = 1024;
/// Most limits one rule may hold; they share one shared-data entry.
pub const MAX_LIMITS_PER_RULE: usize = 8;
/// Most key parts one rule may hold.
pub const MAX_KEY_PARTS: usize = 8;
/// Largest `requests` of one limit.
pub const MAX_REQUESTS: u64 = 1_000_000_000;
/// Largest request cost.
pub const MAX_COST: u64 = 1_000_000;
/// Bounds of `max_buckets`.
pub const MIN_BUCKETS: u64 = 64;
/// Upper bound of `max_buckets`.
pub const MAX_BUCKETS: u64 = 1 << 24;
/// Default of `max_buckets`.
pub const DEFAULT_BUCKETS: u64 = 65_536;
/// Most trusted proxy hops.
pub const MAX_TRUSTED_HOPS: u32 = 16;

/// Why a configuration was refused; each names the field path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// The bytes are not JSON.
    NotJson(String),
    /// A field is unknown, missing, of the wrong type or out of range.
    Field {
        /// Path such as `rules[1].limits[0].per`.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl ConfigError {
    fn field(path: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Field {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            ConfigError::NotJson(e) => write!(f, "configuration is not valid JSON: {e}"),
            ConfigError::Field { path, reason } if path.is_empty() || path == "." => {
                write!(f, "configuration: {reason}")
            }
            ConfigError::Field { path, reason } => write!(f, "{path}: {reason}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// The whole plugin configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Namespace of this configuration's buckets; proxies with the same domain share limits.
    pub domain: String,
    /// Where the client's identity comes from.
    #[serde(default)]
    pub identity: Identity,
    /// The rate-limit rules; every matching rule must pass.
    pub rules: Vec<Rule>,
    /// Request costs; the first match wins, default 1.
    #[serde(default)]
    pub costs: Vec<Cost>,
    /// How denials and headers look.
    #[serde(default)]
    pub response: Response,
    /// Bound on tracked (rule, key) buckets per proxy; see the README.
    #[serde(default = "default_buckets")]
    pub max_buckets: u64,
    /// What to do when the shared state cannot be read or updated.
    #[serde(default)]
    pub on_error: OnError,
    /// The gateway that decides `"scope": "global"` rules; required when any rule is global.
    #[serde(default)]
    pub global: Option<Global>,
}

/// Where a rule is decided.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// In this proxy's shared data.
    #[default]
    Local,
    /// By the gateway, across every proxy.
    Global,
}

/// What a global rule does when the gateway cannot answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Allow, and count it.
    Open,
    /// Answer 503 with a problem body and `Retry-After`.
    Closed,
    /// Decide in this proxy's shared data at `1/instances` of the limit.
    #[default]
    Local,
}

/// The gateway and how to treat its failures.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Global {
    /// Envoy cluster of the gateway (in Istio `outbound|PORT||HOST`).
    pub cluster: String,
    /// `:authority` of the callout.
    #[serde(default = "default_authority")]
    pub authority: String,
    /// Path of the check endpoint.
    #[serde(default = "default_check_path")]
    pub path: String,
    /// Callout timeout; 0 is refused because Envoy treats it as no timeout.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Behaviour when the gateway or Redis fails.
    #[serde(default)]
    pub failure_mode: FailureMode,
    /// Number of proxies sharing the limit, used by `failure_mode: local`.
    #[serde(default = "default_instances")]
    pub instances: u64,
    /// Circuit breaker.
    #[serde(default)]
    pub circuit: Circuit,
}

/// Circuit-breaker settings, shared by all workers of a proxy.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Circuit {
    /// Consecutive failures (or slow answers) that open the circuit.
    #[serde(default = "default_failures")]
    pub failures: u32,
    /// A callout slower than this counts towards opening; 0 turns the latency trigger off.
    #[serde(default)]
    pub latency_ms: u64,
    /// How long the circuit stays open before one probe is let through.
    #[serde(default = "default_cooldown_ms")]
    pub cooldown_ms: u64,
}

impl Default for Circuit {
    fn default() -> Self {
        Circuit {
            failures: default_failures(),
            latency_ms: 0,
            cooldown_ms: default_cooldown_ms(),
        }
    }
}

fn default_authority() -> String {
    "ratelimit-gateway".into()
}
fn default_check_path() -> String {
    "/v1/check".into()
}
fn default_timeout_ms() -> u64 {
    50
}
fn default_instances() -> u64 {
    1
}
fn default_failures() -> u32 {
    5
}
fn default_cooldown_ms() -> u64 {
    2000
}

fn default_buckets() -> u64 {
    DEFAULT_BUCKETS
}

/// Identity sources.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// Header carrying the authenticated client id, set by the layer in front.
    #[serde(default = "default_client_header")]
    pub client_id_header: String,
    /// How many proxies in front append to `X-Forwarded-For`; 0 uses the peer address.
    #[serde(default)]
    pub trusted_proxy_hops: u32,
}

impl Default for Identity {
    fn default() -> Self {
        Identity {
            client_id_header: default_client_header(),
            trusted_proxy_hops: 0,
        }
    }
}

fn default_client_header() -> String {
    "x-client-id".into()
}

/// One rule: which requests, keyed how, limited to what.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Name reported in headers and `violated-policies`.
    pub name: String,
    /// Which requests the rule applies to; absent means all.
    #[serde(default, rename = "match")]
    pub matches: Option<Match>,
    /// Parts of the bucket key; empty means one bucket for all matching requests.
    #[serde(default)]
    pub key: Vec<String>,
    /// Limits that must all pass.
    pub limits: Vec<LimitSpec>,
    /// How the limits count.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// Decided in this proxy or by the gateway.
    #[serde(default)]
    pub scope: Scope,
}

/// A request predicate; all present conditions must hold.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// The path (without query) starts with this.
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// The path (without query) equals this.
    #[serde(default)]
    pub path_exact: Option<String>,
    /// The method is one of these.
    #[serde(default)]
    pub methods: Option<Vec<String>>,
    /// Each named header is present with exactly this value.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// `requests` per `per`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    /// Bucket capacity.
    pub requests: u64,
    /// Time to refill the whole bucket.
    pub per: Seconds,
}

/// A cost for matching requests.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cost {
    /// Which requests.
    #[serde(rename = "match")]
    pub matches: Match,
    /// Tokens they spend.
    pub cost: u64,
}

/// Response settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    /// Which rate-limit headers to send.
    #[serde(default)]
    pub headers: HeaderStyle,
    /// `type` of the problem+json body.
    #[serde(default = "default_problem_type")]
    pub problem_type: String,
}

impl Default for Response {
    fn default() -> Self {
        Response {
            headers: HeaderStyle::default(),
            problem_type: default_problem_type(),
        }
    }
}

/// Default problem type for a 429.
pub const DEFAULT_PROBLEM_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

fn default_problem_type() -> String {
    DEFAULT_PROBLEM_TYPE.into()
}

/// Which rate-limit header families are sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeaderStyle {
    /// `X-RateLimit-*` and the IETF `RateLimit` / `RateLimit-Policy`.
    #[default]
    Both,
    /// Only `X-RateLimit-*`.
    Legacy,
    /// Only `RateLimit` / `RateLimit-Policy`.
    Ietf,
    /// None.
    None,
}

/// Behaviour when the shared state fails (never expected in Envoy; contention past the retry budget).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Let the request through and count the error (as Envoy's own limiters do by default).
    #[default]
    Allow,
    /// Answer 429.
    Deny,
}

/// Parses and validates a configuration.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| ConfigError::NotJson(e.to_string()))?;
    let config: Config = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        ConfigError::field(path, e.into_inner().to_string())
    })?;
    config.validate()?;
    Ok(config)
}

/// True for a token as RFC 9110 defines it (header names, methods).
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// True for names that can stand in a structured-field string and a shared-data key.
fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

/// Known key parts, besides `header:<name>`.
pub const KEY_PARTS: [&str; 4] = ["client", "ip", "method", "path"];

impl Config {
    fn validate(&self) -> Result<(), ConfigError> {
        if !is_plain_name(&self.domain) {
            return Err(ConfigError::field(
                "domain",
                format!(
                    "{:?} must be 1-64 characters of A-Z a-z 0-9 - _ . :",
                    self.domain
                ),
            ));
        }
        let id = &self.identity;
        if !is_token(&id.client_id_header) {
            return Err(ConfigError::field(
                "identity.client_id_header",
                format!("{:?} is not a header name", id.client_id_header),
            ));
        }
        if id.trusted_proxy_hops > MAX_TRUSTED_HOPS {
            return Err(ConfigError::field(
                "identity.trusted_proxy_hops",
                format!("must be at most {MAX_TRUSTED_HOPS}"),
            ));
        }
        if self.rules.is_empty() {
            return Err(ConfigError::field("rules", "at least one rule is required"));
        }
        if self.rules.len() > MAX_RULES {
            return Err(ConfigError::field(
                "rules",
                format!(
                    "{} rules exceed the maximum of {MAX_RULES}",
                    self.rules.len()
                ),
            ));
        }
        let mut names = HashSet::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let at = format!("rules[{i}]");
            if !is_plain_name(&rule.name) {
                return Err(ConfigError::field(
                    format!("{at}.name"),
                    format!(
                        "{:?} must be 1-64 characters of A-Z a-z 0-9 - _ . :",
                        rule.name
                    ),
                ));
            }
            if !names.insert(rule.name.as_str()) {
                return Err(ConfigError::field(
                    format!("{at}.name"),
                    format!("{:?} is used by an earlier rule", rule.name),
                ));
            }
            if let Some(m) = &rule.matches {
                m.validate(&format!("{at}.match"))?;
            }
            if rule.key.len() > MAX_KEY_PARTS {
                return Err(ConfigError::field(
                    format!("{at}.key"),
                    format!("at most {MAX_KEY_PARTS} parts"),
                ));
            }
            for (k, part) in rule.key.iter().enumerate() {
                let ok = KEY_PARTS.contains(&part.as_str())
                    || part.strip_prefix("header:").is_some_and(is_token);
                if !ok {
                    return Err(ConfigError::field(
                        format!("{at}.key[{k}]"),
                        format!("{part:?} is not a key part (client, ip, method, path or header:<name>)"),
                    ));
                }
            }
            if rule.limits.is_empty() || rule.limits.len() > MAX_LIMITS_PER_RULE {
                return Err(ConfigError::field(
                    format!("{at}.limits"),
                    format!("must hold 1 to {MAX_LIMITS_PER_RULE} limits"),
                ));
            }
            for (l, limit) in rule.limits.iter().enumerate() {
                if limit.requests == 0 || limit.requests > MAX_REQUESTS {
                    return Err(ConfigError::field(
                        format!("{at}.limits[{l}].requests"),
                        format!("must be between 1 and {MAX_REQUESTS}"),
                    ));
                }
            }
        }
        self.validate_global()?;
        for (i, cost) in self.costs.iter().enumerate() {
            cost.matches.validate(&format!("costs[{i}].match"))?;
            if cost.cost == 0 || cost.cost > MAX_COST {
                return Err(ConfigError::field(
                    format!("costs[{i}].cost"),
                    format!("must be between 1 and {MAX_COST}"),
                ));
            }
        }
        if self.response.problem_type.is_empty() {
            return Err(ConfigError::field(
                "response.problem_type",
                "must not be empty",
            ));
        }
        if !(MIN_BUCKETS..=MAX_BUCKETS).contains(&self.max_buckets) {
            return Err(ConfigError::field(
                "max_buckets",
                format!("must be between {MIN_BUCKETS} and {MAX_BUCKETS}"),
            ));
        }
        Ok(())
    }
}

/// Largest `requests × per` in milliseconds of a global limit: the gateway's
/// Lua arithmetic is exact only below 2^53.
pub const MAX_GLOBAL_PRODUCT: u64 = 1 << 53;

impl Config {
    fn validate_global(&self) -> Result<(), ConfigError> {
        let first_global = self.rules.iter().position(|r| r.scope == Scope::Global);
        let Some(g) = &self.global else {
            return match first_global {
                Some(i) => Err(ConfigError::field(
                    "global",
                    format!("required because rules[{i}] has \"scope\": \"global\""),
                )),
                None => Ok(()),
            };
        };
        if g.cluster.is_empty() {
            return Err(ConfigError::field(
                "global.cluster",
                "must name an Envoy cluster",
            ));
        }
        if g.authority.is_empty() {
            return Err(ConfigError::field("global.authority", "must not be empty"));
        }
        if !g.path.starts_with('/') {
            return Err(ConfigError::field(
                "global.path",
                format!("{:?} must start with /", g.path),
            ));
        }
        if !(1..=60_000).contains(&g.timeout_ms) {
            return Err(ConfigError::field(
                "global.timeout_ms",
                "must be between 1 and 60000 (Envoy treats 0 as no timeout)",
            ));
        }
        if !(1..=10_000).contains(&g.instances) {
            return Err(ConfigError::field(
                "global.instances",
                "must be between 1 and 10000",
            ));
        }
        if g.circuit.failures == 0 {
            return Err(ConfigError::field(
                "global.circuit.failures",
                "must be at least 1",
            ));
        }
        if !(1..=3_600_000).contains(&g.circuit.cooldown_ms) {
            return Err(ConfigError::field(
                "global.circuit.cooldown_ms",
                "must be between 1 and 3600000",
            ));
        }
        for (i, rule) in self
            .rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.scope == Scope::Global)
        {
            for (l, limit) in rule.limits.iter().enumerate() {
                if limit.requests.saturating_mul(limit.per.0 * 1000) > MAX_GLOBAL_PRODUCT {
                    return Err(ConfigError::field(
                        format!("rules[{i}].limits[{l}]"),
                        "requests × per must stay under 2^53 milliseconds for a global rule",
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Match {
    fn validate(&self, at: &str) -> Result<(), ConfigError> {
        for (field, path) in [
            ("path_prefix", &self.path_prefix),
            ("path_exact", &self.path_exact),
        ] {
            if let Some(p) = path {
                if !p.starts_with('/') {
                    return Err(ConfigError::field(
                        format!("{at}.{field}"),
                        format!("{p:?} must start with /"),
                    ));
                }
            }
        }
        if let Some(methods) = &self.methods {
            if methods.is_empty() {
                return Err(ConfigError::field(
                    format!("{at}.methods"),
                    "must not be empty",
                ));
            }
            for (i, m) in methods.iter().enumerate() {
                if !is_token(m) {
                    return Err(ConfigError::field(
                        format!("{at}.methods[{i}]"),
                        format!("{m:?} is not a method"),
                    ));
                }
            }
        }
        for name in self.headers.keys() {
            if !is_token(name) {
                return Err(ConfigError::field(
                    format!("{at}.headers"),
                    format!("{name:?} is not a header name"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(v: serde_json::Value) -> String {
        parse(v.to_string().as_bytes()).unwrap_err().to_string()
    }

    fn base() -> serde_json::Value {
        json!({
            "domain": "demo",
            "rules": [{ "name": "r", "key": ["client"], "limits": [{ "requests": 5, "per": "1m" }] }]
        })
    }

    #[test]
    fn the_issue_example_parses_with_defaults() {
        let c = parse(
            br#"{
              "domain": "demo",
              "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 0 },
              "rules": [
                { "name": "per-client", "key": ["client"],
                  "limits": [ { "requests": 60, "per": "1m" }, { "requests": 10, "per": "1s" } ] },
                { "name": "uploads", "match": { "path_prefix": "/upload", "methods": ["POST"] },
                  "key": ["client", "path"], "limits": [ { "requests": 5, "per": "1m" } ] },
                { "name": "per-ip", "key": ["ip"], "limits": [ { "requests": 50, "per": "1s" } ] }
              ],
              "costs": [ { "match": { "path_prefix": "/search" }, "cost": 5 },
                         { "match": { "path_prefix": "/export" }, "cost": 50 } ],
              "response": { "headers": "both", "problem_type": "https://iana.org/assignments/http-problem-types#quota-exceeded" }
            }"#,
        )
        .unwrap();
        assert_eq!(c.rules.len(), 3);
        assert_eq!(c.rules[0].limits[1].per, Seconds(1));
        assert_eq!(c.max_buckets, DEFAULT_BUCKETS);
        assert_eq!(c.on_error, OnError::Allow);
        let d = parse(base().to_string().as_bytes()).unwrap();
        assert_eq!(d.identity.client_id_header, "x-client-id");
        assert_eq!(d.response.headers, HeaderStyle::Both);
        assert_eq!(d.response.problem_type, DEFAULT_PROBLEM_TYPE);
    }

    #[test]
    fn bad_duration_names_its_path() {
        let mut v = base();
        v["rules"][0]["limits"][0]["per"] = json!("10x");
        assert_eq!(err(v), r#"rules[0].limits[0].per: "10x" is not a duration"#);
    }

    #[test]
    fn unknown_fields_are_refused_with_their_path() {
        let mut v = base();
        v["rules"][0]["limitz"] = json!([]);
        let e = err(v);
        assert!(
            e.starts_with("rules[0].limitz: unknown field `limitz`"),
            "{e}"
        );
        let mut top = base();
        top["extra"] = json!(1);
        assert!(err(top).contains("unknown field `extra`"));
    }

    #[test]
    fn semantic_errors_name_their_path() {
        let cases = [
            ("/rules/0/limits/0/requests", json!(0), "rules[0].limits[0].requests: must be between 1 and 1000000000"),
            ("/rules/0/key/0", json!("cookie"), r#"rules[0].key[0]: "cookie" is not a key part (client, ip, method, path or header:<name>)"#),
            ("/rules/0/name", json!("has space"), r#"rules[0].name: "has space" must be 1-64 characters of A-Z a-z 0-9 - _ . :"#),
            ("/max_buckets", json!(1), "max_buckets: must be between 64 and 16777216"),
            ("/response/headers", json!("all"), "response.headers: unknown variant `all`, expected one of `both`, `legacy`, `ietf`, `none`"),
            ("/rules/0/limits", json!([]), "rules[0].limits: must hold 1 to 8 limits"),
            ("/identity", json!({"trusted_proxy_hops": 99}), "identity.trusted_proxy_hops: must be at most 16"),
        ];
        for (ptr, value, want) in cases {
            let mut v = base();
            let mut slot = &mut v;
            for seg in ptr.split('/').skip(1) {
                slot = match seg.parse::<usize>() {
                    Ok(i) if slot.is_array() => &mut slot[i],
                    _ => &mut slot[seg],
                };
            }
            *slot = value;
            assert_eq!(err(v), want, "{ptr}");
        }
    }

    #[test]
    fn duplicate_rule_names_and_bad_matches_are_refused() {
        let mut v = base();
        let r = v["rules"][0].clone();
        v["rules"].as_array_mut().unwrap().push(r);
        assert_eq!(err(v), r#"rules[1].name: "r" is used by an earlier rule"#);
        let mut m = base();
        m["rules"][0]["match"] = json!({"path_prefix": "api"});
        assert_eq!(
            err(m),
            r#"rules[0].match.path_prefix: "api" must start with /"#
        );
        let mut c = base();
        c["costs"] = json!([{"match": {"path_prefix": "/x"}, "cost": 0}]);
        assert_eq!(err(c), "costs[0].cost: must be between 1 and 1000000");
    }

    #[test]
    fn too_many_rules_names_the_limit() {
        let mut v = base();
        let rules: Vec<_> = (0..=MAX_RULES)
            .map(|i| json!({"name": format!("r{i}"), "limits": [{"requests": 1, "per": 1}]}))
            .collect();
        v["rules"] = json!(rules);
        assert_eq!(err(v), "rules: 1025 rules exceed the maximum of 1024");
    }

    #[test]
    fn not_json_and_wrong_types() {
        assert!(parse(b"{")
            .unwrap_err()
            .to_string()
            .starts_with("configuration is not valid JSON"));
        assert_eq!(
            err(json!({"domain": "d", "rules": "x"})),
            "rules: invalid type: string \"x\", expected a sequence"
        );
        assert_eq!(
            err(json!({"rules": []})),
            "configuration: missing field `domain`"
        );
    }
}
