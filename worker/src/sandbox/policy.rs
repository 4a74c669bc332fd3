//! The worker's sandbox policy, as data: every system call and io_uring operation a
//! sandboxed worker may use, each with the reason it needs it. A reviewer reads this
//! file; `mod.rs` only applies it.
//!
//! The worker gets every file it uses as an fd from the supervisor, so nothing here
//! opens a path: no `open`, `openat`, `execve`, `socket`, `connect`, `ptrace`, `kill`
//! of other processes, `mount`, `setrlimit`/`prlimit64`, `setuid`, `bpf`, `unshare`.
//! Anything not listed traps (SIGSYS): the worker reports the call and exits with
//! [`super::EXIT_SECCOMP`] (`ublkd_proto::exit::WorkerExit::Seccomp`), which the
//! supervisor describes as such (`ublkd_proto::exit::describe`).
//!
//! An rbd worker (the [`super::Profile::Rbd`]) runs librados and librbd, which talk to
//! the Ceph cluster themselves and start threads as they need them: it keeps the
//! host's network namespace and may also make [`RBD_ALWAYS`]; the calls of
//! [`RBD_REFUSED`] fail with an error instead of trapping. Everything librbd needs from
//! the filesystem is loaded before the sandbox (`--rbd`); what it still looks for
//! afterwards, none of which it needs, is in [`RBD_REFUSED`]'s reasons.

use io_uring::opcode;
use ublkd_proto::msg::TargetSetup;
use ublkd_proto::uapi;

/// One allowed system call, with the arguments it is allowed with. `name` and `why`
/// are for the reader (and the tests).
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)]
pub struct Allowed {
    pub nr: libc::c_long,
    pub name: &'static str,
    pub only: Only,
    pub why: &'static str,
}

/// Which calls of an allowed system call the filter lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Only {
    /// Every call.
    Any,
    /// Calls whose argument `arg` (a C `int`: the low 32 bits are compared) is one of
    /// `values`.
    ArgIn { arg: u8, values: &'static [u64] },
    /// Calls whose argument `arg` has none of the bits in `mask` set.
    ArgLacks { arg: u8, mask: u64 },
    /// Calls whose argument `arg` has every bit in `mask` set.
    ArgHas { arg: u8, mask: u64 },
    /// Calls whose argument `arg`, masked with `mask`, equals `value`: some bits set
    /// and others clear, in one condition.
    ArgMasked { arg: u8, mask: u64, value: u64 },
}

const fn allow(nr: libc::c_long, name: &'static str, why: &'static str) -> Allowed {
    Allowed { nr, name, only: Only::Any, why }
}

const fn allow_only(
    nr: libc::c_long,
    name: &'static str,
    only: Only,
    why: &'static str,
) -> Allowed {
    Allowed { nr, name, only, why }
}

/// `mmap`'s and `mprotect`'s `prot` argument.
const PROT_ARG: u8 = 2;

