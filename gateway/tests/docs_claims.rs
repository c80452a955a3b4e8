//! What `gateway/README.md` says, held against the gateway: the flag table is
//! the parser's flags, the metrics table names every metric the gateway
//! exports and every `op` of its Redis calls, a body over 1 MiB gets 413,
//! and a gateway started before its Redis answers 503 (and `/healthz` says
//! down) until Redis is up.

mod common;

use std::time::{Duration, Instant};

use clap::CommandFactory;
use ratelimit_gateway::{Args, Config, Target};

use common::*;

fn readme() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The flag table's rows: (flag, env, default), backticks removed.
fn documented_flags() -> Vec<(String, String, String)> {
    let text = readme();
    let table = text
        .split("| flag | env | default |")
        .nth(1)
        .expect("gateway/README.md has a flag table");
    table
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split('|')
                .map(|c| {
                    // `20` (≥ 1) → 20: the first code span, else the cell.
                    let c = c.trim();
                    c.split('`').nth(1).unwrap_or(c).to_string()
                })
                .collect();
            let cell = |i: usize| cells.get(i).cloned().unwrap_or_default();
            (cell(0), cell(1), cell(2))
        })
        .collect()
}

#[test]
fn the_flag_table_is_the_parsers_flags() {
    let command = Args::command();
    let mut parsed: Vec<(String, String, String)> = command
        .get_arguments()
        .filter_map(|a| {
            let long = a.get_long()?;
            if long == "help" || long == "version" {
                return None;
            }
            let env = a
                .get_env()
                .map(|e| e.to_string_lossy().into_owned())
                .unwrap_or_default();
            let default = a
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(",");
            Some((format!("--{long}"), env, default))
        })
        .collect();
    let mut documented = documented_flags();
    parsed.sort();
    documented.sort();
    assert_eq!(documented, parsed, "gateway/README.md flag table vs clap");
}

#[test]
fn the_metrics_table_names_every_metric_and_redis_op() {
    let text = readme();
    let table = text
        .split("`GET /metrics` (Prometheus text):")
        .nth(1)
        .expect("gateway/README.md has a metrics table");
    let rows: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    let name = |row: &str| row.split('`').nth(1).unwrap_or_default().to_string();
    let mut documented: Vec<String> = rows.iter().map(|r| name(r)).collect();
    let metrics = ratelimit_gateway::metrics::Metrics::new().unwrap();
    // A family with labels but no value yet is not exported: given one.
    metrics.key_budget_refusals.with_label_values(&["d"]);
    let mut exported: Vec<String> = metrics
        .registry()
        .gather()
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    documented.sort();
    exported.sort();
    assert_eq!(
        documented, exported,
        "gateway/README.md metrics table vs the registry"
    );
    let ops = rows
        .iter()
        .find(|r| name(r) == "ratelimit_gateway_redis_duration_seconds")
        .unwrap();
    let listed: Vec<&str> = ops
        .split("`op` = ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .unwrap()
        .split('`')
        .skip(1)
        .step_by(2)
        .collect();
    assert_eq!(
        listed,
        ratelimit_gateway::metrics::OPS,
        "the op label's values"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_one_mebibyte_gets_413_and_is_counted() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{}/v1/check", gw.url()))
        .header("content-type", "application/json")
        .body(vec![b' '; 1024 * 1024 + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 413);
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_errors_total{kind=\"bad_request\"}"
        )
        .await,
        1.0
    );
    assert_eq!(redis.cli(&["DBSIZE"]).unwrap().trim(), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_redis_exists_checks_answer_503_then_recover_when_it_starts() {
    // Take a free port from a Redis that is then stopped, so it can come back there.
    let mut redis = redis();
    redis.kill();
    // Named before the start: the policy is loaded then.
    let body = request("d", 1, &[("k", "t", &[(5, 60_000, "token_bucket")])]);
    let config = Config::single(
        "127.0.0.1:0".parse().unwrap(),
        redis.url(),
        vec![policy_dir()],
    );
    let gw = ratelimit_gateway::start(config, Duration::ZERO)
        .await
        .unwrap();
    let client = reqwest::Client::new();

    let (status, _) = check(&client, &gw.url(), &body).await;
    assert_eq!(status, 503);
    let (status, health) = get(&client, &gw.url(), "/healthz").await;
    assert_eq!(status, 503);
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["status"], "unavailable", "{health}");
    assert_eq!(health["redis"], "down", "{health}");

    redis.restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let (status, answer) = check(&client, &gw.url(), &body).await;
        if status == 200 {
            assert_eq!(answer["allowed"], true, "{answer}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {status} 3 s after Redis came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Health answers from one probe a second: it follows within that.
    let deadline = Instant::now() + Duration::from_secs(3);
    while get(&client, &gw.url(), "/healthz").await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "/healthz not 200 3 s after Redis came up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
