//! The `ublkctl` socket, served from the supervisor's poll loop without ever blocking
//! it: a client that sends its request a byte at a time, or never reads its answer,
//! costs the loop one nonblocking read or write per wake-up, not a wait.
//!
//! Each connection carries one request and one response (what `ublkctl` sends), each
//! framed as [`msg::write_frame`] frames it. Limits per connection: the request must be
//! complete within [`REQUEST_DEADLINE`] of the connection's accept, and the response
//! taken within [`RESPONSE_DEADLINE`] of its being ready, else the connection is
//! dropped; a request is at most [`MAX_MESSAGE_BYTES`] (a larger length prefix is
//! answered with an error before its body is read), a response at most
//! [`MAX_RESPONSE_BYTES`](ublkd_proto::codec::MAX_RESPONSE_BYTES): `status` of a thousand devices is ~0.5 MiB, more than the
//! socket takes at once, so a response is written in as many turns of the loop as the
//! client's reading takes, one nonblocking write per turn. At most [`MAX_CONNECTIONS`] are open
//! at once: a new client past that evicts the oldest one, so that an operator's
//! `ublkctl`, which sends its whole request at once, is always served even while slow
//! clients hold every slot.
//!
//! This module owns the connections; the requests themselves are handled by the
//! daemon, on the loop thread that owns the device table (see [`ControlServer::service`]
//! and [`ControlServer::respond`]).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use ublkd_proto::codec::MAX_MESSAGE_BYTES;
use ublkd_proto::msg::{self, CtlRequest, CtlResponse, ErrorKind, Failure, MsgError};

/// How long a client may take to send its whole request.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// How long a client may take to read its whole response (of at most
/// [`MAX_RESPONSE_BYTES`](ublkd_proto::codec::MAX_RESPONSE_BYTES), which a client
/// that reads takes in milliseconds).
pub const RESPONSE_DEADLINE: Duration = Duration::from_secs(2);
/// The most connections open at once.
pub const MAX_CONNECTIONS: usize = 32;
/// The most new connections accepted in one turn of the loop (the rest wait in the
/// listen backlog for the next turn).
const ACCEPTS_PER_TURN: usize = 16;
/// A frame's length prefix.
const PREFIX: usize = 4;

/// Identifies a connection between [`ControlServer::service`] and
/// [`ControlServer::respond`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token(u64);

#[derive(Debug)]
enum Phase {
    /// Reading the request: the bytes so far.
    Reading(Vec<u8>),
    /// The request is with the daemon.
    Handling,
    /// Writing the response: the frame and how much of it is sent.
    Writing { frame: Vec<u8>, sent: usize },
}

#[derive(Debug)]
struct Conn {
    token: Token,
    stream: UnixStream,
    phase: Phase,
    /// When the current phase must be over.
    deadline: Instant,
    opened: Instant,
    /// The client asked for errors with their kind ([`CtlRequest::WithKinds`]).
    kinds: bool,
    /// Why the client may not command ublkd, if so: its request is read (to learn how
    /// it takes errors) and answered with this, never handed to the daemon.
    refused: Option<String>,
}

/// What one step of a connection left it as.
enum Step {
    Open,
    Done,
}

/// The listening socket and its open connections.
#[derive(Debug)]
pub struct ControlServer {
    listener: UnixListener,
    conns: Vec<Conn>,
    next_token: u64,
}

impl ControlServer {
    /// Serves `listener` (made nonblocking here).
    pub fn new(listener: UnixListener) -> io::Result<ControlServer> {
        listener.set_nonblocking(true)?;
        Ok(ControlServer { listener, conns: Vec::new(), next_token: 0 })
    }

