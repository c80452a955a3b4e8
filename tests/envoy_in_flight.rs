//! Concurrency limits behind a real Envoy 1.40 (`--concurrency 2`) and a
//! slow upstream of our own (`testkit::Upstream`): exactly N in flight per
//! key across both workers, a 429 with `Retry-After: 1` past it, a slot
//! freed when a stream ends, and under 64 connections of load the upstream
//! never sees more than N of a key at once.

use serde_json::json;
use std::time::Duration;
use testkit::{Client, ConnectionMode, Envoy, EnvoyOptions, Reply, Upstream};

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
