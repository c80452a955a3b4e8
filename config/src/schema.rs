//! The schema of the plugin's JSON configuration: every field, its type and
//! its default, and the bounds the validation holds them to. Field names are a
//! public contract: unknown fields are refused.

use super::condition::ValueMatch;
use super::duration::Seconds;
use super::key::KeyPart;
use super::usage::{CostFrom, StatusMatch};
use super::vocab::Algorithm;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

/// Most rules one configuration may hold; more make every request slower to match.
pub const MAX_RULES: usize = 1024;
/// Most quotas one configuration may hold: a request may count against
/// each, and one gateway check carries them all (the protocol's bound).
pub const MAX_QUOTAS: usize = super::bounds::MAX_QUOTAS;
/// Most global rules one configuration may hold: a request may match each,
/// and one gateway check carries a bucket per global rule (the protocol's bound).
pub const MAX_GLOBAL_RULES: usize = super::bounds::MAX_BUCKETS;
/// Most limits one rule may hold; they share one shared-data entry, and a
/// gateway bucket carries as many (the protocol's bound).
pub const MAX_LIMITS_PER_RULE: usize = super::bounds::MAX_LIMITS;
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
    pub(crate) fn field(path: impl Into<String>, reason: impl Into<String>) -> Self {
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
    /// What the per-rule counters count.
    #[serde(default)]
    pub metrics: Metrics,
    /// What the filter leaves for Envoy's access log.
    #[serde(default)]
    pub access_log: AccessLog,
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

/// How the filter calls the gateway.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// `dispatch_http_call`: a `POST` of the JSON body to the configured
    /// path, over whatever protocol the Envoy cluster speaks (HTTP/1.1
    /// keep-alive in the shipped configurations).
    #[default]
    Http,
    /// `dispatch_grpc_call`: the same JSON body as the message of the
    /// gateway's gRPC method (`ratelimit_wasm.v3.Gateway`, served on its
    /// `--grpc-listen`); the cluster must speak HTTP/2, and the paths are not used.
    Grpc,
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
    /// How the callouts go: `http` or `grpc`.
    #[serde(default)]
    pub transport: Transport,
    /// Path of the check endpoint.
    #[serde(default = "default_check_path")]
    pub path: String,
    /// Path of the settle endpoint (`cost_from` and `charge_on` on global rules).
    #[serde(default = "default_settle_path")]
    pub settle_path: String,
    /// Callout timeout; 0 is refused because Envoy treats it as no timeout.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Coalescing: while a check is in flight, the worker's next checks
    /// wait and go together in one batch to `batch_path`; a check waits at
    /// most this long once another arrives. 0 turns coalescing off: one
    /// call per request to `path` (protocol version 2).
    #[serde(default = "default_coalesce_us")]
    pub coalesce_us: u64,
    /// Most checks in one batch (1 to `bounds::MAX_BATCH`).
    #[serde(default = "default_max_batch")]
    pub max_batch: u64,
    /// Path of the batched check endpoint (protocol version 3).
    #[serde(default = "default_batch_path")]
    pub batch_path: String,
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
    /// Entries of the deny cache: a gateway denial is remembered in shared
    /// data and answered here until the gateway's wait is over; 0 turns it off.
    #[serde(default = "default_deny_cache")]
    pub deny_cache: u64,
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

/// Most bytes of `global.cluster` and `global.authority` together with
/// `transport: grpc`, so that [`Global::grpc_service`]'s lengths (with the
/// two fields' tags) stay under 128.
pub const MAX_GRPC_SERVICE_NAMES: usize = 123;

/// A length-delimited protobuf field (`tag`: field number and wire type 2)
/// whose length is one byte: longer values are cut (validation bounds them).
fn push_field(out: &mut String, tag: u8, value: &str) {
    let mut len = value.len().min(0x7f);
    while !value.is_char_boundary(len) {
        len -= 1;
    }
    out.push(char::from(tag));
    out.push(char::from(len as u8));
    out.push_str(value.get(..len).unwrap_or_default());
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
pub(super) fn is_env_name(s: &str) -> bool {
    s.len() <= 256
        && s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

impl Global {
    /// `envoy.config.core.v3.GrpcService { envoy_grpc: { cluster_name,
    /// authority } }` in protobuf: what a gRPC callout names as its
    /// upstream. Envoy would take a bare cluster name too, but only after
    /// failing to parse it as this message, which some names do not fail;
    /// and a bare name cannot carry the authority. Validation keeps the
    /// names within [`MAX_GRPC_SERVICE_NAMES`], so every length is one byte
    /// and the whole stays ASCII (the proxy-wasm SDK passes it as a `&str`).
    pub fn grpc_service(&self) -> String {
        let mut envoy_grpc = String::new();
        push_field(&mut envoy_grpc, 0x0a, &self.cluster);
        push_field(&mut envoy_grpc, 0x12, &self.authority);
        let mut service = String::new();
        push_field(&mut service, 0x0a, &envoy_grpc);
        service
    }

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

pub(super) fn default_lease_wait_ms() -> u64 {
    20
}
pub(super) fn default_lease_ttl_ms() -> u64 {
    2000
}
pub(super) fn default_lease_path() -> String {
    "/v1/lease".into()
}
pub(super) fn default_max_leases() -> u64 {
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

pub(super) fn default_authority() -> String {
    "ratelimit-gateway".into()
}
pub(super) fn default_check_path() -> String {
    "/v1/check".into()
}

pub(super) fn default_settle_path() -> String {
    "/v1/settle".to_string()
}
pub(super) fn default_coalesce_us() -> u64 {
    500
}
pub(super) fn default_max_batch() -> u64 {
    64
}
pub(super) fn default_batch_path() -> String {
    "/v3/check".to_string()
}
pub(super) fn default_timeout_ms() -> u64 {
    50
}
pub(super) fn default_instances() -> u64 {
    1
}
pub(super) fn default_deny_cache() -> u64 {
    4096
}
pub(super) fn default_failures() -> u32 {
    5
}
pub(super) fn default_cooldown_ms() -> u64 {
    2000
}

pub(super) fn default_buckets() -> u64 {
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

pub(super) fn default_client_header() -> String {
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

pub(super) fn default_reject_at() -> f64 {
    1.0
}

/// Calendar period of a quota, in UTC: the protocol crate's vocabulary,
/// written once for the filter and the gateway.
pub use super::vocab::Period;

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
    pub key: Vec<KeyPart>,
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
    pub key: Vec<KeyPart>,
    /// Limits that must all pass; required unless `tiers` covers every tier.
    #[serde(default)]
    pub limits: Vec<LimitSpec>,
    /// Limits per tier, over `limits`.
    #[serde(default)]
    pub tiers: BTreeMap<String, Vec<LimitSpec>>,
    /// Named sets of limits, one picked per request by a value in metadata,
    /// over `limits`.
    #[serde(default)]
    pub limits_by: Option<LimitsBy>,
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
    /// The cost is read from the response, over `cost` and `costs`.
    #[serde(default)]
    pub cost_from: Option<CostFrom>,
    /// Statuses whose responses are charged; another status refunds the
    /// request's charge. Absent: every status.
    #[serde(default)]
    pub charge_on: Option<Vec<StatusMatch>>,
}

impl Rule {
    /// Whether the rule limits requests in flight (its own `limits` hold
    /// `{"concurrent": N}`; validation holds every other set to the same).
    pub fn is_concurrent(&self) -> bool {
        self.limits.iter().any(LimitSpec::is_concurrent)
            || (self.limits.is_empty()
                && self.tiers.values().flatten().any(LimitSpec::is_concurrent))
    }
}

/// `rules[].limits_by`: the set of limits a request gets, named by a string
/// in the matched route's metadata or in the request's dynamic metadata
/// (exactly one of the two). A request without that string, or naming a set
/// not in `sets`, gets the rule's own `limits`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsBy {
    /// `<namespace>/<key>…` in the matched route's `filter_metadata`.
    #[serde(default)]
    pub route_metadata: Option<String>,
    /// `<filter>/<key>…` in the request's dynamic metadata (what
    /// `jwt_authn` or `ext_authz` wrote).
    #[serde(default)]
    pub metadata: Option<String>,
    /// The sets by name: plain names (A-Z a-z 0-9 - _ . :), 1 to
    /// [`MAX_LIMIT_SETS`](crate::schema::MAX_LIMIT_SETS).
    pub sets: BTreeMap<String, Vec<LimitSpec>>,
}

/// Most named sets of one `limits_by`.
pub const MAX_LIMIT_SETS: usize = 64;

/// Where `limits_by` reads the name of a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitsSource {
    /// The matched route's `filter_metadata` (`xds.route_metadata`).
    RouteMetadata,
    /// The request's dynamic metadata (`metadata.filter_metadata`).
    Metadata,
}

impl LimitsBy {
    /// Where the name is read, and its path as written; `None` unless
    /// exactly one of `route_metadata` and `metadata` is given.
    pub fn source(&self) -> Option<(LimitsSource, &str)> {
        match (&self.route_metadata, &self.metadata) {
            (Some(p), None) => Some((LimitsSource::RouteMetadata, p)),
            (None, Some(p)) => Some((LimitsSource::Metadata, p)),
            _ => None,
        }
    }
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
    /// The host (`:authority`, port stripped, any case) is this one, or
    /// under this domain (`*.example.com`).
    #[serde(default)]
    pub host: Option<String>,
    /// The host (port stripped, lower-case) matches this regular expression whole.
    #[serde(default)]
    pub host_regex: Option<String>,
    /// The path (without query) matches this regular expression whole.
    #[serde(default)]
    pub path_regex: Option<String>,
    /// The name of the Envoy route the request matched (`xds.route_name`).
    #[serde(default)]
    pub route: Option<String>,
    /// Each `<namespace>/<key>…` of the matched route's `filter_metadata`
    /// holds exactly this string.
    #[serde(default)]
    pub route_metadata: BTreeMap<String, String>,
    /// Each `<filter>/<key>…` of the request's dynamic metadata (what
    /// `jwt_authn` or `ext_authz` wrote) holds exactly this string.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Each named query parameter is present (`true`) or has exactly this
    /// value, percent- and `+`-decoded.
    #[serde(default)]
    pub query: BTreeMap<String, ValueMatch>,
    /// Each named cookie is present (`true`) or has exactly this value, percent-decoded.
    #[serde(default)]
    pub cookie: BTreeMap<String, ValueMatch>,
    /// Holds when this match does not.
    #[serde(default)]
    pub not: Option<Box<Match>>,
    /// Holds when one of these matches does.
    #[serde(default)]
    pub any: Option<Vec<Match>>,
}

/// `requests` per `per` (a rate limit), or `concurrent` requests in flight
/// at once (a concurrency limit, alone in its set).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    /// Bucket capacity; 0 when absent (a concurrency limit).
    #[serde(default)]
    pub requests: u64,
    /// Time to refill the whole bucket; 0 when absent (a concurrency limit).
    #[serde(default)]
    pub per: Seconds,
    /// Most requests of one key in flight at once in this proxy.
    #[serde(default)]
    pub concurrent: Option<u32>,
    /// Longest a request holds its slot: a slot older than this is taken
    /// back, so a VM that died never leaks one. Default 5 minutes.
    #[serde(default)]
    pub max_in_flight: Option<Seconds>,
}

/// Default `max_in_flight` of a concurrency limit, in seconds.
pub const DEFAULT_MAX_IN_FLIGHT: u64 = 300;
/// Most requests a concurrency limit lets in flight per key.
pub const MAX_CONCURRENT: u32 = 1024;

impl LimitSpec {
    /// Whether this is a concurrency limit (`concurrent`), not a rate limit.
    pub fn is_concurrent(&self) -> bool {
        self.concurrent.is_some()
    }

    /// How long a slot of this concurrency limit is held at most, in seconds.
    pub fn max_in_flight_secs(&self) -> u64 {
        self.max_in_flight.map_or(DEFAULT_MAX_IN_FLIGHT, |s| s.0)
    }
}

/// A cost for matching requests: `cost` or `cost_from`, not both.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cost {
    /// Which requests.
    #[serde(rename = "match")]
    pub matches: Match,
    /// Tokens they spend.
    #[serde(default)]
    pub cost: Option<u64>,
    /// Tokens they spend, read from the response.
    #[serde(default)]
    pub cost_from: Option<CostFrom>,
}

impl Cost {
    /// What a matching request is charged when it arrives: its `cost`, or
    /// the reservation of its `cost_from`.
    pub fn upfront(&self) -> u64 {
        match (&self.cost_from, self.cost) {
            (Some(from), _) => from.reserve.upfront(),
            (None, cost) => cost.unwrap_or(1),
        }
    }
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

/// What the per-rule counters count.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metrics {
    /// An allowed request whose limit has used at least this share of its
    /// capacity also counts as `near_limit` (envoyproxy/ratelimit's
    /// `NEAR_LIMIT_RATIO`).
    #[serde(default = "default_near_limit")]
    pub near_limit: f64,
}

pub(super) fn default_near_limit() -> f64 {
    0.8
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            near_limit: default_near_limit(),
        }
    }
}

/// What the filter leaves for Envoy's access log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLog {
    /// Set each decision as the filter state `wasm.ratelimit`
    /// (`%FILTER_STATE(wasm.ratelimit:PLAIN)%`): one host call per decided
    /// request.
    #[serde(default = "default_filter_state")]
    pub filter_state: bool,
}

pub(super) fn default_filter_state() -> bool {
    true
}

impl Default for AccessLog {
    fn default() -> Self {
        AccessLog {
            filter_state: default_filter_state(),
        }
    }
}

/// Default problem type for a quota 403.
pub const DEFAULT_QUOTA_PROBLEM_TYPE: &str = "tag:ratelimit-wasm,2026:quota-exhausted";

pub(super) fn default_quota_problem_type() -> String {
    DEFAULT_QUOTA_PROBLEM_TYPE.into()
}

pub(super) fn default_jitter() -> f64 {
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

pub(super) fn default_problem_type() -> String {
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
