//! The Prometheus alert rules and the Grafana dashboard in `packaging/monitoring/`
//! against `promtool` and the metrics ublkd exports. A host test: it reads files and
//! runs `promtool`, needs neither the VM nor the `in-vm` feature (`cargo test -p
//! ublkd-tests --test monitoring`).
//!
//! - **promtool.** `promtool check rules` on `ublkd.rules.yml` and `promtool test rules`
//!   on `ublkd.rules.test.yml` must succeed, and so must `promtool check rules` on the
//!   dashboard's queries made recording rules (so each is PromQL that parses). A
//!   missing promtool fails the test (Debian's `prometheus` package has it;
//!   `tests/vm/install-host-deps.sh` installs it). `PROMTOOL=/path/to/promtool`
//!   overrides the one on `PATH`.
//! - **Metric names.** Every metric and label name in every PromQL expression (the
//!   dashboard's panel targets and template variables, the rules' `expr`s) is one ublkd
//!   exports, or one of the few named in [`FOREIGN_METRICS`] and [`FOREIGN_LABELS`]
//!   (node_exporter's and Prometheus's own). The exported names come from the code:
//!   see [`Exported::from_source`]. The names in an expression come from a small
//!   PromQL tokenizer ([`promql_refs`]), not from a prefix match, so a misspelt name
//!   fails whatever it starts with. Every metric family ublkd exports has a panel.
//! - **The rules' shape.** One group `ublkd`; every alert has an `expr`, a `for`, a
//!   `severity` label and a `summary` and a `description`; `ublkd.rules.test.yml` has,
//!   for every alert, a case that fires it and one that expects no alert. A `state`
//!   matcher names states as metrics.rs's `state_label` does (snake_case), never prose.
//!   The rules' test file's last case joins ublkd's series with node_exporter's
//!   `node_disk_*` on `device`.
//!
//! Each failure names the file, the panel or alert, and the unknown name.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::ErrorKind;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

const RULES: &str = "packaging/monitoring/ublkd.rules.yml";
const RULES_TEST: &str = "packaging/monitoring/ublkd.rules.test.yml";
const DASHBOARD: &str = "packaging/monitoring/ublkd-dashboard.json";
const METRICS_SOURCE: &str = "supervisor/src/metrics.rs";

/// Metrics the rules and the dashboard may use that are not ublkd's, and why.
const FOREIGN_METRICS: [(&str, &str); 2] = [
    ("node_textfile_mtime_seconds", "node_exporter's textfile collector: the file's age"),
    ("up", "Prometheus: whether the scrape of node_exporter worked"),
];

/// Labels that are not ublkd's: Prometheus's target labels, and the textfile
/// collector's `file` on `node_textfile_mtime_seconds`.
const FOREIGN_LABELS: [&str; 3] = ["instance", "job", "file"];

/// The repository's root.
fn root() -> PathBuf {
    ublkd_tests::repo_root()
}

