//! The runtime crate's shape: its modules import each other without a circle, so each can be
//! read (and the protocol core checked) on its own.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module of `src/` and the top-level modules it names (`crate::x`), outside its
/// tests and comments.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = vec![src.clone()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        let relative = path.strip_prefix(&src).unwrap();
        let top = relative
            .iter()
            .next()
            .unwrap()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
        let names = graph.entry(top.clone()).or_default();
        for line in code.lines() {
            let line = line.split("//").next().unwrap();
            for (i, _) in line.match_indices("crate::") {
                let rest = &line[i + "crate::".len()..];
                if let Some(group) = rest.strip_prefix('{') {
                    for item in group.split('}').next().unwrap().split(',') {
                        names.insert(item.trim().split("::").next().unwrap().to_string());
                    }
                } else {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    names.insert(name);
                }
            }
        }
        names.remove(&top);
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for names in graph.values_mut() {
        names.retain(|n| modules.contains(n));
    }
    graph
}

#[test]
fn the_runtime_crates_modules_import_each_other_without_a_circle() {
    let graph = imports();
    assert!(
        graph.contains_key("runner") && graph.contains_key("protocol"),
        "{graph:?}"
    );
    // Depth-first, with the path: a module met again on its own path closes a circle.
    fn visit(
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) {
        let here = path.last().unwrap().clone();
        for next in &graph[&here] {
            if let Some(at) = path.iter().position(|m| m == next) {
                panic!("a circle of imports: {} → {next}", path[at..].join(" → "));
            }
            if done.insert(next.clone()) {
                path.push(next.clone());
                visit(graph, path, done);
                path.pop();
            }
        }
    }
    let mut done = BTreeSet::new();
    for module in graph.keys() {
        if done.insert(module.clone()) {
            visit(&graph, &mut vec![module.clone()], &mut done);
        }
    }
    // The protocol core does no I/O: it names nothing of the runtime but the message's kind.
    assert_eq!(
        graph["protocol"],
        BTreeSet::from(["message".to_string()]),
        "the protocol core imports only plain data"
    );
}
