//! Supervisor ↔ worker: [`ToWorker`] / [`FromWorker`] over a `SOCK_SEQPACKET`
//! socketpair, one message per packet, file descriptors attached with SCM_RIGHTS; what
//! a worker is set up with, and what it reports of its sandbox.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};

use crate::codec::{self, MAX_MESSAGE_BYTES};

#[cfg(doc)]
use super::rbd::MAX_FENCED_CLIENTS;
use super::rbd::RbdSetup;
use super::{DataPath, MAX_FDS, MsgError};

/// What the device's target is, as the worker needs to know it. The target's data
/// (memory pages, backing file) arrives as an fd, never as a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TargetSetup {
    /// Completes every I/O at once, touching no data.
    Null,
    /// RAM: a memfd of the device's size, owned by the supervisor.
    Memory,
    /// A file or block device at least the device's size, opened by the supervisor
    /// (with O_DIRECT or not: the fd carries it).
    Loop,
    /// Fails every I/O with EIO, touching no backend: what a device serves once its
    /// restart budget is spent and `recovery.on_restart_limit` is `"fail-io"`.
    FailIo,
    /// An NBD server's export over `connections` connections (several only where the
    /// export allows it: `NBD_FLAG_CAN_MULTI_CONN`; queue thread `i` uses connection
    /// `i % connections`; one per thread with [`WorkerSetup::zero_copy`]). No fd at
    /// setup: the supervisor connects and negotiates when the worker is activated (a
    /// standby's connection would sit idle, and some servers take one client at a
    /// time), and sends the sockets, in the transmission phase with structured or
    /// simple replies (the worker reads both; simple only with
    /// [`WorkerSetup::zero_copy`]), with [`ToWorker::Activate`].
    Nbd { connections: u8 },
    /// An RBD image in a Ceph cluster, through librbd, which the worker loads. Its
    /// cluster, image and key come in [`WorkerSetup::rbd`]; the worker connects while
    /// standing by and takes the image's exclusive lock at activation, fencing the
    /// earlier workers' clients first (`ToWorker::Activate`'s `fence`).
    Rbd,
}

/// The most connections an nbd worker is given.
pub const MAX_NBD_CONNECTIONS: u8 = 8;

impl TargetSetup {
    /// How many fds follow the fixed ones for this target.
    pub const fn target_fds(&self) -> usize {
        match self {
            TargetSetup::Null
            | TargetSetup::FailIo
            | TargetSetup::Nbd { .. }
            | TargetSetup::Rbd => 0,
            TargetSetup::Memory | TargetSetup::Loop => 1,
        }
    }

    /// How many fds of the target's follow `/dev/ublkcN` in [`ToWorker::Activate`].
    pub const fn activation_fds(&self) -> usize {
        match self {
            TargetSetup::Nbd { connections } => *connections as usize,
            _ => 0,
        }
    }
}

/// Everything a worker needs to get ready to serve a device, sent (with the shared
/// region's fd, then the target's fd if it has one) to a freshly started worker. The
/// worker maps what it can and answers [`FromWorker::Standby`]; it gets the device
/// itself (`/dev/ublkcN`) only with [`ToWorker::Activate`], so a standby worker can
/// wait, warm, until a device needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSetup {
    pub dev_id: u32,
    /// The device's size in bytes.
    pub size_bytes: u64,
    pub nr_queues: u16,
    pub queue_depth: u16,
    /// The largest request in bytes (each tag's buffer size).
    pub max_io_buf_bytes: u32,
    pub nr_threads: u16,
    pub target: TargetSetup,
    /// Logical block size in bytes (the target may use it to align).
    pub block_size: u32,
    /// The device has `UBLK_F_AUTO_BUF_REG` (a zero-copy loop or nbd device, or one
    /// failing its I/O after being one): the worker gives each tag a buffer index
    /// instead of a buffer address, and requests with data arrive registered in its
    /// ring. Always with [`DataPath::Batch`]. For [`TargetSetup::Nbd`], the supervisor
    /// guarantees `connections == nr_threads` (thread `i` alone uses connection `i`, so
    /// the thread that fetched a request reads its reply), and every connection was
    /// negotiated without `NBD_OPT_STRUCTURED_REPLY`: the server sends simple replies
    /// only.
    pub zero_copy: bool,
    /// `recovery.fast_release`: the worker names its rings in Standby (see there) and
    /// makes them so that the supervisor may unregister their files (not
    /// SINGLE_ISSUER, so without DEFER_TASKRUN); otherwise they use DEFER_TASKRUN and
    /// a recovery waits for the kernel's teardown of the dead worker's rings.
    pub fast_release: bool,
    /// The ublk commands the device was created for (see [`DataPath`]).
    pub data_path: DataPath,
    /// With [`TargetSetup::Rbd`] (and only then): the cluster and image.
    pub rbd: Option<RbdSetup>,
    /// The device is read-only: the worker completes every request that would change
    /// data (WRITE, DISCARD, WRITE_ZEROES) with `EROFS` without its target seeing it,
    /// whatever the kernel sends (the kernel refuses writes to a read-only disk too,
    /// but the worker does not rely on it).
    #[serde(default)]
    pub read_only: bool,
}

