//! The NBD target's client side in the supervisor: connecting to an export's server
//! (TCP or a unix socket, as its [`NbdUri`] says), the fixed-newstyle handshake
//! (the `handshake` module), and checking that the export can be a kernel block device.
//!
//! The supervisor, not the worker, connects and negotiates: the worker's sandbox has
//! no network and no filesystem, so it is handed the connected socket, already in the
//! transmission phase (structured replies where the server took them and the device
//! asks for them: [`Replies`]), with its device; the kernel device is made from the [`ExportInfo`] (`crate::target::params`).
//!
//! Every step has a deadline ([`connect`]'s `timeout`, for the whole handshake); a
//! server that stalls, talks garbage or sends a huge length gets a one-line
//! [`NbdError`], never a hang or an allocation of its choosing. Host names are
//! resolved by the C library, whose own timeout applies to that step.

pub mod backoff;
mod error;
mod handshake;
pub mod link;
pub mod target;
mod tls;

pub use error::{KERNEL_MIN_REQUEST, NbdError};
pub use tls::close_notify;

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use ublkd_config::{
    DeviceSpec, MAX_BLOCK_SIZE, MAX_SIZE_BYTES, NbdTransport, NbdUri, TargetSpec, format_size,
};
use ublkd_proto::nbd::handshake as handshake_wire;

/// An export's block size constraints, as its server advertised them
/// (`NBD_INFO_BLOCK_SIZE`; proto.md "Block size constraints").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Smallest length and alignment of a request.
    pub min: u32,
    /// Smallest length at which aligned requests are efficient.
    pub preferred: u32,
    /// Longest request, or `u32::MAX` for no limit.
    pub max: u32,
}

/// What the handshake learnt about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// The transmission flags (`NBD_FLAG_*`), see the accessors.
    pub transmission_flags: u16,
    /// The block sizes, if the server advertised any. Without, the protocol's defaults
    /// apply to the server (minimum 1, preferred 4096, maximum unlimited) and a client
    /// keeps to 512-byte alignment and 32 MiB requests.
    pub block_sizes: Option<BlockSizes>,
    /// The server answers with structured replies (`NBD_OPT_STRUCTURED_REPLY`): a
    /// property of the connection, not of the export.
    pub structured_replies: bool,
    /// The connection is TLS (`nbds://`), carried by the kernel's TLS once negotiated.
    pub tls: bool,
    /// The export was chosen with `NBD_OPT_EXPORT_NAME`: the server has no `NBD_OPT_GO`.
    pub export_name_option: bool,
}

impl ExportInfo {
    fn flag(&self, flag: u16) -> bool {
        self.transmission_flags & flag != 0
    }

    /// The server refuses writes.
    pub fn read_only(&self) -> bool {
        self.flag(handshake_wire::FLAG_READ_ONLY)
    }

    /// The server takes `NBD_CMD_FLUSH`.
    pub fn can_flush(&self) -> bool {
        self.flag(handshake_wire::FLAG_SEND_FLUSH)
    }

    /// The server takes `NBD_CMD_FLAG_FUA`.
    pub fn can_fua(&self) -> bool {
        self.flag(handshake_wire::FLAG_SEND_FUA)
    }

    /// The server takes `NBD_CMD_TRIM`.
    pub fn can_trim(&self) -> bool {
        self.flag(handshake_wire::FLAG_SEND_TRIM)
    }

    /// The server takes `NBD_CMD_WRITE_ZEROES`.
    pub fn can_write_zeroes(&self) -> bool {
        self.flag(handshake_wire::FLAG_SEND_WRITE_ZEROES)
    }

    /// Several connections to the export see each other's flushed writes.
    pub fn can_multi_conn(&self) -> bool {
        self.flag(handshake_wire::FLAG_CAN_MULTI_CONN)
    }

    /// The export behaves like a spinning disk.
    pub fn rotational(&self) -> bool {
        self.flag(handshake_wire::FLAG_ROTATIONAL)
    }
}

