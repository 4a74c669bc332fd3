//! Where a device stands: served, being recovered, or waiting for an operator, and the
//! transitions allowed between those states, checked in one place
//! ([`DeviceState::check`]).
//!
//! The state carries what the operator is told: the cause of a hang, of a wait for an
//! operator or of failing I/O, and a slow release's message. `ublkctl status` and the
//! systemd status line are derived from it. It also holds the worker processes that
//! have the device, in the states that have them: the one serving it (LIVE, hung, or
//! failing I/O), and during a recovery the one killed and the one being handed the
//! device. A state without a worker cannot name one.

use std::fmt;
use std::time::{Duration, Instant};

use crate::worker::{Activating, Worker};

/// A device's state.
#[derive(Debug)]
pub enum DeviceState {
    /// Being created: set up, its first worker not yet started.
    Starting,
    /// Found in the state dir by a new ublkd: its worker not yet taken over, nor the
    /// device recovered.
    Adopted,
    /// Served by `worker`.
    Live { worker: Worker },
    /// Its worker was found hung and killed; the death, once seen, starts a recovery
    /// whose reason is `cause`.
    Hung { cause: String, worker: Worker },
    /// Without a worker, a recovery about to start (or one that stopped, until the
    /// recovery policy says what the device does next).
    Recovering,
    /// A recovery waits for the kernel to release the old worker's `/dev/ublkcN`, then
    /// for its new worker's answer; the device's I/O is held meanwhile.
    Releasing(Box<Release>),
    /// Not served, its I/O held (QUIESCED), until `ublkctl recover`: the restart limit
    /// was reached or a recovery failed.
    WaitingForOperator { cause: String },
    /// Served by `worker`, which fails every I/O with EIO (the restart limit's
    /// `on_restart_limit = "fail-io"`), until `ublkctl recover`.
    FailingIo { cause: String, worker: Worker },
}

/// A recovery waiting for the kernel's release of the old worker's `/dev/ublkcN`.
#[derive(Debug)]
pub struct Release {
    /// Why the device is being recovered (the log's reason).
    pub reason: String,
    /// Set for a recovery with a worker that fails every I/O: the cause it is then
    /// served with ([`DeviceState::FailingIo`]).
    pub fail_io: Option<String>,
    /// When the death was seen (the stall counts from here).
    pub seen: Instant,
    pub started: Instant,
    pub next_try: Instant,
    pub delay: Duration,
    /// Set once the release has taken long: what status says about it.
    pub slow: Option<String>,
    /// Since when the recovery waits for its standby worker to stand by (it was still
    /// starting, or there was none): the loop goes on meanwhile.
    pub standby_wait: Option<Instant>,
    /// How long it waited for its standby (part of the stall, logged apart).
    pub standby_waited: Duration,
    /// How long after its start the kernel released the old worker's file (set once
    /// it has, and the new worker is being handed the device).
    pub released: Option<Duration>,
    /// The worker the recovery killed (an operator's recover, an upgrade), whose end it
    /// waits for, on later loop turns (its pidfd is polled), before the device is
    /// released from it.
    pub dying: Option<Worker>,
    /// The new worker being handed the device, once the kernel released the old one's:
    /// the loop watches its control socket for its answer.
    pub activating: Option<Activating>,
    /// END_USER_RECOVERY, once the new worker has answered: it waits until the worker
    /// has fetched every tag, on a thread of its own, with the worker.
    pub ending: Option<Box<crate::kernel_call::KernelCall>>,
}

impl Release {
    /// A recovery for `reason` that starts now, its I/O held from `seen`; `fail_io`: the
    /// cause it then serves with, failing every I/O.
    pub fn new(reason: String, fail_io: Option<String>, seen: Instant) -> Release {
        let started = Instant::now();
        Release {
            reason,
            fail_io,
            seen,
            started,
            next_try: started,
            delay: Duration::from_micros(200),
            slow: None,
            standby_wait: None,
            standby_waited: Duration::ZERO,
            released: None,
            dying: None,
            activating: None,
            ending: None,
        }
    }
}

/// The states without their data, for the transition table and its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateKind {
    Starting,
    Adopted,
    Live,
    Hung,
    Recovering,
    Releasing,
    WaitingForOperator,
    FailingIo,
}

impl StateKind {
    pub const ALL: [StateKind; 8] = [
        StateKind::Starting,
        StateKind::Adopted,
        StateKind::Live,
        StateKind::Hung,
        StateKind::Recovering,
        StateKind::Releasing,
        StateKind::WaitingForOperator,
        StateKind::FailingIo,
    ];

