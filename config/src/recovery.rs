//! `[recovery]`: when a worker counts as hung, how often a device may recover, what it
//! does past that, and how a dead worker's rings are released.

use std::time::Duration;

/// Largest `recovery.hung_timeout_secs`.
pub const MAX_HUNG_TIMEOUT_SECS: u32 = 300;
/// Largest `recovery.nbd_handshake_timeout_secs`.
pub const MAX_NBD_HANDSHAKE_TIMEOUT_SECS: u32 = 300;
/// Largest `recovery.worker_ready_timeout_secs`.
pub const MAX_WORKER_READY_TIMEOUT_SECS: u32 = 600;
/// Largest `recovery.rbd_cluster_retry_secs`.
pub const MAX_RBD_CLUSTER_RETRY_SECS: u32 = 300;

/// `[recovery]`: when a worker counts as hung, and how often a device may recover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecoveryConfig {
    /// A worker with I/O in flight and no progress this long is killed
    /// (`recovery.hung_timeout_secs`, 1..=300 seconds).
    pub hung_timeout: Duration,
    /// At most this many recoveries per device within `restart_window`
    /// (`recovery.restart_max`); 0 disables automatic recovery.
    pub restart_max: u32,
    /// The window `restart_max` counts in (`recovery.restart_window_secs`, ≥ 1 second).
    pub restart_window: Duration,
    /// What a device does once it used up its recoveries
    /// (`recovery.on_restart_limit`).
    pub on_restart_limit: OnRestartLimit,
    /// Whether workers' rings are made so that ublkd can take `/dev/ublkcN` out of a
    /// dead worker's rings at once (`recovery.fast_release`): a shorter recovery stall,
    /// since the kernel need not tear the dead rings down before it lets the device go,
    /// for fewer IOPS, since the rings then cannot use io_uring's DEFER_TASKRUN (see
    /// `ublkd.example.toml`). Applies to workers started after it changes. Never to
    /// copying O_DIRECT loop devices (see `Device::fast_release_is_safe` in the
    /// supervisor).
    pub fast_release: bool,
    /// How long an nbd device whose server cannot be reached holds its I/O before it
    /// fails it with EIO (`recovery.nbd_server_wait_secs`; `None`, from 0, the default:
    /// for ever, like a hard NFS mount).
    pub nbd_server_wait: Option<Duration>,
    /// How long an nbd device's worker may wait for its server to answer, with no
    /// request completing, before the connection counts as broken: the worker is
    /// replaced, a fresh connection made and the requests re-issued, the I/O held
    /// meanwhile (`recovery.nbd_request_timeout_secs`, default 30; `None`, from 0: for
    /// ever). Never shorter in effect than `hung_timeout`, which is when a wait is
    /// first judged.
    pub nbd_request_timeout: Option<Duration>,
    /// How long an rbd device's request may wait for the Ceph cluster (an OSD or the
    /// monitors away) before it fails with EIO (`recovery.rbd_cluster_wait_secs`, passed
    /// to librados as `rados_osd_op_timeout`; `None`, from 0, the default: for ever).
    pub rbd_cluster_wait: Option<Duration>,
    /// The longest wait between two tries of an rbd device's recovery whose new
    /// workers cannot serve while its Ceph cluster is away
    /// (`recovery.rbd_cluster_retry_secs`, 1..=300 seconds, default 30): the wait
    /// doubles from 1 s up to it, outside the restart budget.
    pub rbd_cluster_retry: Duration,
    /// How long an NBD server has to accept each connection and finish its handshake
    /// (`recovery.nbd_handshake_timeout_secs`, 1..=300 seconds, default 10): a
    /// connection not made by then is a failed add or a recovery's failed try.
    pub nbd_handshake_timeout: Duration,
    /// How long a new worker has to stand by, and then to answer its activation
    /// (Ready) once it has the device (`recovery.worker_ready_timeout_secs`, 1..=600
    /// seconds, default 30): past it the worker is killed, and the device's add,
    /// upgrade or recovery fails (a recovery's device then waits for an operator).
    pub worker_ready_timeout: Duration,
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        Self {
            hung_timeout: Duration::from_secs(10),
            restart_max: 5,
            restart_window: Duration::from_secs(60),
            on_restart_limit: OnRestartLimit::Quiesce,
            fast_release: true,
            nbd_server_wait: None,
            nbd_request_timeout: Some(Duration::from_secs(30)),
            rbd_cluster_wait: None,
            rbd_cluster_retry: Duration::from_secs(30),
            nbd_handshake_timeout: Duration::from_secs(10),
            worker_ready_timeout: Duration::from_secs(30),
        }
    }
}

impl RecoveryConfig {
    /// Whether a crashed or hung worker is restarted automatically.
    pub fn automatic_recovery(&self) -> bool {
        self.restart_max > 0
    }
}

/// What a device does when it hits `restart_max` recoveries within the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum OnRestartLimit {
    /// `"quiesce"`: keep the device, queue its I/O, wait for an operator.
    #[default]
    Quiesce,
    /// `"fail-io"`: keep the device, fail its I/O with an error.
    FailIo,
}

impl OnRestartLimit {
    /// The value as the config file spells it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Quiesce => "quiesce",
            Self::FailIo => "fail-io",
        }
    }
}
