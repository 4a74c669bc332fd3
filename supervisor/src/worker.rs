//! Starting, talking to and reaping `ublkd-worker` processes.
//!
//! A worker is exec'd (never a bare fork of the multi-threaded supervisor) with one end
//! of a `SOCK_SEQPACKET` socketpair at fd 3 and nothing else but stdio. In the child,
//! before exec: `PR_SET_PDEATHSIG(SIGKILL)`, then a re-check that the parent is still
//! the supervisor (closing the race where it died before the prctl), so a worker never
//! outlives its supervisor. The supervisor spawns workers from its main thread, which
//! lives as long as it does (PDEATHSIG follows the spawning thread).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use ublkd_proto::msg::{self, FromWorker, MsgError, ToWorker, WorkerSetup};

/// The fd number at which a worker finds its control socket.
pub const WORKER_CONTROL_FD: i32 = 3;

/// Errors in starting or talking to a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot start worker {}: {source}", binary.display())]
    Spawn { binary: std::path::PathBuf, source: io::Error },
    #[error("cannot create the worker's control socket: {0}")]
    Socket(#[source] nix::Error),
    #[error("cannot send the worker its setup: {0}")]
    Send(#[source] MsgError),
    #[error("worker {pid} failed to set up: {reason}")]
    Failed { pid: u32, reason: String },
    #[error("worker {pid} exited before it was ready ({status})")]
    Died { pid: u32, status: String },
    #[error("worker {pid} sent something other than Ready: {what}")]
    Protocol { pid: u32, what: String },
    #[error("worker {pid} was not ready within {secs} s")]
    Timeout { pid: u32, secs: u64 },
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    child: Child,
    control: OwnedFd,
}

impl Worker {
    /// Starts `binary` for device `dev_id`.
    pub fn spawn(binary: &Path, dev_id: u32) -> Result<Worker, WorkerError> {
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(WorkerError::Socket)?;
        let parent = std::process::id() as libc::pid_t;
        let theirs_raw = theirs.as_raw_fd();
        let mut cmd = Command::new(binary);
        cmd.arg("--control-fd")
            .arg(WORKER_CONTROL_FD.to_string())
            .arg("--dev-id")
            .arg(dev_id.to_string())
            .stdin(Stdio::null());
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (dup2, fcntl, prctl, getppid, _exit) on values
        // captured by copy; it allocates nothing and takes no locks.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(theirs_raw, WORKER_CONTROL_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
                // dup2 to the same number keeps CLOEXEC; the control fd must survive exec.
                if theirs_raw == WORKER_CONTROL_FD {
                    let flags = libc::fcntl(WORKER_CONTROL_FD, libc::F_GETFD);
                    libc::fcntl(WORKER_CONTROL_FD, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(71);
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(|source| WorkerError::Spawn { binary: binary.to_path_buf(), source })?;
        drop(theirs);
        Ok(Worker { child, control: ours })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn control(&self) -> BorrowedFd<'_> {
        self.control.as_fd()
    }

    /// Sends the setup with its fds (`/dev/ublkcN`, the shared region, the target's).
    pub fn send_setup(
        &self,
        setup: &WorkerSetup,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), WorkerError> {
        msg::send_packet(self.control(), &ToWorker::Setup(setup.clone()), fds)
            .map_err(WorkerError::Send)
    }

    /// Waits for the worker's Ready (every tag PREPed, FETCH armed).
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(), WorkerError> {
        let pid = self.pid();
        let mut pfd =
            libc::pollfd { fd: self.control.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(WorkerError::Timeout { pid, secs: timeout.as_secs() });
            }
            // SAFETY: `pfd` is a valid pollfd for the duration of the call.
            let n =
                unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
            if n > 0 {
                break;
            }
        }
        match msg::recv_packet::<FromWorker>(self.control()) {
            Ok((FromWorker::Ready, _)) => Ok(()),
            Ok((FromWorker::Failed { reason }, _)) => Err(WorkerError::Failed { pid, reason }),
            Err(MsgError::Closed) => {
                let status = self.reap(Duration::from_secs(2));
                Err(WorkerError::Died { pid, status })
            }
            Err(e) => Err(WorkerError::Protocol { pid, what: e.to_string() }),
        }
    }

    /// Asks the worker to exit, waits up to `grace`, then kills it. Returns how it ended.
    pub fn stop(mut self, grace: Duration) -> String {
        let _ = msg::send_packet(self.control(), &ToWorker::Shutdown, &[]);
        self.reap(grace)
    }

    /// Waits up to `grace` for the worker to exit, killing it after that.
    pub fn reap(&mut self, grace: Duration) -> String {
        let deadline = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status.to_string(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let _ = self.child.kill();
                    return self.child.wait().map_or_else(|e| e.to_string(), |s| s.to_string());
                }
            }
        }
    }

    /// Whether the worker has exited (reaping it if so).
    pub fn exited(&mut self) -> Option<String> {
        self.child.try_wait().ok().flatten().map(|s| s.to_string())
    }
}
