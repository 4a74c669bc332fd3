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
//! which device and incarnation it serves. The data path never waits for a
//! supervisor, and a restart recovers no device.
//!
//! A worker's stderr is a pipe of its own, relayed into ublkd's log by
//! [`crate::worker_log`]. ublkd keeps a copy of its write end: when it leaves a worker
//! serving (a stop), it makes that end nonblocking (a flag of the pipe's open file, so
//! the worker's end too), and the worker, with nobody reading, drops log lines once the
//! pipe is full instead of stalling on them. While a ublkd reads, writes block as any
//! pipe's, so no line is lost. Nothing here waits for a worker without a bound: a killed worker stuck in the
//! kernel (in D state on a hung backing file, say) is left to [`reap_lingering`], which
//! the loop calls on every turn (SIGCHLD wakes it). A taken-over worker is not ublkd's
//! child: its end is seen on its pidfd, and its exit status is not known.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use ublkd_proto::exit::WorkerExit;
use ublkd_proto::msg::{
    self, FromWorker, LayerSet, MissingLayer, MsgError, SandboxLayer, SandboxReport, SandboxStatus,
    TargetSetup, ToWorker, WorkerSetup,
};

use crate::worker_log::PipeEnd;

mod activation;
mod ending;
mod pidfd;
mod rings;
pub(crate) mod spawn;
mod takeover;
pub mod wait_set;

pub use activation::Activating;
use ending::linger;
pub use ending::reap_lingering;
pub use pidfd::process_start_time;
pub use takeover::AttachClaim;

use pidfd::{exits_within, pidfd_kill};
use rings::{copy_rings, unregister_files_and_buffers};
use spawn::{ChildProcess, SpawnError, SpawnSpec, Spawned};

/// The most entries of a worker's sandbox report's lists kept (there are seven
/// namespace kinds and four layers).
const NAMESPACES_SHOWN: usize = 8;

/// The fd number at which a worker finds its control socket.
pub const WORKER_CONTROL_FD: i32 = 3;

/// How long a worker may take to exit after SIGKILL before it is left to be reaped
/// once it does.
const KILL_GRACE: Duration = Duration::from_millis(500);
/// How long after its control socket closed a worker's exit may take to show on its
/// pidfd (the files close first in an exit): a bound on the loop's wait.
const CLOSED_EXIT_GRACE: Duration = Duration::from_millis(250);

/// How long a stopped worker's last lines may take to reach the log.
const STDERR_END_WAIT: Duration = Duration::from_millis(200);

