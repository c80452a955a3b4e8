//! A JSON Pointer (RFC 6901) into a response body, split and unescaped once
//! when the meter is built, so the scanner compares raw key bytes.

/// The most segments a [`Path`] may have: the scanner keeps one frame per
/// segment, so this bounds its state.
pub const MAX_SEGMENTS: usize = 16;

/// The longest segment a [`Path`] may have, in bytes: the scanner keeps at
/// most this many bytes (plus one) of a key.
pub const MAX_SEGMENT_BYTES: usize = 128;

/// A JSON Pointer (RFC 6901), already split and unescaped (`~1` → `/`,
/// `~0` → `~`): `"/usage/total_tokens"` is `[b"usage", b"total_tokens"]`,
/// `""` is the whole document (no segments).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Path(pub Vec<Vec<u8>>);

impl Path {
    /// Parses a JSON Pointer: empty, or `/`-separated segments with `~0` and
    /// `~1` the only escapes; at most [`MAX_SEGMENTS`] segments of at most
    /// [`MAX_SEGMENT_BYTES`] bytes each.
    pub fn parse(s: &str) -> Result<Path, String> {
        if s.is_empty() {
            return Ok(Path(Vec::new()));
        }
        let Some(rest) = s.strip_prefix('/') else {
            return Err(format!(
                "JSON pointer {s:?} must be empty or start with '/'"
            ));
        };
        let mut segments = Vec::new();
        for raw in rest.split('/') {
            if segments.len() == MAX_SEGMENTS {
                return Err(format!(
                    "JSON pointer {s:?} has more than {MAX_SEGMENTS} segments"
                ));
            }
            let segment = unescape(raw).ok_or_else(|| {
                format!("JSON pointer {s:?}: '~' must be followed by '0' or '1' in {raw:?}")
            })?;
            if segment.len() > MAX_SEGMENT_BYTES {
                return Err(format!(
                    "JSON pointer {s:?}: segment {raw:?} is longer than {MAX_SEGMENT_BYTES} bytes"
                ));
            }
            segments.push(segment);
        }
        Ok(Path(segments))
    }

    /// Whether the path is within the bounds [`Path::parse`] enforces (the
    /// field is public, so a path may have been built by hand): a path
    /// outside them is never found.
    pub fn within_bounds(&self) -> bool {
        self.0.len() <= MAX_SEGMENTS && self.0.iter().all(|s| s.len() <= MAX_SEGMENT_BYTES)
    }
}

/// One segment with `~1` → `/` and `~0` → `~`; `None` on any other `~`.
fn unescape(raw: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(raw.len());
    let mut bytes = raw.bytes();
    while let Some(b) = bytes.next() {
        out.push(match b {
            b'~' => match bytes.next()? {
                b'0' => b'~',
                b'1' => b'/',
                _ => return None,
            },
            _ => b,
        });
    }
    Some(out)
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
