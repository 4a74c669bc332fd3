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
//! `IPAddressAllow=`). No file is reachable, as for every worker.
//!
//! Before all of these, the supervisor starts a sandboxed worker as the first process
//! of a pid namespace of its own (`clone` with `CLONE_NEWPID`, in
//! `supervisor/src/worker/spawn.rs`): the worker sees no other process, and whatever
//! it might start dies with it. Entering one from here would need a fork after
//! `unshare`, with the supervisor watching a parent that is not the worker.

pub mod policy;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use io_uring::{IoUring, cqueue, squeue};
use nix::errno::Errno;
use nix::fcntl::{self, OFlag};
use nix::mount::{self, MntFlags, MsFlags};
use nix::sched::{self, CloneFlags};
use nix::sys::prctl;
use nix::sys::resource::{self, Resource};
use nix::sys::stat::Mode;
use nix::unistd::{self, Gid, Uid};
use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, SeccompRule, TargetArch};
use ublkd_proto::msg::{MissingLayer, SandboxLayer, SandboxReport as Report, TargetSetup};

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

/// TCP ports, both ends included: where an rbd worker may connect (`--rbd-connect-ports`).
pub type PortRange = (u16, u16);

/// The most ports a connect rule list may name (Landlock takes one rule per port).
const MAX_CONNECT_PORTS: usize = 4096;

/// `3300,6789,6800-7568`: the ports of `--rbd-connect-ports`.
pub fn parse_port_ranges(list: &str) -> Result<Vec<PortRange>, String> {
    let port = |p: &str| p.parse::<u16>().map_err(|_| format!("{p:?} is not a TCP port"));
    let mut ranges = Vec::new();
    let mut count = 0usize;
    for item in list.split(',').filter(|i| !i.is_empty()) {
        let (low, high) = match item.split_once('-') {
            Some((low, high)) => (port(low)?, port(high)?),
            None => (port(item)?, port(item)?),
        };
        if low > high || low == 0 {
            return Err(format!("{item:?} is not a range of TCP ports"));
        }
        count += usize::from(high - low) + 1;
        if count > MAX_CONNECT_PORTS {
            return Err(format!("more than {MAX_CONNECT_PORTS} ports"));
        }
        ranges.push((low, high));
    }
    Ok(ranges)
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
    Landlock(landlock::RulesetError),
    #[error("cannot drop capabilities: {0}")]
    Caps(caps::errors::CapsError),
}

/// The sandbox step `step` failed with `errno`.
fn step_failed(step: &'static str) -> impl FnOnce(Errno) -> SandboxError {
    move |errno| SandboxError::Step { step, source: errno.into() }
}

/// Why a layer cannot be applied: the step the kernel refused, and its error.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("{step}: {source}")]
    Call { step: Cow<'static, str>, source: io::Error },
    #[error("no directory to mount it on (/tmp, /mnt, /run, /var)")]
    NoMountPoint,
}

/// `step` failed: the cause of a missing layer, for `map_err`.
fn failed<E: Into<io::Error>>(step: &'static str) -> impl FnOnce(E) -> Refused {
    move |err| refused(step, err)
}

