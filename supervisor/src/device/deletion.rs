//! Deleting devices: STOP_DEV, the workers' exit within their grace, the NBD sessions
//! ended, the record set aside and DEL_DEV ([`Device::delete_all`]), many at once on
//! threads of their own; and leaving a device to the next ublkd ([`Device::leave`]).
//!
//! A safe delete (all but `--force`) takes no device whose disk is open: the kernel's
//! TRY_STOP_DEV refuses it atomically where the device has `UBLK_F_SAFE_STOP_DEV`;
//! elsewhere ublkd holds an exclusive open of the disk across STOP_DEV
//! ([`crate::in_use`]). A device refused is given back untouched, to be served on.
//!
//! STOP_DEV waits in the kernel until every request the worker holds is answered. An
//! rbd worker holds its requests for as long as the Ceph cluster is away (librbd's
//! default), so an rbd device's STOP_DEV that has not returned within
//! [`HELD_IO_GRACE`] has its worker told to fail them with EIO, and STOP_DEV ends (see
//! [`Device::stop_unheld`]). Killing the worker would not do: the kernel holds a dead
//! worker's requests for its successor (tried on 7.x: STOP_DEV still waited 20 s
//! after the kill). A delete, and a SIGTERM that waits for it, never waits on the
//! cluster.

#![allow(unused_imports)]
use super::*;

use std::collections::{BTreeMap, BTreeSet};

use ublkd_proto::uapi;

use crate::in_use::{Claim, InUse, Roots, claim_all, disk_name};

/// The most devices [`Device::delete_all`] deletes at once. Much of a delete is
/// waiting (STOP_DEV and DEL_DEV sleep in the kernel, the workers exit on their own
/// CPU time), so more threads than CPUs pay, up to where the CPUs are the limit (under
/// emulation they soon are: 300 deletes overlapped 14.5 at a time on average).
pub(super) const DELETE_THREADS: usize = 16;

/// Which devices a delete may take while their disks are in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Safety {
    /// Every device, whatever holds it (`--force`): STOP_DEV.
    Force,
    /// Each device whose disk is free; the others are kept, served (a reload).
    Each,
    /// Every device if every disk is free, else none (`del`, `del -a`, `shutdown`).
    AllOrNothing,
}

/// How one delete stops its device.
#[derive(Debug)]
enum Stop {
    /// STOP_DEV, whatever holds the disk.
    Force,
    /// TRY_STOP_DEV: the kernel refuses (EBUSY) while the disk is open.
    Try,
    /// STOP_DEV with ublkd's exclusive open of the disk held across it, so that nobody
    /// mounts it in between (dropped right after: DEL_DEV waits for every opener).
    Holding(Option<std::fs::File>),
}

/// How long a delete asks again while the only holds on its disks are transient
/// ([`crate::in_use::Holder::transient`]: udev's probe after an add or a close).
const TRANSIENT_WAIT: Duration = Duration::from_secs(2);
/// How often it asks meanwhile.
const TRANSIENT_POLL: Duration = Duration::from_millis(100);

/// How long an rbd device's STOP_DEV may wait for the requests its worker holds
/// before the worker is told to fail them (see the module's doc). A cluster that is up answers
/// them in milliseconds; one that has not in this long is away, and a delete (which
/// already has the device's disk free, or was forced) must not wait for it.
pub(super) const HELD_IO_GRACE: Duration = STOP_GRACE;

/// Why a device was not deleted and is given back, to be served as before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Its disk is in use.
    InUse(InUse),
    /// Whether its disk is in use could not be checked.
    Unchecked { id: u32, why: String },
    /// It is free, but another device of the same request is not.
    Others,
}

impl Refusal {
    /// The sentence naming what was wrong (`None` for [`Refusal::Others`]).
    pub fn what(&self) -> Option<String> {
        match self {
            Refusal::InUse(in_use) => Some(in_use.to_string()),
            Refusal::Unchecked { id, why } => {
                Some(format!("cannot tell whether device {id} is in use: {why}"))
            }
            Refusal::Others => None,
        }
    }

