//! Text predicates for values that reach headers, URLs and shared-data keys:
//! RFC 9110 tokens, RFC 3986 URIs, plain names.

/// True for a token as RFC 9110 defines it (header names, methods).
pub(super) fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Why `name` can never name a request header the filter reads, or `None`
/// when it can: not a token, or `host`, which Envoy keeps as `:authority`
/// (HTTP/1's `Host` included), so a rule keyed or matched on it would
/// silently never apply.
pub(super) fn header_name_problem(name: &str) -> Option<String> {
    if !is_token(name) {
        return Some(format!("{name:?} is not a header name"));
    }
    if name.eq_ignore_ascii_case("host") {
        return Some(format!(
            "{name:?} never reaches the filter as a header: Envoy keeps the host as \
             :authority; match on it with match.host or match.host_regex, and key on it with \
             the key part host"
        ));
    }
    None
}

/// True for names that can stand in a structured-field string and a shared-data key.
pub(super) fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

/// Longest URL, URI or path accepted where it reaches a header.
pub const MAX_URI_LEN: usize = 2048;

/// True when `s` holds RFC 3986 characters only (unreserved, gen-delims,
/// sub-delims), each `%` starting a two-hex-digit escape, at most one `#`, and
/// at most [`MAX_URI_LEN`] bytes: no space, quote, angle bracket, CR, LF, other
/// control or non-ASCII character can break out of a header or a `Link` `<…>`.
pub(super) fn is_uri_text(s: &str) -> bool {
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        let ok = match b {
            b'%' => matches!((bytes.next(), bytes.next()),
                (Some(h), Some(l)) if h.is_ascii_hexdigit() && l.is_ascii_hexdigit()),
            _ => b.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=".contains(&b),
        };
        if !ok {
            return false;
        }
    }
    s.len() <= MAX_URI_LEN && s.bytes().filter(|&b| b == b'#').count() <= 1
}

/// The scheme of `s` (RFC 3986: a letter, then letters, digits, `+ - .`) and the rest.
fn split_scheme(s: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = s.split_once(':')?;
    let mut b = scheme.bytes();
    let first = b.next()?;
    (first.is_ascii_alphabetic() && b.all(|c| c.is_ascii_alphanumeric() || b"+-.".contains(&c)))
        .then_some((scheme, rest))
}

/// True for an absolute URI such as `https://…`, `urn:…`, `tag:…` or `about:blank`
/// (problem types: RFC 9457 asks for an absolute URI).
pub(super) fn is_absolute_uri(s: &str) -> bool {
    is_uri_text(s) && split_scheme(s).is_some_and(|(_, rest)| !rest.is_empty())
}

/// True for an absolute `http` or `https` URL with a host: a link a client can follow.
pub(super) fn is_http_url(s: &str) -> bool {
    let Some((scheme, rest)) = split_scheme(s) else {
        return false;
    };
    let web = scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https");
    let host = rest
        .strip_prefix("//")
        .and_then(|r| r.split(['/', '?', '#']).next())
        .unwrap_or("");
    web && !host.is_empty() && is_uri_text(s)
}

/// True for an `:authority` value: a host (name, IPv4 or `[IPv6]`) and an optional port.
pub(super) fn is_authority(s: &str) -> bool {
    !s.is_empty() && s.len() <= 255 && is_uri_text(s) && !s.contains(['/', '?', '#', '@'])
}

/// True for a `:path` value: absolute, RFC 3986 characters, no fragment.
pub(super) fn is_absolute_path(s: &str) -> bool {
    s.starts_with('/') && is_uri_text(s) && !s.contains('#')
}
