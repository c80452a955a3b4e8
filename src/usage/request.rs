//! The request body, read before the request is decided: the reservation a
//! `cost_from.reserve` reads from it (`max_tokens`), and the body rewritten
//! so that an OpenAI-style stream reports its usage (`ensure_stream_usage`).
//!
//! The host holds at most `request_body_limit` bytes of it; a longer body is
//! never parsed ([`Body::TooLarge`]). A body that fits is parsed once with
//! serde_json (its recursion limit bounds the nesting), and a rewrite splices
//! the one member it adds into the original bytes: everything else (key
//! order, spacing, numbers as written) reaches the upstream as the client
//! sent it.

use serde_json::Value;

/// What the filter made of a request body.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// The request ended with its headers.
    Absent,
    /// Longer than the bound: passed on unread.
    TooLarge,
    /// Not a JSON document.
    NotJson,
    /// A JSON document.
    Json(Value),
}

impl Body {
    /// Reads `bytes`: `None` when the body went past the bound.
    pub fn parse(bytes: Option<&[u8]>) -> Body {
        match bytes {
            None => Body::TooLarge,
            Some(b) => serde_json::from_slice(b).map_or(Body::NotJson, Body::Json),
        }
    }
}

/// A reservation read from the body, or why the default applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    /// The value at the pointer, capped.
    Read(u64),
    /// No usable value: the body is absent, too large, not JSON, or its
    /// value is absent or not a whole number of at least 1.
    Default,
}

/// The reservation at `pointer` (split, unescaped) in `body`, capped at
/// `cap`. A whole number of at least 1 counts, however it is written (`500`,
/// `500.0`, `5e2`); one past `cap` (`1e308` too) reserves `cap`. Zero, a
/// negative or fractional number, a string, `null` and anything else
/// reserve the default: a client lowering its reservation only lowers what
/// is held while its response is under way, since the settlement charges
/// the real cost.
pub fn reserve(body: &Body, pointer: &[String], cap: u64) -> Reserved {
    let Body::Json(doc) = body else {
        return Reserved::Default;
    };
    let Some(Value::Number(n)) = lookup(doc, pointer) else {
        return Reserved::Default;
    };
    let whole = match (n.as_u64(), n.as_f64()) {
        (Some(u), _) => Some(u),
        // Past u64 (or written with a fraction or exponent): only a whole,
        // finite, positive value counts; `as` saturates past u64::MAX.
        (None, Some(f)) if f.is_finite() && f >= 1.0 && f.fract() == 0.0 => Some(f as u64),
        _ => None,
    };
    match whole {
        Some(0) | None => Reserved::Default,
        Some(v) => Reserved::Read(v.min(cap)),
    }
}

/// The value at `pointer` in `doc` (RFC 6901: an array index is `0` or
/// digits without a leading zero).
fn lookup<'a>(doc: &'a Value, pointer: &[String]) -> Option<&'a Value> {
    pointer.iter().try_fold(doc, |v, segment| match v {
        Value::Object(m) => m.get(segment),
        Value::Array(a) => {
            let i = super::path::array_index(segment.as_bytes())?;
            a.get(usize::try_from(i).ok()?)
        }
        _ => None,
    })
}

/// What `ensure_stream_usage` does to a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rewrite {
    /// Nothing to do: no stream asked for, or its usage already is.
    Unneeded,
    /// The body could not be read (too large, not JSON, or not an object
    /// whose `stream_options` is an object): passed on unchanged.
    Unchanged,
    /// The new body.
    Body(Vec<u8>),
}

const INCLUDE_USAGE: &str = "include_usage";
const STREAM_OPTIONS: &str = "stream_options";

