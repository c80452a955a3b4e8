//! `key`: bucket keys from hostile request identity. Fixed configurations (client id from a
//! header or from metadata, `trusted_proxy_hops` 0..=3, local and global rules keyed on
//! every kind of part, a quota) meet arbitrary header values (absent, empty, non-UTF-8,
//! up to 64 KiB, `X-Forwarded-For` chains) and peer addresses. Checked against a small
//! model of the documented behaviour:
//!
//! - the same request always gets the same buckets, also from a second plan compiled from
//!   the same configuration and seed;
//! - unlimited clients and tiers get nothing; soft clients are soft;
//! - `bad_input` holds `Oversized` exactly when a key part the plan used is over 1 KiB,
//!   `BadForwardedFor` exactly when a used client IP came from a garbled trusted entry,
//!   `NoPeerAddress` exactly when a used client IP had no usable peer address;
//! - the client IP is the `hops`-th `X-Forwarded-For` entry from the right, and entries a
//!   client prepends never change it;
//! - global keys are `<rule>/<tag>=<escaped value>` or `<tag>#<hash>` per part, printable
//!   ASCII, and decode back to the parts; the hash tag is the first part.
//!
//! Input: one byte (hops = b % 4, metadata identity when b & 4), then the request
//! (`request_gen::request`), then a forged `X-Forwarded-For` prefix.

use crate::input::Input;
use crate::request_gen;
use ratelimit_wasm::policy::key::BadInput;
use ratelimit_wasm::policy::plan::{Evaluation, Plan};
use ratelimit_wasm::policy::request::RequestInfo;
use std::net::{IpAddr, SocketAddr};

const RULES: &str = r#"
  "tiers": { "free": {}, "pro": {}, "staff": { "unlimited": true } },
  "global": { "cluster": "gw" },
  "rules": [
    { "name": "client", "key": ["client"], "limits": [ { "requests": 10, "per": "1m" } ] },
    { "name": "ip", "key": ["ip"], "limits": [ { "requests": 10, "per": "1m" } ] },
    { "name": "mp", "key": ["method", "path"], "limits": [ { "requests": 10, "per": "1m" } ] },
    { "name": "tenant", "key": ["header:x-tenant", "client"],
      "limits": [ { "requests": 10, "per": "1m" } ] },
    { "name": "all", "limits": [ { "requests": 10, "per": "1m" } ] },
    { "name": "g-ip", "scope": "global", "key": ["ip"], "limits": [ { "requests": 10, "per": "1m" } ] },
    { "name": "g-multi", "scope": "global", "key": ["client", "path", "header:X-Tenant"],
      "limits": [ { "requests": 10, "per": "1m" } ] },
    { "name": "g-client", "scope": "global", "algorithm": "sliding_window", "key": ["client"],
      "limits": [ { "requests": 10, "per": "1m" } ] }
  ],
  "quotas": [ { "name": "monthly", "key": ["client", "header:x-tenant"], "period": "month",
                "limit": 1000, "upgrade_url": "https://example.com/upgrade" } ]
}"#;

const CLIENTS: &str = r#""default_tier": "free",
    "clients": { "root": { "unlimited": true }, "trial": { "soft": true }, "acme": { "tier": "pro" } }"#;

/// The configuration for `hops` and the identity source.
pub fn config(hops: u32, metadata: bool) -> String {
    let identity = if metadata {
        format!(
            r#""client_id_metadata": ["jwt", "sub"], "tier_metadata": ["jwt", "tier"],
    "trusted_proxy_hops": {hops}, {CLIENTS}"#
        )
    } else {
        format!(
            r#""client_id_header": "x-client-id", "tier_header": "x-tier",
    "trusted_proxy_hops": {hops}, {CLIENTS}"#
        )
    };
    format!("{{\n  \"domain\": \"fuzz\",\n  \"identity\": {{ {identity} }},{RULES}")
}

/// One rule or quota of the configuration, as the model needs it.
pub struct Keyed {
    name: String,
    parts: Vec<String>,
    global: bool,
    quota: bool,
}

