//! Bucket keys: the client's identity and the parts a rule keys on.

use crate::policy::fields;
use crate::policy::request::{HeaderId, PropertyId, RequestInfo};
use ratelimit_config::condition::host_of;
use std::borrow::Cow;
use std::net::IpAddr;

/// Longest key-part value before it is counted as bad input. It is still used
/// whole (hashed), so distinct long values never share a bucket.
pub const MAX_KEY_PART_BYTES: usize = 1024;

/// One part of a rule's key, its name compiled: a header's id, a query
/// parameter's or cookie's index in [`KeySources::names`], a metadata
/// path's property id.
pub type KeyPart = ratelimit_config::KeyPart<usize>;

pub use ratelimit_config::key::{
    bounded, encode_part, MAX_GLOBAL_KEY_BYTES, MAX_GLOBAL_PART_BYTES,
};

/// Where the client IP comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpSource {
    /// `X-Forwarded-For`, read when `hops > 0`.
    pub xff: HeaderId,
    /// How many trusted proxies append to `X-Forwarded-For`.
    pub hops: u32,
}

/// Where key parts find what they read, compiled with the plan. An id that
/// no part reads is out of range, so a lookup by it finds nothing.
#[derive(Debug, Clone)]
pub struct KeySources {
    /// Where the client IP comes from.
    pub ip: IpSource,
    /// The `:authority` header (`host`).
    pub authority: HeaderId,
    /// The `cookie` header (`cookie:`).
    pub cookie: HeaderId,
    /// The route name property (`route`).
    pub route: PropertyId,
    /// The names of `query:` and `cookie:` parts, by index.
    pub names: Vec<Vec<u8>>,
}

impl KeySources {
    /// Sources for keys that read nothing but the fixed headers and the IP.
    pub fn ip_only(ip: IpSource) -> KeySources {
        KeySources {
            ip,
            authority: usize::MAX,
            cookie: usize::MAX,
            route: usize::MAX,
            names: Vec::new(),
        }
    }
}

/// The network of `ip`: its address masked to `v4` or `v6` bits (an
/// IPv4-mapped IPv6 address counts as IPv4), written `<address>/<len>`.
/// An IPv4 network is written digit by digit: `Ipv4Addr`'s `Display` costs
/// thousands of instructions, and an `ip/<len>` key writes one per request.
pub fn ip_network(ip: IpAddr, v4: u8, v6: u8) -> Vec<u8> {
    match ip.to_canonical() {
        IpAddr::V4(a) => {
            let len = v4.min(32);
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            let mut out = Vec::with_capacity(18);
            let mut digits = itoa::Buffer::new();
            for (i, octet) in (u32::from(a) & mask).to_be_bytes().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                out.extend_from_slice(digits.format(octet).as_bytes());
            }
            out.push(b'/');
            out.extend_from_slice(digits.format(len).as_bytes());
            out
        }
        IpAddr::V6(a) => {
            let len = u32::from(v6.min(128));
            let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
            let net = std::net::Ipv6Addr::from(u128::from(a) & mask);
            format!("{net}/{len}").into_bytes()
        }
    }
}

/// Why a request's identity was not what the configuration expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadInput {
    /// A key part longer than [`MAX_KEY_PART_BYTES`].
    Oversized,
    /// The trusted `X-Forwarded-For` entry is not an IP address.
    BadForwardedFor,
    /// Envoy gave no usable peer address.
    NoPeerAddress,
}

/// Parses Envoy's `source.address` (`1.2.3.4:5678`, `[::1]:80`, or a bare IP).
pub fn peer_ip(address: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(address).ok()?.trim();
    if let Ok(ip) = s.parse() {
        return Some(ip);
    }
    if let Some(rest) = s.strip_prefix('[') {
        return rest.split_once(']')?.0.parse().ok();
    }
    s.rsplit_once(':')?.0.parse().ok()
}

