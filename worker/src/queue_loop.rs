//! One worker thread's io_uring loop: PREP its queues, keep a multishot FETCH armed on
//! each queue it serves, run the target for every delivered tag, and COMMIT results in
//! batches (one COMMIT per queue per loop turn).
//!
//! Any thread may serve any tag: with fewer threads than queues each thread serves a
//! set of queues; with more, several threads arm FETCH on the same queue and the kernel
//! hands each batch of tags to one of them. A tag is handled start to finish by the
//! thread that fetched it, so no per-tag state is shared between threads.
//!
//! A COMMIT the kernel refuses (even partly) means the worker and the kernel disagree
//! about who owns a tag. The loop does not guess: it fails, the worker exits, and the
//! supervisor recovers the device, whose in-flight I/O the kernel reissues (REISSUE) to
//! the next worker, so no I/O fails.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use io_uring::{IoUring, cqueue, squeue};
use ublkd_proto::batch::{self, BatchElem, ElemBuf, ElemFormat};
use ublkd_proto::msg::WorkerSetup;
use ublkd_proto::shm::{CounterSnapshot, TagRecord, tag_state};
use ublkd_proto::sqe;
use ublkd_proto::uapi;

use crate::bufring::BufRing;
use crate::device::Device;
use crate::target::{IoReq, Step, TARGET_FIXED_FD};

/// Errors that end a thread (and so the worker).
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("cannot set up thread {thread}'s io_uring: {source}")]
    Ring { thread: usize, source: std::io::Error },
    #[error("PREP of queue {q_id} failed: {}", ublkd_proto::errno::Errno(-res))]
    Prep { q_id: u16, res: i32 },
    #[error("the kernel refused a COMMIT on queue {q_id} (tag {tag}): {what}")]
    Commit { q_id: u16, tag: u16, what: String },
    #[error("FETCH on queue {q_id} delivered a malformed batch: {source}")]
    Fetch { q_id: u16, source: batch::BatchError },
    #[error("io_uring wait failed in thread {thread}: {source}")]
    Wait { thread: usize, source: std::io::Error },
}

/// Which queues a thread serves, and which of them it PREPs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadPlan {
    pub index: usize,
    pub queues: Vec<u16>,
    /// Each queue is PREPed by exactly one thread (its lowest-numbered server).
    pub prep_queues: Vec<u16>,
}

/// Spreads `nr_queues` over `nr_threads`: round robin, every queue served by at least
/// one thread and every thread serving at least one queue.
pub fn plan(nr_threads: u16, nr_queues: u16) -> Vec<ThreadPlan> {
    let (t, q) = (usize::from(nr_threads.max(1)), nr_queues.max(1));
    (0..t)
        .map(|index| {
            let queues: Vec<u16> = if t <= usize::from(q) {
                (0..q).filter(|qid| usize::from(*qid) % t == index).collect()
            } else {
                vec![(index % usize::from(q)) as u16]
            };
            // The lowest thread serving a queue: with t <= q that is the only one;
            // with t > q it is thread number qid.
            let prep_queues = queues
                .iter()
                .copied()
                .filter(|qid| t <= usize::from(q) || usize::from(*qid) == index)
                .collect();
            ThreadPlan { index, queues, prep_queues }
        })
        .collect()
}

// user_data: kind in bits 56..64, queue in 32..48, a per-kind index in 0..32.
const KIND_PREP: u64 = 1;
const KIND_FETCH: u64 = 2;
const KIND_COMMIT: u64 = 3;
const KIND_TARGET: u64 = 4;
/// A one-element COMMIT sent with `IOSQE_CQE_SKIP_SUCCESS`: only a failure completes,
/// and its index is the tag.
const KIND_COMMIT_ONE: u64 = 6;
#[cfg(feature = "test-hooks")]
const KIND_ATTACK: u64 = 5;

/// The CPUs the calling thread may run on now. Read once, before any thread is pinned
/// (a thread inherits its creator's pinning).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes only the
    // set given, of the size given, and CPU_ISSET reads inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// Pins the calling thread to `cpu`. Best effort: a failure leaves it unpinned.
