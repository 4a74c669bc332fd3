//! Starting, talking to, taking over and reaping `ublkd-worker` processes.
//!
//! A worker is exec'd (never a bare fork of the multi-threaded supervisor) with one end
//! of a `SOCK_SEQPACKET` socketpair at fd 3 and nothing else but stdio.
//!
//! Workers are not tied to the supervisor's life. Until it serves, a worker ends when
//! its control socket does (the supervisor exited): it reads or writes the socket at
//! every step. At activation it is handed the supervisor's end of that socket and the
//! read end of its stderr pipe, which it holds unused; from then on it serves whether
//! or not a supervisor runs, and a restarted ublkd takes it over ([`Worker::attach`]):
//! it copies both fds back out of the worker with pidfd_getfd and asks the worker
//! which device and incarnation it serves. A supervisor restart is then no event on
//! the data path at all.
//!
//! A worker's stderr is a pipe of its own, relayed into ublkd's log by
//! [`crate::worker_log`]; its write end is nonblocking, so that a worker whose
//! supervisor is gone drops log lines once the pipe is full instead of stalling on
//! them. Nothing here waits for a worker without a bound: a killed worker stuck in the
//! kernel (in D state on a hung backing file, say) is left to [`reap_lingering`], which
//! the loop calls on every turn (SIGCHLD wakes it). A taken-over worker is not ublkd's
//! child: its end is seen on its pidfd, and its exit status is not known.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use ublkd_proto::msg::{
    self, Activation, FromWorker, LayerSet, MsgError, SandboxLayer, SandboxReport, ToWorker,
    WorkerSetup,
};
use ublkd_proto::uapi;

use crate::worker_log::PipeEnd;

/// The most rings a worker may name: one per queue thread.
const MAX_RINGS: usize = ublkd_config::MAX_THREADS as usize;

/// The most entries of a worker's sandbox report's lists kept (there are seven
/// namespace kinds and four layers).
const NAMESPACES_SHOWN: usize = 8;

/// The fd number at which a worker finds its control socket.
pub const WORKER_CONTROL_FD: i32 = 3;

/// How long a worker may take to exit after SIGKILL before it is left to be reaped
/// once it does.
const KILL_GRACE: Duration = Duration::from_millis(500);

/// How long a stopped worker's last lines may take to reach the log.
const STDERR_END_WAIT: Duration = Duration::from_millis(200);

/// Workers that were let go before they exited (pids, still ours to reap: an unreaped
/// child's pid is never reused).
static LINGERING: Mutex<Vec<u32>> = Mutex::new(Vec::new());

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
    #[error("cannot copy worker {pid}'s ring (its fd {number}) with pidfd_getfd: {source}")]
    Rings { pid: u32, number: i32, source: io::Error },
    #[error("cannot watch worker {pid} (pidfd_open): {source}")]
    Pidfd { pid: u32, source: io::Error },
    #[error("cannot make a worker's stderr pipe: {0}")]
    Pipe(#[source] io::Error),
    #[error("cannot take over worker {pid}: {what}")]
    Attach { pid: u32, what: String },
}

/// Who a sandboxed worker runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerIdentity {
    pub uid: u32,
    pub gid: u32,
}

/// A worker's sandbox: who it runs as, and which layers it may run without where they
/// cannot be applied (any other it cannot apply makes it refuse to run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerSandbox {
    pub identity: WorkerIdentity,
    pub optional: LayerSet,
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    /// `None` for a worker taken over from a previous supervisor (not our child).
    child: Option<Child>,
    pid: u32,
    control: OwnedFd,
    /// A copy of the read end of the worker's stderr pipe, handed to the worker at
    /// activation (see [`ToWorker::Activate`]); `None` once handed, or where ublkd's
    /// stderr is the worker's.
    stderr_copy: Option<OwnedFd>,
    /// Where the activated worker holds, in its fd table, the fds that outlive this
    /// supervisor: its control socket's other end, then its stderr's read end (if any).
    held: Vec<i32>,
    /// What the worker said its sandbox achieved (`None`: not sandboxed).
    pub sandbox: Option<SandboxReport>,
    /// Readable once the worker has exited: how the supervisor learns of a death at
    /// once, without polling (and without the races of pids being reused).
    pidfd: OwnedFd,
    /// The worker's io_uring instances (named in Standby, copied with pidfd_getfd).
    /// Held so that when the worker dies, [`Self::release_device`] can make the kernel
    /// let go of `/dev/ublkcN` at once.
    rings: Vec<OwnedFd>,
    /// When the relay is done with the worker's stderr (`None`: ublkd's stderr).
    stderr_end: Option<PipeEnd>,
}

