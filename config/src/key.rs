//! Rate-limit keys: the parts a rule or quota keys on ([`KeyPart`], read once
//! with the configuration), and the gateway key encoding that the filter
//! writes and the gateway rebuilds for a native descriptor ([`encode_part`],
//! [`bounded`]).

use super::condition::{name_problem, MetadataPath};
use super::syntax::header_name_problem;
use std::fmt;

/// One part of a rule's or quota's key. `N` names what a named part reads
/// (a header, a query parameter, a cookie, a metadata path): as written
/// (`String`) in the configuration, the filter's compiled id once the
/// policy is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyPart<N = String> {
    /// `client`: the authenticated client id, or the client IP when there is none.
    Client,
    /// `ip`: the client IP.
    Ip,
    /// `method`: the request method.
    Method,
    /// `path`: the path without query.
    Path,
    /// `host`: the host (`:authority`), port stripped, lower-case.
    Host,
    /// `route`: the name of the Envoy route the request matched; a request
    /// that matched no named route is not limited by the rule.
    Route,
    /// `ip/<len>` or `ip/<v4-len>/<v6-len>`: the client IP's network, its
    /// address masked to the prefix length of its family.
    IpPrefix {
        /// Prefix length for an IPv4 client, 0 to 32.
        v4: u8,
        /// Prefix length for an IPv6 client, 0 to 128.
        v6: u8,
    },
    /// `header:<name>`: a request header; a request without it is not limited by the rule.
    Header(N),
    /// `query:<name>`: a query parameter's value, decoded; absent: not limited.
    Query(N),
    /// `cookie:<name>`: a cookie's value, decoded; absent: not limited.
    Cookie(N),
    /// `metadata:<filter>/<key>…`: a string in the request's dynamic
    /// metadata (a `jwt_authn` claim, what `ext_authz` wrote); absent: not limited.
    Metadata(N),
}

/// What a named key part reads, for [`KeyPart::map_name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameKind {
    /// A request header.
    Header,
    /// A query parameter.
    Query,
    /// A cookie.
    Cookie,
    /// A path into dynamic metadata.
    Metadata,
}

impl NameKind {
    /// Every kind, in the order their prefixes are tried.
    pub const ALL: [NameKind; 4] = [
        NameKind::Header,
        NameKind::Query,
        NameKind::Cookie,
        NameKind::Metadata,
    ];

    /// What the configuration writes before the name: `header:`, `query:`, …
    pub fn prefix(self) -> &'static str {
        match self {
            NameKind::Header => "header:",
            NameKind::Query => "query:",
            NameKind::Cookie => "cookie:",
            NameKind::Metadata => "metadata:",
        }
    }

    /// Why `name` cannot be named by this kind of part, or `None`.
    fn problem(self, name: &str) -> Option<String> {
        match self {
            NameKind::Header => header_name_problem(name),
            NameKind::Query => name_problem("query parameter", name),
            NameKind::Cookie => name_problem("cookie", name),
            NameKind::Metadata => MetadataPath::parse(name).err(),
        }
    }
}

/// What an IP prefix part starts with.
const IP_PREFIX: &str = "ip/";

impl<N> KeyPart<N> {
    /// The parts named by a word alone.
    pub const WORDS: [KeyPart<N>; 6] = [
        KeyPart::Client,
        KeyPart::Ip,
        KeyPart::Method,
        KeyPart::Path,
        KeyPart::Host,
        KeyPart::Route,
    ];

    /// The part's one-byte tag in an encoded key (`c=alice/p=%2Fa`), which
    /// makes parts of different kinds never collide.
    pub fn tag(&self) -> u8 {
        match self {
            KeyPart::Client => b'c',
            KeyPart::Ip => b'i',
            KeyPart::Method => b'm',
            KeyPart::Path => b'p',
            KeyPart::Host => b'a',
            KeyPart::Route => b'u',
            KeyPart::IpPrefix { .. } => b'n',
            KeyPart::Header(_) => b'h',
            KeyPart::Query(_) => b'q',
            KeyPart::Cookie(_) => b'k',
            KeyPart::Metadata(_) => b'x',
        }
    }