    /// Appends the listener's and every connection's pollfd, in the order
    /// [`Self::service`] expects them back.
    pub fn pollfds(&self, fds: &mut Vec<libc::pollfd>) {
        fds.push(libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        for c in &self.conns {
            let events = match c.phase {
                Phase::Reading(_) => libc::POLLIN,
                Phase::Writing { .. } => libc::POLLOUT,
                Phase::Handling => 0,
            };
            fds.push(libc::pollfd { fd: c.stream.as_raw_fd(), events, revents: 0 });
        }
    }

    /// The earliest deadline of an open connection: the loop must wake by then. A
    /// connection whose request is being handled (an add under way) has none until it
    /// is answered: its passed deadline would have the loop wake at once, every turn,
    /// for as long as the add takes.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.conns.iter().filter(|c| !matches!(c.phase, Phase::Handling)).map(|c| c.deadline).min()
    }

    /// After a poll on [`Self::pollfds`] (`fds`, exactly as they were added): reads and
    /// writes what is ready, drops connections past their deadline, accepts new ones.
    /// Returns the requests now complete, to be answered with [`Self::respond`].
    pub fn service(&mut self, fds: &[libc::pollfd], now: Instant) -> Vec<(Token, CtlRequest)> {
        let mut requests = Vec::new();
        let ready = |i: usize| fds.get(1 + i).is_some_and(|p| p.revents != 0);
        let mut keep = Vec::with_capacity(self.conns.len());
        for (i, conn) in self.conns.iter_mut().enumerate() {
            let step = if ready(i) { conn.step(now, &mut requests) } else { Step::Open };
            // What was ready is read first: a request sent in time is served even when
            // the loop comes to it late (busy adding a device, say).
            let handling = matches!(conn.phase, Phase::Handling);
            let expired = matches!(step, Step::Open) && !handling && now >= conn.deadline;
            if expired {
                conn.expire();
            }
            keep.push(matches!(step, Step::Open) && !expired);
        }
        let mut keep = keep.into_iter();
        self.conns.retain(|_| keep.next().unwrap_or(false));
        if fds.first().is_some_and(|p| p.revents != 0) {
            self.accept(now, &mut requests);
        }
        requests
    }

    /// Answers the request of `token` (a connection dropped meanwhile is skipped).
    pub fn respond(&mut self, token: Token, response: &CtlResponse, now: Instant) {
        let Some(at) = self.conns.iter().position(|c| c.token == token) else { return };
        let conn = &mut self.conns[at];
        conn.answer(response, now);
        if let Step::Done = conn.write() {
            self.conns.remove(at);
        }
    }

    fn accept(&mut self, now: Instant, requests: &mut Vec<(Token, CtlRequest)>) {
        for _ in 0..ACCEPTS_PER_TURN {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("accept on the control socket failed: {e}");
                    return;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                tracing::warn!("cannot make a ublkctl connection nonblocking: {e}");
                continue;
            }
            if self.conns.len() >= MAX_CONNECTIONS {
                // The oldest whose request is not with the daemon this turn: that one
                // is answered.
                let Some(at) = self.conns.iter().position(|c| !matches!(c.phase, Phase::Handling))
                else {
                    continue; // dropped unanswered: every slot holds a request being handled
                };
                let oldest = self.conns.remove(at);
                tracing::warn!(
                    "{MAX_CONNECTIONS} control connections are open: dropping the oldest, \
                     open for {} ms",
                    now.saturating_duration_since(oldest.opened).as_millis()
                );
            }
            let token = Token(self.next_token);
            self.next_token += 1;
            let refused = peer_allowed(&stream).err();
            let mut conn = Conn {
                token,
                stream,
                phase: Phase::Reading(Vec::new()),
                deadline: now + REQUEST_DEADLINE,
                opened: now,
                kinds: false,
                refused,
            };
            // The client usually sent its request along with the connect.
            let step = conn.step(now, requests);
            if let Step::Open = step {
                self.conns.push(conn);
            }
        }
    }
}

