//! `ublkctl`'s output: the exact formats scripts and the kernel selftests parse, and
//! under `--json` one object per command, each with [`SCHEMA`] (docs/json.md is their
//! contract: a field is added, never renamed or removed, within a schema version).

use serde::Serialize;
use serde_json::json;
use ublkd_proto::msg::{DevListing, DevMetrics, DevStatus, UpgradeOutcome};
use ublkd_proto::shm::LatencySnapshot;

use crate::metrics::{Quantile, quantile};

/// `ublkctl list`: per device, the two lines the kernel selftests parse, then a third
/// with what ublkd knows of it (`identity`, its status; absent if the device went
/// between the two requests): target, size, read-only, name and backing.
pub fn listing(dev: &DevListing, identity: Option<&DevStatus>) -> String {
    let mut out = format!(
        "dev id {}: nr_hw_queues {} queue_depth {} block size {} dev_capacity {}\n\
         \tmax rq size {} daemon pid {} flags {:#x} state {}\n",
        dev.id,
        dev.nr_hw_queues,
        dev.queue_depth,
        dev.block_size,
        dev.dev_capacity,
        dev.max_rq_size,
        dev.daemon_pid,
        dev.flags,
        dev.state
    );
    if let Some(s) = identity {
        out.push_str(&format!(
            "\ttarget {} size {} read-only {} name {} backing {}\n",
            s.target,
            s.size_bytes,
            if s.read_only { "yes" } else { "no" },
            s.name.as_deref().unwrap_or("-"),
            s.backing.as_deref().unwrap_or("-"),
        ));
    }
    out
}

/// The status of device `id` among `statuses`, for [`listing`] and [`listing_json`].
pub fn identity_of(statuses: &[DevStatus], id: u32) -> Option<&DevStatus> {
    statuses.iter().find(|s| s.id == id)
}

/// The version of every `--json` object's schema, in its `"schema"` field.
pub const SCHEMA: u32 = 1;

#[derive(Serialize)]
struct StatusJson<'a> {
    schema: u32,
    devices: Vec<DeviceJson<'a>>,
}

#[derive(Serialize)]
struct DeviceJson<'a> {
    id: u32,
    state: &'a str,
    target: &'a str,
    worker_pid: Option<u32>,
    standby_pid: Option<u32>,
    recoveries: u64,
    last_recovery_ms: Option<u64>,
    last_recovery_reason: Option<&'a str>,
    ios: u64,
    errors: u64,
    reads: u64,
    writes: u64,
    flushes: u64,
    discards: u64,
    write_zeroes: u64,
    bytes_read: u64,
    bytes_written: u64,
    size_bytes: u64,
    queues: u16,
    queue_depth: u16,
    threads: u16,
    note: Option<&'a str>,
    failing_io: bool,
    sandbox: Option<&'a ublkd_proto::msg::SandboxStatus>,
    /// Latency quantiles over every request the device served: the upper bound of the
    /// histogram bucket holding the quantile, in µs; `"+Inf"` past the last bound
    /// (8388608 µs); null before the first request.
    latency_p50_us: serde_json::Value,
    latency_p99_us: serde_json::Value,
    name: Option<&'a str>,
    read_only: bool,
    /// See `DevStatus::backing`.
    backing: Option<&'a str>,
}

/// A quantile of `h` for `status --json` (see `DeviceJson::latency_p50_us`).
fn quantile_json(h: &LatencySnapshot, q: f64) -> serde_json::Value {
    match quantile(h, q) {
        None => serde_json::Value::Null,
        Some(Quantile::AtMostUs(us)) => us.into(),
        Some(Quantile::AboveUs(_)) => "+Inf".into(),
    }
}

/// A quantile of `h` for people: `<=16us`, `<=1.05ms`, `>8.39s`, `-` before any I/O.
fn quantile_text(h: &LatencySnapshot, q: f64) -> String {
    let duration = |us: u64| {
        let (value, unit) = match us {
            0..1000 => return format!("{us}us"),
            1000..1_000_000 => (us as f64 / 1e3, "ms"),
            _ => (us as f64 / 1e6, "s"),
        };
        let digits = if value < 10.0 {
            2
        } else if value < 100.0 {
            1
        } else {
            0
        };
        format!("{value:.digits$}{unit}")
    };
    match quantile(h, q) {
        None => "-".to_string(),
        Some(Quantile::AtMostUs(us)) => format!("<={}", duration(us)),
        Some(Quantile::AboveUs(us)) => format!(">{}", duration(us)),
    }
}

