//! ratelimit-wasm: rate limiting for Envoy and Istio as a proxy-wasm filter.
//!
//! The request's path through the crate: [`config`] → [`plan`] ([`matcher`],
//! [`key`]) → [`limiter`] ([`token_bucket`] in the [`table`] of shared data)
//! → [`decide`] → [`headers`] and [`problem`]. Everything but `filter` is plain
//! Rust, tested on the host; `filter` is the thin layer over the proxy-wasm host.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]
#![warn(missing_docs)]

pub mod algorithm;
pub mod callout;
pub mod circuit;
pub mod config;
pub mod decide;
pub mod duration;
pub mod headers;
pub mod key;
pub mod lease;
pub mod limiter;
pub mod matcher;
pub mod metrics;
pub mod plan;
pub mod problem;
pub mod request;
pub mod sliding_window;
pub mod store;
pub mod table;
pub mod token_bucket;

#[cfg(target_arch = "wasm32")]
mod filter;
