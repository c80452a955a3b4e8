//! The binary's thread-per-core layout (`--worker-threads`): every worker
//! thread runs, has its own Redis connection, and a limit stays exact when
//! the checks of one bucket arrive on different threads at once.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{write, TempDir};
use testkit::redis::Redis;
use testkit::{Client, ConnectionMode, Gateway, GatewayOptions, Request};

/// Domain `api`, one global rule `rule` of 20 a minute per client.
const POLICY: &str = r#"{"domain": "api", "global": {"cluster": "gw"},
  "rules": [{"name": "rule", "scope": "global", "key": ["client"],
             "limits": [{"requests": 20, "per": "1m"}]}]}"#;

const CHECK: &str = r#"{"version":2,"domain":"api","buckets":[{"rule":"rule","key":"rule/c=alice","tag":"c=alice","variant":"default","cost":1}]}"#;

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// The names of the process's threads.
fn threads(pid: u32) -> BTreeSet<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

#[test]
fn every_worker_has_its_thread_and_connection_and_the_limit_stays_exact() {
    const WORKERS: usize = 3;
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = ok(
        Gateway::start(
            GatewayOptions::new(redis.url())
                .policy(POLICY)
                // The count is the subject here, not the timeout: on a busy
                // 2-core machine a Redis answer can take over the default
                // 20 ms, and that check would be a 503 instead of a decision.
                .args(&[
                    "--worker-threads",
                    &WORKERS.to_string(),
                    "--redis-timeout-ms",
                    "2000",
                ]),
        ),
        "starting the gateway",
    );
    let pid = gw.pid().expect("the gateway's pid");
    let names = threads(pid);
    for w in 0..WORKERS {
        assert!(
            names.contains(&format!("rlgw-worker-{w}")),
            "worker {w} missing among {names:?}"
        );
    }
    assert!(
        !names.contains(&format!("rlgw-worker-{WORKERS}")),
        "{names:?}"
    );

    // 60 checks of one bucket, each on its own connection, 12 at a time.
    let answers = spread_checks(&gw, 60, 12);
    assert_eq!(allowed_denied(&answers), (20, 40), "{answers:?}");

    // One Redis connection per worker: every client but redis-cli's own,
    // the one running CLIENT LIST.
    std::thread::sleep(Duration::from_millis(100));
    let clients = ok(redis.cli(&["CLIENT", "LIST"]), "CLIENT LIST");
    let gateway: Vec<&str> = clients
        .lines()
        .filter(|l| !l.contains("cmd=client|list"))
        .collect();
    assert_eq!(gateway.len(), WORKERS, "{clients}");
}

