//! The control socket's requests (`ublkctl add, del, list, status, metrics, recover, upgrade,
//! resize, shutdown`): each
//! parsed, checked and answered against the daemon's devices.

use ublkd_config::{
    DeviceAttrs, DeviceSettings, DeviceSpec, NbdUri, RbdImage, RbdSpec, TargetSpec, check_ceph_id,
};
use ublkd_proto::msg::{
    AddRequest, CtlRequest, CtlResponse, DevListing, DevMetrics, DevStatus, ErrorKind, Failure,
    LayerSet, TargetKind,
};
use ublkd_proto::shm::{CounterSnapshot, DevLatency};
use ublkd_proto::uapi::DevState;

use super::Daemon;
use crate::device::{Device, DeviceError, Recovery, Safety};
use crate::device_state::StateKind;

impl Daemon {
    pub(super) fn handle(&mut self, req: CtlRequest) -> CtlResponse {
        let result = match req {
            // Begun by the loop and answered once done (`Daemon::begin_add`,
            // `begin_del`, `begin_recover`, `begin_upgrade`): never waited for here.
            CtlRequest::Add(_)
            | CtlRequest::Del { .. }
            | CtlRequest::DelForce { .. }
            | CtlRequest::Shutdown
            | CtlRequest::ShutdownForce
            | CtlRequest::Recover { .. }
            | CtlRequest::Upgrade { .. }
            | CtlRequest::Resize { .. } => Err("this request is answered by the loop".into()),
            // The control server unwraps it; one inside another is no request.
            CtlRequest::ReloadPlan { config } => self.reload_plan_answer(&config),
            CtlRequest::WithKinds(_) => {
                Err(Failure::new(ErrorKind::BadArgument, "bad request: a request wrapped twice"))
            }
            CtlRequest::List { id } => self.selected(id).map(|ids| {
                CtlResponse::List(ids.iter().filter_map(|id| self.listing(*id)).collect())
            }),
            // Adds under way are shown too (ADDING), so that no device a client asked
            // for is missing from the list meanwhile.
            CtlRequest::Status { id: Some(id) } if !self.devices.contains(id) => {
                match self.pending_statuses().into_iter().find(|s| s.id == id) {
                    Some(status) => {
                        let mut statuses = vec![status];
                        self.underway_notes(&mut statuses);
                        Ok(CtlResponse::Status(statuses))
                    }
                    None => Err(self.unknown(id)),
                }
            }
            CtlRequest::Status { id } => self.selected(id).map(|ids| {
                let mut all: Vec<DevStatus> =
                    ids.iter().filter_map(|id| self.status(*id)).collect();
                if id.is_none() {
                    all.extend(self.pending_statuses());
                    all.sort_unstable_by_key(|s| s.id);
                }
                self.underway_notes(&mut all);
                CtlResponse::Status(all)
            }),
            CtlRequest::Metrics { id } => self.selected(id).map(|ids| {
                CtlResponse::Metrics(ids.iter().filter_map(|id| self.metrics(*id)).collect())
            }),
        };
        result.unwrap_or_else(CtlResponse::from)
    }

    pub(super) fn selected(&self, id: Option<u32>) -> Result<Vec<u32>, Failure> {
        match id {
            None => Ok(self.devices.ids().collect()),
            Some(id) if self.devices.contains(id) => Ok(vec![id]),
            Some(id) => Err(self.unknown(id)),
        }
    }

    fn unknown(&self, id: u32) -> Failure {
        let ids: Vec<String> = self.devices.ids().map(|id| id.to_string()).collect();
        let message = if ids.is_empty() {
            format!("no device {id}: ublkd serves no devices")
        } else {
            format!("no device {id}: ublkd serves {}", ids.join(", "))
        };
        Failure::new(ErrorKind::NoSuchDevice, message)
    }

