//! Redis addresses, credentials and TLS: everything needed to open a
//! connection, and the one way a Redis URL is ever shown ([`Redacted`]:
//! `redis://user:***@host:6379`), so a password reaches no log line, error
//! message, `--help` text or panic.

use std::fmt;
use std::path::PathBuf;

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, TlsCertificates};

/// A Redis URL for display: the password (and a lone user-info part, which
/// is often a password written without its `:`) is replaced by `***`, as are
/// the values of `pass=` and `password=` query parameters.
#[derive(Clone, Copy)]
pub struct Redacted<'a>(pub &'a str);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let url = self.0;
        let (scheme, rest) = match url.find("://") {
            Some(i) => url.split_at(i + 3),
            None => ("", url),
        };
        f.write_str(scheme)?;
        // User info is everything before the last '@' of the whole URL, not
        // of the authority: a password may hold '/', '?' or '#', which would
        // end the authority early and leave it in the "path".
        let tail = match rest.rfind('@') {
            Some(at) => {
                let (info, host) = rest.split_at(at);
                match info.split_once(':') {
                    Some((user, _)) if !user.contains(['/', '?', '#']) => write!(f, "{user}:***")?,
                    _ => f.write_str("***")?,
                }
                host
            }
            None => {
                // No '@': `host:port`, unless what follows the colon is no
                // port (`redis://user:password` without a host).
                let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
                let (authority, tail) = rest.split_at(end);
                match authority.rsplit_once(':') {
                    Some((host, port)) if !port.bytes().all(|b| b.is_ascii_digit()) => {
                        write!(f, "{host}:***")?
                    }
                    _ => f.write_str(authority)?,
                }
                tail
            }
        };
        write_query_redacted(f, tail)
    }
}

/// `tail` with the values of its `pass=` and `password=` query parameters
/// (Unix socket URLs) replaced by `***`.
fn write_query_redacted(f: &mut fmt::Formatter<'_>, tail: &str) -> fmt::Result {
    let mut first = true;
    for (i, part) in tail.split('&').enumerate() {
        if i > 0 {
            f.write_str("&")?;
        }
        let name_start = if first {
            part.find('?').map_or(0, |q| q + 1)
        } else {
            0
        };
        first = false;
        let (head, param) = part.split_at(name_start);
        match param.split_once('=') {
            Some((name, _)) if name == "pass" || name == "password" => {
                write!(f, "{head}{name}=***")?
            }
            _ => f.write_str(part)?,
        }
    }
    Ok(())
}

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// A password: shown as `***` by `Debug`, never by anything else.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a password.
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// Reads a mounted Secret file: its content less one trailing newline.
    pub fn from_file(path: &std::path::Path, flag: &str) -> Result<Secret, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("{flag} {}: {e}", path.display()))?;
        let text = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(&text);
        if text.is_empty() {
            return Err(format!("{flag} {}: the file is empty", path.display()));
        }
        Ok(Secret(text.to_string()))
    }

    /// The password itself, for the `AUTH` handshake only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// TLS towards Redis (and the Sentinels); applies to `rediss://` addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// CA certificates (PEM) the server's certificate must chain to; the
    /// system roots (rustls-native-certs) when `None`.
    pub ca: Option<PathBuf>,
    /// Client certificate chain (PEM), for mutual TLS; with `key`.
    pub cert: Option<PathBuf>,
    /// Client private key (PEM), for mutual TLS; with `cert`.
    pub key: Option<PathBuf>,
    /// Accept any certificate (trials only; logged as a warning).
    pub insecure: bool,
}

impl RedisTls {
    /// Whether any TLS flag was given (they need `rediss://` addresses).
    pub fn is_set(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.insecure
    }

