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
//!
//! The list also knows which requests librbd holds, so that a worker whose device is
//! being deleted while the cluster is away can give them up ([`Completions::give_up`]):
//! each is finished with EIO at once, every later one is refused, and librbd's own
//! completion of a request given up, whenever it comes, is dropped.

use std::collections::HashSet;
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
    done: Mutex<Lists>,
    /// Where the armed READ puts the eventfd's count (never looked at). Written by the
    /// kernel only while a READ is in flight; it lives as long as the target, which
    /// outlives the rings.
    count: AtomicU64,
}

/// A queue thread's requests: those librbd finished, and those it holds.
#[derive(Debug, Default)]
struct Lists {
    done: Vec<Finished>,
    /// The requests (by user data) handed to librbd and not finished.
    held: HashSet<u64>,
    /// The held requests were given up: every later one is refused.
    given_up: bool,
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
            done: Mutex::new(Lists::default()),
            count: AtomicU64::new(0),
        })
    }

    /// The eventfd the thread's ring registers.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    fn list(&self) -> MutexGuard<'_, Lists> {
        self.done.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wake(&self) {
        if let Err(e) = sys::eventfd_add(self.wake.as_fd(), 1) {
            // Cannot happen to a valid eventfd with a count far from its limit; a
            // lost wake would stall this thread's requests, so say it.
            tracing::error!("cannot wake queue thread for librbd's completions: {e}");
        }
    }

    /// On the queue thread, before the request with `user_data` is handed to librbd:
    /// whether it may be (false once the held requests were given up: the request is
    /// to fail with EIO at once).
    pub fn hand_over(&self, user_data: u64) -> bool {
        let mut lists = self.list();
        !lists.given_up && lists.held.insert(user_data)
    }

    /// On the queue thread: librbd refused the request with `user_data` up front (it
    /// will not call back).
    pub fn refused(&self, user_data: u64) {
        self.list().held.remove(&user_data);
    }

    /// On librbd's thread: hands `finished` to the queue thread, waking it if it has
    /// nothing else waiting; dropped if the request was given up (finished with EIO
    /// already). Never blocks but on the list's lock, held only to push or to swap the
    /// list out.
    pub fn push(&self, finished: Finished) {
        let wake = {
            let mut lists = self.list();
            if !lists.held.remove(&finished.0) {
                return;
            }
            push_and_tell(&mut lists.done, finished)
        };
        if wake {
            self.wake();
        }
    }

    /// Finishes every request librbd holds with EIO, and has every later one refused
    /// ([`Self::hand_over`]): how many were held. Their buffers stay the worker's (a
    /// late read from librbd lands in a buffer whose request has failed, and is never
    /// copied to the kernel).
    pub fn give_up(&self) -> usize {
        let (given_up, wake) = {
            let mut lists = self.list();
            lists.given_up = true;
            let held: Vec<u64> = lists.held.drain().collect();
            let was_empty = lists.done.is_empty();
            lists.done.extend(held.iter().map(|&user_data| (user_data, -libc::EIO)));
            (held.len(), was_empty && !held.is_empty())
        };
        if wake {
            self.wake();
        }
        given_up
    }

    /// Moves every finished request into `into` (the queue loop's `TargetWork::done`).
    pub fn take_into(&self, into: &mut Vec<Finished>) {
        into.append(&mut self.list().done);
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
            assert!(c.hand_over(i));
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
        assert!(c.hand_over(1) && c.hand_over(2));
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
        assert!(c.hand_over(1) && c.hand_over(2));
        c.push((1, 0));
        c.take_into(&mut Vec::new());
        c.push((2, 0));
        assert_eq!(take_count(&c), 2);
    }

    #[test]
    fn held_requests_given_up_fail_with_eio_once_and_later_ones_are_refused() {
        let c = Completions::new().unwrap();
        assert!(c.hand_over(1) && c.hand_over(2) && c.hand_over(3));
        c.refused(3);
        c.push((1, 4096));
        assert_eq!(take_count(&c), 1);
        let mut done = Vec::new();
        c.take_into(&mut done);
        assert_eq!(done, vec![(1, 4096)]);
        // Only 2 is still held by librbd.
        assert_eq!(c.give_up(), 1);
        assert!(woken(&c));
        done.clear();
        c.take_into(&mut done);
        assert_eq!(done, vec![(2, -libc::EIO)]);
        // librbd finishes it late: dropped, not committed twice.
        c.push((2, 4096));
        assert!(c.hand_over(4).eq(&false), "a new request is refused once given up");
        done.clear();
        c.take_into(&mut done);
        assert!(done.is_empty(), "{done:?}");
        assert_eq!(c.give_up(), 0);
    }
}
