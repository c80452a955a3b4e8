//! The gateway alone: checks/s of `ratelimit-gateway` (wrk, `POST
//! /v1/check`) against `redis-benchmark` running `EVALSHA` of the same Lua
//! script (the gateway's `CHECK_LUA`, loaded with `SCRIPT LOAD`) on the same
//! Redis, with the same number of connections; and the same for batches of
//! [`BATCH_CHECKS`] checks (`POST /v3/check` against `EVALSHA` of the
//! gateway's `BATCH_LUA` with the same checks).

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use ratelimit_gateway::clock::RedisTime;
use ratelimit_gateway::flags::DEFAULT_KEY_BUDGET;
use ratelimit_gateway::protocol::{Algorithm, Limit};
use ratelimit_gateway::redis::keys::{self, Group, LimitKey};
use ratelimit_gateway::redis::script::{self, Mode};
use testkit::redis::Redis;

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

/// Checks per `POST /v3/check` call (and per `EVALSHA` of the batch
/// script) in the batch figures: `gateway_batch.lua` sends as many.
pub const BATCH_CHECKS: u32 = 16;

/// Loads the gateway's own check script (`ratelimit_gateway::redis::script`:
/// `check.lua` behind the `common.lua` helpers, as the gateway sends it)
/// into `redis` and returns its SHA1.
pub fn load_script(redis: &Redis) -> Result<String> {
    load(redis, script::CHECK_LUA)
}

/// Loads the gateway's batch script (`BATCH_LUA`) into `redis`; its SHA1.
pub fn load_batch_script(redis: &Redis) -> Result<String> {
    load(redis, script::BATCH_LUA)
}

fn load(redis: &Redis, source: &str) -> Result<String> {
    let sha = redis.cli(&["SCRIPT", "LOAD", source])?;
    if sha.len() != 40 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("SCRIPT LOAD answered {sha:?}");
    }
    Ok(sha)
}

/// The `EVALSHA` command line of one check as the gateway sends it for the
/// wrk script's request on a single Redis: keys and arguments from the
/// gateway's own `keys::redis_key`, `keys::live_ledger` and
/// `script::check_args`, with d.json's limit from the policy and the
/// default key budget. `client` stands for the client key
/// (`c__rand_int__` for redis-benchmark).
pub fn evalsha_args(sha: &str, client: &str) -> Vec<String> {
    let (keys, args) = check_call(client);
    command_line(sha, keys, args)
}

/// The `EVALSHA` command line of one batch of [`BATCH_CHECKS`] checks as
/// the gateway sends it: each check as [`evalsha_args`]'s, of client
/// `client` (each `c__rand_int__` drawn apart by redis-benchmark), laid
/// out by the gateway's own `script::batch_args`.
pub fn batch_evalsha_args(sha: &str, client: &str) -> Vec<String> {
    let checks: Vec<_> = (0..BATCH_CHECKS).map(|_| check_call(client)).collect();
    let (keys, args) = script::batch_args(&checks);
    command_line(sha, keys, args)
}

fn command_line(sha: &str, keys: Vec<String>, args: Vec<String>) -> Vec<String> {
    let mut line = vec![
        "EVALSHA".to_string(),
        sha.to_string(),
        keys.len().to_string(),
    ];
    line.extend(keys);
    line.extend(args);
    line
}

/// `check.lua`'s keys and arguments for one check of `client`.
fn check_call(client: &str) -> (Vec<String>, Vec<String>) {
    let spec = Limit {
        requests: 1_000_000_000,
        window_ms: 1000,
        algorithm: Algorithm::TokenBucket,
        in_flight: false,
    };
    let tag = format!("c={client}");
    let key = keys::redis_key(PREFIX, DOMAIN, &tag, &format!("global/{tag}"), 0, &spec);
    let group = Group {
        limits: vec![LimitKey {
            bucket: 0,
            limit: 0,
            key,
            spec,
            cost: 1,
            debt: 0,
            watched: false,
            graduated: None,
        }],
        quotas: vec![],
    };
    let ledger = keys::live_ledger(PREFIX, DOMAIN);
    script::check_args(
        &group,
        Mode::Charge,
        &RedisTime,
        (&ledger, DEFAULT_KEY_BUDGET),
        None,
        0.0,
    )
}