impl fmt::Display for ExportInfo {
    /// `1 GiB (1073741824 bytes), block sizes 1/4096/4294967295 (min/preferred/max),
    /// read-write, flush, fua, trim, write-zeroes, multi-conn`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} bytes), ", format_size(self.size), self.size)?;
        match self.block_sizes {
            Some(b) => {
                write!(f, "block sizes {}/{}/{} (min/preferred/max)", b.min, b.preferred, b.max)?
            }
            None => f.write_str("no block sizes advertised")?,
        }
        f.write_str(if self.read_only() { ", read-only" } else { ", read-write" })?;
        for (on, name) in [
            (self.can_flush(), "flush"),
            (self.can_fua(), "fua"),
            (self.can_trim(), "trim"),
            (self.can_write_zeroes(), "write-zeroes"),
            (self.can_multi_conn(), "multi-conn"),
            (self.rotational(), "rotational"),
            (self.structured_replies, "structured replies"),
            (self.tls, "TLS 1.2 in the kernel"),
            (self.export_name_option, "chosen with NBD_OPT_EXPORT_NAME (no NBD_OPT_GO)"),
        ] {
            if on {
                write!(f, ", {name}")?;
            }
        }
        Ok(())
    }
}

/// Which replies ublkd asks an NBD server for, on every connection of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replies {
    /// Structured replies where the server takes them (`NBD_OPT_STRUCTURED_REPLY`),
    /// else simple ones: the worker reads both.
    Structured,
    /// Simple replies only: the option is not sent. A READ's simple reply is a 16-byte
    /// header and then exactly the data, so a worker can receive the header on its own
    /// and the data straight into the request's pages, as a zero-copy device's does.
    Simple,
}

/// The export an nbd device of `spec` is made from; `None` for other targets.
pub fn export_uri(spec: &DeviceSpec) -> Option<&NbdUri> {
    match &spec.target {
        TargetSpec::Nbd { uri, .. } => Some(uri),
        _ => None,
    }
}

/// Connects to `uri`'s server and negotiates its export, asking for `replies`, all
/// within `timeout`. Returns the socket, in the transmission phase (no timeouts left set
/// on it), and what the server said about the export, which has been checked to fit a
/// kernel block device.
pub fn connect(
    uri: &NbdUri,
    replies: Replies,
    timeout: Duration,
) -> Result<(OwnedFd, ExportInfo), NbdError> {
    let deadline = Instant::now() + timeout;
    let stream = open(&uri.transport, deadline)?;
    let mut timed = Timed { stream: &stream, deadline };
    let greeting = handshake::greet(&mut timed, timeout)?;
    let info = match &uri.tls {
        None => {
            let info =
                handshake::choose_export(&mut timed, greeting, &uri.export, replies, timeout)?;
            if let Err(error) = fits_kernel(&info) {
                let _ = timed.write_all(&disconnect_request());
                return Err(error);
            }
            info
        }
        Some(settings) => {
            let NbdTransport::Tcp { host, .. } = &uri.transport else {
                // NbdUri refuses nbds+unix: the kernel's TLS is TCP's alone.
                return Err(NbdError::TlsSetup { problem: "TLS needs a TCP connection".into() });
            };
            if !greeting.fixed_newstyle {
                return Err(NbdError::NotFixedNewstyle);
            }
            let mut session = tls::client(settings, host)?;
            handshake::start_tls(&mut timed, timeout)?;
            tls::handshake(&mut session, &mut timed, timeout)?;
            let mut private = rustls::Stream::new(&mut session, &mut timed);
            let info = ExportInfo {
                tls: true,
                ..handshake::choose_export(&mut private, greeting, &uri.export, replies, timeout)?
            };
            // The kernel's TLS is turned on before the keys leave rustls, so that a
            // kernel without it still gets the server a proper goodbye.
            if let Err(error) = fits_kernel(&info).and_then(|()| tls::kernel_tls(stream.as_fd())) {
                let _ = private.write_all(&disconnect_request());
                private.conn.send_close_notify();
                let _ = private.flush();
                return Err(error);
            }
            tls::to_kernel(session, stream.as_fd())?;
            info
        }
    };
    stream
        .clear_timeouts()
        .map_err(|e| NbdError::from_io(e, "finishing the handshake", timeout))?;
    Ok((stream.into(), info))
}

