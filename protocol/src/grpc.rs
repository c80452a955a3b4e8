//! The same calls over gRPC: the gateway's `--grpc-listen` serves
//! [`SERVICE`], one unary method per HTTP route ([`Method`]). A method's
//! request and response messages are the route's JSON bodies, unchanged
//! (gRPC leaves a message's encoding to the service; these are JSON, not
//! protobuf), so a filter that speaks gRPC needs no protobuf of its own.
//!
//! A route's non-200 answer is a gRPC status instead ([`grpc_code`]), and
//! the filter reads a status back as the HTTP status it stands for
//! ([`http_status`]); the gRPC status message is the answer's `error`.

/// The gRPC service name.
pub const SERVICE: &str = "ratelimit_wasm.v3.Gateway";

/// One call of the gateway, by HTTP route and by gRPC method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `POST /v1/check`: one check (version 2).
    Check,
    /// `POST /v3/check`: a batch of checks (version 3).
    CheckBatch,
    /// `POST /v1/lease`: a lease fetch.
    Lease,
    /// `POST /v1/settle`: settlements.
    Settle,
}

impl Method {
    /// Every method.
    pub const ALL: [Method; 4] = [
        Method::Check,
        Method::CheckBatch,
        Method::Lease,
        Method::Settle,
    ];

    /// The gRPC method name within [`SERVICE`].
    pub fn name(self) -> &'static str {
        match self {
            Method::Check => "Check",
            Method::CheckBatch => "CheckBatch",
            Method::Lease => "Lease",
            Method::Settle => "Settle",
        }
    }

    /// The gateway's HTTP route for the same call.
    pub fn http_path(self) -> &'static str {
        match self {
            Method::Check => "/v1/check",
            Method::CheckBatch => "/v3/check",
            Method::Lease => "/v1/lease",
            Method::Settle => "/v1/settle",
        }
    }

    /// The method a gRPC request path (`/<service>/<method>`) names.
    pub fn from_grpc_path(path: &str) -> Option<Method> {
        let name = path
            .strip_prefix('/')?
            .strip_prefix(SERVICE)?
            .strip_prefix('/')?;
        Method::ALL.into_iter().find(|m| m.name() == name)
    }
}

/// gRPC status codes (grpc/grpc `doc/statuscodes.md`) the calls use.
pub mod code {
    /// Success.
    pub const OK: u32 = 0;
    /// The deadline passed before an answer came.
    pub const DEADLINE_EXCEEDED: u32 = 4;
    /// A field at fault: HTTP 400.
    pub const INVALID_ARGUMENT: u32 = 3;
    /// No policy has the domain: HTTP 404.
    pub const NOT_FOUND: u32 = 5;
    /// The token may not act on the domain: HTTP 403.
    pub const PERMISSION_DENIED: u32 = 7;
    /// A message over the size bound, or too many checks: HTTP 413.
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    /// No such method: HTTP 404 of an unknown route.
    pub const UNIMPLEMENTED: u32 = 12;
    /// The gateway failed: HTTP 500.
    pub const INTERNAL: u32 = 13;
    /// Redis failed, or the gateway is busy: HTTP 503.
    pub const UNAVAILABLE: u32 = 14;
    /// No known bearer token: HTTP 401.
    pub const UNAUTHENTICATED: u32 = 16;
}

/// The gRPC status for a route's HTTP status. A status no route answers is
/// `INTERNAL`.
pub fn grpc_code(http: u16) -> u32 {
    match http {
        200 => code::OK,
        400 => code::INVALID_ARGUMENT,
        401 => code::UNAUTHENTICATED,
        403 => code::PERMISSION_DENIED,
        404 => code::NOT_FOUND,
        408 => code::DEADLINE_EXCEEDED,
        413 => code::RESOURCE_EXHAUSTED,
        503 => code::UNAVAILABLE,
        _ => code::INTERNAL,
    }
}

/// The HTTP status a gRPC status stands for, as the filter reads a call's
/// outcome; `None` for no answer (`DEADLINE_EXCEEDED`: the call's timeout,
/// or a status no route gives). `UNAVAILABLE` is also what Envoy says of a
/// gateway it cannot reach: either way a failure, never an answer.
pub fn http_status(grpc: u32) -> Option<u16> {
    match grpc {
        code::OK => Some(200),
        code::INVALID_ARGUMENT => Some(400),
        code::UNAUTHENTICATED => Some(401),
        code::PERMISSION_DENIED => Some(403),
        code::NOT_FOUND | code::UNIMPLEMENTED => Some(404),
        code::RESOURCE_EXHAUSTED => Some(413),
        code::INTERNAL => Some(500),
        code::UNAVAILABLE => Some(503),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_status_reads_back_as_itself() {
        for http in [200, 400, 401, 403, 404, 413, 500, 503] {
            assert_eq!(http_status(grpc_code(http)), Some(http), "{http}");
        }
        // A timeout is no answer, whoever gave it.
        assert_eq!(http_status(grpc_code(408)), None);
        assert_eq!(http_status(code::DEADLINE_EXCEEDED), None);
        assert_eq!(http_status(2), None, "UNKNOWN");
        assert_eq!(grpc_code(502), code::INTERNAL);
    }

    #[test]
    fn a_method_is_found_by_its_full_path_only() {
        for m in Method::ALL {
            let path = format!("/{SERVICE}/{}", m.name());
            assert_eq!(Method::from_grpc_path(&path), Some(m));
        }
        for bad in [
            "/ratelimit_wasm.v3.Gateway/check",
            "/ratelimit_wasm.v3.Gateway/Check/",
            "/ratelimit_wasm.v3.Gateway",
            "/other.Service/Check",
            "ratelimit_wasm.v3.Gateway/Check",
            "/v1/check",
        ] {
            assert_eq!(Method::from_grpc_path(bad), None, "{bad}");
        }
    }
}
