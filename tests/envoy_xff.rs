//! Which address the `ip` key is, and which path a `path_prefix` rule sees,
//! measured with a real Envoy 1.40 (`--concurrency 2`, the filter built by
//! `make build`) run from the shipped template `envoy/envoy.yaml` and from
//! variants of it that differ only in the HTTP connection manager settings
//! named below (the variant is written to a temporary file; the shipped
//! template itself is never changed).
//!
//! # The X-Forwarded-For matrix
//!
//! One rule per traffic kind, keyed `["ip"]` at 5 per minute, 20 requests of
//! each kind, each on its own connection from 127.0.0.1:
//!
//! * **direct**: a client talking straight to Envoy forges a different
//!   three-entry `X-Forwarded-For` on every request
//!   (`192.0.2.i, 198.51.100.i, 203.0.113.i`). 5 admitted means the key was
//!   the connection's peer; 20 means the key was an address the client wrote.
//! * **proxied**: what a trusted proxy in front would send: a forged entry
//!   distinct per request, then the address the proxy saw, alternating between
//!   two real clients (`192.0.2.(100+i), 203.0.113.(201 + i % 2)`). 10 admitted
//!   means the key was the real client (5 each); 5 means the key was the
//!   proxy (every client behind it shares one bucket); 20 means the key was
//!   the forged entry.
//!
//! | `use_remote_address` | `xff_num_trusted_hops` | `trusted_proxy_hops` | direct | proxied | what it proves |
//! | --- | --- | --- | --- | --- | --- |
//! | false (Envoy's default, the old template) | 0 | 0 | 20 | 10 | Envoy makes the last XFF entry `source.address`: right behind a proxy that always appends, but a client that reaches Envoy directly chooses its `ip` (the defect these settings close) |
//! | false | 0 | 1 | 20 | 10 | the filter's hop count reads the same last entry: no safer |
//! | false | 1 | 0 | 20 | 20 | Envoy takes the 2nd entry from the right (N+1): behind ONE proxy that is a client-written entry |
//! | false | 1 | 1 | 20 | 10 | the filter reads the last entry again, whatever Envoy chose |
//! | **true (shipped)** | 0 | 0 | **5** | 5 | `ip` is the TCP peer: nothing a client writes changes it (an edge proxy; behind a proxy every client would share the proxy's bucket) |
//! | true | 0 | 1 | 5 | 5 | the last entry is the peer Envoy itself appended: the same as 0 |
//! | true | 0 | 2 | 20 | 10 | the entry before Envoy's own: the real client behind one proxy, forgeable by a client that bypasses it |
//! | true | 1 | 0 | 20 | 10 | Envoy trusts one hop (the Nth entry from the right, before appending): the same as the row above, decided by Envoy |
//! | true | 1 | 1 | 5 | 5 | the filter's hop count reads Envoy's appended peer, not the address Envoy chose |
//!
//! So with `use_remote_address: true` and no trusted hops (the shipped edge
//! config) a client cannot choose its `ip`; behind N trusted proxies
//! (`xff_num_trusted_hops: N`, or `trusted_proxy_hops: N + 1`) the key is the
//! real client as long as only those proxies can reach this Envoy.
//!
//! # Path normalisation
//!
//! A rule `path_prefix: /upload` keyed on the client at 5 per minute, 8
//! requests of each spelling below (its own client id each). With the shipped
//! settings (`normalize_path`, `merge_slashes`,
//! `path_with_escaped_slashes_action: UNESCAPE_AND_REDIRECT`) `//upload`,
//! `/%75pload` and `/a/../upload` are limited like `/upload` (5 of 8);
//! `/upload%2Fx` and `/%2Fupload` never reach the filter or the upstream (a
//! redirect to the unescaped path, which is then limited when followed). With
//! Envoy's defaults (the old template) the first three pass all 8.
//!
//! Every test prints what it measured (`cargo test --test envoy_xff --
//! --nocapture`). Nothing is skipped: without Envoy or the wasm file the tests
//! fail and say which `make` target to run.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use testkit::{config::template_path, ConnectionMode, Envoy, EnvoyOptions};

/// The four edge settings of the shipped template, as written there.
const SHIPPED_REMOTE_ADDRESS: &str = "          use_remote_address: true\n";
const SHIPPED_PATH_SETTINGS: &str = "          normalize_path: true\n          merge_slashes: true\n          path_with_escaped_slashes_action: UNESCAPE_AND_REDIRECT\n";

/// Requests of each traffic kind in one matrix cell.
const REQUESTS: usize = 20;
/// The rules' limit per minute.
const LIMIT: usize = 5;

/// The connection manager settings of one template variant.
#[derive(Debug, Clone, Copy)]
struct Hcm {
    use_remote_address: bool,
    xff_num_trusted_hops: u32,
    /// The shipped path settings, or none (Envoy's defaults).
    normalize: bool,
}

