//! The fuzz targets on stable, without libFuzzer:
//!
//! - every input in `fuzz/corpus/<target>/` (and `fuzz/artifacts/<target>/`, where
//!   `cargo fuzz` leaves what it found) goes through the very code the fuzz target runs
//!   (`fuzz/targets/*.rs`, included below), so a crash once found and added to the corpus
//!   fails `make test` until it is fixed; the gateway's targets replay in
//!   `gateway/tests/fuzz_corpus.rs`;
//! - a randomized driver (fixed seeds) runs the compiled filter through the wasmtime
//!   harness with random requests and headers, callout answers (garbage included),
//!   failed and timed-out callouts, cancels, ticks, clock jumps both ways and injected CAS
//!   conflicts: the filter must never trap, never leave a request hanging, and never admit
//!   more than its limit.
//!
//! `make fuzz` runs the real fuzzers (nightly, cargo-fuzz).

#[path = "../fuzz/targets/config.rs"]
mod config;
#[path = "../fuzz/targets/decide.rs"]
mod decide;
#[path = "../fuzz/targets/gateway_answer.rs"]
mod gateway_answer;
#[path = "../fuzz/targets/input.rs"]
mod input;
#[path = "../fuzz/targets/key.rs"]
mod key;
#[path = "../fuzz/targets/replay.rs"]
mod replay;
#[path = "../fuzz/targets/request_gen.rs"]
mod request_gen;

mod harness;

use harness::{CallResponse, Harness, KeyFilter, Options, Request, StreamId, StreamPhase};
use input::Input;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

/// Replays one target's corpus through `run`.
fn replay(target: &str, run: fn(&[u8])) {
    replay::replay(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz"),
        target,
        run,
    );
}

#[test]
fn corpus_config() {
    replay("config", config::run);
}

#[test]
fn corpus_gateway_answer() {
    replay("gateway_answer", gateway_answer::run);
}

#[test]
fn corpus_key() {
    replay("key", key::run);
}

#[test]
fn corpus_decide() {
    replay("decide", decide::run);
}

// ---------------------------------------------------------------------------------------------
// The compiled filter under random host events.

/// Random bytes from a fixed seed (splitmix64), decoded into operations like fuzz input.
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    testkit::rng::Rng::new(seed).bytes(len)
}

const HOUR_NS: u64 = 3_600_000_000_000;

