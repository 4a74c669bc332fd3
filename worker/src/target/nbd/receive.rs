//! A connection's reading half: one RECV always armed, into the connection's receive
//! buffer; replies parsed from it in whatever order the server sends them, each matched
//! to its request by cookie. A READ's data is copied from there into the tag's buffer,
//! and what has not arrived yet is received straight into the tag's buffer. A reply
//! that no request asked for, or that does not fit its request, breaks the connection
//! ([`lost`]).
//!
//! Zero copy: a READ's pages are registered in the reading ring and have no address in
//! the worker, so its data can never pass through the receive buffer. The connection
//! then takes simple replies only (the supervisor does not ask for structured ones) and
//! each RECV takes exactly what is known to come next: a reply's 16-byte header, then
//! a READ's data straight into its registered pages (`IORING_RECVSEND_FIXED_BUF`).

use std::collections::HashMap;
use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};
use ublkd_proto::nbd::{self, Chunk, ChunkHeader, ReplyKind, SimpleReply};
use ublkd_proto::uapi::{UBLK_IO_OP_READ, UBLK_IO_OP_WRITE};

use super::coverage::Coverage;
use super::{KEY_POST, KEY_RECEIVE, Payload, key, lost};
use crate::target::{Reply, TargetWork, own_user_data};

/// Each connection's receive buffer: most replies are 16-byte headers, taken a ring
/// completion's worth at a time.
pub(super) const RECEIVE_BUFFER_BYTES: usize = 64 << 10;

/// The least of a READ's data, still to come when the receive buffer runs dry, that is
/// received straight into the tag's buffer: less comes with the next replies through
/// the receive buffer, in one RECV rather than two.
const DIRECT_RECEIVE_MIN_BYTES: u32 = 16 << 10;

/// What a RECV takes while every request waiting on the connection is a large READ:
/// a reply's header and no more (a structured reply's chunk header and its data's
/// offset; a simple reply's header and a few bytes of data), so that the data goes
/// straight into the tag's buffer rather than through the receive buffer and a copy.
pub(super) const HEADER_RECEIVE_BYTES: usize = nbd::CHUNK_HEADER_BYTES + 8;

/// What the connection's reader needs to finish a request: where a READ's data goes,
/// whom to tell, and what its reply said so far (a structured reply comes in chunks).
#[derive(Debug, Clone, Copy)]
pub(super) struct Waiting {
    pub(super) op: u8,
    /// The request's offset on the device: a chunk's data lands at its own offset
    /// minus this in the buffer.
    pub(super) offset: u64,
    /// Where a READ's `len` bytes go.
    pub(super) data: Payload,
    pub(super) len: u32,
    pub(super) reply: Reply,
    /// READ: the parts of it the reply's data and holes have covered.
    pub(super) covered: Coverage,
    /// The first error the reply carried, as `-errno` (0: none).
    pub(super) error: i32,
}

impl Waiting {
    /// The request's result once its reply is whole.
    fn result(&self) -> i32 {
        if self.error != 0 {
            self.error
        } else if self.op == UBLK_IO_OP_READ {
            // A structured reply must cover the whole READ, each byte once; one that
            // does not left bytes of the buffer unwritten, or written twice.
            if self.covered.whole(self.len) { self.len as i32 } else { -libc::EIO }
        } else if self.op == UBLK_IO_OP_WRITE {
            self.len as i32
        } else {
            0
        }
    }

    /// Where `len` bytes at device offset `offset` go in the tag's buffer, if they are
    /// inside this READ (and it has a buffer: zero copy takes no structured replies);
    /// they count as covered.
    fn place(&mut self, offset: u64, len: u32) -> Option<usize> {
        let Payload::Memory(buf) = self.data else { return None };
        let start = offset.checked_sub(self.offset)?;
        let end = start.checked_add(u64::from(len))?;
        if self.op != UBLK_IO_OP_READ || end > u64::from(self.len) {
            return None;
        }
        self.covered.add(start as u32, len);
        Some(buf + start as usize)
    }
}

/// Where the reader is in the stream.
#[derive(Debug, Clone, Copy)]
enum Reading {
    /// At a reply's header.
    Header,
    /// In a READ's data: `left` bytes go to `dest`, then request `cookie` is finished
    /// if this was its reply's last part.
    Data { cookie: u64, dest: Dest, left: u32, last: bool },
}

