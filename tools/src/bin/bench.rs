//! `make bench`: throughput, latency and memory of Envoy with and without the
//! rate-limit filter, the gateway against raw Redis, and the report
//! (BENCHMARKS.md, BENCHMARKS.svg).
//!
//! Every variant runs in one session, interleaved (a a2 a3 b c1 c4 cc d g e b-f c1-f d-f
//! c1-1k cu-1k c1-64k cu-64k, then again, `--repeats` times), each on a fresh Envoy (`--concurrency 2`,
//! the same flags in every variant) whose configuration is the shipped
//! template `envoy/envoy.yaml` rendered by testkit and then changed only in
//! the rate-limit filter entry (see `bench/configs.rs`). All of them forward
//! to the same upstream: a separate Envoy (`--concurrency 1`, pinned to the
//! last CPU) serving the template's own `direct_response` listener (plus
//! chat completions of 1 KiB and 64 KiB for the response-body variants). The
//! load is `wrk` (`bench/load.lua`): 1000 client ids in turn, or, for the f
//! variants, every other request from a client the limiter rejects.
//!
//! Then the gateway alone (`bench/gateway.rs`): wrk on `POST /v1/check`
//! against `redis-benchmark` running `EVALSHA` of `check.lua` on the same
//! Redis, and the same load on a second gateway that authenticates every
//! call (`--auth-tokens` with [`AUTH_CALLERS`] callers; the bearer token in
//! every request), and batches of [`gateway::BATCH_CHECKS`] checks (`POST
//! /v3/check` against `EVALSHA` of the batch script). The wasm-level figures (instructions per decision, shared-data
//! footprint) come from `tests/bench_fuel.rs`, which `make bench` runs first
//! with `BENCH_WASM_OUT` pointing at `--wasm-results`.
//!
//! Usage: `bench [--repeats N] [--seconds S] [--warmup S] [--connections C]
//! [--threads T] [--only a,c1,...] [--wait-quiet SECONDS] [--work-dir DIR]
//! [--wasm-results DIR] [--publish]`. Without `--publish` the report goes to
//! `<work-dir>/BENCHMARKS.md` and `.svg` only; with it, into the workspace's
//! `BENCHMARKS.md` (between its result markers) and `BENCHMARKS.svg`.
//!
//! This file holds the variants and the session's order of work. The parts,
//! under `bench/`: `args.rs` (the command line), `infra.rs` (the processes
//! every variant shares), `runs.rs` (one measured run), `configs.rs` (each
//! variant's Envoy configuration), `wrk.rs`, `gateway.rs` and `lookup.rs`
//! (the loads and the in-process timing), `machine.rs` (CPU, memory, quiet),
//! `stats.rs`, `report.rs`, `results_json.rs` and `chart.rs`. What Ctrl-C stops is
//! `tools::children`, shared with the demo.

#[path = "bench/args.rs"]
mod args;
#[path = "bench/chart.rs"]
mod chart;
#[path = "bench/configs.rs"]
mod configs;
#[path = "bench/gateway.rs"]
mod gateway;
#[path = "bench/infra.rs"]
mod infra;
#[path = "bench/lookup.rs"]
mod lookup;
#[path = "bench/machine.rs"]
mod machine;
#[path = "bench/report.rs"]
mod report;
#[path = "bench/results_json.rs"]
mod results_json;
#[path = "bench/runs.rs"]
mod runs;
#[path = "bench/stats.rs"]
mod stats;
#[path = "bench/wrk.rs"]
mod wrk;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use args::{parse_args, Args};
use configs::FilterVariant;
use infra::Infra;
use runs::RunContext;
use testkit::paths::target_dir;
use testkit::{envoy_bin, wasm_path, workspace_root, Gateway};
use tools::children::stop_children_from_signal;

