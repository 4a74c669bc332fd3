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
//! SIGHUP's config reload is `reload`. With `daemon.metrics_file` set, the loop also
//! hands a snapshot of every device's numbers to [`crate::metrics::FileWriter`]'s thread
//! each interval.

use std::collections::BTreeMap;
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

mod delete;
mod handlers;
mod reload;
mod upgrade;

use handlers::describe_spec;
pub use handlers::spec_from_request;

use crate::control::{ControlServer, Token};
use crate::device::{Context, Creation, Device, DeviceError, Progress};
use crate::device_state::{StateKind, Summary};
use crate::metrics::FileWriter;
use crate::state::StateDir;
use crate::systemd::Notifier;
use crate::target::{NbdLink, TargetError, connect_export};
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
    last_event: Option<String>,
    ctx: Context,
    devices: BTreeMap<u32, Device>,
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
}

/// An `ublkctl recover` answered once its recovery ends (a standby still starting, a
/// slow release, an nbd server away), so that the operator's command returns with the
/// device served (or with why not), not while it still recovers; at the latest after
/// [`RECOVER_ANSWER_WAIT`], with where it stands.
#[derive(Debug)]
struct PendingRecover {
    token: Token,
    id: u32,
    deadline: Instant,
}

/// The longest an `ublkctl recover` waits for its answer: well inside ublkctl's 120 s,
/// past a standby's 30 s start limit.
const RECOVER_ANSWER_WAIT: Duration = Duration::from_secs(60);

/// An `ublkctl add` under way, answered once its device is LIVE (or has failed), so
/// that no add holds up the loop (other devices' recoveries, clients, other adds, the
/// watchdog): an nbd device's export is first connected and negotiated on a thread of
/// its own (up to the handshake's 10 s), then every device's first worker starts while
/// the loop watches its control socket ([`Creation`]: 0.1-1 s under emulation). Adds
/// issued together overlap.
#[derive(Debug)]
struct PendingAdd {
    token: Token,
    /// As asked (for [`Daemon::check_add`]'s conflicts).
    spec: DeviceSpec,
    stage: AddStage,
    /// Adds of this device begun so far: one whose worker was lost (killed while the
    /// device was being made, say) is begun again, up to [`ADD_ATTEMPTS`] in all.
    attempts: u8,
}

/// How many times an add is begun before a lost worker fails it: a client asked for
/// a device, not for a particular worker process, so a worker killed under it (an
/// operator's or an OOM killer's doing) costs a new worker, not an error.
const ADD_ATTEMPTS: u8 = 10;

/// How long a never-started device's leftover worker may take to end after SIGKILL
/// before the device is left for the next start rather than deleted under it.
const NEVER_STARTED_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug)]
enum AddStage {
    /// The nbd export is being negotiated on a thread.
    Connecting(mpsc::Receiver<Result<Option<NbdLink>, TargetError>>),
    /// The device is made; its first worker is starting.
    Starting(Box<Creation>),
}

/// How often the loop looks whether an nbd add's handshake is done.
const PENDING_ADD_POLL: Duration = Duration::from_millis(20);

impl Daemon {
    /// Checks the kernel, prepares the state dir and socket, installs signal handling.
    pub fn start(config: Config, config_path: Option<PathBuf>) -> Result<Daemon, DaemonError> {
        let ctrl = CtrlClient::open()?;
        let kernel_features = ctrl.get_features()?;
        let missing = features::missing_required(kernel_features);
        if !missing.is_empty() {
            return Err(DaemonError::MissingFeatures(missing.join(", ")));
        }
        let worker_binary =
            config.daemon.worker_binary_path().map_err(DaemonError::WorkerBinary)?;
        let worker_identity = worker_identity(config.daemon.worker_user.as_deref())?;
        make_dir(&config.daemon.state_dir, 0o700)?;
        let state = StateDir::new(&config.daemon.state_dir);
        state.check()?;
        // Signals first: a SIGTERM that arrives once the socket exists must stop ublkd
        // cleanly, not kill it.
        let signals = Signals::install().map_err(DaemonError::Signals)?;
        let listener = listen(&config.daemon.socket)?;
        let control = ControlServer::new(listener)
            .map_err(|source| DaemonError::Listen { path: config.daemon.socket.clone(), source })?;
        tracing::info!(socket = %config.daemon.socket.display(), "ublkd listening");
        let metrics_file = config.daemon.metrics_file.clone().and_then(|path| {
            let shown = path.display().to_string();
            FileWriter::start(path, config.daemon.metrics_interval)
                .inspect_err(|e| tracing::error!("not writing the metrics file {shown}: {e}"))
                .ok()
        });
        let fast_release = config.recovery.fast_release;
        let nbd_server_wait = config.recovery.nbd_server_wait;
        let ctx = Context {
            ctrl,
            worker_binary,
            state,
            worker_identity,
            kernel_features,
            fast_release,
            nbd_server_wait,
        };
        Ok(Daemon {
            config,
            config_path,
            configured: Vec::new(),
            notifier: Notifier::new(),
            last_event: None,
            shutting_down: false,
            ctx,
            devices: BTreeMap::new(),
            control,
            signals,
            metrics_file,
            pending_adds: Vec::new(),
            pending_recovers: Vec::new(),
            pending_upgrades: Vec::new(),
            pending_deletes: Vec::new(),
        })
    }

