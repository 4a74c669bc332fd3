//! `nbd`: an export of an NBD server, over the sockets the supervisor connected and
//! negotiated (structured replies where the server took them, else simple ones) and
//! hands over with the device at activation.
//!
//! Everything goes through the queue threads' own rings; the worker makes no system
//! call per request beyond them. Queue thread `i` sends on connection `i % n` (several
//! only where the export allows it: the supervisor decides), and thread `c` reads
//! connection `c`:
//! - **Sending** ([`send`]). A request's header (and a WRITE's data, straight from the tag's
//!   buffer) is queued on its connection, and the turn's requests go in one WRITEV
//!   before the thread waits (with zero copy, a chain of WRITEVs and SENDs linked in
//!   order). At most one batch is in flight per connection, so that two requests never
//!   interleave on the stream; requests queued meanwhile go together in the next one,
//!   when it completes, in whichever ring submitted it.
//! - **Receiving** ([`receive`]). One RECV per connection is always armed, into the
//!   connection's buffer; replies are parsed from it in whatever order the server sends
//!   them. A READ's data is copied from there into the tag's buffer, and what has not
//!   arrived yet is received straight into the tag's buffer.
//! - **Finishing.** A request of the reading thread is handed back to its loop
//!   ([`TargetWork::done`]); one of another thread (a connection shared by several) is
//!   posted into that thread's ring with `IORING_OP_MSG_RING`, as its completion.
//!
//! - **Zero copy** (`UBLK_F_AUTO_BUF_REG`, asked for per device). A request's pages are
//!   registered by the kernel in the ring of the thread that fetched it, so that
//!   thread must send a WRITE's data and receive a READ's: a zero-copy device has one
//!   connection per queue thread (the supervisor makes it so, [`NbdTarget::new`]
//!   checks), the data moves by SEND and RECV on the registered pages, and the reader
//!   takes each reply's header alone so that no data lands in the receive buffer.
//!
//! A connection that breaks (the server closed it, or answered what no request asked)
//! ends the worker with [`WorkerExit::BackendLost`]: the supervisor connects afresh for
//! the next worker and the kernel re-issues the requests that were in flight, so no
//! request fails for it.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

use ublkd_proto::exit::WorkerExit;
use ublkd_proto::msg::MAX_NBD_CONNECTIONS;
use ublkd_proto::nbd::{self, Request};
use ublkd_proto::uapi::{
    UBLK_IO_F_FUA, UBLK_IO_F_NOUNMAP, UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ,
    UBLK_IO_OP_WRITE, UBLK_IO_OP_WRITE_ZEROES,
};

use super::{IoReq, Step, Target, TargetError, TargetWork};

mod coverage;
mod receive;
mod send;

use coverage::Coverage;
use receive::{Receiver, Waiting};
use send::Sender;

/// Where a request's data is: a WRITE's to send, a READ's to receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Payload {
    /// In the tag's buffer, at this address: the buffer belongs to the request until its
    /// result is committed, which finishing it makes happen.
    Memory(usize),
    /// Zero copy: the request's pages, at this index of the buffer table of the ring
    /// that fetched it (the one ring that sends and receives for it).
    Registered(u16),
}

/// What a connection's own SQE is, in the low bits of its key (the connection's number
/// above them).
const KEY_SEND: u32 = 1;
const KEY_RECEIVE: u32 = 2;
const KEY_POST: u32 = 3;

fn key(connection: usize, what: u32) -> u32 {
    ((connection as u32) << 8) | what
}

/// A connection's state, under its lock: its two halves.
#[derive(Debug)]
struct ConnectionState {
    sender: Sender,
    receiver: Receiver,
}

/// One connection to the server.
#[derive(Debug)]
struct Connection {
    /// From activation on.
    socket: OnceLock<OwnedFd>,
    state: Mutex<ConnectionState>,
}

#[derive(Debug)]
pub struct NbdTarget {
    connections: Vec<Connection>,
}

