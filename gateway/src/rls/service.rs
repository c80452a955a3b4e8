//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! Each request descriptor is decided on its own, as envoyproxy/ratelimit
//! does: its limit is found in `--rls-config` ([`super::config`]), limits
//! named in another found limit's `replaces` are dropped, `unlimited` ones
//! answer OK without Redis; the rest are counted in Redis with the
//! descriptor's hits (its `hits_addend`, else the request's, else 1). The
//! answer is `OVER_LIMIT` when any descriptor not in `shadow_mode` is over.
//!
//! * `fixed_window` descriptors: one `fixed_window.lua` call per cluster slot
//!   group, every key counted even when over (theirs).
//! * `token_bucket`, `sliding_window` and `shared` descriptors: one
//!   `check.lua` call each through the HTTP side's [`crate::orchestrate`]: a
//!   denied hit is not counted.
//!
//! A descriptor's own `limit` (Envoy's override) is honoured only with
//! `--rls-allow-overrides` (the default, as theirs); its metrics are counted
//! under the one descriptor label [`OVERRIDE_DESCRIPTOR`], never under
//! anything the request wrote. A `shared` descriptor reads the rule's key
//! parts from its parsed entries, at the positions the configuration fixed
//! ([`super::config::Shared::positions`]); hits above the most the policy
//! lets one request cost the rule answer `OVER_LIMIT` without Redis.
//!
//! Callers authenticate with `authorization: Bearer <token>` metadata
//! (`--auth-tokens`, the same file as `/v1/*`): `UNAUTHENTICATED` without a
//! known token, `PERMISSION_DENIED` for another domain; neither touches Redis.
//! A Redis failure answers `UNKNOWN` (theirs), so the native filter's
//! `failure_mode_deny` decides.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit as ProtoLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use redis::cluster_routing::Slot;
use tonic::{Request, Response, Status};

use super::config::{replaced, RateLimit, RlsAlgorithm, RlsConfig, Unit};
use super::metrics::{RlsMetrics, OVERRIDE_DESCRIPTOR};
use crate::auth::{Caller, Refusal};
use crate::http::server::App;
use crate::logging::Escaped;
use crate::policy::{Resolved, ResolvedBucket};
use crate::protocol::{CheckResponse, Limit, MAX_EXACT};
use crate::redis::keys;
use crate::redis::script;
use crate::redis::store::StoreError;
use crate::reload::Reloadable;

/// Most descriptors in one request (Envoy sends one per matching action set).
pub const MAX_DESCRIPTORS: usize = 64;

/// Longest descriptor entries, as they go into a key, before they are hashed.
pub const MAX_KEY_ENTRIES_BYTES: usize = 512;

/// A call's place among `--max-in-flight`, taken by [`Rls::admit`] and
/// carried in the request's extensions (which need `Clone`).
#[derive(Clone)]
struct InFlight {
    _permit: Arc<tokio::sync::OwnedSemaphorePermit>,
}

/// The rate limit service (cloned once per worker thread of `crate::run`).
#[derive(Clone)]
pub struct Rls {
    app: Arc<App>,
    config: Arc<Reloadable<RlsConfig>>,
    metrics: RlsMetrics,
    near_limit_ratio: f32,
    prefix: String,
    allow_overrides: bool,
}

impl Rls {
    /// A service answering from `config`, counting in the Redis of `app`
    /// under keys starting with `prefix`; a descriptor's own `limit` is
    /// honoured when `allow_overrides` (`--rls-allow-overrides`).
    pub fn new(
        app: Arc<App>,
        config: Arc<Reloadable<RlsConfig>>,
        near_limit_ratio: f32,
        prefix: String,
        allow_overrides: bool,
    ) -> Result<Rls, prometheus::Error> {
        let metrics = RlsMetrics::new(app.metrics.registry())?;
        Ok(Rls {
            app,
            config,
            metrics,
            near_limit_ratio,
            prefix,
            allow_overrides,
        })
    }

    /// The metrics (for tests).
    pub fn metrics(&self) -> &RlsMetrics {
        &self.metrics
    }
}