fn read(relative: &str) -> String {
    let path = root().join(relative);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

// --- What ublkd exports -------------------------------------------------------------

/// The sample names and label names ublkd's metrics carry.
#[derive(Debug)]
struct Exported {
    /// Every sample name as the exposition has it (`_total`, `_bucket`, …).
    metrics: BTreeSet<String>,
    /// Each family's name and its sample names.
    families: BTreeMap<String, Vec<String>>,
    labels: BTreeSet<String>,
    /// The `state` label's values, from `state_label`'s match arms.
    states: Vec<String>,
}

impl Exported {
    /// Read from `supervisor/src/metrics.rs` as text, up to its `#[cfg(test)]` module:
    ///
    /// - each `const X: Family = Family::KIND("NAME", "…");` is a family (KIND:
    ///   `counter`, `gauge` or `histogram`);
    ///   its samples are named as `render` names them: a counter `NAME_total`, a gauge
    ///   `NAME`, a histogram `NAME_bucket`, `NAME_sum` and `NAME_count`;
    /// - a label is an identifier right before `=\"` (the code writes them as
    ///   `device=\"{}\"`), `le` included;
    /// - every other string literal there that starts with `ublkd_` (a sample name
    ///   written out, such as `"ublkd_device_requests_total"`) must be one of the above, so a
    ///   sample written outside the families fails here rather than go unchecked.
    fn from_source(source: &str) -> Exported {
        let code = source.split("#[cfg(test)]").next().expect("split yields a first part");
        let mut families = BTreeMap::new();
        for block in code.split(": Family =").skip(1) {
            let block = block.split(';').next().expect("split yields a first part");
            let kind = field(block, "Family::", '(')
                .unwrap_or_else(|| panic!("{METRICS_SOURCE}: a Family without a kind: {block}"));
            let name = block
                .split_once('(')
                .and_then(|(_, args)| args.trim_start().strip_prefix('"'))
                .and_then(|args| args.split_once('"'))
                .map(|(name, _)| name)
                .unwrap_or_else(|| panic!("{METRICS_SOURCE}: a Family without a name: {block}"));
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "gauge" => &[""],
                "histogram" => &["_bucket", "_sum", "_count"],
                other => {
                    panic!("{METRICS_SOURCE}: family {name} has a kind this test lacks: {other}")
                }
            };
            let samples = suffixes.iter().map(|s| format!("{name}{s}")).collect();
            families.insert(name.to_string(), samples);
        }
        assert!(
            families.contains_key("ublkd_device_info") && families.len() >= 5,
            "{METRICS_SOURCE}: found only {:?}: did its `const X: Family = Family::KIND(` shape change?",
            families.keys()
        );
        let metrics: BTreeSet<String> = families.values().flatten().cloned().collect();

        let mut labels = BTreeSet::new();
        for (at, _) in code.match_indices("=\\\"") {
            let name: String = code[..at]
                .chars()
                .rev()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            if !name.is_empty() {
                labels.insert(name);
            }
        }
        for want in ["device", "le"] {
            assert!(labels.contains(want), "{METRICS_SOURCE}: no label {want} found in {labels:?}");
        }

        for (at, _) in code.match_indices("\"ublkd_") {
            let literal = &code[at + 1..];
            let literal = &literal[..literal.find('"').expect("a closed string literal")];
            assert!(
                families.contains_key(literal) || metrics.contains(literal),
                "{METRICS_SOURCE}: {literal:?} is neither a Family's name nor one of its samples"
            );
        }
        let states: Vec<String> = code
            .split("fn state_label(")
            .nth(1)
            .and_then(|f| f.split("\n}\n").next())
            .map(|body| {
                body.split("=> \"").skip(1).filter_map(|s| s.split('"').next()).map(String::from)
            })
            .into_iter()
            .flatten()
            .collect();
        assert!(
            states.iter().any(|s| s == "live") && states.len() >= 5,
            "{METRICS_SOURCE}: no state labels found in `fn state_label`: {states:?}"
        );
        Exported { metrics, families, labels, states }
    }

    fn load() -> Exported {
        Exported::from_source(&read(METRICS_SOURCE))
    }

    fn knows_metric(&self, name: &str) -> bool {
        self.metrics.contains(name) || FOREIGN_METRICS.iter().any(|(m, _)| *m == name)
    }

    fn knows_label(&self, name: &str) -> bool {
        self.labels.contains(name) || FOREIGN_LABELS.contains(&name)
    }

    /// What is wrong with the names `expr` uses, each message starting with `place`.
    fn check_expr(&self, place: &str, expr: &str) -> Vec<String> {
        let refs = match promql_refs(expr) {
            Ok(refs) => refs,
            Err(e) => return vec![format!("{place}: cannot tokenize {expr:?}: {e}")],
        };
        let mut problems = Vec::new();
        if refs.metrics.is_empty() {
            problems.push(format!("{place}: names no metric: {expr:?}"));
        }
        for m in refs.metrics.iter().filter(|m| !self.knows_metric(m)) {
            problems.push(format!(
                "{place}: unknown metric {m} (not exported by {METRICS_SOURCE}) in {expr:?}"
            ));
        }
        for l in refs.labels.iter().filter(|l| !self.knows_label(l)) {
            problems.push(format!("{place}: unknown label {l} in {expr:?}"));
        }
        problems
    }
}

