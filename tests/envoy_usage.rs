//! Charging from the response behind a real Envoy 1.40 (`--concurrency 2`)
//! and an upstream of our own (`testkit::Upstream`) serving JSON, SSE,
//! chunked, gzip and failing responses: the reservation, the settlement to
//! the usage the body reports (split across chunks), debt and its
//! `Retry-After`, `max`, bodies without usage, and `charge_on`; a
//! reservation read from the request body (`max_tokens`), and the body
//! rewritten so that the stream reports its usage.

use serde_json::{json, Value};
use testkit::{Client, ConnectionMode, Envoy, EnvoyOptions, Reply, Request, Upstream};

fn config(rules: Value) -> String {
    json!({
        "domain": "usage-e2e",
        "rules": rules,
        "response": { "retry_jitter": 0 }
    })
    .to_string()
}

fn start(config: &str, upstream: &Upstream) -> Envoy {
    Envoy::start(EnvoyOptions::new(config).upstream_port(upstream.port()))
        .unwrap_or_else(|e| panic!("could not start Envoy: {e:#}"))
}

/// 1,000 tokens a minute per client, read with the OpenAI chat preset.
fn tokens_per_minute() -> String {
    config(json!([{
        "name": "tokens", "key": ["client"],
        "limits": [{"requests": 1000, "per": "1m"}],
        "cost_from": {"preset": "openai_chat", "max": 4000, "reserve": 100}
    }]))
}

/// A chat completion body reporting `prompt` + `completion` tokens.
fn completion(prompt: u64, completion: u64) -> String {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there, \"friend\"."},
            "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
    })
    .to_string()
}

