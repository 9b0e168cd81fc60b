//! The arrows between the application's modules, and between the crates, point one way: a
//! newcomer can read the code bottom up, and the operator layer stays usable without the server.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The modules of `crates/leasehold/src` each module names as `crate::<module>` (outside its
/// tests).
fn module_uses() -> BTreeMap<String, BTreeSet<String>> {
    let src = leasehold_test_support::workspace_root().join("crates/leasehold/src");
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().is_none_or(|e| e != "rs") || name == "lib" || name == "main" {
            continue;
        }
        modules.insert(name.to_string(), uses_in(&path));
    }
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    for uses in modules.values_mut() {
        uses.retain(|u| names.contains(u));
    }
    modules
}

/// `crate::x` names in a file, up to its `#[cfg(test)]` module.
fn uses_in(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap();
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
    code.match_indices("crate::")
        .map(|(i, m)| {
            code[i + m.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// A cycle through `from`, if there is one: the path back to it.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        goal: &str,
        at: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in graph.get(at).into_iter().flatten() {
            path.push(next.clone());
            if next == goal || (seen.insert(next.clone()) && walk(graph, goal, next, path, seen)) {
                return true;
            }
            path.pop();
        }
        false
    }
    let mut path = vec![from.to_string()];
    walk(graph, from, from, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn the_applications_modules_depend_one_way() {
    let modules = module_uses();
    assert!(
        modules.contains_key("app") && modules.contains_key("settings"),
        "{modules:?}"
    );
    let cycles: Vec<String> = modules
        .keys()
        .filter_map(|m| cycle(&modules, m))
        .map(|c| c.join(" -> "))
        .collect();
    assert!(cycles.is_empty(), "module cycles: {cycles:#?}");
    // The modes are the top: nothing below them reaches back up into their wiring.
    for (module, uses) in &modules {
        assert!(!uses.contains("app"), "{module} uses app");
    }
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("app", &["ops"][..]),
        ("ops", &["settings"][..]),
        ("settings", &["app"][..]),
        ("telemetry", &[][..]),
    ]
    .into_iter()
    .map(|(m, uses)| (m.to_string(), uses.iter().map(|u| u.to_string()).collect()))
    .collect();
    assert_eq!(cycle(&graph, "app").unwrap(), ["app", "ops", "settings", "app"]);
    assert_eq!(cycle(&graph, "telemetry"), None);
}

/// The workspace crates a crate depends on (normal dependencies, from its manifest).
fn crate_deps(name: &str) -> BTreeSet<String> {
    let manifest = std::fs::read_to_string(
        leasehold_test_support::workspace_root().join(format!("crates/{name}/Cargo.toml")),
    )
    .unwrap();
    let mut deps = BTreeSet::new();
    let mut in_deps = false;
    for line in manifest.lines() {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]" || line.ends_with(".dependencies]") && !line.contains("dev-");
            continue;
        }
        if in_deps
            && let Some(dep) = line.split(['.', ' ', '=']).next()
            && !dep.is_empty()
        {
            deps.insert(dep.to_string());
        }
    }
    deps
}

#[test]
fn the_crates_depend_one_way_and_the_operator_layer_needs_no_server() {
    let crates = [
        "leasehold-storage",
        "leasehold-lock",
        "leasehold-runtime",
        "leasehold-dataverse",
        "leasehold-ops",
        "leasehold-functions",
        "leasehold",
    ];
    // Each crate uses only crates before it in this order.
    for (i, name) in crates.iter().enumerate() {
        for dep in crate_deps(name).iter().filter(|d| d.starts_with("leasehold")) {
            let at = crates
                .iter()
                .position(|c| c == dep)
                .unwrap_or_else(|| panic!("{name} uses {dep}"));
            assert!(at < i, "{name} uses {dep}, which comes after it");
        }
    }
    for server in ["axum", "hyper", "leasehold-functions", "leasehold"] {
        assert!(
            !crate_deps("leasehold-ops").contains(server),
            "leasehold-ops uses {server}"
        );
        assert!(
            !crate_deps("leasehold-dataverse").contains(server),
            "leasehold-dataverse uses {server}"
        );
    }
    // Dataverse has one home, used by Start and by the command line.
    assert!(crate_deps("leasehold-functions").contains("leasehold-dataverse"));
    assert!(crate_deps("leasehold").contains("leasehold-dataverse"));
    let root = leasehold_test_support::workspace_root().join("crates");
    for krate in std::fs::read_dir(&root).unwrap() {
        let src = krate.unwrap().path().join("src");
        if src.starts_with(root.join("leasehold-dataverse")) {
            continue;
        }
        for stray in [src.join("dataverse.rs"), src.join("dataverse")] {
            assert!(
                !stray.exists(),
                "{} is Dataverse code outside leasehold-dataverse",
                stray.display()
            );
        }
    }
}