/// Workers that were let go before they exited (pids, still ours to reap: an unreaped
/// child's pid is never reused).
static LINGERING: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Errors in starting or talking to a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot start worker {}: {source}", binary.display())]
    Spawn { binary: std::path::PathBuf, source: SpawnError },
    #[error(
        "cannot start the worker in a pid namespace of its own ({0}); the device requires \
         its sandbox's \"namespaces\" layer (list it in sandbox_optional to run without)"
    )]
    PidNamespace(#[source] io::Error),
    #[error("cannot create the worker's control socket: {0}")]
    Socket(#[source] nix::Error),
    #[error("cannot send the worker its setup: {0}")]
    Send(#[source] MsgError),
    #[error("worker {pid} failed to set up: {reason}")]
    Failed { pid: u32, reason: String },
    #[error("worker {pid} exited before it was ready ({status})")]
    Died {
        pid: u32,
        status: String,
        /// Ended by a signal (killed from outside), not by an exit of its own.
        by_signal: bool,
    },
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
    #[error(
        "worker {pid} does not take ublkd's messages (its control socket's queue is full): \
         killed it"
    )]
    NotReading { pid: u32 },
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
    child: Option<ChildProcess>,
    pid: u32,
    control: OwnedFd,
    /// A copy of the read end of the worker's stderr pipe, handed to the worker at
    /// activation (see [`ToWorker::Activate`]); `None` once handed, or where ublkd's
    /// stderr is the worker's.
    stderr_copy: Option<OwnedFd>,
    /// A copy of the write end of the worker's stderr pipe (the worker's fd 2), made
    /// nonblocking when the worker is left serving ([`Self::leave_serving`]).
    stderr_write: Option<OwnedFd>,
    /// Where the activated worker holds, in its fd table, the fds that outlive this
    /// supervisor: its control socket's other end, then its stderr's read end (if any).
    held: Vec<i32>,
    /// What the worker said its sandbox achieved (`None`: not sandboxed).
    pub sandbox: Option<SandboxReport>,
    /// Its sandbox as `/proc` showed it once it stood by (or was taken over), with
    /// what it reported: what `status` shows. Read once, not per `status`: a sandbox
    /// never loosens (ids, seccomp, no_new_privs and namespaces are for life), and a
    /// read after the worker's death could find a later process under its pid.
    sandbox_seen: Option<SandboxStatus>,
    /// Readable once the worker has exited: how the supervisor learns of a death at
    /// once, without polling (and without the races of pids being reused).
    pidfd: OwnedFd,
    /// The worker's io_uring instances (named in Standby, copied with pidfd_getfd).
    /// Held so that when the worker dies, [`Self::release_device`] can make the kernel
    /// let go of `/dev/ublkcN` at once.
    rings: Vec<OwnedFd>,
    /// When the relay is done with the worker's stderr (`None`: ublkd's stderr).
    stderr_end: Option<PipeEnd>,
    /// The target it was set up for (`Null` until its setup is sent, and for a worker
    /// taken over): which fds its activation carries.
    target: TargetSetup,
    /// Whether ublkd copies the worker's rings to release its device at once when it
    /// dies (its setup's `fast_release`): ublkd's decision, which a worker naming rings
    /// it was not asked for cannot change.
    fast_release: bool,
    /// When it answered Ready to its activation (`None`: not activated by this ublkd).
    activated: Option<Instant>,
    /// How many fds its activation asked it to hold (checked against its Ready).
    held_sent: usize,
    /// A layer ublkd could not give it as it started it (its pid namespace), added to
    /// what it reports missing once it stands by.
    spawned_without: Option<MissingLayer>,
    /// An rbd worker's RADOS client identity, as it reported it in Standby or
    /// Attached (checked by [`rbd_client_name`]): what its successors fence.
    pub rbd_client: Option<String>,
}

impl Worker {
    /// Starts `binary` for device `dev_id`, sandboxed as `sandbox` if given. An rbd
    /// worker (`rbd`: the TCP ports it may connect to, see
    /// [`crate::rbd::conf::connect_ports`]) is told so on its command line: it loads
    /// librbd before its sandbox empties its filesystem, and its sandbox lets it reach
    /// those ports.
    pub fn spawn(
        binary: &Path,
        dev_id: u32,
        sandbox: Option<WorkerSandbox>,
        rbd: Option<&str>,
    ) -> Result<Worker, WorkerError> {
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(WorkerError::Socket)?;
        let mut args = vec![
            "--control-fd".to_string(),
            WORKER_CONTROL_FD.to_string(),
            "--dev-id".to_string(),
            dev_id.to_string(),
        ];
        let relay = crate::worker_log::Relay::get();
        let mut stderr_read = None;
        let mut stderr_write = None;
        if relay.is_some() {
            let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
                .map_err(|e| WorkerError::Pipe(e.into()))?;
            stderr_write = Some(write);
            stderr_read = Some(read);
        }
        if let Some(ports) = rbd {
            args.extend(["--rbd".into(), "--rbd-connect-ports".into(), ports.into()]);
        }
        let new_pid_namespace = match sandbox {
            Some(WorkerSandbox { identity: id, optional }) => {
                args.extend(["--sandbox-uid".into(), id.uid.to_string()]);
                args.extend(["--sandbox-gid".into(), id.gid.to_string()]);
                if !optional.is_empty() {
                    args.push("--sandbox-optional".into());
                    args.push(SandboxLayer::join(&optional.layers()));
                }
                true
            }
            None => {
                args.push("--no-sandbox".into());
                false
            }
        };
        let mut fds = vec![(theirs.as_fd(), WORKER_CONTROL_FD)];
        if let Some(write) = &stderr_write {
            fds.push((write.as_fd(), 2));
        }
        let spec = SpawnSpec {
            binary,
            args,
            fds,
            // ublkd's raised fd limit is its own (see crate::rlimit): the worker starts
            // with the one ublkd was given.
            nofile: crate::rlimit::inherited_nofile()
                .map(|(soft, hard)| libc::rlimit { rlim_cur: soft, rlim_max: hard }),
            new_pid_namespace,
        };
        let mut spawned_without = None;
        let spawned = match spawn::spawn(&spec) {
            // The pid namespace is part of the `namespaces` layer: where the kernel
            // refuses it and the device allows running without that layer, the worker
            // runs without it (it then finds the others refused too, and says so).
            Err(SpawnError::Clone(e))
                if new_pid_namespace
                    && sandbox.is_some_and(|s| s.optional.contains(SandboxLayer::Namespaces)) =>
            {
                spawned_without = Some(MissingLayer {
                    layer: SandboxLayer::Namespaces,
                    cause: format!("clone(CLONE_NEWPID) (its pid namespace): {e}"),
                });
                spawn::spawn(&SpawnSpec { new_pid_namespace: false, ..spec })
            }
            other => other,
        };
        let Spawned { child, pidfd } = spawned.map_err(|source| match source {
            SpawnError::Clone(e) if new_pid_namespace => WorkerError::PidNamespace(e),
            source => WorkerError::Spawn { binary: binary.to_path_buf(), source },
        })?;
        drop(theirs);
        let pid = child.id();
        wait_set::register(&pidfd, dev_id, pid);
        let mut worker = Worker::bare(pid, ours, pidfd);
        worker.child = Some(child);
        worker.stderr_write = stderr_write;
        worker.spawned_without = spawned_without;
        if let (Some(relay), Some(read)) = (relay, stderr_read) {
            worker.stderr_copy = read.try_clone().ok();
            worker.stderr_end = Some(relay.watch(read, dev_id, pid));
        }
        Ok(worker)
    }