/// The shipped template with the ingress connection manager's settings
/// replaced by `hcm`, written into `dir`. Fails if the shipped template no
/// longer holds the settings this test replaces.
fn template_variant(hcm: Hcm, dir: &std::path::Path) -> PathBuf {
    let path = template_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    for needle in [SHIPPED_REMOTE_ADDRESS, SHIPPED_PATH_SETTINGS] {
        assert_eq!(
            text.matches(needle).count(),
            1,
            "the shipped template must hold {needle:?} once: update this test and docs/security.md \"Client identity\""
        );
    }
    let mut remote = format!("          use_remote_address: {}\n", hcm.use_remote_address);
    if hcm.xff_num_trusted_hops > 0 {
        remote.push_str(&format!(
            "          xff_num_trusted_hops: {}\n",
            hcm.xff_num_trusted_hops
        ));
    }
    let paths = if hcm.normalize {
        SHIPPED_PATH_SETTINGS
    } else {
        ""
    };
    let out = text
        .replace(SHIPPED_REMOTE_ADDRESS, &remote)
        .replace(SHIPPED_PATH_SETTINGS, paths);
    let file = dir.join(format!(
        "envoy-ura{}-xff{}-norm{}.yaml",
        hcm.use_remote_address, hcm.xff_num_trusted_hops, hcm.normalize
    ));
    std::fs::write(&file, out).unwrap_or_else(|e| panic!("writing {}: {e}", file.display()));
    file
}

/// A directory for the template variants, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> TempDir {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ratelimit-xff-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    TempDir(dir)
}

fn start(plugin_config: String, template: PathBuf) -> Envoy {
    let mut opts = EnvoyOptions::new(plugin_config);
    opts.template = Some(template);
    Envoy::start(opts).unwrap_or_else(|e| panic!("could not start Envoy: {e:#}"))
}

/// Two rules keyed on the IP, one per traffic kind, `LIMIT` per minute.
fn ip_rules(trusted_proxy_hops: u32) -> String {
    let rule = |name: &str| {
        json!({ "name": name, "match": { "path_prefix": format!("/{name}") },
                "key": ["ip"], "limits": [{ "requests": LIMIT, "per": "1m" }] })
    };
    json!({
        "domain": "xff",
        "identity": { "trusted_proxy_hops": trusted_proxy_hops },
        "rules": [rule("direct"), rule("proxied")]
    })
    .to_string()
}

/// How many of `REQUESTS` GETs of `path` were admitted (200), each with the
/// `X-Forwarded-For` that `xff(i)` gives; every other answer must be a 429.
fn admitted(envoy: &Envoy, path: &str, xff: impl Fn(usize) -> String) -> usize {
    let client = envoy.client(ConnectionMode::NewPerRequest);
    let mut ok = 0;
    for i in 1..=REQUESTS {
        let v = xff(i);
        let r = client
            .get(path, &[("x-forwarded-for", &v)])
            .unwrap_or_else(|e| panic!("GET {path} with XFF {v}: {e:#}"));
        match r.status {
            200 => ok += 1,
            429 => {}
            s => panic!("GET {path} with XFF {v}: status {s}: {r:#?}"),
        }
    }
    ok
}

/// A client's own forged chain, different on every request `i`.
fn direct_xff(i: usize) -> String {
    format!("192.0.2.{i}, 198.51.100.{i}, 203.0.113.{i}")
}

/// What a trusted proxy forwards for request `i`: the client's forged entry,
/// then the address the proxy saw (one of two real clients).
fn proxied_xff(i: usize) -> String {
    format!("192.0.2.{}, 203.0.113.{}", 100 + i, 201 + i % 2)
}

/// One matrix cell: (direct, proxied) admitted counts.
fn cell(ura: bool, xff_hops: u32, proxy_hops: u32) -> (usize, usize) {
    let dir = tempdir();
    let hcm = Hcm {
        use_remote_address: ura,
        xff_num_trusted_hops: xff_hops,
        normalize: true,
    };
    let envoy = start(ip_rules(proxy_hops), template_variant(hcm, dir.path()));
    let direct = admitted(&envoy, "/direct", direct_xff);
    let proxied = admitted(&envoy, "/proxied", proxied_xff);
    (direct, proxied)
}

#[test]
fn xff_matrix_admits_exactly_what_each_setting_keys_on() {
    // (use_remote_address, xff_num_trusted_hops, trusted_proxy_hops) ->
    // (direct, proxied): see the table in the module documentation.
    let expected = [
        ((false, 0, 0), (20, 10)),
        ((false, 0, 1), (20, 10)),
        ((false, 1, 0), (20, 20)),
        ((false, 1, 1), (20, 10)),
        ((true, 0, 0), (5, 5)),
        ((true, 0, 1), (5, 5)),
        ((true, 0, 2), (20, 10)),
        ((true, 1, 0), (20, 10)),
        ((true, 1, 1), (5, 5)),
    ];
    let mut measured = Vec::new();
    for &((ura, xff, hops), _) in &expected {
        let got = cell(ura, xff, hops);
        println!(
            "use_remote_address {ura:<5} xff_num_trusted_hops {xff} trusted_proxy_hops {hops}: \
             direct {:>2} of {REQUESTS}, proxied {:>2} of {REQUESTS}",
            got.0, got.1
        );
        measured.push(((ura, xff, hops), got));
    }
    assert_eq!(measured, expected);
}

