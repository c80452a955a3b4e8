//! The Envoy configurations of the bench, all derived from the ONE shipped
//! template `envoy/envoy.yaml`.
//!
//! Every variant starts from the template rendered by `testkit` exactly as the
//! tests and the demo render it. Then, programmatically (the rendered YAML is
//! parsed with `serde_norway`, edited as data and written back):
//!
//! * in every variant the built-in `upstream` listener is removed: the
//!   `upstream` cluster points at a separate upstream process instead (a
//!   second Envoy, see [`upstream_config`]), so the stand-in upstream does not
//!   share the measured Envoy's worker threads;
//! * then only the `envoy.filters.http.wasm` entry of the `ingress` listener's
//!   `http_filters` differs ([`FilterVariant`]): kept (c, d), removed (a),
//!   pointed at the no-op module (a2), or replaced by Envoy's native
//!   `envoy.filters.http.local_ratelimit` ([`NATIVE_LOCAL_RATELIMIT`], b).
//!   `jwt_authn` and the router stay as shipped;
//! * in every variant the `ingress` listener's access log is removed: the
//!   bench measures the filter, and a line per request to stdout is
//!   Envoy's work, not the filter's (the filter still sets its filter state).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde_norway::Value;
use testkit::config::{demo_jwks, render_file, template_path, TemplateVars};
use testkit::Ports;

/// The name of the shipped wasm filter entry in `http_filters`.
const WASM_FILTER: &str = "envoy.filters.http.wasm";

/// What stands where the shipped template has the wasm rate-limit filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterVariant {
    /// a: no rate-limit filter (the entry is removed).
    None,
    /// a2: the same `envoy.filters.http.wasm` entry with the no-op module.
    Noop,
    /// a3: the same entry with the module that makes only c1's host calls.
    HostCalls,
    /// b: Envoy's native local rate limiter instead.
    Native,
    /// c, d: the shipped entry, unchanged.
    Shipped,
    /// d2: the shipped entry, the gateway's cluster over HTTP/2 (h2c).
    ShippedH2,
    /// dg: the shipped entry calling the gateway's gRPC API
    /// (`transport: grpc`) on the [`RLS_CLUSTER`] cluster.
    ShippedGrpc,
    /// g: Envoy's native global rate limit filter calling the gateway's
    /// rate limit service over gRPC ([`NATIVE_RLS`]).
    NativeRls,
}

/// Envoy's native global rate limit filter (`envoy.filters.http.ratelimit`)
/// calling the gateway's `--grpc-listen` (cluster [`RLS_CLUSTER`]): one
/// descriptor `(client_id, <x-client-id>)` per request in domain
/// `bench-native`, which the bench's `--rls-config` ([`RLS_CONFIG`]) limits
/// to 10^9 a second in a fixed window (their default algorithm), so it
/// rejects nothing. Draft-03 `x-ratelimit-*` headers on every response, as
/// the other variants add theirs.
pub const NATIVE_RLS: &str = r#"
name: envoy.filters.http.ratelimit
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
  domain: bench-native
  failure_mode_deny: false
  enable_x_ratelimit_headers: DRAFT_VERSION_03
  timeout: 0.2s
  rate_limits:
  - actions:
    - request_headers: { header_name: x-client-id, descriptor_key: client_id }
  rate_limit_service:
    transport_api_version: V3
    grpc_service:
      envoy_grpc: { cluster_name: ratelimit_gateway_grpc }
"#;

/// The cluster of the gateway's gRPC port in variants g and dg.
pub const RLS_CLUSTER: &str = "ratelimit_gateway_grpc";

/// The gateway's `--rls-config` in the bench.
/// `client_id` is variant g's; `tb_client` is the gRPC load's, a token
/// bucket, so that its calls run `check.lua` as the HTTP gateway's and
/// `redis-benchmark`'s do.
pub const RLS_CONFIG: &str = "domain: bench-native\ndescriptors:\n\
- key: client_id\n  rate_limit: { unit: second, requests_per_unit: 1000000000 }\n\
- key: tb_client\n  rate_limit: { unit: second, requests_per_unit: 1000000000, algorithm: token_bucket }\n";

