//! The filter's own protocol over gRPC: `--grpc-listen` also serves
//! [`SERVICE`] (`ratelimit_wasm.v3.Gateway`), one unary method per HTTP
//! route ([`Method`]: `Check`, `CheckBatch`, `Lease`, `Settle`). A method's
//! request message is its route's JSON request body and its response
//! message the route's 200 body, both carried unchanged ([`JsonCodec`]:
//! JSON, not protobuf). Any other answer of the route is a gRPC status
//! instead: code [`grpc_code`] of the HTTP status, message the `error` of
//! the route's [`ErrorBody`].
//!
//! A call is answered by sending its message through the HTTP routes
//! themselves ([`crate::http::server::router`]), so the in-flight bound, the
//! token, the body bounds, the parse, the domain checks, the policy, Redis
//! and the metrics are the route's own, not a copy that could drift. Two
//! steps come first, as on the rate limit service: [`Gate`] checks the
//! token from the metadata before the message is read, and tonic reads at
//! most [`MAX_BATCH_BYTES`] (the largest route bound; the route then applies
//! its own), a larger message refused `RESOURCE_EXHAUSTED` as the route's
//! 413.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{self, header, HeaderValue, StatusCode};
use bytes::{Buf, BufMut, Bytes};
use http_body_util::BodyExt;
use ratelimit_protocol::grpc::{grpc_code, Method, SERVICE};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{BoxFuture, Service};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::{Code, Status};

use crate::http::server::App;
use crate::protocol::{ErrorBody, MAX_BATCH_BYTES};

/// The service to add to the `--grpc-listen` server: [`Gateway`] behind
/// [`Gate`].
pub fn service(app: Arc<App>) -> InterceptedService<Gateway, Gate> {
    let gate = Gate {
        app: Arc::clone(&app),
    };
    InterceptedService::new(Gateway::new(app), gate)
}

/// A pass-through codec: a message is its bytes, which for [`SERVICE`] are
/// a route's JSON body. Public so that a client (the tests) can speak the
/// service with `tonic::client::Grpc`.
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonCodec;

impl Codec for JsonCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = JsonCodec;
    type Decoder = JsonCodec;

    fn encoder(&mut self) -> JsonCodec {
        JsonCodec
    }

    fn decoder(&mut self) -> JsonCodec {
        JsonCodec
    }
}

impl Encoder for JsonCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for JsonCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        // `src` is exactly one whole message (tonic has framed it).
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// The token check before the message is read: `UNAUTHENTICATED` without a
/// known bearer token in the `authorization` metadata (with
/// `--auth-tokens`), counted in `auth_failures` as the HTTP routes count a
/// 401. No in-flight permit is taken here: the route takes its own.
#[derive(Clone)]
pub struct Gate {
    app: Arc<App>,
}

impl Interceptor for Gate {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        // The route authenticates again (and checks the domain); this only
        // keeps an unknown caller from sending a message at all.
        super::authenticate(&self.app, request.metadata()).map(|_| request)
    }
}

/// [`SERVICE`]: each method's message sent through its HTTP route.
#[derive(Clone)]
pub struct Gateway {
    app: Arc<App>,
    routes: axum::Router,
}

impl Gateway {
    /// The service answering from the routes of `app`.
    pub fn new(app: Arc<App>) -> Gateway {
        let routes = crate::http::server::router(Arc::clone(&app));
        Gateway { app, routes }
    }
}

impl NamedService for Gateway {
    const NAME: &'static str = SERVICE;
}

impl Service<http::Request<tonic::body::Body>> for Gateway {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let Some(method) = Method::from_grpc_path(req.uri().path()) else {
            // As tonic's generated servers answer a method they lack.
            return Box::pin(async {
                let mut response = http::Response::new(tonic::body::Body::default());
                let headers = response.headers_mut();
                headers.insert(Status::GRPC_STATUS, (Code::Unimplemented as i32).into());
                headers.insert(header::CONTENT_TYPE, tonic::metadata::GRPC_CONTENT_TYPE);
                Ok(response)
            });
        };
        let call = Call {
            method,
            routes: self.routes.clone(),
        };
        let app = Arc::clone(&self.app);
        Box::pin(async move {
            let mut grpc =
                Grpc::new(JsonCodec).apply_max_message_size_config(Some(MAX_BATCH_BYTES), None);
            let response = grpc.unary(call, req).await;
            Ok(oversize_as_too_large(&app, response))
        })
    }
}

