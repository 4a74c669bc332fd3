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
/// `io_uring_register(IORING_REGISTER_PERSONALITY)` on the queue thread's enabled ring.
pub const URING_REGISTER_PERSONALITY: &str = "uring-register-personality";
/// Not an attack on the sandbox but a fault towards the kernel: queue thread 0 COMMITs
/// one tag it was never given (a one-element COMMIT, which completes only on failure).
/// The kernel must refuse it, and the worker must notice, end, and be replaced.
pub const COMMIT_UNOWNED: &str = "commit-unowned";
/// The same with two tags in one COMMIT (which completes with its result).
pub const COMMIT_UNOWNED_BATCH: &str = "commit-unowned-batch";

/// Writes one line in one write, so it never interleaves with the supervisor's log.
pub fn say(line: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// The outcome of a raw call that returned `rc` (negative: refused, errno set).
pub fn outcome(name: &str, rc: i64) {
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        say(format!("attack {name}: blocked ({err})"));
    } else {
        say(format!("attack {name}: ESCAPED (returned {rc})"));
        std::process::exit(99);
    }
}

/// `statx(AT_FDCWD, path, flags)`.
fn statx(path: &CString, flags: libc::c_int) -> i64 {
    // SAFETY: a zeroed statx is a valid out-buffer.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` a valid out-buffer, for the call.
    i64::from(unsafe {
        libc::statx(libc::AT_FDCWD, path.as_ptr(), flags, libc::STATX_SIZE, &mut st)
    })
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
        // With AT_EMPTY_PATH, which seccomp lets through: the path is still looked up
        // (in the worker's root).
        "stat-host-path" => outcome(name, statx(&c("/etc/passwd"), libc::AT_EMPTY_PATH)),
        // Without AT_EMPTY_PATH, which seccomp refuses.
        "stat-host-path-plain" => outcome(name, statx(&c("/etc/passwd"), 0)),
        "stat-other-device" => {
            // Another device's shared region, whose path the test knows.
            let path = std::env::var("UBLKD_WORKER_ATTACK_PATH").unwrap_or_default();
            outcome(name, statx(&c(&path), libc::AT_EMPTY_PATH));
        }
        "mmap-exec" => {
            // SAFETY: see above (an anonymous mapping; nothing is placed at a fixed address).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            outcome(name, if p == libc::MAP_FAILED { -1 } else { p as i64 });
        }
        "mprotect-exec" => {
            // A page of its own, made writable first (allowed), then executable.
            // SAFETY: see above (an anonymous mapping of its own, never dereferenced).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                say(format!("attack {name}: the writable page failed, nothing tried"));
                return;
            }
            // SAFETY: see above; `p` is the page just mapped.
            let rc = unsafe { libc::mprotect(p, 4096, libc::PROT_READ | libc::PROT_EXEC) };
            outcome(name, i64::from(rc));
        }
        "prctl-dumpable" => {
            // Would give its /proc files back to its uid (other workers share it).
            // SAFETY: see above.
            outcome(name, i64::from(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) }));
        }
        "fcntl-setfl" => {
            // SAFETY: see above.
            outcome(name, i64::from(unsafe { libc::fcntl(2, libc::F_SETFL, libc::O_APPEND) }));
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
        URING_OPENAT | URING_REGISTER_PERSONALITY | COMMIT_UNOWNED | COMMIT_UNOWNED_BATCH => {} // made by a queue thread
        other => say(format!("attack {other}: unknown attack, nothing done")),
    }
}
