//! One request against the compiled plan: the cost, the client and its
//! tier, and for every matching rule the bucket it charges (local), the key
//! the gateway counts (global) and the quotas it counts against. Runs on
//! every request: no parsing, one map lookup for a known client, and key
//! parts hashed as they are read.

use super::key;
use super::plan::{ClientPlan, Evaluation, GlobalBucket, Plan, QuotaBucket};
use super::request::RequestInfo;
use crate::config::{QuotaCount, Scope};
use crate::limits::limiter::Bucket;
use siphasher::sip::SipHasher13;
use std::hash::Hasher;

impl Plan {
    /// The client id of `req`, from metadata or the header as configured; `None` when absent or empty.
    pub fn client_id<'a>(&self, req: &'a RequestInfo) -> Option<&'a [u8]> {
        match &self.client_id_property {
            Some(_) => req.client_metadata.as_deref(),
            None => req.header(self.identity.client_header),
        }
        .filter(|v| !v.is_empty())
    }

    /// Resolves the client: its id (`None`: the IP stands in), its static
    /// settings and its tier. The static map's tier wins over the credential's,
    /// which wins over the default.
    fn client<'a>(
        &'a self,
        req: &'a RequestInfo,
    ) -> (Option<&'a [u8]>, Option<&'a ClientPlan>, Option<usize>) {
        let id = &self.identity;
        let client_id = self.client_id(req);
        let known = client_id.and_then(|c| id.clients.get(c));
        let claimed = match (&self.tier_property, id.tier_header) {
            (Some(_), _) => req.tier_metadata.as_deref(),
            (None, Some(h)) => req.header(h),
            (None, None) => None,
        };
        let tier = known
            .and_then(|k| k.tier)
            .or_else(|| claimed.and_then(|t| id.tiers.iter().position(|(n, _)| n.as_bytes() == t)))
            .or(id.default_tier);
        (client_id, known, tier)
    }

    /// Finds the cost and the buckets of every rule and quota that applies to `req`.
    pub fn evaluate(&self, req: &RequestInfo) -> Evaluation {
        let (cost, cost_meter) = self
            .costs
            .iter()
            .find(|(m, _, _)| m.matches(req))
            .map_or((1, None), |(_, c, meter)| (*c, *meter));
        let (client_id, known, tier) = self.client(req);
        let mut eval = Evaluation {
            cost,
            cost_meter,
            soft: known.is_some_and(|k| k.soft),
            unlimited: known.is_some_and(|k| k.unlimited)
                || tier
                    .and_then(|t| self.identity.tiers.get(t))
                    .is_some_and(|(_, u)| *u),
            ..Evaluation::default()
        };
        if eval.unlimited {
            return eval;
        }
        // Sized up front: growing from empty costs more than the allocation.
        eval.buckets = Vec::with_capacity(self.local_rules.min(8));
        let ip = &self.sources;
        for (i, rule) in self.rules.iter().enumerate() {
            // Stand-ins are reached through their global rule only.
            if rule.stand_in || !rule.matcher.as_ref().is_none_or(|m| m.matches(req)) {
                continue;
            }
            let variant = known
                .and_then(|k| k.variants.iter().find(|(r, _)| *r == i).map(|(_, v)| *v))
                .or_else(|| {
                    let by = rule.limits_by.as_ref()?;
                    Some(by.pick(req, &mut eval.limits_by_default))
                })
                .or_else(|| tier.and_then(|t| rule.tier_variant.get(t).copied()))
                .unwrap_or(0);
            let Some(v) = rule.variants.get(variant) else {
                continue;
            };
            let mut hash = v.hasher;
            let mut stand_in = rule.fallback.and_then(|f| {
                self.rules
                    .get(f)
                    .and_then(|r| r.variants.get(variant))
                    .map(|v| (f, v.hasher))
            });
            let mut global =
                (rule.scope == Scope::Global).then(|| (rule.name.clone(), String::new()));
            let applies = key::write_key(
                &rule.key,
                req,
                client_id,
                ip,
                &mut eval.bad_input,
                &mut |tag, value| {
                    key::hash_part(&mut hash, tag, value);
                    if let Some((_, h)) = stand_in.as_mut() {
                        key::hash_part(h, tag, value);
                    }
                    if let Some((k, t)) = global.as_mut() {
                        key::encode_part(k, t.is_empty().then_some(t), tag, value);
                    }
                },
            );
            if !applies {
                continue;
            }
            // A slot is one request, whatever the request costs.
            let cost = if rule.in_flight {
                1
            } else {
                rule.cost.unwrap_or(cost)
            };
            if rule.in_flight && global.is_none() {
                let hash = hash.finish();
                eval.in_flight.push(Bucket {
                    rule: i,
                    variant,
                    fingerprint: hash,
                    set: self.in_flight.set_of(hash),
                    cost: 1,
                });
                continue;
            }
            match global {
                Some((key, tag)) => {
                    eval.global.push(GlobalBucket {
                        rule: i,
                        variant,
                        key: key::bounded(key, &rule.name),
                        tag,
                        cost,
                    });
                    if let Some((f, h)) = stand_in {
                        eval.fallback.push(self.bucket(f, variant, h, cost));
                    }
                }
                None if rule.shadow || eval.soft => {
                    eval.shadow.push(self.bucket(i, variant, hash, cost))
                }
                None => eval.buckets.push(self.bucket(i, variant, hash, cost)),
            }
        }
        for (qi, q) in self.quotas.iter().enumerate() {
            if !q.matcher.as_ref().is_none_or(|m| m.matches(req)) {
                continue;
            }
            use ratelimit_protocol::Variant as Wire;
            let by_client = known
                .and_then(|k| k.quotas.iter().find(|(x, _)| *x == qi).map(|(_, a)| *a))
                .zip(client_id);
            let (limit, variant) = match (by_client, tier) {
                (Some((a, c)), _) => (
                    Some(a),
                    Wire::Client(String::from_utf8_lossy(c).into_owned()),
                ),
                (None, Some(t)) => (
                    q.by_tier.get(t).copied().flatten(),
                    self.identity
                        .tiers
                        .get(t)
                        .map_or(Wire::Default, |(n, _)| Wire::Tier(n.clone())),
                ),
                (None, None) => (q.limit, Wire::Default),
            };
            let Some(limit) = limit else { continue };
            let (mut k, mut tag) = (q.name.clone(), String::new());
            let applies = key::write_key(
                &q.key,
                req,
                client_id,
                ip,
                &mut eval.bad_input,
                &mut |t, value| {
                    key::encode_part(&mut k, tag.is_empty().then_some(&mut tag), t, value);
                },
            );
            if applies {
                let amount = match q.count {
                    QuotaCount::Requests => 1,
                    QuotaCount::Cost => cost,
                };
                eval.quotas.push(QuotaBucket {
                    quota: qi,
                    key: key::bounded(k, &q.name),
                    tag,
                    limit,
                    variant,
                    amount,
                });
            }
        }
        eval
    }

    /// One 64-bit SipHash gives both the fingerprint and the set: two keys
    /// share a bucket only when the whole hash is equal (2^-64 a pair), as
    /// with the 128-bit finish, whose three extra rounds cost c1 116
    /// instructions and c4 466 (BENCHMARKS.md, instructions per decision).
    fn bucket(&self, rule: usize, variant: usize, hasher: SipHasher13, cost: u64) -> Bucket {
        let hash = hasher.finish();
        Bucket {
            rule,
            variant,
            fingerprint: hash,
            set: self.table.set_of(hash),
            cost,
        }
    }
}
