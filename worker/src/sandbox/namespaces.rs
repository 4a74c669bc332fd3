//! Steps 3, 4 and 6 of the sandbox: the namespaces the worker makes as root (mount,
//! network, IPC, UTS, cgroup), the empty read-only root it then sees, and the user
//! namespace it enters last, as its own user. The kernel may refuse each of them
//! ([`Refused`] names the step and the error); [`super::apply`] decides whether the
//! worker runs without the layer or not at all.

use std::borrow::Cow;
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{self, OFlag};
use nix::mount::{self, MntFlags, MsFlags};
use nix::sched::{self, CloneFlags};
use nix::sys::prctl;
use nix::sys::stat::Mode;
use nix::unistd;
use ublkd_proto::msg::SandboxLayer;

use super::{Identity, Layers, Profile, SandboxError};
use crate::sys;

/// Why a layer cannot be applied: the step the kernel refused, and its error.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
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

/// The namespaces root may create without a user namespace, each on its own, so that
/// a refusal names the one refused (no network namespace for an rbd worker, which
/// reaches its cluster through the host's). Returns whether the mount namespace is
/// among them.
pub(super) fn enter_root_namespaces(
    layers: &mut Layers<'_>,
    profile: Profile,
) -> Result<bool, SandboxError> {
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
pub(super) fn open_proc_self() -> Result<OwnedFd, Refused> {
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    fcntl::open(c"/proc/self", flags, Mode::empty()).map_err(|e| refused("open /proc/self", e))
}

/// A user namespace of its own that maps only the worker's uid and gid, entered after
/// the worker became that user (so the namespaces made as root stay owned by the
/// initial user namespace, where the worker holds no capability).
pub(super) fn enter_user_namespace(id: Identity, proc_self: &OwnedFd) -> Result<(), Refused> {
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
pub(super) fn enter_empty_root() -> Result<(), Refused> {
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