/// `ublkctl status --json`: `{"devices":[{"id":N,"state":"LIVE",…}]}`.
pub fn status_json(devs: &[DevStatus]) -> String {
    let devices = devs
        .iter()
        .map(|d| DeviceJson {
            id: d.id,
            state: &d.state,
            target: &d.target,
            worker_pid: d.worker_pid,
            standby_pid: d.standby_pid,
            recoveries: d.recoveries,
            last_recovery_ms: d.last_recovery_ms,
            last_recovery_reason: d.last_recovery_reason.as_deref(),
            ios: d.counters.ios(),
            errors: d.counters.errors,
            reads: d.counters.reads,
            writes: d.counters.writes,
            flushes: d.counters.flushes,
            discards: d.counters.discards,
            write_zeroes: d.counters.write_zeroes,
            bytes_read: d.counters.bytes_read,
            bytes_written: d.counters.bytes_written,
            size_bytes: d.size_bytes,
            queues: d.queues,
            queue_depth: d.queue_depth,
            threads: d.threads,
            note: d.note.as_deref(),
            failing_io: d.failing_io,
            sandbox: d.sandbox.as_ref(),
            latency_p50_us: quantile_json(&d.latency, 0.5),
            latency_p99_us: quantile_json(&d.latency, 0.99),
            name: d.name.as_deref(),
            read_only: d.read_only,
            backing: d.backing.as_deref(),
        })
        .collect();
    serde_json::to_string(&StatusJson { schema: SCHEMA, devices })
        .expect("plain data always serializes")
}

/// `ublkctl add --json`.
pub fn added_json(id: u32) -> String {
    json!({"schema": SCHEMA, "id": id, "disk": format!("/dev/ublkb{id}")}).to_string()
}

/// `ublkctl del --json` and `shutdown --json`: the devices deleted.
pub fn deleted_json(ids: &[u32]) -> String {
    json!({"schema": SCHEMA, "deleted": ids}).to_string()
}

/// `ublkctl list --json`: the fields of [`listing`]'s lines (the third's null if the
/// device went between the two requests).
pub fn listing_json(devs: &[DevListing], statuses: &[DevStatus]) -> String {
    let devices: Vec<_> = devs
        .iter()
        .map(|d| {
            let s = identity_of(statuses, d.id);
            json!({
                "target": s.map(|s| s.target.as_str()),
                "size_bytes": s.map(|s| s.size_bytes),
                "read_only": s.map(|s| s.read_only),
                "name": s.and_then(|s| s.name.as_deref()),
                "backing": s.and_then(|s| s.backing.as_deref()),
                "id": d.id,
                "nr_hw_queues": d.nr_hw_queues,
                "queue_depth": d.queue_depth,
                "block_size": d.block_size,
                "dev_capacity_sectors": d.dev_capacity,
                "max_rq_size": d.max_rq_size,
                "daemon_pid": d.daemon_pid,
                "flags": d.flags,
                "state": d.state,
            })
        })
        .collect();
    json!({"schema": SCHEMA, "devices": devices}).to_string()
}

/// `ublkctl recover --json` and `resize --json` (`size_bytes` for resize only).
pub fn done_json(id: u32, size_bytes: Option<u64>, message: &str) -> String {
    let mut v = json!({"schema": SCHEMA, "id": id, "message": message});
    if let Some(size) = size_bytes {
        v["size_bytes"] = size.into();
    }
    v.to_string()
}

/// `ublkctl upgrade --json`: every device's outcome, those that failed too.
pub fn upgraded_json(outcomes: &[UpgradeOutcome]) -> String {
    let devices: Vec<_> = outcomes
        .iter()
        .map(|o| json!({"id": o.id, "upgraded": o.upgraded, "message": o.message}))
        .collect();
    json!({"schema": SCHEMA, "devices": devices}).to_string()
}

