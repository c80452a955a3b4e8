//! `make demo`, in two parts, then stops everything it started (also on Ctrl-C):
//!
//! 1. Local limits: renders `envoy/envoy.yaml` with `envoy/ratelimit.json`,
//!    starts Envoy on loopback, sends a few bursts through the rate-limit
//!    filter and prints one line per request.
//! 2. One global limit across two proxies: starts `redis-server`, the
//!    `ratelimit-gateway` in front of it and two Envoys with
//!    `envoy/ratelimit-global.json`, then sends one client's requests to the
//!    two proxies in turn and prints which proxy answered, the status and
//!    `x-ratelimit-remaining`: both draw from one shared limit.
//!
//! Usage: `demo [--free-ports | --ports LISTEN,ADMIN,UPSTREAM] [--local-only] [--hold]`
//! (default ports: the local Envoy 10000, 9901, 10001; proxy A 10010, 9902,
//! 10011; proxy B 10020, 9903, 10021; the gateway 8081; Redis a free port.
//! `--ports` moves the local Envoy, `--free-ports` everything; `--hold`
//! keeps everything running after the requests until Ctrl-C).

use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use testkit::config::{demo_global_plugin_config_path, demo_plugin_config_path};
use testkit::redis::Redis;
use testkit::{
    workspace_root, Client, ConnectionMode, Envoy, EnvoyOptions, Gateway, GatewayOptions, Ports,
    Request,
};

/// PIDs of the processes this demo started and has not stopped yet, in
/// start order, for the Ctrl-C handler.
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

fn main() -> ExitCode {
    match run() {
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
    proxy_a: Ports,
    proxy_b: Ports,
    gateway_port: u16,
    global: bool,
    hold: bool,
}

const USAGE: &str =
    "usage: demo [--free-ports | --ports LISTEN,ADMIN,UPSTREAM] [--local-only] [--hold]";

fn parse_args() -> Result<Args> {
    let mut args = Args {
        ports: Ports::DEMO,
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
        hold: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--free-ports" => {
                args.ports = Ports::free()?;
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

/// Stops every process the demo started, newest first: SIGTERM, then
/// SIGKILL after 5 s. Called from the Ctrl-C handler.
fn stop_children_from_signal() {
    let pids = match CHILDREN.lock() {
        Ok(mut c) => std::mem::take(&mut *c),
        Err(_) => return,
    };
    for pid in pids.into_iter().rev() {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            continue;
        };
        if pid <= 0 {
            continue;
        }
        // SAFETY: kill(2) and waitpid(2) have no memory-safety preconditions;
        // `status` outlives the call. Each PID is a child of this process not
        // reaped yet, so it cannot have been reused.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
            let mut status = 0;
            let mut exited = false;
            for _ in 0..250 {
                if libc::waitpid(pid, &mut status, libc::WNOHANG) != 0 {
                    exited = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if !exited {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
        }
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;
    ctrlc::set_handler(|| {
        eprintln!("\ninterrupted: stopping everything the demo started");
        stop_children_from_signal();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;

    let mut envoy = local_part(&args)?;
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
    let pid = Some(envoy.pid());
    let status = envoy.stop()?;
    unregister(pid);
    println!("stopped the local Envoy ({status})");
    Ok(())
}

/// Part 1: one Envoy with `envoy/ratelimit.json`; returns it still running.
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
    let envoy = Envoy::start(
        EnvoyOptions::new(plugin_config)
            .ports(ports)
            .work_dir(&work_dir),
    )?;
    register(Some(envoy.pid()));
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

/// What part 2 started, stopped newest first.
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

/// Part 2: Redis, the gateway and two Envoys with `envoy/ratelimit-global.json`.
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

    let redis = Redis::start().context("starting redis-server (make deps installs it)")?;
    register(redis.pid());
    println!(
        "redis-server pid {} on 127.0.0.1:{}",
        redis.pid().unwrap_or(0),
        redis.port()
    );
    let run_dir = workspace_root().join(".run/demo");
    let gateway = Gateway::start(
        GatewayOptions::new(redis.url())
            .port(args.gateway_port)
            .work_dir(run_dir.join("gateway")),
    )?;
    register(gateway.pid());
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
    let proxies =
        Envoy::start_all(&[opts(args.proxy_a, "proxy-a"), opts(args.proxy_b, "proxy-b")])?;
    for p in &proxies {
        register(Some(p.pid()));
    }
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
