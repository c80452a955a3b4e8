//! A deterministic proxy-wasm host for tests: loads the compiled filter into wasmtime, runs N
//! "workers" (one VM and one `Store` each, like Envoy's worker threads), all sharing one
//! shared-data store (with Envoy's exact semantics), one fake clock and one metrics store.
//!
//! Use it from a test file with `mod harness;`.
//!
//! ```ignore
//! let h = Harness::new(2, r#"{"domain":"demo", ...}"#).unwrap();
//! assert!(h.configured(0));
//! let out = h.send(0, Request::get("/").header("x-client-id", "alice"));
//! assert_eq!(out.status, 200);
//! h.advance(Duration::from_secs(1));
//! ```
//!
//! Everything the filter asks the host for goes through `host.rs`; races are forced with the
//! shared-data hooks (`before_next_shared_set`, `after_next_shared_get`, `fail_next_cas_sets`),
//! whose closures get a `&Harness` and may drive other workers.
//!
//! A wasm trap panics the test with the trap message, the wasm backtrace and the worker's last
//! log lines (a Rust panic inside the filter prints its message to stderr, which is captured).

#![allow(dead_code, unused_imports)]

pub mod host;
pub mod shared;
pub mod wire;

pub use host::StreamPhase;
pub use shared::{status, SharedData, SharedStats};

use host::{AfterAction, HostState, StreamState};
use std::cell::{Cell, OnceCell, Ref, RefCell, RefMut};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use wasmtime::{Engine, Instance, Module, Store, Val, WasmParams, WasmResults};

/// The root context id the harness gives the plugin on every worker.
pub const ROOT_CONTEXT_ID: u32 = 1;
/// The fake clock starts here: 2023-11-14T22:13:20Z.
pub const DEFAULT_START_NS: u64 = 1_700_000_000 * 1_000_000_000;
/// Default downstream address of a `Request`.
pub const DEFAULT_SOURCE: &str = "192.0.2.10:40000";

/// The filter built by `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.
pub fn default_wasm_path() -> PathBuf {
    if let Ok(p) = std::env::var("RATELIMIT_WASM") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/wasm32-wasip1/release/ratelimit_wasm.wasm")
}

// ---------------------------------------------------------------------------------------------
// Engine and module, compiled once per process.

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut config = wasmtime::Config::new();
        config.wasm_backtrace_details(wasmtime::WasmBacktraceDetails::Enable);
        Engine::new(&config).expect("wasmtime engine")
    })
}

/// Loads (and caches for the life of the process) the module at `path`.
/// Panics with build instructions if the file does not exist.
pub fn load_module(path: &Path) -> anyhow::Result<Module> {
    static MODULES: OnceLock<Mutex<HashMap<PathBuf, Module>>> = OnceLock::new();
    let modules = MODULES.get_or_init(Default::default);
    // Hold the lock while compiling so parallel tests compile the module only once.
    let mut modules = modules.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(m) = modules.get(path) {
        return Ok(m.clone());
    }
    if !path.exists() {
        panic!(
            "the wasm filter {} does not exist: build it first with\n    \
             cargo build --release --target wasm32-wasip1 -p ratelimit-wasm\n\
             (or point RATELIMIT_WASM at another .wasm file)",
            path.display()
        );
    }
    let bytes = std::fs::read(path)?;
    let module = match cached_module(&bytes) {
        Some(m) => m,
        None => {
            let m = Module::from_binary(engine(), &bytes)
                .map_err(|e| anyhow::anyhow!("compiling {}: {e:?}", path.display()))?;
            store_cached_module(&bytes, &m);
            m
        }
    };
    modules.insert(path.to_path_buf(), module.clone());
    Ok(module)
}

/// Compiling the filter with a debug build of cranelift takes several seconds, so the
/// compiled code is kept in `target/tmp/wasm-harness-cache`, keyed by a hash of the wasm
/// bytes and the wasmtime version. Any problem with the cache just means compiling again.
fn cache_file(bytes: &[u8]) -> PathBuf {
    let mut hasher = std::hash::DefaultHasher::new();
    hasher.write(bytes);
    hasher.write(wasmtime_version().as_bytes());
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("wasm-harness-cache")
        .join(format!("{:016x}-{}.cwasm", hasher.finish(), bytes.len()))
}

fn wasmtime_version() -> &'static str {
    // The engine refuses artifacts of another version or configuration on its own; the
    // version in the key just keeps old files from being tried at all.
    concat!(env!("CARGO_PKG_NAME"), "/wasmtime-48")
}

fn cached_module(bytes: &[u8]) -> Option<Module> {
    let file = cache_file(bytes);
    if !file.exists() {
        return None;
    }
    // SAFETY: the file was written by `store_cached_module` from `Module::serialize` of
    // this very wasm (keyed by its hash) in this build's own target directory; wasmtime
    // also checks the artifact's version and engine configuration before using it.
    unsafe { Module::deserialize_file(engine(), &file) }.ok()
}

fn store_cached_module(bytes: &[u8], module: &Module) {
    let file = cache_file(bytes);
    let Ok(data) = module.serialize() else { return };
    if let Some(dir) = file.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // Write then rename, so a concurrent test process never reads half a file.
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, data).is_ok() {
        let _ = std::fs::rename(&tmp, &file);
    }
    // Keep the 8 most recent artifacts (each rebuild of the filter makes a new one).
    let Some(dir) = file.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    for (_, old) in files.into_iter().skip(8) {
        let _ = std::fs::remove_file(old);
    }
}

// ---------------------------------------------------------------------------------------------
// Public data types.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl LogLevel {
    pub fn from_i32(v: i32) -> Option<LogLevel> {
        Some(match v {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            5 => LogLevel::Critical,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogSource {
    /// `proxy_log`.
    Proxy,
    /// WASI stdout (fd 1).
    Stdout,
    /// WASI stderr (fd 2); Rust panic messages land here.
    Stderr,
}

#[derive(Clone, Debug)]
pub struct LogEntry {
    pub worker: usize,
    pub level: LogLevel,
    pub source: LogSource,
    pub message: String,
}

impl fmt::Display for LogEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[w{} {:?} {:?}] {}",
            self.worker, self.level, self.source, self.message
        )
    }
}

/// What `proxy_on_request_headers` / `proxy_on_response_headers` returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
    Other(i32),
}

impl Action {
    fn from_i32(v: i32) -> Action {
        match v {
            0 => Action::Continue,
            1 => Action::Pause,
            v => Action::Other(v),
        }
    }
}

/// A `proxy_send_local_response` call as the filter made it.
#[derive(Clone, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub body: Vec<u8>,
    /// The headers as passed (decoded from the pairs serialization, names as given).
    pub headers: Vec<(String, Vec<u8>)>,
    pub details: String,
    pub grpc_status: i32,
}

/// State of an http callout. Envoy makes every callout on the plugin's root context
/// (proxy-wasm-cpp-host `http_call` uses `root_context()`), so the end of the stream that
/// asked for it does not cancel it: its answer still arrives, to the root context, and the
/// SDK drops it if the asking context is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallState {
    Pending,
    /// `respond_http_call`.
    Answered,
    /// `fail_http_call`: the stream to the cluster was reset (0 headers, 0 body).
    Failed,
    /// Its timeout elapsed (`timeout_http_call`, or `advance` past the deadline): Envoy
    /// answers 504 `upstream request timeout` itself.
    TimedOut,
}

/// A `proxy_http_call` the filter made.
#[derive(Clone)]
pub struct HttpCall {
    pub worker: usize,
    pub token: u32,
    /// The context that was current (or effective) when the filter made the call; the SDK
    /// routes the answer there. The host delivers it with the root context id, as Envoy does.
    pub context_id: u32,
    pub upstream: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, Vec<u8>)>,
    pub timeout_ms: u32,
    /// When Envoy would time the call out (None: timeout 0 means no timeout).
    pub deadline_ns: Option<u64>,
    pub state: CallState,
    /// A `proxy_grpc_call`: its service and method (`upstream` is then the
    /// serialized `GrpcService`, `headers` the initial metadata, `body` the message).
    pub grpc: Option<(String, String)>,
}

impl HttpCall {
    pub fn header(&self, name: &str) -> Option<String> {
        find_header(&self.headers, name)
    }
}

/// The answer to an http callout, delivered with `Harness::respond_http_call`.
#[derive(Clone, Default)]
pub struct CallResponse {
    /// Including `:status`.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, Vec<u8>)>,
}

impl CallResponse {
    pub fn new(status: u16) -> Self {
        CallResponse {
            headers: vec![(":status".into(), status.to_string().into_bytes())],
            ..Default::default()
        }
    }
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers
            .push((name.to_ascii_lowercase(), value.as_ref().to_vec()));
        self
    }
    pub fn body(mut self, body: impl AsRef<[u8]>) -> Self {
        self.body = body.as_ref().to_vec();
        self
    }
}

/// What the fake upstream answers to a request the filter let through.
#[derive(Clone)]
pub struct Upstream {
    pub status: u16,
    /// Extra response headers (after `:status`).
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// When not empty, the body as `proxy_on_response_body` sees it, one
    /// call per chunk (else the whole `body` in one call, when not empty).
    pub chunks: Vec<Vec<u8>>,
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            status: 200,
            headers: Vec::new(),
            body: Vec::new(),
            chunks: Vec::new(),
        }
    }
}

