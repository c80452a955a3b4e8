//! Unit tests of the decisions, phase by phase.

use super::*;
use crate::config;
use crate::limits::store::{MemoryStore, StoreError};

const SEC: u64 = 1_000_000_000;
/// A random value that leaves every wait unjittered.
const NEUTRAL: u64 = 0;
const T0: u64 = 1_700_000_000 * SEC;

fn plan(json: &str) -> Plan {
    Plan::compile(&config::parse(json.as_bytes()).unwrap(), [3; 16])
}

fn req(plan: &Plan, path: &str, client: Option<&str>) -> RequestInfo {
    let mut named = vec![(":method", &b"GET"[..]), (":path", path.as_bytes())];
    named.extend(client.map(|c| ("x-client-id", c.as_bytes())));
    RequestInfo::with_headers(&plan.header_names, &named).with_source(b"10.0.0.1:4000")
}

/// Header lines as a passing response's or a rejection's.
trait Lines {
    fn value(&self, name: &str) -> Option<String>;
}

impl Lines for HeaderLines {
    fn value(&self, name: &str) -> Option<String> {
        self.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    }
}

impl Lines for LocalHeaders {
    fn value(&self, name: &str) -> Option<String> {
        self.get(name)
    }
}

fn header(lines: &impl Lines, name: &str) -> String {
    lines.value(name).unwrap_or_else(|| "<absent>".into())
}

fn rejected(o: &Outcome) -> (&u32, &LocalHeaders, &String) {
    match &o.verdict {
        Verdict::Reject {
            status,
            headers,
            body,
        } => (status, headers, body),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// The lines of a passing response, as the host sends them.
fn passed(p: &Plan, o: &Outcome) -> HeaderLines {
    match &o.verdict {
        Verdict::Pass(h) => h.lines(p),
        other => panic!("expected a pass, got {other:?}"),
    }
}

fn done(step: Step) -> Outcome {
    match step {
        Step::Done(o) => o,
        Step::Call(p) => panic!("unexpected callout {p:?}"),
    }
}

fn call(step: Step) -> Pending {
    match step {
        Step::Call(p) => *p,
        Step::Done(o) => panic!("expected a callout, got {o:?}"),
    }
}

const FIVE: &str = r#"{"domain":"d","rules":[{"name":"per-client","key":["client"],"limits":[{"requests":5,"per":"1h"}]}],
    "costs":[{"match":{"path_prefix":"/search"},"cost":2}]}"#;

#[test]
fn counts_down_then_rejects_with_a_problem() {
    let p = plan(FIVE);
    let s = MemoryStore::default();
    for left in (0..5).rev() {
        let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let h = &passed(&p, &o);
        assert_eq!(header(h, "x-ratelimit-remaining"), left.to_string());
        assert_eq!(header(h, "ratelimit-policy"), "\"per-client\";q=5;w=3600");
        assert_eq!(o.counts.get(Metric::Allowed), 1);
    }
    let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let (status, headers, body) = rejected(&o);
    assert_eq!(*status, 429);
    assert_eq!(header(headers, "retry-after"), "720");
    assert_eq!(header(headers, "content-type"), "application/problem+json");
    assert_eq!(header(headers, "x-ratelimit-remaining"), "0");
    assert_eq!(header(headers, "ratelimit"), "\"per-client\";r=0;t=3600");
    assert!(
        body.contains("\"detail\":\"Rate limit exceeded. Retry after 720 seconds.\""),
        "{body}"
    );
    assert!(body.contains("\"violated-policies\":[\"per-client\"]"));
    assert_eq!(o.counts.get(Metric::Denied), 1);
    // Another client is untouched; the IP stands in for a client without an id.
    assert!(matches!(
        done(start(&p, &req(&p, "/", Some("b")), &s, T0, NEUTRAL)).verdict,
        Verdict::Pass(_)
    ));
    assert!(matches!(
        done(start(&p, &req(&p, "/", None), &s, T0, NEUTRAL)).verdict,
        Verdict::Pass(_)
    ));
}

#[test]
fn cost_is_weighted() {
    let p = plan(FIVE);
    let s = MemoryStore::default();
    let o = done(start(&p, &req(&p, "/search", Some("a")), &s, T0, NEUTRAL));
    let Verdict::Pass(h) = &o.verdict else {
        panic!()
    };
    assert_eq!(header(&h.lines(&p), "x-ratelimit-remaining"), "3");
}

#[test]
fn unmatched_requests_pass_without_headers_or_counts() {
    let p = plan(
        r#"{"domain":"d","rules":[{"name":"u","match":{"path_prefix":"/upload"},"limits":[{"requests":1,"per":1}]}]}"#,
    );
    let o = done(start(
        &p,
        &req(&p, "/other", None),
        &MemoryStore::default(),
        T0,
        NEUTRAL,
    ));
    assert_eq!(o.verdict, Verdict::Pass(Passing::default()));
    assert_eq!(o.counts, Counts::default());
}

struct Broken;
impl SharedStore for Broken {
    fn get(&self, _: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        Err(StoreError(10))
    }
    fn compare_and_set(&self, _: &str, _: &[u8], _: u32) -> Result<bool, StoreError> {
        Err(StoreError(10))
    }
}

#[test]
fn store_failure_takes_on_error() {
    let allow = plan(FIVE);
    let o = done(start(
        &allow,
        &req(&allow, "/", Some("a")),
        &Broken,
        T0,
        NEUTRAL,
    ));
    assert_eq!(o.verdict, Verdict::Pass(Passing::default()));
    assert_eq!(o.counts.get(Metric::Errors), 1);
    assert_eq!(o.error, Some(LimitError::Store(StoreError(10))));
    let deny = plan(&FIVE.replace("\"domain\"", "\"on_error\":\"deny\",\"domain\""));
    let o = done(start(
        &deny,
        &req(&deny, "/", Some("a")),
        &Broken,
        T0,
        NEUTRAL,
    ));
    let Verdict::Reject {
        status, headers, ..
    } = o.verdict
    else {
        panic!()
    };
    assert_eq!(status, 429);
    assert_eq!(header(&headers, "retry-after"), "1");
}

fn global_plan(mode: &str) -> Plan {
    plan(&format!(
        r#"{{"domain":"d","global":{{"cluster":"gw","failure_mode":"{mode}","instances":2,
             "circuit":{{"failures":2,"cooldown_ms":3000}}}},
           "rules":[{{"name":"local","key":["client"],"limits":[{{"requests":5,"per":"1h"}}]}},
                    {{"name":"shared","scope":"global","key":["client"],"limits":[{{"requests":4,"per":"1m"}}]}}]}}"#
    ))
}

