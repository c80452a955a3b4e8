//! The thin proxy-wasm layer: fetch the request, call [`decide`], carry out
//! the verdict. Hostcalls go through `hostcalls` directly so that a host error
//! becomes a handled `Err`, never the SDK traits' `unwrap`.
//!
//! The only file that names `proxy_wasm` (`tests/module_graph.rs` holds it);
//! everything it can hand to a pure module (the per-VM helpers in
//! [`crate::vm`], the decisions in [`crate::decide`]) lives there, tested on
//! the host. About 700 lines: the root and HTTP contexts, the raw hostcalls
//! and the callouts stay together because each one is a thin wrapper that
//! only makes sense beside the host state it touches.

use crate::config;
use crate::decide::{self, Counts, Outcome, Passing, Pending, Refresh, Step, Verdict};
use crate::global::circuit::Transition;
use crate::global::lease::{Lease, Watched};
use crate::limits::store::{SharedStore, StoreError, KEY_PREFIX};
use crate::metrics::Metric;
use crate::policy::plan::{Plan, SourceNeed};
use crate::policy::request::RequestInfo;
use crate::vm::{shared_epoch_offset, shared_seed, Jitter, LogGates};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // Replaces the SDK's hook, whose own logging unwraps.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("ratelimit-wasm: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Envoy's shared data.
struct HostStore;

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
    }

    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    extern "C" {
        pub fn clock_time_get(id: u32, precision: u64, time: *mut u64) -> i32;
    }
}

/// `proxy_wasm::types::StreamType::HttpRequest`.
const STREAM_HTTP_REQUEST: u32 = 0;

/// Sends a local response whose headers are `map`, in the proxy-wasm map
/// encoding (`LocalHeaders::into_map`); `Err(status)` when the host refused it.
fn send_local_response(status: u32, map: &[u8], body: &[u8]) -> Result<(), u32> {
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

/// Resumes the paused request of the current context.
fn resume_request() -> Result<(), u32> {
    // SAFETY: no pointers.
    match unsafe { raw::proxy_continue_stream(STREAM_HTTP_REQUEST) } {
        0 => Ok(()),
        rc => Err(rc),
    }
}

/// Resets the request of the current context.
fn reset_request() -> Result<(), u32> {
    // SAFETY: no pointers.
    match unsafe { raw::proxy_close_stream(STREAM_HTTP_REQUEST) } {
        0 => Ok(()),
        rc => Err(rc),
    }
}

/// Lets a paused request go on, or resets it if the host will not resume it:
/// a request left paused would hang until Envoy's stream timeout.
fn resume_or_reset(what: &str) {
    if let Err(rc) = resume_request() {
        log::warn!("ratelimit-wasm: could not resume {what} (status {rc}); resetting it");
        if let Err(rc) = reset_request() {
            log::error!("ratelimit-wasm: could not reset {what} either (status {rc})");
        }
    }
}

/// The host's wall clock (`proxy_get_current_time_nanoseconds`), in ns since the epoch.
fn wall_ns() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .and_then(|d| u64::try_from(d.as_nanos()).ok())
        .unwrap_or(0)
}

/// The host's monotonic clock (WASI `clock_time_get`, id 1: Envoy's steady
/// clock, one for the whole process), `None` on a host without one.
fn monotonic_ns() -> Option<u64> {
    let mut t = 0u64;
    // SAFETY: `t` is a live u64 the host writes to.
    let rc = unsafe { raw::clock_time_get(1, 1, &mut t) };
    (rc == 0 && t > 0).then_some(t)
}

thread_local! {
    /// `now_ns() − monotonic_ns()`, once `on_configure` read it; `None`: the wall clock.
    static EPOCH_OFFSET: Cell<Option<u64>> = const { Cell::new(None) };
}