    /// Reads the worker's sandbox from `/proc` (see `sandbox_seen`): a sandboxed
    /// worker's, once it has locked itself down.
    fn see_sandbox(&mut self) {
        self.sandbox_seen = self
            .sandbox
            .as_ref()
            .and_then(|report| crate::inspect::sandbox_of(self.pid, Some(report)));
    }

    /// Its sandbox as `/proc` showed it when it stood by (`None`: not sandboxed).
    pub fn sandbox_status(&self) -> Option<&SandboxStatus> {
        self.sandbox_seen.as_ref()
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
        self.target = setup.target;
        self.fast_release = setup.fast_release;
        match self.send(&ToWorker::Setup(setup.clone()), fds) {
            Ok(()) => Ok(()),
            Err(e @ WorkerError::NotReading { .. }) => Err(e),
            // A worker that could not set its sandbox up said why before it ended.
            Err(source) => match self.receive(Duration::from_millis(100)) {
                Ok((FromWorker::Failed { reason }, _)) => {
                    Err(WorkerError::Failed { pid: self.pid(), reason })
                }
                _ => Err(source),
            },
        }
    }

    /// Sends `message` to the worker without waiting. ublkd never leaves more than
    /// one message unanswered, so a full queue means the worker stopped reading, or
    /// stuffed its own queue through a copy of ublkd's end (which a serving worker
    /// holds): either way it cannot be trusted to serve, and is killed at once, so that
    /// its death is handled as any other (its device recovered).
    fn send(&self, message: &ToWorker, fds: &[BorrowedFd<'_>]) -> Result<(), WorkerError> {
        match msg::try_send_packet(self.control(), message, fds) {
            Ok(()) => Ok(()),
            Err(MsgError::WouldBlock) => {
                self.kill();
                let error = WorkerError::NotReading { pid: self.pid };
                tracing::error!(worker_pid = self.pid, event = "worker_not_reading", "{error}");
                Err(error)
            }
            Err(e) => Err(WorkerError::Send(e)),
        }
    }

    /// Waits up to `timeout` for the answer to the setup: standing by, or why not.
    pub fn standby_answer(&mut self, timeout: Duration) -> Result<(), WorkerError> {
        match self.receive(timeout)? {
            (FromWorker::Standby { sandbox, rings, client }, _) => {
                self.rbd_client = self.checked_client(client)?;
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
                if let (Some(report), Some(missing)) =
                    (&mut self.sandbox, self.spawned_without.take())
                {
                    report.missing.push(missing);
                }
                self.rings = self.copy_rings(&rings)?;
                self.see_sandbox();
                Ok(())
            }
            (other, _) => self.unexpected("Standby", other),
        }
    }

    /// The client identity a worker reported, if it is one an rbd worker may report:
    /// the supervisor later asks a successor to break the image's lock if this owner
    /// holds it, so a name that is not a RADOS address is refused, not passed on.
    fn checked_client(&self, client: Option<String>) -> Result<Option<String>, WorkerError> {
        match client {
            None => Ok(None),
            Some(_) if self.target != TargetSetup::Rbd => {
                let what = "a client identity from a worker that serves no rbd image".into();
                Err(WorkerError::Protocol { pid: self.pid, what })
            }
            Some(name) if rbd_client_name(&name) => Ok(Some(name)),
            Some(name) => {
                let what = format!("client identity {:?}", msg::untrusted_text(&name));
                Err(WorkerError::Protocol { pid: self.pid, what })
            }
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

    /// Copies the rings the worker named, where ublkd asked for them; naming rings
    /// otherwise breaks the protocol.
    fn copy_rings(&self, named: &[i32]) -> Result<Vec<OwnedFd>, WorkerError> {
        if !self.fast_release && !named.is_empty() {
            let what = format!("named {} rings, which ublkd did not ask for", named.len());
            return Err(WorkerError::Protocol { pid: self.pid, what });
        }
        copy_rings(self.pidfd.as_fd(), self.pid, named)
    }

    /// A worker that is none, for tests of what holds workers: a process that has
    /// ended (signalling it does nothing) and a control socket nobody reads.
    #[cfg(test)]
    pub fn stand_in() -> Worker {
        let mut child = std::process::Command::new("true").spawn().expect("true runs");
        // Opened before the reap, so that it names that process and no later one.
        let pidfd = crate::sys::pidfd_open(child.id()).expect("pidfd_open");
        child.wait().expect("true ends");
        let (control, _) = std::os::unix::net::UnixDatagram::pair().expect("socketpair");
        Worker::bare(child.id(), control.into(), pidfd)
    }

    /// Worker `pid`, known by its `control` socket and `pidfd`, with nothing else yet:
    /// not ublkd's child, no stderr relay, no sandbox report, never activated.
    fn bare(pid: u32, control: OwnedFd, pidfd: OwnedFd) -> Worker {
        Worker {
            child: None,
            pid,
            control,
            stderr_copy: None,
            stderr_write: None,
            held: Vec::new(),
            sandbox: None,
            sandbox_seen: None,
            pidfd,
            rings: Vec::new(),
            stderr_end: None,
            target: TargetSetup::Null,
            fast_release: false,
            activated: None,
            held_sent: 0,
            spawned_without: None,
            rbd_client: None,
        }
    }

    /// Whether it has exited (without waiting, and without reaping it).
    pub fn has_exited(&self) -> bool {
        exits_within(self.pidfd.as_fd(), Duration::ZERO)
    }

    /// How long it has served since this ublkd activated it (`None`: it did not).
    pub fn served_for(&self) -> Option<Duration> {
        self.activated.map(|at| at.elapsed())
    }

    /// Whether the worker has something to say (a message, or its end) right now.
    pub fn has_answered(&self) -> bool {
        crate::sys::readable_now(self.control.as_fd())
    }

    /// The target it was set up for.
    pub fn target_setup(&self) -> TargetSetup {
        self.target
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
        let received = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(WorkerError::Timeout { pid, secs: timeout.as_secs() });
            }
            if crate::sys::wait_readable(self.control.as_fd(), left).is_ok_and(|ready| !ready) {
                continue;
            }
            // Never a blocking read: a serving worker holds a copy of this end, and
            // may have taken the packet the poll saw.
            let mut received = msg::try_recv_packet::<FromWorker>(self.control());
            // A worker that ends with our message unread (one whose sandbox failed ends
            // before it reads its setup) resets the connection, which the kernel
            // reports once, before the packets the worker sent first: its Failed among
            // them.
            if matches!(&received, Err(MsgError::Io(e)) if e.raw_os_error() == Some(libc::ECONNRESET))
            {
                received = msg::try_recv_packet::<FromWorker>(self.control());
            }
            match received {
                Err(MsgError::WouldBlock) => continue,
                received => break received,
            }
        };
        match received {
            Ok(got) => Ok(got),
            // Its socket closes as it exits, and the exit completes moments later. One
            // that closed it and lives on (or whose exit is slow: a loaded machine) is
            // killed, not waited for on the loop, and reaped once it ends
            // (`reap_lingering`): a death by ublkd's signal.
            Err(MsgError::Closed) if exits_within(self.pidfd.as_fd(), CLOSED_EXIT_GRACE) => {
                let status = self.reap(Duration::ZERO);
                Err(WorkerError::Died { pid, status, by_signal: self.ended_by_signal() })
            }
            Err(MsgError::Closed) => {
                self.kill();
                let status = format!(
                    "closed its control socket and had not exited {} ms later: killed",
                    CLOSED_EXIT_GRACE.as_millis()
                );
                Err(WorkerError::Died { pid, status, by_signal: true })
            }
            Err(e) => Err(WorkerError::Protocol { pid, what: e.to_string() }),
        }
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

/// Makes the pipe end `fd` nonblocking (see the module doc).
fn set_nonblocking(fd: BorrowedFd<'_>) -> nix::Result<()> {
    let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)?;
    let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(flags)).map(drop)
}

/// Whether `name` looks like a RADOS client address as librbd names a lock's owner
/// (`127.0.0.1:0/2961794808`, `[::1]:0/42`, with a `v2:` prefix where the messenger
/// adds one): short, and made of nothing but an address's characters.
pub fn rbd_client_name(name: &str) -> bool {
    (1..=96).contains(&name.len())
        && name.contains('/')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b".:/[]-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts `script` (a shell script) as a worker, unsandboxed. The script's file
    /// stays: the shell reads it by its path once started.
    fn spawn_script(tag: &str, script: &str) -> Worker {
        let path = std::env::temp_dir().join(format!("ublkd-worker-{tag}-{}", std::process::id()));
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        // Another test thread forking while the file was open for writing makes exec
        // fail with ETXTBSY until that child has exec'd in turn.
        let mut tries = 0;
        loop {
            match Worker::spawn(&path, 1, None, None) {
                Err(WorkerError::Spawn { source: SpawnError::Exec(e), .. })
                    if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 50 =>
                {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                spawned => break spawned.unwrap(),
            }
        }
    }

    #[test]
    fn a_starting_worker_that_ends_has_answered_and_a_silent_one_times_out() {
        // What the loop relies on to move a new device on without blocking: the control
        // socket of a worker that ends becomes readable (and reading says it died), and
        // one of a worker that says nothing does not.
        let mut silent = spawn_script("silent", "#!/bin/sh\nexec sleep 30\n");
        let mut ending = spawn_script("ending", "#!/bin/sh\nexit 3\n");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ending.has_answered() {
            assert!(Instant::now() < deadline, "a worker that ended has not answered");
            std::thread::sleep(Duration::from_millis(10));
        }
        let died = ending.standby_answer(Duration::from_millis(100));
        assert!(matches!(died, Err(WorkerError::Died { .. })), "{died:?}");
        assert!(!silent.has_answered(), "a silent worker has answered");
        let silence = silent.standby_answer(Duration::from_millis(100));
        assert!(matches!(silence, Err(WorkerError::Timeout { .. })), "{silence:?}");
        silent.kill();
        silent.reap(Duration::ZERO);
        assert!(silent.exited().is_some(), "the silent worker was not ended");
        for tag in ["silent", "ending"] {
            let path = format!("ublkd-worker-{tag}-{}", std::process::id());
            let _ = std::fs::remove_file(std::env::temp_dir().join(path));
        }
    }

    /// A worker that closes its control socket and lives on holds the loop for at
    /// most `CLOSED_EXIT_GRACE`, not the 2 s it once did: it is killed, and says so.
    #[test]
    fn a_worker_that_closes_its_socket_and_lives_on_is_killed_not_waited_for() {
        let mut closer = spawn_script(
            "closer",
            "#!/bin/sh
exec 3>&-
exec sleep 30
",
        );
        let asked = Instant::now();
        let answer = closer.standby_answer(Duration::from_secs(10));
        let took = asked.elapsed();
        assert!(
            matches!(&answer, Err(WorkerError::Died { status, by_signal: true, .. })
                if status.contains("closed its control socket and had not exited")),
            "{answer:?}"
        );
        assert!(took < Duration::from_secs(1), "the closed socket held the caller {took:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !closer.has_exited() {
            assert!(Instant::now() < deadline, "the worker was not killed");
            std::thread::sleep(Duration::from_millis(10));
        }
        let path = format!("ublkd-worker-closer-{}", std::process::id());
        let _ = std::fs::remove_file(std::env::temp_dir().join(path));
    }

    #[test]
    fn a_worker_let_go_before_it_exited_is_reaped_once_it_has() {
        let child =
            std::process::Command::new("/bin/sh").args(["-c", "sleep 0.2"]).spawn().unwrap();
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
}
