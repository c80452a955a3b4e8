//! Coalesced checks, per worker. While a batch is in flight, the worker's
//! next checks wait here and go together in one call (`POST /v3/check`)
//! when it returns; a check never waits longer than `global.coalesce_us`
//! once another arrives, nor than a full batch takes to gather.
//!
//! Exact because nothing is decided here: the gateway decides each check of
//! a batch in order, each all or nothing over its own buckets and quotas,
//! as if it had come alone. This only keeps who waits, and builds bodies.
//! Pure bookkeeping: the host wakes its root context, posts the batches and
//! hands each check its part of the answer.

use crate::policy::plan::BatchPlan;
use ratelimit_protocol::MAX_BATCH_BYTES;
use std::collections::VecDeque;

/// A check waiting for its batch: the request's context and its body part.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Queued {
    context: u32,
    at_ns: u64,
    check: Vec<u8>,
}

/// A check of a batch in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// The request's context id.
    pub context: u32,
    /// When it joined the queue.
    pub at_ns: u64,
    /// Its request left while the batch was in flight: its part of the
    /// answer goes to no one (its place in the batch stays).
    pub gone: bool,
}

/// A batch to post: its body, and its members in the body's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The `POST /v3/check` body.
    pub body: Vec<u8>,
    /// One per check of the body, in order.
    pub members: Vec<Member>,
}

impl Batch {
    /// When the batch's oldest check joined.
    pub fn oldest_ns(&self) -> u64 {
        self.members.iter().map(|m| m.at_ns).min().unwrap_or(0)
    }
}

/// What the host does after a check joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// Nothing: a call in flight, or a wake already asked for, brings it.
    Wait,
    /// Wake the root context, which posts the queue.
    Wake,
}

/// Where a request that left was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Left {
    /// Not here.
    Nowhere,
    /// Queued: dropped before it was sent.
    Queued,
    /// In a batch in flight: its part of the answer will be dropped.
    Posted,
}

/// One worker's queue and batches in flight.
#[derive(Debug, Default)]
pub struct Coalescer {
    queue: VecDeque<Queued>,
    /// Batches in flight: the call's token, when it left, and its members.
    in_flight: Vec<(u32, u64, Vec<Member>)>,
    /// A wake was asked for and has not come yet.
    woken: bool,
}

impl Coalescer {
    /// A check joins the queue. The root is woken at once when there is no
    /// call in flight to wait for, when a whole batch waits, or when the
    /// oldest check waited `coalesce_ns`.
    pub fn join(&mut self, context: u32, check: Vec<u8>, plan: &BatchPlan, now_ns: u64) -> Join {
        self.queue.push_back(Queued {
            context,
            at_ns: now_ns,
            check,
        });
        if self.woken || !self.due(plan, now_ns) {
            return Join::Wait;
        }
        self.woken = true;
        Join::Wake
    }

    /// Whether the queue should go now rather than wait for a call in flight.
    pub fn due(&self, plan: &BatchPlan, now_ns: u64) -> bool {
        let Some(oldest) = self.queue.front() else {
            return false;
        };
        self.in_flight.is_empty()
            || self.queue.len() >= plan.max_batch
            || now_ns.saturating_sub(oldest.at_ns) >= plan.coalesce_ns
    }

    /// The wake came: the queue is the root's to post.
    pub fn wake_served(&mut self) {
        self.woken = false;
    }

    /// The next batch from the queue: up to `max_batch` checks, in order,
    /// within [`MAX_BATCH_BYTES`] (a lone check larger than that still goes,
    /// and the gateway answers 413 for it).
    pub fn next_batch(&mut self, plan: &BatchPlan) -> Option<Batch> {
        self.queue.front()?;
        let mut body = plan.head.clone();
        let mut members = Vec::new();
        while let Some(q) = self.queue.front() {
            let fits = body.len() + q.check.len() + 2 <= MAX_BATCH_BYTES;
            if members.len() >= plan.max_batch || (!members.is_empty() && !fits) {
                break;
            }
            let Some(q) = self.queue.pop_front() else {
                break;
            };
            if !members.is_empty() {
                body.push(b',');
            }
            body.extend_from_slice(&q.check);
            members.push(Member {
                context: q.context,
                at_ns: q.at_ns,
                gone: false,
            });
        }
        body.extend_from_slice(b"]}");
        Some(Batch { body, members })
    }

    /// A batch left as call `token` at `now_ns`.
    pub fn posted(&mut self, token: u32, members: Vec<Member>, now_ns: u64) {
        self.in_flight.push((token, now_ns, members));
    }

    /// The members of the batch that call `token` carried, and when it
    /// left, once; `None` for another call.
    pub fn answered(&mut self, token: u32) -> Option<(Vec<Member>, u64)> {
        let i = self.in_flight.iter().position(|(t, _, _)| *t == token)?;
        let (_, sent_ns, members) = self.in_flight.swap_remove(i);
        Some((members, sent_ns))
    }

