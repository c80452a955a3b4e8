//! The gateway's policy: the plugin configurations the filters load (`--policy`),
//! parsed and validated by the filter's own code (`ratelimit_config::parse`),
//! indexed by `domain`.
//!
//! A request names identifiers only ([`ratelimit_protocol`]); [`Policy::resolve_check`]
//! and [`Policy::resolve_lease`] turn them into the limits, windows, quota
//! amounts, periods and lease bounds the scripts enforce, or a 400 message
//! naming the field. What a request can name is bounded here:
//!
//! * a domain of the policy, a global rule or a quota of that domain, each at
//!   most once per request (so at most as many buckets as the domain has
//!   global rules, and as many quotas as it has quotas);
//! * a variant the rule or quota has (`default`, `tier:<name>`,
//!   `client:<id>` with an override), and `client:<id>` only on a key whose
//!   `client` part is that id's (`c=<id>`, as the filter encodes it); every
//!   variant refused is answered with the same words ([`NO_SUCH_VARIANT`]),
//!   so a 400 never tells which tiers or client overrides exist. A tier
//!   cannot be checked here: the caller read it from the request's
//!   credentials (`docs/security.md`);
//! * a key that starts with the rule's (quota's) name, as the filter writes it;
//!   the hash tag is the gateway's, derived from the key ([`tag_of`]), never
//!   the request's `tag`;
//! * a cost up to the largest the policy can give the rule (its `cost`, or
//!   the largest of `costs[]` and 1), an amount up to what the quota's
//!   `count` allows (1, or that largest cost);
//! * a lease only on a token-bucket rule of a domain with `global.lease`,
//!   enforced and without graduated stages (those are checked per request),
//!   granted at most `lease.fraction` of its smallest limit, its ledger kept
//!   `lease.ttl_ms`.
//!
//! How a bucket is held is the policy's too, never a field of the request:
//! a rule's `mode: shadow` and a soft client (`identity.clients.<id>.soft`,
//! recognised on a rule keyed on `client` by the key's `client` part, as a
//! client override is) make it watched ([`Watch`]); a rule's `graduated`
//! stages become [`Stages`] for the limit of the variant named.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use ratelimit_config::key::{bounded, encode_part};
use ratelimit_config::{self as plugin, KeyPart, QuotaCount, Scope};
use ratelimit_protocol::{
    Algorithm, BatchRequest, BucketRef, CheckRequest, LeaseRequest, Limit, Period, QuotaRef,
    Settlement, Variant, Watch,
};

use crate::reload::Source;

/// Every domain's policy.
#[derive(Debug, Default)]
pub struct Policy {
    domains: HashMap<String, Domain>,
}

/// A request's `domain` that no plugin configuration of the policy has
/// (none at all when the gateway runs without `--policy`). Its own type so
/// that the HTTP side answers it 404, apart from the 400s of the fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownDomain(pub String);

impl std::fmt::Display for UnknownDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "domain: unknown domain `{}`: not in the gateway's policy",
            self.0
        )
    }
}

/// One domain: what one plugin configuration allows.
#[derive(Debug)]
struct Domain {
    rules: HashMap<String, RulePolicy>,
    quotas: HashMap<String, QuotaPolicy>,
    lease: Option<LeasePolicy>,
    /// The `client` key part (`c=<id>`, as the filter encodes it) of every
    /// soft client.
    soft: HashSet<String>,
    /// `response.retry_jitter`: the most a block is lengthened, as a share.
    retry_jitter: f64,
}

#[derive(Debug)]
struct RulePolicy {
    algorithm: Algorithm,
    limits: Vec<Limit>,
    tiers: HashMap<String, Vec<Limit>>,
    clients: HashMap<String, Vec<Limit>>,
    /// `limits_by.sets`: the sets a request names by metadata.
    sets: HashMap<String, Vec<Limit>>,
    max_cost: u64,
    /// The most a settlement may charge one request in this rule (its
    /// `cost_from.max`, or the largest of the `costs[]` entries' that read
    /// the response; its check cost under `charge_on` alone); `None`: the
    /// rule does not settle, and a settlement naming it is refused.
    settle_max: Option<u64>,
    /// The rule's key parts (`client`, `ip`, `method`, `path`,
    /// `header:<name>`), to build its key for a native descriptor (`crate::rls`).
    key: Vec<KeyPart>,
    /// A concurrency rule: each check takes one slot under its reservation,
    /// which a settlement of cost 0 gives back.
    in_flight: bool,
    /// `mode: shadow`: counted, never denying.
    shadow: bool,
    /// The rule's graduated stages, as shares of its limit.
    graduated: Option<plugin::Graduated>,
}

#[derive(Debug)]
struct QuotaPolicy {
    /// The quota's key parts, as [`RulePolicy::key`].
    key: Vec<KeyPart>,
    period: Period,
    limit: Option<u64>,
    /// Every declared tier with its amount (the quota's `tiers.<name>`, else its `limit`).
    tiers: HashMap<String, Option<u64>>,
    clients: HashMap<String, u64>,
    max_amount: u64,
    /// The most a settlement may count one request (`count: cost` with a
    /// `costs[]` entry reading the response); `None`: it does not settle.
    settle_max: Option<u64>,
}

/// A domain's lease bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeasePolicy {
    /// Most of the smallest limit granted per lease call.
    pub fraction: f64,
    /// Life of a caller's ledger entry, in ms.
    pub ttl_ms: u64,
}

/// A check with everything resolved from the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The domain.
    pub domain: String,
    /// One per bucket of the request, in order.
    pub buckets: Vec<ResolvedBucket>,
    /// One per quota of the request, in order.
    pub quotas: Vec<ResolvedQuota>,
    /// The id an allowed check keeps its charges under, for a settlement.
    pub reservation: Option<String>,
}

/// A settlement with everything resolved from the policy: the buckets'
/// costs and the quotas' amounts are the real ones, each within the
/// policy's `max`.
pub type ResolvedSettlement = Resolved;

