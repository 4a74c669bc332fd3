//! Taking over a worker that a previous supervisor left serving: the claim ublkd
//! records of each activated worker, and the checks it must pass before this ublkd
//! treats the process as the device's worker (see the parent module's doc).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::sys::socket::SockType;
use ublkd_config::NbdTransport;
use ublkd_proto::msg::{self, FromWorker, MAX_NBD_CONNECTIONS, SandboxReport, ToWorker};

use super::pidfd::{exits_within, getfd, pidfd_kill, pidfd_open, process_start_time};
use super::{Worker, WorkerError};

impl Worker {
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
    /// `fast_release`: whether ublkd releases this device's dead workers at once (and so
    /// copies the worker's rings).
    pub fn attach(
        claim: &AttachClaim,
        fast_release: bool,
        timeout: Duration,
    ) -> Result<Worker, WorkerError> {
        let pid = claim.pid;
        let refused = |what: String| WorkerError::Attach { pid, what };
        let pidfd = pidfd_open(pid).map_err(|e| refused(format!("no such process ({e})")))?;
        super::wait_set::register(&pidfd, claim.dev_id, pid);
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
        // Its fd 2 (`stderr_write`), for the next stop, is copied below once checked.
        let mut worker = Worker::bare(pid, control, pidfd);
        worker.held.clone_from(&claim.held);
        worker.sandbox.clone_from(&claim.sandbox);
        worker.fast_release = fast_release;
        worker.send(&ToWorker::Attach, &[])?;
        let deadline = Instant::now() + timeout;
        let (dev_id, generation, rings, client) = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match worker.receive(left)? {
                // A worker taken over mid-activation says Ready first.
                (FromWorker::Ready(_), _) => continue,
                // An rbd image's size change reported to the previous ublkd and not
                // read: the device keeps its recorded size (a later change, or
                // `ublkctl resize`, sets it right).
                (FromWorker::ImageResized { .. }, _) => continue,
                (FromWorker::Attached { dev_id, generation, rings, client }, _) => {
                    break (dev_id, generation, rings, client);
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
        worker.rings = worker.copy_rings(&rings)?;
        worker.rbd_client = match client {
            Some(name) if !super::rbd_client_name(&name) => {
                return Err(refused(format!(
                    "it names its client {:?}, which is no RADOS address",
                    msg::untrusted_text(&name)
                )));
            }
            client => client,
        };
        worker.see_sandbox();
        if let (Some(relay), Some(&stderr_at)) =
            (crate::worker_log::Relay::get(), claim.held.get(1))
        {
            match getfd(worker.pidfd.as_fd(), stderr_at) {
                Ok(read) if not_a_pipe(read.as_fd()).is_none() => {
                    worker.stderr_end = Some(relay.watch(read, dev_id, pid));
                    worker.stderr_write = getfd(worker.pidfd.as_fd(), 2)
                        .ok()
                        .filter(|w| not_a_pipe(w.as_fd()).is_none());
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

    /// Copies of the connections to the NBD server `server` that the taken-over worker
    /// holds, so that this ublkd can end them the way it ends those of a worker it
    /// started itself: drained before a successor connects if the worker dies
    /// ([`crate::nbd::drain`]), disconnected when the device is deleted. The previous
    /// ublkd's copies went with it. Found by what the kernel says of each of the
    /// worker's sockets, not by anything the worker says: a stream socket whose peer
    /// is the server (its unix socket's path, or its TCP port; the worker's sandbox
    /// cannot open a TCP socket of its own). One copy per socket, however many fds the
    /// worker holds of it, and at most [`MAX_NBD_CONNECTIONS`]: a worker cannot make
    /// ublkd hold more fds than it handed out. Best effort: a socket that cannot be
    /// read is left out, as before this copy existed.
    pub fn copy_nbd_connections(&self, server: &NbdTransport) -> Vec<OwnedFd> {
        use std::os::unix::ffi::OsStrExt;
        let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", self.pid)) else {
            return Vec::new();
        };
        let mut copies = Vec::new();
        let mut sockets = std::collections::HashSet::new();
        for entry in fds.flatten() {
            if copies.len() == usize::from(MAX_NBD_CONNECTIONS) {
                break;
            }
            let Some(number) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            // A socket's link reads "socket:[INODE]": nothing else is copied.
            let link = std::fs::read_link(entry.path()).unwrap_or_default();
            if !link.as_os_str().as_bytes().starts_with(b"socket:") {
                continue;
            }
            if let Ok(copy) = getfd(self.pidfd.as_fd(), number)
                && connected_to(copy.as_fd(), server)
                && let Ok(stat) = nix::sys::stat::fstat(copy.as_fd())
                && sockets.insert(stat.st_ino)
            {
                copies.push(copy);
            }
        }
        copies
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
    /// What the worker reported of its sandbox when it stood by, for `status` after a
    /// take-over (a claim written before this field has none).
    #[serde(default)]
    pub sandbox: Option<SandboxReport>,
    /// An rbd device's workers' RADOS clients, the claimed one among them (see
    /// `RbdTarget::fence_for`); empty for other targets and older claims.
    #[serde(default)]
    pub rbd_clients: Vec<String>,
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
            sandbox: worker.sandbox.clone(),
            rbd_clients: Vec::new(),
        })
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

/// Whether `fd` is a stream socket connected to `server`.
fn connected_to(fd: BorrowedFd<'_>, server: &NbdTransport) -> bool {
    use nix::sys::socket::{SockaddrStorage, getpeername, sockopt};
    if nix::sys::socket::getsockopt(&fd, sockopt::SockType) != Ok(SockType::Stream) {
        return false;
    }
    let Ok(peer) = getpeername::<SockaddrStorage>(fd.as_raw_fd()) else { return false };
    match server {
        NbdTransport::Unix { socket } => {
            peer.as_unix_addr().and_then(|a| a.path()) == Some(socket.as_path())
        }
        NbdTransport::Tcp { port, .. } => {
            let v4 = peer.as_sockaddr_in().map(|a| a.port());
            let v6 = peer.as_sockaddr_in6().map(|a| a.port());
            v4.or(v6) == Some(*port)
        }
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

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::OwnedFd;
    use std::process::Command;

    use nix::sys::socket::{AddressFamily, SockFlag, socketpair};

    use super::*;

    /// A claim on this very process, as if it were device 5's worker at generation 9
    /// holding its control socket's other end at `control_at`.
    fn claim_on_self(control_at: i32) -> AttachClaim {
        let pid = std::process::id();
        let start_time = process_start_time(pid).expect("our own start time");
        AttachClaim {
            dev_id: 5,
            pid,
            start_time,
            generation: 9,
            held: vec![control_at],
            sandbox: None,
            rbd_clients: Vec::new(),
        }
    }

    fn attach_error(claim: &AttachClaim) -> String {
        match Worker::attach(claim, true, Duration::from_secs(2)) {
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
            let (near, answerer) = answering(FromWorker::Attached {
                dev_id,
                generation,
                rings: Vec::new(),
                client: None,
            });
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

    /// This very process taken over as device 5's worker at generation 9, and the
    /// control socket's near end it was claimed to hold.
    fn self_taken_over() -> (Worker, OwnedFd) {
        let (near, answerer) = answering(FromWorker::Attached {
            dev_id: 5,
            generation: 9,
            rings: Vec::new(),
            client: None,
        });
        let worker = Worker::attach(&claim_on_self(near.as_raw_fd()), true, Duration::from_secs(2));
        answerer.join().unwrap();
        (worker.unwrap(), near)
    }

    #[test]
    fn the_worker_the_claim_names_is_taken_over() {
        let (mut worker, near) = self_taken_over();
        assert_eq!(worker.pid(), std::process::id());
        assert_eq!(worker.held(), [near.as_raw_fd()]);
        assert_eq!(worker.exited(), None, "a running worker taken over seen as ended");
        // Not our child: dropping it must neither kill nor try to reap this process.
        worker.leave_serving();
    }

    #[test]
    fn a_taken_over_workers_connections_to_its_server_are_found_by_their_peer() {
        use std::net::{TcpListener, TcpStream};
        use std::os::unix::net::{UnixListener, UnixStream};
        let (worker, _near) = self_taken_over();
        // This process stands in for the worker: two connections to a unix server, one
        // to another server, the accepted ends, and socket pairs, of which only the
        // first two are the server's.
        let dir = std::env::temp_dir().join(format!("ublkd-copy-nbd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (path, other) = (dir.join("nbd.sock"), dir.join("other.sock"));
        let (server, other_server) =
            (UnixListener::bind(&path).unwrap(), UnixListener::bind(&other).unwrap());
        let ours = [UnixStream::connect(&path).unwrap(), UnixStream::connect(&path).unwrap()];
        let _theirs = UnixStream::connect(&other).unwrap();
        let _accepted = [server.accept().unwrap(), other_server.accept().unwrap()];
        let _pair = UnixStream::pair().unwrap();
        // A second fd of the same connection is not a second connection.
        let _dup = ours[0].try_clone().unwrap();
        let copies = worker.copy_nbd_connections(&NbdTransport::Unix { socket: path.clone() });
        let inode = |fd: BorrowedFd<'_>| nix::sys::stat::fstat(fd).unwrap().st_ino;
        let mut got: Vec<_> = copies.iter().map(|c| inode(c.as_fd())).collect();
        let mut want: Vec<_> = ours.iter().map(|s| inode(s.as_fd())).collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "copies of the connections to {}", path.display());

        // TCP: the connection to the server's port, not the accepted end (whose peer
        // port is the client's).
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let client = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let _accepted = listener.accept().unwrap();
        let tcp = NbdTransport::Tcp { host: "127.0.0.1".into(), port };
        let copies = worker.copy_nbd_connections(&tcp);
        let got: Vec<_> = copies.iter().map(|c| inode(c.as_fd())).collect();
        assert_eq!(got, [inode(client.as_fd())], "copies of the connections to port {port}");
        worker.leave_serving();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
