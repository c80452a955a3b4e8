//! The report: the Markdown results section of BENCHMARKS.md, and the
//! figures the raw JSON (`results_json.rs`) shares with it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::stats::{group, Spread};
use crate::{LoadMode, Run, Session, VARIANTS};

/// The results section sits between these lines of BENCHMARKS.md.
pub const BEGIN: &str = "<!-- bench:begin -->";
pub const END: &str = "<!-- bench:end -->";

/// The targets: (variant, reference, goal).
pub const TARGETS: [(&str, &str, f64); 17] = [
    ("c1", "a2", 0.95),
    ("c4", "a2", 0.95),
    ("c1", "b", 0.88),
    ("c4", "b", 0.88),
    ("c4", "c1", 0.95),
    // A concurrency cap: a slot taken and given back per request.
    ("cc", "c1", 0.90),
    // Matching on host, route and query, keying on an address prefix.
    ("cm", "c1", 0.95),
    // Global checks coalesced, against Envoy alone, the native filter on
    // the gateway, and one call per request.
    ("d", "a", 0.65),
    ("d", "g", 1.3),
    ("d", "d1", 1.0),
    // HTTP/2 to the gateway, and its gRPC API, against HTTP/1 keep-alive:
    // the faster ships.
    ("d2", "d", 1.0),
    ("dg", "d", 1.0),
    ("g", "a", 0.35),
    ("e", "c1", 0.85),
    ("d-f", "c1-f", 0.90),
    // Charging from the response body, against c1 at the same response size.
    ("cu-1k", "c1-1k", 0.80),
    ("cu-64k", "c1-64k", 0.80),
];
/// Gateway checks/s over raw EVALSHA/s.
pub const GATEWAY_TARGET: f64 = 0.70;

/// `tests/bench_fuel.rs`'s instructions per response byte that a
/// `cost_from` rule scans.
fn usage_figures(m: &mut String, f: &Value) {
    let _ = writeln!(
        m,
        "### Inside the wasm: instructions per response byte
"
    );
    let _ = writeln!(
        m,
        "A whole request (every callback, the body in chunks through \
         `on_http_response_body`) of c1's rule with `cost_from` (`bench/cu.json`, the \
         `openai_chat` preset) against c1 with the same body and chunks, mean over {} \
         requests (`tests/bench_fuel.rs`):\n",
        f["requests"]
    );
    let _ = writeln!(
        m,
        "| body | chunks | c1 | c1 + `cost_from` | per response byte |"
    );
    let _ = writeln!(m, "|---|---:|---:|---:|---:|");
    let n = |v: &Value| v.as_f64().map_or("–".to_string(), |x| group(x, 0));
    for (key, what) in [
        ("json_1k", "1 KiB chat completion (JSON)"),
        ("json_64k", "64 KiB chat completion (JSON)"),
        ("sse_64k", "64 KiB chat stream (SSE)"),
        (
            "sse_events_as_json",
            "the stream's events as one JSON document",
        ),
        (
            "json_as_one_event",
            "the 64 KiB chat completion as one SSE event",
        ),
    ] {
        for k in [16, 1] {
            let row = &f["bodies"][format!("{key}_chunks_{k}k")];
            if row.is_null() {
                continue;
            }
            let _ = writeln!(
                m,
                "| {what}, {} bytes | {k} KiB | {} | {} | {:.2} |",
                n(&row["body_bytes"]),
                n(&row["c1_request"]),
                n(&row["cost_from_request"]),
                row["per_byte"].as_f64().unwrap_or(f64::NAN)
            );
        }
    }
    let slope = |k: &str| {
        f["json_slope_per_byte"][k]
            .as_f64()
            .map_or("–".to_string(), |x| format!("{x:.2}"))
    };
    let _ = writeln!(
        m,
        "\nThe JSON scan alone (1 KiB to 64 KiB): {} instructions per byte in 16 KiB \
         chunks, {} in 1 KiB chunks; the rest of the 1 KiB figure is the charge's fixed cost.\n",
        slope("json_chunks_16k"),
        slope("json_chunks_1k")
    );
}