/// A configuration, two plans compiled from it with the same seed, and its rules and quotas.
pub struct Setup {
    pub plan: Plan,
    /// The plugin configuration (JSON) the plan was compiled from: the
    /// gateway's policy in `filter_to_gateway` (not built with every target).
    #[allow(dead_code)]
    pub config: String,
    again: Plan,
    keyed: Vec<Keyed>,
    hops: u32,
    metadata: bool,
}

impl Setup {
    fn new(hops: u32, metadata: bool) -> Setup {
        let config = config(hops, metadata);
        let cfg = ratelimit_wasm::config::parse(config.as_bytes()).expect("the key config parses");
        let v: serde_json::Value = serde_json::from_str(&config).expect("config is JSON");
        let keyed = |x: &serde_json::Value, quota: bool| Keyed {
            name: x["name"].as_str().unwrap().to_string(),
            parts: x["key"]
                .as_array()
                .map(|a| a.iter().map(|p| p.as_str().unwrap().to_string()).collect())
                .unwrap_or_default(),
            global: quota || x["scope"] == "global",
            quota,
        };
        let rules = v["rules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| keyed(r, false));
        let quotas = v["quotas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| keyed(q, true));
        Setup {
            config: config.clone(),
            plan: Plan::compile(&cfg, [9; 16]),
            again: Plan::compile(&cfg, [9; 16]),
            keyed: rules.chain(quotas).collect(),
            hops,
            metadata,
        }
    }
}

thread_local! {
    static SETUPS: Vec<Setup> = (0..8u8).map(|b| Setup::new(u32::from(b % 4), b & 4 != 0)).collect();
}

/// Runs `f` with the setup that input byte `b` selects: hops `b % 4`, metadata when `b & 4`.
pub fn with_setup<R>(b: u8, f: impl FnOnce(&Setup) -> R) -> R {
    SETUPS.with(|s| f(&s[usize::from(b % 8)]))
}

fn header<'a>(plan: &Plan, req: &'a RequestInfo, name: &str) -> Option<&'a [u8]> {
    let id = plan.header_names.iter().position(|n| n == name)?;
    req.header(id)
}

/// The peer address as documented (`1.2.3.4:5678`, `[::1]:80` or a bare IP),
/// read by the standard library's socket-address parser rather than by the
/// filter's own steps. Envoy writes nothing else; for any other text the
/// filter's reading is taken, once checked to be an address written in it.
fn model_peer(address: &[u8]) -> Option<IpAddr> {
    let filter = ratelimit_wasm::policy::key::peer_ip(address);
    let Ok(text) = std::str::from_utf8(address).map(str::trim) else {
        assert_eq!(filter, None, "an address that is not UTF-8 gave {filter:?}");
        return None;
    };
    let documented = text
        .parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<SocketAddr>().ok().map(|a| a.ip()));
    if documented.is_some() {
        assert_eq!(filter, documented, "peer {text:?}");
        return documented;
    }
    if let Some(ip) = filter {
        let written = [ip.to_string(), format!("[{ip}]")];
        assert!(
            written.iter().any(|w| text.contains(w.as_str())) || ip.is_ipv6(),
            "peer {text:?} gave {ip}, which it does not hold"
        );
    }
    filter
}

/// The client IP, and whether the trusted entry was garbled.
fn model_ip(plan: &Plan, req: &RequestInfo, hops: u32) -> (Option<IpAddr>, bool) {
    let mut garbled = false;
    if hops > 0 {
        if let Some(xff) = header(plan, req, "x-forwarded-for") {
            if let Some(entry) = xff.split(|&b| b == b',').rev().nth(hops as usize - 1) {
                match std::str::from_utf8(entry)
                    .ok()
                    .and_then(|e| e.trim().parse().ok())
                {
                    Some(ip) => return (Some(ip), false),
                    None => garbled = true,
                }
            }
        }
    }
    (req.source_address.as_deref().and_then(model_peer), garbled)
}

