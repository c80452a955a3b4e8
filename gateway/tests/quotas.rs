//! Calendar quotas: counted in the same atomic call as the rate limits, all
//! or nothing, on a single Redis and across the slots of a Redis Cluster.
//!
//! Expected period bounds come from [`cal`], a deliberately naive calendar
//! (days counted year by year and month by month) that shares nothing with
//! the Lua's Hinnant arithmetic. Tests that cross a period boundary check
//! through the gateway's limiter on a `FixedClock` ([`at`]): the scripts
//! then take that time instead of Redis `TIME` (keys still expire).

mod common;

use std::time::{SystemTime, UNIX_EPOCH};

use common::*;
use ratelimit_gateway::redis::keys::{group_by_slot, limit_keys, quota_keys};
use ratelimit_gateway::Target;
use serde_json::{json, Value};

const HOUR: u64 = 3_600_000;

/// A naive proleptic Gregorian calendar in UTC, in ms since the epoch.
mod cal {
    pub const DAY_MS: u64 = 86_400_000;

    pub fn leap(y: u64) -> bool {
        (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400)
    }

    pub fn month_days(y: u64, m: u64) -> u64 {
        match m {
            2 if leap(y) => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        }
    }

    fn year_days(y: u64) -> u64 {
        if leap(y) {
            366
        } else {
            365
        }
    }

    /// Days from 1970-01-01 to y-m-d.
    pub fn days(y: u64, m: u64, d: u64) -> u64 {
        (1970..y).map(year_days).sum::<u64>() + (1..m).map(|mm| month_days(y, mm)).sum::<u64>() + d
            - 1
    }

    /// y-m-d h:mi:s.ms UTC in ms since the epoch.
    pub fn ms(y: u64, m: u64, d: u64, h: u64, mi: u64, s: u64, ms: u64) -> u64 {
        days(y, m, d) * DAY_MS + h * 3_600_000 + mi * 60_000 + s * 1000 + ms
    }

    /// The date of a day number.
    pub fn civil(mut days: u64) -> (u64, u64, u64) {
        let mut y = 1970;
        while days >= year_days(y) {
            days -= year_days(y);
            y += 1;
        }
        let mut m = 1;
        while days >= month_days(y, m) {
            days -= month_days(y, m);
            m += 1;
        }
        (y, m, days + 1)
    }

    /// (start, end) in ms of the period holding `t`.
    pub fn period(period: &str, t: u64) -> (u64, u64) {
        let len = match period {
            "minute" => 60_000,
            "hour" => 3_600_000,
            "day" => DAY_MS,
            "month" => {
                let (y, m, _) = civil(t / DAY_MS);
                let start = days(y, m, 1) * DAY_MS;
                return (start, start + month_days(y, m) * DAY_MS);
            }
            other => panic!("no period {other}"),
        };
        (t / len * len, t / len * len + len)
    }

