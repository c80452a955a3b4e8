//! What authentication and the policy lookup cost per check, isolated: the
//! gateway cannot serve without a policy, so a gateway "without the lookup"
//! cannot be loaded beside one with it. The gateway's own code
//! (`ratelimit_gateway::auth`, `ratelimit_gateway::policy`) runs here in
//! process on the wrk script's requests, with the bench gateways' policy and
//! token file, and its time per check is held against the CPU time the
//! loaded gateway spent per check (from /proc).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use ratelimit_gateway::auth::Tokens;
use ratelimit_gateway::policy::{self, Policy};
use ratelimit_gateway::protocol::{parse_check, CheckRequest};
use ratelimit_gateway::reload::Source;

/// Nanoseconds per check of each step, in process (one thread, warm caches).
#[derive(Debug, Clone, Copy, Default)]
pub struct LookupCost {
    /// `Tokens::authenticate` of the `authorization` header and the domain check.
    pub auth_ns: f64,
    /// `Policy::resolve_check`: domain, rule, variant, key and cost against
    /// the policy, and the resolved request built.
    pub policy_ns: f64,
}

impl LookupCost {
    /// Both steps.
    pub fn total_ns(&self) -> f64 {
        self.auth_ns + self.policy_ns
    }
}

fn sources(texts: &[&str], name: &str) -> Vec<Source> {
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| Source {
            path: PathBuf::from(format!("{name}-{i}")),
            bytes: t.as_bytes().to_vec(),
        })
        .collect()
}

/// The body `bench/gateway.lua` sends for client `k`.
fn body(k: u32) -> String {
    format!(
        r#"{{"version":2,"domain":"bench","buckets":[{{"rule":"global","key":"global/c=c{k}","tag":"c=c{k}","variant":"default","cost":1}}]}}"#
    )
}

/// Runs `step` over `requests` in turn for about `time`; nanoseconds per call.
fn time_per_call(
    requests: &[CheckRequest],
    time: Duration,
    mut step: impl FnMut(&CheckRequest),
) -> f64 {
    let mut calls = 0u64;
    let started = Instant::now();
    while started.elapsed() < time {
        for r in requests {
            step(r);
        }
        calls += requests.len() as u64;
    }
    started.elapsed().as_nanos() as f64 / calls.max(1) as f64
}

/// Times authentication (the token file `tokens`, the header
/// `Bearer <token>`) and the policy lookup (the plugin configurations
/// `policies`) over the wrk script's `clients` requests, `time` each.
pub fn measure(
    policies: &[&str],
    tokens: &str,
    token: &str,
    clients: u32,
    time: Duration,
) -> Result<LookupCost> {
    let policy: Policy = policy::parse(&sources(policies, "policy")).map_err(|e| anyhow!(e))?;
    let tokens = Tokens::parse(&sources(&[tokens], "tokens")).map_err(|e| anyhow!(e))?;
    let header = format!("Bearer {token}");
    let requests = (0..clients)
        .map(|k| parse_check(body(k).as_bytes()).map_err(|e| anyhow!(e)))
        .collect::<Result<Vec<_>>>()?;
    for r in &requests {
        let caller = tokens
            .authenticate(Some(header.as_bytes()))
            .map_err(|e| anyhow!("the bench's token is refused: {e:?}"))?;
        if !caller.may_use(&r.domain) {
            return Err(anyhow!("the bench's token may not use domain {}", r.domain));
        }
        policy.resolve_check(r).map_err(|e| anyhow!(e))?;
    }
    let auth_ns = time_per_call(&requests, time, |r| {
        let caller = tokens.authenticate(Some(black_box(header.as_bytes())));
        black_box(caller.is_ok_and(|c| c.may_use(&r.domain)));
    });
    let policy_ns = time_per_call(&requests, time, |r| {
        black_box(policy.resolve_check(black_box(r)).is_ok());
    });
    Ok(LookupCost { auth_ns, policy_ns })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_requests_pass_auth_and_policy() {
        let c = measure(
            &[crate::D_JSON, crate::E_JSON, crate::DF_JSON],
            "bench bench-caller-token-0001\nbench bench-caller-token-0002\n",
            "bench-caller-token-0002",
            10,
            Duration::from_millis(5),
        )
        .unwrap();
        assert!(c.auth_ns > 0.0 && c.policy_ns > 0.0, "{c:?}");
    }
}
