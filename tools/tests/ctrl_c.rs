//! Ctrl-C stops everything a tool started (`tools::children`, which the demo
//! and the bench share). Checked with the demo, which starts four Envoys, the
//! gateway and `redis-server`, the one child without a parent-death signal.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use testkit::process::has_exited;

/// The PIDs of `parent`'s children, with their command names.
fn children_of(parent: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split after ')'.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            let comm = head
                .split_once('(')
                .map(|(_, c)| c.to_string())
                .unwrap_or_default();
            out.push((pid, comm));
        }
    }
    out
}

#[test]
fn ctrl_c_stops_every_process_the_demo_started() {
    let mut demo = Command::new(env!("CARGO_BIN_EXE_demo"))
        .args(["--free-ports", "--hold", "--load-seconds", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting the demo");
    let stdout = demo.stdout.take().expect("the demo's stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("press Ctrl-C to stop") => break,
            Ok(line) => seen.push(line),
            Err(e) => {
                let _ = demo.kill();
                panic!(
                    "the demo did not reach --hold ({e}); it printed:\n{}",
                    seen.join("\n")
                );
            }
        }
    }

    let started = children_of(demo.id());
    let count = |name: &str| started.iter().filter(|(_, c)| c.starts_with(name)).count();
    assert_eq!(
        (
            count("envoy"),
            count("redis-server"),
            count("ratelimit-gate"),
            started.len()
        ),
        (4, 1, 1, 6),
        "the demo's children: {started:?}"
    );

    // SAFETY: kill(2) has no memory-safety preconditions; the demo is our
    // child, not reaped yet.
    unsafe {
        libc::kill(demo.id() as libc::pid_t, libc::SIGINT);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = demo.try_wait().expect("waiting for the demo") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = demo.kill();
            panic!("the demo did not exit within 60 s of Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130), "the demo's exit after Ctrl-C");
    let left: Vec<_> = started
        .iter()
        .filter(|(pid, _)| !has_exited(*pid))
        .collect();
    assert!(left.is_empty(), "still running after Ctrl-C: {left:?}");
}