/// The floor under c1: a3 makes c1's host calls and nothing else, so a3 ÷ a2
/// is what those calls cost Envoy and c1 ÷ a3 what the filter's own work does.
fn floor(m: &mut String, s: &Session) {
    if ["a2", "a3", "c1"]
        .iter()
        .any(|id| runs_of(s, id).is_empty())
    {
        return;
    }
    let cpu = |id: &str| spread_of(s, id, |r| r.envoy_cpu_us).show(1);
    let _ = writeln!(
        m,
        "**The floor under c1** (a3: a module making c1's host calls and nothing else): \
         a3 ÷ a2 {}, what the host calls cost; c1 ÷ a3 {}, what the filter's own work costs \
         on top of them. Envoy CPU per request: a2 {} µs, a3 {} µs, c1 {} µs.\n",
        ratio(s, "a3", "a2").show(3),
        ratio(s, "c1", "a3").show(3),
        cpu("a2"),
        cpu("a3"),
        cpu("c1"),
    );
}

/// Coalesced global checks (d) against one call per request (d1) and a
/// local rule (c1): the Envoy CPU a global check adds over a local one (goal
/// at most 40 µs) and the p99 latency over c1's (goal at most 2), round by
/// round.
fn coalescing(m: &mut String, s: &Session) {
    if ["c1", "d", "d1"].iter().any(|id| runs_of(s, id).is_empty()) {
        return;
    }
    let by_round = |id: &str, f: fn(&Run) -> f64| -> BTreeMap<u32, f64> {
        runs_of(s, id).iter().map(|r| (r.repeat, f(r))).collect()
    };
    let paired = |id: &str, f: fn(&Run) -> f64, op: fn(f64, f64) -> f64| -> Spread {
        let c1 = by_round("c1", f);
        let xs: Vec<f64> = by_round(id, f)
            .iter()
            .filter_map(|(round, x)| Some(op(*x, *c1.get(round)?)))
            .collect();
        Spread::of(&xs)
    };
    let cpu_over = |id: &str| paired(id, |r| r.envoy_cpu_us, |x, c| x - c).show(1);
    let p99_over = |id: &str| paired(id, |r| r.wrk.p99_ms, |x, c| x / c).show(2);
    let met = |ok: bool| if ok { "met" } else { "**missed**" };
    let cpu_d = paired("d", |r| r.envoy_cpu_us, |x, c| x - c);
    let p99_d = paired("d", |r| r.wrk.p99_ms, |x, c| x / c);
    let _ = writeln!(
        m,
        "**Coalesced global checks** (d) against one call per request (d1): d ÷ d1 {}. Envoy \
         CPU per request over c1's: d {} µs ({} the goal of at most 40), d1 {} µs. p99 latency \
         over c1's: d {} ({} the goal of at most 2), d1 {}.\n",
        ratio(s, "d", "d1").show(3),
        cpu_over("d"),
        met(cpu_d.mean <= 40.0),
        cpu_over("d1"),
        p99_over("d"),
        met(p99_d.mean <= 2.0),
        p99_over("d1"),
    );
}

pub fn runs_of<'a>(s: &'a Session, id: &str) -> Vec<&'a Run> {
    s.runs.iter().filter(|r| r.variant == id).collect()
}

pub fn spread_of(s: &Session, id: &str, f: impl Fn(&Run) -> f64) -> Spread {
    Spread::of(&runs_of(s, id).iter().map(|r| f(r)).collect::<Vec<_>>())
}

/// Requests/s of `id` over those of `reference`, round by round (the runs of
/// one round are minutes apart at most), then mean and spread.
pub fn ratio(s: &Session, id: &str, reference: &str) -> Spread {
    let by_round = |v: &str| -> BTreeMap<u32, f64> {
        runs_of(s, v)
            .iter()
            .map(|r| (r.repeat, r.wrk.rps))
            .collect()
    };
    let refs = by_round(reference);
    let xs: Vec<f64> = by_round(id)
        .iter()
        .filter_map(|(round, rps)| Some(rps / refs.get(round)?))
        .collect();
    Spread::of(&xs)
}