/// Posts `n` checks of [`CHECK`], each on its own connection, `par` at a
/// time (the kernel spreads the connections over the workers' sockets);
/// gives each answer's status and body.
fn spread_checks(gw: &Gateway, n: usize, par: usize) -> Vec<(u16, String)> {
    let url = gw.url("");
    std::thread::scope(|s| {
        let tasks: Vec<_> = (0..par)
            .map(|_| {
                let url = url.clone();
                s.spawn(move || {
                    let client = Client::new(url, ConnectionMode::NewPerRequest);
                    (0..n / par)
                        .map(|_| {
                            let req = Request::post("/v1/check", CHECK.to_string())
                                .header("content-type", "application/json");
                            let r = ok(client.send(&req), "posting a check");
                            (r.status, r.body)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        tasks.into_iter().flat_map(|t| t.join().unwrap()).collect()
    })
}

/// How many answers were 200 and allowed, and how many 200 and denied.
fn allowed_denied(answers: &[(u16, String)]) -> (usize, usize) {
    let count = |allowed: &str| {
        answers
            .iter()
            .filter(|(status, body)| *status == 200 && body.contains(allowed))
            .count()
    };
    (count(r#""allowed":true"#), count(r#""allowed":false"#))
}

/// After Redis dies and comes back, every worker's connection is made
/// again by itself, including a worker that saw no check while Redis was
/// down: the first check on it is decided, not answered 503 on the dead
/// connection. The outage outlasts the delays of the client's default
/// series of reconnect attempts (2.2 s before jitter).
#[test]
fn every_worker_reconnects_by_itself_after_redis_comes_back() {
    let mut redis = ok(Redis::start(), "starting redis-server");
    let gw = ok(
        Gateway::start(
            GatewayOptions::new(redis.url())
                .policy(POLICY)
                .args(&["--worker-threads", "2"]),
        ),
        "starting the gateway",
    );
    let before = spread_checks(&gw, 8, 4);
    assert!(before.iter().all(|(s, _)| *s == 200), "{before:?}");

    redis.kill();
    std::thread::sleep(Duration::from_secs(3));
    ok(redis.restart(), "restarting redis-server");
    // Longer than the longest wait between two attempts to connect.
    std::thread::sleep(Duration::from_millis(1500));

    // Redis came back empty: 20 of the 24 are allowed, 4 denied, none fails.
    let after = spread_checks(&gw, 24, 4);
    assert_eq!(allowed_denied(&after), (20, 4), "{after:?}");
}

/// The workers share one listening socket each for `--listen` and
/// `--grpc-listen`, not a port through `SO_REUSEPORT`: another process of
/// the same user cannot bind the port beside them and take a share of the
/// callers' connections.
#[test]
fn no_other_socket_can_join_the_gateways_ports() {
    let redis = ok(Redis::start(), "starting redis-server");
    let dir = TempDir::new();
    let rls = write(
        dir.path(),
        "rls.yaml",
        r#"{"domain": "d", "descriptors": [{"key": "k", "rate_limit": {"unit": "second", "requests_per_unit": 1}}]}"#,
    );
    let grpc_port = testkit::free_port().expect("a free port");
    let grpc = format!("127.0.0.1:{grpc_port}");
    let gw = ok(
        Gateway::start(GatewayOptions::new(redis.url()).policy(POLICY).args(&[
            "--worker-threads",
            "2",
            "--grpc-listen",
            &grpc,
            "--rls-config",
            &rls,
        ])),
        "starting the gateway",
    );
    let http: std::net::SocketAddr = gw
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    for addr in [http, grpc.parse().unwrap()] {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_reuseport(true).unwrap();
        let joined = socket.bind(addr);
        assert_eq!(
            joined.as_ref().map_err(std::io::Error::kind).err(),
            Some(std::io::ErrorKind::AddrInUse),
            "binding {addr} beside the gateway: {joined:?}"
        );
    }
}

/// Health is every worker's: a write that goes through on this thread's
/// Redis connection is not enough while another worker's is not made yet
/// (its checks would answer 503 behind a healthy `/healthz`). Lane 1's
/// runtime is never driven here, so lane 1 never connects.
#[test]
fn health_waits_for_every_workers_connection() {
    use ratelimit_gateway::redis::store::{set_lane, Store};
    let redis = ok(Redis::start(), "starting redis-server");
    let (driven, idle) = (runtime(), runtime());
    let metrics = ratelimit_gateway::metrics::Metrics::new().unwrap();
    let store = driven.block_on(async {
        Store::new(
            ratelimit_gateway::Target::Single(redis.url()),
            "rl:",
            &Default::default(),
            Duration::from_secs(2),
            metrics,
            &[driven.handle().clone(), idle.handle().clone()],
        )
        .unwrap()
    });
    set_lane(0);
    driven.block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while store
            .query::<String>(&redis::cmd("PING"), "ping")
            .await
            .is_err()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "lane 0 never connected"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let probe = store.probe_write().await;
        assert_eq!(
            probe.as_ref().map_err(|e| e.kind()),
            Err("not_connected"),
            "healthy while lane 1 has no connection: {probe:?}"
        );
    });
    idle.shutdown_background();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}
