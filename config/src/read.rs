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
    const FIELDS: &[&str] = &[
        "domain",
        "identity",
        "rules",
        "costs",
        "response",
        "max_buckets",
        "on_error",
        "global",
        "tiers",
        "quotas",
    ];
    let (mut domain, mut rules) = (None, None);
    let mut c = Config {
        domain: String::new(),
        identity: Identity::default(),
        rules: Vec::new(),
        costs: Vec::new(),
        response: Response::default(),
        max_buckets: DEFAULT_BUCKETS,
        on_error: OnError::default(),
        global: None,
        tiers: BTreeMap::new(),
        quotas: Vec::new(),
    };
    Fields::new(v, p, "struct Config", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => domain = Some(string(v, p)?),
            1 => c.identity = identity(v, p)?,
            2 => rules = Some(list(v, p, rule)?),
            3 => c.costs = list(v, p, cost)?,
            4 => c.response = response(v, p)?,
            5 => c.max_buckets = u64_(v, p)?,
            6 => c.on_error = pick(v, p, &["allow", "deny"], &[OnError::Allow, OnError::Deny])?,
            7 => c.global = opt(v, p, global)?,
            8 => c.tiers = map(v, p, tier)?,
            _ => c.quotas = list(v, p, quota)?,
        }
        Ok(())
    })?;
    c.domain = required(domain, p, "domain")?;
    c.rules = required(rules, p, "rules")?;
    Ok(c)
}

#[inline(never)]
fn global(v: &Value, p: &mut Path) -> Result<Global> {
    const FIELDS: &[&str] = &[
        "cluster",
        "authority",
        "path",
        "timeout_ms",
        "failure_mode",
        "instances",
        "circuit",
        "lease",
        "deny_cache",
        "token",
        "token_env",
    ];
    let mut cluster = None;
    let mut g = Global {
        cluster: String::new(),
        authority: default_authority(),
        path: default_check_path(),
        timeout_ms: default_timeout_ms(),
        failure_mode: FailureMode::default(),
        instances: default_instances(),
        circuit: Circuit::default(),
        lease: None,
        deny_cache: default_deny_cache(),
        token: None,
        token_env: None,
    };
    Fields::new(v, p, "struct Global", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => cluster = Some(string(v, p)?),
            1 => g.authority = string(v, p)?,
            2 => g.path = string(v, p)?,
            3 => g.timeout_ms = u64_(v, p)?,
            4 => {
                let all = [FailureMode::Open, FailureMode::Closed, FailureMode::Local];
                g.failure_mode = pick(v, p, &["open", "closed", "local"], &all)?
            }
            5 => g.instances = u64_(v, p)?,
            6 => g.circuit = circuit(v, p)?,
            7 => g.lease = opt(v, p, lease)?,
            8 => g.deny_cache = u64_(v, p)?,
            9 => g.token = opt(v, p, string_)?.map(Token),
            _ => g.token_env = opt(v, p, string_)?,
        }
        Ok(())
    })?;
    g.cluster = required(cluster, p, "cluster")?;
    Ok(g)
}

#[inline(never)]
fn lease(v: &Value, p: &mut Path) -> Result<Lease> {
    const FIELDS: &[&str] = &["fraction", "max_wait_ms", "ttl_ms", "path", "max_leases"];
    let mut fraction = None;
    let mut l = Lease {
        fraction: 0.0,
        max_wait_ms: default_lease_wait_ms(),
        ttl_ms: default_lease_ttl_ms(),
        path: default_lease_path(),
        max_leases: default_max_leases(),
    };
    Fields::new(v, p, "struct Lease", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => fraction = Some(float(v, p)?),
            1 => l.max_wait_ms = u64_(v, p)?,
            2 => l.ttl_ms = u64_(v, p)?,
            3 => l.path = string(v, p)?,
            _ => l.max_leases = u64_(v, p)?,
        }
        Ok(())
    })?;
    l.fraction = required(fraction, p, "fraction")?;
    Ok(l)
}

#[inline(never)]
fn circuit(v: &Value, p: &mut Path) -> Result<Circuit> {
    const FIELDS: &[&str] = &["failures", "latency_ms", "cooldown_ms"];
    let mut c = Circuit::default();
    Fields::new(v, p, "struct Circuit", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => c.failures = u32_(v, p)?,
            1 => c.latency_ms = u64_(v, p)?,
            _ => c.cooldown_ms = u64_(v, p)?,
        }
        Ok(())
    })?;
    Ok(c)
}

