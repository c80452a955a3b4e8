//! The long-running processes a tool started and has not stopped yet, so
//! that Ctrl-C stops them all: one list and one way to stop them, for the
//! demo and the bench alike.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};

/// PIDs of the processes started and not stopped yet, in start order, for
/// the Ctrl-C handler; `None` once the handler has taken them. Held while a
/// child starts (see [`start_child`]).
static CHILDREN: Mutex<Option<Vec<u32>>> = Mutex::new(Some(Vec::new()));

/// Starts children with `start` and registers their PIDs (`pids`) for the
/// Ctrl-C handler, holding the list meanwhile: a Ctrl-C during a start waits
/// for it to finish and then stops what it started too (a child without a
/// parent-death signal, such as `redis-server`, would otherwise outlive the
/// tool), and after a Ctrl-C nothing new starts.
pub fn start_child<T>(
    start: impl FnOnce() -> Result<T>,
    pids: impl FnOnce(&T) -> Vec<Option<u32>>,
) -> Result<T> {
    let mut children = CHILDREN
        .lock()
        .map_err(|_| anyhow!("the list of children is poisoned"))?;
    let Some(list) = children.as_mut() else {
        bail!("interrupted");
    };
    let started = start()?;
    list.extend(pids(&started).into_iter().flatten());
    Ok(started)
}

/// Takes `pid` off the list: the caller is stopping it.
pub fn unregister(pid: Option<u32>) {
    if let (Some(pid), Ok(mut c)) = (pid, CHILDREN.lock()) {
        if let Some(list) = c.as_mut() {
            list.retain(|p| *p != pid);
        }
    }
}

/// Stops every registered process, newest first: SIGTERM, then SIGKILL after
/// 5 s. Called from the Ctrl-C handler; waits for a start in progress to
/// finish first, and no child starts after it.
pub fn stop_children_from_signal() {
    let pids = match CHILDREN.lock() {
        Ok(mut c) => c.take().unwrap_or_default(),
        Err(_) => return,
    };
    for pid in pids.into_iter().rev() {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            continue;
        };
        if pid <= 0 {
            continue;
        }
        // SAFETY: kill(2) and waitpid(2) have no memory-safety preconditions;
        // `status` outlives the call. Each PID is a child of this process not
        // reaped yet, so it cannot have been reused.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
            let mut status = 0;
            let mut exited = false;
            for _ in 0..250 {
                if libc::waitpid(pid, &mut status, libc::WNOHANG) != 0 {
                    exited = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if !exited {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
        }
    }
}
