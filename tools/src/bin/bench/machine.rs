//! The machine: what it is, how busy it is, and the per-process figures the
//! bench reads from `/proc` (RSS, CPU time) or sets (CPU affinity).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

/// What the report says about the machine.
#[derive(Debug, Clone)]
pub struct Machine {
    pub nproc: usize,
    pub cpu_model: String,
    pub mem_total_mib: u64,
    pub kernel: String,
    pub envoy_version: String,
    pub wrk_version: String,
    pub redis_version: String,
}

fn first_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|o| {
            let mut text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&o.stderr));
            text.lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_else(|e| format!("({program}: {e})"))
}

impl Machine {
    pub fn read(envoy: &Path) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, m)| m.trim().to_string())
            .unwrap_or_else(|| "unknown".to_string());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_total_mib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|kib| kib.parse::<u64>().ok())
            .map_or(0, |kib| kib / 1024);
        let envoy_version = first_line(&envoy.to_string_lossy(), &["--version"]);
        let envoy_version = envoy_version
            .split_once("version:")
            .map_or(envoy_version.as_str(), |(_, v)| v)
            .trim()
            .to_string();
        Machine {
            nproc: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            mem_total_mib,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            envoy_version,
            // "wrk debian/4.1.0-3+b2 [epoll] Copyright (C) 2012 Will Glozer"
            wrk_version: first_line("wrk", &["-v"])
                .split(" Copyright")
                .next()
                .unwrap_or_default()
                .to_string(),
            // "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64 ..."
            redis_version: {
                let line = first_line("redis-server", &["--version"]);
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix("v="))
                    .map_or(line.clone(), |v| format!("Redis {v}"))
            },
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "nproc": self.nproc,
            "cpu_model": self.cpu_model,
            "mem_total_mib": self.mem_total_mib,
            "kernel": self.kernel,
            "envoy": self.envoy_version,
            "wrk": self.wrk_version,
            "redis": self.redis_version,
        })
    }
}

/// The 1, 5 and 15 minute load averages.
pub fn loadavg() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut it = text
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(f64::NAN));
    [
        it.next().unwrap_or(f64::NAN),
        it.next().unwrap_or(f64::NAN),
        it.next().unwrap_or(f64::NAN),
    ]
}

/// The outcome of waiting for a quiet machine.
#[derive(Debug, Clone)]
pub struct Quiet {
    /// The 1-minute load average was below the threshold for a minute.
    pub quiet: bool,
    /// How long we waited.
    pub waited: Duration,
    /// Load averages when the measurements started.
    pub load_at_start: [f64; 3],
    pub threshold: f64,
    pub max_wait: Duration,
}

/// Waits until the 1-minute load average has stayed below `threshold` for a
/// minute (checked every 30 s), at most `max_wait`. With a zero `max_wait`,
/// only looks once.
pub fn wait_quiet(threshold: f64, max_wait: Duration) -> Quiet {
    let start = Instant::now();
    let step = Duration::from_secs(30);
    let mut below_since: Option<Instant> = None;
    loop {
        let load = loadavg()[0];
        let now = Instant::now();
        if load < threshold {
            let since = *below_since.get_or_insert(now);
            if max_wait.is_zero() || now.duration_since(since) >= Duration::from_secs(60) {
                return done(true, start, threshold, max_wait);
            }
        } else {
            below_since = None;
        }
        if now.duration_since(start) + step > max_wait {
            return done(false, start, threshold, max_wait);
        }
        eprintln!(
            "bench: waiting for a quiet machine: load average {load:.2} (want < {threshold} for 60 s; \
             waited {:.0} s of at most {:.0} s)",
            now.duration_since(start).as_secs_f64(),
            max_wait.as_secs_f64()
        );
        std::thread::sleep(step);
    }
}

fn done(quiet: bool, start: Instant, threshold: f64, max_wait: Duration) -> Quiet {
    Quiet {
        quiet,
        waited: start.elapsed(),
        load_at_start: loadavg(),
        threshold,
        max_wait,
    }
}

/// Resident set size of process `pid`, in MiB (`VmRSS` of `/proc/PID/status`).
pub fn rss_mib(pid: u32) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no VmRSS in /proc/{pid}/status"))?;
    Ok(kib / 1024.0)
}

/// Clock ticks per second of `/proc` CPU times.
fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// CPU seconds (user + system) used by process `pid` (all its threads);
/// with `children`, plus those of its waited-for children.
pub fn process_cpu_seconds(pid: u32, children: bool) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    // rest[0] is field 3 (state): utime = field 14, stime 15, cutime 16, cstime 17.
    let at = |field: usize| f.get(field - 3).copied().unwrap_or(0.0);
    let mut ticks = at(14) + at(15);
    if children {
        ticks += at(16) + at(17);
    }
    ticks / ticks_per_second()
}

/// Busy CPU seconds of the whole machine, summed over CPUs (`/proc/stat`).
pub fn machine_busy_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(cpu) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return 0.0;
    };
    let v: Vec<f64> = cpu
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy: f64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|&i| v.get(i).copied().unwrap_or(0.0))
        .sum();
    busy / ticks_per_second()
}

/// A CPU-time snapshot of the machine and of the bench's own processes,
/// to tell how much CPU *other* processes took during a measurement.
#[derive(Debug, Clone)]
pub struct CpuSnapshot {
    busy: f64,
    ours: f64,
    at: Instant,
}

impl CpuSnapshot {
    /// `pids`: the bench's own long-running children (their waited-for
    /// children, such as `wrk`, count in this process's own figures).
    pub fn take(pids: &[u32]) -> CpuSnapshot {
        let ours = process_cpu_seconds(std::process::id(), true)
            + pids
                .iter()
                .map(|&p| process_cpu_seconds(p, false))
                .sum::<f64>();
        CpuSnapshot {
            busy: machine_busy_seconds(),
            ours,
            at: Instant::now(),
        }
    }

    /// Share of the machine's CPU capacity (0..1) used by processes that are
    /// not the bench's, between `self` and `later`.
    pub fn foreign_share(&self, later: &CpuSnapshot, nproc: usize) -> f64 {
        let wall = later.at.duration_since(self.at).as_secs_f64();
        if wall <= 0.0 {
            return 0.0;
        }
        let foreign = (later.busy - self.busy) - (later.ours - self.ours);
        (foreign / (wall * nproc as f64)).clamp(0.0, 1.0)
    }
}

/// Pins every thread of process `pid` to CPU `cpu`.
pub fn pin_process(pid: u32, cpu: usize) -> Result<()> {
    let dir = format!("/proc/{pid}/task");
    let tasks = std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))?;
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write inside it,
        // and sched_setaffinity reads size_of::<cpu_set_t>() bytes of it.
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_ZERO(&mut set);
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if rc != 0 {
            bail!(
                "sched_setaffinity({tid}, cpu {cpu}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}
