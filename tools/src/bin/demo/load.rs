//! A steady, open-loop load from one client and its live per-second table.
//!
//! Requests leave on a fixed schedule (request `i` at `i / rate` seconds),
//! from a few worker threads, so a request that the filter holds does not
//! slow the sender down: the offered load stays at `rate` whatever the
//! answers. Each request is counted in the second it was sent in; a second's
//! row is printed as soon as every request scheduled up to its end has been
//! answered.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use testkit::{Client, Request};

/// The load to send.
#[derive(Debug, Clone)]
pub struct Load {
    /// How many seconds to send for.
    pub seconds: u32,
    /// Requests per second.
    pub rate: u32,
    /// The request sent, again and again.
    pub request: Request,
    /// The graduated rule's `delay_ms`: a 200 that took at least this long
    /// and carried `x-ratelimit-warning` was held by the filter.
    pub delay: Option<Duration>,
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// 200 at once.
    Allowed,
    /// 200 after the filter held it (graduated rule's delay stage).
    Delayed,
    /// 429: over a rate limit.
    Limited,
    /// 403: out of quota.
    Quota,
    /// Any other status, or no answer at all.
    Other,
}

/// One answered (or failed) request.
#[derive(Debug)]
struct Sample {
    index: usize,
    sent_at: Duration,
    outcome: Outcome,
    remaining: Option<String>,
    error: Option<String>,
}

/// The counts of one second of the load.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Second {
    /// Requests sent in this second.
    pub sent: u32,
    /// Answered 200 at once.
    pub allowed: u32,
    /// Answered 200 after being held by a graduated rule.
    pub delayed: u32,
    /// Answered 429.
    pub limited: u32,
    /// Answered 403 (quota exhausted).
    pub quota: u32,
    /// Any other status, or a transport failure.
    pub other: u32,
    /// `x-ratelimit-remaining` of the last request sent in this second.
    pub remaining: Option<String>,
    last_index: Option<usize>,
}

impl Second {
    fn add(&mut self, s: &Sample) {
        self.sent += 1;
        match s.outcome {
            Outcome::Allowed => self.allowed += 1,
            Outcome::Delayed => self.delayed += 1,
            Outcome::Limited => self.limited += 1,
            Outcome::Quota => self.quota += 1,
            Outcome::Other => self.other += 1,
        }
        if self.last_index.is_none_or(|i| s.index > i) {
            self.last_index = Some(s.index);
            self.remaining.clone_from(&s.remaining);
        }
    }
}

/// The table's header lines.
pub fn header() -> String {
    format!(
        "{:>7} {:>5} {:>5} {:>7} {:>5} {:>5} {:>5}  {}\n{}",
        "second",
        "sent",
        "200",
        "delayed",
        "429",
        "403",
        "other",
        "x-ratelimit-remaining (last response)",
        "-".repeat(80)
    )
}

/// One row of the table.
pub fn row(k: usize, s: &Second) -> String {
    format!(
        "{:>7} {:>5} {:>5} {:>7} {:>5} {:>5} {:>5}  {}",
        format!("{}-{}", k, k + 1),
        s.sent,
        s.allowed,
        s.delayed,
        s.limited,
        s.quota,
        s.other,
        s.remaining.as_deref().unwrap_or("-")
    )
}

/// The totals row.
pub fn total_row(seconds: &[Second]) -> String {
    let sum = |f: fn(&Second) -> u32| seconds.iter().map(f).sum::<u32>();
    format!(
        "{}\n{:>7} {:>5} {:>5} {:>7} {:>5} {:>5} {:>5}",
        "-".repeat(80),
        "total",
        sum(|s| s.sent),
        sum(|s| s.allowed),
        sum(|s| s.delayed),
        sum(|s| s.limited),
        sum(|s| s.quota),
        sum(|s| s.other),
    )
}

