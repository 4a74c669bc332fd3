//! Every device's numbers as text a Prometheus setup scrapes: OpenMetrics for
//! `ublkctl metrics`, and the Prometheus text format for node_exporter's textfile
//! collector (`daemon.metrics_file`, written by [`FileWriter`] off the loop thread).
//!
//! The two formats carry the same samples, names and labels. They differ where
//! node_exporter's parser (the Prometheus text format only) reads OpenMetrics wrong:
//! OpenMetrics names a counter's family without its `_total` suffix, which that parser
//! takes for another metric and so loses the counter's type; it has `# UNIT` lines and
//! ends with `# EOF`, which that parser skips as comments.
//!
//! The names follow Prometheus's conventions, so that rules need no regex on prose:
//! every per-device series has `device="ublkbN"` (node_exporter's `node_disk_*`
//! label, to join on) and `id="N"`; the state is a state-set (`ublkd_device_state`,
//! snake_case values, 1 for the device's); names carry their unit and what they
//! count. The names are an interface: packaging/monitoring's rules and dashboard use
//! them, and tests/tests/monitoring.rs checks they exist here.
//!
//! Everything counted comes from the shared region, where the worker may have written
//! anything: the values are only printed. Histogram buckets are made cumulative with
//! saturating additions ([`LatencySnapshot::cumulative`]), so they never decrease
//! from one bucket to the next and `_count` is the `+Inf` bucket, whatever the region
//! held.

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use ublkd_proto::msg::DevMetrics;

use crate::device_state::StateKind;
use crate::replace_file::{self, Planted, ReplaceError};
use ublkd_proto::shm::{LATENCY_BUCKETS, LatencyOp, LatencySnapshot, latency_bucket_bound_us};

/// Which text format to render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 (`application/openmetrics-text`), ending in `# EOF`.
    OpenMetrics,
    /// The Prometheus text format 0.0.4, what node_exporter's textfile collector reads.
    Prometheus,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric family's metadata.
struct Family {
    name: &'static str,
    kind: Kind,
    help: &'static str,
}

impl Family {
    const fn counter(name: &'static str, help: &'static str) -> Self {
        Family { name, kind: Kind::Counter, help }
    }

    const fn gauge(name: &'static str, help: &'static str) -> Self {
        Family { name, kind: Kind::Gauge, help }
    }

    const fn histogram(name: &'static str, help: &'static str) -> Self {
        Family { name, kind: Kind::Histogram, help }
    }

    /// The name of the family's samples (a histogram's are its name and a suffix).
    fn sample_name(&self) -> String {
        match self.kind {
            Kind::Counter => format!("{}_total", self.name),
            _ => self.name.to_string(),
        }
    }

    /// The family's unit: OpenMetrics wants a unit to end the name, so the name's
    /// suffix says it.
    fn unit(&self) -> Option<&'static str> {
        ["seconds", "bytes"]
            .into_iter()
            .find(|unit| self.name.strip_suffix(unit).is_some_and(|stem| stem.ends_with('_')))
    }
}

const BUILD_INFO: Family =
    Family::gauge("ublkd_build_info", "The ublkd that wrote these numbers, by version (always 1).");
const DEVICES: Family = Family::gauge(
    "ublkd_devices",
    "Devices ublkd serves, by ublkd's state of them (every state, 0 when none).",
);
const INFO: Family = Family::gauge(
    "ublkd_device_info",
    "A device ublkd serves, with what does not change while it is served (always 1).",
);
const STATE: Family = Family::gauge(
    "ublkd_device_state",
    "ublkd's state of the device: 1 for the state it is in, 0 for every other.",
);
const REQUESTS: Family = Family::counter(
    "ublkd_device_requests",
    "Requests the device's workers completed, by operation, failed ones included.",
);
const ERRORS: Family = Family::counter(
    "ublkd_device_request_errors",
    "Requests completed with an error, by operation (other: counted by a worker of an \
     older ublkd, which did not say the operation); sum() is every error.",
);
const BYTES: Family = Family::counter(
    "ublkd_device_bytes",
    "Bytes read or written by the device's successful requests.",
);
const INFLIGHT: Family = Family::gauge(
    "ublkd_device_inflight_requests",
    "Requests waiting at the device's backend, as of the workers' last loop turns.",
);
const RECOVERIES: Family = Family::counter(
    "ublkd_device_recoveries",
    "Recoveries of the device onto a new worker since ublkd started.",
);
const LAST_RECOVERY: Family = Family::gauge(
    "ublkd_device_last_recovery_timestamp_seconds",
    "When the last recovery put the device back LIVE, in seconds since the Unix epoch.",
);
const LAST_RECOVERY_DURATION: Family = Family::gauge(
    "ublkd_device_last_recovery_duration_seconds",
    "How long the last recovery held the device's I/O, from the worker's death seen to LIVE.",
);
const RESTARTS: Family = Family::counter(
    "ublkd_device_worker_restarts",
    "Times the device's serving worker exited or was killed as hung since ublkd started.",
);
const LATENCY: Family = Family::histogram(
    "ublkd_device_request_duration_seconds",
    "Time from a request's FETCH to its COMMIT in the worker, by operation.",
);

