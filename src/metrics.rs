//! The filter's counters. Envoy shows each as `wasmcustom.<name>` in `/stats`
//! and as the bare `<name>` in `/stats/prometheus`, summed over workers.

/// One counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Requests that matched a rule and were let through.
    Allowed,
    /// Requests answered 429.
    Denied,
    /// Compare-and-swap conflicts that forced a retry.
    CasRetries,
    /// Shared-data failures or contention past the retry budget (then `on_error` applies).
    Errors,
    /// Active buckets evicted from a full set of the bounded table.
    Evictions,
    /// Requests with an oversized key part, a garbled trusted `X-Forwarded-For` or no peer address.
    BadInput,
    /// Set values that could not be decoded and were reset.
    CorruptState,
}

impl Metric {
    /// Every counter, in a fixed order.
    pub const ALL: [Metric; 7] = [
        Metric::Allowed,
        Metric::Denied,
        Metric::CasRetries,
        Metric::Errors,
        Metric::Evictions,
        Metric::BadInput,
        Metric::CorruptState,
    ];

    /// The name given to Envoy.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Allowed => "ratelimit_wasm_requests_allowed",
            Metric::Denied => "ratelimit_wasm_requests_denied",
            Metric::CasRetries => "ratelimit_wasm_cas_retries",
            Metric::Errors => "ratelimit_wasm_errors",
            Metric::Evictions => "ratelimit_wasm_bucket_evictions",
            Metric::BadInput => "ratelimit_wasm_bad_input",
            Metric::CorruptState => "ratelimit_wasm_corrupt_state",
        }
    }

    /// Position in [`Metric::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_prefixed_and_indexes_match() {
        for (i, m) in Metric::ALL.iter().enumerate() {
            assert!(m.name().starts_with("ratelimit_wasm_"));
            assert_eq!(m.index(), i);
        }
    }
}
