//! ublkctl ↔ supervisor: [`CtlRequest`] / [`CtlResponse`], framed on the daemon's
//! unix stream socket (see [`super::write_frame`]); what status, list and metrics say.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::shm::{CounterSnapshot, DevLatency, LatencySnapshot};

use super::{MissingLayer, SandboxLayer};

/// The target kinds an operator can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TargetKind {
    Null,
    Memory,
    Loop,
    /// An NBD server's export.
    Nbd,
    /// An RBD image in a Ceph cluster.
    Rbd,
}

impl TargetKind {
    pub const fn name(self) -> &'static str {
        match self {
            TargetKind::Null => "null",
            TargetKind::Memory => "memory",
            TargetKind::Loop => "loop",
            TargetKind::Nbd => "nbd",
            TargetKind::Rbd => "rbd",
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
    /// Loop and nbd only: zero copy on (`--zero-copy`), off (`--copy`), or `None`: for
    /// loop, on where the kernel has it; for nbd, off (see `WorkerSetup::zero_copy`).
    pub zero_copy: Option<bool>,
    /// Run the worker in its sandbox; `None`: the daemon's default.
    pub sandbox: Option<bool>,
    /// Sandbox layers the worker may run without where they cannot be applied;
    /// `None`: the daemon's default (`defaults.sandbox_optional`).
    pub sandbox_optional: Option<Vec<SandboxLayer>>,
    /// The rbd flags, if any was given (ublkd refuses them for another target).
    pub rbd: Option<RbdAdd>,
    // Fields below were added later; each defaults to what an older client meant.
    /// `--name NAME`: unique among the devices (ublkd checks it).
    #[serde(default)]
    pub name: Option<String>,
    /// `--read-only`.
    #[serde(default)]
    pub read_only: bool,
    /// `--partitions`: the kernel scans the disk for partitions.
    #[serde(default)]
    pub partitions: bool,
}

/// `ublkctl add`'s rbd flags, as typed (ublkd checks them; paths made absolute).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RbdAdd {
    /// `--image POOL[/NAMESPACE]/IMAGE[@SNAPSHOT]`.
    pub image: Option<String>,
    /// `--ceph-conf PATH`.
    pub ceph_conf: Option<PathBuf>,
    /// `--ceph-id ID`.
    pub ceph_id: Option<String>,
    /// `--keyring PATH`.
    pub keyring: Option<PathBuf>,
}

// One request per connection, decoded once: the size of `Add` costs nothing, and
// boxing it would change every `CtlRequest::Add(...)` for no gain.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CtlRequest {
    Add(AddRequest),
    /// `None`: every device. Refused, with nothing deleted, if any of the devices'
    /// disks is in use (mounted, held by dm or md, open in a process).
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
    /// request (besides `Del`) that deletes devices; signals never do. Refused, with
    /// nothing deleted and ublkd serving on, if any device's disk is in use.
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
    // New requests go last: the encoding is positional (a variant is its index), so a
    // variant appended keeps every older client's requests as they were.
    /// `del --force`: [`CtlRequest::Del`] that deletes devices in use too.
    DelForce {
        id: Option<u32>,
    },
    /// `shutdown --force`: [`CtlRequest::Shutdown`] that deletes devices in use too.
    ShutdownForce,
    /// `ublkctl resize`: device `id` to `size_bytes`, online. A smaller size is refused
    /// unless `allow_shrink`.
    Resize {
        id: u32,
        size_bytes: u64,
        allow_shrink: bool,
    },
    /// The request inside, from a client that reads [`CtlResponse::Failed`]: ublkd
    /// answers its errors so, with their [`ErrorKind`], where it answers another
    /// client's with [`CtlResponse::Error`] (which is all an older client decodes). An
    /// older ublkd cannot decode this request and answers `Error` (nothing done); the
    /// client then sends the request bare.
    WithKinds(Box<CtlRequest>),
    /// `ublkd --check-config FILE`: what a reload would do were `config` (an absolute
    /// path, read by ublkd) its config file, doing nothing.
    ReloadPlan {
        config: PathBuf,
    },
}