/// The shared region's latency buckets (bucket `i` holds requests of at most 2^i µs)
/// whose bounds the exposition keeps, every eighth-fold from 16 µs to 4.19 s: what an
/// operator reads from a histogram, 8 series per operation instead of 25. The others
/// are merged into the next kept one (the counts are cumulative, so merging is
/// leaving a bound out); `ublkctl status`'s quantiles still use every bucket.
const EXPOSED_BUCKETS: [usize; 7] = [4, 7, 10, 13, 16, 19, 22];

/// ublkd's device states as the `state` label says them (snake_case, stable): the
/// prose of [`StateKind`]'s `Display` is for people and may change.
fn state_label(kind: StateKind) -> &'static str {
    match kind {
        StateKind::Starting => "starting",
        StateKind::Adopted => "adopted",
        StateKind::Live => "live",
        StateKind::Hung => "hung",
        StateKind::Recovering => "recovering",
        StateKind::Releasing => "releasing",
        StateKind::WaitingForOperator => "waiting_for_operator",
        StateKind::FailingIo => "failing_io",
    }
}

/// The state [`DevMetrics::state`] names (ublkd sends `StateKind`'s `Display`), or
/// `None` for a text no state has (a ublkd of another version).
fn state_of(text: &str) -> Option<StateKind> {
    StateKind::ALL.into_iter().find(|k| k.to_string() == text)
}

/// One number of a device, if it has one, as sample text.
type DeviceValue = fn(&DevMetrics) -> Option<String>;

/// `devs` as `format` text.
pub fn render(devs: &[DevMetrics], format: Format) -> String {
    let mut out = Out { text: String::with_capacity(devs.len() * 8 * 1024), format };
    out.family(&BUILD_INFO);
    out.sample(BUILD_INFO.name, &format!("version=\"{}\"", escape(env!("CARGO_PKG_VERSION"))), "1");
    out.family(&DEVICES);
    let states: Vec<Option<StateKind>> = devs.iter().map(|d| state_of(&d.state)).collect();
    for kind in StateKind::ALL {
        let n = states.iter().filter(|s| **s == Some(kind)).count();
        out.sample(DEVICES.name, &format!("state=\"{}\"", state_label(kind)), &n.to_string());
    }
    out.family(&INFO);
    for d in devs {
        let name = d.name.as_deref().map(escape).unwrap_or_default();
        let labels =
            format!("{},target=\"{}\",name=\"{name}\"", dev_labels(d.id), escape(&d.target));
        out.sample(INFO.name, &labels, "1");
    }
    out.family(&STATE);
    for (d, state) in devs.iter().zip(&states) {
        for kind in StateKind::ALL {
            let labels = format!("{},state=\"{}\"", dev_labels(d.id), state_label(kind));
            out.sample(STATE.name, &labels, if *state == Some(kind) { "1" } else { "0" });
        }
    }
    out.family(&REQUESTS);
    for d in devs {
        let c = &d.counters;
        let per_op = [c.reads, c.writes, c.flushes, c.discards, c.write_zeroes];
        for (op, n) in LatencyOp::ALL.into_iter().zip(per_op) {
            out.sample(&REQUESTS.sample_name(), &op_labels(d.id, op.name()), &n.to_string());
        }
    }
    out.family(&ERRORS);
    for d in devs {
        let c = &d.counters;
        let per_op = LatencyOp::ALL.into_iter().map(LatencyOp::name).zip(c.op_errors());
        for (op, n) in per_op.chain([("other", c.unattributed_errors())]) {
            out.sample(&ERRORS.sample_name(), &op_labels(d.id, op), &n.to_string());
        }
    }
    out.family(&BYTES);
    for d in devs {
        let c = &d.counters;
        for (op, n) in [(LatencyOp::Read, c.bytes_read), (LatencyOp::Write, c.bytes_written)] {
            out.sample(&BYTES.sample_name(), &op_labels(d.id, op.name()), &n.to_string());
        }
    }
    let per_device: [(&Family, DeviceValue); 5] = [
        (&INFLIGHT, |d| Some(d.inflight.to_string())),
        (&RECOVERIES, |d| Some(d.recoveries.to_string())),
        (&LAST_RECOVERY, |d| d.last_recovery_unix_ms.map(seconds_of_ms)),
        (&LAST_RECOVERY_DURATION, |d| d.last_stall_ms.map(seconds_of_ms)),
        (&RESTARTS, |d| Some(d.worker_restarts.to_string())),
    ];
    for (family, value) in per_device {
        out.family(family);
        for d in devs {
            if let Some(v) = value(d) {
                out.sample(&family.sample_name(), &dev_labels(d.id), &v);
            }
        }
    }
    out.family(&LATENCY);
    for d in devs {
        for op in LatencyOp::ALL {
            out.histogram(&op_labels(d.id, op.name()), d.latency.op(op));
        }
    }
    if format == Format::OpenMetrics {
        out.text.push_str("# EOF\n");
    }
    out.text
}

