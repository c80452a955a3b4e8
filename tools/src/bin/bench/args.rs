//! The command line: what to run, how long, and where the report goes.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use testkit::paths::target_dir;

use crate::VARIANTS;

/// Command-line options.
#[derive(Debug, Clone)]
pub struct Args {
    pub repeats: u32,
    pub seconds: u32,
    pub warmup: u32,
    pub connections: u32,
    pub threads: u32,
    pub only: Option<Vec<String>>,
    pub wait_quiet: Duration,
    pub work_dir: PathBuf,
    pub wasm_results: PathBuf,
    pub publish: bool,
    pub command: String,
}

const USAGE: &str = "usage: bench [--repeats N] [--seconds S] [--warmup S] [--connections C] \
                     [--threads T] [--only a,a2,a3,b,c1,c4,cc,d,g,e,b-f,c1-f,d-f,c1-1k,cu-1k,c1-64k,cu-64k,gw] [--wait-quiet SECONDS] \
                     [--work-dir DIR] [--wasm-results DIR] [--publish]";

/// The process's command line, parsed.
pub fn parse_args() -> Result<Args> {
    parse_args_from(std::env::args().skip(1).collect())
}

/// [`parse_args`] of `argv` (the arguments after the program's name).
pub fn parse_args_from(argv: Vec<String>) -> Result<Args> {
    let work = target_dir().join("bench");
    let mut args = Args {
        repeats: 4,
        seconds: 5,
        warmup: 2,
        connections: 32,
        threads: 1,
        only: None,
        wait_quiet: Duration::ZERO,
        wasm_results: work.join("wasm"),
        work_dir: work,
        publish: false,
        command: std::env::var("BENCH_COMMAND").unwrap_or_else(|_| {
            std::iter::once("bench".to_string())
                .chain(argv.iter().cloned())
                .collect::<Vec<_>>()
                .join(" ")
        }),
    };
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        let mut number = |range: std::ops::RangeInclusive<u32>| -> Result<u32> {
            let v = it.next().context(USAGE)?;
            v.parse::<u32>()
                .ok()
                .filter(|n| range.contains(n))
                .with_context(|| format!("{arg} wants a number in {range:?}, not {v:?}"))
        };
        match arg.as_str() {
            "--repeats" => args.repeats = number(1..=100)?,
            "--seconds" => args.seconds = number(1..=600)?,
            "--warmup" => args.warmup = number(0..=600)?,
            "--connections" => args.connections = number(1..=10_000)?,
            "--threads" => args.threads = number(1..=64)?,
            "--wait-quiet" => args.wait_quiet = Duration::from_secs(number(0..=3600)?.into()),
            "--only" => {
                let list = it.next().context(USAGE)?;
                let ids: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
                for id in &ids {
                    if id != "gw" && !VARIANTS.iter().any(|v| v.id == id) {
                        bail!("unknown variant {id:?}\n{USAGE}");
                    }
                }
                args.only = Some(ids);
            }
            "--work-dir" => args.work_dir = PathBuf::from(it.next().context(USAGE)?),
            "--wasm-results" => args.wasm_results = PathBuf::from(it.next().context(USAGE)?),
            "--publish" => args.publish = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if args.threads > args.connections {
        bail!("--threads must not exceed --connections");
    }
    // The policy lookup is timed in this process (bench/lookup.rs): a debug
    // build would publish a share ten times too large.
    if args.publish && cfg!(debug_assertions) {
        bail!("--publish needs a release build of the bench (cargo run --release)");
    }
    Ok(args)
}

impl Args {
    /// Whether variant `id` (or `gw`, the gateway bench) is to run.
    pub fn selected(&self, id: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|ids| ids.iter().any(|i| i == id))
    }
}

#[cfg(test)]
mod tests {
    /// The policy lookup is timed in the bench's own process, so a debug
    /// build must not publish (`cargo test` builds this in debug).
    #[test]
    fn a_debug_build_refuses_to_publish() {
        let refused = super::parse_args_from(vec!["--publish".to_string()]);
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.to_string().contains("release build")),
            "{:?}",
            refused.map(|a| a.publish)
        );
        assert!(super::parse_args_from(vec!["--repeats".into(), "2".into()]).is_ok());
    }
}
