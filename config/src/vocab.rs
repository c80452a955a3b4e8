//! The configuration's vocabularies, each an enum whose names are written in
//! one exhaustive `match`: reading a name is finding it in `ALL`, so adding a
//! variant is one line and the compiler points at every `match` to extend.
//! (Serde's `rename_all` gives the protocol the same names; the tests check
//! that the two agree.)

use serde::{Deserialize, Serialize};

/// How a limit counts (a rule's `algorithm`, on the wire, in Redis keys and in
/// the Lua scripts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// GCRA token bucket: bursts up to `requests`, refilled continuously over the window.
    #[default]
    TokenBucket,
    /// Sliding-window counter: about `requests` in any window.
    SlidingWindow,
}

impl Algorithm {
    /// Every algorithm, in the order error messages list them.
    pub const ALL: [Algorithm; 2] = [Algorithm::TokenBucket, Algorithm::SlidingWindow];

    /// The names of [`Self::ALL`], in its order, for the reader's error messages.
    // Evaluated when compiling: an index out of range fails the build.
    #[allow(clippy::indexing_slicing)]
    pub const NAMES: [&'static str; 2] = {
        let mut names = [""; 2];
        let mut i = 0;
        while i < names.len() {
            names[i] = Self::ALL[i].name();
            i += 1;
        }
        names
    };

    /// The name in configuration, on the wire, in Redis keys and in the Lua scripts.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::SlidingWindow => "sliding_window",
        }
    }

    /// The algorithm named `name`, if any.
    pub fn from_name(name: &str) -> Option<Algorithm> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// How a `rate_limit` of the gateway's RLS configuration counts: envoyproxy/
/// ratelimit's fixed window, or one of the gateway's exact [`Algorithm`]s
/// (whose names it shares). The filter runs only the latter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RlsAlgorithm {
    /// envoyproxy/ratelimit's: a counter per window aligned to the unit
    /// (`floor(now / unit)`), incremented by every hit, over when it passes
    /// `requests_per_unit`.
    #[default]
    FixedWindow,
    /// The gateway's GCRA token bucket: `requests_per_unit` per `unit`, bursts
    /// up to `requests_per_unit`; a denied hit is not counted.
    TokenBucket,
    /// The gateway's sliding-window counter; a denied hit is not counted.
    SlidingWindow,
}

impl RlsAlgorithm {
    /// Every RLS algorithm, in the order error messages list them.
    pub const ALL: [RlsAlgorithm; 3] = [
        RlsAlgorithm::FixedWindow,
        RlsAlgorithm::TokenBucket,
        RlsAlgorithm::SlidingWindow,
    ];

    /// The gateway bucket algorithm it runs, or `None` for `fixed_window`.
    pub fn exact(self) -> Option<Algorithm> {
        match self {
            RlsAlgorithm::FixedWindow => None,
            RlsAlgorithm::TokenBucket => Some(Algorithm::TokenBucket),
            RlsAlgorithm::SlidingWindow => Some(Algorithm::SlidingWindow),
        }
    }

    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self.exact() {
            Some(a) => a.name(),
            None => "fixed_window",
        }
    }

    /// The RLS algorithm named `name`, if any.
    pub fn from_name(name: &str) -> Option<RlsAlgorithm> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// A calendar period of a quota, in UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    /// A clock minute (for tests and trials).
    Minute,
    /// A clock hour.
    Hour,
    /// A UTC day.
    Day,
    /// A UTC calendar month.
    Month,
}

impl Period {
    /// Every period, shortest first.
    pub const ALL: [Period; 4] = [Period::Minute, Period::Hour, Period::Day, Period::Month];

    /// The names of [`Self::ALL`], in its order, for the reader's error messages.
    // Evaluated when compiling: an index out of range fails the build.
    #[allow(clippy::indexing_slicing)]
    pub const NAMES: [&'static str; 4] = {
        let mut names = [""; 4];
        let mut i = 0;
        while i < names.len() {
            names[i] = Self::ALL[i].name();
            i += 1;
        }
        names
    };

    /// The name in configuration, on the wire, in Redis keys and in the Lua scripts.
    pub const fn name(self) -> &'static str {
        match self {
            Period::Minute => "minute",
            Period::Hour => "hour",
            Period::Day => "day",
            Period::Month => "month",
        }
    }

    /// The period named `name`, if any.
    pub fn from_name(name: &str) -> Option<Period> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_names_are_the_names() {
        for a in Algorithm::ALL {
            assert_eq!(serde_json::to_value(a).unwrap(), a.name());
            assert_eq!(Algorithm::from_name(a.name()), Some(a));
        }
        for p in Period::ALL {
            assert_eq!(serde_json::to_value(p).unwrap(), p.name());
            assert_eq!(Period::from_name(p.name()), Some(p));
        }
        assert_eq!(Period::NAMES, ["minute", "hour", "day", "month"]);
        assert_eq!(Algorithm::NAMES, ["token_bucket", "sliding_window"]);

        for r in RlsAlgorithm::ALL {
            assert_eq!(RlsAlgorithm::from_name(r.name()), Some(r));
        }
        assert_eq!(RlsAlgorithm::FixedWindow.name(), "fixed_window");
        assert_eq!(Algorithm::from_name("fixed_window"), None);
    }
}
