//! `null`: completes every I/O at once. Writes are discarded; reads return whatever the
//! tag's buffer holds (no zero-fill, so the target costs nothing per byte).

use std::os::fd::BorrowedFd;

use super::{IoReq, Step, Target};
use ublkd_proto::uapi::{UBLK_IO_OP_READ, UBLK_IO_OP_WRITE};

#[derive(Debug)]
pub struct NullTarget;

impl Target for NullTarget {
    fn start(&self, req: &IoReq) -> Step {
        match req.op {
            UBLK_IO_OP_READ | UBLK_IO_OP_WRITE => Step::Done(req.len as i32),
            _ => Step::Done(0),
        }
    }

    fn on_cqe(&self, _req: &IoReq, res: i32, _done: &mut u32) -> Step {
        Step::Done(res)
    }

    fn fixed_file(&self, _thread: usize) -> Option<BorrowedFd<'_>> {
        None
    }
}