/// The text after `prefix` in `block` up to `end`, trimmed.
fn field<'a>(block: &'a str, prefix: &str, end: char) -> Option<&'a str> {
    let rest = &block[block.find(prefix)? + prefix.len()..];
    Some(rest[..rest.find(end)?].trim())
}

// --- PromQL --------------------------------------------------------------------------

/// The metric and label names a PromQL expression uses.
#[derive(Debug, Default, PartialEq)]
struct Refs {
    metrics: BTreeSet<String>,
    labels: BTreeSet<String>,
    /// The `state` label's values, from `state_label`'s match arms.
    states: Vec<String>,
}

/// Words that are PromQL's own, never a metric: keywords, binary set operators,
/// aggregations (which may be followed by `by`/`without` rather than a parenthesis),
/// and the two float literals.
const KEYWORDS: [&str; 27] = [
    "and",
    "or",
    "unless",
    "atan2",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "inf",
    "nan",
];

/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: [&str; 6] = ["by", "without", "on", "ignoring", "group_left", "group_right"];

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The metric and label names in `expr`, by a tokenizer that knows as much PromQL as
/// the rules and the dashboard use, and Grafana's `$variables`:
///
/// - strings (`"…"`, `'…'`, `` `…` ``), `[…]` ranges and subqueries, numbers and
///   durations, `#` comments and Grafana variables (`$x`, `${x}`) name nothing;
/// - in `{…}`, each matcher's left side is a label name;
/// - after `by`, `without`, `on`, `ignoring`, `group_left`, `group_right`, the names
///   in the parentheses are labels;
/// - any other identifier is a function when a `(` follows it, a keyword when it is
///   one of [`KEYWORDS`], and otherwise a metric name.
fn promql_refs(expr: &str) -> Result<Refs, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut refs = Refs::default();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if matches!(c, '"' | '\'' | '`') {
            i = skip_string(&chars, i)?;
        } else if c == '{' {
            i = label_matchers(&chars, i, &mut refs.labels)?;
        } else if c == '[' {
            i = close_of(&chars, i, ']')?;
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '$' {
            i += 1;
            if chars.get(i) == Some(&'{') {
                i = close_of(&chars, i, '}')?;
            } else {
                while i < chars.len() && is_ident(chars[i]) {
                    i += 1;
                }
            }
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let lower = word.to_ascii_lowercase();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let paren = chars.get(next) == Some(&'(');
            if LABEL_LISTS.contains(&lower.as_str()) {
                if paren {
                    let close = close_of(&chars, next, ')')?;
                    let list: String = chars[next + 1..close - 1].iter().collect();
                    for label in list.split(',').map(str::trim).filter(|l| !l.is_empty()) {
                        if !label.chars().all(is_ident) {
                            return Err(format!("not a label list after {word}: ({list})"));
                        }
                        refs.labels.insert(label.to_string());
                    }
                    i = close;
                }
            } else if !paren && !KEYWORDS.contains(&lower.as_str()) {
                refs.metrics.insert(word);
            }
        } else {
            i += 1;
        }
    }
    Ok(refs)
}

/// The index after the string literal that starts at `open`.
fn skip_string(chars: &[char], open: usize) -> Result<usize, String> {
    let quote = chars[open];
    let mut i = open + 1;
    while i < chars.len() {
        match chars[i] {
            '\\' if quote != '`' => i += 2,
            c if c == quote => return Ok(i + 1),
            _ => i += 1,
        }
    }
    Err(format!("an unterminated string from {open}"))
}

/// The index after the `close` that ends what opens at `open` (strings skipped).
fn close_of(chars: &[char], open: usize, close: char) -> Result<usize, String> {
    let mut i = open + 1;
    while i < chars.len() {
        match chars[i] {
            '"' | '\'' | '`' => i = skip_string(chars, i)?,
            c if c == close => return Ok(i + 1),
            _ => i += 1,
        }
    }
    Err(format!("no {close:?} closes the {:?} at {open}", chars[open]))
}

