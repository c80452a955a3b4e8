//! A JSON Pointer (RFC 6901) into a response body, split and unescaped once
//! when the meter is built, so the scanner compares raw key bytes.

/// The most segments a [`Path`] may have: the scanner keeps one frame per
/// segment, so this bounds its state.
pub const MAX_SEGMENTS: usize = MAX_POINTER_SEGMENTS;

/// The longest segment a [`Path`] may have, in bytes: the scanner keeps at
/// most this many bytes (plus one) of a key.
pub const MAX_SEGMENT_BYTES: usize = MAX_SEGMENT_LEN;

/// A JSON Pointer (RFC 6901), already split and unescaped (`~1` → `/`,
/// `~0` → `~`): `"/usage/total_tokens"` is `[b"usage", b"total_tokens"]`,
/// `""` is the whole document (no segments).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Path(pub Vec<Vec<u8>>);

use crate::config::usage::{JsonPointer, MAX_POINTER_SEGMENTS, MAX_SEGMENT_LEN};

impl Path {
    /// Parses a JSON Pointer with the configuration's parser (the one that
    /// validates `cost_from`): at most [`MAX_SEGMENTS`] segments of at most
    /// [`MAX_SEGMENT_BYTES`] bytes each.
    pub fn parse(s: &str) -> Result<Path, String> {
        JsonPointer::parse(s).map(|p| Path::from(&p))
    }

    /// Whether the path is within the bounds [`Path::parse`] enforces (the
    /// field is public, so a path may have been built by hand): a path
    /// outside them is never found.
    pub fn within_bounds(&self) -> bool {
        self.0.len() <= MAX_SEGMENTS && self.0.iter().all(|s| s.len() <= MAX_SEGMENT_BYTES)
    }
}

impl From<&JsonPointer> for Path {
    fn from(p: &JsonPointer) -> Path {
        Path(p.0.iter().map(|s| s.as_bytes().to_vec()).collect())
    }
}

/// The array index a segment names: `0` or decimal digits without a leading
/// zero (RFC 6901); anything else never matches inside an array.
pub(crate) fn array_index(segment: &[u8]) -> Option<u64> {
    match segment {
        [] => None,
        [b'0'] => Some(0),
        [b'0', ..] => None,
        _ => segment.iter().try_fold(0u64, |n, &b| {
            let digit = b.checked_sub(b'0').filter(|d| *d <= 9)?;
            n.checked_mul(10)?.checked_add(u64::from(digit))
        }),
    }
}