///
/// Why: on the loop target the queue thread, io_uring's iou-wrk worker that runs the
/// reads and writes (tmpfs and overlayfs files cannot be read without blocking, so
/// every target I/O goes through io-wq) and the application all compete for the CPUs;
/// a pinned queue thread (what kublk does with its queue's first CPU) serves loop I/O
/// markedly faster and null I/O no slower (bench/README.md, "Pinning the queue
/// thread").
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_ZERO/CPU_SET index inside it
    // (`cpu` comes from `allowed_cpus`, below CPU_SETSIZE) and sched_setaffinity reads
    // only the set given, of the size given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

fn user_data(kind: u64, q_id: u16, low: u32) -> u64 {
    (kind << 56) | (u64::from(q_id) << 32) | u64::from(low)
}

fn split(ud: u64) -> (u64, u16, u32) {
    (ud >> 56, (ud >> 32) as u16, ud as u32)
}

/// Index of `/dev/ublkcN` in each ring's registered files. Registered, not used by its
/// plain fd: a command holds a reference to a plain fd's file, and ublk does not end a
/// batch FETCH that is busy delivering when its worker dies until the device's file is
/// released, so a worker killed at that moment would leave the file held for good,
/// and the device never recovered. A registered
/// file would be let go only when io_uring tears the dead worker's ring down (tens of
/// milliseconds of a recovery's stall under emulation); with `recovery.fast_release`
/// (the default) the supervisor, which holds a copy of each ring, unregisters it at
/// once instead (see `msg::FromWorker::Standby`).
const UBLKC_FIXED_FD: u32 = 1;

/// How long a wait that counts COMMIT completions in sleeps at most (see
/// `QueueThread::submit_and_wait_for_work`).
const COMMIT_CQE_WAIT_NS: u32 = 20_000_000;

/// The PREP/COMMIT element format: kernel-copy mode names each tag's buffer address;
/// zero copy (`UBLK_F_AUTO_BUF_REG`) only the buffer index, in the header.
fn elem_format(zero_copy: bool) -> ElemFormat {
    if zero_copy { ElemFormat::HEADER } else { ElemFormat::WITH_BUF_ADDR }
}

struct QueueState {
    q_id: u16,
    bufring: BufRing,
    fetch_armed: bool,
    /// The device is going away: FETCH ended for good.
    closed: bool,
    pending: ElemBuf,
}

