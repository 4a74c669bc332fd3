//! The sending half of a connection: requests queued by the queue threads go out in
//! WRITEVs of as many as one message carries, one batch in flight at a time, so that
//! two requests never interleave on the stream; what is queued meanwhile goes in the
//! next one, when the one in flight completes, in whichever ring submitted it.
//!
//! With zero copy a WRITE's data is in the request's own pages, which the kernel
//! registered in the fetching thread's ring and which have no address in the worker:
//! a WRITEV carries the headers up to that WRITE's, then a SEND takes the data from
//! the registered buffer (`IORING_RECVSEND_FIXED_BUF`), then a WRITEV the next headers,
//! and so on: one chain of SQEs linked in stream order (`IOSQE_IO_LINK`), submitted
//! together, so that the batch costs one loop turn and not one per step. A step that
//! sends less than all of its bytes breaks the chain (the kernel cancels the steps
//! after it); once every step's completion is in, the batch goes on from where it
//! stopped. A zero-copy device has one connection per queue thread, so that ring is
//! the only one sending on the connection.

use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};
use ublkd_proto::nbd;

use super::{KEY_SEND, Payload, key, lost};
use crate::target::{TargetWork, own_user_data};

/// The most parts one WRITEV carries (the kernel's limit): a request is one part (its
/// header) or two (and a WRITE's data).
const MAX_PARTS_PER_SEND: usize = libc::UIO_MAXIOV as usize;

/// The most zero-copy WRITEs one batch carries: its chain is at most twice as many
/// SQEs plus one, which every queue ring's submission queue holds at once (at least 16
/// entries, see `StandbyRing`); a chain split over two submissions would not be one.
const MAX_REGISTERED_PER_BATCH: usize = 4;

/// A request waiting to be sent: its header and, for a WRITE, its `len` bytes of data.
#[derive(Debug, Clone, Copy)]
struct Queued {
    header: [u8; nbd::REQUEST_BYTES],
    data: Payload,
    len: u32,
}

/// One step of a batch, in stream order.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// A WRITEV of the parts `start..end` (those of them not yet sent).
    Parts { start: usize, end: usize },
    /// A zero-copy WRITE's data: `sent` of `len` bytes gone.
    Registered { index: u16, sent: u32, len: u32 },
}

/// One batch and everything its SQEs point at, kept (boxed, so it does not move) until
/// it is sent: the headers and the parts (into `headers` and tag buffers), and its
/// steps.
struct SendBatch {
    headers: Vec<[u8; nbd::REQUEST_BYTES]>,
    parts: Vec<libc::iovec>,
    /// The first part not yet sent whole.
    first: usize,
    steps: Vec<Step>,
    /// The first step not yet done.
    step: usize,
    /// SQEs of the chain submitted whose completions are still to come.
    in_flight: usize,
    /// A step of the chain in flight sent less than all of its bytes: the steps after
    /// it complete with ECANCELED, having sent nothing.
    broken: bool,
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
            .field("steps", &self.steps)
            .field("step", &self.step)
            .field("in_flight", &self.in_flight)
            .field("broken", &self.broken)
            .finish()
    }
}

impl SendBatch {
    fn new() -> Box<SendBatch> {
        Box::new(SendBatch {
            headers: Vec::new(),
            parts: Vec::new(),
            first: 0,
            steps: Vec::new(),
            step: 0,
            in_flight: 0,
            broken: false,
        })
    }

    /// The parts of the WRITEV step `start..end` not yet sent.
    fn rest(&self, start: usize, end: usize) -> &[libc::iovec] {
        &self.parts[self.first.max(start)..end]
    }

