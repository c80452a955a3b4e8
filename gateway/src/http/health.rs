//! One Redis write probe per interval, shared by `/healthz`, `/readyz` and
//! the gRPC health service: health checks come from anyone who reaches the
//! port, unauthenticated, so each one must not cost a Redis write. The first
//! caller after the interval probes; callers meanwhile, and those waiting on
//! that probe, answer from its result.

use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use crate::redis::store::Store;

/// How long one probe's answer stands.
pub const EVERY: Duration = Duration::from_secs(1);

/// Redis as the last probe found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redis {
    /// A write went through.
    Up,
    /// The write was refused: Redis is a replica (`READONLY`).
    ReadOnly,
    /// The write was refused: Redis is full under `noeviction` (`OOM`).
    Oom,
    /// No connection, no answer in time, or another error.
    Down,
}

impl Redis {
    /// The `redis` field of `/healthz`'s answer.
    pub fn name(self) -> &'static str {
        match self {
            Redis::Up => "up",
            Redis::ReadOnly => "readonly",
            Redis::Oom => "oom",
            Redis::Down => "down",
        }
    }
}

/// The shared probe result.
#[derive(Debug, Default)]
pub struct Probe {
    last: Mutex<Option<(Instant, Redis)>>,
}

impl Probe {
    /// Redis's state, probed at most once per [`EVERY`].
    pub async fn redis(&self, store: &Store) -> Redis {
        // Held across the probe: concurrent callers wait for its result
        // rather than each writing.
        let mut last = self.last.lock().await;
        if let Some((at, state)) = *last {
            if at.elapsed() < EVERY {
                return state;
            }
        }
        let state = match store.probe_write().await {
            Ok(()) => Redis::Up,
            Err(e) => {
                tracing::debug!(error = %crate::logging::Escaped(&e), "health check: cannot write to Redis");
                match e.kind() {
                    "readonly" => Redis::ReadOnly,
                    "oom" => Redis::Oom,
                    _ => Redis::Down,
                }
            }
        };
        *last = Some((Instant::now(), state));
        state
    }
}
