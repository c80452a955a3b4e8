//! A request whose decision waits for its body: one that matched a
//! `cost_from` whose `reserve` is read from the body (`max_tokens`), or
//! whose `ensure_stream_usage` may rewrite it. Its headers were evaluated
//! (and nothing charged); when the body has ended, or has passed the bound,
//! the reservations are set from it and the request is decided as any
//! other (`start_evaluated`).

use super::*;
use crate::metrics::BodyMetric;
use crate::policy::plan::MeterPlan;
use crate::usage::request::{self, Body, Reserved, Rewrite};

/// A request waiting for its body: what its headers evaluated to.
#[derive(Debug)]
pub struct BodyWait {
    eval: Evaluation,
    random: u64,
    /// The meters that read the body ([`Plan::body_meters`]).
    meters: Vec<usize>,
    limit: usize,
    /// Some meter may rewrite the body (`ensure_stream_usage`).
    rewrites: bool,
}

/// What reading the body did, for the host to carry out.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BodyRead {
    /// The body `ensure_stream_usage` wrote, to replace the one held.
    pub rewritten: Option<Vec<u8>>,
    /// What to count, each once.
    pub counted: Vec<BodyMetric>,
}

impl BodyWait {
    /// The wait of a request evaluated to `eval`, whose `meters` read its
    /// body; it holds at most the largest of their `request_body_limit`s.
    pub fn new(plan: &Plan, eval: Evaluation, random: u64, meters: Vec<usize>) -> BodyWait {
        let limit = meters
            .iter()
            .filter_map(|m| plan.meters.get(*m))
            .map(|m| m.request_body_limit)
            .max()
            .unwrap_or(0);
        let rewrites = meters
            .iter()
            .filter_map(|m| plan.meters.get(*m))
            .any(|m| m.ensure_stream_usage);
        BodyWait {
            eval,
            random,
            meters,
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
            rewrites,
        }
    }

    /// The most bytes of the body read.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Whether the body may be rewritten (`ensure_stream_usage`).
    pub fn rewrites(&self) -> bool {
        self.rewrites
    }

    /// The body as the host has it (`None`: longer than [`BodyWait::limit`]),
    /// read: the evaluation with its reservations set, the random number of
    /// its headers, and what the host carries out.
    pub fn read(self, plan: &Plan, bytes: Option<&[u8]>) -> (Evaluation, u64, BodyRead) {
        let body = Body::parse(bytes);
        self.settle(plan, &body, bytes.unwrap_or_default())
    }

    /// The request ended with its headers: every reservation is its default.
    pub fn absent(self, plan: &Plan) -> (Evaluation, u64, BodyRead) {
        self.settle(plan, &Body::Absent, &[])
    }

    fn settle(mut self, plan: &Plan, body: &Body, bytes: &[u8]) -> (Evaluation, u64, BodyRead) {
        let mut read = BodyRead::default();
        let mut any_default = false;
        let mut any_pointer = false;
        let mut rewrite = false;
        for &m in &self.meters {
            let Some(meter) = plan.meters.get(m) else {
                continue;
            };
            rewrite |= meter.ensure_stream_usage;
            let Some(pointer) = &meter.reserve_from else {
                continue;
            };
            any_pointer = true;
            match request::reserve(body, pointer, meter.max) {
                Reserved::Read(value) => set_reserve(plan, &mut self.eval, m, meter, value),
                // The evaluation already holds the default.
                Reserved::Default => any_default = true,
            }
        }
        if any_pointer {
            read.counted.push(match body {
                Body::TooLarge => BodyMetric::ReserveTooLarge,
                Body::NotJson => BodyMetric::ReserveNotJson,
                _ if any_default => BodyMetric::ReserveMissing,
                _ => BodyMetric::ReserveRead,
            });
        }
        if rewrite {
            match request::ensure_stream_usage(body, bytes) {
                Rewrite::Unneeded => {}
                Rewrite::Unchanged => read.counted.push(BodyMetric::UsageBodyUnchanged),
                Rewrite::Body(b) => {
                    read.counted.push(BodyMetric::UsageBodyRewritten);
                    read.rewritten = Some(b);
                }
            }
        }
        (self.eval, self.random, read)
    }
}

