//! Soak with faults: steady load through two Envoys (`--concurrency 2`), one
//! `ratelimit-gateway` and one `redis-server`, while a chaos loop kills and
//! restarts Redis and the gateway at random points (seeded; the seed is
//! printed, `SOAK_SEED=<seed>` replays the same fault schedule).
//!
//! `SOAK_SECONDS` sets the length (default 28 s, the variant `make test`
//! runs; `make soak` runs 300 s); `SOAK_RATE` the total request rate (default
//! 250/s); `SOAK_REPORT=<file>` also writes the Markdown report there
//! (`RELIABILITY.md` quotes one). A failed run also writes every request
//! (client, proxy, path, sent and answered times, status,
//! `x-ratelimit-limit` and `-remaining`) to
//! `<target>/soak/records-<seed>.csv`.
//!
//! The plugin has a global rule `api` on `/api` (sliding window, `LIMIT` per
//! 10 s per client, `failure_mode: local`, `instances: 2`, circuit
//! `failures: 3, cooldown_ms: 1000`) and a local rule `static` on `/static`
//! (sliding window, `STATIC_LIMIT` per 10 s per client and proxy). Five heavy
//! clients send far more than their limits (three open a new connection per
//! request, two keep one connection per proxy), a light client stays well
//! within them. Recorded and asserted:
//!
//! * **Memory**: VmRSS of both Envoys and the gateway, and Envoy's heap
//!   (`server.memory_allocated`), every second; after a warm-up the average
//!   of the last third of the samples must not exceed the first third's by
//!   more than 20 % plus a small absolute slack (also for the longest-lived
//!   gateway process alone).
//! * **Admitted vs the limit** per client and epoch-aligned 10 s window (both
//!   the gateway's Redis script and the filter align sliding windows to the
//!   epoch). Every `/api` answer says who decided it in `x-ratelimit-limit`:
//!   `LIMIT` is the gateway, `LIMIT / instances` a proxy's local stand-in.
//!   With `G` the gateway's admissions, `S_p` proxy `p`'s stand-in admissions
//!   and `E` the number of Redis processes that lived in the window (a
//!   restarted Redis starts empty):
//!   `G ≤ LIMIT × E`, `S_p ≤ LIMIT / instances`, so
//!   admitted = `G + Σ S_p ≤ LIMIT × E + Σ_p S_p`; in a healthy window
//!   (no fault, no stand-in decision, `E = 1`) that is `admitted ≤ LIMIT`.
//!   `/static` admissions ≤ `STATIC_LIMIT` per proxy. A request is counted
//!   in a window only when it was sent and answered inside it (the decision
//!   lies in between); requests straddling a boundary are reported.
//! * **Statuses** by phase (healthy, Redis down, gateway down, both down,
//!   recovery): only 200 and 429 — `failure_mode: local` never answers 5xx —
//!   and no transport errors; the light client only ever gets 200.
//! * **No trap, no panic**: no Envoy log and not the gateway's mentions
//!   `panic`, `critical`, `RuntimeError` or `Uncaught`; Envoy never reloaded or recreated a VM
//!   (`wasm.ratelimit.vm_reload_*`, `wasm.envoy.wasm.runtime.v8.created`);
//!   `ratelimit_wasm_errors`, `ratelimit_wasm_corrupt_state` and
//!   `ratelimit_wasm_bucket_evictions` stay 0 (a set read as corrupt or an
//!   evicted bucket would forget a count, and the window bounds would not hold).
//! * **Recovery**: after every fault, the last one included (the run goes on
//!   long enough to see it), the gateway decides again: within the circuit's
//!   cooldown + 3 s when the gateway was restarted, within the cooldown +
//!   3.5 s = 4.5 s when it lived through a Redis outage (its Redis client's
//!   reconnect backoff, capped at 500 ms; RELIABILITY.md).
//! * **Coverage**: at least one healthy (client, window) pair, and at least
//!   one fault of each kind. A run shorter than 120 s (the 28 s variant)
//!   plans for both: its first epoch-aligned 10 s window that starts 2 s or
//!   more into the load is left without faults, and the three kinds follow
//!   it in a seeded order; so it lasts 28 s or up to about 8 s more, by
//!   where the clock's 10 s windows fall.
//!
//! Nothing is skipped: without Envoy, the wasm file, the gateway binary or
//! `redis-server` the test fails and says what to build or install.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use testkit::redis::Redis;
// SplitMix64: a small seeded generator, enough for a fault schedule.
use testkit::rng::Rng;
use testkit::{
    Client, ConnectionMode, Envoy, EnvoyOptions, Gateway, GatewayOptions, Request, Response,
};

/// The global rule: `LIMIT` per `WINDOW` per client, across both proxies.
const LIMIT: u64 = 50;
const INSTANCES: u64 = 2;
/// A proxy's stand-in while the gateway fails (`failure_mode: local`).
const SHARE: u64 = LIMIT / INSTANCES;
/// The local rule: `STATIC_LIMIT` per `WINDOW` per client, in each proxy.
const STATIC_LIMIT: u64 = 40;
const WINDOW_NS: u64 = 10_000_000_000;
const PROXIES: usize = 2;
const COOLDOWN_MS: u64 = 1000;
/// Callout timeout and the gateway's bound on a Redis round trip: generous,
/// so that a healthy debug gateway on a busy 2-core machine is not taken for
/// a failing one (a dead gateway or Redis fails fast: connection refused).
const TIMEOUT_MS: u64 = 250;
const REDIS_TIMEOUT_MS: u64 = 100;
/// How long after a fault is removed counts as recovery.
const RECOVERY: Duration = Duration::from_secs(2);
/// The gateway must decide again this soon after a fault is removed: a
/// gateway started afresh connects to Redis at once, so the circuit's
/// cooldown and a probe are all that remain.
const RECOVERED_WITHIN: Duration = Duration::from_millis(COOLDOWN_MS + 3000);
/// The same when the gateway lived through a Redis outage: its reconnect
/// attempts back off exponentially, capped at 500 ms between two attempts
/// (gateway/src/redis/store.rs), so it may wait that long more after Redis returns.
const RECOVERED_WITHIN_REDIS_ONLY: Duration = Duration::from_millis(COOLDOWN_MS + 3500);