/// Where the rest of a READ's data goes, and how it gets there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dest {
    /// To this address in the tag's buffer, copied out of the receive buffer (what is
    /// there already; once it runs dry a large rest is received `Straight`).
    Copied(usize),
    /// To this address in the tag's buffer, received straight there.
    Straight(usize),
    /// Zero copy: received straight into the request's registered pages (at `index`
    /// of the reading ring's buffer table), `at` bytes in. Never through the receive
    /// buffer: the pages have no address to copy to.
    Registered { index: u16, at: usize },
}

impl Dest {
    /// The same place `n` bytes further on.
    fn advance(self, n: usize) -> Dest {
        match self {
            Dest::Copied(a) => Dest::Copied(a + n),
            Dest::Straight(a) => Dest::Straight(a + n),
            Dest::Registered { index, at } => Dest::Registered { index, at: at + n },
        }
    }
}

/// Hashes a cookie with one multiplication: cookies are the loop's user data for a
/// tag, distinct by construction and not chosen by anyone outside the worker, so
/// SipHash's protection against chosen keys buys nothing here and costs twice per
/// request. (A reply's cookie is the server's, but it is only looked up.)
#[derive(Debug, Default, Clone, Copy)]
struct CookieHasher(u64);

impl std::hash::Hasher for CookieHasher {
    fn finish(&self) -> u64 {
        // The tag in the low bits, the queue in bits 32..48 (see `UserData`): folded
        // together, then spread to the high bits too (the table uses both ends).
        (self.0 ^ (self.0 >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Cookies = HashMap<u64, Waiting, std::hash::BuildHasherDefault<CookieHasher>>;

/// A connection's reading half, under the connection's lock.
#[derive(Debug)]
pub(super) struct Receiver {
    /// Requests sent or queued and not yet answered, by cookie (their
    /// `Reply::user_data`, unique while a request is in flight).
    waiting: Cookies,
    /// The receive buffer: bytes `start..end` received and not yet parsed.
    received: Box<[u8]>,
    start: usize,
    end: usize,
    reading: Reading,
    pub(super) traffic: Traffic,
    /// How many of `waiting` are not large READs ([`received_straight`]).
    small_waiting: usize,
    /// The device uses zero copy: every RECV takes exactly what comes next.
    zero_copy: bool,
}

/// Whether a request's reply data is received straight into its buffer (once the
/// header is parsed): a READ of at least `DIRECT_RECEIVE_MIN_BYTES`.
fn received_straight(w: &Waiting) -> bool {
    w.op == UBLK_IO_OP_READ && w.len >= DIRECT_RECEIVE_MIN_BYTES
}

/// What a connection's reader carried, for [`Target::report`] (the sender counts
/// its own).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Traffic {
    /// RECVs completed.
    pub(super) receives: u64,
    /// READ data copied out of the receive buffer (the rest went straight into the
    /// tags' buffers).
    pub(super) copied_bytes: u64,
    /// Zero copy: READ data received into the requests' registered pages.
    pub(super) registered_bytes: u64,
}

impl Receiver {
    /// The reading half of a new connection; `zero_copy`: the device's.
    pub(super) fn new(zero_copy: bool) -> Self {
        Receiver {
            waiting: Cookies::default(),
            received: vec![0u8; RECEIVE_BUFFER_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            reading: Reading::Header,
            traffic: Traffic::default(),
            small_waiting: 0,
            zero_copy,
        }
    }

    /// Expects a reply to request `cookie`, which `w` describes.
    pub(super) fn expect(&mut self, cookie: u64, w: Waiting) {
        self.small_waiting += usize::from(!received_straight(&w));
        self.waiting.insert(cookie, w);
    }

    /// The RECV that continues the stream: into the receive buffer, or, in a READ's
    /// data, straight into the tag's buffer or the request's registered pages.
    pub(super) fn next_receive(&mut self, socket: RawFd, connection: usize) -> squeue::Entry {
        let fd = types::Fd(socket);
        let sqe = match self.reading {
            Reading::Data { dest: Dest::Straight(addr), left, .. } => {
                opcode::Recv::new(fd, addr as *mut u8, left).flags(libc::MSG_WAITALL).build()
            }
            // With the buffer index, the address is the offset in the registered pages.
            Reading::Data { dest: Dest::Registered { index, at }, left, .. } => {
                opcode::Recv::new(fd, at as *mut u8, left)
                    .flags(libc::MSG_WAITALL)
                    .ioprio(ublkd_proto::uapi::IORING_RECVSEND_FIXED_BUF)
                    .buf_group(index)
                    .build()
            }
            _ => self.receive_into_buffer(fd),
        };
        sqe.user_data(own_user_data(key(connection, KEY_RECEIVE)))
    }

    /// A RECV into the receive buffer (what is left of it moved to its start first).
    fn receive_into_buffer(&mut self, fd: types::Fd) -> squeue::Entry {
        if self.start > 0 {
            self.received.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let room = &mut self.received[self.end..];
        // Only large READs waiting (none at all is not that: the next request, not
        // yet known, may be small): take the next reply's header alone.
        let len = if self.zero_copy {
            // What is left of the next simple reply's header, and not a byte more:
            // a READ's data may follow it.
            nbd::SIMPLE_REPLY_BYTES - self.end
        } else if self.small_waiting == 0 && !self.waiting.is_empty() {
            room.len().min(HEADER_RECEIVE_BYTES)
        } else {
            room.len()
        };
        opcode::Recv::new(fd, room.as_mut_ptr(), len as u32).build()
    }

    /// The RECV in flight received `res` bytes: finishes every request whose reply is
    /// now whole, and arms the next RECV.
    pub(super) fn on_received(
        &mut self,
        res: i32,
        thread: usize,
        work: &mut TargetWork,
        socket: RawFd,
    ) {
        let connection = thread;
        if res <= 0 {
            let cause: &dyn std::fmt::Display = if res == 0 {
                &"the server closed the connection"
            } else {
                &std::io::Error::from_raw_os_error(-res)
            };
            lost("waiting for replies", cause);
        }
        self.traffic.receives += 1;
        match self.reading {
            Reading::Data {
                cookie,
                dest: dest @ (Dest::Straight(_) | Dest::Registered { .. }),
                left,
                last,
            } => {
                if matches!(dest, Dest::Registered { .. }) {
                    self.traffic.registered_bytes += res as u64;
                }
                let (dest, left) = (dest.advance(res as usize), left.saturating_sub(res as u32));
                if left > 0 {
                    self.reading = Reading::Data { cookie, dest, left, last };
                } else {
                    self.reading = Reading::Header;
                    if last {
                        self.finish_request(cookie, thread, work);
                    }
                }
            }
            _ => self.end += res as usize,
        }
        self.parse(thread, work);
        work.sqes.push(self.next_receive(socket, connection));
    }

    /// Finishes request `cookie`, whose reply is whole.
    fn finish_request(&mut self, cookie: u64, thread: usize, work: &mut TargetWork) {
        if let Some(w) = self.waiting.remove(&cookie) {
            self.small_waiting -= usize::from(!received_straight(&w));
            finish(&w, w.result(), thread, thread, work);
        }
    }

    /// The request `cookie` names, which the server cannot answer unless it asked.
    fn waiting_for(&mut self, cookie: u64) -> &mut Waiting {
        match self.waiting.get_mut(&cookie) {
            Some(w) => w,
            None => {
                let what = format!("the server answered cookie {cookie:#x}, which no request has");
                lost("reading a reply", &what)
            }
        }
    }

    /// Takes every whole reply (and every byte of READ data) from the receive buffer.
    fn parse(&mut self, thread: usize, work: &mut TargetWork) {
        loop {
            match self.reading {
                Reading::Data { dest: Dest::Straight(_) | Dest::Registered { .. }, .. } => return,
                Reading::Data { cookie, dest: Dest::Copied(dest), left, last } => {
                    let have = &self.received[self.start..self.end];
                    let n = have.len().min(left as usize);
                    // SAFETY: `dest..dest + left` is inside the request's tag buffer
                    // (`Waiting::place`, whose `len` `IoReq::from_desc` checked against
                    // the buffer), mapped for the process's life; the request is in
                    // flight until it is finished, so nothing else touches the buffer
                    // meanwhile, and `n <= left`.
                    unsafe { std::ptr::copy_nonoverlapping(have.as_ptr(), dest as *mut u8, n) };
                    self.start += n;
                    self.traffic.copied_bytes += n as u64;
                    let (dest, left) = (dest + n, left - n as u32);
                    if left > 0 {
                        // The receive buffer is empty: a large rest goes straight where
                        // it belongs.
                        let dest = if left >= DIRECT_RECEIVE_MIN_BYTES {
                            Dest::Straight(dest)
                        } else {
                            Dest::Copied(dest)
                        };
                        self.reading = Reading::Data { cookie, dest, left, last };
                        return;
                    }
                    self.reading = Reading::Header;
                    if last {
                        self.finish_request(cookie, thread, work);
                    }
                }
                Reading::Header => {
                    if !self.take_reply(thread, work) {
                        return;
                    }
                }
            }
        }
    }

    /// Takes the reply whose header starts the receive buffer, if all of it is there
    /// (a simple reply's header, or a chunk's header and metadata; a READ's data then
    /// follows in `Reading::Data`): whether it was.
    fn take_reply(&mut self, thread: usize, work: &mut TargetWork) -> bool {
        let have = &self.received[self.start..self.end];
        let Some(&magic) = have.first_chunk::<4>() else { return false };
        match ReplyKind::of_magic(magic).unwrap_or_else(|e| lost("reading a reply", &e)) {
            ReplyKind::Simple => {
                let Some(header) = have.first_chunk::<{ nbd::SIMPLE_REPLY_BYTES }>() else {
                    return false;
                };
                let reply =
                    SimpleReply::decode(header).unwrap_or_else(|e| lost("reading a reply", &e));
                self.start += nbd::SIMPLE_REPLY_BYTES;
                self.on_simple_reply(reply, thread, work);
            }
            ReplyKind::Chunk if self.zero_copy => lost(
                "reading a reply",
                &"a structured reply, which a zero-copy device does not ask for",
            ),
            ReplyKind::Chunk => {
                let Some(header) = have.first_chunk::<{ nbd::CHUNK_HEADER_BYTES }>() else {
                    return false;
                };
                let header =
                    ChunkHeader::decode(header).unwrap_or_else(|e| lost("reading a reply", &e));
                let meta = header.meta_bytes().min(nbd::MAX_CHUNK_META_BYTES + 1);
                let whole = nbd::CHUNK_HEADER_BYTES + meta as usize;
                let Some(chunk) = have.get(nbd::CHUNK_HEADER_BYTES..whole) else {
                    // Not all here yet (a bounded amount: it fits the buffer).
                    return false;
                };
                let chunk = header.chunk(chunk).unwrap_or_else(|e| lost("reading a reply", &e));
                self.start += whole;
                self.on_chunk(&header, chunk, thread, work);
            }
        }
        true
    }

    fn on_simple_reply(&mut self, reply: SimpleReply, thread: usize, work: &mut TargetWork) {
        if reply.error == libc::ESHUTDOWN as u32 {
            // The server is going away: the request is re-issued on the next
            // connection rather than failed.
            lost("reading a reply", &"the server is shutting down (ESHUTDOWN)");
        }
        let w = self.waiting_for(reply.cookie);
        if reply.error != 0 {
            w.error = -reply.errno();
        } else if w.op == UBLK_IO_OP_READ {
            w.covered.add(0, w.len);
            if w.len > 0 {
                // Zero copy: nothing of the data is in the receive buffer (each RECV
                // stops at a header's end), and all of it goes to the registered pages.
                let dest = match w.data {
                    Payload::Memory(buf) => Dest::Copied(buf),
                    Payload::Registered(index) => Dest::Registered { index, at: 0 },
                };
                self.reading =
                    Reading::Data { cookie: reply.cookie, dest, left: w.len, last: true };
                return;
            }
        }
        self.finish_request(reply.cookie, thread, work);
    }

    fn on_chunk(&mut self, h: &ChunkHeader, chunk: Chunk, thread: usize, work: &mut TargetWork) {
        let w = self.waiting_for(h.cookie);
        match chunk {
            Chunk::None => {}
            Chunk::Data { offset, len } => {
                let Some(dest) = w.place(offset, len) else {
                    let what = format!("{len} bytes of data at {offset}, outside its request");
                    lost("reading a reply", &what);
                };
                let (cookie, last) = (h.cookie, h.done());
                self.reading = Reading::Data { cookie, dest: Dest::Copied(dest), left: len, last };
                return;
            }
            Chunk::Hole { offset, len } => {
                let Some(dest) = w.place(offset, len) else {
                    let what = format!("a hole of {len} bytes at {offset}, outside its request");
                    lost("reading a reply", &what);
                };
                // SAFETY: `dest..dest + len` is inside the request's tag buffer (see
                // `Waiting::place`), which belongs to the request until it is finished.
                unsafe { std::ptr::write_bytes(dest as *mut u8, 0, len as usize) };
            }
            Chunk::Error { error } => {
                if error == libc::ESHUTDOWN as u32 {
                    lost("reading a reply", &"the server is shutting down (ESHUTDOWN)");
                }
                if w.error == 0 {
                    w.error = -nbd::errno(error);
                }
            }
        }
        if h.done() {
            self.finish_request(h.cookie, thread, work);
        }
    }
}

/// Finishes request `w` with `res`: handed back to this thread's loop if it is this
/// thread's, else posted into its own thread's ring.
fn finish(w: &Waiting, res: i32, thread: usize, connection: usize, work: &mut TargetWork) {
    if usize::from(w.reply.thread) == thread {
        work.done.push((w.reply.user_data, res));
        return;
    }
    let sqe = opcode::MsgRingData::new(types::Fd(w.reply.ring_fd), res, w.reply.user_data, None)
        .build()
        .flags(squeue::Flags::SKIP_SUCCESS)
        .user_data(own_user_data(key(connection, KEY_POST)));
    work.sqes.push(sqe);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(op: u8, len: u32, buf_index: u16, user_data: u64) -> Waiting {
        Waiting {
            op,
            offset: 0,
            data: Payload::Registered(buf_index),
            len,
            reply: Reply { ring_fd: -1, user_data, thread: 0 },
            covered: Coverage::default(),
            error: 0,
        }
    }

    /// `bytes` arrive from the kernel into the RECV in flight (into the receive buffer:
    /// the registered pages are not the test's to write).
    fn arrive(r: &mut Receiver, bytes: &[u8], work: &mut TargetWork) -> super::super::SqeFields {
        if !matches!(r.reading, Reading::Data { dest: Dest::Registered { .. }, .. }) {
            r.received[r.end..r.end + bytes.len()].copy_from_slice(bytes);
        }
        r.on_received(bytes.len() as i32, 0, work, -1);
        super::super::sqe_fields(&work.sqes.pop().unwrap())
    }

    fn simple_reply(cookie: u64) -> Vec<u8> {
        let mut b = nbd::SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        b.extend(0u32.to_be_bytes());
        b.extend(cookie.to_be_bytes());
        b
    }

    #[test]
    fn zero_copy_takes_each_header_alone_and_a_reads_data_into_its_registered_pages() {
        use ublkd_proto::uapi::IORING_RECVSEND_FIXED_BUF as FIXED;
        let mut r = Receiver::new(true);
        let mut work = TargetWork::default();
        r.expect(7, waiting(UBLK_IO_OP_READ, 8192, 3, 7));
        r.expect(9, waiting(UBLK_IO_OP_WRITE, 4096, 4, 9));
        let first = super::super::sqe_fields(&r.next_receive(-1, 0));
        assert_eq!((first.len, first.ioprio), (16, 0), "{first:?}");
        // Part of the READ's reply header: the next RECV takes its rest and no more.
        let reply = simple_reply(7);
        let next = arrive(&mut r, &reply[..10], &mut work);
        assert_eq!((next.len, next.ioprio), (6, 0), "{next:?}");
        // The header whole: the data goes into the READ's registered pages, from 0.
        let next = arrive(&mut r, &reply[10..], &mut work);
        assert_eq!((next.ioprio, next.buf_index, next.addr, next.len), (FIXED, 3, 0, 8192));
        let next = arrive(&mut r, &[0; 5000], &mut work);
        assert_eq!((next.ioprio, next.buf_index, next.addr, next.len), (FIXED, 3, 5000, 3192));
        assert!(work.done.is_empty(), "finished before its data came: {:?}", work.done);
        let next = arrive(&mut r, &[0; 3192], &mut work);
        assert_eq!(work.done, [(7, 8192)]);
        assert_eq!((next.len, next.ioprio), (16, 0), "{next:?}");
        // A WRITE's reply is its header alone.
        let next = arrive(&mut r, &simple_reply(9), &mut work);
        assert_eq!(work.done, [(7, 8192), (9, 4096)]);
        assert_eq!((next.len, next.ioprio), (16, 0), "{next:?}");
        assert_eq!((r.traffic.registered_bytes, r.traffic.copied_bytes), (8192, 0));
    }
}
