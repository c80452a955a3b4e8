//! The host side of the proxy-wasm ABI 0.2.1 (module `env`) and a minimal hand-written WASI
//! (`wasi_snapshot_preview1`), following what Envoy (proxy-wasm-cpp-host + Envoy's
//! `source/extensions/common/wasm/context.cc`) does where it matters to a filter:
//!
//! * header maps: request headers are readable and writable only while Envoy holds them
//!   (during `on_request_headers` and while the request is paused); once `on_request_headers`
//!   returned Continue, reading a value returns BadArgument (the SDK then panics). Response
//!   headers likewise only during `on_response_headers`. In `on_log` both maps are the final
//!   ones (a missing map gives NotFound there). Pairs of an unavailable map are empty.
//! * request bodies (buffer 0): a filter that paused the headers sees none of the body until
//!   it resumes them (Envoy's StopAllIterationAndWatermark); after that, chunks the filter
//!   answers Pause for are buffered and it sees the whole buffer, which it may replace.
//! * `send_local_response`, `continue_stream` and `close_stream` take effect after the current
//!   VM call returns (Envoy defers them the same way).
//! * unknown imports trap with a message naming them.

use super::shared::status::*;
use super::wire;
use super::{
    Action, CallResponse, CallState, Harness, HttpCall, Inner, LocalResponse, LogEntry, LogLevel,
    LogSource, MetricKind, Request, SharedGetEvent, SharedSetEvent, Upstream,
};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::rc::{Rc, Weak};
use wasmtime::{bail, format_err, Caller, Engine, Extern, ExternType, Linker, Module, Result, Val};

pub(crate) type Pairs = Vec<(String, Vec<u8>)>;

/// Where a stream is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamPhase {
    /// Context created, `on_request_headers` not yet called.
    Created,
    /// Inside `on_request_headers`.
    RequestHeaders,
    /// `on_request_headers` returned Pause (waiting for the filter to resume it).
    Paused,
    /// Inside `on_request_body`.
    RequestBody,
    /// The request goes upstream (transient).
    Forwarding,
    /// The request went upstream and the test holds the answer (`Request::hold_upstream`).
    AwaitingUpstream,
    /// The upstream answered (transient).
    UpstreamResponse,
    /// A local response is to be sent (transient).
    LocalReply,
    /// Inside `on_response_headers`.
    ResponseHeaders,
    /// `on_response_headers` returned Pause.
    ResponsePaused,
    /// `on_log` / `on_done` / `on_delete` are to be called (transient).
    Completing,
    /// `on_delete` was called; the context is gone.
    Finished,
}

/// Effects the VM asked for, applied after the current VM call returns (as Envoy does).
#[derive(Clone, Copy, Debug)]
pub(crate) enum AfterAction {
    LocalReply(u32),
    ContinueRequest(u32),
    ContinueResponse(u32),
    Reset(u32),
    /// An item was put in this worker's shared queue: Envoy posts the
    /// registering root's `proxy_on_queue_ready` to the worker's event loop.
    QueueReady(u32),
}

#[derive(Debug)]
pub(crate) struct StreamState {
    pub id: u32,
    pub request: Request,
    pub request_headers: Pairs,
    pub req_map_held: bool,
    pub response_headers: Option<Pairs>,
    pub resp_map_held: bool,
    pub response_body: Vec<u8>,
    /// The request body the host holds for the filter (buffer 0).
    pub request_body: Vec<u8>,
    /// The request body that went upstream.
    pub upstream_body: Vec<u8>,
    /// What each `proxy_on_request_body` call returned.
    pub body_actions: Vec<Action>,
    /// The request body waits for a resume before the filter sees it: the
    /// headers paused (Envoy turns that Pause into StopAllIterationAndWatermark).
    pub body_pending: bool,
    /// The chunk `proxy_on_response_body` is called with, while it is.
    pub body_chunk: Option<Vec<u8>>,
    pub access_log_phase: bool,
    pub phase: StreamPhase,
    pub request_action: Option<Action>,
    pub response_action: Option<Action>,
    pub local_response: Option<LocalResponse>,
    pub upstream: Option<Upstream>,
    pub upstream_request: Option<Pairs>,
    pub resumes: u32,
    pub cancelled: bool,
    pub reset_by_filter: bool,
    pub on_done_result: Option<bool>,
    pub calls: Vec<u32>,
    pub set_properties: Vec<(Vec<String>, Vec<u8>)>,
    pub notes: Vec<String>,
}

impl StreamState {
    pub fn new(id: u32, request: Request) -> Self {
        StreamState {
            id,
            request_headers: request.headers.clone(),
            request,
            req_map_held: false,
            response_headers: None,
            resp_map_held: false,
            response_body: Vec::new(),
            request_body: Vec::new(),
            upstream_body: Vec::new(),
            body_actions: Vec::new(),
            body_pending: false,
            body_chunk: None,
            access_log_phase: false,
            phase: StreamPhase::Created,
            request_action: None,
            response_action: None,
            local_response: None,
            upstream: None,
            upstream_request: None,
            resumes: 0,
            cancelled: false,
            reset_by_filter: false,
            on_done_result: None,
            calls: Vec::new(),
            set_properties: Vec::new(),
            notes: Vec::new(),
        }
    }

    pub fn alive(&self) -> bool {
        self.phase != StreamPhase::Finished
    }
}

/// Deterministic random bytes (splitmix64).
pub(crate) use testkit::rng::Rng;