/// The client IP: the `hops`-th `X-Forwarded-For` entry from the right when
/// proxies are trusted, else the peer. A client can prepend entries but never
/// choose the ones trusted proxies append, so a short or forged chain falls back
/// to the peer rather than to anything the client wrote.
pub fn client_ip(req: &RequestInfo, src: IpSource, bad: &mut Vec<BadInput>) -> Option<IpAddr> {
    if src.hops > 0 {
        if let Some(xff) = req.header(src.xff) {
            let hops = src.hops as usize;
            let entry = xff.rsplit(|&b| b == b',').nth(hops - 1);
            if let Some(entry) = entry {
                match std::str::from_utf8(entry)
                    .ok()
                    .and_then(|e| e.trim().parse().ok())
                {
                    Some(ip) => return Some(ip),
                    None => bad.push(BadInput::BadForwardedFor),
                }
            }
        }
    }
    let ip = req.source_address.as_deref().and_then(peer_ip);
    if ip.is_none() {
        bad.push(BadInput::NoPeerAddress);
    }
    ip
}

/// Feeds one rule's key for `req` into `sink` as (tag, value) per part; the
/// tag says which kind of part it is ([`ratelimit_config::KeyPart::tag`]). `client` is the resolved client id; without one the IP
/// stands in. Returns false when a named part (`header:`, `query:`,
/// `cookie:`, `metadata:`), the host or the route is absent: like Envoy's
/// `request_headers` descriptor, the rule then does not apply.
pub fn write_key(
    parts: &[KeyPart],
    req: &RequestInfo,
    client: Option<&[u8]>,
    src: &KeySources,
    bad: &mut Vec<BadInput>,
    sink: &mut impl FnMut(u8, &[u8]),
) -> bool {
    let ip_src = src.ip;
    let mut ip_cache: Option<Option<IpAddr>> = None;
    let mut ip_text = |bad: &mut Vec<BadInput>| -> Vec<u8> {
        let ip = *ip_cache.get_or_insert_with(|| client_ip(req, ip_src, bad));
        ip.map(|ip| ip.to_string().into_bytes()).unwrap_or_default()
    };
    for part in parts {
        // A client without an id is keyed (and tagged) as its IP.
        let (tag, value): (u8, Cow<[u8]>) = match part {
            KeyPart::Client => match client.filter(|v| !v.is_empty()) {
                Some(id) => (part.tag(), id.into()),
                None => (KeyPart::Ip.tag(), ip_text(bad).into()),
            },
            KeyPart::Ip => (part.tag(), ip_text(bad).into()),
            KeyPart::Method => (part.tag(), req.method().into()),
            KeyPart::Path => (part.tag(), req.path().into()),
            KeyPart::Header(id) => match req.header(*id) {
                Some(v) => (part.tag(), v.into()),
                None => return false,
            },
            KeyPart::Host
            | KeyPart::Route
            | KeyPart::IpPrefix { .. }
            | KeyPart::Query(_)
            | KeyPart::Cookie(_)
            | KeyPart::Metadata(_) => match other_part(part, req, src, bad) {
                Some(v) => (part.tag(), v),
                None => return false,
            },
        };
        if value.len() > MAX_KEY_PART_BYTES {
            bad.push(BadInput::Oversized);
        }
        sink(tag, &value);
    }
    true
}

