//! The loop itself ([`Daemon::run`]): one `poll` over the signals' self-pipe, the control
//! socket and its connections, the workers' wait set and each starting worker's socket;
//! each turn handles the deaths and recoveries of the busy devices (those something
//! woke or that wait on a timer: `device_table`), the tick's hang scan when due, the
//! watchdog, adds, upgrades, deletes and clients, and says where a slow turn's time
//! went. A turn costs in proportion to what woke it, not to the devices; only the
//! tick's scan visits every device.

use super::*;

/// Where a loop turn's time went, said when the turn held the loop long enough for a
/// client to notice ([`SLOW_TURN`]).
pub(super) struct TurnTimes {
    at: Instant,
    started: Instant,
    steps: Vec<(&'static str, Duration)>,
}

impl TurnTimes {
    pub(super) fn new(started: Instant) -> TurnTimes {
        TurnTimes { at: started, started, steps: Vec::new() }
    }

    pub(super) fn mark(&mut self, step: &'static str) {
        let now = Instant::now();
        self.steps.push((step, now - self.at));
        self.at = now;
    }

    pub(super) fn report(&self) {
        let took = self.started.elapsed();
        if took < SLOW_TURN {
            return;
        }
        let steps: Vec<String> =
            self.steps.iter().map(|(s, d)| format!("{s} {} ms", d.as_millis())).collect();
        tracing::info!(
            event = "slow_turn",
            "a loop turn took {} ms: {}",
            took.as_millis(),
            steps.join(", ")
        );
    }
}

/// How long a stopping ublkd waits for its devices' spares to exit, together: a
/// standby exits at once, but an RBD spare first closes its image, and one still
/// connecting finishes that first.
pub(super) const SPARES_END_WAIT: Duration = Duration::from_secs(2);

/// How often at most the STATUS line is counted again while devices change without an
/// event (a recovery's turns): each count visits every device.
pub(super) const STATUS_EVERY: Duration = Duration::from_millis(250);

/// A turn longer than this is logged, with its steps.
pub(super) const SLOW_TURN: Duration = Duration::from_millis(100);

/// How long one loop turn spends on deaths and recoveries before it serves the rest
/// (clients, hang checks, the watchdog); the remaining deaths wait for the next turn.
pub(super) const DEATHS_PER_TURN: Duration = Duration::from_secs(1);

/// How many devices the scan's ticks between full ones read each on its own (a
/// stat file each); with more, every tick reads every disk's numbers at once.
pub(super) const WATCHED_ALONE_MAX: usize = 64;

/// How many standbys may be starting at once. Each start (exec, sandbox, rings) takes
/// CPU from the devices serving: after every worker died at once (an OOM kill), the
/// recoveries, not hundreds of spares starting beside them, must have it.
pub(super) const STANDBYS_STARTING_AT_ONCE: usize = 8;

/// How many standbys one loop turn starts: each is a fork and exec on the loop (tens
/// of milliseconds under emulation), and a turn that started eight made `ublkctl
/// status` wait for them; the rest start on the next turns, which come at once.
pub(super) const STANDBYS_SPAWNED_PER_TURN: usize = 2;

/// How many configured devices [`Daemon::create_all`] creates at once: for the same
/// reason, as many as standbys may start at once.
pub(super) const CREATING_AT_ONCE: usize = STANDBYS_STARTING_AT_ONCE;

/// Milliseconds from now until `at` for poll's timeout, rounded up so that the loop
/// does not wake just before a deadline and spin until it.
pub(super) fn millis_until(at: Instant) -> i32 {
    let left = at.saturating_duration_since(Instant::now());
    left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
}

impl Daemon {
    /// Serves until SIGTERM or SIGINT, then exits leaving every device in the kernel
    /// (each LIVE device's worker serves on, for the next ublkd to take over; the
    /// kernel holds the others' I/O until the next ublkd recovers them), or until
    /// `ublkctl shutdown`, which deletes every device first.
    pub fn run(mut self) -> Result<(), DaemonError> {
        let mut woken = Vec::new();
        loop {
            let tick = self.tick();
            let mut wake_by = self.next_scan;
            let mut fds = vec![libc::pollfd {
                fd: self.signals.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            self.control.pollfds(&mut fds);
            let control_fds = 1..fds.len();
            // At the cap, a due standby waits for a starting one to answer (its socket
            // is polled), not for a timer that would spin the loop.
            let standbys_may_start = self.standbys_starting() < STANDBYS_STARTING_AT_ONCE;
            // Every worker's pidfd is in the wait set, polled as one fd; without it
            // (epoll refused at start), each is polled here.
            let wait_set = crate::worker::wait_set::fd();
            match wait_set {
                Some(set) => {
                    fds.push(libc::pollfd { fd: set.as_raw_fd(), events: libc::POLLIN, revents: 0 })
                }
                None => {
                    for dev in self.devices.values() {
                        let workers = [dev.worker(), dev.standby(), dev.dying(), dev.activating()];
                        for w in workers.into_iter().flatten() {
                            let fd = w.pidfd().as_raw_fd();
                            fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                        }
                    }
                }
            }
            let pidfds = control_fds.end..fds.len();
            // Only busy devices have a standby starting, one due, or a recovery's next
            // try (see `device_table`).
            let mut starting_fds = Vec::new();
            for dev in self.devices.busy() {
                // A starting standby (or a recovery's worker being handed the device)
                // answers, or hangs up, on its control socket.
                for w in [dev.starting(), dev.activating()].into_iter().flatten() {
                    starting_fds.push((fds.len(), dev.id()));
                    fds.push(libc::pollfd {
                        fd: w.control().as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
                let standby_due = dev.standby_due().filter(|_| standbys_may_start);
                for due in [standby_due, dev.release_due()].into_iter().flatten() {
                    wake_by = wake_by.min(due);
                }
            }
            // Every operation under way (adds, recovers, upgrades, deletes, a reload)
            // says what wakes the loop for it: a worker's answer on its control socket,
            // a thread's end (looked at every few milliseconds), its deadline.
            for op in self.underway() {
                let wake = op.wake();
                if let Some(fd) = wake.fd {
                    fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                }
                if let Some(at) = wake.at {
                    wake_by = wake_by.min(at);
                }
            }
            let control_due = self.control.next_deadline();
            if let Some(due) = control_due {
                wake_by = wake_by.min(due);
            }
            if let Some(writer) = &self.metrics_file {
                wake_by = wake_by.min(writer.due());
            }
            if self.status_stale {
                wake_by = wake_by.min(self.status_due);
            }
            // Deaths the last turn had no time for are handled on this one, at once, as
            // is a SIGHUP that came during the reload that just ended.
            let reload_waiting = !self.reloading() && self.signals.reload.load(Ordering::Relaxed);
            if self.devices.any_woken() || reload_waiting {
                wake_by = Instant::now();
            }
            let idle = self.devices.is_empty()
                && self.underway().next().is_none()
                && self.notifier.watchdog_interval().is_none()
                && control_due.is_none()
                && self.metrics_file.is_none()
                && !self.status_stale
                && !reload_waiting;
            let timeout = if idle { -1 } else { millis_until(wake_by) };
            if crate::sys::poll(&mut fds, timeout).is_err() {
                continue; // EINTR: a signal; its flag is checked on the next turn.
            }
            // When a death became visible: a recovery's stall is counted from here.
            let woke = Instant::now();
            if fds[0].revents & libc::POLLIN != 0 {
                self.signals.drain();
            }
            self.signals.child.store(false, Ordering::Relaxed);
            crate::worker::reap_lingering();
            if self.signals.terminate.load(Ordering::Relaxed) {
                break;
            }
            // A SIGHUP during a reload is taken once that reload is done.
            if !self.reloading() && self.signals.reload.swap(false, Ordering::Relaxed) {
                self.reload();
            }
            // Which devices woke: those the wait set names (a worker of theirs ended)
            // and those whose starting standby answered. A turn on which nothing woke
            // saw nothing die or answer, and costs no wait4 per worker.
            let pid_events = fds[pidfds].iter().any(|p| p.revents != 0);
            if pid_events && wait_set.is_some() {
                crate::worker::wait_set::ready(&mut woken);
            }
            for &(at, id) in &starting_fds {
                if fds[at].revents != 0 {
                    woken.push(id);
                }
            }
            if pid_events && (wait_set.is_none() || crate::worker::wait_set::incomplete()) {
                self.devices.wake_all();
            }
            for id in woken.drain(..) {
                self.devices.wake(id);
            }
            let mut turn = TurnTimes::new(woke);
            self.handle_deaths(woke);
            turn.mark("deaths");
            self.continue_recoveries();
            turn.mark("recoveries");
            let now = Instant::now();
            if now >= self.next_scan {
                self.scan(now);
                self.next_scan = now + tick;
            }
            self.notifier.watchdog(now, self.hung_devices);
            self.update_status(now);
            turn.mark("hangs");
            self.finish_pending_adds();
            turn.mark("adds");
            self.advance_upgrades(false);
            turn.mark("upgrades");
            self.finish_deletes(false);
            for (token, req) in self.control.service(&fds[control_fds], Instant::now()) {
                let response = match req {
                    CtlRequest::Add(_)
                    | CtlRequest::Upgrade { .. }
                    | CtlRequest::Recover { .. }
                    | CtlRequest::Resize { .. }
                        if self.shutting_down =>
                    {
                        // Not now: a script may ask the next ublkd.
                        let kind = ublkd_proto::msg::ErrorKind::TryAgain;
                        ublkd_proto::msg::Failure::new(kind, "ublkd is shutting down").into()
                    }
                    CtlRequest::Del { id } => match self.begin_del(token, id, false, false) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::DelForce { id } => match self.begin_del(token, id, false, true) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::Shutdown => match self.begin_del(token, None, true, false) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::ShutdownForce => match self.begin_del(token, None, true, true) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::Add(add) => match self.begin_add(token, &add) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::Recover { id } => match self.begin_recover(token, id) {
                        Some(response) => response,
                        None => continue,
                    },
                    CtlRequest::Resize { id, size_bytes, allow_shrink } => {
                        match self.begin_resize(Some(token), id, size_bytes, allow_shrink) {
                            Some(response) => response,
                            None => continue,
                        }
                    }
                    CtlRequest::Upgrade { id } => match self.selected(id) {
                        Ok(ids) => {
                            self.begin_upgrade(token, ids);
                            continue;
                        }
                        Err(failure) => failure.into(),
                    },
                    req => self.handle(req),
                };
                self.control.respond(token, &response, Instant::now());
            }
            turn.mark("requests");
            turn.report();
            // After the requests: a `del` of a device being recovered is answered in
            // the same turn.
            self.answer_recovers(false);
            if let Some(mut writer) = self.metrics_file.take() {
                writer.tick(Instant::now(), || {
                    self.devices.ids().filter_map(|id| self.metrics(id)).collect()
                });
                self.metrics_file = Some(writer);
            }
            for id in self.devices.busy_ids() {
                self.devices.settle(id);
            }
            if self.shutting_down && !self.deleting() {
                break;
            }
        }
        self.notifier.stopping();
        // A reload under way ends with ublkd: its adds are given up below, its deletes
        // finished; nothing tells systemd READY again.
        self.pending_reload = None;
        // Adds under way are given up (their devices deleted, their workers ended),
        // not left half-made, and their clients told so.
        self.give_up_pending_adds(None, "ublkd stopped");
        self.answer_recovers(true);
        self.advance_upgrades(true);
        self.finish_deletes(true);
        let mut serving_on = 0;
        if !self.devices.is_empty() {
            // Deleting is explicit (`ublkctl del`, `shutdown`, a reload): a stop or a
            // restart must not pull block devices from under their users.
            let serving =
                self.devices.values().filter(|d| d.state().kind() == StateKind::Live).count();
            tracing::info!(
                event = "stopping",
                "stopping: leaving {} device(s) to the next ublkd, {serving} of them served \
                 on by their workers meanwhile (the others' I/O is held until it recovers \
                 them)",
                self.devices.len()
            );
            self.leave_all();
            serving_on = serving;
        }
        if let Some(relay) = crate::worker_log::Relay::get() {
            relay.flush(Duration::from_secs(1), serving_on);
        }
        let _ = std::fs::remove_file(&self.config.daemon.socket);
        tracing::info!("ublkd exits");
        Ok(())
    }

    /// Recovers every woken device whose worker died, within its restart budget, and
    /// starts the busy devices' standbys that are due. A device not woken saw no worker
    /// of its end and no starting standby answer, and costs no wait4 per worker.
    pub(super) fn handle_deaths(&mut self, woke: Instant) {
        let mut starting = self.standbys_starting();
        let mut spawned = 0;
        for id in self.devices.busy_ids() {
            // A mass death (every worker OOM-killed) is hundreds of recoveries, one
            // after another: past a turn's share, the rest wait for the next turn (the
            // wait set names them again), so that clients, hangs and the watchdog are
            // served between them and `ublkctl status` shows the recovery progress.
            if woke.elapsed() > DEATHS_PER_TURN {
                break;
            }
            let events = self.devices.take_woken(id);
            let Some(dev) = self.devices.visit(id) else { continue };
            if events {
                dev.standby_progress();
            }
            if starting < STANDBYS_STARTING_AT_ONCE
                && spawned < STANDBYS_SPAWNED_PER_TURN
                && dev.starting().is_none()
            {
                dev.refill_standby_if_due(&self.ctx, woke);
                let started = usize::from(dev.starting().is_some());
                (starting, spawned) = (starting + started, spawned + started);
            }
            if !events {
                continue;
            }
            if let Some(how) = dev.standby_exited() {
                tracing::warn!(dev_id = id, "{how}; starting another");
                dev.refill_standby(&self.ctx);
            }
            let pid = dev.worker().map(|w| w.pid());
            let Some(death) = dev.worker_exited(woke) else { continue };
            tracing::error!(dev_id = id, worker_pid = pid, event = "worker_died", "{}", death.how);
            let rc = &self.config.recovery;
            let counts = !death.backend_lost;
            let event =
                recovery::after_death(dev, &self.ctx, rc, &death.reason(), counts, &self.notifier);
            self.last_event = Some(event);
        }
    }

    /// How many standbys are starting (spawned, not yet standing by): every device with
    /// one is busy.
    pub(super) fn standbys_starting(&self) -> usize {
        self.devices.busy().filter(|d| d.starting().is_some()).count()
    }

    /// Goes on with every recovery that waits for the kernel's release and is due
    /// (every device with one is busy).
    pub(super) fn continue_recoveries(&mut self) {
        let now = Instant::now();
        for id in self.devices.busy_ids() {
            let Some(dev) = self.devices.visit(id) else { continue };
            if let Some(event) =
                recovery::continue_if_due(dev, &self.ctx, &self.config.recovery, now)
            {
                self.last_event = Some(event);
            }
        }
    }

    /// How often the loop scans every device for hangs: heartbeats are compared four
    /// times per timeout, so a hang is seen within 1.5 timeouts (the no-completion rule
    /// holds on two scans in a row). No more often: an idle device's scan is the only
    /// thing that wakes ublkd, and each costs CPU in proportion to the devices (much of
    /// it on an emulated machine). The watchdog's interval shortens it.
    fn tick(&self) -> Duration {
        let tick = (self.config.recovery.hung_timeout / 4).max(Duration::from_millis(100));
        match self.notifier.watchdog_interval() {
            Some(w) => tick.min(w),
            None => tick,
        }
    }

    /// The tick's scan at `now`: kills hung workers (their deaths then wake the loop
    /// like any other), counts the devices making no progress for the watchdog's log
    /// line, and marks busy any device that needs turns.
    ///
    /// Every other tick looks at every device, with every disk's numbers read at once
    /// (`/proc/diskstats`: at 1000 devices most of ublkd's idle CPU, nearly all of it
    /// the kernel's, which walks its disk list again for each page it returns). The
    /// ticks between look only at the devices the last look found with I/O in flight,
    /// a thread in a turn or a hang suspected, each through its own stat file, unless
    /// there are more than [`WATCHED_ALONE_MAX`] of them. An idle device's hang is then
    /// seen at most one tick later (`HangWatch` counts its I/O from at most one tick
    /// back, so it is never seen early).
    fn scan(&mut self, now: Instant) {
        let rc = &self.config.recovery;
        let every = self.full_scan_next || self.watched_devices > WATCHED_ALONE_MAX;
        if every {
            self.disk_stats.refresh();
        } else {
            self.disk_stats.forget();
        }
        self.full_scan_next = !every;
        let disks = &self.disk_stats;
        let (mut stalled, mut watched) = (0, 0);
        self.devices.scan(|dev| {
            let killed =
                (every || dev.hang_watched()) && recovery::kill_if_hung(dev, rc, now, disks);
            stalled += usize::from(!dev.progressing(now, rc.hung_timeout));
            watched += usize::from(dev.hang_watched());
            killed
        });
        self.hung_devices = stalled;
        self.watched_devices = watched;
        self.follow_image_sizes();
    }

    /// Counts the devices by state for systemd's STATUS line when a device changed: at
    /// once for a new event, else at most every [`STATUS_EVERY`], since each count
    /// visits every device.
    fn update_status(&mut self, now: Instant) {
        self.status_stale |= self.devices.take_changed();
        let new_event = self.last_event != self.status_event;
        if !self.status_stale || (now < self.status_due && !new_event) {
            return;
        }
        let status = self.summary();
        self.notifier.status(&status);
        self.status_event.clone_from(&self.last_event);
        self.status_stale = false;
        self.status_due = now + STATUS_EVERY;
    }

    /// Leaves every LIVE device's worker serving, kills the workers that must not serve
    /// on (a killed worker's device is held by the kernel from this moment, for the
    /// next ublkd to recover), and asks the spares to exit, waiting for them up to
    /// `SPARES_END_WAIT` (then killing them), so that the relay logs their last lines.
    pub(super) fn leave_all(&mut self) {
        let left: Vec<Left> = self.devices.take_all().into_iter().map(Device::leave).collect();
        left.iter().for_each(Left::signal);
        let mut spares = Vec::new();
        for Left { to_kill, spare } in left {
            spares.extend(spare);
            for mut w in to_kill {
                let pid = w.pid();
                let how = w.reap(Duration::ZERO);
                tracing::debug!(worker_pid = pid, "worker ended: {how}");
            }
        }
        // The spares exit side by side, each closing what its target opened; one that
        // has not within the wait (still connecting) is killed.
        let deadline = Instant::now() + SPARES_END_WAIT;
        for mut spare in spares {
            let pid = spare.pid();
            let how = spare.reap(deadline.saturating_duration_since(Instant::now()));
            tracing::debug!(worker_pid = pid, "spare ended: {how}");
        }
    }
}
