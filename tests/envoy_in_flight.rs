//! Concurrency limits behind a real Envoy 1.40 (`--concurrency 2`) and a
//! slow upstream of our own (`testkit::Upstream`): exactly N in flight per
//! key across both workers, a 429 with `Retry-After: 1` past it, a slot
//! freed when a stream ends, and under 64 connections of load the upstream
//! never sees more than N of a key at once; and a global limit held on the
//! gateway across two proxies, one of which is killed mid-stream.

use serde_json::json;
use std::time::Duration;
use testkit::{Client, ConnectionMode, Envoy, EnvoyOptions, Reply, Request, Upstream};

fn start(upstream: &Upstream) -> Envoy {
    let config = json!({
        "domain": "inflight-e2e",
        "rules": [{"name": "streams", "key": ["client"], "limits": [{"concurrent": 3}]}],
        "response": { "retry_jitter": 0.5 }
    })
    .to_string();
    Envoy::start(EnvoyOptions::new(config).upstream_port(upstream.port()))
        .unwrap_or_else(|e| panic!("could not start Envoy: {e:#}"))
}

fn client(envoy: &Envoy) -> Client {
    envoy.client(ConnectionMode::NewPerRequest)
}

#[test]
fn three_in_flight_the_fourth_is_429_and_one_more_fits_once_one_ends() {
    let upstream = Upstream::start().expect("upstream");
    upstream.route("/slow", Reply::json("{}"));
    upstream.route("/fast", Reply::json("{}"));
    let gate = upstream.hold("/slow");
    let envoy = start(&upstream);
    std::thread::scope(|s| {
        let held: Vec<_> = (0..3)
            .map(|_| s.spawn(|| client(&envoy).get_as("/slow", "ann")))
            .collect();
        assert!(
            upstream.wait_in_flight(3, Duration::from_secs(10)),
            "three requests reach the upstream"
        );
        let r = client(&envoy).get_as("/fast", "ann");
        assert_eq!(r.status, 429, "{r:#?}");
        assert_eq!(r.int_header("retry-after"), 1);
        assert_eq!(
            r.expect_header("ratelimit-policy"),
            "\"streams\";q=3;qu=\"concurrent-requests\""
        );
        assert_eq!(upstream.requests("/fast"), 0);
        // Another client is not held back.
        assert_eq!(client(&envoy).get_as("/fast", "bob").status, 200);
        gate.open();
        for h in held {
            assert_eq!(h.join().expect("request thread").status, 200);
        }
    });
    for _ in 0..5 {
        assert_eq!(client(&envoy).get_as("/fast", "ann").status, 200);
    }
}

#[test]
fn under_64_connections_the_upstream_never_sees_more_than_three_of_a_key() {
    let upstream = Upstream::start().expect("upstream");
    upstream.route(
        "/slow",
        Reply::json("{}")
            .chunks(vec![b"{".to_vec(), b"}".to_vec()])
            .chunk_delay(Duration::from_millis(20)),
    );
    let envoy = start(&upstream);
    let (mut ok, mut denied) = (0, 0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..64)
            .map(|_| {
                s.spawn(|| {
                    let c = client(&envoy);
                    (0..5)
                        .map(|_| c.get_as("/slow", "ann").status)
                        .collect::<Vec<u16>>()
                })
            })
            .collect();
        for w in workers {
            for status in w.join().expect("load thread") {
                match status {
                    200 => ok += 1,
                    429 => denied += 1,
                    other => panic!("unexpected status {other}"),
                }
            }
        }
    });
    assert_eq!(ok + denied, 320);
    assert!(ok >= 3 && denied > 0, "admitted {ok}, denied {denied}");
    assert!(
        upstream.peak_in_flight() <= 3,
        "the upstream saw {} in flight",
        upstream.peak_in_flight()
    );
    assert_eq!(upstream.requests("/slow"), ok);
    println!(
        "64 connections: {ok} admitted, {denied} denied, peak {} in flight",
        upstream.peak_in_flight()
    );
}

