//! The gateway's answer to a request's callout (a check or a lease fetch):
//! read it distrustfully, record it in the circuit, refund the local charge
//! of a denied request, or take the failure mode when there is no usable
//! answer.

use super::*;

/// Reads the gateway's status and body for `pending` and finishes the decision.
pub fn finish(
    plan: &Plan,
    pending: Pending,
    status: Option<&[u8]>,
    body: &[u8],
    latency_ns: u64,
    store: &impl SharedStore,
    now_ns: u64,
) -> Outcome {
    let reply = Reply::Own { status, body };
    finish_reply(plan, pending, reply, latency_ns, store, now_ns)
}

/// Reads the gateway's reply for `pending` and finishes the decision.
pub fn finish_reply(
    plan: &Plan,
    mut pending: Pending,
    reply: Reply,
    latency_ns: u64,
    store: &impl SharedStore,
    now_ns: u64,
) -> Outcome {
    let (status, body, part) = match reply {
        Reply::Own { status, body } => (status, body, None),
        Reply::Part(part) => (None, &[][..], Some(part)),
    };
    if let Some((l, c)) = pending.lease.take() {
        let cost = l.bucket.cost;
        let mut noted = Noted {
            counts: &mut pending.counts,
            error: &mut pending.error,
        };
        let answer = lease_answer(plan, &mut noted, &l, c, cost, status, body, store, now_ns);
        let spent = answer
            .as_ref()
            .is_ok_and(|a| a.reports.iter().all(|r| r.check.allowed));
        let mut outcome = finish_with(plan, pending, answer, (latency_ns, false), store, now_ns);
        // Spent from the batch: its response settles there.
        outcome.lease = spent.then(|| Box::new(l));
        return outcome;
    }
    let (global, quotas) = (&pending.eval.global, &pending.eval.quotas);
    // A batch's part: the root counted the batch call in the circuit once.
    let recorded = part.is_some();
    let answer = match part {
        None => callout::parse_answer(plan, global, quotas, status, body),
        Some(part) => part.and_then(|a| callout::interpret(plan, global, quotas, a)),
    };
    if let Ok(a) = &answer {
        // The waits count from the callout: never longer than the gateway's.
        let sent = pending.held.at_ns;
        let remembered = match a.apart.uncached.is_empty() {
            true => deny_cache::remember(plan, store, &pending.eval.global, &a.reports, sent),
            false => remember_enforced(plan, store, &pending.eval.global, a, sent),
        };
        if remembered.is_err() {
            pending.counts.add(Metric::Errors, 1);
        }
    }
    finish_with(plan, pending, answer, (latency_ns, recorded), store, now_ns)
}

/// Remembers the denials of the buckets the gateway enforces plainly: a
/// shadow or soft bucket's denial denies nothing, and a graduated bucket
/// counts every request's demand, so neither is answered from the cache.
/// Out of line: most answers hold neither.
#[inline(never)]
fn remember_enforced(
    plan: &Plan,
    store: &impl SharedStore,
    global: &[GlobalBucket],
    a: &Answer,
    sent_ns: u64,
) -> Result<(), LimitError> {
    let plain = |rule: usize| !a.apart.uncached.contains(&rule);
    let global: Vec<GlobalBucket> = global.iter().filter(|g| plain(g.rule)).cloned().collect();
    let reports: Vec<Report> = a
        .reports
        .iter()
        .filter(|r| plain(r.rule))
        .copied()
        .collect();
    deny_cache::remember(plan, store, &global, &reports, sent_ns)
}

/// Stores a lease answer in the slot, spending `cost` of it at once, and reads
/// it as a check answer: allowed when the slot covers the cost once the
/// grant has paid its debt.
#[allow(clippy::too_many_arguments)]
pub(super) fn lease_answer(
    plan: &Plan,
    p: &mut Noted,
    l: &Lease,
    c: Claim,
    cost: u64,
    status: Option<&[u8]>,
    body: &[u8],
    store: &impl SharedStore,
    now_ns: u64,
) -> Result<Answer, AnswerError> {
    let lp = plan.global.as_ref().and_then(|g| g.lease.as_ref());
    let (lp, a) = match (
        lp,
        callout::parse_lease_answer(plan, l, c.want, status, body),
    ) {
        (Some(lp), Ok(a)) => (lp, a),
        (_, parsed) => {
            if let Err(e) = lease::release(store, l) {
                p.failed(e);
            }
            return Err(parsed.err().unwrap_or(AnswerError::NoAnswer));
        }
    };
    // Nothing granted: the pool is empty until the gateway expects a token.
    let empty_ns = if a.granted == 0 {
        a.retry_after_ms.iter().max().copied().unwrap_or(0).max(1) * 1_000_000
    } else {
        0
    };
    let stored = lease::store_grant(store, l, lp, a.granted, cost, &a.limits, empty_ns, now_ns);
    let (slot, spent) = match stored {
        Ok(stored) => stored,
        Err(e) => {
            p.failed(e);
            // Unrecorded, the grant is still this request's to spend.
            (lease::Slot::default(), a.granted >= cost)
        }
    };
    let mut reports = lease::reports(plan, l, &slot, now_ns);
    if !spent {
        // The gateway's wait, or the debt's when the grant went to paying it
        // (only this bucket's: the slot may have changed hands meanwhile).
        let debt_wait = Some(&slot)
            .filter(|s| s.fingerprint == l.fingerprint)
            .and_then(|s| s.debt_wait_ns(&l.debt, cost, now_ns))
            .unwrap_or(0);
        for (r, retry_ms) in reports.iter_mut().zip(&a.retry_after_ms) {
            r.check.allowed = false;
            r.check.retry_after_ns = ((*retry_ms).max(1) * 1_000_000).max(debt_wait);
        }
    }
    Ok(Answer {
        reports,
        quotas: Vec::new(),
        clamped: a.clamped,
        mismatch: a.mismatch,
        apart: Default::default(),
    })
}