impl Upstream {
    /// `status` with `body`, delivered in one chunk.
    pub fn new(status: u16, body: impl AsRef<[u8]>) -> Self {
        Upstream {
            status,
            body: body.as_ref().to_vec(),
            ..Upstream::default()
        }
    }
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers
            .push((name.to_ascii_lowercase(), value.as_ref().to_vec()));
        self
    }
    /// The body cut into pieces of `size` bytes (the last may be shorter).
    pub fn chunked(mut self, size: usize) -> Self {
        self.chunks = self.body.chunks(size.max(1)).map(<[u8]>::to_vec).collect();
        self
    }
}

/// A downstream request. Header names are lowercased; values are arbitrary bytes.
#[derive(Clone)]
pub struct Request {
    /// All request headers, pseudo-headers (`:method`, `:path`, `:authority`, `:scheme`) first.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Properties for `proxy_get_property`: path parts -> raw value.
    /// `["source", "address"]` is set to `DEFAULT_SOURCE` unless changed.
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
    pub upstream: Upstream,
    /// If set, the request stops after going upstream until `Harness::respond_upstream`.
    pub hold_upstream: bool,
    /// The request body as `proxy_on_request_body` sees it arrive, one call
    /// per chunk; empty: the request ends with its headers.
    pub body: Vec<Vec<u8>>,
}

impl Request {
    pub fn new(method: &str, path: &str) -> Self {
        Request {
            headers: vec![
                (":method".into(), method.as_bytes().to_vec()),
                (":path".into(), path.as_bytes().to_vec()),
                (":authority".into(), b"example.com".to_vec()),
                (":scheme".into(), b"http".to_vec()),
            ],
            properties: vec![(
                vec!["source".into(), "address".into()],
                DEFAULT_SOURCE.as_bytes().to_vec(),
            )],
            upstream: Upstream::default(),
            hold_upstream: false,
            body: Vec::new(),
        }
    }
    pub fn get(path: &str) -> Self {
        Self::new("GET", path)
    }
    pub fn post(path: &str) -> Self {
        Self::new("POST", path)
    }
    pub fn method(self, method: &str) -> Self {
        self.set_header(":method", method)
    }
    pub fn path(self, path: &str) -> Self {
        self.set_header(":path", path)
    }
    pub fn authority(self, authority: &str) -> Self {
        self.set_header(":authority", authority)
    }
    /// Appends a header (repeated names are kept, in order).
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers
            .push((name.to_ascii_lowercase(), value.as_ref().to_vec()));
        self
    }
    /// Replaces every value of `name` with one value.
    pub fn set_header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        let name = name.to_ascii_lowercase();
        match self.headers.iter().position(|(k, _)| *k == name) {
            Some(pos) => {
                self.headers[pos].1 = value.as_ref().to_vec();
                let mut seen = 0;
                self.headers.retain(|(k, _)| {
                    if *k == name {
                        seen += 1;
                        seen == 1
                    } else {
                        true
                    }
                });
            }
            None => self.headers.push((name, value.as_ref().to_vec())),
        }
        self
    }
    pub fn remove_header(mut self, name: &str) -> Self {
        let name = name.to_ascii_lowercase();
        self.headers.retain(|(k, _)| *k != name);
        self
    }
    /// The downstream address, `"ip:port"` (property `source.address`).
    pub fn source(self, addr: &str) -> Self {
        self.property(&["source", "address"], addr)
    }
    /// No `source.address` property at all (NotFound).
    pub fn no_source(mut self) -> Self {
        self.properties
            .retain(|(p, _)| p[..] != ["source".to_string(), "address".to_string()]);
        self
    }
    /// Sets a property (replacing an earlier value of the same path).
    pub fn property(mut self, path: &[&str], value: impl AsRef<[u8]>) -> Self {
        let path: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        self.properties.retain(|(p, _)| *p != path);
        self.properties.push((path, value.as_ref().to_vec()));
        self
    }
    pub fn upstream(mut self, upstream: Upstream) -> Self {
        self.upstream = upstream;
        self
    }
    pub fn upstream_status(mut self, status: u16) -> Self {
        self.upstream.status = status;
        self
    }
    /// A request body, delivered in one chunk (the headers then do not end the stream).
    pub fn body(mut self, body: impl AsRef<[u8]>) -> Self {
        self.body = vec![body.as_ref().to_vec()];
        self
    }
    /// The body cut into chunks of `size` bytes (the last may be shorter).
    pub fn body_chunked(mut self, size: usize) -> Self {
        let whole = self.body.concat();
        self.body = whole.chunks(size.max(1)).map(<[u8]>::to_vec).collect();
        self
    }
    pub fn hold_upstream(mut self) -> Self {
        self.hold_upstream = true;
        self
    }
}

/// Identifies a stream (an HTTP context) on a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    pub worker: usize,
    pub context_id: u32,
}

/// What happened to a request (a snapshot; `completed` tells whether the stream is over).
#[derive(Clone)]
pub struct Outcome {
    pub stream: StreamId,
    pub phase: StreamPhase,
    /// `on_request_headers` returned this.
    pub request_action: Option<Action>,
    /// `on_request_headers` returned Pause and the filter sent no local response in it.
    pub paused: bool,
    /// `on_log`, `on_done` and `on_delete` have run.
    pub completed: bool,
    /// Ended without a response (test `cancel`, or the filter reset the stream).
    pub cancelled: bool,
    pub reset_by_filter: bool,
    pub local_response: Option<LocalResponse>,
    /// `:status` the client got (the local response's, or the upstream's); 0 if none yet.
    pub status: u16,
    /// Response headers as the client sees them, `:status` included: the local response (as
    /// Envoy builds it) or the upstream's, after the filter's `on_response_headers` changes.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// Request headers as forwarded upstream (after the filter's changes); None if not forwarded.
    pub upstream_request: Option<Vec<(String, Vec<u8>)>>,
    /// The request body as the upstream got it (after the filter's
    /// changes); None if not forwarded.
    pub upstream_body: Option<Vec<u8>>,
    /// What each `proxy_on_request_body` call returned.
    pub body_actions: Vec<Action>,
    /// Http callouts this stream's context made.
    pub http_calls: Vec<HttpCall>,
    /// `proxy_continue_stream(HttpRequest)` calls on this stream.
    pub resumes: u32,
    /// `proxy_on_done` returned this.
    pub on_done_result: Option<bool>,
    /// Protocol oddities noticed on this stream (e.g. Continue returned after a local response).
    pub notes: Vec<String>,
    /// `proxy_set_property` calls on this stream: path and value, in order.
    pub set_properties: Vec<(Vec<String>, Vec<u8>)>,
}

pub(crate) fn find_header(headers: &[(String, Vec<u8>)], name: &str) -> Option<String> {
    let name = name.to_ascii_lowercase();
    headers
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}

impl Outcome {
    /// First value of a response header (lossy UTF-8).
    pub fn header(&self, name: &str) -> Option<String> {
        find_header(&self.headers, name)
    }
    pub fn header_bytes(&self, name: &str) -> Option<&[u8]> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_slice())
    }
    /// Every value of a response header, in order.
    pub fn header_values(&self, name: &str) -> Vec<String> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .collect()
    }
    /// A header the filter must have set; panics with the full header list otherwise.
    pub fn expect_header(&self, name: &str) -> String {
        self.header(name).unwrap_or_else(|| {
            panic!(
                "response has no `{name}` header; status {}, headers: {}",
                self.status,
                format_headers(&self.headers)
            )
        })
    }
    pub fn upstream_header(&self, name: &str) -> Option<String> {
        self.upstream_request
            .as_ref()
            .and_then(|h| find_header(h, name))
    }
    pub fn body_str(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn body_json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}): {:?} (status {})",
                self.body_str(),
                self.status
            )
        })
    }
    pub fn is_local(&self) -> bool {
        self.local_response.is_some()
    }
}