/// A bucket with its policy limits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvedBucket {
    /// As the request named it.
    pub key: String,
    /// The cluster hash tag, derived from `key` ([`tag_of`]).
    pub tag: String,
    /// The request's cost in this bucket (within the policy's bound).
    pub cost: u64,
    /// The limits of the rule's variant, from the policy.
    pub limits: Vec<Limit>,
    /// Tokens of debt a settlement may leave in the bucket (0: none; a rule
    /// that settles: [`plugin::bounds::DEBT_OVERRUNS`] settlements of its
    /// `max`). Check and settle scripts read a token bucket's TAT up to that
    /// far ahead as debt, not as a clock that stepped back.
    pub debt: u64,
    /// Whether the bucket's denial denies the check (the rule's mode, the
    /// client's softness).
    pub watch: Watch,
    /// The rule's graduated stages for this variant's limit.
    pub stages: Option<Stages>,
}

/// A graduated rule's stages for one variant, in whole tokens of its
/// (single) limit of `requests`, as the filter's `limits/` counts them: a
/// share in use is whole tokens used (partly refilled ones count as used)
/// over `requests`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stages {
    /// The bucket holds `reject_at` of the limit, rounded down (at least
    /// `requests`).
    pub burst: u64,
    /// Warn from this many tokens in use (`warn_at`).
    pub warn_from: Option<u64>,
    /// Delay from this many tokens in use (past `delay_at`).
    pub delay_from: Option<u64>,
    /// How long a delayed request is held.
    pub delay_ms: u64,
    /// The demand bucket's size, `block_at` of the limit rounded up: a
    /// client whose demand (denied requests included) fills it is blocked.
    /// 0: no block stage.
    pub demand: u64,
    /// How long a block lasts.
    pub block_for_ms: u64,
    /// The most a block is lengthened by `response.retry_jitter`.
    pub jitter_ms: u64,
}

impl Stages {
    /// The stages of `g` over a limit of `requests`, with `jitter` the
    /// policy's `response.retry_jitter`.
    pub fn of(g: &plugin::Graduated, requests: u64, jitter: f64) -> Stages {
        let c = requests as f64;
        // As the filter's stages: warn at share + 1e-9 >= warn_at, delay at
        // share > delay_at + 1e-9, over whole tokens.
        let warn_from = g.warn_at.map(|w| (c * (w - 1e-9)).ceil().max(0.0) as u64);
        let delay_from = g.delay_at.map(|d| (c * (d + 1e-9)).floor() as u64 + 1);
        let block_for_ms = g.block_for.map_or(0, |s| s.0.saturating_mul(1000));
        Stages {
            burst: ((c * g.reject_at).floor() as u64).max(requests),
            warn_from,
            delay_from,
            delay_ms: g.delay_ms.unwrap_or(0),
            demand: match g.block_at {
                Some(b) if block_for_ms > 0 => (c * b).ceil() as u64,
                _ => 0,
            },
            block_for_ms,
            jitter_ms: (block_for_ms as f64 * jitter.clamp(0.0, 0.5)) as u64,
        }
    }
}

/// A quota with its policy amount and period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedQuota {
    /// As the request named it.
    pub key: String,
    /// The cluster hash tag, derived from `key` ([`tag_of`]).
    pub tag: String,
    /// Amount per period, from the policy.
    pub limit: u64,
    /// The period, from the policy.
    pub period: Period,
    /// What this request counts (within what the quota's `count` allows).
    pub amount: u64,
}

/// A shared descriptor's bucket ([`Policy::shared_bucket`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedBucket {
    /// The bucket, its cost the descriptor's hits.
    pub bucket: ResolvedBucket,
    /// The most one request may cost the rule (its `cost`, else the
    /// largest of `costs[]` and 1).
    pub max_cost: u64,
}

/// A lease with its policy limits and bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedLease {
    /// The domain.
    pub domain: String,
    /// As the request named it.
    pub key: String,
    /// The cluster hash tag, derived from `key` ([`tag_of`]).
    pub tag: String,
    /// The token-bucket limits of the rule's variant, from the policy.
    pub limits: Vec<Limit>,
    /// Tokens asked for, capped at `lease.fraction` of the smallest limit.
    pub want: u64,
    /// Tokens given back (the script caps them at what the caller holds).
    pub returned: u64,
    /// Life of the caller's ledger entry (`lease.ttl_ms`).
    pub ttl_ms: u64,
}

/// Parses every file as a plugin configuration; errors are
/// `<file>: <field path>: <reason>`. Two files with one domain are refused.
pub fn parse(sources: &[Source]) -> Result<Policy, String> {
    let mut policy = Policy::default();
    let mut from: HashMap<String, PathBuf> = HashMap::new();
    for s in sources {
        let config = plugin::parse(&s.bytes).map_err(|e| format!("{}: {e}", s.path.display()))?;
        if let Some(first) = from.get(&config.domain) {
            return Err(format!(
                "{}: domain: `{}` is already defined by {}",
                s.path.display(),
                config.domain,
                first.display()
            ));
        }
        from.insert(config.domain.clone(), s.path.clone());
        let domain = Domain::new(&config).map_err(|e| format!("{}: {e}", s.path.display()))?;
        policy.domains.insert(config.domain.clone(), domain);
    }
    Ok(policy)
}

/// The most a settlement may charge one request in global rule `r`, as the
/// filter settles it (`Plan::meter_of`: the rule's own `cost_from`, else,
/// without a `cost` of its own, the `costs[]` entry's); a `charge_on` rule
/// settles at least its check cost (given back: 0), and a concurrency rule
/// settles its slot to 0 when the stream ends. `None`: it never settles.
fn rule_settle_max(r: &plugin::Rule, max_cost: u64, costs_settle: Option<u64>) -> Option<u64> {
    if r.is_concurrent() {
        // A slot's real cost once its stream ended: released.
        return Some(0);
    }
    let from_response = match (&r.cost_from, r.cost) {
        (Some(from), _) => Some(from.max),
        (None, None) => costs_settle,
        (None, Some(_)) => None,
    };
    let charged = r.charge_on.as_ref().map(|_| r.cost.unwrap_or(max_cost));
    from_response.max(charged)
}

fn limits_of(algorithm: Algorithm, specs: &[plugin::LimitSpec]) -> Vec<Limit> {
    specs
        .iter()
        .map(|l| match l.concurrent {
            Some(slots) => Limit {
                requests: slots.into(),
                window_ms: l.max_in_flight_secs().saturating_mul(1000),
                algorithm,
                in_flight: true,
            },
            None => Limit {
                requests: l.requests,
                window_ms: l.per.0.saturating_mul(1000),
                algorithm,
                in_flight: false,
            },
        })
        .collect()
}

