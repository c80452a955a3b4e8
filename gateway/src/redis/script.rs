//! The three Lua scripts, their arguments and their replies.
//!
//! `check.lua` checks and (when every limit and every quota passes) charges
//! every key of one slot group atomically, keeping a reservation record when
//! asked; `refund.lua` gives back a charge; `settle.lua` moves a reserved
//! charge to the real cost, once; `lease.lua` grants a batch of one token
//! bucket's tokens. All take their
//! time from a [`Clock`]: in the service Redis `TIME`, so gateway replicas
//! with skewed clocks agree.

use std::sync::OnceLock;

use crate::clock::{self, Clock};

use crate::policy::ResolvedLease;
use crate::redis::keys::{Group, LimitKey, QuotaKey};

/// The check-and-consume script (after the shared helpers of `common.lua`:
/// Redis scripts cannot include each other).
pub const CHECK_LUA: &str = concat!(include_str!("common.lua"), include_str!("check.lua"));
/// The refund script, after `common.lua`.
pub const REFUND_LUA: &str = concat!(include_str!("common.lua"), include_str!("refund.lua"));
/// envoyproxy/ratelimit's fixed window for the rate limit service
/// (`crate::rls`), after `common.lua`: every key counted on its own.
pub const FIXED_WINDOW_LUA: &str =
    concat!(include_str!("common.lua"), include_str!("fixed_window.lua"));
/// The settle script, after `common.lua`.
pub const SETTLE_LUA: &str = concat!(include_str!("common.lua"), include_str!("settle.lua"));
/// The batch script: `check.lua` (after `common.lua`) as a function
/// `check_one(KEYS, ARGV)` of its own slice of the keys and arguments, then
/// `batch.lua`, which calls it once per check of the batch.
pub const BATCH_LUA: &str = concat!(
    "local function check_one(KEYS, ARGV)\n",
    include_str!("common.lua"),
    include_str!("check.lua"),
    "end\n",
    include_str!("batch.lua")
);
/// The lease script, after `common.lua`.
pub const LEASE_LUA: &str = concat!(include_str!("common.lua"), include_str!("lease.lua"));

/// One script: its source and its SHA1 (for `EVALSHA`).
#[derive(Debug)]
pub struct LuaScript {
    /// For logs and metrics.
    pub name: &'static str,
    /// The Lua source.
    pub source: &'static str,
    /// Hex SHA1 of the source.
    pub sha: String,
}

/// The check-and-consume script.
pub fn check() -> &'static LuaScript {
    static S: OnceLock<LuaScript> = OnceLock::new();
    S.get_or_init(|| LuaScript::new("check", CHECK_LUA))
}

/// The refund script.
pub fn refund() -> &'static LuaScript {
    static S: OnceLock<LuaScript> = OnceLock::new();
    S.get_or_init(|| LuaScript::new("refund", REFUND_LUA))
}

/// The settle script.
pub fn settle() -> &'static LuaScript {
    static S: OnceLock<LuaScript> = OnceLock::new();
    S.get_or_init(|| LuaScript::new("settle", SETTLE_LUA))
}

/// The lease script.
pub fn lease() -> &'static LuaScript {
    static S: OnceLock<LuaScript> = OnceLock::new();
    S.get_or_init(|| LuaScript::new("lease", LEASE_LUA))
}

/// The batch script: every check of a batch (of one cluster slot) in one call.
pub fn batch() -> &'static LuaScript {
    static S: OnceLock<LuaScript> = OnceLock::new();
    S.get_or_init(|| LuaScript::new("batch", BATCH_LUA))
}

/// The scripts of `/v1/*` and `/v3/check`, which every new connection loads
/// ahead of use.
pub fn all() -> [&'static LuaScript; 5] {
    [check(), refund(), settle(), lease(), batch()]
}

/// The fixed-window script of the rate limit service.
pub fn fixed_window() -> &'static LuaScript {
    static S: OnceLock<LuaScript> = OnceLock::new();
    S.get_or_init(|| LuaScript::new("fixed_window", FIXED_WINDOW_LUA))
}