/// `name: value` lines, for failure messages.
pub fn format_headers(headers: &[(String, Vec<u8>)]) -> String {
    headers
        .iter()
        .map(|(k, v)| format!("\n  {k}: {}", String::from_utf8_lossy(v)))
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric by name; like Envoy's stats, one value for all workers.
#[derive(Clone, Debug)]
pub struct Metric {
    pub kind: MetricKind,
    pub value: i64,
    pub samples: Vec<u64>,
}

impl Metric {
    pub(crate) fn new(kind: MetricKind) -> Self {
        Metric {
            kind,
            value: 0,
            samples: Vec::new(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared-data interleaving hooks.

/// Which shared-data keys a hook or fault applies to.
#[derive(Clone)]
pub enum KeyFilter {
    Any,
    Exact(String),
    Prefix(String),
    Contains(String),
    Func(Rc<dyn Fn(&str) -> bool>),
}

impl KeyFilter {
    pub fn exact(s: &str) -> Self {
        KeyFilter::Exact(s.into())
    }
    pub fn prefix(s: &str) -> Self {
        KeyFilter::Prefix(s.into())
    }
    pub fn contains(s: &str) -> Self {
        KeyFilter::Contains(s.into())
    }
    pub fn func(f: impl Fn(&str) -> bool + 'static) -> Self {
        KeyFilter::Func(Rc::new(f))
    }
    pub fn matches(&self, key: &str) -> bool {
        match self {
            KeyFilter::Any => true,
            KeyFilter::Exact(s) => key == s,
            KeyFilter::Prefix(s) => key.starts_with(s.as_str()),
            KeyFilter::Contains(s) => key.contains(s.as_str()),
            KeyFilter::Func(f) => f(key),
        }
    }
}

impl fmt::Debug for KeyFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyFilter::Any => write!(f, "Any"),
            KeyFilter::Exact(s) => write!(f, "Exact({s:?})"),
            KeyFilter::Prefix(s) => write!(f, "Prefix({s:?})"),
            KeyFilter::Contains(s) => write!(f, "Contains({s:?})"),
            KeyFilter::Func(_) => write!(f, "Func(..)"),
        }
    }
}

/// Which worker(s) a hook watches. `usize` converts to `Workers::One`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workers {
    One(usize),
    Any,
}

impl From<usize> for Workers {
    fn from(w: usize) -> Self {
        Workers::One(w)
    }
}

impl Workers {
    fn matches(self, w: usize) -> bool {
        match self {
            Workers::One(x) => x == w,
            Workers::Any => true,
        }
    }
}

/// A `proxy_get_shared_data` call, seen by an `after_next_shared_get` hook.
#[derive(Clone, Debug)]
pub struct SharedGetEvent {
    pub worker: usize,
    pub key: String,
    /// `Ok((value, cas))` or `Err(status)` (1 = NotFound).
    pub result: Result<(Vec<u8>, u32), u32>,
}

/// A `proxy_set_shared_data` call about to be applied, seen by a `before_next_shared_set` hook.
#[derive(Clone, Debug)]
pub struct SharedSetEvent {
    pub worker: usize,
    pub key: String,
    pub value: Vec<u8>,
    pub cas: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GetWhen {
    Any,
    Missing,
    Found,
}

type SetHookFn = Box<dyn FnOnce(&Harness, &SharedSetEvent)>;
type GetHookFn = Box<dyn FnOnce(&Harness, &SharedGetEvent)>;

struct SetHook {
    workers: Workers,
    keys: KeyFilter,
    f: SetHookFn,
}

struct GetHook {
    workers: Workers,
    keys: KeyFilter,
    when: GetWhen,
    f: GetHookFn,
}

struct CasFault {
    workers: Workers,
    keys: KeyFilter,
    remaining: usize,
}

#[derive(Default)]
struct Hooks {
    before_set: Vec<SetHook>,
    after_get: Vec<GetHook>,
    cas_faults: Vec<CasFault>,
    fired: usize,
}

// ---------------------------------------------------------------------------------------------
// Options.

/// Everything configurable about a harness. `Options::new(workers, config)` gives the defaults.
#[derive(Clone, Debug)]
pub struct Options {
    pub workers: usize,
    pub plugin_config: Vec<u8>,
    pub vm_config: Vec<u8>,
    pub wasm_path: PathBuf,
    pub start_time_ns: u64,
    /// What `proxy_get_log_level` answers (every `proxy_log` call is captured whatever it is).
    pub log_level: LogLevel,
    /// Seed of the deterministic `random_get` bytes (worker `w` uses `seed + w`);
    /// None = real randomness.
    pub random_seed: Option<u64>,
    /// Envoy runs a filter's own local response through the filter's `on_response_headers`
    /// (the response goes through the whole encoder chain). Default true, like Envoy.
    pub local_reply_through_filter: bool,
    /// Clusters `proxy_http_call` accepts (others get BadArgument, like Envoy). None = any.
    pub clusters: Option<Vec<String>>,
    /// Properties visible from every context (e.g. `plugin_name`).
    pub root_properties: Vec<(Vec<String>, Vec<u8>)>,
    /// WASI `clock_time_get` answers the monotonic clock (id 1), as Envoy does. False: it
    /// answers ENOTSUP, as a host without one would, and the filter runs on the wall clock.
    pub monotonic_clock: bool,
}

impl Options {
    pub fn new(workers: usize, plugin_config: impl AsRef<[u8]>) -> Self {
        Options {
            workers,
            plugin_config: plugin_config.as_ref().to_vec(),
            vm_config: Vec::new(),
            wasm_path: default_wasm_path(),
            start_time_ns: DEFAULT_START_NS,
            log_level: LogLevel::Trace,
            random_seed: Some(0x5eed),
            local_reply_through_filter: true,
            clusters: None,
            root_properties: vec![(vec!["plugin_name".into()], b"ratelimit-wasm".to_vec())],
            monotonic_clock: true,
        }
    }
    pub fn wasm_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.wasm_path = path.into();
        self
    }
    pub fn vm_config(mut self, config: impl AsRef<[u8]>) -> Self {
        self.vm_config = config.as_ref().to_vec();
        self
    }
    pub fn start_time_ns(mut self, ns: u64) -> Self {
        self.start_time_ns = ns;
        self
    }
    pub fn clusters(mut self, clusters: &[&str]) -> Self {
        self.clusters = Some(clusters.iter().map(|s| s.to_string()).collect());
        self
    }
    /// A host without a monotonic clock (see `monotonic_clock`).
    pub fn no_monotonic_clock(mut self) -> Self {
        self.monotonic_clock = false;
        self
    }
}

// ---------------------------------------------------------------------------------------------
// The harness.

pub(crate) struct Worker {
    store: Store<HostState>,
    instance: Instance,
    vm_started: bool,
    configured: bool,
}

pub(crate) struct Inner {
    pub(crate) opts: Options,
    workers: OnceCell<Vec<RefCell<Worker>>>,
    /// The monotonic clock; timers and callout timeouts run on it.
    pub(crate) clock: Cell<u64>,
    /// What the wall clock reads minus `clock` (stepped by `step_wall_clock`).
    pub(crate) wall_offset_ns: Cell<i64>,
    /// Statuses the next `proxy_send_local_response` calls fail with, without sending.
    pub(crate) local_response_faults: RefCell<VecDeque<u32>>,
    pub(crate) shared: RefCell<SharedData>,
    hooks: RefCell<Hooks>,
    pub(crate) metrics: RefCell<BTreeMap<String, Metric>>,
    pub(crate) logs: RefCell<Vec<LogEntry>>,
    pub(crate) notes: RefCell<Vec<String>>,
    /// How deep in `drive` the harness is: a stream's callback is not over
    /// (its returned action not applied) until the outermost drive returns.
    driving: Cell<u32>,
    /// `proxy_on_queue_ready` calls Envoy posted to a worker's event loop
    /// (worker, queue), delivered once no stream is being driven.
    posted: RefCell<VecDeque<(usize, u32)>>,
}

impl Inner {
    pub(crate) fn wall_now_ns(&self) -> u64 {
        self.clock
            .get()
            .saturating_add_signed(self.wall_offset_ns.get())
    }

    pub(crate) fn take_set_hook(&self, worker: usize, key: &str) -> Option<SetHookFn> {
        let mut hooks = self.hooks.borrow_mut();
        let pos = hooks
            .before_set
            .iter()
            .position(|h| h.workers.matches(worker) && h.keys.matches(key))?;
        hooks.fired += 1;
        Some(hooks.before_set.remove(pos).f)
    }

    pub(crate) fn take_get_hook(&self, worker: usize, key: &str, found: bool) -> Option<GetHookFn> {
        let mut hooks = self.hooks.borrow_mut();
        let pos = hooks.after_get.iter().position(|h| {
            h.workers.matches(worker)
                && h.keys.matches(key)
                && match h.when {
                    GetWhen::Any => true,
                    GetWhen::Missing => !found,
                    GetWhen::Found => found,
                }
        })?;
        hooks.fired += 1;
        Some(hooks.after_get.remove(pos).f)
    }

    pub(crate) fn take_cas_fault(&self, worker: usize, key: &str) -> bool {
        let mut hooks = self.hooks.borrow_mut();
        let Some(pos) = hooks
            .cas_faults
            .iter()
            .position(|f| f.remaining > 0 && f.workers.matches(worker) && f.keys.matches(key))
        else {
            return false;
        };
        hooks.cas_faults[pos].remaining -= 1;
        if hooks.cas_faults[pos].remaining == 0 {
            hooks.cas_faults.remove(pos);
        }
        true
    }
}

/// The test host. Cheap to clone (a handle); not `Send`.
#[derive(Clone)]
pub struct Harness {
    pub(crate) inner: Rc<Inner>,
}

impl Harness {
    /// A harness whose workers all accepted `opts`' configuration (panics with the logs
    /// otherwise).
    pub fn running(opts: Options) -> Harness {
        let config = String::from_utf8_lossy(&opts.plugin_config).into_owned();
        let h = Harness::with_options(opts).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            h.configure_results().iter().all(|c| *c),
            "the filter refused the configuration {config}:\n{}",
            h.log_text()
        );
        h
    }

    /// `workers` VMs of the default filter, configured with `plugin_config`.
    /// A trap during start-up is an `Err`; a configuration the filter rejects is not (see
    /// `configured`).
    pub fn new(workers: usize, plugin_config: &str) -> anyhow::Result<Harness> {
        Self::with_options(Options::new(workers, plugin_config))
    }

    pub fn with_options(opts: Options) -> anyhow::Result<Harness> {
        assert!(opts.workers > 0, "a harness needs at least one worker");
        let module = load_module(&opts.wasm_path)?;
        let real_seed = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let inner = Rc::new(Inner {
            clock: Cell::new(opts.start_time_ns),
            wall_offset_ns: Cell::new(0),
            local_response_faults: RefCell::default(),
            opts,
            workers: OnceCell::new(),
            shared: RefCell::new(SharedData::new()),
            hooks: RefCell::default(),
            metrics: RefCell::default(),
            logs: RefCell::default(),
            notes: RefCell::default(),
            driving: Cell::new(0),
            posted: RefCell::default(),
        });
        let linker =
            host::linker(engine(), &module).map_err(|e| anyhow::anyhow!("linker: {e:?}"))?;
        let mut workers = Vec::new();
        for w in 0..inner.opts.workers {
            let seed = inner
                .opts
                .random_seed
                .map(|s| s.wrapping_add(w as u64))
                .unwrap_or(real_seed.wrapping_add(w as u64));
            let mut store = Store::new(engine(), HostState::new(w, Rc::downgrade(&inner), seed));
            let instance = linker
                .instantiate(&mut store, &module)
                .map_err(|e| anyhow::anyhow!("instantiating worker {w}: {e:?}"))?;
            workers.push(RefCell::new(Worker {
                store,
                instance,
                vm_started: false,
                configured: false,
            }));
        }
        let _ = inner.workers.set(workers);
        let h = Harness { inner };
        for w in 0..h.workers() {
            h.start_worker(w)?;
        }
        Ok(h)
    }

    fn start_worker(&self, w: usize) -> anyhow::Result<()> {
        let has = |name: &str| {
            let mut wk = self.worker_mut(w);
            let Worker {
                store, instance, ..
            } = &mut *wk;
            instance.get_export(&mut *store, name).is_some()
        };
        if has("_initialize") {
            self.try_invoke::<(), ()>(w, 0, "_initialize", ())?;
        } else if has("_start") {
            self.try_invoke::<(), ()>(w, 0, "_start", ())?;
        }
        let root = ROOT_CONTEXT_ID as i32;
        self.try_invoke::<(i32, i32), ()>(
            w,
            ROOT_CONTEXT_ID,
            "proxy_on_context_create",
            (root, 0),
        )?;
        let vm_len = self.inner.opts.vm_config.len() as i32;
        let started = self
            .try_invoke::<(i32, i32), i32>(w, ROOT_CONTEXT_ID, "proxy_on_vm_start", (root, vm_len))?
            .unwrap_or(1)
            != 0;
        self.worker_mut(w).vm_started = started;
        if !started {
            return Ok(());
        }
        let cfg_len = self.inner.opts.plugin_config.len() as i32;
        self.host_mut(w).plugin_config_available = true;
        let configured = self.try_invoke::<(i32, i32), i32>(
            w,
            ROOT_CONTEXT_ID,
            "proxy_on_configure",
            (root, cfg_len),
        );
        self.host_mut(w).plugin_config_available = false;
        let configured = configured?.unwrap_or(1) != 0;
        self.worker_mut(w).configured = configured;
        Ok(())
    }

    // ----- borrowing helpers ---------------------------------------------------------------

    fn worker_cell(&self, w: usize) -> &RefCell<Worker> {
        let workers = self.inner.workers.get().expect("workers not created");
        workers
            .get(w)
            .unwrap_or_else(|| panic!("no worker {w}: this harness has {} workers", workers.len()))
    }

    fn worker_mut(&self, w: usize) -> RefMut<'_, Worker> {
        self.worker_cell(w).try_borrow_mut().unwrap_or_else(|_| {
            panic!(
                "worker {w} is busy: it is in the middle of a VM call (a hook closure may only drive \
                 workers other than the one whose hostcall it interrupted)"
            )
        })
    }

    fn worker_ref(&self, w: usize) -> Ref<'_, Worker> {
        self.worker_cell(w)
            .try_borrow()
            .unwrap_or_else(|_| panic!("worker {w} is busy: it is in the middle of a VM call"))
    }

    fn host_mut(&self, w: usize) -> RefMut<'_, HostState> {
        RefMut::map(self.worker_mut(w), |wk| wk.store.data_mut())
    }

    fn host_ref(&self, w: usize) -> Ref<'_, HostState> {
        Ref::map(self.worker_ref(w), |wk| wk.store.data())
    }

    fn with_stream<R>(&self, id: StreamId, f: impl FnOnce(&mut StreamState) -> R) -> R {
        let mut h = self.host_mut(id.worker);
        let s = h
            .streams
            .get_mut(&id.context_id)
            .unwrap_or_else(|| panic!("no stream {id:?} (forgotten?)"));
        f(s)
    }

    // ----- calling into the VM -------------------------------------------------------------

    /// Calls export `name` on worker `w` with `ctx` as the current context, then applies what
    /// the VM asked for (local responses, resumes, resets). `Ok(None)` if there is no such
    /// export. A trap is an `Err` and makes the worker unusable.
    pub fn try_invoke<P: WasmParams, R: WasmResults>(
        &self,
        w: usize,
        ctx: u32,
        name: &str,
        params: P,
    ) -> anyhow::Result<Option<R>> {
        let result = {
            let mut wk = self.worker_mut(w);
            if let Some(p) = &wk.store.data().poisoned {
                anyhow::bail!("worker {w} is unusable after an earlier trap: {p}");
            }
            let Worker {
                store, instance, ..
            } = &mut *wk;
            let func = match instance.get_export(&mut *store, name) {
                None => return Ok(None),
                Some(e) => e
                    .into_func()
                    .ok_or_else(|| anyhow::anyhow!("export {name} is not a function"))?,
            };
            let func = func
                .typed::<P, R>(&*store)
                .map_err(|e| anyhow::anyhow!("export {name} has an unexpected type: {e:?}"))?;
            {
                let d = store.data_mut();
                d.current_ctx = ctx;
                d.effective_ctx = None;
                d.in_call = Some(format!("{name}(context {ctx})"));
            }
            let result = func.call(&mut *store, params);
            let d = store.data_mut();
            d.effective_ctx = None;
            d.in_call = None;
            match result {
                Ok(r) => r,
                Err(e) => {
                    d.flush_output(true);
                    let msg =
                        format!("wasm trap in worker {w} during {name}(context {ctx}): {e:?}");
                    d.poisoned = Some(msg.clone());
                    drop(wk);
                    let tail = self.log_tail(w, 25);
                    anyhow::bail!("{msg}\n--- last log lines of worker {w} ---\n{tail}");
                }
            }
        };
        self.pump(w);
        Ok(Some(result))
    }

    /// `try_invoke` that panics (failing the test) on a trap.
    pub fn invoke<P: WasmParams, R: WasmResults>(
        &self,
        w: usize,
        ctx: u32,
        name: &str,
        params: P,
    ) -> Option<R> {
        self.try_invoke(w, ctx, name, params)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Bytes of worker `w`'s linear memory (it only grows: its high-water mark).
    pub fn memory_bytes(&self, w: usize) -> usize {
        let mut wk = self.worker_mut(w);
        let Worker {
            store, instance, ..
        } = &mut *wk;
        instance
            .get_memory(&mut *store, "memory")
            .map_or(0, |m| m.data_size(&*store))
    }

    /// Untyped call of any export (escape hatch); panics on a trap or a missing export.
    pub fn raw_call(&self, w: usize, ctx: u32, name: &str, args: &[Val]) -> Vec<Val> {
        let results = {
            let mut wk = self.worker_mut(w);
            let Worker {
                store, instance, ..
            } = &mut *wk;
            let func = instance
                .get_func(&mut *store, name)
                .unwrap_or_else(|| panic!("no exported function {name}"));
            let n = func.ty(&*store).results().len();
            let mut results = vec![Val::I32(0); n];
            store.data_mut().current_ctx = ctx;
            store.data_mut().effective_ctx = None;
            let r = func.call(&mut *store, args, &mut results);
            store.data_mut().effective_ctx = None;
            if let Err(e) = r {
                store.data_mut().flush_output(true);
                drop(wk);
                panic!(
                    "wasm trap in worker {w} during {name}: {e:?}\n--- last log lines ---\n{}",
                    self.log_tail(w, 25)
                );
            }
            results
        };
        self.pump(w);
        results
    }

    /// Applies the effects the VM asked for during the last call (Envoy runs them right after
    /// the VM call returns).
    fn pump(&self, w: usize) {
        // Envoy clears the http call response before the other deferred actions.
        self.host_mut(w).http_call_response = None;
        loop {
            let action = self.host_mut(w).actions.pop_front();
            let Some(action) = action else { break };
            match action {
                AfterAction::LocalReply(ctx) => {
                    let id = StreamId {
                        worker: w,
                        context_id: ctx,
                    };
                    self.with_stream(id, |s| match s.phase {
                        StreamPhase::Finished | StreamPhase::Completing => {}
                        _ => s.phase = StreamPhase::LocalReply,
                    });
                    self.drive(id);
                }
                AfterAction::ContinueRequest(ctx) => {
                    let id = StreamId {
                        worker: w,
                        context_id: ctx,
                    };
                    let pending = self.with_stream(id, |s| {
                        s.resumes += 1;
                        std::mem::take(&mut s.body_pending) && s.phase == StreamPhase::Paused
                    });
                    if pending {
                        // The headers go on, then the filter sees the body
                        // Envoy held for it.
                        self.with_stream(id, |s| {
                            s.req_map_held = false;
                            s.phase = StreamPhase::Forwarding;
                        });
                        self.deliver_request_body(id);
                    } else {
                        self.with_stream(id, |s| {
                            if s.phase == StreamPhase::Paused {
                                s.phase = StreamPhase::Forwarding;
                            } else {
                                s.notes.push(format!(
                                    "proxy_continue_stream(HttpRequest) while the stream was {:?}: ignored",
                                    s.phase
                                ));
                            }
                        });
                    }
                    self.drive(id);
                }
                AfterAction::ContinueResponse(ctx) => {
                    let id = StreamId {
                        worker: w,
                        context_id: ctx,
                    };
                    self.with_stream(id, |s| {
                        if s.phase == StreamPhase::ResponsePaused {
                            s.resp_map_held = false;
                            s.phase = StreamPhase::Completing;
                        } else {
                            s.notes.push(format!(
                                "proxy_continue_stream(HttpResponse) while the stream was {:?}: ignored",
                                s.phase
                            ));
                        }
                    });
                    self.drive(id);
                }
                AfterAction::QueueReady(queue) => {
                    self.inner.posted.borrow_mut().push_back((w, queue));
                    if self.inner.driving.get() == 0 {
                        self.run_posted();
                    }
                }
                AfterAction::Reset(ctx) => {
                    let id = StreamId {
                        worker: w,
                        context_id: ctx,
                    };
                    self.with_stream(id, |s| {
                        if s.phase != StreamPhase::Finished && s.phase != StreamPhase::Completing {
                            s.reset_by_filter = true;
                            s.cancelled = true;
                            s.phase = StreamPhase::Completing;
                        }
                    });
                    self.drive(id);
                }
            }
        }
    }

    /// The upstream's body through `proxy_on_response_body`, chunk by
    /// chunk, as Envoy streams a body the filter does not buffer.
    fn deliver_body(&self, id: StreamId) {
        let chunks = self.with_stream(id, |s| {
            let up = s.upstream.clone().unwrap_or_default();
            match (up.chunks.is_empty(), up.body.is_empty()) {
                (false, _) => up.chunks,
                (true, false) => vec![up.body],
                (true, true) => Vec::new(),
            }
        });
        let n = chunks.len();
        for (i, chunk) in chunks.into_iter().enumerate() {
            let len = chunk.len() as i32;
            let live = self.with_stream(id, |s| {
                s.body_chunk = Some(chunk);
                s.phase == StreamPhase::Completing && !s.cancelled
            });
            if !live {
                break;
            }
            let eos = (i + 1 == n) as i32;
            self.invoke::<(i32, i32, i32), i32>(
                id.worker,
                id.context_id,
                "proxy_on_response_body",
                (id.context_id as i32, len, eos),
            );
        }
        self.with_stream(id, |s| s.body_chunk = None);
    }

    /// Moves a stream forward as far as it goes without outside input.
    fn drive(&self, id: StreamId) {
        self.inner.driving.set(self.inner.driving.get() + 1);
        self.drive_phases(id);
        self.inner.driving.set(self.inner.driving.get() - 1);
        if self.inner.driving.get() == 0 {
            self.run_posted();
        }
    }

    /// Runs what Envoy posted to the workers' event loops: the queues' readiness.
    fn run_posted(&self) {
        loop {
            let next = self.inner.posted.borrow_mut().pop_front();
            let Some((w, queue)) = next else { return };
            self.invoke::<(i32, i32), ()>(
                w,
                ROOT_CONTEXT_ID,
                "proxy_on_queue_ready",
                (ROOT_CONTEXT_ID as i32, queue as i32),
            );
        }
    }

    fn drive_phases(&self, id: StreamId) {
        let w = id.worker;
        let ctx = id.context_id as i32;
        loop {
            let phase = self.with_stream(id, |s| s.phase);
            match phase {
                StreamPhase::LocalReply | StreamPhase::UpstreamResponse => {
                    let through = phase == StreamPhase::UpstreamResponse
                        || self.inner.opts.local_reply_through_filter;
                    let (n, eos) = self.with_stream(id, |s| {
                        let (headers, body) = if phase == StreamPhase::LocalReply {
                            local_reply_headers(s.local_response.as_ref().unwrap())
                        } else {
                            let up = s.upstream.clone().unwrap_or_default();
                            let mut headers =
                                vec![(":status".to_string(), up.status.to_string().into_bytes())];
                            headers.extend(up.headers.clone());
                            (headers, up.body)
                        };
                        let n = headers.len();
                        s.response_headers = Some(headers);
                        s.response_body = body;
                        if through {
                            s.resp_map_held = true;
                            s.phase = StreamPhase::ResponseHeaders;
                        } else {
                            s.phase = StreamPhase::Completing;
                        }
                        (n as i32, s.response_body.is_empty() as i32)
                    });
                    if !through {
                        continue;
                    }
                    let action = self
                        .invoke::<(i32, i32, i32), i32>(
                            w,
                            id.context_id,
                            "proxy_on_response_headers",
                            (ctx, n, eos),
                        )
                        .map(Action::from_i32)
                        .unwrap_or(Action::Continue);
                    let body_next = self.with_stream(id, |s| {
                        if s.phase != StreamPhase::ResponseHeaders {
                            return false; // a local reply or reset happened meanwhile
                        }
                        s.response_action = Some(action);
                        if action == Action::Continue {
                            s.resp_map_held = false;
                            s.phase = StreamPhase::Completing;
                            phase == StreamPhase::UpstreamResponse
                        } else {
                            s.phase = StreamPhase::ResponsePaused;
                            false
                        }
                    });
                    if body_next {
                        self.deliver_body(id);
                    }
                }
                StreamPhase::Forwarding => {
                    self.with_stream(id, |s| {
                        let buffered = std::mem::take(&mut s.request_body);
                        s.upstream_body.extend(buffered);
                        s.upstream_request = Some(s.request_headers.clone());
                        if s.request.hold_upstream {
                            s.phase = StreamPhase::AwaitingUpstream;
                        } else {
                            s.upstream = Some(s.request.upstream.clone());
                            s.phase = StreamPhase::UpstreamResponse;
                        }
                    });
                }
                StreamPhase::Completing => {
                    self.with_stream(id, |s| s.access_log_phase = true);
                    self.invoke::<i32, ()>(w, id.context_id, "proxy_on_log", ctx);
                    self.with_stream(id, |s| {
                        s.access_log_phase = false;
                        s.req_map_held = false;
                        s.resp_map_held = false;
                    });
                    let done = self.invoke::<i32, i32>(w, id.context_id, "proxy_on_done", ctx);
                    self.invoke::<i32, ()>(w, id.context_id, "proxy_on_delete", ctx);
                    let mut h = self.host_mut(w);
                    let s = h.streams.get_mut(&id.context_id).unwrap();
                    s.on_done_result = done.map(|d| d != 0);
                    s.phase = StreamPhase::Finished;
                    return;
                }
                _ => return,
            }
        }
    }

    fn check_usable(&self, w: usize) {
        let wk = self.worker_ref(w);
        if let Some(p) = &wk.store.data().poisoned {
            panic!("worker {w} is unusable after an earlier trap: {p}");
        }
        if !wk.vm_started || !wk.configured {
            drop(wk);
            panic!(
                "worker {w} is not running the filter: proxy_on_vm_start/proxy_on_configure \
                 returned false. Logs:\n{}",
                self.log_tail(w, 25)
            );
        }
    }

    // ----- start-up results --------------------------------------------------------------

    pub fn workers(&self) -> usize {
        self.inner.workers.get().map(|w| w.len()).unwrap_or(0)
    }

    /// `proxy_on_configure` returned true on worker `w`.
    pub fn configured(&self, w: usize) -> bool {
        self.worker_ref(w).configured
    }

    pub fn vm_started(&self, w: usize) -> bool {
        self.worker_ref(w).vm_started
    }

    pub fn configure_results(&self) -> Vec<bool> {
        (0..self.workers()).map(|w| self.configured(w)).collect()
    }

    pub fn options(&self) -> &Options {
        &self.inner.opts
    }

    // ----- requests ------------------------------------------------------------------------

    /// Runs a whole request on worker `w`: context create, `on_request_headers` (end of
    /// stream), then either the local response or the fake upstream's answer through
    /// `on_response_headers`, then `on_log`, `on_done`, `on_delete`. If the filter pauses the
    /// request, returns with `paused` set and the stream open (see `outcome`, `cancel`,
    /// `tick`, `respond_http_call`).
    pub fn send(&self, w: usize, req: Request) -> Outcome {
        let id = self.begin(w, req);
        let out = self.outcome(id);
        if out.completed {
            self.host_mut(w).streams.remove(&id.context_id);
        }
        out
    }

    /// `send` on worker `i % workers`.
    pub fn send_rr(&self, i: usize, req: Request) -> Outcome {
        self.send(i % self.workers(), req)
    }

    /// Starts a request (context create + `on_request_headers`) and drives it as far as it
    /// goes; returns its id.
    pub fn begin(&self, w: usize, req: Request) -> StreamId {
        self.check_usable(w);
        let ctx = {
            let mut h = self.host_mut(w);
            let ctx = h.next_ctx;
            h.next_ctx += 1;
            h.streams.insert(ctx, StreamState::new(ctx, req));
            ctx
        };
        let id = StreamId {
            worker: w,
            context_id: ctx,
        };
        self.invoke::<(i32, i32), ()>(
            w,
            ctx,
            "proxy_on_context_create",
            (ctx as i32, ROOT_CONTEXT_ID as i32),
        );
        // Held until `drive` below: what Envoy posts waits for this callback's end.
        self.inner.driving.set(self.inner.driving.get() + 1);
        let (n, eos) = self.with_stream(id, |s| {
            s.phase = StreamPhase::RequestHeaders;
            s.req_map_held = true;
            (
                s.request_headers.len() as i32,
                s.request.body.is_empty() as i32,
            )
        });
        let action = self
            .invoke::<(i32, i32, i32), i32>(
                w,
                ctx,
                "proxy_on_request_headers",
                (ctx as i32, n, eos),
            )
            .map(Action::from_i32)
            .unwrap_or(Action::Continue);
        self.with_stream(id, |s| {
            s.request_action = Some(action);
            if s.local_response.is_some() && action == Action::Continue {
                s.notes.push(
                    "on_request_headers returned Continue after proxy_send_local_response \
                     (Envoy stops iteration anyway)"
                        .into(),
                );
            }
            if s.phase == StreamPhase::RequestHeaders {
                if action == Action::Continue {
                    s.req_map_held = false;
                    s.phase = StreamPhase::Forwarding;
                } else {
                    s.phase = StreamPhase::Paused;
                }
            }
        });
        self.deliver_request_body(id);
        self.inner.driving.set(self.inner.driving.get() - 1);
        self.drive(id);
        id
    }

    /// The request body through `proxy_on_request_body`, chunk by chunk,
    /// as Envoy 1.40 delivers it. Headers the filter paused make Envoy stop
    /// all iteration (`StopAllIterationAndWatermark`, without the plugin
    /// option `allow_on_headers_stop_iteration`): the filter sees none of
    /// the body until it resumes the request, and then all of it. Once the
    /// headers went on, while the filter answers Pause the chunks are
    /// buffered, each call seeing the whole buffer (`body_size` its length,
    /// buffer 0 its bytes, which `proxy_set_buffer_bytes` may replace), and
    /// the request is held until Continue or a resume passes the buffer on.
    fn deliver_request_body(&self, id: StreamId) {
        let (chunks, stop_all) = self.with_stream(id, |s| {
            let stop_all = s.phase == StreamPhase::Paused && !s.request.body.is_empty();
            s.body_pending = stop_all;
            (s.request.body.clone(), stop_all)
        });
        if stop_all {
            return;
        }
        let n = chunks.len();
        for (i, chunk) in chunks.into_iter().enumerate() {
            let before = self.with_stream(id, |s| s.phase);
            if !matches!(before, StreamPhase::Paused | StreamPhase::Forwarding) {
                break;
            }
            let len = self.with_stream(id, |s| {
                s.request_body.extend(chunk);
                s.phase = StreamPhase::RequestBody;
                s.request_body.len() as i32
            });
            let eos = (i + 1 == n) as i32;
            let action = self
                .invoke::<(i32, i32, i32), i32>(
                    id.worker,
                    id.context_id,
                    "proxy_on_request_body",
                    (id.context_id as i32, len, eos),
                )
                .map(Action::from_i32)
                .unwrap_or(Action::Continue);
            self.with_stream(id, |s| {
                if s.phase != StreamPhase::RequestBody {
                    return; // a local reply or reset happened meanwhile
                }
                s.body_actions.push(action);
                if action == Action::Continue {
                    let buffered = std::mem::take(&mut s.request_body);
                    s.upstream_body.extend(buffered);
                    s.req_map_held = false;
                    s.phase = StreamPhase::Forwarding;
                } else {
                    // Held: the request goes upstream when it is resumed.
                    s.phase = StreamPhase::Paused;
                }
            });
        }
    }

    /// A snapshot of a stream (live or finished and not yet forgotten).
    pub fn outcome(&self, id: StreamId) -> Outcome {
        let h = self.host_ref(id.worker);
        let s = h
            .streams
            .get(&id.context_id)
            .unwrap_or_else(|| panic!("no stream {id:?} (already returned by send()?)"));
        let status = s
            .response_headers
            .as_ref()
            .and_then(|hs| find_header(hs, ":status"))
            .and_then(|v| v.parse().ok())
            .or(s.local_response.as_ref().map(|l| l.status as u16))
            .unwrap_or(0);
        Outcome {
            stream: id,
            phase: s.phase,
            request_action: s.request_action,
            paused: s.request_action == Some(Action::Pause) && s.local_response.is_none(),
            completed: s.phase == StreamPhase::Finished,
            cancelled: s.cancelled,
            reset_by_filter: s.reset_by_filter,
            local_response: s.local_response.clone(),
            status,
            headers: s.response_headers.clone().unwrap_or_default(),
            body: s.response_body.clone(),
            upstream_request: s.upstream_request.clone(),
            upstream_body: s.upstream_request.as_ref().map(|_| s.upstream_body.clone()),
            body_actions: s.body_actions.clone(),
            http_calls: s
                .calls
                .iter()
                .filter_map(|t| h.calls.get(t).cloned())
                .collect(),
            resumes: s.resumes,
            on_done_result: s.on_done_result,
            notes: s.notes.clone(),
            set_properties: s.set_properties.clone(),
        }
    }

    /// The client goes away: `on_log`, `on_done`, `on_delete` without any response (pending
    /// callouts of the stream are cancelled, as Envoy does).
    pub fn cancel(&self, id: StreamId) -> Outcome {
        self.with_stream(id, |s| {
            assert!(
                s.phase != StreamPhase::Finished,
                "cancel: stream {id:?} already finished"
            );
            s.cancelled = true;
            s.phase = StreamPhase::Completing;
        });
        self.drive(id);
        self.outcome(id)
    }

    /// Delivers the upstream answer to a request made with `Request::hold_upstream`.
    pub fn respond_upstream(&self, id: StreamId, upstream: Upstream) -> Outcome {
        self.with_stream(id, |s| {
            assert_eq!(
                s.phase,
                StreamPhase::AwaitingUpstream,
                "respond_upstream: stream {id:?} is not waiting for its upstream"
            );
            s.upstream = Some(upstream);
            s.phase = StreamPhase::UpstreamResponse;
        });
        self.drive(id);
        self.outcome(id)
    }

    /// Live (not finished) streams of all workers.
    pub fn open_streams(&self) -> Vec<StreamId> {
        let mut out = Vec::new();
        for w in 0..self.workers() {
            let h = self.host_ref(w);
            for s in h.streams.values().filter(|s| s.alive()) {
                out.push(StreamId {
                    worker: w,
                    context_id: s.id,
                });
            }
        }
        out
    }

    /// Drops the records of finished streams (for long fuzz runs).
    pub fn forget_finished(&self) {
        for w in 0..self.workers() {
            self.host_mut(w).streams.retain(|_, s| s.alive());
        }
    }

    // ----- http callouts -------------------------------------------------------------------

    /// Every callout made so far (all workers).
    pub fn http_calls(&self) -> Vec<HttpCall> {
        (0..self.workers())
            .flat_map(|w| self.host_ref(w).calls.values().cloned().collect::<Vec<_>>())
            .collect()
    }

    pub fn pending_http_calls(&self) -> Vec<HttpCall> {
        self.http_calls()
            .into_iter()
            .filter(|c| c.state == CallState::Pending)
            .collect()
    }

    /// The one callout pending on any worker (`what` names it in the panic
    /// when there is none or more than one).
    pub fn the_pending_call(&self, what: &str) -> HttpCall {
        let calls = self.pending_http_calls();
        let [call] = calls.as_slice() else {
            panic!("one {what} expected: {calls:?}");
        };
        call.clone()
    }

    fn pending_call(&self, w: usize, token: u32) -> HttpCall {
        let h = self.host_ref(w);
        let call = h
            .calls
            .get(&token)
            .unwrap_or_else(|| panic!("no http call {token} on worker {w}"))
            .clone();
        assert_eq!(
            call.state,
            CallState::Pending,
            "http call {token} on worker {w} is not pending"
        );
        call
    }

    /// Answers callout `token` of worker `w`: `proxy_on_http_call_response` on the root
    /// context, with the headers (map 6) and body (buffer 4) available during the call.
    pub fn respond_http_call(&self, w: usize, token: u32, response: CallResponse) {
        self.deliver_http_call(w, token, CallState::Answered, Some(response));
    }

    /// The stream to the cluster is reset: `proxy_on_http_call_response` with 0 headers,
    /// 0 body bytes, 0 trailers and no response to read (Envoy's `onHttpCallFailure`; reading
    /// a response header then returns BadArgument, on which the Rust SDK panics).
    pub fn fail_http_call(&self, w: usize, token: u32) {
        self.deliver_http_call(w, token, CallState::Failed, None);
    }

    /// Answers gRPC callout `token` of worker `w`: status 0 is
    /// `proxy_on_grpc_receive` with `message` in the gRPC receive buffer
    /// (type 5); any other is `proxy_on_grpc_close` with that status, as
    /// Envoy delivers a failed call.
    pub fn respond_grpc_call(&self, w: usize, token: u32, status: u32, message: &[u8]) {
        let call = self.pending_call(w, token);
        assert!(call.grpc.is_some(), "call {token} is not a gRPC call");
        let state = if status == 0 {
            CallState::Answered
        } else {
            CallState::Failed
        };
        {
            let mut h = self.host_mut(w);
            h.calls.get_mut(&token).unwrap().state = state;
            h.http_call_response = (status == 0).then(|| CallResponse::default().body(message));
        }
        let root = ROOT_CONTEXT_ID as i32;
        let (export, arg) = if status == 0 {
            ("proxy_on_grpc_receive", message.len() as i32)
        } else {
            ("proxy_on_grpc_close", status as i32)
        };
        self.invoke::<(i32, i32, i32), ()>(w, ROOT_CONTEXT_ID, export, (root, token as i32, arg));
    }

    /// The call times out: Envoy's async client answers it itself with a 504
    /// (a gRPC call: closed with DEADLINE_EXCEEDED).
    pub fn timeout_http_call(&self, w: usize, token: u32) {
        if self.pending_call(w, token).grpc.is_some() {
            self.respond_grpc_call(w, token, 4, b"");
            self.host_mut(w).calls.get_mut(&token).unwrap().state = CallState::TimedOut;
            return;
        }
        let response = CallResponse::new(504)
            .header("content-length", "24")
            .header("content-type", "text/plain")
            .body("upstream request timeout");
        self.deliver_http_call(w, token, CallState::TimedOut, Some(response));
    }

    fn deliver_http_call(
        &self,
        w: usize,
        token: u32,
        state: CallState,
        response: Option<CallResponse>,
    ) {
        self.pending_call(w, token);
        let (nh, nb, nt) = response.as_ref().map_or((0, 0, 0), |r| {
            (
                r.headers.len() as i32,
                r.body.len() as i32,
                r.trailers.len() as i32,
            )
        });
        {
            let mut h = self.host_mut(w);
            h.calls.get_mut(&token).unwrap().state = state;
            h.http_call_response = response;
        }
        let root = ROOT_CONTEXT_ID as i32;
        self.invoke::<(i32, i32, i32, i32, i32), ()>(
            w,
            ROOT_CONTEXT_ID,
            "proxy_on_http_call_response",
            (root, token as i32, nh, nb, nt),
        );
    }

    // ----- time ----------------------------------------------------------------------------

    pub fn now_ns(&self) -> u64 {
        self.inner.clock.get()
    }

    /// Sets the clock without firing timers (it may go backwards: tests of clock skew).
    /// Moves the monotonic and the wall clock together.
    pub fn set_time_ns(&self, ns: u64) {
        self.inner.clock.set(ns);
    }

    /// What the wall clock (`proxy_get_current_time_nanoseconds`, WASI realtime) reads now.
    pub fn wall_now_ns(&self) -> u64 {
        self.inner.wall_now_ns()
    }

    /// Steps the wall clock alone by `delta_ns` (negative: back), as NTP or an operator
    /// does; the monotonic clock, timers and callout timeouts go on undisturbed.
    pub fn step_wall_clock(&self, delta_ns: i64) {
        let offset = &self.inner.wall_offset_ns;
        offset.set(offset.get().saturating_add(delta_ns));
    }

    // ----- host failures -------------------------------------------------------------------

    /// The next `proxy_send_local_response` call fails with `status` (e.g. BAD_ARGUMENT, as
    /// Envoy answers a second local reply) and sends nothing.
    pub fn fail_next_local_response(&self, status: u32) {
        self.inner
            .local_response_faults
            .borrow_mut()
            .push_back(status);
    }

    /// Advances the clock by `d`, firing on the way, in time order, every worker's `on_tick`
    /// whose period elapses and the 504 of every callout whose timeout elapses (the clock
    /// reads the event's time while it runs).
    pub fn advance(&self, d: Duration) {
        let target = self.now_ns() + d.as_nanos() as u64;
        loop {
            // (time, kind: 0 callout timeout / 1 tick, worker, token)
            let mut next: Option<(u64, u8, usize, u32)> = None;
            for w in 0..self.workers() {
                let h = self.host_ref(w);
                let ticks = h.next_tick_ns.map(|t| (t, 1, w, 0));
                let timeouts = h
                    .calls
                    .values()
                    .filter(|c| c.state == CallState::Pending)
                    .filter_map(|c| c.deadline_ns.map(|t| (t, 0, w, c.token)));
                for ev in ticks.into_iter().chain(timeouts) {
                    if ev.0 <= target && next.is_none_or(|n| ev < n) {
                        next = Some(ev);
                    }
                }
            }
            let Some((t, kind, w, token)) = next else {
                break;
            };
            self.inner.clock.set(t.max(self.now_ns()));
            if kind == 0 {
                self.timeout_http_call(w, token);
                continue;
            }
            {
                let mut h = self.host_mut(w);
                let period = h.tick_period_ms as u64 * 1_000_000;
                h.next_tick_ns = Some(t + period.max(1));
            }
            self.tick(w);
        }
        self.inner.clock.set(target);
    }

    pub fn advance_ms(&self, ms: u64) {
        self.advance(Duration::from_millis(ms))
    }

    /// Calls `proxy_on_tick` on worker `w`'s root context now (whatever its period).
    pub fn tick(&self, w: usize) {
        self.check_usable(w);
        self.invoke::<i32, ()>(w, ROOT_CONTEXT_ID, "proxy_on_tick", ROOT_CONTEXT_ID as i32);
    }

    pub fn tick_all(&self) {
        for w in 0..self.workers() {
            self.tick(w);
        }
    }

    /// The period worker `w` asked for with `proxy_set_tick_period_milliseconds` (0 = none).
    pub fn tick_period_ms(&self, w: usize) -> u32 {
        self.host_ref(w).tick_period_ms
    }

    /// How many times worker `w` called `proxy_done`.
    pub fn done_calls(&self, w: usize) -> u32 {
        self.host_ref(w).done_calls
    }

    // ----- shared data ---------------------------------------------------------------------

    pub fn shared(&self) -> Ref<'_, SharedData> {
        self.inner.shared.borrow()
    }

    /// Direct access, e.g. to seed entries or move the cas counter (not counted in stats).
    pub fn shared_mut(&self) -> RefMut<'_, SharedData> {
        self.inner.shared.borrow_mut()
    }

    pub fn shared_len(&self) -> usize {
        self.shared().len()
    }

    pub fn shared_bytes(&self) -> usize {
        self.shared().total_bytes()
    }

    pub fn shared_keys(&self) -> Vec<String> {
        self.shared().keys().map(str::to_string).collect()
    }

    pub fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared().get(key).ok()
    }

    pub fn shared_stats(&self) -> SharedStats {
        self.shared().stats
    }

    pub fn reset_shared_stats(&self) {
        self.shared_mut().stats = SharedStats::default();
    }

    /// When worker(s) `workers` next call `proxy_set_shared_data` on a key matching `keys`,
    /// `f` runs first (before the set is applied). `f` may drive other workers.
    pub fn before_next_shared_set(
        &self,
        workers: impl Into<Workers>,
        keys: KeyFilter,
        f: impl FnOnce(&Harness, &SharedSetEvent) + 'static,
    ) {
        self.inner.hooks.borrow_mut().before_set.push(SetHook {
            workers: workers.into(),
            keys,
            f: Box::new(f),
        });
    }

    /// When worker(s) `workers` next call `proxy_get_shared_data` on a key matching `keys`,
    /// `f` runs after the value was read (before the filter sees it).
    pub fn after_next_shared_get(
        &self,
        workers: impl Into<Workers>,
        keys: KeyFilter,
        f: impl FnOnce(&Harness, &SharedGetEvent) + 'static,
    ) {
        self.add_get_hook(workers.into(), keys, GetWhen::Any, Box::new(f));
    }

    /// Like `after_next_shared_get`, for the next get that returns NotFound.
    pub fn after_next_shared_get_missing(
        &self,
        workers: impl Into<Workers>,
        keys: KeyFilter,
        f: impl FnOnce(&Harness, &SharedGetEvent) + 'static,
    ) {
        self.add_get_hook(workers.into(), keys, GetWhen::Missing, Box::new(f));
    }

    /// Like `after_next_shared_get`, for the next get that finds the key.
    pub fn after_next_shared_get_found(
        &self,
        workers: impl Into<Workers>,
        keys: KeyFilter,
        f: impl FnOnce(&Harness, &SharedGetEvent) + 'static,
    ) {
        self.add_get_hook(workers.into(), keys, GetWhen::Found, Box::new(f));
    }

    fn add_get_hook(&self, workers: Workers, keys: KeyFilter, when: GetWhen, f: GetHookFn) {
        self.inner.hooks.borrow_mut().after_get.push(GetHook {
            workers,
            keys,
            when,
            f,
        });
    }

    /// The next `count` CAS sets (cas != 0) on keys matching `keys`, by any worker, fail with
    /// CasMismatch without writing.
    pub fn fail_next_cas_sets(&self, count: usize, keys: KeyFilter) {
        self.fail_next_cas_sets_on(Workers::Any, count, keys);
    }

    pub fn fail_next_cas_sets_on(
        &self,
        workers: impl Into<Workers>,
        count: usize,
        keys: KeyFilter,
    ) {
        if count > 0 {
            self.inner.hooks.borrow_mut().cas_faults.push(CasFault {
                workers: workers.into(),
                keys,
                remaining: count,
            });
        }
    }

    /// Hooks registered but not fired yet (assert 0 to prove a forced race really happened).
    pub fn pending_hooks(&self) -> usize {
        let h = self.inner.hooks.borrow();
        h.before_set.len() + h.after_get.len()
    }

    /// Hooks fired so far.
    pub fn fired_hooks(&self) -> usize {
        self.inner.hooks.borrow().fired
    }

    /// Injected CAS failures not used yet.
    pub fn pending_cas_faults(&self) -> usize {
        self.inner
            .hooks
            .borrow()
            .cas_faults
            .iter()
            .map(|f| f.remaining)
            .sum()
    }

    pub fn clear_hooks(&self) {
        let mut h = self.inner.hooks.borrow_mut();
        h.before_set.clear();
        h.after_get.clear();
        h.cas_faults.clear();
    }

    // ----- metrics -------------------------------------------------------------------------

    /// Calls `proxy_on_tick` on every worker running the filter: the filter
    /// flushes the counts it keeps in the VM on its tick, so a counter read
    /// here is what Envoy shows after that (the tick's other work runs too).
    pub fn flush_metrics(&self) {
        for w in 0..self.workers() {
            let usable = {
                let wk = self.worker_ref(w);
                wk.store.data().poisoned.is_none() && wk.vm_started && wk.configured
            };
            if usable {
                self.tick(w);
            }
        }
    }

    /// Value of a counter or gauge (one value for all workers, as in
    /// Envoy's stats) after the workers' tick ([`Harness::flush_metrics`]).
    /// Panics if the filter never defined it.
    pub fn metric(&self, name: &str) -> u64 {
        self.flush_metrics();
        let metrics = self.inner.metrics.borrow();
        match metrics.get(name) {
            Some(m) => m.value as u64,
            None => panic!(
                "metric `{name}` was never defined by the filter; defined: {:?}",
                metrics.keys().collect::<Vec<_>>()
            ),
        }
    }

    /// Value of a counter as the host holds it now, without the workers'
    /// tick: what the filter handed over so far.
    pub fn metric_unflushed(&self, name: &str) -> Option<u64> {
        self.inner
            .metrics
            .borrow()
            .get(name)
            .map(|m| m.value as u64)
    }

    pub fn metric_opt(&self, name: &str) -> Option<u64> {
        self.flush_metrics();
        self.inner
            .metrics
            .borrow()
            .get(name)
            .map(|m| m.value as u64)
    }

    pub fn metrics(&self) -> BTreeMap<String, Metric> {
        self.flush_metrics();
        self.inner.metrics.borrow().clone()
    }

    // ----- logs ----------------------------------------------------------------------------

    pub fn logs(&self) -> Vec<LogEntry> {
        self.inner.logs.borrow().clone()
    }

    pub fn logs_containing(&self, needle: &str) -> Vec<LogEntry> {
        self.inner
            .logs
            .borrow()
            .iter()
            .filter(|l| l.message.contains(needle))
            .cloned()
            .collect()
    }

    /// Log entries at `level` or above.
    pub fn logs_at_least(&self, level: LogLevel) -> Vec<LogEntry> {
        self.inner
            .logs
            .borrow()
            .iter()
            .filter(|l| l.level >= level)
            .cloned()
            .collect()
    }

    /// All log lines, one per line (for failure messages).
    pub fn log_text(&self) -> String {
        self.inner
            .logs
            .borrow()
            .iter()
            .map(|l| format!("{l}\n"))
            .collect()
    }

    pub fn clear_logs(&self) {
        self.inner.logs.borrow_mut().clear();
    }

    fn log_tail(&self, w: usize, n: usize) -> String {
        let logs = self.inner.logs.borrow();
        let mine: Vec<_> = logs.iter().filter(|l| l.worker == w).collect();
        mine[mine.len().saturating_sub(n)..]
            .iter()
            .map(|l| format!("{l}\n"))
            .collect()
    }

    /// Protocol oddities the host noticed outside any stream (e.g. a resume on the root
    /// context); per-stream ones are in `Outcome::notes`.
    pub fn notes(&self) -> Vec<String> {
        self.inner.notes.borrow().clone()
    }
}

