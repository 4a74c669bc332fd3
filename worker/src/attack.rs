//! Test-only: attacks a sandboxed worker makes on itself, one per boundary, to prove
//! that each boundary holds, and faults a worker can commit towards the kernel, to
//! prove that the worker notices and ublkd recovers the device. Compiled only with the
//! `test-hooks` feature, which no release or package build enables; the sandbox tests
//! build a separate worker with it.
//!
//! `UBLKD_WORKER_ATTACK=<name>` picks the attack; the first incarnation of the worker
//! makes it right after reporting Ready. Outcomes, on stderr (the supervisor's log):
//! `attack <name>: blocked (<why>)` and the worker goes on serving; or the sandbox
//! kills it (seccomp: exit 159) and the supervisor recovers the device; or
//! `attack <name>: ESCAPED` and exit 99, which the tests treat as a failure.

use std::ffi::CString;

/// The attack named in the environment, if any.
pub fn requested() -> Option<String> {
    std::env::var("UBLKD_WORKER_ATTACK").ok().filter(|a| !a.is_empty())
}

/// Attacks the ring makes from inside a queue thread (see `queue_loop`).
pub const URING_OPENAT: &str = "uring-openat";
/// Not an attack on the sandbox but a fault towards the kernel: queue thread 0 COMMITs
/// one tag it was never given (a one-element COMMIT, which completes only on failure).
/// The kernel must refuse it, and the worker must notice, end, and be replaced.
pub const COMMIT_UNOWNED: &str = "commit-unowned";
/// The same with two tags in one COMMIT (which completes with its result).
pub const COMMIT_UNOWNED_BATCH: &str = "commit-unowned-batch";

/// Not an attack on the sandbox but on the supervisor's log: a line on stderr that
/// mimics one of the supervisor's, then [`FLOOD_LINES`] lines as fast as it can write
/// them (`flood line N`).
pub const STDERR_FLOOD: &str = "stderr-flood";
/// How many lines [`STDERR_FLOOD`] writes after its forged one.
pub const FLOOD_LINES: u32 = 5000;

/// Writes one line in one write, so it never interleaves with the supervisor's log.
pub fn say(line: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

fn outcome(name: &str, rc: i64) {
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        say(format!("attack {name}: blocked ({err})"));
    } else {
        say(format!("attack {name}: ESCAPED (returned {rc})"));
        std::process::exit(99);
    }
}

/// Makes attack `name`; `supervisor` is the supervisor's pid (read before the
/// sandbox went up).
pub fn run(name: &str, supervisor: i32) {
    let c = |s: &str| CString::new(s).expect("no NUL");
    // SAFETY (all blocks below): each is a single raw syscall with valid arguments
    // (NUL-terminated paths that live across the call, valid out-buffers); whether the
    // kernel allows it is the question the attack asks.
    match name {
        "open-host-path" => {
            let p = c("/etc/passwd");
            // SAFETY: see above.
            outcome(name, i64::from(unsafe { libc::open(p.as_ptr(), libc::O_RDONLY) }));
        }
        "stat-host-path" => {
            let p = c("/etc/passwd");
            // SAFETY: see above.
            let mut st: libc::statx = unsafe { std::mem::zeroed() };
            // SAFETY: see above.
            let rc =
                unsafe { libc::statx(libc::AT_FDCWD, p.as_ptr(), 0, libc::STATX_SIZE, &mut st) };
            outcome(name, i64::from(rc));
        }
        "stat-other-device" => {
            // Another device's shared region, whose path the test knows.
            let path = std::env::var("UBLKD_WORKER_ATTACK_PATH").unwrap_or_default();
            let p = c(&path);
            // SAFETY: see above.
            let mut st: libc::statx = unsafe { std::mem::zeroed() };
            // SAFETY: see above.
            let rc =
                unsafe { libc::statx(libc::AT_FDCWD, p.as_ptr(), 0, libc::STATX_SIZE, &mut st) };
            outcome(name, i64::from(rc));
        }
        "socket" => {
            // SAFETY: see above.
            outcome(name, i64::from(unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) }));
        }
        "signal-supervisor" => {
            // SAFETY: see above.
            outcome(name, i64::from(unsafe { libc::kill(supervisor, libc::SIGTERM) }));
        }
        "ptrace-supervisor" => {
            // SAFETY: see above.
            let rc = unsafe { libc::ptrace(libc::PTRACE_ATTACH, supervisor, 0, 0) };
            outcome(name, rc);
        }
        "exec" => {
            let sh = c("/bin/sh");
            let argv = [sh.as_ptr(), std::ptr::null()];
            let envp = [std::ptr::null()];
            // SAFETY: see above.
            outcome(
                name,
                i64::from(unsafe { libc::execve(sh.as_ptr(), argv.as_ptr(), envp.as_ptr()) }),
            );
        }
        "new-io-uring" => {
            // SAFETY: see above.
            let mut params: [u8; 120] = [0; 120];
            // SAFETY: see above.
            let rc = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params.as_mut_ptr()) };
            outcome(name, rc);
        }
        "raise-rlimit" => {
            let lim = libc::rlimit { rlim_cur: 1 << 20, rlim_max: 1 << 20 };
            // SAFETY: see above.
            outcome(name, i64::from(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }));
        }
        URING_OPENAT | COMMIT_UNOWNED | COMMIT_UNOWNED_BATCH => {} // made by a queue thread
        STDERR_FLOOD => {
            // The supervisor's own text format, a device event it never logged, and a
            // carriage return that would hide the line's start on a terminal.
            say("2026-01-01T00:00:00.000000Z ERROR ublkd::daemon: forged supervisor line \
                 dev_id=0 event=\"deleted\"\r"
                .into());
            for i in 0..FLOOD_LINES {
                say(format!("flood line {i}"));
            }
        }
        other => say(format!("attack {other}: unknown attack, nothing done")),
    }
}