/// Allowed for the worker's whole life once sandboxed.
pub const ALWAYS: &[Allowed] = &[
    allow(
        libc::SYS_read,
        "read",
        "reading an fd the supervisor gave (rare; kept for std's fallbacks)",
    ),
    allow(libc::SYS_write, "write", "log lines to stderr (a pipe ublkd relays to its log)"),
    allow(libc::SYS_writev, "writev", "log lines to stderr, as the logger writes them"),
    allow(libc::SYS_close, "close", "dropping fds it no longer needs"),
    allow(libc::SYS_recvmsg, "recvmsg", "messages and fds from the supervisor (SCM_RIGHTS)"),
    allow(libc::SYS_sendmsg, "sendmsg", "answers to the supervisor"),
    allow_only(
        libc::SYS_mmap,
        "mmap",
        Only::ArgLacks { arg: PROT_ARG, mask: libc::PROT_EXEC as u64 },
        "descriptor arrays, the shared region, memory target, buffers, thread stacks; \
         never executable: the worker loads no code once sandboxed",
    ),
    allow(libc::SYS_munmap, "munmap", "freeing mappings (allocator, thread stacks)"),
    allow_only(
        libc::SYS_mprotect,
        "mprotect",
        Only::ArgLacks { arg: PROT_ARG, mask: libc::PROT_EXEC as u64 },
        "guard pages of thread stacks; never making memory executable",
    ),
    allow(libc::SYS_mremap, "mremap", "the allocator growing large blocks"),
    allow(libc::SYS_madvise, "madvise", "the allocator returning memory"),
    allow(libc::SYS_brk, "brk", "the allocator's heap"),
    allow(libc::SYS_futex, "futex", "locks, channels and thread joins"),
    allow(
        libc::SYS_io_uring_enter,
        "io_uring_enter",
        "the data path: submit and wait on each thread's ring",
    ),
    allow(
        libc::SYS_io_uring_register,
        "io_uring_register",
        "registering files, FETCH buffer rings and restrictions while a ring is disabled; \
         once enabled, the ring itself allows only URING_REGISTER_OPS",
    ),
    allow(libc::SYS_fstat, "fstat", "sizes of the target's fd and the shared region"),
    allow_only(
        libc::SYS_newfstatat,
        "newfstatat",
        Only::ArgHas { arg: 3, mask: libc::AT_EMPTY_PATH as u64 },
        "fstat as glibc issues it: AT_EMPTY_PATH on an fd (a path would still be looked \
         up, in the empty root, where there is nothing to find)",
    ),
    allow_only(
        libc::SYS_statx,
        "statx",
        Only::ArgHas { arg: 2, mask: libc::AT_EMPTY_PATH as u64 },
        "file metadata of a given fd (std's File::metadata: AT_EMPTY_PATH; a path would \
         still be looked up, in the empty root)",
    ),
    allow(libc::SYS_lseek, "lseek", "size of a block device behind the loop target's fd"),
    allow_only(
        libc::SYS_fcntl,
        "fcntl",
        Only::ArgIn { arg: 1, values: &[libc::F_DUPFD_CLOEXEC as u64, libc::F_GETFD as u64] },
        "std duplicating fds with F_DUPFD_CLOEXEC (try_clone of the region's and the \
         target's fds), and std's check that an fd is open before it closes it (F_GETFD, \
         which only reads the close-on-exec flag; debug builds); no other command",
    ),
    allow(libc::SYS_ppoll, "ppoll", "waiting on the control socket"),
    allow(libc::SYS_poll, "poll", "waiting on the control socket"),
    allow(libc::SYS_gettid, "gettid", "the thread id it reports in the shared region"),
    allow(libc::SYS_getpid, "getpid", "logging"),
    allow(
        libc::SYS_clock_gettime,
        "clock_gettime",
        "timestamps (when the vDSO falls back to the syscall)",
    ),
    allow(libc::SYS_clock_nanosleep, "clock_nanosleep", "short sleeps"),
    allow(libc::SYS_nanosleep, "nanosleep", "short sleeps"),
    allow(libc::SYS_sched_yield, "sched_yield", "spin loops in locks"),
    allow(libc::SYS_sched_getaffinity, "sched_getaffinity", "std asking how many CPUs there are"),
    allow(libc::SYS_rt_sigprocmask, "rt_sigprocmask", "std masking signals around thread creation"),
    allow(libc::SYS_rt_sigreturn, "rt_sigreturn", "returning from the SIGSYS handler's frame"),
    allow(
        libc::SYS_rt_sigaction,
        "rt_sigaction",
        "std's signal setup in new threads (dropping the SIGSYS handler only makes a trap kill the worker outright)",
    ),
    allow(libc::SYS_sigaltstack, "sigaltstack", "std's per-thread signal stacks"),
    allow(libc::SYS_getrandom, "getrandom", "std's hash seeds"),
    allow(libc::SYS_exit, "exit", "a thread ending"),
    allow(libc::SYS_exit_group, "exit_group", "the worker ending"),
    allow(
        libc::SYS_pause,
        "pause",
        "std: a thread that calls exit while another thread exits waits here for its end",
    ),
    allow_only(
        libc::SYS_prctl,
        "prctl",
        Only::ArgIn { arg: 0, values: &[libc::PR_SET_NAME as u64] },
        "std naming threads (PR_SET_NAME); no other option",
    ),
    allow(libc::SYS_set_robust_list, "set_robust_list", "glibc's per-thread setup"),
    allow(libc::SYS_rseq, "rseq", "glibc's per-thread setup"),
];

