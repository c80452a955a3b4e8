//! `gateway_answer`: the filter's reading of the gateway's answer
//! (`callout::parse_answer`) on any status and body, for a fixed plan with two global
//! rules (three limits) and a quota, and the same bytes as an answer to a lease of the
//! first rule (`callout::parse_lease_answer`). It must never panic, and whatever it
//! accepts must be clamped to what the limits the gateway says it enforced make possible
//! (a lease: to this filter's limits, never more granted than asked).
//!
//! Input: the status up to the first `\n` (`~` for no answer at all), then the body. An
//! input without `\n` is a body with status 200.

use ratelimit_wasm::global::callout::{self, Answer, AnswerError};
use ratelimit_wasm::global::lease;
use ratelimit_wasm::policy::plan::{Evaluation, Plan};
use ratelimit_wasm::policy::request::RequestInfo;

pub const CONFIG: &str = r#"{
  "domain": "fuzz",
  "tiers": { "free": {} },
  "identity": { "default_tier": "free" },
  "global": { "cluster": "gw", "failure_mode": "local", "instances": 2,
              "lease": { "fraction": 0.5 } },
  "rules": [
    { "name": "g", "scope": "global", "key": ["client"],
      "limits": [ { "requests": 10, "per": "1m" }, { "requests": 2, "per": "1s" } ] },
    { "name": "g-up", "scope": "global", "algorithm": "sliding_window",
      "match": { "path_prefix": "/upload" }, "key": ["client", "path"],
      "limits": [ { "requests": 5, "per": "1h" } ] },
    { "name": "local", "key": ["client"], "limits": [ { "requests": 100, "per": "1m" } ] }
  ],
  "quotas": [ { "name": "monthly", "key": ["client"], "period": "month", "limit": 1000,
                "upgrade_url": "https://example.com/upgrade" } ]
}"#;

/// The fixed plan and the evaluation of `POST /upload/x` by client `alice`.
fn setup() -> (Plan, Evaluation) {
    let cfg = ratelimit_wasm::config::parse(CONFIG.as_bytes()).expect("the fixed config parses");
    let plan = Plan::compile(&cfg, [0; 16]);
    let named = [
        (":method", &b"POST"[..]),
        (":path", b"/upload/x?y"),
        ("x-client-id", b"alice"),
    ];
    let eval = plan.evaluate(
        &RequestInfo::with_headers(&plan.header_names, &named).with_source(b"192.0.2.1:1000"),
    );
    assert_eq!(eval.global.len(), 2);
    assert_eq!(eval.quotas.len(), 1);
    (plan, eval)
}

thread_local! {
    static SETUP: (Plan, Evaluation) = setup();
}

pub fn run(data: &[u8]) {
    SETUP.with(|(plan, eval)| run_with(plan, eval, data));
}

fn run_with(plan: &Plan, eval: &Evaluation, data: &[u8]) {
    let (status, body) = match data.iter().position(|&b| b == b'\n') {
        Some(i) if &data[..i] == b"~" => (None, &data[i + 1..]),
        Some(i) => (Some(&data[..i]), &data[i + 1..]),
        None => (Some(&b"200"[..]), data),
    };
    let result = callout::parse_answer(plan, &eval.global, &eval.quotas, status, body);
    match &result {
        Err(AnswerError::NoAnswer) => assert!(status.is_none()),
        Err(AnswerError::Status(_)) => assert_ne!(status, Some(&b"200"[..])),
        Err(_) => {}
        Ok(answer) => check(plan, eval, answer),
    }
    // Same input, same answer.
    assert_eq!(
        result,
        callout::parse_answer(plan, &eval.global, &eval.quotas, status, body)
    );
    lease(plan, eval, status, body);
}

/// The bytes as the answer to a lease of 3 tokens of the first global rule.
fn lease(plan: &Plan, eval: &Evaluation, status: Option<&[u8]>, body: &[u8]) {
    let Some(l) = eval.global.first().and_then(|g| lease::locate(plan, g)) else {
        panic!("the first global rule leases");
    };
    const WANT: u64 = 3;
    match callout::parse_lease_answer(plan, &l, WANT, status, body) {
        Err(AnswerError::NoAnswer) => assert!(status.is_none()),
        Err(AnswerError::Status(_)) => assert_ne!(status, Some(&b"200"[..])),
        Err(_) => {}
        Ok(a) => {
            assert!(a.granted <= WANT, "{a:?}");
            let limits = plan.limits(l.bucket.rule, l.bucket.variant);
            assert_eq!(a.limits.len(), limits.len(), "{a:?}");
            assert_eq!(a.retry_after_ms.len(), limits.len(), "{a:?}");
            for ((remaining, reset_ms), (limit, _)) in a.limits.iter().zip(limits) {
                assert!(*remaining <= limit.capacity, "{a:?}");
                assert!(*reset_ms <= 2 * (limit.period_ns / MS), "{a:?}");
            }
        }
    }
}

const MS: u64 = 1_000_000;

fn check(plan: &Plan, eval: &Evaluation, answer: &Answer) {
    let _ = plan;
    for r in &answer.reports {
        // Every figure within the limit the gateway said it enforced.
        let e = r
            .enforced
            .expect("a gateway report carries the enforced limit");
        assert!(e.requests >= 1 && e.window_ms >= 1, "{r:?}");
        let window_ns = e.window_ms * MS;
        assert!(r.check.remaining <= e.requests, "{r:?}");
        assert!(r.check.reset_ns <= 2 * window_ns, "{r:?}");
        assert!(r.check.retry_after_ns <= 2 * window_ns, "{r:?}");
        if r.check.allowed {
            assert_eq!(r.check.retry_after_ns, 0, "{r:?}");
        } else {
            assert!(
                r.check.retry_after_ns > 0,
                "a denial must say when to retry: {r:?}"
            );
        }
    }
    assert_eq!(answer.quotas.len(), eval.quotas.len(), "{answer:?}");
    for (q, asked) in answer.quotas.iter().zip(&eval.quotas) {
        assert_eq!(q.quota, asked.quota);
        assert!(q.reset_ms <= 31 * 86_400_000, "{q:?}");
    }
}