/// Sets the reservation of the buckets meter `m` settles to `value` (at
/// most `max` already), each capped at its rule's smallest limit, as a
/// fixed `reserve` is held to when the configuration is loaded: a request
/// whose body asks for more than a bucket holds is not refused for ever.
/// Local, shadow, stand-in and global buckets alike, and the quotas that
/// count the cost of a `costs[]` entry reading the body.
fn set_reserve(plan: &Plan, eval: &mut Evaluation, m: usize, meter: &MeterPlan, value: u64) {
    let cost_meter = eval.cost_meter;
    let reserve = |rule: usize, variant: usize| {
        let smallest = plan
            .limits(rule, variant)
            .iter()
            .map(|(l, _)| l.capacity)
            .min()
            .unwrap_or(value);
        value.min(smallest).max(1)
    };
    let local = eval
        .buckets
        .iter_mut()
        .chain(eval.shadow.iter_mut())
        .chain(eval.fallback.iter_mut());
    for b in local.filter(|b| plan.meter_of(b.rule, cost_meter) == Some(m)) {
        b.cost = reserve(b.rule, b.variant);
    }
    for g in eval
        .global
        .iter_mut()
        .filter(|g| plan.meter_of(g.rule, cost_meter) == Some(m))
    {
        g.cost = reserve(g.rule, g.variant);
    }
    if cost_meter == Some(m) {
        eval.cost = value.min(meter.max);
        let counts_cost = |q: usize| plan.quotas.get(q).is_some_and(|p| p.counts_cost());
        for q in eval.quotas.iter_mut().filter(|q| counts_cost(q.quota)) {
            q.amount = eval.cost;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::store::MemoryStore;

    fn plan(reserve: serde_json::Value, cost_rule: bool) -> Plan {
        let from = serde_json::json!({"preset": "openai_chat", "max": 1000, "reserve": reserve,
            "ensure_stream_usage": true});
        let mut rule = serde_json::json!({"name": "tokens", "key": ["client"],
            "limits": [{"requests": 800, "per": "1m"}, {"requests": 5000, "per": "1h"}]});
        let mut config = serde_json::json!({"domain": "d", "rules": [rule.clone()]});
        if cost_rule {
            rule["cost_from"] = from;
            config["rules"] = serde_json::json!([rule]);
        } else {
            config["costs"] =
                serde_json::json!([{"match": {"path_prefix": "/v1"}, "cost_from": from}]);
        }
        let config = crate::config::parse(config.to_string().as_bytes()).unwrap();
        Plan::compile(&config, [7; 16])
    }

    fn wait(plan: &Plan) -> BodyWait {
        let named: [(&str, &[u8]); 2] = [(":path", b"/v1/chat"), ("x-client-id", b"a")];
        let req = RequestInfo::with_headers(&plan.header_names, &named);
        let eval = plan.evaluate(&req);
        let meters = plan.body_meters(&eval);
        assert_eq!(meters, [0]);
        BodyWait::new(plan, eval, 9, meters)
    }

    fn costs(eval: &Evaluation) -> Vec<u64> {
        eval.buckets.iter().map(|b| b.cost).collect()
    }

    #[test]
    fn the_body_sets_the_reservation_of_the_rule_and_of_a_costs_entry() {
        for cost_rule in [true, false] {
            let plan = plan(
                serde_json::json!({"pointer": "/max_tokens", "default": 20}),
                cost_rule,
            );
            assert!(plan.reads_request_body);
            let w = wait(&plan);
            assert_eq!((w.limit(), w.rewrites()), (64 << 10, true));
            let (eval, random, read) = w.read(&plan, Some(br#"{"max_tokens": 500}"#));
            assert_eq!((costs(&eval), random), (vec![500], 9), "{cost_rule}");
            assert_eq!(read.counted, [BodyMetric::ReserveRead]);
            assert_eq!(read.rewritten, None);
            // Past the rule's smallest limit (800): capped there, under max (1000).
            let (eval, _, _) = wait(&plan).read(&plan, Some(br#"{"max_tokens": 900}"#));
            assert_eq!(costs(&eval), [800]);
            let (eval, _, read) = wait(&plan).read(&plan, Some(br#"{"max_tokens": 0}"#));
            assert_eq!(
                (costs(&eval), read.counted),
                (vec![20], vec![BodyMetric::ReserveMissing])
            );
            let (eval, _, read) = wait(&plan).read(&plan, Some(b"max_tokens=5"));
            assert_eq!(
                (costs(&eval), read.counted),
                (
                    vec![20],
                    vec![BodyMetric::ReserveNotJson, BodyMetric::UsageBodyUnchanged]
                )
            );
            let (eval, _, read) = wait(&plan).read(&plan, None);
            assert_eq!(
                (costs(&eval), read.counted),
                (
                    vec![20],
                    vec![BodyMetric::ReserveTooLarge, BodyMetric::UsageBodyUnchanged]
                )
            );
            let (eval, _, read) = wait(&plan).absent(&plan);
            assert_eq!(
                (costs(&eval), read.counted),
                (vec![20], vec![BodyMetric::ReserveMissing])
            );
        }
    }

    #[test]
    fn a_stream_is_asked_for_its_usage_and_a_fixed_reserve_is_kept() {
        let plan = plan(serde_json::json!(30), true);
        let (eval, _, read) = wait(&plan).read(&plan, Some(br#"{"stream":true,"max_tokens":500}"#));
        assert_eq!(costs(&eval), [30]);
        assert_eq!(read.counted, [BodyMetric::UsageBodyRewritten]);
        assert_eq!(
            read.rewritten.as_deref(),
            Some(
                &br#"{"stream_options":{"include_usage":true},"stream":true,"max_tokens":500}"#[..]
            )
        );
        let (_, _, read) = wait(&plan).read(&plan, Some(br#"{"stream":false}"#));
        assert_eq!(read, BodyRead::default());
    }

    #[test]
    fn a_stream_waits_for_its_body_and_trailers_decide_it_on_the_defaults() {
        let plan = plan(
            serde_json::json!({"pointer": "/max_tokens", "default": 20}),
            true,
        );
        let store = MemoryStore::default();
        let named: [(&str, &[u8]); 2] = [(":path", b"/v1/chat"), ("x-client-id", b"a")];
        let req = RequestInfo::with_headers(&plan.header_names, &named);
        let mut s = Stream::default();
        let (next, read) = s.request_headers_reading_body(&plan, &req, &store, 1, 9, false);
        assert_eq!((next, read), (Next::Body, BodyRead::default()));
        assert_eq!((s.body_limit(), s.body_rewritten()), (Some(64 << 10), true));
        assert!(s.held().is_none() && !s.holds_body());
        let (next, read) = s.request_trailers(&plan, &store, 2);
        assert_eq!(next, Next::Decided);
        assert_eq!(read.counted, [BodyMetric::ReserveMissing]);
        assert_eq!(s.held().map(|h| h.buckets[0].cost), Some(20));
        assert_eq!(s.body_limit(), None);
        // Once decided, a late body changes nothing.
        let (next, read) = s.request_body(&plan, Some(br#"{"max_tokens":5}"#), &store, 3);
        assert_eq!((next, read), (Next::Decided, BodyRead::default()));
        assert_eq!(s.held().map(|h| h.buckets[0].cost), Some(20));
        // The same request with its body: read when the body ends.
        let mut s = Stream::default();
        s.request_headers_reading_body(&plan, &req, &store, 4, 9, false);
        let (next, read) = s.request_body(&plan, Some(br#"{"max_tokens":5}"#), &store, 5);
        assert_eq!(
            (next, read.counted),
            (Next::Decided, vec![BodyMetric::ReserveRead])
        );
        assert_eq!(s.held().map(|h| h.buckets[0].cost), Some(5));
        // Without a body at all: decided at the headers.
        let mut s = Stream::default();
        let (next, read) = s.request_headers_reading_body(&plan, &req, &store, 6, 9, true);
        assert_eq!(
            (next, read.counted),
            (Next::Decided, vec![BodyMetric::ReserveMissing])
        );
        assert_eq!(s.held().map(|h| h.buckets[0].cost), Some(20));
    }

    #[test]
    fn the_decision_after_the_body_charges_the_reservation_read() {
        let plan = plan(serde_json::json!({"pointer": "/max_tokens"}), true);
        let store = MemoryStore::default();
        let (eval, random, _) = wait(&plan).read(&plan, Some(br#"{"max_tokens": 700}"#));
        let Step::Done(o) = start_evaluated(&plan, eval, &store, 1, random) else {
            panic!("a local rule needs no callout");
        };
        assert!(matches!(o.verdict, Verdict::Pass(_)));
        assert_eq!(o.held.buckets[0].cost, 700);
        // 100 left of 800: a second request reserving 700 is refused.
        let (eval, random, _) = wait(&plan).read(&plan, Some(br#"{"max_tokens": 700}"#));
        let Step::Done(o) = start_evaluated(&plan, eval, &store, 2, random) else {
            panic!("a local rule needs no callout");
        };
        assert!(matches!(o.verdict, Verdict::Reject { status: 429, .. }));
        let (eval, random, _) = wait(&plan).read(&plan, Some(br#"{"max_tokens": 100}"#));
        let Step::Done(o) = start_evaluated(&plan, eval, &store, 3, random) else {
            panic!("a local rule needs no callout");
        };
        assert!(matches!(o.verdict, Verdict::Pass(_)));
    }

    #[test]
    fn the_body_sets_the_reservation_of_a_global_rule_and_of_a_quota_counting_cost() {
        let config = serde_json::json!({"domain": "d", "global": {"cluster": "gw"},
            "rules": [{"name": "g", "scope": "global", "key": ["client"],
                       "limits": [{"requests": 800, "per": "1m"}]}],
            "costs": [{"match": {"path_prefix": "/v1"}, "cost_from": {"preset": "openai_chat",
                "max": 1000, "reserve": {"pointer": "/max_tokens", "default": 20}}}],
            "quotas": [{"name": "monthly", "key": ["client"], "period": "month", "limit": 100000,
                        "count": "cost", "upgrade_url": "https://example.com/up"}]});
        let config = crate::config::parse(config.to_string().as_bytes()).unwrap();
        let plan = Plan::compile(&config, [7; 16]);
        let read = |body: &[u8]| {
            let (eval, _, _) = wait(&plan).read(&plan, Some(body));
            let global: Vec<u64> = eval.global.iter().map(|g| g.cost).collect();
            let quotas: Vec<u64> = eval.quotas.iter().map(|q| q.amount).collect();
            (global, quotas)
        };
        assert_eq!(read(br#"{"max_tokens": 500}"#), (vec![500], vec![500]));
        // The rule holds at most its smallest limit; the quota counts up to max.
        assert_eq!(read(br#"{"max_tokens": 900}"#), (vec![800], vec![900]));
        assert_eq!(read(br#"{}"#), (vec![20], vec![20]));
    }
}