/// `step` failed with `err`: the cause of a missing layer.
fn refused(step: impl Into<Cow<'static, str>>, err: impl Into<io::Error>) -> Refused {
    Refused::Call { step: step.into(), source: err.into() }
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
        Some(abi) => layers.report.landlock_abi = Some(abi),
        None => layers.missing(SandboxLayer::Landlock, "the kernel does not enforce it".into())?,
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

/// The namespaces root may create without a user namespace, each on its own, so that
/// a refusal names the one refused (no network namespace for an rbd worker, which
/// reaches its cluster through the host's). Returns whether the mount namespace is
/// among them.
fn enter_root_namespaces(layers: &mut Layers<'_>, profile: Profile) -> Result<bool, SandboxError> {
    let mut refused = Vec::new();
    let mut mount_ns = false;
    for (flag, name, call) in [
        (CloneFlags::CLONE_NEWNS, "mnt", "unshare(CLONE_NEWNS)"),
        (CloneFlags::CLONE_NEWNET, "net", "unshare(CLONE_NEWNET)"),
        (CloneFlags::CLONE_NEWIPC, "ipc", "unshare(CLONE_NEWIPC)"),
        (CloneFlags::CLONE_NEWUTS, "uts", "unshare(CLONE_NEWUTS)"),
        (CloneFlags::CLONE_NEWCGROUP, "cgroup", "unshare(CLONE_NEWCGROUP)"),
    ] {
        if flag == CloneFlags::CLONE_NEWNET && profile == Profile::Rbd {
            continue;
        }
        // The process is single-threaded here.
        match sched::unshare(flag) {
            Err(errno) => refused.push(self::refused(call, errno).to_string()),
            Ok(()) => {
                mount_ns |= flag == CloneFlags::CLONE_NEWNS;
                layers.report.namespaces.push(name.into());
            }
        }
    }
    if !refused.is_empty() {
        layers.missing(SandboxLayer::Namespaces, refused.join(", "))?;
    }
    Ok(mount_ns)
}

/// `/proc/self` of this process, opened while the host's `/proc` is still in reach.
fn open_proc_self() -> Result<OwnedFd, Refused> {
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    fcntl::open(c"/proc/self", flags, Mode::empty()).map_err(|e| refused("open /proc/self", e))
}

/// A user namespace of its own that maps only the worker's uid and gid, entered after
/// the worker became that user (so the namespaces made as root stay owned by the
/// initial user namespace, where the worker holds no capability).
fn enter_user_namespace(id: Identity, proc_self: &OwnedFd) -> Result<(), Refused> {
    // The process is single-threaded here, as CLONE_NEWUSER requires.
    sched::unshare(CloneFlags::CLONE_NEWUSER).map_err(|e| {
        // The kernel's two refusals, in the words an operator looks for.
        let step = match e {
            Errno::ENOSPC => {
                "unshare(CLONE_NEWUSER) (the host's limit sysctl user.max_user_namespaces \
                 is reached, or 0)"
            }
            Errno::EPERM => {
                "unshare(CLONE_NEWUSER) (this host refuses user namespaces here: inside a \
                 chroot, or by a sysctl or security policy)"
            }
            _ => "unshare(CLONE_NEWUSER)",
        };
        refused(step, e)
    })?;
    // Changing uid made the process non-dumpable, which leaves its /proc files to
    // root: writable again for the maps, then closed again (another worker runs as
    // the same user).
    prctl::set_dumpable(true).map_err(|e| refused("set dumpable", e))?;
    let write = |name: &CStr, text: String| -> Result<(), Refused> {
        let path = || format!("/proc/self/{}", name.to_string_lossy());
        let flags = OFlag::O_WRONLY | OFlag::O_CLOEXEC;
        let fd = fcntl::openat(proc_self, name, flags, Mode::empty())
            .map_err(|e| refused(format!("open {}", path()), e))?;
        io::Write::write_all(&mut std::fs::File::from(fd), text.as_bytes())
            .map_err(|e| refused(format!("write {}", path()), e))
    };
    write(c"setgroups", "deny".into())?;
    write(c"gid_map", format!("{0} {0} 1\n", id.gid))?;
    write(c"uid_map", format!("{0} {0} 1\n", id.uid))?;
    prctl::set_dumpable(false).map_err(|e| refused("clear dumpable", e))
}

/// Makes an empty read-only tmpfs the root: with pivot_root where the current root is
/// a mount point, else (ublkd runs in a chroot) by chroot into a tmpfs that is
/// attached nowhere. Either way the host's files are out of reach: the old root is
/// detached, or, after the chroot, reachable only by another chroot (CAP_SYS_CHROOT,
/// which the worker drops, and a system call seccomp refuses).
fn enter_empty_root() -> Result<(), Refused> {
    let none = None::<&CStr>;
    match mount::mount(none, c"/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none) {
        Ok(()) => pivot_to_empty_root(),
        // `/` is not a mount point, so this is a chroot, where pivot_root is refused
        // too.
        Err(Errno::EINVAL) => chroot_to_empty_root(),
        Err(e) => Err(refused("make / private", e)),
    }
}

const EMPTY_ROOT_OPTIONS: &CStr = c"size=4k,nr_inodes=2,mode=0555";

fn pivot_to_empty_root() -> Result<(), Refused> {
    // The new root is mounted over an existing directory, then becomes `/`.
    let Some(mount_point) = [c"/tmp", c"/mnt", c"/run", c"/var"]
        .into_iter()
        .find(|p| std::path::Path::new(&*p.to_string_lossy()).is_dir())
    else {
        return Err(Refused::NoMountPoint);
    };
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY;
    mount::mount(Some(c"tmpfs"), mount_point, Some(c"tmpfs"), flags, Some(EMPTY_ROOT_OPTIONS))
        .map_err(failed("mount the empty root"))?;
    unistd::chdir(mount_point).map_err(failed("chdir to the new root"))?;
    // pivot_root(".", ".") stacks the old root under the new one; detaching "." then
    // removes the old root from this mount namespace.
    unistd::pivot_root(c".", c".").map_err(failed("pivot_root"))?;
    mount::umount2(c".", MntFlags::MNT_DETACH).map_err(failed("detach the old root"))?;
    unistd::chdir(c"/").map_err(failed("chdir /"))
}

fn chroot_to_empty_root() -> Result<(), Refused> {
    // The new mount API makes a tmpfs mount without attaching it anywhere, so nothing
    // propagates to the host's mounts (`/` cannot be made private from inside a
    // chroot: it is not a mount point).
    const FSOPEN_CLOEXEC: libc::c_uint = 1;
    const FSMOUNT_CLOEXEC: libc::c_uint = 1;
    const MOUNT_ATTR_RDONLY: libc::c_uint = 0x1;
    const MOUNT_ATTR_NOSUID: libc::c_uint = 0x2;
    const MOUNT_ATTR_NODEV: libc::c_uint = 0x4;
    const MOUNT_ATTR_NOEXEC: libc::c_uint = 0x8;
    let fs = sys::fsopen(c"tmpfs", FSOPEN_CLOEXEC).map_err(failed("fsopen(tmpfs)"))?;
    for (key, value) in [(c"size", c"4k"), (c"nr_inodes", c"2"), (c"mode", c"0555")] {
        sys::fsconfig_set_string(fs.as_fd(), key, value).map_err(failed("fsconfig(tmpfs)"))?;
    }
    sys::fsconfig_create(fs.as_fd()).map_err(failed("create the tmpfs"))?;
    let attrs = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
    let mnt = sys::fsmount(fs.as_fd(), FSMOUNT_CLOEXEC, attrs).map_err(failed("fsmount(tmpfs)"))?;
    unistd::fchdir(&mnt).map_err(failed("fchdir to the new root"))?;
    unistd::chroot(c".").map_err(failed("chroot"))?;
    unistd::chdir(c"/").map_err(failed("chdir /"))
}

/// Landlock: no file access at all; for an rbd worker also TCP, which it may use only
/// to connect to `connect_ports` (the cluster's monitors and OSDs) and never to bind
/// (kernels from Landlock ABI 4, Linux 6.7; older ones enforce the file part only).
fn apply_landlock(
    profile: Profile,
    connect_ports: &[PortRange],
) -> Result<Option<u8>, SandboxError> {
    use landlock::{
        ABI, Access, AccessFs, AccessNet, NetPort, Ruleset, RulesetAttr, RulesetCreatedAttr,
        RulesetStatus,
    };
    let abi = ABI::V5;
    let ruleset = Ruleset::default().handle_access(AccessFs::from_all(abi));
    let status = match profile {
        Profile::Standard => ruleset.and_then(|r| r.create()),
        Profile::Rbd => ruleset
            .and_then(|r| r.handle_access(AccessNet::from_all(abi)))
            .and_then(|r| r.create())
            .and_then(|r| {
                r.add_rules(connect_ports.iter().flat_map(|&(low, high)| {
                    (low..=high).map(|port| Ok(NetPort::new(port, AccessNet::ConnectTcp)))
                }))
            }),
    }
    .and_then(|r| r.restrict_self())
    .map_err(SandboxError::Landlock)?;
    Ok(match status.ruleset {
        RulesetStatus::NotEnforced => None,
        RulesetStatus::FullyEnforced | RulesetStatus::PartiallyEnforced => {
            Some(sys::landlock_abi())
        }
    })
}

fn drop_capabilities() -> Result<(), SandboxError> {
    let e = SandboxError::Caps;
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
    let rc = unsafe { libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) };
    if rc < 0 { Err(step_failed("sigaction(SIGSYS)")(Errno::last())) } else { Ok(()) }
}

