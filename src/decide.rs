//! One request from headers to answer: match, key, limit, then what to send.
//! Pure: the host layer only fetches the request and carries out the verdict.

use crate::config::OnError;
use crate::headers;
use crate::key::BadInput;
use crate::limiter::{self, Decision, LimitError, Stats};
use crate::metrics::Metric;
use crate::plan::Plan;
use crate::problem;
use crate::request::RequestInfo;
use crate::store::SharedStore;

/// Header lines to send.
pub type HeaderLines = Vec<(&'static str, String)>;

/// What the filter does with the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Let it through and add these headers to the response.
    Pass(HeaderLines),
    /// Answer it here.
    Reject {
        /// HTTP status.
        status: u32,
        /// Response headers.
        headers: HeaderLines,
        /// Response body.
        body: String,
    },
}

/// The verdict and what to count and log about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// What to do.
    pub verdict: Verdict,
    /// Increments per [`Metric`], indexed by [`Metric::index`].
    pub counts: [u64; Metric::ALL.len()],
    /// A shared-data failure that `on_error` decided.
    pub error: Option<LimitError>,
    /// Odd input seen while building keys.
    pub bad_input: Vec<BadInput>,
}

/// Decides `req` at `now_ns` against the buckets in `store`.
pub fn decide(plan: &Plan, req: &RequestInfo, store: &impl SharedStore, now_ns: u64) -> Outcome {
    let eval = plan.evaluate(req);
    let mut counts = [0u64; Metric::ALL.len()];
    let mut add = |m: Metric, n: u64| {
        if let Some(c) = counts.get_mut(m.index()) {
            *c += n;
        }
    };
    if !eval.bad_input.is_empty() {
        add(Metric::BadInput, 1);
    }
    let mut stats = Stats::default();
    let mut error = None;
    let verdict = if eval.buckets.is_empty() {
        Verdict::Pass(Vec::new())
    } else {
        match limiter::check_and_consume(store, plan, &eval.buckets, eval.cost, now_ns, &mut stats)
        {
            Ok(Decision::Allowed(reports)) => {
                add(Metric::Allowed, 1);
                let lines = headers::closest(plan, &reports)
                    .map(|s| headers::render(plan.header_style, &s))
                    .unwrap_or_default();
                Verdict::Pass(lines)
            }
            Ok(Decision::Denied(reports)) => {
                add(Metric::Denied, 1);
                let shown = headers::binding(plan, &reports);
                let retry = shown.as_ref().map_or(1, |s| s.retry_after_secs);
                let mut lines = shown
                    .as_ref()
                    .map(|s| headers::render(plan.header_style, s))
                    .unwrap_or_default();
                let body = problem::too_many_requests(
                    &plan.problem_type,
                    retry,
                    &headers::violated(plan, &reports),
                );
                reject(&mut lines, retry, body)
            }
            Err(e) => {
                add(Metric::Errors, 1);
                error = Some(e);
                match plan.on_error {
                    OnError::Allow => Verdict::Pass(Vec::new()),
                    OnError::Deny => {
                        let body = problem::too_many_requests(&plan.problem_type, 1, &[]);
                        reject(&mut Vec::new(), 1, body)
                    }
                }
            }
        }
    };
    add(Metric::CasRetries, stats.cas_retries);
    add(Metric::Evictions, stats.evictions);
    add(Metric::CorruptState, stats.corrupt_sets);
    Outcome {
        verdict,
        counts,
        error,
        bad_input: eval.bad_input,
    }
}