impl Worker {
    /// Starts `binary` for device `dev_id`, sandboxed as `sandbox` if given.
    pub fn spawn(
        binary: &Path,
        dev_id: u32,
        sandbox: Option<WorkerSandbox>,
    ) -> Result<Worker, WorkerError> {
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(WorkerError::Socket)?;
        let theirs_raw = theirs.as_raw_fd();
        let mut cmd = Command::new(binary);
        cmd.arg("--control-fd")
            .arg(WORKER_CONTROL_FD.to_string())
            .arg("--dev-id")
            .arg(dev_id.to_string())
            .stdin(Stdio::null());
        let relay = crate::worker_log::Relay::get();
        let mut stderr_read = None;
        if relay.is_some() {
            let (read, write) = stderr_pipe()?;
            cmd.stderr(Stdio::from(write));
            stderr_read = Some(read);
        }
        match sandbox {
            Some(WorkerSandbox { identity: id, optional }) => {
                cmd.arg("--sandbox-uid")
                    .arg(id.uid.to_string())
                    .arg("--sandbox-gid")
                    .arg(id.gid.to_string());
                if !optional.is_empty() {
                    cmd.arg("--sandbox-optional").arg(SandboxLayer::join(&optional.layers()));
                }
            }
            None => {
                cmd.arg("--no-sandbox");
            }
        }
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (dup2, fcntl) on values captured by copy; it
        // allocates nothing and takes no locks.
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
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|source| WorkerError::Spawn { binary: binary.to_path_buf(), source })?;
        drop(theirs);
        // The child is ours and not yet reaped, so its pid cannot have been reused.
        let pid = child.id();
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => fd,
            Err(source) => {
                let _ = child.kill();
                linger(pid);
                return Err(WorkerError::Pidfd { pid, source });
            }
        };
        let mut worker = Worker {
            child: Some(child),
            pid,
            control: ours,
            stderr_copy: None,
            held: Vec::new(),
            sandbox: None,
            pidfd,
            rings: Vec::new(),
            stderr_end: None,
        };
        if let (Some(relay), Some(read)) = (relay, stderr_read) {
            worker.stderr_copy = read.try_clone().ok();
            worker.stderr_end = Some(relay.watch(read, dev_id, pid));
        }
        Ok(worker)
    }

    /// Readable when the worker has exited.
    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn control(&self) -> BorrowedFd<'_> {
        self.control.as_fd()
    }

    /// Sends the setup (fds: the shared region, the target's) without waiting: the
    /// worker answers on [`Self::control`] when it stands by (or fails), to be read
    /// with [`Self::standby_answer`].
    pub fn send_setup(
        &mut self,
        setup: &WorkerSetup,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), WorkerError> {
        match msg::send_packet(self.control(), &ToWorker::Setup(setup.clone()), fds) {
            Ok(()) => Ok(()),
            // A worker that could not set its sandbox up said why before it ended.
            Err(source) => match self.receive(Duration::from_millis(100)) {
                Ok((FromWorker::Failed { reason }, _)) => {
                    Err(WorkerError::Failed { pid: self.pid(), reason })
                }
                _ => Err(WorkerError::Send(source)),
            },
        }
    }

    /// Waits up to `timeout` for the answer to the setup: standing by, or why not.
    pub fn standby_answer(&mut self, timeout: Duration) -> Result<(), WorkerError> {
        match self.receive(timeout)? {
            (FromWorker::Standby { sandbox, rings }, _) => {
                // Its text reaches the journal and status: escaped, bounded.
                self.sandbox = sandbox.map(|mut report| {
                    report.namespaces.truncate(NAMESPACES_SHOWN);
                    report.missing.truncate(NAMESPACES_SHOWN);
                    for ns in &mut report.namespaces {
                        *ns = msg::untrusted_text(ns);
                    }
                    for missing in &mut report.missing {
                        missing.cause = msg::untrusted_text(&missing.cause);
                    }
                    report
                });
                self.rings = copy_rings(self.pidfd.as_fd(), self.pid(), &rings)?;
                Ok(())
            }
            (other, _) => self.unexpected("Standby", other),
        }
    }

    /// After the worker's death: unregisters the files and buffers of its rings, so
    /// that the kernel releases `/dev/ublkcN` now (the last reference is then dropped
    /// by this thread, and ublk's release runs right after the syscall), not when
    /// io_uring's asynchronous teardown of each ring frees its file table. Not every
    /// request ended with the worker: O_DIRECT writes to the backing file may still be
    /// in flight as bios, and the release re-issues their requests; the device asks
    /// for this only where that is safe (`Device::fast_release_is_safe`). A reference a
    /// request still holds delays the release until the ring's teardown, which the
    /// rings' fds being closed here starts. Call it only once the worker is dead (reaped).
    pub fn release_device(&mut self) {
        let refused = unregister_files_and_buffers(&std::mem::take(&mut self.rings));
        if refused > 0 {
            // The release then waits for io_uring's teardown of the rings, as it would
            // without this; START_USER_RECOVERY keeps retrying until it is done.
            tracing::debug!(worker_pid = self.pid(), refused, "rings kept their files");
        }
    }

    /// Whether the worker has something to say (a message, or its end) right now.
    pub fn has_answered(&self) -> bool {
        let mut pfd = [PollFd::new(self.control.as_fd(), PollFlags::POLLIN)];
        poll(&mut pfd, PollTimeout::ZERO).is_ok_and(|n| n > 0)
    }

    /// Hands the worker the device (`/dev/ublkcN`) and waits until it has PREPed every
    /// tag and armed FETCH.
    pub fn activate(
        &mut self,
        generation: u64,
        ublkc: BorrowedFd<'_>,
        timeout: Duration,
    ) -> Result<Activation, WorkerError> {
        let mut fds = vec![ublkc, self.control.as_fd()];
        fds.extend(self.stderr_copy.as_ref().map(AsFd::as_fd));
        msg::send_packet(self.control(), &ToWorker::Activate { generation }, &fds)
            .map_err(WorkerError::Send)?;
        let sent_held = fds.len() - 1;
        // The worker has its own copy now.
        self.stderr_copy = None;
        match self.receive(timeout)? {
            (FromWorker::Ready(activation), _) => {
                if activation.held.len() != sent_held {
                    let what =
                        format!("held {} fds of the {sent_held} sent", activation.held.len());
                    return Err(WorkerError::Protocol { pid: self.pid, what });
                }
                self.held.clone_from(&activation.held);
                Ok(activation)
            }
            (other, _) => self.unexpected("Ready", other),
        }
    }

    /// Where the activated worker holds its control socket's other end and (if any)
    /// its stderr's read end: what a restarted ublkd needs to take it over.
    pub fn held(&self) -> &[i32] {
        &self.held
    }

    /// Takes over worker `pid`, which a previous supervisor activated for device
    /// `dev_id` at `generation` and which has served on since: copies its control
    /// socket's other end (held at `held[0]`) and its stderr's read end (`held[1]`)
    /// out of it, and asks it what it serves. Anything that does not match, from the
    /// process's start time to the worker's answer, is refused: the caller then kills
    /// whatever runs at `pid` if it is that worker, and recovers the device.
    pub fn attach(claim: &AttachClaim, timeout: Duration) -> Result<Worker, WorkerError> {
        let pid = claim.pid;
        let refused = |what: String| WorkerError::Attach { pid, what };
        let pidfd = pidfd_open(pid).map_err(|e| refused(format!("no such process ({e})")))?;
        // The pidfd pins the process: if the start time matches now, it is the worker
        // the record names and not a later process that reused its pid.
        match process_start_time(pid) {
            Some(t) if t == claim.start_time => {}
            Some(_) => return Err(refused("the pid belongs to another process now".into())),
            None => return Err(refused("its start time cannot be read".into())),
        }
        let Some(&control_at) = claim.held.first() else {
            return Err(refused("it was never told to hold its control socket".into()));
        };
        let control = getfd(pidfd.as_fd(), control_at)
            .map_err(|e| refused(format!("cannot copy its fd {control_at}: {e}")))?;
        if let Some(what) = not_a_seqpacket_socket(control.as_fd()) {
            return Err(refused(format!("its fd {control_at} is {what}")));
        }
        let mut worker = Worker {
            child: None,
            pid,
            control,
            stderr_copy: None,
            held: claim.held.clone(),
            sandbox: None,
            pidfd,
            rings: Vec::new(),
            stderr_end: None,
        };
        msg::send_packet(worker.control(), &ToWorker::Attach, &[]).map_err(WorkerError::Send)?;
        let deadline = Instant::now() + timeout;
        let (dev_id, generation, rings) = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match worker.receive(left)? {
                // A worker taken over mid-activation says Ready first.
                (FromWorker::Ready(_), _) => continue,
                (FromWorker::Attached { dev_id, generation, rings }, _) => {
                    break (dev_id, generation, rings);
                }
                (other, _) => return worker.unexpected("Attached", other),
            }
        };
        if (dev_id, generation) != (claim.dev_id, claim.generation) {
            return Err(refused(format!(
                "it serves device {dev_id} generation {generation}, not device {} \
                 generation {}",
                claim.dev_id, claim.generation
            )));
        }
        worker.rings = copy_rings(worker.pidfd.as_fd(), pid, &rings)?;
        if let (Some(relay), Some(&stderr_at)) =
            (crate::worker_log::Relay::get(), claim.held.get(1))
        {
            match getfd(worker.pidfd.as_fd(), stderr_at) {
                Ok(read) if not_a_pipe(read.as_fd()).is_none() => {
                    worker.stderr_end = Some(relay.watch(read, dev_id, pid));
                }
                Ok(read) => tracing::warn!(
                    dev_id,
                    worker_pid = pid,
                    "not relaying the worker's stderr: its fd {stderr_at} is {}",
                    not_a_pipe(read.as_fd()).unwrap_or_default()
                ),
                Err(e) => tracing::warn!(
                    dev_id,
                    worker_pid = pid,
                    "not relaying the worker's stderr: cannot copy its fd {stderr_at}: {e}"
                ),
            }
        }
        Ok(worker)
    }

    /// Kills a worker that [`Self::attach`] refused, if `claim`'s pid still is that
    /// worker, and waits up to `grace` for its end; whether it has ended (or was never
    /// there).
    pub fn kill_claimed(claim: &AttachClaim, grace: Duration) -> bool {
        let Ok(pidfd) = pidfd_open(claim.pid) else { return true };
        if process_start_time(claim.pid) != Some(claim.start_time) {
            return true;
        }
        let _ = pidfd_kill(pidfd.as_fd());
        exits_within(pidfd.as_fd(), grace)
    }

    fn unexpected<T>(&self, want: &str, got: FromWorker) -> Result<T, WorkerError> {
        let pid = self.pid();
        match got {
            FromWorker::Failed { reason } => {
                Err(WorkerError::Failed { pid, reason: msg::untrusted_text(&reason) })
            }
            other => Err(WorkerError::Protocol {
                pid,
                what: msg::untrusted_text(&format!("expected {want}, got {other:?}")),
            }),
        }
    }

    /// Waits for the worker's next message, and the fds it came with.
    fn receive(&mut self, timeout: Duration) -> Result<(FromWorker, Vec<OwnedFd>), WorkerError> {
        let pid = self.pid();
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(WorkerError::Timeout { pid, secs: timeout.as_secs() });
            }
            let mut pfd = [PollFd::new(self.control.as_fd(), PollFlags::POLLIN)];
            if poll(&mut pfd, poll_timeout(left)).is_ok_and(|n| n > 0) {
                break;
            }
        }
        let mut received = msg::recv_packet::<FromWorker>(self.control());
        // A worker that ends with our message unread (one whose sandbox failed ends
        // before it reads its setup) resets the connection, which the kernel reports
        // once, before the packets the worker sent first: its Failed among them.
        if matches!(&received, Err(MsgError::Io(e)) if e.raw_os_error() == Some(libc::ECONNRESET)) {
            received = msg::recv_packet::<FromWorker>(self.control());
        }
        match received {
            Ok(got) => Ok(got),
            Err(MsgError::Closed) => {
                let status = self.reap(Duration::from_secs(2));
                Err(WorkerError::Died { pid, status })
            }
            Err(e) => Err(WorkerError::Protocol { pid, what: e.to_string() }),
        }
    }

    /// Asks the worker to exit, waits up to `grace`, then kills it. Returns how it ended.
    /// Once it has exited, waits briefly for the relay to log its last lines and close
    /// its stderr, so that nothing of a stopped worker is left open in ublkd.
    pub fn stop(mut self, grace: Duration) -> String {
        let _ = msg::send_packet(self.control(), &ToWorker::Shutdown, &[]);
        let how = self.reap(grace);
        if let Some(end) = &self.stderr_end {
            end.wait(STDERR_END_WAIT);
        }
        how
    }

    /// Waits up to `grace` for the worker to exit (on its pidfd), then kills it and
    /// waits up to [`KILL_GRACE`] more. A worker that still has not exited (stuck in the
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
        // It has exited: this wait returns at once.
        match &mut self.child {
            Some(child) => {
                child.wait().map_or_else(|e| e.to_string(), |s| ublkd_proto::exit::describe(&s))
            }
            None => NOT_OUR_CHILD.to_string(),
        }
    }

    /// Sends SIGKILL (the worker is then reaped through its pidfd like any death).
    pub fn kill(&mut self) {
        let _ = pidfd_kill(self.pidfd.as_fd());
    }

    /// Whether the worker has exited (reaping it if so), and how.
    pub fn exited(&mut self) -> Option<String> {
        match &mut self.child {
            Some(child) => child.try_wait().ok().flatten().map(|s| ublkd_proto::exit::describe(&s)),
            None => exits_within(self.pidfd.as_fd(), Duration::ZERO)
                .then(|| format!("worker {} ended; {NOT_OUR_CHILD}", self.pid)),
        }
    }

    /// Lets a serving worker serve on after this supervisor exits, for the next one to
    /// take over: nothing of it is closed that it needs (it holds its own copies).
    pub fn leave_serving(mut self) {
        // Not ours to reap later either: this supervisor is about to exit.
        self.child = None;
    }
}

