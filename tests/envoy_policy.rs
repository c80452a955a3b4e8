//! End-to-end tests of the policy features behind real authentication: a real
//! Envoy 1.40 (`--concurrency 2`, the filter built by `make build`) whose
//! `jwt_authn` filter, from the one template `envoy/envoy.yaml`, verifies
//! RS256 tokens signed here with the demo key (`envoy/jwt/`) and writes their
//! claims into dynamic metadata, where the filter reads the client id (`sub`)
//! and the tier (`tier`). Quotas add the `ratelimit-gateway` binary (`cargo
//! build -p ratelimit-gateway`) and a real `redis-server`.
//!
//! * Tiers: free and pro tokens get exactly their own limits.
//! * Forged `x-client-id` / `x-tier` headers change nothing; a token that
//!   fails to verify is a 401 from `jwt_authn`, before the filter.
//! * Graduated response: warning, a measured delay, 429, a block and its end.
//! * A shadow rule never rejects; `ratelimit_wasm_shadow_denied` counts.
//! * Quotas: 403 with the upgrade link, 429 over the rate limit, kept across a
//!   gateway restart, and a fresh count at the next calendar minute.
//!
//! Every request goes on its own connection, so both workers take part. The
//! tests print what they measured (`cargo test --test envoy_policy --
//! --nocapture`). Nothing is skipped: without Envoy, the wasm file, the
//! gateway binary or `redis-server`, the tests fail and say what to build or
//! install.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use testkit::config::{demo_signing_key_path, DEMO_JWT_ISSUER, DEMO_JWT_KID};
use testkit::redis::Redis;
use testkit::{Client, ConnectionMode, Envoy, EnvoyOptions, Gateway, GatewayOptions, Response};

const PROBLEM_TYPE: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";
/// `response.quota_problem_type`'s default.
const QUOTA_PROBLEM_TYPE: &str = "tag:ratelimit-wasm,2026:quota-exhausted";
const UPGRADE: &str = "https://example.com/upgrade";

/// Where `jwt_authn` (`payload_in_metadata: payload`) puts the claims.
const JWT_METADATA: &str = "envoy.filters.http.jwt_authn";

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
}

// ---------------------------------------------------------------------------
// Tokens
// ---------------------------------------------------------------------------

/// An RS256 token signed with the demo key, valid for an hour.
fn signed(claims: &Value) -> String {
    let pem = std::fs::read(demo_signing_key_path())
        .unwrap_or_else(|e| panic!("reading {}: {e}", demo_signing_key_path().display()));
    let key = EncodingKey::from_rsa_pem(&pem).expect("the demo signing key");
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(DEMO_JWT_KID.to_string());
    jsonwebtoken::encode(&header, claims, &key).expect("signing a token")
}

fn claims(sub: &str, tier: &str) -> Value {
    let now = unix_now().as_secs();
    json!({ "iss": DEMO_JWT_ISSUER, "sub": sub, "tier": tier, "iat": now, "exp": now + 3600 })
}

/// A valid token for client `sub` of tier `tier`.
fn token(sub: &str, tier: &str) -> String {
    signed(&claims(sub, tier))
}

/// `token` with its payload replaced by `payload` and its signature kept: what
/// a client that edits its own claims sends.
fn with_payload(token: &str, payload: &Value) -> String {
    let parts: Vec<&str> = token.split('.').collect();
    assert_eq!(parts.len(), 3, "{token}");
    let forged = signed(payload);
    let forged_payload = forged.split('.').nth(1).expect("a payload");
    format!("{}.{forged_payload}.{}", parts[0], parts[2])
}

/// `token` with one character in the middle of its signature changed.
fn with_flipped_signature(token: &str) -> String {
    let (signed_part, sig) = token.rsplit_once('.').expect("a signature");
    let mut sig: Vec<char> = sig.chars().collect();
    let mid = sig.len() / 2;
    sig[mid] = if sig[mid] == 'A' { 'B' } else { 'A' };
    format!("{signed_part}.{}", sig.into_iter().collect::<String>())
}

// ---------------------------------------------------------------------------
// Configuration, requests and checks
// ---------------------------------------------------------------------------

