//! A device's user recovery, the kernel's way of replacing its worker: a standby
//! standing by (one still starting is waited for by the loop, not here), the old
//! worker's `/dev/ublkcN` released (START_USER_RECOVERY answers EBUSY until then), the
//! standby activated, END_USER_RECOVERY (on a thread of its own, [`KernelCall`]: it waits
//! for the new worker to fetch its tags). The I/O is held meanwhile, not failed.

use std::time::{Duration, Instant};

use super::{Context, Device, DeviceError, RELEASE_QUICK, RELEASE_SLOW, Recovery, Spare};

use crate::device_state::{DeviceState, Release, StateKind};
use crate::kernel_call::{KernelCall, KernelCallError};
use crate::nbd::target::Readiness;
use crate::worker::{Activating, Worker};
use ublkd_proto::ctrl::CtrlCmd;
use ublkd_proto::msg::{Activation, TargetSetup};

/// How often the loop looks whether a killed worker has ended, if its pidfd has not
/// woken it first.
const DYING_POLL: Duration = Duration::from_millis(50);
/// How long END_USER_RECOVERY runs before status says that it waits for the worker's
/// tags (see [`Device::continue_ending`]).
const ENDING_NOTE_AFTER: Duration = Duration::from_secs(5);
/// How often the loop looks whether a recovery's standby stands by (its socket also
/// wakes the loop, but the recovery goes on only once due).
const STANDBY_POLL: Duration = Duration::from_millis(10);