/// What one request descriptor asks for.
// Unboxed on purpose: a call's few plans live in one vector for the call,
// and boxing the large variant would allocate once more per descriptor.
#[allow(clippy::large_enum_variant)]
enum Plan<'a> {
    /// No limit found (or replaced): OK, nothing counted.
    None,
    /// `unlimited`: OK with `limit_remaining` 2^32 − 1.
    Unlimited,
    /// A limit to count `hits` in.
    Count {
        limit: std::borrow::Cow<'a, RateLimit>,
        hits: u64,
        /// The entries as they go into a fixed-window or native bucket key
        /// (empty for a shared limit).
        entries: String,
        /// A shared limit's key part values, one per `shared.entries`, taken
        /// from the request's parsed entries (empty otherwise).
        shared: Vec<&'a str>,
    },
}

/// What a token-bucket, sliding-window or shared descriptor asks Redis.
enum Resolution {
    /// One bucket to check.
    Check(Resolved),
    /// A shared descriptor whose hits pass the most one request may cost
    /// the rule: over the limit without a look at Redis, with the rule's
    /// limits for the answer.
    TooCostly(Vec<Limit>),
}

/// A fixed-window descriptor in a script call: (descriptor index, key
/// base, unit in seconds, hits).
type FixedKey = (usize, String, u64, u64);

/// One descriptor's outcome, before shadow mode.
struct Outcome {
    over: bool,
    remaining: u64,
    /// Count before and after the hits (metrics).
    before: u64,
    after: u64,
    reset_ms: u64,
    current: ProtoLimit,
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        // The place is held until the call is answered.
        let (_in_flight, req) = self.admitted(request)?;
        let config = self.config.current();
        let plans = match plan(&config, &req, self.allow_overrides) {
            Ok(p) => p,
            Err(message) => return Err(self.refuse("invalid", Status::invalid_argument(message))),
        };
        let outcomes = match self.count(&req.domain, &plans).await {
            Ok(o) => o,
            Err(e) => return Err(self.failed(&req.domain, &e)),
        };
        let mut overall = Code::Ok;
        let mut statuses = Vec::with_capacity(plans.len());
        for (p, outcome) in plans.iter().zip(outcomes) {
            let status = self.descriptor_status(&req.domain, p, outcome);
            if status.code == Code::OverLimit as i32 {
                overall = Code::OverLimit;
            }
            statuses.push(status);
        }
        self.metrics.answered(overall == Code::OverLimit);
        Ok(Response::new(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            ..Default::default()
        }))
    }
}

impl Rls {
    /// The interceptor in front of the service, run on a call's metadata
    /// before its message is read: its place among `--max-in-flight`
    /// (`UNAVAILABLE` when none is free), then its bearer token, so that
    /// neither a caller without a token nor one over the bound can make the
    /// gateway buffer a message. The place and the caller go into the
    /// request's extensions, held until the call is answered.
    pub fn admit(&self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let Ok(permit) = Arc::clone(&self.app.in_flight).try_acquire_owned() else {
            self.app.metrics.shed.inc();
            return Err(self.refuse(
                "error",
                Status::unavailable("busy: too many requests in flight"),
            ));
        };
        request.extensions_mut().insert(InFlight {
            _permit: Arc::new(permit),
        });
        match super::authenticate(&self.app, request.metadata()) {
            Ok(Some(caller)) => {
                request.extensions_mut().insert(caller);
                Ok(request)
            }
            Ok(None) => Ok(request),
            Err(status) => Err(self.refuse("unauthenticated", status)),
        }
    }

