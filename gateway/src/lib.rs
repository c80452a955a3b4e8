//! ratelimit-gateway: a small stateless HTTP service between the
//! `ratelimit-wasm` filter and Redis.
//!
//! The HTTP listener ([`http`]: [`http::server`]) answers `POST /v1/check`
//! and `POST /v1/lease` ([`protocol`]) by running the Lua scripts of
//! [`redis::script`] over the Redis connection of [`redis::store`], under the
//! keys of [`redis::keys`], all or nothing ([`orchestrate`]), at the time of
//! a [`clock`], counted in [`metrics`]. The policy ([`policy`]) and the
//! callers' tokens ([`auth`]) say what is enforced and for whom.
//! [`rls`] serves Envoy's rate limit service over gRPC beside it
//! (`--grpc-listen`), on the same Redis; started with its configuration
//! alone (no `--policy`), the gateway is a drop-in for envoyproxy/ratelimit.
//! The same port serves the HTTP routes' calls over gRPC ([`rls::wasm`]).
//! `main.rs` only parses [`flags::Args`] and calls [`run`].
//!
//! [`run`] serves thread per core: `--worker-threads` threads, each with its
//! own single-threaded Tokio runtime accepting from the shared listening
//! sockets (HTTP and gRPC: whichever thread is free first takes a new
//! connection) and its own Redis connection
//! ([`redis::store`]'s lanes). A request is read, checked in Redis, answered
//! and its memory freed on one thread: no wake-up of another thread per
//! request, and no memory freed on another thread than the one that
//! allocated it (the profile of the earlier layout, one runtime of several
//! workers over one connection, showed both as its largest costs).
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]
#![warn(missing_docs)]

pub mod auth;
pub mod clock;
pub mod deny_cache;
pub mod flags;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod orchestrate;
pub mod policy;
pub mod protocol;
pub mod redis;
pub mod reload;
pub mod rls;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use crate::http::server::App;
pub use crate::redis::store::Target;
pub use auth::Caller;
pub use flags::{Args, Auth, Bounds, Config, RlsOptions};

/// Builds the shared state: metrics, the Redis connection (made in the
/// background) and the limiter. Must be called inside a Tokio runtime,
/// which makes and drives the one Redis connection.
pub fn build(config: &Config) -> Result<Arc<App>> {
    build_on(config, &[Handle::current()])
}

/// [`build`] with one Redis connection per runtime of `runtimes`, made and
/// driven there; a thread takes its connection with
/// [`crate::redis::store::set_lane`].
pub fn build_on(config: &Config, runtimes: &[Handle]) -> Result<Arc<App>> {
    crate::redis::keys::check_prefix(&config.key_prefix).map_err(anyhow::Error::msg)?;
    let metrics = metrics::Metrics::new().context("registering metrics")?;
    let store = crate::redis::store::Store::new(
        config.target.clone(),
        &config.key_prefix,
        &config.redis,
        config.redis_timeout,
        metrics.clone(),
        runtimes,
    )
    .map_err(anyhow::Error::msg)?;
    let limiter = orchestrate::Limiter::new(
        store,
        config.key_prefix.clone(),
        metrics.clone(),
        deny_cache::DenyCache::new(config.deny_cache_entries),
    )
    .with_key_budget(config.key_budget)
    .with_reservation_ttl(u64::try_from(config.reservation_ttl.as_millis()).unwrap_or(u64::MAX));
    let warnings = logging::Warnings::new(metrics.log_suppressed.clone());
    if config.enforces_nothing() {
        anyhow::bail!(flags::NOTHING_TO_ENFORCE);
    }
    // Without --policy, no files: an empty policy, which names no domain (so
    // /v1/* answers 404), and which `prepare` does not watch.
    let policy = reload::Reloadable::load(
        "policy",
        config.policy.clone(),
        Box::new(policy::parse),
        metrics.clone(),
    )
    .map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    if config.policy.is_empty() {
        tracing::info!(
            "no --policy: the rate limit service (--rls-config) alone; /v1/* answers 404 \
             for every domain"
        );
    } else {
        tracing::info!(domains = ?policy.current().domains(), "policy loaded");
    }
    let tokens = match &config.auth {
        flags::Auth::Tokens(path) => {
            let tokens = reload::Reloadable::load(
                "auth_tokens",
                vec![path.clone()],
                Box::new(auth::Tokens::parse),
                metrics.clone(),
            )
            .map_err(|e| anyhow::anyhow!("--auth-tokens: {e}"))?;
            tracing::info!(callers = tokens.current().len(), "caller tokens loaded");
            Some(tokens)
        }
        flags::Auth::Insecure => {
            tracing::warn!(
                "--insecure-no-auth: /v1/* answers anyone who can reach this port; \
                 give --auth-tokens in production"
            );
            None
        }
    };
    let http_slots = crate::http::conn::Slots::new(
        config.bounds.max_connections,
        metrics.connections_refused.with_label_values(&["http"]),
    );
    let grpc_slots = crate::http::conn::Slots::new(
        config.bounds.max_connections,
        metrics.connections_refused.with_label_values(&["grpc"]),
    );
    Ok(Arc::new(App {
        limiter,
        metrics,
        warnings,
        policy,
        tokens,
        bounds: config.bounds,
        in_flight: Arc::new(tokio::sync::Semaphore::new(config.bounds.max_in_flight)),
        health: crate::http::health::Probe::default(),
        http_slots,
        grpc_slots,
    }))
}

