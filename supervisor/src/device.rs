//! One ublk device's lifecycle: ADD_DEV → SET_PARAMS → shared region and target →
//! worker (PREP) → START_DEV; recovery when its worker dies or hangs
//! (START_USER_RECOVERY → a warm standby worker → END_USER_RECOVERY); adoption by a
//! restarted supervisor; STOP_DEV → worker exit → DEL_DEV.
//!
//! The supervisor opens `/dev/ublkcN` only to hand it to the worker and closes its own
//! copy at once: any copy it kept would keep the kernel from ever starting a recovery.
//! Because the supervisor is the opener, the kernel records the supervisor's pid as the
//! device's server, and START_DEV / END_USER_RECOVERY carry that pid.
//!
//! This module creates (in two steps, so that a worker's start never holds up the
//! loop: [`Device::begin_create`], then [`Creation::progress`] once the worker
//! answers), adopts and deletes devices and keeps their state
//! ([`crate::device_state`]): `creation` makes them, `deletion` deletes them and
//! `adoption` takes over a previous ublkd's; `workers` starts and activates their workers,
//! `worker_death` sees them die or hang, `user_recovery` replaces a worker through the
//! kernel's user recovery, and [`crate::target`] sets up what the workers are given.
//! When to recover is [`crate::recovery`]'s decision.

mod adoption;
mod creation;
mod deletion;
mod policy_state;
mod resize;
mod user_recovery;
mod worker_death;
mod workers;

pub use creation::{Creation, Progress};
pub use deletion::{Deletion, Left, Refusal, Safety, Stages};
pub use worker_death::WorkerDeath;

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use ublkd_config::DeviceSpec;
use ublkd_proto::ctrl::{AUTO_DEV_ID, CtrlClient, CtrlError};
use ublkd_proto::shm::{Geometry, ShmError, ShmRegion};
use ublkd_proto::uapi::UblksrvCtrlDevInfo;

use crate::device_state::{DeviceState, StateKind, TransitionError};
use crate::features::KernelRelease;
use crate::hang::HangWatch;
use crate::nbd::ExportInfo;
use crate::nbd::target::NbdTarget;
use crate::rbd::RbdTarget;
use crate::state::{DeviceRecord, ExportRecord, OWNER_TAG, StateDir, StateError};
use crate::target::{MAX_IO_BUF_BYTES, device_flags, params};
use crate::target::{TargetError, decide_zero_copy, open_target};
use crate::worker::{Activating, Worker, WorkerError, WorkerIdentity};
pub use policy_state::{ClusterWait, HangPolicy, RestartBudget, StandbySchedule};
pub use resize::{ResizeError, ResizePlan};

/// How long a worker left serving by a previous ublkd may take to answer its take-over.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a worker may take to exit when asked.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// How long a recovery asks the kernel every few milliseconds whether it released a
/// dead worker's `/dev/ublkcN`, from the loop's turns, before it asks less often.
const RELEASE_QUICK: Duration = Duration::from_millis(250);
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
    #[error("device {id}: {source}")]
    Worker { id: u32, source: WorkerError },
    #[error("device {id} is not ublkd's: {why}")]
    NotOurs { id: u32, why: String },
    #[error("device {id} was created by ublkd but never started (a create cut short)")]
    NeverStarted { id: u32 },
    #[error("device {id}: no worker stands by to be handed the device")]
    NoStandby { id: u32 },
    #[error("device {id}: {source}")]
    KernelCall { id: u32, source: crate::kernel_call::KernelCallError },
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error(transparent)]
    Transition(#[from] TransitionError),
}

impl DeviceError {
    /// Whether the error is the loss of a worker (it died, or stopped taking ublkd's
    /// messages, while the device was set up): what a new worker would not meet
    /// again, unlike a worker that said why it failed, or did not answer in time.
    pub fn worker_lost(&self) -> bool {
        match self {
            DeviceError::Worker { source, .. } => match source {
                // Killed from outside, not a worker that failed by itself (a sandbox
                // refusal is an exit of its own, and would fail again).
                WorkerError::Died { by_signal, .. } => *by_signal,
                WorkerError::Send(_) | WorkerError::NotReading { .. } => true,
                // Gone between its answer and ublkd's copy of its rings.
                WorkerError::Rings { source, .. } => source.raw_os_error() == Some(libc::ESRCH),
                _ => false,
            },
            _ => false,
        }
    }

