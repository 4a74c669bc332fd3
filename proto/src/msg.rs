//! The messages between ublkd's processes, and how they travel.
//!
//! - supervisor ↔ worker: [`ToWorker`] / [`FromWorker`] over a `SOCK_SEQPACKET`
//!   socketpair, one message per packet, file descriptors attached with SCM_RIGHTS.
//! - ublkctl ↔ supervisor: [`CtlRequest`] / [`CtlResponse`] over the daemon's unix
//!   stream socket, each message framed by a 4-byte little-endian length. A request is
//!   at most [`MAX_MESSAGE_BYTES`](crate::codec::MAX_MESSAGE_BYTES) like every other message; a response, which grows
//!   with the devices it lists, at most [`MAX_RESPONSE_BYTES`](crate::codec::MAX_RESPONSE_BYTES) ([`write_response`],
//!   [`read_response`]).
//!
//! Every message is encoded by [`crate::codec`] (bounded decode). Receivers treat
//! everything they decode as untrusted input and validate it before use.

use std::io;

use crate::codec::CodecError;

mod ctl;
mod data_path;
mod frame;
pub mod rbd;
mod worker;
pub use ctl::{
    AddRequest, CtlRequest, CtlResponse, DevListing, DevMetrics, DevStatus, ErrorKind, Failure,
    RbdAdd, SandboxStatus, TargetKind, UpgradeOutcome,
};
pub use data_path::DataPath;
pub use frame::{read_frame, read_response, write_frame, write_response};
pub use worker::{
    Activation, FromWorker, LayerSet, MAX_HELD_FDS, MAX_NBD_CONNECTIONS, MissingLayer,
    SandboxLayer, SandboxReport, TargetSetup, ToWorker, UnknownLayer, WorkerSetup, recv_packet,
    send_packet, try_recv_packet, try_send_packet,
};

/// The most fds one message may carry.
pub const MAX_FDS: usize = 8;

/// Errors moving messages.
#[derive(Debug, thiserror::Error)]
pub enum MsgError {
    #[error("the peer closed the connection")]
    Closed,
    #[error("socket I/O failed: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("a message's length prefix says {len} bytes, more than the limit of {limit}")]
    FrameTooLarge { len: usize, limit: usize },
    #[error("a message was cut short (truncated to the receive buffer)")]
    Truncated,
    #[error("a message carried {got} file descriptors, expected {want}")]
    FdCount { got: usize, want: usize },
    /// Only from the `try_` functions: the peer has not taken the packets already
    /// queued to it (sending), or nothing is there (receiving).
    #[error("the socket's queue is full, or empty: the call would have blocked")]
    WouldBlock,
}

/// The most characters of a worker's text (a failure reason) that the supervisor
/// passes on to its log, an operator's error or status.
pub const MAX_UNTRUSTED_TEXT: usize = 512;

/// A worker's text made safe to show: control characters but tab (a newline that
/// would start a forged log line, terminal escapes) escaped, and cut at
/// [`MAX_UNTRUSTED_TEXT`] characters with a mark that it was.
pub fn untrusted_text(text: &str) -> String {
    untrusted_text_within(text, MAX_UNTRUSTED_TEXT)
}

