//! JSON text for the filter's answers, written as `serde_json` writes it:
//! the constant part of a 429 body is written once when the plan is compiled
//! ([`too_many_head`]), and `respond::problem` writes the rest per answer.

/// Appends `s` as a JSON string, escaped as `serde_json` escapes it: `"`,
/// `\\` and control characters only (short forms where JSON has them).
pub fn json_string(out: &mut String, s: &str) {
    out.push('"');
    // Nearly every string has nothing to escape: one copy.
    if !s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        out.push_str(s);
        out.push('"');
        return;
    }
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        let short = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0..=0x1f => "",
            _ => continue,
        };
        out.push_str(s.get(start..i).unwrap_or_default());
        if short.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            for nibble in [b >> 4, b & 0xf] {
                out.push(char::from(
                    HEX.get(usize::from(nibble)).copied().unwrap_or(b'0'),
                ));
            }
        } else {
            out.push_str(short);
        }
        start = i + 1;
    }
    out.push_str(s.get(start..).unwrap_or_default());
    out.push('"');
}

/// `s` as a JSON string of its own, quotes included.
pub fn quoted(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    json_string(&mut q, s);
    q
}

/// Title of a 429's problem body.
pub const TOO_MANY_TITLE: &str = "Too Many Requests";

/// Start of a 429's `detail`, before the wait in seconds.
pub const TOO_MANY_DETAIL: &str = "Rate limit exceeded. Retry after ";

/// A 429 body of problem type `problem_type` up to the wait in its `detail`:
/// everything in it that does not depend on the request.
pub fn too_many_head(problem_type: &str) -> String {
    let mut out = String::with_capacity(96 + problem_type.len());
    out.push_str("{\"type\":");
    json_string(&mut out, problem_type);
    out.push_str(",\"title\":");
    json_string(&mut out, TOO_MANY_TITLE);
    out.push_str(",\"status\":429,\"detail\":\"");
    // The detail's prefix has nothing to escape.
    out.push_str(TOO_MANY_DETAIL);
    out
}
