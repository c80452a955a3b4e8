//! The upstream's promises, checked over plain TCP (to see the framing as
//! sent) and through the testkit's client.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use testkit::upstream::Body;
use testkit::{Client, ConnectionMode, Reply, Upstream};

/// A response as read off the wire.
#[derive(Debug)]
struct Raw {
    status: u16,
    /// Names lower-case.
    headers: Vec<(String, String)>,
    /// The body, de-chunked.
    body: Vec<u8>,
    /// The chunks as sent (empty for a `content-length` body).
    chunks: Vec<Vec<u8>>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

fn connect(up: &Upstream) -> BufReader<TcpStream> {
    let s = TcpStream::connect((Ipv4Addr::LOCALHOST, up.port()))
        .unwrap_or_else(|e| panic!("connecting to the upstream: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap_or_else(|e| panic!("{e}"));
    BufReader::new(s)
}

fn send(conn: &mut BufReader<TcpStream>, raw: &[u8]) {
    conn.get_mut()
        .write_all(raw)
        .unwrap_or_else(|e| panic!("sending: {e}"));
}

fn line(conn: &mut BufReader<TcpStream>) -> String {
    let mut l = String::new();
    conn.read_line(&mut l)
        .unwrap_or_else(|e| panic!("reading a line: {e}"));
    l.trim_end_matches("\r\n").to_string()
}

fn exact(conn: &mut BufReader<TcpStream>, n: usize) -> Vec<u8> {
    let mut b = vec![0; n];
    conn.read_exact(&mut b)
        .unwrap_or_else(|e| panic!("reading {n} bytes: {e}"));
    b
}

fn read_response(conn: &mut BufReader<TcpStream>) -> Raw {
    let status_line = line(conn);
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let l = line(conn);
        if l.is_empty() {
            break;
        }
        let (n, v) = l
            .split_once(':')
            .unwrap_or_else(|| panic!("bad header {l:?}"));
        headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let mut raw = Raw {
        status,
        headers,
        body: Vec::new(),
        chunks: Vec::new(),
    };
    if raw.header("transfer-encoding") == Some("chunked") {
        loop {
            let size = line(conn);
            let size = usize::from_str_radix(&size, 16)
                .unwrap_or_else(|_| panic!("bad chunk size {size:?}"));
            if size == 0 {
                assert_eq!(line(conn), "", "no trailers expected");
                break;
            }
            let chunk = exact(conn, size);
            assert_eq!(exact(conn, 2), b"\r\n");
            raw.body.extend_from_slice(&chunk);
            raw.chunks.push(chunk);
        }
    } else if let Some(n) = raw.header("content-length") {
        let n = n.parse().unwrap_or_else(|_| panic!("bad length {n:?}"));
        raw.body = exact(conn, n);
    }
    raw
}

fn get(conn: &mut BufReader<TcpStream>, path: &str) -> Raw {
    send(
        conn,
        format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes(),
    );
    read_response(conn)
}

fn start() -> Upstream {
    Upstream::start().unwrap_or_else(|e| panic!("{e:#}"))
}

fn gunzip(data: &[u8]) -> Vec<u8> {
    let mut child = Command::new("gzip")
        .arg("-dc")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running gzip: {e}"));
    let mut stdin = child.stdin.take().unwrap_or_else(|| panic!("no stdin"));
    let data = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("waiting for gzip: {e}"));
    let _ = writer.join();
    assert!(out.status.success(), "gzip -dc failed: {out:?}");
    out.stdout
}

#[test]
fn a_json_body_round_trips_and_unknown_paths_are_404() {
    let up = start();
    up.route("/v1/chat", Reply::json(r#"{"id":"x","ok":true}"#));
    let c = Client::new(up.url(""), ConnectionMode::NewPerRequest);
    let r = c.must_get("/v1/chat?stream=false", &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("content-length"), Some("20"));
    assert_eq!(r.body, r#"{"id":"x","ok":true}"#);
    assert_eq!(up.requests("/v1/chat"), 1);

    let r = c.must_get("/nowhere", &[]);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["path"], "/nowhere");
    assert_eq!(up.requests("/nowhere"), 1);

    up.fallback(Reply::json("{}").status(503).header("retry-after", "1"));
    let r = c.must_get("/nowhere", &[]);
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("1"));
}

#[test]
fn sse_arrives_chunked_with_the_exact_bytes() {
    let up = start();
    let events = [
        "data: {\"n\":1}\n\n",
        "data: {\"n\":2}\n\n",
        "data: [DONE]\n\n",
    ];
    up.route("/sse", Reply::sse(&events));
    let mut conn = connect(&up);
    let r = get(&mut conn, "/sse");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    assert_eq!(r.header("content-length"), None);
    let sent: Vec<Vec<u8>> = events.iter().map(|e| e.as_bytes().to_vec()).collect();
    assert_eq!(r.chunks, sent);
    assert_eq!(r.body, events.concat().into_bytes());

    // And through the client, which de-chunks.
    let c = Client::new(up.url(""), ConnectionMode::KeepAlive);
    let r = c.must_get("/sse", &[]);
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    assert_eq!(r.body, events.concat());
}

#[test]
fn one_connection_serves_many_requests_with_either_kind_of_body() {
    let up = start();
    up.route("/a", Reply::json("a"));
    up.route("/b", Reply::json("b").status(201));
    let mut conn = connect(&up);
    assert_eq!(get(&mut conn, "/a").body, b"a");
    send(
        &mut conn,
        b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello",
    );
    let r = read_response(&mut conn);
    assert_eq!((r.status, r.body.as_slice()), (201, &b"b"[..]));
    send(
        &mut conn,
        b"POST /b?q HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n\
          3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\nx-trailer: 1\r\n\r\n",
    );
    assert_eq!(read_response(&mut conn).status, 201);
    // Two requests in one write (pipelined).
    send(
        &mut conn,
        b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n",
    );
    assert_eq!(read_response(&mut conn).body, b"a");
    assert_eq!(read_response(&mut conn).body, b"b");
    assert_eq!(up.connections(), 1);
    assert_eq!((up.requests("/a"), up.requests("/b")), (2, 3));

    let got = up.received();
    let bodies: Vec<&[u8]> = got.iter().map(|r| r.body.as_slice()).collect();
    assert_eq!(bodies, [&b""[..], b"hello", b"abcdefg", b"", b""]);
    assert_eq!(got[2].target, "/b?q");
    assert_eq!(got[2].path(), "/b");
    assert_eq!(got[2].header("Transfer-Encoding"), Some("chunked"));

    // `connection: close` is honoured.
    send(
        &mut conn,
        b"GET /a HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    );
    let r = read_response(&mut conn);
    assert_eq!(r.header("connection"), Some("close"));
    let mut rest = Vec::new();
    let n = conn
        .read_to_end(&mut rest)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(n, 0);
}

#[test]
fn slow_chunks_and_a_delay_take_at_least_their_time() {
    let up = start();
    let between = Duration::from_millis(120);
    up.route(
        "/slow",
        Reply::sse(&["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"]).chunk_delay(between),
    );
    up.route(
        "/late",
        Reply::json("{}")
            .chunks(vec![b"x".to_vec(), b"y".to_vec()])
            .delay(between),
    );
    let mut conn = connect(&up);
    let t = Instant::now();
    let r = get(&mut conn, "/slow");
    assert!(t.elapsed() >= between * 2, "{:?}", t.elapsed());
    assert_eq!(r.chunks.len(), 3);

    let t = Instant::now();
    let r = get(&mut conn, "/late");
    assert!(t.elapsed() >= between, "{:?}", t.elapsed());
    assert_eq!(r.body, b"xy");

    // A delay per chunk, as given.
    up.route(
        "/custom",
        Reply::new(200).body(Body::Chunked(vec![
            (b"a".to_vec(), between),
            (Vec::new(), Duration::ZERO),
            (b"b".to_vec(), Duration::ZERO),
        ])),
    );
    let t = Instant::now();
    let r = get(&mut conn, "/custom");
    assert!(t.elapsed() >= between, "{:?}", t.elapsed());
    assert_eq!(r.chunks, [b"a".to_vec(), b"b".to_vec()]);
}

#[test]
fn held_requests_stay_in_flight_until_the_gate_opens() {
    let up = start();
    up.route("/held", Reply::json("done"));
    let gate = up.hold("/held");
    let url = up.url("");
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let c = Client::new(url.clone(), ConnectionMode::NewPerRequest);
            std::thread::spawn(move || c.must_get("/held", &[]).body)
        })
        .collect();
    assert!(
        up.wait_in_flight(3, Duration::from_secs(5)),
        "{}",
        up.in_flight()
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(up.in_flight(), 3);
    assert_eq!(up.peak_in_flight(), 3);
    assert!(!gate.is_open());
    gate.open();
    for c in clients {
        let body = c.join().unwrap_or_else(|_| panic!("a client panicked"));
        assert_eq!(body, "done");
    }
    assert!(up.wait_in_flight(0, Duration::from_secs(5)));
    assert_eq!(up.peak_in_flight(), 3);
    up.reset_peak();
    assert_eq!(up.peak_in_flight(), 0);
    // The gate stays open.
    let c = Client::new(url, ConnectionMode::NewPerRequest);
    assert_eq!(c.must_get("/held", &[]).body, "done");
    assert_eq!(up.peak_in_flight(), 1);
}

#[test]
fn a_reset_reply_is_a_connection_error() {
    let up = start();
    up.route("/reset", Reply::json("never").reset());
    up.route("/ok", Reply::json("ok"));
    let c = Client::new(up.url(""), ConnectionMode::NewPerRequest);
    assert!(c.get("/reset", &[]).is_err());

    let mut conn = connect(&up);
    send(&mut conn, b"GET /reset HTTP/1.1\r\nhost: x\r\n\r\n");
    let mut buf = Vec::new();
    let e = conn
        .read_to_end(&mut buf)
        .expect_err("a reset, not an orderly close");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    assert!(buf.is_empty());

    assert_eq!(up.requests("/reset"), 2);
    assert_eq!(c.must_get("/ok", &[]).body, "ok");
    assert_eq!(up.in_flight(), 0);
}

#[test]
fn a_gzip_body_decompresses_to_the_body() {
    let up = start();
    // More than one stored block (65535 bytes each).
    let big: Vec<u8> = (0..150_000u32).map(|i| (i * 7 % 251) as u8).collect();
    up.route("/gz", Reply::json(big.clone()).gzip());
    up.route(
        "/gz-stream",
        Reply::sse(&["data: 1\n\n", "data: 2\n\n"]).gzip(),
    );
    let mut conn = connect(&up);
    let r = get(&mut conn, "/gz");
    assert_eq!(r.header("content-encoding"), Some("gzip"));
    assert_eq!(r.body.get(..3), Some(&[0x1f, 0x8b, 8][..]));
    assert_eq!(
        r.header("content-length"),
        Some(r.body.len().to_string().as_str())
    );
    assert_eq!(gunzip(&r.body), big);

    let r = get(&mut conn, "/gz-stream");
    assert_eq!(r.header("content-encoding"), Some("gzip"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    // One chunk per event, one for the end of the gzip stream.
    assert_eq!(r.chunks.len(), 3);
    assert_eq!(gunzip(&r.body), b"data: 1\n\ndata: 2\n\n");

    assert_eq!(gunzip(&testkit::upstream::gzip(b"")), b"");
}

#[test]
fn stopping_frees_the_port_and_cuts_held_requests() {
    let mut up = start();
    let _gate = up.hold("/held");
    let c = Client::new(up.url(""), ConnectionMode::NewPerRequest);
    let client = std::thread::spawn(move || c.get("/held", &[]).is_err());
    assert!(up.wait_in_flight(1, Duration::from_secs(5)));
    let t = Instant::now();
    up.stop();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(client.join().unwrap_or_else(|_| panic!("client panicked")));
    assert!(TcpStream::connect((Ipv4Addr::LOCALHOST, up.port())).is_err());
}
