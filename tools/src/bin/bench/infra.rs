//! The processes every variant shares: the upstream Envoy, Redis and the
//! two gateways.

use std::path::Path;

use anyhow::{Context, Result};
use testkit::redis::Redis;
use testkit::{free_port, Envoy, EnvoyOptions, Gateway, GatewayOptions, Ports};
use tools::children::{start_child, unregister};

use crate::args::Args;
use crate::{configs, machine, AUTH_CALLERS, DF_JSON, D_JSON, E_JSON};

/// The processes every variant shares: the upstream Envoy, and Redis and the
/// gateway (for d and the gateway bench).
pub struct Infra {
    pub upstream: Envoy,
    /// The plain gateway's `--grpc-listen` port (variant g).
    pub grpc_port: u16,
    pub redis: Option<Redis>,
    pub gateway: Option<Gateway>,
    /// The same gateway with `--auth-tokens`.
    pub gateway_auth: Option<Gateway>,
}

impl Infra {
    /// Starts them; Redis and the gateways only when `needs_gateway`.
    pub fn start(args: &Args, wasm: &Path, needs_gateway: bool, nproc: usize) -> Result<Infra> {
        let mut redis = None;
        let mut gateway = None;
        let mut gateway_auth = None;
        let grpc_port = free_port()?;
        if needs_gateway {
            let r = start_child(Redis::start, |r| vec![r.pid()])?;
            // The gateway's policy: the plugin configurations of d and e (and
            // of the wrk script, which is d's domain and rule).
            let opts = GatewayOptions::new(r.url())
                .shipped_redis_timeout()
                .policy(D_JSON)
                .policy(E_JSON)
                .policy(DF_JSON)
                .work_dir(args.work_dir.join("gateway"));
            let rls = args.work_dir.join("rls.yaml");
            std::fs::write(&rls, configs::RLS_CONFIG).context("writing the bench's rls config")?;
            let grpc = format!("127.0.0.1:{grpc_port}");
            let rls = rls.display().to_string();
            let g = start_child(
                || {
                    Gateway::start(opts.clone().args(&[
                        "--grpc-listen",
                        &grpc,
                        "--rls-config",
                        &rls,
                    ]))
                },
                |g| vec![g.pid()],
            )?;
            let tokens = args.work_dir.join("gateway-tokens");
            let mut text = String::new();
            for i in 0..AUTH_CALLERS {
                text.push_str(&format!("bench bench-caller-token-{i:04}\n"));
            }
            std::fs::write(&tokens, text).context("writing the bench's token file")?;
            let tokens = tokens.display().to_string();
            let ga = start_child(
                || {
                    Gateway::start(
                        opts.args(&["--auth-tokens", &tokens])
                            .work_dir(args.work_dir.join("gateway-auth")),
                    )
                },
                |g| vec![g.pid()],
            )?;
            redis = Some(r);
            gateway = Some(g);
            gateway_auth = Some(ga);
        }
        let ports = Ports::free()?;
        let dir = args.work_dir.join("upstream");
        std::fs::create_dir_all(&dir)?;
        let yaml = dir.join("upstream.yaml");
        std::fs::write(&yaml, configs::upstream_config(ports, wasm)?)?;
        let mut opts = EnvoyOptions::new("{}").ports(ports);
        opts.template = Some(yaml);
        opts.wasm = Some(wasm.to_path_buf());
        opts.concurrency = 1;
        opts.log_level = "warning".into();
        opts.component_log_level = "wasm:warning".into();
        opts.work_dir = Some(dir.join("run"));
        let upstream = start_child(|| Envoy::start(opts), |e| vec![Some(e.pid())])?;
        let cpu = nproc.saturating_sub(1);
        machine::pin_process(upstream.pid(), cpu)
            .with_context(|| format!("pinning the upstream Envoy to CPU {cpu}"))?;
        Ok(Infra {
            upstream,
            grpc_port,
            redis,
            gateway,
            gateway_auth,
        })
    }

    /// Their PIDs, for the CPU accounting.
    pub fn pids(&self) -> Vec<u32> {
        [
            Some(self.upstream.pid()),
            self.gateway.as_ref().and_then(Gateway::pid),
            self.gateway_auth.as_ref().and_then(Gateway::pid),
            self.redis.as_ref().and_then(Redis::pid),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// Stops them all.
    pub fn stop(mut self) -> Result<()> {
        unregister(Some(self.upstream.pid()));
        self.upstream.stop()?;
        for mut g in [self.gateway.take(), self.gateway_auth.take()]
            .into_iter()
            .flatten()
        {
            unregister(g.pid());
            g.stop()?;
        }
        if let Some(mut r) = self.redis.take() {
            unregister(r.pid());
            r.kill();
        }
        Ok(())
    }
}