/// Allowed only while the worker sets up (until its rings exist and its threads run).
pub const SETUP_ONLY: &[Allowed] = &[
    allow(
        libc::SYS_io_uring_setup,
        "io_uring_setup",
        "one ring per queue thread, created while standing by",
    ),
    allow(libc::SYS_clone3, "clone3", "starting the queue threads"),
    allow(libc::SYS_sched_setaffinity, "sched_setaffinity", "pinning a queue thread to its CPU"),
    allow(libc::SYS_clone, "clone", "starting the queue threads (older glibc)"),
    allow(libc::SYS_seccomp, "seccomp", "installing stage 2 of this very filter"),
    allow_only(
        libc::SYS_prctl,
        "prctl",
        Only::ArgIn { arg: 0, values: &[libc::PR_SET_NO_NEW_PRIVS as u64] },
        "seccompiler sets no_new_privs (already set) before it installs stage 2",
    ),
];

/// The namespace flags of `clone`: a thread may be started with none of them.
const CLONE_NAMESPACES: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64;

/// Allowed to an rbd worker for its whole life, besides [`ALWAYS`]: librados's
/// messenger (TCP connections to the monitors and OSDs, driven by epoll), librbd's
/// asio engine (epoll, timerfd, eventfd), and the threads both start when they need
/// them, also once the worker serves (a new OSD session, a lock request). Seen with
/// `strace -f` of the probe and of the target's host tests (I/O, lock break and
/// acquire), librbd 16.2.15.
pub const RBD_ALWAYS: &[Allowed] = &[
    allow_only(
        libc::SYS_clone,
        "clone",
        Only::ArgMasked {
            arg: 0,
            mask: libc::CLONE_THREAD as u64 | CLONE_NAMESPACES,
            value: libc::CLONE_THREAD as u64,
        },
        "librados and librbd starting their threads (messenger workers, timers, finishers, asio) at any time: a thread of this process only (CLONE_THREAD, which the kernel allows only with CLONE_VM and CLONE_SIGHAND), with no new namespace; clone3 is refused with ENOSYS (RBD_REFUSED), on which glibc retries with clone",
    ),
    allow(
        libc::SYS_clone3,
        "clone3",
        "let through here only to be refused with ENOSYS by RBD_REFUSED (its flags are in memory, which seccomp cannot read); trapping it would end the worker",
    ),
    allow_only(
        libc::SYS_socket,
        "socket",
        Only::ArgIn { arg: 0, values: &[libc::AF_INET as u64, libc::AF_INET6 as u64] },
        "librados's connections to the cluster's monitors and OSDs: IPv4 or IPv6 only (no unix, netlink or packet socket)",
    ),
    allow(libc::SYS_connect, "connect", "librados connecting to a monitor or an OSD"),
    allow(libc::SYS_getsockname, "getsockname", "librados learning its own address"),
    allow(libc::SYS_setsockopt, "setsockopt", "librados setting TCP_NODELAY on its connections"),
    allow(libc::SYS_shutdown, "shutdown", "librados closing a connection"),
    allow(libc::SYS_epoll_create, "epoll_create", "librados's messenger event loops"),
    allow(libc::SYS_epoll_create1, "epoll_create1", "librbd's asio event loop"),
    allow(libc::SYS_epoll_ctl, "epoll_ctl", "librados's and librbd's event loops"),
    allow(libc::SYS_epoll_wait, "epoll_wait", "librados's and librbd's event loops"),
    allow(libc::SYS_pipe2, "pipe2", "librados's messenger waking its event loops"),
    allow(
        libc::SYS_eventfd2,
        "eventfd2",
        "librbd's asio waking its event loop; the target's per-thread completion eventfds",
    ),
    allow(libc::SYS_timerfd_create, "timerfd_create", "librbd's asio timers"),
    allow(libc::SYS_timerfd_settime, "timerfd_settime", "librbd's asio timers"),
    allow(libc::SYS_uname, "uname", "librados naming its host in its client metadata"),
    allow_only(
        libc::SYS_fcntl,
        "fcntl",
        Only::ArgIn {
            arg: 1,
            values: &[libc::F_GETFL as u64, libc::F_SETFL as u64, libc::F_SETFD as u64],
        },
        "librados making its sockets and pipes non-blocking (F_GETFL, F_SETFL) and close-on-exec (F_SETFD)",
    ),
    allow(
        libc::SYS_openat,
        "openat",
        "let through here only to be refused with ENOENT by RBD_REFUSED, before the kernel sees it",
    ),
    allow(
        libc::SYS_statx,
        "statx",
        "of a path: let through here only to be refused with ENOENT by RBD_REFUSED",
    ),
];

