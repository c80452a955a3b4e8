//! Who may call `/v1/*`: bearer tokens from the `--auth-tokens` file.
//!
//! The file holds one caller per line, `<domain> <token>`; `#` starts a
//! comment line, blank lines are skipped. A token is an RFC 6750 `b64token`
//! and appears once in the file (one token, one domain). The file is read by
//! [`crate::reload`] (SIGHUP, or a change, keeps the old tokens when the new
//! file is bad).
//!
//! A request carries `authorization: Bearer <token>`. Only SHA-256 digests
//! of the tokens are kept, and the digest of the presented token is compared
//! with **every** one of them in constant time ([`subtle`]), so neither the
//! time taken nor an early exit tells which (or whether one) matched. The
//! answer is 401 (`www-authenticate: Bearer`) without a known token, and 403
//! when the token belongs to another domain than the request's `domain`
//! (checked once the body is parsed, before anything reaches Redis).
//!
//! **The seam for the limiter**: an authenticated request carries a
//! [`Caller`] in its extensions (domain and token id, never the token); the
//! handlers take it as `Extension<Caller>` and hand it to the limiter, whose
//! per-caller lease ledger keys on [`Caller::id`]. With `--insecure-no-auth`
//! every request is [`Caller::anonymous`].

use std::sync::Arc;

use ring::digest::{digest, SHA256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::reload::Source;

/// The authenticated caller of a request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller {
    /// The only domain this caller may name; `None` without authentication
    /// (`--insecure-no-auth`): any domain.
    pub domain: Option<Arc<str>>,
    /// Stable, non-secret identity: `<domain>/<first 12 hex digits of the
    /// token's SHA-256>`, or `anonymous`. Unchanged across reloads while the
    /// token is, and the same on every gateway replica.
    pub id: Arc<str>,
}

impl Caller {
    /// The caller of every request when authentication is off.
    pub fn anonymous() -> Caller {
        Caller {
            domain: None,
            id: Arc::from("anonymous"),
        }
    }

    /// Whether this caller may act on `domain`.
    pub fn may_use(&self, domain: &str) -> bool {
        self.domain.as_deref().is_none_or(|d| d == domain)
    }
}

/// Why a request was refused, as the `reason` label of
/// `ratelimit_gateway_auth_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `authorization` header (401).
    Missing,
    /// An `authorization` header that is not `Bearer <b64token>` (401).
    Malformed,
    /// A bearer token not in the file (401).
    Unknown,
    /// A known token of another domain than the request's (403).
    WrongDomain,
}

/// Every `reason` label value.
pub const REASONS: [&str; 4] = ["missing", "malformed", "unknown", "wrong_domain"];

impl Refusal {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed => "malformed",
            Refusal::Unknown => "unknown",
            Refusal::WrongDomain => "wrong_domain",
        }
    }
}

struct Entry {
    /// The token's SHA-256, as four words (compared without a branch).
    digest: [u64; 4],
    caller: Caller,
}

/// The callers of the token file.
pub struct Tokens {
    entries: Vec<Entry>,
    /// Where the tokens below [`MIN_TOKEN_BITS`] are (`<file>: line <n>`).
    short: Vec<String>,
}

/// Tokens estimated below this many bits of entropy are warned about.
pub const MIN_TOKEN_BITS: f64 = 128.0;

/// An upper bound on a token's entropy in bits: its length times log2 of
/// the alphabet its character classes span (digits 10, lower case 26,
/// upper case 26, `-._~+/=` 7). A 32-character hex token (128 random bits)
/// counts 165; a phrase counts as if random, so this only catches the short.
pub fn token_bits(token: &str) -> f64 {
    type Class = (fn(u8) -> bool, u32);
    let classes: [Class; 4] = [
        (|b| b.is_ascii_digit(), 10),
        (|b| b.is_ascii_lowercase(), 26),
        (|b| b.is_ascii_uppercase(), 26),
        (|b| !b.is_ascii_alphanumeric(), 7),
    ];
    let alphabet: u32 = classes
        .iter()
        .filter(|(is, _)| token.bytes().any(is))
        .map(|(_, n)| n)
        .sum();
    token.len() as f64 * f64::from(alphabet.max(1)).log2()
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the digests: ids only.
        f.debug_list()
            .entries(self.entries.iter().map(|e| &e.caller.id))
            .finish()
    }
}

