//! The bounds shared by the configuration and the wire protocol, defined once:
//! the protocol crate uses these, so a configuration the validation accepts
//! always fits in a request the gateway accepts.

/// Most buckets in one gateway request: one per global rule of the domain.
pub const MAX_BUCKETS: usize = 64;
/// Most limits in one bucket (one rule's `limits`).
pub const MAX_LIMITS: usize = 8;
/// Most quotas in one gateway request, and in one configuration.
pub const MAX_QUOTAS: usize = 64;
/// Largest quota amount per period.
pub const MAX_QUOTA_LIMIT: u64 = 1 << 50;
/// Longest `domain`, `rule`, `quota`, `key`, `tag` or variant on the wire, in bytes.
pub const MAX_NAME_BYTES: usize = 512;
/// Largest `requests × window_ms`, cost, amount, `want` and `return`: the Lua
/// scripts' doubles stay exact integers up to 2^53.
pub const MAX_EXACT: u64 = 1 << 53;