    /// Whether a recovery that failed with this error starts over with a new worker,
    /// within the restart budget: its new worker was lost, or it failed the kernel's
    /// wait for its tags (a worker of its own, not the device, is at fault).
    pub fn retried_by_recovery(&self) -> bool {
        self.worker_lost() || matches!(self, DeviceError::KernelCall { .. })
    }
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
    /// The kernel's release (uname), for what no feature flag tells (`None`: it does
    /// not read as one).
    pub kernel_release: Option<KernelRelease>,
    /// `recovery.fast_release`, for the workers started from now on.
    pub fast_release: bool,
    /// `recovery.nbd_server_wait_secs` (`None`: for ever).
    pub nbd_server_wait: Option<Duration>,
    /// `recovery.rbd_cluster_wait_secs` (`None`: for ever).
    pub rbd_cluster_wait: Option<Duration>,
    /// `recovery.nbd_handshake_timeout_secs`: how long an NBD server has to accept each
    /// connection and finish its handshake.
    pub nbd_handshake_timeout: Duration,
    /// `recovery.worker_ready_timeout_secs`: how long a worker may take to get set up
    /// (stand by), or to PREP every tag and answer its activation.
    pub worker_ready_timeout: Duration,
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
    /// An nbd device's export and its connections: everything particular to NBD.
    nbd: Option<NbdTarget>,
    /// An rbd device's image and its workers' clients (whom a new worker may fence).
    rbd: Option<RbdTarget>,
    /// The next worker, started ahead so that a recovery does not wait for a process
    /// to start. The workers that have the device are in its state.
    spare: Spare,
    recoveries: u64,
    last_recovery_ms: Option<u64>,
    last_recovery_reason: Option<String>,
    /// When the last recovery put the device back LIVE (wall-clock, for the metrics'
    /// last-recovery timestamp): set where a recovery ends, releasing to LIVE.
    last_recovered_at: Option<SystemTime>,
    /// Times the active worker exited or was killed (each one a worker restart).
    worker_restarts: u64,
    restart_budget: RestartBudget,
    /// An rbd device's recovery waiting for its Ceph cluster (see
    /// [`Self::wait_for_cluster`]): outside the restart budget.
    cluster_wait: ClusterWait,
    standby_schedule: StandbySchedule,
    hang: HangWatch,
    hang_policy: HangPolicy,
    /// The worker was killed because its NBD server answered nothing for
    /// `recovery.nbd_request_timeout_secs`: its death is a lost connection (a fresh one
    /// for the next worker, nothing from the restart budget), not a crash.
    server_silent: bool,
    /// The worker incarnation the region is prepared for: the supervisor's own count,
    /// never read back from the region (a worker can write anything there).
    generation: u64,
    /// When the active worker's death was seen (see [`Self::worker_exited`]): the next
    /// recovery counts its stall from here.
    death_seen: Option<Instant>,
}