/// `ublkctl metrics --json`: the counters of the OpenMetrics text, without the
/// latency histograms (those are for Prometheus).
pub fn metrics_json(devs: &[DevMetrics]) -> String {
    let devices: Vec<_> = devs
        .iter()
        .map(|d| {
            let c = &d.counters;
            json!({
                "id": d.id,
                "state": d.state,
                "target": d.target,
                "reads": c.reads,
                "writes": c.writes,
                "flushes": c.flushes,
                "discards": c.discards,
                "write_zeroes": c.write_zeroes,
                "bytes_read": c.bytes_read,
                "bytes_written": c.bytes_written,
                "errors": c.errors,
                "inflight": d.inflight,
                "recoveries": d.recoveries,
                "last_stall_ms": d.last_stall_ms,
                "worker_restarts": d.worker_restarts,
            })
        })
        .collect();
    json!({"schema": SCHEMA, "devices": devices}).to_string()
}

/// `ublkctl features --json`: the kernel's feature mask, names and data path.
pub fn features_json(mask: u64) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&crate::features::render_json(mask))
        .expect("features' JSON is an object");
    v["schema"] = SCHEMA.into();
    v.to_string()
}

/// An error under `--json` (on stderr): its kind (`ErrorKind::name`, or
/// `exit::kind_name` for ublkctl's own) and message.
pub fn error_json(kind: &str, message: &str) -> String {
    json!({"schema": SCHEMA, "error": {"kind": kind, "message": message}}).to_string()
}

