//! The layering of `src/`, checked: the top-level modules (the folders
//! `usage/`, `policy/`, `limits/`, `global/`, `respond/`, `decide/`, `host/`, `vm/`
//! and the file `metrics.rs`) name each other through
//! `crate::<module>` paths; the graph of those names must be acyclic, so each
//! folder can be read with only the ones below it in mind. Each file is
//! parsed whole (`syn`); test code (any `#[cfg(test)]` item, wherever it sits
//! in the file, or a `*tests.rs` file) may build its fixtures from higher
//! layers and is left out, and so are comments. Only the host
//! layer (`host.rs` or `host/`) may name `proxy_wasm`: everything else is plain Rust, tested on the host.
//!
//! `MODULE_GRAPH_SRC` points the test at another tree (e.g. an older
//! checkout) to see what it finds there.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use syn::visit::{self, Visit};

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

/// The `crate::<name>` and `proxy_wasm` paths a file's code names, its test
/// items (`#[cfg(test)]` modules, functions, impls, uses, wherever they sit)
/// and its comments left out: the file is parsed whole with `syn`.
#[derive(Default)]
struct Names {
    crate_modules: BTreeSet<String>,
    proxy_wasm: bool,
}

impl Names {
    fn of(code: &str) -> Names {
        let file = syn::parse_file(code).unwrap_or_else(|e| panic!("does not parse: {e}"));
        let mut names = Names::default();
        names.visit_file(&file);
        names
    }

    /// A path's leading segments: `crate::x::…` names module `x`.
    fn path<'a>(&mut self, mut segments: impl Iterator<Item = &'a syn::Ident>) {
        match segments.next().map(|i| i.to_string()).as_deref() {
            Some("crate") => {
                if let Some(next) = segments.next() {
                    self.crate_modules.insert(next.to_string());
                }
            }
            Some("proxy_wasm") => self.proxy_wasm = true,
            _ => {}
        }
    }

    /// `use crate::{a::X, b}` names `a` and `b`.
    fn use_tree(&mut self, tree: &syn::UseTree, prefix: &[syn::Ident]) {
        match tree {
            syn::UseTree::Path(p) => {
                let mut longer = prefix.to_vec();
                longer.push(p.ident.clone());
                self.use_tree(&p.tree, &longer);
            }
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| self.use_tree(t, prefix)),
            syn::UseTree::Name(n) => self.path(prefix.iter().chain([&n.ident])),
            syn::UseTree::Rename(r) => self.path(prefix.iter().chain([&r.ident])),
            syn::UseTree::Glob(_) => self.path(prefix.iter()),
        }
    }
}

/// `#[cfg(test)]` (also inside `all(..)`/`any(..)`): code the filter does not run.
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && {
            let tokens = a.meta.require_list().map(|l| l.tokens.to_string());
            tokens.is_ok_and(|t| {
                t.split(|c: char| !c.is_alphanumeric() && c != '_')
                    .any(|w| w == "test")
            })
        }
    })
}

impl<'ast> Visit<'ast> for Names {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Use(u) => &u.attrs,
            syn::Item::Const(c) => &c.attrs,
            syn::Item::Static(s) => &s.attrs,
            syn::Item::Struct(s) => &s.attrs,
            syn::Item::Enum(e) => &e.attrs,
            syn::Item::Trait(t) => &t.attrs,
            syn::Item::Macro(m) => &m.attrs,
            _ => return visit::visit_item(self, item),
        };
        if is_test(attrs) {
            return;
        }
        if let syn::Item::Use(u) = item {
            return self.use_tree(&u.tree, &[]);
        }
        visit::visit_item(self, item);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test(&f.attrs) {
            visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.path(p.segments.iter().map(|s| &s.ident));
        visit::visit_path(self, p);
    }

    /// Macro bodies are not parsed by `syn`: their `crate::`/`proxy_wasm::`
    /// paths are read from the tokens.
    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        let idents: Vec<syn::Ident> = m
            .tokens
            .clone()
            .into_iter()
            .filter_map(|t| match t {
                proc_macro2::TokenTree::Ident(i) => Some(i),
                _ => None,
            })
            .collect();
        for (i, id) in idents.iter().enumerate() {
            if id == "crate" || id == "proxy_wasm" {
                self.path(idents[i..].iter());
            }
        }
        visit::visit_macro(self, m);
    }
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
        let names = Names::of(&text);
        if names.proxy_wasm {
            proxy_wasm.push(rel_name);
        }
        let edges = edges.entry(unit.clone()).or_default();
        edges.extend(names.crate_modules.into_iter().filter(|n| *n != unit));
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
        "config", "usage", "limits", "policy", "global", "respond", "decide", "vm", "host",
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
fn only_the_host_layer_names_proxy_wasm() {
    let g = graph(&source_root());
    assert!(!g.proxy_wasm.is_empty(), "nothing names proxy_wasm");
    let elsewhere: Vec<_> = g
        .proxy_wasm
        .iter()
        .filter(|f| *f != "host.rs" && !f.starts_with("host/"))
        .collect();
    assert!(elsewhere.is_empty(), "{elsewhere:?} name proxy_wasm");
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
    let code = r#"
        use crate::x::Y; // crate::z
        /// [`crate::d`]
        fn f() { crate::w::g(); log!("{}", crate::m::n); }
        #[cfg(test)]
        mod tests { use crate::t; }
        #[cfg(test)]
        fn helper() { crate::u::v() }
        impl S {
            #[cfg(all(test, feature = "x"))]
            fn only_in_tests() { crate::k::j() }
            fn kept() { use crate::{a::B, c}; }
        }
        fn host() { proxy_wasm::hostcalls::log(); }
        #[cfg(test)]
        mod more { fn g() { crate::after::f() } }
    "#;
    let names = Names::of(code);
    assert_eq!(
        names.crate_modules,
        ["a", "c", "m", "w", "x"]
            .map(String::from)
            .into_iter()
            .collect()
    );
    assert!(names.proxy_wasm);
    assert!(!Names::of("#[cfg(test)] mod t { use proxy_wasm::x; }").proxy_wasm);
}
