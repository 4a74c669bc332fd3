//! Adopting the devices a previous ublkd left: checking that each is ublkd's and
//! matches its record, and taking over the worker that served on, else leaving the
//! device to a recovery.

use super::{ATTACH_TIMEOUT, Context, Device, DeviceError, STOP_GRACE};
use crate::device_state::DeviceState;
use crate::state::{DeviceRecord, OWNER_TAG};
use crate::target::device_flags;
use crate::worker::Worker;
use ublkd_proto::uapi::{self, DevState};

impl Device {
    /// Adopts a device a previous supervisor left: checks that the kernel's device is
    /// ours and matches the record, and starts the worker that will serve it, without
    /// waiting for it: the caller recovers the device onto it ([`Self::recover`]) once
    /// every adopted device's worker is on its way, so that they start side by side.
    pub fn adopt(ctx: &Context, rec: &DeviceRecord) -> Result<Device, DeviceError> {
        let id = rec.id;
        let info = ctx.ctrl.get_dev_info(id)?;
        let not_ours = |why: String| DeviceError::NotOurs { id, why };
        if info.ublksrv_flags != OWNER_TAG {
            return Err(not_ours(format!("its ublksrv_flags are {:#x}", info.ublksrv_flags)));
        }
        if (info.nr_hw_queues, info.queue_depth) != (rec.queues, rec.queue_depth) {
            return Err(not_ours("its queues differ from ublkd's record".into()));
        }
        // ublkd creates privileged devices as root: a device with its tag that is
        // neither was made by someone else, who may have copied the tag.
        if info.owner_uid != 0 || info.owner_gid != 0 {
            return Err(not_ours(format!(
                "it belongs to uid {} gid {}, not root",
                info.owner_uid, info.owner_gid
            )));
        }
        if info.flags & uapi::UBLK_F_UNPRIVILEGED_DEV != 0 {
            return Err(not_ours("it is an unprivileged device".into()));
        }
        let spec = rec.spec().map_err(not_ours)?;
        // The worker's batch elements depend on it: a mismatch would fail every PREP.
        if info.flags & uapi::UBLK_F_AUTO_BUF_REG
            != device_flags(&spec, ctx.kernel_features) & uapi::UBLK_F_AUTO_BUF_REG
        {
            return Err(not_ours("its zero-copy flag differs from ublkd's record".into()));
        }
        if DevState::from_raw(info.state) == DevState::Dead {
            // Created but never started: the previous supervisor died mid-create. It
            // never served anything; the caller deletes it rather than leak its id.
            return Err(DeviceError::NeverStarted { id });
        }
        let mut dev = Self::open(ctx, id, spec, DeviceState::Adopted)?;
        // What the kernel device was made from: a server that comes back without a
        // feature it was told of is refused, after a restart as after a reconnect.
        if let (Some(target), Some(export)) = (dev.nbd.as_mut(), rec.export) {
            target.adopt_export(export);
        }
        // LIVE: a worker serves it still (the kernel moves a device whose server has
        // gone out of LIVE); else it is held for a recovery.
        if DevState::from_raw(info.state) != DevState::Live || !dev.take_over(ctx) {
            dev.transition(DeviceState::Recovering)?;
            // The worker its recovery needs: now.
            dev.refill_standby(ctx);
        } else {
            // A spare: after a restart with a thousand devices, a thousand of them would
            // start at once, beside the workers serving.
            dev.schedule_standby();
        }
        Ok(dev)
    }

    /// Takes over the worker the previous ublkd left serving, as its claim in the state
    /// dir names it: whether it did (the device is then LIVE). One that cannot be taken
    /// over is killed (if it is that worker), for the caller to recover the device.
    fn take_over(&mut self, ctx: &Context) -> bool {
        let id = self.id;
        let claim = match ctx.state.worker_claim(id) {
            Ok(Some(claim)) => {
                // Whether or not the worker is taken over, its successors may fence it.
                if let Some(target) = &mut self.rbd {
                    target.adopt_clients(&claim.rbd_clients);
                }
                claim
            }
            Ok(None) => {
                tracing::warn!(dev_id = id, "LIVE, but no worker is recorded for it");
                return false;
            }
            Err(e) => {
                tracing::warn!(dev_id = id, "not taking its worker over: {e}");
                return false;
            }
        };
        let attached = if claim.generation == self.generation {
            Worker::attach(&claim, self.fast_release(ctx), ATTACH_TIMEOUT)
                .map_err(|e| e.to_string())
        } else {
            Err(format!(
                "worker {} was recorded for generation {}, the region is at {}",
                claim.pid, claim.generation, self.generation
            ))
        };
        match attached {
            Ok(worker) => {
                let pid = worker.pid();
                if let Some(target) = &mut self.nbd {
                    target.took_over(id, &worker);
                }
                if self.serve(worker, None).is_err() {
                    return false;
                }
                tracing::info!(
                    dev_id = id,
                    worker_pid = pid,
                    generation = self.generation,
                    event = "taken_over",
                    "took over the worker a previous ublkd left serving"
                );
                self.watch_new_worker();
                true
            }
            Err(why) => {
                tracing::warn!(dev_id = id, "not taking its worker over ({why}): recovering");
                if !Worker::kill_claimed(&claim, STOP_GRACE) {
                    tracing::warn!(
                        dev_id = id,
                        worker_pid = claim.pid,
                        "the worker did not end within {} s of SIGKILL",
                        STOP_GRACE.as_secs()
                    );
                }
                false
            }
        }
    }
}
