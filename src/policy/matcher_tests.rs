use super::*;
use serde_json::json;
use std::collections::BTreeMap;

/// The plan's registry in small: headers after `:method` and `:path`, and properties.
#[derive(Default)]
struct Names {
    headers: Vec<String>,
    properties: Vec<Vec<String>>,
}

impl Reads for Names {
    fn header(&mut self, name: &str) -> HeaderId {
        let name = name.to_ascii_lowercase();
        let i = self
            .headers
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| {
                self.headers.push(name);
                self.headers.len() - 1
            });
        i + 2
    }
    fn property(&mut self, path: Vec<String>) -> PropertyId {
        self.properties
            .iter()
            .position(|p| *p == path)
            .unwrap_or_else(|| {
                self.properties.push(path);
                self.properties.len() - 1
            })
    }
}

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

/// A matcher of `m` (JSON) with the request built from named headers and properties.
fn check(m: serde_json::Value, headers: &[(&str, &str)], props: &[(&[&str], &str)]) -> bool {
    let m: Match = serde_json::from_value(m).unwrap();
    let mut names = Names::default();
    let c = Matcher::compile(&m, &mut names);
    let mut all = vec![":method".to_string(), ":path".to_string()];
    all.extend(names.headers.iter().cloned());
    let named: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
    let mut r = RequestInfo::with_headers(&all, &named);
    for (path, value) in props {
        let path: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        if let Some(id) = names.properties.iter().position(|p| *p == path) {
            r = r.with_property(id, value.as_bytes());
        }
    }
    c.matches(&r)
}

#[test]
fn all_conditions_must_hold() {
    let m = Match {
        path_prefix: Some("/upload".into()),
        methods: Some(vec!["POST".into()]),
        headers: BTreeMap::from([("x-tenant".to_string(), "a".to_string())]),
        ..Match::default()
    };
    let c = Matcher::compile(&m, &mut Names::default());
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
    let c = Matcher::compile(&m, &mut Names::default());
    assert!(c.matches(&req("GET", "/login?next=/", None)));
    assert!(!c.matches(&req("GET", "/login/x", None)));
    assert!(Matcher::default().matches(&req("GET", "/", None)));
}

#[test]
fn host_ignores_case_and_port() {
    let exact = json!({"host": "api.example.com"});
    assert!(check(
        exact.clone(),
        &[(":authority", "API.example.com:443")],
        &[]
    ));
    assert!(check(
        exact.clone(),
        &[(":authority", "api.example.com")],
        &[]
    ));
    assert!(!check(
        exact.clone(),
        &[(":authority", "web.example.com")],
        &[]
    ));
    assert!(!check(exact, &[], &[]));
    let wild = json!({"host": "*.example.com"});
    assert!(check(
        wild.clone(),
        &[(":authority", "a.B.example.com:8080")],
        &[]
    ));
    assert!(!check(wild, &[(":authority", "example.com")], &[]));
    let re = json!({"host_regex": "(api|web)[.]example[.]com"});
    assert!(check(
        re.clone(),
        &[(":authority", "WEB.example.com:80")],
        &[]
    ));
    assert!(!check(re, &[(":authority", "x.api.example.com")], &[]));
}

#[test]
fn route_and_metadata_compare_exact_strings() {
    let route = json!({"route": "api"});
    assert!(check(
        route.clone(),
        &[],
        &[(&["xds", "route_name"], "api")]
    ));
    assert!(!check(
        route.clone(),
        &[],
        &[(&["xds", "route_name"], "apiv2")]
    ));
    assert!(!check(route, &[], &[]));
    let rm = json!({"route_metadata": {"ratelimit/plan": "premium"}});
    let at: &[&str] = &[
        "xds",
        "route_metadata",
        "filter_metadata",
        "ratelimit",
        "plan",
    ];
    assert!(check(rm.clone(), &[], &[(at, "premium")]));
    assert!(!check(rm, &[], &[(at, "basic")]));
    let md = json!({"metadata": {"envoy.filters.http.jwt_authn/payload/org": "acme"}});
    let at: &[&str] = &[
        "metadata",
        "filter_metadata",
        "envoy.filters.http.jwt_authn",
        "payload",
        "org",
    ];
    assert!(check(md.clone(), &[], &[(at, "acme")]));
    assert!(!check(md, &[], &[]));
}

#[test]
fn query_and_cookie_are_decoded_before_they_compare() {
    let q = json!({"query": {"api_key": "abc", "debug": true}});
    assert!(check(
        q.clone(),
        &[(":path", "/x?debug&api_key=a%62c")],
        &[]
    ));
    assert!(check(
        q.clone(),
        &[(":path", "/x?api_key=abc&debug=0")],
        &[]
    ));
    assert!(!check(q.clone(), &[(":path", "/x?api_key=abc")], &[]));
    assert!(!check(q, &[(":path", "/x?api_key=abd&debug")], &[]));
    let c = json!({"cookie": {"session": true, "plan": "pro plan"}});
    assert!(check(
        c.clone(),
        &[("cookie", "session=1; plan=pro%20plan")],
        &[]
    ));
    assert!(!check(c.clone(), &[("cookie", "plan=pro%20plan")], &[]));
    assert!(!check(c, &[], &[]));
}

#[test]
fn not_and_any_combine_matches() {
    let m = json!({"not": {"path_prefix": "/health"},
        "any": [{"host": "a.example"}, {"query": {"k": true}}]});
    assert!(check(
        m.clone(),
        &[(":path", "/x"), (":authority", "a.example")],
        &[]
    ));
    assert!(check(
        m.clone(),
        &[(":path", "/x?k"), (":authority", "b.example")],
        &[]
    ));
    assert!(!check(
        m.clone(),
        &[(":path", "/x"), (":authority", "b.example")],
        &[]
    ));
    assert!(!check(
        m,
        &[(":path", "/health?k"), (":authority", "a.example")],
        &[]
    ));
}

#[test]
fn path_regex_matches_the_whole_path_without_query() {
    let m = json!({"path_regex": "/v[0-9]+/users/[0-9]+"});
    assert!(check(m.clone(), &[(":path", "/v1/users/42?x=/v1")], &[]));
    // Crafted near-misses: a suffix, a prefix, a newline, the query.
    for path in [
        "/v1/users/42/x",
        "/a/v1/users/42",
        "/v1/users/42%0A",
        "/v1/users/?42",
    ] {
        assert!(!check(m.clone(), &[(":path", path)], &[]), "{path}");
    }
    assert!(!check(m, &[(":path", "/v1/users/4\u{ff}")], &[]));
}

#[test]
fn a_pattern_exponential_for_backtracking_is_linear_here() {
    // (a+)+$ against a^n! takes 2^n steps in a backtracking engine; n = 60 000 here.
    let m = json!({"path_regex": "/(a+)+"});
    let mut path = "/".to_string();
    path.push_str(&"a".repeat(60_000));
    path.push('!');
    assert!(!check(m.clone(), &[(":path", &path)], &[]));
    path.pop();
    assert!(check(m, &[(":path", &path)], &[]));
}