impl LuaScript {
    fn new(name: &'static str, source: &'static str) -> Self {
        LuaScript {
            name,
            source,
            sha: redis::Script::new(source).get_hash().to_string(),
        }
    }
}

/// What `check.lua` should do with a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Charge every key when every limit passes.
    Charge,
    /// Evaluate only; write nothing.
    Peek,
}

/// Keys and arguments of a `check.lua` call: the limit keys, then the quota
/// key bases.
///
/// `clock` gives the time the script runs at ([`crate::clock`]; the
/// service's is Redis `TIME`).
///
/// `budget` is the most live keys `ledger` (the domain's ledger of live keys
/// in the group's slot, [`crate::redis::keys::live_ledger`]) may hold; 0: no budget.
///
/// `record` is the reservation record to write when the charge passes, and
/// its life in ms ([`crate::redis::keys::record_key`]).
///
/// `spread` (in `[0, 1)`) places a new block's end within the policy's
/// `retry_jitter` of its `block_for`, so that blocked clients come back
/// apart.
pub fn check_args(
    group: &Group,
    mode: Mode,
    clock: &dyn Clock,
    (ledger, budget): (&str, u64),
    record: Option<(&str, u64)>,
    spread: f64,
) -> (Vec<String>, Vec<String>) {
    let mut args = vec![
        match mode {
            Mode::Charge => "1".to_string(),
            Mode::Peek => "0".to_string(),
        },
        clock::script_arg(clock),
    ];
    push_limits(&mut args, &group.limits);
    for q in &group.quotas {
        args.push(q.period.name().to_string());
        args.push(q.limit.to_string());
        args.push(q.amount.to_string());
    }
    let mut keys = keys(&group.limits, &group.quotas);
    let special = push_special(&mut args, &mut keys, &group.limits, spread);
    args.push(special.to_string());
    args.push(record.map_or(0, |(_, ms)| ms.max(1)).to_string());
    args.push(budget.to_string());
    if let Some((key, _)) = record {
        keys.push(key.to_string());
    }
    keys.push(ledger.to_string());
    (keys, args)
}

/// Keys and arguments of a `batch.lua` call: the checks' own `check.lua`
/// keys and arguments ([`check_args`]), in order, laid out as its header says.
pub fn batch_args(checks: &[(Vec<String>, Vec<String>)]) -> (Vec<String>, Vec<String>) {
    let n_keys = checks.iter().map(|(k, _)| k.len()).sum();
    let n_args = checks.iter().map(|(_, a)| a.len()).sum::<usize>();
    let mut keys = Vec::with_capacity(n_keys);
    let mut args = Vec::with_capacity(1 + 2 * checks.len() + n_args);
    args.push(checks.len().to_string());
    for (k, a) in checks {
        args.push(k.len().to_string());
        args.push(a.len().to_string());
    }
    for (k, a) in checks {
        keys.extend_from_slice(k);
        args.extend_from_slice(a);
    }
    (keys, args)
}

/// One check's entry in a `batch.lua` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchEntry {
    /// `check.lua`'s reply, for [`parse_check_reply`].
    Reply(Vec<i64>),
    /// The error that ended this check (Redis's text: code, then message).
    Error(String),
}

/// Splits a `batch.lua` reply into its `checks` entries, in order.
pub fn parse_batch_reply(
    reply: Vec<redis::Value>,
    checks: usize,
) -> Result<Vec<BatchEntry>, String> {
    if reply.len() != checks {
        return Err(format!(
            "batch script answered {} entries for {checks} checks",
            reply.len()
        ));
    }
    reply
        .into_iter()
        .map(|entry| match entry {
            redis::Value::Array(_) => redis::from_redis_value::<Vec<i64>>(entry)
                .map(BatchEntry::Reply)
                .map_err(|e| format!("batch script entry: {e}")),
            redis::Value::BulkString(bytes) => Ok(BatchEntry::Error(
                String::from_utf8_lossy(&bytes).into_owned(),
            )),
            redis::Value::SimpleString(text) => Ok(BatchEntry::Error(text)),
            other => Err(format!("batch script entry {other:?}")),
        })
        .collect()
}

