//! How to count, whatever is counted: the token bucket and the sliding
//! window behind one [`algorithm`] interface, the bounded [`table`] of
//! buckets in shared data (its layout, placement and encoding), the
//! direct-mapped [`slots`] of per-bucket state (leases, the deny cache), the one
//! read-modify-CAS helper [`update::update`] that every other shared-data
//! writer goes through, the all-or-nothing charge of a request's buckets
//! ([`limiter`]), the bounded concurrency slots of the `concurrent` limits
//! ([`in_flight`]: taken per request, released at its end, reclaimed at a
//! deadline), and the [`store`] trait over Envoy's shared data. Nothing
//! here knows how a configuration is compiled: the charge reads rules
//! through [`limiter::Rules`], which the policy's plan implements.

pub mod algorithm;
pub mod in_flight;
pub mod limiter;
pub mod sliding_window;
pub mod slots;
pub mod store;
pub mod table;
pub mod token_bucket;
pub mod update;
