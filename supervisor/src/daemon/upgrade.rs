//! `ublkctl upgrade`: each device handed over to a worker from the binary on disk,
//! without holding up the loop. A new worker is started beside the serving one (the
//! device keeps its worker and standby until the new one stands by; if it fails,
//! nothing changes), then a planned recovery moves the device onto it, which stalls
//! its I/O like any recovery (held, re-issued, not failed) and spends none of its
//! restart budget. Not the kernel's QUIESCE_DEV: on a BATCH_IO device (Linux 7.2) it
//! fails the I/O that arrives during the hand-off with EIO, and 6.12 has no QUIESCE.
//!
//! The worker's start (0.1-1 s under emulation) and the recovery are steps the loop
//! takes on later turns ([`PendingUpgrade`]): clients, other devices' recoveries and
//! systemd's watchdog are served meanwhile. The answer comes once each device is LIVE
//! on its new worker, or at the latest [`UPGRADE_SETTLE`] after its hand-over with
//! where it stands (a resize, which needs the device LIVE on its new worker, waits as
//! long as a worker may take to start); a recovery held up outside ublkd (a server away, a slow release) is
//! answered at once, for the loop to finish by itself.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use ublkd_config::format_size;
use ublkd_proto::msg::{CtlResponse, ErrorKind, Failure, UpgradeOutcome};

use super::Daemon;
use super::underway::{Standing, Underway, Wake};
use crate::control::Token;
use crate::device::{Recovery, ResizePlan};
use crate::device_state::StateKind;
use crate::worker::Worker;

/// How long an upgrade's answer waits for a recovery that goes on (an nbd device
/// connecting afresh) once the device was handed over.
const UPGRADE_SETTLE: Duration = Duration::from_secs(5);

/// An `ublkctl upgrade` under way: the devices still to upgrade, in order, the one
/// being upgraded, and the outcomes so far (the answer lists them all). Or the hand-off
/// of an `ublkctl resize` (`resize`: its one device's, see [`Daemon::begin_resize`]),
/// which moves the device onto a worker set up with its new size the same way.
#[derive(Debug)]
pub(super) struct PendingUpgrade {
    /// Whom to answer; `None` for a resize ublkd began itself (an rbd image that grew).
    token: Option<Token>,
    queue: VecDeque<u32>,
    current: Option<(u32, Step)>,
    outcomes: Vec<UpgradeOutcome>,
    resize: Option<ResizePlan>,
}

#[derive(Debug)]
enum Step {
    /// The new worker is starting; the old one serves.
    Starting { worker: Box<Worker>, deadline: Instant },
    /// Handed over: a recovery onto the new worker goes on.
    Settling { until: Instant },
}

impl Underway for PendingUpgrade {
    /// The new worker's control socket, to poll, and when the step is due anyway.
    fn wake(&self) -> Wake {
        match &self.current {
            Some((_, Step::Starting { worker, deadline })) => {
                Wake { fd: Some(worker.control().as_raw_fd()), at: Some(*deadline) }
            }
            Some((_, Step::Settling { until })) => Wake::at(*until),
            // The next device begins on the next turn.
            None => Wake::at(Instant::now()),
        }
    }

    fn progress(&self, _now: Instant) -> Standing {
        let after = match self.queue.len() {
            0 => String::new(),
            n => format!(" ({n} more device(s) to upgrade after it)"),
        };
        let being = match self.resize {
            Some(plan) => format!("being resized to {}", format_size(plan.to)),
            None => "being upgraded".to_string(),
        };
        match &self.current {
            Some((id, Step::Starting { worker, .. })) => Standing {
                devices: vec![*id],
                what: format!(
                    "{being}: its new worker (pid {}) is starting, the old one serves{after}",
                    worker.pid()
                ),
            },
            Some((id, Step::Settling { .. })) => Standing {
                devices: vec![*id],
                what: format!("{being}: handed to its new worker{after}"),
            },
            None => Standing { devices: Vec::new(), what: format!("upgrading{after}") },
        }
    }
}

