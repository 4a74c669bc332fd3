//! `ublkctl add` and `ublkctl recover` as the loop carries them: an add is answered once
//! its device is LIVE (its nbd export negotiated on a thread, its first worker started
//! while the loop serves others, begun again with a new worker if one is lost), a
//! recover once its recovery ends; both on later turns, never by waiting.

use super::underway::{Standing, Underway, Wake, for_so_far};
use super::*;
use std::os::fd::AsRawFd;
use ublkd_proto::msg::Failure;

/// An `ublkctl add` under way, answered once its device is LIVE (or has failed), so
/// that no add holds up the loop (other devices' recoveries, clients, other adds, the
/// watchdog): an nbd device's export is first connected and negotiated on a thread of
/// its own (within `recovery.nbd_handshake_timeout_secs`, 10 s by default), then every device's first worker starts while
/// the loop watches its control socket ([`Creation`]: 0.1-1 s under emulation). Adds
/// issued together overlap.
#[derive(Debug)]
pub(super) struct PendingAdd {
    pub(super) for_whom: AddFor,
    /// As asked (for [`Daemon::check_add`]'s conflicts).
    pub(super) spec: DeviceSpec,
    pub(super) stage: AddStage,
    /// Adds of this device begun so far: one whose worker was lost (killed while the
    /// device was being made, say) is begun again, up to [`ADD_ATTEMPTS`] in all.
    pub(super) attempts: u8,
    /// When it was asked for.
    pub(super) began: Instant,
}

impl Underway for PendingAdd {
    fn wake(&self) -> Wake {
        match &self.stage {
            AddStage::Starting(creation) => Wake {
                fd: creation.control().map(|fd| fd.as_raw_fd()),
                at: Some(creation.deadline()),
            },
            // A handshake's thread has no fd to poll.
            AddStage::Connecting(_) => Wake::at(Instant::now() + PENDING_ADD_POLL),
        }
    }

    fn progress(&self, now: Instant) -> Standing {
        let so_far = for_so_far(self.began, now);
        let (devices, what) = match &self.stage {
            AddStage::Connecting(_) => (
                self.spec.id.into_iter().collect(),
                format!("being added: ublkd is negotiating its NBD export ({so_far})"),
            ),
            AddStage::Starting(creation) if creation.starting_dev() => (
                vec![creation.id()],
                format!(
                    "being added: START_DEV waits for its first worker to fetch its tags \
                     ({so_far})"
                ),
            ),
            AddStage::Starting(creation) if creation.activating() => (
                vec![creation.id()],
                format!("being added: its first worker is being handed the device ({so_far})"),
            ),
            AddStage::Starting(creation) => (
                vec![creation.id()],
                format!("being added: its first worker is starting ({so_far})"),
            ),
        };
        Standing { devices, what }
    }
}

/// Who an add is for, and so who hears how it ended.
#[derive(Debug)]
pub(super) enum AddFor {
    /// An `ublkctl add`, answered on its connection.
    Client(Token),
    /// A device a reload found in the config file (as the file describes it), counted
    /// in the reload's outcome.
    Reload(Box<DeviceSpec>),
}

/// How many times an add is begun before a lost worker fails it: a client asked for
/// a device, not for a particular worker process, so a worker killed under it (an
/// operator's or an OOM killer's doing) costs a new worker, not an error.
pub(super) const ADD_ATTEMPTS: u8 = 10;

#[derive(Debug)]
pub(super) enum AddStage {
    /// The nbd export is being negotiated, or the rbd image probed, on a thread.
    Connecting(mpsc::Receiver<Result<Reached, TargetError>>),
    /// The device is made; its first worker is starting.
    Starting(Box<Creation>),
}

/// How often the loop looks whether an nbd add's handshake is done.
pub(super) const PENDING_ADD_POLL: Duration = Duration::from_millis(20);