/// Envoy's native local rate limiter, "equivalent" to the c variants: one
/// token bucket per client (`x-client-id`, a dynamic descriptor: an entry
/// without a value makes one bucket per distinct value, up to
/// `max_dynamic_descriptors`) of 10^9 tokens per second, which rejects
/// nothing; client `over` has a bucket of 1 token per day (the f load).
/// Only the matching descriptor's bucket is charged
/// (`always_consume_default_token_bucket: false`), as the filter charges one
/// bucket per rule. It adds draft-03 `x-ratelimit-*` headers to every
/// response, as the filter adds its rate-limit headers.
pub const NATIVE_LOCAL_RATELIMIT: &str = r#"
name: envoy.filters.http.local_ratelimit
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
  stat_prefix: bench_local_ratelimit
  token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
  filter_enabled: { default_value: { numerator: 100, denominator: HUNDRED } }
  filter_enforced: { default_value: { numerator: 100, denominator: HUNDRED } }
  always_consume_default_token_bucket: false
  enable_x_ratelimit_headers: DRAFT_VERSION_03
  max_dynamic_descriptors: 65536
  rate_limits:
  - actions:
    - request_headers: { header_name: x-client-id, descriptor_key: client }
  descriptors:
  - entries: [ { key: client, value: over } ]
    token_bucket: { max_tokens: 1, tokens_per_fill: 1, fill_interval: 86400s }
  - entries: [ { key: client } ]
    token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
"#;

/// The shipped template rendered by testkit, as YAML data.
fn rendered(ports: Ports, gateway_port: u16, wasm: &Path, plugin_config: &str) -> Result<Value> {
    let vars = TemplateVars {
        ports,
        gateway_port,
        wasm_path: wasm.to_path_buf(),
        plugin_config: plugin_config.to_string(),
        jwks: demo_jwks()?,
    };
    let text = render_file(&template_path(), &vars)?;
    serde_norway::from_str(&text).context("parsing the rendered envoy/envoy.yaml")
}

fn field<'a>(v: &'a mut Value, key: &str) -> Result<&'a mut Value> {
    v.get_mut(key)
        .ok_or_else(|| anyhow!("the rendered template has no `{key}` where expected"))
}

fn seq<'a>(v: &'a mut Value, what: &str) -> Result<&'a mut Vec<Value>> {
    v.as_sequence_mut()
        .ok_or_else(|| anyhow!("`{what}` in the rendered template is not a list"))
}

fn name_of(v: &Value) -> Option<&str> {
    v.get("name").and_then(Value::as_str)
}

fn listeners(doc: &mut Value) -> Result<&mut Vec<Value>> {
    seq(
        field(field(doc, "static_resources")?, "listeners")?,
        "listeners",
    )
}

/// Keeps only the listeners whose name `keep` accepts; returns how many
/// were removed.
fn retain_listeners(doc: &mut Value, keep: impl Fn(&str) -> bool) -> Result<usize> {
    let list = listeners(doc)?;
    let before = list.len();
    list.retain(|l| name_of(l).is_some_and(&keep));
    Ok(before - list.len())
}

/// The `typed_config` of listener `listener`'s (only) HTTP connection manager.
fn hcm<'a>(doc: &'a mut Value, listener: &str) -> Result<&'a mut Value> {
    let l = listeners(doc)?
        .iter_mut()
        .find(|l| name_of(l) == Some(listener))
        .ok_or_else(|| anyhow!("no listener `{listener}` in the rendered template"))?;
    let chains = seq(field(l, "filter_chains")?, "filter_chains")?;
    if chains.len() != 1 {
        bail!(
            "listener `{listener}` has {} filter chains, not 1",
            chains.len()
        );
    }
    let filters = seq(field(&mut chains[0], "filters")?, "filters")?;
    if filters.len() != 1 {
        bail!(
            "listener `{listener}` has {} network filters, not 1",
            filters.len()
        );
    }
    field(&mut filters[0], "typed_config")
}

/// The ingress listener's one route gets the name `api` in every variant,
/// so that cm's `match.route` holds (a route's name changes nothing else).
fn name_the_route(doc: &mut Value) -> Result<()> {
    let hosts = seq(
        field(
            field(hcm(doc, "ingress")?, "route_config")?,
            "virtual_hosts",
        )?,
        "virtual_hosts",
    )?;
    let [host] = hosts.as_mut_slice() else {
        bail!(
            "the ingress listener has {} virtual hosts, not 1",
            hosts.len()
        );
    };
    let routes = seq(field(host, "routes")?, "routes")?;
    let [route] = routes.as_mut_slice() else {
        bail!("the ingress listener has {} routes, not 1", routes.len());
    };
    route
        .as_mapping_mut()
        .context("the ingress route is not a mapping")?
        .insert("name".into(), "api".into());
    Ok(())
}

