//! The decision the compiled filter leaves for Envoy's access log: one
//! `proxy_set_property(["ratelimit"], …)` per decided request (Envoy's
//! filter state `wasm.ratelimit`), before a local reply; none for a
//! request no rule applies to, none at all with
//! `access_log.filter_state: false`; and never the client's own text.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use serde_json::{json, Value};

/// `per-client`: 2 an hour per client on `/a`.
fn config(extra: Value) -> String {
    let mut c = json!({"domain": "log", "response": {"retry_jitter": 0},
        "rules": [{"name": "per-client", "key": ["client"], "match": {"path_prefix": "/a"},
                   "limits": [{"requests": 2, "per": "1h"}]}]});
    if let Value::Object(extra) = extra {
        for (k, v) in extra {
            c[k] = v;
        }
    }
    c.to_string()
}

fn get(path: &str, client: &str) -> Request {
    Request::get(path).header("x-client-id", client)
}

/// The properties a request set, as text.
fn set(o: &Outcome) -> Vec<(Vec<String>, String)> {
    o.set_properties
        .iter()
        .map(|(p, v)| (p.clone(), String::from_utf8_lossy(v).into_owned()))
        .collect()
}

fn one(line: &str) -> Vec<(Vec<String>, String)> {
    vec![(vec!["ratelimit".to_string()], line.to_string())]
}

#[test]
fn each_decided_request_sets_its_line_once() {
    let h = Harness::running(Options::new(2, config(json!({}))));
    let outcomes: Vec<Outcome> = (0..3).map(|i| h.send(i % 2, get("/a", "ann"))).collect();
    let statuses: Vec<u16> = outcomes.iter().map(|o| o.status).collect();
    assert_eq!(statuses, [200, 200, 429]);
    let lines: Vec<_> = outcomes.iter().map(set).collect();
    assert_eq!(
        lines,
        [
            one("outcome=allowed rule=per-client remaining=1 cost=1 source=local"),
            one("outcome=allowed rule=per-client remaining=0 cost=1 source=local"),
            one("outcome=denied rule=per-client remaining=0 cost=1 source=local"),
        ]
    );
    // No rule applies: nothing set.
    assert_eq!(set(&h.send(0, get("/b", "ann"))), []);
}

#[test]
fn filter_state_false_sets_nothing() {
    let config = config(json!({"access_log": {"filter_state": false}}));
    let h = Harness::running(Options::new(1, config));
    let statuses: Vec<u16> = (0..3)
        .map(|_| {
            let o = h.send(0, get("/a", "ann"));
            assert_eq!(set(&o), []);
            o.status
        })
        .collect();
    assert_eq!(statuses, [200, 200, 429]);
}

/// A client inside the mesh that names itself like a log field cannot
/// write into the line: the values are the configuration's words and
/// numbers only.
#[test]
fn a_client_cannot_write_into_the_line() {
    let h = Harness::running(Options::new(1, config(json!({}))));
    let forged = "x outcome=allowed rule=admin source=gateway\nratelimit: forged";
    let lines: Vec<_> = (0..3)
        .map(|_| set(&h.send(0, get("/a", forged).header("x-ratelimit-rule", "admin"))))
        .collect();
    assert_eq!(
        lines,
        [
            one("outcome=allowed rule=per-client remaining=1 cost=1 source=local"),
            one("outcome=allowed rule=per-client remaining=0 cost=1 source=local"),
            one("outcome=denied rule=per-client remaining=0 cost=1 source=local"),
        ]
    );
}
