//! An nbd device's target as a device keeps it between workers: the one place where a
//! device does anything particular to NBD. A device asks it five things:
//!
//! - what to prepare before a worker is handed the device: its connections, made on a
//!   thread, after a server that keeps breaking them has waited out its backoff
//!   ([`NbdTarget::poll_ready`]);
//! - what to hand the next worker ([`NbdTarget::hand_over`]), and what to keep of it
//!   ([`NbdTarget::keep_served`], [`NbdTarget::took_over`]);
//! - what a worker's death means: a connection the server broke within a few seconds
//!   of a reconnect lengthens the backoff ([`NbdTarget::after_death`]);
//! - when a silent server makes a worker count as hung ([`NbdTarget::silent_server`]);
//! - how to close: `NBD_CMD_DISC` on each connection that can take one, and TLS's
//!   close_notify ([`NbdTarget::close`]).
//!
//! The connections themselves are [`NbdLink`]'s (`link.rs`), the handshake the parent
//! module's.

use std::os::fd::OwnedFd;
use std::task::Poll;
use std::time::{Duration, Instant};

use ublkd_config::{DeviceSpec, NbdUri};
use ublkd_proto::msg::DataPath;

use super::backoff::QUICK_BREAK;
use super::link::{NbdLink, nbd_poll_connect};
use super::{ExportInfo, NbdError, export_uri};
use crate::state::ExportRecord;
use crate::target::error::TargetError;
use crate::worker::Worker;

/// The longest a recovery waits between two tries to reach its server.
pub const NBD_RETRY_MAX: Duration = Duration::from_secs(2);
/// How often a recovery looks whether its connecting thread is done.
const NBD_CONNECT_POLL: Duration = Duration::from_millis(20);

/// An nbd device's export and its connections.
#[derive(Debug)]
pub struct NbdTarget {
    uri: NbdUri,
    link: NbdLink,
    /// How long a recovery waits before its next try to reach an unreachable server
    /// (doubling up to [`NBD_RETRY_MAX`]).
    retry_delay: Duration,
}

/// Where a recovery's connections stand ([`NbdTarget::poll_ready`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Readiness {
    /// The next worker's connections are made: `made` of them.
    Ready { made: usize },
    /// Not yet: try again at `until`; `why` is what status says meanwhile, if anything
    /// is held up outside ublkd.
    Waiting { until: Instant, why: Option<String> },
    /// The server has been away past `recovery.nbd_server_wait_secs`: the device is to
    /// fail I/O, for this cause.
    GaveUp { cause: String },
}

