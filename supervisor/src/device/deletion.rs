//! Deleting devices: STOP_DEV, the workers' exit within their grace, the NBD sessions
//! ended, the record set aside and DEL_DEV ([`Device::destroy`]), many at once on
//! threads of their own; and leaving a device to the next ublkd ([`Device::leave`]).

#![allow(unused_imports)]
use super::*;

/// The most devices [`Device::destroy_all`] deletes at once. Much of a delete is
/// waiting (STOP_DEV and DEL_DEV sleep in the kernel, the workers exit on their own
/// CPU time), so more threads than CPUs pay, up to where the CPUs are the limit (under
/// emulation they soon are: 300 deletes overlapped 14.5 at a time on average).
pub(super) const DELETE_THREADS: usize = 16;

impl Device {
    /// Stops and deletes the device: STOP_DEV, the workers' exit, DEL_DEV (which waits
    /// for `/dev/ublkcN` to be released), and its state.
    pub fn destroy(self, ctx: &Context) -> Result<(), DeviceError> {
        self.destroy_with(&ctx.ctrl, &ctx.state)
    }

    /// Deletes every one of `devices` ([`Self::destroy`]), up to `DELETE_THREADS` (16) at
    /// once, and returns each one's outcome. Each device's delete sleeps in the kernel
    /// (STOP_DEV, DEL_DEV) and waits for its workers to exit: ~100 ms under emulation,
    /// which one device after another made minutes of a thousand. Each thread sends its
    /// commands on a control client of its own, since a client runs one command at a
    /// time.
    pub fn destroy_all(ctx: &Context, devices: Vec<Device>) -> Vec<(u32, Result<(), DeviceError>)> {
        Self::destroy_each(&ctx.ctrl, &ctx.state, devices)
    }

    /// [`Self::destroy_all`] with `ctrl` as the control client of last resort (each
    /// helper thread opens its own): for a thread of its own, off ublkd's loop.
    pub fn destroy_each(
        shared: &CtrlClient,
        state: &StateDir,
        devices: Vec<Device>,
    ) -> Vec<(u32, Result<(), DeviceError>)> {
        let count = devices.len();
        let queue = Mutex::new(devices);
        let outcomes = Mutex::new(Vec::with_capacity(count));
        let work = |ctrl: &CtrlClient| {
            loop {
                // Its own statement: the guard must not live through the delete.
                let next = lock(&queue).pop();
                let Some(dev) = next else { break };
                let id = dev.id;
                let outcome = dev.destroy_with(ctrl, state);
                lock(&outcomes).push((id, outcome));
            }
        };
        std::thread::scope(|scope| {
            // This thread works through the queue too: if no helper starts, it deletes
            // every device itself, one after another as before.
            for n in 1..DELETE_THREADS.min(count) {
                let helper = std::thread::Builder::new()
                    .name(format!("ublkd-delete-{n}"))
                    .spawn_scoped(scope, || match CtrlClient::open() {
                        Ok(own) => work(&own),
                        Err(e) => {
                            tracing::warn!("deleting with the shared control client: {e}");
                            work(shared)
                        }
                    });
                if let Err(e) = helper {
                    tracing::warn!("deleting with fewer threads: cannot start one: {e}");
                    break;
                }
            }
            work(shared);
        });
        outcomes.into_inner().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn destroy_with(
        mut self,
        ctrl: &CtrlClient,
        state: &StateDir,
    ) -> Result<(), DeviceError> {
        let id = self.id;
        let started = Instant::now();
        let stopped = ctrl.stop_dev(id);
        let stop_done = Instant::now();
        let serving = self.worker().map(Worker::pid);
        let workers = self.take_workers();
        // Asked at once, the workers exit side by side.
        for worker in &workers {
            worker.ask_to_exit();
        }
        let mut served_cleanly = false;
        for worker in workers {
            let pid = worker.pid();
            let (how, clean) = worker.finish(STOP_GRACE);
            if Some(pid) == serving {
                served_cleanly = clean;
            }
            tracing::info!(dev_id = id, worker_pid = pid, "worker ended: {how}");
        }
        if let Some(target) = self.nbd.take() {
            // Only once the kernel has stopped the device has every request been
            // answered: a worker told to exit before that may leave one half sent.
            target.close(id, served_cleanly && stopped.is_ok());
        }
        let workers_done = Instant::now();
        // Out of the id's place first: once deleted, the id may go to a new device.
        let aside = state.set_aside(id);
        let deleted = ctrl.del_dev(id);
        match (&deleted, aside) {
            (Ok(()), Ok(Some(aside))) => state.forget_aside(&aside),
            (Ok(()), Ok(None)) => {}
            (Ok(()), Err(e)) => {
                tracing::warn!(dev_id = id, "its record could not be set aside ({e}): removed");
                state.remove(id);
            }
            (Err(_), Ok(Some(aside))) => state.put_back(&aside, id),
            (Err(_), _) => {}
        }
        stopped?;
        deleted?;
        tracing::info!(
            dev_id = id,
            event = "deleted",
            stop_ms = stop_done.duration_since(started).as_millis() as u64,
            workers_ms = workers_done.duration_since(stop_done).as_millis() as u64,
            del_ms = workers_done.elapsed().as_millis() as u64,
            "device deleted"
        );
        Ok(())
    }

    /// Leaves the device to the next ublkd (a stop, not a delete): the device and its
    /// state stay. A LIVE device's worker serves on, for the next ublkd to take over.
    /// The others are handed back: a hung or failing-I/O device's worker (and one a
    /// recovery was ending) to be killed, so that the kernel holds that device's I/O
    /// until the next ublkd recovers it; the spare apart, to be asked to exit (see
    /// [`Left`]).
    pub fn leave(mut self) -> Left {
        // A LIVE device's worker serves on, for the next ublkd to take over.
        match std::mem::replace(&mut self.state, DeviceState::Recovering) {
            DeviceState::Live { worker } => worker.leave_serving(),
            other => self.state = other,
        }
        let spare = self.spare.take();
        let state = std::mem::replace(&mut self.state, DeviceState::Recovering);
        Left { to_kill: state.into_workers(), spare }
    }

    /// Every worker the device has, whatever it is doing.
    pub(super) fn take_workers(&mut self) -> Vec<Worker> {
        let state = std::mem::replace(&mut self.state, DeviceState::Recovering);
        state.into_workers().into_iter().chain(self.spare.take()).collect()
    }
}

/// The workers a device left to the next ublkd hands back ([`Device::leave`]).
#[derive(Debug)]
pub struct Left {
    /// Workers that must not serve on: killed.
    pub to_kill: Vec<Worker>,
    /// The spare (standing by or starting), which serves nothing: asked to exit, so
    /// that it gives back what its target holds outside, which a kill would leave
    /// behind (an RBD spare's watch on its image, which the cluster keeps for its watch
    /// timeout, 30 s by default; seen in CI to hold a later delete's close on the same
    /// image past the worker's grace).
    pub spare: Option<Worker>,
}

impl Left {
    /// Kills the workers to kill and asks the spare to exit, waiting for none of them
    /// (a caller that then drops them leaves each to `reap_lingering`, once it ends).
    pub fn signal(&self) {
        for worker in &self.to_kill {
            worker.kill();
        }
        if let Some(spare) = &self.spare {
            spare.ask_to_exit();
        }
    }
}