/// How the end of a worker taken over from a previous supervisor is told.
const NOT_OUR_CHILD: &str =
    "its exit status is unknown (started by a previous ublkd, so not this one's child)";

impl Drop for Worker {
    /// A worker let go before it was reaped (still running, or stuck after SIGKILL) is
    /// reaped later by [`reap_lingering`], so that it never stays a zombie.
    fn drop(&mut self) {
        if let Some(child) = &mut self.child
            && let Ok(None) = child.try_wait()
        {
            linger(child.id());
        }
    }
}

/// What a previous supervisor recorded of a worker it activated, to take it over by
/// ([`Worker::attach`]). Kept in the state dir, which only ublkd can write.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AttachClaim {
    pub dev_id: u32,
    pub pid: u32,
    /// The process's start time (`/proc/PID/stat`, clock ticks after boot): tells the
    /// worker from a later process that reused its pid.
    pub start_time: u64,
    pub generation: u64,
    /// [`Worker::held`]; empty while the activation has not answered.
    pub held: Vec<i32>,
}

impl AttachClaim {
    /// The claim on `worker`, activated at `generation` for `dev_id`; `None` if its
    /// start time cannot be read (it has exited).
    pub fn of(worker: &Worker, dev_id: u32, generation: u64) -> Option<AttachClaim> {
        Some(AttachClaim {
            dev_id,
            pid: worker.pid,
            start_time: process_start_time(worker.pid)?,
            generation,
            held: worker.held.clone(),
        })
    }
}