/// The refusal of a client override the gateway could not check: the
/// override's rule or quota has no `client` part in its key, so no key
/// names whose override it is.
fn unverifiable(field: String, what: &str, name: &str) -> String {
    format!(
        "{field}: {what} `{name}` has no `client` in its key, so the gateway cannot check whose \
         key a `client:<id>` variant names; key it on `client`, or use a tier"
    )
}

impl RulePolicy {
    /// Tokens of debt a settlement may leave in one of the rule's buckets.
    fn debt(&self) -> u64 {
        self.settle_max
            .map_or(0, |m| m.saturating_mul(plugin::bounds::DEBT_OVERRUNS))
    }
}

impl Domain {
    fn new(c: &plugin::Config) -> Result<Domain, String> {
        for (id, spec) in &c.identity.clients {
            for rule in spec.limits.keys() {
                let global = c
                    .rules
                    .iter()
                    .find(|r| r.name == *rule && r.scope == Scope::Global);
                if global.is_some_and(|r| !r.key.contains(&KeyPart::Client)) {
                    let at = format!("identity.clients.{id}.limits.{rule}");
                    return Err(unverifiable(at, "global rule", rule));
                }
            }
            for quota in spec.quotas.keys() {
                let q = c.quotas.iter().find(|q| q.name == *quota);
                if q.is_some_and(|q| !q.key.contains(&KeyPart::Client)) {
                    let at = format!("identity.clients.{id}.quotas.{quota}");
                    return Err(unverifiable(at, "quota", quota));
                }
            }
        }
        // The largest cost `costs` can give a request at its check (a
        // reservation read from the request body reaches `max` at most); 1
        // when none matches.
        let max_cost = c
            .costs
            .iter()
            .map(|x| x.cost_from.as_ref().map_or(x.upfront(), |f| f.max))
            .max()
            .unwrap_or(1)
            .max(1);
        // The largest real cost a `costs[]` entry reading the response settles.
        let costs_settle = c
            .costs
            .iter()
            .filter_map(|x| x.cost_from.as_ref().map(|f| f.max))
            .max();
        let rules = c
            .rules
            .iter()
            .filter(|r| r.scope == Scope::Global)
            .map(|r| {
                let clients = c
                    .identity
                    .clients
                    .iter()
                    .filter_map(|(id, spec)| {
                        let l = spec.limits.get(&r.name)?;
                        Some((id.clone(), limits_of(r.algorithm, l)))
                    })
                    .collect();
                let policy = RulePolicy {
                    algorithm: r.algorithm,
                    limits: limits_of(r.algorithm, &r.limits),
                    tiers: r
                        .tiers
                        .iter()
                        .map(|(t, l)| (t.clone(), limits_of(r.algorithm, l)))
                        .collect(),
                    clients,
                    sets: r
                        .limits_by
                        .iter()
                        .flat_map(|b| &b.sets)
                        .map(|(n, l)| (n.clone(), limits_of(r.algorithm, l)))
                        .collect(),
                    max_cost: match &r.cost_from {
                        _ if r.is_concurrent() => 1,
                        Some(from) => from.max,
                        None => r.cost.unwrap_or(max_cost),
                    },
                    settle_max: rule_settle_max(r, max_cost, costs_settle),
                    key: r.key.clone(),
                    in_flight: r.is_concurrent(),
                    shadow: r.mode == plugin::Mode::Shadow,
                    graduated: r.graduated.clone(),
                };
                (r.name.clone(), policy)
            })
            .collect();
        let quotas = c
            .quotas
            .iter()
            .map(|q| {
                let policy = QuotaPolicy {
                    key: q.key.clone(),
                    period: q.period,
                    limit: q.limit,
                    tiers: c
                        .tiers
                        .keys()
                        .map(|t| (t.clone(), q.tiers.get(t).copied().or(q.limit)))
                        .collect(),
                    clients: c
                        .identity
                        .clients
                        .iter()
                        .filter_map(|(id, spec)| Some((id.clone(), *spec.quotas.get(&q.name)?)))
                        .collect(),
                    max_amount: match q.count {
                        QuotaCount::Requests => 1,
                        QuotaCount::Cost => max_cost,
                    },
                    settle_max: match q.count {
                        QuotaCount::Requests => None,
                        QuotaCount::Cost => costs_settle,
                    },
                };
                (q.name.clone(), policy)
            })
            .collect();
        let lease = c
            .global
            .as_ref()
            .and_then(|g| g.lease.as_ref())
            .map(|l| LeasePolicy {
                fraction: l.fraction,
                ttl_ms: l.ttl_ms.max(1),
            });
        let soft = c
            .identity
            .clients
            .iter()
            .filter(|(_, spec)| spec.soft)
            .map(|(id, _)| client_key_part(id))
            .collect();
        Ok(Domain {
            rules,
            quotas,
            lease,
            soft,
            retry_jitter: c.response.retry_jitter,
        })
    }

    fn quota(&self, at: At, domain: &str, name: &str) -> Result<&QuotaPolicy, String> {
        self.quotas
            .get(name)
            .ok_or_else(|| format!("{at}: unknown quota `{name}` in domain `{domain}`"))
    }

    fn rule(&self, at: At, domain: &str, name: &str) -> Result<&RulePolicy, String> {
        self.rules.get(name).ok_or_else(|| {
            format!("{at}: unknown rule `{name}`: not a global rule of domain `{domain}`")
        })
    }
}

impl Policy {
    /// The domains, sorted (for the log).
    pub fn domains(&self) -> Vec<&str> {
        let mut d: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        d.sort_unstable();
        d
    }

    /// `Ok` when a plugin configuration of the policy has domain `name`.
    pub fn has_domain(&self, name: &str) -> Result<(), UnknownDomain> {
        if self.domains.contains_key(name) {
            Ok(())
        } else {
            Err(UnknownDomain(name.to_string()))
        }
    }

    fn domain(&self, name: &str) -> Result<&Domain, String> {
        self.domains
            .get(name)
            .ok_or_else(|| UnknownDomain(name.to_string()).to_string())
    }

    /// Resolves a validated check request, or the 400 message.
    pub fn resolve_check(&self, req: &CheckRequest) -> Result<Resolved, String> {
        let d = self.domain(&req.domain)?;
        resolve_items(
            &req.domain,
            d,
            &req.buckets,
            &req.quotas,
            req.reservation.as_deref(),
        )
    }

