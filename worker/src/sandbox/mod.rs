//! The worker's sandbox: what a compromised worker can reach is its own device's fds
//! and nothing else. [`policy`] lists what is allowed and why; this module applies it
//! (the namespaces and the empty root in `namespaces`, Landlock in `landlock`, the
//! seccomp filters in `seccomp`), always in this order, before the worker reads
//! anything from the supervisor:
//!
//! 1. fds: everything but stdio and the control socket is closed (`close_range`).
//! 2. rlimits: `NOFILE`, `CORE` 0, `MEMLOCK` lowered (raising them back needs a
//!    capability the worker no longer has). `NPROC` is left alone on purpose: io_uring
//!    starts its io-wq kernel threads (fsync, fallocate, buffered loop I/O) as the
//!    worker's user, so a low limit would starve the data path; thread creation is
//!    closed by seccomp stage 2 instead.
//! 3. namespaces, still as root (which needs no user namespace for them): new mount,
//!    network, IPC, UTS and cgroup namespaces, each unshared on its own so that a
//!    refusal names the one refused.
//! 4. root: an empty read-only tmpfs becomes `/`: pivot_root, the old root detached;
//!    where `/` is not a mount point (ublkd runs in a chroot, where pivot_root is
//!    refused), chroot into a tmpfs attached nowhere, which only another chroot could
//!    leave (CAP_SYS_CHROOT, dropped below, and a call seccomp refuses).
//! 5. identity: supplementary groups cleared, then gid and uid set to the dedicated
//!    unprivileged user, after the capability bounding set was emptied.
//! 6. user namespace, entered as that user and mapping only its uid/gid. Entered last,
//!    it owns none of the namespaces above: those stay owned by the initial user
//!    namespace, where the worker holds no capability. (`/proc/self` is opened before
//!    step 4 to write its maps.)
//! 7. `no_new_privs`.
//! 8. Landlock: every filesystem access right handled, none granted.
//! 9. capabilities: every set emptied (effective, permitted, inheritable, ambient, and
//!    the namespace's bounding set).
//! 10. seccomp, stage 1: [`policy::ALWAYS`] plus [`policy::SETUP_ONLY`]; anything else
//!     traps and the worker exits [`EXIT_SECCOMP`].
//!
//! The sandbox fails closed: a layer the kernel refuses (the user namespace, the other
//! namespaces, the empty root, Landlock: [`SandboxLayer`]) makes the worker refuse to
//! run and tell the supervisor which and why, unless its device lists the layer in
//! `sandbox_optional`; then the worker runs without it and reports it missing (status
//! and a warning in the journal). Kernels refuse user namespaces inside a chroot and
//! where they are restricted (`user.max_user_namespaces=0`, Debian's
//! `kernel.unprivileged_userns_clone=0`, Ubuntu's AppArmor restriction).
//!
//! While standing by, the worker creates every queue thread and its ring, restricted
//! to [`policy::URING_OPS`] and [`policy::URING_REGISTER_OPS`] and enabled
//! ([`restrict_ring`]) before it runs anything,
//! then seccomp stage 2 ([`lock_down`]) drops `io_uring_setup` and thread creation for
//! all threads, before the worker ever sees the device. At activation each ring gets
//! `/dev/ublkcN` as a registered file.
//!
//! What it costs: the kernel suppresses partition scanning for a device whose tags were
//! PREPed by a task without CAP_SYS_ADMIN (ublk's `unprivileged_daemons`), so a
//! sandboxed device shows no partitions (`/dev/ublkbNpM`). ublkd keeps that kernel
//! protection: a device whose partitions are needed runs with `sandbox = false`.
//!
//! An rbd worker ([`Profile::Rbd`], `--rbd`) differs in four places, all for librbd,
//! which the worker loads before step 1: it keeps the host's network namespace (step
//! 3: librados connects to the cluster itself), its fd limit is higher (step 2: a
//! connection per OSD), and its seccomp policy adds [`policy::RBD_ALWAYS`] (sockets,
//! event loops, threads of its own at any time) and refuses [`policy::RBD_REFUSED`]
//! with an error (stage 1 and 2 alike), and Landlock also handles TCP (step 8): it may
//! connect only to the ports ublkd names (`--rbd-connect-ports`: the monitors' ports
//! and the OSDs' range, `ms_bind_port_min`..`ms_bind_port_max`) and bind none. The
//! addresses are the host's firewall's to limit (under systemd, the generator's
//! `IPAddressAllow=`). No file is reachable, as for every worker. A kernel whose
//! Landlock has no TCP control (ABI below 4) enforces the file rules only: the worker
//! then misses the layer `landlock-tcp` ([`SandboxLayer::LandlockTcp`]), and fails
//! closed as for any other layer. Its sockets are stream TCP only: seccomp fails any
//! other (UDP, ICMP, raw) with EPERM ([`policy::RBD_REFUSED`]), so Landlock's TCP
//! rules cover every connection it can make.
//!
//! Before all of these, the supervisor starts a sandboxed worker as the first process
//! of a pid namespace of its own (`clone` with `CLONE_NEWPID`, in
//! `supervisor/src/worker/spawn.rs`): the worker sees no other process, and whatever
//! it might start dies with it. Entering one from here would need a fork after
//! `unshare`, with the supervisor watching a parent that is not the worker.