/// The response headers Envoy builds for `sendLocalReply`: `:status`, the filter's headers
/// (names lowercased, appended), then `content-length` and, if the filter gave none,
/// `content-type: text/plain` when there is a body; with an empty body both are removed.
fn local_reply_headers(lr: &LocalResponse) -> (Vec<(String, Vec<u8>)>, Vec<u8>) {
    let mut headers = vec![(":status".to_string(), lr.status.to_string().into_bytes())];
    for (k, v) in &lr.headers {
        headers.push((k.to_ascii_lowercase(), v.clone()));
    }
    if lr.body.is_empty() {
        headers.retain(|(k, _)| k != "content-length" && k != "content-type");
    } else {
        headers.retain(|(k, _)| k != "content-length");
        headers.push((
            "content-length".to_string(),
            lr.body.len().to_string().into_bytes(),
        ));
        if !headers.iter().any(|(k, _)| k == "content-type") {
            headers.push(("content-type".to_string(), b"text/plain".to_vec()));
        }
    }
    (headers, lr.body.clone())
}

// ---------------------------------------------------------------------------------------------
// Readable Debug output: byte strings shown as (lossy, escaped) text.

/// Shows bytes as a string literal (non-UTF-8 bytes escaped, long values shortened).
pub struct Lossy<'a>(pub &'a [u8]);

