//! The client contract of the rate-limit headers (docs/clients.md), in the
//! compiled filter run in the wasmtime harness, every header read as a client
//! reads it: `RateLimit-Policy` and `RateLimit` by a real RFC 9651 parser
//! (`testkit::fields`, the `sfv` crate) as Lists of one item per limit the
//! request was checked against, and `Retry-After` and `X-RateLimit-*` as
//! integers. The raw values are compared too, byte for byte.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use serde_json::{json, Value};
use std::time::Duration;
use testkit::fields::{self, Limit, Policy};

/// A configuration of `rules` keyed on `x-client-id`, without jitter so that
/// every `Retry-After` is exact, sending the header families `headers`.
fn config(rules: Value, headers: &str) -> String {
    json!({
        "domain": "headers",
        "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 0 },
        "response": { "retry_jitter": 0, "headers": headers },
        "rules": rules,
    })
    .to_string()
}

/// Two rules, one with two limits: a request to `/upload` meets three.
fn three_limits() -> Value {
    json!([
        { "name": "per-client", "key": ["client"],
          "limits": [ { "requests": 10, "per": "1m" }, { "requests": 3, "per": "1s" } ] },
        { "name": "uploads", "key": ["client"], "match": { "path_prefix": "/upload" },
          "limits": [ { "requests": 2, "per": "1h" } ] }
    ])
}

fn harness(config: &str) -> Harness {
    Harness::running(Options::new(2, config))
}

fn client(path: &str, id: &str) -> Request {
    Request::get(path).header("x-client-id", id)
}

fn policy(name: &str, q: i64, w: i64) -> Policy {
    Policy {
        name: name.into(),
        q,
        qu: None,
        w: Some(w),
    }
}

fn limit(name: &str, r: i64, t: i64) -> Limit {
    Limit {
        name: name.into(),
        r,
        t: Some(t),
    }
}

/// The one value of header `name`, read by `read`; panics with the response
/// when it is missing, repeated or malformed.
fn read<T>(o: &Outcome, name: &str, read: impl Fn(&str) -> anyhow::Result<T>) -> T {
    let values = o.header_values(name);
    let [value] = values.as_slice() else {
        panic!("{name}: {values:?}; {o:?}");
    };
    read(value).unwrap_or_else(|e| panic!("{name}: {e:#}; {o:?}"))
}

/// `X-RateLimit-Limit`, `-Remaining` and `-Reset`, read as integers.
fn legacy(o: &Outcome) -> [i64; 3] {
    [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ]
    .map(|name| read(o, name, fields::integer))
}

