//! An nbd device's connections to its export, as the supervisor makes them for each
//! worker: never on ublkd's loop. Every connection a worker gets (one per queue thread
//! on a multi-conn export) is made and negotiated on a thread of its own, each within
//! `recovery.nbd_handshake_timeout_secs` (the `handshake` arguments), the loop only
//! looking whether they are done ([`nbd_poll_connect`], and for `ublkctl add` the
//! daemon's pending add). A server that
//! answers the first connection of a set but not the others (a proxy, a server at its
//! connection limit) gets the device served over the connections that answered, not a
//! failed add or a recovery that never ends: the device keeps that count ([`NbdLink`]'s
//! `cap`) and its workers are started for it.
//!
//! A zero-copy device is the exception: its worker receives a READ's data straight
//! into the request's pages, which the kernel registered in the ring of the thread that
//! fetched the request, so that thread must be the one reading the connection. Its
//! workers get exactly one connection per thread, each negotiated with simple replies
//! ([`Replies::Simple`]), or none: an export without multi-conn is refused when the
//! device has several threads, and a set that comes back short is ended and tried
//! again later, as when the server cannot be reached, never served over fewer.

use std::os::fd::OwnedFd;
use std::sync::mpsc;
use std::task::Poll;
use std::time::{Duration, Instant};

use ublkd_config::{DeviceSpec, NbdUri};
use ublkd_proto::msg::{DataPath, MAX_NBD_CONNECTIONS};

use super::backoff::Backoff;
use super::{ExportInfo, NbdError, Replies};
use crate::target::error::TargetError;
use crate::target::zero_copy::zero_copy;

/// How long a recovery waits for the server to finish with a dead worker's connections
/// before it connects anyway.
pub const NBD_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// What a connecting thread hands back: the set of connections for one worker (at
/// least one), each with what its handshake said.
type ConnectedSet = Result<Vec<(OwnedFd, ExportInfo)>, NbdError>;

/// An nbd device's link to its export: what the server said when the device was made
/// (or last connected), the connections made ahead for the next worker, and a set being
/// made.
#[derive(Debug, Default)]
pub struct NbdLink {
    pub info: Option<ExportInfo>,
    /// Made ahead for the next worker (at creation, or by a recovery).
    pub sockets: Vec<OwnedFd>,
    connecting: Option<mpsc::Receiver<ConnectedSet>>,
    /// Copies of the connections the serving worker was given: once it is dead they
    /// are drained ([`super::drain`]) before its successor connects.
    pub served: Vec<OwnedFd>,
    /// When the next connection may be made, after connections that broke quickly.
    pub backoff: Backoff,
    /// The most connections a worker gets, once a set came back short: the count that
    /// answered.
    pub cap: Option<u8>,
}

impl NbdLink {
    /// How many connections the next worker of `spec` gets: one per queue thread (the
    /// per-I/O path has one per queue at most), up to [`MAX_NBD_CONNECTIONS`] and the
    /// `cap`, where the export allows several (`NBD_FLAG_CAN_MULTI_CONN`: a flush on one
    /// then covers writes completed on all); else one, which every queue thread shares.
    /// An adopted device whose export ublkd has not talked to yet gets one. A zero-copy
    /// device gets one per thread, always (see the module's doc; no `cap` is kept for
    /// it).
    pub fn connections(&self, spec: &DeviceSpec, data_path: DataPath) -> u8 {
        let wanted = connections_for(spec, self.info.as_ref(), data_path);
        if zero_copy(spec) {
            return wanted;
        }
        self.cap.map_or(wanted, |cap| wanted.min(cap).max(1))
    }

    /// Ends the device's sessions with its server as the device is deleted: the
    /// connections made ahead for a next worker, and, if the serving worker exited
    /// cleanly (`served_cleanly`: every request answered, nothing half sent), its
    /// connections too, each with `NBD_CMD_DISC` (and close_notify over TLS). A worker
    /// that was killed may have left half a request in the stream, after which a
    /// disconnect request would be read as that request's rest: its connections are
    /// only closed. `tls`: the device's URI is `nbds://` (known also for a device
    /// taken over, whose export this ublkd may not have negotiated itself).
    pub fn close(self, served_cleanly: bool, tls: bool) -> usize {
        let mut ended = 0;
        for socket in self.sockets {
            super::disconnect(socket, tls);
            ended += 1;
        }
        if served_cleanly {
            for socket in self.served {
                super::disconnect(socket, tls);
                ended += 1;
            }
        }
        ended
    }

