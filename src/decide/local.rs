//! The first step of a request: evaluate the plan, charge the local rules,
//! spend from a lease or gate the callout through the circuit, and decide
//! whatever can be decided without the gateway; and the way back when the
//! client leaves while its request waits.
//!
//! Each step below returns its own result: a step that fails notes its error
//! for the log but never changes what another step holds, so a charge that
//! succeeded stays on the refund list whatever fails after it.

use super::*;

/// Decides `req` at `now_ns` as far as possible without the gateway.
/// `random` feeds the jitter of `Retry-After` and of block releases.
pub fn start(
    plan: &Plan,
    req: &RequestInfo,
    store: &impl SharedStore,
    now_ns: u64,
    random: u64,
) -> Step {
    first_step(plan, || plan.evaluate(req), store, now_ns, random)
}

/// [`start`] for a request already evaluated: one that waited for its body
/// (`decide::body`), whose reservations the body set.
pub fn start_evaluated(
    plan: &Plan,
    eval: Evaluation,
    store: &impl SharedStore,
    now_ns: u64,
    random: u64,
) -> Step {
    first_step(plan, move || eval, store, now_ns, random)
}

/// The first step over the evaluation `evaluate` makes. A closure rather
/// than the evaluation itself: [`start`] then builds it in place, where
/// passing it by value cost c1 129 instructions of copying (a decision
/// 4,758.9 against 4,629.9).
#[inline(always)]
fn first_step(
    plan: &Plan,
    evaluate: impl FnOnce() -> Evaluation,
    store: &impl SharedStore,
    now_ns: u64,
    random: u64,
) -> Step {
    let mut eval = evaluate();
    let mut ctx = Ctx::new(plan, store, now_ns, random);
    if !eval.bad_input.is_empty() {
        ctx.counts.add(Metric::BadInput, 1);
    }
    ctx.counts
        .add(Metric::LimitsByDefault, eval.limits_by_default);
    if nothing_applies(&eval) {
        return Step::Done(untouched(ctx, eval));
    }
    let leasing = match ctx.spend_lease(&eval) {
        Ok(l) => l,
        Err(v) => return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None)),
    };
    if leasing.served.is_none() {
        if let Some(v) = ctx.cached_denial(&eval) {
            return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None));
        }
    }
    let needs_gateway =
        (!eval.global.is_empty() && leasing.served.is_none()) || !eval.quotas.is_empty();
    let global = plan.global.as_ref().filter(|_| needs_gateway);
    let gate = global.map(|g| ctx.gate(g));
    let mut charge = std::mem::take(&mut eval.buckets);
    let mut watch_fallback = false;
    if let (Some(g), Some(Gate::Open)) = (global, gate) {
        match ctx.circuit_open(g, &eval, &mut charge) {
            Ok(watch) => watch_fallback = watch,
            Err(v) => return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None)),
        }
    }
    let (mut charged, mut reports) = match ctx.charge(&charge) {
        Ok(Some(reports)) => (charge, reports),
        Ok(None) => (Vec::new(), Vec::new()),
        Err(v) => {
            if let (Some(l), Some(_)) = (&leasing.lease, &leasing.served) {
                ctx.give_back(l);
            }
            return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None));
        }
    };
    // A shadow charge is held like an enforced one: settled from its
    // response, and given back if the request is refused after all.
    if ctx.watch(&eval.shadow, &mut reports) {
        charged.extend_from_slice(&eval.shadow);
    }
    if watch_fallback {
        ctx.watch_stand_ins(&eval, &mut reports);
    }
    let mut held = Held {
        buckets: charged,
        at_ns: now_ns,
        more: eval.cost_meter.map(|m| {
            Box::new(HeldMore {
                cost_meter: Some(m),
                ..HeldMore::default()
            })
        }),
    };
    if !eval.in_flight.is_empty() {
        match ctx.take_slots(&eval, &mut reports) {
            Ok(slots) => held.more.get_or_insert_with(Box::default).slots = slots,
            Err(v) => {
                ctx.refund(&mut held);
                if let (Some(l), Some(_)) = (&leasing.lease, &leasing.served) {
                    ctx.give_back(l);
                }
                return Step::Done(ctx.done(v, eval.bad_input, None, Transition::None));
            }
        }
    }
    match gate {
        Some(Gate::Call) | Some(Gate::Probe) => {
            let probe = gate == Some(Gate::Probe);
            Step::Call(ctx.callout(leasing, eval, held, reports, probe))
        }
        _ => {
            let served = leasing.served.is_some();
            let v = ctx.admit(leasing.served, reports);
            let mut outcome = ctx.done(v, eval.bad_input, None, Transition::None);
            outcome.lease = leasing.lease.filter(|_| served);
            outcome.held = held;
            Step::Done(outcome)
        }
    }
}