impl NbdTarget {
    /// A target over `connections` connections, whose sockets come at activation
    /// ([`Target::activate`]), for a device served by `threads` queue threads, with
    /// `zero_copy` or not.
    pub fn new(connections: u8, zero_copy: bool, threads: usize) -> Result<Self, TargetError> {
        if connections == 0 || connections > MAX_NBD_CONNECTIONS {
            return Err(TargetError::Fds {
                target: "nbd",
                want: usize::from(MAX_NBD_CONNECTIONS),
                got: usize::from(connections),
            });
        }
        if zero_copy && usize::from(connections) != threads {
            return Err(TargetError::NbdZeroCopyConnections { connections, threads });
        }
        let connection = |_| Connection {
            socket: OnceLock::new(),
            state: Mutex::new(ConnectionState {
                sender: Sender::default(),
                receiver: Receiver::new(zero_copy),
            }),
        };
        Ok(NbdTarget { connections: (0..connections).map(connection).collect() })
    }
}

/// The connection is gone or cannot be trusted: end the worker so that the supervisor
/// recovers the device over a new one. The requests in flight are re-issued by the
/// kernel to the next worker, not failed.
fn lost(what: &str, cause: &dyn std::fmt::Display) -> ! {
    tracing::error!(
        event = "nbd_connection_lost",
        "the NBD connection broke while {what}: {cause}; ending so that a fresh worker \
         serves the device over a new connection (requests in flight are re-issued)"
    );
    crate::sys::exit_now(i32::from(WorkerExit::BackendLost.code()))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl NbdTarget {
    fn socket(&self, connection: usize) -> Option<RawFd> {
        self.connections.get(connection)?.socket.get().map(AsRawFd::as_raw_fd)
    }
}

impl Target for NbdTarget {
    fn start(&self, req: &IoReq) -> Step {
        let index = usize::from(req.reply.thread) % self.connections.len();
        if self.socket(index).is_none() {
            return Step::Done(-libc::EIO);
        }
        let nounmap = req.flags & UBLK_IO_F_NOUNMAP != 0;
        let (kind, flags, length) = match req.op {
            UBLK_IO_OP_READ => (nbd::CMD_READ, 0, req.len),
            UBLK_IO_OP_WRITE if req.flags & UBLK_IO_F_FUA != 0 => {
                (nbd::CMD_WRITE, nbd::CMD_FLAG_FUA, req.len)
            }
            UBLK_IO_OP_WRITE => (nbd::CMD_WRITE, 0, req.len),
            UBLK_IO_OP_FLUSH => (nbd::CMD_FLUSH, 0, 0),
            UBLK_IO_OP_DISCARD => (nbd::CMD_TRIM, 0, req.len),
            UBLK_IO_OP_WRITE_ZEROES if nounmap => {
                (nbd::CMD_WRITE_ZEROES, nbd::CMD_FLAG_NO_HOLE, req.len)
            }
            UBLK_IO_OP_WRITE_ZEROES => (nbd::CMD_WRITE_ZEROES, 0, req.len),
            _ => return Step::Done(-libc::EOPNOTSUPP),
        };
        let moves_data = matches!(req.op, UBLK_IO_OP_READ | UBLK_IO_OP_WRITE);
        let payload = match req.buf_index {
            // Only this thread's ring has the pages, and it reads and sends on its own
            // connection alone (`new` checked that there is one per thread).
            Some(buf_index) if usize::from(req.reply.thread) == index => {
                Payload::Registered(buf_index)
            }
            // A thread without its own connection: `new` refuses such a device.
            Some(_) => return Step::Done(-libc::EIO),
            None if moves_data && req.buf.is_null() => return Step::Done(-libc::EIO),
            None => Payload::Memory(req.buf as usize),
        };
        let offset = if req.op == UBLK_IO_OP_FLUSH { 0 } else { req.offset };
        let cookie = req.reply.user_data;
        let header = Request { flags, kind, cookie, offset, length }.encode();
        let waiting = Waiting {
            op: req.op,
            offset: req.offset,
            data: payload,
            len: req.len,
            reply: req.reply,
            covered: Coverage::default(),
            error: 0,
        };
        let data_len = if req.op == UBLK_IO_OP_WRITE { req.len } else { 0 };
        let mut state = lock(&self.connections[index].state);
        state.receiver.expect(cookie, waiting);
        // Sent with the rest of the turn's requests, before the thread waits.
        state.sender.queue(header, payload, data_len);
        Step::Pending
    }

    fn before_wait(&self, thread: usize, work: &mut TargetWork) {
        let index = thread % self.connections.len();
        if let Some(socket) = self.socket(index) {
            lock(&self.connections[index].state).sender.next(socket, index, work);
        }
    }

    fn on_cqe(&self, _req: &IoReq, res: i32, _done: &mut u32) -> Step {
        // The request's result, from its connection's reader.
        Step::Done(res)
    }

    fn report(&self) {
        for (connection, c) in self.connections.iter().enumerate() {
            let state = lock(&c.state);
            let (t, requests, sends) =
                (state.receiver.traffic, state.sender.requests, state.sender.sends);
            let sent_registered = state.sender.registered_bytes;
            drop(state);
            let per = |n: u64| requests as f64 / n.max(1) as f64;
            tracing::info!(
                connection,
                requests,
                sends,
                receives = t.receives,
                copied_bytes = t.copied_bytes,
                "nbd connection {connection}: {} requests in {} sends and {} receives \
                 ({:.2} requests per send, {:.2} replies per receive), {} KiB of READ data \
                 copied from the receive buffer; zero copy: {} KiB of READ data received \
                 into and {} KiB of WRITE data sent from the requests' registered pages",
                requests,
                sends,
                t.receives,
                per(sends),
                per(t.receives),
                t.copied_bytes >> 10,
                t.registered_bytes >> 10,
                sent_registered >> 10,
            );
        }
    }

    fn arm(&self, thread: usize, work: &mut TargetWork) {
        if let Some(socket) = self.socket(thread) {
            let sqe = lock(&self.connections[thread].state).receiver.next_receive(socket, thread);
            work.sqes.push(sqe);
        }
    }

    fn on_own_cqe(&self, thread: usize, key: u32, res: i32, work: &mut TargetWork) {
        let connection = (key >> 8) as usize;
        let Some(socket) = self.socket(connection) else {
            lost("serving requests", &format!("a completion names connection {connection}"));
        };
        let mut state = lock(&self.connections[connection].state);
        match key & 0xff {
            KEY_SEND => {
                state.sender.on_sent(res, socket, connection, work);
            }
            KEY_RECEIVE if connection == thread => {
                state.receiver.on_received(res, thread, work, socket)
            }
            // Posted only on failure (IOSQE_CQE_SKIP_SUCCESS).
            KEY_POST => {
                let cause = std::io::Error::from_raw_os_error(res.saturating_neg());
                lost("posting a reply's result to another queue thread", &cause);
            }
            _ => lost("serving requests", &format!("a completion with the unknown key {key:#x}")),
        }
    }

    fn fixed_file(&self, _thread: usize) -> Option<BorrowedFd<'_>> {
        None
    }

    fn activate(&self, fds: Vec<OwnedFd>, _fence: &[String]) -> Result<(), TargetError> {
        if fds.len() != self.connections.len() {
            let (want, got) = (self.connections.len(), fds.len());
            return Err(TargetError::Fds { target: "nbd", want, got });
        }
        for (fd, connection) in fds.into_iter().zip(&self.connections) {
            if connection.socket.set(fd).is_err() {
                return Err(TargetError::Io(std::io::Error::other(
                    "the nbd target was activated twice",
                )));
            }
        }
        Ok(())
    }
}

