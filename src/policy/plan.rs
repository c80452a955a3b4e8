//! The configuration compiled for the request path: matchers, key parts,
//! tiers and limits resolved once, so a request does no parsing, no map
//! lookups but one for a known client, and reads only the headers it needs.

use crate::limits::algorithm::Algorithm;
use crate::config::{
    Circuit, Config, FailureMode, HeaderStyle, LimitSpec, Mode, OnError, Period, QuotaCount, Rule,
    Scope,
};
use crate::policy::key::{self, BadInput, IpSource, KeyPart};
use crate::global::lease::LeasePlan;
use crate::policy::matcher::Matcher;
use crate::policy::request::{HeaderId, RequestInfo};
use crate::limits::table::WAYS;
use crate::limits::token_bucket::Limit;
use siphasher::sip128::{Hasher128, SipHasher13};
use std::collections::HashMap;
use std::hash::Hasher;

/// Prefix of every shared-data key the filter writes (Istio shares one namespace between plugins).
pub const KEY_PREFIX: &str = "ratelimit-wasm/";

/// One set of limits of a rule: the rule's own, a tier's, or a client's override.
#[derive(Debug, Clone)]
pub struct Variant {
    /// `requests` per `per` for each limit, and `per` in seconds for headers.
    pub limits: Vec<(Limit, u64)>,
    /// Hash state after domain, rule, algorithm and limits: changing a limit starts fresh buckets.
    hasher: SipHasher13,
    /// How the gateway protocol names this set.
    pub wire: ratelimit_protocol::Variant,
}

/// Graduated stages of a rule, as shares of its (single) limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraduatedPlan {
    /// Warn from this share used.
    pub warn_at: Option<f64>,
    /// Delay beyond this share used.
    pub delay_at: Option<f64>,
    /// How long to delay.
    pub delay_ms: u64,
    /// Demand share that blocks the client.
    pub block_at: Option<f64>,
    /// How long a block lasts (ns).
    pub block_for_ns: u64,
}

/// A compiled rule.
#[derive(Debug, Clone)]
pub struct RulePlan {
    /// The rule's name.
    pub name: String,
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
    tier_variant: Vec<usize>,
    matcher: Option<Matcher>,
    key: Vec<KeyPart>,
}

impl RulePlan {
    /// The limits of a variant (empty for an unknown one).
    pub fn limits(&self, variant: usize) -> &[(Limit, u64)] {
        self.variants
            .get(variant)
            .map_or(&[], |v| v.limits.as_slice())
    }

    /// Number of states a bucket of this rule keeps: one per limit, plus the
    /// demand and the end of a block for a graduated rule.
    pub fn states(&self, variant: usize) -> usize {
        self.limits(variant).len() + if self.graduated.is_some() { 2 } else { 0 }
    }
}

/// One bucket a request must pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// Index into [`Plan::rules`].
    pub rule: usize,
    /// Index into the rule's variants.
    pub variant: usize,
    /// Identity of the bucket inside its set.
    pub fingerprint: u64,
    /// Which set (shared-data key) holds it.
    pub set: u64,
    /// Tokens the request spends in it.
    pub cost: u64,
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

/// What the plan makes of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evaluation {
    /// The request's cost from `costs` (rules may override it).
    pub cost: u64,
    /// The buckets of every matching, enforced local rule.
    pub buckets: Vec<Bucket>,
    /// The buckets of matching shadow rules (or every local rule for a soft client).
    pub shadow: Vec<Bucket>,
    /// The buckets of every matching global rule.
    pub global: Vec<GlobalBucket>,
    /// The local stand-ins of `global`, for `failure_mode: local`.
    pub fallback: Vec<Bucket>,
    /// The quotas the request counts against.
    pub quotas: Vec<QuotaBucket>,
    /// The client is soft: nothing rejects it.
    pub soft: bool,
    /// The client or its tier is unlimited: nothing applies.
    pub unlimited: bool,
    /// Anything odd about the request's identity.
    pub bad_input: Vec<BadInput>,
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
    count: QuotaCount,
    /// Amount for a tier not listed, and for every client when no tiers are declared.
    limit: Option<u64>,
    by_tier: Vec<Option<u64>>,
    matcher: Option<Matcher>,
    key: Vec<KeyPart>,
}

/// What the filter knows of one client from `identity.clients`.
#[derive(Debug, Clone, Default)]
struct ClientPlan {
    tier: Option<usize>,
    unlimited: bool,
    soft: bool,
    /// (rule, variant) overrides.
    variants: Vec<(usize, usize)>,
    /// (quota, amount) overrides.
    quotas: Vec<(usize, u64)>,
}

