//! Configuration files reloaded in place: one helper for every file the
//! gateway reads at start and keeps in force (the policy, the caller tokens).
//!
//! [`Reloadable::load`] reads the paths (each a file, or a directory whose
//! `*.json` files are read in name order; names starting with `.` are
//! skipped, such as a Kubernetes ConfigMap's `..data`) and parses them once:
//! an error there fails the start. [`Reloadable::watch`] then reloads on
//! SIGHUP and when a file's content changes, checked every [`POLL`]. A
//! reload that fails keeps the value in force, logs the error (the parse
//! function's field path, escaped) and counts
//! `ratelimit_gateway_reload_failures_total{what}`; one that succeeds swaps
//! the value atomically and counts `ratelimit_gateway_reloads_total{what}`.
//!
//! Polling instead of inotify (`notify`): a ConfigMap update swaps a
//! symlinked directory, which inotify watches on the files miss; reading a
//! few small files once a second costs nothing, and needs no dependency.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::task::JoinHandle;

use crate::logging::Escaped;
use crate::metrics::Metrics;

/// How often the files are read to see whether they changed.
pub const POLL: Duration = Duration::from_secs(1);

/// One file read: its path and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The file, as found (a directory's entry joined to it).
    pub path: PathBuf,
    /// Its content.
    pub bytes: Vec<u8>,
}

/// Turns every file read into the value kept in force; the error should
/// name the file and the field path (`<file>: <field>: <reason>`).
pub type Parse<T> = dyn Fn(&[Source]) -> Result<T, String> + Send + Sync;

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The files were as last read: nothing done.
    Unchanged,
    /// The new value is in force.
    Reloaded,
    /// The files could not be read or parsed: the old value stays in force.
    Failed(String),
}

/// A value parsed from files, swapped atomically on reload.
pub struct Reloadable<T> {
    what: &'static str,
    paths: Vec<PathBuf>,
    /// The file extensions read from a directory.
    extensions: &'static [&'static str],
    parse: Box<Parse<T>>,
    current: ArcSwap<T>,
    /// What the last read found (files or a read error), to see a change.
    seen: Mutex<Result<Vec<Source>, String>>,
    metrics: Metrics,
}

impl<T: Send + Sync + 'static> Reloadable<T> {
    /// Reads and parses `paths`; an error names the file and field. `what`
    /// labels the metrics and the log (e.g. `policy`, `auth_tokens`).
    pub fn load(
        what: &'static str,
        paths: Vec<PathBuf>,
        parse: Box<Parse<T>>,
        metrics: Metrics,
    ) -> Result<Arc<Self>, String> {
        Self::load_files(what, paths, &["json"], parse, metrics)
    }

    /// As [`Reloadable::load`], reading the files of a directory whose
    /// extension is one of `extensions` (e.g. `["yaml", "yml"]`).
    pub fn load_files(
        what: &'static str,
        paths: Vec<PathBuf>,
        extensions: &'static [&'static str],
        parse: Box<Parse<T>>,
        metrics: Metrics,
    ) -> Result<Arc<Self>, String> {
        let sources = read_sources_with(&paths, extensions)?;
        let value = parse(&sources)?;
        Ok(Arc::new(Reloadable {
            what,
            paths,
            extensions,
            parse,
            current: ArcSwap::from_pointee(value),
            seen: Mutex::new(Ok(sources)),
            metrics,
        }))
    }

    /// The value in force (cheap: one atomic load and a reference count).
    pub fn current(&self) -> Arc<T> {
        self.current.load_full()
    }

    /// Reads the files again and, when they changed (or always, with
    /// `force`), parses them and puts the result in force. Logs and counts.
    pub fn reload(&self, force: bool) -> Outcome {
        let read = read_sources_with(&self.paths, self.extensions);
        {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if !force && *seen == read {
                return Outcome::Unchanged;
            }
            *seen = read.clone();
        }
        match read.and_then(|sources| (self.parse)(&sources)) {
            Ok(value) => {
                self.current.store(Arc::new(value));
                self.metrics.reloads.with_label_values(&[self.what]).inc();
                tracing::info!(what = self.what, "reloaded");
                Outcome::Reloaded
            }
            Err(e) => {
                self.metrics
                    .reload_failures
                    .with_label_values(&[self.what])
                    .inc();
                tracing::warn!(what = self.what, error = %Escaped(&e), "reload failed; the previous value stays in force");
                Outcome::Failed(e)
            }
        }
    }

    /// Reloads on SIGHUP (always) and every `poll` when a file changed,
    /// until the returned task is aborted.
    pub fn watch(self: &Arc<Self>, poll: Duration) -> JoinHandle<()> {
        let this = Arc::clone(self);
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, what = this.what, "cannot listen for SIGHUP; reloading on file changes only");
                None
            }
        };
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(poll);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let force = tokio::select! {
                    _ = tick.tick() => false,
                    Some(()) = async {
                        match hangup.as_mut() {
                            Some(s) => s.recv().await,
                            None => std::future::pending().await,
                        }
                    } => true,
                };
                // Reading files blocks: off the runtime's worker threads.
                let r = Arc::clone(&this);
                let _ = tokio::task::spawn_blocking(move || r.reload(force)).await;
            }
        })
    }
}

