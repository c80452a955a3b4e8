//! One request against the compiled plan: the cost, the client and its
//! tier, and for every matching rule the bucket it charges (local), the key
//! the gateway counts (global) and the quotas it counts against. Runs on
//! every request: no parsing, one map lookup for a known client, and key
//! parts hashed as they are read.

use super::key::{self, BadInput};
use super::plan::{ClientPlan, Evaluation, GlobalBucket, Plan, QuotaBucket, QuotaPlan, RulePlan};
use super::request::RequestInfo;
use crate::config::{QuotaCount, Scope};
use crate::limits::limiter::Bucket;
use ratelimit_protocol::Variant as Wire;
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
    fn client<'a>(&'a self, req: &'a RequestInfo) -> Who<'a> {
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
        Who {
            id: client_id,
            known,
            tier,
        }
    }

    /// Finds the cost and the buckets of every rule and quota that applies to `req`.
    pub fn evaluate(&self, req: &RequestInfo) -> Evaluation {
        let cost = self
            .costs
            .iter()
            .find(|(m, _)| m.matches(req))
            .map_or(1, |(_, c)| *c);
        let who = self.client(req);
        let mut eval = Evaluation {
            cost,
            soft: who.known.is_some_and(|k| k.soft),
            unlimited: who.known.is_some_and(|k| k.unlimited)
                || who
                    .tier
                    .and_then(|t| self.identity.tiers.get(t))
                    .is_some_and(|(_, u)| *u),
            ..Evaluation::default()
        };
        if eval.unlimited {
            return eval;
        }
        // Sized up front: growing from empty costs more than the allocation.
        eval.buckets = Vec::with_capacity(self.local_rules.min(8));
        for (i, rule) in self.rules.iter().enumerate() {
            self.add_rule(i, rule, req, who, &mut eval);
        }
        for (qi, q) in self.quotas.iter().enumerate() {
            self.add_quota(qi, q, req, who, &mut eval);
        }
        eval
    }

    /// Adds rule `i`'s bucket when the rule applies to `req`; each rule is
    /// matched, keyed and filed on its own.
    #[inline]
    fn add_rule(
        &self,
        i: usize,
        rule: &RulePlan,
        req: &RequestInfo,
        who: Who,
        eval: &mut Evaluation,
    ) {
        // Stand-ins are reached through their global rule only.
        if rule.stand_in || !rule.matcher.as_ref().is_none_or(|m| m.matches(req)) {
            return;
        }
        let variant = who.variant(i, rule);
        let Some(v) = rule.variants.get(variant) else {
            return;
        };
        if let Some(k) = self.rule_key(rule, variant, v.hasher, req, who, &mut eval.bad_input) {
            self.file_rule(i, variant, rule, k, eval);
        }
    }

    /// Reads a rule's key parts once into every form the rule is counted
    /// under (local hash, stand-in hash, gateway key); `None` when a part
    /// the key needs is missing and the rule does not apply.
    #[inline]
    fn rule_key(
        &self,
        rule: &RulePlan,
        variant: usize,
        hasher: SipHasher13,
        req: &RequestInfo,
        who: Who,
        bad_input: &mut Vec<BadInput>,
    ) -> Option<RuleKey> {
        let mut k = RuleKey {
            hash: hasher,
            stand_in: rule.fallback.and_then(|f| {
                self.rules
                    .get(f)
                    .and_then(|r| r.variants.get(variant))
                    .map(|v| (f, v.hasher))
            }),
            global: (rule.scope == Scope::Global).then(|| (rule.name.clone(), String::new())),
        };
        let applies = key::write_key(
            &rule.key,
            req,
            who.id,
            self.identity.ip_source,
            bad_input,
            &mut |tag, value| {
                key::hash_part(&mut k.hash, tag, value);
                if let Some((_, h)) = k.stand_in.as_mut() {
                    key::hash_part(h, tag, value);
                }
                if let Some((key, t)) = k.global.as_mut() {
                    key::encode_part(key, t.is_empty().then_some(t), tag, value);
                }
            },
        );
        applies.then_some(k)
    }

    /// Files a rule's bucket where it is counted: with the gateway (and its
    /// local stand-in, for when the gateway fails), in shadow, or locally.
    #[inline]
    fn file_rule(
        &self,
        i: usize,
        variant: usize,
        rule: &RulePlan,
        k: RuleKey,
        eval: &mut Evaluation,
    ) {
        let cost = rule.cost.unwrap_or(eval.cost);
        match k.global {
            Some((key, tag)) => {
                eval.global.push(GlobalBucket {
                    rule: i,
                    variant,
                    key: key::bounded(key, &rule.name),
                    tag,
                    cost,
                });
                if let Some((f, h)) = k.stand_in {
                    eval.fallback.push(self.bucket(f, variant, h, cost));
                }
            }
            None if rule.shadow || eval.soft => {
                eval.shadow.push(self.bucket(i, variant, k.hash, cost))
            }
            None => eval.buckets.push(self.bucket(i, variant, k.hash, cost)),
        }
    }

    /// Adds quota `qi`'s bucket when the quota applies to `req` and the
    /// client has an amount of it; quotas are keyed apart from the rules.
    #[inline]
    fn add_quota(
        &self,
        qi: usize,
        q: &QuotaPlan,
        req: &RequestInfo,
        who: Who,
        eval: &mut Evaluation,
    ) {
        if !q.matcher.as_ref().is_none_or(|m| m.matches(req)) {
            return;
        }
        let (limit, variant) = self.quota_limit(qi, q, who);
        let Some(limit) = limit else { return };
        let (mut k, mut tag) = (q.name.clone(), String::new());
        let applies = key::write_key(
            &q.key,
            req,
            who.id,
            self.identity.ip_source,
            &mut eval.bad_input,
            &mut |t, value| {
                key::encode_part(&mut k, tag.is_empty().then_some(&mut tag), t, value);
            },
        );
        if applies {
            let amount = match q.count {
                QuotaCount::Requests => 1,
                QuotaCount::Cost => eval.cost,
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

    /// The client's amount of quota `qi` and the variant the gateway is told:
    /// the client's own amount wins over its tier's, which wins over the default.
    #[inline]
    fn quota_limit(&self, qi: usize, q: &QuotaPlan, who: Who) -> (Option<u64>, Wire) {
        let by_client = who
            .known
            .and_then(|k| k.quotas.iter().find(|(x, _)| *x == qi).map(|(_, a)| *a))
            .zip(who.id);
        match (by_client, who.tier) {
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
        }
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

/// Who sent a request, as every rule and quota reads it: resolved once per
/// request.
#[derive(Clone, Copy)]
struct Who<'a> {
    /// The client id; `None`: the IP stands in.
    id: Option<&'a [u8]>,
    /// The client's static settings, for a client in `identity.clients`.
    known: Option<&'a ClientPlan>,
    /// The client's tier.
    tier: Option<usize>,
}

impl Who<'_> {
    /// The variant of rule `i` for this client: its own override wins over
    /// its tier's, which wins over the rule's own limits (0).
    #[inline]
    fn variant(&self, i: usize, rule: &RulePlan) -> usize {
        self.known
            .and_then(|k| k.variants.iter().find(|(r, _)| *r == i).map(|(_, v)| *v))
            .or_else(|| self.tier.and_then(|t| rule.tier_variant.get(t).copied()))
            .unwrap_or(0)
    }
}

/// A rule's key for one request, in every form the rule is counted under.
struct RuleKey {
    /// The local bucket's hash.
    hash: SipHasher13,
    /// The stand-in rule and its hash, for a global rule that has one.
    stand_in: Option<(usize, SipHasher13)>,
    /// The gateway's key and tag, for a global rule.
    global: Option<(String, String)>,
}
