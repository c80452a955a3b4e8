//! What a response cost, read from its body as it streams: a [`Meter`]
//! (terms: a JSON Pointer's value times a weight, summed and capped) and
//! the streaming JSON scanner that finds their values in bounded state.

pub mod json;
pub mod meter;
pub mod path;

pub use meter::{Meter, Slot, Term, Usage, MAX_PATHS};
pub use path::Path;
