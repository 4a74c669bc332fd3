//! `nbd`: an export of an NBD server, over the socket the supervisor connected and
//! negotiated (simple replies only) and hands over with the device at activation.
//!
//! A queue thread sends its requests itself, on its connection (one per queue thread,
//! up to the count the supervisor gives, where the export allows several; else one
//! for all): the header, and a WRITE's data, in one `writev`, under the connection's
//! lock so that two threads' requests never interleave on the stream. The request
//! then waits ([`Step::Pending`]). Each connection's reply thread reads its replies in
//! whatever order the server sends them, reads a READ's data straight into
//! the tag's buffer, and posts the result into the ring of the queue thread that owns
//! the request (`IORING_OP_MSG_RING`): the completion that thread's loop would get
//! from a target SQE, so the loop itself knows nothing of NBD.
//!
//! A connection that breaks (the server closed it, or answered what no request asked)
//! ends the worker with [`WorkerExit::BackendLost`]: the supervisor connects afresh for
//! the next worker and the kernel re-issues the requests that were in flight, so no
//! request fails for it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, mpsc};

use io_uring::{IoUring, opcode, types};
use ublkd_proto::exit::WorkerExit;
use ublkd_proto::msg::MAX_NBD_CONNECTIONS;
use ublkd_proto::nbd::{self, Request, SimpleReply};
use ublkd_proto::uapi::{
    UBLK_IO_F_FUA, UBLK_IO_F_NOUNMAP, UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ,
    UBLK_IO_OP_WRITE, UBLK_IO_OP_WRITE_ZEROES,
};

use super::{IoReq, Reply, Step, Target, TargetError};

/// The socket's receive buffer in user space: most replies are 16-byte headers, read
/// a batch per system call.
const REPLY_BUFFER_BYTES: usize = 64 << 10;

/// What the reply thread needs to finish a request: where a READ's data goes and whom
/// to tell.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    op: u8,
    /// The tag's buffer (READ: `len` bytes are written there), as an address: the
    /// buffer belongs to the request until its result is committed, which the reply
    /// thread's post makes happen.
    buf: usize,
    len: u32,
    reply: Reply,
}

/// One connection to the server: its own socket, send lock, requests in flight and
/// reply thread.
#[derive(Debug, Default)]
struct Connection {
    /// The socket's sending side, from activation on.
    socket: OnceLock<File>,
    /// Held for the whole of one request's `writev`s.
    sending: Mutex<()>,
    /// Requests sent and not yet answered, by cookie (their `Reply::user_data`, unique
    /// while a request is in flight).
    waiting: Mutex<HashMap<u64, Waiting>>,
}