#[inline(never)]
fn identity(v: &Value, p: &mut Path) -> Result<Identity> {
    const FIELDS: &[&str] = &[
        "client_id_header",
        "trusted_proxy_hops",
        "client_id_metadata",
        "tier_metadata",
        "tier_header",
        "default_tier",
        "clients",
    ];
    let mut id = Identity::default();
    Fields::new(v, p, "struct Identity", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => id.client_id_header = string(v, p)?,
            1 => id.trusted_proxy_hops = u32_(v, p)?,
            2 => id.client_id_metadata = opt(v, p, strings)?,
            3 => id.tier_metadata = opt(v, p, strings)?,
            4 => id.tier_header = opt(v, p, string_)?,
            5 => id.default_tier = opt(v, p, string_)?,
            _ => id.clients = map(v, p, client)?,
        }
        Ok(())
    })?;
    Ok(id)
}

#[inline(never)]
fn client(v: &Value, p: &mut Path) -> Result<ClientSpec> {
    const FIELDS: &[&str] = &["tier", "unlimited", "soft", "limits", "quotas"];
    let mut c = ClientSpec::default();
    Fields::new(v, p, "struct ClientSpec", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => c.tier = opt(v, p, string_)?,
            1 => c.unlimited = boolean(v, p)?,
            2 => c.soft = boolean(v, p)?,
            3 => c.limits = map(v, p, limits)?,
            _ => c.quotas = map(v, p, u64_)?,
        }
        Ok(())
    })?;
    Ok(c)
}

#[inline(never)]
fn tier(v: &Value, p: &mut Path) -> Result<TierSpec> {
    let mut t = TierSpec::default();
    Fields::new(v, p, "struct TierSpec", &["unlimited"])?.each(p, |_, v, p| {
        t.unlimited = boolean(v, p)?;
        Ok(())
    })?;
    Ok(t)
}

#[inline(never)]
fn graduated(v: &Value, p: &mut Path) -> Result<Graduated> {
    const FIELDS: &[&str] = &[
        "warn_at",
        "delay_at",
        "delay_ms",
        "reject_at",
        "block_at",
        "block_for",
    ];
    let share = |v: &Value, p: &mut Path| float(v, p);
    let mut g = Graduated {
        warn_at: None,
        delay_at: None,
        delay_ms: None,
        reject_at: default_reject_at(),
        block_at: None,
        block_for: None,
    };
    Fields::new(v, p, "struct Graduated", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => g.warn_at = opt(v, p, share)?,
            1 => g.delay_at = opt(v, p, share)?,
            2 => g.delay_ms = opt(v, p, u64_)?,
            3 => g.reject_at = float(v, p)?,
            4 => g.block_at = opt(v, p, share)?,
            _ => g.block_for = opt(v, p, seconds)?,
        }
        Ok(())
    })?;
    Ok(g)
}

#[inline(never)]
fn quota(v: &Value, p: &mut Path) -> Result<QuotaSpec> {
    const FIELDS: &[&str] = &[
        "name",
        "match",
        "key",
        "period",
        "tiers",
        "limit",
        "upgrade_url",
        "count",
    ];
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
    Fields::new(v, p, "struct QuotaSpec", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => name = Some(string(v, p)?),
            1 => q.matches = opt(v, p, matcher)?,
            2 => q.key = key_parts(v, p)?,
            3 => period = Some(pick(v, p, &Period::NAMES, &Period::ALL)?),
            4 => q.tiers = map(v, p, u64_)?,
            5 => q.limit = opt(v, p, u64_)?,
            6 => upgrade_url = Some(string(v, p)?),
            _ => {
                let all = [QuotaCount::Requests, QuotaCount::Cost];
                q.count = pick(v, p, &["requests", "cost"], &all)?
            }
        }
        Ok(())
    })?;
    q.name = required(name, p, "name")?;
    q.period = required(period, p, "period")?;
    q.upgrade_url = required(upgrade_url, p, "upgrade_url")?;
    Ok(q)
}

#[inline(never)]
fn rule(v: &Value, p: &mut Path) -> Result<Rule> {
    const FIELDS: &[&str] = &[
        "name",
        "match",
        "key",
        "limits",
        "tiers",
        "algorithm",
        "scope",
        "mode",
        "cost",
        "graduated",
    ];
    let mut name = None;
    let mut r = Rule {
        name: String::new(),
        matches: None,
        key: Vec::new(),
        limits: Vec::new(),
        tiers: BTreeMap::new(),
        algorithm: Algorithm::default(),
        scope: Scope::default(),
        mode: Mode::default(),
        cost: None,
        graduated: None,
    };
    Fields::new(v, p, "struct Rule", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => name = Some(string(v, p)?),
            1 => r.matches = opt(v, p, matcher)?,
            2 => r.key = key_parts(v, p)?,
            3 => r.limits = limits(v, p)?,
            4 => r.tiers = map(v, p, limits)?,
            5 => r.algorithm = pick(v, p, &Algorithm::NAMES, &Algorithm::ALL)?,
            6 => r.scope = pick(v, p, &["local", "global"], &[Scope::Local, Scope::Global])?,
            7 => r.mode = pick(v, p, &["enforce", "shadow"], &[Mode::Enforce, Mode::Shadow])?,
            8 => r.cost = opt(v, p, u64_)?,
            _ => r.graduated = opt(v, p, graduated)?,
        }
        Ok(())
    })?;
    r.name = required(name, p, "name")?;
    Ok(r)
}

