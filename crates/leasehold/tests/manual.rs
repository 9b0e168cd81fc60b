//! The manual holds together: the front page (`README.md`) and its chapters under `docs/`.
//!
//! - Every relative link and anchor in every Markdown file of the repository resolves: the file
//!   or directory exists, and the anchor is a heading of the target under GitHub's slug rules.
//! - The front page stays a front page: at most [`README_MAX_LINES`] lines, linking every
//!   chapter of [`CHAPTERS`] in reading order; each chapter opens with a lead and ends with a
//!   "Next:" link to the following one; every file under `docs/` can be reached from it.
//! - The front page's two commands are the ones CI runs.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};

/// The chapters of the manual, in reading order (paths from the workspace root).
const CHAPTERS: &[&str] = &[
    "docs/getting-started.md",
    "docs/concepts.md",
    "docs/logic.md",
    "docs/start.md",
    "docs/dataverse.md",
    "docs/deploying.md",
    "docs/operating.md",
    "docs/security.md",
    "docs/configuration.md",
    "docs/performance.md",
    "docs/proof.md",
    "docs/contributing.md",
];

/// Where the last chapter's "Next:" leads.
const AFTER_THE_LAST_CHAPTER: &str = "docs/design.md";

const README_MAX_LINES: usize = 250;

/// Directories never searched for Markdown: build output, dependencies, git's own, Azurite's
/// state from `scripts/dev.sh`.
const SKIPPED_DIRS: &[&str] = &["target", "node_modules", ".git", ".azurite"];

fn root() -> PathBuf {
    leasehold_test_support::workspace_root()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn relative(path: &Path) -> String {
    let root = root();
    path.strip_prefix(&root).unwrap_or(path).display().to_string()
}

/// Every Markdown file of the repository, sorted.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let entry = entry.unwrap();
            let path = entry.path();
            let name = entry.file_name();
            let file_type = entry.file_type().unwrap();
            if file_type.is_dir() {
                if !SKIPPED_DIRS.iter().any(|s| name == *s) {
                    walk(&path, found);
                }
            } else if file_type.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("md")) {
                found.push(path);
            }
        }
    }
    let mut found = Vec::new();
    walk(&root(), &mut found);
    found.sort();
    found
}

/// The lines of a Markdown text with fenced code blocks emptied (line numbers stay as they were).
fn without_fences(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let run = |c: char| trimmed.chars().take_while(|&x| x == c).count();
        match fence {
            Some((c, n)) => {
                if run(c) >= n && trimmed.trim_end().chars().all(|x| x == c) {
                    fence = None;
                }
                lines.push(String::new());
            }
            None => match ['`', '~'].into_iter().find(|&c| run(c) >= 3) {
                Some(c) => {
                    fence = Some((c, run(c)));
                    lines.push(String::new());
                }
                None => lines.push(line.to_string()),
            },
        }
    }
    lines
}

/// The lines of a Markdown text with fenced code blocks emptied and inline code spans blanked
/// (line numbers and columns stay as they were), so that what is left is what renders as prose.
fn without_code(text: &str) -> Vec<String> {
    let lines = without_fences(text);
    // Inline code spans: a run of n backticks up to the next run of exactly n, within one block
    // (a span may cross a line break, never a blank line). An unmatched run is literal.
    let mut chars: Vec<char> = lines.join("\n").chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' || (i > 0 && chars[i - 1] == '\\') {
            i += 1;
            continue;
        }
        let n = chars[i..].iter().take_while(|&&c| c == '`').count();
        let mut j = i + n;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '\n'
                && chars[j + 1..]
                    .iter()
                    .take_while(|&&c| c != '\n')
                    .all(|c| c.is_whitespace())
            {
                break; // a blank line ends the block
            }
            if chars[j] == '`' {
                let m = chars[j..].iter().take_while(|&&c| c == '`').count();
                if m == n {
                    close = Some(j + m);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                for c in &mut chars[i..end] {
                    if *c != '\n' {
                        *c = ' ';
                    }
                }
                i = end;
            }
            None => i += n,
        }
    }
    chars
        .into_iter()
        .collect::<String>()
        .split('\n')
        .map(str::to_string)
        .collect()
}

/// A link in a Markdown file: the line it is on and its destination as written.
#[derive(Debug)]
struct Link {
    line: usize,
    target: String,
}

