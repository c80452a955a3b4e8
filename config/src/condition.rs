//! The text forms of the newer `match` conditions and key parts, read once
//! with the configuration: host patterns (`api.example.com`,
//! `*.example.com`), metadata paths (`envoy.filters.http.jwt_authn/payload/org`),
//! query and cookie tests (`true` for present, a string for an exact
//! value), and the regular expressions of `path_regex` and `host_regex`,
//! compiled by a linear-time engine within fixed bounds.

use std::fmt;

/// A compiled `path_regex` or `host_regex`.
pub use regex_lite::Regex as Pattern;

/// Longest `path_regex` or `host_regex` pattern.
pub const MAX_PATTERN_BYTES: usize = 1024;
/// Most heap one compiled pattern may take (`regex-lite`'s size limit).
pub const MAX_PATTERN_HEAP: usize = 256 * 1024;
/// Deepest nesting of groups and repetitions in a pattern.
pub const MAX_PATTERN_NEST: u32 = 32;
/// Most patterns in one configuration: each holds up to [`MAX_PATTERN_HEAP`].
pub const MAX_PATTERNS: usize = 64;
/// Deepest nesting of `not` and `any` inside one `match`.
pub const MAX_MATCH_DEPTH: usize = 4;
/// Most alternatives of one `any`.
pub const MAX_ANY: usize = 16;
/// Most segments of a metadata path, its filter included.
pub const MAX_METADATA_SEGMENTS: usize = 8;
/// Longest name of a query parameter, a cookie or a metadata segment.
pub const MAX_NAME_BYTES: usize = 256;

/// `match.host`: one host, or every host under a domain (`*.example.com`
/// matches `api.example.com` and `a.b.example.com`, not `example.com`).
/// Compared case-insensitively with the request's `:authority`, its port
/// stripped ([`host_of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// Exactly this host, lower-case.
    Exact(String),
    /// Any host ending in this suffix, lower-case, its leading dot included.
    Suffix(String),
}

impl HostPattern {
    /// Reads `api.example.com` or `*.example.com`; the error says why.
    pub fn parse(s: &str) -> Result<HostPattern, String> {
        let (suffix, name) = match s.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let ok = !name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b));
        if !ok {
            return Err(format!(
                "{s:?} is not a host name or *.<domain> (letters, digits, - _ . only; no port)"
            ));
        }
        let name = name.to_ascii_lowercase();
        Ok(match suffix {
            true => HostPattern::Suffix(format!(".{name}")),
            false => HostPattern::Exact(name),
        })
    }

    /// Whether `host` (already without its port, any case) matches.
    pub fn matches(&self, host: &[u8]) -> bool {
        match self {
            HostPattern::Exact(h) => host.eq_ignore_ascii_case(h.as_bytes()),
            HostPattern::Suffix(s) => {
                host.len() > s.len()
                    && host
                        .get(host.len() - s.len()..)
                        .is_some_and(|end| end.eq_ignore_ascii_case(s.as_bytes()))
            }
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPattern::Exact(h) => f.write_str(h),
            HostPattern::Suffix(s) => write!(f, "*{s}"),
        }
    }
}

/// The host of an `:authority` value: without its port (`api.example.com:443`
/// → `api.example.com`, `[::1]:80` → `[::1]`) and without a trailing dot.
/// The case is left as it came: matches compare it case-insensitively, and
/// keys lower-case it.
pub fn host_of(authority: &[u8]) -> &[u8] {
    let host = if authority.first() == Some(&b'[') {
        match authority.iter().position(|&b| b == b']') {
            Some(end) => authority.get(..=end).unwrap_or(authority),
            None => authority,
        }
    } else {
        match authority.iter().rposition(|&b| b == b':') {
            Some(colon)
                if authority
                    .get(colon + 1..)
                    .is_some_and(|p| p.iter().all(u8::is_ascii_digit)) =>
            {
                authority.get(..colon).unwrap_or(authority)
            }
            _ => authority,
        }
    };
    host.strip_suffix(b".").unwrap_or(host)
}

/// A path into metadata: the filter's namespace, then the keys inside its
/// struct, written `<filter>/<key>/<key>…` (`ratelimit/plan`,
/// `envoy.filters.http.jwt_authn/payload/org`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MetadataPath(pub Vec<String>);

impl MetadataPath {
    /// Reads `<filter>/<key>…`: at least one key, no empty segment, at most
    /// [`MAX_METADATA_SEGMENTS`] segments.
    pub fn parse(s: &str) -> Result<MetadataPath, String> {
        let segments: Vec<String> = s.split('/').map(str::to_string).collect();
        let bad = segments.len() < 2
            || segments.len() > MAX_METADATA_SEGMENTS
            || segments.iter().any(|g| {
                g.is_empty() || g.len() > MAX_NAME_BYTES || g.chars().any(char::is_control)
            });
        if bad {
            return Err(format!(
                "{s:?} is not a metadata path (<filter>/<key>[/<key>…], 2 to \
                 {MAX_METADATA_SEGMENTS} non-empty segments)"
            ));
        }
        Ok(MetadataPath(segments))
    }
}

