//! The messages between ublkd's processes, and how they travel.
//!
//! - supervisor ↔ worker: [`ToWorker`] / [`FromWorker`] over a `SOCK_SEQPACKET`
//!   socketpair, one message per packet, file descriptors attached with SCM_RIGHTS.
//! - ublkctl ↔ supervisor: [`CtlRequest`] / [`CtlResponse`] over the daemon's unix
//!   stream socket, each message framed by a 4-byte little-endian length. A request is
//!   at most [`MAX_MESSAGE_BYTES`] like every other message; a response, which grows
//!   with the devices it lists, at most [`MAX_RESPONSE_BYTES`](crate::codec::MAX_RESPONSE_BYTES) ([`write_response`],
//!   [`read_response`]).
//!
//! Every message is encoded by [`crate::codec`] (bounded decode). Receivers treat
//! everything they decode as untrusted input and validate it before use.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};

use crate::codec::{self, CodecError, MAX_MESSAGE_BYTES};
use crate::shm::{CounterSnapshot, DevLatency, LatencySnapshot};

mod data_path;
mod frame;
pub use data_path::DataPath;
pub use frame::{read_frame, read_response, write_frame, write_response};

/// The most fds one message may carry.
pub const MAX_FDS: usize = 8;

/// Errors moving messages.
#[derive(Debug, thiserror::Error)]
pub enum MsgError {
    #[error("the peer closed the connection")]
    Closed,
    #[error("socket I/O failed: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("a message's length prefix says {len} bytes, more than the limit of {limit}")]
    FrameTooLarge { len: usize, limit: usize },
    #[error("a message was cut short (truncated to the receive buffer)")]
    Truncated,
    #[error("a message carried {got} file descriptors, expected {want}")]
    FdCount { got: usize, want: usize },
    /// Only from the `try_` functions: the peer has not taken the packets already
    /// queued to it (sending), or nothing is there (receiving).
    #[error("the socket's queue is full, or empty: the call would have blocked")]
    WouldBlock,
}

// ---------------------------------------------------------------------------------------
// Supervisor ↔ worker.

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
    /// `i % connections`). No fd at setup: the supervisor connects and negotiates when
    /// the worker is activated (a standby's connection would sit idle, and some servers
    /// take one client at a time), and sends the sockets, in the transmission phase
    /// with structured or simple replies (the worker reads both), with
    /// [`ToWorker::Activate`].
    Nbd { connections: u8 },
}

/// The most connections an nbd worker is given.
pub const MAX_NBD_CONNECTIONS: u8 = 8;

impl TargetSetup {
    /// How many fds follow the fixed ones for this target.
    pub const fn target_fds(&self) -> usize {
        match self {
            TargetSetup::Null | TargetSetup::FailIo | TargetSetup::Nbd { .. } => 0,
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
    /// The device has `UBLK_F_AUTO_BUF_REG` (a zero-copy loop device, or one failing
    /// its I/O after being one): the worker gives each tag a buffer index instead of a
    /// buffer address, and requests with data arrive registered in its ring.
    pub zero_copy: bool,
    /// `recovery.fast_release`: the worker names its rings in Standby (see there) and
    /// makes them so that the supervisor may unregister their files (not
    /// SINGLE_ISSUER, so without DEFER_TASKRUN); otherwise they use DEFER_TASKRUN and
    /// a recovery waits for the kernel's teardown of the dead worker's rings.
    pub fast_release: bool,
    /// The ublk commands the device was created for (see [`DataPath`]).
    pub data_path: DataPath,
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
    Activate { generation: u64 },
    /// Stop serving and exit (the device is being stopped).
    Shutdown,
    /// From a supervisor that took the serving worker over (a restarted ublkd): say
    /// which device and incarnation you serve. Answered with [`FromWorker::Attached`].
    Attach,
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
    /// Its own mount, network, IPC, UTS and cgroup namespaces.
    Namespaces,
    /// An empty read-only root instead of the host's.
    EmptyRoot,
    /// Landlock denying every file access.
    Landlock,
}

/// A name that is not a [`SandboxLayer`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a sandbox layer; expected user-namespace, namespaces, empty-root or landlock"
)]
pub struct UnknownLayer(pub String);

