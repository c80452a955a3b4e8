//! Helpers shared by the gateway's integration tests: an in-process gateway
//! on a free port in front of a real Redis, requests and metrics.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use ratelimit_gateway::{Config, Running, Target};
use serde_json::{json, Value};

/// Starts a gateway in this runtime in front of `target`, with a generous
/// Redis timeout (debug builds on 2 cores under 64 concurrent clients). Its
/// policy is this process's [`policy_dir`]: the requests built here add what
/// they name to it, and the post helpers put it in force before posting.
pub async fn gateway(target: Target, timeout_ms: u64) -> Running {
    gateway_with(target, timeout_ms, |c| c).await
}

/// [`gateway`] with its configuration changed by `change` first.
pub async fn gateway_with(
    target: Target,
    timeout_ms: u64,
    change: impl FnOnce(Config) -> Config,
) -> Running {
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        target,
        redis_timeout: Duration::from_millis(timeout_ms),
        key_prefix: "rl:".to_string(),
        // No tokens (in-process tests), default bounds.
        ..Config::single(
            "127.0.0.1:0".parse().unwrap(),
            String::new(),
            vec![policy_dir()],
        )
    };
    let config = change(config);
    let running = ratelimit_gateway::start(config, Duration::from_secs(15))
        .await
        .unwrap();
    assert!(
        running
            .app
            .limiter
            .store()
            .wait_connected(Duration::from_secs(1))
            .await,
        "the gateway did not connect to Redis"
    );
    registry().gateways.push(running.app.policy.clone());
    running
}

/// A limit: (requests, window_ms, algorithm).
pub type L = (u64, u64, &'static str);

/// What the requests of this test process named, as plugin configurations:
/// one global rule per key prefix (its limits; other limits for the same
/// rule become tiers `v<i>`), one quota per quota key prefix. Tiers, not
/// client overrides: the gateway takes `client:<id>` only on that client's
/// key, and these requests name keys of their own.
#[derive(Default)]
struct Registry {
    domains: BTreeMap<String, Domain>,
    /// Bumped on every change; the gateways reload when it moved.
    generation: u64,
    synced: u64,
    gateways: Vec<
        std::sync::Arc<ratelimit_gateway::reload::Reloadable<ratelimit_gateway::policy::Policy>>,
    >,
}

/// A rule's algorithm and its limit sets: (requests, window_ms) per limit;
/// the first is `default`, the others tiers `v<i>`.
type RuleSets = (String, Vec<Vec<(u64, u64)>>);

#[derive(Default)]
struct Domain {
    rules: BTreeMap<String, RuleSets>,
    quotas: BTreeMap<String, (String, Vec<u64>)>,
    max_cost: u64,
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The policy directory of this test process (one `<domain>.json` each).
pub fn policy_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rlgw-test-policy-{}", std::process::id()));
    if !dir.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        // A directory given as --policy must hold a file.
        std::fs::write(
            dir.join("zz-start.json"),
            r#"{"domain":"zz-start","rules":[{"name":"r","limits":[{"requests":1,"per":1}]}]}"#,
        )
        .unwrap();
    }
    dir
}

/// The name a key is filed under: the part before its first `/` or `#`.
pub fn rule_of(key: &str) -> &str {
    key.split(['/', '#']).next().unwrap_or(key)
}

/// Files `limits` for `key`'s rule in `domain`; the variant that names them.
fn file_rule(domain: &str, key: &str, limits: &[L], cost: u64) -> String {
    file_in(domain, cost, |d| {
        let algorithm = limits.first().map_or("token_bucket", |l| l.2);
        assert!(
            limits.iter().all(|l| l.2 == algorithm),
            "a rule counts with one algorithm: {limits:?}"
        );
        let pairs: Vec<(u64, u64)> = limits.iter().map(|l| (l.0, l.1)).collect();
        let rule = d
            .rules
            .entry(rule_of(key).to_string())
            .or_insert_with(|| (algorithm.to_string(), Vec::new()));
        assert_eq!(rule.0, algorithm, "rule {key} named with two algorithms");
        variant_of(&mut rule.1, pairs)
    })
}

