//! The HTTP side: `POST /v1/check`, `POST /v1/lease`, `POST /v1/settle`,
//! `POST /v3/check` (a batch of checks), `GET /healthz` (= `/readyz`),
//! `GET /livez`, `GET /metrics`.
//!
//! [`serve`] is the accept loop: TLS when configured, HTTP/1.1 with a header
//! read timeout or HTTP/2 (h2c with prior knowledge, or `h2` in TLS's ALPN)
//! with at most [`MAX_STREAMS_PER_CONNECTION`] streams, headers of both at
//! most [`MAX_HEAD_BYTES`], every connection closed when idle past
//! `--header-timeout-ms`, and a drain deadline after the shutdown signal.
//! [`admit`] stands in front of `/v1/*` and `/v3/check` only, the first
//! step of their handlers: the in-flight bound (503 + `Retry-After`), the
//! bearer token (401), the body read under its own deadline (408) and size
//! bound (413; a batch's is [`MAX_BATCH_BYTES`]);
//! then the handler checks the token's domain against the request's (403),
//! then that the policy has the domain (404), before anything reaches Redis. (A handler step, not a middleware layer:
//! no boxed service call, no extension map, no second pass over the body.)
//! The health and metrics routes stay open and unbounded.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

use crate::auth::{Caller, Refusal, Tokens};
use crate::flags::Bounds;
use crate::http::conn::Guarded;
use crate::logging::{Escaped, Warnings};
use crate::metrics::Metrics;
use crate::orchestrate::Limiter;
use crate::policy::UnknownDomain;
use crate::protocol::{
    self, BatchError, BatchResponse, CheckResult, ErrorBody, Health, MAX_BATCH_BYTES,
    STORE_UNAVAILABLE,
};
use crate::redis::store::StoreError;

/// Largest accepted request body (and gRPC message). A maximal valid
/// request (`ratelimit_protocol::MAX_BUCKETS` buckets with 512-byte keys and
/// tags and `MAX_LIMITS` limits each, and `MAX_QUOTAS` quotas with 512-byte
/// keys and tags) is about 210 KiB.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Largest request head (request line and headers) hyper buffers; over
/// HTTP/2 the largest header list.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// Most HTTP/2 streams open at once on one connection of the HTTP listener
/// (as on the gRPC port): a client past it waits, as HTTP/2's settings say,
/// or has its new streams refused.
pub const MAX_STREAMS_PER_CONNECTION: u32 = crate::rls::MAX_STREAMS_PER_CONNECTION;

/// `Retry-After` of a 503 shed by the in-flight bound, in seconds.
pub const SHED_RETRY_AFTER_S: u64 = 1;

/// What the handlers share.
pub struct App {
    /// The check logic and its Redis connection.
    pub limiter: Limiter,
    /// The metrics registry.
    pub metrics: Metrics,
    /// The rate limit of the warnings callers cause.
    pub warnings: Warnings,
    /// The policy in force (`--policy`), reloaded on SIGHUP and file changes;
    /// empty (no domain) without `--policy`.
    pub policy: Arc<crate::reload::Reloadable<crate::policy::Policy>>,
    /// The callers' tokens in force; `None` with `--insecure-no-auth`.
    pub tokens: Option<Arc<crate::reload::Reloadable<Tokens>>>,
    /// Timeouts, in-flight bound, drain deadline.
    pub bounds: Bounds,
    /// One permit per `/v1/*` request served (`bounds.max_in_flight`).
    pub in_flight: Arc<Semaphore>,
    /// The Redis write probe every health check shares.
    pub health: crate::http::health::Probe,
    /// The HTTP listener's places among `--max-connections`.
    pub http_slots: crate::http::conn::Slots,
    /// The gRPC listener's places among `--max-connections`.
    pub grpc_slots: crate::http::conn::Slots,
}

/// The routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/check", post(check))
        .route("/v1/lease", post(lease))
        .route("/v1/settle", post(settle))
        .route("/v3/check", post(check_batch))
        .route("/healthz", get(healthz))
        .route("/readyz", get(healthz))
        .route("/livez", get(livez))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

