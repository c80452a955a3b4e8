//! The hostcalls the contexts make, each wrapped so that a host error
//! becomes a handled `Err` or `None`, never the SDK's `unwrap`: shared data,
//! the local response, resuming and resetting a stream, the clocks, the
//! counters, the callout and properties.

use crate::decide::{Counter, Tally};
use crate::global::callout::grpc_outcome;
use crate::limits::store::{SharedStore, StoreError};
use crate::metrics::{
    quota_metric_name, rule_metric_name, Background, BodyMetric, Metric, RuleMetric,
};
use crate::policy::plan::{CallTransport, Plan};
use crate::vm::Jitter;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use ratelimit_protocol::grpc::{self, Method};
use std::cell::Cell;
use std::time::{Duration, UNIX_EPOCH};

/// Envoy's shared data.
pub(super) struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(value), Some(cas))) => Ok(Some((value, cas))),
            Ok((Some(value), None)) => Ok(Some((value, 0))),
            Ok((None, _)) => Ok(None),
            Err(status) => Err(StoreError(status as u32)),
        }
    }

    fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError> {
        match hostcalls::set_shared_data(key, Some(value), Some(cas)) {
            Ok(()) => Ok(true),
            Err(Status::CasMismatch) => Ok(false),
            Err(status) => Err(StoreError(status as u32)),
        }
    }
}