impl Device {
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
        let seen = self.death_seen.take().unwrap_or_else(Instant::now);
        // A worker that has the device (an operator's recover, an upgrade, a recovery
        // begun again) must go first: killed now, its end waited for by the loop
        // (`dying`), not here.
        let mut old = Vec::new();
        if self.state.kind() != StateKind::Recovering {
            self.transition_with(StateKind::Recovering, |state| {
                old = state.into_workers();
                DeviceState::Recovering
            })?;
        }
        for worker in &old {
            worker.kill();
        }
        let mut release = Release::new(reason.to_string(), fail_io, seen);
        // At most one: a state holds one worker that has the device at a time.
        release.dying = old.pop();
        self.transition(DeviceState::Releasing(Box::new(release)))?;
        self.continue_recovery(ctx)
    }

    /// When a recovery waiting for the kernel's release tries again, if one waits: at
    /// once if the worker it killed has ended.
    pub fn release_due(&self) -> Option<Instant> {
        match &self.state {
            // Its start is past: due on any turn from now on.
            DeviceState::Releasing(r) if r.dying.as_ref().is_some_and(Worker::has_exited) => {
                Some(r.started)
            }
            // Its new worker answered its activation: due at once.
            DeviceState::Releasing(r)
                if r.activating.as_ref().is_some_and(|a| a.due(Instant::now())) =>
            {
                Some(r.started)
            }
            DeviceState::Releasing(r) => Some(r.next_try),
            _ => None,
        }
    }

    /// Goes on with a recovery that waits for its standby to stand by
    /// ([`Self::standby_ready`]) or for the kernel to release the dead worker's
    /// `/dev/ublkcN` (START_USER_RECOVERY answers EBUSY until then): tries once, and
    /// leaves the next try to the loop ([`Self::release_due`]), never waiting here: every
    /// few milliseconds for the first [`RELEASE_QUICK`] (the release usually takes tens
    /// of milliseconds, and the stall should not wait long for a turn), then less and
    /// less often (a dead worker's write stuck in a slow backend). The device's I/O is
    /// held meanwhile, for as long as it takes. A recovery that fails leaves the device
    /// `Recovering`, for the recovery policy to decide on.
    pub fn continue_recovery(&mut self, ctx: &Context) -> Result<Recovery, DeviceError> {
        let id = self.id;
        if let DeviceState::Releasing(r) = &mut self.state {
            if let Some(call) = r.ending.take() {
                return self.continue_ending(call);
            }
            if let Some(activating) = r.activating.take() {
                return self.continue_activation(ctx, activating);
            }
            if let Some(old) = &r.dying {
                if !old.has_exited() {
                    r.next_try = Instant::now() + DYING_POLL;
                    return Ok(Recovery::Waiting);
                }
                if let Some(mut old) = r.dying.take() {
                    old.reap(Duration::ZERO);
                    old.release_device();
                }
            }
        }
        if !self.nbd_connected(ctx) {
            return Ok(Recovery::Waiting);
        }
        match self.standby_ready(ctx) {
            Ok(true) => {}
            Ok(false) => return Ok(Recovery::Waiting),
            Err(e) => {
                self.enter(DeviceState::Recovering);
                return Err(e);
            }
        }
        let DeviceState::Releasing(r) = &mut self.state else { return Ok(Recovery::Waiting) };
        match ctx.ctrl.start_user_recovery(id) {
            Ok(()) => {}
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
                // A short cap at first keeps the overshoot past a quick release
                // small; past RELEASE_QUICK the loop tries less and less often.
                r.delay = if waited < RELEASE_QUICK {
                    (r.delay * 2).clamp(Duration::from_micros(400), Duration::from_millis(4))
                } else {
                    (r.delay * 2).clamp(Duration::from_millis(5), Duration::from_millis(100))
                };
                r.next_try = now + r.delay;
                return Ok(Recovery::Waiting);
            }
            Err(e) => {
                self.enter(DeviceState::Recovering);
                return Err(e.into());
            }
        }
        r.released = Some(r.started.elapsed());
        // `standby_ready` made sure of a standby (one that fails I/O, if that is what
        // the recovery serves with).
        match self.take_standby().and_then(|next| self.begin_activation(ctx, next)) {
            Ok(activating) => {
                if let DeviceState::Releasing(r) = &mut self.state {
                    r.next_try = activating.deadline();
                    r.activating = Some(activating);
                } else {
                    // Not reached: the state is left only by this recovery.
                    activating.into_worker().kill();
                }
                Ok(Recovery::Waiting)
            }
            Err(e) => {
                self.enter(DeviceState::Recovering);
                Err(e)
            }
        }
    }

    /// Goes on with a recovery whose new worker is being handed the device: once it
    /// has answered (or its time is up), ends the recovery.
    fn continue_activation(
        &mut self,
        ctx: &Context,
        activating: Activating,
    ) -> Result<Recovery, DeviceError> {
        if !activating.due(Instant::now()) {
            if let DeviceState::Releasing(r) = &mut self.state {
                r.next_try = activating.deadline();
                r.activating = Some(activating);
            }
            return Ok(Recovery::Waiting);
        }
        let id = self.id;
        let begun = self.end_activation(ctx, activating).and_then(|(worker, activation)| {
            let limit = ctx.worker_ready_timeout;
            KernelCall::begin(CtrlCmd::EndUserRecovery, id, worker, activation, limit)
                .map_err(|source| DeviceError::KernelCall { id, source })
        });
        match begun {
            Ok(call) => {
                if let DeviceState::Releasing(r) = &mut self.state {
                    r.next_try = call.next_look(Instant::now());
                    r.ending = Some(Box::new(call));
                }
                // Most often it has ended already.
                self.continue_recovery(ctx)
            }
            Err(e) => {
                self.enter(DeviceState::Recovering);
                Err(e)
            }
        }
    }

    /// Goes on with a recovery whose END_USER_RECOVERY runs: once it has ended (or its
    /// deadline passed, its worker killed), the device is served, or the recovery failed.
    /// Status says what it waits for meanwhile.
    fn continue_ending(&mut self, mut call: Box<KernelCall>) -> Result<Recovery, DeviceError> {
        let now = Instant::now();
        let Some((worker, activation, ended)) = call.poll(now) else {
            if let DeviceState::Releasing(r) = &mut self.state {
                r.next_try = call.next_look(now);
                // Said only once the call takes longer than any honest worker's: a
                // note makes the recovery held up (an `ublkctl recover` is answered at
                // once with it), and on a loaded emulated machine an honest worker's
                // tags took up to half a second.
                if now.saturating_duration_since(call.began()) > ENDING_NOTE_AFTER {
                    r.slow = Some(call.note());
                }
                r.ending = Some(call);
            }
            return Ok(Recovery::Waiting);
        };
        if let DeviceState::Releasing(r) = &mut self.state {
            r.slow = None;
        }
        let finished = self.finish_recovery(worker, &activation, call.began(), ended);
        if finished.is_err() {
            self.enter(DeviceState::Recovering);
        }
        finished.map(Recovery::Done)
    }

    /// For a recovery: whether the worker it hands the device to stands by, starting
    /// one if there is none. One still starting is not waited for here (0.1-1 s under
    /// emulation, for each of many devices after a mass death): the loop polls its
    /// socket and comes back every [`STANDBY_POLL`], so that other devices, clients and
    /// the watchdog are served meanwhile; the device's I/O stays held. A standby that
    /// fails, or does not stand by within `worker_ready_timeout` ([`Context`]), fails the recovery, as a
    /// wait for it did. A recovery that fails I/O wants a worker that fails I/O: a
    /// standby of the device's own target is ended, and one that fails I/O started.
    fn standby_ready(&mut self, ctx: &Context) -> Result<bool, DeviceError> {
        let DeviceState::Releasing(r) = &mut self.state else { return Ok(true) };
        let fail_io = r.fail_io.is_some();
        if fail_io {
            // A standby for the device's own target is no use to a recovery that fails
            // I/O: ended (reaped once it has, by `reap_lingering`), not waited for.
            self.spare.end_if(|w| w.target_setup() != TargetSetup::FailIo);
        }
        if matches!(self.spare, Spare::StandingBy(_)) {
            return Ok(true);
        }
        let since = *r.standby_wait.get_or_insert_with(Instant::now);
        if self.starting().is_none() {
            self.spare = Spare::Starting(self.spawn_worker(ctx, fail_io)?);
        }
        let answered = self.starting().is_some_and(Worker::has_answered);
        let timed_out = since.elapsed() >= ctx.worker_ready_timeout;
        if answered || timed_out {
            let Some(worker) = self.take_starting() else { return Ok(false) };
            let standby = if answered {
                self.await_standby(worker, Duration::from_millis(100))?
            } else {
                let source = crate::worker::WorkerError::Timeout {
                    pid: worker.pid(),
                    secs: ctx.worker_ready_timeout.as_secs(),
                };
                return Err(self.standby_failed(worker, source));
            };
            self.spare = Spare::StandingBy(standby);
            if let DeviceState::Releasing(r) = &mut self.state {
                r.standby_wait = None;
                r.standby_waited = since.elapsed();
            }
            return Ok(true);
        }
        if let DeviceState::Releasing(r) = &mut self.state {
            r.next_try = Instant::now() + STANDBY_POLL;
        }
        Ok(false)
    }

    /// Whether the device's recovery waits for its standby worker to start (see
    /// [`Self::standby_ready`]).
    pub fn awaiting_standby(&self) -> bool {
        matches!(&self.state, DeviceState::Releasing(r) if r.standby_wait.is_some())
    }

    /// For an nbd device in a recovery: whether it has the connections for its next
    /// worker, connecting if not ([`crate::nbd::target::NbdTarget::poll_ready`]). A server that is not
    /// there (restarting, say) is not a failed recovery: the device's I/O stays held and
    /// the loop tries again, for as long as it takes, or until `ctx.nbd_server_wait`
    /// (`recovery.nbd_server_wait_secs`): then the recovery goes on with a worker that
    /// fails every I/O, until `ublkctl recover`. Status says why. Other devices always
    /// have what they need.
    fn nbd_connected(&mut self, ctx: &Context) -> bool {
        let Some(target) = &mut self.nbd else { return true };
        // As many connections as the next worker was started for, or will be.
        let data_path = ublkd_proto::msg::DataPath::for_kernel(ctx.kernel_features);
        let want = match self.spare.worker() {
            Some(w) => match w.target_setup() {
                TargetSetup::Nbd { connections } => connections,
                _ => 1,
            },
            None => target.connections(&self.spec, data_path),
        };
        let DeviceState::Releasing(r) = &mut self.state else { return true };
        // A recovery that fails I/O needs no server.
        if r.fail_io.is_some() {
            return true;
        }
        let said = r.slow.as_deref();
        let (wait_limit, handshake) = (ctx.nbd_server_wait, ctx.nbd_handshake_timeout);
        match target.poll_ready(self.id, &self.spec, want, r.started, wait_limit, handshake, said) {
            Readiness::Ready { made } => {
                r.slow = None;
                // Fewer connections answered than the standby was made for: a worker
                // for as many as there are is started instead.
                self.spare.end_if(|w| {
                    matches!(w.target_setup(), TargetSetup::Nbd { connections }
                        if usize::from(connections) != made)
                });
                true
            }
            Readiness::Waiting { until, why } => {
                if why.is_some() {
                    r.slow = why;
                }
                r.next_try = until;
                false
            }
            Readiness::GaveUp { cause } => {
                r.fail_io = Some(cause);
                true
            }
        }
    }

    /// The rest of a recovery once its END_USER_RECOVERY, begun at `ending`, has ended
    /// with `ended`.
    fn finish_recovery(
        &mut self,
        mut worker: Worker,
        activation: &Activation,
        ending: Instant,
        ended: Result<(), KernelCallError>,
    ) -> Result<Duration, DeviceError> {
        let id = self.id;
        let (reason, fail_io, seen, started, standby_waited, released) = match &self.state {
            DeviceState::Releasing(r) => (
                r.reason.clone(),
                r.fail_io.clone(),
                r.seen,
                r.started,
                r.standby_waited,
                r.released.unwrap_or_default(),
            ),
            // Not reached: an activation is begun and continued only in a recovery.
            _ => {
                let now = Instant::now();
                (String::from("recovery"), None, now, now, Duration::ZERO, Duration::ZERO)
            }
        };
        let reason = reason.as_str();
        let activated = ending.saturating_duration_since(started);
        if let Err(source) = ended {
            worker.kill();
            let how = worker.reap(Duration::ZERO);
            let pid = worker.pid();
            tracing::error!(
                dev_id = id,
                worker_pid = pid,
                "END_USER_RECOVERY failed ({how}): {source}"
            );
            return Err(DeviceError::KernelCall { id, source });
        }
        let stall = seen.elapsed();
        let detect = started - seen;
        let pid = worker.pid();
        if let Some(cause) = fail_io {
            self.serve(worker, Some(cause))?;
            tracing::warn!(dev_id = id, "device LIVE, failing every I/O with EIO ({reason})");
            // The standby it replaced (one of the device's own target) comes back, for
            // the `ublkctl recover` that puts a real worker back.
            self.standby_schedule.after_recovery();
            return Ok(stall);
        }
        self.serve(worker, None)?;
        self.recoveries += 1;
        self.last_recovery_ms = Some(stall.as_millis() as u64);
        self.last_recovery_reason = Some(reason.to_string());
        tracing::info!(
            dev_id = id,
            worker_pid = pid,
            stall_ms = stall.as_millis() as u64,
            // Where the stall went: from the death seen to the recovery starting, its
            // standby still starting (standby), the kernel releasing the old file
            // (release: after the standby stood by), the standby mapping (map) and PREPing
            // (prep) as it says and the supervisor's round trip to it (activate), the
            // kernel going LIVE.
            detect_us = detect.as_micros() as u64,
            standby_us = standby_waited.as_micros() as u64,
            release_us = released.saturating_sub(standby_waited).as_micros() as u64,
            activate_us = (activated - released).as_micros() as u64,
            map_us = activation.map_us,
            prep_us = activation.prep_us,
            end_us = (stall - detect - activated).as_micros() as u64,
            event = "recovered",
            "device recovered ({reason})"
        );
        self.standby_schedule.after_recovery();
        Ok(stall)
    }
}
