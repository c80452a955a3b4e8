//! A tiny HTTP/1.1 server that answers every request with one canned
//! response, optionally after a delay: a stand-in for a gateway that is slow
//! or answers garbage.
//!
//! `std::net` only: one thread accepts, one thread per connection reads a
//! request (headers and a `content-length` body), sleeps, answers with
//! `connection: close` and closes.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::ports::free_port;

/// The response a [`Stub`] gives to every request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StubReply {
    /// Status code.
    pub status: u16,
    /// `content-type` header.
    pub content_type: String,
    /// Body.
    pub body: String,
    /// How long to wait after reading the request before answering.
    pub delay: Duration,
}

impl StubReply {
    /// `status` with `body` of `content_type`, at once.
    pub fn new(status: u16, content_type: &str, body: impl Into<String>) -> StubReply {
        StubReply {
            status,
            content_type: content_type.to_string(),
            body: body.into(),
            delay: Duration::ZERO,
        }
    }

    /// 200 with a JSON body.
    pub fn json(body: impl Into<String>) -> StubReply {
        StubReply::new(200, "application/json", body)
    }

    /// Answers only after `delay`.
    pub fn delay(mut self, delay: Duration) -> StubReply {
        self.delay = delay;
        self
    }
}

/// A running stub server on 127.0.0.1; stopped when dropped.
#[derive(Debug)]
pub struct Stub {
    port: u16,
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicUsize>,
    acceptor: Option<JoinHandle<()>>,
}

impl Stub {
    /// Starts a stub on a free loopback port.
    pub fn start(reply: StubReply) -> Result<Stub> {
        Stub::start_on(free_port().context("picking a free port")?, reply)
    }

    /// Starts a stub on 127.0.0.1:`port` (for example the port of a gateway
    /// just killed, so that an Envoy configured for the gateway now reaches
    /// the stub). Retries for up to 5 s while the port is still taken.
    pub fn start_on(port: u16, reply: StubReply) -> Result<Stub> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
                Ok(l) => break l,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).with_context(|| format!("binding 127.0.0.1:{port}")),
            }
        };
        listener
            .set_nonblocking(true)
            .context("making the listener non-blocking")?;
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicUsize::new(0));
        let acceptor = {
            let stop = Arc::clone(&stop);
            let requests = Arc::clone(&requests);
            let reply = Arc::new(reply);
            std::thread::Builder::new()
                .name(format!("stub-{port}"))
                .spawn(move || accept_loop(listener, &stop, &requests, &reply))
                .context("spawning the stub's thread")?
        };
        Ok(Stub {
            port,
            stop,
            requests,
            acceptor: Some(acceptor),
        })
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// How many requests it has read so far (answered or still waiting out
    /// the delay).
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// Stops accepting and closes the listening socket (the port is free
    /// again when this returns). Connections already accepted finish by
    /// themselves.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(
    listener: TcpListener,
    stop: &AtomicBool,
    requests: &Arc<AtomicUsize>,
    reply: &Arc<StubReply>,
) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let requests = Arc::clone(requests);
                let reply = Arc::clone(reply);
                std::thread::spawn(move || {
                    let _ = serve(stream, &requests, &reply);
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Reads one request and answers it.
fn serve(mut stream: TcpStream, requests: &AtomicUsize, reply: &StubReply) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let header_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
    };
    let head = String::from_utf8_lossy(buf.get(..header_end).unwrap_or_default()).to_string();
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    while buf.len() < header_end + length {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
    }
    requests.fetch_add(1, Ordering::SeqCst);
    if !reply.delay.is_zero() {
        std::thread::sleep(reply.delay);
    }
    let response = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
        reply.status,
        reason(reply.status),
        reply.content_type,
        reply.body.len(),
        reply.body
    );
    stream.write_all(response.as_bytes())?;
    stream.flush()?;
    let _ = stream.shutdown(std::net::Shutdown::Both);
    Ok(())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{Client, ConnectionMode, Request};

    #[test]
    fn answers_every_request_with_the_canned_reply() {
        let mut stub = Stub::start(StubReply::new(200, "text/html", "<html>hi</html>")).unwrap();
        let c = Client::new(stub.url(""), ConnectionMode::NewPerRequest);
        let r = c.send(&Request::post("/v1/check", "{\"a\":1}")).unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("text/html"));
        assert_eq!(r.body, "<html>hi</html>");
        assert_eq!(c.get("/healthz", &[]).unwrap().status, 200);
        assert_eq!(stub.requests(), 2);
        let port = stub.port();
        stub.stop();
        assert!(TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err());
    }

    #[test]
    fn waits_out_the_delay() {
        let stub = Stub::start(StubReply::json("{}").delay(Duration::from_millis(150))).unwrap();
        let c = Client::new(stub.url(""), ConnectionMode::NewPerRequest);
        let t = Instant::now();
        assert_eq!(c.get("/", &[]).unwrap().body, "{}");
        assert!(
            t.elapsed() >= Duration::from_millis(150),
            "{:?}",
            t.elapsed()
        );
    }
}
