//! Command-line flags, each also read from an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Parser};

use crate::http::tls::TlsFiles;
use crate::redis::store::Target;
use crate::redis::url::{RedisOptions, RedisTls, Secret};

/// ratelimit-gateway: a stateless HTTP service between the ratelimit-wasm
/// filter and Redis.
#[derive(Debug, Clone, Parser)]
#[command(name = "ratelimit-gateway", version, about)]
#[command(group(ArgGroup::new("backend").required(true).args(["redis", "redis_cluster", "redis_sentinel"])))]
pub struct Args {
    /// Address to listen on.
    #[arg(long, env = "RLGW_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    /// A single Redis server, e.g. redis://127.0.0.1:6379 or rediss://redis.internal:6380 (TLS); give its password with --redis-password-file (a mounted Secret), never in the URL on the command line, where `ps` shows it to every user of the host.
    #[arg(long, env = "RLGW_REDIS", hide_env_values = true)]
    pub redis: Option<String>,
    /// Redis Cluster seed nodes, comma-separated, e.g. redis://10.0.0.1:6379,redis://10.0.0.2:6379; the password with --redis-password-file, never in the URLs.
    #[arg(
        long,
        env = "RLGW_REDIS_CLUSTER",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub redis_cluster: Vec<String>,
    /// Redis Sentinels, comma-separated host:port (rediss://host:port for TLS); with --redis-master.
    #[arg(
        long,
        env = "RLGW_REDIS_SENTINEL",
        value_delimiter = ',',
        requires = "redis_master",
        hide_env_values = true
    )]
    pub redis_sentinel: Vec<String>,
    /// The master's name in the Sentinels (`sentinel monitor <name> ...`).
    #[arg(long, env = "RLGW_REDIS_MASTER", requires = "redis_sentinel")]
    pub redis_master: Option<String>,
    /// Redis ACL user name (overrides the URL's).
    #[arg(long, env = "RLGW_REDIS_USERNAME")]
    pub redis_username: Option<String>,
    /// File holding the Redis password (a mounted Secret; one trailing newline ignored); overrides the URL's.
    #[arg(long, env = "RLGW_REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<PathBuf>,
    /// File holding the Sentinels' password (their requirepass).
    #[arg(
        long,
        env = "RLGW_REDIS_SENTINEL_PASSWORD_FILE",
        requires = "redis_sentinel"
    )]
    pub redis_sentinel_password_file: Option<PathBuf>,
    /// CA certificates (PEM) the Redis server's certificate must chain to; default the system roots.
    #[arg(long, env = "RLGW_REDIS_TLS_CA")]
    pub redis_tls_ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for mutual TLS with Redis; with --redis-tls-key.
    #[arg(long, env = "RLGW_REDIS_TLS_CERT", requires = "redis_tls_key")]
    pub redis_tls_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS with Redis; with --redis-tls-cert.
    #[arg(long, env = "RLGW_REDIS_TLS_KEY", requires = "redis_tls_cert")]
    pub redis_tls_key: Option<PathBuf>,
    /// Do not check the Redis server's certificate (trials only; logged as a warning).
    #[arg(long, env = "RLGW_REDIS_TLS_INSECURE")]
    pub redis_tls_insecure: bool,
    /// Timeout of each Redis round trip, in ms.
    #[arg(long, env = "RLGW_REDIS_TIMEOUT_MS", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub redis_timeout_ms: u64,
    /// Prefix of every Redis key (must not contain '{' or '}').
    #[arg(long, env = "RLGW_KEY_PREFIX", default_value = "rl:")]
    pub key_prefix: String,
    /// The policy: plugin configurations (a file, or a directory of *.json), one domain each, whose limits /v1/* enforces; repeatable; reloaded on SIGHUP and change. Required unless --rls-config is given (without it, /v1/* answers 404 for every domain).
    #[arg(long, env = "RLGW_POLICY", value_delimiter = ',')]
    pub policy: Vec<PathBuf>,
    /// Callers allowed on /v1/*: one `<domain> <token>` per line; reloaded on SIGHUP and change.
    #[arg(long, env = "RLGW_AUTH_TOKENS_FILE")]
    pub auth_tokens: Option<PathBuf>,
    /// Serve /v1/* to anyone (no --auth-tokens): for trials only, logged as a warning.
    #[arg(long, env = "RLGW_INSECURE_NO_AUTH", conflicts_with = "auth_tokens")]
    pub insecure_no_auth: bool,
    /// TLS certificate chain of the listener (PEM); with --tls-key.
    #[arg(long, env = "RLGW_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key of the listener (PEM); with --tls-cert.
    #[arg(long, env = "RLGW_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM) that client certificates must chain to: mutual TLS, a certificate required.
    #[arg(long, env = "RLGW_CLIENT_CA", requires = "tls_cert")]
    pub client_ca: Option<PathBuf>,
    /// Longest wait for a request's headers (and the TLS handshake, and an idle keep-alive), in ms.
    #[arg(long, env = "RLGW_HEADER_TIMEOUT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: u64,
    /// Longest wait for a request's whole body once its headers are read, in ms.
    #[arg(long, env = "RLGW_BODY_TIMEOUT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout_ms: u64,
    /// Most /v1/* and gRPC ShouldRateLimit requests served at once; more are answered 503 (UNAVAILABLE) with Retry-After.
    #[arg(long, env = "RLGW_MAX_IN_FLIGHT", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_in_flight: u64,
    /// Most connections open at once on each listener (--listen, --grpc-listen); more are closed at accept and counted.
    #[arg(long, env = "RLGW_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections: u64,
    /// After SIGTERM, how long requests in flight may finish (e.g. 10s, 500ms) before the process exits.
    #[arg(long, env = "RLGW_DRAIN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Also serve gRPC on this address: the filter's calls (`ratelimit_wasm.v3.Gateway`, for global.transport grpc), Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`, whose domains come from --rls-config; none without it) and gRPC health.
    #[arg(long, env = "RLGW_GRPC_LISTEN")]
    pub grpc_listen: Option<SocketAddr>,
    /// envoyproxy/ratelimit's YAML configuration (a file, or a directory of *.yaml / *.yml), for --grpc-listen; repeatable; reloaded on SIGHUP and change.
    #[arg(
        long,
        env = "RLGW_RLS_CONFIG",
        value_delimiter = ',',
        requires = "grpc_listen"
    )]
    pub rls_config: Vec<PathBuf>,
    /// Buckets the deny cache remembers: a bucket Redis denied is answered denied from memory, without a Redis call, until Redis's wait is over; 0 turns it off.
    #[arg(long, env = "RLGW_DENY_CACHE_ENTRIES", default_value_t = DEFAULT_DENY_CACHE_ENTRIES, value_parser = clap::value_parser!(u64).range(0..=1 << 24))]
    pub deny_cache_entries: u64,
    /// Live Redis keys one domain and tag (one hash tag) may hold; a check that would create one more is refused with 503 for that hash tag only, existing keys keep working; 0 turns it off.
    #[arg(long, env = "RLGW_KEY_BUDGET", default_value_t = DEFAULT_KEY_BUDGET)]
    pub key_budget: u64,
    /// How long a check's reservation waits for its settlement (e.g. 3600s, 600s): a settlement after it changes nothing, and the request keeps what its check charged.
    #[arg(long, env = "RLGW_RESERVATION_TTL", default_value = "3600s", value_parser = parse_duration)]
    pub reservation_ttl: Duration,
    /// The share of a descriptor's limit past which its hits count as near_limit in the rate limit service's metrics (theirs: NEAR_LIMIT_RATIO).
    #[arg(long, env = "RLGW_RLS_NEAR_LIMIT_RATIO", default_value_t = 0.8, value_parser = parse_ratio)]
    pub rls_near_limit_ratio: f64,
    /// Whether the rate limit service honours a descriptor's own `limit` (Envoy's override), as envoyproxy/ratelimit does: true or false.
    #[arg(long, env = "RLGW_RLS_ALLOW_OVERRIDES", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub rls_allow_overrides: bool,
    /// Worker threads, each with its own runtime and Redis connection, all accepting from the same listening sockets; 0: one per available CPU.
    #[arg(long, env = "RLGW_WORKER_THREADS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1024))]
    pub worker_threads: u64,
}