/// The value of a `host`, `route`, `ip/<len>`, `query:`, `cookie:` or
/// `metadata:` part, normalized or decoded; `None` when absent.
// Kept out of write_key: the rules that key on none of these pay nothing for them.
#[inline(never)]
fn other_part<'r>(
    part: &KeyPart,
    req: &'r RequestInfo,
    src: &KeySources,
    bad: &mut Vec<BadInput>,
) -> Option<Cow<'r, [u8]>> {
    let name = |i: &usize| src.names.get(*i).map(Vec::as_slice);
    match part {
        KeyPart::Host => {
            let host = host_of(req.header(src.authority)?);
            Some(match host.iter().any(u8::is_ascii_uppercase) {
                true => host.to_ascii_lowercase().into(),
                false => host.into(),
            })
        }
        KeyPart::Route => req.property(src.route).map(Cow::from),
        // Read again rather than shared with an `ip` part of the same key,
        // which no sensible key has.
        KeyPart::IpPrefix { v4, v6 } => Some(
            client_ip(req, src.ip, bad)
                .map(|ip| ip_network(ip, *v4, *v6))
                .unwrap_or_default()
                .into(),
        ),
        KeyPart::Query(i) => {
            let query = fields::query_of(req.header(super::request::PATH)?);
            Some(
                fields::query_param(query, name(i)?)?
                    .collect::<Vec<u8>>()
                    .into(),
            )
        }
        KeyPart::Cookie(i) => {
            let header = req.header(src.cookie)?;
            Some(
                fields::cookie(header, name(i)?)?
                    .collect::<Vec<u8>>()
                    .into(),
            )
        }
        KeyPart::Metadata(id) => req.property(*id).map(Cow::from),
        KeyPart::Client | KeyPart::Ip | KeyPart::Method | KeyPart::Path | KeyPart::Header(_) => {
            None
        }
    }
}

/// Feeds one part to a bucket hash as whole 64-bit words. The head word
/// holds the tag, the length (255 and then a word of its own for 255 bytes
/// or more) and the first six bytes; the rest follows eight bytes a word,
/// the last padded with zeros. The length makes the padding and the parts'
/// boundaries unambiguous (proptest `hashed_parts_read_back_as_the_same_parts`).
/// Whole words skip SipHash's byte buffering, and a part of up to six bytes
/// (a method, a short id) is one word: c1's 4-byte client id cost about 250
/// instructions as bytes (BENCHMARKS.md, instructions per decision).
pub fn hash_part(h: &mut impl std::hash::Hasher, tag: u8, value: &[u8]) {
    let (first, rest) = value.split_at(value.len().min(HEAD_BYTES));
    let long = value.len() >= usize::from(LONG);
    let len_byte = if long { LONG } else { value.len() as u8 };
    h.write_u64(u64::from_le_bytes(padded(first, [tag, len_byte])));
    if long {
        h.write_u64(value.len() as u64);
    }
    let mut words = rest.chunks_exact(8);
    for w in words.by_ref() {
        h.write_u64(u64::from_le_bytes(padded(w, [])));
    }
    if !words.remainder().is_empty() {
        h.write_u64(u64::from_le_bytes(padded(words.remainder(), [])));
    }
}

/// Value bytes in a part's head word.
const HEAD_BYTES: usize = 6;
/// The head's length byte of a part of 255 bytes or more.
const LONG: u8 = 255;