    /// Resolves every check of a validated batch, or the 400 message of the
    /// first that does not resolve, its field path under `checks[c].`: the
    /// batch is refused whole.
    pub fn resolve_batch(&self, req: &BatchRequest) -> Result<Vec<Resolved>, String> {
        let d = self.domain(&req.domain)?;
        req.checks
            .iter()
            .enumerate()
            .map(|(c, check)| {
                resolve_items(
                    &req.domain,
                    d,
                    &check.buckets,
                    &check.quotas,
                    check.reservation.as_deref(),
                )
                .map_err(|e| format!("checks[{c}].{e}"))
            })
            .collect()
    }
    /// Resolves one settlement of a validated settle request (`at`:
    /// `settlements[2]`), or the 400 message: every bucket's rule and every
    /// quota must settle, and each real cost be within the policy's `max`.
    pub fn resolve_settlement(
        &self,
        domain: &str,
        at: usize,
        s: &Settlement,
    ) -> Result<ResolvedSettlement, String> {
        let d = self.domain(domain)?;
        let mut buckets = Vec::with_capacity(s.buckets.len());
        let mut seen = Seen::with_capacity(s.buckets.len());
        for (b, bucket) in s.buckets.iter().enumerate() {
            let at = At::nested("settlements", at, "buckets", b);
            if !seen.insert(&bucket.rule) {
                return Err(format!("{at}.rule: rule `{}` named twice", bucket.rule));
            }
            let rule = d.rule(at.field("rule"), domain, &bucket.rule)?;
            let Some(max) = rule.settle_max else {
                return Err(format!(
                    "{at}.rule: rule `{}` is not charged from the response: nothing to settle",
                    bucket.rule
                ));
            };
            if bucket.cost > max {
                return Err(format!(
                    "{at}.cost: {} is above {max}, the most rule `{}` settles",
                    bucket.cost, bucket.rule
                ));
            }
            let resolved = resolve_bucket(
                at,
                domain,
                d,
                &BucketRef {
                    cost: 1,
                    ..bucket.clone()
                },
            )?;
            buckets.push(ResolvedBucket {
                cost: bucket.cost,
                ..resolved
            });
        }
        let mut quotas = Vec::with_capacity(s.quotas.len());
        let mut seen = Seen::with_capacity(s.quotas.len());
        for (q, quota) in s.quotas.iter().enumerate() {
            let at = At::nested("settlements", at, "quotas", q);
            if !seen.insert(&quota.quota) {
                return Err(format!("{at}.quota: quota `{}` named twice", quota.quota));
            }
            let policy = d.quota(at.field("quota"), domain, &quota.quota)?;
            let Some(max) = policy.settle_max else {
                return Err(format!(
                    "{at}.quota: quota `{}` does not count a cost read from the response: nothing to settle",
                    quota.quota
                ));
            };
            if quota.amount > max {
                return Err(format!(
                    "{at}.amount: {} is above {max}, the most quota `{}` settles",
                    quota.amount, quota.quota
                ));
            }
            let resolved = resolve_quota(
                at,
                domain,
                d,
                &QuotaRef {
                    amount: 1,
                    ..quota.clone()
                },
            )?;
            quotas.push(ResolvedQuota {
                amount: quota.amount,
                ..resolved
            });
        }
        Ok(Resolved {
            domain: domain.to_string(),
            buckets,
            quotas,
            reservation: Some(s.reservation.clone()),
        })
    }

    /// The bucket of global rule `rule` of `domain` that a wasm filter with
    /// this plugin configuration charges for a request whose key parts are
    /// `values` (one per key part of the rule, in order), with the rule's own
    /// limits: the key the filter writes, with the tag [`tag_of`] derives
    /// from it, so the Redis keys of a `/v1/check` of that bucket.
    /// A `client` part is the client id (the filter's `c=` part). Used by the
    /// rate limit service (`crate::rls`) for `rate_limit.shared`, which
    /// answers a cost above [`SharedBucket::max_cost`] over the limit.
    pub fn shared_bucket(
        &self,
        domain: &str,
        rule: &str,
        values: &[&str],
        cost: u64,
    ) -> Result<SharedBucket, String> {
        let d = self.domain(domain)?;
        let r = d.rule(At::top("shared.rule"), domain, rule)?;
        if r.in_flight {
            // The rate limit service protocol has no end of request to release a slot at.
            return Err(format!(
                "shared.rule: rule `{rule}` is a concurrency rule, which a descriptor cannot hold: \
                 the rate limit service is never told when a request ends"
            ));
        }
        if values.len() != r.key.len() {
            return Err(format!(
                "shared.entries: rule `{rule}` has {} key parts, the descriptor gave {}",
                r.key.len(),
                values.len()
            ));
        }
        let mut key = rule.to_string();
        for (part, value) in r.key.iter().zip(values) {
            encode_part(&mut key, None, part.tag(), value.as_bytes());
        }
        let key = bounded(key, rule);
        Ok(SharedBucket {
            bucket: ResolvedBucket {
                tag: tag_of(rule, &key).to_string(),
                key,
                cost,
                limits: r.limits.clone(),
                debt: r.debt(),
                // The rate limit service answers descriptors by its own rules.
                watch: Watch::Enforce,
                stages: None,
            },
            max_cost: r.max_cost,
        })
    }

    /// Resolves a validated lease request, or the 400 message.
    pub fn resolve_lease(&self, req: &LeaseRequest) -> Result<ResolvedLease, String> {
        let d = self.domain(&req.domain)?;
        let Some(lease) = d.lease else {
            return Err(format!(
                "domain: domain `{}` has no global.lease in the gateway's policy",
                req.domain
            ));
        };
        let rule = d.rule(At::top("rule"), &req.domain, &req.rule)?;
        if rule.in_flight {
            return Err(format!(
                "rule: rule `{}` is a concurrency rule; leases need token_bucket",
                req.rule
            ));
        }
        if rule.algorithm != Algorithm::TokenBucket {
            return Err(format!(
                "rule: rule `{}` is a {}; leases need token_bucket",
                req.rule,
                rule.algorithm.name()
            ));
        }
        // A batch spent in a proxy would skip the stages, the block and the
        // shadow's "never denies": such a rule is checked per request.
        if rule.shadow || rule.graduated.is_some() {
            return Err(format!(
                "rule: rule `{}` is a shadow or graduated rule: it is checked per request, never leased",
                req.rule
            ));
        }
        check_key(At::top("key"), &req.rule, &req.key)?;
        let limits = variant_limits(At::top("variant"), &req.rule, rule, &req.key, &req.variant)?;
        let smallest = limits.iter().map(|l| l.requests).min().unwrap_or(1);
        // As the filter sizes a batch: at least one token, at most the smallest limit.
        let cap = ((smallest as f64 * lease.fraction).floor() as u64).clamp(1, smallest.max(1));
        Ok(ResolvedLease {
            domain: req.domain.clone(),
            key: req.key.clone(),
            tag: tag_of(&req.rule, &req.key).to_string(),
            limits: limits.to_vec(),
            want: req.want.min(cap),
            returned: req.returned,
            ttl_ms: lease.ttl_ms,
        })
    }
}