/// The gateway's default key prefix and the bench policy's domain (d.json).
const PREFIX: &str = "rl:";
const DOMAIN: &str = "bench";

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

/// Checks that one `EVALSHA` of the batch script allows every check: one
/// reply per check, each starting with 1.
pub fn check_batch_once(redis: &Redis, sha: &str) -> Result<()> {
    let args = batch_evalsha_args(sha, "c0");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let reply = redis.cli(&args)?;
    // redis-cli prints nested replies one integer a line: each check's
    // reply is `1`, the time, then `1` and three numbers per limit.
    let lines: Vec<&str> = reply.lines().collect();
    let allowed = lines.chunks(6).filter(|c| c.first() == Some(&"1")).count();
    if lines.len() != 6 * BATCH_CHECKS as usize || allowed != BATCH_CHECKS as usize {
        bail!("EVALSHA of the batch script did not allow every check: {reply:?}");
    }
    Ok(())
}

/// Runs `redis-benchmark` with `requests` calls of `line` ([`evalsha_args`]
/// or [`batch_evalsha_args`] of client `c__rand_int__`: each placeholder
/// drawn apart from [`CLIENTS`] keys, `-r`) over `connections` connections,
/// no pipelining.
pub fn redis_benchmark(
    redis: &Redis,
    line: Vec<String>,
    connections: u32,
    requests: u64,
) -> Result<BenchResult> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &redis.port().to_string()])
        .args(["-c", &connections.to_string()])
        .args(["-n", &requests.to_string()])
        .args(["-r", &CLIENTS.to_string()])
        .arg("--csv")
        .args(line)
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

/// `h2load` processes of the gRPC load: each posts one client's body, so
/// the load spreads over this many client keys (h2load sends one body per
/// run).
pub const GRPC_PROCESSES: u32 = 4;

/// One gRPC load run, and what it cost.
#[derive(Debug, Clone, Default)]
pub struct GrpcRun {
    /// Calls answered (HTTP 2xx and, by the gateway's counters, gRPC OK).
    pub result: crate::wrk::WrkResult,
    /// CPU seconds of the `h2load` processes.
    pub generator_cpu_s: f64,
    /// CPU seconds of the gateway over the same run.
    pub gateway_cpu_s: f64,
}

