//! One queue thread's loop, the same for both data paths (see `DataPath`): wait for
//! requests, run the target for each, hand results back, and keep the thread's
//! heartbeat, counters, latency histogram and tag records in the shared region. It owns
//! the per-tag state of the tags it was given. How requests arrive and results leave
//! is the data path's: `batched` (multishot FETCH, batched COMMIT) or `per_io`
//! (FETCH_REQ, then COMMIT_AND_FETCH_REQ per request).

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};

use io_uring::{IoUring, cqueue, squeue};
use ublkd_proto::batch::ElemBuf;
use ublkd_proto::errno::Errno;
use ublkd_proto::msg::DataPath;
use ublkd_proto::shm::{CounterSnapshot, LatencyOp, TagRecord, tag_state};
use ublkd_proto::uapi;

use super::clock::TurnClock;
use super::plan::ThreadPlan;
use super::user_data::UserData;
use super::{CommitRefusal, LoopError};
use crate::bufring::BufRing;
use crate::device::Device;
use crate::hooks;
use crate::target::{Bounds, IoReq, Reply, Step, TargetWork};

/// How long a wait that counts COMMIT completions in sleeps at most (see
/// `QueueThread::submit_and_wait_for_work`).
const COMMIT_CQE_WAIT_NS: u32 = 20_000_000;

/// One queue a thread serves.
pub struct QueueState {
    pub(super) q_id: u16,
    /// Batched path: the provided buffers its FETCH writes tags into.
    pub(super) bufring: Option<BufRing>,
    pub(super) fetch_armed: bool,
    /// The device is going away: no more requests will come on this queue.
    pub(super) closed: bool,
    /// Batched path: COMMIT elements collected in this turn.
    pub(super) pending: ElemBuf,
    /// Per-I/O path: tags with a FETCH_REQ or COMMIT_AND_FETCH_REQ in the kernel.
    pub(super) armed: u32,
}

impl QueueState {
    /// Queue `q_id`, fetching into `bufring` (batched path), collecting COMMIT elements
    /// in `pending`.
    pub fn new(q_id: u16, bufring: Option<BufRing>, pending: ElemBuf) -> Self {
        QueueState { q_id, bufring, fetch_armed: false, closed: false, pending, armed: 0 }
    }
}

/// One thread's loop state. `ring` is declared first so it drops first.
pub struct QueueThread {
    pub(super) ring: IoUring<squeue::Entry, cqueue::Entry>,
    pub(super) dev: Arc<Device>,
    pub(super) path: DataPath,
    pub(super) plan: ThreadPlan,
    pub(super) queues: Vec<QueueState>,
    /// Per tag of every queue (only this thread's tags are used): the request and the
    /// bytes done so far.
    reqs: Vec<Option<(IoReq, u32)>>,
    pub(super) commit_slots: Vec<Option<(u16, ElemBuf)>>,
    /// Element buffers of one-element COMMITs, which complete only on failure: the
    /// kernel reads them while it issues the COMMIT (ublk's COMMIT runs inline), so
    /// they are free again once the submission queue is empty after a submit.
    pub(super) sent_unacked: Vec<ElemBuf>,
    pub(super) spare: Vec<ElemBuf>,
    inflight: u32,
    /// Completions counted in this loop turn, added to the device's shared counters
    /// at its end: one atomic add per counter per turn, not two per I/O.
    counted: CounterSnapshot,
    /// The turn's time, read once per turn at most, only when a request in it spans
    /// turns (see [`TurnClock`]).
    clock: TurnClock,
    /// Per tag of every queue (only this thread's tags are used): the time of the turn
    /// that FETCHed it, once the target left it waiting (`None` until then).
    fetched_ns: Vec<Option<u64>>,
    /// Completions taken from the ring and not yet handled: each turn's, and the ones
    /// the per-I/O path's first FETCH_REQs posted while it waited for none.
    pub(super) cqes: Vec<(u64, i32, u32)>,
    /// Which failed requests this thread has said in the log (a few per window).
    failures_logged: FailureLog,
    /// What the target's own completions led to (kept for its allocations).
    target_work: TargetWork,
    /// What this thread's wake-ups brought, for the line it logs when it ends.
    wakeups: Wakeups,
    /// Target SQEs queued for the next submit that usually complete in it
    /// ([`TargetWork::inline`]).
    inline_sqes: usize,
}