/// A plugin configuration with the identity from the verified token: `sub`
/// is the client, `tier` the tier (free or pro, default free). The header
/// names are configured too, to show that they are not read.
fn policy_config(rules: Value, extra: Value) -> String {
    let mut config = json!({
        "domain": "policy-e2e",
        "tiers": { "free": {}, "pro": {} },
        "identity": {
            "client_id_metadata": [JWT_METADATA, "payload", "sub"],
            "tier_metadata": [JWT_METADATA, "payload", "tier"],
            "client_id_header": "x-client-id",
            "tier_header": "x-tier",
            "default_tier": "free"
        },
        "rules": rules,
        "response": { "headers": "both", "problem_type": PROBLEM_TYPE, "retry_jitter": 0 }
    });
    if let Value::Object(extra) = extra {
        for (k, v) in extra {
            config[k] = v;
        }
    }
    config.to_string()
}

/// free: 3 per hour; pro: 6 per hour.
fn tiered_rule() -> Value {
    json!([{
        "name": "per-client", "key": ["client"],
        "limits": [ { "requests": 3, "per": "1h" } ],
        "tiers": { "pro": [ { "requests": 6, "per": "1h" } ] }
    }])
}

fn start(config: &str) -> Envoy {
    ok(Envoy::start(EnvoyOptions::new(config)), "starting Envoy")
}

fn client(envoy: &Envoy) -> Client {
    envoy.client(ConnectionMode::NewPerRequest)
}

/// GET `path` with `Authorization: Bearer <token>` (when given) and `extra` headers.
fn get(c: &Client, path: &str, token: Option<&str>, extra: &[(&str, &str)]) -> Response {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let mut headers: Vec<(&str, &str)> = extra.to_vec();
    if let Some(b) = &bearer {
        headers.push(("authorization", b));
    }
    c.must_get(path, &headers)
}

/// GET `path` and how long it took.
fn timed(c: &Client, path: &str, token: &str) -> (Response, Duration) {
    let started = Instant::now();
    let r = get(c, path, Some(token), &[]);
    (r, started.elapsed())
}

/// ceil(1.1 × `secs`): the most the default `retry_jitter` (10%, upwards
/// only) makes of a wait of `secs` whole seconds.
fn jitter_bound(secs: u64) -> u64 {
    (secs * 11).div_ceil(10)
}

/// An allowed request showing `policy` with `limit` per `window` seconds and
/// `remaining` left in the legacy lines (the closest limit), the policy's
/// item among those `RateLimit-Policy` lists (one per limit checked).
fn assert_passes(r: &Response, policy: &str, limit: u64, window: u64, remaining: u64, what: &str) {
    assert_eq!(r.status, 200, "{what}: {r:#?}");
    assert_eq!(r.body, "ok\n", "{what}: the upstream's body");
    assert_eq!(r.int_header("x-ratelimit-limit"), limit, "{what}: {r:#?}");
    assert_eq!(
        r.int_header("x-ratelimit-remaining"),
        remaining,
        "{what}: {r:#?}"
    );
    let item = format!("\"{policy}\";q={limit};w={window}");
    let policies = r.expect_header("ratelimit-policy");
    assert!(
        policies.split(", ").any(|i| i == item),
        "{what}: {item} not in ratelimit-policy {policies:?}"
    );
}

/// A 429 from the filter naming `violated`; returns its `Retry-After`.
fn assert_429(r: &Response, violated: &[&str], what: &str) -> u64 {
    assert_eq!(r.status, 429, "{what}: {r:#?}");
    assert_eq!(r.expect_header("content-type"), "application/problem+json");
    let retry_after = r.int_header("retry-after");
    assert!(retry_after >= 1, "{what}: retry-after {retry_after}");
    let body = r.json();
    assert_eq!(body["type"], PROBLEM_TYPE, "{what}: {body}");
    assert_eq!(body["status"], 429, "{what}: {body}");
    assert_eq!(
        body["detail"],
        format!("Rate limit exceeded. Retry after {retry_after} seconds."),
        "{what}: {body}"
    );
    assert_eq!(body["violated-policies"], json!(violated), "{what}: {body}");
    assert_eq!(r.header("link"), None, "{what}: {r:#?}");
    retry_after
}

/// A 401 from `jwt_authn` with `body`: the filter never saw the request.
fn assert_401(r: &Response, body: &str, what: &str) {
    assert_eq!(r.status, 401, "{what}: {r:#?}");
    assert_eq!(r.body, body, "{what}: {r:#?}");
    for h in ["x-ratelimit-limit", "ratelimit", "ratelimit-policy"] {
        assert_eq!(r.header(h), None, "{what}: the filter must not run: {r:#?}");
    }
}

/// The value of `name` on Envoy's `/stats/prometheus` page (0 when absent).
fn metric(envoy: &Envoy, name: &str) -> u64 {
    ok(envoy.metric(name), "reading /stats/prometheus").unwrap_or(0.0) as u64
}

