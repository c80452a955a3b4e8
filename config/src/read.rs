//! The configuration read from a `serde_json::Value` by hand, with the path
//! of every field kept as it goes, so that an error names it
//! (`rules[2].limits[0].per: "10x" is not a duration`).
//!
//! Why not `#[derive(Deserialize)]` with `serde_path_to_error`: that pair
//! compiled to about 230 KB of the module's 630 KB code section (each struct's
//! visitor instantiated twice, once wrapped for the path), and V8 holds about
//! 37 bytes of Envoy's memory per byte of code it compiles (BENCHMARKS.md,
//! "Where the memory goes"). Here each struct is one small function over
//! shared, non-generic helpers. The messages are serde's own (built with
//! `serde::de::Error` on `serde_json::Error`): unknown fields and variants,
//! missing fields, wrong types, read in the object's key order as serde read
//! them. The derives stay on the schema as the oracle of a differential test
//! (`config::read::tests::the_reader_agrees_with_serde`).

use super::duration::{self, Seconds};
use super::vocab::{Algorithm, Period};
use super::*;
use serde::de::{Error as _, Unexpected};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

type Result<T> = std::result::Result<T, ConfigError>;

/// Where the reader is: `rules[1].limits[0]`, as `serde_path_to_error` prints it.
pub(super) struct Path(String);

impl Path {
    /// The root: a field of it prints without a leading dot.
    pub(super) fn root() -> Path {
        Path(String::new())
    }

    /// Reads `f` one field (or map key) deeper; the path is restored after.
    fn key<T>(&mut self, key: &str, f: impl FnOnce(&mut Path) -> Result<T>) -> Result<T> {
        let len = self.0.len();
        if len > 0 {
            self.0.push('.');
        }
        self.0.push_str(key);
        let out = f(self);
        self.0.truncate(len);
        out
    }

    /// An error at this path; the root prints as `.`, as serde_path_to_error does.
    fn error(&self, e: serde_json::Error) -> ConfigError {
        let path = if self.0.is_empty() { "." } else { &self.0 };
        ConfigError::field(path, e.to_string())
    }

    /// `invalid type: <what v is>, expected <what>`.
    fn invalid_type(&self, v: &Value, what: &str) -> ConfigError {
        self.error(serde_json::Error::invalid_type(unexpected(v), &what))
    }
}

/// What serde calls `v` in an error message.
fn unexpected(v: &Value) -> Unexpected<'_> {
    match v {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Unexpected::Unsigned(u),
            (None, Some(i)) => Unexpected::Signed(i),
            _ => Unexpected::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

/// The fields of one object, read in the object's order; `fields` are the
/// names the struct knows (an unknown one is refused, naming them).
struct Fields<'v> {
    map: &'v Map<String, Value>,
    fields: &'static [&'static str],
}

impl<'v> Fields<'v> {
    fn new(v: &'v Value, p: &Path, name: &str, fields: &'static [&'static str]) -> Result<Self> {
        match v {
            Value::Object(map) => Ok(Fields { map, fields }),
            _ => Err(p.invalid_type(v, name)),
        }
    }

    /// Calls `f` with each field's index in `fields` and its value, one path
    /// segment deeper; stops at the first error, as serde does.
    #[inline(never)]
    fn each(
        &self,
        p: &mut Path,
        mut f: impl FnMut(usize, &Value, &mut Path) -> Result<()>,
    ) -> Result<()> {
        for (k, v) in self.map {
            p.key(k, |p| match self.fields.iter().position(|f| f == k) {
                Some(i) => f(i, v, p),
                None => Err(p.error(serde_json::Error::unknown_field(k, self.fields))),
            })?;
        }
        Ok(())
    }
}

/// Reads the fields of one object with [`Fields::each`]: each field's name
/// is written next to its handler, and the list of names (for serde's
/// unknown-field error) is made from the same lines, so no name can be
/// paired with another field's handler.
macro_rules! fields {
    ($v:ident, $p:ident, $struct:literal, { $($name:literal => $body:expr),+ $(,)? }) => {{
        const FIELDS: &[&str] = &[$($name),+];
        Fields::new($v, $p, $struct, FIELDS)?.each($p, |i, $v, $p| {
            // The n-th handler runs for FIELDS[n]: `at` counts the arms as written.
            let mut at = 0usize;
            $(
                if i == at {
                    $body;
                    return Ok(());
                }
                at += 1;
            )+
            let _ = at;
            Ok(())
        })
    }};
}

/// A required field that was not given.
#[inline(never)]
fn required<T>(v: Option<T>, p: &Path, field: &'static str) -> Result<T> {
    v.ok_or_else(|| p.error(serde_json::Error::missing_field(field)))
}

#[inline(never)]
fn string(v: &Value, p: &Path) -> Result<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        _ => Err(p.invalid_type(v, "a string")),
    }
}