/// How much each of a queue thread's wake-ups handled: requests finished and
/// completions taken per loop turn. Logged once, when the thread
/// ends: what batching buys (or does not) shows there, without a profiler.
#[derive(Debug, Default)]
struct Wakeups {
    /// Loop turns: one `io_uring_enter` each, which waits for work unless none is
    /// expected.
    turns: u64,
    /// Completions taken from the ring.
    cqes: u64,
    /// Requests finished (committed), every op counted.
    requests: u64,
}

impl Wakeups {
    fn log(&self, thread: usize) {
        let per_turn = |n: u64| n as f64 / self.turns.max(1) as f64;
        tracing::info!(
            thread,
            turns = self.turns,
            cqes = self.cqes,
            requests = self.requests,
            "queue thread ended: {} requests and {} completions in {} wake-ups ({:.2} \
             requests, {:.2} completions per wake-up)",
            self.requests,
            self.cqes,
            self.turns,
            per_turn(self.requests),
            per_turn(self.cqes),
        );
    }
}

/// A failed request is logged (a backend that fails is what an operator must see, and
/// fio's EIO names no cause), but a failing backend fails thousands: at most
/// [`FailureLog::PER_WINDOW`] lines per [`FailureLog::WINDOW_NS`]; how many more there
/// were is said with the first failure after the window (a count left when failures
/// stop is still in the shared region's error counter, which `status` shows).
#[derive(Default)]
struct FailureLog {
    window_start_ns: u64,
    logged: u32,
    suppressed: u64,
}

impl FailureLog {
    const PER_WINDOW: u32 = 5;
    const WINDOW_NS: u64 = 10_000_000_000;

