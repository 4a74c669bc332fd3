//! A device's workers: starting one and sending it its setup, keeping a standby ready
//! without blocking the loop, and handing the device to a standby (activation).

use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use ublkd_config::TargetSpec;
use ublkd_proto::msg::{Activation, DataPath, TargetSetup, WorkerSetup};

use super::{Context, Device, DeviceError, Spare};
use crate::target::{
    MAX_IO_BUF_BYTES, TargetError, fast_release_supported, open_char_dev, zero_copy,
};
use crate::worker::{Activating, AttachClaim, Worker, WorkerError, WorkerSandbox};

impl Device {
    /// Whether a dead worker's device may be released at once (`recovery.fast_release`,
    /// [`crate::worker::Worker::release_device`]) without a write it left in flight
    /// landing after the re-issued request and newer writes to the same blocks. The
    /// kernel does not wait for a dying worker's O_DIRECT writes (they are bios by then);
    /// with zero copy, ublk's release itself waits for them (they hold the request's
    /// registered buffer); null and memory devices and buffered loop files have no
    /// write that outlives the worker. That leaves O_DIRECT loop devices in copy mode:
    /// theirs is released by the rings' teardown, which waits for every request.
    /// `tests/tests/data_safety.rs` proves both sides.
    fn fast_release_is_safe(&self) -> bool {
        !(matches!(self.spec.target, TargetSpec::Loop { .. }) && self.direct)
            || zero_copy(&self.spec)
    }

    /// Whether this device's workers are released at once when they die: decided here
    /// from the config, the device and the kernel, never from what a worker says (on a
    /// kernel without the fast path, unregistering a dead worker's ring files waits
    /// for every request, on ublkd's loop).
    pub(super) fn fast_release(&self, ctx: &Context) -> bool {
        ctx.fast_release
            && self.fast_release_is_safe()
            && fast_release_supported(DataPath::for_kernel(ctx.kernel_features))
    }

    /// How many connections an nbd device's next worker gets ([`NbdLink::connections`]).
    ///
    /// [`NbdLink::connections`]: crate::target::NbdLink::connections
    pub(super) fn nbd_connections(&self, data_path: DataPath) -> u8 {
        self.nbd.as_ref().map_or(1, |target| target.connections(&self.spec, data_path))
    }

    /// Starts a worker and sends it its setup (region and target to map, buffers and
    /// rings to make), without waiting for it to stand by.
    pub(super) fn spawn_worker(&self, ctx: &Context, fail_io: bool) -> Result<Worker, DeviceError> {
        let id = self.id;
        let worker_err = |source| DeviceError::Worker { id, source };
        let sandbox = self.spec.settings.sandbox.then_some(WorkerSandbox {
            identity: ctx.worker_identity,
            optional: self.spec.settings.sandbox_optional,
        });
        let rbd = match (&self.rbd, fail_io) {
            (Some(target), false) => {
                Some(target.worker_setup(ctx.rbd_cluster_wait).map_err(|source| {
                    DeviceError::Target(TargetError::RbdConf { image: target.image(), source })
                })?)
            }
            _ => None,
        };
        if let (Some(setup), Some(target), true) = (&rbd, &self.rbd, self.spec.settings.sandbox) {
            crate::rbd::conf::check_monitors_by_address(&setup.options).map_err(|source| {
                DeviceError::Target(TargetError::RbdConf { image: target.image(), source })
            })?;
        }
        let ports = rbd.as_ref().map(|setup| crate::rbd::conf::connect_ports(&setup.options));
        let mut worker =
            Worker::spawn(&ctx.worker_binary, id, sandbox, ports.as_deref()).map_err(worker_err)?;
        // The kernel's, as at the device's creation (`target::device_flags`).
        let data_path = DataPath::for_kernel(ctx.kernel_features);
        let setup = WorkerSetup {
            dev_id: id,
            size_bytes: self.spec.size_bytes,
            nr_queues: self.spec.settings.queues,
            queue_depth: self.spec.settings.queue_depth,
            max_io_buf_bytes: MAX_IO_BUF_BYTES,
            nr_threads: self.spec.settings.threads,
            target: match &self.spec.target {
                _ if fail_io => TargetSetup::FailIo,
                TargetSpec::Null => TargetSetup::Null,
                TargetSpec::Memory => TargetSetup::Memory,
                TargetSpec::Loop { .. } => TargetSetup::Loop,
                TargetSpec::Nbd { .. } => {
                    TargetSetup::Nbd { connections: self.nbd_connections(data_path) }
                }
                TargetSpec::Rbd(_) => TargetSetup::Rbd,
            },
            zero_copy: zero_copy(&self.spec),
            fast_release: self.fast_release(ctx),
            block_size: self.spec.settings.block_size,
            data_path,
            rbd,
            read_only: self.spec.attrs.read_only,
        };
        let mut fds: Vec<BorrowedFd<'_>> = vec![self.shm_fd.as_fd()];
        if let Some(fd) = self.target_fd.as_ref().filter(|_| setup.target.target_fds() > 0) {
            fds.push(fd.as_fd());
        }
        if let Err(source) = worker.send_setup(&setup, &fds) {
            let how = worker.reap(Duration::from_millis(100));
            tracing::error!(
                dev_id = id,
                worker_pid = worker.pid(),
                "worker failed ({how}): {source}"
            );
            return Err(worker_err(source));
        }
        Ok(worker)
    }

