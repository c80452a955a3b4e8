//! Command-line flags, each also read from an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Parser};

use crate::store::Target;

/// ratelimit-gateway: a stateless HTTP service between the ratelimit-wasm
/// filter and Redis.
#[derive(Debug, Clone, Parser)]
#[command(name = "ratelimit-gateway", version, about)]
#[command(group(ArgGroup::new("backend").required(true).args(["redis", "redis_cluster"])))]
pub struct Args {
    /// Address to listen on.
    #[arg(long, env = "RLGW_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    /// A single Redis server, e.g. redis://127.0.0.1:6379.
    #[arg(long, env = "RLGW_REDIS")]
    pub redis: Option<String>,
    /// Redis Cluster seed nodes, comma-separated, e.g. redis://10.0.0.1:6379,redis://10.0.0.2:6379.
    #[arg(long, env = "RLGW_REDIS_CLUSTER", value_delimiter = ',')]
    pub redis_cluster: Vec<String>,
    /// Timeout of each Redis round trip, in ms.
    #[arg(long, env = "RLGW_REDIS_TIMEOUT_MS", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub redis_timeout_ms: u64,
    /// Prefix of every Redis key (must not contain '{' or '}').
    #[arg(long, env = "RLGW_KEY_PREFIX", default_value = "rl:")]
    pub key_prefix: String,
    /// The policy: plugin configurations (a file, or a directory of *.json), one domain each; repeatable; reloaded on SIGHUP and change.
    #[arg(long, env = "RLGW_POLICY", value_delimiter = ',')]
    pub policy: Vec<PathBuf>,
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
}

impl Config {
    /// A config for one Redis server with the defaults of the flags;
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
        }
    }
}

impl TryFrom<Args> for Config {
    type Error = String;

    fn try_from(a: Args) -> Result<Config, String> {
        let target = match (a.redis, a.redis_cluster.is_empty()) {
            (Some(url), true) => Target::Single(url),
            (None, false) => Target::Cluster(
                a.redis_cluster
                    .into_iter()
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect(),
            ),
            _ => return Err("give exactly one of --redis and --redis-cluster".to_string()),
        };
        crate::keys::check_prefix(&a.key_prefix)?;
        Ok(Config {
            listen: a.listen,
            target,
            redis_timeout: Duration::from_millis(a.redis_timeout_ms),
            key_prefix: a.key_prefix,
            policy: a.policy,
        })
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
        let bad =
            Args::try_parse_from(["gw", "--redis", "redis://x", "--key-prefix", "a{b"]).unwrap();
        assert!(Config::try_from(bad).is_err());
    }
}
