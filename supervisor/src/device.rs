//! One ublk device's lifecycle: ADD_DEV → SET_PARAMS → shared region and target →
//! worker (PREP) → START_DEV; recovery when its worker dies or hangs
//! (START_USER_RECOVERY → a warm standby worker → END_USER_RECOVERY); adoption by a
//! restarted supervisor; STOP_DEV → worker exit → DEL_DEV.
//!
//! The supervisor opens `/dev/ublkcN` only to hand it to the worker and closes its own
//! copy at once: any copy it kept would keep the kernel from ever starting a recovery.
//! Because the supervisor is the opener, the kernel records the supervisor's pid as the
//! device's server, and START_DEV / END_USER_RECOVERY carry that pid.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ublkd_config::{DeviceSpec, TargetSpec};
use ublkd_proto::ctrl::{AUTO_DEV_ID, CtrlClient, CtrlError};
use ublkd_proto::msg::{Activation, TargetSetup, WorkerSetup};
use ublkd_proto::shm::{Geometry, ShmError, ShmRegion};
use ublkd_proto::uapi::{
    self, DevState, UblkParamBasic, UblkParamDiscard, UblkParams, UblksrvCtrlDevInfo,
};

use crate::device_state::{DeviceState, Release, StateKind, TransitionError};
use crate::hang::HangWatch;
use crate::recovery::{HangPolicy, RestartBudget, StandbySchedule};
use crate::state::{DeviceRecord, OWNER_TAG, StateDir, StateError};
use crate::worker::{Worker, WorkerError, WorkerIdentity, WorkerSandbox};

/// The largest request, and so each tag's buffer in the worker.
pub const MAX_IO_BUF_BYTES: u32 = 512 * 1024;

/// The feature flags every ublkd device is created with.
pub const DEVICE_FLAGS: u64 =
    uapi::UBLK_F_BATCH_IO | uapi::UBLK_F_USER_RECOVERY | uapi::UBLK_F_USER_RECOVERY_REISSUE;

/// The flags of a device: [`DEVICE_FLAGS`], and automatic buffer registration for a
/// zero-copy loop device.
pub fn device_flags(spec: &DeviceSpec) -> u64 {
    if zero_copy(spec) { DEVICE_FLAGS | uapi::UBLK_F_AUTO_BUF_REG } else { DEVICE_FLAGS }
}

fn zero_copy(spec: &DeviceSpec) -> bool {
    matches!(spec.target, TargetSpec::Loop { zero_copy: Some(true), .. })
}

/// `spec` with its zero copy decided: asked for, it needs the kernel's AUTO_BUF_REG;
/// left unset, a loop device gets it where the kernel has it and the device fits a
/// ring's buffer table (zero copy served the loop jobs of `bench/run` 1.2-1.7x as fast
/// as copying).
fn decide_zero_copy(spec: &DeviceSpec, kernel_features: u64) -> Result<DeviceSpec, DeviceError> {
    let mut spec = spec.clone();
    let has = kernel_features & uapi::UBLK_F_AUTO_BUF_REG != 0;
    let fits = spec.fits_zero_copy();
    if let TargetSpec::Loop { zero_copy, .. } = &mut spec.target {
        match zero_copy {
            Some(true) if !has => return Err(DeviceError::ZeroCopyUnsupported),
            Some(_) => {}
            None => *zero_copy = Some(has && fits),
        }
    }
    Ok(spec)
}

/// How long a worker may take to get set up, or to PREP every tag.
const WORKER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a worker may take to exit when asked.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How long a recovery waits inline for the kernel to release a dead worker's
/// `/dev/ublkcN` before it leaves the waiting to the loop's later turns.
const RELEASE_WAIT_INLINE: Duration = Duration::from_millis(250);
/// A release that has taken this long is logged and shown in status (and still
/// waited for).
const RELEASE_SLOW: Duration = Duration::from_secs(15);

/// Errors in a device's lifecycle. Each names the device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Ctrl(#[from] CtrlError),
    #[error("device {id}: {source}")]
    Shm { id: u32, source: ShmError },
    #[error("device {id}: {source}")]
    State { id: u32, source: StateError },
    #[error("device {id}: cannot open its backing file {}: {source}", path.display())]
    Backing { id: u32, path: PathBuf, source: io::Error },
    #[error("device {id}: {} did not appear: {source}", path.display())]
    CharDev { id: u32, path: PathBuf, source: io::Error },
    #[error("device {id}: {source}")]
    Worker { id: u32, source: WorkerError },
    #[error("device {id} is not ublkd's: {why}")]
    NotOurs { id: u32, why: String },
    #[error("device {id} was created by ublkd but never started (a create cut short)")]
    NeverStarted { id: u32 },
    #[error("zero_copy needs the kernel's UBLK_F_AUTO_BUF_REG (Linux >= 6.16), which it lacks")]
    ZeroCopyUnsupported,
    #[error(transparent)]
    Transition(#[from] TransitionError),
}