/// The seccomp rule that lets through the calls `only` describes (`None`: all).
fn rule_of(only: policy::Only) -> Result<Option<Vec<SeccompRule>>, SandboxError> {
    use seccompiler::{SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond};
    let err = SandboxError::SeccompFilter;
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
        policy::Only::ArgMasked { arg, mask, value } => {
            vec![one(arg, Len::Qword, Op::MaskedEq(mask), value)?]
        }
    }))
}

fn filter(setup: bool, profile: Profile) -> Result<BpfProgram, SandboxError> {
    // Per system call: `None` once any entry allows every call, else the union of the
    // entries' rules.
    let mut allowed: BTreeMap<i64, Option<Vec<SeccompRule>>> = BTreeMap::new();
    let mut lists: Vec<&[policy::Allowed]> = vec![policy::ALWAYS];
    if setup {
        lists.push(policy::SETUP_ONLY);
    }
    if profile == Profile::Rbd {
        lists.push(policy::RBD_ALWAYS);
    }
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
            .map_err(SandboxError::SeccompFilter)?;
    f.try_into().map_err(SandboxError::SeccompFilter)
}

/// The filter that makes [`policy::RBD_REFUSED`] fail with their errno, and lets
/// everything else through to the other filters. Seccomp runs every filter and takes
/// the strictest answer: an error beats the main filter's allow (and a trap beats the
/// error, so the main filter lets these through: `policy::RBD_ALWAYS`).
fn refusals() -> Result<Vec<BpfProgram>, SandboxError> {
    // One filter per errno: a seccompiler filter has one match action.
    let mut by_errno: BTreeMap<u32, BTreeMap<i64, Vec<SeccompRule>>> = BTreeMap::new();
    for r in policy::RBD_REFUSED {
        let rules = by_errno.entry(r.errno).or_default().entry(r.nr).or_default();
        if let Some(more) = rule_of(r.only)? {
            rules.extend(more);
        }
    }
    by_errno
        .into_iter()
        .map(|(errno, rules)| {
            let f = SeccompFilter::new(
                rules,
                SeccompAction::Allow,
                SeccompAction::Errno(errno),
                TargetArch::x86_64,
            )
            .map_err(SandboxError::SeccompFilter)?;
            f.try_into().map_err(SandboxError::SeccompFilter)
        })
        .collect()
}

