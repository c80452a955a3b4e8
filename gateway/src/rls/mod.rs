//! Envoy's rate limit service protocol: `--grpc-listen` serves
//! `envoy.service.ratelimit.v3.RateLimitService` (and the gRPC health
//! service) beside the HTTP listener, on the same Redis and Lua, so the
//! native `envoy.filters.http.ratelimit` filter (and Envoy Gateway, Contour,
//! Gloo) can use this gateway in place of envoyproxy/ratelimit.
//!
//! [`config`] reads envoyproxy/ratelimit's YAML (`--rls-config`, reloaded
//! like the policy) and finds a descriptor's limit as they do; [`service`]
//! answers `ShouldRateLimit`; [`metrics`] counts per descriptor as they do.

pub mod config;
pub mod metrics;
pub mod service;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tokio::task::JoinHandle;

pub use config::RlsConfig;
pub use service::Rls;

/// How often the gRPC health service's status follows the shared Redis
/// write probe ([`crate::health`]).
pub const HEALTH_POLL: Duration = crate::health::EVERY;

/// Serves the rate limit service and the gRPC health service on `listener`
/// until `shutdown` completes. The health status of the rate limit service
/// (and of the server, `""`) is `SERVING` while a write to Redis goes
/// through, as `/healthz`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    rls: Rls,
    app: Arc<crate::App>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let probe: JoinHandle<()> = tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEALTH_POLL);
        loop {
            tick.tick().await;
            let up = app.health.redis(app.limiter.store()).await == crate::health::Redis::Up;
            for name in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
                let status = if up {
                    tonic_health::ServingStatus::Serving
                } else {
                    tonic_health::ServingStatus::NotServing
                };
                reporter.set_service_status(name, status).await;
            }
        }
    });
    let served = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RateLimitServiceServer::new(rls))
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await;
    probe.abort();
    served
}

/// Binds `addr` for [`serve`] (a bind error names the flag).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context;
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr} (--grpc-listen)"))
}