/// [`untrusted_text`] cut at `max` characters (escapes counted as shown), for a caller
/// that bounds the text its own way.
pub fn untrusted_text_within(text: &str, max: usize) -> String {
    let mut out = String::new();
    let mut shown = 0usize;
    for c in text.chars() {
        let escaped = (c.is_control() && c != '\t').then(|| c.escape_default());
        let width = escaped.clone().map_or(1, Iterator::count);
        if shown.saturating_add(width) > max {
            out.push_str("…(cut)");
            break;
        }
        shown += width;
        match escaped {
            Some(e) => out.extend(e),
            None => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{self, MAX_MESSAGE_BYTES, MAX_RESPONSE_BYTES};
    use crate::shm::{CounterSnapshot, LatencySnapshot};
    use std::io::Write;
    use std::os::fd::{AsFd, AsRawFd, OwnedFd};
    use std::os::unix::net::UnixStream;

    fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap()
    }

    #[test]
    fn setup_travels_with_its_fds() {
        let (a, b) = seqpacket_pair();
        let setup = WorkerSetup {
            dev_id: 3,
            size_bytes: 1 << 20,
            nr_queues: 2,
            queue_depth: 64,
            max_io_buf_bytes: 1 << 19,
            nr_threads: 2,
            target: TargetSetup::Memory,
            block_size: 4096,
            zero_copy: true,
            fast_release: true,
            data_path: DataPath::PerIo,
            rbd: None,
            read_only: true,
        };
        let f1 = std::fs::File::open("/dev/null").unwrap();
        let f2 = std::fs::File::open("/dev/zero").unwrap();
        send_packet(a.as_fd(), &ToWorker::Setup(setup.clone()), &[f1.as_fd(), f2.as_fd()]).unwrap();
        let (msg, fds): (ToWorker, _) = recv_packet(b.as_fd()).unwrap();
        assert_eq!(msg, ToWorker::Setup(setup.clone()));
        assert_eq!(fds.len(), setup.fd_count());
    }

    #[test]
    fn closed_peer_is_reported_as_closed() {
        let (a, b) = seqpacket_pair();
        drop(a);
        assert!(matches!(recv_packet::<FromWorker>(b.as_fd()), Err(MsgError::Closed)));
    }

    #[test]
    fn a_peer_that_stops_reading_cannot_make_the_try_calls_wait() {
        let (ours, theirs) = seqpacket_pair();
        // The peer clears O_NONBLOCK on the description both ends share (as a worker
        // holding a copy of ours could); the try calls must not care.
        // SAFETY: F_SETFL on an fd this test owns, for the call.
        assert_eq!(unsafe { libc::fcntl(ours.as_raw_fd(), libc::F_SETFL, 0) }, 0);
        assert!(matches!(try_recv_packet::<ToWorker>(ours.as_fd()), Err(MsgError::WouldBlock)));
        let mut sent = 0;
        let full = loop {
            match try_send_packet(ours.as_fd(), &ToWorker::Shutdown, &[]) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(sent < 100_000, "the queue never filled");
        };
        assert!(matches!(full, MsgError::WouldBlock), "{full}");
        assert!(sent > 0);
        let (got, _) = recv_packet::<ToWorker>(theirs.as_fd()).unwrap();
        assert_eq!(got, ToWorker::Shutdown);
    }

    #[test]
    fn garbage_packet_is_a_codec_error_not_a_panic() {
        let (a, b) = seqpacket_pair();
        nix::unistd::write(&a, &[0xff, 0xff, 0xff, 0x01]).unwrap();
        assert!(matches!(recv_packet::<FromWorker>(b.as_fd()), Err(MsgError::Codec(_))));
    }

    #[test]
    fn a_workers_text_cannot_forge_a_log_line_or_flood_it() {
        assert_eq!(untrusted_text("bad\nublkd: device 0 deleted"), "bad\\nublkd: device 0 deleted");
        assert_eq!(untrusted_text("\u{1b}[2J"), "\\u{1b}[2J");
        let long = untrusted_text(&"x".repeat(10 * MAX_UNTRUSTED_TEXT));
        assert_eq!(long.chars().count(), MAX_UNTRUSTED_TEXT + "…(cut)".chars().count());
        assert_eq!(untrusted_text("plain"), "plain");
    }

    proptest::proptest! {
        /// Whatever bytes a worker or a client sends, decoding them is an error or a
        /// message, never a panic; and a worker's text is always bounded and one line.
        #[test]
        fn any_bytes_decode_without_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
        ) {
            let _ = codec::decode::<FromWorker>(&bytes);
            let _ = codec::decode::<ToWorker>(&bytes);
            let _ = codec::decode::<CtlRequest>(&bytes);
            let _ = codec::decode::<CtlResponse>(&bytes);
            let text = untrusted_text(&String::from_utf8_lossy(&bytes));
            proptest::prop_assert!(!text.contains('\n') && !text.contains('\r'));
            proptest::prop_assert!(text.chars().count() <= MAX_UNTRUSTED_TEXT + 6);
        }

        /// A real message with bytes flipped: the decoder sees almost-valid input.
        #[test]
        fn corrupted_worker_messages_decode_without_panic(
            flips in proptest::collection::vec((0usize..64, proptest::prelude::any::<u8>()), 1..8),
        ) {
            let msg = FromWorker::Standby {
                sandbox: Some(SandboxReport {
                    namespaces: vec!["user".into(), "mnt".into()],
                    missing: vec![MissingLayer {
                        layer: SandboxLayer::UserNamespace,
                        cause: "refused".into(),
                    }],
                    landlock_abi: Some(4),
                }),
                rings: vec![5, 6, 7],
                client: Some("client.4186".into()),
            };
            let mut bytes = codec::encode(&msg).unwrap();
            for (at, value) in flips {
                let len = bytes.len();
                bytes[at % len] = value;
            }
            let _ = codec::decode::<FromWorker>(&bytes);
        }
    }

    #[test]
    fn frames_round_trip_and_oversized_frames_are_refused_unread() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let req = CtlRequest::Del { id: Some(4) };
        write_frame(&mut a, &req).unwrap();
        assert_eq!(read_frame::<CtlRequest>(&mut b).unwrap(), req);
        a.write_all(&(u32::MAX).to_le_bytes()).unwrap();
        assert!(matches!(read_frame::<CtlRequest>(&mut b), Err(MsgError::FrameTooLarge { .. })));
        drop(a);
        assert!(matches!(read_frame::<CtlRequest>(&mut b), Err(MsgError::Closed)));
    }

    #[test]
    fn requests_of_older_clients_decode_as_they_did() {
        // Encoded by a ublkctl from before `--force`: `del -n 4` and `shutdown`.
        let del: CtlRequest = codec::decode(&[1, 1, 4]).unwrap();
        assert_eq!(del, CtlRequest::Del { id: Some(4) });
        assert_eq!(codec::decode::<CtlRequest>(&[5]).unwrap(), CtlRequest::Shutdown);
        assert_eq!(codec::encode(&CtlRequest::Del { id: Some(4) }).unwrap(), [1, 1, 4]);
        let forced = CtlRequest::DelForce { id: None };
        assert_eq!(codec::decode::<CtlRequest>(&codec::encode(&forced).unwrap()).unwrap(), forced);
        let forced = CtlRequest::ShutdownForce;
        assert_eq!(codec::decode::<CtlRequest>(&codec::encode(&forced).unwrap()).unwrap(), forced);
        let resize = CtlRequest::Resize { id: 3, size_bytes: 1 << 30, allow_shrink: true };
        assert_eq!(codec::decode::<CtlRequest>(&codec::encode(&resize).unwrap()).unwrap(), resize);
    }

    /// A `status` answer for `n` devices.
    fn status_of(n: u32) -> CtlResponse {
        CtlResponse::Status(
            (0..n)
                .map(|id| DevStatus {
                    id,
                    state: "LIVE".into(),
                    target: "null".into(),
                    worker_pid: Some(1000 + id),
                    standby_pid: Some(2000 + id),
                    sandbox: None,
                    last_recovery_ms: None,
                    last_recovery_reason: Some("worker 1234 killed by signal 9".into()),
                    size_bytes: 1 << 30,
                    queues: 1,
                    queue_depth: 128,
                    threads: 1,
                    recoveries: 1,
                    counters: CounterSnapshot::default(),
                    latency: LatencySnapshot::default(),
                    note: None,
                    failing_io: false,
                    name: None,
                    read_only: false,
                    backing: None,
                })
                .collect(),
        )
    }

    #[test]
    fn a_response_past_the_request_bound_travels_within_its_own() {
        let big = status_of(5000);
        let mut frame = Vec::new();
        write_response(&mut frame, &big).unwrap();
        assert!(frame.len() > MAX_MESSAGE_BYTES + 4, "only {} bytes", frame.len());
        assert_eq!(read_response(&mut frame.as_slice()).unwrap(), big);
        // The same frame is refused where a request is read.
        let err = read_frame::<CtlResponse>(&mut frame.as_slice()).unwrap_err();
        assert!(matches!(err, MsgError::FrameTooLarge { limit: MAX_MESSAGE_BYTES, .. }), "{err}");
        let err = write_frame(&mut Vec::new(), &big).unwrap_err();
        assert!(matches!(err, MsgError::Codec(CodecError::TooLarge { .. })), "{err}");
    }

    #[test]
    fn a_response_frame_over_its_bound_is_refused_before_its_body_is_read() {
        let mut stream = Vec::new();
        stream.extend_from_slice(&(MAX_RESPONSE_BYTES as u32 + 1).to_le_bytes());
        stream.extend_from_slice(&[0; 64]);
        let mut r = stream.as_slice();
        let err = read_response(&mut r).unwrap_err();
        assert!(
            matches!(err, MsgError::FrameTooLarge { len, limit: MAX_RESPONSE_BYTES } if len == MAX_RESPONSE_BYTES + 1),
            "{err}"
        );
        assert_eq!(r.len(), 64, "the body was read");
    }
}
