//! Making a device: ADD_DEV and SET_PARAMS at once, its first worker started without
//! waiting for it ([`Device::begin_create`]), then, once the worker answers on a later
//! loop turn, the hand-over and START_DEV ([`Creation::progress`]), which runs on a
//! thread of its own ([`KernelCall`]): it waits for the worker to fetch its tags.

#![allow(unused_imports)]
use super::*;
use crate::kernel_call::{KernelCall, KernelCallError};
use crate::nbd::link::NbdLink;
use crate::nbd::target::NbdTarget;
use crate::target::Reached;
use ublkd_proto::ctrl::CtrlCmd;
use ublkd_proto::msg::Activation;

/// A device on its way to LIVE: made in the kernel (ADD_DEV, SET_PARAMS), its record
/// written, its first worker started and sent its setup. Starting a worker (exec,
/// sandbox, rings) takes 0.1-1 s under emulation: the loop watches the worker's control
/// socket ([`Self::control`]) and moves the creation on ([`Self::progress`]) once it
/// answers, so that it serves everything else meanwhile and creations overlap. Every
/// creation ends in [`Progress::Done`] or [`Self::abandon`]: dropped otherwise, it would
/// leave its kernel device (and its worker) behind.
#[derive(Debug)]
pub struct Creation {
    dev: Device,
    /// When the worker must have stood by (`worker_ready_timeout` after its start).
    deadline: Instant,
    /// Its worker, once standing by, being handed the device.
    activating: Option<Box<Activating>>,
    /// START_DEV, once the worker has answered its activation: on a thread of its own
    /// ([`KernelCall`]), as it waits until the worker has fetched every tag.
    starting: Option<Box<KernelCall>>,
}

impl Creation {
    /// The kernel's id of the device being created.
    pub fn id(&self) -> u32 {
        self.dev.id
    }

    /// What the device is being made as.
    pub fn spec(&self) -> &DeviceSpec {
        &self.dev.spec
    }

    /// The worker's pid, until the device is LIVE.
    pub fn worker_pid(&self) -> Option<u32> {
        let activating = self.activating.as_deref().map(Activating::worker);
        let starting = self.starting.as_deref().and_then(KernelCall::worker);
        self.dev.starting().or(activating).or(starting).map(Worker::pid)
    }

    /// The worker's control socket: readable once it stands by (or answers its
    /// activation), fails or ends.
    pub fn control(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.activating {
            Some(activating) => Some(activating.control()),
            None => self.dev.starting().map(Worker::control),
        }
    }

    /// Whether its worker stands by and is being handed the device.
    pub fn activating(&self) -> bool {
        self.activating.is_some()
    }

    /// Whether START_DEV runs, waiting for the worker to fetch its tags.
    pub fn starting_dev(&self) -> bool {
        self.starting.is_some()
    }

    /// When the creation fails if its worker has not answered by then; while START_DEV
    /// runs, when the loop looks again whether it has ended.
    pub fn deadline(&self) -> Instant {
        if let Some(call) = &self.starting {
            return call.next_look(Instant::now());
        }
        self.activating.as_deref().map_or(self.deadline, Activating::deadline)
    }

