//! Measurements for `make bench` (BENCHMARKS.md) that need the filter's own
//! code rather than a running Envoy:
//!
//! * **Instructions per decision** inside the compiled module: the release
//!   `ratelimit_wasm.wasm` (and the baselines `noop_filter.wasm` and `hostcalls_filter.wasm`)
//!   runs in wasmtime with fuel metering on, driven by the test harness's host
//!   (`tests/harness`: same headers, properties, shared data and clock as
//!   every harness test). Wasmtime charges one unit of fuel per wasm
//!   operator executed (`nop`, `drop`, `block`, `loop`, `else`, `end`,
//!   `return` and `unreachable` are free; a `memory.copy` or `memory.fill`
//!   is one more per byte: wasmtime 48's default variable cost), so fuel
//!   consumed = wasm instructions executed and bytes copied; time spent
//!   in host functions is not counted. The plugin configurations are the
//!   bench's own (`tools/src/bin/bench/c1.json`, `c4.json`), so the numbers
//!   belong to the same 1-rule and 4-rule variants `make bench` loads into
//!   Envoy; `cm.json` (a rule matched on host, route and query, keyed on
//!   `ip/24`) is measured here only.
//! * **Instructions per response byte** that a `cost_from` rule scans: the
//!   same VM answers each request with a chat completion (JSON) or a chat
//!   stream (SSE) through `proxy_on_response_body`, in 16 KiB or 1 KiB
//!   chunks, with c1's rule plus `cost_from` (`bench/cu.json`) and with
//!   c1's plain rule; the difference over the body's length.
//! * **Shared-data footprint** with 1,000,000 distinct client keys: the
//!   filter's decision code over a `MemoryStore` (the approach of
//!   `tests/hostile.rs`), bytes stored against the bound that `max_buckets`
//!   sets.
//!
//! Each test prints its figures (`bench-wasm: {json}` lines, also written to
//! `$BENCH_WASM_OUT/<name>.json` when that variable is set, which `make
//! bench` does) and asserts only what must hold everywhere: positive fuel, 4
//! rules cheaper than 8 × 1 rule, every charged response settled from its
//! body at 0 to 200 instructions per byte, and the footprint within its bound. The
//! footprint test is `#[ignore]`d (a minute or more in a debug build;
//! `tests/hostile.rs` holds the same kind of bound in every `cargo test`);
//! `make bench` runs both with `--include-ignored`.

mod harness;

use std::collections::BTreeMap;
use std::hash::Hasher;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Mutex, OnceLock};

use harness::host::{self, HostState, StreamState};
use harness::{Harness, Options, Request, StreamPhase, ROOT_CONTEXT_ID};
use ratelimit_wasm::config;
use ratelimit_wasm::decide::{self, Step, Verdict};
use ratelimit_wasm::limits::store::MemoryStore;
use ratelimit_wasm::policy::plan::Plan;
use ratelimit_wasm::policy::request::RequestInfo;
use serde_json::{json, Value};
use wasmtime::{Engine, Instance, Module, Store};

const C1: &str = include_str!("../tools/src/bin/bench/c1.json");
const C4: &str = include_str!("../tools/src/bin/bench/c4.json");
const CC: &str = include_str!("../tools/src/bin/bench/cc.json");
/// One rule matched on a host pattern, a route name and a query parameter,
/// keyed on the client's /24.
const CM: &str = include_str!("../tools/src/bin/bench/cm.json");

/// Requests measured per configuration (after [`WARMUP`] unmeasured ones).
const MEASURED: u32 = 400;
const WARMUP: u32 = 100;
/// Distinct client ids the requests cycle through, as the Envoy bench's load.
const CLIENTS: u32 = 1000;

fn noop_wasm_path() -> PathBuf {
    testkit::paths::fixture_wasm_path("NOOP_FILTER_WASM", "noop_filter.wasm")
}

/// `make bench`'s a3: the module that makes only c1's host calls.
fn hostcalls_wasm_path() -> PathBuf {
    testkit::paths::fixture_wasm_path("HOSTCALLS_FILTER_WASM", "hostcalls_filter.wasm")
}

/// Prints `figures` and writes them to `$BENCH_WASM_OUT/<name>.json`.
fn report(name: &str, figures: &Value) {
    println!("bench-wasm: {figures}");
    if let Some(dir) = std::env::var_os("BENCH_WASM_OUT") {
        let dir = PathBuf::from(dir);
        std::fs::create_dir_all(&dir).expect("creating $BENCH_WASM_OUT");
        let file = dir.join(format!("{name}.json"));
        std::fs::write(&file, format!("{figures:#}\n"))
            .unwrap_or_else(|e| panic!("writing {}: {e}", file.display()));
    }
}

// ---------------------------------------------------------------------------------------------
// Instructions per decision.

/// One VM of `wasm` in a fuel-metering engine, on the host of a one-worker
/// [`Harness`] (whose shared data, clock and metrics it uses).
///
/// The harness's own engine has no fuel metering, so this VM is built here
/// from the harness's pieces (its linker and per-VM host state) and driven
/// through the same callbacks, in the same order, as `Harness::send` drives a
/// request that the filter lets through to an upstream answering 200.
struct FuelVm {
    // Keeps the shared data, clock and metrics alive (the host state holds a Weak).
    _harness: Harness,
    store: Store<HostState>,
    instance: Instance,
}

/// `wasm` compiled (once per process) by an engine with fuel metering on.
fn fuel_module(wasm: &Path) -> Module {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    static MODULES: Mutex<BTreeMap<PathBuf, Module>> = Mutex::new(BTreeMap::new());
    let engine = ENGINE.get_or_init(|| {
        let mut cfg = wasmtime::Config::new();
        cfg.consume_fuel(true);
        Engine::new(&cfg).expect("a fuel-metering engine")
    });
    let mut modules = MODULES.lock().unwrap_or_else(|e| e.into_inner());
    modules
        .entry(wasm.to_path_buf())
        .or_insert_with(|| compile_cached(engine, wasm))
        .clone()
}