/// The `http_filters` list of listener `listener`'s (only) HTTP connection manager.
fn http_filters<'a>(doc: &'a mut Value, listener: &str) -> Result<&'a mut Vec<Value>> {
    seq(field(hcm(doc, listener)?, "http_filters")?, "http_filters")
}

/// The chat completions the upstream serves besides `ok\n` (the
/// response-body variants): path and length in bytes.
pub const RESPONSE_BODIES: [(&str, usize); 2] = [("/chat-1k", 1024), ("/chat-64k", 64 * 1024)];

/// An OpenAI chat completion of exactly `len` bytes (at least 600): one long
/// `content` string of words, the `usage` at the end, as
/// `tests/bench_fuel.rs` measures them.
pub fn chat_completion(len: usize) -> String {
    const WORDS: [&str; 12] = [
        "the", "bucket", "refills", "at", "a", "steady", "rate", "while", "each", "request",
        "spends", "tokens",
    ];
    let completion = len / 4;
    let head = "{\"id\":\"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT\",\"created\":1741569952,\
                \"model\":\"gpt-4o-2024-08-06\",\"object\":\"chat.completion\",\"choices\":\
                [{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"";
    let tail = format!(
        "\",\"refusal\":null,\"annotations\":[]}},\"logprobs\":null,\"finish_reason\":\"stop\"}}],\
         \"usage\":{{\"prompt_tokens\":19,\"completion_tokens\":{completion},\"total_tokens\":{},\
         \"prompt_tokens_details\":{{\"cached_tokens\":0,\"audio_tokens\":0}},\
         \"completion_tokens_details\":{{\"reasoning_tokens\":0,\"audio_tokens\":0,\
         \"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}},\
         \"service_tier\":\"default\",\"system_fingerprint\":\"fp_fc9f1d7035\"}}",
        completion + 19
    );
    let room = len.saturating_sub(head.len() + tail.len());
    let mut content = String::with_capacity(room + 16);
    let mut i = 0usize;
    while content.len() < room {
        content.push_str(WORDS[(i * 7 + i / 12) % WORDS.len()]);
        i += 1;
        content.push_str(match i % 20 {
            0 => ".\\n",
            13 => ". ",
            _ => " ",
        });
    }
    content.truncate(room);
    if content.ends_with('\\') {
        content.pop();
        content.push('.');
    }
    format!("{head}{content}{tail}")
}

/// The baseline modules loaded in place of the filter (test fixtures).
#[derive(Debug, Clone)]
pub struct Baselines {
    /// a2's `noop_filter.wasm`.
    pub noop: PathBuf,
    /// a3's `hostcalls_filter.wasm`.
    pub host_calls: PathBuf,
}

/// The wasm filter entry `entry` with `module` in place of the shipped one,
/// every other setting (runtime, `vm_id`, failure policy) kept.
fn load_module(entry: &mut Value, module: &Path) -> Result<()> {
    let local = ["typed_config", "config", "vm_config", "code", "local"]
        .iter()
        .try_fold(entry, |v, k| field(v, k))?;
    let file = module
        .to_str()
        .ok_or_else(|| anyhow!("{} is not UTF-8", module.display()))?;
    *field(local, "filename")? = Value::String(file.to_string());
    Ok(())
}