    /// Takes the `n` connections of the next worker from those made ahead; any more are
    /// ended (their worker wants fewer).
    pub fn take_sockets(&mut self, n: u8, tls: bool) -> Option<Vec<OwnedFd>> {
        let n = usize::from(n);
        if self.sockets.len() < n {
            return None;
        }
        let taken: Vec<OwnedFd> = self.sockets.drain(..n).collect();
        for extra in self.sockets.drain(..) {
            super::disconnect(extra, tls);
        }
        Some(taken)
    }
}

/// [`NbdLink::connections`] before the device has a link.
fn connections_for(spec: &DeviceSpec, info: Option<&ExportInfo>, data_path: DataPath) -> u8 {
    if zero_copy(spec) {
        // Zero copy has the batched path, and the config keeps threads within
        // MAX_NBD_CONNECTIONS; an export that does not allow them all is refused where
        // the set is made (`zero_copy_refusal`).
        return spec.settings.threads.clamp(1, u16::from(MAX_NBD_CONNECTIONS)) as u8;
    }
    if !info.is_some_and(ExportInfo::can_multi_conn) {
        return 1;
    }
    let settings = &spec.settings;
    let threads = match data_path {
        DataPath::Batch => settings.threads,
        DataPath::PerIo => settings.threads.min(settings.queues),
    };
    threads.clamp(1, u16::from(MAX_NBD_CONNECTIONS)) as u8
}

/// For an nbd target, connects and negotiates, so that the device is made from what
/// the export is (its size, block sizes, flags), and makes the rest of its first
/// worker's connections (see [`connect_set`]), each within `handshake`. `None` for
/// other targets. Runs on a thread of its own.
pub fn connect_export(
    spec: &DeviceSpec,
    data_path: DataPath,
    handshake: Duration,
) -> Result<Option<NbdLink>, TargetError> {
    let Some(uri) = super::export_uri(spec) else { return Ok(None) };
    let wanted = |info: &ExportInfo| connections_for(spec, Some(info), data_path);
    match connect_set(uri, wanted, replies_for(spec), handshake) {
        Ok(set) => {
            let info = set[0].1;
            if let Err(source) = super::fits_device(&info, spec.settings.block_size) {
                for (socket, other) in set {
                    super::disconnect(socket, other.tls);
                }
                return Err(TargetError::Nbd { uri: uri.to_string(), source: Box::new(source) });
            }
            tracing::info!(uri = %uri, event = "nbd_export", "NBD export: {info}");
            let mut link = NbdLink { info: Some(info), ..NbdLink::default() };
            let want = wanted(&info);
            for (socket, other) in set {
                // Every connection of a set must be the same export.
                if other.size == info.size && other.transmission_flags == info.transmission_flags {
                    link.sockets.push(socket);
                } else {
                    super::disconnect(socket, other.tls);
                }
            }
            if let Some(refused) = zero_copy_refusal(spec, uri, &info, link.sockets.len()) {
                link.sockets.drain(..).for_each(|s| super::disconnect(s, info.tls));
                return Err(refused);
            }
            note_short_set(&mut link, None, uri, want, handshake);
            Ok(Some(link))
        }
        Err(source) => Err(TargetError::Nbd { uri: uri.to_string(), source: Box::new(source) }),
    }
}

/// What every connection of `spec`'s device asks its server for: simple replies for a
/// zero-copy device (whose worker reads a READ's header alone and then its data straight
/// into the request's pages), else structured ones where the server takes them.
fn replies_for(spec: &DeviceSpec) -> Replies {
    if zero_copy(spec) { Replies::Simple } else { Replies::Structured }
}

/// Why a set of `got` connections to `uri`, whose export is `info`, cannot serve
/// `spec`'s device, if it is a zero-copy one that needs one per thread and the export
/// does not allow several (a configuration to change) or fewer answered (a server to
/// try again later). `None` for any other device: it is served over what there is.
fn zero_copy_refusal(
    spec: &DeviceSpec,
    uri: &NbdUri,
    info: &ExportInfo,
    got: usize,
) -> Option<TargetError> {
    if !zero_copy(spec) {
        return None;
    }
    let want = connections_for(spec, Some(info), DataPath::Batch);
    if want > 1 && !info.can_multi_conn() {
        return Some(TargetError::ZeroCopyNbdOneConnection { uri: uri.to_string() });
    }
    (got < usize::from(want)).then(|| TargetError::ZeroCopyNbdConnections {
        uri: uri.to_string(),
        got,
        want,
    })
}