    /// The configuration word of a part named by one (`None` for the others).
    pub fn word(&self) -> Option<&'static str> {
        match self {
            KeyPart::Client => Some("client"),
            KeyPart::Ip => Some("ip"),
            KeyPart::Method => Some("method"),
            KeyPart::Path => Some("path"),
            KeyPart::Host => Some("host"),
            KeyPart::Route => Some("route"),
            KeyPart::IpPrefix { .. }
            | KeyPart::Header(_)
            | KeyPart::Query(_)
            | KeyPart::Cookie(_)
            | KeyPart::Metadata(_) => None,
        }
    }

    /// The name a named part reads, and its kind.
    pub fn name(&self) -> Option<(NameKind, &N)> {
        match self {
            KeyPart::Header(n) => Some((NameKind::Header, n)),
            KeyPart::Query(n) => Some((NameKind::Query, n)),
            KeyPart::Cookie(n) => Some((NameKind::Cookie, n)),
            KeyPart::Metadata(n) => Some((NameKind::Metadata, n)),
            KeyPart::Client
            | KeyPart::Ip
            | KeyPart::Method
            | KeyPart::Path
            | KeyPart::Host
            | KeyPart::Route
            | KeyPart::IpPrefix { .. } => None,
        }
    }

    /// The same part with its name (if it has one) given by `f(kind, name)`.
    pub fn map_name<G>(&self, f: impl FnOnce(NameKind, &N) -> G) -> KeyPart<G> {
        match self {
            KeyPart::Client => KeyPart::Client,
            KeyPart::Ip => KeyPart::Ip,
            KeyPart::Method => KeyPart::Method,
            KeyPart::Path => KeyPart::Path,
            KeyPart::Host => KeyPart::Host,
            KeyPart::Route => KeyPart::Route,
            KeyPart::IpPrefix { v4, v6 } => KeyPart::IpPrefix { v4: *v4, v6: *v6 },
            KeyPart::Header(n) => KeyPart::Header(f(NameKind::Header, n)),
            KeyPart::Query(n) => KeyPart::Query(f(NameKind::Query, n)),
            KeyPart::Cookie(n) => KeyPart::Cookie(f(NameKind::Cookie, n)),
            KeyPart::Metadata(n) => KeyPart::Metadata(f(NameKind::Metadata, n)),
        }
    }
}

/// Reads `ip/<len>` (the same length for both families, at most each
/// family's width) or `ip/<v4-len>/<v6-len>`.
fn ip_prefix(s: &str) -> Result<(u8, u8), String> {
    let len = |t: &str, max: u8| t.parse::<u8>().ok().filter(|n| *n <= max);
    let parsed = match s.split_once('/') {
        None => len(s, 128).map(|n| (n.min(32), n)),
        Some((v4, v6)) => len(v4, 32).zip(len(v6, 128)),
    };
    parsed.ok_or_else(|| {
        format!(
            "{IP_PREFIX}{s:?} is not an IP prefix (ip/<len> up to 128, or \
             ip/<IPv4 len up to 32>/<IPv6 len up to 128>)"
        )
    })
}

impl KeyPart {
    /// Reads a configuration key part: a word of [`KeyPart::WORDS`],
    /// `ip/<len>`, or a named part (`header:<name>`, `query:<name>`,
    /// `cookie:<name>`, `metadata:<filter>/<key>…`); the error says why,
    /// for the caller to place.
    pub fn parse(s: &str) -> Result<KeyPart, String> {
        for kind in NameKind::ALL {
            if let Some(name) = s.strip_prefix(kind.prefix()) {
                if let Some(why) = kind.problem(name) {
                    return Err(why);
                }
                let name = name.to_string();
                return Ok(match kind {
                    NameKind::Header => KeyPart::Header(name),
                    NameKind::Query => KeyPart::Query(name),
                    NameKind::Cookie => KeyPart::Cookie(name),
                    NameKind::Metadata => KeyPart::Metadata(name),
                });
            }
        }
        if let Some(lens) = s.strip_prefix(IP_PREFIX) {
            let (v4, v6) = ip_prefix(lens)?;
            return Ok(KeyPart::IpPrefix { v4, v6 });
        }
        if let Some(part) = Self::WORDS.into_iter().find(|p| p.word() == Some(s)) {
            return Ok(part);
        }
        let mut forms: Vec<String> = Self::WORDS
            .iter()
            .filter_map(|p| p.word())
            .map(String::from)
            .collect();
        forms.push(format!("{IP_PREFIX}<len>"));
        forms.extend(NameKind::ALL.iter().map(|k| match k {
            NameKind::Metadata => format!("{}<filter>/<key>", k.prefix()),
            _ => format!("{}<name>", k.prefix()),
        }));
        let last = forms.pop().unwrap_or_default();
        Err(format!(
            "{s:?} is not a key part ({} or {last})",
            forms.join(", ")
        ))
    }
}

