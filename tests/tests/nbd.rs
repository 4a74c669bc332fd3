//! The nbd target through the real `ublkd`, `ublkctl` and kernel: devices served from
//! an NBD server's export, with real servers (nbdkit and qemu-nbd, installed by
//! `tests/vm/install-host-deps.sh` and seen by the guest through the shared host root).
//! What must hold: data written through `/dev/ublkbN` is what the server stores; a
//! worker killed under load, and the server itself restarted under load, each cost a
//! recovery with the I/O held, never an I/O error; and a server that is not there is
//! named without a kernel device being made. Runs inside the test VM.

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ublkd_proto::uapi::UBLK_F_AUTO_BUF_REG;
use ublkd_tests::harness::fio::{Fio, assert_fio_clean, fio_verify_args};
use ublkd_tests::harness::machine::{block_dev, kernel_devices, serial, wait_for_path};
use ublkd_tests::harness::process::{bin, describe, run, signal};
use ublkd_tests::harness::storage::{Mount, pattern, sha256, sparse_file, write_file};
use ublkd_tests::harness::ublkd::{StatusProber, Ublkd};
use ublkd_tests::proxy::{Endpoint, OneAtATimeProxy};

const MIB: u64 = 1 << 20;
/// The bound on a time-based fio that a test stops itself once the kills, restarts or
/// outages it brackets are over and verified I/O followed.
const FIO_CAP: &str = "--runtime=600";
/// Requests a device serves between two blows: fio is mid-run at each.
const IOS_BETWEEN: u64 = 300;
/// Requests a device serves after the last blow before fio is stopped: about half are
/// writes, so the writes around it are then behind fio's verify backlog (256) twice
/// over, and verified. (2000 before: over TCP on a loaded TCG host they took 19.6 s of
/// the test's 55.6 s, and TLS served its first 300 requests 2.4 times slower.)
const IOS_AFTER: u64 = 1000;
/// How long the server stays away in the restart tests, at least: several of
/// ublkd's reconnects fail meanwhile.
const MIN_OUTAGE: Duration = Duration::from_secs(2);
/// The NBD handshake's time limit (`recovery.nbd_handshake_timeout_secs`, 10 s by
/// default) where a test waits it out against a silent server.
const HANDSHAKE_SECS: u64 = 4;
/// The same, in the reload test, where another device must be LIVE within it.
const RELOAD_HANDSHAKE_SECS: u64 = 6;
/// How long the breaking server breaks every connection: past four steps of the
/// reconnect backoff (1 s, doubling).
const BREAKING_FOR: Duration = Duration::from_secs(16);

/// The config lines that set the NBD handshake's time limit.
fn handshake_limit(secs: u64) -> String {
    format!("\n[recovery]\nnbd_handshake_timeout_secs = {secs}\n")
}

/// Where a test's nbdkit listens.
#[derive(Debug, Clone, Copy)]
enum Listen {
    Tcp(u16),
    Unix(&'static str),
    /// TCP with TLS required, with the certificates of [`tls_certificates`].
    Tls(u16),
}

/// What a test's nbdkit offers besides its file plugin.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Offer {
    /// NBD_FLAG_CAN_MULTI_CONN, as the file plugin does: a connection per queue thread.
    MultiConn,
    /// The multi-conn filter hides the plugin's NBD_FLAG_CAN_MULTI_CONN, so ublkd gives
    /// the worker one connection for all its queue threads.
    OneConnection,
    /// `--mask-handshake=0`: newstyle without the fixed extension, as servers older than
    /// NBD_OPT_GO spoke it: the export is chosen with NBD_OPT_EXPORT_NAME, with simple
    /// replies and no advertised block sizes.
    NoFixedNewstyle,
}

/// Where [`tls_certificates`] puts them.
const PKI: &str = "/tmp/ublkd-test-pki";

/// Makes throwaway certificates in [`PKI`] (tests/vm/make-tls-certs.sh): `server/` for
/// nbdkit, `client/` for ublkd.
fn tls_certificates() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/make-tls-certs.sh");
    let _ = std::fs::remove_dir_all(PKI);
    let status = Command::new("sh").arg(&script).arg(PKI).status().expect("run sh");
    assert!(status.success(), "{} failed: {status}", script.display());
}

/// A counter of /proc/net/tls_stat, the kernel's TLS sockets.
fn tls_stat(name: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/net/tls_stat")
        .unwrap_or_else(|e| panic!("/proc/net/tls_stat: {e}: the kernel's TLS is not loaded"));
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /proc/net/tls_stat:\n{text}"))
}

/// An NBD server process, killed on drop.
struct Server {
    child: Child,
    uri: String,
    /// Where its stderr goes.
    log: PathBuf,
}

