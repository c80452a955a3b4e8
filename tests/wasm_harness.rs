//! The compiled filter (`target/wasm32-wasip1/release/ratelimit_wasm.wasm`) run in the
//! wasmtime harness: exact admission counts across workers, forced shared-data races, the fake
//! clock, costs, configuration errors, hostile input and the bounded key space.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use serde_json::{json, Value};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// Bucket entries of the filter (the seed key and other fixed keys do not match).
fn bucket_keys() -> KeyFilter {
    KeyFilter::func(|k| k.starts_with("ratelimit-wasm/") && k.contains("/set/"))
}

fn config(rules: Value) -> String {
    config_with(rules, json!({}))
}

/// `{"domain": "demo", "identity": {"client_id_header": "x-client-id"}, "rules": rules}`
/// plus the top-level fields of `extra`. `response.retry_jitter` is 0 unless `extra` sets it,
/// so that Retry-After values are exact (the jitter has its own test).
fn config_with(rules: Value, extra: Value) -> String {
    let mut c = json!({
        "domain": "demo",
        "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 0 },
        "rules": rules,
        "response": {},
    });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    if c["response"].get("retry_jitter").is_none() {
        c["response"]["retry_jitter"] = json!(0);
    }
    c.to_string()
}

fn per_client(requests: u64, per: &str) -> Value {
    json!([{ "name": "per-client", "key": ["client"], "limits": [ { "requests": requests, "per": per } ] }])
}

/// A harness whose workers all accepted `config` (panics with the logs otherwise).
fn harness(workers: usize, config: &str) -> Harness {
    let h = Harness::new(workers, config).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        h.configure_results().iter().all(|c| *c),
        "the filter refused the configuration {config}:\n{}",
        h.log_text()
    );
    h
}

fn client(id: &str) -> Request {
    Request::get("/").header("x-client-id", id)
}

fn remaining(o: &Outcome) -> u64 {
    o.expect_header("x-ratelimit-remaining")
        .parse()
        .unwrap_or_else(|e| panic!("x-ratelimit-remaining not a number ({e}): {o:?}"))
}

fn assert_allowed(o: &Outcome) {
    assert_eq!(o.status, 200, "expected the request through: {o:?}");
    assert!(o.local_response.is_none(), "{o:?}");
    assert!(o.completed, "{o:?}");
}

fn assert_denied(o: &Outcome) {
    assert_eq!(o.status, 429, "expected a 429: {o:?}");
    assert!(o.completed, "{o:?}");
}

/// The 429 of the contract: problem+json body, whole-second Retry-After.
fn assert_problem(o: &Outcome, retry_after: u64, policies: &[&str]) {
    assert_denied(o);
    assert_eq!(
        o.header_values("retry-after"),
        vec![retry_after.to_string()],
        "{o:?}"
    );
    assert_eq!(
        o.header_values("content-type"),
        vec!["application/problem+json".to_string()],
        "{o:?}"
    );
    let body = o.body_json();
    assert!(
        body["type"].as_str().is_some_and(|t| !t.is_empty()),
        "{body}"
    );
    assert_eq!(body["title"], "Too Many Requests", "{body}");
    assert_eq!(body["status"], 429, "{body}");
    assert_eq!(
        body["detail"],
        format!("Rate limit exceeded. Retry after {retry_after} seconds."),
        "{body}"
    );
    assert_eq!(body["violated-policies"], json!(policies), "{body}");
}

// ---------------------------------------------------------------------------------------------
// The harness itself (no filter needed).

