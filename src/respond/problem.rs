//! RFC 9457 problem details for the filter's own answers.

use serde::Serialize;

/// Media type of problem bodies.
pub const CONTENT_TYPE: &str = "application/problem+json";

/// Problem type of a 503: the generic one, since HTTP's status says it all.
pub const UNAVAILABLE_TYPE: &str = "about:blank";

#[derive(Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    title: &'a str,
    status: u16,
    detail: String,
    #[serde(rename = "violated-policies", skip_serializing_if = "Option::is_none")]
    violated_policies: Option<&'a [&'a str]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    upgrade_url: Option<&'a str>,
}

impl Problem<'_> {
    fn render(&self) -> String {
        // Serialising plain strings and numbers cannot fail; keep a valid body regardless.
        serde_json::to_string(self).unwrap_or_else(|_| format!("{{\"status\":{}}}", self.status))
    }
}

/// The body of a 429.
pub fn too_many_requests(problem_type: &str, retry_after_secs: u64, violated: &[&str]) -> String {
    Problem {
        kind: problem_type,
        title: "Too Many Requests",
        status: 429,
        detail: format!("Rate limit exceeded. Retry after {retry_after_secs} seconds."),
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
        detail: format!("Rate limit service unavailable. Retry after {retry_after_secs} seconds."),
        violated_policies: None,
        upgrade_url: None,
    }
    .render()
}

#[cfg(test)]
mod tests {
    use super::*;

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