/// A short run leaves the first epoch-aligned window that starts this long
/// into the load without faults (the healthy window it must have).
const HEALTHY_LEAD: Duration = Duration::from_secs(2);
/// Room the run keeps after a fault ends, so that the recovery check sees
/// every fault, the last one included.
const RECOVERY_ROOM: Duration = Duration::from_millis(COOLDOWN_MS + 3500 + 500);

/// Memory: allowed growth from the first to the last third of the samples.
const RSS_FACTOR: f64 = 1.2;
const ENVOY_RSS_SLACK_KB: f64 = 8.0 * 1024.0;
const GATEWAY_RSS_SLACK_KB: f64 = 4.0 * 1024.0;
/// The same rule for Envoy's own heap (`server.memory_allocated`).
const ENVOY_HEAP_SLACK_KB: f64 = 2.0 * 1024.0;

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
    )
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn plugin_config() -> String {
    json!({
        "domain": "soak",
        "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 0 },
        "global": {
            "cluster": "ratelimit_gateway",
            "timeout_ms": TIMEOUT_MS,
            "failure_mode": "local",
            "instances": INSTANCES,
            "circuit": { "failures": 3, "cooldown_ms": COOLDOWN_MS }
        },
        "rules": [
            { "name": "api", "scope": "global", "match": { "path_prefix": "/api" },
              "key": ["client"], "algorithm": "sliding_window",
              "limits": [{ "requests": LIMIT, "per": "10s" }] },
            { "name": "static", "match": { "path_prefix": "/static" },
              "key": ["client"], "algorithm": "sliding_window",
              "limits": [{ "requests": STATIC_LIMIT, "per": "10s" }] }
        ],
        "response": { "headers": "both" }
    })
    .to_string()
}

// ---------------------------------------------------------------------------
// Load.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    Api,
    Static,
}

/// One request as the client saw it.
#[derive(Debug, Clone, Copy)]
struct Rec {
    client: usize,
    proxy: usize,
    path: Path,
    sent_ns: u64,
    recv_ns: u64,
    /// 0: transport error.
    status: u16,
    /// `x-ratelimit-limit`, 0 when absent.
    limit: u64,
    /// `x-ratelimit-remaining` (`None` when absent): the deciding limiter's
    /// own count, which places the decision in its window.
    remaining: Option<u64>,
}

#[derive(Debug, Clone)]
struct ClientSpec {
    id: String,
    mode: ConnectionMode,
    rate: f64,
    /// Share of requests to `/static` (the rest go to `/api`).
    static_share: f64,
    heavy: bool,
}

fn clients(total_rate: f64) -> Vec<ClientSpec> {
    let light_rate = 1.5;
    let heavy_rate = ((total_rate - light_rate) / 5.0).max(1.0);
    let mut v: Vec<ClientSpec> = (0..5)
        .map(|i| ClientSpec {
            id: format!("heavy-{i}"),
            mode: if i < 3 {
                ConnectionMode::NewPerRequest
            } else {
                ConnectionMode::KeepAlive
            },
            rate: heavy_rate,
            static_share: 0.25,
            heavy: true,
        })
        .collect();
    // About 15 requests per window: under the stand-in's share of each proxy.
    v.push(ClientSpec {
        id: "light".to_string(),
        mode: ConnectionMode::NewPerRequest,
        rate: light_rate,
        static_share: 0.0,
        heavy: false,
    });
    v
}

/// Sends `spec`'s requests at its rate until `stop`, to a random proxy each.
fn load(
    index: usize,
    spec: &ClientSpec,
    urls: &[String],
    stop: &AtomicBool,
    mut rng: Rng,
) -> Vec<Rec> {
    let conns: Vec<Client> = urls
        .iter()
        .map(|u| Client::with_timeout(u.clone(), spec.mode, Duration::from_secs(5)))
        .collect();
    let api = Request::get("/api/items").header("x-client-id", &spec.id);
    let stat = Request::get("/static/app.js").header("x-client-id", &spec.id);
    let interval = Duration::from_secs_f64(1.0 / spec.rate);
    let mut recs = Vec::new();
    let mut next = Instant::now() + interval.mul_f64(rng.unit());
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        } else if now - next > Duration::from_secs(1) {
            // Fell behind (a slow answer): carry on at the rate, no burst.
            next = now;
        }
        next += interval;
        let proxy = (rng.next_u64() % urls.len() as u64) as usize;
        let path = if rng.unit() < spec.static_share {
            Path::Static
        } else {
            Path::Api
        };
        let req = match path {
            Path::Api => &api,
            Path::Static => &stat,
        };
        let sent_ns = now_ns();
        let r = conns[proxy].send(req);
        let recv_ns = now_ns();
        let (status, limit, remaining) = match &r {
            Ok(r) => (
                r.status,
                number(r, "x-ratelimit-limit").unwrap_or(0),
                number(r, "x-ratelimit-remaining"),
            ),
            Err(_) => (0, 0, None),
        };
        recs.push(Rec {
            client: index,
            proxy,
            path,
            sent_ns,
            recv_ns,
            status,
            limit,
            remaining,
        });
    }
    recs
}

/// The number in header `name` of `r`; `None` when absent or not a number.
fn number(r: &Response, name: &str) -> Option<u64> {
    r.header(name).and_then(|v| v.parse().ok())
}

// ---------------------------------------------------------------------------
// Processes, memory and counters.

