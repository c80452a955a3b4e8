//! `decide`: the whole filter with random host events, at the pure-logic level.
//! `decide::start` / `decide::finish` over a `MemoryStore` wrapped to inject CAS conflicts
//! (another writer came first) and store failures, with an arbitrary sequence of requests,
//! clock jumps forward and back, callouts answered (well-formed, inconsistent or garbage),
//! failed, or never, and corrupted shared data.
//!
//! Checked on every outcome: a rejection is 403, 429 or 503 with a JSON problem body and a
//! whole-second `Retry-After` (429/503); no header value can split a header; a delay is
//! positive. And the admission bound, for the configurations with one enforced local rule
//! of N per hour keyed on the client (alone, or next to global rules and a quota):
//!
//! - token bucket: a client's admissions (verdict pass or delay, no store error) never
//!   exceed `N + N × (latest time − client's first request time) / 1 h`: exactly N at a
//!   constant time, and nothing extra from a clock going backwards;
//! - sliding window, clock steps back included: at most N per fixed window of the
//!   limiter's clock, on which a charge falls in its own window or, when the clock stepped
//!   back behind the window last charged, in that one (refunded charges not counted).
//!
//! The bound is not checked after an eviction or a corrupted set (both reset buckets by
//! design), nor for a sliding window after a store failure (which charges it leaves is
//! then unknown).

use crate::input::Input;
use crate::request_gen;
use ratelimit_wasm::decide::{self, Outcome, Pending, Step, Verdict};
use ratelimit_wasm::limits::store::{MemoryStore, SharedStore, StoreError};
use ratelimit_wasm::metrics::Metric;
use ratelimit_wasm::policy::plan::Plan;
use ratelimit_wasm::policy::request::RequestInfo;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

const SEC: u64 = 1_000_000_000;
const HOUR: u64 = 3600 * SEC;
const T0: u64 = 1_700_000_000 * SEC;
/// Most operations per input, so that one execution stays fast.
const MAX_OPS: usize = 300;

/// `MemoryStore` that can be told to lose the next CAS writes to "another worker" (the
/// value is rewritten as it was, which moves its version) or to fail calls outright.
#[derive(Default)]
pub struct FlakyStore {
    pub inner: MemoryStore,
    pub conflicts: Cell<u32>,
    pub failures: Cell<u32>,
    pub keys: RefCell<Vec<String>>,
}

impl FlakyStore {
    fn fail(&self) -> Result<(), StoreError> {
        match self.failures.get() {
            0 => Ok(()),
            n => {
                self.failures.set(n - 1);
                Err(StoreError(1))
            }
        }
    }
}

impl SharedStore for FlakyStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.fail()?;
        self.inner.get(key)
    }

    fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError> {
        self.fail()?;
        if self.conflicts.get() > 0 {
            if let Some((current, _)) = self.inner.get(key)? {
                self.conflicts.set(self.conflicts.get() - 1);
                self.inner.compare_and_set(key, &current, 0)?;
                return Ok(false);
            }
        }
        let written = self.inner.compare_and_set(key, value, cas)?;
        if written && !self.keys.borrow().iter().any(|k| k == key) {
            self.keys.borrow_mut().push(key.to_string());
        }
        Ok(written)
    }
}

/// What the input asks for.
pub struct Scenario {
    pub config: String,
    /// The rule "hour" (index 0) is enforced for every request, with this limit.
    pub bounded: Option<u64>,
    pub sliding: bool,
}

