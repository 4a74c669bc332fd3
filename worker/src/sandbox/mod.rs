//! The worker's sandbox: what a compromised worker can reach is its own device's fds
//! and nothing else. [`policy`] lists what is allowed and why; this module applies it,
//! always in this order, before the worker reads anything from the supervisor:
//!
//! 1. fds: everything but stdio and the control socket is closed (`close_range`).
//! 2. rlimits: `NOFILE`, `CORE` 0, `MEMLOCK` lowered (raising them back needs a
//!    capability the worker no longer has). `NPROC` is left alone on purpose: io_uring
//!    starts its io-wq kernel threads (fsync, fallocate, buffered loop I/O) as the
//!    worker's user, so a low limit would starve the data path; thread creation is
//!    closed by seccomp stage 2 instead.
//! 3. identity: supplementary groups cleared, then gid and uid set to the dedicated
//!    unprivileged user, after the capability bounding set was emptied.
//! 4. namespaces: new user, mount, network, IPC, UTS and cgroup namespaces (the user
//!    namespace maps only the worker's own uid/gid); where the kernel refuses user
//!    namespaces, the worker goes on without them and says so.
//! 5. root: an empty read-only tmpfs becomes `/` (pivot_root), the old root is
//!    detached.
//! 6. `no_new_privs`.
//! 7. Landlock: every filesystem access right handled, none granted.
//! 8. capabilities: every set emptied (effective, permitted, inheritable, ambient, and
//!    the namespace's bounding set).
//! 9. seccomp, stage 1: [`policy::ALWAYS`] plus [`policy::SETUP_ONLY`]; anything else
//!    traps and the worker exits [`EXIT_SECCOMP`].
//!
//! While standing by, the worker creates every queue thread and its ring, restricted
//! to [`policy::URING_OPS`] and enabled ([`restrict_ring`]) before it runs anything,
//! then seccomp stage 2 ([`lock_down`]) drops `io_uring_setup` and thread creation for
//! all threads, before the worker ever sees the device. At activation each ring gets
//! `/dev/ublkcN` as a registered file.
//!
//! What it costs: the kernel suppresses partition scanning for a device whose tags were
//! PREPed by a task without CAP_SYS_ADMIN (ublk's `unprivileged_daemons`), so a
//! sandboxed device shows no partitions (`/dev/ublkbNpM`). ublkd keeps that kernel
//! protection: a device whose partitions are needed runs with `sandbox = false`.
//!
//! Not done: a pid namespace. The worker would have to fork after `unshare` to enter
//! one, and the supervisor watches the worker itself by pidfd; other processes are
//! already out of reach (another uid, no capabilities, no `kill`/`ptrace` syscalls).

pub mod policy;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;

use io_uring::{IoUring, cqueue, squeue};
use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, SeccompRule, TargetArch};
use ublkd_proto::msg::SandboxReport as Report;

/// The worker's exit code after a system call outside the policy.
pub const EXIT_SECCOMP: i32 = 159;

/// Who the worker becomes.
#[derive(Debug, Clone, Copy)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
}

/// Errors applying the sandbox (the worker then refuses to run).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox step {step} failed: {source}")]
    Step { step: &'static str, source: io::Error },
    #[error("cannot build the seccomp filter: {0}")]
    Seccomp(String),
    #[error("cannot apply Landlock: {0}")]
    Landlock(String),
    #[error("cannot drop capabilities: {0}")]
    Caps(String),
}

fn check(step: &'static str, rc: libc::c_int) -> Result<(), SandboxError> {
    if rc < 0 {
        Err(SandboxError::Step { step, source: io::Error::last_os_error() })
    } else {
        Ok(())
    }
}

