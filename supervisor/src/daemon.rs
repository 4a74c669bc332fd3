//! The running supervisor: its devices, the `ublkctl` socket and the signals it obeys.
//!
//! One thread does everything, in one `poll` loop over the control socket and its
//! connections (served without blocking: [`crate::control`]), a self-pipe that signal
//! handlers write to, a pidfd per worker (readable the moment it dies), and the control
//! socket of each worker still starting. An `ublkctl add` is answered once its device
//! is LIVE, without holding the loop meanwhile (`PendingAdd`): adds sent together
//! overlap their workers' start-ups, and a recovery whose standby is still starting
//! waits for it on later turns (an `ublkctl recover` is then answered once it ends:
//! `PendingRecover`). Devices change only on that thread, so the device table
//! needs no lock. While any device is served the loop also wakes a few times per
//! hung-worker timeout to compare heartbeats.
//!
//! A worker's death starts a recovery at once, within the device's restart budget;
//! past the budget the device stays QUIESCED (I/O waits, nothing fails) and `ublkctl
//! status` says why until an operator runs `ublkctl recover`. That policy is
//! [`crate::recovery`]'s; the requests of `ublkctl` are answered in `handlers`, and
//! SIGHUP's config reload is `reload`. The loop's turn is `event_loop`; starting up
//! and adopting a previous ublkd's devices, `startup`; adds and recovers under way,
//! `adds`; upgrades, `upgrade`; deletes, `delete`. With `daemon.metrics_file` set, the loop also
//! hands a snapshot of every device's numbers to [`crate::metrics::FileWriter`]'s thread
//! each interval.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use ublkd_config::{Config, DeviceSpec, TargetSpec};
use ublkd_proto::ctrl::{CtrlClient, CtrlError};
use ublkd_proto::msg::{AddRequest, CtlRequest, CtlResponse, DataPath, DevStatus};

mod adds;
mod delete;
mod device_table;
mod event_loop;
mod handlers;
mod reload;
mod startup;
mod underway;
mod upgrade;

use adds::{PendingAdd, PendingRecover};
use device_table::DeviceTable;
use event_loop::{CREATING_AT_ONCE, millis_until};
use handlers::describe_spec;
pub use handlers::spec_from_request;

use crate::control::{ControlServer, Token};
use crate::device::{Context, Creation, Device, DeviceError, Left, Progress};
use crate::device_state::{StateKind, Summary};
use crate::features::KernelRelease;
use crate::metrics::FileWriter;
use crate::state::StateDir;
use crate::systemd::Notifier;
use crate::target::{Reached, TargetError, decide_zero_copy, reach, reach_takes_time};
use crate::worker::WorkerIdentity;
use crate::{exit, features, recovery};

/// Fatal errors of the daemon, each with its exit code.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Ctrl(#[from] CtrlError),
    #[error("this kernel's ublk driver lacks {0}")]
    MissingFeatures(String),
    #[error("cannot find the worker binary: {0}")]
    WorkerBinary(#[source] io::Error),
    #[error("cannot create {}: {source}", path.display())]
    Dir { path: PathBuf, source: io::Error },
    #[error("another ublkd is already serving {}", path.display())]
    AlreadyRunning { path: PathBuf },
    #[error("cannot listen on {}: {source}", path.display())]
    Listen { path: PathBuf, source: io::Error },
    #[error("cannot set up signal handling: {0}")]
    Signals(#[source] io::Error),
    #[error(transparent)]
    StateDir(#[from] crate::state::StateError),
    #[error(
        "the worker user {0:?} does not exist: create it (the package does) or set daemon.worker_user"
    )]
    NoWorkerUser(String),
}

impl DaemonError {
    pub fn exit_code(&self) -> i32 {
        match self {
            DaemonError::Ctrl(CtrlError::NoDriver { .. }) => exit::NO_UBLK,
            DaemonError::Ctrl(e) if e.errno() == Some(libc::EPERM) => exit::PERMISSION,
            DaemonError::Ctrl(CtrlError::Open { source, .. })
                if source.kind() == io::ErrorKind::PermissionDenied =>
            {
                exit::PERMISSION
            }
            DaemonError::MissingFeatures(_) => exit::MISSING_FEATURE,
            DaemonError::AlreadyRunning { .. } | DaemonError::Listen { .. } => exit::SOCKET,
            _ => exit::FAILURE,
        }
    }
}

/// Signals, as flags the loop checks after the self-pipe wakes it.
#[derive(Debug)]
struct Signals {
    terminate: Arc<AtomicBool>,
    child: Arc<AtomicBool>,
    reload: Arc<AtomicBool>,
    wake: UnixStream,
}

impl Signals {
    fn install() -> io::Result<Signals> {
        let (wake, wake_writer) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        let terminate = Arc::new(AtomicBool::new(false));
        let child = Arc::new(AtomicBool::new(false));
        let reload = Arc::new(AtomicBool::new(false));
        for (sig, flag) in [
            (libc::SIGTERM, &terminate),
            (libc::SIGINT, &terminate),
            (libc::SIGCHLD, &child),
            (libc::SIGHUP, &reload),
        ] {
            signal_hook::flag::register(sig, Arc::clone(flag))?;
            signal_hook::low_level::pipe::register(sig, wake_writer.try_clone()?)?;
        }
        Ok(Signals { terminate, child, reload, wake })
    }