/// Global `concurrent: 3` (slots held at most 4 s) over two proxies and the
/// gateway on a real Redis: three in flight across both, the fourth 429 on
/// either; a proxy killed mid-stream (SIGKILL: no `on_log`, no settlement)
/// leaves its two slots held until their deadline and no longer.
#[test]
fn three_in_flight_across_two_proxies_and_a_killed_proxys_slots_come_back_at_their_deadline() {
    use std::time::Instant;
    use testkit::redis::Redis;
    use testkit::{Gateway, GatewayOptions};
    let redis = Redis::start().expect("redis-server");
    let config = json!({
        "domain": "inflight-global",
        "global": {"cluster": "ratelimit_gateway", "timeout_ms": 500, "failure_mode": "closed"},
        "rules": [{"name": "streams", "scope": "global", "key": ["client"],
                   "limits": [{"concurrent": 3, "max_in_flight": "4s"}]}],
        "response": {"retry_jitter": 0}
    })
    .to_string();
    let gateway = Gateway::start(GatewayOptions::new(redis.url()).policy(config.clone()))
        .expect("ratelimit-gateway");
    let upstream = Upstream::start().expect("upstream");
    for path in ["/slow", "/slow2", "/fast"] {
        upstream.route(path, Reply::json("{}"));
    }
    let first = upstream.hold("/slow");
    let second = upstream.hold("/slow2");
    let opts = EnvoyOptions::new(config)
        .upstream_port(upstream.port())
        .gateway_port(gateway.port());
    let mut envoys = Envoy::start_all(&[opts.clone(), opts]).expect("two Envoys");
    let settled = |e: &Envoy| e.metric("ratelimit_wasm_global_settled").ok().flatten();
    let fast = |e: &Envoy| client(e).get_as("/fast", "ann");
    let (a_client, b_client) = (client(&envoys[0]), client(&envoys[1]));
    // A's two fail when A is killed: sent as results, not unwrapped.
    let a_request = Request::get("/slow").header("x-client-id", "ann");
    let started = Instant::now();
    std::thread::scope(|s| {
        let a: Vec<_> = (0..2)
            .map(|_| s.spawn(|| a_client.send(&a_request)))
            .collect();
        let b = s.spawn(|| b_client.get_as("/slow", "ann"));
        assert!(
            upstream.wait_in_flight(3, Duration::from_secs(10)),
            "three requests reach the upstream"
        );
        for e in &envoys {
            let r = fast(e);
            assert_eq!(r.status, 429, "{r:#?}");
            assert_eq!(r.int_header("retry-after"), 1);
            assert_eq!(
                r.expect_header("ratelimit-policy"),
                "\"streams\";q=3;qu=\"concurrent-requests\""
            );
        }
        envoys[0].kill();
        first.open();
        assert_eq!(b.join().expect("request thread").status, 200);
        for h in a {
            assert!(
                h.join().expect("request thread").is_err(),
                "A died mid-stream"
            );
        }
    });
    // B's slot is released through the gateway; A's two stay held.
    let deadline = Instant::now() + Duration::from_secs(5);
    while settled(&envoys[1]) != Some(1.0) {
        assert!(
            Instant::now() < deadline,
            "B's settlement: {:?}",
            settled(&envoys[1])
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Counted on arrival at the upstream (A's dead streams may still be in flight there).
    let arrived = |path: &str, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while upstream.requests(path) < n {
            assert!(Instant::now() < deadline, "{n} requests reach {path}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    std::thread::scope(|s| {
        let held = s.spawn(|| b_client.get_as("/slow2", "ann"));
        arrived("/slow2", 1);
        assert_eq!(fast(&envoys[1]).status, 429, "A's two slots and this one");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "the check above must come before the killed proxy's slots' deadline"
        );
        second.open();
        assert_eq!(held.join().expect("request thread").status, 200);
    });
    // Past the deadline of A's slots (4 s from their start): three fit again, and a fourth does not.
    std::thread::sleep(Duration::from_millis(4200).saturating_sub(started.elapsed()));
    let third = upstream.hold("/slow3");
    upstream.route("/slow3", Reply::json("{}"));
    std::thread::scope(|s| {
        let held: Vec<_> = (0..3)
            .map(|_| s.spawn(|| b_client.get_as("/slow3", "ann")))
            .collect();
        arrived("/slow3", 3);
        assert_eq!(fast(&envoys[1]).status, 429);
        third.open();
        for h in held {
            assert_eq!(h.join().expect("request thread").status, 200);
        }
    });
    assert_eq!(upstream.requests("/fast"), 0);
}

/// The filter built with `--features test-trap` (`make wasm`): a response
/// carrying `x-test-trap` kills its VM.
fn crashing_wasm() -> std::path::PathBuf {
    let path =
        testkit::paths::target_dir().join("test-trap/wasm32-wasip1/release/ratelimit_wasm.wasm");
    assert!(
        path.is_file(),
        "{} is missing: build it with `make wasm` (cargo build --release --target wasm32-wasip1 \
         -p ratelimit-wasm --features test-trap --target-dir target/test-trap)",
        path.display()
    );
    path
}

/// A VM that dies holding a slot (a trap in `on_http_response_headers`, as
/// a crash: its `on_log` never runs) leaves the slot in shared data, where
/// it outlives the VM; Envoy's reloaded VM and the other worker's both
/// count it until its `max_in_flight` (2 s), then take it back.
#[test]
fn a_slot_held_by_a_vm_that_crashed_is_taken_back_at_max_in_flight() {
    use std::time::Instant;
    let upstream = Upstream::start().expect("upstream");
    upstream.route("/crash", Reply::json("{}").header("x-test-trap", "1"));
    upstream.route("/fast", Reply::json("{}"));
    let config = json!({
        "domain": "inflight-crash",
        "rules": [{"name": "streams", "key": ["client"],
                   "limits": [{"concurrent": 1, "max_in_flight": "2s"}]}],
        "response": {"retry_jitter": 0}
    })
    .to_string();
    let mut opts = EnvoyOptions::new(config).upstream_port(upstream.port());
    opts.wasm = Some(crashing_wasm());
    let envoy = Envoy::start(opts).unwrap_or_else(|e| panic!("could not start Envoy: {e:#}"));
    // A VM that traps within 1-1.5 s of its load leaves its worker answering
    // 503 until then (tests/envoy_failure_policy.rs): let both VMs settle first.
    std::thread::sleep(Duration::from_millis(1600));
    let started = Instant::now();
    let crashed = client(&envoy).get_as("/crash", "ann");
    assert_eq!(
        crashed.status, 503,
        "the VM died answering it: {crashed:#?}"
    );
    // Both workers (one with a fresh VM) see the dead VM's slot until its deadline.
    let mut denied = 0;
    while started.elapsed() < Duration::from_millis(1500) {
        let r = client(&envoy).get_as("/fast", "ann");
        assert_eq!(r.status, 429, "{r:#?}");
        denied += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(denied >= 4, "{denied}");
    std::thread::sleep(Duration::from_millis(2200).saturating_sub(started.elapsed()));
    for _ in 0..4 {
        assert_eq!(client(&envoy).get_as("/fast", "ann").status, 200);
    }
    let reloaded = envoy
        .stat("wasm.ratelimit.vm_reload_success")
        .ok()
        .flatten();
    assert_eq!(reloaded, Some(1), "a fresh VM replaced the crashed one");
    assert_eq!(upstream.requests("/fast"), 4);
}
