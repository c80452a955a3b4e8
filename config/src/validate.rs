//! Parsing and validation of a configuration: every error names the field
//! path, e.g. `rules[1].limits[0].per: "10x" is not a duration`. The rules,
//! limits, graduated stages, identity and quotas are checked here; the gateway
//! settings in [`super::validate_global`].

use super::syntax::*;
use super::vocab::Algorithm;
use super::*;
use std::collections::HashSet;

/// Parses and validates a configuration.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| ConfigError::NotJson(e.to_string()))?;
    let config = super::read::config(&value, &mut super::read::Path::root())?;
    config.validate()?;
    Ok(config)
}

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
        if let Some(why) = header_name_problem(&id.client_id_header) {
            return Err(ConfigError::field("identity.client_id_header", why));
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
        at_most("rules", self.rules.len(), MAX_RULES)?;
        self.validate_global_count()?;
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
            if let Some(by) = &rule.limits_by {
                validate_limits_by(&format!("{at}.limits_by"), by, rule)?;
            }
            if let Some(cost) = rule.cost {
                check_cost(&format!("{at}.cost"), cost)?;
            }
            rule.validate_charging(&at)?;
            if rule.is_concurrent() {
                rule.validate_concurrency(&at)?;
            }
            if let Some(g) = &rule.graduated {
                validate_graduated(&format!("{at}.graduated"), rule, g)?;
            }
        }
        self.validate_global()?;
        self.validate_pattern_count()?;
        self.validate_identity()?;
        self.validate_quotas()?;
        for (i, cost) in self.costs.iter().enumerate() {
            let at = format!("costs[{i}]");
            cost.matches.validate(&format!("{at}.match"))?;
            match (cost.cost, &cost.cost_from) {
                (Some(c), None) => check_cost(&format!("{at}.cost"), c)?,
                (None, Some(from)) => from.validate(&format!("{at}.cost_from"))?,
                _ => {
                    return Err(ConfigError::field(
                        at,
                        "give exactly one of cost and cost_from",
                    ))
                }
            }
        }
        self.validate_costs_fit()?;
        if !(self.metrics.near_limit > 0.0 && self.metrics.near_limit <= 1.0) {
            return Err(ConfigError::field(
                "metrics.near_limit",
                "must be above 0 and at most 1",
            ));
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

/// A top-level list of `n` entries holds at most `max`; the error names the
/// list and counts in its own word (`rules: 1025 rules exceed …`).
impl Config {
    /// Refuses more global rules than one gateway check carries buckets: a
    /// request matching them all would be refused by the gateway.
    fn validate_global_count(&self) -> Result<(), ConfigError> {
        let over = self
            .rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.scope == Scope::Global)
            .nth(MAX_GLOBAL_RULES);
        match over {
            Some((i, _)) => Err(ConfigError::field(
                format!("rules[{i}].scope"),
                format!(
                    "a {}th global rule; one gateway check carries at most \
                     {MAX_GLOBAL_RULES} buckets, one per global rule",
                    MAX_GLOBAL_RULES + 1
                ),
            )),
            None => Ok(()),
        }
    }
}

fn at_most(list: &str, n: usize, max: usize) -> Result<(), ConfigError> {
    if n > max {
        return Err(ConfigError::field(
            list,
            format!("{n} {list} exceed the maximum of {max}"),
        ));
    }
    Ok(())
}

fn validate_key(at: &str, key: &[KeyPart]) -> Result<(), ConfigError> {
    if key.len() > MAX_KEY_PARTS {
        return Err(ConfigError::field(
            at,
            format!("at most {MAX_KEY_PARTS} parts"),
        ));
    }
    Ok(())
}

