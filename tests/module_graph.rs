//! The layering of `src/`, checked: the top-level modules (the folders
//! `config/`, `policy/`, `limits/`, `global/`, `respond/`, `decide/` and the
//! files `host.rs`, `vm.rs`, `metrics.rs`) name each other through
//! `crate::<module>` paths; the graph of those names must be acyclic, so each
//! folder can be read with only the ones below it in mind. Test code (a
//! `#[cfg(test)]` module at the bottom of a file, or a `*tests.rs` file) may
//! build its fixtures from higher layers and is left out. Only `host.rs` may
//! name `proxy_wasm`: everything else is plain Rust, tested on the host.
//!
//! `MODULE_GRAPH_SRC` points the test at another tree (e.g. an older
//! checkout) to see what it finds there.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's code without its test module (by convention the last item).
fn non_test_code(text: &str) -> &str {
    text.find("#[cfg(test)]").map_or(text, |i| &text[..i])
}

/// Every `crate::<name>` in `code`, comments left out.
fn crate_names(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    names
}

struct Graph {
    /// Top-level module → the top-level modules its non-test code names.
    edges: BTreeMap<String, BTreeSet<String>>,
    /// Files whose non-test code names `proxy_wasm`, relative to the source root.
    proxy_wasm: Vec<String>,
}

fn graph(root: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    files.sort();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut proxy_wasm = Vec::new();
    for file in files {
        let rel = file.strip_prefix(root).unwrap();
        let rel_name = rel.to_string_lossy().replace('\\', "/");
        let file_name = rel.file_name().unwrap().to_string_lossy().into_owned();
        if rel_name == "lib.rs" || file_name.ends_with("tests.rs") {
            continue;
        }
        let unit = match rel.components().count() {
            1 => rel.file_stem().unwrap().to_string_lossy().into_owned(),
            _ => rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy()
                .into_owned(),
        };
        let text = std::fs::read_to_string(&file).unwrap();
        let code = non_test_code(&text);
        if code.contains("proxy_wasm") {
            proxy_wasm.push(rel_name);
        }
        let names = edges.entry(unit.clone()).or_default();
        names.extend(crate_names(code).into_iter().filter(|n| *n != unit));
    }
    Graph { edges, proxy_wasm }
}

/// A cycle of the graph, when there is one (depth-first search).
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(node) {
            Some(2) => return None,
            Some(1) => {
                let start = path.iter().position(|n| n == node).unwrap();
                let mut c = path[start..].to_vec();
                c.push(node.to_string());
                return Some(c);
            }
            _ => {}
        }
        state.insert(node.to_string(), 1);
        path.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, edges, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in edges.keys() {
        if let Some(c) = visit(node, edges, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

fn source_root() -> PathBuf {
    std::env::var_os("MODULE_GRAPH_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn the_top_level_modules_form_no_import_loop() {
    let g = graph(&source_root());
    for (from, to) in &g.edges {
        println!(
            "{from} -> {}",
            to.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    assert_eq!(
        cycle(&g.edges),
        None,
        "an import loop between top-level modules"
    );
    // The request's path, bottom up: nothing below names what is above it.
    let order = [
        "config", "limits", "policy", "global", "respond", "decide", "vm", "host",
    ];
    for (i, lower) in order.iter().enumerate() {
        let above: Vec<_> = g
            .edges
            .get(*lower)
            .into_iter()
            .flatten()
            .filter(|n| order[i + 1..].contains(&n.as_str()))
            .collect();
        assert!(
            above.is_empty(),
            "{lower} names {above:?}, which are above it"
        );
    }
}

#[test]
fn only_host_rs_names_proxy_wasm() {
    let g = graph(&source_root());
    assert_eq!(g.proxy_wasm, vec!["host.rs".to_string()]);
}

#[test]
fn the_graph_finds_a_loop_and_skips_tests_and_comments() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    edges.entry("a".into()).or_default().insert("b".into());
    edges.entry("b".into()).or_default().insert("c".into());
    assert_eq!(cycle(&edges), None);
    edges.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        cycle(&edges),
        Some(["a", "b", "c", "a"].map(String::from).to_vec())
    );
    let code = "use crate::x::Y; // crate::z\nfn f() { crate::w::g() }\n#[cfg(test)]\nmod tests { use crate::t; }";
    assert_eq!(
        crate_names(non_test_code(code)),
        ["w", "x"].map(String::from).into_iter().collect()
    );
}