/// A number in 0..=1.
fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?}: expected a number from 0 to 1, e.g. 0.8")),
    }
}

/// `<n>s` or `<n>ms`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?}: expected a whole number of s or ms, e.g. 10s or 500ms");
    if let Some(ms) = s.strip_suffix("ms") {
        return ms.parse().map(Duration::from_millis).map_err(|_| bad());
    }
    let secs = s.strip_suffix('s').ok_or_else(bad)?;
    secs.parse().map(Duration::from_secs).map_err(|_| bad())
}

/// Who may call `/v1/*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    /// Bearer tokens from this file (`crate::auth`).
    Tokens(PathBuf),
    /// Anyone (`--insecure-no-auth`).
    Insecure,
}

/// The bounds of the listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Headers (and TLS handshake, and keep-alive idleness).
    pub header_timeout: Duration,
    /// The whole body, after the headers.
    pub body_timeout: Duration,
    /// `/v1/*` requests served at once.
    pub max_in_flight: usize,
    /// Connections open at once on each listener; more are closed at accept.
    pub max_connections: usize,
    /// Drain deadline after the shutdown signal.
    pub drain_timeout: Duration,
}

impl Default for Bounds {
    /// The flags' defaults.
    fn default() -> Self {
        Bounds {
            header_timeout: Duration::from_millis(5000),
            body_timeout: Duration::from_millis(5000),
            max_in_flight: 256,
            max_connections: DEFAULT_MAX_CONNECTIONS as usize,
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// Envoy's rate limit service (`crate::rls`): off unless `grpc_listen` is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RlsOptions {
    /// `--grpc-listen`.
    pub grpc_listen: Option<SocketAddr>,
    /// `--rls-config`: files and directories of YAML.
    pub config: Vec<PathBuf>,
    /// `--rls-near-limit-ratio`, in thousandths.
    pub near_limit_permille: u32,
    /// `--rls-allow-overrides`: a descriptor's own `limit` applies.
    pub allow_overrides: bool,
}

impl Default for RlsOptions {
    /// Off; the flags' defaults.
    fn default() -> Self {
        RlsOptions {
            grpc_listen: None,
            config: Vec::new(),
            near_limit_permille: 800,
            allow_overrides: true,
        }
    }
}

/// What the server needs to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Where Redis is.
    pub target: Target,
    /// Timeout of each Redis round trip.
    pub redis_timeout: Duration,
    /// Prefix of every Redis key.
    pub key_prefix: String,
    /// The policy's files and directories (`crate::policy`).
    pub policy: Vec<PathBuf>,
    /// Credentials and TLS towards Redis.
    pub redis: RedisOptions,
    /// Who may call `/v1/*`.
    pub auth: Auth,
    /// TLS on the listener.
    pub tls: Option<TlsFiles>,
    /// Timeouts, in-flight bound, drain deadline.
    pub bounds: Bounds,
    /// Envoy's rate limit service over gRPC.
    pub rls: RlsOptions,
    /// Slots of the deny cache (`crate::deny_cache`); 0: off.
    pub deny_cache_entries: usize,
    /// Live keys per hash tag (`--key-budget`); 0: no budget.
    pub key_budget: u64,
    /// Life of a reservation record (`--reservation-ttl`).
    pub reservation_ttl: Duration,
    /// Worker threads of [`crate::run`] (`--worker-threads`, 0 resolved to
    /// the available CPUs); at least 1. [`crate::start`] serves on its
    /// caller's runtime instead.
    pub worker_threads: usize,
}

impl Config {
    /// A config for one Redis server with the defaults of the flags, and
    /// **no authentication** ([`Auth::Insecure`]: in-process tests and
    /// embedding; the binary demands `--auth-tokens` or `--insecure-no-auth`).
    /// `policy` is what `--policy` would give.
    pub fn single(
        listen: SocketAddr,
        redis_url: impl Into<String>,
        policy: Vec<PathBuf>,
    ) -> Config {
        Config {
            listen,
            target: Target::Single(redis_url.into()),
            redis_timeout: Duration::from_millis(20),
            key_prefix: "rl:".to_string(),
            policy,
            redis: RedisOptions::default(),
            auth: Auth::Insecure,
            tls: None,
            bounds: Bounds::default(),
            rls: RlsOptions::default(),
            deny_cache_entries: DEFAULT_DENY_CACHE_ENTRIES as usize,
            key_budget: DEFAULT_KEY_BUDGET,
            reservation_ttl: Duration::from_millis(DEFAULT_RESERVATION_TTL_MS),
            worker_threads: 1,
        }
    }
}

impl Config {
    /// Whether this configuration leaves the gateway nothing to enforce: no
    /// policy for `/v1/*`, and no rate limit service (its YAML and its
    /// address go together). Refused at start with [`NOTHING_TO_ENFORCE`].
    pub fn enforces_nothing(&self) -> bool {
        self.policy.is_empty() && (self.rls.config.is_empty() || self.rls.grpc_listen.is_none())
    }
}

/// Why a start with neither `--policy` nor `--rls-config` is refused.
pub const NOTHING_TO_ENFORCE: &str =
    "nothing to enforce: give --policy (the plugin configurations \
     /v1/* enforces), --rls-config with --grpc-listen (envoyproxy/ratelimit's YAML), or both";

/// `--max-connections`' default.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 1024;

/// `--key-budget`'s default: live keys per domain (on a cluster, see
/// `crate::redis::keys::slot_budget`).
pub const DEFAULT_KEY_BUDGET: u64 = 100_000;

/// `--reservation-ttl`'s default, in ms: an hour, longer than any stream
/// Envoy's default timeouts let run.
pub const DEFAULT_RESERVATION_TTL_MS: u64 = 3_600_000;

/// `--deny-cache-entries`' default.
pub const DEFAULT_DENY_CACHE_ENTRIES: u64 = 16384;

impl TryFrom<Args> for Config {
    type Error = String;