/// A `/v1/*` request let in by [`admit`].
struct Admitted {
    /// Who is calling.
    caller: Caller,
    /// The whole body.
    body: Bytes,
    /// Its place among `--max-in-flight`, held until the answer is made.
    _permit: OwnedSemaphorePermit,
}

/// In front of `/v1/*` and `/v3/check`: the in-flight bound, the token, the
/// body's deadline and its size (at most `max_body` bytes: a declared
/// `Content-Length` over it is refused before any of the body is read); or
/// the answer that refuses the request.
async fn admit(app: &App, req: Request, max_body: usize) -> Result<Admitted, Response> {
    let Ok(permit) = Arc::clone(&app.in_flight).try_acquire_owned() else {
        app.metrics.shed.inc();
        let mut r = error(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy: too many requests in flight",
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(SHED_RETRY_AFTER_S));
        return Err(r);
    };
    let caller = match &app.tokens {
        None => Caller::anonymous(),
        Some(tokens) => {
            let value = req
                .headers()
                .get(header::AUTHORIZATION)
                .map(HeaderValue::as_bytes);
            match tokens.current().authenticate(value) {
                Ok(c) => c,
                Err(refusal) => return Err(refuse(app, refusal)),
            }
        }
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body as u64) {
        let mut r = bad_request(
            app,
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body: length limit exceeded ({max_body} bytes)"),
        );
        // The body is left unread: this connection is done.
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Err(r);
    }
    let limited = http_body_util::Limited::new(req.into_body(), max_body);
    let bytes = match tokio::time::timeout(app.bounds.body_timeout, limited.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) => {
            let status = if e.is::<http_body_util::LengthLimitError>() {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::BAD_REQUEST
            };
            return Err(bad_request(app, status, format!("body: {e}")));
        }
        Err(_) => {
            app.metrics.read_timeouts.with_label_values(&["body"]).inc();
            let mut r = error(StatusCode::REQUEST_TIMEOUT, "body: not received in time");
            // The rest of the body may still come: this connection is done.
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return Err(r);
        }
    };
    Ok(Admitted {
        caller,
        body: bytes,
        _permit: permit,
    })
}

/// 401 (with `www-authenticate: Bearer`) or 403, counted.
fn refuse(app: &App, refusal: Refusal) -> Response {
    app.metrics
        .auth_failures
        .with_label_values(&[refusal.label()])
        .inc();
    match refusal {
        Refusal::WrongDomain => error(
            StatusCode::FORBIDDEN,
            "authorization: this token may not act on this domain",
        ),
        _ => {
            let mut r = error(
                StatusCode::UNAUTHORIZED,
                "authorization: a known bearer token is required",
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
    }
}

/// Serves `app` on `listener` (over TLS when `tls` is given) until
/// `shutdown` completes; then stops accepting, lets the requests in flight
/// finish within `app.bounds.drain_timeout`, and returns, cutting the
/// connections still open (a half-open one cannot hold the process).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let bounds = app.bounds;
    let router = router(Arc::clone(&app));
    let http = Builders::new(bounds);
    let graceful = GracefulShutdown::new();
    let (cut, cut_rx) = tokio::sync::watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, most likely: let some close.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(slot) = app.http_slots.take() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let watcher = graceful.watcher();
        let http = http.clone();
        let service = TowerToHyperService::new(router.clone());
        let tls = tls.clone();
        let metrics = app.metrics.clone();
        let mut cut_rx = cut_rx.clone();
        tokio::spawn(async move {
            let served = async {
                match tls {
                    None => match prior_knowledge(&stream, bounds.header_timeout).await {
                        Some(h2) => http.serve(stream, h2, slot, service, watcher).await,
                        None => {
                            metrics.read_timeouts.with_label_values(&["header"]).inc();
                            Ok(())
                        }
                    },
                    Some(acceptor) => {
                        let handshake = acceptor.accept(stream);
                        let stream =
                            match tokio::time::timeout(bounds.header_timeout, handshake).await {
                                Ok(Ok(s)) => s,
                                Ok(Err(e)) => {
                                    tracing::debug!(error = %e, "TLS handshake failed");
                                    return Ok(());
                                }
                                Err(_) => {
                                    metrics
                                        .read_timeouts
                                        .with_label_values(&["handshake"])
                                        .inc();
                                    return Ok(());
                                }
                            };
                        let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                        http.serve(stream, h2, slot, service, watcher).await
                    }
                }
            };
            tokio::select! {
                r = served => {
                    if let Err(e) = r {
                        if timed_out(e.as_ref()) {
                            metrics.read_timeouts.with_label_values(&["header"]).inc();
                        }
                        tracing::debug!(error = %e, "connection ended");
                    }
                }
                _ = cut_rx.wait_for(|c| *c) => {}
            }
        });
    }
    drop(listener);
    let open = graceful.count();
    if open > 0 {
        tracing::info!(open, drain_timeout = ?bounds.drain_timeout, "draining connections");
    }
    if tokio::time::timeout(bounds.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            drain_timeout = ?bounds.drain_timeout,
            "drain deadline passed: closing the connections still open"
        );
        let _ = cut.send(true);
    }
    Ok(())
}