mod landlock;
mod namespaces;
pub mod policy;
mod seccomp;

use std::io;

use io_uring::{IoUring, cqueue, squeue};
use nix::errno::Errno;
use nix::sys::prctl;
use nix::sys::resource::{self, Resource};
use nix::unistd::{self, Gid, Uid};
use ublkd_proto::msg::{MissingLayer, SandboxLayer, SandboxReport as Report, TargetSetup};

pub use self::landlock::{PortRange, parse_port_ranges};
use self::landlock::{apply_landlock, tcp_missing};
use self::namespaces::{
    enter_empty_root, enter_root_namespaces, enter_user_namespace, open_proc_self,
};
pub use self::seccomp::lock_down;
use self::seccomp::{apply_refusals, apply_seccomp, install_sigsys_handler};
use crate::sys;

/// Set once [`apply`] begins: from then on the worker may not open a file (a library
/// it loads late would trap, or find nothing in the empty root).
static APPLIED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the sandbox is (being) applied to this process.
pub fn applied() -> bool {
    APPLIED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The worker's exit code after a system call outside the policy.
pub const EXIT_SECCOMP: i32 = ublkd_proto::exit::WorkerExit::Seccomp.code() as i32;

/// Which policy a worker runs under, chosen before the setup is read (from the
/// command line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// Every target but rbd: no network, no thread after standby.
    Standard,
    /// The rbd target, whose librados and librbd run in the worker (see the module
    /// doc).
    Rbd,
}

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
    #[error(
        "the sandbox layer {layer} cannot be applied: {cause}; the worker does not run \
         without it unless its device allows that (sandbox_optional = [\"{layer}\"])"
    )]
    Layer { layer: SandboxLayer, cause: String },
    #[error("cannot build the seccomp filter: {0}")]
    SeccompFilter(seccompiler::BackendError),
    #[error("cannot install the seccomp filter: {0}")]
    SeccompInstall(seccompiler::Error),
    #[error("cannot apply Landlock: {0}")]
    Landlock(::landlock::RulesetError),
    #[error("cannot drop capabilities: {0}")]
    Caps(caps::errors::CapsError),
}

/// The sandbox step `step` failed with `errno`.
fn step_failed(step: &'static str) -> impl FnOnce(Errno) -> SandboxError {
    move |errno| SandboxError::Step { step, source: errno.into() }
}

/// The report under construction, and which layers may be missing.
struct Layers<'a> {
    optional: &'a [SandboxLayer],
    report: Report,
}

impl Layers<'_> {
    /// `layer` cannot be applied because of `cause`: noted if it is optional, else the
    /// worker's end.
    fn missing(&mut self, layer: SandboxLayer, cause: String) -> Result<(), SandboxError> {
        if !self.optional.contains(&layer) {
            return Err(SandboxError::Layer { layer, cause });
        }
        self.report.missing.push(MissingLayer { layer, cause });
        Ok(())
    }
}