/// The TLS acceptors of the two listeners (`None`: plaintext): the same
/// certificate and client CA, each with its own ALPN.
#[derive(Clone, Default)]
struct Acceptors {
    http: Option<tokio_rustls::TlsAcceptor>,
    grpc: Option<tokio_rustls::TlsAcceptor>,
}

/// Starts what runs beside the server (the reload tasks of the policy, when
/// `--policy` is given, and of the token file) and makes the TLS acceptor; the tasks end when the returned
/// guards drop.
fn prepare(config: &Config, app: &App) -> Result<(Acceptors, Vec<AbortOnDrop>)> {
    let tls = match &config.tls {
        Some(files) => Acceptors {
            http: Some(
                crate::http::tls::acceptor(files, crate::http::tls::Alpn::Http)
                    .map_err(anyhow::Error::msg)?,
            ),
            grpc: Some(
                crate::http::tls::acceptor(files, crate::http::tls::Alpn::H2)
                    .map_err(anyhow::Error::msg)?,
            ),
        },
        None => Acceptors::default(),
    };
    let mut watch = Vec::new();
    // No --policy: no files to watch. SIGHUP still has a handler (else it
    // would end the process): `--rls-config`'s reloader, which such a start has.
    if !config.policy.is_empty() {
        watch.push(AbortOnDrop(app.policy.watch(reload::POLL)));
    }
    watch.extend(
        app.tokens
            .as_ref()
            .map(|t| AbortOnDrop(t.watch(reload::POLL))),
    );
    Ok((tls, watch))
}

/// The rate limit service of `config.rls` when `--grpc-listen` is given: its
/// configuration loaded (an error fails the start, naming the file and
/// field), its reload task added to `watch`.
fn load_rls(
    config: &Config,
    app: &Arc<App>,
    watch: &mut Vec<AbortOnDrop>,
) -> Result<Option<(SocketAddr, rls::Rls)>> {
    let Some(addr) = config.rls.grpc_listen else {
        return Ok(None);
    };
    let loaded = reload::Reloadable::load_files(
        "rls_config",
        config.rls.config.clone(),
        &["yaml", "yml"],
        Box::new(rls::config::parse),
        app.metrics.clone(),
    )
    .map_err(|e| anyhow::anyhow!("--rls-config: {e}"))?;
    tracing::info!(domains = ?loaded.current().domains(), "rls config loaded");
    watch.push(AbortOnDrop(loaded.watch(reload::POLL)));
    let service = rls::Rls::new(
        Arc::clone(app),
        loaded,
        config.rls.near_limit_permille as f32 / 1000.0,
        config.key_prefix.clone(),
        config.rls.allow_overrides,
    )
    .context("registering the rate limit service's metrics")?;
    Ok(Some((addr, service)))
}

