//! The thin proxy-wasm layer: the root and HTTP contexts. Each callback
//! fetches what a phase of [`decide::Stream`] reads, calls it, and carries
//! out what it returns; the decisions, the per-VM helpers ([`crate::vm`])
//! and the timers ([`crate::vm::timers`]) are pure code tested on the host.
//!
//! The only layer that names `proxy_wasm` (`tests/module_graph.rs` holds
//! it): `calls` wraps the hostcalls so that a host error becomes a handled
//! `Err`, never the SDK traits' `unwrap`, and `alloc` is the VM's allocator.

mod alloc;
mod batch;
mod calls;
mod http;
mod worker;

use crate::config;
use crate::decide::{self, Refresh, Stream, Tally};
use crate::global::circuit::Transition;
use crate::global::outbox::{self, Batch};
use crate::limits::store::KEY_PREFIX;
use crate::metrics::Background;
use crate::policy::plan::Plan;
use crate::vm::shared_epoch_offset;
use crate::vm::shared_seed;
use crate::vm::timers::{RefreshSchedule, FLUSH_TICK, TICK};
use calls::{
    call_response, dispatch, grpc_call_response, monotonic_ns, now_ns, random_seed, register_queue,
    resume_or_reset, seeded_jitter, use_epoch_offset, wall_ns, HostStore, Metrics,
};
use http::Http;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};
use ratelimit_protocol::grpc::Method;
use std::collections::HashMap;
use std::rc::Rc;
use worker::Worker;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // Replaces the SDK's hook, whose own logging unwraps.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("ratelimit-wasm: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> {
        let root = Root::default();
        root.w.root_id.set(id);
        Box::new(root)
    });
}}

/// One per worker: holds the compiled configuration.
#[derive(Default)]
struct Root {
    plan: Option<Rc<Plan>>,
    /// The worker's counter ids, which its tick flushes the tally into.
    metrics: Metrics,
    /// What the worker's requests share with it.
    w: Rc<Worker>,
    /// Lease refreshes in flight: callout token → refresh and when it left.
    refreshes: HashMap<u32, (Refresh, u64)>,
    refresh_schedule: RefreshSchedule,
    /// Settle calls in flight: callout token → their batch.
    settle_calls: HashMap<u32, Batch>,
}

impl Root {
    /// Tops up leases running low, ahead of the requests that will need them.
    fn refresh_leases(&mut self, plan: &Plan, now: u64) {
        let Some(lp) = plan.global.as_ref().and_then(|g| g.lease.as_ref()) else {
            return;
        };
        if !self.refresh_schedule.due(now) {
            return;
        }
        let recent = self.w.leases.borrow_mut().recent(now, lp.ttl_ns);
        for lease in recent {
            let (started, counts) = decide::refresh_start(plan, &HostStore, &lease, now);
            self.w.tally.borrow_mut().counts(&counts);
            let Some(r) = started else {
                continue;
            };
            match dispatch(plan, &r.body, Method::Lease, lp.max_wait_ms) {
                Some(token) => {
                    self.refreshes.insert(token, (r, now));
                }
                None => {
                    let (counts, _, _) =
                        decide::refresh_finish(plan, &HostStore, r, None, &[], 0, now);
                    self.w.tally.borrow_mut().counts(&counts);
                }
            }
        }
    }
}

impl Root {
    /// Posts what the outbox holds, a batch per call, up to
    /// [`outbox::MAX_CALLS`] calls in flight.
    fn flush_settlements(&mut self, plan: &Plan) {
        if plan.global.is_none() {
            return;
        }
        while self.settle_calls.len() < outbox::MAX_CALLS {
            let Some((batch, body)) = self.w.outbox.borrow_mut().next_batch(&plan.domain) else {
                return;
            };
            match dispatch(plan, &body, Method::Settle, outbox::TIMEOUT_MS) {
                Some(token) => {
                    self.settle_calls.insert(token, batch);
                }
                None => {
                    // Tried again on a later tick, not at once.
                    self.settled(batch, None, &[]);
                    return;
                }
            }
        }
    }