/// A process's start time, field 22 of `/proc/PID/stat` (after the command name,
/// which may hold spaces and parentheses: the last `)` ends it).
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name; 22 is the 20th.
    after_name.split_ascii_whitespace().nth(19)?.parse().ok()
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new fd returned by pidfd_open, owned by nothing else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) })
}

/// SIGKILL through the pidfd: never a process that reused the pid.
fn pidfd_kill(pidfd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: pidfd_send_signal takes a pidfd, a signal, a null siginfo and flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// A copy of the fd numbered `number` in the process behind `pidfd`.
fn getfd(pidfd: BorrowedFd<'_>, number: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd, an fd number and flags (0), and returns a new
    // fd (close-on-exec) or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), number, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new fd returned by pidfd_getfd, owned by nothing else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) })
}

/// Whether the process behind `pidfd` exits within `limit` (the pidfd turns readable).
fn exits_within(pidfd: BorrowedFd<'_>, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = [PollFd::new(pidfd, PollFlags::POLLIN)];
        match poll(&mut pfd, poll_timeout(left)) {
            Ok(n) => return n > 0,
            Err(Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
}

/// Why `fd` is not a unix `SOCK_SEQPACKET` socket (a worker's control socket), if not.
fn not_a_seqpacket_socket(fd: BorrowedFd<'_>) -> Option<String> {
    use nix::sys::socket::{AddressFamily, SockaddrLike, SockaddrStorage, getsockname, sockopt};
    match nix::sys::socket::getsockopt(&fd, sockopt::SockType) {
        Ok(SockType::SeqPacket) => {}
        Ok(other) => return Some(format!("a {other:?} socket, not a control socket")),
        Err(e) => return Some(format!("not a socket ({e})")),
    }
    match getsockname::<SockaddrStorage>(fd.as_raw_fd()).map(|a| a.family()) {
        Ok(Some(AddressFamily::Unix)) => None,
        Ok(family) => Some(format!("a {family:?} socket, not a unix one")),
        Err(e) => Some(format!("a socket whose address cannot be read ({e})")),
    }
}

/// Why `fd` is not a pipe, if it is not.
fn not_a_pipe(fd: BorrowedFd<'_>) -> Option<String> {
    match nix::sys::stat::fstat(fd) {
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFIFO => None,
        Ok(st) => Some(format!("not a pipe (mode {:o})", st.st_mode)),
        Err(e) => Some(format!("an fd that cannot be inspected ({e})")),
    }
}

/// A worker's stderr pipe: the read end for the relay, close-on-exec; the write end
/// for the worker, nonblocking (see the module doc).
fn stderr_pipe() -> Result<(OwnedFd, OwnedFd), WorkerError> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| WorkerError::Pipe(e.into()))?;
    let flags = nix::fcntl::fcntl(&write, nix::fcntl::FcntlArg::F_GETFL)
        .map_err(|e| WorkerError::Pipe(e.into()))?;
    let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(&write, nix::fcntl::FcntlArg::F_SETFL(flags))
        .map_err(|e| WorkerError::Pipe(e.into()))?;
    Ok((read, write))
}

/// `left` as poll's timeout, capped at the longest poll takes.
fn poll_timeout(left: Duration) -> PollTimeout {
    PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX)
}