/// The gateway settings, as the request path needs them.
#[derive(Debug, Clone)]
pub struct GlobalPlan {
    /// Envoy cluster name.
    pub cluster: String,
    /// `:authority` of the callout.
    pub authority: String,
    /// Path of the check endpoint.
    pub path: String,
    /// Callout timeout.
    pub timeout_ms: u64,
    /// Behaviour on failure.
    pub failure_mode: FailureMode,
    /// Circuit breaker.
    pub circuit: Circuit,
    /// Shared-data key of the circuit-breaker state.
    pub circuit_key: String,
    /// Lease mode, when configured.
    pub lease: Option<LeasePlan>,
    /// `authorization` of the callouts (`Bearer <token>`): the inline
    /// `global.token` here; the filter's `on_configure` resolves `token_env`.
    pub authorization: Option<crate::config::Token>,
}

/// Where identity comes from.
#[derive(Debug, Clone)]
struct IdentityPlan {
    client_header: HeaderId,
    tier_header: Option<HeaderId>,
    ip_source: IpSource,
    tiers: Vec<(String, bool)>,
    default_tier: Option<usize>,
    clients: HashMap<Vec<u8>, ClientPlan>,
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
    /// Property path of the client id in Envoy metadata, when configured.
    pub client_id_property: Option<Vec<String>>,
    /// Property path of the tier in Envoy metadata, when configured.
    pub tier_property: Option<Vec<String>>,
    /// The compiled rules.
    pub rules: Vec<RulePlan>,
    /// The compiled quotas.
    pub quotas: Vec<QuotaPlan>,
    /// Header families on responses.
    pub header_style: HeaderStyle,
    /// `type` of 429 problem bodies.
    pub problem_type: String,
    /// `type` of quota 403 problem bodies.
    pub quota_problem_type: String,
    /// Share of random spread on `Retry-After` and block releases, upwards only.
    pub retry_jitter: f64,
    /// What to do when shared data fails.
    pub on_error: OnError,
    /// Number of sets (shared-data keys) in the bucket table.
    pub sets: u64,
    /// Prefix of the set keys, ending in `/`.
    pub set_key_prefix: String,
    /// The gateway, when any rule is global.
    pub global: Option<GlobalPlan>,
    /// The configuration's domain.
    pub domain: String,
    costs: Vec<(Matcher, u64)>,
    identity: IdentityPlan,
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

/// Registers header names to fetch, giving each an index.
struct Headers(Vec<String>);

impl Headers {
    fn id(&mut self, name: &str) -> HeaderId {
        let name = name.to_ascii_lowercase();
        match self.0.iter().position(|n| *n == name) {
            Some(i) => i,
            None => {
                self.0.push(name);
                self.0.len() - 1
            }
        }
    }