/// Reads the matchers `{name op "value", …}` that open at `open` into `labels`; the
/// index after the `}`.
fn label_matchers(
    chars: &[char],
    open: usize,
    labels: &mut BTreeSet<String>,
) -> Result<usize, String> {
    let mut i = open + 1;
    loop {
        while i < chars.len() && (chars[i].is_whitespace() || chars[i] == ',') {
            i += 1;
        }
        match chars.get(i) {
            None => return Err(format!("no '}}' closes the '{{' at {open}")),
            Some('}') => return Ok(i + 1),
            // A quoted name (Prometheus 3's `{"name"}`): not one of ours.
            Some('"' | '\'' | '`') => i = skip_string(chars, i)?,
            Some(&c) if is_ident_start(c) => {
                let start = i;
                while i < chars.len() && is_ident(chars[i]) {
                    i += 1;
                }
                labels.insert(chars[start..i].iter().collect());
                while i < chars.len() && chars[i].is_whitespace() {
                    i += 1;
                }
                let op_start = i;
                while i < chars.len() && matches!(chars[i], '=' | '!' | '~') {
                    i += 1;
                }
                let op: String = chars[op_start..i].iter().collect();
                if !["=", "!=", "=~", "!~"].contains(&op.as_str()) {
                    return Err(format!("a label matcher with the operator {op:?}"));
                }
                while i < chars.len() && chars[i].is_whitespace() {
                    i += 1;
                }
                if !matches!(chars.get(i), Some('"' | '\'' | '`')) {
                    return Err("a label matcher without a quoted value".into());
                }
                i = skip_string(chars, i)?;
            }
            Some(c) => return Err(format!("{c:?} in label matchers")),
        }
    }
}

/// A Grafana variable query: `label_values(EXPR, LABEL)` (or `label_values(LABEL)`)
/// as the expression and the label it lists; anything else is an expression.
fn variable_query(query: &str) -> (Option<String>, Option<String>) {
    let query = query.trim();
    let Some(args) = query.strip_prefix("label_values(").and_then(|a| a.strip_suffix(')')) else {
        return (Some(query.to_string()), None);
    };
    match args.rfind(',') {
        Some(comma) => {
            (Some(args[..comma].trim().to_string()), Some(args[comma + 1..].trim().to_string()))
        }
        None => (None, Some(args.trim().to_string())),
    }
}

// --- The dashboard -------------------------------------------------------------------

/// Every panel of `dashboard`, rows' nested panels too.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    let mut todo: Vec<&Value> =
        dashboard["panels"].as_array().map(|p| p.iter().collect()).unwrap_or_default();
    while let Some(p) = todo.pop() {
        if let Some(nested) = p["panels"].as_array() {
            todo.extend(nested);
        }
        all.push(p);
    }
    all
}

/// What is wrong with `dashboard`, and the ublkd families it shows.
fn check_dashboard(exported: &Exported, dashboard: &Value) -> (Vec<String>, BTreeSet<String>) {
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    let mut check = |place: String, expr: &str, problems: &mut Vec<String>| {
        problems.extend(exported.check_expr(&place, expr));
        if let Ok(refs) = promql_refs(expr) {
            used.extend(refs.metrics);
        }
    };

    if dashboard["schemaVersion"].as_u64().is_none_or(|v| v < 36) {
        problems
            .push(format!("schemaVersion {} is not a Grafana 10+ one", dashboard["schemaVersion"]));
    }
    let variables: Vec<&Value> =
        dashboard["templating"]["list"].as_array().map(|l| l.iter().collect()).unwrap_or_default();
    if !variables.iter().any(|v| v["type"] == "datasource" && v["name"] == "datasource") {
        problems.push("no `datasource` variable of type datasource".into());
    }
    let mut device_variable = false;
    for v in &variables {
        if v["type"] != "query" {
            continue;
        }
        let name = v["name"].as_str().unwrap_or("?");
        let query = v["query"]["query"].as_str().or(v["query"].as_str()).unwrap_or("");
        let (expr, label) = variable_query(query);
        let place = format!("variable ${name}");
        if let Some(expr) = expr {
            check(place.clone(), &expr, &mut problems);
        }
        if let Some(label) = &label
            && !exported.knows_label(label)
        {
            problems.push(format!("{place}: lists the values of unknown label {label}"));
        }
        device_variable |= name == "device" && label.as_deref() == Some("device");
    }
    if !device_variable {
        problems.push("no `device` variable listing label_values(…, device)".into());
    }

    let mut ids = BTreeSet::new();
    for p in panels(dashboard) {
        let title = p["title"].as_str().unwrap_or("(untitled)");
        if !ids.insert(p["id"].to_string()) {
            problems.push(format!("panel {title:?}: id {} is used twice", p["id"]));
        }
        let Some(targets) = p["targets"].as_array() else { continue };
        if p["datasource"]["uid"] != "${datasource}" {
            problems.push(format!("panel {title:?}: datasource is not ${{datasource}}"));
        }
        if targets.is_empty() {
            problems.push(format!("panel {title:?}: no query"));
        }
        for t in targets {
            let place = format!("panel {title:?}, query {}", t["refId"].as_str().unwrap_or("?"));
            match t["expr"].as_str() {
                Some(expr) if !expr.trim().is_empty() => check(place, expr, &mut problems),
                _ => problems.push(format!("{place}: no expr")),
            }
        }
    }
    let shown = exported
        .families
        .iter()
        .filter(|(_, samples)| samples.iter().any(|s| used.contains(s)))
        .map(|(family, _)| family.clone())
        .collect();
    (problems, shown)
}

