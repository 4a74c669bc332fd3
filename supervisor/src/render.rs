//! `ublkctl`'s output: the exact formats scripts and the kernel selftests parse.

use serde::Serialize;
use ublkd_proto::msg::{DevListing, DevStatus};

/// `ublkctl list`: per device, the two lines the kernel selftests parse.
pub fn listing(dev: &DevListing) -> String {
    format!(
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
    )
}

#[derive(Serialize)]
struct StatusJson<'a> {
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
        })
        .collect();
    serde_json::to_string(&StatusJson { devices }).expect("plain data always serializes")
}

/// `ublkctl status`: one line per device for people.
pub fn status_text(devs: &[DevStatus]) -> String {
    let mut out = String::new();
    for d in devs {
        let pid = d.worker_pid.map_or_else(|| "-".to_string(), |p| p.to_string());
        out.push_str(&format!(
            "dev {}: {} {} worker {} ios {} errors {} recoveries {}{}\n",
            d.id,
            d.state,
            d.target,
            pid,
            d.counters.ios(),
            d.counters.errors,
            d.recoveries,
            d.note.as_ref().map(|n| format!(" ({n})")).unwrap_or_default()
        ));
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
    use ublkd_proto::shm::CounterSnapshot;

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
        assert_eq!(
            listing(&d),
            "dev id 3: nr_hw_queues 2 queue_depth 128 block size 512 dev_capacity 2097152\n\
             \tmax rq size 524288 daemon pid 77 flags 0x8058 state LIVE\n"
        );
    }

    #[test]
    fn status_json_has_the_contract_fields() {
        let d = DevStatus {
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
        };
        let v: serde_json::Value = serde_json::from_str(&status_json(&[d])).unwrap();
        let dev = &v["devices"][0];
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
    }
}