    /// The spec `add` asks for, if no device (or nbd add under way) has its id, its
    /// loop file or its nbd export.
    pub(super) fn check_add(&self, add: &AddRequest) -> Result<DeviceSpec, Failure> {
        let spec = spec_from_request(add, &self.config.defaults)
            .map_err(|e| Failure::new(ErrorKind::BadArgument, e))?;
        let exists = |message: String| Err(Failure::new(ErrorKind::AlreadyExists, message));
        let pending = self.pending_adds.iter().map(|p| &p.spec);
        let specs: Vec<&DeviceSpec> =
            self.devices.values().map(Device::spec).chain(pending).collect();
        if let Some(id) = spec.id
            && specs.iter().any(|s| s.id == Some(id))
        {
            return exists(format!("device {id} already exists"));
        }
        if let Some(taken) = self.name_taken(&spec) {
            return exists(format!("--name: {taken}"));
        }
        match &spec.target {
            TargetSpec::Loop { file, .. } => {
                let in_use = specs
                    .iter()
                    .any(|s| matches!(&s.target, TargetSpec::Loop { file: f, .. } if f == file));
                if in_use {
                    return exists(format!("{} already backs another device", file.display()));
                }
            }
            TargetSpec::Nbd { uri, .. } => {
                let in_use = specs
                    .iter()
                    .any(|s| matches!(&s.target, TargetSpec::Nbd { uri: u, .. } if u == uri));
                if in_use {
                    return exists(format!("{uri} is already the export of another device"));
                }
            }
            // A snapshot is read-only: any number of devices may serve it.
            TargetSpec::Rbd(rbd) if rbd.image.snapshot.is_none() => {
                let in_use = specs.iter().any(|s| {
                    matches!(&s.target, TargetSpec::Rbd(r) if r.image.snapshot.is_none()
                        && r.image == rbd.image)
                });
                if in_use {
                    return exists(format!("{} is already the image of another device", rbd.image));
                }
            }
            TargetSpec::Rbd(_) | TargetSpec::Null | TargetSpec::Memory => {}
        }
        Ok(spec)
    }

    /// Why `spec`'s name cannot be had, if another device (or an add under way) has it:
    /// for `ublkctl add`, and for the config file's devices, which the config's own
    /// check keeps unique only among themselves.
    pub(super) fn name_taken(&self, spec: &DeviceSpec) -> Option<String> {
        let name = spec.attrs.name.as_ref()?;
        let pending = self.pending_adds.iter().map(|p| &p.spec);
        let mut specs = self.devices.values().map(Device::spec).chain(pending);
        let other = specs.find(|s| s.attrs.name.as_ref() == Some(name))?;
        Some(match other.id {
            Some(id) => format!(
                "{name:?} is already the name of device {id} (/dev/ublkb{id}); give each \
                 device its own name"
            ),
            None => format!(
                "{name:?} is already the name of a device being added; give each device \
                 its own name"
            ),
        })
    }

    /// `ublkctl del` (`id`: one device, else every one) and `shutdown`: the devices
    /// deleted off the loop ([`Self::begin_delete`]); answered now only if refused or
    /// if there was nothing to delete. Unless `force`, none is deleted if any of them
    /// is in use: the delete's thread gives them back, served as before.
    pub(super) fn begin_del(
        &mut self,
        token: crate::control::Token,
        id: Option<u32>,
        shutdown: bool,
        force: bool,
    ) -> Option<CtlResponse> {
        use super::delete::{DeleteFor, Request};
        let all = |daemon: &mut Daemon, why: &str| {
            // Adds under way too: none of them may come up after the answer.
            let made = daemon.give_up_pending_adds(None, why);
            let devices: Vec<Device> = daemon.devices.take_all();
            (devices, made)
        };
        let (devices, request, given_up) = match id {
            _ if shutdown => {
                tracing::info!(
                    event = "shutdown",
                    "shutdown requested{}: deleting {} device(s), then exiting",
                    if force { " (--force)" } else { "" },
                    self.devices.len()
                );
                self.shutting_down = true;
                let (devices, made) = all(self, "ublkd was shut down");
                (devices, Request::Shutdown, made)
            }
            None => {
                let (devices, made) = all(self, "deleted by `ublkctl del -a`");
                (devices, Request::All, made)
            }
            Some(id) if !self.devices.contains(id) => {
                let before = self.pending_adds.len();
                self.give_up_pending_adds(Some(id), &format!("deleted by `ublkctl del {id}`"));
                if self.pending_adds.len() == before {
                    return Some(self.unknown(id).into());
                }
                return Some(CtlResponse::Deleted { ids: vec![id] });
            }
            Some(id) => {
                let dev = self.devices.remove(id).expect("checked above");
                (vec![dev], Request::One, Vec::new())
            }
        };
        let safety = if force { Safety::Force } else { Safety::AllOrNothing };
        self.begin_delete(DeleteFor::Client { token, request, given_up }, devices, safety)
    }

