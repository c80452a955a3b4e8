//! The HTTP listener and what both listeners share: the `/v1/*` and health
//! routes ([`server`]), each connection's place and deadline ([`conn`]),
//! TLS ([`tls`]) and the shared Redis health probe ([`health`]).

pub mod conn;
pub mod health;
pub mod server;
pub mod tls;
