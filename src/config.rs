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
    /// Named tiers; clients get one from their credential, the static map or `identity.default_tier`.
    #[serde(default)]
    pub tiers: BTreeMap<String, TierSpec>,
    /// Commercial quotas, kept by the gateway.
    #[serde(default)]
    pub quotas: Vec<QuotaSpec>,
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
    /// Decide in this proxy's shared data at its share of the limit,
    /// `requests / (instances × per)`, with a bucket of at least one request.
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
    /// Lease mode: spend batches of a global bucket's tokens locally; absent, one callout per request.
    #[serde(default)]
    pub lease: Option<Lease>,
    /// Bearer token sent to the gateway (`authorization: Bearer <token>`);
    /// prefer `token_env`, which keeps it out of the configuration.
    #[serde(default)]
    pub token: Option<Token>,
    /// Name of an environment variable of the VM holding the token (Envoy
    /// `vm_config.environment_variables`, Istio `WasmPlugin.spec.vmConfig.env`),
    /// read when the plugin is configured.
    #[serde(default)]
    pub token_env: Option<String>,
}

/// A bearer token: never printed (`Debug` shows `***`).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

/// Longest bearer token accepted (the gateway's bound too).
pub const MAX_TOKEN_LEN: usize = 4096;

/// True for an RFC 6750 `b64token` of at most [`MAX_TOKEN_LEN`] bytes:
/// `1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="`. Nothing
/// else can reach the `authorization` header (no space, CR, LF).
pub fn is_b64token(s: &str) -> bool {
    let body = s.trim_end_matches('=');
    s.len() <= MAX_TOKEN_LEN
        && !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

/// True for a POSIX-style environment variable name: `[A-Za-z_][A-Za-z0-9_]*`, ≤ 256 bytes.
fn is_env_name(s: &str) -> bool {
    s.len() <= 256
        && s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

impl Global {
    /// The `authorization` header value of the callouts (`Bearer <token>`),
    /// from `token` or from the environment variable `token_env` looked up
    /// with `env` (`std::env::var` in the filter: Envoy hands the VM's
    /// `environment_variables` to the module as its WASI environment).
    /// `None` when neither is set. The error never holds the token.
    pub fn bearer(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, ConfigError> {
        let token = match (&self.token, &self.token_env) {
            (Some(t), None) => t.0.clone(),
            (None, Some(name)) => {
                let value = env(name).ok_or_else(|| {
                    ConfigError::field(
                        "global.token_env",
                        format!(
                            "the VM has no environment variable {name:?} (Envoy: \
                             vm_config.environment_variables; Istio: WasmPlugin vmConfig.env)"
                        ),
                    )
                })?;
                if !is_b64token(&value) {
                    return Err(ConfigError::field(
                        "global.token_env",
                        format!(
                            "the value of {name:?} is not an RFC 6750 b64token of at most \
                             {MAX_TOKEN_LEN} bytes"
                        ),
                    ));
                }
                value
            }
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => {
                return Err(ConfigError::field(
                    "global.token",
                    "give token or token_env, not both",
                ))
            }
        };
        Ok(Some(format!("Bearer {token}")))
    }
}

/// Lease mode of global token-bucket rules.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lease {
    /// Share of the smallest limit reserved per batch (at least one token).
    pub fraction: f64,
    /// Longest a request waits for a batch: the timeout of a lease callout.
    #[serde(default = "default_lease_wait_ms")]
    pub max_wait_ms: u64,
    /// How long a batch may be spent; unspent tokens are given back with the next batch.
    #[serde(default = "default_lease_ttl_ms")]
    pub ttl_ms: u64,
    /// Path of the gateway's lease endpoint.
    #[serde(default = "default_lease_path")]
    pub path: String,
    /// Bound on leases held per proxy (one shared-data key each).
    #[serde(default = "default_max_leases")]
    pub max_leases: u64,
}

fn default_lease_wait_ms() -> u64 {
    20
}
fn default_lease_ttl_ms() -> u64 {
    2000
}
fn default_lease_path() -> String {
    "/v1/lease".into()
}
fn default_max_leases() -> u64 {
    4096
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
    /// Path under Envoy's `metadata.filter_metadata` holding the authenticated
    /// client id; when set, `client_id_header` is not consulted.
    #[serde(default)]
    pub client_id_metadata: Option<Vec<String>>,
    /// Path under `metadata.filter_metadata` holding the client's tier.
    #[serde(default)]
    pub tier_metadata: Option<Vec<String>>,
    /// Header holding the client's tier (only safe when the layer in front overwrites it).
    #[serde(default)]
    pub tier_header: Option<String>,
    /// Tier of clients whose tier is not known otherwise; required when `tiers` is set.
    #[serde(default)]
    pub default_tier: Option<String>,
    /// Static per-client settings, by client id.
    #[serde(default)]
    pub clients: BTreeMap<String, ClientSpec>,
}

impl Default for Identity {
    fn default() -> Self {
        Identity {
            client_id_header: default_client_header(),
            trusted_proxy_hops: 0,
            client_id_metadata: None,
            tier_metadata: None,
            tier_header: None,
            default_tier: None,
            clients: BTreeMap::new(),
        }
    }
}

fn default_client_header() -> String {
    "x-client-id".into()
}

/// Settings for one known client.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientSpec {
    /// The client's tier, over any tier its credential claims.
    #[serde(default)]
    pub tier: Option<String>,
    /// Never limited.
    #[serde(default)]
    pub unlimited: bool,
    /// Never rejected: every rule acts as `"mode": "shadow"` for this client.
    #[serde(default)]
    pub soft: bool,
    /// Limits that supersede the tier's, by rule name.
    #[serde(default)]
    pub limits: BTreeMap<String, Vec<LimitSpec>>,
    /// Quota amounts that supersede the tier's, by quota name.
    #[serde(default)]
    pub quotas: BTreeMap<String, u64>,
}

/// A tier's settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierSpec {
    /// Clients of this tier are never limited.
    #[serde(default)]
    pub unlimited: bool,
}

