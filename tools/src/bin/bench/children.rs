//! The long-running processes the bench started, so that Ctrl-C stops them
//! all.

use std::sync::Mutex;

/// PIDs of the long-running processes started and not yet stopped.
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());

pub fn register(pid: Option<u32>) {
    if let (Some(pid), Ok(mut c)) = (pid, CHILDREN.lock()) {
        c.push(pid);
    }
}

pub fn unregister(pid: Option<u32>) {
    if let (Some(pid), Ok(mut c)) = (pid, CHILDREN.lock()) {
        c.retain(|p| *p != pid);
    }
}

pub fn children() -> Vec<u32> {
    CHILDREN.lock().map(|c| c.clone()).unwrap_or_default()
}

/// SIGTERM to every registered child (by its own PID), newest first.
pub fn stop_children_from_signal() {
    let pids = children();
    for pid in pids.iter().rev() {
        if let Ok(pid) = libc::pid_t::try_from(*pid) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
    }
}
