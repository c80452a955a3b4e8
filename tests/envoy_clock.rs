//! A real Envoy 1.40 gives the filter its monotonic clock (WASI `clock_time_get`, id 1),
//! so the filter's deadlines and buckets never follow a step of the wall clock
//! (README "Robustness"; the steps themselves are tested in `tests/wasm_clock.rs`).

use serde_json::json;
use std::time::Duration;
use testkit::{ConnectionMode, Envoy, EnvoyOptions, Request};

#[test]
fn every_worker_times_on_envoys_monotonic_clock() {
    let config = json!({
        "domain": "clock",
        "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 0 },
        "rules": [{ "name": "two", "key": ["client"], "limits": [{ "requests": 2, "per": "1m" }] }]
    })
    .to_string();
    let envoy = Envoy::start(EnvoyOptions::new(config))
        .unwrap_or_else(|e| panic!("could not start Envoy: {e:#}"));
    let c = envoy.client(ConnectionMode::NewPerRequest);
    let statuses: Vec<u16> = (0..3)
        .map(|_| {
            c.send(&Request::get("/").header("x-client-id", "mo"))
                .unwrap_or_else(|e| panic!("request failed: {e:#}"))
                .status
        })
        .collect();
    assert_eq!(statuses, [200, 200, 429]);
    let needle = "timing on the host's monotonic clock";
    assert!(
        envoy.wait_for_log(needle, Duration::from_secs(5)),
        "{}",
        envoy.log_tail(40)
    );
    let log = envoy.log();
    // Envoy configures a VM on the main thread and one per worker (--concurrency 2).
    assert!(log.matches(needle).count() >= 3, "{log}");
    assert!(!log.contains("no monotonic clock"), "{log}");
}