/// The raw imports behind the SDK's wrappers, which panic on any status but Ok
/// (a trap kills the worker's VM); these hand the status back instead.
mod raw {
    #[link(wasm_import_module = "env")]
    extern "C" {
        pub fn proxy_send_local_response(
            status_code: u32,
            details_data: *const u8,
            details_size: usize,
            body_data: *const u8,
            body_size: usize,
            headers_data: *const u8,
            headers_size: usize,
            grpc_status: i32,
        ) -> u32;
        pub fn proxy_continue_stream(stream_type: u32) -> u32;
        pub fn proxy_close_stream(stream_type: u32) -> u32;
        pub fn proxy_set_property(
            path_data: *const u8,
            path_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_register_shared_queue(
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> u32;
        pub fn proxy_enqueue_shared_queue(
            queue_id: u32,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
    }

    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    extern "C" {
        pub fn clock_time_get(id: u32, precision: u64, time: *mut u64) -> i32;
    }
}

/// `proxy_wasm::types::StreamType::HttpRequest`.
const STREAM_HTTP_REQUEST: u32 = 0;

/// Sends a local response whose headers are `map`, in the proxy-wasm map
/// encoding (`LocalHeaders::take_map`); `Err(status)` when the host refused it.
pub(super) fn send_local_response(status: u32, map: &[u8], body: &[u8]) -> Result<(), u32> {
    // SAFETY: every pointer comes with the length of a live buffer.
    let rc = unsafe {
        raw::proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            map.as_ptr(),
            map.len(),
            -1,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}

/// Sets the one-segment property `name` of the current stream (Envoy keeps
/// it as the filter state `wasm.<name>`); `Err(status)` when the host
/// refused it. A one-segment path is the name's bytes alone.
pub(super) fn set_property(name: &str, value: &[u8]) -> Result<(), u32> {
    // SAFETY: every pointer comes with the length of a live buffer.
    let rc =
        unsafe { raw::proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}

/// Registers this worker's wake queue under `name` (unique to the worker):
/// an item put in it has the host call the root context's
/// `on_queue_ready` on the worker's own event loop, soon after the current
/// callback. `None` when the host refused.
pub(super) fn register_queue(name: &str) -> Option<u32> {
    let mut id = 0;
    // SAFETY: the name's pointer comes with its length; `id` outlives the call.
    let rc = unsafe { raw::proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) };
    (rc == 0).then_some(id)
}

/// Wakes the root context that registered `queue`; false when the host refused.
pub(super) fn wake(queue: u32) -> bool {
    const ITEM: &[u8] = b"w";
    // SAFETY: a static item with its length.
    unsafe { raw::proxy_enqueue_shared_queue(queue, ITEM.as_ptr(), ITEM.len()) == 0 }
}

/// Empties the wake queue (its items say nothing but "wake").
pub(super) fn drain(queue: u32) {
    // Bounded: each wake put one item, and a wake is asked for only when
    // none is pending; a host error ends it.
    for _ in 0..1024 {
        match hostcalls::dequeue_shared_queue(queue) {
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return,
        }
    }
}

/// Resumes the paused request of the current context.
fn resume_request() -> Result<(), u32> {
    // SAFETY: no pointers.
    match unsafe { raw::proxy_continue_stream(STREAM_HTTP_REQUEST) } {
        0 => Ok(()),
        rc => Err(rc),
    }
}

/// Resets the request of the current context.
pub(super) fn reset_request() -> Result<(), u32> {
    // SAFETY: no pointers.
    match unsafe { raw::proxy_close_stream(STREAM_HTTP_REQUEST) } {
        0 => Ok(()),
        rc => Err(rc),
    }
}

/// Lets a paused request go on, or resets it if the host will not resume it:
/// a request left paused would hang until Envoy's stream timeout.
pub(super) fn resume_or_reset(what: &str) {
    if let Err(rc) = resume_request() {
        log::warn!("ratelimit-wasm: could not resume {what} (status {rc}); resetting it");
        if let Err(rc) = reset_request() {
            log::error!("ratelimit-wasm: could not reset {what} either (status {rc})");
        }
    }
}

/// The host's wall clock (`proxy_get_current_time_nanoseconds`), in ns since the epoch.
pub(super) fn wall_ns() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .and_then(|d| u64::try_from(d.as_nanos()).ok())
        .unwrap_or(0)
}

/// The host's monotonic clock (WASI `clock_time_get`, id 1: Envoy's steady
/// clock, one for the whole process), `None` on a host without one.
pub(super) fn monotonic_ns() -> Option<u64> {
    let mut t = 0u64;
    // SAFETY: `t` is a live u64 the host writes to.
    let rc = unsafe { raw::clock_time_get(1, 1, &mut t) };
    (rc == 0 && t > 0).then_some(t)
}

thread_local! {
    /// `now_ns() − monotonic_ns()`, once `on_configure` read it; `None`: the wall clock.
    pub(super) static EPOCH_OFFSET: Cell<Option<u64>> = const { Cell::new(None) };
}

/// The filter's time, in ns: the monotonic clock plus one offset that every
/// worker shares, so it reads as the epoch time at which the first worker
/// started and never follows a step of the wall clock (NTP, an operator).
/// Every deadline and bucket is kept in it. On a host with no monotonic clock
/// it is the wall clock, and the stored deadlines are clamped to their spans
/// instead (`circuit.rs`, `lease.rs`, `token_bucket.rs`, the delays below).
pub(super) fn now_ns() -> u64 {
    match (EPOCH_OFFSET.with(Cell::get), monotonic_ns()) {
        (Some(offset), Some(mono)) => mono.saturating_add(offset),
        _ => wall_ns(),
    }
}

/// Keeps the filter's time on the monotonic clock from now on, at `offset`
/// from it (`vm::shared_epoch_offset`, one for every worker).
pub(super) fn use_epoch_offset(offset: u64) {
    EPOCH_OFFSET.with(|o| o.set(Some(offset)));
}

/// Counter ids from `define_metric`, `None` where the host refused one:
/// the decisions' counters, the request bodies', the root context's own,
/// then per rule and per quota of the plan.
#[derive(Default)]
pub(super) struct Metrics {
    decisions: [Option<u32>; Metric::ALL.len()],
    body: [Option<u32>; BodyMetric::ALL.len()],
    background: [Option<u32>; Background::ALL.len()],
    rules: Vec<[Option<u32>; RuleMetric::ALL.len()]>,
    quotas: Vec<Option<u32>>,
}

impl Metrics {
    /// Defines every counter of `plan`: a global rule's stand-in has none
    /// of its own, its counts go to its global rule's.
    pub(super) fn define(plan: &Plan) -> Metrics {
        let define = |name: &str| hostcalls::define_metric(MetricType::Counter, name).ok();
        let mut rules: Vec<[Option<u32>; RuleMetric::ALL.len()]> = plan
            .rules
            .iter()
            .map(|r| {
                RuleMetric::ALL.map(|m| {
                    (!r.stand_in)
                        .then(|| define(&rule_metric_name(&plan.domain, &r.name, m)))
                        .flatten()
                })
            })
            .collect();
        // A stand-in counts under its global rule.
        for (i, r) in plan.rules.iter().enumerate() {
            let ids = rules.get(i).copied();
            if let (Some(f), Some(ids)) = (r.fallback, ids) {
                if let Some(slot) = rules.get_mut(f) {
                    *slot = ids;
                }
            }
        }
        Metrics {
            decisions: Metric::ALL.map(|m| define(m.name())),
            body: BodyMetric::ALL.map(|m| define(m.name())),
            background: Background::ALL.map(|m| define(m.name())),
            rules,
            quotas: plan
                .quotas
                .iter()
                .map(|q| define(&quota_metric_name(&plan.domain, &q.name)))
                .collect(),
        }
    }

    /// Adds what `tally` counted since the last flush.
    pub(super) fn flush(&self, tally: &mut Tally) {
        tally.drain(|counter, n| {
            let id = match counter {
                Counter::Decision(m) => self.decisions.get(m.index()).copied().flatten(),
                Counter::Body(m) => self.body.get(m.index()).copied().flatten(),
                Counter::Background(m) => {
                    let i = Background::ALL.iter().position(|x| *x == m);
                    i.and_then(|i| self.background.get(i)).copied().flatten()
                }
                Counter::Rule(r, m) => self
                    .rules
                    .get(r)
                    .and_then(|ids| ids.get(m.index()))
                    .copied()
                    .flatten(),
                Counter::Quota(q) => self.quotas.get(q).copied().flatten(),
            };
            if let Some(id) = id {
                let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
            }
        });
    }
}

/// A per-worker jitter source seeded from the host's randomness (the clock
/// when there is none: jitter needs spread, not secrecy).
pub(super) fn seeded_jitter() -> Jitter {
    let mut bytes = [0u8; 8];
    let seed = match getrandom::fill(&mut bytes) {
        Ok(()) => u64::from_le_bytes(bytes),
        Err(_) => now_ns(),
    };
    Jitter::new(seed)
}

pub(super) fn random_seed() -> Result<[u8; 16], String> {
    let mut seed = [0u8; 16];
    getrandom::fill(&mut seed).map_err(|e| format!("no randomness for the hash seed: {e}"))?;
    Ok(seed)
}

/// Sends `body` to the gateway's `method`, by the plan's transport; `None`
/// when the callout could not even start.
pub(super) fn dispatch(plan: &Plan, body: &[u8], method: Method, timeout_ms: u64) -> Option<u32> {
    let g = plan.global.as_ref()?;
    let timeout = Duration::from_millis(timeout_ms);
    let authorization = g.authorization.as_ref().map(|a| a.0.as_str());
    let started = match &g.transport {
        CallTransport::Http => {
            let path = g.path(method)?;
            let mut headers = vec![
                (":method", "POST"),
                (":path", path),
                (":authority", g.authority.as_str()),
                ("content-type", "application/json"),
            ];
            if let Some(a) = authorization {
                headers.push(("authorization", a));
            }
            hostcalls::dispatch_http_call(&g.cluster, headers, Some(body), vec![], timeout)
        }
        CallTransport::Grpc { service } => {
            let metadata: Vec<(&str, &[u8])> = authorization
                .map(|a| ("authorization", a.as_bytes()))
                .into_iter()
                .collect();
            hostcalls::dispatch_grpc_call(
                service,
                grpc::SERVICE,
                method.name(),
                metadata,
                Some(body),
                timeout,
            )
        }
    };
    match started {
        Ok(token) => Some(token),
        Err(e) => {
            log::warn!(
                "ratelimit-wasm: callout to cluster {:?} failed to start: {e:?}",
                g.cluster
            );
            None
        }
    }
}

/// The outcome of a gRPC callout as [`call_response`] gives an HTTP one:
/// the HTTP status its gRPC status stands for (`None`: no answer), and the
/// response message. The status message is not read: the SDK's reader
/// panics on one that is not UTF-8.
pub(super) fn grpc_call_response(grpc_status: u32, size: usize) -> (Option<Vec<u8>>, Vec<u8>) {
    let body = if grpc_status != grpc::code::OK || size == 0 {
        Vec::new()
    } else {
        buffer(BufferType::GrpcReceiveBuffer, size)
    };
    (grpc_outcome(grpc_status), body)
}

/// The status and body of a callout's answer. A reset callout has no response
/// to read: Envoy answers BadArgument, on which the SDK's getter panics, so do not ask.
pub(super) fn call_response(num_headers: usize, body_size: usize) -> (Option<Vec<u8>>, Vec<u8>) {
    let status = if num_headers == 0 {
        None
    } else {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
    };
    let body = if body_size == 0 {
        Vec::new()
    } else {
        buffer(BufferType::HttpCallResponseBody, body_size)
    };
    (status, body)
}

pub(super) fn property(path: &Option<Vec<String>>) -> Option<Vec<u8>> {
    let path: Vec<&str> = path.as_ref()?.iter().map(String::as_str).collect();
    hostcalls::get_property(path).ok().flatten()
}

/// The response's headers, read as a settlement asks for them.
pub struct HostResponse;

impl crate::decide::ResponseHeaders for HostResponse {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
            .ok()
            .flatten()
    }
}

/// The `size` bytes of the request body the host holds (empty when it has none).
pub fn request_body(size: usize) -> Vec<u8> {
    buffer(BufferType::HttpRequestBody, size)
}

/// Replaces the `size` bytes of the request body the host holds with
/// `body`; `false` when the host refused.
pub fn replace_request_body(size: usize, body: &[u8]) -> bool {
    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, body).is_ok()
}

/// Removes the request's `content-length`: the body may change length
/// after the headers have gone on (Envoy then frames it itself, chunked
/// to an HTTP/1 upstream).
pub fn drop_content_length() {
    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "content-length", None);
}

/// The `size` bytes of the response body chunk at hand (empty when the host has none).
pub fn response_body(size: usize) -> Vec<u8> {
    buffer(BufferType::HttpResponseBody, size)
}

/// The first `size` bytes of the host's buffer `kind`; empty when the host
/// has none or refused.
fn buffer(kind: BufferType, size: usize) -> Vec<u8> {
    hostcalls::get_buffer(kind, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}
