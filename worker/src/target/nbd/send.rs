//! The sending half of a connection: requests queued by the queue threads go out in
//! WRITEVs of as many as one message carries, one send in flight at a time, so that
//! two requests never interleave on the stream; what is queued meanwhile goes in the
//! next one, when the one in flight completes, in whichever ring submitted it.
//!
//! With zero copy a WRITE's data is in the request's own pages, which the kernel
//! registered in the fetching thread's ring and which have no address in the worker:
//! the WRITEV carries the headers up to that WRITE's, then a SEND takes the data from
//! the registered buffer (`IORING_RECVSEND_FIXED_BUF`), and only then does the next
//! batch go. A zero-copy device has one connection per queue thread, so that ring is
//! the only one sending on the connection.

use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};
use ublkd_proto::nbd;

use super::{KEY_SEND, key, lost};
#[cfg(doc)]
use crate::target::TargetWork;
use crate::target::own_user_data;

/// The most parts one WRITEV carries (the kernel's limit): a request is one part (its
/// header) or two (and a WRITE's data).
const MAX_PARTS_PER_SEND: usize = libc::UIO_MAXIOV as usize;

/// Where a WRITE's data is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Payload {
    /// In the tag's buffer, at this address.
    Memory(usize),
    /// Zero copy: the request's pages, at this index of the sending ring's buffer table.
    Registered(u16),
}

/// A request waiting to be sent: its header and, for a WRITE, its `len` bytes of data.
#[derive(Debug, Clone, Copy)]
struct Queued {
    header: [u8; nbd::REQUEST_BYTES],
    data: Payload,
    len: u32,
}

/// A zero-copy WRITE's data, sent after the batch's WRITEV: `sent` of `len` bytes gone.
#[derive(Debug, Clone, Copy)]
struct RegisteredPart {
    index: u16,
    sent: u32,
    len: u32,
}

/// One WRITEV and everything it points at, kept (boxed, so it does not move) until it
/// completes: the headers and the parts (into `headers` and tag buffers).
struct SendBatch {
    headers: Vec<[u8; nbd::REQUEST_BYTES]>,
    parts: Vec<libc::iovec>,
    /// The first part not yet sent whole.
    first: usize,
    /// Zero copy: the last request's data, after the parts.
    registered: Option<RegisteredPart>,
}

// SAFETY: the raw pointers are into the batch's own heap (`headers`, `parts`) and into
// tag buffers (mapped for the process's life); a batch is touched only under its
// connection's lock, by one thread at a time.
unsafe impl Send for SendBatch {}

impl std::fmt::Debug for SendBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendBatch")
            .field("requests", &self.headers.len())
            .field("parts", &self.parts.len())
            .field("first", &self.first)
            .field("registered", &self.registered)
            .finish()
    }
}

impl SendBatch {
    fn new() -> Box<SendBatch> {
        Box::new(SendBatch { headers: Vec::new(), parts: Vec::new(), first: 0, registered: None })
    }

    /// The parts not yet sent.
    fn rest(&self) -> &[libc::iovec] {
        &self.parts[self.first..]
    }

    /// `sent` more bytes went out (of the parts while any are left, else of the
    /// registered data): whether any are left.
    fn advance(&mut self, mut sent: usize) -> bool {
        if self.first == self.parts.len()
            && let Some(part) = self.registered.as_mut()
        {
            part.sent = part.sent.saturating_add(sent as u32).min(part.len);
            return part.sent < part.len;
        }
        while sent > 0 && self.first < self.parts.len() {
            let part = &mut self.parts[self.first];
            if sent >= part.iov_len {
                sent -= part.iov_len;
                self.first += 1;
            } else {
                part.iov_base = part.iov_base.wrapping_byte_add(sent);
                part.iov_len -= sent;
                sent = 0;
            }
        }
        self.first < self.parts.len() || self.registered.is_some_and(|r| r.sent < r.len)
    }

    /// The send that continues the batch: a WRITEV of the parts left, else the SEND of
    /// the registered data.
    fn sqe(&self, socket: RawFd, connection: usize) -> squeue::Entry {
        match self.registered {
            Some(part) if self.first == self.parts.len() => {
                registered_send_sqe(socket, part, connection)
            }
            _ => send_sqe(socket, self.rest(), connection),
        }
    }
}

/// A connection's sending half, under the connection's lock.
#[derive(Debug, Default)]
pub(super) struct Sender {
    queued: Vec<Queued>,
    /// The WRITEV in flight, if any.
    sending: Option<Box<SendBatch>>,
    /// The last batch sent, for its allocations.
    spare: Option<Box<SendBatch>>,
    /// WRITEVs submitted (a short one's rest counted again), for `Target::report`.
    pub(super) sends: u64,
    /// Requests sent (each answered by one reply).
    pub(super) requests: u64,
    /// Zero copy: WRITE data sent from the requests' registered pages.
    pub(super) registered_bytes: u64,
}