#[inline(never)]
fn boolean(v: &Value, p: &Path) -> Result<bool> {
    v.as_bool().ok_or_else(|| p.invalid_type(v, "a boolean"))
}

#[inline(never)]
fn float(v: &Value, p: &Path) -> Result<f64> {
    match v {
        Value::Number(n) => Ok(n.as_f64().unwrap_or(f64::NAN)),
        _ => Err(p.invalid_type(v, "f64")),
    }
}

/// An unsigned integer up to `max`, named `what` (`u64`, `u32`) in errors.
#[inline(never)]
fn unsigned(v: &Value, p: &Path, max: u64, what: &str) -> Result<u64> {
    let bad = |u| p.error(serde_json::Error::invalid_value(u, &what));
    match v {
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) if u <= max => Ok(u),
            (Some(u), _) => Err(bad(Unexpected::Unsigned(u))),
            (None, Some(i)) => Err(bad(Unexpected::Signed(i))),
            _ => Err(p.invalid_type(v, what)),
        },
        _ => Err(p.invalid_type(v, what)),
    }
}

fn u64_(v: &Value, p: &mut Path) -> Result<u64> {
    unsigned(v, p, u64::MAX, "u64")
}

fn u32_(v: &Value, p: &Path) -> Result<u32> {
    unsigned(v, p, u32::MAX.into(), "u32").map(|u| u as u32)
}

fn string_(v: &Value, p: &mut Path) -> Result<String> {
    string(v, p)
}

/// `null` is `None`, as for serde's `Option`.
fn opt<T>(
    v: &Value,
    p: &mut Path,
    f: impl FnOnce(&Value, &mut Path) -> Result<T>,
) -> Result<Option<T>> {
    match v {
        Value::Null => Ok(None),
        _ => f(v, p).map(Some),
    }
}

#[inline(never)]
fn list<T>(
    v: &Value,
    p: &mut Path,
    mut f: impl FnMut(&Value, &mut Path) -> Result<T>,
) -> Result<Vec<T>> {
    let Value::Array(items) = v else {
        return Err(p.invalid_type(v, "a sequence"));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let len = p.0.len();
        p.0.push_str(&format!("[{i}]"));
        let r = f(item, p);
        p.0.truncate(len);
        out.push(r?);
    }
    Ok(out)
}

#[inline(never)]
fn map<T>(
    v: &Value,
    p: &mut Path,
    mut f: impl FnMut(&Value, &mut Path) -> Result<T>,
) -> Result<BTreeMap<String, T>> {
    let Value::Object(entries) = v else {
        return Err(p.invalid_type(v, "a map"));
    };
    let mut out = BTreeMap::new();
    for (k, v) in entries {
        out.insert(k.clone(), p.key(k, |p| f(v, p))?);
    }
    Ok(out)
}

fn strings(v: &Value, p: &mut Path) -> Result<Vec<String>> {
    list(v, p, string_)
}

/// A rule's or quota's `key`: each part read into a [`KeyPart`] here, once.
#[inline(never)]
fn key_parts(v: &Value, p: &mut Path) -> Result<Vec<KeyPart>> {
    list(v, p, |v, p| {
        let s = string(v, p)?;
        KeyPart::parse(&s).map_err(|why| p.error(serde_json::Error::custom(why)))
    })
}

/// A unit variant of `variants`, as serde reads an enum from JSON: its name
/// as a string, or a map of that one name to `null`. Returns its index.
#[inline(never)]
fn variant(v: &Value, p: &Path, variants: &'static [&'static str]) -> Result<usize> {
    let (name, value) = match v {
        Value::String(s) => (s, None),
        Value::Object(m) if m.len() == 1 => match m.iter().next() {
            Some((k, value)) => (k, Some(value)),
            None => return Err(p.invalid_type(v, "string or map")),
        },
        Value::Object(_) => {
            let e = serde_json::Error::invalid_value(Unexpected::Map, &"map with a single key");
            return Err(p.error(e));
        }
        _ => return Err(p.invalid_type(v, "string or map")),
    };
    let i = variants
        .iter()
        .position(|n| n == name)
        .ok_or_else(|| p.error(serde_json::Error::unknown_variant(name, variants)))?;
    match value {
        // serde_path_to_error names the variant in the path of its content.
        Some(value) if !value.is_null() => {
            let mut at = Path(p.0.clone());
            at.key(name, |p| Err(p.invalid_type(value, "unit")))
        }
        _ => Ok(i),
    }
}