/// The connection builders of the HTTP listener, one per protocol.
#[derive(Clone)]
struct Builders {
    http1: hyper::server::conn::http1::Builder,
    http2: hyper::server::conn::http2::Builder<TokioExecutor>,
    /// An HTTP/2 connection's idle deadline (`--header-timeout-ms`).
    idle: Duration,
}

/// What a connection of the HTTP listener ends with.
type Served = Result<(), Box<dyn std::error::Error + Send + Sync>>;

impl Builders {
    fn new(bounds: Bounds) -> Builders {
        let mut http1 = hyper::server::conn::http1::Builder::new();
        // The header timeout also closes a keep-alive connection idle that long.
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(bounds.header_timeout)
            .max_buf_size(MAX_HEAD_BYTES);
        let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
            .max_header_list_size(MAX_HEAD_BYTES as u32);
        Builders {
            http1,
            http2,
            idle: bounds.header_timeout,
        }
    }

    /// Serves one connection holding `slot` (its place among
    /// `--max-connections`) until it ends: HTTP/2 when `h2`, closed when
    /// idle past the deadline as the gRPC port's (HTTP/2 has no header read
    /// timeout), else HTTP/1.1.
    async fn serve<I>(
        &self,
        io: I,
        h2: bool,
        slot: OwnedSemaphorePermit,
        service: TowerToHyperService<Router>,
        watcher: hyper_util::server::graceful::Watcher,
    ) -> Served
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        if h2 {
            let io = TokioIo::new(Guarded::new(io, slot, self.idle));
            let conn = self.http2.serve_connection(io, service);
            watcher.watch(conn).await.map_err(Into::into)
        } else {
            let _slot = slot;
            let conn = self.http1.serve_connection(TokioIo::new(io), service);
            watcher.watch(conn).await.map_err(Into::into)
        }
    }
}

/// HTTP/2's connection preface: a client with prior knowledge opens with it.
/// Its first three bytes decide: no HTTP/1.1 request starts with `PRI`
/// (RFC 9113 reserves the method), and hyper's HTTP/2 checks the rest.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const H2_DECIDES: usize = 3;

/// Whether a cleartext connection opens with HTTP/2's preface (h2c with
/// prior knowledge) rather than an HTTP/1.1 request, read without taking
/// the bytes; `None` when it closed, or sent too little to tell within
/// `limit` (as HTTP/1.1's header read timeout).
async fn prior_knowledge(stream: &tokio::net::TcpStream, limit: Duration) -> Option<bool> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = [0u8; H2_DECIDES];
    let mut pause = Duration::from_millis(1);
    loop {
        let n = tokio::time::timeout_at(deadline, stream.peek(&mut buf))
            .await
            .ok()?
            .ok()?;
        let (Some(seen), Some(expected)) = (buf.get(..n), H2_PREFACE.get(..n)) else {
            return None;
        };
        if n == 0 {
            return None;
        }
        if seen != expected {
            return Some(false);
        }
        if n == H2_DECIDES {
            return Some(true);
        }
        // One or two bytes of the preface so far: the peek would return at
        // once (even past the deadline), so wait, longer each time, for the rest.
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + pause)).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Whether a connection ended on a read deadline: hyper's header read
/// timeout, or the idle deadline of [`Guarded`].
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout)
            || e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cause = e.source();
    }
    false
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(ErrorBody::new(message))).into_response()
}

