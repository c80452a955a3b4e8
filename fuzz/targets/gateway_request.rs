//! `gateway_request`: the gateway's `POST /v1/check` and `POST /v1/lease` body parsers and
//! validators (`ratelimit_gateway::protocol::parse` and `parse_lease`) on any bytes. They must
//! never panic; a body they accept must pass validation, and must come back the same after
//! a serialize/parse round trip.

use ratelimit_gateway::protocol;

pub fn run(data: &[u8]) {
    match protocol::parse(data) {
        Ok(req) => {
            assert_eq!(protocol::validate(&req), Ok(()));
            let again = serde_json::to_vec(&req).expect("a CheckRequest serializes");
            assert_eq!(protocol::parse(&again).as_ref(), Ok(&req), "round trip");
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
        }
        Err(e) => assert!(!e.is_empty(), "an error must say something"),
    }
}