    fn key(&mut self, parts: &[String]) -> Vec<KeyPart> {
        parts
            .iter()
            .map(|p| match p.as_str() {
                "client" => KeyPart::Client,
                "ip" => KeyPart::Ip,
                "method" => KeyPart::Method,
                "path" => KeyPart::Path,
                other => KeyPart::Header(self.id(other.strip_prefix("header:").unwrap_or(other))),
            })
            .collect()
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
}

impl VariantMaker<'_> {
    /// The limits of one set; `instances` above 1 makes a proxy's stand-in share.
    fn make(
        &self,
        (specs, wire): &(&[LimitSpec], ratelimit_protocol::Variant),
        instances: u64,
    ) -> Variant {
        let reject_at = self.rule.graduated.as_ref().map_or(1.0, |g| g.reject_at);
        let limits: Vec<(Limit, u64)> = specs
            .iter()
            .map(|l| {
                let (capacity, period_ns) = share(l, instances);
                // A graduated rule admits up to `reject_at` of the limit; the stages above 100% delay.
                let burst = ((capacity as f64) * reject_at).floor() as u64;
                let limit = Limit {
                    capacity,
                    period_ns,
                    burst: burst.max(capacity),
                };
                (limit, period_ns.div_ceil(1_000_000_000))
            })
            .collect();
        let mut hasher = SipHasher13::new_with_keys(self.keys.0, self.keys.1);
        for part in [
            self.config.domain.as_bytes(),
            self.rule.name.as_bytes(),
            self.rule.algorithm.name().as_bytes(),
        ] {
            hasher.write(&(part.len() as u64).to_le_bytes());
            hasher.write(part);
        }
        for (l, _) in &limits {
            hasher.write(&l.capacity.to_le_bytes());
            hasher.write(&l.period_ns.to_le_bytes());
            hasher.write(&l.burst.to_le_bytes());
        }
        Variant {
            limits,
            hasher,
            wire: wire.clone(),
        }
    }
}

impl Plan {
    /// Compiles a validated configuration. `seed` keys the bucket hash so that
    /// clients cannot aim their keys at another client's bucket.
    pub fn compile(config: &Config, seed: [u8; 16]) -> Plan {
        let mut h = Headers(vec![":method".into(), ":path".into()]);
        let id = &config.identity;
        let tiers: Vec<(String, bool)> = config
            .tiers
            .iter()
            .map(|(name, spec)| (name.clone(), spec.unlimited))
            .collect();
        let tier_index = |name: &str| tiers.iter().position(|(n, _)| n == name);
        let mut identity = IdentityPlan {
            client_header: h.id(&id.client_id_header),
            tier_header: id.tier_header.as_deref().map(|t| h.id(t)),
            ip_source: IpSource {
                xff: h.id("x-forwarded-for"),
                hops: id.trusted_proxy_hops,
            },
            default_tier: id.default_tier.as_deref().and_then(tier_index),
            tiers: tiers.clone(),
            clients: HashMap::new(),
        };
        for (client, spec) in &id.clients {
            identity.clients.insert(
                client.as_bytes().to_vec(),
                ClientPlan {
                    tier: spec.tier.as_deref().and_then(tier_index),
                    unlimited: spec.unlimited,
                    soft: spec.soft,
                    ..ClientPlan::default()
                },
            );
        }
        let keys = split_seed(seed);
        let mut rules = Vec::with_capacity(config.rules.len());
        let mut stand_ins = Vec::new();
        for (rule_index, rule) in config.rules.iter().enumerate() {
            let key = h.key(&rule.key);
            let maker = VariantMaker { config, rule, keys };
            let divisor = match (&config.global, rule.scope) {
                (Some(g), Scope::Global) => Some(g.instances.max(1)),
                _ => None,
            };
            // Variant lists in the same order for the rule and its stand-in.
            use ratelimit_protocol::Variant as Wire;
            let mut specs: Vec<(&[LimitSpec], Wire)> = vec![(&rule.limits, Wire::Default)];
            let tier_variant = tiers
                .iter()
                .map(|(name, _)| match rule.tiers.get(name) {
                    Some(limits) => {
                        specs.push((limits, Wire::Tier(name.clone())));
                        specs.len() - 1
                    }
                    None => 0,
                })
                .collect();
            for (client, spec) in &id.clients {
                if let Some(limits) = spec.limits.get(&rule.name) {
                    specs.push((limits, Wire::Client(client.clone())));
                    if let Some(c) = identity.clients.get_mut(client.as_bytes()) {
                        c.variants.push((rule_index, specs.len() - 1));
                    }
                }
            }
            let graduated = rule.graduated.as_ref().map(|g| GraduatedPlan {
                warn_at: g.warn_at,
                delay_at: g.delay_at,
                delay_ms: g.delay_ms.unwrap_or(0),
                block_at: g.block_at,
                block_for_ns: g.block_for.map_or(0, |s| s.0 * 1_000_000_000),
            });
            let base = RulePlan {
                name: rule.name.clone(),
                algorithm: rule.algorithm,
                scope: rule.scope,
                shadow: rule.mode == Mode::Shadow,
                cost: rule.cost,
                graduated,
                variants: specs.iter().map(|s| maker.make(s, 1)).collect(),
                fallback: None,
                stand_in: false,
                tier_variant,
                matcher: rule
                    .matches
                    .as_ref()
                    .map(|m| Matcher::compile(m, |n| h.id(n))),
                key,
            };
            if let Some(n) = divisor {
                let stand_in = RulePlan {
                    scope: Scope::Local,
                    stand_in: true,
                    matcher: None,
                    variants: specs.iter().map(|s| maker.make(s, n)).collect(),
                    ..base.clone()
                };
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
        let quotas: Vec<QuotaPlan> = config
            .quotas
            .iter()
            .enumerate()
            .map(|(qi, q)| {
                for (client, spec) in &id.clients {
                    if let Some(amount) = spec.quotas.get(&q.name) {
                        if let Some(c) = identity.clients.get_mut(client.as_bytes()) {
                            c.quotas.push((qi, *amount));
                        }
                    }
                }
                let key = h.key(&q.key);
                QuotaPlan {
                    name: q.name.clone(),
                    period: q.period,
                    upgrade_url: q.upgrade_url.clone(),
                    count: q.count,
                    limit: q.limit,
                    by_tier: tiers
                        .iter()
                        .map(|(name, _)| q.tiers.get(name).copied().or(q.limit))
                        .collect(),
                    matcher: q.matches.as_ref().map(|m| Matcher::compile(m, |n| h.id(n))),
                    key,
                }
            })
            .collect();
        let costs: Vec<(Matcher, u64)> = config
            .costs
            .iter()
            .map(|c| (Matcher::compile(&c.matches, |n| h.id(n)), c.cost))
            .collect();
        let sets = (config.max_buckets / WAYS as u64).max(1);
        let (header_needed, source) = reads(
            h.0.len(),
            &identity,
            config.identity.client_id_metadata.is_none(),
            config.identity.tier_metadata.is_none(),
            &rules,
            quotas.as_slice(),
            costs.as_slice(),
        );
        Plan {
            header_names: h.0,
            header_needed,
            source,
            client_id_property: id.client_id_metadata.as_ref().map(|p| metadata_path(p)),
            tier_property: id.tier_metadata.as_ref().map(|p| metadata_path(p)),
            rules,
            quotas,
            header_style: config.response.headers,
            problem_type: config.response.problem_type.clone(),
            quota_problem_type: config.response.quota_problem_type.clone(),
            retry_jitter: config.response.retry_jitter,
            on_error: config.on_error,
            sets,
            set_key_prefix: format!("{KEY_PREFIX}set/{}/{sets}/", config.domain),
            global: config.global.as_ref().map(|g| GlobalPlan {
                cluster: g.cluster.clone(),
                authority: g.authority.clone(),
                path: g.path.clone(),
                timeout_ms: g.timeout_ms,
                failure_mode: g.failure_mode,
                circuit: g.circuit.clone(),
                circuit_key: format!("{KEY_PREFIX}circuit/{}/{}", config.domain, g.cluster),
                lease: g
                    .lease
                    .as_ref()
                    .map(|l| LeasePlan::new(l, &config.domain, keys)),
                authorization: g.bearer(|_| None).ok().flatten().map(crate::config::Token),
            }),
            domain: config.domain.clone(),
            costs,
            identity,
        }
    }

    /// The client id of `req`, from metadata or the header as configured; `None` when absent or empty.
    pub fn client_id<'a>(&self, req: &'a RequestInfo) -> Option<&'a [u8]> {
        match &self.client_id_property {
            Some(_) => req.client_metadata.as_deref(),
            None => req.header(self.identity.client_header),
        }
        .filter(|v| !v.is_empty())
    }

