//! The request body read before the request is decided, in the compiled
//! filter run in the wasmtime harness: a reservation read from `max_tokens`
//! (`cost_from.reserve: {"pointer", "default"}`), the default when the body
//! has none, is too large or is not JSON, what a client gains by lying in
//! it (nothing past its own hold), and `ensure_stream_usage` rewriting the
//! body the upstream gets.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use serde_json::{json, Value};

/// 1,000 tokens a minute per client, read with the `openai_chat` preset; a
/// request reserves its `max_tokens` (at most `max`, 4,000, and the rule's
/// 1,000), or 100. `more` is merged into the `cost_from`.
fn cfg(more: Value) -> String {
    let mut from = json!({"preset": "openai_chat", "max": 4000,
        "reserve": {"pointer": "/max_tokens", "default": 100}});
    if let (Some(f), Some(m)) = (from.as_object_mut(), more.as_object()) {
        f.extend(m.clone());
    }
    json!({"domain": "body", "response": {"retry_jitter": 0}, "rules": [{
        "name": "tokens", "key": ["client"], "match": {"path_prefix": "/v1/chat"},
        "limits": [{"requests": 1000, "per": "1m"}], "cost_from": from}]})
    .to_string()
}

fn harness(config: &str) -> Harness {
    Harness::running(Options::new(2, config))
}

/// A chat request of client `id` with `body`; its upstream reports no usage
/// (the reservation is kept).
fn chat(id: &str, body: impl AsRef<[u8]>) -> Request {
    Request::post("/v1/chat/completions")
        .header("x-client-id", id)
        .header("content-type", "application/json")
        .body(body)
        .upstream(Upstream::new(200, "{}"))
}

fn remaining(o: &Outcome) -> Option<u64> {
    o.header("x-ratelimit-remaining")
        .and_then(|r| r.parse().ok())
}