impl WorkerSetup {
    /// How many fds come with the setup message.
    pub const fn fd_count(&self) -> usize {
        1 + self.target.target_fds()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToWorker {
    /// Get ready (fds: the shared region, the target's).
    Setup(WorkerSetup),
    /// Serve the device now: PREP every tag, arm FETCH, answer Ready. `generation` is
    /// the shared region's generation for this incarnation. fds: `/dev/ublkcN`, the
    /// target's if it is given at activation ([`TargetSetup::activation_fds`]), then
    /// the ones the worker holds for as long as it serves, unused, so that they outlive
    /// the supervisor ([`MAX_HELD_FDS`] at most): the supervisor's own end of this
    /// control socket (without which the worker would see the socket end when the
    /// supervisor exits), and the read end of the worker's stderr pipe where ublkd
    /// relays it. A restarted ublkd takes them back with pidfd_getfd at the numbers
    /// the worker names in Ready, and talks to the worker that served on meanwhile.
    ///
    /// `fence` (rbd only, else empty): the client identities of the device's earlier
    /// workers (what each said in [`FromWorker::Standby`]), at most
    /// [`MAX_FENCED_CLIENTS`]. An exclusive-lock owner among them is broken, which
    /// blocklists it so that a write it still has in flight can never land, before the
    /// new worker takes the lock; any other owner is another client's, and the
    /// activation fails naming it.
    Activate { generation: u64, fence: Vec<String> },
    /// Stop serving and exit (the device is being stopped).
    Shutdown,
    /// From a supervisor that took the serving worker over (a restarted ublkd): say
    /// which device and incarnation you serve. Answered with [`FromWorker::Attached`].
    Attach,
    /// The device is being deleted and its stop waits on requests the backend holds (an
    /// rbd worker's, while the Ceph cluster is away): fail every request held now with
    /// EIO, and every new one at once. Not answered; a target that holds nothing of its
    /// own ignores it.
    GiveUpHeld,
}

/// The most fds a worker holds for its supervisor's successor (see
/// [`ToWorker::Activate`]).
pub const MAX_HELD_FDS: usize = 2;

/// A layer of the worker sandbox that a kernel (or where ublkd runs) can refuse. A
/// worker that cannot apply one refuses to run, unless its device lists the layer as
/// optional (`sandbox_optional`); then it runs without and says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxLayer {
    /// Its own user namespace, mapping only the worker's uid and gid. Refused inside a
    /// chroot, and where user namespaces are restricted (`user.max_user_namespaces=0`,
    /// Debian's `kernel.unprivileged_userns_clone=0`, Ubuntu's AppArmor restriction).
    UserNamespace,
    /// Its own pid (made by the supervisor as it starts the worker), mount, network,
    /// IPC, UTS and cgroup namespaces.
    Namespaces,
    /// An empty read-only root instead of the host's.
    EmptyRoot,
    /// Landlock denying every file access.
    Landlock,
    /// An rbd worker's Landlock TCP rules (connect to the cluster's ports only, bind
    /// none): Landlock ABI 4 (Linux 6.7). An older kernel's Landlock enforces the file
    /// rules only.
    LandlockTcp,
}

/// A name that is not a [`SandboxLayer`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a sandbox layer; expected user-namespace, namespaces, empty-root, landlock \
     or landlock-tcp"
)]
pub struct UnknownLayer(pub String);