/// An `ublkctl recover` answered once its recovery ends (a standby still starting, a
/// slow release, an nbd server away), so that the operator's command returns with the
/// device served (or with why not), not while it still recovers; at the latest after
/// [`RECOVER_ANSWER_WAIT`], with where it stands.
#[derive(Debug)]
pub(super) struct PendingRecover {
    pub(super) token: Token,
    pub(super) id: u32,
    pub(super) deadline: Instant,
}

/// The longest an `ublkctl recover` waits for its answer: well inside ublkctl's 120 s,
/// past a standby's start limit at its default (`recovery.worker_ready_timeout_secs`,
/// 30 s; past this wait the answer says where the recovery stands).
pub(super) const RECOVER_ANSWER_WAIT: Duration = Duration::from_secs(60);

impl Underway for PendingRecover {
    fn wake(&self) -> Wake {
        Wake::at(self.deadline)
    }

    fn progress(&self, now: Instant) -> Standing {
        let left = self.deadline.saturating_duration_since(now).as_secs();
        let what = format!("an `ublkctl recover` waits for its end (at most {left} s more)");
        Standing { devices: vec![self.id], what }
    }
}

impl Daemon {
    /// `ublkctl add`: answered now if it is refused, else once its device is LIVE or
    /// has failed ([`PendingAdd`], `None` here): an nbd device's export negotiated on a
    /// thread of its own, then every device's worker started while the loop goes on.
    pub(super) fn begin_add(&mut self, token: Token, add: &AddRequest) -> Option<CtlResponse> {
        let spec = match self.check_add(add) {
            Ok(spec) => spec,
            Err(failure) => return Some(failure.into()),
        };
        let mut attempts = 1;
        match self.first_add_stage(&spec, &mut attempts) {
            Ok(stage) => {
                let for_whom = AddFor::Client(token);
                let began = Instant::now();
                self.pending_adds.push(PendingAdd { for_whom, spec, stage, attempts, began });
                None
            }
            Err(failure) => Some(failure.into()),
        }
    }

    /// Whether an add that failed with `e` is begun again (its worker was lost: killed
    /// before it stood by, say), counting it in `attempts`; says so if it is.
    fn add_again(spec: &DeviceSpec, e: &DeviceError, attempts: &mut u8) -> bool {
        if !e.worker_lost() || *attempts >= ADD_ATTEMPTS {
            return false;
        }
        *attempts += 1;
        tracing::warn!(
            event = "add_retried",
            "adding {} again (attempt {} of {ADD_ATTEMPTS}): {e}",
            describe_spec(spec),
            *attempts
        );
        true
    }

    /// Where an add of `spec` (checked) begins: an nbd export negotiated on a thread
    /// of its own, any other device made at once with its worker starting.
    /// A worker lost at once (killed before it took its setup) costs another attempt,
    /// counted in `attempts`, not the add.
    pub(super) fn first_add_stage(
        &self,
        spec: &DeviceSpec,
        attempts: &mut u8,
    ) -> Result<AddStage, Failure> {
        if !reach_takes_time(spec) {
            loop {
                match Device::begin_create(&self.ctx, spec, Reached::Nbd(None)) {
                    Ok(creation) => return Ok(AddStage::Starting(Box::new(creation))),
                    Err(e) if Self::add_again(spec, &e, attempts) => {}
                    Err(e) => return Err(handlers::device_failure(&e)),
                }
            }
        }
        // Zero copy the kernel cannot give is refused before the server is bothered
        // (creation decides it again, for devices made from the config).
        decide_zero_copy(spec, self.ctx.kernel_features, self.ctx.kernel_release)
            .map_err(|e| Failure::from(e.to_string()))?;
        let (tx, connected) = mpsc::channel();
        let for_thread = spec.clone();
        let binary = self.ctx.worker_binary.clone();
        let data_path = DataPath::for_kernel(self.ctx.kernel_features);
        let handshake = self.ctx.nbd_handshake_timeout;
        std::thread::Builder::new()
            .name("add-reach".into())
            .spawn(move || drop(tx.send(reach(&binary, &for_thread, data_path, handshake))))
            .map_err(|e| {
                Failure::from(format!("cannot start a thread to reach the target: {e}"))
            })?;
        Ok(AddStage::Connecting(connected))
    }

