//! The project reads nothing outside its own tree.
//!
//! A user's clone has no sibling folders, so no tracked file other than
//! Markdown may refer to one (the developers' `shared` folder held reference material for the
//! developers; what the project needs from it is vendored, see `NOTICE`).
//! The file list comes from `git ls-files` when the tree is a git checkout,
//! else from a walk of the tree without build and tool outputs.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Relative paths of the project's files.
fn project_files() -> Vec<String> {
    let git = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root())
        .output();
    if let Ok(out) = git {
        if out.status.success() && !out.stdout.is_empty() {
            return out
                .stdout
                .split(|b| *b == 0)
                .filter(|p| !p.is_empty())
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
        }
    }
    let mut out = Vec::new();
    walk(&root(), &mut out);
    out
}

fn walk(dir: &Path, out: &mut Vec<String>) {
    const SKIP: [&str; 5] = ["target", ".git", ".venv", "work", "artifacts"];
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !SKIP.contains(&name.as_str()) {
                walk(&path, out);
            }
        } else if let Ok(rel) = path.strip_prefix(root()) {
            out.push(rel.to_string_lossy().into_owned());
        }
    }
}

#[test]
fn no_file_outside_markdown_refers_to_a_sibling_folder() {
    // Built from parts so that this file does not match itself.
    let needle = ["..", "/shared"].concat();
    let files = project_files();
    assert!(
        files.len() > 50,
        "found only {} project files; the listing is broken",
        files.len()
    );
    let offenders: Vec<String> = files
        .iter()
        .filter(|f| !f.ends_with(".md"))
        .filter(|f| {
            std::fs::read(root().join(f))
                .map(|bytes| String::from_utf8_lossy(&bytes).contains(&needle))
                .unwrap_or(false)
        })
        .cloned()
        .collect();
    assert!(
        offenders.is_empty(),
        "these files refer to {needle}, which a clone does not have: {offenders:?}"
    );
}

#[test]
fn vendored_schemas_record_their_origin_and_license() {
    let crd = std::fs::read_to_string(root().join("deploy/istio/crd/wasmplugin-crd.yaml"))
        .unwrap_or_else(|e| panic!("the vendored WasmPlugin CRD: {e}"));
    assert!(
        crd.starts_with("# Vendored from istio/api (Apache-2.0)"),
        "the CRD does not say where it comes from"
    );
    assert!(crd.contains("b8f8791d9653b2edc77a071d48887e582cfe84bf"));
    let notice = std::fs::read_to_string(root().join("NOTICE")).expect("NOTICE");
    assert!(notice.contains("deploy/istio/crd/wasmplugin-crd.yaml"));
    // The security.istio.io schemas: each names its origin, the commit it was
    // read at, and appears in NOTICE and the folder's README.
    let readme = std::fs::read_to_string(root().join("deploy/istio/crd/README.md"))
        .expect("deploy/istio/crd/README.md");
    for name in [
        "authorizationpolicy-crd.yaml",
        "peerauthentication-crd.yaml",
        "requestauthentication-crd.yaml",
    ] {
        let text = std::fs::read_to_string(root().join("deploy/istio/crd").join(name))
            .unwrap_or_else(|e| panic!("the vendored {name}: {e}"));
        assert!(
            text.starts_with("# Vendored from istio/api (Apache-2.0)"),
            "{name} does not say where it comes from"
        );
        assert!(
            text.contains("00017fa37746a08c4799b58636c59399b66c63dd"),
            "{name}"
        );
        assert!(
            notice.contains(&format!("deploy/istio/crd/{name}")),
            "NOTICE: {name}"
        );
        assert!(
            readme.contains(&format!("`{name}`")),
            "crd/README.md: {name}"
        );
    }
    let license = std::fs::read_to_string(root().join("third_party/licenses/Apache-2.0.txt"))
        .expect("the Apache-2.0 text");
    assert!(license.contains("Apache License"));
    assert!(license.contains("Version 2.0, January 2004"));
}