pub fn gateway_ratio(s: &Session) -> Spread {
    Spread::of(
        &s.gateway_runs
            .iter()
            .map(|g| g.gateway.rps / g.redis.rps)
            .collect::<Vec<_>>(),
    )
}

/// Batched checks/s through `POST /v3/check` ÷ the batch script's raw
/// checks/s, round by round (both the same checks per call).
pub fn batch_ratio(s: &Session) -> Spread {
    Spread::of(
        &s.gateway_runs
            .iter()
            .map(|g| g.batch.rps / g.redis_batch.rps.max(1e-9))
            .collect::<Vec<_>>(),
    )
}

/// The gateway's gRPC `ShouldRateLimit` calls/s ÷ raw EVALSHA/s, round by round.
pub fn grpc_ratio(s: &Session) -> Spread {
    Spread::of(
        &s.gateway_runs
            .iter()
            .map(|g| g.grpc.rps / g.redis.rps)
            .collect::<Vec<_>>(),
    )
}

/// The authenticating gateway's throughput ÷ the plain one's, round by round.
fn auth_ratio(s: &Session) -> Spread {
    Spread::of(
        &s.gateway_runs
            .iter()
            .map(|g| g.gateway_auth.rps / g.gateway.rps)
            .collect::<Vec<_>>(),
    )
}

/// Authentication may cost at most 5 % of the gateway's throughput (the target in BENCHMARKS.md).
pub const AUTH_TARGET: f64 = 0.95;

/// Authentication and the policy lookup together: at most this share of
/// the gateway's CPU per check (the target in BENCHMARKS.md: together ≤ 5 %).
pub const LOOKUP_TARGET: f64 = 0.05;

/// Authentication + policy lookup time per check (in process,
/// `bench/lookup.rs`) ÷ the plain gateway's CPU time per check under load,
/// round by round. The gateway is CPU-bound under the bench's load, so this
/// is the share of its throughput they cost.
fn lookup_share(s: &Session) -> Spread {
    Spread::of(
        &s.gateway_runs
            .iter()
            .map(|g| g.lookup.total_ns() / (g.gateway_cpu_us * 1000.0))
            .collect::<Vec<_>>(),
    )
}

fn counter(r: &Run, name: &str) -> f64 {
    r.counters.get(name).copied().unwrap_or(0.0)
}

