//! What a response cost, read from its body as it streams: a [`Meter`]
//! (terms: a JSON Pointer's value times a weight, summed and capped) and
//! the [`Scan`] of one body, fed chunk by chunk in bounded state, plain JSON
//! (`json.rs`, over `segments.rs`) or server-sent events
//! (`sse.rs`, [`Framing`]); [`Preset`] has the terms of the LLM APIs whose
//! responses report their token usage. `request.rs` reads the request
//! body before the request is decided: a reservation (`max_tokens`) and the
//! rewrite that asks a stream for its usage.

pub mod json;
pub mod meter;
pub mod path;
pub mod preset;
pub mod request;
pub mod scan;
pub mod segments;
pub mod sse;

pub use meter::{Meter, Slot, Term, Usage, MAX_PATHS};
pub use path::Path;
pub use preset::Preset;
pub use scan::{Framing, Scan};

#[cfg(test)]
mod tests;