/// Ends a session that [`connect`] opened, the protocol's way (`NBD_CMD_DISC`, and
/// over TLS (`tls`: [`ExportInfo::tls`]) the alert close_notify, then close), so the
/// server logs a clean disconnect rather than a dropped client. Only on a connection
/// nobody else writes to, between requests: one that [`connect`] made and nobody used,
/// or one whose worker exited cleanly (with no request in flight).
pub fn disconnect(socket: OwnedFd, tls: bool) {
    // A 28-byte write to a socket whose send buffer nothing else has used does not
    // block; the fd is closed when `file` drops, whatever the write did. Over the
    // kernel's TLS the write is sealed into a record of application data.
    let mut file = std::fs::File::from(socket);
    if file.write_all(&disconnect_request()).is_ok()
        && tls
        && let Err(e) = close_notify(file.as_fd())
    {
        tracing::debug!("close_notify not sent: {e}");
    }
}

/// Ends connections a dead worker used, so that nothing it sent can still reach the
/// export once its successor serves: the sending side is shut (no bytes added: the dead
/// worker may have left half a request in the stream, which the server then drops as
/// truncated), and what the server still answers is read and thrown away until it
/// closes its side. That orders the dead worker's writes before its successor's for a
/// server that closes only once it has finished the requests it read (not checked for
/// nbdkit or qemu-nbd: see docs/operators-guide.md, "NBD and nbds devices"). A server that has not closed by `deadline` is
/// left to it. Returns how many connections the server closed in time.
pub fn drain(sockets: Vec<OwnedFd>, deadline: Instant) -> usize {
    use nix::sys::socket::{Shutdown, shutdown};
    let mut closed = 0;
    for socket in sockets {
        let fd = socket.as_raw_fd();
        // Already shut, or not connected any more (the server went first): reading
        // tells which.
        let _ = shutdown(fd, Shutdown::Write);
        let mut buf = [0u8; 16 << 10];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match crate::sys::wait_readable(socket.as_fd(), left.min(Duration::from_secs(10))) {
                Ok(false) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(true) => {}
                Err(_) => break,
            }
            match nix::unistd::read(&socket, &mut buf) {
                Ok(0) | Err(_) => {
                    // End of stream, or the connection reset: the server is done with it.
                    closed += 1;
                    break;
                }
                Ok(_) => {}
            }
        }
    }
    closed
}

/// `NBD_CMD_DISC`: magic, flags 0, type, handle 0, offset 0, length 0.
pub(crate) fn disconnect_request() -> [u8; 28] {
    let mut request = [0u8; 28];
    request[..4].copy_from_slice(&ublkd_proto::nbd::REQUEST_MAGIC.to_be_bytes());
    request[6..8].copy_from_slice(&ublkd_proto::nbd::CMD_DISC.to_be_bytes());
    request
}

/// The export fits a ublk device: a non-zero whole number of 512-byte sectors, at most
/// what ublkd's devices can be, and a minimum block size the kernel can take as its
/// logical block size.
fn fits_kernel(info: &ExportInfo) -> Result<(), NbdError> {
    let problem = if info.size == 0 {
        "is zero: an empty export cannot be a block device"
    } else if !info.size.is_multiple_of(512) {
        "is not a multiple of 512: the kernel counts a block device in 512-byte sectors"
    } else if info.size > MAX_SIZE_BYTES {
        "is larger than 2^63 bytes, the largest device ublkd makes"
    } else {
        return match info.block_sizes {
            Some(b) if b.min > MAX_BLOCK_SIZE => Err(NbdError::UnusableBlockSize { min: b.min }),
            Some(b) if b.max < KERNEL_MIN_REQUEST => {
                Err(NbdError::UnusableMaxBlockSize { max: b.max })
            }
            _ => Ok(()),
        };
    };
    Err(NbdError::UnusableSize { size: info.size, problem })
}

/// The logical block size a device on this export has: its configured one, or the
/// export's minimum if that is larger (the least the kernel may send the server).
pub fn device_block_size(info: &ExportInfo, configured: u32) -> u32 {
    configured.max(info.block_sizes.map_or(0, |b| b.min))
}

/// The export fits a device with `configured` logical block size: its size is a whole
/// number of the device's blocks (else the last block's I/O would reach past the
/// export's end, and the server fail it).
pub fn fits_device(info: &ExportInfo, configured: u32) -> Result<(), NbdError> {
    let block_size = device_block_size(info, configured);
    if info.size.is_multiple_of(u64::from(block_size)) {
        Ok(())
    } else {
        Err(NbdError::SizeNotBlocks { size: info.size, block_size })
    }
}

