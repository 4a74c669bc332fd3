//! The workers' wait set: one epoll instance holding the pidfd of every worker this
//! ublkd starts or takes over, registered once, when the worker is, under its device's
//! id. The loop polls the epoll fd alone, so a turn's `poll` does not carry two or
//! three pidfds per device, and [`ready`] names the devices whose workers ended, so
//! that a death costs a visit to its own device, not to all of them.
//!
//! Nothing is ever removed by hand: closing a worker's pidfd (dropping the `Worker`)
//! takes it out of the set. Each pidfd is registered one-shot: an ended worker is
//! named once, since an end is for good, and a dead worker that something still holds
//! (a delete's thread, a recovery waiting for the kernel's release) does not keep the
//! loop awake; the loop remembers which devices were named until it has visited them.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

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

/// Set once a worker could not join the set: from then on the loop visits every device
/// whenever the set wakes it, since it cannot rely on being told which.
static INCOMPLETE: AtomicBool = AtomicBool::new(false);

/// How many ended workers one call of [`ready`] names at most; the rest stay ready and
/// are named on the next turns.
const READY_AT_ONCE: usize = 256;

/// Adds `pidfd` (worker `pid`'s, of device `dev_id`) to the wait set, if there is one.
/// A failure leaves the worker unwatched by the set, so it is an error in the journal;
/// it cannot happen short of running out of memory.
pub(super) fn register(pidfd: &OwnedFd, dev_id: u32, pid: u32) {
    let Some(epoll) = WAIT_SET.get() else { return };
    let event = EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLONESHOT, token(dev_id, pid));
    if let Err(e) = epoll.add(pidfd, event) {
        INCOMPLETE.store(true, Ordering::Relaxed);
        tracing::error!(
            dev_id,
            worker_pid = pid,
            "cannot add the worker to the wait set (epoll: {e}); every device is visited \
             whenever a worker ends from now on"
        );
    }
}

/// Whether the set may miss a worker (one could not join it).
pub fn incomplete() -> bool {
    INCOMPLETE.load(Ordering::Relaxed)
}

/// An epoll event's data: the device in the high half, the worker's pid in the low.
fn token(dev_id: u32, pid: u32) -> u64 {
    (u64::from(dev_id) << 32) | u64::from(pid)
}

/// The devices of the workers that have ended since the last call, appended to
/// `devices` (each end once), without waiting. Empty without a set.
pub fn ready(devices: &mut Vec<u32>) {
    let Some(epoll) = WAIT_SET.get() else { return };
    let mut events = [EpollEvent::empty(); READY_AT_ONCE];
    match epoll.wait(&mut events, EpollTimeout::ZERO) {
        Ok(n) => devices.extend(events[..n].iter().map(|e| (e.data() >> 32) as u32)),
        Err(e) => {
            // Not expected (EINTR aside): say so, and let the caller visit everything.
            tracing::debug!("the wait set cannot be read (epoll: {e})");
            INCOMPLETE.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_keeps_the_device_and_the_pid_apart() {
        let t = token(u32::MAX - 1, 7);
        assert_eq!((t >> 32) as u32, u32::MAX - 1);
        assert_eq!(t as u32, 7);
    }

    #[test]
    fn an_ended_child_names_its_device() {
        init();
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let pidfd = crate::worker::pidfd::pidfd_open(pid).unwrap();
        register(&pidfd, 41, pid);
        let mut named = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !named.contains(&41) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
            ready(&mut named);
        }
        assert!(named.contains(&41), "the wait set did not name device 41: {named:?}");
        drop(child);
    }
}
