//! The two Lua scripts, their arguments and their replies.
//!
//! `check.lua` checks and (when every limit passes) charges every key of one
//! slot group atomically; `refund.lua` gives back a charge. Both take their
//! time from Redis `TIME`, so gateway replicas with skewed clocks agree.

use std::sync::OnceLock;

use crate::keys::LimitKey;
use crate::protocol::LimitResult;

/// The check-and-consume script.
pub const CHECK_LUA: &str = include_str!("check.lua");
/// The refund script.
pub const REFUND_LUA: &str = include_str!("refund.lua");

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

/// Keys and arguments of a `check.lua` call.
///
/// `now_ms` is the **test-only** time override: `None` in the service (time
/// comes from Redis `TIME`); `Some` only in the differential tests, which
/// replay generated times. With an override the script writes keys without
/// an expiry.
pub fn check_args(
    limits: &[LimitKey],
    mode: Mode,
    now_ms: Option<u64>,
) -> (Vec<String>, Vec<String>) {
    let mut args = vec![
        match mode {
            Mode::Charge => "1".to_string(),
            Mode::Peek => "0".to_string(),
        },
        now_ms.map(|n| n.to_string()).unwrap_or_default(),
    ];
    push_limits(&mut args, limits);
    (limits.iter().map(|l| l.key.clone()).collect(), args)
}

/// Keys and arguments of a `refund.lua` call for a charge made at `charged_at_ms`
/// (the time `check.lua` returned). `now_ms` is the test-only override.
pub fn refund_args(
    limits: &[LimitKey],
    charged_at_ms: u64,
    now_ms: Option<u64>,
) -> (Vec<String>, Vec<String>) {
    let mut args = vec![
        charged_at_ms.to_string(),
        now_ms.map(|n| n.to_string()).unwrap_or_default(),
    ];
    push_limits(&mut args, limits);
    (limits.iter().map(|l| l.key.clone()).collect(), args)
}

fn push_limits(args: &mut Vec<String>, limits: &[LimitKey]) {
    for l in limits {
        args.push(l.spec.algorithm.name().to_string());
        args.push(l.spec.requests.to_string());
        args.push(l.spec.window_ms.to_string());
        args.push(l.cost.to_string());
    }
}

/// A decoded `check.lua` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReply {
    /// Every limit passed (and, in [`Mode::Charge`], was charged).
    pub allowed: bool,
    /// The Redis time the script used, in ms.
    pub now_ms: u64,
    /// One per key, in order.
    pub limits: Vec<LimitResult>,
}

/// Decodes `{all, now, (allowed, remaining, reset, retry)*}`.
pub fn parse_check_reply(reply: &[i64], keys: usize) -> Result<CheckReply, String> {
    if reply.len() != 2 + 4 * keys {
        return Err(format!(
            "check script answered {} integers for {keys} keys",
            reply.len()
        ));
    }
    let non_negative = |v: i64| u64::try_from(v).map_err(|_| format!("negative value {v}"));
    let (head, rest) = reply.split_at(2);
    let (all, now) = match head {
        [a, n] => (*a, *n),
        _ => return Err("short reply".to_string()),
    };
    let mut limits = Vec::with_capacity(keys);
    for chunk in rest.chunks_exact(4) {
        if let [a, rem, reset, retry] = chunk {
            limits.push(LimitResult {
                allowed: *a == 1,
                remaining: non_negative(*rem)?,
                reset_ms: non_negative(*reset)?,
                retry_after_ms: non_negative(*retry)?,
            });
        }
    }
    Ok(CheckReply {
        allowed: all == 1,
        now_ms: non_negative(now)?,
        limits,
    })
}