impl Scenario {
    pub fn read(inp: &mut Input) -> Scenario {
        let kind = inp.below(3);
        // At least 2: `/search` costs 2, and a cost above a rule's capacity is refused at load.
        let n = 2 + inp.below(7) as u64;
        let sliding = inp.bool();
        let algorithm = if sliding {
            "sliding_window"
        } else {
            "token_bucket"
        };
        let on_error = inp.pick(&["allow", "deny"]);
        let jitter = inp.pick(&["0", "0.1", "0.5"]);
        let mode = inp.pick(&["open", "closed", "local"]);
        let instances = 1 + inp.below(3);
        let failures = 1 + inp.below(5);
        let latency_ms = inp.pick(&[0, 1, 100]);
        let cooldown_ms = inp.pick(&[1, 2000, 60_000]);
        let global = format!(
            r#""global": {{ "cluster": "gw", "timeout_ms": 50, "failure_mode": "{mode}",
              "instances": {instances}, "circuit": {{ "failures": {failures},
              "latency_ms": {latency_ms}, "cooldown_ms": {cooldown_ms} }} }}"#
        );
        let hour = format!(
            r#"{{ "name": "hour", "algorithm": "{algorithm}", "key": ["client"],
                 "limits": [ {{ "requests": {n}, "per": "1h" }} ] }}"#
        );
        let common = format!(
            r#""domain": "fuzz", "on_error": "{on_error}", "response": {{ "retry_jitter": {jitter} }},
               "costs": [ {{ "match": {{ "path_prefix": "/search" }}, "cost": 2 }} ]"#
        );
        let config = match kind {
            0 => format!(r#"{{ {common}, "rules": [ {hour} ] }}"#),
            1 => format!(
                r#"{{ {common}, {global},
                  "tiers": {{ "free": {{}}, "pro": {{}} }},
                  "identity": {{ "default_tier": "free", "tier_header": "x-tier" }},
                  "rules": [ {hour},
                    {{ "name": "g", "scope": "global", "key": ["client"],
                       "limits": [ {{ "requests": 3, "per": "1m" }}, {{ "requests": 2, "per": "1s" }} ] }},
                    {{ "name": "g-up", "scope": "global", "algorithm": "sliding_window",
                       "match": {{ "path_prefix": "/upload" }}, "key": ["client", "path"],
                       "limits": [ {{ "requests": 2, "per": "1h" }} ] }} ],
                  "quotas": [ {{ "name": "monthly", "key": ["client"], "period": "month",
                    "tiers": {{ "free": 5 }}, "count": "cost",
                    "upgrade_url": "https://example.com/upgrade" }} ] }}"#
            ),
            _ => format!(
                r#"{{ {common}, {global}, "max_buckets": 64,
                  "tiers": {{ "free": {{}}, "pro": {{}}, "staff": {{ "unlimited": true }} }},
                  "identity": {{ "default_tier": "free", "tier_header": "x-tier", "trusted_proxy_hops": 1,
                    "clients": {{ "alice": {{ "tier": "pro", "limits": {{ "grad": [ {{ "requests": 4, "per": "10s" }} ] }} }},
                                 "trial": {{ "soft": true }}, "root": {{ "unlimited": true }},
                                 "big": {{ "quotas": {{ "monthly": 2 }} }} }} }},
                  "rules": [ {hour},
                    {{ "name": "grad", "key": ["client"], "limits": [ {{ "requests": 3, "per": "10s" }} ],
                       "tiers": {{ "pro": [ {{ "requests": 6, "per": "10s" }} ] }},
                       "graduated": {{ "warn_at": 0.5, "delay_at": 0.8, "delay_ms": 30, "reject_at": 1.5,
                                      "block_at": 2.5, "block_for": "1m" }} }},
                    {{ "name": "watch", "mode": "shadow", "key": ["ip"], "limits": [ {{ "requests": 2, "per": "1m" }} ] }},
                    {{ "name": "sw", "algorithm": "sliding_window", "match": {{ "methods": ["POST"] }},
                       "key": ["method", "header:x-tenant"], "limits": [ {{ "requests": 3, "per": "1s" }}, {{ "requests": 5, "per": "1m" }} ] }},
                    {{ "name": "g", "scope": "global", "key": ["client", "path"],
                       "limits": [ {{ "requests": 3, "per": "1m" }} ], "tiers": {{ "pro": [ {{ "requests": 9, "per": "1m" }} ] }} }} ],
                  "quotas": [ {{ "name": "monthly", "key": ["client"], "period": "day",
                    "tiers": {{ "free": 5, "pro": 50 }}, "count": "cost",
                    "upgrade_url": "https://example.com/upgrade" }} ] }}"#
            ),
        };
        Scenario {
            config,
            bounded: (kind < 2).then_some(n),
            sliding,
        }
    }
}