/// A chat completion stream whose last event carries the usage, cut into
/// chunks inside the JSON and inside `data:`.
fn stream(prompt: u64, completion: u64) -> Reply {
    let mut text = String::new();
    for word in ["Hel", "lo", "!"] {
        let chunk = json!({"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": word}}], "usage": null});
        text.push_str(&format!("data: {chunk}\n\n"));
    }
    let last = json!({"id": "c", "object": "chat.completion.chunk", "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}});
    text.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
    let bytes = text.into_bytes();
    let cuts = [7, 3, 41, 2, 200, bytes.len() - 30, bytes.len() - 29];
    let mut chunks = Vec::new();
    let mut from = 0;
    for cut in cuts {
        let to = cut.clamp(from, bytes.len());
        chunks.push(bytes[from..to].to_vec());
        from = to;
    }
    chunks.push(bytes[from..].to_vec());
    chunks.retain(|c| !c.is_empty());
    Reply::sse(&[])
        .chunks(chunks)
        .header("content-type", "text/event-stream")
}

fn client(envoy: &Envoy) -> Client {
    envoy.client(ConnectionMode::NewPerRequest)
}

fn metric(envoy: &Envoy, name: &str) -> u64 {
    envoy.metric(name).expect("admin stats").unwrap_or(0.0) as u64
}

#[test]
fn tokens_from_json_and_sse_bodies_put_the_client_in_debt_and_retry_after_covers_it() {
    let upstream = Upstream::start().expect("upstream");
    upstream.route("/json300", Reply::json(completion(120, 180)));
    upstream.route("/sse500", stream(200, 300));
    upstream.route("/cheap", Reply::json(completion(1, 0)));
    let envoy = start(&tokens_per_minute(), &upstream);
    let c = client(&envoy);
    let r = c.get_as("/json300", "ann");
    assert_eq!(r.status, 200, "{r:#?}");
    assert_eq!(r.int_header("x-ratelimit-remaining"), 900);
    assert!(
        r.body.contains("chatcmpl-1"),
        "the body passes whole: {}",
        r.body
    );
    let r = c.get_as("/json300", "ann");
    assert_eq!(r.int_header("x-ratelimit-remaining"), 600);
    let r = c.get_as("/sse500", "ann");
    assert_eq!(r.status, 200);
    assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    assert_eq!(r.int_header("x-ratelimit-remaining"), 300);
    // 1,100 spent: 100 in debt, and a reservation of 100 needs 200 tokens
    // refilled at 60 ms each.
    let r = c.get_as("/cheap", "ann");
    assert_eq!(r.status, 429, "{r:#?}");
    assert_eq!(r.int_header("retry-after"), 12);
    assert_eq!(upstream.requests("/cheap"), 0);
    assert_eq!(metric(&envoy, "ratelimit_wasm_usage_settled"), 3);
    // Another client is not touched.
    assert_eq!(c.get_as("/cheap", "bob").status, 200);
}

#[test]
fn bodies_without_usage_compressed_or_past_max_charge_what_they_must() {
    let upstream = Upstream::start().expect("upstream");
    upstream.route("/none", Reply::json(r#"{"choices": []}"#));
    upstream.route("/huge", Reply::json(completion(1_000_000_000_000, 0)));
    upstream.route("/gzip", Reply::json(completion(500, 500)).gzip());
    upstream.route("/zero", Reply::json(completion(0, 0)));
    let envoy = start(
        &config(json!([{
            "name": "tokens", "key": ["client"],
            "limits": [{"requests": 10000, "per": "1h"}],
            "cost_from": {"preset": "openai_chat", "max": 4000, "reserve": 100}
        }])),
        &upstream,
    );
    let c = client(&envoy);
    // Each response's headers show the reservation; the next one shows the settlement.
    assert_eq!(
        c.get_as("/none", "ann").int_header("x-ratelimit-remaining"),
        9900
    );
    // The missing usage kept the reservation: 9,900, then 100 more reserved.
    assert_eq!(
        c.get_as("/huge", "ann").int_header("x-ratelimit-remaining"),
        9800
    );
    // /huge charged max: 9,900 − 4,000 = 5,900 before this reservation.
    let r = c.get_as("/gzip", "ann");
    assert_eq!(r.status, 200);
    assert_eq!(r.int_header("x-ratelimit-remaining"), 5800);
    // The gzip body kept its reservation: 5,800, then 100 reserved.
    assert_eq!(
        c.get_as("/zero", "ann").int_header("x-ratelimit-remaining"),
        5700
    );
    assert_eq!(
        c.get_as("/zero", "ann").int_header("x-ratelimit-remaining"),
        5700
    );
    assert_eq!(metric(&envoy, "ratelimit_wasm_usage_missing"), 1);
    assert_eq!(metric(&envoy, "ratelimit_wasm_usage_capped"), 1);
    assert_eq!(metric(&envoy, "ratelimit_wasm_usage_compressed"), 1);
}

#[test]
fn charge_on_2xx_lets_404s_503s_and_resets_cost_nothing() {
    let upstream = Upstream::start().expect("upstream");
    upstream.route("/missing", Reply::json("{}").status(404));
    upstream.route("/down", Reply::json("{}").status(503));
    upstream.route("/reset", Reply::json("{}").reset());
    upstream.route("/ok", Reply::json("{}"));
    let envoy = start(
        &config(json!([{
            "name": "calls", "key": ["client"],
            "limits": [{"requests": 3, "per": "1h"}],
            "charge_on": ["2xx"]
        }])),
        &upstream,
    );
    let c = client(&envoy);
    for path in ["/missing", "/down", "/reset"] {
        for _ in 0..4 {
            let r = c.get_as(path, "ann");
            assert!(r.status == 404 || r.status >= 500, "{path}: {r:#?}");
        }
    }
    for i in 0..3 {
        assert_eq!(c.get_as("/ok", "ann").status, 200, "request {i}");
    }
    assert_eq!(c.get_as("/ok", "ann").status, 429);
    assert_eq!(metric(&envoy, "ratelimit_wasm_charge_refunded"), 12);
}

#[test]
fn twenty_concurrent_streams_are_admitted_by_their_reservations_and_settle_exactly() {
    let upstream = Upstream::start().expect("upstream");
    upstream.route("/stream", stream(20, 30));
    upstream.route("/json", Reply::json(completion(1, 1)));
    let gate = upstream.hold("/stream");
    let envoy = start(
        &config(json!([{
            "name": "tokens", "key": ["client"],
            "limits": [{"requests": 1000, "per": "1h"}],
            "cost_from": {"preset": "openai_chat", "max": 4000, "reserve": 100}
        }])),
        &upstream,
    );
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let all: Vec<_> = (0..20)
            .map(|_| s.spawn(|| client(&envoy).get_as("/stream", "ann")))
            .collect();
        // Ten reservations of 100 fill the bucket while the streams are held.
        assert!(
            upstream.wait_in_flight(10, std::time::Duration::from_secs(10)),
            "ten streams reach the upstream"
        );
        // The other ten are answered while those are held (429s).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while all.iter().filter(|h| h.is_finished()).count() < 10 {
            assert!(std::time::Instant::now() < deadline, "ten answered early");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let denied_meanwhile = client(&envoy).get_as("/json", "ann");
        assert_eq!(denied_meanwhile.status, 429);
        gate.open();
        all.into_iter()
            .map(|h| h.join().expect("request thread").status)
            .collect()
    });
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    assert_eq!(admitted, 10, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 10);
    assert_eq!(upstream.requests("/stream"), 10);
    // Each stream reported 50: 500 spent, and the next reservation of 100
    // leaves 400.
    let r = client(&envoy).get_as("/json", "ann");
    assert_eq!(r.status, 200);
    assert_eq!(r.int_header("x-ratelimit-remaining"), 400);
    // The ten streams and that last request.
    assert_eq!(metric(&envoy, "ratelimit_wasm_usage_settled"), 11);
}

/// Two proxies, one gateway and Redis: a global rule and a monthly quota
/// that counts cost, both charged from the stream's usage (a `costs[]`
/// entry), settle on the gateway. 50 streamed requests of five sizes over
/// both proxies (both workers of each) leave exactly what the upstream
/// reported counted in Redis, every settlement applied once.
#[test]
fn two_proxies_settle_fifty_streams_on_the_gateway_exactly() {
    use testkit::redis::Redis;
    use testkit::{Gateway, GatewayOptions};
    let redis = Redis::start().expect("redis-server");
    let config = json!({
        "domain": "usage-global",
        "global": {"cluster": "ratelimit_gateway", "timeout_ms": 200, "failure_mode": "closed"},
        "rules": [{"name": "tokens", "scope": "global", "key": ["client"],
                   "limits": [{"requests": 100_000, "per": "30d"}]}],
        "costs": [{"match": {"path_prefix": "/v1"},
                   "cost_from": {"preset": "openai_chat", "max": 4000, "reserve": 100}}],
        "quotas": [{"name": "monthly", "key": ["client"], "period": "month", "limit": 1_000_000,
                    "count": "cost", "upgrade_url": "https://example.com/upgrade"}],
        "response": {"retry_jitter": 0}
    })
    .to_string();
    let gateway = Gateway::start(
        GatewayOptions::new(redis.url())
            .policy(config.clone())
            .args(&["--redis-timeout-ms", "100"]),
    )
    .expect("ratelimit-gateway");
    let upstream = Upstream::start().expect("upstream");
    // Usage 37, 137, 237, 337 and 437 (prompt + completion).
    let sizes: Vec<u64> = (0..5).map(|i| 37 + 100 * i).collect();
    for (i, size) in sizes.iter().enumerate() {
        upstream.route(&format!("/v1/s{i}"), stream(size / 3, size - size / 3));
    }
    let opts = EnvoyOptions::new(config)
        .upstream_port(upstream.port())
        .gateway_port(gateway.port());
    let envoys = Envoy::start_all(&[opts.clone(), opts]).expect("two Envoys");
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let all: Vec<_> = (0..8)
            .map(|t| {
                let envoys = &envoys;
                s.spawn(move || {
                    (0..50)
                        .filter(|n| n % 8 == t)
                        .map(|n| {
                            let r =
                                client(&envoys[n % 2]).get_as(&format!("/v1/s{}", n % 5), "ann");
                            assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
                            r.status
                        })
                        .collect::<Vec<u16>>()
                })
            })
            .collect();
        all.into_iter()
            .flat_map(|h| h.join().expect("request thread"))
            .collect()
    });
    assert_eq!(statuses, vec![200; 50]);
    let reported: u64 = sizes.iter().sum::<u64>() * 10;
    // The settlements leave on each worker's next tick: wait for all 50.
    let settled = |e: &Envoy| metric(e, "ratelimit_wasm_global_settled");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while envoys.iter().map(settled).sum::<u64>() < 50 {
        if std::time::Instant::now() > deadline {
            let stats: Vec<String> = envoys
                .iter()
                .map(|e| {
                    let page = e.stats_prometheus().unwrap_or_default();
                    page.lines()
                        .filter(|l| l.starts_with("ratelimit_wasm_") && !l.ends_with(" 0"))
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .collect();
            panic!(
                "50 settlements applied: {stats:#?}\n{}",
                envoys[0].log_tail(30)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    for e in &envoys {
        assert!(settled(e) > 0, "each proxy settled some");
        assert_eq!(metric(e, "ratelimit_wasm_global_settle_unmatched"), 0);
        assert_eq!(metric(e, "ratelimit_wasm_global_settle_failed"), 0);
        assert_eq!(metric(e, "ratelimit_wasm_global_failures"), 0);
    }
    assert_eq!(envoys.iter().map(settled).sum::<u64>(), 50);
    // The month's count is exactly what the upstream reported, and no
    // reservation record is left.
    let dump = redis.dump().expect("dumping Redis");
    let quota: Vec<&str> = dump
        .lines()
        .filter(|l| l.contains("|q|monthly/") && l.contains(" string "))
        .collect();
    let [line] = quota.as_slice() else {
        panic!("one quota key expected:\n{dump}");
    };
    assert!(
        line.contains(&format!(" string \"{reported}\" ")),
        "{line}: expected {reported}"
    );
    assert!(
        !dump.contains("|r|"),
        "no reservation record is left:\n{dump}"
    );
    // The bucket: 100,000 less what was reported, and the 100 this request
    // reserves (a token comes back every 26 s: at most one meanwhile).
    let r = client(&envoys[0]).get_as("/v1/s0", "ann");
    assert_eq!(r.status, 200);
    let left = r.int_header("x-ratelimit-remaining");
    let exact = 100_000 - reported - 100;
    assert!(
        (exact..=exact + 1).contains(&left),
        "{left} left, {exact} expected"
    );
}

/// A request body with `max_tokens` and `"stream": true` waits for its body
/// in a real Envoy: it reserves its `max_tokens`, the upstream gets the
/// body with `stream_options.include_usage` added (framed by Envoy, the
/// client's `content-length` gone), and the stream settles to the usage it
/// then reports. Bodies in many pieces: a 200 KB one passes unread and
/// unchanged on the default, a 30 KB one is read whole.
#[test]
fn a_streamed_request_reserves_its_max_tokens_and_the_upstream_is_asked_for_usage() {
    let upstream = Upstream::start().expect("upstream");
    upstream.route("/v1/chat/completions", stream(200, 300));
    let envoy = start(
        &config(json!([{
            "name": "tokens", "key": ["client"],
            // A day: no whole token comes back while the test runs (a
            // minute gave 17 a second, past the exact figures below on a
            // loaded machine).
            "limits": [{"requests": 1000, "per": "1d"}],
            "cost_from": {"preset": "openai_chat", "max": 4000,
                "reserve": {"pointer": "/max_tokens", "default": 100},
                "ensure_stream_usage": true}
        }])),
        &upstream,
    );
    let c = client(&envoy);
    let chat = |max_tokens: u64| {
        let body = format!(
            r#"{{"model":"gpt-4o-mini", "stream":true, "max_tokens":{max_tokens}, "messages":[{{"role":"user","content":"Hi"}}]}}"#
        );
        let r = c
            .send(
                &Request::post("/v1/chat/completions", body.clone())
                    .header("x-client-id", "ann")
                    .header("content-type", "application/json"),
            )
            .unwrap_or_else(|e| panic!("the request: {e:#}\n{}", envoy.log_tail(40)));
        (body, r)
    };
    let (sent, r) = chat(600);
    assert_eq!(r.status, 200, "{r:#?}");
    // The headers show the reservation of 600.
    assert_eq!(r.int_header("x-ratelimit-remaining"), 400);
    assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    let received = upstream.received();
    assert_eq!(received.len(), 1);
    let got = &received[0];
    let want = sent.replacen('{', r#"{"stream_options":{"include_usage":true},"#, 1);
    assert_eq!(String::from_utf8_lossy(&got.body), want);
    let as_json: Value = serde_json::from_slice(&got.body).expect("JSON");
    assert_eq!(as_json["stream_options"]["include_usage"], json!(true));
    // The headers left before the body was read: Envoy frames the new
    // body itself, chunked, and no content-length of the old one is left.
    assert_eq!(got.header("content-length"), None, "{got:?}");
    assert_eq!(got.header("transfer-encoding"), Some("chunked"), "{got:?}");
    // Settled to the 500 the stream reported: 500 left, exactly.
    let (_, r) = chat(501);
    assert_eq!(r.status, 429, "{r:#?}");
    assert_eq!(upstream.requests("/v1/chat/completions"), 1);
    let (_, r) = chat(500);
    assert_eq!(r.status, 200, "{r:#?}");
    assert_eq!(r.int_header("x-ratelimit-remaining"), 0);
    assert_eq!(metric(&envoy, "ratelimit_wasm_reserve_from_body"), 3);
    // The body is read (and rewritten) before the decision: the refused
    // request's was too.
    assert_eq!(metric(&envoy, "ratelimit_wasm_usage_body_rewritten"), 3);
    assert_eq!(metric(&envoy, "ratelimit_wasm_usage_settled"), 2);

    // Bodies in many pieces: past the 64 KiB bound, passed on unread and
    // unchanged with the default reserved; under it, read whole.
    let send = |body: &str| {
        c.send(
            &Request::post("/v1/chat/completions", body.to_string())
                .header("x-client-id", "bob")
                .header("content-type", "application/json"),
        )
        .unwrap_or_else(|e| panic!("the request: {e:#}\n{}", envoy.log_tail(40)))
    };
    let big = format!(
        r#"{{"stream":true,"max_tokens":300,"pad":"{}"}}"#,
        "x".repeat(200_000)
    );
    let r = send(&big);
    assert_eq!(
        (r.status, r.int_header("x-ratelimit-remaining")),
        (200, 900)
    );
    assert_eq!(
        upstream.received().last().map(|g| g.body.clone()),
        Some(big.into_bytes())
    );
    assert_eq!(
        metric(&envoy, "ratelimit_wasm_reserve_default_too_large"),
        1
    );
    assert_eq!(metric(&envoy, "ratelimit_wasm_usage_body_unchanged"), 1);
    // Settled to 500: a 30 KB body asking for 250 leaves 250.
    let mid = format!(r#"{{"max_tokens":250,"pad":"{}"}}"#, "y".repeat(30_000));
    let r = send(&mid);
    assert_eq!(
        (r.status, r.int_header("x-ratelimit-remaining")),
        (200, 250)
    );
    assert_eq!(
        upstream.received().last().map(|g| g.body.clone()),
        Some(mid.into_bytes())
    );
}

/// Two proxies and the gateway on a real Redis: a global rule reserves the
/// `max_tokens` read from each request body on the gateway, and the stream
/// settles there to the usage it reports, whichever proxy the next request
/// goes through.
#[test]
fn a_global_rule_reserves_max_tokens_on_the_gateway_and_settles_the_stream_exactly() {
    use testkit::redis::Redis;
    use testkit::{Gateway, GatewayOptions};
    let redis = Redis::start().expect("redis-server");
    let config = json!({
        "domain": "usage-body-global",
        "global": {"cluster": "ratelimit_gateway", "timeout_ms": 500, "failure_mode": "closed"},
        "rules": [{"name": "tokens", "scope": "global", "key": ["client"],
                   "limits": [{"requests": 1000, "per": "1d"}],
                   "cost_from": {"preset": "openai_chat", "max": 4000,
                       "reserve": {"pointer": "/max_tokens", "default": 100},
                       "ensure_stream_usage": true}}],
        "response": {"retry_jitter": 0}
    })
    .to_string();
    let gateway = Gateway::start(GatewayOptions::new(redis.url()).policy(config.clone()))
        .expect("ratelimit-gateway");
    let upstream = Upstream::start().expect("upstream");
    upstream.route("/v1/chat/completions", stream(200, 300));
    let opts = EnvoyOptions::new(config)
        .upstream_port(upstream.port())
        .gateway_port(gateway.port());
    let envoys = Envoy::start_all(&[opts.clone(), opts]).expect("two Envoys");
    let chat = |e: &Envoy, max_tokens: u64| {
        let body = format!(r#"{{"stream":true,"max_tokens":{max_tokens},"messages":[]}}"#);
        client(e)
            .send(
                &Request::post("/v1/chat/completions", body)
                    .header("x-client-id", "ann")
                    .header("content-type", "application/json"),
            )
            .unwrap_or_else(|e| panic!("the request: {e:#}"))
    };
    let settled = |e: &Envoy, n: u64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while metric(e, "ratelimit_wasm_global_settled") < n {
            assert!(std::time::Instant::now() < deadline, "{n} settled");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    // 600 reserved on the gateway (the headers show it), then settled to 500.
    let r = chat(&envoys[0], 600);
    assert_eq!(r.status, 200, "{r:#?}");
    assert_eq!(r.int_header("x-ratelimit-remaining"), 400);
    settled(&envoys[0], 1);
    // 500 left, whichever proxy asks: 501 does not fit, 500 does.
    let r = chat(&envoys[1], 501);
    assert_eq!(r.status, 429, "{r:#?}");
    let r = chat(&envoys[1], 500);
    assert_eq!(r.status, 200, "{r:#?}");
    assert_eq!(r.int_header("x-ratelimit-remaining"), 0);
    settled(&envoys[1], 1);
    assert_eq!(upstream.requests("/v1/chat/completions"), 2);
    for got in upstream.received() {
        let body: Value = serde_json::from_slice(&got.body).expect("JSON");
        assert_eq!(body["stream_options"]["include_usage"], json!(true));
    }
    for e in &envoys {
        assert_eq!(metric(e, "ratelimit_wasm_global_settle_unmatched"), 0);
    }
    let dump = redis.dump().expect("dumping Redis");
    assert!(
        !dump.contains("|r|"),
        "no reservation record is left:\n{dump}"
    );
}
