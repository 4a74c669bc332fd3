//! The VM's helper processes (qemu, virtiofsd): killed when dropped, and when this
//! process dies.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::thread;
use std::time::{Duration, Instant};

use super::VmError;

/// A child process killed (and reaped) when dropped.
#[derive(Debug)]
pub(super) struct Guarded(pub(super) Child);

impl Guarded {
    /// Waits up to `grace` for the child to exit, then kills it; returns its status.
    pub(super) fn stop(&mut self, grace: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + grace;
        loop {
            match self.0.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < until => thread::sleep(Duration::from_millis(20)),
                _ => break,
            }
        }
        let _ = self.0.kill();
        self.0.wait().ok()
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

/// Spawns `cmd` so that it is SIGKILLed when this process dies.
pub(super) fn spawn_tied(cmd: &mut Command, what: &'static str) -> Result<Guarded, VmError> {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the hook runs in the forked child before exec and only calls
    // async-signal-safe functions (prctl, getppid) without allocating.
    unsafe {
        cmd.pre_exec(move || die_with_parent(parent));
    }
    cmd.spawn().map(Guarded).map_err(|e| VmError::Spawn(what, e))
}

/// `pre_exec` hook: SIGKILL on parent death, then re-check that the parent is still
/// `parent` (it may have died before prctl).
fn die_with_parent(parent: libc::pid_t) -> io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and touches no memory.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } != parent {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}
