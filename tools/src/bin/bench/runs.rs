//! One measured run: a fresh Envoy per variant under wrk, or the gateway
//! against raw EVALSHA; what each costs in CPU and memory.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use testkit::redis::Redis;
use testkit::{free_port, Envoy, EnvoyOptions, Gateway, Ports};
use tools::children::{start_child, unregister};

use crate::args::Args;
use crate::{
    configs, gateway, lookup, machine, wrk, GatewayRun, Run, Variant, AUTH_TOKEN, CLIENTS, DF_JSON,
    D_JSON, E_JSON, VARIANTS,
};

/// What every run needs.
pub struct RunContext<'a> {
    pub args: &'a Args,
    pub wasm: &'a Path,
    pub baselines: &'a configs::Baselines,
    pub upstream_port: u16,
    pub gateway_port: u16,
    pub grpc_port: u16,
    pub load_lua: &'a Path,
    pub nproc: usize,
    /// The long-running children (upstream, gateway, Redis), for the CPU accounting.
    pub infra_pids: Vec<u32>,
    /// The gateway's Redis, whose `EVALSHA` calls each run counts.
    pub redis: Option<&'a Redis>,
}

/// `EVALSHA` calls Redis has served (`INFO commandstats`).
fn evalsha_calls(redis: &Redis) -> Result<f64> {
    let stats = redis.cli(&["info", "commandstats"])?;
    let calls = stats
        .lines()
        .find_map(|l| l.trim().strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse::<f64>().ok());
    Ok(calls.unwrap_or(0.0))
}

/// Counters read from the measured Envoy after a run (Prometheus names).
const COUNTERS: [&str; 14] = [
    "ratelimit_wasm_requests_allowed",
    "ratelimit_wasm_requests_denied",
    "ratelimit_wasm_global_calls",
    "ratelimit_wasm_global_batches",
    "ratelimit_wasm_global_failures",
    "ratelimit_wasm_circuit_open_skips",
    "ratelimit_wasm_errors",
    "ratelimit_wasm_lease_served",
    "ratelimit_wasm_lease_fetches",
    "ratelimit_wasm_deny_cache_hits",
    "ratelimit_wasm_usage_settled",
    "ratelimit_wasm_usage_capped",
    "ratelimit_wasm_usage_missing",
    "ratelimit_wasm_usage_over_scan_limit",
];

/// The filter's counters ([`COUNTERS`]) and the native limiter's
/// (`envoy_http_local_rate_limit_*`) that Envoy shows.
fn counters(envoy: &Envoy) -> Result<BTreeMap<String, f64>> {
    let page = envoy.stats_prometheus()?;
    let mut counters: BTreeMap<String, f64> = COUNTERS
        .iter()
        .filter_map(|&n| Some((n.to_string(), testkit::prometheus_value(&page, n)?)))
        .collect();
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        if let Some((name, value)) = line.split_once(' ') {
            if name.starts_with("envoy_http_local_rate_limit_") {
                let name = name.split('{').next().unwrap_or(name).to_string();
                if let Ok(x) = value.trim().parse::<f64>() {
                    *counters.entry(name).or_insert(0.0) += x;
                }
            }
        }
    }
    Ok(counters)
}

/// Connections accepted so far by worker `worker` of the measured listener.
fn worker_connections(envoy: &Envoy, worker: usize) -> Result<f64> {
    let name = format!(
        "listener.127.0.0.1_{}.worker_{worker}.downstream_cx_total",
        envoy.ports().listen
    );
    Ok(envoy.stat(&name)?.unwrap_or(0) as f64)
}