fn gw(allowed: bool, remaining: u64) -> Vec<u8> {
    serde_json::json!({"version":2,"allowed":allowed,"buckets":[{"limits":[
        {"requests":4,"window_ms":60000,"algorithm":"token_bucket",
         "allowed":allowed,"remaining":remaining,"reset_ms":15000,"retry_after_ms": if allowed {0} else {15000}}]}]})
    .to_string()
    .into_bytes()
}

/// The local bucket of client "a", seen through a plan without the global rule.
fn local_remaining(s: &MemoryStore) -> String {
    let local = plan(
        r#"{"domain":"d","rules":[{"name":"local","key":["client"],"limits":[{"requests":5,"per":"1h"}]}]}"#,
    );
    let o = done(start(&local, &req(&local, "/", Some("a")), s, T0, NEUTRAL));
    let Verdict::Pass(h) = o.verdict else {
        panic!()
    };
    header(&h.lines(&local), "x-ratelimit-remaining").to_string()
}

#[test]
fn global_answer_decides_and_the_tightest_limit_is_shown() {
    let p = global_plan("local");
    let s = MemoryStore::default();
    let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let body: serde_json::Value = serde_json::from_slice(&pending.body).unwrap();
    assert_eq!(body["buckets"][0]["key"], "shared/c=a");
    let o = finish(&p, pending, Some(b"200"), &gw(true, 1), SEC / 1000, &s, T0);
    let h = &passed(&p, &o);
    // Every limit in the IETF fields, local then global; the legacy ones the tightest.
    assert_eq!(
        header(h, "ratelimit-policy"),
        "\"local\";q=5;w=3600, \"shared\";q=4;w=60"
    );
    assert_eq!(
        header(h, "ratelimit"),
        "\"local\";r=4;t=720, \"shared\";r=1;t=15"
    );
    assert_eq!(header(h, "x-ratelimit-limit"), "4");
    assert_eq!(header(h, "x-ratelimit-remaining"), "1");
    assert_eq!(o.counts.get(Metric::GlobalCalls), 1);
}

#[test]
fn global_denial_refunds_the_local_charge() {
    let p = global_plan("local");
    let s = MemoryStore::default();
    let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let o = finish(&p, pending, Some(b"200"), &gw(false, 0), SEC / 1000, &s, T0);
    let (status, headers, body) = rejected(&o);
    assert_eq!(*status, 429);
    assert_eq!(header(headers, "retry-after"), "15");
    assert!(body.contains("[\"shared\"]"), "{body}");
    // The local limit, refunded, shows what is left now: all 5.
    assert_eq!(
        header(headers, "ratelimit"),
        "\"local\";r=5;t=0, \"shared\";r=0;t=15"
    );
    // The local bucket was charged and refunded: the next local request sees 4 left of 5.
    assert_eq!(local_remaining(&s), "4");
}

#[test]
fn a_request_abandoned_while_waiting_gives_its_local_charge_back() {
    let p = global_plan("local");
    let s = MemoryStore::default();
    for _ in 0..3 {
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        assert_eq!(abandon(&p, pending, &s), Counts::default());
    }
    assert_eq!(local_remaining(&s), "4");
}

#[test]
fn a_local_denial_skips_the_callout() {
    let p = global_plan("local");
    let s = MemoryStore::default();
    for _ in 0..5 {
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        finish(&p, pending, Some(b"200"), &gw(true, 3), SEC / 1000, &s, T0);
    }
    let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let (status, headers, _) = rejected(&o);
    assert_eq!(*status, 429);
    assert_eq!(o.counts.get(Metric::GlobalCalls), 0);
    // The gateway was not asked: only the local limit is listed.
    assert_eq!(header(headers, "ratelimit-policy"), "\"local\";q=5;w=3600");
    assert_eq!(header(headers, "ratelimit"), "\"local\";r=0;t=3600");
    // The access log: the proxy's own refusal.
    assert_eq!(
        logged(&p, &o),
        "outcome=denied rule=local remaining=0 cost=1 source=local"
    );
}