/// Applies steps 1–9. `keep_fd` is the control socket.
pub fn apply(id: Identity, keep_fd: i32) -> Result<Report, SandboxError> {
    let mut report = Report::default();
    close_other_fds(keep_fd)?;
    set_rlimits()?;
    become_user(id)?;
    match enter_namespaces(id)? {
        Ok(names) => {
            report.namespaces = names;
            pivot_to_empty_root()?;
        }
        Err(refused) => report.namespaces_note = Some(format!("no namespaces: {refused}")),
    }
    // SAFETY: prctl with PR_SET_NO_NEW_PRIVS takes integer arguments only.
    check("no_new_privs", unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
    report.landlock_abi = apply_landlock()?;
    drop_capabilities()?;
    install_sigsys_handler()?;
    apply_seccomp(true)?;
    Ok(report)
}

fn close_other_fds(keep_fd: i32) -> Result<(), SandboxError> {
    // Keep 0, 1, 2 and the control socket (the supervisor puts it at 3).
    let first = (keep_fd + 1) as libc::c_uint;
    // SAFETY: close_range takes integers and only closes fds of this process; nothing
    // else in the process owns fds above the control socket at this point.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, libc::c_uint::MAX, 0) };
    check("close_range", rc as libc::c_int)
}

fn set_rlimits() -> Result<(), SandboxError> {
    let set = |step, resource, value: u64| {
        let lim = libc::rlimit { rlim_cur: value, rlim_max: value };
        // SAFETY: `lim` is a valid rlimit for the duration of the call.
        check(step, unsafe { libc::setrlimit(resource, &lim) })
    };
    set("RLIMIT_NOFILE", libc::RLIMIT_NOFILE, policy::MAX_FDS)?;
    set("RLIMIT_CORE", libc::RLIMIT_CORE, 0)?;
    set("RLIMIT_MEMLOCK", libc::RLIMIT_MEMLOCK, policy::MAX_LOCKED_BYTES)
}

fn become_user(id: Identity) -> Result<(), SandboxError> {
    // The bounding set can only be emptied while the worker still holds CAP_SETPCAP.
    caps::clear(None, caps::CapSet::Bounding).map_err(|e| SandboxError::Caps(e.to_string()))?;
    // SAFETY: setgroups with a zero length reads no memory.
    check("setgroups", unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: integer arguments only.
    check("setresgid", unsafe { libc::setresgid(id.gid, id.gid, id.gid) })?;
    // SAFETY: integer arguments only. Changing every uid away from 0 clears the
    // permitted, effective and ambient capability sets.
    check("setresuid", unsafe { libc::setresuid(id.uid, id.uid, id.uid) })
}

/// Enters the namespaces. `Ok(Err(why))` when the kernel refuses them (the worker
/// goes on without); `Err` when they were entered but could not be set up.
fn enter_namespaces(id: Identity) -> Result<Result<Vec<String>, io::Error>, SandboxError> {
    let flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP;
    // SAFETY: unshare takes flags only; the process is single-threaded here, as
    // CLONE_NEWUSER requires.
    if unsafe { libc::unshare(flags) } < 0 {
        return Ok(Err(io::Error::last_os_error()));
    }
    // Changing uid made the process non-dumpable, which leaves its /proc files to
    // root: writable again for the maps, then closed again (another worker runs as
    // the same user).
    // SAFETY: integer arguments only.
    check("set dumpable", unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) })?;
    let write = |path: &'static str, text: String| {
        std::fs::write(path, text).map_err(|source| SandboxError::Step { step: path, source })
    };
    write("/proc/self/setgroups", "deny".into())?;
    write("/proc/self/gid_map", format!("{0} {0} 1\n", id.gid))?;
    write("/proc/self/uid_map", format!("{0} {0} 1\n", id.uid))?;
    // SAFETY: integer arguments only.
    check("clear dumpable", unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })?;
    Ok(Ok(["user", "mnt", "net", "ipc", "uts", "cgroup"].map(String::from).to_vec()))
}