    /// Moves every add under way on: makes the devices of the nbd adds whose
    /// handshakes are done, hands each new device whose worker has answered to it, and
    /// answers the adds that are done.
    pub(super) fn finish_pending_adds(&mut self) {
        let mut waiting = Vec::with_capacity(self.pending_adds.len());
        for mut pending in std::mem::take(&mut self.pending_adds) {
            if let AddStage::Connecting(connected) = &pending.stage {
                let begun = match connected.try_recv() {
                    Ok(reached) => reached.map_err(DeviceError::from).and_then(|reached| {
                        Device::begin_create(&self.ctx, &pending.spec, reached)
                    }),
                    Err(mpsc::TryRecvError::Empty) => {
                        waiting.push(pending);
                        continue;
                    }
                    Err(mpsc::TryRecvError::Disconnected) => {
                        let why = "the thread reaching the target ended without an answer";
                        self.add_done(pending.for_whom, Err(Failure::from(why)));
                        continue;
                    }
                };
                match begun {
                    Ok(creation) => pending.stage = AddStage::Starting(Box::new(creation)),
                    // Connected again, for a new worker.
                    Err(e) if Self::add_again(&pending.spec, &e, &mut pending.attempts) => {
                        match self.first_add_stage(&pending.spec, &mut pending.attempts) {
                            Ok(stage) => {
                                pending.stage = stage;
                                waiting.push(pending);
                            }
                            Err(message) => self.add_done(pending.for_whom, Err(message)),
                        }
                        continue;
                    }
                    Err(e) => {
                        self.add_done(pending.for_whom, Err(handlers::device_failure(&e)));
                        continue;
                    }
                }
            }
            let AddStage::Starting(creation) = pending.stage else { continue };
            let outcome = match creation.progress(&self.ctx, Instant::now()) {
                Progress::Pending(creation) => {
                    pending.stage = AddStage::Starting(Box::new(creation));
                    waiting.push(pending);
                    continue;
                }
                Progress::Done(Ok(dev)) => {
                    let id = dev.id();
                    self.devices.insert(id, dev);
                    Ok(id)
                }
                Progress::Done(Err(e))
                    if Self::add_again(&pending.spec, &e, &mut pending.attempts) =>
                {
                    match self.first_add_stage(&pending.spec, &mut pending.attempts) {
                        Ok(stage) => {
                            pending.stage = stage;
                            waiting.push(pending);
                            continue;
                        }
                        Err(message) => Err(message),
                    }
                }
                Progress::Done(Err(e)) => Err(handlers::device_failure(&e)),
            };
            self.add_done(pending.for_whom, outcome);
        }
        self.pending_adds = waiting;
    }

    /// Tells whom an add was for how it ended: the device's id, or why it failed.
    fn add_done(&mut self, for_whom: AddFor, outcome: Result<u32, Failure>) {
        match for_whom {
            AddFor::Client(token) => {
                let response = match outcome {
                    Ok(id) => CtlResponse::Added { id },
                    Err(failure) => failure.into(),
                };
                self.control.respond(token, &response, Instant::now());
            }
            AddFor::Reload(spec) => {
                self.reload_add_done(*spec, outcome.map_err(|failure| failure.message))
            }
        }
    }

