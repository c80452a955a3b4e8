//! A real Envoy process rendered from `envoy/envoy.yaml`.
//!
//! Like every child of [`crate::process`], Envoy gets SIGTERM when the
//! *thread* that spawned it ends. Start it from the thread that uses it (a
//! test function, the demo's `main`) and keep the [`Envoy`] value alive
//! there; dropping it stops the process by its own PID.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::config::{demo_jwks, render_file, template_path, TemplateVars, DEFAULT_GATEWAY_PORT};
use crate::http::{Client, ConnectionMode};
use crate::paths::{envoy_bin, wasm_path};
use crate::ports::Ports;
use crate::process::{is_port_clash, start_retrying, Process};

/// How to start an [`Envoy`].
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// The plugin configuration (JSON text handed to the filter verbatim).
    pub plugin_config: String,
    /// Fixed ports; `None` picks free loopback ports (and retries with new
    /// ones if Envoy cannot bind).
    pub ports: Option<Ports>,
    /// Port of the `ratelimit-gateway` behind the `ratelimit_gateway`
    /// cluster; `None` renders [`DEFAULT_GATEWAY_PORT`].
    pub gateway_port: Option<u16>,
    /// The JSON Web Key Set (JSON text) that `jwt_authn` verifies bearer
    /// tokens with; `None` renders the demo key set `envoy/jwt/jwks.json`.
    pub jwks: Option<String>,
    /// Envoy bootstrap template; default `envoy/envoy.yaml`.
    pub template: Option<PathBuf>,
    /// The filter; default [`wasm_path()`].
    pub wasm: Option<PathBuf>,
    /// Worker threads (`--concurrency`); default 2.
    pub concurrency: u32,
    /// How long to wait for the admin `/ready` endpoint to say `LIVE`.
    pub ready_timeout: Duration,
    /// Directory for the rendered config and the log; default a fresh
    /// temporary directory removed on drop (kept when a test panics).
    pub work_dir: Option<PathBuf>,
    /// `--log-level`; default `info` (needed for the filter's log lines).
    pub log_level: String,
    /// `--component-log-level`; default `wasm:debug`.
    pub component_log_level: String,
    /// Environment variables of the wasm VM (`vm_config.environment_variables`),
    /// e.g. the gateway token that `global.token_env` names.
    pub vm_env: Vec<(String, String)>,
    /// TLS (and a client certificate) on the `ratelimit_gateway` cluster.
    pub gateway_tls: Option<GatewayTls>,
    /// The `ratelimit_gateway` cluster speaks HTTP/2 with prior knowledge
    /// (h2c): for `global.transport: grpc`, pointed at the gateway's
    /// `--grpc-listen`.
    pub gateway_http2: bool,
    /// Port of an outside upstream (a [`crate::Upstream`]) behind the
    /// `upstream` cluster, in place of the template's built-in one.
    pub upstream_port: Option<u16>,
    /// Writes the ingress listener's access log (the template's format) to
    /// `access.log` in the work directory ([`Envoy::access_log`]) in place of
    /// Envoy's stdout.
    pub access_log_file: bool,
}

/// An `UpstreamTlsContext` on the `ratelimit_gateway` cluster.
#[derive(Debug, Clone)]
pub struct GatewayTls {
    /// CA certificate (PEM) the gateway's certificate must chain to.
    pub ca: PathBuf,
    /// SNI and the name the gateway's certificate must hold.
    pub server_name: String,
    /// Client certificate chain and key (PEM), for mutual TLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

impl EnvoyOptions {
    /// Defaults for the given plugin configuration.
    pub fn new(plugin_config: impl Into<String>) -> Self {
        EnvoyOptions {
            plugin_config: plugin_config.into(),
            ports: None,
            gateway_port: None,
            jwks: None,
            template: None,
            wasm: None,
            concurrency: 2,
            ready_timeout: Duration::from_secs(30),
            work_dir: None,
            log_level: "info".to_string(),
            component_log_level: "wasm:debug".to_string(),
            vm_env: Vec::new(),
            gateway_tls: None,
            gateway_http2: false,
            upstream_port: None,
            access_log_file: false,
        }
    }

