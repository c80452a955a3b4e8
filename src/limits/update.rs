//! The one read-modify-CAS loop over a shared-data key. Every writer of a
//! single key goes through it: the lease slots, the circuit breaker, a
//! refund in the bucket table, and the proxy's hash seed and clock epoch.
//! (A request's charge writes several sets all or nothing and has its own
//! loop in [`super::limiter`].)

use super::store::{SharedStore, StoreError, CREATE_ONLY};

/// Why an [`update`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateError {
    /// The host's shared data failed.
    Store(StoreError),
    /// Every attempt lost the compare-and-swap to another writer.
    Contention,
}

impl From<StoreError> for UpdateError {
    fn from(e: StoreError) -> Self {
        UpdateError::Store(e)
    }
}

/// Reads `key`, hands its value to `change` (`None`: never written), and
/// writes what `change` returns with compare-and-swap on the version read;
/// `(None, out)` leaves the key as it is. A missing key is written
/// create-only, so two first writers cannot overwrite each other. Retries
/// `change` on a fresh read when another writer came first, at most
/// `attempts` times.
pub fn update<T>(
    store: &impl SharedStore,
    key: &str,
    attempts: u32,
    mut change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
) -> Result<T, UpdateError> {
    for _ in 0..attempts {
        let found = store.get(key)?;
        let (new, out) = change(found.as_ref().map(|(bytes, _)| bytes.as_slice()));
        let Some(new) = new else {
            return Ok(out);
        };
        // A version of 0 would be an unconditional write on Envoy's host.
        let cas = found.map_or(CREATE_ONLY, |(_, cas)| cas.max(1));
        if store.compare_and_set(key, &new, cas)? {
            return Ok(out);
        }
    }
    Err(UpdateError::Contention)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::store::MemoryStore;
    use std::cell::Cell;

    /// A store whose every write loses to another writer that bumps the key first.
    struct Racing {
        inner: MemoryStore,
        lost: Cell<u32>,
    }

    impl SharedStore for Racing {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.inner.get(key)
        }
        fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError> {
            if self.lost.get() > 0 {
                self.lost.set(self.lost.get() - 1);
                // The other writer: a plain write that changes the version.
                self.inner.compare_and_set(key, b"theirs", 0)?;
            }
            self.inner.compare_and_set(key, value, cas)
        }
    }

    #[test]
    fn a_missing_key_is_created_and_a_kept_value_is_not_written() {
        let store = MemoryStore::default();
        let seen = update(&store, "k", 4, |v| (Some(b"one".to_vec()), v.is_none())).unwrap();
        assert!(seen);
        assert_eq!(store.get("k").unwrap().unwrap().0, b"one");
        let before = store.get("k").unwrap().unwrap().1;
        let len = update(&store, "k", 4, |v| (None, v.map_or(0, <[u8]>::len))).unwrap();
        assert_eq!(len, 3);
        assert_eq!(store.get("k").unwrap().unwrap().1, before);
    }

    #[test]
    fn a_lost_race_reruns_the_change_on_the_winners_value() {
        let store = Racing {
            inner: MemoryStore::default(),
            lost: Cell::new(2),
        };
        store.inner.compare_and_set("k", b"0", CREATE_ONLY).unwrap();
        let mut calls = Vec::new();
        let out = update(&store, "k", 4, |v| {
            calls.push(v.map(<[u8]>::to_vec));
            (Some(b"mine".to_vec()), calls.len())
        })
        .unwrap();
        assert_eq!(out, 3);
        assert_eq!(
            calls,
            vec![
                Some(b"0".to_vec()),
                Some(b"theirs".to_vec()),
                Some(b"theirs".to_vec())
            ]
        );
        assert_eq!(store.inner.get("k").unwrap().unwrap().0, b"mine");
    }

    #[test]
    fn attempts_run_out_as_contention() {
        let store = Racing {
            inner: MemoryStore::default(),
            lost: Cell::new(u32::MAX),
        };
        let mut calls = 0;
        let r = update(&store, "k", 5, |_| {
            calls += 1;
            (Some(b"mine".to_vec()), ())
        });
        assert_eq!(r, Err(UpdateError::Contention));
        assert_eq!(calls, 5);
    }
}
