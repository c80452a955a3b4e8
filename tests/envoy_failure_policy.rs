//! What Envoy 1.40 does when the Wasm VM traps, under the `failure_policy`
//! that `envoy/envoy.yaml` ships (`FAIL_RELOAD`).
//!
//! The module is `tests/fixtures/trap-filter` (build it with `cargo build --release
//! --target wasm32-wasip1 -p trap-filter`): it panics in
//! `on_http_request_headers` on `x-trap: 1` (a panic aborts on
//! `wasm32-wasip1`, which traps the VM, exactly as a panic in the real filter
//! would) and otherwise passes, tagging each response with the VM that served
//! it (`x-trap-vm`), that VM's own count (`x-trap-seq`) and a count kept in
//! shared data (`x-trap-shared`). It is rendered into the one template with
//! an empty plugin configuration, so what is tested is the policy users run.
//!
//! Each trap is aimed at one worker (a keep-alive connection stays on the
//! worker that accepted it): worker 0's settled VM, then at once the VM that
//! replaced it, twice; worker 1's settled VM, then its replacement. Measured (Envoy 1.40.0,
//! `--concurrency 2`), and asserted:
//! * the trapping request gets 503 with an empty body; the other worker's VM
//!   serves on untouched;
//! * a fresh VM replaces the trapped one on the same worker (its own count
//!   starts at 1; `wasm.ratelimit.vm_reload_success`) and serves from then
//!   on, and shared data outlives the reload;
//! * the reload backs off from the trapped VM's *load*, not from the trap:
//!   for each request on the failed worker Envoy draws an interval in
//!   [1 s, 1.5 s) and reloads when the VM was loaded longer ago than that. A
//!   VM that had been serving for a while is replaced by the very next
//!   request (no 503 but the trapping request's); a VM that traps within 1 s
//!   of its load (a crash loop) leaves its worker answering 503 to every
//!   request until 1-1.5 s after that load (each counted in
//!   `wasm.ratelimit.vm_reload_backoff`). The wait does not grow.
//!
//! Nothing is skipped: without Envoy or the trap module the test fails and
//! says what to build.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use testkit::{Client, ConnectionMode, Envoy, EnvoyOptions, Response};

/// The reload backoff of the shipped template (no `reload_config`: Envoy's
/// default base interval, 1 s). Envoy draws a fresh interval in
/// [base, 1.5 base) for every request on a failed worker and reloads when the
/// worker's VM was loaded longer ago than that.
const BACKOFF_BASE: Duration = Duration::from_millis(1000);
const BACKOFF_MAX: Duration = Duration::from_millis(1500);

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// `target/wasm32-wasip1/release/trap_filter.wasm`; fails saying how to build it.
fn trap_wasm() -> PathBuf {
    let path = testkit::paths::release_wasm_path("trap_filter.wasm");
    assert!(
        path.is_file(),
        "{} is missing: build it with `cargo build --release --target wasm32-wasip1 -p trap-filter`",
        path.display()
    );
    path
}

/// Who passed a request: the VM's identity, its own count and the shared count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Served {
    vm: u64,
    seq: u64,
    shared: u64,
}

fn served(r: &Response) -> Option<Served> {
    let num = |name: &str| r.header(name).and_then(|v| v.parse::<u64>().ok());
    Some(Served {
        vm: num("x-trap-vm")?,
        seq: num("x-trap-seq")?,
        shared: num("x-trap-shared")?,
    })
}

fn send(c: &Client, trap: bool) -> Response {
    let headers: &[(&str, &str)] = if trap { &[("x-trap", "1")] } else { &[] };
    c.get("/", headers)
        .unwrap_or_else(|e| panic!("GET / (trap: {trap}): {e:#}"))
}