/// Compiles `wasm`, or loads what an earlier run compiled from the same
/// bytes: a debug build of cranelift takes many seconds on the filter, so the
/// code is kept in `target/tmp/bench-fuel-cache` (as the harness keeps its
/// own), keyed by a hash of the bytes. Any problem with the cache just means
/// compiling again.
fn compile_cached(engine: &Engine, wasm: &Path) -> Module {
    let bytes = std::fs::read(wasm).unwrap_or_else(|e| panic!("reading {}: {e}", wasm.display()));
    let mut hasher = std::hash::DefaultHasher::new();
    hasher.write(&bytes);
    hasher.write(b"fuel/wasmtime-48");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-fuel-cache");
    let file = dir.join(format!("{:016x}-{}.cwasm", hasher.finish(), bytes.len()));
    // SAFETY: the file was written below by `Module::serialize` of these very
    // bytes (keyed by their hash) with this engine's configuration, in this
    // build's own target directory; wasmtime also checks the artifact's
    // version and engine configuration before using it.
    if let Ok(m) = unsafe { Module::deserialize_file(engine, &file) } {
        return m;
    }
    let module = Module::from_binary(engine, &bytes).expect("compiling the module");
    if let Ok(data) = module.serialize() {
        let _ = std::fs::create_dir_all(&dir);
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, data).is_ok() {
            let _ = std::fs::rename(&tmp, &file);
        }
        prune(&dir, 6);
    }
    module
}

/// Keeps the `keep` most recent artifacts in `dir` (each rebuild of the
/// filter makes a new one).
fn prune(dir: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    for (_, old) in files.into_iter().skip(keep) {
        let _ = std::fs::remove_file(old);
    }
}

/// Fuel consumed by one request's callbacks.
#[derive(Debug, Clone, Default)]
struct RequestFuel {
    /// `proxy_on_request_headers`: the decision.
    request_headers: u64,
    /// Every callback of the request: context create, request headers,
    /// response headers, log, done, delete.
    total: u64,
    /// `proxy_on_request_headers` returned Continue and sent no local reply.
    passed: bool,
    /// The response's header names after every callback, in order, each with
    /// the length of its value.
    response_headers: Vec<(String, usize)>,
}

impl FuelVm {
    fn new(wasm: &Path, plugin_config: &str) -> FuelVm {
        assert!(
            wasm.exists(),
            "{} does not exist: build it first with\n    \
             cargo build --release --target wasm32-wasip1 -p ratelimit-wasm -p noop-filter",
            wasm.display()
        );
        let harness = Harness::with_options(Options::new(1, plugin_config).wasm_path(wasm))
            .unwrap_or_else(|e| panic!("{e:#}"));
        assert!(harness.configured(0), "{}", harness.log_text());
        let module = fuel_module(wasm);
        let linker = host::linker(module.engine(), &module).expect("the harness's linker");
        let state = HostState::new(0, Rc::downgrade(&harness.inner), 0x5eed);
        let mut store = Store::new(module.engine(), state);
        store.set_fuel(u64::MAX).expect("fuel is on");
        let instance = linker
            .instantiate(&mut store, &module)
            .expect("instantiating");
        let mut vm = FuelVm {
            _harness: harness,
            store,
            instance,
        };
        let root = ROOT_CONTEXT_ID as i32;
        if vm.has("_initialize") {
            vm.call::<(), ()>(ROOT_CONTEXT_ID, "_initialize", ());
        } else if vm.has("_start") {
            vm.call::<(), ()>(ROOT_CONTEXT_ID, "_start", ());
        }
        vm.call::<(i32, i32), ()>(ROOT_CONTEXT_ID, "proxy_on_context_create", (root, 0));
        let started = vm.call::<(i32, i32), i32>(ROOT_CONTEXT_ID, "proxy_on_vm_start", (root, 0));
        assert_ne!(started, 0, "proxy_on_vm_start returned false");
        vm.store.data_mut().plugin_config_available = true;
        let len = plugin_config.len() as i32;
        let configured =
            vm.call::<(i32, i32), i32>(ROOT_CONTEXT_ID, "proxy_on_configure", (root, len));
        vm.store.data_mut().plugin_config_available = false;
        assert_ne!(configured, 0, "proxy_on_configure returned false");
        vm
    }

    fn has(&mut self, name: &str) -> bool {
        self.instance.get_export(&mut self.store, name).is_some()
    }

    fn fuel_left(&self) -> u64 {
        self.store.get_fuel().expect("fuel is on")
    }

