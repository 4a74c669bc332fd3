//! Test-only: attacks a sandboxed worker makes on itself, one per boundary, to prove
//! that each boundary holds, and faults a worker can commit towards the kernel, to
//! prove that the worker notices and ublkd recovers the device. Compiled only with the
//! `test-hooks` feature, which no release or package build enables; the sandbox tests
//! build a separate worker with it.
//!
//! `UBLKD_WORKER_ATTACK=<name>` picks the attack; the first incarnation of the worker
//! makes it right after reporting Ready. Outcomes, on stderr (the supervisor's log):
//! `attack <name>: blocked (<why>)` and the worker goes on serving; or the sandbox
//! kills it (seccomp: `WorkerExit::Seccomp`) and the supervisor recovers the device; or
//! `attack <name>: ESCAPED` and exit 99, which the tests treat as a failure.

use std::ffi::CString;

/// The attack named in the environment, if any.
pub fn requested() -> Option<&'static str> {
    // Read once: the queue threads ask after every turn.
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| std::env::var("UBLKD_WORKER_ATTACK").ok().filter(|a| !a.is_empty()))
        .as_deref()
}

/// Attacks the ring makes from inside a queue thread (see `hooks`).
pub const URING_OPENAT: &str = "uring-openat";
/// A SENDMSG, a RECV and a URING_CMD by raw descriptor (the ring's own fd), asked of
/// the queue thread's ring: a null or memory worker's ring has no socket operation, and
/// takes no descriptor it was not given registered.
pub const URING_SENDMSG: &str = "uring-sendmsg";
pub const URING_RECV: &str = "uring-recv";
pub const URING_CMD_RAW_FD: &str = "uring-cmd-raw-fd";
/// A SENDMSG carrying a descriptor (`SCM_RIGHTS`, the ring's own fd), as a worker would
/// pass one to its server over `nbd+unix`: even an nbd worker's ring has no SENDMSG
/// (it sends with WRITEV, which carries no control message).
pub const URING_SENDMSG_RIGHTS: &str = "uring-sendmsg-rights";
/// `io_uring_register(IORING_REGISTER_PERSONALITY)` on the queue thread's enabled ring.
pub const URING_REGISTER_PERSONALITY: &str = "uring-register-personality";
/// Not an attack on the sandbox but a fault towards the kernel: queue thread 0 COMMITs
/// one tag it was never given (a one-element COMMIT, which completes only on failure).
/// The kernel must refuse it, and the worker must notice, end, and be replaced.
pub const COMMIT_UNOWNED: &str = "commit-unowned";
/// The same with two tags in one COMMIT (which completes with its result).
pub const COMMIT_UNOWNED_BATCH: &str = "commit-unowned-batch";

/// Not a sandbox attack but a hostile worker towards the supervisor: once it has
/// served a while, queue thread 0 writes all-ones over every field of its shared
/// region (header, generation, counters, thread slots, tag records), then dies. The
/// supervisor must stay up, recover the device and repair the region.
pub const SCRIBBLE_REGION: &str = "scribble-region";
/// A queue thread stuck in the middle of a turn while the others serve on: the first
/// queue thread to have served a while sleeps for good right after handling a batch of
/// requests, holding them. The supervisor's hang watch must find it.
pub const STALL_THREAD: &str = "stall-thread";

/// Not an attack but the kernel's side of a race, made on purpose: queue thread 0
/// unregisters its ring's buffer table before its first turn, as the supervisor's fast
/// release does to a dead worker's ring that a FETCH may still be delivering into. The
/// kernel then cannot register the next request's pages in that ring (zero copy). It
/// must deliver the request marked NEED_REG_BUF (the fallback flag), never fail it
/// with EIO; the worker must end and the device recover with no I/O error.
pub const DROP_ZERO_COPY_BUFFERS: &str = "drop-zero-copy-buffers";

/// Not a sandbox attack but a worker that tries to make its supervisor wait on it: once
/// serving, it fills its own control socket's queue through the copy of ublkd's end it
/// holds (so that ublkd's next send to it would block), fills ublkd's queue through its
/// own end, steals what its stderr pipe holds, then never reads its control socket
/// again while its queue threads serve on. ublkd must answer its clients, delete the
/// device, and take it over after a restart (killing and recovering it) all the same.
pub const FILL_CONTROL: &str = "fill-control";

/// Not a sandbox attack but a worker that makes its supervisor wait for its answer:
/// the targeted device's second incarnation (the one a recovery hands the device to)
/// takes its activation and never answers it. ublkd must serve everything else
/// meanwhile, end the activation at its deadline, and recover the device when asked.
pub const SILENT_ACTIVATION: &str = "silent-activation";

