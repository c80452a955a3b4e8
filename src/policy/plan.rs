//! The configuration compiled for the request path: matchers, key parts,
//! tiers and limits resolved once, so a request does no parsing, no map
//! lookups but one for a known client, and reads only the headers it needs.

use super::key::{self, BadInput, IpSource, KeyPart, KeySources};
use super::matcher::Matcher;
use super::request::{self, HeaderId, PropertyId, Reads};
use crate::config::{
    self, Circuit, Config, CostFrom, FailureMode, HeaderStyle, LimitSpec, Mode, OnError, Period,
    QuotaCount, Rule, Scope, StatusMatch,
};
use crate::limits::algorithm::Algorithm;
use crate::limits::in_flight::InFlightLayout;
use crate::limits::limiter::{Bucket, GraduatedPlan, RuleLimits, Rules};
use crate::limits::slots::Slots;
use crate::limits::store::KEY_PREFIX;
use crate::limits::table::Layout;
use crate::limits::token_bucket::Limit;
use crate::policy::policy_list::PolicyList;
use ratelimit_protocol::grpc::Method;
use ratelimit_protocol::Variant as Wire;
use siphasher::sip::SipHasher13;
use std::hash::Hasher;

/// One set of limits of a rule: the rule's own, a tier's, or a client's override.
#[derive(Debug, Clone)]
pub struct Variant {
    /// `requests` per `per` for each limit, and `per` in seconds for headers.
    pub limits: Vec<(Limit, u64)>,
    /// Hash state after domain, rule, algorithm and limits: changing a limit starts fresh buckets.
    pub(super) hasher: SipHasher13,
    /// How the gateway protocol names this set.
    pub wire: ratelimit_protocol::Variant,
    /// What the response headers say of each limit that never changes.
    pub texts: Vec<LimitText>,
}

/// The constant header values of one limit, written once at configure time
/// rather than formatted on every response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitText {
    /// `x-ratelimit-limit`: the capacity.
    pub quota: String,
    /// `, ` and the limit's `ratelimit-policy` item: a list's next item,
    /// copied whole (the item alone is [`LimitText::policy`]).
    listed_policy: String,
    /// `, ` and the start of the limit's `ratelimit` item, up to its
    /// remaining: `, <name>;r=`.
    listed_state: String,
}

/// Bytes before an item in a list's text: `, `.
const SEP: usize = 2;
/// Bytes after the name in [`LimitText`]'s `listed_state`: `;r=`.
const STATE: usize = 3;

/// The policy name of limit `limit` of rule `rule`, as an sf-string: a rule's
/// first limit is named after the rule (what a one-limit rule has always
/// been called), limit `n` after it `<rule>/<n>`. Rule names never hold `/`,
/// so no limit's name is another rule's, and none needs escaping.
pub fn policy_name(rule: &str, limit: usize) -> String {
    let mut name = String::with_capacity(rule.len() + 6);
    push_policy_name(&mut name, rule, limit);
    name
}

/// Appends [`policy_name`]`(rule, limit)` to `out`.
pub fn push_policy_name(out: &mut String, rule: &str, limit: usize) {
    out.push('"');
    out.push_str(rule);
    if limit > 0 {
        out.push('/');
        out.push_str(itoa::Buffer::new().format(limit));
    }
    out.push('"');
}

impl LimitText {
    /// A concurrency limit's: `"<rule>";q=<slots>;qu="concurrent-requests"`
    /// (the quota unit the IETF draft names for it; no window). A
    /// concurrency rule has that one limit.
    pub fn concurrent(rule: &str, slots: u64) -> LimitText {
        let quota = itoa::Buffer::new().format(slots).to_owned();
        LimitText::of(
            policy_name(rule, 0),
            quota,
            &[";qu=\"concurrent-requests\""],
        )
    }

    /// Limit `limit` of a rate rule: `<name>;q=<capacity>;w=<window>`.
    fn new(rule: &str, limit: usize, capacity: u64, window_secs: u64) -> LimitText {
        let quota = itoa::Buffer::new().format(capacity).to_owned();
        let mut w = itoa::Buffer::new();
        LimitText::of(
            policy_name(rule, limit),
            quota,
            &[";w=", w.format(window_secs)],
        )
    }

    /// The texts of the limit named `name` of `quota`, its policy item's
    /// parameters after `q` being `rest`.
    fn of(name: String, quota: String, rest: &[&str]) -> LimitText {
        let mut listed_policy = String::with_capacity(SEP + name.len() + quota.len() + 32);
        for part in [", ", &name, ";q=", &quota]
            .into_iter()
            .chain(rest.iter().copied())
        {
            listed_policy.push_str(part);
        }
        let mut listed_state = String::with_capacity(SEP + name.len() + STATE);
        for part in [", ", &name, ";r="] {
            listed_state.push_str(part);
        }
        LimitText {
            quota,
            listed_policy,
            listed_state,
        }
    }

    /// The limit's `ratelimit-policy` item: its name, `;q=<capacity>;w=<per
    /// in seconds>` (a concurrency limit: `;q=<slots>;qu=...`).
    pub fn policy(&self) -> &str {
        self.listed_policy.get(SEP..).unwrap_or_default()
    }

    /// The item [`LimitText::policy`] after an earlier one: `, ` first.
    pub fn listed_policy(&self) -> &str {
        &self.listed_policy
    }

    /// Its policy name as an sf-string, quotes included: `"<rule>"` for a
    /// rule's first limit, `"<rule>/<n>"` for limit `n` after it
    /// ([`policy_name`]).
    pub fn name(&self) -> &str {
        let end = self.listed_state.len().saturating_sub(STATE);
        self.listed_state.get(SEP..end).unwrap_or_default()
    }

    /// The start of its `ratelimit` item, up to the remaining: `<name>;r=`.
    pub fn state(&self) -> &str {
        self.listed_state.get(SEP..).unwrap_or_default()
    }

    /// [`LimitText::state`] after an earlier item: `, ` first.
    pub fn listed_state(&self) -> &str {
        &self.listed_state
    }
}