fn load_dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD)).unwrap_or_else(|e| panic!("{DASHBOARD}: not JSON: {e}"))
}

// --- The rules -----------------------------------------------------------------------

/// One alerting rule as the rules file writes it.
#[derive(Debug)]
struct Alert {
    name: String,
    expr: String,
    /// The rule's other keys seen (`for`, `severity`, `summary`, …).
    keys: BTreeSet<String>,
}

/// The alerts of a rules file in the shape `ublkd.rules.yml` keeps: each starts with
/// `- alert: NAME`; `expr:` is on one line or a `|` block of the lines indented more
/// than it. (promtool checks the YAML itself; this only finds the expressions.)
fn alerts(rules: &str) -> Vec<Alert> {
    let lines: Vec<&str> = rules.lines().collect();
    let mut alerts: Vec<Alert> = Vec::new();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        i += 1;
        if let Some(name) = line.strip_prefix("- alert:") {
            alerts.push(Alert {
                name: name.trim().into(),
                expr: String::new(),
                keys: BTreeSet::new(),
            });
            continue;
        }
        let Some(alert) = alerts.last_mut() else { continue };
        let Some((key, value)) = line.split_once(':') else { continue };
        if key.contains(' ') || key.starts_with('#') {
            continue;
        }
        alert.keys.insert(key.to_string());
        if key == "expr" {
            let value = value.trim();
            if value.starts_with('|') || value.starts_with('>') {
                let own = indent(lines[i - 1]);
                while i < lines.len() && (lines[i].trim().is_empty() || indent(lines[i]) > own) {
                    alert.expr.push_str(lines[i]);
                    alert.expr.push('\n');
                    i += 1;
                }
            } else {
                alert.expr = value.trim_matches(|c| c == '"' || c == '\'').to_string();
            }
        }
    }
    alerts
}

/// What is wrong with a rules file's alerts.
fn check_rules(exported: &Exported, rules: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let found = alerts(rules);
    if found.is_empty() {
        problems.push(format!("{RULES}: no `- alert:` found"));
    }
    for a in &found {
        for key in ["expr", "for", "severity", "summary", "description"] {
            if !a.keys.contains(key) {
                problems.push(format!("{RULES}: alert {} has no {key}", a.name));
            }
        }
        problems.extend(exported.check_expr(&format!("{RULES}: alert {}", a.name), &a.expr));
        problems.extend(state_matchers(&a.expr).into_iter().filter_map(|value| {
            let unknown: Vec<&str> =
                value.split('|').filter(|s| !exported.states.iter().any(|k| k == s)).collect();
            (!unknown.is_empty()).then(|| {
                format!(
                    "{RULES}: alert {} matches state {value:?}: {unknown:?} is no state \
                     label of {METRICS_SOURCE} (snake_case, as `state_label` gives them)",
                    a.name
                )
            })
        }));
    }
    problems
}

