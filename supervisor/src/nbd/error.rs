//! Why an NBD export could not be connected to or used: [`NbdError`], whose messages
//! are what an operator reads (after the URI) in `ublkctl add`'s answer, status and
//! the journal.

use std::io;
use std::path::PathBuf;

use ublkd_config::MAX_BLOCK_SIZE;

/// Why an export could not be connected to or used. Messages are sentences that say
/// what went wrong and, where there is one, what to do; callers prefix the URI.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// The host name did not resolve.
    #[error("cannot resolve host {host}: {source}")]
    Resolve {
        /// The host as written.
        host: String,
        /// Why.
        source: io::Error,
    },
    /// Nothing listens at the address.
    #[error("the connection to {addr} was refused: no NBD server listens there (is it running?)")]
    ConnectionRefused {
        /// The address or socket path.
        addr: String,
    },
    /// The unix socket does not exist.
    #[error("there is no socket at {}: no NBD server listens there (is it running?)", path.display())]
    NoSocket {
        /// The socket path.
        path: PathBuf,
    },
    /// The kernel refused ublkd the connection itself: under the packaged systemd unit,
    /// its network is closed but to the servers the config names.
    #[error(
        "connecting to {addr} is not permitted ({source}): under systemd, ublkd's unit \
         reaches only the addresses of the nbd:// devices in /etc/ublkd/ublkd.toml (its \
         generator allows them at `systemctl daemon-reload`, for ublkd's next start) and \
         any IPAddressAllow= of your own drop-in"
    )]
    Forbidden { addr: String, source: io::Error },
    /// Connecting failed otherwise.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address or socket path.
        addr: String,
        /// Why.
        source: io::Error,
    },
    /// A step took longer than the handshake's time limit.
    #[error("the server did not answer within {secs} s while {step}")]
    Timeout {
        /// What ublkd was doing.
        step: &'static str,
        /// The limit, in seconds.
        secs: f64,
    },
    /// The server closed the connection.
    #[error("the server closed the connection while {step}")]
    Closed {
        /// What ublkd was doing.
        step: &'static str,
    },
    /// Another I/O error.
    #[error("I/O error while {step}: {source}")]
    Io {
        /// What ublkd was doing.
        step: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The peer's first bytes are not `NBDMAGIC`.
    #[error("the server's greeting does not start with NBDMAGIC: it is not an NBD server")]
    NotNbd,
    /// The peer uses the oldstyle handshake.
    #[error(
        "oldstyle servers are not supported (the oldstyle handshake has no export names and \
         cannot report errors); serve the export with the newstyle handshake, the default \
         of nbdkit, qemu-nbd and nbd-server"
    )]
    Oldstyle,
    /// The peer speaks newstyle but not fixed newstyle, and TLS was asked for.
    #[error(
        "the server does not offer fixed newstyle negotiation, without which it cannot \
         start TLS; use nbd:// if the export is meant to be reached without TLS"
    )]
    NotFixedNewstyle,
    /// The server closed the connection on `NBD_OPT_EXPORT_NAME`.
    #[error(
        "the server closed the connection when asked for the export {export:?} with \
         NBD_OPT_EXPORT_NAME (it has no NBD_OPT_GO, so it cannot say why): it has no such \
         export, or it refuses this client"
    )]
    ExportNameRefused {
        /// The name ublkd asked for.
        export: String,
    },
    /// `NBD_REP_ERR_UNKNOWN`.
    #[error("the server has no export named {export:?}{}", suffix(message))]
    UnknownExport {
        /// The name ublkd asked for.
        export: String,
        /// The server's message, if any.
        message: String,
    },
    /// `NBD_REP_ERR_TLS_REQD`.
    #[error(
        "the server requires TLS{}; use an nbds:// URI with tls-certificates=DIR",
        suffix(message)
    )]
    TlsRequired {
        /// The server's message, if any.
        message: String,
    },
    /// An error reply to `NBD_OPT_STARTTLS`.
    #[error(
        "the server does not offer TLS (it answered NBD_OPT_STARTTLS with {reply}{}); \
         use nbd:// if the export is meant to be reached without it",
        suffix(message)
    )]
    NoTls {
        /// The reply type's name.
        reply: String,
        /// The server's message, if any.
        message: String,
    },
    /// A certificate or key file is missing or unusable.
    #[error("{} {problem}", path.display())]
    TlsFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// The TLS session could not be set up.
    #[error("cannot set up TLS: {problem}")]
    TlsSetup {
        /// Why.
        problem: String,
    },
    /// TLS failed during the handshake or the options inside it.
    #[error("TLS failed while {step}: {error}{hint}")]
    Tls {
        /// What ublkd was doing.
        step: &'static str,
        /// The TLS library's error.
        error: rustls::Error,
        /// What to check, if anything obvious.
        hint: &'static str,
    },
    /// The kernel refused the TLS session.
    #[error("{step} failed: {source}; {hint}")]
    KernelTls {
        /// What ublkd asked the kernel.
        step: &'static str,
        /// Why it refused.
        source: io::Error,
        /// What to check.
        hint: &'static str,
    },
    /// `NBD_REP_ERR_SHUTDOWN`.
    #[error("the server is shutting down{}", suffix(message))]
    ShuttingDown {
        /// The server's message, if any.
        message: String,
    },
    /// Another error reply.
    #[error("the server refused {option} with {reply}{}", suffix(message))]
    Refused {
        /// The option.
        option: &'static str,
        /// The reply type's name.
        reply: String,
        /// The server's message, if any.
        message: String,
    },
    /// The server broke the protocol.
    #[error("the server broke the NBD protocol: {problem}")]
    Protocol {
        /// What it did.
        problem: String,
    },
    /// The export's size cannot be a block device's.
    #[error("the export's size, {size} bytes, {problem}")]
    UnusableSize {
        /// The size the server gave.
        size: u64,
        /// Why the kernel cannot take it.
        problem: &'static str,
    },
    /// The export's minimum block size is larger than any logical block size.
    #[error(
        "the export's minimum block size, {min} bytes, is larger than {MAX_BLOCK_SIZE}, the \
         largest logical block size the kernel takes"
    )]
    UnusableBlockSize {
        /// The server's minimum block size.
        min: u32,
    },
    /// The export's largest request is smaller than the least the kernel may send.
    #[error(
        "the export's maximum block size, {max} bytes, is below {KERNEL_MIN_REQUEST}: the \
         kernel sends a block device requests of up to a page, which the server would \
         refuse"
    )]
    UnusableMaxBlockSize {
        /// The server's maximum block size.
        max: u32,
    },
    /// The export's size is not a whole number of the device's logical blocks.
    #[error(
        "the export's size, {size} bytes, is not a multiple of the device's logical block \
         size ({block_size} bytes): its last block would reach past the export's end"
    )]
    SizeNotBlocks {
        /// The size the server gave.
        size: u64,
        /// The device's logical block size (its configured one, or the export's minimum
        /// if larger).
        block_size: u32,
    },
}

/// The least a block device's requests may be limited to (a page: the kernel refuses
/// a device whose `max_sectors` is smaller).
pub const KERNEL_MIN_REQUEST: u32 = 4096;

fn suffix(message: &str) -> String {
    if message.is_empty() { String::new() } else { format!(": {message}") }
}

impl NbdError {
    /// Whether the server answered with a refusal during option haggling, after which
    /// the protocol wants the client's soft disconnect (`NBD_OPT_ABORT`).
    pub(super) fn server_refused(&self) -> bool {
        matches!(
            self,
            Self::UnknownExport { .. }
                | Self::TlsRequired { .. }
                | Self::NoTls { .. }
                | Self::ShuttingDown { .. }
                | Self::Refused { .. }
        )
    }
}