/// Applies steps 1–10 under `profile`. `keep_fd` is the control socket; `optional`
/// the layers the worker may run without where they cannot be applied.
pub fn apply(
    id: Identity,
    optional: &[SandboxLayer],
    keep_fd: i32,
    profile: Profile,
    connect_ports: &[PortRange],
) -> Result<Report, SandboxError> {
    APPLIED.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut layers = Layers { optional, report: Report::default() };
    close_other_fds(keep_fd)?;
    set_rlimits(profile)?;
    // The user namespace maps are written after the root is gone: through this.
    let proc_self = open_proc_self();
    let mount_ns = enter_root_namespaces(&mut layers, profile)?;
    if mount_ns {
        if let Err(cause) = enter_empty_root() {
            layers.missing(SandboxLayer::EmptyRoot, cause.to_string())?;
        }
    } else {
        layers.missing(SandboxLayer::EmptyRoot, "no mount namespace to make it in".into())?;
    }
    become_user(id)?;
    match proc_self.and_then(|dir| enter_user_namespace(id, &dir)) {
        Ok(()) => layers.report.namespaces.insert(0, "user".into()),
        Err(cause) => layers.missing(SandboxLayer::UserNamespace, cause.to_string())?,
    }
    prctl::set_no_new_privs().map_err(step_failed("no_new_privs"))?;
    match apply_landlock(profile, connect_ports)? {
        Some(abi) => {
            layers.report.landlock_abi = Some(abi);
            if let Some(cause) = tcp_missing(profile, abi) {
                layers.missing(SandboxLayer::LandlockTcp, cause)?;
            }
        }
        None => {
            layers.missing(SandboxLayer::Landlock, "the kernel does not enforce it".into())?;
            if profile == Profile::Rbd {
                let cause = "the kernel does not enforce Landlock".into();
                layers.missing(SandboxLayer::LandlockTcp, cause)?;
            }
        }
    }
    drop_capabilities()?;
    install_sigsys_handler()?;
    if profile == Profile::Rbd {
        // Installed first, so that stage 1 and 2 stack on it (every thread, librbd's
        // too, inherits it).
        apply_refusals()?;
    }
    apply_seccomp(true, profile)?;
    Ok(layers.report)
}

fn close_other_fds(keep_fd: i32) -> Result<(), SandboxError> {
    // Keep 0, 1, 2 and the control socket (the supervisor puts it at 3); nothing else
    // in the process owns fds above it at this point.
    sys::close_from(keep_fd + 1)
        .map_err(|source| SandboxError::Step { step: "close_range", source })
}

fn set_rlimits(profile: Profile) -> Result<(), SandboxError> {
    let set = |step, resource, value: u64| {
        resource::setrlimit(resource, value, value).map_err(step_failed(step))
    };
    let fds = match profile {
        Profile::Standard => policy::MAX_FDS,
        Profile::Rbd => policy::MAX_FDS_RBD,
    };
    set("RLIMIT_NOFILE", Resource::RLIMIT_NOFILE, fds)?;
    set("RLIMIT_CORE", Resource::RLIMIT_CORE, 0)?;
    set("RLIMIT_MEMLOCK", Resource::RLIMIT_MEMLOCK, policy::MAX_LOCKED_BYTES)
}

fn become_user(id: Identity) -> Result<(), SandboxError> {
    // The bounding set can only be emptied while the worker still holds CAP_SETPCAP.
    caps::clear(None, caps::CapSet::Bounding).map_err(SandboxError::Caps)?;
    unistd::setgroups(&[]).map_err(step_failed("setgroups"))?;
    let (uid, gid) = (Uid::from_raw(id.uid), Gid::from_raw(id.gid));
    unistd::setresgid(gid, gid, gid).map_err(step_failed("setresgid"))?;
    // Changing every uid away from 0 clears the permitted, effective and ambient
    // capability sets.
    unistd::setresuid(uid, uid, uid).map_err(step_failed("setresuid"))
}

fn drop_capabilities() -> Result<(), SandboxError> {
    let e = SandboxError::Caps;
    caps::clear(None, caps::CapSet::Ambient).map_err(e)?;
    caps::clear(None, caps::CapSet::Bounding).map_err(e)?;
    caps::clear(None, caps::CapSet::Inheritable).map_err(e)?;
    caps::clear(None, caps::CapSet::Effective).map_err(e)?;
    caps::clear(None, caps::CapSet::Permitted).map_err(e)
}