/// A compiled rule.
#[derive(Debug, Clone)]
pub struct RulePlan {
    /// The rule's name.
    pub name: String,
    /// The name as a JSON string, quotes included, for a 429's
    /// `violated-policies`: escaped once here rather than on every answer.
    pub name_json: String,
    /// How the limits count.
    pub algorithm: Algorithm,
    /// Local, or decided by the gateway.
    pub scope: Scope,
    /// Never rejects.
    pub shadow: bool,
    /// Cost of a request for this rule, over `costs`.
    pub cost: Option<u64>,
    /// Warn, delay and block stages.
    pub graduated: Option<GraduatedPlan>,
    /// Limit sets: 0 is the rule's own `limits`, then tiers' and clients'.
    pub variants: Vec<Variant>,
    /// For a global rule: the index of its local stand-in (each limit a
    /// proxy's exact share, `requests / (instances × per)`, same variants),
    /// used when the gateway fails in `failure_mode: local`.
    pub fallback: Option<usize>,
    /// True for the local stand-in of a global rule.
    pub stand_in: bool,
    /// Its own `cost_from`: an index into [`Plan::meters`].
    pub meter: Option<usize>,
    /// Statuses whose responses keep the charge; `None`: every status.
    pub charge_on: Option<Vec<StatusMatch>>,
    /// A concurrency rule: each variant's one limit is `concurrent` slots
    /// (`capacity`) held at most `max_in_flight` (`period_ns`).
    pub in_flight: bool,
    pub(super) tier_variant: Vec<usize>,
    /// `limits_by`: where the set's name is read, and each set's variant.
    pub(super) limits_by: Option<SetsPlan>,
    pub(super) matcher: Option<Matcher>,
    pub(super) key: Vec<KeyPart>,
}

/// `limits_by` compiled: the property holding a set's name, and the
/// variant of each set by name, sorted for one binary search a request.
#[derive(Debug, Clone)]
pub(super) struct SetsPlan {
    pub(super) property: PropertyId,
    pub(super) sets: Vec<(Vec<u8>, usize)>,
}

impl SetsPlan {
    /// The variant the request's value names; 0 (the rule's own limits),
    /// counted in `defaults`, without a value or for a name not among the sets.
    #[inline(never)]
    pub(super) fn pick(&self, req: &request::RequestInfo, defaults: &mut u64) -> usize {
        let found = req.property(self.property).and_then(|name| {
            let i = self
                .sets
                .binary_search_by(|(n, _)| n.as_slice().cmp(name))
                .ok()?;
            self.sets.get(i).map(|(_, v)| *v)
        });
        *defaults += u64::from(found.is_none());
        found.unwrap_or(0)
    }
}

impl QuotaPlan {
    /// Whether the quota counts the request's cost rather than 1.
    pub fn counts_cost(&self) -> bool {
        self.count == QuotaCount::Cost
    }
}

impl RulePlan {
    /// The limits of a variant (empty for an unknown one).
    pub fn limits(&self, variant: usize) -> &[(Limit, u64)] {
        self.variants
            .get(variant)
            .map_or(&[], |v| v.limits.as_slice())
    }
}

/// One bucket the gateway decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalBucket {
    /// Index into [`Plan::rules`].
    pub rule: usize,
    /// Index into the rule's variants.
    pub variant: usize,
    /// Readable key, the same on every proxy: `<rule>/<tag>=<value>/…`.
    pub key: String,
    /// Redis Cluster hash tag: the first key part.
    pub tag: String,
    /// Tokens the request spends in it.
    pub cost: u64,
}

/// One quota counter the gateway keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaBucket {
    /// Index into [`Plan::quotas`].
    pub quota: usize,
    /// Readable key: `<quota>/<parts>`.
    pub key: String,
    /// Redis Cluster hash tag.
    pub tag: String,
    /// Amount per period for this client.
    pub limit: u64,
    /// Which amount applies, as the gateway protocol names it.
    pub variant: ratelimit_protocol::Variant,
    /// What this request counts.
    pub amount: u64,
}

/// How a request's real cost is read from its response (`cost_from`).
#[derive(Debug, Clone)]
pub struct MeterPlan {
    /// Where the cost is.
    pub source: MeterSource,
    /// Charged when the request arrives: the fixed reservation, or the
    /// default of one read from the request body.
    pub reserve: u64,
    /// The most one response charges.
    pub max: u64,
    /// Where the reservation is read in the request body (split, unescaped).
    pub reserve_from: Option<Vec<String>>,
    /// Ask a stream for its usage (rewrite the request body).
    pub ensure_stream_usage: bool,
    /// Bytes of the request body held to read it.
    pub request_body_limit: u64,
}

/// Where a [`MeterPlan`] reads the cost.
#[derive(Debug, Clone)]
pub enum MeterSource {
    /// A response header holding a decimal integer (lower-case name).
    Header(String),
    /// Values in the JSON body or the SSE events.
    Body(crate::usage::Meter),
}

/// Most tokens of debt a settlement may leave in a bucket, in responses of
/// `max` each: the bound of what concurrent requests can overrun together
/// before the rest is forgiven. The gateway holds the same bound.
pub use crate::config::bounds::DEBT_OVERRUNS;

impl MeterPlan {
    /// Whether a request this meter settles waits for its body.
    pub fn reads_request_body(&self) -> bool {
        self.reserve_from.is_some() || self.ensure_stream_usage
    }

    fn compile(from: &CostFrom) -> MeterPlan {
        let terms = match (&from.header, &from.json, from.preset) {
            (Some(h), _, _) => {
                return MeterPlan {
                    source: MeterSource::Header(h.to_ascii_lowercase()),
                    reserve: from.reserve.upfront(),
                    max: from.max,
                    reserve_from: from.reserve.pointer().map(|p| p.0.clone()),
                    ensure_stream_usage: false,
                    request_body_limit: from.request_body_limit,
                }
            }
            (None, Some(json), _) => json
                .iter()
                .map(|t| crate::usage::Term {
                    any_of: vec![crate::usage::Path::from(&t.pointer)],
                    weight: t.weight,
                })
                .collect(),
            (None, None, Some(preset)) => crate::usage::preset::terms(preset),
            (None, None, None) => Vec::new(),
        };
        MeterPlan {
            source: MeterSource::Body(crate::usage::Meter {
                terms,
                max: from.max,
                scan_limit: from.scan_limit,
            }),
            reserve: from.reserve.upfront(),
            max: from.max,
            reserve_from: from.reserve.pointer().map(|p| p.0.clone()),
            ensure_stream_usage: from.ensure_stream_usage,
            request_body_limit: from.request_body_limit,
        }
    }
}

