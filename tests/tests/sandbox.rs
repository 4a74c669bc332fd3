//! The worker sandbox, boundary by boundary, against the real kernel (in the VM).
//!
//! Each attack test runs a worker built with the test-only `test-hooks` feature
//! (`target/test-hooks/debug/ublkd-worker`, built by `./run-tests`), which makes one
//! attack on its own sandbox right after it reports Ready. Every attack must fail:
//! either the call is refused and the worker goes on serving, or the sandbox kills the
//! worker (seccomp, exit 159) and ublkd recovers the device like after any crash. A
//! worker that gets through prints `ESCAPED` and exits 99: the test fails.
//!
//! The same hooks make a worker misbehave towards the kernel (a COMMIT of a tag it was
//! never given): the kernel must refuse, the worker must end, ublkd must recover.
//!
//! The rest of the suite (serve, chaos) runs with the sandbox on by default, which is
//! what proves the allowlist complete for the real data path.

mod common;

use std::path::PathBuf;

use common::{Ublkd, block_dev, run_ok, serial, wait_for_path};

fn hooked_worker() -> PathBuf {
    // target/debug/deps/sandbox-… → target/test-hooks/debug/ublkd-worker
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().unwrap().parent().unwrap().parent().unwrap();
    let worker = target.join("test-hooks/debug/ublkd-worker");
    assert!(
        worker.is_file(),
        "{} is missing: build it with `cargo build -p ublkd-worker --features test-hooks \
         --target-dir target/test-hooks` (run-tests does)",
        worker.display()
    );
    worker
}

/// Starts ublkd with the hooked worker making `attack`, adds a memory device and
/// returns ublkd and the device id.
fn attacked(name: &str, attack: &str) -> (Ublkd, u32) {
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let ublkd = Ublkd::start_with(name, &extra, &[("UBLKD_WORKER_ATTACK", attack)]);
    let id = ublkd.add(&["-t", "memory", "-s", "16M"]);
    (ublkd, id)
}

/// The device still serves: write and read back 1 MiB.
fn assert_device_serves(id: u32) {
    let dev = block_dev(id);
    wait_for_path(&dev);
    let out = run_ok(std::process::Command::new("dd").args([
        "if=/dev/urandom",
        &format!("of={}", dev.display()),
        "bs=64k",
        "count=16",
        "oflag=direct",
    ]));
    let _ = out;
    run_ok(std::process::Command::new("dd").args([
        &format!("if={}", dev.display()),
        "of=/dev/null",
        "bs=64k",
        "count=16",
        "iflag=direct",
    ]));
}

/// `attacked`, then waits for the device's one recovery; returns its status and the
/// recovery's reason too.
fn attacked_and_recovered(name: &str, attack: &str) -> (Ublkd, u32, serde_json::Value, String) {
    let (ublkd, id) = attacked(name, attack);
    ublkd.wait_until("the attacked worker's recovery", || {
        ublkd.status_of(id)["recoveries"].as_u64() == Some(1)
    });
    let status = ublkd.status_of(id);
    let reason = status["last_recovery_reason"].as_str().unwrap_or_default().to_string();
    (ublkd, id, status, reason)
}

/// An attack the sandbox answers by killing the worker: the device is recovered.
/// Returns ublkd's log.
fn assert_killed_and_recovered(name: &str, attack: &str) -> String {
    let _serial = serial();
    let (ublkd, id, status, reason) = attacked_and_recovered(name, attack);
    assert!(
        reason.contains("159"),
        "attack {attack}: recovered for {reason:?}, not a sandbox kill"
    );
    let log = ublkd.log();
    assert!(log.contains("sandbox: blocked system call"), "no seccomp report in:\n{log}");
    assert!(!log.contains("ESCAPED"), "attack {attack} escaped:\n{log}");
    assert_eq!(status["state"], "LIVE");
    assert_device_serves(id);
    ublkd.stop();
    log
}

/// An attack the sandbox answers with an error: the worker reports it and serves on.
fn assert_refused(name: &str, attack: &str, error: &str) {
    let _serial = serial();
    let (ublkd, id) = attacked(name, attack);
    let line = format!("attack {attack}: blocked");
    ublkd.wait_until("the attack's outcome", || {
        ublkd.log().contains(&line) || ublkd.log().contains("ESCAPED")
    });
    let log = ublkd.log();
    assert!(!log.contains("ESCAPED"), "attack {attack} escaped:\n{log}");
    let outcome = log.lines().find(|l| l.contains(&line)).unwrap();
    assert!(outcome.contains(error), "attack {attack}: expected {error:?}, got {outcome:?}");
    assert_eq!(ublkd.status_of(id)["recoveries"], 0, "the refused attack must not kill the worker");
    assert_device_serves(id);
    ublkd.stop();
}

/// An attack on system call `nr`, which the policy allows with other arguments: the
/// seccomp filter kills the worker on that very call, and the device is recovered.
fn assert_argument_filter_kills(name: &str, attack: &str, nr: i64) {
    let log = assert_killed_and_recovered(name, attack);
    let report = format!("sandbox: blocked system call {nr:04}");
    assert!(log.contains(&report), "attack {attack}: no {report:?} in:\n{log}");
}

#[test]
fn opening_a_host_path_kills_the_worker() {
    assert_killed_and_recovered("sbx-open", "open-host-path");
}

#[test]
fn a_host_path_is_not_even_visible() {
    // statx with AT_EMPTY_PATH passes seccomp (it is how std stats its own fds), and a
    // path given with it is still looked up: in the empty root, where it is not.
    assert_refused("sbx-stat", "stat-host-path", "No such file or directory");
}