    /// The shared-data key of set `index`.
    pub fn set_key(&self, index: u64) -> String {
        let mut n = itoa::Buffer::new();
        let index = n.format(index);
        let mut key = String::with_capacity(self.set_key_prefix.len() + index.len());
        key.push_str(&self.set_key_prefix);
        key.push_str(index);
        key
    }

    /// The limits of a bucket's rule and variant.
    pub fn limits(&self, rule: usize, variant: usize) -> &[(Limit, u64)] {
        self.rules.get(rule).map_or(&[], |r| r.limits(variant))
    }

    /// Resolves the client: its id (`None`: the IP stands in), its static
    /// settings and its tier. The static map's tier wins over the credential's,
    /// which wins over the default.
    fn client<'a>(
        &'a self,
        req: &'a RequestInfo,
    ) -> (Option<&'a [u8]>, Option<&'a ClientPlan>, Option<usize>) {
        let id = &self.identity;
        let client_id = self.client_id(req);
        let known = client_id.and_then(|c| id.clients.get(c));
        let claimed = match (&self.tier_property, id.tier_header) {
            (Some(_), _) => req.tier_metadata.as_deref(),
            (None, Some(h)) => req.header(h),
            (None, None) => None,
        };
        let tier = known
            .and_then(|k| k.tier)
            .or_else(|| claimed.and_then(|t| id.tiers.iter().position(|(n, _)| n.as_bytes() == t)))
            .or(id.default_tier);
        (client_id, known, tier)
    }

