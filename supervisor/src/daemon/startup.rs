//! Starting up: the kernel's features, the state dir, the socket and the signals
//! ([`Daemon::start`]); adopting what a previous ublkd left ([`Daemon::adopt_previous`],
//! a never-started device's recorded worker killed before the device is deleted); and
//! the configured devices, made side by side, their exports negotiated on threads.

use super::*;

/// How long a never-started device's leftover worker may take to end after SIGKILL
/// before the device is left for the next start rather than deleted under it.
pub(super) const NEVER_STARTED_GRACE: Duration = Duration::from_secs(2);

/// The user sandboxed workers run as: `daemon.worker_user`, else `ublkd-worker` (which
/// the package creates), else `nobody` with a warning (a source build run by hand).
/// Whether the device `made` (as ublkd created it, from its record) is the configured
/// `config`: the same, but for what ublkd decides at creation where the config leaves
/// it open: the id if none is given, a loop device's zero copy, an nbd device's size and
/// block size (its export's) and its zero copy left unset (which is copying), an rbd
/// device's size (its image's); and, where the config gives no id, any device's size,
/// which `ublkctl resize` may have changed since (made again, a resized device would be
/// a second one beside it, or be refused its loop file). Where the config gives the id,
/// a size other than the config's is a device that differs from it: it is adopted and
/// serves on as it is, and the journal says so (`create_configured`).
pub(super) fn made_from(made: &DeviceSpec, config: &DeviceSpec) -> bool {
    let mut made = made.clone();
    if config.id.is_none() {
        made.id = None;
        made.size_bytes = config.size_bytes;
    }
    match (&mut made.target, &config.target) {
        (TargetSpec::Loop { zero_copy, .. }, TargetSpec::Loop { zero_copy: None, .. }) => {
            *zero_copy = None;
        }
        (TargetSpec::Rbd(_), TargetSpec::Rbd(_)) => made.size_bytes = config.size_bytes,
        (TargetSpec::Nbd { zero_copy, .. }, TargetSpec::Nbd { zero_copy: unset, .. }) => {
            if unset.is_none() && *zero_copy == Some(false) {
                *zero_copy = None;
            }
            made.size_bytes = config.size_bytes;
            if made.settings.block_size >= config.settings.block_size {
                made.settings.block_size = config.settings.block_size;
            }
        }
        _ => {}
    }
    made == *config
}

pub(super) fn worker_identity(configured: Option<&str>) -> Result<WorkerIdentity, DaemonError> {
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

/// [`reach`] for each of `specs`, in order: the nbd and rbd ones each on a thread of
/// its own, side by side (each within its time limit), the others at once.
pub(super) fn reach_targets<'a>(
    specs: impl Iterator<Item = &'a DeviceSpec>,
    worker_binary: &Path,
    data_path: DataPath,
    nbd_handshake: Duration,
) -> Vec<Result<Reached, TargetError>> {
    /// A spec's target: reached already, or on its thread.
    enum Target<T> {
        Done(Result<Reached, TargetError>),
        Reaching(T),
    }
    std::thread::scope(|scope| {
        let pending: Vec<_> = specs
            .map(|spec| {
                if !reach_takes_time(spec) {
                    return Target::Done(reach(worker_binary, spec, data_path, nbd_handshake));
                }
                match std::thread::Builder::new()
                    .name("configured".into())
                    .spawn_scoped(scope, move || {
                        reach(worker_binary, spec, data_path, nbd_handshake)
                    }) {
                    Ok(thread) => Target::Reaching(thread),
                    // No thread to be had: reached here, one after another.
                    Err(_) => Target::Done(reach(worker_binary, spec, data_path, nbd_handshake)),
                }
            })
            .collect();
        pending
            .into_iter()
            .map(|target| match target {
                Target::Done(done) => done,
                // `reach` does not panic; a thread that did is the release profile's abort.
                Target::Reaching(thread) => thread.join().expect("reach never panics"),
            })
            .collect()
    })
}

/// Waits until one of `creating`'s workers has something to say, or the first of their
/// deadlines.
pub(super) fn wait_for_workers<'a>(creating: impl Iterator<Item = &'a Creation>) {
    let mut fds = Vec::new();
    let mut wake_by = Instant::now() + Duration::from_secs(1);
    for creation in creating {
        wake_by = wake_by.min(creation.deadline());
        if let Some(fd) = creation.control() {
            fds.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
    }
    // Its outcome is not needed: each creation then looks at its own worker.
    let _ = crate::sys::poll(&mut fds, millis_until(wake_by));
}

pub(super) fn make_dir(path: &Path, mode: u32) -> Result<(), DaemonError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|source| DaemonError::Dir { path: path.to_path_buf(), source })
}