// ---------------------------------------------------------------------------
// 1. Tiers and identity from verified tokens
// ---------------------------------------------------------------------------

#[test]
fn free_and_pro_tokens_get_exactly_their_own_limits() {
    let envoy = start(&policy_config(tiered_rule(), json!({})));
    let c = client(&envoy);
    let alice = token("alice", "free");
    let bob = token("bob", "pro");

    for i in 0..3 {
        let r = get(&c, "/", Some(&alice), &[]);
        assert_passes(
            &r,
            "per-client",
            3,
            3600,
            2 - i,
            &format!("free #{}", i + 1),
        );
    }
    let denied = get(&c, "/", Some(&alice), &[]);
    // One of 3 per hour comes back in 1200 s (no jitter); a few ms have passed.
    let retry = assert_429(&denied, &["per-client"], "free #4");
    assert_eq!(retry, 1200, "{denied:#?}");
    assert_eq!(denied.int_header("x-ratelimit-limit"), 3);

    for i in 0..6 {
        let r = get(&c, "/", Some(&bob), &[]);
        assert_passes(&r, "per-client", 6, 3600, 5 - i, &format!("pro #{}", i + 1));
    }
    let denied = get(&c, "/", Some(&bob), &[]);
    let retry = assert_429(&denied, &["per-client"], "pro #7");
    assert_eq!(retry, 600, "{denied:#?}");
    assert_eq!(denied.int_header("x-ratelimit-limit"), 6);

    // Another free client has a bucket of its own.
    let r = get(&c, "/", Some(&token("carol", "free")), &[]);
    assert_passes(&r, "per-client", 3, 3600, 2, "another free client");
    // A claimed tier that is not declared is unknown: the default (free) applies.
    let odd = token("dan", "platinum");
    for i in 0..3 {
        let r = get(&c, "/", Some(&odd), &[]);
        assert_passes(&r, "per-client", 3, 3600, 2 - i, "an undeclared tier");
    }
    assert_429(
        &get(&c, "/", Some(&odd), &[]),
        &["per-client"],
        "undeclared #4",
    );

    assert_eq!(
        metric(&envoy, "ratelimit_wasm_requests_allowed"),
        3 + 6 + 1 + 3
    );
    assert_eq!(metric(&envoy, "ratelimit_wasm_requests_denied"), 3);
    println!(
        "tiers: free 3 x 200 then 429 (Retry-After 1200), pro 6 x 200 then 429 (Retry-After 600)"
    );
}