    fn try_from(a: Args) -> Result<Config, String> {
        let list = |v: Vec<String>| -> Vec<String> {
            v.into_iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        };
        let target = match (
            a.redis,
            a.redis_cluster.is_empty(),
            a.redis_sentinel.is_empty(),
        ) {
            (Some(url), true, true) => Target::Single(url),
            (None, false, true) => Target::Cluster(list(a.redis_cluster)),
            (None, true, false) => Target::Sentinel {
                sentinels: list(a.redis_sentinel),
                master: a.redis_master.unwrap_or_default(),
            },
            _ => {
                return Err(
                    "give exactly one of --redis, --redis-cluster and --redis-sentinel".to_string(),
                )
            }
        };
        let redis = RedisOptions {
            username: a.redis_username,
            password: a
                .redis_password_file
                .map(|p| Secret::from_file(&p, "--redis-password-file"))
                .transpose()?,
            sentinel_password: a
                .redis_sentinel_password_file
                .map(|p| Secret::from_file(&p, "--redis-sentinel-password-file"))
                .transpose()?,
            tls: RedisTls {
                ca: a.redis_tls_ca,
                cert: a.redis_tls_cert,
                key: a.redis_tls_key,
                insecure: a.redis_tls_insecure,
            },
        };
        crate::redis::keys::check_prefix(&a.key_prefix)?;
        let auth = match (a.auth_tokens, a.insecure_no_auth) {
            (Some(path), false) => Auth::Tokens(path),
            (None, true) => Auth::Insecure,
            (Some(_), true) => {
                return Err("give one of --auth-tokens and --insecure-no-auth".to_string())
            }
            (None, false) => {
                return Err(
                    "refusing to serve /v1/* to anyone: give --auth-tokens FILE \
                            (or --insecure-no-auth, for trials only)"
                        .to_string(),
                )
            }
        };
        let tls = match (a.tls_cert, a.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert,
                key,
                client_ca: a.client_ca,
            }),
            (None, None) if a.client_ca.is_none() => None,
            _ => {
                return Err(
                    "--tls-cert and --tls-key go together (and --client-ca needs them)".to_string(),
                )
            }
        };
        let config = Config {
            listen: a.listen,
            target,
            redis_timeout: Duration::from_millis(a.redis_timeout_ms),
            key_prefix: a.key_prefix,
            policy: a.policy,
            redis,
            auth,
            tls,
            bounds: Bounds {
                header_timeout: Duration::from_millis(a.header_timeout_ms),
                body_timeout: Duration::from_millis(a.body_timeout_ms),
                max_in_flight: usize::try_from(a.max_in_flight).unwrap_or(usize::MAX),
                max_connections: usize::try_from(a.max_connections).unwrap_or(usize::MAX),
                drain_timeout: a.drain_timeout,
            },
            rls: RlsOptions {
                grpc_listen: a.grpc_listen,
                config: a.rls_config,
                near_limit_permille: (a.rls_near_limit_ratio * 1000.0).round() as u32,
                allow_overrides: a.rls_allow_overrides,
            },
            deny_cache_entries: usize::try_from(a.deny_cache_entries).unwrap_or(usize::MAX),
            key_budget: a.key_budget,
            reservation_ttl: a.reservation_ttl,
            worker_threads: match a.worker_threads {
                0 => std::thread::available_parallelism().map_or(1, usize::from),
                n => usize::try_from(n).unwrap_or(1),
            },
        };
        if config.enforces_nothing() {
            return Err(NOTHING_TO_ENFORCE.to_string());
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags() {
        let a = Args::try_parse_from([
            "gw",
            "--redis-cluster",
            "redis://a:1,redis://b:2",
            "--redis-timeout-ms",
            "50",
            "--insecure-no-auth",
            "--policy",
            "p.json",
        ])
        .unwrap();
        let c = Config::try_from(a).unwrap();
        assert_eq!(
            c.target,
            Target::Cluster(vec!["redis://a:1".into(), "redis://b:2".into()])
        );
        assert_eq!(c.redis_timeout, Duration::from_millis(50));
        assert_eq!(c.listen.to_string(), "127.0.0.1:8081");
        assert!(Args::try_parse_from(["gw"]).is_err());
        assert!(Args::try_parse_from([
            "gw",
            "--redis",
            "redis://x",
            "--redis-cluster",
            "redis://y"
        ])
        .is_err());
        let bad = Args::try_parse_from([
            "gw",
            "--redis",
            "redis://x",
            "--key-prefix",
            "a{b",
            "--insecure-no-auth",
        ])
        .unwrap();
        assert!(Config::try_from(bad).is_err());
    }

    #[test]
    fn rls_overrides_are_honoured_unless_turned_off() {
        let parse = |extra: &[&str]| {
            let mut argv = vec![
                "gw",
                "--redis",
                "redis://x",
                "--insecure-no-auth",
                "--policy",
                "p.json",
            ];
            argv.extend_from_slice(extra);
            Config::try_from(Args::try_parse_from(argv).unwrap()).unwrap()
        };
        assert!(parse(&[]).rls.allow_overrides);
        assert!(
            !parse(&["--rls-allow-overrides", "false"])
                .rls
                .allow_overrides
        );
        assert!(
            parse(&["--rls-allow-overrides", "true"])
                .rls
                .allow_overrides
        );
        assert!(
            Args::try_parse_from(["gw", "--redis", "x", "--rls-allow-overrides", "no"]).is_err()
        );
    }

    #[test]
    fn a_policy_or_the_rate_limit_service_is_required() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["gw", "--redis", "redis://x", "--insecure-no-auth"];
            argv.extend_from_slice(extra);
            Config::try_from(Args::try_parse_from(argv).unwrap())
        };
        assert_eq!(parse(&[]).unwrap_err(), NOTHING_TO_ENFORCE);
        // The drop-in for envoyproxy/ratelimit: their YAML alone.
        let dropin = parse(&["--grpc-listen", "127.0.0.1:8091", "--rls-config", "rls"]).unwrap();
        assert_eq!(dropin.policy, Vec::<PathBuf>::new());
        assert_eq!(dropin.rls.config, [PathBuf::from("rls")]);
        let wasm_only = parse(&["--policy", "a.json,b"]).unwrap();
        assert_eq!(
            wasm_only.policy,
            [PathBuf::from("a.json"), PathBuf::from("b")]
        );
        assert_eq!(wasm_only.rls.grpc_listen, None);
        // A configuration built in code is held to the same rule.
        let mut config = dropin;
        config.rls.grpc_listen = None;
        assert!(config.enforces_nothing());
    }

    #[test]
    fn auth_is_required_and_bounds_parse() {
        let no_auth = Args::try_parse_from(["gw", "--redis", "redis://x"]).unwrap();
        assert_eq!(
            Config::try_from(no_auth).unwrap_err(),
            "refusing to serve /v1/* to anyone: give --auth-tokens FILE \
             (or --insecure-no-auth, for trials only)"
        );
        assert!(Args::try_parse_from([
            "gw",
            "--redis",
            "redis://x",
            "--auth-tokens",
            "t",
            "--insecure-no-auth"
        ])
        .is_err());
        let a = Args::try_parse_from([
            "gw",
            "--redis",
            "redis://x",
            "--auth-tokens",
            "/etc/t",
            "--drain-timeout",
            "1500ms",
            "--max-in-flight",
            "8",
            "--policy",
            "p.json",
        ])
        .unwrap();
        let c = Config::try_from(a).unwrap();
        assert_eq!(c.auth, Auth::Tokens("/etc/t".into()));
        assert_eq!(c.bounds.drain_timeout, Duration::from_millis(1500));
        assert_eq!(c.bounds.max_in_flight, 8);
        assert_eq!(c.bounds.header_timeout, Duration::from_secs(5));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert!(parse_duration("10").is_err() && parse_duration("1.5s").is_err());
        assert!(Args::try_parse_from(["gw", "--redis", "x", "--tls-cert", "c"]).is_err());
        assert!(Args::try_parse_from(["gw", "--redis", "x", "--client-ca", "c"]).is_err());
    }
}