    /// `ublkctl recover`: recovers the device now and resets its restart budget. The
    /// answer, or `None` if the recovery goes on in the loop (its standby still
    /// starting, the kernel not yet releasing the old worker's file, an nbd server not
    /// yet there): the loop then answers once it ends ([`Self::recover_outcome`]).
    pub(super) fn handle_recover(&mut self, id: u32) -> Result<Option<String>, Failure> {
        if !self.devices.contains(id) {
            return Err(self.unknown(id));
        }
        let state = self.ctx.ctrl.get_dev_info(id).map(|i| DevState::from_raw(i.state));
        let dev = self.devices.get_mut(id).expect("checked above");
        dev.restart_budget_mut().reset();
        let live = state.as_ref().is_ok_and(|s| *s == DevState::Live);
        if live && dev.state().has_worker() && !dev.state().failing_io() {
            return Ok(Some(format!("device {id} is LIVE: nothing to recover")));
        }
        // The operator's recovery is timed from the command, not from a death that
        // the restart limit left waiting.
        dev.forget_death();
        match dev.recover(&self.ctx, "ublkctl recover") {
            Ok(Recovery::Done(stall)) => {
                Ok(Some(format!("device {id} recovered in {} ms", stall.as_millis())))
            }
            Ok(Recovery::Waiting) => Ok(None),
            Err(e) => {
                dev.wait_for_operator(format!("recovery failed: {e} (after: ublkctl recover)"));
                Err(Failure::new(device_error_kind(&e), format!("recover device {id}: {e}")))
            }
        }
    }

    /// How an `ublkctl recover` of device `id` that went on in the loop ended, or
    /// `None` while it goes on: recovered (served by a real worker again), or stopped
    /// (deleted, a failed recovery waiting for an operator, a server that stayed away
    /// past `recovery.nbd_server_wait_secs`), with status's note.
    pub(super) fn recover_outcome(&self, id: u32) -> Option<Result<String, String>> {
        let Some(dev) = self.devices.get(id) else {
            return Some(Err(format!("device {id} was deleted before its recovery ended")));
        };
        let state = dev.state();
        let note = state.note().unwrap_or("no reason given");
        match state.kind() {
            StateKind::Live | StateKind::Hung => Some(Ok(match dev.last_recovery_ms() {
                Some(ms) => format!("device {id} recovered in {ms} ms"),
                None => format!("device {id} recovered"),
            })),
            StateKind::FailingIo => {
                Some(Err(format!("device {id} is served again, but fails every I/O: {note}")))
            }
            StateKind::WaitingForOperator => Some(Err(format!("recover device {id}: {note}"))),
            StateKind::Starting
            | StateKind::Adopted
            | StateKind::Recovering
            | StateKind::Releasing => None,
        }
    }

    /// Whether the recovery of device `id` waits on something outside ublkd that
    /// status names (the kernel's release past `RELEASE_SLOW`, an unreachable NBD
    /// server), rather than on its own new worker.
    pub(super) fn recovery_held_up(&self, id: u32) -> bool {
        self.devices.get(id).is_some_and(|dev| {
            dev.state().kind() == StateKind::Releasing && dev.state().note().is_some()
        })
    }