    /// Writes the ingress listener's access log to a file
    /// ([`EnvoyOptions::access_log_file`]).
    pub fn access_log_file(mut self) -> Self {
        self.access_log_file = true;
        self
    }

    /// Sends the routed requests to the upstream on 127.0.0.1:`port`
    /// instead of the template's built-in listener (which is left out).
    pub fn upstream_port(mut self, port: u16) -> Self {
        self.upstream_port = Some(port);
        self
    }

    /// Sets an environment variable of the wasm VM.
    pub fn vm_env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.vm_env.push((name.into(), value.into()));
        self
    }

    /// Calls the gateway over TLS.
    pub fn gateway_tls(mut self, tls: GatewayTls) -> Self {
        self.gateway_tls = Some(tls);
        self
    }

    /// Speaks HTTP/2 to the gateway ([`EnvoyOptions::gateway_http2`]).
    pub fn gateway_http2(mut self) -> Self {
        self.gateway_http2 = true;
        self
    }

    /// Uses fixed ports instead of free ones.
    pub fn ports(mut self, ports: Ports) -> Self {
        self.ports = Some(ports);
        self
    }

    /// Points the `ratelimit_gateway` cluster at 127.0.0.1:`port`.
    pub fn gateway_port(mut self, port: u16) -> Self {
        self.gateway_port = Some(port);
        self
    }

    /// Makes `jwt_authn` verify tokens against `jwks` (JSON Web Key Set text)
    /// instead of the demo key set.
    pub fn jwks(mut self, jwks: impl Into<String>) -> Self {
        self.jwks = Some(jwks.into());
        self
    }

    /// Writes the rendered config and the log into `dir` (created if needed).
    pub fn work_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.work_dir = Some(dir.into());
        self
    }
}

/// Where the rendered config and the log of one process live: a temporary
/// directory, or one the caller chose. Also used by [`crate::gateway`].
#[derive(Debug)]
pub(crate) enum WorkDir {
    Temp(tempfile::TempDir),
    Fixed(PathBuf),
}

impl WorkDir {
    /// `dir` (created if needed), or a fresh temporary directory named
    /// `prefix…` when `None`.
    pub(crate) fn new(dir: Option<&Path>, prefix: &str) -> Result<WorkDir> {
        Ok(match dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                WorkDir::Fixed(d.to_path_buf())
            }
            None => WorkDir::Temp(
                tempfile::Builder::new()
                    .prefix(prefix)
                    .tempdir()
                    .context("creating a temporary directory")?,
            ),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        match self {
            WorkDir::Temp(t) => t.path(),
            WorkDir::Fixed(p) => p,
        }
    }
}

/// The access log's file name in the work directory.
const ACCESS_LOG: &str = "access.log";

/// How long the filter may take to hand its counts to Envoy: it counts in
/// the VM and flushes on its root's tick, every 100 ms at the longest
/// (`vm::timers::FLUSH_TICK`); twice that and a margin.
pub const FILTER_FLUSH: Duration = Duration::from_millis(250);

/// A running Envoy, stopped (SIGTERM, then SIGKILL) when dropped.
#[derive(Debug)]
pub struct Envoy {
    process: Process,
    ports: Ports,
    base_id: u32,
    config_path: PathBuf,
    // Dropped last: removes the temporary directory.
    dir: Option<WorkDir>,
}

impl Envoy {
    /// Starts Envoy and waits until its admin `/ready` says `LIVE`.
    ///
    /// When the ports were picked automatically and Envoy could not bind one
    /// of them, retries with new ports ([`crate::process::start_retrying`]).
    pub fn start(opts: EnvoyOptions) -> Result<Envoy> {
        start_retrying("Envoy", opts.ports.is_none(), || {
            let mut envoy = Envoy::spawn(opts.clone())?;
            match envoy.wait_live(opts.ready_timeout) {
                Ok(()) => Ok(envoy),
                Err(e) => Err(envoy.process.failed(e)),
            }
        })
    }