/// The measured Envoy's configuration: the shipped template rendered with
/// `ports` (whose `upstream` is the separate upstream's port), the built-in
/// upstream listener removed, and the wasm filter entry as `variant` says.
pub fn proxy_config(
    variant: FilterVariant,
    ports: Ports,
    gateway_port: u16,
    grpc_port: u16,
    wasm: &Path,
    baselines: &Baselines,
    plugin_config: &str,
) -> Result<String> {
    let mut doc = rendered(ports, gateway_port, wasm, plugin_config)?;
    if retain_listeners(&mut doc, |n| n != "upstream")? != 1 {
        bail!("expected exactly one `upstream` listener in the rendered template");
    }
    if let Some(m) = hcm(&mut doc, "ingress")?.as_mapping_mut() {
        m.remove("access_log");
    }
    name_the_route(&mut doc)?;
    let filters = http_filters(&mut doc, "ingress")?;
    let at = filters
        .iter()
        .position(|f| name_of(f) == Some(WASM_FILTER))
        .ok_or_else(|| anyhow!("no {WASM_FILTER} in the ingress listener's http_filters"))?;
    match variant {
        FilterVariant::Shipped => {}
        FilterVariant::ShippedH2 => gateway_over_h2(&mut doc)?,
        FilterVariant::ShippedGrpc => {}
        FilterVariant::None => {
            filters.remove(at);
        }
        FilterVariant::Native => {
            filters[at] = serde_norway::from_str(NATIVE_LOCAL_RATELIMIT)
                .context("parsing the native local_ratelimit entry")?;
        }
        FilterVariant::NativeRls => {
            filters[at] =
                serde_norway::from_str(NATIVE_RLS).context("parsing the native ratelimit entry")?;
        }
        FilterVariant::Noop => {
            load_module(
                filters.get_mut(at).context("the wasm entry")?,
                &baselines.noop,
            )?;
        }
        FilterVariant::HostCalls => {
            load_module(
                filters.get_mut(at).context("the wasm entry")?,
                &baselines.host_calls,
            )?;
        }
    }
    if matches!(
        variant,
        FilterVariant::NativeRls | FilterVariant::ShippedGrpc
    ) {
        let cluster: Value = serde_norway::from_str(&format!(
            "name: {RLS_CLUSTER}\nconnect_timeout: 0.25s\ntype: STATIC\n\
             typed_extension_protocol_options:\n  envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n\
             \x20   \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n\
             \x20   explicit_http_config: {{ http2_protocol_options: {{}} }}\n\
             load_assignment:\n  cluster_name: {RLS_CLUSTER}\n  endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {grpc_port} }} }} }} }} ] }} ]\n"
        ))
        .context("parsing the gRPC cluster")?;
        seq(
            field(field(&mut doc, "static_resources")?, "clusters")?,
            "clusters",
        )?
        .push(cluster);
    }
    serde_norway::to_string(&doc).context("writing the derived YAML")
}

/// The `ratelimit_gateway` cluster's HTTP/1 (`http_protocol_options`)
/// turned to HTTP/2 with prior knowledge (`http2_protocol_options`).
fn gateway_over_h2(doc: &mut Value) -> Result<()> {
    let clusters = seq(
        field(field(doc, "static_resources")?, "clusters")?,
        "clusters",
    )?;
    let gateway = clusters
        .iter_mut()
        .find(|c| name_of(c) == Some("ratelimit_gateway"))
        .context("no ratelimit_gateway cluster in the rendered template")?;
    let options = field(
        field(gateway, "typed_extension_protocol_options")?,
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    )?;
    let explicit = field(options, "explicit_http_config")?
        .as_mapping_mut()
        .context("explicit_http_config is not a mapping")?;
    explicit.clear();
    explicit.insert(
        "http2_protocol_options".into(),
        Value::Mapping(Default::default()),
    );
    Ok(())
}