    /// Where the recovery of device `id` stands while it goes on: the error an
    /// `ublkctl recover` gets when it cannot wait for the end (a script's `ublkctl
    /// recover N && mount` must not go on with a device that is not served yet).
    pub(super) fn recovering_message(&self, id: u32) -> String {
        if !self.devices.contains(id) {
            return format!("device {id} was deleted before its recovery ended");
        }
        format!("device {id}: {}", self.recovery_wait(id))
    }

    /// What the recovery of device `id` still waits for, and that ublkd goes on with it.
    pub(super) fn recovery_wait(&self, id: u32) -> String {
        let rest =
            format!("ublkd finishes the recovery by itself; `ublkctl status {id}` shows when");
        let Some(dev) = self.devices.get(id) else { return rest };
        if dev.awaiting_standby() {
            return format!(
                "not recovered yet: its new worker is still starting, its I/O held; {rest}"
            );
        }
        if let Some(worker) = dev.activating() {
            return format!(
                "not recovered yet: its new worker (pid {}) is being handed the device, its \
                 I/O held; {rest}",
                worker.pid()
            );
        }
        // The notes say what is held.
        match dev.state().note() {
            Some(note) => format!("not recovered yet: {note}; {rest}"),
            None => format!(
                "not recovered yet: the kernel has not released /dev/ublkc{id} (the old \
                 worker's I/O has not ended), its I/O held; {rest}"
            ),
        }
    }

    fn listing(&self, id: u32) -> Option<DevListing> {
        self.devices.contains(id).then_some(())?;
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
        let dev = self.devices.get(id)?;
        let state = match self.ctx.ctrl.get_dev_info(id) {
            Ok(info) => DevState::from_raw(info.state).to_string(),
            Err(e) => format!("UNKNOWN ({e})"),
        };
        let (counters, latency) = region_numbers(dev);
        Some(DevStatus {
            id,
            state,
            target: dev.spec().target.name().to_string(),
            worker_pid: dev.worker().map(|w| w.pid()),
            standby_pid: dev.standby().map(|w| w.pid()),
            sandbox: dev.worker().and_then(|w| w.sandbox_status().cloned()),
            last_recovery_ms: dev.last_recovery_ms(),
            last_recovery_reason: dev.last_recovery_reason().map(str::to_owned),
            size_bytes: dev.spec().size_bytes,
            queues: dev.spec().settings.queues,
            queue_depth: dev.spec().settings.queue_depth,
            threads: dev.spec().settings.threads,
            recoveries: dev.recoveries(),
            counters,
            note: dev.status_note(),
            failing_io: dev.state().failing_io(),
            latency: latency.merged(),
            name: dev.spec().attrs.name.clone(),
            read_only: read_only(dev.spec(), dev.export_read_only()),
            backing: backing(dev.spec()),
        })
    }

    /// Device `id`'s numbers for `ublkctl metrics` and the metrics file: read from
    /// memory only (ublkd's own state and the device's region), no system call.
    pub(super) fn metrics(&self, id: u32) -> Option<DevMetrics> {
        let dev = self.devices.get(id)?;
        let (counters, latency) = region_numbers(dev);
        Some(DevMetrics {
            id,
            // ublkd's view, not the kernel's: no ioctl per device every interval.
            state: dev.state().kind().to_string(),
            target: dev.spec().target.name().to_string(),
            counters,
            inflight: if dev.worker().is_some() { dev.shm().inflight() } else { 0 },
            recoveries: dev.recoveries(),
            last_stall_ms: dev.last_recovery_ms(),
            worker_restarts: dev.worker_restarts(),
            latency,
            last_recovery_unix_ms: dev.last_recovered_at().and_then(|at| {
                let since = at.duration_since(std::time::UNIX_EPOCH).ok()?;
                u64::try_from(since.as_millis()).ok()
            }),
            name: dev.spec().attrs.name.clone(),
        })
    }
}

/// What kind of failure a device operation's error is, for ublkctl's exit code: the
/// device's worker failed to start or to take the device (it exited, said why, did not
/// answer, or no standby was there to hand it over), or the device is in a state that
/// does not allow the operation now; anything else is of no particular kind.
pub(super) fn device_error_kind(e: &DeviceError) -> ErrorKind {
    match e {
        DeviceError::Worker { .. } | DeviceError::NoStandby { .. } => ErrorKind::WorkerFailed,
        DeviceError::Transition(_) => ErrorKind::TryAgain,
        _ => ErrorKind::Other,
    }
}

