//! Metrics end to end (in the VM): fio on a loop device, then `ublkctl metrics` read
//! by an independent parser (python3-prometheus-client's OpenMetrics parser, installed
//! by tests/vm/install-host-deps.sh), its latency histograms holding fio's I/O, p50/p99
//! in status, the state-set and the recovery counter and timestamp after a worker's
//! death, the `device` label the kernel's disk name (what node_exporter's
//! `node_disk_*` series carry), `daemon.metrics_file` written and replaced whole, and
//! errors counted by the operation that failed (an NBD server that fails every request).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ublkd_tests::harness::fio::Fio;
use ublkd_tests::harness::machine::{block_dev, serial};
use ublkd_tests::harness::process::describe;
use ublkd_tests::harness::ublkd::Ublkd;

/// Reads metrics text on stdin with prometheus_client's parser for the format named by
/// argv[1] and prints every sample as JSON; a text the parser refuses makes it fail.
const PARSE: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
from prometheus_client.parser import text_string_to_metric_families as prom
parse = om if sys.argv[1] == "openmetrics" else prom
samples = []
for family in parse(sys.stdin.read()):
    for s in family.samples:
        samples.append({"family": family.name, "type": family.type, "name": s.name,
                        "labels": s.labels, "value": s.value})
print(json.dumps(samples))
"#;

/// The samples of `text` as prometheus_client parses it (`format`: "openmetrics" or
/// "prometheus").
fn parse(text: &str, format: &str) -> Result<Vec<serde_json::Value>, String> {
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", PARSE, format])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run python3 (tests/vm/install-host-deps.sh): {e}"))?;
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        return Err(format!("{format} parser refused the text:\n{}\n{text}", describe(&out)));
    }
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .map_err(|e| format!("parser output is not JSON: {e}"))?
        .as_array()
        .cloned()
        .ok_or("parser output is not an array".into())
}

/// The value of the sample `name` with exactly `labels`.
fn value(samples: &[serde_json::Value], name: &str, labels: &[(&str, &str)]) -> f64 {
    let want: serde_json::Map<String, serde_json::Value> =
        labels.iter().map(|(k, v)| (k.to_string(), (*v).into())).collect();
    samples
        .iter()
        .find(|s| s["name"] == name && s["labels"].as_object() == Some(&want))
        .and_then(|s| s["value"].as_f64())
        .unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
}

