//! One queue thread's loop: keep a multishot FETCH armed on each queue it serves, run
//! the target for every delivered tag, and COMMIT results in batches (one COMMIT per
//! queue per loop turn). It owns the per-tag state of the tags it fetched, the COMMIT
//! element buffers in flight, and the thread's heartbeat and counters in the shared
//! region.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use io_uring::{IoUring, cqueue, squeue};
use ublkd_proto::batch::{self, BatchElem, ElemBuf};
use ublkd_proto::errno::Errno;
use ublkd_proto::shm::{CounterSnapshot, LatencyOp, TagRecord, tag_state};
use ublkd_proto::sqe;
use ublkd_proto::uapi;

use super::plan::ThreadPlan;
use super::ring::{UBLKC_FIXED_FD, elem_format};
use super::user_data::UserData;
use super::{CommitRefusal, LoopError};
use crate::bufring::BufRing;
use crate::device::Device;
use crate::hooks;
use crate::target::{Bounds, IoReq, Step};

/// How long a wait that counts COMMIT completions in sleeps at most (see
/// `QueueThread::submit_and_wait_for_work`).
const COMMIT_CQE_WAIT_NS: u32 = 20_000_000;

/// One queue a thread serves.
pub struct QueueState {
    q_id: u16,
    bufring: BufRing,
    fetch_armed: bool,
    /// The device is going away: FETCH ended for good.
    closed: bool,
    pending: ElemBuf,
}

impl QueueState {
    /// Queue `q_id`, fetching into `bufring`, collecting COMMIT elements in `pending`.
    pub fn new(q_id: u16, bufring: BufRing, pending: ElemBuf) -> Self {
        QueueState { q_id, bufring, fetch_armed: false, closed: false, pending }
    }
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
    /// Nanoseconds since `started`, read once per loop turn (not per tag) when its
    /// completions are taken: when this turn's FETCHed tags were seen.
    turn_ns: u64,
    /// Per tag of every queue (only this thread's tags are used): `turn_ns` of the turn
    /// that FETCHed it.
    fetched_ns: Vec<u64>,
    /// Requests finished since the last COMMIT, with when they were fetched: their
    /// latency is counted when the COMMIT goes out, with one clock read for them all.
    finished: Vec<(LatencyOp, u64)>,
    cqes: Vec<(u64, i32, u32)>,
}

impl QueueThread {
    /// The loop of `plan` on `ring` (`entries` SQEs, the device registered), serving
    /// `queues` of `dev`, which has `nr_tags` tags in all.
    pub fn new(
        ring: IoUring<squeue::Entry, cqueue::Entry>,
        dev: Arc<Device>,
        plan: ThreadPlan,
        queues: Vec<QueueState>,
        nr_tags: usize,
        entries: u32,
    ) -> Self {
        QueueThread {
            ring,
            plan,
            queues,
            reqs: vec![None; nr_tags],
            commit_slots: Vec::new(),
            sent_unacked: Vec::new(),
            spare: Vec::new(),
            inflight: 0,
            started: Instant::now(),
            turn_ns: 0,
            fetched_ns: vec![0; nr_tags],
            finished: Vec::with_capacity(nr_tags),
            counted: CounterSnapshot::default(),
            cqes: Vec::with_capacity(entries as usize * 4),
            dev,
        }
    }

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
            .user_data(UserData::Prep { q_id }.encode());
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
                if res != 0 {
                    let q_id = match UserData::decode(ud) {
                        Some(UserData::Prep { q_id }) => q_id,
                        _ => 0,
                    };
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
        let ud = UserData::Fetch { q_id: q.q_id, index: qi as u32 };
        let sqe = sqe::fetch(UBLKC_FIXED_FD, q.q_id, self.dev.depth, q.bufring.bgid())
            .user_data(ud.encode());
        self.push(&sqe)?;
        self.queues[qi].fetch_armed = true;
        Ok(())
    }

    /// What a test hook asks of this thread before its first turn (nothing without
    /// the `test-hooks` feature).
    fn start_hooks(&mut self) -> Result<(), LoopError> {
        let start = hooks::on_thread_start(&self.dev, self.plan.index, self.ring.as_raw_fd());
        if let Some(sqe) = start.sqe {
            self.push(&sqe)?;
        }
        for tag in start.unowned_tags {
            let elem = self.elem(self.queues[0].q_id, tag, 0);
            let _ = self.queues[0].pending.push(elem);
        }
        Ok(())
    }