    /// Waits up to `timeout` for a worker sent its setup to stand by.
    pub(super) fn await_standby(
        &self,
        mut worker: Worker,
        timeout: Duration,
    ) -> Result<Worker, DeviceError> {
        let id = self.id;
        if let Err(source) = worker.standby_answer(timeout) {
            return Err(self.standby_failed(worker, source));
        }
        let missing = worker.sandbox.as_ref().map(|s| &s.missing[..]).unwrap_or_default();
        if !missing.is_empty() {
            let list: Vec<String> = missing.iter().map(|m| m.to_string()).collect();
            tracing::warn!(
                dev_id = id,
                worker_pid = worker.pid(),
                event = "sandbox_weaker",
                "the worker runs without the sandbox layer(s) {} (allowed by sandbox_optional)",
                list.join(", ")
            );
        }
        Ok(worker)
    }

    /// Ends a worker that failed to stand by (`source`: how), and says so.
    pub(super) fn standby_failed(&self, mut worker: Worker, source: WorkerError) -> DeviceError {
        let id = self.id;
        let how = worker.reap(Duration::from_millis(100));
        tracing::error!(
            dev_id = id,
            worker_pid = worker.pid(),
            "standby worker failed ({how}): {source}"
        );
        DeviceError::Worker { id, source }
    }

    /// The worker standing by, to be handed the device. Never waited for: the loop
    /// waits for a starting one on its turns (`standby_ready`, `Creation::progress`).
    pub(super) fn take_standby(&mut self) -> Result<Worker, DeviceError> {
        match std::mem::take(&mut self.spare) {
            Spare::StandingBy(worker) => Ok(worker),
            other => {
                self.spare = other;
                Err(DeviceError::NoStandby { id: self.id })
            }
        }
    }

    /// Starts a worker from the binary now on disk, to become the standby an upgrade
    /// hands the device to ([`Self::renew_standby`] once it has answered, or its
    /// deadline passed). The device keeps its worker and standby meanwhile.
    pub fn start_renewed_standby(&self, ctx: &Context) -> Result<Worker, DeviceError> {
        self.spawn_worker(ctx, false)
    }

    /// Makes `fresh` (from [`Self::start_renewed_standby`]) the standby if it stands by
    /// (`answered`: it has said something, so this does not wait; else it is given up
    /// as too slow), ending the old standby. If the new worker failed, the device
    /// keeps its worker and standby, and the error says why.
    pub fn renew_standby(
        &mut self,
        ctx: &Context,
        fresh: Worker,
        answered: bool,
    ) -> Result<(), DeviceError> {
        let fresh = if answered {
            self.await_standby(fresh, Duration::from_millis(100))?
        } else {
            let secs = ctx.worker_ready_timeout.as_secs();
            let source = WorkerError::Timeout { pid: fresh.pid(), secs };
            return Err(self.standby_failed(fresh, source));
        };
        // Not waited for: reaped once it ends (`reap_lingering`).
        if let Some(old) = std::mem::replace(&mut self.spare, Spare::StandingBy(fresh)).take() {
            old.kill();
        }
        Ok(())
    }

    /// Starts a new standby if there is none, without waiting for it (see
    /// [`Self::standby_progress`]). A failure is logged and retried later; a recovery
    /// meanwhile starts a worker itself.
    pub fn refill_standby(&mut self, ctx: &Context) {
        if !matches!(self.spare, Spare::None) {
            return;
        }
        match self.spawn_worker(ctx, false) {
            Ok(worker) => self.spare = Spare::Starting(worker),
            Err(e) => {
                tracing::warn!(dev_id = self.id, "no standby worker: {e}");
                self.standby_schedule.after_failure();
            }
        }
    }

    /// Moves a starting standby on once it has answered: standing by, or failed (logged,
    /// retried later).
    pub fn standby_progress(&mut self) {
        if !self.starting().is_some_and(Worker::has_answered) {
            return;
        }
        // A recovery waiting for this standby takes it itself, and fails if it failed
        // (rather than start one worker after another that fail).
        if self.awaiting_standby() {
            return;
        }
        let Some(worker) = self.take_starting() else { return };
        match self.await_standby(worker, Duration::from_millis(100)) {
            Ok(worker) => {
                tracing::debug!(dev_id = self.id, worker_pid = worker.pid(), "standby ready");
                self.spare = Spare::StandingBy(worker);
            }
            Err(e) => {
                tracing::warn!(dev_id = self.id, "no standby worker: {e}");
                self.standby_schedule.after_failure();
            }
        }
    }

