//! Rendering the Envoy bootstrap template and validating configs.
//!
//! `envoy/` holds only Envoy bootstrap templates (`*.yaml`) and plugin
//! configurations (`*.json`). A template has placeholders written `${NAME}`:
//! `LISTEN_PORT`, `ADMIN_PORT`, `UPSTREAM_PORT` and `GATEWAY_PORT` become integers;
//! `WASM_PATH`, `PLUGIN_CONFIG` and `JWKS` become JSON string literals (which
//! are also valid YAML double-quoted scalars), so they stand unquoted in the
//! template.
//!
//! `envoy/jwt/` holds the demo's JWT material: `jwks.json`, the key set that
//! the template's `jwt_authn` verifies tokens with unless told otherwise, and
//! `demo-signing-key.pem`, its RS256 private key (demo and tests only).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};

use crate::paths::{envoy_bin, wasm_path, workspace_root};
use crate::ports::Ports;

/// The values substituted into an Envoy bootstrap template.
#[derive(Debug, Clone)]
pub struct TemplateVars {
    /// Listener, admin and upstream ports.
    pub ports: Ports,
    /// Port of the `ratelimit_gateway` cluster (a `ratelimit-gateway` on
    /// 127.0.0.1); [`DEFAULT_GATEWAY_PORT`] when the test uses no gateway.
    pub gateway_port: u16,
    /// Path of `ratelimit_wasm.wasm`.
    pub wasm_path: PathBuf,
    /// The plugin configuration (JSON text, passed to the filter verbatim).
    pub plugin_config: String,
    /// The JSON Web Key Set (JSON text) that `jwt_authn` verifies bearer
    /// tokens with; usually [`demo_jwks()`].
    pub jwks: String,
}

/// The gateway port rendered when none is given: the default `--listen`
/// port of `ratelimit-gateway` (127.0.0.1:8081). A plugin configuration
/// without global rules never calls it.
pub const DEFAULT_GATEWAY_PORT: u16 = 8081;

/// Path of the one Envoy bootstrap template, `<workspace>/envoy/envoy.yaml`.
pub fn template_path() -> PathBuf {
    workspace_root().join("envoy/envoy.yaml")
}

/// Path of the demo's plugin configuration, `<workspace>/envoy/ratelimit-demo.json`:
/// `envoy/ratelimit.json` keyed on the client-written `x-client-id` on purpose,
/// so that one machine can play several clients.
pub fn demo_plugin_config_path() -> PathBuf {
    workspace_root().join("envoy/ratelimit-demo.json")
}

/// Path of the demo's plugin configuration with a global rule (two proxies
/// sharing one limit through the gateway), `<workspace>/envoy/ratelimit-global.json`.
pub fn demo_global_plugin_config_path() -> PathBuf {
    workspace_root().join("envoy/ratelimit-global.json")
}

/// Path of the demo's JSON Web Key Set, `<workspace>/envoy/jwt/jwks.json`:
/// the public half of [`demo_signing_key_path()`], rendered into the
/// template's `jwt_authn` provider (issuer [`DEMO_JWT_ISSUER`]) by default.
pub fn demo_jwks_path() -> PathBuf {
    workspace_root().join("envoy/jwt/jwks.json")
}

/// Path of the demo's RS256 signing key (PKCS#1 PEM),
/// `<workspace>/envoy/jwt/demo-signing-key.pem`. DEMO ONLY: it is public, so
/// anyone can mint tokens that the demo JWKS accepts.
pub fn demo_signing_key_path() -> PathBuf {
    workspace_root().join("envoy/jwt/demo-signing-key.pem")
}

/// The `iss` that the template's `jwt_authn` provider requires.
pub const DEMO_JWT_ISSUER: &str = "ratelimit-wasm-demo";

/// The `kid` of the demo key in [`demo_jwks_path()`].
pub const DEMO_JWT_KID: &str = "ratelimit-wasm-demo-1";