/// One check's buckets, quotas and reservation resolved in domain `d`
/// (named `domain`), or the 400 message.
fn resolve_items(
    domain: &str,
    d: &Domain,
    bucket_refs: &[BucketRef],
    quota_refs: &[QuotaRef],
    reservation: Option<&str>,
) -> Result<Resolved, String> {
    if bucket_refs.len() > d.rules.len() {
        return Err(format!(
            "buckets: domain `{}` has {} global rules, so at most {} buckets, got {}",
            domain,
            d.rules.len(),
            d.rules.len(),
            bucket_refs.len()
        ));
    }
    if quota_refs.len() > d.quotas.len() {
        return Err(format!(
            "quotas: domain `{}` has {} quotas, got {}",
            domain,
            d.quotas.len(),
            quota_refs.len()
        ));
    }
    let mut seen = Seen::with_capacity(bucket_refs.len());
    let mut buckets = Vec::with_capacity(bucket_refs.len());
    for (b, bucket) in bucket_refs.iter().enumerate() {
        let at = At::item("buckets", b);
        if !seen.insert(&bucket.rule) {
            return Err(format!(
                "{}: rule `{}` named twice in one request",
                at.field("rule"),
                bucket.rule
            ));
        }
        let resolved = resolve_bucket(at, domain, d, bucket)?;
        if reservation.is_none() && resolved.limits.iter().any(|l| l.in_flight) {
            return Err(format!(
                "{}: rule `{}` is a concurrency rule: its check needs a reservation, \
                 under which the slot is released",
                at.field("rule"),
                bucket.rule
            ));
        }
        buckets.push(resolved);
    }
    let mut seen = Seen::with_capacity(quota_refs.len());
    let mut quotas = Vec::with_capacity(quota_refs.len());
    for (q, quota) in quota_refs.iter().enumerate() {
        let at = At::item("quotas", q);
        if !seen.insert(&quota.quota) {
            return Err(format!(
                "{}: quota `{}` named twice in one request",
                at.field("quota"),
                quota.quota
            ));
        }
        quotas.push(resolve_quota(at, domain, d, quota)?);
    }
    Ok(Resolved {
        domain: domain.to_string(),
        buckets,
        quotas,
        reservation: reservation.map(str::to_string),
    })
}

fn resolve_bucket(
    at: At,
    domain: &str,
    d: &Domain,
    bucket: &BucketRef,
) -> Result<ResolvedBucket, String> {
    let rule = d.rule(at.field("rule"), domain, &bucket.rule)?;
    check_key(at.field("key"), &bucket.rule, &bucket.key)?;
    let limits = variant_limits(
        at.field("variant"),
        &bucket.rule,
        rule,
        &bucket.key,
        &bucket.variant,
    )?;
    if bucket.cost > rule.max_cost {
        return Err(format!(
            "{at}.cost: {} is above {}, the largest cost the policy gives rule `{}`",
            bucket.cost, rule.max_cost, bucket.rule
        ));
    }
    let watch = if rule.shadow {
        Watch::Shadow
    } else if client_part(&rule.key, &bucket.rule, &bucket.key).is_some_and(|c| d.soft.contains(c))
    {
        Watch::Soft
    } else {
        Watch::Enforce
    };
    let stages = rule.graduated.as_ref().and_then(|g| {
        let first = limits
            .first()
            .filter(|l| l.algorithm == Algorithm::TokenBucket)?;
        Some(Stages::of(g, first.requests, d.retry_jitter))
    });
    Ok(ResolvedBucket {
        key: bucket.key.clone(),
        tag: tag_of(&bucket.rule, &bucket.key).to_string(),
        cost: bucket.cost,
        limits: limits.to_vec(),
        debt: rule.debt(),
        watch,
        stages,
    })
}

fn resolve_quota(
    at: At,
    domain: &str,
    d: &Domain,
    quota: &QuotaRef,
) -> Result<ResolvedQuota, String> {
    let q = d.quota(at.field("quota"), domain, &quota.quota)?;
    check_key(at.field("key"), &quota.quota, &quota.key)?;
    let limit = match &quota.variant {
        Variant::Default => q.limit,
        Variant::Tier(t) => q.tiers.get(t).copied().flatten(),
        Variant::Client(c) if client_part_is(&q.key, &quota.quota, &quota.key, c) => {
            q.clients.get(c).copied()
        }
        Variant::Client(_) | Variant::Set(_) => None,
    };
    let Some(limit) = limit else {
        return Err(format!("{}: {NO_SUCH_VARIANT}", at.field("variant")));
    };
    if quota.amount > q.max_amount {
        return Err(format!(
            "{at}.amount: {} is above {}, the most quota `{}` counts for one request",
            quota.amount, q.max_amount, quota.quota
        ));
    }
    Ok(ResolvedQuota {
        key: quota.key.clone(),
        tag: tag_of(&quota.quota, &quota.key).to_string(),
        limit,
        period: q.period,
        amount: quota.amount,
    })
}

