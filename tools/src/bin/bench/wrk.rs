//! Running `wrk` and reading its report.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The wrk scripts, written into the work directory at start.
pub const LOAD_LUA: &str = include_str!("load.lua");
pub const GATEWAY_LUA: &str = include_str!("gateway.lua");

/// How to load a target.
#[derive(Debug, Clone)]
pub struct Load<'a> {
    pub url: String,
    pub script: &'a Path,
    /// Arguments handed to the script's `init`.
    pub script_args: Vec<String>,
    pub threads: u32,
    pub connections: u32,
    pub seconds: u32,
}

/// What one wrk run reported.
#[derive(Debug, Clone, Default)]
pub struct WrkResult {
    pub requests: u64,
    pub seconds: f64,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub non_2xx: u64,
    pub socket_errors: u64,
}

/// Runs wrk to the end and parses its report.
pub fn run(load: &Load) -> Result<WrkResult> {
    let out = Command::new("wrk")
        .arg("-t")
        .arg(load.threads.to_string())
        .arg("-c")
        .arg(load.connections.to_string())
        .arg("-d")
        .arg(format!("{}s", load.seconds))
        .arg("--latency")
        .arg("-s")
        .arg(load.script)
        .arg(&load.url)
        .arg("--")
        .args(&load.script_args)
        .stdin(Stdio::null())
        .output()
        .context("running wrk (Debian package `wrk`; `make bench` installs it)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "wrk {} failed ({}):\n{text}{}",
            load.url,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse(&text).with_context(|| format!("reading wrk's report:\n{text}"))
}

/// A wrk duration (`850.00us`, `1.23ms`, `2.00s`, `1.00m`) in milliseconds.
fn duration_ms(v: &str) -> Option<f64> {
    let (num, factor) = if let Some(n) = v.strip_suffix("us") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60_000.0)
    } else if let Some(n) = v.strip_suffix('h') {
        (n, 3_600_000.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|n| n * factor)
}

/// Parses wrk's text report (with `--latency`).
pub fn parse(text: &str) -> Result<WrkResult> {
    let mut r = WrkResult::default();
    let (mut p50, mut p99, mut rps, mut total) = (None, None, None, None);
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["50%", v] => p50 = duration_ms(v),
            ["99%", v] => p99 = duration_ms(v),
            ["Requests/sec:", v] => rps = v.parse::<f64>().ok(),
            [n, "requests", "in", secs, ..] => {
                total = n.parse::<u64>().ok();
                r.seconds = duration_ms(secs.trim_end_matches(',')).unwrap_or(0.0) / 1000.0;
            }
            ["Non-2xx", "or", "3xx", "responses:", n] => r.non_2xx = n.parse().unwrap_or(0),
            ["Socket", "errors:", rest @ ..] => {
                // "connect 0, read 0, write 0, timeout 0"
                r.socket_errors = rest
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<u64>().ok())
                    .sum();
            }
            _ => {}
        }
    }
    r.p50_ms = p50.context("no 50% latency")?;
    r.p99_ms = p99.context("no 99% latency")?;
    r.rps = rps.context("no Requests/sec")?;
    r.requests = total.context("no request count")?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_wrk_report() {
        let text = "Running 5s test @ http://127.0.0.1:1/\n  1 threads and 32 connections\n  \
            Thread Stats   Avg      Stdev     Max   +/- Stdev\n    Latency     1.23ms  456.00us  12.34ms   90.00%\n    \
            Req/Sec    26.00k     1.00k   28.00k    80.00%\n  Latency Distribution\n     50%  850.00us\n     \
            75%    1.30ms\n     90%    1.60ms\n     99%    2.50ms\n  130000 requests in 5.00s, 20.00MB read\n  \
            Socket errors: connect 0, read 2, write 0, timeout 1\n  Non-2xx or 3xx responses: 65000\n\
            Requests/sec:  26000.00\nTransfer/sec:      4.00MB\n";
        let r = parse(text).unwrap();
        assert_eq!(r.requests, 130000);
        assert!((r.seconds - 5.0).abs() < 1e-9);
        assert!((r.rps - 26000.0).abs() < 1e-9);
        assert!((r.p50_ms - 0.85).abs() < 1e-9);
        assert!((r.p99_ms - 2.5).abs() < 1e-9);
        assert_eq!(r.non_2xx, 65000);
        assert_eq!(r.socket_errors, 3);
    }
}