fn linger(pid: u32) {
    LINGERING.lock().unwrap_or_else(|p| p.into_inner()).push(pid);
}

/// Reaps the workers that were let go before they exited and have exited since;
/// never waits.
pub fn reap_lingering() {
    let mut lingering = LINGERING.lock().unwrap_or_else(|p| p.into_inner());
    lingering.retain(|&pid| {
        let mut status = 0;
        // SAFETY: waitpid with WNOHANG on a child of ours writes only `status`.
        match unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) } {
            0 => true,
            n if n > 0 => {
                let how = ublkd_proto::exit::describe(
                    &std::os::unix::process::ExitStatusExt::from_raw(status),
                );
                tracing::info!(worker_pid = pid, "a worker let go earlier has ended: {how}");
                false
            }
            _ => false, // not ours (ECHILD): nothing to reap
        }
    });
}

/// Copies a worker's rings (fd numbers in the worker) into the supervisor, each
/// checked to be an io_uring. Where the kernel does not let the supervisor copy them
/// (EPERM: no CAP_SYS_PTRACE, or Yama's ptrace_scope 3), the worker serves as well and
/// only its recovery waits longer: that is logged, not refused.
fn copy_rings(
    pidfd: BorrowedFd<'_>,
    pid: u32,
    numbers: &[i32],
) -> Result<Vec<OwnedFd>, WorkerError> {
    if numbers.len() > MAX_RINGS {
        let what = format!("named {} rings, more than {MAX_RINGS}", numbers.len());
        return Err(WorkerError::Protocol { pid, what });
    }
    let mut rings = Vec::with_capacity(numbers.len());
    for &number in numbers {
        let ring = match getfd(pidfd, number) {
            Ok(ring) => ring,
            Err(source) if source.raw_os_error() == Some(libc::EPERM) => {
                tracing::warn!(
                    worker_pid = pid,
                    "cannot copy the worker's rings ({source}): its device's recoveries \
                     will wait for the kernel to tear the rings down"
                );
                return Ok(Vec::new());
            }
            Err(source) => return Err(WorkerError::Rings { pid, number, source }),
        };
        if let Some(what) = not_an_io_uring(ring.as_fd()) {
            let what = format!("named its fd {number} as a ring, but that is {what}");
            return Err(WorkerError::Protocol { pid, what });
        }
        rings.push(ring);
    }
    Ok(rings)
}

