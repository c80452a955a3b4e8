//! An HTTP/1.1 upstream for the end-to-end tests to put behind a real Envoy:
//! it answers each request with the [`Reply`] registered for the request's
//! path (JSON, server-sent events, chunked, slow, gzip-encoded, or a
//! connection reset), counts the requests per path and how many are in
//! flight, and can hold the requests of a path until a [`Gate`] opens.
//!
//! `std::net` only: one thread accepts, one thread per connection serves
//! requests one after another on it (keep-alive, as Envoy reuses its upstream
//! connections), reading `content-length` and `transfer-encoding: chunked`
//! request bodies.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::ports::bind_loopback;

/// The body of a [`Reply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Sent whole, with `content-length`.
    Fixed(Vec<u8>),
    /// Sent with `transfer-encoding: chunked`, each piece as one chunk after
    /// its delay. Empty pieces are not sent (an empty chunk would end the
    /// body), but their delay is still waited out.
    Chunked(Vec<(Vec<u8>, Duration)>),
}

/// What an [`Upstream`] answers to the requests of one path (a builder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Body,
    /// Waited out after the request is read, before the status line.
    delay: Duration,
    /// The delay that [`Reply::chunks`] puts between chunks.
    chunk_delay: Duration,
    gzip: bool,
    reset_before_headers: bool,
}

impl Reply {
    /// `status` with no headers and an empty body.
    pub fn new(status: u16) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            body: Body::Fixed(Vec::new()),
            delay: Duration::ZERO,
            chunk_delay: Duration::ZERO,
            gzip: false,
            reset_before_headers: false,
        }
    }

    /// 200 `application/json` with `body`, sent with `content-length`.
    pub fn json(body: impl Into<Vec<u8>>) -> Reply {
        Reply::new(200)
            .header("content-type", "application/json")
            .body(Body::Fixed(body.into()))
    }

    /// 200 `text/event-stream`, chunked, each of `events` one chunk as given
    /// (the caller writes the framing, e.g. `"data: x\n\n"`).
    pub fn sse(events: &[&str]) -> Reply {
        Reply::new(200)
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .chunks(events.iter().map(|e| e.as_bytes().to_vec()).collect())
    }

    /// Sets the status code.
    pub fn status(mut self, status: u16) -> Reply {
        self.status = status;
        self
    }

    /// Sets header `name` (replacing any header of that name,
    /// case-insensitively). The framing headers (`content-length`,
    /// `transfer-encoding`, `connection`) are written by the upstream.
    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: Body) -> Reply {
        self.body = body;
        self
    }

    /// A chunked body of these pieces, the [`Reply::chunk_delay`] between
    /// them.
    pub fn chunks(mut self, chunks: Vec<Vec<u8>>) -> Reply {
        let between = self.chunk_delay;
        self.body = Body::Chunked(
            chunks
                .into_iter()
                .enumerate()
                .map(|(i, c)| (c, if i == 0 { Duration::ZERO } else { between }))
                .collect(),
        );
        self
    }

    /// Waits `delay` between chunks (a slow stream): before every chunk but
    /// the first, of the chunked body already set and of one set later with
    /// [`Reply::chunks`] or [`Reply::sse`]. Not before the end of the body.
    pub fn chunk_delay(mut self, delay: Duration) -> Reply {
        self.chunk_delay = delay;
        if let Body::Chunked(chunks) = &mut self.body {
            for (_, d) in chunks.iter_mut().skip(1) {
                *d = delay;
            }
        }
        self
    }

    /// Waits `delay` after reading the request, before the status line (or
    /// before the reset).
    pub fn delay(mut self, delay: Duration) -> Reply {
        self.delay = delay;
        self
    }

    /// Answers nothing: closes the connection with a TCP reset (`SO_LINGER`
    /// 0) after the delay.
    pub fn reset(mut self) -> Reply {
        self.reset_before_headers = true;
        self
    }

    /// Gzips the body (stored deflate blocks: valid gzip, not smaller) and
    /// sets `content-encoding: gzip`. A chunked body stays chunked, the gzip
    /// stream spread over its chunks, its end in one more chunk.
    pub fn gzip(mut self) -> Reply {
        self.gzip = true;
        self
    }
}