#[test]
fn three_policies_in_one_response_read_as_rfc_9651_lists() {
    let h = harness(&config(three_limits(), "both"));
    let o = h.send(0, client("/upload", "ann"));
    assert_eq!(o.status, 200, "{o:?}");
    // Each limit a policy of its own, in the order of the rules and their
    // limits; the second limit of a rule named after its place.
    assert_eq!(
        read(&o, "ratelimit-policy", fields::policies),
        [
            policy("per-client", 10, 60),
            policy("per-client/1", 3, 1),
            policy("uploads", 2, 3600),
        ]
    );
    // One token back every 6 s, 1/3 s and 1800 s.
    assert_eq!(
        read(&o, "ratelimit", fields::limits),
        [
            limit("per-client", 9, 6),
            limit("per-client/1", 2, 1),
            limit("uploads", 1, 1800),
        ]
    );
    assert_eq!(
        o.header("ratelimit-policy").as_deref(),
        Some(r#""per-client";q=10;w=60, "per-client/1";q=3;w=1, "uploads";q=2;w=3600"#)
    );
    assert_eq!(
        o.header("ratelimit").as_deref(),
        Some(r#""per-client";r=9;t=6, "per-client/1";r=2;t=1, "uploads";r=1;t=1800"#)
    );
    // The legacy lines: the limit with the fewest left.
    assert_eq!(legacy(&o), [2, 1, 1800]);

    // Elsewhere the upload rule does not apply: two policies, the tighter
    // second limit in the legacy lines.
    let o = h.send(1, client("/", "ann"));
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(
        read(&o, "ratelimit-policy", fields::policies),
        [policy("per-client", 10, 60), policy("per-client/1", 3, 1)]
    );
    assert_eq!(
        read(&o, "ratelimit", fields::limits),
        [limit("per-client", 8, 12), limit("per-client/1", 1, 1)]
    );
    assert_eq!(legacy(&o), [3, 1, 1]);
}

#[test]
fn a_429_of_two_denying_limits_says_to_wait_for_the_later() {
    let rules = json!([
        { "name": "per-client", "key": ["client"],
          "limits": [ { "requests": 2, "per": "1m" }, { "requests": 100, "per": "1h" } ] },
        { "name": "hourly", "key": ["client"], "limits": [ { "requests": 2, "per": "1h" } ] }
    ]);
    let h = harness(&config(rules, "both"));
    for i in 0..2 {
        assert_eq!(h.send_rr(i, client("/", "ann")).status, 200);
    }
    // Both 2-request limits are spent: a token of the first is back in 30 s,
    // of the second in 1800 s. Retry-After is the later.
    let o = h.send(0, client("/", "ann"));
    assert_eq!(o.status, 429, "{o:?}");
    assert_eq!(read(&o, "retry-after", fields::integer), 1800);
    assert_eq!(
        o.body_json()["violated-policies"],
        json!(["per-client", "hourly"])
    );
    assert_eq!(
        read(&o, "ratelimit-policy", fields::policies),
        [
            policy("per-client", 2, 60),
            policy("per-client/1", 100, 3600),
            policy("hourly", 2, 3600),
        ]
    );
    // The limit that let the request through shows what is left, not what
    // its charge would have left (97): nothing was charged.
    assert_eq!(
        read(&o, "ratelimit", fields::limits),
        [
            limit("per-client", 0, 60),
            limit("per-client/1", 98, 72),
            limit("hourly", 0, 3600),
        ]
    );
    // The legacy lines: the denying limit with the longest wait.
    assert_eq!(legacy(&o), [2, 0, 3600]);

    // Back after the first limit's wait: only the second denies now.
    h.advance(Duration::from_secs(30));
    let o = h.send(1, client("/", "ann"));
    assert_eq!(o.status, 429, "{o:?}");
    assert_eq!(read(&o, "retry-after", fields::integer), 1770);
    assert_eq!(o.body_json()["violated-policies"], json!(["hourly"]));
    assert_eq!(
        read(&o, "ratelimit", fields::limits),
        [
            limit("per-client", 1, 30),
            limit("per-client/1", 98, 42),
            limit("hourly", 0, 3570),
        ]
    );
    // Back when Retry-After said: admitted, and charged (the hour's 100 has
    // had 30 minutes to refill the two it lost).
    h.advance(Duration::from_secs(1770));
    let o = h.send(0, client("/", "ann"));
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(
        read(&o, "ratelimit", fields::limits),
        [
            limit("per-client", 1, 30),
            limit("per-client/1", 99, 36),
            limit("hourly", 0, 3600),
        ]
    );
}

#[test]
fn a_concurrency_limit_is_listed_in_concurrent_requests() {
    let rules = json!([
        { "name": "per-client", "key": ["client"], "limits": [ { "requests": 5, "per": "1m" } ] },
        { "name": "streams", "key": ["client"],
          "limits": [ { "concurrent": 2, "max_in_flight": "1m" } ] }
    ]);
    let h = harness(&config(rules, "both"));
    let held = h.begin(0, client("/", "ann").hold_upstream());
    let o = h.send(1, client("/", "ann"));
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(
        read(&o, "ratelimit-policy", fields::policies),
        [
            policy("per-client", 5, 60),
            Policy {
                name: "streams".into(),
                q: 2,
                qu: Some("concurrent-requests".into()),
                w: None,
            },
        ]
    );
    assert_eq!(
        read(&o, "ratelimit", fields::limits),
        [limit("per-client", 3, 24), limit("streams", 0, 0)]
    );
    assert_eq!(legacy(&o), [2, 0, 0]);
    // Two held: a 429 whose slot item waits a second, the rate limit
    // uncharged (three of five taken).
    let second = h.begin(1, client("/", "ann").hold_upstream());
    let full = h.send(0, client("/", "ann"));
    assert_eq!(full.status, 429, "{full:?}");
    assert_eq!(read(&full, "retry-after", fields::integer), 1);
    assert_eq!(
        read(&full, "ratelimit", fields::limits),
        [limit("per-client", 2, 36), limit("streams", 0, 1)]
    );
    for id in [held, second] {
        assert!(h.respond_upstream(id, Upstream::new(200, "done")).completed);
    }
}

/// docs/configuration.md's example: the demo's rule (60 a minute, 10 a
/// second) on a client's first request.
#[test]
fn the_documented_example_is_what_a_first_request_gets() {
    let rules = json!([{ "name": "per-client", "key": ["client"],
        "limits": [ { "requests": 60, "per": "1m" }, { "requests": 10, "per": "1s" } ] }]);
    let h = harness(&config(rules, "both"));
    let o = h.send(0, client("/", "ann"));
    assert_eq!(
        o.header("ratelimit-policy").as_deref(),
        Some(r#""per-client";q=60;w=60, "per-client/1";q=10;w=1"#)
    );
    assert_eq!(
        o.header("ratelimit").as_deref(),
        Some(r#""per-client";r=59;t=1, "per-client/1";r=9;t=1"#)
    );
}

/// `response.headers` chooses the families as before: the IETF ones carry
/// the list, the legacy ones the most constraining limit.
#[test]
fn the_header_option_still_chooses_the_families() {
    let ietf = [
        (
            "ratelimit-policy",
            r#""per-client";q=10;w=60, "per-client/1";q=3;w=1, "uploads";q=2;w=3600"#,
        ),
        (
            "ratelimit",
            r#""per-client";r=9;t=6, "per-client/1";r=2;t=1, "uploads";r=1;t=1800"#,
        ),
    ];
    let legacy = [
        ("x-ratelimit-limit", "2"),
        ("x-ratelimit-remaining", "1"),
        ("x-ratelimit-reset", "1800"),
    ];
    for (style, want) in [
        ("both", [&legacy[..], &ietf[..]].concat()),
        ("legacy", legacy.to_vec()),
        ("ietf", ietf.to_vec()),
        ("none", Vec::new()),
    ] {
        let h = harness(&config(three_limits(), style));
        let o = h.send(0, client("/upload", "ann"));
        assert_eq!(o.status, 200, "{style}: {o:?}");
        let got: Vec<(String, String)> = o
            .headers
            .iter()
            .filter(|(n, _)| n != ":status")
            .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
            .collect();
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        assert_eq!(got, want, "{style}");
    }
}