    /// The gateway's answer to a settle call (`status` `None`: none came).
    fn settled(&mut self, batch: Batch, status: Option<&[u8]>, body: &[u8]) {
        let d = self.w.outbox.borrow_mut().answered(batch, status, body);
        self.w
            .tally
            .borrow_mut()
            .background(Background::GlobalSettled, d.settled);
        self.w
            .tally
            .borrow_mut()
            .background(Background::GlobalSettleUnmatched, d.unmatched);
        self.w
            .tally
            .borrow_mut()
            .background(Background::GlobalSettleFailed, d.failed);
        if d.failed > 0 {
            if let Some(more) = self.w.logs.gateway.open(now_ns()) {
                log::warn!(
                    "ratelimit-wasm: gave up {} settlements: their requests keep what they reserved (+{more} not logged)",
                    d.failed
                );
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
        let (status, body) = call_response(num_headers, body_size);
        self.call_answered(token_id, status.as_deref(), &body);
    }

    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        let (status, body) = grpc_call_response(status_code, response_size);
        self.call_answered(token_id, status.as_deref(), &body);
    }
}

impl Root {
    /// The answer to one of the root context's callouts, whichever the
    /// transport: a batch of checks, a settle call or a lease refresh.
    fn call_answered(&mut self, token_id: u32, status: Option<&[u8]>, body: &[u8]) {
        let batch = self.w.coalescer.borrow_mut().answered(token_id);
        if let (Some(plan), Some((members, sent_at))) = (self.plan.clone(), batch) {
            batch::answered(&self.w, &plan, &members, (status, body), sent_at);
            batch::post(&self.w, &plan, now_ns());
            return;
        }
        if let Some(batch) = self.settle_calls.remove(&token_id) {
            self.settled(batch, status, body);
            return;
        }
        let (Some(plan), Some((r, sent_at))) =
            (self.plan.clone(), self.refreshes.remove(&token_id))
        else {
            return;
        };
        let now = now_ns();
        let (counts, transition, error) = decide::refresh_finish(
            &plan,
            &HostStore,
            r,
            status,
            body,
            now.saturating_sub(sent_at),
            now,
        );
        self.w.tally.borrow_mut().counts(&counts);
        if let Some(e) = error {
            if let Some(more) = self.w.logs.gateway.open(now) {
                log::warn!("ratelimit-wasm: lease refresh failed: {e} (+{more} not logged)");
            }
        }
        if transition == Transition::Opened {
            log::warn!("ratelimit-wasm: circuit to the gateway opened");
        }
    }
}

/// The plugin configuration from the host, parsed and checked.
fn read_config() -> Result<config::Config, String> {
    let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
        .unwrap_or_default();
    config::parse(&bytes).map_err(|e| format!("invalid configuration: {e}"))
}

/// Puts the filter's time on the host's monotonic clock, at the offset every
/// worker shares; a host without one leaves it on the wall clock.
fn settle_clock() -> Result<(), String> {
    let Some(mono) = monotonic_ns() else {
        log::warn!(
            "ratelimit-wasm: the host has no monotonic clock: timing follows the wall clock, \
             and a step of it is clamped to each deadline's span"
        );
        return Ok(());
    };
    let offset = shared_epoch_offset(&HostStore, || wall_ns().saturating_sub(mono))?;
    use_epoch_offset(offset);
    log::info!("ratelimit-wasm: timing on the host's monotonic clock");
    Ok(())
}

/// Compiles the plan with the bearer token its `token_env` names (Envoy's
/// `vm_config.environment_variables` reach the module through WASI).
fn compile(config: &config::Config, seed: [u8; 16]) -> Result<Plan, String> {
    let mut plan = Plan::compile(config, seed);
    if let (Some(g), Some(gp)) = (&config.global, plan.global.as_mut()) {
        let bearer = g
            .bearer(|name| std::env::var(name).ok())
            .map_err(|e| format!("invalid configuration: {e}"))?;
        gp.authorization = bearer.map(config::Token);
    }
    Ok(plan)
}

/// Starts the tick: every [`TICK`] when delayed requests, leases or
/// settlements need it, else every [`FLUSH_TICK`], for the counters alone.
fn start_timer(plan: &Plan) -> Result<(), String> {
    let delays = plan
        .rules
        .iter()
        .any(|r| r.graduated.is_some_and(|g| g.delay_ms > 0));
    let leases = plan.global.as_ref().is_some_and(|g| g.lease.is_some());
    // Settlements of global rules wait in the outbox for the tick.
    let settles = plan.global.is_some() && plan.settling;
    // Batches the tick posts when no wake came.
    let batches = plan.batch().is_some();
    let period = if delays || leases || settles || batches {
        TICK
    } else {
        FLUSH_TICK
    };
    hostcalls::set_tick_period(period).map_err(|e| format!("no timer: {e:?}"))
}

impl Root {
    /// Reads, checks and compiles the configuration, and starts the timer.
    fn configure(&mut self) -> Result<(), String> {
        let config = read_config()?;
        let seed = shared_seed(&HostStore, random_seed)?;
        settle_clock()?;
        let plan = compile(&config, seed)?;
        log::info!(
            "ratelimit-wasm: configured domain {:?}: {} rules, {} bucket sets under {KEY_PREFIX}",
            config.domain,
            plan.rules.len(),
            plan.table.sets
        );
        let plan = self.wake_queue(plan);
        start_timer(&plan)?;
        self.metrics = Metrics::define(&plan);
        *self.w.tally.borrow_mut() = Tally::new(&plan);
        self.plan = Some(Rc::new(plan));
        *self.w.jitter.borrow_mut() = seeded_jitter();
        Ok(())
    }