impl SandboxLayer {
    pub const ALL: [SandboxLayer; 4] =
        [Self::UserNamespace, Self::Namespaces, Self::EmptyRoot, Self::Landlock];

    /// The name the config file, the command lines and status use.
    pub const fn name(self) -> &'static str {
        match self {
            Self::UserNamespace => "user-namespace",
            Self::Namespaces => "namespaces",
            Self::EmptyRoot => "empty-root",
            Self::Landlock => "landlock",
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
    Standby { sandbox: Option<SandboxReport>, rings: Vec<i32> },
    /// Every tag of every queue is PREPed: ready for START_DEV or END_USER_RECOVERY
    /// (the kernel holds requests until FETCH is armed, right after), with how long
    /// the activation took. The supervisor logs that; the worker logs nothing on this
    /// path, where a new process's first log line costs milliseconds under emulation.
    Ready(Activation),
    /// The worker cannot serve the device; it exits after sending this.
    Failed { reason: String },
    /// The answer to [`ToWorker::Attach`]: the device and incarnation it serves, and
    /// its rings' fd numbers as in Standby.
    Attached { dev_id: u32, generation: u64, rings: Vec<i32> },
}

/// The most characters of a worker's text (a failure reason) that the supervisor
/// passes on to its log, an operator's error or status.
pub const MAX_UNTRUSTED_TEXT: usize = 512;

/// A worker's text made safe to show: control characters but tab (a newline that
/// would start a forged log line, terminal escapes) escaped, and cut at
/// [`MAX_UNTRUSTED_TEXT`] characters with a mark that it was.
pub fn untrusted_text(text: &str) -> String {
    untrusted_text_within(text, MAX_UNTRUSTED_TEXT)
}

/// [`untrusted_text`] cut at `max` characters (escapes counted as shown), for a caller
/// that bounds the text its own way.
pub fn untrusted_text_within(text: &str, max: usize) -> String {
    let mut out = String::new();
    let mut shown = 0usize;
    for c in text.chars() {
        let escaped = (c.is_control() && c != '\t').then(|| c.escape_default());
        let width = escaped.clone().map_or(1, Iterator::count);
        if shown.saturating_add(width) > max {
            out.push_str("…(cut)");
            break;
        }
        shown += width;
        match escaped {
            Some(e) => out.extend(e),
            None => out.push(c),
        }
    }
    out
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

// ---------------------------------------------------------------------------------------
// ublkctl ↔ supervisor.

/// The target kinds an operator can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TargetKind {
    Null,
    Memory,
    Loop,
    /// An NBD server's export.
    Nbd,
}

impl TargetKind {
    pub const fn name(self) -> &'static str {
        match self {
            TargetKind::Null => "null",
            TargetKind::Memory => "memory",
            TargetKind::Loop => "loop",
            TargetKind::Nbd => "nbd",
        }
    }
}

/// `ublkctl add`: a device described on the command line. Unset fields take the
/// daemon's defaults; the supervisor validates everything as it would a config file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddRequest {
    pub id: Option<u32>,
    pub target: TargetKind,
    /// Absolute path (ublkctl resolves it), loop only.
    pub file: Option<PathBuf>,
    /// The export's NBD URI as typed (ublkd parses it), nbd only.
    pub uri: Option<String>,
    pub size: Option<u64>,
    pub queues: Option<u16>,
    pub queue_depth: Option<u16>,
    pub threads: Option<u16>,
    /// Loop only: zero copy on (`--zero-copy`), off (`--copy`), or `None`: on where the
    /// kernel has it (see `WorkerSetup::zero_copy`).
    pub zero_copy: Option<bool>,
    /// Run the worker in its sandbox; `None`: the daemon's default.
    pub sandbox: Option<bool>,
    /// Sandbox layers the worker may run without where they cannot be applied;
    /// `None`: the daemon's default (`defaults.sandbox_optional`).
    pub sandbox_optional: Option<Vec<SandboxLayer>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CtlRequest {
    Add(AddRequest),
    /// `None`: every device.
    Del {
        id: Option<u32>,
    },
    List {
        id: Option<u32>,
    },
    Status {
        id: Option<u32>,
    },
    Recover {
        id: u32,
    },
    /// Delete every device, answer [`CtlResponse::Deleted`], then exit: the one
    /// request (besides `Del`) that deletes devices; signals never do.
    Shutdown,
    /// Move device `id` (`None`: every device) to the worker binary now on disk, one
    /// device at a time, each serving throughout.
    Upgrade {
        id: Option<u32>,
    },
    /// Every device's counters and latency histograms (`id`: only that device's), for
    /// `ublkctl metrics`.
    Metrics {
        id: Option<u32>,
    },
}