/// The values `expr` matches the `state` label against (`state="…"`, `=~`, `!=`,
/// `!~`): a rule must name states as metrics.rs labels them, never by prose.
fn state_matchers(expr: &str) -> Vec<String> {
    let mut values = Vec::new();
    for (at, _) in expr.match_indices("state") {
        let before = expr[..at].chars().next_back();
        if before.is_some_and(is_ident) {
            continue;
        }
        let rest = expr[at + "state".len()..].trim_start();
        let Some(rest) = ["=~", "!~", "!=", "="].iter().find_map(|op| rest.strip_prefix(op)) else {
            continue;
        };
        if let Some(value) = rest.trim_start().strip_prefix('"').and_then(|r| r.split('"').next()) {
            values.push(value.to_string());
        }
    }
    values
}

/// The alerts `promtool test rules` input expects to fire somewhere, and those it
/// expects not to (`exp_alerts: []`), from each `alertname:` to the next test.
fn tested(tests: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    let mut current: Option<String> = None;
    for line in tests.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("alertname:") {
            current = Some(name.trim().to_string());
        } else if line.starts_with("- eval_time:") || line.starts_with("- name:") {
            current = None;
        } else if let Some(name) = &current {
            if line == "exp_alerts: []" {
                quiet.insert(name.clone());
            } else if line.starts_with("- exp_labels:") {
                fires.insert(name.clone());
            }
        }
    }
    (fires, quiet)
}

// --- promtool ------------------------------------------------------------------------

/// Runs promtool with `args` in the repository's root; its output. Fails on a
/// missing promtool (naming the package) and on an unsuccessful run (with its output).
fn promtool(args: &[&str]) -> String {
    let program = std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let out = match Command::new(&program).args(args).current_dir(root()).output() {
        Ok(out) => out,
        Err(e) if e.kind() == ErrorKind::NotFound => panic!(
            "{program} is missing: install Debian's `prometheus` package (`apt-get install \
             prometheus`, which tests/vm/install-host-deps.sh does for ./run-tests), or \
             set PROMTOOL to a promtool binary"
        ),
        Err(e) => panic!("cannot run {program}: {e}"),
    };
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "`{program} {}` failed ({}):\n{text}",
        args.join(" "),
        out.status
    );
    text
}

// --- The tests -----------------------------------------------------------------------

#[test]
fn promtool_checks_the_rules() {
    let out = promtool(&["check", "rules", RULES]);
    let count = alerts(&read(RULES)).len();
    assert!(
        out.contains(&format!("SUCCESS: {count} rules found")),
        "promtool found another number of rules than the {count} alerts this test reads \
         in {RULES}:\n{out}"
    );
}

#[test]
fn promtool_unit_tests_pass() {
    promtool(&["test", "rules", RULES_TEST]);
}

