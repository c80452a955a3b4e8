//! Differential test: the Lua scripts (`check.lua`, `refund.lua` and
//! `lease.lua`, run by a real Redis) and the filter's Rust buckets
//! (`ratelimit_wasm::limits::token_bucket` and `ratelimit_wasm::limits::sliding_window`, with
//! their refunds) must give the same decisions — allowed, remaining, reset and
//! retry-after — on the same generated sequences, clock steps back included.
//!
//! The script normally takes its time from Redis `TIME`; here every call goes
//! through the gateway's limiter on a `FixedClock` (its time is ARGV[2]
//! of `check.lua`), so both sides see the same whole-millisecond times. The
//! Rust side runs in nanoseconds (`now_ms × 10^6`, `window_ms × 10^6`) and its
//! reset / retry are rounded up to ms.
//!
//! Seeded generator: `RLGW_DIFF_SEED` (default fixed) and `RLGW_DIFF_CASES`
//! reproduce or widen a run.

mod common;
use common::Rng;

use std::sync::Arc;
use std::time::Duration;

use ratelimit_gateway::clock::FixedClock;
use ratelimit_gateway::orchestrate::Limiter;
use ratelimit_gateway::policy::{Resolved, ResolvedBucket, ResolvedLease};
use ratelimit_gateway::protocol::{Algorithm, Limit as LimitSpec};
use ratelimit_gateway::redis::keys::{self, Group};
use ratelimit_gateway::redis::script;
use ratelimit_gateway::{App, Config};
use ratelimit_wasm::limits::token_bucket::{Check, Limit};

const MS: u64 = 1_000_000;

/// The seed and the number of cases of a run: `RLGW_DIFF_SEED` and
/// `RLGW_DIFF_CASES`, or these defaults.
fn seed_and_cases(seed: u64, cases: u64) -> (u64, u64) {
    (
        env_u64("RLGW_DIFF_SEED", seed),
        env_u64("RLGW_DIFF_CASES", cases),
    )
}

/// Both algorithms, for the runs that mix them.
const BOTH: &[Algorithm] = &[Algorithm::TokenBucket, Algorithm::SlidingWindow];

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
            ratelimit_wasm::limits::sliding_window::check(limit, state, now_ns, cost)
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
        in_flight: false,
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

/// Holds each Rust check against the Lua script's answer for the same limit
/// (times in whole ms, rounded up as the gateway reports them); a difference
/// is a mismatch described by `context(limit index)`.
fn compare_limits(
    tally: &mut Tally,
    rust: &[Check],
    lua: &[ratelimit_gateway::protocol::LimitResult],
    context: impl Fn(usize) -> String,
) {
    for (i, (r, l)) in rust.iter().zip(lua).enumerate() {
        tally.limits += 1;
        let want = (
            r.allowed,
            r.remaining,
            r.reset_ns.div_ceil(MS),
            r.retry_after_ns.div_ceil(MS),
        );
        let got = (l.allowed, l.remaining, l.reset_ms, l.retry_after_ms);
        if want != got {
            tally.mismatches.push(format!(
                "{}: rust (allowed, remaining, reset_ms, retry_ms) = {want:?}, lua = {got:?}",
                context(i)
            ));
        }
    }
}

/// The gateway's app on `redis` (5 s Redis round trips), its configuration,
/// once it has reached Redis.
async fn connected_app(redis: &testkit::redis::Redis) -> (Config, std::sync::Arc<App>) {
    let mut config = Config::single(
        "127.0.0.1:0".parse().unwrap(),
        redis.url(),
        vec![common::policy_dir()],
    );
    config.redis_timeout = Duration::from_secs(5);
    let app = ratelimit_gateway::build(&config).unwrap();
    assert!(
        app.limiter
            .store()
            .wait_connected(Duration::from_secs(15))
            .await
    );
    (config, app)
}

async fn run_differential(algorithms: &[Algorithm], seed: u64, cases: u64) -> Tally {
    let redis = common::redis();
    let (_, app) = connected_app(&redis).await;
    let limiter: &Limiter = &app.limiter;

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
        // Version 1 could carry a request cost besides the bucket's; every
        // bucket now has its own. The draw stays, so the seeds' cases do.
        let _ = rng.range(0, 1);
        // The Limiter's input, built directly: windows in ms and products up
        // to 2^53, beyond what a policy (whole seconds) can say.
        let req = |cost: u64| Resolved {
            domain: format!("diff-{seed}-{case}"),
            buckets: vec![ResolvedBucket {
                key: "k".to_string(),
                tag: "t".to_string(),
                cost,
                limits: specs.clone(),
                debt: 0,
                ..Default::default()
            }],
            quotas: vec![],
            reservation: None,
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
            let lua = limiter
                .with_clock(Arc::new(FixedClock(now_ms)))
                .check(&req(cost))
                .await
                .unwrap();
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
            for r in &rust {
                if r.allowed {
                    tally.allowed += 1;
                } else {
                    tally.denied += 1;
                }
            }
            compare_limits(&mut tally, &rust, &lua.buckets[0].limits, |i| {
                format!(
                    "case {case} step {step} limit {i} {:?}; state {:?}, now_ms {now_ms}, cost {cost}",
                    specs[i], states[i]
                )
            });
            store_rust(&specs, &mut states, &rust);
        }
    }
    tally
}

