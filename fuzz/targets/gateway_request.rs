//! `gateway_request`: the gateway's `POST /v1/check` and `POST /v1/lease` body parsers and
//! validators (`ratelimit_gateway::protocol::parse_check` and `parse_lease`, the protocol
//! crate's) on any bytes, then the policy's resolution of what they accept (a fixed policy:
//! `gateway_answer`'s configuration). They must
//! never panic; a body they accept must pass validation, and must come back the same after
//! a serialize/parse round trip.

use ratelimit_gateway::policy::{self, Policy};
use ratelimit_gateway::protocol;
use ratelimit_gateway::reload::Source;

thread_local! {
    static POLICY: Policy = policy::parse(&[Source {
        path: "fuzz.json".into(),
        bytes: crate::gateway_answer::CONFIG.as_bytes().to_vec(),
    }])
    .expect("the fixed policy parses");
}

pub fn run(data: &[u8]) {
    match protocol::parse_check(data) {
        Ok(req) => {
            assert_eq!(protocol::validate_check(&req), Ok(()));
            let again = serde_json::to_vec(&req).expect("a CheckRequest serializes");
            assert_eq!(
                protocol::parse_check(&again).as_ref(),
                Ok(&req),
                "round trip"
            );
            // Whatever the policy resolves stays within it.
            if let Ok(r) = POLICY.with(|p| p.resolve_check(&req)) {
                assert_eq!(r.buckets.len(), req.buckets.len());
                assert!(r.buckets.len() <= 2 && r.quotas.len() <= 1, "{r:?}");
                for b in &r.buckets {
                    assert!(b.cost <= 1 && !b.limits.is_empty(), "{b:?}");
                }
            }
        }
        Err(e) => assert!(!e.is_empty(), "an error must say something"),
    }
    match protocol::parse_lease(data) {
        Ok(req) => {
            assert_eq!(protocol::validate_lease(&req), Ok(()));
            let again = serde_json::to_vec(&req).expect("a LeaseRequest serializes");
            assert_eq!(
                protocol::parse_lease(&again).as_ref(),
                Ok(&req),
                "round trip"
            );
            if let Ok(r) = POLICY.with(|p| p.resolve_lease(&req)) {
                // Half of the smallest limit (2 per second): 1 token at most.
                assert!(r.want <= 1, "{r:?}");
            }
        }
        Err(e) => assert!(!e.is_empty(), "an error must say something"),
    }
}
