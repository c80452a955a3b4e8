//! `make bench`: throughput, latency and memory of Envoy with and without the
//! rate-limit filter, the gateway against raw Redis, and the report
//! (BENCHMARKS.md, BENCHMARKS.svg).
//!
//! Every variant runs in one session, interleaved (a a2 a3 b c1 c4 d g e b-f c1-f d-f,
//! then again, `--repeats` times), each on a fresh Envoy (`--concurrency 2`,
//! the same flags in every variant) whose configuration is the shipped
//! template `envoy/envoy.yaml` rendered by testkit and then changed only in
//! the rate-limit filter entry (see `bench/configs.rs`). All of them forward
//! to the same upstream: a separate Envoy (`--concurrency 1`, pinned to the
//! last CPU) serving the template's own `direct_response` listener. The load
//! is `wrk` (`bench/load.lua`): 1000 client ids in turn, or, for the f
//! variants, every other request from a client the limiter rejects.
//!
//! Then the gateway alone (`bench/gateway.rs`): wrk on `POST /v1/check`
//! against `redis-benchmark` running `EVALSHA` of `check.lua` on the same
//! Redis, and the same load on a second gateway that authenticates every
//! call (`--auth-tokens` with [`AUTH_CALLERS`] callers; the bearer token in
//! every request). The wasm-level figures (instructions per decision, shared-data
//! footprint) come from `tests/bench_fuel.rs`, which `make bench` runs first
//! with `BENCH_WASM_OUT` pointing at `--wasm-results`.
//!
//! Usage: `bench [--repeats N] [--seconds S] [--warmup S] [--connections C]
//! [--threads T] [--only a,c1,...] [--wait-quiet SECONDS] [--work-dir DIR]
//! [--wasm-results DIR] [--publish]`. Without `--publish` the report goes to
//! `<work-dir>/BENCHMARKS.md` and `.svg` only; with it, into the workspace's
//! `BENCHMARKS.md` (between its result markers) and `BENCHMARKS.svg`.

#[path = "bench/chart.rs"]
mod chart;
#[path = "bench/configs.rs"]
mod configs;
#[path = "bench/gateway.rs"]
mod gateway;
#[path = "bench/lookup.rs"]
mod lookup;
#[path = "bench/machine.rs"]
mod machine;
#[path = "bench/report.rs"]
mod report;
#[path = "bench/stats.rs"]
mod stats;
#[path = "bench/wrk.rs"]
mod wrk;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use configs::FilterVariant;
use testkit::paths::target_dir;
use testkit::redis::Redis;
use testkit::{
    envoy_bin, free_port, wasm_path, workspace_root, Envoy, EnvoyOptions, Gateway, GatewayOptions,
    Ports,
};

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

/// What the wrk script sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadMode {
    /// Clients c0..c999 in turn: nothing is rejected.
    Spread,
    /// Every other request from client `over`, whom the limiter rejects.
    Half,
}