    /// Registers the queue that wakes this worker's root to post a batch,
    /// under a name of its own; a host without one gets no batches (one
    /// call per request, protocol version 2).
    fn wake_queue(&mut self, mut plan: Plan) -> Plan {
        let Some(g) = plan.global.as_mut().filter(|g| g.batch.is_some()) else {
            return plan;
        };
        let name = random_seed()
            .map(|s| format!("ratelimit-wasm/wake/{}", u128::from_le_bytes(s)))
            .ok();
        match name.as_deref().and_then(register_queue) {
            Some(id) => self.w.wake_queue.set(Some(id)),
            None => {
                log::warn!(
                    "ratelimit-wasm: the host has no shared queue: checks go one call each to {:?}",
                    g.path
                );
                g.batch = None;
            }
        }
        plan
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        match self.configure() {
            Ok(()) => true,
            Err(e) => {
                log::error!("ratelimit-wasm: {e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let now = now_ns();
        if let Some(plan) = self.plan.clone() {
            self.refresh_leases(&plan, now);
            self.flush_settlements(&plan);
            batch::tick(&self.w, &plan, now);
        }
        self.metrics.flush(&mut self.w.tally.borrow_mut());
        let due = self.w.delays.borrow_mut().due(now);
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
            w: self.w.clone(),
            stream: Stream::default(),
            call: None,
            parked: false,
        }))
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        calls::drain(queue_id);
        self.w.coalescer.borrow_mut().wake_served();
        if let Some(plan) = self.plan.clone() {
            batch::post(&self.w, &plan, now_ns());
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Test builds only (`--features test-trap`): a response carrying
/// `x-test-trap` kills the VM (an abort traps on wasm32-wasip1), as a crash
/// would, so that a real Envoy test sees what a dead VM leaves behind.
#[cfg(feature = "test-trap")]
fn crash_on_test_trap() {
    let headers = proxy_wasm::types::MapType::HttpResponseHeaders;
    let header = hostcalls::get_map_value(headers, "x-test-trap");
    if header.ok().flatten().is_some() {
        std::process::abort();
    }
}