/// Adds `"stream_options": {"include_usage": true}` to a request asking for
/// a stream (`"stream": true`) whose `stream_options.include_usage` is not
/// `true`: into an existing `stream_options` object, or as a new member.
/// An `include_usage` of any other value is replaced, since a client
/// turning it off would leave its stream without usage and its charge at
/// the reservation.
pub fn ensure_stream_usage(body: &Body, bytes: &[u8]) -> Rewrite {
    let doc = match body {
        Body::Json(doc) => doc,
        Body::Absent => return Rewrite::Unneeded,
        Body::TooLarge | Body::NotJson => return Rewrite::Unchanged,
    };
    let Value::Object(top) = doc else {
        return Rewrite::Unneeded;
    };
    if top.get("stream") != Some(&Value::Bool(true)) {
        return Rewrite::Unneeded;
    }
    let options = top.get(STREAM_OPTIONS);
    match options {
        None => {}
        Some(Value::Object(o)) if o.get(INCLUDE_USAGE) == Some(&Value::Bool(true)) => {
            return Rewrite::Unneeded;
        }
        Some(Value::Object(_)) => {}
        // `null` or another type: the upstream would refuse it anyway.
        Some(_) => return Rewrite::Unchanged,
    }
    splice(bytes, options.is_some()).map_or(Rewrite::Unchanged, Rewrite::Body)
}

/// The new bytes: `include_usage: true` set in the last `stream_options`
/// member (the one a JSON parser keeps), or a new member first in the
/// object. `None` when the text is not as its parse said (never, for bytes
/// serde_json read).
fn splice(bytes: &[u8], has_options: bool) -> Option<Vec<u8>> {
    let open = skip_ws(bytes, 0);
    let top = members(bytes, open)?;
    if !has_options {
        let member = format!("\"{STREAM_OPTIONS}\":{{\"{INCLUDE_USAGE}\":true}}");
        let comma = if top.is_empty() { "" } else { "," };
        return Some(insert(
            bytes,
            open + 1,
            &[member.as_bytes(), comma.as_bytes()],
        ));
    }
    let (_, value) = top.iter().rev().find(|(k, _)| k == STREAM_OPTIONS)?;
    let inner = members(bytes, value.start)?;
    match inner.iter().rev().find(|(k, _)| k == INCLUDE_USAGE) {
        Some((_, v)) => {
            let mut out = Vec::with_capacity(bytes.len() + 4);
            out.extend_from_slice(bytes.get(..v.start)?);
            out.extend_from_slice(b"true");
            out.extend_from_slice(bytes.get(v.end..)?);
            Some(out)
        }
        None => {
            let member = format!("\"{INCLUDE_USAGE}\":true");
            let comma = if inner.is_empty() { "" } else { "," };
            Some(insert(
                bytes,
                value.start + 1,
                &[member.as_bytes(), comma.as_bytes()],
            ))
        }
    }
}

fn insert(bytes: &[u8], at: usize, parts: &[&[u8]]) -> Vec<u8> {
    let (head, tail) = bytes.split_at(at.min(bytes.len()));
    let mut out = Vec::with_capacity(bytes.len() + parts.iter().map(|p| p.len()).sum::<usize>());
    out.extend_from_slice(head);
    for p in parts {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(tail);
    out
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// The members of the object whose `{` is at `open`: each key (unescaped)
/// and its value's span. Iterative: only the object's own level is split,
/// nested values are skipped by counting brackets.
fn members(b: &[u8], open: usize) -> Option<Vec<(String, std::ops::Range<usize>)>> {
    if b.get(open) != Some(&b'{') {
        return None;
    }
    let mut out = Vec::new();
    let mut i = skip_ws(b, open + 1);
    if b.get(i) == Some(&b'}') {
        return Some(out);
    }
    loop {
        let key_end = string_end(b, i)?;
        let raw = b.get(i..key_end)?;
        // Escaped keys are rare: read those with serde_json.
        let key = if raw.contains(&b'\\') {
            serde_json::from_slice::<String>(raw).ok()?
        } else {
            String::from_utf8(raw.get(1..raw.len().checked_sub(1)?)?.to_vec()).ok()?
        };
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(b, i + 1);
        let end = value_end(b, start)?;
        out.push((key, start..end));
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return Some(out),
            _ => return None,
        }
    }
}

/// The index after the string whose `"` is at `i`.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
}

/// The index after the value starting at `i`.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while !matches!(
                b.get(j),
                None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            ) {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