/// What the runs of a variant say about correctness, in words.
fn checks(s: &Session, id: &str, load: LoadMode) -> String {
    let runs = runs_of(s, id);
    let mut out = Vec::new();
    let requests: u64 = runs.iter().map(|r| r.wrk.requests).sum();
    let non_2xx: u64 = runs.iter().map(|r| r.wrk.non_2xx).sum();
    let socket: u64 = runs.iter().map(|r| r.wrk.socket_errors).sum();
    match load {
        LoadMode::Half => out.push(format!(
            "{requests} requests, {:.1} % answered 429",
            100.0 * non_2xx as f64 / requests.max(1) as f64
        )),
        LoadMode::Spread | LoadMode::Matched => {
            out.push(format!("{requests} requests, {non_2xx} non-2xx"))
        }
    }
    if socket > 0 {
        out.push(format!("{socket} socket errors"));
    }
    let decided: f64 = runs
        .iter()
        .map(|r| {
            counter(r, "ratelimit_wasm_requests_allowed")
                + counter(r, "ratelimit_wasm_requests_denied")
                + counter(r, "envoy_http_local_rate_limit_enabled")
        })
        .sum();
    if decided > 0.0 {
        out.push(format!(
            "the limiter decided {:.1} % of them",
            100.0 * decided / requests.max(1) as f64
        ));
    }
    let calls: f64 = runs
        .iter()
        .map(|r| counter(r, "ratelimit_wasm_global_calls"))
        .sum();
    if calls > 0.0 {
        let failures: f64 = runs
            .iter()
            .map(|r| {
                counter(r, "ratelimit_wasm_global_failures")
                    + counter(r, "ratelimit_wasm_circuit_open_skips")
            })
            .sum();
        let batches: f64 = runs
            .iter()
            .map(|r| counter(r, "ratelimit_wasm_global_batches"))
            .sum();
        let callouts = if batches > 0.0 { batches } else { calls };
        out.push(format!(
            "{:.2} callouts per request, {failures:.0} failed or skipped",
            callouts / decided.max(1.0)
        ));
        if batches > 0.0 {
            out.push(format!("{:.1} checks per batch call", calls / batches));
        }
    }
    let evalsha: f64 = runs.iter().map(|r| counter(r, "redis_evalsha")).sum();
    if evalsha > 0.0 {
        out.push(format!(
            "{:.3} Redis calls (EVALSHA) per request",
            evalsha / requests.max(1) as f64
        ));
    }
    let usage = |name: &str| -> f64 { runs.iter().map(|r| counter(r, name)).sum() };
    let settled = usage("ratelimit_wasm_usage_settled");
    let unread =
        usage("ratelimit_wasm_usage_missing") + usage("ratelimit_wasm_usage_over_scan_limit");
    if settled + unread > 0.0 {
        out.push(format!(
            "{:.1} % settled to the usage in the body ({:.1} % capped at max), {unread:.0} \
             without a usage read",
            100.0 * settled / decided.max(1.0),
            100.0 * usage("ratelimit_wasm_usage_capped") / decided.max(1.0)
        ));
    }
    let hits: f64 = runs
        .iter()
        .map(|r| counter(r, "ratelimit_wasm_deny_cache_hits"))
        .sum();
    if hits > 0.0 {
        out.push(format!(
            "{:.1} % answered from the deny cache",
            100.0 * hits / decided.max(1.0)
        ));
    }
    let fetches: f64 = runs
        .iter()
        .map(|r| counter(r, "ratelimit_wasm_lease_fetches"))
        .sum();
    if fetches > 0.0 {
        let served: f64 = runs
            .iter()
            .map(|r| counter(r, "ratelimit_wasm_lease_served"))
            .sum();
        out.push(format!(
            "{:.1} % served from a lease, {:.3} lease fetches per request",
            100.0 * served / decided.max(1.0),
            fetches / decided.max(1.0)
        ));
    }
    let errors: f64 = runs
        .iter()
        .map(|r| counter(r, "ratelimit_wasm_errors"))
        .sum();
    if errors > 0.0 {
        out.push(format!("{errors:.0} filter errors"));
    }
    out.join("; ")
}

fn met(x: f64, goal: f64) -> &'static str {
    if !x.is_finite() {
        "not measured"
    } else if x >= goal {
        "**met**"
    } else {
        "**missed**"
    }
}

fn ratio_cell(s: &Session, id: &str, reference: &str) -> String {
    if id == reference || runs_of(s, reference).is_empty() {
        return "–".to_string();
    }
    ratio(s, id, reference).show(3)
}