    /// Starts several Envoys at once and waits until every one is ready:
    /// their startups (mostly V8 compiling the module) overlap. Like
    /// [`Envoy::start`], an Envoy on automatically picked ports that could not
    /// bind is started again on new ones.
    ///
    /// Call it from the thread that keeps the returned values (see the
    /// module documentation).
    pub fn start_all(opts: &[EnvoyOptions]) -> Result<Vec<Envoy>> {
        let mut envoys = opts
            .iter()
            .map(|o| Envoy::spawn(o.clone()))
            .collect::<Result<Vec<_>>>()?;
        for (envoy, o) in envoys.iter_mut().zip(opts) {
            if let Err(e) = envoy.wait_live(o.ready_timeout) {
                if o.ports.is_some() || !is_port_clash(&envoy.log()) {
                    return Err(e);
                }
                *envoy = Envoy::start(o.clone())?;
            }
        }
        Ok(envoys)
    }

    /// Starts Envoy without waiting for it to be ready.
    pub fn spawn(opts: EnvoyOptions) -> Result<Envoy> {
        let envoy = envoy_bin()?;
        let wasm = match &opts.wasm {
            Some(w) => w.clone(),
            None => wasm_path()?,
        };
        let template = opts.template.clone().unwrap_or_else(template_path);
        let ports = match opts.ports {
            Some(p) => p,
            None => Ports::free().context("picking free ports")?,
        };
        let dir = WorkDir::new(opts.work_dir.as_deref(), "ratelimit-envoy-")?;
        let vars = TemplateVars {
            ports,
            gateway_port: opts.gateway_port.unwrap_or(DEFAULT_GATEWAY_PORT),
            wasm_path: wasm,
            plugin_config: opts.plugin_config.clone(),
            jwks: match &opts.jwks {
                Some(j) => j.clone(),
                None => demo_jwks()?,
            },
        };
        let mut rendered = render_file(&template, &vars)?;
        if !opts.vm_env.is_empty()
            || opts.gateway_tls.is_some()
            || opts.gateway_http2
            || opts.upstream_port.is_some()
            || opts.access_log_file
        {
            rendered = customize(&rendered, &opts, &dir.path().join(ACCESS_LOG))?;
        }
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, rendered)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let log_path = dir.path().join("envoy.log");
        // A fresh log for a fresh work directory's Envoy.
        File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let base_id = unique_base_id(ports);

