//! The two per-rule algorithms behind one interface.

use crate::sliding_window;
use crate::token_bucket::{Check, Limit};
use serde::Deserialize;

/// How a rule's limits count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Token bucket (GCRA): bursts up to the limit, refilled continuously.
    #[default]
    TokenBucket,
    /// Sliding-window counter: about N in any window of length `per`.
    SlidingWindow,
}

impl Algorithm {
    /// The name used in configuration and on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::SlidingWindow => "sliding_window",
        }
    }

    /// Checks `cost` against `limit` for a bucket in `state` (`None`: never used).
    pub fn check(self, limit: &Limit, state: Option<u128>, now_ns: u64, cost: u64) -> Check {
        match self {
            Algorithm::TokenBucket => limit.check(state, now_ns, cost),
            Algorithm::SlidingWindow => sliding_window::check(limit, state, now_ns, cost),
        }
    }

    /// When a bucket in `state` holds nothing worth keeping (ns).
    pub fn full_at_ns(self, limit: &Limit, state: u128) -> u64 {
        match self {
            Algorithm::TokenBucket => limit.full_at_ns(state),
            Algorithm::SlidingWindow => sliding_window::full_at_ns(limit, state),
        }
    }

    /// `state` with `cost`, charged at `charged_at_ns`, given back. The sliding
    /// window needs the charge's time to find the window that holds it.
    pub fn refund(self, limit: &Limit, state: u128, cost: u64, charged_at_ns: u64) -> u128 {
        match self {
            Algorithm::TokenBucket => state.saturating_sub(limit.increment(cost)),
            Algorithm::SlidingWindow => sliding_window::refund(limit, state, cost, charged_at_ns),
        }
    }
}
