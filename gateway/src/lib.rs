//! ratelimit-gateway: a small stateless HTTP service between the
//! `ratelimit-wasm` filter and Redis.
//!
//! [`server`] answers `POST /v1/check` and `POST /v1/lease` ([`protocol`])
//! by running the Lua scripts of [`script`] over the Redis connection of
//! [`redis_store`], under the keys of [`keys`], all or nothing ([`orchestrate`]),
//! counted in [`metrics`].
//! [`rls`] serves Envoy's rate limit service over gRPC beside it
//! (`--grpc-listen`), on the same Redis.
//! `main.rs` only parses [`flags::Args`] and calls [`run`].
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
pub mod deny_cache;
pub mod flags;
pub mod keys;
pub mod logging;
pub mod metrics;
pub mod orchestrate;
pub mod policy;
pub mod protocol;
pub mod redis_store;
pub mod redis_url;
pub mod reload;
pub mod rls;
pub mod script;
pub mod sentinel;
pub mod server;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use auth::Caller;
pub use flags::{Args, Auth, Bounds, Config, RlsOptions};
pub use redis_store::Target;
pub use server::App;

/// Builds the shared state: metrics, the Redis connection (made in the
/// background) and the limiter. Must be called inside a Tokio runtime.
pub fn build(config: &Config) -> Result<Arc<App>> {
    keys::check_prefix(&config.key_prefix).map_err(anyhow::Error::msg)?;
    let metrics = metrics::Metrics::new().context("registering metrics")?;
    let store = redis_store::Store::new(
        config.target.clone(),
        &config.key_prefix,
        &config.redis,
        config.redis_timeout,
        metrics.clone(),
    )
    .map_err(anyhow::Error::msg)?;
    let limiter = orchestrate::Limiter::new(
        store,
        config.key_prefix.clone(),
        metrics.clone(),
        deny_cache::DenyCache::new(config.deny_cache_entries),
    );
    let warnings = logging::Warnings::new(metrics.log_suppressed.clone());
    if config.policy.is_empty() {
        anyhow::bail!(
            "--policy: give the plugin configurations whose limits this gateway enforces"
        );
    }
    let policy = reload::Reloadable::load(
        "policy",
        config.policy.clone(),
        Box::new(policy::parse),
        metrics.clone(),
    )
    .map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    tracing::info!(domains = ?policy.current().domains(), "policy loaded");
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
    Ok(Arc::new(App {
        limiter,
        metrics,
        warnings,
        policy,
        tokens,
        bounds: config.bounds,
        in_flight: Arc::new(tokio::sync::Semaphore::new(config.bounds.max_in_flight)),
    }))
}

/// Starts what runs beside the server (the policy's and the token file's
/// reload tasks) and makes the TLS acceptor; the tasks end when the returned
/// guards drop.
fn prepare(
    config: &Config,
    app: &App,
) -> Result<(Option<tokio_rustls::TlsAcceptor>, Vec<AbortOnDrop>)> {
    let tls = match &config.tls {
        Some(files) => Some(tls::acceptor(files).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let mut watch = vec![AbortOnDrop(app.policy.watch(reload::POLL))];
    watch.extend(
        app.tokens
            .as_ref()
            .map(|t| AbortOnDrop(t.watch(reload::POLL))),
    );
    Ok((tls, watch))
}

/// The rate limit service of `config.rls` when `--grpc-listen` is given: its
/// configuration loaded (an error fails the start, naming the file and
/// field), its reload task added to `watch`, its address bound.
async fn prepare_rls(
    config: &Config,
    app: &Arc<App>,
    watch: &mut Vec<AbortOnDrop>,
) -> Result<Option<(tokio::net::TcpListener, rls::Rls)>> {
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
    )
    .context("registering the rate limit service's metrics")?;
    Ok(Some((rls::bind(addr).await?, service)))
}

/// Serves the rate limit service in a task until `stop` says so.
fn spawn_rls(
    grpc: Option<(tokio::net::TcpListener, rls::Rls)>,
    app: &Arc<App>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Option<JoinHandle<()>> {
    let (listener, service) = grpc?;
    let app = Arc::clone(app);
    Some(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = rls::serve(listener, service, app, shutdown).await {
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

/// Binds `config.listen` and serves until `shutdown` completes.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let app = build(&config)?;
    let (tls, mut watch) = prepare(&config, &app)?;
    let grpc = prepare_rls(&config, &app, &mut watch).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    tracing::info!(
        listen = %config.listen,
        grpc_listen = ?config.rls.grpc_listen,
        target = ?config.target,
        tls = tls.is_some(),
        client_certificates = config.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
        "ratelimit-gateway listening"
    );
    // One shutdown signal for both listeners.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let grpc = spawn_rls(grpc, &app, stopped.clone());
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    let mut http_stopped = stopped;
    server::serve(listener, Arc::clone(&app), tls, async move {
        let _ = http_stopped.wait_for(|s| *s).await;
    })
    .await
    .context("serving")?;
    if let Some(grpc) = grpc {
        let _ = tokio::time::timeout(app.bounds.drain_timeout, grpc).await;
    }
    drop(watch);
    tracing::info!("ratelimit-gateway stopped");
    Ok(())
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
    let grpc = spawn_rls(grpc, &app, grpc_stopped);
    let served = server::serve(listener, Arc::clone(&app), tls, async move {
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