/// Where a field is in the request (`buckets[1].key`, or `key` of a lease),
/// formatted only into an error message: an accepted request builds no
/// field paths.
#[derive(Debug, Clone, Copy)]
struct At {
    /// The list and item the item's list is in (`settlements[1]`), if any.
    outer: Option<(&'static str, usize)>,
    /// The list and the index of the item, if the field is in one.
    item: Option<(&'static str, usize)>,
    /// The field; empty for the item itself.
    field: &'static str,
}

impl At {
    fn top(field: &'static str) -> At {
        At {
            outer: None,
            item: None,
            field,
        }
    }

    fn item(list: &'static str, index: usize) -> At {
        At {
            outer: None,
            item: Some((list, index)),
            field: "",
        }
    }

    fn field(self, field: &'static str) -> At {
        At { field, ..self }
    }

    /// An item of a list inside an item (`settlements[1].buckets[0]`).
    fn nested(outer: &'static str, o: usize, list: &'static str, index: usize) -> At {
        At {
            outer: Some((outer, o)),
            ..At::item(list, index)
        }
    }
}

impl std::fmt::Display for At {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some((outer, o)) = self.outer {
            write!(f, "{outer}[{o}].")?;
        }
        match (self.item, self.field) {
            (Some((list, i)), "") => write!(f, "{list}[{i}]"),
            (Some((list, i)), field) => write!(f, "{list}[{i}].{field}"),
            (None, field) => f.write_str(field),
        }
    }
}

/// The names a request has used so far: on the stack while few (most
/// requests name one to four), in a hash set past [`Seen::LINEAR`].
// On the stack on purpose: the small form is the common one, and boxing it
// would be the allocation it exists to avoid.
#[allow(clippy::large_enum_variant)]
enum Seen<'a> {
    Few([&'a str; Seen::LINEAR], usize),
    Many(HashSet<&'a str>),
}

impl<'a> Seen<'a> {
    const LINEAR: usize = 16;

    fn with_capacity(n: usize) -> Seen<'a> {
        if n <= Self::LINEAR {
            Seen::Few([""; Self::LINEAR], 0)
        } else {
            Seen::Many(HashSet::with_capacity(n))
        }
    }

    /// False when `name` was seen before.
    fn insert(&mut self, name: &'a str) -> bool {
        match self {
            Seen::Few(names, n) => {
                let seen = names.get(..*n).unwrap_or_default();
                if seen.contains(&name) {
                    return false;
                }
                match names.get_mut(*n) {
                    Some(slot) => {
                        *slot = name;
                        *n += 1;
                        true
                    }
                    // Full (more names than `with_capacity` was told): move to a set.
                    None => {
                        let mut h: HashSet<&'a str> = names.iter().copied().collect();
                        h.insert(name);
                        *self = Seen::Many(h);
                        true
                    }
                }
            }
            Seen::Many(h) => h.insert(name),
        }
    }
}

/// The filter writes a key as `<name>/<parts>` (or `<name>#<hash>` when
/// long): a key of another rule or quota is refused.
fn check_key(at: At, name: &str, key: &str) -> Result<(), String> {
    let ok = key
        .strip_prefix(name)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/') || rest.starts_with('#'));
    if !ok {
        return Err(format!("{at}: must start with `{name}/`"));
    }
    Ok(())
}

/// What a 400 says of every variant refused (a tier, client override or
/// `limits_by` set the rule or quota lacks, or a client override on a key that is not that
/// client's): the same words for all, naming nothing that exists.
pub const NO_SUCH_VARIANT: &str = "not a variant this key may use";

/// The limits of `variant` of rule `name` for `key`, or the 400.
fn variant_limits<'a>(
    at: At,
    name: &str,
    rule: &'a RulePolicy,
    key: &str,
    variant: &Variant,
) -> Result<&'a [Limit], String> {
    let found = match variant {
        Variant::Default => Some(&rule.limits),
        Variant::Tier(t) => rule.tiers.get(t),
        Variant::Client(c) if client_part_is(&rule.key, name, key, c) => rule.clients.get(c),
        Variant::Client(_) => None,
        Variant::Set(n) => rule.sets.get(n),
    };
    found
        .map(Vec::as_slice)
        .ok_or_else(|| format!("{at}: {NO_SUCH_VARIANT}"))
}

/// The cluster hash tag of `key` (which [`check_key`] found to start with
/// `name`): its first part, as the filter makes it (`per-client/c=alice/…`
/// → `c=alice`); nothing for a key without parts; the whole key when the
/// filter hashed it (`<name>#<hash>`), whose first part is not readable.
/// Derived here, so a request cannot move a key to a fresh tag.
pub fn tag_of<'k>(name: &str, key: &'k str) -> &'k str {
    let rest = key.get(name.len()..).unwrap_or_default();
    match rest.strip_prefix('/') {
        Some(parts) => parts.split('/').next().unwrap_or_default(),
        None if rest.is_empty() => "",
        None => key,
    }
}

/// Whether `key` (of rule or quota `name`, keyed on `parts`) is client
/// `id`'s: as many parts as `parts`, and at the `client` part `c=<id>`,
/// encoded as the filter encodes it. A hashed key shows no part: false.
fn client_part_is(parts: &[KeyPart], name: &str, key: &str, id: &str) -> bool {
    client_part(parts, name, key) == Some(client_key_part(id).as_str())
}

/// Client `id` as a key's `client` part, encoded as the filter writes it (`c=<id>`).
fn client_key_part(id: &str) -> String {
    let mut part = String::new();
    encode_part(
        &mut part,
        None,
        KeyPart::<String>::Client.tag(),
        id.as_bytes(),
    );
    part
}