/// Counts and logs (rate-limited) a bad request; the caller's own words are
/// in `message`: escaped. (Also for a gRPC message over its bound,
/// [`crate::rls::wasm`], refused before it reaches a route.)
pub(crate) fn count_bad_request(app: &App, message: &str) {
    app.metrics.check("error");
    app.metrics.error("bad_request");
    if let Some(suppressed) = app.warnings.allow("bad_request") {
        tracing::warn!(error = %Escaped(message), suppressed, "bad request");
    }
}

/// A 404 for a domain no policy names (none at all without `--policy`):
/// counted as an error of its own kind and logged within the warnings' rate
/// limit, since a caller can send it at will. Asked after the token's domain
/// (403), so that a token holder cannot probe which domains exist.
fn unknown_domain(app: &App, e: &UnknownDomain) -> Response {
    app.metrics.check("error");
    app.metrics.error("unknown_domain");
    if let Some(suppressed) = app.warnings.allow("unknown_domain") {
        tracing::warn!(error = %Escaped(e), suppressed, "unknown domain");
    }
    error(StatusCode::NOT_FOUND, e.to_string())
}

/// A 400 or 413 of the body, counted.
fn bad_request(app: &App, status: StatusCode, message: String) -> Response {
    count_bad_request(app, &message);
    error(status, message)
}

/// A body refused: its status (400 or 413) and the message naming the field.
type Refused = (StatusCode, String);

/// A body fault of the request: 400.
fn invalid(message: String) -> Refused {
    (StatusCode::BAD_REQUEST, message)
}

/// A failed check or lease (`what`): counted, logged in full (within the
/// warnings' rate limit), answered 503 with a body that says only that the
/// store failed.
fn unavailable(app: &App, what: &'static str, domain: &str, e: &StoreError) -> Response {
    count_failure(app, what, domain, e);
    error(StatusCode::SERVICE_UNAVAILABLE, STORE_UNAVAILABLE)
}

/// Counts and logs (within the warnings' rate limit) one check, lease or
/// settlement (`what`) that failed in Redis.
fn count_failure(app: &App, what: &'static str, domain: &str, e: &StoreError) {
    app.metrics.check("error");
    app.metrics.error(e.kind());
    // A timeout may come after the script ran, a bad reply surely does: the
    // charge may stand although the caller reads 503 (its failure mode then
    // decides; the charge is not refunded, erring strict). Counted.
    if matches!(e.kind(), "timeout" | "reply") {
        app.metrics
            .charged_then_failed
            .with_label_values(&[e.kind()])
            .inc();
    }
    if let Some(suppressed) = app.warnings.allow(e.kind()) {
        tracing::warn!(
            error = %Escaped(e),
            domain = %Escaped(domain),
            suppressed,
            "{what} failed"
        );
    }
}

/// Counts `charged_then_failed{reason="client_gone"}` when dropped armed:
/// hyper drops a handler whose caller closed the connection, and a handler
/// dropped during its Redis call may have charged for an answer nobody reads.
struct ChargeInFlight<'a> {
    metrics: &'a Metrics,
    armed: bool,
}

impl<'a> ChargeInFlight<'a> {
    fn arm(metrics: &'a Metrics) -> Self {
        ChargeInFlight {
            metrics,
            armed: true,
        }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for ChargeInFlight<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.metrics
                .charged_then_failed
                .with_label_values(&["client_gone"])
                .inc();
        }
    }
}

/// A `/v1/*` call past the steps every one takes: admitted, its body
/// parsed, its domain the token's and one the policy names.
struct Call<T> {
    /// Held until the answer is made (its place among `--max-in-flight`).
    admitted: Admitted,
    req: T,
    /// The policy in force when the call was read.
    policy: Arc<crate::policy::Policy>,
}