/// Checks one set of limits of `rule`, wherever it is written: the rule's own
/// `limits`, a tier's, or a client's override. Every set of a rule takes the
/// same path to the buckets and the gateway, so every check lives here once.
/// `limits_by`: one metadata path, plain set names, each set valid limits.
/// Not beside `tiers`: a request gets one of the two kinds of sets.
fn validate_limits_by(at: &str, by: &LimitsBy, rule: &Rule) -> Result<(), ConfigError> {
    if !rule.tiers.is_empty() {
        return Err(ConfigError::field(
            at,
            "does not go with tiers: a rule picks its limits by tier or by metadata",
        ));
    }
    let Some((source, path)) = by.source() else {
        return Err(ConfigError::field(
            at,
            "give exactly one of route_metadata and metadata",
        ));
    };
    let field = match source {
        LimitsSource::RouteMetadata => "route_metadata",
        LimitsSource::Metadata => "metadata",
    };
    condition::MetadataPath::parse(path)
        .map_err(|why| ConfigError::field(format!("{at}.{field}"), why))?;
    if by.sets.is_empty() || by.sets.len() > MAX_LIMIT_SETS {
        return Err(ConfigError::field(
            format!("{at}.sets"),
            format!("must hold 1 to {MAX_LIMIT_SETS} sets"),
        ));
    }
    for (name, limits) in &by.sets {
        if !is_plain_name(name) {
            return Err(ConfigError::field(
                format!("{at}.sets"),
                format!("{name:?} must be 1-64 characters of A-Z a-z 0-9 - _ . :"),
            ));
        }
        validate_limits(&format!("{at}.sets.{name}"), limits, rule, false)?;
    }
    Ok(())
}

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
    if rule.is_concurrent() {
        return validate_concurrent(at, limits);
    }
    for (l, limit) in limits.iter().enumerate() {
        if limit.is_concurrent() || limit.max_in_flight.is_some() {
            return Err(ConfigError::field(
                format!("{at}[{l}]"),
                "a concurrency limit stands alone: the rule's every limit set is one \
                 {\"concurrent\": N}",
            ));
        }
        if limit.per.0 == 0 {
            return Err(ConfigError::field(
                format!("{at}[{l}].per"),
                "required for a rate limit (or give concurrent)",
            ));
        }
        if limit.requests == 0 || limit.requests > MAX_REQUESTS {
            return Err(ConfigError::field(
                format!("{at}[{l}].requests"),
                format!("must be between 1 and {MAX_REQUESTS}"),
            ));
        }
        // A graduated rule's bucket holds `reject_at` of the limit, and its
        // demand `block_at` of it: the gateway's scripts count those too.
        let product = graduated_tokens(limit.requests, rule.graduated.as_ref())
            .saturating_mul(limit.per.0.saturating_mul(1000));
        if rule.scope == Scope::Global && product > MAX_GLOBAL_PRODUCT {
            let reason = match rule.graduated {
                None => "requests × per must stay under 2^53 milliseconds for a global rule",
                Some(_) => {
                    "requests × per × the largest graduated share (reject_at, block_at) \
                     must stay under 2^53 milliseconds for a global rule"
                }
            };
            return Err(ConfigError::field(format!("{at}[{l}].per"), reason));
        }
    }
    Ok(())
}

/// Most seconds a concurrency slot may be held (`max_in_flight`).
pub const MAX_IN_FLIGHT_SECS: u64 = 86_400;

/// Checks one limit set of a concurrency rule: exactly one
/// `{"concurrent": N}`, without `requests` or `per`.
fn validate_concurrent(at: &str, limits: &[LimitSpec]) -> Result<(), ConfigError> {
    let [limit] = limits else {
        return Err(ConfigError::field(
            at,
            "a concurrency rule's every limit set is exactly one {\"concurrent\": N}",
        ));
    };
    let Some(n) = limit.concurrent else {
        return Err(ConfigError::field(
            format!("{at}[0]"),
            "a concurrency rule's every limit set is exactly one {\"concurrent\": N}",
        ));
    };
    if limit.requests != 0 || limit.per.0 != 0 {
        return Err(ConfigError::field(
            format!("{at}[0]"),
            "give concurrent, or requests and per, not both",
        ));
    }
    if n == 0 || n > MAX_CONCURRENT {
        return Err(ConfigError::field(
            format!("{at}[0].concurrent"),
            format!("must be between 1 and {MAX_CONCURRENT}"),
        ));
    }
    if limit.max_in_flight_secs() > MAX_IN_FLIGHT_SECS {
        return Err(ConfigError::field(
            format!("{at}[0].max_in_flight"),
            "must be at most 1d",
        ));
    }
    Ok(())
}

impl Rule {
    /// A concurrency rule (at `at`, `rules[2]`) is local, holds one slot per
    /// request whatever it costs, and always enforces.
    fn validate_concurrency(&self, at: &str) -> Result<(), ConfigError> {
        let refused = [
            (
                self.graduated.is_some(),
                "graduated",
                "does not apply to a concurrency rule",
            ),
            (
                self.cost.is_some(),
                "cost",
                "does not apply to a concurrency rule: each request holds one slot",
            ),
            (
                self.cost_from.is_some(),
                "cost_from",
                "does not apply to a concurrency rule: each request holds one slot",
            ),
            (
                self.charge_on.is_some(),
                "charge_on",
                "does not apply to a concurrency rule: a slot is held until the stream ends",
            ),
            (
                self.mode == Mode::Shadow,
                "mode",
                "shadow is not supported for a concurrency rule",
            ),
        ];
        match refused.iter().find(|(bad, _, _)| *bad) {
            Some((_, field, why)) => Err(ConfigError::field(format!("{at}.{field}"), *why)),
            None => Ok(()),
        }
    }
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

/// The most tokens a graduated rule's limit of `requests` counts: its
/// bucket (`reject_at` of it) or its demand (`block_at` of it), rounded up;
/// `requests` for a rule without stages.
pub fn graduated_tokens(requests: u64, g: Option<&Graduated>) -> u64 {
    let share = g.map_or(1.0, |g| g.reject_at.max(g.block_at.unwrap_or(1.0)).max(1.0));
    ((requests as f64) * share).ceil() as u64
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
pub const MAX_QUOTA: u64 = super::bounds::MAX_QUOTA_LIMIT;

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
            if let Some(why) = header_name_problem(h) {
                return Err(ConfigError::field("identity.tier_header", why));
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
        at_most("quotas", self.quotas.len(), MAX_QUOTAS)?;
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
            if let Some(why) = header_name_problem(name) {
                return Err(ConfigError::field(format!("{at}.headers"), why));
            }
        }
        self.validate_conditions(at, 0)
    }