#[test]
fn a_request_reserves_its_max_tokens_and_the_default_without_them() {
    let h = harness(&cfg(json!({})));
    let o = h.send(0, chat("ann", r#"{"model":"m","max_tokens":500}"#));
    assert_eq!((o.status, remaining(&o)), (200, Some(500)), "{o:?}");
    // The headers went on; the body was held until it ended, then decided.
    assert_eq!(o.request_action, Some(Action::Continue));
    assert_eq!(o.body_actions, [Action::Continue]);
    assert_eq!(
        o.upstream_body.as_deref(),
        Some(&br#"{"model":"m","max_tokens":500}"#[..])
    );
    assert_eq!(h.metric("ratelimit_wasm_reserve_from_body"), 1);

    // No max_tokens: the default, 100.
    let o = h.send(1, chat("ann", r#"{"model":"m"}"#));
    assert_eq!((o.status, remaining(&o)), (200, Some(400)), "{o:?}");
    // No body at all: decided at the headers, with the default.
    let o = h.send(
        0,
        Request::get("/v1/chat/completions").header("x-client-id", "ann"),
    );
    assert_eq!((o.status, remaining(&o)), (200, Some(300)), "{o:?}");
    assert_eq!(o.request_action, Some(Action::Continue));
    assert_eq!(h.metric("ratelimit_wasm_reserve_default_missing"), 2);

    // 300 left: a body asking for 301 is refused (nothing charged), 300 passes.
    let o = h.send(1, chat("ann", r#"{"max_tokens":301}"#));
    assert_eq!(o.status, 429, "{o:?}");
    assert_eq!(o.upstream_request, None);
    let o = h.send(0, chat("ann", r#"{"max_tokens":300}"#));
    assert_eq!((o.status, remaining(&o)), (200, Some(0)), "{o:?}");
    assert_eq!(h.metric("ratelimit_wasm_reserve_from_body"), 3);
    // Another client's bucket is its own.
    assert_eq!(h.send(1, chat("bob", r#"{"max_tokens":1000}"#)).status, 200);
}

#[test]
fn a_body_in_pieces_is_held_until_its_end_and_a_field_split_across_them_is_read() {
    let h = harness(&cfg(json!({})));
    let body = r#"{"model":"m","max_tokens":  742}"#;
    let o = h.send(0, chat("ann", body).body_chunked(3));
    assert_eq!((o.status, remaining(&o)), (200, Some(258)), "{o:?}");
    let mut expected = vec![Action::Pause; body.len().div_ceil(3) - 1];
    expected.push(Action::Continue);
    assert_eq!(o.body_actions, expected);
    assert_eq!(
        o.upstream_body.as_deref(),
        Some(&br#"{"model":"m","max_tokens":  742}"#[..])
    );
}

#[test]
fn a_reservation_read_from_the_body_settles_to_the_usage_reported() {
    let h = harness(&cfg(json!({})));
    let usage = r#"{"usage":{"prompt_tokens":10,"completion_tokens":20}}"#;
    let o = h.send(
        0,
        chat("ann", r#"{"max_tokens":500}"#).upstream(Upstream::new(200, usage)),
    );
    assert_eq!((o.status, remaining(&o)), (200, Some(500)), "{o:?}");
    // Settled to 30: 970 left, exactly.
    assert_eq!(h.send(1, chat("ann", r#"{"max_tokens":971}"#)).status, 429);
    let o = h.send(1, chat("ann", r#"{"max_tokens":970}"#));
    assert_eq!((o.status, remaining(&o)), (200, Some(0)), "{o:?}");
    assert_eq!(h.metric("ratelimit_wasm_usage_settled"), 1);
}

#[test]
fn a_body_past_the_bound_or_not_json_reserves_the_default_and_is_counted() {
    let h = harness(&cfg(json!({"request_body_limit": 1024})));
    let big = format!(r#"{{"max_tokens":500,"pad":"{}"}}"#, "x".repeat(2000));
    let o = h.send(0, chat("ann", &big).body_chunked(512));
    assert_eq!((o.status, remaining(&o)), (200, Some(900)), "{o:?}");
    // Held up to 1,024 bytes, then let go unread.
    assert_eq!(
        o.body_actions,
        [
            Action::Pause,
            Action::Continue,
            Action::Continue,
            Action::Continue
        ]
    );
    assert_eq!(o.upstream_body.as_deref(), Some(big.as_bytes()));
    assert_eq!(h.metric("ratelimit_wasm_reserve_default_too_large"), 1);

    let o = h.send(1, chat("ann", "max_tokens=500"));
    assert_eq!((o.status, remaining(&o)), (200, Some(800)), "{o:?}");
    assert_eq!(h.metric("ratelimit_wasm_reserve_default_not_json"), 1);
    assert_eq!(h.metric("ratelimit_wasm_reserve_from_body"), 0);
}

/// A client writing its own `max_tokens` can lower only its own hold while
/// its response is under way: 0, negative, fractional and string values
/// reserve the default, a huge one the cap, a 10 MiB body the default, and
/// the settlement charges what the response reports whatever was reserved.
#[test]
fn a_client_lying_about_max_tokens_gains_nothing_past_its_own_hold() {
    let h = harness(&cfg(json!({})));
    for (i, (body, reserved)) in [
        (r#"{"max_tokens":0}"#, 100),
        (r#"{"max_tokens":-5}"#, 100),
        (r#"{"max_tokens":2.5}"#, 100),
        (r#"{"max_tokens":"5"}"#, 100),
        (r#"{"max_tokens":null}"#, 100),
        (r#"{"max_tokens":1e308}"#, 1000),
        (r#"{"max_tokens":99999999999999999999999}"#, 1000),
    ]
    .into_iter()
    .enumerate()
    {
        let o = h.send(i % 2, chat(&format!("c{i}"), body));
        assert_eq!(
            (o.status, remaining(&o)),
            (200, Some(1000 - reserved)),
            "{body}: {o:?}"
        );
    }
    let huge = format!(r#"{{"max_tokens":1,"pad":"{}"}}"#, "x".repeat(10 << 20));
    let o = h.send(0, chat("big", &huge).body_chunked(16 << 10));
    assert_eq!((o.status, remaining(&o)), (200, Some(900)), "{o:?}");
    assert_eq!(o.upstream_body.as_ref().map(Vec::len), Some(huge.len()));
    // The settlement charges the real cost: reserving 1 (or the default
    // for 0) and using 400 leaves 600.
    let usage = r#"{"usage":{"prompt_tokens":100,"completion_tokens":300}}"#;
    let o = h.send(
        1,
        chat("zed", r#"{"max_tokens":0}"#).upstream(Upstream::new(200, usage)),
    );
    assert_eq!((o.status, remaining(&o)), (200, Some(900)), "{o:?}");
    assert_eq!(h.send(0, chat("zed", r#"{"max_tokens":601}"#)).status, 429);
    assert_eq!(h.send(0, chat("zed", r#"{"max_tokens":600}"#)).status, 200);
}

#[test]
fn ensure_stream_usage_adds_include_usage_to_the_body_the_upstream_gets() {
    let h = harness(&cfg(json!({"ensure_stream_usage": true})));
    let sent = r#"{"model":"m","stream":true,"max_tokens":50}"#;
    let o = h.send(
        0,
        chat("ann", sent).header("content-length", sent.len().to_string()),
    );
    let want =
        r#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"max_tokens":50}"#;
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(
        String::from_utf8(o.upstream_body.clone().unwrap()).unwrap(),
        want
    );
    // The headers went on before the body was read: its length is Envoy's
    // to frame (chunked to an HTTP/1 upstream).
    assert_eq!(o.upstream_header("content-length"), None);
    assert_eq!(remaining(&o), Some(950));
    assert_eq!(h.metric("ratelimit_wasm_usage_body_rewritten"), 1);

    // Merged into the stream_options there are.
    let o = h.send(
        1,
        chat("ann", r#"{"stream":true,"stream_options":{"x":1}}"#),
    );
    assert_eq!(
        o.upstream_body.as_deref(),
        Some(&br#"{"stream":true,"stream_options":{"include_usage":true,"x":1}}"#[..])
    );
    assert_eq!(o.upstream_header("content-length"), None);

    // Nothing to ask: the body goes on as it came.
    for body in [
        r#"{"stream":false,"max_tokens":5}"#,
        r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
    ] {
        let o = h.send(
            0,
            chat("bob", body).header("content-length", body.len().to_string()),
        );
        assert_eq!(o.upstream_body.as_deref(), Some(body.as_bytes()));
    }
    assert_eq!(h.metric("ratelimit_wasm_usage_body_rewritten"), 2);

    // Too large to read: unchanged and counted.
    let big = format!(r#"{{"stream":true,"pad":"{}"}}"#, "x".repeat(70_000));
    let o = h.send(1, chat("cat", &big).body_chunked(8192));
    assert_eq!(o.upstream_body.as_deref(), Some(big.as_bytes()));
    assert_eq!(h.metric("ratelimit_wasm_usage_body_unchanged"), 1);
}

#[test]
fn a_fixed_reserve_with_ensure_stream_usage_still_waits_only_for_matching_requests() {
    let h = harness(&cfg(json!({"reserve": 7, "ensure_stream_usage": true})));
    let o = h.send(0, chat("ann", r#"{"stream":true,"max_tokens":500}"#));
    assert_eq!(remaining(&o), Some(993));
    assert_eq!(o.body_actions, [Action::Continue]);
    // A request no rule reads the body of is decided at its headers and
    // its body passes untouched.
    let o = h.send(
        1,
        Request::post("/other")
            .header("x-client-id", "ann")
            .body(r#"{"stream":true}"#),
    );
    assert_eq!(o.request_action, Some(Action::Continue));
    assert_eq!(o.body_actions, [Action::Continue]);
    assert_eq!(o.upstream_body.as_deref(), Some(&br#"{"stream":true}"#[..]));
    assert_eq!(h.metric("ratelimit_wasm_reserve_from_body"), 0);
}

#[test]
fn a_request_that_waited_for_its_body_still_calls_the_gateway_and_resumes() {
    let config = json!({"domain": "body", "response": {"retry_jitter": 0},
        "global": { "coalesce_us": 0, "cluster": "gateway", "timeout_ms": 50, "failure_mode": "open"},
        "rules": [
            {"name": "g", "scope": "global", "key": ["client"], "cost": 1,
             "limits": [{"requests": 10, "per": "1m"}]},
            {"name": "tokens", "key": ["client"], "limits": [{"requests": 1000, "per": "1m"}],
             "cost_from": {"preset": "openai_chat", "max": 4000,
                "reserve": {"pointer": "/max_tokens", "default": 100}}}]})
    .to_string();
    let h = harness(&config);
    let id = h.begin(0, chat("ann", r#"{"max_tokens":250}"#));
    let o = h.outcome(id);
    assert_eq!(o.body_actions, [Action::Pause]);
    assert_eq!(o.http_calls.len(), 1, "{o:?}");
    assert_eq!(o.upstream_request, None);
    h.fail_http_call(o.http_calls[0].worker, o.http_calls[0].token);
    let o = h.outcome(id);
    assert!(o.completed, "{o:?}");
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.resumes, 1);
    assert_eq!(
        o.upstream_body.as_deref(),
        Some(&br#"{"max_tokens":250}"#[..])
    );
    // The local bucket holds the 250 reserved: 751 more is refused there,
    // without a callout.
    let o = h.send(1, chat("ann", r#"{"max_tokens":751}"#));
    assert_eq!((o.status, o.http_calls.len()), (429, 0), "{o:?}");
}

/// The harness holds Envoy's rule: a filter that paused the headers sees
/// the body only once it resumes them. A request waiting for the gateway
/// (no rule reads its body) gets its body after the answer; and a body the
/// filter decided at `request_body_limit` holds its remaining pieces while
/// the gateway answers.
#[test]
fn a_body_waits_with_its_request_for_the_gateway() {
    let config = json!({"domain": "body", "response": {"retry_jitter": 0},
        "global": { "coalesce_us": 0, "cluster": "gateway", "timeout_ms": 50, "failure_mode": "open"},
        "rules": [
            {"name": "g", "scope": "global", "key": ["client"], "cost": 1,
             "limits": [{"requests": 10, "per": "1m"}]},
            {"name": "tokens", "key": ["client"], "match": {"path_prefix": "/v1/chat"},
             "limits": [{"requests": 1000, "per": "1m"}],
             "cost_from": {"preset": "openai_chat", "max": 4000, "request_body_limit": 1024,
                "reserve": {"pointer": "/max_tokens", "default": 100}}}]})
    .to_string();
    let h = harness(&config);
    let id = h.begin(
        0,
        Request::post("/other")
            .header("x-client-id", "ann")
            .body("abc")
            .upstream(Upstream::new(200, "{}")),
    );
    let o = h.outcome(id);
    assert_eq!(
        (o.request_action, o.body_actions.len()),
        (Some(Action::Pause), 0)
    );
    h.fail_http_call(o.http_calls[0].worker, o.http_calls[0].token);
    let o = h.outcome(id);
    assert_eq!(o.body_actions, [Action::Continue]);
    assert_eq!(o.upstream_body.as_deref(), Some(&b"abc"[..]));

    let big = format!(r#"{{"max_tokens":300,"pad":"{}"}}"#, "x".repeat(3000));
    let id = h.begin(1, chat("ann", &big).body_chunked(600));
    let o = h.outcome(id);
    // 600 bytes held, then 1,200 past the bound: decided, the callout
    // made, and the rest held with it.
    assert_eq!(o.body_actions, [Action::Pause; 6]);
    assert_eq!(o.upstream_request, None);
    h.fail_http_call(o.http_calls[0].worker, o.http_calls[0].token);
    let o = h.outcome(id);
    assert_eq!((o.status, remaining(&o)), (200, Some(900)), "{o:?}");
    assert_eq!(o.upstream_body.as_deref(), Some(big.as_bytes()));
}
