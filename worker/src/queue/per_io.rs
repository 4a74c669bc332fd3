//! The per-I/O data path of a queue thread, for kernels without `UBLK_F_BATCH_IO`
//! (Linux 6.5 to 6.x): one `FETCH_REQ` per tag hands the kernel the tag and its buffer;
//! it completes when a request for that tag arrives (its descriptor in the queue's
//! mmapped descriptor array, WRITE data already copied into the buffer). The result
//! goes back with `COMMIT_AND_FETCH_REQ`, which also re-arms the tag (the kernel copies
//! READ data out of the buffer while it runs). `UBLK_IO_RES_ABORT` ends a tag: the
//! queue is going away.
//!
//! Without `UBLK_F_PER_IO_DAEMON` the kernel binds a queue to the task that issued its
//! first FETCH_REQ and refuses commands for it from any other, so on this path each
//! queue is served by exactly one thread (see `plan::plan_for`), which issues every
//! command of its queues itself, from its own ring. What both data paths share is in
//! `thread`.

use ublkd_proto::errno::Errno;
use ublkd_proto::sqe;
use ublkd_proto::uapi::{self, UblksrvIoCmd};

use super::CommitRefusal;
use super::LoopError;
use super::ring::UBLKC_FIXED_FD;
use super::thread::QueueThread;
use super::user_data::UserData;

impl QueueThread {
    /// The per-I/O command `cmd_op` for tag `tag` of queue `q_id`, with `result` and
    /// the tag's buffer.
    fn io_cmd(&self, cmd_op: u32, q_id: u16, tag: u16, result: i32) -> io_uring::squeue::Entry {
        let addr = self.dev.bufs.get(q_id, tag).map_or(0, |p| p as u64);
        let cmd = UblksrvIoCmd { q_id, tag, result, addr };
        sqe::io_cmd(UBLKC_FIXED_FD, cmd_op, cmd).user_data(UserData::IoCmd { q_id, tag }.encode())
    }

    fn queue_index(&self, q_id: u16) -> Option<usize> {
        self.queues.iter().position(|q| q.q_id == q_id)
    }

    /// Issues a FETCH_REQ for every tag of this thread's queues, from this thread (the
    /// queue's task from now on). They complete only with requests, after the device
    /// is started or recovered; a FETCH_REQ the kernel refuses fails at once, so the
    /// completions already posted are looked at: a refusal fails the preparation, any
    /// other completion is kept for the loop's first turn.
    pub(super) fn prep_per_io(&mut self) -> Result<(), LoopError> {
        for qi in 0..self.queues.len() {
            let q_id = self.queues[qi].q_id;
            for tag in 0..self.dev.depth {
                let sqe = self.io_cmd(uapi::UBLK_U_IO_FETCH_REQ, q_id, tag, 0);
                self.push(&sqe)?;
                self.queues[qi].armed += 1;
            }
        }
        self.ring.submit().map_err(|source| LoopError::Wait { thread: self.plan.index, source })?;
        let posted: Vec<(u64, i32, u32)> =
            self.ring.completion().map(|c| (c.user_data(), c.result(), c.flags())).collect();
        for (ud, res, flags) in posted {
            if let Some(UserData::IoCmd { q_id, tag }) = UserData::decode(ud)
                && res < 0
            {
                return Err(LoopError::FetchReq { q_id, tag, errno: Errno(-res) });
            }
            self.cqes.push((ud, res, flags));
        }
        Ok(())
    }

    /// Hands request `tag` of queue `q_id` back with `result` and re-arms the tag.
    pub(super) fn commit_and_fetch(
        &mut self,
        q_id: u16,
        tag: u16,
        result: i32,
    ) -> Result<(), LoopError> {
        let sqe = self.io_cmd(uapi::UBLK_U_IO_COMMIT_AND_FETCH_REQ, q_id, tag, result);
        self.push(&sqe)?;
        if let Some(qi) = self.queue_index(q_id) {
            let q = &mut self.queues[qi];
            q.armed += 1;
            q.closed = false;
        }
        Ok(())
    }

    /// A FETCH_REQ or COMMIT_AND_FETCH_REQ of tag `tag` completed with `res`: a request
    /// (`UBLK_IO_RES_OK`), the end of the tag (`UBLK_IO_RES_ABORT`: the device is
    /// stopping, or this worker's file is going away), or a refusal, which means the
    /// worker and the kernel disagree about who owns the tag: the loop fails (see the
    /// module docs of `queue`).
    pub(super) fn on_io_cmd(&mut self, q_id: u16, tag: u16, res: i32) -> Result<(), LoopError> {
        let Some(qi) = self.queue_index(q_id) else { return Ok(()) };
        let q = &mut self.queues[qi];
        q.armed = q.armed.saturating_sub(1);
        match res {
            uapi::UBLK_IO_RES_OK => self.on_tag(q_id, tag),
            uapi::UBLK_IO_RES_ABORT => {
                if q.armed == 0 {
                    q.closed = true;
                    tracing::debug!(q_id, "every tag aborted: queue closed");
                }
                Ok(())
            }
            _ => {
                let what = if res < 0 {
                    CommitRefusal::Errno(Errno(-res))
                } else {
                    CommitRefusal::Unexpected(res)
                };
                Err(LoopError::Commit { q_id, tag, what })
            }
        }
    }
}