/// Admits `req` ([`admit`], its body at most `max_body` bytes), parses its
/// body with `parse` (400, or the status it gives), then checks that the
/// caller's token is for its `domain` (403) and that the policy names that
/// domain (404), in that order for every route; or the answer that refuses
/// it.
async fn admit_call<T>(
    app: &App,
    req: Request,
    max_body: usize,
    parse: fn(&[u8]) -> Result<T, Refused>,
    domain: fn(&T) -> &str,
) -> Result<Call<T>, Response> {
    let admitted = admit(app, req, max_body).await?;
    let req = parse(&admitted.body).map_err(|(status, m)| bad_request(app, status, m))?;
    if !admitted.caller.may_use(domain(&req)) {
        return Err(refuse(app, Refusal::WrongDomain));
    }
    let policy = app.policy.current();
    if let Err(e) = policy.has_domain(domain(&req)) {
        return Err(unknown_domain(app, &e));
    }
    Ok(Call {
        admitted,
        req,
        policy,
    })
}

async fn check(State(app): State<Arc<App>>, req: Request) -> Response {
    // `_admitted` keeps the call's place among `--max-in-flight` to the end.
    let Call {
        admitted: _admitted,
        req,
        policy,
    } = match admit_call(
        &app,
        req,
        MAX_BODY_BYTES,
        |b| protocol::parse_check(b).map_err(invalid),
        |r| &r.domain,
    )
    .await
    {
        Ok(c) => c,
        Err(refused) => return refused,
    };
    // Limits, windows and amounts from the policy: 400 for what it lacks.
    let resolved = match policy.resolve_check(&req) {
        Ok(r) => r,
        Err(message) => return bad_request(&app, StatusCode::BAD_REQUEST, message),
    };
    let in_flight = ChargeInFlight::arm(&app.metrics);
    let result = app.limiter.check(&resolved).await;
    in_flight.disarm();
    match result {
        Ok(answer) => {
            app.metrics
                .check(if answer.allowed { "allowed" } else { "denied" });
            (StatusCode::OK, Json(answer)).into_response()
        }
        Err(e) => unavailable(&app, "check", &req.domain, &e),
    }
}

/// `POST /v3/check`: the checks of one domain, each decided as `/v1/check`
/// decides it alone, in order ([`Limiter::check_batch`]). Every check is
/// resolved before any is decided: a body with one check the policy cannot
/// resolve is refused whole (400, its field path under `checks[c].`),
/// writing nothing. A check's own failure (its Redis call, the key budget)
/// is its result's `error`, the others decided; when every check failed in
/// Redis (none by the key budget) the answer is 503, as `/v1/check`'s.
async fn check_batch(State(app): State<Arc<App>>, req: Request) -> Response {
    // `_admitted` keeps the call's place among `--max-in-flight` to the end.
    let Call {
        admitted: _admitted,
        req,
        policy,
    } = match admit_call(&app, req, MAX_BATCH_BYTES, parse_batch, |r| &r.domain).await {
        Ok(c) => c,
        Err(refused) => return refused,
    };
    let resolved = match policy.resolve_batch(&req) {
        Ok(r) => r,
        Err(message) => return bad_request(&app, StatusCode::BAD_REQUEST, message),
    };
    let in_flight = ChargeInFlight::arm(&app.metrics);
    let answers = app.limiter.check_batch(&resolved).await;
    in_flight.disarm();
    let store_down = answers
        .iter()
        .all(|a| a.as_ref().is_err_and(|e| e.kind() != "key_budget"));
    let mut results = Vec::with_capacity(answers.len());
    for answer in answers {
        match answer {
            Ok(r) => {
                app.metrics
                    .check(if r.allowed { "allowed" } else { "denied" });
                results.push(CheckResult {
                    allowed: r.allowed,
                    buckets: r.buckets,
                    quotas: r.quotas,
                    error: None,
                });
            }
            Err(e) => {
                count_failure(&app, "batched check", &req.domain, &e);
                results.push(CheckResult {
                    allowed: false,
                    buckets: Vec::new(),
                    quotas: Vec::new(),
                    error: Some(e.kind().to_string()),
                });
            }
        }
    }
    if store_down {
        return error(StatusCode::SERVICE_UNAVAILABLE, STORE_UNAVAILABLE);
    }
    let answer = BatchResponse {
        version: protocol::BATCH_VERSION,
        results,
    };
    (StatusCode::OK, Json(answer)).into_response()
}