    /// Adopts the devices a previous ublkd left in the state dir (after a crash, its
    /// workers died with it and the devices wait QUIESCED). Devices whose record is
    /// missing or whose kernel tag is not ublkd's are never touched.
    pub fn adopt_previous(&mut self) -> usize {
        let mut adopted = 0;
        for id in self.ctx.state.recover_set_aside() {
            tracing::warn!(
                dev_id = id,
                "the previous ublkd died while deleting device {id}: its record is back, and \
                 the device is adopted if the kernel still has it (delete it again)"
            );
        }
        for rec in self.ctx.state.records() {
            let rec = match rec {
                Ok(rec) => rec,
                Err(e) => {
                    tracing::error!("not adopting: {e}");
                    continue;
                }
            };
            let id = rec.id;
            match Device::adopt(&self.ctx, &rec) {
                Ok(dev) => {
                    self.devices.insert(id, dev);
                    adopted += 1;
                }
                Err(e @ DeviceError::NeverStarted { .. }) => {
                    // The first worker the previous ublkd activated may still run, with
                    // /dev/ublkcN open: deleting the device meanwhile would wait on it
                    // (and the worker would outlive its device). It goes first.
                    let claim = self.ctx.state.worker_claim(id).ok().flatten();
                    if let Some(claim) = claim
                        && !crate::worker::Worker::kill_claimed(&claim, NEVER_STARTED_GRACE)
                    {
                        tracing::error!(
                            dev_id = id,
                            worker_pid = claim.pid,
                            "{e}, but its worker {} did not end within {} s of SIGKILL: the \
                             device is left, and deleted at the next start",
                            claim.pid,
                            NEVER_STARTED_GRACE.as_secs()
                        );
                        continue;
                    }
                    let deleted = self.ctx.ctrl.del_dev(id);
                    match deleted {
                        Ok(()) => tracing::warn!(dev_id = id, "{e}: deleted it"),
                        Err(del) => tracing::error!(dev_id = id, "{e}; deleting it failed: {del}"),
                    }
                    self.ctx.state.remove(id);
                }
                Err(DeviceError::NotOurs { id, why }) => {
                    tracing::warn!(
                        dev_id = id,
                        "forgetting the record of a device that is not ublkd's: {why}"
                    );
                    self.ctx.state.remove(id);
                }
                Err(DeviceError::Ctrl(e)) if e.errno() == Some(libc::ENODEV) => {
                    tracing::info!(
                        dev_id = id,
                        "the recorded device no longer exists; forgetting it"
                    );
                    self.ctx.state.remove(id);
                }
                Err(e) => tracing::error!(dev_id = id, "cannot adopt: {e}"),
            }
        }
        // Every adopted device's standby is starting: recover each device whose worker
        // was not taken over onto its own. The recoveries wait for their standbys side
        // by side (see below).
        for (&id, dev) in &mut self.devices {
            if dev.state().kind() == StateKind::Live {
                continue;
            }
            match dev.recover(&self.ctx, "the supervisor restarted") {
                Ok(_) => tracing::info!(
                    dev_id = id,
                    event = "adopted",
                    "adopted the device of a previous ublkd"
                ),
                Err(e) => {
                    tracing::error!(dev_id = id, "adopted, but not recovered: {e}");
                    dev.wait_for_operator(format!(
                        "adopted from a previous ublkd, but the recovery failed: {e}; its I/O \
                         is held: fix the cause, then run `ublkctl recover {id}`"
                    ));
                }
            }
        }
        // READY (which follows) still means every adopted device is served, failed, or
        // waiting for the kernel's release (which only the loop waits for).
        while self.devices.values().any(Device::awaiting_standby) {
            std::thread::sleep(Duration::from_millis(10));
            self.continue_recoveries();
        }
        adopted
    }

    /// Creates the configured devices; one that fails is reported and skipped. A
    /// configured device that was adopted from a previous ublkd (same description, and
    /// the same id if the config gives one) is not created again.
    pub fn create_configured(&mut self) -> usize {
        let mut failed = 0;
        let mut missing = Vec::new();
        let mut adopted: Vec<DeviceSpec> =
            self.devices.values().map(|d| d.spec().clone()).collect();
        for spec in self.config.devices.clone() {
            let same = |made: &DeviceSpec| made_from(made, &spec);
            if let Some(at) = adopted.iter().position(same) {
                let adopted_spec = adopted.remove(at);
                if let Some(id) = adopted_spec.id {
                    self.configured.push((spec.clone(), id));
                }
                continue;
            }
            missing.push(spec);
        }
        for (spec, made) in missing.iter().zip(self.create_all(&missing, true)) {
            match made {
                Ok(id) => self.configured.push((spec.clone(), id)),
                Err(e) => {
                    tracing::error!("configured device {}: {e}", describe_spec(spec));
                    self.last_event =
                        Some(format!("configured device {} failed: {e}", describe_spec(spec)));
                    failed += 1;
                }
            }
        }
        failed
    }

