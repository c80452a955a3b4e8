//! What a response costs: terms (a path's value times a weight), their sum
//! and its cap, and the outcome a finished scan reports.

use super::path::Path;

/// The most paths a [`Meter`] may use in all its terms together: the scanner
/// tracks them as bits of one `u64`. Paths past this (and paths outside
/// [`Path::within_bounds`]) are never found.
pub const MAX_PATHS: usize = 64;

/// One term of a cost: the value at the first of `any_of` that the document
/// (or SSE event) has, times `weight`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Term {
    /// The places the value may be, in order of preference.
    pub any_of: Vec<Path>,
    /// What one unit of the value costs.
    pub weight: u64,
}

/// What a response costs: the weighted sum of terms, capped at `max`;
/// bodies are scanned up to `scan_limit` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meter {
    /// Every term must be found for the usage to be known.
    pub terms: Vec<Term>,
    /// The most a response may cost.
    pub max: u64,
    /// The most body bytes scanned; a longer body is [`Usage::OverLimit`].
    pub scan_limit: u64,
}

/// The result when the body ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// Every term was found: the weighted sum (saturating), capped at
    /// `max`; `capped` says the cap applied.
    Found {
        /// What the response costs.
        cost: u64,
        /// Whether the sum exceeded `max` (and `cost` is `max`).
        capped: bool,
    },
    /// A term's value was not found, the JSON was malformed or truncated,
    /// a value was not a non-negative integer, or the meter has no terms.
    Missing,
    /// The body was longer than `scan_limit`.
    OverLimit,
}

/// What a document (or SSE event) holds at one path. `null` counts as
/// [`Slot::Absent`]: OpenAI streams send `"usage": null` until the last
/// chunk, and a path that holds null is treated alike in both framings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The path is not in the document, or holds `null`.
    Absent,
    /// A non-negative integer (saturated at `u64::MAX`).
    Value(u64),
    /// Anything else: a string, a fraction, an exponent, a negative
    /// number, `true`/`false`, an object or an array.
    Invalid,
}

impl Meter {
    /// Every path of every term, in order: a path's index here is its bit in
    /// the scanner's masks.
    pub(crate) fn paths(&self) -> impl Iterator<Item = &Path> + Clone {
        self.terms.iter().flat_map(|t| t.any_of.iter())
    }

    /// Each term's slot in one document: the first of its paths the
    /// document has (`slots` indexed as [`Meter::paths`]), or absent.
    pub(crate) fn pick<'a>(&'a self, slots: &'a [Slot]) -> impl Iterator<Item = Slot> + 'a {
        let mut first = 0;
        self.terms.iter().map(move |term| {
            let mine = slots.get(first..).unwrap_or_default();
            first += term.any_of.len();
            mine.iter()
                .take(term.any_of.len())
                .copied()
                .find(|s| *s != Slot::Absent)
                .unwrap_or(Slot::Absent)
        })
    }

    /// The usage of the terms' values (one slot per term): found when every
    /// one is a value.
    pub(crate) fn total(&self, values: impl Iterator<Item = Slot>) -> Usage {
        let mut sum = 0u64;
        let mut any = false;
        for (term, value) in self.terms.iter().zip(values) {
            let Slot::Value(v) = value else {
                return Usage::Missing;
            };
            sum = sum.saturating_add(term.weight.saturating_mul(v));
            any = true;
        }
        match (any, sum > self.max) {
            (false, _) => Usage::Missing,
            (true, true) => Usage::Found {
                cost: self.max,
                capped: true,
            },
            (true, false) => Usage::Found {
                cost: sum,
                capped: false,
            },
        }
    }
}