/// True for an RFC 6750 `b64token`: `1*( ALPHA / DIGIT / "-" / "." / "_" /
/// "~" / "+" / "/" ) *"="`.
pub fn is_b64token(s: &str) -> bool {
    let body = s.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
}

fn sha256(bytes: &[u8]) -> [u64; 4] {
    let d = digest(&SHA256, bytes);
    let mut out = [0u64; 4];
    for (word, chunk) in out.iter_mut().zip(d.as_ref().chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        *word = u64::from_be_bytes(b);
    }
    out
}

/// Longest token accepted (a header line stays small).
pub const MAX_TOKEN_LEN: usize = 4096;

impl Tokens {
    /// Where the tokens estimated below [`MIN_TOKEN_BITS`] are, each
    /// warned about when the file is loaded.
    pub fn short(&self) -> &[String] {
        &self.short
    }

    /// Parses the token file(s); the error names the file and line, never
    /// the token.
    pub fn parse(sources: &[Source]) -> Result<Tokens, String> {
        let mut entries: Vec<Entry> = Vec::new();
        let mut lines_of: Vec<String> = Vec::new();
        let mut short = Vec::new();
        for source in sources {
            let file = source.path.display();
            let text = std::str::from_utf8(&source.bytes)
                .map_err(|e| format!("{file}: not UTF-8: {e}"))?;
            for (i, line) in text.lines().enumerate() {
                let n = i + 1;
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let mut words = line.split_whitespace();
                let (Some(domain), Some(token), None) = (words.next(), words.next(), words.next())
                else {
                    return Err(format!(
                        "{file}: line {n}: expected `<domain> <token>`, two words"
                    ));
                };
                if domain.len() > 512 {
                    return Err(format!("{file}: line {n}: domain longer than 512 bytes"));
                }
                if token.len() > MAX_TOKEN_LEN || !is_b64token(token) {
                    return Err(format!(
                        "{file}: line {n}: the token is not an RFC 6750 b64token of at most \
                         {MAX_TOKEN_LEN} bytes"
                    ));
                }
                let d = sha256(token.as_bytes());
                if let Some(j) = entries.iter().position(|e| e.digest == d) {
                    let first = lines_of.get(j).map(String::as_str).unwrap_or("?");
                    return Err(format!(
                        "{file}: line {n}: the same token as {first} (one token, one domain)"
                    ));
                }
                if token_bits(token) < MIN_TOKEN_BITS {
                    tracing::warn!(
                        "{file}: line {n}: the token of domain {domain:?} has under 128 bits of \
                         entropy; use at least 32 random hex or 22 random base64 characters"
                    );
                    short.push(format!("{file}: line {n}"));
                }
                // The first 48 bits of the digest, in hex.
                let id = format!("{domain}/{:012x}", d[0] >> 16);
                entries.push(Entry {
                    digest: d,
                    caller: Caller {
                        domain: Some(Arc::from(domain)),
                        id: Arc::from(id),
                    },
                });
                lines_of.push(format!("{file}: line {n}"));
            }
        }
        Ok(Tokens { entries, short })
    }

    /// How many callers the file names.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the file names no caller (every request is then refused).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The caller whose token `authorization` (the header's value) carries.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Caller, Refusal> {
        let value = authorization.ok_or(Refusal::Missing)?;
        let token = bearer(value).ok_or(Refusal::Malformed)?;
        let d = sha256(token);
        // Every entry is compared, the match picked by a constant-time select:
        // a word-wise XOR/OR, then one constant-time test per entry.
        let mut found = subtle::Choice::from(0u8);
        let mut index = 0u32;
        for (i, e) in self.entries.iter().enumerate() {
            let diff = (e.digest[0] ^ d[0])
                | (e.digest[1] ^ d[1])
                | (e.digest[2] ^ d[2])
                | (e.digest[3] ^ d[3]);
            let hit = diff.ct_eq(&0);
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            index = u32::conditional_select(&index, &i, hit);
            found |= hit;
        }
        if bool::from(found) {
            let i = usize::try_from(index).unwrap_or(usize::MAX);
            self.entries
                .get(i)
                .map(|e| e.caller.clone())
                .ok_or(Refusal::Unknown)
        } else {
            Err(Refusal::Unknown)
        }
    }
}