/// What the plan makes of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evaluation {
    /// The request's cost from `costs` (rules may override it).
    pub cost: u64,
    /// The `costs` entry's `cost_from` that set `cost`: an index into [`Plan::meters`].
    pub cost_meter: Option<usize>,
    /// The buckets of every matching, enforced local rule.
    pub buckets: Vec<Bucket>,
    /// The buckets of matching shadow rules (or every local rule for a soft client).
    pub shadow: Vec<Bucket>,
    /// The buckets of every matching global rule.
    pub global: Vec<GlobalBucket>,
    /// The local stand-ins of `global`, for `failure_mode: local`.
    pub fallback: Vec<Bucket>,
    /// A slot of every matching concurrency rule (`set` in [`Plan::in_flight`]).
    pub in_flight: Vec<Bucket>,
    /// The quotas the request counts against.
    pub quotas: Vec<QuotaBucket>,
    /// The client is soft: nothing rejects it.
    pub soft: bool,
    /// The client or its tier is unlimited: nothing applies.
    pub unlimited: bool,
    /// Anything odd about the request's identity.
    pub bad_input: Vec<BadInput>,
    /// Matching `limits_by` rules that gave the request their own limits:
    /// no value at the path, or a name not among the sets.
    pub limits_by_default: u64,
}

/// A compiled quota.
#[derive(Debug, Clone)]
pub struct QuotaPlan {
    /// Name, in the 403 body.
    pub name: String,
    /// Calendar period.
    pub period: Period,
    /// Where to buy more.
    pub upgrade_url: String,
    pub(super) count: QuotaCount,
    /// Amount for a tier not listed, and for every client when no tiers are declared.
    pub(super) limit: Option<u64>,
    pub(super) by_tier: Vec<Option<u64>>,
    pub(super) matcher: Option<Matcher>,
    pub(super) key: Vec<KeyPart>,
}

/// What the filter knows of one client from `identity.clients`.
#[derive(Debug, Clone, Default)]
pub(super) struct ClientPlan {
    pub(super) tier: Option<usize>,
    pub(super) unlimited: bool,
    pub(super) soft: bool,
    /// (rule, variant) overrides.
    pub(super) variants: Vec<(usize, usize)>,
    /// (quota, amount) overrides.
    pub(super) quotas: Vec<(usize, u64)>,
}

/// The gateway settings, as the request path needs them.
#[derive(Debug, Clone)]
pub struct GlobalPlan {
    /// Envoy cluster name.
    pub cluster: String,
    /// `:authority` of the callout.
    pub authority: String,
    /// HTTP or gRPC.
    pub transport: CallTransport,
    /// Path of the check endpoint.
    pub path: String,
    /// Path of the settle endpoint.
    pub settle_path: String,
    /// Callout timeout.
    pub timeout_ms: u64,
    /// Coalesced checks; `None` when `global.coalesce_us` is 0.
    pub batch: Option<BatchPlan>,
    /// Behaviour on failure.
    pub failure_mode: FailureMode,
    /// Circuit breaker.
    pub circuit: Circuit,
    /// Shared-data key of the circuit-breaker state.
    pub circuit_key: String,
    /// Lease mode, when configured.
    pub lease: Option<LeasePlan>,
    /// The deny cache's entries (`global.deny_cache`); `None` when it is 0 (off).
    pub deny_cache: Option<Slots>,
    /// `authorization` of the callouts (`Bearer <token>`): the inline
    /// `global.token` here; the filter's `on_configure` resolves `token_env`.
    pub authorization: Option<config::Token>,
}

/// How the callouts reach the gateway (`global.transport`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallTransport {
    /// `dispatch_http_call`: a `POST` to the endpoint's path.
    Http,
    /// `dispatch_grpc_call` of the gateway's gRPC method.
    Grpc {
        /// The serialized `GrpcService` naming the cluster and authority
        /// ([`config::Global::grpc_service`]).
        service: String,
    },
}

impl GlobalPlan {
    /// The HTTP path of `method`'s endpoint (`None`: a lease without lease mode).
    pub fn path(&self, method: Method) -> Option<&str> {
        match method {
            Method::Check => Some(&self.path),
            Method::CheckBatch => self.batch.as_ref().map(|b| b.path.as_str()),
            Method::Lease => self.lease.as_ref().map(|l| l.path.as_str()),
            Method::Settle => Some(&self.settle_path),
        }
    }
}

/// Coalesced checks: the worker's checks that wait while one is in flight
/// go together in one call (`global.coalesce_us`, `max_batch`, `batch_path`).
#[derive(Debug, Clone)]
pub struct BatchPlan {
    /// Path of the batched check endpoint.
    pub path: String,
    /// Longest a queued check waits once another arrives, in ns.
    pub coalesce_ns: u64,
    /// Most checks in one batch.
    pub max_batch: usize,
    /// A batch body up to its first check: the version and the domain,
    /// written once.
    pub head: Vec<u8>,
}

impl BatchPlan {
    fn new(domain: &str, g: &config::Global) -> Option<BatchPlan> {
        if g.coalesce_us == 0 {
            return None;
        }
        let domain = serde_json::to_string(domain).unwrap_or_default();
        let version = ratelimit_protocol::BATCH_VERSION;
        Some(BatchPlan {
            path: g.batch_path.clone(),
            coalesce_ns: g.coalesce_us.saturating_mul(1_000),
            max_batch: usize::try_from(g.max_batch).unwrap_or(1).max(1),
            head: format!("{{\"version\":{version},\"domain\":{domain},\"checks\":[").into_bytes(),
        })
    }
}

/// Where identity comes from.
#[derive(Debug, Clone)]
pub(super) struct IdentityPlan {
    pub(super) client_header: HeaderId,
    pub(super) tier_header: Option<HeaderId>,
    pub(super) ip_source: IpSource,
    pub(super) tiers: Vec<(String, bool)>,
    pub(super) default_tier: Option<usize>,
    pub(super) clients: ClientTable,
}