    /// Calls export `name` with `ctx` as the current context.
    fn call<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &mut self,
        ctx: u32,
        name: &str,
        params: P,
    ) -> R {
        let func = self
            .instance
            .get_typed_func::<P, R>(&mut self.store, name)
            .unwrap_or_else(|e| panic!("export {name}: {e:?}"));
        {
            let d = self.store.data_mut();
            d.current_ctx = ctx;
            d.effective_ctx = None;
            d.in_call = Some(format!("{name}(context {ctx})"));
        }
        let r = func
            .call(&mut self.store, params)
            .unwrap_or_else(|e| panic!("wasm trap during {name}(context {ctx}): {e:?}"));
        let d = self.store.data_mut();
        d.in_call = None;
        d.effective_ctx = None;
        d.actions.clear();
        r
    }

    fn stream(&mut self, ctx: u32) -> &mut StreamState {
        self.store
            .data_mut()
            .streams
            .get_mut(&ctx)
            .expect("the stream exists")
    }

    /// One request through every callback, as `Harness::send` drives it,
    /// answered `ok\n`.
    fn request(&mut self, req: Request) -> RequestFuel {
        self.request_answered(req, &Answer::ok())
    }

    /// One request through every callback, as `Harness::send` drives it; a
    /// request let through is answered `answer`, whose body (when not empty)
    /// goes through `proxy_on_response_body` chunk by chunk, as the harness's
    /// `deliver_body` does.
    fn request_answered(&mut self, req: Request, answer: &Answer) -> RequestFuel {
        let ctx = {
            let d = self.store.data_mut();
            let ctx = d.next_ctx;
            d.next_ctx += 1;
            d.streams.insert(ctx, StreamState::new(ctx, req));
            ctx
        };
        let c = ctx as i32;
        let root = ROOT_CONTEXT_ID as i32;
        let start = self.fuel_left();
        self.call::<(i32, i32), ()>(ctx, "proxy_on_context_create", (c, root));
        let n = {
            let s = self.stream(ctx);
            s.phase = StreamPhase::RequestHeaders;
            s.req_map_held = true;
            s.request_headers.len() as i32
        };
        let before = self.fuel_left();
        let action = self.call::<(i32, i32, i32), i32>(ctx, "proxy_on_request_headers", (c, n, 1));
        let request_headers = before - self.fuel_left();
        let passed = action == 0 && self.stream(ctx).local_response.is_none();
        if passed {
            let (n, eos) = self.answer(ctx, answer);
            self.call::<(i32, i32, i32), i32>(ctx, "proxy_on_response_headers", (c, n, eos));
            let s = self.stream(ctx);
            s.resp_map_held = false;
            s.phase = StreamPhase::Completing;
            let chunks: Vec<&[u8]> = match answer.chunk {
                Some(size) => answer.body.chunks(size.max(1)).collect(),
                None => Vec::new(),
            };
            for (i, chunk) in chunks.iter().enumerate() {
                self.stream(ctx).body_chunk = Some(chunk.to_vec());
                let eos = (i + 1 == chunks.len()) as i32;
                let len = chunk.len() as i32;
                self.call::<(i32, i32, i32), i32>(ctx, "proxy_on_response_body", (c, len, eos));
            }
            self.stream(ctx).body_chunk = None;
        }
        self.stream(ctx).access_log_phase = true;
        self.call::<i32, ()>(ctx, "proxy_on_log", c);
        {
            let s = self.stream(ctx);
            s.access_log_phase = false;
            s.req_map_held = false;
            s.resp_map_held = false;
        }
        self.call::<i32, i32>(ctx, "proxy_on_done", c);
        self.call::<i32, ()>(ctx, "proxy_on_delete", c);
        let total = start - self.fuel_left();
        let stream = self.store.data_mut().streams.remove(&ctx);
        let response_headers = stream
            .and_then(|s| s.response_headers)
            .unwrap_or_default()
            .into_iter()
            .map(|(name, value)| (name, value.len()))
            .collect();
        RequestFuel {
            request_headers,
            total,
            passed,
            response_headers,
        }
    }
}

impl FuelVm {
    /// Hands stream `ctx`, let through, the upstream's `answer`: the
    /// arguments of its `proxy_on_response_headers` (header count, end of
    /// stream).
    fn answer(&mut self, ctx: u32, answer: &Answer) -> (i32, i32) {
        let s = self.stream(ctx);
        s.req_map_held = false;
        s.upstream_request = Some(s.request_headers.clone());
        let mut headers = vec![
            (":status".to_string(), b"200".to_vec()),
            (
                "content-length".to_string(),
                answer.body.len().to_string().into_bytes(),
            ),
        ];
        if let Some(t) = answer.content_type {
            headers.push(("content-type".to_string(), t.as_bytes().to_vec()));
        }
        let n = headers.len() as i32;
        s.response_headers = Some(headers);
        s.response_body = answer.body.clone();
        s.resp_map_held = true;
        s.phase = StreamPhase::ResponseHeaders;
        let eos = (answer.chunk.is_some() && answer.body.is_empty()) as i32;
        (n, eos)
    }
}

/// What the upstream answers a request let through: 200 with `body`,
/// which reaches the filter in chunks of `chunk` bytes.
struct Answer {
    content_type: Option<&'static str>,
    body: Vec<u8>,
    /// `None`: `proxy_on_response_body` is not called (the decision
    /// figures have always been measured so).
    chunk: Option<usize>,
}

impl Answer {
    /// The bench upstream's `ok\n`, the body not delivered to the filter.
    fn ok() -> Answer {
        Answer {
            content_type: None,
            body: b"ok\n".to_vec(),
            chunk: None,
        }
    }
}

fn client_request(client: &str) -> Request {
    Request::get("/").header("x-client-id", client)
}

/// Mean fuel over [`MEASURED`] requests of clients `c0`…`c999` (after
/// [`WARMUP`]); every one must pass.
fn mean_passing(vm: &mut FuelVm) -> (f64, f64) {
    mean_passing_of(vm, |i| client_request(&format!("c{}", i % CLIENTS)))
}

/// [`mean_passing`] of the requests `request(i)`.
fn mean_passing_of(vm: &mut FuelVm, request: impl Fn(u32) -> Request) -> (f64, f64) {
    let (mut decide, mut total) = (0u64, 0u64);
    for i in 0..WARMUP + MEASURED {
        let f = vm.request(request(i));
        assert!(f.passed, "request {i} was not let through");
        if i >= WARMUP {
            decide += f.request_headers;
            total += f.total;
        }
    }
    let n = f64::from(MEASURED);
    (decide as f64 / n, total as f64 / n)
}

/// Calls from the module to the host, and entries from the host into the
/// module (the callbacks and the allocations for what the host returns),
/// during one request of `client`; and the response's header names with the
/// lengths of their values.
fn calls_of_a_request(vm: &mut FuelVm, client: &str) -> (u32, u32, Vec<(String, usize)>) {
    let counts: std::sync::Arc<Mutex<(u32, u32)>> = Default::default();
    let c = counts.clone();
    vm.store.call_hook(move |_, hook| {
        let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
        match hook {
            wasmtime::CallHook::CallingHost => c.0 += 1,
            wasmtime::CallHook::CallingWasm => c.1 += 1,
            _ => {}
        }
        Ok(())
    });
    let f = vm.request(client_request(client));
    vm.store.call_hook(|_, _| Ok(()));
    assert!(f.passed, "{client} was not let through");
    let (to_host, into_vm) = *counts.lock().unwrap_or_else(|e| e.into_inner());
    (to_host, into_vm, f.response_headers)
}

