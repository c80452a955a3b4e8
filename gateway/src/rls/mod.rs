//! The gRPC listener (`--grpc-listen`): Envoy's rate limit service protocol,
//! the filter's own protocol, and the gRPC health service, beside the HTTP
//! listener, on the same Redis and Lua.
//!
//! `envoy.service.ratelimit.v3.RateLimitService` lets the native
//! `envoy.filters.http.ratelimit` filter (and Envoy Gateway, Contour, Gloo)
//! use this gateway in place of envoyproxy/ratelimit: [`config`] reads
//! envoyproxy/ratelimit's YAML (`--rls-config`, reloaded like the policy)
//! and finds a descriptor's limit as they do; [`service`] answers
//! `ShouldRateLimit`; [`metrics`] counts per descriptor as they do.
//!
//! `ratelimit_wasm.v3.Gateway` ([`wasm`]) is the filter's protocol over
//! gRPC: one unary method per HTTP route, its messages the routes' JSON
//! bodies, each call answered by the route itself.

pub mod config;
pub mod metrics;
pub mod service;
pub mod wasm;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tonic::service::interceptor::InterceptedService;

use crate::http::conn::Guarded;

pub use config::RlsConfig;
pub use service::Rls;

/// How often the gRPC health service's status follows the shared Redis
/// write probe ([`crate::http::health`]).
pub const HEALTH_POLL: Duration = crate::http::health::EVERY;

/// Largest number of concurrent streams one HTTP/2 connection may open.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 128;

/// Serves the rate limit service, the filter's protocol ([`wasm`]) and the
/// gRPC health service on `listener` (over TLS when `tls` is given) until
/// `shutdown` completes, with the bounds of the HTTP listener:
/// `--max-connections` ([`crate::http::conn`]), an idle deadline and a TLS
/// handshake deadline of `--header-timeout-ms`, a deadline of the header
/// and body timeouts on each call, streams per connection, and the token
/// checked from the metadata before the message is read ([`Rls::admit`],
/// [`wasm::Gate`]). A rate limit service message is at most
/// `MAX_BODY_BYTES`, under `--max-in-flight` taken by [`Rls::admit`]; a
/// [`wasm`] message is at most `MAX_BATCH_BYTES`, then bounded by its HTTP
/// route (which takes its own in-flight place). The health status of both
/// services (and of the server, `""`) is `SERVING` while the shared Redis
/// probe ([`crate::http::health`]) finds a write goes through, as `/healthz`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    rls: Rls,
    app: Arc<crate::App>,
    tls: Option<TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let probe_app = Arc::clone(&app);
    let probe: JoinHandle<()> = tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEALTH_POLL);
        loop {
            tick.tick().await;
            let up = probe_app.health.redis(probe_app.limiter.store()).await
                == crate::http::health::Redis::Up;
            for name in [
                "",
                "envoy.service.ratelimit.v3.RateLimitService",
                ratelimit_protocol::grpc::SERVICE,
            ] {
                let status = if up {
                    tonic_health::ServingStatus::Serving
                } else {
                    tonic_health::ServingStatus::NotServing
                };
                reporter.set_service_status(name, status).await;
            }
        }
    });
    let bounds = app.bounds;
    let filter = wasm::service(Arc::clone(&app));
    let gate = rls.clone();
    let service = InterceptedService::new(
        RateLimitServiceServer::new(rls)
            .max_decoding_message_size(crate::http::server::MAX_BODY_BYTES),
        move |request| gate.admit(request),
    );
    let served = tonic::transport::Server::builder()
        .timeout(bounds.header_timeout + bounds.body_timeout)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_max_header_list_size(crate::http::server::MAX_HEAD_BYTES as u32)
        .add_service(health)
        .add_service(service)
        .add_service(filter)
        .serve_with_incoming_shutdown(accepted(listener, app, tls), shutdown)
        .await;
    probe.abort();
    served
}

/// The caller a gRPC call's `authorization` metadata names (`None` without
/// `--auth-tokens`), or `UNAUTHENTICATED`, counted in `auth_failures` by
/// reason as the HTTP routes count a 401.
fn authenticate(
    app: &crate::App,
    metadata: &tonic::metadata::MetadataMap,
) -> Result<Option<crate::auth::Caller>, tonic::Status> {
    let Some(tokens) = &app.tokens else {
        return Ok(None);
    };
    let value = metadata.get("authorization").map(|v| v.as_bytes());
    match tokens.current().authenticate(value) {
        Ok(caller) => Ok(Some(caller)),
        Err(refusal) => {
            app.metrics
                .auth_failures
                .with_label_values(&[refusal.label()])
                .inc();
            Err(tonic::Status::unauthenticated(
                "authorization: a known bearer token is required",
            ))
        }
    }
}

/// A connection's stream, plain or TLS.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// The connections of `listener` that found a place among
/// `--max-connections` (the others are closed at once, counted) and
/// finished their TLS handshake within `--header-timeout-ms`; each is closed
/// when idle that long. Handshakes run in tasks of their own, so a slow one
/// holds up no other.
fn accepted(
    listener: tokio::net::TcpListener,
    app: Arc<crate::App>,
    tls: Option<TlsAcceptor>,
) -> impl futures_util::Stream<Item = std::io::Result<Guarded<Box<dyn Io>>>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Guarded<Box<dyn Io>>>(64);
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                () = tx.closed() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed (--grpc-listen)");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = app.grpc_slots.take() else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let (tx, tls, app) = (tx.clone(), tls.clone(), Arc::clone(&app));
            tokio::spawn(async move {
                let idle = app.bounds.header_timeout;
                let io: Box<dyn Io> = match tls {
                    None => Box::new(stream),
                    Some(acceptor) => {
                        match tokio::time::timeout(idle, acceptor.accept(stream)).await {
                            Ok(Ok(s)) => Box::new(s),
                            Ok(Err(e)) => {
                                tracing::debug!(error = %e, "TLS handshake failed (--grpc-listen)");
                                return;
                            }
                            Err(_) => {
                                app.metrics
                                    .read_timeouts
                                    .with_label_values(&["handshake"])
                                    .inc();
                                return;
                            }
                        }
                    }
                };
                let _ = tx.send(Guarded::new(io, slot, idle)).await;
            });
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|conn| (Ok(conn), rx))
    })
}

/// Binds `addr` for [`serve`] (a bind error names the flag).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context;
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr} (--grpc-listen)"))
}