    /// Tells systemd that startup is done (every configured device is LIVE or failed).
    pub fn notify_ready(&mut self) {
        let status = self.summary();
        self.notifier.ready(&status);
    }

    fn summary(&self) -> String {
        let count = |s| self.devices.values().filter(|d| d.state().summary() == s).count();
        let (live, recovering, waiting) =
            (count(Summary::Live), count(Summary::Recovering), count(Summary::Waiting));
        crate::systemd::summary(live, recovering, waiting, self.last_event.as_deref())
    }

    /// `ublkctl add`: answered now if it is refused, else once its device is LIVE or
    /// has failed ([`PendingAdd`], `None` here): an nbd device's export negotiated on a
    /// thread of its own, then every device's worker started while the loop goes on.
    fn begin_add(&mut self, token: Token, add: &AddRequest) -> Option<CtlResponse> {
        let spec = match self.check_add(add) {
            Ok(spec) => spec,
            Err(e) => return Some(CtlResponse::Error { message: e }),
        };
        match self.first_add_stage(&spec) {
            Ok(stage) => {
                self.pending_adds.push(PendingAdd { token, spec, stage, attempts: 1 });
                None
            }
            Err(message) => Some(CtlResponse::Error { message }),
        }
    }

    /// Where an add of `spec` (checked) begins: an nbd export negotiated on a thread
    /// of its own, any other device made at once with its worker starting.
    fn first_add_stage(&self, spec: &DeviceSpec) -> Result<AddStage, String> {
        if !matches!(spec.target, TargetSpec::Nbd { .. }) {
            return Device::begin_create(&self.ctx, spec, None)
                .map(|creation| AddStage::Starting(Box::new(creation)))
                .map_err(|e| e.to_string());
        }
        let (tx, connected) = mpsc::channel();
        let for_thread = spec.clone();
        let data_path = DataPath::for_kernel(self.ctx.kernel_features);
        std::thread::Builder::new()
            .name("nbd-add".into())
            .spawn(move || drop(tx.send(connect_export(&for_thread, data_path))))
            .map_err(|e| format!("cannot start a thread to connect: {e}"))?;
        Ok(AddStage::Connecting(connected))
    }

    /// Moves every add under way on: makes the devices of the nbd adds whose
    /// handshakes are done, hands each new device whose worker has answered to it, and
    /// answers the adds that are done.
    fn finish_pending_adds(&mut self) {
        let mut waiting = Vec::with_capacity(self.pending_adds.len());
        for mut pending in std::mem::take(&mut self.pending_adds) {
            if let AddStage::Connecting(connected) = &pending.stage {
                let begun = match connected.try_recv() {
                    Ok(connected) => connected
                        .map_err(DeviceError::from)
                        .and_then(|link| Device::begin_create(&self.ctx, &pending.spec, link)),
                    Err(mpsc::TryRecvError::Empty) => {
                        waiting.push(pending);
                        continue;
                    }
                    Err(mpsc::TryRecvError::Disconnected) => {
                        let why = "the thread negotiating the export ended without an answer";
                        let response = CtlResponse::Error { message: why.into() };
                        self.control.respond(pending.token, &response, Instant::now());
                        continue;
                    }
                };
                match begun {
                    Ok(creation) => pending.stage = AddStage::Starting(Box::new(creation)),
                    Err(e) => {
                        let response = CtlResponse::Error { message: e.to_string() };
                        self.control.respond(pending.token, &response, Instant::now());
                        continue;
                    }
                }
            }
            let AddStage::Starting(creation) = pending.stage else { continue };
            let response = match creation.progress(&self.ctx, Instant::now()) {
                Progress::Pending(creation) => {
                    pending.stage = AddStage::Starting(Box::new(creation));
                    waiting.push(pending);
                    continue;
                }
                Progress::Done(Ok(dev)) => {
                    let id = dev.id();
                    self.devices.insert(id, dev);
                    CtlResponse::Added { id }
                }
                Progress::Done(Err(e)) if e.worker_lost() && pending.attempts < ADD_ATTEMPTS => {
                    pending.attempts += 1;
                    tracing::warn!(
                        event = "add_retried",
                        "adding {} again (attempt {} of {ADD_ATTEMPTS}): {e}",
                        describe_spec(&pending.spec),
                        pending.attempts
                    );
                    match self.first_add_stage(&pending.spec) {
                        Ok(stage) => {
                            pending.stage = stage;
                            waiting.push(pending);
                            continue;
                        }
                        Err(message) => CtlResponse::Error { message },
                    }
                }
                Progress::Done(Err(e)) => CtlResponse::Error { message: e.to_string() },
            };
            self.control.respond(pending.token, &response, Instant::now());
        }
        self.pending_adds = waiting;
    }

