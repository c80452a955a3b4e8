//! ratelimit-wasm: rate limiting for Envoy and Istio as a proxy-wasm filter.
//!
//! The request's path through the crate, one folder per stage:
//! [`config`] (the JSON a user writes) → [`policy`] (compiled once; per
//! request: which rules match, which buckets) → [`limits`] (count them in the
//! shared-data table) → [`global`] (the gateway's callout, circuit and
//! leases) → [`respond`] (headers and problem bodies), with [`decide`] running
//! the phases of one request; [`usage`] reads what a response cost from its
//! body as it streams. Everything but `host` is plain Rust, tested on
//! the host; `host.rs` is the thin layer over the proxy-wasm host and the only
//! file that names `proxy_wasm`, with its pure per-VM helpers in [`vm`].
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

/// The plugin configuration, its own crate (`config/`) shared with the
/// gateway and the CLI.
pub use ratelimit_config as config;
pub mod decide;
pub mod global;
pub mod limits;
pub mod metrics;
pub mod policy;
pub mod respond;
pub mod usage;
pub mod vm;

#[cfg(target_arch = "wasm32")]
mod host;