impl Connection {
    fn send(&self, socket: &File, header: &[u8], data: &[u8]) -> io::Result<()> {
        let _turn = lock(&self.sending);
        let mut all = [IoSlice::new(header), IoSlice::new(data)];
        // Without data, only the header: a list of empty parts would write 0 bytes.
        let mut parts = &mut all[..if data.is_empty() { 1 } else { 2 }];
        let mut out = socket;
        while !parts.is_empty() {
            match out.write_vectored(parts) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut parts, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct NbdTarget {
    /// Queue thread `i` sends on connection `i % len` (several only for an export that
    /// allows it: the supervisor decides).
    connections: Vec<Arc<Connection>>,
    /// Give the reply threads, started while standing by (a sandboxed worker cannot
    /// start threads once it serves), their sockets at activation.
    start_replies: Mutex<Vec<mpsc::Sender<File>>>,
}

impl NbdTarget {
    /// Starts a reply thread per connection, with the ring it posts completions
    /// through; they wait for their sockets ([`Target::activate`]).
    pub fn new(connections: u8) -> Result<Self, TargetError> {
        if connections == 0 || connections > MAX_NBD_CONNECTIONS {
            return Err(TargetError::Fds {
                target: "nbd",
                want: usize::from(MAX_NBD_CONNECTIONS),
                got: usize::from(connections),
            });
        }
        let mut all = Vec::new();
        let mut starts = Vec::new();
        for i in 0..connections {
            let ring = completion_ring()?;
            let connection = Arc::new(Connection::default());
            let (tx, rx) = mpsc::channel::<File>();
            let for_replies = Arc::clone(&connection);
            std::thread::Builder::new().name(format!("ublk-nbd-replies{i}")).spawn(move || {
                // No socket: the standby was let go and the process is ending.
                if let Ok(socket) = rx.recv() {
                    serve_replies(&for_replies, ring, socket);
                }
            })?;
            all.push(connection);
            starts.push(tx);
        }
        Ok(NbdTarget { connections: all, start_replies: Mutex::new(starts) })
    }
}

/// The small ring the reply thread posts completions through: it may run MSG_RING and
/// nothing else, whether the worker is sandboxed or not.
fn completion_ring() -> Result<IoUring, TargetError> {
    use io_uring::register::Restriction;
    let ring = IoUring::builder().setup_r_disabled().build(16)?;
    let mut allowed: Vec<Restriction> = crate::sandbox::policy::NBD_COMPLETION_RING_OPS
        .iter()
        .map(|op| Restriction::sqe_op(op.opcode))
        .collect();
    ring.submitter().register_restrictions(&mut allowed)?;
    ring.submitter().register_enable_rings()?;
    Ok(ring)
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
    std::process::exit(i32::from(WorkerExit::BackendLost.code()))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The reply thread: reads every reply and hands its result to the request's thread.
fn serve_replies(shared: &Connection, mut ring: IoUring, socket: File) -> ! {
    let mut replies = BufReader::with_capacity(REPLY_BUFFER_BYTES, socket);
    let mut header = [0u8; nbd::SIMPLE_REPLY_BYTES];
    loop {
        if let Err(e) = replies.read_exact(&mut header) {
            lost("waiting for a reply", &e);
        }
        let reply = SimpleReply::decode(&header).unwrap_or_else(|e| lost("reading a reply", &e));
        let Some(w) = lock(&shared.waiting).remove(&reply.cookie) else {
            let what =
                format!("the server answered cookie {:#x}, which no request has", reply.cookie);
            lost("reading a reply", &what);
        };
        if reply.error == libc::ESHUTDOWN as u32 {
            // The server is going away: the request is re-issued on the next
            // connection rather than failed.
            lost("reading a reply", &"the server is shutting down (ESHUTDOWN)");
        }
        let res = if reply.error != 0 {
            -reply.errno()
        } else if w.op == UBLK_IO_OP_READ {
            // SAFETY: `w.buf` is the request's tag buffer, at least `w.len` bytes (checked
            // by `IoReq::from_desc`), mapped for the process's life; the request is in
            // flight until this thread posts its result below, so nothing else touches
            // the buffer meanwhile.
            let data = unsafe { std::slice::from_raw_parts_mut(w.buf as *mut u8, w.len as usize) };
            if let Err(e) = replies.read_exact(data) {
                lost("reading a READ's data", &e);
            }
            w.len as i32
        } else if w.op == UBLK_IO_OP_WRITE {
            w.len as i32
        } else {
            0
        };
        post(&mut ring, w.reply, res);
    }
}

/// Posts `res` as the completion `reply` names into its queue thread's ring.
fn post(ring: &mut IoUring, reply: Reply, res: i32) {
    let sqe =
        opcode::MsgRingData::new(types::Fd(reply.ring_fd), res, reply.user_data, None).build();
    // SAFETY: a MSG_RING SQE references no memory; the target ring's fd stays open while
    // its queue thread runs, and it runs while this request is in flight.
    if unsafe { ring.submission().push(&sqe) }.is_err() {
        // The ring is emptied after every post, so it is never full.
        lost("posting a completion", &"the completion ring is full");
    }
    if let Err(e) = ring.submit_and_wait(1) {
        lost("posting a completion", &e);
    }
    for cqe in ring.completion() {
        if cqe.result() < 0 {
            let e = io::Error::from_raw_os_error(-cqe.result());
            lost("posting a completion to a queue thread", &e);
        }
    }
}

impl Target for NbdTarget {
    fn start(&self, req: &IoReq) -> Step {
        let connection = &self.connections[usize::from(req.reply.thread) % self.connections.len()];
        let Some(socket) = connection.socket.get() else { return Step::Done(-libc::EIO) };
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
        if moves_data && req.buf.is_null() {
            // Zero copy is never set up for nbd devices.
            return Step::Done(-libc::EIO);
        }
        let offset = if req.op == UBLK_IO_OP_FLUSH { 0 } else { req.offset };
        let cookie = req.reply.user_data;
        let header = Request { flags, kind, cookie, offset, length }.encode();
        let waiting = Waiting { op: req.op, buf: req.buf as usize, len: req.len, reply: req.reply };
        // Recorded before it is sent: the reply may arrive before `send` returns.
        lock(&connection.waiting).insert(cookie, waiting);
        let data: &[u8] = if req.op == UBLK_IO_OP_WRITE {
            // SAFETY: a WRITE's data is in the tag's buffer, `req.len` bytes (checked by
            // `IoReq::from_desc`), which belongs to this request until it is committed.
            unsafe { std::slice::from_raw_parts(req.buf, req.len as usize) }
        } else {
            &[]
        };
        if let Err(e) = connection.send(socket, &header, data) {
            lost("sending a request", &e);
        }
        Step::Pending
    }

    fn on_cqe(&self, _req: &IoReq, res: i32, _done: &mut u32) -> Step {
        // The reply thread's post: the request's result.
        Step::Done(res)
    }

    fn fixed_file(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    fn activate(&self, fds: Vec<OwnedFd>) -> Result<(), TargetError> {
        if fds.len() != self.connections.len() {
            let (want, got) = (self.connections.len(), fds.len());
            return Err(TargetError::Fds { target: "nbd", want, got });
        }
        let starts = std::mem::take(&mut *lock(&self.start_replies));
        if starts.len() != fds.len() {
            return Err(TargetError::Io(io::Error::other("the nbd target was activated twice")));
        }
        for ((fd, connection), start) in fds.into_iter().zip(&self.connections).zip(starts) {
            let socket = File::from(fd);
            let for_replies = socket.try_clone()?;
            if connection.socket.set(socket).is_err() || start.send(for_replies).is_err() {
                return Err(TargetError::Io(io::Error::other("an nbd reply thread is gone")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// An NBD target on one end of a socket pair, the test playing the server on the
    /// other, and a ring standing in for a queue thread's.
    fn target() -> (NbdTarget, UnixStream, IoUring) {
        let (target, mut servers, ring) = target_over(1);
        (target, servers.remove(0), ring)
    }

    /// The same over `n` connections: the server's ends, in order.
    fn target_over(n: u8) -> (NbdTarget, Vec<UnixStream>, IoUring) {
        let (ours, servers): (Vec<_>, Vec<_>) = (0..n).map(|_| UnixStream::pair().unwrap()).unzip();
        let target = NbdTarget::new(n).unwrap();
        target.activate(ours.into_iter().map(OwnedFd::from).collect()).unwrap();
        (target, servers, IoUring::new(8).unwrap())
    }

    fn req(op: u8, flags: u32, buf: &mut [u8], ring: &IoUring, user_data: u64) -> IoReq {
        IoReq {
            op,
            flags,
            offset: 8192,
            len: buf.len() as u32,
            buf: buf.as_mut_ptr(),
            buf_index: None,
            reply: Reply { ring_fd: ring.as_raw_fd(), user_data, thread: 0 },
        }
    }

    fn request(server: &mut UnixStream) -> [u8; nbd::REQUEST_BYTES] {
        let mut header = [0u8; nbd::REQUEST_BYTES];
        server.read_exact(&mut header).unwrap();
        header
    }

    fn reply(server: &mut UnixStream, error: u32, cookie: &[u8], data: &[u8]) {
        let mut b = nbd::SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&error.to_be_bytes());
        b.extend_from_slice(cookie);
        b.extend_from_slice(data);
        server.write_all(&b).unwrap();
    }

    /// The completion the reply thread posted: (user_data, res).
    fn posted(ring: &mut IoUring) -> (u64, i32) {
        ring.submit_and_wait(1).unwrap();
        let cqe = ring.completion().next().expect("a completion");
        (cqe.user_data(), cqe.result())
    }

    #[test]
    fn replies_in_any_order_reach_their_requests_with_their_data() {
        let (target, mut server, mut ring) = target();
        let mut read_buf = vec![0u8; 4096];
        let mut write_buf = vec![7u8; 1024];
        let read = req(UBLK_IO_OP_READ, 0, &mut read_buf, &ring, 11);
        let write = req(UBLK_IO_OP_WRITE, UBLK_IO_F_FUA, &mut write_buf, &ring, 22);
        assert!(matches!(target.start(&read), Step::Pending));
        assert!(matches!(target.start(&write), Step::Pending));

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

        // The write is answered first, with an error; then the read, with its data.
        reply(&mut server, libc::ENOSPC as u32, &w[8..16], &[]);
        assert_eq!(posted(&mut ring), (22, -libc::ENOSPC));
        reply(&mut server, 0, &r[8..16], &[9u8; 4096]);
        assert_eq!(posted(&mut ring), (11, 4096));
        assert!(read_buf.iter().all(|&b| b == 9), "the READ's data is in its buffer");
        // A closed connection ends the process (as it must in a worker): keep it open.
        std::mem::forget(server);
    }

    #[test]
    fn flush_discard_and_write_zeroes_carry_no_data_and_complete_with_zero() {
        let (target, mut server, mut ring) = target();
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
            let r = req(op, flags, &mut none, &ring, u64::from(op));
            assert!(matches!(target.start(&r), Step::Pending));
            let h = request(&mut server);
            assert_eq!(h[4..6], cmd_flags.to_be_bytes());
            assert_eq!(h[6..8], kind.to_be_bytes());
            if op == UBLK_IO_OP_FLUSH {
                assert_eq!(h[16..28], [0u8; 12], "a FLUSH has offset and length 0");
            }
            reply(&mut server, 0, &h[8..16], &[]);
            assert_eq!(posted(&mut ring), (u64::from(op), 0));
        }
        std::mem::forget(server);
    }

    #[test]
    fn each_queue_thread_sends_on_its_own_connection() {
        let (target, mut servers, mut ring) = target_over(2);
        let mut bufs = [vec![0u8; 512], vec![0u8; 512], vec![0u8; 512]];
        for (thread, buf) in bufs.iter_mut().enumerate() {
            let mut r = req(UBLK_IO_OP_READ, 0, buf, &ring, 100 + thread as u64);
            r.reply.thread = thread as u16;
            assert!(matches!(target.start(&r), Step::Pending));
        }
        // Threads 0 and 2 on connection 0, thread 1 on connection 1.
        let cookie =
            |h: &[u8; nbd::REQUEST_BYTES]| u64::from_be_bytes(h[8..16].try_into().unwrap());
        let first = [request(&mut servers[0]), request(&mut servers[0])];
        assert_eq!(first.map(|h| cookie(&h)), [100, 102]);
        let second = request(&mut servers[1]);
        assert_eq!(cookie(&second), 101);
        reply(&mut servers[1], 0, &second[8..16], &[1u8; 512]);
        assert_eq!(posted(&mut ring), (101, 512));
        for h in &first {
            reply(&mut servers[0], 0, &h[8..16], &[2u8; 512]);
            assert_eq!(posted(&mut ring), (cookie(h), 512));
        }
        assert!(bufs[1].iter().all(|&b| b == 1) && bufs[2].iter().all(|&b| b == 2));
        // Activation takes exactly one socket per connection, once.
        let err = target.activate(Vec::new()).unwrap_err().to_string();
        assert!(err.contains("needs 2 file descriptor(s), got 0"), "{err}");
        assert!(NbdTarget::new(0).is_err() && NbdTarget::new(MAX_NBD_CONNECTIONS + 1).is_err());
        std::mem::forget(servers);
    }
}
