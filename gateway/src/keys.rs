//! Redis key layout and cluster slot grouping.
//!
//! One key per limit:
//! `<prefix>{<domain>|<tag>}|<key>|<limit index>|<algorithm>|<requests>|<window_ms>`.
//! The `{…}` hash tag puts every key of one domain and tag in one cluster
//! slot; the limit's parameters in the name make a changed limit start a
//! fresh key. `domain`, `tag` and `key` are escaped (`%` → `%25`, `|` → `%7C`,
//! `{` → `%7B`, `}` → `%7D`) so that no two different requests can name the
//! same key and a `}` in a tag cannot end the hash tag early.

use redis::cluster_routing::Slot;

use crate::protocol::{CheckRequest, LimitSpec};

/// One limit of one bucket, with its Redis key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitKey {
    /// Index of the bucket in the request.
    pub bucket: usize,
    /// Index of the limit in the bucket.
    pub limit: usize,
    /// The Redis key.
    pub key: String,
    /// The limit.
    pub spec: LimitSpec,
    /// What the request costs in this limit (its bucket's cost).
    pub cost: u64,
}

/// Keys that share one cluster slot, in request order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// The limits of this group.
    pub limits: Vec<LimitKey>,
}

/// Escapes the characters that structure a key.
pub fn escape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    for ch in part.chars() {
        match ch {
            '%' => out.push_str("%25"),
            '|' => out.push_str("%7C"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

/// The Redis key of limit `index` of a bucket.
pub fn redis_key(
    prefix: &str,
    domain: &str,
    tag: &str,
    key: &str,
    index: usize,
    spec: &LimitSpec,
) -> String {
    format!(
        "{prefix}{{{}|{}}}|{}|{index}|{}|{}|{}",
        escape(domain),
        escape(tag),
        escape(key),
        spec.algorithm.name(),
        spec.requests,
        spec.window_ms
    )
}

/// Every limit of the request with its key, in request order.
pub fn limit_keys(prefix: &str, req: &CheckRequest) -> Vec<LimitKey> {
    let mut out = Vec::new();
    for (b, bucket) in req.buckets.iter().enumerate() {
        for (l, spec) in bucket.limits.iter().enumerate() {
            out.push(LimitKey {
                bucket: b,
                limit: l,
                key: redis_key(prefix, &req.domain, &bucket.tag, &bucket.key, l, spec),
                spec: *spec,
                cost: bucket.cost_in(req.cost),
            });
        }
    }
    out
}

/// Splits limits by cluster slot, groups ordered by first appearance.
pub fn group_by_slot(limits: Vec<LimitKey>) -> Vec<Group> {
    let mut groups: Vec<(Slot, Group)> = Vec::new();
    for lk in limits {
        let slot = Slot::for_key(lk.key.as_bytes());
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, g)) => g.limits.push(lk),
            None => groups.push((slot, Group { limits: vec![lk] })),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// A key prefix must not contain a hash-tag brace, or the `{…}` would not be
/// the first one in the key.
pub fn check_prefix(prefix: &str) -> Result<(), String> {
    if prefix.contains(['{', '}']) {
        return Err(format!(
            "key prefix {prefix:?} must not contain '{{' or '}}'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Algorithm;

    const TB: LimitSpec = LimitSpec {
        requests: 60,
        window_ms: 60000,
        algorithm: Algorithm::TokenBucket,
    };

    #[test]
    fn layout() {
        assert_eq!(
            redis_key("rl:", "demo", "c=alice", "per-client/c=alice", 0, &TB),
            "rl:{demo|c=alice}|per-client/c=alice|0|token_bucket|60|60000"
        );
        assert_eq!(
            redis_key("rl:", "a|b", "}x{", "k%", 1, &TB),
            "rl:{a%7Cb|%7Dx%7B}|k%25|1|token_bucket|60|60000"
        );
    }

    #[test]
    fn one_tag_is_one_slot() {
        let a = redis_key("rl:", "d", "t", "k1", 0, &TB);
        let b = redis_key("rl:", "d", "t", "other", 3, &TB);
        assert_eq!(Slot::for_key(a), Slot::for_key(b));
    }
}
