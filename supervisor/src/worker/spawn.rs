//! Starting a worker process: `clone` and `execve`, so that a sandboxed worker is born
//! the first process of a pid namespace of its own (`CLONE_NEWPID`) and the supervisor
//! holds its pidfd from the start (`CLONE_PIDFD`, no pid to race on).
//!
//! std's `Command` can do neither. What it does for a child, this does too: the signal
//! mask emptied and SIGPIPE back to its default (Rust's runtime ignores it), stdin
//! `/dev/null`, the fds the worker gets at fixed numbers, every other fd closed on exec.
//!
//! The child is started the way `posix_spawn` starts one, with `CLONE_VM | CLONE_VFORK`:
//! until its `execve` it runs in this process's memory, on a stack of its own, while the
//! thread that started it waits. A fork would copy the supervisor's page tables and
//! mappings, which grow with the devices it serves, so starting or restarting any one
//! worker would cost in proportion to all of them; sharing the memory costs the same
//! however many there are. The fd table is still the child's own copy, so that placing
//! its fds cannot disturb the supervisor's.
//!
//! Sharing the memory is why the child, between `clone` and `execve`, calls only
//! async-signal-safe functions on values prepared before the clone and allocates
//! nothing: another thread of the supervisor may hold a lock it would wait on forever,
//! and whatever it wrote would be the supervisor's. It is also why signals are blocked
//! across the clone, so that the child starts with them blocked, and why the child puts
//! every handler back to its default before it unblocks any: a handler of the
//! supervisor's (signal-hook's set its flags and write to its wake-up pipe) that ran in
//! the child would act on the supervisor's memory, as if the supervisor had been
//! signalled. And it is how a failed `execve` is told: the child stores its errno where
//! the parent reads it once the clone returns.
//!
//! A pid namespace costs the worker nothing it uses: it sees no other process (it
//! could neither signal nor trace one anyway: another uid, no capabilities, seccomp),
//! and when it exits its namespace goes with it, so nothing it could have started
//! outlives it. The supervisor, in the parent namespace, sees it under its usual pid
//! and kills it with SIGKILL, which reaches a namespace's first process from outside.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};

use nix::fcntl::{FcntlArg, OFlag, fcntl, open};
use nix::sys::stat::Mode;

/// The lowest fd number the sources of the child's fds are moved to before the clone,
/// so that placing one at its number (0, 2, 3) never overwrites another source.
const ABOVE_TARGETS: RawFd = 10;

/// The stack the child runs on until its `execve`: ample for the few libc calls it
/// makes (and glibc's `posix_spawn` gives its child less).
const CHILD_STACK_SIZE: usize = 64 * 1024;

/// One more than the highest signal number (the kernel's `_NSIG`, 64).
const NSIG: libc::c_int = 65;