/// Restricts a ring created disabled (after its files and buffer rings are
/// registered) to the operations of [`policy::URING_OPS`] that `target` needs, on
/// registered files only where it can ([`policy::fixed_files_required`]), and, once
/// enabled, to [`policy::URING_REGISTER_OPS`]; then enables it.
pub fn restrict_ring(
    ring: &IoUring<squeue::Entry, cqueue::Entry>,
    target: &TargetSetup,
) -> io::Result<()> {
    use io_uring::register::Restriction;
    let mut restrictions: Vec<Restriction> = policy::uring_ops(target)
        .map(|op| Restriction::sqe_op(op.opcode))
        .chain(policy::URING_REGISTER_OPS.iter().map(|op| Restriction::register_op(op.opcode)))
        .collect();
    restrictions.push(Restriction::sqe_flags_allowed(policy::URING_SQE_FLAGS));
    if policy::fixed_files_required(target) {
        restrictions.push(Restriction::sqe_flags_required(squeue::Flags::FIXED_FILE.bits()));
    }
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
    fn an_rbd_worker_may_start_threads_but_no_process_and_open_nothing() {
        let rbd = |nr| policy::RBD_ALWAYS.iter().find(|a| a.nr == nr).map(|a| a.only);
        let Some(policy::Only::ArgMasked { arg: 0, mask, value }) = rbd(libc::SYS_clone) else {
            panic!("clone is allowed only with its flags checked");
        };
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        assert_eq!(thread & mask, value, "pthread_create's flags are allowed");
        let fork = libc::SIGCHLD as u64;
        assert_ne!(fork & mask, value, "a new process is not");
        let thread_in_new_ns = thread | libc::CLONE_NEWNET as u64;
        assert_ne!(thread_in_new_ns & mask, value, "a thread in a new namespace is not");
        // Let through by the main filter only to be refused by the errno filter.
        for nr in [libc::SYS_openat, libc::SYS_clone3] {
            assert!(rbd(nr).is_some());
            let refused = policy::RBD_REFUSED.iter().find(|r| r.nr == nr).expect("refused");
            assert_eq!(refused.only, policy::Only::Any);
        }
        for forbidden in [libc::SYS_execve, libc::SYS_bind, libc::SYS_listen, libc::SYS_accept4] {
            assert!(rbd(forbidden).is_none(), "syscall {forbidden} must not be allowed");
        }
        for r in policy::RBD_ALWAYS {
            assert!(!r.why.is_empty(), "{} has no reason", r.name);
        }
    }

    /// Whether a socket(2) call with these arguments is refused by [`policy::RBD_REFUSED`],
    /// read the way the seccomp filter reads the entries.
    fn socket_refused(domain: i32, ty: i32, protocol: i32) -> bool {
        let args = [domain as u64, ty as u64, protocol as u64];
        policy::RBD_REFUSED.iter().filter(|r| r.nr == libc::SYS_socket).any(|r| match r.only {
            policy::Only::ArgMaskedIn { arg, mask, values } => {
                values.contains(&(args[usize::from(arg)] & mask))
            }
            policy::Only::ArgNotIn { arg, values } => !values.contains(&args[usize::from(arg)]),
            other => panic!("socket refused by an unexpected rule {other:?}"),
        })
    }

    #[test]
    fn an_rbd_worker_may_open_stream_tcp_sockets_only() {
        let flags = libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
        for family in [libc::AF_INET, libc::AF_INET6] {
            assert!(!socket_refused(family, libc::SOCK_STREAM, 0));
            assert!(!socket_refused(family, libc::SOCK_STREAM | flags, libc::IPPROTO_TCP));
            for ty in [libc::SOCK_DGRAM, libc::SOCK_RAW, libc::SOCK_SEQPACKET, libc::SOCK_RDM] {
                assert!(socket_refused(family, ty, 0), "type {ty}");
                assert!(socket_refused(family, ty | flags, 0), "type {ty} with flags");
            }
            assert!(socket_refused(family, libc::SOCK_DGRAM, libc::IPPROTO_ICMP));
            assert!(socket_refused(family, libc::SOCK_STREAM, libc::IPPROTO_SCTP));
            assert!(socket_refused(family, libc::SOCK_STREAM, libc::IPPROTO_MPTCP));
        }
        let errno = |r: &policy::RefusedCall| r.errno as i32;
        for r in policy::RBD_REFUSED.iter().filter(|r| r.nr == libc::SYS_socket) {
            assert_eq!(errno(r), libc::EPERM, "a refused socket fails, it does not trap");
        }
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
