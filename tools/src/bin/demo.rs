//! `make demo`, in three parts, then stops everything it started (also on Ctrl-C):
//!
//! 1. Local limits: renders `envoy/envoy.yaml` with `envoy/ratelimit-demo.json`,
//!    starts Envoy on loopback, sends a few bursts through the rate-limit
//!    filter and prints one line per request.
//! 2. A steady load: a second Envoy with `envoy/ratelimit-demo-graduated.json`
//!    (one graduated rule: 20 requests per 2 s per client, warn, delay, then
//!    429); one client sends 25 requests/s for 6 s on a fixed schedule and a
//!    live table prints, for each second, what was sent and how it was
//!    answered: 200 at once, 200 after a delay, 429, 403, and the last
//!    `x-ratelimit-remaining`. Then it writes `.run/demo/chart.svg`: the
//!    same seconds as a chart, against the limit's refill rate.
//! 3. One global limit across two proxies: starts `redis-server`, the
//!    `ratelimit-gateway` in front of it and two Envoys with
//!    `envoy/ratelimit-global.json`, then sends one client's requests to the
//!    two proxies in turn and prints which proxy answered, the status and
//!    `x-ratelimit-remaining`: both draw from one shared limit.
//!
//! Usage: `demo [--free-ports | --ports LISTEN,ADMIN,UPSTREAM] [--local-only]
//! [--load-seconds N] [--load-rate N] [--hold]` (default ports: the local
//! Envoy 10000, 9901, 10001; the steady-load Envoy 10030, 9904, 10031; proxy
//! A 10010, 9902, 10011; proxy B 10020, 9903, 10021; the gateway 8081; Redis a
//! free port. `--ports` moves the local Envoy, `--free-ports` everything;
//! `--local-only` skips part 3; `--load-seconds` and `--load-rate` change part
//! 2's load (default 6 s at 25 requests/s); `--hold` keeps everything running
//! after the requests until Ctrl-C).

#[path = "demo/chart.rs"]
mod chart;
#[path = "demo/load.rs"]
mod load;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use testkit::config::{demo_global_plugin_config_path, demo_plugin_config_path};
use testkit::redis::Redis;
use testkit::{
    workspace_root, Client, ConnectionMode, Envoy, EnvoyOptions, Gateway, GatewayOptions, Ports,
    Request,
};
use tools::children::{start_child, stop_children_from_signal, unregister};

/// Set by the Ctrl-C handler, which then stops the children and exits: the
/// load stops sending, and `main` leaves the exit to the handler.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