fn pivot_to_empty_root() -> Result<(), SandboxError> {
    let c = |s: &str| CString::new(s).expect("no NUL");
    let (root, tmpfs, opts) = (c("/"), c("tmpfs"), c("size=4k,nr_inodes=2,mode=0555"));
    // SAFETY: all pointers are valid NUL-terminated strings or null, for the call.
    check("make / private", unsafe {
        libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    })?;
    // The new root is mounted over an existing directory, then becomes `/`.
    let mount_point = ["/tmp", "/mnt", "/run", "/var"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_dir())
        .ok_or_else(|| SandboxError::Step {
            step: "find a mount point",
            source: io::ErrorKind::NotFound.into(),
        })?;
    let target = c(mount_point);
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_RDONLY;
    // SAFETY: valid NUL-terminated strings, for the call.
    check("mount the empty root", unsafe {
        libc::mount(tmpfs.as_ptr(), target.as_ptr(), tmpfs.as_ptr(), flags, opts.as_ptr().cast())
    })?;
    // SAFETY: valid NUL-terminated string.
    check("chdir to the new root", unsafe { libc::chdir(target.as_ptr()) })?;
    let dot = c(".");
    // pivot_root(".", ".") stacks the old root under the new one; detaching "." then
    // removes the old root from this mount namespace.
    // SAFETY: valid NUL-terminated strings.
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    check("pivot_root", rc as libc::c_int)?;
    // SAFETY: valid NUL-terminated string.
    check("detach the old root", unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) })?;
    // SAFETY: valid NUL-terminated string.
    check("chdir /", unsafe { libc::chdir(root.as_ptr()) })
}

fn apply_landlock() -> Result<Option<u8>, SandboxError> {
    use landlock::{ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetStatus};
    let abi = ABI::V5;
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.create())
        .and_then(|r| r.restrict_self())
        .map_err(|e| SandboxError::Landlock(e.to_string()))?;
    Ok(match status.ruleset {
        RulesetStatus::NotEnforced => None,
        RulesetStatus::FullyEnforced | RulesetStatus::PartiallyEnforced => Some(landlock_abi()),
    })
}

/// The kernel's Landlock ABI version.
fn landlock_abi() -> u8 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with the VERSION flag, landlock_create_ruleset reads no memory.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    u8::try_from(v).unwrap_or(0)
}

fn drop_capabilities() -> Result<(), SandboxError> {
    let e = |e: caps::errors::CapsError| SandboxError::Caps(e.to_string());
    caps::clear(None, caps::CapSet::Ambient).map_err(e)?;
    caps::clear(None, caps::CapSet::Bounding).map_err(e)?;
    caps::clear(None, caps::CapSet::Inheritable).map_err(e)?;
    caps::clear(None, caps::CapSet::Effective).map_err(e)?;
    caps::clear(None, caps::CapSet::Permitted).map_err(e)
}

/// On a trapped system call: say which, with its first three arguments (what an
/// argument filter looked at), and exit with [`EXIT_SECCOMP`].
extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // siginfo_t for SIGSYS carries the syscall number at byte offset 24 on x86_64
    // (`si_syscall`, after si_call_addr), which the libc crate does not expose.
    // SAFETY: the kernel passes a valid siginfo_t for a SA_SIGINFO handler.
    let nr = unsafe { *(info.cast::<u8>().add(24).cast::<libc::c_int>()) };
    // SAFETY: for a SA_SIGINFO handler the third argument is the interrupted context;
    // at a seccomp trap its registers hold the system call's arguments.
    let gregs = unsafe { (*ctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs };
    let args = [libc::REG_RDI, libc::REG_RSI, libc::REG_RDX].map(|r| gregs[r as usize] as u64);
    let mut msg = [0u8; 128];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        msg[len..len + bytes.len()].copy_from_slice(bytes);
        len += bytes.len();
    };
    put(b"ublkd-worker: sandbox: blocked system call ");
    let mut digits = [b'0'; 4];
    let mut n = nr.unsigned_abs();
    for d in digits.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    put(&digits);
    put(b" (args");
    for arg in args {
        let mut hex = *b" 0x0000000000000000";
        for (i, h) in hex[3..].iter_mut().enumerate() {
            *h = b"0123456789abcdef"[((arg >> (60 - 4 * i)) & 0xf) as usize];
        }
        put(&hex);
    }
    put(b")\n");
    // SAFETY: write and _exit are async-signal-safe; `msg[..len]` is initialised.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), len);
        libc::_exit(EXIT_SECCOMP);
    }
}