impl fmt::Display for KeyPart {
    /// The configuration form: `client`, …, `ip/24`, `header:<name>`, …
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(w) = self.word() {
            return f.write_str(w);
        }
        if let Some((kind, name)) = self.name() {
            return write!(f, "{}{name}", kind.prefix());
        }
        match self {
            // The short form when it reads back as the same pair.
            KeyPart::IpPrefix { v4, v6 } if *v4 == (*v6).min(32) => write!(f, "{IP_PREFIX}{v6}"),
            KeyPart::IpPrefix { v4, v6 } => write!(f, "{IP_PREFIX}{v4}/{v6}"),
            _ => Ok(()),
        }
    }
}

impl<'de> serde::Deserialize<'de> for KeyPart {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        KeyPart::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Longest key-part value sent to the gateway as it is; longer ones are hashed.
pub const MAX_GLOBAL_PART_BYTES: usize = 128;

/// Appends one part to a global (gateway) key as `tag=value`, percent-encoding
/// anything but unreserved characters, or `tag#<hash>` for long values. The
/// hash is unkeyed so every proxy computes the same key. The first part also
/// becomes the Redis Cluster hash tag when `tag_out` is given.
pub fn encode_part(key: &mut String, tag_out: Option<&mut String>, tag: u8, value: &[u8]) {
    use siphasher::sip128::{Hasher128, SipHasher13};
    use std::fmt::Write;
    use std::hash::Hasher;
    if !key.is_empty() {
        key.push('/');
    }
    let body_start = key.len();
    key.push(char::from(tag));
    if value.len() > MAX_GLOBAL_PART_BYTES {
        let mut h = SipHasher13::new();
        h.write(value);
        let _ = write!(key, "#{:032x}", h.finish128().as_u128());
    } else {
        key.push('=');
        for &b in value {
            if b.is_ascii_alphanumeric() || b"-._~:@".contains(&b) {
                key.push(char::from(b));
            } else {
                let _ = write!(key, "%{b:02X}");
            }
        }
    }
    if let Some(t) = tag_out {
        t.push_str(key.get(body_start..).unwrap_or_default());
    }
}

/// Longest global key sent to the gateway, which refuses keys over 512 bytes.
pub const MAX_GLOBAL_KEY_BYTES: usize = 512;

/// `key` itself when it fits the gateway's bound, else `<name>#<hash of key>`:
/// several long parts together must not make a key the gateway refuses.
pub fn bounded(key: String, name: &str) -> String {
    use siphasher::sip128::{Hasher128, SipHasher13};
    use std::hash::Hasher;
    if key.len() <= MAX_GLOBAL_KEY_BYTES {
        return key;
    }
    let mut h = SipHasher13::new();
    h.write(key.as_bytes());
    format!("{name}#{:032x}", h.finish128().as_u128())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One part of every kind, in the configuration's form.
    const SAMPLES: [&str; 14] = [
        "client",
        "ip",
        "method",
        "path",
        "host",
        "route",
        "ip/24",
        "ip/64",
        "ip/24/64",
        "ip/0",
        "header:x-tenant",
        "query:api_key",
        "cookie:session",
        "metadata:envoy.filters.http.jwt_authn/payload/org",
    ];

    #[test]
    fn key_parts_read_back_as_written() {
        for s in SAMPLES {
            assert_eq!(KeyPart::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(KeyPart::parse("header:x-tenant").unwrap().tag(), b'h');
        assert_eq!(
            KeyPart::parse("ip/24").unwrap(),
            KeyPart::IpPrefix { v4: 24, v6: 24 }
        );
        assert_eq!(
            KeyPart::parse("ip/64").unwrap(),
            KeyPart::IpPrefix { v4: 32, v6: 64 }
        );
        assert_eq!(
            KeyPart::parse("cookie").unwrap_err(),
            r#""cookie" is not a key part (client, ip, method, path, host, route, ip/<len>, header:<name>, query:<name>, cookie:<name> or metadata:<filter>/<key>)"#
        );
        assert_eq!(
            KeyPart::parse("header:a b").unwrap_err(),
            r#""a b" is not a header name"#
        );
        for bad in [
            "ip/33/64",
            "ip/129",
            "ip/x",
            "ip/24/",
            "query:",
            "metadata:jwt",
            "cookie:a\nb",
        ] {
            assert!(KeyPart::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_kind_has_its_own_tag() {
        // ip/24, ip/64, ip/24/64 and ip/0 are one kind.
        let parts: Vec<u8> = SAMPLES
            .iter()
            .filter(|s| !["ip/64", "ip/24/64", "ip/0"].contains(s))
            .map(|s| KeyPart::parse(s).unwrap().tag())
            .collect();
        let mut unique = parts.to_vec();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), parts.len());
    }
}