impl SandboxLayer {
    pub const ALL: [SandboxLayer; 5] =
        [Self::UserNamespace, Self::Namespaces, Self::EmptyRoot, Self::Landlock, Self::LandlockTcp];

    /// The name the config file, the command lines and status use.
    pub const fn name(self) -> &'static str {
        match self {
            Self::UserNamespace => "user-namespace",
            Self::Namespaces => "namespaces",
            Self::EmptyRoot => "empty-root",
            Self::Landlock => "landlock",
            Self::LandlockTcp => "landlock-tcp",
        }
    }

    pub fn from_name(name: &str) -> Result<Self, UnknownLayer> {
        Self::ALL.into_iter().find(|l| l.name() == name).ok_or_else(|| UnknownLayer(name.into()))
    }

    /// A comma-separated list of names (the worker's `--sandbox-optional`), empty or
    /// not; sorted, without repeats.
    pub fn parse_list(list: &str) -> Result<Vec<Self>, UnknownLayer> {
        let mut layers = list
            .split(',')
            .filter(|n| !n.is_empty())
            .map(Self::from_name)
            .collect::<Result<Vec<_>, _>>()?;
        layers.sort();
        layers.dedup();
        Ok(layers)
    }

    /// `layers` as [`Self::parse_list`] reads them.
    pub fn join(layers: &[Self]) -> String {
        layers.iter().map(|l| l.name()).collect::<Vec<_>>().join(",")
    }
}

impl std::fmt::Display for SandboxLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of [`SandboxLayer`]s (a device's `sandbox_optional`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerSet(u8);

impl LayerSet {
    pub const EMPTY: LayerSet = LayerSet(0);

    pub fn of(layers: &[SandboxLayer]) -> Self {
        LayerSet(layers.iter().fold(0, |bits, l| bits | 1 << *l as u8))
    }

    pub fn contains(self, layer: SandboxLayer) -> bool {
        self.0 & 1 << layer as u8 != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The layers, in [`SandboxLayer::ALL`]'s order.
    pub fn layers(self) -> Vec<SandboxLayer> {
        SandboxLayer::ALL.into_iter().filter(|l| self.contains(*l)).collect()
    }
}

/// A sandbox layer a worker runs without, because its device allows that, and why
/// it could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingLayer {
    pub layer: SandboxLayer,
    pub cause: String,
}

impl std::fmt::Display for MissingLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.layer, self.cause)
    }
}

/// What a worker says its sandbox achieved (informational: the supervisor checks
/// what it can itself, from `/proc`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxReport {
    /// The namespaces it entered.
    pub namespaces: Vec<String>,
    /// The layers it runs without (each one its device allowed to be missing).
    pub missing: Vec<MissingLayer>,
    /// The Landlock ABI enforced, or `None` where it is missing.
    pub landlock_abi: Option<u8>,
}

/// How long a worker's activation took, in microseconds (informational).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activation {
    /// Mapping the descriptor arrays.
    pub map_us: u32,
    /// Registering `/dev/ublkcN` in the rings and PREPing every tag.
    pub prep_us: u32,
    /// The numbers at which the worker holds the fds that came after `/dev/ublkcN`
    /// with Activate, in their order.
    pub held: Vec<i32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FromWorker {
    /// Set up and waiting for Activate; `sandbox` is `None` for an unsandboxed worker.
    /// `rings` (with `fast_release`, else empty): the fd numbers of the worker's
    /// io_uring instances, one per queue thread, which the supervisor copies with
    /// pidfd_getfd (io_uring fds cannot travel by SCM_RIGHTS). When the worker dies,
    /// the supervisor unregisters their files and buffers, so the kernel lets go of
    /// `/dev/ublkcN` at once instead of after the rings' asynchronous teardown (two
    /// RCU grace periods and a deferred file release later).
    /// `client` (rbd only): the worker's RADOS client identity, as exclusive-lock
    /// owners are named, which its successors may fence.
    Standby { sandbox: Option<SandboxReport>, rings: Vec<i32>, client: Option<String> },
    /// Every tag of every queue is PREPed: ready for START_DEV or END_USER_RECOVERY
    /// (the kernel holds requests until FETCH is armed, right after), with how long
    /// the activation took. The supervisor logs that; the worker logs nothing on this
    /// path, where a new process's first log line costs milliseconds under emulation.
    Ready(Activation),
    /// The worker cannot serve the device; it exits after sending this.
    Failed { reason: String },
    /// The answer to [`ToWorker::Attach`]: the device and incarnation it serves, and
    /// its rings' fd numbers as in Standby.
    Attached { dev_id: u32, generation: u64, rings: Vec<i32>, client: Option<String> },
    /// (rbd only, at any time after Ready, from one of librbd's threads) The image's
    /// size changed to `size_bytes` (an `rbd resize` anywhere, librbd's update watch
    /// says): the supervisor checks it (growth only, a whole number of blocks, at most
    /// the largest device) and, if it takes it, resizes the device as `ublkctl resize`
    /// does. Last: the codec is positional.
    ImageResized { size_bytes: u64 },
}

