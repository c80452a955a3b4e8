//! The gateway alone: checks/s of `ratelimit-gateway` (wrk, `POST
//! /v1/check`) against `redis-benchmark` running `EVALSHA` of the same Lua
//! script (`gateway/src/check.lua`, loaded with `SCRIPT LOAD`) on the same
//! Redis, with the same number of connections.

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use testkit::redis::Redis;
use testkit::workspace_root;

/// What one `redis-benchmark` run reported.
#[derive(Debug, Clone, Default)]
pub struct BenchResult {
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub requests: u64,
}

/// Client keys the load cycles through (as the wrk scripts).
pub const CLIENTS: u32 = 1000;

/// Loads `check.lua`, behind the `common.lua` helpers as the gateway sends it
/// (`gateway/src/script.rs`), into `redis` and returns its SHA1.
pub fn load_script(redis: &Redis) -> Result<String> {
    let mut source = String::new();
    for file in ["common.lua", "check.lua"] {
        let path = workspace_root().join("gateway/src").join(file);
        source += &std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
    }
    let sha = redis.cli(&["SCRIPT", "LOAD", &source])?;
    if sha.len() != 40 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("SCRIPT LOAD answered {sha:?}");
    }
    Ok(sha)
}

/// The `EVALSHA` command line of one check, as the gateway sends it for the
/// wrk script's request (`gateway/src/script.rs`, `check_args`, with d.json's
/// limit from the policy): one limit key
/// `rl:{<domain>|<tag>}|<key>|<limit index>|<algorithm>|<requests>|<window_ms>`;
/// ARGV: charge "1", no time override "", 1 limit, then the limit's
/// algorithm, requests, window_ms and cost. `client` stands for the client
/// key (`c__rand_int__` for redis-benchmark).
pub fn evalsha_args(sha: &str, client: &str) -> Vec<String> {
    [
        "EVALSHA",
        sha,
        "1",
        &format!("rl:{{bench|c={client}}}|global/c={client}|0|token_bucket|1000000000|1000"),
        "1",
        "",
        "1",
        "token_bucket",
        "1000000000",
        "1000",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Checks that one `EVALSHA` with these arguments is allowed.
pub fn check_once(redis: &Redis, sha: &str) -> Result<()> {
    let args = evalsha_args(sha, "c0");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let reply = redis.cli(&args)?;
    if reply.lines().next() != Some("1") {
        bail!("EVALSHA of check.lua did not allow: {reply:?}");
    }
    Ok(())
}

/// Runs `redis-benchmark` with `requests` EVALSHA calls over `connections`
/// connections, keys drawn from [`CLIENTS`] (`-r`), no pipelining.
pub fn redis_benchmark(
    redis: &Redis,
    sha: &str,
    connections: u32,
    requests: u64,
) -> Result<BenchResult> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &redis.port().to_string()])
        .args(["-c", &connections.to_string()])
        .args(["-n", &requests.to_string()])
        .args(["-r", &CLIENTS.to_string()])
        .arg("--csv")
        .args(evalsha_args(sha, "c__rand_int__"))
        .stdin(Stdio::null())
        .output()
        .context("running redis-benchmark (Debian package redis-tools)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "redis-benchmark failed ({}):\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut r =
        parse_csv(&text).with_context(|| format!("reading redis-benchmark's CSV:\n{text}"))?;
    r.requests = requests;
    Ok(r)
}

/// Parses `--csv` output: a header line, then
/// `"<test>","rps","avg","min","p50","p95","p99","max"` (the test name may
/// hold commas, so the numbers are read from the right).
fn parse_csv(text: &str) -> Result<BenchResult> {
    let line = text
        .lines()
        .rfind(|l| l.starts_with('"') && !l.starts_with("\"test\""))
        .context("no result line")?;
    let fields: Vec<f64> = line
        .rsplitn(8, ',')
        .take(7)
        .map(|f| f.trim().trim_matches('"').parse::<f64>())
        .collect::<Result<_, _>>()
        .context("non-numeric field")?;
    // Reversed: max, p99, p95, p50, min, avg, rps.
    let [_max, p99, _p95, p50, _min, _avg, rps] = fields.as_slice() else {
        bail!("expected 7 numbers, got {}", fields.len());
    };
    Ok(BenchResult {
        rps: *rps,
        p50_ms: *p50,
        p99_ms: *p99,
        requests: 0,
    })
}

/// `ShouldRateLimit` calls/s on the gateway's `--grpc-listen` at
/// 127.0.0.1:`port`: `connections` callers, each on its own HTTP/2
/// connection, one call at a time, one descriptor `(tb_client, c<k>)` in
/// domain `bench-native` (a token bucket: `check.lua`, as the other
/// figures), cycling through [`CLIENTS`], for `seconds`. Calls answered with
/// a gRPC error count in `non_2xx`.
pub fn grpc_load(port: u16, connections: u32, seconds: u32) -> Result<crate::wrk::WrkResult> {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use std::time::{Duration, Instant};

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the gRPC load's runtime")?;
    rt.block_on(async move {
        let deadline = Instant::now() + Duration::from_secs(seconds.into());
        let started = Instant::now();
        let mut tasks = Vec::new();
        for c in 0..connections {
            let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
                .await
                .context("connecting to the gateway's gRPC port")?;
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0u64;
                let mut k = c;
                while Instant::now() < deadline {
                    k = (k + connections) % CLIENTS;
                    let req = RateLimitRequest {
                        domain: "bench-native".to_string(),
                        descriptors: vec![RateLimitDescriptor {
                            entries: vec![Entry {
                                key: "tb_client".to_string(),
                                value: format!("c{k}"),
                            }],
                            ..Default::default()
                        }],
                        hits_addend: 0,
                    };
                    let t = Instant::now();
                    if client.should_rate_limit(req).await.is_err() {
                        errors += 1;
                    }
                    latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                (latencies, errors)
            }));
        }
        let mut all = Vec::new();
        let mut errors = 0;
        for t in tasks {
            let (l, e) = t.await.context("a gRPC load task")?;
            all.extend(l);
            errors += e;
        }
        let elapsed = started.elapsed().as_secs_f64();
        all.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0.0)
        };
        Ok(crate::wrk::WrkResult {
            requests: all.len() as u64,
            seconds: elapsed,
            rps: all.len() as f64 / elapsed.max(1e-9),
            p50_ms: pct(0.50),
            p99_ms: pct(0.99),
            non_2xx: errors,
            socket_errors: 0,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_benchmark_csv() {
        let text = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
            \"EVALSHA abc 1 rl:{bench|c__rand_int__}|x 1  1 token_bucket 1000000000 1000 1\",\"10608.95\",\"2.743\",\"0.216\",\"1.951\",\"6.687\",\"11.287\",\"62.079\"\n";
        let r = parse_csv(text).unwrap();
        assert!((r.rps - 10608.95).abs() < 1e-9);
        assert!((r.p50_ms - 1.951).abs() < 1e-9);
        assert!((r.p99_ms - 11.287).abs() < 1e-9);
    }

    #[test]
    fn the_key_has_the_gateways_layout() {
        let a = evalsha_args("s", "c7");
        assert_eq!(
            a[3],
            "rl:{bench|c=c7}|global/c=c7|0|token_bucket|1000000000|1000"
        );
        assert_eq!(a.len(), 11);
    }
}