fn install_sigsys_handler() -> Result<(), SandboxError> {
    // SAFETY: a zeroed sigaction is valid; we set the handler and flags below.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = on_sigsys;
    sa.sa_sigaction = handler as usize;
    sa.sa_flags = libc::SA_SIGINFO;
    // SAFETY: `sa` is a valid sigaction for the call; the handler is async-signal-safe.
    check("sigaction(SIGSYS)", unsafe { libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) })
}

/// The seccomp rule that lets through the calls `only` describes (`None`: all).
fn rule_of(only: policy::Only) -> Result<Option<Vec<SeccompRule>>, SandboxError> {
    use seccompiler::{SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond};
    let err = |e: seccompiler::BackendError| SandboxError::Seccomp(e.to_string());
    let one = |arg: u8, len: Len, op: Op, value: u64| -> Result<SeccompRule, SandboxError> {
        SeccompRule::new(vec![Cond::new(arg, len, op, value).map_err(err)?]).map_err(err)
    };
    Ok(Some(match only {
        policy::Only::Any => return Ok(None),
        policy::Only::ArgIn { arg, values } => {
            values.iter().map(|&v| one(arg, Len::Dword, Op::Eq, v)).collect::<Result<_, _>>()?
        }
        policy::Only::ArgLacks { arg, mask } => vec![one(arg, Len::Qword, Op::MaskedEq(mask), 0)?],
        policy::Only::ArgHas { arg, mask } => {
            vec![one(arg, Len::Qword, Op::MaskedEq(mask), mask)?]
        }
    }))
}

fn filter(setup: bool) -> Result<BpfProgram, SandboxError> {
    // Per system call: `None` once any entry allows every call, else the union of the
    // entries' rules.
    let mut allowed: BTreeMap<i64, Option<Vec<SeccompRule>>> = BTreeMap::new();
    let lists: &[&[policy::Allowed]] =
        if setup { &[policy::ALWAYS, policy::SETUP_ONLY] } else { &[policy::ALWAYS] };
    for a in lists.iter().flat_map(|l| l.iter()) {
        let rule = rule_of(a.only)?;
        match (allowed.entry(a.nr).or_insert_with(|| Some(Vec::new())), rule) {
            (slot, None) => *slot = None,
            (Some(rules), Some(more)) => rules.extend(more),
            (None, Some(_)) => {}
        }
    }
    // seccompiler: an empty rule list allows every call.
    let rules = allowed.into_iter().map(|(nr, r)| (nr, r.unwrap_or_default())).collect();
    let f =
        SeccompFilter::new(rules, SeccompAction::Trap, SeccompAction::Allow, TargetArch::x86_64)
            .map_err(|e| SandboxError::Seccomp(e.to_string()))?;
    f.try_into().map_err(|e: seccompiler::BackendError| SandboxError::Seccomp(e.to_string()))
}

fn apply_seccomp(setup: bool) -> Result<(), SandboxError> {
    let prog = filter(setup)?;
    let apply =
        if setup { seccompiler::apply_filter } else { seccompiler::apply_filter_all_threads };
    apply(&prog).map_err(|e| SandboxError::Seccomp(e.to_string()))
}

/// Seccomp stage 2, for every thread: no new rings, no new threads.
pub fn lock_down() -> Result<(), SandboxError> {
    apply_seccomp(false)
}

