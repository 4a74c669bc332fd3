//! A provided-buffer ring (io_uring `IORING_REGISTER_PBUF_RING`) for multishot FETCH.
//!
//! Each FETCH CQE consumes one buffer, into which the kernel wrote the delivered tags.
//! Returning a buffer is two plain memory writes (the entry and the tail), no syscall.
//! The ring holds as many buffers as the queue has tags, so it cannot run dry: at most
//! `queue_depth` requests are at the server, each CQE carries at least one, and a
//! buffer is returned as soon as its CQE is processed. (If it ever did run dry, the
//! FETCH would end with `ENOBUFS` and the thread re-arms it.)

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::types::BufRingEntry;
use io_uring::{IoUring, cqueue, squeue};

/// Bytes of tags one buffer holds: the most one CQE may carry.
pub const BUF_BYTES: usize = ublkd_proto::batch::MAX_TAGS_PER_FETCH * 2;

/// A registered buffer ring and the buffers it hands out.
#[derive(Debug)]
pub struct BufRing {
    bgid: u16,
    entries: u16,
    /// `entries` × `BufRingEntry`, page aligned, shared with the kernel.
    ring: NonNull<BufRingEntry>,
    /// `entries` × `BUF_BYTES`. Leaked like the ring mapping: the kernel may write
    /// into a provided buffer until the io_uring's asynchronous teardown finishes,
    /// which can be after the ring is dropped, so neither is ever freed (a worker
    /// registers its rings once, at start).
    bufs: &'static mut [u8],
    tail: u16,
}

impl BufRing {
    /// Registers a ring of at least `min_entries` buffers (rounded up to a power of two,
    /// at most 32768) as buffer group `bgid` of `uring`, with every buffer provided.
    pub fn register(
        uring: &IoUring<squeue::Entry, cqueue::Entry>,
        bgid: u16,
        min_entries: usize,
    ) -> io::Result<BufRing> {
        let entries = min_entries.clamp(2, 1 << 15).next_power_of_two();
        let ring_bytes = entries * size_of::<BufRingEntry>();
        let ring =
            crate::device::map_anonymous(ring_bytes, libc::MAP_POPULATE)?.cast::<BufRingEntry>();
        let ptr = ring.as_ptr();
        // The mapping is never unmapped (see `bufs`).
        let mut this = BufRing {
            bgid,
            entries: entries as u16,
            ring,
            bufs: Box::leak(vec![0u8; entries * BUF_BYTES].into_boxed_slice()),
            tail: 0,
        };
        // SAFETY: `ring` is a page-aligned, zeroed mapping of `entries` entries that is
        // never unmapped; `entries` is a power of two ≤ 32768.
        unsafe {
            uring.submitter().register_buf_ring_with_flags(ptr as u64, entries as u16, bgid, 0)?;
        }
        for bid in 0..entries as u16 {
            this.push(bid);
        }
        this.publish();
        Ok(this)
    }

    pub fn bgid(&self) -> u16 {
        self.bgid
    }

    /// The bytes of buffer `bid` the kernel filled (`len` from the CQE), or `None` for
    /// a buffer id or length outside the ring.
    pub fn filled(&self, bid: u16, len: usize) -> Option<&[u8]> {
        if bid >= self.entries || len > BUF_BYTES {
            return None;
        }
        let start = usize::from(bid) * BUF_BYTES;
        Some(&self.bufs[start..start + len])
    }

    /// Gives buffer `bid` back to the kernel.
    pub fn recycle(&mut self, bid: u16) {
        if bid < self.entries {
            self.push(bid);
            self.publish();
        }
    }

    fn push(&mut self, bid: u16) {
        let mask = self.entries - 1;
        let index = usize::from(self.tail & mask);
        let addr = self.bufs.as_ptr() as u64 + u64::from(bid) * BUF_BYTES as u64;
        // SAFETY: `index` < `entries`, inside the ring mapping; the kernel reads only
        // entries between its head and the published tail, and this one is past the
        // tail until `publish`.
        let entry = unsafe { &mut *self.ring.as_ptr().wrapping_add(index) };
        entry.set_addr(addr);
        entry.set_len(BUF_BYTES as u32);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    fn publish(&self) {
        // The ring's tail shares its place with the first entry's reserved field
        // (`struct io_uring_buf_ring`), at byte 14.
        // SAFETY: byte offset 14 of the first entry is 2-byte aligned and inside the
        // mapping; the kernel reads it concurrently, so it is accessed atomically.
        let tail =
            unsafe { &*(self.ring.as_ptr().cast::<u8>().wrapping_add(14).cast::<AtomicU16>()) };
        tail.store(self.tail, Ordering::Release);
    }
}