#[test]
fn failure_mode_open_allows_and_counts() {
    let p = global_plan("open");
    let s = MemoryStore::default();
    let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let o = finish(
        &p,
        pending,
        Some(b"200"),
        b"<html>garbage",
        SEC / 1000,
        &s,
        T0,
    );
    let h = &passed(&p, &o);
    assert_eq!(header(h, "ratelimit-policy"), "\"local\";q=5;w=3600");
    assert_eq!(o.counts.get(Metric::FailOpen), 1);
    assert_eq!(o.counts.get(Metric::GlobalFailures), 1);
    assert!(matches!(o.gateway_error, Some(AnswerError::Garbled(_))));
}

#[test]
fn failure_mode_closed_answers_503_and_refunds() {
    let p = global_plan("closed");
    let s = MemoryStore::default();
    let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let o = finish(&p, pending, None, b"", 50 * SEC / 1000, &s, T0);
    let (status, headers, body) = rejected(&o);
    assert_eq!(*status, 503);
    assert_eq!(header(headers, "retry-after"), "3");
    assert!(body.contains("Service Unavailable"));
    assert_eq!(local_remaining(&s), "4");
}

#[test]
fn failure_mode_local_uses_a_share_of_the_limit_then_the_circuit_opens_and_recovers() {
    let p = global_plan("local");
    let s = MemoryStore::default();
    // Two failures: each decided locally at 4 / 2 instances = 2; the second opens the circuit.
    for expected_left in ["1", "0"] {
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let o = finish(&p, pending, Some(b"503"), b"", SEC / 1000, &s, T0);
        let h = &passed(&p, &o);
        assert_eq!(header(h, "x-ratelimit-remaining"), expected_left);
        assert_eq!(
            header(h, "ratelimit-policy"),
            "\"local\";q=5;w=3600, \"shared\";q=2;w=60"
        );
    }
    // Circuit open: no callout; the local share is spent, so 429 from the stand-in.
    let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0 + SEC, NEUTRAL));
    let Verdict::Reject { status, body, .. } = &o.verdict else {
        panic!("{o:?}")
    };
    assert_eq!(*status, 429);
    assert!(body.contains("[\"shared\"]"));
    assert_eq!(o.counts.get(Metric::CircuitOpenSkips), 1);
    // After the cooldown one probe goes out; its success closes the circuit.
    let probe = call(start(
        &p,
        &req(&p, "/", Some("b")),
        &s,
        T0 + 3 * SEC,
        NEUTRAL,
    ));
    assert!(probe.probe);
    let o = finish(
        &p,
        probe,
        Some(b"200"),
        &gw(true, 3),
        SEC / 1000,
        &s,
        T0 + 3 * SEC,
    );
    assert_eq!(o.circuit, Transition::Closed);
    let next = call(start(
        &p,
        &req(&p, "/", Some("b")),
        &s,
        T0 + 3 * SEC,
        NEUTRAL,
    ));
    assert!(!next.probe);
}

const GRADUATED: &str = r#"{"domain":"d","response":{"retry_jitter":0},"rules":[{"name":"api","key":["client"],
    "limits":[{"requests":10,"per":"1m"}],
    "graduated":{"warn_at":0.8,"delay_at":1.0,"delay_ms":100,"reject_at":1.2,"block_at":2.0,"block_for":"5m"}}]}"#;

#[test]
fn graduated_warns_delays_rejects_then_blocks() {
    let p = plan(GRADUATED);
    let s = MemoryStore::default();
    let mut seen = Vec::new();
    for _ in 0..21 {
        let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        seen.push(match &o.verdict {
            Verdict::Pass(h) => format!("pass {}", header(&h.lines(&p), "x-ratelimit-warning")),
            Verdict::Delay { ms, headers } => {
                format!(
                    "delay {ms} {}",
                    header(&headers.lines(&p), "x-ratelimit-warning")
                )
            }
            Verdict::Reject {
                status, headers, ..
            } => format!("{status} {}", header(headers, "retry-after")),
        });
    }
    let mut want: Vec<String> = (0..7).map(|_| "pass <absent>".to_string()).collect();
    want.extend(
        [
            "pass \"api\";used=80",
            "pass \"api\";used=90",
            "pass \"api\";used=100",
        ]
        .map(String::from),
    );
    want.extend(["delay 100 \"api\";used=110", "delay 100 \"api\";used=120"].map(String::from));
    // Rejected from the 13th; demand (denied included) reaches 200% at the 20th: blocked for 5 minutes.
    want.extend((13..20).map(|_| "429 6".to_string()));
    want.extend(["429 300", "429 300"].map(String::from));
    assert_eq!(seen, want);
    let o = done(start(
        &p,
        &req(&p, "/", Some("a")),
        &s,
        T0 + 299 * SEC,
        NEUTRAL,
    ));
    assert!(matches!(o.verdict, Verdict::Reject { status: 429, .. }));
    assert_eq!(o.counts.get(Metric::Blocked), 1);
    // The block is over and the bucket refilled meanwhile.
    let o = done(start(
        &p,
        &req(&p, "/", Some("a")),
        &s,
        T0 + 300 * SEC,
        NEUTRAL,
    ));
    assert!(matches!(o.verdict, Verdict::Pass(_)), "{o:?}");
}