/// What every device operation needs from the daemon.
#[derive(Debug)]
pub struct Context {
    pub ctrl: CtrlClient,
    pub worker_binary: PathBuf,
    pub state: StateDir,
    /// Who sandboxed workers run as.
    pub worker_identity: WorkerIdentity,
    /// The kernel's `UBLK_F_*` feature mask (`UBLK_U_CMD_GET_FEATURES`).
    pub kernel_features: u64,
    /// `recovery.fast_release`, for the workers started from now on.
    pub fast_release: bool,
}

/// Where a recovery stands when the call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// LIVE again, after this stall (from the death seen, or the call).
    Done(Duration),
    /// Waiting for the kernel to release the old worker's file: the loop goes on
    /// with it ([`Device::continue_recovery`]).
    Waiting,
}

/// How a device's active worker died.
#[derive(Debug)]
pub struct WorkerDeath {
    /// The exit, as the log says it (`worker PID killed by signal 9`).
    pub how: String,
    /// Why the worker was killed, if it was found hung.
    pub hang: Option<String>,
}

impl WorkerDeath {
    /// The recovery's reason: the hang that got the worker killed, else its exit.
    pub fn reason(self) -> String {
        self.hang.unwrap_or(self.how)
    }
}

/// A device ublkd created (or adopted) and serves.
#[derive(Debug)]
pub struct Device {
    id: u32,
    spec: DeviceSpec,
    /// Where the device stands; changed only through [`Self::transition`].
    state: DeviceState,
    shm: ShmRegion,
    shm_fd: OwnedFd,
    /// The memory target's data file or the loop target's file, held so workers can
    /// be given it again.
    target_fd: Option<OwnedFd>,
    /// Whether the loop file really is O_DIRECT (a filesystem may refuse it).
    direct: bool,
    /// The active worker: present exactly in the states that have one
    /// ([`DeviceState::has_worker`]).
    worker: Option<Worker>,
    /// Set up and waiting, so a recovery does not wait for a process to start.
    standby: Option<Worker>,
    /// A standby on its way: sent its setup, not yet standing by. The poll loop
    /// watches its control socket, so starting one never blocks the supervisor.
    starting: Option<Worker>,
    recoveries: u64,
    last_recovery_ms: Option<u64>,
    last_recovery_reason: Option<String>,
    restart_budget: RestartBudget,
    standby_schedule: StandbySchedule,
    hang: HangWatch,
    hang_policy: HangPolicy,
    /// The worker incarnation the region is prepared for: the supervisor's own count,
    /// never read back from the region (a worker can write anything there).
    generation: u64,
    /// When the active worker's death was seen (see [`Self::worker_exited`]): the next
    /// recovery counts its stall from here.
    death_seen: Option<Instant>,
}

impl Device {
    /// Creates, hands over and starts a device described by `spec` (already validated).
    pub fn create(ctx: &Context, spec: &DeviceSpec) -> Result<Device, DeviceError> {
        let spec = &decide_zero_copy(spec, ctx.kernel_features)?;
        let info = UblksrvCtrlDevInfo {
            nr_hw_queues: spec.queues,
            queue_depth: spec.queue_depth,
            max_io_buf_bytes: MAX_IO_BUF_BYTES,
            dev_id: spec.id.unwrap_or(AUTO_DEV_ID),
            flags: device_flags(spec),
            ublksrv_flags: OWNER_TAG,
            ..UblksrvCtrlDevInfo::default()
        };
        let added = ctx.ctrl.add_dev(&info)?;
        let id = added.dev_id;
        let mut spec = spec.clone();
        if added.nr_hw_queues != spec.queues {
            // The kernel gives a device at most one queue per CPU.
            tracing::info!(
                dev_id = id,
                "{} queues asked, the kernel gives {} (one per CPU)",
                spec.queues,
                added.nr_hw_queues
            );
            spec.queues = added.nr_hw_queues;
            let slots = spec.queues.saturating_mul(spec.queue_depth).max(1);
            spec.threads = spec.threads.min(slots);
        }
        // From here on, a failure deletes the half-made device.
        match Self::finish_create(ctx, id, &spec) {
            Ok(dev) => Ok(dev),
            Err(e) => {
                if let Err(del) = ctx.ctrl.del_dev(id) {
                    tracing::error!(dev_id = id, "cleanup after a failed create: {del}");
                }
                ctx.state.remove(id);
                Err(e)
            }
        }
    }