/// The separate upstream: the same rendered template with only its
/// `upstream` listener (the `direct_response` 200 with body `ok\n`, on
/// `ports.upstream`) and no clusters; before its route, one
/// `direct_response` per [`RESPONSE_BODIES`] path: 200, `application/json`,
/// the [`chat_completion`] of that length.
pub fn upstream_config(ports: Ports, wasm: &Path) -> Result<String> {
    let mut doc = rendered(ports, ports.upstream, wasm, "{}")?;
    retain_listeners(&mut doc, |n| n == "upstream")?;
    if listeners(&mut doc)?.len() != 1 {
        bail!("expected exactly one `upstream` listener in the rendered template");
    }
    let routes_config = field(hcm(&mut doc, "upstream")?, "route_config")?;
    let largest = RESPONSE_BODIES.iter().map(|b| b.1).max().unwrap_or(0);
    // Envoy refuses a direct response body over 4096 bytes unless told.
    routes_config
        .as_mapping_mut()
        .context("route_config")?
        .insert(
            Value::from("max_direct_response_body_size_bytes"),
            Value::from(largest as u64),
        );
    let hosts = seq(field(routes_config, "virtual_hosts")?, "virtual_hosts")?;
    let routes = seq(
        field(hosts.first_mut().context("a virtual host")?, "routes")?,
        "routes",
    )?;
    for (at, (path, len)) in RESPONSE_BODIES.iter().enumerate() {
        let route = serde_json::json!({
            "match": { "path": path },
            "direct_response": {
                "status": 200,
                "body": { "inline_string": chat_completion(*len) },
            },
            "response_headers_to_add": [{
                "header": { "key": "content-type", "value": "application/json" },
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }],
        });
        routes.insert(
            at,
            serde_norway::to_value(route).context("a chat completion's route")?,
        );
    }
    *field(field(&mut doc, "static_resources")?, "clusters")? = Value::Sequence(Vec::new());
    serde_norway::to_string(&doc).context("writing the derived YAML")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ports() -> Ports {
        Ports {
            listen: 1,
            admin: 2,
            upstream: 3,
        }
    }

    fn filters_of(yaml: &str) -> Vec<String> {
        let mut doc: Value = serde_norway::from_str(yaml).unwrap();
        http_filters(&mut doc, "ingress")
            .unwrap()
            .iter()
            .map(|f| name_of(f).unwrap().to_string())
            .collect()
    }

    fn config(v: FilterVariant) -> String {
        proxy_config(
            v,
            ports(),
            4,
            5,
            Path::new("/x/ratelimit_wasm.wasm"),
            &Baselines {
                noop: PathBuf::from("/x/noop_filter.wasm"),
                host_calls: PathBuf::from("/x/hostcalls_filter.wasm"),
            },
            "{}",
        )
        .unwrap()
    }

    #[test]
    fn d2_differs_from_d_only_in_the_gateway_clusters_protocol() {
        let (d, d2) = (
            config(FilterVariant::Shipped),
            config(FilterVariant::ShippedH2),
        );
        assert_ne!(d, d2);
        assert_eq!(
            d2.replace("http2_protocol_options", "http_protocol_options"),
            d
        );
    }

    #[test]
    fn variants_differ_only_in_the_wasm_entry() {
        let jwt = "envoy.filters.http.jwt_authn";
        let router = "envoy.filters.http.router";
        assert_eq!(
            filters_of(&config(FilterVariant::Shipped)),
            [jwt, WASM_FILTER, router]
        );
        assert_eq!(filters_of(&config(FilterVariant::None)), [jwt, router]);
        assert_eq!(
            filters_of(&config(FilterVariant::Native)),
            [jwt, "envoy.filters.http.local_ratelimit", router]
        );
        let noop = config(FilterVariant::Noop);
        assert_eq!(filters_of(&noop), [jwt, WASM_FILTER, router]);
        assert!(noop.contains("/x/noop_filter.wasm") && !noop.contains("ratelimit_wasm.wasm"));
        let calls = config(FilterVariant::HostCalls);
        assert_eq!(filters_of(&calls), [jwt, WASM_FILTER, router]);
        assert!(
            calls.contains("/x/hostcalls_filter.wasm") && !calls.contains("ratelimit_wasm.wasm")
        );
        let g = config(FilterVariant::NativeRls);
        assert_eq!(
            filters_of(&g),
            [jwt, "envoy.filters.http.ratelimit", router]
        );
        assert!(
            g.contains("port_value: 5") && g.contains(RLS_CLUSTER),
            "{g}"
        );
        for v in [
            FilterVariant::Shipped,
            FilterVariant::None,
            FilterVariant::Native,
            FilterVariant::Noop,
            FilterVariant::HostCalls,
        ] {
            let yaml = config(v);
            // The built-in upstream listener is gone; the cluster still points at port 3.
            assert!(!yaml.contains("upstream_http"), "{yaml}");
            assert!(yaml.contains("port_value: 3"), "{yaml}");
            // No access log: the bench measures the filter, not logging.
            assert!(!yaml.contains("access_log"), "{yaml}");
        }
    }

    #[test]
    fn the_upstream_is_only_the_direct_response_listener() {
        let yaml = upstream_config(ports(), Path::new("/x/ratelimit_wasm.wasm")).unwrap();
        assert!(yaml.contains("direct_response"), "{yaml}");
        assert!(!yaml.contains("ingress"), "{yaml}");
        assert!(!yaml.contains(WASM_FILTER), "{yaml}");
        // The chat completions first, then the template's own catch-all.
        let mut doc: Value = serde_norway::from_str(&yaml).unwrap();
        let rc = field(hcm(&mut doc, "upstream").unwrap(), "route_config").unwrap();
        assert_eq!(rc["max_direct_response_body_size_bytes"], 65536);
        let routes = &rc["virtual_hosts"][0]["routes"];
        for (at, (path, len)) in RESPONSE_BODIES.iter().enumerate() {
            assert_eq!(routes[at]["match"]["path"].as_str(), Some(*path));
            let body = routes[at]["direct_response"]["body"]["inline_string"]
                .as_str()
                .unwrap();
            assert_eq!(body.len(), *len);
            let chat: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(chat["usage"]["completion_tokens"], len / 4);
        }
        assert_eq!(routes[2]["match"]["prefix"].as_str(), Some("/"));
    }
}