/// Picks the variant of `all` whose index [`variant`] read.
fn pick<T: Copy>(v: &Value, p: &Path, names: &'static [&'static str], all: &[T]) -> Result<T> {
    let i = variant(v, p, names)?;
    all.get(i)
        .copied()
        .ok_or_else(|| p.invalid_type(v, "a variant"))
}

#[inline(never)]
fn seconds(v: &Value, p: &mut Path) -> Result<Seconds> {
    let custom = |m: String| p.error(serde_json::Error::custom(m));
    match v {
        Value::String(s) => match duration::parse(s) {
            Some(secs) => duration::check_range(secs).map_err(custom),
            None => Err(custom(format!("{s:?} is not a duration"))),
        },
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => duration::check_range(u).map_err(custom),
            (None, Some(i)) => Err(custom(format!("{i} is not a duration"))),
            _ => {
                let f = n.as_f64().unwrap_or(f64::NAN);
                Err(custom(format!("{f} is not a whole number of seconds")))
            }
        },
        _ => Err(p.invalid_type(v, duration::EXPECTING)),
    }
}

/// Reads a whole configuration (not yet validated).
#[inline(never)]
pub(super) fn config(v: &Value, p: &mut Path) -> Result<Config> {
    let (mut domain, mut rules) = (None, None);
    let mut c = Config {
        domain: String::new(),
        identity: Identity::default(),
        rules: Vec::new(),
        costs: Vec::new(),
        response: Response::default(),
        metrics: Metrics::default(),
        access_log: AccessLog::default(),
        max_buckets: DEFAULT_BUCKETS,
        on_error: OnError::default(),
        global: None,
        tiers: BTreeMap::new(),
        quotas: Vec::new(),
    };
    fields!(v, p, "struct Config", {
        "domain" => domain = Some(string(v, p)?),
        "identity" => c.identity = identity(v, p)?,
        "rules" => rules = Some(list(v, p, rule)?),
        "costs" => c.costs = list(v, p, cost)?,
        "response" => c.response = response(v, p)?,
        "metrics" => c.metrics = metrics(v, p)?,
        "access_log" => c.access_log = access_log(v, p)?,
        "max_buckets" => c.max_buckets = u64_(v, p)?,
        "on_error" => c.on_error = pick(v, p, &["allow", "deny"], &[OnError::Allow, OnError::Deny])?,
        "global" => c.global = opt(v, p, global)?,
        "tiers" => c.tiers = map(v, p, tier)?,
        "quotas" => c.quotas = list(v, p, quota)?,
    })?;
    c.domain = required(domain, p, "domain")?;
    c.rules = required(rules, p, "rules")?;
    Ok(c)
}

#[inline(never)]
fn global(v: &Value, p: &mut Path) -> Result<Global> {
    let mut cluster = None;
    let mut g = Global {
        cluster: String::new(),
        authority: default_authority(),
        transport: Transport::default(),
        path: default_check_path(),
        settle_path: default_settle_path(),
        timeout_ms: default_timeout_ms(),
        coalesce_us: default_coalesce_us(),
        max_batch: default_max_batch(),
        batch_path: default_batch_path(),
        failure_mode: FailureMode::default(),
        instances: default_instances(),
        circuit: Circuit::default(),
        lease: None,
        deny_cache: default_deny_cache(),
        token: None,
        token_env: None,
    };
    fields!(v, p, "struct Global", {
        "cluster" => cluster = Some(string(v, p)?),
        "authority" => g.authority = string(v, p)?,
        "transport" => g.transport = pick(v, p, &["http", "grpc"], &[Transport::Http, Transport::Grpc])?,
        "path" => g.path = string(v, p)?,
        "settle_path" => g.settle_path = string(v, p)?,
        "timeout_ms" => g.timeout_ms = u64_(v, p)?,
        "coalesce_us" => g.coalesce_us = u64_(v, p)?,
        "max_batch" => g.max_batch = u64_(v, p)?,
        "batch_path" => g.batch_path = string(v, p)?,
        "failure_mode" => {
                let all = [FailureMode::Open, FailureMode::Closed, FailureMode::Local];
                g.failure_mode = pick(v, p, &["open", "closed", "local"], &all)?
            },
        "instances" => g.instances = u64_(v, p)?,
        "circuit" => g.circuit = circuit(v, p)?,
        "lease" => g.lease = opt(v, p, lease)?,
        "deny_cache" => g.deny_cache = u64_(v, p)?,
        "token" => g.token = opt(v, p, string_)?.map(Token),
        "token_env" => g.token_env = opt(v, p, string_)?,
    })?;
    g.cluster = required(cluster, p, "cluster")?;
    Ok(g)
}