/// Files in `domain` what `file` files in it (raising the domain's
/// `max_cost` to `cost`); `file` answers the variant's index and whether it
/// added one. The domain's policy file is rewritten when anything changed.
/// The variant's name.
fn file_in(domain: &str, cost: u64, file: impl FnOnce(&mut Domain) -> (usize, bool)) -> String {
    let mut r = registry();
    let d = r.domains.entry(domain.to_string()).or_default();
    let changed = cost > d.max_cost;
    d.max_cost = d.max_cost.max(cost);
    let (i, added) = file(d);
    if changed || added {
        r.generation += 1;
        write_domain(domain, &r.domains[domain]);
    }
    variant_name(i)
}

/// The index of `item` among `variants`, pushed there if new, and whether
/// it was.
fn variant_of<T: PartialEq>(variants: &mut Vec<T>, item: T) -> (usize, bool) {
    match variants.iter().position(|v| *v == item) {
        Some(i) => (i, false),
        None => {
            variants.push(item);
            (variants.len() - 1, true)
        }
    }
}

fn variant_name(i: usize) -> String {
    if i == 0 {
        "default".to_string()
    } else {
        format!("tier:v{i}")
    }
}

fn write_domain(domain: &str, d: &Domain) {
    let limits = |pairs: &[(u64, u64)]| -> Vec<Value> {
        pairs
            .iter()
            .map(|(r, w)| {
                assert_eq!(w % 1000, 0, "a policy window is whole seconds: {w} ms");
                json!({"requests": r, "per": w / 1000})
            })
            .collect()
    };
    // Tier v0 (every request naming `default`) and one per other set.
    let mut tiers: BTreeMap<String, Value> = BTreeMap::new();
    tiers.insert("v0".to_string(), json!({}));
    let mut rules = Vec::new();
    for (name, (algorithm, sets)) in &d.rules {
        // The requests here name their own costs: the `costs` entry below
        // only sets the policy's largest, on requests no rule matches (a
        // cost above a rule it can match is refused at load).
        let mut rule = json!({"name": name, "scope": "global", "algorithm": algorithm,
                          "match": {"headers": {"x-test-cost": "rule"}},
                          "key": ["client"], "limits": limits(&sets[0])});
        for (i, set) in sets.iter().enumerate().skip(1) {
            tiers.insert(format!("v{i}"), json!({}));
            rule["tiers"][format!("v{i}")] = json!(limits(set));
        }
        rules.push(rule);
    }
    if rules.is_empty() {
        // A configuration needs a rule: a local one, which no request can name.
        rules.push(
            json!({"name": "zz-local", "match": {"headers": {"x-test-cost": "rule"}},
                          "limits": [{"requests": 1, "per": 1}]}),
        );
    }
    let mut quotas = Vec::new();
    for (name, (period, amounts)) in &d.quotas {
        let mut quota = json!({"name": name, "key": ["client"], "period": period, "limit": amounts[0],
                           "count": "cost", "upgrade_url": "https://example.com/upgrade"});
        for (i, a) in amounts.iter().enumerate().skip(1) {
            tiers.insert(format!("v{i}"), json!({}));
            quota["tiers"][format!("v{i}")] = json!(a);
        }
        quotas.push(quota);
    }
    let mut config = json!({"domain": domain,
        "global": {"cluster": "gw", "lease": {"fraction": 1.0, "ttl_ms": 3_600_000}},
        "tiers": tiers, "identity": {"default_tier": "v0"}, "rules": rules, "quotas": quotas});
    if d.max_cost > 1 {
        config["costs"] =
            json!([{"match": {"headers": {"x-test-cost": "max"}}, "cost": d.max_cost}]);
    }
    let file = policy_dir().join(format!("{}.json", hex(domain)));
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, config.to_string()).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
}

/// A domain as a file name (any bytes a test uses for a domain).
fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// The plugin configuration (JSON) this process's requests made of `domain`,
/// for a gateway started as a process (`GatewayOptions::policy`).
pub fn policy_json(domain: &str) -> String {
    std::fs::read_to_string(policy_dir().join(format!("{}.json", hex(domain)))).unwrap()
}

