//! One child process of a test — Envoy, `ratelimit-gateway` or
//! `redis-server` — started, waited for, retried, stopped and logged the same
//! way.
//!
//! * [`Process::spawn`]: stdin closed, stdout and stderr appended to one log
//!   file, its own process group (a Ctrl-C in a terminal reaches only the
//!   program that started it, which then stops it in order), and a
//!   parent-death signal: the child gets SIGTERM when the *thread* that
//!   spawned it ends, so that a test that dies or forgets to stop it never
//!   leaves it behind. Start it from the thread that keeps the value.
//! * [`Process::wait_ready`]: polls a readiness probe; fails early when the
//!   child exits, and after a timeout, both errors with the log's tail.
//! * [`start_retrying`]: the one retry rule: a start whose log says a port
//!   was taken ([`is_port_clash`]) is tried again on new ports, at most
//!   [`START_ATTEMPTS`] times, and only when the ports were picked
//!   automatically; any other failure is reported at once.
//! * [`Process::stop`] (SIGTERM, then SIGKILL after a grace period) and
//!   [`Process::kill`] (SIGKILL, as a crash), both by the child's own PID and
//!   both reaping it.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// How many times a start that lost its port to another process is tried.
pub const START_ATTEMPTS: usize = 3;

/// How often [`Process::wait_ready`] and [`Process::wait_for_log`] poll.
const POLL: Duration = Duration::from_millis(20);

/// Whether a child's log says it could not bind because the address was
/// taken. Envoy ("cannot bind '…': Address already in use"), the gateway
/// ("binding 127.0.0.1:…: Address already in use (os error 98)") and
/// redis-server ("Could not create server TCP listening socket …: bind:
/// Address already in use") all print the operating system's words.
pub fn is_port_clash(log: &str) -> bool {
    log.contains("Address already in use")
}

/// A start attempt that failed: the error and the failed child's log.
#[derive(Debug)]
pub struct Failed {
    /// What went wrong (with the log's tail).
    pub error: anyhow::Error,
    /// The whole log of the failed child.
    pub log: String,
}

impl From<anyhow::Error> for Failed {
    fn from(error: anyhow::Error) -> Failed {
        Failed {
            error,
            log: String::new(),
        }
    }
}

/// Runs `attempt` until it succeeds. A failure whose log shows a port clash
/// is tried again (up to [`START_ATTEMPTS`] in all) when `auto_ports` says
/// the attempt picks new free ports each time; any other failure, or a clash
/// on fixed ports, ends at once.
pub fn start_retrying<T>(
    what: &str,
    auto_ports: bool,
    mut attempt: impl FnMut() -> std::result::Result<T, Failed>,
) -> Result<T> {
    let attempts = if auto_ports { START_ATTEMPTS } else { 1 };
    let mut last = None;
    for n in 1..=attempts {
        match attempt() {
            Ok(v) => return Ok(v),
            Err(f) => {
                let clash = is_port_clash(&f.log);
                last = Some(f.error.context(format!(
                    "starting {what} (attempt {n} of {attempts}{})",
                    if clash { ", a port was taken" } else { "" }
                )));
                if !clash {
                    break;
                }
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow!("{what} did not start")))
}

/// A running child with its output in a log file; killed when dropped.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Option<Child>,
    exit: Option<ExitStatus>,
    log_path: PathBuf,
}

