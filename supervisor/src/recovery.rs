//! Recovery policy: whether a device whose worker died is recovered or left for an
//! operator (the restart budget and `on_restart_limit`), what a hang verdict leads to,
//! when a device's next standby worker starts, and how an rbd device's recovery waits
//! for its Ceph cluster: its new workers that cannot serve are tried again after a
//! backoff, outside the restart budget, for as long as the cluster is away (or until
//! `recovery.rbd_cluster_wait_secs`, then the device fails its I/O).
//!
//! The mechanism is elsewhere: the kernel commands and workers of a recovery in
//! [`crate::device`], the heartbeat comparison in [`crate::hang`]. What the policy
//! remembers of each device (its budget, its next standby's time, a backend wait) is
//! the device's (`device/policy_state.rs`): this module uses `device`, never the
//! other way round.

use std::time::{Duration, Instant};

use ublkd_config::{OnRestartLimit, RecoveryConfig};

use crate::device::{Context, Device, DeviceError, Recovery};
use crate::event::Event;
use crate::systemd::Notifier;

/// How much longer systemd is asked to wait while a recovery runs.
const RECOVERY_TIMEOUT_EXTENSION: Duration = Duration::from_secs(30);

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
        Err(e) if dev.waits_for_cluster_after(&e) => wait_for_cluster(dev, ctx, rc, &e, after),
        Err(e) if e.retried_by_recovery() => {
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
        Ok(Recovery::Done(stall)) => {
            if let Some(waited) = dev.cluster_wait_mut().end(Instant::now()) {
                tracing::info!(
                    dev_id = id,
                    event = "rbd_cluster_back",
                    "the Ceph cluster serves the device again after {:.0} s of waiting for it",
                    waited.as_secs_f64()
                );
            }
            Event::Recovered { id, stall }
        }
        Ok(Recovery::Waiting) if dev.awaiting_standby() => Event::WaitsForWorker { id },
        Ok(Recovery::Waiting) => Event::WaitsForRelease { id },
        Err(e) => {
            tracing::error!(dev_id = id, event = "recovery_failed", "recovery failed: {e}");
            dev.wait_for_operator(format!("recovery failed: {e} (after: {after})"));
            Event::RecoveryFailed { id }
        }
    }
}

/// An rbd recovery whose new worker could not serve (`e`): waits for the cluster and
/// tries again after a backoff, taking nothing from the restart budget; past
/// `recovery.rbd_cluster_wait_secs` of waiting, serves the device with a worker that
/// fails every I/O, until `ublkctl recover`. Returns the event for the status line.
fn wait_for_cluster(
    dev: &mut Device,
    ctx: &Context,
    rc: &RecoveryConfig,
    e: &DeviceError,
    after: &str,
) -> Event {
    let id = dev.id();
    let waited = dev.cluster_wait_mut().since().map(|(at, _)| at.elapsed());
    if let (Some(limit), Some(waited)) = (rc.rbd_cluster_wait, waited)
        && waited >= limit
    {
        dev.cluster_wait_mut().end(Instant::now());
        let cause = format!(
            "its Ceph cluster has been away for {} s ({e}); every I/O fails with EIO \
             (recovery.rbd_cluster_wait_secs): once the cluster is back, run \
             `ublkctl recover {id}`",
            waited.as_secs()
        );
        tracing::error!(dev_id = id, event = "rbd_cluster_gave_up", "{cause}");
        return match dev.recover_failing_io(ctx, after, cause.clone()) {
            Ok(recovery) => match recovery {
                Recovery::Done(stall) => Event::Recovered { id, stall },
                Recovery::Waiting => Event::WaitsForWorker { id },
            },
            Err(e) => {
                dev.wait_for_operator(format!("{cause}; failing its I/O did not work ({e})"));
                Event::RecoveryFailed { id }
            }
        };
    }
    match dev.wait_for_cluster(after, e, rc.rbd_cluster_retry) {
        Ok(_) => Event::WaitsForCluster { id },
        Err(t) => {
            let note = format!("recovery failed: {e} (after: {after}); then: {t}");
            tracing::error!(dev_id = id, event = "recovery_failed", "{note}");
            dev.wait_for_operator(note);
            Event::RecoveryFailed { id }
        }
    }
}