impl<S: SharedStore> Ctx<'_, S> {
    /// Charges the stand-ins that only watch: a soft client's all, else
    /// those of shadow rules. Out of line: the circuit is rarely open.
    #[inline(never)]
    fn watch_stand_ins(&mut self, eval: &Evaluation, reports: &mut Vec<Report>) {
        let (watched, _) = stand_ins(self.plan, &eval.fallback);
        let watched = if eval.soft { &eval.fallback } else { &watched };
        self.watch(watched, reports);
    }
}

/// The local stand-ins of a request's global rules, split into those of
/// shadow rules (watched: counted, never denying) and the others.
#[inline(never)]
pub(super) fn stand_ins(plan: &Plan, fallback: &[Bucket]) -> (Vec<Bucket>, Vec<Bucket>) {
    fallback
        .iter()
        .partition(|b| plan.rules.get(b.rule).is_some_and(|r| r.shadow))
}

/// No rule, quota or shadow rule applies to the request.
#[inline(always)]
fn nothing_applies(eval: &Evaluation) -> bool {
    eval.buckets.is_empty()
        && eval.shadow.is_empty()
        && eval.global.is_empty()
        && eval.quotas.is_empty()
        && eval.in_flight.is_empty()
}

/// The outcome of a request nothing applies to: it passes uncounted and
/// without headers (only an unlimited client is counted as such).
fn untouched<S>(mut ctx: Ctx<'_, S>, eval: Evaluation) -> Outcome {
    if eval.unlimited {
        ctx.counts.add(Metric::Unlimited, 1);
    }
    Outcome {
        verdict: Verdict::Pass(Passing::default()),
        counts: ctx.counts,
        error: None,
        gateway_error: None,
        circuit: Transition::None,
        refusals: Vec::new(),
        bad_input: eval.bad_input,
        lease: None,
        held: Held::default(),
    }
}

/// What the lease step found: the lease that may serve the request, the
/// reports of the tokens it spent, and whether it needs a batch.
struct Leasing {
    /// Boxed: moved between the steps, inline it cost c1 instructions
    /// even when no lease applies.
    lease: Option<Box<Lease>>,
    served: Option<Vec<Report>>,
    short: bool,
}

