//! How a worker ends, and what ublkd learns from it: asked to exit, killed, reaped
//! (never waited for on the loop: one not yet ended lingers and is reaped on a later
//! turn), its exit status read for why, or let go to serve on without ublkd.

#![allow(unused_imports)]
use super::*;

pub(super) fn linger(pid: u32) {
    LINGERING.lock().unwrap_or_else(|p| p.into_inner()).push(pid);
}

/// Reaps the workers that were let go before they exited and have exited since;
/// never waits.
pub fn reap_lingering() {
    let mut lingering = LINGERING.lock().unwrap_or_else(|p| p.into_inner());
    lingering.retain(|&pid| {
        match crate::sys::waitpid_nohang(pid) {
            Ok(None) => true,
            Ok(Some(status)) => {
                let how = ublkd_proto::exit::describe(
                    &std::os::unix::process::ExitStatusExt::from_raw(status),
                );
                tracing::info!(worker_pid = pid, "a worker let go earlier has ended: {how}");
                false
            }
            Err(_) => false, // not ours (ECHILD): nothing to reap
        }
    });
}

impl Worker {
    /// Asks the worker to exit, without waiting: [`Self::finish`] waits, so that the
    /// workers asked together exit side by side.
    pub fn ask_to_exit(&self) {
        // One that does not take the message is killed ([`Self::send`]).
        let _ = self.send(&ToWorker::Shutdown, &[]);
    }

    /// After [`Self::ask_to_exit`]: waits up to `grace` for the worker to exit, then kills
    /// it. Returns how it ended, and whether it exited by itself with
    /// [`WorkerExit::Clean`] (every request answered). Once it has exited, waits briefly
    /// for the relay to log its last lines and close its stderr, so that nothing of a
    /// stopped worker is left open in ublkd.
    pub fn finish(mut self, grace: Duration) -> (String, bool) {
        let how = self.reap(grace);
        if let Some(end) = &self.stderr_end {
            end.wait(STDERR_END_WAIT);
        }
        (how, self.exited_with(WorkerExit::Clean))
    }

    /// Waits up to `grace` for the worker to exit (on its pidfd), then kills it and
    /// waits up to `KILL_GRACE` more. A worker that still has not exited (stuck in the
    /// kernel) is not waited for: it is reaped once it exits (see [`reap_lingering`]).
    pub fn reap(&mut self, grace: Duration) -> String {
        if !exits_within(self.pidfd.as_fd(), grace) {
            self.kill();
            if !exits_within(self.pidfd.as_fd(), KILL_GRACE) {
                return format!(
                    "did not exit within {} ms of SIGKILL (stuck in the kernel?); it is \
                     reaped once it exits",
                    KILL_GRACE.as_millis()
                );
            }
        }
        // It has exited: our copy of its stderr's write end goes, so that the relay
        // sees the pipe end. This wait returns at once.
        self.stderr_write = None;
        match &mut self.child {
            Some(child) => {
                child.wait().map_or_else(|e| e.to_string(), |s| ublkd_proto::exit::describe(&s))
            }
            None => NOT_OUR_CHILD.to_string(),
        }
    }

    /// Sends SIGKILL (the worker is then reaped through its pidfd like any death).
    pub fn kill(&self) {
        let _ = pidfd_kill(self.pidfd.as_fd());
    }

    /// Whether the worker has exited (reaping it if so), and how.
    pub fn exited(&mut self) -> Option<String> {
        let how = self.exit_status();
        if how.is_some() {
            self.stderr_write = None;
        }
        how
    }

    /// Whether the worker ended because its target's connection broke (an NBD server
    /// went away): not a crash of its own. Known once [`Self::exited`] said it ended.
    pub fn lost_backend(&mut self) -> bool {
        self.exited_with(WorkerExit::BackendLost)
    }

    /// Whether the worker (our child, already reaped) was ended by a signal.
    pub(super) fn ended_by_signal(&mut self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        let status = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        status.is_some_and(|s| s.signal().is_some())
    }

    /// Whether the worker (our child, already reaped) exited by itself with `code`.
    pub(super) fn exited_with(&mut self, code: WorkerExit) -> bool {
        use std::os::unix::process::ExitStatusExt;
        let status = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        status.is_some_and(|s| s.signal().is_none() && s.code() == Some(i32::from(code.code())))
    }

    pub(super) fn exit_status(&mut self) -> Option<String> {
        match &mut self.child {
            Some(child) => child.try_wait().ok().flatten().map(|s| ublkd_proto::exit::describe(&s)),
            None => exits_within(self.pidfd.as_fd(), Duration::ZERO)
                .then(|| format!("ended; {NOT_OUR_CHILD}")),
        }
    }

    /// Lets a serving worker serve on after this supervisor exits, for the next one to
    /// take over: nothing of it is closed that it needs (it holds its own copies).
    pub fn leave_serving(mut self) {
        if let Some(write) = &self.stderr_write
            && let Err(e) = set_nonblocking(write.as_fd())
        {
            tracing::warn!(
                worker_pid = self.pid,
                "cannot make the worker's stderr nonblocking ({e}): with no ublkd reading \
                 it, a worker that logs much may stall"
            );
        }
        // Not ours to reap later either: this supervisor is about to exit.
        self.child = None;
    }
}