    /// Whether a failure at `now_ns` gets its own line; says how many the window before
    /// left out when a new one starts.
    fn admit(&mut self, now_ns: u64) -> bool {
        if now_ns.saturating_sub(self.window_start_ns) >= Self::WINDOW_NS {
            if self.suppressed > 0 {
                tracing::warn!(more = self.suppressed, "more requests failed than were logged");
            }
            *self = FailureLog { window_start_ns: now_ns, logged: 0, suppressed: 0 };
        }
        if self.logged < Self::PER_WINDOW {
            self.logged += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }
}

impl QueueThread {
    /// The loop of `plan` on `ring` (`entries` SQEs, the device registered), serving
    /// `queues` of `dev`, which has `nr_tags` tags in all, with the commands of its
    /// data path.
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
            path: dev.data_path,
            plan,
            queues,
            reqs: vec![None; nr_tags],
            commit_slots: Vec::new(),
            sent_unacked: Vec::new(),
            spare: Vec::new(),
            inflight: 0,
            clock: TurnClock::new(),
            fetched_ns: vec![None; nr_tags],
            counted: CounterSnapshot::default(),
            cqes: Vec::with_capacity(entries as usize * 4),
            failures_logged: FailureLog::default(),
            target_work: TargetWork::default(),
            wakeups: Wakeups::default(),
            inline_sqes: 0,
            dev,
        }
    }

    /// Hands the kernel every tag of this thread's queues (batched: PREP, waiting for
    /// it; per-I/O: a FETCH_REQ per tag, which completes only with a request), before
    /// the device is started or recovered.
    pub fn prep(&mut self) -> Result<(), LoopError> {
        match self.path {
            DataPath::Batch => self.prep_batch(),
            DataPath::PerIo => self.prep_per_io(),
        }
    }

    pub(super) fn push(&mut self, sqe: &squeue::Entry) -> Result<(), LoopError> {
        loop {
            // SAFETY: every SQE this loop builds references memory that outlives its
            // completion (per-I/O commands reference none outside the SQE but their
            // tag's buffer): tag buffers and descriptor arrays (process-lifetime mappings),
            // FETCH buffer rings (leaked), and COMMIT/PREP element buffers, which stay
            // in `commit_slots` (or the PREP call's frame, which waits) until their CQE,
            // or for one-element COMMITs in `sent_unacked` and then `spare`: never freed
            // while the thread runs, so even a COMMIT the kernel read late would read
            // live memory (at worst a later batch's elements, which it would refuse).
            // A target's own SQEs (`nbd`'s WRITEV and RECV) reference its
            // connections' buffers and tag buffers, which the target (owned by the
            // device, which outlives this ring) keeps until their completions.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            self.ring
                .submit()
                .map_err(|source| LoopError::Wait { thread: self.plan.index, source })?;
        }
    }

    /// What a test hook asks of this thread before its first turn (nothing without
    /// the `test-hooks` feature).
    fn start_hooks(&mut self) -> Result<(), LoopError> {
        let start = hooks::on_thread_start(&self.dev, self.plan.index, self.ring.as_raw_fd());
        if let Some(sqe) = start.sqe {
            self.push(&sqe)?;
        }
        let q_id = self.queues[0].q_id;
        for tag in start.unowned_tags {
            match self.path {
                DataPath::Batch => {
                    let elem = self.elem(q_id, tag, 0);
                    let _ = self.queues[0].pending.push(elem);
                }
                DataPath::PerIo => self.commit_and_fetch(q_id, tag, 0)?,
            }
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
        if self.path == DataPath::Batch {
            for qi in 0..self.queues.len() {
                self.arm_fetch(qi)?;
            }
        }
        self.with_target(|target, thread, work| target.arm(thread, work))?;
        self.start_hooks()?;
        loop {
            if self.path == DataPath::Batch {
                self.flush_commits()?;
            }
            self.with_target(|target, thread, work| target.before_wait(thread, work))?;
            let open = self.queues.iter().any(|q| !q.closed);
            if !open
                && self.inflight == 0
                && self.commit_slots.iter().all(Option::is_none)
                && self.ring.submission().is_empty()
            {
                self.wakeups.log(self.plan.index);
                return Ok(());
            }
            // Completions already taken (the per-I/O path's first FETCH_REQs') are
            // handled without waiting.
            let work_expected = (open || self.inflight > 0) && self.cqes.is_empty();
            let waited = self.submit_and_wait_for_work(work_expected);
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
            self.clock.next_turn();
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result(), c.flags())));
            self.wakeups.turns += 1;
            self.wakeups.cqes += cqes.len() as u64;
            for &(ud, res, flags) in &cqes {
                self.handle_cqe(ud, res, flags)?;
            }
            cqes.clear();
            self.cqes = cqes;
            let handled = self.counted != CounterSnapshot::default();
            hooks::after_turn(&self.dev, slot_index, beat / 2, handled);
            if handled {
                self.wakeups.requests += self.counted.ios();
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

    /// Submits what is queued and sleeps until there is work: a FETCH batch (a request,
    /// per-I/O) or a target completion. A COMMIT of several elements completes at once
    /// (ublk runs it inline), and so does what a target says usually does (an NBD
    /// send), so waiting for a single completion would return at once for that CQE
    /// alone and cost a second `io_uring_enter` per loop turn; the wait counts those
    /// CQEs in and asks for one more. Its timeout bounds how late a failed COMMIT is
    /// noticed if nothing else arrives, and how long a send that did not complete at
    /// once can delay the turn. (One-element COMMITs post no CQE unless they fail.)
    fn submit_and_wait_for_work(&mut self, work_expected: bool) -> std::io::Result<usize> {
        let commits = self.commit_slots.iter().filter(|s| s.is_some()).count();
        let inline = commits + std::mem::take(&mut self.inline_sqes);
        // With every queue closed and nothing in the target only the COMMITs' own
        // completions are still to come.
        let want = inline + usize::from(work_expected);
        if want == 0 {
            return self.ring.submit();
        }
        if inline == 0 {
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
            Some(UserData::TargetOwn { key }) => {
                self.with_target(|target, thread, work| target.on_own_cqe(thread, key, res, work))
            }
            Some(UserData::IoCmd { q_id, tag }) => self.on_io_cmd(q_id, tag, res),
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

    pub(super) fn on_tag(&mut self, q_id: u16, tag: u16) -> Result<(), LoopError> {
        // Borrowed through the field, not cloned: the reference count is two atomic
        // operations per I/O, which cost under emulation.
        let dev = &*self.dev;
        let Some(desc) = dev.descs.get(usize::from(q_id)).and_then(|d| d.get(tag)) else {
            return Ok(());
        };
        let (buf, buf_index) = if dev.zero_copy {
            if desc.op_flags & uapi::UBLK_IO_F_NEED_REG_BUF != 0 {
                return Err(LoopError::PagesNotRegistered { q_id, tag });
            }
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
                since_ms: self.clock.known() / 1_000_000,
            });
        }
        let index = self.tag_index(q_id, tag);
        if let Some(at) = self.fetched_ns.get_mut(index) {
            *at = None;
        }
        let bounds = Bounds { size_bytes: dev.size_bytes, buf_bytes: dev.bufs.buf_bytes() as u64 };
        let mut req = match IoReq::from_desc(&desc, bounds, buf, buf_index) {
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
        req.reply = Reply {
            ring_fd: self.ring.as_raw_fd(),
            user_data: UserData::Target { q_id, tag }.encode(),
            thread: self.plan.index as u16,
        };
        let step = dev.target.start(&req);
        if !matches!(step, Step::Done(_))
            && let Some(at) = self.fetched_ns.get_mut(index)
        {
            *at = Some(self.clock.now());
        }
        self.reqs[index] = Some((req, 0));
        self.step(q_id, tag, step)
    }

    pub(super) fn tag_index(&self, q_id: u16, tag: u16) -> usize {
        usize::from(q_id) * usize::from(self.dev.depth) + usize::from(tag)
    }

    /// Zero copy: where in the ring's buffer table the kernel registers the request's
    /// pages — the tag's index, the same in every ring, so that whichever thread's
    /// FETCH delivers a tag finds its slot free. (The config keeps queues × depth
    /// within io_uring's 2^14 buffers for zero-copy devices.)
    pub(super) fn buf_index(&self, q_id: u16, tag: u16) -> u16 {
        self.tag_index(q_id, tag) as u16
    }

    fn step(&mut self, q_id: u16, tag: u16, step: Step) -> Result<(), LoopError> {
        match step {
            Step::Done(res) => {
                let index = self.tag_index(q_id, tag);
                let req = self.reqs[index].take().map(|(r, _)| r);
                if res < 0
                    && !self.dev.target.fails_on_purpose()
                    && self.failures_logged.admit(self.clock.now())
                {
                    tracing::warn!(
                        q_id,
                        tag,
                        op = req.map(|r| r.op),
                        offset = req.map(|r| r.offset),
                        len = req.map(|r| r.len),
                        "request failed: {}",
                        std::io::Error::from_raw_os_error(res.saturating_neg())
                    );
                }
                self.complete(q_id, tag, req.map_or(0, |r| r.op), res)
            }
            Step::Submit(sqe) => {
                let sqe = sqe.user_data(UserData::Target { q_id, tag }.encode());
                self.push(&sqe)
            }
            // Its completion comes as a target SQE's would (see `IoReq::reply`).
            Step::Pending => Ok(()),
        }
    }

    /// Asks the target `ask` (with this thread's number and the reused
    /// [`TargetWork`]), then carries out what it answered.
    fn with_target(
        &mut self,
        ask: impl FnOnce(&dyn crate::target::Target, usize, &mut TargetWork),
    ) -> Result<(), LoopError> {
        let mut work = std::mem::take(&mut self.target_work);
        ask(&*self.dev.target, self.plan.index, &mut work);
        let carried = self.carry_out(&mut work);
        self.target_work = work;
        carried
    }

    /// Submits the target's own SQEs and finishes the requests it says are done.
    fn carry_out(&mut self, work: &mut TargetWork) -> Result<(), LoopError> {
        // A target's SQEs go into one submission: they may be a chain linked in order
        // (`nbd`'s zero-copy sends), which split over two would run as two chains, side
        // by side. (A target's SQEs are far fewer than the ring's entries.)
        let free = {
            let sq = self.ring.submission();
            sq.capacity() - sq.len()
        };
        if free < work.sqes.len() {
            self.ring
                .submit()
                .map_err(|source| LoopError::Wait { thread: self.plan.index, source })?;
        }
        for sqe in work.sqes.drain(..) {
            self.push(&sqe)?;
        }
        self.inline_sqes += std::mem::take(&mut work.inline);
        for (ud, res) in work.done.drain(..) {
            if let Some(UserData::Target { q_id, tag }) = UserData::decode(ud) {
                self.on_target(q_id, tag, res)?;
            }
        }
        Ok(())
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

    /// Records a finished request and hands its result back: queues its COMMIT element
    /// (batched) or submits its COMMIT_AND_FETCH_REQ (per-I/O).
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
            match op {
                uapi::UBLK_IO_OP_READ => c.read_errors += 1,
                uapi::UBLK_IO_OP_WRITE => c.write_errors += 1,
                uapi::UBLK_IO_OP_FLUSH => c.flush_errors += 1,
                uapi::UBLK_IO_OP_DISCARD => c.discard_errors += 1,
                uapi::UBLK_IO_OP_WRITE_ZEROES => c.write_zeroes_errors += 1,
                // Counted in `errors` alone: the supervisor reports it as op="other".
                _ => {}
            }
        } else if op == uapi::UBLK_IO_OP_READ {
            c.bytes_read += res as u64;
        } else if op == uapi::UBLK_IO_OP_WRITE {
            c.bytes_written += res as u64;
        }
        if let Some(slot) = self.dev.shm.tag(q_id, tag) {
            slot.set_state(tag_state::COMMITTED);
        }
        if let (Some(class), Some(at), Some(hist)) = (
            LatencyOp::of_ublk_op(op),
            self.fetched_ns.get(self.tag_index(q_id, tag)).copied(),
            self.dev.shm.latency(self.plan.index),
        ) {
            // Answered in the turn that fetched it: no time at the backend, and no
            // clock read.
            let ns = at.map_or(0, |at| self.clock.now().saturating_sub(at));
            hist.record(class, ns);
        }
        self.inflight = self.inflight.saturating_sub(1);
        if self.path == DataPath::PerIo {
            return self.commit_and_fetch(q_id, tag, res);
        }
        let elem = self.elem(q_id, tag, res);
        let Some(q) = self.queues.iter_mut().find(|q| q.q_id == q_id) else { return Ok(()) };
        q.pending.push(elem).map_err(|e| LoopError::Commit { q_id, tag, what: e.into() })
    }
}

#[cfg(test)]
mod tests {
    use super::FailureLog;

    #[test]
    fn failures_are_logged_a_few_per_window_then_counted() {
        let mut log = FailureLog::default();
        let second = 1_000_000_000;
        let admitted = (0..20).filter(|&i| log.admit(i * 1_000)).count();
        assert_eq!(admitted, FailureLog::PER_WINDOW as usize);
        assert_eq!(log.suppressed, 20 - u64::from(FailureLog::PER_WINDOW));
        // Still the same window: nothing more gets a line.
        assert!(!log.admit(5 * second));
        // A new window: the count starts again, and the left-out ones are said once.
        assert!(log.admit(FailureLog::WINDOW_NS + 1));
        assert_eq!((log.logged, log.suppressed), (1, 0));
    }
}