/// The plugin configurations of the c and d variants (also read by
/// `tests/bench_fuel.rs`).
const C1_JSON: &str = include_str!("bench/c1.json");
const C4_JSON: &str = include_str!("bench/c4.json");
const D_JSON: &str = include_str!("bench/d.json");
const E_JSON: &str = include_str!("bench/e.json");
/// d-f: c1's local rule for every client, and a global rule (per-request
/// mode) for client `over` at 1 per 366 days: the gateway denies `over`
/// once, then the deny cache answers it, so the rejected half of the load is
/// decided in global mode and the admitted half as in c1-f.
const DF_JSON: &str = include_str!("bench/df.json");
/// A rule matched on host, route and query, keyed on the IPv4 /24 (`tests/bench_fuel.rs` too).
const CM_JSON: &str = include_str!("bench/cm.json");
/// d's rule over the gateway's gRPC API (`transport: grpc`, the
/// `ratelimit_gateway_grpc` cluster on its `--grpc-listen`, HTTP/2).
const DG_JSON: &str = include_str!("bench/dg.json");
/// d's rule with one call per request (protocol version 2): d before coalescing.
const D1_JSON: &str = include_str!("bench/d1.json");
/// cu: c1's rule charged from the response body (`cost_from` with the
/// `openai_chat` preset, reserve 100, max 4000; also read by
/// `tests/bench_fuel.rs`).
const CU_JSON: &str = include_str!("bench/cu.json");
/// cc: c1's rule and a concurrency cap per client (`{"concurrent": 64}`,
/// never reached): a slot taken and given back per request.
const CC_JSON: &str = include_str!("bench/cc.json");

/// What the wrk script sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadMode {
    /// Clients c0..c999 in turn: nothing is rejected.
    Spread,
    /// Every other request from client `over`, whom the limiter rejects.
    Half,
    /// As `Spread`, with `Host: api.example.com` (the path carries cm's query).
    Matched,
}

impl LoadMode {
    fn arg(self) -> &'static str {
        match self {
            LoadMode::Spread => "spread",
            LoadMode::Half => "half",
            LoadMode::Matched => "matched",
        }
    }
}

/// One measured configuration.
#[derive(Debug, Clone, Copy)]
pub struct Variant {
    pub id: &'static str,
    pub what: &'static str,
    pub filter: FilterVariant,
    /// The plugin configuration rendered into the template (ignored when
    /// the filter entry is removed or replaced; the no-op module ignores it).
    pub plugin: &'static str,
    pub load: LoadMode,
    /// The path requested: `/`, or one of [`configs::RESPONSE_BODIES`] for a
    /// chat completion of that size from the upstream.
    pub path: &'static str,
    pub needs_gateway: bool,
}

