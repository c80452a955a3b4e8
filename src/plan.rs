//! The configuration compiled for the request path: matchers, key parts and
//! limits resolved once, so a request does no parsing and reads only the
//! headers it needs.

use crate::algorithm::Algorithm;
use crate::config::{Circuit, Config, FailureMode, HeaderStyle, OnError, Scope};
use crate::key::{self, BadInput, IpSource, KeyPart};
use crate::matcher::Matcher;
use crate::request::{HeaderId, RequestInfo};
use crate::table::WAYS;
use crate::token_bucket::Limit;
use siphasher::sip128::{Hasher128, SipHasher13};
use std::hash::Hasher;

/// Prefix of every shared-data key the filter writes (Istio shares one namespace between plugins).
pub const KEY_PREFIX: &str = "ratelimit-wasm/";

/// A compiled rule.
#[derive(Debug, Clone)]
pub struct RulePlan {
    /// The rule's name.
    pub name: String,
    /// `requests` per `per` for each limit, and `per` in seconds for headers.
    pub limits: Vec<(Limit, u64)>,
    /// How the limits count.
    pub algorithm: Algorithm,
    /// Local, or decided by the gateway.
    pub scope: Scope,
    /// For a global rule: the index of its local stand-in (limits divided by
    /// `instances`), used when the gateway fails in `failure_mode: local`.
    pub fallback: Option<usize>,
    /// True for the local stand-in of a global rule.
    pub stand_in: bool,
    matcher: Option<Matcher>,
    key: Vec<KeyPart>,
    /// Hash state after domain, rule name and limits: changing a limit starts fresh buckets.
    hasher: SipHasher13,
}

/// One bucket a request must pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// Index into [`Plan::rules`].
    pub rule: usize,
    /// Identity of the bucket inside its set.
    pub fingerprint: u64,
    /// Which set (shared-data key) holds it.
    pub set: u64,
}

/// One bucket the gateway decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalBucket {
    /// Index into [`Plan::rules`].
    pub rule: usize,
    /// Readable key, the same on every proxy: `<rule>/<tag>=<value>/…`.
    pub key: String,
    /// Redis Cluster hash tag: the first key part.
    pub tag: String,
}

/// What the plan makes of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evaluation {
    /// Tokens the request spends in every bucket.
    pub cost: u64,
    /// The buckets of every matching local rule.
    pub buckets: Vec<Bucket>,
    /// The buckets of every matching global rule.
    pub global: Vec<GlobalBucket>,
    /// The local stand-ins of `global`, for `failure_mode: local`.
    pub fallback: Vec<Bucket>,
    /// Anything odd about the request's identity.
    pub bad_input: Vec<BadInput>,
}

/// The compiled configuration.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Headers to fetch per request, lower-case, `:method` and `:path` first.
    pub header_names: Vec<String>,
    /// Whether any rule needs the peer address.
    pub needs_source_address: bool,
    /// The compiled rules.
    pub rules: Vec<RulePlan>,
    /// Header families on responses.
    pub header_style: HeaderStyle,
    /// `type` of problem bodies.
    pub problem_type: String,
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
    client_header: HeaderId,
    ip_source: IpSource,
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
}