/// Per-worker (per-VM) host state, the `T` of the worker's `Store<T>`.
pub(crate) struct HostState {
    pub worker: usize,
    pub inner: Weak<Inner>,
    /// The context the host called into.
    pub current_ctx: u32,
    /// Set by `proxy_set_effective_context` for the rest of the current VM call.
    pub effective_ctx: Option<u32>,
    /// Name of the export being called (for messages).
    pub in_call: Option<String>,
    pub plugin_config_available: bool,
    pub streams: BTreeMap<u32, StreamState>,
    pub next_ctx: u32,
    pub calls: BTreeMap<u32, HttpCall>,
    pub next_token: u32,
    pub http_call_response: Option<CallResponse>,
    pub tick_period_ms: u32,
    pub next_tick_ns: Option<u64>,
    pub metric_ids: HashMap<u32, String>,
    pub metric_by_name: HashMap<String, u32>,
    pub rng: Rng,
    pub out_buf: [Vec<u8>; 2],
    pub actions: VecDeque<AfterAction>,
    pub done_calls: u32,
    pub root_set_properties: Vec<(Vec<String>, Vec<u8>)>,
    pub poisoned: Option<String>,
    /// Shared queues this worker registered: id → name and items.
    pub queues: BTreeMap<u32, (String, VecDeque<Vec<u8>>)>,
}

impl HostState {
    pub fn new(worker: usize, inner: Weak<Inner>, seed: u64) -> Self {
        HostState {
            worker,
            inner,
            current_ctx: 0,
            effective_ctx: None,
            in_call: None,
            plugin_config_available: false,
            streams: BTreeMap::new(),
            next_ctx: super::ROOT_CONTEXT_ID + 1,
            calls: BTreeMap::new(),
            next_token: 1,
            http_call_response: None,
            tick_period_ms: 0,
            next_tick_ns: None,
            metric_ids: HashMap::new(),
            metric_by_name: HashMap::new(),
            rng: Rng::new(seed),
            out_buf: [Vec::new(), Vec::new()],
            actions: VecDeque::new(),
            done_calls: 0,
            root_set_properties: Vec::new(),
            poisoned: None,
            queues: BTreeMap::new(),
        }
    }

    pub fn inner(&self) -> Rc<Inner> {
        self.inner
            .upgrade()
            .expect("the Harness was dropped while its VM was running")
    }

    pub fn active_ctx(&self) -> u32 {
        self.effective_ctx.unwrap_or(self.current_ctx)
    }

    pub fn active_stream(&self) -> Option<&StreamState> {
        self.streams.get(&self.active_ctx()).filter(|s| s.alive())
    }

    pub fn active_stream_mut(&mut self) -> Option<&mut StreamState> {
        let id = self.active_ctx();
        self.streams.get_mut(&id).filter(|s| s.alive())
    }

    fn note(&self, msg: String) {
        let inner = self.inner();
        inner
            .notes
            .borrow_mut()
            .push(format!("worker {}: {msg}", self.worker));
    }

    fn log(&self, level: LogLevel, source: LogSource, message: String) {
        let inner = self.inner();
        inner.logs.borrow_mut().push(LogEntry {
            worker: self.worker,
            level,
            source,
            message,
        });
    }

    /// Moves complete lines (and, with `all`, any rest) of captured stdout/stderr to the logs.
    pub fn flush_output(&mut self, all: bool) {
        for fd in 0..2 {
            loop {
                let buf = &mut self.out_buf[fd];
                let line = match buf.iter().position(|b| *b == b'\n') {
                    Some(i) => {
                        let line: Vec<u8> = buf.drain(..=i).collect();
                        line[..line.len() - 1].to_vec()
                    }
                    None if all && !buf.is_empty() => std::mem::take(buf),
                    None => break,
                };
                let (level, source) = if fd == 0 {
                    (LogLevel::Info, LogSource::Stdout)
                } else {
                    (LogLevel::Error, LogSource::Stderr)
                };
                self.log(level, source, String::from_utf8_lossy(&line).into_owned());
            }
        }
    }

    /// The map `map_type` as Envoy's `getConstMap` would give it to the active context.
    fn const_map(&self, map_type: i32) -> Option<&Pairs> {
        match map_type {
            6 => return self.http_call_response.as_ref().map(|r| &r.headers),
            7 => return self.http_call_response.as_ref().map(|r| &r.trailers),
            _ => {}
        }
        let s = self.active_stream()?;
        match map_type {
            0 if s.access_log_phase || s.req_map_held => Some(&s.request_headers),
            2 if s.access_log_phase || s.resp_map_held => s.response_headers.as_ref(),
            _ => None,
        }
    }

    /// The map `map_type` as Envoy's (mutable) `getMap` would give it to the active context.
    fn mut_map(&mut self, map_type: i32) -> Option<&mut Pairs> {
        let s = self.active_stream_mut()?;
        match map_type {
            0 if s.req_map_held => Some(&mut s.request_headers),
            2 if s.resp_map_held => s.response_headers.as_mut(),
            _ => None,
        }
    }

    fn access_log_phase(&self) -> bool {
        self.active_stream().is_some_and(|s| s.access_log_phase)
    }

