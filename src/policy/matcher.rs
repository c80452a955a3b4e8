//! Request predicates (`match`), compiled once at configure time.

use crate::config::Match;
use crate::policy::request::{HeaderId, RequestInfo};

/// A compiled [`Match`]: every present condition must hold.
#[derive(Debug, Clone, Default)]
pub struct Matcher {
    path_prefix: Option<Vec<u8>>,
    path_exact: Option<Vec<u8>>,
    methods: Option<Vec<Vec<u8>>>,
    headers: Vec<(HeaderId, Vec<u8>)>,
}

impl Matcher {
    /// Compiles `m`, registering the headers it reads through `header_id`.
    // Kept out of Plan::compile: V8 holds memory superlinear in a wasm
    // function's size (BENCHMARKS.md, "Where the memory goes").
    #[inline(never)]
    pub fn compile(m: &Match, mut header_id: impl FnMut(&str) -> HeaderId) -> Self {
        Matcher {
            path_prefix: m.path_prefix.as_ref().map(|p| p.as_bytes().to_vec()),
            path_exact: m.path_exact.as_ref().map(|p| p.as_bytes().to_vec()),
            methods: m
                .methods
                .as_ref()
                .map(|ms| ms.iter().map(|m| m.as_bytes().to_vec()).collect()),
            headers: m
                .headers
                .iter()
                .map(|(name, value)| (header_id(name), value.as_bytes().to_vec()))
                .collect(),
        }
    }

    /// The headers this matcher reads (`:method` and `:path` included).
    pub fn reads(&self) -> impl Iterator<Item = HeaderId> + '_ {
        let method = self
            .methods
            .is_some()
            .then_some(crate::policy::request::METHOD);
        let path = (self.path_prefix.is_some() || self.path_exact.is_some())
            .then_some(crate::policy::request::PATH);
        method
            .into_iter()
            .chain(path)
            .chain(self.headers.iter().map(|(id, _)| *id))
    }

    /// Whether the request satisfies every condition.
    pub fn matches(&self, req: &RequestInfo) -> bool {
        let path = req.path();
        if let Some(prefix) = &self.path_prefix {
            if !path.starts_with(prefix) {
                return false;
            }
        }
        if let Some(exact) = &self.path_exact {
            if path != exact.as_slice() {
                return false;
            }
        }
        if let Some(methods) = &self.methods {
            let method = req.method();
            if !methods.iter().any(|m| m.as_slice() == method) {
                return false;
            }
        }
        self.headers
            .iter()
            .all(|(id, value)| req.header(*id) == Some(value.as_slice()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn req(method: &str, path: &str, tenant: Option<&str>) -> RequestInfo {
        RequestInfo {
            headers: vec![
                Some(method.as_bytes().to_vec()),
                Some(path.as_bytes().to_vec()),
                tenant.map(|t| t.as_bytes().to_vec()),
            ],
            ..RequestInfo::default()
        }
    }

    #[test]
    fn all_conditions_must_hold() {
        let m = Match {
            path_prefix: Some("/upload".into()),
            methods: Some(vec!["POST".into()]),
            headers: BTreeMap::from([("x-tenant".to_string(), "a".to_string())]),
            ..Match::default()
        };
        let c = Matcher::compile(&m, |_| 2);
        assert!(c.matches(&req("POST", "/upload/x?y", Some("a"))));
        assert!(!c.matches(&req("GET", "/upload/x", Some("a"))));
        assert!(!c.matches(&req("POST", "/down", Some("a"))));
        assert!(!c.matches(&req("POST", "/upload", Some("b"))));
        assert!(!c.matches(&req("POST", "/upload", None)));
    }

    #[test]
    fn exact_path_ignores_the_query_and_empty_match_is_true() {
        let m = Match {
            path_exact: Some("/login".into()),
            ..Match::default()
        };
        let c = Matcher::compile(&m, |_| 2);
        assert!(c.matches(&req("GET", "/login?next=/", None)));
        assert!(!c.matches(&req("GET", "/login/x", None)));
        assert!(Matcher::default().matches(&req("GET", "/", None)));
    }
}