/// What `ublkctl upgrade` did to one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpgradeOutcome {
    pub id: u32,
    /// Whether the device is now served by the binary on disk.
    pub upgraded: bool,
    /// What happened (the stall), or why not.
    pub message: String,
}

/// One device as `ublkctl list` prints it (the kernel selftests' two lines).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevListing {
    pub id: u32,
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub block_size: u32,
    /// In 512-byte sectors.
    pub dev_capacity: u64,
    pub max_rq_size: u32,
    pub daemon_pid: i32,
    pub flags: u64,
    pub state: String,
}

/// A worker's sandbox as the supervisor sees it from `/proc/<pid>` (uid, namespaces,
/// seccomp, capabilities, no_new_privs), plus the Landlock ABI the worker reported.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxStatus {
    pub uid: u32,
    pub gid: u32,
    /// Namespaces the worker does not share with the supervisor.
    pub namespaces: Vec<String>,
    /// `filter`, `strict` or `disabled`.
    pub seccomp: String,
    pub no_new_privs: bool,
    /// Effective capabilities, as the kernel prints them (hex).
    pub capabilities: String,
    /// `ABI n`, or `unsupported`.
    pub landlock: String,
    /// The layers the worker runs without (its device allowed that), with why.
    #[serde(default)]
    pub missing: Vec<MissingLayer>,
}

/// One device as `ublkctl status` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevStatus {
    pub id: u32,
    pub state: String,
    pub target: String,
    pub worker_pid: Option<u32>,
    pub size_bytes: u64,
    pub queues: u16,
    pub queue_depth: u16,
    pub threads: u16,
    pub recoveries: u64,
    /// The last recovery's stall, from the death's detection to LIVE.
    pub last_recovery_ms: Option<u64>,
    pub last_recovery_reason: Option<String>,
    pub standby_pid: Option<u32>,
    /// `None`: the device's worker runs without a sandbox (or has none running).
    pub sandbox: Option<SandboxStatus>,
    pub counters: CounterSnapshot,
    /// Why the device is not LIVE (or not served by its target), if so.
    pub note: Option<String>,
    /// LIVE, but every I/O fails with EIO: the restart budget is spent and the config
    /// says `on_restart_limit = "fail-io"` (see `note`).
    pub failing_io: bool,
    /// The latency of every request the device's workers served, all operations in one
    /// histogram (from the shared region: untrusted values).
    pub latency: LatencySnapshot,
}

