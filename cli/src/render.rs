//! `ratelimit render FILE --out DIR`: from one plugin configuration, the
//! deployment files of both sides, so that the limits a proxy applies and the
//! limits the gateway enforces cannot drift apart.
//!
//! The configuration is validated with the filter's own code
//! (`ratelimit_config::parse`, which the gateway's `--policy` runs too)
//! and then embedded **verbatim** (the same bytes, re-indented) in every file
//! written, so what a reviewer reads in the source file is what both sides run.
//! Every output is parsed back and compared with the source before it is
//! written.
//!
//! * `--target istio` (default): `wasmplugin.yaml` (the filter from an OCI
//!   image), `wasmplugin-file.yaml` (the same plugin from a file inside the
//!   proxy) and `gateway-policy.yaml` (a ConfigMap holding the policy for
//!   `ratelimit-gateway --policy`). When the configuration names
//!   `global.token_env`, the WasmPlugins pass that variable from the proxy's
//!   environment into the VM (`vmConfig.env`, `valueFrom: HOST`).
//! * `--target envoy`: `envoy-wasm-filter.yaml` (the `http_filters` entry, with
//!   `vm_config.environment_variables.host_env_keys` for `global.token_env`)
//!   and `<domain>.json` (the policy file for `--policy`).

use serde_json::Value;
use std::path::Path;

/// Where the rendered files go and what they name; every field has the
/// default the shipped `deploy/istio/` manifests are rendered with. The
/// fields are `render`'s flags; in the manifests, `name` and `namespace` are
/// the WasmPlugin's `metadata`, `selector` its `spec.selector.matchLabels`,
/// `image` and `sha256` the OCI variant's `spec.url` and `spec.sha256`, and
/// `file_url` the file variant's `spec.url` (Istio) or the module's path
/// (Envoy).
#[derive(clap::Args)]
pub struct Options {
    /// `istio`: wasmplugin.yaml, wasmplugin-file.yaml, gateway-policy.yaml;
    /// `envoy`: envoy-wasm-filter.yaml and <domain>.json.
    #[arg(long, default_value = "istio")]
    pub target: String,
    /// The WasmPlugin's name.
    #[arg(long, default_value = "ratelimit")]
    pub name: String,
    /// The WasmPlugin's namespace (where the selected proxies run).
    #[arg(long, default_value = "istio-system")]
    pub namespace: String,
    /// The WasmPlugin's selector, `key=value` (repeatable).
    #[arg(long, default_value = "istio=ingressgateway")]
    pub selector: Vec<String>,
    /// The OCI image of the filter (pin the tag).
    #[arg(long, default_value = "oci://ghcr.io/example/ratelimit-wasm:0.1.0")]
    pub image: String,
    /// The image manifest's digest, 64 hex digits without `sha256:`;
    /// required for `--target istio` (64 zeros only as an explicit placeholder).
    #[arg(long)]
    pub sha256: Option<String>,
    /// The gateway's Kubernetes service host; for `--target istio` it sets
    /// `global.cluster` to `outbound|PORT||HOST`, the name Istio gives it.
    #[arg(long)]
    pub gateway_host: Option<String>,
    /// The gateway's service port, with `--gateway-host`.
    #[arg(long, default_value_t = 8081)]
    pub gateway_port: u16,
    /// The variable a literal `global.token` is rendered as (`token_env`).
    #[arg(long, default_value = "RATELIMIT_GATEWAY_TOKEN")]
    pub token_env: String,
    /// Keep a literal `global.token` in the rendered files (it is then in
    /// the manifests and in Envoy's config_dump).
    #[arg(long)]
    pub inline_token: bool,
    /// Where the module is inside the proxy (file:// url, or a path).
    #[arg(long, default_value = "file:///opt/filters/ratelimit_wasm.wasm")]
    pub file_url: String,
    /// The policy ConfigMap's name.
    #[arg(long, default_value = "ratelimit-policy")]
    pub policy_name: String,
    /// The policy ConfigMap's namespace (the gateway's).
    #[arg(long, default_value = "ratelimit")]
    pub policy_namespace: String,
}

