//! Query parameters and cookies, found by name and decoded by one parser
//! each, so that two spellings of one value (`a%62c`, `abc`) are one value
//! wherever a rule reads it (a `match` or a key). Each lookup is one pass
//! over the query or the `cookie` header, allocation-free until a value is
//! kept: linear in the request, whatever it holds.

/// Bytes percent-decoded (`%41` → `A`; a `%` not followed by two hex digits
/// stays as it is), and with `plus` a `+` read as a space (HTML form
/// encoding, as query strings use it).
#[derive(Debug, Clone)]
pub struct Decoded<'a> {
    rest: &'a [u8],
    plus: bool,
}

impl<'a> Decoded<'a> {
    /// The decoding of a query component (`+` is a space).
    pub fn query(bytes: &'a [u8]) -> Self {
        Decoded {
            rest: bytes,
            plus: true,
        }
    }

    /// The decoding of a cookie value (`+` stays `+`).
    pub fn cookie(bytes: &'a [u8]) -> Self {
        Decoded {
            rest: bytes,
            plus: false,
        }
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

impl Iterator for Decoded<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        let (&b, rest) = self.rest.split_first()?;
        self.rest = rest;
        match b {
            b'%' => {
                let pair = match rest {
                    [h, l, ..] => hex(*h).zip(hex(*l)),
                    _ => None,
                };
                match (pair, rest.get(2..)) {
                    (Some((h, l)), Some(after)) => {
                        self.rest = after;
                        Some((h << 4) | l)
                    }
                    _ => Some(b'%'),
                }
            }
            b'+' if self.plus => Some(b' '),
            _ => Some(b),
        }
    }
}

/// The query string of a `:path` (after the first `?`, before any `#`), or empty.
pub fn query_of(path: &[u8]) -> &[u8] {
    let Some(q) = path.iter().position(|&b| b == b'?') else {
        return &[];
    };
    let query = path.get(q + 1..).unwrap_or_default();
    match query.iter().position(|&b| b == b'#') {
        Some(end) => query.get(..end).unwrap_or(query),
        None => query,
    }
}

/// The raw value of the first query parameter whose decoded name is
/// `name` (`Some(b"")` for `?name` and `?name=`); `None` when absent.
pub fn query_param<'q>(query: &'q [u8], name: &[u8]) -> Option<Decoded<'q>> {
    query.split(|&b| b == b'&').find_map(|pair| {
        let (n, v) = match pair.iter().position(|&b| b == b'=') {
            Some(eq) => (pair.get(..eq)?, pair.get(eq + 1..)?),
            None => (pair, &[][..]),
        };
        Decoded::query(n)
            .eq(name.iter().copied())
            .then(|| Decoded::query(v))
    })
}

/// The value of the first cookie called `name` in a `cookie` header
/// (`a=1; b=2`; Envoy joins several `cookie` headers with `; `), without
/// the double quotes RFC 6265 allows around it; `None` when absent. Names
/// compare as they are written.
pub fn cookie<'c>(header: &'c [u8], name: &[u8]) -> Option<Decoded<'c>> {
    header.split(|&b| b == b';').find_map(|pair| {
        let pair = pair.trim_ascii();
        let eq = pair.iter().position(|&b| b == b'=')?;
        let (n, v) = (
            pair.get(..eq)?.trim_ascii(),
            pair.get(eq + 1..)?.trim_ascii(),
        );
        let v = match v {
            [b'"', inner @ .., b'"'] => inner,
            _ => v,
        };
        (n == name).then(|| Decoded::cookie(v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(query: &str, name: &str) -> Option<Vec<u8>> {
        query_param(query.as_bytes(), name.as_bytes()).map(Iterator::collect)
    }

    fn c(header: &str, name: &str) -> Option<Vec<u8>> {
        cookie(header.as_bytes(), name.as_bytes()).map(Iterator::collect)
    }

    #[test]
    fn two_spellings_of_one_query_value_are_one_value() {
        assert_eq!(q("api_key=a%62c", "api_key"), q("api_key=abc", "api_key"));
        assert_eq!(q("api%5Fkey=abc", "api_key").as_deref(), Some(&b"abc"[..]));
        assert_eq!(q("a+b=1", "a b").as_deref(), Some(&b"1"[..]));
        assert_eq!(q("a%2Bb=1", "a+b").as_deref(), Some(&b"1"[..]));
        assert_eq!(q("a+b=1", "a+b"), None, "a + in a name is a space");
        assert_eq!(q("k=a+b%20c", "k").as_deref(), Some(&b"a b c"[..]));
        assert_eq!(
            q("a=1&k=first&k=second", "k").as_deref(),
            Some(&b"first"[..])
        );
        assert_eq!(q("k", "k").as_deref(), Some(&b""[..]));
        assert_eq!(q("k=", "k").as_deref(), Some(&b""[..]));
        assert_eq!(q("kk=1&k2=2", "k"), None);
        assert_eq!(q("", "k"), None);
        // Bad escapes stay as they are.
        assert_eq!(q("k=%zz%4", "k").as_deref(), Some(&b"%zz%4"[..]));
        assert_eq!(q("k=%%41", "k").as_deref(), Some(&b"%A"[..]));
    }

    #[test]
    fn the_query_is_after_the_first_question_mark() {
        assert_eq!(query_of(b"/a?b=1?c#frag"), b"b=1?c");
        assert_eq!(query_of(b"/a"), b"");
        assert_eq!(query_of(b"/a?"), b"");
    }

    #[test]
    fn cookies_are_trimmed_unquoted_and_percent_decoded() {
        let h = "a=1; session=\"s%31\";b= x ;plus=a+b";
        assert_eq!(c(h, "session").as_deref(), Some(&b"s1"[..]));
        assert_eq!(c(h, "b").as_deref(), Some(&b"x"[..]));
        assert_eq!(c(h, "plus").as_deref(), Some(&b"a+b"[..]));
        assert_eq!(c(h, "Session"), None);
        assert_eq!(c("flag; x=1", "flag"), None);
        assert_eq!(c("a=1;a=2", "a").as_deref(), Some(&b"1"[..]));
    }

    #[test]
    fn hostile_sizes_are_one_pass() {
        // 64 KiB of parameters, and 1,000 cookies in a 60 KiB header: found
        // (or not) by one scan each.
        let mut query = "x=1&".repeat(16 * 1024 - 8);
        query.push_str("k=v");
        assert_eq!(q(&query, "k").as_deref(), Some(&b"v"[..]));
        assert_eq!(q(&query, "absent"), None);
        let mut header: String = (0..1000)
            .map(|i| format!("c{i}={}; ", "v".repeat(50)))
            .collect();
        header.push_str("session=s");
        assert!(header.len() > 55 * 1024);
        assert_eq!(c(&header, "session").as_deref(), Some(&b"s"[..]));
        assert_eq!(c(&header, "c999").map(|v| v.len()), Some(50));
    }
}
