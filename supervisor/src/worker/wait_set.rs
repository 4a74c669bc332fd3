//! The workers' wait set: one epoll instance holding the pidfd of every worker this
//! ublkd starts or takes over, registered once, when the worker is. The loop polls the
//! epoll fd alone, so a turn's `poll` no longer carries two or three pidfds per device
//! (a cost in proportion to the devices, on every turn).
//!
//! Nothing is ever removed by hand: closing a worker's pidfd (dropping the `Worker`)
//! takes it out of the set. The set is level-triggered, as the `poll` it replaces: a
//! dead worker's pidfd keeps the epoll fd readable until the worker is reaped and
//! dropped, which the loop does on the turn it sees it.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::OnceLock;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};

static WAIT_SET: OnceLock<Epoll> = OnceLock::new();

/// Creates the wait set (once, at ublkd's start). If it cannot, the loop polls every
/// pidfd itself.
pub fn init() {
    if WAIT_SET.get().is_some() {
        return;
    }
    match Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC) {
        Ok(epoll) => {
            let _ = WAIT_SET.set(epoll);
        }
        Err(e) => tracing::warn!("cannot create the workers' wait set (epoll: {e}); polling each"),
    }
}

/// The wait set's fd, readable when a registered worker has exited.
pub fn fd() -> Option<BorrowedFd<'static>> {
    WAIT_SET.get().map(|e| e.0.as_fd())
}

/// Adds `pidfd` (worker `pid`'s) to the wait set, if there is one. A failure leaves
/// the worker unwatched by the set, so it is an error in the journal; it cannot happen
/// short of running out of memory.
pub(super) fn register(pidfd: &OwnedFd, pid: u32) {
    let Some(epoll) = WAIT_SET.get() else { return };
    let event = EpollEvent::new(EpollFlags::EPOLLIN, u64::from(pid));
    if let Err(e) = epoll.add(pidfd, event) {
        tracing::error!(worker_pid = pid, "cannot add the worker to the wait set (epoll: {e})");
    }
}