#[test]
fn block_release_and_retry_after_are_jittered_within_bounds() {
    let p = plan(&GRADUATED.replace("\"retry_jitter\":0", "\"retry_jitter\":0.1"));
    let mut blocks = Vec::new();
    for (i, random) in [0u64, u64::MAX, 1 << 63 | 1 << 31].into_iter().enumerate() {
        let s = MemoryStore::default();
        let client = format!("c{i}");
        for _ in 0..19 {
            start(&p, &req(&p, "/", Some(&client)), &s, T0, random);
        }
        let o = done(start(&p, &req(&p, "/", Some(&client)), &s, T0, random));
        let Verdict::Reject { headers, .. } = &o.verdict else {
            panic!("{o:?}")
        };
        blocks.push(header(headers, "retry-after").parse::<u64>().unwrap());
    }
    // The block's end is spread within +10% (300..330 s); its Retry-After is that rest, not spread again.
    for b in &blocks {
        assert!((300..=330).contains(b), "{blocks:?}");
    }
    assert_eq!(blocks[0], 300, "no spread at the low end");
    assert_ne!(blocks[0], blocks[1]);
}

#[test]
fn shadow_rules_and_soft_clients_never_reject_but_count() {
    let p = plan(
        r#"{"domain":"d","identity":{"clients":{"trial":{"soft":true}}},"rules":[
            {"name":"watch","mode":"shadow","key":["client"],"limits":[{"requests":1,"per":"1h"}]},
            {"name":"api","key":["client"],"limits":[{"requests":2,"per":"1h"}]}]}"#,
    );
    let s = MemoryStore::default();
    let first = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    assert!(first.shadow_denied(&p).is_empty());
    let second = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let h = &passed(&p, &second);
    assert_eq!(second.shadow_denied(&p), ["watch"]);
    assert_eq!(second.counts.get(Metric::ShadowDenied), 1);
    assert_eq!(header(h, "x-ratelimit-remaining"), "0");
    assert!(matches!(
        done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL)).verdict,
        Verdict::Reject { .. }
    ));
    for _ in 0..5 {
        let o = done(start(&p, &req(&p, "/", Some("trial")), &s, T0, NEUTRAL));
        assert!(matches!(o.verdict, Verdict::Pass(_)));
    }
}

#[test]
fn unlimited_clients_pass_untouched() {
    let p = plan(
        r#"{"domain":"d","tiers":{"free":{},"staff":{"unlimited":true}},
            "identity":{"default_tier":"free","clients":{"ops":{"tier":"staff"}}},
            "rules":[{"name":"api","key":["client"],"limits":[{"requests":1,"per":"1h"}]}]}"#,
    );
    let s = MemoryStore::default();
    for _ in 0..3 {
        let o = done(start(&p, &req(&p, "/", Some("ops")), &s, T0, NEUTRAL));
        assert_eq!(o.verdict, Verdict::Pass(Passing::default()));
        assert_eq!(o.counts.get(Metric::Unlimited), 1);
        // Nothing for the access log either.
        assert_eq!(logged(&p, &o), "-");
    }
}

const QUOTA: &str = r#"{"domain":"d","global":{"cluster":"gw"},"tiers":{"free":{}},"identity":{"default_tier":"free"},
    "rules":[{"name":"burst","key":["client"],"limits":[{"requests":5,"per":"1h"}]}],
    "quotas":[{"name":"monthly","key":["client"],"period":"month","tiers":{"free":3},"upgrade_url":"https://e.com/up"}]}"#;

fn quota_answer(quota_ok: bool) -> Vec<u8> {
    serde_json::json!({"version":2,"allowed":quota_ok,"buckets":[],
        "quotas":[{"limit":3,"period":"month","allowed":quota_ok,"remaining":0,"reset_ms":86_400_000}]})
    .to_string()
    .into_bytes()
}

#[test]
fn a_spent_quota_is_a_403_with_the_upgrade_link_and_no_retry_after() {
    let p = plan(QUOTA);
    let s = MemoryStore::default();
    let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let body: serde_json::Value = serde_json::from_slice(&pending.body).unwrap();
    assert_eq!(
        body["quotas"],
        // The quota and the tier by name: the gateway's policy has the amount.
        serde_json::json!([{"quota":"monthly","key":"monthly/c=a","tag":"c=a","variant":"tier:free","amount":1}])
    );
    let o = finish(
        &p,
        pending,
        Some(b"200"),
        &quota_answer(false),
        SEC / 1000,
        &s,
        T0,
    );
    let (status, headers, body) = rejected(&o);
    assert_eq!(*status, 403);
    assert_eq!(header(headers, "retry-after"), "<absent>");
    assert_eq!(
        header(headers, "link"),
        "<https://e.com/up>; rel=\"payment\""
    );
    assert!(
        body.contains("\"upgrade_url\":\"https://e.com/up\""),
        "{body}"
    );
    assert!(body.contains("tag:ratelimit-wasm,2026:quota-exhausted"));
    assert_eq!(o.counts.get(Metric::QuotaExhausted), 1);
    assert_eq!(
        logged(&p, &o),
        "outcome=quota_exhausted rule=monthly remaining=0 cost=1 source=gateway"
    );
    // A 403 is an answer the filter made itself: ratelimit_wasm_requests_denied.
    assert_eq!(o.counts.get(Metric::Denied), 1);
    // The local charge was refunded: 5 local requests still pass the burst rule.
    for _ in 0..5 {
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let o = finish(
            &p,
            pending,
            Some(b"200"),
            &quota_answer(true),
            SEC / 1000,
            &s,
            T0,
        );
        assert!(matches!(o.verdict, Verdict::Pass(_)), "{o:?}");
    }
    // Out of rate limit: 429, before the gateway is asked.
    let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    assert!(matches!(o.verdict, Verdict::Reject { status: 429, .. }));
}

