//! The two per-rule algorithms behind one interface.

use crate::limits::sliding_window;
use crate::limits::token_bucket::{Check, Limit};

/// How a rule's limits count: the protocol crate's vocabulary, written once
/// for the filter and the gateway.
pub use ratelimit_protocol::Algorithm;

/// The arithmetic of each algorithm, on the filter's buckets.
pub trait Counting {
    /// Checks `cost` against `limit` for a bucket in `state` (`None`: never used).
    fn check(self, limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> Check;
    /// When a bucket in `state` holds nothing worth keeping (ns).
    fn full_at_ns(self, limit: &Limit, state: u128) -> u64;
    /// `state` with `cost`, charged at `charged_at_ns`, given back.
    fn refund(self, limit: &Limit, state: u128, cost: u64, charged_at_ns: u64) -> u128;
    /// `state` with `cost` more spent at `now_ns` whatever it holds: a
    /// settlement may overdraw the bucket.
    fn force(self, limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> u128;
}

impl Counting for Algorithm {
    fn check(self, limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> Check {
        match self {
            Algorithm::TokenBucket => limit.check(state, now_ns, cost),
            Algorithm::SlidingWindow => sliding_window::check(limit, state, now_ns, cost),
        }
    }

    fn full_at_ns(self, limit: &Limit, state: u128) -> u64 {
        match self {
            Algorithm::TokenBucket => limit.full_at_ns(state),
            Algorithm::SlidingWindow => sliding_window::full_at_ns(limit, state),
        }
    }

    // The sliding window needs the charge's time to find the window that holds it.
    fn refund(self, limit: &Limit, state: u128, cost: u64, charged_at_ns: u64) -> u128 {
        match self {
            Algorithm::TokenBucket => state.saturating_sub(limit.increment(cost)),
            Algorithm::SlidingWindow => sliding_window::refund(limit, state, cost, charged_at_ns),
        }
    }

    fn force(self, limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> u128 {
        match self {
            Algorithm::TokenBucket => limit.force(state, now_ns, cost),
            Algorithm::SlidingWindow => sliding_window::force(limit, state, now_ns, cost),
        }
    }
}