/// The fields of an SQE the tests check and the io-uring crate does not read back.
#[cfg(test)]
#[derive(Debug)]
struct SqeFields {
    opcode: u8,
    flags: u8,
    ioprio: u16,
    addr: u64,
    len: u32,
    buf_index: u16,
}

#[cfg(test)]
fn sqe_fields(sqe: &io_uring::squeue::Entry) -> SqeFields {
    const _: () = assert!(size_of::<io_uring::squeue::Entry>() == 64);
    // SAFETY: `squeue::Entry` is `#[repr(C)]` over the kernel's 64-byte `io_uring_sqe`
    // (asserted above), plain integers with no invalid values.
    let b: [u8; 64] = unsafe { std::mem::transmute_copy(sqe) };
    let u16_at = |at: usize| u16::from_ne_bytes([b[at], b[at + 1]]);
    let u32_at = |at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().unwrap());
    // `struct io_uring_sqe`'s offsets (include/uapi/linux/io_uring.h).
    SqeFields {
        opcode: b[0],
        flags: b[1],
        ioprio: u16_at(2),
        addr: u64_at(16),
        len: u32_at(24),
        buf_index: u16_at(40),
    }
}

/// A test's turn of the ring that stands in for a queue thread's: submits what is
/// queued, waits up to `wait_ns` for a completion (none coming is no error: ETIME),
/// and takes every completion there is, as (user_data, result). For the target tests'
/// stand-in loops; the rbd host tests' `Loop::finished` does the same.
#[cfg(test)]
pub(super) fn submit_and_reap(ring: &mut io_uring::IoUring, wait_ns: u32) -> Vec<(u64, i32)> {
    let timeout = io_uring::types::Timespec::new().nsec(wait_ns);
    let args = io_uring::types::SubmitArgs::new().timespec(&timeout);
    if let Err(e) = ring.submitter().submit_with_args(1, &args) {
        assert_eq!(e.raw_os_error(), Some(libc::ETIME), "{e}");
    }
    ring.completion().map(|c| (c.user_data(), c.result())).collect()
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use io_uring::{IoUring, squeue};

    use super::receive::{HEADER_RECEIVE_BYTES, RECEIVE_BUFFER_BYTES};
    use super::*;
    use crate::queue::user_data::UserData;
    use crate::target::Reply;

    /// Stands in for a queue thread's loop: its ring, submitting what the target asks
    /// and handing it its own completions.
    struct Loop {
        ring: IoUring,
        thread: usize,
        work: TargetWork,
    }

    impl Loop {
        fn new(thread: usize) -> Loop {
            Loop { ring: IoUring::new(64).unwrap(), thread, work: TargetWork::default() }
        }

        fn req(&self, op: u8, flags: u32, buf: &mut [u8], user_data: u64) -> IoReq {
            IoReq {
                op,
                flags,
                offset: 8192,
                len: buf.len() as u32,
                buf: buf.as_mut_ptr(),
                buf_index: None,
                reply: Reply {
                    ring_fd: self.ring.as_raw_fd(),
                    user_data,
                    thread: self.thread as u16,
                },
            }
        }

        fn push(&mut self, sqe: &squeue::Entry) {
            // SAFETY: the target's SQEs point into its connections and the tests' buffers,
            // which outlive the test's rings.
            unsafe { self.ring.submission().push(sqe) }.unwrap();
        }

        fn start(&mut self, target: &NbdTarget, req: &IoReq) {
            match target.start(req) {
                Step::Pending => {}
                other => panic!("start: {other:?}"),
            }
        }

        fn arm(&mut self, target: &NbdTarget) {
            target.arm(self.thread, &mut self.work);
            for sqe in std::mem::take(&mut self.work.sqes) {
                self.push(&sqe);
            }
        }

        /// One turn: submits, waits up to `ms` for a completion, handles every one.
        /// The requests finished, as (user_data, res), and whether anything completed.
        fn turn(&mut self, target: &NbdTarget, ms: u32) -> (Vec<(u64, i32)>, bool) {
            target.before_wait(self.thread, &mut self.work);
            for sqe in std::mem::take(&mut self.work.sqes) {
                self.push(&sqe);
            }
            let cqes = submit_and_reap(&mut self.ring, ms * 1_000_000);
            let mut finished = Vec::new();
            for &(ud, res) in &cqes {
                if let Some(UserData::TargetOwn { key }) = UserData::decode(ud) {
                    target.on_own_cqe(self.thread, key, res, &mut self.work);
                    for sqe in std::mem::take(&mut self.work.sqes) {
                        self.push(&sqe);
                    }
                    finished.append(&mut self.work.done);
                } else {
                    // Posted by another thread's reader.
                    finished.push((ud, res));
                }
            }
            (finished, !cqes.is_empty())
        }

        /// Turns until nothing more completes: the requests finished meanwhile.
        fn settle(&mut self, target: &NbdTarget) -> Vec<(u64, i32)> {
            let mut all = Vec::new();
            loop {
                let (mut finished, any) = self.turn(target, 100);
                all.append(&mut finished);
                if !any {
                    return all;
                }
            }
        }

        /// Turns until `n` requests finished.
        fn finished(&mut self, target: &NbdTarget, n: usize) -> Vec<(u64, i32)> {
            let mut all = Vec::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while std::time::Instant::now() < deadline {
                all.append(&mut self.turn(target, 100).0);
                if all.len() >= n {
                    return all;
                }
            }
            panic!("only {} of {n} requests finished: {all:?}", all.len());
        }
    }

    /// A target over `n` connections, the test playing the server on their other ends.
    fn target_over(n: u8) -> (NbdTarget, Vec<UnixStream>) {
        let (ours, servers): (Vec<_>, Vec<_>) = (0..n).map(|_| UnixStream::pair().unwrap()).unzip();
        let target = NbdTarget::new(n, false, usize::from(n)).unwrap();
        target.activate(ours.into_iter().map(OwnedFd::from).collect(), &[]).unwrap();
        (target, servers)
    }

    /// A target over one connection, its server's end, and thread 0's loop, armed.
    fn one_connection() -> (NbdTarget, UnixStream, Loop) {
        let (target, mut servers) = target_over(1);
        let mut lp = Loop::new(0);
        lp.arm(&target);
        (target, servers.remove(0), lp)
    }

    fn request(server: &mut UnixStream) -> [u8; nbd::REQUEST_BYTES] {
        let mut header = [0u8; nbd::REQUEST_BYTES];
        server.read_exact(&mut header).unwrap();
        header
    }

    fn cookie(h: &[u8; nbd::REQUEST_BYTES]) -> u64 {
        u64::from_be_bytes(h[8..16].try_into().unwrap())
    }

    fn reply_bytes(error: u32, cookie: &[u8], data: &[u8]) -> Vec<u8> {
        let mut b = nbd::SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&error.to_be_bytes());
        b.extend_from_slice(cookie);
        b.extend_from_slice(data);
        b
    }

    #[test]
    fn replies_in_any_order_reach_their_requests_with_their_data() {
        let (target, mut server, mut lp) = one_connection();
        let mut read_buf = vec![0u8; 4096];
        let mut write_buf = vec![7u8; 1024];
        let read = lp.req(UBLK_IO_OP_READ, 0, &mut read_buf, 11);
        let write = lp.req(UBLK_IO_OP_WRITE, UBLK_IO_F_FUA, &mut write_buf, 22);
        lp.start(&target, &read);
        lp.start(&target, &write);
        assert!(lp.settle(&target).is_empty());

        let r = request(&mut server);
        assert_eq!(r[..4], nbd::REQUEST_MAGIC.to_be_bytes());
        assert_eq!(r[6..8], nbd::CMD_READ.to_be_bytes());
        assert_eq!(r[16..24], 8192u64.to_be_bytes());
        assert_eq!(r[24..28], 4096u32.to_be_bytes());
        let w = request(&mut server);
        assert_eq!(w[4..6], nbd::CMD_FLAG_FUA.to_be_bytes());
        assert_eq!(w[6..8], nbd::CMD_WRITE.to_be_bytes());
        let mut data = vec![0u8; 1024];
        server.read_exact(&mut data).unwrap();
        assert!(data.iter().all(|&b| b == 7), "the WRITE's data follows its header");

        // The write is answered first, with an error; then the read, with its data, in
        // two pieces with a pause between: the header and part of the data, the rest.
        server.write_all(&reply_bytes(libc::ENOSPC as u32, &w[8..16], &[])).unwrap();
        assert_eq!(lp.finished(&target, 1), [(22, -libc::ENOSPC)]);
        let whole = reply_bytes(0, &r[8..16], &[9u8; 4096]);
        server.write_all(&whole[..1000]).unwrap();
        assert!(lp.settle(&target).is_empty(), "a READ finishes only with all its data");
        server.write_all(&whole[1000..]).unwrap();
        assert_eq!(lp.finished(&target, 1), [(11, 4096)]);
        assert!(read_buf.iter().all(|&b| b == 9), "the READ's data is in its buffer");
        // A closed connection ends the process (as it must in a worker): keep it open.
        std::mem::forget(server);
    }

    fn chunk_bytes(flags: u16, kind: u16, cookie: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut b = nbd::STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(cookie);
        b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        b.extend_from_slice(payload);
        b
    }

    fn at(offset: u64, rest: &[u8]) -> Vec<u8> {
        let mut b = offset.to_be_bytes().to_vec();
        b.extend_from_slice(rest);
        b
    }

    #[test]
    fn structured_replies_place_data_and_holes_in_any_order_and_carry_errors() {
        let (target, mut server, mut lp) = one_connection();
        let mut bufs = [vec![0xeeu8; 8192], vec![0u8; 4096], vec![0u8; 512]];
        let [a, b, c] = &mut bufs;
        let reads = [
            lp.req(UBLK_IO_OP_READ, 0, a, 1),
            lp.req(UBLK_IO_OP_READ, 0, b, 2),
            lp.req(UBLK_IO_OP_WRITE, 0, c, 3),
        ];
        for r in &reads {
            lp.start(&target, r);
        }
        lp.settle(&target);
        let h: Vec<_> = (0..3).map(|_| request(&mut server)).collect();
        let mut data = vec![0u8; 512];
        server.read_exact(&mut data).unwrap();
        // Read 1 (8 KiB at 8192): its second half as data, then its first half as a
        // hole, then a NONE chunk marked done, read 2's chunks interleaved; read 2
        // fails with an error chunk; the write gets a simple reply.
        let (c1, c2, c3) = (&h[0][8..16], &h[1][8..16], &h[2][8..16]);
        let mut stream = chunk_bytes(0, nbd::REPLY_TYPE_OFFSET_DATA, c1, &at(12288, &[7u8; 4096]));
        stream.extend(chunk_bytes(0, nbd::REPLY_TYPE_OFFSET_DATA, c2, &at(8192, &[1u8; 100])));
        stream.extend(chunk_bytes(
            0,
            nbd::REPLY_TYPE_OFFSET_HOLE,
            c1,
            &at(8192, &4096u32.to_be_bytes()),
        ));
        let mut error = (libc::ENOSPC as u32).to_be_bytes().to_vec();
        error.extend_from_slice(&2u16.to_be_bytes());
        error.extend_from_slice(b"no");
        stream.extend(chunk_bytes(nbd::REPLY_FLAG_DONE, nbd::REPLY_TYPE_ERROR, c2, &error));
        stream.extend(reply_bytes(0, c3, &[]));
        stream.extend(chunk_bytes(nbd::REPLY_FLAG_DONE, nbd::REPLY_TYPE_NONE, c1, &[]));
        // A byte at a time for the first 300: every header and payload split.
        for byte in &stream[..300] {
            server.write_all(std::slice::from_ref(byte)).unwrap();
            lp.turn(&target, 0);
        }
        server.write_all(&stream[300..]).unwrap();
        let mut done = lp.finished(&target, 3);
        done.sort();
        assert_eq!(done, [(1, 8192), (2, -libc::ENOSPC), (3, 512)]);
        assert!(bufs[0][..4096].iter().all(|&b| b == 0), "the hole reads as zeroes");
        assert!(bufs[0][4096..].iter().all(|&b| b == 7), "the data chunk is at its offset");
        std::mem::forget(server);
    }

    #[test]
    fn a_structured_read_not_covered_whole_fails_rather_than_return_stale_bytes() {
        let (target, mut server, mut lp) = one_connection();
        let mut buf = vec![0u8; 4096];
        let r = lp.req(UBLK_IO_OP_READ, 0, &mut buf, 5);
        lp.start(&target, &r);
        lp.settle(&target);
        let h = request(&mut server);
        let mut stream =
            chunk_bytes(0, nbd::REPLY_TYPE_OFFSET_DATA, &h[8..16], &at(8192, &[3u8; 1024]));
        stream.extend(chunk_bytes(nbd::REPLY_FLAG_DONE, nbd::REPLY_TYPE_NONE, &h[8..16], &[]));
        server.write_all(&stream).unwrap();
        assert_eq!(lp.finished(&target, 1), [(5, -libc::EIO)]);
        std::mem::forget(server);
    }

    /// Two chunks that overlap add up to the READ's length but leave a gap: the sum of
    /// their lengths called it whole and returned the tag buffer's stale bytes.
    #[test]
    fn a_structured_read_with_overlapping_or_repeated_chunks_fails() {
        // The loop's requests are at device offset 8192.
        for second_at in [8192 + 1024, 8192] {
            let (target, mut server, mut lp) = one_connection();
            let mut buf = vec![9u8; 4096];
            let r = lp.req(UBLK_IO_OP_READ, 0, &mut buf, 6);
            lp.start(&target, &r);
            lp.settle(&target);
            let h = request(&mut server);
            // 0..2048 and then 1024..3072 (or 0..2048 again): 4096 bytes in all, the
            // last 1024 (or 2048) never sent.
            let mut stream =
                chunk_bytes(0, nbd::REPLY_TYPE_OFFSET_DATA, &h[8..16], &at(8192, &[3u8; 2048]));
            stream.extend(chunk_bytes(
                nbd::REPLY_FLAG_DONE,
                nbd::REPLY_TYPE_OFFSET_DATA,
                &h[8..16],
                &at(second_at, &[4u8; 2048]),
            ));
            server.write_all(&stream).unwrap();
            assert_eq!(lp.finished(&target, 1), [(6, -libc::EIO)], "second chunk at {second_at}");
            std::mem::forget(server);
        }
    }

    #[test]
    fn a_read_larger_than_the_receive_buffer_lands_whole_in_its_buffer() {
        let (target, mut server, mut lp) = one_connection();
        let len = RECEIVE_BUFFER_BYTES * 3 + 123;
        let mut bufs = [vec![0u8; len], vec![0u8; 512]];
        let big = lp.req(UBLK_IO_OP_READ, 0, &mut bufs[0], 1);
        let small = lp.req(UBLK_IO_OP_READ, 0, &mut bufs[1], 2);
        lp.start(&target, &big);
        lp.start(&target, &small);
        lp.settle(&target);
        let (b, s) = (request(&mut server), request(&mut server));
        let pattern: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        // Both replies in one stream, written by another thread as the ring takes it.
        let mut stream = reply_bytes(0, &b[8..16], &pattern);
        stream.extend(reply_bytes(0, &s[8..16], &[5u8; 512]));
        let writer = std::thread::spawn(move || {
            for piece in stream.chunks(50_000) {
                server.write_all(piece).unwrap();
            }
            server
        });
        let mut done = lp.finished(&target, 2);
        done.sort();
        assert_eq!(done, [(1, len as i32), (2, 512)]);
        assert!(bufs[0] == pattern, "the large READ's data is whole and in order");
        assert!(bufs[1].iter().all(|&b| b == 5), "the reply after it is read from the stream");
        std::mem::forget(writer.join().unwrap());
    }

    #[test]
    fn with_only_large_reads_waiting_their_data_skips_the_receive_buffer() {
        let (target, mut server, mut lp) = one_connection();
        let len = 64 << 10;
        let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; len]).collect();
        let reqs: Vec<IoReq> =
            (0..4).map(|i| lp.req(UBLK_IO_OP_READ, 0, &mut bufs[i], i as u64 + 1)).collect();
        for req in &reqs {
            lp.start(&target, req);
        }
        lp.settle(&target);
        let mut stream = Vec::new();
        for i in 0..4 {
            let h = request(&mut server);
            stream.extend(reply_bytes(0, &h[8..16], &vec![i as u8 + 1; len]));
        }
        // Every reply at once: a RECV as large as the receive buffer would take each
        // reply's first 64 KiB through it.
        let writer = std::thread::spawn(move || {
            server.write_all(&stream).unwrap();
            server
        });
        let mut done = lp.finished(&target, 4);
        done.sort();
        assert_eq!(done, (1..=4).map(|ud| (ud, len as i32)).collect::<Vec<_>>());
        for (i, buf) in bufs.iter().enumerate() {
            assert!(buf.iter().all(|&b| b == i as u8 + 1), "READ {i}'s data is whole");
        }
        let copied = lock(&target.connections[0].state).receiver.traffic.copied_bytes;
        // The RECV armed before any request was known takes the first reply's data
        // (up to the buffer's size); after it, only a header's few bytes per reply.
        assert!(
            copied <= (len + 3 * HEADER_RECEIVE_BYTES) as u64,
            "{copied} bytes of READ data went through the receive buffer"
        );
        std::mem::forget(writer.join().unwrap());
    }

    #[test]
    fn flush_discard_and_write_zeroes_carry_no_data_and_complete_with_zero() {
        let (target, mut server, mut lp) = one_connection();
        let mut none = vec![0u8; 65536];
        for (op, flags, kind, cmd_flags) in [
            (UBLK_IO_OP_FLUSH, 0, nbd::CMD_FLUSH, 0),
            (UBLK_IO_OP_DISCARD, 0, nbd::CMD_TRIM, 0),
            (
                UBLK_IO_OP_WRITE_ZEROES,
                UBLK_IO_F_NOUNMAP,
                nbd::CMD_WRITE_ZEROES,
                nbd::CMD_FLAG_NO_HOLE,
            ),
        ] {
            let r = lp.req(op, flags, &mut none, u64::from(op));
            lp.start(&target, &r);
            lp.settle(&target);
            let h = request(&mut server);
            assert_eq!(h[4..6], cmd_flags.to_be_bytes());
            assert_eq!(h[6..8], kind.to_be_bytes());
            if op == UBLK_IO_OP_FLUSH {
                assert_eq!(h[16..28], [0u8; 12], "a FLUSH has offset and length 0");
            }
            server.write_all(&reply_bytes(0, &h[8..16], &[])).unwrap();
            assert_eq!(lp.finished(&target, 1), [(u64::from(op), 0)]);
        }
        std::mem::forget(server);
    }

    #[test]
    fn requests_queued_behind_a_send_all_go_out_whole_and_in_order() {
        let (target, mut server, mut lp) = one_connection();
        // More requests than one WRITEV carries, each WRITE with its own data: the
        // server reads them only later, so sends fill the socket and wait.
        let n = 700;
        let mut bufs: Vec<Vec<u8>> = (0..n).map(|i| vec![(i % 256) as u8; 4096]).collect();
        for (i, buf) in bufs.iter_mut().enumerate() {
            let r = lp.req(UBLK_IO_OP_WRITE, 0, buf, 1000 + i as u64);
            lp.start(&target, &r);
        }
        let reader = std::thread::spawn(move || {
            let mut cookies = Vec::new();
            for i in 0..n {
                let h = request(&mut server);
                let mut data = vec![0u8; 4096];
                server.read_exact(&mut data).unwrap();
                assert!(data.iter().all(|&b| b == (i % 256) as u8), "request {i}'s data");
                cookies.push(h[8..16].to_vec());
            }
            for c in &cookies {
                server.write_all(&reply_bytes(0, c, &[])).unwrap();
            }
            (server, cookies)
        });
        let mut done = lp.finished(&target, n);
        let (server, cookies) = reader.join().unwrap();
        let sent: Vec<u64> =
            cookies.iter().map(|c| u64::from_be_bytes(c[..].try_into().unwrap())).collect();
        assert_eq!(sent, (1000..1000 + n as u64).collect::<Vec<_>>(), "sent in the order started");
        done.sort();
        assert_eq!(done, (0..n).map(|i| (1000 + i as u64, 4096)).collect::<Vec<_>>());
        std::mem::forget(server);
    }

    #[test]
    fn a_shared_connections_replies_reach_each_threads_ring() {
        // Three queue threads on two connections: threads 0 and 2 share connection 0,
        // which thread 0 reads; thread 2's results are posted into thread 2's ring.
        let (target, mut servers) = target_over(2);
        let mut loops = [Loop::new(0), Loop::new(1), Loop::new(2)];
        for lp in &mut loops {
            lp.arm(&target);
        }
        let mut bufs = [vec![0u8; 512], vec![0u8; 512], vec![0u8; 512]];
        for (thread, buf) in bufs.iter_mut().enumerate() {
            let r = loops[thread].req(UBLK_IO_OP_READ, 0, buf, 100 + thread as u64);
            loops[thread].start(&target, &r);
            loops[thread].settle(&target);
        }
        let first = [request(&mut servers[0]), request(&mut servers[0])];
        assert_eq!(first.map(|h| cookie(&h)), [100, 102]);
        let second = request(&mut servers[1]);
        assert_eq!(cookie(&second), 101);
        servers[1].write_all(&reply_bytes(0, &second[8..16], &[1u8; 512])).unwrap();
        assert_eq!(loops[1].finished(&target, 1), [(101, 512)]);
        for (h, byte) in first.iter().zip([2u8, 3]) {
            servers[0].write_all(&reply_bytes(0, &h[8..16], &[byte; 512])).unwrap();
        }
        // Thread 0 reads both; its own request is handed back, thread 2's posted.
        assert_eq!(loops[0].finished(&target, 1), [(100, 512)]);
        // The post is submitted with thread 0's next turn.
        assert!(loops[0].settle(&target).is_empty());
        assert_eq!(loops[2].finished(&target, 1), [(102, 512)]);
        assert!(bufs[1].iter().all(|&b| b == 1), "connection 1's READ");
        assert!(bufs[0].iter().all(|&b| b == 2) && bufs[2].iter().all(|&b| b == 3));
        // Activation takes exactly one socket per connection, once.
        let err = target.activate(Vec::new(), &[]).unwrap_err().to_string();
        assert!(err.contains("needs 2 file descriptor(s), got 0"), "{err}");
        assert!(NbdTarget::new(0, false, 1).is_err());
        assert!(NbdTarget::new(MAX_NBD_CONNECTIONS + 1, false, 1).is_err());
        std::mem::forget(servers);
    }
}