    #[test]
    fn the_naive_calendar_itself() {
        assert_eq!(days(1970, 1, 1), 0);
        assert_eq!(days(2000, 3, 1), 11_017);
        assert_eq!(ms(2026, 1, 1, 0, 0, 0, 0), 1_767_225_600_000);
        assert_eq!(civil(days(2028, 2, 29)), (2028, 2, 29));
        assert_eq!(civil(days(2100, 3, 1) - 1), (2100, 2, 28));
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn groups(body: &Value) -> usize {
    let req = resolve(body);
    group_by_slot(limit_keys("rl:", &req), quota_keys("rl:", &req)).len()
}

/// `{allowed, remaining, reset_ms}` of a quota answer, checked for exactly
/// these fields and the enforced `limit` and `period`.
fn q(body: &Value, i: usize) -> (bool, u64, u64) {
    let v = quota_of(body, i);
    assert_eq!(v.as_object().map(|o| o.len()), Some(5), "{body}");
    (
        v["allowed"].as_bool().unwrap(),
        v["remaining"].as_u64().unwrap(),
        v["reset_ms"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_quota_counts_to_its_limit_then_denies_until_the_1st() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let rate: &[L] = &[(100, HOUR, "token_bucket")];
    let body = with_quotas(
        request("demo", 1, &[("per-client/c=alice", "c=alice", rate)]),
        &[quota("demo", "monthly/c=alice", "c=alice", 3, "month", 1)],
    );
    for left in [2, 1, 0] {
        let (status, resp) = check(&client, &gw.url(), &body).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(resp["allowed"], true, "{resp}");
        assert!(q(&resp, 0).0, "{resp}");
        assert_eq!(q(&resp, 0).1, left, "{resp}");
    }
    let before = now_ms();
    let (status, resp) = check(&client, &gw.url(), &body).await;
    let after = now_ms();
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["version"], 2);
    assert_eq!(resp["allowed"], false, "{resp}");
    let (allowed, remaining, reset) = q(&resp, 0);
    assert!(!allowed && remaining == 0, "{resp}");
    // Until the next 1st of the month, 00:00 UTC (± 1 s).
    let (start, end) = cal::period("month", after);
    assert!(
        reset + before + 1000 >= end && reset + after <= end + 1000,
        "reset_ms {reset}, next month starts in {} ms: {resp}",
        end - after
    );
    // The rate limit passed: it reports what it would have left, and was
    // not charged.
    assert_eq!(limit(&resp, 0, 0)["allowed"], true, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["remaining"], 96, "{resp}");
    let (_, only_rate) = check(
        &client,
        &gw.url(),
        &request("demo", 1, &[("per-client/c=alice", "c=alice", rate)]),
    )
    .await;
    assert_eq!(limit(&only_rate, 0, 0)["remaining"], 96, "{only_rate}");
    assert!(only_rate.get("quotas").is_none(), "{only_rate}");

    // The key names its period and expires at its end.
    let key = format!(
        "rl:{{demo|c=alice}}|q|monthly/c=alice|month|{}",
        start / 1000
    );
    assert_eq!(redis.cli(&["get", &key]).unwrap(), "3");
    assert_eq!(
        redis.cli(&["pexpiretime", &key]).unwrap(),
        end.to_string(),
        "{key}"
    );
    let base = &gw.url();
    let sample = "ratelimit_gateway_quota_denials_total{period=\"month\"}";
    assert_eq!(metric(&client, base, sample).await, 1.0);
    let sample = "ratelimit_gateway_denials_total{algorithm=\"token_bucket\"}";
    assert_eq!(metric(&client, base, sample).await, 0.0);
    let sample = "ratelimit_gateway_checks_total{result=\"denied\"}";
    assert_eq!(metric(&client, base, sample).await, 1.0);
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_or_nothing_with_the_rate_limits() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let base = &gw.url();

    // A rate-limit denial charges no quota.
    let narrow: &[L] = &[(1, HOUR, "sliding_window")];
    let monthly = quota("aon", "monthly/c=x", "c=x", 10, "month", 1);
    let body = with_quotas(
        request("aon", 1, &[("narrow", "c=x", narrow)]),
        std::slice::from_ref(&monthly),
    );
    let (_, first) = check(&client, base, &body).await;
    assert_eq!(first["allowed"], true, "{first}");
    assert_eq!(q(&first, 0).1, 9);
    let (_, second) = check(&client, base, &body).await;
    assert_eq!(second["allowed"], false, "{second}");
    assert_eq!(limit(&second, 0, 0)["allowed"], false, "{second}");
    // The quota passes on its own, and reports its uncharged state.
    assert!(q(&second, 0).0, "{second}");
    assert_eq!(q(&second, 0).1, 9, "{second}");
    let (_, only_quota) = check(&client, base, &quota_request("aon", &[monthly])).await;
    assert_eq!(only_quota["allowed"], true, "{only_quota}");
    assert_eq!(only_quota["buckets"], json!([]), "{only_quota}");
    assert_eq!(q(&only_quota, 0).1, 8, "{only_quota}");

    // A quota denial charges no bucket (nor the other quotas).
    let wide: &[L] = &[(10, HOUR, "token_bucket"), (10, HOUR, "token_bucket")];
    let daily = quota("aon", "daily/c=y", "c=y", 1, "day", 1);
    let hourly = quota("aon", "hourly/c=y", "c=y", 5, "hour", 1);
    let body = with_quotas(
        request("aon", 1, &[("wide", "c=y", wide)]),
        &[hourly.clone(), daily],
    );
    let (_, first) = check(&client, base, &body).await;
    assert_eq!(first["allowed"], true, "{first}");
    assert_eq!((q(&first, 0).1, q(&first, 1).1), (4, 0), "{first}");
    let (_, second) = check(&client, base, &body).await;
    assert_eq!(second["allowed"], false, "{second}");
    assert_eq!(limit(&second, 0, 0)["allowed"], true, "{second}");
    assert_eq!(limit(&second, 0, 0)["remaining"], 8, "{second}");
    assert_eq!(q(&second, 0), (true, 4, q(&second, 0).2), "{second}");
    assert_eq!(q(&second, 1), (false, 0, q(&second, 1).2), "{second}");
    let rate_and_hourly = with_quotas(request("aon", 1, &[("wide", "c=y", wide)]), &[hourly]);
    let (_, third) = check(&client, base, &rate_and_hourly).await;
    assert_eq!(third["allowed"], true, "{third}");
    assert_eq!(limit(&third, 0, 0)["remaining"], 8, "{third}");
    assert_eq!(limit(&third, 0, 1)["remaining"], 8, "{third}");
    assert_eq!(q(&third, 0).1, 3, "{third}");
    let sample = "ratelimit_gateway_quota_denials_total{period=\"day\"}";
    assert_eq!(metric(&client, base, sample).await, 1.0);
    let sample = "ratelimit_gateway_quota_denials_total{period=\"hour\"}";
    assert_eq!(metric(&client, base, sample).await, 0.0);
    let sample = "ratelimit_gateway_denials_total{algorithm=\"sliding_window\"}";
    assert_eq!(metric(&client, base, sample).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spent_quotas_amounts_and_a_lowered_limit() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let base = &gw.url();

    // limit 0: spent; nothing written.
    let (_, resp) = check(
        &client,
        base,
        &quota_request("s", &[quota("s", "zero", "c=z", 0, "month", 1)]),
    )
    .await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert!(!q(&resp, 0).0);
    assert_eq!(q(&resp, 0).1, 0);
    assert_eq!(redis.cli(&["dbsize"]).unwrap(), "0");

    // An amount (the request's cost): 4 + 4 fit in 10, a third 4 does not.
    let cost = quota_request("s", &[quota("s", "cost", "c=c", 10, "day", 4)]);
    for left in [6, 2] {
        let (_, resp) = check(&client, base, &cost).await;
        assert_eq!(
            (resp["allowed"].as_bool(), q(&resp, 0).1),
            (Some(true), left)
        );
    }
    let (_, resp) = check(&client, base, &cost).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!((q(&resp, 0).0, q(&resp, 0).1), (false, 2), "{resp}");
    // 2 still fit.
    let two = quota_request("s", &[quota("s", "cost", "c=c", 10, "day", 2)]);
    let (_, resp) = check(&client, base, &two).await;
    assert_eq!((resp["allowed"].as_bool(), q(&resp, 0).1), (Some(true), 0));

    // The limit is not in the key: a lowered limit (another tier) keeps the
    // count, and remaining is never negative.
    let lowered = quota_request("s", &[quota("s", "cost", "c=c", 3, "day", 1)]);
    let (_, resp) = check(&client, base, &lowered).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!(q(&resp, 0).1, 0, "{resp}");
    let raised = quota_request("s", &[quota("s", "cost", "c=c", 15, "day", 1)]);
    let (_, resp) = check(&client, base, &raised).await;
    assert_eq!((resp["allowed"].as_bool(), q(&resp, 0).1), (Some(true), 4));

    // Twice the same quota.
    let twice = quota_request(
        "s",
        &[
            quota("s", "dup", "c=d", 3, "hour", 1),
            quota("s", "dup", "c=d", 3, "hour", 1),
        ],
    );
    // The same quota twice in one call is refused: one per quota of the policy.
    let (status, resp) = check(&client, base, &twice).await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(
        resp["error"],
        "quotas[1].quota: quota `dup` named twice in one request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_get_exactly_the_quota() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 5000).await;
    let body = with_quotas(
        request(
            "burst",
            1,
            &[("rate", "c=b", &[(1000, HOUR, "token_bucket")])],
        ),
        &[quota("burst", "q", "c=b", 100, "month", 1)],
    );
    let (allowed, denied, other) = burst(&gw.url(), body, 64, 300).await;
    eprintln!(
        "quota 100, 64 clients, 300 requests: {allowed} allowed, {denied} denied, {other} errors"
    );
    assert_eq!((allowed, denied, other), (100, 200, 0));
    let client = reqwest::Client::new();
    let only_rate = request(
        "burst",
        1,
        &[("rate", "c=b", &[(1000, HOUR, "token_bucket")])],
    );
    let (_, resp) = check(&client, &gw.url(), &only_rate).await;
    assert_eq!(limit(&resp, 0, 0)["remaining"], 1000 - 101, "{resp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_count_survives_a_gateway_restart() {
    let redis = redis();
    let client = reqwest::Client::new();
    let body = quota_request(
        "restart",
        &[quota("restart", "monthly/c=r", "c=r", 3, "month", 1)],
    );
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    for left in [2, 1] {
        let (_, resp) = check(&client, &gw.url(), &body).await;
        assert_eq!(q(&resp, 0), (true, left, q(&resp, 0).2), "{resp}");
    }
    let old = gw.url();
    gw.stop().await.unwrap();
    assert!(client.get(format!("{old}/healthz")).send().await.is_err());

    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let (_, resp) = check(&client, &gw.url(), &body).await;
    assert_eq!(q(&resp, 0), (true, 0, q(&resp, 0).2), "{resp}");
    let (_, resp) = check(&client, &gw.url(), &body).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_month_starts_fresh() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let body = quota_request(
        "fresh",
        &[quota("fresh", "monthly/c=f", "c=f", 2, "month", 1)],
    );
    let march = cal::ms(2027, 3, 15, 12, 0, 0, 0);
    let last_ms = cal::ms(2027, 3, 31, 23, 59, 59, 999);
    let april = cal::ms(2027, 4, 1, 0, 0, 0, 0);
    assert_eq!(last_ms + 1, april);

    let resp = check_at(&gw, &body, march).await;
    assert_eq!(q(&resp, 0), (true, 1, april - march), "{resp}");
    let resp = check_at(&gw, &body, last_ms - 1).await;
    assert_eq!(q(&resp, 0), (true, 0, 2), "{resp}");
    let resp = check_at(&gw, &body, last_ms).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!(q(&resp, 0), (false, 0, 1), "{resp}");
    let resp = check_at(&gw, &body, april).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    assert_eq!(q(&resp, 0), (true, 1, 30 * cal::DAY_MS), "{resp}");

    // One key per period; it expires when its period ends (April: 30 days
    // after the check at its first ms), whatever clock the script ran on.
    let key = |start_ms: u64| format!("rl:{{fresh|c=f}}|q|monthly/c=f|month|{}", start_ms / 1000);
    let march_key = key(cal::ms(2027, 3, 1, 0, 0, 0, 0));
    assert_eq!(redis.cli(&["get", &march_key]).unwrap(), "2");
    assert_eq!(redis.cli(&["get", &key(april)]).unwrap(), "1");
    let pttl: u64 = redis.cli(&["pttl", &key(april)]).unwrap().parse().unwrap();
    assert!(
        (30 * cal::DAY_MS - 60_000..=30 * cal::DAY_MS).contains(&pttl),
        "PTTL {pttl}"
    );

    // A late check of the old month (a replica's request in flight) still
    // sees its own count and never touches the new month's key.
    let resp = check_at(&gw, &body, last_ms).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!(redis.cli(&["get", &key(april)]).unwrap(), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_at_the_end_of_their_period_in_real_time() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let lengths = [
        ("minute", 60_000),
        ("hour", HOUR),
        ("day", cal::DAY_MS),
        ("month", 31 * cal::DAY_MS),
    ];
    let quotas: Vec<Value> = lengths
        .iter()
        .map(|(p, _)| quota("exp", &format!("{p}/c=e"), "c=e", 10, p, 1))
        .collect();
    let before = now_ms();
    let (_, resp) = check(&client, &gw.url(), &quota_request("exp", &quotas)).await;
    let after = now_ms();
    assert_eq!(resp["allowed"], true, "{resp}");
    for (i, (period, longest)) in lengths.iter().enumerate() {
        let pattern = format!("rl:{{exp|c=e}}|q|{period}/c=e|{period}|*");
        let keys = redis.cli(&["keys", &pattern]).unwrap();
        let start_s: u64 = keys
            .rsplit('|')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no single key for {pattern}: {keys:?}"));
        // The period of Redis' clock at the check, as the naive calendar has it.
        let (start, end) = cal::period(period, start_s * 1000);
        assert_eq!(start, start_s * 1000, "{keys}: not a {period} start");
        assert!(
            (start..end).contains(&before) || (start..end).contains(&after),
            "{keys}: {before}..{after} is not in that {period}"
        );
        let expire: u64 = redis.cli(&["pexpiretime", &keys]).unwrap().parse().unwrap();
        assert_eq!(expire, end, "{period}: PEXPIRETIME of {keys}");
        let pttl: u64 = redis.cli(&["pttl", &keys]).unwrap().parse().unwrap();
        assert!(pttl > 0 && pttl <= *longest, "{period}: PTTL {pttl}");
        if *period == "minute" {
            assert_eq!(expire % 60_000, 0);
            assert!(pttl <= 60_000);
        }
        // reset_ms is the time left until then (± 1 s of clock reading).
        let reset = q(&resp, i).2;
        assert!(
            reset + before + 1000 >= end && reset + after <= end + 1000,
            "{period}: reset_ms {reset}, end {end}, now {before}..{after}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn day_and_month_boundaries_leap_years_and_new_year() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let day = quota_request("b", &[quota("b", "daily", "c=b", 1, "day", 1)]);
    let month = quota_request("b", &[quota("b", "monthly", "c=b", 1, "month", 1)]);
    let minute = quota_request("b", &[quota("b", "per-minute", "c=b", 1, "minute", 1)]);
    let hour = quota_request("b", &[quota("b", "hourly", "c=b", 1, "hour", 1)]);

    // Feb 28 → Feb 29 → Mar 1, 2028 (a leap year), by day.
    let feb28_last = cal::ms(2028, 2, 28, 23, 59, 59, 999);
    let feb29 = cal::ms(2028, 2, 29, 0, 0, 0, 0);
    let mar1 = cal::ms(2028, 3, 1, 0, 0, 0, 0);
    assert_eq!(feb28_last + 1, feb29);
    assert_eq!(feb29 + cal::DAY_MS, mar1);
    let resp = check_at(&gw, &day, feb28_last).await;
    assert_eq!(q(&resp, 0), (true, 0, 1), "{resp}");
    assert_eq!(q(&check_at(&gw, &day, feb28_last).await, 0), (false, 0, 1));
    assert_eq!(
        q(&check_at(&gw, &day, feb29).await, 0),
        (true, 0, cal::DAY_MS)
    );
    assert_eq!(q(&check_at(&gw, &day, mar1 - 1).await, 0), (false, 0, 1));
    assert_eq!(
        q(&check_at(&gw, &day, mar1).await, 0),
        (true, 0, cal::DAY_MS)
    );
    let key = format!("rl:{{b|c=b}}|q|daily/c=b|day|{}", feb29 / 1000);
    assert_eq!(redis.cli(&["get", &key]).unwrap(), "1");

    // February 2028 has 29 days, by month.
    let feb10 = cal::ms(2028, 2, 10, 8, 30, 0, 0);
    let resp = check_at(&gw, &month, feb10).await;
    assert_eq!(q(&resp, 0), (true, 0, mar1 - feb10), "{resp}");
    assert_eq!(mar1 - cal::ms(2028, 2, 1, 0, 0, 0, 0), 29 * cal::DAY_MS);
    assert_eq!(q(&check_at(&gw, &month, mar1 - 1).await, 0), (false, 0, 1));
    let resp = check_at(&gw, &month, mar1).await;
    assert_eq!(q(&resp, 0), (true, 0, 31 * cal::DAY_MS), "{resp}");

    // December → January.
    let new_year = cal::ms(2028, 1, 1, 0, 0, 0, 0);
    let dec = cal::ms(2027, 12, 1, 0, 0, 0, 0);
    assert_eq!(
        q(&check_at(&gw, &month, dec).await, 0),
        (true, 0, 31 * cal::DAY_MS)
    );
    assert_eq!(
        q(&check_at(&gw, &month, new_year - 1).await, 0),
        (false, 0, 1)
    );
    assert_eq!(q(&check_at(&gw, &day, new_year - 1).await, 0), (true, 0, 1));
    assert_eq!(
        q(&check_at(&gw, &hour, new_year - 1).await, 0),
        (true, 0, 1)
    );
    assert_eq!(
        q(&check_at(&gw, &minute, new_year - 1).await, 0),
        (true, 0, 1)
    );
    for (body, len) in [
        (&month, 31 * cal::DAY_MS),
        (&day, cal::DAY_MS),
        (&hour, HOUR),
        (&minute, 60_000),
    ] {
        let resp = check_at(&gw, body, new_year).await;
        assert_eq!(q(&resp, 0), (true, 0, len), "{resp}");
        assert_eq!(
            q(&check_at(&gw, body, new_year + len - 1).await, 0),
            (false, 0, 1)
        );
    }
    let key = format!("rl:{{b|c=b}}|q|monthly/c=b|month|{}", new_year / 1000);
    assert_eq!(redis.cli(&["get", &key]).unwrap(), "1");
    let key = format!("rl:{{b|c=b}}|q|monthly/c=b|month|{}", dec / 1000);
    assert_eq!(redis.cli(&["get", &key]).unwrap(), "1");

    // Century rules: 2100 is not a leap year, 2000 is; 2027 is not.
    for (y, feb) in [(2000, 29), (2027, 28), (2100, 28), (2400, 29)] {
        let t = cal::ms(y, 2, 1, 0, 0, 0, 0);
        let resp = check_at(&gw, &month, t).await;
        assert_eq!(q(&resp, 0).2, feb * cal::DAY_MS, "February {y}: {resp}");
    }
}

/// Every period's end, from the script, against the naive calendar: month
/// starts ± 1 ms (1970–1972, 1999–2101) and scattered instants up to 2400. A
/// spent quota (limit 0) writes nothing, so one key set serves every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn period_ends_match_an_independent_calendar() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let periods = ["minute", "hour", "day", "month"];
    let quotas: Vec<Value> = periods
        .iter()
        .map(|p| quota("sweep", p, "c", 0, p, 1))
        .collect();
    let body = quota_request("sweep", &quotas);
    let mut times = vec![0, 1, 999, 1000];
    for y in (1970..=1972).chain(1999..=2101) {
        for m in 1..=12 {
            let t = cal::ms(y, m, 1, 0, 0, 0, 0);
            times.extend([t.saturating_sub(1), t, t + 1]);
        }
    }
    let mut t: u64 = 0;
    let end = cal::ms(2400, 1, 1, 0, 0, 0, 0);
    while t < end {
        times.push(t);
        t += 37 * cal::DAY_MS + 7 * HOUR + 13 * 60_000 + 17_123;
    }
    for &t in &times {
        let resp = check_at(&gw, &body, t).await;
        for (i, p) in periods.iter().enumerate() {
            let (_, end) = cal::period(p, t);
            assert_eq!(
                q(&resp, i),
                (false, 0, end - t),
                "{p} at {t} ({:?})",
                cal::civil(t / cal::DAY_MS)
            );
        }
    }
    assert_eq!(redis.cli(&["dbsize"]).unwrap(), "0");
    eprintln!("{} instants × 4 periods agree", times.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_quota_fields_get_400_with_the_field_path() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let good = with_quotas(
        request("badq", 1, &[("k", "t", &[(10, 1000, "token_bucket")])]),
        &[quota("badq", "monthly/c=a", "c=a", 100, "month", 1)],
    );
    type Change = fn(&mut Value);
    let cases: Vec<(Change, &str)> = vec![
        (
            |v| v["quotas"][0]["period"] = json!("week"),
            "quotas[0].period: unknown field `period`",
        ),
        (
            |v| v["quotas"][0]["limit"] = json!((1u64 << 50) + 1),
            "quotas[0].limit: unknown field `limit`",
        ),
        (
            |v| v["quotas"][0]["variant"] = json!("tier:gold"),
            "quotas[0].variant: not a variant this key may use",
        ),
        (
            |v| v["quotas"][0]["quota"] = json!("yearly"),
            "quotas[0].quota: unknown quota `yearly` in domain `badq`",
        ),
        (
            |v| v["quotas"][0]["amount"] = json!(0),
            "quotas[0].amount: must be between 1 and 2^53, got 0",
        ),
        (
            |v| v["quotas"][0]["amount"] = json!((1u64 << 53) + 1),
            "quotas[0].amount: must be between 1 and 2^53, got 9007199254740993",
        ),
        (
            |v| v["quotas"][0]["key"] = json!(""),
            "quotas[0].key: must not be empty",
        ),
        (
            |v| v["quotas"][0]["key"] = json!("k".repeat(513)),
            "quotas[0].key: must be at most 512 bytes, got 513",
        ),
        (
            |v| v["quotas"][0]["tag"] = json!("t".repeat(513)),
            "quotas[0].tag: must be at most 512 bytes, got 513",
        ),
        (
            |v| {
                v["quotas"][0].as_object_mut().unwrap().remove("amount");
            },
            "quotas[0]: missing field `amount`",
        ),
        (
            |v| v["quotas"][0]["upgrade_url"] = json!("https://x"),
            "quotas[0].upgrade_url: unknown field `upgrade_url`",
        ),
        (
            |v| {
                let second = json!({"quota":"monthly","key":"monthly","tag":"","variant":"default","amount":"1"});
                v["quotas"].as_array_mut().unwrap().push(second);
            },
            "quotas[1].amount: invalid type: string \"1\"",
        ),
        (
            |v| v["quotas"] = json!(vec![v["quotas"][0].clone(); 65]),
            "quotas: must hold at most 64 quotas, got 65",
        ),
        (|v| v["quotas"] = json!({}), "quotas: invalid type: map"),
        (
            |v| {
                v["buckets"] = json!([]);
                v["quotas"] = json!([]);
            },
            "buckets: must hold 1 to 64 buckets, got 0",
        ),
    ];
    let n = cases.len();
    for (change, want) in cases {
        let mut body = good.clone();
        change(&mut body);
        let (status, resp) = check(&client, &gw.url(), &body).await;
        assert_eq!(status, 400, "{resp}");
        assert_eq!(resp["version"], 2);
        let err = resp["error"].as_str().unwrap();
        assert!(err.starts_with(want), "{err:?} should start with {want:?}");
    }
    assert_eq!(redis.cli(&["dbsize"]).unwrap(), "0");
    let sample = "ratelimit_gateway_errors_total{kind=\"bad_request\"}";
    assert_eq!(metric(&client, &gw.url(), sample).await, n as f64);
    // The good one passes.
    let (status, resp) = check(&client, &gw.url(), &good).await;
    assert_eq!((status, &resp["allowed"]), (200, &json!(true)), "{resp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_quotas_all_or_nothing_across_slots() {
    let cluster = redis_cluster();
    let gw = gateway(Target::Cluster(cluster.seeds()), 5000).await;
    let client = reqwest::Client::new();
    let base = &gw.url();
    let refunds = "ratelimit_gateway_refunds_total";

    // Quotas on the three masters (these tags of domain "demo" hash to
    // slots on all three; see cluster.rs), one slot group each, in one call.
    let tags = ["c=alice", "c=frank", "t=a"];
    let spread: Vec<Value> = tags
        .iter()
        .enumerate()
        .map(|(i, t)| quota("demo", &format!("q{i}/{t}"), t, 2, "month", 1))
        .collect();
    let body = quota_request("demo", &spread);
    assert_eq!(groups(&body), 3);
    for left in [1, 0] {
        let (_, resp) = check(&client, base, &body).await;
        assert_eq!(resp["allowed"], true, "{resp}");
        for i in 0..3 {
            assert_eq!(q(&resp, i).1, left, "{resp}");
        }
    }
    let (_, resp) = check(&client, base, &body).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    // Per master: its quota key and the domain's ledger of live keys in that slot.
    let sizes = cluster.cli_each(&["dbsize"]).unwrap();
    assert!(sizes.iter().all(|s| s == "2"), "keys on {sizes:?}");

    // A quota denial in a later slot group refunds the bucket charged before.
    let wide: &[L] = &[(10, HOUR, "token_bucket")];
    let body = with_quotas(
        request("x", 1, &[("wide", "t=a", wide)]),
        &[quota("x", "monthly", "t=b", 1, "month", 1)],
    );
    assert_eq!(groups(&body), 2);
    let (_, first) = check(&client, base, &body).await;
    assert_eq!(first["allowed"], true, "{first}");
    let refunds_before = metric(&client, base, refunds).await;
    let (_, second) = check(&client, base, &body).await;
    assert_eq!(second["allowed"], false, "{second}");
    assert!(!q(&second, 0).0, "{second}");
    assert_eq!(limit(&second, 0, 0)["allowed"], true, "{second}");
    assert_eq!(metric(&client, base, refunds).await, refunds_before + 1.0);
    let (_, only_rate) = check(&client, base, &request("x", 1, &[("wide", "t=a", wide)])).await;
    assert_eq!(limit(&only_rate, 0, 0)["remaining"], 8, "{only_rate}");

    // A rate-limit denial in a later slot group refunds the quota charged
    // with an earlier group (same tag as the first bucket).
    let narrow: &[L] = &[(1, HOUR, "sliding_window")];
    let monthly = quota("y", "monthly", "t=b", 10, "month", 1);
    let body = with_quotas(
        request("y", 1, &[("wide", "t=b", wide), ("narrow", "t=a", narrow)]),
        std::slice::from_ref(&monthly),
    );
    assert_eq!(groups(&body), 2);
    let (_, first) = check(&client, base, &body).await;
    assert_eq!(first["allowed"], true, "{first}");
    assert_eq!(q(&first, 0).1, 9, "{first}");
    let (_, second) = check(&client, base, &body).await;
    assert_eq!(second["allowed"], false, "{second}");
    assert_eq!(limit(&second, 1, 0)["allowed"], false, "{second}");
    // The quota passed and was refunded: it reports its state before the request.
    assert!(q(&second, 0).0, "{second}");
    assert_eq!(q(&second, 0).1, 9, "{second}");
    let (start, _) = cal::period("month", now_ms());
    let key = format!("rl:{{y|t=b}}|q|monthly/t=b|month|{}", start / 1000);
    assert_eq!(cluster.cli(&["get", &key]).unwrap(), "1");
    let (_, only_quota) = check(&client, base, &quota_request("y", &[monthly])).await;
    assert_eq!(q(&only_quota, 0).1, 8, "{only_quota}");

    // Many clients across two slots: exactly the quota, every denial refunded.
    let body = with_quotas(
        request(
            "cc",
            1,
            &[("rate", "t=a", &[(10_000, 1000 * HOUR, "token_bucket")])],
        ),
        &[quota("cc", "q", "t=b", 100, "month", 1)],
    );
    assert_eq!(groups(&body), 2);
    let (allowed, denied, other) = burst(base, body, 64, 300).await;
    eprintln!("cluster quota 100, 64 clients, 300 cross-slot requests: {allowed} allowed, {denied} denied, {other} errors");
    assert_eq!((allowed, denied, other), (100, 200, 0));
    let (_, resp) = check(
        &client,
        base,
        &request(
            "cc",
            1,
            &[("rate", "t=a", &[(10_000, 1000 * HOUR, "token_bucket")])],
        ),
    )
    .await;
    assert_eq!(limit(&resp, 0, 0)["remaining"], 10_000 - 101, "{resp}");

    // The given time reaches every slot group: a new month on every master.
    let spread_body = quota_request("demo", &spread);
    let next = cal::period("month", now_ms()).1;
    let resp = check_at(&gw, &spread_body, next).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    gw.stop().await.unwrap();
}

/// The filter's own request (`callout::encode_request`) is accepted, and the
/// gateway's answer passes the filter's distrustful reading
/// (`callout::parse_answer`): same quotas, in order, nothing clamped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_filter_s_request_and_answer_round_trip() {
    use ratelimit_wasm::config;
    use ratelimit_wasm::global::callout;
    use ratelimit_wasm::policy::{plan::Plan, request::RequestInfo};
    let json = r#"{"domain":"roundtrip","global":{"cluster":"gw"},
        "tiers":{"free":{}},"identity":{"default_tier":"free"},
        "rules":[{"name":"g","scope":"global","key":["client"],"limits":[{"requests":100,"per":"1h"}]}],
        "quotas":[{"name":"monthly","key":["client"],"period":"month","limit":2,"upgrade_url":"https://x"},
                  {"name":"daily","key":["client"],"period":"day","limit":10,"upgrade_url":"https://x"}]}"#;
    let plan = Plan::compile(&config::parse(json.as_bytes()).unwrap(), [0; 16]);
    let eval = plan.evaluate(&RequestInfo::with_headers(
        &plan.header_names,
        &[(":path", b"/"), ("x-client-id", b"alice")],
    ));
    assert_eq!((eval.global.len(), eval.quotas.len()), (1, 2), "{eval:?}");
    let body = callout::encode_request(&plan, &eval.global, &eval.quotas, None);
    // The gateway's policy is this very configuration.
    add_policy(json);
    sync_policy();

    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let mut seen = Vec::new();
    for _ in 0..3 {
        let resp = client
            .post(format!("{}/v1/check", gw.url()))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let bytes = resp.bytes().await.unwrap();
        let answer = callout::parse_answer(&plan, &eval.global, &eval.quotas, Some(b"200"), &bytes)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&bytes)));
        assert_eq!((answer.clamped, answer.mismatch), (0, false));
        assert_eq!(answer.quotas.len(), 2);
        let reset = answer.quotas[0].reset_ms;
        assert!(reset > 0 && reset <= 31 * cal::DAY_MS, "{reset}");
        seen.push((
            answer.quotas[0].allowed,
            answer.quotas[0].remaining,
            answer.quotas[1].allowed,
            answer.quotas[1].remaining,
        ));
    }
    assert_eq!(
        seen,
        [(true, 1, true, 9), (true, 0, true, 8), (false, 0, true, 8)]
    );
    let start = cal::period("month", now_ms()).0 / 1000;
    let key = format!("rl:{{roundtrip|c=alice}}|q|monthly/c=alice|month|{start}");
    assert_eq!(redis.cli(&["get", &key]).unwrap(), "2");
}