impl Process {
    /// Spawns `cmd` as described in the module documentation, appending its
    /// output to `log_path` (created when missing). `name` names it in errors.
    pub fn spawn(name: &str, mut cmd: Command, log_path: &Path) -> Result<Process> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let log_err = log.try_clone().context("duplicating the log file handle")?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .process_group(0);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {name} ({:?})", cmd.get_program()))?;
        Ok(Process {
            name: name.to_string(),
            child: Some(child),
            exit: None,
            log_path: log_path.to_path_buf(),
        })
    }

    /// Polls `probe` every 20 ms until it says ready (`Ok`). Its `Err` text
    /// says what it saw last, for the timeout's message. Fails early when the
    /// child exits, and after `timeout`; both errors end with the log's tail.
    pub fn wait_ready(
        &mut self,
        timeout: Duration,
        mut probe: impl FnMut(&Process) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                bail!(
                    "{} exited with {status} before becoming ready.\n--- log tail ---\n{}",
                    self.name,
                    self.log_tail(40)
                );
            }
            let last = match probe(self) {
                Ok(()) => return Ok(()),
                Err(last) => last,
            };
            if Instant::now() >= deadline {
                bail!(
                    "{} (pid {}) not ready after {timeout:?}: {last}\n--- log tail ---\n{}",
                    self.name,
                    self.pid().unwrap_or_default(),
                    self.log_tail(40)
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// Kills the child (if it runs) and wraps `error` with its log, for
    /// [`start_retrying`].
    pub fn failed(&mut self, error: anyhow::Error) -> Failed {
        self.kill();
        Failed {
            error,
            log: self.log(),
        }
    }

    /// The exit status if the child has exited (or was stopped), without
    /// blocking.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            if let Some(child) = self.child.as_mut() {
                self.exit = child
                    .try_wait()
                    .with_context(|| format!("waiting for {}", self.name))?;
            }
        }
        Ok(self.exit)
    }

    /// Waits up to `timeout` for the child to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if self.child.is_none() || Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(POLL);
        }
    }

    /// Whether the child runs.
    pub fn is_running(&mut self) -> bool {
        self.child.is_some() && matches!(self.try_wait(), Ok(None))
    }

    /// The child's process id, until it is stopped or killed.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the child: SIGTERM to its own PID, then SIGKILL after `grace`.
    /// `None` when it had already been stopped or killed.
    pub fn stop(&mut self, grace: Duration) -> Result<Option<ExitStatus>> {
        if self.child.is_none() {
            return Ok(self.exit);
        }
        if self.try_wait()?.is_none() {
            // Not reaped yet, so its PID cannot have been reused.
            if let Some(pid) = self.pid().and_then(|p| libc::pid_t::try_from(p).ok()) {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
            self.wait_exit(grace)?;
        }
        let status = match self.child.take() {
            Some(mut child) => match self.exit {
                Some(s) => s,
                None => {
                    let _ = child.kill();
                    child
                        .wait()
                        .with_context(|| format!("waiting for {}", self.name))?
                }
            },
            None => return Ok(self.exit),
        };
        self.exit = Some(status);
        Ok(Some(status))
    }

    /// Kills the child now (SIGKILL by its own PID, as a crash) and reaps it:
    /// its ports are free again when this returns.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            if let Ok(s) = child.wait() {
                self.exit = Some(s);
            }
        }
    }

    /// The file receiving the child's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The whole log so far (lossy UTF-8; empty if unreadable).
    pub fn log(&self) -> String {
        read_log(&self.log_path)
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log(), lines)
    }

    /// Waits up to `timeout` for `needle` to appear in the log.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.log().contains(needle) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether process `pid` is gone or a zombie (exited, not reaped yet), by
/// `/proc/<pid>/stat`: for a PID this process does not hold a `Child` for.
pub fn has_exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state is the field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

/// The whole file at `path` (lossy UTF-8; empty if unreadable).
pub fn read_log(path: &Path) -> String {
    let mut bytes = Vec::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all.get(all.len().saturating_sub(lines)..)
        .unwrap_or_default()
        .join("\n")
}

/// Makes the child get SIGTERM when the thread that spawns it ends
/// (`PR_SET_PDEATHSIG`), and refuse to start when its parent is already gone.
fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec and only
    // makes async-signal-safe calls (prctl, getppid).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                return Err(std::io::Error::other("the parent exited"));
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// `sh -c script` as a [`Process`] logging into `log`.
    fn sh(log: &Path, script: &str) -> Process {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(script);
        Process::spawn("sh", cmd, log).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// A start that fails with `script`'s output, counting the attempts.
    fn count_attempts(auto_ports: bool, script: &str) -> (usize, String) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let n = Cell::new(0);
        let r = start_retrying("sh", auto_ports, || -> std::result::Result<(), Failed> {
            n.set(n.get() + 1);
            let mut p = sh(&dir.path().join(format!("sh-{}.log", n.get())), script);
            match p.wait_ready(Duration::from_secs(5), |_| Err("never".into())) {
                Ok(()) => Ok(()),
                Err(e) => Err(p.failed(e)),
            }
        });
        let err = r.err().map(|e| format!("{e:#}")).unwrap_or_default();
        (n.get(), err)
    }

    #[test]
    fn only_a_port_clash_is_tried_again_and_only_on_picked_ports() {
        let clash = "echo 'bind: Address already in use' >&2; exit 1";
        let (n, err) = count_attempts(true, clash);
        assert_eq!(n, 3, "{err}");
        assert!(err.contains("attempt 3 of 3, a port was taken"), "{err}");
        assert_eq!(count_attempts(false, clash).0, 1);
        let (n, err) = count_attempts(true, "echo 'unknown option' >&2; exit 2");
        assert_eq!(n, 1, "{err}");
        assert!(err.contains("attempt 1 of 3): sh exited with"), "{err}");
        assert!(err.contains("unknown option"), "the log tail: {err}");
    }

    #[test]
    fn stop_sends_sigterm_then_reaps() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut p = sh(
            &dir.path().join("sh.log"),
            "trap 'echo got TERM; exit 7' TERM; while :; do sleep 0.05; done",
        );
        assert!(p.is_running());
        std::thread::sleep(Duration::from_millis(200));
        let status = p
            .stop(Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(status.and_then(|s| s.code()), Some(7), "{}", p.log());
        assert_eq!(p.log().trim(), "got TERM");
        assert_eq!(p.pid(), None);
        assert!(!p.is_running());
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a\n", 5), "a");
        assert_eq!(tail("", 5), "");
    }
}