fn apply_refusals() -> Result<(), SandboxError> {
    for prog in refusals()? {
        seccompiler::apply_filter(&prog).map_err(SandboxError::SeccompInstall)?;
    }
    Ok(())
}

fn apply_seccomp(setup: bool, profile: Profile) -> Result<(), SandboxError> {
    let prog = filter(setup, profile)?;
    let apply =
        if setup { seccompiler::apply_filter } else { seccompiler::apply_filter_all_threads };
    apply(&prog).map_err(SandboxError::SeccompInstall)
}

/// Seccomp stage 2, for every thread: no new rings, no new threads (but an rbd
/// worker's libraries', see [`policy::RBD_ALWAYS`]).
pub fn lock_down(profile: Profile) -> Result<(), SandboxError> {
    apply_seccomp(false, profile)
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
    fn connect_ports_are_ports_and_ranges_and_not_too_many() {
        assert_eq!(
            parse_port_ranges("3300,6789,6800-7568"),
            Ok(vec![(3300, 3300), (6789, 6789), (6800, 7568)])
        );
        assert_eq!(parse_port_ranges(""), Ok(Vec::new()));
        assert!(parse_port_ranges("7568-6800").unwrap_err().contains("not a range"));
        assert!(parse_port_ranges("0").unwrap_err().contains("not a range"));
        assert!(parse_port_ranges("http").unwrap_err().contains("not a TCP port"));
        assert!(parse_port_ranges("1-65535").unwrap_err().contains("more than"));
    }

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
        for profile in [Profile::Standard, Profile::Rbd] {
            assert!(!filter(true, profile).unwrap().is_empty());
            assert!(filter(false, profile).unwrap().len() < filter(true, profile).unwrap().len());
        }
        assert!(!refusals().unwrap().is_empty());
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