/// The states the filter's limiter stores after a check: every new state when
/// all passed; else only a token bucket's bound (a TAT more than a full bucket
/// ahead, from a clock that stepped back), as `check.lua` writes it.
fn store_rust(specs: &[LimitSpec], states: &mut [Option<u128>], rust: &[Check]) {
    let all = rust.iter().all(|c| c.allowed);
    for ((s, r), spec) in states.iter_mut().zip(rust).zip(specs) {
        let bounded = spec.algorithm == Algorithm::TokenBucket
            && !r.allowed
            && s.is_some_and(|t| t > r.new_state);
        if all || bounded {
            *s = Some(r.new_state);
        }
    }
}

/// The filter's refund of `cost` charged at `charged_at_ms` in one limit.
/// The gateway's and the filter's `Algorithm` are one type (ratelimit-protocol).
fn rust_refund(alg: Algorithm, limit: &Limit, state: u128, cost: u64, charged_at_ms: u64) -> u128 {
    use ratelimit_wasm::limits::algorithm::Counting;
    alg.refund(limit, state, cost, charged_at_ms * MS)
}

/// `lease.lua` over the Rust token bucket: give back `returned` (the filter's
/// refund), grant the whole tokens every limit has (a check of cost 0 reads
/// them), charge them as a check of that cost. With nothing granted, a limit
/// whose use the give-back or the bound changed is stored as read at now (the
/// script writes `now + use`, or deletes a full one).
/// Returns (granted, per limit (remaining, reset_ms, retry_ms)).
fn rust_lease(
    limits: &[Limit],
    states: &mut [Option<u128>],
    now_ms: u64,
    want: u64,
    returned: u64,
) -> (u64, Vec<(u64, u64, u64)>) {
    let now = now_ms * MS;
    let given: Vec<Option<u128>> = limits
        .iter()
        .zip(states.iter())
        .map(|(l, s)| s.map(|t| t.saturating_sub(l.increment(returned))))
        .collect();
    let free: Vec<Check> = limits
        .iter()
        .zip(&given)
        .map(|(l, s)| l.check(*s, now, 0))
        .collect();
    let granted = limits
        .iter()
        .zip(&free)
        .map(|(l, c)| l.capacity.min(c.remaining))
        .fold(want, u64::min);
    let mut out = Vec::with_capacity(limits.len());
    for (i, l) in limits.iter().enumerate() {
        if granted > 0 {
            let c = l.check(given[i], now, granted);
            assert!(c.allowed, "a grant within the free tokens passes");
            states[i] = Some(c.new_state);
            out.push((c.remaining, c.reset_ns.div_ceil(MS), 0));
            continue;
        }
        let c0 = &free[i];
        let now_scaled = l.check(None, now, 0).new_state;
        let read_before = states[i].map_or(now_scaled, |t| t.max(now_scaled));
        if c0.new_state != read_before {
            states[i] = (c0.new_state != now_scaled).then_some(c0.new_state);
        }
        let retry = if c0.remaining < 1 {
            l.check(given[i], now, 1).retry_after_ns.div_ceil(MS)
        } else {
            0
        };
        out.push((c0.remaining, c0.reset_ns.div_ceil(MS), retry));
    }
    (granted, out)
}