#[test]
fn every_alert_is_tested_firing_and_quiet() {
    let names: BTreeSet<String> = alerts(&read(RULES)).into_iter().map(|a| a.name).collect();
    let (fires, quiet) = tested(&read(RULES_TEST));
    let mut problems = Vec::new();
    for name in &names {
        if !fires.contains(name) {
            problems.push(format!("{RULES_TEST}: no case fires {name}"));
        }
        if !quiet.contains(name) {
            problems.push(format!("{RULES_TEST}: no case expects {name} not to fire"));
        }
    }
    for name in fires.union(&quiet).filter(|n| !names.contains(*n)) {
        problems.push(format!("{RULES_TEST}: tests {name}, which {RULES} lacks"));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_rules_name_only_metrics_ublkd_exports() {
    let rules = read(RULES);
    assert!(rules.contains("- name: ublkd\n"), "{RULES}: no group named ublkd");
    assert_eq!(rules.matches("- name:").count(), 1, "{RULES}: one group only");
    let problems = check_rules(&Exported::load(), &rules);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_dashboard_names_only_metrics_ublkd_exports_and_shows_each() {
    let exported = Exported::load();
    let (problems, shown) = check_dashboard(&exported, &load_dashboard());
    assert!(problems.is_empty(), "{DASHBOARD}:\n{}", problems.join("\n"));
    let missing: Vec<&String> = exported.families.keys().filter(|f| !shown.contains(*f)).collect();
    assert!(missing.is_empty(), "{DASHBOARD}: no panel shows {missing:?}");
}

/// Every dashboard query is PromQL promtool parses: each, its Grafana variables
/// replaced ([`grafana_substituted`]), as a recording rule of a file for `promtool
/// check rules`.
#[test]
fn promtool_parses_every_dashboard_query() {
    let dashboard = load_dashboard();
    let mut queries: Vec<(String, String)> = Vec::new();
    for p in panels(&dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("(untitled)");
            let place = format!("panel {title:?}, query {}", t["refId"].as_str().unwrap_or("?"));
            queries.push((place, t["expr"].as_str().unwrap_or_default().to_string()));
        }
    }
    for v in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        let query = v["query"]["query"].as_str().or(v["query"].as_str()).unwrap_or("");
        if let (Some(expr), _) = variable_query(query)
            && v["type"] == "query"
        {
            queries.push((format!("variable ${}", v["name"].as_str().unwrap_or("?")), expr));
        }
    }
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (place, expr)) in queries.iter().enumerate() {
        let expr = serde_json::to_string(&grafana_substituted(expr)).expect("a string");
        rules.push_str(&format!("      # {place}\n      - record: dashboard:query{i}\n"));
        rules.push_str(&format!("        expr: {expr}\n"));
    }
    let dir = TempDir::new();
    let path = dir.0.join("dashboard.rules.yml");
    fs::write(&path, &rules).expect("the queries' rules file is written");
    let out = promtool(&["check", "rules", path.to_str().expect("a UTF-8 temporary path")]);
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "promtool did not find the {} queries:\n{out}\n{rules}",
        queries.len()
    );
}

/// A directory of this process's own under the temporary directory, removed when
/// dropped (a failed test too).
#[derive(Debug)]
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("ublkd-monitoring-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("a temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `expr` with Grafana's variables replaced by what Prometheus parses: an interval
/// (`$__rate_interval`, `$__interval`, `$__range`) by `5m`, any other (`$device`,
/// `${device}`, always inside a quoted regex here) by `.*`.
fn grafana_substituted(expr: &str) -> String {
    let mut out = String::with_capacity(expr.len());
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at + 1..];
        let braced = rest.starts_with('{');
        let name_at = usize::from(braced);
        let len = rest[name_at..].find(|c: char| !is_ident(c)).unwrap_or(rest.len() - name_at);
        let name = &rest[name_at..name_at + len];
        out.push_str(if name.starts_with("__") { "5m" } else { ".*" });
        rest =
            &rest[name_at + len + usize::from(braced && rest[name_at + len..].starts_with('}'))..];
    }
    out.push_str(rest);
    out
}