/// `identity.clients` by id, sorted for a binary search: a lookup costs a
/// few byte comparisons where a `HashMap` hashed the id with SipHash on every
/// request (BENCHMARKS.md, instructions per decision), and no id an attacker
/// picks makes it slower.
#[derive(Debug, Clone, Default)]
pub(super) struct ClientTable(Vec<(Vec<u8>, ClientPlan)>);

impl ClientTable {
    /// Builds the table from `(id, plan)` pairs; ids are unique (a map's keys).
    fn new(mut clients: Vec<(Vec<u8>, ClientPlan)>) -> ClientTable {
        clients.sort_by(|a, b| a.0.cmp(&b.0));
        ClientTable(clients)
    }

    /// The plan of client `id`.
    pub(super) fn get(&self, id: &[u8]) -> Option<&ClientPlan> {
        let i = self
            .0
            .binary_search_by(|(k, _)| k.as_slice().cmp(id))
            .ok()?;
        self.0.get(i).map(|(_, c)| c)
    }

    fn get_mut(&mut self, id: &[u8]) -> Option<&mut ClientPlan> {
        let i = self
            .0
            .binary_search_by(|(k, _)| k.as_slice().cmp(id))
            .ok()?;
        self.0.get_mut(i).map(|(_, c)| c)
    }
}

/// The compiled configuration.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Headers to fetch per request, lower-case, `:method` and `:path` first.
    pub header_names: Vec<String>,
    /// Which of `header_names` a request must fetch: a registered header
    /// nothing reads (`:method` without a method match, `X-Forwarded-For`
    /// without trusted hops) costs a hostcall for nothing.
    pub header_needed: Vec<bool>,
    /// When the peer address must be fetched.
    pub source: SourceNeed,
    /// Properties to fetch per request (the route's name, route and dynamic
    /// metadata that some condition or key reads), in [`request::RequestInfo::properties`]'s order.
    pub properties: Vec<Vec<String>>,
    /// Where key parts find what they read.
    pub(super) sources: KeySources,
    /// Property path of the client id in Envoy metadata, when configured.
    pub client_id_property: Option<Vec<String>>,
    /// Property path of the tier in Envoy metadata, when configured.
    pub tier_property: Option<Vec<String>>,
    /// The compiled rules.
    pub rules: Vec<RulePlan>,
    /// The `RateLimit-Policy` list of every rule's own limits, which a
    /// response checked against a run of them borrows.
    pub policies: PolicyList,
    /// The compiled quotas.
    pub quotas: Vec<QuotaPlan>,
    /// Header families on responses.
    pub header_style: HeaderStyle,
    /// A 429 body of the configured `problem_type` up to its wait
    /// ([`super::json::too_many_head`]), written once.
    pub too_many_head: String,
    /// `type` of 429 problem bodies (the whole body of one that can never pass).
    pub problem_type: String,
    /// `type` of quota 403 problem bodies.
    pub quota_problem_type: String,
    /// Share of random spread on `Retry-After` and block releases, upwards only.
    pub retry_jitter: f64,
    /// `metrics.near_limit`: the share of a limit past which an allowed
    /// request also counts as near it.
    pub near_limit: f64,
    /// `access_log.filter_state`: each decision is set as filter state
    /// for Envoy's access log ([`crate::decide::why`]).
    pub filter_state: bool,
    /// What to do when shared data fails.
    pub on_error: OnError,
    /// Where the buckets live in shared data.
    pub table: Layout,
    /// The gateway, when any rule is global.
    pub global: Option<GlobalPlan>,
    /// The configuration's domain.
    pub domain: String,
    /// Every `cost_from`: the rules' own, then the `costs` entries'.
    pub meters: Vec<MeterPlan>,
    /// Where the concurrency rules' slots live in shared data.
    pub in_flight: InFlightLayout,
    /// Some rule is settled from its response (`cost_from`, `charge_on`), or
    /// holds a global concurrency slot, released through the gateway when
    /// the stream ends: only then does an admitted request keep state for
    /// its response.
    pub settling: bool,
    /// Some `cost_from` reads the request body (`reserve` from a pointer,
    /// `ensure_stream_usage`): only then may a request wait for its body.
    pub reads_request_body: bool,
    pub(super) costs: Vec<(Matcher, u64, Option<usize>)>,
    pub(super) identity: IdentityPlan,
    /// Rules a request may charge locally (neither global nor a stand-in):
    /// the most buckets an evaluation holds, to size its list once.
    pub(super) local_rules: usize,
    /// Some rule has graduated stages: only then does an allowed request's
    /// answer look for a warning or a delay.
    pub any_graduated: bool,
    /// Some rule limits requests in flight.
    pub any_in_flight: bool,
}

/// When a request's peer address is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceNeed {
    /// No key reads the client IP.
    Never,
    /// Only for requests without a client id (the IP stands in for it).
    WithoutClient,
    /// Some key reads the IP itself.
    Always,
}

/// Registers what requests are read for, giving each an index: header
/// names to fetch, properties to fetch, and the query parameter and cookie
/// names that key parts look up.
struct Headers {
    headers: Vec<String>,
    properties: Vec<Vec<String>>,
    names: Vec<Vec<u8>>,
}

/// An index nothing was registered at: a lookup by it finds nothing.
const UNREAD: usize = usize::MAX;

impl Reads for Headers {
    // Kept out of Plan::compile: V8 holds memory superlinear in a wasm
    // function's size (BENCHMARKS.md, "Where the memory goes").
    #[inline(never)]
    fn header(&mut self, name: &str) -> HeaderId {
        let name = name.to_ascii_lowercase();
        register(&mut self.headers, name)
    }

    fn property(&mut self, path: Vec<String>) -> PropertyId {
        register(&mut self.properties, path)
    }
}

/// The index of `item` in `list`, added at the end when new.
fn register<T: PartialEq>(list: &mut Vec<T>, item: T) -> usize {
    match list.iter().position(|n| *n == item) {
        Some(i) => i,
        None => {
            list.push(item);
            list.len() - 1
        }
    }
}

impl Headers {
    fn id(&mut self, name: &str) -> HeaderId {
        self.header(name)
    }

