//! The HTTP side: `POST /v1/check`, `POST /v1/lease`, `GET /healthz`,
//! `GET /metrics`.

use std::future::Future;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::limiter::Limiter;
use crate::logging::{Escaped, Warnings};
use crate::metrics::Metrics;
use crate::protocol::{self, ErrorBody, Health, STORE_UNAVAILABLE};
use crate::store::StoreError;

/// Largest accepted request body. A maximal valid request (64 buckets with
/// 512-byte keys and tags and 8 limits each, and 64 quotas with 512-byte keys
/// and tags) is about 210 KiB.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// What the handlers share.
pub struct App {
    /// The check logic and its Redis connection.
    pub limiter: Limiter,
    /// The metrics registry.
    pub metrics: Metrics,
    /// The rate limit of the warnings callers cause.
    pub warnings: Warnings,
    /// The policy in force (`--policy`), reloaded on SIGHUP and file changes.
    pub policy: Arc<crate::reload::Reloadable<crate::policy::Policy>>,
}

/// The routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/check", post(check))
        .route("/v1/lease", post(lease))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

/// Serves until `shutdown` completes, then finishes the requests in flight.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(app))
        .with_graceful_shutdown(shutdown)
        .await
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(ErrorBody::new(message))).into_response()
}

/// A failed check or lease (`what`): counted, logged in full (within the
/// warnings' rate limit), answered 503 with a body that says only that the
/// store failed.
fn unavailable(app: &App, what: &'static str, domain: &str, e: &StoreError) -> Response {
    app.metrics.check("error");
    app.metrics.error(e.kind());
    if let Some(suppressed) = app.warnings.allow(e.kind()) {
        tracing::warn!(
            error = %Escaped(e),
            domain = %Escaped(domain),
            suppressed,
            "{what} failed"
        );
    }
    error(StatusCode::SERVICE_UNAVAILABLE, STORE_UNAVAILABLE)
}

/// Reads and parses a body with `parse`; on failure, the status and message
/// of the error answer (counted as a bad request).
fn read_body<T>(
    app: &App,
    body: Result<Bytes, BytesRejection>,
    parse: fn(&[u8]) -> Result<T, String>,
) -> Result<T, (StatusCode, String)> {
    let bad = |status, message: String| {
        app.metrics.check("error");
        app.metrics.error("bad_request");
        // The caller's own words are in `message`: escaped, and rate-limited.
        if let Some(suppressed) = app.warnings.allow("bad_request") {
            tracing::warn!(error = %Escaped(&message), suppressed, "bad request");
        }
        (status, message)
    };
    let body = body.map_err(|e| bad(e.status(), format!("body: {}", e.body_text())))?;
    parse(&body).map_err(|message| bad(StatusCode::BAD_REQUEST, message))
}

/// A 400 for what the policy does not have, counted as a bad request.
fn policy_refusal(app: &App, message: String) -> Response {
    app.metrics.check("error");
    app.metrics.error("bad_request");
    if let Some(suppressed) = app.warnings.allow("bad_request") {
        tracing::warn!(error = %Escaped(&message), suppressed, "bad request");
    }
    error(StatusCode::BAD_REQUEST, message)
}

async fn check(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let req = match read_body(&app, body, protocol::parse_check) {
        Ok(r) => r,
        Err((status, message)) => return error(status, message),
    };
    // Limits, windows and amounts from the policy: 400 for what it lacks.
    let resolved = match app.policy.current().resolve_check(&req) {
        Ok(r) => r,
        Err(message) => return policy_refusal(&app, message),
    };
    match app.limiter.check(&resolved).await {
        Ok(answer) => {
            app.metrics
                .check(if answer.allowed { "allowed" } else { "denied" });
            (StatusCode::OK, Json(answer)).into_response()
        }
        Err(e) => unavailable(&app, "check", &req.domain, &e),
    }
}

async fn lease(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let req = match read_body(&app, body, protocol::parse_lease) {
        Ok(r) => r,
        Err((status, message)) => return error(status, message),
    };
    let resolved = match app.policy.current().resolve_lease(&req) {
        Ok(r) => r,
        Err(message) => return policy_refusal(&app, message),
    };
    // One ledger for every caller until callers are authenticated.
    match app.limiter.lease(&resolved, "anonymous").await {
        Ok(answer) => {
            app.metrics.check("lease");
            (StatusCode::OK, Json(answer)).into_response()
        }
        Err(e) => unavailable(&app, "lease", &req.domain, &e),
    }
}

async fn healthz(State(app): State<Arc<App>>) -> Response {
    match app.limiter.store().ping().await {
        Ok(()) => (
            StatusCode::OK,
            Json(Health {
                status: "ok".to_string(),
                redis: "up".to_string(),
            }),
        )
            .into_response(),
        Err(e) => {
            tracing::debug!(error = %Escaped(&e), "health check: Redis down");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(Health {
                    status: "unavailable".to_string(),
                    redis: "down".to_string(),
                }),
            )
                .into_response()
        }
    }
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