        let mut cmd = Command::new(&envoy);
        cmd.arg("-c")
            .arg(&config_path)
            .arg("--concurrency")
            .arg(opts.concurrency.to_string())
            .arg("--base-id")
            .arg(base_id.to_string())
            .arg("--log-level")
            .arg(&opts.log_level)
            .arg("--component-log-level")
            .arg(&opts.component_log_level);
        let process = Process::spawn("Envoy", cmd, &log_path)?;
        Ok(Envoy {
            process,
            ports,
            base_id,
            config_path,
            dir: Some(dir),
        })
    }

    /// The ingress listener's access log so far (empty unless started with
    /// [`EnvoyOptions::access_log_file`]; Envoy flushes it every second).
    pub fn access_log(&self) -> String {
        let dir = self.dir.as_ref().map(|d| d.path().join(ACCESS_LOG));
        dir.and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Polls the admin `/ready` endpoint until it answers `LIVE`.
    ///
    /// Fails early if Envoy exits, and after `timeout`; both errors include
    /// the tail of Envoy's log.
    pub fn wait_live(&mut self, timeout: Duration) -> Result<()> {
        let admin = Client::with_timeout(
            self.admin_url(""),
            ConnectionMode::NewPerRequest,
            Duration::from_secs(2),
        );
        let config = self.config_path.display().to_string();
        self.process
            .wait_ready(timeout, |_| match admin.get("/ready", &[]) {
                Ok(r) if r.status == 200 && r.body.trim() == "LIVE" => Ok(()),
                Ok(r) => Err(format!("/ready answered {} {:?}", r.status, r.body.trim())),
                Err(e) => Err(format!("/ready: {e:#}")),
            })
            .with_context(|| format!("Envoy with config {config}"))
    }

    /// The exit status if Envoy has exited, without blocking.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        self.process.try_wait()
    }

    /// Waits up to `timeout` for Envoy to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        self.process.wait_exit(timeout)
    }

    /// Stops Envoy: SIGTERM to its own PID, then SIGKILL after 5 s.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        self.process
            .stop(Duration::from_secs(5))?
            .context("Envoy was stopped without an exit status")
    }

    /// Kills Envoy now (SIGKILL, as a crash): its streams end without
    /// their `on_log`, and its ports are free when this returns.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Envoy's process id (0 once stopped).
    pub fn pid(&self) -> u32 {
        self.process.pid().unwrap_or_default()
    }

    /// The ports Envoy listens on.
    pub fn ports(&self) -> Ports {
        self.ports
    }

    /// The `--base-id` given to this Envoy.
    pub fn base_id(&self) -> u32 {
        self.base_id
    }

    /// The rendered bootstrap config.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// The file that receives Envoy's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        self.process.log_path()
    }

    /// `http://127.0.0.1:<listen port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports.listen)
    }

    /// `http://127.0.0.1:<admin port><path>`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports.admin)
    }

    /// A client for the rate-limited listener.
    pub fn client(&self, mode: ConnectionMode) -> Client {
        Client::new(self.url(""), mode)
    }

    /// Envoy's whole log so far (lossy UTF-8; empty if unreadable).
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// The last `lines` lines of Envoy's log.
    pub fn log_tail(&self, lines: usize) -> String {
        self.process.log_tail(lines)
    }

    /// Waits up to `timeout` for `needle` to appear in the log.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        self.process.wait_for_log(needle, timeout)
    }

    /// The admin `/stats/prometheus` page, read once the filter's workers
    /// have flushed what they counted so far ([`FILTER_FLUSH`]).
    pub fn stats_prometheus(&self) -> Result<String> {
        std::thread::sleep(FILTER_FLUSH);
        let admin = Client::new(self.admin_url(""), ConnectionMode::NewPerRequest);
        let r = admin.get("/stats/prometheus", &[])?;
        if r.status != 200 {
            bail!("/stats/prometheus answered {}: {}", r.status, r.body);
        }
        Ok(r.body)
    }

    /// The value of the admin `/stats` counter or gauge `name` (for
    /// example `listener.127.0.0.1_10000.downstream_cx_total`), or `None`
    /// when Envoy does not show it.
    pub fn stat(&self, name: &str) -> Result<Option<u64>> {
        std::thread::sleep(FILTER_FLUSH);
        let admin = Client::new(self.admin_url(""), ConnectionMode::NewPerRequest);
        let r = admin.get("/stats?usedonly", &[])?;
        if r.status != 200 {
            bail!("/stats answered {}: {}", r.status, r.body);
        }
        for line in r.body.lines() {
            if let Some((n, v)) = line.split_once(": ") {
                if n == name {
                    return Ok(v.trim().parse().ok());
                }
            }
        }
        Ok(None)
    }

    /// The value of the Prometheus metric `name` (summed over its series),
    /// or `None` when Envoy does not show it.
    pub fn metric(&self, name: &str) -> Result<Option<f64>> {
        Ok(prometheus_value(&self.stats_prometheus()?, name))
    }

    /// The counter `name` summed over `envoys` (0 where one does not show it).
    pub fn summed(envoys: &[Envoy], name: &str) -> Result<u64> {
        let mut total = 0;
        for e in envoys {
            total += e.metric(name)?.unwrap_or(0.0) as u64;
        }
        Ok(total)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.stop();
        if std::thread::panicking() {
            eprintln!(
                "--- Envoy (pid {}, config {}) log tail ---\n{}\n--- end of Envoy log ---",
                self.pid(),
                self.config_path.display(),
                self.log_tail(30)
            );
            if let Some(WorkDir::Temp(t)) = self.dir.take() {
                eprintln!("kept Envoy's files in {}", t.keep().display());
            }
        }
    }
}