/// Binds the control socket (root-only), replacing a stale one but never a live one.
pub(super) fn listen(path: &Path) -> Result<UnixListener, DaemonError> {
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

impl Daemon {
    /// Checks the kernel, prepares the state dir and socket, installs signal handling.
    pub fn start(config: Config, config_path: Option<PathBuf>) -> Result<Daemon, DaemonError> {
        // Before any worker is started or taken over: each registers in it.
        crate::worker::wait_set::init();
        let ctrl = CtrlClient::open()?;
        let kernel_features = ctrl.get_features()?;
        let missing = features::missing_required(kernel_features);
        if !missing.is_empty() {
            return Err(DaemonError::MissingFeatures(missing.join(", ")));
        }
        let worker_binary =
            config.daemon.worker_binary_path().map_err(DaemonError::WorkerBinary)?;
        let worker_identity = worker_identity(config.daemon.worker_user.as_deref())?;
        crate::rbd::probe::set_worker_identity(worker_identity);
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
            kernel_release: KernelRelease::running(),
            fast_release,
            nbd_server_wait,
            rbd_cluster_wait: config.recovery.rbd_cluster_wait,
            nbd_handshake_timeout: config.recovery.nbd_handshake_timeout,
            worker_ready_timeout: config.recovery.worker_ready_timeout,
        };
        Ok(Daemon {
            config,
            config_path,
            configured: Vec::new(),
            notifier: Notifier::new(),
            last_event: None,
            shutting_down: false,
            ctx,
            devices: DeviceTable::default(),
            next_scan: Instant::now(),
            hung_devices: 0,
            disk_stats: Default::default(),
            full_scan_next: true,
            watched_devices: 0,
            status_stale: true,
            status_due: Instant::now(),
            status_event: None,
            control,
            signals,
            metrics_file,
            pending_adds: Vec::new(),
            pending_recovers: Vec::new(),
            pending_upgrades: Vec::new(),
            pending_deletes: Vec::new(),
            pending_reload: None,
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
        for (id, dev) in self.devices.all_mut() {
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
        let waiting = |dev: &Device| dev.awaiting_standby() || dev.activating().is_some();
        while self.devices.values().any(waiting) {
            std::thread::sleep(Duration::from_millis(10));
            self.continue_recoveries();
        }
        adopted
    }

    /// Creates the configured devices; one that fails is reported and skipped. A
    /// configured device that was adopted from a previous ublkd (same description, and
    /// the same id if the config gives one) is not created again, nor is one whose id an
    /// adopted device with another description holds (it serves on as it is, and the
    /// journal says how to make it as configured).
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
            // Adopted under the configured id, but not as configured (changed since):
            // making it would fail (the id is taken), and replacing it would lose what
            // it holds.
            if let Some(id) = spec.id
                && self.devices.contains(id)
            {
                tracing::warn!(
                    dev_id = id,
                    event = "configured_device_differs",
                    "{}",
                    reload::changed_but_served(id)
                );
                self.configured.push((spec.clone(), id));
                continue;
            }
            // A device added with `ublkctl add` and adopted may have its name.
            if let Some(taken) = self.name_taken(&spec) {
                let error = format!("name {taken}");
                tracing::error!("configured device {}: {error}", describe_spec(&spec));
                self.last_event = Some(crate::event::Event::ConfiguredDeviceFailed {
                    device: describe_spec(&spec),
                    error,
                });
                failed += 1;
                continue;
            }
            missing.push(spec);
        }
        for (spec, made) in missing.iter().zip(self.create_all(&missing)) {
            match made {
                Ok(id) => self.configured.push((spec.clone(), id)),
                Err(e) => {
                    tracing::error!("configured device {}: {e}", describe_spec(spec));
                    self.last_event = Some(crate::event::Event::ConfiguredDeviceFailed {
                        device: describe_spec(spec),
                        error: e.to_string(),
                    });
                    failed += 1;
                }
            }
        }
        failed
    }

    /// Creates the configured devices of `specs` at start (before READY),
    /// [`CREATING_AT_ONCE`] at a time so that their workers' start-ups overlap, and
    /// waits until each is LIVE or has failed: the outcome of each, in order. An nbd
    /// device's export is negotiated here first. systemd is told that each batch needs
    /// time.
    fn create_all(&mut self, specs: &[DeviceSpec]) -> Vec<Result<u32, DeviceError>> {
        let mut outcomes: Vec<(usize, Result<u32, DeviceError>)> = Vec::with_capacity(specs.len());
        let mut creating: Vec<(usize, Creation)> = Vec::new();
        let mut next = specs.iter().enumerate();
        loop {
            while creating.len() < CREATING_AT_ONCE {
                // The next few, their nbd exports negotiated side by side: a server
                // that takes its whole handshake limit delays its own device, not the
                // others'.
                let batch: Vec<(usize, &DeviceSpec)> =
                    next.by_ref().take(CREATING_AT_ONCE - creating.len()).collect();
                if batch.is_empty() {
                    break;
                }
                // Time for a batch to be made: its connections (the first, then the
                // others of a set) and its workers' standby and activation.
                let (handshake, ready) =
                    (self.ctx.nbd_handshake_timeout, self.ctx.worker_ready_timeout);
                self.notifier.extend_timeout(Duration::from_secs(60).max(2 * (handshake + ready)));
                let data_path = DataPath::for_kernel(self.ctx.kernel_features);
                let binary = &self.ctx.worker_binary;
                let specs = batch.iter().map(|(_, spec)| *spec);
                let reached = reach_targets(specs, binary, data_path, handshake);
                for ((at, spec), reached) in batch.into_iter().zip(reached) {
                    let begun = reached
                        .map_err(DeviceError::from)
                        .and_then(|reached| Device::begin_create(&self.ctx, spec, reached));
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
}