/// The destinations of the inline links and images (`[text](target "title")`,
/// `![alt](<target>)`) and of the link reference definitions (`[label]: target`) of a Markdown
/// text, outside code.
fn links(text: &str) -> Vec<Link> {
    let lines = without_code(text);
    let mut found = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if line.len() - trimmed.len() < 4
            && trimmed.starts_with('[')
            && let Some(end) = trimmed.find("]:")
        {
            let target = trimmed[end + 2..].split_whitespace().next().unwrap_or("");
            found.push(Link {
                line: index + 1,
                target: target.trim_matches(['<', '>']).to_string(),
            });
        }
    }
    let prose = lines.join("\n");
    let mut rest = prose.as_str();
    let mut offset = 0;
    while let Some(at) = rest.find("](") {
        let start = at + 2;
        let dest = rest[start..].trim_start_matches([' ', '\t']);
        let target: String = if let Some(inner) = dest.strip_prefix('<') {
            inner.chars().take_while(|&c| c != '>' && c != '\n').collect()
        } else {
            let mut depth = 0usize;
            dest.chars()
                .take_while(|&c| {
                    match c {
                        '(' => depth += 1,
                        ')' if depth == 0 => return false,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    !c.is_whitespace()
                })
                .collect()
        };
        let line = prose[..offset + at].matches('\n').count() + 1;
        found.push(Link { line, target });
        offset += start;
        rest = &rest[start..];
    }
    found.sort_by_key(|l| l.line);
    found
}

/// GitHub's anchor for a heading's text: lower-cased, everything but letters, digits, spaces,
/// hyphens and underscores dropped, spaces turned into hyphens.
fn slug(heading: &str) -> String {
    // What renders: a link or image shows its text, not its destination.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|c| open + c) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|e| close + e) else {
            break;
        };
        text.push_str(rest[..open].trim_end_matches('!'));
        text.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == ' ' || c == '-' || c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (ATX `#` and setext), duplicates numbered as
/// GitHub numbers them (`-1`, `-2`, …).
fn anchors(text: &str) -> BTreeSet<String> {
    let lines = without_fences(text);
    let mut headings = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim();
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if line.len() - line.trim_start().len() < 4
            && (1..=6).contains(&hashes)
            && (trimmed.len() == hashes || trimmed[hashes..].starts_with([' ', '\t']))
        {
            let content = trimmed[hashes..].trim();
            // An optional closing sequence of #s, after a space.
            let content = match content.trim_end_matches('#') {
                stripped if stripped.is_empty() || stripped.ends_with([' ', '\t']) => stripped.trim_end(),
                _ => content,
            };
            headings.push(content.to_string());
        } else if i > 0
            && !trimmed.is_empty()
            && (trimmed.chars().all(|c| c == '=') || trimmed.chars().all(|c| c == '-'))
        {
            let previous = lines[i - 1].trim();
            let paragraph = !previous.is_empty()
                && !previous.starts_with(['#', '|', '-', '*', '+', '>'])
                && !previous.chars().next().is_some_and(|c| c.is_ascii_digit());
            if paragraph {
                headings.push(previous.to_string());
            }
        }
    }
    let mut occurrences: HashMap<String, usize> = HashMap::new();
    let mut anchors = BTreeSet::new();
    for heading in headings {
        let original = slug(&heading);
        let mut anchor = original.clone();
        while occurrences.contains_key(&anchor) {
            let n = occurrences.get_mut(&original).unwrap();
            *n += 1;
            anchor = format!("{original}-{n}");
        }
        occurrences.insert(anchor.clone(), 0);
        anchors.insert(anchor);
    }
    anchors
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(high), Some(low)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((high * 16 + low) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A destination with a scheme (`https:`, `mailto:`, …) or protocol-relative: not checked.
fn is_absolute(target: &str) -> bool {
    if target.starts_with("//") {
        return true;
    }
    match target.find(':') {
        Some(colon) => {
            let scheme = &target[..colon];
            scheme.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
        }
        None => false,
    }
}

/// Where a relative link of `from` leads, or why it leads nowhere.
fn resolve(
    from: &Path,
    target: &str,
    anchor_cache: &mut HashMap<PathBuf, BTreeSet<String>>,
) -> Result<PathBuf, String> {
    let root = root();
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (percent_decode(path), Some(percent_decode(anchor))),
        None => (percent_decode(target), None),
    };
    let path = path.split_once('?').map_or(path.as_str(), |(p, _)| p).to_string();
    let file = if path.is_empty() {
        from.to_path_buf()
    } else if let Some(from_root) = path.strip_prefix('/') {
        root.join(from_root)
    } else {
        from.parent().unwrap().join(&path)
    };
    let file = file
        .canonicalize()
        .map_err(|_| format!("{} does not exist", relative(&file)))?;
    if !file.starts_with(&root) {
        return Err("leads outside the repository".into());
    }
    let Some(anchor) = anchor.filter(|a| !a.is_empty()) else {
        return Ok(file);
    };
    if file.is_dir() {
        return Err(format!("#{anchor} on a directory"));
    }
    if !file.extension().is_some_and(|e| e.eq_ignore_ascii_case("md")) {
        // GitHub's line anchors of a source file: #L12, #L12-L20.
        let line_anchor = anchor.split('-').all(|part| {
            part.strip_prefix('L')
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        });
        return if line_anchor {
            Ok(file)
        } else {
            Err(format!("#{anchor} on a file that is not Markdown"))
        };
    }
    let anchors = anchor_cache
        .entry(file.clone())
        .or_insert_with(|| anchors(&read(&file)));
    if anchors.contains(&anchor) {
        Ok(file)
    } else {
        Err(format!(
            "no heading of {} has the anchor #{anchor}",
            relative(&file)
        ))
    }
}