/// Keys and arguments of a `refund.lua` call for a charge made at `charged_at_ms`
/// (the time `check.lua` returned), at the time `clock` gives.
/// `record`: the reservation record the charge wrote, deleted with it.
pub fn refund_args(
    group: &Group,
    charged_at_ms: u64,
    clock: &dyn Clock,
    record: Option<&str>,
) -> (Vec<String>, Vec<String>) {
    let mut args = vec![charged_at_ms.to_string(), clock::script_arg(clock)];
    push_limits(&mut args, &group.limits);
    for q in &group.quotas {
        args.push(q.period.name().to_string());
        args.push(q.amount.to_string());
    }
    let mut keys = keys(&group.limits, &group.quotas);
    keys.extend(record.map(str::to_string));
    (keys, args)
}

/// Keys and arguments of a `settle.lua` call: the group's limits with the
/// real cost as their cost, its quotas with the real amount, the
/// reservation record of the group's slot, and the slot's ledger of live
/// keys with its budget (0: none kept).
pub fn settle_args(
    group: &Group,
    clock: &dyn Clock,
    record: &str,
    (ledger, budget): (&str, u64),
) -> (Vec<String>, Vec<String>) {
    let mut args = vec![budget.to_string(), clock::script_arg(clock)];
    push_limits(&mut args, &group.limits);
    for q in &group.quotas {
        args.push(q.period.name().to_string());
        args.push(q.amount.to_string());
    }
    let mut keys = keys(&group.limits, &group.quotas);
    keys.push(record.to_string());
    keys.push(ledger.to_string());
    (keys, args)
}

/// Decodes `settle.lua`'s `{found, keys changed}`: whether the record was there.
pub fn parse_settle_reply(reply: &[i64]) -> Result<bool, String> {
    match reply {
        [found, changed] if *changed >= 0 => Ok(*found == 1),
        _ => Err(format!("settle script answered {reply:?}")),
    }
}

/// Arguments of a `lease.lua` call (its keys are [`crate::redis::keys::lease_keys`]
/// and the caller's [`crate::redis::keys::ledger_key`]): the time `clock` gives, want,
/// return, the ledger's life (twice the policy's `lease.ttl_ms`: a batch's
/// unspent tokens come back after it expired), then per limit requests and
/// window_ms.
pub fn lease_args(req: &ResolvedLease, clock: &dyn Clock) -> Vec<String> {
    let mut args = Vec::with_capacity(4 + 2 * req.limits.len());
    args.push(clock::script_arg(clock));
    args.push(req.want.to_string());
    args.push(req.returned.to_string());
    args.push(req.ttl_ms.saturating_mul(2).max(1).to_string());
    for l in &req.limits {
        args.push(l.requests.to_string());
        args.push(l.window_ms.to_string());
    }
    args
}

fn keys(limits: &[LimitKey], quotas: &[QuotaKey]) -> Vec<String> {
    limits
        .iter()
        .map(|l| l.key.clone())
        .chain(quotas.iter().map(|q| q.base.clone()))
        .collect()
}

/// `L`, then per limit: algorithm, requests, window_ms, cost, ceiling.
fn push_limits(args: &mut Vec<String>, limits: &[LimitKey]) {
    args.push(limits.len().to_string());
    for l in limits {
        args.push(l.spec.counter().to_string());
        args.push(l.spec.requests.to_string());
        args.push(l.spec.window_ms.to_string());
        args.push(l.cost.to_string());
        let burst = l.graduated.as_ref().map_or(0, |g| g.stages.burst);
        args.push(
            ceiling(&l.spec, l.debt)
                .max(full_ms(&l.spec, burst))
                .to_string(),
        );
    }
}

