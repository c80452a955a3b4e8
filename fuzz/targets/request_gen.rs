//! Builds a `RequestInfo` for a plan from fuzz bytes: every header and property (route
//! name, metadata) the plan reads may be absent, empty, a plausible value, raw (non-UTF-8)
//! bytes, an `X-Forwarded-For`-like chain or a huge value; the peer address may be missing
//! or garbage.

use crate::input::Input;
use ratelimit_wasm::policy::plan::Plan;
use ratelimit_wasm::policy::request::RequestInfo;

/// Plausible values, so that small inputs reach matches, known clients and tiers.
pub const WORDS: &[&str] = &[
    "GET",
    "POST",
    "PUT",
    "/",
    "/upload",
    "/upload/a?x=1",
    "/search?q=1",
    "/export",
    "/api/v1/items",
    "alice",
    "bob",
    "acme",
    "root",
    "trial",
    "big",
    "free",
    "pro",
    "staff",
    "t1",
    "10.0.0.1",
    "::1",
    "2001:db8::7",
    "192.0.2.10:40000",
    "[2001:db8::1]:443",
    "API.example.com:443",
    "api.example.com",
    "/?api_key=a%62c&x=+1",
    "sid=%61bc; theme=\"dark\"",
    "premium",
];

/// Sizes around the 1 KiB key-part bound and beyond.
pub const BIG_SIZES: &[usize] = &[127, 128, 129, 1023, 1024, 1025, 4096, 65_536];

pub fn ip(inp: &mut Input) -> String {
    if inp.bool() {
        let [a, b, c, d] = inp.u32().to_be_bytes();
        format!("{a}.{b}.{c}.{d}")
    } else {
        std::net::Ipv6Addr::from(u128::from(inp.u64()) << 64 | u128::from(inp.u16())).to_string()
    }
}

/// An `X-Forwarded-For`-like chain: IPs, garbage, empty entries, odd spacing.
pub fn chain(inp: &mut Input) -> Vec<u8> {
    let n = inp.below(7);
    let mut out = Vec::new();
    for i in 0..n {
        if i > 0 {
            out.extend_from_slice(inp.pick(&[&b","[..], b", ", b" ,", b",\t"]));
        }
        match inp.below(5) {
            0 | 1 => out.extend_from_slice(ip(inp).as_bytes()),
            2 => out.extend_from_slice(inp.short_bytes()),
            3 => out.extend_from_slice(format!(" {} ", ip(inp)).as_bytes()),
            _ => {}
        }
    }
    out
}

/// One header value, or `None` for an absent header.
pub fn value(inp: &mut Input) -> Option<Vec<u8>> {
    Some(match inp.below(9) {
        0 => return None,
        1 | 2 => inp.short_bytes().to_vec(),
        3 => inp.pick(WORDS).as_bytes().to_vec(),
        4 => {
            let size = inp.pick(BIG_SIZES);
            vec![inp.u8(); size]
        }
        5 => chain(inp),
        6 => Vec::new(),
        7 => {
            let mut v = inp.pick(WORDS).as_bytes().to_vec();
            v.extend_from_slice(inp.short_bytes());
            v
        }
        _ => {
            let size = usize::from(inp.u16());
            let fill = inp.short_bytes();
            if fill.is_empty() {
                vec![b'a'; size]
            } else {
                fill.iter().copied().cycle().take(size).collect()
            }
        }
    })
}

/// Envoy's `source.address`, sometimes missing or garbled.
pub fn source(inp: &mut Input) -> Option<Vec<u8>> {
    Some(match inp.below(6) {
        0 => return None,
        1 => {
            let [a, b, c, d] = inp.u32().to_be_bytes();
            format!("{a}.{b}.{c}.{d}:{}", inp.u16()).into_bytes()
        }
        2 => format!("[{}]:{}", ip(inp), inp.u16()).into_bytes(),
        3 => ip(inp).into_bytes(),
        4 => inp.short_bytes().to_vec(),
        _ => b"192.0.2.10:40000".to_vec(),
    })
}

/// A request with a value (or none) for every header and property the plan reads.
pub fn request(plan: &Plan, inp: &mut Input) -> RequestInfo {
    // Headers first: the order the input is read in is the corpus's format,
    // so what was added later (the properties) is read last.
    let req = RequestInfo::from_headers(&plan.header_names, |_| value(inp));
    let req = RequestInfo {
        source_address: source(inp),
        client_metadata: if inp.bool() { value(inp) } else { None },
        tier_metadata: if inp.bool() { value(inp) } else { None },
        ..req
    };
    (0..plan.properties.len()).fold(req, |req, id| match value(inp) {
        Some(v) => req.with_property(id, &v),
        None => req,
    })
}