/// `make bench`'s floor (a3) is only a floor if it makes the calls c1 makes:
/// the same number into the host and back into the VM, for a new client and
/// for one seen before, the same response headers with values as long, and
/// shared-data values as long. A change to c1's calls fails here until
/// `tests/fixtures/hostcalls-filter` follows it.
#[test]
fn the_floor_module_makes_the_calls_c1_makes() {
    let path = hostcalls_wasm_path();
    assert!(
        path.exists(),
        "{} is missing: cargo build --release --target wasm32-wasip1 -p hostcalls-filter",
        path.display()
    );
    let mut c1 = FuelVm::new(&harness::default_wasm_path(), C1);
    let mut floor = FuelVm::new(&path, C1);
    // A new client's read finds nothing, so nothing is allocated for it.
    for (client, calls) in [("c1", (10, 7)), ("c1", (10, 8)), ("c2", (10, 7))] {
        let c1_calls = calls_of_a_request(&mut c1, client);
        let floor_calls = calls_of_a_request(&mut floor, client);
        assert_eq!(c1_calls, floor_calls, "client {client}");
        assert_eq!((c1_calls.0, c1_calls.1), calls, "client {client}");
        let names: Vec<&str> = c1_calls.2.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                ":status",
                "content-length",
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
                "ratelimit-policy",
                "ratelimit"
            ]
        );
    }
    // And the values it reads and writes are as long as c1's sets.
    let value_lengths = |vm: &FuelVm, marker: &str| -> Vec<usize> {
        let mut lengths: Vec<usize> = vm
            ._harness
            .shared_keys()
            .iter()
            .filter(|k| k.contains(marker))
            .filter_map(|k| vm._harness.shared_get(k))
            .map(|(value, _)| value.len())
            .collect();
        lengths.sort_unstable();
        lengths
    };
    assert_eq!(value_lengths(&c1, "/set/"), [35, 35]);
    assert_eq!(value_lengths(&floor, "hostcalls/"), [35, 35]);
}

/// A baseline module's mean fuel per decision and per request, or null when
/// it is not built: only a reference figure, which `make bench` builds (and
/// then requires) but a plain `cargo test` may not have.
fn baseline_fuel(path: &Path, package: &str) -> Value {
    if path.exists() || std::env::var_os("BENCH_WASM_OUT").is_some() {
        let mut vm = FuelVm::new(path, "{}");
        let (decide, total) = mean_passing(&mut vm);
        json!({ "decision": decide, "request": total })
    } else {
        println!(
            "bench-wasm: no baseline: {} is not built (cargo build --release --target \
             wasm32-wasip1 -p {package})",
            path.display()
        );
        Value::Null
    }
}

#[test]
fn instructions_per_decision_in_the_compiled_module() {
    let filter = harness::default_wasm_path();
    let mut c1 = FuelVm::new(&filter, C1);
    let (c1_decide, c1_total) = mean_passing(&mut c1);
    // A denied decision: client "over" has 1 request per 366 days.
    assert!(c1.request(client_request("over")).passed);
    let over: Vec<RequestFuel> = (0..MEASURED)
        .map(|_| c1.request(client_request("over")))
        .collect();
    assert!(over.iter().all(|f| !f.passed), "\"over\" must be denied");
    let denied_decide =
        over.iter().map(|f| f.request_headers).sum::<u64>() as f64 / f64::from(MEASURED);

    let mut c4 = FuelVm::new(&filter, C4);
    let (c4_decide, c4_total) = mean_passing(&mut c4);
    let mut cc = FuelVm::new(&filter, CC);
    let (cc_decide, cc_total) = mean_passing(&mut cc);
    // cm's request: a host under example.com, the route `api`, an api_key.
    let mut cm = FuelVm::new(&filter, CM);
    let (cm_decide, cm_total) = mean_passing_of(&mut cm, |i| {
        Request::get(&format!("/v1/items?page=2&api_key=k{}", i % CLIENTS))
            .set_header(":authority", "api.example.com:443")
            .property(&["xds", "route_name"], "api")
    });

    let noop = baseline_fuel(&noop_wasm_path(), "noop-filter");
    let host_calls = baseline_fuel(&hostcalls_wasm_path(), "hostcalls-filter");

    let figures = json!({
        "unit": "wasm instructions (wasmtime fuel), mean per request",
        "requests": MEASURED,
        "clients": CLIENTS,
        "c1": { "decision": c1_decide, "request": c1_total, "denied_decision": denied_decide },
        "c4": { "decision": c4_decide, "request": c4_total },
        "cc": { "decision": cc_decide, "request": cc_total },
        "cm": { "decision": cm_decide, "request": cm_total },
        "noop": noop,
        "hostcalls": host_calls,
        "c4_over_c1": c4_decide / c1_decide,
    });
    report("fuel", &figures);
    for v in [
        c1_decide,
        c1_total,
        denied_decide,
        c4_decide,
        c4_total,
        cc_decide,
        cc_total,
        cm_decide,
        cm_total,
    ] {
        assert!(v > 0.0, "{figures}");
    }
    assert!(
        c4_decide < 8.0 * c1_decide,
        "4 rules must cost less than 8 × 1 rule: {figures}"
    );
}

// ---------------------------------------------------------------------------------------------
// Instructions per response byte scanned.

/// c1's rule charged from the response: `cost_from` with the `openai_chat`
/// preset (`make bench`'s cu variants).
const CU: &str = include_str!("../tools/src/bin/bench/cu.json");

/// Requests measured per body (after [`BODY_WARMUP`] unmeasured ones).
const BODY_MEASURED: u32 = 100;
const BODY_WARMUP: u32 = 20;

