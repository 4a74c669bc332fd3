//! A queue thread's io_uring, made while the worker stands by: created disabled, with
//! everything registered that does not need the device, restricted and enabled before
//! the device is known. Activation then only registers `/dev/ublkcN` and hands the ring
//! to the loop ([`QueueThread`]).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use io_uring::{IoUring, cqueue, squeue};
use ublkd_proto::batch::{ElemBuf, ElemFormat};
use ublkd_proto::msg::{DataPath, WorkerSetup};

use super::LoopError;
use super::plan::{ThreadPlan, pin_to_cpu};
use super::thread::{QueueState, QueueThread};
use crate::bufring::BufRing;
use crate::device::Device;
use crate::target::TARGET_FIXED_FD;

/// Index of `/dev/ublkcN` in each ring's registered files. Registered, not used by its
/// plain fd: a command holds a reference to a plain fd's file, and ublk does not end a
/// batch FETCH that is busy delivering when its worker dies until the device's file is
/// released, so a worker killed at that moment would leave the file held for good,
/// and the device never recovered. A registered file is let go when io_uring tears
/// the dead worker's ring down, which a recovery would wait for; with
/// `recovery.fast_release` (the default) the supervisor, which holds a copy of each
/// ring, unregisters it at once instead (see `msg::FromWorker::Standby`).
pub const UBLKC_FIXED_FD: u32 = 1;

/// The PREP/COMMIT element format: kernel-copy mode names each tag's buffer address;
/// zero copy (`UBLK_F_AUTO_BUF_REG`) only the buffer index, in the header, with the
/// fallback flag. Without it, a request whose pages the kernel cannot register in the
/// fetching ring is failed with EIO. That happens to a worker killed while its FETCH
/// delivers: the delivery goes on into the dead worker's ring, whose buffer table the
/// supervisor has already unregistered (`recovery.fast_release`); an application saw
/// EIO across `ublkctl upgrade`. With the flag the request is delivered unregistered,
/// so the dead worker owns it like any other, and the release re-issues it to the next
/// worker. A live worker never sees it (see `LoopError::PagesNotRegistered`).
pub fn elem_format(zero_copy: bool) -> ElemFormat {
    if zero_copy { ElemFormat::ZERO_COPY } else { ElemFormat::WITH_BUF_ADDR }
}

/// A thread's ring made while the worker stands by: created disabled, with the
/// target's file and the FETCH buffer rings registered and a free file slot for
/// `/dev/ublkcN`, which the worker only gets when it is activated. Activation is then
/// one file update, the ring's restrictions, enabling it, and PREP: a recovery does not
/// wait for rings to be created.
pub struct StandbyRing {
    ring: IoUring<squeue::Entry, cqueue::Entry>,
    plan: ThreadPlan,
    queues: Vec<QueueState>,
    nr_tags: usize,
    entries: u32,
}

impl StandbyRing {
    /// Creates the ring for `setup`'s device, registering `target_file` (if the target
    /// has one) at [`TARGET_FIXED_FD`] and on the batched path one buffer ring per
    /// queue the thread serves,
    /// and for zero copy an empty buffer table the kernel registers requests' pages in;
    /// then restricts it (if `restricted`, see `sandbox::restrict_ring`) and enables
    /// it, all before the device is there. Pins the calling thread (the ring's owner)
    /// to `cpu` first.
    pub fn new(
        plan: ThreadPlan,
        setup: &WorkerSetup,
        target_file: Option<RawFd>,
        cpu: Option<usize>,
        restricted: bool,
    ) -> Result<Self, LoopError> {
        let (nr_queues, depth, zero_copy) = (setup.nr_queues, setup.queue_depth, setup.zero_copy);
        let thread = plan.index;
        let ring_err = |source| LoopError::Ring { thread, source };
        // Like kublk: a queue thread that stays on one CPU serves a loop device
        // faster (see `pin_to_cpu`). The thread calling this is the ring's owner.
        if let Some(cpu) = cpu {
            pin_to_cpu(cpu);
        }
        let tags = plan.queues.len() * usize::from(depth);
        // One slot per tag (target I/O, or a per-I/O command) plus a FETCH and a COMMIT
        // per queue, with room.
        let entries = (tags + 4 * plan.queues.len() + 8).next_power_of_two().min(4096) as u32;
        let mut builder = IoUring::<squeue::Entry, cqueue::Entry>::builder();
        // Completions (FETCH batches, target I/O) run as task work when this thread
        // enters the kernel, not by interrupting it; with DEFER_TASKRUN only when it
        // waits for them, which serves a loop device faster. But DEFER_TASKRUN needs
        // SINGLE_ISSUER, and the kernel lets no one but the single issuer unregister a
        // ring's files: with `fast_release` the supervisor does that once this worker
        // is dead (see `msg::FromWorker::Standby`). Created disabled: restrictions can
        // only be registered before a ring runs anything, and a single issuer is
        // whoever enables it (this thread, below).
        builder.setup_cqsize(entries * 4).setup_coop_taskrun().setup_r_disabled();
        if !setup.fast_release {
            builder.setup_single_issuer().setup_defer_taskrun();
        }
        let ring = builder.build(entries).map_err(ring_err)?;
        ring.submitter().register_files_sparse(2).map_err(ring_err)?;
        if let Some(fd) = target_file {
            ring.submitter().register_files_update(TARGET_FIXED_FD, &[fd]).map_err(ring_err)?;
        }
        if zero_copy {
            let slots = u32::from(nr_queues) * u32::from(depth);
            ring.submitter().register_buffers_sparse(slots).map_err(ring_err)?;
        }
        let mut queues = Vec::with_capacity(plan.queues.len());
        for (i, &q_id) in plan.queues.iter().enumerate() {
            let bufring = match setup.data_path {
                DataPath::Batch => {
                    Some(BufRing::register(&ring, i as u16, usize::from(depth)).map_err(ring_err)?)
                }
                DataPath::PerIo => None,
            };
            let pending = ElemBuf::new(elem_format(zero_copy), depth);
            queues.push(QueueState::new(q_id, bufring, pending));
        }
        // Restricted and enabled now, not at activation: it runs nothing until then, and
        // a recovery's stall need not wait for these two syscalls.
        if restricted {
            crate::sandbox::restrict_ring(&ring, &setup.target).map_err(ring_err)?;
        } else {
            ring.submitter().register_enable_rings().map_err(ring_err)?;
        }
        let nr_tags = usize::from(nr_queues) * usize::from(depth);
        Ok(StandbyRing { ring, plan, queues, nr_tags, entries })
    }

    /// The ring's fd, for the supervisor (see `msg::FromWorker::Standby`).
    pub fn ring_fd(&self) -> RawFd {
        self.ring.as_raw_fd()
    }

    /// Registers `ublkc` (`/dev/ublkcN`) at [`UBLKC_FIXED_FD`].
    pub fn activate(self, dev: Arc<Device>, ublkc: RawFd) -> Result<QueueThread, LoopError> {
        let thread = self.plan.index;
        let ring_err = |source| LoopError::Ring { thread, source };
        let ring = self.ring;
        ring.submitter().register_files_update(UBLKC_FIXED_FD, &[ublkc]).map_err(ring_err)?;
        Ok(QueueThread::new(ring, dev, self.plan, self.queues, self.nr_tags, self.entries))
    }
}
