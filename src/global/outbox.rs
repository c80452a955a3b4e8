//! Settlements on their way to the gateway. A request's stream ends in its
//! HTTP context, which Envoy deletes with the callouts it made; so a
//! settlement is queued here, per worker, and the root context's tick posts
//! the queue to `POST /v1/settle` in batches. Bounded: at most
//! [`MAX_QUEUED`] wait, holding at most [`MAX_QUEUED_BYTES`] of names and
//! keys, and one that cannot be delivered in
//! [`MAX_ATTEMPTS`] is given up (the request keeps what its check reserved,
//! and the gateway drops the record after `--reservation-ttl`). Retrying is
//! safe: the gateway settles a reservation once, whatever the attempts.

use crate::global::callout::{self, AnswerError};
use ratelimit_protocol::{SettleRequest, SettleResponse, Settlement, MAX_SETTLEMENTS, VERSION};
use std::collections::VecDeque;

/// Most settlements one worker keeps waiting; more are given up at once.
pub const MAX_QUEUED: usize = 4096;
/// Most bytes of names, keys and ids the waiting settlements hold (a
/// settlement of one bucket holds about 100 to 300).
pub const MAX_QUEUED_BYTES: usize = 1 << 20;
/// Attempts at delivering one settlement.
pub const MAX_ATTEMPTS: u8 = 3;
/// Settle calls one worker keeps in flight at once.
pub const MAX_CALLS: usize = 4;
/// How long a settle call waits for its answer: no request waits for it, so
/// longer than a check's `global.timeout_ms`.
pub const TIMEOUT_MS: u64 = 1000;

/// The queue of one worker.
#[derive(Debug, Default)]
pub struct Outbox {
    queue: VecDeque<(Settlement, u8)>,
    /// [`weight`] of what `queue` holds.
    bytes: usize,
}

/// What a settlement holds in names, keys and ids, plus a little per item.
fn weight(s: &Settlement) -> usize {
    let buckets = s
        .buckets
        .iter()
        .map(|b| b.rule.len() + b.key.len() + b.tag.len() + b.variant.encode().len() + 32);
    let quotas = s
        .quotas
        .iter()
        .map(|q| q.quota.len() + q.key.len() + q.tag.len() + q.variant.encode().len() + 32);
    s.reservation.len() + 32 + buckets.chain(quotas).sum::<usize>()
}

/// A batch posted: its settlements and their attempts so far.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    items: Vec<(Settlement, u8)>,
}

/// What became of a batch's settlements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delivered {
    /// Settled by the gateway.
    pub settled: u64,
    /// The gateway had no reservation for them (already settled: an earlier
    /// attempt's answer was lost; or expired).
    pub unmatched: u64,
    /// Given up.
    pub failed: u64,
}

impl Outbox {
    /// Queues a settlement; false when the queue is full (it is given up).
    pub fn push(&mut self, s: Settlement) -> bool {
        if !self.has_room(&s) {
            return false;
        }
        self.bytes += weight(&s);
        self.queue.push_back((s, 0));
        true
    }

    fn has_room(&self, s: &Settlement) -> bool {
        self.queue.len() < MAX_QUEUED && self.bytes + weight(s) <= MAX_QUEUED_BYTES
    }

    /// Settlements waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The next batch, oldest first, and its body for `domain`; `None` when
    /// nothing waits.
    pub fn next_batch(&mut self, domain: &str) -> Option<(Batch, Vec<u8>)> {
        if self.queue.is_empty() {
            return None;
        }
        let n = self.queue.len().min(MAX_SETTLEMENTS);
        let items: Vec<(Settlement, u8)> = self.queue.drain(..n).collect();
        self.bytes = self
            .bytes
            .saturating_sub(items.iter().map(|(s, _)| weight(s)).sum::<usize>());
        let body = SettleRequest {
            version: VERSION,
            domain: domain.to_string(),
            settlements: items.iter().map(|(s, _)| s.clone()).collect(),
        };
        let body = serde_json::to_vec(&body).unwrap_or_default();
        Some((Batch { items }, body))
    }

    /// The gateway's answer to `batch` (`status` `None`: none came). A
    /// failed call puts the batch back for another attempt, but for what has
    /// had its last; a 400 (a body the policy refuses) or a 404 (a domain
    /// the gateway's policy does not name) is not retried: the same body
    /// would be refused again.
    pub fn answered(&mut self, batch: Batch, status: Option<&[u8]>, body: &[u8]) -> Delivered {
        let mut out = Delivered::default();
        match read_answer(status, body, batch.items.len()) {
            Ok(settled) => {
                for found in settled {
                    if found {
                        out.settled += 1;
                    } else {
                        out.unmatched += 1;
                    }
                }
            }
            Err(AnswerError::Status(s)) if s == "400" || s == "404" => {
                out.failed = batch.items.len() as u64
            }
            Err(_) => {
                // Back at the front, in their order: they are the oldest.
                for (s, attempts) in batch.items.into_iter().rev() {
                    if attempts + 1 >= MAX_ATTEMPTS || !self.has_room(&s) {
                        out.failed += 1;
                    } else {
                        self.bytes += weight(&s);
                        self.queue.push_front((s, attempts + 1));
                    }
                }
            }
        }
        out
    }
}