pub const VARIANTS: [Variant; 21] = [
    Variant {
        id: "a",
        what: "Envoy, no rate-limit filter",
        filter: FilterVariant::None,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "a2",
        what: "Envoy + no-op wasm filter",
        filter: FilterVariant::Noop,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "a3",
        what: "Envoy + a wasm module making c1's host calls and nothing else (the floor under c1)",
        filter: FilterVariant::HostCalls,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "b",
        what: "Envoy native local_ratelimit, per-client bucket",
        filter: FilterVariant::Native,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "c1",
        what: "this filter, 1 local rule",
        filter: FilterVariant::Shipped,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "c4",
        what: "this filter, 4 local rules with burst sub-limits",
        filter: FilterVariant::Shipped,
        plugin: C4_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "cc",
        what: "this filter, c1's rule and a concurrency cap per client",
        filter: FilterVariant::Shipped,
        plugin: CC_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "cm",
        what: "this filter, 1 rule matched on host, route name and query, keyed on the IPv4 /24",
        filter: FilterVariant::Shipped,
        plugin: CM_JSON,
        load: LoadMode::Matched,
        path: "/?api_key=bench",
        needs_gateway: false,
    },
    Variant {
        id: "d",
        what: "this filter, 1 global rule, checks coalesced (one batch call per worker in flight)",
        filter: FilterVariant::Shipped,
        plugin: D_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: true,
    },
    Variant {
        id: "d2",
        what: "as d, the gateway's cluster over HTTP/2 (h2c) instead of HTTP/1 keep-alive",
        filter: FilterVariant::ShippedH2,
        plugin: D_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: true,
    },
    Variant {
        id: "dg",
        what: "as d, by dispatch_grpc_call to the gateway's gRPC API (`transport: grpc`, HTTP/2)",
        filter: FilterVariant::ShippedGrpc,
        plugin: DG_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: true,
    },
    Variant {
        id: "d1",
        what: "as d, one call per request (`coalesce_us: 0`, protocol version 2)",
        filter: FilterVariant::Shipped,
        plugin: D1_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: true,
    },
    Variant {
        id: "g",
        what: "Envoy's native ratelimit filter, the gateway over gRPC per request (fixed window)",
        filter: FilterVariant::NativeRls,
        plugin: D_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: true,
    },
    Variant {
        id: "e",
        what: "this filter, 1 global rule in lease mode (batches of 5%)",
        filter: FilterVariant::Shipped,
        plugin: E_JSON,
        load: LoadMode::Spread,
        path: "/",
        needs_gateway: true,
    },
    Variant {
        id: "b-f",
        what: "as b, half the requests over the limit",
        filter: FilterVariant::Native,
        plugin: C1_JSON,
        load: LoadMode::Half,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "c1-f",
        what: "as c1, half the requests over the limit",
        filter: FilterVariant::Shipped,
        plugin: C1_JSON,
        load: LoadMode::Half,
        path: "/",
        needs_gateway: false,
    },
    Variant {
        id: "d-f",
        what: "as c1-f, the rejected client over a global rule (per request; the deny cache)",
        filter: FilterVariant::Shipped,
        plugin: DF_JSON,
        load: LoadMode::Half,
        path: "/",
        needs_gateway: true,
    },
    Variant {
        id: "c1-1k",
        what: "as c1, the upstream answering a 1 KiB chat completion (JSON)",
        filter: FilterVariant::Shipped,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        path: "/chat-1k",
        needs_gateway: false,
    },
    Variant {
        id: "cu-1k",
        what: "c1's rule charged from the 1 KiB response body (`cost_from`, openai_chat preset)",
        filter: FilterVariant::Shipped,
        plugin: CU_JSON,
        load: LoadMode::Spread,
        path: "/chat-1k",
        needs_gateway: false,
    },
    Variant {
        id: "c1-64k",
        what: "as c1, the upstream answering a 64 KiB chat completion (JSON)",
        filter: FilterVariant::Shipped,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        path: "/chat-64k",
        needs_gateway: false,
    },
    Variant {
        id: "cu-64k",
        what: "c1's rule charged from the 64 KiB response body (`cost_from`, openai_chat preset)",
        filter: FilterVariant::Shipped,
        plugin: CU_JSON,
        load: LoadMode::Spread,
        path: "/chat-64k",
        needs_gateway: false,
    },
];

/// Client ids the load cycles through.
const CLIENTS: u32 = 1000;

// ---------------------------------------------------------------------------------------------
// Results.

/// One measured run of one variant.
#[derive(Debug, Clone)]
pub struct Run {
    pub variant: &'static str,
    pub repeat: u32,
    pub wrk: wrk::WrkResult,
    pub rss_mib: f64,
    /// CPU time (user + system, all threads) of the measured Envoy per
    /// request answered during the run, in µs.
    pub envoy_cpu_us: f64,
    /// Share of the machine's CPU that other processes used during the run.
    pub foreign_cpu: f64,
    /// How much the filter's (or the native limiter's) counters grew
    /// during the measured run.
    pub counters: BTreeMap<String, f64>,
}

/// Callers in the token file of the authenticating gateway: each call is
/// compared with every one of them (constant time), so the cost is measured
/// with a realistic file, not a single line.
pub const AUTH_CALLERS: usize = 100;

/// The token the bench's load sends to the authenticating gateway.
const AUTH_TOKEN: &str = "bench-caller-token-0099";