    // Kept out of Plan::compile: V8 holds memory superlinear in a wasm
    // function's size (BENCHMARKS.md, "Where the memory goes").
    #[inline(never)]
    fn key(&mut self, parts: &[config::KeyPart]) -> Vec<KeyPart> {
        use ratelimit_config::key::NameKind;
        parts
            .iter()
            .map(|p| {
                p.map_name(|kind, name| match kind {
                    NameKind::Header => self.id(name),
                    NameKind::Query | NameKind::Cookie => {
                        register(&mut self.names, name.as_bytes().to_vec())
                    }
                    NameKind::Metadata => {
                        let path = config::MetadataPath::parse(name).map(|p| p.0);
                        match path {
                            Ok(path) => self.property(request::metadata_path(&path)),
                            Err(_) => UNREAD,
                        }
                    }
                })
            })
            .collect()
    }

    /// Where key parts find what they read; the headers and the route
    /// property are registered only when some key part reads them.
    #[inline(never)]
    fn key_sources<'k>(
        &mut self,
        ip: IpSource,
        keys: impl Iterator<Item = &'k Vec<KeyPart>>,
    ) -> KeySources {
        let (mut host, mut cookie, mut route) = (false, false, false);
        for part in keys.flatten() {
            match part {
                KeyPart::Host => host = true,
                KeyPart::Cookie(_) => cookie = true,
                KeyPart::Route => route = true,
                KeyPart::Client
                | KeyPart::Ip
                | KeyPart::Method
                | KeyPart::Path
                | KeyPart::IpPrefix { .. }
                | KeyPart::Header(_)
                | KeyPart::Query(_)
                | KeyPart::Metadata(_) => {}
            }
        }
        KeySources {
            ip,
            authority: if host {
                self.id(request::AUTHORITY)
            } else {
                UNREAD
            },
            cookie: if cookie {
                self.id(request::COOKIE)
            } else {
                UNREAD
            },
            route: if route {
                self.property(request::route_name_path())
            } else {
                UNREAD
            },
            names: std::mem::take(&mut self.names),
        }
    }
}

// The steps of Plan::compile, each kept out of it: V8 holds memory
// superlinear in a wasm function's size (BENCHMARKS.md, "Where the memory goes").

/// Where identity comes from: the identity headers, the tiers in
/// configuration order, and the clients (their rule variants and quotas are
/// filled in by [`rule_plans`] and [`quota_plans`]).
#[inline(never)]
fn identity_plan(config: &Config, h: &mut Headers) -> IdentityPlan {
    let id = &config.identity;
    let tiers: Vec<(String, bool)> = config
        .tiers
        .iter()
        .map(|(name, spec)| (name.clone(), spec.unlimited))
        .collect();
    let tier_index = |name: &str| tiers.iter().position(|(n, _)| n == name);
    let clients = id
        .clients
        .iter()
        .map(|(client, spec)| {
            let plan = ClientPlan {
                tier: spec.tier.as_deref().and_then(tier_index),
                unlimited: spec.unlimited,
                soft: spec.soft,
                ..ClientPlan::default()
            };
            (client.as_bytes().to_vec(), plan)
        })
        .collect();
    IdentityPlan {
        client_header: h.id(&id.client_id_header),
        tier_header: id.tier_header.as_deref().map(|t| h.id(t)),
        ip_source: IpSource {
            xff: h.id("x-forwarded-for"),
            hops: id.trusted_proxy_hops,
        },
        default_tier: id.default_tier.as_deref().and_then(tier_index),
        clients: ClientTable::new(clients),
        tiers,
    }
}

/// Every rule's plan in configuration order, then the local stand-ins of the
/// global rules (each global rule's `fallback` names its stand-in).
#[inline(never)]
fn rule_plans(
    config: &Config,
    h: &mut Headers,
    identity: &mut IdentityPlan,
    keys: (u64, u64),
    meters: &mut Vec<MeterPlan>,
) -> Vec<RulePlan> {
    let mut rules = Vec::with_capacity(config.rules.len());
    let mut stand_ins = Vec::new();
    // The largest `max` of the `costs` entries read from the response: the
    // debt a rule without its own cost may be left with.
    let costs_max = config
        .costs
        .iter()
        .filter_map(|c| c.cost_from.as_ref().map(|f| f.max))
        .max();
    for (rule_index, rule) in config.rules.iter().enumerate() {
        let meter = rule.cost_from.as_ref().map(|from| {
            meters.push(MeterPlan::compile(from));
            meters.len() - 1
        });
        let max = match (&rule.cost_from, rule.cost) {
            (Some(from), _) => Some(from.max),
            (None, None) => costs_max,
            (None, Some(_)) => None,
        };
        let debt = max.map_or(0, |m| m.saturating_mul(DEBT_OVERRUNS));
        let (mut base, stand_in) = rule_plan(config, rule, rule_index, h, identity, keys, debt);
        base.meter = meter;
        if let Some(stand_in) = stand_in {
            stand_ins.push((rules.len(), stand_in));
        }
        rules.push(base);
    }
    for (global_index, stand_in) in stand_ins {
        let index = rules.len();
        rules.push(stand_in);
        if let Some(r) = rules.get_mut(global_index) {
            r.fallback = Some(index);
        }
    }
    rules
}

