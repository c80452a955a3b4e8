//! Differential test: the Lua script (`check.lua`, run by a real Redis) and
//! the filter's Rust buckets (`ratelimit_wasm::token_bucket` and
//! `ratelimit_wasm::sliding_window`) must give the same decisions — allowed,
//! remaining, reset and retry-after — on the same generated sequences.
//!
//! The script normally takes its time from Redis `TIME`; here every call goes
//! through [`Limiter::check_at`] with the **test-only** time override (ARGV[2]
//! of `check.lua`), so both sides see the same whole-millisecond times. The
//! Rust side runs in nanoseconds (`now_ms × 10^6`, `window_ms × 10^6`) and its
//! reset / retry are rounded up to ms.
//!
//! Seeded generator: `RLGW_DIFF_SEED` (default fixed) and `RLGW_DIFF_CASES`
//! reproduce or widen a run.

mod common;
use common::Rng;

use std::time::Duration;

use ratelimit_gateway::limiter::Limiter;
use ratelimit_gateway::protocol::{Algorithm, BucketSpec, CheckRequest, LimitSpec};
use ratelimit_gateway::Config;
use ratelimit_wasm::token_bucket::{Check, Limit};

const MS: u64 = 1_000_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rust_check(alg: Algorithm, limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> Check {
    match alg {
        Algorithm::TokenBucket => limit.check(state, now_ns, cost),
        Algorithm::SlidingWindow => {
            ratelimit_wasm::sliding_window::check(limit, state, now_ns, cost)
        }
    }
}

/// A limit in one of several regimes: small, odd divisors, or
/// `requests × window_ms` right at 2^53.
fn gen_limit(rng: &mut Rng, alg: Algorithm) -> LimitSpec {
    let (requests, window_ms) = match rng.range(0, 9) {
        0..=4 => (rng.range(1, 20), rng.range(1, 3000)),
        5..=7 => (
            rng.pick(&[1, 2, 3, 7, 9, 11, 13, 60, 999, 1000, 999_983]),
            rng.pick(&[1, 3, 7, 10, 999, 1000, 1001, 60_000, 3_600_000]),
        ),
        _ => {
            // C × W = 2^53 exactly; W ≤ 2^42 keeps the Rust ns arithmetic in u64,
            // C < 2^32 keeps the Rust sliding-window state (u32 counts) exact.
            let k = match alg {
                Algorithm::TokenBucket => rng.range(11, 40),
                Algorithm::SlidingWindow => rng.range(11, 31),
            };
            (1u64 << k, 1u64 << (53 - k))
        }
    };
    LimitSpec {
        requests,
        window_ms,
        algorithm: alg,
    }
}

#[derive(Default, Debug)]
struct Tally {
    calls: u64,
    limits: u64,
    allowed: u64,
    denied: u64,
    mismatches: Vec<String>,
}

async fn run_differential(algorithms: &[Algorithm], seed: u64, cases: u64) -> Tally {
    let redis = common::redis();
    let mut config = Config::single("127.0.0.1:0".parse().unwrap(), redis.url());
    config.redis_timeout = Duration::from_secs(5);
    let app = ratelimit_gateway::build(&config).unwrap();
    let limiter: &Limiter = &app.limiter;
    assert!(
        limiter
            .store()
            .wait_connected(Duration::from_secs(15))
            .await
    );

    let mut rng = Rng(seed);
    let mut tally = Tally::default();
    for case in 0..cases {
        let n_limits = rng.range(1, 3) as usize;
        let specs: Vec<LimitSpec> = (0..n_limits)
            .map(|_| {
                let alg = rng.pick(algorithms);
                gen_limit(&mut rng, alg)
            })
            .collect();
        let max_w = specs.iter().map(|s| s.window_ms).max().unwrap_or(1);
        let max_c = specs.iter().map(|s| s.requests).max().unwrap_or(1);
        // Half the cases carry the cost on the bucket (a rule's own cost),
        // with a different request cost that must then be ignored.
        let on_bucket = rng.range(0, 1) == 1;
        let req = |cost: u64| CheckRequest {
            version: 1,
            domain: format!("diff-{seed}-{case}"),
            cost: if on_bucket { 1 + cost % 7 } else { cost },
            buckets: vec![BucketSpec {
                key: "k".to_string(),
                tag: "t".to_string(),
                cost: on_bucket.then_some(cost),
                limits: specs.clone(),
            }],
            quotas: vec![],
        };
        let mut now_ms: u64 = 1_700_000_000_000 + rng.range(0, 10_000_000_000);
        let mut states: Vec<Option<u128>> = vec![None; n_limits];
        let steps = rng.range(1, 60);
        for step in 0..steps {
            // Mostly small steps, some bursts at one instant, some long gaps,
            // a few steps back in time.
            now_ms = match rng.range(0, 19) {
                0..=4 => now_ms,
                5..=14 => now_ms + rng.range(0, (max_w / 4).max(1)),
                15..=17 => now_ms + rng.range(0, max_w.saturating_mul(2).min(1 << 44)),
                18 => now_ms + rng.range(0, 3),
                _ => now_ms.saturating_sub(rng.range(0, (max_w / 10).clamp(1, 1 << 40))),
            };
            // Keep now_ms × 10^6 (the Rust side's ns) well inside u64.
            if now_ms > 12_000_000_000_000 {
                break;
            }
            let cost = match rng.range(0, 9) {
                0..=5 => 1,
                6..=8 => rng.range(1, max_c.min(1 << 40)),
                _ => rng.range(1, max_c.saturating_add(2).min(1 << 53)),
            };
            let lua = limiter.check_at(&req(cost), Some(now_ms)).await.unwrap();
            tally.calls += 1;
            let mut rust = Vec::with_capacity(n_limits);
            for (spec, state) in specs.iter().zip(&states) {
                // The protocol has no burst: burst = capacity.
                let limit = Limit::new(spec.requests, spec.window_ms * MS);
                rust.push(rust_check(
                    spec.algorithm,
                    &limit,
                    *state,
                    now_ms * MS,
                    cost,
                ));
            }
            let all = rust.iter().all(|c| c.allowed);
            if lua.allowed != all {
                tally.mismatches.push(format!(
                    "case {case} step {step}: overall allowed lua={} rust={all} (specs {specs:?}, now {now_ms}, cost {cost})",
                    lua.allowed
                ));
            }
            for (i, (r, l)) in rust.iter().zip(&lua.buckets[0].limits).enumerate() {
                tally.limits += 1;
                if r.allowed {
                    tally.allowed += 1;
                } else {
                    tally.denied += 1;
                }
                let want = (
                    r.allowed,
                    r.remaining,
                    r.reset_ns.div_ceil(MS),
                    r.retry_after_ns.div_ceil(MS),
                );
                let got = (l.allowed, l.remaining, l.reset_ms, l.retry_after_ms);
                if want != got {
                    tally.mismatches.push(format!(
                        "case {case} step {step} limit {i} {:?}: rust (allowed, remaining, reset_ms, retry_ms) = {want:?}, lua = {got:?}; state {:?}, now_ms {now_ms}, cost {cost}",
                        specs[i], states[i]
                    ));
                }
            }
            if all {
                for (s, r) in states.iter_mut().zip(&rust) {
                    *s = Some(r.new_state);
                }
            }
        }
    }
    tally
}

fn report(name: &str, seed: u64, t: &Tally) {
    eprintln!(
        "{name} (seed {seed}): {} calls, {} limit checks ({} allowed, {} denied), {} mismatches",
        t.calls,
        t.limits,
        t.allowed,
        t.denied,
        t.mismatches.len()
    );
    for m in t.mismatches.iter().take(20) {
        eprintln!("  {m}");
    }
    assert!(
        t.mismatches.is_empty(),
        "{name}: Lua and Rust disagree (seed {seed})"
    );
    assert!(
        t.allowed > 0 && t.denied > 0,
        "{name}: the generator must exercise both outcomes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_token_bucket_matches_rust() {
    let seed = env_u64("RLGW_DIFF_SEED", 0x5EED_0001);
    let cases = env_u64("RLGW_DIFF_CASES", 300);
    let t = run_differential(&[Algorithm::TokenBucket], seed, cases).await;
    report("token bucket", seed, &t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_sliding_window_matches_rust() {
    let seed = env_u64("RLGW_DIFF_SEED", 0x5EED_0002);
    let cases = env_u64("RLGW_DIFF_CASES", 300);
    let t = run_differential(&[Algorithm::SlidingWindow], seed, cases).await;
    report("sliding window", seed, &t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_mixed_limits_all_or_nothing_match_rust() {
    let seed = env_u64("RLGW_DIFF_SEED", 0x5EED_0003);
    let cases = env_u64("RLGW_DIFF_CASES", 200);
    let t = run_differential(
        &[Algorithm::TokenBucket, Algorithm::SlidingWindow],
        seed,
        cases,
    )
    .await;
    report("mixed", seed, &t);
}
