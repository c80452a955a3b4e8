//! `filter_to_gateway`: the two ends of the gateway protocol against each other. For the
//! `key` target's configurations (global rules keyed on client, IP, path and a header, and a
//! quota) and a hostile request:
//!
//! - every `POST /v1/check` body the filter builds (`callout::encode_request`) must be
//!   accepted by the gateway's parser (`ratelimit_gateway::protocol::parse`) and carry the
//!   filter's keys, tags, costs and limits; a body the gateway refuses with 400 is a
//!   gateway failure for the filter (failure mode, and a step towards opening the circuit);
//! - every in-range answer the gateway can send (`protocol::CheckResponse`) must be read
//!   by the filter (`callout::parse_answer`) without clamping.
//!
//! Input: as for `key`, then the figures of the answer.

use crate::input::Input;
use crate::{key, request_gen};
use ratelimit_gateway::protocol;
use ratelimit_wasm::callout;
use ratelimit_wasm::plan::Plan;

pub fn run(data: &[u8]) {
    let mut inp = Input::new(data);
    let b = inp.u8();
    key::with_setup(b, |setup| run_with(&setup.plan, &mut inp));
}

fn run_with(plan: &Plan, inp: &mut Input) {
    let req = request_gen::request(plan, inp);
    let eval = plan.evaluate(&req);
    if eval.global.is_empty() && eval.quotas.is_empty() {
        return;
    }
    let body = callout::encode_request(plan, eval.cost, &eval.global, &eval.quotas);
    let parsed = protocol::parse(&body).unwrap_or_else(|e| {
        let text = String::from_utf8_lossy(&body);
        let head: String = text.chars().take(400).collect();
        panic!(
            "the gateway refuses the filter's check ({e}); body of {} bytes: {head}…",
            body.len()
        )
    });
    assert_eq!(parsed.domain, plan.domain);
    assert_eq!(parsed.cost, eval.cost);
    assert_eq!(parsed.buckets.len(), eval.global.len());
    for (got, want) in parsed.buckets.iter().zip(&eval.global) {
        assert_eq!(
            (got.key.as_str(), got.tag.as_str()),
            (want.key.as_str(), want.tag.as_str())
        );
        assert_eq!(got.cost_in(parsed.cost), want.cost);
        let limits = plan.limits(want.rule, want.variant);
        assert_eq!(got.limits.len(), limits.len());
        for (l, (limit, secs)) in got.limits.iter().zip(limits) {
            assert_eq!((l.requests, l.window_ms), (limit.capacity, secs * 1000));
            assert_eq!(l.algorithm.name(), plan.rules[want.rule].algorithm.name());
        }
    }

    // Any in-range answer of the gateway is read as it is.
    let mut all = true;
    let buckets = parsed
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
        })
        .collect();
    let quotas = parsed
        .quotas
        .iter()
        .map(|q| {
            let allowed = inp.below(3) != 0;
            all &= allowed;
            protocol::QuotaResult {
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
    assert_eq!(read.clamped, 0, "{answer:?}");
}