impl<S: SharedStore> Ctx<'_, S> {
    /// Spends the request's cost from its lease when lease mode serves it
    /// (one global token bucket, no quota, not a soft client); `Err` is the
    /// 429 of a pool the gateway said is empty.
    #[inline(always)]
    fn spend_lease(&mut self, eval: &Evaluation) -> Result<Leasing, Verdict> {
        let lease = match (eval.global.as_slice(), eval.quotas.is_empty(), eval.soft) {
            ([g], true, false) => lease::locate(self.plan, g),
            _ => None,
        };
        let mut leasing = Leasing {
            lease: None,
            served: None,
            short: false,
        };
        let Some(l) = lease else {
            return Ok(leasing);
        };
        match lease::take(self.store, &l, self.now_ns) {
            Ok(Take::Taken(slot)) => {
                self.counts.add(Metric::LeaseServed, 1);
                leasing.served = Some(lease::reports(self.plan, &l, &slot, self.now_ns));
            }
            Ok(Take::Short) => leasing.short = true,
            Ok(Take::Busy) => {}
            Ok(Take::Empty { wait_ns } | Take::InDebt { wait_ns }) => {
                self.counts.add(Metric::LeaseServed, 1);
                let reports = lease::refused_reports(self.plan, &l, wait_ns, self.now_ns);
                return Err(self.too_many(&reports));
            }
            Err(e) => self.failed(e),
        }
        leasing.lease = Some(Box::new(l));
        Ok(leasing)
    }

    /// A bucket the gateway denied and whose wait is not over: 429 here,
    /// before any charge (a denied request consumes nothing). A soft client
    /// is never denied; an unreadable cache denies nothing.
    #[inline(always)]
    fn cached_denial(&mut self, eval: &Evaluation) -> Option<Verdict> {
        if eval.soft || eval.global.is_empty() {
            return None;
        }
        match deny_cache::lookup(self.plan, self.store, &eval.global, self.now_ns) {
            Ok(Some(reports)) => {
                self.counts.add(Metric::DenyCacheHits, 1);
                Some(self.too_many(&reports))
            }
            Ok(None) => None,
            Err(_) => {
                self.counts.add(Metric::Errors, 1);
                None
            }
        }
    }

    /// Whether the circuit lets a callout go now.
    #[inline(always)]
    fn gate(&self, g: &GlobalPlan) -> Gate {
        let longest = longest_timeout_ms(g);
        circuit::gate(
            self.store,
            &g.circuit_key,
            &g.circuit,
            g.timeout_ms,
            longest,
            self.now_ns,
        )
    }

    /// The circuit is open: the failure mode decides. `Err` is fail-closed's
    /// 503; `failure_mode: local` adds the local stand-ins to `charge` (all
    /// or nothing with the local rules), or says to watch them for a soft
    /// client (`Ok(true)`).
    #[inline(always)]
    fn circuit_open(
        &mut self,
        g: &GlobalPlan,
        eval: &Evaluation,
        charge: &mut Vec<Bucket>,
    ) -> Result<bool, Verdict> {
        self.counts.add(Metric::CircuitOpenSkips, 1);
        match g.failure_mode {
            FailureMode::Closed => {
                self.counts.add(Metric::FailClosed, 1);
                Err(self.unavailable())
            }
            FailureMode::Open => {
                self.counts.add(Metric::FailOpen, 1);
                Ok(false)
            }
            FailureMode::Local => {
                self.counts.add(Metric::FallbackLocal, 1);
                if eval.soft {
                    return Ok(true);
                }
                let (watched, enforced) = stand_ins(self.plan, &eval.fallback);
                charge.extend_from_slice(&enforced);
                Ok(!watched.is_empty())
            }
        }
    }

    /// The request waits for the gateway: a lease batch when the lease ran
    /// short and the slot could be claimed, otherwise a check of every
    /// global bucket and quota.
    fn callout(
        mut self,
        leasing: Leasing,
        eval: Evaluation,
        held: Held,
        local_reports: Vec<Report>,
        probe: bool,
    ) -> Box<Pending> {
        self.counts.add(Metric::GlobalCalls, 1);
        let lease = match leasing.lease {
            Some(l) if leasing.short => self.claim_lease(*l),
            _ => None,
        };
        let mut reservation = None;
        let body = match &lease {
            Some((l, c)) => {
                self.counts.add(Metric::LeaseFetches, 1);
                callout::encode_lease(self.plan, l, c.want, c.returned)
            }
            None => {
                if self.plan.settling && super::remote::settles(self.plan, &eval) {
                    reservation = Some(super::remote::reservation_id(self.random));
                }
                let id = reservation.as_deref();
                match self.plan.batch().is_some() {
                    true => callout::encode_check(self.plan, &eval.global, &eval.quotas, id),
                    false => callout::encode_request(self.plan, &eval.global, &eval.quotas, id),
                }
            }
        };
        Box::new(Pending {
            body,
            lease,
            probe,
            held,
            local_reports,
            eval,
            random: self.random,
            counts: self.counts,
            error: self.error,
            refusals: self.refusals,
            reservation,
        })
    }

    /// Claims the lease slot for a batch fetch; `None` when another request
    /// is fetching, or when the slot cannot be written (the request is then
    /// checked on its own).
    fn claim_lease(&mut self, l: Lease) -> Option<(Lease, Claim)> {
        let lp = self.plan.global.as_ref()?.lease.as_ref()?;
        match lease::claim(self.store, &l, lp, self.now_ns, false) {
            Ok(Some(c)) => Some((l, c)),
            Ok(None) => None,
            Err(e) => {
                self.failed(e);
                None
            }
        }
    }

    /// Lets the request through without the gateway, with the reports of
    /// the lease that served it, if any. Works on the context in place:
    /// taking it by value cost c1 about 140 instructions of moves.
    #[inline(always)]
    fn admit(&mut self, served: Option<Vec<Report>>, mut reports: Vec<Report>) -> Verdict {
        if let Some(leased) = served {
            reports.extend(leased);
        }
        self.pass(reports)
    }
}

/// The client left while its request waited for the gateway: gives back the
/// local charge (the request never reached the upstream) and frees a lease
/// claim. A late answer is dropped, so what the gateway charged stays charged:
/// the strict side.
pub fn abandon(plan: &Plan, pending: Pending, store: &impl SharedStore) -> Counts {
    let held = &pending.held;
    let mut counts = super::in_flight::release(plan, store, held.slots(), held.at_ns);
    if limiter::refund(store, plan, &held.buckets, held.at_ns).is_err() {
        counts.add(Metric::Errors, 1);
    }
    if let Some((l, _)) = &pending.lease {
        if lease::release(store, l).is_err() {
            counts.add(Metric::Errors, 1);
        }
    }
    counts
}