impl Daemon {
    /// `ublkctl upgrade` of `ids`: begun now, answered by [`Self::advance_upgrades`].
    pub(super) fn begin_upgrade(&mut self, token: Token, ids: Vec<u32>) {
        let queue = ids.into_iter().collect();
        self.pending_upgrades.push(PendingUpgrade {
            token: Some(token),
            queue,
            current: None,
            outcomes: Vec::new(),
            resize: None,
        });
        self.advance_upgrades(false);
    }

    /// `ublkctl resize`: checked, its first half done ([`Device::begin_resize`]), and
    /// the device handed to a worker set up with the new size as an upgrade hands it;
    /// answered once that is done and the kernel told ([`Self::resize_answer`]). The
    /// answer now if it is refused or there is nothing to do.
    ///
    /// [`Device::begin_resize`]: crate::device::Device::begin_resize
    pub(super) fn begin_resize(
        &mut self,
        token: Option<Token>,
        id: u32,
        size_bytes: u64,
        allow_shrink: bool,
    ) -> Option<CtlResponse> {
        let error = |message: String| Some(CtlResponse::Error { message });
        // Not now: the same resize may be asked again once the device is LIVE.
        let not_now = |message: String| Some(Failure::new(ErrorKind::TryAgain, message).into());
        let Some(dev) = self.devices.get(id) else {
            return self.selected(Some(id)).err().map(CtlResponse::from);
        };
        let state = dev.state();
        if state.kind() != StateKind::Live || !state.has_worker() || state.failing_io() {
            return not_now(format!(
                "device {id} is not LIVE ({}): resize it once it is served again",
                state.kind()
            ));
        }
        let busy = |p: &PendingUpgrade| {
            p.queue.contains(&id) || p.current.as_ref().is_some_and(|(c, _)| *c == id)
        };
        if self.pending_upgrades.iter().any(busy) {
            return not_now(format!(
                "device {id} is being upgraded or resized: resize it once that is done"
            ));
        }
        let plan = match dev.plan_resize(&self.ctx, size_bytes, allow_shrink) {
            Ok(Some(plan)) => plan,
            Ok(None) => {
                let message = format!("device {id} is {} already", format_size(size_bytes));
                return Some(CtlResponse::Resized { id, size_bytes, message });
            }
            Err(e) => return Some(Failure::new(e.kind(), e.to_string()).into()),
        };
        let dev = self.devices.get_mut(id).expect("looked up above");
        if let Err(e) = dev.begin_resize(&self.ctx, plan) {
            tracing::error!(dev_id = id, event = "resize_failed", "resize: {e}");
            return error(e.to_string());
        }
        self.pending_upgrades.push(PendingUpgrade {
            token,
            queue: VecDeque::from([id]),
            current: None,
            outcomes: Vec::new(),
            resize: Some(plan),
        });
        self.advance_upgrades(false);
        None
    }

    /// The answer to a resize whose hand-off ended with `outcomes`: the kernel told of
    /// the new size if the device is LIVE on a worker set up with it.
    fn resize_answer(&mut self, plan: ResizePlan, outcomes: &[UpgradeOutcome]) -> CtlResponse {
        let id = plan.id;
        let handed = outcomes.iter().any(|o| o.id == id && o.upgraded);
        let live = self.devices.get(id).is_some_and(|dev| dev.state().kind() == StateKind::Live);
        let result = match self.devices.get_mut(id) {
            Some(dev) if handed && live => {
                dev.finish_resize(&self.ctx, plan).map_err(|e| e.to_string())
            }
            _ => Err(outcomes.iter().map(|o| o.message.clone()).collect::<Vec<_>>().join("; ")),
        };
        match result {
            Ok(()) => CtlResponse::Resized {
                id,
                size_bytes: plan.to,
                message: format!(
                    "device {id} resized from {} to {}",
                    format_size(plan.from),
                    format_size(plan.to)
                ),
            },
            Err(why) => {
                tracing::error!(dev_id = id, event = "resize_failed", "resize: {why}");
                let message = format!(
                    "device {id}: not resized: its new size ({}) is recorded, but it was not \
                     handed to a worker serving that size ({why}); run the same `ublkctl \
                     resize` again once the device is LIVE",
                    format_size(plan.to)
                );
                Failure::new(ErrorKind::TryAgain, message).into()
            }
        }
    }

