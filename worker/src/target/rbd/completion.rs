//! How a request librbd finished gets back to the queue thread that started it:
//! librbd calls its callback on a thread of its own, which must not block. The
//! callback adds `(user_data, result)` to that queue thread's list and, only when the
//! list was empty, adds 1 to the thread's eventfd, which a READ armed in the thread's
//! ring is waiting on; the thread then takes the whole list at once. So a burst of
//! completions costs one `write` and one ring completion, not one each.
//!
//! No wake is lost: every push onto an empty list is followed by a write, the eventfd
//! keeps its count until a READ takes it, and the thread takes the list only after its
//! READ completed and re-arms the READ right after; a write that lands between the
//! take and the re-arm completes the next READ at once (at worst one wake-up that finds
//! the list empty).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard};

use io_uring::{opcode, squeue, types};

use crate::sys;
use crate::target::{TARGET_FIXED_FD, own_user_data};

/// A finished request: its [`crate::target::Reply::user_data`] and result.
pub type Finished = (u64, i32);

/// One queue thread's finished requests, and the eventfd that wakes it.
#[derive(Debug)]
pub struct Completions {
    /// Registered at [`TARGET_FIXED_FD`] in the thread's ring (see
    /// `Target::fixed_file`).
    wake: OwnedFd,
    done: Mutex<Vec<Finished>>,
    /// Where the armed READ puts the eventfd's count (never looked at). Written by the
    /// kernel only while a READ is in flight; it lives as long as the target, which
    /// outlives the rings.
    count: AtomicU64,
}

/// Adds `finished` to `list`: whether the list was empty, so the thread must be woken.
fn push_and_tell(list: &mut Vec<Finished>, finished: Finished) -> bool {
    let was_empty = list.is_empty();
    list.push(finished);
    was_empty
}

impl Completions {
    pub fn new() -> io::Result<Completions> {
        Ok(Completions {
            // Blocking (no EFD_NONBLOCK): io_uring then waits for a count instead of
            // failing the READ with EAGAIN.
            wake: sys::eventfd(libc::EFD_CLOEXEC)?,
            done: Mutex::new(Vec::new()),
            count: AtomicU64::new(0),
        })
    }

    /// The eventfd the thread's ring registers.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    fn list(&self) -> MutexGuard<'_, Vec<Finished>> {
        self.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// On librbd's thread: hands `finished` to the queue thread, waking it if it has
    /// nothing else waiting. Never blocks but on the list's lock, held only to push
    /// or to swap the list out.
    pub fn push(&self, finished: Finished) {
        let wake = push_and_tell(&mut self.list(), finished);
        if wake && let Err(e) = sys::eventfd_add(self.wake.as_fd(), 1) {
            // Cannot happen to a valid eventfd with a count far from its limit; a
            // lost wake would stall this thread's requests, so say it.
            tracing::error!("cannot wake queue thread for librbd's completions: {e}");
        }
    }

    /// Moves every finished request into `into` (the queue loop's `TargetWork::done`).
    pub fn take_into(&self, into: &mut Vec<Finished>) {
        into.append(&mut self.list());
    }

    /// The READ of the eventfd (registered at [`TARGET_FIXED_FD`]) that completes
    /// when the list becomes non-empty, with [`own_user_data`]`(key)`.
    pub fn wait_sqe(&self, key: u32) -> squeue::Entry {
        opcode::Read::new(types::Fixed(TARGET_FIXED_FD), self.count.as_ptr().cast(), 8)
            .build()
            .user_data(own_user_data(key))
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    /// Whether the eventfd has a count, without taking it.
    fn woken(c: &Completions) -> bool {
        let mut fds =
            [libc::pollfd { fd: c.wake_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        // SAFETY: one valid pollfd for the call's duration; a zero timeout.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
        n == 1
    }

    /// Takes the eventfd's count (only called when it has one: the fd blocks).
    fn take_count(c: &Completions) -> u64 {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v`, which is 8 bytes long.
        let n = unsafe { libc::read(c.wake_fd().as_raw_fd(), (&raw mut v).cast(), 8) };
        assert_eq!(n, 8);
        v
    }

    #[test]
    fn only_a_push_onto_an_empty_list_wakes() {
        let mut list = Vec::new();
        assert!(push_and_tell(&mut list, (1, 0)));
        assert!(!push_and_tell(&mut list, (2, 0)));
        list.clear();
        assert!(push_and_tell(&mut list, (3, 0)));
    }

    #[test]
    fn a_burst_of_completions_costs_one_wake_and_is_taken_whole() {
        let c = Completions::new().unwrap();
        assert!(!woken(&c));
        for i in 0..5 {
            c.push((i, 4096));
        }
        assert_eq!(take_count(&c), 1);
        let mut done = Vec::new();
        c.take_into(&mut done);
        assert_eq!(done, (0..5).map(|i| (i, 4096)).collect::<Vec<_>>());
        assert!(!woken(&c));
    }

    #[test]
    fn a_push_after_the_take_wakes_again() {
        let c = Completions::new().unwrap();
        c.push((1, 0));
        assert_eq!(take_count(&c), 1);
        c.take_into(&mut Vec::new());
        c.push((2, -libc::EIO));
        assert!(woken(&c));
        let mut done = Vec::new();
        c.take_into(&mut done);
        assert_eq!(done, vec![(2, -libc::EIO)]);
    }

    #[test]
    fn a_push_before_the_wake_was_taken_leaves_one_count() {
        // The thread took the list, then a callback pushed before the READ was
        // re-armed: the count waits for the next READ.
        let c = Completions::new().unwrap();
        c.push((1, 0));
        c.take_into(&mut Vec::new());
        c.push((2, 0));
        assert_eq!(take_count(&c), 2);
    }
}
