//! `read_only`: a device's target behind a gate that completes every request that
//! would change data with `EROFS`, so that it never reaches the backend. The kernel
//! marks a disk made with `UBLK_ATTR_READ_ONLY` read-only, but a write that reaches
//! the block layer anyway (the flag cleared with `blockdev --setrw` by root) is only
//! warned about, not failed (as measured for issue 45). So the worker enforces it
//! itself, trusting nothing but its own setup.

use std::os::fd::{BorrowedFd, OwnedFd};

use ublkd_proto::uapi::{UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ};

use super::{IoReq, Step, Target, TargetError, TargetWork};

/// `inner`, refusing every request but READ and FLUSH.
pub struct ReadOnlyTarget {
    inner: Box<dyn Target>,
}

impl ReadOnlyTarget {
    pub fn new(inner: Box<dyn Target>) -> Self {
        Self { inner }
    }

    /// Whether `req` leaves the data as it is: an allowlist, so that an operation
    /// added to the kernel later is refused until it is known to be harmless.
    fn allowed(req: &IoReq) -> bool {
        matches!(req.op, UBLK_IO_OP_READ | UBLK_IO_OP_FLUSH)
    }
}

impl Target for ReadOnlyTarget {
    fn start(&self, req: &IoReq) -> Step {
        if Self::allowed(req) { self.inner.start(req) } else { Step::Done(-libc::EROFS) }
    }

    fn on_cqe(&self, req: &IoReq, res: i32, done: &mut u32) -> Step {
        // Only requests `start` let through have SQEs.
        self.inner.on_cqe(req, res, done)
    }

    fn arm(&self, thread: usize, work: &mut TargetWork) {
        self.inner.arm(thread, work);
    }

    fn before_wait(&self, thread: usize, work: &mut TargetWork) {
        self.inner.before_wait(thread, work);
    }

    fn on_own_cqe(&self, thread: usize, key: u32, res: i32, work: &mut TargetWork) {
        self.inner.on_own_cqe(thread, key, res, work);
    }

    fn fixed_file(&self, thread: usize) -> Option<BorrowedFd<'_>> {
        self.inner.fixed_file(thread)
    }

    fn activate(&self, fds: Vec<OwnedFd>, fence: &[String]) -> Result<(), TargetError> {
        self.inner.activate(fds, fence)
    }

    fn client_identity(&self) -> Option<String> {
        self.inner.client_identity()
    }

    fn give_up_held(&self) -> usize {
        self.inner.give_up_held()
    }

    fn report(&self) {
        self.inner.report();
    }

    fn release(&self) {
        self.inner.release();
    }

    unsafe fn close(&self) {
        // SAFETY: the caller upholds `close`'s contract (no thread uses the target for
        // I/O from now on), which is `inner`'s too: this target is its only user.
        unsafe { self.inner.close() }
    }

    fn fails_on_purpose(&self) -> bool {
        self.inner.fails_on_purpose()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use ublkd_proto::uapi::{UBLK_IO_OP_DISCARD, UBLK_IO_OP_WRITE, UBLK_IO_OP_WRITE_ZEROES};

    use super::*;
    use crate::target::Reply;

    /// Counts the requests that reach it and completes each at once.
    struct Counting(Arc<AtomicUsize>);

    impl Target for Counting {
        fn start(&self, req: &IoReq) -> Step {
            self.0.fetch_add(1, Ordering::Relaxed);
            Step::Done(req.len as i32)
        }

        fn on_cqe(&self, _req: &IoReq, res: i32, _done: &mut u32) -> Step {
            Step::Done(res)
        }

        fn fixed_file(&self, _thread: usize) -> Option<BorrowedFd<'_>> {
            None
        }
    }

    fn req(op: u8) -> IoReq {
        IoReq {
            op,
            flags: 0,
            offset: 0,
            len: 4096,
            buf: std::ptr::null_mut(),
            buf_index: None,
            reply: Reply::UNSET,
        }
    }

    #[test]
    fn a_change_of_data_is_refused_with_erofs_and_never_reaches_the_target() {
        let reached = Arc::new(AtomicUsize::new(0));
        let target = ReadOnlyTarget::new(Box::new(Counting(reached.clone())));
        for op in [UBLK_IO_OP_WRITE, UBLK_IO_OP_DISCARD, UBLK_IO_OP_WRITE_ZEROES, 0xfe] {
            assert!(matches!(target.start(&req(op)), Step::Done(r) if r == -libc::EROFS), "{op}");
        }
        assert_eq!(reached.load(Ordering::Relaxed), 0);
        assert!(matches!(target.start(&req(UBLK_IO_OP_READ)), Step::Done(4096)));
        assert!(matches!(target.start(&req(UBLK_IO_OP_FLUSH)), Step::Done(_)));
        assert_eq!(reached.load(Ordering::Relaxed), 2);
    }
}