struct Model {
    client: Option<Vec<u8>>,
    unlimited: bool,
    soft: bool,
    ip: Option<IpAddr>,
    garbled_xff: bool,
}

fn model(plan: &Plan, req: &RequestInfo, hops: u32, metadata: bool) -> Model {
    let (client, claimed) = if metadata {
        (req.client_metadata.clone(), req.tier_metadata.clone())
    } else {
        (
            header(plan, req, "x-client-id").map(<[u8]>::to_vec),
            header(plan, req, "x-tier").map(<[u8]>::to_vec),
        )
    };
    let client = client.filter(|c| !c.is_empty());
    let known = client.as_deref();
    let tier: &[u8] = match known {
        Some(b"acme") => b"pro",
        _ => match claimed.as_deref() {
            Some(t @ (b"free" | b"pro" | b"staff")) => t,
            _ => b"free",
        },
    };
    let (ip, garbled_xff) = model_ip(plan, req, hops);
    Model {
        unlimited: known == Some(&b"root"[..]) || tier == b"staff",
        soft: known == Some(&b"trial"[..]),
        client,
        ip,
        garbled_xff,
    }
}

/// The value of one key part as the documentation describes it; `None`: the header is absent.
fn part_value(plan: &Plan, req: &RequestInfo, m: &Model, part: &str) -> Option<(u8, Vec<u8>)> {
    let ip = || m.ip.map(|i| i.to_string().into_bytes()).unwrap_or_default();
    Some(match part {
        "client" => match &m.client {
            Some(c) => (b'c', c.clone()),
            None => (b'i', ip()),
        },
        "ip" => (b'i', ip()),
        "method" => (b'm', req.method().to_vec()),
        "path" => (b'p', req.path().to_vec()),
        h => {
            let name = h.strip_prefix("header:").unwrap().to_ascii_lowercase();
            (b'h', header(plan, req, &name)?.to_vec())
        }
    })
}

/// Decodes one escaped global key part, or `None` if it is not well formed.
fn unescape(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                if hex.bytes().any(|c| c.is_ascii_lowercase()) {
                    return None;
                }
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            c if c.is_ascii_alphanumeric() || b"-._~:@".contains(&c) => {
                out.push(c);
                i += 1;
            }
            _ => return None,
        }
    }
    Some(out)
}

fn check_global_key(key: &str, tag: &str, name: &str, want: &[(u8, Vec<u8>)]) {
    assert!(key.is_ascii(), "{key:?}");
    assert!(
        key.len() <= ratelimit_wasm::policy::key::MAX_GLOBAL_KEY_BYTES,
        "{key:?}"
    );
    // A key too long for the gateway is sent as `<name>#<hash of the whole key>`.
    if let Some(hash) = key.strip_prefix(name).and_then(|r| r.strip_prefix('#')) {
        assert!(
            hash.len() == 32 && hash.bytes().all(|c| c.is_ascii_hexdigit()),
            "{key:?}"
        );
        return;
    }
    let mut pieces = key.split('/');
    assert_eq!(pieces.next(), Some(name), "{key:?}");
    let parts: Vec<&str> = pieces.collect();
    assert_eq!(parts.len(), want.len(), "{key:?}");
    assert_eq!(tag, parts.first().copied().unwrap_or(""), "{key:?}");
    for (got, (t, value)) in parts.iter().zip(want) {
        let (head, body) = got.split_at(1);
        assert_eq!(head.as_bytes(), [*t], "{key:?}");
        if value.len() > ratelimit_wasm::policy::key::MAX_GLOBAL_PART_BYTES {
            let hash = body.strip_prefix('#').unwrap_or_else(|| panic!("{key:?}"));
            assert!(
                hash.len() == 32 && hash.bytes().all(|c| c.is_ascii_hexdigit()),
                "{key:?}"
            );
        } else {
            let escaped = body.strip_prefix('=').unwrap_or_else(|| panic!("{key:?}"));
            assert_eq!(unescape(escaped).as_ref(), Some(value), "{key:?}");
        }
    }
}