/// One gateway-vs-Redis round.
#[derive(Debug, Clone)]
pub struct GatewayRun {
    pub repeat: u32,
    pub gateway: wrk::WrkResult,
    /// The same load on the gateway with `--auth-tokens`.
    pub gateway_auth: wrk::WrkResult,
    /// CPU time (user + system, all threads) of the plain gateway per check
    /// answered during its measured run, in µs.
    pub gateway_cpu_us: f64,
    /// The same of the authenticating gateway.
    pub gateway_auth_cpu_us: f64,
    /// Authentication and the policy lookup, timed in process (`bench/lookup.rs`).
    pub lookup: lookup::LookupCost,
    /// `ShouldRateLimit` calls on the plain gateway's `--grpc-listen`.
    pub grpc: wrk::WrkResult,
    /// CPU seconds of the gRPC load's `h2load` processes ÷ the gateway's
    /// over the same run: well below 1, the load generator is not the ceiling.
    pub grpc_generator_share: f64,
    pub redis: gateway::BenchResult,
    /// `POST /v3/check` calls of [`gateway::BATCH_CHECKS`] checks on the
    /// plain gateway.
    pub batch: wrk::WrkResult,
    /// `EVALSHA` calls of the batch script with the same checks.
    pub redis_batch: gateway::BenchResult,
    pub foreign_cpu: f64,
}

/// Everything the report needs.
#[derive(Debug, Clone)]
pub struct Session {
    pub args: Args,
    pub machine: machine::Machine,
    pub quiet: machine::Quiet,
    pub load_at_end: [f64; 3],
    pub started_utc: String,
    pub duration: Duration,
    pub runs: Vec<Run>,
    pub gateway_runs: Vec<GatewayRun>,
    pub wasm: BTreeMap<String, serde_json::Value>,
    pub notes: Vec<String>,
}

// ---------------------------------------------------------------------------------------------

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn utc_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// A baseline module (`testkit::paths::fixture_wasm_path`), which must be built.
fn baseline_wasm_path(env: &str, file: &str, package: &str) -> Result<PathBuf> {
    let path = testkit::paths::fixture_wasm_path(env, file);
    if !path.is_file() {
        bail!(
            "{} is missing: run `cargo build --release --target wasm32-wasip1 -p {package}`",
            path.display()
        );
    }
    Ok(path)
}

/// The release gateway (`$RATELIMIT_GATEWAY_BIN`, else `target/release`):
/// the debug build that the tests use would measure the compiler's debug
/// code, not the gateway.
fn release_gateway() -> Result<PathBuf> {
    let path = match std::env::var_os(testkit::paths::GATEWAY_BIN_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => target_dir().join("release/ratelimit-gateway"),
    };
    if !path.is_file() {
        bail!(
            "{} is missing: run `cargo build --release -p ratelimit-gateway`",
            path.display()
        );
    }
    // testkit's Gateway starts $RATELIMIT_GATEWAY_BIN.
    std::env::set_var(testkit::paths::GATEWAY_BIN_ENV, &path);
    Ok(path)
}

fn require(program: &str, package: &str) -> Result<()> {
    let found = std::process::Command::new(program)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok();
    if !found {
        bail!("{program} not found: install the Debian package {package} (`make bench` does)");
    }
    Ok(())
}