impl Sender {
    /// Queues a request: its `header`, then (a WRITE) `len` bytes of `data`, which
    /// stay untouched until the request is finished.
    pub(super) fn queue(&mut self, header: [u8; nbd::REQUEST_BYTES], data: Payload, len: u32) {
        self.queued.push(Queued { header, data, len });
    }

    /// The next send, if none is in flight and requests are queued: a WRITEV of as
    /// many of them as one message carries, up to and including the first zero-copy
    /// WRITE, whose data a SEND then takes from its registered buffer.
    pub(super) fn next(&mut self, socket: RawFd, connection: usize) -> Option<squeue::Entry> {
        if self.sending.is_some() || self.queued.is_empty() {
            return None;
        }
        let mut batch = self.spare.take().unwrap_or_else(SendBatch::new);
        batch.headers.clear();
        batch.parts.clear();
        batch.first = 0;
        batch.registered = None;
        let (mut parts, mut registered) = (0, false);
        let taken = self
            .queued
            .iter()
            .take_while(|q| {
                let memory = q.len > 0 && matches!(q.data, Payload::Memory(_));
                parts += 1 + usize::from(memory);
                let fits = parts <= MAX_PARTS_PER_SEND && !registered;
                registered |= q.len > 0 && matches!(q.data, Payload::Registered(_));
                fits
            })
            .count();
        // The headers first, all of them: the parts point into this vector, which must
        // not grow once they do.
        batch.headers.extend(self.queued[..taken].iter().map(|q| q.header));
        for (i, q) in self.queued.drain(..taken).enumerate() {
            let header = &batch.headers[i];
            let base = header.as_ptr().cast_mut().cast();
            batch.parts.push(libc::iovec { iov_base: base, iov_len: header.len() });
            match q.data {
                _ if q.len == 0 => {}
                Payload::Memory(data) => {
                    let base = data as *mut libc::c_void;
                    batch.parts.push(libc::iovec { iov_base: base, iov_len: q.len as usize });
                }
                Payload::Registered(index) => {
                    batch.registered = Some(RegisteredPart { index, sent: 0, len: q.len });
                }
            }
        }
        let sqe = batch.sqe(socket, connection);
        self.sending = Some(batch);
        self.sends += 1;
        self.requests += taken as u64;
        Some(sqe)
    }

    /// Whether the send in flight, once it completes, leaves nothing to send: then its
    /// completion need not wake the loop by itself ([`TargetWork::inline`]). Not so for
    /// a WRITEV that a zero-copy WRITE's data follows, nor for a send that requests
    /// queued behind it follow: their completions submit the next send (counted in,
    /// each would hold that send back until some other completion ended the wait).
    pub(super) fn ends_alone(&self) -> bool {
        let last = self
            .sending
            .as_ref()
            .is_some_and(|b| b.registered.is_none() || b.first == b.parts.len());
        last && self.queued.is_empty()
    }

    /// The WRITEV in flight sent `res` bytes: the rest of it, else the next one.
    pub(super) fn on_sent(
        &mut self,
        res: i32,
        socket: RawFd,
        connection: usize,
    ) -> Option<squeue::Entry> {
        if res <= 0 {
            let cause = if res == 0 {
                std::io::Error::from(std::io::ErrorKind::WriteZero)
            } else {
                std::io::Error::from_raw_os_error(-res)
            };
            lost("sending requests", &cause);
        }
        let Some(batch) = self.sending.as_mut() else {
            lost("sending requests", &"a send completed that was never submitted");
        };
        if batch.first == batch.parts.len() && batch.registered.is_some() {
            self.registered_bytes += res as u64;
        }
        if batch.advance(res as usize) {
            self.sends += 1;
            return Some(batch.sqe(socket, connection));
        }
        self.spare = self.sending.take();
        self.next(socket, connection)
    }
}

/// A WRITEV of `parts` on the socket, not a SENDMSG: a write carries no control
/// message, so the ring cannot pass a descriptor to the server (`SCM_RIGHTS` over
/// `nbd+unix`), and the sandbox allows the ring no SENDMSG at all. A short write is
/// continued by [`Sender::on_sent`]; a broken connection is EPIPE, not a signal
/// (Rust's runtime ignores SIGPIPE).
fn send_sqe(socket: RawFd, parts: &[libc::iovec], connection: usize) -> squeue::Entry {
    opcode::Writev::new(types::Fd(socket), parts.as_ptr(), parts.len() as u32)
        .build()
        .user_data(own_user_data(key(connection, KEY_SEND)))
}

