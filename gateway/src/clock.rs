//! The time the Lua scripts run at, behind one trait.
//!
//! The service reads Redis `TIME` inside each script ([`RedisTime`]), so
//! gateway replicas with skewed clocks agree. A [`FixedClock`] hands the
//! scripts a time instead: the differential and quota-period tests replay
//! generated times or step into the next minute, day or month with it. Either
//! way every key gets an expiry (`common.lua`'s `ttl`: at a given time at
//! least a day of Redis time), so no clock can write a key that never expires.

/// Where the scripts take "now" from.
pub trait Clock: Send + Sync {
    /// The time in ms since the epoch the scripts run at; `None`: each
    /// script reads Redis `TIME` itself.
    fn now_ms(&self) -> Option<u64>;
}

/// Redis `TIME`, read inside each script: the service's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct RedisTime;

impl Clock for RedisTime {
    fn now_ms(&self) -> Option<u64> {
        None
    }
}

/// One time in ms since the epoch, for every script call.
#[derive(Debug, Clone, Copy)]
pub struct FixedClock(pub u64);

impl Clock for FixedClock {
    fn now_ms(&self) -> Option<u64> {
        Some(self.0)
    }
}

/// The scripts' time argument: "" for Redis `TIME`, else the time in ms.
pub(crate) fn script_arg(clock: &dyn Clock) -> String {
    clock.now_ms().map(|n| n.to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_argument_is_empty_for_redis_time_and_the_ms_otherwise() {
        assert_eq!(script_arg(&RedisTime), "");
        assert_eq!(script_arg(&FixedClock(1_767_225_600_000)), "1767225600000");
    }
}