/// One rule's plan, and for a global rule its local stand-in (the proxy's
/// share of each limit among `global.instances`).
#[inline(never)]
fn rule_plan(
    config: &Config,
    rule: &Rule,
    rule_index: usize,
    h: &mut Headers,
    identity: &mut IdentityPlan,
    keys: (u64, u64),
    debt: u64,
) -> (RulePlan, Option<RulePlan>) {
    let key = h.key(&rule.key);
    let maker = VariantMaker {
        config,
        rule,
        keys,
        debt,
    };
    let (specs, tier_variant) = limit_sets(config, rule, rule_index, identity);
    let limits_by = rule
        .limits_by
        .as_ref()
        .and_then(|by| sets_plan(by, &specs, h));
    let graduated = rule.graduated.as_ref().map(|g| GraduatedPlan {
        warn_at: g.warn_at,
        delay_at: g.delay_at,
        delay_ms: g.delay_ms.unwrap_or(0),
        block_at: g.block_at,
        block_for_ns: g.block_for.map_or(0, |s| s.0 * 1_000_000_000),
    });
    let base = RulePlan {
        name: rule.name.clone(),
        name_json: super::json::quoted(&rule.name),
        algorithm: rule.algorithm,
        scope: rule.scope,
        shadow: rule.mode == Mode::Shadow,
        cost: rule
            .cost
            .or(rule.cost_from.as_ref().map(|f| f.reserve.upfront())),
        graduated,
        variants: specs.iter().map(|s| maker.make(s, 1)).collect(),
        fallback: None,
        stand_in: false,
        meter: None,
        charge_on: rule.charge_on.clone(),
        in_flight: rule.is_concurrent(),
        tier_variant,
        limits_by,
        matcher: rule.matches.as_ref().map(|m| Matcher::compile(m, h)),
        key,
    };
    // A concurrency rule has no stand-in: its slots are released through
    // the gateway, which a local share could not be.
    let divisor = match (&config.global, rule.scope) {
        (Some(g), Scope::Global) if !rule.is_concurrent() => Some(g.instances.max(1)),
        _ => None,
    };
    let stand_in = divisor.map(|n| RulePlan {
        scope: Scope::Local,
        stand_in: true,
        matcher: None,
        variants: specs.iter().map(|s| maker.make(s, n)).collect(),
        ..base.clone()
    });
    (base, stand_in)
}

/// The rule's sets of limits with their wire variants: its own first, then
/// each tier's that has one, then each client override's (recorded in the
/// client's plan), then each `limits_by` set's. Also each tier's set by tier index (0, the rule's own, for
/// a tier without one). The rule and its stand-in list them in this order.
fn limit_sets<'c>(
    config: &'c Config,
    rule: &'c Rule,
    rule_index: usize,
    identity: &mut IdentityPlan,
) -> (Vec<(&'c [LimitSpec], Wire)>, Vec<usize>) {
    let mut specs: Vec<(&[LimitSpec], Wire)> = vec![(&rule.limits, Wire::Default)];
    let tier_variant = identity
        .tiers
        .iter()
        .map(|(name, _)| match rule.tiers.get(name) {
            Some(limits) => {
                specs.push((limits, Wire::Tier(name.clone())));
                specs.len() - 1
            }
            None => 0,
        })
        .collect();
    for (client, spec) in &config.identity.clients {
        if let Some(limits) = spec.limits.get(&rule.name) {
            specs.push((limits, Wire::Client(client.clone())));
            if let Some(c) = identity.clients.get_mut(client.as_bytes()) {
                c.variants.push((rule_index, specs.len() - 1));
            }
        }
    }
    for (name, limits) in rule.limits_by.iter().flat_map(|b| &b.sets) {
        specs.push((limits, Wire::Set(name.clone())));
    }
    (specs, tier_variant)
}

/// The `limits_by` sets' variants in `specs` (where [`limit_sets`] put
/// them), and the property their name is read from.
fn sets_plan(
    by: &config::LimitsBy,
    specs: &[(&[LimitSpec], Wire)],
    h: &mut Headers,
) -> Option<SetsPlan> {
    let (source, path) = by.source()?;
    let path = config::MetadataPath::parse(path).ok()?.0;
    let property = h.property(match source {
        config::LimitsSource::RouteMetadata => request::route_metadata_path(&path),
        config::LimitsSource::Metadata => request::metadata_path(&path),
    });
    let mut sets: Vec<(Vec<u8>, usize)> = specs
        .iter()
        .enumerate()
        .filter_map(|(i, (_, w))| match w {
            Wire::Set(n) => Some((n.as_bytes().to_vec(), i)),
            _ => None,
        })
        .collect();
    sets.sort();
    Some(SetsPlan { property, sets })
}

/// Every quota's plan in configuration order; each client's amount
/// overrides are recorded in the client's plan.
#[inline(never)]
fn quota_plans(config: &Config, h: &mut Headers, identity: &mut IdentityPlan) -> Vec<QuotaPlan> {
    let mut quotas = Vec::with_capacity(config.quotas.len());
    for (qi, q) in config.quotas.iter().enumerate() {
        for (client, spec) in &config.identity.clients {
            if let Some(amount) = spec.quotas.get(&q.name) {
                if let Some(c) = identity.clients.get_mut(client.as_bytes()) {
                    c.quotas.push((qi, *amount));
                }
            }
        }
        let key = h.key(&q.key);
        quotas.push(QuotaPlan {
            name: q.name.clone(),
            period: q.period,
            upgrade_url: q.upgrade_url.clone(),
            count: q.count,
            limit: q.limit,
            by_tier: identity
                .tiers
                .iter()
                .map(|(name, _)| q.tiers.get(name).copied().or(q.limit))
                .collect(),
            matcher: q.matches.as_ref().map(|m| Matcher::compile(m, h)),
            key,
        });
    }
    quotas
}

/// The gateway settings (`global`) as the filter uses them.
#[inline(never)]
fn global_plan(config: &Config, g: &config::Global, keys: (u64, u64)) -> GlobalPlan {
    GlobalPlan {
        cluster: g.cluster.clone(),
        authority: g.authority.clone(),
        transport: match g.transport {
            config::Transport::Http => CallTransport::Http,
            config::Transport::Grpc => CallTransport::Grpc {
                service: g.grpc_service(),
            },
        },
        path: g.path.clone(),
        settle_path: g.settle_path.clone(),
        timeout_ms: g.timeout_ms,
        batch: BatchPlan::new(&config.domain, g),
        failure_mode: g.failure_mode,
        circuit: g.circuit.clone(),
        circuit_key: format!("{KEY_PREFIX}circuit/{}/{}", config.domain, g.cluster),
        lease: g
            .lease
            .as_ref()
            .map(|l| LeasePlan::new(l, &config.domain, keys)),
        deny_cache: (g.deny_cache > 0).then(|| {
            let prefix = format!("{KEY_PREFIX}deny/{}/{}/", config.domain, g.deny_cache);
            Slots::new(prefix, g.deny_cache, keys)
        }),
        authorization: g.bearer(|_| None).ok().flatten().map(config::Token),
    }
}

/// One proxy's share of `l` among `instances`: a bucket of
/// `max(requests / instances, 1)` refilled at exactly `requests / (instances ×
/// per)`, its period rounded up to a whole nanosecond (never above the share).
/// With more proxies than requests, a bucket of 1 refills slower than `per`, so
/// the proxies together still admit `requests` per `per` plus one bucket each.
fn share(l: &LimitSpec, instances: u64) -> (u64, u64) {
    let per_ns = u128::from(l.per.0) * 1_000_000_000;
    let instances = instances.max(1);
    let capacity = (l.requests / instances).max(1);
    let requests = u128::from(l.requests.max(1));
    let period = (u128::from(capacity) * u128::from(instances) * per_ns).div_ceil(requests);
    // Only 1 request per 366 d over thousands of proxies passes u64 (584 years):
    // the longest period then, which admits less, never more.
    (capacity, u64::try_from(period).unwrap_or(u64::MAX))
}

struct VariantMaker<'a> {
    config: &'a Config,
    rule: &'a Rule,
    keys: (u64, u64),
    /// Tokens of debt a settlement may leave ([`DEBT_OVERRUNS`] responses).
    debt: u64,
}