#[inline(never)]
fn lease(v: &Value, p: &mut Path) -> Result<Lease> {
    let mut fraction = None;
    let mut l = Lease {
        fraction: 0.0,
        max_wait_ms: default_lease_wait_ms(),
        ttl_ms: default_lease_ttl_ms(),
        path: default_lease_path(),
        max_leases: default_max_leases(),
    };
    fields!(v, p, "struct Lease", {
        "fraction" => fraction = Some(float(v, p)?),
        "max_wait_ms" => l.max_wait_ms = u64_(v, p)?,
        "ttl_ms" => l.ttl_ms = u64_(v, p)?,
        "path" => l.path = string(v, p)?,
        "max_leases" => l.max_leases = u64_(v, p)?,
    })?;
    l.fraction = required(fraction, p, "fraction")?;
    Ok(l)
}

#[inline(never)]
fn circuit(v: &Value, p: &mut Path) -> Result<Circuit> {
    let mut c = Circuit::default();
    fields!(v, p, "struct Circuit", {
        "failures" => c.failures = u32_(v, p)?,
        "latency_ms" => c.latency_ms = u64_(v, p)?,
        "cooldown_ms" => c.cooldown_ms = u64_(v, p)?,
    })?;
    Ok(c)
}

#[inline(never)]
fn identity(v: &Value, p: &mut Path) -> Result<Identity> {
    let mut id = Identity::default();
    fields!(v, p, "struct Identity", {
        "client_id_header" => id.client_id_header = string(v, p)?,
        "trusted_proxy_hops" => id.trusted_proxy_hops = u32_(v, p)?,
        "client_id_metadata" => id.client_id_metadata = opt(v, p, strings)?,
        "tier_metadata" => id.tier_metadata = opt(v, p, strings)?,
        "tier_header" => id.tier_header = opt(v, p, string_)?,
        "default_tier" => id.default_tier = opt(v, p, string_)?,
        "clients" => id.clients = map(v, p, client)?,
    })?;
    Ok(id)
}

#[inline(never)]
fn client(v: &Value, p: &mut Path) -> Result<ClientSpec> {
    let mut c = ClientSpec::default();
    fields!(v, p, "struct ClientSpec", {
        "tier" => c.tier = opt(v, p, string_)?,
        "unlimited" => c.unlimited = boolean(v, p)?,
        "soft" => c.soft = boolean(v, p)?,
        "limits" => c.limits = map(v, p, limits)?,
        "quotas" => c.quotas = map(v, p, u64_)?,
    })?;
    Ok(c)
}

#[inline(never)]
fn tier(v: &Value, p: &mut Path) -> Result<TierSpec> {
    let mut t = TierSpec::default();
    fields!(v, p, "struct TierSpec", {
        "unlimited" => t.unlimited = boolean(v, p)?,
    })?;
    Ok(t)
}

#[inline(never)]
fn graduated(v: &Value, p: &mut Path) -> Result<Graduated> {
    let share = |v: &Value, p: &mut Path| float(v, p);
    let mut g = Graduated {
        warn_at: None,
        delay_at: None,
        delay_ms: None,
        reject_at: default_reject_at(),
        block_at: None,
        block_for: None,
    };
    fields!(v, p, "struct Graduated", {
        "warn_at" => g.warn_at = opt(v, p, share)?,
        "delay_at" => g.delay_at = opt(v, p, share)?,
        "delay_ms" => g.delay_ms = opt(v, p, u64_)?,
        "reject_at" => g.reject_at = float(v, p)?,
        "block_at" => g.block_at = opt(v, p, share)?,
        "block_for" => g.block_for = opt(v, p, seconds)?,
    })?;
    Ok(g)
}