/// VmRSS of `pid` in kB.
fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Counters read from each Envoy.
const COUNTERS: [&str; 14] = [
    "ratelimit_wasm_requests_allowed",
    "ratelimit_wasm_requests_denied",
    "ratelimit_wasm_errors",
    "ratelimit_wasm_corrupt_state",
    "ratelimit_wasm_bucket_evictions",
    "ratelimit_wasm_global_calls",
    "ratelimit_wasm_global_failures",
    "ratelimit_wasm_failure_mode_local",
    "ratelimit_wasm_circuit_opened",
    "ratelimit_wasm_circuit_open_skips",
    "envoy_wasm_ratelimit_vm_reload_success",
    "envoy_wasm_ratelimit_vm_reload_failure",
    "envoy_wasm_ratelimit_vm_reload_backoff",
    "envoy_wasm_envoy_wasm_runtime_v8_created",
];

fn counters(envoy: &Envoy) -> Option<BTreeMap<&'static str, u64>> {
    let page = envoy.stats_prometheus().ok()?;
    Some(
        COUNTERS
            .iter()
            .map(|&n| (n, testkit::prometheus_value(&page, n).unwrap_or(0.0) as u64))
            .chain(std::iter::once((
                "envoy_server_memory_allocated",
                testkit::prometheus_value(&page, "envoy_server_memory_allocated").unwrap_or(0.0)
                    as u64,
            )))
            .collect(),
    )
}

#[derive(Debug, Clone)]
struct Sample {
    t: Duration,
    envoy_rss: [Option<u64>; PROXIES],
    envoy_heap: [Option<u64>; PROXIES],
    gateway_rss: Option<u64>,
    gateway_pid: Option<u32>,
}

// ---------------------------------------------------------------------------
// Faults.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Redis,
    Gateway,
    Both,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Redis => "Redis killed",
            Kind::Gateway => "gateway killed",
            Kind::Both => "Redis and gateway killed",
        }
    }
}

#[derive(Debug, Clone)]
struct Fault {
    kind: Kind,
    /// Epoch ns: the kill, and the moment the restart returned.
    start_ns: u64,
    end_ns: u64,
    restore: Duration,
}

/// Lifetimes of the Redis processes, epoch ns (from just before the spawn
/// to just after the kill).
#[derive(Debug, Default)]
struct RedisLives(Vec<(u64, u64)>);

impl RedisLives {
    fn overlapping(&self, from: u64, to: u64) -> u64 {
        self.0.iter().filter(|(a, b)| *a < to && *b >= from).count() as u64
    }
}

fn restart_redis(redis: &mut Redis) {
    let mut last = None;
    for _ in 0..5 {
        match redis.restart() {
            Ok(()) => return,
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!(
        "restarting redis-server: {:#}",
        last.unwrap_or_else(|| anyhow::anyhow!("?"))
    );
}

// ---------------------------------------------------------------------------
// Analysis.

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Healthy,
    Fault(Kind),
    Recovery,
}

impl Phase {
    fn name(self) -> String {
        match self {
            Phase::Healthy => "healthy".to_string(),
            Phase::Fault(k) => k.name().to_string(),
            Phase::Recovery => format!("recovery (≤ {} s after a fault)", RECOVERY.as_secs()),
        }
    }
}

fn phase_at(ns: u64, faults: &[Fault]) -> Phase {
    for f in faults {
        if ns >= f.start_ns && ns < f.end_ns {
            return Phase::Fault(f.kind);
        }
    }
    for f in faults {
        if ns >= f.end_ns && ns < f.end_ns + RECOVERY.as_nanos() as u64 {
            return Phase::Recovery;
        }
    }
    Phase::Healthy
}

/// Admissions of one client in one window, counted from requests sent and
/// answered inside it (`lower`) and from every request overlapping it
/// (`upper`).
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    gateway: u64,
    stand_in: [u64; PROXIES],
    statik: [u64; PROXIES],
    /// `/api` answers (any status) decided by a stand-in.
    stand_in_decisions: u64,
}

impl Counts {
    fn add(&mut self, r: &Rec) {
        match r.path {
            Path::Api => {
                if r.limit == SHARE {
                    self.stand_in_decisions += 1;
                }
                if r.status == 200 {
                    if r.limit == LIMIT {
                        self.gateway += 1;
                    } else if r.limit == SHARE {
                        self.stand_in[r.proxy] += 1;
                    }
                }
            }
            Path::Static => {
                if r.status == 200 {
                    self.statik[r.proxy] += 1;
                }
            }
        }
    }

    fn admitted(&self) -> u64 {
        self.gateway + self.stand_in.iter().sum::<u64>()
    }
}

