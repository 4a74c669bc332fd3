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

use ublkd_tests::harness::machine::{block_dev, serial, wait_for_path};
use ublkd_tests::harness::process::{hooked_worker, run_ok};
use ublkd_tests::harness::ublkd::Ublkd;

/// Starts ublkd with the hooked worker making `attack`, adds a memory device and
/// returns ublkd and the device id.
fn attacked(name: &str, attack: &str) -> (Ublkd, u32) {
    attacked_device(name, attack, MEMORY_DEVICE)
}

/// `ublkctl add`'s arguments for the attacked device, unless a test says otherwise.
const MEMORY_DEVICE: &[&str] = &["-t", "memory", "-s", "16M"];

/// [`attacked`] with the device `add_args` describe.
fn attacked_device(name: &str, attack: &str, add_args: &[&str]) -> (Ublkd, u32) {
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let ublkd = Ublkd::start_with(name, &extra, &[("UBLKD_WORKER_ATTACK", attack)]);
    let id = ublkd.add(add_args);
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
    assert_refused_on(name, attack, error, MEMORY_DEVICE);
}

/// [`assert_refused`] on the device `add_args` describe.
fn assert_refused_on(name: &str, attack: &str, error: &str, add_args: &[&str]) {
    let _serial = serial();
    let (ublkd, id) = attacked_device(name, attack, add_args);
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

/// A memory device's ring has no socket operation, and no operation on a descriptor
/// that was not registered for it: each is refused by the ring itself (EACCES), before
/// the descriptor is looked at.
#[test]
fn socket_operations_and_raw_descriptors_are_refused_by_a_memory_workers_ring() {
    assert_refused("sbx-sendmsg", "uring-sendmsg", "Permission denied");
    assert_refused("sbx-recv", "uring-recv", "Permission denied");
    assert_refused("sbx-cmd-raw", "uring-cmd-raw-fd", "Permission denied");
}

/// An nbd worker's ring sends with WRITEV and has no SENDMSG: a SENDMSG passing a
/// descriptor (`SCM_RIGHTS`), as a compromised worker would hand one to its server over
/// `nbd+unix`, is refused by the ring itself (EACCES; were SENDMSG allowed, sending on
/// the ring's own fd would answer ENOTSOCK instead).
#[test]
fn a_descriptor_passing_sendmsg_is_refused_by_an_nbd_workers_ring() {
    let socket = "/tmp/ublkd-sbx-nbd.sock";
    let _ = std::fs::remove_file(socket);
    let mut nbdkit = std::process::Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "--unix", socket, "memory", "16M"])
        .spawn()
        .expect("nbdkit");
    wait_for_path(std::path::Path::new(socket));
    let uri = format!("nbd+unix:///?socket={socket}");
    assert_refused_on(
        "sbx-sendmsg-rights",
        "uring-sendmsg-rights",
        "Permission denied",
        &["-t", "nbd", "--uri", &uri],
    );
    let _ = nbdkit.kill();
    let _ = nbdkit.wait();
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
    for ns in ["user", "mnt", "net", "ipc", "uts", "cgroup", "pid"] {
        assert!(namespaces.contains(&ns), "{ns} missing from {namespaces:?}");
    }
    // The worker is the first process of its pid namespace: pid 1 there.
    let pid = status["worker_pid"].as_u64().unwrap();
    let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let nspid = proc_status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
    let pids: Vec<&str> = nspid.split_whitespace().skip(1).collect();
    assert_eq!(pids, [pid.to_string().as_str(), "1"], "{nspid}");
    assert!(sbx["landlock"].as_str().unwrap().starts_with("ABI "), "{sbx}");
    ublkd.stop();
}

/// While alive, the guest's namespace limit `path` (under /proc/sys/user) is 0, so the
/// kernel refuses that kind of namespace to everyone, as a restricted kernel does; the
/// old limit comes back on drop.
struct NamespacesRefused {
    path: &'static str,
    old: String,
}

impl NamespacesRefused {
    fn new(path: &'static str) -> Self {
        let old = std::fs::read_to_string(path).unwrap();
        std::fs::write(path, "0").unwrap();
        NamespacesRefused { path, old }
    }
}

impl Drop for NamespacesRefused {
    fn drop(&mut self) {
        std::fs::write(self.path, self.old.trim()).unwrap();
    }
}

const MAX_USER_NAMESPACES: &str = "/proc/sys/user/max_user_namespaces";
const MAX_PID_NAMESPACES: &str = "/proc/sys/user/max_pid_namespaces";