/// One device's numbers as `ublkctl metrics` renders them. The counters and histograms
/// come from the shared region (untrusted values, only ever reported); the rest is the
/// supervisor's own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevMetrics {
    pub id: u32,
    pub state: String,
    pub target: String,
    pub counters: CounterSnapshot,
    /// Requests waiting at the worker's backend, at most the device's tag count.
    pub inflight: u64,
    pub recoveries: u64,
    /// The last recovery's stall, from the death's detection to LIVE.
    pub last_stall_ms: Option<u64>,
    /// Times the device's serving worker exited or was killed (as hung).
    pub worker_restarts: u64,
    pub latency: DevLatency,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CtlResponse {
    Added {
        id: u32,
    },
    Deleted {
        ids: Vec<u32>,
    },
    List(Vec<DevListing>),
    Status(Vec<DevStatus>),
    Recovered {
        id: u32,
        message: String,
    },
    Upgraded(Vec<UpgradeOutcome>),
    /// The request failed; `message` names what and why.
    Error {
        message: String,
    },
    Metrics(Vec<DevMetrics>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::MAX_RESPONSE_BYTES;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap()
    }

    #[test]
    fn setup_travels_with_its_fds() {
        let (a, b) = seqpacket_pair();
        let setup = WorkerSetup {
            dev_id: 3,
            size_bytes: 1 << 20,
            nr_queues: 2,
            queue_depth: 64,
            max_io_buf_bytes: 1 << 19,
            nr_threads: 2,
            target: TargetSetup::Memory,
            block_size: 4096,
            zero_copy: true,
            fast_release: true,
            data_path: DataPath::PerIo,
        };
        let f1 = std::fs::File::open("/dev/null").unwrap();
        let f2 = std::fs::File::open("/dev/zero").unwrap();
        send_packet(a.as_fd(), &ToWorker::Setup(setup.clone()), &[f1.as_fd(), f2.as_fd()]).unwrap();
        let (msg, fds): (ToWorker, _) = recv_packet(b.as_fd()).unwrap();
        assert_eq!(msg, ToWorker::Setup(setup.clone()));
        assert_eq!(fds.len(), setup.fd_count());
    }

    #[test]
    fn closed_peer_is_reported_as_closed() {
        let (a, b) = seqpacket_pair();
        drop(a);
        assert!(matches!(recv_packet::<FromWorker>(b.as_fd()), Err(MsgError::Closed)));
    }

    #[test]
    fn a_peer_that_stops_reading_cannot_make_the_try_calls_wait() {
        let (ours, theirs) = seqpacket_pair();
        // The peer clears O_NONBLOCK on the description both ends share (as a worker
        // holding a copy of ours could); the try calls must not care.
        // SAFETY: F_SETFL on an fd this test owns, for the call.
        assert_eq!(unsafe { libc::fcntl(ours.as_raw_fd(), libc::F_SETFL, 0) }, 0);
        assert!(matches!(try_recv_packet::<ToWorker>(ours.as_fd()), Err(MsgError::WouldBlock)));
        let mut sent = 0;
        let full = loop {
            match try_send_packet(ours.as_fd(), &ToWorker::Shutdown, &[]) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(sent < 100_000, "the queue never filled");
        };
        assert!(matches!(full, MsgError::WouldBlock), "{full}");
        assert!(sent > 0);
        let (got, _) = recv_packet::<ToWorker>(theirs.as_fd()).unwrap();
        assert_eq!(got, ToWorker::Shutdown);
    }

    #[test]
    fn garbage_packet_is_a_codec_error_not_a_panic() {
        let (a, b) = seqpacket_pair();
        nix::unistd::write(&a, &[0xff, 0xff, 0xff, 0x01]).unwrap();
        assert!(matches!(recv_packet::<FromWorker>(b.as_fd()), Err(MsgError::Codec(_))));
    }

    #[test]
    fn a_workers_text_cannot_forge_a_log_line_or_flood_it() {
        assert_eq!(untrusted_text("bad\nublkd: device 0 deleted"), "bad\\nublkd: device 0 deleted");
        assert_eq!(untrusted_text("\u{1b}[2J"), "\\u{1b}[2J");
        let long = untrusted_text(&"x".repeat(10 * MAX_UNTRUSTED_TEXT));
        assert_eq!(long.chars().count(), MAX_UNTRUSTED_TEXT + "…(cut)".chars().count());
        assert_eq!(untrusted_text("plain"), "plain");
    }

    proptest::proptest! {
        /// Whatever bytes a worker or a client sends, decoding them is an error or a
        /// message, never a panic; and a worker's text is always bounded and one line.
        #[test]
        fn any_bytes_decode_without_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
        ) {
            let _ = codec::decode::<FromWorker>(&bytes);
            let _ = codec::decode::<ToWorker>(&bytes);
            let _ = codec::decode::<CtlRequest>(&bytes);
            let _ = codec::decode::<CtlResponse>(&bytes);
            let text = untrusted_text(&String::from_utf8_lossy(&bytes));
            proptest::prop_assert!(!text.contains('\n') && !text.contains('\r'));
            proptest::prop_assert!(text.chars().count() <= MAX_UNTRUSTED_TEXT + 6);
        }

        /// A real message with bytes flipped: the decoder sees almost-valid input.
        #[test]
        fn corrupted_worker_messages_decode_without_panic(
            flips in proptest::collection::vec((0usize..64, proptest::prelude::any::<u8>()), 1..8),
        ) {
            let msg = FromWorker::Standby {
                sandbox: Some(SandboxReport {
                    namespaces: vec!["user".into(), "mnt".into()],
                    missing: vec![MissingLayer {
                        layer: SandboxLayer::UserNamespace,
                        cause: "refused".into(),
                    }],
                    landlock_abi: Some(4),
                }),
                rings: vec![5, 6, 7],
            };
            let mut bytes = codec::encode(&msg).unwrap();
            for (at, value) in flips {
                let len = bytes.len();
                bytes[at % len] = value;
            }
            let _ = codec::decode::<FromWorker>(&bytes);
        }
    }

    #[test]
    fn frames_round_trip_and_oversized_frames_are_refused_unread() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let req = CtlRequest::Del { id: Some(4) };
        write_frame(&mut a, &req).unwrap();
        assert_eq!(read_frame::<CtlRequest>(&mut b).unwrap(), req);
        a.write_all(&(u32::MAX).to_le_bytes()).unwrap();
        assert!(matches!(read_frame::<CtlRequest>(&mut b), Err(MsgError::FrameTooLarge { .. })));
        drop(a);
        assert!(matches!(read_frame::<CtlRequest>(&mut b), Err(MsgError::Closed)));
    }

    /// A `status` answer for `n` devices.
    fn status_of(n: u32) -> CtlResponse {
        CtlResponse::Status(
            (0..n)
                .map(|id| DevStatus {
                    id,
                    state: "LIVE".into(),
                    target: "null".into(),
                    worker_pid: Some(1000 + id),
                    standby_pid: Some(2000 + id),
                    sandbox: None,
                    last_recovery_ms: None,
                    last_recovery_reason: Some("worker 1234 killed by signal 9".into()),
                    size_bytes: 1 << 30,
                    queues: 1,
                    queue_depth: 128,
                    threads: 1,
                    recoveries: 1,
                    counters: CounterSnapshot::default(),
                    latency: LatencySnapshot::default(),
                    note: None,
                    failing_io: false,
                })
                .collect(),
        )
    }

    #[test]
    fn a_response_past_the_request_bound_travels_within_its_own() {
        let big = status_of(5000);
        let mut frame = Vec::new();
        write_response(&mut frame, &big).unwrap();
        assert!(frame.len() > MAX_MESSAGE_BYTES + 4, "only {} bytes", frame.len());
        assert_eq!(read_response(&mut frame.as_slice()).unwrap(), big);
        // The same frame is refused where a request is read.
        let err = read_frame::<CtlResponse>(&mut frame.as_slice()).unwrap_err();
        assert!(matches!(err, MsgError::FrameTooLarge { limit: MAX_MESSAGE_BYTES, .. }), "{err}");
        let err = write_frame(&mut Vec::new(), &big).unwrap_err();
        assert!(matches!(err, MsgError::Codec(CodecError::TooLarge { .. })), "{err}");
    }

    #[test]
    fn a_response_frame_over_its_bound_is_refused_before_its_body_is_read() {
        let mut stream = Vec::new();
        stream.extend_from_slice(&(MAX_RESPONSE_BYTES as u32 + 1).to_le_bytes());
        stream.extend_from_slice(&[0; 64]);
        let mut r = stream.as_slice();
        let err = read_response(&mut r).unwrap_err();
        assert!(
            matches!(err, MsgError::FrameTooLarge { len, limit: MAX_RESPONSE_BYTES } if len == MAX_RESPONSE_BYTES + 1),
            "{err}"
        );
        assert_eq!(r.len(), 64, "the body was read");
    }
}