impl VariantMaker<'_> {
    /// The limits of one set; `instances` above 1 makes a proxy's stand-in share.
    // Kept out of Plan::compile: V8 holds memory superlinear in a wasm
    // function's size (BENCHMARKS.md, "Where the memory goes").
    #[inline(never)]
    fn make(
        &self,
        (specs, wire): &(&[LimitSpec], ratelimit_protocol::Variant),
        instances: u64,
    ) -> Variant {
        let reject_at = self.rule.graduated.as_ref().map_or(1.0, |g| g.reject_at);
        let limits: Vec<(Limit, u64)> = specs
            .iter()
            .map(|l| {
                if let Some(slots) = l.concurrent {
                    let hold_ns = l.max_in_flight_secs().saturating_mul(1_000_000_000);
                    return (Limit::new(slots.into(), hold_ns), 0);
                }
                let (capacity, period_ns) = share(l, instances);
                // A graduated rule admits up to `reject_at` of the limit; the stages above 100% delay.
                let burst = ((capacity as f64) * reject_at).floor() as u64;
                let limit = Limit {
                    capacity,
                    period_ns,
                    burst: burst.max(capacity),
                    debt: self.debt,
                };
                (limit, period_ns.div_ceil(1_000_000_000))
            })
            .collect();
        // Whole words only, so that a request's key parts start on a word.
        let mut hasher = SipHasher13::new_with_keys(self.keys.0, self.keys.1);
        for (tag, part) in [
            (b'd', self.config.domain.as_bytes()),
            (b'r', self.rule.name.as_bytes()),
            (b'a', self.rule.algorithm.name().as_bytes()),
        ] {
            key::hash_part(&mut hasher, tag, part);
        }
        for (l, _) in &limits {
            hasher.write_u64(l.capacity);
            hasher.write_u64(l.period_ns);
            hasher.write_u64(l.burst);
        }
        let texts = limits
            .iter()
            .zip(specs.iter())
            .enumerate()
            .map(|(i, ((l, secs), spec))| match spec.concurrent {
                Some(_) => LimitText::concurrent(&self.rule.name, l.capacity),
                None => LimitText::new(&self.rule.name, i, l.capacity, *secs),
            })
            .collect();
        Variant {
            limits,
            hasher,
            wire: wire.clone(),
            texts,
        }
    }
}

impl Plan {
    /// Compiles a validated configuration. `seed` keys the bucket hash so that
    /// clients cannot aim their keys at another client's bucket.
    pub fn compile(config: &Config, seed: [u8; 16]) -> Plan {
        let mut h = Headers {
            headers: vec![":method".into(), ":path".into()],
            properties: Vec::new(),
            names: Vec::new(),
        };
        let keys = split_seed(seed);
        let mut identity = identity_plan(config, &mut h);
        let mut meters = Vec::new();
        let rules = rule_plans(config, &mut h, &mut identity, keys, &mut meters);
        let quotas = quota_plans(config, &mut h, &mut identity);
        let costs: Vec<(Matcher, u64, Option<usize>)> = config
            .costs
            .iter()
            .map(|c| {
                let meter = c.cost_from.as_ref().map(|from| {
                    meters.push(MeterPlan::compile(from));
                    meters.len() - 1
                });
                (Matcher::compile(&c.matches, &mut h), c.upfront(), meter)
            })
            .collect();
        let settling = !meters.is_empty()
            || rules
                .iter()
                .any(|r| r.charge_on.is_some() || (r.in_flight && r.scope == Scope::Global));
        let reads_request_body = meters.iter().any(MeterPlan::reads_request_body);
        let id = &config.identity;
        let key_parts = rules
            .iter()
            .map(|r| &r.key)
            .chain(quotas.iter().map(|q| &q.key));
        let sources = h.key_sources(identity.ip_source, key_parts);
        let (header_needed, source) = reads(
            (h.headers.len(), &sources),
            &identity,
            id.client_id_metadata.is_none(),
            id.tier_metadata.is_none(),
            &rules,
            quotas.as_slice(),
            costs.as_slice(),
        );
        let local_rules = rules
            .iter()
            .filter(|r| r.scope == Scope::Local && !r.stand_in)
            .count();
        Plan {
            local_rules,
            any_graduated: rules.iter().any(|r| r.graduated.is_some()),
            any_in_flight: rules.iter().any(|r| r.in_flight),
            header_names: h.headers,
            properties: h.properties,
            sources,
            header_needed,
            source,
            client_id_property: id
                .client_id_metadata
                .as_ref()
                .map(|p| request::metadata_path(p)),
            tier_property: id.tier_metadata.as_ref().map(|p| request::metadata_path(p)),
            policies: PolicyList::new(&rules),
            rules,
            quotas,
            header_style: config.response.headers,
            too_many_head: super::json::too_many_head(&config.response.problem_type),
            problem_type: config.response.problem_type.clone(),
            quota_problem_type: config.response.quota_problem_type.clone(),
            retry_jitter: config.response.retry_jitter,
            near_limit: config.metrics.near_limit,
            filter_state: config.access_log.filter_state,
            on_error: config.on_error,
            table: Layout::new(&config.domain, config.max_buckets),
            global: config.global.as_ref().map(|g| global_plan(config, g, keys)),
            domain: config.domain.clone(),
            meters,
            settling,
            reads_request_body,
            in_flight: InFlightLayout::new(&config.domain, config.max_buckets),
            costs,
            identity,
        }
    }