/// Sends one message (one packet) with `fds` attached, waiting for room if the peer's
/// queue is full. For the worker, whose one peer is its supervisor.
pub fn send_packet<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), MsgError> {
    send_with(sock, msg, fds, MsgFlags::MSG_NOSIGNAL)
}

/// [`send_packet`] that never waits: [`MsgError::WouldBlock`] if the peer's queue is
/// full. For the supervisor, which must not be held by a worker that stops reading.
/// `MSG_DONTWAIT` per call, not `O_NONBLOCK`: the file status flags are shared with
/// every copy of the socket, and a copy the peer holds could clear them.
pub fn try_send_packet<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), MsgError> {
    send_with(sock, msg, fds, MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT)
}

fn send_with<T: Serialize>(
    sock: BorrowedFd<'_>,
    msg: &T,
    fds: &[BorrowedFd<'_>],
    flags: MsgFlags,
) -> Result<(), MsgError> {
    let bytes = codec::encode(msg)?;
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsgs: Vec<ControlMessage<'_>> =
        if raw.is_empty() { Vec::new() } else { vec![ControlMessage::ScmRights(&raw)] };
    let iov = [IoSlice::new(&bytes)];
    loop {
        match sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsgs, flags, None) {
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(_) => return Err(MsgError::Truncated),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) => return Err(MsgError::WouldBlock),
            Err(nix::errno::Errno::EPIPE | nix::errno::Errno::ECONNRESET) => {
                return Err(MsgError::Closed);
            }
            Err(e) => return Err(MsgError::Io(e.into())),
        }
    }
}

/// Receives one message (one packet) and the fds attached to it (closed on error),
/// waiting for one.
pub fn recv_packet<T: serde::de::DeserializeOwned>(
    sock: BorrowedFd<'_>,
) -> Result<(T, Vec<OwnedFd>), MsgError> {
    recv_with(sock, MsgFlags::MSG_CMSG_CLOEXEC)
}

/// [`recv_packet`] that never waits: [`MsgError::WouldBlock`] if nothing is queued
/// (also after a poll said there was: another holder of the socket may have taken it).
pub fn try_recv_packet<T: serde::de::DeserializeOwned>(
    sock: BorrowedFd<'_>,
) -> Result<(T, Vec<OwnedFd>), MsgError> {
    recv_with(sock, MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT)
}

fn recv_with<T: serde::de::DeserializeOwned>(
    sock: BorrowedFd<'_>,
    flags: MsgFlags,
) -> Result<(T, Vec<OwnedFd>), MsgError> {
    let mut buf = vec![0u8; MAX_MESSAGE_BYTES];
    let mut cmsg_space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (len, fds, truncated) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg_space), flags) {
            Ok(r) => {
                let mut fds = Vec::new();
                for c in r.cmsgs().map_err(|e| MsgError::Io(e.into()))? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        for fd in raw {
                            // SAFETY: SCM_RIGHTS installed `fd` in this process just now
                            // and nothing else owns it.
                            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                        }
                    }
                }
                let truncated = r.flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
                break (r.bytes, fds, truncated);
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) => return Err(MsgError::WouldBlock),
            Err(e) => return Err(MsgError::Io(e.into())),
        }
    };
    if truncated {
        return Err(MsgError::Truncated);
    }
    if len == 0 && fds.is_empty() {
        return Err(MsgError::Closed);
    }
    Ok((codec::decode(&buf[..len])?, fds))
}