const CHAT_ID: &str = r#""id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","created":1741569952,"model":"gpt-4o-2024-08-06""#;

/// `len` bytes of a completion's text as a JSON string's inside: words, a
/// sentence's end now and then, an escaped line break after every 20th.
fn prose(len: usize) -> String {
    const WORDS: [&str; 12] = [
        "the", "bucket", "refills", "at", "a", "steady", "rate", "while", "each", "request",
        "spends", "tokens",
    ];
    let mut out = String::with_capacity(len + 16);
    let mut i = 0usize;
    while out.len() < len {
        out.push_str(WORDS[(i * 7 + i / 12) % WORDS.len()]);
        i += 1;
        out.push_str(match i % 20 {
            0 => ".\\n",
            13 => ". ",
            _ => " ",
        });
    }
    out.truncate(len);
    if out.ends_with('\\') {
        out.pop();
        out.push('.');
    }
    out
}

/// An OpenAI chat completion of `len` bytes: one long `content` string, the
/// `usage` at the end.
fn openai_chat_json(len: usize) -> Vec<u8> {
    let completion = len / 4;
    let head = format!(
        r#"{{{CHAT_ID},"object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":""#
    );
    let tail = format!(
        r#"","refusal":null,"annotations":[]}},"logprobs":null,"finish_reason":"stop"}}],"usage":{{"prompt_tokens":19,"completion_tokens":{completion},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":0,"audio_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}},"service_tier":"default","system_fingerprint":"fp_fc9f1d7035"}}"#,
        completion + 19
    );
    let body = format!("{head}{}{tail}", prose(len - head.len() - tail.len()));
    assert_eq!(body.len(), len);
    let _: Value = serde_json::from_str(&body).expect("the body is JSON");
    body.into_bytes()
}