/// The entry of list `v` named `name`.
fn named<'a>(v: &'a mut serde_norway::Value, name: &str) -> Result<&'a mut serde_norway::Value> {
    v.as_sequence_mut()
        .and_then(|list| {
            list.iter_mut()
                .find(|e| e.get("name").and_then(|n| n.as_str()) == Some(name))
        })
        .with_context(|| format!("no `{name}` in the rendered template"))
}

/// Descends `keys` (a number indexes a list) from `v`.
fn at<'a>(v: &'a mut serde_norway::Value, keys: &[&str]) -> Result<&'a mut serde_norway::Value> {
    let mut v = v;
    for k in keys {
        v = match k.parse::<usize>() {
            Ok(i) => v.get_mut(i),
            Err(_) => v.get_mut(*k),
        }
        .with_context(|| format!("no `{k}` in the rendered template"))?;
    }
    Ok(v)
}

/// The ingress listener's HTTP connection manager.
fn ingress_hcm(doc: &mut serde_norway::Value) -> Result<&mut serde_norway::Value> {
    let listeners = at(doc, &["static_resources", "listeners"])?;
    at(
        named(listeners, "ingress")?,
        &["filter_chains", "0", "filters", "0"],
    )
}

/// The rendered template with the VM's environment variables and the
/// gateway cluster's TLS of `opts` (edited as YAML data; the template itself
/// stays as shipped).
fn customize(rendered: &str, opts: &EnvoyOptions, access_log: &Path) -> Result<String> {
    use serde_norway::{Mapping, Value};
    let mut doc: Value =
        serde_norway::from_str(rendered).context("parsing the rendered template")?;
    if !opts.vm_env.is_empty() {
        let hcm = ingress_hcm(&mut doc)?;
        let filters = at(hcm, &["typed_config", "http_filters"])?;
        let wasm = named(filters, "envoy.filters.http.wasm")?;
        let vm = at(wasm, &["typed_config", "config", "vm_config"])?;
        let mut vars = Mapping::new();
        for (k, v) in &opts.vm_env {
            vars.insert(Value::from(k.as_str()), Value::from(v.as_str()));
        }
        let mut env = Mapping::new();
        env.insert("key_values".into(), Value::Mapping(vars));
        vm.as_mapping_mut()
            .context("vm_config is not a mapping")?
            .insert("environment_variables".into(), Value::Mapping(env));
    }
    if let Some(tls) = &opts.gateway_tls {
        let file = |p: &Path| -> Result<Value> {
            let p = p.to_str().context("a TLS path is not UTF-8")?;
            Ok(serde_norway::from_str(&format!(
                "{{ filename: {} }}",
                serde_json::to_string(p)?
            ))?)
        };
        let mut common = Mapping::new();
        let mut validation = Mapping::new();
        validation.insert("trusted_ca".into(), file(&tls.ca)?);
        common.insert("validation_context".into(), Value::Mapping(validation));
        if let Some((cert, key)) = &tls.client_cert {
            let mut pair = Mapping::new();
            pair.insert("certificate_chain".into(), file(cert)?);
            pair.insert("private_key".into(), file(key)?);
            common.insert(
                "tls_certificates".into(),
                Value::Sequence(vec![Value::Mapping(pair)]),
            );
        }
        let mut ctx = Mapping::new();
        ctx.insert(
            "@type".into(),
            "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
                .into(),
        );
        ctx.insert("sni".into(), tls.server_name.as_str().into());
        ctx.insert("common_tls_context".into(), Value::Mapping(common));
        let mut socket = Mapping::new();
        socket.insert("name".into(), "envoy.transport_sockets.tls".into());
        socket.insert("typed_config".into(), Value::Mapping(ctx));
        let clusters = at(&mut doc, &["static_resources", "clusters"])?;
        named(clusters, "ratelimit_gateway")?
            .as_mapping_mut()
            .context("the gateway cluster is not a mapping")?
            .insert("transport_socket".into(), Value::Mapping(socket));
    }
    if opts.gateway_http2 {
        let clusters = at(&mut doc, &["static_resources", "clusters"])?;
        let options = at(
            named(clusters, "ratelimit_gateway")?,
            &[
                "typed_extension_protocol_options",
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            ],
        )?;
        let http2: Value = serde_norway::from_str("{ http2_protocol_options: {} }")?;
        options
            .as_mapping_mut()
            .context("the gateway cluster's protocol options are not a mapping")?
            .insert("explicit_http_config".into(), http2);
    }
    if opts.access_log_file {
        let hcm = ingress_hcm(&mut doc)?;
        let logger = at(hcm, &["typed_config", "access_log", "0"])?
            .as_mapping_mut()
            .context("the access logger is not a mapping")?;
        logger.insert("name".into(), "envoy.access_loggers.file".into());
        let config = logger
            .get_mut("typed_config")
            .and_then(Value::as_mapping_mut)
            .context("the access logger has no typed_config")?;
        config.insert(
            "@type".into(),
            "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog".into(),
        );
        let path = access_log
            .to_str()
            .context("the access log path is not UTF-8")?;
        config.insert("path".into(), path.into());
    }
    if let Some(port) = opts.upstream_port {
        let listeners = at(&mut doc, &["static_resources", "listeners"])?
            .as_sequence_mut()
            .context("listeners is not a list")?;
        listeners.retain(|l| l.get("name").and_then(|n| n.as_str()) != Some("upstream"));
        let clusters = at(&mut doc, &["static_resources", "clusters"])?;
        let address = at(
            named(clusters, "upstream")?,
            &[
                "load_assignment",
                "endpoints",
                "0",
                "lb_endpoints",
                "0",
                "endpoint",
                "address",
                "socket_address",
            ],
        )?;
        address
            .as_mapping_mut()
            .context("the upstream address is not a mapping")?
            .insert("port_value".into(), Value::from(port));
    }
    serde_norway::to_string(&doc).context("writing the customized template")
}

