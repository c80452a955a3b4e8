//! The HTTP context: one per request. Each callback fetches what a phase of
//! [`Stream`] reads, calls it, and carries out what it returns.

use super::calls::{
    call_response, dispatch, drop_content_length, grpc_call_response, now_ns, property,
    replace_request_body, request_body, response_body, wake, HostResponse, HostStore,
};
use super::worker::{Parked, Req, Worker};
use crate::decide::{Next, Reply, Stream};
use crate::global::coalesce::Join;
use crate::metrics::Background;
use crate::policy::plan::{BatchPlan, Plan, SourceNeed};
use crate::policy::request::RequestInfo;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};
use std::rc::Rc;

/// One per request.
pub(super) struct Http {
    pub id: u32,
    pub plan: Option<Rc<Plan>>,
    pub w: Rc<Worker>,
    /// The request's state across the callbacks.
    pub stream: Stream,
    /// The callout of its own in flight: its token and when it left.
    pub call: Option<(u32, u64)>,
    /// Its stream is parked in the worker while its check is in a batch.
    pub parked: bool,
}

impl Http {
    fn req(&mut self) -> Req<'_> {
        Req {
            id: self.id,
            w: &self.w,
            stream: &mut self.stream,
        }
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

    /// Calls the gateway for the waiting stream: in a batch, or alone.
    fn call_gateway(&mut self, plan: &Plan, now: u64) -> Action {
        self.w
            .tally
            .borrow_mut()
            .background(Background::LeaseDebtDropped, self.stream.dropped_debt());
        if let Some(bp) = plan.batch() {
            if self.stream.batched(plan) {
                return self.join_batch(bp, now);
            }
        }
        let token = self.stream.callout(plan).and_then(|(c, lease)| {
            let token = dispatch(plan, c.body, c.method, c.timeout_ms)?;
            if let Some(l) = lease {
                self.w.leases.borrow_mut().touch(l, now);
            }
            Some(token)
        });
        match token {
            Some(token) => {
                self.call = Some((token, now));
                Action::Pause
            }
            None => {
                let none = Reply::Own {
                    status: None,
                    body: &[],
                };
                self.req().answer(plan, none, now, false)
            }
        }
    }

    /// Queues the check for the worker's next batch and parks the stream,
    /// where the root carries out its part of the answer.
    fn join_batch(&mut self, bp: &BatchPlan, now: u64) -> Action {
        let check = self.stream.take_check();
        let join = self.w.coalescer.borrow_mut().join(self.id, check, bp, now);
        let stream = std::mem::take(&mut self.stream);
        let parked = Parked {
            stream,
            answered: false,
        };
        self.w.parked.borrow_mut().insert(self.id, parked);
        self.parked = true;
        if join == Join::Wake && !self.w.wake_queue.get().is_some_and(wake) {
            // No wake: the root's tick posts the queue.
            self.w.coalescer.borrow_mut().wake_served();
        }
        Action::Pause
    }

    /// Takes the stream back once the root carried out its batch's answer;
    /// true while it still waits for that answer.
    fn unpark(&mut self) -> bool {
        if !self.parked {
            return false;
        }
        let mut parked = self.w.parked.borrow_mut();
        if parked.get(&self.id).is_some_and(|p| !p.answered) {
            return true;
        }
        if let Some(p) = parked.remove(&self.id) {
            self.stream = p.stream;
        }
        self.parked = false;
        false
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
        self.w.tally.borrow_mut().body(&read.counted);
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
            Next::Decided => self.req().conclude(plan, now, false),
            Next::Call => self.call_gateway(plan, now),
            // Only the headers phase waits for the body (see `headers_reading_body`).
            Next::Body => Action::Continue,
        }
    }

    /// A request-side callback after the headers: the rest of a body waits
    /// with a request that waits for the gateway (alone or in a batch) or a
    /// delay, or was refused; any other streams on.
    fn hold_or_continue(&mut self) -> Action {
        if self.parked || self.stream.holds_body() || self.w.delays.borrow().holds(self.id) {
            return Action::Pause;
        }
        Action::Continue
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
        let (status, body) = call_response(num_headers, body_size);
        self.call_answered(token_id, status.as_deref(), &body);
    }

    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        let (status, body) = grpc_call_response(status_code, response_size);
        self.call_answered(token_id, status.as_deref(), &body);
    }
}

impl Http {
    /// The answer to this request's own callout, whichever the transport.
    fn call_answered(&mut self, token_id: u32, status: Option<&[u8]>, body: &[u8]) {
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
        let reply = Reply::Own { status, body };
        self.req().answer(&plan, reply, sent_at, true);
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        let req = Self::read_request(&plan);
        let now = now_ns();
        let random = self.w.jitter.borrow().next(&plan);
        if plan.reads_request_body {
            return self.headers_reading_body(&plan, &req, now, random, end_of_stream);
        }
        let next = self
            .stream
            .request_headers(&plan, &req, &HostStore, now, random);
        // `request_headers` never waits for a body.
        self.carry_out(&plan, next, now)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.unpark();
        let Some(limit) = self.stream.body_limit() else {
            return self.hold_or_continue();
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
        self.w.tally.borrow_mut().body(&read.counted);
        if let Some(new) = &read.rewritten {
            if !replace_request_body(body_size, new) {
                log::warn!("ratelimit-wasm: the host refused the rewritten request body");
            }
        }
        self.carry_out(&plan, next, now)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.unpark();
        if self.stream.body_limit().is_none() {
            return self.hold_or_continue();
        }
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        // Trailers end the request: one still waiting for its body is
        // decided now, on its defaults, rather than let through undecided.
        let now = now_ns();
        let (next, read) = self.stream.request_trailers(&plan, &HostStore, now);
        self.w.tally.borrow_mut().body(&read.counted);
        self.carry_out(&plan, next, now)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        #[cfg(feature = "test-trap")]
        super::crash_on_test_trap();
        self.unpark();
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
            self.w.tally.borrow_mut().counts(&counts);
            self.req().queue_settlement();
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
            self.w.tally.borrow_mut().counts(&counts);
            self.req().queue_settlement();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // The stream is done (or was cancelled while held): never resume it.
        self.w.delays.borrow_mut().forget(self.id);
        if self.parked {
            // Gone while its check waited: out of the queue (its local
            // charges are given back below), or its part of a batch's
            // answer goes to no one.
            self.w.coalescer.borrow_mut().leave(self.id);
            if let Some(p) = self.w.parked.borrow_mut().remove(&self.id) {
                self.stream = p.stream;
            }
            self.parked = false;
        }
        if let Some(plan) = self.plan.clone() {
            let now = if self.stream.ends_on_the_clock() {
                now_ns()
            } else {
                0
            };
            if let Some(counts) = self.stream.end(&plan, &HostStore, now) {
                self.w.tally.borrow_mut().counts(&counts);
                self.req().queue_settlement();
            }
        }
    }
}