#[test]
fn shared_data_has_envoys_semantics() {
    let mut sd = SharedData::new();
    assert_eq!(sd.get("k"), Err(status::NOT_FOUND));
    // A missing key is created whatever the cas; the first set takes cas 1.
    assert_eq!(sd.set("k", b"a", 12345), Ok(()));
    assert_eq!(sd.get("k"), Ok((b"a".to_vec(), 1)));
    // Wrong cas: refused, nothing written, no cas consumed.
    assert_eq!(sd.set("k", b"b", 7), Err(status::CAS_MISMATCH));
    assert_eq!(sd.get("k"), Ok((b"a".to_vec(), 1)));
    assert_eq!(sd.next_cas(), 2);
    // Right cas and cas 0 both write; one global counter.
    assert_eq!(sd.set("k", b"b", 1), Ok(()));
    assert_eq!(sd.set("j", b"x", 0), Ok(()));
    assert_eq!(sd.set("k", b"c", 0), Ok(()));
    assert_eq!(sd.get("k"), Ok((b"c".to_vec(), 4)));
    assert_eq!(sd.get("j"), Ok((b"x".to_vec(), 3)));
    assert_eq!(sd.len(), 2);
    assert_eq!(sd.total_bytes(), 4);
    assert_eq!(sd.keys().collect::<Vec<_>>(), vec!["j", "k"]);
    // The counter skips 0 when it wraps.
    sd.set_next_cas(u32::MAX);
    assert_eq!(sd.set("w", b"1", 0), Ok(()));
    assert_eq!(sd.get("w").unwrap().1, u32::MAX);
    assert_eq!(sd.set("w", b"2", u32::MAX), Ok(()));
    assert_eq!(sd.get("w").unwrap().1, 1);
}

#[test]
fn pairs_and_property_paths_round_trip() {
    let pairs = vec![
        (":status".to_string(), b"429".to_vec()),
        ("x-bin".to_string(), vec![0xff, 0x00, 0x80]),
        ("empty".to_string(), Vec::new()),
    ];
    let bytes = wire::serialize_pairs(&pairs);
    assert_eq!(&bytes[..4], &3u32.to_le_bytes());
    assert_eq!(wire::deserialize_pairs(&bytes).unwrap(), pairs);
    assert_eq!(wire::deserialize_pairs(&[]).unwrap(), vec![]);
    assert!(wire::deserialize_pairs(&bytes[..bytes.len() - 1]).is_err());
    assert_eq!(
        wire::split_property_path(b"source\0address"),
        vec!["source".to_string(), "address".to_string()]
    );
    assert_eq!(
        wire::split_property_path(b"source\0address\0"),
        vec!["source".to_string(), "address".to_string()]
    );
}