/// A connected socket of either kind.
#[derive(Debug)]
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(timeout).and_then(|()| s.set_write_timeout(timeout)),
            Self::Unix(s) => {
                s.set_read_timeout(timeout).and_then(|()| s.set_write_timeout(timeout))
            }
        }
    }

    fn clear_timeouts(&self) -> io::Result<()> {
        self.set_timeouts(None)
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Self::Tcp(s) => s.as_fd(),
            Self::Unix(s) => s.as_fd(),
        }
    }
}

impl From<Stream> for OwnedFd {
    fn from(stream: Stream) -> OwnedFd {
        match stream {
            Stream::Tcp(s) => s.into(),
            Stream::Unix(s) => s.into(),
        }
    }
}

/// Connects to the server, within `deadline`: each address a host name resolves to in
/// turn, or the unix socket.
fn open(transport: &NbdTransport, deadline: Instant) -> Result<Stream, NbdError> {
    match transport {
        NbdTransport::Unix { socket } => {
            let left = deadline.saturating_duration_since(Instant::now());
            let stream = connect_unix(socket, left).map_err(|source| match source.kind() {
                io::ErrorKind::NotFound => NbdError::NoSocket { path: socket.clone() },
                io::ErrorKind::ConnectionRefused => {
                    NbdError::ConnectionRefused { addr: socket.display().to_string() }
                }
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    NbdError::Timeout { step: "connecting", secs: left.as_secs_f64() }
                }
                _ => NbdError::Connect { addr: socket.display().to_string(), source },
            })?;
            Ok(Stream::Unix(stream))
        }
        NbdTransport::Tcp { host, port } => {
            let addrs: Vec<_> = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(|source| NbdError::Resolve { host: host.clone(), source })?
                .collect();
            let mut last = None;
            for addr in &addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match TcpStream::connect_timeout(addr, left) {
                    Ok(stream) => {
                        // The protocol asks both sides to turn Nagle off: requests are
                        // small and latency-bound.
                        let _ = stream.set_nodelay(true);
                        return Ok(Stream::Tcp(stream));
                    }
                    Err(e) => last = Some((addr, e)),
                }
            }
            let Some((addr, source)) = last else {
                return Err(NbdError::Resolve {
                    host: host.clone(),
                    source: io::Error::new(io::ErrorKind::NotFound, "no address"),
                });
            };
            Err(match source.kind() {
                io::ErrorKind::ConnectionRefused => {
                    NbdError::ConnectionRefused { addr: addr.to_string() }
                }
                // IPAddressDeny= (a cgroup filter: EPERM) or RestrictAddressFamilies=
                // (seccomp: EAFNOSUPPORT for the socket itself).
                _ if matches!(source.raw_os_error(), Some(libc::EPERM | libc::EAFNOSUPPORT)) => {
                    NbdError::Forbidden { addr: addr.to_string(), source }
                }
                _ => NbdError::Connect { addr: addr.to_string(), source },
            })
        }
    }
}

/// Connects to the unix socket at `path`, waiting at most `timeout`: a blocking
/// connect waits while the server's accept backlog is full, for as long as the
/// socket's send timeout allows (`unix_stream_connect` in `net/unix/af_unix.c`), and
/// then fails with EAGAIN; std's `UnixStream::connect` sets none.
fn connect_unix(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr, sockopt};
    use nix::sys::time::{TimeVal, TimeValLike};
    let fd = socket::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    // A zero timeout means "wait for ever" to the kernel: at least a microsecond.
    let micros = i64::try_from(timeout.as_micros()).unwrap_or(i64::MAX).max(1);
    socket::setsockopt(&fd, sockopt::SendTimeout, &TimeVal::microseconds(micros))?;
    socket::connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    Ok(UnixStream::from(fd))
}

/// A stream whose every read and write gives up at `deadline`: each call sets the
/// socket's timeout to the time left.
struct Timed<'a> {
    stream: &'a Stream,
    deadline: Instant,
}

