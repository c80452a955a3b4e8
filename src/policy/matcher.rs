//! Request predicates (`match`), compiled once at configure time: each
//! condition is one comparison or one scan of what it reads, patterns are
//! compiled here and never on a request.

use crate::config::{HostPattern, Match, MetadataPath, ValueMatch};
use crate::policy::fields;
use crate::policy::request::{self, HeaderId, PropertyId, Reads, RequestInfo};
use ratelimit_config::condition::{compile_pattern, host_of, Pattern};

/// A compiled [`Match`]: every present condition must hold.
#[derive(Debug, Clone, Default)]
pub struct Matcher {
    path_prefix: Option<Vec<u8>>,
    path_exact: Option<Vec<u8>>,
    methods: Option<Vec<Vec<u8>>>,
    headers: Vec<(HeaderId, Vec<u8>)>,
    /// The other conditions, cheapest first; empty for most rules, which
    /// then pay one length check for them.
    more: Vec<Condition>,
}

/// One condition beyond path, method and headers.
#[derive(Debug, Clone)]
enum Condition {
    /// The `:authority` header's host matches.
    Host(HeaderId, HostPattern),
    /// A property (route name, route or dynamic metadata) is this string.
    Equals(PropertyId, Vec<u8>),
    /// A query parameter is present (`None`) or has this decoded value.
    Query(Vec<u8>, Option<Vec<u8>>),
    /// A cookie (in the `cookie` header) is present or has this decoded value.
    Cookie(HeaderId, Vec<u8>, Option<Vec<u8>>),
    /// The host (port stripped) matches a case-insensitive pattern whole.
    HostRegex(HeaderId, Option<Pattern>),
    /// The path (without query) matches a pattern whole.
    PathRegex(Option<Pattern>),
    /// The inner match fails.
    Not(Box<Matcher>),
    /// One of the inner matches holds.
    Any(Vec<Matcher>),
}

fn exact(v: &ValueMatch) -> Option<Vec<u8>> {
    match v {
        ValueMatch::Present => None,
        ValueMatch::Exact(s) => Some(s.as_bytes().to_vec()),
    }
}

/// A pattern the configuration's validation already compiled; should it
/// fail here all the same, `None`: the condition never holds, rather than always.
fn pattern(p: &str, case_insensitive: bool) -> Option<Pattern> {
    compile_pattern(p, case_insensitive).ok()
}

impl Matcher {
    /// Compiles `m`, registering the headers and properties it reads with `reads`.
    // Kept out of Plan::compile: V8 holds memory superlinear in a wasm
    // function's size (BENCHMARKS.md, "Where the memory goes").
    #[inline(never)]
    pub fn compile(m: &Match, reads: &mut impl Reads) -> Self {
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
                .map(|(name, value)| (reads.header(name), value.as_bytes().to_vec()))
                .collect(),
            more: Self::more(m, reads),
        }
    }

    #[inline(never)]
    fn more(m: &Match, reads: &mut impl Reads) -> Vec<Condition> {
        let mut out = Vec::new();
        if let Some(host) = m.host.as_deref().and_then(|h| HostPattern::parse(h).ok()) {
            out.push(Condition::Host(reads.header(request::AUTHORITY), host));
        }
        if let Some(route) = &m.route {
            let id = reads.property(request::route_name_path());
            out.push(Condition::Equals(id, route.as_bytes().to_vec()));
        }
        let metadata = m
            .route_metadata
            .iter()
            .map(|(p, v)| {
                (
                    p,
                    v,
                    request::route_metadata_path as fn(&[String]) -> Vec<String>,
                )
            })
            .chain(
                m.metadata
                    .iter()
                    .map(|(p, v)| (p, v, request::metadata_path as fn(&[String]) -> Vec<String>)),
            );
        for (path, value, property) in metadata {
            if let Ok(path) = MetadataPath::parse(path) {
                let id = reads.property(property(&path.0));
                out.push(Condition::Equals(id, value.as_bytes().to_vec()));
            }
        }
        for (name, v) in &m.query {
            out.push(Condition::Query(name.as_bytes().to_vec(), exact(v)));
        }
        for (name, v) in &m.cookie {
            let id = reads.header(request::COOKIE);
            out.push(Condition::Cookie(id, name.as_bytes().to_vec(), exact(v)));
        }
        if let Some(p) = &m.host_regex {
            out.push(Condition::HostRegex(
                reads.header(request::AUTHORITY),
                pattern(p, true),
            ));
        }
        if let Some(p) = &m.path_regex {
            out.push(Condition::PathRegex(pattern(p, false)));
        }
        if let Some(not) = &m.not {
            out.push(Condition::Not(Box::new(Matcher::compile(not, reads))));
        }
        if let Some(any) = &m.any {
            out.push(Condition::Any(
                any.iter().map(|m| Matcher::compile(m, reads)).collect(),
            ));
        }
        out
    }

    /// Marks the headers this matcher reads (`:method` and `:path` included).
    pub fn reads(&self, mark: &mut impl FnMut(HeaderId)) {
        if self.methods.is_some() {
            mark(request::METHOD);
        }
        if self.path_prefix.is_some() || self.path_exact.is_some() {
            mark(request::PATH);
        }
        self.headers.iter().for_each(|(id, _)| mark(*id));
        for c in &self.more {
            match c {
                Condition::Host(id, _) | Condition::HostRegex(id, _) => mark(*id),
                Condition::Cookie(id, _, _) => mark(*id),
                Condition::Query(..) | Condition::PathRegex(_) => mark(request::PATH),
                Condition::Equals(..) => {}
                Condition::Not(m) => m.reads(mark),
                Condition::Any(ms) => ms.iter().for_each(|m| m.reads(mark)),
            }
        }
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
            && (self.more.is_empty() || self.more.iter().all(|c| c.holds(req)))
    }
}

/// Whether a decoded value is there and, when `want` says, equal to it.
fn value_holds(found: Option<fields::Decoded<'_>>, want: &Option<Vec<u8>>) -> bool {
    match (found, want) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(v), Some(w)) => v.eq(w.iter().copied()),
    }
}

impl Condition {
    #[inline(never)]
    fn holds(&self, req: &RequestInfo) -> bool {
        match self {
            Condition::Host(id, host) => req.header(*id).is_some_and(|a| host.matches(host_of(a))),
            Condition::Equals(id, value) => req.property(*id) == Some(value.as_slice()),
            Condition::Query(name, want) => {
                let query = fields::query_of(req.header(request::PATH).unwrap_or_default());
                value_holds(fields::query_param(query, name), want)
            }
            Condition::Cookie(id, name, want) => {
                let found = req.header(*id).and_then(|h| fields::cookie(h, name));
                value_holds(found, want)
            }
            Condition::HostRegex(id, re) => req
                .header(*id)
                .and_then(|a| std::str::from_utf8(host_of(a)).ok())
                .zip(re.as_ref())
                .is_some_and(|(h, re)| re.is_match(h)),
            Condition::PathRegex(re) => std::str::from_utf8(req.path())
                .ok()
                .zip(re.as_ref())
                .is_some_and(|(p, re)| re.is_match(p)),
            Condition::Not(m) => !m.matches(req),
            Condition::Any(ms) => ms.iter().any(|m| m.matches(req)),
        }
    }
}

#[cfg(test)]
#[path = "matcher_tests.rs"]
mod tests;
