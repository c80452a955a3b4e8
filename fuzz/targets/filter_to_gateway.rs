//! `filter_to_gateway`: the two ends of the gateway protocol against each other. For the
//! `key` target's configurations (global rules keyed on client, IP, path and a header, and a
//! quota) and a hostile request:
//!
//! - every `POST /v1/check` body the filter builds (`callout::encode_request`) must be
//!   accepted by the gateway's parser (`protocol::parse_check`) and resolved by a gateway
//!   whose policy is the same configuration (`policy::Policy::resolve_check`) into the
//!   filter's keys, tags, costs, limits and quota amounts; a body the gateway refuses with
//!   400 is a gateway failure for the filter (failure mode, and a step towards opening the
//!   circuit);
//! - every in-range answer the gateway can send for it (`protocol::CheckResponse`, with the
//!   limits it enforced) must be read by the filter (`callout::parse_answer`) without
//!   clamping and without a policy mismatch.
//!
//! Input: as for `key`, then the figures of the answer.

use crate::input::Input;
use crate::{key, request_gen};
use ratelimit_gateway::policy::{self, Policy};
use ratelimit_gateway::protocol;
use ratelimit_gateway::reload::Source;
use ratelimit_wasm::global::callout;
use ratelimit_wasm::policy::plan::Plan;

thread_local! {
    /// The gateway's policy for each `key` setup: its own configuration.
    static POLICIES: Vec<Policy> = (0..8u8)
        .map(|b| {
            key::with_setup(b, |setup| {
                policy::parse(&[Source {
                    path: "key.json".into(),
                    bytes: setup.config.as_bytes().to_vec(),
                }])
                .expect("the key configuration is a valid policy")
            })
        })
        .collect();
}

pub fn run(data: &[u8]) {
    let mut inp = Input::new(data);
    let b = inp.u8();
    POLICIES.with(|policies| {
        let policy = &policies[usize::from(b % 8)];
        key::with_setup(b, |setup| run_with(&setup.plan, policy, &mut inp));
    });
}

fn run_with(plan: &Plan, policy: &Policy, inp: &mut Input) {
    let req = request_gen::request(plan, inp);
    let eval = plan.evaluate(&req);
    if eval.global.is_empty() && eval.quotas.is_empty() {
        return;
    }
    let body = callout::encode_request(plan, &eval.global, &eval.quotas, None);
    let refused = |e: String| -> ! {
        let text = String::from_utf8_lossy(&body);
        let head: String = text.chars().take(400).collect();
        panic!(
            "the gateway refuses the filter's check ({e}); body of {} bytes: {head}…",
            body.len()
        )
    };
    let parsed = protocol::parse_check(&body).unwrap_or_else(|e| refused(e));
    let resolved = policy.resolve_check(&parsed).unwrap_or_else(|e| refused(e));
    assert_eq!(resolved.domain, plan.domain);
    assert_eq!(resolved.buckets.len(), eval.global.len());
    for (got, want) in resolved.buckets.iter().zip(&eval.global) {
        // The gateway derives the tag from the key: the filter's, except for
        // a hashed key (`<rule>#<hash>`), whose parts it cannot read.
        let name = &plan.rules[want.rule].name;
        let tag = match want.key.strip_prefix(name.as_str()) {
            Some(rest) if rest.starts_with('#') => want.key.as_str(),
            _ => want.tag.as_str(),
        };
        assert_eq!(
            (got.key.as_str(), got.tag.as_str()),
            (want.key.as_str(), tag)
        );
        assert_eq!(got.cost, want.cost);
        let limits = plan.limits(want.rule, want.variant);
        assert_eq!(got.limits.len(), limits.len());
        for (l, (limit, secs)) in got.limits.iter().zip(limits) {
            assert_eq!((l.requests, l.window_ms), (limit.capacity, secs * 1000));
            assert_eq!(l.algorithm.name(), plan.rules[want.rule].algorithm.name());
        }
    }
    assert_eq!(resolved.quotas.len(), eval.quotas.len());
    for (got, want) in resolved.quotas.iter().zip(&eval.quotas) {
        assert_eq!((got.limit, got.amount), (want.limit, want.amount));
        assert_eq!(got.period, plan.quotas[want.quota].period);
    }

    // Any in-range answer of the gateway is read as it is.
    let mut all = true;
    let buckets = resolved
        .buckets
        .iter()
        .map(|b| protocol::BucketResult {
            limits: b
                .limits
                .iter()
                .map(|l| {
                    let allowed = inp.below(3) != 0;
                    all &= allowed;
                    protocol::LimitResult {
                        requests: l.requests,
                        window_ms: l.window_ms,
                        algorithm: l.algorithm,
                        in_flight: l.in_flight,
                        allowed,
                        remaining: inp.u64() % (l.requests + 1),
                        reset_ms: inp.u64() % (2 * l.window_ms + 1),
                        retry_after_ms: if allowed {
                            0
                        } else {
                            1 + inp.u64() % (2 * l.window_ms)
                        },
                    }
                })
                .collect(),
            watch: b.watch,
            stage: None,
        })
        .collect();
    let quotas = resolved
        .quotas
        .iter()
        .map(|q| {
            let allowed = inp.below(3) != 0;
            all &= allowed;
            protocol::QuotaResult {
                limit: q.limit,
                period: q.period,
                allowed,
                remaining: inp.u64() % (q.limit + 1),
                reset_ms: inp.u64() % (31 * 86_400_000 + 1),
            }
        })
        .collect();
    let answer = protocol::CheckResponse {
        version: protocol::VERSION,
        allowed: all,
        buckets,
        quotas,
    };
    let json = serde_json::to_vec(&answer).expect("a CheckResponse serializes");
    let read = callout::parse_answer(plan, &eval.global, &eval.quotas, Some(b"200"), &json)
        .unwrap_or_else(|e| panic!("the filter refuses a gateway answer ({e}): {answer:?}"));
    assert_eq!((read.clamped, read.mismatch), (0, false), "{answer:?}");
}