/// A system call an rbd worker's libraries make that fails with `errno` instead of
/// trapping: they look for files they can do without, and treat the failure as
/// absence (the empty root and Landlock would refuse each anyway; this refuses it
/// before the kernel sees it).
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)]
pub struct RefusedCall {
    pub nr: libc::c_long,
    pub name: &'static str,
    pub only: Only,
    pub errno: u32,
    pub why: &'static str,
}

/// What an rbd worker's libraries still look for after they were loaded, and get an
/// error for.
pub const RBD_REFUSED: &[RefusedCall] = &[
    RefusedCall {
        nr: libc::SYS_openat,
        name: "openat",
        only: Only::Any,
        errno: libc::ENOENT as u32,
        why: "every open: librados's OpenSSL reading /usr/lib/ssl/openssl.cnf (it runs without), glibc reading /etc/localtime (UTC then) and /sys/devices/system/cpu/online (it counts CPUs otherwise), librados naming a thread through /proc/self/task/N/comm (left unnamed)",
    },
    RefusedCall {
        nr: libc::SYS_statx,
        name: "statx",
        only: Only::ArgLacks { arg: 2, mask: libc::AT_EMPTY_PATH as u64 },
        errno: libc::ENOENT as u32,
        why: "of a path: librados looking for /sys/fs/cgroup/cpu/ (a CPU quota; none then)",
    },
    RefusedCall {
        nr: libc::SYS_clone3,
        name: "clone3",
        only: Only::Any,
        errno: libc::ENOSYS as u32,
        why: "its flags are in memory seccomp cannot read: glibc retries with clone, whose flags RBD_ALWAYS checks",
    },
];

/// One allowed io_uring operation, for the targets that need it. `name` and `why` are
/// for the reader.
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)]
pub struct AllowedOp {
    pub opcode: u8,
    pub name: &'static str,
    pub only_for: OpFor,
    pub why: &'static str,
}

/// Which targets' rings allow an operation: a null, memory or fail-io worker's ring
/// serves the device alone and has no socket or file operation at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpFor {
    Every,
    Loop,
    Nbd,
    Rbd,
}

impl OpFor {
    fn allows(self, target: &TargetSetup) -> bool {
        match self {
            OpFor::Every => true,
            OpFor::Loop => matches!(target, TargetSetup::Loop),
            OpFor::Nbd => matches!(target, TargetSetup::Nbd { .. }),
            OpFor::Rbd => matches!(target, TargetSetup::Rbd),
        }
    }
}

/// The operations `target`'s rings accept.
pub fn uring_ops(target: &TargetSetup) -> impl Iterator<Item = &'static AllowedOp> + '_ {
    URING_OPS.iter().filter(|op| op.only_for.allows(target))
}

