//! Recovery policy: whether a device whose worker died is recovered or left for an
//! operator (the restart budget and `on_restart_limit`), what a hang verdict leads to,
//! and when a device's next standby worker starts.
//!
//! The mechanism is elsewhere: the kernel commands and workers of a recovery in
//! [`crate::device`], the heartbeat comparison in [`crate::hang`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ublkd_config::{OnRestartLimit, RecoveryConfig};

use crate::device::{Context, Device, DeviceError, Recovery};
use crate::event::Event;
use crate::hang::Verdict;
use crate::systemd::Notifier;

/// How long after a recovery the next standby worker starts: not while the requeued
/// I/O is being served, when on a small machine it would compete with the new worker
/// for CPU.
const STANDBY_DELAY: Duration = Duration::from_millis(300);
/// After a standby failed to start, the next try waits this long (no tight loop).
const STANDBY_RETRY: Duration = Duration::from_secs(2);
/// How much longer systemd is asked to wait while a recovery runs.
const RECOVERY_TIMEOUT_EXTENSION: Duration = Duration::from_secs(30);

/// A device's recent recoveries, against `recovery.restart_max` per
/// `recovery.restart_window`.
#[derive(Debug, Default)]
pub struct RestartBudget {
    restarts: VecDeque<Instant>,
}

impl RestartBudget {
    /// Records a recovery attempt against the budget of `max` in `window`; false when
    /// the budget is spent.
    pub fn take(&mut self, max: u32, window: Duration) -> bool {
        let now = Instant::now();
        while self.restarts.front().is_some_and(|t| now.duration_since(*t) > window) {
            self.restarts.pop_front();
        }
        if self.restarts.len() >= max as usize {
            return false;
        }
        self.restarts.push_back(now);
        true
    }

    /// Forgets past recoveries (an operator fixed the cause).
    pub fn reset(&mut self) {
        self.restarts.clear();
    }

    /// How many recoveries the budget holds now.
    pub fn recent(&self) -> usize {
        self.restarts.len()
    }
}

/// When a device's next standby worker is due to start, if one is left for later.
#[derive(Debug, Default)]
pub struct StandbySchedule {
    due: Option<Instant>,
}

impl StandbySchedule {
    /// A recovery used the standby: the next starts a little later.
    pub fn after_recovery(&mut self) {
        self.due = Some(Instant::now() + STANDBY_DELAY);
    }

    /// A standby is wanted as soon as one may start (see the daemon's cap on standbys
    /// starting at once).
    pub fn due_now(&mut self) {
        self.due = Some(Instant::now());
    }

    /// A standby failed to start: the next try waits.
    pub fn after_failure(&mut self) {
        self.due = Some(Instant::now() + STANDBY_RETRY);
    }

    pub fn due(&self) -> Option<Instant> {
        self.due
    }

    /// Whether a standby is due by `now`; if so, the schedule is cleared.
    pub fn take_due(&mut self, now: Instant) -> bool {
        let due = self.due.is_some_and(|due| now >= due);
        if due {
            self.due = None;
        }
        due
    }
}

/// What a device's hang verdicts lead to: a hung worker is replaced; one waiting for a
/// slow backend is not, and the wait is logged once when it starts and once when it
/// ends.
#[derive(Debug, Default)]
pub struct HangPolicy {
    /// Since when the worker has said it waits for a slow backend.
    backend_wait: Option<Duration>,
}

impl HangPolicy {
    /// Why the worker `pid` of device `dev_id` must be replaced, if it must.
    pub fn judge(&mut self, dev_id: u32, pid: u32, verdict: Verdict) -> Option<String> {
        match verdict {
            Verdict::Hung(why) => Some(why),
            Verdict::Backend(quiet) => {
                if self.backend_wait.is_none() {
                    tracing::warn!(
                        dev_id,
                        worker_pid = pid,
                        event = "backend_slow",
                        "no I/O completed for {:.1} s: the worker waits for its backend \
                         (not hung: not replaced, unless it is an nbd worker past \
                         recovery.nbd_request_timeout_secs)",
                        quiet.as_secs_f64()
                    );
                }
                self.backend_wait = Some(quiet);
                None
            }
            Verdict::Fine => {
                if let Some(quiet) = self.backend_wait.take() {
                    tracing::info!(
                        dev_id,
                        event = "backend_progress",
                        "the backend completed I/O again after {:.1} s",
                        quiet.as_secs_f64()
                    );
                }
                None
            }
        }
    }

