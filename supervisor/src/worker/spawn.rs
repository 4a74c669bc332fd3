//! Starting a worker process: `clone3` and `execve`, so that a sandboxed worker is born
//! the first process of a pid namespace of its own (`CLONE_NEWPID`) and the supervisor
//! holds its pidfd from the start (`CLONE_PIDFD`, no pid to race on).
//!
//! std's `Command` can do neither. What it does for a child, this does too: the signal
//! mask emptied and SIGPIPE back to its default (Rust's runtime ignores it), stdin
//! `/dev/null`, the fds the worker gets at fixed numbers, every other fd closed on exec.
//! Between `clone3` and `execve` the child is a copy of a multi-threaded process, so it
//! calls only async-signal-safe functions on values prepared before the clone.
//!
//! A pid namespace costs the worker nothing it uses: it sees no other process (it
//! could neither signal nor trace one anyway: another uid, no capabilities, seccomp),
//! and when it exits its namespace goes with it, so nothing it could have started
//! outlives it. The supervisor, in the parent namespace, sees it under its usual pid
//! and kills it with SIGKILL, which reaches a namespace's first process from outside.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;

use nix::fcntl::{FcntlArg, OFlag, fcntl, open};
use nix::sys::stat::Mode;

/// The kernel's `struct clone_args` as of 5.5 (`CLONE_ARGS_SIZE_VER1`), which has every
/// field this uses.
#[repr(C)]
#[derive(Debug, Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
}

/// `CLONE_ARGS_SIZE_VER1` in `<linux/sched.h>`.
const CLONE_ARGS_SIZE_VER1: usize = 80;
const _: () = assert!(size_of::<CloneArgs>() == CLONE_ARGS_SIZE_VER1);
const _: () = assert!(std::mem::offset_of!(CloneArgs, exit_signal) == 32);
const _: () = assert!(std::mem::offset_of!(CloneArgs, set_tid_size) == 72);

/// The lowest fd number the sources of the child's fds are moved to before the clone,
/// so that placing one at its number (0, 2, 3) never overwrites another source.
const ABOVE_TARGETS: RawFd = 10;

/// What to start.
#[derive(Debug)]
pub(super) struct SpawnSpec<'a> {
    pub binary: &'a Path,
    pub args: Vec<String>,
    /// Each fd the child gets, at the number it gets it.
    pub fds: Vec<(BorrowedFd<'a>, RawFd)>,
    /// `RLIMIT_NOFILE` for the child, if not this process's.
    pub nofile: Option<libc::rlimit>,
    /// Start it as the first process of a new pid namespace.
    pub new_pid_namespace: bool,
}