#[inline(never)]
fn quota(v: &Value, p: &mut Path) -> Result<QuotaSpec> {
    let (mut name, mut period, mut upgrade_url) = (None, None, None);
    let mut q = QuotaSpec {
        name: String::new(),
        matches: None,
        key: Vec::new(),
        period: Period::Month,
        tiers: BTreeMap::new(),
        limit: None,
        upgrade_url: String::new(),
        count: QuotaCount::default(),
    };
    fields!(v, p, "struct QuotaSpec", {
        "name" => name = Some(string(v, p)?),
        "match" => q.matches = opt(v, p, matcher)?,
        "key" => q.key = key_parts(v, p)?,
        "period" => period = Some(pick(v, p, &Period::NAMES, &Period::ALL)?),
        "tiers" => q.tiers = map(v, p, u64_)?,
        "limit" => q.limit = opt(v, p, u64_)?,
        "upgrade_url" => upgrade_url = Some(string(v, p)?),
        "count" => {
                let all = [QuotaCount::Requests, QuotaCount::Cost];
                q.count = pick(v, p, &["requests", "cost"], &all)?
            },
    })?;
    q.name = required(name, p, "name")?;
    q.period = required(period, p, "period")?;
    q.upgrade_url = required(upgrade_url, p, "upgrade_url")?;
    Ok(q)
}

#[inline(never)]
fn rule(v: &Value, p: &mut Path) -> Result<Rule> {
    let mut name = None;
    let mut r = Rule {
        name: String::new(),
        matches: None,
        key: Vec::new(),
        limits: Vec::new(),
        tiers: BTreeMap::new(),
        limits_by: None,
        algorithm: Algorithm::default(),
        scope: Scope::default(),
        mode: Mode::default(),
        cost: None,
        graduated: None,
        cost_from: None,
        charge_on: None,
    };
    fields!(v, p, "struct Rule", {
        "name" => name = Some(string(v, p)?),
        "match" => r.matches = opt(v, p, matcher)?,
        "key" => r.key = key_parts(v, p)?,
        "limits" => r.limits = limits(v, p)?,
        "tiers" => r.tiers = map(v, p, limits)?,
        "limits_by" => r.limits_by = opt(v, p, limits_by)?,
        "algorithm" => r.algorithm = pick(v, p, &Algorithm::NAMES, &Algorithm::ALL)?,
        "scope" => r.scope = pick(v, p, &["local", "global"], &[Scope::Local, Scope::Global])?,
        "mode" => r.mode = pick(v, p, &["enforce", "shadow"], &[Mode::Enforce, Mode::Shadow])?,
        "cost" => r.cost = opt(v, p, u64_)?,
        "graduated" => r.graduated = opt(v, p, graduated)?,
        "cost_from" => r.cost_from = opt(v, p, cost_from)?,
        "charge_on" => r.charge_on = opt(v, p, |v, p| list(v, p, status_match))?,
    })?;
    r.name = required(name, p, "name")?;
    Ok(r)
}

#[inline(never)]
fn limits_by(v: &Value, p: &mut Path) -> Result<LimitsBy> {
    let mut b = LimitsBy::default();
    let mut sets = None;
    fields!(v, p, "struct LimitsBy", {
        "route_metadata" => b.route_metadata = opt(v, p, string_)?,
        "metadata" => b.metadata = opt(v, p, string_)?,
        "sets" => sets = Some(map(v, p, limits)?),
    })?;
    b.sets = required(sets, p, "sets")?;
    Ok(b)
}

#[inline(never)]
fn matcher(v: &Value, p: &mut Path) -> Result<Match> {
    let mut m = Match::default();
    fields!(v, p, "struct Match", {
        "path_prefix" => m.path_prefix = opt(v, p, string_)?,
        "path_exact" => m.path_exact = opt(v, p, string_)?,
        "methods" => m.methods = opt(v, p, strings)?,
        "headers" => m.headers = map(v, p, string_)?,
        "host" => m.host = opt(v, p, string_)?,
        "host_regex" => m.host_regex = opt(v, p, string_)?,
        "path_regex" => m.path_regex = opt(v, p, string_)?,
        "route" => m.route = opt(v, p, string_)?,
        "route_metadata" => m.route_metadata = map(v, p, string_)?,
        "metadata" => m.metadata = map(v, p, string_)?,
        "query" => m.query = map(v, p, value_match)?,
        "cookie" => m.cookie = map(v, p, value_match)?,
        "not" => m.not = opt(v, p, |v, p| matcher(v, p).map(Box::new))?,
        "any" => m.any = opt(v, p, |v, p| list(v, p, matcher))?,
    })?;
    Ok(m)
}

