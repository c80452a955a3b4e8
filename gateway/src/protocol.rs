//! The wire protocol between the filter and the gateway: the types, bounds
//! and validation of the `ratelimit-protocol` crate (written once, for both
//! sides), and what only the gateway answers.
//!
//! `POST /v1/check` takes a [`CheckRequest`] and answers 200 with a
//! [`CheckResponse`], 400 with an [`ErrorBody`] naming the field at fault
//! (of the body, or of the policy it names), 404 with one naming `domain`
//! when no policy has the domain, or 503 with an [`ErrorBody`] when Redis
//! fails or times out. `POST /v1/lease` takes a [`LeaseRequest`] and
//! answers 200 with a [`LeaseResponse`], or 400, 404 and 503 as a check does.

use serde::{Deserialize, Serialize};

pub use ratelimit_protocol::*;

/// The `error` of every 503: what failed in Redis (script SHA and line,
/// Redis' own message) is for the gateway's log, not for the caller.
pub const STORE_UNAVAILABLE: &str = "redis: unavailable";

/// `GET /healthz` answer body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// `ok` when Redis is up, else `unavailable`.
    pub status: String,
    /// `up` or `down`.
    pub redis: String,
}