/// `ublkctl add ARGS` fails, naming the user-namespace layer, `cause`, and the setting
/// that would allow it; no device is left.
fn assert_add_refused_for_the_user_namespace(ublkd: &Ublkd, args: &[&str], cause: &str) {
    let mut full = vec!["add"];
    full.extend_from_slice(args);
    let out = ublkd.ctl(&full);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "add must fail without a user namespace:\n{err}");
    for part in
        ["sandbox layer user-namespace", "unshare(CLONE_NEWUSER)", cause, "sandbox_optional"]
    {
        assert!(err.contains(part), "{part:?} missing from the refusal:\n{err}");
    }
    let status: serde_json::Value =
        serde_json::from_str(&ublkd.ctl_ok(&["status", "--json"])).expect("status --json is JSON");
    assert_eq!(status["devices"], serde_json::json!([]), "a refused device is left: {status}");
}

/// The worker of device `id` runs without its user namespace only, and every surface
/// says so: status --json, status, and a warning in the journal.
fn assert_runs_without_the_user_namespace(ublkd: &Ublkd, id: u32, cause: &str) {
    let status = ublkd.status_of(id);
    let sbx = &status["sandbox"];
    let namespaces: Vec<&str> =
        sbx["namespaces"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    assert_eq!(namespaces, ["mnt", "net", "ipc", "uts", "cgroup", "pid"], "{status}");
    let missing = sbx["missing"].as_array().expect("missing layers listed");
    assert_eq!(missing.len(), 1, "{status}");
    assert_eq!(missing[0]["layer"], "user-namespace");
    assert!(missing[0]["cause"].as_str().unwrap().contains(cause), "{status}");
    assert_eq!(sbx["seccomp"], "filter");
    assert_eq!(sbx["capabilities"], "0000000000000000");
    assert!(sbx["landlock"].as_str().unwrap().starts_with("ABI "), "{sbx}");
    let text = ublkd.ctl_ok(&["status"]);
    assert!(
        text.contains("warning: its worker runs without the sandbox layer(s) user-namespace"),
        "{text}"
    );
    let log = ublkd.log();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("runs without the sandbox layer(s) user-namespace")),
        "no warning in the journal:\n{log}"
    );
}

/// The hooked worker's `stat-host-path` attack (statx of /etc/passwd, which seccomp
/// lets through with AT_EMPTY_PATH) finds nothing: the worker's root is empty.
fn assert_host_root_out_of_sight(ublkd: &Ublkd) {
    let line = "attack stat-host-path: blocked";
    ublkd.wait_until("the attack's outcome", || {
        ublkd.log().contains(line) || ublkd.log().contains("ESCAPED")
    });
    let log = ublkd.log();
    assert!(!log.contains("ESCAPED"), "the worker saw the host's root:\n{log}");
    let outcome = log.lines().find(|l| l.contains(line)).unwrap();
    assert!(outcome.contains("No such file or directory"), "{outcome}");
}

/// Where the kernel refuses `ublkd`'s workers a user namespace for `cause`: a memory
/// device is refused unless it may run without that layer; then its worker runs
/// without it and says so, the hooked worker's `stat-host-path` attack still finds the
/// host's root out of sight, and the device serves. Stops ublkd.
fn assert_serves_only_without_the_user_namespace(ublkd: Ublkd, cause: &str) {
    assert_add_refused_for_the_user_namespace(&ublkd, &["-t", "memory", "-s", "16M"], cause);
    let id = ublkd.add(&["-t", "memory", "-s", "16M", "--sandbox-optional", "user-namespace"]);
    assert_runs_without_the_user_namespace(&ublkd, id, cause);
    assert_host_root_out_of_sight(&ublkd);
    assert_device_serves(id);
    ublkd.stop();
}

#[test]
fn a_refused_user_namespace_refuses_the_device_unless_allowed_and_then_says_so() {
    let _serial = serial();
    let _refused = NamespacesRefused::new(MAX_USER_NAMESPACES);
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let env = [("UBLKD_WORKER_ATTACK", "stat-host-path")];
    let ublkd = Ublkd::start_with("sbx-no-userns", &extra, &env);
    // The kernel's answer to unshare(CLONE_NEWUSER) over the limit: ENOSPC, with the
    // setting that limits it.
    let cause = "user.max_user_namespaces is reached, or 0): No space left on device";
    assert_serves_only_without_the_user_namespace(ublkd, cause);
}

#[test]
fn the_config_default_allows_running_without_the_user_namespace() {
    let _serial = serial();
    let _refused = NamespacesRefused::new(MAX_USER_NAMESPACES);
    let extra = "worker_user = \"nobody\"\n\n[defaults]\nsandbox_optional = [\"user-namespace\"]\n";
    let ublkd = Ublkd::start_with("sbx-no-userns-config", extra, &[]);
    let id = ublkd.add(&["-t", "memory", "-s", "16M"]);
    assert_runs_without_the_user_namespace(&ublkd, id, "No space left on device");
    assert_device_serves(id);
    ublkd.stop();
}