    /// Moves every upgrade under way on by the steps that are ready, and answers those
    /// done. `stopping`: ublkd stops; each is answered now with where it stands.
    pub(super) fn advance_upgrades(&mut self, stopping: bool) {
        for mut pending in std::mem::take(&mut self.pending_upgrades) {
            loop {
                let (id, step) = match pending.current.take() {
                    Some(current) => current,
                    None => match pending.queue.pop_front() {
                        Some(id) if stopping => {
                            let message = format!("device {id}: not upgraded: ublkd is stopping");
                            pending.outcomes.push(UpgradeOutcome { id, upgraded: false, message });
                            continue;
                        }
                        Some(id) => match self.start_upgrade(id) {
                            Ok(step) => (id, step),
                            Err(outcome) => {
                                pending.outcomes.push(outcome);
                                continue;
                            }
                        },
                        None => break,
                    },
                };
                // A resize is answered only once its device is LIVE on a worker that
                // serves the new size, so it waits for the recovery as long as a worker
                // may take to start (an rbd worker fences its predecessor first: 5 to
                // 10 s on a busy machine), not an upgrade's few seconds.
                let settle = match pending.resize {
                    Some(_) => UPGRADE_SETTLE.max(self.ctx.worker_ready_timeout),
                    None => UPGRADE_SETTLE,
                };
                match self.upgrade_step(id, step, stopping, settle) {
                    Ok(step) => {
                        pending.current = Some((id, step));
                        break;
                    }
                    Err(outcome) => pending.outcomes.push(outcome),
                }
            }
            if pending.current.is_some() || !pending.queue.is_empty() {
                self.pending_upgrades.push(pending);
                continue;
            }
            let response = match pending.resize {
                Some(plan) => self.resize_answer(plan, &pending.outcomes),
                _ => CtlResponse::Upgraded(pending.outcomes),
            };
            match pending.token {
                Some(token) => self.control.respond(token, &response, Instant::now()),
                // A resize ublkd began itself: `resize_answer` logged a failure.
                None => {
                    if let CtlResponse::Resized { message, .. } = &response {
                        tracing::info!("{message}, as its rbd image did");
                    }
                }
            }
        }
    }

    /// The tick's look at the LIVE rbd devices' workers: each device whose image grew
    /// (`rbd resize` elsewhere, [`crate::device::Device::image_resized`]) is resized to
    /// it as `ublkctl resize` would do it, answering no one.
    pub(super) fn follow_image_sizes(&mut self) {
        let grown: Vec<(u32, u64)> = self
            .devices
            .values()
            .filter_map(|dev| dev.image_resized().map(|size| (dev.id(), size)))
            .collect();
        for (id, size) in grown {
            tracing::info!(
                dev_id = id,
                event = "rbd_image_resized",
                "its rbd image grew to {}: resizing the device to it",
                format_size(size)
            );
            if let Some(CtlResponse::Error { message } | CtlResponse::Failed { message, .. }) =
                self.begin_resize(None, id, size, false)
            {
                tracing::warn!(
                    dev_id = id,
                    event = "resize_failed",
                    "not resized to its image's new size: {message}"
                );
            }
        }
    }