    fn drain(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// The daemon's state.
#[derive(Debug)]
pub struct Daemon {
    config: Config,
    /// Where the config came from, for SIGHUP (`None`: built-in defaults).
    config_path: Option<PathBuf>,
    /// Devices created from the config file, by the spec the file gave, for reloads.
    configured: Vec<(DeviceSpec, u32)>,
    notifier: Notifier,
    last_event: Option<crate::event::Event>,
    ctx: Context,
    devices: DeviceTable,
    /// When the loop next scans every device for hangs.
    next_scan: Instant,
    /// How many devices the last scan found making no progress (for the watchdog).
    hung_devices: usize,
    /// The kernel's numbers of every ublk disk, read once per full scan.
    disk_stats: crate::hang::DiskStats,
    /// Whether the next scan looks at every device (see `event_loop`'s `scan`).
    full_scan_next: bool,
    /// How many devices the last scan found watched (I/O in flight, a thread in a
    /// turn, a hang suspected).
    watched_devices: usize,
    /// Whether the STATUS line's counts may be out of date, when they may be counted
    /// again, and the event it last showed.
    status_stale: bool,
    status_due: Instant,
    status_event: Option<crate::event::Event>,
    control: ControlServer,
    signals: Signals,
    /// `ublkctl shutdown` deleted every device: the loop ends after this turn.
    shutting_down: bool,
    /// Writes `daemon.metrics_file`, if set.
    metrics_file: Option<FileWriter>,
    /// `ublkctl add`s under way: exports being negotiated, workers starting.
    pending_adds: Vec<PendingAdd>,
    /// `ublkctl recover`s whose recovery goes on in the loop.
    pending_recovers: Vec<PendingRecover>,
    /// `ublkctl upgrade`s under way.
    pending_upgrades: Vec<upgrade::PendingUpgrade>,
    /// `ublkctl del`s and `shutdown`s under way.
    pending_deletes: Vec<delete::PendingDelete>,
    /// A SIGHUP's reload under way.
    pending_reload: Option<reload::PendingReload>,
}

impl Daemon {
    /// Tells systemd that startup is done (every configured device is LIVE or failed).
    pub fn notify_ready(&mut self) {
        let status = self.summary();
        self.notifier.ready(&status);
    }

    fn summary(&self) -> String {
        let (mut live, mut recovering, mut waiting) = (0, 0, 0);
        for dev in self.devices.values() {
            match dev.state().summary() {
                Summary::Live => live += 1,
                Summary::Recovering => recovering += 1,
                Summary::Waiting => waiting += 1,
            }
        }
        crate::systemd::summary(live, recovering, waiting, self.last_event.as_ref())
    }
}

/// The dedicated user of sandboxed workers, created by the package.
pub const DEFAULT_WORKER_USER: &str = "ublkd-worker";

#[cfg(test)]
mod tests {
    use super::startup::made_from;
    use super::*;

    fn spec(target: &str) -> DeviceSpec {
        let text = format!("[[device]]\n{target}\n");
        Config::parse(&text, "test").unwrap().devices.remove(0)
    }

    #[test]
    fn a_made_device_is_its_configured_one_despite_what_creation_decided() {
        let file = std::env::temp_dir().join(format!("ublkd-made-from-{}", std::process::id()));
        std::fs::File::create(&file).unwrap().set_len(1 << 20).unwrap();
        let config = spec(&format!("target = \"loop\"\nfile = \"{}\"", file.display()));
        let _ = std::fs::remove_file(&file);
        let mut made = config.clone();
        made.id = Some(4);
        if let TargetSpec::Loop { zero_copy, .. } = &mut made.target {
            *zero_copy = Some(true);
        }
        assert!(made_from(&made, &config));

        let config = spec("target = \"nbd\"\nuri = \"nbd+unix:///?socket=/run/n.sock\"");
        let mut made = config.clone();
        (made.id, made.size_bytes, made.settings.block_size) = (Some(2), 1 << 30, 4096);
        // Unset is copying: what the record says of a device made from it.
        if let TargetSpec::Nbd { zero_copy, .. } = &mut made.target {
            *zero_copy = Some(false);
        }
        assert!(made_from(&made, &config));
        let mut zero_copy_made = made.clone();
        if let TargetSpec::Nbd { zero_copy, .. } = &mut zero_copy_made.target {
            *zero_copy = Some(true);
        }
        assert!(!made_from(&zero_copy_made, &config), "zero copy is another device");
        made.settings.queues += 1;
        assert!(!made_from(&made, &config), "a changed queue count is another device");

        let memory = spec("target = \"memory\"\nsize = \"1G\"");
        let mut bigger = memory.clone();
        (bigger.id, bigger.size_bytes) = (Some(5), bigger.size_bytes * 2);
        // `ublkctl resize` changes a device's size, not which device it is: made again
        // it would be a second one.
        assert!(made_from(&bigger, &memory), "a resized device is its configured one");
        // Under the id the config gives, it is adopted either way; a size the config
        // does not give is said to differ from it.
        let mut with_id = memory.clone();
        with_id.id = Some(5);
        assert!(!made_from(&bigger, &with_id), "a size other than the config's differs");
    }
}