/// `ublkctl status`: one line per device for people.
pub fn status_text(devs: &[DevStatus]) -> String {
    let mut out = String::new();
    for d in devs {
        let pid = d.worker_pid.map_or_else(|| "-".to_string(), |p| p.to_string());
        out.push_str(&format!(
            "dev {}: {} {} worker {} ios {} errors {} recoveries {} p50 {} p99 {}{}\n",
            d.id,
            d.state,
            d.target,
            pid,
            d.counters.ios(),
            d.counters.errors,
            d.recoveries,
            quantile_text(&d.latency, 0.5),
            quantile_text(&d.latency, 0.99),
            d.note.as_ref().map(|n| format!(" ({n})")).unwrap_or_default()
        ));
        // What the device is, on a line of its own: the first stays as scripts read it.
        let mut what = format!(
            "  {} {}",
            ublkd_config::format_size(d.size_bytes),
            if d.read_only { "read-only" } else { "read-write" }
        );
        if let Some(name) = &d.name {
            what.push_str(&format!(" name {name}"));
        }
        if let Some(backing) = &d.backing {
            what.push_str(&format!(" backing {backing}"));
        }
        out.push_str(&what);
        out.push('\n');
        if let Some(missing) = d.sandbox.as_ref().map(|s| &s.missing).filter(|m| !m.is_empty()) {
            let list: Vec<String> = missing.iter().map(|m| m.to_string()).collect();
            out.push_str(&format!(
                "  warning: its worker runs without the sandbox layer(s) {}\n",
                list.join(", ")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ublkd_proto::shm::{CounterSnapshot, LATENCY_FINITE_BUCKETS};

    #[test]
    fn listing_matches_the_selftests_format() {
        let d = DevListing {
            id: 3,
            nr_hw_queues: 2,
            queue_depth: 128,
            block_size: 512,
            dev_capacity: 2097152,
            max_rq_size: 524288,
            daemon_pid: 77,
            flags: 0x8058,
            state: "LIVE".into(),
        };
        let selftests = "dev id 3: nr_hw_queues 2 queue_depth 128 block size 512 \
                         dev_capacity 2097152\n\
                         \tmax rq size 524288 daemon pid 77 flags 0x8058 state LIVE\n";
        assert_eq!(listing(&d, None), selftests);
        // ublkd's own line comes after them, for the device whose status it is.
        let status = DevStatus { id: 3, ..a_device() };
        assert_eq!(
            listing(&d, identity_of(&[a_device(), status.clone()], 3)),
            format!(
                "{selftests}\ttarget loop size 4096 read-only yes name db backing /srv/db.img\n"
            )
        );
        let statuses = [DevStatus { name: None, backing: None, read_only: false, ..status }];
        let plain = listing(&d, identity_of(&statuses, 3));
        assert!(plain.ends_with("\ttarget loop size 4096 read-only no name - backing -\n"));
        let v: serde_json::Value =
            serde_json::from_str(&listing_json(&[d], &[a_device()])).unwrap();
        // Device 1's status is not device 3's: null, not another device's.
        assert_eq!(v["devices"][0]["id"], 3);
        assert!(v["devices"][0]["backing"].is_null() && v["devices"][0]["target"].is_null());
    }

    #[test]
    fn list_json_names_what_backs_the_device() {
        let d = DevListing {
            id: 1,
            nr_hw_queues: 1,
            queue_depth: 8,
            block_size: 512,
            dev_capacity: 8,
            max_rq_size: 4096,
            daemon_pid: 9,
            flags: 0,
            state: "LIVE".into(),
        };
        let v: serde_json::Value =
            serde_json::from_str(&listing_json(&[d], &[a_device()])).unwrap();
        let dev = &v["devices"][0];
        assert_eq!(dev["backing"], "/srv/db.img");
        assert_eq!((&dev["name"], &dev["read_only"]), (&"db".into(), &true.into()));
        assert_eq!((&dev["target"], &dev["size_bytes"]), (&"loop".into(), &4096.into()));
    }

    fn a_device() -> DevStatus {
        DevStatus {
            id: 1,
            state: "LIVE".into(),
            target: "loop".into(),
            worker_pid: Some(9),
            size_bytes: 4096,
            queues: 1,
            queue_depth: 8,
            threads: 1,
            recoveries: 0,
            last_recovery_ms: None,
            last_recovery_reason: None,
            standby_pid: Some(10),
            sandbox: None,
            counters: CounterSnapshot { reads: 2, writes: 3, errors: 1, ..Default::default() },
            note: None,
            failing_io: false,
            latency: LatencySnapshot::default(),
            name: Some("db".into()),
            read_only: true,
            backing: Some("/srv/db.img".into()),
        }
    }

    #[test]
    fn status_names_the_device_and_what_backs_it() {
        let v: serde_json::Value = serde_json::from_str(&status_json(&[a_device()])).unwrap();
        let dev = &v["devices"][0];
        assert_eq!((&dev["name"], &dev["read_only"]), (&"db".into(), &true.into()));
        assert_eq!(dev["backing"], "/srv/db.img");
        let text = status_text(&[a_device()]);
        assert!(text.contains("\n  4K read-only name db backing /srv/db.img\n"), "{text}");
    }

    #[test]
    fn status_json_has_the_contract_fields() {
        let d = a_device();
        let v: serde_json::Value = serde_json::from_str(&status_json(&[d])).unwrap();
        let dev = &v["devices"][0];
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(dev["id"], 1);
        assert_eq!(dev["state"], "LIVE");
        assert_eq!(dev["target"], "loop");
        assert_eq!(dev["worker_pid"], 9);
        assert_eq!(dev["recoveries"], 0);
        assert_eq!(dev["failing_io"], false);
        assert_eq!(dev["standby_pid"], 10);
        assert!(dev["last_recovery_ms"].is_null());
        assert_eq!(dev["ios"], 5);
        assert_eq!(dev["errors"], 1);
        assert!(dev["latency_p50_us"].is_null(), "no I/O measured: {dev}");
        assert!(dev["latency_p99_us"].is_null(), "no I/O measured: {dev}");
    }

    #[test]
    fn status_gives_p50_and_p99_as_the_bounds_of_their_buckets() {
        let mut d = a_device();
        d.latency.buckets[4] = 90; // <= 16 µs
        d.latency.buckets[10] = 9; // <= 1024 µs
        d.latency.buckets[LATENCY_FINITE_BUCKETS] = 1; // > 8.39 s
        let v: serde_json::Value = serde_json::from_str(&status_json(&[d.clone()])).unwrap();
        assert_eq!(v["devices"][0]["latency_p50_us"], 16);
        assert_eq!(v["devices"][0]["latency_p99_us"], 1024);
        let text = status_text(&[d.clone()]);
        assert!(text.contains(" p50 <=16us p99 <=1.02ms"), "{text}");
        d.latency.buckets[4] = 40;
        d.latency.buckets[10] = 20;
        d.latency.buckets[LATENCY_FINITE_BUCKETS] = 40;
        let v: serde_json::Value = serde_json::from_str(&status_json(&[d.clone()])).unwrap();
        assert_eq!(v["devices"][0]["latency_p99_us"], "+Inf");
        let text = status_text(&[d]);
        assert!(text.contains(" p50 <=1.02ms p99 >8.39s"), "{text}");
        assert!(status_text(&[a_device()]).contains(" p50 - p99 -"));
    }
}
