//! What a client is told: the rate limit response headers in each
//! configured style ([`headers`]) and the RFC 9457 problem bodies of 429s and
//! quota 403s ([`problem`]). Pure formatting over the limiter's reports.

pub mod headers;
pub mod problem;