/// If fewer than `want` connections answered (each given `handshake`), caps the
/// device's workers at what did, and says so.
fn note_short_set(
    link: &mut NbdLink,
    id: Option<u32>,
    uri: &NbdUri,
    want: u8,
    handshake: Duration,
) {
    let got = link.sockets.len().min(usize::from(u8::MAX)) as u8;
    if got >= want || got == 0 {
        return;
    }
    link.cap = Some(got);
    tracing::warn!(
        dev_id = id,
        event = "nbd_fewer_connections",
        "the NBD server {uri} answered {got} of the {want} connections its export allows \
         (the others not within {} s): the device is served over {got}",
        handshake.as_secs()
    );
}

/// Connects to `uri` for one worker, every connection asking for `replies`: the first
/// connection (whose failure is the result), then, as many as `wanted` says of its
/// export, the others side by side, each on a thread of its own within `timeout`. One of those that fails is left out (said
/// in the log), so that a server that answers only some connections serves the device
/// over fewer rather than not at all.
fn connect_set(
    uri: &NbdUri,
    wanted: impl FnOnce(&ExportInfo) -> u8,
    replies: Replies,
    timeout: Duration,
) -> ConnectedSet {
    let first = super::connect(uri, replies, timeout)?;
    let want = usize::from(wanted(&first.1).max(1));
    let mut set = vec![first];
    if want == 1 {
        return Ok(set);
    }
    let more: Vec<Result<(OwnedFd, ExportInfo), NbdError>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (1..want)
            .map(|n| {
                std::thread::Builder::new()
                    .name(format!("nbd-conn-{n}"))
                    .spawn_scoped(scope, move || super::connect(uri, replies, timeout))
            })
            .collect();
        threads
            .into_iter()
            .map(|thread| match thread {
                Ok(thread) => thread.join().unwrap_or_else(|_| {
                    Err(NbdError::Connect {
                        addr: uri.to_string(),
                        source: std::io::Error::other("the connecting thread panicked"),
                    })
                }),
                Err(source) => {
                    Err(NbdError::Connect { addr: "a thread to connect".into(), source })
                }
            })
            .collect()
    });
    for (n, connected) in more.into_iter().enumerate() {
        match connected {
            Ok(connected) => set.push(connected),
            Err(e) => tracing::warn!(
                uri = %uri,
                "connection {} of {want} to the NBD server failed: {e}",
                n + 2
            ),
        }
    }
    Ok(set)
}

/// Whether nbd device `id` has the connections for its next worker (which wants
/// `want`), connecting on a thread of its own if not, so that ublkd's loop never waits
/// for a server: `Pending` while that thread connects (ask again soon), else whether it
/// worked; each connection within `handshake`. A set that came back short caps the device's connections ([`NbdLink`]'s
/// `cap`): the caller then starts a worker for that many. A failed try is not retried
/// here: the next call starts a new one.
pub fn nbd_poll_connect(
    id: u32,
    uri: &NbdUri,
    spec: &DeviceSpec,
    link: &mut NbdLink,
    want: u8,
    handshake: Duration,
) -> Poll<Result<(), TargetError>> {
    if !link.sockets.is_empty() {
        return Poll::Ready(Ok(()));
    }
    let Some(rx) = &link.connecting else {
        let (tx, rx) = mpsc::channel();
        let target = uri.clone();
        let dead = std::mem::take(&mut link.served);
        let replies = replies_for(spec);
        let spawned =
            std::thread::Builder::new().name(format!("nbd-connect-{id}")).spawn(move || {
                if !dead.is_empty() {
                    drain_dead_workers(id, dead);
                }
                let wanted = |info: &ExportInfo| if info.can_multi_conn() { want } else { 1 };
                drop(tx.send(connect_set(&target, wanted, replies, handshake)));
            });
        return match spawned {
            Ok(_) => {
                link.connecting = Some(rx);
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(TargetError::Nbd {
                uri: uri.to_string(),
                source: Box::new(NbdError::Connect {
                    addr: "a thread to connect".into(),
                    source: e,
                }),
            })),
        };
    };
    let connected = match rx.try_recv() {
        Ok(connected) => connected,
        Err(mpsc::TryRecvError::Empty) => return Poll::Pending,
        Err(mpsc::TryRecvError::Disconnected) => Err(NbdError::Connect {
            addr: uri.to_string(),
            source: std::io::Error::other("the connecting thread ended without an answer"),
        }),
    };
    link.connecting = None;
    let set = match connected {
        Ok(set) => set,
        Err(source) => {
            return Poll::Ready(Err(TargetError::Nbd {
                uri: uri.to_string(),
                source: Box::new(source),
            }));
        }
    };
    let (multi, set_info) = (set[0].1.can_multi_conn(), set[0].1);
    let mut sockets = Vec::with_capacity(set.len());
    for connected in set {
        match same_export(id, uri, spec, link, connected) {
            Ok(socket) => sockets.push(socket),
            Err(e) => {
                let tls = link.info.is_some_and(|i| i.tls);
                sockets.into_iter().for_each(|s| super::disconnect(s, tls));
                return Poll::Ready(Err(e));
            }
        }
    }
    let info = link.info.unwrap_or(set_info);
    if let Some(refused) = zero_copy_refusal(spec, uri, &info, sockets.len()) {
        sockets.into_iter().for_each(|s| super::disconnect(s, info.tls));
        return Poll::Ready(Err(refused));
    }
    link.sockets = sockets;
    note_short_set(link, Some(id), uri, if multi { want } else { 1 }, handshake);
    Poll::Ready(Ok(()))
}