#[test]
fn metrics_parse_as_openmetrics_and_their_histograms_count_fios_io() {
    let _serial = serial();
    let dir = Path::new("/tmp/ublkd-test-metrics");
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("ublkd.prom");
    let extra = format!("metrics_file = \"{}\"\nmetrics_interval_secs = 1", file.display());
    let ublkd = Ublkd::start_with("metrics", &extra, &[]);
    // A loop device: its requests wait on the backend, from the turn that fetched them
    // to a later one, which is what the histograms measure (a memory device's requests
    // are answered at once: 0 there).
    let backing = dir.join("backing");
    std::fs::File::create(&backing).unwrap().set_len(64 << 20).unwrap();
    let id = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);
    let dev = block_dev(id);
    // One block request per fio I/O: no merging of adjacent ones.
    let nomerges = format!("/sys/block/{}/queue/nomerges", dev.file_name().unwrap().display());
    std::fs::write(&nomerges, "2").unwrap();

    let job = Fio::run(
        [
            "--name=metrics",
            &format!("--filename={}", dev.display()),
            "--rw=randrw",
            "--bs=4k",
            "--size=4M",
            "--iodepth=16",
            "--direct=1",
            "--ioengine=io_uring",
        ]
        .map(String::from)
        .into(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let (fio_reads, fio_writes) = (job.read_bytes / 4096, job.write_bytes / 4096);
    assert!(fio_reads > 0 && fio_writes > 0, "{job:?}");

    // What ublkctl prints parses as OpenMetrics, and its histograms hold fio's I/O.
    let text = ublkd.ctl_ok(&["metrics"]);
    assert!(text.ends_with("# EOF\n"), "{text}");
    let samples = parse(&text, "openmetrics").unwrap_or_else(|e| panic!("{e}"));
    // `device` is the disk's name as the kernel gives it, which node_exporter's
    // node_disk_* series carry: the two join on it.
    let device = dev.file_name().unwrap().to_str().unwrap().to_string();
    assert_eq!(device, format!("ublkb{id}"));
    let id_label = id.to_string();
    let dev_labels = [("device", device.as_str()), ("id", id_label.as_str())];
    for (op, fio_count) in [("read", fio_reads), ("write", fio_writes)] {
        let labels = [dev_labels[0], dev_labels[1], ("op", op)];
        let count = value(&samples, "ublkd_device_request_duration_seconds_count", &labels);
        let total = value(&samples, "ublkd_device_requests_total", &labels);
        assert!(count >= fio_count as f64, "{op}: histogram {count} < fio's {fio_count}");
        assert_eq!(count, total, "{op}: histogram and counter disagree");
        let inf = [dev_labels[0], dev_labels[1], ("op", op), ("le", "+Inf")];
        assert_eq!(value(&samples, "ublkd_device_request_duration_seconds_bucket", &inf), count);
        let sum = value(&samples, "ublkd_device_request_duration_seconds_sum", &labels);
        assert!(sum > 0.0, "{op}: latency sum {sum}");
    }
    for op in ["read", "write", "flush", "discard", "write_zeroes", "other"] {
        let errors = [dev_labels[0], dev_labels[1], ("op", op)];
        assert_eq!(value(&samples, "ublkd_device_request_errors_total", &errors), 0.0, "{text}");
    }
    let families: Vec<&str> = samples.iter().filter_map(|s| s["family"].as_str()).collect();
    for family in ["ublkd_device_inflight_requests", "ublkd_device_recoveries"] {
        assert!(families.contains(&family), "no {family} in:\n{text}");
    }
    assert!(families.contains(&"ublkd_device_worker_restarts"), "{text}");
    // The state as a state-set: live at 1, every other state at 0; the count by state.
    let state = |samples: &[serde_json::Value], s: &str| {
        value(samples, "ublkd_device_state", &[dev_labels[0], dev_labels[1], ("state", s)])
    };
    assert_eq!(state(&samples, "live"), 1.0, "{text}");
    for other in ["starting", "recovering", "releasing", "waiting_for_operator", "failing_io"] {
        assert_eq!(state(&samples, other), 0.0, "{other}: {text}");
    }
    assert_eq!(value(&samples, "ublkd_devices", &[("state", "live")]), 1.0, "{text}");
    let info = [dev_labels[0], dev_labels[1], ("target", "loop"), ("name", "")];
    let info_found = samples.iter().any(|s| {
        s["name"] == "ublkd_device_info"
            && info.iter().all(|(k, v)| s["labels"].get(*k).map_or(v.is_empty(), |l| l == v))
    });
    assert!(info_found, "no ublkd_device_info{info:?} in:\n{text}");
    assert!(!text.contains("ublkd_device_last_recovery_timestamp_seconds{"), "{text}");
    assert!(text.contains("ublkd_build_info{version=\""), "{text}");

    // Status: p50 and p99 from the same histogram.
    let status = ublkd.status_of(id);
    let (p50, p99) = (&status["latency_p50_us"], &status["latency_p99_us"]);
    assert!(p50.as_u64().is_some_and(|v| v > 0), "{status}");
    assert!(p99.as_u64() >= p50.as_u64() || *p99 == "+Inf", "{status}");
    let line = ublkd.ctl_ok(&["status"]);
    assert!(line.contains(" p50 <=") && line.contains(" p99 "), "{line}");

    // A worker's death: one recovery counted, and stamped with the time it ended.
    let unix_now = || {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
    };
    let before = unix_now();
    ublkd.kill_worker(id);
    let after = unix_now();
    let text = ublkd.ctl_ok(&["metrics"]);
    let samples = parse(&text, "openmetrics").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(value(&samples, "ublkd_device_recoveries_total", &dev_labels), 1.0, "{text}");
    let at = value(&samples, "ublkd_device_last_recovery_timestamp_seconds", &dev_labels);
    assert!(before <= at && at <= after, "recovered at {at}, not within [{before}, {after}]");
    let took = value(&samples, "ublkd_device_last_recovery_duration_seconds", &dev_labels);
    assert!(took > 0.0 && took <= after - before, "recovery took {took} s");
    assert_eq!(state(&samples, "live"), 1.0, "{text}");

    // The metrics file: written, in the Prometheus text format node_exporter reads,
    // with fio's I/O, and replaced by a rename (another inode than the last look's:
    // tmpfs reuses a freed inode number, so two may alternate) that leaves no part-file
    // for a reader to see.
    // Every look finds a whole file: as many lines as a whole one, the last one the
    // last histogram's count. (The parser runs once, at the end: under emulation a
    // python start takes seconds.)
    let last_line = format!(
        "ublkd_device_request_duration_seconds_count{{device=\"{device}\",id=\"{id}\",\
         op=\"write_zeroes\"}} "
    );
    let whole_lines = text.lines().filter(|l| !l.starts_with('#')).count();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut inode = None;
    let (mut replaced, mut reads) = (0, 0);
    while replaced < 2 {
        assert!(Instant::now() < deadline, "metrics file replaced {replaced} times in 20 s");
        if let Ok(meta) = std::fs::metadata(&file) {
            let text = std::fs::read_to_string(&file).unwrap();
            let samples = text.lines().filter(|l| !l.starts_with('#')).count();
            let ends_whole = text.lines().last().is_some_and(|l| l.starts_with(&last_line));
            assert!(samples == whole_lines && ends_whole && text.ends_with('\n'), "{text}");
            assert_eq!(meta.mode() & 0o777, 0o644, "metrics file mode");
            if inode.is_some_and(|i| i != meta.ino()) {
                replaced += 1;
            }
            inode = Some(meta.ino());
            reads += 1;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let last = parse(&std::fs::read_to_string(&file).unwrap(), "prometheus").unwrap();
    let typed: Vec<_> =
        last.iter().filter(|s| s["name"] == "ublkd_device_requests_total").collect();
    assert!(typed.iter().all(|s| s["type"] == "counter"), "counters lost their type: {typed:?}");
    let labels = [dev_labels[0], dev_labels[1], ("op", "write")];
    assert!(value(&last, "ublkd_device_requests_total", &labels) >= fio_writes as f64);
    let read = [dev_labels[0], dev_labels[1], ("op", "read")];
    let count = value(&last, "ublkd_device_request_duration_seconds_count", &read);
    assert!(count >= fio_reads as f64, "the file's read histogram: {count} < fio's {fio_reads}");
    let names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    let ours = |n: &std::ffi::OsString| {
        ["ublkd.prom", ".ublkd.prom.tmp", "backing"].contains(&n.to_str().unwrap_or(""))
    };
    assert!(names.iter().all(ours), "{names:?}");
    eprintln!("metrics file read {reads} times, replaced {replaced} times meanwhile");

    ublkd.stop();
    std::fs::remove_dir_all(dir).unwrap();
}

/// The metrics directory is node_exporter's, which another user may write: links and a
/// FIFO planted there by that user (at the file's name, at the temporary name ublkd
/// once used, and beside them) must never make root's ublkd write through them. After
/// three intervals the file they point to is unchanged and still 0600, the metrics
/// file is ublkd's own, and the log says once what it replaced. A directory every user
/// may write is refused at start, with the reason.
#[test]
fn links_and_fifos_planted_in_the_metrics_directory_are_never_written_through() {
    use std::os::unix::fs::{PermissionsExt, lchown, symlink};
    let _serial = serial();
    let root = Path::new("/tmp/ublkd-test-metrics-planted");
    let _ = std::fs::remove_dir_all(root);
    let dir = root.join("textfile");
    std::fs::create_dir_all(&dir).unwrap();
    // Root's, and its group's to write (nogroup's, as the prometheus group would be).
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&dir, Some(0), Some(65534)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
    let secret = root.join("secret");
    std::fs::write(&secret, b"root's own data\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let file = dir.join("ublkd.prom");
    for name in ["ublkd.prom", ".ublkd.prom.tmp", ".ublkd.prom.new"] {
        symlink(&secret, dir.join(name)).unwrap();
        lchown(dir.join(name), Some(65534), Some(65534)).unwrap();
    }
    let fifo = dir.join(".ublkd.prom.fifo");
    nix_mkfifo(&fifo);
    lchown(&fifo, Some(65534), Some(65534)).unwrap();
    let extra = format!("metrics_file = \"{}\"\nmetrics_interval_secs = 1", file.display());
    let ublkd = Ublkd::start_with("metrics-planted", &extra, &[]);
    ublkd.add(&["-t", "null", "-s", "16M"]);
    std::thread::sleep(Duration::from_millis(3500));
    assert_eq!(std::fs::read(&secret).unwrap(), b"root's own data\n", "written through a link");
    assert_eq!(std::fs::metadata(&secret).unwrap().mode() & 0o7777, 0o600, "chmod through a link");
    let meta = std::fs::symlink_metadata(&file).unwrap();
    assert!(meta.file_type().is_file(), "the metrics file is not ublkd's own");
    assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o644));
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("ublkd_device_requests_total{device=\"ublkb0\",id=\"0\",op=\"read\"}"),
        "{text}"
    );
    let log = ublkd.log();
    let said = log.matches("was a symlink owned by uid 65534").count();
    assert_eq!(said, 1, "the plant was not said once:\n{log}");
    assert!(!log.contains("metrics_file_failed"), "{log}");
    ublkd.stop();

    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::remove_file(&file).unwrap();
    let ublkd = Ublkd::start_with("metrics-open-dir", &extra, &[]);
    std::thread::sleep(Duration::from_millis(1500));
    let log = ublkd.log();
    assert!(log.contains("may be written by every user (mode 0777)"), "{log}");
    assert!(!file.exists(), "written into a directory every user may write");
    ublkd.stop();
    let _ = std::fs::remove_dir_all(root);
}

fn nix_mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is NUL-terminated and lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

/// An NBD server (nbdkit's eval plugin) on `socket` with a 16 MiB export that fails
/// every read and every write with EIO, killed on drop.
struct FailingServer(std::process::Child);

impl FailingServer {
    fn start(socket: &str) -> FailingServer {
        let _ = std::fs::remove_file(socket);
        let pid_file = format!("{socket}.pid");
        let _ = std::fs::remove_file(&pid_file);
        let args = ["-U", socket, "-f", "--exit-with-parent", "-P", &pid_file, "eval"];
        let child = Command::new("nbdkit")
            .args(args)
            // Exit 1 with the errno's name first on stderr: nbdkit answers that error.
            .args([
                "get_size=echo 16777216",
                "pread=echo 'EIO this export fails every read' >&2; exit 1",
                "pwrite=echo 'EIO this export fails every write' >&2; exit 1",
            ])
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run nbdkit (tests/vm/install-host-deps.sh): {e}"));
        let server = FailingServer(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read(&pid_file).is_ok_and(|pid| pid.ends_with(b"\n")) {
            assert!(Instant::now() < deadline, "nbdkit did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }
}

impl Drop for FailingServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One 4 KiB O_DIRECT read or write at `offset` of `dev` (so that exactly one request
/// reaches the device, past the page cache): its error, which the test wants.
fn direct_io_fails(dev: &Path, write: bool, offset: u64) -> std::io::Error {
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .unwrap_or_else(|e| panic!("{}: {e}", dev.display()));
    // O_DIRECT wants a buffer aligned to the logical block: a page-aligned slice of a
    // larger Vec.
    let mut buf = vec![0xa5u8; 8192];
    let start = buf.as_ptr().align_offset(4096);
    let block = &mut buf[start..start + 4096];
    let done = if write { file.write_at(block, offset) } else { file.read_at(block, offset) };
    match done {
        Ok(n) => {
            panic!("a {} of {n} bytes at {offset} succeeded", if write { "write" } else { "read" })
        }
        Err(e) => e,
    }
}

/// Each device's errors by `op`, from `ublkctl metrics`.
fn errors_by_op(ublkd: &Ublkd, id: u32) -> std::collections::BTreeMap<String, f64> {
    let text = ublkd.ctl_ok(&["metrics"]);
    let samples = parse(&text, "openmetrics").unwrap_or_else(|e| panic!("{e}"));
    let device = format!("ublkb{id}");
    samples
        .iter()
        .filter(|s| s["name"] == "ublkd_device_request_errors_total")
        .filter(|s| s["labels"]["device"] == device.as_str())
        .map(|s| (s["labels"]["op"].as_str().unwrap().to_string(), s["value"].as_f64().unwrap()))
        .collect()
}

/// A read and a write that the backend fails land on their own `op`: an NBD server
/// that answers every read and write with an error, one O_DIRECT write and one read.
#[test]
fn errors_are_counted_by_the_operation_that_failed() {
    let _serial = serial();
    let socket = "/tmp/ublkd-test-metrics-failing.sock";
    let _server = FailingServer::start(socket);
    let ublkd = Ublkd::start("metrics-errors");
    let uri = format!("nbd+unix:///?socket={socket}");
    let id = ublkd.add(&["-t", "nbd", "--uri", &uri]);
    let dev = block_dev(id);
    ublkd_tests::harness::machine::wait_for_path(&dev);
    // The kernel's partition scan reads (and fails) as the disk appears: let it end,
    // then count from there.
    std::thread::sleep(Duration::from_secs(2));
    let before = errors_by_op(&ublkd, id);
    let ops = ["discard", "flush", "other", "read", "write", "write_zeroes"];
    assert_eq!(before.keys().map(String::as_str).collect::<Vec<_>>(), ops, "{before:?}");
    assert_eq!(before["write"], 0.0, "{before:?}");

    let e = direct_io_fails(&dev, true, 0);
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "the write: {e}");
    let after_write = errors_by_op(&ublkd, id);
    assert_eq!(after_write["write"], before["write"] + 1.0, "{after_write:?}");

    let e = direct_io_fails(&dev, false, 1 << 20);
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "the read: {e}");
    let after = errors_by_op(&ublkd, id);
    assert!(after["read"] > after_write["read"], "{after_write:?} then {after:?}");
    assert_eq!(after["write"], after_write["write"], "{after:?}");
    for op in ["flush", "discard", "write_zeroes", "other"] {
        assert_eq!(after[op], 0.0, "{op}: {after:?}");
    }
    // The ops add up to the total that status gives.
    let total: f64 = after.values().sum();
    let status = ublkd.status_of(id);
    assert_eq!(status["errors"].as_f64(), Some(total), "{status} vs {after:?}");
    ublkd.del(id);
    ublkd.stop();
}