impl Server {
    /// `program args`, once it has written `pid_file` (both servers write it once they
    /// listen, so no probing connection is needed), reached at `uri`.
    fn start(program: &str, args: &[&str], pid_file: &Path, uri: String) -> Server {
        let _ = std::fs::remove_file(pid_file);
        let log = pid_file.with_extension("log");
        let stderr =
            std::fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {program} ({e}): install it with tests/vm/install-host-deps.sh")
            });
        let mut server = Server { child, uri, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read(pid_file).is_ok_and(|pid| pid.ends_with(b"\n")) {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("{program} exited before it listened: {status}\n{}", server.log_text());
            }
            assert!(Instant::now() < deadline, "{program} did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// nbdkit's file plugin serving `image` where `listen` says, one thread per
    /// connection: with several, nbdkit 1.32 (Debian 12's) can abort when a client dies
    /// while it writes a reply (`raw_send_socket: Assertion 'sock >= 0' failed`, seen
    /// here when a worker was killed), and these tests kill clients on purpose.
    fn nbdkit(listen: Listen, image: &Path, offer: Offer) -> Server {
        let (pid_file, mut args, uri) = match listen {
            Listen::Tcp(port) => (
                PathBuf::from(format!("/tmp/ublkd-test-nbdkit-{port}.pid")),
                vec!["-i".to_string(), "127.0.0.1".into(), "-p".into(), port.to_string()],
                format!("nbd://127.0.0.1:{port}"),
            ),
            Listen::Unix(socket) => {
                let _ = std::fs::remove_file(socket);
                (
                    PathBuf::from(format!("{socket}.pid")),
                    vec!["-U".to_string(), socket.to_string()],
                    format!("nbd+unix:///?socket={socket}"),
                )
            }
            Listen::Tls(port) => (
                PathBuf::from(format!("/tmp/ublkd-test-nbdkit-{port}.pid")),
                vec![
                    "-i".to_string(),
                    "127.0.0.1".into(),
                    "-p".into(),
                    port.to_string(),
                    "--tls=require".into(),
                    format!("--tls-certificates={PKI}/server"),
                ],
                format!("nbds://127.0.0.1:{port}/?tls-certificates={PKI}/client"),
            ),
        };
        args.extend(["-f", "--exit-with-parent", "--threads=1"].map(String::from));
        args.extend(["-P".to_string(), pid_file.display().to_string()]);
        match offer {
            Offer::MultiConn => {}
            Offer::OneConnection => args.push("--filter=multi-conn".into()),
            Offer::NoFixedNewstyle => args.push("--mask-handshake=0".into()),
        }
        args.extend(["file".to_string(), format!("file={}", image.display())]);
        if offer == Offer::OneConnection {
            args.push("multi-conn-mode=disable".into());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Server::start("nbdkit", &args, &pid_file, uri)
    }

    /// An export of `size` bytes on `socket` that takes writes but offers neither
    /// FLUSH nor FUA (nbdkit's eval plugin with no flush script), and fails every
    /// request: a server that came back as less than it was.
    fn without_flush(socket: &str, size: u64) -> Server {
        let _ = std::fs::remove_file(socket);
        let pid_file = format!("{socket}.pid");
        let get_size = format!("get_size=echo {size}");
        let args = ["-U", socket, "-f", "--exit-with-parent", "-P", &pid_file, "eval", &get_size];
        let args = [&args[..], &["pread=exit 1", "pwrite=exit 1"]].concat();
        Server::start(
            "nbdkit",
            &args,
            Path::new(&pid_file),
            format!("nbd+unix:///?socket={socket}"),
        )
    }

    /// What the server has written to its stderr so far.
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// qemu-nbd serving `image` (`format`) on the unix socket `socket`, one client at a
    /// time (its default), staying up when a client goes (`--persistent`).
    fn qemu_nbd(socket: &Path, image: &Path, format: &str) -> Server {
        let _ = std::fs::remove_file(socket);
        let pid_file = socket.with_extension("pid");
        let args = [
            "--persistent",
            &format!("--format={format}"),
            "--cache=none",
            &format!("--socket={}", socket.display()),
            &format!("--pid-file={}", pid_file.display()),
            image.to_str().unwrap(),
        ];
        let uri = format!("nbd+unix:///?socket={}", socket.display());
        Server::start("qemu-nbd", &args, &pid_file, uri)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until device `id` has had `n` recoveries and is LIVE again.
fn wait_recovered(ublkd: &Ublkd, id: u32, n: u64) {
    ublkd.wait_until(&format!("device {id} recovered {n} times"), || {
        let dev = ublkd.status_of(id);
        dev["recoveries"].as_u64() >= Some(n) && dev["state"] == "LIVE"
    });
}

fn write_at(dev: &Path, offset: u64, data: &[u8]) {
    let mut f = OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(dev).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    // O_DIRECT wants an aligned buffer: a Vec of u64s is 8-aligned, not enough; copy
    // into a page-aligned one.
    let mut buf = AlignedBuf::new(data.len());
    buf.as_mut().copy_from_slice(data);
    f.write_all(buf.as_ref())
        .unwrap_or_else(|e| panic!("writing {} at {offset}: {e}", dev.display()));
}

fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = std::fs::File::open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut data = vec![0; len];
    f.read_exact(&mut data).unwrap();
    data
}

/// A page-aligned heap buffer, for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(4096), 4096).unwrap()
    }

    fn new(len: usize) -> AlignedBuf {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(len)) };
        assert!(!ptr.is_null());
        AlignedBuf { ptr, len }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of at least `len` bytes, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of at least `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) };
    }
}

/// Established TCP connections to 127.0.0.1:`port` (`/proc/net/tcp`: the remote
/// address's port, state 01).
fn connections_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let remote = format!("0100007F:{port:04X}");
    table
        .lines()
        .filter(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            fields.get(2) == Some(&remote.as_str()) && fields.get(3) == Some(&"01")
        })
        .count()
}

/// The connections nbdkit accepted on the unix socket `path`: the server's ends carry
/// the socket's path in /proc/net/unix, connected (state 03); a client's end is
/// unbound and shows none.
fn unix_connections_to(path: &str) -> usize {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            fields.get(7) == Some(&path) && fields.get(5) == Some(&"03")
        })
        .count()
}

/// A configured nbd device comes up LIVE with its export's size; fio writes and
/// verifies it while its worker is SIGKILLed three times and then nbdkit itself is
/// stopped for 3 s and started again: every kill and the server's absence cost a
/// recovery with the I/O held, fio sees no error and no corrupt block, and the device
/// reads back identical to the server's file. Over TCP with a connection per queue
/// thread (multi-conn), and over a unix socket with one connection both queue threads
/// share (the export without multi-conn): the second connection's reader posts the
/// other thread's results into its ring.
fn fio_verify_survives_three_worker_kills_and_a_server_restart(listen: Listen) {
    let file = PathBuf::from("/tmp/ublkd-test-nbd-fio.img");
    sparse_file(&file, 96 * MIB);
    let multi_conn = !matches!(listen, Listen::Unix(_));
    let offer = if multi_conn { Offer::MultiConn } else { Offer::OneConnection };
    let tls = matches!(listen, Listen::Tls(_));
    if tls {
        tls_certificates();
    }
    let nbdkit = Server::nbdkit(listen, &file, offer);
    let ublkd = Ublkd::start_with(
        "nbd-fio",
        &format!(
            "\n[[device]]\nid = 3\ntarget = \"nbd\"\nuri = \"{}\"\nqueues = 2\nthreads = 2\n",
            nbdkit.uri
        ),
        &[],
    );
    let id = 3;
    let dev = ublkd.status_of(id);
    assert_eq!((dev["state"].as_str(), dev["target"].as_str()), (Some("LIVE"), Some("nbd")));
    assert_eq!(dev["size_bytes"].as_u64(), Some(96 * MIB), "{dev}");
    let connections = || match listen {
        Listen::Tcp(port) | Listen::Tls(port) => connections_to(port),
        Listen::Unix(path) => unix_connections_to(path),
    };
    // With multi-conn one connection per queue thread, else one both threads share.
    let want_connections = if multi_conn { 2 } else { 1 };
    assert_eq!(connections(), want_connections, "the worker's connections to nbdkit");
    let node = block_dev(id);
    wait_for_path(&node);

    let mut args = fio_verify_args("nbd-fio", &node, "randwrite", 2, 32 * MIB);
    // Time-based, so fio is still writing when the server goes away, reading back and
    // checking its writes as it goes (every 256); stopped once all that it brackets
    // happened and verified I/O followed ([`FIO_CAP`] is only a bound).
    args.extend(["--time_based", FIO_CAP, "--verify_backlog=256"].map(String::from));
    let fio = Fio::spawn(args);
    for kill in 1..=3 {
        ublkd.wait_for_ios(id, IOS_BETWEEN);
        let pid = ublkd.worker_pid(id);
        assert!(signal(pid, libc::SIGKILL), "worker {pid} is gone");
        wait_recovered(&ublkd, id, kill);
    }
    ublkd.wait_for_ios(id, IOS_BETWEEN);
    drop(nbdkit);
    let away = Instant::now();
    ublkd.wait_until("ublkd to wait for the NBD server", || {
        ublkd.log().contains("waiting for the NBD server")
    });
    // Away for a while (the outage is the subject): several of ublkd's reconnects
    // (100 ms, doubling) find no server.
    std::thread::sleep(MIN_OUTAGE.saturating_sub(away.elapsed()));
    let dev = ublkd.status_of(id);
    assert_ne!(dev["state"], "LIVE", "LIVE without its server: {dev}");
    eprintln!("while the server is away: {} ({})", dev["state"], dev["note"]);
    let nbdkit = Server::nbdkit(listen, &file, offer);
    wait_recovered(&ublkd, id, 4);
    let outage = away.elapsed();
    ublkd.wait_for_ios(id, IOS_AFTER);
    let jobs = fio.interrupt().unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    assert_fio_clean(&jobs, 2);
    let dev = ublkd.status_of(id);
    assert_eq!(dev["recoveries"].as_u64(), Some(4), "{dev}");
    assert_eq!(connections(), want_connections, "the last worker's connections to nbdkit");
    assert_eq!(dev["errors"].as_u64(), Some(0), "{dev}");
    let log = ublkd.log();
    assert!(log.contains("lost its connection to the NBD server"), "{log}");
    assert!(log.contains("waiting for the NBD server"), "{log}");
    // Each dead worker's connections were ended and drained before its successor's.
    assert!(log.contains("the server finished with the dead worker's"), "{log}");
    let export = log.lines().find(|l| l.contains("NBD export:")).unwrap_or_else(|| panic!("{log}"));
    // nbdkit answers in chunks (NBD_OPT_STRUCTURED_REPLY), which the worker reads.
    assert!(export.contains("structured replies"), "{export}");
    assert_eq!(export.contains("multi-conn"), multi_conn, "{export}");
    assert_eq!(export.contains("TLS 1.2 in the kernel"), tls, "{export}");
    if tls {
        // The worker's sockets are the kernel's TLS sockets (nbdkit's TLS is GnuTLS's,
        // in user space): what crossed the wire was encrypted, and what fio verified
        // came back through the kernel's decryption.
        for counter in ["TlsCurrTxSw", "TlsCurrRxSw"] {
            assert_eq!(tls_stat(counter), want_connections as u64, "{counter}");
        }
        assert_eq!(tls_stat("TlsDecryptError"), 0, "TlsDecryptError");
        eprintln!("kernel TLS: {} sessions opened", tls_stat("TlsTxSw"));
    }
    eprintln!(
        "3 worker kills and a {:.1} s server outage under fio ({listen:?}); last stall {} ms",
        outage.as_secs_f64(),
        dev["last_recovery_ms"]
    );
    assert_eq!(sha256(&node), sha256(&file), "the device does not read back as the server's file");
    // Deleting the device ends its sessions the protocol's way (NBD_CMD_DISC, and over
    // TLS close_notify), so the server reports no broken session: nbdkit logs
    // "gnutls_record_recv: The TLS connection was non-properly terminated" for a TLS
    // client that just closes.
    let before = nbdkit.log_text().len();
    ublkd.del(id);
    let deadline = Instant::now() + Duration::from_secs(10);
    while connections() > 0 {
        assert!(Instant::now() < deadline, "nbdkit still has connections 10 s after del");
        std::thread::sleep(Duration::from_millis(50));
    }
    let said = ublkd.log();
    assert!(said.contains("session(s) with the NBD server (NBD_CMD_DISC)"), "{said}");
    let logged = nbdkit.log_text();
    let since = logged.get(before..).unwrap_or_default();
    assert!(!since.contains("error"), "nbdkit after the device was deleted:\n{since}");
    drop(nbdkit);
    ublkd.stop();
    let _ = std::fs::remove_file(&file);
}

#[test]
fn fio_verify_over_tcp_survives_three_worker_kills_and_a_server_restart() {
    let _serial = serial();
    fio_verify_survives_three_worker_kills_and_a_server_restart(Listen::Tcp(10_809));
}

#[test]
fn fio_verify_over_tls_survives_three_worker_kills_and_a_server_restart() {
    let _serial = serial();
    fio_verify_survives_three_worker_kills_and_a_server_restart(Listen::Tls(10_811));
}

#[test]
fn fio_verify_over_a_unix_socket_shared_by_two_threads_survives_kills_and_a_server_restart() {
    let _serial = serial();
    fio_verify_survives_three_worker_kills_and_a_server_restart(Listen::Unix(
        "/tmp/ublkd-test-nbdkit.sock",
    ));
}

/// Zero copy (`--zero-copy`): a READ's data is received straight into the request's
/// pages and a WRITE's sent from them, over a connection per queue thread with simple
/// replies. fio writes and verifies (4k-128k) while the worker is SIGKILLed twice; the
/// device reads back as the server's file, and the worker's report shows the data went
/// through the registered pages and none through its receive buffer. Where the kernel
/// cannot (6.12: no AUTO_BUF_REG, no BATCH_IO), the add is refused, saying why, and no
/// device is left.
#[test]
fn zero_copy_verifies_across_worker_kills_with_the_data_in_the_requests_pages() {
    let _serial = serial();
    let file = PathBuf::from("/tmp/ublkd-test-nbd-zero-copy.img");
    sparse_file(&file, 64 * MIB);
    let nbdkit = Server::nbdkit(Listen::Tcp(10_813), &file, Offer::MultiConn);
    let ublkd = Ublkd::start_with("nbd-zero-copy", "", &[("UBLKD_LOG", "info")]);
    let args = ["-t", "nbd", "--uri", &nbdkit.uri, "--zero-copy", "-q", "2", "--threads", "2"];
    if ublkd.zero_copy_refused(&args, "UBLK_F_AUTO_BUF_REG") {
        ublkd.stop();
        let _ = std::fs::remove_file(&file);
        return;
    }
    let id = ublkd.add(&args);
    assert_ne!(ublkd.kernel_flags(id) & UBLK_F_AUTO_BUF_REG, 0, "not a zero-copy device");
    assert_eq!(connections_to(10_813), 2, "one connection per queue thread");
    let node = block_dev(id);
    let mut args = fio_verify_args("nbd-zc", &node, "randwrite", 2, 24 * MIB);
    args.extend(["--time_based", FIO_CAP, "--verify_backlog=256"].map(String::from));
    let fio = Fio::spawn(args);
    for kill in 1..=2 {
        ublkd.wait_for_ios(id, IOS_BETWEEN);
        let pid = ublkd.worker_pid(id);
        assert!(signal(pid, libc::SIGKILL), "worker {pid} is gone");
        wait_recovered(&ublkd, id, kill);
    }
    ublkd.wait_for_ios(id, IOS_AFTER);
    let jobs = fio.interrupt().unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    assert_fio_clean(&jobs, 2);
    let dev = ublkd.status_of(id);
    assert_eq!(dev["errors"].as_u64(), Some(0), "{dev}");
    assert_eq!(sha256(&node), sha256(&file), "the device does not read back as the server's file");
    let log = ublkd.log();
    let export = log.lines().find(|l| l.contains("NBD export:")).unwrap_or_else(|| panic!("{log}"));
    assert!(!export.contains("structured replies"), "zero copy asked for chunks: {export}");
    ublkd.del(id);
    // The last worker's report, as it ends: data through the registered pages both ways,
    // none copied out of the receive buffer.
    let log = ublkd.log();
    let reports: Vec<&str> =
        log.lines().filter(|l| l.contains("KiB of READ data copied")).collect();
    assert_eq!(reports.len(), 2, "one report per connection:\n{log}");
    let kib = |line: &str, before: &str| -> u64 {
        let at = line.find(before).unwrap_or_else(|| panic!("{before:?} not in {line}"));
        let n = line[..at].trim_end().rsplit(' ').next().unwrap();
        n.parse().unwrap_or_else(|e| panic!("{n:?} in {line}: {e}"))
    };
    for report in reports {
        assert_eq!(kib(report, "KiB of READ data copied"), 0, "{report}");
        assert!(kib(report, "KiB of READ data received into") > 0, "{report}");
        assert!(kib(report, "KiB of WRITE data sent from") > 0, "{report}");
    }
    drop(nbdkit);
    ublkd.stop();
    let _ = std::fs::remove_file(&file);
}

/// A server that is not there is named, and no kernel device is made for it.
#[test]
fn a_missing_server_is_named_and_makes_no_device() {
    let _serial = serial();
    let ublkd = Ublkd::start("nbd-missing");
    let before = kernel_devices();
    let missing = "nbd+unix:///?socket=/tmp/ublkd-test-nbd-missing.sock";
    let out = ublkd.ctl(&["add", "-t", "nbd", "--uri", missing]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains(&format!("cannot use the nbd export {missing}: there is no socket")),
        "{}",
        describe(&out)
    );
    assert_eq!(kernel_devices(), before, "a kernel device was made");
    ublkd.stop();
}

/// Writes `chunks` 0 and 1 on either side of a worker kill, then stops `server` with
/// nothing in flight: the next write (chunk 2) finds the connection broken, its worker
/// ends, and the write must wait, not fail, until `restart` brings a server back.
/// Returns the new server, with the device recovered twice.
fn written_across_a_worker_kill_and_a_server_restart(
    ublkd: &Ublkd,
    id: u32,
    chunks: &[(u64, Vec<u8>)],
    server: Server,
    restart: impl FnOnce() -> Server,
) -> Server {
    let node = block_dev(id);
    write_at(&node, chunks[0].0, &chunks[0].1);
    assert!(signal(ublkd.worker_pid(id), libc::SIGKILL));
    wait_recovered(ublkd, id, 1);
    write_at(&node, chunks[1].0, &chunks[1].1);
    drop(server);
    let writer = {
        let (node, (offset, data)) = (node.clone(), chunks[2].clone());
        std::thread::spawn(move || write_at(&node, offset, &data))
    };
    std::thread::sleep(Duration::from_secs(2));
    assert!(!writer.is_finished(), "a write completed while the server was down");
    let server = restart();
    writer.join().expect("the write held across the server's restart failed");
    wait_recovered(ublkd, id, 2);
    server
}

/// Every chunk is in the server's `image` at its offset.
fn assert_chunks_stored(image: &Path, chunks: &[(u64, Vec<u8>)]) {
    for (i, (offset, data)) in chunks.iter().enumerate() {
        let stored = read_at(image, *offset, data.len());
        assert!(stored == *data, "chunk {i} at {offset} is not in the server's file");
    }
}

/// qemu-nbd, one client at a time, on a raw file: what is written through the device
/// is in the file. Its worker is killed (the next connection must wait for qemu-nbd to
/// let the dead one go), then qemu-nbd itself is killed while a write waits and started
/// again two seconds later: the worker ends on the broken connection, ublkd keeps the
/// device's I/O held and reconnects once the server is back, and the write completes.
/// Then ublkd restarts and takes the serving worker over, connection and all.
#[test]
fn a_qemu_nbd_file_holds_what_was_written_across_a_worker_kill_and_a_server_restart() {
    let _serial = serial();
    let raw = PathBuf::from("/tmp/ublkd-test-nbd.img");
    sparse_file(&raw, 64 * MIB);
    let socket = PathBuf::from("/tmp/ublkd-test-qemu-nbd.sock");
    let server = Server::qemu_nbd(&socket, &raw, "raw");
    let mut ublkd = Ublkd::start("nbd-qemu");
    let id = ublkd.add(&["-t", "nbd", "--uri", &server.uri]);
    let node = block_dev(id);
    let chunks: Vec<(u64, Vec<u8>)> =
        (0..4).map(|i| (i * 8 * MIB + 4096 * i, pattern(100 + i, MIB as usize))).collect();

    let server =
        written_across_a_worker_kill_and_a_server_restart(&ublkd, id, &chunks, server, || {
            Server::qemu_nbd(&socket, &raw, "raw")
        });
    // ublkd itself restarts (SIGTERM, as systemd's restart): the worker serves on, its
    // connection with it, and the next ublkd takes it over (its record names the export).
    let serving = ublkd.worker_pid(id);
    ublkd.signal_and_restart(libc::SIGTERM, || {});
    ublkd.wait_until("the device taken over", || {
        ublkd.ctl.device(id).is_ok_and(|d| d["state"] == "LIVE")
    });
    assert_eq!(ublkd.worker_pid(id), serving, "the restarted ublkd did not take the worker over");
    // An upgrade hands the device to a new worker, which needs a connection of its own
    // (qemu-nbd serves one client at a time: the taken-over worker's is drained first);
    // it answers once the device is served.
    let out = ublkd.ctl(&["upgrade", "-n", &id.to_string()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "upgrade failed: {text}\n{}", ublkd.log());
    assert!(text.contains(&format!("device {id}: upgraded to")), "{text}");
    let dev = ublkd.status_of(id);
    assert_eq!(dev["state"], "LIVE", "{dev}");
    assert_ne!(ublkd.worker_pid(id), serving, "the upgrade left the old worker serving");
    eprintln!("upgrade: {}", text.trim());
    write_at(&node, chunks[3].0, &chunks[3].1);
    // Read back past the page cache, across the end of chunk 0 into the file's hole:
    // qemu-nbd answers such a read with a data chunk and a hole chunk (structured
    // replies), which must land as the data and as zeroes.
    let across = read_at_direct(&node, MIB - 256 * 1024, 512 * 1024);
    assert!(
        across[..256 * 1024] == chunks[0].1[MIB as usize - 256 * 1024..],
        "data before the hole"
    );
    assert!(across[256 * 1024..].iter().all(|&b| b == 0), "the hole does not read as zeroes");

    let dev = ublkd.status_of(id);
    assert_eq!(dev["errors"].as_u64(), Some(0), "{dev}");
    let log = ublkd.log();
    assert!(log.contains("lost its connection to the NBD server"), "{log}");
    assert!(log.contains("structured replies"), "qemu-nbd offers them: {log}");
    // Everything reached qemu-nbd's file (--cache=none, and the device is gone).
    ublkd.del(id);
    drop(server);
    assert_chunks_stored(&raw, &chunks);
    ublkd.stop();
    let _ = std::fs::remove_file(&raw);
}

/// A server without NBD_OPT_GO (nbdkit `--mask-handshake=0`: newstyle without the fixed
/// extension, as older servers speak it) is served: the export is chosen with
/// NBD_OPT_EXPORT_NAME and answered with simple replies. A worker kill, and the server
/// stopped while a write waits and started again, each reconnect the same way, and the
/// server's file holds every write.
#[test]
fn a_server_without_nbd_opt_go_is_served_and_reconnected_with_nbd_opt_export_name() {
    let _serial = serial();
    const SOCKET: &str = "/tmp/ublkd-test-nbdkit-plain.sock";
    let file = PathBuf::from("/tmp/ublkd-test-nbd-plain.img");
    sparse_file(&file, 32 * MIB);
    let server = Server::nbdkit(Listen::Unix(SOCKET), &file, Offer::NoFixedNewstyle);
    let ublkd = Ublkd::start("nbd-plain");
    let id = ublkd.add(&["-t", "nbd", "--uri", &server.uri]);
    let chunks: Vec<(u64, Vec<u8>)> =
        (0..3).map(|i| (i * 4 * MIB + 4096 * i, pattern(200 + i, 256 * 1024))).collect();

    let server =
        written_across_a_worker_kill_and_a_server_restart(&ublkd, id, &chunks, server, || {
            Server::nbdkit(Listen::Unix(SOCKET), &file, Offer::NoFixedNewstyle)
        });

    let dev = ublkd.status_of(id);
    assert_eq!(dev["errors"].as_u64(), Some(0), "{dev}");
    let log = ublkd.log();
    let export = log.lines().find(|l| l.contains("NBD export:")).unwrap_or_else(|| panic!("{log}"));
    assert!(export.contains("chosen with NBD_OPT_EXPORT_NAME"), "{export}");
    assert!(!export.contains("structured replies"), "{export}");
    assert!(export.contains("no block sizes advertised"), "{export}");
    ublkd.del(id);
    drop(server);
    assert_chunks_stored(&file, &chunks);
    ublkd.stop();
    let _ = std::fs::remove_file(&file);
}

/// An ext4 filesystem on a qcow2 image served by qemu-nbd: made, filled while its
/// worker is killed, while ublkd itself is stopped and started again, and while the
/// worker the new ublkd took over is killed; unmounted, checked clean by fsck, and every
/// file read back.
#[test]
fn ext4_on_a_qcow2_export_stays_clean_across_worker_kills_and_a_ublkd_restart() {
    let _serial = serial();
    let qcow2 = PathBuf::from("/tmp/ublkd-test-nbd.qcow2");
    let created =
        run(Command::new("qemu-img").args(["create", "-q", "-f", "qcow2"]).arg(&qcow2).arg("128M"));
    assert!(created.status.success(), "qemu-img create: {}", describe(&created));
    let server = Server::qemu_nbd(Path::new("/tmp/ublkd-test-qcow2.sock"), &qcow2, "qcow2");
    let mut ublkd = Ublkd::start("nbd-qcow2");
    let id = ublkd.add(&["-t", "nbd", "--uri", &server.uri]);
    let node = block_dev(id);
    let mkfs = run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&node));
    assert!(mkfs.status.success(), "mkfs.ext4: {}", describe(&mkfs));
    let mnt = PathBuf::from("/tmp/ublkd-test-nbd-mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mount = Mount::new(&node, &mnt);
    let files: Vec<(PathBuf, Vec<u8>)> = (0..8)
        .map(|i| (mnt.join(format!("f{i}")), pattern(i + 40, (i as usize + 1) * 300_001)))
        .collect();
    // Files are written across a worker kill; while ublkd is stopped (SIGTERM: the
    // worker serves the mounted filesystem on without it); and across a kill of the
    // worker the restarted ublkd took over, which it recovers onto a fresh connection.
    for (i, (path, data)) in files.iter().enumerate() {
        if i == 5 {
            let serving = ublkd.worker_pid(id);
            ublkd.signal_and_restart(libc::SIGTERM, || write_file(path, data));
            assert_eq!(ublkd.worker_pid(id), serving, "the new ublkd did not take the worker over");
        } else {
            write_file(path, data);
        }
        if i == 3 {
            assert!(signal(ublkd.worker_pid(id), libc::SIGKILL));
            wait_recovered(&ublkd, id, 1);
        }
        if i == 6 {
            let taken_over = ublkd.worker_pid(id);
            assert!(signal(taken_over, libc::SIGKILL));
            ublkd.wait_until("the taken-over worker's device recovered", || {
                let dev = ublkd.status_of(id);
                dev["state"] == "LIVE" && dev["worker_pid"].as_u64() != Some(taken_over.into())
            });
        }
    }
    let synced = run(Command::new("sync").arg("-f").arg(&mnt));
    assert!(synced.status.success(), "sync: {}", describe(&synced));
    mount.umount();
    let fsck = run(Command::new("fsck.ext4").arg("-fn").arg(&node));
    assert_eq!(fsck.status.code(), Some(0), "fsck.ext4 -fn found problems:\n{}", describe(&fsck));
    let mount = Mount::new(&node, &mnt);
    for (path, data) in &files {
        assert!(std::fs::read(path).unwrap() == *data, "{} differs", path.display());
    }
    mount.umount();
    assert_eq!(ublkd.status_of(id)["errors"].as_u64(), Some(0));
    // The restarted ublkd copied the taken-over worker's connection (the previous
    // ublkd's copy went with it), and drained it when that worker was killed, as the
    // first ublkd drained its own worker's: both recoveries waited for qemu-nbd to end
    // the dead worker's session.
    let log = ublkd.log();
    assert!(log.contains("holding copies of the taken-over worker's 1 connection(s)"), "{log}");
    let drained = log.matches("the server finished with the dead worker's 1 connection(s)").count();
    assert_eq!(drained, 2, "drains of a dead worker's connection:\n{log}");
    ublkd.stop();
    drop(server);
    let _ = std::fs::remove_file(&qcow2);
}

/// A device keeps what its export was across a ublkd restart (its record in the state
/// dir): a server that comes back without FLUSH and FUA, which the kernel was told the
/// device has, is refused and named by the next ublkd as by this one; the device's I/O
/// is held until the server offers the export again, and nothing is lost.
#[test]
fn an_export_that_drops_flush_across_a_ublkd_restart_is_refused_and_named() {
    let _serial = serial();
    let file = PathBuf::from("/tmp/ublkd-test-nbd-fua.img");
    sparse_file(&file, 16 * MIB);
    let socket = "/tmp/ublkd-test-nbd-fua.sock";
    let nbdkit = Server::nbdkit(Listen::Unix(socket), &file, Offer::MultiConn);
    let mut ublkd = Ublkd::start("nbd-fua");
    let id = ublkd.add(&["-t", "nbd", "--uri", &nbdkit.uri]);
    let log = ublkd.log();
    assert!(log.contains(", flush, fua"), "the export did not offer FUA:\n{log}");
    let node = block_dev(id);
    write_at(&node, 0, &pattern(7, 65536));
    // ublkd stops (the worker would serve on), and meanwhile the server comes back
    // without FLUSH: the worker's connection broke, so the next ublkd reconnects.
    let mut without_flush = None;
    ublkd.signal_and_restart(libc::SIGTERM, || {
        drop(nbdkit);
        without_flush = Some(Server::without_flush(socket, 16 * MIB));
    });
    ublkd.wait_until("the changed export refused", || {
        let note = ublkd.status_of(id)["note"].as_str().unwrap_or_default().to_string();
        note.contains(&format!("is no longer what device {id} was made from"))
    });
    let dev = ublkd.status_of(id);
    let note = dev["note"].as_str().unwrap();
    assert!(note.contains("flush, fua") && note.contains("its I/O is held"), "{dev}");
    assert_ne!(dev["state"], "LIVE", "{dev}");
    eprintln!("the restarted ublkd says: {note}");
    // A read meanwhile is held, not failed, and completes once the export is back.
    let reader = std::thread::spawn(move || read_at_direct(&node, 0, 65536));
    std::thread::sleep(Duration::from_secs(1));
    assert!(!reader.is_finished(), "a read completed while the device had no server");
    drop(without_flush);
    let _nbdkit = Server::nbdkit(Listen::Unix(socket), &file, Offer::MultiConn);
    assert!(reader.join().unwrap() == pattern(7, 65536), "the data did not survive");
    wait_recovered(&ublkd, id, 1);
    assert_eq!(ublkd.status_of(id)["errors"].as_u64(), Some(0));
    ublkd.stop();
    let _ = std::fs::remove_file(&file);
}

/// A server that keeps its connections up but answers nothing (SIGSTOPped) holds no
/// I/O for ever: past `recovery.nbd_request_timeout_secs` the connection counts as
/// broken, the worker is replaced and the request re-issued on a fresh connection once
/// the server answers again; the read completes with its data, nothing fails, and the
/// budget of crashes is not touched (`restart_max = 1`).
#[test]
fn a_server_that_answers_nothing_past_the_request_timeout_is_reconnected() {
    let _serial = serial();
    let file = PathBuf::from("/tmp/ublkd-test-nbd-silent.img");
    sparse_file(&file, 16 * MIB);
    let socket = "/tmp/ublkd-test-nbd-silent.sock";
    let nbdkit = Server::nbdkit(Listen::Unix(socket), &file, Offer::MultiConn);
    let ublkd = Ublkd::start_with(
        "nbd-silent",
        "\n[recovery]\nhung_timeout_secs = 2\nnbd_request_timeout_secs = 3\nrestart_max = 1\n",
        &[],
    );
    let id = ublkd.add(&["-t", "nbd", "--uri", &nbdkit.uri]);
    let node = block_dev(id);
    write_at(&node, 0, &pattern(11, 65536));
    let first = ublkd.worker_pid(id);
    assert!(signal(nbdkit.child.id(), libc::SIGSTOP));
    let stopped = Instant::now();
    let reader = std::thread::spawn(move || read_at_direct(&node, 0, 65536));
    ublkd.wait_until("the silent server's worker replaced", || {
        ublkd.log().contains("event=\"nbd_request_timeout\"")
    });
    let noticed = stopped.elapsed();
    assert!(noticed >= Duration::from_secs(3), "replaced after {noticed:?}, before the timeout");
    std::thread::sleep(Duration::from_secs(2));
    assert!(!reader.is_finished(), "the read finished while the server answered nothing");
    assert!(signal(nbdkit.child.id(), libc::SIGCONT));
    assert!(reader.join().unwrap() == pattern(11, 65536), "the re-issued read's data differs");
    wait_recovered(&ublkd, id, 1);
    let dev = ublkd.status_of(id);
    assert_ne!(dev["worker_pid"].as_u64(), Some(first.into()), "{dev}");
    assert_eq!(dev["errors"].as_u64(), Some(0), "{dev}");
    let reason = dev["last_recovery_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("has answered no request for"), "{dev}");
    // Lost connections take nothing from the budget: the next crash still recovers.
    assert!(signal(ublkd.worker_pid(id), libc::SIGKILL));
    wait_recovered(&ublkd, id, 2);
    eprintln!("replaced {noticed:?} after the server stopped answering: {reason}");
    ublkd.stop();
    drop(nbdkit);
    let _ = std::fs::remove_file(&file);
}

/// Server restarts do not use up the restart budget (meant for crashing workers): with
/// `restart_max = 1`, three in a row are three recoveries. With
/// `recovery.nbd_server_wait_secs`, a server that stays away is waited for that long,
/// then the device fails its I/O with EIO (status says why), and `ublkctl recover`
/// serves it again once the server is back.
#[test]
fn a_server_away_past_nbd_server_wait_secs_fails_io_until_recover() {
    let _serial = serial();
    let file = PathBuf::from("/tmp/ublkd-test-nbd-wait.img");
    sparse_file(&file, 16 * MIB);
    let port = 10_810;
    let mut nbdkit = Server::nbdkit(Listen::Tcp(port), &file, Offer::MultiConn);
    let ublkd = Ublkd::start_with(
        "nbd-wait",
        "\n[recovery]\nnbd_server_wait_secs = 3\nrestart_max = 1\n",
        &[],
    );
    let id = ublkd.add(&["-t", "nbd", "--uri", &nbdkit.uri]);
    let node = block_dev(id);
    write_at(&node, 0, &pattern(5, 65536));
    for restart in 1..=3 {
        drop(nbdkit);
        nbdkit = Server::nbdkit(Listen::Tcp(port), &file, Offer::MultiConn);
        wait_recovered(&ublkd, id, restart);
        assert!(read_at_direct(&node, 0, 65536) == pattern(5, 65536));
    }

    drop(nbdkit);
    let t = Instant::now();
    let read = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&node)
        .and_then(|mut f| f.read_exact(AlignedBuf::new(65536).as_mut()));
    let waited = t.elapsed();
    let e = read.expect_err("a read succeeded with the server gone past the wait limit");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(waited >= Duration::from_secs(3), "failed after {waited:?}, before the 3 s limit");
    let dev = ublkd.status_of(id);
    assert_eq!(dev["failing_io"], true, "{dev}");
    let note = dev["note"].as_str().unwrap_or_default();
    assert!(note.contains("its NBD server has been out of reach for"), "{dev}");
    assert!(note.contains(&format!("ublkctl recover {id}")), "{dev}");
    eprintln!("the read failed after {waited:?}: {note}");

    // A recover while the server is still away fails at once, saying what it waits
    // for (the device's I/O is held meanwhile): `recover && mount` must not go on.
    let t = Instant::now();
    let out = ublkd.ctl.run(&["recover", &id.to_string()]);
    let took = t.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "recover with the server away: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(stderr.contains("not recovered yet: waiting for the NBD server"), "{stderr}");
    assert!(took < Duration::from_secs(10), "recover answered after {took:?}");
    eprintln!("recover with the server away failed after {took:?}: {}", stderr.trim());

    let _nbdkit = Server::nbdkit(Listen::Tcp(port), &file, Offer::MultiConn);
    ublkd.ctl_ok(&["recover", &id.to_string()]);
    let dev = ublkd.status_of(id);
    assert_eq!((dev["state"].as_str(), dev["failing_io"].as_bool()), (Some("LIVE"), Some(false)));
    assert!(read_at_direct(&node, 0, 65536) == pattern(5, 65536), "the data did not survive");
    ublkd.stop();
    let _ = std::fs::remove_file(&file);
}

/// `len` bytes at `offset` of the device, read past the page cache.
fn read_at_direct(dev: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(dev).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut buf = AlignedBuf::new(len);
    f.read_exact(buf.as_mut()).unwrap();
    buf.as_ref().to_vec()
}

/// A server at `socket` that accepts every connection and never says a word.
fn silent_unix_server(socket: &Path) {
    let _ = std::fs::remove_file(socket);
    let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
    // Accepts, and keeps every connection open without a word.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            held.push(conn);
        }
    });
}

/// Configured nbd devices negotiate side by side at start: three silent servers cost
/// ublkd one handshake's time limit ([`HANDSHAKE_SECS`]), not three, and the other
/// devices are made.
#[test]
fn configured_exports_are_negotiated_side_by_side_at_start() {
    let _serial = serial();
    let mut config = handshake_limit(HANDSHAKE_SECS);
    let sockets: Vec<PathBuf> =
        (0..3).map(|i| PathBuf::from(format!("/tmp/ublkd-test-nbd-silent-{i}.sock"))).collect();
    for (i, socket) in sockets.iter().enumerate() {
        silent_unix_server(socket);
        config += &format!(
            "\n[[device]]\nid = {}\ntarget = \"nbd\"\nuri = \"nbd+unix:///?socket={}\"\n",
            20 + i,
            socket.display()
        );
    }
    config += "\n[[device]]\nid = 30\ntarget = \"null\"\nsize = \"64M\"\n";
    let started = Instant::now();
    let ublkd = Ublkd::start_with("nbd-configured-silent", &config, &[]);
    let took = started.elapsed();
    eprintln!("three silent servers configured: ublkd answered after {took:?}");
    let one_after_another = Duration::from_secs(3 * HANDSHAKE_SECS);
    assert!(took < one_after_another, "ublkd took {took:?}: one handshake after another");
    let status = ublkd.status();
    assert_eq!(status.len(), 1, "{status:?}");
    assert_eq!((status[0]["id"].as_u64(), status[0]["state"].as_str()), (Some(30), Some("LIVE")));
    let log = ublkd.log();
    for socket in &sockets {
        assert!(
            log.lines().any(|l| l.contains(&socket.display().to_string())
                && l.contains(&format!("did not answer within {HANDSHAKE_SECS} s"))),
            "no error for {}:\n{log}",
            socket.display()
        );
    }
    ublkd.stop();
}

/// A reload that adds a device whose server says nothing holds up nothing but that
/// device: ublkd answers `list` at once meanwhile, the reload's other new device is
/// LIVE before the silent one fails, and the outcome, logged once both are done, counts
/// the one made and names why the other was not.
#[test]
fn a_reload_adding_a_silent_servers_device_holds_up_nothing_else() {
    let _serial = serial();
    let socket = PathBuf::from("/tmp/ublkd-test-nbd-silent-reload.sock");
    silent_unix_server(&socket);
    let null = |id: u32| format!("\n[[device]]\nid = {id}\ntarget = \"null\"\nsize = \"64M\"\n");
    // Longer than the other tests' limit: device 31 must be LIVE within it.
    let limit = handshake_limit(RELOAD_HANDSHAKE_SECS);
    let ublkd = Ublkd::start_with("nbd-silent-reload", &format!("{}{limit}", null(30)), &[]);
    let silent = format!(
        "\n[[device]]\nid = 21\ntarget = \"nbd\"\nuri = \"nbd+unix:///?socket={}\"\n",
        socket.display()
    );
    let started = Instant::now();
    let outcome = std::thread::scope(|scope| {
        let reload =
            scope.spawn(|| ublkd.reload_with(&format!("{}{silent}{}{limit}", null(30), null(31))));
        let mut slowest = Duration::ZERO;
        let mut seen_31 = None;
        while !reload.is_finished() {
            let t = Instant::now();
            let listed = ublkd.status();
            slowest = slowest.max(t.elapsed());
            let live_31 = listed.iter().any(|d| d["id"] == 31 && d["state"] == "LIVE");
            if live_31 && seen_31.is_none() {
                seen_31 = Some(started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("during the reload: slowest status {slowest:?}, device 31 LIVE at {seen_31:?}");
        assert!(slowest < Duration::from_secs(1), "a status took {slowest:?} during the reload");
        let seen_31 = seen_31.expect("device 31 was never LIVE during the reload");
        let before_the_limit = Duration::from_secs(RELOAD_HANDSHAKE_SECS - 1);
        assert!(seen_31 < before_the_limit, "device 31 was LIVE only at {seen_31:?}");
        reload.join().unwrap()
    });
    let took = started.elapsed();
    let limit = Duration::from_secs(RELOAD_HANDSHAKE_SECS);
    assert!(took >= limit, "the reload ended after {took:?}");
    assert!(outcome.contains("reloaded: 1 device(s) added, 0 deleted"), "{outcome}");
    let log = ublkd.log();
    assert!(
        log.lines().any(|l| l.contains("reload: configured device")
            && l.contains(&format!("did not answer within {RELOAD_HANDSHAKE_SECS} s"))),
        "no error for the silent server's device:\n{log}"
    );
    let ids: Vec<u64> = ublkd.status().iter().filter_map(|d| d["id"].as_u64()).collect();
    assert_eq!(ids, [30, 31], "after the reload");
    ublkd.stop();
}

/// A server that accepts and then says nothing holds up only its own `ublkctl add`:
/// the handshake runs on a thread of its own, so meanwhile ublkd answers `status` (which
/// shows the add and where it stands) and adds another device; the add then fails after
/// the handshake's time limit, naming why.
#[test]
fn a_silent_server_holds_up_only_its_own_add() {
    let _serial = serial();
    let socket = PathBuf::from("/tmp/ublkd-test-nbd-silent.sock");
    silent_unix_server(&socket);
    let ublkd = Ublkd::start_with("nbd-silent", &handshake_limit(HANDSHAKE_SECS), &[]);
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    let t = Instant::now();
    let add = Command::new(bin("ublkctl"))
        .arg("--socket")
        .arg(&ublkd.ctl.socket)
        .args(["add", "-n", "5", "-t", "nbd", "--uri", &uri])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    ublkd.wait_until("the add to be under way", || !ublkd.status().is_empty());
    let asked = Instant::now();
    // Status shows the add under way, and where it stands.
    let adding = ublkd.status();
    assert_eq!(adding.len(), 1, "{adding:?}");
    assert_eq!((adding[0]["id"].as_u64(), adding[0]["state"].as_str()), (Some(5), Some("ADDING")));
    let note = adding[0]["note"].as_str().unwrap_or_default();
    assert!(note.contains("being added: ublkd is negotiating its NBD export ("), "{note}");
    let id = ublkd.add(&["-t", "null", "-s", "64M"]);
    let meanwhile = asked.elapsed();
    assert!(meanwhile < Duration::from_secs(5), "status and an add took {meanwhile:?}");
    let out = add.wait_with_output().unwrap();
    let took = t.elapsed();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the add of a silent server succeeded: {}", describe(&out));
    let limit = format!("did not answer within {HANDSHAKE_SECS} s");
    assert!(said.contains(&limit), "{}", describe(&out));
    assert!(took >= Duration::from_secs(HANDSHAKE_SECS), "the add failed after {took:?}");
    eprintln!("while the silent server's add waited: status and a null add took {meanwhile:?}");
    assert_eq!(ublkd.status().len(), 1, "the silent server's device exists");
    ublkd.del(id);
    ublkd.stop();
}

/// A TCP proxy in front of an NBD server that, while `breaking`, lets each connection
/// negotiate and closes it when its first transmission request arrives (a request's
/// magic starts the client's data): the server whose connections break at once.
struct BreakingProxy {
    breaking: std::sync::Arc<std::sync::atomic::AtomicBool>,
    broken: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    uri: String,
}

impl BreakingProxy {
    fn start(port: u16, server_port: u16) -> BreakingProxy {
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let breaking = Arc::new(AtomicBool::new(false));
        let broken = Arc::new(AtomicUsize::new(0));
        let (b, n) = (Arc::clone(&breaking), Arc::clone(&broken));
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(("127.0.0.1", server_port)) else { continue };
                let (mut from_server, mut to_client) =
                    (server.try_clone().unwrap(), client.try_clone().unwrap());
                std::thread::spawn(move || drop(std::io::copy(&mut from_server, &mut to_client)));
                let (b, n) = (Arc::clone(&b), Arc::clone(&n));
                std::thread::spawn(move || {
                    let (mut client, mut server) = (client, server);
                    let mut buf = vec![0u8; 1 << 20];
                    loop {
                        let len = match client.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(len) => len,
                        };
                        if b.load(Ordering::SeqCst)
                            && buf[..len].starts_with(&[0x25, 0x60, 0x95, 0x13])
                        {
                            n.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        if server.write_all(&buf[..len]).is_err() {
                            break;
                        }
                    }
                    let _ = client.shutdown(Shutdown::Both);
                    let _ = server.shutdown(Shutdown::Both);
                });
            }
        });
        BreakingProxy { breaking, broken, uri: format!("nbd://127.0.0.1:{port}") }
    }

    fn set_breaking(&self, on: bool) {
        self.breaking.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    fn broken(&self) -> usize {
        self.broken.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A server that accepts and negotiates every connection, then breaks it at its first
/// request, for [`BREAKING_FOR`]: each broken connection is a worker lost, but a connection that
/// breaks that soon counts as a failed connect, so the next one waits longer each time
/// (1 s, doubling): one new worker per step of the backoff, not one per connection as
/// fast as the server breaks them. ublkd answers meanwhile, status says what it waits
/// for, and the read held all along completes, with no error, once the server behaves.
#[test]
fn a_server_that_breaks_every_connection_at_once_gets_one_worker_per_backoff_step() {
    let _serial = serial();
    let file = PathBuf::from("/tmp/ublkd-test-nbd-breaking.img");
    sparse_file(&file, 16 * MIB);
    let _nbdkit = Server::nbdkit(Listen::Tcp(10_830), &file, Offer::OneConnection);
    let proxy = BreakingProxy::start(10_831, 10_830);
    let ublkd = Ublkd::start("nbd-breaking");
    let id = ublkd.add(&["-t", "nbd", "--uri", &proxy.uri]);
    let node = block_dev(id);
    write_at(&node, 0, &pattern(7, 4096));
    proxy.set_breaking(true);
    let reading = node.clone();
    let reader = std::thread::spawn(move || read_at_direct(&reading, 0, 4096));
    let started = Instant::now();
    // How long ublkd keeps a client waiting meanwhile, asked on its socket (a ublkctl
    // process's own start under emulation is not ublkd's to answer for).
    let prober = StatusProber::start(&ublkd.ctl);
    let mut noted = String::new();
    while started.elapsed() < BREAKING_FOR {
        let note = ublkd.status_of(id)["note"].as_str().unwrap_or_default().to_string();
        if note.contains("keeps breaking connections") {
            noted = note;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let slowest = prober.finish();
    let broken = proxy.broken();
    proxy.set_breaking(false);
    let read = reader.join().expect("the held read failed");
    assert!(read == pattern(7, 4096), "the held read returned other data");
    eprintln!(
        "{broken} connections broken in {BREAKING_FOR:?}; status took {slowest:?} at most; {noted}"
    );
    assert!(broken >= 3, "only {broken} connections were broken: the test proves nothing");
    // Connections at 0, 1, 3, 7 and 15 s (plus each worker's start): five at most
    // (without the backoff, one per worker start: dozens).
    assert!(broken <= 6, "{broken} workers in {BREAKING_FOR:?}:\n{}", ublkd.log());
    assert!(slowest < Duration::from_secs(1), "status took {slowest:?}");
    assert!(!noted.is_empty(), "status never said the server keeps breaking connections");
    assert!(ublkd.log().contains("keeps breaking connections"), "{}", ublkd.log());
    let dev = ublkd.status_of(id);
    assert_eq!(dev["state"], "LIVE", "{dev}");
    ublkd.stop();
    let _ = std::fs::remove_file(&file);
}

/// A multi-conn export whose server answers the first connection of a worker's set and
/// never the others: every connection is made off ublkd's loop, so `ublkctl status`
/// answers within a second throughout the add, a worker kill and an upgrade of that
/// device; the device is served over the one connection that answered; and a second
/// device's worker killed meanwhile recovers with its usual stall.
#[test]
fn a_server_that_answers_one_connection_of_a_set_never_holds_up_ublkd() {
    let _serial = serial();
    let file = PathBuf::from("/tmp/ublkd-test-nbd-one-at-a-time.img");
    sparse_file(&file, 16 * MIB);
    let _nbdkit = Server::nbdkit(Listen::Tcp(10_840), &file, Offer::MultiConn);
    let proxy = OneAtATimeProxy::start(Endpoint::Tcp(10_841), Endpoint::Tcp(10_840));
    let ublkd = Ublkd::start("nbd-one-at-a-time");
    let bystander = ublkd.add(&["-t", "memory", "-s", "16M"]);
    ublkd.wait_until("the bystander's standby", || {
        ublkd.status_of(bystander)["standby_pid"].as_u64().is_some()
    });
    let first = ublkd.worker_pid(bystander);
    signal(first, libc::SIGKILL);
    wait_recovered(&ublkd, bystander, 1);
    let usual = ublkd.stall_after_kill(first);

    let prober = StatusProber::start(&ublkd.ctl);
    let id = ublkd.add(&["-t", "nbd", "--uri", &proxy.uri, "-q", "2", "--threads", "8"]);
    let node = block_dev(id);
    write_at(&node, 0, &pattern(9, 65536));
    let worker = ublkd.worker_pid(id);
    signal(worker, libc::SIGKILL);
    wait_recovered(&ublkd, id, 1);
    let out = ublkd.ctl(&["upgrade", "-n", &id.to_string()]);
    assert!(out.status.success(), "upgrade: {}\n{}", describe(&out), ublkd.log());
    ublkd.wait_until("the bystander's standby", || {
        ublkd.status_of(bystander)["standby_pid"].as_u64().is_some()
    });
    let second = ublkd.worker_pid(bystander);
    signal(second, libc::SIGKILL);
    wait_recovered(&ublkd, bystander, 2);
    let slowest = prober.finish();
    let stall = ublkd.stall_after_kill(second);
    assert!(read_at_direct(&node, 0, 65536) == pattern(9, 65536), "the data did not survive");
    let silent = proxy.silent();
    eprintln!(
        "{silent} connections left unanswered; status took {slowest:?} at most; the \
         bystander's stall {stall} ms, {usual} ms before"
    );
    assert!(silent >= 1, "no connection was left unanswered: the test proves nothing");
    assert!(slowest < Duration::from_secs(1), "status took {slowest:?}:\n{}", ublkd.log());
    assert!(stall <= 2 * usual + 500, "the bystander's stall was {stall} ms, {usual} ms before");
    assert!(ublkd.log().contains("answered 1 of the"), "{}", ublkd.log());
    assert_eq!(ublkd.status_of(id)["state"], "LIVE");
    ublkd.del(id);
    ublkd.stop();
    let _ = std::fs::remove_file(&file);
}