/// `connected`, if its export is the one nbd device `id` was made from: its size, a
/// minimum block size the device's fits, and every feature the device was made with
/// (the kernel was told of them). Else it is disconnected and the error says both.
fn same_export(
    id: u32,
    uri: &NbdUri,
    spec: &DeviceSpec,
    link: &mut NbdLink,
    (socket, info): (OwnedFd, ExportInfo),
) -> Result<OwnedFd, TargetError> {
    let changed = |what: String| TargetError::NbdChanged { id, uri: uri.to_string(), what };
    if info.size != spec.size_bytes {
        super::disconnect(socket, info.tls);
        return Err(changed(format!(
            "its size is {} bytes, the device's {}",
            info.size, spec.size_bytes
        )));
    }
    let min_grew = info.block_sizes.is_some_and(|b| b.min > spec.settings.block_size);
    let lost_features = link.info.as_ref().is_some_and(|was| {
        // A smaller maximum would refuse requests the kernel was told it may send.
        let max = |i: &ExportInfo| i.block_sizes.map_or(u32::MAX, |b| b.max);
        max(&info) < max(was)
            || (was.can_flush() && !info.can_flush())
            || (was.can_fua() && !info.can_fua())
            || (was.can_trim() && !info.can_trim())
            || (was.can_write_zeroes() && !info.can_write_zeroes())
            || (!was.read_only() && info.read_only())
    });
    if min_grew || lost_features {
        let was = link.info.as_ref().map_or_else(|| "unknown".to_string(), |w| w.to_string());
        super::disconnect(socket, info.tls);
        return Err(changed(format!("it was {was}; now it is {info}")));
    }
    link.info = Some(info);
    Ok(socket)
}