    /// Whether a device may go from `self` to `to`.
    pub fn may_become(self, to: StateKind) -> bool {
        use StateKind::*;
        matches!(
            (self, to),
            // A worker found hung is killed; one that dies (or that an operator
            // replaces) leaves the device to a recovery.
            (Starting, Live)
                // The previous ublkd's worker, taken over; else a recovery.
                | (Adopted, Live | Recovering)
                | (Live | FailingIo, Hung | Recovering)
                // A hang seen again before the death is: the newer cause.
                | (Hung, Hung | Recovering)
                | (Recovering, Releasing | WaitingForOperator)
                // Released: served again, normally or failing I/O. Stopped (an error,
                // or an operator starting over): back to the recovery policy.
                | (Releasing, Live | FailingIo | Recovering)
                | (WaitingForOperator, Recovering)
        )
    }
}

impl fmt::Display for StateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StateKind::Starting => "starting",
            StateKind::Adopted => "adopted",
            StateKind::Live => "live",
            StateKind::Hung => "hung",
            StateKind::Recovering => "recovering",
            StateKind::Releasing => "waiting for the kernel's release",
            StateKind::WaitingForOperator => "waiting for an operator",
            StateKind::FailingIo => "failing I/O",
        })
    }
}

/// Errors of the state machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("device {id} cannot go from {from} to {to}: it stays {from}")]
    IllegalTransition { id: u32, from: StateKind, to: StateKind },
}

/// How the systemd status line counts a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Summary {
    /// Served (normally, failing I/O, or by a worker about to be killed).
    Live,
    /// Without a worker, nothing for an operator to do.
    Recovering,
    /// Without a worker, with a message for the operator.
    Waiting,
}

impl DeviceState {
    pub fn kind(&self) -> StateKind {
        match self {
            DeviceState::Starting => StateKind::Starting,
            DeviceState::Adopted => StateKind::Adopted,
            DeviceState::Live { .. } => StateKind::Live,
            DeviceState::Hung { .. } => StateKind::Hung,
            DeviceState::Recovering => StateKind::Recovering,
            DeviceState::Releasing(_) => StateKind::Releasing,
            DeviceState::WaitingForOperator { .. } => StateKind::WaitingForOperator,
            DeviceState::FailingIo { .. } => StateKind::FailingIo,
        }
    }

    /// Checks that device `id` may go from this state to one of kind `to`.
    pub fn check(&self, id: u32, to: StateKind) -> Result<(), TransitionError> {
        let from = self.kind();
        if from.may_become(to) {
            Ok(())
        } else {
            Err(TransitionError::IllegalTransition { id, from, to })
        }
    }

    /// Whether a worker serves the device in this state.
    pub fn has_worker(&self) -> bool {
        self.worker().is_some()
    }

    /// The worker serving the device, in the states that have one.
    pub fn worker(&self) -> Option<&Worker> {
        match self {
            DeviceState::Live { worker }
            | DeviceState::Hung { worker, .. }
            | DeviceState::FailingIo { worker, .. } => Some(worker),
            _ => None,
        }
    }

    pub fn worker_mut(&mut self) -> Option<&mut Worker> {
        match self {
            DeviceState::Live { worker }
            | DeviceState::Hung { worker, .. }
            | DeviceState::FailingIo { worker, .. } => Some(worker),
            _ => None,
        }
    }

    /// A recovery's worker killed and not yet ended, if there is one.
    pub fn dying(&self) -> Option<&Worker> {
        match self {
            DeviceState::Releasing(r) => r.dying.as_ref(),
            _ => None,
        }
    }

    /// A recovery's new worker being handed the device, if there is one.
    pub fn activating(&self) -> Option<&Activating> {
        match self {
            DeviceState::Releasing(r) => r.activating.as_ref(),
            _ => None,
        }
    }

    /// Every worker the state holds, taken out of it (which leaves it without any).
    pub fn into_workers(self) -> Vec<Worker> {
        match self {
            DeviceState::Live { worker }
            | DeviceState::Hung { worker, .. }
            | DeviceState::FailingIo { worker, .. } => vec![worker],
            DeviceState::Releasing(r) => {
                let Release { dying, activating, ending, .. } = *r;
                // END_USER_RECOVERY is interrupted, and waited for, before its worker
                // is handed back (to be killed).
                let ending = ending.and_then(|call| call.into_worker());
                dying
                    .into_iter()
                    .chain(activating.map(Activating::into_worker))
                    .chain(ending)
                    .collect()
            }
            DeviceState::Starting
            | DeviceState::Adopted
            | DeviceState::Recovering
            | DeviceState::WaitingForOperator { .. } => Vec::new(),
        }
    }