/// One thread's loop state. `ring` is declared first so it drops first.
pub struct QueueThread {
    ring: IoUring<squeue::Entry, cqueue::Entry>,
    dev: Arc<Device>,
    plan: ThreadPlan,
    queues: Vec<QueueState>,
    /// Per tag of every queue (only this thread's tags are used): the request and the
    /// bytes done so far.
    reqs: Vec<Option<(IoReq, u32)>>,
    commit_slots: Vec<Option<(u16, ElemBuf)>>,
    /// Element buffers of one-element COMMITs, which complete only on failure: the
    /// kernel reads them while it issues the COMMIT (ublk's COMMIT runs inline), so
    /// they are free again once the submission queue is empty after a submit.
    sent_unacked: Vec<ElemBuf>,
    spare: Vec<ElemBuf>,
    inflight: u32,
    started: Instant,
    /// Completions counted in this loop turn, added to the device's shared counters
    /// at its end: one atomic add per counter per turn, not two per I/O.
    counted: CounterSnapshot,
    /// Milliseconds since `started`, read once per loop turn (not per tag) for the tag
    /// records' `since_ms`.
    now_ms: u64,
    cqes: Vec<(u64, i32, u32)>,
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
    /// has one) at [`TARGET_FIXED_FD`] and one buffer ring per queue the thread serves,
    /// and for zero copy an empty buffer table the kernel registers requests' pages in;
    /// then restricts it (if `restricted`, see `sandbox::restrict_ring`) and enables
    /// it, all before the device is there. Pins the calling thread (the ring's owner)
    /// to `cpu` first.
    pub fn new(
        plan: ThreadPlan,
        setup: &WorkerSetup,
        target_file: Option<std::os::fd::RawFd>,
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
        // One slot per tag (target I/O) plus a FETCH and a COMMIT per queue, with room.
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
            let bufring =
                BufRing::register(&ring, i as u16, usize::from(depth)).map_err(ring_err)?;
            queues.push(QueueState {
                q_id,
                bufring,
                fetch_armed: false,
                closed: false,
                pending: ElemBuf::new(elem_format(zero_copy), depth),
            });
        }
        // Restricted and enabled now, not at activation: it runs nothing until then, and
        // a recovery's stall need not wait for these two syscalls (~1-3 ms under TCG).
        if restricted {
            crate::sandbox::restrict_ring(&ring).map_err(ring_err)?;
        } else {
            ring.submitter().register_enable_rings().map_err(ring_err)?;
        }
        let nr_tags = usize::from(nr_queues) * usize::from(depth);
        Ok(StandbyRing { ring, plan, queues, nr_tags, entries })
    }

    /// The ring's fd, for the supervisor (see `msg::FromWorker::Standby`).
    pub fn ring_fd(&self) -> std::os::fd::RawFd {
        self.ring.as_raw_fd()
    }

    /// Registers `ublkc` (`/dev/ublkcN`) at [`UBLKC_FIXED_FD`].
    pub fn activate(
        self,
        dev: Arc<Device>,
        ublkc: std::os::fd::RawFd,
    ) -> Result<QueueThread, LoopError> {
        let thread = self.plan.index;
        let ring_err = |source| LoopError::Ring { thread, source };
        let ring = self.ring;
        ring.submitter().register_files_update(UBLKC_FIXED_FD, &[ublkc]).map_err(ring_err)?;
        Ok(QueueThread {
            ring,
            plan: self.plan,
            queues: self.queues,
            reqs: vec![None; self.nr_tags],
            commit_slots: Vec::new(),
            sent_unacked: Vec::new(),
            spare: Vec::new(),
            inflight: 0,
            started: Instant::now(),
            now_ms: 0,
            counted: CounterSnapshot::default(),
            cqes: Vec::with_capacity(self.entries as usize * 4),
            dev,
        })
    }
}

impl QueueThread {
    fn push(&mut self, sqe: &squeue::Entry) -> Result<(), LoopError> {
        loop {
            // SAFETY: every SQE this loop builds references memory that outlives its
            // completion: tag buffers and descriptor arrays (process-lifetime mappings),
            // FETCH buffer rings (leaked), and COMMIT/PREP element buffers, which stay
            // in `commit_slots` (or the PREP call's frame, which waits) until their CQE,
            // or for one-element COMMITs in `sent_unacked` and then `spare`: never freed
            // while the thread runs, so even a COMMIT the kernel read late would read
            // live memory (at worst a later batch's elements, which it would refuse).
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            self.ring
                .submit()
                .map_err(|source| LoopError::Wait { thread: self.plan.index, source })?;
        }
    }

    /// The PREP or COMMIT element of a tag: its buffer's address (kernel copy), or the
    /// buffer table index its pages are to be registered at (zero copy).
    fn elem(&self, q_id: u16, tag: u16, result: i32) -> BatchElem {
        if self.dev.zero_copy {
            let buf_index = self.buf_index(q_id, tag);
            BatchElem { tag, buf_index, result, ..BatchElem::default() }
        } else {
            let buf_addr = self.dev.bufs.get(q_id, tag).map_or(0, |p| p as u64);
            BatchElem { tag, buf_addr, result, ..BatchElem::default() }
        }
    }