/// What kind of failure an error answer is, for `ublkctl`'s exit code. Decided where
/// the error is made (the error enums), never from a message's text. On the wire it is
/// its [`name`](Self::name), so that a kind added later reaches an older client as
/// [`ErrorKind::Other`] rather than failing the whole answer's decoding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ErrorKind {
    /// None of the others; also what a kind added by a newer ublkd decodes as.
    #[default]
    Other,
    /// No device has the id (or name) the request gives.
    NoSuchDevice,
    /// The id, name, file, export or image the request gives is another device's.
    AlreadyExists,
    /// The device is in use (mounted, held, open) and the request would take it away.
    Busy,
    /// The running kernel lacks what the request needs.
    NotSupported,
    /// The request's arguments are wrong (the same checks as the config file's).
    BadArgument,
    /// The client may not command ublkd.
    PermissionDenied,
    /// Not now: the device is not in a state that allows the request (not LIVE, being
    /// recovered, upgraded or resized), or ublkd is shutting down. The same request
    /// may succeed later, unchanged.
    TryAgain,
    /// The device's worker failed to start or to take the device (it exited, said why
    /// it could not set up, or did not answer in time): the backend it was to open, or
    /// the worker's sandbox, is at fault, not the request's form.
    WorkerFailed,
}

impl ErrorKind {
    /// The kind's name in `ublkctl`'s JSON (`docs/json.md`).
    pub const fn name(self) -> &'static str {
        match self {
            ErrorKind::Other => "other",
            ErrorKind::NoSuchDevice => "no_such_device",
            ErrorKind::AlreadyExists => "already_exists",
            ErrorKind::Busy => "busy",
            ErrorKind::NotSupported => "not_supported",
            ErrorKind::BadArgument => "bad_argument",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::TryAgain => "try_again",
            ErrorKind::WorkerFailed => "worker_failed",
        }
    }

    /// Every kind but [`ErrorKind::Other`].
    pub const ALL: [ErrorKind; 8] = [
        ErrorKind::NoSuchDevice,
        ErrorKind::AlreadyExists,
        ErrorKind::Busy,
        ErrorKind::NotSupported,
        ErrorKind::BadArgument,
        ErrorKind::PermissionDenied,
        ErrorKind::TryAgain,
        ErrorKind::WorkerFailed,
    ];

    /// The kind named `name`; [`ErrorKind::Other`] for a name not known here.
    pub fn from_name(name: &str) -> ErrorKind {
        Self::ALL.into_iter().find(|k| k.name() == name).unwrap_or(ErrorKind::Other)
    }
}

impl Serialize for ErrorKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for ErrorKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ErrorKind, D::Error> {
        let name = String::deserialize(d)?;
        Ok(ErrorKind::from_name(&name))
    }
}

/// A refused or failed request: its kind and what to tell the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: ErrorKind,
    pub message: String,
}

impl Failure {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Failure {
        Failure { kind, message: message.into() }
    }
}

/// The message alone, as plain output says it.
impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A message alone is a failure of no particular kind.
impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure { kind: ErrorKind::Other, message }
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Failure {
        Failure::from(message.to_string())
    }
}