/// The Markdown results section (without the markers).
pub fn markdown(s: &Session, svg: &str) -> String {
    let a = &s.args;
    let mut m = String::new();
    let ids: Vec<&str> = VARIANTS
        .iter()
        .filter(|v| a.selected(v.id))
        .map(|v| v.id)
        .collect();
    let _ = writeln!(
        m,
        "_Generated by `make bench` (`tools/src/bin/bench.rs`); everything between the \
         `bench:begin` and `bench:end` markers is rewritten by each run._\n"
    );
    let _ = writeln!(
        m,
        "Measured {} in {:.0} s with `{}`: {} round{}; in each round every variant once, in the \
         order {}, each on a fresh Envoy: {} s of warm-up, then {} s measured with wrk \
         ({} thread, {} connections, keep-alive).\n",
        s.started_utc,
        s.duration.as_secs_f64(),
        a.command,
        a.repeats,
        if a.repeats == 1 { "" } else { "s" },
        ids.join(" "),
        a.warmup,
        a.seconds,
        a.threads,
        a.connections
    );
    let mc = &s.machine;
    let _ = writeln!(
        m,
        "**Machine:** `nproc` = {}, CPU model \"{}\" (/proc/cpuinfo), {} MiB of memory, Linux {}; \
         Envoy {}; {}; {}.\n",
        mc.nproc,
        mc.cpu_model,
        mc.mem_total_mib,
        mc.kernel,
        mc.envoy_version,
        mc.wrk_version,
        mc.redis_version
    );
    let foreign: Vec<f64> = s
        .runs
        .iter()
        .map(|r| r.foreign_cpu)
        .chain(s.gateway_runs.iter().map(|g| g.foreign_cpu))
        .collect();
    let fs = Spread::of(&foreign);
    let q = &s.quiet;
    let l = q.load_at_start;
    let quiet_text = if q.quiet && !q.max_wait.is_zero() {
        format!(
            "quiet: the 1-minute load average stayed below {} for a minute before the \
             measurements started (after waiting {:.0} s)",
            q.threshold,
            q.waited.as_secs_f64()
        )
    } else if q.quiet {
        format!(
            "quiet when the measurements started (1-minute load average {:.2}, below {}; not \
             waited for)",
            l[0], q.threshold
        )
    } else if q.max_wait.is_zero() {
        format!(
            "**NOT quiet**: the 1-minute load average was {:.2} when the measurements started \
             (not waited for: no `BENCH_WAIT_QUIET`); other work on the machine took CPU from \
             the measured processes, so these numbers are lower and noisier than on an idle \
             machine",
            l[0]
        )
    } else {
        format!(
            "**NOT quiet**: the 1-minute load average did not stay below {} for a minute in the \
             {:.0} s we waited ({:.2} when the measurements started); other work on the machine \
             took CPU from the measured processes, so these numbers are lower and noisier than \
             on an idle machine",
            q.threshold,
            q.waited.as_secs_f64(),
            l[0]
        )
    };
    let _ = writeln!(
        m,
        "**Load:** {quiet_text}. Load averages at the start {:.2} / {:.2} / {:.2}, at the end \
         {:.2} / {:.2} / {:.2} (the bench's own processes included). Processes other than the \
         bench's took {:.1} % of the machine's CPU during the measured runs on average (at most \
         {:.1} %; from /proc/stat minus the CPU time of the bench's own processes).\n",
        l[0],
        l[1],
        l[2],
        s.load_at_end[0],
        s.load_at_end[1],
        s.load_at_end[2],
        fs.mean * 100.0,
        fs.max * 100.0
    );

    let _ = writeln!(m, "### Envoy\n");
    let _ = writeln!(
        m,
        "| variant | what | requests/s | p50 ms | p99 ms | ÷ a | ÷ a2 | ÷ b | Envoy CPU µs/request | Envoy RSS MiB | checks |"
    );
    let _ = writeln!(m, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for v in VARIANTS.iter().filter(|v| a.selected(v.id)) {
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            v.id,
            v.what,
            spread_of(s, v.id, |r| r.wrk.rps).show(0),
            spread_of(s, v.id, |r| r.wrk.p50_ms).show(3),
            spread_of(s, v.id, |r| r.wrk.p99_ms).show(3),
            ratio_cell(s, v.id, "a"),
            ratio_cell(s, v.id, "a2"),
            ratio_cell(s, v.id, "b"),
            spread_of(s, v.id, |r| r.envoy_cpu_us).show(1),
            spread_of(s, v.id, |r| r.rss_mib).show(1),
            checks(s, v.id, v.load),
        );
    }
    let _ = writeln!(m);
    let _ = writeln!(
        m,
        "Each cell: mean ± sample standard deviation over the rounds. Ratios (÷) are taken \
         round by round (a variant's requests/s over the reference's in the same round), then \
         averaged. Latency is wrk's (closed loop: {} connections always busy). Envoy CPU is the \
         measured Envoy's user + system time (all threads, /proc) during the measured run over \
         the requests it answered: less sensitive than requests/s to other work on the machine. \
         RSS is Envoy's `VmRSS` right after the measured run.\n",
        a.connections
    );

    let _ = writeln!(m, "### Targets\n");
    let _ = writeln!(m, "| target | measured | goal | |");
    let _ = writeln!(m, "|---|---:|---:|---|");
    for (id, reference, goal) in TARGETS {
        if runs_of(s, id).is_empty() || runs_of(s, reference).is_empty() {
            continue;
        }
        let r = ratio(s, id, reference);
        let _ = writeln!(
            m,
            "| {id} ÷ {reference} | {} | ≥ {goal:.2} | {} |",
            r.show(3),
            met(r.mean, goal)
        );
    }
    if !s.gateway_runs.is_empty() {
        let r = gateway_ratio(s);
        let _ = writeln!(
            m,
            "| gateway ÷ raw EVALSHA | {} | ≥ {GATEWAY_TARGET:.2} | {} |",
            r.show(3),
            met(r.mean, GATEWAY_TARGET)
        );
        let r = grpc_ratio(s);
        let _ = writeln!(
            m,
            "| gateway gRPC (`ShouldRateLimit`) ÷ raw EVALSHA | {} | ≥ {GATEWAY_TARGET:.2} | {} |",
            r.show(3),
            met(r.mean, GATEWAY_TARGET)
        );
        let r = auth_ratio(s);
        let _ = writeln!(
            m,
            "| gateway with auth ÷ gateway | {} | ≥ {AUTH_TARGET:.2} | {} |",
            r.show(3),
            met(r.mean, AUTH_TARGET)
        );
        let r = lookup_share(s);
        let _ = writeln!(
            m,
            "| auth + policy lookup ÷ the gateway's CPU per check | {} | ≤ {LOOKUP_TARGET:.2} | {} |",
            r.show(3),
            // At most the goal: met when the goal is at least the share.
            met(LOOKUP_TARGET, r.mean)
        );
    }
    let _ = writeln!(m);
    floor(&mut m, s);
    coalescing(&mut m, s);

    if !s.gateway_runs.is_empty() {
        let g = |f: &dyn Fn(&crate::GatewayRun) -> f64| {
            Spread::of(&s.gateway_runs.iter().map(f).collect::<Vec<_>>())
        };
        let _ = writeln!(m, "### The gateway alone\n");
        let _ = writeln!(m, "| | checks/s | p50 ms | p99 ms |");
        let _ = writeln!(m, "|---|---:|---:|---:|");
        let _ = writeln!(
            m,
            "| `ratelimit-gateway` (release build), wrk `POST /v1/check`, 1 bucket × 1 limit | {} | {} | {} |",
            g(&|r| r.gateway.rps).show(0),
            g(&|r| r.gateway.p50_ms).show(3),
            g(&|r| r.gateway.p99_ms).show(3)
        );
        let _ = writeln!(
            m,
            "| the same with `--auth-tokens` ({} callers), a bearer token in every request | {} | {} | {} |",
            crate::AUTH_CALLERS,
            g(&|r| r.gateway_auth.rps).show(0),
            g(&|r| r.gateway_auth.p50_ms).show(3),
            g(&|r| r.gateway_auth.p99_ms).show(3)
        );
        let _ = writeln!(
            m,
            "| the rate limit service over gRPC (`--grpc-listen`), `ShouldRateLimit` with 1 token-bucket descriptor, h2load: {} HTTP/2 connections × {} calls in flight (h2load's CPU {} × the gateway's) | {} | {} | {} |",
            crate::gateway::GRPC_PROCESSES.min(a.connections.max(1)),
            (a.connections / crate::gateway::GRPC_PROCESSES.min(a.connections.max(1))).max(1),
            g(&|r| r.grpc_generator_share).show(2),
            g(&|r| r.grpc.rps).show(0),
            g(&|r| r.grpc.p50_ms).show(3),
            g(&|r| r.grpc.p99_ms).show(3)
        );
        let _ = writeln!(
            m,
            "| `redis-benchmark` `EVALSHA` of `check.lua`, same keys and ARGV, same Redis | {} | {} | {} |",
            g(&|r| r.redis.rps).show(0),
            g(&|r| r.redis.p50_ms).show(3),
            g(&|r| r.redis.p99_ms).show(3)
        );
        let per_batch = f64::from(crate::gateway::BATCH_CHECKS);
        let _ = writeln!(
            m,
            "| batches: wrk `POST /v3/check`, {} checks of 1 bucket × 1 limit per call (checks/s = calls/s × {}; latency per call) | {} | {} | {} |",
            crate::gateway::BATCH_CHECKS,
            crate::gateway::BATCH_CHECKS,
            g(&|r| r.batch.rps * per_batch).show(0),
            g(&|r| r.batch.p50_ms).show(3),
            g(&|r| r.batch.p99_ms).show(3)
        );
        let _ = writeln!(
            m,
            "| `redis-benchmark` `EVALSHA` of the batch script, the same {} checks per call | {} | {} | {} |",
            crate::gateway::BATCH_CHECKS,
            g(&|r| r.redis_batch.rps * per_batch).show(0),
            g(&|r| r.redis_batch.p50_ms).show(3),
            g(&|r| r.redis_batch.p99_ms).show(3)
        );
        let _ = writeln!(
            m,
            "\nCPU time per check (user + system, all threads, /proc): the gateway {} µs, \
             with `--auth-tokens` {} µs. Authentication and the policy lookup alone, timed in \
             process on the same requests, policy and token file (`bench/lookup.rs`: the \
             gateway's `Tokens::authenticate` and `Policy::resolve_check`; the gateway cannot \
             serve without its policy, so no loaded gateway goes without the lookup): {} ns \
             and {} ns per check, together {} of the gateway's CPU per check.",
            g(&|r| r.gateway_cpu_us).show(2),
            g(&|r| r.gateway_auth_cpu_us).show(2),
            g(&|r| r.lookup.auth_ns).show(0),
            g(&|r| r.lookup.policy_ns).show(0),
            lookup_share(s).show(3)
        );
        let non_2xx: u64 = s.gateway_runs.iter().map(|r| r.gateway.non_2xx).sum();
        let checks: u64 = s.gateway_runs.iter().map(|r| r.gateway.requests).sum();
        let _ = writeln!(
            m,
            "\nGateway ÷ raw EVALSHA: {} (round by round). Both with {} connections, no \
             pipelining by the client, 1000 client keys. The gateway answered {non_2xx} of \
             {checks} measured checks with a non-2xx status (503: a Redis round trip over its \
             20 ms `--redis-timeout-ms`).\n",
            gateway_ratio(s).show(3),
            a.connections
        );
        let _ = writeln!(
            m,
            "Batched gateway ÷ raw EVALSHA of the batch script: {} (round by round, checks/s \
             over checks/s; each batch is one EVALSHA).\n",
            batch_ratio(s).show(3)
        );
    }

    if let Some(f) = s.wasm.get("fuel") {
        let n = |v: &Value| v.as_f64().map_or("–".to_string(), |x| group(x, 0));
        let _ = writeln!(m, "### Inside the wasm: instructions per decision\n");
        let _ = writeln!(
            m,
            "Wasm instructions executed (wasmtime fuel) by the release module, mean over {} \
             requests of {} clients (`tests/bench_fuel.rs`):\n",
            f["requests"], f["clients"]
        );
        let _ = writeln!(
            m,
            "| module and configuration | decision (`on_http_request_headers`) | whole request (every callback) |"
        );
        let _ = writeln!(m, "|---|---:|---:|");
        let _ = writeln!(
            m,
            "| no-op filter | {} | {} |",
            n(&f["noop"]["decision"]),
            n(&f["noop"]["request"])
        );
        if !f["hostcalls"].is_null() {
            let _ = writeln!(
                m,
                "| a3's module: c1's host calls, nothing else | {} | {} |",
                n(&f["hostcalls"]["decision"]),
                n(&f["hostcalls"]["request"])
            );
        }
        let _ = writeln!(
            m,
            "| c1: 1 rule, allowed | {} | {} |",
            n(&f["c1"]["decision"]),
            n(&f["c1"]["request"])
        );
        let _ = writeln!(
            m,
            "| c1: 1 rule, denied (429 with problem body) | {} | – |",
            n(&f["c1"]["denied_decision"])
        );
        let _ = writeln!(
            m,
            "| c4: 4 rules × 2 limits, allowed | {} | {} |",
            n(&f["c4"]["decision"]),
            n(&f["c4"]["request"])
        );
        if !f["cc"].is_null() {
            let _ = writeln!(
                m,
                "| cc: c1 and a concurrency cap (a slot taken, then given back in `on_log`) | {} | {} |",
                n(&f["cc"]["decision"]),
                n(&f["cc"]["request"])
            );
        }
        let _ = writeln!(
            m,
            "\n4 rules ÷ 1 rule: {:.2} (the test asserts < 8).\n",
            f["c4_over_c1"].as_f64().unwrap_or(f64::NAN)
        );
    }
    if let Some(f) = s.wasm.get("usage") {
        usage_figures(&mut m, f);
    }
    if let Some(f) = s.wasm.get("footprint") {
        let _ = writeln!(
            m,
            "### Shared data with 1,000,000 distinct clients\n\nOne request from each of \
             1,000,000 distinct client ids through the filter's decision code over a \
             `MemoryStore` with Envoy's shared-data semantics (`tests/bench_fuel.rs`, as \
             `tests/hostile.rs`):\n"
        );
        let _ = writeln!(
            m,
            "| configuration | `max_buckets` | keys | bytes (keys + values) | bound | of the bound |"
        );
        let _ = writeln!(m, "|---|---:|---:|---:|---:|---:|");
        for id in ["c1", "c4"] {
            let v = &f[id];
            let bytes = v["bytes"].as_f64().unwrap_or(f64::NAN);
            let bound = v["bound_bytes"].as_f64().unwrap_or(f64::NAN);
            let _ = writeln!(
                m,
                "| {id} | {} | {} | {} | {} | {:.1} % |",
                group(v["max_buckets"].as_f64().unwrap_or(f64::NAN), 0),
                group(v["keys"].as_f64().unwrap_or(f64::NAN), 0),
                group(bytes, 0),
                group(bound, 0),
                100.0 * bytes / bound
            );
        }
        let _ = writeln!(
            m,
            "\nThe bound: `max_buckets / 4` sets × (longest set key + 2 + 4 × (33 + 16 per \
             extra limit)) bytes, whatever the number of clients.\n"
        );
    }
    for note in &s.notes {
        let _ = writeln!(m, "> {note}\n");
    }
    let _ = writeln!(
        m,
        "![requests/s, Envoy CPU per request and latency per variant; the gateway against raw \
         EVALSHA]({svg})"
    );
    m
}

/// Puts `section` between the markers of the Markdown file at `path`
/// (creating it, or appending the markers, when they are missing).
pub fn write_section(path: &Path, section: &str) -> Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let block = format!("{BEGIN}\n{section}{END}");
    let new = match (old.find(BEGIN), old.find(END)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{block}{}", &old[..b], &old[e + END.len()..])
        }
        _ if old.trim().is_empty() => format!("# Benchmarks\n\n{block}\n"),
        _ => format!("{}\n\n{block}\n", old.trim_end()),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_only_the_section() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("B.md");
        std::fs::write(
            &p,
            format!("# T\n\nprose\n\n{BEGIN}\nold\n{END}\n\nafter\n"),
        )
        .unwrap();
        write_section(&p, "new\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("# T\n\nprose\n\n{BEGIN}\nnew\n{END}\n\nafter\n")
        );
        let q = dir.path().join("C.md");
        write_section(&q, "x\n").unwrap();
        assert!(std::fs::read_to_string(&q)
            .unwrap()
            .contains("x\n<!-- bench:end -->"));
    }
}