/// Holds the requests of a path in flight until opened (see
/// [`Upstream::hold`]). Clones share the one gate.
#[derive(Debug, Clone, Default)]
pub struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    /// Lets the held requests, and every later one, through.
    pub fn open(&self) {
        let (open, changed) = &*self.0;
        *lock(open) = true;
        changed.notify_all();
    }

    /// Whether it has been opened.
    pub fn is_open(&self) -> bool {
        *lock(&self.0 .0)
    }

    /// Waits until it is open or the upstream stops.
    fn wait(&self, stop: &AtomicBool) {
        let (open, changed) = &*self.0;
        let mut is_open = lock(open);
        while !*is_open && !stop.load(Ordering::SeqCst) {
            is_open = match changed.wait_timeout(is_open, Duration::from_millis(20)) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

/// A request an [`Upstream`] has read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// E.g. `GET`.
    pub method: String,
    /// The request target as sent: path and query.
    pub target: String,
    /// Headers, names lower-case, in order.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked).
    pub body: Vec<u8>,
}

impl Received {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The target without its query string.
    pub fn path(&self) -> &str {
        path_of(&self.target)
    }

    fn wants_close(&self, http10: bool) -> bool {
        let connection = self.header("connection").unwrap_or("").to_ascii_lowercase();
        connection.contains("close") || (http10 && !connection.contains("keep-alive"))
    }
}

#[derive(Debug, Default)]
struct Shared {
    routes: Mutex<HashMap<String, Reply>>,
    fallback: Mutex<Option<Reply>>,
    gates: Mutex<HashMap<String, Gate>>,
    counts: Mutex<HashMap<String, usize>>,
    received: Mutex<Vec<Received>>,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    connections: AtomicUsize,
    stop: AtomicBool,
}

/// A running upstream on 127.0.0.1; stopped when dropped.
#[derive(Debug)]
pub struct Upstream {
    port: u16,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Upstream {
    /// Starts an upstream on a free loopback port. Every path answers 404
    /// (a small JSON body) until routed.
    pub fn start() -> Result<Upstream> {
        let (listener, port) = bind_loopback().context("binding a loopback port")?;
        listener
            .set_nonblocking(true)
            .context("making the listener non-blocking")?;
        let shared = Arc::new(Shared::default());
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("upstream-{port}"))
                .spawn(move || accept_loop(&listener, &shared))
                .context("spawning the upstream's thread")?
        };
        Ok(Upstream {
            port,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// Answers requests for `path` (exact, without the query string) with
    /// `reply` from now on, replacing any earlier reply for it.
    pub fn route(&self, path: &str, reply: Reply) {
        lock(&self.shared.routes).insert(path_of(path).to_string(), reply);
    }

    /// Answers requests for paths with no route with `reply` from now on
    /// (instead of the 404).
    pub fn fallback(&self, reply: Reply) {
        *lock(&self.shared.fallback) = Some(reply);
    }

    /// Holds every request for `path` from now on, after it is read and
    /// counted in flight, until the returned gate is opened (or the upstream
    /// stops). Replaces any earlier gate of the path.
    pub fn hold(&self, path: &str) -> Gate {
        let gate = Gate::default();
        lock(&self.shared.gates).insert(path_of(path).to_string(), gate.clone());
        gate
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// How many requests for `path` (without the query string) it has read.
    pub fn requests(&self, path: &str) -> usize {
        lock(&self.shared.counts)
            .get(path_of(path))
            .copied()
            .unwrap_or(0)
    }

    /// Every request read so far, in order.
    pub fn received(&self) -> Vec<Received> {
        lock(&self.shared.received).clone()
    }

    /// How many TCP connections it has accepted.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Requests read whose response is not finished. A request stops
    /// counting just before the last bytes of its response are written, so a
    /// client that has read a whole response never still sees it here.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests in flight at once since the start or the last
    /// [`Upstream::reset_peak`].
    pub fn peak_in_flight(&self) -> usize {
        self.shared.peak.load(Ordering::SeqCst)
    }

    /// Starts the peak over from the requests in flight now.
    pub fn reset_peak(&self) {
        self.shared.peak.store(
            self.shared.in_flight.load(Ordering::SeqCst),
            Ordering::SeqCst,
        );
    }

    /// Waits up to `timeout` until exactly `n` requests are in flight;
    /// whether they are.
    pub fn wait_in_flight(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.in_flight() == n {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops: closes the listening socket and every connection (held
    /// requests and slow streams are cut off). The port is free again when
    /// this returns.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn path_of(target: &str) -> &str {
    target.split_once('?').map_or(target, |(p, _)| p)
}

/// Sleeps `d`, in slices, returning early when the upstream stops.
fn nap(d: Duration, stop: &AtomicBool) {
    let deadline = Instant::now() + d;
    while !stop.load(Ordering::SeqCst) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(20)));
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut connections: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                shared.connections.fetch_add(1, Ordering::SeqCst);
                connections.retain(|h| !h.is_finished());
                let shared = Arc::clone(shared);
                if let Ok(h) = std::thread::Builder::new()
                    .name("upstream-conn".to_string())
                    .spawn(move || {
                        let _ = serve(stream, &shared);
                    })
                {
                    connections.push(h);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    for h in connections {
        let _ = h.join();
    }
}

/// Counts a request in flight until dropped.
struct InFlight<'a>(&'a Shared);

impl<'a> InFlight<'a> {
    fn enter(shared: &'a Shared) -> InFlight<'a> {
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        shared.peak.fetch_max(now, Ordering::SeqCst);
        InFlight(shared)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves requests on one connection until the client closes it, asks to
/// close it, sends garbage, or the upstream stops.
fn serve(stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    // Short, so that an idle keep-alive connection notices the stop.
    stream.set_read_timeout(Some(Duration::from_millis(50)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut conn = Conn {
        stream,
        buf: Vec::new(),
        stop: &shared.stop,
    };
    loop {
        let Some((req, http10)) = read_request(&mut conn)? else {
            return Ok(());
        };
        let path = req.path().to_string();
        let close = req.wants_close(http10);
        let head_only = req.method.eq_ignore_ascii_case("HEAD");
        let in_flight = InFlight::enter(shared);
        *lock(&shared.counts).entry(path.clone()).or_default() += 1;
        lock(&shared.received).push(req);
        let gate = lock(&shared.gates).get(&path).cloned();
        if let Some(gate) = gate {
            gate.wait(&shared.stop);
        }
        let reply = lock(&shared.routes)
            .get(&path)
            .cloned()
            .or_else(|| lock(&shared.fallback).clone())
            .unwrap_or_else(|| not_found(&path));
        nap(reply.delay, &shared.stop);
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        if reply.reset_before_headers {
            drop(in_flight);
            reset(&conn.stream);
            return Ok(());
        }
        write_reply(
            &mut conn.stream,
            &reply,
            (close, head_only),
            in_flight,
            &shared.stop,
        )?;
        if close || shared.stop.load(Ordering::SeqCst) {
            let _ = conn.stream.shutdown(Shutdown::Both);
            return Ok(());
        }
    }
}

fn not_found(path: &str) -> Reply {
    let body = serde_json::json!({ "error": "no route", "path": path }).to_string();
    Reply::json(body).status(404)
}

/// Closes with a TCP reset: `SO_LINGER` on with a zero timeout, then close.
fn reset(stream: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: the descriptor is open (owned by `stream`), and the option
    // value points to a live `linger` of the length given.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::from_ref(&linger).cast::<libc::c_void>(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// A connection's read side with what has been read but not consumed.
struct Conn<'a> {
    stream: TcpStream,
    buf: Vec<u8>,
    stop: &'a AtomicBool,
}

/// The most a request head, a chunk-size line or a trailer may take.
const MAX_HEAD: usize = 64 * 1024;

impl Conn<'_> {
    /// Reads more; `false` at the end of the stream or when the upstream
    /// stops.
    fn fill(&mut self) -> io::Result<bool> {
        let mut chunk = [0u8; 8192];
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Ok(false);
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf
                        .extend_from_slice(chunk.get(..n).unwrap_or_default());
                    return Ok(true);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the bytes up to `delim` (dropping `delim`); `None` when the
    /// stream ends first.
    fn take_until(&mut self, delim: &[u8]) -> io::Result<Option<Vec<u8>>> {
        loop {
            if let Some(i) = find(&self.buf, delim) {
                let mut line: Vec<u8> = self.buf.drain(..i + delim.len()).collect();
                line.truncate(i);
                return Ok(Some(line));
            }
            if self.buf.len() > MAX_HEAD {
                return Err(invalid("line or head too long"));
            }
            if !self.fill()? {
                return Ok(None);
            }
        }
    }

    /// Takes `n` bytes; `None` when the stream ends first.
    fn take(&mut self, n: usize) -> io::Result<Option<Vec<u8>>> {
        while self.buf.len() < n {
            if !self.fill()? {
                return Ok(None);
            }
        }
        Ok(Some(self.buf.drain(..n).collect()))
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Reads one request (head and body) and whether it is HTTP/1.0; `None`
/// when the connection ends before one.
fn read_request(conn: &mut Conn) -> io::Result<Option<(Received, bool)>> {
    let head = loop {
        let Some(head) = conn.take_until(b"\r\n\r\n")? else {
            return Ok(None);
        };
        // Empty lines before a request are allowed (RFC 9112 2.2).
        let head = String::from_utf8_lossy(&head).trim_start().to_string();
        if !head.is_empty() {
            break head;
        }
    };
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split_whitespace();
    let (Some(method), Some(target), Some(version)) = (first.next(), first.next(), first.next())
    else {
        return Err(invalid("bad request line"));
    };
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut req = Received {
        method: method.to_string(),
        target: target.to_string(),
        headers,
        body: Vec::new(),
    };
    let http10 = version.eq_ignore_ascii_case("HTTP/1.0");
    if req
        .header("expect")
        .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
    {
        conn.stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
    }
    let chunked = req
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    if chunked {
        loop {
            let Some(line) = conn.take_until(b"\r\n")? else {
                return Ok(None);
            };
            let line = String::from_utf8_lossy(&line);
            let size = line.split(';').next().unwrap_or_default().trim();
            let size = usize::from_str_radix(size, 16).map_err(|_| invalid("bad chunk size"))?;
            if size == 0 {
                // Trailers, up to an empty line.
                loop {
                    match conn.take_until(b"\r\n")? {
                        None => return Ok(None),
                        Some(l) if l.is_empty() => break,
                        Some(_) => {}
                    }
                }
                break;
            }
            let Some(data) = conn.take(size + 2)? else {
                return Ok(None);
            };
            req.body
                .extend_from_slice(data.get(..size).unwrap_or_default());
        }
    } else if let Some(length) = req.header("content-length") {
        let length = length
            .parse::<usize>()
            .map_err(|_| invalid("bad content-length"))?;
        let Some(body) = conn.take(length)? else {
            return Ok(None);
        };
        req.body = body;
    }
    Ok(Some((req, http10)))
}

/// Writes `reply`; the request stops counting in flight (`done` is
/// dropped) just before the last write, so that a client that has read the
/// whole response sees it no longer in flight.
fn write_reply(
    stream: &mut TcpStream,
    reply: &Reply,
    (close, head_only): (bool, bool),
    done: InFlight,
    stop: &AtomicBool,
) -> io::Result<()> {
    let status = reply.status;
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (n, v) in &reply.headers {
        let _ = write!(head, "{n}: {v}\r\n");
    }
    let has_encoding = reply
        .headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("content-encoding"));
    if reply.gzip && !has_encoding {
        head.push_str("content-encoding: gzip\r\n");
    }
    if close {
        head.push_str("connection: close\r\n");
    }
    let bodyless = status / 100 == 1 || status == 204 || status == 304;
    match &reply.body {
        _ if bodyless => {
            head.push_str("\r\n");
            drop(done);
            stream.write_all(head.as_bytes())?;
        }
        Body::Fixed(bytes) => {
            let gzipped;
            let bytes = if reply.gzip {
                gzipped = gzip(bytes);
                &gzipped
            } else {
                bytes
            };
            let _ = write!(head, "content-length: {}\r\n\r\n", bytes.len());
            let mut out = head.into_bytes();
            if !head_only {
                out.extend_from_slice(bytes);
            }
            drop(done);
            stream.write_all(&out)?;
        }
        Body::Chunked(chunks) => {
            head.push_str("transfer-encoding: chunked\r\n\r\n");
            if head_only {
                drop(done);
                stream.write_all(head.as_bytes())?;
                return stream.flush();
            }
            stream.write_all(head.as_bytes())?;
            stream.flush()?;
            let mut gz = reply.gzip.then(Gzip::default);
            for (data, delay) in chunks {
                nap(*delay, stop);
                if stop.load(Ordering::SeqCst) {
                    return Ok(());
                }
                let data = match &mut gz {
                    Some(gz) => gz.chunk(data),
                    None => data.clone(),
                };
                stream.write_all(&chunk(&data))?;
                stream.flush()?;
            }
            let mut end = gz.map(|gz| chunk(&gz.finish())).unwrap_or_default();
            end.extend_from_slice(b"0\r\n\r\n");
            drop(done);
            stream.write_all(&end)?;
        }
    }
    stream.flush()
}

/// `data` framed as one chunk; nothing for no data (an empty chunk would
/// end the body).
fn chunk(data: &[u8]) -> Vec<u8> {
    if data.is_empty() {
        return Vec::new();
    }
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

/// `data` as one gzip member of stored (uncompressed) deflate blocks.
pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut gz = Gzip::default();
    let mut out = gz.chunk(data);
    out.extend(gz.finish());
    out
}

/// A gzip member written piece by piece: stored deflate blocks, so every
/// piece can be sent as soon as it is known.
#[derive(Debug, Default)]
struct Gzip {
    started: bool,
    crc: u32,
    size: u32,
}

impl Gzip {
    /// The gzip bytes for `data` (the header first, the first time).
    fn chunk(&mut self, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len() + 16);
        if !self.started {
            self.started = true;
            // Magic, deflate, no flags, no mtime, no extra flags, OS unknown.
            out.extend_from_slice(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff]);
        }
        for piece in data.chunks(usize::from(u16::MAX)) {
            let len = u16::try_from(piece.len()).unwrap_or(u16::MAX);
            // BFINAL 0, BTYPE 00 (stored), padded to the byte.
            out.push(0);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&(!len).to_le_bytes());
            out.extend_from_slice(piece);
        }
        self.crc = crc32(self.crc, data);
        // ISIZE is the length modulo 2^32.
        self.size = self.size.wrapping_add(data.len() as u32);
        out
    }

    /// The end: an empty final stored block, the CRC-32 and the size.
    fn finish(mut self) -> Vec<u8> {
        let mut out = if self.started {
            Vec::new()
        } else {
            self.chunk(&[])
        };
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
        out.extend_from_slice(&self.crc.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out
    }
}

/// CRC-32 (IEEE, reflected), continuing from `crc` (0 to start).
fn crc32(crc: u32, data: &[u8]) -> u32 {
    let mut c = !crc;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0xedb8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_of_the_check_string() {
        assert_eq!(crc32(0, b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(crc32(0, b"1234"), b"56789"), 0xcbf4_3926);
    }

    #[test]
    fn the_query_string_is_not_part_of_the_path() {
        assert_eq!(path_of("/a/b?x=1&y"), "/a/b");
        assert_eq!(path_of("/a"), "/a");
    }
}