/// A hand-assembled module that calls an import the harness does not provide during
/// `_initialize`: the harness must fail with a message naming it.
#[test]
fn unknown_import_traps_with_its_name() {
    let name = b"proxy_no_such_call";
    let mut import = vec![0x01, 0x03];
    import.extend_from_slice(b"env");
    import.push(name.len() as u8);
    import.extend_from_slice(name);
    import.extend_from_slice(&[0x00, 0x00]);
    let mut export = vec![0x01, 0x0b];
    export.extend_from_slice(b"_initialize");
    export.extend_from_slice(&[0x00, 0x01]);
    let mut wasm = b"\0asm\x01\0\0\0".to_vec();
    for (id, body) in [
        (1u8, vec![0x01, 0x60, 0x00, 0x00]),
        (2, import),
        (3, vec![0x01, 0x00]),
        (7, export),
        (10, vec![0x01, 0x04, 0x00, 0x10, 0x00, 0x0b]),
    ] {
        wasm.push(id);
        wasm.push(body.len() as u8);
        wasm.extend(body);
    }
    let path = std::env::temp_dir().join(format!(
        "harness-unknown-import-{}.wasm",
        std::process::id()
    ));
    std::fs::write(&path, &wasm).unwrap();
    let err = match Harness::with_options(Options::new(1, "{}").wasm_path(&path)) {
        Ok(_) => panic!("instantiating a module calling an unknown import must fail"),
        Err(e) => e.to_string(),
    };
    let _ = std::fs::remove_file(&path);
    assert!(err.contains("env.proxy_no_such_call"), "{err}");
    assert!(err.contains("does not implement"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// The filter.

#[test]
fn two_workers_admit_exactly_the_limit_then_429() {
    let h = harness(2, &config(per_client(10, "1h")));
    for i in 0..10u64 {
        let o = h.send_rr(i as usize, client("alice"));
        assert_allowed(&o);
        assert_eq!(remaining(&o), 9 - i, "request {i}: {o:?}");
        assert_eq!(o.header_values("x-ratelimit-limit"), vec!["10"], "{o:?}");
        assert_eq!(
            o.header_values("ratelimit-policy"),
            vec![r#""per-client";q=10;w=3600"#],
            "{o:?}"
        );
        let rl = o.expect_header("ratelimit");
        assert!(
            rl.starts_with(&format!(r#""per-client";r={};t="#, 9 - i)),
            "request {i}: ratelimit: {rl}"
        );
        let t: u64 = rl.rsplit_once(";t=").unwrap().1.parse().unwrap();
        assert!((1..=3600).contains(&t), "ratelimit: {rl}");
        let reset: u64 = o.expect_header("x-ratelimit-reset").parse().unwrap();
        assert!((1..=3600).contains(&reset), "{o:?}");
    }
    for i in 10..13 {
        let o = h.send_rr(i, client("alice"));
        // 10 per hour: one request's worth comes back after 360 s.
        assert_problem(&o, 360, &["per-client"]);
        assert_eq!(o.header_values("x-ratelimit-limit"), vec!["10"], "{o:?}");
        assert_eq!(o.header_values("x-ratelimit-remaining"), vec!["0"], "{o:?}");
        assert_eq!(o.header_values("ratelimit-policy").len(), 1, "{o:?}");
        assert_eq!(o.header_values("ratelimit").len(), 1, "{o:?}");
        assert!(
            o.upstream_request.is_none(),
            "a denied request went upstream: {o:?}"
        );
    }
    // Another client is not affected.
    let o = h.send(1, client("bob"));
    assert_allowed(&o);
    assert_eq!(remaining(&o), 9);
    assert_eq!(h.metric("ratelimit_wasm_requests_allowed"), 11);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 3);
    assert_eq!(h.metric("ratelimit_wasm_errors"), 0);
    assert!(
        h.logs_at_least(LogLevel::Error).is_empty(),
        "{}",
        h.log_text()
    );
}

/// With the default configuration (jitter on), Retry-After may be spread out, but never below
/// the time the request needs to pass: a client that waits as told must not get another 429.
#[test]
fn default_retry_after_never_sends_a_client_back_too_early() {
    let c = json!({ "domain": "demo", "rules": per_client(10, "1h") });
    let h = harness(2, &c.to_string());
    let mut told_then_got = Vec::new();
    for i in 0..40 {
        let who = format!("early-{i}");
        for _ in 0..10 {
            assert_allowed(&h.send_rr(i, client(&who)));
        }
        let o = h.send_rr(i + 1, client(&who));
        assert_denied(&o);
        let secs: u64 = o.expect_header("retry-after").parse().unwrap();
        // Wait as told, then try again.
        h.advance(Duration::from_secs(secs));
        told_then_got.push((secs, h.send_rr(i, client(&who)).status));
    }
    assert!(
        told_then_got
            .iter()
            .all(|(s, status)| *s >= 360 && *status == 200),
        "(Retry-After, status after waiting that long); a token takes 360 s: {told_then_got:?}"
    );
}

#[test]
fn remaining_counts_down_across_four_workers() {
    let h = harness(4, &config(per_client(10, "1h")));
    let mut seen = Vec::new();
    for i in 0..11 {
        let o = h.send_rr(i, client("carol"));
        seen.push((o.status, o.header("x-ratelimit-remaining")));
    }
    let expected: Vec<(u16, Option<String>)> = (0..10)
        .map(|i| (200, Some((9 - i).to_string())))
        .chain([(429, Some("0".to_string()))])
        .collect();
    assert_eq!(seen, expected);
}

#[test]
fn forced_cas_conflict_still_admits_exactly_the_limit() {
    let limit = 5;
    let h = harness(2, &config(per_client(limit, "1h")));
    let statuses = Rc::new(RefCell::new(Vec::new()));
    let mut raced = 0;
    for _ in 0..8 {
        // Just before worker 0 writes its bucket set, worker 1 runs a whole request.
        let s = statuses.clone();
        h.before_next_shared_set(0, bucket_keys(), move |h, ev| {
            assert_ne!(ev.cas, 0, "bucket writes must be conditional: {ev:?}");
            s.borrow_mut().push(h.send(1, client("dave")).status);
        });
        let o = h.send(0, client("dave"));
        statuses.borrow_mut().push(o.status);
        if h.pending_hooks() == 0 {
            raced += 1;
        } else {
            h.clear_hooks();
        }
    }
    let statuses = statuses.borrow();
    let allowed = statuses.iter().filter(|s| **s == 200).count() as u64;
    let denied = statuses.iter().filter(|s| **s == 429).count() as u64;
    assert_eq!(allowed, limit, "statuses: {statuses:?}\n{}", h.log_text());
    assert_eq!(allowed + denied, statuses.len() as u64, "{statuses:?}");
    assert!(raced >= 1, "the hook never fired: statuses {statuses:?}");
    assert!(h.metric("ratelimit_wasm_cas_retries") > 0);
    assert!(
        h.shared_stats().cas_mismatches > 0,
        "{:?}",
        h.shared_stats()
    );
    assert_eq!(h.metric("ratelimit_wasm_requests_allowed"), limit);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), denied);
}

#[test]
fn first_insert_race_admits_exactly_the_limit() {
    let limit = 3;
    let h = harness(2, &config(per_client(limit, "1h")));
    let b_status = Rc::new(RefCell::new(None));
    let b = b_status.clone();
    // Worker 0 reads the bucket set and finds it missing; before it writes, worker 1 runs a
    // whole request (and also finds it missing, and creates it).
    h.after_next_shared_get_missing(0, bucket_keys(), move |h, ev| {
        assert_eq!(ev.result, Err(status::NOT_FOUND));
        *b.borrow_mut() = Some(h.send(1, client("erin")));
    });
    let a = h.send(0, client("erin"));
    assert_eq!(
        h.pending_hooks(),
        0,
        "the first get of worker 0 never missed"
    );
    let b = b_status.borrow_mut().take().unwrap();
    assert_allowed(&a);
    assert_allowed(&b);
    // Both requests were counted: one of them lost the creation race and retried.
    let mut left = [remaining(&a), remaining(&b)];
    left.sort();
    assert_eq!(left, [limit - 2, limit - 1], "a: {a:?}\nb: {b:?}");
    let mut allowed = 2;
    for i in 0..10 {
        if h.send_rr(i, client("erin")).status == 200 {
            allowed += 1;
        }
    }
    assert_eq!(allowed, limit, "{}", h.log_text());
    // The race really happened: the loser's creation (or update) was refused.
    assert!(
        h.shared_stats().cas_mismatches >= 1,
        "{:?}",
        h.shared_stats()
    );
}

#[test]
fn injected_cas_failures_are_retried_without_double_counting() {
    let h = harness(2, &config(per_client(4, "1h")));
    assert_allowed(&h.send(0, client("fay"))); // the bucket set exists now
    h.fail_next_cas_sets(2, bucket_keys());
    let o = h.send(1, client("fay"));
    assert_allowed(&o);
    assert_eq!(h.pending_cas_faults(), 0);
    assert_eq!(remaining(&o), 2, "{o:?}");
    assert_eq!(h.shared_stats().injected_cas_mismatches, 2);
    assert_eq!(h.metric("ratelimit_wasm_cas_retries"), 2);
    assert_eq!(remaining(&h.send(0, client("fay"))), 1);
    assert_eq!(remaining(&h.send(1, client("fay"))), 0);
    assert_denied(&h.send(0, client("fay")));
}

#[test]
fn fake_clock_refills_exactly() {
    let h = harness(2, &config(per_client(10, "1s")));
    let count = |h: &Harness| {
        (0..15)
            .filter(|i| h.send_rr(*i, client("gus")).status == 200)
            .count()
    };
    assert_eq!(count(&h), 10);
    let o = h.send(0, client("gus"));
    // 0.1 s until the next token, rounded up to whole seconds.
    assert_problem(&o, 1, &["per-client"]);
    h.advance(Duration::from_secs(1));
    assert_eq!(count(&h), 10, "a full second refills 10, not 11");
    h.advance(Duration::from_millis(500));
    assert_eq!(count(&h), 5, "half a second refills 5");
    h.advance(Duration::from_secs(3600));
    assert_eq!(
        count(&h),
        10,
        "the bucket never holds more than its capacity"
    );
}

#[test]
fn burst_sub_limit_and_minute_limit_both_hold() {
    let rules = json!([{ "name": "per-client", "key": ["client"],
        "limits": [ { "requests": 60, "per": "1m" }, { "requests": 10, "per": "1s" } ] }]);
    let h = harness(2, &config(rules));
    let mut per_second = Vec::new();
    let mut last_denial = None;
    for second in 0..8 {
        let mut allowed = 0;
        for i in 0..15 {
            let o = h.send_rr(i, client("hal"));
            if o.status == 200 {
                allowed += 1;
            } else {
                last_denial = Some(o);
            }
        }
        per_second.push(allowed);
        if second == 0 {
            let o = last_denial.as_ref().unwrap();
            assert_problem(o, 1, &["per-client"]);
            // The 1 s limit is the one exhausted.
            assert_eq!(o.header_values("x-ratelimit-limit"), vec!["10"], "{o:?}");
        }
        h.advance(Duration::from_secs(1));
    }
    // The minute bucket (refilling 1/s) holds 60 - 10k + k before second k's requests:
    // seconds 0-5 get the 10 of the second bucket (at second 5: 15 >= 10), second 6 gets
    // 60 - 60 + 6 = 6, and from then on the minute bucket allows 1 per second.
    assert_eq!(per_second, vec![10, 10, 10, 10, 10, 10, 6, 1]);
    let o = last_denial.unwrap();
    assert_problem(&o, 1, &["per-client"]);
    assert_eq!(o.header_values("x-ratelimit-limit"), vec!["60"], "{o:?}");
}

#[test]
fn weighted_cost_and_denials_cost_nothing() {
    let h = harness(
        2,
        &config_with(
            per_client(22, "1h"),
            json!({ "costs": [ { "match": { "path_prefix": "/search" }, "cost": 5 } ] }),
        ),
    );
    let search = || Request::get("/search?q=x").header("x-client-id", "ida");
    for (i, left) in [17u64, 12, 7, 2].into_iter().enumerate() {
        let o = h.send_rr(i, search());
        assert_allowed(&o);
        assert_eq!(remaining(&o), left);
    }
    // 2 tokens left, 5 needed: 3 tokens at 3600/22 s each = 490.9 s.
    let o = h.send(0, search());
    assert_problem(&o, 491, &["per-client"]);
    // The denied search took nothing: two cost-1 requests still pass.
    assert_eq!(remaining(&h.send(1, client("ida"))), 1);
    assert_eq!(remaining(&h.send(0, client("ida"))), 0);
    assert_denied(&h.send(1, client("ida")));
}

#[test]
fn a_request_denied_by_one_rule_consumes_nothing_from_another() {
    let rules = json!([
        { "name": "per-client", "key": ["client"], "limits": [ { "requests": 10, "per": "1h" } ] },
        { "name": "uploads", "match": { "path_prefix": "/upload", "methods": ["POST"] },
          "key": ["client", "path"], "limits": [ { "requests": 2, "per": "1h" } ] }
    ]);
    let h = harness(2, &config(rules));
    let upload = || Request::post("/upload/a").header("x-client-id", "jo");
    assert_allowed(&h.send(0, upload()));
    assert_allowed(&h.send(1, upload()));
    for w in 0..2 {
        let o = h.send(w, upload());
        assert_problem(&o, 1800, &["uploads"]);
    }
    // per-client saw 2 admitted uploads, not the 2 denied ones.
    let o = h.send(0, client("jo"));
    assert_allowed(&o);
    assert_eq!(remaining(&o), 7, "{o:?}");
    // A GET is not an upload; another path is another uploads bucket.
    let o = h.send(1, Request::post("/upload/b").header("x-client-id", "jo"));
    assert_allowed(&o);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 2);
}

#[test]
fn bad_config_is_refused_naming_the_field() {
    let rules = json!([{ "name": "per-client", "key": ["client"], "limits": [ { "requests": 10, "per": "10x" } ] }]);
    let h = Harness::new(2, &config(rules)).unwrap();
    assert_eq!(h.configure_results(), vec![false, false]);
    let lines = h.logs_containing(r#"rules[0].limits[0].per: "10x" is not a duration"#);
    assert_eq!(
        lines.iter().map(|l| l.worker).collect::<Vec<_>>(),
        vec![0, 1],
        "{}",
        h.log_text()
    );
    assert!(
        lines.iter().all(|l| l.level >= LogLevel::Error),
        "{lines:?}"
    );

    let h = Harness::new(1, "{ not json").unwrap();
    assert!(!h.configured(0));
    assert!(
        !h.logs_at_least(LogLevel::Error).is_empty(),
        "{}",
        h.log_text()
    );

    let h = Harness::new(
        1,
        &config_with(per_client(1, "1s"), json!({ "max_buckets": "many" })),
    )
    .unwrap();
    assert!(!h.configured(0));
    assert_eq!(
        h.logs_containing("max_buckets").len(),
        1,
        "{}",
        h.log_text()
    );
}

#[test]
fn non_utf8_and_huge_client_ids_are_handled() {
    let h = harness(2, &config(per_client(10, "1h")));
    let weird = vec![0xff, 0xfe, b'a', 0x80, b'z'];
    let o = h.send(0, Request::get("/").header("x-client-id", &weird));
    assert_allowed(&o);
    assert_eq!(remaining(&o), 9);
    assert_eq!(
        remaining(&h.send(1, Request::get("/").header("x-client-id", &weird))),
        8
    );
    let other = vec![0xff, 0xfe, b'b'];
    assert_eq!(
        remaining(&h.send(1, Request::get("/").header("x-client-id", &other))),
        9
    );
    assert_eq!(h.metric("ratelimit_wasm_bad_input"), 0);

    // 64 KiB ids: handled, hashed whole (ids differing in the last byte are different buckets).
    let mut big = vec![b'x'; 64 * 1024];
    let o = h.send(0, Request::get("/").header("x-client-id", &big));
    assert_allowed(&o);
    assert_eq!(remaining(&o), 9);
    assert_eq!(
        remaining(&h.send(1, Request::get("/").header("x-client-id", &big))),
        8
    );
    *big.last_mut().unwrap() = b'y';
    assert_eq!(
        remaining(&h.send(0, Request::get("/").header("x-client-id", &big))),
        9
    );
    assert_eq!(h.metric("ratelimit_wasm_bad_input"), 3);
    assert_eq!(h.metric("ratelimit_wasm_errors"), 0);
}

#[test]
fn client_falls_back_to_the_peer_ip_and_trusted_hops_read_forwarded_for() {
    let h = harness(2, &config(per_client(10, "1h")));
    let from = |addr: &str| Request::get("/").source(addr);
    assert_eq!(remaining(&h.send(0, from("198.51.100.7:1111"))), 9);
    // Same IP, other port, empty client id: the same bucket.
    assert_eq!(
        remaining(&h.send(1, from("198.51.100.7:2222").header("x-client-id", ""))),
        8
    );
    assert_eq!(remaining(&h.send(1, from("198.51.100.8:1111"))), 9);

    let c = json!({
        "domain": "demo",
        "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 1 },
        "rules": per_client(10, "1h"),
    });
    let h = harness(2, &c.to_string());
    let xff = |v: &str, addr: &str| Request::get("/").source(addr).header("x-forwarded-for", v);
    assert_eq!(
        remaining(&h.send(0, xff("1.1.1.1, 2.2.2.2", "10.0.0.1:1"))),
        9
    );
    // The client may forge entries on the left, never the one the trusted proxy appended.
    assert_eq!(
        remaining(&h.send(1, xff("9.9.9.9, 2.2.2.2", "10.0.0.2:1"))),
        8
    );
    assert_eq!(
        remaining(&h.send(1, xff("2.2.2.2, 3.3.3.3", "10.0.0.1:1"))),
        9
    );
    // No forwarded-for: the peer address.
    assert_eq!(
        remaining(&h.send(0, Request::get("/").source("10.0.0.1:5"))),
        9
    );
}

#[test]
fn header_styles() {
    let names = [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit",
        "ratelimit-policy",
    ];
    for (style, present) in [
        ("both", vec![true, true, true, true, true]),
        ("legacy", vec![true, true, true, false, false]),
        ("ietf", vec![false, false, false, true, true]),
        ("none", vec![false, false, false, false, false]),
    ] {
        let h = harness(
            1,
            &config_with(
                per_client(1, "1h"),
                json!({ "response": { "headers": style } }),
            ),
        );
        for o in [h.send(0, client("kim")), h.send(0, client("kim"))] {
            let got: Vec<bool> = names.iter().map(|n| o.header(n).is_some()).collect();
            assert_eq!(got, present, "style {style}, status {}: {o:?}", o.status);
        }
    }
}

#[test]
fn requests_matching_no_rule_pass_untouched() {
    let rules = json!([{ "name": "uploads", "match": { "path_prefix": "/upload", "methods": ["POST"] },
        "key": ["client"], "limits": [ { "requests": 1, "per": "1h" } ] }]);
    let h = harness(1, &config(rules));
    for _ in 0..3 {
        let o = h.send(0, client("lee"));
        assert_allowed(&o);
        assert_eq!(
            o.headers,
            vec![(":status".to_string(), b"200".to_vec())],
            "{o:?}"
        );
    }
    assert_eq!(h.metric("ratelimit_wasm_requests_allowed"), 0);
}

#[test]
fn a_clock_going_backwards_never_over_admits() {
    let h = harness(2, &config(per_client(10, "1s")));
    let count = |h: &Harness| {
        (0..15)
            .filter(|i| h.send_rr(*i, client("max")).status == 200)
            .count()
    };
    assert_eq!(count(&h), 10);
    let t0 = h.now_ns();
    h.set_time_ns(t0 - 5_000_000_000);
    assert_eq!(count(&h), 0, "a clock step back must not refill");
    h.set_time_ns(t0 + 1_000_000_000);
    assert_eq!(count(&h), 10);
    assert_eq!(h.metric("ratelimit_wasm_errors"), 0);
}

#[test]
fn upstream_errors_carry_the_headers_and_abandoned_requests_still_count() {
    let h = harness(2, &config(per_client(10, "1h")));
    // The upstream answers 503 later: the filter still adds its headers to that response.
    let id = h.begin(0, client("ned").hold_upstream());
    let o = h.outcome(id);
    assert_eq!(o.phase, StreamPhase::AwaitingUpstream, "{o:?}");
    assert_eq!(o.upstream_header("x-client-id").as_deref(), Some("ned"));
    let o = h.respond_upstream(
        id,
        Upstream {
            status: 503,
            headers: vec![("x-ratelimit-remaining".into(), b"999".to_vec())],
            body: b"down".to_vec(),
            chunks: Vec::new(),
        },
    );
    assert!(o.completed, "{o:?}");
    assert_eq!(o.status, 503);
    assert_eq!(o.header_values("x-ratelimit-remaining"), vec!["9"], "{o:?}");
    assert_eq!(o.body_str(), "down");
    // The client goes away before the upstream answers: the request was admitted and counts.
    let id = h.begin(1, client("ned").hold_upstream());
    let o = h.cancel(id);
    assert!(o.completed && o.cancelled, "{o:?}");
    assert_eq!(o.status, 0, "{o:?}");
    assert_eq!(remaining(&h.send(0, client("ned"))), 7);
    assert!(h.open_streams().is_empty(), "{:?}", h.open_streams());
}

/// Global rules ask the gateway with an http callout. However the callout ends (reset,
/// timeout, or answered after the client left), the filter must not trap, and with
/// `failure_mode: local` the first request is decided locally and let through.
#[test]
fn global_rule_callout_failures_never_trap() {
    let c = json!({
        "domain": "demo",
        "global": { "coalesce_us": 0, "cluster": "gateway", "timeout_ms": 50, "failure_mode": "local" },
        "rules": [{ "name": "g", "scope": "global", "key": ["client"],
                    "limits": [ { "requests": 5, "per": "1m" } ] }],
    });
    let h = Harness::with_options(Options::new(2, c.to_string()).clusters(&["gateway"]))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(h.configure_results(), vec![true, true], "{}", h.log_text());
    let start = |w: usize, who: &str| {
        let o = h.send(w, client(who));
        assert!(o.paused && !o.completed, "{o:?}");
        assert_eq!(o.http_calls.len(), 1, "{o:?}");
        let call = o.http_calls[0].clone();
        assert_eq!(call.upstream, "gateway");
        assert_eq!(call.header(":method").as_deref(), Some("POST"));
        assert_eq!(call.header(":path").as_deref(), Some("/v1/check"));
        assert_eq!(call.timeout_ms, 50);
        (o.stream, call)
    };

    // The connection to the gateway is reset (Envoy: 0 headers and no response to read).
    let (id, call) = start(0, "reset");
    h.fail_http_call(call.worker, call.token);
    let o = h.outcome(id);
    assert!(o.completed, "{o:?}");
    assert_eq!(o.status, 200, "{o:?}");

    // The gateway is too slow: Envoy answers the callout 504 after 50 ms.
    let (id, call) = start(1, "slow");
    h.advance_ms(49);
    assert_eq!(h.pending_http_calls().len(), 1);
    h.advance_ms(1);
    assert_eq!(
        h.http_calls()
            .iter()
            .find(|c| c.worker == 1 && c.token == call.token)
            .unwrap()
            .state,
        CallState::TimedOut
    );
    let o = h.outcome(id);
    assert!(o.completed, "{o:?}");
    assert_eq!(o.status, 200, "{o:?}");

    // The client leaves first; the answer still arrives (Envoy does not cancel callouts).
    let (id, call) = start(0, "gone");
    assert!(h.cancel(id).cancelled);
    h.respond_http_call(call.worker, call.token, CallResponse::new(200).body("{}"));

    // Every worker still works.
    for w in 0..2 {
        let (_, call) = start(w, "after");
        h.fail_http_call(call.worker, call.token);
    }
    assert!(h.open_streams().is_empty(), "{:?}", h.open_streams());
}

#[test]
fn bounded_keys_with_twenty_thousand_clients_and_an_exact_hot_client() {
    let max_buckets = 1024;
    let h = harness(
        2,
        &config_with(per_client(5, "1h"), json!({ "max_buckets": max_buckets })),
    );
    let fixed_keys = h.shared_len();
    let (mut hot_allowed, mut cold_allowed, mut max_keys) = (0, 0, 0);
    for i in 0..20_000usize {
        let o = h.send_rr(i, client(&format!("cold-{i}")));
        if o.status == 200 {
            cold_allowed += 1;
        }
        if i % 100 == 0 {
            if h.send_rr(i + 1, client("hot")).status == 200 {
                hot_allowed += 1;
            }
            max_keys = max_keys.max(h.shared_len());
        }
        if i % 1000 == 0 {
            h.forget_finished();
        }
    }
    max_keys = max_keys.max(h.shared_len());
    assert_eq!(
        hot_allowed, 5,
        "the hot client must stay limited while cold clients churn"
    );
    assert_eq!(cold_allowed, 20_000, "every new client has a full bucket");
    // The table is `max_buckets / WAYS` sets of WAYS (4) buckets, one key each
    // (src/limits/table.rs): 20 000 clients fill every set and never add a key.
    assert_eq!(
        max_keys,
        fixed_keys + max_buckets / ratelimit_wasm::limits::table::WAYS,
        "shared-data keys for max_buckets {max_buckets} ({fixed_keys} before any request)"
    );
    assert!(
        h.metric("ratelimit_wasm_bucket_evictions") >= 20_000 + 1 - max_buckets as u64,
        "evictions {}",
        h.metric("ratelimit_wasm_bucket_evictions")
    );
    println!(
        "keys {} (max {max_keys}), {} bytes, evictions {}, stats {:?}",
        h.shared_len(),
        h.shared_bytes(),
        h.metric("ratelimit_wasm_bucket_evictions"),
        h.shared_stats()
    );
}

#[test]
fn a_trap_fails_the_test_with_its_message() {
    let h = harness(1, &config(per_client(1, "1h")));
    // The SDK panics on an unknown context id: the harness must not swallow the trap.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        h.invoke::<(i32, i32, i32), i32>(0, 999, "proxy_on_request_headers", (999, 0, 1))
    }));
    let err = result.expect_err("a trap must fail the test");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_else(|| format!("{err:?}"));
    assert!(
        msg.contains("wasm trap in worker 0 during proxy_on_request_headers(context 999)"),
        "{msg}"
    );
    assert!(
        msg.contains("invalid context_id"),
        "the panic message is missing: {msg}"
    );
    // The worker is unusable afterwards, and says so.
    let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.send(0, client("x"))));
    let msg = again.expect_err("a poisoned worker must refuse work");
    let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("unusable after an earlier trap"), "{msg}");
}