    /// `ublkctl recover`: answered now if the recovery ended at once (or was refused),
    /// else once it ends ([`PendingRecover`], `None` here).
    fn begin_recover(&mut self, token: Token, id: u32) -> Option<CtlResponse> {
        match self.handle_recover(id) {
            Ok(Some(message)) => Some(CtlResponse::Recovered { id, message }),
            Ok(None) => {
                let deadline = Instant::now() + RECOVER_ANSWER_WAIT;
                self.pending_recovers.push(PendingRecover { token, id, deadline });
                None
            }
            Err(message) => Some(CtlResponse::Error { message }),
        }
    }

    /// Answers the `ublkctl recover`s whose recovery has ended, and with where it
    /// stands those held up outside ublkd, those that waited [`RECOVER_ANSWER_WAIT`],
    /// or all, at `stopping`.
    fn answer_recovers(&mut self, stopping: bool) {
        let now = Instant::now();
        for pending in std::mem::take(&mut self.pending_recovers) {
            let id = pending.id;
            let result = match self.recover_outcome(id) {
                Some(outcome) => outcome,
                None if stopping => Err(format!(
                    "ublkd stopped before device {id} was recovered; the next ublkd recovers it"
                )),
                // Waiting on what ublkd cannot hurry (a release behind a slow backend,
                // an NBD server away) is said at once, as status says it.
                None if now >= pending.deadline || self.recovery_held_up(id) => {
                    Err(self.recovering_message(id))
                }
                None => {
                    self.pending_recovers.push(pending);
                    continue;
                }
            };
            let response = match result {
                Ok(message) => CtlResponse::Recovered { id, message },
                Err(message) => CtlResponse::Error { message },
            };
            self.control.respond(pending.token, &response, now);
        }
    }

    /// Gives up the adds under way for device `id` (every one for `None`) because of
    /// `why`: a device already made in the kernel is deleted with its worker and record
    /// ([`Creation::abandon`]), an export being negotiated is dropped when its thread
    /// answers, and each add is answered with `why`. The ids of the devices that had
    /// been made.
    pub(super) fn give_up_pending_adds(&mut self, id: Option<u32>, why: &str) -> Vec<u32> {
        let mut made = Vec::new();
        let mut kept = Vec::with_capacity(self.pending_adds.len());
        for pending in std::mem::take(&mut self.pending_adds) {
            let pending_id = match &pending.stage {
                AddStage::Starting(creation) => Some(creation.id()),
                AddStage::Connecting(_) => pending.spec.id,
            };
            if id.is_some_and(|id| pending_id != Some(id)) {
                kept.push(pending);
                continue;
            }
            if let AddStage::Starting(creation) = pending.stage {
                tracing::info!(dev_id = creation.id(), "{why}: giving up an add under way");
                made.push(creation.id());
                creation.abandon(&self.ctx);
            }
            let message = format!("{why} before the device was made");
            self.control.respond(pending.token, &CtlResponse::Error { message }, Instant::now());
        }
        self.pending_adds = kept;
        made
    }

    /// The adds under way with a device id, as `ublkctl status` shows them: an nbd add
    /// still negotiating has an id only if it asked for one.
    pub(super) fn pending_statuses(&self) -> Vec<DevStatus> {
        self.pending_adds
            .iter()
            .filter_map(|pending| {
                let (id, spec, worker_pid, note) = match &pending.stage {
                    AddStage::Starting(creation) => (
                        creation.id(),
                        creation.spec(),
                        creation.worker_pid(),
                        "being added: its first worker is starting",
                    ),
                    AddStage::Connecting(_) => (
                        pending.spec.id?,
                        &pending.spec,
                        None,
                        "being added: ublkd is negotiating its NBD export",
                    ),
                };
                Some(DevStatus {
                    id,
                    state: "ADDING".into(),
                    target: spec.target.name().to_string(),
                    worker_pid,
                    size_bytes: spec.size_bytes,
                    queues: spec.settings.queues,
                    queue_depth: spec.settings.queue_depth,
                    threads: spec.settings.threads,
                    recoveries: 0,
                    last_recovery_ms: None,
                    last_recovery_reason: None,
                    standby_pid: None,
                    sandbox: None,
                    counters: Default::default(),
                    note: Some(note.into()),
                    failing_io: false,
                    latency: Default::default(),
                })
            })
            .collect()
    }