/// An OpenAI chat completion streamed (`stream_options.include_usage`) as
/// events of a few words each, about `len` bytes: the usage in the last
/// event before `[DONE]`.
fn openai_chat_sse(len: usize) -> Vec<u8> {
    let event = |choices: &str, usage: &str| {
        format!(
            "data: {{{CHAT_ID},\"object\":\"chat.completion.chunk\",\"service_tier\":\"default\",\
             \"system_fingerprint\":\"fp_fc9f1d7035\",\"choices\":{choices},\"usage\":{usage}}}\n\n"
        )
    };
    let delta = |delta: &str, finish: &str| {
        format!(r#"[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]"#)
    };
    let mut body = event(
        &delta(
            r#"{"role":"assistant","content":"","refusal":null}"#,
            "null",
        ),
        "null",
    );
    let text = prose(len / 8);
    let mut words = text.split_inclusive(' ');
    let mut events = 0;
    let end = |events: usize| {
        event(&delta("{}", r#""stop""#), "null")
            + &event(
                "[]",
                &format!(
                    r#"{{"prompt_tokens":19,"completion_tokens":{events},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":0,"audio_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}}"#,
                    events + 19
                ),
            )
            + "data: [DONE]\n\n"
    };
    while body.len() + end(events).len() < len {
        let word = words.next().unwrap_or("tokens ");
        body.push_str(&event(
            &delta(&format!(r#"{{"content":"{word}"}}"#), "null"),
            "null",
        ));
        events += 1;
    }
    body.push_str(&end(events));
    body.into_bytes()
}

/// Where a stream's cost goes: the same events as one JSON document (an
/// array of them, the usage after it), without the SSE framing and the
/// scan's reset per event.
fn sse_events_as_json(len: usize) -> Vec<u8> {
    let sse = String::from_utf8(openai_chat_sse(len)).expect("UTF-8");
    let events: Vec<Value> = sse
        .split("\n\n")
        .filter_map(|e| serde_json::from_str(e.strip_prefix("data: ")?).ok())
        .collect();
    let usage = events.last().expect("events")["usage"].clone();
    serde_json::to_vec(&json!({ "events": events, "usage": usage })).expect("JSON")
}

/// And the other way round: the chat completion of `len` bytes as the one
/// event of a stream.
fn openai_chat_json_as_one_event(len: usize) -> Vec<u8> {
    let mut body = b"data: ".to_vec();
    body.extend(openai_chat_json(len));
    body.extend(b"\n\ndata: [DONE]\n\n");
    body
}

/// Mean fuel of a whole request answered `answer`, over [`BODY_MEASURED`]
/// requests of clients `c<first>`… (after [`BODY_WARMUP`]); every one must
/// pass.
fn mean_answered(vm: &mut FuelVm, answer: &Answer, first: u32) -> f64 {
    let mut total = 0u64;
    for i in 0..BODY_WARMUP + BODY_MEASURED {
        let f = vm.request_answered(client_request(&format!("c{}", first + i)), answer);
        assert!(f.passed, "request {i} was not let through");
        if i >= BODY_WARMUP {
            total += f.total;
        }
    }
    total as f64 / f64::from(BODY_MEASURED)
}

/// The wasm instructions a `cost_from` rule spends per response byte: a
/// whole request (headers, body chunk by chunk, log) of c1's rule with
/// `cost_from` (`bench/cu.json`: the `openai_chat` preset) minus the same
/// request, same body, same chunks, of c1's plain rule (whose filter does not
/// read the body), over the body's length. Bodies: OpenAI chat completions
/// of 1 KiB and 64 KiB (JSON, mostly one long `content` string, the usage
/// at the end) and a 64 KiB stream of chat chunks (SSE); chunks of 16 KiB
/// (Envoy's buffers) and of 1 KiB. Also, to see where the stream's cost
/// goes, the stream's events as one JSON document and the 64 KiB chat
/// completion as the one event of a stream.
#[test]
fn instructions_per_response_byte_scanned() {
    let filter = harness::default_wasm_path();
    let mut c1 = FuelVm::new(&filter, C1);
    let mut cu = FuelVm::new(&filter, CU);
    let bodies: [(&str, &'static str, Vec<u8>); 5] = [
        ("json_1k", "application/json", openai_chat_json(1024)),
        ("json_64k", "application/json", openai_chat_json(64 * 1024)),
        ("sse_64k", "text/event-stream", openai_chat_sse(64 * 1024)),
        // Where the stream's cost goes (see the two functions).
        (
            "sse_events_as_json",
            "application/json",
            sse_events_as_json(64 * 1024),
        ),
        (
            "json_as_one_event",
            "text/event-stream",
            openai_chat_json_as_one_event(64 * 1024),
        ),
    ];
    // The filter hands its counts to the host on its root's tick.
    let settled = |vm: &mut FuelVm| {
        let root = ROOT_CONTEXT_ID as i32;
        vm.call::<i32, ()>(ROOT_CONTEXT_ID, "proxy_on_tick", root);
        vm._harness
            .metric_unflushed("ratelimit_wasm_usage_settled")
            .unwrap_or(0)
    };
    let mut rows = serde_json::Map::new();
    let mut first = 0;
    for (name, content_type, body) in &bodies {
        for chunk in [16 * 1024, 1024] {
            let answer = Answer {
                content_type: Some(content_type),
                body: body.clone(),
                chunk: Some(chunk),
            };
            let before = settled(&mut cu);
            let plain = mean_answered(&mut c1, &answer, first);
            let charged = mean_answered(&mut cu, &answer, first);
            assert_eq!(
                settled(&mut cu) - before,
                u64::from(BODY_WARMUP + BODY_MEASURED),
                "every response of {name} settles to the usage it reports"
            );
            first += BODY_WARMUP + BODY_MEASURED;
            let per_byte = (charged - plain) / body.len() as f64;
            println!(
                "bench-wasm: {name:18} ({:6} bytes) in {:5}-byte chunks: c1 {plain:9.0}, \
                 c1 + cost_from {charged:9.0} instructions per request: {per_byte:.2} per byte",
                body.len(),
                chunk
            );
            rows.insert(
                format!("{name}_chunks_{}k", chunk / 1024),
                json!({
                    "body_bytes": body.len(),
                    "chunk_bytes": chunk,
                    "c1_request": plain,
                    "cost_from_request": charged,
                    "per_byte": per_byte,
                }),
            );
        }
    }
    assert_eq!(settled(&mut c1), 0, "c1's rule reads no body");
    // The 1 KiB body's figure holds the fixed cost of a charge from the body
    // (reservation, settlement); the slope from 1 KiB to 64 KiB is the scan's
    // own cost per byte.
    let extra = |key: &str| {
        let r = &rows[key];
        r["cost_from_request"].as_f64().unwrap_or(f64::NAN)
            - r["c1_request"].as_f64().unwrap_or(f64::NAN)
    };
    let mut slopes = serde_json::Map::new();
    for k in [16, 1] {
        let slope = (extra(&format!("json_64k_chunks_{k}k"))
            - extra(&format!("json_1k_chunks_{k}k")))
            / (64.0 * 1024.0 - 1024.0);
        println!("bench-wasm: JSON from 1 KiB to 64 KiB in {k} KiB chunks: {slope:.2} per byte");
        slopes.insert(format!("json_chunks_{k}k"), json!(slope));
    }
    let figures = json!({
        "unit": "wasm instructions (wasmtime fuel), mean per request; per_byte: \
                 (cost_from_request - c1_request) / body_bytes",
        "requests": BODY_MEASURED,
        "bodies": rows,
        "json_slope_per_byte": slopes,
    });
    report("usage", &figures);
    for (name, row) in &rows {
        let per_byte = row["per_byte"].as_f64().unwrap_or(f64::NAN);
        assert!(
            per_byte > 0.0 && per_byte < 200.0,
            "{name}: {per_byte} instructions per byte scanned: {figures}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Shared-data footprint.

fn request_info(plan: &Plan, client: &[u8]) -> RequestInfo {
    let named = [
        (":method", &b"GET"[..]),
        (":path", b"/"),
        ("x-client-id", client),
    ];
    RequestInfo::with_headers(&plan.header_names, &named).with_source(b"127.0.0.1:40000")
}

/// The bytes (keys + values) that the bucket table of `plan` can ever hold:
/// `sets` keys of at most the longest set key's length, each holding
/// `ways` buckets of 33 bytes plus 16 per extra limit, after a 2-byte header
/// (README, *Shared state and its bounds*).
fn bound(plan: &Plan, max_limits: usize) -> usize {
    let key = plan.table.set_key(plan.table.sets - 1).len();
    let per_bucket = 33 + 16 * (max_limits - 1);
    plan.table.sets as usize * (key + 2 + ratelimit_wasm::limits::table::WAYS * per_bucket)
}

/// Decides one request for each of `clients` distinct clients over a
/// `MemoryStore` and reports what the store holds.
fn footprint(name: &str, plugin_config: &str, max_limits: usize, clients: u64) -> Value {
    let plan = Plan::compile(&config::parse(plugin_config.as_bytes()).unwrap(), [7; 16]);
    let store = MemoryStore::default();
    const T0: u64 = 1_700_000_000 * 1_000_000_000;
    let mut denied = 0u64;
    for i in 0..clients {
        let step = decide::start(
            &plan,
            &request_info(&plan, format!("client-{i}").as_bytes()),
            &store,
            T0 + i * 1000,
            0,
        );
        match step {
            Step::Done(o) => {
                if !matches!(o.verdict, Verdict::Pass(_)) {
                    denied += 1;
                }
            }
            Step::Call(_) => panic!("no global rules here"),
        }
    }
    let bound = bound(&plan, max_limits);
    json!({
        "config": name,
        "clients": clients,
        "max_buckets": plan.table.sets as usize * ratelimit_wasm::limits::table::WAYS,
        "keys": store.len(),
        "bytes": store.bytes(),
        "bound_bytes": bound,
        "denied": denied,
    })
}

// A million decisions per configuration take a minute or more in a debug
// build, and `tests/hostile.rs` already holds the bound for a million
// clients in every `cargo test`; `make bench` runs this one with
// `--include-ignored`.
#[test]
#[ignore = "slow (a minute or more); run by `make bench`"]
fn shared_data_footprint_with_a_million_distinct_clients() {
    let clients = 1_000_000;
    let c1 = footprint("c1", C1, 1, clients);
    let c4 = footprint("c4", C4, 2, clients);
    let figures = json!({ "c1": c1, "c4": c4 });
    report("footprint", &figures);
    for f in [&c1, &c4] {
        assert!(f["bytes"].as_u64() <= f["bound_bytes"].as_u64(), "{f}");
        assert_eq!(
            f["denied"], 0,
            "each new client gets its first request: {f}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Where a decision's instructions go.

/// A VM of the filter with `config`, after `warm` requests (clients `c0`…).
fn warm_vm(config: &str, warm: u32) -> FuelVm {
    let mut vm = FuelVm::new(&harness::default_wasm_path(), config);
    for i in 0..warm {
        vm.request(client_request(&format!("c{i}")));
    }
    vm
}

/// Runs `proxy_on_request_headers` of a new request with `fuel` fuel (all
/// there is when `None`): the fuel it used, or the names on the wasm stack
/// where the fuel ran out. `PROFILE_PHASE=response` runs the request's
/// headers with all the fuel there is and its response's headers (`ok\n`)
/// with `fuel`; `PROFILE_PHASE=body` the same, then the first 16 KiB chunk
/// of a 64 KiB chat completion with `fuel`.
fn run_out_of_fuel(vm: &mut FuelVm, req: Request, fuel: Option<u64>) -> Result<u64, Vec<String>> {
    let ctx = {
        let d = vm.store.data_mut();
        let ctx = d.next_ctx;
        d.next_ctx += 1;
        d.streams.insert(ctx, StreamState::new(ctx, req));
        ctx
    };
    let (c, root) = (ctx as i32, ROOT_CONTEXT_ID as i32);
    vm.call::<(i32, i32), ()>(ctx, "proxy_on_context_create", (c, root));
    let n = {
        let s = vm.stream(ctx);
        s.phase = StreamPhase::RequestHeaders;
        s.req_map_held = true;
        s.request_headers.len() as i32
    };
    // The response's headers are measured after a decision with all the
    // fuel there is.
    let (name, args) = match std::env::var("PROFILE_PHASE").as_deref() {
        Ok("response") => {
            let action =
                vm.call::<(i32, i32, i32), i32>(ctx, "proxy_on_request_headers", (c, n, 1));
            assert_eq!(action, 0, "the request measured must be let through");
            let (n, eos) = vm.answer(ctx, &Answer::ok());
            ("proxy_on_response_headers", (c, n, eos))
        }
        Ok("body") => {
            let action =
                vm.call::<(i32, i32, i32), i32>(ctx, "proxy_on_request_headers", (c, n, 1));
            assert_eq!(action, 0, "the request measured must be let through");
            let answer = Answer {
                content_type: Some("application/json"),
                body: openai_chat_json(64 * 1024),
                chunk: Some(16 * 1024),
            };
            let (n, eos) = vm.answer(ctx, &answer);
            vm.call::<(i32, i32, i32), i32>(ctx, "proxy_on_response_headers", (c, n, eos));
            let s = vm.stream(ctx);
            s.resp_map_held = false;
            s.phase = StreamPhase::Completing;
            let chunk = answer.body.get(..16 * 1024).unwrap_or_default().to_vec();
            let len = chunk.len() as i32;
            s.body_chunk = Some(chunk);
            ("proxy_on_response_body", (c, len, 0))
        }
        Err(_) => ("proxy_on_request_headers", (c, n, 1)),
        Ok(other) => panic!("PROFILE_PHASE={other}: response or body, or unset"),
    };
    let func = vm
        .instance
        .get_typed_func::<(i32, i32, i32), i32>(&mut vm.store, name)
        .expect("the export");
    {
        let d = vm.store.data_mut();
        d.current_ctx = ctx;
        d.effective_ctx = None;
        d.in_call = Some(format!("{name}(context {ctx})"));
    }
    if let Some(f) = fuel {
        vm.store.set_fuel(f).expect("fuel is on");
    }
    let before = vm.fuel_left();
    match func.call(&mut vm.store, args) {
        Ok(_) => Ok(before - vm.fuel_left()),
        Err(e) => Err(e
            .downcast_ref::<wasmtime::WasmBacktrace>()
            .map(|b| {
                let offsets = std::env::var_os("PROFILE_OFFSETS").is_some();
                b.frames()
                    .iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let name = match f.func_name() {
                            Some(n) => n.to_string(),
                            None => format!("#{}", f.func_index()),
                        };
                        match f.module_offset() {
                            Some(at) if offsets && i == 0 => format!("{name}@{at:#x}"),
                            _ => name,
                        }
                    })
                    .collect()
            })
            .unwrap_or_default()),
    }
}

/// The configuration and client the profiling tools measure:
/// `PROFILE_CONFIG` (`c1` when unset, `c4`, `cc`, `cm`, `cu`; any other name
/// fails) and `PROFILE_CLIENT` (`c50`).
fn profiled() -> (&'static str, String) {
    let config = match std::env::var("PROFILE_CONFIG").as_deref() {
        Err(_) | Ok("c1") => C1,
        Ok("c4") => C4,
        Ok("cc") => CC,
        Ok("cm") => CM,
        Ok("cu") => CU,
        Ok(other) => panic!("PROFILE_CONFIG={other}: one of c1, c4, cc, cm, cu"),
    };
    let client = std::env::var("PROFILE_CLIENT").unwrap_or_else(|_| "c50".into());
    (config, client)
}

/// The profiled request of `client`: cm's matches a host under
/// example.com, the route `api` and an api_key, as its fuel figure's do.
fn profiled_request(config: &str, client: &str) -> Request {
    if config != CM {
        return client_request(client);
    }
    Request::get(&format!("/v1/items?page=2&api_key={client}"))
        .set_header(":authority", "api.example.com:443")
        .property(&["xds", "route_name"], "api")
}

/// A VM of `config` after 50 clients' requests, and one of `over` when it
/// is the client measured (so that it is denied).
fn profiled_vm(config: &str, client: &str) -> FuelVm {
    let mut vm = warm_vm(config, 50);
    if client == "over" {
        vm.request(client_request("over"));
    }
    vm
}

/// A per-function profile of one decision, by sampling: the same request,
/// on a fresh VM each time, is given 1/N, 2/N, … of the fuel it needs, and
/// the wasm stack where the fuel runs out is one sample. Deterministic, and
/// exact in the limit; a function's share of the samples is its share of the
/// instructions (exclusive: on top of the stack; inclusive: anywhere on it).
///
/// Names need a module built without stripping:
///
/// ```text
/// CARGO_PROFILE_RELEASE_STRIP=false cargo build --release --target wasm32-wasip1 \
///     -p ratelimit-wasm --target-dir /tmp/named
/// RATELIMIT_WASM=/tmp/named/wasm32-wasip1/release/ratelimit_wasm.wasm \
///     cargo test --release --test bench_fuel profile -- --ignored --nocapture
/// ```
///
/// Functions on top of the stack are also listed with their caller.
/// `PROFILE_CONFIG=c4` profiles c4 (`cc` the concurrency variant, `cm` the matched rule), `PROFILE_CLIENT=over` a denial,
/// `PROFILE_PHASE=response` the response's headers instead of the decision
/// (`body`: the first 16 KiB chunk of a 64 KiB chat completion, with `cu`),
/// `PROFILE_SAMPLES` sets N (150); `PROFILE_OFFSETS=1` adds to the top
/// frame its module offset (as `wasm-tools print --print-offsets` shows it).
#[test]
#[ignore = "a tool: run by hand with a named module (see its doc)"]
fn profile_of_a_decision() {
    let (config, client) = profiled();
    let samples: u64 = std::env::var("PROFILE_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150);
    let fresh = || profiled_vm(config, &client);
    let total = run_out_of_fuel(&mut fresh(), profiled_request(config, &client), None)
        .unwrap_or_else(|stack| panic!("ran out of u64::MAX fuel: {stack:?}"));
    let (mut inclusive, mut exclusive, mut callers) =
        (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    for k in 0..samples {
        let fuel = 1 + k * total / samples;
        let stack = run_out_of_fuel(&mut fresh(), profiled_request(config, &client), Some(fuel))
            .err()
            .unwrap_or_default();
        if let Some(top) = stack.first() {
            *exclusive.entry(top.clone()).or_insert(0u64) += 1;
            let caller = stack.get(1).cloned().unwrap_or_default();
            *callers.entry(format!("{top} <- {caller}")).or_insert(0u64) += 1;
        }
        let mut seen = std::collections::BTreeSet::new();
        for f in stack {
            if seen.insert(f.clone()) {
                *inclusive.entry(f).or_insert(0u64) += 1;
            }
        }
    }
    println!("profile: {total} instructions, {samples} samples");
    for (kind, counts) in [
        ("inclusive", inclusive),
        ("exclusive", exclusive),
        ("exclusive, by caller", callers),
    ] {
        let mut rows: Vec<(String, u64)> = counts.into_iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1));
        for (name, n) in rows.into_iter().take(40) {
            println!("profile {kind}: {:>6} {name}", n * total / samples);
        }
    }
    assert!(total > 0);
}

/// The fuel between the module's calls to the host during one decision:
/// each line is the instructions since the previous host call and the
/// function that makes this one. Exact, unlike the sampled profile, whose
/// straight-line code is charged to the next call or loop. For finer steps, a
/// throwaway build logs `probe <what>` (`proxy_log`) where it wants a mark:
/// the mark is named by the message. Named module as for
/// [`profile_of_a_decision`]; same `PROFILE_CONFIG` and `PROFILE_CLIENT`.
#[test]
#[ignore = "a tool: run by hand with a named module (see its doc)"]
fn trace_of_a_decision() {
    let (config, client) = profiled();
    let mut vm = profiled_vm(config, &client);
    let marks: std::sync::Arc<Mutex<Vec<(u64, String)>>> = Default::default();
    let m = marks.clone();
    vm.store.call_hook(move |ctx, hook| {
        if matches!(hook, wasmtime::CallHook::CallingHost) {
            let fuel = ctx.get_fuel().unwrap_or(0);
            let caller = wasmtime::WasmBacktrace::capture(&ctx)
                .frames()
                .first()
                .and_then(|f| f.func_name().map(str::to_string))
                .unwrap_or_default();
            m.lock().unwrap().push((fuel, caller));
        }
        Ok(())
    });
    vm.store.set_fuel(u64::MAX / 2).expect("fuel is on");
    let earlier = vm._harness.logs_containing("probe ").len();
    let used =
        run_out_of_fuel(&mut vm, profiled_request(config, &client), None).expect("enough fuel");
    // The context's creation ran first, on the same fuel.
    let end = vm.fuel_left();
    let mut last = end + used;
    // A throwaway build may log `probe …` messages at the points to measure.
    let mut probes = vm
        ._harness
        .logs_containing("probe ")
        .into_iter()
        .skip(earlier)
        .map(|l| l.message);
    for (fuel, caller) in marks.lock().unwrap().iter() {
        let caller = match caller.contains("probe") {
            true => probes.next().unwrap_or_default(),
            false => caller.clone(),
        };
        if *fuel > end + used {
            continue;
        }
        println!("trace: {:6} {caller}", last - fuel);
        last = *fuel;
    }
    println!("trace: {:6} (to the end)", last - end);
    println!("trace: {used} instructions");
}