impl fmt::Debug for Lossy<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MAX: usize = 200;
        let shown = &self.0[..self.0.len().min(MAX)];
        let mut text = String::new();
        for chunk in shown.utf8_chunks() {
            text.extend(chunk.valid().escape_debug());
            for b in chunk.invalid() {
                text.push_str(&format!("\\x{b:02x}"));
            }
        }
        if self.0.len() > MAX {
            write!(f, "\"{text}\"... ({} bytes)", self.0.len())
        } else {
            write!(f, "\"{text}\"")
        }
    }
}

/// Shows header pairs as `name: "value"` entries.
pub struct PairsDbg<'a>(pub &'a [(String, Vec<u8>)]);

impl fmt::Debug for PairsDbg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| (k, Lossy(v))))
            .finish()
    }
}

impl fmt::Debug for LocalResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalResponse")
            .field("status", &self.status)
            .field("headers", &PairsDbg(&self.headers))
            .field("body", &Lossy(&self.body))
            .field("details", &self.details)
            .field("grpc_status", &self.grpc_status)
            .finish()
    }
}

impl fmt::Debug for HttpCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpCall")
            .field("worker", &self.worker)
            .field("token", &self.token)
            .field("context_id", &self.context_id)
            .field("upstream", &self.upstream)
            .field("headers", &PairsDbg(&self.headers))
            .field("body", &Lossy(&self.body))
            .field("trailers", &PairsDbg(&self.trailers))
            .field("timeout_ms", &self.timeout_ms)
            .field("deadline_ns", &self.deadline_ns)
            .field("grpc", &self.grpc)
            .field("state", &self.state)
            .finish()
    }
}