impl Device {
    /// The device's state from its record: region, target data. A device `Starting`
    /// gets a new region; an adopted one (`Recovering`) keeps its own if it is sound.
    fn open(
        ctx: &Context,
        id: u32,
        spec: DeviceSpec,
        state: DeviceState,
    ) -> Result<Device, DeviceError> {
        let fresh = state.kind() == StateKind::Starting;
        let state_err = |source| DeviceError::State { id, source };
        let geometry = Geometry {
            dev_id: id,
            nr_queues: spec.settings.queues,
            queue_depth: spec.settings.queue_depth,
            nr_threads: spec.settings.threads,
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
                    ShmRegion::create_in(ctx.state.fresh_shm_file(id).map_err(state_err)?, geometry)
                }
            }
        }
        .map_err(|source| DeviceError::Shm { id, source })?;
        // Any value will do (it only has to differ between incarnations): the next
        // activation writes its successor over whatever the region holds.
        let generation = shm.generation();
        let (target_fd, direct) = open_target(&ctx.state, id, &spec)?;
        // An adopted nbd device learns its export again at its next connection.
        let nbd = NbdTarget::for_spec(&spec, None);
        Ok(Device {
            nbd,
            rbd: RbdTarget::for_spec(&spec),
            id,
            spec,
            state,
            shm,
            shm_fd,
            target_fd,
            direct,
            spare: Spare::None,
            recoveries: 0,
            last_recovery_ms: None,
            last_recovery_reason: None,
            last_recovered_at: None,
            worker_restarts: 0,
            restart_budget: RestartBudget::default(),
            cluster_wait: ClusterWait::default(),
            standby_schedule: StandbySchedule::default(),
            death_seen: None,
            hang: HangWatch::new(id),
            hang_policy: HangPolicy::default(),
            server_silent: false,
            generation,
        })
    }

    /// When the next standby is due to start, if one waits.
    pub fn standby_due(&self) -> Option<Instant> {
        self.standby_schedule.due()
    }

    /// Starts the standby a recovery left for later, once it is due.
    /// Leaves the next standby to the loop, which starts it when few others are
    /// starting.
    pub fn schedule_standby(&mut self) {
        self.standby_schedule.due_now();
    }

    pub fn refill_standby_if_due(&mut self, ctx: &Context, now: Instant) {
        if self.standby_schedule.take_due(now) {
            self.refill_standby(ctx);
        }
    }

    /// The device's recent recoveries, for the recovery policy.
    pub fn restart_budget_mut(&mut self) -> &mut RestartBudget {
        &mut self.restart_budget
    }

    pub fn shm(&self) -> &ShmRegion {
        &self.shm
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// The device's description, its zero copy and queue count as decided at creation.
    /// Whether the device's nbd export is read-only, as its server last said (false
    /// for other targets, and for an adopted nbd device until it connects again).
    pub fn export_read_only(&self) -> bool {
        self.nbd.as_ref().and_then(NbdTarget::info).is_some_and(ExportInfo::read_only)
    }

    pub fn spec(&self) -> &DeviceSpec {
        &self.spec
    }

    pub fn state(&self) -> &DeviceState {
        &self.state
    }

    /// What `status` says of the device beyond its state: its state's note, else what
    /// its worker waits for when no I/O has completed for a while (its NBD server, its
    /// Ceph cluster: what ublkd cannot hurry, and does not count as a hang).
    pub fn status_note(&self) -> Option<String> {
        if let Some(note) = self.state.note() {
            return Some(note.to_owned());
        }
        let quiet = self.hang_policy.backend_wait()?;
        let what = match &self.spec.target {
            ublkd_config::TargetSpec::Nbd { uri, .. } => format!("its NBD server ({uri})"),
            ublkd_config::TargetSpec::Rbd(rbd) => {
                format!("the Ceph cluster (image {}): an OSD or monitor away", rbd.image)
            }
            _ => "its backing file".to_owned(),
        };
        Some(format!(
            "no I/O completed for {:.0} s: the worker waits for {what}; I/O is held, not failed",
            quiet.as_secs_f64()
        ))
    }

    /// The worker serving the device, if one does.
    pub fn worker(&self) -> Option<&Worker> {
        self.state.worker()
    }

    /// The worker standing by for the next recovery, if one does.
    pub fn standby(&self) -> Option<&Worker> {
        match &self.spare {
            Spare::StandingBy(worker) => Some(worker),
            _ => None,
        }
    }

    /// The standby on its way, if one is.
    pub fn starting(&self) -> Option<&Worker> {
        match &self.spare {
            Spare::Starting(worker) => Some(worker),
            _ => None,
        }
    }

    /// The standby on its way, taken out of the device, if there is one.
    fn take_starting(&mut self) -> Option<Worker> {
        match std::mem::take(&mut self.spare) {
            Spare::Starting(worker) => Some(worker),
            other => {
                self.spare = other;
                None
            }
        }
    }

    /// A worker a recovery killed and waits for the end of, if there is one.
    pub fn dying(&self) -> Option<&Worker> {
        self.state.dying()
    }

    /// A recovery's new worker being handed the device, whose answer the loop awaits.
    pub fn activating(&self) -> Option<&Worker> {
        self.state.activating().map(Activating::worker)
    }

    /// Whether the loop must look at the device on its next turn even if nothing wakes
    /// it: a standby starting or due to start, a recovery under way, a killed worker
    /// not yet ended. A device without any of these changes only when a worker of it
    /// ends (its pidfd wakes the loop), on the tick's hang scan, or by a request.
    pub fn needs_turns(&self) -> bool {
        self.starting().is_some()
            || self.dying().is_some()
            || self.standby_schedule.due().is_some()
            || self.release_due().is_some()
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

    /// When the last counted recovery put the device back LIVE.
    pub fn last_recovered_at(&self) -> Option<SystemTime> {
        self.last_recovered_at
    }

    /// How many times the serving worker exited or was killed as hung.
    pub fn worker_restarts(&self) -> u64 {
        self.worker_restarts
    }

    /// Moves the device to `to` if the state machine allows it
    /// ([`crate::device_state::StateKind::may_become`]); a refusal leaves the state
    /// as it is and is logged. Either way no worker is let go still running: those the
    /// old state held (a dead one, or one a recovery gave up) or, on a refusal, those
    /// `to` holds are killed (and reaped once they end).
    pub fn transition(&mut self, to: DeviceState) -> Result<(), TransitionError> {
        if let Err(e) = self.may_become(to.kind()) {
            kill_all(to.into_workers());
            return Err(e);
        }
        let old = std::mem::replace(&mut self.state, to);
        // Releasing to LIVE is a recovery's end and nothing else (fail-io ends in
        // FailingIo): the one place that sees it without the recovery code knowing.
        if old.kind() == StateKind::Releasing && self.state.kind() == StateKind::Live {
            self.last_recovered_at = Some(SystemTime::now());
        }
        kill_all(old.into_workers());
        Ok(())
    }

    /// Moves the device to a state of kind `to`, made by `make` from the old one (so
    /// that a worker moves from one to the other), if the state machine allows it; a
    /// refusal leaves the state as it is, and is logged.
    fn transition_with(
        &mut self,
        to: StateKind,
        make: impl FnOnce(DeviceState) -> DeviceState,
    ) -> Result<(), TransitionError> {
        self.may_become(to)?;
        let old = std::mem::replace(&mut self.state, DeviceState::Recovering);
        self.state = make(old);
        Ok(())
    }

    /// Whether the device may go to a state of kind `to`; a refusal is logged.
    fn may_become(&self, to: StateKind) -> Result<(), TransitionError> {
        self.state.check(self.id, to).inspect_err(|e| {
            tracing::error!(dev_id = self.id, event = "illegal_transition", "{e}");
        })
    }

    /// Serves the device with `worker`, LIVE or (with `failing`) failing every I/O for
    /// that cause. Refused, the worker is killed.
    fn serve(&mut self, worker: Worker, failing: Option<String>) -> Result<(), TransitionError> {
        self.transition(match failing {
            Some(cause) => DeviceState::FailingIo { cause, worker },
            None => DeviceState::Live { worker },
        })
    }

    /// [`Self::transition`] where a refusal needs nothing more than its log line.
    fn enter(&mut self, to: DeviceState) {
        let _refused_and_logged = self.transition(to);
    }

    /// Leaves the device QUIESCED, without a worker, until an operator recovers it.
    pub fn wait_for_operator(&mut self, cause: String) {
        self.enter(DeviceState::WaitingForOperator { cause });
    }
}

/// A device's next worker, started ahead of need: at most one at a time.
#[derive(Debug, Default)]
enum Spare {
    #[default]
    None,
    /// Sent its setup, not yet standing by. The loop watches its control socket, so
    /// starting one never blocks the supervisor.
    Starting(Worker),
    /// Set up and waiting for a device to be handed.
    StandingBy(Worker),
}

impl Spare {
    /// The spare worker, starting or standing by.
    fn worker(&self) -> Option<&Worker> {
        match self {
            Spare::None => None,
            Spare::Starting(worker) | Spare::StandingBy(worker) => Some(worker),
        }
    }

    /// Kills the spare (reaped once it ends, by `reap_lingering`) if `unfit` says so.
    fn end_if(&mut self, unfit: impl FnOnce(&Worker) -> bool) {
        if self.worker().is_some_and(unfit)
            && let Some(worker) = self.take()
        {
            worker.kill();
        }
    }

    fn take(&mut self) -> Option<Worker> {
        match std::mem::take(self) {
            Spare::None => None,
            Spare::Starting(worker) | Spare::StandingBy(worker) => Some(worker),
        }
    }
}

/// Kills `workers` (reaped once they end, by `reap_lingering`, not waited for).
fn kill_all(workers: Vec<Worker>) {
    for worker in workers {
        worker.kill();
    }
}

/// `mutex`'s guard, also after a panic elsewhere (what it guards stays consistent: each
/// holder only pushes or pops one element).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