#[test]
fn shipped_template_keys_ip_on_the_connection_not_on_forged_xff() {
    // The shipped template itself, unmodified: the edge cell of the matrix.
    // With the old template (Envoy's default use_remote_address: false) this
    // measured direct 20 of 20.
    let envoy = start(ip_rules(0), template_path());
    let direct = admitted(&envoy, "/direct", direct_xff);
    println!("shipped template, trusted_proxy_hops 0: direct {direct} of {REQUESTS}");
    assert_eq!(direct, LIMIT);
}

/// The status line's code and the `Location` header of a raw HTTP/1.1 GET:
/// sent byte for byte, so that no client library normalises the path first.
fn raw_get(port: u16, path: &str, client_id: &str) -> (u16, Option<String>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connecting to Envoy");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nx-client-id: {client_id}\r\nConnection: close\r\n\r\n"
    )
    .expect("sending the request");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("reading the answer");
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"));
    let location = answer.lines().take_while(|l| !l.is_empty()).find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case("location")
            .then(|| v.trim().to_string())
    });
    (status, location)
}

/// For each spelling, 8 GETs on fresh connections (client id = the
/// spelling): (200s, 429s, redirects and their target).
fn path_counts(
    envoy: &Envoy,
    spellings: &[&str],
) -> Vec<(String, usize, usize, usize, Option<String>)> {
    spellings
        .iter()
        .map(|p| {
            let (mut ok, mut limited, mut redirected, mut target) = (0, 0, 0, None);
            for _ in 0..8 {
                match raw_get(envoy.ports().listen, p, p) {
                    (200, _) => ok += 1,
                    (429, _) => limited += 1,
                    (301..=308, loc) => {
                        redirected += 1;
                        target = loc;
                    }
                    (s, _) => panic!("GET {p}: status {s}"),
                }
            }
            println!("{p:<14} 200 x{ok}  429 x{limited}  redirect x{redirected} -> {target:?}");
            (p.to_string(), ok, limited, redirected, target)
        })
        .collect()
}

const SPELLINGS: [&str; 7] = [
    "/upload",
    "//upload",
    "/%75pload",
    "/a/../upload",
    "/upload%2Fx",
    "/%2Fupload",
    "/download",
];

fn upload_rule() -> String {
    json!({
        "domain": "paths",
        "rules": [{ "name": "uploads", "match": { "path_prefix": "/upload" },
                    "key": ["client"], "limits": [{ "requests": LIMIT, "per": "1m" }] }]
    })
    .to_string()
}

fn row(
    p: &str,
    ok: usize,
    limited: usize,
    redirected: usize,
    target: Option<&str>,
) -> (String, usize, usize, usize, Option<String>) {
    (
        p.to_string(),
        ok,
        limited,
        redirected,
        target.map(str::to_string),
    )
}

#[test]
fn shipped_path_settings_leave_no_spelling_of_a_prefix_unlimited() {
    // The shipped template itself, unmodified.
    let envoy = start(upload_rule(), template_path());
    let got = path_counts(&envoy, &SPELLINGS);
    assert_eq!(
        got,
        vec![
            row("/upload", 5, 3, 0, None),
            row("//upload", 5, 3, 0, None),
            row("/%75pload", 5, 3, 0, None),
            row("/a/../upload", 5, 3, 0, None),
            row("/upload%2Fx", 0, 0, 8, Some("/upload/x")),
            row("/%2Fupload", 0, 0, 8, Some("/upload")),
            row("/download", 8, 0, 0, None),
        ]
    );
    // Following the redirect lands on a limited path: the same client's
    // bucket for /upload/x is a fresh one (its id differs), 5 of 8 again.
    let followed = path_counts(&envoy, &["/upload/x"]);
    assert_eq!(followed, vec![row("/upload/x", 5, 3, 0, None)]);
}

#[test]
fn envoy_default_path_settings_let_other_spellings_past_a_prefix_rule() {
    // The old template (no path settings): the figure the settings fix.
    let dir = tempdir();
    let old = Hcm {
        use_remote_address: true,
        xff_num_trusted_hops: 0,
        normalize: false,
    };
    let envoy = start(upload_rule(), template_variant(old, dir.path()));
    let got = path_counts(&envoy, &SPELLINGS);
    assert_eq!(
        got,
        vec![
            row("/upload", 5, 3, 0, None),
            row("//upload", 8, 0, 0, None),
            row("/%75pload", 8, 0, 0, None),
            row("/a/../upload", 8, 0, 0, None),
            row("/upload%2Fx", 5, 3, 0, None),
            row("/%2Fupload", 8, 0, 0, None),
            row("/download", 8, 0, 0, None),
        ]
    );
}
