//! `gateway_request`: the gateway's `POST /v1/check` body parser and validator
//! (`ratelimit_gateway::protocol::parse`, which runs `validate`) on any bytes. It must never
//! panic; a body it accepts must pass `validate`, and must come back the same after a
//! serialize/parse round trip.

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
}