    /// Whether the device is served by a worker that fails every I/O.
    pub fn failing_io(&self) -> bool {
        matches!(self, DeviceState::FailingIo { .. })
    }

    /// What `ublkctl status` says about the device's state, if anything.
    pub fn note(&self) -> Option<&str> {
        match self {
            DeviceState::Starting
            | DeviceState::Adopted
            | DeviceState::Live { .. }
            | DeviceState::Recovering => None,
            DeviceState::Hung { cause, .. }
            | DeviceState::WaitingForOperator { cause }
            | DeviceState::FailingIo { cause, .. } => Some(cause),
            DeviceState::Releasing(r) => r.slow.as_deref().or(r.fail_io.as_deref()),
        }
    }

    pub fn summary(&self) -> Summary {
        match (self.has_worker(), self.note()) {
            (true, _) => Summary::Live,
            (false, None) => Summary::Recovering,
            (false, Some(_)) => Summary::Waiting,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release(fail_io: Option<&str>) -> Box<Release> {
        Box::new(Release::new("worker died".into(), fail_io.map(String::from), Instant::now()))
    }

    fn example(kind: StateKind) -> DeviceState {
        let cause = "why".to_string();
        let worker = Worker::stand_in;
        match kind {
            StateKind::Starting => DeviceState::Starting,
            StateKind::Adopted => DeviceState::Adopted,
            StateKind::Live => DeviceState::Live { worker: worker() },
            StateKind::Hung => DeviceState::Hung { cause, worker: worker() },
            StateKind::Recovering => DeviceState::Recovering,
            StateKind::Releasing => DeviceState::Releasing(release(None)),
            StateKind::WaitingForOperator => DeviceState::WaitingForOperator { cause },
            StateKind::FailingIo => DeviceState::FailingIo { cause, worker: worker() },
        }
    }

    const ALLOWED: [(StateKind, StateKind); 15] = {
        use StateKind::*;
        [
            (Starting, Live),
            (Adopted, Live),
            (Adopted, Recovering),
            (Live, Hung),
            (Live, Recovering),
            (FailingIo, Hung),
            (FailingIo, Recovering),
            (Hung, Hung),
            (Hung, Recovering),
            (Recovering, Releasing),
            (Recovering, WaitingForOperator),
            (Releasing, Live),
            (Releasing, FailingIo),
            (Releasing, Recovering),
            (WaitingForOperator, Recovering),
        ]
    };

    #[test]
    fn every_allowed_transition_is_accepted() {
        for (from, to) in ALLOWED {
            assert_eq!(example(from).check(7, to), Ok(()), "{from} -> {to}");
        }
    }

    #[test]
    fn every_other_transition_is_refused_with_both_states_named() {
        for from in StateKind::ALL {
            for to in StateKind::ALL {
                if ALLOWED.contains(&(from, to)) {
                    continue;
                }
                let err = example(from).check(7, to).unwrap_err();
                assert_eq!(err, TransitionError::IllegalTransition { id: 7, from, to });
                let text = err.to_string();
                assert!(
                    text.starts_with(&format!("device 7 cannot go from {from} to {to}")),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn a_recovery_never_skips_the_release() {
        assert!(!StateKind::Recovering.may_become(StateKind::Live));
        assert!(!StateKind::WaitingForOperator.may_become(StateKind::Live));
        assert!(!StateKind::Live.may_become(StateKind::Live));
    }

    #[test]
    fn status_is_derived_from_the_state() {
        let cases = [
            (example(StateKind::Starting), None, false, Summary::Recovering),
            (example(StateKind::Adopted), None, false, Summary::Recovering),
            (example(StateKind::Live), None, false, Summary::Live),
            (example(StateKind::Hung), Some("why"), false, Summary::Live),
            (example(StateKind::Recovering), None, false, Summary::Recovering),
            (example(StateKind::Releasing), None, false, Summary::Recovering),
            (
                DeviceState::Releasing(release(Some("limit"))),
                Some("limit"),
                false,
                Summary::Waiting,
            ),
            (example(StateKind::WaitingForOperator), Some("why"), false, Summary::Waiting),
            (example(StateKind::FailingIo), Some("why"), true, Summary::Live),
        ];
        for (state, note, failing_io, summary) in cases {
            assert_eq!(state.note(), note, "{state:?}");
            assert_eq!(state.failing_io(), failing_io, "{state:?}");
            assert_eq!(state.summary(), summary, "{state:?}");
            assert_eq!(state.has_worker(), state.worker().is_some(), "{state:?}");
        }
        let mut slow = release(Some("limit"));
        slow.slow = Some("waiting for the kernel".into());
        assert_eq!(DeviceState::Releasing(slow).note(), Some("waiting for the kernel"));
    }
}
