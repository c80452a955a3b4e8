//! A small blocking HTTP/1.1 client (built on `ureq`) and a parallel burst
//! helper.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use ureq::http;

/// Whether requests share keep-alive connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionMode {
    /// Reuse idle connections between requests.
    KeepAlive,
    /// Open a new TCP connection for every request (and send
    /// `connection: close`).
    NewPerRequest,
}

/// A request relative to a [`Client`]'s base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// HTTP method, e.g. `GET`.
    pub method: String,
    /// Path and query, starting with `/`.
    pub path: String,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
    /// Request body (none when empty).
    pub body: Vec<u8>,
}

impl Request {
    /// A request with no headers and no body.
    pub fn new(method: &str, path: &str) -> Request {
        Request {
            method: method.to_string(),
            path: path.to_string(),
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    /// `GET path`.
    pub fn get(path: &str) -> Request {
        Request::new("GET", path)
    }

    /// `POST path` with `body`.
    pub fn post(path: &str, body: impl Into<Vec<u8>>) -> Request {
        let mut r = Request::new("POST", path);
        r.body = body.into();
        r
    }

    /// Adds a request header.
    pub fn header(mut self, name: &str, value: &str) -> Request {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }
}

/// A response: status, headers (names lower-cased, in order) and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-case.
    pub headers: Vec<(String, String)>,
    /// Body, as lossy UTF-8.
    pub body: String,
}

impl Response {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first value of header `name`; panics, showing the response, when
    /// it has none (an assertion for tests).
    pub fn expect_header(&self, name: &str) -> &str {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} header in {self:#?}"))
    }

    /// Header `name` as an integer; panics, showing the response, when it is
    /// missing or not one.
    pub fn int_header(&self, name: &str) -> u64 {
        let v = self.expect_header(name);
        v.parse()
            .unwrap_or_else(|_| panic!("{name}: {v:?} is not an integer in {self:#?}"))
    }

    /// The body as JSON; panics, showing the response, when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {self:#?}"))
    }

    /// Every value of header `name` (case-insensitive).
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// A blocking HTTP client for one base URL (e.g. `http://127.0.0.1:10000`).
///
/// Statuses 4xx and 5xx are ordinary responses, not errors.
#[derive(Debug, Clone)]
pub struct Client {
    base_url: String,
    mode: ConnectionMode,
    timeout: Duration,
    agent: ureq::Agent,
}

fn agent(mode: ConnectionMode, timeout: Duration) -> ureq::Agent {
    let idle = match mode {
        ConnectionMode::KeepAlive => 16,
        ConnectionMode::NewPerRequest => 0,
    };
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .max_idle_connections(idle)
        .max_idle_connections_per_host(idle)
        .timeout_global(Some(timeout))
        .build();
    ureq::Agent::new_with_config(config)
}

impl Client {
    /// A client with a 10 s timeout per request.
    pub fn new(base_url: impl Into<String>, mode: ConnectionMode) -> Client {
        Client::with_timeout(base_url, mode, Duration::from_secs(10))
    }

    /// A client with the given timeout per request.
    pub fn with_timeout(
        base_url: impl Into<String>,
        mode: ConnectionMode,
        timeout: Duration,
    ) -> Client {
        Client {
            base_url: base_url.into(),
            mode,
            timeout,
            agent: agent(mode, timeout),
        }
    }

    /// The base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// `GET path` with extra headers.
    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Result<Response> {
        let mut r = Request::get(path);
        for (n, v) in headers {
            r = r.header(n, v);
        }
        self.send(&r)
    }

    /// `GET path` with extra headers; panics, naming the request, when it
    /// fails at the transport level (for tests, where that is a failure).
    pub fn must_get(&self, path: &str, headers: &[(&str, &str)]) -> Response {
        self.get(path, headers)
            .unwrap_or_else(|e| panic!("GET {path} {headers:?}: {e:#}"))
    }

    /// `GET path` as client `client_id` (the `x-client-id` header that the
    /// demo configuration `envoy/ratelimit-demo.json` and the tests key on);
    /// panics like [`Client::must_get`].
    pub fn get_as(&self, path: &str, client_id: &str) -> Response {
        self.must_get(path, &[("x-client-id", client_id)])
    }

    /// Sends `req`.
    pub fn send(&self, req: &Request) -> Result<Response> {
        let url = format!("{}{}", self.base_url, req.path);
        let mut builder = http::Request::builder()
            .method(req.method.as_str())
            .uri(&url);
        for (n, v) in &req.headers {
            builder = builder.header(n.as_str(), v.as_str());
        }
        // A fresh agent per request guarantees a fresh connection.
        let fresh;
        let agent = match self.mode {
            ConnectionMode::KeepAlive => &self.agent,
            ConnectionMode::NewPerRequest => {
                builder = builder.header("connection", "close");
                fresh = agent(self.mode, self.timeout);
                &fresh
            }
        };
        let what = || format!("{} {url}", req.method);
        let result = if req.body.is_empty() {
            let r = builder.body(()).with_context(what)?;
            agent.run(r)
        } else {
            let r = builder.body(req.body.clone()).with_context(what)?;
            agent.run(r)
        };
        let mut resp = result.with_context(what)?;
        let status = resp.status().as_u16();
        let headers = resp
            .headers()
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_ascii_lowercase(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        // Bytes, read as lossy UTF-8: a compressed body is not text.
        let bytes = resp
            .body_mut()
            .read_to_vec()
            .with_context(|| format!("reading the body of {}", what()))?;
        let body = String::from_utf8_lossy(&bytes).into_owned();
        Ok(Response {
            status,
            headers,
            body,
        })
    }
}

/// Sends `count` copies of `req` to `base_url` from `threads` threads at
/// once, each request on its own new connection. Returns the responses in
/// request order; fails if any request failed at the transport level.
pub fn burst(base_url: &str, req: &Request, count: usize, threads: usize) -> Result<Vec<Response>> {
    let threads = threads.clamp(1, count.max(1));
    let next = Arc::new(AtomicUsize::new(0));
    let slots: Arc<Mutex<Vec<Option<Result<Response>>>>> =
        Arc::new(Mutex::new((0..count).map(|_| None).collect()));
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let next = Arc::clone(&next);
            let slots = Arc::clone(&slots);
            let start = Arc::clone(&start);
            let client = Client::new(base_url, ConnectionMode::NewPerRequest);
            let req = req.clone();
            std::thread::spawn(move || {
                start.wait();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    let r = client.send(&req);
                    if let Ok(mut s) = slots.lock() {
                        s[i] = Some(r);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| anyhow!("a burst thread panicked"))?;
    }
    let slots = Arc::try_unwrap(slots)
        .map_err(|_| anyhow!("burst results still shared"))?
        .into_inner()
        .map_err(|_| anyhow!("burst results poisoned"))?;
    slots
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|| Err(anyhow!("request {i} was not sent"))))
        .collect()
}