    fn finish_create(ctx: &Context, id: u32, spec: &DeviceSpec) -> Result<Device, DeviceError> {
        let state_err = |source| DeviceError::State { id, source };
        let mut spec = spec.clone();
        spec.id = Some(id);
        ctx.state.write_record(&DeviceRecord::new(id, &spec)).map_err(state_err)?;
        ctx.ctrl.set_params(id, &params(&spec))?;
        let mut dev = Self::open(ctx, id, spec, DeviceState::Starting)?;
        let standby = dev.ensure_standby(ctx)?;
        let (worker, activation) = dev.activate(standby)?;
        ctx.ctrl.start_dev(id, std::process::id() as i32)?;
        tracing::info!(
            dev_id = id,
            worker_pid = worker.pid(),
            map_us = activation.map_us,
            prep_us = activation.prep_us,
            backend = dev.spec.target.name(),
            event = "live",
            "device LIVE"
        );
        dev.transition(DeviceState::Live)?;
        dev.worker = Some(worker);
        dev.refill_standby(ctx);
        Ok(dev)
    }

    /// The device's state from its record: region, target data. A device `Starting`
    /// gets a new region; an adopted one (`Recovering`) keeps its own if it is sound.
    fn open(
        ctx: &Context,
        id: u32,
        spec: DeviceSpec,
        state: DeviceState,
    ) -> Result<Device, DeviceError> {
        let fresh = state == DeviceState::Starting;
        let state_err = |source| DeviceError::State { id, source };
        let geometry = Geometry {
            dev_id: id,
            nr_queues: spec.queues,
            queue_depth: spec.queue_depth,
            nr_threads: spec.threads,
        };
        let shm_file = ctx.state.shm_file(id).map_err(state_err)?;
        let (shm, shm_fd) = if fresh {
            ShmRegion::create_in(shm_file, geometry)
        } else {
            // An adopted device keeps its region (counters, generation) if it is sound.
            let fd: OwnedFd = shm_file.into();
            match ShmRegion::open(fd.as_fd(), geometry) {
                Ok(region) => Ok((region, fd)),
                Err(e) => {
                    tracing::warn!(dev_id = id, "rebuilding the shared region: {e}");
                    ShmRegion::create_in(File::from(fd), geometry)
                }
            }
        }
        .map_err(|source| DeviceError::Shm { id, source })?;
        // Any value will do (it only has to differ between incarnations): the next
        // activation writes its successor over whatever the region holds.
        let generation = shm.generation();
        let (target_fd, direct) = open_target(ctx, id, &spec)?;
        Ok(Device {
            id,
            spec,
            state,
            shm,
            shm_fd,
            target_fd,
            direct,
            worker: None,
            standby: None,
            starting: None,
            recoveries: 0,
            last_recovery_ms: None,
            last_recovery_reason: None,
            restart_budget: RestartBudget::default(),
            standby_schedule: StandbySchedule::default(),
            death_seen: None,
            hang: HangWatch::new(id),
            hang_policy: HangPolicy::default(),
            generation,
        })
    }

    /// Adopts a device a previous supervisor left: checks that the kernel's device is
    /// ours and matches the record, then recovers it with a new worker.
    pub fn adopt(ctx: &Context, rec: &DeviceRecord) -> Result<Device, DeviceError> {
        let id = rec.id;
        let info = ctx.ctrl.get_dev_info(id)?;
        let not_ours = |why: String| DeviceError::NotOurs { id, why };
        if info.ublksrv_flags != OWNER_TAG {
            return Err(not_ours(format!("its ublksrv_flags are {:#x}", info.ublksrv_flags)));
        }
        if (info.nr_hw_queues, info.queue_depth) != (rec.queues, rec.queue_depth) {
            return Err(not_ours("its queues differ from ublkd's record".into()));
        }
        // ublkd creates privileged devices as root: a device with its tag that is
        // neither was made by someone else, who may have copied the tag.
        if info.owner_uid != 0 || info.owner_gid != 0 {
            return Err(not_ours(format!(
                "it belongs to uid {} gid {}, not root",
                info.owner_uid, info.owner_gid
            )));
        }
        if info.flags & uapi::UBLK_F_UNPRIVILEGED_DEV != 0 {
            return Err(not_ours("it is an unprivileged device".into()));
        }
        let spec = rec.spec().map_err(not_ours)?;
        // The worker's batch elements depend on it: a mismatch would fail every PREP.
        if info.flags & uapi::UBLK_F_AUTO_BUF_REG != device_flags(&spec) & uapi::UBLK_F_AUTO_BUF_REG
        {
            return Err(not_ours("its zero-copy flag differs from ublkd's record".into()));
        }
        if DevState::from_raw(info.state) == DevState::Dead {
            // Created but never started: the previous supervisor died mid-create. It
            // never served anything; the caller deletes it rather than leak its id.
            return Err(DeviceError::NeverStarted { id });
        }
        let mut dev = Self::open(ctx, id, spec, DeviceState::Recovering)?;
        dev.recover(ctx, "the supervisor restarted")?;
        Ok(dev)
    }

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