#[test]
fn a_configured_device_without_its_user_namespace_fails_naming_the_layer() {
    let _serial = serial();
    let _refused = NamespacesRefused::new(MAX_USER_NAMESPACES);
    let extra = "worker_user = \"nobody\"\n\n[[device]]\ntarget = \"memory\"\nsize = \"16M\"\n";
    let ublkd = Ublkd::start_with("sbx-no-userns-configured", extra, &[]);
    ublkd.wait_until("the configured device's outcome", || {
        ublkd.log().contains("configured device")
    });
    let log = ublkd.log();
    let line = log.lines().find(|l| l.contains("configured device")).unwrap();
    for part in ["ERROR", "sandbox layer user-namespace", "unshare(CLONE_NEWUSER)", "No space left"]
    {
        assert!(line.contains(part), "{part:?} missing from {line:?}");
    }
    let status: serde_json::Value =
        serde_json::from_str(&ublkd.ctl_ok(&["status", "--json"])).unwrap();
    assert_eq!(status["devices"], serde_json::json!([]), "{status}");
    ublkd.stop();
}

/// ublkd starts each sandboxed worker in a pid namespace of its own, part of the
/// `namespaces` layer: where the kernel refuses one, the add fails naming it, unless
/// the device may run without that layer; then the worker runs without it and status
/// and the journal say so.
#[test]
fn a_refused_pid_namespace_refuses_the_device_unless_namespaces_are_optional() {
    let _serial = serial();
    let _refused = NamespacesRefused::new(MAX_PID_NAMESPACES);
    let ublkd = Ublkd::start_with("sbx-no-pidns", "worker_user = \"nobody\"\n", &[]);
    let out = ublkd.ctl(&["add", "-t", "memory", "-s", "16M"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "add must fail without a pid namespace:\n{err}");
    for part in ["pid namespace of its own", "No space left on device", "sandbox_optional"] {
        assert!(err.contains(part), "{part:?} missing from the refusal:\n{err}");
    }
    let status: serde_json::Value =
        serde_json::from_str(&ublkd.ctl_ok(&["status", "--json"])).unwrap();
    assert_eq!(status["devices"], serde_json::json!([]), "a refused device is left: {status}");

    let id = ublkd.add(&["-t", "memory", "-s", "16M", "--sandbox-optional", "namespaces"]);
    let status = ublkd.status_of(id);
    let sbx = &status["sandbox"];
    let namespaces: Vec<&str> =
        sbx["namespaces"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    assert!(!namespaces.contains(&"pid"), "{status}");
    assert!(namespaces.contains(&"mnt"), "the other namespaces are still made: {status}");
    let missing = sbx["missing"].as_array().expect("missing layers listed");
    assert!(
        missing
            .iter()
            .any(|m| m["layer"] == "namespaces"
                && m["cause"].as_str().unwrap().contains("CLONE_NEWPID")),
        "{status}"
    );
    let text = ublkd.ctl_ok(&["status"]);
    assert!(text.contains("runs without the sandbox layer(s) namespaces"), "{text}");
    assert_device_serves(id);
    ublkd.stop();
}

/// A root that is a plain directory (not a mount point) with the guest's top-level
/// entries bound into it, in a mount namespace of its own (gone with ublkd): a chroot
/// as a distribution's build or rescue environment makes one. Returns the wrapper
/// that runs a command there.
fn chroot_wrapper() -> Vec<&'static str> {
    const SCRIPT: &str = r#"set -e
echo "test chroot: binding the guest's entries in at $(date +%T.%N)" >&2
root=/tmp/ublkd-test-chroot
mkdir -p "$root"
for entry in /*; do
    name=${entry#/}
    if [ -L "$entry" ]; then
        ln -sfn "$(readlink "$entry")" "$root/$name"
    elif [ -d "$entry" ]; then
        mkdir -p "$root/$name"
        mount --rbind "$entry" "$root/$name"
    fi
done
echo "test chroot: $root ready at $(date +%T.%N)" >&2
exec chroot "$root" "$@""#;
    vec!["unshare", "--mount", "--propagation", "private", "sh", "-c", SCRIPT, "sh"]
}

#[test]
fn inside_a_chroot_the_worker_keeps_every_other_layer_and_the_host_root_out_of_sight() {
    let _serial = serial();
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let env = [("UBLKD_WORKER_ATTACK", "stat-host-path")];
    let ublkd = Ublkd::start_wrapped("sbx-chroot", &extra, &env, &chroot_wrapper());
    // Inside a chroot the kernel refuses CLONE_NEWUSER to anyone, root included: EPERM.
    let cause = "inside a chroot, or by a sysctl or security policy): Operation not permitted";
    // pivot_root is refused there too (`/` is not a mount point): the worker chroots
    // into a detached empty tmpfs instead, and the chroot's files are out of sight.
    assert_serves_only_without_the_user_namespace(ublkd, cause);
}