    /// How long the worker has waited for its backend with nothing completing, if it
    /// does.
    pub fn backend_wait(&self) -> Option<Duration> {
        self.backend_wait
    }

    /// A new worker: no wait is going on.
    pub fn reset(&mut self) {
        self.backend_wait = None;
    }
}

/// Kills the device's worker if it holds I/O and has made no progress by `now` (the
/// tick's scan); its death is then handled like any other, with the hang as the
/// recovery's reason. Whether it did.
pub fn kill_if_hung(
    dev: &mut Device,
    rc: &RecoveryConfig,
    now: Instant,
    disks: &crate::hang::DiskStats,
) -> bool {
    let Some(reason) = dev.hung(now, disks, rc.hung_timeout, rc.nbd_request_timeout) else {
        return false;
    };
    let pid = dev.worker().map(|w| w.pid());
    if dev.server_silent() {
        tracing::warn!(
            dev_id = dev.id(),
            worker_pid = pid,
            event = "nbd_request_timeout",
            "{reason}; killing worker {}",
            pid.unwrap_or_default()
        );
    } else {
        tracing::error!(
            dev_id = dev.id(),
            worker_pid = pid,
            event = "worker_hung",
            "{reason}; killing it"
        );
    }
    dev.mark_hung(reason);
    dev.kill_worker();
    true
}

/// After the device's worker died: recovers it within its restart budget, else does
/// what `on_restart_limit` says. A death that does not `count` (the worker's NBD server
/// went away) takes nothing from the budget: a server restarted often is not a
/// crashing worker. Returns the event for the STATUS line.
pub fn after_death(
    dev: &mut Device,
    ctx: &Context,
    rc: &RecoveryConfig,
    reason: &str,
    counts: bool,
    notifier: &Notifier,
) -> Event {
    let id = dev.id();
    let within_budget = !counts || dev.restart_budget_mut().take(rc.restart_max, rc.restart_window);
    if !rc.automatic_recovery() || !within_budget {
        restart_limit(dev, ctx, rc, reason);
        return Event::RestartLimit { id };
    }
    notifier.extend_timeout(RECOVERY_TIMEOUT_EXTENSION);
    let outcome = dev.recover(ctx, reason);
    outcome_event(dev, ctx, rc, outcome, reason)
}

/// The restart limit reached: the device waits QUIESCED for an operator, or is served
/// by a worker that fails every I/O (`on_restart_limit = "fail-io"`).
fn restart_limit(dev: &mut Device, ctx: &Context, rc: &RecoveryConfig, reason: &str) {
    let id = dev.id();
    let limit = format!(
        "not recovered: {} recoveries within {} s reached the restart limit \
         (last cause: {reason})",
        dev.restart_budget_mut().recent(),
        rc.restart_window.as_secs()
    );
    let fix = format!("fix the cause, then run `ublkctl recover {id}`");
    let note = match rc.on_restart_limit {
        OnRestartLimit::Quiesce => {
            let note =
                format!("{limit}; the device waits QUIESCED (its I/O is held, not failed): {fix}");
            dev.wait_for_operator(note.clone());
            note
        }
        OnRestartLimit::FailIo => {
            let failing = format!(
                "{limit}; every I/O fails with EIO (on_restart_limit = \"fail-io\"): {fix}"
            );
            match dev.recover_failing_io(ctx, reason, failing.clone()) {
                Ok(_) => failing,
                Err(e) => {
                    let note = format!(
                        "{limit}; failing its I/O did not work ({e}), so the device waits \
                         QUIESCED (its I/O is held): {fix}"
                    );
                    dev.wait_for_operator(note.clone());
                    note
                }
            }
        }
    };
    tracing::error!(dev_id = id, event = "restart_limit", "{note}");
}