#[test]
fn a_refused_request_takes_the_failure_mode_but_does_not_open_the_circuit() {
    let p = global_plan("open");
    let s = MemoryStore::default();
    for _ in 0..3 {
        let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
        let o = finish(&p, pending, Some(b"400"), b"{}", SEC / 1000, &s, T0);
        assert!(matches!(o.verdict, Verdict::Pass(_)));
        assert_eq!(o.counts.get(Metric::FailOpen), 1);
        assert_eq!(o.circuit, Transition::None);
    }
    // Still calling: two failures of any other kind would have opened it.
    call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
}

fn lease_answer_body(granted: u64, retry_after_ms: u64) -> Vec<u8> {
    serde_json::json!({"version": 2, "granted": granted,
        "limits": [{"requests": 100, "window_ms": 60_000,
                    "remaining": 50, "reset_ms": 1000, "retry_after_ms": retry_after_ms}]})
    .to_string()
    .into_bytes()
}

#[test]
fn a_lease_serves_locally_gives_back_on_a_local_denial_and_an_empty_pool_refuses_here() {
    let p = plan(
        r#"{"domain":"d","global":{"cluster":"gw","failure_mode":"closed","lease":{"fraction":0.04}},
           "rules":[{"name":"local","key":["client"],"limits":[{"requests":3,"per":"1h"}]},
                    {"name":"shared","scope":"global","key":["client"],"limits":[{"requests":100,"per":"1m"}]}]}"#,
    );
    let s = MemoryStore::default();
    let r = req(&p, "/", Some("ann"));
    // The first request fetches a batch of 4 and spends 1.
    let pending = call(start(&p, &r, &s, T0, NEUTRAL));
    assert_eq!(pending.route(&p), Some((Method::Lease, 20)));
    let body: serde_json::Value = serde_json::from_slice(&pending.body).unwrap();
    assert_eq!(
        (body["want"].as_u64(), body["return"].as_u64()),
        (Some(4), Some(0))
    );
    let o = finish(
        &p,
        pending,
        Some(b"200"),
        &lease_answer_body(4, 0),
        0,
        &s,
        T0,
    );
    assert!(matches!(o.verdict, Verdict::Pass(_)), "{o:?}");
    // The access log: the gateway answered (the local rule is the closest).
    let mut lines = vec![logged(&p, &o)];
    // Two more from the batch, no callout; the local rule (3/h) then denies and the
    // lease token it took goes back.
    for _ in 0..2 {
        let o = done(start(&p, &r, &s, T0, NEUTRAL));
        assert!(matches!(o.verdict, Verdict::Pass(_)), "{o:?}");
        assert_eq!(o.counts.get(Metric::LeaseServed), 1);
        lines.push(logged(&p, &o));
    }
    let o = done(start(&p, &r, &s, T0, NEUTRAL));
    assert_eq!(rejected(&o).0, &429);
    lines.push(logged(&p, &o));
    assert_eq!(
        lines,
        [
            "outcome=allowed rule=local remaining=2 cost=1 source=gateway",
            "outcome=allowed rule=local remaining=1 cost=1 source=lease",
            "outcome=allowed rule=local remaining=0 cost=1 source=lease",
            "outcome=denied rule=local remaining=0 cost=1 source=local",
        ]
    );
    let other = req(&p, "/", Some("bob"));
    let pending = call(start(&p, &other, &s, T0, NEUTRAL));
    // Bob's pool is empty for 7 s: refused here, with that wait, without a callout.
    let o = finish(
        &p,
        pending,
        Some(b"200"),
        &lease_answer_body(0, 7000),
        0,
        &s,
        T0,
    );
    assert_eq!(header(rejected(&o).1, "retry-after"), "7");
    let o = done(start(&p, &other, &s, T0 + SEC, NEUTRAL));
    assert_eq!(header(rejected(&o).1, "retry-after"), "6");
    assert_eq!(o.counts.get(Metric::GlobalCalls), 0);
    assert_eq!(
        logged(&p, &o),
        "outcome=denied rule=shared remaining=0 cost=1 source=lease"
    );
    // Ann's slot still holds the token given back: 1 left.
    let l = crate::global::lease::locate(&p, &p.evaluate(&r).global[0]).unwrap();
    let (bytes, _) = s.get(&l.slot_key).unwrap().unwrap();
    assert_eq!(
        crate::global::lease::Slot::decode(&bytes).unwrap().tokens,
        1
    );
}

#[test]
fn a_refresh_that_cannot_read_shared_data_counts_an_error() {
    let p = plan(
        r#"{"domain":"d","global":{"cluster":"gw","lease":{"fraction":0.04}},
           "rules":[{"name":"shared","scope":"global","key":["client"],"limits":[{"requests":100,"per":"1m"}]}]}"#,
    );
    let r = req(&p, "/", Some("ann"));
    let l = crate::global::lease::locate(&p, &p.evaluate(&r).global[0]).unwrap();
    let (started, counts) = refresh_start(&p, &Broken, &l, T0);
    assert_eq!(started, None);
    assert_eq!(counts.get(Metric::Errors), 1);
    // A slot with nothing to refresh is no error.
    let (started, counts) = refresh_start(&p, &MemoryStore::default(), &l, T0);
    assert_eq!(started, None);
    assert_eq!(counts, Counts::default());
}