/// A gateway answer shaped after the filter's request body (or not), or garbage.
fn gateway_response(inp: &mut Input, request_body: &[u8]) -> CallResponse {
    let status = inp.pick(&[200, 200, 200, 200, 503, 400, 504, 999]);
    let asked: serde_json::Value = serde_json::from_slice(request_body).unwrap_or_default();
    let body = match inp.below(6) {
        0 => inp.short_bytes().to_vec(),
        kind => {
            let mut body = match asked["checks"].as_array() {
                // A batch (protocol 3): one result per check, now and then one too many.
                Some(checks) => {
                    let mut results: Vec<String> = checks
                        .iter()
                        .map(|c| check_answer(inp, c, kind, ""))
                        .collect();
                    if kind == 1 && inp.bool() {
                        results.push(r#"{"allowed":false,"error":"key_budget"}"#.into());
                    }
                    format!(r#"{{"version":3,"results":[{}]}}"#, results.join(","))
                }
                None => check_answer(inp, &asked, kind, r#""version":2,"#),
            }
            .into_bytes();
            if kind == 3 {
                body.truncate(inp.below(body.len() + 1));
            }
            body
        }
    };
    CallResponse::new(status)
        .header("content-type", "application/json")
        .body(body)
}

/// One check's answer to `asked` (its buckets and quotas), with `head`
/// before its fields; `kind` 1 skews the counts, 2 contradicts `allowed`.
fn check_answer(inp: &mut Input, asked: &serde_json::Value, kind: usize, head: &str) -> String {
    let mut all = true;
    let num = |inp: &mut Input| -> String {
        inp.pick(&[
            "0",
            "1",
            "3",
            "-1",
            "1e300",
            "0.5",
            "60000",
            "18446744073709551615",
        ])
        .to_string()
    };
    let skew = |inp: &mut Input, n: usize| if kind == 1 && inp.bool() { n + 1 } else { n };
    let empty = Vec::new();
    let buckets = asked["buckets"].as_array().unwrap_or(&empty);
    let buckets: Vec<String> = buckets
        .iter()
        .map(|_| {
            // A request names no limits: the answer says which it enforced.
            let n = skew(inp, 1);
            let limits: Vec<String> = (0..n)
                .map(|_| {
                    let allowed = inp.below(3) != 0;
                    all &= allowed;
                    format!(
                        r#"{{"requests":{},"window_ms":{},"algorithm":"token_bucket","allowed":{allowed},"remaining":{},"reset_ms":{},"retry_after_ms":{}}}"#,
                        num(inp),
                        num(inp),
                        num(inp),
                        num(inp),
                        num(inp)
                    )
                })
                .collect();
            format!(r#"{{"limits":[{}]}}"#, limits.join(","))
        })
        .collect();
    let quotas = asked["quotas"].as_array().map_or(0, Vec::len);
    let quotas: Vec<String> = (0..quotas)
        .map(|_| {
            let allowed = inp.below(3) != 0;
            all &= allowed;
            format!(
                r#"{{"limit":{},"period":"month","allowed":{allowed},"remaining":{},"reset_ms":{}}}"#,
                num(inp),
                num(inp),
                num(inp)
            )
        })
        .collect();
    let allowed = if kind == 2 { !all } else { all };
    format!(
        r#"{{{head}"allowed":{allowed},"buckets":[{}],"quotas":[{}]}}"#,
        buckets.join(","),
        quotas.join(",")
    )
}

fn random_request(inp: &mut Input) -> (Request, Option<&'static str>) {
    let method = inp.pick(&["GET", "POST"]);
    let path = inp.pick(&["/", "/search?q=1", "/upload/a", "/x%00y", "/a?b"]);
    let mut req = Request::new(method, path);
    let client = match inp.below(6) {
        0 => None,
        1 => {
            if let Some(v) = request_gen::value(inp) {
                req = req.header("x-client-id", v);
            }
            None
        }
        i => {
            let id = ["alice", "bob", "trial", "root"][i - 2];
            req = req.header("x-client-id", id);
            Some(id)
        }
    };
    for name in ["x-forwarded-for", "x-tier", "x-tenant"] {
        if let Some(v) = request_gen::value(inp) {
            req = req.header(name, v);
        }
    }
    match inp.below(4) {
        0 => req = req.no_source(),
        1 => req = req.source_bytes(request_gen::source(inp).unwrap_or_default()),
        _ => {}
    }
    if inp.below(8) == 0 {
        req = req.hold_upstream();
    }
    (req, client)
}

trait SourceBytes {
    fn source_bytes(self, addr: Vec<u8>) -> Self;
}

impl SourceBytes for Request {
    fn source_bytes(self, addr: Vec<u8>) -> Self {
        self.property(&["source", "address"], addr)
    }
}

/// One case: a configuration from `decide::Scenario`, two workers, up to `steps` events.
fn drive(seed: u64, steps: usize) {
    let bytes = random_bytes(seed, 64 * 1024);
    let mut inp = Input::new(&bytes);
    let sc = decide::Scenario::read(&mut inp);
    let mut opts = Options::new(2, &sc.config);
    // Sometimes the gateway's cluster is unknown: the callout cannot even start.
    opts = if inp.below(6) == 0 {
        opts.clusters(&["other"])
    } else {
        opts.clusters(&["gw"])
    };
    let h = Harness::with_options(opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        h.configure_results().iter().all(|c| *c),
        "the filter refused {}:\n{}",
        sc.config,
        h.log_text()
    );
    let t0 = h.now_ns();
    // One case in three loses whole requests' worth of CAS writes (then `on_error` decides,
    // and the admission bound does not apply).
    let bursts = inp.below(3) == 0;
    // Half the cases stay within seconds, where the bound is tight.
    let long_jumps = inp.bool();
    // Streams of the bounded clients, and when each client first came.
    let mut counted: Vec<(StreamId, &'static str)> = Vec::new();
    let mut first: HashMap<&'static str, u64> = HashMap::new();
    let mut latest = t0;
    // Sliding window: the window each charge falls in on the limiter's clock (its own, or
    // the window last charged when the clock stepped back behind it).
    let mut last_charged: HashMap<&'static str, u64> = HashMap::new();
    let mut window_of: HashMap<StreamId, u64> = HashMap::new();
    for _ in 0..steps {
        match inp.below(16) {
            0..=4 => {
                let (req, client) = random_request(&mut inp);
                let w = inp.below(2);
                let id = h.begin(w, req);
                if let Some(c @ ("alice" | "bob")) = client {
                    counted.push((id, c));
                    // The earliest clock reading, not the first request: the clock may step back.
                    let t = first.entry(c).or_insert(h.now_ns());
                    *t = (*t).min(h.now_ns());
                    // Not refused at once: the local rules were charged.
                    if h.outcome(id).local_response.is_none() {
                        let w = last_charged.entry(c).or_insert(0);
                        *w = (*w).max(h.now_ns() / HOUR_NS);
                        window_of.insert(id, *w);
                    }
                }
            }
            5 | 6 => {
                let calls = h.pending_http_calls();
                if !calls.is_empty() {
                    let call = &calls[inp.below(calls.len())];
                    let response = gateway_response(&mut inp, &call.body);
                    h.respond_http_call(call.worker, call.token, response);
                }
            }
            7 => {
                let calls = h.pending_http_calls();
                if !calls.is_empty() {
                    let call = &calls[inp.below(calls.len())];
                    if inp.bool() {
                        h.fail_http_call(call.worker, call.token);
                    } else {
                        h.timeout_http_call(call.worker, call.token);
                    }
                }
            }
            8 => {
                let open = h.open_streams();
                if !open.is_empty() {
                    let id = open[inp.below(open.len())];
                    if h.outcome(id).phase == StreamPhase::AwaitingUpstream {
                        h.respond_upstream(id, Default::default());
                    } else {
                        h.cancel(id);
                    }
                }
            }
            9 | 10 => h.advance_ms(u64::from(inp.u8())),
            11 => {
                // Seconds to minutes; a configuration with delays ticks every 5 ms, and
                // `advance` runs every tick on the way, so it gets milliseconds.
                let n = u64::from(inp.u8()) * 10;
                if !long_jumps {
                    h.advance_ms(n);
                } else if h.tick_period_ms(0) == 0 {
                    h.advance(Duration::from_secs(n));
                } else {
                    h.advance_ms(n);
                }
            }
            12 => h.set_time_ns(h.now_ns().saturating_sub(u64::from(inp.u16()) * 1_000_000)),
            13 => h.tick(inp.below(2)),
            _ => {
                // Another worker writes first, now and then past the retry budget. Envoy
                // always creates a missing key, so only writes to existing keys lose.
                let n = if bursts && inp.below(8) == 0 {
                    40
                } else if h.pending_cas_faults() < 8 {
                    inp.below(6)
                } else {
                    0
                };
                let inner = Rc::downgrade(&h.inner);
                let exists = move |k: &str| {
                    inner
                        .upgrade()
                        .is_some_and(|i| i.shared.borrow().get(k).is_ok())
                };
                h.fail_next_cas_sets(n, KeyFilter::func(exists));
            }
        }
        latest = latest.max(h.now_ns());
    }
    // Wind down: every callout fails, delays elapse, held upstreams answer.
    for call in h.pending_http_calls() {
        h.fail_http_call(call.worker, call.token);
    }
    h.advance(Duration::from_secs(1));
    for id in h.open_streams() {
        if h.outcome(id).phase == StreamPhase::AwaitingUpstream {
            h.respond_upstream(id, Default::default());
        }
    }
    let stuck: Vec<_> = h
        .open_streams()
        .into_iter()
        .map(|id| h.outcome(id))
        .collect();
    assert!(stuck.is_empty(), "requests left hanging: {stuck:#?}");

    let metrics: Vec<String> = h
        .metrics()
        .iter()
        .filter(|(_, m)| m.value != 0)
        .map(|(k, m)| format!("{}={}", k.trim_start_matches("ratelimit_wasm_"), m.value))
        .collect();
    println!(
        "seed {seed}: {} streams, {} callouts; {}",
        counted.len(),
        h.http_calls().len(),
        metrics.join(" ")
    );

    // The admission bound, unless the shared state failed or buckets were reset by design.
    let Some(n) = sc.bounded else { return };
    let tainted = ["errors", "bucket_evictions", "corrupt_state"]
        .iter()
        .any(|m| h.metric_opt(&format!("ratelimit_wasm_{m}")).unwrap_or(0) > 0);
    if tainted {
        return;
    }
    if sc.sliding {
        // At most N admitted in every fixed window of the limiter's clock.
        let mut per_window: HashMap<(&str, u64), u64> = HashMap::new();
        for (id, c) in &counted {
            if let (Some(w), Some(_)) = (window_of.get(id), &h.outcome(*id).upstream_request) {
                *per_window.entry((*c, *w)).or_insert(0) += 1;
            }
        }
        for ((client, w), admitted) in per_window {
            assert!(
                admitted <= n,
                "{client}: {admitted} admitted > N={n} in window {w} ({})",
                sc.config
            );
        }
        return;
    }
    for client in ["alice", "bob"] {
        let admitted = counted
            .iter()
            .filter(|(id, c)| *c == client && h.outcome(*id).upstream_request.is_some())
            .count() as u64;
        let Some(&t_first) = first.get(client) else {
            continue;
        };
        let bound = n + (u128::from(n) * u128::from(latest - t_first) / u128::from(HOUR_NS)) as u64;
        println!("seed {seed}: {client} admitted {admitted}, bound {bound} (N={n})");
        assert!(
            admitted <= bound,
            "{client}: {admitted} admitted > {bound} ({})",
            sc.config
        );
    }
}

/// Fixed seeds, so a failure reproduces; `FUZZ_HARNESS_CASES` runs more of them.
#[test]
fn compiled_filter_survives_random_host_events() {
    let cases: u64 = std::env::var("FUZZ_HARNESS_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    for seed in 0..cases {
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| drive(seed, 300))) {
            panic!(
                "random host events, seed {seed} (rerun: drive({seed}, 300)):\n{}",
                replay::panic_message(&*e)
            );
        }
    }
}