    fn property(&self, path: &[String]) -> Option<Vec<u8>> {
        let inner = self.inner();
        if let Some(s) = self.active_stream() {
            if let Some((_, v)) = s.set_properties.iter().rev().find(|(p, _)| p == path) {
                return Some(v.clone());
            }
            if let Some((_, v)) = s.request.properties.iter().rev().find(|(p, _)| p == path) {
                return Some(v.clone());
            }
            let header = |name: &str| {
                s.request_headers
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            };
            let p: Vec<&str> = path.iter().map(|s| s.as_str()).collect();
            let derived = match p.as_slice() {
                ["source", "port"] | ["destination", "port"] => {
                    let addr_path = [p[0].to_string(), "address".to_string()];
                    s.request
                        .properties
                        .iter()
                        .rev()
                        .find(|(k, _)| k[..] == addr_path[..])
                        .and_then(|(_, v)| {
                            let text = String::from_utf8_lossy(v).into_owned();
                            let port = text.rsplit_once(':')?.1.parse::<i64>().ok()?;
                            Some(port.to_le_bytes().to_vec())
                        })
                }
                ["request", "path"] => header(":path"),
                ["request", "url_path"] => header(":path").map(|v| {
                    let end = v.iter().position(|b| *b == b'?').unwrap_or(v.len());
                    v[..end].to_vec()
                }),
                ["request", "host"] => header(":authority"),
                ["request", "method"] => header(":method"),
                ["request", "scheme"] => header(":scheme"),
                ["request", "protocol"] => Some(b"HTTP/1.1".to_vec()),
                _ => None,
            };
            if derived.is_some() {
                return derived;
            }
        }
        if let Some((_, v)) = self
            .root_set_properties
            .iter()
            .rev()
            .find(|(p, _)| p == path)
        {
            return Some(v.clone());
        }
        inner
            .opts
            .root_properties
            .iter()
            .rev()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Memory helpers.

type C<'a> = Caller<'a, HostState>;

fn memory(caller: &mut C<'_>) -> Result<wasmtime::Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => bail!("the module exports no memory named `memory`"),
    }
}

fn read(caller: &mut C<'_>, ptr: i32, len: i32) -> Result<Vec<u8>> {
    let (p, l) = (ptr as u32 as usize, len as u32 as usize);
    if l == 0 {
        return Ok(Vec::new());
    }
    let mem = memory(caller)?;
    let data = mem.data(&*caller);
    data.get(p..p.saturating_add(l))
        .map(|s| s.to_vec())
        .ok_or_else(|| {
            format_err!(
                "invalid memory access: {l} bytes at {p:#x} (memory is {} bytes)",
                data.len()
            )
        })
}

fn read_str(caller: &mut C<'_>, ptr: i32, len: i32) -> Result<String> {
    Ok(String::from_utf8_lossy(&read(caller, ptr, len)?).into_owned())
}

fn write(caller: &mut C<'_>, ptr: i32, bytes: &[u8]) -> Result<()> {
    let p = ptr as u32 as usize;
    let mem = memory(caller)?;
    let data = mem.data_mut(&mut *caller);
    let len = data.len();
    match data.get_mut(p..p.saturating_add(bytes.len())) {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            Ok(())
        }
        None => bail!(
            "invalid memory write: {} bytes at {p:#x} (memory is {len} bytes)",
            bytes.len()
        ),
    }
}

fn write_u32(caller: &mut C<'_>, ptr: i32, v: u32) -> Result<()> {
    write(caller, ptr, &v.to_le_bytes())
}

fn write_u64(caller: &mut C<'_>, ptr: i32, v: u64) -> Result<()> {
    write(caller, ptr, &v.to_le_bytes())
}

/// Envoy's `copyToPointerSize`: allocate in the VM via `proxy_on_memory_allocate` (or `malloc`),
/// copy, and store pointer and size; an empty value stores pointer 0 and size 0.
fn alloc_copy(caller: &mut C<'_>, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> Result<()> {
    let mut ptr = 0u32;
    if !bytes.is_empty() {
        let func = caller
            .get_export("proxy_on_memory_allocate")
            .or_else(|| caller.get_export("malloc"))
            .and_then(|e| e.into_func())
            .ok_or_else(|| {
                format_err!("module exports neither proxy_on_memory_allocate nor malloc")
            })?;
        let func = func.typed::<i32, i32>(&*caller)?;
        ptr = func.call(&mut *caller, bytes.len() as i32)? as u32;
        if ptr == 0 {
            bail!("proxy_on_memory_allocate({}) returned 0", bytes.len());
        }
        write(caller, ptr as i32, bytes)?;
    }
    write_u32(caller, ptr_ptr, ptr)?;
    write_u32(caller, size_ptr, bytes.len() as u32)
}

fn read_pairs(caller: &mut C<'_>, ptr: i32, len: i32, what: &str) -> Result<Pairs> {
    let raw = read(caller, ptr, len)?;
    wire::deserialize_pairs(&raw).map_err(|e| format_err!("{what}: malformed pairs: {e}"))
}

fn lower(key: &str) -> String {
    key.to_ascii_lowercase()
}

fn i(status: u32) -> i32 {
    status as i32
}

// ---------------------------------------------------------------------------------------------
// The linker.

struct Defs<'a> {
    linker: &'a mut Linker<HostState>,
    names: HashSet<(String, String)>,
}

macro_rules! def {
    ($defs:expr, $module:expr, $name:expr, $f:expr) => {{
        $defs.linker.func_wrap($module, $name, $f)?;
        $defs.names.insert(($module.to_string(), $name.to_string()));
    }};
}

/// Builds a linker with every host function; imports of `module` the harness does not
/// implement trap with a message naming them.
pub(crate) fn linker(engine: &Engine, module: &Module) -> Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    let mut defs = Defs {
        linker: &mut linker,
        names: HashSet::new(),
    };
    define_env(&mut defs)?;
    define_wasi(&mut defs)?;
    let names = defs.names;
    for import in module.imports() {
        let key = (import.module().to_string(), import.name().to_string());
        if names.contains(&key) {
            continue;
        }
        if let ExternType::Func(ty) = import.ty() {
            let full = format!("{}.{}", key.0, key.1);
            linker.func_new(&key.0, &key.1, ty, move |caller, _, _| {
                bail!(
                    "the filter called host import `{full}`, which the test harness does not \
                     implement (worker {}, during {})",
                    caller.data().worker,
                    caller.data().in_call.as_deref().unwrap_or("?")
                )
            })?;
        }
    }
    Ok(linker)
}