    /// What frees it.
    pub fn remedy(&self) -> String {
        match self {
            Refusal::InUse(in_use) => in_use.holder.remedy(),
            Refusal::Unchecked { .. } | Refusal::Others => "free it".into(),
        }
    }
}

/// How one device's delete ended.
#[derive(Debug)]
pub enum Deletion {
    Deleted,
    /// The delete failed part way: the device is no longer served (see
    /// [`Device::destroy_with`]).
    Failed(DeviceError),
    /// Not deleted, nothing done to it: the device, to be served as before.
    Kept(Box<Device>, Refusal),
}

/// Where each delete under way stands, by device, for a delete that must answer before
/// it is done.
#[derive(Debug, Clone, Default)]
pub struct Stages(std::sync::Arc<Mutex<BTreeMap<u32, &'static str>>>);

impl Stages {
    fn set(&self, id: u32, what: &'static str) {
        lock(&self.0).insert(id, what);
    }

    /// Each device's stage, by id.
    pub fn now(&self) -> Vec<(u32, &'static str)> {
        lock(&self.0).iter().map(|(id, what)| (*id, *what)).collect()
    }
}

impl Device {
    /// Deletes `devices` as `safety` allows (each stopped with TRY_STOP_DEV where its
    /// flags have `UBLK_F_SAFE_STOP_DEV`, else with ublkd's exclusive open of its disk
    /// held across STOP_DEV), up to `DELETE_THREADS` (16) at once, and returns each
    /// one's outcome. A device found in use is given back untouched
    /// ([`Deletion::Kept`]); with [`Safety::AllOrNothing`], if any is, every one is.
    pub fn delete_all(
        shared: &CtrlClient,
        state: &StateDir,
        devices: Vec<Device>,
        safety: Safety,
        stages: &Stages,
    ) -> Vec<(u32, Deletion)> {
        if safety == Safety::Force {
            let stops = devices.into_iter().map(|d| (d, Stop::Force)).collect();
            return Self::destroy_each(shared, state, stops, stages);
        }
        for dev in &devices {
            stages.set(dev.id, "checking whether its disk is in use");
        }
        // The kernel checks the devices it can stop safely; ublkd claims the others'
        // disks itself (and checks every disk first, so that a request that takes many
        // devices takes none if one of them is busy).
        let safe: BTreeSet<u32> = devices
            .iter()
            .map(Device::id)
            .filter(|&id| {
                shared.get_dev_info(id).is_ok_and(|i| i.flags & uapi::UBLK_F_SAFE_STOP_DEV != 0)
            })
            .collect();
        let ids: Vec<u32> = devices.iter().map(Device::id).collect();
        let hold: BTreeSet<u32> = ids.iter().copied().filter(|id| !safe.contains(id)).collect();
        let roots = Roots::default();
        let give_up = Instant::now() + TRANSIENT_WAIT;
        let mut claims = loop {
            let claims = claim_all(&roots, &ids, &hold);
            let transient = claims.values().any(|c| matches!(c, Claim::Busy(h) if h.transient()));
            let lasting = claims.values().any(|c| matches!(c, Claim::Busy(h) if !h.transient()));
            if !transient || lasting || Instant::now() >= give_up {
                break claims;
            }
            drop(claims);
            std::thread::sleep(TRANSIENT_POLL);
        };
        let mut refusals = BTreeMap::new();
        let mut stops = BTreeMap::new();
        for id in ids {
            match claims.remove(&id) {
                Some(Claim::Busy(holder)) => {
                    refusals.insert(id, Refusal::InUse(InUse { id, holder }));
                }
                Some(Claim::Unchecked(e)) if !safe.contains(&id) => {
                    let why = format!("cannot open /dev/{}: {e}", disk_name(id));
                    refusals.insert(id, Refusal::Unchecked { id, why });
                }
                // Opened or not, TRY_STOP_DEV checks again.
                _ if safe.contains(&id) => {
                    stops.insert(id, Stop::Try);
                }
                Some(Claim::Free(file)) => {
                    stops.insert(id, Stop::Holding(file));
                }
                Some(Claim::Unchecked(_)) | None => {
                    stops.insert(id, Stop::Holding(None));
                }
            }
        }
        if safety == Safety::AllOrNothing && !refusals.is_empty() {
            // Dropping the stops closes the disks claimed.
            return devices
                .into_iter()
                .map(|dev| {
                    let why = refusals.remove(&dev.id).unwrap_or(Refusal::Others);
                    (dev.id, Deletion::Kept(Box::new(dev), why))
                })
                .collect();
        }
        let mut outcomes = Vec::new();
        let mut to_delete = Vec::new();
        for dev in devices {
            match (refusals.remove(&dev.id), stops.remove(&dev.id)) {
                (None, Some(stop)) => to_delete.push((dev, stop)),
                (why, _) => {
                    let why = why.unwrap_or(Refusal::Others);
                    outcomes.push((dev.id, Deletion::Kept(Box::new(dev), why)));
                }
            }
        }
        outcomes.extend(Self::destroy_each(shared, state, to_delete, stages));
        outcomes
    }

    /// Deletes every one of `devices`, each stopped as it says, up to
    /// `DELETE_THREADS` (16) at once. Each device's delete sleeps in the kernel
    /// (STOP_DEV, DEL_DEV) and waits for its workers to exit: ~100 ms under emulation,
    /// which one device after another made minutes of a thousand. Each thread sends its
    /// commands on a control client of its own (`shared` is the one of last resort),
    /// since a client runs one command at a time.
    fn destroy_each(
        shared: &CtrlClient,
        state: &StateDir,
        devices: Vec<(Device, Stop)>,
        stages: &Stages,
    ) -> Vec<(u32, Deletion)> {
        let count = devices.len();
        let queue = Mutex::new(devices);
        let outcomes = Mutex::new(Vec::with_capacity(count));
        let work = |ctrl: &CtrlClient| {
            loop {
                // Its own statement: the guard must not live through the delete.
                let next = lock(&queue).pop();
                let Some((dev, stop)) = next else { break };
                let id = dev.id;
                let outcome = dev.destroy_with(ctrl, state, stop, stages);
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

    /// Stops the device (as `stop` says: a refusal gives it back untouched), then its
    /// workers' exit, DEL_DEV (which waits for `/dev/ublkcN` to be released), and its
    /// state.
    fn destroy_with(
        mut self,
        ctrl: &CtrlClient,
        state: &StateDir,
        stop: Stop,
        stages: &Stages,
    ) -> Deletion {
        let id = self.id;
        let started = Instant::now();
        stages.set(id, "stopping it (STOP_DEV)");
        let (stopped, gave_up) = self.stop_unheld(|| match stop {
            Stop::Force | Stop::Holding(None) => Ok(ctrl.stop_dev(id)),
            Stop::Holding(Some(claim)) => {
                let stopped = ctrl.stop_dev(id);
                drop(claim);
                Ok(stopped)
            }
            Stop::Try => {
                let give_up = Instant::now() + TRANSIENT_WAIT;
                loop {
                    match ctrl.try_stop_dev(id) {
                        Err(e) if e.errno() == Some(libc::EBUSY) => {
                            let holder = Roots::default().holder(id, std::process::id());
                            if holder.transient() && Instant::now() < give_up {
                                std::thread::sleep(TRANSIENT_POLL);
                                continue;
                            }
                            return Err(Refusal::InUse(InUse { id, holder }));
                        }
                        // No disk (never started, or stopped already): nothing holds it.
                        Err(e) if e.errno() == Some(libc::ENODEV) => break Ok(Ok(())),
                        other => break Ok(other),
                    }
                }
            }
        });
        let stopped = match stopped {
            Ok(stopped) => stopped,
            Err(why) => return Deletion::Kept(Box::new(self), why),
        };
        match self.finish_delete(ctrl, state, stopped, started, stages, gave_up) {
            Ok(()) => Deletion::Deleted,
            Err(e) => Deletion::Failed(e),
        }
    }

    /// Runs `stop` (the device's STOP_DEV) and, for an rbd device, has its serving
    /// worker give up the requests it holds if `stop` has not returned within
    /// [`HELD_IO_GRACE`] (`ToWorker::GiveUpHeld`: they wait on a Ceph cluster that is
    /// away, and STOP_DEV waits for them): the worker fails them with EIO, and STOP_DEV
    /// goes on. A stop that returns in time (every delete while the cluster answers)
    /// changes nothing. Other targets' workers answer their requests by themselves (an
    /// nbd worker within its request timeout), and are not asked. Returns `stop`'s
    /// outcome, and whether the worker was told to give up.
    fn stop_unheld<T>(&self, stop: impl FnOnce() -> T) -> (T, bool) {
        let (Some(_), Some(worker)) = (&self.rbd, self.worker()) else { return (stop(), false) };
        let (id, pid) = (self.id, worker.pid());
        let control = match worker.control().try_clone_to_owned() {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(
                    dev_id = id,
                    "cannot watch STOP_DEV for requests held on the cluster \
                     (cannot copy worker {pid}'s control socket: {e})"
                );
                return (stop(), false);
            }
        };
        let (stopped, watch) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let watchdog = std::thread::Builder::new()
                .name(format!("ublkd-held-{id}"))
                .spawn_scoped(scope, move || {
                    // The sender dropped (STOP_DEV returned) ends the wait at once.
                    if watch.recv_timeout(HELD_IO_GRACE)
                        != Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                    {
                        return false;
                    }
                    tracing::warn!(
                        dev_id = id,
                        worker_pid = pid,
                        event = "delete_held_io",
                        "STOP_DEV has waited {} s for the requests worker {pid} holds (the \
                         Ceph cluster does not answer them): the worker fails them with EIO, \
                         so that the delete goes on",
                        HELD_IO_GRACE.as_secs()
                    );
                    // Never waits (the socket is the worker's, whatever it does with it).
                    let give_up = ublkd_proto::msg::ToWorker::GiveUpHeld;
                    if let Err(e) =
                        ublkd_proto::msg::try_send_packet(control.as_fd(), &give_up, &[])
                    {
                        tracing::warn!(dev_id = id, "cannot tell worker {pid} to give up: {e}");
                    }
                    true
                });
            if let Err(e) = &watchdog {
                tracing::warn!(
                    dev_id = id,
                    "STOP_DEV unwatched: a request held on the cluster would hold the delete \
                     (cannot start a thread: {e})"
                );
            }
            let out = stop();
            drop(stopped);
            let gave_up = watchdog.is_ok_and(|w| w.join().unwrap_or(false));
            (out, gave_up)
        })
    }

    /// The rest of a delete once the device is stopped (or failed to stop): its workers'
    /// exit, DEL_DEV, its record. Workers whose held requests were given up
    /// (`gave_up`: the Ceph cluster is away) are killed rather than asked to exit: a
    /// clean exit gives back the image's lock and closes the image, which waits on the
    /// cluster, so asking would only cost the stop grace.
    fn finish_delete(
        &mut self,
        ctrl: &CtrlClient,
        state: &StateDir,
        stopped: Result<(), CtrlError>,
        started: Instant,
        stages: &Stages,
        gave_up: bool,
    ) -> Result<(), DeviceError> {
        let id = self.id;
        let stop_done = Instant::now();
        stages.set(id, "waiting for its workers to exit");
        let serving = self.worker().map(Worker::pid);
        let workers = self.take_workers();
        // Asked at once, the workers exit side by side.
        for worker in &workers {
            if gave_up { worker.kill() } else { worker.ask_to_exit() }
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
        stages.set(id, "deleting it (DEL_DEV waits until every opener of its disk has closed it)");
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