fn reject(lines: &mut HeaderLines, retry_after: u64, body: String) -> Verdict {
    lines.push(("retry-after", retry_after.to_string()));
    lines.push(("content-type", problem::CONTENT_TYPE.to_string()));
    Verdict::Reject {
        status: 429,
        headers: std::mem::take(lines),
        body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::store::{MemoryStore, StoreError};

    const SEC: u64 = 1_000_000_000;
    const T0: u64 = 1_700_000_000 * SEC;

    fn plan(json: &str) -> Plan {
        Plan::compile(&config::parse(json.as_bytes()).unwrap(), [3; 16])
    }

    fn req(plan: &Plan, path: &str, client: Option<&str>) -> RequestInfo {
        let headers = plan
            .header_names
            .iter()
            .map(|n| match n.as_str() {
                ":method" => Some(b"GET".to_vec()),
                ":path" => Some(path.as_bytes().to_vec()),
                "x-client-id" => client.map(|c| c.as_bytes().to_vec()),
                _ => None,
            })
            .collect();
        RequestInfo {
            headers,
            source_address: Some(b"10.0.0.1:4000".to_vec()),
        }
    }

    fn header<'a>(lines: &'a HeaderLines, name: &str) -> &'a str {
        lines
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or("<absent>")
    }

    const FIVE: &str = r#"{"domain":"d","rules":[{"name":"per-client","key":["client"],"limits":[{"requests":5,"per":"1h"}]}],
        "costs":[{"match":{"path_prefix":"/search"},"cost":2}]}"#;

    #[test]
    fn counts_down_then_rejects_with_a_problem() {
        let p = plan(FIVE);
        let s = MemoryStore::default();
        for left in (0..5).rev() {
            let o = decide(&p, &req(&p, "/", Some("a")), &s, T0);
            let Verdict::Pass(h) = &o.verdict else {
                panic!("{o:?}")
            };
            assert_eq!(header(h, "x-ratelimit-remaining"), left.to_string());
            assert_eq!(header(h, "ratelimit-policy"), "\"per-client\";q=5;w=3600");
            assert_eq!(o.counts[Metric::Allowed.index()], 1);
        }
        let o = decide(&p, &req(&p, "/", Some("a")), &s, T0);
        let Verdict::Reject {
            status,
            headers,
            body,
        } = &o.verdict
        else {
            panic!("{o:?}")
        };
        assert_eq!(*status, 429);
        assert_eq!(header(headers, "retry-after"), "720");
        assert_eq!(header(headers, "content-type"), "application/problem+json");
        assert_eq!(header(headers, "x-ratelimit-remaining"), "0");
        assert_eq!(header(headers, "ratelimit"), "\"per-client\";r=0;t=3600");
        assert!(
            body.contains("\"detail\":\"Rate limit exceeded. Retry after 720 seconds.\""),
            "{body}"
        );
        assert!(body.contains("\"violated-policies\":[\"per-client\"]"));
        assert_eq!(o.counts[Metric::Denied.index()], 1);
        // Another client is untouched; the IP stands in for a client without an id.
        assert!(matches!(
            decide(&p, &req(&p, "/", Some("b")), &s, T0).verdict,
            Verdict::Pass(_)
        ));
        assert!(matches!(
            decide(&p, &req(&p, "/", None), &s, T0).verdict,
            Verdict::Pass(_)
        ));
    }

    #[test]
    fn cost_is_weighted() {
        let p = plan(FIVE);
        let s = MemoryStore::default();
        let o = decide(&p, &req(&p, "/search", Some("a")), &s, T0);
        let Verdict::Pass(h) = &o.verdict else {
            panic!()
        };
        assert_eq!(header(h, "x-ratelimit-remaining"), "3");
    }

    #[test]
    fn unmatched_requests_pass_without_headers() {
        let p = plan(
            r#"{"domain":"d","rules":[{"name":"u","match":{"path_prefix":"/upload"},"limits":[{"requests":1,"per":1}]}]}"#,
        );
        let o = decide(&p, &req(&p, "/other", None), &MemoryStore::default(), T0);
        assert_eq!(o.verdict, Verdict::Pass(Vec::new()));
        assert_eq!(o.counts, [0; Metric::ALL.len()]);
    }

    struct Broken;
    impl SharedStore for Broken {
        fn get(&self, _: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            Err(StoreError(10))
        }
        fn compare_and_set(&self, _: &str, _: &[u8], _: u32) -> Result<bool, StoreError> {
            Err(StoreError(10))
        }
    }

    #[test]
    fn store_failure_takes_on_error() {
        let allow = plan(FIVE);
        let o = decide(&allow, &req(&allow, "/", Some("a")), &Broken, T0);
        assert_eq!(o.verdict, Verdict::Pass(Vec::new()));
        assert_eq!(o.counts[Metric::Errors.index()], 1);
        assert_eq!(o.error, Some(LimitError::Store(StoreError(10))));
        let deny = plan(&FIVE.replace("\"domain\"", "\"on_error\":\"deny\",\"domain\""));
        let o = decide(&deny, &req(&deny, "/", Some("a")), &Broken, T0);
        let Verdict::Reject {
            status, headers, ..
        } = o.verdict
        else {
            panic!()
        };
        assert_eq!((status, header(&headers, "retry-after")), (429, "1"));
    }
}