/// A SEND of a zero-copy WRITE's data from the request's registered pages (address 0
/// is their start), all of it (`MSG_WAITALL`; a short send is still continued).
fn registered_send_sqe(socket: RawFd, part: RegisteredPart, connection: usize) -> squeue::Entry {
    let rest = part.sent as usize as *const u8;
    opcode::Send::new(types::Fd(socket), rest, part.len - part.sent)
        .flags(libc::MSG_WAITALL)
        .ioprio(super::IORING_RECVSEND_FIXED_BUF)
        .buf_group(part.index)
        .build()
        .user_data(own_user_data(key(connection, KEY_SEND)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(bytes: &mut [u8]) -> libc::iovec {
        libc::iovec { iov_base: bytes.as_mut_ptr().cast(), iov_len: bytes.len() }
    }

    #[test]
    fn a_short_send_resumes_inside_the_part_it_stopped_in() {
        let (mut a, mut b) = ([0u8; 10], [0u8; 20]);
        let mut batch = SendBatch::new();
        batch.parts.extend([iov(&mut a), iov(&mut b)]);
        assert!(batch.advance(14));
        assert_eq!(batch.rest().len(), 1);
        assert_eq!(batch.rest()[0].iov_len, 16);
        assert_eq!(batch.rest()[0].iov_base, b[4..].as_ptr().cast_mut().cast());
        assert!(!batch.advance(16));
        assert!(batch.rest().is_empty());
    }

    #[test]
    fn a_zero_copy_write_ends_its_batch_and_its_data_follows_from_its_registered_pages() {
        let mut sender = Sender::default();
        let memory = [7u8; 8];
        let header = [0; nbd::REQUEST_BYTES];
        sender.queue(header, Payload::Memory(0), 0); // a READ
        sender.queue(header, Payload::Registered(5), 4096); // a zero-copy WRITE
        sender.queue(header, Payload::Memory(memory.as_ptr() as usize), 8);
        let first = sender.next(-1, 0).unwrap();
        assert_eq!(first.get_opcode(), u32::from(opcode::Writev::CODE));
        // The READ's and the WRITE's headers, not the third request.
        assert_eq!(sender.requests, 2);
        // Its completion sends the data: it must wake the loop.
        assert!(!sender.ends_alone());
        let data = sender.on_sent(2 * nbd::REQUEST_BYTES as i32, -1, 0).unwrap();
        assert_eq!(data.get_opcode(), u32::from(opcode::Send::CODE));
        let f = super::super::sqe_fields(&data);
        assert_eq!(
            (f.ioprio, f.buf_index, f.addr, f.len),
            (super::super::IORING_RECVSEND_FIXED_BUF, 5, 0, 4096)
        );
        // A short send: the rest of the data, still from the registered pages.
        let rest = super::super::sqe_fields(&sender.on_sent(1000, -1, 0).unwrap());
        assert_eq!(
            (rest.opcode, rest.buf_index, rest.addr, rest.len),
            (opcode::Send::CODE, 5, 1000, 3096)
        );
        assert_eq!(sender.registered_bytes, 1000);
        // The third request waits behind it.
        assert!(!sender.ends_alone());
        // Then, only once the data is all out, the next request.
        let next = sender.on_sent(3096, -1, 0).unwrap();
        assert_eq!(next.get_opcode(), u32::from(opcode::Writev::CODE));
        assert_eq!((sender.requests, sender.registered_bytes), (3, 4096));
        assert!(sender.ends_alone(), "nothing follows the last send");
    }

    #[test]
    fn one_send_carries_at_most_the_kernels_parts_and_the_rest_follows() {
        let mut sender = Sender::default();
        let data = [7u8; 8];
        for _ in 0..MAX_PARTS_PER_SEND {
            sender.queue([0; nbd::REQUEST_BYTES], Payload::Memory(data.as_ptr() as usize), 8);
        }
        assert!(sender.next(-1, 0).is_some());
        // Two parts per WRITE: half of them went.
        assert_eq!(sender.requests, MAX_PARTS_PER_SEND as u64 / 2);
        assert!(sender.next(-1, 0).is_none(), "a second WRITEV while one is in flight");
        let all = (MAX_PARTS_PER_SEND / 2) * (nbd::REQUEST_BYTES + 8);
        assert!(sender.on_sent(all as i32, -1, 0).is_some());
        assert_eq!((sender.requests, sender.sends), (MAX_PARTS_PER_SEND as u64, 2));
    }
}