const CLIENTS: &[&[u8]] = &[b"alice", b"bob", b"trial", b"root", b"big"];

fn request(plan: &Plan, inp: &mut Input) -> RequestInfo {
    let req = RequestInfo::from_headers(&plan.header_names, |n| match n {
        ":method" => Some(inp.pick(&[&b"GET"[..], b"POST"]).to_vec()),
        ":path" => match inp.below(4) {
            0 => Some(b"/".to_vec()),
            1 => Some(b"/search?q=1".to_vec()),
            2 => Some(b"/upload/a".to_vec()),
            _ => request_gen::value(inp),
        },
        "x-client-id" => match inp.below(8) {
            0 | 1 => None,
            2 => request_gen::value(inp),
            i => Some(CLIENTS[i - 3].to_vec()),
        },
        _ => request_gen::value(inp),
    });
    let source_address = match inp.below(4) {
        0 => request_gen::source(inp),
        1 => Some(b"10.0.0.2:1".to_vec()),
        _ => Some(b"10.0.0.1:1".to_vec()),
    };
    RequestInfo {
        source_address,
        ..req
    }
}

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "-1",
    "0.5",
    "1e300",
    "-1e300",
    "60000",
    "3600000",
    "18446744073709551615",
    "9007199254740993",
];

/// A gateway answer for `req`: well-formed, inconsistent, of another version, cut short, or
/// garbage.
fn answer(plan: &Plan, req: &RequestInfo, inp: &mut Input) -> (Option<Vec<u8>>, Vec<u8>) {
    let status = match inp.below(8) {
        0 => None,
        6 => Some(b"503".to_vec()),
        7 => Some(inp.short_bytes().to_vec()),
        _ => Some(b"200".to_vec()),
    };
    let kind = inp.below(8);
    if kind == 0 {
        return (status, inp.short_bytes().to_vec());
    }
    let eval = plan.evaluate(req);
    let mut all = true;
    let num = |inp: &mut Input| {
        if inp.below(4) == 0 {
            inp.pick(NUMBERS).to_string()
        } else {
            inp.below(100).to_string()
        }
    };
    let skew = |inp: &mut Input, n: usize| match (kind, inp.below(4)) {
        (2, 0) => n + 1,
        (2, 1) => n.saturating_sub(1),
        _ => n,
    };
    let buckets: Vec<String> = (0..skew(inp, eval.global.len()))
        .map(|i| {
            let want = eval
                .global
                .get(i)
                .map_or(1, |g| plan.limits(g.rule, g.variant).len());
            let limits: Vec<String> = (0..skew(inp, want))
                .map(|_| {
                    let allowed = inp.below(4) != 0;
                    all &= allowed;
                    format!(
                        r#"{{"allowed":{allowed},"remaining":{},"reset_ms":{},"retry_after_ms":{}}}"#,
                        num(inp),
                        num(inp),
                        num(inp)
                    )
                })
                .collect();
            format!(r#"{{"limits":[{}]}}"#, limits.join(","))
        })
        .collect();
    let quotas: Vec<String> = (0..skew(inp, eval.quotas.len()))
        .map(|_| {
            let allowed = inp.below(3) != 0;
            all &= allowed;
            format!(
                r#"{{"allowed":{allowed},"remaining":{},"reset_ms":{}}}"#,
                num(inp),
                num(inp)
            )
        })
        .collect();
    let version = if kind == 3 { 2 } else { 1 };
    let allowed = if kind == 4 { !all } else { all };
    let mut body = format!(
        r#"{{"version":{version},"allowed":{allowed},"buckets":[{}],"quotas":[{}]}}"#,
        buckets.join(","),
        quotas.join(",")
    )
    .into_bytes();
    if kind == 5 {
        body.truncate(inp.below(body.len() + 1));
    }
    (status, body)
}

fn check_headers<N: AsRef<str>>(lines: &[(N, String)]) {
    for (name, value) in lines {
        let name = name.as_ref();
        assert!(
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'),
            "header name {name:?}"
        );
        assert!(
            !value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0),
            "header {name}: {value:?}"
        );
    }
}

