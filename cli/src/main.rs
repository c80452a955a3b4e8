//! `ratelimit`: checks plugin configurations with the filter's own code.
//!
//! - `validate FILE...`: exit 1 with field paths on errors; fit for CI.
//! - `explain FILE`: every rule × tier with its effective limits, burst, cost
//!   and scope, and each limit's `RateLimit-Policy` item (a response shows
//!   one: the limit closest to exhaustion); which requests each rule, quota
//!   and cost applies to and what it keys on; what `cost_from` reserves and how
//!   it settles, and `charge_on`; with `--response-body`, what the filter
//!   would settle for that sample response; with `--envoy BOOTSTRAP`, which
//!   of its routes pick which `limits_by` set.
//! - `budget FILE... --provider-limit N/1m --headroom 10%`: whether the
//!   service-wide global limits of several services sharing one paid upstream
//!   fit under the provider's limit.
//! - `check-envoy FILE...`: warnings, exit 1, when an Envoy bootstrap's
//!   listeners that run the filter let a client choose its `ip` (trusting
//!   `X-Forwarded-For`) or do not normalise paths; fit for CI.
//! - `render FILE --out DIR`: from one plugin configuration, the filter's
//!   deployment (Istio `WasmPlugin`s, or an Envoy `http_filters` entry) and
//!   the gateway's policy (a ConfigMap, or the policy file), so the two cannot
//!   drift apart.

mod budget;
mod charging;
mod check_envoy;
mod explain;
mod matching;
mod render;
mod routes;

use clap::{Parser, Subcommand};
use ratelimit_config::{self as config, Config};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ratelimit",
    version,
    about = "Validate, explain and budget ratelimit-wasm configurations, and check the Envoy configs that run it"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// One Command is parsed per run, so Render's larger options cost nothing.
#[allow(clippy::large_enum_variant)]
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
        /// A sample response body: show what the filter would settle for it,
        /// read by the filter's own scanner.
        #[arg(long)]
        response_body: Option<String>,
        /// A header of the sample response, `name: value` (repeatable).
        #[arg(long, requires = "response_body")]
        response_header: Vec<String>,
        /// The sample response's status.
        #[arg(long, default_value_t = 200, requires = "response_body")]
        status: u16,
        /// The sample response's content type (`text/event-stream` for a stream).
        #[arg(long, requires = "response_body")]
        content_type: Option<String>,
        /// An Envoy bootstrap (YAML or JSON): show which of its routes pick
        /// which `limits_by` set, read from each route's metadata.
        #[arg(long)]
        envoy: Option<String>,
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
    /// Check Envoy bootstraps: the listeners running the filter must not trust
    /// X-Forwarded-For and must normalise paths; exit 1 on any warning.
    CheckEnvoy {
        /// Envoy bootstrap files (YAML or JSON).
        #[arg(required = true)]
        files: Vec<String>,
    },
    /// Render one plugin configuration into the filter's deployment and the
    /// gateway's policy (the same JSON in both), after validating it.
    Render {
        /// The plugin configuration (JSON).
        file: String,
        /// Directory to write into (created if missing; files are overwritten).
        #[arg(long)]
        out: String,
        /// What to render and what it names.
        #[command(flatten)]
        opts: render::Options,
    },
}

/// Reads and validates one file; the error names the file and the field path.
pub fn load(file: &str) -> Result<Config, String> {
    let bytes = std::fs::read(file).map_err(|e| format!("{file}: cannot read: {e}"))?;
    config::parse(&bytes).map_err(|e| format!("{file}: {e}"))
}

/// Runs `check` on each of `files`, which answers whether its file passed
/// (having said why not) or the error, printed here. `Err("")` (all said)
/// when any file did not pass.
fn each_file(
    files: &[String],
    mut check: impl FnMut(&str) -> Result<bool, String>,
) -> Result<(), String> {
    let mut failed = false;
    for f in files {
        match check(f) {
            Ok(passed) => failed |= !passed,
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

/// `explain`: the table, the charging section, a sample's settlement, and
/// the routes of a bootstrap.
fn explain(
    file: &str,
    body: Option<&str>,
    headers: &[String],
    status: u16,
    content_type: Option<String>,
    envoy: Option<&str>,
) -> Result<(), String> {
    let c = load(file)?;
    let bootstrap = envoy
        .map(|f| check_envoy::read_bootstrap(f).map(|doc| (f, doc)))
        .transpose()?;
    let sample = match body {
        None => None,
        Some(b) => {
            let mut parsed = headers
                .iter()
                .map(|h| charging::parse_header(h))
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(t) = content_type {
                parsed.insert(0, ("content-type".into(), t));
            }
            Some(charging::Sample {
                status,
                headers: parsed,
                body: std::fs::read(b).map_err(|e| format!("{b}: cannot read: {e}"))?,
            })
        }
    };
    print!(
        "{}{}{}",
        explain::table(&c),
        matching::describe(&c),
        charging::describe(&c)
    );
    if let Some(s) = &sample {
        print!("{}", charging::settle(&c, s));
    }
    if let Some((f, doc)) = &bootstrap {
        print!("{}", routes::describe(&c, doc, f));
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Validate { files } => each_file(&files, |f| {
            load(f)?;
            println!("{f}: ok");
            Ok(true)
        }),
        Command::Explain {
            file,
            response_body,
            response_header,
            status,
            content_type,
            envoy,
        } => explain(
            &file,
            response_body.as_deref(),
            &response_header,
            status,
            content_type,
            envoy.as_deref(),
        ),
        Command::Budget {
            files,
            provider_limit,
            headroom,
        } => budget::run(&files, &provider_limit, &headroom),
        Command::CheckEnvoy { files } => check_envoy::run(&files),
        Command::Render { file, out, opts } => render::run(&file, &out, &opts).map(|names| {
            for n in names {
                println!("{}", std::path::Path::new(&out).join(n).display());
            }
        }),
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