/// The second argument is the call's latency and whether the circuit
/// already counted the call (a batch's, counted once by the host).
fn finish_with(
    plan: &Plan,
    p: Pending,
    answer: Result<Answer, AnswerError>,
    (latency_ns, recorded): (u64, bool),
    store: &impl SharedStore,
    now_ns: u64,
) -> Outcome {
    let mut ctx = Ctx {
        plan,
        store,
        now_ns,
        random: p.random,
        counts: p.counts,
        error: p.error,
        refusals: p.refusals,
    };
    let eval = p.eval;
    let mut held = p.held;
    let Some(g) = &plan.global else {
        let v = ctx.pass(p.local_reports);
        let mut outcome = ctx.done(v, eval.bad_input, None, Transition::None);
        outcome.held = held;
        return outcome;
    };
    // Everything passed: the gateway charged it, and kept a reservation if asked.
    let charged = answer.as_ref().is_ok_and(|a| {
        a.reports.iter().all(|r| r.check.allowed) && a.quotas.iter().all(|q| q.allowed)
    });
    let reserved = p
        .reservation
        .filter(|_| charged)
        .and_then(|id| super::remote::Reserved::new(plan, &eval, id));
    let transition = match recorded {
        true => Transition::None,
        false => record_call(g, store, &answer, latency_ns, p.probe, now_ns),
    };
    if transition == Transition::Opened {
        ctx.counts.add(Metric::CircuitOpened, 1);
    }
    let (v, gateway_error) = match answer {
        Ok(a) => (ctx.answered(a, &eval, &mut held, p.local_reports), None),
        Err(e) => {
            let v = ctx.failure_mode(g, &eval, &mut held, p.local_reports);
            (v, Some(e))
        }
    };
    if let Some(r) = reserved {
        held.more.get_or_insert_with(Box::default).remote = Some(Box::new(r));
    }
    let mut outcome = ctx.done(v, eval.bad_input, gateway_error, transition);
    outcome.held = held;
    outcome
}

impl<S: SharedStore> Ctx<'_, S> {
    /// The gateway answered: its denial (of a rate or a quota) refunds the
    /// local charge; a soft client only has it noted.
    fn answered(
        &mut self,
        a: Answer,
        eval: &Evaluation,
        held: &mut Held,
        local_reports: Vec<Report>,
    ) -> Verdict {
        self.counts.add(Metric::GatewayClamped, a.clamped);
        self.counts
            .add(Metric::PolicyMismatch, u64::from(a.mismatch));
        let mut all = local_reports;
        let apart = &a.apart;
        let watched = |r: &Report| apart.watches(r.rule);
        let rate_denied = a.reports.iter().any(|r| !r.check.allowed && !watched(r));
        let quota_denied = a.quotas.iter().any(|q| !q.allowed);
        if !apart.watched.is_empty() {
            // What the gateway's shadow rules and soft clients would have denied.
            let would: Vec<Report> = a
                .reports
                .iter()
                .filter(|r| !r.check.allowed && watched(r))
                .copied()
                .collect();
            if !would.is_empty() && !(eval.soft && (rate_denied || quota_denied)) {
                self.note_shadow(&would);
            }
        }
        if eval.soft && (rate_denied || quota_denied) {
            all.extend_from_slice(&a.reports);
            self.note_shadow(&a.reports);
            self.pass_staged(all, apart)
        } else if rate_denied || quota_denied {
            // A watched limit's denial is no reason: it stays out of the 429.
            all.extend(a.reports.iter().filter(|r| !watched(r)).copied());
            self.refund(held);
            match rate_denied {
                true => self.too_many(&all),
                false => self.quota_exhausted(&a.quotas, &eval.quotas, &all),
            }
        } else {
            all.extend_from_slice(&a.reports);
            self.pass_staged(all, apart)
        }
    }

    /// No usable answer: the global plan's failure mode decides. Fail-closed
    /// refunds the local charge; `local` charges the local stand-ins, all or
    /// nothing, and refunds the local charge when they deny.
    fn failure_mode(
        &mut self,
        g: &GlobalPlan,
        eval: &Evaluation,
        held: &mut Held,
        local_reports: Vec<Report>,
    ) -> Verdict {
        self.counts.add(Metric::GlobalFailures, 1);
        match g.failure_mode {
            FailureMode::Open => {
                self.counts.add(Metric::FailOpen, 1);
                self.pass(local_reports)
            }
            FailureMode::Closed => {
                self.counts.add(Metric::FailClosed, 1);
                self.refund(held);
                self.unavailable()
            }
            FailureMode::Local if eval.soft => {
                self.counts.add(Metric::FallbackLocal, 1);
                let mut all = local_reports;
                self.watch(&eval.fallback, &mut all);
                self.pass(all)
            }
            FailureMode::Local => {
                self.counts.add(Metric::FallbackLocal, 1);
                let (watched, enforced) = super::local::stand_ins(self.plan, &eval.fallback);
                match self.charge(&enforced) {
                    Ok(r) => {
                        let mut all = local_reports;
                        // The stand-ins stay out of `held`: charged now, not
                        // when `held` was, a refund would miss their window.
                        all.extend(r.into_iter().flatten());
                        self.watch(&watched, &mut all);
                        self.pass(all)
                    }
                    Err(v) => {
                        self.refund(held);
                        v
                    }
                }
            }
        }
    }
}
