//! RFC 9457 problem details for the filter's own answers.
//!
//! Bodies are written by hand, byte for byte what `serde_json` writes for
//! [`Problem`] (a test holds the two equal): serde's formatter and `format!`
//! cost thousands of wasm instructions per 429 (issue 14, Performance).

/// Media type of problem bodies.
pub const CONTENT_TYPE: &str = "application/problem+json";

/// Problem type of a 503: the generic one, since HTTP's status says it all.
pub const UNAVAILABLE_TYPE: &str = "about:blank";

#[cfg_attr(test, derive(serde::Serialize))]
struct Problem<'a> {
    #[cfg_attr(test, serde(rename = "type"))]
    kind: &'a str,
    title: &'a str,
    status: u16,
    detail: String,
    #[cfg_attr(
        test,
        serde(rename = "violated-policies", skip_serializing_if = "Option::is_none")
    )]
    violated_policies: Option<&'a [&'a str]>,
    #[cfg_attr(test, serde(skip_serializing_if = "Option::is_none"))]
    upgrade_url: Option<&'a str>,
}

impl Problem<'_> {
    fn render(&self) -> String {
        let names: usize = self
            .violated_policies
            .map_or(0, |v| v.iter().map(|n| n.len() + 3).sum());
        let url = self.upgrade_url.map_or(0, str::len);
        let mut out = String::with_capacity(
            96 + self.kind.len() + self.title.len() + self.detail.len() + names + url,
        );
        out.push_str("{\"type\":");
        json_string(&mut out, self.kind);
        out.push_str(",\"title\":");
        json_string(&mut out, self.title);
        out.push_str(",\"status\":");
        out.push_str(itoa::Buffer::new().format(self.status));
        out.push_str(",\"detail\":");
        json_string(&mut out, &self.detail);
        if let Some(names) = self.violated_policies {
            out.push_str(",\"violated-policies\":[");
            for (i, n) in names.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json_string(&mut out, n);
            }
            out.push(']');
        }
        if let Some(url) = self.upgrade_url {
            out.push_str(",\"upgrade_url\":");
            json_string(&mut out, url);
        }
        out.push('}');
        out
    }
}

/// Appends `s` as a JSON string, escaped as `serde_json` escapes it: `"`,
/// `\\` and control characters only (short forms where JSON has them).
fn json_string(out: &mut String, s: &str) {
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

/// `Rate limit exceeded. Retry after {secs} seconds.` without `format!`.
fn retry_detail(prefix: &str, secs: u64) -> String {
    let mut n = itoa::Buffer::new();
    let secs = n.format(secs);
    let mut d = String::with_capacity(prefix.len() + secs.len() + 9);
    d.push_str(prefix);
    d.push_str(secs);
    d.push_str(" seconds.");
    d
}

/// The body of a 429.
pub fn too_many_requests(problem_type: &str, retry_after_secs: u64, violated: &[&str]) -> String {
    Problem {
        kind: problem_type,
        title: "Too Many Requests",
        status: 429,
        detail: retry_detail("Rate limit exceeded. Retry after ", retry_after_secs),
        violated_policies: Some(violated),
        upgrade_url: None,
    }
    .render()
}

/// The body of a 403 when a quota is spent: no `Retry-After` — waiting a few
/// seconds will not help; the period's end or an upgrade will.
pub fn quota_exhausted(
    problem_type: &str,
    quotas: &[&str],
    upgrade_url: &str,
    renews_in_secs: u64,
) -> String {
    Problem {
        kind: problem_type,
        title: "Quota Exhausted",
        status: 403,
        detail: format!(
            "Quota {} is used up; it renews in {renews_in_secs} seconds.",
            quotas.join(", ")
        ),
        violated_policies: Some(quotas),
        upgrade_url: Some(upgrade_url),
    }
    .render()
}

/// The body of a 503 when the rate-limit service failed and `failure_mode` is `closed`.
pub fn service_unavailable(retry_after_secs: u64) -> String {
    Problem {
        kind: UNAVAILABLE_TYPE,
        title: "Service Unavailable",
        status: 503,
        detail: retry_detail(
            "Rate limit service unavailable. Retry after ",
            retry_after_secs,
        ),
        violated_policies: None,
        upgrade_url: None,
    }
    .render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The hand-written body is exactly serde_json's, whatever the text.
        #[test]
        fn the_body_is_serde_jsons_byte_for_byte(
            kind in "\\PC*|[\\x00-\\x7f]*",
            name in "\\PC*|[\\x00-\\x7f]*",
            secs in any::<u64>(),
            url in proptest::option::of("[\\x00-\\x7f]*"),
            names in proptest::option::of(proptest::collection::vec("[\\x00-\\x7f]{0,8}", 0..3)),
        ) {
            let names: Option<Vec<&str>> = names.as_ref().map(|v| v.iter().map(String::as_str).collect());
            let p = Problem {
                kind: &kind,
                title: &name,
                status: 429,
                detail: retry_detail("Retry after ", secs),
                violated_policies: names.as_deref(),
                upgrade_url: url.as_deref(),
            };
            prop_assert_eq!(p.render(), serde_json::to_string(&p).unwrap());
        }
    }

    #[test]
    fn quota_body() {
        let v: serde_json::Value = serde_json::from_str(&quota_exhausted(
            "tag:x",
            &["monthly"],
            "https://e.com/up",
            86_400,
        ))
        .unwrap();
        assert_eq!(
            v,
            serde_json::json!({"type":"tag:x","title":"Quota Exhausted","status":403,
                "detail":"Quota monthly is used up; it renews in 86400 seconds.",
                "violated-policies":["monthly"],"upgrade_url":"https://e.com/up"})
        );
    }

    #[test]
    fn unavailable_body() {
        let v: serde_json::Value = serde_json::from_str(&service_unavailable(2)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"type":"about:blank","title":"Service Unavailable","status":503,
                "detail":"Rate limit service unavailable. Retry after 2 seconds."})
        );
    }

    #[test]
    fn body_has_every_field() {
        let body = too_many_requests("https://example.com/p", 7, &["per-client", "uploads"]);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "type": "https://example.com/p",
                "title": "Too Many Requests",
                "status": 429,
                "detail": "Rate limit exceeded. Retry after 7 seconds.",
                "violated-policies": ["per-client", "uploads"]
            })
        );
    }
}