struct Out {
    text: String,
    format: Format,
}

impl Out {
    fn family(&mut self, f: &Family) {
        // The Prometheus text format names a counter by its sample, OpenMetrics without
        // the suffix.
        let name = match self.format {
            Format::Prometheus => f.sample_name(),
            Format::OpenMetrics => f.name.to_string(),
        };
        let _ = writeln!(self.text, "# HELP {name} {}", f.help);
        let _ = writeln!(self.text, "# TYPE {name} {}", f.kind.name());
        if let (Format::OpenMetrics, Some(unit)) = (self.format, f.unit()) {
            let _ = writeln!(self.text, "# UNIT {name} {unit}");
        }
    }

    fn sample(&mut self, name: &str, labels: &str, value: &str) {
        let _ = writeln!(self.text, "{name}{{{labels}}} {value}");
    }

    fn histogram(&mut self, labels: &str, h: &LatencySnapshot) {
        let name = LATENCY.name;
        let cumulative = h.cumulative();
        let kept = EXPOSED_BUCKETS
            .into_iter()
            .filter_map(|i| Some((seconds_of_us(latency_bucket_bound_us(i)?), cumulative[i])));
        let all = cumulative[LATENCY_BUCKETS - 1];
        for (le, count) in kept.chain([("+Inf".to_string(), all)]) {
            let _ = writeln!(self.text, "{name}_bucket{{{labels},le=\"{le}\"}} {count}");
        }
        let sum = format!("{}.{:09}", h.sum_ns / 1_000_000_000, h.sum_ns % 1_000_000_000);
        self.sample(&format!("{name}_sum"), labels, &sum);
        self.sample(&format!("{name}_count"), labels, &all.to_string());
    }
}

/// A device's own labels: `device` as the kernel names its disk (what node_exporter's
/// `node_disk_*` series carry, so the two join), `id` as ublkctl takes it.
fn dev_labels(id: u32) -> String {
    format!("device=\"ublkb{id}\",id=\"{id}\"")
}

fn op_labels(id: u32, op: &str) -> String {
    format!("{},op=\"{op}\"", dev_labels(id))
}

/// Milliseconds as exact decimal seconds (`1500` → `1.500`), as [`seconds_of_us`].
fn seconds_of_ms(ms: u64) -> String {
    format!("{}.{:03}", ms / 1000, ms % 1000)
}

/// Microseconds as exact decimal seconds (`16` → `0.000016`): no float rounding, and
/// the same text in both formats.
fn seconds_of_us(us: u64) -> String {
    format!("{}.{:06}", us / 1_000_000, us % 1_000_000)
}

/// A label value escaped as both formats want it.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A latency quantile as `ublkctl status` gives it: the upper bound of the bucket that
/// holds it (so "at most"), `Above` for the bucket past the last bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantile {
    AtMostUs(u64),
    AboveUs(u64),
}

/// Quantile `q` of `h`, or `None` with nothing counted.
pub fn quantile(h: &LatencySnapshot, q: f64) -> Option<Quantile> {
    let bucket = h.quantile_bucket(q)?;
    Some(match latency_bucket_bound_us(bucket) {
        Some(us) => Quantile::AtMostUs(us),
        None => Quantile::AboveUs(bucket.checked_sub(1).and_then(latency_bucket_bound_us)?),
    })
}

/// Snapshots waiting for the writer thread, at most: a write still going when the
/// next is due makes the loop skip that one rather than queue it.
const QUEUED_SNAPSHOTS: usize = 1;

/// Writes the metrics file every interval, from a thread of its own: the loop only
/// takes the snapshot (reading the regions), never waits on the file system. A write
/// still going when the next is due makes the loop skip that one.
#[derive(Debug)]
pub struct FileWriter {
    path: PathBuf,
    interval: Duration,
    next: Instant,
    tx: SyncSender<Vec<DevMetrics>>,
}

