//! Validation of charging from the response: `cost_from` (one source, a
//! `max`, a `reserve` within it) and `charge_on`. Every rule may settle: a
//! local one in its bucket, a global one on the gateway (`POST /v1/settle`)
//! or, in lease mode, against the batch it spent from; a quota is never
//! leased, so it always settles on the gateway.

use super::syntax;
use super::usage::{
    MAX_REQUEST_BODY_LIMIT, MAX_SCAN_LIMIT, MAX_TERMS, MAX_WEIGHT, MIN_REQUEST_BODY_LIMIT,
    MIN_SCAN_LIMIT,
};
use super::*;

impl Rule {
    /// Checks `cost_from` and `charge_on` of the rule at `at` (`rules[2]`).
    pub(super) fn validate_charging(&self, at: &str) -> Result<(), ConfigError> {
        if let Some(from) = &self.cost_from {
            let field = format!("{at}.cost_from");
            if self.cost.is_some() {
                return Err(ConfigError::field(
                    field,
                    "give cost or cost_from, not both",
                ));
            }
            if self.graduated.is_some() {
                return Err(ConfigError::field(
                    field,
                    "does not combine with graduated: the stages are shares of a bucket a settlement may overdraw",
                ));
            }
            from.validate(&field)?;
        }
        if let Some(statuses) = &self.charge_on {
            let field = format!("{at}.charge_on");
            if statuses.is_empty() {
                return Err(ConfigError::field(
                    field,
                    "must list at least one status or class",
                ));
            }
        }
        Ok(())
    }
}

impl CostFrom {
    /// Checks one `cost_from` at `at`.
    pub(super) fn validate(&self, at: &str) -> Result<(), ConfigError> {
        let sources = [
            self.header.is_some(),
            self.json.is_some(),
            self.preset.is_some(),
        ];
        if sources.iter().filter(|s| **s).count() != 1 {
            return Err(ConfigError::field(
                at,
                "give exactly one of header, json and preset",
            ));
        }
        if let Some(h) = &self.header {
            if let Some(why) = syntax::header_name_problem(h) {
                return Err(ConfigError::field(format!("{at}.header"), why));
            }
        }
        if let Some(terms) = &self.json {
            if terms.is_empty() || terms.len() > MAX_TERMS {
                return Err(ConfigError::field(
                    format!("{at}.json"),
                    format!("must hold 1 to {MAX_TERMS} terms"),
                ));
            }
            for (t, term) in terms.iter().enumerate() {
                if term.weight > MAX_WEIGHT {
                    return Err(ConfigError::field(
                        format!("{at}.json[{t}].weight"),
                        format!("must be at most {MAX_WEIGHT}"),
                    ));
                }
            }
            if terms.iter().all(|t| t.weight == 0) {
                return Err(ConfigError::field(
                    format!("{at}.json"),
                    "every weight is 0: nothing would ever be charged",
                ));
            }
        }
        if self.max == 0 || self.max > MAX_REQUESTS {
            return Err(ConfigError::field(
                format!("{at}.max"),
                format!("must be between 1 and {MAX_REQUESTS}"),
            ));
        }
        if self.reserve.upfront() > self.max {
            return Err(ConfigError::field(
                self.reserve.field(at),
                format!("{} is above max ({})", self.reserve.upfront(), self.max),
            ));
        }
        if !(MIN_REQUEST_BODY_LIMIT..=MAX_REQUEST_BODY_LIMIT).contains(&self.request_body_limit) {
            return Err(ConfigError::field(
                format!("{at}.request_body_limit"),
                format!(
                    "must be between {MIN_REQUEST_BODY_LIMIT} and {MAX_REQUEST_BODY_LIMIT} bytes"
                ),
            ));
        }
        // A header source says nothing of the body's shape: the stream's
        // usage would be asked for and never read.
        if self.ensure_stream_usage && self.header.is_some() {
            return Err(ConfigError::field(
                format!("{at}.ensure_stream_usage"),
                "needs a json or preset source: the usage it asks for is read from the body",
            ));
        }
        if !(MIN_SCAN_LIMIT..=MAX_SCAN_LIMIT).contains(&self.scan_limit) {
            return Err(ConfigError::field(
                format!("{at}.scan_limit"),
                format!("must be between {MIN_SCAN_LIMIT} and {MAX_SCAN_LIMIT} bytes"),
            ));
        }
        Ok(())
    }
}