    /// Gives up the adds under way for device `id` (every one for `None`) because of
    /// `why`: a device already made in the kernel is deleted with its worker and record
    /// ([`Creation::abandon`]), an export being negotiated is dropped when its thread
    /// answers, and each add is answered with `why`. The ids of the devices that had
    /// been made.
    pub(super) fn give_up_pending_adds(&mut self, id: Option<u32>, why: &str) -> Vec<u32> {
        let mut made = Vec::new();
        let mut kept = Vec::with_capacity(self.pending_adds.len());
        for pending in std::mem::take(&mut self.pending_adds) {
            let pending_id = match &pending.stage {
                AddStage::Starting(creation) => Some(creation.id()),
                AddStage::Connecting(_) => pending.spec.id,
            };
            if id.is_some_and(|id| pending_id != Some(id)) {
                kept.push(pending);
                continue;
            }
            if let AddStage::Starting(creation) = pending.stage {
                tracing::info!(dev_id = creation.id(), "{why}: giving up an add under way");
                made.push(creation.id());
                creation.abandon(&self.ctx);
            }
            let failure = Failure::from(format!("{why} before the device was made"));
            self.add_done(pending.for_whom, Err(failure));
        }
        self.pending_adds = kept;
        made
    }

    /// The adds under way with a device id, as `ublkctl status` shows them: an nbd add
    /// still negotiating has an id only if it asked for one.
    pub(super) fn pending_statuses(&self) -> Vec<DevStatus> {
        self.pending_adds
            .iter()
            .filter_map(|pending| {
                // Its note is its progress, as every operation's (`underway_notes`).
                let (id, spec, worker_pid) = match &pending.stage {
                    AddStage::Starting(creation) => {
                        (creation.id(), creation.spec(), creation.worker_pid())
                    }
                    AddStage::Connecting(_) => (pending.spec.id?, &pending.spec, None),
                };
                Some(DevStatus {
                    id,
                    state: "ADDING".into(),
                    target: spec.target.name().to_string(),
                    worker_pid,
                    size_bytes: spec.size_bytes,
                    queues: spec.settings.queues,
                    queue_depth: spec.settings.queue_depth,
                    threads: spec.settings.threads,
                    recoveries: 0,
                    last_recovery_ms: None,
                    last_recovery_reason: None,
                    standby_pid: None,
                    sandbox: None,
                    counters: Default::default(),
                    note: None,
                    failing_io: false,
                    latency: Default::default(),
                    name: spec.attrs.name.clone(),
                    read_only: handlers::read_only(spec, false),
                    backing: handlers::backing(spec),
                })
            })
            .collect()
    }

    /// `ublkctl recover`: answered now if the recovery ended at once (or was refused),
    /// else once it ends ([`PendingRecover`], `None` here).
    pub(super) fn begin_recover(&mut self, token: Token, id: u32) -> Option<CtlResponse> {
        match self.handle_recover(id) {
            Ok(Some(message)) => Some(CtlResponse::Recovered { id, message }),
            Ok(None) => {
                let deadline = Instant::now() + RECOVER_ANSWER_WAIT;
                self.pending_recovers.push(PendingRecover { token, id, deadline });
                None
            }
            Err(failure) => Some(failure.into()),
        }
    }

    /// Answers the `ublkctl recover`s whose recovery has ended, and with where it
    /// stands those held up outside ublkd, those that waited [`RECOVER_ANSWER_WAIT`],
    /// or all, at `stopping`.
    pub(super) fn answer_recovers(&mut self, stopping: bool) {
        let now = Instant::now();
        for pending in std::mem::take(&mut self.pending_recovers) {
            let id = pending.id;
            let result = match self.recover_outcome(id) {
                Some(outcome) => outcome,
                None if stopping => Err(format!(
                    "ublkd stopped before device {id} was recovered; the next ublkd recovers it"
                )),
                // Waiting on what ublkd cannot hurry (a release behind a slow backend,
                // an NBD server away) is said at once, as status says it.
                None if now >= pending.deadline || self.recovery_held_up(id) => {
                    Err(self.recovering_message(id))
                }
                None => {
                    self.pending_recovers.push(pending);
                    continue;
                }
            };
            let response = match result {
                Ok(message) => CtlResponse::Recovered { id, message },
                Err(message) => CtlResponse::Error { message },
            };
            self.control.respond(pending.token, &response, now);
        }
    }
}