/// The checksum placeholder: 64 zeros, which makes Istio's fetch fail (so an
/// unedited file never runs an unverified module); accepted only when given
/// explicitly, with a warning.
pub const SHA256_PLACEHOLDER: &str =
    "0000000000000000000000000000000000000000000000000000000000000000";

/// Renders `file` into `out` and returns the names of the files written.
pub fn run(file: &str, out: &str, opts: &Options) -> Result<Vec<String>, String> {
    let original =
        std::fs::read_to_string(file).map_err(|e| format!("{file}: cannot read: {e}"))?;
    ratelimit_config::parse(original.as_bytes()).map_err(|e| format!("{file}: {e}"))?;
    let mut source: Value =
        serde_json::from_str(&original).map_err(|e| format!("{file}: not valid JSON: {e}"))?;
    let mut rewritten = false;
    if let Some(global) = source.get_mut("global").and_then(Value::as_object_mut) {
        if global.contains_key("token") && !opts.inline_token {
            // A literal token would be in the manifests and in Envoy's
            // config_dump, readable by any container of the pod.
            global.remove("token");
            global.insert("token_env".into(), Value::String(opts.token_env.clone()));
            rewritten = true;
            eprintln!(
                "{file}: note: global.token is not rendered: the files name token_env {:?} \
                 instead; put the token in that variable of the proxy (from a Secret), \
                 or pass --inline-token to keep the literal",
                opts.token_env
            );
        } else if global.contains_key("token") {
            eprintln!(
                "{file}: warning: global.token is inline, so whoever can read the rendered files \
                 (WasmPlugins, Envoy configs, config_dump) reads the token; prefer global.token_env"
            );
        }
        if opts.target == "istio" {
            let cluster = global.get("cluster").and_then(Value::as_str).unwrap_or("");
            match &opts.gateway_host {
                Some(host) => {
                    let istio = format!("outbound|{}||{host}", opts.gateway_port);
                    if cluster != istio {
                        global.insert("cluster".into(), Value::String(istio));
                        rewritten = true;
                    }
                }
                None if !cluster.starts_with("outbound|") => {
                    return Err(format!(
                        "{file}: global.cluster {cluster:?}: Istio names the gateway's cluster \
                         outbound|PORT||HOST; pass --gateway-host (and --gateway-port) or write it"
                    ))
                }
                None => {}
            }
        }
    }
    // Verbatim unless a flag changed it; then the JSON re-serialized.
    let text = if rewritten {
        let mut t = serde_json::to_string_pretty(&source)
            .map_err(|e| format!("{file}: cannot serialize: {e}"))?;
        t.push('\n');
        t
    } else {
        original
    };
    let parsed = ratelimit_config::parse(text.as_bytes()).map_err(|e| format!("{file}: {e}"))?;
    let token_env = source
        .pointer("/global/token_env")
        .and_then(Value::as_str)
        .map(str::to_string);
    if opts.target == "istio" {
        check_sha256(opts.sha256.as_deref())?;
    }
    let target = match opts.target.as_str() {
        "istio" => istio,
        "envoy" => envoy,
        other => return Err(format!("--target {other:?}: expected istio or envoy")),
    };
    let files = target(
        file,
        &text,
        &source,
        &parsed.domain,
        token_env.as_deref(),
        opts,
    )?;
    std::fs::create_dir_all(out).map_err(|e| format!("{out}: cannot create: {e}"))?;
    let mut names = Vec::new();
    for (name, body) in files {
        let path = Path::new(out).join(&name);
        std::fs::write(&path, body)
            .map_err(|e| format!("{}: cannot write: {e}", path.display()))?;
        names.push(name);
    }
    Ok(names)
}

/// Checks `--sha256` for the OCI WasmPlugin: required, 64 lower-case hex
/// digits; the all-zeros placeholder only with a warning.
fn check_sha256(sha: Option<&str>) -> Result<(), String> {
    let sha = sha.ok_or(
        "--sha256 is required for --target istio: the digest of the image's manifest \
         (e.g. `crane digest IMAGE`), 64 hex digits without `sha256:`",
    )?;
    if sha.len() != 64
        || !sha
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(format!(
            "--sha256 {sha:?}: expected 64 lower-case hex digits without `sha256:`"
        ));
    }
    if sha == SHA256_PLACEHOLDER {
        eprintln!(
            "warning: --sha256 64 zeros is a placeholder: Istio refuses to load wasmplugin.yaml \
             until it is replaced with the image's digest"
        );
    }
    Ok(())
}

