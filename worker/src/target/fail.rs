//! `fail-io`: completes every request with EIO at once. The supervisor serves a device
//! with it once the device's restart budget is spent and the config says
//! `on_restart_limit = "fail-io"`: applications get an error instead of waiting on a
//! QUIESCED device, and the device (its id, its openers, its data) stays for
//! `ublkctl recover`.

use std::os::fd::BorrowedFd;

use super::{IoReq, Step, Target};

#[derive(Debug)]
pub struct FailTarget;

impl Target for FailTarget {
    fn start(&self, _req: &IoReq) -> Step {
        Step::Done(-libc::EIO)
    }

    fn on_cqe(&self, _req: &IoReq, _res: i32, _done: &mut u32) -> Step {
        Step::Done(-libc::EIO)
    }

    fn fixed_file(&self, _thread: usize) -> Option<BorrowedFd<'_>> {
        None
    }

    fn fails_on_purpose(&self) -> bool {
        true
    }
}
