//! The terms of the LLM APIs whose responses report their token usage
//! (`cost_from.preset`): the pointers are the configuration's
//! ([`UsagePreset::terms`]), made into the scanner's terms here.

use super::meter::Term;
use super::path::Path;

/// An API whose responses report their token usage: the configuration's vocabulary.
pub use crate::config::UsagePreset as Preset;

/// The terms of `preset`: each the first of its pointers a document has,
/// and every one must be found.
pub fn terms(preset: Preset) -> Vec<Term> {
    preset
        .terms()
        .iter()
        .map(|(pointers, weight)| Term {
            // The pointers are the configuration's constants, each valid
            // (config::usage tests parse them all).
            any_of: pointers
                .iter()
                .filter_map(|p| Path::parse(p).ok())
                .collect(),
            weight: *weight,
        })
        .collect()
}