    /// PREPs every tag of this thread's PREP queues and waits until the kernel took them.
    pub fn prep(&mut self) -> Result<(), LoopError> {
        let mut bufs = Vec::new();
        for q_id in self.plan.prep_queues.clone() {
            let mut elems = ElemBuf::new(elem_format(self.dev.zero_copy), self.dev.depth);
            for tag in 0..self.dev.depth {
                elems.push(self.elem(q_id, tag, 0)).expect("capacity is the depth");
            }
            let sqe = sqe::batch_cmd(
                UBLKC_FIXED_FD,
                uapi::UBLK_U_IO_PREP_IO_CMDS,
                elems.header(q_id),
                elems.as_bytes(),
            )
            .user_data(user_data(KIND_PREP, q_id, 0));
            self.push(&sqe)?;
            bufs.push(elems);
        }
        let mut left = bufs.len();
        while left > 0 {
            self.ring
                .submit_and_wait(1)
                .map_err(|source| LoopError::Wait { thread: self.plan.index, source })?;
            let done: Vec<(u64, i32)> =
                self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (ud, res) in done {
                let (_, q_id, _) = split(ud);
                if res != 0 {
                    return Err(LoopError::Prep { q_id, res });
                }
                left -= 1;
            }
        }
        drop(bufs);
        Ok(())
    }

    fn arm_fetch(&mut self, qi: usize) -> Result<(), LoopError> {
        let q = &self.queues[qi];
        if q.fetch_armed || q.closed {
            return Ok(());
        }
        let sqe = sqe::fetch(UBLKC_FIXED_FD, q.q_id, self.dev.depth, q.bufring.bgid())
            .user_data(user_data(KIND_FETCH, q.q_id, qi as u32));
        self.push(&sqe)?;
        self.queues[qi].fetch_armed = true;
        Ok(())
    }

