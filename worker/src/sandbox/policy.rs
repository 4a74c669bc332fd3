//! The worker's sandbox policy, as data: every system call and io_uring operation a
//! sandboxed worker may use, each with the reason it needs it. A reviewer reads this
//! file; the rest of the sandbox module only applies it.
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

/// One allowed system call, with the arguments it is allowed with. `name` (the `libc`
/// constant's: `SYS_read`) and `why` are for the reader (and the tests).
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
    /// Calls whose argument `arg`, masked with `mask`, is one of `values`.
    ArgMaskedIn { arg: u8, mask: u64, values: &'static [u64] },
    /// Calls whose argument `arg` (a C `int`) is none of `values`.
    ArgNotIn { arg: u8, values: &'static [u64] },
}

// The tables below are written with these macros so that each entry is what a reviewer
// checks and nothing else: its reason, as a doc comment, then what it allows. The
// reason is kept (`why`) for the tests, which require one of every entry.

/// A list of [`Allowed`] system calls: `SYS_name` (the `libc` constant), and after
/// `if` which calls of it ([`Only`]; every call where there is no `if`).
macro_rules! syscalls {
    (@only) => { Only::Any };
    (@only $only:expr) => { $only };
    ($($(#[doc = $why:literal])+ $nr:ident $(if $only:expr)?,)*) => {
        &[$(Allowed {
            nr: libc::$nr,
            name: stringify!($nr),
            only: syscalls!(@only $($only)?),
            why: concat!($($why),+).trim_ascii(),
        }),*]
    };
}

/// A list of [`RefusedCall`]s: `SYS_name`, which calls of it as in `syscalls!`, and
/// after `=>` the `libc` errno they fail with.
macro_rules! refused_calls {
    ($($(#[doc = $why:literal])+ $nr:ident $(if $only:expr)? => $errno:ident,)*) => {
        &[$(RefusedCall {
            nr: libc::$nr,
            name: stringify!($nr),
            only: syscalls!(@only $($only)?),
            errno: libc::$errno as u32,
            why: concat!($($why),+).trim_ascii(),
        }),*]
    };
}

/// A list of [`AllowedOp`]s: the `io_uring::opcode` type, `as` the kernel's name for
/// it, `for` the targets whose rings allow it ([`OpFor`]).
macro_rules! uring_ops {
    ($($(#[doc = $why:literal])+ $op:ident as $name:ident for $for:ident,)*) => {
        &[$(AllowedOp {
            opcode: opcode::$op::CODE,
            name: stringify!($name),
            only_for: OpFor::$for,
            why: concat!($($why),+).trim_ascii(),
        }),*]
    };
}

/// A list of [`AllowedRegisterOp`]s: the `io_uring_register(2)` opcode, as
/// [`ublkd_proto::uapi`] names it.
macro_rules! register_ops {
    ($($(#[doc = $why:literal])+ $op:ident,)*) => {
        &[$(AllowedRegisterOp {
            opcode: uapi::$op as u8,
            name: stringify!($op),
            why: concat!($($why),+).trim_ascii(),
        }),*]
    };
}

/// `mmap`'s and `mprotect`'s `prot` argument.
const PROT_ARG: u8 = 2;

/// Allowed for the worker's whole life once sandboxed.
pub const ALWAYS: &[Allowed] = syscalls![
    /// reading an fd the supervisor gave (rare; kept for std's fallbacks)
    SYS_read,
    /// log lines to stderr (a pipe ublkd relays to its log)
    SYS_write,
    /// log lines to stderr, as the logger writes them
    SYS_writev,
    /// dropping fds it no longer needs
    SYS_close,
    /// messages and fds from the supervisor (SCM_RIGHTS)
    SYS_recvmsg,
    /// answers to the supervisor
    SYS_sendmsg,
    /// descriptor arrays, the shared region, memory target, buffers, thread stacks; never
    /// executable: the worker loads no code once sandboxed
    SYS_mmap if Only::ArgLacks { arg: PROT_ARG, mask: libc::PROT_EXEC as u64 },
    /// freeing mappings (allocator, thread stacks)
    SYS_munmap,
    /// guard pages of thread stacks; never making memory executable
    SYS_mprotect if Only::ArgLacks { arg: PROT_ARG, mask: libc::PROT_EXEC as u64 },
    /// the allocator growing large blocks
    SYS_mremap,
    /// the allocator returning memory
    SYS_madvise,
    /// the allocator's heap
    SYS_brk,
    /// locks, channels and thread joins
    SYS_futex,
    /// the data path: submit and wait on each thread's ring
    SYS_io_uring_enter,
    /// registering files, FETCH buffer rings and restrictions while a ring is disabled; once
    /// enabled, the ring itself allows only URING_REGISTER_OPS
    SYS_io_uring_register,
    /// sizes of the target's fd and the shared region
    SYS_fstat,
    /// fstat as glibc issues it: AT_EMPTY_PATH on an fd (a path would still be looked up, in the
    /// empty root, where there is nothing to find)
    SYS_newfstatat if Only::ArgHas { arg: 3, mask: libc::AT_EMPTY_PATH as u64 },
    /// file metadata of a given fd (std's File::metadata: AT_EMPTY_PATH; a path would still be
    /// looked up, in the empty root)
    SYS_statx if Only::ArgHas { arg: 2, mask: libc::AT_EMPTY_PATH as u64 },
    /// size of a block device behind the loop target's fd
    SYS_lseek,
    /// std duplicating fds with F_DUPFD_CLOEXEC (try_clone of the region's and the target's fds),
    /// and std's check that an fd is open before it closes it (F_GETFD, which only reads the
    /// close-on-exec flag; debug builds); no other command
    SYS_fcntl if Only::ArgIn {
        arg: 1,
        values: &[libc::F_DUPFD_CLOEXEC as u64, libc::F_GETFD as u64],
    },
    /// waiting on the control socket
    SYS_ppoll,
    /// waiting on the control socket
    SYS_poll,
    /// the thread id it reports in the shared region
    SYS_gettid,
    /// logging
    SYS_getpid,
    /// timestamps (when the vDSO falls back to the syscall)
    SYS_clock_gettime,
    /// short sleeps
    SYS_clock_nanosleep,
    /// short sleeps
    SYS_nanosleep,
    /// spin loops in locks
    SYS_sched_yield,
    /// std asking how many CPUs there are
    SYS_sched_getaffinity,
    /// std masking signals around thread creation
    SYS_rt_sigprocmask,
    /// returning from the SIGSYS handler's frame
    SYS_rt_sigreturn,
    /// std's signal setup in new threads (dropping the SIGSYS handler only makes a trap kill the
    /// worker outright)
    SYS_rt_sigaction,
    /// std's per-thread signal stacks
    SYS_sigaltstack,
    /// std's hash seeds
    SYS_getrandom,
    /// a thread ending
    SYS_exit,
    /// the worker ending
    SYS_exit_group,
    /// std: a thread that calls exit while another thread exits waits here for its end
    SYS_pause,
    /// std naming threads (PR_SET_NAME); no other option
    SYS_prctl if Only::ArgIn { arg: 0, values: &[libc::PR_SET_NAME as u64] },
    /// glibc's per-thread setup
    SYS_set_robust_list,
    /// glibc's per-thread setup
    SYS_rseq,
];

/// Allowed only while the worker sets up (until its rings exist and its threads run).
pub const SETUP_ONLY: &[Allowed] = syscalls![
    /// one ring per queue thread, created while standing by
    SYS_io_uring_setup,
    /// starting the queue threads
    SYS_clone3,
    /// pinning a queue thread to its CPU
    SYS_sched_setaffinity,
    /// starting the queue threads (older glibc)
    SYS_clone,
    /// installing stage 2 of this very filter
    SYS_seccomp,
    /// seccompiler sets no_new_privs (already set) before it installs stage 2
    SYS_prctl if Only::ArgIn { arg: 0, values: &[libc::PR_SET_NO_NEW_PRIVS as u64] },
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
pub const RBD_ALWAYS: &[Allowed] = syscalls![
    /// librados and librbd starting their threads (messenger workers, timers, finishers, asio) at
    /// any time: a thread of this process only (CLONE_THREAD, which the kernel allows only with
    /// CLONE_VM and CLONE_SIGHAND), with no new namespace; clone3 is refused with ENOSYS
    /// (RBD_REFUSED), on which glibc retries with clone
    SYS_clone if Only::ArgMasked {
        arg: 0,
        mask: libc::CLONE_THREAD as u64 | CLONE_NAMESPACES,
        value: libc::CLONE_THREAD as u64,
    },
    /// let through here only to be refused with ENOSYS by RBD_REFUSED (its flags are in memory,
    /// which seccomp cannot read); trapping it would end the worker
    SYS_clone3,
    /// librados's connections to the cluster's monitors and OSDs: IPv4 or IPv6 only (no unix,
    /// netlink or packet socket); of those, stream TCP only (RBD_REFUSED fails the others)
    SYS_socket if Only::ArgIn { arg: 0, values: &[libc::AF_INET as u64, libc::AF_INET6 as u64] },
    /// librados connecting to a monitor or an OSD
    SYS_connect,
    /// librados learning its own address
    SYS_getsockname,
    /// librados setting TCP_NODELAY on its connections
    SYS_setsockopt,
    /// librados closing a connection
    SYS_shutdown,
    /// librados's messenger event loops
    SYS_epoll_create,
    /// librbd's asio event loop
    SYS_epoll_create1,
    /// librados's and librbd's event loops
    SYS_epoll_ctl,
    /// librados's and librbd's event loops
    SYS_epoll_wait,
    /// librados's messenger waking its event loops
    SYS_pipe2,
    /// librbd's asio waking its event loop; the target's per-thread completion eventfds
    SYS_eventfd2,
    /// librbd's asio timers
    SYS_timerfd_create,
    /// librbd's asio timers
    SYS_timerfd_settime,
    /// librados naming its host in its client metadata
    SYS_uname,
    /// librados making its sockets and pipes non-blocking (F_GETFL, F_SETFL) and close-on-exec
    /// (F_SETFD)
    SYS_fcntl if Only::ArgIn {
        arg: 1,
        values: &[libc::F_GETFL as u64, libc::F_SETFL as u64, libc::F_SETFD as u64],
    },
    /// let through here only to be refused with ENOENT by RBD_REFUSED, before the kernel sees it
    SYS_openat,
    /// of a path: let through here only to be refused with ENOENT by RBD_REFUSED
    SYS_statx,
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
pub const RBD_REFUSED: &[RefusedCall] = refused_calls![
    /// every open: librados's OpenSSL reading /usr/lib/ssl/openssl.cnf (it runs without), glibc
    /// reading /etc/localtime (UTC then) and /sys/devices/system/cpu/online (it counts CPUs
    /// otherwise), librados naming a thread through /proc/self/task/N/comm (left unnamed)
    SYS_openat => ENOENT,
    /// of a path: librados looking for /sys/fs/cgroup/cpu/ (a CPU quota; none then)
    SYS_statx if Only::ArgLacks { arg: 2, mask: libc::AT_EMPTY_PATH as u64 } => ENOENT,
    /// its flags are in memory seccomp cannot read: glibc retries with clone, whose flags
    /// RBD_ALWAYS checks
    SYS_clone3 => ENOSYS,
    /// an IPv4 or IPv6 socket that is not a stream (UDP, ICMP, raw, SCTP's seqpacket): librados
    /// speaks TCP only, and a datagram socket could reach any address and port Landlock's TCP
    /// rules do not cover; an error, not a trap, so that a library that probes goes on
    SYS_socket if Only::ArgMaskedIn {
        arg: 1,
        mask: SOCK_TYPE_MASK,
        values: &[0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    } => EPERM,
    /// a stream socket of another protocol than TCP (MPTCP, SCTP): only TCP is what Landlock's
    /// port rules govern
    SYS_socket if Only::ArgNotIn { arg: 2, values: &[0, libc::IPPROTO_TCP as u64] } => EPERM,
];

/// The bits of socket(2)'s `type` that name the type, below `SOCK_NONBLOCK` and
/// `SOCK_CLOEXEC` (the kernel's `SOCK_TYPE_MASK`).
const SOCK_TYPE_MASK: u64 = 0xf;

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
pub const URING_OPS: &[AllowedOp] = uring_ops![
    /// ublk PREP/FETCH/COMMIT on /dev/ublkcN
    UringCmd16 as URING_CMD for Every,
    /// loop target reads from its backing fd
    Read as READ for Loop,
    /// rbd target: each queue thread waiting on its own eventfd (registered in its ring, the only
    /// file the ring reaches but /dev/ublkcN), which librbd's completion callback writes
    Read as READ for Rbd,
    /// loop target writes to its backing fd
    Write as WRITE for Loop,
    /// zero-copy loop target reads into a request's pages the kernel registered
    ReadFixed as READ_FIXED for Loop,
    /// zero-copy loop target writes from a request's pages the kernel registered
    WriteFixed as WRITE_FIXED for Loop,
    /// loop target FLUSH (fdatasync)
    Fsync as FSYNC for Loop,
    /// loop target DISCARD/WRITE_ZEROES (punch hole)
    Fallocate as FALLOCATE for Loop,
    /// nbd target: requests (and a WRITE's data) on the socket ublkd connected, as a gathered
    /// write: never SENDMSG, whose control messages could pass a descriptor to the server; the
    /// worker opens and connects no socket (no SOCKET or CONNECT here)
    Writev as WRITEV for Nbd,
    /// zero-copy nbd target: a WRITE's data from the request's registered pages on a socket ublkd
    /// connected (a WRITEV cannot take a registered buffer); like WRITEV it carries no control
    /// message, and the worker has no socket without a peer for a destination address to matter
    Send as SEND for Nbd,
    /// nbd target: replies (and a READ's data) on the socket ublkd connected
    Recv as RECV for Nbd,
    /// nbd target: a connection's reader posting a reply's result into the ring of the queue thread
    /// that sent the request; MSG_RING's other command, passing a registered file, would pass only
    /// files this worker already has
    MsgRingData as MSG_RING for Nbd,
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
pub const URING_REGISTER_OPS: &[AllowedRegisterOp] = register_ops![
    /// activation: /dev/ublkcN into the slot kept free for it while standing by
    IORING_REGISTER_FILES_UPDATE,
    /// recovery.fast_release: the supervisor, on its copy of a dead worker's ring, lets go of the
    /// requests' pages (zero copy) so the device is released at once
    IORING_UNREGISTER_BUFFERS,
    /// recovery.fast_release: the supervisor, on its copy of a dead worker's ring, drops
    /// /dev/ublkcN so the device is released at once
    IORING_UNREGISTER_FILES,
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