/// Whether every SQE of `target`'s rings must name a registered file
/// (`IORING_RESTRICTION_SQE_FLAGS_REQUIRED` with `IOSQE_FIXED_FILE`), so that the ring
/// reaches no descriptor but those registered for it (/dev/ublkcN, the loop target's
/// file): a URING_CMD on a raw descriptor (the control socket's socket commands, which
/// seccomp keeps out of the worker's own system calls) is refused. Not for nbd: a
/// shared connection's reader posts results into the other threads' rings with
/// MSG_RING, which names the ring by descriptor or by registered file, and the kernel
/// refuses to register a ring in a file table (`io_uring/rsrc.c`: "Don't allow io_uring
/// instances to be registered", EBADF). The flag is required of every SQE or of none,
/// so an nbd ring takes descriptors; what it can do with one is still only WRITEV, RECV,
/// MSG_RING and URING_CMD.
pub fn fixed_files_required(target: &TargetSetup) -> bool {
    !matches!(target, TargetSetup::Nbd { .. })
}

/// The only SQE opcodes a worker's ring accepts (`IORING_REGISTER_RESTRICTIONS`),
/// since io_uring runs many operations in kernel threads that seccomp never sees.
/// OPENAT, CONNECT, SOCKET, SENDMSG, … are not here, so a compromised worker cannot use
/// its ring to reach files or the network.
pub const URING_OPS: &[AllowedOp] = &[
    AllowedOp {
        opcode: opcode::UringCmd16::CODE,
        name: "URING_CMD",
        only_for: OpFor::Every,
        why: "ublk PREP/FETCH/COMMIT on /dev/ublkcN",
    },
    AllowedOp {
        opcode: opcode::Read::CODE,
        name: "READ",
        only_for: OpFor::Loop,
        why: "loop target reads from its backing fd",
    },
    AllowedOp {
        opcode: opcode::Read::CODE,
        name: "READ",
        only_for: OpFor::Rbd,
        why: "rbd target: each queue thread waiting on its own eventfd (registered in its \
              ring, the only file the ring reaches but /dev/ublkcN), which librbd's \
              completion callback writes",
    },
    AllowedOp {
        opcode: opcode::Write::CODE,
        name: "WRITE",
        only_for: OpFor::Loop,
        why: "loop target writes to its backing fd",
    },
    AllowedOp {
        opcode: opcode::ReadFixed::CODE,
        name: "READ_FIXED",
        only_for: OpFor::Loop,
        why: "zero-copy loop target reads into a request's pages the kernel registered",
    },
    AllowedOp {
        opcode: opcode::WriteFixed::CODE,
        name: "WRITE_FIXED",
        only_for: OpFor::Loop,
        why: "zero-copy loop target writes from a request's pages the kernel registered",
    },
    AllowedOp {
        opcode: opcode::Fsync::CODE,
        name: "FSYNC",
        only_for: OpFor::Loop,
        why: "loop target FLUSH (fdatasync)",
    },
    AllowedOp {
        opcode: opcode::Fallocate::CODE,
        name: "FALLOCATE",
        only_for: OpFor::Loop,
        why: "loop target DISCARD/WRITE_ZEROES (punch hole)",
    },
    AllowedOp {
        opcode: opcode::Writev::CODE,
        name: "WRITEV",
        only_for: OpFor::Nbd,
        why: "nbd target: requests (and a WRITE's data) on the socket ublkd connected, \
              as a gathered write: never SENDMSG, whose control messages could pass a \
              descriptor to the server; the worker opens and connects no socket (no \
              SOCKET or CONNECT here)",
    },
    AllowedOp {
        opcode: opcode::Send::CODE,
        name: "SEND",
        only_for: OpFor::Nbd,
        why: "zero-copy nbd target: a WRITE's data from the request's registered pages on \
              a socket ublkd connected (a WRITEV cannot take a registered buffer); like \
              WRITEV it carries no control message, and the worker has no socket without \
              a peer for a destination address to matter",
    },
    AllowedOp {
        opcode: opcode::Recv::CODE,
        name: "RECV",
        only_for: OpFor::Nbd,
        why: "nbd target: replies (and a READ's data) on the socket ublkd connected",
    },
    AllowedOp {
        opcode: opcode::MsgRingData::CODE,
        name: "MSG_RING",
        only_for: OpFor::Nbd,
        why: "nbd target: a connection's reader posting a reply's result into the ring of \
              the queue thread that sent the request; MSG_RING's other command, passing a \
              registered file, would pass only files this worker already has",
    },
];

