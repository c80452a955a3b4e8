//! Envoy's shared data as a small trait, the namespace of every key the
//! filter writes in it, and an in-memory store with Envoy's exact semantics
//! for tests.

use std::cell::RefCell;
use std::collections::HashMap;

/// Prefix of every shared-data key the filter writes (Istio shares one namespace between plugins).
pub const KEY_PREFIX: &str = "ratelimit-wasm/";

/// `prefix` then `index` in decimal: the key of one of a layout's sets,
/// built without the formatting machinery (it is on every request's path).
pub fn numbered_key(prefix: &str, index: u64) -> String {
    let mut n = itoa::Buffer::new();
    let index = n.format(index);
    let mut key = String::with_capacity(prefix.len() + index.len());
    key.push_str(prefix);
    key.push_str(index);
    key
}

/// A version number ("cas") that makes a write create the key only if it is
/// missing. Envoy's host creates a missing key whatever the cas, and refuses a
/// write to an existing key unless the cas equals its current version. Versions
/// come from one global counter starting at 1, so an existing entry carries
/// `u32::MAX` only after four billion writes, and only one entry at a time.
pub const CREATE_ONLY: u32 = u32::MAX;

/// A failure of the host's shared data (never a CAS mismatch, which is normal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreError(pub u32);

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "shared data call failed with status {}", self.0)
    }
}

/// Envoy shared data, one map for every worker of a proxy.
pub trait SharedStore {
    /// The value and its version, or `None` when the key was never written.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    /// Writes `value` if the key's version is still `cas` (or the key is
    /// missing); `Ok(false)` when another writer came first. `cas` must not be 0,
    /// which the host treats as an unconditional write.
    fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError>;
}

/// In-memory [`SharedStore`] with the semantics of proxy-wasm-cpp-host's `shared_data.cc`.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: RefCell<MemoryInner>,
}

#[derive(Debug, Default)]
struct MemoryInner {
    map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl MemoryStore {
    /// Number of keys ever written.
    pub fn len(&self) -> usize {
        self.inner.borrow().map.len()
    }

    /// True when nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held in keys and values.
    pub fn bytes(&self) -> usize {
        self.inner
            .borrow()
            .map
            .iter()
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }
}

impl SharedStore for MemoryStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        Ok(self.inner.borrow().map.get(key).cloned())
    }

    fn compare_and_set(&self, key: &str, value: &[u8], cas: u32) -> Result<bool, StoreError> {
        let mut inner = self.inner.borrow_mut();
        let version = inner.next_cas.max(1);
        if let Some((_, current)) = inner.map.get(key) {
            if cas != 0 && cas != *current {
                return Ok(false);
            }
        }
        inner.next_cas = version.wrapping_add(1).max(1);
        inner.map.insert(key.to_string(), (value.to_vec(), version));
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_envoy_semantics() {
        let s = MemoryStore::default();
        assert_eq!(s.get("k").unwrap(), None);
        // A missing key is created whatever the cas.
        assert!(s.compare_and_set("k", b"a", 12345).unwrap());
        let (v, cas) = s.get("k").unwrap().unwrap();
        assert_eq!((v.as_slice(), cas), (b"a".as_slice(), 1));
        assert!(!s.compare_and_set("k", b"b", CREATE_ONLY).unwrap());
        assert!(!s.compare_and_set("k", b"b", 7).unwrap());
        assert!(s.compare_and_set("k", b"b", cas).unwrap());
        assert_eq!(s.get("k").unwrap().unwrap(), (b"b".to_vec(), 2));
        assert!(s.compare_and_set("j", b"x", 0).unwrap());
        assert_eq!(s.get("j").unwrap().unwrap().1, 3);
        assert_eq!(s.len(), 2);
        assert_eq!(s.bytes(), 4);
    }
}