    /// The conditions beyond path, method and headers; `depth` counts the
    /// `not` and `any` this match sits in.
    fn validate_conditions(&self, at: &str, depth: usize) -> Result<(), ConfigError> {
        let field = |f: &str, why: String| Err(ConfigError::field(format!("{at}.{f}"), why));
        if let Some(h) = &self.host {
            if let Err(why) = condition::HostPattern::parse(h) {
                return field("host", why);
            }
        }
        for (f, pattern, host) in [
            ("host_regex", &self.host_regex, true),
            ("path_regex", &self.path_regex, false),
        ] {
            if let Some(why) = pattern
                .as_deref()
                .and_then(|p| condition::compile_pattern(p, host).err())
            {
                return field(f, why);
            }
        }
        if let Some(route) = &self.route {
            if let Some(why) = condition::name_problem("route", route) {
                return field("route", why);
            }
        }
        for (f, paths) in [
            ("route_metadata", &self.route_metadata),
            ("metadata", &self.metadata),
        ] {
            for path in paths.keys() {
                if let Err(why) = condition::MetadataPath::parse(path) {
                    return field(f, why);
                }
            }
        }
        for (f, kind, names) in [
            ("query", "query parameter", &self.query),
            ("cookie", "cookie", &self.cookie),
        ] {
            for name in names.keys() {
                if let Some(why) = condition::name_problem(kind, name) {
                    return field(f, why);
                }
            }
        }
        let nested = self.not.is_some() || self.any.is_some();
        if nested && depth >= condition::MAX_MATCH_DEPTH {
            return Err(ConfigError::field(
                at,
                format!(
                    "not and any nest at most {} deep",
                    condition::MAX_MATCH_DEPTH
                ),
            ));
        }
        if let Some(not) = &self.not {
            let at = format!("{at}.not");
            not.validate(&at)?;
            not.validate_conditions(&at, depth + 1)?;
        }
        if let Some(any) = &self.any {
            if any.is_empty() || any.len() > condition::MAX_ANY {
                return field(
                    "any",
                    format!("must hold 1 to {} matches", condition::MAX_ANY),
                );
            }
            for (i, m) in any.iter().enumerate() {
                let at = format!("{at}.any[{i}]");
                m.validate(&at)?;
                m.validate_conditions(&at, depth + 1)?;
            }
        }
        Ok(())
    }

    /// How many regular expressions this match (and those inside it) compiles.
    pub fn patterns(&self) -> usize {
        let own = usize::from(self.host_regex.is_some()) + usize::from(self.path_regex.is_some());
        let not = self.not.as_ref().map_or(0, |m| m.patterns());
        let any = self
            .any
            .iter()
            .flatten()
            .map(Match::patterns)
            .sum::<usize>();
        own + not + any
    }
}

impl Config {
    /// At most [`condition::MAX_PATTERNS`] regular expressions in all:
    /// each takes up to [`condition::MAX_PATTERN_HEAP`] of every VM's memory.
    fn validate_pattern_count(&self) -> Result<(), ConfigError> {
        let matches = self
            .rules
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.matches.as_ref().map(|m| (format!("rules[{i}].match"), m)))
            .chain(self.quotas.iter().enumerate().filter_map(|(i, q)| {
                q.matches
                    .as_ref()
                    .map(|m| (format!("quotas[{i}].match"), m))
            }))
            .chain(
                self.costs
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (format!("costs[{i}].match"), &c.matches)),
            );
        let mut total = 0;
        for (at, m) in matches {
            total += m.patterns();
            if total > condition::MAX_PATTERNS {
                return Err(ConfigError::field(
                    at,
                    format!(
                        "at most {} path_regex and host_regex patterns in all",
                        condition::MAX_PATTERNS
                    ),
                ));
            }
        }
        Ok(())
    }
}