    /// Runs until every queue this thread serves is closed by the kernel and nothing
    /// is left in flight.
    pub fn run(mut self, barrier: &Barrier) -> Result<(), LoopError> {
        barrier.wait();
        let slot_index = self.plan.index;
        if let Some(slot) = self.dev.shm.thread(slot_index) {
            let tid = nix::unistd::gettid().as_raw();
            slot.tid.store(tid as u32, Ordering::Relaxed);
            slot.generation.store(self.dev.generation, Ordering::Relaxed);
        }
        // This thread is the slot's only writer: its heartbeat needs no read-modify-write.
        let mut beat = 0u64;
        for qi in 0..self.queues.len() {
            self.arm_fetch(qi)?;
        }
        self.start_hooks()?;
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
            self.turn_ns = self.started.elapsed().as_nanos() as u64;
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.clear();
            cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result(), c.flags())));
            for &(ud, res, flags) in &cqes {
                self.handle_cqe(ud, res, flags)?;
            }
            self.cqes = cqes;
            let handled = self.counted != CounterSnapshot::default();
            hooks::after_turn(&self.dev, slot_index, beat / 2, handled);
            if handled {
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
        match UserData::decode(ud) {
            Some(UserData::Fetch { index, .. }) => self.on_fetch(index as usize, res, flags),
            Some(UserData::Target { q_id, tag }) => self.on_target(q_id, tag, res),
            Some(UserData::Commit { slot, .. }) => self.on_commit(slot as usize, res),
            // Posted only on failure (IOSQE_CQE_SKIP_SUCCESS).
            Some(UserData::CommitOne { q_id, tag }) => Err(LoopError::Commit {
                q_id,
                tag,
                what: if res < 0 {
                    CommitRefusal::Errno(Errno(-res))
                } else {
                    CommitRefusal::Unexpected(res)
                },
            }),
            Some(UserData::Attack) => {
                hooks::on_attack_cqe(res);
                Ok(())
            }
            Some(UserData::Prep { .. }) | None => Ok(()),
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
        let (buf, buf_index) = if dev.zero_copy {
            (std::ptr::null_mut(), Some(self.buf_index(q_id, tag)))
        } else {
            (dev.bufs.get(q_id, tag).unwrap_or(std::ptr::null_mut()), None)
        };
        self.inflight += 1;
        if let Some(slot) = dev.shm.tag(q_id, tag) {
            slot.write(&TagRecord {
                state: tag_state::IN_TARGET,
                op: u32::from(desc.op()),
                nr_sectors: desc.nr_sectors,
                start_sector: desc.start_sector,
                since_ms: self.turn_ns / 1_000_000,
            });
        }
        let index = self.tag_index(q_id, tag);
        if let Some(at) = self.fetched_ns.get_mut(index) {
            *at = self.turn_ns;
        }
        let bounds = Bounds { size_bytes: dev.size_bytes, buf_bytes: dev.bufs.buf_bytes() as u64 };
        let req = match IoReq::from_desc(&desc, bounds, buf, buf_index) {
            Ok(req) => req,
            Err(bad) => {
                let (op, offset, len_bytes) = (bad.op, bad.offset, bad.len_bytes);
                tracing::warn!(
                    q_id,
                    tag,
                    op,
                    offset,
                    len_bytes,
                    "request outside the device or unsupported"
                );
                return self.complete(q_id, tag, op, bad.result());
            }
        };
        let step = dev.target.start(&req);
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
                let sqe = sqe.user_data(UserData::Target { q_id, tag }.encode());
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
        if let (Some(class), Some(&at)) =
            (LatencyOp::of_ublk_op(op), self.fetched_ns.get(self.tag_index(q_id, tag)))
        {
            self.finished.push((class, at));
        }
        self.inflight = self.inflight.saturating_sub(1);
        let elem = self.elem(q_id, tag, res);
        let Some(q) = self.queues.iter_mut().find(|q| q.q_id == q_id) else { return Ok(()) };
        q.pending.push(elem).map_err(|e| LoopError::Commit { q_id, tag, what: e.into() })
    }

    /// Counts the latency of every request finished since the last COMMIT, from the
    /// turn that FETCHed it to now, when its COMMIT is about to be submitted: one clock
    /// read (vDSO, no syscall) per COMMIT turn, however many requests it carries.
    fn record_latency(&mut self) {
        if self.finished.is_empty() {
            return;
        }
        let now = self.started.elapsed().as_nanos() as u64;
        if let Some(hist) = self.dev.shm.latency(self.plan.index) {
            for &(op, at) in &self.finished {
                hist.record(op, now.saturating_sub(at));
            }
        }
        self.finished.clear();
    }

    /// Submits one COMMIT per queue with finished requests.
    fn flush_commits(&mut self) -> Result<(), LoopError> {
        self.record_latency();
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
                let ud = UserData::CommitOne { q_id, tag };
                sqe.flags(squeue::Flags::SKIP_SUCCESS).user_data(ud.encode())
            } else {
                let slot = match self.commit_slots.iter().position(Option::is_none) {
                    Some(free) => free,
                    None => {
                        self.commit_slots.push(None);
                        self.commit_slots.len() - 1
                    }
                };
                self.commit_slots[slot] = Some((q_id, elems));
                sqe.user_data(UserData::Commit { q_id, slot: slot as u32 }.encode())
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
            let what = CommitRefusal::Errno(Errno(-res));
            return Err(LoopError::Commit { q_id, tag: first, what });
        }
        let done = elems.consume_committed(res as usize).map_err(|e| LoopError::Commit {
            q_id,
            tag: first,
            what: e.into(),
        })?;
        if done != sent {
            let tag = elems.get(0).map_or(0, |e| e.tag);
            return Err(LoopError::Commit {
                q_id,
                tag,
                what: CommitRefusal::Partial { done, sent },
            });
        }
        elems.clear();
        self.spare.push(elems);
        Ok(())
    }
}