/// A batch body: 413 for more checks than [`protocol::MAX_BATCH`], 400 for
/// any other fault.
fn parse_batch(body: &[u8]) -> Result<protocol::BatchRequest, Refused> {
    protocol::parse_batch(body).map_err(|e| match e {
        BatchError::TooManyChecks(m) => (StatusCode::PAYLOAD_TOO_LARGE, m),
        BatchError::Invalid(m) => (StatusCode::BAD_REQUEST, m),
    })
}

async fn lease(State(app): State<Arc<App>>, req: Request) -> Response {
    let Call {
        admitted,
        req,
        policy,
    } = match admit_call(
        &app,
        req,
        MAX_BODY_BYTES,
        |b| protocol::parse_lease(b).map_err(invalid),
        |r| &r.domain,
    )
    .await
    {
        Ok(c) => c,
        Err(refused) => return refused,
    };
    let caller = &admitted.caller;
    let resolved = match policy.resolve_lease(&req) {
        Ok(r) => r,
        Err(message) => return bad_request(&app, StatusCode::BAD_REQUEST, message),
    };
    let in_flight = ChargeInFlight::arm(&app.metrics);
    // The ledger of what this caller holds is keyed on its identity.
    let result = app.limiter.lease(&resolved, &caller.id).await;
    in_flight.disarm();
    match result {
        Ok(answer) => {
            app.metrics.check("lease");
            (StatusCode::OK, Json(answer)).into_response()
        }
        Err(e) => unavailable(&app, "lease", &req.domain, &e),
    }
}

/// `POST /v1/settle`: the settlements of one domain, in order, each once.
/// Every settlement is resolved (every rule and quota must settle, every
/// real cost be within the policy's `max`) before any is written: a body
/// with one bad settlement is refused whole, writing nothing.
async fn settle(State(app): State<Arc<App>>, req: Request) -> Response {
    // `_admitted` keeps the call's place among `--max-in-flight` to the end.
    let Call {
        admitted: _admitted,
        req,
        policy,
    } = match admit_call(
        &app,
        req,
        MAX_BODY_BYTES,
        |b| protocol::parse_settle(b).map_err(invalid),
        |r| &r.domain,
    )
    .await
    {
        Ok(c) => c,
        Err(refused) => return refused,
    };
    let mut resolved = Vec::with_capacity(req.settlements.len());
    for (i, s) in req.settlements.iter().enumerate() {
        match policy.resolve_settlement(&req.domain, i, s) {
            Ok(r) => resolved.push(r),
            Err(message) => return bad_request(&app, StatusCode::BAD_REQUEST, message),
        }
    }
    let mut settled = Vec::with_capacity(resolved.len());
    for s in &resolved {
        match app.limiter.settle(s).await {
            Ok(found) => {
                app.metrics
                    .check(if found { "settled" } else { "unsettled" });
                settled.push(found);
            }
            Err(e) => return unavailable(&app, "settle", &req.domain, &e),
        }
    }
    let answer = protocol::SettleResponse {
        version: protocol::VERSION,
        settled,
    };
    (StatusCode::OK, Json(answer)).into_response()
}

/// `GET /healthz` and `GET /readyz`: 200 only when every worker has its
/// connection and a write goes through (`SET <prefix>health:<instance> 1 PX
/// 5000` on the connection the checks use), so a Redis turned replica (`READONLY`) or full under `noeviction`
/// (`OOM`) takes the pod out of service, as an unreachable one does. One
/// probe a second at most, shared by every caller ([`crate::http::health`]).
async fn healthz(State(app): State<Arc<App>>) -> Response {
    let redis = app.health.redis(app.limiter.store()).await;
    let (status, word) = match redis {
        crate::http::health::Redis::Up => (StatusCode::OK, "ok"),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
    };
    (
        status,
        Json(Health {
            status: word.to_string(),
            redis: redis.name().to_string(),
        }),
    )
        .into_response()
}

/// `GET /livez`: the process answers HTTP; never touches Redis, so a Redis
/// outage does not make Kubernetes restart every replica.
async fn livez() -> Response {
    (StatusCode::OK, Json(serde_json::json!({ "status": "ok" }))).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    match app.metrics.render() {
        Ok(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