#[inline(never)]
fn matcher(v: &Value, p: &mut Path) -> Result<Match> {
    const FIELDS: &[&str] = &["path_prefix", "path_exact", "methods", "headers"];
    let mut m = Match::default();
    Fields::new(v, p, "struct Match", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => m.path_prefix = opt(v, p, string_)?,
            1 => m.path_exact = opt(v, p, string_)?,
            2 => m.methods = opt(v, p, strings)?,
            _ => m.headers = map(v, p, string_)?,
        }
        Ok(())
    })?;
    Ok(m)
}

#[inline(never)]
fn limits(v: &Value, p: &mut Path) -> Result<Vec<LimitSpec>> {
    list(v, p, |v, p| {
        let (mut requests, mut per) = (None, None);
        Fields::new(v, p, "struct LimitSpec", &["requests", "per"])?.each(p, |i, v, p| {
            match i {
                0 => requests = Some(u64_(v, p)?),
                _ => per = Some(seconds(v, p)?),
            }
            Ok(())
        })?;
        Ok(LimitSpec {
            requests: required(requests, p, "requests")?,
            per: required(per, p, "per")?,
        })
    })
}

#[inline(never)]
fn cost(v: &Value, p: &mut Path) -> Result<Cost> {
    let (mut matches, mut cost) = (None, None);
    Fields::new(v, p, "struct Cost", &["match", "cost"])?.each(p, |i, v, p| {
        match i {
            0 => matches = Some(matcher(v, p)?),
            _ => cost = Some(u64_(v, p)?),
        }
        Ok(())
    })?;
    Ok(Cost {
        matches: required(matches, p, "match")?,
        cost: required(cost, p, "cost")?,
    })
}

#[inline(never)]
fn response(v: &Value, p: &mut Path) -> Result<Response> {
    const FIELDS: &[&str] = &[
        "headers",
        "problem_type",
        "quota_problem_type",
        "retry_jitter",
    ];
    let mut r = Response::default();
    Fields::new(v, p, "struct Response", FIELDS)?.each(p, |i, v, p| {
        match i {
            0 => {
                let all = [
                    HeaderStyle::Both,
                    HeaderStyle::Legacy,
                    HeaderStyle::Ietf,
                    HeaderStyle::None,
                ];
                r.headers = pick(v, p, &["both", "legacy", "ietf", "none"], &all)?
            }
            1 => r.problem_type = string(v, p)?,
            2 => r.quota_problem_type = string(v, p)?,
            _ => r.retry_jitter = float(v, p)?,
        }
        Ok(())
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
        let limits = json!([{"requests": 5, "per": "1m"}, {"requests": 1, "per": 2}]);
        let matcher = json!({"path_prefix": "/a", "path_exact": "/b", "methods": ["GET"],
            "headers": {"x-a": "1"}});
        json!({
            "domain": "d",
            "identity": {"client_id_header": "x-id", "trusted_proxy_hops": 1,
                "client_id_metadata": ["a", "b"], "tier_metadata": ["t"], "tier_header": "x-t",
                "default_tier": "free",
                "clients": {"acme": {"tier": "free", "unlimited": false, "soft": true,
                    "limits": {"r": limits}, "quotas": {"q": 3}}}},
            "rules": [{"name": "r", "match": matcher, "key": ["client"], "limits": limits,
                "tiers": {"free": limits}, "algorithm": "sliding_window", "scope": "local",
                "mode": "shadow", "cost": 2,
                "graduated": {"warn_at": 0.5, "delay_at": 0.8, "delay_ms": 10, "reject_at": 1,
                    "block_at": 2.5, "block_for": "1h"}}],
            "costs": [{"match": matcher, "cost": 5}],
            "response": {"headers": "ietf", "problem_type": "about:blank",
                "quota_problem_type": "urn:q", "retry_jitter": 0.2},
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
            edits in proptest::collection::vec((any::<usize>(), 0usize..32, any::<bool>()), 0..4)
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