impl NbdTarget {
    /// The target of a device made from `spec`, if it is an nbd device: with `link` if
    /// its export was negotiated already (an add), else to learn it at its next
    /// connection (an adopted device).
    pub fn for_spec(spec: &DeviceSpec, link: Option<NbdLink>) -> Option<NbdTarget> {
        let uri = export_uri(spec)?;
        Some(NbdTarget {
            uri: uri.clone(),
            link: link.unwrap_or_default(),
            retry_delay: Duration::ZERO,
        })
    }

    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }

    /// What the server said when the device was made (or last connected).
    pub fn info(&self) -> Option<&ExportInfo> {
        self.link.info.as_ref()
    }

    /// What an adopted device was made from, as its record says: a server that comes
    /// back without a feature the kernel was told of is refused.
    pub fn adopt_export(&mut self, export: ExportRecord) {
        self.link.info = Some(export.info());
    }

    /// How many connections the next worker of `spec` gets (see
    /// [`NbdLink::connections`]).
    pub fn connections(&self, spec: &DeviceSpec, data_path: DataPath) -> u8 {
        self.link.connections(spec, data_path)
    }

    /// For a recovery that started at `started` and whose next worker wants `want`
    /// connections: whether they are made, connecting on a thread if not. A server
    /// that keeps breaking connections is waited for (its backoff); one that is not
    /// there (restarting, say) is tried again, less and less often (up to every
    /// [`NBD_RETRY_MAX`]), for as long as it takes, or until `wait_limit`
    /// (`recovery.nbd_server_wait_secs`), each connection within `handshake`. `said`:
    /// what status says of the recovery so far (a change is logged).
    #[allow(clippy::too_many_arguments)]
    pub fn poll_ready(
        &mut self,
        id: u32,
        spec: &DeviceSpec,
        want: u8,
        started: Instant,
        wait_limit: Option<Duration>,
        handshake: Duration,
        said: Option<&str>,
    ) -> Readiness {
        let now = Instant::now();
        if let Some(until) = self.link.backoff.waiting_until(now) {
            let why = format!(
                "its NBD server keeps breaking connections ({} in a row within {} s of \
                 being served): the next connection is made in {} s; its I/O is held",
                self.link.backoff.quick_breaks(),
                QUICK_BREAK.as_secs(),
                until.duration_since(now).as_secs_f64().ceil() as u64
            );
            return Readiness::Waiting { until, why: Some(why) };
        }
        match nbd_poll_connect(id, &self.uri, spec, &mut self.link, want, handshake) {
            Poll::Ready(Ok(())) => {
                self.retry_delay = Duration::ZERO;
                if said.is_some() {
                    tracing::info!(
                        dev_id = id,
                        event = "nbd_reconnected",
                        "reconnected to {}",
                        self.uri
                    );
                }
                Readiness::Ready { made: self.link.sockets.len() }
            }
            Poll::Pending => Readiness::Waiting { until: now + NBD_CONNECT_POLL, why: None },
            Poll::Ready(Err(e)) if wait_limit.is_some_and(|limit| started.elapsed() >= limit) => {
                let waited = started.elapsed().as_secs();
                let cause = format!(
                    "its NBD server has been out of reach for {waited} s ({e}); every I/O \
                     fails with EIO (recovery.nbd_server_wait_secs): once the server is \
                     back, run `ublkctl recover {id}`"
                );
                tracing::error!(dev_id = id, event = "nbd_gave_up", "{cause}");
                Readiness::GaveUp { cause }
            }
            Poll::Ready(Err(e)) => {
                let why = format!(
                    "waiting for the NBD server ({e}); its I/O is held, and ublkd tries \
                     again every {} s at most",
                    NBD_RETRY_MAX.as_secs()
                );
                if said != Some(why.as_str()) {
                    // A zero-copy device that cannot have one connection per thread
                    // waits like one whose server is away, but the operator may have
                    // to change it: an error, not a warning.
                    if matches!(
                        e,
                        TargetError::ZeroCopyNbdOneConnection { .. }
                            | TargetError::ZeroCopyNbdConnections { .. }
                    ) {
                        tracing::error!(dev_id = id, event = "nbd_zero_copy_connections", "{why}");
                    } else {
                        tracing::warn!(dev_id = id, event = "nbd_unreachable", "{why}");
                    }
                }
                self.retry_delay =
                    (self.retry_delay * 2).clamp(Duration::from_millis(100), NBD_RETRY_MAX);
                Readiness::Waiting { until: now + self.retry_delay, why: Some(why) }
            }
        }
    }

    /// The `connections` a worker is handed with its device, from those made ahead
    /// (any more are ended).
    pub fn hand_over(&mut self, connections: u8) -> Result<Vec<OwnedFd>, TargetError> {
        let made = self.link.sockets.len();
        self.link.take_sockets(connections, self.uri.tls.is_some()).ok_or_else(|| {
            TargetError::Nbd {
                uri: self.uri.to_string(),
                source: Box::new(NbdError::Connect {
                    addr: self.uri.to_string(),
                    source: std::io::Error::other(format!(
                        "{made} connection(s) made for a worker that wants {connections}"
                    )),
                }),
            }
        })
    }

    /// Keeps copies of the connections a worker was handed: once it is dead they are
    /// drained before its successor connects (a previous worker's go now).
    pub fn keep_served(&mut self, sockets: Vec<OwnedFd>) {
        self.link.served = sockets;
    }

    /// For a worker a previous ublkd left serving device `id`, taken over: copies of
    /// its connections, as if this ublkd had handed them.
    pub fn took_over(&mut self, id: u32, worker: &Worker) {
        self.link.served = worker.copy_nbd_connections(&self.uri.transport);
        tracing::info!(
            dev_id = id,
            event = "nbd_connections_copied",
            "holding copies of the taken-over worker's {} connection(s) to the NBD server",
            self.link.served.len()
        );
    }

    /// What the death (seen at `seen`) of device `id`'s worker, which served for
    /// `served_for`, means: a connection the server broke (`backend_lost`) soon after
    /// it was made counts as a failed connect, so the next one waits longer.
    pub fn after_death(
        &mut self,
        id: u32,
        backend_lost: bool,
        served_for: Option<Duration>,
        seen: Instant,
    ) {
        // Any other death ends the run of quick breaks.
        let served_for = if backend_lost { served_for } else { None };
        if let Some(wait) = self.link.backoff.broke(served_for, seen) {
            tracing::warn!(
                dev_id = id,
                event = "nbd_breaking",
                "the NBD server {} keeps breaking connections ({} in a row within {} s of \
                 being served): the next connection waits {} s; the device's I/O is held",
                self.uri,
                self.link.backoff.quick_breaks(),
                QUICK_BREAK.as_secs(),
                wait.as_secs()
            );
        }
    }

    /// Why a worker whose requests have waited for the server for `quiet` counts as
    /// hung, if past `request_timeout` (`recovery.nbd_request_timeout_secs`): a server
    /// that answers nothing is a broken connection.
    pub fn silent_server(&self, quiet: Duration, request_timeout: Duration) -> Option<String> {
        (quiet >= request_timeout).then(|| {
            format!(
                "its NBD server {} has answered no request for {:.0} s \
                 (recovery.nbd_request_timeout_secs = {}): the connection counts as broken, \
                 and a fresh worker reconnects and re-issues the requests (the I/O is held)",
                self.uri,
                quiet.as_secs_f64(),
                request_timeout.as_secs()
            )
        })
    }

    /// Ends device `id`'s sessions with its server as it is deleted (see
    /// [`NbdLink::close`]): `served_cleanly` if its worker exited with every request
    /// answered.
    pub fn close(self, id: u32, served_cleanly: bool) {
        let ended = self.link.close(served_cleanly, self.uri.tls.is_some());
        if ended > 0 {
            tracing::info!(
                dev_id = id,
                event = "nbd_disconnected",
                "ended {ended} session(s) with the NBD server (NBD_CMD_DISC)"
            );
        }
    }
}
