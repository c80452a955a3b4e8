//! RFC 9457 problem details for the filter's own answers.
//!
//! Bodies are written by hand, byte for byte what `serde_json` writes for
//! [`Problem`] (a test holds the two equal): serde's formatter and `format!`
//! cost thousands of wasm instructions per 429 (BENCHMARKS.md, instructions
//! per decision).

/// Media type of problem bodies.
pub const MEDIA_TYPE: &str = "application/problem+json";

/// Problem type of a 503: the generic one, since HTTP's status says it all.
pub const UNAVAILABLE_TYPE: &str = "about:blank";

use crate::policy::json::json_string;
#[cfg(test)]
use crate::policy::json::{quoted, too_many_head};

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

/// The body of a 429 written at once: the oracle of the tests (the filter
/// writes it from the plan's compiled head, [`too_many_after`]).
#[cfg(test)]
pub fn too_many_requests(problem_type: &str, retry_after_secs: u64, violated: &[&str]) -> String {
    let quoted: Vec<String> = violated.iter().map(|n| quoted(n)).collect();
    too_many_after(
        &too_many_head(problem_type),
        retry_after_secs,
        quoted.iter().map(String::as_str),
    )
}

/// The body of a 429 whose constant part, [`too_many_head`], the plan
/// compiled once (`Plan::too_many_head`): only the wait and the names are
/// written per answer. `violated` are the names already written as JSON
/// strings (`RulePlan::name_json`): escaping them per answer scanned every
/// byte of every name.
pub fn too_many_after<'a>(
    head: &str,
    retry_after_secs: u64,
    violated: impl Iterator<Item = &'a str>,
) -> String {
    let mut n = itoa::Buffer::new();
    let secs = n.format(retry_after_secs);
    // Room for a few names: sizing it exactly took a second pass over them.
    let mut out = String::with_capacity(head.len() + secs.len() + 34 + 128);
    out.push_str(head);
    out.push_str(secs);
    out.push_str(" seconds.\",\"violated-policies\":[");
    for (i, name) in violated.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(name);
    }
    out.push_str("]}");
    out
}

/// The body of a 429 whose cost is above the capacity of a limit of rule
/// `rule` (`capacity`): waiting cannot help, so it promises no wait.
pub fn never_passes(
    problem_type: &str,
    cost: u64,
    rule: &str,
    capacity: u64,
    violated: &[&str],
) -> String {
    Problem {
        kind: problem_type,
        title: crate::policy::json::TOO_MANY_TITLE,
        status: 429,
        detail: format!(
            "This request costs {cost}, more than a limit of {rule} holds ({capacity}): \
             it can never pass."
        ),
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
    use crate::policy::json::{TOO_MANY_DETAIL, TOO_MANY_TITLE};
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

    proptest! {
        /// The 429 written from its compiled head is the whole body written at once.
        #[test]
        fn a_429_from_its_head_is_the_whole_body(
            kind in "\\PC*|[\\x00-\\x7f]*",
            secs in any::<u64>(),
            names in proptest::collection::vec("\\PC{0,8}|[\\x00-\\x7f]{0,8}", 0..3),
        ) {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let whole = Problem {
                kind: &kind,
                title: TOO_MANY_TITLE,
                status: 429,
                detail: retry_detail(TOO_MANY_DETAIL, secs),
                violated_policies: Some(&names),
                upgrade_url: None,
            };
            prop_assert_eq!(too_many_requests(&kind, secs, &names), whole.render());
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
