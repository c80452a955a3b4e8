//! The plugin's JSON configuration, its own crate so that the filter, the
//! gateway, the protocol and the CLI read it with the same code; the first
//! stop of every change to what a user can write: the [`schema`] (every field, its type and default), the
//! [`validate`] and [`validate_global`] checks that refuse a bad field by its
//! path, the text `syntax` rules for values that reach headers and keys, and
//! the [`duration`] strings (`"1s"`, `"1m"`). [`parse`] is the one entry: bytes
//! in, a validated [`Config`] out. The [`vocab`]ularies and the [`bounds`]
//! shared with the wire protocol are defined here, once. It depends on no other crate of
//! the workspace; the filter's policy compiles what it accepts.
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

pub mod bounds;
pub mod condition;
pub mod duration;
pub mod key;
mod read;
pub mod schema;
mod syntax;
pub mod usage;
pub mod validate;
mod validate_cost;
pub mod validate_global;
mod validate_usage;
pub mod vocab;

pub use condition::{HostPattern, MetadataPath, ValueMatch};
pub use key::KeyPart;
pub use schema::*;
pub use syntax::MAX_URI_LEN;
pub use usage::{CostFrom, JsonPointer, Reserve, ReserveFrom, StatusMatch, UsagePreset, UsageTerm};
pub use validate::{graduated_tokens, parse, MAX_QUOTA, MAX_SHARE};
pub use validate_global::MAX_GLOBAL_PRODUCT;
pub use vocab::{Algorithm, Period, RlsAlgorithm};

#[cfg(test)]
mod tests;