/// Every file of `paths`: a file as given, a directory's files with one of
/// `extensions` in name order (the policy's: `json`). A directory without one
/// is an error (an empty policy refuses all).
pub fn read_sources_with(paths: &[PathBuf], extensions: &[&str]) -> Result<Vec<Source>, String> {
    let mut out = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| is_config_file(p, extensions))
                .collect();
            if files.is_empty() {
                let names: Vec<String> = extensions.iter().map(|e| format!("*.{e}")).collect();
                return Err(format!(
                    "{}: no {} file",
                    path.display(),
                    names.join(" or ")
                ));
            }
            files.sort();
            for f in files {
                out.push(read(&f)?);
            }
        } else {
            out.push(read(path)?);
        }
    }
    Ok(out)
}

fn is_config_file(p: &Path, extensions: &[&str]) -> bool {
    let visible = p
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| !n.starts_with('.'));
    visible
        && p.extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| extensions.contains(&e))
        && p.is_file()
}

fn read(path: &Path) -> Result<Source, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Source {
        path: path.to_path_buf(),
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rlgw-reload-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Sums the numbers of every file; a file that is not a number fails.
    fn sum() -> Box<Parse<u64>> {
        Box::new(|sources| {
            let mut total = 0;
            for s in sources {
                let text = String::from_utf8_lossy(&s.bytes);
                total += text
                    .trim()
                    .parse::<u64>()
                    .map_err(|e| format!("{}: value: {e}", s.path.display()))?;
            }
            Ok(total)
        })
    }

    #[test]
    fn a_directory_reloads_on_change_and_keeps_the_old_value_on_error() {
        let d = dir("dir");
        std::fs::write(d.join("a.json"), "1").unwrap();
        std::fs::write(d.join("b.json"), "2").unwrap();
        std::fs::write(d.join("c.txt"), "x").unwrap();
        std::fs::write(d.join(".hidden.json"), "x").unwrap();
        let m = Metrics::new().unwrap();
        let r = Reloadable::load("policy", vec![d.clone()], sum(), m.clone()).unwrap();
        assert_eq!(*r.current(), 3);
        assert_eq!(r.reload(false), Outcome::Unchanged);
        std::fs::write(d.join("b.json"), "20").unwrap();
        assert_eq!(r.reload(false), Outcome::Reloaded);
        assert_eq!(*r.current(), 21);
        std::fs::write(d.join("b.json"), "oops").unwrap();
        let Outcome::Failed(e) = r.reload(false) else {
            panic!("should fail")
        };
        assert!(
            e.ends_with("b.json: value: invalid digit found in string"),
            "{e}"
        );
        assert_eq!(*r.current(), 21);
        // The same broken content is not read as a change again; SIGHUP forces.
        assert_eq!(r.reload(false), Outcome::Unchanged);
        assert!(matches!(r.reload(true), Outcome::Failed(_)));
        std::fs::remove_file(d.join("b.json")).unwrap();
        assert_eq!(r.reload(false), Outcome::Reloaded);
        assert_eq!(*r.current(), 1);
        let ok = m.reloads.with_label_values(&["policy"]).get();
        let failed = m.reload_failures.with_label_values(&["policy"]).get();
        assert_eq!((ok, failed), (2, 2));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_start_with_a_broken_or_missing_file_fails() {
        let d = dir("start");
        std::fs::write(d.join("a.json"), "x").unwrap();
        let m = Metrics::new().unwrap();
        let e = Reloadable::load("policy", vec![d.join("a.json")], sum(), m.clone())
            .err()
            .unwrap();
        assert!(
            e.ends_with("a.json: value: invalid digit found in string"),
            "{e}"
        );
        let e = Reloadable::load("policy", vec![d.join("none.json")], sum(), m.clone())
            .err()
            .unwrap();
        assert!(e.contains("none.json: "), "{e}");
        std::fs::remove_file(d.join("a.json")).unwrap();
        let e = Reloadable::load("policy", vec![d.clone()], sum(), m)
            .err()
            .unwrap();
        assert!(e.ends_with(": no *.json file"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
