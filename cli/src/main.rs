//! `ratelimit`: checks plugin configurations with the filter's own code.
//!
//! - `validate FILE...`: exit 1 with field paths on errors; fit for CI.
//! - `explain FILE`: every rule × tier with its effective limits, burst, cost
//!   and scope, and the `RateLimit-Policy` header clients will see.
//! - `budget FILE... --provider-limit N/1m --headroom 10%`: whether the
//!   service-wide global limits of several services sharing one paid upstream
//!   fit under the provider's limit.

mod budget;
mod explain;

use clap::{Parser, Subcommand};
use ratelimit_wasm::config::{self, Config};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ratelimit",
    version,
    about = "Validate, explain and budget ratelimit-wasm configurations"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate plugin configurations; exit 1 if any is refused.
    Validate {
        /// Plugin configuration files (JSON).
        #[arg(required = true)]
        files: Vec<String>,
    },
    /// Show every rule × tier with effective limits, burst, cost, scope and headers.
    Explain {
        /// A plugin configuration file (JSON).
        file: String,
    },
    /// Check that service-wide global limits sum to under a provider's limit.
    Budget {
        /// Plugin configuration files (JSON), one per service.
        #[arg(required = true)]
        files: Vec<String>,
        /// The provider's limit, as `<requests>/<duration>`, e.g. `1000/1m`.
        #[arg(long)]
        provider_limit: String,
        /// Share of the provider's limit kept free, e.g. `10%`.
        #[arg(long, default_value = "10%")]
        headroom: String,
    },
}

/// Reads and validates one file; the error names the file and the field path.
pub fn load(file: &str) -> Result<Config, String> {
    let bytes = std::fs::read(file).map_err(|e| format!("{file}: cannot read: {e}"))?;
    config::parse(&bytes).map_err(|e| format!("{file}: {e}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Validate { files } => {
            let mut failed = false;
            for f in &files {
                match load(f) {
                    Ok(_) => println!("{f}: ok"),
                    Err(e) => {
                        eprintln!("{e}");
                        failed = true;
                    }
                }
            }
            if failed {
                Err(String::new())
            } else {
                Ok(())
            }
        }
        Command::Explain { file } => load(&file).map(|c| print!("{}", explain::table(&c))),
        Command::Budget {
            files,
            provider_limit,
            headroom,
        } => budget::run(&files, &provider_limit, &headroom),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("{e}");
            }
            ExitCode::FAILURE
        }
    }
}