/// Checks, refunds of earlier charges and (token buckets only) leases on one
/// bucket, with the clock stepping forward and back across window
/// boundaries: after each step the Lua answers must equal the Rust ones.
async fn run_refunds_and_leases(
    algorithms: &[Algorithm],
    leases: bool,
    seed: u64,
    cases: u64,
) -> Tally {
    let redis = common::redis();
    let (config, app) = connected_app(&redis).await;
    let prefix = config.key_prefix.clone();
    let limiter: &Limiter = &app.limiter;
    let mut rng = Rng(seed);
    let mut tally = Tally::default();
    for case in 0..cases {
        let n_limits = rng.range(1, 3) as usize;
        let specs: Vec<LimitSpec> = (0..n_limits)
            .map(|_| {
                let alg = rng.pick(algorithms);
                let (requests, window_ms) = (rng.range(1, 12), rng.range(1, 2000));
                LimitSpec {
                    requests,
                    window_ms,
                    algorithm: alg,
                    in_flight: false,
                }
            })
            .collect();
        let limits: Vec<Limit> = specs
            .iter()
            .map(|s| Limit::new(s.requests, s.window_ms * MS))
            .collect();
        let max_w = specs.iter().map(|s| s.window_ms).max().unwrap_or(1);
        let domain = format!("refund-{seed}-{case}");
        let req = |cost: u64| Resolved {
            domain: domain.clone(),
            buckets: vec![ResolvedBucket {
                key: "k".to_string(),
                tag: "t".to_string(),
                cost,
                limits: specs.clone(),
                debt: 0,
                ..Default::default()
            }],
            quotas: vec![],
            reservation: None,
        };
        let mut now_ms: u64 = 1_700_000_000_000 + rng.range(0, 10_000_000);
        let mut states: Vec<Option<u128>> = vec![None; n_limits];
        // Charges not yet refunded: (charged at, cost).
        let mut charges: Vec<(u64, u64)> = Vec::new();
        let mut lease_held = 0u64;
        for step in 0..rng.range(1, 80) {
            now_ms = match rng.range(0, 9) {
                0..=1 => now_ms,
                2..=6 => now_ms + rng.range(0, max_w / 2 + 1),
                7 => now_ms + rng.range(0, 3 * max_w),
                // Back, often across a window boundary.
                _ => now_ms - rng.range(1, 2 * max_w),
            };
            let what = rng.range(0, 9);
            if what <= 2 && !charges.is_empty() {
                let (at, cost) =
                    charges.swap_remove(rng.range(0, charges.len() as u64 - 1) as usize);
                let group = Group {
                    limits: keys::limit_keys(&prefix, &req(cost)),
                    quotas: vec![],
                };
                let (k, args) = script::refund_args(&group, at, &FixedClock(now_ms), None);
                let _: i64 = limiter
                    .store()
                    .eval(script::refund(), &k, &args, "refund")
                    .await
                    .unwrap();
                for ((s, l), spec) in states.iter_mut().zip(&limits).zip(&specs) {
                    *s = s.map(|t| rust_refund(spec.algorithm, l, t, cost, at));
                }
                continue;
            }
            if leases && what >= 7 {
                let want = rng.range(1, 6);
                let returned = if rng.range(0, 1) == 1 {
                    lease_held.min(rng.range(0, 4))
                } else {
                    0
                };
                let lreq = ResolvedLease {
                    domain: domain.clone(),
                    key: "k".to_string(),
                    tag: "t".to_string(),
                    limits: specs.clone(),
                    want,
                    returned,
                    ttl_ms: 3_600_000,
                };
                // It gives back at most its last grant: within its ledger.
                let lua = limiter
                    .with_clock(Arc::new(FixedClock(now_ms)))
                    .lease(&lreq, "differential")
                    .await
                    .unwrap();
                let (granted, rust) = rust_lease(&limits, &mut states, now_ms, want, returned);
                lease_held = granted;
                tally.calls += 1;
                let got: Vec<(u64, u64, u64)> = lua
                    .limits
                    .iter()
                    .map(|l| (l.remaining, l.reset_ms, l.retry_after_ms))
                    .collect();
                if (lua.granted, &got) != (granted, &rust) {
                    tally.mismatches.push(format!(
                        "case {case} step {step} lease want {want} return {returned}: rust {:?}, lua {:?}; specs {specs:?}, now {now_ms}",
                        (granted, &rust),
                        (lua.granted, &got)
                    ));
                }
                if granted > 0 {
                    tally.allowed += 1;
                } else {
                    tally.denied += 1;
                }
                continue;
            }
            let cost = rng.range(1, 4);
            let lua = limiter
                .with_clock(Arc::new(FixedClock(now_ms)))
                .check(&req(cost))
                .await
                .unwrap();
            let rust: Vec<Check> = specs
                .iter()
                .zip(&limits)
                .zip(&states)
                .map(|((spec, l), s)| rust_check(spec.algorithm, l, *s, now_ms * MS, cost))
                .collect();
            tally.calls += 1;
            compare_limits(&mut tally, &rust, &lua.buckets[0].limits, |i| {
                format!(
                    "case {case} step {step} limit {i} {:?}; state {:?}, now_ms {now_ms}, cost {cost}",
                    specs[i], states[i]
                )
            });
            let all = rust.iter().all(|c| c.allowed);
            if all {
                tally.allowed += 1;
                charges.push((now_ms, cost));
            } else {
                tally.denied += 1;
            }
            store_rust(&specs, &mut states, &rust);
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
    let (seed, cases) = seed_and_cases(0x5EED_0001, 300);
    let t = run_differential(&[Algorithm::TokenBucket], seed, cases).await;
    report("token bucket", seed, &t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_sliding_window_matches_rust() {
    let (seed, cases) = seed_and_cases(0x5EED_0002, 300);
    let t = run_differential(&[Algorithm::SlidingWindow], seed, cases).await;
    report("sliding window", seed, &t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_mixed_limits_all_or_nothing_match_rust() {
    let (seed, cases) = seed_and_cases(0x5EED_0003, 200);
    let t = run_differential(BOTH, seed, cases).await;
    report("mixed", seed, &t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_refunds_match_rust_across_clock_steps() {
    let (seed, cases) = seed_and_cases(0x5EED_0004, 200);
    let t = run_refunds_and_leases(BOTH, false, seed, cases).await;
    report("refunds", seed, &t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lua_leases_match_rust_token_bucket_across_clock_steps() {
    let (seed, cases) = seed_and_cases(0x5EED_0005, 200);
    let t = run_refunds_and_leases(&[Algorithm::TokenBucket], true, seed, cases).await;
    report("leases", seed, &t);
}