    /// Creates the devices of `specs` (configured ones, at start or in a reload),
    /// [`CREATING_AT_ONCE`] at a time so that their workers' start-ups overlap, and
    /// waits until each is LIVE or has failed: the outcome of each, in order. An nbd
    /// device's export is negotiated here first. `starting`: ublkd is starting, and
    /// tells systemd that it needs time for each device.
    fn create_all(
        &mut self,
        specs: &[DeviceSpec],
        starting: bool,
    ) -> Vec<Result<u32, DeviceError>> {
        let mut outcomes: Vec<(usize, Result<u32, DeviceError>)> = Vec::with_capacity(specs.len());
        let mut creating: Vec<(usize, Creation)> = Vec::new();
        let mut next = specs.iter().enumerate();
        loop {
            while creating.len() < CREATING_AT_ONCE {
                // The next few, their nbd exports negotiated side by side: a server
                // that takes its 10 s delays its own device, not the others'.
                let batch: Vec<(usize, &DeviceSpec)> =
                    next.by_ref().take(CREATING_AT_ONCE - creating.len()).collect();
                if batch.is_empty() {
                    break;
                }
                if starting {
                    self.notifier.extend_timeout(Duration::from_secs(60));
                }
                let data_path = DataPath::for_kernel(self.ctx.kernel_features);
                let links = connect_exports(batch.iter().map(|(_, spec)| *spec), data_path);
                for ((at, spec), link) in batch.into_iter().zip(links) {
                    let begun = link
                        .map_err(DeviceError::from)
                        .and_then(|link| Device::begin_create(&self.ctx, spec, link));
                    match begun {
                        Ok(creation) => creating.push((at, creation)),
                        Err(e) => outcomes.push((at, Err(e))),
                    }
                }
            }
            if creating.is_empty() {
                break;
            }
            wait_for_workers(creating.iter().map(|(_, c)| c));
            for (at, creation) in std::mem::take(&mut creating) {
                match creation.progress(&self.ctx, Instant::now()) {
                    Progress::Pending(creation) => creating.push((at, creation)),
                    Progress::Done(made) => outcomes.push((
                        at,
                        made.map(|dev| {
                            let id = dev.id();
                            self.devices.insert(id, dev);
                            id
                        }),
                    )),
                }
            }
        }
        outcomes.sort_unstable_by_key(|(at, _)| *at);
        outcomes.into_iter().map(|(_, made)| made).collect()
    }

