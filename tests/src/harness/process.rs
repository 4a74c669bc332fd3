//! The binaries under test and the commands a test runs: where the workspace's
//! binaries are (and the worker built with `test-hooks`), running a command with or
//! without a time limit, asserting it succeeded with its output in the failure message,
//! and ending or signalling a process.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A workspace binary: they sit two levels above the running test binary
/// (target/debug/deps).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(path.is_file(), "{} is missing: build the workspace first", path.display());
    path
}

/// The worker built with the test-only `test-hooks` feature (attacks on its own
/// sandbox, hostile behaviour towards ublkd; see worker/src/attack.rs).
pub fn hooked_worker() -> PathBuf {
    // target/debug/deps/<test>-… → target/test-hooks/debug/ublkd-worker
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().unwrap().parent().unwrap().parent().unwrap();
    let worker = target.join("test-hooks/debug/ublkd-worker");
    assert!(
        worker.is_file(),
        "{} is missing: build it with `cargo build --workspace --bins --features \
         ublkd-tests/in-vm,ublkd-worker/test-hooks` and copy target/debug/ublkd-worker there, \
         then build again without test-hooks (run-tests does)",
        worker.display()
    );
    worker
}

/// Runs `cmd`, returning its output; panics only if it cannot be started.
pub fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs `cmd` for at most `limit`; past that it is SIGKILLed and the error says so,
/// with what it printed by then. For tests that must report a hang, not become one.
pub fn run_within(cmd: &mut Command, limit: Duration) -> Result<Output, String> {
    use std::io::Read;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let pid = child.id();
    let status = wait_exit(child, limit);
    let out = Output {
        status: status.unwrap_or_else(|| std::os::unix::process::ExitStatusExt::from_raw(9)),
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    };
    match status {
        Some(_) => Ok(out),
        None => Err(format!("{cmd:?} (pid {pid}) hung for {limit:?}:\n{}", describe(&out))),
    }
}

/// Runs `cmd` and asserts it exits 0; returns its stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{}", out.status, describe(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// Asserts that `what` (a command line) succeeded; a failure shows its output and then
/// `log`, a daemon's log or the journal, headed by `log_name`.
pub fn assert_succeeded(out: &Output, what: &str, log_name: &str, log: impl FnOnce() -> String) {
    if !out.status.success() {
        panic!("{what} failed ({}):\n{}\n--- {log_name}\n{}", out.status, describe(out), log());
    }
}

/// A command's stdout and stderr, for failure messages.
pub fn describe(out: &Output) -> String {
    format!(
        "--- stdout\n{}--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Sends SIGTERM to `child` and waits up to `timeout` for its exit status; past that,
/// SIGKILL and `None`.
pub(crate) fn terminate(child: Child, timeout: Duration) -> Option<ExitStatus> {
    signal(child.id(), libc::SIGTERM);
    wait_exit(child, timeout)
}

/// Waits up to `timeout` for `child`'s exit status; past that, SIGKILLs and reaps it
/// and returns `None`.
pub(crate) fn wait_exit(mut child: Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Sends `sig` to `pid`; true if it was delivered to a process that existed.
pub fn signal(pid: u32, sig: libc::c_int) -> bool {
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is a process this test
    // started (ublkd, a worker ublkd reported, or fio).
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}