    /// Goes on once the worker has answered (or the deadline passed at `now`): hands
    /// the device to it (activation: the worker maps it and PREPs every tag, a few
    /// milliseconds, answered on a later turn), then starts the device. A failure
    /// cleans up after itself.
    pub fn progress(mut self, ctx: &Context, now: Instant) -> Progress {
        let id = self.dev.id;
        let live = if let Some(mut call) = self.starting.take() {
            match call.poll(now) {
                None => {
                    self.starting = Some(call);
                    return Progress::Pending(self);
                }
                Some((worker, activation, started)) => {
                    self.dev.go_live(ctx, worker, &activation, started)
                }
            }
        } else if let Some(activating) = self.activating.take() {
            if !activating.due(now) {
                self.activating = Some(activating);
                return Progress::Pending(self);
            }
            let started = self.dev.end_activation(ctx, *activating).and_then(|(worker, a)| {
                KernelCall::begin(CtrlCmd::StartDev, id, worker, a, ctx.worker_ready_timeout)
                    .map_err(|source| DeviceError::KernelCall { id, source })
            });
            match started {
                Ok(call) => {
                    self.starting = Some(Box::new(call));
                    return Progress::Pending(self);
                }
                Err(e) => Err(e),
            }
        } else {
            let answered = self.dev.starting().is_some_and(Worker::has_answered);
            if !answered && now < self.deadline && self.dev.starting().is_some() {
                return Progress::Pending(self);
            }
            let activating = match self.dev.take_starting() {
                Some(worker) if answered => {
                    self.dev.await_standby(worker, Duration::from_millis(100))
                }
                Some(worker) => {
                    let source = WorkerError::Timeout {
                        pid: worker.pid(),
                        secs: ctx.worker_ready_timeout.as_secs(),
                    };
                    Err(self.dev.standby_failed(worker, source))
                }
                None => self.dev.take_standby(),
            }
            .and_then(|standby| self.dev.begin_activation(ctx, standby));
            match activating {
                Ok(activating) => {
                    self.activating = Some(Box::new(activating));
                    return Progress::Pending(self);
                }
                Err(e) => Err(e),
            }
        };
        match live {
            Ok(()) => Progress::Done(Ok(self.dev)),
            Err(e) => {
                tracing::debug!(dev_id = id, "create failed: {e}; deleting the device");
                self.abandon(ctx);
                Progress::Done(Err(e))
            }
        }
    }

    /// Gives the creation up (it failed, or ublkd is stopping before it finished):
    /// kills its workers and deletes the device and its record.
    pub fn abandon(self, ctx: &Context) {
        let mut dev = self.dev;
        let id = dev.id;
        let activating = self.activating.map(|a| a.into_worker());
        // START_DEV holds a reference to the device, which DEL_DEV would wait for: it
        // is interrupted, and waited for, first.
        let starting = self.starting.and_then(|call| call.into_worker());
        for mut worker in dev.take_workers().into_iter().chain(activating).chain(starting) {
            worker.kill();
            let pid = worker.pid();
            let how = worker.reap(Duration::ZERO);
            tracing::debug!(dev_id = id, worker_pid = pid, "worker of a create given up: {how}");
        }
        if let Err(del) = ctx.ctrl.del_dev(id) {
            tracing::error!(dev_id = id, "cleanup after a failed create: {del}");
        }
        ctx.state.remove(id);
    }
}

/// Where a [`Creation`] stands after [`Creation::progress`].
#[derive(Debug)]
pub enum Progress {
    /// Its worker has not answered yet.
    Pending(Creation),
    /// LIVE, or failed and cleaned up (no kernel device, no worker, no record left).
    Done(Result<Device, DeviceError>),
}

