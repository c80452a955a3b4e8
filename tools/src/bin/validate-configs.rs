//! `make validate-configs`: renders every shipped Envoy template with every
//! shipped plugin configuration and checks each with `envoy --mode validate`.

use std::process::ExitCode;

fn main() -> ExitCode {
    match testkit::validate_shipped_configs() {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