impl Conn {
    /// Reads or writes what the connection is ready for.
    fn step(&mut self, now: Instant, requests: &mut Vec<(Token, CtlRequest)>) -> Step {
        match &mut self.phase {
            Phase::Reading(buf) => match read_request(&mut self.stream, buf) {
                Ok(None) => Step::Open,
                Ok(Some(req)) => {
                    let req = match req {
                        CtlRequest::WithKinds(inner) => {
                            self.kinds = true;
                            *inner
                        }
                        req => req,
                    };
                    if let Some(message) = self.refused.take() {
                        let failure = Failure::new(ErrorKind::PermissionDenied, message);
                        self.answer(&CtlResponse::from(failure), now);
                        return self.write();
                    }
                    self.phase = Phase::Handling;
                    requests.push((self.token, req));
                    Step::Open
                }
                Err(MsgError::Closed) => Step::Done,
                Err(MsgError::Io(e)) => {
                    tracing::debug!("a ublkctl client's connection failed: {e}");
                    Step::Done
                }
                Err(e) => {
                    self.answer(&CtlResponse::Error { message: format!("bad request: {e}") }, now);
                    self.write()
                }
            },
            Phase::Handling => Step::Open,
            Phase::Writing { .. } => self.write(),
        }
    }

    /// Queues `response` to be written, its error in the form the client takes.
    fn answer(&mut self, response: &CtlResponse, now: Instant) {
        let mut frame = Vec::new();
        if let Err(e) = msg::write_response(&mut frame, &self.for_client(response.clone())) {
            frame.clear();
            let message = format!("ublkd cannot send its answer: {e}");
            // An error message this short always encodes.
            let error = self.for_client(CtlResponse::Error { message });
            let _ = msg::write_response(&mut frame, &error);
        }
        self.phase = Phase::Writing { frame, sent: 0 };
        self.deadline = now + RESPONSE_DEADLINE;
    }

    /// `response` as this client decodes it. A client that asked for kinds never gets a
    /// bare `Error`, which it takes for an older ublkd's refusal of a request it could
    /// not decode, and sends the request again: an error without a kind is `Other`.
    /// Any other client never gets `Failed`, which it cannot decode.
    fn for_client(&self, response: CtlResponse) -> CtlResponse {
        match response {
            CtlResponse::Error { message } if self.kinds => {
                Failure::new(ErrorKind::Other, message).into()
            }
            response if self.kinds => response,
            response => response.without_kind(),
        }
    }

    /// Writes as much of the response as the socket takes now.
    fn write(&mut self) -> Step {
        let Phase::Writing { frame, sent } = &mut self.phase else { return Step::Open };
        while *sent < frame.len() {
            match self.stream.write(&frame[*sent..]) {
                Ok(0) => return Step::Done,
                Ok(n) => *sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Open,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("cannot answer a ublkctl client: {e}");
                    return Step::Done;
                }
            }
        }
        Step::Done
    }

    fn expire(&self) {
        let what = match self.phase {
            Phase::Reading(_) => {
                format!("sent no complete request within {} s", REQUEST_DEADLINE.as_secs())
            }
            _ => format!("did not read its answer within {} s", RESPONSE_DEADLINE.as_secs()),
        };
        tracing::warn!("dropping a ublkctl connection that {what}");
    }
}

/// Reads what `stream` has of a request into `buf` without blocking: `Ok(None)` while
/// incomplete. Never reads past the frame, nor a body whose length prefix is over
/// [`MAX_MESSAGE_BYTES`].
fn read_request(stream: &mut impl Read, buf: &mut Vec<u8>) -> Result<Option<CtlRequest>, MsgError> {
    loop {
        let want = match buf.len() {
            n if n < PREFIX => PREFIX,
            _ => {
                let len = u32::from_le_bytes(buf[..PREFIX].try_into().expect("4 bytes")) as usize;
                if len > MAX_MESSAGE_BYTES {
                    return Err(MsgError::FrameTooLarge { len, limit: MAX_MESSAGE_BYTES });
                }
                PREFIX + len
            }
        };
        if buf.len() == want {
            // The frame is whole: proto's reader decodes it with its own checks.
            return msg::read_frame(&mut buf.as_slice()).map(Some);
        }
        let have = buf.len();
        buf.resize(want, 0);
        match stream.read(&mut buf[have..]) {
            Ok(0) => {
                buf.truncate(have);
                return Err(MsgError::Closed);
            }
            Ok(n) => buf.truncate(have + n),
            Err(e) => {
                buf.truncate(have);
                match e.kind() {
                    io::ErrorKind::WouldBlock => return Ok(None),
                    io::ErrorKind::Interrupted => {}
                    _ => return Err(e.into()),
                }
            }
        }
    }
}