/// One allowed `io_uring_register` operation on an enabled ring.
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)]
pub struct AllowedRegisterOp {
    pub opcode: u8,
    pub name: &'static str,
    pub why: &'static str,
}

/// The only `io_uring_register(2)` operations an enabled ring accepts
/// (`IORING_RESTRICTION_REGISTER_OP`), from the worker and from the supervisor alike.
/// Everything the rings need before they run (the file table, the target's file, the
/// FETCH buffer rings, the zero-copy buffer table, the restrictions themselves,
/// ENABLE_RINGS) is registered while the ring is still disabled, which the kernel
/// exempts from its own register restrictions. So no PERSONALITY (running requests
/// with other credentials), PBUF_RING, BUFFERS, FILES, EVENTFD, IOWQ_*, RESTRICTIONS
/// again, MEM_REGION, ZCRX, BPF_FILTER, RESIZE_RINGS, CLONE_BUFFERS, …
pub const URING_REGISTER_OPS: &[AllowedRegisterOp] = &[
    AllowedRegisterOp {
        opcode: uapi::IORING_REGISTER_FILES_UPDATE as u8,
        name: "REGISTER_FILES_UPDATE",
        why: "activation: /dev/ublkcN into the slot kept free for it while standing by",
    },
    AllowedRegisterOp {
        opcode: uapi::IORING_UNREGISTER_BUFFERS as u8,
        name: "UNREGISTER_BUFFERS",
        why: "recovery.fast_release: the supervisor, on its copy of a dead worker's ring, \
              lets go of the requests' pages (zero copy) so the device is released at once",
    },
    AllowedRegisterOp {
        opcode: uapi::IORING_UNREGISTER_FILES as u8,
        name: "UNREGISTER_FILES",
        why: "recovery.fast_release: the supervisor, on its copy of a dead worker's ring, \
              drops /dev/ublkcN so the device is released at once",
    },
];

/// SQE flags the ring accepts: fixed files (every fd the data path uses is registered),
/// buffer selection (multishot FETCH), skipping a successful completion (a one-element
/// COMMIT, which can only succeed whole or fail) and linking (a zero-copy nbd batch:
/// its WRITEVs and SENDs run one after the other, in stream order; a link only orders
/// operations the ring already allows).
pub const URING_SQE_FLAGS: u8 = io_uring::squeue::Flags::FIXED_FILE.bits()
    | io_uring::squeue::Flags::BUFFER_SELECT.bits()
    | io_uring::squeue::Flags::SKIP_SUCCESS.bits()
    | io_uring::squeue::Flags::IO_LINK.bits();

/// `RLIMIT_NOFILE`: the worker holds a handful of fds (control socket, device,
/// region, target, one ring per thread).
pub const MAX_FDS: u64 = 128;
/// `RLIMIT_NOFILE` of an rbd worker: librados holds a connection per monitor and per
/// OSD it talks to (up to every OSD of a large cluster), plus its event loops' epoll
/// fds, pipes and eventfds.
pub const MAX_FDS_RBD: u64 = 4096;
/// `RLIMIT_MEMLOCK`: the worker locks nothing itself; rings are charged to its cgroup.
pub const MAX_LOCKED_BYTES: u64 = 8 << 20;