impl Timed<'_> {
    fn arm(&self) -> io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_timeouts(Some(left))
    }
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        match self.stream {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        match self.stream {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(size: u64, min: Option<u32>) -> ExportInfo {
        ExportInfo {
            size,
            transmission_flags: handshake_wire::FLAG_HAS_FLAGS,
            block_sizes: min.map(|min| BlockSizes { min, preferred: 4096, max: u32::MAX }),
            structured_replies: false,
            tls: false,
            export_name_option: false,
        }
    }

    #[test]
    fn only_sizes_and_block_sizes_a_kernel_device_can_have_fit() {
        assert!(fits_kernel(&export(512, None)).is_ok());
        assert!(fits_kernel(&export(MAX_SIZE_BYTES, Some(4096))).is_ok());
        for (size, part) in [
            (0, "is zero"),
            (4097, "not a multiple of 512"),
            (MAX_SIZE_BYTES + 512, "larger than 2^63 bytes"),
        ] {
            let error = fits_kernel(&export(size, None)).unwrap_err().to_string();
            assert!(error.contains(part), "{size}: {error}");
        }
        let error = fits_kernel(&export(1 << 20, Some(8192))).unwrap_err();
        assert!(matches!(error, NbdError::UnusableBlockSize { min: 8192 }));
        // A maximum below a page would have the kernel send requests the server refuses.
        let mut small_max = export(1 << 20, Some(512));
        small_max.block_sizes = Some(BlockSizes { min: 512, preferred: 512, max: 2048 });
        let error = fits_kernel(&small_max).unwrap_err();
        assert!(matches!(error, NbdError::UnusableMaxBlockSize { max: 2048 }), "{error}");
        assert!(error.to_string().contains("2048 bytes, is below 4096"), "{error}");
    }

    #[test]
    fn an_export_fits_a_device_only_in_whole_logical_blocks() {
        let odd = (1 << 20) + 512;
        assert!(fits_device(&export(odd, None), 512).is_ok());
        let error = fits_device(&export(odd, None), 4096).unwrap_err();
        assert!(matches!(error, NbdError::SizeNotBlocks { size, block_size: 4096 } if size == odd));
        assert!(error.to_string().contains("not a multiple of the device's logical block"));
        // The export's minimum raises the device's block size.
        let error = fits_device(&export(odd, Some(4096)), 512).unwrap_err();
        assert!(matches!(error, NbdError::SizeNotBlocks { block_size: 4096, .. }));
        assert!(fits_device(&export(1 << 20, Some(4096)), 512).is_ok());
    }

    #[test]
    fn export_info_reads_as_one_line_with_every_flag_it_has() {
        let mut info = export(1 << 30, Some(512));
        info.transmission_flags |= handshake_wire::FLAG_READ_ONLY | handshake_wire::FLAG_SEND_FLUSH;
        assert_eq!(
            info.to_string(),
            "1G (1073741824 bytes), block sizes 512/4096/4294967295 (min/preferred/max), \
             read-only, flush"
        );
    }

    #[test]
    fn the_disconnect_request_is_nbd_cmd_disc() {
        let request = disconnect_request();
        assert_eq!(request[..4], [0x25, 0x60, 0x95, 0x13]);
        assert_eq!(request[4..8], [0, 0, 0, 2]);
        assert!(request[8..].iter().all(|b| *b == 0));
    }

    #[test]
    fn a_drain_shuts_the_sending_side_and_waits_for_the_server_to_close() {
        // A server that reads to the end of what was sent, answers, and closes.
        let (ours, mut server) = UnixStream::pair().unwrap();
        (&ours).write_all(b"half a request").unwrap();
        let served = std::thread::spawn(move || {
            let mut got = Vec::new();
            server.read_to_end(&mut got).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            server.write_all(&[7; 100]).unwrap();
            got
        });
        let started = Instant::now();
        assert_eq!(drain(vec![OwnedFd::from(ours)], started + Duration::from_secs(5)), 1);
        assert!(started.elapsed() >= Duration::from_millis(200), "did not wait for the close");
        assert_eq!(served.join().unwrap(), b"half a request", "no byte was added to the stream");

        // A server that keeps the connection open is waited for until the deadline only.
        let (ours, server) = UnixStream::pair().unwrap();
        let started = Instant::now();
        assert_eq!(drain(vec![OwnedFd::from(ours)], started + Duration::from_millis(300)), 0);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
        drop(server);
    }
}