/// Restricts a ring created disabled (after its files and buffer rings are
/// registered) to [`policy::URING_OPS`] and, once enabled, to
/// [`policy::URING_REGISTER_OPS`], and enables it.
pub fn restrict_ring(ring: &IoUring<squeue::Entry, cqueue::Entry>) -> io::Result<()> {
    use io_uring::register::Restriction;
    let mut restrictions: Vec<Restriction> = policy::URING_OPS
        .iter()
        .map(|op| Restriction::sqe_op(op.opcode))
        .chain(policy::URING_REGISTER_OPS.iter().map(|op| Restriction::register_op(op.opcode)))
        .collect();
    restrictions.push(Restriction::sqe_flags_allowed(policy::URING_SQE_FLAGS));
    ring.submitter().register_restrictions(&mut restrictions)?;
    ring.submitter().register_enable_rings()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ublkd_proto::uapi;

    #[test]
    fn policy_lists_have_no_duplicates_and_every_entry_has_a_reason() {
        let mut seen = std::collections::BTreeSet::new();
        for a in policy::ALWAYS.iter().chain(policy::SETUP_ONLY) {
            assert!(seen.insert((a.nr, format!("{:?}", a.only))), "{} listed twice", a.name);
            assert!(!a.why.is_empty(), "{} has no reason", a.name);
        }
        for forbidden in [
            libc::SYS_openat,
            libc::SYS_execve,
            libc::SYS_socket,
            libc::SYS_ptrace,
            libc::SYS_kill,
            libc::SYS_setrlimit,
            libc::SYS_prlimit64,
            libc::SYS_io_uring_setup,
        ] {
            assert!(
                !policy::ALWAYS.iter().any(|a| a.nr == forbidden),
                "syscall {forbidden} must not be allowed after setup"
            );
        }
    }

    #[test]
    fn arguments_are_filtered_where_the_reasons_say_so() {
        let only =
            |nr| policy::ALWAYS.iter().find(|a| a.nr == nr).map(|a| a.only).expect("allowed");
        let no_exec = policy::Only::ArgLacks { arg: 2, mask: libc::PROT_EXEC as u64 };
        assert_eq!(only(libc::SYS_mmap), no_exec);
        assert_eq!(only(libc::SYS_mprotect), no_exec);
        assert_eq!(
            only(libc::SYS_prctl),
            policy::Only::ArgIn { arg: 0, values: &[libc::PR_SET_NAME as u64] }
        );
        let empty_path = libc::AT_EMPTY_PATH as u64;
        assert_eq!(only(libc::SYS_statx), policy::Only::ArgHas { arg: 2, mask: empty_path });
        assert_eq!(only(libc::SYS_newfstatat), policy::Only::ArgHas { arg: 3, mask: empty_path });
    }

    #[test]
    fn an_enabled_ring_allows_no_register_op_that_adds_power() {
        for op in [
            uapi::IORING_REGISTER_PERSONALITY,
            22, // IORING_REGISTER_PBUF_RING
            11, // IORING_REGISTER_RESTRICTIONS
            0,  // IORING_REGISTER_BUFFERS
            2,  // IORING_REGISTER_FILES
        ] {
            assert!(
                !policy::URING_REGISTER_OPS.iter().any(|o| u32::from(o.opcode) == op),
                "register op {op} allowed"
            );
        }
    }

    #[test]
    fn both_filter_stages_compile() {
        assert!(!filter(true).unwrap().is_empty());
        assert!(filter(false).unwrap().len() < filter(true).unwrap().len());
    }

    #[test]
    fn the_ring_allows_no_opcode_that_opens_or_connects() {
        for op in [
            io_uring::opcode::OpenAt::CODE,
            io_uring::opcode::Connect::CODE,
            io_uring::opcode::Socket::CODE,
        ] {
            assert!(!policy::URING_OPS.iter().any(|o| o.opcode == op), "opcode {op} allowed");
        }
    }
}