impl LoadMode {
    fn arg(self) -> &'static str {
        match self {
            LoadMode::Spread => "spread",
            LoadMode::Half => "half",
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
    pub needs_gateway: bool,
}

pub const VARIANTS: [Variant; 12] = [
    Variant {
        id: "a",
        what: "Envoy, no rate-limit filter",
        filter: FilterVariant::None,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        needs_gateway: false,
    },
    Variant {
        id: "a2",
        what: "Envoy + no-op wasm filter",
        filter: FilterVariant::Noop,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        needs_gateway: false,
    },
    Variant {
        id: "a3",
        what: "Envoy + a wasm module making c1's host calls and nothing else (the floor under c1)",
        filter: FilterVariant::HostCalls,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        needs_gateway: false,
    },
    Variant {
        id: "b",
        what: "Envoy native local_ratelimit, per-client bucket",
        filter: FilterVariant::Native,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        needs_gateway: false,
    },
    Variant {
        id: "c1",
        what: "this filter, 1 local rule",
        filter: FilterVariant::Shipped,
        plugin: C1_JSON,
        load: LoadMode::Spread,
        needs_gateway: false,
    },
    Variant {
        id: "c4",
        what: "this filter, 4 local rules with burst sub-limits",
        filter: FilterVariant::Shipped,
        plugin: C4_JSON,
        load: LoadMode::Spread,
        needs_gateway: false,
    },
    Variant {
        id: "d",
        what: "this filter, 1 global rule (gateway + Redis callout per request)",
        filter: FilterVariant::Shipped,
        plugin: D_JSON,
        load: LoadMode::Spread,
        needs_gateway: true,
    },
    Variant {
        id: "g",
        what: "Envoy's native ratelimit filter, the gateway over gRPC per request (fixed window)",
        filter: FilterVariant::NativeRls,
        plugin: D_JSON,
        load: LoadMode::Spread,
        needs_gateway: true,
    },
    Variant {
        id: "e",
        what: "this filter, 1 global rule in lease mode (batches of 5%)",
        filter: FilterVariant::Shipped,
        plugin: E_JSON,
        load: LoadMode::Spread,
        needs_gateway: true,
    },
    Variant {
        id: "b-f",
        what: "as b, half the requests over the limit",
        filter: FilterVariant::Native,
        plugin: C1_JSON,
        load: LoadMode::Half,
        needs_gateway: false,
    },
    Variant {
        id: "c1-f",
        what: "as c1, half the requests over the limit",
        filter: FilterVariant::Shipped,
        plugin: C1_JSON,
        load: LoadMode::Half,
        needs_gateway: false,
    },
    Variant {
        id: "d-f",
        what: "as c1-f, the rejected client over a global rule (per request; the deny cache)",
        filter: FilterVariant::Shipped,
        plugin: DF_JSON,
        load: LoadMode::Half,
        needs_gateway: true,
    },
];

/// Client ids the load cycles through.
const CLIENTS: u32 = 1000;

/// Command-line options.
#[derive(Debug, Clone)]
pub struct Args {
    pub repeats: u32,
    pub seconds: u32,
    pub warmup: u32,
    pub connections: u32,
    pub threads: u32,
    pub only: Option<Vec<String>>,
    pub wait_quiet: Duration,
    pub work_dir: PathBuf,
    pub wasm_results: PathBuf,
    pub publish: bool,
    pub command: String,
}

const USAGE: &str = "usage: bench [--repeats N] [--seconds S] [--warmup S] [--connections C] \
                     [--threads T] [--only a,a2,a3,b,c1,c4,d,g,e,b-f,c1-f,d-f,gw] [--wait-quiet SECONDS] \
                     [--work-dir DIR] [--wasm-results DIR] [--publish]";

fn parse_args() -> Result<Args> {
    parse_args_from(std::env::args().skip(1).collect())
}

/// [`parse_args`] of `argv` (the arguments after the program's name).
fn parse_args_from(argv: Vec<String>) -> Result<Args> {
    let work = target_dir().join("bench");
    let mut args = Args {
        repeats: 4,
        seconds: 5,
        warmup: 2,
        connections: 32,
        threads: 1,
        only: None,
        wait_quiet: Duration::ZERO,
        wasm_results: work.join("wasm"),
        work_dir: work,
        publish: false,
        command: std::env::var("BENCH_COMMAND").unwrap_or_else(|_| {
            std::iter::once("bench".to_string())
                .chain(argv.iter().cloned())
                .collect::<Vec<_>>()
                .join(" ")
        }),
    };
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        let mut number = |range: std::ops::RangeInclusive<u32>| -> Result<u32> {
            let v = it.next().context(USAGE)?;
            v.parse::<u32>()
                .ok()
                .filter(|n| range.contains(n))
                .with_context(|| format!("{arg} wants a number in {range:?}, not {v:?}"))
        };
        match arg.as_str() {
            "--repeats" => args.repeats = number(1..=100)?,
            "--seconds" => args.seconds = number(1..=600)?,
            "--warmup" => args.warmup = number(0..=600)?,
            "--connections" => args.connections = number(1..=10_000)?,
            "--threads" => args.threads = number(1..=64)?,
            "--wait-quiet" => args.wait_quiet = Duration::from_secs(number(0..=3600)?.into()),
            "--only" => {
                let list = it.next().context(USAGE)?;
                let ids: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
                for id in &ids {
                    if id != "gw" && !VARIANTS.iter().any(|v| v.id == id) {
                        bail!("unknown variant {id:?}\n{USAGE}");
                    }
                }
                args.only = Some(ids);
            }
            "--work-dir" => args.work_dir = PathBuf::from(it.next().context(USAGE)?),
            "--wasm-results" => args.wasm_results = PathBuf::from(it.next().context(USAGE)?),
            "--publish" => args.publish = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if args.threads > args.connections {
        bail!("--threads must not exceed --connections");
    }
    // The policy lookup is timed in this process (bench/lookup.rs): a debug
    // build would publish a share ten times too large.
    if args.publish && cfg!(debug_assertions) {
        bail!("--publish needs a release build of the bench (cargo run --release)");
    }
    Ok(args)
}

impl Args {
    fn selected(&self, id: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|ids| ids.iter().any(|i| i == id))
    }
}

// ---------------------------------------------------------------------------------------------
// Children, for Ctrl-C.

/// PIDs of the long-running processes started and not yet stopped.
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn register(pid: Option<u32>) {
    if let (Some(pid), Ok(mut c)) = (pid, CHILDREN.lock()) {
        c.push(pid);
    }
}

fn unregister(pid: Option<u32>) {
    if let (Some(pid), Ok(mut c)) = (pid, CHILDREN.lock()) {
        c.retain(|p| *p != pid);
    }
}

fn children() -> Vec<u32> {
    CHILDREN.lock().map(|c| c.clone()).unwrap_or_default()
}

/// SIGTERM to every registered child (by its own PID), newest first.
fn stop_children_from_signal() {
    let pids = children();
    for pid in pids.iter().rev() {
        if let Ok(pid) = libc::pid_t::try_from(*pid) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
    }
}

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

/// The processes every variant shares: the upstream Envoy, and Redis and the
/// gateway (for d and the gateway bench).
struct Infra {
    upstream: Envoy,
    /// The plain gateway's `--grpc-listen` port (variant g).
    grpc_port: u16,
    redis: Option<Redis>,
    gateway: Option<Gateway>,
    /// The same gateway with `--auth-tokens`.
    gateway_auth: Option<Gateway>,
}

impl Infra {
    fn start(args: &Args, wasm: &Path, needs_gateway: bool, nproc: usize) -> Result<Infra> {
        let mut redis = None;
        let mut gateway = None;
        let mut gateway_auth = None;
        let grpc_port = free_port()?;
        if needs_gateway {
            let r = Redis::start()?;
            register(r.pid());
            // The gateway's policy: the plugin configurations of d and e (and
            // of the wrk script, which is d's domain and rule).
            let opts = GatewayOptions::new(r.url())
                .policy(D_JSON)
                .policy(E_JSON)
                .policy(DF_JSON)
                .work_dir(args.work_dir.join("gateway"));
            let rls = args.work_dir.join("rls.yaml");
            std::fs::write(&rls, configs::RLS_CONFIG).context("writing the bench's rls config")?;
            let grpc = format!("127.0.0.1:{grpc_port}");
            let rls = rls.display().to_string();
            let g =
                Gateway::start(
                    opts.clone()
                        .args(&["--grpc-listen", &grpc, "--rls-config", &rls]),
                )?;
            register(g.pid());
            let tokens = args.work_dir.join("gateway-tokens");
            let mut text = String::new();
            for i in 0..AUTH_CALLERS {
                text.push_str(&format!("bench bench-caller-token-{i:04}\n"));
            }
            std::fs::write(&tokens, text).context("writing the bench's token file")?;
            let tokens = tokens.display().to_string();
            let ga = Gateway::start(
                opts.args(&["--auth-tokens", &tokens])
                    .work_dir(args.work_dir.join("gateway-auth")),
            )?;
            register(ga.pid());
            redis = Some(r);
            gateway = Some(g);
            gateway_auth = Some(ga);
        }
        let ports = Ports::free()?;
        let dir = args.work_dir.join("upstream");
        std::fs::create_dir_all(&dir)?;
        let yaml = dir.join("upstream.yaml");
        std::fs::write(&yaml, configs::upstream_config(ports, wasm)?)?;
        let mut opts = EnvoyOptions::new("{}").ports(ports);
        opts.template = Some(yaml);
        opts.wasm = Some(wasm.to_path_buf());
        opts.concurrency = 1;
        opts.log_level = "warning".into();
        opts.component_log_level = "wasm:warning".into();
        opts.work_dir = Some(dir.join("run"));
        let upstream = Envoy::start(opts)?;
        register(Some(upstream.pid()));
        let cpu = nproc.saturating_sub(1);
        machine::pin_process(upstream.pid(), cpu)
            .with_context(|| format!("pinning the upstream Envoy to CPU {cpu}"))?;
        Ok(Infra {
            upstream,
            grpc_port,
            redis,
            gateway,
            gateway_auth,
        })
    }

