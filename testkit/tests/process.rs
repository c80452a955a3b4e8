//! The process layer's promises, on real programs: a child dies with the
//! thread that started it, and a start that fails because a port is taken is
//! recognised the same way for every program.

use std::time::{Duration, Instant};

use testkit::process::has_exited;
use testkit::redis::Redis;

#[test]
fn a_redis_dies_with_the_thread_that_started_it() {
    let pid = std::thread::spawn(|| {
        let redis = Redis::start().unwrap_or_else(|e| panic!("{e:#}"));
        let pid = redis.pid().unwrap_or_else(|| panic!("no pid"));
        // Not dropped: only the parent-death signal can stop it now.
        std::mem::forget(redis);
        pid
    })
    .join()
    .unwrap_or_else(|_| panic!("the starting thread panicked"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !has_exited(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let alive = !has_exited(pid);
    if alive {
        // Clean up what the old code leaves behind.
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
    assert!(
        !alive,
        "redis-server {pid} outlived the thread that started it by 5 s"
    );
}

/// A plugin configuration with one global rule, for a gateway's policy.
const POLICY: &str = r#"{
    "domain": "process-test",
    "global": { "cluster": "ratelimit_gateway" },
    "rules": [{ "name": "r", "scope": "global", "key": ["client"],
                "limits": [{ "requests": 1, "per": "1h" }] }]
}"#;

/// Envoy, the gateway and redis-server each started on a port another
/// socket holds: every one fails at once (fixed ports are not retried) with
/// the failure read as a port clash, from each program's own log line.
#[test]
fn a_taken_port_reads_as_a_clash_for_every_program() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let taken = holder.local_addr().unwrap_or_else(|e| panic!("{e}")).port();
    let clash = "attempt 1 of 1, a port was taken";

    let mut redis = Redis::start().unwrap_or_else(|e| panic!("{e:#}"));
    let ports = testkit::Ports {
        listen: taken,
        ..testkit::Ports::free().unwrap_or_else(|e| panic!("{e}"))
    };
    let envoy = testkit::Envoy::start(testkit::EnvoyOptions::new(POLICY).ports(ports));
    let err = format!(
        "{:#}",
        envoy.err().unwrap_or_else(|| panic!("Envoy started"))
    );
    assert!(err.contains(clash), "Envoy: {err}");

    let gateway = testkit::Gateway::start(
        testkit::GatewayOptions::new(redis.url())
            .policy(POLICY)
            .port(taken),
    );
    let err = format!(
        "{:#}",
        gateway
            .err()
            .unwrap_or_else(|| panic!("the gateway started"))
    );
    assert!(err.contains(clash), "gateway: {err}");

    // redis-server: its own port, taken while it was down.
    let port = redis.port();
    redis.kill();
    let _holder2 =
        std::net::TcpListener::bind(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
    let err = format!(
        "{:#}",
        redis
            .restart()
            .err()
            .unwrap_or_else(|| panic!("Redis restarted"))
    );
    assert!(err.contains(clash), "redis-server: {err}");
}