/// The `client` part of `key` (of rule or quota `name`, keyed on `parts`),
/// encoded as the filter writes it (`c=<id>`): `None` when `parts` has no
/// `client`, or the key is hashed or has another number of parts.
fn client_part<'k>(parts: &[KeyPart], name: &str, key: &'k str) -> Option<&'k str> {
    let i = parts.iter().position(|p| *p == KeyPart::Client)?;
    let written = key.get(name.len()..)?.strip_prefix('/')?;
    if written.split('/').count() != parts.len() {
        return None;
    }
    written.split('/').nth(i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratelimit_protocol::{parse_check, parse_lease};
    use serde_json::json;

    const API: &str = r#"{"domain":"api",
        "global":{"cluster":"gw","lease":{"fraction":0.5,"ttl_ms":3000}},
        "costs":[{"match":{"path_prefix":"/big"},"cost":5}],
        "tiers":{"gold":{},"free":{}},
        "identity":{"default_tier":"free","clients":{"vip":{"limits":{"per-client":[{"requests":100,"per":"1m"}]},"quotas":{"monthly":7}}}},
        "rules":[
          {"name":"per-client","scope":"global","key":["client"],"limits":[{"requests":20,"per":"1m"},{"requests":5,"per":"1s"}],
           "tiers":{"gold":[{"requests":40,"per":"1m"}]}},
          {"name":"search","scope":"global","key":["client"],"cost":3,"algorithm":"sliding_window","limits":[{"requests":10,"per":"1m"}]},
          {"name":"local","key":["client"],"limits":[{"requests":5,"per":"1s"}]}],
        "quotas":[
          {"name":"monthly","key":["client"],"period":"month","limit":1000,"tiers":{"gold":5000},"upgrade_url":"https://example.com/up"},
          {"name":"spend","key":["client"],"period":"day","count":"cost","tiers":{"gold":50},"upgrade_url":"https://example.com/up"}]}"#;

    fn policy() -> Policy {
        parse(&[Source {
            path: "api.json".into(),
            bytes: API.as_bytes().to_vec(),
        }])
        .unwrap()
    }

    fn check(v: serde_json::Value) -> Result<Resolved, String> {
        policy().resolve_check(&parse_check(&serde_json::to_vec(&v).unwrap())?)
    }

    /// alice's bucket of `rule`, or vip's for a `client:` variant.
    fn bucket(rule: &str, variant: &str, cost: u64) -> serde_json::Value {
        let who = if variant.starts_with("client:") {
            "vip"
        } else {
            "alice"
        };
        json!({"rule": rule, "key": format!("{rule}/c={who}"), "tag": "c=alice", "variant": variant, "cost": cost})
    }

    /// As [`bucket`], for a quota.
    fn quota(name: &str, variant: &str, amount: u64) -> serde_json::Value {
        let who = if variant.starts_with("client:") {
            "vip"
        } else {
            "alice"
        };
        json!({"quota": name, "key": format!("{name}/c={who}"), "tag": "c=alice", "variant": variant, "amount": amount})
    }

    /// The stages in whole tokens, as the filter's own graduated rules reach
    /// them: warn at 8 of 10 (80%), delay past 100% (the 11th), reject past
    /// 120% (a bucket of 12), block when the demand reaches 200% (20).
    #[test]
    fn stages_are_the_filters_shares_in_whole_tokens() {
        let g: plugin::Graduated = serde_json::from_value(serde_json::json!({
            "warn_at": 0.8, "delay_at": 1.0, "delay_ms": 100, "reject_at": 1.2,
            "block_at": 2.0, "block_for": "5m"}))
        .unwrap();
        let s = Stages::of(&g, 10, 0.1);
        assert_eq!(
            s,
            Stages {
                burst: 12,
                warn_from: Some(8),
                delay_from: Some(11),
                delay_ms: 100,
                demand: 20,
                block_for_ms: 300_000,
                jitter_ms: 30_000,
            }
        );
        // A share that is not a whole number of tokens: 85% of 10 warns from
        // the 9th, a delay past 33% of 3 from the 1st (a third is past it); no
        // block without both block fields.
        let g: plugin::Graduated = serde_json::from_value(serde_json::json!({
            "warn_at": 0.85, "delay_at": 0.33, "delay_ms": 5}))
        .unwrap();
        assert_eq!(Stages::of(&g, 10, 0.0).warn_from, Some(9));
        assert_eq!(Stages::of(&g, 3, 0.0).delay_from, Some(1));
        assert_eq!(Stages::of(&g, 3, 0.0).demand, 0);
    }

    #[test]
    fn limits_and_amounts_come_from_the_policy() {
        let r = check(json!({"version": 2, "domain": "api",
            "buckets": [bucket("per-client", "default", 5), bucket("search", "default", 3)],
            "quotas": [quota("monthly", "tier:gold", 1), quota("spend", "tier:gold", 5)]}))
        .unwrap();
        let tb = |requests, window_ms| Limit {
            requests,
            window_ms,
            algorithm: Algorithm::TokenBucket,
            in_flight: false,
        };
        assert_eq!(r.buckets[0].limits, [tb(20, 60_000), tb(5, 1000)]);
        assert_eq!(
            r.buckets[1].limits,
            [Limit {
                requests: 10,
                window_ms: 60_000,
                algorithm: Algorithm::SlidingWindow,
                in_flight: false,
            }]
        );
        assert_eq!(
            (r.quotas[0].limit, r.quotas[0].period),
            (5000, Period::Month)
        );
        assert_eq!((r.quotas[1].limit, r.quotas[1].amount), (50, 5));
        let r = check(json!({"version": 2, "domain": "api",
            "buckets": [bucket("per-client", "tier:gold", 1)],
            "quotas": [quota("monthly", "client:vip", 1), quota("spend", "tier:free", 1)]}));
        // `free` is declared but `spend` has neither `tiers.free` nor `limit`.
        assert_eq!(
            r.unwrap_err(),
            "quotas[1].variant: not a variant this key may use"
        );
        let r = check(json!({"version": 2, "domain": "api",
            "buckets": [bucket("per-client", "client:vip", 1)],
            "quotas": [quota("monthly", "client:vip", 1)]}))
        .unwrap();
        assert_eq!(r.buckets[0].limits, [tb(100, 60_000)]);
        assert_eq!(r.quotas[0].limit, 7);
        // The tags are the keys' first parts, whatever the request said.
        assert_eq!(
            (r.buckets[0].tag.as_str(), r.quotas[0].tag.as_str()),
            ("c=vip", "c=vip")
        );
    }

    #[test]
    fn tags_are_the_keys_first_parts_and_overrides_need_the_clients_key() {
        assert_eq!(tag_of("r", "r/c=alice/p=%2F"), "c=alice");
        assert_eq!(tag_of("r", "r/c#00ff"), "c#00ff");
        assert_eq!(tag_of("r", "r"), "");
        assert_eq!(tag_of("r", "r#0123"), "r#0123");
        let client = [KeyPart::Client];
        let two = [KeyPart::Ip, KeyPart::Client];
        assert!(client_part_is(&client, "r", "r/c=vip", "vip"));
        assert!(client_part_is(&two, "r", "r/i=1.2.3.4/c=a%20b", "a b"));
        let long = "x".repeat(200);
        let mut hashed = String::from("r");
        encode_part(&mut hashed, None, b'c', long.as_bytes());
        assert!(client_part_is(&client, "r", &hashed, &long));
        for (parts, key) in [
            (&client[..], "r/c=alice"),
            (&client[..], "r/i=vip"),
            (&client[..], "r/c=vip/x"),
            (&client[..], "r#0123"),
            (&client[..], "r"),
            (&two[..], "r/c=vip/i=1"),
            (&[KeyPart::Ip][..], "r/c=vip"),
        ] {
            assert!(!client_part_is(parts, "r", key, "vip"), "{key}");
        }
    }

    /// The stack form and the hash set agree with a plain set, across the
    /// switch from one to the other.
    #[test]
    fn seen_finds_every_repeat_on_the_stack_and_in_the_set() {
        let names: Vec<String> = (0..40).map(|i| format!("r{}", i % 23)).collect();
        for capacity in [0, 1, 4, Seen::LINEAR, Seen::LINEAR + 1, 40] {
            let mut seen = Seen::with_capacity(capacity);
            let mut plain = HashSet::new();
            for n in &names {
                assert_eq!(
                    seen.insert(n),
                    plain.insert(n.as_str()),
                    "{n}, capacity {capacity}"
                );
            }
        }
        assert_eq!(
            At::item("quotas", 3).field("key").to_string(),
            "quotas[3].key"
        );
        assert_eq!(At::item("buckets", 0).to_string(), "buckets[0]");
        assert_eq!(At::top("variant").to_string(), "variant");
    }

    #[test]
    fn what_the_policy_does_not_have_is_refused_by_field() {
        let cases = [
            (
                json!({"version": 2, "domain": "other", "buckets": [bucket("per-client", "default", 1)]}),
                "domain: unknown domain `other`: not in the gateway's policy",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [bucket("nope", "default", 1)]}),
                "buckets[0].rule: unknown rule `nope`: not a global rule of domain `api`",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [bucket("local", "default", 1)]}),
                "buckets[0].rule: unknown rule `local`: not a global rule of domain `api`",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [bucket("per-client", "tier:free", 1)]}),
                "buckets[0].variant: not a variant this key may use",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [bucket("per-client", "client:bob", 1)]}),
                "buckets[0].variant: not a variant this key may use",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [bucket("per-client", "default", 6)]}),
                "buckets[0].cost: 6 is above 5, the largest cost the policy gives rule `per-client`",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [bucket("search", "default", 4)]}),
                "buckets[0].cost: 4 is above 3, the largest cost the policy gives rule `search`",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [bucket("per-client", "default", 1), bucket("per-client", "default", 1)]}),
                "buckets[1].rule: rule `per-client` named twice in one request",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [bucket("search", "default", 1), bucket("per-client", "default", 1), bucket("per-client", "default", 1)]}),
                "buckets: domain `api` has 2 global rules, so at most 2 buckets, got 3",
            ),
            (
                json!({"version": 2, "domain": "api", "buckets": [{"rule": "search", "key": "per-client/c=alice", "tag": "", "variant": "default", "cost": 1}]}),
                "buckets[0].key: must start with `search/`",
            ),
            (
                json!({"version": 2, "domain": "api", "quotas": [quota("nope", "default", 1)]}),
                "quotas[0].quota: unknown quota `nope` in domain `api`",
            ),
            (
                json!({"version": 2, "domain": "api", "quotas": [quota("monthly", "default", 2)]}),
                "quotas[0].amount: 2 is above 1, the most quota `monthly` counts for one request",
            ),
            (
                json!({"version": 2, "domain": "api", "quotas": [quota("spend", "tier:gold", 6)]}),
                "quotas[0].amount: 6 is above 5, the most quota `spend` counts for one request",
            ),
            (
                json!({"version": 2, "domain": "api", "quotas": [quota("monthly", "tier:silver", 1)]}),
                "quotas[0].variant: not a variant this key may use",
            ),
            (
                json!({"version": 2, "domain": "api", "quotas": [quota("monthly", "client:bob", 1)]}),
                "quotas[0].variant: not a variant this key may use",
            ),
        ];
        for (body, want) in cases {
            assert_eq!(check(body).unwrap_err(), want);
        }
        // The domain alone, as the HTTP side asks it first (404); no policy has none.
        assert_eq!(policy().has_domain("api"), Ok(()));
        assert_eq!(
            Policy::default().has_domain("api").unwrap_err().to_string(),
            "domain: unknown domain `api`: not in the gateway's policy"
        );
    }

    #[test]
    fn leases_are_bounded_by_the_policy() {
        let lease = |v: serde_json::Value| {
            policy().resolve_lease(&parse_lease(&serde_json::to_vec(&v).unwrap()).unwrap())
        };
        let base = json!({"version": 2, "domain": "api", "rule": "per-client", "key": "per-client/c=alice",
            "tag": "c=alice", "variant": "default", "want": 20, "return": 1000000});
        let r = lease(base.clone()).unwrap();
        // Half of the smallest limit (5 per second): 2 tokens at most.
        assert_eq!((r.want, r.returned, r.ttl_ms), (2, 1_000_000, 3000));
        let mut v = base.clone();
        v["rule"] = "search".into();
        v["key"] = "search/c=alice".into();
        assert_eq!(
            lease(v).unwrap_err(),
            "rule: rule `search` is a sliding_window; leases need token_bucket"
        );
        let other = parse(&[Source {
            path: "a.json".into(),
            bytes: br#"{"domain":"nolease","global":{"cluster":"gw"},"rules":[{"name":"r","scope":"global","limits":[{"requests":1,"per":"1s"}]}]}"#.to_vec(),
        }])
        .unwrap();
        let mut v = base;
        v["domain"] = "nolease".into();
        v["rule"] = "r".into();
        v["key"] = "r".into();
        let req = parse_lease(&serde_json::to_vec(&v).unwrap()).unwrap();
        assert_eq!(
            other.resolve_lease(&req).unwrap_err(),
            "domain: domain `nolease` has no global.lease in the gateway's policy"
        );
    }

    #[test]
    fn files_are_validated_by_the_filter_and_a_domain_is_defined_once() {
        let src = |path: &str, bytes: &str| Source {
            path: path.into(),
            bytes: bytes.as_bytes().to_vec(),
        };
        let e = parse(&[src(
            "bad.json",
            r#"{"domain":"d","rules":[{"name":"r","limits":[{"requests":0,"per":"1s"}]}]}"#,
        )])
        .unwrap_err();
        assert!(
            e.starts_with("bad.json: rules[0].limits[0].requests: "),
            "{e}"
        );
        let e = parse(&[src("a.json", API), src("b.json", API)]).unwrap_err();
        assert_eq!(e, "b.json: domain: `api` is already defined by a.json");
    }
}