    /// The call's place (put there by [`Rls::admit`]), its caller, and its
    /// message once the domain and descriptors are ones to count: theirs
    /// answers an empty domain or descriptor list with `UNKNOWN`.
    fn admitted(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<(InFlight, RateLimitRequest), Status> {
        let Some(in_flight) = request.extensions().get::<InFlight>().cloned() else {
            return Err(self.refuse(
                "error",
                Status::unavailable("busy: too many requests in flight"),
            ));
        };
        let caller = match request.extensions().get::<Caller>() {
            Some(c) => c.clone(),
            None if self.app.tokens.is_none() => Caller::anonymous(),
            None => {
                return Err(self.refuse(
                    "unauthenticated",
                    Status::unauthenticated("authorization: a known bearer token is required"),
                ))
            }
        };
        let req = request.into_inner();
        if req.domain.is_empty() {
            return Err(self.refuse(
                "invalid",
                Status::unknown("rate limit domain must not be empty"),
            ));
        }
        if req.descriptors.is_empty() {
            return Err(self.refuse(
                "invalid",
                Status::unknown("rate limit descriptor list must not be empty"),
            ));
        }
        if !caller.may_use(&req.domain) {
            self.count_refusal(Refusal::WrongDomain);
            return Err(self.refuse(
                "permission_denied",
                Status::permission_denied("authorization: this token may not act on this domain"),
            ));
        }
        if req.descriptors.len() > MAX_DESCRIPTORS {
            return Err(self.refuse(
                "invalid",
                Status::invalid_argument(format!(
                    "descriptors: at most {MAX_DESCRIPTORS}, got {}",
                    req.descriptors.len()
                )),
            ));
        }
        Ok((in_flight, req))
    }

    /// One descriptor's status, its metrics counted: `OVER_LIMIT` when over
    /// and not in shadow mode.
    fn descriptor_status(
        &self,
        domain: &str,
        plan: &Plan<'_>,
        outcome: Option<Outcome>,
    ) -> DescriptorStatus {
        match (plan, outcome) {
            (Plan::Count { limit, hits, .. }, Some(o)) => {
                let rpu = u64::from(limit.requests_per_unit);
                let near = (limit.requests_per_unit as f32 * self.near_limit_ratio).floor() as u64;
                self.metrics.count(
                    &[domain, limit.path.as_str()],
                    *hits,
                    o.before,
                    o.after,
                    if limit.shared.is_some() {
                        u64::from(o.current.requests_per_unit)
                    } else {
                        rpu
                    },
                    near,
                    o.over,
                    limit.shadow_mode,
                );
                let code = if o.over && !limit.shadow_mode {
                    Code::OverLimit
                } else {
                    Code::Ok
                };
                DescriptorStatus {
                    code: code as i32,
                    current_limit: Some(o.current),
                    limit_remaining: u32::try_from(o.remaining).unwrap_or(u32::MAX),
                    duration_until_reset: Some(ProtoDuration {
                        seconds: i64::try_from(o.reset_ms.div_ceil(1000)).unwrap_or(i64::MAX),
                        nanos: 0,
                    }),
                    quota: None,
                }
            }
            (Plan::Unlimited, _) => DescriptorStatus {
                code: Code::Ok as i32,
                limit_remaining: u32::MAX,
                ..Default::default()
            },
            _ => DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            },
        }
    }

    fn refuse(&self, code: &str, status: Status) -> Status {
        self.metrics.requests.with_label_values(&[code]).inc();
        status
    }

    fn count_refusal(&self, refusal: Refusal) {
        self.app
            .metrics
            .auth_failures
            .with_label_values(&[refusal.label()])
            .inc();
    }

    /// Redis failed: counted, logged within the warnings' rate limit,
    /// answered `UNKNOWN` as theirs does.
    fn failed(&self, domain: &str, e: &StoreError) -> Status {
        self.app.metrics.error(e.kind());
        if let Some(suppressed) = self.app.warnings.allow(e.kind()) {
            tracing::warn!(error = %Escaped(e), domain = %Escaped(domain), suppressed, "ShouldRateLimit failed");
        }
        self.refuse("error", Status::unknown(crate::protocol::STORE_UNAVAILABLE))
    }