/// [`load_rls`], its address bound in the current runtime.
async fn prepare_rls(
    config: &Config,
    app: &Arc<App>,
    watch: &mut Vec<AbortOnDrop>,
) -> Result<Option<(tokio::net::TcpListener, rls::Rls)>> {
    match load_rls(config, app, watch)? {
        Some((addr, service)) => Ok(Some((rls::bind(addr).await?, service))),
        None => Ok(None),
    }
}

/// One listening socket on `addr`, registered with each runtime of
/// `runtimes`: every worker accepts from the same socket, and whichever is
/// free first takes a new connection. Not `SO_REUSEPORT`, which would let
/// another process of the same user bind the port beside the gateway and
/// take a share of its callers. A bind error names `flag`.
fn bind_each(
    addr: SocketAddr,
    runtimes: &[Runtime],
    flag: &str,
) -> Result<Vec<tokio::net::TcpListener>> {
    let first = runtimes.first().context("no worker runtime")?;
    let bound = (|| {
        // A tokio listener registers with a runtime; any will do, since it
        // is taken back out as a plain socket right away.
        let _entered = first.enter();
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // Lets a restarted gateway bind while old connections sit in TIME_WAIT.
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(1024)?.into_std()
    })()
    .with_context(|| format!("binding {addr} ({flag})"))?;
    runtimes
        .iter()
        .map(|runtime| {
            let _entered = runtime.enter();
            let mine = bound.try_clone()?;
            mine.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(mine)
        })
        .collect::<std::io::Result<Vec<_>>>()
        .with_context(|| format!("listening on {addr} ({flag})"))
}

/// Serves the rate limit service in a task until `stop` says so.
fn spawn_rls(
    grpc: Option<(tokio::net::TcpListener, rls::Rls)>,
    app: &Arc<App>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Option<JoinHandle<()>> {
    let (listener, service) = grpc?;
    let app = Arc::clone(app);
    Some(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = rls::serve(listener, service, app, tls, shutdown).await {
            tracing::error!(error = %e, "the rate limit service (--grpc-listen) failed");
        }
    }))
}

/// Aborts a background task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Binds `config.listen` (and `--grpc-listen`) once per worker thread
/// (`config.worker_threads`, each with its own runtime and Redis connection)
/// and serves until `shutdown` completes; then every thread drains within
/// the drain deadline. The reload tasks run on the caller's runtime.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let workers = config.worker_threads.max(1);
    let mut runtimes = Runtimes(
        (0..workers)
            .map(|_| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("starting a worker's runtime")
            })
            .collect::<Result<Vec<Runtime>>>()?,
    );
    let handles: Vec<Handle> = runtimes.0.iter().map(|r| r.handle().clone()).collect();
    let app = build_on(&config, &handles)?;
    let (tls, mut watch) = prepare(&config, &app)?;
    let rls = load_rls(&config, &app, &mut watch)?;
    let http = bind_each(config.listen, &runtimes.0, "--listen")?;
    let mut grpc: Vec<Option<tokio::net::TcpListener>> = match &rls {
        Some((addr, _)) => bind_each(*addr, &runtimes.0, "--grpc-listen")?
            .into_iter()
            .map(Some)
            .collect(),
        None => (0..workers).map(|_| None).collect(),
    };
    tracing::info!(
        listen = %config.listen,
        grpc_listen = ?config.rls.grpc_listen,
        target = ?config.target,
        tls = tls.http.is_some(),
        client_certificates = config.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
        worker_threads = workers,
        "ratelimit-gateway listening"
    );
    // One shutdown signal for every thread and both listeners.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut done = Vec::with_capacity(workers);
    let runtimes = std::mem::take(&mut runtimes.0);
    for (lane, (runtime, listener)) in runtimes.into_iter().zip(http).enumerate() {
        let grpc = match (grpc.get_mut(lane).and_then(Option::take), &rls) {
            (Some(l), Some((_, service))) => Some((l, service.clone())),
            _ => None,
        };
        let (app, tls, stopped) = (Arc::clone(&app), tls.clone(), stopped.clone());
        let (finished, finished_rx) = oneshot::channel();
        // In a guard until the thread has it: a failed spawn drops it here.
        let mut mine = Runtimes(vec![runtime]);
        std::thread::Builder::new()
            .name(format!("rlgw-worker-{lane}"))
            .spawn(move || {
                crate::redis::store::set_lane(lane);
                if let Some(runtime) = mine.0.pop() {
                    let served = runtime.block_on(worker(listener, grpc, app, tls, stopped));
                    let _ = finished.send(served);
                }
            })
            .context("starting a worker thread")?;
        done.push(finished_rx);
    }
    drop(rls);
    shutdown.await;
    let _ = stop.send(true);
    let mut result = Ok(());
    for finished in done {
        match finished.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => result = Err(e).context("serving"),
            Err(_) => result = Err(anyhow::anyhow!("a worker thread ended early")),
        }
    }
    drop(watch);
    tracing::info!("ratelimit-gateway stopped");
    result
}

