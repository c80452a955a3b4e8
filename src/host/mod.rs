//! The thin proxy-wasm layer: the root and HTTP contexts. Each callback
//! fetches what a phase of [`decide::Stream`] reads, calls it, and carries
//! out what it returns; the decisions, the per-VM helpers ([`crate::vm`])
//! and the timers ([`crate::vm::timers`]) are pure code tested on the host.
//!
//! The only layer that names `proxy_wasm` (`tests/module_graph.rs` holds
//! it): `calls` wraps the hostcalls so that a host error becomes a handled
//! `Err`, never the SDK traits' `unwrap`, and `alloc` is the VM's allocator.

mod alloc;
mod calls;

use crate::config;
use crate::decide::{self, Next, Outcome, Refresh, Stream, Tally, Verdict};
use crate::global::circuit::Transition;
use crate::global::lease::{Lease, Watched};
use crate::global::outbox::{self, Batch, Outbox};
use crate::limits::store::KEY_PREFIX;
use crate::metrics::{Background, Metric};
use crate::policy::plan::{Plan, SourceNeed};
use crate::policy::request::RequestInfo;
use crate::vm::timers::{Delays, RefreshSchedule, FLUSH_TICK, TICK};
use crate::vm::{shared_epoch_offset, shared_seed, Jitter, LogGates};
use calls::{
    call_response, dispatch, drop_content_length, monotonic_ns, now_ns, property, random_seed,
    replace_request_body, request_body, reset_request, response_body, resume_or_reset,
    seeded_jitter, send_local_response, set_property, use_epoch_offset, wall_ns, HostResponse,
    HostStore, Metrics,
};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // Replaces the SDK's hook, whose own logging unwraps.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("ratelimit-wasm: panic: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// One per worker: holds the compiled configuration.
#[derive(Default)]
struct Root {
    plan: Option<Rc<Plan>>,
    /// The worker's counter ids, which its tick flushes `tally` into.
    metrics: Metrics,
    /// What this worker counted since the last tick.
    tally: Rc<RefCell<Tally>>,
    logs: Rc<LogGates>,
    /// Requests a graduated rule holds; the tick resumes them.
    delays: Rc<RefCell<Delays>>,
    /// Leases this worker's requests used lately.
    leases: Rc<RefCell<Watched>>,
    jitter: Rc<Jitter>,
    /// Lease refreshes in flight: callout token → refresh and when it left.
    refreshes: HashMap<u32, (Refresh, u64)>,
    refresh_schedule: RefreshSchedule,
    /// Settlements this worker's streams left for the gateway.
    outbox: Rc<RefCell<Outbox>>,
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
        let recent = self.leases.borrow_mut().recent(now, lp.ttl_ns);
        for lease in recent {
            let (started, counts) = decide::refresh_start(plan, &HostStore, &lease, now);
            self.tally.borrow_mut().counts(&counts);
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
                    self.tally.borrow_mut().counts(&counts);
                }
            }
        }
    }
}