#[test]
fn every_relative_link_and_anchor_in_the_markdown_resolves() {
    let files = markdown_files();
    assert!(
        files.iter().any(|f| f.ends_with("README.md")),
        "no README.md found under {}",
        root().display()
    );
    let mut cache = HashMap::new();
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        for link in links(&read(file)) {
            if link.target.is_empty() {
                broken.push(format!(
                    "{}:{} → (empty): a link with no destination",
                    relative(file),
                    link.line
                ));
                continue;
            }
            if is_absolute(&link.target) {
                continue;
            }
            checked += 1;
            if let Err(why) = resolve(file, &link.target, &mut cache) {
                broken.push(format!(
                    "{}:{} → {}: {why}",
                    relative(file),
                    link.line,
                    link.target
                ));
            }
        }
    }
    assert!(
        checked > 0,
        "no relative link found in {} Markdown files",
        files.len()
    );
    assert!(
        broken.is_empty(),
        "{} broken link(s):\n{}",
        broken.len(),
        broken.join("\n")
    );
}

/// The lines of the section under `## {heading}`, up to the next heading of level 2 or above.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let marker = format!("\n## {heading}\n");
    let start = text
        .find(&marker)
        .unwrap_or_else(|| panic!("no section \"## {heading}\""))
        + marker.len();
    let rest = &text[start..];
    let end = rest
        .find("\n## ")
        .or_else(|| rest.find("\n# "))
        .unwrap_or(rest.len());
    &rest[..end]
}

/// The relative links of `text` (a file at `from`) as paths from the workspace root, without
/// anchors, in order.
fn linked_files(from: &Path, text: &str) -> Vec<String> {
    links(text)
        .into_iter()
        .filter(|l| !is_absolute(&l.target) && !l.target.starts_with('#'))
        .filter_map(|l| {
            let path = l.target.split('#').next().unwrap();
            from.parent().unwrap().join(path).canonicalize().ok()
        })
        .map(|p| relative(&p))
        .collect()
}

#[test]
fn the_readme_is_a_front_page_linking_every_chapter_in_reading_order() {
    let readme_path = root().join("README.md");
    let readme = read(&readme_path);
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines; a front page has at most {README_MAX_LINES}"
    );

    let manual = section(&readme, "The manual");
    let listed: Vec<String> = linked_files(&readme_path, manual)
        .into_iter()
        .filter(|p| CHAPTERS.contains(&p.as_str()))
        .collect();
    let mut first_mentions: Vec<String> = Vec::new();
    for p in listed {
        if !first_mentions.contains(&p) {
            first_mentions.push(p);
        }
    }
    let missing: Vec<&&str> = CHAPTERS
        .iter()
        .filter(|c| !first_mentions.iter().any(|p| p == *c))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md, \"## The manual\", does not link {missing:?} (or it does not exist)"
    );
    assert_eq!(
        first_mentions, CHAPTERS,
        "README.md, \"## The manual\": the chapters out of reading order"
    );
}