#[test]
fn stat_of_a_path_without_at_empty_path_kills_the_worker() {
    assert_argument_filter_kills("sbx-stat-plain", "stat-host-path-plain", libc::SYS_statx);
}

#[test]
fn mapping_executable_memory_kills_the_worker() {
    assert_argument_filter_kills("sbx-mmap-exec", "mmap-exec", libc::SYS_mmap);
}

#[test]
fn making_memory_executable_kills_the_worker() {
    assert_argument_filter_kills("sbx-mprotect-exec", "mprotect-exec", libc::SYS_mprotect);
}

#[test]
fn a_prctl_option_other_than_naming_a_thread_kills_the_worker() {
    assert_argument_filter_kills("sbx-prctl", "prctl-dumpable", libc::SYS_prctl);
}

#[test]
fn an_fcntl_command_other_than_dup_kills_the_worker() {
    assert_argument_filter_kills("sbx-fcntl", "fcntl-setfl", libc::SYS_fcntl);
}

#[test]
fn another_devices_shared_region_is_not_visible() {
    let _serial = serial();
    // Device 0's region, a file the supervisor keeps in its state dir; device 1's worker
    // (and 0's own) look for it by path and must not find it.
    let name = "sbx-other";
    let shm = format!("/run/ublkd-test-{name}/state/devices/0/shm");
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let env =
        [("UBLKD_WORKER_ATTACK", "stat-other-device"), ("UBLKD_WORKER_ATTACK_PATH", shm.as_str())];
    let ublkd = Ublkd::start_with(name, &extra, &env);
    let first = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let second = ublkd.add(&["-t", "memory", "-s", "16M"]);
    assert_eq!(first, 0, "the region path assumes device 0");
    assert!(std::path::Path::new(&shm).is_file(), "{shm} should exist on the host");
    ublkd.wait_until("both attacks' outcomes", || {
        ublkd.log().matches("attack stat-other-device: blocked").count() == 2
            || ublkd.log().contains("ESCAPED")
    });
    let log = ublkd.log();
    assert!(!log.contains("ESCAPED"), "a worker saw another device's region:\n{log}");
    assert!(log.contains("No such file or directory"), "{log}");
    assert_device_serves(second);
    ublkd.stop();
}

#[test]
fn creating_a_socket_kills_the_worker() {
    assert_killed_and_recovered("sbx-socket", "socket");
}

#[test]
fn signalling_the_supervisor_kills_the_worker() {
    assert_killed_and_recovered("sbx-kill", "signal-supervisor");
}

#[test]
fn ptracing_the_supervisor_kills_the_worker() {
    assert_killed_and_recovered("sbx-ptrace", "ptrace-supervisor");
}

#[test]
fn exec_kills_the_worker() {
    assert_killed_and_recovered("sbx-exec", "exec");
}

#[test]
fn a_new_io_uring_kills_the_worker() {
    assert_killed_and_recovered("sbx-uring", "new-io-uring");
}

#[test]
fn a_forbidden_io_uring_opcode_is_refused_by_the_ring() {
    assert_refused("sbx-openat", "uring-openat", "Permission denied");
}

#[test]
fn a_forbidden_io_uring_register_op_is_refused_by_the_ring() {
    // IORING_REGISTER_PERSONALITY on the queue thread's enabled ring: the ring's
    // register restrictions answer EACCES.
    assert_refused("sbx-register", "uring-register-personality", "Permission denied");
}

/// A worker that COMMITs a tag it was never given (`fault`): the kernel refuses, the
/// worker ends with its data-path exit code naming the refusal, and ublkd recovers the
/// device, which serves on.
fn assert_refused_commit_recovers(name: &str, fault: &str) {
    let _serial = serial();
    let (ublkd, id, status, reason) = attacked_and_recovered(name, fault);
    assert!(reason.contains("70"), "{fault}: recovered for {reason:?}, not the data-path exit");
    let log = ublkd.log();
    let refusal = "the kernel refused a COMMIT on queue 0 (tag ";
    let line = log.lines().find(|l| l.contains(refusal));
    assert!(
        line.is_some_and(|l| l.contains("Device or resource busy")),
        "{fault}: no EBUSY refusal in:\n{log}"
    );
    assert_eq!(status["state"], "LIVE");
    assert_device_serves(id);
    assert_eq!(ublkd.status_of(id)["recoveries"], 1, "the second worker must serve on");
    ublkd.stop();
}

#[test]
fn a_refused_one_tag_commit_ends_the_worker_and_the_device_recovers() {
    assert_refused_commit_recovers("commit-one", "commit-unowned");
}

#[test]
fn a_refused_batch_commit_ends_the_worker_and_the_device_recovers() {
    assert_refused_commit_recovers("commit-batch", "commit-unowned-batch");
}

#[test]
fn raising_an_rlimit_kills_the_worker() {
    assert_killed_and_recovered("sbx-rlimit", "raise-rlimit");
}

#[test]
fn status_shows_the_sandbox_in_force() {
    let _serial = serial();
    let ublkd = Ublkd::start_with("sbx-status", "worker_user = \"nobody\"\n", &[]);
    let id = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let status = ublkd.status_of(id);
    let sbx = &status["sandbox"];
    assert_eq!(sbx["uid"], 65534, "{status}");
    assert_eq!(sbx["seccomp"], "filter");
    assert_eq!(sbx["no_new_privs"], true);
    assert_eq!(sbx["capabilities"], "0000000000000000");
    let namespaces: Vec<&str> =
        sbx["namespaces"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    for ns in ["user", "mnt", "net", "ipc", "uts", "cgroup"] {
        assert!(namespaces.contains(&ns), "{ns} missing from {namespaces:?}");
    }
    assert!(sbx["landlock"].as_str().unwrap().starts_with("ABI "), "{sbx}");
    ublkd.stop();
}