impl RunContext<'_> {
    /// Every selected variant once per round, `--repeats` rounds.
    pub fn run_variants(&self) -> Result<Vec<Run>> {
        let mut runs = Vec::new();
        for repeat in 0..self.args.repeats {
            for v in VARIANTS.iter().filter(|v| self.args.selected(v.id)) {
                let run = self.run_variant(v, repeat)?;
                eprintln!(
                    "bench: round {}/{} {:5} {:>9.0} req/s  p50 {:6.3} ms  p99 {:6.3} ms  \
                     non-2xx {:>7}  Envoy CPU {:5.1} µs/req  RSS {:6.1} MiB  other CPU {:4.1} %",
                    repeat + 1,
                    self.args.repeats,
                    v.id,
                    run.wrk.rps,
                    run.wrk.p50_ms,
                    run.wrk.p99_ms,
                    run.wrk.non_2xx,
                    run.envoy_cpu_us,
                    run.rss_mib,
                    run.foreign_cpu * 100.0
                );
                runs.push(run);
            }
        }
        Ok(runs)
    }

    /// The gateway against raw EVALSHA, `--repeats` rounds.
    pub fn run_gateways(
        &self,
        g: &Gateway,
        ga: &Gateway,
        r: &Redis,
        script: &Path,
    ) -> Result<Vec<GatewayRun>> {
        let sha = gateway::load_script(r)?;
        gateway::check_once(r, &sha)?;
        let batch_sha = gateway::load_batch_script(r)?;
        gateway::check_batch_once(r, &batch_sha)?;
        let mut runs = Vec::new();
        for repeat in 0..self.args.repeats {
            let run = self.run_gateway(repeat, g, ga, r, (&sha, &batch_sha), script)?;
            eprintln!(
                "bench: round {}/{} gateway {:>9.0} checks/s (p50 {:.3} ms, p99 {:.3} ms)  \
                 with auth {:>9.0} checks/s (p50 {:.3} ms, p99 {:.3} ms)  \
                 gRPC {:>9.0} checks/s (p50 {:.3} ms, p99 {:.3} ms; h2load CPU {:.2}× the gateway's)  \
                 redis-benchmark EVALSHA {:>9.0}/s (p50 {:.3} ms, p99 {:.3} ms)  \
                 batches of {} {:>9.0} checks/s (p99 {:.3} ms), raw EVALSHA {:>9.0} checks/s",
                repeat + 1,
                self.args.repeats,
                run.gateway.rps,
                run.gateway.p50_ms,
                run.gateway.p99_ms,
                run.gateway_auth.rps,
                run.gateway_auth.p50_ms,
                run.gateway_auth.p99_ms,
                run.grpc.rps,
                run.grpc.p50_ms,
                run.grpc.p99_ms,
                run.grpc_generator_share,
                run.redis.rps,
                run.redis.p50_ms,
                run.redis.p99_ms,
                gateway::BATCH_CHECKS,
                run.batch.rps * f64::from(gateway::BATCH_CHECKS),
                run.batch.p99_ms,
                run.redis_batch.rps * f64::from(gateway::BATCH_CHECKS),
            );
            runs.push(run);
        }
        Ok(runs)
    }

    /// Starts a fresh Envoy for `v` (its derived configuration is kept in
    /// `<work-dir>/runs/<id>/envoy-derived.yaml`), loads it, stops it.
    fn run_variant(&self, v: &Variant, repeat: u32) -> Result<Run> {
        let ports = Ports {
            listen: free_port()?,
            admin: free_port()?,
            upstream: self.upstream_port,
        };
        let yaml = configs::proxy_config(
            v.filter,
            ports,
            self.gateway_port,
            self.grpc_port,
            self.wasm,
            self.baselines,
            v.plugin,
        )?;
        let dir = self.args.work_dir.join("runs").join(v.id);
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("envoy-derived.yaml");
        std::fs::write(&config, &yaml)?;

        let mut opts = EnvoyOptions::new(v.plugin).ports(ports);
        opts.template = Some(config);
        opts.wasm = Some(self.wasm.to_path_buf());
        opts.gateway_port = Some(self.gateway_port);
        opts.concurrency = 2;
        opts.log_level = "warning".into();
        opts.component_log_level = "wasm:warning".into();
        opts.work_dir = Some(dir.join("run"));
        let mut envoy = start_child(|| Envoy::start(opts), |e| vec![Some(e.pid())])
            .with_context(|| format!("starting variant {}", v.id))?;
        let result = self.measure(v, repeat, &envoy);
        unregister(Some(envoy.pid()));
        let stopped = envoy.stop();
        let run = result.with_context(|| {
            format!(
                "variant {} (Envoy log: {})",
                v.id,
                envoy.log_path().display()
            )
        })?;
        stopped?;
        Ok(run)
    }

    fn measure(&self, v: &Variant, repeat: u32, envoy: &Envoy) -> Result<Run> {
        let mut load = wrk::Load {
            url: envoy.url("/"),
            script: self.load_lua,
            script_args: vec![
                v.load.arg().to_string(),
                CLIENTS.to_string(),
                v.path.to_string(),
            ],
            threads: self.args.threads,
            connections: self.args.connections,
            seconds: self.args.warmup,
        };
        if self.args.warmup > 0 {
            wrk::run(&load).context("warm-up")?;
        }
        load.seconds = self.args.seconds;
        let mut pids = self.infra_pids.clone();
        pids.push(envoy.pid());
        let counters_before = counters(envoy)?;
        let redis = self.redis.filter(|_| v.needs_gateway);
        let evalsha_before = redis.map(evalsha_calls).transpose()?;
        let workers_before = (0..2)
            .map(|w| worker_connections(envoy, w))
            .collect::<Result<Vec<_>>>()?;
        let before = machine::CpuSnapshot::take(&pids);
        let envoy_cpu_before = machine::process_cpu_seconds(envoy.pid(), false);
        let result = wrk::run(&load)?;
        let envoy_cpu = machine::process_cpu_seconds(envoy.pid(), false) - envoy_cpu_before;
        let after = machine::CpuSnapshot::take(&pids);
        let rss_mib = machine::rss_mib(envoy.pid())?;
        let envoy_cpu_us = envoy_cpu * 1e6 / result.requests.max(1) as f64;
        let mut counters = counters(envoy)?;
        for (name, value) in counters.iter_mut() {
            *value -= counters_before.get(name).copied().unwrap_or(0.0);
        }
        if let (Some(r), Some(before)) = (redis, evalsha_before) {
            counters.insert("redis_evalsha".into(), evalsha_calls(r)? - before);
        }
        // How the kernel spread the measured run's connections over the workers.
        for (worker, before) in workers_before.iter().enumerate() {
            counters.insert(
                format!("worker_{worker}_connections"),
                worker_connections(envoy, worker)? - before,
            );
        }
        Ok(Run {
            variant: v.id,
            repeat,
            wrk: result,
            rss_mib,
            envoy_cpu_us,
            foreign_cpu: before.foreign_share(&after, self.nproc),
            counters,
        })
    }

    /// `redis-benchmark` of `line` for about `--seconds`: its request count
    /// calibrated by a first run of `probe` requests.
    fn redis_benchmark_timed(
        &self,
        redis: &Redis,
        line: Vec<String>,
        probe: u64,
    ) -> Result<gateway::BenchResult> {
        let connections = self.args.connections;
        let first = gateway::redis_benchmark(redis, line.clone(), connections, probe)?;
        let n = (first.rps * f64::from(self.args.seconds)).max(probe as f64) as u64;
        gateway::redis_benchmark(redis, line, connections, n)
    }

    fn run_gateway(
        &self,
        repeat: u32,
        g: &Gateway,
        ga: &Gateway,
        redis: &Redis,
        (sha, batch_sha): (&str, &str),
        script: &Path,
    ) -> Result<GatewayRun> {
        let mut load = wrk::Load {
            url: g.url("/v1/check"),
            script,
            script_args: vec![gateway::CLIENTS.to_string()],
            threads: self.args.threads,
            connections: self.args.connections,
            seconds: self.args.warmup.max(1),
        };
        wrk::run(&load).context("gateway warm-up")?;
        load.seconds = self.args.seconds;
        let before = machine::CpuSnapshot::take(&self.infra_pids);
        // Non-2xx answers (503: Redis timed out) are counted in the report.
        // The two gateways take turns going first, so that neither always
        // meets the Redis the other one warmed.
        let mut auth = load.clone();
        auth.url = ga.url("/v1/check");
        auth.script_args.push(AUTH_TOKEN.to_string());
        auth.seconds = self.args.warmup.max(1);
        wrk::run(&auth).context("authenticating gateway warm-up")?;
        auth.seconds = self.args.seconds;
        // Each gateway's own CPU time per check, from /proc around its run.
        let timed = |l: &wrk::Load, gw: &Gateway| -> Result<(wrk::WrkResult, f64)> {
            let pid = gw.pid().context("the gateway has no pid")?;
            let cpu = machine::process_cpu_seconds(pid, false);
            let r = wrk::run(l)?;
            let cpu = machine::process_cpu_seconds(pid, false) - cpu;
            let per_check = cpu * 1e6 / r.requests.max(1) as f64;
            Ok((r, per_check))
        };
        let ((gateway, gateway_cpu_us), (gateway_auth, gateway_auth_cpu_us)) =
            if repeat.is_multiple_of(2) {
                let plain = timed(&load, g)?;
                (plain, timed(&auth, ga)?)
            } else {
                let with_auth = timed(&auth, ga)?;
                (timed(&load, g)?, with_auth)
            };
        let tokens = std::fs::read_to_string(self.args.work_dir.join("gateway-tokens"))
            .context("reading the bench's token file")?;
        let lookup = lookup::measure(
            &[D_JSON, E_JSON, DF_JSON],
            &tokens,
            AUTH_TOKEN,
            gateway::CLIENTS,
            Duration::from_millis(500),
        )
        .context("timing authentication and the policy lookup")?;
        let grpc_dir = self.args.work_dir.join("grpc-load");
        gateway::grpc_load(
            g,
            self.grpc_port,
            self.args.connections,
            self.args.warmup.max(1),
            &grpc_dir,
        )
        .context("gRPC warm-up")?;
        let grpc = gateway::grpc_load(
            g,
            self.grpc_port,
            self.args.connections,
            self.args.seconds,
            &grpc_dir,
        )?;
        let line = gateway::evalsha_args(sha, "c__rand_int__");
        let redis_result = self.redis_benchmark_timed(redis, line, 20_000)?;
        // Batches: the plain gateway's /v3/check, then the batch script raw.
        let mut batched = load.clone();
        batched.url = g.url("/v3/check");
        batched.script_args = vec![
            gateway::CLIENTS.to_string(),
            String::new(),
            gateway::BATCH_CHECKS.to_string(),
        ];
        batched.seconds = self.args.warmup.max(1);
        wrk::run(&batched).context("batch warm-up")?;
        batched.seconds = self.args.seconds;
        let batch = wrk::run(&batched)?;
        let line = gateway::batch_evalsha_args(batch_sha, "c__rand_int__");
        let redis_batch = self.redis_benchmark_timed(redis, line, 2_000)?;
        let after = machine::CpuSnapshot::take(&self.infra_pids);
        Ok(GatewayRun {
            repeat,
            gateway,
            gateway_auth,
            gateway_cpu_us,
            gateway_auth_cpu_us,
            lookup,
            grpc: grpc.result,
            grpc_generator_share: grpc.generator_cpu_s / grpc.gateway_cpu_s.max(1e-9),
            redis: redis_result,
            batch,
            redis_batch,
            foreign_cpu: before.foreign_share(&after, self.nproc),
        })
    }
}