/// `text` with every line prefixed by `indent` spaces (empty lines stay empty).
fn indented(text: &str, indent: usize) -> String {
    let pad = " ".repeat(indent);
    text.trim_end()
        .lines()
        .map(|l| {
            if l.trim().is_empty() {
                String::new()
            } else {
                format!("{pad}{l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A YAML double-quoted scalar (JSON's string syntax is YAML's).
fn q(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The ConfigMap key (and file name) of a domain's policy: ConfigMap keys
/// allow `[-._a-zA-Z0-9]`, domains also `:`.
pub fn policy_key(domain: &str) -> String {
    format!("{}.json", domain.replace(':', "_"))
}

/// Parses a rendered YAML text back and checks that the JSON at `pointer`
/// (or, with `as_string`, the JSON text held there) is the source's.
fn check_roundtrip(
    file: &str,
    name: &str,
    body: &str,
    pointer: &str,
    as_string: bool,
    source: &Value,
) -> Result<(), String> {
    let doc: Value = serde_norway::from_str(body).map_err(|e| {
        format!("{file}: rendered {name} is not valid YAML ({e}); indent the JSON with spaces")
    })?;
    let found = doc.pointer(pointer).cloned().unwrap_or(Value::Null);
    let found = if as_string {
        found
            .as_str()
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or(Value::Null)
    } else {
        found
    };
    if &found != source {
        return Err(format!(
            "{file}: the configuration does not survive embedding in {name}; indent the JSON with spaces"
        ));
    }
    Ok(())
}

fn istio(
    file: &str,
    text: &str,
    source: &Value,
    domain: &str,
    token_env: Option<&str>,
    o: &Options,
) -> Result<Vec<(String, String)>, String> {
    let mut labels = String::new();
    for kv in &o.selector {
        let (k, v) = kv
            .split_once('=')
            .filter(|(k, _)| !k.is_empty())
            .ok_or_else(|| format!("--selector {kv:?}: expected key=value"))?;
        labels.push_str(&format!("      {k}: {}\n", q(v)));
    }
    if labels.is_empty() {
        return Err("--selector: at least one key=value is required".into());
    }
    let vm_env = match token_env {
        Some(var) => format!(
            "  # The gateway token: global.token_env names a variable of the VM, and this
  # copies it from the proxy's own environment (valueFrom HOST), where a
  # Kubernetes Secret puts it (deploy/istio/README.md, \"The gateway token\").
  # A proxy without the variable fails to configure the plugin (logged as
  # global.token_env); it never calls the gateway without its token.
  vmConfig:
    env:
    - name: {}
      valueFrom: HOST
",
            q(var)
        ),
        None => String::new(),
    };
    let header = |what: &str| {
        format!(
            "\
# GENERATED by `ratelimit render {file}`: do not edit;
# edit that file and render again.
# {what}
# The pluginConfig below is that file verbatim, validated by the filter's own
# code; the gateway's policy (gateway-policy.yaml) holds the same text.
"
        )
    };
    let spec_common = format!(
        "  # AUTHZ: after Istio's authentication filters, so the client id the filter
  # reads from jwt_authn's metadata (identity.client_id_metadata) is there,
  # and before Istio's authorization filters, so a flood is cut early.
  phase: AUTHZ
  # Order among WasmPlugins in the same phase, highest first.
  priority: 100
  # A trap at run time: that request gets a 5xx and Envoy starts a fresh VM
  # (the buckets live in shared data and survive). A module that cannot be
  # loaded: requests to the selected proxies are refused, never passed
  # unlimited (Istio 1.24+). Mirrors envoy/envoy.yaml's failure_policy.
  failStrategy: FAIL_RELOAD
{vm_env}  pluginName: ratelimit
  pluginConfig:
{}
",
        indented(text, 4)
    );
    let metadata = format!(
        "\
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata:
  name: {}
  namespace: {}
  labels:
    app.kubernetes.io/name: ratelimit-wasm
spec:
  # Which proxies load the plugin. For sidecars, select the workload's labels
  # and add `match: [ {{ mode: SERVER }} ]` to limit inbound requests only.
  selector:
    matchLabels:
{labels}",
        q(&o.name),
        q(&o.namespace)
    );
    let oci = format!(
        "{}{metadata}  # Pin the tag (never `latest`); Istio then pulls once per proxy.
  url: {}
  imagePullPolicy: IfNotPresent
  # The digest of the pushed image's MANIFEST, without `sha256:` (docker
  # inspect / crane digest). 64 zeros is a placeholder that makes the fetch
  # fail: replace it before applying.
  sha256: {}
{spec_common}",
        header("The filter pulled from an OCI image."),
        q(&o.image),
        q(o.sha256.as_deref().unwrap_or(SHA256_PLACEHOLDER))
    );
    let from_file = format!(
        "{}{metadata}  # A file inside the proxy container; Istio reads no sha256 for file://.
  url: {}
{spec_common}",
        header("The filter loaded from a file inside the proxy (apply this or wasmplugin.yaml)."),
        q(&o.file_url)
    );
    let key = policy_key(domain);
    let policy = format!(
        "\
# GENERATED by `ratelimit render {file}`: do not edit;
# edit that file and render again. The gateway's policy: mount this ConfigMap as a directory and
# point `ratelimit-gateway --policy` at it. The data below is that file
# verbatim, the same text as the WasmPlugins' pluginConfig, so the limits the
# gateway enforces are the ones the proxies were given.
apiVersion: v1
kind: ConfigMap
metadata:
  name: {}
  namespace: {}
  labels:
    app.kubernetes.io/name: ratelimit-gateway
data:
  {}: |
{}
",
        q(&o.policy_name),
        q(&o.policy_namespace),
        q(&key),
        indented(text, 4)
    );
    check_roundtrip(
        file,
        "wasmplugin.yaml",
        &oci,
        "/spec/pluginConfig",
        false,
        source,
    )?;
    check_roundtrip(
        file,
        "wasmplugin-file.yaml",
        &from_file,
        "/spec/pluginConfig",
        false,
        source,
    )?;
    let pointer = format!("/data/{}", key.replace('~', "~0").replace('/', "~1"));
    check_roundtrip(file, "gateway-policy.yaml", &policy, &pointer, true, source)?;
    Ok(vec![
        ("wasmplugin.yaml".into(), oci),
        ("wasmplugin-file.yaml".into(), from_file),
        ("gateway-policy.yaml".into(), policy),
    ])
}

fn envoy(
    file: &str,
    text: &str,
    source: &Value,
    domain: &str,
    token_env: Option<&str>,
    o: &Options,
) -> Result<Vec<(String, String)>, String> {
    let module = o.file_url.strip_prefix("file://").unwrap_or(&o.file_url);
    let env = match token_env {
        Some(var) => format!(
            "      # global.token_env: Envoy copies this variable of its own process
      # environment into the VM.
      environment_variables:
        host_env_keys: [{}]
",
            q(var)
        ),
        None => String::new(),
    };
    let filter = format!(
        "\
# GENERATED by `ratelimit render {file} --target envoy`: do not edit;
# edit that file and render again. One entry of an HTTP connection manager's
# http_filters, before envoy.filters.http.router. The configuration below is
# that file verbatim; the gateway's policy ({}) is the same text.
name: envoy.filters.http.wasm
typed_config:
  \"@type\": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
  config:
    name: ratelimit
    root_id: ratelimit
    failure_policy: FAIL_RELOAD
    vm_config:
      vm_id: ratelimit
      runtime: envoy.wasm.runtime.v8
      code:
        local:
          filename: {}
{env}    configuration:
      \"@type\": type.googleapis.com/google.protobuf.StringValue
      value: |
{}
",
        policy_key(domain),
        q(module),
        indented(text, 8)
    );
    check_roundtrip(
        file,
        "envoy-wasm-filter.yaml",
        &filter,
        "/typed_config/config/configuration/value",
        true,
        source,
    )?;
    let policy = format!("{}\n", text.trim_end());
    Ok(vec![
        ("envoy-wasm-filter.yaml".into(), filter),
        (policy_key(domain), policy),
    ])
}
