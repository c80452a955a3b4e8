//! Rate-limit keys: the parts a rule or quota keys on ([`KeyPart`], read once
//! with the configuration), and the gateway key encoding that the filter
//! writes and the gateway rebuilds for a native descriptor ([`encode_part`],
//! [`bounded`]).

use super::syntax::header_name_problem;
use std::fmt;

/// One part of a rule's or quota's key. `H` names the header: its name as
/// written (`String`) in the configuration, the filter's compiled header id
/// once the policy is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyPart<H = String> {
    /// `client`: the authenticated client id, or the client IP when there is none.
    Client,
    /// `ip`: the client IP.
    Ip,
    /// `method`: the request method.
    Method,
    /// `path`: the path without query.
    Path,
    /// `header:<name>`: a request header; a request without it is not limited by the rule.
    Header(H),
}

/// What a `header:` key part starts with.
const HEADER_PREFIX: &str = "header:";

impl<H> KeyPart<H> {
    /// The parts named by a word alone (all but `header:<name>`).
    pub const WORDS: [KeyPart<H>; 4] =
        [KeyPart::Client, KeyPart::Ip, KeyPart::Method, KeyPart::Path];

    /// The part's one-byte tag in an encoded key (`c=alice/p=%2Fa`), which
    /// makes parts of different kinds never collide.
    pub fn tag(&self) -> u8 {
        match self {
            KeyPart::Client => b'c',
            KeyPart::Ip => b'i',
            KeyPart::Method => b'm',
            KeyPart::Path => b'p',
            KeyPart::Header(_) => b'h',
        }
    }

    /// The configuration word of a part named by one (`None` for a header).
    pub fn word(&self) -> Option<&'static str> {
        match self {
            KeyPart::Client => Some("client"),
            KeyPart::Ip => Some("ip"),
            KeyPart::Method => Some("method"),
            KeyPart::Path => Some("path"),
            KeyPart::Header(_) => None,
        }
    }

    /// The same part with its header named by `f(name)`.
    pub fn map_header<G>(&self, f: impl FnOnce(&H) -> G) -> KeyPart<G> {
        match self {
            KeyPart::Client => KeyPart::Client,
            KeyPart::Ip => KeyPart::Ip,
            KeyPart::Method => KeyPart::Method,
            KeyPart::Path => KeyPart::Path,
            KeyPart::Header(h) => KeyPart::Header(f(h)),
        }
    }
}

impl KeyPart {
    /// Reads a configuration key part: a word of [`KeyPart::WORDS`] or
    /// `header:<name>`; the error says why, for the caller to place.
    pub fn parse(s: &str) -> Result<KeyPart, String> {
        if let Some(name) = s.strip_prefix(HEADER_PREFIX) {
            return match header_name_problem(name) {
                Some(why) => Err(why),
                None => Ok(KeyPart::Header(name.to_string())),
            };
        }
        if let Some(part) = Self::WORDS.into_iter().find(|p| p.word() == Some(s)) {
            return Ok(part);
        }
        let words: Vec<&str> = Self::WORDS.iter().filter_map(|p| p.word()).collect();
        Err(format!(
            "{s:?} is not a key part ({} or {HEADER_PREFIX}<name>)",
            words.join(", ")
        ))
    }
}

impl fmt::Display for KeyPart {
    /// The configuration form: `client`, …, `header:<name>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.word(), self) {
            (Some(w), _) => f.write_str(w),
            (None, KeyPart::Header(name)) => write!(f, "{HEADER_PREFIX}{name}"),
            (None, _) => Ok(()),
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

    #[test]
    fn key_parts_read_back_as_written() {
        for s in ["client", "ip", "method", "path", "header:x-tenant"] {
            assert_eq!(KeyPart::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(KeyPart::parse("header:x-tenant").unwrap().tag(), b'h');
        assert_eq!(
            KeyPart::parse("cookie").unwrap_err(),
            r#""cookie" is not a key part (client, ip, method, path or header:<name>)"#
        );
        assert_eq!(
            KeyPart::parse("header:a b").unwrap_err(),
            r#""a b" is not a header name"#
        );
    }
}