    fn pids(&self) -> Vec<u32> {
        [
            Some(self.upstream.pid()),
            self.gateway.as_ref().and_then(Gateway::pid),
            self.gateway_auth.as_ref().and_then(Gateway::pid),
            self.redis.as_ref().and_then(Redis::pid),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn stop(mut self) -> Result<()> {
        unregister(Some(self.upstream.pid()));
        self.upstream.stop()?;
        for mut g in [self.gateway.take(), self.gateway_auth.take()]
            .into_iter()
            .flatten()
        {
            unregister(g.pid());
            g.stop()?;
        }
        if let Some(mut r) = self.redis.take() {
            unregister(r.pid());
            r.kill();
        }
        Ok(())
    }
}

/// The figures `tests/bench_fuel.rs` wrote into `dir`, and a note for each
/// one missing.
fn read_wasm_figures(dir: &Path) -> Result<(BTreeMap<String, serde_json::Value>, Vec<String>)> {
    let mut figures = BTreeMap::new();
    let mut notes = Vec::new();
    for name in ["fuel", "footprint"] {
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
    std::fs::write(&json_path, format!("{:#}\n", report::to_json(session)))
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

/// What every run needs.
struct RunContext<'a> {
    args: &'a Args,
    wasm: &'a Path,
    baselines: &'a configs::Baselines,
    upstream_port: u16,
    gateway_port: u16,
    grpc_port: u16,
    load_lua: &'a Path,
    nproc: usize,
    /// The long-running children (upstream, gateway, Redis), for the CPU accounting.
    infra_pids: Vec<u32>,
}

/// Counters read from the measured Envoy after a run (Prometheus names).
const COUNTERS: [&str; 9] = [
    "ratelimit_wasm_requests_allowed",
    "ratelimit_wasm_requests_denied",
    "ratelimit_wasm_global_calls",
    "ratelimit_wasm_global_failures",
    "ratelimit_wasm_circuit_open_skips",
    "ratelimit_wasm_errors",
    "ratelimit_wasm_lease_served",
    "ratelimit_wasm_lease_fetches",
    "ratelimit_wasm_deny_cache_hits",
];

/// The filter's counters ([`COUNTERS`]) and the native limiter's
/// (`envoy_http_local_rate_limit_*`) that Envoy shows.
fn counters(envoy: &Envoy) -> Result<BTreeMap<String, f64>> {
    let page = envoy.stats_prometheus()?;
    let mut counters: BTreeMap<String, f64> = COUNTERS
        .iter()
        .filter_map(|&n| Some((n.to_string(), testkit::prometheus_value(&page, n)?)))
        .collect();
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        if let Some((name, value)) = line.split_once(' ') {
            if name.starts_with("envoy_http_local_rate_limit_") {
                let name = name.split('{').next().unwrap_or(name).to_string();
                if let Ok(x) = value.trim().parse::<f64>() {
                    *counters.entry(name).or_insert(0.0) += x;
                }
            }
        }
    }
    Ok(counters)
}

/// Connections accepted so far by worker `worker` of the measured listener.
fn worker_connections(envoy: &Envoy, worker: usize) -> Result<f64> {
    let name = format!(
        "listener.127.0.0.1_{}.worker_{worker}.downstream_cx_total",
        envoy.ports().listen
    );
    Ok(envoy.stat(&name)?.unwrap_or(0) as f64)
}

impl RunContext<'_> {
    /// Every selected variant once per round, `--repeats` rounds.
    fn run_variants(&self) -> Result<Vec<Run>> {
        let mut runs = Vec::new();
        for repeat in 0..self.args.repeats {
            for v in VARIANTS.iter().filter(|v| self.args.selected(v.id)) {
                let run = self.run_variant(v, repeat)?;
                eprintln!(
                    "bench: round {}/{} {:5} {:>9.0} req/s  p50 {:6.3} ms  p99 {:6.3} ms  \
                     non-2xx {:>7}  Envoy CPU {:5.1} µs/req  RSS {:6.1} MiB  other CPU {:4.1} %",
                    repeat + 1,
                    self.args.repeats,
                    v.id,
                    run.wrk.rps,
                    run.wrk.p50_ms,
                    run.wrk.p99_ms,
                    run.wrk.non_2xx,
                    run.envoy_cpu_us,
                    run.rss_mib,
                    run.foreign_cpu * 100.0
                );
                runs.push(run);
            }
        }
        Ok(runs)
    }

    /// The gateway against raw EVALSHA, `--repeats` rounds.
    fn run_gateways(
        &self,
        g: &Gateway,
        ga: &Gateway,
        r: &Redis,
        script: &Path,
    ) -> Result<Vec<GatewayRun>> {
        let sha = gateway::load_script(r)?;
        gateway::check_once(r, &sha)?;
        let mut runs = Vec::new();
        for repeat in 0..self.args.repeats {
            let run = self.run_gateway(repeat, g, ga, r, &sha, script)?;
            eprintln!(
                "bench: round {}/{} gateway {:>9.0} checks/s (p50 {:.3} ms, p99 {:.3} ms)  \
                 with auth {:>9.0} checks/s (p50 {:.3} ms, p99 {:.3} ms)  \
                 gRPC {:>9.0} checks/s (p50 {:.3} ms, p99 {:.3} ms; h2load CPU {:.2}× the gateway's)  \
                 redis-benchmark EVALSHA {:>9.0}/s (p50 {:.3} ms, p99 {:.3} ms)",
                repeat + 1,
                self.args.repeats,
                run.gateway.rps,
                run.gateway.p50_ms,
                run.gateway.p99_ms,
                run.gateway_auth.rps,
                run.gateway_auth.p50_ms,
                run.gateway_auth.p99_ms,
                run.grpc.rps,
                run.grpc.p50_ms,
                run.grpc.p99_ms,
                run.grpc_generator_share,
                run.redis.rps,
                run.redis.p50_ms,
                run.redis.p99_ms
            );
            runs.push(run);
        }
        Ok(runs)
    }

    /// Starts a fresh Envoy for `v` (its derived configuration is kept in
    /// `<work-dir>/runs/<id>/envoy-derived.yaml`), loads it, stops it.
    fn run_variant(&self, v: &Variant, repeat: u32) -> Result<Run> {
        let ports = Ports {
            listen: free_port()?,
            admin: free_port()?,
            upstream: self.upstream_port,
        };
        let yaml = configs::proxy_config(
            v.filter,
            ports,
            self.gateway_port,
            self.grpc_port,
            self.wasm,
            self.baselines,
            v.plugin,
        )?;
        let dir = self.args.work_dir.join("runs").join(v.id);
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("envoy-derived.yaml");
        std::fs::write(&config, &yaml)?;

        let mut opts = EnvoyOptions::new(v.plugin).ports(ports);
        opts.template = Some(config);
        opts.wasm = Some(self.wasm.to_path_buf());
        opts.gateway_port = Some(self.gateway_port);
        opts.concurrency = 2;
        opts.log_level = "warning".into();
        opts.component_log_level = "wasm:warning".into();
        opts.work_dir = Some(dir.join("run"));
        let mut envoy = Envoy::start(opts).with_context(|| format!("starting variant {}", v.id))?;
        register(Some(envoy.pid()));
        let result = self.measure(v, repeat, &envoy);
        unregister(Some(envoy.pid()));
        let stopped = envoy.stop();
        let run = result.with_context(|| {
            format!(
                "variant {} (Envoy log: {})",
                v.id,
                envoy.log_path().display()
            )
        })?;
        stopped?;
        Ok(run)
    }

    fn measure(&self, v: &Variant, repeat: u32, envoy: &Envoy) -> Result<Run> {
        let mut load = wrk::Load {
            url: envoy.url("/"),
            script: self.load_lua,
            script_args: vec![v.load.arg().to_string(), CLIENTS.to_string()],
            threads: self.args.threads,
            connections: self.args.connections,
            seconds: self.args.warmup,
        };
        if self.args.warmup > 0 {
            wrk::run(&load).context("warm-up")?;
        }
        load.seconds = self.args.seconds;
        let mut pids = self.infra_pids.clone();
        pids.push(envoy.pid());
        let counters_before = counters(envoy)?;
        let workers_before = (0..2)
            .map(|w| worker_connections(envoy, w))
            .collect::<Result<Vec<_>>>()?;
        let before = machine::CpuSnapshot::take(&pids);
        let envoy_cpu_before = machine::process_cpu_seconds(envoy.pid(), false);
        let result = wrk::run(&load)?;
        let envoy_cpu = machine::process_cpu_seconds(envoy.pid(), false) - envoy_cpu_before;
        let after = machine::CpuSnapshot::take(&pids);
        let rss_mib = machine::rss_mib(envoy.pid())?;
        let envoy_cpu_us = envoy_cpu * 1e6 / result.requests.max(1) as f64;
        let mut counters = counters(envoy)?;
        for (name, value) in counters.iter_mut() {
            *value -= counters_before.get(name).copied().unwrap_or(0.0);
        }
        // How the kernel spread the measured run's connections over the workers.
        for (worker, before) in workers_before.iter().enumerate() {
            counters.insert(
                format!("worker_{worker}_connections"),
                worker_connections(envoy, worker)? - before,
            );
        }
        Ok(Run {
            variant: v.id,
            repeat,
            wrk: result,
            rss_mib,
            envoy_cpu_us,
            foreign_cpu: before.foreign_share(&after, self.nproc),
            counters,
        })
    }

    fn run_gateway(
        &self,
        repeat: u32,
        g: &Gateway,
        ga: &Gateway,
        redis: &Redis,
        sha: &str,
        script: &Path,
    ) -> Result<GatewayRun> {
        let mut load = wrk::Load {
            url: g.url("/v1/check"),
            script,
            script_args: vec![gateway::CLIENTS.to_string()],
            threads: self.args.threads,
            connections: self.args.connections,
            seconds: self.args.warmup.max(1),
        };
        wrk::run(&load).context("gateway warm-up")?;
        load.seconds = self.args.seconds;
        let before = machine::CpuSnapshot::take(&self.infra_pids);
        // Non-2xx answers (503: Redis timed out) are counted in the report.
        // The two gateways take turns going first, so that neither always
        // meets the Redis the other one warmed.
        let mut auth = load.clone();
        auth.url = ga.url("/v1/check");
        auth.script_args.push(AUTH_TOKEN.to_string());
        auth.seconds = self.args.warmup.max(1);
        wrk::run(&auth).context("authenticating gateway warm-up")?;
        auth.seconds = self.args.seconds;
        // Each gateway's own CPU time per check, from /proc around its run.
        let timed = |l: &wrk::Load, gw: &Gateway| -> Result<(wrk::WrkResult, f64)> {
            let pid = gw.pid().context("the gateway has no pid")?;
            let cpu = machine::process_cpu_seconds(pid, false);
            let r = wrk::run(l)?;
            let cpu = machine::process_cpu_seconds(pid, false) - cpu;
            let per_check = cpu * 1e6 / r.requests.max(1) as f64;
            Ok((r, per_check))
        };
        let ((gateway, gateway_cpu_us), (gateway_auth, gateway_auth_cpu_us)) =
            if repeat.is_multiple_of(2) {
                let plain = timed(&load, g)?;
                (plain, timed(&auth, ga)?)
            } else {
                let with_auth = timed(&auth, ga)?;
                (timed(&load, g)?, with_auth)
            };
        let tokens = std::fs::read_to_string(self.args.work_dir.join("gateway-tokens"))
            .context("reading the bench's token file")?;
        let lookup = lookup::measure(
            &[D_JSON, E_JSON, DF_JSON],
            &tokens,
            AUTH_TOKEN,
            gateway::CLIENTS,
            Duration::from_millis(500),
        )
        .context("timing authentication and the policy lookup")?;
        let grpc_dir = self.args.work_dir.join("grpc-load");
        gateway::grpc_load(
            g,
            self.grpc_port,
            self.args.connections,
            self.args.warmup.max(1),
            &grpc_dir,
        )
        .context("gRPC warm-up")?;
        let grpc = gateway::grpc_load(
            g,
            self.grpc_port,
            self.args.connections,
            self.args.seconds,
            &grpc_dir,
        )?;
        // Calibrate redis-benchmark's request count to last about as long.
        let probe = gateway::redis_benchmark(redis, sha, self.args.connections, 20_000)?;
        let n = (probe.rps * f64::from(self.args.seconds)).max(20_000.0) as u64;
        let redis_result = gateway::redis_benchmark(redis, sha, self.args.connections, n)?;
        let after = machine::CpuSnapshot::take(&self.infra_pids);
        Ok(GatewayRun {
            repeat,
            gateway,
            gateway_auth,
            gateway_cpu_us,
            gateway_auth_cpu_us,
            lookup,
            grpc: grpc.result,
            grpc_generator_share: grpc.generator_cpu_s / grpc.gateway_cpu_s.max(1e-9),
            redis: redis_result,
            foreign_cpu: before.foreign_share(&after, self.nproc),
        })
    }
}

#[cfg(test)]
mod tests {
    /// The policy lookup is timed in the bench's own process, so a debug
    /// build must not publish (`cargo test` builds this in debug).
    #[test]
    fn a_debug_build_refuses_to_publish() {
        let refused = super::parse_args_from(vec!["--publish".to_string()]);
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.to_string().contains("release build")),
            "{:?}",
            refused.map(|a| a.publish)
        );
        assert!(super::parse_args_from(vec!["--repeats".into(), "2".into()]).is_ok());
    }
}