/// The answer's per-settlement results, exactly one per settlement sent.
fn read_answer(status: Option<&[u8]>, body: &[u8], sent: usize) -> Result<Vec<bool>, AnswerError> {
    let a: SettleResponse = callout::read_body(status, body, |a: &SettleResponse| a.version)?;
    if a.settled.len() != sent {
        return Err(AnswerError::Inconsistent(format!(
            "{} results for {sent} settlements",
            a.settled.len()
        )));
    }
    Ok(a.settled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratelimit_protocol::{BucketRef, Variant};

    fn settlement(i: u64) -> Settlement {
        Settlement {
            reservation: format!("{i:016x}"),
            buckets: vec![BucketRef {
                rule: "tokens".into(),
                key: "tokens/c=a".into(),
                tag: "c=a".into(),
                variant: Variant::Default,
                cost: i,
            }],
            quotas: vec![],
        }
    }

    #[test]
    fn batches_hold_at_most_64_oldest_first_and_name_the_domain() {
        let mut o = Outbox::default();
        for i in 0..70 {
            assert!(o.push(settlement(i)));
        }
        let (batch, body) = o.next_batch("llm").unwrap();
        let req = ratelimit_protocol::parse_settle(&body).unwrap();
        assert_eq!(req.domain, "llm");
        assert_eq!(req.settlements.len(), 64);
        assert_eq!(req.settlements[0].buckets[0].cost, 0);
        assert_eq!(o.len(), 6);
        let d = o.answered(
            batch,
            Some(b"200"),
            br#"{"version":2,"settled":[true,false]}"#,
        );
        // Two results for 64: inconsistent, so retried.
        assert_eq!(d, Delivered::default());
        assert_eq!(o.len(), 70);
        let (batch, _) = o.next_batch("llm").unwrap();
        let mut answer = vec![true; 63];
        answer.push(false);
        let body = serde_json::to_vec(&SettleResponse {
            version: 2,
            settled: answer,
        })
        .unwrap();
        let d = o.answered(batch, Some(b"200"), &body);
        assert_eq!((d.settled, d.unmatched, d.failed), (63, 1, 0));
        assert_eq!(o.len(), 6);
    }

    #[test]
    fn a_failed_call_is_retried_up_to_the_last_attempt_and_a_400_or_404_never() {
        let mut o = Outbox::default();
        o.push(settlement(1));
        for attempt in 1..MAX_ATTEMPTS {
            let (batch, _) = o.next_batch("d").unwrap();
            assert_eq!(
                o.answered(batch, None, b""),
                Delivered::default(),
                "{attempt}"
            );
            assert_eq!(o.len(), 1);
        }
        let (batch, _) = o.next_batch("d").unwrap();
        assert_eq!(o.answered(batch, Some(b"503"), b"").failed, 1);
        assert!(o.is_empty());
        o.push(settlement(2));
        let (batch, _) = o.next_batch("d").unwrap();
        assert_eq!(o.answered(batch, Some(b"400"), b"{}").failed, 1);
        assert!(o.is_empty());
        o.push(settlement(3));
        let (batch, _) = o.next_batch("d").unwrap();
        assert_eq!(o.answered(batch, Some(b"404"), b"{}").failed, 1);
        assert!(o.is_empty());
        assert!(o.next_batch("d").is_none());
    }

    #[test]
    fn the_queue_is_bounded_in_settlements_and_in_bytes() {
        let mut o = Outbox::default();
        for i in 0..MAX_QUEUED as u64 {
            assert!(o.push(settlement(i)));
        }
        assert!(!o.push(settlement(0)));
        assert_eq!(o.len(), MAX_QUEUED);
        while o.next_batch("d").is_some() {}
        assert_eq!(o.bytes, 0);
        // Settlements of 64 buckets with keys of 512 bytes (35 KiB each): 29 fit in 1 MiB.
        let mut big = settlement(0);
        big.buckets[0].key = "k".repeat(512);
        big.buckets = vec![big.buckets[0].clone(); 64];
        let mut n = 0;
        while o.push(big.clone()) {
            n += 1;
        }
        assert!(o.bytes <= MAX_QUEUED_BYTES);
        assert_eq!(n, MAX_QUEUED_BYTES / weight(&big));
        assert_eq!(n, 29);
    }
}
