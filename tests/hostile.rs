//! Hostile input at scale, on the filter's own logic over a store with Envoy's
//! shared-data semantics, and on the compiled module in the wasmtime harness.

mod harness;

use harness::{Harness, Request};
use ratelimit_wasm::config;
use ratelimit_wasm::decide::{self, Step, Verdict};
use ratelimit_wasm::limits::store::MemoryStore;
use ratelimit_wasm::policy::plan::Plan;
use ratelimit_wasm::policy::request::RequestInfo;
use serde_json::json;

const SEC: u64 = 1_000_000_000;
const T0: u64 = 1_700_000_000 * SEC;

fn request(plan: &Plan, client: &[u8]) -> RequestInfo {
    let named = [
        (":method", &b"GET"[..]),
        (":path", b"/"),
        ("x-client-id", client),
    ];
    RequestInfo::with_headers(&plan.header_names, &named).with_source(b"203.0.113.9:4000")
}

fn allowed(step: Step) -> bool {
    match step {
        Step::Done(o) => matches!(o.verdict, Verdict::Pass(_)),
        Step::Call(_) => panic!("no global rules here"),
    }
}

#[test]
fn a_million_distinct_clients_stay_within_the_bound_and_a_hot_client_is_still_limited() {
    let cfg = json!({
        "domain": "hostile", "max_buckets": 4096,
        "rules": [{ "name": "per-client", "key": ["client"], "limits": [{ "requests": 5, "per": "1h" }] }]
    });
    let plan = Plan::compile(&config::parse(cfg.to_string().as_bytes()).unwrap(), [9; 16]);
    let store = MemoryStore::default();
    let mut hot_admitted = 0;
    let mut others_denied = 0;
    for i in 0..1_000_000u64 {
        let now = T0 + i * 1000;
        if i % 1000 == 0
            && allowed(decide::start(
                &plan,
                &request(&plan, b"hot"),
                &store,
                now,
                0,
            ))
        {
            hot_admitted += 1;
        }
        if !allowed(decide::start(
            &plan,
            &request(&plan, format!("c{i}").as_bytes()),
            &store,
            now,
            0,
        )) {
            others_denied += 1;
        }
    }
    // One shared-data key per set, whatever the number of clients.
    assert_eq!(store.len() as u64, plan.table.sets);
    assert_eq!(plan.table.sets, 1024);
    // Each set holds at most 4 one-limit buckets: 2 + 4 × 33 bytes, plus its key.
    let key_len = plan.table.set_key(plan.table.sets - 1).len();
    assert!(
        store.bytes() <= 1024 * (2 + 4 * 33 + key_len),
        "{} bytes",
        store.bytes()
    );
    // The hot client drains its bucket first, so it is never the one evicted.
    assert_eq!(hot_admitted, 5);
    assert_eq!(
        others_denied, 0,
        "each distinct client gets its first request"
    );
}

fn many_rules(n: usize) -> String {
    let rules: Vec<_> = (0..n)
        .map(|i| {
            json!({ "name": format!("r{i}"), "match": { "path_exact": format!("/p/{i}") },
                    "key": ["client"], "limits": [{ "requests": 2, "per": "1h" }] })
        })
        .collect();
    json!({ "domain": "many", "rules": rules, "response": { "retry_jitter": 0 } }).to_string()
}

#[test]
fn a_thousand_rules_load_and_limit_exactly_and_too_many_name_the_limit() {
    let h = Harness::new(2, &many_rules(1000)).unwrap();
    let statuses: Vec<u16> = (0..3)
        .map(|i| {
            h.send(i % 2, Request::get("/p/999").header("x-client-id", "a"))
                .status
        })
        .collect();
    assert_eq!(statuses, [200, 200, 429]);
    assert_eq!(
        h.send(0, Request::get("/p/998").header("x-client-id", "a"))
            .status,
        200
    );
    assert_eq!(
        h.send(0, Request::get("/unmatched").header("x-client-id", "a"))
            .status,
        200
    );

    let refused = Harness::new(1, &many_rules(1025)).unwrap();
    assert!(!refused.configured(0));
    assert!(
        !refused
            .logs_containing("rules: 1025 rules exceed the maximum of 1024")
            .is_empty(),
        "{:?}",
        refused.logs()
    );
}

#[test]
fn an_empty_client_id_is_the_peer_ip_not_a_shared_empty_bucket() {
    let cfg = json!({ "domain": "e", "rules": [{ "name": "r", "key": ["client"], "limits": [{ "requests": 1, "per": "1h" }] }],
                      "response": { "retry_jitter": 0 } });
    let h = Harness::new(1, &cfg.to_string()).unwrap();
    let from = |peer: &str| Request::get("/").header("x-client-id", "").source(peer);
    assert_eq!(h.send(0, from("192.0.2.1:1")).status, 200);
    assert_eq!(
        h.send(0, from("192.0.2.2:1")).status,
        200,
        "another IP, another bucket"
    );
    assert_eq!(h.send(0, from("192.0.2.1:2")).status, 429);
}