/// Ms a token bucket of `burst` tokens (at the limit's rate) takes to fill:
/// a graduated bucket holds more than the limit, and reads as far ahead.
fn full_ms(spec: &crate::protocol::Limit, burst: u64) -> u64 {
    let (w, c) = (u128::from(spec.window_ms), u128::from(spec.requests.max(1)));
    u64::try_from((w * u128::from(burst)).div_ceil(c)).unwrap_or(u64::MAX)
}

/// `check.lua`'s special limits (watched or graduated): six arguments
/// each, and a graduated one's demand and block keys. Their number.
fn push_special(
    args: &mut Vec<String>,
    keys: &mut Vec<String>,
    limits: &[LimitKey],
    spread: f64,
) -> usize {
    let mut n = 0;
    for (i, l) in limits.iter().enumerate() {
        if !l.watched && l.graduated.is_none() {
            continue;
        }
        n += 1;
        args.push((i + 1).to_string());
        args.push(if l.watched { "1" } else { "0" }.to_string());
        match &l.graduated {
            Some(g) => {
                let s = &g.stages;
                let jitter = (s.jitter_ms as f64 * spread.clamp(0.0, 1.0)) as u64;
                args.push(s.burst.to_string());
                args.push(s.demand.to_string());
                args.push(s.block_for_ms.saturating_add(jitter).max(1).to_string());
                args.push(
                    s.block_for_ms
                        .saturating_add(s.jitter_ms)
                        .max(1)
                        .to_string(),
                );
                keys.push(g.demand.clone());
                keys.push(g.block.clone());
            }
            None => args.extend(["0", "0", "0", "0"].map(str::to_string)),
        }
    }
    n
}

/// How many of `limits` are special to `check.lua` (watched or graduated):
/// its reply has a stage for each.
pub fn special_count(limits: &[LimitKey]) -> usize {
    limits
        .iter()
        .filter(|l| l.watched || l.graduated.is_some())
        .count()
}

/// How far ahead of now (ms) a token bucket's TAT may stand: its window,
/// plus the time `debt` tokens take to refill, at most what keeps
/// `ceiling × requests` within 2^53 (the scripts' exact integers).
pub fn ceiling(spec: &crate::protocol::Limit, debt: u64) -> u64 {
    let (w, c) = (u128::from(spec.window_ms), u128::from(spec.requests.max(1)));
    let wanted = w + (u128::from(debt) * w).div_ceil(c);
    let exact = u128::from(crate::protocol::MAX_EXACT) / c;
    u64::try_from(wanted.min(exact.max(w))).unwrap_or(spec.window_ms)
}

/// One limit's verdict from `check.lua` (the answer adds the limit itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitVerdict {
    /// Whether this limit alone lets the cost through.
    pub allowed: bool,
    /// Whole tokens left.
    pub remaining: u64,
    /// Ms until the limit holds nothing back.
    pub reset_ms: u64,
    /// Ms until the cost would pass.
    pub retry_after_ms: u64,
}

/// What `check.lua` says of a special limit (watched or graduated).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageVerdict {
    /// Whole tokens in use (after the request when it passed).
    pub used: u64,
    /// The client is blocked.
    pub blocked: bool,
}

/// One quota's verdict from `check.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaVerdict {
    /// Whether this quota alone lets the amount through.
    pub allowed: bool,
    /// Amount left in the period.
    pub remaining: u64,
    /// Ms until the period ends.
    pub reset_ms: u64,
}

/// A decoded `check.lua` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReply {
    /// Every limit and quota passed (and, in [`Mode::Charge`], was charged).
    pub allowed: bool,
    /// The Redis time the script used, in ms.
    pub now_ms: u64,
    /// One per limit key, in order.
    pub limits: Vec<LimitVerdict>,
    /// One per quota, in order.
    pub quotas: Vec<QuotaVerdict>,
    /// One per special limit of the group ([`special_count`]), in order.
    pub stages: Vec<StageVerdict>,
}

