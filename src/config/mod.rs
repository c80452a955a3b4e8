//! The plugin's JSON configuration, the first stop of every change to what a
//! user can write: the [`schema`] (every field, its type and default), the
//! [`validate`] and [`validate_global`] checks that refuse a bad field by its
//! path, the text `syntax` rules for values that reach headers and keys, and
//! the [`duration`] strings (`"1s"`, `"1m"`). [`parse`] is the one entry: bytes
//! in, a validated [`Config`] out. Nothing here depends on the rest of the
//! crate; the policy compiles what this module accepts.

pub mod duration;
mod read;
pub mod schema;
mod syntax;
pub mod validate;
mod validate_cost;
pub mod validate_global;

pub use schema::*;
pub use syntax::MAX_URI_LEN;
pub use validate::{parse, KEY_PARTS, MAX_QUOTA, MAX_SHARE};
pub use validate_global::MAX_GLOBAL_PRODUCT;

#[cfg(test)]
mod tests;