    /// Records `worker` as the one activated at `generation`, for the next ublkd to take
    /// over. A failure costs only that: the next ublkd recovers the device instead.
    fn claim_worker(&self, ctx: &Context, worker: &Worker, generation: u64) {
        let written = AttachClaim::of(worker, self.id, generation).map(|mut claim| {
            claim.rbd_clients = self.rbd.as_ref().map(|t| t.clients().to_vec()).unwrap_or_default();
            ctx.state.write_worker_claim(&claim)
        });
        match written {
            Some(Ok(())) => {}
            Some(Err(e)) => tracing::warn!(dev_id = self.id, "cannot record its worker: {e}"),
            None => tracing::warn!(dev_id = self.id, "cannot record its worker: it has ended"),
        }
    }

    /// Gives the device to `worker` (standing by) without waiting for it: the worker
    /// maps the device and PREPs every tag, then answers on its control socket, which
    /// the loop watches ([`Activating::control`]) before it ends the activation
    /// ([`Self::end_activation`]). The supervisor's copy of `/dev/ublkcN` is closed
    /// before this returns.
    pub(super) fn begin_activation(
        &mut self,
        ctx: &Context,
        mut worker: Worker,
    ) -> Result<Activating, DeviceError> {
        let id = self.id;
        self.generation = self.generation.wrapping_add(1);
        let generation = self.generation;
        self.shm.prepare_activation(generation);
        // An rbd worker breaks the image's lock if an earlier worker of this device
        // holds it, and only then; it is recorded with them (in the claim) first.
        let fence = match &mut self.rbd {
            Some(target) => target.fence_for(worker.rbd_client.as_deref()),
            None => Vec::new(),
        };
        // Recorded before the worker is told: if this ublkd dies mid-activation, the
        // next one finds the worker (which may serve on) and, as the claim names no held
        // fds, kills it and recovers the device rather than leave it an unknown server.
        self.claim_worker(ctx, &worker, generation);
        // An nbd worker gets its connections with the device (a fail-io one none), all
        // made ahead on a thread (at creation, or by the recovery).
        let mut sockets = Vec::new();
        if let (Some(target), TargetSetup::Nbd { connections }) =
            (&mut self.nbd, worker.target_setup())
        {
            sockets = match target.hand_over(connections) {
                Ok(sockets) => sockets,
                Err(e) => {
                    worker.kill();
                    worker.reap(Duration::ZERO);
                    return Err(e.into());
                }
            };
        }
        let ublkc = match open_char_dev(id) {
            Ok(ublkc) => ublkc,
            Err(e) => {
                worker.kill();
                worker.reap(Duration::ZERO);
                return Err(e.into());
            }
        };
        let sent = worker.begin_activation(generation, ublkc.as_fd(), &sockets, &fence);
        // Close our copy now: only the worker may hold /dev/ublkcN. The connections are
        // kept, to be drained once this worker is dead (a previous worker's go now).
        drop(ublkc);
        if let Some(target) = &mut self.nbd {
            target.keep_served(sockets);
        }
        if let Err(source) = sent {
            let how = worker.reap(Duration::from_millis(100));
            tracing::error!(dev_id = id, "worker failed ({how}): {source}");
            return Err(DeviceError::Worker { id, source });
        }
        Ok(Activating::new(worker, generation, Instant::now() + ctx.worker_ready_timeout))
    }

    /// Ends an activation once its worker has answered (or the deadline passed): the
    /// worker, serving, and what it said of its activation.
    pub(super) fn end_activation(
        &mut self,
        ctx: &Context,
        activating: Activating,
    ) -> Result<(Worker, Activation), DeviceError> {
        let id = self.id;
        let (mut worker, generation) = activating.into_parts();
        let answer = if worker.has_answered() {
            // It has answered: the message is there, or its end.
            worker.activation_answer(Duration::from_millis(100))
        } else {
            worker.kill();
            Err(WorkerError::Timeout {
                pid: worker.pid(),
                secs: ctx.worker_ready_timeout.as_secs(),
            })
        };
        let activation = match answer {
            Ok(a) => a,
            Err(source) => {
                let how = worker.reap(Duration::from_millis(100));
                tracing::error!(dev_id = id, "worker failed ({how}): {source}");
                return Err(DeviceError::Worker { id, source });
            }
        };
        self.claim_worker(ctx, &worker, generation);
        self.watch_new_worker();
        Ok((worker, activation))
    }

    /// Starts the hang watch afresh for a worker that now serves the device (activated
    /// or taken over): its heartbeats and the kernel's counts are new to the watch.
    pub(super) fn watch_new_worker(&mut self) {
        self.hang.reset(&self.shm);
        self.hang_policy.reset();
    }
}