#[test]
fn a_cost_above_a_limits_capacity_says_it_can_never_pass_without_a_retry_after() {
    // The rule's own limits hold /export's cost of 8; the free tier's 5 do not.
    let p = plan(
        r#"{"domain":"d","tiers":{"free":{},"gold":{}},"identity":{"default_tier":"free","tier_header":"x-tier"},
            "rules":[{"name":"api","key":["client"],"limits":[{"requests":10,"per":"1m"}],
                      "tiers":{"free":[{"requests":5,"per":"1m"}]}}],
            "costs":[{"match":{"path_prefix":"/export"},"cost":8}]}"#,
    );
    let s = MemoryStore::default();
    let o = done(start(&p, &req(&p, "/export", Some("a")), &s, T0, NEUTRAL));
    let (status, headers, body) = rejected(&o);
    assert_eq!(*status, 429);
    assert_eq!(header(headers, "retry-after"), "<absent>");
    assert_eq!(
        body,
        "{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
         \"title\":\"Too Many Requests\",\"status\":429,\
         \"detail\":\"This request costs 8, more than a limit of api holds (5): it can never pass.\",\
         \"violated-policies\":[\"api\"]}"
    );
    assert_eq!(o.counts.get(Metric::Denied), 1);
    // A request the bucket can hold but not now keeps its Retry-After.
    for _ in 0..5 {
        assert!(matches!(
            done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL)).verdict,
            Verdict::Pass(_)
        ));
    }
    let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    assert_eq!(header(rejected(&o).1, "retry-after"), "12");
}

/// Shared data whose compare-and-set fails on one key.
struct FailsOn<'a> {
    inner: &'a MemoryStore,
    key: String,
}

impl SharedStore for FailsOn<'_> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.inner.get(key)
    }
    fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError> {
        if key == self.key {
            return Err(StoreError(10));
        }
        self.inner.compare_and_set(key, value, cas)
    }
}

#[test]
fn a_failed_lease_claim_after_the_local_charge_still_refunds_it_on_a_denial() {
    let p = plan(
        r#"{"domain":"d","global":{"cluster":"gw","failure_mode":"closed","lease":{"fraction":0.04}},
           "rules":[{"name":"local","key":["client"],"limits":[{"requests":5,"per":"1h"}]},
                    {"name":"shared","scope":"global","key":["client"],"limits":[{"requests":4,"per":"1m"}]}]}"#,
    );
    let s = MemoryStore::default();
    let r = req(&p, "/", Some("a"));
    let l = crate::global::lease::locate(&p, &p.evaluate(&r).global[0]).unwrap();
    let failing = FailsOn {
        inner: &s,
        key: l.slot_key.clone(),
    };
    // The lease slot cannot be claimed: the request asks the gateway itself.
    let pending = call(start(&p, &r, &failing, T0, NEUTRAL));
    assert_eq!(pending.lease(), None);
    assert_eq!(pending.counts.get(Metric::Errors), 1);
    let o = finish(&p, pending, Some(b"200"), &gw(false, 0), SEC / 1000, &s, T0);
    assert_eq!(rejected(&o).0, &429);
    // Denied: the local charge went back, 4 of 5 left after the next request.
    assert_eq!(local_remaining(&s), "4");
}

#[test]
fn a_stream_keeps_its_response_headers_and_charge_until_it_ends() {
    let p = plan(FIVE);
    let s = MemoryStore::default();
    let mut stream = Stream::default();
    let next = stream.request_headers(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL);
    assert_eq!(next, Next::Decided);
    let o = stream.outcome().expect("decided");
    assert_eq!(o.counts.get(Metric::Allowed), 1);
    let h = stream.response_headers().expect("admitted").lines(&p);
    assert_eq!(header(&h, "x-ratelimit-remaining"), "4");
    assert_eq!(stream.held().map(|h| h.buckets.len()), Some(1));
    assert_eq!(stream.callout(&p), None);
    // An answer it does not wait for changes nothing.
    assert!(!stream.gateway_answer(&p, own(&gw(true, 3)), 0, &s, T0));
    let h = stream.response_headers().expect("still admitted").lines(&p);
    assert_eq!(header(&h, "x-ratelimit-remaining"), "4");
    // The end of an admitted stream gives nothing back: it reached the upstream.
    assert_eq!(stream.end(&p, &s, 0), None);
    let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    assert_eq!(header(&passed(&p, &o), "x-ratelimit-remaining"), "3");
}

#[test]
fn a_stream_answered_here_adds_no_response_headers() {
    let p = plan(FIVE);
    let s = MemoryStore::default();
    for _ in 0..5 {
        done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    }
    let mut stream = Stream::default();
    let next = stream.request_headers(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL);
    assert_eq!(next, Next::Decided);
    assert_eq!(rejected(stream.outcome().expect("decided")).0, &429);
    assert!(stream.response_headers().is_none());
    assert!(stream.held().is_none());
    // The answer is taken once, to be sent.
    let answer = stream.take_answer().expect("a local answer");
    assert_eq!(answer.status, 429);
    assert!(answer.body.contains("\"status\":429"), "{}", answer.body);
    assert!(stream.take_answer().is_none());
    assert!(stream.response_headers().is_none());
}

#[test]
fn a_stream_waiting_for_the_gateway_gives_its_charge_back_when_it_ends() {
    let p = global_plan("local");
    let s = MemoryStore::default();
    let mut stream = Stream::default();
    assert_eq!(
        stream.request_headers(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL),
        Next::Call
    );
    let (c, lease) = stream.callout(&p).expect("a callout");
    assert_eq!((c.method, c.timeout_ms, lease), (Method::Check, 50, None));
    assert!(stream.response_headers().is_none());
    assert_eq!(stream.end(&p, &s, 0), Some(Counts::default()));
    assert_eq!(local_remaining(&s), "4");
    // Ended: a late answer finds nothing waiting.
    assert!(!stream.gateway_answer(&p, own(&gw(true, 3)), 0, &s, T0));
}