/// The token of `Bearer <token>` (scheme case-insensitive, RFC 7235), if it
/// is a b64token.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim_start();
    (scheme.eq_ignore_ascii_case("bearer") && token.len() <= MAX_TOKEN_LEN && is_b64token(token))
        .then_some(token.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Tokens, String> {
        Tokens::parse(&[Source {
            path: "tokens".into(),
            bytes: text.as_bytes().to_vec(),
        }])
    }

    #[test]
    fn lines_comments_and_errors_naming_the_line() {
        let t = parse("# callers\n\napi s3cr3t-A\n  web  tok.en/B==  \n").unwrap();
        assert_eq!(t.len(), 2);
        let a = t.authenticate(Some(b"Bearer s3cr3t-A")).unwrap();
        assert_eq!(a.domain.as_deref(), Some("api"));
        assert!(a.id.starts_with("api/") && a.id.len() == "api/".len() + 12);
        assert!(!a.id.contains("s3cr3t"));
        assert!(a.may_use("api") && !a.may_use("web"));
        let b = t.authenticate(Some(b"bearer   tok.en/B==")).unwrap();
        assert_eq!(b.domain.as_deref(), Some("web"));
        assert_eq!(
            parse("api a b\n").unwrap_err(),
            "tokens: line 1: expected `<domain> <token>`, two words"
        );
        assert_eq!(
            parse("\napi\n").unwrap_err(),
            "tokens: line 2: expected `<domain> <token>`, two words"
        );
        assert_eq!(
            parse("api to\"ken\n").unwrap_err(),
            "tokens: line 1: the token is not an RFC 6750 b64token of at most 4096 bytes"
        );
        let e = parse("api s3cr3t\n# x\nweb s3cr3t\n").unwrap_err();
        assert_eq!(
            e,
            "tokens: line 3: the same token as tokens: line 1 (one token, one domain)"
        );
        assert!(!e.contains("s3cr3t"));
    }

    #[test]
    fn tokens_under_128_bits_are_named_and_long_random_ones_are_not() {
        let t = parse(
            "api s3cr3t\n\
             web 0123456789abcdef0123456789abcdef\n\
             ops AbCdEfGhIjKlMnOpQrSt12\n\
             dev abcdefghijklmnopqrstuvwxyz\n",
        )
        .unwrap();
        assert_eq!(t.short(), ["tokens: line 1", "tokens: line 4"]);
        assert!(
            (token_bits("0123456789abcdef0123456789abcdef") - 32.0 * 36f64.log2()).abs() < 1e-9
        );
    }

    #[test]
    fn refusals() {
        let t = parse("api good\n").unwrap();
        assert_eq!(t.authenticate(None), Err(Refusal::Missing));
        assert_eq!(t.authenticate(Some(b"good")), Err(Refusal::Malformed));
        assert_eq!(t.authenticate(Some(b"Basic good")), Err(Refusal::Malformed));
        assert_eq!(
            t.authenticate(Some(b"Bearer a\"b")),
            Err(Refusal::Malformed)
        );
        assert_eq!(t.authenticate(Some(b"Bearer goo")), Err(Refusal::Unknown));
        assert_eq!(t.authenticate(Some(b"Bearer goodd")), Err(Refusal::Unknown));
        let empty = parse("# nobody\n").unwrap();
        assert!(empty.is_empty());
        assert_eq!(
            empty.authenticate(Some(b"Bearer good")),
            Err(Refusal::Unknown)
        );
        assert!(Caller::anonymous().may_use("any"));
        assert!(is_b64token("a=") && !is_b64token("=") && !is_b64token("a=b"));
    }
}