/// The text of the demo JWKS ([`demo_jwks_path()`]).
pub fn demo_jwks() -> Result<String> {
    let path = demo_jwks_path();
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// Encodes `s` as a JSON string literal (quotes included).
fn json_string(s: &str) -> Result<String> {
    serde_json::to_string(s).context("encoding a JSON string")
}

/// Substitutes every `${NAME}` placeholder of `template`.
///
/// Fails on a placeholder it does not know, and when the wasm path is not
/// UTF-8.
///
/// ```
/// use testkit::{render_template, Ports, TemplateVars};
/// let vars = TemplateVars {
///     ports: Ports { listen: 10000, admin: 9901, upstream: 10001 },
///     gateway_port: 8081,
///     wasm_path: "/opt/ratelimit_wasm.wasm".into(),
///     plugin_config: r#"{"domain": "d"}"#.to_string(),
///     jwks: r#"{"keys": []}"#.to_string(),
/// };
/// let out = render_template("port: ${LISTEN_PORT}\nvalue: ${PLUGIN_CONFIG}\n", &vars).unwrap();
/// assert_eq!(out, "port: 10000\nvalue: \"{\\\"domain\\\": \\\"d\\\"}\"\n");
/// ```
pub fn render_template(template: &str, vars: &TemplateVars) -> Result<String> {
    let wasm = vars
        .wasm_path
        .to_str()
        .ok_or_else(|| anyhow!("wasm path {:?} is not UTF-8", vars.wasm_path))?;
    let values = [
        ("LISTEN_PORT", vars.ports.listen.to_string()),
        ("ADMIN_PORT", vars.ports.admin.to_string()),
        ("UPSTREAM_PORT", vars.ports.upstream.to_string()),
        ("GATEWAY_PORT", vars.gateway_port.to_string()),
        ("WASM_PATH", json_string(wasm)?),
        ("PLUGIN_CONFIG", json_string(&vars.plugin_config)?),
        ("JWKS", json_string(&vars.jwks)?),
    ];
    let mut out = String::with_capacity(template.len() + vars.plugin_config.len() * 2);
    let mut rest = template;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| anyhow!("unterminated placeholder at {:?}", truncate(&rest[start..])))?;
        let name = &after[..end];
        let value = values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| anyhow!("unknown placeholder ${{{name}}} in the Envoy template"))?;
        out.push_str(value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(40) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Reads the template at `template` and renders it with `vars`.
pub fn render_file(template: &Path, vars: &TemplateVars) -> Result<String> {
    let text = std::fs::read_to_string(template)
        .with_context(|| format!("reading Envoy template {}", template.display()))?;
    render_template(&text, vars).with_context(|| format!("rendering {}", template.display()))
}

/// Runs `envoy --mode validate -c config` and returns its output on failure.
///
/// In validate mode Envoy loads the Wasm module and configures the plugin, so
/// this checks the plugin configuration as well.
pub fn validate_config(config: &Path) -> Result<()> {
    let envoy = envoy_bin()?;
    let out = Command::new(&envoy)
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(config)
        .args(["--log-level", "info", "--component-log-level", "wasm:debug"])
        .output()
        .with_context(|| format!("running {}", envoy.display()))?;
    if !out.status.success() {
        bail!(
            "envoy --mode validate -c {} failed ({}):\n{}{}",
            config.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Renders every Envoy template `envoy/*.yaml` with every plugin
/// configuration `envoy/*.json` and validates each with `envoy --mode
/// validate`. Returns one line per validated combination; fails listing
/// every combination that did not validate.
pub fn validate_shipped_configs() -> Result<Vec<String>> {
    let dir = workspace_root().join("envoy");
    let mut templates = Vec::new();
    let mut plugins = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("yaml") | Some("yml") => templates.push(path),
            Some("json") => plugins.push(path),
            _ => {}
        }
    }
    templates.sort();
    plugins.sort();
    if templates.is_empty() || plugins.is_empty() {
        bail!(
            "no Envoy template (*.yaml) or plugin config (*.json) in {}",
            dir.display()
        );
    }
    let wasm = wasm_path()?;
    let jwks = demo_jwks()?;
    let work = tempfile::Builder::new()
        .prefix("ratelimit-validate-")
        .tempdir()
        .context("creating a temporary directory")?;
    let mut ok = Vec::new();
    let mut failures = Vec::new();
    for template in &templates {
        for plugin in &plugins {
            let label = format!("{} + {}", file_name(template), file_name(plugin));
            let result = (|| -> Result<()> {
                let plugin_config = std::fs::read_to_string(plugin)
                    .with_context(|| format!("reading {}", plugin.display()))?;
                let vars = TemplateVars {
                    ports: Ports::free()?,
                    gateway_port: DEFAULT_GATEWAY_PORT,
                    wasm_path: wasm.clone(),
                    plugin_config,
                    jwks: jwks.clone(),
                };
                let rendered = render_file(template, &vars)?;
                let out = work.path().join(format!(
                    "{}-{}.yaml",
                    file_stem(template),
                    file_stem(plugin)
                ));
                std::fs::write(&out, rendered)
                    .with_context(|| format!("writing {}", out.display()))?;
                validate_config(&out)
            })();
            match result {
                Ok(()) => ok.push(format!("OK {label}")),
                Err(e) => failures.push(format!("FAILED {label}: {e:#}")),
            }
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(ok)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn file_stem(p: &Path) -> String {
    p.file_stem()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(config: &str) -> TemplateVars {
        TemplateVars {
            ports: Ports {
                listen: 1,
                admin: 2,
                upstream: 3,
            },
            gateway_port: 4,
            wasm_path: PathBuf::from("/x/\"q\".wasm"),
            plugin_config: config.to_string(),
            jwks: "{\"keys\": []}".to_string(),
        }
    }

    #[test]
    fn substitutes_every_placeholder() {
        let t = "a: ${LISTEN_PORT}\nb: ${ADMIN_PORT}\nc: ${UPSTREAM_PORT} ${UPSTREAM_PORT}\ng: ${GATEWAY_PORT}\nw: ${WASM_PATH}\np: ${PLUGIN_CONFIG}\nj: ${JWKS}\n";
        let out = render_template(t, &vars("{\"k\": \"v\\n\"}\n")).unwrap();
        assert_eq!(
            out,
            "a: 1\nb: 2\nc: 3 3\ng: 4\nw: \"/x/\\\"q\\\".wasm\"\np: \"{\\\"k\\\": \\\"v\\\\n\\\"}\\n\"\nj: \"{\\\"keys\\\": []}\"\n"
        );
    }

    #[test]
    fn rejects_unknown_and_unterminated_placeholders() {
        let e = render_template("x: ${NOPE}", &vars("{}")).unwrap_err();
        assert!(e.to_string().contains("${NOPE}"), "{e}");
        assert!(render_template("x: ${LISTEN_PORT", &vars("{}")).is_err());
    }

    #[test]
    fn shipped_template_has_only_known_placeholders() {
        let out = render_file(&template_path(), &vars("{}")).unwrap();
        assert!(!out.contains("${"));
        // The gateway cluster that global rules name, on the rendered port.
        let cluster = out
            .split("- name: ratelimit_gateway")
            .nth(1)
            .expect("a ratelimit_gateway cluster");
        assert!(
            cluster.contains("port_value: 4 }"),
            "gateway port: {cluster}"
        );
        // jwt_authn verifies tokens against the rendered JWKS, before the
        // wasm filter reads the claims it wrote.
        assert!(
            out.contains("inline_string: \"{\\\"keys\\\": []}\""),
            "{out}"
        );
        let jwt = out
            .find("- name: envoy.filters.http.jwt_authn")
            .expect("jwt_authn");
        let wasm = out
            .find("- name: envoy.filters.http.wasm")
            .expect("wasm filter");
        assert!(jwt < wasm, "jwt_authn must run before the wasm filter");
        assert!(out.contains(&format!("issuer: {DEMO_JWT_ISSUER}")), "{out}");
    }

    #[test]
    fn demo_jwks_is_one_public_rs256_key() {
        let jwks: serde_json::Value = serde_json::from_str(&demo_jwks().unwrap()).unwrap();
        let keys = jwks["keys"].as_array().expect("keys");
        assert_eq!(keys.len(), 1, "{jwks}");
        let key = &keys[0];
        assert_eq!(key["kty"], "RSA");
        assert_eq!(key["alg"], "RS256");
        assert_eq!(key["kid"], DEMO_JWT_KID);
        // The public half only: no private exponent or primes.
        for private in ["d", "p", "q", "dp", "dq", "qi"] {
            assert!(key.get(private).is_none(), "{private} in the JWKS");
        }
        assert!(demo_signing_key_path().is_file());
    }
}