/// `lead`, then `bytes`, then zeros, as one word's eight bytes.
fn padded<const N: usize>(bytes: &[u8], lead: [u8; N]) -> [u8; 8] {
    let mut w = [0u8; 8];
    if let Some((front, back)) = w.split_at_mut_checked(N) {
        front.copy_from_slice(&lead);
        if let Some(dst) = back.get_mut(..bytes.len()) {
            dst.copy_from_slice(bytes);
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLIENT: HeaderId = 2;
    const XFF: HeaderId = 3;
    const TENANT: HeaderId = 4;

    fn req(client: Option<&[u8]>, xff: Option<&str>, peer: &str) -> RequestInfo {
        RequestInfo {
            headers: vec![
                Some(b"GET".to_vec()),
                Some(b"/p?q".to_vec()),
                client.map(<[u8]>::to_vec),
                xff.map(|x| x.as_bytes().to_vec()),
                None,
            ],
            source_address: Some(peer.as_bytes().to_vec()),
            ..RequestInfo::default()
        }
    }

    fn key(parts: &[KeyPart], r: &RequestInfo, hops: u32) -> (Option<Vec<u8>>, Vec<BadInput>) {
        let mut out = Vec::new();
        let mut bad = Vec::new();
        let src = KeySources::ip_only(IpSource { xff: XFF, hops });
        let ok = write_key(parts, r, r.header(CLIENT), &src, &mut bad, &mut |t, v| {
            out.push(t);
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            out.extend_from_slice(v);
        });
        (ok.then_some(out), bad)
    }

    /// Records the words a hash is fed; any byte write fails the test.
    #[derive(Default)]
    struct Words(Vec<u64>);

    impl std::hash::Hasher for Words {
        fn write(&mut self, _: &[u8]) {
            panic!("a key part must be fed as whole words");
        }
        fn write_u64(&mut self, w: u64) {
            self.0.push(w);
        }
        fn finish(&self) -> u64 {
            0
        }
    }

    /// Reads the parts back from their words: `None` when the words are not
    /// a sequence of parts.
    fn parts_of(words: &[u64]) -> Option<Vec<(u8, Vec<u8>)>> {
        let mut out = Vec::new();
        let mut rest = words;
        while let Some((&head, tail)) = rest.split_first() {
            let head = head.to_le_bytes();
            let (tag, len_byte) = (head[0], head[1]);
            rest = tail;
            let len = if len_byte == 255 {
                let (&len, tail) = rest.split_first()?;
                rest = tail;
                // A short part never takes the long form.
                if len < 255 {
                    return None;
                }
                len as usize
            } else {
                usize::from(len_byte)
            };
            let n = len.saturating_sub(6).div_ceil(8);
            let mut bytes = head[2..].to_vec();
            bytes.extend(rest.get(..n)?.iter().flat_map(|w| w.to_le_bytes()));
            rest = rest.get(n..)?;
            // The padding is zeros, or the words are not ours.
            if bytes.get(len..)?.iter().any(|&b| b != 0) {
                return None;
            }
            out.push((tag, bytes.get(..len)?.to_vec()));
        }
        Some(out)
    }

    proptest::proptest! {
        /// The words of a key's parts give the parts back, so two keys that
        /// differ anywhere (a tag, a byte, a boundary between parts) feed the
        /// bucket hash different words.
        #[test]
        fn hashed_parts_read_back_as_the_same_parts(
            parts in proptest::collection::vec(
                (proptest::prelude::any::<u8>(), proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)),
                0..5,
            ),
        ) {
            let mut words = Words::default();
            for (tag, value) in &parts {
                hash_part(&mut words, *tag, value);
            }
            proptest::prop_assert_eq!(parts_of(&words.0), Some(parts));
        }
    }

    #[test]
    fn peer_addresses_parse() {
        assert_eq!(peer_ip(b"10.0.0.1:443"), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(peer_ip(b"[::1]:80"), Some("::1".parse().unwrap()));
        assert_eq!(peer_ip(b"::1"), Some("::1".parse().unwrap()));
        assert_eq!(peer_ip(b"nonsense"), None);
        assert_eq!(peer_ip(&[0xff, 0xfe]), None);
    }

    #[test]
    fn client_falls_back_to_ip_and_empty_counts_as_absent() {
        let with_id = key(
            &[KeyPart::Client],
            &req(Some(b"alice"), None, "1.1.1.1:5"),
            0,
        )
        .0;
        let no_id = key(&[KeyPart::Client], &req(None, None, "1.1.1.1:5"), 0).0;
        let empty_id = key(&[KeyPart::Client], &req(Some(b""), None, "1.1.1.1:5"), 0).0;
        let ip = key(&[KeyPart::Ip], &req(Some(b"alice"), None, "1.1.1.1:9"), 0).0;
        assert_ne!(with_id, no_id);
        assert_eq!(no_id, empty_id);
        assert_eq!(no_id, ip);
    }

    #[test]
    fn trusted_hops_pick_from_the_right_and_ignore_forged_prefixes() {
        let parts = [KeyPart::Ip];
        let real = key(&parts, &req(None, Some("9.9.9.9"), "1.1.1.1:1"), 0).0;
        let peer = key(&parts, &req(None, None, "1.1.1.1:1"), 0).0;
        assert_eq!(real, peer, "hops 0 ignores XFF");
        let one = key(&parts, &req(None, Some("6.6.6.6, 5.5.5.5"), "1.1.1.1:1"), 1).0;
        let forged = key(
            &parts,
            &req(None, Some("7.7.7.7, 6.6.6.6,5.5.5.5"), "1.1.1.1:1"),
            1,
        )
        .0;
        let want = key(&parts, &req(None, None, "5.5.5.5:1"), 0).0;
        assert_eq!(one, want);
        assert_eq!(forged, want);
        let two = key(
            &parts,
            &req(None, Some("7.7.7.7, 6.6.6.6,5.5.5.5"), "1.1.1.1:1"),
            2,
        )
        .0;
        assert_eq!(two, key(&parts, &req(None, None, "6.6.6.6:1"), 0).0);
        // A chain shorter than the trusted hops falls back to the peer.
        let short = key(&parts, &req(None, Some("5.5.5.5"), "1.1.1.1:1"), 2).0;
        assert_eq!(short, peer);
    }

    #[test]
    fn garbage_in_the_trusted_position_is_counted_and_falls_back() {
        let (k, bad) = key(
            &[KeyPart::Ip],
            &req(None, Some("1.2.3.4, not-an-ip"), "1.1.1.1:1"),
            1,
        );
        assert_eq!(k, key(&[KeyPart::Ip], &req(None, None, "1.1.1.1:1"), 0).0);
        assert_eq!(bad, vec![BadInput::BadForwardedFor]);
    }

    #[test]
    fn absent_header_part_skips_the_rule() {
        let (k, _) = key(&[KeyPart::Header(TENANT)], &req(None, None, "1.1.1.1:1"), 0);
        assert_eq!(k, None);
    }

    #[test]
    fn oversized_and_binary_values_are_used_whole_and_counted() {
        let big = vec![0xffu8; 64 * 1024];
        let mut big2 = big.clone();
        big2[60_000] = 0;
        let (a, bad) = key(&[KeyPart::Client], &req(Some(&big), None, "1.1.1.1:1"), 0);
        let (b, _) = key(&[KeyPart::Client], &req(Some(&big2), None, "1.1.1.1:1"), 0);
        assert_ne!(a, b);
        assert_eq!(bad, vec![BadInput::Oversized]);
    }

    #[test]
    fn global_keys_are_readable_escaped_and_bounded() {
        let mut k = String::new();
        let mut tag = String::new();
        encode_part(&mut k, Some(&mut tag), b'c', b"alice");
        encode_part(&mut k, None, b'p', b"/a b/\xff");
        assert_eq!(k, "c=alice/p=%2Fa%20b%2F%FF");
        assert_eq!(tag, "c=alice");
        let mut long = String::new();
        encode_part(&mut long, None, b'h', &[b'x'; 500]);
        assert!(long.starts_with("h#") && long.len() == 2 + 32, "{long}");
    }

    #[test]
    fn long_global_keys_are_hashed_whole() {
        let mut k = String::from("rule");
        for (t, v) in [
            (b'c', [b' '; 128]),
            (b'p', [b'/'; 128]),
            (b'h', [b'%'; 128]),
        ] {
            encode_part(&mut k, None, t, &v);
        }
        assert!(k.len() > MAX_GLOBAL_KEY_BYTES);
        let b = bounded(k.clone(), "rule");
        assert!(b.starts_with("rule#") && b.len() == 5 + 32, "{b}");
        let mut other = k.clone();
        other.push('x');
        assert_ne!(bounded(other, "rule"), b);
        assert_eq!(bounded("rule/c=a".into(), "rule"), "rule/c=a");
    }

    #[test]
    fn networks_mask_each_family_to_its_length() {
        let net =
            |ip: &str, v4, v6| String::from_utf8(ip_network(ip.parse().unwrap(), v4, v6)).unwrap();
        assert_eq!(net("10.1.2.3", 24, 64), "10.1.2.0/24");
        // Every octet and every prefix length is written as std writes it.
        for o in 0..=255u8 {
            let ip = format!("{o}.{o}.{o}.{o}");
            assert_eq!(net(&ip, 32, 64), format!("{ip}/32"));
        }
        for len in 0..=32u8 {
            let want =
                std::net::Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0));
            assert_eq!(net("255.255.255.255", len, 64), format!("{want}/{len}"));
        }
        assert_eq!(net("10.1.2.3", 0, 64), "0.0.0.0/0");
        assert_eq!(net("10.1.2.3", 32, 64), "10.1.2.3/32");
        assert_eq!(net("::ffff:10.1.2.3", 24, 64), "10.1.2.0/24");
        assert_eq!(net("2001:db8:1:2:3:4:5:6", 24, 64), "2001:db8:1:2::/64");
        assert_eq!(net("2001:db8::1", 24, 0), "::/0");
        assert_eq!(net("2001:db8::1", 24, 128), "2001:db8::1/128");
    }

    #[test]
    fn host_query_cookie_and_prefix_parts_are_normalized_or_skip_the_rule() {
        let names = [":method", ":path", ":authority", "cookie"].map(String::from);
        let src = KeySources {
            ip: IpSource { xff: 9, hops: 0 },
            authority: 2,
            cookie: 3,
            route: 0,
            names: vec![b"api_key".to_vec(), b"session".to_vec()],
        };
        let key = |parts: &[KeyPart], headers: &[(&str, &[u8])], peer: &str| {
            let r = RequestInfo::with_headers(&names, headers).with_source(peer.as_bytes());
            let mut out = Vec::new();
            let ok = write_key(parts, &r, None, &src, &mut Vec::new(), &mut |t, v| {
                out.push((t, v.to_vec()))
            });
            ok.then_some(out)
        };
        let host = [KeyPart::Host];
        assert_eq!(
            key(
                &host,
                &[(":authority", b"API.example.com:443")],
                "1.1.1.1:1"
            ),
            Some(vec![(b'a', b"api.example.com".to_vec())])
        );
        assert_eq!(
            key(&host, &[(":authority", b"api.example.com")], "1.1.1.1:1"),
            key(
                &host,
                &[(":authority", b"API.example.com:443")],
                "1.1.1.1:1"
            )
        );
        assert_eq!(key(&host, &[], "1.1.1.1:1"), None);
        let query = [KeyPart::Query(0)];
        assert_eq!(
            key(&query, &[(":path", b"/a?x=1&api_key=a%62c")], "1.1.1.1:1"),
            Some(vec![(b'q', b"abc".to_vec())])
        );
        assert_eq!(key(&query, &[(":path", b"/a?x=1")], "1.1.1.1:1"), None);
        let cookie = [KeyPart::Cookie(1)];
        assert_eq!(
            key(&cookie, &[("cookie", b"a=1; session=s%2B1")], "1.1.1.1:1"),
            Some(vec![(b'k', b"s+1".to_vec())])
        );
        assert_eq!(key(&cookie, &[("cookie", b"a=1")], "1.1.1.1:1"), None);
        let route = [KeyPart::Route];
        assert_eq!(key(&route, &[], "1.1.1.1:1"), None);
        let net = [KeyPart::IpPrefix { v4: 24, v6: 64 }];
        assert_eq!(key(&net, &[], "10.0.0.7:5"), key(&net, &[], "10.0.0.200:9"));
        assert_ne!(key(&net, &[], "10.0.0.7:5"), key(&net, &[], "10.0.1.7:5"));
        assert_eq!(
            key(&net, &[], "[2001:db8::1]:5"),
            Some(vec![(b'n', b"2001:db8::/64".to_vec())])
        );
    }

    #[test]
    fn parts_are_unambiguous() {
        let a = key(
            &[KeyPart::Method, KeyPart::Path],
            &req(None, None, "1.1.1.1:1"),
            0,
        )
        .0;
        let b = key(
            &[KeyPart::Path, KeyPart::Method],
            &req(None, None, "1.1.1.1:1"),
            0,
        )
        .0;
        assert_ne!(a, b);
    }
}