    /// The certificates read from their files (`None`: system roots, no client certificate).
    pub(crate) fn certificates(&self) -> Result<Option<TlsCertificates>, String> {
        let read = |p: &PathBuf, flag: &str| {
            std::fs::read(p).map_err(|e| format!("{flag} {}: {e}", p.display()))
        };
        let root_cert = self
            .ca
            .as_ref()
            .map(|p| read(p, "--redis-tls-ca"))
            .transpose()?;
        let client_tls = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some(redis::ClientTlsConfig {
                client_cert: read(c, "--redis-tls-cert")?,
                client_key: read(k, "--redis-tls-key")?,
            }),
            (None, None) => None,
            _ => return Err("--redis-tls-cert and --redis-tls-key go together".to_string()),
        };
        if root_cert.is_none() && client_tls.is_none() {
            return Ok(None);
        }
        Ok(Some(TlsCertificates {
            client_tls,
            root_cert,
        }))
    }
}

/// How to log in to Redis and how to secure the connection, beside the
/// addresses of [`crate::redis::store::Target`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisOptions {
    /// ACL user name; overrides the URL's.
    pub username: Option<String>,
    /// Password (of `username`, or of `default`); overrides the URL's.
    pub password: Option<Secret>,
    /// Password of the Sentinels (`requirepass` of the Sentinel processes).
    pub sentinel_password: Option<Secret>,
    /// TLS settings.
    pub tls: RedisTls,
}

/// Parses one address (`redis://`, `rediss://`, `host:port`) into a client
/// with the credentials and TLS settings of `opts` (the Sentinels' own
/// password when `sentinel`). Errors name the address redacted.
pub fn client(url: &str, opts: &RedisOptions, sentinel: bool) -> Result<redis::Client, String> {
    build(url, opts, sentinel, false)
}

/// [`client`] for a single server's connection manager, speaking RESP3:
/// the manager then hears a dropped connection at once (a disconnection
/// push) and connects again in the background, so a worker that saw no
/// check while Redis was down does not fail its first check on the dead
/// connection afterwards. Needs Redis 6 or later (`HELLO 3`).
pub fn managed_client(url: &str, opts: &RedisOptions) -> Result<redis::Client, String> {
    build(url, opts, false, true)
}

fn build(
    url: &str,
    opts: &RedisOptions,
    sentinel: bool,
    resp3: bool,
) -> Result<redis::Client, String> {
    let full = if url.contains("://") {
        url.to_string()
    } else {
        // A bare host:port (Sentinel lists): TLS when TLS flags are given.
        let scheme = if opts.tls.is_set() { "rediss" } else { "redis" };
        format!("{scheme}://{url}")
    };
    if full.starts_with("redis+sentinel://") || full.starts_with("rediss+sentinel://") {
        return Err(format!(
            "{}: give Sentinels with --redis-sentinel host:port,... and --redis-master NAME",
            Redacted(url)
        ));
    }
    let bad = |why: String| format!("Redis address {}: {why}", Redacted(url));
    let mut info: ConnectionInfo = full
        .as_str()
        .into_connection_info()
        .map_err(|e| bad(e.to_string()))?;
    let mut settings = info.redis_settings().clone();
    if sentinel {
        if let Some(p) = &opts.sentinel_password {
            settings = settings.set_password(p.expose());
        }
    } else {
        if let Some(u) = &opts.username {
            settings = settings.set_username(u);
        }
        if let Some(p) = &opts.password {
            settings = settings.set_password(p.expose());
        }
    }
    if resp3 {
        settings = settings.set_protocol(redis::ProtocolVersion::RESP3);
    }
    info = info.set_redis_settings(settings);
    let tls = match info.addr().clone() {
        ConnectionAddr::TcpTls {
            host,
            port,
            insecure,
            tls_params,
        } => {
            info = info.set_addr(ConnectionAddr::TcpTls {
                host,
                port,
                insecure: insecure || opts.tls.insecure,
                tls_params,
            });
            true
        }
        _ => false,
    };
    if !tls && opts.tls.is_set() {
        return Err(bad(
            "--redis-tls-* flags need a rediss:// address (TLS)".to_string()
        ));
    }
    match opts.tls.certificates()? {
        Some(certs) if tls => {
            redis::Client::build_with_tls(info, certs).map_err(|e| bad(e.to_string()))
        }
        _ => redis::Client::open(info).map_err(|e| bad(e.to_string())),
    }
}