/// The shipped access log names the client by its verified token's
/// subject (`sub=`), next to the filter's decision: whom a rule denies.
#[test]
fn the_access_log_names_the_tokens_subject_with_the_decision() {
    let config = policy_config(tiered_rule(), json!({}));
    let envoy = ok(
        Envoy::start(EnvoyOptions::new(&config).access_log_file()),
        "starting Envoy",
    );
    let c = client(&envoy);
    let ann = token("ann", "free");
    for _ in 0..4 {
        get(&c, "/who", Some(&ann), &[]);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let tails = loop {
        let log = envoy.access_log();
        let tails: Vec<String> = log
            .lines()
            .filter_map(|l| l.split_once("\" ").map(|(_, t)| t.to_string()))
            .collect();
        if tails.len() >= 4 || Instant::now() > deadline {
            break tails;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let lines: Vec<String> = tails
        .iter()
        .map(|t| {
            // Past the status, flags and duration: the client and the decision.
            t.split_once(" peer=")
                .map(|(status, rest)| {
                    let status = status.split(' ').next().unwrap_or_default();
                    let rest = rest.split_once(' ').map_or("", |(_, r)| r);
                    format!("{status} {rest}")
                })
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(
        lines,
        [
            "200 sub=ann ratelimit: outcome=allowed rule=per-client remaining=2 cost=1 source=local",
            "200 sub=ann ratelimit: outcome=allowed rule=per-client remaining=1 cost=1 source=local",
            "200 sub=ann ratelimit: outcome=allowed rule=per-client remaining=0 cost=1 source=local",
            "429 sub=ann ratelimit: outcome=denied rule=per-client remaining=0 cost=1 source=local",
        ],
        "{}",
        envoy.access_log()
    );
}

#[test]
fn forged_headers_change_nothing_and_bad_tokens_are_refused() {
    let envoy = start(&policy_config(tiered_rule(), json!({})));
    let c = client(&envoy);

    // A free token with a forged tier and a different forged client id on each request:
    // still dave's free bucket.
    let dave = token("dave", "free");
    for i in 0..3u64 {
        let id = format!("someone-else-{i}");
        let r = get(
            &c,
            "/",
            Some(&dave),
            &[("x-tier", "pro"), ("x-client-id", &id)],
        );
        assert_passes(
            &r,
            "per-client",
            3,
            3600,
            2 - i,
            "free token, forged headers",
        );
    }
    let r = get(
        &c,
        "/",
        Some(&dave),
        &[("x-tier", "pro"), ("x-client-id", "fresh")],
    );
    assert_eq!(assert_429(&r, &["per-client"], "free token #4"), 1200);

    // No token, forged headers: keyed by the IP (127.0.0.1), free tier.
    for i in 0..3u64 {
        let id = format!("pretender-{i}");
        let r = get(&c, "/", None, &[("x-tier", "pro"), ("x-client-id", &id)]);
        assert_passes(&r, "per-client", 3, 3600, 2 - i, "no token, forged headers");
    }
    let r = get(
        &c,
        "/",
        None,
        &[("x-tier", "pro"), ("x-client-id", "pretender-3")],
    );
    assert_eq!(assert_429(&r, &["per-client"], "no token #4"), 1200);

    // Tokens that do not verify never reach the filter: 401 from jwt_authn.
    let erin = token("erin", "free");
    let now = unix_now().as_secs();
    let bad = [
        (
            "payload edited to tier pro",
            with_payload(&erin, &claims("erin", "pro")),
            "Jwt verification fails",
        ),
        (
            "signature changed",
            with_flipped_signature(&erin),
            "Jwt verification fails",
        ),
        (
            "expired",
            signed(
                &json!({ "iss": DEMO_JWT_ISSUER, "sub": "erin", "tier": "pro",
                            "iat": now - 7200, "exp": now - 3600 }),
            ),
            "Jwt is expired",
        ),
        (
            "another issuer",
            signed(
                &json!({ "iss": "someone-else", "sub": "erin", "tier": "pro",
                            "iat": now, "exp": now + 3600 }),
            ),
            "Jwt issuer is not configured",
        ),
    ];
    for (what, t, body) in &bad {
        assert_401(&get(&c, "/", Some(t), &[("x-tier", "pro")]), body, what);
    }
    // The IP's bucket is spent, but erin's valid token is keyed by her id.
    let r = get(&c, "/", Some(&erin), &[]);
    assert_passes(&r, "per-client", 3, 3600, 2, "a valid token after the 401s");

    assert_eq!(metric(&envoy, "ratelimit_wasm_requests_allowed"), 7);
    assert_eq!(metric(&envoy, "ratelimit_wasm_requests_denied"), 2);
    println!(
        "forged headers: free token 3 x 200 then 429; no token 3 x 200 (by IP) then 429; \
         {} bad tokens: 401 from jwt_authn",
        bad.len()
    );
}

// ---------------------------------------------------------------------------
// 2. Graduated response
// ---------------------------------------------------------------------------

#[test]
fn graduated_rule_warns_delays_rejects_blocks_and_releases() {
    // Two graduated rules. "grad" (5 per minute) shows every stage with exact figures: it
    // barely refills during the test. "grad-fast" (5 per 5 s, no warning or delay)
    // refills within seconds, so after its block it shows that the client is let through
    // again. The warning first shows `used=80` at the 4th request and the block comes at
    // the 10th (shares count whole tokens in use, so refill since the first request does
    // not delay a stage placed on a whole request).
    let stages = json!({ "warn_at": 0.8, "delay_at": 1.0, "delay_ms": 300,
                         "reject_at": 1.2, "block_at": 2.0, "block_for": "3s" });
    let config = policy_config(
        json!([
            { "name": "grad", "match": { "path_prefix": "/grad" }, "key": ["client"],
              "limits": [ { "requests": 5, "per": "1m" } ], "graduated": stages },
            { "name": "grad-fast", "match": { "path_prefix": "/fast" }, "key": ["client"],
              "limits": [ { "requests": 5, "per": "5s" } ],
              "graduated": { "reject_at": 1.2, "block_at": 1.9, "block_for": "3s" } }
        ]),
        // The default jitter: Retry-After and block ends spread up to +10%.
        json!({ "response": { "headers": "both", "problem_type": PROBLEM_TYPE } }),
    );
    let envoy = start(&config);
    let c = client(&envoy);
    let gus = token("gus", "free");

    // 1-3 plain, 4-5 warned, 6 delayed (and warned), 7-9 rejected, 10 blocked.
    let mut took = Vec::new();
    let expect_warning = [None, None, None, Some(80), Some(100), Some(120)];
    for (i, warning) in expect_warning.iter().enumerate() {
        let (r, t) = timed(&c, "/grad", &gus);
        took.push(t);
        let what = format!("grad #{}", i + 1);
        assert_passes(&r, "grad", 5, 60, 4u64.saturating_sub(i as u64), &what);
        let want: Vec<String> = warning
            .iter()
            .map(|u| format!("\"grad\";used={u}"))
            .collect();
        assert_eq!(r.header_all("x-ratelimit-warning"), want, "{what}: {r:#?}");
    }
    let mut retry_afters = Vec::new();
    for i in 7..=9 {
        let (r, t) = timed(&c, "/grad", &gus);
        took.push(t);
        // The 6th took the last token of 1.2 × 5; the next is back 12 s after the first
        // (11.6 s from now, or so: 12 rounded up), spread up to +10%.
        let retry = assert_429(&r, &["grad"], &format!("grad #{i}"));
        assert!((12..=jitter_bound(12)).contains(&retry), "#{i}: {retry}");
        retry_afters.push(retry);
    }
    let (r, t) = timed(&c, "/grad", &gus);
    took.push(t);
    let block_retry = assert_429(&r, &["grad"], "grad #10");
    // The block's rest: 3 s plus up to 10% of it (the release spread), rounded up; a
    // block's Retry-After is not spread a second time.
    assert!(
        (3..=jitter_bound(3)).contains(&block_retry),
        "block Retry-After {block_retry}"
    );
    let ms: Vec<u128> = took.iter().map(Duration::as_millis).collect();
    println!("graduated: ms per request #1-#10: {ms:?}; Retry-After #7-#9 {retry_afters:?}, block {block_retry}");
    for (i, t) in took.iter().enumerate() {
        if i == 5 {
            assert!(
                *t >= Duration::from_millis(300),
                "#6 (120%) must be held 300 ms: took {t:?}"
            );
        } else {
            assert!(
                *t < Duration::from_millis(300),
                "#{} is not delayed: took {t:?}",
                i + 1
            );
        }
    }
    // (The counters are read at the end: a read waits for the filter's
    // flush, and the blocks below are timed against each other.)

    // grad-fast: 6 pass (up to 120%), 7-9 rejected, the 10th blocks.
    for i in 0..6u64 {
        let r = get(&c, "/fast", Some(&gus), &[]);
        assert_passes(&r, "grad-fast", 5, 5, 4u64.saturating_sub(i), "fast");
    }
    for i in 7..=9 {
        assert_429(
            &get(&c, "/fast", Some(&gus), &[]),
            &["grad-fast"],
            &format!("fast #{i}"),
        );
    }
    let r = get(&c, "/fast", Some(&gus), &[]);
    let fast_blocked = Instant::now();
    let fast_retry = assert_429(&r, &["grad-fast"], "fast #10");
    assert!(
        (3..=jitter_bound(jitter_bound(3))).contains(&fast_retry),
        "{fast_retry}"
    );

    // At 2.5 s both are still blocked, although grad-fast's bucket would admit the request
    // (2.5 of its 5 per 5 s are back): the rest of the block, under a second, rounded up
    // and spread.
    std::thread::sleep(
        (fast_blocked + Duration::from_millis(2500)).saturating_duration_since(Instant::now()),
    );
    let r = get(&c, "/fast", Some(&gus), &[]);
    let rest = assert_429(&r, &["grad-fast"], "fast at 2.5 s");
    assert!((1..=2).contains(&rest), "Retry-After at 2.5 s: {rest}");
    let r = get(&c, "/grad", Some(&gus), &[]);
    let grad_rest = assert_429(&r, &["grad"], "grad at ~2.5 s");
    assert!(
        (1..=2).contains(&grad_rest),
        "Retry-After at ~2.5 s: {grad_rest}"
    );

    // At 3.5 s the blocks are over (they end within 3.3 s). grad-fast lets the client
    // through with a refilled bucket; grad's own bucket is still spent (6 of 5 per
    // minute taken 3.5 s ago), so it answers an ordinary 429, not a block.
    std::thread::sleep(
        (fast_blocked + Duration::from_millis(3500)).saturating_duration_since(Instant::now()),
    );
    let r = get(&c, "/fast", Some(&gus), &[]);
    assert_eq!(r.status, 200, "grad-fast after its block: {r:#?}");
    assert_eq!(r.expect_header("ratelimit-policy"), "\"grad-fast\";q=5;w=5");
    let r = get(&c, "/grad", Some(&gus), &[]);
    let after = assert_429(&r, &["grad"], "grad after its block");
    // Blocked: grad's 10th and grad-fast's, and both again at 2.5 s; no longer.
    assert_eq!(metric(&envoy, "ratelimit_wasm_blocked"), 4);
    assert_eq!(metric(&envoy, "ratelimit_wasm_warned"), 3);
    assert_eq!(metric(&envoy, "ratelimit_wasm_delayed"), 1);
    // About 8.4 s until one token of 12 s is back (plus jitter): more than any block's rest.
    assert!((5..=jitter_bound(12)).contains(&after), "{after}");
    println!(
        "graduated: blocked at #10 with Retry-After {block_retry} (grad) / {fast_retry} (grad-fast); \
         at +2.5 s still blocked (Retry-After {grad_rest} / {rest}); at +{:?} grad-fast lets \
         through, grad answers its rate limit (Retry-After {after})",
        fast_blocked.elapsed()
    );
}

/// The README's stages, exactly as a user would write them: 80% and 200% of
/// a 5-request limit fall on whole requests (the 4th and the 10th).
#[test]
fn graduated_stages_on_whole_requests_are_reached_on_time() {
    let config = policy_config(
        json!([{ "name": "grad", "key": ["client"], "limits": [ { "requests": 5, "per": "1m" } ],
                 "graduated": { "warn_at": 0.8, "reject_at": 1.2, "block_at": 2.0, "block_for": "3s" } }]),
        json!({}),
    );
    let envoy = start(&config);
    let c = client(&envoy);
    let t = token("hal", "free");
    let mut seen = Vec::new();
    for _ in 0..11 {
        let r = get(&c, "/", Some(&t), &[]);
        seen.push(format!(
            "{} warning={} retry-after={}",
            r.status,
            r.header("x-ratelimit-warning").unwrap_or("-"),
            r.header("retry-after").unwrap_or("-")
        ));
    }
    let blocked = metric(&envoy, "ratelimit_wasm_blocked");
    println!("whole-request stages: {seen:#?}\nratelimit_wasm_blocked = {blocked}");
    assert!(
        seen[3].starts_with("200 warning=\"grad\";used=80 "),
        "{seen:?}"
    );
    // Blocked from the 10th request on (demand 200%): the 10th and the 11th.
    assert_eq!(blocked, 2, "{seen:?}");
}

// ---------------------------------------------------------------------------
// 3. Shadow rules
// ---------------------------------------------------------------------------

#[test]
fn a_shadow_rule_never_rejects_and_counts_what_it_would_deny() {
    let config = policy_config(
        json!([
            { "name": "watch", "mode": "shadow", "key": ["client"],
              "limits": [ { "requests": 2, "per": "1h" } ] },
            { "name": "per-client", "key": ["client"],
              "limits": [ { "requests": 9, "per": "1h" } ] }
        ]),
        json!({}),
    );
    let envoy = start(&config);
    let c = client(&envoy);
    let sam = token("sam", "free");
    for i in 0..8u64 {
        let r = get(&c, "/", Some(&sam), &[]);
        // Both rules are listed, the enforced one first (a shadow rule is
        // charged after); the shadow rule is the tightest (2 vs 9): the
        // legacy headers are its.
        assert_eq!(
            r.expect_header("ratelimit-policy"),
            "\"per-client\";q=9;w=3600, \"watch\";q=2;w=3600",
            "#{}",
            i + 1
        );
        assert_passes(
            &r,
            "watch",
            2,
            3600,
            1u64.saturating_sub(i),
            &format!("#{}", i + 1),
        );
    }
    assert_eq!(metric(&envoy, "ratelimit_wasm_shadow_denied"), 6);
    assert_eq!(get(&c, "/", Some(&sam), &[]).status, 200, "#9");
    // The enforced rule still rejects at its limit; the shadow rule is not named.
    let r = get(&c, "/", Some(&sam), &[]);
    assert_eq!(assert_429(&r, &["per-client"], "#10"), 400);
    // Another client: 2 within the shadow limit, 1 over it.
    for _ in 0..3 {
        assert_eq!(get(&c, "/", Some(&token("tom", "pro")), &[]).status, 200);
    }
    let page = ok(envoy.stats_prometheus(), "reading /stats/prometheus");
    let value = |name: &str| {
        testkit::prometheus_value(&page, name)
            .unwrap_or_else(|| panic!("{name} missing from /stats/prometheus:\n{page}"))
    };
    // sam #3-#9 and tom #3.
    assert_eq!(value("ratelimit_wasm_shadow_denied"), 8.0);
    assert_eq!(value("ratelimit_wasm_requests_allowed"), 12.0);
    assert_eq!(value("ratelimit_wasm_requests_denied"), 1.0);
    println!("shadow: 12 x 200, 1 x 429 (the enforced rule), ratelimit_wasm_shadow_denied = 8");
}

// ---------------------------------------------------------------------------
// 4. Quotas (real Redis and gateway)
// ---------------------------------------------------------------------------

/// A plugin configuration with one global rule "api" (5 per hour per client;
/// `/heavy` costs 3) and the quota `quota`, through the gateway on `gateway`'s
/// port with `failure_mode: closed`.
fn quota_config(quota: Value) -> String {
    policy_config(
        json!([{ "name": "api", "scope": "global", "key": ["client"],
                 "limits": [ { "requests": 5, "per": "1h" } ] }]),
        json!({
            "global": { "cluster": "ratelimit_gateway", "timeout_ms": 200, "failure_mode": "closed",
                        "circuit": { "failures": 5, "cooldown_ms": 1000 } },
            "costs": [ { "match": { "path_prefix": "/heavy" }, "cost": 3 } ],
            "quotas": [quota]
        }),
    )
}

/// Redis, a gateway in front of it (a debug build on a busy machine: Redis
/// round trips up to 100 ms) and an Envoy calling that gateway.
fn quota_stack(config: &str) -> (Redis, Gateway, Envoy) {
    let redis = ok(Redis::start(), "starting redis-server");
    let gateway = ok(
        Gateway::start(
            GatewayOptions::new(redis.url())
                .policy(config)
                .args(&["--redis-timeout-ms", "100"]),
        ),
        "starting ratelimit-gateway",
    );
    let envoy = ok(
        Envoy::start(EnvoyOptions::new(config).gateway_port(gateway.port())),
        "starting Envoy",
    );
    (redis, gateway, envoy)
}

/// A 403 for the spent quota `name`: problem+json with the upgrade link and
/// no `Retry-After`. Returns the seconds until the quota renews (from `detail`).
fn assert_403(r: &Response, name: &str, what: &str) -> u64 {
    assert_eq!(r.status, 403, "{what}: {r:#?}");
    assert_eq!(r.expect_header("content-type"), "application/problem+json");
    assert_eq!(
        r.expect_header("link"),
        format!("<{UPGRADE}>; rel=\"payment\""),
        "{what}"
    );
    assert_eq!(r.header("retry-after"), None, "{what}: {r:#?}");
    let body = r.json();
    assert_eq!(body["type"], QUOTA_PROBLEM_TYPE, "{what}: {body}");
    assert_eq!(body["title"], "Quota Exhausted", "{what}: {body}");
    assert_eq!(body["status"], 403, "{what}: {body}");
    assert_eq!(body["violated-policies"], json!([name]), "{what}: {body}");
    assert_eq!(body["upgrade_url"], UPGRADE, "{what}: {body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    let secs = detail
        .strip_prefix(&format!("Quota {name} is used up; it renews in "))
        .and_then(|s| s.strip_suffix(" seconds."))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{what}: detail {detail:?}"));
    secs
}

#[test]
fn a_monthly_quota_is_a_403_survives_a_gateway_restart_and_yields_to_429() {
    let config = quota_config(json!({
        "name": "monthly", "key": ["client"], "period": "month",
        "tiers": { "free": 3, "pro": 100 }, "upgrade_url": UPGRADE
    }));
    let (_redis, mut gateway, envoy) = quota_stack(&config);
    let c = client(&envoy);
    let fay = token("fay", "free");
    let pat = token("pat", "pro");

    for i in 0..3u64 {
        let r = get(&c, "/", Some(&fay), &[]);
        assert_passes(&r, "api", 5, 3600, 4 - i, &format!("free #{}", i + 1));
    }
    // Quota spent: 403, and neither the quota nor the rate limit is charged.
    // (The 403's rate-limit headers are not checked: the gateway reports the rule's
    // figures as if the request had been charged, "remaining 1" where 2 are left.)
    for i in 4..=5 {
        let r = get(&c, "/", Some(&fay), &[]);
        let renews = assert_403(&r, "monthly", &format!("free #{i}"));
        assert!((1..=31 * 86_400).contains(&renews), "renews in {renews} s");
        assert_eq!(r.int_header("x-ratelimit-limit"), 5, "{r:#?}");
    }
    // Over the rate limit too (/heavy costs 3): 429, not 403. Its Retry-After shows that
    // the 403s took nothing: with 2 of 5 left, one token (720 s, no jitter) must come
    // back; had they been charged it would be two or more.
    let r = get(&c, "/heavy", Some(&fay), &[]);
    let retry = assert_429(&r, &["api"], "free, over the rate limit and the quota");
    assert_eq!(retry, 720, "{r:#?}");
    assert_eq!(r.int_header("x-ratelimit-remaining"), 2, "{r:#?}");
    // A pro client's quota is 100.
    for i in 0..4u64 {
        let r = get(&c, "/", Some(&pat), &[]);
        assert_passes(&r, "api", 5, 3600, 4 - i, &format!("pro #{}", i + 1));
    }
    assert_eq!(metric(&envoy, "ratelimit_wasm_quota_exhausted"), 2);

    // The gateway crashes: failure_mode closed answers 503 ...
    gateway.kill();
    let r = get(&c, "/", Some(&fay), &[]);
    assert_eq!(r.status, 503, "gateway down: {r:#?}");
    // Retry-After: the circuit's cooldown, 1 s.
    assert_eq!(r.expect_header("retry-after"), "1", "{r:#?}");
    // ... and once it is back on the same port, the count kept in Redis still holds.
    ok(gateway.restart(), "restarting ratelimit-gateway");
    let r = get(&c, "/", Some(&fay), &[]);
    assert_403(&r, "monthly", "free after the gateway restart");
    let r = get(&c, "/", Some(&pat), &[]);
    assert_passes(&r, "api", 5, 3600, 0, "pro after the gateway restart");
    assert_eq!(metric(&envoy, "ratelimit_wasm_quota_exhausted"), 3);
    let denials = ok(
        gateway.metric("ratelimit_gateway_quota_denials_total{period=\"month\"}"),
        "reading the gateway's /metrics",
    );
    assert_eq!(denials, Some(1.0), "quota denials since the restart");
    println!(
        "monthly quota: free 3 x 200, 2 x 403, /heavy 429 (Retry-After {retry}); pro 4 x 200; \
         gateway killed: 503; restarted on port {}: free 403, pro 200",
        gateway.port()
    );
}

#[test]
fn a_minute_quota_starts_fresh_at_the_next_minute() {
    let config = quota_config(json!({
        "name": "per-minute", "key": ["client"], "period": "minute",
        "tiers": { "free": 3, "pro": 100 }, "upgrade_url": UPGRADE
    }));
    let (_redis, _gateway, envoy) = quota_stack(&config);
    let c = client(&envoy);
    let ivy = token("ivy", "free");

    // Spend the quota in the last 1.5 s of a minute (UTC; the gateway takes the time from
    // Redis on this machine).
    let lead = Duration::from_millis(1500);
    let now = unix_now();
    let mut boundary = Duration::from_secs((now.as_secs() / 60 + 1) * 60);
    if boundary - now < lead + Duration::from_millis(100) {
        boundary += Duration::from_secs(60);
    }
    let until = |d: Duration| d.checked_sub(unix_now()).unwrap_or_default();
    std::thread::sleep(until(boundary - lead));
    let at = |what: &str| {
        let now = unix_now();
        let ms = now.as_millis() as i128 - boundary.as_millis() as i128;
        format!("{what} at {ms:+} ms")
    };
    let mut log = Vec::new();
    for i in 0..3u64 {
        let r = get(&c, "/", Some(&ivy), &[]);
        assert_passes(&r, "api", 5, 3600, 4 - i, &format!("#{}", i + 1));
        log.push(at("200"));
    }
    let r = get(&c, "/", Some(&ivy), &[]);
    let renews = assert_403(&r, "per-minute", "#4");
    log.push(at("403"));
    assert!(
        unix_now() < boundary,
        "the quota must be spent before the minute ends: {log:?}"
    );
    assert!((1..=2).contains(&renews), "renews in {renews} s: {log:?}");

    // Just after the boundary: a new period, a fresh count.
    std::thread::sleep(until(boundary + Duration::from_millis(200)));
    let r = get(&c, "/", Some(&ivy), &[]);
    log.push(at(&r.status.to_string()));
    assert_passes(
        &r,
        "api",
        5,
        3600,
        1,
        "the first request of the next minute",
    );
    println!("minute quota (renews in {renews} s): {log:?}");
    assert_eq!(metric(&envoy, "ratelimit_wasm_quota_exhausted"), 1);
}
