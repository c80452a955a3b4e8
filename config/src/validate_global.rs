//! Validation of the gateway settings: `global`, its lease mode, and the
//! bounds that keep the gateway's Lua arithmetic exact.

use super::syntax::*;
use super::*;

/// Largest `requests × per` in milliseconds of a global limit: the gateway's
/// Lua arithmetic is exact only below 2^53.
pub const MAX_GLOBAL_PRODUCT: u64 = super::bounds::MAX_EXACT;

impl Config {
    pub(super) fn validate_global(&self) -> Result<(), ConfigError> {
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
        check_grpc_service(g)?;
        check_path("global.path", &g.path)?;
        check_path("global.settle_path", &g.settle_path)?;
        check_path("global.batch_path", &g.batch_path)?;
        validate_batching(g)?;
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
        if g.deny_cache > 1 << 20 {
            return Err(ConfigError::field(
                "global.deny_cache",
                "must be between 0 (off) and 1048576",
            ));
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

/// `cluster` and `authority` fit the `GrpcService` a gRPC callout names
/// ([`Global::grpc_service`]).
fn check_grpc_service(g: &Global) -> Result<(), ConfigError> {
    let names = g.cluster.len() + g.authority.len();
    if g.transport == Transport::Grpc && names > MAX_GRPC_SERVICE_NAMES {
        return Err(ConfigError::field(
            "global.cluster",
            format!(
                "with \"transport\": \"grpc\", cluster and authority must be at most {MAX_GRPC_SERVICE_NAMES} bytes together ({names})"
            ),
        ));
    }
    Ok(())
}

/// `coalesce_us` and `max_batch`: a check never waits longer than a
/// second for its batch, and a batch fits what the gateway accepts.
fn validate_batching(g: &Global) -> Result<(), ConfigError> {
    if g.coalesce_us > 1_000_000 {
        return Err(ConfigError::field(
            "global.coalesce_us",
            "must be between 0 (off) and 1000000",
        ));
    }
    if !(1..=super::bounds::MAX_BATCH as u64).contains(&g.max_batch) {
        return Err(ConfigError::field(
            "global.max_batch",
            format!("must be between 1 and {}", super::bounds::MAX_BATCH),
        ));
    }
    Ok(())
}
