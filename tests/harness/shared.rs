//! Shared data with the semantics of proxy-wasm-cpp-host `src/shared_data.cc` (what Envoy uses):
//! one map key -> (value, cas); a single cas counter that starts at 1, is taken by every
//! successful set and skips 0 when it wraps; `get` of a missing key is NotFound; `set` with
//! cas 0 writes unconditionally; `set` on an existing key whose cas differs from a non-zero
//! `cas` argument returns CasMismatch and writes nothing; `set` on a missing key always succeeds.

use std::collections::BTreeMap;

/// proxy-wasm ABI 0.2.1 status codes (`proxy_wasm::types::Status`).
pub mod status {
    pub const OK: u32 = 0;
    pub const NOT_FOUND: u32 = 1;
    pub const BAD_ARGUMENT: u32 = 2;
    pub const SERIALIZATION_FAILURE: u32 = 3;
    pub const PARSE_FAILURE: u32 = 4;
    pub const EMPTY: u32 = 7;
    pub const CAS_MISMATCH: u32 = 8;
    pub const INTERNAL_FAILURE: u32 = 10;
    pub const UNIMPLEMENTED: u32 = 12;
}

/// Counters of the hostcalls the filter made (calls made directly by tests are not counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedStats {
    /// `proxy_get_shared_data` calls.
    pub gets: u64,
    /// ... of which returned NotFound.
    pub get_misses: u64,
    /// `proxy_set_shared_data` calls.
    pub sets: u64,
    /// ... of which were applied.
    pub sets_ok: u64,
    /// ... of which passed a non-zero cas.
    pub cas_sets: u64,
    /// ... of which returned CasMismatch (real conflicts and injected failures).
    pub cas_mismatches: u64,
    /// ... of which were injected by `Harness::fail_next_cas_sets`.
    pub injected_cas_mismatches: u64,
}

/// The shared key/value store of one VM id (all workers of a `Harness`).
#[derive(Debug)]
pub struct SharedData {
    map: BTreeMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    pub(crate) stats: SharedStats,
}

impl Default for SharedData {
    fn default() -> Self {
        Self::new()
    }
}

impl SharedData {
    pub fn new() -> Self {
        SharedData {
            map: BTreeMap::new(),
            next_cas: 1,
            stats: SharedStats::default(),
        }
    }

    fn take_cas(&mut self) -> u32 {
        let result = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1);
        if self.next_cas == 0 {
            self.next_cas = 1;
        }
        result
    }

    /// Envoy's `SharedData::get`: `Ok((value, cas))` or `Err(NOT_FOUND)`.
    pub fn get(&self, key: &str) -> Result<(Vec<u8>, u32), u32> {
        match self.map.get(key) {
            Some((value, cas)) => Ok((value.clone(), *cas)),
            None => Err(status::NOT_FOUND),
        }
    }

    /// Envoy's `SharedData::set`: `Ok(())` or `Err(CAS_MISMATCH)`.
    pub fn set(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), u32> {
        if let Some(entry) = self.map.get(key) {
            if cas != 0 && cas != entry.1 {
                return Err(status::CAS_MISMATCH);
            }
        }
        let new_cas = self.take_cas();
        self.map.insert(key.to_string(), (value.to_vec(), new_cas));
        Ok(())
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Total bytes of all keys and values.
    pub fn total_bytes(&self) -> usize {
        self.map.iter().map(|(k, (v, _))| k.len() + v.len()).sum()
    }

    /// Keys in sorted order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(|k| k.as_str())
    }

    /// Entries in key order: (key, value, cas).
    pub fn entries(&self) -> impl Iterator<Item = (&str, &[u8], u32)> {
        self.map
            .iter()
            .map(|(k, (v, c))| (k.as_str(), v.as_slice(), *c))
    }

    /// The cas the next successful set will get.
    pub fn next_cas(&self) -> u32 {
        self.next_cas
    }

    /// Test hook: move the cas counter (e.g. close to `u32::MAX` to exercise the wrap).
    /// 0 is not a valid cas and is turned into 1, like the wrap does.
    pub fn set_next_cas(&mut self, cas: u32) {
        self.next_cas = if cas == 0 { 1 } else { cas };
    }

    pub fn stats(&self) -> SharedStats {
        self.stats
    }
}
