//! The batched data path (`UBLK_F_BATCH_IO`) of a queue thread: PREP every tag once,
//! keep a multishot FETCH armed on each queue the thread serves, and COMMIT finished
//! requests in batches, one COMMIT per queue per loop turn. It owns the COMMIT element
//! buffers in flight; what both data paths share is in `thread`.

use io_uring::{cqueue, squeue};
use ublkd_proto::batch::{self, BatchElem, ElemBuf};
use ublkd_proto::errno::Errno;
use ublkd_proto::sqe;
use ublkd_proto::uapi;

use super::ring::{UBLKC_FIXED_FD, elem_format};
use super::thread::QueueThread;
use super::user_data::UserData;
use super::{CommitRefusal, LoopError};
use crate::bufring::BufRing;

impl QueueThread {
    /// The PREP or COMMIT element of a tag: its buffer's address (kernel copy), or the
    /// buffer table index its pages are to be registered at (zero copy).
    pub(super) fn elem(&self, q_id: u16, tag: u16, result: i32) -> BatchElem {
        if self.dev.zero_copy {
            let buf_index = self.buf_index(q_id, tag);
            BatchElem { tag, buf_index, result, ..BatchElem::default() }
        } else {
            let buf_addr = self.dev.bufs.get(q_id, tag).map_or(0, |p| p as u64);
            BatchElem { tag, buf_addr, result, ..BatchElem::default() }
        }
    }

    /// PREPs every tag of this thread's PREP queues and waits until the kernel took them.
    pub(super) fn prep_batch(&mut self) -> Result<(), LoopError> {
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

    pub(super) fn arm_fetch(&mut self, qi: usize) -> Result<(), LoopError> {
        let q = &self.queues[qi];
        if q.fetch_armed || q.closed {
            return Ok(());
        }
        let ud = UserData::Fetch { q_id: q.q_id, index: qi as u32 };
        let Some(bgid) = q.bufring.as_ref().map(BufRing::bgid) else { return Ok(()) };
        let sqe = sqe::fetch(UBLKC_FIXED_FD, q.q_id, self.dev.depth, bgid).user_data(ud.encode());
        self.push(&sqe)?;
        self.queues[qi].fetch_armed = true;
        Ok(())
    }

    pub(super) fn on_fetch(&mut self, qi: usize, res: i32, flags: u32) -> Result<(), LoopError> {
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
                let bytes = q
                    .bufring
                    .as_mut()
                    .expect("a batch queue has a buffer ring")
                    .filled(bid, res as usize)
                    .ok_or(LoopError::Fetch {
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
            if let Some(bufring) = q.bufring.as_mut() {
                bufring.recycle(bid);
            }
            for &tag in &tags[..count] {
                self.on_tag(q_id, tag)?;
            }
        }
        if !self.queues[qi].fetch_armed && !self.queues[qi].closed {
            self.arm_fetch(qi)?;
        }
        Ok(())
    }

    /// Submits one COMMIT per queue with finished requests.
    pub(super) fn flush_commits(&mut self) -> Result<(), LoopError> {
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

    pub(super) fn on_commit(&mut self, slot: usize, res: i32) -> Result<(), LoopError> {
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