/// A `query` or `cookie` test: `true` (present) or a string (exact), as
/// [`ValueMatch`]'s `Deserialize` reads it.
#[inline(never)]
fn value_match(v: &Value, p: &mut Path) -> Result<ValueMatch> {
    match v {
        Value::String(s) => Ok(ValueMatch::Exact(s.clone())),
        Value::Bool(true) => Ok(ValueMatch::Present),
        Value::Bool(false) => Err(p.error(serde_json::Error::invalid_value(
            Unexpected::Bool(false),
            &condition::VALUE_MATCH_EXPECTING,
        ))),
        _ => Err(p.invalid_type(v, condition::VALUE_MATCH_EXPECTING)),
    }
}

#[inline(never)]
fn limits(v: &Value, p: &mut Path) -> Result<Vec<LimitSpec>> {
    list(v, p, |v, p| {
        let mut l = LimitSpec {
            requests: 0,
            per: Seconds::default(),
            concurrent: None,
            max_in_flight: None,
        };
        fields!(v, p, "struct LimitSpec", {
            "requests" => l.requests = u64_(v, p)?,
            "per" => l.per = seconds(v, p)?,
            "concurrent" => l.concurrent = opt(v, p, |v, p| u32_(v, p))?,
            "max_in_flight" => l.max_in_flight = opt(v, p, seconds)?,
        })?;
        Ok(l)
    })
}

#[inline(never)]
fn cost(v: &Value, p: &mut Path) -> Result<Cost> {
    let (mut matches, mut cost, mut from) = (None, None, None);
    fields!(v, p, "struct Cost", {
        "match" => matches = Some(matcher(v, p)?),
        "cost" => cost = opt(v, p, u64_)?,
        "cost_from" => from = opt(v, p, cost_from)?,
    })?;
    Ok(Cost {
        matches: required(matches, p, "match")?,
        cost,
        cost_from: from,
    })
}

#[inline(never)]
fn cost_from(v: &Value, p: &mut Path) -> Result<CostFrom> {
    let mut max = None;
    let mut c = CostFrom {
        header: None,
        json: None,
        preset: None,
        max: 0,
        reserve: Reserve::default(),
        scan_limit: usage::default_scan_limit(),
        request_body_limit: usage::default_request_body_limit(),
        ensure_stream_usage: false,
    };
    fields!(v, p, "struct CostFrom", {
        "header" => c.header = opt(v, p, string_)?,
        "json" => c.json = opt(v, p, |v, p| list(v, p, usage_term))?,
        "preset" => c.preset = opt(v, p, |v, p| pick(v, p, &UsagePreset::NAMES, &UsagePreset::ALL))?,
        "max" => max = Some(u64_(v, p)?),
        "reserve" => c.reserve = reserve(v, p)?,
        "scan_limit" => c.scan_limit = u64_(v, p)?,
        "request_body_limit" => c.request_body_limit = u64_(v, p)?,
        "ensure_stream_usage" => c.ensure_stream_usage = boolean(v, p)?,
    })?;
    c.max = required(max, p, "max")?;
    Ok(c)
}

/// `reserve`: a number, or `{"pointer", "default"}` (told apart by type, as
/// `Reserve`'s `Deserialize` does).
#[inline(never)]
fn reserve(v: &Value, p: &mut Path) -> Result<Reserve> {
    match v {
        Value::Number(n) if n.as_u64().is_some() => Ok(Reserve::Fixed(n.as_u64().unwrap_or(1))),
        Value::Object(_) => {
            let mut pointer = None;
            let mut default = usage::default_reserve();
            fields!(v, p, "struct ReserveFrom", {
                "pointer" => pointer = Some(parsed(v, p, JsonPointer::parse)?),
                "default" => default = u64_(v, p)?,
            })?;
            Ok(Reserve::FromBody(ReserveFrom {
                pointer: required(pointer, p, "pointer")?,
                default,
            }))
        }
        _ => Err(p.invalid_type(v, usage::RESERVE_EXPECTED)),
    }
}

#[inline(never)]
fn usage_term(v: &Value, p: &mut Path) -> Result<UsageTerm> {
    let mut pointer = None;
    let mut weight = usage::default_weight();
    fields!(v, p, "struct UsageTerm", {
        "pointer" => pointer = Some(parsed(v, p, JsonPointer::parse)?),
        "weight" => weight = u64_(v, p)?,
    })?;
    Ok(UsageTerm {
        pointer: required(pointer, p, "pointer")?,
        weight,
    })
}

fn status_match(v: &Value, p: &mut Path) -> Result<StatusMatch> {
    parsed(v, p, StatusMatch::parse)
}

