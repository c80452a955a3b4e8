//! Free loopback ports.

use std::collections::HashSet;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::{Mutex, OnceLock};

/// Ports handed out by this process, never handed out twice, so that tests
/// running in parallel threads do not pick the same port.
fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| Mutex::new(HashSet::new()))
}

/// A loopback TCP port that was free a moment ago and that this process has
/// not handed out before.
///
/// Another process can still take it before it is used; [`crate::Envoy::start`]
/// retries with new ports when Envoy cannot bind.
pub fn free_port() -> io::Result<u16> {
    for _ in 0..64 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let port = listener.local_addr()?.port();
        let mut seen = handed_out()
            .lock()
            .map_err(|_| io::Error::other("port registry poisoned"))?;
        if seen.insert(port) {
            return Ok(port);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrNotAvailable,
        "no free loopback port found",
    ))
}

/// A loopback listener on a port the system picked (no window in which
/// another process can take it, as with [`free_port`]), recorded as handed
/// out.
pub fn bind_loopback() -> io::Result<(TcpListener, u16)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let port = listener.local_addr()?.port();
    handed_out()
        .lock()
        .map_err(|_| io::Error::other("port registry poisoned"))?
        .insert(port);
    Ok((listener, port))
}

/// The three ports an Envoy rendered from `envoy/envoy.yaml` listens on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    /// The rate-limited listener.
    pub listen: u16,
    /// The admin interface.
    pub admin: u16,
    /// The built-in upstream listener (`direct_response` 200).
    pub upstream: u16,
}

impl Ports {
    /// Three distinct free loopback ports.
    pub fn free() -> io::Result<Ports> {
        Ok(Ports {
            listen: free_port()?,
            admin: free_port()?,
            upstream: free_port()?,
        })
    }

    /// The demo's fixed ports: 10000 (listener), 9901 (admin), 10001 (upstream).
    pub const DEMO: Ports = Ports {
        listen: 10000,
        admin: 9901,
        upstream: 10001,
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct() {
        let a = Ports::free().unwrap();
        let b = Ports::free().unwrap();
        let all = [a.listen, a.admin, a.upstream, b.listen, b.admin, b.upstream];
        let set: HashSet<u16> = all.iter().copied().collect();
        assert_eq!(set.len(), all.len());
    }
}