/// Not a sandbox attack but a worker that makes its supervisor's kernel calls wait on
/// it: the targeted device's first incarnation (the one an add hands the device to)
/// answers its activation Ready without fetching (PREPing) a single tag, then idles.
/// START_DEV waits in the kernel until every tag is fetched: ublkd must serve
/// everything else meanwhile, and refuse the add at its deadline naming the worker.
pub const READY_NO_FETCH: &str = "ready-no-fetch";
/// The same for the targeted device's second incarnation, the one a recovery hands the
/// device to: END_USER_RECOVERY waits on it, and the recovery must start over with a
/// new worker at its deadline.
pub const READY_NO_FETCH_RECOVERY: &str = "ready-no-fetch-recovery";

/// Not an attack but a window for the tests to look at: `ublkd-worker --probe-rbd`
/// pauses this many milliseconds once its sandbox is up, before it reads its setup, so
/// that a test can read its `/proc/PID/status` while it runs.
pub const PROBE_PAUSE_ENV: &str = "UBLKD_WORKER_PROBE_PAUSE_MS";

/// The probe's pause ([`PROBE_PAUSE_ENV`]), said on stderr so that a test can tell it
/// caught the probe sandboxed.
pub fn probe_pause() {
    let Some(ms) = std::env::var(PROBE_PAUSE_ENV).ok().and_then(|v| v.parse::<u64>().ok()) else {
        return;
    };
    say(format!("probe: sandboxed, pausing {ms} ms"));
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

/// Whether the worker of device `dev_id`'s incarnation `generation` answers its
/// activation without fetching its tags ([`READY_NO_FETCH`], [`READY_NO_FETCH_RECOVERY`]).
pub fn skips_fetch(dev_id: u32, generation: u64) -> bool {
    let wanted = match requested() {
        Some(READY_NO_FETCH) => 1,
        Some(READY_NO_FETCH_RECOVERY) => 2,
        _ => return false,
    };
    generation == wanted && targets(dev_id)
}

/// Makes [`FILL_CONTROL`] on the control thread, which then parks for good.
pub fn fill_control(control: std::os::fd::RawFd, held: &[std::os::fd::RawFd]) {
    let into_own = held.first().map_or(0, |&ublkds_end| stuff(ublkds_end));
    let into_ublkds = stuff(control);
    let mut stolen = 0;
    if let Some(&stderr_read) = held.get(1) {
        let mut buf = [0u8; 4096];
        // SAFETY: `buf` is writable for its length; the pipe is nonblocking (the relay
        // made it so), and if it were not, this thread may wait: it parks below anyway.
        while let n @ 1.. = unsafe { libc::read(stderr_read, buf.as_mut_ptr().cast(), buf.len()) } {
            stolen += n;
            if stolen > 1 << 20 {
                break;
            }
        }
    }
    say(format!(
        "attack {FILL_CONTROL}: queued {into_own} packets to itself through ublkd's end and \
         {into_ublkds} to ublkd, stole {stolen} bytes of its stderr; no longer reading"
    ));
    loop {
        std::thread::park();
    }
}

/// Sends 64-byte packets on `fd` without waiting until its peer's queue is full (at
/// most a million); how many went.
fn stuff(fd: std::os::fd::RawFd) -> usize {
    let mut junk = [0xa5u8; 64];
    let mut sent = 0;
    while sent < 1_000_000 {
        let mut iov = libc::iovec { iov_base: junk.as_mut_ptr().cast(), iov_len: junk.len() };
        // SAFETY: a zeroed msghdr is valid; it then names one iovec over `junk`.
        let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
        header.msg_iov = &mut iov;
        header.msg_iovlen = 1;
        // SAFETY: `header` and what it points to live across the call.
        let rc = unsafe { libc::sendmsg(fd, &header, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if rc < 0 {
            break;
        }
        sent += 1;
    }
    sent
}

/// Whether the attack applies to device `dev_id`: `UBLKD_WORKER_ATTACK_DEV` limits it
/// to one device (a test with two devices attacks one and watches the other).
pub fn targets(dev_id: u32) -> bool {
    static DEV: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    DEV.get_or_init(|| std::env::var("UBLKD_WORKER_ATTACK_DEV").ok()?.parse().ok())
        .is_none_or(|id| id == dev_id)
}

/// The hostile-worker attacks made from inside a queue thread's loop, after each turn:
/// `turn` counts the thread's turns, `handled` says whether this one handled requests.
pub fn after_turn(dev: &crate::device::Device, thread: usize, turn: u64, handled: bool) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static STALLED: AtomicBool = AtomicBool::new(false);
    if dev.generation != 1 || turn < 50 || !targets(dev.dev_id) {
        return;
    }
    match requested() {
        Some(SCRIBBLE_REGION) if thread == 0 => {
            scribble(&dev.shm);
            say(format!("attack {SCRIBBLE_REGION}: region scribbled, exiting"));
            // SAFETY: _exit has no preconditions; the process ends here.
            unsafe { libc::_exit(i32::from(ublkd_proto::exit::WorkerExit::TestHook.code())) };
        }
        // Whichever thread gets there first (only one fetches a queue's requests at a
        // time); the others serve on.
        Some(STALL_THREAD) if handled && !STALLED.swap(true, Ordering::Relaxed) => {
            say(format!("attack {STALL_THREAD}: queue thread {thread} stops mid-turn"));
            // Parked, not asleep: a sleep interrupted by a signal would be restarted
            // through restart_syscall, which the sandbox does not allow.
            loop {
                std::thread::park();
            }
        }
        _ => {}
    }
}

/// All-ones over every field of the region a worker can reach.
fn scribble(shm: &ublkd_proto::shm::ShmRegion) {
    use std::sync::atomic::Ordering::Relaxed;
    let h = shm.header();
    let c = &h.counters;
    let g = shm.geometry();
    let mut wide = vec![&h.magic, &h.generation, &c.reads, &c.writes, &c.flushes];
    wide.extend([&c.discards, &c.write_zeroes, &c.bytes_read, &c.bytes_written, &c.errors]);
    wide.extend([&c.read_errors, &c.write_errors, &c.flush_errors]);
    wide.extend([&c.discard_errors, &c.write_zeroes_errors]);
    let mut narrow = vec![&h.version, &h.header_bytes, &h.dev_id, &h.nr_queues];
    narrow.extend([&h.queue_depth, &h.nr_threads]);
    for slot in (0..usize::from(g.nr_threads)).filter_map(|t| shm.thread(t)) {
        wide.extend([&slot.heartbeat, &slot.generation]);
        narrow.extend([&slot.inflight, &slot.tid]);
    }
    let tags = (0..g.nr_queues).flat_map(|q| (0..g.queue_depth).map(move |t| (q, t)));
    for slot in tags.filter_map(|(q, t)| shm.tag(q, t)) {
        wide.extend([&slot.start_sector, &slot.since_ms]);
        narrow.extend([&slot.seq, &slot.state, &slot.op, &slot.nr_sectors]);
    }
    for hist in (0..usize::from(g.nr_threads)).filter_map(|t| shm.latency(t)) {
        for op in &hist.ops {
            wide.extend(op.buckets.iter().chain([&op.sum_ns]));
        }
    }
    wide.into_iter().for_each(|a| a.store(u64::MAX, Relaxed));
    narrow.into_iter().for_each(|a| a.store(u32::MAX, Relaxed));
}

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
        // An rbd worker (which may make TCP sockets) connecting where no Ceph daemon
        // listens: 127.0.0.1 at the port the test listens on. Landlock refuses it
        // (EACCES); a connection, or any other error, means the network was reached.
        "tcp-connect-elsewhere" => {
            let port: u16 = std::env::var("UBLKD_WORKER_ATTACK_PORT")
                .ok()
                .and_then(|p| p.parse().ok())
                .unwrap_or(22);
            // SAFETY: see above.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
            if fd < 0 {
                return outcome(name, -1);
            }
            let addr = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: port.to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: see above (`addr` is a valid sockaddr_in for the call).
            let rc = unsafe {
                libc::connect(
                    fd,
                    (&raw const addr).cast(),
                    size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            };
            let refused =
                rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EACCES);
            if rc < 0 && !refused {
                let err = std::io::Error::last_os_error();
                say(format!("attack {name}: ESCAPED (the network answered: {err})"));
                std::process::exit(99);
            }
            outcome(name, i64::from(rc));
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
        // An rbd worker may make sockets, but stream TCP ones only: a datagram socket
        // could reach any address and port. Refused with an error (EPERM), not a trap.
        "udp-socket" => {
            // SAFETY: see above.
            outcome(name, i64::from(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) }));
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
        // Made by a queue thread.
        URING_OPENAT
        | URING_SENDMSG
        | URING_SENDMSG_RIGHTS
        | URING_RECV
        | URING_CMD_RAW_FD
        | URING_REGISTER_PERSONALITY
        | COMMIT_UNOWNED
        | COMMIT_UNOWNED_BATCH
        | SCRIBBLE_REGION
        | STALL_THREAD
        | FILL_CONTROL
        | SILENT_ACTIVATION
        | READY_NO_FETCH
        | READY_NO_FETCH_RECOVERY => {}
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
