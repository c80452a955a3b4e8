//! Limits shared by every proxy, decided by the gateway: the callout's
//! bodies and the distrustful reading of its answers ([`callout`]), the
//! circuit breaker in front of it, shared by every worker ([`circuit`]), and
//! lease mode, where a proxy spends a batch of a global bucket's tokens
//! locally ([`lease`]), and the deny cache that answers a bucket the gateway
//! denied until its wait is over ([`deny_cache`]), and the settlements of
//! costs read from responses on their way to it ([`outbox`]), and the
//! checks that wait to go together in one call ([`coalesce`]). Pure: the
//! host layer only dispatches the callouts.
//! Open this folder to change the wire protocol or the failure handling.

pub mod callout;
pub mod circuit;
pub mod coalesce;
pub mod deny_cache;
pub mod lease;
pub mod outbox;
