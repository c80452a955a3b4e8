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
/// Most checks in one batched check (`POST /v3/check`), and the largest
/// `global.max_batch`.
pub const MAX_BATCH: usize = 256;
/// Largest body of a batched check, in bytes: the filter sends no larger
/// batch (it starts another call), and the gateway answers 413 to one.
pub const MAX_BATCH_BYTES: usize = 4 << 20;
/// Most settlements in one `POST /v1/settle`.
pub const MAX_SETTLEMENTS: usize = 64;
/// Shortest and longest reservation id a check may name for its settlement.
pub const RESERVATION_ID_BYTES: std::ops::RangeInclusive<usize> = 16..=64;
/// How many responses of `max` a bucket charged from the response may owe:
/// a settlement past what the bucket holds leaves it in debt, up to this
/// many times the largest settlement, in the filter and the gateway alike.
pub const DEBT_OVERRUNS: u64 = 1024;