/// A 200 passed by the trap filter; returns who passed it.
fn passed(r: &Response, what: &str) -> Served {
    assert_eq!(r.status, 200, "{what}: {r:#?}");
    assert_eq!(r.body, "ok\n", "{what}: the upstream's body");
    served(r).unwrap_or_else(|| panic!("{what}: no x-trap-* headers: {r:#?}"))
}

/// A keep-alive connection served by the VM `vm`: new connections until one
/// lands on that VM's worker (the kernel spreads connections over the
/// workers; a connection stays on its worker). Its first request is counted
/// in `shared`.
fn connection_to(envoy: &Envoy, vm: u64, shared: &mut u64, round: usize) -> Client {
    for attempt in 0..200 {
        let c = envoy.client(ConnectionMode::KeepAlive);
        let what = format!("round {round}: looking for VM {vm}, attempt {attempt}");
        let s = passed(&send(&c, false), &what);
        assert_eq!(s.shared, *shared + 1, "{what}");
        *shared = s.shared;
        if s.vm == vm {
            return c;
        }
    }
    panic!("round {round}: 200 new connections and none on VM {vm}'s worker");
}

/// Envoy's reload counters for the plugin named `ratelimit` in the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reloads {
    success: u64,
    failure: u64,
    backoff: u64,
}

fn reloads(envoy: &Envoy) -> Reloads {
    let page = ok(envoy.stats_prometheus(), "reading /stats/prometheus");
    let v = |name: &str| {
        testkit::prometheus_value(&page, name)
            .unwrap_or_else(|| panic!("{name} missing from /stats/prometheus")) as u64
    };
    Reloads {
        success: v("envoy_wasm_ratelimit_vm_reload_success"),
        failure: v("envoy_wasm_ratelimit_vm_reload_failure"),
        backoff: v("envoy_wasm_ratelimit_vm_reload_backoff"),
    }
}

/// Nanoseconds since the Unix epoch, the clock of `x-trap-vm`.
fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn ms(ns: u64) -> Duration {
    Duration::from_nanos(ns)
}

/// What one trap showed.
#[derive(Debug)]
struct Round {
    /// The worker that trapped (0 or 1, labels given at the start).
    worker: usize,
    /// How long the trapped VM had been loaded when it trapped.
    age: Duration,
    /// 503s on the trapped worker after the trap (the reload backoff).
    backoff_503s: u64,
    /// 200s from the other worker meanwhile.
    survivor_200s: u64,
    /// From the trapped VM's load to its replacement's.
    reload_after_load: Duration,
    /// From the trap's answer to the first request served by the new VM.
    served_after_trap: Duration,
}

/// The two ways a trap goes, by the age of the VM that trapped.
fn settled(age: Duration) -> bool {
    age >= BACKOFF_MAX
}

