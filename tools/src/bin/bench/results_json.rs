//! `<work-dir>/results.json`: every run as measured, and the summary the
//! Markdown report shows.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::report::{batch_ratio, gateway_ratio, grpc_ratio, ratio, runs_of, spread_of};
use crate::{Session, VARIANTS};

/// Everything measured, for `<work-dir>/results.json`.
pub fn to_json(s: &Session) -> Value {
    let runs: Vec<Value> = s
        .runs
        .iter()
        .map(|r| {
            json!({
                "variant": r.variant, "round": r.repeat + 1,
                "rps": r.wrk.rps, "p50_ms": r.wrk.p50_ms, "p99_ms": r.wrk.p99_ms,
                "requests": r.wrk.requests, "seconds": r.wrk.seconds,
                "non_2xx": r.wrk.non_2xx, "socket_errors": r.wrk.socket_errors,
                "rss_mib": r.rss_mib, "envoy_cpu_us_per_request": r.envoy_cpu_us,
                "foreign_cpu": r.foreign_cpu, "counters": r.counters,
            })
        })
        .collect();
    let gateway: Vec<Value> = s
        .gateway_runs
        .iter()
        .map(|g| {
            json!({
                "round": g.repeat + 1,
                "gateway": { "rps": g.gateway.rps, "p50_ms": g.gateway.p50_ms, "p99_ms": g.gateway.p99_ms,
                             "requests": g.gateway.requests },
                "gateway_auth": { "rps": g.gateway_auth.rps, "p50_ms": g.gateway_auth.p50_ms,
                                  "p99_ms": g.gateway_auth.p99_ms, "requests": g.gateway_auth.requests },
                "grpc": { "rps": g.grpc.rps, "p50_ms": g.grpc.p50_ms, "p99_ms": g.grpc.p99_ms,
                          "requests": g.grpc.requests, "errors": g.grpc.non_2xx,
                          "generator_cpu_share": g.grpc_generator_share },
                "redis_benchmark": { "rps": g.redis.rps, "p50_ms": g.redis.p50_ms, "p99_ms": g.redis.p99_ms,
                                     "requests": g.redis.requests },
                "batch_checks": crate::gateway::BATCH_CHECKS,
                "batch": { "rps": g.batch.rps, "p50_ms": g.batch.p50_ms, "p99_ms": g.batch.p99_ms,
                           "requests": g.batch.requests, "non_2xx": g.batch.non_2xx },
                "redis_benchmark_batch": { "rps": g.redis_batch.rps, "p50_ms": g.redis_batch.p50_ms,
                                           "p99_ms": g.redis_batch.p99_ms, "requests": g.redis_batch.requests },
                "gateway_cpu_us_per_check": g.gateway_cpu_us,
                "gateway_auth_cpu_us_per_check": g.gateway_auth_cpu_us,
                "lookup_ns_per_check": { "auth": g.lookup.auth_ns, "policy": g.lookup.policy_ns },
                "foreign_cpu": g.foreign_cpu,
            })
        })
        .collect();
    let summary: BTreeMap<&str, Value> = VARIANTS
        .iter()
        .filter(|v| !runs_of(s, v.id).is_empty())
        .map(|v| {
            (
                v.id,
                json!({
                    "rps": spread_of(s, v.id, |r| r.wrk.rps).to_json(),
                    "p50_ms": spread_of(s, v.id, |r| r.wrk.p50_ms).to_json(),
                    "p99_ms": spread_of(s, v.id, |r| r.wrk.p99_ms).to_json(),
                    "rss_mib": spread_of(s, v.id, |r| r.rss_mib).to_json(),
                    "envoy_cpu_us_per_request": spread_of(s, v.id, |r| r.envoy_cpu_us).to_json(),
                    "vs_a": ratio(s, v.id, "a").to_json(),
                    "vs_a2": ratio(s, v.id, "a2").to_json(),
                    "vs_b": ratio(s, v.id, "b").to_json(),
                }),
            )
        })
        .collect();
    json!({
        "started": s.started_utc,
        "duration_s": s.duration.as_secs_f64(),
        "command": s.args.command,
        "rounds": s.args.repeats,
        "seconds": s.args.seconds,
        "warmup_s": s.args.warmup,
        "connections": s.args.connections,
        "threads": s.args.threads,
        "machine": s.machine.to_json(),
        "quiet": {
            "quiet": s.quiet.quiet, "waited_s": s.quiet.waited.as_secs_f64(),
            "load_at_start": s.quiet.load_at_start, "load_at_end": s.load_at_end,
        },
        "summary": summary,
        "gateway_ratio": gateway_ratio(s).to_json(),
        "batch_ratio": batch_ratio(s).to_json(),
        "grpc_ratio": grpc_ratio(s).to_json(),
        "runs": runs,
        "gateway_runs": gateway,
        "wasm": s.wasm,
        "notes": s.notes,
    })
}