impl Root {
    /// Posts what the outbox holds, a batch per call, up to
    /// [`outbox::MAX_CALLS`] calls in flight.
    fn flush_settlements(&mut self, plan: &Plan) {
        let Some(g) = plan.global.as_ref() else {
            return;
        };
        while self.settle_calls.len() < outbox::MAX_CALLS {
            let Some((batch, body)) = self.outbox.borrow_mut().next_batch(&plan.domain) else {
                return;
            };
            match dispatch(plan, &body, &g.settle_path, outbox::TIMEOUT_MS) {
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
        let d = self.outbox.borrow_mut().answered(batch, status, body);
        self.tally
            .borrow_mut()
            .background(Background::GlobalSettled, d.settled);
        self.tally
            .borrow_mut()
            .background(Background::GlobalSettleUnmatched, d.unmatched);
        self.tally
            .borrow_mut()
            .background(Background::GlobalSettleFailed, d.failed);
        if d.failed > 0 {
            if let Some(more) = self.logs.gateway.open(now_ns()) {
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
        if let Some(batch) = self.settle_calls.remove(&token_id) {
            let (status, body) = call_response(num_headers, body_size);
            self.settled(batch, status.as_deref(), &body);
            return;
        }
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
        self.tally.borrow_mut().counts(&counts);
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
    let period = if delays || leases || settles {
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
        start_timer(&plan)?;
        self.metrics = Metrics::define(&plan);
        self.tally = Rc::new(RefCell::new(Tally::new(&plan)));
        self.plan = Some(Rc::new(plan));
        self.jitter = Rc::new(seeded_jitter());
        Ok(())
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
        }
        self.metrics.flush(&mut self.tally.borrow_mut());
        let due = self.delays.borrow_mut().due(now);
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
            tally: self.tally.clone(),
            logs: self.logs.clone(),
            delays: self.delays.clone(),
            leases: self.leases.clone(),
            jitter: self.jitter.clone(),
            outbox: self.outbox.clone(),
            stream: Stream::default(),
            call: None,
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
    tally: Rc<RefCell<Tally>>,
    logs: Rc<LogGates>,
    delays: Rc<RefCell<Delays>>,
    leases: Rc<RefCell<Watched>>,
    jitter: Rc<Jitter>,
    outbox: Rc<RefCell<Outbox>>,
    /// The request's state across the callbacks.
    stream: Stream,
    /// The callout in flight: its token and when it left.
    call: Option<(u32, u64)>,
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
            // Only what some condition or key reads: each costs a host call.
            properties: plan
                .properties
                .iter()
                .map(|path| {
                    let path: Vec<&str> = path.iter().map(String::as_str).collect();
                    hostcalls::get_property(path).ok().flatten()
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
        self.tally.borrow_mut().outcome(plan, outcome);
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
        let shadow = outcome.shadow_denied(plan);
        if !shadow.is_empty() {
            if let Some(more) = self.logs.shadow.open(now) {
                log::info!(
                    "ratelimit-wasm: shadow: {shadow:?} would have denied this request (+{more} not logged)"
                );
            }
        }
    }

    /// Reports the stream's decision and carries out its verdict; `paused`
    /// says whether the request waits for a resume.
    fn conclude(&mut self, plan: &Plan, now: u64, paused: bool) -> Action {
        let Some(outcome) = self.stream.outcome() else {
            return Action::Continue;
        };
        self.report(plan, outcome, now);
        if plan.filter_state {
            leave_for_the_access_log(plan, outcome);
        }
        if let Some(l) = &outcome.lease {
            self.watch(l, now);
        }
        match outcome.verdict {
            Verdict::Delay { ms, .. } => {
                let delay = ms.saturating_mul(1_000_000);
                self.delays.borrow_mut().hold(self.id, now_ns(), delay);
                Action::Pause
            }
            Verdict::Pass(_) => {
                if paused {
                    resume_or_reset("the request");
                }
                Action::Continue
            }
            Verdict::Reject { .. } => {
                self.send_answer();
                Action::Pause
            }
        }
    }

    /// Sends the filter's own answer. Fails closed: a denial whose answer
    /// cannot be sent resets the stream; resuming would admit it, and leaving
    /// it paused would hold it until Envoy's stream timeout.
    fn send_answer(&mut self) {
        let Some(a) = self.stream.take_answer() else {
            return;
        };
        if let Err(rc) = send_local_response(a.status, &a.headers, a.body.as_bytes()) {
            log::error!(
                "ratelimit-wasm: could not send the {} response (status {rc}); resetting the request",
                a.status
            );
            if let Err(rc) = reset_request() {
                log::error!("ratelimit-wasm: could not reset the request either (status {rc})");
            }
        }
    }

    /// Queues the settlement the stream's response completed, if any, for
    /// the root's tick to post, and counts what settling against a lease
    /// could not apply.
    fn queue_settlement(&mut self) {
        let left = self.stream.take_lease_left();
        self.tally
            .borrow_mut()
            .background(Background::LeaseUnreturned, left.unreturned);
        self.tally
            .borrow_mut()
            .background(Background::LeaseDebtDropped, left.dropped);
        let Some(s) = self.stream.take_remote() else {
            return;
        };
        if !self.outbox.borrow_mut().push(s) {
            self.tally
                .borrow_mut()
                .background(Background::GlobalSettleFailed, 1);
        }
    }

    /// Posts the stream's callout; `None` when it could not even start.
    fn call_gateway(&self, plan: &Plan, now: u64) -> Option<u32> {
        self.tally
            .borrow_mut()
            .background(Background::LeaseDebtDropped, self.stream.dropped_debt());
        let (c, lease) = self.stream.callout(plan)?;
        let token = dispatch(plan, c.body, c.path, c.timeout_ms)?;
        if let Some(l) = lease {
            self.watch(l, now);
        }
        Some(token)
    }

    /// Request headers of a plan that reads request bodies (out of line:
    /// the others never come here).
    #[inline(never)]
    fn headers_reading_body(
        &mut self,
        plan: &Plan,
        req: &RequestInfo,
        now: u64,
        random: u64,
        end_of_stream: bool,
    ) -> Action {
        let (next, read) = self.stream.request_headers_reading_body(
            plan,
            req,
            &HostStore,
            now,
            random,
            end_of_stream,
        );
        self.tally.borrow_mut().body(&read.counted);
        if next == Next::Body {
            // Envoy gives a filter that paused its headers none of the body
            // until it resumes them: the headers go on, the body is held.
            if self.stream.body_rewritten() {
                drop_content_length();
            }
            return Action::Continue;
        }
        self.carry_out(plan, next, now)
    }

    /// Carries out what a phase before the request went on returned: the
    /// verdict, the callout, or the wait for the body.
    fn carry_out(&mut self, plan: &Plan, next: Next, now: u64) -> Action {
        match next {
            Next::Decided => self.conclude(plan, now, false),
            Next::Call => match self.call_gateway(plan, now) {
                Some(token) => {
                    self.call = Some((token, now));
                    Action::Pause
                }
                None => self.answer(plan, None, &[], now, false),
            },
            // Only the headers phase waits for the body (see `headers_reading_body`).
            Next::Body => Action::Continue,
        }
    }

    /// The gateway's answer, or none (`status` `None`), for the waiting request.
    fn answer(
        &mut self,
        plan: &Plan,
        status: Option<&[u8]>,
        body: &[u8],
        sent_at: u64,
        paused: bool,
    ) -> Action {
        let now = now_ns();
        let latency = now.saturating_sub(sent_at);
        if self
            .stream
            .gateway_answer(plan, status, body, latency, &HostStore, now)
        {
            // A failed check's release of the slots it may hold.
            self.queue_settlement();
            self.conclude(plan, now, paused)
        } else {
            Action::Continue
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
        let Some((token, sent_at)) = self.call else {
            return;
        };
        if token != token_id {
            log::warn!("ratelimit-wasm: answer for unknown callout {token_id}");
            return;
        }
        self.call = None;
        let (status, body) = call_response(num_headers, body_size);
        self.answer(&plan, status.as_deref(), &body, sent_at, true);
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        let req = Self::read_request(&plan);
        let now = now_ns();
        let random = self.jitter.next(&plan);
        if plan.reads_request_body {
            return self.headers_reading_body(&plan, &req, now, random, end_of_stream);
        }
        match self
            .stream
            .request_headers(&plan, &req, &HostStore, now, random)
        {
            Next::Decided => self.conclude(&plan, now, false),
            Next::Call => match self.call_gateway(&plan, now) {
                Some(token) => {
                    self.call = Some((token, now));
                    Action::Pause
                }
                None => self.answer(&plan, None, &[], now, false),
            },
            // `request_headers` never waits for a body.
            Next::Body => Action::Continue,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(limit) = self.stream.body_limit() else {
            // The rest of a body waits with a request that waits for the
            // gateway or a delay, or was refused; any other streams on.
            if self.stream.holds_body() || self.delays.borrow().holds(self.id) {
                return Action::Pause;
            }
            return Action::Continue;
        };
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        // Envoy buffers the body while this returns Pause; `body_size` is
        // all of it so far. Past the bound it is decided unread.
        let over = body_size > limit || (!end_of_stream && body_size >= limit);
        if !over && !end_of_stream {
            return Action::Pause;
        }
        let bytes = (!over).then(|| request_body(body_size));
        let now = now_ns();
        let (next, read) = self
            .stream
            .request_body(&plan, bytes.as_deref(), &HostStore, now);
        self.tally.borrow_mut().body(&read.counted);
        if let Some(new) = &read.rewritten {
            if !replace_request_body(body_size, new) {
                log::warn!("ratelimit-wasm: the host refused the rewritten request body");
            }
        }
        self.carry_out(&plan, next, now)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.stream.body_limit().is_none() {
            if self.stream.holds_body() || self.delays.borrow().holds(self.id) {
                return Action::Pause;
            }
            return Action::Continue;
        }
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        // Trailers end the request: one still waiting for its body is
        // decided now, on its defaults, rather than let through undecided.
        let now = now_ns();
        let (next, read) = self.stream.request_trailers(&plan, &HostStore, now);
        self.tally.borrow_mut().body(&read.counted);
        self.carry_out(&plan, next, now)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        #[cfg(feature = "test-trap")]
        crash_on_test_trap();
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        if let Some(headers) = self.stream.response_headers() {
            headers.each(&plan, |name, value| {
                let _ =
                    hostcalls::set_map_value_bytes(MapType::HttpResponseHeaders, name, Some(value));
            });
        }
        if self.stream.settles() {
            let counts = self
                .stream
                .response_started(&plan, &HostResponse, &HostStore, now_ns());
            self.tally.borrow_mut().counts(&counts);
            self.queue_settlement();
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Scanned as it passes, never held: the client gets each chunk at once.
        if !self.stream.wants_body() {
            return Action::Continue;
        }
        if let Some(plan) = self.plan.clone() {
            let chunk = response_body(body_size);
            let counts =
                self.stream
                    .response_body(&plan, &chunk, end_of_stream, &HostStore, now_ns());
            self.tally.borrow_mut().counts(&counts);
            self.queue_settlement();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // The stream is done (or was cancelled while held): never resume it.
        self.delays.borrow_mut().forget(self.id);
        if let Some(plan) = self.plan.clone() {
            let now = if self.stream.ends_on_the_clock() {
                now_ns()
            } else {
                0
            };
            if let Some(counts) = self.stream.end(&plan, &HostStore, now) {
                self.tally.borrow_mut().counts(&counts);
                self.queue_settlement();
            }
        }
    }
}

/// Sets the decision as filter state for Envoy's access log (before a
/// local reply: the log reads the state its stream holds at the end).
#[inline(never)]
fn leave_for_the_access_log(plan: &Plan, outcome: &Outcome) {
    let Some(why) = decide::why::why(plan, outcome) else {
        return;
    };
    if let Err(rc) = set_property(decide::why::FILTER_STATE, why.line().as_bytes()) {
        log::debug!("ratelimit-wasm: the host refused the access log's filter state (status {rc})");
    }
}

/// Test builds only (`--features test-trap`): a response carrying
/// `x-test-trap` kills the VM (an abort traps on wasm32-wasip1), as a crash
/// would, so that a real Envoy test sees what a dead VM leaves behind.
#[cfg(feature = "test-trap")]
fn crash_on_test_trap() {
    let header = hostcalls::get_map_value(MapType::HttpResponseHeaders, "x-test-trap");
    if header.ok().flatten().is_some() {
        std::process::abort();
    }
}
