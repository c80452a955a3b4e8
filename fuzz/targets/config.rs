//! `config`: any bytes through `config::parse`; a configuration that parses is compiled and
//! one request built from the rest of the input is evaluated and decided.
//!
//! Input: the configuration up to the first NUL byte (JSON never holds a raw NUL, so every
//! shipped configuration is a seed as it is), then the bytes that build the request.

use crate::input::Input;
use crate::request_gen;
use ratelimit_wasm::config::Scope;
use ratelimit_wasm::global::callout;
use ratelimit_wasm::limits::store;
use ratelimit_wasm::policy::plan::Plan;
use ratelimit_wasm::{config, decide};

pub fn run(data: &[u8]) {
    let (config_bytes, rest) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(cfg) = config::parse(config_bytes) else {
        return;
    };
    let plan = Plan::compile(&cfg, [0; 16]);
    assert_eq!(plan.header_names[..2], [":method", ":path"]);
    assert!(plan.table.sets >= 1);
    let mut inp = Input::new(rest);
    let req = request_gen::request(&plan, &mut inp);
    let eval = plan.evaluate(&req);
    assert_eq!(eval, plan.evaluate(&req), "evaluate is not deterministic");
    for b in eval
        .buckets
        .iter()
        .chain(&eval.shadow)
        .chain(&eval.fallback)
    {
        let rule = &plan.rules[b.rule];
        assert_eq!(rule.scope, Scope::Local, "{b:?}");
        assert!(b.variant < rule.variants.len(), "{b:?}");
        assert!(b.set < plan.table.sets, "{b:?}");
        assert!(b.cost >= 1, "{b:?}");
    }
    for g in &eval.global {
        let rule = &plan.rules[g.rule];
        assert_eq!(rule.scope, Scope::Global, "{g:?}");
        assert!(g.variant < rule.variants.len(), "{g:?}");
        assert!(g.key.starts_with(&rule.name), "{g:?}");
    }
    if !eval.global.is_empty() || !eval.quotas.is_empty() {
        let body = callout::encode_request(&plan, &eval.global, &eval.quotas, None);
        let v: serde_json::Value = serde_json::from_slice(&body).expect("request body is JSON");
        // An empty list is left out of the body.
        assert_eq!(
            v["buckets"].as_array().map_or(0, Vec::len),
            eval.global.len()
        );
    }
    let store = store::MemoryStore::default();
    let now = 1_700_000_000_000_000_000 + u64::from(inp.u32());
    match decide::start(&plan, &req, &store, now, inp.u64()) {
        decide::Step::Done(_) => {}
        decide::Step::Call(p) => {
            let _ = decide::finish(&plan, *p, None, b"", 0, &store, now);
        }
    }
}