/// Only root (or the daemon's own user) may command the daemon.
fn peer_allowed(stream: &UnixStream) -> Result<(), String> {
    let cred =
        nix::sys::socket::getsockopt(&stream.as_fd(), nix::sys::socket::sockopt::PeerCredentials)
            .map_err(|e| format!("cannot read the client's credentials: {e}"))?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() == 0 || cred.uid() == me {
        Ok(())
    } else {
        Err(format!("permission denied: uid {} may not control ublkd (root only)", cred.uid()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    fn frame(req: &CtlRequest) -> Vec<u8> {
        let mut f = Vec::new();
        msg::write_frame(&mut f, req).unwrap();
        f
    }

    #[test]
    fn a_request_sent_a_byte_at_a_time_is_read_without_waiting_and_then_whole() {
        let (mut client, mut server) = pair();
        let bytes = frame(&CtlRequest::List { id: Some(7) });
        let mut buf = Vec::new();
        for (i, b) in bytes.iter().enumerate() {
            assert!(read_request(&mut server, &mut buf).unwrap().is_none(), "at byte {i}");
            client.write_all(&[*b]).unwrap();
        }
        let req = read_request(&mut server, &mut buf).unwrap();
        assert!(matches!(req, Some(CtlRequest::List { id: Some(7) })), "{req:?}");
    }

    #[test]
    fn an_oversized_length_prefix_is_refused_before_its_body() {
        let (mut client, mut server) = pair();
        client.write_all(&(MAX_MESSAGE_BYTES as u32 + 1).to_le_bytes()).unwrap();
        client.write_all(&[0u8; 16]).unwrap();
        let mut buf = Vec::new();
        let err = read_request(&mut server, &mut buf).unwrap_err();
        assert!(
            matches!(err, MsgError::FrameTooLarge { len, .. } if len == MAX_MESSAGE_BYTES + 1),
            "{err}"
        );
        assert_eq!(buf.len(), PREFIX, "read past the prefix");
    }

    #[test]
    fn a_client_that_hangs_up_mid_request_is_closed() {
        let (mut client, mut server) = pair();
        client.write_all(&[5, 0]).unwrap();
        drop(client);
        let mut buf = Vec::new();
        assert!(matches!(read_request(&mut server, &mut buf), Err(MsgError::Closed)));
    }

    fn server(tag: &str) -> (ControlServer, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("ublkd-control-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sock");
        (ControlServer::new(UnixListener::bind(&path).unwrap()).unwrap(), dir)
    }

    fn turn(server: &mut ControlServer, now: Instant) -> Vec<(Token, CtlRequest)> {
        let mut fds = Vec::new();
        server.pollfds(&mut fds);
        let _ = crate::sys::poll(&mut fds, 0);
        server.service(&fds, now)
    }

    #[test]
    fn a_request_sent_in_time_is_served_even_when_the_loop_reads_it_late() {
        let (mut server, dir) = server("late");
        let t0 = Instant::now();
        let mut early = UnixStream::connect(dir.join("sock")).unwrap();
        assert!(turn(&mut server, t0).is_empty(), "accepted, nothing sent yet");
        early.write_all(&frame(&CtlRequest::List { id: None })).unwrap();
        // The loop was busy (adding a device, say) past the request's deadline.
        let requests = turn(&mut server, t0 + REQUEST_DEADLINE * 3);
        assert_eq!(requests.len(), 1, "the request that arrived in time was dropped");
        server.respond(requests[0].0, &CtlResponse::List(Vec::new()), t0 + REQUEST_DEADLINE * 3);
        let answer = msg::read_response(&mut early).unwrap();
        assert!(matches!(answer, CtlResponse::List(_)), "{answer:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_connection_silent_past_its_deadline_is_dropped_and_others_are_served() {
        let (mut server, dir) = server("silent");
        let path = dir.join("sock");
        let silent = UnixStream::connect(&path).unwrap();
        let mut prompt = UnixStream::connect(&path).unwrap();
        prompt.write_all(&frame(&CtlRequest::Status { id: None })).unwrap();
        let t0 = Instant::now();
        let requests = turn(&mut server, t0);
        assert_eq!(requests.len(), 1, "the prompt client's request");
        assert_eq!(server.conns.len(), 2);
        server.respond(requests[0].0, &CtlResponse::Deleted { ids: vec![1] }, t0);
        let answer = msg::read_response(&mut prompt).unwrap();
        assert!(matches!(answer, CtlResponse::Deleted { .. }), "{answer:?}");
        assert_eq!(server.conns.len(), 1, "the answered connection is closed");
        assert!(turn(&mut server, t0 + REQUEST_DEADLINE / 2).is_empty());
        assert_eq!(server.conns.len(), 1, "dropped before its deadline");
        // poll reports nothing for the silent one: the deadline alone drops it.
        turn(&mut server, t0 + REQUEST_DEADLINE);
        assert_eq!(server.conns.len(), 0, "kept past its deadline");
        drop(silent);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn each_client_gets_errors_in_the_form_it_asked_for() {
        let (mut server, dir) = server("kinds");
        let path = dir.join("sock");
        let t0 = Instant::now();
        let asks = |busy: bool| {
            let inner = CtlRequest::Del { id: Some(2) };
            let (old, new) = (inner.clone(), CtlRequest::WithKinds(Box::new(inner)));
            let mut old_client = UnixStream::connect(&path).unwrap();
            let mut new_client = UnixStream::connect(&path).unwrap();
            old_client.write_all(&frame(&old)).unwrap();
            new_client.write_all(&frame(&new)).unwrap();
            (old_client, new_client, busy)
        };
        for busy in [true, false] {
            let (mut old_client, mut new_client, busy) = asks(busy);
            let requests = turn(&mut server, t0);
            assert_eq!(requests.len(), 2);
            for (token, request) in &requests {
                // The daemon sees the request unwrapped.
                assert_eq!(request, &CtlRequest::Del { id: Some(2) });
                let answer = if busy {
                    Failure::new(ErrorKind::Busy, "device 2 is in use").into()
                } else {
                    CtlResponse::Error { message: "delete failed".into() }
                };
                server.respond(*token, &answer, t0);
            }
            let (message, kind) = if busy {
                ("device 2 is in use", ErrorKind::Busy)
            } else {
                ("delete failed", ErrorKind::Other)
            };
            let old = msg::read_response(&mut old_client).unwrap();
            assert_eq!(old, CtlResponse::Error { message: message.into() });
            // Never a bare Error, which the client would take for an older ublkd's.
            let new = msg::read_response(&mut new_client).unwrap();
            assert_eq!(new, CtlResponse::Failed { kind, message: message.into() });
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_request_being_handled_sets_no_deadline_for_the_loop() {
        let (mut server, dir) = server("handling");
        let mut client = UnixStream::connect(dir.join("sock")).unwrap();
        let t0 = Instant::now();
        assert!(turn(&mut server, t0).is_empty(), "accepted, nothing sent yet");
        assert!(server.next_deadline().is_some(), "a request not yet sent has its deadline");
        client.write_all(&frame(&CtlRequest::Status { id: None })).unwrap();
        let requests = turn(&mut server, t0);
        assert_eq!(requests.len(), 1);
        // Answered later (an add waiting for its worker): until then the loop must not
        // be woken by a deadline that passes meanwhile.
        assert_eq!(server.next_deadline(), None, "a handled request's deadline wakes the loop");
        assert!(turn(&mut server, t0 + REQUEST_DEADLINE * 3).is_empty());
        assert_eq!(server.conns.len(), 1, "a handled request was dropped at its deadline");
        let later = t0 + REQUEST_DEADLINE * 3;
        server.respond(requests[0].0, &CtlResponse::Added { id: 3 }, later);
        let answer = msg::read_response(&mut client).unwrap();
        assert!(matches!(answer, CtlResponse::Added { id: 3 }), "{answer:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A `list` answer for `n` devices.
    fn listing(n: u32) -> CtlResponse {
        CtlResponse::List(
            (0..n)
                .map(|id| msg::DevListing {
                    id,
                    nr_hw_queues: 1,
                    queue_depth: 128,
                    block_size: 4096,
                    dev_capacity: 1 << 21,
                    max_rq_size: 1 << 20,
                    daemon_pid: 1234,
                    flags: 0x8058,
                    state: "LIVE".into(),
                })
                .collect(),
        )
    }

    /// Reads what `client` (nonblocking) has now into `into`.
    fn read_available(client: &mut UnixStream, into: &mut Vec<u8>) {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match client.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => into.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => panic!("reading the answer: {e}"),
            }
        }
    }

    /// A client connected to `server`, its `list` request with the daemon.
    fn asking(
        server: &mut ControlServer,
        dir: &std::path::Path,
        now: Instant,
    ) -> (UnixStream, Token) {
        let mut client = UnixStream::connect(dir.join("sock")).unwrap();
        client.write_all(&frame(&CtlRequest::List { id: None })).unwrap();
        let requests = turn(server, now);
        assert_eq!(requests.len(), 1);
        client.set_nonblocking(true).unwrap();
        (client, requests[0].0)
    }

    #[test]
    fn a_response_larger_than_the_socket_takes_is_written_over_turns_as_it_is_read() {
        let (mut server, dir) = server("large");
        let t0 = Instant::now();
        let (mut client, token) = asking(&mut server, &dir, t0);
        let response = listing(40_000);
        server.respond(token, &response, t0);
        assert_eq!(server.conns.len(), 1, "the whole answer went out in one write");

        let mut received = Vec::new();
        let mut turns = 0;
        while !server.conns.is_empty() {
            read_available(&mut client, &mut received);
            turn(&mut server, t0 + RESPONSE_DEADLINE / 2);
            turns += 1;
            assert!(turns < 100_000, "the answer never ended: {} bytes read", received.len());
        }
        read_available(&mut client, &mut received);
        assert!(received.len() > MAX_MESSAGE_BYTES, "a small answer: {} bytes", received.len());
        assert!(turns > 1, "written in one turn");
        assert_eq!(msg::read_response(&mut received.as_slice()).unwrap(), response);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_client_that_stops_reading_a_large_response_is_dropped_at_the_deadline() {
        let (mut server, dir) = server("stalled");
        let t0 = Instant::now();
        let (mut client, token) = asking(&mut server, &dir, t0);
        server.respond(token, &listing(40_000), t0);
        let mut received = Vec::new();
        read_available(&mut client, &mut received);
        turn(&mut server, t0 + RESPONSE_DEADLINE / 2);
        assert_eq!(server.conns.len(), 1, "dropped before its deadline");
        // The client reads no more.
        turn(&mut server, t0 + RESPONSE_DEADLINE);
        assert_eq!(server.conns.len(), 0, "kept past its deadline");
        read_available(&mut client, &mut received);
        let err = msg::read_response(&mut received.as_slice()).unwrap_err();
        assert!(matches!(err, MsgError::Io(_)), "the cut answer read as whole: {err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