    /// The current step sent `sent` bytes: whether it is done.
    fn advance(&mut self, mut sent: usize) -> bool {
        match &mut self.steps[self.step] {
            Step::Parts { end, .. } => {
                let end = *end;
                while sent > 0 && self.first < end {
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
                self.first == end
            }
            Step::Registered { sent: done, len, .. } => {
                *done = done.saturating_add(sent as u32).min(*len);
                *done == *len
            }
        }
    }

    /// Pushes the chain of the steps left into `work` (linked, all but the last); how
    /// many SQEs it is.
    fn submit(&mut self, socket: RawFd, connection: usize, work: &mut TargetWork) -> usize {
        let first = work.sqes.len();
        for step in &self.steps[self.step..] {
            let sqe = match *step {
                Step::Parts { start, end } => send_sqe(socket, self.rest(start, end), connection),
                Step::Registered { index, sent, len } => {
                    registered_send_sqe(socket, index, sent, len, connection)
                }
            };
            work.sqes.push(sqe);
        }
        let n = work.sqes.len() - first;
        if let Some((_last, linked)) = work.sqes[first..].split_last_mut() {
            for sqe in linked {
                *sqe = sqe.clone().flags(squeue::Flags::IO_LINK);
            }
        }
        self.in_flight = n;
        self.broken = false;
        n
    }
}

/// The parts `steps` send: up to the end of their last WRITEV.
fn written(steps: &[Step]) -> usize {
    steps
        .iter()
        .rev()
        .find_map(|s| match s {
            Step::Parts { end, .. } => Some(*end),
            Step::Registered { .. } => None,
        })
        .unwrap_or(0)
}

/// A connection's sending half, under the connection's lock.
#[derive(Debug, Default)]
pub(super) struct Sender {
    queued: Vec<Queued>,
    /// The batch in flight, if any.
    sending: Option<Box<SendBatch>>,
    /// The last batch sent, for its allocations.
    spare: Option<Box<SendBatch>>,
    /// Sends submitted (WRITEVs and SENDs; a short one's rest counted again), for
    /// `Target::report`.
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

    /// Sends the next batch, if none is in flight and requests are queued: as many of
    /// them as one WRITEV carries and up to [`MAX_REGISTERED_PER_BATCH`] zero-copy
    /// WRITEs, whose data SENDs take from their registered pages between WRITEVs.
    pub(super) fn next(&mut self, socket: RawFd, connection: usize, work: &mut TargetWork) {
        if self.sending.is_some() || self.queued.is_empty() {
            return;
        }
        let mut batch = self.spare.take().unwrap_or_else(SendBatch::new);
        batch.headers.clear();
        batch.parts.clear();
        batch.steps.clear();
        (batch.first, batch.step) = (0, 0);
        let (mut parts, mut registered) = (0, 0);
        let taken = self
            .queued
            .iter()
            .take_while(|q| {
                let zero_copy = q.len > 0 && matches!(q.data, Payload::Registered(_));
                parts += 1 + usize::from(q.len > 0 && !zero_copy);
                registered += usize::from(zero_copy);
                parts <= MAX_PARTS_PER_SEND && registered <= MAX_REGISTERED_PER_BATCH
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
                    let start = written(&batch.steps);
                    batch.steps.push(Step::Parts { start, end: batch.parts.len() });
                    batch.steps.push(Step::Registered { index, sent: 0, len: q.len });
                }
            }
        }
        let start = written(&batch.steps);
        if start < batch.parts.len() {
            batch.steps.push(Step::Parts { start, end: batch.parts.len() });
        }
        self.requests += taken as u64;
        self.submit(batch, socket, connection, work);
    }

    /// Submits `batch`'s chain; its completion alone wakes the loop only if it submits
    /// the next batch, that is if requests are queued behind it ([`TargetWork::inline`]:
    /// the steps' completions come in while they are submitted, when the socket takes
    /// them at once).
    fn submit(
        &mut self,
        mut batch: Box<SendBatch>,
        socket: RawFd,
        connection: usize,
        work: &mut TargetWork,
    ) {
        let n = batch.submit(socket, connection, work);
        self.sends += n as u64;
        work.inline += n - usize::from(!self.queued.is_empty());
        self.sending = Some(batch);
    }

