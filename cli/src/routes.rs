//! `explain --envoy BOOTSTRAP`: which of a bootstrap's routes pick which
//! of a rule's `limits_by` sets. For a set named in route metadata, each
//! route of the connection managers that run the filter is read as the
//! filter reads `xds.route_metadata`: the string at
//! `filter_metadata.<namespace>.<key>…` names the set; a route without one,
//! or naming no set of the rule, gets the rule's own limits.

use crate::check_envoy::filter_hcms;
use ratelimit_config::{Config, LimitsBy, LimitsSource};
use serde_json::Value;

/// The section `explain` prints for `doc` (read from `file`).
pub fn describe(c: &Config, doc: &Value, file: &str) -> String {
    let mut out = format!("\nwhich routes pick which limits ({file}):\n");
    let rules: Vec<_> = c
        .rules
        .iter()
        .filter_map(|r| Some((r.name.as_str(), r.limits_by.as_ref()?)))
        .collect();
    if rules.is_empty() {
        out.push_str("  no rule has limits_by: every route gets each rule's own limits\n");
        return out;
    }
    let routes = routes(doc);
    for (rule, by) in rules {
        match by.source() {
            Some((LimitsSource::RouteMetadata, path)) => {
                out.push_str(&format!("  rule {rule}, by route metadata {path}:\n"));
                if routes.is_empty() {
                    out.push_str("    no route runs the filter in this bootstrap\n");
                }
                for (at, route) in &routes {
                    out.push_str(&format!("    {at}: {}\n", pick(by, path, route)));
                }
            }
            Some((LimitsSource::Metadata, path)) => out.push_str(&format!(
                "  rule {rule}, by dynamic metadata {path}: chosen per request (what \
                 jwt_authn or ext_authz wrote), not by the route\n"
            )),
            None => {}
        }
    }
    out
}

/// Every route of the connection managers that run the filter, with where
/// it is: `listener "ingress", virtual host "backend", route "premium"`
/// (a route without a name is shown by its match).
fn routes(doc: &Value) -> Vec<(String, &Value)> {
    let mut found = Vec::new();
    for (listener, hcm) in filter_hcms(doc) {
        let hosts = hcm
            .pointer("/route_config/virtual_hosts")
            .and_then(Value::as_array);
        for host in hosts.into_iter().flatten() {
            let host_name = host.get("name").and_then(Value::as_str).unwrap_or("-");
            let routes = host.get("routes").and_then(Value::as_array);
            for route in routes.into_iter().flatten() {
                let at = format!(
                    "{listener}, virtual host \"{host_name}\", route {}",
                    label(route)
                );
                found.push((at, route));
            }
        }
    }
    found
}

/// A route's name, or its match when it has none.
fn label(route: &Value) -> String {
    if let Some(name) = route.get("name").and_then(Value::as_str) {
        return format!("\"{name}\"");
    }
    let m = route.get("match");
    for kind in ["prefix", "path", "path_separated_prefix"] {
        if let Some(v) = m.and_then(|m| m.get(kind)).and_then(Value::as_str) {
            return format!("({kind} {v})");
        }
    }
    "(another match)".into()
}

/// What `route` gets from `by`, read at `path` in its filter metadata.
fn pick(by: &LimitsBy, path: &str, route: &Value) -> String {
    let mut at = route.pointer("/metadata/filter_metadata");
    for segment in path.split('/') {
        at = at.and_then(|v| v.get(segment));
    }
    match at {
        None => format!("the rule's own limits (no {path} in its metadata)"),
        Some(Value::String(name)) if by.sets.contains_key(name) => format!("set {name}"),
        Some(Value::String(name)) => {
            format!("the rule's own limits ({name:?} names no set of the rule)")
        }
        Some(other) => format!("the rule's own limits ({other} is not a string)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bootstrap(routes: Value) -> Value {
        json!({ "static_resources": { "listeners": [{ "name": "ingress", "filter_chains": [{
            "filters": [{ "name": "envoy.filters.network.http_connection_manager", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "route_config": { "virtual_hosts": [{ "name": "backend", "routes": routes }] },
                "http_filters": [
                    { "name": "envoy.filters.http.wasm", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                        "config": { "root_id": "ratelimit" } } },
                    { "name": "envoy.filters.http.router" } ] } }] }] }] } })
    }

    fn config(by: Value) -> Config {
        let c = json!({ "domain": "d", "rules": [{ "name": "api", "key": ["client"],
            "limits": [{ "requests": 10, "per": "1m" }], "limits_by": by }] });
        ratelimit_config::parse(c.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn each_route_shows_the_set_its_metadata_names_or_the_rules_own_limits() {
        let c = config(json!({ "route_metadata": "ratelimit/plan", "sets": {
            "premium": [{ "requests": 100, "per": "1m" }] } }));
        let doc = bootstrap(json!([
            { "name": "paid", "match": { "prefix": "/paid" },
              "metadata": { "filter_metadata": { "ratelimit": { "plan": "premium" } } } },
            { "match": { "prefix": "/typo" },
              "metadata": { "filter_metadata": { "ratelimit": { "plan": "premum" } } } },
            { "match": { "prefix": "/" } }
        ]));
        let text = describe(&c, &doc, "envoy.yaml");
        assert_eq!(
            text,
            "\nwhich routes pick which limits (envoy.yaml):\n  rule api, by route metadata ratelimit/plan:\n    \
             listener \"ingress\", virtual host \"backend\", route \"paid\": set premium\n    \
             listener \"ingress\", virtual host \"backend\", route (prefix /typo): the rule's own limits (\"premum\" names no set of the rule)\n    \
             listener \"ingress\", virtual host \"backend\", route (prefix /): the rule's own limits (no ratelimit/plan in its metadata)\n"
        );
    }

    #[test]
    fn a_set_named_by_dynamic_metadata_is_not_the_routes_to_pick() {
        let c = config(
            json!({ "metadata": "envoy.filters.http.jwt_authn/payload/plan", "sets": {
            "premium": [{ "requests": 100, "per": "1m" }] } }),
        );
        let text = describe(&c, &bootstrap(json!([])), "b.yaml");
        assert!(text.contains(
            "rule api, by dynamic metadata envoy.filters.http.jwt_authn/payload/plan: chosen per request"
        ));
    }
}