impl FileWriter {
    /// Starts the writer thread for `path`, first due now.
    /// A directory that every user may write is refused here, once, with the reason.
    pub fn start(path: PathBuf, interval: Duration) -> io::Result<FileWriter> {
        if let Some(dir) = path.parent().filter(|d| d.exists()) {
            // Anything else (not there yet, say) is said by the writes, which retry.
            if let Err(e @ ReplaceError::WorldWritable { .. }) = replace_file::open_dir(dir) {
                return Err(io::Error::other(e));
            }
        }
        let (tx, rx) = mpsc::sync_channel::<Vec<DevMetrics>>(QUEUED_SNAPSHOTS);
        let target = path.clone();
        std::thread::Builder::new().name("ublkd-metrics".into()).spawn(move || {
            let mut failing: Option<String> = None;
            for devs in rx {
                let text = render(&devs, Format::Prometheus);
                match write_replacing(&target, text.as_bytes()) {
                    Ok(planted) => {
                        if let Some(Planted { kind, uid }) = planted {
                            tracing::warn!(
                                event = "metrics_file_planted",
                                "{} was {kind} owned by uid {uid}, not ublkd's file: \
                                 replaced it without writing through it",
                                target.display()
                            );
                        }
                        if failing.take().is_some() {
                            tracing::info!("writing {} works again", target.display());
                        }
                    }
                    Err(e) => {
                        let msg =
                            format!("cannot write the metrics file {}: {e}", target.display());
                        // Once per distinct failure, not every interval.
                        if failing.as_deref() != Some(msg.as_str()) {
                            tracing::warn!(event = "metrics_file_failed", "{msg}");
                            failing = Some(msg);
                        }
                    }
                }
            }
        })?;
        Ok(FileWriter { path, interval, next: Instant::now(), tx })
    }

    /// When the next write is due.
    pub fn due(&self) -> Instant {
        self.next
    }

    /// If a write is due at `now`, hands `snapshot()` to the writer thread (or skips it
    /// if the last write is still going).
    pub fn tick(&mut self, now: Instant, snapshot: impl FnOnce() -> Vec<DevMetrics>) {
        if now < self.next {
            return;
        }
        self.next = now + self.interval;
        match self.tx.try_send(snapshot()) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                tracing::debug!(
                    "metrics file {}: the last write is still going",
                    self.path.display()
                );
            }
            Err(TrySendError::Disconnected(_)) => {
                tracing::error!("metrics file {}: the writer thread is gone", self.path.display());
            }
        }
    }
}