fn check(setup: &Setup, req: &RequestInfo, eval: &Evaluation) {
    let plan = &setup.plan;
    let m = model(plan, req, setup.hops, setup.metadata);
    assert_eq!(eval.unlimited, m.unlimited, "{eval:?}");
    if m.unlimited {
        let nothing = Evaluation {
            cost: 1,
            unlimited: true,
            soft: m.soft,
            ..Evaluation::default()
        };
        assert_eq!(eval, &nothing);
        return;
    }
    assert_eq!(eval.soft, m.soft, "{eval:?}");
    let (mut oversized, mut ip_used) = (false, false);
    let mut global = eval.global.iter().map(|g| (g.key.as_str(), g.tag.as_str()));
    let mut quotas = eval.quotas.iter().map(|q| (q.key.as_str(), q.tag.as_str()));
    for k in &setup.keyed {
        let mut values = Vec::new();
        let mut applies = true;
        for p in &k.parts {
            if p == "ip" || (p == "client" && m.client.is_none()) {
                ip_used = true;
            }
            match part_value(plan, req, &m, p) {
                Some(v) => {
                    oversized |= v.1.len() > ratelimit_wasm::policy::key::MAX_KEY_PART_BYTES;
                    values.push(v);
                }
                None => {
                    applies = false;
                    break;
                }
            }
        }
        if !applies || !k.global {
            continue;
        }
        let next = if k.quota {
            quotas.next()
        } else {
            global.next()
        };
        let (key, tag) = next.unwrap_or_else(|| panic!("no global key for {}: {eval:?}", k.name));
        check_global_key(key, tag, &k.name, &values);
    }
    assert!(
        global.next().is_none() && quotas.next().is_none(),
        "{eval:?}"
    );
    let has = |b: BadInput| eval.bad_input.contains(&b);
    assert_eq!(has(BadInput::Oversized), oversized, "{:?}", eval.bad_input);
    assert_eq!(
        has(BadInput::BadForwardedFor),
        ip_used && m.garbled_xff,
        "{:?}",
        eval.bad_input
    );
    assert_eq!(
        has(BadInput::NoPeerAddress),
        ip_used && m.ip.is_none(),
        "{:?}",
        eval.bad_input
    );
}

pub fn run(data: &[u8]) {
    let mut inp = Input::new(data);
    let b = inp.u8();
    with_setup(b, |setup| run_with(setup, &mut inp));
}

fn run_with(setup: &Setup, inp: &mut Input) {
    let plan = &setup.plan;
    let req = request_gen::request(plan, inp);
    let eval = plan.evaluate(&req);
    assert_eq!(eval, plan.evaluate(&req), "same request, same buckets");
    assert_eq!(
        eval,
        setup.again.evaluate(&req),
        "same config and seed, same buckets"
    );
    check(setup, &req, &eval);

    // Entries a client prepends to a chain that reaches the trusted hops change nothing.
    let hops = setup.hops as usize;
    let xff = plan
        .header_names
        .iter()
        .position(|n| n == "x-forwarded-for");
    let prefix = inp.short_bytes();
    let (Some(x), true) = (xff, hops > 0) else {
        return;
    };
    let Some(chain) = req.header(x) else { return };
    if chain.split(|&b| b == b',').count() < hops {
        return;
    }
    let mut forged = req.clone();
    let mut v = prefix.to_vec();
    v.push(b',');
    v.extend_from_slice(chain);
    forged.headers[x] = Some(v);
    let e2 = plan.evaluate(&forged);
    let by_ip = |e: &Evaluation| -> (Vec<String>, Vec<u64>) {
        let keys = e.global.iter().filter(|g| g.key.starts_with("g-ip/"));
        let buckets = e.buckets.iter().filter(|b| plan.rules[b.rule].name == "ip");
        (
            keys.map(|g| g.key.clone()).collect(),
            buckets.map(|b| b.fingerprint).collect(),
        )
    };
    assert_eq!(
        by_ip(&eval),
        by_ip(&e2),
        "a prepended entry moved the client IP"
    );
}