#[test]
fn a_stream_the_gateway_admits_holds_its_local_charge_and_one_it_denies_holds_none() {
    let p = global_plan("local");
    let s = MemoryStore::default();
    let mut admitted = Stream::default();
    admitted.request_headers(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL);
    assert!(admitted.gateway_answer(&p, own(&gw(true, 3)), 0, &s, T0));
    let h = admitted.response_headers().expect("admitted").lines(&p);
    assert_eq!(header(&h, "x-ratelimit-remaining"), "3");
    assert_eq!(
        admitted.held().map(|h| (h.buckets.len(), h.at_ns)),
        Some((1, T0))
    );
    let mut denied = Stream::default();
    denied.request_headers(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL);
    assert!(denied.gateway_answer(&p, own(&gw(false, 0)), 0, &s, T0));
    assert_eq!(rejected(denied.outcome().expect("decided")).0, &429);
    assert!(denied.held().is_none());
    // One charge held (the admitted one), the denied one refunded: 3 of 5 left
    // after the next request.
    assert_eq!(local_remaining(&s), "3");
}

/// Response headers for a settlement: `(name, value)` pairs.
struct Head(Vec<(&'static str, &'static str)>);

impl ResponseHeaders for Head {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.0
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_bytes().to_vec())
    }
}

#[test]
fn a_body_past_its_scan_limit_settles_at_once_and_asks_for_no_more() {
    let p = plan(
        r#"{"domain":"d","rules":[{"name":"t","key":["client"],
            "limits":[{"requests":1000,"per":"1h"}],
            "cost_from":{"preset":"openai_chat","max":500,"reserve":50,"scan_limit":1024}}]}"#,
    );
    let s = MemoryStore::default();
    let mut stream = Stream::default();
    let next = stream.request_headers(&p, &req(&p, "/", Some("ann")), &s, 0, 0);
    assert_eq!(next, Next::Decided);
    let head = Head(vec![
        (":status", "200"),
        ("content-type", "application/json"),
    ]);
    assert_eq!(stream.response_started(&p, &head, &s, 0), Counts::default());
    assert!(stream.wants_body());
    let counts = stream.response_body(&p, &[b' '; 1000], false, &s, 0);
    assert_eq!(counts, Counts::default());
    assert!(stream.wants_body());
    let counts = stream.response_body(&p, &[b' '; 100], false, &s, 0);
    assert_eq!(counts.get(Metric::UsageOverScanLimit), 1);
    assert!(
        !stream.wants_body(),
        "the rest of the body is not asked for"
    );
    // The end of the stream settles nothing more.
    assert_eq!(
        stream
            .end(&p, &s, 0)
            .map(|c| c.get(Metric::UsageOverScanLimit)),
        Some(0)
    );
}

#[test]
fn streams_spent_from_a_lease_settle_their_responses_against_its_slot() {
    let p = plan(
        r#"{"domain":"d","response":{"retry_jitter":0},
           "global":{"cluster":"gw","failure_mode":"closed","lease":{"fraction":0.05}},
           "rules":[{"name":"tokens","scope":"global","key":["client"],"limits":[{"requests":100,"per":"1m"}],
                     "cost_from":{"header":"x-u","max":40,"reserve":2},"charge_on":["2xx"]}]}"#,
    );
    let s = MemoryStore::default();
    let r = req(&p, "/", Some("ann"));
    let l = crate::global::lease::locate(&p, &p.evaluate(&r).global[0]).unwrap();
    let slot = || {
        let (bytes, _) = s.get(&l.slot_key).unwrap().unwrap();
        let slot = crate::global::lease::Slot::decode(&bytes).unwrap();
        (slot.tokens, slot.debt)
    };
    let respond = |stream: &mut Stream, status: &'static str, used: &'static str| {
        let head = Head(vec![(":status", status), ("x-u", used)]);
        let counts = stream.response_started(&p, &head, &s, T0);
        (counts, stream.take_lease_left())
    };
    // The request that fetches the batch of 5 spends its reservation of 2,
    // and its response of 1 gives 1 back.
    let mut fetched = Stream::default();
    assert_eq!(fetched.request_headers(&p, &r, &s, T0, NEUTRAL), Next::Call);
    assert!(fetched.gateway_answer(&p, own(&lease_answer_body(5, 0)), 0, &s, T0));
    assert_eq!(slot(), (3, 0));
    let (counts, left) = respond(&mut fetched, "200", "1");
    assert_eq!(counts.get(Metric::UsageSettled), 1);
    assert_eq!(left, crate::global::lease::Settled::default());
    assert_eq!(slot(), (4, 0));
    // One served from the batch and answered 503 gives its 2 back (charge_on).
    let mut refunded = Stream::default();
    assert_eq!(
        refunded.request_headers(&p, &r, &s, T0, NEUTRAL),
        Next::Decided
    );
    assert_eq!(slot(), (2, 0));
    let (counts, _) = respond(&mut refunded, "503", "9");
    assert_eq!(counts.get(Metric::ChargeRefunded), 1);
    assert_eq!(counts.get(Metric::UsageSettled), 0);
    assert_eq!(slot(), (4, 0));
    // One that cost 9: the 2 left after its reservation, then 5 owed.
    let mut over = Stream::default();
    over.request_headers(&p, &r, &s, T0, NEUTRAL);
    respond(&mut over, "200", "9");
    assert_eq!(slot(), (0, 5));
    assert_eq!(over.end(&p, &s, T0), Some(Counts::default()));
    // The next waits for 5 + 2 tokens at 600 ms each: 4.2 s, without a callout.
    let o = done(start(&p, &r, &s, T0, NEUTRAL));
    assert_eq!(header(rejected(&o).1, "retry-after"), "5");
    assert_eq!(o.counts.get(Metric::LeaseServed), 1);
    assert_eq!(o.counts.get(Metric::GlobalCalls), 0);
}