/// Crates whose public functions may still answer `Result<_, String>` (none: each has an error
/// type; name a crate here only with a reason).
const STRING_ERRORS_ALLOWED_IN: &[&str] = &[];

/// The public functions (`pub fn`, `pub async fn`, `pub const fn`; not `pub(crate)`) in `text`
/// whose return type is `Result<…, String>`, as 1-based line numbers, up to the file's
/// `#[cfg(test)]` module. A signature may span lines: it is read up to its body's `{` or a `;`.
/// Trait impls (`impl FromStr` with `type Err = String`) are not functions declared `pub` and
/// are not looked at: a trait fixes their shape.
fn public_string_errors(text: &str) -> Vec<usize> {
    let code = text.split("#[cfg(test)]").next().unwrap();
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let public = ["pub fn ", "pub async fn ", "pub const fn ", "pub unsafe fn "]
            .iter()
            .any(|p| t.starts_with(p));
        if !public {
            continue;
        }
        let mut signature = String::new();
        for next in &lines[i..] {
            let next = next.split("//").next().unwrap();
            signature.push_str(next);
            signature.push(' ');
            if next.contains('{') || next.trim_end().ends_with(';') {
                break;
            }
        }
        let signature = signature.split('{').next().unwrap();
        let signature = signature.split(" where ").next().unwrap();
        let Some((_, returns)) = signature.rsplit_once("->") else {
            continue;
        };
        let returns: String = returns.chars().filter(|c| !c.is_whitespace()).collect();
        let returns = returns.trim_end_matches(';');
        let result = ["Result<", "std::result::Result<", "core::result::Result<"]
            .iter()
            .any(|p| returns.starts_with(p));
        if result && returns.ends_with(",String>") {
            found.push(i + 1);
        }
    }
    found
}

#[test]
fn the_string_error_scan_sees_one_line_and_wrapped_signatures() {
    let text = "pub fn a() -> Result<(), String> {\n}\n\
                pub(crate) fn b() -> Result<(), String> {}\n\
                pub async fn c(\n    x: u32,\n) -> std::result::Result<Vec<u8>,\n    String> {\n}\n\
                pub fn d() -> Result<String, Error> {}\n\
                /// pub fn e() -> Result<(), String>\n\
                pub fn f() -> Result<(), String>;\n\
                #[cfg(test)]\nmod tests { pub fn g() -> Result<(), String> {} }\n";
    assert_eq!(public_string_errors(text), [1, 4, 11]);
}

/// No public function of the workspace's crates answers `Result<_, String>` (issue 44): an
/// error a caller can only print, not match on. Give it an error type (thiserror, as
/// `BadBudgetName` or `BadHistoryPrefix`).
#[test]
fn no_public_function_returns_a_string_error() {
    fn walk(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, files);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let root = leasehold_test_support::workspace_root();
    let mut offenders = Vec::new();
    let mut scanned = 0;
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        let krate = krate.unwrap().path();
        let name = krate.file_name().unwrap().to_string_lossy().to_string();
        let src = krate.join("src");
        if STRING_ERRORS_ALLOWED_IN.contains(&name.as_str()) || !src.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        walk(&src, &mut files);
        for file in files {
            scanned += 1;
            let text = std::fs::read_to_string(&file).unwrap();
            for line in public_string_errors(&text) {
                offenders.push(format!(
                    "{}:{line}",
                    file.strip_prefix(&root).unwrap_or(&file).display()
                ));
            }
        }
    }
    assert!(
        scanned > 50,
        "only {scanned} files scanned: is the workspace root right?"
    );
    assert!(
        offenders.is_empty(),
        "public functions answering Result<_, String> (give them an error type):\n{}",
        offenders.join("\n")
    );
}