    /// A step of the batch in flight completed with `res`: once the chain's last
    /// completion is in, the batch's rest (a step sent short), else the next batch.
    pub(super) fn on_sent(
        &mut self,
        res: i32,
        socket: RawFd,
        connection: usize,
        work: &mut TargetWork,
    ) {
        let Some(batch) = self.sending.as_mut() else {
            lost("sending requests", &"a send completed that was never submitted");
        };
        batch.in_flight = batch.in_flight.saturating_sub(1);
        if batch.broken && res == -libc::ECANCELED {
            // A step after a short one: it sent nothing.
        } else if res <= 0 {
            let cause = if res == 0 {
                std::io::Error::from(std::io::ErrorKind::WriteZero)
            } else {
                std::io::Error::from_raw_os_error(-res)
            };
            lost("sending requests", &cause);
        } else {
            if matches!(batch.steps.get(batch.step), Some(Step::Registered { .. })) {
                self.registered_bytes += res as u64;
            }
            if batch.advance(res as usize) {
                batch.step += 1;
            } else {
                batch.broken = true;
            }
        }
        if batch.in_flight > 0 {
            return;
        }
        let Some(batch) = self.sending.take() else { return };
        if batch.step < batch.steps.len() {
            self.submit(batch, socket, connection, work);
            return;
        }
        self.spare = Some(batch);
        self.next(socket, connection, work);
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

/// A SEND of a zero-copy WRITE's data from the request's registered pages at `index`
/// (address 0 is their start), from byte `sent` on, all of it (`MSG_WAITALL`; a short
/// send is still continued).
fn registered_send_sqe(
    socket: RawFd,
    index: u16,
    sent: u32,
    len: u32,
    connection: usize,
) -> squeue::Entry {
    let rest = sent as usize as *const u8;
    opcode::Send::new(types::Fd(socket), rest, len - sent)
        .flags(libc::MSG_WAITALL)
        .ioprio(ublkd_proto::uapi::IORING_RECVSEND_FIXED_BUF)
        .buf_group(index)
        .build()
        .user_data(own_user_data(key(connection, KEY_SEND)))
}

#[cfg(test)]
mod tests {
    use super::super::sqe_fields;
    use super::*;
    use ublkd_proto::uapi::IORING_RECVSEND_FIXED_BUF as FIXED;

    const HEADER: [u8; nbd::REQUEST_BYTES] = [0; nbd::REQUEST_BYTES];

    /// The chain `work` holds, as (opcode, linked to the next, len), and empties it.
    fn chain(work: &mut TargetWork) -> Vec<(u8, bool, u32)> {
        let link = squeue::Flags::IO_LINK.bits();
        let out = work
            .sqes
            .iter()
            .map(|sqe| {
                let f = sqe_fields(sqe);
                (f.opcode, f.flags & link != 0, f.len)
            })
            .collect();
        work.sqes.clear();
        out
    }

    const WRITEV: u8 = opcode::Writev::CODE;
    const SEND: u8 = opcode::Send::CODE;

    #[test]
    fn a_short_send_resumes_inside_the_part_it_stopped_in() {
        let (a, b) = ([0u8; 10], [0u8; 20]);
        let mut sender = Sender::default();
        let mut work = TargetWork::default();
        sender.queue(HEADER, Payload::Memory(a.as_ptr() as usize), 10);
        sender.queue(HEADER, Payload::Memory(b.as_ptr() as usize), 20);
        sender.next(-1, 0, &mut work);
        // One WRITEV of four parts, 28 + 10 + 28 + 20 bytes.
        assert_eq!(chain(&mut work), [(WRITEV, false, 4)]);
        sender.on_sent(28 + 10 + 28 + 4, -1, 0, &mut work);
        assert_eq!(chain(&mut work), [(WRITEV, false, 1)]);
        let batch = sender.sending.as_ref().unwrap();
        let rest = batch.rest(0, batch.parts.len());
        assert_eq!((rest[0].iov_len, rest[0].iov_base), (16, b[4..].as_ptr().cast_mut().cast()));
        sender.on_sent(16, -1, 0, &mut work);
        assert!(work.sqes.is_empty() && sender.sending.is_none());
        assert_eq!((sender.requests, sender.sends), (2, 2));
    }

    #[test]
    fn one_send_carries_at_most_the_kernels_parts_and_the_rest_follows() {
        let mut sender = Sender::default();
        let mut work = TargetWork::default();
        let data = [7u8; 8];
        for _ in 0..MAX_PARTS_PER_SEND {
            sender.queue(HEADER, Payload::Memory(data.as_ptr() as usize), 8);
        }
        sender.next(-1, 0, &mut work);
        // Two parts per WRITE: half of them went.
        assert_eq!(sender.requests, MAX_PARTS_PER_SEND as u64 / 2);
        // The rest wait behind it: its completion must wake the loop.
        assert_eq!((work.sqes.len(), work.inline), (1, 0));
        sender.next(-1, 0, &mut work);
        assert_eq!(work.sqes.len(), 1, "a second batch while one is in flight");
        let all = (MAX_PARTS_PER_SEND / 2) * (nbd::REQUEST_BYTES + 8);
        sender.on_sent(all as i32, -1, 0, &mut work);
        assert_eq!(work.sqes.len(), 2);
        assert_eq!((sender.requests, sender.sends, work.inline), (MAX_PARTS_PER_SEND as u64, 2, 1));
    }

    #[test]
    fn zero_copy_writes_go_in_one_linked_chain_their_data_from_their_registered_pages() {
        let mut sender = Sender::default();
        let mut work = TargetWork::default();
        sender.queue(HEADER, Payload::Memory(0), 0); // a READ
        sender.queue(HEADER, Payload::Registered(5), 4096); // a zero-copy WRITE
        sender.queue(HEADER, Payload::Registered(6), 8192); // another
        sender.queue(HEADER, Payload::Memory(0), 0); // a FLUSH
        sender.next(-1, 0, &mut work);
        let sends: Vec<_> = work.sqes.iter().map(sqe_fields).collect();
        assert_eq!(
            chain(&mut work),
            [
                (WRITEV, true, 2),
                (SEND, true, 4096),
                (WRITEV, true, 1),
                (SEND, true, 8192),
                (WRITEV, false, 1)
            ]
        );
        assert_eq!((sends[1].ioprio, sends[1].buf_index, sends[1].addr), (FIXED, 5, 0));
        assert_eq!((sends[3].ioprio, sends[3].buf_index, sends[3].addr), (FIXED, 6, 0));
        // Nothing queued behind it: every completion comes in as it is submitted.
        assert_eq!(work.inline, 5);
        assert_eq!(sender.requests, 4);
        // The second header's WRITEV goes short: the steps after it are cancelled, and
        // the chain is submitted again from where it stopped once all are in.
        let header = nbd::REQUEST_BYTES as i32;
        sender.on_sent(2 * header, -1, 0, &mut work);
        sender.on_sent(4096, -1, 0, &mut work);
        sender.on_sent(10, -1, 0, &mut work);
        sender.on_sent(-libc::ECANCELED, -1, 0, &mut work);
        assert!(work.sqes.is_empty(), "resubmitted before the chain's last completion");
        sender.on_sent(-libc::ECANCELED, -1, 0, &mut work);
        assert_eq!(chain(&mut work), [(WRITEV, true, 1), (SEND, true, 8192), (WRITEV, false, 1)]);
        assert_eq!(sender.registered_bytes, 4096);
        // The SEND goes short too: its rest, from byte 1000 of the registered pages.
        sender.on_sent(header - 10, -1, 0, &mut work);
        sender.on_sent(1000, -1, 0, &mut work);
        sender.on_sent(-libc::ECANCELED, -1, 0, &mut work);
        let rest: Vec<_> = work.sqes.iter().map(sqe_fields).collect();
        assert_eq!(chain(&mut work), [(SEND, true, 7192), (WRITEV, false, 1)]);
        assert_eq!((rest[0].buf_index, rest[0].addr), (6, 1000));
        sender.on_sent(7192, -1, 0, &mut work);
        sender.on_sent(header, -1, 0, &mut work);
        assert!(work.sqes.is_empty() && sender.sending.is_none());
        assert_eq!(sender.registered_bytes, 4096 + 8192);
    }

    #[test]
    fn a_batch_carries_at_most_its_share_of_zero_copy_writes() {
        let mut sender = Sender::default();
        let mut work = TargetWork::default();
        for i in 0..=MAX_REGISTERED_PER_BATCH as u16 {
            sender.queue(HEADER, Payload::Registered(i), 4096);
        }
        sender.next(-1, 0, &mut work);
        assert_eq!(work.sqes.len(), 2 * MAX_REGISTERED_PER_BATCH);
        assert_eq!(sender.requests, MAX_REGISTERED_PER_BATCH as u64);
        // One waits behind the chain: its last completion must wake the loop.
        assert_eq!(work.inline, 2 * MAX_REGISTERED_PER_BATCH - 1);
    }
}
