//! What the recovery policy (`crate::recovery`) remembers of one device, kept by the
//! device: its recent recoveries against the restart budget, an rbd device's wait for
//! its Ceph cluster (outside that budget), when its next standby worker starts, and
//! whether its worker waits for a slow backend. Plain bookkeeping, below both: the
//! policy decides with it, the device carries it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::hang::Verdict;

/// How long after a recovery the next standby worker starts: not while the requeued
/// I/O is being served, when on a small machine it would compete with the new worker
/// for CPU.
const STANDBY_DELAY: Duration = Duration::from_millis(300);
/// After a standby failed to start, the next try waits this long (no tight loop).
const STANDBY_RETRY: Duration = Duration::from_secs(2);

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

/// The wait before an rbd recovery's second try once its new worker could not serve.
pub const CLUSTER_FIRST_WAIT: Duration = Duration::from_secs(1);

/// An rbd device's recovery whose new workers cannot serve (a worker cannot reach its
/// monitors, open its image or take its lock while the Ceph cluster is away): each try
/// that failed doubles the wait before the next, from [`CLUSTER_FIRST_WAIT`] up to
/// `recovery.rbd_cluster_retry_secs`, as nbd's wait for its server does. Nothing here
/// counts against the [`RestartBudget`]: an outage of any length, with any number of
/// new workers lost meanwhile, leaves the budget as the death that began it left it.
#[derive(Debug, Default)]
pub struct ClusterWait {
    /// Since when the recovery has waited (its first failed try), and why it began.
    since: Option<(Instant, String)>,
    /// Tries failed in a row.
    failed: u32,
}

impl ClusterWait {
    /// A try failed at `now` (for the recovery begun for `reason`, if this is the first
    /// failure): how long until the next, at most `max`.
    pub fn failed(&mut self, now: Instant, reason: &str, max: Duration) -> Duration {
        self.since.get_or_insert_with(|| (now, reason.to_owned()));
        self.failed = self.failed.saturating_add(1);
        let doublings = (self.failed - 1).min(16);
        CLUSTER_FIRST_WAIT.saturating_mul(1 << doublings).min(max)
    }

    /// Since when the recovery has waited, and the reason it began with, if it waits.
    pub fn since(&self) -> Option<(Instant, &str)> {
        self.since.as_ref().map(|(at, why)| (*at, why.as_str()))
    }

    /// How many tries failed in a row.
    pub fn failures(&self) -> u32 {
        self.failed
    }

    /// The recovery served the device (or an operator took over): how long it had
    /// waited, if it had.
    pub fn end(&mut self, now: Instant) -> Option<Duration> {
        let waited = self.since.take().map(|(at, _)| now.saturating_duration_since(at));
        self.failed = 0;
        waited
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
    fn the_cluster_wait_doubles_to_its_bound_keeps_its_start_and_ends() {
        let start = Instant::now();
        let mut wait = ClusterWait::default();
        assert_eq!(wait.since(), None);
        let max = Duration::from_secs(10);
        let waits: Vec<u64> = (0..6)
            .map(|n| {
                let at = start + Duration::from_secs(n);
                wait.failed(at, &format!("death {n}"), max).as_secs()
            })
            .collect();
        assert_eq!(waits, [1, 2, 4, 8, 10, 10]);
        assert_eq!(wait.failures(), 6);
        assert_eq!(wait.since(), Some((start, "death 0")), "the first failure's start and reason");
        assert_eq!(wait.end(start + Duration::from_secs(30)), Some(Duration::from_secs(30)));
        assert_eq!((wait.since(), wait.failures()), (None, 0));
        assert_eq!(wait.end(start), None, "no wait, nothing waited");
        assert_eq!(wait.failed(start, "again", max), CLUSTER_FIRST_WAIT, "starts over");
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