/// Whether a rule rejects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Deny over the limit.
    #[default]
    Enforce,
    /// Count, log and add headers, never reject.
    Shadow,
}

/// Graduated response: warn, then delay, then reject, then block.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Graduated {
    /// Share of the limit used from which a warning header is added.
    #[serde(default)]
    pub warn_at: Option<f64>,
    /// Share of the limit beyond which each request is held `delay_ms`.
    #[serde(default)]
    pub delay_at: Option<f64>,
    /// How long a delayed request is held.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// Share of the limit beyond which requests get 429.
    #[serde(default = "default_reject_at")]
    pub reject_at: f64,
    /// Share of the limit that the client's demand (denied requests included) may reach before a block.
    #[serde(default)]
    pub block_at: Option<f64>,
    /// How long a block lasts.
    #[serde(default)]
    pub block_for: Option<Seconds>,
}

fn default_reject_at() -> f64 {
    1.0
}

/// Calendar period of a quota, in UTC: the protocol crate's vocabulary,
/// written once for the filter and the gateway.
pub use ratelimit_protocol::Period;

/// What a quota counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuotaCount {
    /// Each request counts 1.
    #[default]
    Requests,
    /// Each request counts its cost.
    Cost,
}

/// A commercial quota kept by the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaSpec {
    /// Name, reported in the 403 body.
    pub name: String,
    /// Which requests count; absent means all.
    #[serde(default, rename = "match")]
    pub matches: Option<Match>,
    /// Parts of the quota's key, as for rules.
    #[serde(default)]
    pub key: Vec<String>,
    /// Calendar period.
    pub period: Period,
    /// Amount per period by tier.
    #[serde(default)]
    pub tiers: BTreeMap<String, u64>,
    /// Amount for tiers not listed (absent: those tiers have no quota).
    #[serde(default)]
    pub limit: Option<u64>,
    /// Where clients can buy more; in the 403 body and a `Link` header.
    pub upgrade_url: String,
    /// What counts.
    #[serde(default)]
    pub count: QuotaCount,
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
    /// Limits that must all pass; required unless `tiers` covers every tier.
    #[serde(default)]
    pub limits: Vec<LimitSpec>,
    /// Limits per tier, over `limits`.
    #[serde(default)]
    pub tiers: BTreeMap<String, Vec<LimitSpec>>,
    /// How the limits count.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// Decided in this proxy or by the gateway.
    #[serde(default)]
    pub scope: Scope,
    /// Enforce, or only watch.
    #[serde(default)]
    pub mode: Mode,
    /// Cost of a request for this rule, over `costs`.
    #[serde(default)]
    pub cost: Option<u64>,
    /// Warn, delay, reject and block stages.
    #[serde(default)]
    pub graduated: Option<Graduated>,
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
    /// `type` of the 403 body when a quota is spent.
    #[serde(default = "default_quota_problem_type")]
    pub quota_problem_type: String,
    /// Random spread of `Retry-After` values and block releases, as a share,
    /// upwards only: no client is told to come back before it would pass.
    #[serde(default = "default_jitter")]
    pub retry_jitter: f64,
}

/// Default problem type for a quota 403.
pub const DEFAULT_QUOTA_PROBLEM_TYPE: &str = "tag:ratelimit-wasm,2026:quota-exhausted";

fn default_quota_problem_type() -> String {
    DEFAULT_QUOTA_PROBLEM_TYPE.into()
}

fn default_jitter() -> f64 {
    0.1
}

