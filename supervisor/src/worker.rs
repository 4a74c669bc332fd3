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
use ublkd_proto::msg::{
    self, Activation, FromWorker, MsgError, SandboxReport, ToWorker, WorkerSetup,
};

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
    #[error("worker {pid} broke the protocol: {what}")]
    Protocol { pid: u32, what: String },
    #[error("worker {pid} did not answer within {secs} s")]
    Timeout { pid: u32, secs: u64 },
    #[error("cannot watch worker {pid} (pidfd_open): {source}")]
    Pidfd { pid: u32, source: io::Error },
}

/// Who a sandboxed worker runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerIdentity {
    pub uid: u32,
    pub gid: u32,
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    child: Child,
    control: OwnedFd,
    /// What the worker said its sandbox achieved (`None`: not sandboxed).
    pub sandbox: Option<SandboxReport>,
    /// Readable once the worker has exited: how the supervisor learns of a death at
    /// once, without polling (and without the races of pids being reused).
    pidfd: OwnedFd,
}

impl Worker {
    /// Starts `binary` for device `dev_id`, sandboxed as `sandbox` if given.
    pub fn spawn(
        binary: &Path,
        dev_id: u32,
        sandbox: Option<WorkerIdentity>,
    ) -> Result<Worker, WorkerError> {
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
        match sandbox {
            Some(id) => {
                cmd.arg("--sandbox-uid")
                    .arg(id.uid.to_string())
                    .arg("--sandbox-gid")
                    .arg(id.gid.to_string());
            }
            None => {
                cmd.arg("--no-sandbox");
            }
        }
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
        let mut child = cmd
            .spawn()
            .map_err(|source| WorkerError::Spawn { binary: binary.to_path_buf(), source })?;
        drop(theirs);
        // The child is ours and not yet reaped, so its pid cannot have been reused.
        let pid = child.id();
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if raw < 0 {
            let source = io::Error::last_os_error();
            let _ = child.kill();
            let _ = child.wait();
            return Err(WorkerError::Pidfd { pid, source });
        }
        // SAFETY: `raw` is a new fd returned by pidfd_open, owned by nothing else.
        let pidfd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) };
        Ok(Worker { child, control: ours, sandbox: None, pidfd })
    }

    /// Readable when the worker has exited.
    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn control(&self) -> BorrowedFd<'_> {
        self.control.as_fd()
    }

    /// Sends the setup (fds: the shared region, the target's) and waits until the
    /// worker stands by.
    pub fn setup(
        &mut self,
        setup: &WorkerSetup,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(), WorkerError> {
        self.send_setup(setup, fds)?;
        self.standby_answer(timeout)
    }

    /// Sends the setup without waiting: the worker answers on [`Self::control`] when it
    /// stands by (or fails), to be read with [`Self::standby_answer`].
    pub fn send_setup(
        &mut self,
        setup: &WorkerSetup,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), WorkerError> {
        msg::send_packet(self.control(), &ToWorker::Setup(setup.clone()), fds)
            .map_err(WorkerError::Send)
    }

    /// Waits up to `timeout` for the answer to the setup: standing by, or why not.
    pub fn standby_answer(&mut self, timeout: Duration) -> Result<(), WorkerError> {
        match self.receive(timeout)? {
            FromWorker::Standby { sandbox } => {
                self.sandbox = sandbox;
                Ok(())
            }
            other => self.unexpected("Standby", other),
        }
    }

    /// Whether the worker has something to say (a message, or its end) right now.
    pub fn has_answered(&self) -> bool {
        let mut pfd =
            libc::pollfd { fd: self.control.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
    }

    /// Hands the worker the device (`/dev/ublkcN`) and waits until it has PREPed every
    /// tag and armed FETCH.
    pub fn activate(
        &mut self,
        generation: u64,
        ublkc: BorrowedFd<'_>,
        timeout: Duration,
    ) -> Result<Activation, WorkerError> {
        msg::send_packet(self.control(), &ToWorker::Activate { generation }, &[ublkc])
            .map_err(WorkerError::Send)?;
        match self.receive(timeout)? {
            FromWorker::Ready(activation) => Ok(activation),
            other => self.unexpected("Ready", other),
        }
    }

    fn unexpected<T>(&self, want: &str, got: FromWorker) -> Result<T, WorkerError> {
        let pid = self.pid();
        match got {
            FromWorker::Failed { reason } => Err(WorkerError::Failed { pid, reason }),
            other => {
                Err(WorkerError::Protocol { pid, what: format!("expected {want}, got {other:?}") })
            }
        }
    }

    /// Waits for the worker's next message.
    fn receive(&mut self, timeout: Duration) -> Result<FromWorker, WorkerError> {
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
            Ok((got, _)) => Ok(got),
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

    /// Waits up to `grace` for the worker to exit (on its pidfd), killing it after that.
    pub fn reap(&mut self, grace: Duration) -> String {
        let mut pfd = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = grace.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        let exited = unsafe { libc::poll(&mut pfd, 1, ms) } > 0;
        if !exited {
            let _ = self.child.kill();
        }
        self.child.wait().map_or_else(|e| e.to_string(), |s| describe_exit(&s))
    }

    /// Sends SIGKILL (the worker is then reaped through its pidfd like any death).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
    }

    /// Whether the worker has exited (reaping it if so), and how.
    pub fn exited(&mut self) -> Option<String> {
        self.child.try_wait().ok().flatten().map(|s| describe_exit(&s))
    }
}

/// How a worker ended, in words an operator can act on.
pub fn describe_exit(status: &std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        // SAFETY: strsignal returns a pointer to a static or thread-local string.
        let name = unsafe { std::ffi::CStr::from_ptr(libc::strsignal(sig)) };
        return format!("killed by signal {sig} ({})", name.to_string_lossy());
    }
    match status.code() {
        Some(0) => "exited cleanly".into(),
        Some(64) => "exited 64 (protocol mismatch with the supervisor)".into(),
        Some(65) => "exited 65 (device setup failed)".into(),
        Some(70) => {
            "exited 70 (data path error: the kernel refused a COMMIT or sent a bad FETCH)".into()
        }
        Some(71) => "exited 71 (lost its supervisor)".into(),
        Some(c) => format!("exited {c}"),
        None => "ended".into(),
    }
}