    /// Runs until every queue this thread serves is closed by the kernel and nothing
    /// is left in flight.
    pub fn run(mut self, barrier: &Barrier) -> Result<(), LoopError> {
        barrier.wait();
        let slot_index = self.plan.index;
        if let Some(slot) = self.dev.shm.thread(slot_index) {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            slot.tid.store(tid as u32, Ordering::Relaxed);
            slot.generation.store(self.dev.generation, Ordering::Relaxed);
        }
        // This thread is the slot's only writer: its heartbeat needs no read-modify-write.
        let mut beat = 0u64;
        for qi in 0..self.queues.len() {
            self.arm_fetch(qi)?;
        }
        #[cfg(feature = "test-hooks")]
        if crate::attack::requested() == Some(crate::attack::URING_OPENAT)
            && self.dev.generation == 1
            && self.plan.index == 0
        {
            // Ask the ring to open a host file: its restrictions must refuse.
            let path = c"/etc/passwd";
            let sqe =
                io_uring::opcode::OpenAt::new(io_uring::types::Fd(libc::AT_FDCWD), path.as_ptr())
                    .build()
                    .user_data(user_data(KIND_ATTACK, 0, 0));
            self.push(&sqe)?;
        }
        #[cfg(feature = "test-hooks")]
        if crate::attack::requested() == Some(crate::attack::URING_REGISTER_PERSONALITY)
            && self.dev.generation == 1
            && self.plan.index == 0
        {
            // Give the enabled ring this thread's credentials as a personality: its
            // register restrictions must refuse.
            // SAFETY: io_uring_register with a null argument and no entries reads no
            // memory; the ring fd is this thread's own.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_io_uring_register,
                    self.ring.as_raw_fd(),
                    uapi::IORING_REGISTER_PERSONALITY,
                    std::ptr::null::<libc::c_void>(),
                    0,
                )
            };
            crate::attack::outcome(crate::attack::URING_REGISTER_PERSONALITY, rc);
        }
        #[cfg(feature = "test-hooks")]
        if self.dev.generation == 1 && self.plan.index == 0 {
            let tags: &[u16] = match crate::attack::requested() {
                Some(crate::attack::COMMIT_UNOWNED) => &[1],
                Some(crate::attack::COMMIT_UNOWNED_BATCH) => &[1, 2],
                _ => &[],
            };
            // The highest tags: blk-mq hands out the lowest first, so these are idle.
            for &from_top in tags {
                let (q_id, tag) = (self.queues[0].q_id, self.dev.depth - from_top);
                let elem = self.elem(q_id, tag, 0);
                let _ = self.queues[0].pending.push(elem);
            }
        }
        loop {
            self.flush_commits()?;
            let open = self.queues.iter().any(|q| !q.closed);
            if !open
                && self.inflight == 0
                && self.commit_slots.iter().all(Option::is_none)
                && self.ring.submission().is_empty()
            {
                return Ok(());
            }
            let waited = self.submit_and_wait_for_work(open || self.inflight > 0);
            if self.ring.submission().is_empty() {
                for mut elems in self.sent_unacked.drain(..) {
                    elems.clear();
                    self.spare.push(elems);
                }
            }
            match waited {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::ETIME)) => {}
                Err(source) => return Err(LoopError::Wait { thread: self.plan.index, source }),
            }
            // Odd: working through a turn (the supervisor's hang watch tells a thread
            // stuck mid-turn from one waiting in the ring by this).
            if let Some(slot) = self.dev.shm.thread(slot_index) {
                slot.heartbeat.store(beat.wrapping_add(1), Ordering::Relaxed);
            }
            self.now_ms = self.started.elapsed().as_millis() as u64;
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.clear();
            cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result(), c.flags())));
            for &(ud, res, flags) in &cqes {
                self.handle_cqe(ud, res, flags)?;
            }
            self.cqes = cqes;
            #[cfg(feature = "test-hooks")]
            crate::attack::after_turn(
                &self.dev,
                slot_index,
                beat / 2,
                self.counted != CounterSnapshot::default(),
            );
            if self.counted != CounterSnapshot::default() {
                self.dev.shm.counters().add(&self.counted);
                self.counted = CounterSnapshot::default();
            }
            // Even again: about to wait, with `inflight` requests at the backend.
            beat = beat.wrapping_add(2);
            if let Some(slot) = self.dev.shm.thread(slot_index) {
                slot.inflight.store(self.inflight, Ordering::Relaxed);
                slot.heartbeat.store(beat, Ordering::Relaxed);
            }
        }
    }

    /// Submits what is queued and sleeps until there is work: a FETCH batch or a target
    /// completion. A COMMIT of several elements completes at once (ublk runs it inline),
    /// so waiting for a single completion would return at once for that CQE alone and
    /// cost a second `io_uring_enter` per loop turn; the wait counts those CQEs in and
    /// asks for one more. Its timeout only bounds how late a failed COMMIT is noticed if
    /// nothing else arrives. (One-element COMMITs post no CQE unless they fail.)
    fn submit_and_wait_for_work(&mut self, work_expected: bool) -> std::io::Result<usize> {
        let commits = self.commit_slots.iter().filter(|s| s.is_some()).count();
        // With every queue closed and nothing in the target only the COMMITs' own
        // completions are still to come.
        let want = commits + usize::from(work_expected);
        if want == 0 {
            return self.ring.submit();
        }
        if commits == 0 {
            return self.ring.submit_and_wait(want);
        }
        let timeout = io_uring::types::Timespec::new().nsec(COMMIT_CQE_WAIT_NS);
        let args = io_uring::types::SubmitArgs::new().timespec(&timeout);
        self.ring.submitter().submit_with_args(want, &args)
    }

    fn handle_cqe(&mut self, ud: u64, res: i32, flags: u32) -> Result<(), LoopError> {
        let (kind, q_id, low) = split(ud);
        match kind {
            KIND_FETCH => self.on_fetch(low as usize, res, flags),
            KIND_TARGET => self.on_target(q_id, low as u16, res),
            KIND_COMMIT => self.on_commit(low as usize, res),
            // Posted only on failure (IOSQE_CQE_SKIP_SUCCESS).
            KIND_COMMIT_ONE => Err(LoopError::Commit {
                q_id,
                tag: low as u16,
                what: if res < 0 {
                    ublkd_proto::errno::Errno(-res).to_string()
                } else {
                    format!("unexpected completion {res}")
                },
            }),
            #[cfg(feature = "test-hooks")]
            KIND_ATTACK => {
                if res < 0 {
                    let err = std::io::Error::from_raw_os_error(-res);
                    crate::attack::say(format!(
                        "attack {}: blocked ({err})",
                        crate::attack::URING_OPENAT
                    ));
                } else {
                    crate::attack::say(format!(
                        "attack {}: ESCAPED (fd {res})",
                        crate::attack::URING_OPENAT
                    ));
                    std::process::exit(99);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn on_fetch(&mut self, qi: usize, res: i32, flags: u32) -> Result<(), LoopError> {
        let Some(q) = self.queues.get_mut(qi) else { return Ok(()) };
        let q_id = q.q_id;
        if !cqueue::more(flags) {
            q.fetch_armed = false;
        }
        if res < 0 {
            if res != -libc::ENOBUFS {
                // -ENODEV (device stopping or the fd going away) or a cancel: no more I/O
                // will come on this queue for this worker.
                q.closed = true;
                tracing::debug!(q_id, res, "FETCH ended");
            }
        } else if let Some(bid) = cqueue::buffer_select(flags) {
            let mut tags = [0u16; batch::MAX_TAGS_PER_FETCH];
            let count = {
                let bytes = q.bufring.filled(bid, res as usize).ok_or(LoopError::Fetch {
                    q_id,
                    source: batch::BatchError::FetchTooMany(res as usize / 2),
                })?;
                let fetched = batch::decode_fetched_tags(bytes, self.dev.depth)
                    .map_err(|source| LoopError::Fetch { q_id, source })?;
                let n = fetched.len();
                for (slot, tag) in tags.iter_mut().zip(fetched) {
                    *slot = tag;
                }
                n
            };
            q.bufring.recycle(bid);
            for &tag in &tags[..count] {
                self.on_tag(q_id, tag)?;
            }
        }
        if !self.queues[qi].fetch_armed && !self.queues[qi].closed {
            self.arm_fetch(qi)?;
        }
        Ok(())
    }

    fn on_tag(&mut self, q_id: u16, tag: u16) -> Result<(), LoopError> {
        // Borrowed through the field, not cloned: the reference count is two atomic
        // operations per I/O, which cost under emulation.
        let dev = &*self.dev;
        let Some(desc) = dev.descs.get(usize::from(q_id)).and_then(|d| d.get(tag)) else {
            return Ok(());
        };
        let op = desc.op();
        let len_bytes = u64::from(desc.nr_sectors) << 9;
        let offset = desc.start_sector.saturating_mul(512);
        let (buf, buf_index) = if dev.zero_copy {
            (std::ptr::null_mut(), Some(self.buf_index(q_id, tag)))
        } else {
            (dev.bufs.get(q_id, tag).unwrap_or(std::ptr::null_mut()), None)
        };
        self.inflight += 1;
        if let Some(slot) = dev.shm.tag(q_id, tag) {
            slot.write(&TagRecord {
                state: tag_state::IN_TARGET,
                op: u32::from(op),
                nr_sectors: desc.nr_sectors,
                start_sector: desc.start_sector,
                since_ms: self.now_ms,
            });
        }
        // Checked here once so targets can trust the request.
        let valid = match op {
            uapi::UBLK_IO_OP_READ | uapi::UBLK_IO_OP_WRITE => {
                len_bytes <= dev.bufs.buf_bytes() as u64
                    && offset.checked_add(len_bytes).is_some_and(|end| end <= dev.size_bytes)
            }
            uapi::UBLK_IO_OP_DISCARD | uapi::UBLK_IO_OP_WRITE_ZEROES => {
                offset.checked_add(len_bytes).is_some_and(|end| end <= dev.size_bytes)
                    && len_bytes <= u64::from(u32::MAX)
            }
            uapi::UBLK_IO_OP_FLUSH => true,
            _ => false,
        };
        if !valid {
            tracing::warn!(
                q_id,
                tag,
                op,
                offset,
                len_bytes,
                "request outside the device or unsupported"
            );
            let res = if matches!(op, uapi::UBLK_IO_OP_READ | uapi::UBLK_IO_OP_WRITE) {
                -libc::EIO
            } else {
                -libc::EOPNOTSUPP
            };
            return self.complete(q_id, tag, op, res);
        }
        let req = IoReq { op, flags: desc.flags(), offset, len: len_bytes as u32, buf, buf_index };
        let step = dev.target.start(&req);
        let index = self.tag_index(q_id, tag);
        self.reqs[index] = Some((req, 0));
        self.step(q_id, tag, step)
    }

    fn tag_index(&self, q_id: u16, tag: u16) -> usize {
        usize::from(q_id) * usize::from(self.dev.depth) + usize::from(tag)
    }

    /// Zero copy: where in the ring's buffer table the kernel registers the request's
    /// pages — the tag's index, the same in every ring, so that whichever thread's
    /// FETCH delivers a tag finds its slot free. (The config keeps queues × depth
    /// within io_uring's 2^14 buffers for zero-copy devices.)
    fn buf_index(&self, q_id: u16, tag: u16) -> u16 {
        self.tag_index(q_id, tag) as u16
    }

    fn step(&mut self, q_id: u16, tag: u16, step: Step) -> Result<(), LoopError> {
        match step {
            Step::Done(res) => {
                let index = self.tag_index(q_id, tag);
                let op = self.reqs[index].take().map_or(0, |(r, _)| r.op);
                self.complete(q_id, tag, op, res)
            }
            Step::Submit(sqe) => {
                let sqe = sqe.user_data(user_data(KIND_TARGET, q_id, u32::from(tag)));
                self.push(&sqe)
            }
        }
    }

    fn on_target(&mut self, q_id: u16, tag: u16, res: i32) -> Result<(), LoopError> {
        let index = self.tag_index(q_id, tag);
        let Some((req, mut done)) = self.reqs.get(index).copied().flatten() else {
            return Ok(());
        };
        let step = self.dev.target.on_cqe(&req, res, &mut done);
        self.reqs[index] = Some((req, done));
        self.step(q_id, tag, step)
    }

    /// Records a finished request and queues its COMMIT element.
    fn complete(&mut self, q_id: u16, tag: u16, op: u8, res: i32) -> Result<(), LoopError> {
        let c = &mut self.counted;
        match op {
            uapi::UBLK_IO_OP_READ => c.reads += 1,
            uapi::UBLK_IO_OP_WRITE => c.writes += 1,
            uapi::UBLK_IO_OP_FLUSH => c.flushes += 1,
            uapi::UBLK_IO_OP_DISCARD => c.discards += 1,
            uapi::UBLK_IO_OP_WRITE_ZEROES => c.write_zeroes += 1,
            _ => {}
        }
        if res < 0 {
            c.errors += 1;
        } else if op == uapi::UBLK_IO_OP_READ {
            c.bytes_read += res as u64;
        } else if op == uapi::UBLK_IO_OP_WRITE {
            c.bytes_written += res as u64;
        }
        if let Some(slot) = self.dev.shm.tag(q_id, tag) {
            slot.set_state(tag_state::COMMITTED);
        }
        self.inflight = self.inflight.saturating_sub(1);
        let elem = self.elem(q_id, tag, res);
        let Some(q) = self.queues.iter_mut().find(|q| q.q_id == q_id) else { return Ok(()) };
        q.pending.push(elem).map_err(|e| LoopError::Commit { q_id, tag, what: e.to_string() })
    }

    /// Submits one COMMIT per queue with finished requests.
    fn flush_commits(&mut self) -> Result<(), LoopError> {
        for qi in 0..self.queues.len() {
            if self.queues[qi].pending.is_empty() {
                continue;
            }
            let depth = self.dev.depth;
            let format = elem_format(self.dev.zero_copy);
            let fresh = self.spare.pop().unwrap_or_else(|| ElemBuf::new(format, depth));
            let elems = std::mem::replace(&mut self.queues[qi].pending, fresh);
            let q_id = self.queues[qi].q_id;
            let sqe = sqe::batch_cmd(
                UBLKC_FIXED_FD,
                uapi::UBLK_U_IO_COMMIT_IO_CMDS,
                elems.header(q_id),
                elems.as_bytes(),
            );
            // The element buffer's heap storage does not move when the ElemBuf moves
            // below, so the address in the SQE stays valid.
            let sqe = if elems.len() == 1 {
                // One element: the COMMIT either takes it (success, no CQE) or fails
                // (a CQE with the error), so no partial result can go unseen.
                let tag = elems.get(0).map_or(0, |e| e.tag);
                self.sent_unacked.push(elems);
                let ud = user_data(KIND_COMMIT_ONE, q_id, u32::from(tag));
                sqe.flags(squeue::Flags::SKIP_SUCCESS).user_data(ud)
            } else {
                let slot = match self.commit_slots.iter().position(Option::is_none) {
                    Some(free) => free,
                    None => {
                        self.commit_slots.push(None);
                        self.commit_slots.len() - 1
                    }
                };
                self.commit_slots[slot] = Some((q_id, elems));
                sqe.user_data(user_data(KIND_COMMIT, q_id, slot as u32))
            };
            self.push(&sqe)?;
        }
        Ok(())
    }

    fn on_commit(&mut self, slot: usize, res: i32) -> Result<(), LoopError> {
        let Some((q_id, mut elems)) = self.commit_slots.get_mut(slot).and_then(Option::take) else {
            return Ok(());
        };
        let sent = elems.len();
        let first = elems.get(0).map_or(0, |e| e.tag);
        if res < 0 {
            return Err(LoopError::Commit {
                q_id,
                tag: first,
                what: ublkd_proto::errno::Errno(-res).to_string(),
            });
        }
        let done = elems.consume_committed(res as usize).map_err(|e| LoopError::Commit {
            q_id,
            tag: first,
            what: e.to_string(),
        })?;
        if done != sent {
            let tag = elems.get(0).map_or(0, |e| e.tag);
            return Err(LoopError::Commit {
                q_id,
                tag,
                what: format!("only {done} of {sent} elements were taken"),
            });
        }
        elems.clear();
        self.spare.push(elems);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_threads_than_queues_split_queues_round_robin() {
        let p = plan(2, 4);
        assert_eq!(p[0].queues, [0, 2]);
        assert_eq!(p[1].queues, [1, 3]);
        assert_eq!(p[0].prep_queues, [0, 2]);
        assert_eq!(p[1].prep_queues, [1, 3]);
    }

    #[test]
    fn more_threads_than_queues_share_queues_and_prep_once() {
        let p = plan(4, 2);
        let served: Vec<Vec<u16>> = p.iter().map(|t| t.queues.clone()).collect();
        assert_eq!(served, [vec![0], vec![1], vec![0], vec![1]]);
        let preps: Vec<u16> = p.iter().flat_map(|t| t.prep_queues.clone()).collect();
        assert_eq!(preps, [0, 1]);
    }

    #[test]
    fn every_queue_is_prepped_exactly_once() {
        for threads in 1..=9u16 {
            for queues in 1..=9u16 {
                let mut preps: Vec<u16> =
                    plan(threads, queues).iter().flat_map(|t| t.prep_queues.clone()).collect();
                preps.sort_unstable();
                assert_eq!(
                    preps,
                    (0..queues).collect::<Vec<_>>(),
                    "{threads} threads, {queues} queues"
                );
                assert!(plan(threads, queues).iter().all(|t| !t.queues.is_empty()));
            }
        }
    }

    #[test]
    fn user_data_round_trips() {
        assert_eq!(split(user_data(KIND_COMMIT, 513, 77)), (KIND_COMMIT, 513, 77));
    }
}