fn define_env(d: &mut Defs<'_>) -> Result<()> {
    const ENV: &str = "env";

    def!(d, ENV, "proxy_log", |mut c: C<'_>,
                               level: i32,
                               ptr: i32,
                               len: i32|
     -> Result<i32> {
        let msg = read_str(&mut c, ptr, len)?;
        let level = LogLevel::from_i32(level)
            .ok_or_else(|| format_err!("proxy_log: bad log level {level}"))?;
        c.data().log(level, LogSource::Proxy, msg);
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_get_log_level", |mut c: C<'_>,
                                         ret: i32|
     -> Result<i32> {
        let level = c.data().inner().opts.log_level as u32;
        write_u32(&mut c, ret, level)?;
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_get_current_time_nanoseconds", |mut c: C<
        '_,
    >,
                                                        ret: i32|
     -> Result<
        i32,
    > {
        let now = c.data().inner().wall_now_ns();
        write_u64(&mut c, ret, now)?;
        Ok(i(OK))
    });

    def!(
        d,
        ENV,
        "proxy_set_tick_period_milliseconds",
        |mut c: C<'_>, period: i32| -> Result<i32> {
            let now = c.data().inner().clock.get();
            let h = c.data_mut();
            h.tick_period_ms = period as u32;
            h.next_tick_ns = if period == 0 {
                None
            } else {
                Some(now + period as u32 as u64 * 1_000_000)
            };
            Ok(i(OK))
        }
    );

    def!(d, ENV, "proxy_get_buffer_bytes", |mut c: C<'_>,
                                            ty: i32,
                                            start: i32,
                                            max: i32,
                                            ptr_ptr: i32,
                                            size_ptr: i32|
     -> Result<i32> {
        let buf = match buffer(&c, ty) {
            Some(b) => b,
            None => return Ok(i(NOT_FOUND)),
        };
        let (start, max) = (start as u32 as usize, max as u32 as usize);
        if start > buf.len() {
            return Ok(i(BAD_ARGUMENT));
        }
        let len = max.min(buf.len() - start);
        if len == 0 {
            return Ok(i(OK));
        }
        alloc_copy(&mut c, &buf[start..start + len], ptr_ptr, size_ptr)?;
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_get_buffer_status", |mut c: C<'_>,
                                             ty: i32,
                                             len_ptr: i32,
                                             flags_ptr: i32|
     -> Result<i32> {
        let buf = match buffer(&c, ty) {
            Some(b) => b,
            None => return Ok(i(NOT_FOUND)),
        };
        write_u32(&mut c, len_ptr, buf.len() as u32)?;
        write_u32(&mut c, flags_ptr, 0)?;
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_set_buffer_bytes", |mut c: C<'_>,
                                            ty: i32,
                                            start: i32,
                                            size: i32,
                                            ptr: i32,
                                            len: i32|
     -> Result<i32> {
        let data = read(&mut c, ptr, len)?;
        if ty != 0 && ty != 1 {
            bail!("proxy_set_buffer_bytes(buffer type {ty}): the harness only supports the request (0) and response (1) bodies");
        }
        let Some(s) = c.data_mut().active_stream_mut() else {
            return Ok(i(NOT_FOUND));
        };
        let body = if ty == 0 {
            &mut s.request_body
        } else {
            &mut s.response_body
        };
        let start = (start as u32 as usize).min(body.len());
        let end = start.saturating_add(size as u32 as usize).min(body.len());
        body.splice(start..end, data);
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_get_header_map_pairs", |mut c: C<'_>,
                                                ty: i32,
                                                ptr_ptr: i32,
                                                size_ptr: i32|
     -> Result<i32> {
        let pairs = c.data().const_map(ty).cloned().unwrap_or_default();
        let bytes = if pairs.is_empty() {
            Vec::new()
        } else {
            wire::serialize_pairs(&pairs)
        };
        alloc_copy(&mut c, &bytes, ptr_ptr, size_ptr)?;
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_set_header_map_pairs", |mut c: C<'_>,
                                                ty: i32,
                                                ptr: i32,
                                                len: i32|
     -> Result<i32> {
        let pairs = read_pairs(&mut c, ptr, len, "proxy_set_header_map_pairs")?;
        match c.data_mut().mut_map(ty) {
            Some(map) => {
                *map = pairs.into_iter().map(|(k, v)| (lower(&k), v)).collect();
                Ok(i(OK))
            }
            None => Ok(i(BAD_ARGUMENT)),
        }
    });

    def!(d, ENV, "proxy_get_header_map_value", |mut c: C<'_>,
                                                ty: i32,
                                                kp: i32,
                                                kl: i32,
                                                vpp: i32,
                                                vsp: i32|
     -> Result<i32> {
        let key = lower(&read_str(&mut c, kp, kl)?);
        let h = c.data();
        let value = match h.const_map(ty) {
            None if h.access_log_phase() => return Ok(i(NOT_FOUND)),
            None => return Ok(i(BAD_ARGUMENT)),
            Some(map) => match map.iter().find(|(k, _)| *k == key) {
                Some((_, v)) => v.clone(),
                None => return Ok(i(NOT_FOUND)),
            },
        };
        alloc_copy(&mut c, &value, vpp, vsp)?;
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_add_header_map_value", |mut c: C<'_>,
                                                ty: i32,
                                                kp: i32,
                                                kl: i32,
                                                vp: i32,
                                                vl: i32|
     -> Result<i32> {
        let key = lower(&read_str(&mut c, kp, kl)?);
        let value = read(&mut c, vp, vl)?;
        match c.data_mut().mut_map(ty) {
            Some(map) => {
                map.push((key, value));
                Ok(i(OK))
            }
            None => Ok(i(BAD_ARGUMENT)),
        }
    });

    def!(d, ENV, "proxy_replace_header_map_value", |mut c: C<'_>,
                                                    ty: i32,
                                                    kp: i32,
                                                    kl: i32,
                                                    vp: i32,
                                                    vl: i32|
     -> Result<
        i32,
    > {
        let key = lower(&read_str(&mut c, kp, kl)?);
        let value = read(&mut c, vp, vl)?;
        match c.data_mut().mut_map(ty) {
            Some(map) => {
                // Envoy's setCopy: remove every value of the key, then append one.
                map.retain(|(k, _)| *k != key);
                map.push((key, value));
                Ok(i(OK))
            }
            None => Ok(i(BAD_ARGUMENT)),
        }
    });

    def!(
        d,
        ENV,
        "proxy_remove_header_map_value",
        |mut c: C<'_>, ty: i32, kp: i32, kl: i32| -> Result<i32> {
            let key = lower(&read_str(&mut c, kp, kl)?);
            match c.data_mut().mut_map(ty) {
                Some(map) => {
                    map.retain(|(k, _)| *k != key);
                    Ok(i(OK))
                }
                None => Ok(i(BAD_ARGUMENT)),
            }
        }
    );

    def!(d, ENV, "proxy_get_property", |mut c: C<'_>,
                                        pp: i32,
                                        pl: i32,
                                        vpp: i32,
                                        vsp: i32|
     -> Result<i32> {
        let raw = read(&mut c, pp, pl)?;
        let path = wire::split_property_path(&raw);
        match c.data().property(&path) {
            Some(v) => {
                alloc_copy(&mut c, &v, vpp, vsp)?;
                Ok(i(OK))
            }
            None => Ok(i(NOT_FOUND)),
        }
    });

    def!(d, ENV, "proxy_set_property", |mut c: C<'_>,
                                        pp: i32,
                                        pl: i32,
                                        vp: i32,
                                        vl: i32|
     -> Result<i32> {
        let raw = read(&mut c, pp, pl)?;
        let path = wire::split_property_path(&raw);
        let value = read(&mut c, vp, vl)?;
        let h = c.data_mut();
        match h.active_stream_mut() {
            Some(s) => s.set_properties.push((path, value)),
            None => h.root_set_properties.push((path, value)),
        }
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_get_shared_data", |mut c: C<'_>,
                                           kp: i32,
                                           kl: i32,
                                           vpp: i32,
                                           vsp: i32,
                                           casp: i32|
     -> Result<i32> {
        let key = read_str(&mut c, kp, kl)?;
        let worker = c.data().worker;
        let inner = c.data().inner();
        let result = {
            let mut sd = inner.shared.borrow_mut();
            sd.stats.gets += 1;
            let r = sd.get(&key);
            if r.is_err() {
                sd.stats.get_misses += 1;
            }
            r
        };
        let status = match &result {
            Ok((value, cas)) => {
                alloc_copy(&mut c, value, vpp, vsp)?;
                write_u32(&mut c, casp, *cas)?;
                OK
            }
            Err(s) => *s,
        };
        let hook = inner.take_get_hook(worker, &key, result.is_ok());
        if let Some(hook) = hook {
            let ev = SharedGetEvent {
                worker,
                key,
                result,
            };
            hook(
                &Harness {
                    inner: inner.clone(),
                },
                &ev,
            );
        }
        Ok(i(status))
    });

    def!(d, ENV, "proxy_set_shared_data", |mut c: C<'_>,
                                           kp: i32,
                                           kl: i32,
                                           vp: i32,
                                           vl: i32,
                                           cas: i32|
     -> Result<i32> {
        let key = read_str(&mut c, kp, kl)?;
        let value = read(&mut c, vp, vl)?;
        let cas = cas as u32;
        let worker = c.data().worker;
        let inner = c.data().inner();
        if let Some(hook) = inner.take_set_hook(worker, &key) {
            let ev = SharedSetEvent {
                worker,
                key: key.clone(),
                value: value.clone(),
                cas,
            };
            hook(
                &Harness {
                    inner: inner.clone(),
                },
                &ev,
            );
        }
        let injected = cas != 0 && inner.take_cas_fault(worker, &key);
        let mut sd = inner.shared.borrow_mut();
        sd.stats.sets += 1;
        if cas != 0 {
            sd.stats.cas_sets += 1;
        }
        if injected {
            sd.stats.cas_mismatches += 1;
            sd.stats.injected_cas_mismatches += 1;
            return Ok(i(CAS_MISMATCH));
        }
        match sd.set(&key, &value, cas) {
            Ok(()) => {
                sd.stats.sets_ok += 1;
                Ok(i(OK))
            }
            Err(s) => {
                if s == CAS_MISMATCH {
                    sd.stats.cas_mismatches += 1;
                }
                Ok(i(s))
            }
        }
    });

    def!(d, ENV, "proxy_continue_stream", |mut c: C<'_>,
                                           ty: i32|
     -> Result<i32> {
        Ok(i(stream_action(&mut c, ty, false)))
    });
    def!(d, ENV, "proxy_close_stream", |mut c: C<'_>,
                                        ty: i32|
     -> Result<i32> {
        Ok(i(stream_action(&mut c, ty, true)))
    });
    def!(
        d,
        ENV,
        "proxy_resume_http_request",
        |mut c: C<'_>| -> Result<i32> { Ok(i(stream_action(&mut c, 0, false))) }
    );
    def!(
        d,
        ENV,
        "proxy_resume_http_response",
        |mut c: C<'_>| -> Result<i32> { Ok(i(stream_action(&mut c, 1, false))) }
    );

    def!(d, ENV, "proxy_send_local_response", |mut c: C<'_>,
                                               status: i32,
                                               dp: i32,
                                               dl: i32,
                                               bp: i32,
                                               bl: i32,
                                               hp: i32,
                                               hl: i32,
                                               grpc: i32|
     -> Result<i32> {
        let details = read_str(&mut c, dp, dl)?;
        let body = read(&mut c, bp, bl)?;
        let headers = read_pairs(&mut c, hp, hl, "proxy_send_local_response headers")?;
        let lr = LocalResponse {
            status: status as u32,
            body,
            headers,
            details,
            grpc_status: grpc,
        };
        let fault = c
            .data()
            .inner()
            .local_response_faults
            .borrow_mut()
            .pop_front();
        if let Some(status) = fault {
            let h = c.data_mut();
            let ctx = h.active_ctx();
            h.note(format!(
                "proxy_send_local_response({}) on context {ctx} failed with status {status} (injected)",
                lr.status
            ));
            return Ok(i(status));
        }
        let h = c.data_mut();
        let ctx = h.active_ctx();
        match h.active_stream_mut() {
                Some(s) if s.local_response.is_none() => {
                    s.local_response = Some(lr);
                    h.actions.push_back(AfterAction::LocalReply(ctx));
                }
                Some(s) => s.notes.push(format!(
                    "proxy_send_local_response({}) called again after a local response ({}); ignored",
                    lr.status,
                    s.local_response.as_ref().unwrap().status
                )),
                None => h.note(format!(
                    "proxy_send_local_response({}) on context {ctx}, which is not a live stream: ignored",
                    lr.status
                )),
            }
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_http_call", |mut c: C<'_>,
                                     up: i32,
                                     ul: i32,
                                     hp: i32,
                                     hl: i32,
                                     bp: i32,
                                     bl: i32,
                                     tp: i32,
                                     tl: i32,
                                     timeout: i32,
                                     token_ptr: i32|
     -> Result<i32> {
        let upstream = read_str(&mut c, up, ul)?;
        let headers = read_pairs(&mut c, hp, hl, "proxy_http_call headers")?;
        let body = read(&mut c, bp, bl)?;
        let trailers = read_pairs(&mut c, tp, tl, "proxy_http_call trailers")?;
        let inner = c.data().inner();
        if timeout < 0 {
            return Ok(i(BAD_ARGUMENT));
        }
        if let Some(clusters) = &inner.opts.clusters {
            if !clusters.contains(&upstream) {
                return Ok(i(BAD_ARGUMENT));
            }
        }
        let has = |name: &str| headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(name));
        if !(has(":path") && has(":method") && has(":authority")) {
            return Ok(i(BAD_ARGUMENT));
        }
        let call = NewCall {
            upstream,
            headers,
            body,
            trailers,
            timeout,
            grpc: None,
        };
        record_call(&mut c, call, token_ptr)
    });

    def!(d, ENV, "proxy_grpc_call", |mut c: C<'_>,
                                     up: i32,
                                     ul: i32,
                                     sp: i32,
                                     sl: i32,
                                     mp: i32,
                                     ml: i32,
                                     hp: i32,
                                     hl: i32,
                                     bp: i32,
                                     bl: i32,
                                     timeout: i32,
                                     token_ptr: i32|
     -> Result<i32> {
        let upstream = String::from_utf8_lossy(&read(&mut c, up, ul)?).into_owned();
        let service = read_str(&mut c, sp, sl)?;
        let method = read_str(&mut c, mp, ml)?;
        let metadata = read_pairs(&mut c, hp, hl, "proxy_grpc_call metadata")?;
        let body = read(&mut c, bp, bl)?;
        let inner = c.data().inner();
        if let Some(clusters) = &inner.opts.clusters {
            // Envoy takes the cluster from the serialized GrpcService.
            if !clusters.iter().any(|k| upstream.contains(k.as_str())) {
                return Ok(i(PARSE_FAILURE));
            }
        }
        let call = NewCall {
            upstream,
            headers: metadata,
            body,
            trailers: Vec::new(),
            timeout,
            grpc: Some((service, method)),
        };
        record_call(&mut c, call, token_ptr)
    });

    def!(d, ENV, "proxy_register_shared_queue", |mut c: C<'_>,
                                                 np: i32,
                                                 nl: i32,
                                                 ret: i32|
     -> Result<i32> {
        let name = read_str(&mut c, np, nl)?;
        let h = c.data_mut();
        let id = match h.queues.iter().find(|(_, (n, _))| *n == name) {
            Some((id, _)) => *id,
            None => {
                let id = h.queues.len() as u32 + 1;
                h.queues.insert(id, (name, VecDeque::new()));
                id
            }
        };
        write_u32(&mut c, ret, id)?;
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_enqueue_shared_queue", |mut c: C<'_>,
                                                id: i32,
                                                vp: i32,
                                                vl: i32|
     -> Result<i32> {
        let value = read(&mut c, vp, vl)?;
        let h = c.data_mut();
        let Some((_, items)) = h.queues.get_mut(&(id as u32)) else {
            return Ok(i(NOT_FOUND));
        };
        items.push_back(value);
        h.actions.push_back(AfterAction::QueueReady(id as u32));
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_dequeue_shared_queue", |mut c: C<'_>,
                                                id: i32,
                                                vpp: i32,
                                                vsp: i32|
     -> Result<i32> {
        let item = match c.data_mut().queues.get_mut(&(id as u32)) {
            None => return Ok(i(NOT_FOUND)),
            Some((_, items)) => items.pop_front(),
        };
        match item {
            Some(value) => {
                alloc_copy(&mut c, &value, vpp, vsp)?;
                Ok(i(OK))
            }
            None => Ok(i(EMPTY)),
        }
    });

    def!(d, ENV, "proxy_set_effective_context", |mut c: C<'_>,
                                                 id: i32|
     -> Result<i32> {
        let id = id as u32;
        let h = c.data_mut();
        let ok = id == super::ROOT_CONTEXT_ID || h.streams.get(&id).is_some_and(|s| s.alive());
        if ok {
            h.effective_ctx = Some(id);
            Ok(i(OK))
        } else {
            Ok(i(BAD_ARGUMENT))
        }
    });

    def!(d, ENV, "proxy_done", |mut c: C<'_>| -> Result<i32> {
        c.data_mut().done_calls += 1;
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_define_metric", |mut c: C<'_>,
                                         ty: i32,
                                         np: i32,
                                         nl: i32,
                                         ret: i32|
     -> Result<i32> {
        let name = read_str(&mut c, np, nl)?;
        let kind = match ty {
            0 => MetricKind::Counter,
            1 => MetricKind::Gauge,
            2 => MetricKind::Histogram,
            _ => return Ok(i(BAD_ARGUMENT)),
        };
        let inner = c.data().inner();
        inner
            .metrics
            .borrow_mut()
            .entry(name.clone())
            .or_insert_with(|| super::Metric::new(kind));
        let h = c.data_mut();
        let id = match h.metric_by_name.get(&name) {
            Some(id) => *id,
            None => {
                // Like Envoy, the metric type is encoded in the low bits of the id.
                let id = ((h.metric_ids.len() as u32 + 1) << 2) | ty as u32;
                h.metric_ids.insert(id, name.clone());
                h.metric_by_name.insert(name, id);
                id
            }
        };
        write_u32(&mut c, ret, id)?;
        Ok(i(OK))
    });

    def!(d, ENV, "proxy_increment_metric", |c: C<'_>,
                                            id: i32,
                                            offset: i64|
     -> Result<i32> {
        Ok(i(metric_op(&c, id, |m| match m.kind {
            MetricKind::Counter if offset > 0 => {
                m.value += offset;
                OK
            }
            MetricKind::Counter => BAD_ARGUMENT,
            MetricKind::Gauge => {
                m.value += offset;
                OK
            }
            MetricKind::Histogram => BAD_ARGUMENT,
        })))
    });

    def!(d, ENV, "proxy_record_metric", |c: C<'_>,
                                         id: i32,
                                         value: i64|
     -> Result<i32> {
        Ok(i(metric_op(&c, id, |m| {
            match m.kind {
                MetricKind::Counter => m.value += value,
                MetricKind::Gauge => m.value = value,
                MetricKind::Histogram => m.samples.push(value as u64),
            }
            OK
        })))
    });

    def!(d, ENV, "proxy_get_metric", |mut c: C<'_>,
                                      id: i32,
                                      ret: i32|
     -> Result<i32> {
        let mut value = 0i64;
        let status = metric_op(&c, id, |m| match m.kind {
            MetricKind::Histogram => BAD_ARGUMENT,
            _ => {
                value = m.value;
                OK
            }
        });
        if status == OK {
            write_u64(&mut c, ret, value as u64)?;
        }
        Ok(i(status))
    });

    Ok(())
}

fn metric_op(c: &C<'_>, id: i32, f: impl FnOnce(&mut super::Metric) -> u32) -> u32 {
    let h = c.data();
    let Some(name) = h.metric_ids.get(&(id as u32)) else {
        return NOT_FOUND;
    };
    let inner = h.inner();
    let mut metrics = inner.metrics.borrow_mut();
    match metrics.get_mut(name) {
        Some(m) => f(m),
        None => NOT_FOUND,
    }
}

fn buffer(c: &C<'_>, ty: i32) -> Option<Vec<u8>> {
    let h = c.data();
    match ty {
        7 if h.plugin_config_available => Some(h.inner().opts.plugin_config.clone()),
        6 => Some(h.inner().opts.vm_config.clone()),
        4 | 5 => h.http_call_response.as_ref().map(|r| r.body.clone()),
        0 => h.active_stream().map(|s| s.request_body.clone()),
        1 => h.active_stream().map(|s| {
            s.body_chunk
                .clone()
                .unwrap_or_else(|| s.response_body.clone())
        }),
        _ => None,
    }
}

/// A callout as `proxy_http_call` or `proxy_grpc_call` hands it over.
struct NewCall {
    upstream: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    trailers: Vec<(String, Vec<u8>)>,
    timeout: i32,
    grpc: Option<(String, String)>,
}

/// Records `call` as pending under a new token, on the context that made
/// it (and its stream, if any), and writes the token to `token_ptr`.
fn record_call(c: &mut C<'_>, call: NewCall, token_ptr: i32) -> Result<i32> {
    let now = c.data().inner().clock.get();
    let h = c.data_mut();
    let token = h.next_token;
    h.next_token += 1;
    let timeout = call.timeout;
    let call = HttpCall {
        worker: h.worker,
        token,
        context_id: h.active_ctx(),
        upstream: call.upstream,
        headers: call.headers,
        body: call.body,
        trailers: call.trailers,
        timeout_ms: timeout as u32,
        deadline_ns: (timeout > 0).then(|| now + timeout as u64 * 1_000_000),
        state: CallState::Pending,
        grpc: call.grpc,
    };
    h.calls.insert(token, call);
    if let Some(s) = h.active_stream_mut() {
        s.calls.push(token);
    }
    write_u32(c, token_ptr, token)?;
    Ok(i(OK))
}

/// `proxy_continue_stream` / `proxy_close_stream`: recorded and applied after the VM call.
fn stream_action(c: &mut C<'_>, ty: i32, close: bool) -> u32 {
    let h = c.data_mut();
    let ctx = h.active_ctx();
    let name = if close {
        "proxy_close_stream"
    } else {
        "proxy_continue_stream"
    };
    if !(0..=3).contains(&ty) {
        return BAD_ARGUMENT;
    }
    if ty >= 2 {
        h.note(format!("{name}({ty}) on an HTTP filter: ignored"));
        return OK;
    }
    if h.active_stream().is_none() {
        h.note(format!(
            "{name}({ty}) on context {ctx}, which is not a live stream (missing proxy_set_effective_context?): ignored"
        ));
        return OK;
    }
    let action = match (close, ty) {
        (false, 0) => AfterAction::ContinueRequest(ctx),
        (false, _) => AfterAction::ContinueResponse(ctx),
        (true, _) => AfterAction::Reset(ctx),
    };
    h.actions.push_back(action);
    OK
}

// ---------------------------------------------------------------------------------------------
// WASI, by hand.

fn define_wasi(d: &mut Defs<'_>) -> Result<()> {
    const WASI: &str = "wasi_snapshot_preview1";
    const ERRNO_SUCCESS: i32 = 0;
    const ERRNO_BADF: i32 = 8;
    const ERRNO_INVAL: i32 = 28;
    const ERRNO_NOTSUP: i32 = 58;

    def!(d, WASI, "fd_write", |mut c: C<'_>,
                               fd: i32,
                               iovs: i32,
                               iovs_len: i32,
                               nwritten: i32|
     -> Result<i32> {
        if fd != 1 && fd != 2 {
            return Ok(ERRNO_BADF);
        }
        let mut total = 0u32;
        let mut bytes = Vec::new();
        for k in 0..iovs_len {
            let iov = read(&mut c, iovs + k * 8, 8)?;
            let ptr = u32::from_le_bytes(iov[0..4].try_into().unwrap());
            let len = u32::from_le_bytes(iov[4..8].try_into().unwrap());
            bytes.extend(read(&mut c, ptr as i32, len as i32)?);
            total += len;
        }
        let h = c.data_mut();
        h.out_buf[(fd - 1) as usize].extend(bytes);
        h.flush_output(false);
        write_u32(&mut c, nwritten, total)?;
        Ok(ERRNO_SUCCESS)
    });

    for name in ["environ_sizes_get", "args_sizes_get"] {
        def!(d, WASI, name, |mut c: C<'_>,
                             count: i32,
                             size: i32|
         -> Result<i32> {
            write_u32(&mut c, count, 0)?;
            write_u32(&mut c, size, 0)?;
            Ok(ERRNO_SUCCESS)
        });
    }
    for name in ["environ_get", "args_get"] {
        def!(d, WASI, name, |_c: C<'_>,
                             _a: i32,
                             _b: i32|
         -> Result<i32> { Ok(ERRNO_SUCCESS) });
    }

    def!(d, WASI, "clock_time_get", |mut c: C<'_>,
                                     id: i32,
                                     _precision: i64,
                                     ret: i32|
     -> Result<i32> {
        // 0 realtime reads the wall clock; 1 monotonic, 2/3 cpu time the fake clock.
        if !(0..=3).contains(&id) {
            return Ok(ERRNO_INVAL);
        }
        let inner = c.data().inner();
        if id == 1 && !inner.opts.monotonic_clock {
            return Ok(ERRNO_NOTSUP);
        }
        let now = if id == 0 {
            inner.wall_now_ns()
        } else {
            inner.clock.get()
        };
        write_u64(&mut c, ret, now)?;
        Ok(ERRNO_SUCCESS)
    });

    def!(d, WASI, "clock_res_get", |mut c: C<'_>,
                                    _id: i32,
                                    ret: i32|
     -> Result<i32> {
        write_u64(&mut c, ret, 1)?;
        Ok(ERRNO_SUCCESS)
    });

    def!(d, WASI, "random_get", |mut c: C<'_>,
                                 buf: i32,
                                 len: i32|
     -> Result<i32> {
        let mut bytes = vec![0u8; len as u32 as usize];
        c.data_mut().rng.fill(&mut bytes);
        write(&mut c, buf, &bytes)?;
        Ok(ERRNO_SUCCESS)
    });

    def!(d, WASI, "proc_exit", |c: C<'_>, code: i32| -> Result<()> {
        bail!(
            "the filter called wasi proc_exit({code}) (worker {}, during {})",
            c.data().worker,
            c.data().in_call.as_deref().unwrap_or("?")
        )
    });

    Ok(())
}

/// Values of `Val` for `raw_call`.
pub fn val_to_string(v: &Val) -> String {
    match v {
        Val::I32(x) => format!("{x}"),
        Val::I64(x) => format!("{x}"),
        other => format!("{other:?}"),
    }
}