impl From<Failure> for CtlResponse {
    fn from(f: Failure) -> CtlResponse {
        CtlResponse::Failed { kind: f.kind, message: f.message }
    }
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
    // Fields below were added later; an older ublkd's answer has none of them.
    /// The device's name, if it was given one.
    #[serde(default)]
    pub name: Option<String>,
    /// The disk is read-only: asked for (`--read-only`), or because its target is (a
    /// read-only nbd export, an rbd snapshot).
    #[serde(default)]
    pub read_only: bool,
    /// What backs the device: a loop device's file, an nbd device's URI (it carries
    /// no secret: ublkd refuses a URI with a user or password, and TLS names a
    /// directory), an rbd device's `POOL[/NAMESPACE]/IMAGE[@SNAPSHOT]`; `None` for
    /// null and memory.
    #[serde(default)]
    pub backing: Option<String>,
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
    /// When the last recovery put the device back LIVE, in milliseconds since the
    /// Unix epoch; `None` before the first.
    #[serde(default)]
    pub last_recovery_unix_ms: Option<u64>,
    /// The device's name (`--name`, `name =`), if it has one.
    #[serde(default)]
    pub name: Option<String>,
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
    // New responses go last, as requests do.
    /// `ublkctl resize` done: the device serves `size_bytes` now.
    Resized {
        id: u32,
        size_bytes: u64,
        message: String,
    },
    /// [`Self::Error`] with its kind: sent only to a client that asked for it
    /// ([`CtlRequest::WithKinds`]).
    Failed {
        kind: ErrorKind,
        message: String,
    },
    /// What a reload to the config of [`CtlRequest::ReloadPlan`] would do, each device
    /// described in a line.
    ReloadPlan {
        /// The config file ublkd reloads (`None`: it runs without one, and a reload
        /// changes nothing).
        reloads: Option<PathBuf>,
        add: Vec<String>,
        change: Vec<String>,
        remove: Vec<String>,
        /// What else a reload says (settings applied only at a restart).
        notes: Vec<String>,
    },
}

impl CtlResponse {
    /// The answer as a client that did not ask for kinds decodes it: a
    /// [`Self::Failed`] becomes [`Self::Error`].
    pub fn without_kind(self) -> CtlResponse {
        match self {
            CtlResponse::Failed { message, .. } => CtlResponse::Error { message },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;

    #[test]
    fn an_error_with_its_kind_reaches_old_and_new_clients() {
        let failed = CtlResponse::from(Failure::new(ErrorKind::Busy, "device 0 is mounted"));
        let bytes = codec::encode(&failed).unwrap();
        assert_eq!(codec::decode::<CtlResponse>(&bytes).unwrap(), failed);
        // What an older client gets: the `Error` it always knew (variant 6).
        let old = codec::encode(&failed.without_kind()).unwrap();
        assert_eq!(old[0], 6);
        assert_eq!(
            codec::decode::<CtlResponse>(&old).unwrap(),
            CtlResponse::Error { message: "device 0 is mounted".into() }
        );
    }

    #[test]
    fn a_kind_from_a_newer_ublkd_decodes_as_other() {
        let bytes =
            codec::encode(&CtlResponse::Failed { kind: ErrorKind::Busy, message: "x".into() })
                .unwrap();
        // The variant (9), then the kind by its name: "busy", 4 bytes.
        assert_eq!(&bytes[..6], &[9, 4, b'b', b'u', b's', b'y']);
        let mut bytes = bytes;
        bytes.splice(1..6, [5, b'w', b'e', b'i', b'r', b'd']);
        let decoded = codec::decode::<CtlResponse>(&bytes).unwrap();
        assert_eq!(decoded, CtlResponse::Failed { kind: ErrorKind::Other, message: "x".into() });
    }

    #[test]
    fn every_kind_goes_by_its_own_name_and_back() {
        for kind in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_name(kind.name()), kind);
            let bytes = codec::encode(&CtlResponse::Failed { kind, message: "x".into() }).unwrap();
            let decoded = codec::decode::<CtlResponse>(&bytes).unwrap();
            assert_eq!(decoded, CtlResponse::Failed { kind, message: "x".into() });
        }
        assert_eq!(ErrorKind::from_name("try_again"), ErrorKind::TryAgain);
        assert_eq!(ErrorKind::from_name("worker_failed"), ErrorKind::WorkerFailed);
    }

    #[test]
    fn a_wrapped_request_is_one_an_older_ublkd_refuses_whole() {
        let req = CtlRequest::WithKinds(Box::new(CtlRequest::Del { id: Some(4) }));
        let bytes = codec::encode(&req).unwrap();
        // A variant after every one an older ublkd knows, so it fails to decode there.
        assert_eq!(bytes[0], 11);
        assert_eq!(codec::decode::<CtlRequest>(&bytes).unwrap(), req);
    }
}
