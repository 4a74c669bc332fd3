//! The machine-wide state the system tests share and check: the lock that runs a test
//! binary's tests one at a time, the kernel's ublk features, devices and device nodes,
//! and what `/proc` says of processes (worker processes, open fds, holders of a path).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ublkd_proto::ctrl::CtrlClient;

/// The system tests check machine-wide state (every ublk device, every worker
/// process): each holds this for its whole run, so a test binary's tests run one at a
/// time even without `--test-threads=1`.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The kernel's ublk feature mask (GET_FEATURES): what a test that depends on a
/// feature asks before it decides what to assert (a refusal where it is missing).
pub fn kernel_features() -> u64 {
    CtrlClient::open()
        .and_then(|c| c.get_features())
        .expect("GET_FEATURES must work: run these tests in the test VM")
}

/// `/dev/ublkbN`.
pub fn block_dev(id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/ublkb{id}"))
}

/// The id of the device `ublkctl add` printed as `out` (its disk, `/dev/ublkbN`).
pub fn added_id(out: &str) -> u32 {
    let text = out.trim();
    text.strip_prefix("/dev/ublkb")
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("`ublkctl add` printed {text:?}, not /dev/ublkbN"))
}

/// Waits (at most 10 s) for `path` to appear: devtmpfs creates nodes asynchronously.
pub fn wait_for_path(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} did not appear within 10 s", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The `/dev/ublkb*` and `/dev/ublkc*` nodes there are now.
pub fn ublk_nodes() -> BTreeSet<String> {
    std::fs::read_dir("/dev")
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.starts_with("ublkb") || n.starts_with("ublkc"))
        .collect()
}

/// The ids of the ublk devices the kernel has now.
pub fn kernel_devices() -> BTreeSet<u32> {
    std::fs::read_dir("/sys/class/ublk-char")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether process `pid` exists (has a `/proc` entry).
pub fn pid_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The pids of every process whose name is `ublkd-worker`.
pub fn worker_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim_end() == "ublkd-worker")
        })
        .collect()
}

/// Where process `pid`'s open fds point (`readlink /proc/PID/fd/*`), sorted.
pub fn fd_targets(pid: u32) -> Vec<String> {
    let mut targets: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    targets.sort();
    targets
}

/// The pids of every process that has `path` open.
pub fn holders(path: &Path) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).any(|t| t == path)
            })
        })
        .collect()
}