impl fmt::Display for MetadataPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("/"))
    }
}

/// What a `query` or `cookie` condition asks of one name: that it is
/// present (`true`), or present with exactly this decoded value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueMatch {
    /// `true`: present, with any value (an empty one included).
    Present,
    /// A string: present with this value, once decoded.
    Exact(String),
}

/// What [`ValueMatch`] reads, as serde words it in an error.
pub const VALUE_MATCH_EXPECTING: &str = "a string or true";

impl<'de> serde::Deserialize<'de> for ValueMatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ValueMatch;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(VALUE_MATCH_EXPECTING)
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ValueMatch, E> {
                Ok(ValueMatch::Exact(s.to_string()))
            }
            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<ValueMatch, E> {
                match b {
                    true => Ok(ValueMatch::Present),
                    false => Err(E::invalid_value(serde::de::Unexpected::Bool(b), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// True for a query parameter or cookie name a condition or key may use.
pub fn name_problem(kind: &str, name: &str) -> Option<String> {
    let bad = name.is_empty() || name.len() > MAX_NAME_BYTES || name.chars().any(char::is_control);
    bad.then(|| {
        format!("{name:?} is not a {kind} name (1-{MAX_NAME_BYTES} bytes, no control characters)")
    })
}

/// Compiles a `path_regex` or `host_regex` that must match the whole value
/// (as Envoy's route `safe_regex` does), within [`MAX_PATTERN_BYTES`],
/// [`MAX_PATTERN_HEAP`] and [`MAX_PATTERN_NEST`]. `regex-lite` runs in
/// time linear in the pattern and the text, whatever either holds.
/// `host_regex` compiles with `case_insensitive`, as hosts compare.
pub fn compile_pattern(pattern: &str, case_insensitive: bool) -> Result<Pattern, String> {
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(format!("must be at most {MAX_PATTERN_BYTES} bytes"));
    }
    regex_lite::RegexBuilder::new(&format!("^(?:{pattern})$"))
        .case_insensitive(case_insensitive)
        .size_limit(MAX_PATTERN_HEAP)
        .nest_limit(MAX_PATTERN_NEST)
        .build()
        .map_err(|e| format!("{pattern:?} is not a regular expression: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_lose_their_port_and_match_in_any_case() {
        assert_eq!(host_of(b"API.example.com:443"), b"API.example.com");
        assert_eq!(host_of(b"api.example.com."), b"api.example.com");
        assert_eq!(host_of(b"[::1]:8080"), b"[::1]");
        assert_eq!(host_of(b"[::1"), b"[::1");
        assert_eq!(host_of(b"a:b"), b"a:b");
        let exact = HostPattern::parse("Api.Example.com").unwrap();
        assert!(exact.matches(host_of(b"API.example.COM:443")));
        assert!(!exact.matches(b"api.example.org"));
        let suffix = HostPattern::parse("*.example.com").unwrap();
        assert!(suffix.matches(b"a.b.EXAMPLE.com"));
        assert!(!suffix.matches(b"example.com"));
        assert!(!suffix.matches(b".example.com"));
        assert!(!suffix.matches(b"badexample.com"));
        assert_eq!(suffix.to_string(), "*.example.com");
        for bad in ["", "*.", "a b", "a:443", "*example.com", "a/b"] {
            assert!(HostPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn metadata_paths_need_a_filter_and_a_key() {
        let p = MetadataPath::parse("envoy.filters.http.jwt_authn/payload/org").unwrap();
        assert_eq!(p.0.len(), 3);
        assert_eq!(p.to_string(), "envoy.filters.http.jwt_authn/payload/org");
        for bad in [
            "ratelimit",
            "ratelimit/",
            "/plan",
            "a//b",
            "a/b/c/d/e/f/g/h/i",
        ] {
            assert!(MetadataPath::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn patterns_match_whole_and_refuse_what_cannot_compile() {
        let r = compile_pattern("/v[0-9]+/.*", false).unwrap();
        assert!(r.is_match("/v1/users"));
        assert!(!r.is_match("/x/v1/users"));
        assert!(compile_pattern("api[.]example[.]com", true)
            .unwrap()
            .is_match("API.example.com"));
        assert!(compile_pattern("(", false).is_err());
        assert!(compile_pattern(&"a".repeat(MAX_PATTERN_BYTES + 1), false).is_err());
        // Over the heap bound: a counted repetition of a large class.
        for big in [r"[a-z]{1000}{1000}", r"(?:\w{500}){500}"] {
            assert!(compile_pattern(big, false).is_err(), "{big}");
        }
        assert!(compile_pattern(&format!("{}a{}", "(".repeat(40), ")".repeat(40)), false).is_err());
    }
}