    /// Starts a worker and sends it its setup (region and target to map, buffers and
    /// rings to make), without waiting for it to stand by.
    fn spawn_worker(&self, ctx: &Context, fail_io: bool) -> Result<Worker, DeviceError> {
        let id = self.id;
        let worker_err = |source| DeviceError::Worker { id, source };
        let sandbox = self.spec.sandbox.then_some(WorkerSandbox {
            identity: ctx.worker_identity,
            optional: self.spec.sandbox_optional,
        });
        let mut worker = Worker::spawn(&ctx.worker_binary, id, sandbox).map_err(worker_err)?;
        let setup = WorkerSetup {
            dev_id: id,
            size_bytes: self.spec.size_bytes,
            nr_queues: self.spec.queues,
            queue_depth: self.spec.queue_depth,
            max_io_buf_bytes: MAX_IO_BUF_BYTES,
            nr_threads: self.spec.threads,
            target: match &self.spec.target {
                _ if fail_io => TargetSetup::FailIo,
                TargetSpec::Null => TargetSetup::Null,
                TargetSpec::Memory => TargetSetup::Memory,
                TargetSpec::Loop { .. } => TargetSetup::Loop,
            },
            zero_copy: zero_copy(&self.spec),
            fast_release: ctx.fast_release && self.fast_release_is_safe(),
            block_size: self.spec.block_size,
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
    fn await_standby(&self, mut worker: Worker, timeout: Duration) -> Result<Worker, DeviceError> {
        let id = self.id;
        if let Err(source) = worker.standby_answer(timeout) {
            let how = worker.reap(Duration::from_millis(100));
            tracing::error!(
                dev_id = id,
                worker_pid = worker.pid(),
                "standby worker failed ({how}): {source}"
            );
            return Err(DeviceError::Worker { id, source });
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

    /// A standby now, waiting for it if need be: the one standing by, else the one on
    /// its way, else a new one.
    fn ensure_standby(&mut self, ctx: &Context) -> Result<Worker, DeviceError> {
        if let Some(worker) = self.standby.take() {
            return Ok(worker);
        }
        let worker = match self.starting.take() {
            Some(w) => w,
            None => self.spawn_worker(ctx, false)?,
        };
        self.await_standby(worker, WORKER_TIMEOUT)
    }

    /// Starts a new standby if there is none, without waiting for it (see
    /// [`Self::standby_progress`]). A failure is logged and retried later; a recovery
    /// meanwhile starts a worker itself.
    pub fn refill_standby(&mut self, ctx: &Context) {
        if self.standby.is_some() || self.starting.is_some() {
            return;
        }
        match self.spawn_worker(ctx, false) {
            Ok(worker) => self.starting = Some(worker),
            Err(e) => {
                tracing::warn!(dev_id = self.id, "no standby worker: {e}");
                self.standby_schedule.after_failure();
            }
        }
    }

    /// Moves a starting standby on once it has answered: standing by, or failed (logged,
    /// retried later).
    pub fn standby_progress(&mut self) {
        if !self.starting.as_ref().is_some_and(Worker::has_answered) {
            return;
        }
        let worker = self.starting.take().expect("checked above");
        match self.await_standby(worker, Duration::from_millis(100)) {
            Ok(worker) => {
                tracing::debug!(dev_id = self.id, worker_pid = worker.pid(), "standby ready");
                self.standby = Some(worker);
            }
            Err(e) => {
                tracing::warn!(dev_id = self.id, "no standby worker: {e}");
                self.standby_schedule.after_failure();
            }
        }
    }

    /// Gives the device to `worker` (standing by) and waits until it has PREPed every
    /// tag. The supervisor's copy of `/dev/ublkcN` is closed before this returns.
    fn activate(&mut self, mut worker: Worker) -> Result<(Worker, Activation), DeviceError> {
        let id = self.id;
        self.generation = self.generation.wrapping_add(1);
        let generation = self.generation;
        self.shm.prepare_activation(generation);
        let ublkc = open_char_dev(id)?;
        let ready = worker.activate(generation, ublkc.as_fd(), WORKER_TIMEOUT);
        // Close our copy now: only the worker may hold /dev/ublkcN.
        drop(ublkc);
        let activation = match ready {
            Ok(a) => a,
            Err(source) => {
                let how = worker.reap(Duration::from_millis(100));
                tracing::error!(dev_id = id, "worker failed ({how}): {source}");
                return Err(DeviceError::Worker { id, source });
            }
        };
        self.hang.reset(&self.shm);
        self.hang_policy.reset();
        Ok((worker, activation))
    }

    /// Recovers the device: waits for the kernel to release the old worker's file
    /// (START_USER_RECOVERY answers EBUSY until then; past a short wait the loop goes
    /// on with it, see [`Self::continue_recovery`]), activates the standby, and ends
    /// the recovery. Done: the stall, from the worker's death being seen (or the call,
    /// if no death was) to LIVE.
    pub fn recover(&mut self, ctx: &Context, reason: &str) -> Result<Recovery, DeviceError> {
        self.recover_with(ctx, reason, None)
    }

    /// Recovers the device with a worker that fails every request with EIO: what
    /// `on_restart_limit = "fail-io"` asks for once the restart budget is spent. The
    /// device stays (LIVE, failing fast) for `ublkctl recover`, which puts a real
    /// worker back. Not counted as a recovery. `cause` is what status says meanwhile
    /// and after ([`DeviceState::FailingIo`]).
    pub fn recover_failing_io(
        &mut self,
        ctx: &Context,
        reason: &str,
        cause: String,
    ) -> Result<Recovery, DeviceError> {
        self.recover_with(ctx, reason, Some(cause))
    }

    fn recover_with(
        &mut self,
        ctx: &Context,
        reason: &str,
        fail_io: Option<String>,
    ) -> Result<Recovery, DeviceError> {
        let started = Instant::now();
        let seen = self.death_seen.take().unwrap_or(started);
        if self.state.kind() != StateKind::Recovering {
            self.transition(DeviceState::Recovering)?;
        }
        self.transition(DeviceState::Releasing(Release {
            reason: reason.to_string(),
            fail_io,
            seen,
            started,
            next_try: started,
            delay: Duration::from_micros(200),
            slow: None,
        }))?;
        if let Some(mut old) = self.worker.take() {
            // A live worker (an operator's recover) must go first. Already killed:
            // waiting for it is bounded by the kill's grace, not a polite stop's.
            old.kill();
            old.reap(Duration::ZERO);
            old.release_device();
        }
        self.continue_recovery(ctx, RELEASE_WAIT_INLINE)
    }

    /// When a recovery waiting for the kernel's release tries again, if one waits.
    pub fn release_due(&self) -> Option<Instant> {
        match &self.state {
            DeviceState::Releasing(r) => Some(r.next_try),
            _ => None,
        }
    }

    /// Goes on with a recovery that waits for the kernel to release the dead worker's
    /// `/dev/ublkcN` (START_USER_RECOVERY answers EBUSY until then): tries again,
    /// waiting here at most `inline` (short: the release usually takes tens of
    /// milliseconds, and a recovery's stall should not wait for the loop's next turn),
    /// then leaves the rest to the loop ([`Self::release_due`]), which is never held up
    /// by a release that takes long (a dead worker's write stuck in a slow backend).
    /// The device's I/O is held meanwhile, for as long as it takes. A recovery that
    /// fails leaves the device `Recovering`, for the recovery policy to decide on.
    pub fn continue_recovery(
        &mut self,
        ctx: &Context,
        inline: Duration,
    ) -> Result<Recovery, DeviceError> {
        let id = self.id;
        let DeviceState::Releasing(r) = &mut self.state else { return Ok(Recovery::Waiting) };
        let inline_until = Instant::now() + inline;
        loop {
            match ctx.ctrl.start_user_recovery(id) {
                Ok(()) => break,
                Err(e) if e.errno() == Some(libc::EBUSY) => {
                    let now = Instant::now();
                    let waited = now.saturating_duration_since(r.started);
                    if waited > RELEASE_SLOW && r.slow.is_none() {
                        let why = format!(
                            "waiting for the kernel to release /dev/ublkc{id} ({:.0} s so far: \
                             the dead worker's I/O has not ended); its I/O is held",
                            waited.as_secs_f64()
                        );
                        tracing::warn!(dev_id = id, event = "release_slow", "{why}");
                        r.slow = Some(why);
                    }
                    if now + r.delay > inline_until {
                        // The loop tries again, less and less often.
                        r.delay = r.delay.max(Duration::from_millis(5));
                        r.next_try = now + r.delay;
                        r.delay = (r.delay * 2).min(Duration::from_millis(100));
                        return Ok(Recovery::Waiting);
                    }
                    std::thread::sleep(r.delay);
                    // A short cap keeps the overshoot past a quick release small.
                    r.delay = (r.delay * 2).min(Duration::from_millis(4));
                }
                Err(e) => {
                    self.enter(DeviceState::Recovering);
                    return Err(e.into());
                }
            }
        }
        let (reason, fail_io, seen, started) =
            (r.reason.clone(), r.fail_io.clone(), r.seen, r.started);
        let finished = self.finish_recovery(ctx, &reason, fail_io, seen, started);
        if finished.is_err() {
            self.enter(DeviceState::Recovering);
        }
        finished.map(Recovery::Done)
    }

    /// The rest of a recovery once the kernel has released the old worker's file.
    fn finish_recovery(
        &mut self,
        ctx: &Context,
        reason: &str,
        fail_io: Option<String>,
        seen: Instant,
        started: Instant,
    ) -> Result<Duration, DeviceError> {
        let id = self.id;
        let released = started.elapsed();
        let next = if fail_io.is_some() {
            let starting = self.spawn_worker(ctx, true)?;
            self.await_standby(starting, WORKER_TIMEOUT)?
        } else {
            self.ensure_standby(ctx)?
        };
        let (worker, activation) = self.activate(next)?;
        let activated = started.elapsed();
        ctx.ctrl.end_user_recovery(id, std::process::id() as i32)?;
        let stall = seen.elapsed();
        let detect = started - seen;
        if let Some(cause) = fail_io {
            self.transition(DeviceState::FailingIo { cause })?;
            self.worker = Some(worker);
            tracing::warn!(dev_id = id, "device LIVE, failing every I/O with EIO ({reason})");
            return Ok(stall);
        }
        self.transition(DeviceState::Live)?;
        self.recoveries += 1;
        self.last_recovery_ms = Some(stall.as_millis() as u64);
        self.last_recovery_reason = Some(reason.to_string());
        tracing::info!(
            dev_id = id,
            worker_pid = worker.pid(),
            stall_ms = stall.as_millis() as u64,
            // Where the stall went: from the death seen to the recovery starting, the
            // kernel releasing the old file, the standby mapping (map) and PREPing
            // (prep) as it says and the supervisor's round trip to it (activate), the
            // kernel going LIVE.
            detect_us = detect.as_micros() as u64,
            release_us = released.as_micros() as u64,
            activate_us = (activated - released).as_micros() as u64,
            map_us = activation.map_us,
            prep_us = activation.prep_us,
            end_us = (stall - detect - activated).as_micros() as u64,
            event = "recovered",
            "device recovered ({reason})"
        );
        self.worker = Some(worker);
        self.standby_schedule.after_recovery();
        Ok(stall)
    }

    /// When the next standby is due to start, if one waits.
    pub fn standby_due(&self) -> Option<Instant> {
        self.standby_schedule.due()
    }

    /// Starts the standby a recovery left for later, once it is due.
    pub fn refill_standby_if_due(&mut self, ctx: &Context) {
        if self.standby_schedule.take_due(Instant::now()) {
            self.refill_standby(ctx);
        }
    }

    /// The device's recent recoveries, for the recovery policy.
    pub fn restart_budget_mut(&mut self) -> &mut RestartBudget {
        &mut self.restart_budget
    }

    /// Stops and deletes the device: STOP_DEV, the workers' exit, DEL_DEV (which waits
    /// for `/dev/ublkcN` to be released), and its state.
    pub fn destroy(mut self, ctx: &Context) -> Result<(), DeviceError> {
        let id = self.id;
        let stopped = ctx.ctrl.stop_dev(id);
        let workers = [self.worker.take(), self.standby.take(), self.starting.take()];
        for worker in workers.into_iter().flatten() {
            let pid = worker.pid();
            let how = worker.stop(STOP_GRACE);
            tracing::info!(dev_id = id, worker_pid = pid, "worker ended: {how}");
        }
        let deleted = ctx.ctrl.del_dev(id);
        if deleted.is_ok() {
            ctx.state.remove(id);
        }
        stopped?;
        deleted?;
        tracing::info!(dev_id = id, event = "deleted", "device deleted");
        Ok(())
    }

    pub fn shm(&self) -> &ShmRegion {
        &self.shm
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// The device's description, its zero copy and queue count as decided at creation.
    pub fn spec(&self) -> &DeviceSpec {
        &self.spec
    }

    pub fn state(&self) -> &DeviceState {
        &self.state
    }

    /// The worker serving the device, if one does.
    pub fn worker(&self) -> Option<&Worker> {
        self.worker.as_ref()
    }

    /// The worker standing by for the next recovery, if one does.
    pub fn standby(&self) -> Option<&Worker> {
        self.standby.as_ref()
    }

    /// The standby on its way, if one is.
    pub fn starting(&self) -> Option<&Worker> {
        self.starting.as_ref()
    }

    /// How many times the device was recovered (fail-io workers not counted).
    pub fn recoveries(&self) -> u64 {
        self.recoveries
    }

    pub fn last_recovery_ms(&self) -> Option<u64> {
        self.last_recovery_ms
    }

    pub fn last_recovery_reason(&self) -> Option<&str> {
        self.last_recovery_reason.as_deref()
    }

    /// Moves the device to `to` if the state machine allows it
    /// ([`crate::device_state::StateKind::may_become`]); a refusal leaves the state
    /// as it is and is logged.
    pub fn transition(&mut self, to: DeviceState) -> Result<(), TransitionError> {
        match self.state.check(self.id, &to) {
            Ok(()) => {
                self.state = to;
                Ok(())
            }
            Err(e) => {
                tracing::error!(dev_id = self.id, event = "illegal_transition", "{e}");
                Err(e)
            }
        }
    }

    /// [`Self::transition`] where a refusal needs nothing more than its log line.
    fn enter(&mut self, to: DeviceState) {
        let _refused_and_logged = self.transition(to);
    }

    /// Leaves the device QUIESCED, without a worker, until an operator recovers it.
    pub fn wait_for_operator(&mut self, cause: String) {
        self.enter(DeviceState::WaitingForOperator { cause });
    }

    /// Records why the active worker is about to be killed as hung.
    pub fn mark_hung(&mut self, cause: String) {
        self.enter(DeviceState::Hung { cause });
    }

    /// If the active worker exited, reaps it and says how, and leaves the device
    /// `Recovering`; `seen` is when its death became visible (its pidfd readable), from
    /// which the next recovery counts its stall.
    pub fn worker_exited(&mut self, seen: Instant) -> Option<WorkerDeath> {
        let w = self.worker.as_mut()?;
        let how = w.exited()?;
        let pid = w.pid();
        w.release_device();
        self.worker = None;
        self.death_seen = Some(seen);
        let hang = match &self.state {
            DeviceState::Hung { cause } => Some(cause.clone()),
            _ => None,
        };
        self.enter(DeviceState::Recovering);
        Some(WorkerDeath { how: format!("worker {pid} {how}"), hang })
    }

    /// Forgets when the last worker's death was seen: the next recovery counts its
    /// stall from its own start.
    pub fn forget_death(&mut self) {
        self.death_seen = None;
    }

    /// If the standby exited, reaps it and says how.
    pub fn standby_exited(&mut self) -> Option<String> {
        let w = self.standby.as_mut()?;
        let how = w.exited()?;
        let pid = w.pid();
        self.standby = None;
        Some(format!("standby worker {pid} {how}"))
    }

    /// Why the worker is hung, if it is (see [`crate::hang`] and
    /// [`crate::recovery::HangPolicy`]).
    pub fn hung(&mut self, timeout: Duration) -> Option<String> {
        let pid = self.worker.as_ref()?.pid();
        let verdict = self.hang.check(&self.shm, pid, timeout);
        self.hang_policy.judge(self.id, pid, verdict)
    }

    /// False while the worker holds I/O and none completes for longer than `limit` (the
    /// loop counts such devices; the watchdog does not wait for them). Devices without a
    /// worker (waiting for an operator or a release) and idle ones count as fine: they
    /// are not wedged, they are waiting.
    pub fn progressing(&self, limit: Duration) -> bool {
        self.worker.is_none() || self.hang.quiet_for() <= limit
    }

    /// Kills the active worker (its death is then handled like any other).
    pub fn kill_worker(&mut self) {
        if let Some(w) = &mut self.worker {
            w.kill();
        }
    }
}

/// The kernel parameters for `spec`.
pub fn params(spec: &DeviceSpec) -> UblkParams {
    let bs_shift = spec.block_size.trailing_zeros() as u8;
    let types = uapi::UBLK_PARAM_TYPE_BASIC | uapi::UBLK_PARAM_TYPE_DISCARD;
    // A loop file has a write-back cache (the page cache, or the disk's own): FLUSH and
    // FUA must reach the target. RAM and null have nothing to flush.
    let attrs = match spec.target {
        TargetSpec::Loop { .. } => uapi::UBLK_ATTR_VOLATILE_CACHE | uapi::UBLK_ATTR_FUA,
        TargetSpec::Null | TargetSpec::Memory => 0,
    };
    let max_sectors = MAX_IO_BUF_BYTES >> 9;
    UblkParams {
        len: 0,
        types,
        basic: UblkParamBasic {
            attrs,
            logical_bs_shift: bs_shift,
            physical_bs_shift: bs_shift.max(12),
            io_opt_shift: 12,
            io_min_shift: bs_shift,
            max_sectors,
            chunk_sectors: 0,
            dev_sectors: spec.size_bytes >> 9,
            virt_boundary_mask: 0,
        },
        discard: UblkParamDiscard {
            discard_alignment: 0,
            discard_granularity: spec.block_size,
            max_discard_sectors: max_sectors,
            max_write_zeroes_sectors: max_sectors,
            max_discard_segments: 1,
            reserved0: 0,
        },
        ..UblkParams::default()
    }
}

/// Opens the target's data: the memory file in the state dir for `memory`, the
/// backing file for `loop` (O_DIRECT when asked and the filesystem allows it). Returns
/// the fd and whether the file is in direct mode.
fn open_target(
    ctx: &Context,
    id: u32,
    spec: &DeviceSpec,
) -> Result<(Option<OwnedFd>, bool), DeviceError> {
    match &spec.target {
        TargetSpec::Null => Ok((None, false)),
        TargetSpec::Memory => {
            let file = ctx
                .state
                .memory_file(id, spec.size_bytes)
                .map_err(|source| DeviceError::State { id, source })?;
            Ok((Some(file.into()), false))
        }
        TargetSpec::Loop { file, direct, .. } => open_backing(id, file, *direct),
    }
}

fn open_backing(
    id: u32,
    file: &Path,
    direct: bool,
) -> Result<(Option<OwnedFd>, bool), DeviceError> {
    let open = |flags: i32| {
        OpenOptions::new().read(true).write(true).custom_flags(flags | libc::O_CLOEXEC).open(file)
    };
    let backing_err = |source| DeviceError::Backing { id, path: file.to_path_buf(), source };
    if direct {
        match open(libc::O_DIRECT) {
            Ok(f) => return Ok((Some(f.into()), true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(
                    dev_id = id,
                    file = %file.display(),
                    "the filesystem refuses O_DIRECT; using buffered I/O"
                );
            }
            Err(e) => return Err(backing_err(e)),
        }
    }
    Ok((Some(open(0).map_err(backing_err)?.into()), false))
}

/// Opens `/dev/ublkcN`, waiting briefly for the node to appear (udev or devtmpfs).
fn open_char_dev(id: u32) -> Result<File, DeviceError> {
    let path = PathBuf::from(format!("/dev/ublkc{id}"));
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut delay = Duration::from_millis(1);
    loop {
        match OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(&path) {
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_millis(100));
            }
            Err(source) => return Err(DeviceError::CharDev { id, path, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(target: TargetSpec, block_size: u32) -> DeviceSpec {
        DeviceSpec {
            id: None,
            target,
            size_bytes: 1 << 30,
            queues: 2,
            queue_depth: 64,
            block_size,
            threads: 1,
            sandbox: true,
            sandbox_optional: ublkd_proto::msg::LayerSet::EMPTY,
        }
    }

    fn loop_spec(zero_copy: Option<bool>) -> DeviceSpec {
        spec(TargetSpec::Loop { file: "/x".into(), direct: true, zero_copy }, 4096)
    }

    fn decided(spec: &DeviceSpec, features: u64) -> Option<bool> {
        match decide_zero_copy(spec, features).unwrap().target {
            TargetSpec::Loop { zero_copy, .. } => zero_copy,
            other => panic!("not a loop target: {other:?}"),
        }
    }

    #[test]
    fn zero_copy_by_default_only_where_the_kernel_has_it_and_the_device_fits() {
        let all = uapi::UBLK_F_AUTO_BUF_REG;
        assert_eq!(decided(&loop_spec(None), all), Some(true));
        assert_eq!(decided(&loop_spec(None), 0), Some(false));
        let mut big = loop_spec(None);
        (big.queues, big.queue_depth) = (8, 4096);
        assert_eq!(decided(&big, all), Some(false));
        assert_eq!(decided(&loop_spec(Some(false)), all), Some(false));
        assert_eq!(decided(&loop_spec(Some(true)), all), Some(true));
        assert!(matches!(
            decide_zero_copy(&loop_spec(Some(true)), 0),
            Err(DeviceError::ZeroCopyUnsupported)
        ));
        assert_eq!(device_flags(&loop_spec(Some(true))) & all, all);
        assert_eq!(device_flags(&loop_spec(Some(false))) & all, 0);
    }

    #[test]
    fn params_describe_size_block_size_and_request_limit() {
        let p = params(&spec(TargetSpec::Memory, 512));
        assert_eq!(p.basic.dev_sectors, (1 << 30) >> 9);
        assert_eq!(p.basic.logical_bs_shift, 9);
        assert_eq!(p.basic.physical_bs_shift, 12);
        assert_eq!(p.basic.max_sectors, MAX_IO_BUF_BYTES >> 9);
        assert_eq!(p.basic.attrs, 0);
        assert_ne!(p.types & uapi::UBLK_PARAM_TYPE_DISCARD, 0);
    }

    #[test]
    fn loop_devices_declare_a_volatile_cache_and_fua() {
        let p = params(&spec(
            TargetSpec::Loop { file: "/x".into(), direct: true, zero_copy: None },
            4096,
        ));
        assert_eq!(p.basic.attrs, uapi::UBLK_ATTR_VOLATILE_CACHE | uapi::UBLK_ATTR_FUA);
        assert_eq!(p.basic.logical_bs_shift, 12);
    }
}
