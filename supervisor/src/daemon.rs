//! The running supervisor: its devices, the `ublkctl` socket and the signals it obeys.
//!
//! One thread does everything, in one `poll` loop over the control socket and its
//! connections (served without blocking: [`crate::control`]), a self-pipe that signal
//! handlers write to, and a pidfd per worker (readable the moment it dies).
//! Devices change only on that thread, so the device table needs no lock, and workers
//! are spawned from the thread that lives as long as the process (which
//! `PR_SET_PDEATHSIG` requires). While any device is served the loop also wakes a few
//! times per hung-worker timeout to compare heartbeats.
//!
//! A worker's death starts a recovery at once, within the device's restart budget;
//! past the budget the device stays QUIESCED (I/O waits, nothing fails) and `ublkctl
//! status` says why until an operator runs `ublkctl recover`.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ublkd_config::{Config, DeviceSpec, TargetSpec};
use ublkd_proto::ctrl::{CtrlClient, CtrlError};
use ublkd_proto::msg::{
    AddRequest, CtlRequest, CtlResponse, DevListing, DevStatus, LayerSet, TargetKind,
};
use ublkd_proto::uapi::DevState;

use crate::control::ControlServer;
use crate::device::{Context, Device, DeviceError, Recovery};
use crate::device_state::Summary;
use crate::state::StateDir;
use crate::systemd::Notifier;
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
}

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
        let fast_release = config.recovery.fast_release;
        let ctx =
            Context { ctrl, worker_binary, state, worker_identity, kernel_features, fast_release };
        Ok(Daemon {
            config,
            config_path,
            configured: Vec::new(),
            notifier: Notifier::new(),
            last_event: None,
            ctx,
            devices: BTreeMap::new(),
            control,
            signals,
        })
    }

    /// Adopts the devices a previous ublkd left in the state dir (after a crash, its
    /// workers died with it and the devices wait QUIESCED). Devices whose record is
    /// missing or whose kernel tag is not ublkd's are never touched.
    pub fn adopt_previous(&mut self) -> usize {
        let mut adopted = 0;
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
                    tracing::info!(
                        dev_id = id,
                        event = "adopted",
                        "adopted the device of a previous ublkd"
                    );
                    self.devices.insert(id, dev);
                    adopted += 1;
                }
                Err(e @ DeviceError::NeverStarted { .. }) => {
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
        adopted
    }

    /// Creates the configured devices; one that fails is reported and skipped. A
    /// configured device that was adopted from a previous ublkd (same description, and
    /// the same id if the config gives one) is not created again.
    pub fn create_configured(&mut self) -> usize {
        let mut failed = 0;
        let mut adopted: Vec<DeviceSpec> =
            self.devices.values().map(|d| d.spec().clone()).collect();
        for spec in self.config.devices.clone() {
            let same = |a: &DeviceSpec| {
                let mut a = a.clone();
                if spec.id.is_none() {
                    a.id = None;
                }
                a == spec
            };
            if let Some(at) = adopted.iter().position(same) {
                let adopted_spec = adopted.remove(at);
                if let Some(id) = adopted_spec.id {
                    self.configured.push((spec.clone(), id));
                }
                continue;
            }
            self.notifier.extend_timeout(Duration::from_secs(60));
            match self.add(&spec) {
                Ok(id) => self.configured.push((spec.clone(), id)),
                Err(e) => {
                    tracing::error!("configured device {}: {e}", describe(&spec));
                    self.last_event =
                        Some(format!("configured device {} failed: {e}", describe(&spec)));
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

    /// SIGHUP: re-reads the config file. Devices added to it are created, devices removed
    /// from it deleted; a changed device or daemon setting is reported as needing a
    /// restart. A config with errors is rejected whole and nothing changes.
    fn reload(&mut self) {
        self.notifier.reloading();
        let outcome = match &self.config_path {
            None => "reload: ublkd runs on built-in defaults, without a config file".to_string(),
            Some(path) => match Config::load(path) {
                Err(e) => {
                    let msg =
                        format!("reload rejected, nothing changed: {}", crate::error_chain(&e));
                    tracing::error!(event = "reload_rejected", "{msg}");
                    msg
                }
                Ok(new) => {
                    let msg = self.apply_config(new);
                    tracing::info!(event = "reloaded", "{msg}");
                    msg
                }
            },
        };
        self.last_event = Some(outcome);
        let status = self.summary();
        self.notifier.ready(&status);
    }

    fn apply_config(&mut self, new: Config) -> String {
        let mut restart_needed = Vec::new();
        if new.daemon != self.config.daemon {
            restart_needed.push("[daemon] settings".to_string());
        }
        let old_specs: Vec<DeviceSpec> = self.configured.iter().map(|(s, _)| s.clone()).collect();
        let mut added = 0;
        let mut removed = 0;
        // Removed (or changed) devices.
        for (spec, id) in std::mem::take(&mut self.configured) {
            if new.devices.contains(&spec) {
                self.configured.push((spec, id));
                continue;
            }
            let changed = spec.id.is_some() && new.devices.iter().any(|d| d.id == spec.id);
            if changed {
                restart_needed.push(format!("device {id}"));
                self.configured.push((spec, id));
                continue;
            }
            if let Some(dev) = self.devices.remove(&id) {
                match dev.destroy(&self.ctx) {
                    Ok(()) => removed += 1,
                    Err(e) => tracing::error!(dev_id = id, "reload: delete failed: {e}"),
                }
            }
        }
        // New devices.
        for spec in &new.devices {
            if old_specs.contains(spec) || spec.id.is_some_and(|id| self.devices.contains_key(&id))
            {
                continue;
            }
            match self.add(spec) {
                Ok(id) => {
                    self.configured.push((spec.clone(), id));
                    added += 1;
                }
                Err(e) => tracing::error!("reload: configured device {}: {e}", describe(spec)),
            }
        }
        let daemon = self.config.daemon.clone();
        self.ctx.fast_release = new.recovery.fast_release;
        self.config = new;
        // Socket, state dir and worker settings only change with a restart.
        self.config.daemon = daemon;
        let mut msg = format!("reloaded: {added} device(s) added, {removed} deleted");
        if !restart_needed.is_empty() {
            msg.push_str(&format!(
                "; changed, applied at the next restart: {}",
                restart_needed.join(", ")
            ));
        }
        msg
    }

    fn add(&mut self, spec: &DeviceSpec) -> Result<u32, DeviceError> {
        let dev = Device::create(&self.ctx, spec)?;
        let id = dev.id();
        self.devices.insert(id, dev);
        Ok(id)
    }

    /// Serves until SIGTERM or SIGINT, then stops and deletes every device.
    pub fn run(mut self) -> Result<(), DaemonError> {
        loop {
            let hung_timeout = self.config.recovery.hung_timeout;
            // Heartbeats are compared four times per timeout: a hang is seen within 1.25
            // timeouts. No more often: an idle device's tick is the only thing that wakes
            // ublkd, and under emulation each wake-up costs milliseconds of CPU. The
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
            for dev in self.devices.values() {
                for w in [dev.worker(), dev.standby()].into_iter().flatten() {
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
                for due in [dev.standby_due(), dev.release_due()].into_iter().flatten() {
                    wake_by = wake_by.min(due);
                }
            }
            let worker_fds = control_fds.end..fds.len();
            let control_due = self.control.next_deadline();
            if let Some(due) = control_due {
                wake_by = wake_by.min(due);
            }
            let idle = self.devices.is_empty()
                && self.notifier.watchdog_interval().is_none()
                && control_due.is_none();
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
            self.handle_deaths(woke, worker_events);
            self.continue_recoveries();
            for dev in self.devices.values_mut() {
                recovery::kill_if_hung(dev, hung_timeout);
            }
            let hung = self.devices.values().filter(|d| !d.progressing(hung_timeout)).count();
            self.notifier.watchdog(Instant::now(), hung);
            let status = self.summary();
            self.notifier.status(&status);
            for (token, req) in self.control.service(&fds[control_fds], Instant::now()) {
                let response = self.handle(req);
                self.control.respond(token, &response, Instant::now());
            }
        }
        self.notifier.stopping();
        tracing::info!("stopping: deleting {} device(s)", self.devices.len());
        self.delete_all();
        if let Some(relay) = crate::worker_log::Relay::get() {
            relay.flush(Duration::from_secs(1));
        }
        let _ = std::fs::remove_file(&self.config.daemon.socket);
        Ok(())
    }

    /// Recovers every device whose worker died, within its restart budget, and starts
    /// standbys that are due. `events`: whether the poll reported a ready fd (without
    /// one no worker died and no starting standby answered).
    fn handle_deaths(&mut self, woke: Instant, events: bool) {
        for (&id, dev) in &mut self.devices {
            if events {
                dev.standby_progress();
            }
            dev.refill_standby_if_due(&self.ctx);
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
            let event = recovery::after_death(dev, &self.ctx, rc, &death.reason(), &self.notifier);
            self.last_event = Some(event);
        }
    }

    /// Goes on with every recovery that waits for the kernel's release and is due.
    fn continue_recoveries(&mut self) {
        let now = Instant::now();
        for dev in self.devices.values_mut() {
            if let Some(event) = recovery::continue_if_due(dev, &self.ctx, now) {
                self.last_event = Some(event);
            }
        }
    }

    fn delete_all(&mut self) -> Vec<u32> {
        let ids: Vec<u32> = self.devices.keys().copied().collect();
        for id in &ids {
            if let Some(dev) = self.devices.remove(id)
                && let Err(e) = dev.destroy(&self.ctx)
            {
                tracing::error!(dev_id = id, "delete failed: {e}");
            }
        }
        ids
    }

    fn handle(&mut self, req: CtlRequest) -> CtlResponse {
        let result = match req {
            CtlRequest::Add(add) => self.handle_add(&add).map(|id| CtlResponse::Added { id }),
            CtlRequest::Del { id } => self.handle_del(id).map(|ids| CtlResponse::Deleted { ids }),
            CtlRequest::List { id } => self.selected(id).map(|ids| {
                CtlResponse::List(ids.iter().filter_map(|id| self.listing(*id)).collect())
            }),
            CtlRequest::Status { id } => self.selected(id).map(|ids| {
                CtlResponse::Status(ids.iter().filter_map(|id| self.status(*id)).collect())
            }),
            CtlRequest::Recover { id } => {
                self.handle_recover(id).map(|message| CtlResponse::Recovered { id, message })
            }
        };
        result.unwrap_or_else(|message| CtlResponse::Error { message })
    }

    fn selected(&self, id: Option<u32>) -> Result<Vec<u32>, String> {
        match id {
            None => Ok(self.devices.keys().copied().collect()),
            Some(id) if self.devices.contains_key(&id) => Ok(vec![id]),
            Some(id) => Err(self.unknown(id)),
        }
    }

    fn unknown(&self, id: u32) -> String {
        let ids: Vec<String> = self.devices.keys().map(u32::to_string).collect();
        if ids.is_empty() {
            format!("no device {id}: ublkd serves no devices")
        } else {
            format!("no device {id}: ublkd serves {}", ids.join(", "))
        }
    }

    fn handle_add(&mut self, add: &AddRequest) -> Result<u32, String> {
        let spec = spec_from_request(add, &self.config.defaults)?;
        if let Some(id) = spec.id
            && self.devices.contains_key(&id)
        {
            return Err(format!("device {id} already exists"));
        }
        if let TargetSpec::Loop { file, .. } = &spec.target {
            let in_use = self
                .devices
                .values()
                .any(|d| matches!(&d.spec().target, TargetSpec::Loop { file: f, .. } if f == file));
            if in_use {
                return Err(format!("{} already backs another device", file.display()));
            }
        }
        self.add(&spec).map_err(|e| e.to_string())
    }

    fn handle_del(&mut self, id: Option<u32>) -> Result<Vec<u32>, String> {
        match id {
            None => Ok(self.delete_all()),
            Some(id) => {
                let dev = self.devices.remove(&id).ok_or_else(|| self.unknown(id))?;
                dev.destroy(&self.ctx).map_err(|e| e.to_string())?;
                Ok(vec![id])
            }
        }
    }

    /// `ublkctl recover`: recovers the device now and resets its restart budget.
    fn handle_recover(&mut self, id: u32) -> Result<String, String> {
        let state = self.ctx.ctrl.get_dev_info(id).map(|i| DevState::from_raw(i.state));
        let dev =
            self.devices.get_mut(&id).ok_or_else(|| format!("no device {id} served by ublkd"))?;
        dev.restart_budget_mut().reset();
        let live = state.as_ref().is_ok_and(|s| *s == DevState::Live);
        if live && dev.state().has_worker() && !dev.state().failing_io() {
            return Ok(format!("device {id} is LIVE: nothing to recover"));
        }
        // The operator's recovery is timed from the command, not from a death that
        // the restart limit left waiting.
        dev.forget_death();
        match dev.recover(&self.ctx, "ublkctl recover") {
            Ok(Recovery::Done(stall)) => {
                Ok(format!("device {id} recovered in {} ms", stall.as_millis()))
            }
            Ok(Recovery::Waiting) => Ok(format!(
                "device {id}: recovering, waiting for the kernel to release /dev/ublkc{id} \
                 (the old worker's I/O has not ended); `ublkctl status {id}` shows when it is LIVE"
            )),
            Err(e) => {
                dev.wait_for_operator(format!("recovery failed: {e} (after: ublkctl recover)"));
                Err(format!("recover device {id}: {e}"))
            }
        }
    }

    fn listing(&self, id: u32) -> Option<DevListing> {
        self.devices.contains_key(&id).then_some(())?;
        let info = self.ctx.ctrl.get_dev_info(id).ok()?;
        let params = self.ctx.ctrl.get_params(id).ok()?;
        Some(DevListing {
            id,
            nr_hw_queues: info.nr_hw_queues,
            queue_depth: info.queue_depth,
            block_size: 1 << params.basic.logical_bs_shift.min(31),
            dev_capacity: params.basic.dev_sectors,
            max_rq_size: info.max_io_buf_bytes,
            daemon_pid: info.ublksrv_pid,
            flags: info.flags,
            state: DevState::from_raw(info.state).to_string(),
        })
    }

    fn status(&self, id: u32) -> Option<DevStatus> {
        let dev = self.devices.get(&id)?;
        let state = match self.ctx.ctrl.get_dev_info(id) {
            Ok(info) => DevState::from_raw(info.state).to_string(),
            Err(e) => format!("UNKNOWN ({e})"),
        };
        // The region is validated before anything in it is believed.
        let counters = match dev.shm().validate() {
            Ok(()) => dev.shm().counters().snapshot(),
            Err(e) => {
                tracing::warn!(dev_id = id, "shared region failed validation: {e}");
                Default::default()
            }
        };
        Some(DevStatus {
            id,
            state,
            target: dev.spec().target.name().to_string(),
            worker_pid: dev.worker().map(|w| w.pid()),
            standby_pid: dev.standby().map(|w| w.pid()),
            sandbox: dev
                .worker()
                .filter(|w| w.sandbox.is_some())
                .and_then(|w| crate::inspect::sandbox_of(w.pid(), w.sandbox.as_ref())),
            last_recovery_ms: dev.last_recovery_ms(),
            last_recovery_reason: dev.last_recovery_reason().map(str::to_owned),
            size_bytes: dev.spec().size_bytes,
            queues: dev.spec().queues,
            queue_depth: dev.spec().queue_depth,
            threads: dev.spec().threads,
            recoveries: dev.recoveries(),
            counters,
            note: dev.state().note().map(str::to_owned),
            failing_io: dev.state().failing_io(),
        })
    }
}

/// The user sandboxed workers run as: `daemon.worker_user`, else `ublkd-worker` (which
/// the package creates), else `nobody` with a warning (a source build run by hand).
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

/// A device spec from `ublkctl add`, with the daemon's defaults, validated like the
/// config file's devices. Errors name the command-line flag.
pub fn spec_from_request(
    add: &AddRequest,
    defaults: &ublkd_config::DeviceDefaults,
) -> Result<DeviceSpec, String> {
    let target = match add.target {
        TargetKind::Null => TargetSpec::Null,
        TargetKind::Memory => TargetSpec::Memory,
        TargetKind::Loop => {
            let file = add.file.clone().ok_or("a loop device needs a backing file (-f FILE)")?;
            TargetSpec::Loop { file, direct: true, zero_copy: add.zero_copy }
        }
    };
    if add.file.is_some() && add.target != TargetKind::Loop {
        return Err(format!("-f/--file is only for loop devices, not {}", add.target.name()));
    }
    if let Some(on) = add.zero_copy
        && add.target != TargetKind::Loop
    {
        return Err(format!(
            "{} is only for loop devices (the {} target copies no data from a file)",
            if on { "--zero-copy" } else { "--copy" },
            add.target.name()
        ));
    }
    let block_size = defaults.block_size;
    let size_bytes = match (add.size, &target) {
        (Some(size), _) => size,
        (None, TargetSpec::Loop { file, .. }) => {
            DeviceSpec::loop_size_from_file(file, block_size).map_err(|e| flag_error(&e))?
        }
        (None, _) => {
            return Err(format!(
                "a {} device needs a size (-s SIZE, e.g. -s 1G)",
                add.target.name()
            ));
        }
    };
    let spec = DeviceSpec {
        id: add.id,
        target,
        size_bytes,
        queues: add.queues.unwrap_or(defaults.queues),
        queue_depth: add.queue_depth.unwrap_or(defaults.queue_depth),
        block_size,
        threads: add.threads.unwrap_or(defaults.threads),
        sandbox: add.sandbox.unwrap_or(defaults.sandbox),
        sandbox_optional: add
            .sandbox_optional
            .as_deref()
            .map_or(defaults.sandbox_optional, LayerSet::of),
    };
    spec.validate().map_err(|e| flag_error(&e))?;
    Ok(spec)
}

/// A config-key error restated with the `ublkctl add` flag for that key.
fn flag_error(e: &ublkd_config::FieldError) -> String {
    let flag = match e.field {
        "size" => "-s/--size",
        "queues" => "-q/--queues",
        "queue_depth" => "-d/--depth",
        "threads" => "--threads",
        "id" => "-n/--id",
        "file" => "-f/--file",
        "zero_copy" => "--zero-copy",
        other => other,
    };
    format!("{flag}: {}", e.problem)
}

fn describe(spec: &DeviceSpec) -> String {
    match spec.id {
        Some(id) => format!("{} (id {id})", spec.target.name()),
        None => spec.target.name().to_string(),
    }
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
    use ublkd_config::DeviceDefaults;

    fn defaults() -> DeviceDefaults {
        Config::default().defaults
    }

    fn add(target: TargetKind) -> AddRequest {
        AddRequest {
            id: None,
            target,
            file: None,
            size: None,
            queues: None,
            queue_depth: None,
            threads: None,
            zero_copy: None,
            sandbox: None,
            sandbox_optional: None,
        }
    }

    #[test]
    fn sandbox_optional_overrides_the_default_and_none_keeps_it() {
        use ublkd_proto::msg::SandboxLayer;
        let mut d = defaults();
        d.sandbox_optional = LayerSet::of(&[SandboxLayer::Landlock]);
        let a = add(TargetKind::Null);
        let mut a = AddRequest { size: Some(1 << 20), ..a };
        assert_eq!(spec_from_request(&a, &d).unwrap().sandbox_optional, d.sandbox_optional);
        a.sandbox_optional = Some(vec![SandboxLayer::UserNamespace]);
        assert_eq!(
            spec_from_request(&a, &d).unwrap().sandbox_optional.layers(),
            [SandboxLayer::UserNamespace]
        );
    }

    #[test]
    fn zero_copy_is_for_loop_devices_only() {
        let mut a = add(TargetKind::Memory);
        a.size = Some(1 << 20);
        a.zero_copy = Some(true);
        let err = spec_from_request(&a, &defaults()).unwrap_err();
        assert!(err.starts_with("--zero-copy is only for loop devices"), "{err}");
    }

    #[test]
    fn zero_copy_past_the_buffer_table_names_the_flag() {
        let file = std::env::temp_dir().join(format!("ublkd-zc-{}.img", std::process::id()));
        std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
        let mut a = add(TargetKind::Loop);
        a.file = Some(file.clone());
        a.zero_copy = Some(true);
        a.queues = Some(8);
        a.queue_depth = Some(4096);
        let err = spec_from_request(&a, &defaults());
        std::fs::remove_file(&file).unwrap();
        let err = err.unwrap_err();
        assert!(err.starts_with("--zero-copy: needs queues × queue_depth <= 16384"), "{err}");
    }

    #[test]
    fn no_sandbox_overrides_the_default() {
        let mut a = add(TargetKind::Memory);
        a.size = Some(1 << 20);
        a.sandbox = Some(false);
        assert!(defaults().sandbox);
        assert!(!spec_from_request(&a, &defaults()).unwrap().sandbox);
    }

    #[test]
    fn memory_without_size_names_the_flag() {
        let err = spec_from_request(&add(TargetKind::Memory), &defaults()).unwrap_err();
        assert_eq!(err, "a memory device needs a size (-s SIZE, e.g. -s 1G)");
    }

    #[test]
    fn loop_without_file_names_the_flag() {
        let err = spec_from_request(&add(TargetKind::Loop), &defaults()).unwrap_err();
        assert!(err.contains("-f FILE"), "{err}");
    }

    #[test]
    fn file_on_a_non_loop_target_is_refused() {
        let mut a = add(TargetKind::Null);
        a.file = Some("/tmp/x".into());
        a.size = Some(1 << 20);
        assert!(spec_from_request(&a, &defaults()).unwrap_err().starts_with("-f/--file"));
    }

    #[test]
    fn bad_depth_is_reported_with_its_flag() {
        let mut a = add(TargetKind::Null);
        a.size = Some(1 << 20);
        a.queue_depth = Some(0);
        let err = spec_from_request(&a, &defaults()).unwrap_err();
        assert!(err.starts_with("-d/--depth: "), "{err}");
    }

    #[test]
    fn defaults_fill_what_the_request_leaves_out() {
        let mut a = add(TargetKind::Memory);
        a.size = Some(64 << 20);
        a.queues = Some(2);
        let spec = spec_from_request(&a, &defaults()).unwrap();
        assert_eq!(spec.queues, 2);
        assert_eq!(spec.queue_depth, defaults().queue_depth);
        assert_eq!(spec.size_bytes, 64 << 20);
    }
}