#[test]
fn each_chapter_opens_with_a_lead_and_ends_with_next_to_the_following_one() {
    let mut wrong = Vec::new();
    for (i, chapter) in CHAPTERS.iter().enumerate() {
        let path = root().join(chapter);
        let Ok(text) = std::fs::read_to_string(&path) else {
            wrong.push(format!("{chapter}: missing"));
            continue;
        };
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        if !lines.next().is_some_and(|l| l.starts_with("# ")) {
            wrong.push(format!("{chapter}: does not start with a title (`# …`)"));
        }
        let lead = lines.next().unwrap_or("");
        if !lead
            .chars()
            .next()
            .is_some_and(|c| c.is_alphanumeric() || c == '[' || c == '*')
        {
            wrong.push(format!("{chapter}: no lead after the title (found {lead:?})"));
        }
        let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        let expected = CHAPTERS.get(i + 1).copied().unwrap_or(AFTER_THE_LAST_CHAPTER);
        let next = linked_files(&path, last);
        if !last.starts_with("Next: ") || next.first().map(String::as_str) != Some(expected) {
            wrong.push(format!(
                "{chapter}: should end with \"Next: \" and a link to {expected}; it ends with {last:?}, \
                 which links {next:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_file_under_docs_can_be_reached_from_the_readme() {
    let root = root();
    let mut reached = BTreeSet::new();
    let mut queue = VecDeque::from([root.join("README.md").canonicalize().unwrap()]);
    while let Some(file) = queue.pop_front() {
        let first_visit = reached.insert(relative(&file));
        let markdown = file.extension().is_some_and(|e| e == "md");
        if !(first_visit && markdown) {
            continue;
        }
        for target in linked_files(&file, &read(&file)) {
            queue.push_back(root.join(target));
        }
    }
    let mut unreached: Vec<String> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| relative(&e.unwrap().path()))
        .filter(|p| !reached.contains(p))
        .collect();
    unreached.sort();
    assert!(
        unreached.is_empty(),
        "no chain of links from README.md reaches {unreached:?}"
    );
}

#[cfg(unix)]
#[test]
fn the_readmes_two_commands_are_the_ones_ci_runs() {
    use std::os::unix::fs::PermissionsExt;

    let root = root();
    let readme = read(&root.join("README.md"));
    let table = section(&readme, "Two commands");
    let mut commands: HashMap<String, String> = HashMap::new();
    for row in table.lines().filter(|l| l.starts_with('|')).skip(2) {
        let cells: Vec<&str> = row.trim_matches('|').split(" | ").map(str::trim).collect();
        let &[what, command] = cells.as_slice() else {
            panic!("README.md, \"Two commands\": a row of two cells, not {row:?}")
        };
        commands.insert(command.trim_matches('`').to_string(), what.to_string());
    }
    for (script, says) in [("scripts/test.sh", "the tests"), ("scripts/dev.sh", "locally")] {
        let what = commands.get(script).unwrap_or_else(|| {
            panic!("README.md, \"Two commands\", does not name `{script}` (it names {commands:?})")
        });
        assert!(
            what.contains(says),
            "README.md, \"Two commands\": `{script}` is not the command that runs {says}: {what:?}"
        );
        let mode = std::fs::metadata(root.join(script))
            .unwrap_or_else(|e| panic!("{script}, named by README.md: {e}"))
            .permissions()
            .mode();
        assert!(
            mode & 0o111 != 0,
            "{script}, named by README.md, is not executable (mode {mode:o})"
        );
    }

    let ci = read(&root.join(".ci/run"));
    let runs_the_tests = ci.lines().filter(|l| !l.trim_start().starts_with('#')).any(|l| {
        l.split(|c: char| c.is_whitespace() || c == ';' || c == '&' || c == '|')
            .any(|word| word == "scripts/test.sh" || word == "./scripts/test.sh")
    });
    assert!(
        runs_the_tests,
        ".ci/run does not run scripts/test.sh, the README's test command"
    );
}
