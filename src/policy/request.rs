//! What the filter reads from one request, fetched once from the host.

/// Index into [`RequestInfo::headers`], fixed when the configuration is compiled.
pub type HeaderId = usize;

/// Position of `:method` in every plan's header list.
pub const METHOD: HeaderId = 0;
/// Position of `:path` in every plan's header list.
pub const PATH: HeaderId = 1;

/// Index into [`RequestInfo::properties`], fixed when the configuration is compiled.
pub type PropertyId = usize;

/// Where a compiled matcher or key finds what it reads: it registers each
/// header and property once, and keeps the index the request's lists use.
pub trait Reads {
    /// The index of header `name` (any case).
    fn header(&mut self, name: &str) -> HeaderId;
    /// The index of the property at `path` (Envoy's attribute path).
    fn property(&mut self, path: Vec<String>) -> PropertyId;
}

/// The `:authority` header, whose host `match.host` and the `host` key read.
pub const AUTHORITY: &str = ":authority";
/// The `cookie` header, which `match.cookie` and `cookie:` keys read.
pub const COOKIE: &str = "cookie";

/// Envoy's property of the matched route's name.
pub fn route_name_path() -> Vec<String> {
    vec!["xds".into(), "route_name".into()]
}

/// Envoy's property path of a value in the matched route's `filter_metadata`.
pub fn route_metadata_path(path: &[String]) -> Vec<String> {
    let mut out: Vec<String> = ["xds", "route_metadata", "filter_metadata"]
        .map(String::from)
        .to_vec();
    out.extend(path.iter().cloned());
    out
}

/// Envoy's property path of a value in the request's dynamic metadata
/// (`metadata.filter_metadata`, where `jwt_authn` writes its payload).
pub fn metadata_path(path: &[String]) -> Vec<String> {
    let mut out = vec!["metadata".to_string(), "filter_metadata".to_string()];
    out.extend(path.iter().cloned());
    out
}

/// The request as the limiter sees it: only the headers the configuration needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestInfo {
    /// Values of the plan's headers, in the plan's order; `None` when absent.
    pub headers: Vec<Option<Vec<u8>>>,
    /// Values of the plan's properties (route name, route and dynamic
    /// metadata that some condition or key reads), in the plan's order;
    /// `None` when absent.
    pub properties: Vec<Option<Vec<u8>>>,
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

    /// A property's value, when present.
    pub fn property(&self, id: PropertyId) -> Option<&[u8]> {
        self.properties.get(id).and_then(|v| v.as_deref())
    }

    /// The same request with property `id` of the plan's list set to `value`
    /// (the host layer fetches them; tests set them here).
    pub fn with_property(mut self, id: PropertyId, value: &[u8]) -> RequestInfo {
        if self.properties.len() <= id {
            self.properties.resize(id + 1, None);
        }
        if let Some(slot) = self.properties.get_mut(id) {
            *slot = Some(value.to_vec());
        }
        self
    }

    /// The request method, or empty.
    pub fn method(&self) -> &[u8] {
        self.header(METHOD).unwrap_or_default()
    }

    /// A request laid out for a plan whose header list is `names` (its
    /// `header_names`): each header's value is `value(name)`, `None` when
    /// absent. The one way to build a request outside the host layer (unit
    /// tests, `tests/`, the fuzz targets), so its layout is written once.
    pub fn from_headers(
        names: &[String],
        value: impl FnMut(&str) -> Option<Vec<u8>>,
    ) -> RequestInfo {
        let mut value = value;
        RequestInfo {
            headers: names.iter().map(|n| value(n)).collect(),
            ..RequestInfo::default()
        }
    }

    /// [`RequestInfo::from_headers`] with the values given as (name, value)
    /// pairs; names compare case-insensitively (a plan's names are lower-case).
    pub fn with_headers(names: &[String], named: &[(&str, &[u8])]) -> RequestInfo {
        RequestInfo::from_headers(names, |n| {
            named
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .map(|(_, v)| v.to_vec())
        })
    }

    /// The same request from the peer `address` (`ip:port`).
    pub fn with_source(mut self, address: &[u8]) -> RequestInfo {
        self.source_address = Some(address.to_vec());
        self
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

    #[test]
    fn built_from_named_headers_in_the_plans_order() {
        let names: Vec<String> = [":method", ":path", "x-client-id", "x-tier"]
            .map(String::from)
            .to_vec();
        let r = RequestInfo::with_headers(&names, &[("X-Client-Id", b"alice"), (":path", b"/")])
            .with_source(b"10.0.0.1:4000");
        assert_eq!(
            r.headers,
            vec![None, Some(b"/".to_vec()), Some(b"alice".to_vec()), None]
        );
        assert_eq!(r.source_address.as_deref(), Some(&b"10.0.0.1:4000"[..]));
        assert_eq!((r.client_metadata, r.tier_metadata), (None, None));
    }
}
