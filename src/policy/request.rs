//! What the filter reads from one request, fetched once from the host.

/// Index into [`RequestInfo::headers`], fixed when the configuration is compiled.
pub type HeaderId = usize;

/// Position of `:method` in every plan's header list.
pub const METHOD: HeaderId = 0;
/// Position of `:path` in every plan's header list.
pub const PATH: HeaderId = 1;

/// The request as the limiter sees it: only the headers the configuration needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestInfo {
    /// Values of the plan's headers, in the plan's order; `None` when absent.
    pub headers: Vec<Option<Vec<u8>>>,
    /// The downstream peer as `ip:port` (Envoy's `source.address`), when known.
    pub source_address: Option<Vec<u8>>,
    /// The client id from Envoy metadata, when the plan reads it.
    pub client_metadata: Option<Vec<u8>>,
    /// The tier from Envoy metadata, when the plan reads it.
    pub tier_metadata: Option<Vec<u8>>,
}

impl RequestInfo {
    /// A header's value, when present.
    pub fn header(&self, id: HeaderId) -> Option<&[u8]> {
        self.headers.get(id).and_then(|v| v.as_deref())
    }

    /// The request method, or empty.
    pub fn method(&self) -> &[u8] {
        self.header(METHOD).unwrap_or_default()
    }

    /// The path without its query string, or empty.
    pub fn path(&self) -> &[u8] {
        let full = self.header(PATH).unwrap_or_default();
        match full.iter().position(|&b| b == b'?') {
            Some(q) => full.get(..q).unwrap_or(full),
            None => full,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_drops_the_query() {
        let r = RequestInfo {
            headers: vec![Some(b"GET".to_vec()), Some(b"/a/b?x=1".to_vec())],
            ..RequestInfo::default()
        };
        assert_eq!(r.path(), b"/a/b");
        assert_eq!(r.method(), b"GET");
        assert_eq!(RequestInfo::default().path(), b"");
    }
}
