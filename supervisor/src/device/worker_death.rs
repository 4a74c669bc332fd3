//! How a device learns that its worker is gone or hung: the active worker's exit seen
//! and reaped, with what it means for the next recovery ([`WorkerDeath`]), a standby's
//! exit, the hang watch's verdict (and an nbd worker whose server answers nothing),
//! and the kill that follows; and an rbd recovery whose new workers cannot serve while
//! the Ceph cluster is away, set to try again after a backoff
//! ([`Device::wait_for_cluster`]). What to do about each is [`crate::recovery`]'s
//! decision.

use std::time::{Duration, Instant};

use super::{ClusterWait, Device, DeviceError, Spare};
use crate::device_state::{DeviceState, Release, StateKind, TransitionError};

/// How a device's active worker died.
#[derive(Debug)]
pub struct WorkerDeath {
    /// The exit, as the log says it (`worker PID killed by signal 9`).
    pub how: String,
    /// Why the worker was killed, if it was found hung.
    pub hang: Option<String>,
    /// It ended because its target's connection broke (an NBD server went away): the
    /// server's doing, not a crash, so it does not count against the restart budget.
    pub backend_lost: bool,
}

impl WorkerDeath {
    /// The recovery's reason: the hang that got the worker killed, else its exit.
    pub fn reason(self) -> String {
        self.hang.unwrap_or(self.how)
    }
}

impl Device {
    /// Records why the active worker is about to be killed as hung.
    pub fn mark_hung(&mut self, cause: String) {
        let _refused_and_logged = self.transition_with(StateKind::Hung, |old| match old {
            DeviceState::Live { worker }
            | DeviceState::Hung { worker, .. }
            | DeviceState::FailingIo { worker, .. } => DeviceState::Hung { cause, worker },
            // Not reached: only a state with a worker may become Hung.
            other => other,
        });
    }

    /// If the active worker exited, reaps it and says how, and leaves the device
    /// `Recovering`; `seen` is when its death became visible (its pidfd readable), from
    /// which the next recovery counts its stall.
    pub fn worker_exited(&mut self, seen: Instant) -> Option<WorkerDeath> {
        let w = self.state.worker_mut()?;
        let how = w.exited()?;
        // A connection that answers nothing is as lost as one that broke.
        let backend_lost = w.lost_backend() || std::mem::take(&mut self.server_silent);
        let pid = w.pid();
        let served_for = w.served_for();
        w.release_device();
        self.worker_restarts += 1;
        self.death_seen = Some(seen);
        let hang = match &self.state {
            DeviceState::Hung { cause, .. } => Some(cause.clone()),
            _ => None,
        };
        self.enter(DeviceState::Recovering);
        if let Some(target) = &mut self.nbd {
            target.after_death(self.id, backend_lost, served_for, seen);
        }
        Some(WorkerDeath { how: format!("worker {pid} {how}"), hang, backend_lost })
    }

    /// Forgets when the last worker's death was seen: the next recovery counts its
    /// stall from its own start.
    pub fn forget_death(&mut self) {
        self.death_seen = None;
    }

    /// If the standby exited, reaps it and says how.
    pub fn standby_exited(&mut self) -> Option<String> {
        let Spare::StandingBy(w) = &mut self.spare else { return None };
        let how = w.exited()?;
        let pid = w.pid();
        self.spare = Spare::None;
        Some(format!("standby worker {pid} {how}"))
    }