#[test]
fn fail_reload_answers_503_then_a_fresh_vm_serves() {
    let mut opts = EnvoyOptions::new("{}");
    opts.wasm = Some(trap_wasm());
    let envoy = ok(Envoy::start(opts), "starting Envoy with the trap filter");
    // The policy under test is the one the shipped template sets.
    let rendered = ok(
        std::fs::read_to_string(envoy.config_path()).map_err(Into::into),
        "reading the rendered config",
    );
    assert!(
        rendered.contains("failure_policy: FAIL_RELOAD"),
        "the template no longer ships FAIL_RELOAD; update this test, RELIABILITY.md and docs/operations.md"
    );
    let c = envoy.client(ConnectionMode::NewPerRequest);

    // 1. Both workers serve: two VMs, each on its own worker. Right after
    // the start one worker may take every new connection for a while (its
    // listener is up first), so keep asking until both answer, up to 10 s.
    let mut vms = BTreeSet::new();
    let mut shared = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0.. {
        let s = passed(&send(&c, false), &format!("warm-up request {i}"));
        assert_eq!(s.shared, shared + 1, "the shared count goes up by one");
        shared = s.shared;
        vms.insert(s.vm);
        if vms.len() == 2 && i >= 10 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "two workers, two VMs: only {vms:?} after {} requests in 10 s",
            i + 1
        );
        if i >= 200 {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    assert_eq!(vms.len(), 2, "two workers, two VMs: {vms:?}");
    // Which worker each VM runs on: labels 0 and 1, inherited by a reloaded VM.
    let mut worker_of: BTreeMap<u64, usize> =
        vms.iter().enumerate().map(|(i, v)| (*v, i)).collect();
    println!("failure policy: two workers' VMs {vms:?} serve; shared count {shared}");

    // 2. Five traps, each aimed at one worker through a keep-alive
    // connection that worker serves: its settled VM, then at once the VM
    // that replaced it, twice (a crash loop); the settled VM of the other
    // worker, then its replacement.
    let plan = [(0, false), (0, true), (0, true), (1, false), (1, true)];
    let mut rounds: Vec<Round> = Vec::new();
    for (i, &(target_worker, crash_loop)) in plan.iter().enumerate() {
        let round = i + 1;
        let target = worker_of
            .iter()
            .find(|(vm, w)| **w == target_worker && vms.contains(vm))
            .map(|(vm, _)| *vm)
            .unwrap_or_else(|| panic!("round {round}: no VM on worker {target_worker}"));
        if !crash_loop {
            // Settled: loaded longer ago than any reload backoff.
            let wait =
                (target + BACKOFF_MAX.as_nanos() as u64 + 300_000_000).saturating_sub(now_ns());
            std::thread::sleep(ms(wait));
        }
        let pinned = connection_to(&envoy, target, &mut shared, round);
        let before = reloads(&envoy);
        let r = send(&pinned, true);
        let trapped_at = Instant::now();
        let trapped_ns = now_ns();
        assert_eq!(r.status, 503, "round {round}: the trapping request: {r:#?}");
        assert_eq!(r.body, "", "round {round}: {r:#?}");
        assert!(served(&r).is_none(), "round {round}: {r:#?}");

        // 3. Until a new VM answers: the trapped worker answers 503 while its
        // reload backs off; the other serves on.
        let mut backoff_503s = 0;
        let mut survivors = BTreeSet::new();
        let mut survivor_200s = 0;
        let deadline = trapped_at + Duration::from_secs(6);
        let (fresh, served_after_trap) = loop {
            assert!(
                Instant::now() < deadline,
                "round {round}: no new VM within 6 s of the trap ({backoff_503s} x 503 so far)"
            );
            let r = send(&c, false);
            let what = format!("round {round}, {:?} after the trap", trapped_at.elapsed());
            if r.status == 503 {
                assert!(served(&r).is_none(), "{what}: {r:#?}");
                backoff_503s += 1;
            } else {
                let s = passed(&r, &what);
                assert_eq!(
                    s.shared,
                    shared + 1,
                    "{what}: shared data outlives the trap"
                );
                shared = s.shared;
                if vms.contains(&s.vm) {
                    survivors.insert(s.vm);
                    survivor_200s += 1;
                } else {
                    // A fresh VM: its own count starts again.
                    assert_eq!(s.seq, 1, "{what}: the first request of a fresh VM: {s:?}");
                    break (s.vm, trapped_at.elapsed());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        };

        // 4. From now on both workers serve again: the survivor and the new
        // VM; the trapped VM never again.
        let mut after = BTreeSet::from([fresh]);
        for i in 0..60 {
            let what = format!("round {round}, request {i} after the reload");
            let s = passed(&send(&c, false), &what);
            assert_eq!(s.shared, shared + 1, "{what}");
            shared = s.shared;
            after.insert(s.vm);
            assert!(after.len() <= 2, "{what}: three VMs serve: {after:?}");
            if after.len() == 2 {
                break;
            }
        }
        assert_eq!(
            after.len(),
            2,
            "round {round}: both workers serve again: {after:?}"
        );
        let trapped: Vec<u64> = vms.difference(&after).copied().collect();
        assert_eq!(
            trapped.len(),
            1,
            "round {round}: exactly one VM replaced: before {vms:?}, after {after:?}"
        );
        let trapped = trapped[0];
        assert_eq!(
            trapped, target,
            "round {round}: the trap hit the VM it was aimed at"
        );
        assert!(
            survivors.is_subset(&after),
            "round {round}: the trapped VM served after its trap: {survivors:?}, {after:?}"
        );
        let worker = worker_of[&trapped];
        worker_of.insert(fresh, worker);
        let age = ms(trapped_ns.saturating_sub(trapped));
        let reload_after_load = ms(fresh.saturating_sub(trapped));

        // 5. Envoy counted one reload, and every 503 since the trap as a
        // reload backoff on the trapped worker (none on the other).
        let now = reloads(&envoy);
        assert_eq!(now.success - before.success, 1, "round {round}: {now:?}");
        assert_eq!(now.failure, before.failure, "round {round}: {now:?}");
        assert_eq!(
            now.backoff - before.backoff,
            backoff_503s,
            "round {round}: every 503 after the trap was a reload backoff: {now:?}"
        );
        // 6. The backoff runs from the trapped VM's load, not from the trap.
        if settled(age) {
            assert_eq!(
                backoff_503s, 0,
                "round {round}: a VM loaded {age:?} before its trap is replaced at once"
            );
        } else {
            assert!(
                reload_after_load + Duration::from_millis(50) >= BACKOFF_BASE,
                "round {round}: reloaded {reload_after_load:?} after the last load"
            );
        }
        if age < BACKOFF_BASE {
            assert!(
                backoff_503s >= 1,
                "round {round}: a VM {age:?} old trapped and nothing waited for the backoff"
            );
        }
        println!(
            "failure policy: round {round}: trap on worker {worker} (VM loaded {age:.2?} \
             before) -> 503; {backoff_503s} x 503 (reload backoff); new VM loaded \
             {reload_after_load:.2?} after the trapped one, serving {served_after_trap:.2?} \
             after the trap; other worker {survivor_200s} x 200 meanwhile"
        );
        rounds.push(Round {
            worker,
            age,
            backoff_503s,
            survivor_200s,
            reload_after_load,
            served_after_trap,
        });
        vms = after;
    }

    // A crash loop is throttled to one reload per 1-1.5 s per worker; the
    // wait does not grow with repeated traps.
    for (i, r) in rounds.iter().enumerate() {
        if !settled(r.age) {
            assert!(
                r.reload_after_load < BACKOFF_MAX + Duration::from_millis(1000),
                "round {}: {r:?}",
                i + 1
            );
        }
    }
    assert!(
        rounds.iter().any(|r| r.age < BACKOFF_BASE) && rounds.iter().any(|r| settled(r.age)),
        "both a settled VM and a VM in a crash loop trapped: {rounds:?}"
    );
    let n = rounds.len();
    let log = envoy.log();
    let panics = log.matches("panicked at").count();
    let traps = log
        .matches("failed: Uncaught RuntimeError: unreachable")
        .count();
    assert_eq!(
        (panics, traps),
        (n, n),
        "one panic message (critical) and one trap per round in the log"
    );
    let total = reloads(&envoy);
    assert_eq!(total.success, n as u64, "{total:?}");
    println!("failure policy: {n} traps; Envoy counters {total:?}");
    println!(
        "| trap | worker | trapped VM's age | 503s after the trap | new VM loaded after the old | \
         first served after the trap | other worker meanwhile |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (i, r) in rounds.iter().enumerate() {
        println!(
            "| {} | {} | {:.2?} | {} | {:.2?} | {:.2?} | {} x 200 |",
            i + 1,
            r.worker,
            r.age,
            r.backoff_503s,
            r.reload_after_load,
            r.served_after_trap,
            r.survivor_200s
        );
    }
}