    /// Finds the cost and the buckets of every rule and quota that applies to `req`.
    pub fn evaluate(&self, req: &RequestInfo) -> Evaluation {
        let cost = self
            .costs
            .iter()
            .find(|(m, _)| m.matches(req))
            .map_or(1, |(_, c)| *c);
        let (client_id, known, tier) = self.client(req);
        let mut eval = Evaluation {
            cost,
            soft: known.is_some_and(|k| k.soft),
            unlimited: known.is_some_and(|k| k.unlimited)
                || tier
                    .and_then(|t| self.identity.tiers.get(t))
                    .is_some_and(|(_, u)| *u),
            ..Evaluation::default()
        };
        if eval.unlimited {
            return eval;
        }
        let ip = self.identity.ip_source;
        for (i, rule) in self.rules.iter().enumerate() {
            // Stand-ins are reached through their global rule only.
            if rule.stand_in || !rule.matcher.as_ref().is_none_or(|m| m.matches(req)) {
                continue;
            }
            let variant = known
                .and_then(|k| k.variants.iter().find(|(r, _)| *r == i).map(|(_, v)| *v))
                .or_else(|| tier.and_then(|t| rule.tier_variant.get(t).copied()))
                .unwrap_or(0);
            let Some(v) = rule.variants.get(variant) else {
                continue;
            };
            let mut hash = v.hasher;
            let mut stand_in = rule.fallback.and_then(|f| {
                self.rules
                    .get(f)
                    .and_then(|r| r.variants.get(variant))
                    .map(|v| (f, v.hasher))
            });
            let mut global =
                (rule.scope == Scope::Global).then(|| (rule.name.clone(), String::new()));
            let applies = key::write_key(
                &rule.key,
                req,
                client_id,
                ip,
                &mut eval.bad_input,
                &mut |tag, value| {
                    hash_part(&mut hash, tag, value);
                    if let Some((_, h)) = stand_in.as_mut() {
                        hash_part(h, tag, value);
                    }
                    if let Some((k, t)) = global.as_mut() {
                        key::encode_part(k, t.is_empty().then_some(t), tag, value);
                    }
                },
            );
            if !applies {
                continue;
            }
            let cost = rule.cost.unwrap_or(cost);
            match global {
                Some((key, tag)) => {
                    eval.global.push(GlobalBucket {
                        rule: i,
                        variant,
                        key: key::bounded(key, &rule.name),
                        tag,
                        cost,
                    });
                    if let Some((f, h)) = stand_in {
                        eval.fallback.push(self.bucket(f, variant, h, cost));
                    }
                }
                None if rule.shadow || eval.soft => {
                    eval.shadow.push(self.bucket(i, variant, hash, cost))
                }
                None => eval.buckets.push(self.bucket(i, variant, hash, cost)),
            }
        }
        for (qi, q) in self.quotas.iter().enumerate() {
            if !q.matcher.as_ref().is_none_or(|m| m.matches(req)) {
                continue;
            }
            use ratelimit_protocol::Variant as Wire;
            let by_client = known
                .and_then(|k| k.quotas.iter().find(|(x, _)| *x == qi).map(|(_, a)| *a))
                .zip(client_id);
            let (limit, variant) = match (by_client, tier) {
                (Some((a, c)), _) => (
                    Some(a),
                    Wire::Client(String::from_utf8_lossy(c).into_owned()),
                ),
                (None, Some(t)) => (
                    q.by_tier.get(t).copied().flatten(),
                    self.identity
                        .tiers
                        .get(t)
                        .map_or(Wire::Default, |(n, _)| Wire::Tier(n.clone())),
                ),
                (None, None) => (q.limit, Wire::Default),
            };
            let Some(limit) = limit else { continue };
            let (mut k, mut tag) = (q.name.clone(), String::new());
            let applies = key::write_key(
                &q.key,
                req,
                client_id,
                ip,
                &mut eval.bad_input,
                &mut |t, value| {
                    key::encode_part(&mut k, tag.is_empty().then_some(&mut tag), t, value);
                },
            );
            if applies {
                let amount = match q.count {
                    QuotaCount::Requests => 1,
                    QuotaCount::Cost => cost,
                };
                eval.quotas.push(QuotaBucket {
                    quota: qi,
                    key: key::bounded(k, &q.name),
                    tag,
                    limit,
                    variant,
                    amount,
                });
            }
        }
        eval
    }

    fn bucket(&self, rule: usize, variant: usize, hasher: SipHasher13, cost: u64) -> Bucket {
        let hash = hasher.finish128();
        Bucket {
            rule,
            variant,
            fingerprint: hash.h1,
            set: hash.h2 % self.sets,
            cost,
        }
    }
}