/// A `--base-id` no other Envoy of this machine uses right now: derived from
/// the admin port (which this Envoy is about to hold) and a per-process
/// counter.
fn unique_base_id(ports: Ports) -> u32 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed) % 16;
    u32::from(ports.admin) * 16 + n
}

/// The value of metric `name` in a Prometheus text page, summed over all its
/// series; `None` when no sample has that exact name.
///
/// ```
/// let page = "# TYPE ratelimit_wasm_requests_denied counter\n\
///             ratelimit_wasm_requests_denied{} 140\n";
/// assert_eq!(testkit::prometheus_value(page, "ratelimit_wasm_requests_denied"), Some(140.0));
/// assert_eq!(testkit::prometheus_value(page, "ratelimit_wasm_requests"), None);
/// ```
pub fn prometheus_value(page: &str, name: &str) -> Option<f64> {
    let mut total = None;
    for line in page.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let rest = match rest.chars().next() {
            Some('{') => match rest.find('}') {
                Some(i) => &rest[i + 1..],
                None => continue,
            },
            Some(' ') => rest,
            _ => continue,
        };
        if let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *total.get_or_insert(0.0) += v;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prometheus_values() {
        let page =
            "# TYPE a_total counter\na_total{} 3\na_total_more 9\na_total{x=\"1\"} 4\nb 2.5\n";
        assert_eq!(prometheus_value(page, "a_total"), Some(7.0));
        assert_eq!(prometheus_value(page, "b"), Some(2.5));
        assert_eq!(prometheus_value(page, "c"), None);
    }
}