/// tonic refuses a message over its bound `OUT_OF_RANGE`, which the filter
/// reads as no answer at all ([`ratelimit_protocol::grpc::http_status`]);
/// the route's answer to a body over its bound is 413, so the status is
/// made `RESOURCE_EXHAUSTED` with the route's message, counted as the route
/// counts it. No other `OUT_OF_RANGE` can come: [`grpc_code`] gives none,
/// and no encoding bound is set.
fn oversize_as_too_large(
    app: &App,
    response: http::Response<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    match response.extensions().get::<Status>() {
        Some(s) if s.code() == Code::OutOfRange => {
            let message = format!("body: length limit exceeded ({MAX_BATCH_BYTES} bytes)");
            crate::http::server::count_bad_request(app, &message);
            Status::resource_exhausted(message).into_http()
        }
        _ => response,
    }
}

/// One method's call, answered by its route.
struct Call {
    method: Method,
    routes: axum::Router,
}

impl UnaryService<Bytes> for Call {
    type Response = Bytes;
    type Future = BoxFuture<tonic::Response<Bytes>, Status>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        Box::pin(forward(self.routes.clone(), self.method, request))
    }
}

/// `request` sent as `POST <route>` with its `authorization`, and the
/// route's answer: its 200 body, or the status of any other.
async fn forward(
    mut routes: axum::Router,
    method: Method,
    request: tonic::Request<Bytes>,
) -> Result<tonic::Response<Bytes>, Status> {
    let (metadata, _, message) = request.into_parts();
    let length = HeaderValue::from(message.len());
    let mut req = http::Request::new(axum::body::Body::from(message));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = http::Uri::from_static(method.http_path());
    let headers = req.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CONTENT_LENGTH, length);
    if let Some(token) = metadata.into_headers().remove(header::AUTHORIZATION) {
        headers.insert(header::AUTHORIZATION, token);
    }
    // axum's Router is always ready; asked anyway, as a Service must be.
    let ready =
        std::future::poll_fn(|cx| Service::<axum::extract::Request>::poll_ready(&mut routes, cx));
    let answer = match ready.await {
        Ok(()) => match routes.call(req).await {
            Ok(answer) => answer,
            Err(never) => match never {},
        },
        Err(never) => match never {},
    };
    let (parts, body) = answer.into_parts();
    // The route's own answer, a small JSON value already made: collected whole.
    let body = body
        .collect()
        .await
        .map_err(|e| Status::internal(format!("reading the answer: {e}")))?
        .to_bytes();
    if parts.status == StatusCode::OK {
        return Ok(tonic::Response::new(body));
    }
    Err(refused(parts.status, &body))
}

/// The gRPC status for a route's non-200 answer of `body`.
fn refused(status: StatusCode, body: &[u8]) -> Status {
    let code = Code::from(grpc_code(status.as_u16()) as i32);
    let message = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => e.error,
        Err(_) => status
            .canonical_reason()
            .unwrap_or(status.as_str())
            .to_string(),
    };
    Status::new(code, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_error_body_becomes_the_status_message() {
        let body = serde_json::to_vec(&ErrorBody::new("checks[0].key: required")).unwrap();
        let s = refused(StatusCode::BAD_REQUEST, &body);
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "checks[0].key: required");
        let s = refused(StatusCode::METHOD_NOT_ALLOWED, b"");
        assert_eq!(s.code(), Code::Internal);
        assert_eq!(s.message(), "Method Not Allowed");
        let s = refused(StatusCode::PAYLOAD_TOO_LARGE, b"{\"not\":1}");
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.message(), "Payload Too Large");
    }
}