impl Device {
    /// Starts creating a device described by `spec` (already validated), with its
    /// target reached (an nbd export connected and negotiated, an rbd image probed:
    /// [`crate::target::reach`]): makes it in the kernel and starts its first
    /// worker, without waiting for the worker (see [`Creation`]).
    pub fn begin_create(
        ctx: &Context,
        spec: &DeviceSpec,
        reached: Reached,
    ) -> Result<Creation, DeviceError> {
        let mut spec = match decide_zero_copy(spec, ctx.kernel_features, ctx.kernel_release) {
            Ok(spec) => spec,
            Err(e) => {
                // The export's server gets a clean goodbye on the connections made for
                // a device that will not be.
                if let Reached::Nbd(Some(link)) = reached {
                    let tls = link.info.is_some_and(|i| i.tls);
                    link.close(false, tls);
                }
                return Err(e.into());
            }
        };
        let nbd = match reached {
            Reached::Nbd(link) => link,
            // An rbd device is its image's size, probed before it is made.
            Reached::Rbd(probe) => {
                spec.size_bytes = probe.size_bytes;
                None
            }
        };
        // An nbd device is what its export is: connected and negotiated before the
        // kernel device is made, so a server that is not there costs nothing.
        if let Some(info) = nbd.as_ref().and_then(|l| l.info.as_ref()) {
            spec.size_bytes = info.size;
            // The server's minimum is the least the kernel may send it.
            spec.settings.block_size =
                crate::nbd::device_block_size(info, spec.settings.block_size);
        }
        let spec = &spec;
        let info = UblksrvCtrlDevInfo {
            nr_hw_queues: spec.settings.queues,
            queue_depth: spec.settings.queue_depth,
            max_io_buf_bytes: MAX_IO_BUF_BYTES,
            dev_id: spec.id.unwrap_or(AUTO_DEV_ID),
            flags: device_flags(spec, ctx.kernel_features),
            ublksrv_flags: OWNER_TAG,
            ..UblksrvCtrlDevInfo::default()
        };
        let added = ctx.ctrl.add_dev(&info)?;
        let id = added.dev_id;
        let mut spec = spec.clone();
        if added.nr_hw_queues != spec.settings.queues {
            // The kernel gives a device at most one queue per CPU.
            tracing::info!(
                dev_id = id,
                "{} queues asked, the kernel gives {} (one per CPU)",
                spec.settings.queues,
                added.nr_hw_queues
            );
            spec.settings.queues = added.nr_hw_queues;
            let slots = spec.settings.queues.saturating_mul(spec.settings.queue_depth).max(1);
            spec.settings.threads = spec.settings.threads.min(slots);
        }
        // From here on, a failure deletes the half-made device.
        match Self::prepare(ctx, id, &spec, nbd) {
            Ok(dev) => {
                let deadline = Instant::now() + ctx.worker_ready_timeout;
                Ok(Creation { dev, deadline, activating: None, starting: None })
            }
            Err(e) => {
                if let Err(del) = ctx.ctrl.del_dev(id) {
                    tracing::error!(dev_id = id, "cleanup after a failed create: {del}");
                }
                ctx.state.remove(id);
                Err(e)
            }
        }
    }

    /// A device just added to the kernel: its record, its parameters, its state, and
    /// its first worker started (`starting`).
    pub(super) fn prepare(
        ctx: &Context,
        id: u32,
        spec: &DeviceSpec,
        nbd: Option<NbdLink>,
    ) -> Result<Device, DeviceError> {
        let state_err = |source| DeviceError::State { id, source };
        let mut spec = spec.clone();
        spec.id = Some(id);
        let export = nbd.as_ref().and_then(|l| l.info.as_ref());
        let record =
            DeviceRecord { export: export.map(ExportRecord::from), ..DeviceRecord::new(id, &spec) };
        ctx.state.write_record(&record).map_err(state_err)?;
        ctx.ctrl.set_params(id, &params(&spec, export))?;
        let nbd_target = NbdTarget::for_spec(&spec, nbd);
        let mut dev = Self::open(ctx, id, spec, DeviceState::Starting)?;
        dev.nbd = nbd_target;
        dev.spare = Spare::Starting(dev.spawn_worker(ctx, false)?);
        Ok(dev)
    }

    /// Serves a new device whose START_DEV (run off the loop: [`KernelCall`]) has
    /// ended with `started`, by its first worker.
    pub(super) fn go_live(
        &mut self,
        ctx: &Context,
        mut worker: Worker,
        activation: &Activation,
        started: Result<(), KernelCallError>,
    ) -> Result<(), DeviceError> {
        let id = self.id;
        if let Err(source) = started {
            // Not left running beside the device it was given, which is deleted next.
            worker.kill();
            let how = worker.reap(Duration::ZERO);
            tracing::error!(
                dev_id = id,
                worker_pid = worker.pid(),
                "START_DEV failed ({how}): {source}"
            );
            return Err(DeviceError::KernelCall { id, source });
        }
        let pid = worker.pid();
        // Refused, the worker is killed (see `transition`).
        self.serve(worker, None)?;
        tracing::info!(
            dev_id = id,
            worker_pid = pid,
            map_us = activation.map_us,
            prep_us = activation.prep_us,
            backend = self.spec.target.name(),
            event = "live",
            "device LIVE"
        );
        self.refill_standby(ctx);
        Ok(())
    }
}