/// Why a child could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cannot prepare its start: {0}")]
    Prepare(#[source] io::Error),
    /// `clone3` refused: with a new pid namespace, the namespace may be what was
    /// refused (EPERM: no CAP_SYS_ADMIN or a seccomp filter such as systemd's
    /// `RestrictNamespaces=`; ENOSPC: `user.max_pid_namespaces`).
    #[error("clone3 failed: {0}")]
    Clone(#[source] io::Error),
    #[error("execve failed: {0}")]
    Exec(#[source] io::Error),
}

/// A started child: ours to reap.
#[derive(Debug)]
pub(super) struct Spawned {
    pub child: ChildProcess,
    pub pidfd: OwnedFd,
}

/// A child process of this one, reaped at most once; its status kept once reaped.
#[derive(Debug)]
pub struct ChildProcess {
    pid: u32,
    status: Option<ExitStatus>,
}

impl ChildProcess {
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Its status if it has exited (reaping it), else `None`; never waits.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.reap(libc::WNOHANG)
    }

    /// Waits for it to exit (reaping it).
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        self.reap(0).map(|s| s.expect("waitpid without WNOHANG returns a status"))
    }

    fn reap(&mut self, flags: i32) -> io::Result<Option<ExitStatus>> {
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        loop {
            match crate::sys::waitpid(self.pid, flags) {
                Ok(None) => return Ok(None),
                Ok(Some(raw)) => {
                    self.status = Some(ExitStatus::from_raw(raw));
                    return Ok(self.status);
                }
                Err(e) => {
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
    }
}

/// Starts `spec`. An `execve` that fails is this call's error (the child then exits
/// and is reaped here).
pub(super) fn spawn(spec: &SpawnSpec<'_>) -> Result<Spawned, SpawnError> {
    let path = cstring(spec.binary.as_os_str()).map_err(SpawnError::Prepare)?;
    let mut argv_owned = vec![path.clone()];
    for arg in &spec.args {
        argv_owned.push(cstring(OsStr::new(arg)).map_err(SpawnError::Prepare)?);
    }
    let env_owned: Vec<CString> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).ok()
        })
        .collect();
    let argv: Vec<*const libc::c_char> =
        argv_owned.iter().map(|a| a.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();
    let envp: Vec<*const libc::c_char> =
        env_owned.iter().map(|e| e.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();

    let prepare = |e: nix::Error| SpawnError::Prepare(e.into());
    let dev_null =
        open("/dev/null", OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty()).map_err(prepare)?;
    let mut sources = vec![(above_targets(dev_null.as_fd()).map_err(prepare)?, 0)];
    for (fd, target) in &spec.fds {
        sources.push((above_targets(*fd).map_err(prepare)?, *target));
    }
    let placements: Vec<(RawFd, RawFd)> =
        sources.iter().map(|(fd, target)| (fd.as_raw_fd(), *target)).collect();
    let (error_read, error_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(prepare)?;

    let mut pidfd: RawFd = -1;
    let mut args = CloneArgs {
        flags: (libc::CLONE_PIDFD as u64)
            | if spec.new_pid_namespace { libc::CLONE_NEWPID as u64 } else { 0 },
        pidfd: std::ptr::addr_of_mut!(pidfd) as u64,
        exit_signal: libc::SIGCHLD as u64,
        ..CloneArgs::default()
    };
    // SAFETY: clone3 with a valid, fully initialized `clone_args` of its stated size,
    // no CLONE_VM (the child gets a copy of this address space, as with fork) and no
    // stack (it runs on its copy of this thread's). The child goes straight to
    // `exec_child`, which never returns.
    let rc = unsafe {
        libc::syscall(libc::SYS_clone3, std::ptr::addr_of_mut!(args), size_of::<CloneArgs>())
    };
    if rc == 0 {
        exec_child(&path, &argv, &envp, &placements, spec.nofile.as_ref(), error_write.as_raw_fd());
    }
    if rc < 0 {
        return Err(SpawnError::Clone(io::Error::last_os_error()));
    }
    drop(error_write);
    drop(sources);
    // SAFETY: CLONE_PIDFD stored a new pidfd for the child in `pidfd`, owned by nothing
    // else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let mut child = ChildProcess { pid: rc as u32, status: None };
    let mut errno = [0u8; 4];
    loop {
        match nix::unistd::read(&error_read, &mut errno) {
            Ok(0) => return Ok(Spawned { child, pidfd }),
            Ok(_) => {
                let _ = child.wait();
                let errno = i32::from_ne_bytes(errno);
                return Err(SpawnError::Exec(io::Error::from_raw_os_error(errno)));
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                let _ = child.wait();
                return Err(SpawnError::Exec(e.into()));
            }
        }
    }
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| io::Error::other(format!("{s:?} holds a NUL byte")))
}

/// A close-on-exec copy of `fd` at [`ABOVE_TARGETS`] or above.
fn above_targets(fd: BorrowedFd<'_>) -> nix::Result<OwnedFd> {
    let copy = fcntl(fd, FcntlArg::F_DUPFD_CLOEXEC(ABOVE_TARGETS))?;
    // SAFETY: F_DUPFD_CLOEXEC returned a new fd owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

/// The child, between `clone3` and `execve`: only async-signal-safe calls, nothing
/// allocated. On failure it writes the errno to `error_fd` and exits 127.
fn exec_child(
    path: &CString,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    placements: &[(RawFd, RawFd)],
    nofile: Option<&libc::rlimit>,
    error_fd: RawFd,
) -> ! {
    // SAFETY: each call is async-signal-safe and takes pointers into memory this
    // process owns (its copy of the parent's), which nothing else touches here.
    unsafe {
        let fail = |errno: i32| -> ! {
            let bytes = errno.to_ne_bytes();
            libc::write(error_fd, bytes.as_ptr().cast(), bytes.len());
            libc::_exit(127)
        };
        let last = || *libc::__errno_location();
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        if libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) != 0 {
            fail(last());
        }
        if libc::signal(libc::SIGPIPE, libc::SIG_DFL) == libc::SIG_ERR {
            fail(last());
        }
        if let Some(limit) = nofile
            && libc::setrlimit(libc::RLIMIT_NOFILE, limit) != 0
        {
            fail(last());
        }
        // The sources are all at ABOVE_TARGETS or higher, so no dup2 overwrites one;
        // the copies dup2 makes are not close-on-exec.
        for &(source, target) in placements {
            if libc::dup2(source, target) < 0 {
                fail(last());
            }
        }
        libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr());
        fail(last())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsFd;

    use super::*;

    fn sh(script: &str, fds: Vec<(BorrowedFd<'_>, RawFd)>) -> Result<Spawned, SpawnError> {
        spawn(&SpawnSpec {
            binary: Path::new("/bin/sh"),
            args: vec!["-c".into(), script.into()],
            fds,
            nofile: None,
            new_pid_namespace: false,
        })
    }

    #[test]
    fn the_child_gets_its_fds_at_their_numbers_and_nothing_else() {
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC).unwrap();
        // fd 2 of the child is the pipe; fd 5 is not there; stdin is /dev/null.
        let mut spawned = sh(
            "echo err >&2; (echo x >&5) 2>/dev/null || echo no5 >&2; cat; echo end >&2",
            vec![(write.as_fd(), 2)],
        )
        .unwrap();
        drop(write);
        let status = spawned.child.wait().unwrap();
        assert!(status.success(), "{status:?}");
        let mut out = String::new();
        std::fs::File::from(read).read_to_string(&mut out).unwrap();
        assert_eq!(out, "err\nno5\nend\n");
        assert_eq!(spawned.child.try_wait().unwrap(), Some(status), "kept once reaped");
    }

    #[test]
    fn a_failed_exec_is_the_spawns_error() {
        let err = spawn(&SpawnSpec {
            binary: Path::new("/nonexistent/ublkd-worker"),
            args: Vec::new(),
            fds: Vec::new(),
            nofile: None,
            new_pid_namespace: false,
        })
        .unwrap_err();
        let SpawnError::Exec(e) = &err else { panic!("not an exec error: {err}") };
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{err}");
    }

    #[test]
    fn the_pidfd_is_the_childs() {
        let mut spawned = sh("exit 7", Vec::new()).unwrap();
        assert!(super::super::pidfd::exits_within(
            spawned.pidfd.as_fd(),
            std::time::Duration::from_secs(10)
        ));
        assert_eq!(spawned.child.wait().unwrap().code(), Some(7));
    }

    #[test]
    fn a_new_pid_namespace_makes_the_child_its_first_process() {
        // CLONE_NEWPID needs CAP_SYS_ADMIN: the suite runs as root, as ublkd does.
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC).unwrap();
        let mut spawned = spawn(&SpawnSpec {
            binary: Path::new("/bin/sh"),
            args: vec!["-c".into(), "echo $$ >&2".into()],
            fds: vec![(write.as_fd(), 2)],
            nofile: None,
            new_pid_namespace: true,
        })
        .unwrap();
        drop(write);
        assert!(spawned.child.wait().unwrap().success());
        let mut out = String::new();
        std::fs::File::from(read).read_to_string(&mut out).unwrap();
        assert_eq!(out.trim(), "1", "the child's own pid, in its namespace");
    }
}