/// The access log's line for `o` (`-` when the filter sets none).
fn logged(p: &Plan, o: &Outcome) -> String {
    why::why(p, o).map_or_else(|| "-".to_string(), |w| w.line())
}

/// The lines of client "a"'s requests to `paths`, one after the other,
/// decided locally on a fresh store.
fn logged_run(p: &Plan, paths: &[&str]) -> Vec<String> {
    let s = MemoryStore::default();
    paths
        .iter()
        .map(|path| {
            logged(
                p,
                &done(start(p, &req(p, path, Some("a")), &s, T0, NEUTRAL)),
            )
        })
        .collect()
}

/// Local rules: the rule whose limit is closest is named with what it has
/// left after an admission and before a refusal; a shadow rule's refusal
/// and a graduated delay name their rule; nothing is said of a request no
/// rule applies to.
#[test]
fn the_access_log_names_the_deciding_local_rule() {
    let p = plan(FIVE);
    assert_eq!(
        logged_run(&p, &["/search", "/search", "/", "/search"]),
        [
            "outcome=allowed rule=per-client remaining=3 cost=2 source=local",
            "outcome=allowed rule=per-client remaining=1 cost=2 source=local",
            "outcome=allowed rule=per-client remaining=0 cost=1 source=local",
            "outcome=denied rule=per-client remaining=0 cost=2 source=local",
        ]
    );
    let p = plan(
        r#"{"domain":"d","rules":[{"name":"a","match":{"path_prefix":"/a"},"key":["client"],
            "limits":[{"requests":5,"per":"1h"}]}]}"#,
    );
    assert_eq!(logged_run(&p, &["/b"]), ["-"]);

    let p = plan(
        r#"{"domain":"d","rules":[
            {"name":"watch","mode":"shadow","key":["client"],"limits":[{"requests":1,"per":"1h"}]},
            {"name":"api","key":["client"],"limits":[{"requests":5,"per":"1h"}]}]}"#,
    );
    assert_eq!(
        logged_run(&p, &["/", "/"]),
        [
            "outcome=allowed rule=watch remaining=0 cost=1 source=local",
            "outcome=shadow_denied rule=watch remaining=0 cost=1 source=local",
        ]
    );

    let p = plan(GRADUATED);
    assert_eq!(
        logged_run(&p, &["/"; 13])[9..],
        [
            "outcome=allowed rule=api remaining=0 cost=1 source=local",
            "outcome=delayed rule=api remaining=0 cost=1 source=local",
            "outcome=delayed rule=api remaining=0 cost=1 source=local",
            "outcome=denied rule=api remaining=0 cost=1 source=local",
        ]
    );
}

/// Global rules: the gateway's answer, the deny cache, each failure mode
/// (a lease, a spent quota and a local refusal are in their own tests).
#[test]
fn the_access_log_says_what_answered_a_global_rule() {
    let p = global_plan("open");
    let s = MemoryStore::default();
    let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let o = finish(&p, pending, Some(b"200"), &gw(true, 2), SEC / 1000, &s, T0);
    assert_eq!(
        logged(&p, &o),
        "outcome=allowed rule=shared remaining=2 cost=1 source=gateway"
    );
    let pending = call(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    let o = finish(&p, pending, Some(b"200"), &gw(false, 0), SEC / 1000, &s, T0);
    assert_eq!(
        logged(&p, &o),
        "outcome=denied rule=shared remaining=0 cost=1 source=gateway"
    );
    // The gateway's denial is cached: the next request is refused here.
    let o = done(start(&p, &req(&p, "/", Some("a")), &s, T0, NEUTRAL));
    assert_eq!(o.counts.get(Metric::DenyCacheHits), 1, "{o:?}");
    assert_eq!(
        logged(&p, &o),
        "outcome=denied rule=shared remaining=0 cost=1 source=deny_cache"
    );

    for (mode, want) in [
        (
            "open",
            "outcome=allowed rule=local remaining=4 cost=1 source=failure_open",
        ),
        (
            "closed",
            "outcome=unavailable rule=- remaining=- cost=- source=failure_closed",
        ),
        (
            "local",
            "outcome=allowed rule=shared remaining=1 cost=1 source=failure_local",
        ),
    ] {
        let p = global_plan(mode);
        let s = MemoryStore::default();
        let pending = call(start(&p, &req(&p, "/", Some("b")), &s, T0, NEUTRAL));
        let o = finish(&p, pending, None, b"", SEC / 1000, &s, T0);
        assert_eq!(logged(&p, &o), want, "failure_mode {mode}");
    }
}

/// A 200 answer with `body`, to a call of the request's own.
fn own(body: &[u8]) -> Reply<'_> {
    Reply::Own {
        status: Some(b"200"),
        body,
    }
}
