//! The documentation against the tree. A host test: it reads files only, needs neither
//! the VM nor the `in-vm` feature (`cargo test -p ublkd-tests --test docs`).
//!
//! What it checks, and the conventions the docs keep for it:
//!
//! - **Messages.** In `docs/troubleshooting.md`, the section under the heading
//!   `## Messages` (up to the next `## ` heading) quotes ublkd's messages: every line
//!   there that starts with ``- ` `` carries one, the text between its first two
//!   backticks. That text must occur in a `.rs` file under `supervisor/src`,
//!   `config/src`, `proto/src` or `worker/src`, as the compiled string has it: a
//!   string continued over lines with a trailing `\` is joined first, and `\"` read as
//!   `"`. So a reworded message fails this test until the page follows it.
//! - **README length.** `README.md` has at most [`README_MAX_LINES`] lines.
//! - **Links.** Every markdown link in `README.md`, `ARCHITECTURE.md` and `docs/*.md`
//!   (`[text](target)`, and `[label]: target` definitions), outside fenced code,
//!   points to a file or directory inside the repository that exists; web links
//!   (`http://`, `https://`, `mailto:`) are left alone, any other scheme fails. An
//!   anchor (`#...`) into a markdown file must name one of its headings, slugged as
//!   GitHub does. An inline code span that reads as a path (`../x`, or an absolute path
//!   into this checkout) must not leave the repository either.
//! - **The README's dashboard.** Every test file in `tests/tests/` is linked from
//!   `README.md`, so that a new test file is not left off the evidence it gives.
//! - **Config keys.** Every key of the config file (the fields of the `Raw*` tables in
//!   `config/src/raw.rs`) is documented in the man page `docs/ublkd.toml.5` (as
//!   `\fBkey\fR`) and named in `docs/operators-guide.md` (as `` `key` ``).
//!
//! Each failure names the file and line to fix.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The most lines `README.md` may have: it is a front page, not the manual.
const README_MAX_LINES: usize = 170;

/// Fewer quoted messages than this means the section lost its marker or its content.
const MIN_MESSAGES: usize = 60;

/// The directories whose code the quoted messages must come from.
const MESSAGE_SOURCES: [&str; 4] = ["supervisor/src", "config/src", "proto/src", "worker/src"];

/// The repository's root.
fn root() -> PathBuf {
    ublkd_tests::repo_root()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The path of `path` relative to the root, for messages.
fn shown(root: &Path, path: &Path) -> String {
    path.strip_prefix(root).unwrap_or(path).display().to_string()
}

/// Every file under `dir` whose name ends in `ext`, recursively, in a stable order.
fn files_under(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries =
            fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.to_string_lossy().ends_with(ext) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Rust source as its string literals compile: a `\` at the end of a line joins the
/// next line without its leading whitespace, and `\"` is `"`.
fn compiled_strings(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('\n') => {
                chars.next();
                while chars.peek().is_some_and(|c| *c == ' ' || *c == '\t') {
                    chars.next();
                }
            }
            Some('"') => {
                chars.next();
                out.push('"');
            }
            _ => out.push(c),
        }
    }
    out
}

/// The lines of a markdown file outside fenced code blocks, with their numbers (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (at, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push((at + 1, line));
        }
    }
    lines
}

/// `line` without its inline code spans, and the spans' contents.
fn split_code_spans(line: &str) -> (String, Vec<&str>) {
    let mut text = String::with_capacity(line.len());
    let mut spans = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        text.push_str(&rest[..start]);
        let ticks = rest[start..].chars().take_while(|c| *c == '`').count();
        let fence = &rest[start..start + ticks];
        let after = &rest[start + ticks..];
        match after.find(fence) {
            Some(end) => {
                spans.push(after[..end].trim());
                rest = &after[end + ticks..];
            }
            None => {
                text.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    text.push_str(rest);
    (text, spans)
}

/// The link targets of one line of prose (code spans already removed).
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let trimmed = text.trim_start();
    // `[label]: target`, a link definition.
    if trimmed.starts_with('[')
        && let Some(close) = trimmed.find("]:")
        && !trimmed[..close].contains("](")
    {
        if let Some(target) = trimmed[close + 2..].split_whitespace().next() {
            targets.push(target.trim_matches(['<', '>']).to_string());
        }
        return targets;
    }
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').unwrap_or(after.len());
        let target = after[..end].split_whitespace().next().unwrap_or("");
        targets.push(target.trim_matches(['<', '>']).to_string());
        rest = &after[end..];
    }
    targets
}

/// A heading's anchor as GitHub makes it: lower case, letters, digits, `-` and `_`
/// kept, spaces made `-`, everything else dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a markdown file's headings (a repeated heading gets `-1`, `-2`, ...).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut anchors = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim().trim_end_matches('#'));
        let count = seen.entry(base.clone()).or_insert(0);
        anchors.insert(if *count == 0 { base.clone() } else { format!("{base}-{count}") });
        *count += 1;
    }
    anchors
}