/// Goes on with the device's recovery if it waits for the kernel's release or its new
/// worker and is due; returns the event for the status line if it did.
pub fn continue_if_due(
    dev: &mut Device,
    ctx: &Context,
    rc: &RecoveryConfig,
    now: Instant,
) -> Option<Event> {
    if dev.release_due().is_none_or(|t| t > now) {
        return None;
    }
    let outcome = dev.continue_recovery(ctx);
    let after = "the recovery waiting for the release or its worker";
    Some(outcome_event(dev, ctx, rc, outcome, after))
}

/// What a recovery's outcome means for the device: a failed one leaves it waiting for
/// an operator, unless what failed was its new worker, lost (killed from outside, as
/// a chaos test or the OOM killer does): that is one more worker death, and the
/// recovery starts over with another, within the restart budget. Returns the event for
/// the status line.
pub fn outcome_event(
    dev: &mut Device,
    ctx: &Context,
    rc: &RecoveryConfig,
    outcome: Result<Recovery, DeviceError>,
    after: &str,
) -> Event {
    let id = dev.id();
    match outcome {
        Err(e) if e.worker_lost() => {
            let reason = format!("{after}; then its new worker was lost: {e}");
            if !rc.automatic_recovery()
                || !dev.restart_budget_mut().take(rc.restart_max, rc.restart_window)
            {
                restart_limit(dev, ctx, rc, &reason);
                return Event::RestartLimit { id };
            }
            tracing::warn!(
                dev_id = id,
                event = "recovery_worker_lost",
                "the recovery's new worker was lost ({e}); starting over with another \
                 (the device's I/O stays held)"
            );
            let outcome = dev.recover(ctx, &reason);
            outcome_event(dev, ctx, rc, outcome, after)
        }
        Ok(Recovery::Done(stall)) => Event::Recovered { id, stall },
        Ok(Recovery::Waiting) if dev.awaiting_standby() => Event::WaitsForWorker { id },
        Ok(Recovery::Waiting) => Event::WaitsForRelease { id },
        Err(e) => {
            tracing::error!(dev_id = id, event = "recovery_failed", "recovery failed: {e}");
            dev.wait_for_operator(format!("recovery failed: {e} (after: {after})"));
            Event::RecoveryFailed { id }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_refuses_past_max_and_forgets_on_reset() {
        let mut budget = RestartBudget::default();
        let window = Duration::from_secs(60);
        assert!(budget.take(2, window));
        assert!(budget.take(2, window));
        assert!(!budget.take(2, window));
        assert_eq!(budget.recent(), 2);
        budget.reset();
        assert_eq!(budget.recent(), 0);
        assert!(budget.take(2, window));
    }

    #[test]
    fn the_budget_forgets_recoveries_older_than_the_window() {
        let mut budget = RestartBudget::default();
        assert!(budget.take(1, Duration::ZERO));
        std::thread::sleep(Duration::from_millis(2));
        assert!(budget.take(1, Duration::ZERO));
    }

    #[test]
    fn a_standby_is_due_once_and_after_its_delay() {
        let mut schedule = StandbySchedule::default();
        assert!(!schedule.take_due(Instant::now()));
        schedule.after_recovery();
        let due = schedule.due().unwrap();
        assert!(!schedule.take_due(due - Duration::from_millis(1)));
        assert!(schedule.take_due(due));
        assert!(!schedule.take_due(due));
        schedule.after_failure();
        assert!(schedule.due().unwrap() >= due + STANDBY_RETRY - STANDBY_DELAY);
    }

    #[test]
    fn only_a_hang_replaces_the_worker() {
        let mut policy = HangPolicy::default();
        assert_eq!(policy.judge(1, 2, Verdict::Fine), None);
        assert_eq!(policy.judge(1, 2, Verdict::Backend(Duration::from_secs(9))), None);
        assert_eq!(policy.backend_wait, Some(Duration::from_secs(9)));
        assert_eq!(policy.judge(1, 2, Verdict::Fine), None);
        assert_eq!(policy.backend_wait, None);
        assert_eq!(policy.judge(1, 2, Verdict::Hung("stuck".into())), Some("stuck".into()));
    }
}