/// Puts the policy in force in every in-process gateway, when it changed.
pub fn sync_policy() {
    let mut r = registry();
    if r.synced == r.generation {
        return;
    }
    r.synced = r.generation;
    for g in &r.gateways {
        if let ratelimit_gateway::reload::Outcome::Failed(e) = g.reload(true) {
            panic!("the test policy does not validate: {e}");
        }
    }
}

/// The key sent for `key` with hash tag `tag`: the gateway derives the tag
/// from the key's first part (`rule/c=alice` → `c=alice`), so a key without
/// parts gets `tag` as its one part (`k`, `c=t` → `k/c=t`); a key with parts
/// is sent as it is.
pub fn keyed(key: &str, tag: &str) -> String {
    if key.contains(['/', '#']) || tag.is_empty() {
        key.to_string()
    } else {
        format!("{key}/{tag}")
    }
}

/// A check request body with one or more buckets (key, tag, limits): each
/// names its rule (the key's first part) and the variant holding `limits`;
/// the key is [`keyed`].
pub fn request(domain: &str, cost: u64, buckets: &[(&str, &str, &[L])]) -> Value {
    let buckets: Vec<Value> = buckets
        .iter()
        .map(|(key, tag, limits)| {
            let variant = file_rule(domain, key, limits, cost);
            json!({ "rule": rule_of(key), "key": keyed(key, tag), "tag": tag, "variant": variant, "cost": cost })
        })
        .collect();
    registry().domains.entry(domain.to_string()).or_default();
    json!({ "version": 2, "domain": domain, "buckets": buckets })
}

/// A lease request body for one bucket (key, tag, limits); the key is [`keyed`].
pub fn lease_request(
    domain: &str,
    key: &str,
    tag: &str,
    limits: &[L],
    want: u64,
    give_back: u64,
) -> Value {
    let variant = file_rule(domain, key, limits, 1);
    json!({ "version": 2, "domain": domain, "rule": rule_of(key), "key": keyed(key, tag), "tag": tag,
            "variant": variant, "want": want, "return": give_back })
}

/// Posts to `/v1/lease`; the status and the JSON body.
pub async fn lease(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    post(client, &format!("{base}/v1/lease"), body).await
}