fn run() -> Result<()> {
    let args = parse_args()?;
    ctrlc::set_handler(|| {
        eprintln!("\ninterrupted: stopping everything the bench started");
        stop_children_from_signal();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;

    // Everything must be there before anything is measured.
    let envoy = envoy_bin()?;
    let wasm = wasm_path()?;
    let baselines = configs::Baselines {
        noop: baseline_wasm_path("NOOP_FILTER_WASM", "noop_filter.wasm", "noop-filter")?,
        host_calls: baseline_wasm_path(
            "HOSTCALLS_FILTER_WASM",
            "hostcalls_filter.wasm",
            "hostcalls-filter",
        )?,
    };
    require("wrk", "wrk")?;
    require("redis-benchmark", "redis-tools")?;
    let needs_gateway = VARIANTS
        .iter()
        .any(|v| v.needs_gateway && args.selected(v.id))
        || args.selected("gw");
    if needs_gateway {
        release_gateway()?;
    }
    std::fs::create_dir_all(&args.work_dir)
        .with_context(|| format!("creating {}", args.work_dir.display()))?;
    let load_lua = args.work_dir.join("load.lua");
    std::fs::write(&load_lua, wrk::LOAD_LUA).context("writing load.lua")?;
    let gateway_lua = args.work_dir.join("gateway.lua");
    std::fs::write(&gateway_lua, wrk::GATEWAY_LUA).context("writing gateway.lua")?;

    let machine = machine::Machine::read(&envoy);
    eprintln!(
        "bench: {} CPUs ({}), {} MiB, Envoy {}",
        machine.nproc, machine.cpu_model, machine.mem_total_mib, machine.envoy_version
    );
    let quiet = machine::wait_quiet(0.8, args.wait_quiet);
    eprintln!(
        "bench: load average {:.2} {:.2} {:.2} ({})",
        quiet.load_at_start[0],
        quiet.load_at_start[1],
        quiet.load_at_start[2],
        if quiet.quiet { "quiet" } else { "NOT quiet" }
    );
    let started_utc = utc_now();
    let t0 = Instant::now();

    let infra = Infra::start(&args, &wasm, needs_gateway, machine.nproc)?;
    let ctx = RunContext {
        args: &args,
        wasm: &wasm,
        baselines: &baselines,
        upstream_port: infra.upstream.ports().upstream,
        gateway_port: infra
            .gateway
            .as_ref()
            .map_or(testkit::config::DEFAULT_GATEWAY_PORT, Gateway::port),
        grpc_port: infra.grpc_port,
        load_lua: &load_lua,
        nproc: machine.nproc,
        infra_pids: infra.pids(),
        redis: infra.redis.as_ref(),
    };
    let runs = ctx.run_variants()?;
    let gateway_runs = match (&infra.redis, &infra.gateway, &infra.gateway_auth) {
        (Some(r), Some(g), Some(ga)) if args.selected("gw") => {
            ctx.run_gateways(g, ga, r, &gateway_lua)?
        }
        _ => Vec::new(),
    };
    infra.stop()?;

    let (wasm_figures, notes) = read_wasm_figures(&args.wasm_results)?;
    let session = Session {
        args: args.clone(),
        machine,
        quiet,
        load_at_end: machine::loadavg(),
        started_utc,
        duration: t0.elapsed(),
        runs,
        gateway_runs,
        wasm: wasm_figures,
        notes,
    };
    publish(&session)
}

/// The figures `tests/bench_fuel.rs` wrote into `dir`, and a note for each
/// one missing.
fn read_wasm_figures(dir: &Path) -> Result<(BTreeMap<String, serde_json::Value>, Vec<String>)> {
    let mut figures = BTreeMap::new();
    let mut notes = Vec::new();
    for name in ["fuel", "usage", "footprint"] {
        let file = dir.join(format!("{name}.json"));
        match std::fs::read_to_string(&file) {
            Ok(text) => {
                let v: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("parsing {}", file.display()))?;
                figures.insert(name.to_string(), v);
            }
            Err(_) => notes.push(format!(
                "{} not found: run `BENCH_WASM_OUT={} cargo test --test bench_fuel -- \
                 --include-ignored` (make bench does)",
                file.display(),
                dir.display()
            )),
        }
    }
    Ok((figures, notes))
}

/// Writes `results.json`, the chart and the Markdown section (into the
/// workspace's BENCHMARKS.md and BENCHMARKS.svg with `--publish`, else into
/// the work directory).
fn publish(session: &Session) -> Result<()> {
    let args = &session.args;
    let json_path = args.work_dir.join("results.json");
    std::fs::write(
        &json_path,
        format!("{:#}\n", results_json::to_json(session)),
    )
    .with_context(|| format!("writing {}", json_path.display()))?;
    let dir = if args.publish {
        workspace_root()
    } else {
        args.work_dir.clone()
    };
    let (md_path, svg_path) = (dir.join("BENCHMARKS.md"), dir.join("BENCHMARKS.svg"));
    chart::write(&svg_path, session)?;
    let section = report::markdown(session, "BENCHMARKS.svg");
    report::write_section(&md_path, &section)?;
    println!("{section}");
    eprintln!(
        "bench: wrote {}, {} and {} in {:.0} s",
        md_path.display(),
        svg_path.display(),
        json_path.display(),
        session.duration.as_secs_f64()
    );
    Ok(())
}