fn avg(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Least-squares slope of `series` (one sample per second), per minute.
fn slope_per_min(series: &[f64]) -> f64 {
    let n = series.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mx = (n - 1.0) / 2.0;
    let my = avg(series);
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (i, y) in series.iter().enumerate() {
        let dx = i as f64 - mx;
        sxy += dx * (y - my);
        sxx += dx * dx;
    }
    sxy / sxx * 60.0
}

/// (first-third average, last-third average) of `series`.
fn thirds(series: &[f64]) -> (f64, f64) {
    let n = series.len() / 3;
    (avg(&series[..n]), avg(&series[series.len() - n..]))
}

fn mb(kb: f64) -> String {
    format!("{:.1}", kb / 1024.0)
}

fn opt_mb(kb: Option<u64>) -> String {
    kb.map_or("–".to_string(), |k| mb(k as f64))
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// How long, how fast and with which faults; from the environment.
#[derive(Debug, Clone)]
struct Settings {
    seconds: u64,
    rate: f64,
    seed: u64,
    /// No faults, and memory samples not judged, before this.
    warm_up: Duration,
    /// Healthy gaps between faults, and fault lengths.
    gap: (Duration, Duration),
    fault: (Duration, Duration),
    /// Short runs: the first fault waits for the end of a planned healthy
    /// window ([`first_fault_after`]) instead of the warm-up and a gap.
    plan_healthy_window: bool,
}

/// When the first fault of a short run may start, from the start of the
/// load at `start_ns` (epoch ns): 200 ms after the end of the first
/// epoch-aligned window that starts [`HEALTHY_LEAD`] or more into the load,
/// so that window is healthy. Between 12.2 and 22.2 s.
fn first_fault_after(start_ns: u64) -> Duration {
    let lead = HEALTHY_LEAD.as_nanos() as u64;
    let window_start = (start_ns + lead).div_ceil(WINDOW_NS) * WINDOW_NS;
    Duration::from_nanos(window_start + WINDOW_NS - start_ns) + Duration::from_millis(200)
}

impl Settings {
    fn from_env() -> Settings {
        let seconds = env_u64("SOAK_SECONDS").unwrap_or(28).max(20);
        let rate = env_u64("SOAK_RATE").unwrap_or(250).max(10) as f64;
        let seed = env_u64("SOAK_SEED").unwrap_or_else(|| now_ns() ^ u64::from(std::process::id()));
        let ms = Duration::from_millis;
        if seconds >= 120 {
            Settings {
                seconds,
                rate,
                seed,
                warm_up: ms(30_000),
                gap: (ms(4000), ms(12_000)),
                fault: (ms(1000), ms(5000)),
                plan_healthy_window: false,
            }
        } else {
            Settings {
                seconds,
                rate,
                seed,
                warm_up: ms(6000),
                gap: (ms(1000), ms(1500)),
                fault: (ms(1000), ms(1500)),
                plan_healthy_window: true,
            }
        }
    }
}

/// Everything one run recorded.
struct Run {
    specs: Vec<ClientSpec>,
    recs: Vec<Rec>,
    samples: Vec<Sample>,
    faults: Vec<Fault>,
    lives: RedisLives,
    start_ns: u64,
    elapsed: Duration,
    /// Envoy counters at the start and at the end, per proxy.
    first_counters: Vec<BTreeMap<&'static str, u64>>,
    last_counters: Vec<BTreeMap<&'static str, u64>>,
    envoy_logs: Vec<String>,
    gateway_log: String,
}

/// Starts Redis, the gateway and two Envoys, runs the load and the chaos
/// loop for `s.seconds`, and stops everything.
fn run(s: &Settings) -> Run {
    let mut rng = Rng(s.seed);
    let mut redis = ok(Redis::start(), "starting redis-server");
    let mut lives = RedisLives::default();
    let mut redis_born = now_ns();
    let mut gateway = ok(
        Gateway::start(
            GatewayOptions::new(redis.url())
                .policy(plugin_config())
                .args(&["--redis-timeout-ms", &REDIS_TIMEOUT_MS.to_string()]),
        ),
        "starting ratelimit-gateway",
    );
    let opts = EnvoyOptions::new(plugin_config()).gateway_port(gateway.port());
    let envoys = ok(
        Envoy::start_all(&[opts.clone(), opts]),
        "starting two Envoys",
    );
    for e in &envoys {
        // The wheel's wrapper execs Envoy: the PID is Envoy's own.
        assert_eq!(comm(e.pid()), "envoy", "pid {} is Envoy itself", e.pid());
    }
    let urls: Vec<String> = envoys.iter().map(|e| e.url("")).collect();
    let specs = clients(s.rate);
    let read_counters = || -> Vec<_> {
        envoys
            .iter()
            .map(|e| counters(e).expect("Envoy's /stats/prometheus"))
            .collect()
    };
    let first_counters = read_counters();

    let duration = Duration::from_secs(s.seconds);
    let stop = AtomicBool::new(false);
    let mut samples: Vec<Sample> = Vec::new();
    let mut faults: Vec<Fault> = Vec::new();
    let start = Instant::now();
    let start_ns = now_ns();
    let recs: Vec<Rec> = std::thread::scope(|scope| {
        let handles: Vec<_> = specs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let rng = Rng(s.seed ^ (i as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
                let (urls, stop) = (&urls, &stop);
                scope.spawn(move || load(i, spec, urls, stop, rng))
            })
            .collect();

        // Chaos and sampling, in this thread: it started the gateway, which
        // gets SIGTERM when the thread that spawned it ends.
        let mut next_sample = start;
        let mut next_fault = if s.plan_healthy_window {
            start + first_fault_after(start_ns)
        } else {
            start + s.warm_up + rng.between(s.gap.0, s.gap.1)
        };
        // The run lasts `duration`, and longer if needed: until every fault
        // is over and the recovery check has had its room after the last.
        let mut end = start + duration;
        let mut active: Option<(Kind, u64, Instant)> = None;
        // The first three faults are the three kinds, in a random order;
        // then Redis alone half the time (the gateway lives on through it),
        // each of the others a quarter. In a long run, the second half kills
        // only Redis, so that one gateway process lives long enough for its
        // memory to be judged on its own.
        let mut first_kinds = vec![Kind::Redis, Kind::Gateway, Kind::Both];
        for i in (1..first_kinds.len()).rev() {
            first_kinds.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        // No new fault after this, except the planned kinds of a short run.
        let last_fault_start = duration.saturating_sub(s.fault.1 + RECOVERY_ROOM);
        let gateway_kills_until = if s.seconds >= 120 {
            duration / 2
        } else {
            duration
        };
        while Instant::now() < end || active.is_some() {
            let now = Instant::now();
            if now >= next_sample {
                let pid = gateway.pid();
                let mut rss = [None; PROXIES];
                let mut heap = [None; PROXIES];
                for (p, e) in envoys.iter().enumerate() {
                    rss[p] = rss_kb(e.pid());
                    heap[p] = counters(e).map(|c| c["envoy_server_memory_allocated"] / 1024);
                }
                samples.push(Sample {
                    t: start.elapsed(),
                    envoy_rss: rss,
                    envoy_heap: heap,
                    gateway_rss: pid.and_then(rss_kb),
                    gateway_pid: pid,
                });
                next_sample += Duration::from_secs(1);
            }
            match active {
                None if now >= next_fault
                    && (now - start <= last_fault_start
                        || (s.plan_healthy_window && !first_kinds.is_empty())) =>
                {
                    let kind = first_kinds.pop().unwrap_or_else(|| {
                        if now - start >= gateway_kills_until {
                            return Kind::Redis;
                        }
                        match rng.next_u64() % 4 {
                            0 | 1 => Kind::Redis,
                            2 => Kind::Gateway,
                            _ => Kind::Both,
                        }
                    });
                    let kill_ns = now_ns();
                    if matches!(kind, Kind::Redis | Kind::Both) {
                        redis.kill();
                        lives.0.push((redis_born, now_ns()));
                    }
                    if matches!(kind, Kind::Gateway | Kind::Both) {
                        gateway.kill();
                    }
                    active = Some((kind, kill_ns, now + rng.between(s.fault.0, s.fault.1)));
                }
                Some((kind, kill_ns, until)) if now >= until => {
                    let t = Instant::now();
                    // Redis first: the gateway is healthy only with Redis.
                    if matches!(kind, Kind::Redis | Kind::Both) {
                        redis_born = now_ns();
                        restart_redis(&mut redis);
                    }
                    if matches!(kind, Kind::Gateway | Kind::Both) {
                        ok(gateway.restart(), "restarting ratelimit-gateway");
                    }
                    faults.push(Fault {
                        kind,
                        start_ns: kill_ns,
                        end_ns: now_ns(),
                        restore: t.elapsed(),
                    });
                    active = None;
                    end = end.max(Instant::now() + RECOVERY_ROOM);
                    next_fault = Instant::now() + rng.between(s.gap.0, s.gap.1);
                }
                _ => {}
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.join().expect("a load thread panicked"));
        }
        all
    });
    lives.0.push((redis_born, now_ns()));
    Run {
        specs,
        recs,
        samples,
        faults,
        lives,
        start_ns,
        elapsed: start.elapsed(),
        first_counters,
        last_counters: read_counters(),
        envoy_logs: envoys.iter().map(Envoy::log).collect(),
        gateway_log: gateway.log(),
    }
}

/// The report being written and the checks that failed.
#[derive(Default)]
struct Checks {
    report: String,
    failures: Vec<String>,
}

impl Checks {
    fn fail(&mut self, what: String) {
        self.failures.push(what);
    }

    /// Seconds since the start of the run.
    fn secs(run: &Run, ns: u64) -> f64 {
        ns.saturating_sub(run.start_ns) as f64 / 1e9
    }

    /// The fault timeline; after each fault the gateway decides again soon.
    fn faults(&mut self, run: &Run) {
        let r = &mut self.report;
        let _ = writeln!(r, "### Fault timeline\n");
        let _ = writeln!(
            r,
            "Asserted: the gateway decides again (an `/api` answer with its figures) within \
             {RECOVERED_WITHIN:?} of a fault that restarted it, within \
             {RECOVERED_WITHIN_REDIS_ONLY:?} of a Redis-only fault.\n"
        );
        let _ = writeln!(
            r,
            "| # | from (s) | to (s) | fault | restart took | gateway decides again after |"
        );
        let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- |");
        let mut failures = Vec::new();
        for (i, f) in run.faults.iter().enumerate() {
            // The first `/api` answer from the gateway sent after the restore.
            let back = run
                .recs
                .iter()
                .filter(|r| r.path == Path::Api && r.limit == LIMIT && r.sent_ns >= f.end_ns)
                .map(|r| r.recv_ns)
                .min();
            let after = back.map(|b| Duration::from_nanos(b - f.end_ns));
            let _ = writeln!(
                r,
                "| {} | {:.1} | {:.1} | {} | {:.0?} | {} |",
                i + 1,
                Self::secs(run, f.start_ns),
                Self::secs(run, f.end_ns),
                f.kind.name(),
                f.restore,
                after.map_or("–".to_string(), |a| format!("{a:.2?}"))
            );
            let within = match f.kind {
                Kind::Redis => RECOVERED_WITHIN_REDIS_ONLY,
                Kind::Gateway | Kind::Both => RECOVERED_WITHIN,
            };
            // No fault is let off, the last one included: the run went on
            // for RECOVERY_ROOM after each.
            match after {
                Some(a) if a <= within => {}
                other => failures.push(format!(
                    "fault {} ({}): the gateway did not decide again within {within:?} \
                     (after: {other:?})",
                    i + 1,
                    f.kind.name()
                )),
            }
        }
        for kind in [Kind::Redis, Kind::Gateway, Kind::Both] {
            if !run.faults.iter().any(|f| f.kind == kind) {
                failures.push(format!("no fault of the kind {:?}", kind.name()));
            }
        }
        self.failures.extend(failures);
    }

    /// Statuses and latencies by phase; who decided each answer.
    fn statuses(&mut self, run: &Run) {
        #[derive(Default)]
        struct Tally {
            n: u64,
            s200: u64,
            s429: u64,
            s503: u64,
            other5xx: u64,
            other: u64,
            transport: u64,
            stand_in: u64,
            latencies_us: Vec<u64>,
        }
        let mut by_phase: BTreeMap<Phase, Tally> = BTreeMap::new();
        for r in &run.recs {
            let t = by_phase
                .entry(phase_at(r.sent_ns, &run.faults))
                .or_default();
            t.n += 1;
            match r.status {
                0 => t.transport += 1,
                200 => t.s200 += 1,
                429 => t.s429 += 1,
                503 => t.s503 += 1,
                500..=599 => t.other5xx += 1,
                _ => t.other += 1,
            }
            if r.path == Path::Api && r.limit == SHARE {
                t.stand_in += 1;
            }
            t.latencies_us.push((r.recv_ns - r.sent_ns) / 1000);
        }
        let _ = writeln!(
            self.report,
            "\n### Statuses by phase (the phase when a request was sent)\n"
        );
        let _ = writeln!(
            self.report,
            "| phase | requests | 200 | 429 | 503 | other 5xx | other | transport errors | \
             `/api` decided by a stand-in | latency p50 / p99 |"
        );
        let _ = writeln!(
            self.report,
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        );
        for (phase, t) in &mut by_phase {
            t.latencies_us.sort_unstable();
            let _ = writeln!(
                self.report,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} / {:.1} ms |",
                phase.name(),
                t.n,
                t.s200,
                t.s429,
                t.s503,
                t.other5xx,
                t.other,
                t.transport,
                t.stand_in,
                percentile(&t.latencies_us, 0.5) as f64 / 1000.0,
                percentile(&t.latencies_us, 0.99) as f64 / 1000.0
            );
            if t.s503 + t.other5xx + t.other + t.transport > 0 {
                self.failures.push(format!(
                    "phase {}: {} x 503, {} other 5xx, {} other, {} transport errors \
                     (failure_mode local answers only 200 and 429)",
                    phase.name(),
                    t.s503,
                    t.other5xx,
                    t.other,
                    t.transport
                ));
            }
        }
        for (i, spec) in run.specs.iter().enumerate() {
            let mine: Vec<&Rec> = run.recs.iter().filter(|r| r.client == i).collect();
            if !spec.heavy {
                let denied = mine.iter().filter(|r| r.status != 200).count();
                if denied > 0 {
                    self.fail(format!(
                        "the light client ({} requests) was answered other than 200 {denied} times",
                        mine.len()
                    ));
                }
            }
            // Attribution: every answer names the limit that decided it.
            if let Some(r) = mine.iter().find(|r| match (r.path, r.status) {
                (Path::Api, 200 | 429) => r.limit != LIMIT && r.limit != SHARE,
                (Path::Static, 200 | 429) => r.limit != STATIC_LIMIT,
                _ => false,
            }) {
                self.fail(format!(
                    "{}: {:?} {} with x-ratelimit-limit {} (expected {LIMIT} or {SHARE} on /api, \
                     {STATIC_LIMIT} on /static)",
                    spec.id, r.path, r.status, r.limit
                ));
            }
        }
    }

    /// Admitted requests per client and window against the bounds.
    fn windows(&mut self, run: &Run) {
        // `lower`: requests sent and answered inside the window (its decision
        // certainly fell in it); `upper`: every request overlapping it.
        let mut lower: BTreeMap<(usize, u64), Counts> = BTreeMap::new();
        let mut upper: BTreeMap<(usize, u64), Counts> = BTreeMap::new();
        let mut straddling = 0u64;
        for r in &run.recs {
            let (a, b) = (r.sent_ns / WINDOW_NS, r.recv_ns / WINDOW_NS);
            if a == b {
                lower.entry((r.client, a)).or_default().add(r);
            } else if r.status == 200 {
                straddling += 1;
            }
            for w in a..=b {
                upper.entry((r.client, w)).or_default().add(r);
            }
        }
        #[derive(Default)]
        struct Class {
            windows: u64,
            with_stand_in: u64,
            max_epochs: u64,
            max_total: f64,
            max_total_upper: f64,
            max_gateway: f64,
            max_stand_in: f64,
            max_static: f64,
        }
        let mut classes: BTreeMap<&'static str, Class> = BTreeMap::new();
        let recovery_ns = RECOVERY.as_nanos() as u64;
        for (&(client, w), c) in &lower {
            let (from, to) = (w * WINDOW_NS, (w + 1) * WINDOW_NS);
            let epochs = run.lives.overlapping(from, to).max(1);
            let faulty = run
                .faults
                .iter()
                .any(|f| f.start_ns < to && f.end_ns + recovery_ns > from);
            let healthy = !faulty && epochs == 1 && c.stand_in_decisions == 0;
            let class = classes
                .entry(if healthy { "healthy" } else { "with faults" })
                .or_default();
            class.windows += 1;
            class.max_epochs = class.max_epochs.max(epochs);
            if c.stand_in_decisions > 0 {
                class.with_stand_in += 1;
            }
            let at = format!(
                "{}, window from {:.0} s",
                run.specs[client].id,
                Self::secs(run, from)
            );
            // G ≤ LIMIT × E.
            if c.gateway > LIMIT * epochs {
                self.failures.push(format!(
                    "{at}: the gateway admitted {} > {LIMIT} x {epochs} Redis lifetime(s)",
                    c.gateway
                ));
            }
            // S_p ≤ LIMIT / instances; /static ≤ STATIC_LIMIT per proxy.
            for p in 0..PROXIES {
                if c.stand_in[p] > SHARE {
                    self.failures.push(format!(
                        "{at}: proxy {p}'s stand-in admitted {} > {SHARE}",
                        c.stand_in[p]
                    ));
                }
                if c.statik[p] > STATIC_LIMIT {
                    self.failures.push(format!(
                        "{at}: proxy {p} admitted {} x /static > {STATIC_LIMIT}",
                        c.statik[p]
                    ));
                }
                class.max_stand_in = class.max_stand_in.max(c.stand_in[p] as f64 / SHARE as f64);
                class.max_static = class
                    .max_static
                    .max(c.statik[p] as f64 / STATIC_LIMIT as f64);
            }
            // admitted = G + Σ S_p ≤ LIMIT × E + Σ S_p; healthy: ≤ LIMIT.
            let bound = if healthy {
                LIMIT
            } else {
                LIMIT * epochs + c.stand_in.iter().sum::<u64>()
            };
            if c.admitted() > bound {
                self.failures.push(format!(
                    "{at}: admitted {} > {bound} (healthy: {healthy}, E = {epochs}, stand-ins {:?})",
                    c.admitted(),
                    c.stand_in
                ));
            }
            class.max_gateway = class
                .max_gateway
                .max(c.gateway as f64 / (LIMIT * epochs) as f64);
            // Ratios against the a-priori bound: LIMIT when healthy, else
            // LIMIT × E + proxies × SHARE.
            let a_priori = if healthy {
                LIMIT
            } else {
                LIMIT * epochs + PROXIES as u64 * SHARE
            } as f64;
            class.max_total = class.max_total.max(c.admitted() as f64 / a_priori);
            if let Some(u) = upper.get(&(client, w)) {
                class.max_total_upper = class.max_total_upper.max(u.admitted() as f64 / a_priori);
            }
        }
        // The healthy bound (admitted ≤ LIMIT) must have been put to the test.
        if classes.get("healthy").is_none_or(|c| c.windows == 0) {
            self.failures.push(
                "no healthy (client, window) pair: the bound admitted ≤ LIMIT was never checked"
                    .to_string(),
            );
        }
        let r = &mut self.report;
        let _ = writeln!(
            r,
            "\n### Admitted vs the limit, per client and 10 s window\n"
        );
        let _ = writeln!(
            r,
            "Global rule `api`: {LIMIT} per 10 s per client (sliding window, `instances: \
             {INSTANCES}`: a proxy's stand-in allows {SHARE}); local rule `static`: {STATIC_LIMIT} \
             per 10 s per client in each proxy. E = Redis processes alive in the window. Asserted \
             per (client, window): gateway-admitted ≤ {LIMIT} × E, each proxy's stand-in-admitted \
             ≤ {SHARE}, `/static` ≤ {STATIC_LIMIT} per proxy, admitted ≤ {LIMIT} in a healthy window \
             (no fault or recovery, no stand-in decision, E = 1). Ratios are against the a-priori \
             bound: {LIMIT} in a healthy window, {LIMIT} × E + {PROXIES} × {SHARE} otherwise. \
             {straddling} admitted requests straddled a window boundary; they are left out of \
             the per-window counts, and counted in both windows in the last column.\n"
        );
        let _ = writeln!(
            r,
            "| windows | (client, window) pairs | with stand-in decisions | max E | max admitted / \
             bound | max gateway-admitted / ({LIMIT} × E) | max stand-in-admitted / {SHARE} | max \
             `/static` / {STATIC_LIMIT} | max admitted / bound, straddlers in both |"
        );
        let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        for (name, c) in &classes {
            let _ = writeln!(
                r,
                "| {name} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                c.windows,
                c.with_stand_in,
                c.max_epochs,
                c.max_total,
                c.max_gateway,
                c.max_stand_in,
                c.max_static,
                c.max_total_upper
            );
        }
    }

    /// One memory series: last third ≤ first third × RSS_FACTOR + slack.
    fn judge(&mut self, name: &str, series: &[f64], slack_kb: f64) {
        if series.len() < 6 {
            self.fail(format!("{name}: only {} memory samples", series.len()));
            return;
        }
        let (first, last) = thirds(series);
        let limit = first * RSS_FACTOR + slack_kb;
        let _ = writeln!(
            self.report,
            "| {name} | {} | {} | {} | {} | {:+.1}% | {:+.0} kB/min |",
            series.len(),
            mb(first),
            mb(last),
            mb(limit),
            (last / first - 1.0) * 100.0,
            slope_per_min(series)
        );
        if last > limit {
            self.fail(format!(
                "{name}: grew from {} MB to {} MB (limit {} MB)",
                mb(first),
                mb(last),
                mb(limit)
            ));
        }
    }

    /// Memory over time and the growth checks.
    fn memory(&mut self, run: &Run, s: &Settings) {
        let r = &mut self.report;
        let _ = writeln!(
            r,
            "\n### Memory (MB: VmRSS; Envoy heap = `server.memory_allocated`)\n"
        );
        let _ = writeln!(
            r,
            "| t (s) | Envoy A RSS | Envoy B RSS | Envoy A heap | Envoy B heap | gateway RSS (pid) |"
        );
        let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- |");
        let every = (s.seconds / 10).max(1) as usize;
        for (i, x) in run.samples.iter().enumerate() {
            if i % every == 0 || i + 1 == run.samples.len() {
                let _ = writeln!(
                    r,
                    "| {:.0} | {} | {} | {} | {} | {} ({}) |",
                    x.t.as_secs_f64(),
                    opt_mb(x.envoy_rss[0]),
                    opt_mb(x.envoy_rss[1]),
                    opt_mb(x.envoy_heap[0]),
                    opt_mb(x.envoy_heap[1]),
                    opt_mb(x.gateway_rss),
                    x.gateway_pid.map_or("down".to_string(), |p| p.to_string())
                );
            }
        }
        let _ = writeln!(
            r,
            "\nJudged after the {:?} warm-up, one sample a second: average of the last third ≤ \
             first third × {RSS_FACTOR} + slack ({} MB for Envoy's RSS, {} MB for its heap, {} MB \
             for the gateway). Trend: least-squares slope over the judged samples.\n",
            s.warm_up,
            mb(ENVOY_RSS_SLACK_KB),
            mb(ENVOY_HEAP_SLACK_KB),
            mb(GATEWAY_RSS_SLACK_KB)
        );
        let _ = writeln!(
            r,
            "| series | samples | first third | last third | limit | growth | trend |"
        );
        let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- | --- |");
        let judged: Vec<&Sample> = run.samples.iter().filter(|x| x.t >= s.warm_up).collect();
        let series = |f: &dyn Fn(&Sample) -> Option<u64>| -> Vec<f64> {
            judged
                .iter()
                .filter_map(|x| f(x))
                .map(|v| v as f64)
                .collect()
        };
        for (p, name) in ["A", "B"].iter().enumerate() {
            let rss = series(&|x| x.envoy_rss[p]);
            self.judge(&format!("Envoy {name} RSS"), &rss, ENVOY_RSS_SLACK_KB);
            let heap = series(&|x| x.envoy_heap[p]);
            self.judge(&format!("Envoy {name} heap"), &heap, ENVOY_HEAP_SLACK_KB);
        }
        let gateway = series(&|x| x.gateway_rss);
        self.judge("gateway RSS, all processes", &gateway, GATEWAY_RSS_SLACK_KB);
        // The longest-lived gateway process on its own (the chaos restarts it).
        let mut lifetimes: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
        for x in &judged {
            if let (Some(pid), Some(kb)) = (x.gateway_pid, x.gateway_rss) {
                lifetimes.entry(pid).or_default().push(kb as f64);
            }
        }
        if let Some((pid, one)) = lifetimes.into_iter().max_by_key(|(_, v)| v.len()) {
            if one.len() >= 9 {
                let name = format!("gateway RSS, pid {pid} (the longest-lived)");
                self.judge(&name, &one, GATEWAY_RSS_SLACK_KB);
            }
        }
    }

    /// Envoy's counters, and the logs of both Envoys and the gateway.
    fn counters_and_logs(&mut self, run: &Run) {
        let _ = writeln!(self.report, "\n### Envoy counters over the run\n");
        let _ = writeln!(self.report, "| counter | Envoy A | Envoy B |");
        let _ = writeln!(self.report, "| --- | --- | --- |");
        for name in COUNTERS {
            let d: Vec<u64> = (0..PROXIES)
                .map(|p| run.last_counters[p][name].saturating_sub(run.first_counters[p][name]))
                .collect();
            let _ = writeln!(self.report, "| `{name}` | {} | {} |", d[0], d[1]);
            // No shared-data failure, no bucket lost to a set read as corrupt
            // or to an eviction (either would forget a client's count: the
            // window bounds below would not hold); no VM ever failed,
            // reloaded or was recreated.
            let must_stay = name == "ratelimit_wasm_errors"
                || name == "ratelimit_wasm_corrupt_state"
                || name == "ratelimit_wasm_bucket_evictions"
                || name.starts_with("envoy_wasm_ratelimit_vm_reload")
                || name == "envoy_wasm_envoy_wasm_runtime_v8_created";
            if must_stay && d.iter().any(|&v| v > 0) {
                self.fail(format!("{name} went up: {d:?}"));
            }
        }
        let needles = ["panic", "critical", "runtimeerror", "uncaught", "wasm trap"];
        let mut found = 0;
        let logs = run
            .envoy_logs
            .iter()
            .zip(["Envoy A", "Envoy B"])
            .chain(std::iter::once((&run.gateway_log, "the gateway")));
        for (log, who) in logs {
            let hit = log.lines().find_map(|line| {
                let l = line.to_ascii_lowercase();
                needles.iter().find(|n| l.contains(**n)).map(|n| (n, line))
            });
            if let Some((n, line)) = hit {
                found += 1;
                self.fail(format!("{who}'s log has {n:?}: {line}"));
            }
        }
        let _ = writeln!(
            self.report,
            "\nBoth Envoy logs and the gateway's searched for {needles:?} (case-insensitive): {}.",
            if found == 0 { "none" } else { "found" }
        );
    }
}

/// The planned healthy window of a short run, for every phase of the clock
/// against the 10 s windows: it starts at least `HEALTHY_LEAD` into the load,
/// is whole, and ends before the first fault, which comes 12.2–22.2 s in.
#[test]
fn a_short_run_plans_one_whole_healthy_window_before_its_faults() {
    let lead = HEALTHY_LEAD.as_nanos() as u64;
    for phase_ms in (0..10_000).step_by(7) {
        let start_ns = 1_767_225_600 * 1_000_000_000 + phase_ms * 1_000_000 + 123;
        let first = first_fault_after(start_ns);
        let fault_ns = start_ns + first.as_nanos() as u64;
        // The last whole window before the fault.
        let window_start = (fault_ns / WINDOW_NS - 1) * WINDOW_NS;
        assert!(window_start >= start_ns + lead, "phase {phase_ms} ms");
        assert_eq!(fault_ns - (window_start + WINDOW_NS), 200_000_000);
        assert!(
            (Duration::from_millis(12_200)..Duration::from_millis(22_200)).contains(&first),
            "phase {phase_ms} ms: {first:?}"
        );
    }
}

#[test]
fn soak_with_redis_and_gateway_faults() {
    let s = Settings::from_env();
    println!(
        "soak: {} s at {} req/s, seed {} (SOAK_SEED={} replays the fault schedule)",
        s.seconds, s.rate, s.seed, s.seed
    );
    let run = run(&s);

    let mut checks = Checks::default();
    let _ = writeln!(
        checks.report,
        "## Soak run: {} s, seed {}\n\n{} requests in {:.1?} ({:.0} req/s) from {} clients (5 heavy: \
         3 with a new connection per request, 2 keeping one connection per proxy; 1 light at 1.5 \
         req/s) through 2 Envoys (`--concurrency 2`), one gateway and one Redis; {} faults.\n",
        s.seconds,
        s.seed,
        run.recs.len(),
        run.elapsed,
        run.recs.len() as f64 / run.elapsed.as_secs_f64(),
        run.specs.len(),
        run.faults.len()
    );
    checks.faults(&run);
    checks.statuses(&run);
    checks.windows(&run);
    checks.memory(&run, &s);
    checks.counters_and_logs(&run);

    println!("{}", checks.report);
    if let Some(path) = std::env::var_os("SOAK_REPORT").filter(|p| !p.is_empty()) {
        let path = std::path::PathBuf::from(path);
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        ok(
            std::fs::write(&path, &checks.report).map_err(Into::into),
            "writing SOAK_REPORT",
        );
        println!("soak: report written to {}", path.display());
    }
    if !checks.failures.is_empty() {
        // A failure keeps its evidence: every request, to place the decisions
        // near a window's edge (each answer's remaining says where its
        // limiter counted it).
        let path = testkit::paths::target_dir().join(format!("soak/records-{}.csv", s.seed));
        let mut csv = String::from("client,proxy,path,sent_ns,recv_ns,status,limit,remaining\n");
        for r in &run.recs {
            let _ = writeln!(
                csv,
                "{},{},{:?},{},{},{},{},{}",
                run.specs[r.client].id,
                r.proxy,
                r.path,
                r.sent_ns,
                r.recv_ns,
                r.status,
                r.limit,
                r.remaining.map_or(String::new(), |v| v.to_string())
            );
        }
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&path, csv));
        println!(
            "soak: every request of the failed run in {} ({written:?})",
            path.display()
        );
    }
    assert!(
        checks.failures.is_empty(),
        "soak (seed {}) failed {} check(s):\n{}",
        s.seed,
        checks.failures.len(),
        checks.failures.join("\n")
    );
}