fn check_outcome(plan: &Plan, o: &Outcome) {
    match &o.verdict {
        Verdict::Pass(lines) => check_headers(&lines.lines(plan)),
        Verdict::Delay { ms, headers } => {
            assert!(*ms > 0, "{o:?}");
            check_headers(&headers.lines(plan));
        }
        Verdict::Reject {
            status,
            headers,
            body,
        } => {
            assert!(matches!(status, 403 | 429 | 503), "{o:?}");
            let lines = headers.lines();
            check_headers(&lines);
            let problem: serde_json::Value =
                serde_json::from_str(body).unwrap_or_else(|e| panic!("problem body {e}: {body}"));
            assert_eq!(problem["status"], *status, "{body}");
            let retry: Vec<&String> = lines
                .iter()
                .filter(|(n, _)| *n == "retry-after")
                .map(|(_, v)| v)
                .collect();
            // A 403, and a 429 whose cost is above a limit's capacity, promise no wait.
            let never = problem["detail"]
                .as_str()
                .is_some_and(|d| d.ends_with("it can never pass."));
            if *status == 403 || never {
                assert!(retry.is_empty(), "{o:?}");
            } else {
                assert_eq!(retry.len(), 1, "{o:?}");
                let secs: u64 = retry[0].parse().unwrap_or_else(|_| panic!("{o:?}"));
                assert!(secs >= 1, "{o:?}");
            }
        }
    }
}

/// Admissions per bucket of the bounded rule.
#[derive(Default)]
struct Bound {
    /// fingerprint → (admitted, time of the client's first request)
    clients: HashMap<u64, (u64, u64)>,
    /// fingerprint → the window last charged (sliding window)
    charged: HashMap<u64, u64>,
    /// (fingerprint, window) → admitted in that window of the limiter's clock
    per_window: HashMap<(u64, u64), u64>,
    latest: u64,
    tainted: bool,
    store_failed: bool,
}

impl Bound {
    fn saw_time(&mut self, now: u64) {
        self.latest = self.latest.max(now);
    }

    /// The bounded rule charged `req` at `now`: the window of the limiter's clock it
    /// falls in (never before the window last charged).
    fn charge(&mut self, plan: &Plan, req: &RequestInfo, now: u64) -> Option<u64> {
        let fp = Self::fingerprint(plan, req)?;
        let w = self.charged.entry(fp).or_insert(0);
        *w = (*w).max(now / HOUR);
        Some(*w)
    }

    fn fingerprint(plan: &Plan, req: &RequestInfo) -> Option<u64> {
        let eval = plan.evaluate(req);
        eval.buckets
            .iter()
            .find(|b| b.rule == 0)
            .map(|b| b.fingerprint)
    }

    fn started(&mut self, plan: &Plan, req: &RequestInfo, now: u64) {
        self.saw_time(now);
        if let Some(fp) = Self::fingerprint(plan, req) {
            let c = self.clients.entry(fp).or_insert((0, now));
            c.1 = c.1.min(now);
        }
    }

    fn outcome(
        &mut self,
        sc: &Scenario,
        plan: &Plan,
        req: &RequestInfo,
        o: &Outcome,
        window: Option<u64>,
    ) {
        check_outcome(plan, o);
        if o.counts.get(Metric::Evictions) > 0 || o.counts.get(Metric::CorruptState) > 0 {
            self.tainted = true;
        }
        self.store_failed |= o.error.is_some();
        let admitted = matches!(o.verdict, Verdict::Pass(_) | Verdict::Delay { .. });
        let Some(n) = sc.bounded else { return };
        let Some(fp) = Self::fingerprint(plan, req) else {
            return;
        };
        if !admitted || o.error.is_some() {
            return;
        }
        let (count, first) = self.clients.get_mut(&fp).expect("started");
        *count += 1;
        if self.tainted {
            return;
        }
        if sc.sliding {
            let Some(w) = window else { return };
            let in_window = self.per_window.entry((fp, w)).or_insert(0);
            *in_window += 1;
            assert!(
                self.store_failed || *in_window <= n,
                "admitted {in_window} > N={n} in window {w} of the limiter's clock"
            );
            return;
        }
        let bound =
            n + (u128::from(n) * u128::from(self.latest - *first) / u128::from(HOUR)) as u64;
        assert!(
            *count <= bound,
            "admitted {count} > bound {bound} (N={n}, first {}, latest {})",
            *first,
            self.latest
        );
    }
}