    /// The limits of a bucket's rule and variant.
    pub fn limits(&self, rule: usize, variant: usize) -> &[(Limit, u64)] {
        self.rules.get(rule).map_or(&[], |r| r.limits(variant))
    }

    /// The meters of `eval`'s buckets (and of its `costs` entry) that read
    /// the request body, each once: empty when the request is decided at
    /// its headers.
    pub fn body_meters(&self, eval: &Evaluation) -> Vec<usize> {
        let mut out: Vec<usize> = eval
            .buckets
            .iter()
            .chain(&eval.shadow)
            .map(|b| b.rule)
            .chain(eval.global.iter().map(|g| g.rule))
            .filter_map(|rule| self.meter_of(rule, eval.cost_meter))
            .chain(eval.cost_meter)
            .filter(|m| {
                self.meters
                    .get(*m)
                    .is_some_and(MeterPlan::reads_request_body)
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The meter that settles a bucket of `rule`: the rule's own
    /// Coalesced checks, when global checks go in batches.
    pub fn batch(&self) -> Option<&BatchPlan> {
        self.global.as_ref()?.batch.as_ref()
    }

    /// `cost_from`, or the request's `costs` entry's when the rule has no
    /// cost of its own (`cost_meter`, from [`Evaluation::cost_meter`]);
    /// none for a concurrency rule, whose slot is one request.
    pub fn meter_of(&self, rule: usize, cost_meter: Option<usize>) -> Option<usize> {
        let r = self.rules.get(rule).filter(|r| !r.in_flight)?;
        match (r.meter, r.cost) {
            (Some(m), _) => Some(m),
            (None, None) => cost_meter,
            (None, Some(_)) => None,
        }
    }
}

impl Rules for Plan {
    fn rule(&self, rule: usize, variant: usize) -> Option<RuleLimits<'_>> {
        let r = self.rules.get(rule)?;
        Some(RuleLimits {
            algorithm: r.algorithm,
            limits: r.limits(variant),
            graduated: r.graduated.as_ref(),
        })
    }

    fn retry_jitter(&self) -> f64 {
        self.retry_jitter
    }

    fn set_key(&self, index: u64) -> String {
        self.table.set_key(index)
    }
}

/// Lease settings, compiled.
#[derive(Debug, Clone)]
pub struct LeasePlan {
    /// Share of the smallest limit reserved per batch.
    pub fraction: f64,
    /// Timeout of a lease callout.
    pub max_wait_ms: u64,
    /// How long a batch may be spent.
    pub ttl_ns: u64,
    /// Path of the gateway's lease endpoint.
    pub path: String,
    /// The lease slots (shared-data keys).
    pub slots: Slots,
}

impl LeasePlan {
    /// Compiles the settings; `keys` is the proxy's seed, so clients cannot aim at another's slot.
    pub fn new(l: &config::Lease, domain: &str, keys: (u64, u64)) -> LeasePlan {
        LeasePlan {
            fraction: l.fraction,
            max_wait_ms: l.max_wait_ms,
            ttl_ns: l.ttl_ms.saturating_mul(1_000_000),
            path: l.path.clone(),
            slots: Slots::new(
                format!("{KEY_PREFIX}lease/{domain}/{}/", l.max_leases),
                l.max_leases,
                keys,
            ),
        }
    }
}

/// Which headers the compiled plan reads, and when it reads the peer address.
// Kept out of Plan::compile: V8 holds memory superlinear in a wasm
// function's size (BENCHMARKS.md, "Where the memory goes").
#[inline(never)]
fn reads(
    (headers, sources): (usize, &KeySources),
    identity: &IdentityPlan,
    client_from_header: bool,
    tier_from_header: bool,
    rules: &[RulePlan],
    quotas: &[QuotaPlan],
    costs: &[(Matcher, u64, Option<usize>)],
) -> (Vec<bool>, SourceNeed) {
    let mut needed = vec![false; headers];
    let mut mark = |id: HeaderId| {
        if let Some(n) = needed.get_mut(id) {
            *n = true;
        }
    };
    if client_from_header {
        mark(identity.client_header);
    }
    if let (true, Some(t)) = (tier_from_header, identity.tier_header) {
        mark(t);
    }
    let (mut ip, mut client) = (false, false);
    let keys = rules
        .iter()
        .map(|r| &r.key)
        .chain(quotas.iter().map(|q| &q.key));
    for part in keys.flatten() {
        match part {
            KeyPart::Client => client = true,
            KeyPart::Ip | KeyPart::IpPrefix { .. } => ip = true,
            KeyPart::Method => mark(request::METHOD),
            KeyPart::Path | KeyPart::Query(_) => mark(request::PATH),
            KeyPart::Host => mark(sources.authority),
            KeyPart::Cookie(_) => mark(sources.cookie),
            KeyPart::Header(id) => mark(*id),
            // Properties: every one registered is fetched.
            KeyPart::Route | KeyPart::Metadata(_) => {}
        }
    }
    let matchers = rules
        .iter()
        .filter_map(|r| r.matcher.as_ref())
        .chain(quotas.iter().filter_map(|q| q.matcher.as_ref()))
        .chain(costs.iter().map(|(m, _, _)| m));
    for m in matchers {
        m.reads(&mut mark);
    }
    if (ip || client) && identity.ip_source.hops > 0 {
        mark(identity.ip_source.xff);
    }
    let source = match (ip, client) {
        (true, _) => SourceNeed::Always,
        (false, true) => SourceNeed::WithoutClient,
        (false, false) => SourceNeed::Never,
    };
    (needed, source)
}

fn split_seed(seed: [u8; 16]) -> (u64, u64) {
    let (a, b) = seed.split_at(8);
    let k = |s: &[u8]| s.try_into().map(u64::from_le_bytes).unwrap_or_default();
    (k(a), k(b))
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