/// Replaces `path` with `data` atomically: a reader (node_exporter) sees the old file
/// or the new one, never a part, and nothing planted in the directory is written
/// through ([`crate::replace_file`]; its temporary names are dot files not ending in
/// `.prom`, which the textfile collector ignores). Readable by all (0644, whatever the
/// umask: the unit's is 0077), since node_exporter runs as its own user.
pub fn write_replacing(path: &Path, data: &[u8]) -> Result<Option<Planted>, ReplaceError> {
    replace_file::replace(path, data, 0o644)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};
    use ublkd_proto::shm::{CounterSnapshot, DevLatency, LATENCY_FINITE_BUCKETS};

    /// One sample line, parsed.
    #[derive(Debug, Clone, PartialEq)]
    struct Sample {
        name: String,
        labels: BTreeMap<String, String>,
        value: f64,
    }

    fn is_name(s: &str) -> bool {
        let mut chars = s.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    /// `name{a="x",b="y"} value`, strictly: no spaces but the one before the value, label
    /// values with only the three escapes, a number or +Inf as the value.
    fn parse_sample(line: &str) -> Result<Sample, String> {
        let bad = |why: &str| format!("{why}: {line:?}");
        let open = line.find('{').ok_or_else(|| bad("no labels"))?;
        let name = &line[..open];
        if !is_name(name) {
            return Err(bad("bad metric name"));
        }
        let mut labels = BTreeMap::new();
        let mut rest = &line[open + 1..];
        loop {
            let eq = rest.find('=').ok_or_else(|| bad("label without ="))?;
            let label = &rest[..eq];
            if !is_name(label) || label.contains(':') {
                return Err(bad("bad label name"));
            }
            rest = rest[eq + 1..].strip_prefix('"').ok_or_else(|| bad("unquoted label value"))?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                match chars.next().ok_or_else(|| bad("unterminated label value"))? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next().map(|(_, c)| c) {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        _ => return Err(bad("bad escape")),
                    },
                    (_, '\n') => return Err(bad("raw newline in a label value")),
                    (_, c) => value.push(c),
                }
            };
            if labels.insert(label.to_string(), value).is_some() {
                return Err(bad("duplicate label"));
            }
            rest = &rest[end + 1..];
            if let Some(r) = rest.strip_prefix(',') {
                rest = r;
            } else if let Some(r) = rest.strip_prefix("} ") {
                rest = r;
                break;
            } else {
                return Err(bad("labels not closed by '} '"));
            }
        }
        let value = match rest {
            "+Inf" => f64::INFINITY,
            v if !v.is_empty() && v.chars().all(|c| c.is_ascii_digit() || c == '.') => {
                v.parse().map_err(|_| bad("bad value"))?
            }
            _ => return Err(bad("bad value")),
        };
        Ok(Sample { name: name.to_string(), labels, value })
    }

    /// A metric family as the parser collected it.
    #[derive(Debug, Default)]
    struct ParsedFamily {
        kind: String,
        unit: Option<String>,
        samples: Vec<Sample>,
    }

    /// Parses OpenMetrics text strictly (the subset ublkd writes: no timestamps, no
    /// exemplars): metadata before samples and once per family, families contiguous,
    /// sample names that fit their family's type, no duplicate series, histograms with
    /// increasing `le`, cumulative counts, `+Inf` last and equal to `_count`, `# EOF`
    /// last. Families by name.
    fn parse_openmetrics(text: &str) -> Result<BTreeMap<String, ParsedFamily>, String> {
        let body = text.strip_suffix("# EOF\n").ok_or("the text does not end with # EOF")?;
        let mut families: BTreeMap<String, ParsedFamily> = BTreeMap::new();
        let mut current: Option<String> = None;
        let mut done: BTreeSet<String> = BTreeSet::new();
        let mut series = BTreeSet::new();
        for line in body.split_inclusive('\n') {
            let line = line.strip_suffix('\n').ok_or("the last line has no newline")?;
            if line.is_empty() {
                return Err("a blank line".into());
            }
            if let Some(meta) = line.strip_prefix("# ") {
                let mut parts = meta.splitn(3, ' ');
                let (what, name, arg) = (parts.next(), parts.next(), parts.next());
                let (Some(what), Some(name), Some(arg)) = (what, name, arg) else {
                    return Err(format!("bad metadata line {line:?}"));
                };
                if current.as_deref() != Some(name) {
                    if let Some(prev) = current.take() {
                        done.insert(prev);
                    }
                    if done.contains(name) || families.contains_key(name) {
                        return Err(format!("family {name} appears twice"));
                    }
                    current = Some(name.to_string());
                }
                let family = families.entry(name.to_string()).or_default();
                if !family.samples.is_empty() {
                    return Err(format!("metadata after samples: {line:?}"));
                }
                match what {
                    "HELP" => {}
                    "TYPE" if ["counter", "gauge", "histogram"].contains(&arg) => {
                        family.kind = arg.to_string();
                    }
                    "UNIT" if name.ends_with(&format!("_{arg}")) => {
                        family.unit = Some(arg.to_string());
                    }
                    _ => return Err(format!("bad metadata line {line:?}")),
                }
                continue;
            }
            if line.starts_with('#') {
                return Err(format!("a comment before # EOF: {line:?}"));
            }
            let sample = parse_sample(line)?;
            let name = current.as_deref().ok_or(format!("a sample without a family: {line:?}"))?;
            let family = families.get_mut(name).expect("current family exists");
            let suffixes: &[&str] = match family.kind.as_str() {
                "counter" => &["_total"],
                "gauge" => &[""],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => return Err(format!("family {name} has no TYPE")),
            };
            if !suffixes.iter().any(|s| sample.name == format!("{name}{s}")) {
                return Err(format!("sample {} does not belong to {name}", sample.name));
            }
            if !series.insert((sample.name.clone(), sample.labels.clone())) {
                return Err(format!("duplicate series {line:?}"));
            }
            family.samples.push(sample);
        }
        for (name, family) in &families {
            if family.kind == "histogram" {
                check_histogram(name, &family.samples)?;
            }
        }
        Ok(families)
    }

    fn check_histogram(name: &str, samples: &[Sample]) -> Result<(), String> {
        let mut groups: BTreeMap<BTreeMap<String, String>, Vec<&Sample>> = BTreeMap::new();
        for s in samples {
            let mut key = s.labels.clone();
            key.remove("le");
            groups.entry(key).or_default().push(s);
        }
        for (labels, group) in groups {
            let buckets: Vec<&&Sample> =
                group.iter().filter(|s| s.name == format!("{name}_bucket")).collect();
            let mut last_le = f64::NEG_INFINITY;
            let mut last_count = 0.0;
            for b in &buckets {
                let le = b.labels.get("le").ok_or(format!("bucket without le: {b:?}"))?;
                let le: f64 = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().map_err(|_| format!("bad le {le}"))?
                };
                if le <= last_le || b.value < last_count || b.value.fract() != 0.0 {
                    return Err(format!("{name}{labels:?}: buckets out of order at {b:?}"));
                }
                (last_le, last_count) = (le, b.value);
            }
            if last_le != f64::INFINITY {
                return Err(format!("{name}{labels:?}: no +Inf bucket"));
            }
            let one = |suffix: &str| {
                let found: Vec<_> =
                    group.iter().filter(|s| s.name == format!("{name}{suffix}")).collect();
                match found[..] {
                    [s] => Ok(s.value),
                    _ => Err(format!("{name}{labels:?}: {} {suffix} samples", found.len())),
                }
            };
            if one("_count")? != last_count {
                return Err(format!("{name}{labels:?}: _count is not the +Inf bucket"));
            }
            one("_sum")?;
        }
        Ok(())
    }

    fn device(id: u32) -> DevMetrics {
        let mut latency = DevLatency::default();
        let read = &mut latency.ops[LatencyOp::Read as usize];
        read.buckets[3] = 10; // <= 8 µs
        read.buckets[5] = 5; // <= 32 µs
        read.sum_ns = 1_500_000_123;
        latency.ops[LatencyOp::Write as usize].buckets[LATENCY_FINITE_BUCKETS] = 2;
        DevMetrics {
            id,
            state: StateKind::Live.to_string(),
            target: "memory".into(),
            counters: CounterSnapshot {
                reads: 15,
                writes: 2,
                bytes_read: 61440,
                bytes_written: 8192,
                errors: 4,
                read_errors: 1,
                write_errors: 2,
                ..Default::default()
            },
            inflight: 3,
            recoveries: 1,
            last_stall_ms: Some(38),
            worker_restarts: 1,
            latency,
            last_recovery_unix_ms: Some(1_765_000_000_250),
            name: Some("db".into()),
        }
    }

    fn value(
        families: &BTreeMap<String, ParsedFamily>,
        family: &str,
        name: &str,
        labels: &[(&str, &str)],
    ) -> f64 {
        let want: BTreeMap<String, String> =
            labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        families[family]
            .samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .unwrap_or_else(|| panic!("no {name}{labels:?}"))
            .value
    }

    #[test]
    fn openmetrics_text_parses_strictly_and_carries_every_number() {
        let mut quiet = device(9);
        quiet.last_stall_ms = None;
        quiet.last_recovery_unix_ms = None;
        quiet.name = None;
        quiet.state = StateKind::WaitingForOperator.to_string();
        quiet.latency = DevLatency::default();
        let text = render(&[device(3), quiet], Format::OpenMetrics);
        let families = parse_openmetrics(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));

        let dev3 = [("device", "ublkb3"), ("id", "3")];
        let op3 = |op| [("device", "ublkb3"), ("id", "3"), ("op", op)];
        assert_eq!(
            value(&families, "ublkd_device_requests", "ublkd_device_requests_total", &op3("read")),
            15.0
        );
        // Errors by op; "other" holds what no op was counted for, so the sum is all.
        let errors = |op| {
            value(
                &families,
                "ublkd_device_request_errors",
                "ublkd_device_request_errors_total",
                &op3(op),
            )
        };
        assert_eq!([errors("read"), errors("write"), errors("flush")], [1.0, 2.0, 0.0]);
        assert_eq!([errors("discard"), errors("write_zeroes"), errors("other")], [0.0, 0.0, 1.0]);
        assert!(
            families["ublkd_device_request_errors"].samples.iter().all(|s| s.labels["op"] != "all")
        );
        assert_eq!(
            value(&families, "ublkd_device_bytes", "ublkd_device_bytes_total", &op3("write")),
            8192.0
        );
        assert_eq!(families["ublkd_device_bytes"].unit.as_deref(), Some("bytes"));
        assert_eq!(
            value(
                &families,
                "ublkd_device_inflight_requests",
                "ublkd_device_inflight_requests",
                &dev3
            ),
            3.0
        );
        let last = "ublkd_device_last_recovery_timestamp_seconds";
        assert_eq!(value(&families, last, last, &dev3), 1_765_000_000.25);
        assert_eq!(families[last].unit.as_deref(), Some("seconds"));
        let took = "ublkd_device_last_recovery_duration_seconds";
        assert_eq!(value(&families, took, took, &dev3), 0.038);
        assert_eq!(
            value(
                &families,
                "ublkd_device_worker_restarts",
                "ublkd_device_worker_restarts_total",
                &dev3
            ),
            1.0
        );
        assert_eq!(
            value(
                &families,
                "ublkd_device_info",
                "ublkd_device_info",
                &[("device", "ublkb3"), ("id", "3"), ("target", "memory"), ("name", "db")]
            ),
            1.0
        );
        // The state is a state-set: one series per state, the device's at 1.
        let state = |id: &str, s: &str| {
            value(
                &families,
                "ublkd_device_state",
                "ublkd_device_state",
                &[("device", &format!("ublkb{id}")), ("id", id), ("state", s)],
            )
        };
        assert_eq!(state("3", "live"), 1.0);
        assert_eq!(state("3", "waiting_for_operator"), 0.0);
        assert_eq!(state("9", "waiting_for_operator"), 1.0);
        assert_eq!(state("9", "live"), 0.0);
        assert_eq!(families["ublkd_device_state"].samples.len(), 2 * StateKind::ALL.len());
        let devices = |s: &str| value(&families, "ublkd_devices", "ublkd_devices", &[("state", s)]);
        assert_eq!((devices("live"), devices("waiting_for_operator")), (1.0, 1.0));
        assert_eq!(devices("failing_io"), 0.0);
        let version = env!("CARGO_PKG_VERSION");
        assert_eq!(
            value(&families, "ublkd_build_info", "ublkd_build_info", &[("version", version)]),
            1.0
        );
        // No recovery yet: no sample, rather than a made-up 0.
        for family in [last, took] {
            let samples = &families[family].samples;
            assert!(samples.iter().all(|s| s.labels["id"] == "3"), "{samples:?}");
        }

        let lat = "ublkd_device_request_duration_seconds";
        let bucket = |le: &str| {
            value(
                &families,
                lat,
                &format!("{lat}_bucket"),
                &[("device", "ublkb3"), ("id", "3"), ("op", "read"), ("le", le)],
            )
        };
        // 10 requests of at most 8 µs and 5 of at most 32 µs: the 8 µs bucket is
        // merged into 16 µs, the 32 µs one into 128 µs.
        assert_eq!(bucket("0.000016"), 10.0);
        assert_eq!(bucket("0.000128"), 15.0);
        assert_eq!(bucket("4.194304"), 15.0);
        assert_eq!(bucket("+Inf"), 15.0);
        let les: Vec<&str> = families[lat]
            .samples
            .iter()
            .filter(|s| s.name.ends_with("_bucket") && s.labels["id"] == "3")
            .filter(|s| s.labels["op"] == "read")
            .map(|s| s.labels["le"].as_str())
            .collect();
        assert_eq!(
            les,
            [
                "0.000016", "0.000128", "0.001024", "0.008192", "0.065536", "0.524288", "4.194304",
                "+Inf"
            ]
        );
        assert_eq!(value(&families, lat, &format!("{lat}_sum"), &op3("read")), 1.500000123);
        assert_eq!(value(&families, lat, &format!("{lat}_count"), &op3("write")), 2.0);
        // Every op of every device has its histogram, empty or not.
        let counts = families[lat].samples.iter().filter(|s| s.name.ends_with("_count")).count();
        assert_eq!(counts, 2 * LatencyOp::ALL.len());
    }

    #[test]
    fn every_state_has_its_own_snake_case_label() {
        let labels: BTreeSet<&str> = StateKind::ALL.into_iter().map(state_label).collect();
        assert_eq!(labels.len(), StateKind::ALL.len());
        for label in &labels {
            assert!(label.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{label}");
        }
        for kind in StateKind::ALL {
            assert_eq!(state_of(&kind.to_string()), Some(kind));
        }
    }

    #[test]
    fn scribbled_counts_and_an_unknown_state_render_valid_text() {
        let mut d = device(1);
        for op in &mut d.latency.ops {
            op.buckets = [u64::MAX; LATENCY_BUCKETS];
            op.sum_ns = u64::MAX;
        }
        d.state = "UNKNOWN (a \"quoted\"\\ta\nb)".into();
        d.name = Some("a \"quoted\"\\name\n".into());
        let text = render(&[d.clone()], Format::OpenMetrics);
        let families = parse_openmetrics(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let info = &families["ublkd_device_info"].samples[0];
        assert_eq!(info.labels["name"], d.name.unwrap());
        // A state ublkd does not know (another version's) is none of the set's.
        assert!(families["ublkd_device_state"].samples.iter().all(|s| s.value == 0.0));
        assert!(families["ublkd_devices"].samples.iter().all(|s| s.value == 0.0));
        let max = u64::MAX.to_string();
        assert!(text.contains(&format!("le=\"0.000016\"}} {max}\n")), "{text}");
        assert!(text.contains(&format!(
            "ublkd_device_request_duration_seconds_count{{device=\"ublkb1\",id=\"1\",op=\"read\"}} {max}\n"
        )));
    }

    #[test]
    fn the_parser_refuses_what_openmetrics_forbids() {
        let good = render(&[device(3)], Format::OpenMetrics);
        assert!(parse_openmetrics(&good).is_ok());
        let read = "device=\"ublkb3\",id=\"3\",op=\"read\"";
        let broken = [
            good.replace("# EOF\n", ""),
            good.replace(
                &format!("{read},le=\"0.000128\"}} 15"),
                &format!("{read},le=\"0.000128\"}} 9"),
            ),
            good.replace(&format!("{read},le=\"+Inf\"}} 15"), &format!("{read},le=\"+Inf\"}} 16")),
            good.replace(
                &format!("ublkd_device_requests_total{{{read}}}"),
                &format!("ublkd_device_requests{{{read}}}"),
            ),
            good.replace("# TYPE ublkd_device_inflight_requests gauge\n", ""),
            good.replace("# EOF\n", "\n# EOF\n"),
            format!("{good}x 1\n"),
        ];
        for (i, text) in broken.iter().enumerate() {
            assert_ne!(text, &good, "case {i} changed nothing");
            assert!(parse_openmetrics(text).is_err(), "case {i} parsed:\n{text}");
        }
    }

    #[test]
    fn the_prometheus_format_has_the_same_samples_with_counters_typed_by_their_sample() {
        let devs = [device(3), device(4)];
        let om = render(&devs, Format::OpenMetrics);
        let prom = render(&devs, Format::Prometheus);
        let samples = |text: &str| -> BTreeSet<String> {
            text.lines().filter(|l| !l.starts_with('#')).map(str::to_string).collect()
        };
        assert_eq!(samples(&om), samples(&prom));
        assert!(prom.contains("# TYPE ublkd_device_requests_total counter\n"), "{prom}");
        assert!(prom.contains("# TYPE ublkd_device_request_duration_seconds histogram\n"));
        assert!(!prom.contains("# EOF") && !prom.contains("# UNIT"), "{prom}");
        // Every line is metadata or a sample of the family named last.
        let mut family = "";
        for line in prom.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap();
            } else if !line.starts_with("# HELP ") {
                let sample = parse_sample(line).unwrap();
                assert!(sample.name.starts_with(family), "{line} after TYPE {family}");
            }
        }
    }

    #[test]
    fn no_devices_is_build_info_zero_counts_and_eof() {
        let text = render(&[], Format::OpenMetrics);
        let families = parse_openmetrics(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(samples.len(), 1 + StateKind::ALL.len(), "{text}");
        assert!(families["ublkd_devices"].samples.iter().all(|s| s.value == 0.0));
    }

    #[test]
    fn quantiles_are_bucket_bounds() {
        let mut h = LatencySnapshot::default();
        assert_eq!(quantile(&h, 0.5), None);
        h.buckets[2] = 1;
        assert_eq!(quantile(&h, 0.5), Some(Quantile::AtMostUs(4)));
        h.buckets[LATENCY_FINITE_BUCKETS] = 5;
        assert_eq!(quantile(&h, 0.99), Some(Quantile::AboveUs(1 << 23)));
    }

    #[test]
    fn the_metrics_file_is_replaced_whole_and_readable_by_all() {
        let dir = std::env::temp_dir().join(format!("ublkd-metrics-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("ublkd.prom");
        write_replacing(&path, b"one\n").unwrap();
        let first = std::fs::metadata(&path).unwrap();
        write_replacing(&path, b"two\n").unwrap();
        let second = std::fs::metadata(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two\n");
        // Replaced by a rename, not rewritten in place: a reader never sees half a file.
        use std::os::unix::fs::MetadataExt;
        assert_ne!(first.ino(), second.ino());
        assert_eq!(second.mode() & 0o777, 0o644);
        let left: Vec<_> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["ublkd.prom"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_writer_writes_when_due_and_not_before() {
        let dir = std::env::temp_dir().join(format!("ublkd-metrics-writer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("ublkd.prom");
        let mut writer = FileWriter::start(path.clone(), Duration::from_secs(3600)).unwrap();
        let start = writer.due();
        writer.tick(start, || vec![device(5)]);
        assert!(writer.due() >= start + Duration::from_secs(3600));
        let mut called = false;
        writer.tick(start + Duration::from_secs(1), || {
            called = true;
            vec![]
        });
        assert!(!called, "a snapshot was taken before the interval passed");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !path.exists() {
            assert!(Instant::now() < deadline, "the metrics file was not written");
            std::thread::sleep(Duration::from_millis(10));
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains(
                "ublkd_device_requests_total{device=\"ublkb5\",id=\"5\",op=\"read\"} 15\n"
            ),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