/// Drains a dead worker's connections (see [`super::drain`]) and says how it went: a
/// write it sent must not reach the export after its successor's.
fn drain_dead_workers(id: u32, sockets: Vec<OwnedFd>) {
    let (n, started) = (sockets.len(), Instant::now());
    let closed = super::drain(sockets, started + NBD_DRAIN_TIMEOUT);
    let ms = started.elapsed().as_millis() as u64;
    if closed == n {
        tracing::info!(
            dev_id = id,
            event = "nbd_drained",
            drain_ms = ms,
            "the server finished with the dead worker's {n} connection(s) in {ms} ms"
        );
    } else {
        tracing::warn!(
            dev_id = id,
            event = "nbd_drain_timeout",
            "the server did not close {} of the dead worker's {n} connection(s) within {} s; \
             connecting anyway (a request the dead worker sent could still reach the export \
             late)",
            n - closed,
            NBD_DRAIN_TIMEOUT.as_secs()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ublkd_config::{DeviceSettings, TargetSpec};
    use ublkd_proto::nbd::handshake::{FLAG_CAN_MULTI_CONN, FLAG_HAS_FLAGS};

    fn nbd_spec(zero_copy: Option<bool>, threads: u16) -> DeviceSpec {
        DeviceSpec {
            id: None,
            target: TargetSpec::Nbd { uri: "nbd://127.0.0.1/x".parse().unwrap(), zero_copy },
            size_bytes: 0,
            settings: DeviceSettings { queues: 2, threads, ..DeviceSettings::default() },
            attrs: Default::default(),
        }
    }

    fn export(multi_conn: bool) -> ExportInfo {
        let multi = if multi_conn { FLAG_CAN_MULTI_CONN } else { 0 };
        ExportInfo {
            size: 1 << 30,
            transmission_flags: FLAG_HAS_FLAGS | multi,
            block_sizes: None,
            structured_replies: false,
            tls: false,
            export_name_option: false,
        }
    }

    #[test]
    fn a_zero_copy_device_gets_one_connection_per_thread_with_simple_replies() {
        let zc = nbd_spec(Some(true), 4);
        let uri: NbdUri = "nbd://127.0.0.1/x".parse().unwrap();
        let link = NbdLink { info: Some(export(true)), cap: Some(2), ..NbdLink::default() };
        // Never capped, and the per-I/O path's one per queue does not apply.
        assert_eq!(link.connections(&zc, DataPath::Batch), 4);
        assert_eq!(connections_for(&zc, None, DataPath::PerIo), 4, "even before a link");
        assert_eq!(replies_for(&zc), Replies::Simple);
        assert!(zero_copy_refusal(&zc, &uri, &export(true), 4).is_none());
        // A copying device on the same link is capped, and asks for structured replies.
        assert_eq!(link.connections(&nbd_spec(None, 4), DataPath::Batch), 2);
        assert_eq!(replies_for(&nbd_spec(Some(false), 4)), Replies::Structured);
    }

    #[test]
    fn a_zero_copy_device_with_threads_refuses_an_export_without_multi_conn() {
        let uri: NbdUri = "nbd://127.0.0.1/x".parse().unwrap();
        let refused = zero_copy_refusal(&nbd_spec(Some(true), 2), &uri, &export(false), 1);
        let message = refused.expect("refused").to_string();
        assert_eq!(
            message,
            "zero copy needs one connection per thread; the export nbd://127.0.0.1/x does not \
             allow several connections (no NBD_FLAG_CAN_MULTI_CONN): set threads = 1 or turn \
             zero_copy off"
        );
        // One thread needs one connection, which any export allows.
        assert!(zero_copy_refusal(&nbd_spec(Some(true), 1), &uri, &export(false), 1).is_none());
        // A copying device shares the one connection.
        assert!(zero_copy_refusal(&nbd_spec(None, 2), &uri, &export(false), 1).is_none());
    }

    #[test]
    fn a_zero_copy_device_is_never_served_over_a_short_set() {
        let uri: NbdUri = "nbd://127.0.0.1/x".parse().unwrap();
        let refused = zero_copy_refusal(&nbd_spec(Some(true), 4), &uri, &export(true), 3);
        assert!(
            matches!(refused, Some(TargetError::ZeroCopyNbdConnections { got: 3, want: 4, .. })),
            "{refused:?}"
        );
        // A copying device is served over what answered.
        assert!(zero_copy_refusal(&nbd_spec(None, 4), &uri, &export(true), 3).is_none());
    }

    #[test]
    fn a_deleted_devices_sessions_end_with_a_disconnect_only_if_its_worker_exited_cleanly() {
        use std::io::Read;
        use std::os::unix::net::UnixStream;
        // What the server reads on each connection once the link is closed.
        let read_all = |mut s: UnixStream| {
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            got
        };
        let disc = super::super::disconnect_request();
        for served_cleanly in [true, false] {
            let (ahead, ahead_server) = UnixStream::pair().unwrap();
            let (served, served_server) = UnixStream::pair().unwrap();
            let link = NbdLink {
                sockets: vec![ahead.into()],
                served: vec![served.into()],
                ..NbdLink::default()
            };
            assert_eq!(link.close(served_cleanly, false), 1 + usize::from(served_cleanly));
            // The connection nobody used is always between requests.
            assert_eq!(read_all(ahead_server), disc);
            // A killed worker may have left half a request: nothing is added to it.
            let want = if served_cleanly { disc.to_vec() } else { Vec::new() };
            assert_eq!(read_all(served_server), want, "served_cleanly {served_cleanly}");
        }
    }

    #[test]
    fn a_short_set_of_connections_caps_the_workers_connections() {
        let mut link = NbdLink::default();
        let uri: NbdUri = "nbd://127.0.0.1:10809".parse().unwrap();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        link.sockets.push(a.into());
        note_short_set(&mut link, Some(3), &uri, 8, Duration::from_secs(10));
        assert_eq!(link.cap, Some(1));
        note_short_set(&mut link, Some(3), &uri, 1, Duration::from_secs(10));
        assert_eq!(link.cap, Some(1), "a full set leaves the cap");
    }
}