    /// Counts every planned descriptor in Redis: `None` for the ones with no
    /// count to make.
    async fn count(
        &self,
        domain: &str,
        plans: &[Plan<'_>],
    ) -> Result<Vec<Option<Outcome>>, StoreError> {
        let mut out: Vec<Option<Outcome>> = plans.iter().map(|_| None).collect();
        // The common call, one descriptor counted by `check.lua`: awaited
        // directly, without the two joins below (their futures are moved
        // into vectors and polled through them).
        if let [Plan::Count {
            limit,
            hits,
            entries,
            shared,
        }] = plans
        {
            if counts_a_bucket(limit) {
                let answer = self.check_bucket(domain, limit, *hits, entries, shared);
                place_answer(&mut out, plans, 0, answer.await?);
                return Ok(out);
            }
        }
        let groups = self.fixed_groups(domain, plans);
        // Fixed windows: one script call per slot group.
        let fixed = futures_util::future::join_all(groups.iter().map(|(_, g)| self.eval_fixed(g)));
        // Buckets: one all-or-nothing check per descriptor.
        let buckets =
            futures_util::future::join_all(plans.iter().enumerate().filter_map(|(i, p)| {
                let Plan::Count {
                    limit,
                    hits,
                    entries,
                    shared,
                } = p
                else {
                    return None;
                };
                if !counts_a_bucket(limit) {
                    return None;
                }
                let answer = self.check_bucket(domain, limit, *hits, entries, shared);
                Some(async move { Ok::<_, StoreError>((i, answer.await?)) })
            }));
        let (fixed, buckets) = tokio::join!(fixed, buckets);
        for ((_, g), reply) in groups.iter().zip(fixed) {
            place_fixed(&mut out, plans, g, &reply?)?;
        }
        for r in buckets {
            let (i, answer) = r?;
            place_answer(&mut out, plans, i, answer);
        }
        Ok(out)
    }

    /// The fixed-window descriptors' keys, grouped by cluster slot (one group
    /// on a single Redis).
    fn fixed_groups(&self, domain: &str, plans: &[Plan<'_>]) -> Vec<(Option<Slot>, Vec<FixedKey>)> {
        let mut groups: Vec<(Option<Slot>, Vec<FixedKey>)> = Vec::new();
        for (i, p) in plans.iter().enumerate() {
            let Plan::Count {
                limit,
                hits,
                entries,
                ..
            } = p
            else {
                continue;
            };
            if counts_a_bucket(limit) {
                continue;
            }
            let unit = limit.unit.unwrap_or(Unit::Second).seconds();
            let base = format!(
                "{}{{{}|{}}}|fixed_window|{unit}",
                self.prefix,
                keys::escape(domain),
                entries
            );
            let slot = self
                .app
                .limiter
                .store()
                .is_cluster()
                .then(|| Slot::for_key(base.as_bytes()));
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, g)) => g.push((i, base, unit, *hits)),
                None => groups.push((slot, vec![(i, base, unit, *hits)])),
            }
        }
        groups
    }

    /// One `fixed_window.lua` call over one slot group, at the limiter's clock.
    async fn eval_fixed(&self, group: &[FixedKey]) -> Result<Vec<i64>, StoreError> {
        let keys: Vec<String> = group.iter().map(|(_, k, _, _)| k.clone()).collect();
        let mut args = Vec::with_capacity(1 + 2 * group.len());
        args.push(crate::clock::script_arg(self.app.limiter.clock()));
        for (_, _, unit, hits) in group {
            args.push(unit.to_string());
            args.push(hits.to_string());
        }
        self.app
            .limiter
            .store()
            .eval::<Vec<i64>>(script::fixed_window(), &keys, &args, "fixed_window")
            .await
    }

    /// A token-bucket, sliding-window or shared descriptor's check; `Err`
    /// with the limits when its hits cost more than the rule lets one request.
    async fn check_bucket(
        &self,
        domain: &str,
        limit: &RateLimit,
        hits: u64,
        entries: &str,
        values: &[&str],
    ) -> Result<Result<CheckResponse, Vec<Limit>>, StoreError> {
        match self.resolve(domain, limit, hits, entries, values)? {
            Resolution::Check(resolved) => Ok(Ok(self.app.limiter.check(&resolved).await?)),
            Resolution::TooCostly(limits) => Ok(Err(limits)),
        }
    }

    /// The one-bucket check a token-bucket, sliding-window or shared
    /// descriptor makes. A shared one is the policy's bucket; a policy that
    /// lacks it is a configuration error, answered as a Redis failure is
    /// (logged with the reason), so that `failure_mode_deny` decides.
    fn resolve(
        &self,
        domain: &str,
        limit: &RateLimit,
        hits: u64,
        entries: &str,
        values: &[&str],
    ) -> Result<Resolution, StoreError> {
        if let Some(shared) = &limit.shared {
            let bucket = self
                .app
                .policy
                .current()
                .shared_bucket(&shared.domain, &shared.rule, values, hits)
                .map_err(|e| StoreError::Reply(format!("rls_config shared: {e}")))?;
            if hits > bucket.max_cost {
                return Ok(Resolution::TooCostly(bucket.bucket.limits));
            }
            return Ok(Resolution::Check(Resolved {
                domain: shared.domain.clone(),
                buckets: vec![bucket.bucket],
                quotas: vec![],
                reservation: None,
            }));
        }
        let unit = limit.unit.unwrap_or(Unit::Second);
        // `check` counts unshared fixed windows itself; only exact ones come here.
        let Some(algorithm) = limit.algorithm.exact() else {
            return Err(StoreError::Reply(format!(
                "rls_config {domain}: a fixed_window limit has no gateway bucket"
            )));
        };
        // A domain of its own (`|rls` cannot end an escaped policy domain's
        // hash tag part the same way), so native buckets never meet a filter's.
        Ok(Resolution::Check(Resolved {
            domain: format!("{domain}|rls"),
            buckets: vec![ResolvedBucket {
                key: entries.to_string(),
                tag: entries.to_string(),
                cost: hits,
                limits: vec![Limit {
                    requests: u64::from(limit.requests_per_unit),
                    window_ms: unit.seconds().saturating_mul(1000),
                    algorithm,
                    in_flight: false,
                }],
                debt: 0,
                ..ResolvedBucket::default()
            }],
            quotas: vec![],
            reservation: None,
        }))
    }
}

