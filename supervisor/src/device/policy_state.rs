//! What the recovery policy (`crate::recovery`) remembers of one device, kept by the
//! device: its recent recoveries against the restart budget, when its next standby
//! worker starts, and whether its worker waits for a slow backend. Plain bookkeeping,
//! below both: the policy decides with it, the device carries it.

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