fn main() -> ExitCode {
    let result = run();
    if interrupted() {
        // The Ctrl-C handler is stopping the children (whose requests may
        // have failed meanwhile) and exits with 130.
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Command-line options.
struct Args {
    ports: Ports,
    load_ports: Ports,
    proxy_a: Ports,
    proxy_b: Ports,
    gateway_port: u16,
    global: bool,
    load_seconds: u32,
    load_rate: u32,
    hold: bool,
}

const USAGE: &str = "usage: demo [--free-ports | --ports LISTEN,ADMIN,UPSTREAM] [--local-only] \
                     [--load-seconds N] [--load-rate N] [--hold]";

fn parse_args() -> Result<Args> {
    let mut args = Args {
        ports: Ports::DEMO,
        load_ports: Ports {
            listen: 10030,
            admin: 9904,
            upstream: 10031,
        },
        proxy_a: Ports {
            listen: 10010,
            admin: 9902,
            upstream: 10011,
        },
        proxy_b: Ports {
            listen: 10020,
            admin: 9903,
            upstream: 10021,
        },
        gateway_port: testkit::config::DEFAULT_GATEWAY_PORT,
        global: true,
        load_seconds: 6,
        load_rate: 25,
        hold: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--free-ports" => {
                args.ports = Ports::free()?;
                args.load_ports = Ports::free()?;
                args.proxy_a = Ports::free()?;
                args.proxy_b = Ports::free()?;
                args.gateway_port = testkit::free_port()?;
            }
            "--ports" => {
                let list = it.next().context(USAGE)?;
                let p: Vec<u16> = list
                    .split(',')
                    .map(|s| s.trim().parse::<u16>())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("bad --ports {list:?}"))?;
                let [listen, admin, upstream] = p.as_slice() else {
                    bail!("--ports wants LISTEN,ADMIN,UPSTREAM");
                };
                args.ports = Ports {
                    listen: *listen,
                    admin: *admin,
                    upstream: *upstream,
                };
            }
            "--local-only" => args.global = false,
            "--load-seconds" | "--load-rate" => {
                let v = it.next().context(USAGE)?;
                let n: u32 = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .with_context(|| format!("{arg} wants a number from 1 to 1000, not {v:?}"))?;
                if arg == "--load-seconds" {
                    args.load_seconds = n;
                } else {
                    args.load_rate = n;
                }
            }
            "--hold" => args.hold = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    Ok(args)
}

fn run() -> Result<()> {
    let args = parse_args()?;
    ctrlc::set_handler(|| {
        INTERRUPTED.store(true, Ordering::SeqCst);
        eprintln!("\ninterrupted: stopping everything the demo started");
        stop_children_from_signal();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;

    let mut envoy = local_part(&args)?;
    let mut load_envoy = load_part(&args)?;
    let mut global = if args.global {
        Some(global_part(&args)?)
    } else {
        None
    };

    if args.hold {
        println!(
            "\nEverything keeps running: try `curl -i -H 'x-client-id: me' {}`",
            envoy.url("/")
        );
        // The demo's clients name themselves; a real edge must not let them.
        println!(
            "(this demo trusts the client-written x-client-id header on purpose, so that you can \
             play several clients; `ratelimit check-envoy` warns about it, and a real edge sets \
             the id from a verified token: identity.client_id_metadata)"
        );
        println!(
            "or the graduated rule: `curl -si -H 'x-client-id: me' {} | grep -i ratelimit`",
            load_envoy.url("/")
        );
        if let Some(g) = &global {
            println!(
                "or the shared limit: `curl -i -H 'x-client-id: me' {}` and {}; press Ctrl-C to stop",
                g.proxies[0].url("/"),
                g.proxies[1].url("/")
            );
        } else {
            println!("press Ctrl-C to stop");
        }
        loop {
            if let Some(status) = envoy.try_wait()? {
                bail!(
                    "Envoy exited by itself ({status}); log {}",
                    envoy.log_path().display()
                );
            }
            if let Some(status) = load_envoy.try_wait()? {
                bail!(
                    "the steady-load Envoy exited by itself ({status}); log {}",
                    load_envoy.log_path().display()
                );
            }
            if let Some(g) = global.as_mut() {
                g.check_running()?;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    println!();
    if let Some(g) = global.take() {
        g.stop()?;
    }
    let pid = Some(load_envoy.pid());
    let status = load_envoy.stop()?;
    unregister(pid);
    println!("stopped the steady-load Envoy ({status})");
    let pid = Some(envoy.pid());
    let status = envoy.stop()?;
    unregister(pid);
    println!("stopped the local Envoy ({status})");
    Ok(())
}

/// Part 1: one Envoy with `envoy/ratelimit-demo.json`; returns it still running.
fn local_part(args: &Args) -> Result<Envoy> {
    let ports = args.ports;
    let config_path = demo_plugin_config_path();
    let plugin_config = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let work_dir = workspace_root().join(".run/demo");
    println!("plugin config: {}", config_path.display());
    println!(
        "starting Envoy: listener 127.0.0.1:{}, admin 127.0.0.1:{}, upstream 127.0.0.1:{}",
        ports.listen, ports.admin, ports.upstream
    );
    let envoy = start_child(
        || {
            Envoy::start(
                EnvoyOptions::new(plugin_config)
                    .ports(ports)
                    .work_dir(&work_dir),
            )
        },
        |e| vec![Some(e.pid())],
    )?;
    println!(
        "Envoy pid {} is ready; config {}, log {}\n",
        envoy.pid(),
        envoy.config_path().display(),
        envoy.log_path().display()
    );

    let client = envoy.client(ConnectionMode::NewPerRequest);
    let mut n = 0;
    let mut send = |who: &str, req: Request| -> Result<()> {
        n += 1;
        let req = req.header("x-client-id", who);
        print_line(n, who, &req, &client)
    };

    println!("== 15 requests from client alice (per-client allows 10/s and 60/min)");
    for _ in 0..15 {
        send("alice", Request::get("/"))?;
    }
    println!("\n== 3 requests from client bob: a different client has its own buckets");
    for _ in 0..3 {
        send("bob", Request::get("/"))?;
    }
    println!("\n== 3 requests to /search from client carol: each costs 5 tokens");
    for _ in 0..3 {
        send("carol", Request::get("/search?q=envoy"))?;
    }
    println!("\n== 2 uploads from client dave (POST /upload: 5/min per client and path)");
    for _ in 0..2 {
        send("dave", Request::post("/upload/report", "data"))?;
    }

    let stats = envoy.stats_prometheus()?;
    println!("\n== metrics (admin /stats/prometheus)");
    for line in stats.lines() {
        if line.starts_with("ratelimit_wasm_") {
            println!("{line}");
        }
    }
    Ok(envoy)
}

/// Path of part 2's plugin configuration.
fn load_plugin_config_path() -> std::path::PathBuf {
    workspace_root().join("envoy/ratelimit-demo-graduated.json")
}

/// A limit's `per` in seconds: `"<n>s"`, `"<n>m"`, `"<n>h"`, `"<n>d"` or a
/// whole number of seconds.
fn per_seconds(per: &serde_json::Value) -> Option<u64> {
    if let Some(n) = per.as_u64() {
        return Some(n);
    }
    let s = per.as_str()?;
    let (n, unit) = s.split_at(s.len().checked_sub(1)?);
    let n: u64 = n.parse().ok()?;
    let unit = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return None,
    };
    Some(n * unit)
}

/// A share of a limit as a percentage, e.g. `0.8` as `80%`.
fn percent(share: f64) -> String {
    format!("{}%", (share * 100.0).round())
}

/// Part 2: one Envoy with `envoy/ratelimit-demo-graduated.json`, a steady
/// load from one client with a live per-second table, then the chart.
/// Returns the Envoy still running.
fn load_part(args: &Args) -> Result<Envoy> {
    let config_path = load_plugin_config_path();
    let plugin_config = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let config: serde_json::Value = serde_json::from_str(&plugin_config)
        .with_context(|| format!("parsing {}", config_path.display()))?;
    let rule = &config["rules"][0];
    let rule_name = rule["name"].as_str().unwrap_or("?");
    let limit = &rule["limits"][0];
    let requests = limit["requests"]
        .as_u64()
        .with_context(|| format!("{}: rules[0].limits[0].requests", config_path.display()))?;
    let per = per_seconds(&limit["per"])
        .filter(|p| *p > 0)
        .with_context(|| format!("{}: rules[0].limits[0].per", config_path.display()))?;
    let per_text = match &limit["per"] {
        serde_json::Value::String(s) => s.clone(),
        v => format!("{v}s"),
    };
    let limit_rate = requests as f64 / per as f64;
    let graduated = &rule["graduated"];
    let delay_ms = graduated["delay_ms"].as_u64();
    let mut stages = Vec::new();
    if let Some(w) = graduated["warn_at"].as_f64() {
        stages.push(format!("x-ratelimit-warning from {} in use", percent(w)));
    }
    if let (Some(d), Some(ms)) = (graduated["delay_at"].as_f64(), delay_ms) {
        stages.push(format!("held {ms} ms above {}", percent(d)));
    }
    let reject_at = graduated["reject_at"].as_f64().unwrap_or(1.0);
    stages.push(format!("429 above {}", percent(reject_at)));
    let who = "frank";
    let load = load::Load {
        seconds: args.load_seconds,
        rate: args.load_rate,
        request: Request::get("/").header("x-client-id", who),
        delay: delay_ms.map(Duration::from_millis),
    };

    println!(
        "\n== a steady load: client {who} sends {} requests/s for {} s on a fixed schedule \
         (plugin config {})\n\
         rule {rule_name:?}: {requests} requests per {per_text} per client, refilled at \
         {limit_rate} requests/s; graduated: {}",
        load.rate,
        load.seconds,
        config_path.display(),
        stages.join(", "),
    );
    let work_dir = workspace_root().join(".run/demo");
    let envoy = start_child(
        || {
            Envoy::start(
                EnvoyOptions::new(plugin_config)
                    .ports(args.load_ports)
                    .work_dir(work_dir.join("steady")),
            )
        },
        |e| vec![Some(e.pid())],
    )?;
    println!(
        "Envoy pid {} on {} (admin {}); log {}",
        envoy.pid(),
        envoy.url(""),
        envoy.admin_url(""),
        envoy.log_path().display()
    );
    let held = match delay_ms {
        Some(ms) => format!(
            "200 after the graduated rule held it, told by its timing: it took at least \
             delay_ms ({ms} ms) and carries x-ratelimit-warning"
        ),
        None => "none: this rule has no delay stage".to_string(),
    };
    println!(
        "columns: 200 = answered at once; delayed = {held};\n         \
         429 = over the limit; 403 = quota exhausted (this config has no quota: 0); \
         other = any other status, or no answer\n"
    );
    println!("{}", load::header());
    let client = envoy.client(ConnectionMode::KeepAlive);
    let seconds = load::run(&client, &load, interrupted, |k, s| {
        println!("{}", load::row(k, s));
    })?;
    println!("{}", load::total_row(&seconds));

    let stats = envoy.stats_prometheus()?;
    let metric = |m: &str| testkit::prometheus_value(&stats, m).unwrap_or(0.0);
    println!(
        "the filter's own counts (admin /stats/prometheus): ratelimit_wasm_requests_allowed {}, \
         ratelimit_wasm_delayed {}, ratelimit_wasm_requests_denied {}, ratelimit_wasm_warned {}",
        metric("ratelimit_wasm_requests_allowed"),
        metric("ratelimit_wasm_delayed"),
        metric("ratelimit_wasm_requests_denied"),
        metric("ratelimit_wasm_warned"),
    );

    let chart_path = work_dir.join("chart.svg");
    let title = format!(
        "client {who}: {} requests/s for {} s against rule {rule_name:?} ({requests} per {per_text}, graduated)",
        load.rate, load.seconds
    );
    let limit_label = format!("limit: {requests} per {per_text} = {limit_rate} requests/s");
    chart::write(
        &chart_path,
        &seconds,
        &chart::ChartInfo {
            title: &title,
            limit_rate,
            limit_label: &limit_label,
        },
    )?;
    println!("chart: {}", chart_path.display());
    Ok(envoy)
}

/// What part 3 started, stopped newest first.
struct Global {
    redis: Redis,
    gateway: Gateway,
    proxies: Vec<Envoy>,
}

impl Global {
    fn check_running(&mut self) -> Result<()> {
        for (name, p) in ["A", "B"].iter().zip(self.proxies.iter_mut()) {
            if let Some(status) = p.try_wait()? {
                bail!(
                    "proxy {name} exited by itself ({status}); log {}",
                    p.log_path().display()
                );
            }
        }
        if let Some(status) = self.gateway.try_wait()? {
            bail!(
                "the gateway exited by itself ({status}); log {}",
                self.gateway.log_path().display()
            );
        }
        if !self.redis.is_running() {
            bail!("redis-server exited by itself");
        }
        Ok(())
    }

    fn stop(mut self) -> Result<()> {
        for (name, p) in ["A", "B"].iter().zip(self.proxies.iter_mut()).rev() {
            let pid = Some(p.pid());
            let status = p.stop()?;
            unregister(pid);
            println!("stopped proxy {name} ({status})");
        }
        let pid = self.gateway.pid();
        if let Some(status) = self.gateway.stop()? {
            println!("stopped the gateway ({status})");
        }
        unregister(pid);
        let pid = self.redis.pid();
        self.redis.kill();
        unregister(pid);
        println!("stopped redis-server");
        Ok(())
    }
}

/// Part 3: Redis, the gateway and two Envoys with `envoy/ratelimit-global.json`.
fn global_part(args: &Args) -> Result<Global> {
    let config_path = demo_global_plugin_config_path();
    let plugin_config = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let config: serde_json::Value = serde_json::from_str(&plugin_config)
        .with_context(|| format!("parsing {}", config_path.display()))?;
    let rule = &config["rules"][0];
    let limit = &rule["limits"][0];
    println!(
        "\n== one global limit, two proxies: rule {:?} allows {} requests per {} per client, \
         counted by ratelimit-gateway in Redis (plugin config {})",
        rule["name"].as_str().unwrap_or("?"),
        limit["requests"],
        limit["per"].as_str().unwrap_or("?"),
        config_path.display()
    );

    let redis = start_child(
        || Redis::start().context("starting redis-server (make deps installs it)"),
        |r| vec![r.pid()],
    )?;
    println!(
        "redis-server pid {} on 127.0.0.1:{}",
        redis.pid().unwrap_or(0),
        redis.port()
    );
    let run_dir = workspace_root().join(".run/demo");
    let gateway = start_child(
        || {
            Gateway::start(
                GatewayOptions::new(redis.url())
                    .shipped_redis_timeout()
                    .port(args.gateway_port)
                    // Its policy is the proxies' own configuration.
                    .policy(plugin_config.clone())
                    .work_dir(run_dir.join("gateway")),
            )
        },
        |g| vec![g.pid()],
    )?;
    println!(
        "ratelimit-gateway pid {} on 127.0.0.1:{}; log {}",
        gateway.pid().unwrap_or(0),
        gateway.port(),
        gateway.log_path().display()
    );
    let opts = |ports: Ports, dir: &str| {
        EnvoyOptions::new(plugin_config.clone())
            .ports(ports)
            .gateway_port(gateway.port())
            .work_dir(run_dir.join(dir))
    };
    let proxies = start_child(
        || Envoy::start_all(&[opts(args.proxy_a, "proxy-a"), opts(args.proxy_b, "proxy-b")]),
        |ps| ps.iter().map(|p| Some(p.pid())).collect(),
    )?;
    let global = Global {
        redis,
        gateway,
        proxies,
    };
    for (name, p) in ["A", "B"].iter().zip(&global.proxies) {
        println!(
            "proxy {name}: Envoy pid {} on {} (admin {}); log {}",
            p.pid(),
            p.url(""),
            p.admin_url(""),
            p.log_path().display()
        );
    }

    println!("\n== 14 requests from client erin, alternating between proxy A and proxy B");
    let clients: Vec<Client> = global
        .proxies
        .iter()
        .map(|p| p.client(ConnectionMode::NewPerRequest))
        .collect();
    for i in 0..14 {
        let name = ["A", "B"][i % 2];
        let r = clients[i % 2].get("/", &[("x-client-id", "erin")])?;
        let h = |n: &str| r.header(n).unwrap_or("-").to_string();
        let mut line = format!(
            "#{:02} erin   via proxy {name} ({})  {}  x-ratelimit-remaining={}",
            i + 1,
            global.proxies[i % 2].url(""),
            r.status,
            h("x-ratelimit-remaining"),
        );
        if r.status == 429 {
            line.push_str(&format!("  retry-after={}", h("retry-after")));
        }
        println!("{line}");
    }

    println!("\n== metrics per proxy (admin /stats/prometheus)");
    for (name, p) in ["A", "B"].iter().zip(&global.proxies) {
        let stats = p.stats_prometheus()?;
        for metric in [
            "ratelimit_wasm_global_calls",
            "ratelimit_wasm_requests_allowed",
            "ratelimit_wasm_requests_denied",
            "ratelimit_wasm_global_failures",
        ] {
            let v = testkit::prometheus_value(&stats, metric).unwrap_or(0.0);
            println!("proxy {name}: {metric} {v}");
        }
    }
    println!("\n== the gateway's checks (GET /metrics)");
    for line in global.gateway.metrics()?.lines() {
        if line.starts_with("ratelimit_gateway_checks_total") {
            println!("{line}");
        }
    }
    Ok(global)
}

fn print_line(n: usize, who: &str, req: &Request, client: &Client) -> Result<()> {
    let r = client.send(req)?;
    let h = |name: &str| r.header(name).unwrap_or("-").to_string();
    let mut line = format!(
        "#{n:02} {who:<6} {:<4} {:<16} {}  x-ratelimit-limit={} remaining={} reset={}",
        req.method,
        req.path,
        r.status,
        h("x-ratelimit-limit"),
        h("x-ratelimit-remaining"),
        h("x-ratelimit-reset"),
    );
    if let Some(p) = r.header("ratelimit-policy") {
        line.push_str(&format!("  ratelimit-policy: {p}"));
    }
    if let Some(p) = r.header("ratelimit") {
        line.push_str(&format!("  ratelimit: {p}"));
    }
    if r.status == 429 {
        line.push_str(&format!("  retry-after={}", h("retry-after")));
        println!("{line}");
        println!("      {}", r.body.trim());
    } else {
        println!("{line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_seconds_reads_every_unit() {
        let v = |s: &str| per_seconds(&serde_json::Value::from(s));
        assert_eq!(v("2s"), Some(2));
        assert_eq!(v("1m"), Some(60));
        assert_eq!(v("3h"), Some(10_800));
        assert_eq!(v("1d"), Some(86_400));
        assert_eq!(per_seconds(&serde_json::json!(30)), Some(30));
        assert_eq!(v("5x"), None);
        assert_eq!(v(""), None);
    }
}