impl Default for Response {
    fn default() -> Self {
        Response {
            headers: HeaderStyle::default(),
            problem_type: default_problem_type(),
            quota_problem_type: default_quota_problem_type(),
            retry_jitter: default_jitter(),
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

/// Longest URL, URI or path accepted where it reaches a header.
pub const MAX_URI_LEN: usize = 2048;

/// True when `s` holds RFC 3986 characters only (unreserved, gen-delims,
/// sub-delims), each `%` starting a two-hex-digit escape, at most one `#`, and
/// at most [`MAX_URI_LEN`] bytes: no space, quote, angle bracket, CR, LF, other
/// control or non-ASCII character can break out of a header or a `Link` `<…>`.
fn is_uri_text(s: &str) -> bool {
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        let ok = match b {
            b'%' => matches!((bytes.next(), bytes.next()),
                (Some(h), Some(l)) if h.is_ascii_hexdigit() && l.is_ascii_hexdigit()),
            _ => b.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=".contains(&b),
        };
        if !ok {
            return false;
        }
    }
    s.len() <= MAX_URI_LEN && s.bytes().filter(|&b| b == b'#').count() <= 1
}

/// The scheme of `s` (RFC 3986: a letter, then letters, digits, `+ - .`) and the rest.
fn split_scheme(s: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = s.split_once(':')?;
    let mut b = scheme.bytes();
    let first = b.next()?;
    (first.is_ascii_alphabetic() && b.all(|c| c.is_ascii_alphanumeric() || b"+-.".contains(&c)))
        .then_some((scheme, rest))
}

/// True for an absolute URI such as `https://…`, `urn:…`, `tag:…` or `about:blank`
/// (problem types: RFC 9457 asks for an absolute URI).
fn is_absolute_uri(s: &str) -> bool {
    is_uri_text(s) && split_scheme(s).is_some_and(|(_, rest)| !rest.is_empty())
}

/// True for an absolute `http` or `https` URL with a host: a link a client can follow.
fn is_http_url(s: &str) -> bool {
    let Some((scheme, rest)) = split_scheme(s) else {
        return false;
    };
    let web = scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https");
    let host = rest
        .strip_prefix("//")
        .and_then(|r| r.split(['/', '?', '#']).next())
        .unwrap_or("");
    web && !host.is_empty() && is_uri_text(s)
}

/// True for an `:authority` value: a host (name, IPv4 or `[IPv6]`) and an optional port.
fn is_authority(s: &str) -> bool {
    !s.is_empty() && s.len() <= 255 && is_uri_text(s) && !s.contains(['/', '?', '#', '@'])
}

/// True for a `:path` value: absolute, RFC 3986 characters, no fragment.
fn is_absolute_path(s: &str) -> bool {
    s.starts_with('/') && is_uri_text(s) && !s.contains('#')
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
            validate_key(&format!("{at}.key"), &rule.key)?;
            let covered =
                !self.tiers.is_empty() && self.tiers.keys().all(|t| rule.tiers.contains_key(t));
            validate_limits(&format!("{at}.limits"), &rule.limits, rule, covered)?;
            for (tier, limits) in &rule.tiers {
                if !self.tiers.contains_key(tier) {
                    return Err(ConfigError::field(
                        format!("{at}.tiers"),
                        format!("{tier:?} is not a tier declared in tiers"),
                    ));
                }
                validate_limits(&format!("{at}.tiers.{tier}"), limits, rule, false)?;
            }
            if let Some(cost) = rule.cost {
                check_cost(&format!("{at}.cost"), cost)?;
            }
            if rule.mode == Mode::Shadow && rule.scope == Scope::Global {
                return Err(ConfigError::field(
                    format!("{at}.mode"),
                    "shadow is supported for local rules only",
                ));
            }
            if let Some(g) = &rule.graduated {
                validate_graduated(&format!("{at}.graduated"), rule, g)?;
            }
        }
        self.validate_global()?;
        self.validate_identity()?;
        self.validate_quotas()?;
        for (i, cost) in self.costs.iter().enumerate() {
            cost.matches.validate(&format!("costs[{i}].match"))?;
            check_cost(&format!("costs[{i}].cost"), cost.cost)?;
        }
        if !(0.0..=0.5).contains(&self.response.retry_jitter) {
            return Err(ConfigError::field(
                "response.retry_jitter",
                "must be between 0 and 0.5",
            ));
        }
        for (field, value) in [
            ("problem_type", &self.response.problem_type),
            ("quota_problem_type", &self.response.quota_problem_type),
        ] {
            if !is_absolute_uri(value) {
                return Err(ConfigError::field(
                    format!("response.{field}"),
                    format!("{value:?} is not an absolute URI of RFC 3986 characters"),
                ));
            }
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

fn validate_key(at: &str, key: &[String]) -> Result<(), ConfigError> {
    if key.len() > MAX_KEY_PARTS {
        return Err(ConfigError::field(
            at,
            format!("at most {MAX_KEY_PARTS} parts"),
        ));
    }
    for (k, part) in key.iter().enumerate() {
        let ok = KEY_PARTS.contains(&part.as_str())
            || part.strip_prefix("header:").is_some_and(is_token);
        if !ok {
            return Err(ConfigError::field(
                format!("{at}[{k}]"),
                format!("{part:?} is not a key part (client, ip, method, path or header:<name>)"),
            ));
        }
    }
    Ok(())
}

/// Checks one set of limits of `rule`, wherever it is written: the rule's own
/// `limits`, a tier's, or a client's override. Every set of a rule takes the
/// same path to the buckets and the gateway, so every check lives here once.
fn validate_limits(
    at: &str,
    limits: &[LimitSpec],
    rule: &Rule,
    may_be_empty: bool,
) -> Result<(), ConfigError> {
    if (limits.is_empty() && !may_be_empty) || limits.len() > MAX_LIMITS_PER_RULE {
        return Err(ConfigError::field(
            at,
            format!("must hold 1 to {MAX_LIMITS_PER_RULE} limits"),
        ));
    }
    if rule.graduated.is_some() && limits.len() > 1 {
        return Err(ConfigError::field(
            at,
            "needs exactly one limit: the rule is graduated, its stages are shares of it",
        ));
    }
    for (l, limit) in limits.iter().enumerate() {
        if limit.requests == 0 || limit.requests > MAX_REQUESTS {
            return Err(ConfigError::field(
                format!("{at}[{l}].requests"),
                format!("must be between 1 and {MAX_REQUESTS}"),
            ));
        }
        let product = limit
            .requests
            .saturating_mul(limit.per.0.saturating_mul(1000));
        if rule.scope == Scope::Global && product > MAX_GLOBAL_PRODUCT {
            return Err(ConfigError::field(
                format!("{at}[{l}].per"),
                "requests × per must stay under 2^53 milliseconds for a global rule",
            ));
        }
    }
    Ok(())
}

fn check_cost(at: &str, cost: u64) -> Result<(), ConfigError> {
    if cost == 0 || cost > MAX_COST {
        return Err(ConfigError::field(
            at,
            format!("must be between 1 and {MAX_COST}"),
        ));
    }
    Ok(())
}

/// Most a graduated share may be.
pub const MAX_SHARE: f64 = 100.0;

fn validate_graduated(at: &str, rule: &Rule, g: &Graduated) -> Result<(), ConfigError> {
    if rule.algorithm != Algorithm::TokenBucket {
        return Err(ConfigError::field(
            at,
            "needs \"algorithm\": \"token_bucket\"",
        ));
    }
    if rule.scope != Scope::Local {
        return Err(ConfigError::field(at, "is supported for local rules only"));
    }
    let share = |name: &str, v: f64, min: f64| -> Result<(), ConfigError> {
        if !v.is_finite() || v < min || v > MAX_SHARE {
            return Err(ConfigError::field(
                format!("{at}.{name}"),
                format!("must be between {min} and {MAX_SHARE}"),
            ));
        }
        Ok(())
    };
    share("reject_at", g.reject_at, 1.0)?;
    if let Some(w) = g.warn_at {
        share("warn_at", w, 0.01)?;
        if w > g.reject_at {
            return Err(ConfigError::field(
                format!("{at}.warn_at"),
                "must not exceed reject_at",
            ));
        }
    }
    match (g.delay_at, g.delay_ms) {
        (None, None) => {}
        (Some(d), Some(ms)) => {
            share("delay_at", d, 0.01)?;
            if d >= g.reject_at {
                return Err(ConfigError::field(
                    format!("{at}.delay_at"),
                    "must be below reject_at",
                ));
            }
            if !(1..=60_000).contains(&ms) {
                return Err(ConfigError::field(
                    format!("{at}.delay_ms"),
                    "must be between 1 and 60000",
                ));
            }
        }
        (Some(_), None) => {
            return Err(ConfigError::field(
                format!("{at}.delay_ms"),
                "required with delay_at",
            ))
        }
        (None, Some(_)) => {
            return Err(ConfigError::field(
                format!("{at}.delay_at"),
                "required with delay_ms",
            ))
        }
    }
    match (g.block_at, g.block_for) {
        (None, None) => {}
        (Some(b), Some(_)) => {
            share("block_at", b, 1.0)?;
            if b < g.reject_at {
                return Err(ConfigError::field(
                    format!("{at}.block_at"),
                    "must not be below reject_at",
                ));
            }
        }
        (Some(_), None) => {
            return Err(ConfigError::field(
                format!("{at}.block_for"),
                "required with block_at",
            ))
        }
        (None, Some(_)) => {
            return Err(ConfigError::field(
                format!("{at}.block_at"),
                "required with block_for",
            ))
        }
    }
    Ok(())
}

/// Largest quota amount.
pub const MAX_QUOTA: u64 = 1 << 50;

impl Config {
    fn validate_identity(&self) -> Result<(), ConfigError> {
        let id = &self.identity;
        for (i, name) in self.tiers.keys().enumerate() {
            if !is_plain_name(name) {
                return Err(ConfigError::field(
                    "tiers",
                    format!("tier {i} {name:?} must be 1-64 characters of A-Z a-z 0-9 - _ . :"),
                ));
            }
        }
        match (&id.default_tier, self.tiers.is_empty()) {
            (None, false) => {
                return Err(ConfigError::field(
                    "identity.default_tier",
                    "required when tiers are declared",
                ))
            }
            (Some(t), _) if !self.tiers.contains_key(t) => {
                return Err(ConfigError::field(
                    "identity.default_tier",
                    format!("{t:?} is not a tier declared in tiers"),
                ))
            }
            _ => {}
        }
        if let Some(h) = &id.tier_header {
            if !is_token(h) {
                return Err(ConfigError::field(
                    "identity.tier_header",
                    format!("{h:?} is not a header name"),
                ));
            }
        }
        for (field, path) in [
            ("client_id_metadata", &id.client_id_metadata),
            ("tier_metadata", &id.tier_metadata),
        ] {
            if let Some(path) = path {
                if path.is_empty() || path.len() > 8 || path.iter().any(|p| p.is_empty()) {
                    return Err(ConfigError::field(
                        format!("identity.{field}"),
                        "must be 1 to 8 non-empty names: filter name, then the fields inside its metadata",
                    ));
                }
            }
        }
        for (client, spec) in &id.clients {
            let at = format!("identity.clients.{client}");
            if client.is_empty() {
                return Err(ConfigError::field(
                    "identity.clients",
                    "a client id must not be empty",
                ));
            }
            if let Some(t) = &spec.tier {
                if !self.tiers.contains_key(t) {
                    return Err(ConfigError::field(
                        format!("{at}.tier"),
                        format!("{t:?} is not a tier declared in tiers"),
                    ));
                }
            }
            for (rule, limits) in &spec.limits {
                let Some(r) = self.rules.iter().find(|r| r.name == *rule) else {
                    return Err(ConfigError::field(
                        format!("{at}.limits"),
                        format!("{rule:?} is not a rule name"),
                    ));
                };
                validate_limits(&format!("{at}.limits.{rule}"), limits, r, false)?;
            }
            for (quota, amount) in &spec.quotas {
                if !self.quotas.iter().any(|q| q.name == *quota) {
                    return Err(ConfigError::field(
                        format!("{at}.quotas"),
                        format!("{quota:?} is not a quota name"),
                    ));
                }
                if *amount > MAX_QUOTA {
                    return Err(ConfigError::field(
                        format!("{at}.quotas.{quota}"),
                        format!("must be at most {MAX_QUOTA}"),
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_quotas(&self) -> Result<(), ConfigError> {
        if !self.quotas.is_empty() && self.global.is_none() {
            return Err(ConfigError::field(
                "quotas",
                "need global: the gateway keeps quotas",
            ));
        }
        let mut names = HashSet::new();
        for (i, q) in self.quotas.iter().enumerate() {
            let at = format!("quotas[{i}]");
            if !is_plain_name(&q.name)
                || !names.insert(q.name.as_str())
                || self.rules.iter().any(|r| r.name == q.name)
            {
                return Err(ConfigError::field(
                    format!("{at}.name"),
                    format!("{:?} must be a unique name of 1-64 characters of A-Z a-z 0-9 - _ . : (not a rule's)", q.name),
                ));
            }
            if let Some(m) = &q.matches {
                m.validate(&format!("{at}.match"))?;
            }
            validate_key(&format!("{at}.key"), &q.key)?;
            if !is_http_url(&q.upgrade_url) {
                return Err(ConfigError::field(
                    format!("{at}.upgrade_url"),
                    format!(
                        "{:?} is not an absolute http(s) URL of RFC 3986 characters",
                        q.upgrade_url
                    ),
                ));
            }
            for (tier, amount) in &q.tiers {
                if !self.tiers.contains_key(tier) {
                    return Err(ConfigError::field(
                        format!("{at}.tiers"),
                        format!("{tier:?} is not a tier declared in tiers"),
                    ));
                }
                if *amount > MAX_QUOTA {
                    return Err(ConfigError::field(
                        format!("{at}.tiers.{tier}"),
                        format!("must be at most {MAX_QUOTA}"),
                    ));
                }
            }
            if q.limit.is_some_and(|l| l > MAX_QUOTA) {
                return Err(ConfigError::field(
                    format!("{at}.limit"),
                    format!("must be at most {MAX_QUOTA}"),
                ));
            }
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
        // Istio's cluster names hold `|`, so any visible ASCII; never a control character.
        if g.cluster.is_empty() || !g.cluster.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::field(
                "global.cluster",
                format!(
                    "{:?} must name an Envoy cluster in visible ASCII",
                    g.cluster
                ),
            ));
        }
        if !is_authority(&g.authority) {
            return Err(ConfigError::field(
                "global.authority",
                format!("{:?} is not a host with an optional port", g.authority),
            ));
        }
        check_path("global.path", &g.path)?;
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
        if let Some(l) = &g.lease {
            validate_lease(l)?;
        }
        if g.token.is_some() && g.token_env.is_some() {
            return Err(ConfigError::field(
                "global.token",
                "give token or token_env, not both",
            ));
        }
        if g.token.as_ref().is_some_and(|t| !is_b64token(&t.0)) {
            return Err(ConfigError::field(
                "global.token",
                format!("not an RFC 6750 b64token of at most {MAX_TOKEN_LEN} bytes"),
            ));
        }
        if let Some(name) = &g.token_env {
            if !is_env_name(name) {
                return Err(ConfigError::field(
                    "global.token_env",
                    format!(
                        "{name:?} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A callout's `:path`.
fn check_path(at: &str, path: &str) -> Result<(), ConfigError> {
    if !is_absolute_path(path) {
        return Err(ConfigError::field(
            at,
            format!("{path:?} is not an absolute path of RFC 3986 characters"),
        ));
    }
    Ok(())
}

fn validate_lease(l: &Lease) -> Result<(), ConfigError> {
    if !(l.fraction > 0.0 && l.fraction <= 1.0) {
        return Err(ConfigError::field(
            "global.lease.fraction",
            format!("{} must be above 0 and at most 1", l.fraction),
        ));
    }
    if !(1..=60_000).contains(&l.max_wait_ms) {
        return Err(ConfigError::field(
            "global.lease.max_wait_ms",
            "must be between 1 and 60000 (Envoy treats 0 as no timeout)",
        ));
    }
    if !(10..=3_600_000).contains(&l.ttl_ms) {
        return Err(ConfigError::field(
            "global.lease.ttl_ms",
            "must be between 10 and 3600000",
        ));
    }
    check_path("global.lease.path", &l.path)?;
    if !(1..=1 << 20).contains(&l.max_leases) {
        return Err(ConfigError::field(
            "global.lease.max_leases",
            "must be between 1 and 1048576",
        ));
    }
    Ok(())
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

    #[test]
    fn policy_fields_are_checked_with_their_paths() {
        let cases = [
            (json!({"tiers": {"free": {}}}), "identity.default_tier: required when tiers are declared"),
            (
                json!({"tiers": {"free": {}}, "identity": {"default_tier": "gold"}}),
                r#"identity.default_tier: "gold" is not a tier declared in tiers"#,
            ),
            (
                json!({"identity": {"clients": {"a": {"limits": {"nope": []}}}}}),
                r#"identity.clients.a.limits: "nope" is not a rule name"#,
            ),
            (
                json!({"quotas": [{"name": "q", "period": "month", "upgrade_url": "https://x"}]}),
                "quotas: need global: the gateway keeps quotas",
            ),
            (
                json!({"quotas": [{"name": "q", "period": "week", "upgrade_url": "https://x"}], "global": {"cluster": "gw"}}),
                "quotas[0].period: unknown variant `week`, expected one of `minute`, `hour`, `day`, `month`",
            ),
            (json!({"response": {"retry_jitter": 0.9}}), "response.retry_jitter: must be between 0 and 0.5"),
        ];
        for (extra, want) in cases {
            let mut v = base();
            for (k, val) in extra.as_object().unwrap() {
                v[k] = val.clone();
            }
            assert_eq!(err(v), want);
        }
    }

    #[test]
    fn graduated_and_shadow_constraints() {
        let mut v = base();
        v["rules"][0]["graduated"] = json!({"delay_at": 1.0});
        assert_eq!(
            err(v),
            "rules[0].graduated.delay_ms: required with delay_at"
        );
        let mut v = base();
        v["rules"][0]["graduated"] = json!({"reject_at": 1.2, "block_at": 1.1, "block_for": "1m"});
        assert_eq!(
            err(v),
            "rules[0].graduated.block_at: must not be below reject_at"
        );
        let mut v = base();
        v["rules"][0]["limits"] = json!([{"requests": 1, "per": 1}, {"requests": 2, "per": 2}]);
        v["rules"][0]["graduated"] = json!({"warn_at": 0.5});
        assert_eq!(
            err(v),
            "rules[0].limits: needs exactly one limit: the rule is graduated, its stages are shares of it"
        );
        let mut v = base();
        v["rules"][0]["algorithm"] = json!("sliding_window");
        v["rules"][0]["graduated"] = json!({"warn_at": 0.5});
        assert_eq!(
            err(v),
            r#"rules[0].graduated: needs "algorithm": "token_bucket""#
        );
        let mut v = base();
        v["global"] = json!({"cluster": "gw"});
        v["rules"][0]["scope"] = json!("global");
        v["rules"][0]["mode"] = json!("shadow");
        assert_eq!(
            err(v),
            "rules[0].mode: shadow is supported for local rules only"
        );
        let mut v = base();
        v["rules"][0]["scope"] = json!("global");
        assert_eq!(
            err(v),
            r#"global: required because rules[0] has "scope": "global""#
        );
        let mut v = base();
        v["global"] = json!({"cluster": "gw", "timeout_ms": 0});
        assert_eq!(
            err(v),
            "global.timeout_ms: must be between 1 and 60000 (Envoy treats 0 as no timeout)"
        );
    }

    #[test]
    fn lease_settings_are_checked_with_their_paths() {
        let cases = [
            (json!({"fraction": 0}), "global.lease.fraction: 0 must be above 0 and at most 1"),
            (json!({"fraction": 1.5}), "global.lease.fraction: 1.5 must be above 0 and at most 1"),
            (
                json!({"fraction": 0.1, "max_wait_ms": 0}),
                "global.lease.max_wait_ms: must be between 1 and 60000 (Envoy treats 0 as no timeout)",
            ),
            (json!({"fraction": 0.1, "ttl_ms": 5}), "global.lease.ttl_ms: must be between 10 and 3600000"),
            (json!({"fraction": 0.1, "path": "x"}), r#"global.lease.path: "x" is not an absolute path of RFC 3986 characters"#),
            (json!({"fraction": 0.1, "max_leases": 0}), "global.lease.max_leases: must be between 1 and 1048576"),
            (json!({"fraction": 0.1, "size": 3}), "global.lease.size: unknown field `size`, expected one of `fraction`, `max_wait_ms`, `ttl_ms`, `path`, `max_leases`"),
        ];
        for (lease, want) in cases {
            let mut v = base();
            v["global"] = json!({"cluster": "gw", "lease": lease});
            assert_eq!(err(v), want);
        }
        let mut v = base();
        v["global"] = json!({"cluster": "gw", "lease": {"fraction": 0.05}});
        let c = parse(v.to_string().as_bytes()).unwrap();
        let l = c.global.unwrap().lease.unwrap();
        assert_eq!(
            (l.max_wait_ms, l.ttl_ms, l.path.as_str(), l.max_leases),
            (20, 2000, "/v1/lease", 4096)
        );
    }

    #[test]
    fn tiers_may_replace_the_rule_limits() {
        let mut v = base();
        v["tiers"] = json!({"free": {}, "pro": {}});
        v["identity"] = json!({"default_tier": "free"});
        v["rules"][0]["limits"] = json!([]);
        v["rules"][0]["tiers"] = json!({"free": [{"requests": 1, "per": 1}]});
        assert_eq!(err(v.clone()), "rules[0].limits: must hold 1 to 8 limits");
        v["rules"][0]["tiers"]["pro"] = json!([{"requests": 5, "per": 1}]);
        assert!(parse(v.to_string().as_bytes()).is_ok());
    }

    /// 10^6 per 366 d is 3.2 × 10^16 ms, past 2^53: the gateway would answer
    /// 400 to every request and each would take the failure mode.
    fn year() -> serde_json::Value {
        json!([{"requests": 1_000_000, "per": "366d"}])
    }

    fn two_global_rules() -> serde_json::Value {
        let mut v = base();
        v["global"] = json!({"cluster": "gw"});
        v["rules"] = json!([
            {"name": "l", "limits": [{"requests": 1, "per": 1}]},
            {"name": "g", "scope": "global", "key": ["client"], "limits": [{"requests": 5, "per": "1m"}]}
        ]);
        v
    }

    #[test]
    fn the_global_exactness_bound_holds_in_every_limit_set() {
        let reason = "requests × per must stay under 2^53 milliseconds for a global rule";
        let mut own = two_global_rules();
        own["rules"][1]["limits"] = year();
        assert_eq!(err(own), format!("rules[1].limits[0].per: {reason}"));
        let mut tier = two_global_rules();
        tier["tiers"] = json!({"free": {}, "gold": {}});
        tier["identity"] = json!({"default_tier": "free"});
        tier["rules"][1]["tiers"] = json!({"gold": year()});
        assert_eq!(err(tier), format!("rules[1].tiers.gold[0].per: {reason}"));
        let mut client = two_global_rules();
        client["identity"] = json!({"clients": {"acme": {"limits": {"g": year()}}}});
        assert_eq!(
            err(client),
            format!("identity.clients.acme.limits.g[0].per: {reason}")
        );
        // A local rule never reaches the gateway: the same figure is fine there.
        let mut local = two_global_rules();
        local["identity"] = json!({"clients": {"acme": {"limits": {"l": year()}}}});
        local["rules"][0]["limits"] = year();
        assert!(parse(local.to_string().as_bytes()).is_ok());
        // Each limit set is held to the same count and range checks.
        let mut zero = two_global_rules();
        zero["identity"] =
            json!({"clients": {"acme": {"limits": {"g": [{"requests": 0, "per": 1}]}}}});
        assert_eq!(
            err(zero),
            "identity.clients.acme.limits.g[0].requests: must be between 1 and 1000000000"
        );
    }

    #[test]
    fn strings_that_reach_a_header_or_a_body_are_checked_as_what_they_are() {
        let quota = |url: &str| {
            let mut v = base();
            v["global"] = json!({"cluster": "gw"});
            v["quotas"] = json!([{"name": "q", "period": "month", "limit": 5, "upgrade_url": url}]);
            v
        };
        let url_reason = "is not an absolute http(s) URL of RFC 3986 characters";
        for bad in [
            "https://x/\r\nSet-Cookie:session=evil\r\nX-A:\u{1}",
            "https://x/a b",
            "https://x/<a>",
            "javascript:alert(1)",
            "/upgrade",
            "https://",
            "https://x/%zz",
            "https://x/\u{e9}",
        ] {
            assert_eq!(
                err(quota(bad)),
                format!("quotas[0].upgrade_url: {bad:?} {url_reason}")
            );
        }
        for good in [
            "https://example.com/upgrade",
            "HTTP://e.com:8080/up?plan=pro&from=a%20b#top",
            "https://[::1]/x",
        ] {
            assert!(parse(quota(good).to_string().as_bytes()).is_ok(), "{good}");
        }
        let uri_reason = "is not an absolute URI of RFC 3986 characters";
        for (field, bad) in [
            ("problem_type", "https://e.com/p\n"),
            ("problem_type", "no-scheme"),
            ("problem_type", "1x:y"),
            ("quota_problem_type", "tag:a b"),
            ("quota_problem_type", ""),
        ] {
            let mut v = base();
            v["response"] = json!({ field: bad });
            assert_eq!(err(v), format!("response.{field}: {bad:?} {uri_reason}"));
        }
        let mut v = base();
        v["response"] =
            json!({"problem_type": "about:blank", "quota_problem_type": "urn:example:quota"});
        assert!(parse(v.to_string().as_bytes()).is_ok());
        // The callout's :authority and :path headers.
        let global = |g: serde_json::Value| {
            let mut v = base();
            v["global"] = g;
            err(v)
        };
        assert_eq!(
            global(json!({"cluster": "gw", "authority": "gw\r\nx-a: 1"})),
            r#"global.authority: "gw\r\nx-a: 1" is not a host with an optional port"#
        );
        assert_eq!(
            global(json!({"cluster": "gw", "path": "/v1/check\n"})),
            r#"global.path: "/v1/check\n" is not an absolute path of RFC 3986 characters"#
        );
        assert_eq!(
            global(json!({"cluster": "gw", "lease": {"fraction": 0.1, "path": "/v1/lease x"}})),
            r#"global.lease.path: "/v1/lease x" is not an absolute path of RFC 3986 characters"#
        );
        assert_eq!(
            global(json!({"cluster": "gw\n"})),
            r#"global.cluster: "gw\n" must name an Envoy cluster in visible ASCII"#
        );
        let mut v = base();
        v["global"] = json!({"cluster": "outbound|8080||gw.ns.svc.cluster.local",
            "authority": "gw.ns.svc.cluster.local:8080", "path": "/v1/check?x=1"});
        assert!(parse(v.to_string().as_bytes()).is_ok());
    }

    #[test]
    fn the_gateway_token_is_a_b64token_from_the_config_or_the_environment() {
        let global = |g: serde_json::Value| {
            let mut v = base();
            v["global"] = g;
            parse(v.to_string().as_bytes())
        };
        let err = |g| global(g).unwrap_err().to_string();
        assert_eq!(
            err(json!({"cluster": "gw", "token": "a b"})),
            "global.token: not an RFC 6750 b64token of at most 4096 bytes"
        );
        assert_eq!(
            err(json!({"cluster": "gw", "token": "x\r\nevil: 1"})),
            "global.token: not an RFC 6750 b64token of at most 4096 bytes"
        );
        assert_eq!(
            err(json!({"cluster": "gw", "token": "abc", "token_env": "T"})),
            "global.token: give token or token_env, not both"
        );
        assert_eq!(
            err(json!({"cluster": "gw", "token_env": "1T"})),
            r#"global.token_env: "1T" is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"#
        );
        let inline = global(json!({"cluster": "gw", "token": "s3cr3t.A/b+c=="})).unwrap();
        let g = inline.global.unwrap();
        assert_eq!(
            g.bearer(|_| None).unwrap().as_deref(),
            Some("Bearer s3cr3t.A/b+c==")
        );
        assert!(
            !format!("{g:?}").contains("s3cr3t"),
            "Debug shows the token"
        );
        let from_env = global(json!({"cluster": "gw", "token_env": "RL_TOKEN"})).unwrap();
        let g = from_env.global.unwrap();
        let env = |v: &'static str| move |n: &str| (n == "RL_TOKEN").then(|| v.to_string());
        assert_eq!(
            g.bearer(env("tok-1")).unwrap().as_deref(),
            Some("Bearer tok-1")
        );
        let bad = g.bearer(env("tok 1")).unwrap_err().to_string();
        assert_eq!(
            bad,
            r#"global.token_env: the value of "RL_TOKEN" is not an RFC 6750 b64token of at most 4096 bytes"#
        );
        assert_eq!(
            g.bearer(|_| None).unwrap_err().to_string(),
            r#"global.token_env: the VM has no environment variable "RL_TOKEN" (Envoy: vm_config.environment_variables; Istio: WasmPlugin vmConfig.env)"#
        );
        let none = global(json!({"cluster": "gw"})).unwrap().global.unwrap();
        assert_eq!(none.bearer(|_| Some("x".into())).unwrap(), None);
    }
}
