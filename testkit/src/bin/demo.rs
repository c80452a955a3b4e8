//! `make demo`: renders `envoy/envoy.yaml` with `envoy/ratelimit.json`,
//! starts Envoy on loopback, sends a few bursts through the rate-limit
//! filter and prints one line per request, then stops Envoy (also on Ctrl-C).
//!
//! Usage: `demo [--free-ports | --ports LISTEN,ADMIN,UPSTREAM] [--hold]`
//! (default ports 10000, 9901, 10001; `--hold` keeps Envoy running after
//! the bursts until Ctrl-C).

use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use testkit::config::demo_plugin_config_path;
use testkit::{workspace_root, Client, ConnectionMode, Envoy, EnvoyOptions, Ports, Request};

/// PID of the Envoy this demo started, for the Ctrl-C handler (0: none).
static ENVOY_PID: AtomicU32 = AtomicU32::new(0);

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
    hold: bool,
}

const USAGE: &str = "usage: demo [--free-ports | --ports LISTEN,ADMIN,UPSTREAM] [--hold]";

fn parse_args() -> Result<Args> {
    let mut args = Args {
        ports: Ports::DEMO,
        hold: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--free-ports" => args.ports = Ports::free()?,
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

/// Stops the Envoy started by the demo: SIGTERM, then SIGKILL after 5 s.
fn stop_envoy_from_signal() {
    let pid = ENVOY_PID.swap(0, Ordering::SeqCst);
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    if pid == 0 {
        return;
    }
    // SAFETY: kill(2) and waitpid(2) have no memory-safety preconditions;
    // `status` outlives the call.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
        let mut status = 0;
        for _ in 0..250 {
            if libc::waitpid(pid, &mut status, libc::WNOHANG) != 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, 0);
    }
}

fn run() -> Result<()> {
    let Args { ports, hold } = parse_args()?;
    ctrlc::set_handler(|| {
        eprintln!("\ninterrupted: stopping Envoy");
        stop_envoy_from_signal();
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;

    let config_path = demo_plugin_config_path();
    let plugin_config = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let work_dir = workspace_root().join(".run/demo");
    println!("plugin config: {}", config_path.display());
    println!(
        "starting Envoy: listener 127.0.0.1:{}, admin 127.0.0.1:{}, upstream 127.0.0.1:{}",
        ports.listen, ports.admin, ports.upstream
    );
    let mut envoy = Envoy::start(
        EnvoyOptions::new(plugin_config)
            .ports(ports)
            .work_dir(&work_dir),
    )?;
    ENVOY_PID.store(envoy.pid(), Ordering::SeqCst);
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

    if hold {
        println!(
            "\nEnvoy keeps running: try `curl -i -H 'x-client-id: me' {}`; press Ctrl-C to stop",
            envoy.url("/")
        );
        loop {
            if let Some(status) = envoy.try_wait()? {
                bail!(
                    "Envoy exited by itself ({status}); log {}",
                    envoy.log_path().display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    ENVOY_PID.store(0, Ordering::SeqCst);
    let status = envoy.stop()?;
    println!("\nstopped Envoy ({status})");
    Ok(())
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