impl Plan {
    /// Compiles a validated configuration. `seed` keys the bucket hash so that
    /// clients cannot aim their keys at another client's bucket.
    pub fn compile(config: &Config, seed: [u8; 16]) -> Plan {
        let mut names: Vec<String> = vec![":method".into(), ":path".into()];
        let mut header_id = |name: &str| -> HeaderId {
            let name = name.to_ascii_lowercase();
            match names.iter().position(|n| *n == name) {
                Some(i) => i,
                None => {
                    names.push(name);
                    names.len() - 1
                }
            }
        };
        let client_header = header_id(&config.identity.client_id_header);
        let ip_source = IpSource {
            xff: header_id("x-forwarded-for"),
            hops: config.identity.trusted_proxy_hops,
        };
        let (k0, k1) = split_seed(seed);
        let mut needs_source_address = false;
        let mut rules = Vec::with_capacity(config.rules.len());
        let mut fallbacks = Vec::new();
        for rule in &config.rules {
            let key: Vec<KeyPart> = rule
                .key
                .iter()
                .map(|p| match p.as_str() {
                    "client" => KeyPart::Client,
                    "ip" => KeyPart::Ip,
                    "method" => KeyPart::Method,
                    "path" => KeyPart::Path,
                    other => {
                        KeyPart::Header(header_id(other.strip_prefix("header:").unwrap_or(other)))
                    }
                })
                .collect();
            needs_source_address |= key
                .iter()
                .any(|k| matches!(k, KeyPart::Client | KeyPart::Ip));
            let divisor = match (&config.global, rule.scope) {
                (Some(g), Scope::Global) => Some(g.instances.max(1)),
                _ => None,
            };
            let make = |divide_by: u64, scope: Scope| {
                let limits: Vec<(Limit, u64)> = rule
                    .limits
                    .iter()
                    .map(|l| {
                        let limit = Limit {
                            capacity: (l.requests / divide_by).max(1),
                            period_ns: l.per.0 * 1_000_000_000,
                        };
                        (limit, l.per.0)
                    })
                    .collect();
                let mut hasher = SipHasher13::new_with_keys(k0, k1);
                for part in [
                    config.domain.as_bytes(),
                    rule.name.as_bytes(),
                    rule.algorithm.name().as_bytes(),
                ] {
                    hasher.write(&(part.len() as u64).to_le_bytes());
                    hasher.write(part);
                }
                for (l, _) in &limits {
                    hasher.write(&l.capacity.to_le_bytes());
                    hasher.write(&l.period_ns.to_le_bytes());
                }
                RulePlan {
                    name: rule.name.clone(),
                    limits,
                    algorithm: rule.algorithm,
                    scope,
                    fallback: None,
                    stand_in: scope != rule.scope,
                    matcher: None,
                    key: key.clone(),
                    hasher,
                }
            };
            let mut plan = make(1, rule.scope);
            plan.matcher = rule
                .matches
                .as_ref()
                .map(|m| Matcher::compile(m, &mut header_id));
            if let Some(n) = divisor {
                fallbacks.push((rules.len(), make(n, Scope::Local)));
            }
            rules.push(plan);
        }
        for (global_index, fallback) in fallbacks {
            let index = rules.len();
            rules.push(fallback);
            if let Some(r) = rules.get_mut(global_index) {
                r.fallback = Some(index);
            }
        }
        let costs = config
            .costs
            .iter()
            .map(|c| (Matcher::compile(&c.matches, &mut header_id), c.cost))
            .collect();
        let sets = (config.max_buckets / WAYS as u64).max(1);
        Plan {
            header_names: names,
            needs_source_address,
            rules,
            header_style: config.response.headers,
            problem_type: config.response.problem_type.clone(),
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
            }),
            domain: config.domain.clone(),
            costs,
            client_header,
            ip_source,
        }
    }

    /// The shared-data key of set `index`.
    pub fn set_key(&self, index: u64) -> String {
        format!("{}{index}", self.set_key_prefix)
    }

    /// Finds the cost and the buckets of every rule that applies to `req`.
    pub fn evaluate(&self, req: &RequestInfo) -> Evaluation {
        let cost = self
            .costs
            .iter()
            .find(|(m, _)| m.matches(req))
            .map_or(1, |(_, c)| *c);
        let mut eval = Evaluation {
            cost,
            ..Evaluation::default()
        };
        for (i, rule) in self.rules.iter().enumerate() {
            // Stand-ins are reached through their global rule only.
            if rule.stand_in || !rule.matcher.as_ref().is_none_or(|m| m.matches(req)) {
                continue;
            }
            let mut h = rule.hasher;
            let mut fb = rule
                .fallback
                .and_then(|f| self.rules.get(f).map(|r| (f, r.hasher)));
            let mut global =
                (rule.scope == Scope::Global).then(|| (rule.name.clone(), String::new()));
            let applies = key::write_key(
                &rule.key,
                req,
                self.client_header,
                self.ip_source,
                &mut eval.bad_input,
                &mut |tag, value| {
                    hash_part(&mut h, tag, value);
                    if let Some((_, fh)) = fb.as_mut() {
                        hash_part(fh, tag, value);
                    }
                    if let Some((k, t)) = global.as_mut() {
                        key::encode_part(k, t.is_empty().then_some(t), tag, value);
                    }
                },
            );
            if !applies {
                continue;
            }
            match global {
                Some((key, tag)) => {
                    eval.global.push(GlobalBucket { rule: i, key, tag });
                    if let Some((f, fh)) = fb {
                        eval.fallback.push(self.bucket(f, fh));
                    }
                }
                None => eval.buckets.push(self.bucket(i, h)),
            }
        }
        eval
    }
}

fn hash_part(h: &mut SipHasher13, tag: u8, value: &[u8]) {
    h.write(&[tag]);
    h.write(&(value.len() as u64).to_le_bytes());
    h.write(value);
}

impl Plan {
    fn bucket(&self, rule: usize, hasher: SipHasher13) -> Bucket {
        let hash = hasher.finish128();
        Bucket {
            rule,
            fingerprint: hash.h1,
            set: hash.h2 % self.sets,
        }
    }
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

    pub(crate) fn plan(json: &str) -> Plan {
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
        assert!(p.needs_source_address);
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
        assert_eq!(get.buckets.iter().map(|b| b.rule).collect::<Vec<_>>(), [0]);
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
}