/// `e` as the answer to a request, with its kind ([`device_error_kind`]).
pub(super) fn device_failure(e: &DeviceError) -> Failure {
    Failure::new(device_error_kind(e), e.to_string())
}

/// What the device's worker counted in its region: validated before anything in it is
/// believed, zero if it fails; values only, never used as sizes or indexes.
fn region_numbers(dev: &Device) -> (CounterSnapshot, DevLatency) {
    match dev.shm().validate() {
        Ok(()) => (dev.shm().counters().snapshot(), dev.shm().latency_snapshot()),
        Err(e) => {
            tracing::warn!(dev_id = dev.id(), "shared region failed validation: {e}");
            Default::default()
        }
    }
}

/// A device spec from `ublkctl add`, with the daemon's defaults, validated like the
/// config file's devices. Errors name the command-line flag.
pub fn spec_from_request(
    add: &AddRequest,
    defaults: &DeviceSettings,
) -> Result<DeviceSpec, String> {
    let target = match add.target {
        TargetKind::Null => TargetSpec::Null,
        TargetKind::Memory => TargetSpec::Memory,
        TargetKind::Loop => {
            let file = add.file.clone().ok_or("a loop device needs a backing file (-f FILE)")?;
            TargetSpec::Loop { file, direct: true, zero_copy: add.zero_copy }
        }
        TargetKind::Nbd => {
            let text = add.uri.as_deref().ok_or(
                "an nbd device needs its export's URI (--uri nbd://HOST/EXPORT or \
                 --uri nbd+unix:///EXPORT?socket=PATH)",
            )?;
            let uri = NbdUri::parse(text).map_err(|e| format!("--uri: {e}"))?;
            TargetSpec::Nbd { uri, zero_copy: add.zero_copy }
        }
        TargetKind::Rbd => {
            let rbd = add.rbd.clone().unwrap_or_default();
            let text = rbd.image.as_deref().ok_or(
                "an rbd device needs its image (--image POOL/IMAGE, or POOL/IMAGE@SNAPSHOT for \
                 a read-only device)",
            )?;
            let image = RbdImage::parse(text).map_err(|e| format!("--image: {e}"))?;
            if let Some(id) = &rbd.ceph_id {
                check_ceph_id(id).map_err(|e| format!("--ceph-id: {e}"))?;
            }
            TargetSpec::Rbd(RbdSpec {
                image,
                ceph_conf: rbd.ceph_conf,
                ceph_id: rbd.ceph_id,
                keyring: rbd.keyring,
                // Only in a config file: `ublkctl add` has no flag for it (yet).
                allow_unfenced: false,
            })
        }
    };
    if add.rbd.is_some() && add.target != TargetKind::Rbd {
        return Err(format!(
            "--image, --ceph-conf, --ceph-id and --keyring are only for rbd devices, not {}",
            add.target.name()
        ));
    }
    if add.file.is_some() && add.target != TargetKind::Loop {
        return Err(format!("-f/--file is only for loop devices, not {}", add.target.name()));
    }
    if add.uri.is_some() && add.target != TargetKind::Nbd {
        return Err(format!("--uri is only for nbd devices, not {}", add.target.name()));
    }
    if let Some(on) = add.zero_copy
        && !matches!(add.target, TargetKind::Loop | TargetKind::Nbd)
    {
        return Err(format!(
            "{} is only for loop and nbd devices, not {}; leave it out",
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
        // The export's or image's, learnt at connection (see `DeviceSpec::size_bytes`).
        (None, TargetSpec::Nbd { .. } | TargetSpec::Rbd(_)) => 0,
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
        settings: DeviceSettings {
            queues: add.queues.unwrap_or(defaults.queues),
            queue_depth: add.queue_depth.unwrap_or(defaults.queue_depth),
            block_size,
            threads: add.threads.unwrap_or(defaults.threads),
            sandbox: add.sandbox.unwrap_or(defaults.sandbox),
            sandbox_optional: add
                .sandbox_optional
                .as_deref()
                .map_or(defaults.sandbox_optional, LayerSet::of),
        },
        attrs: DeviceAttrs {
            name: add.name.clone(),
            read_only: add.read_only,
            partitions: add.partitions,
        },
    };
    spec.validate().map_err(|e| flag_error(&e))?;
    Ok(spec)
}

/// Whether `spec`'s disk is read-only: asked for, an rbd snapshot, or an nbd export
/// its server said was (`export_read_only`).
pub(super) fn read_only(spec: &DeviceSpec, export_read_only: bool) -> bool {
    spec.attrs.read_only
        || export_read_only
        || matches!(&spec.target, TargetSpec::Rbd(rbd) if rbd.image.snapshot.is_some())
}

/// What backs `spec`'s device, as status shows it (see `DevStatus::backing`).
pub(super) fn backing(spec: &DeviceSpec) -> Option<String> {
    match &spec.target {
        TargetSpec::Loop { file, .. } => Some(file.display().to_string()),
        TargetSpec::Nbd { uri, .. } => Some(uri.to_string()),
        TargetSpec::Rbd(rbd) => Some(rbd.image.to_string()),
        TargetSpec::Null | TargetSpec::Memory => None,
    }
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
        "uri" => "--uri",
        "name" => "--name",
        "partitions" => "--partitions",
        other => other,
    };
    format!("{flag}: {}", e.problem)
}

/// A device spec as log lines name it: its target, and its id if it has one.
pub(super) fn describe_spec(spec: &DeviceSpec) -> String {
    match spec.id {
        Some(id) => format!("{} (id {id})", spec.target.name()),
        None => spec.target.name().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ublkd_config::Config;

    fn defaults() -> DeviceSettings {
        Config::default().defaults
    }

    fn sized(target: TargetKind, size: u64) -> AddRequest {
        AddRequest { size: Some(size), ..add(target) }
    }

    fn add(target: TargetKind) -> AddRequest {
        AddRequest {
            id: None,
            target,
            file: None,
            uri: None,
            size: None,
            queues: None,
            queue_depth: None,
            threads: None,
            zero_copy: None,
            sandbox: None,
            sandbox_optional: None,
            rbd: None,
            name: None,
            read_only: false,
            partitions: false,
        }
    }

    #[test]
    fn sandbox_optional_overrides_the_default_and_none_keeps_it() {
        use ublkd_proto::msg::SandboxLayer;
        let mut d = defaults();
        d.sandbox_optional = LayerSet::of(&[SandboxLayer::Landlock]);
        let mut a = sized(TargetKind::Null, 1 << 20);
        assert_eq!(
            spec_from_request(&a, &d).unwrap().settings.sandbox_optional,
            d.sandbox_optional
        );
        a.sandbox_optional = Some(vec![SandboxLayer::UserNamespace]);
        assert_eq!(
            spec_from_request(&a, &d).unwrap().settings.sandbox_optional.layers(),
            [SandboxLayer::UserNamespace]
        );
    }

    #[test]
    fn zero_copy_is_for_loop_and_nbd_devices_only() {
        let mut a = sized(TargetKind::Memory, 1 << 20);
        a.zero_copy = Some(true);
        let err = spec_from_request(&a, &defaults()).unwrap_err();
        assert_eq!(err, "--zero-copy is only for loop and nbd devices, not memory; leave it out");
    }

    #[test]
    fn an_nbd_device_takes_zero_copy_or_copy_and_leaves_it_unset_otherwise() {
        let mut a = add(TargetKind::Nbd);
        a.uri = Some("nbd+unix:///disk?socket=/run/nbd.sock".into());
        for zero_copy in [None, Some(true), Some(false)] {
            a.zero_copy = zero_copy;
            let spec = spec_from_request(&a, &defaults()).unwrap();
            assert_eq!(spec.target.zero_copy(), zero_copy);
        }
        // One connection per thread, and a worker takes at most eight.
        (a.zero_copy, a.threads, a.queues) = (Some(true), Some(9), Some(4));
        let err = spec_from_request(&a, &defaults()).unwrap_err();
        assert!(err.starts_with("--threads: 9 is more than 8: a zero-copy nbd device"), "{err}");
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
        let mut a = sized(TargetKind::Memory, 1 << 20);
        a.sandbox = Some(false);
        assert!(defaults().sandbox);
        assert!(!spec_from_request(&a, &defaults()).unwrap().settings.sandbox);
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
        let mut a = sized(TargetKind::Null, 1 << 20);
        a.queue_depth = Some(0);
        let err = spec_from_request(&a, &defaults()).unwrap_err();
        assert!(err.starts_with("-d/--depth: "), "{err}");
    }

    #[test]
    fn an_nbd_device_takes_its_uri_and_no_size() {
        let mut a = add(TargetKind::Nbd);
        a.uri = Some("nbd+unix:///disk?socket=/run/nbd.sock".into());
        let spec = spec_from_request(&a, &defaults()).unwrap();
        assert!(
            matches!(&spec.target, TargetSpec::Nbd { uri, zero_copy: None } if uri.export == "disk")
        );
        assert_eq!(spec.size_bytes, 0);

        a.size = Some(1 << 30);
        let err = spec_from_request(&a, &defaults()).unwrap_err();
        assert!(err.starts_with("-s/--size: an nbd device's size is its export's"), "{err}");
    }

    #[test]
    fn nbd_uri_mistakes_name_the_flag() {
        let err = spec_from_request(&add(TargetKind::Nbd), &defaults()).unwrap_err();
        assert!(err.starts_with("an nbd device needs its export's URI (--uri"), "{err}");

        let mut a = add(TargetKind::Nbd);
        a.uri = Some("nbds://host/disk".into());
        let err = spec_from_request(&a, &defaults()).unwrap_err();
        assert!(
            err.starts_with(
                "--uri: \"nbds://host/disk\": an nbds:// URI needs tls-certificates=DIR"
            ),
            "{err}"
        );

        let mut a = sized(TargetKind::Memory, 1 << 20);
        a.uri = Some("nbd://host/".into());
        let err = spec_from_request(&a, &defaults()).unwrap_err();
        assert_eq!(err, "--uri is only for nbd devices, not memory");
    }

    #[test]
    fn defaults_fill_what_the_request_leaves_out() {
        let mut a = sized(TargetKind::Memory, 64 << 20);
        a.queues = Some(2);
        let spec = spec_from_request(&a, &defaults()).unwrap();
        assert_eq!(spec.settings.queues, 2);
        assert_eq!(spec.settings.queue_depth, defaults().queue_depth);
        assert_eq!(spec.size_bytes, 64 << 20);
    }

    #[test]
    fn a_failed_worker_and_a_state_that_forbids_it_have_their_own_kinds() {
        use crate::device_state::TransitionError;
        use crate::worker::WorkerError;
        let worker = |source| DeviceError::Worker { id: 3, source };
        let exited = WorkerError::Died { pid: 9, status: "exit 1".into(), by_signal: false };
        assert_eq!(device_error_kind(&worker(exited)), ErrorKind::WorkerFailed);
        let silent = WorkerError::Timeout { pid: 9, secs: 30 };
        let failure = device_failure(&worker(silent));
        assert_eq!(failure.kind, ErrorKind::WorkerFailed);
        assert_eq!(failure.message, "device 3: worker 9 did not answer within 30 s");
        assert_eq!(device_error_kind(&DeviceError::NoStandby { id: 3 }), ErrorKind::WorkerFailed);
        let illegal = TransitionError::IllegalTransition {
            id: 3,
            from: StateKind::Releasing,
            to: StateKind::Recovering,
        };
        assert_eq!(device_error_kind(&DeviceError::from(illegal)), ErrorKind::TryAgain);
        let not_ours = DeviceError::NotOurs { id: 3, why: "x".into() };
        assert_eq!(device_error_kind(&not_ours), ErrorKind::Other);
    }
}