    /// Why the worker is hung at `now`, with the kernel's numbers of the scan's `disks`,
    /// if it is (see [`crate::hang`] and [`super::HangPolicy`]).
    ///
    /// An nbd worker that waits for its server (not hung: the server is slow) is
    /// replaced once no request has completed for `request_timeout`
    /// (`recovery.nbd_request_timeout_secs`): its connection counts as broken.
    pub fn hung(
        &mut self,
        now: Instant,
        disks: &crate::hang::DiskStats,
        timeout: Duration,
        request_timeout: Option<Duration>,
    ) -> Option<String> {
        let pid = self.worker()?.pid();
        let verdict = self.hang.check(now, disks, &self.shm, pid, timeout);
        let hung = self.hang_policy.judge(self.id, pid, verdict);
        if hung.is_some() {
            return hung;
        }
        let cause =
            self.nbd.as_ref()?.silent_server(self.hang_policy.backend_wait()?, request_timeout?)?;
        self.server_silent = true;
        Some(cause)
    }

    /// Whether the hang watch must look at the device on every tick (see
    /// [`crate::hang::HangWatch::watched`]).
    pub fn hang_watched(&self) -> bool {
        self.worker().is_some() && self.hang.watched()
    }

    /// Whether the worker is being replaced because its NBD server answers nothing.
    pub fn server_silent(&self) -> bool {
        self.server_silent
    }

    /// False while the worker holds I/O and none completes for longer than `limit` at
    /// `now` (the loop counts such devices; the watchdog does not wait for them). Devices
    /// without a worker (waiting for an operator or a release) and idle ones count as
    /// fine: they are not wedged, they are waiting.
    pub fn progressing(&self, now: Instant, limit: Duration) -> bool {
        self.worker().is_none() || self.hang.quiet_for(now) <= limit
    }

    /// Kills the active worker (its death is then handled like any other).
    pub fn kill_worker(&mut self) {
        if let Some(w) = self.worker() {
            w.kill();
        }
    }

    /// Whether a recovery that failed with `e` is an rbd recovery whose new worker could
    /// not serve (it did not stand by, or did not take the device, in time; it failed
    /// or was lost): what a Ceph cluster that is away does to every new worker, for as
    /// long as it is away. Such a recovery waits for the cluster
    /// ([`Self::wait_for_cluster`]) rather than for an operator or the restart budget.
    pub fn waits_for_cluster_after(&self, e: &DeviceError) -> bool {
        self.rbd.is_some()
            && matches!(e, DeviceError::Worker { .. })
            && self.state.kind() == StateKind::Recovering
    }

    /// What the device's wait for its Ceph cluster stands at (see [`ClusterWait`]).
    pub fn cluster_wait_mut(&mut self) -> &mut ClusterWait {
        &mut self.cluster_wait
    }

    /// An rbd recovery's new worker could not serve (`error`; the recovery began for
    /// `reason`): the recovery tries again once the backoff has passed (the loop comes
    /// back at the release's next try), its I/O held meanwhile, and status says that it
    /// waits for the cluster and why. Returns the wait until the next try.
    pub fn wait_for_cluster(
        &mut self,
        reason: &str,
        error: &DeviceError,
        retry_max: Duration,
    ) -> Result<Duration, TransitionError> {
        let now = Instant::now();
        let wait = self.cluster_wait.failed(now, reason, retry_max);
        let (since, first_reason) = self.cluster_wait.since().unwrap_or((now, reason));
        let image = self.rbd.as_ref().map(|t| t.image()).unwrap_or_default();
        let note = format!(
            "waiting for the Ceph cluster (image {image}) for {} s: the recovery's new worker \
             could not serve ({error}); its I/O is held, and ublkd tries again, every {} s at \
             most, outside the restart budget",
            now.saturating_duration_since(since).as_secs(),
            retry_max.as_secs()
        );
        tracing::warn!(
            dev_id = self.id,
            event = "rbd_cluster_wait",
            "{note} (try {} failed; the next in {} s)",
            self.cluster_wait.failures(),
            wait.as_secs_f64()
        );
        // Counted from the death that began the wait: the recovery's stall is the outage.
        let mut release =
            Release::new(format!("{first_reason}; then the Ceph cluster was away"), None, since);
        release.next_try = now + wait;
        release.slow = Some(note);
        self.transition(DeviceState::Releasing(Box::new(release)))?;
        Ok(wait)
    }
}