/// Makes `rustls` use the `ring` provider (built quickly here; `aws-lc-rs`
/// is not compiled in). Idempotent.
pub fn install_crypto_provider() {
    // Err only when a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A clearer message for a failed TLS handshake (the rustls error alone
/// says `invalid peer certificate: UnknownIssuer`).
pub fn explain(error: &str) -> String {
    if error.contains("invalid peer certificate") || error.contains("UnknownIssuer") {
        format!(
            "{error} (TLS: the Redis server's certificate is not trusted: it does not chain to \
             --redis-tls-ca, or to the system roots without it, or does not name the host)"
        )
    } else {
        error.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        let r = |s: &str| Redacted(s).to_string();
        assert_eq!(r("redis://:s3cret@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(r("rediss://app:s3cret@h:6380"), "rediss://app:***@h:6380");
        assert_eq!(r("redis://s3cret@h"), "redis://***@h");
        assert_eq!(r("redis://h:6379"), "redis://h:6379");
        assert_eq!(r("redis://u:p@ss@h"), "redis://u:***@h");
        assert_eq!(
            r("redis+unix:///tmp/r.sock?db=1&pass=s3cret"),
            "redis+unix:///tmp/r.sock?db=1&pass=***"
        );
        assert_eq!(r("h:26379"), "h:26379");
        assert_eq!(format!("{:?}", Secret::new("s3cret")), "***");
    }

    /// Malformed URLs: a password holding `/`, `?` or `#`, no `://`, no
    /// host. Neither the shown URL nor the start-up error holds any of it.
    #[test]
    fn no_malformed_url_shows_its_password() {
        let pieces = ["zq", "XY", "KW", "VU"];
        let urls = [
            "redis://user:zq/XY?KW#VU@host:6379",
            "redis://:zq/XY?KW#VU@host:6379/0",
            "rediss://:zq#XY@host",
            "redis://u:zq?XY@host?db=1",
            "user:zqXYKWVU@host:6379",
            ":zqXYKWVU@host:6379",
            "redis:/user:zqXYKWVU@host",
            "redis//:zqXYKWVU@host",
            "redis://:zqXYKWVU@",
            "redis://user:zqXYKWVU@:6379",
            "redis://user:zqXYKWVU",
            "redis://:zqXYKWVU",
            "redis://host:6379/0?password=zqXYKWVU",
        ];
        for url in urls {
            let shown = Redacted(url).to_string();
            let error = client(url, &RedisOptions::default(), false)
                .err()
                .unwrap_or_default();
            for piece in pieces {
                assert!(!shown.contains(piece), "{url} shown as {shown}");
                assert!(!error.contains(piece), "{url}: {error}");
            }
        }
    }

    #[test]
    fn options_override_the_url_and_tls_needs_rediss() {
        let opts = RedisOptions {
            username: Some("app".into()),
            password: Some(Secret::new("file-pw")),
            ..Default::default()
        };
        let c = client("redis://:url-pw@127.0.0.1:1", &opts, false).unwrap();
        let s = c.get_connection_info().redis_settings();
        assert_eq!((s.username(), s.password()), (Some("app"), Some("file-pw")));
        let tls = RedisOptions {
            tls: RedisTls {
                insecure: true,
                ..Default::default()
            },
            ..Default::default()
        };
        let e = client("redis://:pw@127.0.0.1:1", &tls, false).unwrap_err();
        assert_eq!(
            e,
            "Redis address redis://:***@127.0.0.1:1: --redis-tls-* flags need a rediss:// address (TLS)"
        );
        assert!(client("127.0.0.1:26379", &tls, true).is_ok());
        let e = client("redis+sentinel://:pw@h:26379/m", &opts, false).unwrap_err();
        assert!(e.starts_with("redis+sentinel://:***@h"), "{e}");
    }
}