/// Posts `body` as JSON to `url`; the status and the JSON answer.
async fn post(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    sync_policy();
    let resp = client.post(url).json(body).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

/// A quota of `domain` (`limit` per `period` filed in its policy): `{quota,
/// key, tag, variant, amount}`; the key is [`keyed`].
pub fn quota(domain: &str, key: &str, tag: &str, limit: u64, period: &str, amount: u64) -> Value {
    let variant = file_in(domain, amount, |d| {
        let q = d
            .quotas
            .entry(rule_of(key).to_string())
            .or_insert_with(|| (period.to_string(), Vec::new()));
        assert_eq!(q.0, period, "quota {key} named with two periods");
        variant_of(&mut q.1, limit)
    });
    json!({ "quota": rule_of(key), "key": keyed(key, tag), "tag": tag, "variant": variant, "amount": amount })
}

/// `body` with `quotas` set.
pub fn with_quotas(mut body: Value, quotas: &[Value]) -> Value {
    body["quotas"] = Value::Array(quotas.to_vec());
    body
}

/// A request with only quotas (no bucket).
pub fn quota_request(domain: &str, quotas: &[Value]) -> Value {
    let mut body = with_quotas(request(domain, 1, &[]), quotas);
    body.as_object_mut().unwrap().remove("buckets");
    body
}

/// `body.quotas[q]`.
pub fn quota_of(body: &Value, q: usize) -> &Value {
    &body["quotas"][q]
}

/// Posts to `/v1/check`; the status and the JSON body.
pub async fn check(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    post(client, &format!("{base}/v1/check"), body).await
}

/// A check of a `/v3/check` batch: a `/v1/check` body ([`request`],
/// [`with_quotas`]) without its version and domain, which the batch gives.
pub fn as_check(body: &Value) -> Value {
    let mut check = body.clone();
    let fields = check.as_object_mut().unwrap();
    fields.remove("version");
    fields.remove("domain");
    check
}

/// A `/v3/check` body of `checks` (each [`as_check`]) in `domain`.
pub fn batch_request(domain: &str, checks: Vec<Value>) -> Value {
    json!({ "version": 3, "domain": domain, "checks": checks })
}

/// Posts to `/v3/check`; the status and the JSON body.
pub async fn batch(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    post(client, &format!("{base}/v3/check"), body).await
}

/// Posts `body` to `/v1/settle`.
pub async fn settle(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    post(client, &format!("{base}/v1/settle"), body).await
}

/// Posts raw bytes to `/v1/check`.
pub async fn check_raw(client: &reqwest::Client, base: &str, body: &'static str) -> (u16, Value) {
    sync_policy();
    let resp = client
        .post(format!("{base}/v1/check"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

/// `GET path`: status and body text.
pub async fn get(client: &reqwest::Client, base: &str, path: &str) -> (u16, String) {
    let resp = client.get(format!("{base}{path}")).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

/// The value of one sample line of `/metrics` (name with labels, exactly as printed).
pub async fn metric(client: &reqwest::Client, base: &str, sample: &str) -> f64 {
    let (status, text) = get(client, base, "/metrics").await;
    assert_eq!(status, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {sample} in\n{text}"))
}

/// `body.buckets[b].limits[l]`.
pub fn limit(body: &Value, b: usize, l: usize) -> &Value {
    &body["buckets"][b]["limits"][l]
}

/// Starts a single Redis, with the `make deps` hint on failure.
pub fn redis() -> testkit::redis::Redis {
    testkit::redis::Redis::start().unwrap_or_else(|e| panic!("{e:#}"))
}

/// Starts a 3-master Redis Cluster, with the `make deps` hint on failure.
pub fn redis_cluster() -> testkit::redis::RedisCluster {
    testkit::redis::RedisCluster::start().unwrap_or_else(|e| panic!("{e:#}"))
}

/// Sends `total` one-request tasks, at most `clients` at a time, each its own
/// HTTP request on its own connection; counts (allowed, denied, other).
pub async fn burst(base: &str, body: Value, clients: usize, total: usize) -> (u64, u64, u64) {
    let body = std::sync::Arc::new(body);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let base = base.to_string();
        let body = body.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap();
            let (mut a, mut d, mut o) = (0, 0, 0);
            while next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < total {
                let (status, resp) = check(&client, &base, &body).await;
                match (status, resp["allowed"].as_bool()) {
                    (200, Some(true)) => a += 1,
                    (200, Some(false)) => d += 1,
                    _ => {
                        eprintln!("unexpected answer {status}: {resp}");
                        o += 1
                    }
                }
            }
            (a, d, o)
        }));
    }
    let mut sum = (0, 0, 0);
    for t in tasks {
        let (a, d, o) = t.await.unwrap();
        sum = (sum.0 + a, sum.1 + d, sum.2 + o);
    }
    sum
}

/// splitmix64: seeded, reproducible test input.
// Each test binary compiles this module; not all of them draw random input.
#[allow(unused_imports)]
pub use testkit::rng::Rng;

/// The policy this process's requests made, as a gateway started now loads it.
pub fn current_policy() -> ratelimit_gateway::policy::Policy {
    let sources = ratelimit_gateway::reload::read_sources_with(&[policy_dir()], &["json"]).unwrap();
    ratelimit_gateway::policy::parse(&sources).unwrap()
}

/// A check body resolved as the gateway resolves it (limits from the policy).
pub fn resolve(body: &Value) -> ratelimit_gateway::policy::Resolved {
    let req = ratelimit_gateway::protocol::parse_check(&serde_json::to_vec(body).unwrap()).unwrap();
    current_policy().resolve_check(&req).unwrap()
}

/// A lease body resolved as the gateway resolves it.
pub fn resolve_lease(body: &Value) -> ratelimit_gateway::policy::ResolvedLease {
    let req = ratelimit_gateway::protocol::parse_lease(&serde_json::to_vec(body).unwrap()).unwrap();
    current_policy().resolve_lease(&req).unwrap()
}

/// One check at time `t` (ms): through the gateway's limiter on a
/// [`ratelimit_gateway::clock::FixedClock`].
pub async fn check_at(gw: &Running, body: &Value, t: u64) -> Value {
    sync_policy();
    let answer = gw
        .app
        .limiter
        .with_clock(std::sync::Arc::new(ratelimit_gateway::clock::FixedClock(t)))
        .check(&resolve(body))
        .await
        .unwrap();
    serde_json::to_value(answer).unwrap()
}

/// Adds a whole plugin configuration (its own domain, which no request of
/// this process names otherwise) to the policy.
pub fn add_policy(config_json: &str) {
    let v: Value = serde_json::from_str(config_json).unwrap();
    let domain = v["domain"].as_str().unwrap();
    let mut r = registry();
    assert!(
        !r.domains.contains_key(domain),
        "domain {domain} already filed"
    );
    std::fs::write(
        policy_dir().join(format!("{}.json", hex(domain))),
        config_json,
    )
    .unwrap();
    r.generation += 1;
}

fn limits_of(limits: &[L]) -> Vec<ratelimit_gateway::protocol::Limit> {
    limits
        .iter()
        .map(|(r, w, a)| ratelimit_gateway::protocol::Limit {
            requests: *r,
            window_ms: *w,
            algorithm: serde_json::from_value(json!(a)).unwrap(),
            in_flight: false,
        })
        .collect()
}

/// What `Limiter::check` takes, built directly: for arithmetic tests
/// beyond what a policy can say (windows in ms, products up to 2^53).
pub fn direct_check(
    domain: &str,
    cost: u64,
    buckets: &[(&str, &str, &[L])],
) -> ratelimit_gateway::policy::Resolved {
    ratelimit_gateway::policy::Resolved {
        domain: domain.to_string(),
        buckets: buckets
            .iter()
            .map(
                |(key, tag, limits)| ratelimit_gateway::policy::ResolvedBucket {
                    key: key.to_string(),
                    tag: tag.to_string(),
                    cost,
                    limits: limits_of(limits),
                    debt: 0,
                    ..Default::default()
                },
            )
            .collect(),
        quotas: Vec::new(),
        reservation: None,
    }
}

/// What `Limiter::lease` takes, built directly (as [`direct_check`]).
pub fn direct_lease(
    domain: &str,
    key: &str,
    tag: &str,
    limits: &[L],
    want: u64,
    give_back: u64,
) -> ratelimit_gateway::policy::ResolvedLease {
    ratelimit_gateway::policy::ResolvedLease {
        domain: domain.to_string(),
        key: key.to_string(),
        tag: tag.to_string(),
        limits: limits_of(limits),
        want,
        returned: give_back,
        ttl_ms: 3_600_000,
    }
}

/// A fresh directory under the system's temporary one, removed on drop.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    /// Makes it.
    pub fn new() -> TempDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("rlgw-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Where it is.
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `text` to `dir`/`name`; its path, as a flag takes it.
pub fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// Waits until the current window of `unit_s` seconds has at least `need_ms`
/// left, so that a sequence is not split by a window boundary.
pub fn align(unit_s: u64, need_ms: u64) {
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let left = unit_s * 1000 - now % (unit_s * 1000);
        if left >= need_ms {
            return;
        }
        std::thread::sleep(Duration::from_millis(left + 5));
    }
}

/// An HTTP/2 connection over TLS (ALPN h2) to `addr`, with `ca` as root
/// and an optional client certificate.
pub async fn h2_tls(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    client: Option<(&std::path::Path, &std::path::Path)>,
) -> Result<h2::client::SendRequest<bytes::Bytes>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(ca).unwrap())
        .unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_file(cert).unwrap()],
                PrivateKeyDer::from_pem_file(key).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (client, conn) = h2::client::handshake(tls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(client)
}