pub fn run(data: &[u8]) {
    let mut inp = Input::new(data);
    let sc = Scenario::read(&mut inp);
    let cfg = ratelimit_wasm::config::parse(sc.config.as_bytes())
        .unwrap_or_else(|e| panic!("the decide config does not parse: {e}\n{}", sc.config));
    let plan = Plan::compile(&cfg, [5; 16]);
    let store = FlakyStore::default();
    let mut now = T0;
    let mut pending: Vec<(RequestInfo, Box<Pending>, u64, Option<u64>)> = Vec::new();
    let mut bound = Bound::default();
    for _ in 0..MAX_OPS {
        if inp.is_empty() {
            break;
        }
        match inp.below(12) {
            0..=3 => {
                let req = request(&plan, &mut inp);
                bound.started(&plan, &req, now);
                match decide::start(&plan, &req, &store, now, inp.u64()) {
                    Step::Done(o) => {
                        let passed = matches!(o.verdict, Verdict::Pass(_) | Verdict::Delay { .. });
                        let window = if passed {
                            bound.charge(&plan, &req, now)
                        } else {
                            None
                        };
                        bound.outcome(&sc, &plan, &req, &o, window);
                    }
                    Step::Call(p) => {
                        assert!(!p.body.is_empty());
                        // The local rules were charged before the call.
                        let window = bound.charge(&plan, &req, now);
                        pending.push((req, p, now, window));
                    }
                }
            }
            4 | 5 if !pending.is_empty() => {
                let (req, p, sent, window) = pending.remove(inp.below(pending.len()));
                let (status, body) = answer(&plan, &req, &mut inp);
                bound.saw_time(now);
                let o = decide::finish(
                    &plan,
                    *p,
                    status.as_deref(),
                    &body,
                    now.saturating_sub(sent),
                    &store,
                    now,
                );
                bound.outcome(&sc, &plan, &req, &o, window);
            }
            6 => now = now.saturating_add(u64::from(inp.u16()) * 1_000_000),
            7 => now = now.saturating_add(u64::from(inp.u8()) * 60 * SEC),
            8 => now = now.saturating_sub(u64::from(inp.u16()) * 1_000_000),
            9 => now = now.saturating_sub(u64::from(inp.u8()) * 60 * SEC),
            10 => {
                if inp.below(4) == 0 {
                    store.failures.set(u32::from(inp.u8() % 4));
                } else {
                    store.conflicts.set(u32::from(inp.u8() % 48));
                }
                // A failure, or more conflicts than a CAS loop retries, can leave a charge
                // the outcome does not show.
                let limit = ratelimit_wasm::limits::limiter::MAX_ATTEMPTS;
                bound.store_failed |= store.failures.get() > 0 || store.conflicts.get() >= limit;
            }
            _ => {
                // Someone else's bytes in one of our keys.
                let keys = store.keys.borrow().clone();
                if !keys.is_empty() {
                    let key = &keys[inp.below(keys.len())];
                    let garbage = inp.short_bytes().to_vec();
                    let _ = store.inner.compare_and_set(key, &garbage, 0);
                    bound.tainted = true;
                }
            }
        }
    }
    // Callouts still in flight end without an answer.
    for (req, p, sent, window) in pending {
        let o = decide::finish(&plan, *p, None, b"", now.saturating_sub(sent), &store, now);
        bound.outcome(&sc, &plan, &req, &o, window);
    }
}