    /// Serves until SIGTERM or SIGINT, then exits leaving every device in the kernel
    /// (each LIVE device's worker serves on, for the next ublkd to take over; the
    /// kernel holds the others' I/O until the next ublkd recovers them), or until
    /// `ublkctl shutdown`, which deletes every device first.
    pub fn run(mut self) -> Result<(), DaemonError> {
        loop {
            let hung_timeout = self.config.recovery.hung_timeout;
            // Heartbeats are compared four times per timeout: a hang is seen within 1.5
            // timeouts (the no-completion rule holds on two ticks in a row). No more
            // often: an idle device's tick is the only thing that wakes
            // ublkd, and each wake-up costs CPU (much of it on an emulated machine). The
            // watchdog, a due standby, a recovery waiting for the kernel's release and a
            // control connection's deadline shorten it.
            let mut tick = (hung_timeout / 4).max(Duration::from_millis(100));
            if let Some(w) = self.notifier.watchdog_interval() {
                tick = tick.min(w);
            }
            let mut wake_by = Instant::now() + tick;
            let mut fds = vec![libc::pollfd {
                fd: self.signals.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            self.control.pollfds(&mut fds);
            let control_fds = 1..fds.len();
            // At the cap, a due standby waits for a starting one to answer (its socket
            // is polled), not for a timer that would spin the loop.
            let standbys_may_start = self.standbys_starting() < STANDBYS_STARTING_AT_ONCE;
            for dev in self.devices.values() {
                for w in [dev.worker(), dev.standby(), dev.dying()].into_iter().flatten() {
                    fds.push(libc::pollfd {
                        fd: w.pidfd().as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
                // A starting standby answers (or hangs up) on its control socket.
                if let Some(w) = dev.starting() {
                    fds.push(libc::pollfd {
                        fd: w.control().as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
                let standby_due = dev.standby_due().filter(|_| standbys_may_start);
                for due in [standby_due, dev.release_due()].into_iter().flatten() {
                    wake_by = wake_by.min(due);
                }
            }
            let worker_fds = control_fds.end..fds.len();
            // A new device's starting worker answers (or hangs up) on its control
            // socket; an nbd add's handshake has no fd to poll.
            for pending in &self.pending_adds {
                match &pending.stage {
                    AddStage::Starting(creation) => {
                        wake_by = wake_by.min(creation.deadline());
                        if let Some(fd) = creation.control() {
                            let fd = fd.as_raw_fd();
                            fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                        }
                    }
                    AddStage::Connecting(_) => {
                        wake_by = wake_by.min(Instant::now() + PENDING_ADD_POLL);
                    }
                }
            }
            for pending in &self.pending_recovers {
                wake_by = wake_by.min(pending.deadline);
            }
            if self.deleting() {
                wake_by = wake_by.min(Instant::now() + delete::DELETE_POLL);
            }
            for pending in &self.pending_upgrades {
                let (fd, due) = pending.wake();
                if let Some(fd) = fd {
                    fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                }
                if let Some(due) = due {
                    wake_by = wake_by.min(due);
                }
            }
            let control_due = self.control.next_deadline();
            if let Some(due) = control_due {
                wake_by = wake_by.min(due);
            }
            if let Some(writer) = &self.metrics_file {
                wake_by = wake_by.min(writer.due());
            }
            let idle = self.devices.is_empty()
                && self.pending_adds.is_empty()
                && self.pending_recovers.is_empty()
                && self.pending_upgrades.is_empty()
                && self.pending_deletes.is_empty()
                && self.notifier.watchdog_interval().is_none()
                && control_due.is_none()
                && self.metrics_file.is_none();
            let timeout = if idle { -1 } else { millis_until(wake_by) };
            // SAFETY: `fds` is a valid array of pollfds for the duration of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if n < 0 {
                continue; // EINTR: a signal; its flag is checked on the next turn.
            }
            // When a death became visible: a recovery's stall is counted from here.
            let woke = Instant::now();
            if fds[0].revents & libc::POLLIN != 0 {
                self.signals.drain();
            }
            self.signals.child.store(false, Ordering::Relaxed);
            crate::worker::reap_lingering();
            if self.signals.terminate.load(Ordering::Relaxed) {
                break;
            }
            if self.signals.reload.swap(false, Ordering::Relaxed) {
                self.reload();
            }
            // Deaths first (pidfds), then hangs, then clients. A turn on which no pidfd
            // or standby socket was ready saw nothing die or answer, and costs no wait4
            // per worker.
            let worker_events = fds[worker_fds].iter().any(|p| p.revents != 0);
            let mut turn = TurnTimes::new(woke);
            self.handle_deaths(woke, worker_events);
            turn.mark("deaths");
            self.continue_recoveries();
            turn.mark("recoveries");
            for dev in self.devices.values_mut() {
                recovery::kill_if_hung(dev, &self.config.recovery);
            }
            let hung = self.devices.values().filter(|d| !d.progressing(hung_timeout)).count();
            self.notifier.watchdog(Instant::now(), hung);
            let status = self.summary();
            self.notifier.status(&status);
            turn.mark("hangs");
            self.finish_pending_adds();
            turn.mark("adds");
            self.advance_upgrades(false);
            turn.mark("upgrades");
            self.finish_deletes(false);
            for (token, req) in self.control.service(&fds[control_fds], Instant::now()) {
                let response = match req {
                    CtlRequest::Add(_)
                    | CtlRequest::Upgrade { .. }
                    | CtlRequest::Recover { .. }
                        if self.shutting_down =>
                    {
                        let message = "ublkd is shutting down".to_string();
                        CtlResponse::Error { message }
                    }
                    CtlRequest::Del { id } => match self.begin_del(token, id, false) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::Shutdown => match self.begin_del(token, None, true) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::Add(add) => match self.begin_add(token, &add) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::Recover { id } => match self.begin_recover(token, id) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::Upgrade { id } => match self.selected(id) {
                        Ok(ids) => {
                            self.begin_upgrade(token, ids);
                            continue;
                        }
                        Err(message) => CtlResponse::Error { message },
                    },
                    req => self.handle(req),
                };
                self.control.respond(token, &response, Instant::now());
            }
            turn.mark("requests");
            turn.report();
            // After the requests: a `del` of a device being recovered is answered in
            // the same turn.
            self.answer_recovers(false);
            if let Some(mut writer) = self.metrics_file.take() {
                writer.tick(Instant::now(), || {
                    self.devices.keys().filter_map(|id| self.metrics(*id)).collect()
                });
                self.metrics_file = Some(writer);
            }
            if self.shutting_down && !self.deleting() {
                break;
            }
        }
        self.notifier.stopping();
        // Adds under way are given up (their devices deleted, their workers ended),
        // not left half-made, and their clients told so.
        self.give_up_pending_adds(None, "ublkd stopped");
        self.answer_recovers(true);
        self.advance_upgrades(true);
        self.finish_deletes(true);
        let mut serving_on = 0;
        if !self.devices.is_empty() {
            // Deleting is explicit (`ublkctl del`, `shutdown`, a reload): a stop or a
            // restart must not pull block devices from under their users.
            let serving =
                self.devices.values().filter(|d| d.state().kind() == StateKind::Live).count();
            tracing::info!(
                event = "stopping",
                "stopping: leaving {} device(s) to the next ublkd, {serving} of them served \
                 on by their workers meanwhile (the others' I/O is held until it recovers \
                 them)",
                self.devices.len()
            );
            self.leave_all();
            serving_on = serving;
        }
        if let Some(relay) = crate::worker_log::Relay::get() {
            relay.flush(Duration::from_secs(1), serving_on);
        }
        let _ = std::fs::remove_file(&self.config.daemon.socket);
        tracing::info!("ublkd exits");
        Ok(())
    }

    /// Recovers every device whose worker died, within its restart budget, and starts
    /// standbys that are due. `events`: whether the poll reported a ready fd (without
    /// one no worker died and no starting standby answered).
    fn handle_deaths(&mut self, woke: Instant, events: bool) {
        let mut starting = self.standbys_starting();
        let mut spawned = 0;
        for (&id, dev) in &mut self.devices {
            // A mass death (every worker OOM-killed) is hundreds of recoveries, one
            // after another: past a turn's share, the rest wait for the next turn (their
            // pidfds keep the poll ready), so that clients, hangs and the watchdog are
            // served between them and `ublkctl status` shows the recovery progress.
            if woke.elapsed() > DEATHS_PER_TURN {
                break;
            }
            if events {
                dev.standby_progress();
            }
            if starting < STANDBYS_STARTING_AT_ONCE
                && spawned < STANDBYS_SPAWNED_PER_TURN
                && dev.starting().is_none()
            {
                dev.refill_standby_if_due(&self.ctx);
                let started = usize::from(dev.starting().is_some());
                (starting, spawned) = (starting + started, spawned + started);
            }
            if !events {
                continue;
            }
            if let Some(how) = dev.standby_exited() {
                tracing::warn!(dev_id = id, "{how}; starting another");
                dev.refill_standby(&self.ctx);
            }
            let pid = dev.worker().map(|w| w.pid());
            let Some(death) = dev.worker_exited(woke) else { continue };
            tracing::error!(dev_id = id, worker_pid = pid, event = "worker_died", "{}", death.how);
            let rc = &self.config.recovery;
            let counts = !death.backend_lost;
            let event =
                recovery::after_death(dev, &self.ctx, rc, &death.reason(), counts, &self.notifier);
            self.last_event = Some(event);
        }
    }

    /// How many standbys are starting (spawned, not yet standing by).
    fn standbys_starting(&self) -> usize {
        self.devices.values().filter(|d| d.starting().is_some()).count()
    }

    /// Goes on with every recovery that waits for the kernel's release and is due.
    fn continue_recoveries(&mut self) {
        let now = Instant::now();
        for dev in self.devices.values_mut() {
            if let Some(event) =
                recovery::continue_if_due(dev, &self.ctx, &self.config.recovery, now)
            {
                self.last_event = Some(event);
            }
        }
    }

    /// Leaves every LIVE device's worker serving and kills the rest now (standbys would
    /// end with their control sockets at ublkd's exit; a killed worker's device is held
    /// by the kernel from this moment, for the next ublkd to recover), so that the
    /// relay logs their last lines.
    fn leave_all(&mut self) {
        let mut workers: Vec<crate::worker::Worker> =
            std::mem::take(&mut self.devices).into_values().flat_map(Device::leave).collect();
        for w in &mut workers {
            w.kill();
        }
        for mut w in workers {
            let pid = w.pid();
            let how = w.reap(Duration::ZERO);
            tracing::debug!(worker_pid = pid, "worker ended: {how}");
        }
    }
}

/// Where a loop turn's time went, said when the turn held the loop long enough for a
/// client to notice ([`SLOW_TURN`]).
struct TurnTimes {
    at: Instant,
    started: Instant,
    steps: Vec<(&'static str, Duration)>,
}

/// A turn longer than this is logged, with its steps.
const SLOW_TURN: Duration = Duration::from_millis(100);

impl TurnTimes {
    fn new(started: Instant) -> TurnTimes {
        TurnTimes { at: started, started, steps: Vec::new() }
    }

    fn mark(&mut self, step: &'static str) {
        let now = Instant::now();
        self.steps.push((step, now - self.at));
        self.at = now;
    }

    fn report(&self) {
        let took = self.started.elapsed();
        if took < SLOW_TURN {
            return;
        }
        let steps: Vec<String> =
            self.steps.iter().map(|(s, d)| format!("{s} {} ms", d.as_millis())).collect();
        tracing::info!(
            event = "slow_turn",
            "a loop turn took {} ms: {}",
            took.as_millis(),
            steps.join(", ")
        );
    }
}

/// The user sandboxed workers run as: `daemon.worker_user`, else `ublkd-worker` (which
/// the package creates), else `nobody` with a warning (a source build run by hand).
/// Whether the device `made` (as ublkd created it, from its record) is the configured
/// `config`: the same, but for what ublkd decides at creation where the config leaves
/// it open: the id if none is given, a loop device's zero copy, an nbd device's size and
/// block size (its export's).
fn made_from(made: &DeviceSpec, config: &DeviceSpec) -> bool {
    let mut made = made.clone();
    if config.id.is_none() {
        made.id = None;
    }
    match (&mut made.target, &config.target) {
        (TargetSpec::Loop { zero_copy, .. }, TargetSpec::Loop { zero_copy: None, .. }) => {
            *zero_copy = None;
        }
        (TargetSpec::Nbd { .. }, TargetSpec::Nbd { .. }) => {
            made.size_bytes = config.size_bytes;
            if made.settings.block_size >= config.settings.block_size {
                made.settings.block_size = config.settings.block_size;
            }
        }
        _ => {}
    }
    made == *config
}

fn worker_identity(configured: Option<&str>) -> Result<WorkerIdentity, DaemonError> {
    let lookup = |name: &str| {
        nix::unistd::User::from_name(name)
            .ok()
            .flatten()
            .map(|u| WorkerIdentity { uid: u.uid.as_raw(), gid: u.gid.as_raw() })
    };
    if let Some(name) = configured {
        return lookup(name).ok_or_else(|| DaemonError::NoWorkerUser(name.to_string()));
    }
    if let Some(id) = lookup(DEFAULT_WORKER_USER) {
        return Ok(id);
    }
    let nobody =
        lookup("nobody").ok_or_else(|| DaemonError::NoWorkerUser(DEFAULT_WORKER_USER.into()))?;
    tracing::warn!(
        "the worker user {DEFAULT_WORKER_USER} does not exist (the package creates it); \
         sandboxed workers run as nobody (uid {})",
        nobody.uid
    );
    Ok(nobody)
}

/// The dedicated user of sandboxed workers, created by the package.
pub const DEFAULT_WORKER_USER: &str = "ublkd-worker";

/// How long one loop turn spends on deaths and recoveries before it serves the rest
/// (clients, hang checks, the watchdog); the remaining deaths wait for the next turn.
const DEATHS_PER_TURN: Duration = Duration::from_secs(1);

/// How many standbys may be starting at once. Each start (exec, sandbox, rings) takes
/// CPU from the devices serving: after every worker died at once (an OOM kill), the
/// recoveries, not hundreds of spares starting beside them, must have it.
const STANDBYS_STARTING_AT_ONCE: usize = 8;

/// How many standbys one loop turn starts: each is a fork and exec on the loop (tens
/// of milliseconds under emulation), and a turn that started eight made `ublkctl
/// status` wait for them; the rest start on the next turns, which come at once.
const STANDBYS_SPAWNED_PER_TURN: usize = 2;

/// How many configured devices [`Daemon::create_all`] creates at once: for the same
/// reason, as many as standbys may start at once.
const CREATING_AT_ONCE: usize = STANDBYS_STARTING_AT_ONCE;

/// [`connect_export`] for each of `specs`, in order: the nbd ones each on a thread of
/// its own, side by side (each within the handshake's time limit), the others at once.
fn connect_exports<'a>(
    specs: impl Iterator<Item = &'a DeviceSpec>,
    data_path: DataPath,
) -> Vec<Result<Option<NbdLink>, TargetError>> {
    /// A spec's export: negotiated already, or on its thread.
    enum Export<T> {
        Done(Result<Option<NbdLink>, TargetError>),
        Negotiating(String, T),
    }
    std::thread::scope(|scope| {
        let pending: Vec<_> = specs
            .map(|spec| {
                let TargetSpec::Nbd { uri } = &spec.target else {
                    return Export::Done(connect_export(spec, data_path));
                };
                match std::thread::Builder::new()
                    .name("nbd-configured".into())
                    .spawn_scoped(scope, move || connect_export(spec, data_path))
                {
                    Ok(thread) => Export::Negotiating(uri.to_string(), thread),
                    // No thread to be had: negotiated here, one after another.
                    Err(_) => Export::Done(connect_export(spec, data_path)),
                }
            })
            .collect();
        pending
            .into_iter()
            .map(|export| match export {
                Export::Done(done) => done,
                Export::Negotiating(uri, thread) => thread.join().unwrap_or_else(|_| {
                    let step = "negotiating on a thread of its own";
                    let source = io::Error::other("the thread ended without an answer");
                    let source = Box::new(crate::nbd::NbdError::Io { step, source });
                    Err(TargetError::Nbd { uri, source })
                }),
            })
            .collect()
    })
}

/// Waits until one of `creating`'s workers has something to say, or the first of their
/// deadlines.
fn wait_for_workers<'a>(creating: impl Iterator<Item = &'a Creation>) {
    let mut fds = Vec::new();
    let mut wake_by = Instant::now() + Duration::from_secs(1);
    for creation in creating {
        wake_by = wake_by.min(creation.deadline());
        if let Some(fd) = creation.control() {
            fds.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
    }
    // SAFETY: `fds` is a valid array of pollfds for the duration of the call. Its
    // outcome is not needed: each creation then looks at its own worker.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis_until(wake_by)) };
}

fn make_dir(path: &Path, mode: u32) -> Result<(), DaemonError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|source| DaemonError::Dir { path: path.to_path_buf(), source })
}

/// Binds the control socket (root-only), replacing a stale one but never a live one.
fn listen(path: &Path) -> Result<UnixListener, DaemonError> {
    if let Some(parent) = path.parent() {
        make_dir(parent, 0o755)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(DaemonError::AlreadyRunning { path: path.to_path_buf() });
        }
        let _ = std::fs::remove_file(path);
    }
    let listen_err = |source| DaemonError::Listen { path: path.to_path_buf(), source };
    let listener = UnixListener::bind(path).map_err(listen_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(listen_err)?;
    Ok(listener)
}

/// Milliseconds from now until `at` for poll's timeout, rounded up so that the loop
/// does not wake just before a deadline and spin until it.
fn millis_until(at: Instant) -> i32 {
    let left = at.saturating_duration_since(Instant::now());
    left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
}

#[cfg(test)]
mod tests {
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
        assert!(made_from(&made, &config));
        made.settings.queues += 1;
        assert!(!made_from(&made, &config), "a changed queue count is another device");

        let memory = spec("target = \"memory\"\nsize = \"1G\"");
        let mut bigger = memory.clone();
        bigger.size_bytes *= 2;
        assert!(!made_from(&bigger, &memory), "a memory device's size is its own");
    }
}