/// Sends `load` through `client`, calling `on_second` with each second's
/// counts as soon as that second is complete. Stops early (returning what it
/// has) when `stop()` says so. Returns every second's counts.
pub fn run(
    client: &Client,
    load: &Load,
    stop: fn() -> bool,
    mut on_second: impl FnMut(usize, &Second),
) -> Result<Vec<Second>> {
    let rate = u64::from(load.rate.max(1));
    let seconds = load.seconds.max(1) as usize;
    let total = seconds * rate as usize;
    // Enough workers for every request in flight while others are held.
    let held_ms = load.delay.map_or(0, |d| d.as_millis() as u64) + 250;
    let workers = ((rate * held_ms / 1000) as usize + 2).clamp(2, 64);

    let next = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel::<Sample>();
    let start = Instant::now();
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let next = Arc::clone(&next);
            let tx = tx.clone();
            let client = client.clone();
            let load = load.clone();
            std::thread::spawn(move || loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= total || stop() {
                    break;
                }
                let due = start + Duration::from_nanos(index as u64 * 1_000_000_000 / rate);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                let sent = Instant::now();
                let result = client.send(&load.request);
                let latency = sent.elapsed();
                let sample = match result {
                    Ok(r) => {
                        let outcome = match r.status {
                            200 => {
                                let held = load.delay.is_some_and(|d| latency >= d)
                                    && r.header("x-ratelimit-warning").is_some();
                                if held {
                                    Outcome::Delayed
                                } else {
                                    Outcome::Allowed
                                }
                            }
                            429 => Outcome::Limited,
                            403 => Outcome::Quota,
                            _ => Outcome::Other,
                        };
                        Sample {
                            index,
                            sent_at: sent - start,
                            outcome,
                            remaining: r.header("x-ratelimit-remaining").map(str::to_string),
                            error: None,
                        }
                    }
                    Err(e) => Sample {
                        index,
                        sent_at: sent - start,
                        outcome: Outcome::Other,
                        remaining: None,
                        error: Some(format!("{e:#}")),
                    },
                };
                if tx.send(sample).is_err() {
                    break;
                }
            })
        })
        .collect();
    drop(tx);

    let mut table = vec![Second::default(); seconds];
    let mut done = vec![false; total];
    let mut answered = 0; // every request below this index is answered
    let mut printed = 0; // rows printed so far
    let mut first_error: Option<String> = None;
    while printed < seconds {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(s) => {
                // A request that left late counts in the second it left in
                // (the last one, if it left after the end).
                let k = ((s.sent_at.as_secs()) as usize).min(seconds - 1);
                table[k].add(&s);
                done[s.index] = true;
                if first_error.is_none() {
                    first_error = s.error;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        while answered < total && done[answered] {
            answered += 1;
        }
        // A request sent before the end of second k was scheduled before it,
        // so its index is below (k + 1) × rate.
        while printed < seconds && answered >= (printed + 1) * rate as usize {
            on_second(printed, &table[printed]);
            printed += 1;
        }
    }
    for h in handles {
        h.join().map_err(|_| anyhow!("a load thread panicked"))?;
    }
    if let Some(e) = first_error {
        eprintln!("note: some requests failed: {e}");
    }
    table.truncate(printed);
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(index: usize, outcome: Outcome, remaining: &str) -> Sample {
        Sample {
            index,
            sent_at: Duration::ZERO,
            outcome,
            remaining: Some(remaining.to_string()),
            error: None,
        }
    }

    #[test]
    fn a_second_counts_each_outcome_and_keeps_the_last_remaining() {
        let mut s = Second::default();
        s.add(&sample(3, Outcome::Delayed, "0"));
        s.add(&sample(1, Outcome::Allowed, "2"));
        s.add(&sample(4, Outcome::Limited, "0"));
        s.add(&sample(2, Outcome::Quota, "1"));
        assert_eq!(
            (s.sent, s.allowed, s.delayed, s.limited, s.quota, s.other),
            (4, 1, 1, 1, 1, 0)
        );
        assert_eq!(s.remaining.as_deref(), Some("0"));
        assert_eq!(
            row(1, &s),
            "    1-2     4     1       1     1     1     0  0"
        );
    }
}