/// The body of one `ShouldRateLimit` call as it goes on the wire: gRPC's
/// 5-byte frame header (not compressed, big-endian length), then the
/// `RateLimitRequest` with one descriptor `(tb_client, c<client>)` in
/// domain `bench-native`.
pub fn grpc_body(client: u32) -> Vec<u8> {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use prost::Message;

    let message = RateLimitRequest {
        domain: "bench-native".to_string(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "tb_client".to_string(),
                value: format!("c{client}"),
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    }
    .encode_to_vec();
    let mut body = Vec::with_capacity(5 + message.len());
    body.push(0);
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(&message);
    body
}

/// CPU seconds of this process's children that have been waited for.
fn children_cpu_seconds() -> f64 {
    let me = std::process::id();
    crate::machine::process_cpu_seconds(me, true) - crate::machine::process_cpu_seconds(me, false)
}

/// `ShouldRateLimit` calls/s on `gateway`'s `--grpc-listen` at
/// 127.0.0.1:`port`, for `seconds`, loaded by `h2load` (Debian package
/// `nghttp2-client`): [`GRPC_PROCESSES`] processes, each on its own
/// HTTP/2 connection with `connections / GRPC_PROCESSES` calls in flight
/// (so `connections` calls in flight in all, as wrk and redis-benchmark
/// have; Envoy's native filter also multiplexes its calls over one
/// connection per worker), each posting [`grpc_body`] of its own client (a
/// token bucket: `check.lua`, as the other figures). h2load sees HTTP
/// statuses only, not the `grpc-status` trailer, so the gateway's own
/// counter of answers (`ratelimit_gateway_rls_requests_total{code}`) is
/// read before and after: any answer but `ok` fails the run. Per-call
/// latencies come from h2load's `--log-file`s, in `dir`.
pub fn grpc_load(
    gateway: &testkit::gateway::Gateway,
    port: u16,
    connections: u32,
    seconds: u32,
    dir: &std::path::Path,
) -> Result<GrpcRun> {
    const ANSWERS: &str = "ratelimit_gateway_rls_requests_total";
    const OK: &str = "ratelimit_gateway_rls_requests_total{code=\"ok\"}";
    let answers = || -> Result<(f64, f64)> {
        let page = gateway.metrics()?;
        Ok((
            testkit::prometheus_value(&page, ANSWERS).unwrap_or(0.0),
            gateway.metric(OK)?.unwrap_or(0.0),
        ))
    };
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let processes = GRPC_PROCESSES.min(connections.max(1));
    let streams = (connections / processes).max(1);
    let url = format!(
        "http://127.0.0.1:{port}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    );
    let (all_before, ok_before) = answers()?;
    let cpu_before = children_cpu_seconds();
    let gateway_pid = gateway.pid().unwrap_or(0);
    let gateway_before = crate::machine::process_cpu_seconds(gateway_pid, false);
    let mut children = Vec::new();
    for p in 0..processes {
        let body = dir.join(format!("body-{p}.bin"));
        std::fs::write(&body, grpc_body(p))
            .with_context(|| format!("writing {}", body.display()))?;
        let log = dir.join(format!("h2load-{p}.log"));
        let child = Command::new("h2load")
            .args(["-c", "1", "-m", &streams.to_string()])
            .args(["-D", &seconds.to_string()])
            .arg("-d")
            .arg(&body)
            .arg("--log-file")
            .arg(&log)
            .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
            .arg(&url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running h2load (Debian package nghttp2-client; `make bench` installs it)")?;
        children.push((child, log));
    }
    let mut result = crate::wrk::WrkResult::default();
    let mut latencies = Vec::new();
    for (child, log) in children {
        let out = child.wait_with_output().context("waiting for h2load")?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "h2load failed ({}):\n{text}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let run =
            parse_h2load(&text).with_context(|| format!("reading h2load's report:\n{text}"))?;
        result.requests += run.requests;
        // The processes run side by side for the same time.
        result.rps += run.rps;
        result.seconds = result.seconds.max(run.seconds);
        result.non_2xx += run.non_2xx;
        result.socket_errors += run.socket_errors;
        let log_text =
            std::fs::read_to_string(&log).with_context(|| format!("reading {}", log.display()))?;
        // start (µs since the epoch), HTTP status, µs to the end of the response.
        latencies.extend(
            log_text
                .lines()
                .filter_map(|l| l.split('\t').nth(2)?.trim().parse::<f64>().ok())
                .map(|us| us / 1000.0),
        );
    }
    if result.non_2xx + result.socket_errors > 0 {
        bail!(
            "h2load: {} calls answered with a non-2xx HTTP status, {} failed or timed out",
            result.non_2xx,
            result.socket_errors
        );
    }
    let generator_cpu_s = children_cpu_seconds() - cpu_before;
    let gateway_cpu_s = crate::machine::process_cpu_seconds(gateway_pid, false) - gateway_before;
    let (all_after, ok_after) = answers()?;
    let not_ok = (all_after - all_before) - (ok_after - ok_before);
    if not_ok > 0.0 {
        bail!(
            "the gateway answered {not_ok} of {} ShouldRateLimit calls with something else than \
             OK (ratelimit_gateway_rls_requests_total by code)",
            all_after - all_before
        );
    }
    // Calls cut off at the end are counted by the gateway, not by h2load.
    if ok_after - ok_before < result.requests as f64 {
        bail!(
            "h2load counted {} answered calls, the gateway {} OK answers",
            result.requests,
            ok_after - ok_before
        );
    }
    latencies.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    result.p50_ms = pct(0.50);
    result.p99_ms = pct(0.99);
    Ok(GrpcRun {
        result,
        generator_cpu_s,
        gateway_cpu_s,
    })
}

/// Reads h2load's report: `finished in <s>s, ...` and
/// `requests: <n> total, <n> started, <n> done, <n> succeeded, <n> failed,
/// <n> errored, <n> timeout`. `requests` is the succeeded calls (2xx);
/// failed (non-2xx) calls count in `non_2xx`, errored and timed-out ones in
/// `socket_errors`.
fn parse_h2load(text: &str) -> Result<crate::wrk::WrkResult> {
    let finished = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("finished in "))
        .context("no 'finished in' line")?;
    let mut parts = finished.split(", ");
    let seconds = parts
        .next()
        .and_then(|s| s.strip_suffix('s'))
        .context("no duration")?
        .parse::<f64>()
        .context("duration")?;
    let counts = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("requests: "))
        .context("no 'requests:' line")?;
    let count = |name: &str| -> Result<u64> {
        counts
            .split(", ")
            .find_map(|c| c.strip_suffix(name).map(str::trim))
            .with_context(|| format!("no '{name}' count"))?
            .parse::<u64>()
            .with_context(|| format!("the '{name}' count"))
    };
    let requests = count(" succeeded")?;
    Ok(crate::wrk::WrkResult {
        requests,
        seconds,
        rps: requests as f64 / seconds.max(1e-9),
        p50_ms: 0.0,
        p99_ms: 0.0,
        non_2xx: count(" failed")?,
        socket_errors: count(" errored")? + count(" timeout")?,
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
    fn parses_h2load_report() {
        let text = "starting benchmark...\n\
            finished in 4.00s, 34126.50 req/s, 2.02MB/s\n\
            requests: 136506 total, 136522 started, 136506 done, 136500 succeeded, 6 failed, 0 errored, 0 timeout\n\
            status codes: 136500 2xx, 0 3xx, 0 4xx, 6 5xx\n";
        let r = parse_h2load(text).unwrap();
        assert_eq!(r.requests, 136_500);
        assert_eq!(r.non_2xx, 6);
        assert!((r.seconds - 4.0).abs() < 1e-9);
        assert!((r.rps - 136_500.0 / 4.0).abs() < 1e-6);
    }

    #[test]
    fn the_grpc_body_is_one_framed_request() {
        use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
        use prost::Message;
        let body = grpc_body(7);
        assert_eq!(body[0], 0, "not compressed");
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        assert_eq!(len, body.len() - 5);
        let req = RateLimitRequest::decode(&body[5..]).unwrap();
        assert_eq!(req.domain, "bench-native");
        assert_eq!(req.descriptors[0].entries[0].key, "tb_client");
        assert_eq!(req.descriptors[0].entries[0].value, "c7");
    }

    #[test]
    fn the_call_is_the_gateways_layout() {
        let a = evalsha_args("s", "c7");
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        assert_eq!(
            a,
            [
                "EVALSHA",
                "s",
                "2",
                "rl:{bench|c=c7}|global/c=c7|0|token_bucket|1000000000|1000",
                "rl:{bench|live}",
                "1",
                "",
                "1",
                "token_bucket",
                "1000000000",
                "1000",
                "1",
                // The ceiling (the window: no debt), no special limit, no
                // reservation record, the key budget.
                "1000",
                "0",
                "0",
                "100000",
            ]
        );
    }

    #[test]
    fn the_batch_call_is_the_gateways_layout() {
        let one = evalsha_args("s", "c7");
        let b = batch_evalsha_args("s", "c7");
        let n = BATCH_CHECKS as usize;
        // EVALSHA, sha, the keys' count; then each check's 2 keys; then the
        // checks' count, each check's key and argument counts, its arguments.
        assert_eq!(b[..3], ["EVALSHA", "s", &(2 * n).to_string()]);
        let keys = &b[3..3 + 2 * n];
        assert_eq!(keys[..2], one[3..5]);
        assert_eq!(keys[2 * n - 2..], one[3..5]);
        let args = &b[3 + 2 * n..];
        assert_eq!(args[0], n.to_string());
        assert_eq!(args[1..3], ["2", "11"]);
        assert_eq!(args.len(), 1 + 2 * n + 11 * n);
        assert_eq!(args[1 + 2 * n..1 + 2 * n + 11], one[5..]);
    }
}
