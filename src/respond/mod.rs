//! What a client is told: the rate limit response headers in each
//! configured style ([`headers`]; the `RateLimit-Policy` value compiled once
//! is the plan's, `policy::policy_list`) and the RFC 9457 problem bodies of 429s and
//! quota 403s ([`problem`]). Pure formatting over the limiter's reports.

pub mod digits;
pub mod headers;
pub mod problem;