/// A string read by `parse`, whose refusal is the error at this path (as
/// serde's `try_from = "String"` words it).
#[inline(never)]
fn parsed<T>(v: &Value, p: &Path, parse: fn(&str) -> std::result::Result<T, String>) -> Result<T> {
    let s = string(v, p)?;
    parse(&s).map_err(|why| p.error(serde_json::Error::custom(why)))
}

#[inline(never)]
fn metrics(v: &Value, p: &mut Path) -> Result<Metrics> {
    let mut m = Metrics::default();
    fields!(v, p, "struct Metrics", {
        "near_limit" => m.near_limit = float(v, p)?,
    })?;
    Ok(m)
}

#[inline(never)]
fn access_log(v: &Value, p: &mut Path) -> Result<AccessLog> {
    let mut a = AccessLog::default();
    fields!(v, p, "struct AccessLog", {
        "filter_state" => a.filter_state = boolean(v, p)?,
    })?;
    Ok(a)
}

fn response(v: &Value, p: &mut Path) -> Result<Response> {
    let mut r = Response::default();
    fields!(v, p, "struct Response", {
        "headers" => {
                let all = [
                    HeaderStyle::Both,
                    HeaderStyle::Legacy,
                    HeaderStyle::Ietf,
                    HeaderStyle::None,
                ];
                r.headers = pick(v, p, &["both", "legacy", "ietf", "none"], &all)?
            },
        "problem_type" => r.problem_type = string(v, p)?,
        "quota_problem_type" => r.quota_problem_type = string(v, p)?,
        "retry_jitter" => r.retry_jitter = float(v, p)?,
    })?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// Every field of the schema, each with a valid value.
    fn full() -> Value {
        let limits = json!([{"requests": 5, "per": "1m"}, {"requests": 1, "per": 2},
            {"concurrent": 3, "max_in_flight": "10m"}]);
        let matcher = json!({"path_prefix": "/a", "path_exact": "/b", "methods": ["GET"],
            "headers": {"x-a": "1"}, "host": "*.example.com", "host_regex": "a.*",
            "path_regex": "/v[0-9]+", "route": "api", "route_metadata": {"ratelimit/plan": "p"},
            "metadata": {"envoy.filters.http.jwt_authn/payload/org": "o"},
            "query": {"k": "v", "debug": true}, "cookie": {"s": true},
            "not": {"path_prefix": "/x"}, "any": [{"route": "r"}, {"host": "h"}]});
        json!({
            "domain": "d",
            "identity": {"client_id_header": "x-id", "trusted_proxy_hops": 1,
                "client_id_metadata": ["a", "b"], "tier_metadata": ["t"], "tier_header": "x-t",
                "default_tier": "free",
                "clients": {"acme": {"tier": "free", "unlimited": false, "soft": true,
                    "limits": {"r": limits}, "quotas": {"q": 3}}}},
            "rules": [{"name": "r", "match": matcher, "key": ["client"], "limits": limits,
                "tiers": {"free": limits}, "algorithm": "sliding_window", "scope": "local",
                "mode": "shadow", "cost": 2, "charge_on": ["2xx", "404"],
                "cost_from": {"header": "x-u", "json": [{"pointer": "/a/b", "weight": 2}],
                    "preset": "openai_chat", "max": 9, "reserve": {"pointer": "/max_tokens", "default": 3},
                    "scan_limit": 4096, "request_body_limit": 2048, "ensure_stream_usage": true},
                "graduated": {"warn_at": 0.5, "delay_at": 0.8, "delay_ms": 10, "reject_at": 1,
                    "block_at": 2.5, "block_for": "1h"}}],
            "costs": [{"match": matcher, "cost": 5,
                "cost_from": {"json": [{"pointer": "/u"}], "max": 7}}],
            "response": {"headers": "ietf", "problem_type": "about:blank",
                "quota_problem_type": "urn:q", "retry_jitter": 0.2},
            "metrics": {"near_limit": 0.9},
            "access_log": {"filter_state": false},
            "max_buckets": 100,
            "on_error": "deny",
            "global": {"cluster": "gw", "authority": "a", "path": "/p", "timeout_ms": 9,
                "failure_mode": "closed", "instances": 2,
                "circuit": {"failures": 3, "latency_ms": 4, "cooldown_ms": 5},
                "lease": {"fraction": 0.1, "max_wait_ms": 1, "ttl_ms": 20, "path": "/l",
                    "max_leases": 7},
                "deny_cache": 0, "token": "t", "token_env": "E"},
            "tiers": {"free": {"unlimited": true}},
            "quotas": [{"name": "q", "match": matcher, "key": ["ip"], "period": "day",
                "tiers": {"free": 9}, "limit": 4, "upgrade_url": "https://u", "count": "cost"}]
        })
    }

    /// JSON pointers of every value in `v`.
    fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => m
                .iter()
                .for_each(|(k, v)| pointers(v, format!("{at}/{k}"), out)),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .for_each(|(i, v)| pointers(v, format!("{at}/{i}"), out)),
            _ => {}
        }
        out.push(at);
    }

    /// What a mutation puts in place of a value: every JSON type, numbers at
    /// the edges of u32/u64, durations, enum names (also in serde's map form).
    fn replacement(choice: usize) -> Option<Value> {
        let all = [
            json!(null),
            json!(true),
            json!(0),
            json!(7),
            json!(-3),
            json!(1.5),
            json!(1.0),
            json!(4294967296u64),
            json!(u64::MAX),
            json!(""),
            json!("x"),
            json!("1m"),
            json!("0s"),
            json!("10x"),
            json!([]),
            json!(["a"]),
            json!({}),
            json!({"zz": 1}),
            json!({"local": null}),
            json!({"global": 1}),
            json!({"a": null, "b": null}),
            json!("global"),
            json!("month"),
            json!("cost"),
            json!([{"requests": 1, "per": 1}]),
            json!({"requests": 1}),
            json!({"per": "1s", "requests": -1}),
            json!({"name": "n"}),
            json!("2xx"),
            json!("/usage/x"),
            json!("a~2"),
            json!("anthropic_messages"),
            json!(false),
        ];
        all.get(choice).cloned()
    }

    fn read(v: &Value) -> std::result::Result<String, ConfigError> {
        config(v, &mut Path::root()).map(|c| format!("{c:?}"))
    }

    fn serde(v: &Value) -> std::result::Result<String, ConfigError> {
        serde_path_to_error::deserialize::<_, Config>(v)
            .map(|c| format!("{c:?}"))
            .map_err(|e| ConfigError::field(e.path().to_string(), e.inner().to_string()))
    }

    proptest! {
        /// The reader accepts what `#[derive(Deserialize)]` accepted, with the
        /// same defaults, and refuses the rest with serde_path_to_error's path
        /// and serde's message. One deliberate difference: serde also read a
        /// struct from an array of its fields in order, which no documented
        /// configuration writes; the reader refuses it as the wrong type.
        #[test]
        fn the_reader_agrees_with_serde(
            edits in proptest::collection::vec((any::<usize>(), 0usize..37, any::<bool>()), 0..4)
        ) {
            let mut v = full();
            for (at, choice, delete) in edits {
                let mut ptrs = Vec::new();
                pointers(&v, String::new(), &mut ptrs);
                let ptr = &ptrs[at % ptrs.len()];
                let (parent, key) = ptr.rsplit_once('/').unwrap_or(("", ""));
                match (v.pointer_mut(parent), replacement(choice)) {
                    (Some(Value::Object(m)), _) if delete => { m.remove(key); }
                    (Some(Value::Object(m)), None) => { m.insert(format!("{key}_"), json!(1)); }
                    (_, Some(new)) => if let Some(slot) = v.pointer_mut(ptr) { *slot = new },
                    _ => {}
                }
            }
            let ours = read(&v);
            if let Err(ConfigError::Field { reason, .. }) = &ours {
                prop_assume!(!reason.starts_with("invalid type: sequence, expected struct"));
            }
            prop_assert_eq!(ours, serde(&v), "{}", v);
        }
    }

    /// The two cases the proptest first found: serde names an unknown
    /// variant before it looks at the map's value, and puts the variant in
    /// the path of a value that is not `null`.
    #[test]
    fn enums_in_serde_map_form() {
        for (field, value) in [
            ("period", json!({"global": 1})),
            ("count", json!({"requests": 1})),
            ("count", json!({"cost": null})),
        ] {
            let mut v = full();
            v["quotas"][0][field] = value;
            assert_eq!(read(&v), serde(&v), "{field}");
        }
    }

    #[test]
    fn every_field_is_read() {
        let v = full();
        assert_eq!(read(&v), serde(&v));
        assert!(read(&v).is_ok());
        let minimal = json!({"domain": "d", "rules": []});
        assert_eq!(read(&minimal), serde(&minimal));
    }
}