/// What to start.
#[derive(Debug)]
pub(crate) struct SpawnSpec<'a> {
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
    /// `clone` refused: with a new pid namespace, the namespace may be what was
    /// refused (EPERM: no CAP_SYS_ADMIN or a seccomp filter such as systemd's
    /// `RestrictNamespaces=`; ENOSPC: `user.max_pid_namespaces`).
    #[error("clone failed: {0}")]
    Clone(#[source] io::Error),
    #[error("execve failed: {0}")]
    Exec(#[source] io::Error),
}

/// A started child: ours to reap.
#[derive(Debug)]
pub(crate) struct Spawned {
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
pub(crate) fn spawn(spec: &SpawnSpec<'_>) -> Result<Spawned, SpawnError> {
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
    let stack = ChildStack::new().map_err(SpawnError::Prepare)?;
    let child_args = ChildArgs {
        path: &path,
        argv: &argv,
        envp: &envp,
        placements: &placements,
        nofile: spec.nofile.as_ref(),
        errno: AtomicI32::new(0),
    };

    let flags = libc::CLONE_VM
        | libc::CLONE_VFORK
        | libc::CLONE_PIDFD
        | if spec.new_pid_namespace { libc::CLONE_NEWPID } else { 0 }
        | libc::SIGCHLD;
    let mut pidfd: libc::c_int = -1;
    let blocked = SignalsBlocked::new().map_err(SpawnError::Prepare)?;
    // SAFETY: `exec_child` runs on `stack`, a mapping of its own that stays mapped
    // until after this call, and reads `child_args`, which outlives this call: with
    // CLONE_VFORK this thread is suspended until the child has exec'd (its memory is
    // then a new one) or exited, so the child never uses either after clone returns.
    // It starts with every signal blocked but glibc's own two (`blocked`), so no
    // handler of this process's runs in it, in this memory, before it has reset them
    // (glibc's ignore a signal from another process). CLONE_PIDFD stores an
    // fd in `pidfd`, a live c_int, at clone's parent_tid argument; the tls and
    // child_tid arguments are read only with flags not given here.
    let rc = unsafe {
        libc::clone(
            exec_child,
            stack.top(),
            flags,
            (&raw const child_args).cast_mut().cast(),
            &raw mut pidfd,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::pid_t>(),
        )
    };
    let clone_error = (rc < 0).then(io::Error::last_os_error);
    drop(blocked);
    drop(stack);
    drop(sources);
    if let Some(e) = clone_error {
        return Err(SpawnError::Clone(e));
    }
    // SAFETY: CLONE_PIDFD stored a new pidfd for the child in `pidfd`, owned by nothing
    // else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let mut child = ChildProcess { pid: rc as u32, status: None };
    match child_args.errno.load(Ordering::Acquire) {
        0 => Ok(Spawned { child, pidfd }),
        errno => {
            let _ = child.wait();
            Err(SpawnError::Exec(io::Error::from_raw_os_error(errno)))
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

/// What the child reads between `clone` and `execve`, in the memory it shares with the
/// parent, and where it tells the parent why it stopped short of `execve`.
struct ChildArgs<'a> {
    path: &'a CStr,
    /// Null-terminated.
    argv: &'a [*const libc::c_char],
    /// Null-terminated.
    envp: &'a [*const libc::c_char],
    /// Each (source, target) to `dup2`.
    placements: &'a [(RawFd, RawFd)],
    nofile: Option<&'a libc::rlimit>,
    /// 0, or the errno of the call that failed in the child, which then exits 127.
    errno: AtomicI32,
}

/// The child's stack: an anonymous mapping with a guard page at its low end, so that
/// running off it faults rather than writing over another mapping. Unmapped on drop.
struct ChildStack {
    base: *mut libc::c_void,
    len: usize,
}

impl ChildStack {
    fn new() -> io::Result<ChildStack> {
        // SAFETY: sysconf reads a constant.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let len = CHILD_STACK_SIZE + page;
        // SAFETY: a new private anonymous mapping, at an address the kernel picks, so
        // nothing else is mapped over.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = ChildStack { base, len };
        // SAFETY: the lowest page of the mapping just made, which nothing uses yet.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// Its highest address, where the child's stack pointer starts (stacks grow down
    /// on x86_64 and aarch64): page-aligned, so 16-byte aligned as both ABIs want.
    fn top(&self) -> *mut libc::c_void {
        self.base.wrapping_byte_add(self.len)
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made, which no reference points into and no child
        // runs on any more (see `spawn`).
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// Every signal blocked in this thread while it lives; the mask it found restored on
/// drop. glibc's `pthread_sigmask` leaves its own two (SIGCANCEL, SIGSETXID) unblocked,
/// whose handlers ignore a signal another process sent.
struct SignalsBlocked {
    old: libc::sigset_t,
}

impl SignalsBlocked {
    fn new() -> io::Result<SignalsBlocked> {
        // SAFETY: sigfillset and pthread_sigmask write only the sets they are given,
        // locals; an all-zero sigset_t is a valid value for them to overwrite.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            match libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) {
                0 => Ok(SignalsBlocked { old }),
                errno => Err(io::Error::from_raw_os_error(errno)),
            }
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: pthread_sigmask reads the mask `new` saved.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}

/// The child, between `clone` and `execve`, in the parent's memory: only
/// async-signal-safe calls, nothing allocated, nothing written but its stack, the C
/// errno of the parent's thread (whose TLS it shares), its own kernel state and, on
/// failure, `errno` in its [`ChildArgs`] (after which it exits 127). Never returns. It starts with every signal blocked and unblocks them only
/// once no handler of the parent's is left in its own copy of the handler table.
///
/// `spawn`'s clone is its only caller, with `arg` pointing to a live [`ChildArgs`].
extern "C" fn exec_child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` in the frame of `spawn`, whose thread is
    // suspended until this process execs or exits, so it and the memory it points to
    // stay valid and unchanged throughout; `errno` is written atomically. Each call is
    // async-signal-safe and is given pointers into that memory or into locals here.
    // errno itself is the parent thread's (the TLS is shared), which it does not read
    // while suspended nor after a clone that succeeded.
    unsafe {
        let args = &*arg.cast_const().cast::<ChildArgs<'_>>();
        let fail = |errno: i32| -> ! {
            args.errno.store(errno, Ordering::Release);
            libc::_exit(127)
        };
        let last = || *libc::__errno_location();
        // What posix_spawn does: a handler is set back to its default, an ignored
        // signal stays ignored (execve keeps it so), except SIGPIPE.
        for signal in 1..NSIG {
            if signal == libc::SIGKILL || signal == libc::SIGSTOP {
                continue;
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut action) != 0 {
                // glibc's own signals, which it keeps from being changed.
                continue;
            }
            let handled =
                action.sa_sigaction != libc::SIG_DFL && action.sa_sigaction != libc::SIG_IGN;
            if !handled && signal != libc::SIGPIPE {
                continue;
            }
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            if libc::sigaction(signal, &default, std::ptr::null_mut()) != 0 {
                fail(last());
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        if libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) != 0 {
            fail(last());
        }
        if let Some(limit) = args.nofile
            && libc::setrlimit(libc::RLIMIT_NOFILE, limit) != 0
        {
            fail(last());
        }
        // The sources are all at ABOVE_TARGETS or higher, so no dup2 overwrites one;
        // the copies dup2 makes are not close-on-exec. The fd table is the child's own
        // (no CLONE_FILES).
        for &(source, target) in args.placements {
            if libc::dup2(source, target) < 0 {
                fail(last());
            }
        }
        libc::execve(args.path.as_ptr(), args.argv.as_ptr(), args.envp.as_ptr());
        fail(last())
    }
}
#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsFd;
    use std::sync::atomic::{AtomicI32, Ordering};

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

    #[test]
    fn a_failed_exec_in_a_new_pid_namespace_is_the_spawns_error() {
        let err = spawn(&SpawnSpec {
            binary: Path::new("/nonexistent/ublkd-worker"),
            args: Vec::new(),
            fds: Vec::new(),
            nofile: None,
            new_pid_namespace: true,
        })
        .unwrap_err();
        let SpawnError::Exec(e) = &err else { panic!("not an exec error: {err}") };
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{err}");
    }

    /// The signals blocked in this thread.
    fn this_threads_mask() -> Vec<libc::c_int> {
        // SAFETY: pthread_sigmask with no new set writes only `mask`, a local.
        unsafe {
            let mut mask: libc::sigset_t = std::mem::zeroed();
            assert_eq!(libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask), 0);
            (1..NSIG).filter(|&s| libc::sigismember(&mask, s) == 1).collect()
        }
    }

    /// Blocks `signals` in this thread, returning the mask to restore.
    fn block(signals: &[libc::c_int]) -> libc::sigset_t {
        // SAFETY: sigaddset and pthread_sigmask write only the sets given, locals.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for &s in signals {
                libc::sigaddset(&mut set, s);
            }
            assert_eq!(libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old), 0);
            old
        }
    }

    fn restore(mask: &libc::sigset_t) {
        // SAFETY: pthread_sigmask reads `mask`.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) };
        assert_eq!(rc, 0);
    }

    /// Makes `handler` the handler of `signal`, returning the action it replaced.
    fn handle(signal: libc::c_int, handler: extern "C" fn(libc::c_int)) -> libc::sigaction {
        // SAFETY: sigaction reads `action` and writes `old`, locals; `handler` only does
        // async-signal-safe things (the handlers below store to atomics).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            let mut old: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handler as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            assert_eq!(libc::sigaction(signal, &action, &mut old), 0);
            old
        }
    }

    fn unhandle(signal: libc::c_int, old: &libc::sigaction) {
        // SAFETY: sigaction reads `old`, an action sigaction returned.
        assert_eq!(unsafe { libc::sigaction(signal, old, std::ptr::null_mut()) }, 0);
    }

    /// The bit of `signal` in a mask of /proc's `status`.
    fn bit(signal: libc::c_int) -> u64 {
        1 << (signal - 1)
    }

    #[test]
    fn the_child_starts_with_no_signal_blocked_nor_sigpipe_ignored() {
        // This thread has SIGUSR2 and SIGWINCH blocked (and, from Rust's runtime, SIGPIPE
        // ignored): the child has neither. (That no handler of ours runs in the child
        // before its exec is the next test's; after it, the kernel resets them.)
        let old_mask = block(&[libc::SIGUSR2, libc::SIGWINCH]);
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC).unwrap();
        let spawned = spawn(&SpawnSpec {
            binary: Path::new("/bin/cat"),
            args: vec!["/proc/self/status".into()],
            fds: vec![(write.as_fd(), 1)],
            nofile: None,
            new_pid_namespace: false,
        });
        restore(&old_mask);
        let mut spawned = spawned.unwrap();
        drop(write);
        let mut status = String::new();
        std::fs::File::from(read).read_to_string(&mut status).unwrap();
        assert!(spawned.child.wait().unwrap().success());
        let mask = |name: &str| {
            let line = status.lines().find_map(|l| l.strip_prefix(name)).unwrap();
            u64::from_str_radix(line.trim(), 16).unwrap()
        };
        assert_eq!(mask("SigBlk:"), 0, "{status}");
        assert_eq!(mask("SigIgn:") & bit(libc::SIGPIPE), 0, "{status}");
    }

    #[test]
    fn spawn_leaves_the_callers_signal_mask_as_it_found_it() {
        let old_mask = block(&[libc::SIGUSR2, libc::SIGWINCH]);
        let before = this_threads_mask();
        let started = sh("exit 0", Vec::new()).map(|mut s| s.child.wait().unwrap());
        let after_start = this_threads_mask();
        let failed = spawn(&SpawnSpec {
            binary: Path::new("/nonexistent/ublkd-worker"),
            args: Vec::new(),
            fds: Vec::new(),
            nofile: None,
            new_pid_namespace: false,
        });
        let after_failure = this_threads_mask();
        restore(&old_mask);
        assert!(started.unwrap().success());
        assert!(failed.is_err());
        assert!(before.contains(&libc::SIGUSR2) && before.contains(&libc::SIGWINCH));
        assert_eq!(after_start, before);
        assert_eq!(after_failure, before);
    }

    /// This process's pid, and the pid of a process other than it that ran
    /// `record_a_child`.
    static PARENT: AtomicI32 = AtomicI32::new(0);
    static HANDLED_IN_CHILD: AtomicI32 = AtomicI32::new(0);

    extern "C" fn record_a_child(_: libc::c_int) {
        // SAFETY: getpid has no preconditions (and is async-signal-safe).
        let pid = unsafe { libc::getpid() };
        if pid != PARENT.load(Ordering::Relaxed) {
            HANDLED_IN_CHILD.store(pid, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_signal_that_reaches_the_child_before_its_exec_runs_no_handler_of_ours() {
        // The child shares this process's memory until it execs, so a handler of ours
        // that ran in it would store to our HANDLED_IN_CHILD. Another thread signals
        // every child of the spawning thread as soon as it sees it (no child is reaped
        // before that thread stops, so no pid it signals can be another process's),
        // and many of them are signalled before their exec.
        PARENT.store(std::process::id() as i32, Ordering::Relaxed);
        let old_action = handle(libc::SIGUSR1, record_a_child);
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let children = format!("/proc/self/task/{tid}/children");
        std::fs::read_to_string(&children).expect("/proc lists a thread's children");
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let signaller = std::thread::spawn({
            let (seen, stop) = (std::sync::Arc::clone(&seen), std::sync::Arc::clone(&stop));
            move || {
                let mut signalled = std::collections::HashSet::new();
                while !stop.load(Ordering::Relaxed) {
                    let Ok(list) = std::fs::read_to_string(&children) else { continue };
                    for pid in list.split_whitespace().map(|p| p.parse::<i32>().unwrap()) {
                        if signalled.insert(pid) {
                            // SAFETY: kill of a child of ours that is not reaped yet.
                            unsafe { libc::kill(pid, libc::SIGUSR1) };
                        }
                    }
                    seen.store(signalled.len(), Ordering::Relaxed);
                }
            }
        });
        // Many fds to place make the time between clone and execve longer.
        let dev_null = std::fs::File::open("/dev/null").unwrap();
        let fds = vec![(dev_null.as_fd(), 3); 200];
        let mut spawned = Vec::new();
        for _ in 0..100 {
            let started = spawn(&SpawnSpec {
                binary: Path::new("/bin/true"),
                args: Vec::new(),
                fds: fds.clone(),
                nofile: None,
                new_pid_namespace: false,
            });
            spawned.push(started.unwrap());
        }
        // Each child, exited or not, is listed until it is reaped.
        while seen.load(Ordering::Relaxed) < spawned.len() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
        signaller.join().unwrap();
        let killed = spawned
            .iter_mut()
            .map(|s| s.child.wait().unwrap())
            .filter(|status| status.signal() == Some(libc::SIGUSR1))
            .count();
        unhandle(libc::SIGUSR1, &old_action);
        eprintln!("{killed} of {} children killed by SIGUSR1", spawned.len());
        assert_eq!(HANDLED_IN_CHILD.load(Ordering::Relaxed), 0, "a child ran our handler");
    }
}