impl fmt::Debug for CallResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallResponse")
            .field("headers", &PairsDbg(&self.headers))
            .field("body", &Lossy(&self.body))
            .field("trailers", &PairsDbg(&self.trailers))
            .finish()
    }
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("status", &self.status)
            .field("headers", &PairsDbg(&self.headers))
            .field("body", &Lossy(&self.body))
            .finish()
    }
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let props: Vec<_> = self
            .properties
            .iter()
            .map(|(p, v)| (p.join("."), Lossy(v)))
            .collect();
        f.debug_struct("Request")
            .field("headers", &PairsDbg(&self.headers))
            .field("properties", &props)
            .field("upstream", &self.upstream)
            .field("hold_upstream", &self.hold_upstream)
            .finish()
    }
}

impl fmt::Debug for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outcome")
            .field("stream", &self.stream)
            .field("phase", &self.phase)
            .field("status", &self.status)
            .field("headers", &PairsDbg(&self.headers))
            .field("body", &Lossy(&self.body))
            .field("request_action", &self.request_action)
            .field("paused", &self.paused)
            .field("completed", &self.completed)
            .field("cancelled", &self.cancelled)
            .field("reset_by_filter", &self.reset_by_filter)
            .field("local_response", &self.local_response)
            .field(
                "upstream_request",
                &self.upstream_request.as_deref().map(PairsDbg),
            )
            .field("http_calls", &self.http_calls)
            .field("resumes", &self.resumes)
            .field("on_done_result", &self.on_done_result)
            .field("notes", &self.notes)
            .finish()
    }
}