/// Unregisters every ring's buffers, then its files; returns how many calls the
/// kernel refused (ENXIO, nothing of that kind registered, is not a refusal).
fn unregister_files_and_buffers(rings: &[OwnedFd]) -> usize {
    let mut refused = 0;
    // Buffers first: with zero copy they hold the requests' pages, and ublk's release
    // waits for those before it lets the device go.
    for opcode in [uapi::IORING_UNREGISTER_BUFFERS, uapi::IORING_UNREGISTER_FILES] {
        for ring in rings {
            // SAFETY: io_uring_register with a null argument and no entries only reads
            // its scalar arguments; `ring` is an open fd.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_io_uring_register,
                    ring.as_raw_fd(),
                    opcode,
                    std::ptr::null::<libc::c_void>(),
                    0,
                )
            };
            if rc < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO) {
                refused += 1;
            }
        }
    }
    refused
}

/// Why `fd` is not an io_uring instance, if it is not.
fn not_an_io_uring(fd: BorrowedFd<'_>) -> Option<String> {
    match std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        Ok(target) if target.as_os_str() == "anon_inode:[io_uring]" => None,
        Ok(target) => Some(format!("an fd to {}", target.display())),
        Err(e) => Some(format!("an fd it cannot inspect ({e})")),
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::RawFd;

    use super::*;

    fn own_pidfd() -> OwnedFd {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, std::process::id(), 0) };
        assert!(raw >= 0, "pidfd_open: {}", io::Error::last_os_error());
        // SAFETY: `raw` is a new fd owned by nothing else.
        unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) }
    }

    fn io_uring_register(ring: RawFd, opcode: u32, arg: *const libc::c_void, n: u32) -> i64 {
        // SAFETY: `arg` points to `n` fds (or is null with `n` 0) for the call's duration.
        unsafe { libc::syscall(libc::SYS_io_uring_register, ring, opcode, arg, n) }
    }

    /// A claim on this very process, as if it were device 5's worker at generation 9
    /// holding its control socket's other end at `control_at`.
    fn claim_on_self(control_at: i32) -> AttachClaim {
        let pid = std::process::id();
        let start_time = process_start_time(pid).expect("our own start time");
        AttachClaim { dev_id: 5, pid, start_time, generation: 9, held: vec![control_at] }
    }

    fn attach_error(claim: &AttachClaim) -> String {
        match Worker::attach(claim, Duration::from_secs(2)) {
            Ok(w) => panic!("took over {w:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_claim_on_a_process_that_is_gone_or_reused_is_refused() {
        let mut child = Command::new("/bin/true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let claim = AttachClaim { pid: gone, ..claim_on_self(0) };
        assert!(attach_error(&claim).contains("no such process"), "{}", attach_error(&claim));
        let claim = AttachClaim { start_time: 1, ..claim_on_self(0) };
        let err = attach_error(&claim);
        assert!(err.contains("the pid belongs to another process now"), "{err}");
    }

    #[test]
    fn a_claim_that_names_no_socket_is_refused() {
        let err = attach_error(&AttachClaim { held: Vec::new(), ..claim_on_self(0) });
        assert!(err.contains("never told to hold its control socket"), "{err}");
        let null = File::open("/dev/null").unwrap();
        let err = attach_error(&claim_on_self(null.as_raw_fd()));
        assert!(err.contains(&format!("its fd {} is not a socket", null.as_raw_fd())), "{err}");
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = attach_error(&claim_on_self(a.as_raw_fd()));
        assert!(err.contains("a Stream socket, not a control socket"), "{err}");
    }

    /// A control socket pair whose far end answers one Attach with `answer`.
    fn answering(answer: FromWorker) -> (OwnedFd, std::thread::JoinHandle<()>) {
        let (near, far) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .unwrap();
        let answerer = std::thread::spawn(move || {
            let (got, _) = msg::recv_packet::<ToWorker>(far.as_fd()).unwrap();
            assert_eq!(got, ToWorker::Attach);
            msg::send_packet(far.as_fd(), &answer, &[]).unwrap();
        });
        (near, answerer)
    }

    #[test]
    fn a_worker_that_serves_another_device_or_generation_is_refused() {
        for (dev_id, generation) in [(6, 9), (5, 8)] {
            let (near, answerer) =
                answering(FromWorker::Attached { dev_id, generation, rings: Vec::new() });
            let err = attach_error(&claim_on_self(near.as_raw_fd()));
            answerer.join().unwrap();
            assert!(
                err.contains(&format!(
                    "it serves device {dev_id} generation {generation}, not device 5 \
                     generation 9"
                )),
                "{err}"
            );
        }
    }

    #[test]
    fn the_worker_the_claim_names_is_taken_over() {
        let (near, answerer) =
            answering(FromWorker::Attached { dev_id: 5, generation: 9, rings: Vec::new() });
        let worker = Worker::attach(&claim_on_self(near.as_raw_fd()), Duration::from_secs(2));
        answerer.join().unwrap();
        let mut worker = worker.unwrap();
        assert_eq!(worker.pid(), std::process::id());
        assert_eq!(worker.held(), [near.as_raw_fd()]);
        assert_eq!(worker.exited(), None, "a running worker taken over seen as ended");
        // Not our child: dropping it must neither kill nor try to reap this process.
        worker.leave_serving();
    }

    #[test]
    fn a_worker_let_go_before_it_exited_is_reaped_once_it_has() {
        let child = Command::new("/bin/sh").args(["-c", "sleep 0.2"]).spawn().unwrap();
        let pid = child.id();
        drop(child); // std neither kills nor reaps a dropped child
        linger(pid);
        let deadline = Instant::now() + Duration::from_secs(10);
        while LINGERING.lock().unwrap().contains(&pid) {
            assert!(Instant::now() < deadline, "worker {pid} was never reaped");
            reap_lingering();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "{pid} is left a zombie");
    }

    #[test]
    fn a_named_fd_that_is_not_a_ring_is_refused_naming_what_it_is() {
        let null = File::open("/dev/null").unwrap();
        let err = copy_rings(own_pidfd().as_fd(), 7, &[null.as_raw_fd()]).unwrap_err();
        assert!(matches!(err, WorkerError::Protocol { pid: 7, .. }), "{err:?}");
        assert!(err.to_string().contains("/dev/null"), "{err}");
    }

    #[test]
    fn a_named_fd_that_does_not_exist_is_refused() {
        let err = copy_rings(own_pidfd().as_fd(), 7, &[-1]).unwrap_err();
        assert!(matches!(err, WorkerError::Rings { number: -1, .. }), "{err:?}");
    }

    #[test]
    fn more_rings_than_threads_are_refused() {
        let err = copy_rings(own_pidfd().as_fd(), 7, &[0; MAX_RINGS + 1]).unwrap_err();
        assert!(err.to_string().contains(&format!("more than {MAX_RINGS}")), "{err}");
    }

    #[test]
    fn a_copied_ring_loses_its_files_and_buffers() {
        let mut params = [0u8; 120]; // struct io_uring_params, zeroed: defaults
        // SAFETY: io_uring_setup reads and writes `params` (120 bytes, its size).
        let raw = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4, params.as_mut_ptr()) };
        assert!(raw >= 0, "io_uring_setup: {}", io::Error::last_os_error());
        // SAFETY: `raw` is a new fd owned by nothing else.
        let ring = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) };
        let null = File::open("/dev/null").unwrap();
        let fds = [null.as_raw_fd()];
        const IORING_REGISTER_FILES: u32 = 2;
        let rc = io_uring_register(ring.as_raw_fd(), IORING_REGISTER_FILES, fds.as_ptr().cast(), 1);
        assert_eq!(rc, 0, "register files: {}", io::Error::last_os_error());

        let rings = copy_rings(own_pidfd().as_fd(), 7, &[ring.as_raw_fd()]).unwrap();
        assert_eq!(rings.len(), 1);
        assert_eq!(unregister_files_and_buffers(&rings), 0, "no buffers is not a refusal");
        let rc =
            io_uring_register(ring.as_raw_fd(), uapi::IORING_UNREGISTER_FILES, std::ptr::null(), 0);
        assert_eq!(
            (rc, io::Error::last_os_error().raw_os_error()),
            (-1, Some(libc::ENXIO)),
            "the ring still had files"
        );
    }
}