/// `path` with `.` and `..` resolved lexically, or `None` if it climbs above the root.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return None,
            Component::Normal(name) => out.push(name),
        }
    }
    Some(out)
}

/// What is wrong with the link `target` in the markdown file `file`, if anything.
fn link_problem(root: &Path, file: &Path, target: &str) -> Option<String> {
    if target.is_empty() {
        return Some("an empty link target".into());
    }
    if target.starts_with("http://")
        || target.starts_with("https://")
        || target.starts_with("mailto:")
    {
        return None;
    }
    if target.contains("://") || target.starts_with("file:") {
        return Some(format!("{target} is not a file in the repository"));
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let dir = file.parent().expect("a file has a directory").strip_prefix(root).ok()?;
    let resolved = if path.is_empty() {
        file.strip_prefix(root).ok()?.to_path_buf()
    } else if path.starts_with('/') {
        return Some(format!("{target} is an absolute path, not a path in the repository"));
    } else {
        match normalize(&dir.join(path)) {
            Some(resolved) => resolved,
            None => return Some(format!("{target} points outside the repository")),
        }
    };
    let full = root.join(&resolved);
    if !full.exists() {
        return Some(format!("{target}: {} does not exist", resolved.display()));
    }
    if let Some(anchor) = anchor
        && full.extension().is_some_and(|e| e == "md")
        && !anchors(&read(&full)).contains(anchor)
    {
        return Some(format!("{target}: {} has no heading #{anchor}", resolved.display()));
    }
    None
}

/// What is wrong with an inline code span that reads as a path, if anything: one that
/// climbs out of the repository, or an absolute path into this very checkout.
fn code_path_problem(root: &Path, file: &Path, span: &str) -> Option<String> {
    if span.contains(char::is_whitespace) {
        return None;
    }
    if span.starts_with(&*root.to_string_lossy()) {
        return Some(format!("`{span}` is this checkout's absolute path; give it relative"));
    }
    if span.starts_with("../") {
        let dir = file.parent()?.strip_prefix(root).ok()?;
        if normalize(&dir.join(span)).is_none() {
            return Some(format!("`{span}` points outside the repository"));
        }
    }
    None
}

/// The markdown files whose links are checked.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    files.extend(files_under(&root.join("docs"), ".md"));
    files
}

#[test]
fn every_quoted_message_is_in_the_code() {
    let root = root();
    let mut sources = String::new();
    for dir in MESSAGE_SOURCES {
        for file in files_under(&root.join(dir), ".rs") {
            sources.push_str(&compiled_strings(&read(&file)));
            sources.push('\n');
        }
    }
    let page = root.join("docs/troubleshooting.md");
    let text = read(&page);
    let mut in_section = false;
    let mut quoted = 0;
    let mut missing = Vec::new();
    for (at, line) in prose_lines(&text) {
        if line.starts_with("## ") {
            in_section = line.trim() == "## Messages";
            continue;
        }
        if !in_section || !line.starts_with("- `") {
            continue;
        }
        let fragment = line[3..].split('`').next().unwrap_or("");
        quoted += 1;
        if fragment.trim().len() < 6 {
            missing.push(format!(
                "{}:{at}: `{fragment}` is too short to name a message",
                shown(&root, &page)
            ));
        } else if !sources.contains(fragment) {
            missing.push(format!(
                "{}:{at}: `{fragment}` occurs in no .rs file under {}",
                shown(&root, &page),
                MESSAGE_SOURCES.join(", ")
            ));
        }
    }
    assert!(
        quoted >= MIN_MESSAGES,
        "{}: only {quoted} quoted messages under `## Messages` (lines starting with \"- `\"); \
         expected at least {MIN_MESSAGES}",
        shown(&root, &page)
    );
    assert!(missing.is_empty(), "messages the code no longer prints:\n{}", missing.join("\n"));
}

#[test]
fn the_readme_is_short() {
    let root = root();
    let lines = read(&root.join("README.md")).lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move detail into docs/"
    );
}