/// Decodes `{all, now, (allowed, remaining, reset, retry)*L, (allowed,
/// remaining, reset)*Q, (used, blocked)*S}`.
pub fn parse_check_reply(
    reply: &[i64],
    limits: usize,
    quotas: usize,
    special: usize,
) -> Result<CheckReply, String> {
    if reply.len() != 2 + 4 * limits + 3 * quotas + 2 * special {
        return Err(format!(
            "check script answered {} integers for {limits} limits, {quotas} quotas and \
             {special} special limits",
            reply.len()
        ));
    }
    let non_negative = |v: i64| u64::try_from(v).map_err(|_| format!("negative value {v}"));
    let (head, rest) = reply.split_at(2);
    let (all, now) = match head {
        [a, n] => (*a, *n),
        _ => return Err("short reply".to_string()),
    };
    let Some((limit_part, rest)) = rest.split_at_checked(4 * limits) else {
        return Err("short reply".to_string());
    };
    let Some((quota_part, stage_part)) = rest.split_at_checked(3 * quotas) else {
        return Err("short reply".to_string());
    };
    let mut out = CheckReply {
        allowed: all == 1,
        now_ms: non_negative(now)?,
        limits: Vec::with_capacity(limits),
        quotas: Vec::with_capacity(quotas),
        stages: Vec::with_capacity(special),
    };
    for chunk in stage_part.chunks_exact(2) {
        if let [used, blocked] = chunk {
            out.stages.push(StageVerdict {
                used: non_negative(*used)?,
                blocked: *blocked == 1,
            });
        }
    }
    for chunk in limit_part.chunks_exact(4) {
        if let [a, rem, reset, retry] = chunk {
            out.limits.push(LimitVerdict {
                allowed: *a == 1,
                remaining: non_negative(*rem)?,
                reset_ms: non_negative(*reset)?,
                retry_after_ms: non_negative(*retry)?,
            });
        }
    }
    for chunk in quota_part.chunks_exact(3) {
        if let [a, rem, reset] = chunk {
            out.quotas.push(QuotaVerdict {
                allowed: *a == 1,
                remaining: non_negative(*rem)?,
                reset_ms: non_negative(*reset)?,
            });
        }
    }
    Ok(out)
}

/// One limit of a decoded `lease.lua` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseVerdict {
    /// Whole tokens left after the grant.
    pub remaining: u64,
    /// Ms until the limit is full again.
    pub reset_ms: u64,
    /// Ms until 1 token is free (0 when something was granted).
    pub retry_after_ms: u64,
}

/// A decoded `lease.lua` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReply {
    /// Tokens granted.
    pub granted: u64,
    /// Tokens taken back (the return, capped at what the caller held).
    pub taken_back: u64,
    /// One per limit, in order.
    pub limits: Vec<LeaseVerdict>,
}