/// The filter's time, in ns: the monotonic clock plus one offset that every
/// worker shares, so it reads as the epoch time at which the first worker
/// started and never follows a step of the wall clock (NTP, an operator).
/// Every deadline and bucket is kept in it. On a host with no monotonic clock
/// it is the wall clock, and the stored deadlines are clamped to their spans
/// instead (`circuit.rs`, `lease.rs`, `token_bucket.rs`, the delays below).
fn now_ns() -> u64 {
    match (EPOCH_OFFSET.with(Cell::get), monotonic_ns()) {
        (Some(offset), Some(mono)) => mono.saturating_add(offset),
        _ => wall_ns(),
    }
}

/// Counter ids from `define_metric`, `None` where the host refused one.
#[derive(Default)]
struct Metrics([Option<u32>; Metric::ALL.len()]);

impl Metrics {
    fn define() -> Metrics {
        let mut ids = [None; Metric::ALL.len()];
        for (id, m) in ids.iter_mut().zip(Metric::ALL) {
            *id = hostcalls::define_metric(MetricType::Counter, m.name()).ok();
        }
        Metrics(ids)
    }

    fn add_all(&self, counts: &Counts) {
        for (i, n) in counts.counted() {
            if let Some(Some(id)) = self.0.get(i) {
                let _ = hostcalls::increment_metric(*id, i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }
}

/// A per-worker jitter source seeded from the host's randomness (the clock
/// when there is none: jitter needs spread, not secrecy).
fn seeded_jitter() -> Jitter {
    let mut bytes = [0u8; 8];
    let seed = match getrandom::fill(&mut bytes) {
        Ok(()) => u64::from_le_bytes(bytes),
        Err(_) => now_ns(),
    };
    Jitter::new(seed)
}

fn random_seed() -> Result<[u8; 16], String> {
    let mut seed = [0u8; 16];
    getrandom::fill(&mut seed).map_err(|e| format!("no randomness for the hash seed: {e}"))?;
    Ok(seed)
}

/// Requests held by a graduated rule's delay: (context id, resume at ns, the
/// delay in ns). One per worker; the root context's timer resumes them.
type Delays = Rc<RefCell<Vec<(u32, u64, u64)>>>;

/// How often the root context looks for delayed requests to resume.
const TICK: Duration = Duration::from_millis(5);
/// How often the root context looks for leases running low.
const REFRESH_EVERY_NS: u64 = 20_000_000;

/// One per worker: holds the compiled configuration.
#[derive(Default)]
struct Root {
    plan: Option<Rc<Plan>>,
    metrics: Rc<Metrics>,
    logs: Rc<LogGates>,
    delays: Delays,
    /// Leases this worker's requests used lately.
    leases: Rc<RefCell<Watched>>,
    jitter: Rc<Jitter>,
    /// Lease refreshes in flight: callout token → refresh and when it left.
    refreshes: HashMap<u32, (Refresh, u64)>,
    next_refresh_ns: u64,
}

impl Root {
    /// Tops up leases running low, ahead of the requests that will need them.
    fn refresh_leases(&mut self, plan: &Plan, now: u64) {
        let Some(lp) = plan.global.as_ref().and_then(|g| g.lease.as_ref()) else {
            return;
        };
        if now < self.next_refresh_ns {
            return;
        }
        self.next_refresh_ns = now.saturating_add(REFRESH_EVERY_NS);
        let recent = self.leases.borrow_mut().recent(now, lp.ttl_ns);
        for lease in recent {
            let (started, counts) = decide::refresh_start(plan, &HostStore, &lease, now);
            self.metrics.add_all(&counts);
            let Some(r) = started else {
                continue;
            };
            match dispatch(plan, &r.body, &lp.path, lp.max_wait_ms) {
                Some(token) => {
                    self.refreshes.insert(token, (r, now));
                }
                None => {
                    let (counts, _, _) =
                        decide::refresh_finish(plan, &HostStore, r, None, &[], 0, now);
                    self.metrics.add_all(&counts);
                }
            }
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let (Some(plan), Some((r, sent_at))) =
            (self.plan.clone(), self.refreshes.remove(&token_id))
        else {
            return;
        };
        let (status, body) = call_response(num_headers, body_size);
        let now = now_ns();
        let (counts, transition, error) = decide::refresh_finish(
            &plan,
            &HostStore,
            r,
            status.as_deref(),
            &body,
            now.saturating_sub(sent_at),
            now,
        );
        self.metrics.add_all(&counts);
        if let Some(e) = error {
            if let Some(more) = self.logs.gateway.open(now) {
                log::warn!("ratelimit-wasm: lease refresh failed: {e} (+{more} not logged)");
            }
        }
        if transition == Transition::Opened {
            log::warn!("ratelimit-wasm: circuit to the gateway opened");
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log::error!("ratelimit-wasm: invalid configuration: {e}");
                return false;
            }
        };
        let seed = match shared_seed(&HostStore, random_seed) {
            Ok(s) => s,
            Err(e) => {
                log::error!("ratelimit-wasm: {e}");
                return false;
            }
        };
        let epoch = match monotonic_ns() {
            Some(mono) => {
                shared_epoch_offset(&HostStore, || wall_ns().saturating_sub(mono)).map(Some)
            }
            None => Ok(None),
        };
        match epoch {
            Ok(Some(offset)) => {
                EPOCH_OFFSET.with(|o| o.set(Some(offset)));
                log::info!("ratelimit-wasm: timing on the host's monotonic clock");
            }
            Ok(None) => log::warn!(
                "ratelimit-wasm: the host has no monotonic clock: timing follows the wall clock, \
                 and a step of it is clamped to each deadline's span"
            ),
            Err(e) => {
                log::error!("ratelimit-wasm: {e}");
                return false;
            }
        }
        let mut plan = Plan::compile(&config, seed);
        // token_env names a variable of the VM's environment (Envoy's
        // vm_config.environment_variables reach the module through WASI).
        if let (Some(g), Some(gp)) = (&config.global, plan.global.as_mut()) {
            match g.bearer(|name| std::env::var(name).ok()) {
                Ok(b) => gp.authorization = b.map(config::Token),
                Err(e) => {
                    log::error!("ratelimit-wasm: invalid configuration: {e}");
                    return false;
                }
            }
        }
        log::info!(
            "ratelimit-wasm: configured domain {:?}: {} rules, {} bucket sets under {KEY_PREFIX}",
            config.domain,
            plan.rules.len(),
            plan.table.sets
        );
        let delays = plan
            .rules
            .iter()
            .any(|r| r.graduated.is_some_and(|g| g.delay_ms > 0));
        let leases = plan.global.as_ref().is_some_and(|g| g.lease.is_some());
        if delays || leases {
            if let Err(e) = hostcalls::set_tick_period(TICK) {
                log::error!("ratelimit-wasm: no timer for delayed requests and leases: {e:?}");
                return false;
            }
        }
        self.plan = Some(Rc::new(plan));
        self.metrics = Rc::new(Metrics::define());
        self.jitter = Rc::new(seeded_jitter());
        true
    }

    fn on_tick(&mut self) {
        let now = now_ns();
        if let Some(plan) = self.plan.clone() {
            self.refresh_leases(&plan, now);
        }
        let due: Vec<u32> = {
            let mut delays = self.delays.borrow_mut();
            for (_, at, delay) in delays.iter_mut() {
                // A release further off than the delay itself means the clock
                // stepped back (wall clock only): hold no longer than the delay.
                *at = (*at).min(now.saturating_add(*delay));
            }
            let due = delays
                .iter()
                .filter(|(_, at, _)| *at <= now)
                .map(|(id, _, _)| *id)
                .collect();
            delays.retain(|(_, at, _)| *at > now);
            due
        };
        for id in due {
            // A stream that went away is gone from the host: nothing to resume.
            if hostcalls::set_effective_context(id).is_ok() {
                resume_or_reset("a delayed request");
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http {
            id: context_id,
            plan: self.plan.clone(),
            metrics: self.metrics.clone(),
            logs: self.logs.clone(),
            delays: self.delays.clone(),
            leases: self.leases.clone(),
            jitter: self.jitter.clone(),
            response_headers: Passing::default(),
            answered: false,
            pending: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One per request.
struct Http {
    id: u32,
    plan: Option<Rc<Plan>>,
    metrics: Rc<Metrics>,
    logs: Rc<LogGates>,
    delays: Delays,
    leases: Rc<RefCell<Watched>>,
    jitter: Rc<Jitter>,
    response_headers: Passing,
    /// The filter sent the response itself; it already carries the headers.
    answered: bool,
    /// A callout in flight: its token, what it decides, and when it left.
    pending: Option<(u32, Box<Pending>, u64)>,
}

/// Posts `body` to the gateway; `None` when the callout could not even start.
fn dispatch(plan: &Plan, body: &[u8], path: &str, timeout_ms: u64) -> Option<u32> {
    let g = plan.global.as_ref()?;
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", g.authority.as_str()),
        ("content-type", "application/json"),
    ];
    if let Some(a) = &g.authorization {
        headers.push(("authorization", a.0.as_str()));
    }
    let timeout = Duration::from_millis(timeout_ms);
    match hostcalls::dispatch_http_call(&g.cluster, headers, Some(body), vec![], timeout) {
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

/// The status and body of a callout's answer. A reset callout has no response
/// to read: Envoy answers BadArgument, on which the SDK's getter panics, so do not ask.
fn call_response(num_headers: usize, body_size: usize) -> (Option<Vec<u8>>, Vec<u8>) {
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
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default()
    };
    (status, body)
}

fn property(path: &Option<Vec<String>>) -> Option<Vec<u8>> {
    let path: Vec<&str> = path.as_ref()?.iter().map(String::as_str).collect();
    hostcalls::get_property(path).ok().flatten()
}

impl Http {
    fn watch(&self, lease: &Lease, now: u64) {
        self.leases.borrow_mut().touch(lease, now);
    }

    fn read_request(plan: &Plan) -> RequestInfo {
        let mut req = RequestInfo {
            headers: plan
                .header_names
                .iter()
                .zip(&plan.header_needed)
                .map(|(name, needed)| {
                    needed
                        .then(|| hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name))
                        .and_then(|v| v.ok().flatten())
                })
                .collect(),
            source_address: None,
            client_metadata: property(&plan.client_id_property),
            tier_metadata: property(&plan.tier_property),
        };
        let source = match plan.source {
            SourceNeed::Never => false,
            SourceNeed::WithoutClient => plan.client_id(&req).is_none(),
            SourceNeed::Always => true,
        };
        if source {
            req.source_address = hostcalls::get_property(vec!["source", "address"])
                .ok()
                .flatten();
        }
        req
    }

    fn report(&self, plan: &Plan, outcome: &Outcome, now: u64) {
        self.metrics.add_all(&outcome.counts);
        // Once per VM: every answer of a drifted policy would say it again.
        static MISMATCH_LOGGED: std::sync::atomic::AtomicBool =
            std::sync::atomic::AtomicBool::new(false);
        if outcome.counts.get(Metric::PolicyMismatch) > 0
            && !MISMATCH_LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            log::warn!(
                "ratelimit-wasm: the gateway enforces other limits than this configuration of domain {:?}; \
                 the gateway's apply and are shown (render both from one file); \
                 counted in ratelimit_wasm_policy_mismatch, logged once",
                plan.domain
            );
        }
        if let Some(e) = &outcome.error {
            log::warn!(
                "ratelimit-wasm: shared state failed, on_error={:?}: {e}",
                plan.on_error
            );
        }
        if let Some(e) = &outcome.gateway_error {
            if let Some(more) = self.logs.gateway.open(now) {
                let mode = plan.global.as_ref().map(|g| g.failure_mode);
                log::warn!("ratelimit-wasm: gateway failed, failure_mode={mode:?}: {e} (+{more} not logged)");
            }
        }
        match outcome.circuit {
            Transition::Opened => log::warn!("ratelimit-wasm: circuit to the gateway opened"),
            Transition::Closed => log::info!("ratelimit-wasm: circuit to the gateway closed"),
            Transition::None => {}
        }
        if !outcome.bad_input.is_empty() {
            if let Some(more) = self.logs.bad_input.open(now) {
                log::warn!(
                    "ratelimit-wasm: bad input in request identity: {:?} (+{more} not logged)",
                    outcome.bad_input
                );
            }
        }
        if !outcome.shadow_denied.is_empty() {
            if let Some(more) = self.logs.shadow.open(now) {
                log::info!(
                    "ratelimit-wasm: shadow: {:?} would have denied this request (+{more} not logged)",
                    outcome.shadow_denied
                );
            }
        }
    }

    /// Carries out a verdict; `paused` says whether the request waits for a resume.
    fn carry_out(&mut self, verdict: Verdict, paused: bool) -> Action {
        match verdict {
            Verdict::Delay { ms, headers } => {
                self.response_headers = headers;
                let delay = ms.saturating_mul(1_000_000);
                let at = now_ns().saturating_add(delay);
                self.delays.borrow_mut().push((self.id, at, delay));
                Action::Pause
            }
            Verdict::Pass(lines) => {
                self.response_headers = lines;
                if paused {
                    resume_or_reset("the request");
                }
                Action::Continue
            }
            Verdict::Reject {
                status,
                headers,
                body,
            } => {
                self.answered = true;
                if let Err(rc) = send_local_response(status, &headers.into_map(), body.as_bytes()) {
                    // Fail closed: a denial whose answer cannot be sent resets the
                    // stream; resuming would admit it, and leaving it paused would
                    // hold it until Envoy's stream timeout.
                    log::error!(
                        "ratelimit-wasm: could not send the {status} response (status {rc}); resetting the request"
                    );
                    if let Err(rc) = reset_request() {
                        log::error!(
                            "ratelimit-wasm: could not reset the request either (status {rc})"
                        );
                    }
                }
                Action::Pause
            }
        }
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(plan) = self.plan.clone() else {
            return;
        };
        let Some((token, pending, sent_at)) = self.pending.take() else {
            return;
        };
        if token != token_id {
            log::warn!("ratelimit-wasm: answer for unknown callout {token_id}");
            self.pending = Some((token, pending, sent_at));
            return;
        }
        let (status, body) = call_response(num_headers, body_size);
        let now = now_ns();
        let outcome = decide::finish(
            &plan,
            *pending,
            status.as_deref(),
            &body,
            now.saturating_sub(sent_at),
            &HostStore,
            now,
        );
        self.report(&plan, &outcome, now);
        self.carry_out(outcome.verdict, true);
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        let req = Self::read_request(&plan);
        let now = now_ns();
        match decide::start(&plan, &req, &HostStore, now, self.jitter.next(&plan)) {
            Step::Done(outcome) => {
                self.report(&plan, &outcome, now);
                if let Some(l) = &outcome.lease {
                    self.watch(l, now);
                }
                self.carry_out(outcome.verdict, false)
            }
            Step::Call(pending) => match pending
                .route(&plan)
                .and_then(|(path, timeout)| dispatch(&plan, &pending.body, path, timeout))
            {
                Some(token) => {
                    if let Some(l) = pending.lease() {
                        self.watch(l, now);
                    }
                    self.pending = Some((token, pending, now));
                    Action::Pause
                }
                None => {
                    let outcome = decide::finish(&plan, *pending, None, &[], 0, &HostStore, now);
                    self.report(&plan, &outcome, now);
                    self.carry_out(outcome.verdict, false)
                }
            },
        }
    }

    fn on_log(&mut self) {
        // The stream is done (or was cancelled while held): never resume it.
        let id = self.id;
        self.delays.borrow_mut().retain(|(d, _, _)| *d != id);
        // Cancelled while waiting for the gateway: give the local charge back.
        if let (Some(plan), Some((_, pending, _))) = (self.plan.clone(), self.pending.take()) {
            let counts = decide::abandon(&plan, *pending, &HostStore);
            self.metrics.add_all(&counts);
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if !self.answered {
            if let Some(plan) = &self.plan {
                self.response_headers.each(plan, |name, value| {
                    let _ =
                        hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
                });
            }
        }
        Action::Continue
    }
}

/// The VM's allocator: blocks of up to [`small::MAX`] bytes are recycled
/// through per-size free lists in front of the system's (wasi-libc's dlmalloc).
/// A decision allocates and frees a few dozen small blocks (keys, sets,
/// reports, header values); dlmalloc spent about a quarter of a c1 decision's
/// wasm instructions on them (issue 14, Performance).
#[global_allocator]
static ALLOCATOR: small::Recycling = small::Recycling::new();

mod small {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::UnsafeCell;

    /// Size step of the classes; also the alignment every class block has.
    const STEP: usize = 16;
    /// Classes: 16, 32, …, 2048 bytes. Up to 2 KiB: a request's reports
    /// outgrow 256 bytes at a few limits (c4's eight take 896 bytes); served
    /// by dlmalloc, blocks of that size cost c4 1,094 more instructions and
    /// a 429 with its problem body 239 more (measured when the charge also
    /// kept a list of pending writes).
    const CLASSES: usize = 128;
    /// Largest block served from the free lists.
    pub const MAX: usize = STEP * CLASSES;

    /// Free lists (a freed block holds the next one's address) over [`System`].
    /// A block of a class is always allocated from the system at the class's
    /// full size and never handed back, so any block of a class fits any
    /// request of it; the lists hold at most the VM's peak of small blocks.
    pub struct Recycling {
        heads: UnsafeCell<[*mut u8; CLASSES]>,
    }

    // SAFETY: a proxy-wasm VM runs one thread (wasm32 without threads), and this
    // type exists only in that build (host.rs is wasm32 only).
    unsafe impl Sync for Recycling {}

    impl Recycling {
        /// Empty lists.
        pub const fn new() -> Recycling {
            Recycling {
                heads: UnsafeCell::new([std::ptr::null_mut(); CLASSES]),
            }
        }
    }

    /// The class of `layout`, when the free lists serve it.
    fn class(layout: &Layout) -> Option<usize> {
        let size = layout.size();
        (size > 0 && size <= MAX && layout.align() <= STEP).then(|| (size - 1) / STEP)
    }

    unsafe impl GlobalAlloc for Recycling {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let Some(c) = class(&layout) else {
                return System.alloc(layout);
            };
            let heads = &mut *self.heads.get();
            let Some(head) = heads.get_mut(c) else {
                return System.alloc(layout);
            };
            if head.is_null() {
                return System.alloc(Layout::from_size_align_unchecked((c + 1) * STEP, STEP));
            }
            let block = *head;
            *head = *(block as *mut *mut u8);
            block
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            let Some(c) = class(&layout) else {
                return System.dealloc(ptr, layout);
            };
            let heads = &mut *self.heads.get();
            if let Some(head) = heads.get_mut(c) {
                *(ptr as *mut *mut u8) = *head;
                *head = ptr;
            }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            let new = Layout::from_size_align_unchecked(new_size, layout.align());
            match (class(&layout), class(&new)) {
                // Both large: the system may grow it in place.
                (None, None) => System.realloc(ptr, layout, new_size),
                // Same class: the block already has room.
                (Some(a), Some(b)) if a == b => ptr,
                _ => {
                    let to = self.alloc(new);
                    if !to.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, to, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    to
                }
            }
        }
    }
}