/// The checks can fail: a made-up metric, a misspelt one without the `ublkd_` prefix
/// and an unknown label are each refused, naming the panel or alert.
#[test]
fn the_checker_refuses_unknown_names() {
    let exported = Exported::load();
    let mut dashboard = load_dashboard();
    let (problems, _) = check_dashboard(&exported, &dashboard);
    assert!(problems.is_empty(), "{problems:?}");
    let panel = dashboard["panels"]
        .as_array_mut()
        .expect("the dashboard has panels")
        .iter_mut()
        .find(|p| p["title"] == "In flight")
        .expect("the dashboard has an In flight panel");
    panel["targets"][0]["expr"] =
        "rate(ublkd_device_made_up_total{device=~\"$device\"}[5m])".into();
    let (problems, _) = check_dashboard(&exported, &dashboard);
    assert!(
        problems.iter().any(|p| p.contains("panel \"In flight\"")
            && p.contains("unknown metric ublkd_device_made_up_total")),
        "{problems:?}"
    );

    for (expr, unknown) in [
        ("sum by (device) (rate(ublk_device_io_total[5m]))", "unknown metric ublk_device_io_total"),
        ("ublkd_device_inflight_requests{devcie=\"ublkb3\"}", "unknown label devcie"),
        ("sum by (dev) (ublkd_device_inflight_requests)", "unknown label dev"),
        ("vector(1)", "names no metric"),
    ] {
        let problems = exported.check_expr("here", expr);
        assert!(problems.iter().any(|p| p.contains(unknown)), "{expr}: {problems:?}");
    }

    let rules = "groups:\n  - name: ublkd\n    rules:\n      - alert: Made\n        expr: |\n          \
                 ublkd_device_made_up > 0\n        for: 1m\n        labels:\n          \
                 severity: warning\n        annotations:\n          summary: s\n          \
                 description: d\n      - alert: Bare\n        expr: up == 0\n";
    let problems = check_rules(&exported, rules);
    assert!(
        problems.iter().any(|p| p.contains("alert Made") && p.contains("ublkd_device_made_up")),
        "{problems:?}"
    );
    assert!(problems.iter().any(|p| p.contains("alert Bare has no for")), "{problems:?}");

    // A state by prose, as the rules once matched it, is refused; snake_case passes.
    let prose = "groups:\n  - name: ublkd\n    rules:\n      - alert: Prose\n        expr: |\n          \
                 ublkd_device_state{state=~\"live|waiting for an operator\"} == 1\n        \
                 for: 1m\n        labels:\n          severity: warning\n        annotations:\n          \
                 summary: s\n          description: d\n";
    let problems = check_rules(&exported, prose);
    assert!(
        problems.iter().any(|p| p.contains("alert Prose") && p.contains("waiting for an operator")),
        "{problems:?}"
    );
    let snake = prose.replace("waiting for an operator", "waiting_for_operator");
    assert!(check_rules(&exported, &snake).is_empty(), "{:?}", check_rules(&exported, &snake));
}

#[test]
fn the_tokenizer_finds_metrics_and_labels_only() {
    let expr = r#"
        histogram_quantile(0.99, sum by (instance, le) (rate(a_bucket{op=~"read|write",
          x!="a}b\"c"}[$__rate_interval] offset 5m)))
        > 0.5 and on (device) group_left(state) count without (op) (b:c{y="$device"})
        or vector(0) * 1e3 unless time() - c @ end() # d_comment
        / max_over_time(d[1h:1m]) > bool Inf or sum(e) by (z)"#;
    let refs = promql_refs(expr).unwrap();
    let set = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(refs.metrics, set(&["a_bucket", "b:c", "c", "d", "e"]));
    assert_eq!(refs.labels, set(&["device", "instance", "le", "op", "state", "x", "y", "z"]));
    assert_eq!(
        variable_query("label_values(ublkd_device_info{instance=~\"$instance\"}, device)"),
        (Some("ublkd_device_info{instance=~\"$instance\"}".into()), Some("device".into()))
    );
    assert!(promql_refs("a{b=\"c}").is_err());
    assert_eq!(
        grafana_substituted("rate(a{d=~\"$device\",i=~\"${instance}\"}[$__rate_interval])"),
        "rate(a{d=~\".*\",i=~\".*\"}[5m])"
    );
}

#[test]
fn the_exported_names_come_from_the_code() {
    let exported = Exported::load();
    // A few the docs' table names, to show the reading of the source works.
    for name in [
        "ublkd_build_info",
        "ublkd_devices",
        "ublkd_device_info",
        "ublkd_device_state",
        "ublkd_device_requests_total",
        "ublkd_device_request_errors_total",
        "ublkd_device_inflight_requests",
        "ublkd_device_last_recovery_timestamp_seconds",
        "ublkd_device_request_duration_seconds_bucket",
        "ublkd_device_request_duration_seconds_count",
    ] {
        assert!(exported.metrics.contains(name), "{name} not in {:?}", exported.metrics);
    }
    assert!(!exported.metrics.contains("ublkd_device_request_duration_seconds"));
    assert!(!exported.metrics.contains("ublkd_device_requests"));
    for label in ["device", "id", "op", "state", "target", "name", "version", "le"] {
        assert!(exported.labels.contains(label), "{label} not in {:?}", exported.labels);
    }
}