    /// Starts the new worker of device `id`'s upgrade.
    fn start_upgrade(&mut self, id: u32) -> Result<Step, UpgradeOutcome> {
        let binary = self.ctx.worker_binary.display().to_string();
        let outcome = |message| UpgradeOutcome { id, upgraded: false, message };
        let Some(dev) = self.devices.get_mut(id) else {
            return Err(outcome(format!("device {id}: no longer served by ublkd")));
        };
        if !dev.state().has_worker() || dev.state().failing_io() {
            return Err(outcome(format!(
                "device {id}: not upgraded: it is not served ({}); `ublkctl recover {id}` \
                 serves it with the binary on disk",
                dev.state().kind()
            )));
        }
        match dev.start_renewed_standby(&self.ctx) {
            Ok(worker) => Ok(Step::Starting {
                worker: Box::new(worker),
                deadline: Instant::now() + self.ctx.worker_ready_timeout,
            }),
            Err(e) => {
                tracing::error!(dev_id = id, event = "upgrade_failed", "upgrade: {e}");
                Err(outcome(format!(
                    "device {id}: not upgraded: the new worker ({binary}) did not start: {e}; \
                     the old worker serves on"
                )))
            }
        }
    }

    /// Takes device `id`'s upgrade on from `step` if it can: the next step to wait on,
    /// or the outcome. `settle`: how long the answer waits for the recovery after the
    /// hand-over.
    fn upgrade_step(
        &mut self,
        id: u32,
        step: Step,
        stopping: bool,
        settle: Duration,
    ) -> Result<Step, UpgradeOutcome> {
        let binary = self.ctx.worker_binary.display().to_string();
        let failed = |message| UpgradeOutcome { id, upgraded: false, message };
        let now = Instant::now();
        match step {
            Step::Starting { worker, deadline } => {
                let Some(dev) = self.devices.get_mut(id) else {
                    worker.kill();
                    return Err(failed(format!("device {id}: no longer served by ublkd")));
                };
                if stopping {
                    worker.kill();
                    return Err(failed(format!("device {id}: not upgraded: ublkd is stopping")));
                }
                let answered = worker.has_answered();
                if !answered && now < deadline {
                    return Ok(Step::Starting { worker, deadline });
                }
                if let Err(e) = dev.renew_standby(&self.ctx, *worker, answered) {
                    tracing::error!(dev_id = id, event = "upgrade_failed", "upgrade: {e}");
                    return Err(failed(format!(
                        "device {id}: not upgraded: the new worker ({binary}) did not start: \
                         {e}; the old worker serves on"
                    )));
                }
                dev.forget_death();
                match dev.recover(&self.ctx, "ublkctl upgrade") {
                    Ok(Recovery::Done(_)) => Err(self.upgrade_outcome(id)),
                    Ok(Recovery::Waiting) => Ok(Step::Settling { until: now + settle }),
                    Err(e) => {
                        dev.wait_for_operator(format!(
                            "upgrade failed: {e} (after: ublkctl upgrade)"
                        ));
                        Err(failed(format!("device {id}: upgrade failed: {e}")))
                    }
                }
            }
            Step::Settling { until } => {
                let releasing = self
                    .devices
                    .get(id)
                    .is_some_and(|dev| dev.state().kind() == StateKind::Releasing);
                if releasing && now < until && !stopping && !self.recovery_held_up(id) {
                    return Ok(Step::Settling { until });
                }
                Err(self.upgrade_outcome(id))
            }
        }
    }

    /// Where device `id` stands once its upgrade's recovery is done, or was waited for.
    fn upgrade_outcome(&self, id: u32) -> UpgradeOutcome {
        let binary = self.ctx.worker_binary.display().to_string();
        let outcome = |upgraded, message| UpgradeOutcome { id, upgraded, message };
        let Some(dev) = self.devices.get(id) else {
            return outcome(false, format!("device {id}: no longer served by ublkd"));
        };
        match dev.state().kind() {
            StateKind::Live => {
                let stall = dev.last_recovery_ms().unwrap_or_default();
                tracing::info!(
                    dev_id = id,
                    event = "upgraded",
                    stall_ms = stall,
                    "upgraded to {binary}"
                );
                outcome(true, format!("device {id}: upgraded to {binary} (stall {stall} ms)"))
            }
            StateKind::Releasing => outcome(
                true,
                format!("device {id}: handed to {binary}, {}", self.recovery_wait(id)),
            ),
            _ => {
                let note = dev.state().note().unwrap_or("no reason given");
                outcome(false, format!("device {id}: upgrade failed: {note}"))
            }
        }
    }
}