#[test]
fn every_link_stays_in_the_repository_and_resolves() {
    let root = root();
    let mut problems = Vec::new();
    for file in markdown_files(&root) {
        let text = read(&file);
        for (at, line) in prose_lines(&text) {
            let (prose, spans) = split_code_spans(line);
            for target in link_targets(&prose) {
                if let Some(problem) = link_problem(&root, &file, &target) {
                    problems.push(format!("{}:{at}: {problem}", shown(&root, &file)));
                }
            }
            for span in spans {
                if let Some(problem) = code_path_problem(&root, &file, span) {
                    problems.push(format!("{}:{at}: {problem}", shown(&root, &file)));
                }
            }
        }
    }
    assert!(problems.is_empty(), "links to fix:\n{}", problems.join("\n"));
}

#[test]
fn the_readme_links_every_test_file() {
    let root = root();
    let readme = read(&root.join("README.md"));
    let linked: BTreeSet<String> = prose_lines(&readme)
        .iter()
        .flat_map(|(_, line)| link_targets(&split_code_spans(line).0))
        .collect();
    let unlinked: Vec<String> = files_under(&root.join("tests/tests"), ".rs")
        .into_iter()
        .filter(|f| f.parent().is_some_and(|d| d.ends_with("tests/tests")))
        .map(|f| shown(&root, &f))
        .filter(|f| !linked.contains(f))
        .collect();
    assert!(
        unlinked.is_empty(),
        "README.md's status dashboard links no evidence to these test files: {}",
        unlinked.join(", ")
    );
}

/// The keys of the config file: the fields of `config/src/raw.rs`'s `Raw*` tables
/// (not `RawFile`, whose fields are the tables themselves).
fn config_keys(root: &Path) -> Vec<(String, String)> {
    let raw = read(&root.join("config/src/raw.rs"));
    let mut keys = Vec::new();
    let mut table: Option<&str> = None;
    for line in raw.lines() {
        // Indented too: `[defaults]` and `[[device]]` are declared inside a macro call.
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix("pub(crate) struct Raw") {
            let name = rest.split([' ', '{', '(']).next().unwrap_or("");
            table = (line.ends_with('{') && name != "File").then_some(name);
            continue;
        }
        if line.starts_with('}') {
            table = None;
            continue;
        }
        if let Some(name) = table
            && let Some(field) = line.trim().strip_prefix("pub ")
            && let Some((key, _)) = field.split_once(':')
        {
            keys.push((name.to_string(), key.trim().to_string()));
        }
    }
    keys
}

#[test]
fn every_config_key_is_documented() {
    let root = root();
    let keys = config_keys(&root);
    assert!(keys.len() >= 20, "config/src/raw.rs: found only {} keys: {keys:?}", keys.len());
    let man = read(&root.join("docs/ublkd.toml.5"));
    let guide = read(&root.join("docs/operators-guide.md"));
    let mut undocumented = Vec::new();
    for (table, key) in &keys {
        if !man.contains(&format!("\\fB{key}\\fR")) {
            undocumented.push(format!("docs/ublkd.toml.5: no entry \\fB{key}\\fR (Raw{table})"));
        }
        if !guide.contains(&format!("`{key}`")) {
            undocumented
                .push(format!("docs/operators-guide.md: `{key}` is not named (Raw{table})"));
        }
    }
    assert!(undocumented.is_empty(), "config keys to document:\n{}", undocumented.join("\n"));
}

#[test]
fn the_checks_themselves_work() {
    assert_eq!(compiled_strings("\"a \\\n     b \\\"c\\\"\""), "\"a b \"c\"\"");
    assert_eq!(
        slug("The recovery-stall benchmark: `bench/run recovery`"),
        "the-recovery-stall-benchmark-benchrun-recovery"
    );
    assert_eq!(
        slug("6.12 LTS, per-I/O path (issue 20), 2026-12-02"),
        "612-lts-per-io-path-issue-20-2026-12-02"
    );
    assert_eq!(link_targets("see [a](x.md#y) and [`b`](../c \"t\")"), ["x.md#y", "../c"]);
    assert_eq!(link_targets("[label]: docs/x.md"), ["docs/x.md"]);
    let (text, spans) = split_code_spans("a `b` c ``d`e`` f");
    assert_eq!((text.as_str(), spans), ("a  c  f", vec!["b", "d`e"]));
    assert_eq!(normalize(Path::new("docs/../README.md")), Some(PathBuf::from("README.md")));
    assert_eq!(normalize(Path::new("../shared/notes.md")), None);
    let headings = anchors("# A\n```\n# not a heading\n```\n## A\n");
    assert_eq!(headings, BTreeSet::from(["a".to_string(), "a-1".to_string()]));
}