    /// A request leaves: dropped from the queue, or from its batch's members.
    pub fn leave(&mut self, context: u32) -> Left {
        if let Some(i) = self.queue.iter().position(|q| q.context == context) {
            self.queue.remove(i);
            return Left::Queued;
        }
        for (_, _, members) in &mut self.in_flight {
            if let Some(m) = members.iter_mut().find(|m| m.context == context && !m.gone) {
                m.gone = true;
                return Left::Posted;
            }
        }
        Left::Nowhere
    }

    /// Checks waiting for a batch.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Batches in flight.
    pub fn calls(&self) -> usize {
        self.in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(max_batch: usize, coalesce_ns: u64) -> BatchPlan {
        BatchPlan {
            path: "/v3/check".into(),
            coalesce_ns,
            max_batch,
            head: br#"{"version":3,"domain":"d","checks":["#.to_vec(),
        }
    }

    fn check(n: u32) -> Vec<u8> {
        format!(r#"{{"n":{n}}}"#).into_bytes()
    }

    #[test]
    fn the_first_check_wakes_and_the_next_wait_for_the_call_in_flight() {
        let p = plan(64, 500_000);
        let mut c = Coalescer::default();
        assert_eq!(c.join(1, check(1), &p, 0), Join::Wake);
        // The wake has not come yet: no second wake.
        assert_eq!(c.join(2, check(2), &p, 10), Join::Wait);
        c.wake_served();
        let b = c.next_batch(&p).unwrap();
        assert_eq!(
            b.body,
            br#"{"version":3,"domain":"d","checks":[{"n":1},{"n":2}]}"#
        );
        assert_eq!(
            b.members.iter().map(|m| m.context).collect::<Vec<_>>(),
            [1, 2]
        );
        c.posted(7, b.members, 15);
        // A call in flight: the next checks wait for it.
        assert_eq!(c.join(3, check(3), &p, 20), Join::Wait);
        assert_eq!(c.join(4, check(4), &p, 30), Join::Wait);
        assert_eq!(c.answered(7).unwrap().0.len(), 2);
        assert_eq!(c.answered(7), None);
        let b = c.next_batch(&p).unwrap();
        assert_eq!(
            b.body,
            br#"{"version":3,"domain":"d","checks":[{"n":3},{"n":4}]}"#
        );
        assert_eq!(b.oldest_ns(), 20);
        assert_eq!(c.next_batch(&p), None);
    }

    #[test]
    fn a_check_that_waited_coalesce_us_or_a_full_batch_wakes_despite_a_call_in_flight() {
        let p = plan(4, 500_000);
        let mut c = Coalescer::default();
        c.posted(1, vec![], 0);
        assert_eq!(c.join(1, check(1), &p, 0), Join::Wait);
        assert_eq!(c.join(2, check(2), &p, 499_999), Join::Wait);
        // The oldest has waited coalesce_us.
        assert_eq!(c.join(3, check(3), &p, 500_000), Join::Wake);
        c.wake_served();
        assert_eq!(c.next_batch(&p).unwrap().members.len(), 3);
        let p = plan(3, 500_000);
        assert_eq!(c.join(4, check(4), &p, 600_000), Join::Wait);
        assert_eq!(c.join(5, check(5), &p, 600_001), Join::Wait);
        // The third makes a whole batch of max_batch.
        assert_eq!(c.join(6, check(6), &p, 600_002), Join::Wake);
    }

    #[test]
    fn batches_hold_at_most_max_batch_checks_in_arrival_order() {
        let p = plan(2, 1);
        let mut c = Coalescer::default();
        for n in 1..=5 {
            c.join(n, check(n), &p, 0);
        }
        let sizes: Vec<Vec<u32>> = std::iter::from_fn(|| c.next_batch(&p))
            .map(|b| b.members.iter().map(|m| m.context).collect())
            .collect();
        assert_eq!(sizes, [vec![1, 2], vec![3, 4], vec![5]]);
    }

    #[test]
    fn a_batch_stays_within_the_gateways_body_bound() {
        let p = plan(256, 1);
        let mut c = Coalescer::default();
        let big = vec![b'x'; MAX_BATCH_BYTES / 3];
        for n in 1..=4 {
            c.join(n, big.clone(), &p, 0);
        }
        let b = c.next_batch(&p).unwrap();
        assert_eq!(b.members.len(), 2);
        assert!(b.body.len() <= MAX_BATCH_BYTES);
        assert_eq!(c.next_batch(&p).unwrap().members.len(), 2);
    }

    #[test]
    fn a_request_that_leaves_is_dropped_from_the_queue_or_from_its_batch() {
        let p = plan(64, 500_000);
        let mut c = Coalescer::default();
        c.join(1, check(1), &p, 0);
        c.join(2, check(2), &p, 0);
        let b = c.next_batch(&p).unwrap();
        c.posted(9, b.members, 0);
        c.join(3, check(3), &p, 0);
        assert_eq!(c.leave(3), Left::Queued);
        assert_eq!(c.queued(), 0);
        assert_eq!(c.leave(1), Left::Posted);
        assert_eq!(c.leave(1), Left::Nowhere);
        let (members, _) = c.answered(9).unwrap();
        let kept: Vec<(u32, bool)> = members.iter().map(|m| (m.context, m.gone)).collect();
        assert_eq!(kept, [(1, true), (2, false)]);
        assert_eq!(c.calls(), 0);
    }
}