/// Puts the answer of shared descriptor `i`, whose hits pass what one
/// request may cost its rule, into `out[i]`: over, nothing left, the rule's
/// smallest limit as the current one. Its hits count as over the limit.
/// Whether a descriptor is counted by `check.lua` (token bucket, sliding
/// window, shared) rather than `fixed_window.lua`.
fn counts_a_bucket(limit: &RateLimit) -> bool {
    limit.algorithm != RlsAlgorithm::FixedWindow || limit.shared.is_some()
}

/// A bucket check's answer, or its refusal as too costly, at descriptor `i`.
fn place_answer(
    out: &mut [Option<Outcome>],
    plans: &[Plan<'_>],
    i: usize,
    answer: Result<CheckResponse, Vec<Limit>>,
) {
    match answer {
        Ok(answer) => place_bucket(out, plans, i, &answer),
        Err(limits) => place_too_costly(out, plans, i, &limits),
    }
}

/// One `fixed_window.lua` reply's counts at their descriptors: over when the
/// count after the hits is above the limit (theirs).
fn place_fixed(
    out: &mut [Option<Outcome>],
    plans: &[Plan<'_>],
    group: &[FixedKey],
    reply: &[i64],
) -> Result<(), StoreError> {
    if reply.len() != 1 + 2 * group.len() {
        return Err(StoreError::Reply(format!(
            "fixed_window script answered {} integers for {} keys",
            reply.len(),
            group.len()
        )));
    }
    for ((i, _, _, hits), pair) in group
        .iter()
        .zip(reply.get(1..).unwrap_or_default().chunks_exact(2))
    {
        let [count, reset] = pair else { continue };
        let Some(Plan::Count { limit, .. }) = plans.get(*i) else {
            continue;
        };
        let after = u64::try_from(*count).unwrap_or(0);
        let rpu = u64::from(limit.requests_per_unit);
        let over = after > rpu;
        if let Some(slot) = out.get_mut(*i) {
            *slot = Some(Outcome {
                over,
                remaining: if over { 0 } else { rpu - after },
                before: after.saturating_sub(*hits),
                after,
                reset_ms: u64::try_from(*reset).unwrap_or(0),
                current: proto_limit(limit, rpu, limit.unit),
            });
        }
    }
    Ok(())
}

fn place_too_costly(out: &mut [Option<Outcome>], plans: &[Plan<'_>], i: usize, limits: &[Limit]) {
    let Some(Plan::Count { limit, hits, .. }) = plans.get(i) else {
        return;
    };
    let Some(binding) = limits.iter().min_by_key(|l| l.requests) else {
        return;
    };
    if let Some(slot) = out.get_mut(i) {
        *slot = Some(Outcome {
            over: true,
            remaining: 0,
            before: binding.requests,
            after: binding.requests.saturating_add(*hits),
            // No wait lets these hits through.
            reset_ms: 0,
            current: proto_limit(
                limit,
                binding.requests,
                Unit::of_window_ms(binding.window_ms),
            ),
        });
    }
}

fn proto_limit(limit: &RateLimit, requests: u64, unit: Option<Unit>) -> ProtoLimit {
    ProtoLimit {
        name: limit.name.clone().unwrap_or_default(),
        requests_per_unit: u32::try_from(requests).unwrap_or(u32::MAX),
        unit: unit.map_or(0, Unit::proto),
    }
}

/// Puts the answer of descriptor `i`'s one-bucket check into `out[i]`: the
/// binding limit (the fewest remaining) gives the outcome.
fn place_bucket(out: &mut [Option<Outcome>], plans: &[Plan<'_>], i: usize, answer: &CheckResponse) {
    let Some(Plan::Count { limit, hits, .. }) = plans.get(i) else {
        return;
    };
    let results = answer
        .buckets
        .first()
        .map(|b| b.limits.as_slice())
        .unwrap_or_default();
    let Some(binding) = results.iter().min_by_key(|l| l.remaining) else {
        return;
    };
    let over = !answer.allowed;
    let reset_ms = if over {
        results
            .iter()
            .filter(|l| !l.allowed)
            .map(|l| l.retry_after_ms)
            .max()
            .unwrap_or(binding.retry_after_ms)
    } else {
        binding.reset_ms
    };
    let requests = binding.requests;
    let unit = match &limit.shared {
        Some(_) => Unit::of_window_ms(binding.window_ms),
        None => limit.unit,
    };
    // What was used of the binding limit, after and before the hits.
    let after = requests.saturating_sub(binding.remaining);
    let before = if over {
        after
    } else {
        after.saturating_sub(*hits)
    };
    let after = if over {
        after.saturating_add(*hits)
    } else {
        after
    };
    if let Some(slot) = out.get_mut(i) {
        *slot = Some(Outcome {
            over,
            remaining: if over { 0 } else { binding.remaining },
            before,
            after,
            reset_ms,
            current: proto_limit(limit, requests, unit),
        });
    }
}

/// The hits of descriptor `d`: its own `hits_addend` when set (0 allowed:
/// look without counting), else the request's, else 1 (theirs).
fn hits_of(req: &RateLimitRequest, d: &RateLimitDescriptor) -> u64 {
    match &d.hits_addend {
        Some(h) => h.value,
        None => u64::from(req.hits_addend.max(1)),
    }
}

/// The entries as a key part: `key=value|key=value` (escaped; a wildcard
/// with `share_threshold` gives its pattern for the value), hashed past
/// [`MAX_KEY_ENTRIES_BYTES`].
fn entries_key(d: &RateLimitDescriptor, shared_values: &[Option<&str>]) -> String {
    use ratelimit_config::key::bounded;
    let mut s = String::new();
    for (i, e) in d.entries.iter().enumerate() {
        if i > 0 {
            s.push('|');
        }
        let value = shared_values
            .get(i)
            .copied()
            .flatten()
            .unwrap_or(e.value.as_str());
        s.push_str(&keys::escape(&e.key).replace('=', "%3D"));
        s.push('=');
        s.push_str(&keys::escape(value));
    }
    bounded(s, "entries")
}

/// A found limit, with its entries key and shared values (see [`Plan::Count`]).
type FoundLimit<'a> = (std::borrow::Cow<'a, RateLimit>, String, Vec<&'a str>);

/// Finds every descriptor's limit and drops the replaced ones; the error is
/// an `INVALID_ARGUMENT` message naming the field. A descriptor's own `limit`
/// applies when `allow_overrides`, else it is ignored.
fn plan<'a>(
    config: &'a RlsConfig,
    req: &'a RateLimitRequest,
    allow_overrides: bool,
) -> Result<Vec<Plan<'a>>, String> {
    let known = config.has_domain(&req.domain);
    let mut found: Vec<Option<FoundLimit<'a>>> = Vec::with_capacity(req.descriptors.len());
    for (i, d) in req.descriptors.iter().enumerate() {
        let hits = hits_of(req, d);
        if hits > MAX_EXACT {
            return Err(format!(
                "descriptors[{i}].hits_addend: must be at most 2^53, got {hits}"
            ));
        }
        let limit = match (&d.limit, known && allow_overrides) {
            (Some(o), true) => Some(override_limit(i, d, o)?),
            _ => configured_limit(config, &req.domain, i, d)?,
        };
        found.push(limit);
    }
    let names: std::collections::HashSet<String> =
        replaced(found.iter().flatten().map(|(l, _, _)| l.as_ref()))
            .into_iter()
            .map(str::to_string)
            .collect();
    Ok(found
        .into_iter()
        .zip(&req.descriptors)
        .map(|(f, d)| match f {
            None => Plan::None,
            Some((l, _, _)) if l.unlimited => Plan::Unlimited,
            Some((l, _, _)) if l.name.as_ref().is_some_and(|n| names.contains(n)) => Plan::None,
            Some((limit, entries, shared)) => Plan::Count {
                hits: hits_of(req, d),
                limit,
                entries,
                shared,
            },
        })
        .collect())
}

/// A descriptor's own limit from Envoy (theirs): it applies to a known
/// domain only, as a fixed window without shadow mode. Its metrics label is
/// one fixed value: the request's keys are the caller's, unbounded.
fn override_limit<'a>(
    i: usize,
    d: &RateLimitDescriptor,
    o: &RateLimitOverride,
) -> Result<FoundLimit<'a>, String> {
    let unit = Unit::from_proto(o.unit)
        .ok_or_else(|| format!("descriptors[{i}].limit.unit: unknown unit {}", o.unit))?;
    let limit = RateLimit {
        requests_per_unit: o.requests_per_unit,
        unit: Some(unit),
        unlimited: false,
        name: None,
        replaces: vec![],
        shadow_mode: false,
        algorithm: RlsAlgorithm::FixedWindow,
        shared: None,
        path: OVERRIDE_DESCRIPTOR.to_string(),
    };
    Ok((
        std::borrow::Cow::Owned(limit),
        entries_key(d, &[]),
        Vec::new(),
    ))
}

/// The configuration's limit for descriptor `i`, if any: with the values
/// its shared key is built from (unhashed, each from its own parsed entry),
/// or with the key of its entries.
fn configured_limit<'a>(
    config: &'a RlsConfig,
    domain: &str,
    i: usize,
    d: &'a RateLimitDescriptor,
) -> Result<Option<FoundLimit<'a>>, String> {
    let pairs: Vec<(&str, &str)> = d
        .entries
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_str()))
        .collect();
    let Some(f) = config.find(domain, &pairs) else {
        return Ok(None);
    };
    let Some(shared) = &f.limit.shared else {
        let key = entries_key(d, &f.shared_values);
        return Ok(Some((std::borrow::Cow::Borrowed(f.limit), key, Vec::new())));
    };
    let mut values = Vec::with_capacity(shared.positions.len());
    for (j, p) in shared.positions.iter().enumerate() {
        let Some((_, v)) = pairs.get(*p) else {
            return Err(format!(
                "descriptors[{i}]: has no entry `{}` at position {p}",
                shared.entries.get(j).map_or("", String::as_str)
            ));
        };
        values.push(*v);
    }
    Ok(Some((
        std::borrow::Cow::Borrowed(f.limit),
        String::new(),
        values,
    )))
}