/// Which headers the compiled plan reads, and when it reads the peer address.
fn reads(
    headers: usize,
    identity: &IdentityPlan,
    client_from_header: bool,
    tier_from_header: bool,
    rules: &[RulePlan],
    quotas: &[QuotaPlan],
    costs: &[(Matcher, u64)],
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
            KeyPart::Ip => ip = true,
            KeyPart::Method => mark(crate::policy::request::METHOD),
            KeyPart::Path => mark(crate::policy::request::PATH),
            KeyPart::Header(id) => mark(*id),
        }
    }
    let matchers = rules
        .iter()
        .filter_map(|r| r.matcher.as_ref())
        .chain(quotas.iter().filter_map(|q| q.matcher.as_ref()))
        .chain(costs.iter().map(|(m, _)| m));
    for m in matchers {
        m.reads().for_each(&mut mark);
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

/// Envoy's property path for a field of a filter's dynamic metadata.
fn metadata_path(path: &[String]) -> Vec<String> {
    let mut out = vec!["metadata".to_string(), "filter_metadata".to_string()];
    out.extend(path.iter().cloned());
    out
}

fn hash_part(h: &mut SipHasher13, tag: u8, value: &[u8]) {
    h.write(&[tag]);
    h.write(&(value.len() as u64).to_le_bytes());
    h.write(value);
}

fn split_seed(seed: [u8; 16]) -> (u64, u64) {
    let (a, b) = seed.split_at(8);
    let k = |s: &[u8]| s.try_into().map(u64::from_le_bytes).unwrap_or_default();
    (k(a), k(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn plan(json: &str) -> Plan {
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [7; 16])
    }

    fn request(
        plan: &Plan,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        peer: &str,
    ) -> RequestInfo {
        let headers = plan
            .header_names
            .iter()
            .map(|n| match n.as_str() {
                ":method" => Some(method.as_bytes().to_vec()),
                ":path" => Some(path.as_bytes().to_vec()),
                n => headers
                    .iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.as_bytes().to_vec()),
            })
            .collect();
        RequestInfo {
            headers,
            source_address: Some(peer.as_bytes().to_vec()),
            ..RequestInfo::default()
        }
    }

    const EXAMPLE: &str = r#"{
      "domain": "demo",
      "rules": [
        { "name": "per-client", "key": ["client"], "limits": [ { "requests": 60, "per": "1m" }, { "requests": 10, "per": "1s" } ] },
        { "name": "uploads", "match": { "path_prefix": "/upload", "methods": ["POST"] }, "key": ["client", "path"], "limits": [ { "requests": 5, "per": "1m" } ] },
        { "name": "tenant", "key": ["header:X-Tenant"], "limits": [ { "requests": 5, "per": "1m" } ] }
      ],
      "costs": [ { "match": { "path_prefix": "/search" }, "cost": 5 }, { "match": { "path_prefix": "/s" }, "cost": 2 } ]
    }"#;

    #[test]
    fn reads_only_needed_headers() {
        let p = plan(EXAMPLE);
        assert_eq!(
            p.header_names,
            [
                ":method",
                ":path",
                "x-client-id",
                "x-forwarded-for",
                "x-tenant"
            ]
        );
        // X-Forwarded-For is registered but not read without trusted hops.
        assert_eq!(p.header_needed, [true, true, true, false, true]);
        assert_eq!(p.source, SourceNeed::WithoutClient);
        let only_client = plan(
            r#"{"domain":"d","rules":[{"name":"r","key":["client"],"limits":[{"requests":1,"per":1}]}]}"#,
        );
        assert_eq!(only_client.header_needed, [false, false, true, false]);
        let by_ip = plan(
            r#"{"domain":"d","identity":{"trusted_proxy_hops":1},"rules":[{"name":"r","key":["ip"],"match":{"methods":["GET"]},"limits":[{"requests":1,"per":1}]}]}"#,
        );
        assert_eq!(by_ip.header_needed, [true, false, true, true]);
        assert_eq!(by_ip.source, SourceNeed::Always);
        assert_eq!(p.sets, 16_384);
        assert_eq!(p.set_key(3), "ratelimit-wasm/set/demo/16384/3");
    }

    #[test]
    fn matching_rules_and_first_cost_win() {
        let p = plan(EXAMPLE);
        let get = p.evaluate(&request(
            &p,
            "GET",
            "/search?q",
            &[("x-client-id", "a")],
            "1.1.1.1:1",
        ));
        assert_eq!(get.cost, 5);
        assert_eq!(
            get.buckets
                .iter()
                .map(|b| (b.rule, b.cost))
                .collect::<Vec<_>>(),
            [(0, 5)]
        );
        let up = p.evaluate(&request(
            &p,
            "POST",
            "/upload",
            &[("x-tenant", "t")],
            "1.1.1.1:1",
        ));
        assert_eq!(up.cost, 1);
        assert_eq!(
            up.buckets.iter().map(|b| b.rule).collect::<Vec<_>>(),
            [0, 1, 2]
        );
    }

    #[test]
    fn buckets_differ_by_client_and_rule_and_are_stable() {
        let p = plan(EXAMPLE);
        let a1 = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "a")],
            "1.1.1.1:1",
        ));
        let a2 = p.evaluate(&request(
            &p,
            "GET",
            "/x",
            &[("x-client-id", "a")],
            "2.2.2.2:1",
        ));
        let b = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "b")],
            "1.1.1.1:1",
        ));
        assert_eq!(a1.buckets, a2.buckets);
        assert_ne!(a1.buckets[0].fingerprint, b.buckets[0].fingerprint);
        let other_seed = Plan::compile(&config::parse(EXAMPLE.as_bytes()).unwrap(), [8; 16]);
        let a3 = other_seed.evaluate(&request(
            &other_seed,
            "GET",
            "/",
            &[("x-client-id", "a")],
            "1.1.1.1:1",
        ));
        assert_ne!(a1.buckets[0].fingerprint, a3.buckets[0].fingerprint);
    }

    const TIERS: &str = r#"{
      "domain": "d",
      "tiers": { "free": {}, "pro": {}, "staff": { "unlimited": true } },
      "identity": { "default_tier": "free", "tier_header": "x-tier",
        "clients": { "acme": { "tier": "pro", "limits": { "api": [ { "requests": 500, "per": "1m" } ] } },
                     "root": { "unlimited": true }, "trial": { "soft": true } } },
      "rules": [
        { "name": "api", "key": ["client"], "limits": [ { "requests": 10, "per": "1m" } ],
          "tiers": { "pro": [ { "requests": 100, "per": "1m" } ] }, "cost": 3 },
        { "name": "watch", "mode": "shadow", "limits": [ { "requests": 1, "per": "1h" } ] }
      ]
    }"#;

    fn capacity(p: &Plan, e: &Evaluation) -> u64 {
        let b = e.buckets[0];
        p.limits(b.rule, b.variant)[0].0.capacity
    }

    #[test]
    fn tiers_come_from_the_static_map_then_the_credential_then_the_default() {
        let p = plan(TIERS);
        let free = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "x")],
            "1.1.1.1:1",
        ));
        assert_eq!(capacity(&p, &free), 10);
        let pro = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "x"), ("x-tier", "pro")],
            "1.1.1.1:1",
        ));
        assert_eq!(capacity(&p, &pro), 100);
        assert_ne!(free.buckets[0].fingerprint, pro.buckets[0].fingerprint);
        let unknown = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "x"), ("x-tier", "gold")],
            "1.1.1.1:1",
        ));
        assert_eq!(capacity(&p, &unknown), 10);
        // acme is pro by the static map and has its own override.
        let acme = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "acme"), ("x-tier", "free")],
            "1.1.1.1:1",
        ));
        assert_eq!(capacity(&p, &acme), 500);
        assert_eq!(acme.buckets[0].cost, 3, "the rule's cost overrides");
        assert_eq!(acme.shadow.len(), 1, "shadow rules go aside");
    }

    #[test]
    fn unlimited_and_soft_clients() {
        let p = plan(TIERS);
        let root = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "root")],
            "1.1.1.1:1",
        ));
        assert!(root.unlimited && root.buckets.is_empty() && root.shadow.is_empty());
        let staff = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-tier", "staff")],
            "1.1.1.1:1",
        ));
        assert!(staff.unlimited);
        let trial = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "trial")],
            "1.1.1.1:1",
        ));
        assert!(trial.soft && trial.buckets.is_empty());
        assert_eq!(trial.shadow.len(), 2);
    }

    #[test]
    fn metadata_identity_ignores_headers() {
        let json = r#"{"domain":"d","tiers":{"free":{},"pro":{}},
            "identity":{"default_tier":"free","client_id_metadata":["envoy.filters.http.jwt_authn","payload","sub"],
                        "tier_metadata":["envoy.filters.http.jwt_authn","payload","tier"]},
            "rules":[{"name":"api","key":["client"],"limits":[{"requests":10,"per":"1m"}],"tiers":{"pro":[{"requests":100,"per":"1m"}]}}]}"#;
        let p = plan(json);
        assert_eq!(
            p.client_id_property.as_deref().unwrap(),
            [
                "metadata",
                "filter_metadata",
                "envoy.filters.http.jwt_authn",
                "payload",
                "sub"
            ]
        );
        let mut forged = request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "victim"), ("x-tier", "pro")],
            "1.1.1.1:1",
        );
        let anonymous = p.evaluate(&forged);
        assert_eq!(capacity(&p, &anonymous), 10);
        let by_ip = p.evaluate(&request(&p, "GET", "/", &[], "1.1.1.1:1"));
        assert_eq!(
            anonymous.buckets, by_ip.buckets,
            "a header id is not trusted"
        );
        forged.client_metadata = Some(b"alice".to_vec());
        forged.tier_metadata = Some(b"pro".to_vec());
        let alice = p.evaluate(&forged);
        assert_eq!(capacity(&p, &alice), 100);
    }

    #[test]
    fn a_quota_limit_applies_when_no_tiers_are_declared() {
        let json = r#"{"domain":"d","global":{"cluster":"gw"},
            "rules":[{"name":"api","key":["client"],"limits":[{"requests":10,"per":"1m"}]}],
            "quotas":[{"name":"daily","key":["client"],"period":"day","limit":7,"upgrade_url":"https://e.com/up"}]}"#;
        let p = plan(json);
        let e = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "a")],
            "1.1.1.1:1",
        ));
        assert_eq!(e.quotas.len(), 1);
        assert_eq!(e.quotas[0].limit, 7);
    }

    #[test]
    fn quotas_by_tier_and_client() {
        let json = r#"{"domain":"d","tiers":{"free":{},"pro":{}},"global":{"cluster":"gw"},
            "identity":{"default_tier":"free","tier_header":"x-tier","clients":{"big":{"quotas":{"monthly":5}}}},
            "rules":[{"name":"api","key":["client"],"limits":[{"requests":10,"per":"1m"}]}],
            "costs":[{"match":{"path_prefix":"/export"},"cost":50}],
            "quotas":[{"name":"monthly","key":["client"],"period":"month","tiers":{"free":100,"pro":1000},
                       "upgrade_url":"https://example.com/upgrade","count":"cost"}]}"#;
        let p = plan(json);
        let free = p.evaluate(&request(
            &p,
            "GET",
            "/export",
            &[("x-client-id", "a")],
            "1.1.1.1:1",
        ));
        assert_eq!(
            free.quotas,
            [QuotaBucket {
                quota: 0,
                key: "monthly/c=a".into(),
                tag: "c=a".into(),
                limit: 100,
                variant: ratelimit_protocol::Variant::Tier("free".into()),
                amount: 50
            }]
        );
        let pro = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "a"), ("x-tier", "pro")],
            "1.1.1.1:1",
        ));
        assert_eq!((pro.quotas[0].limit, pro.quotas[0].amount), (1000, 1));
        let big = p.evaluate(&request(
            &p,
            "GET",
            "/",
            &[("x-client-id", "big")],
            "1.1.1.1:1",
        ));
        assert_eq!(big.quotas[0].limit, 5);
        // The gateway is told which amount applies, never the amount.
        use ratelimit_protocol::Variant;
        assert_eq!(pro.quotas[0].variant, Variant::Tier("pro".into()));
        assert_eq!(big.quotas[0].variant, Variant::Client("big".into()));
    }

    /// The stand-in limit of a global rule with `requests` per `per` seconds
    /// shared by `instances` proxies.
    fn stand_in(requests: u64, per: u64, instances: u64, algorithm: &str) -> (Limit, u64) {
        let p = plan(&format!(
            r#"{{"domain":"d","global":{{"cluster":"gw","instances":{instances}}},
                "rules":[{{"name":"g","scope":"global","algorithm":"{algorithm}",
                           "limits":[{{"requests":{requests},"per":{per}}}]}}]}}"#
        ));
        let f = p.rules[0].fallback.unwrap();
        assert!(p.rules[f].stand_in);
        p.rules[f].limits(0)[0]
    }

    /// Admissions of one proxy that retries the moment its stand-in allows,
    /// from a full bucket at 0 until `horizon_ns` included: the most it can admit.
    fn greedy_admissions(limit: &Limit, horizon_ns: u64) -> u64 {
        let (mut tat, mut now, mut admitted) = (None, 0, 0);
        while now <= horizon_ns {
            let c = limit.check(tat, now, 1);
            if c.allowed {
                tat = Some(c.new_state);
                admitted += 1;
            } else {
                now += c.retry_after_ns.max(1);
            }
        }
        admitted
    }

    #[test]
    fn the_failure_mode_local_stand_in_keeps_the_exact_share_with_more_proxies_than_requests() {
        const SEC: u64 = 1_000_000_000;
        // 3/s over 10 proxies: one token per 10/3 s each, a bucket of one.
        let (limit, window_secs) = stand_in(3, 1, 10, "token_bucket");
        assert_eq!(
            (limit.capacity, limit.period_ns, limit.burst),
            (1, 3_333_333_334, 1)
        );
        assert_eq!(window_secs, 4, "RateLimit-Policy w: the period rounded up");
        // Over 10 s (and 1 µs for the period's rounding to a whole ns): the
        // bucket of 1 plus 3 per 10 s. The fleet: 10 × 4 = 40 = 3 × 10 + 10 × 1.
        assert_eq!(greedy_admissions(&limit, 10 * SEC + 1_000), 4);
        assert_eq!(greedy_admissions(&limit, 100 * SEC + 1_000), 31);
        // Where the share divides evenly, the period is the rule's own.
        let (limit, window_secs) = stand_in(4, 60, 2, "token_bucket");
        assert_eq!(
            (limit.capacity, limit.period_ns, window_secs),
            (2, 60 * SEC, 60)
        );
        // 7/s over 2 proxies: 3 per 6/7 s each, rounded up to the ns (never above the share).
        let (limit, _) = stand_in(7, 1, 2, "sliding_window");
        assert_eq!((limit.capacity, limit.period_ns), (3, 857_142_858));
        // The longest period the validation allows still fits: 1 per 366 d over 10^4 proxies.
        let (limit, _) = stand_in(1, 366 * 86_400, 10_000, "token_bucket");
        assert_eq!((limit.capacity, limit.period_ns), (1, u64::MAX));
    }
}