/// Worker runtimes not yet running on their threads. Dropped in the
/// caller's async context (a start-up error such as a port in use), a Tokio
/// runtime panics, so these shut down in the background instead.
struct Runtimes(Vec<Runtime>);

impl Drop for Runtimes {
    fn drop(&mut self) {
        for runtime in self.0.drain(..) {
            runtime.shutdown_background();
        }
    }
}

/// One worker thread's servers: HTTP on `listener`, the rate limit service
/// on `grpc` when given, until `stopped` turns true; then drains.
async fn worker(
    listener: tokio::net::TcpListener,
    grpc: Option<(tokio::net::TcpListener, rls::Rls)>,
    app: Arc<App>,
    tls: Acceptors,
    stopped: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let grpc = spawn_rls(grpc, &app, tls.grpc, stopped.clone());
    let mut http_stopped = stopped;
    let served = crate::http::server::serve(listener, Arc::clone(&app), tls.http, async move {
        let _ = http_stopped.wait_for(|s| *s).await;
    })
    .await;
    if let Some(grpc) = grpc {
        let _ = tokio::time::timeout(app.bounds.drain_timeout, grpc).await;
    }
    served
}

/// A server running in this process (for tests): stops when dropped.
pub struct Running {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// Its shared state.
    pub app: Arc<App>,
    /// The address of the rate limit service (`--grpc-listen`), when served.
    pub grpc_addr: Option<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Running {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, finishes the requests in flight and waits for the end.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.context("server task")?.context("serving")?;
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Starts a server on `config.listen` (port 0 picks a free one) in the
/// current runtime and waits up to `connect_wait` for its first Redis
/// connection.
pub async fn start(config: Config, connect_wait: std::time::Duration) -> Result<Running> {
    let app = build(&config)?;
    let (tls, mut watch) = prepare(&config, &app)?;
    let grpc = prepare_rls(&config, &app, &mut watch).await?;
    let grpc_addr = match &grpc {
        Some((l, _)) => Some(l.local_addr()?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    let addr = listener.local_addr()?;
    app.limiter.store().wait_connected(connect_wait).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let (grpc_stop, grpc_stopped) = tokio::sync::watch::channel(false);
    let grpc = spawn_rls(grpc, &app, tls.grpc, grpc_stopped);
    let served = crate::http::server::serve(listener, Arc::clone(&app), tls.http, async move {
        let _ = stopped.await;
        let _ = grpc_stop.send(true);
    });
    let task = tokio::spawn(async move {
        let _watch = watch;
        let r = served.await;
        if let Some(grpc) = grpc {
            let _ = grpc.await;
        }
        r
    });
    Ok(Running {
        addr,
        grpc_addr,
        app,
        stop: Some(stop),
        task: Some(task),
    })
}