/// Decodes `lease.lua`'s `{granted, taken back, (remaining, reset, retry)*L}`.
pub fn parse_lease_reply(reply: &[i64], limits: usize) -> Result<LeaseReply, String> {
    if reply.len() != 2 + 3 * limits {
        return Err(format!(
            "lease script answered {} integers for {limits} limits",
            reply.len()
        ));
    }
    let non_negative = |v: i64| u64::try_from(v).map_err(|_| format!("negative value {v}"));
    let (head, rest) = reply.split_at(2);
    let [granted, taken_back] = head else {
        return Err("short reply".to_string());
    };
    let mut out = LeaseReply {
        granted: non_negative(*granted)?,
        taken_back: non_negative(*taken_back)?,
        limits: Vec::with_capacity(limits),
    };
    for chunk in rest.chunks_exact(3) {
        if let [remaining, reset, retry] = chunk {
            out.limits.push(LeaseVerdict {
                remaining: non_negative(*remaining)?,
                reset_ms: non_negative(*reset)?,
                retry_after_ms: non_negative(*retry)?,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{FixedClock, RedisTime};
    use crate::protocol::{Algorithm, Limit};

    #[test]
    fn lease_args_layout() {
        let tb = |requests, window_ms| Limit {
            requests,
            window_ms,
            algorithm: Algorithm::TokenBucket,
            in_flight: false,
        };
        let req = ResolvedLease {
            domain: "d".to_string(),
            key: "k".to_string(),
            tag: "t".to_string(),
            limits: vec![tb(10, 60_000), tb(3, 1000)],
            want: 5,
            returned: 2,
            ttl_ms: 2000,
        };
        assert_eq!(
            lease_args(&req, &RedisTime),
            ["", "5", "2", "4000", "10", "60000", "3", "1000"]
        );
        assert_eq!(lease_args(&req, &FixedClock(1234))[0], "1234");
    }

    #[test]
    fn batch_args_layout() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let checks = [
            (s(&["k1", "ledger"]), s(&["1", "", "1", "a", "b"])),
            (s(&["k2", "k3", "ledger"]), s(&["1", "", "2"])),
        ];
        let (keys, args) = batch_args(&checks);
        assert_eq!(keys, s(&["k1", "ledger", "k2", "k3", "ledger"]));
        assert_eq!(
            args,
            s(&["2", "2", "5", "3", "3", "1", "", "1", "a", "b", "1", "", "2"])
        );
    }

    #[test]
    fn batch_replies() {
        use redis::Value;
        let reply = vec![
            Value::Array(vec![Value::Int(1), Value::Int(5)]),
            Value::BulkString(b"KEYBUDGET ratelimit: 2 live keys of 2, 1 more refused".to_vec()),
        ];
        assert_eq!(
            parse_batch_reply(reply.clone(), 2).unwrap(),
            [
                BatchEntry::Reply(vec![1, 5]),
                BatchEntry::Error(
                    "KEYBUDGET ratelimit: 2 live keys of 2, 1 more refused".to_string()
                ),
            ]
        );
        assert_eq!(
            parse_batch_reply(reply, 3).unwrap_err(),
            "batch script answered 2 entries for 3 checks"
        );
        assert!(parse_batch_reply(vec![Value::Int(1)], 1).is_err());
    }

    /// Lua 5.1 allows 200 locals in one function, and `check_one` holds
    /// every top-level local of `common.lua` and `check.lua` (and their
    /// blocks' own while they run): this keeps a wide margin.
    #[test]
    fn the_batch_wrapper_stays_within_lua_locals() {
        let top_level: usize = [include_str!("common.lua"), include_str!("check.lua")]
            .iter()
            .flat_map(|f| f.lines())
            .filter_map(|l| l.strip_prefix("local "))
            .map(|l| {
                let names = l.strip_prefix("function ").unwrap_or(l);
                let names = names.split(['=', '(']).next().unwrap_or_default();
                names.split(',').filter(|n| !n.trim().is_empty()).count()
            })
            .sum();
        assert!(top_level > 40, "{top_level}: the count reads the files");
        assert!(
            top_level <= 120,
            "{top_level} top-level locals in check_one"
        );
    }

    #[test]
    fn the_batch_script_wraps_check_lua_whole() {
        assert!(BATCH_LUA.starts_with("local function check_one(KEYS, ARGV)\n"));
        assert!(BATCH_LUA.contains(CHECK_LUA));
        assert!(BATCH_LUA.contains("\nend\n-- ratelimit-gateway: the checks of one batch"));
    }

    #[test]
    fn lease_replies() {
        let r = parse_lease_reply(&[2, 1, 0, 60_000, 0, 7, 18_000, 0], 2).unwrap();
        assert_eq!((r.granted, r.taken_back), (2, 1));
        assert_eq!(
            r.limits,
            [
                LeaseVerdict {
                    remaining: 0,
                    reset_ms: 60_000,
                    retry_after_ms: 0
                },
                LeaseVerdict {
                    remaining: 7,
                    reset_ms: 18_000,
                    retry_after_ms: 0
                },
            ]
        );
        assert_eq!(
            parse_lease_reply(&[2, 0, 0, 1], 1).unwrap_err(),
            "lease script answered 4 integers for 1 limits"
        );
        assert_eq!(
            parse_lease_reply(&[0, 0, 0, -1, 0], 1).unwrap_err(),
            "negative value -1"
        );
    }
}
