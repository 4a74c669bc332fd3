//! The NBD client's handshake against real servers on this host (nbdkit, qemu-nbd)
//! and against tiny fake ones written here (garbage, oldstyle, a stall). No kernel
//! device is involved, so these run anywhere nbdkit and qemu-utils are installed
//! (`tests/vm/install-host-deps.sh` installs them; the README's test command runs it).
//!
//! Each server is a child process owned by a [`Server`] guard that kills it on drop,
//! and each test waits for its server to be ready before connecting: nbdkit's pid file
//! (written once it listens), qemu-nbd's socket accepting a connection.

use std::io::Write;
use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use ublkd_proto::msg::DataPath;

use ublkd_config::{DeviceSettings, DeviceSpec, NbdUri, TargetSpec};
use ublkd_supervisor::nbd::{self, ExportInfo, NbdError, Replies};
use ublkd_supervisor::target::{NbdLink, TargetError, connect_export, nbd_poll_connect};

/// The limit on each connection's handshake: `recovery.nbd_handshake_timeout_secs`'s default.
const HANDSHAKE: Duration = Duration::from_secs(10);

const TIMEOUT: Duration = Duration::from_secs(10);

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "ublkd-nbd-{}-{}-{name}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create the test's directory");
        TempDir(path)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server process, killed and reaped on drop.
struct Server {
    child: Child,
    name: &'static str,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `program args`, checking first that it is installed.
    fn start(program: &'static str, args: &[&str]) -> Server {
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {program} ({e}): the nbd tests need nbdkit and qemu-nbd; \
                     install them with tests/vm/install-host-deps.sh (as root) or \
                     apt-get install nbdkit qemu-utils"
                )
            });
        Server { child, name: program }
    }

    /// Waits until `ready` succeeds (the server accepts connections), failing the test
    /// if the server exits or takes longer than [`TIMEOUT`].
    fn wait_until(&mut self, ready: impl Fn() -> bool) {
        let deadline = Instant::now() + TIMEOUT;
        while !ready() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("{} exited before it listened: {status}", self.name);
            }
            assert!(Instant::now() < deadline, "{} did not listen within {TIMEOUT:?}", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn on_unix(program: &'static str, socket: &Path, args: &[&str]) -> Server {
        let mut server = Server::start(program, args);
        server.wait_until(|| UnixStream::connect(socket).is_ok());
        server
    }

    /// nbdkit with `args`, once it accepts connections: nbdkit writes its pid file
    /// only then, which spares it a probing connection (that it would log as an error).
    fn nbdkit(dir: &TempDir, args: &[&str]) -> Server {
        let pid_file = dir.join("nbdkit.pid");
        let pid_text = pid_file.to_str().unwrap();
        let mut full = vec!["-f", "--exit-with-parent", "-P", pid_text];
        full.extend_from_slice(args);
        let mut server = Server::start("nbdkit", &full);
        server.wait_until(|| std::fs::read(&pid_file).is_ok_and(|pid| pid.ends_with(b"\n")));
        server
    }
}

/// nbdkit with `extra` (options, the plugin and its arguments) on a unix socket in
/// `dir`; returns it and its URI for `export` (as written in a URI: percent-encoded).
fn nbdkit_unix(dir: &TempDir, extra: &[&str], export: &str) -> (Server, NbdUri) {
    let socket = dir.join("nbdkit.sock");
    let socket_text = socket.to_str().unwrap();
    let mut args = vec!["-U", socket_text];
    args.extend_from_slice(extra);
    let server = Server::nbdkit(dir, &args);
    let uri = NbdUri::parse(&format!("nbd+unix:///{export}?socket={socket_text}")).unwrap();
    (server, uri)
}

fn connected(uri: &NbdUri) -> ExportInfo {
    let (socket, info) =
        nbd::connect(uri, Replies::Structured, TIMEOUT).unwrap_or_else(|e| panic!("{uri}: {e}"));
    eprintln!("{uri}: {info}");
    nbd::disconnect(socket, info.tls);
    info
}

fn refused(uri: &NbdUri, timeout: Duration) -> NbdError {
    match nbd::connect(uri, Replies::Structured, timeout) {
        Ok((_, info)) => panic!("{uri}: expected an error, connected to {info:?}"),
        Err(e) => {
            eprintln!("{uri}: {e}");
            e
        }
    }
}

/// A free TCP port on 127.0.0.1 (bound, then released for the server to take).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn nbdkit_memory_over_a_unix_socket_gives_its_size_and_flags() {
    let dir = TempDir::new("unix");
    let (_server, uri) = nbdkit_unix(&dir, &["memory", "1G"], "");
    let info = connected(&uri);
    assert_eq!(info.size, 1 << 30);
    assert!(!info.read_only());
    assert!(info.can_flush() && info.can_fua() && info.can_trim() && info.can_write_zeroes());
    assert!(info.can_multi_conn(), "nbdkit's memory plugin shares one RAM disk");
    assert!(info.structured_replies, "nbdkit takes NBD_OPT_STRUCTURED_REPLY");
}

#[test]
fn nbdkit_memory_over_tcp_on_localhost() {
    let dir = TempDir::new("tcp");
    let port = free_port();
    let port_text = port.to_string();
    let _server = Server::nbdkit(&dir, &["-i", "127.0.0.1", "-p", &port_text, "memory", "64M"]);
    let info = connected(&NbdUri::parse(&format!("nbd://127.0.0.1:{port}/")).unwrap());
    assert_eq!(info.size, 64 << 20);
    assert!(!info.read_only());
}

#[test]
fn a_named_export_is_found_and_an_unknown_one_is_named_in_the_error() {
    let dir = TempDir::new("named");
    let strict =
        ["--filter=exportname", "memory", "16M", "exportname=disk one", "exportname-strict=true"];
    let (_server, uri) = nbdkit_unix(&dir, &strict, "disk%20one");
    assert_eq!(connected(&uri).size, 16 << 20);

    let socket = dir.join("nbdkit.sock");
    let other = NbdUri::parse(&format!("nbd+unix:///nope?socket={}", socket.display())).unwrap();
    let error = refused(&other, TIMEOUT);
    assert!(matches!(&error, NbdError::UnknownExport { export, .. } if export == "nope"));
    assert!(error.to_string().starts_with("the server has no export named \"nope\""), "{error}");
}

#[test]
fn a_read_only_export_says_so() {
    let dir = TempDir::new("ro");
    let (_server, uri) = nbdkit_unix(&dir, &["-r", "memory", "1M"], "");
    assert!(connected(&uri).read_only());
}

#[test]
fn advertised_block_sizes_are_recorded_and_one_the_kernel_cannot_take_is_refused() {
    let dir = TempDir::new("bs");
    let policy = |min: &'static str| {
        [
            "--filter=blocksize-policy",
            "memory",
            "1M",
            min,
            "blocksize-preferred=65536",
            "blocksize-maximum=1048576",
        ]
    };
    let (server, uri) = nbdkit_unix(&dir, &policy("blocksize-minimum=4096"), "");
    let info = connected(&uri);
    let sizes = info.block_sizes.expect("blocksize-policy advertises block sizes");
    assert_eq!((sizes.min, sizes.preferred, sizes.max), (4096, 65536, 1 << 20));
    drop(server);

    let dir = TempDir::new("bs-big");
    let (_server, uri) = nbdkit_unix(&dir, &policy("blocksize-minimum=8192"), "");
    let error = refused(&uri, TIMEOUT);
    assert!(matches!(error, NbdError::UnusableBlockSize { min: 8192 }), "{error}");
}

#[test]
fn a_size_that_is_not_whole_sectors_is_refused() {
    let dir = TempDir::new("odd");
    let (_server, uri) = nbdkit_unix(&dir, &["memory", "1000"], "");
    let error = refused(&uri, TIMEOUT);
    assert!(matches!(error, NbdError::UnusableSize { size: 1000, .. }), "{error}");
    assert!(error.to_string().contains("not a multiple of 512"), "{error}");
}

/// A server whose requests may be at most 512 bytes cannot serve a block device (the
/// kernel sends up to a page): refused, named, not raised to 4 KiB behind its back.
#[test]
fn an_export_whose_maximum_request_is_below_a_page_is_refused() {
    let dir = TempDir::new("small-max");
    let args = [
        "--filter=blocksize-policy",
        "memory",
        "1M",
        "blocksize-minimum=512",
        "blocksize-preferred=512",
        "blocksize-maximum=512",
    ];
    let (_server, uri) = nbdkit_unix(&dir, &args, "");
    let error = refused(&uri, TIMEOUT);
    assert!(matches!(error, NbdError::UnusableMaxBlockSize { max: 512 }), "{error}");
    let message =
        connect_export(&nbd_spec(uri), DataPath::Batch, HANDSHAKE).unwrap_err().to_string();
    assert!(message.contains("maximum block size, 512 bytes, is below 4096"), "{message}");
}

/// An export of whole sectors but not whole 4 KiB blocks cannot be a device with 4 KiB
/// logical blocks: refused with both numbers, before any kernel device is made; with
/// 512-byte blocks it is served.
#[test]
fn an_export_that_is_not_whole_logical_blocks_is_refused() {
    let dir = TempDir::new("odd-blocks");
    let size = (1 << 20) + 512;
    let (_server, uri) = nbdkit_unix(&dir, &["memory", &size.to_string()], "");
    let mut spec = nbd_spec(uri);
    assert_eq!(spec.settings.block_size, 4096, "the default logical block size");
    let message = connect_export(&spec, DataPath::Batch, HANDSHAKE).unwrap_err().to_string();
    assert!(
        message.contains(&format!(
            "the export's size, {size} bytes, is not a multiple of the device's logical block \
             size (4096 bytes)"
        )),
        "{message}"
    );
    spec.settings.block_size = 512;
    let link = connect_export(&spec, DataPath::Batch, HANDSHAKE).unwrap().expect("an nbd link");
    assert_eq!(link.info.unwrap().size, size);
}

#[test]
fn qemu_nbd_serves_a_qcow2_image_over_a_unix_socket() {
    let dir = TempDir::new("qemu");
    let image = dir.join("disk.qcow2");
    let status = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&image)
        .arg("256M")
        .status()
        .unwrap_or_else(|e| panic!("cannot run qemu-img ({e}): install qemu-utils"));
    assert!(status.success(), "qemu-img create failed: {status}");
    let socket = dir.join("qemu.sock");
    let (socket_text, image_text) = (socket.to_str().unwrap(), image.to_str().unwrap());
    let _server = Server::on_unix(
        "qemu-nbd",
        &socket,
        &["-k", socket_text, "-f", "qcow2", "-x", "vm-disk", "-t", image_text],
    );
    let uri = NbdUri::parse(&format!("nbd+unix:///vm-disk?socket={socket_text}")).unwrap();
    let info = connected(&uri);
    assert_eq!(info.size, 256 << 20);
    assert!(!info.read_only() && info.can_flush());
    assert!(info.structured_replies, "qemu-nbd takes NBD_OPT_STRUCTURED_REPLY");
    assert!(info.block_sizes.is_some(), "qemu-nbd advertises block sizes");
}

#[test]
fn nothing_listening_is_a_refused_connection() {
    let port = free_port();
    let error = refused(&NbdUri::parse(&format!("nbd://127.0.0.1:{port}")).unwrap(), TIMEOUT);
    assert!(matches!(error, NbdError::ConnectionRefused { .. }), "{error}");
    assert!(error.to_string().contains("no NBD server listens there"), "{error}");

    let dir = TempDir::new("refused");
    let missing = dir.join("missing.sock");
    let uri = NbdUri::parse(&format!("nbd+unix:///?socket={}", missing.display())).unwrap();
    assert!(matches!(refused(&uri, TIMEOUT), NbdError::NoSocket { .. }));

    // A socket file whose listener is gone.
    let stale = dir.join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    let uri = NbdUri::parse(&format!("nbd+unix:///?socket={}", stale.display())).unwrap();
    assert!(matches!(refused(&uri, TIMEOUT), NbdError::ConnectionRefused { .. }));
}

/// A fake server on a unix socket in `dir`: each connection gets `greeting`, then the
/// connection is held open (so the client must judge the bytes, not an EOF) until the
/// client goes.
fn fake_server(dir: &TempDir, greeting: Vec<u8>) -> NbdUri {
    let socket = dir.join("fake.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let _ = stream.write_all(&greeting);
            // Drain until the client closes; the thread ends with the test process.
            let _ = std::io::copy(&mut stream, &mut std::io::sink());
        }
    });
    NbdUri::parse(&format!("nbd+unix:///?socket={}", socket.display())).unwrap()
}

#[test]
fn a_server_that_talks_garbage_gets_a_clear_error_not_a_hang() {
    let dir = TempDir::new("garbage");
    let uri = fake_server(&dir, b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n".to_vec());
    let started = Instant::now();
    let error = refused(&uri, TIMEOUT);
    assert!(matches!(error, NbdError::NotNbd), "{error}");
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
}

#[test]
fn a_server_that_stalls_mid_handshake_times_out() {
    let dir = TempDir::new("stall");
    // The greeting up to the handshake flags, then nothing.
    let uri = fake_server(&dir, 0x4e42_444d_4147_4943u64.to_be_bytes().to_vec());
    let started = Instant::now();
    let error = refused(&uri, Duration::from_millis(300));
    assert!(
        matches!(error, NbdError::Timeout { step: "reading the server's greeting", .. }),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
}

/// nbdkit with `--mask-handshake=0` offers neither fixed newstyle nor NO_ZEROES, as
/// servers older than NBD_OPT_GO did: the export is chosen with NBD_OPT_EXPORT_NAME
/// (and its 124 zeroes read), and a TLS URI is refused by name, as such a server
/// cannot start TLS.
#[test]
fn a_server_without_fixed_newstyle_is_served_through_nbd_opt_export_name() {
    let dir = TempDir::new("plain-newstyle");
    let (_server, uri) = nbdkit_unix(&dir, &["--mask-handshake=0", "memory", "64M"], "");
    let info = connected(&uri);
    assert_eq!(info.size, 64 << 20);
    assert!(!info.read_only() && info.can_flush() && info.can_trim(), "{info}");
    assert!(info.export_name_option && !info.structured_replies && info.block_sizes.is_none());

    // Another directory: Server::nbdkit waits for its pid file.
    let dir = TempDir::new("plain-newstyle-tcp");
    let port = free_port();
    let port_text = port.to_string();
    let _tcp = Server::nbdkit(
        &dir,
        &["-i", "127.0.0.1", "-p", &port_text, "--mask-handshake=0", "memory", "1M"],
    );
    let tls = NbdUri::parse(&format!(
        "nbds://127.0.0.1:{port}/?tls-certificates={}",
        dir.join("pki").display()
    ))
    .unwrap();
    let error = refused(&tls, TIMEOUT);
    assert!(matches!(error, NbdError::NotFixedNewstyle), "{error}");
    assert!(error.to_string().contains("cannot start TLS"), "{error}");
}

#[test]
fn an_oldstyle_server_is_refused_as_such() {
    let dir = TempDir::new("oldstyle");
    let mut greeting = 0x4e42_444d_4147_4943u64.to_be_bytes().to_vec();
    greeting.extend_from_slice(&0x0000_4202_8186_1253u64.to_be_bytes());
    greeting.extend_from_slice(&(1u64 << 30).to_be_bytes());
    greeting.extend_from_slice(&1u32.to_be_bytes());
    greeting.extend_from_slice(&[0; 124]);
    let error = refused(&fake_server(&dir, greeting), TIMEOUT);
    assert!(matches!(error, NbdError::Oldstyle), "{error}");
    assert!(error.to_string().starts_with("oldstyle servers are not supported"), "{error}");
}

/// An nbd device's spec for `uri`, as the config file or `ublkctl add` makes it.
fn nbd_spec(uri: NbdUri) -> DeviceSpec {
    DeviceSpec {
        id: None,
        target: TargetSpec::Nbd { uri, zero_copy: None },
        size_bytes: 0,
        settings: DeviceSettings::default(),
        attrs: Default::default(),
    }
}

/// What ublkd answers `ublkctl add -t nbd` (and logs for a configured nbd device)
/// before it would make a kernel device: the export's details when the URI works, the
/// A device is made from what its export is: `connect_export` negotiates before any
/// kernel device exists and says why when it cannot.
#[test]
fn ublkd_learns_an_export_before_making_its_device_and_names_a_server_that_is_not_there() {
    let dir = TempDir::new("servable");
    let (_server, uri) = nbdkit_unix(&dir, &["-r", "memory", "2G"], "");
    let link = connect_export(&nbd_spec(uri.clone()), DataPath::Batch, HANDSHAKE)
        .unwrap()
        .expect("an nbd link");
    let info = link.info.expect("the export's details");
    assert_eq!(info.size, 2 << 30);
    assert!(info.read_only(), "{info}");
    assert_eq!(link.sockets.len(), 1, "a worker's one connection, made with the device");

    let port = free_port();
    let nowhere = NbdUri::parse(&format!("nbd://127.0.0.1:{port}/disk")).unwrap();
    let message =
        connect_export(&nbd_spec(nowhere), DataPath::Batch, HANDSHAKE).unwrap_err().to_string();
    assert!(
        message.starts_with(&format!(
            "cannot use the nbd export nbd://127.0.0.1:{port}/disk: the connection to \
             127.0.0.1:{port} was refused"
        )),
        "{message}"
    );
}

/// A worker's next connection must be to the export the device was made from: a
/// server restarted with another size, or without a feature the kernel was told of,
/// is refused with both descriptions, not served.
#[test]
fn a_reconnection_to_a_changed_export_is_refused() {
    let dir = TempDir::new("changed");
    let (server, uri) = nbdkit_unix(&dir, &["memory", "64M"], "");
    let mut spec = nbd_spec(uri.clone());
    let mut link = connect_export(&spec, DataPath::Batch, HANDSHAKE).unwrap().expect("an nbd link");
    spec.size_bytes = link.info.as_ref().unwrap().size;
    // The first worker's connection is the one made with the device.
    let first = link.sockets.remove(0);
    nbd::disconnect(first, false);
    // The same export again: a new connection, accepted.
    let again = reconnect(&uri, &spec, &mut link).unwrap();
    nbd::disconnect(again, false);
    // The server restarted on the same socket, as another export.
    let restart = |server: Server, args: &[&str]| {
        drop(server);
        for stale in ["nbdkit.pid", "nbdkit.sock"] {
            let _ = std::fs::remove_file(dir.join(stale));
        }
        nbdkit_unix(&dir, args, "").0
    };
    let smaller = restart(server, &["memory", "32M"]);
    let message = reconnect(&uri, &spec, &mut link).unwrap_err().to_string();
    assert!(message.contains("is no longer what device 1 was made from"), "{message}");
    assert!(message.contains("its size is 33554432 bytes, the device's 67108864"), "{message}");

    let read_only = restart(smaller, &["-r", "memory", "64M"]);
    let message = reconnect(&uri, &spec, &mut link).unwrap_err().to_string();
    assert!(message.contains("read-write") && message.contains("read-only"), "{message}");

    // Requests the kernel was told it may send (no limit was advertised) would now be
    // refused by the server.
    let _smaller_max = restart(
        read_only,
        &["--filter=blocksize-policy", "memory", "64M", "blocksize-maximum=65536"],
    );
    let message = reconnect(&uri, &spec, &mut link).unwrap_err().to_string();
    assert!(message.contains("is no longer what device 1 was made from"), "{message}");
    assert!(message.contains("/65536 (min/preferred/max)"), "{message}");
}

/// A recovery's connection for device 1's next worker, made on ublkd's connecting
/// thread as the loop would wait for it.
fn reconnect(uri: &NbdUri, spec: &DeviceSpec, link: &mut NbdLink) -> Result<OwnedFd, TargetError> {
    loop {
        match nbd_poll_connect(1, uri, spec, link, 1, HANDSHAKE) {
            std::task::Poll::Pending => std::thread::sleep(Duration::from_millis(10)),
            std::task::Poll::Ready(done) => return done.map(|()| link.sockets.remove(0)),
        }
    }
}

/// A server whose accept backlog is full (it never accepts): connect would wait for
/// ever without its own timeout.
#[test]
fn a_server_that_never_accepts_times_out_connecting() {
    use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd;
    let dir = TempDir::new("backlog");
    let path = dir.join("full.sock");
    let addr = UnixAddr::new(&path).unwrap();
    let unix_socket = |flags| {
        socket::socket(AddressFamily::Unix, SockType::Stream, flags | SockFlag::SOCK_CLOEXEC, None)
            .unwrap()
    };
    // A backlog of one, filled by non-blocking connects until the kernel says EAGAIN.
    let listener = unix_socket(SockFlag::empty());
    socket::bind(listener.as_raw_fd(), &addr).unwrap();
    socket::listen(&listener, Backlog::new(1).unwrap()).unwrap();
    let mut pending = Vec::new();
    loop {
        let fd = unix_socket(SockFlag::SOCK_NONBLOCK);
        match socket::connect(fd.as_raw_fd(), &addr) {
            Ok(()) => pending.push(fd),
            Err(nix::errno::Errno::EAGAIN) => break,
            Err(e) => panic!("filling the backlog: {e}"),
        }
        assert!(pending.len() < 64, "a backlog of one never filled");
    }
    let uri = NbdUri::parse(&format!("nbd+unix:///?socket={}", path.display())).unwrap();
    let started = Instant::now();
    let error = refused(&uri, Duration::from_millis(300));
    assert!(matches!(error, NbdError::Timeout { step: "connecting", .. }), "{error}");
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
}

/// Throwaway certificates made by tests/vm/make-tls-certs.sh (`server/`, `client/`,
/// `other/`).
fn tls_certificates(dir: &TempDir) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/vm/make-tls-certs.sh");
    let out = dir.join("pki");
    let status = Command::new("sh").arg(&script).arg(&out).status().expect("run openssl's script");
    assert!(status.success(), "{} failed: {status}", script.display());
    out
}

/// nbdkit serving 64 MiB over TCP on 127.0.0.1 with TLS required, and `extra` options.
fn nbdkit_tls(dir: &TempDir, pki: &Path, extra: &[&str]) -> (Server, u16) {
    let port = free_port();
    let port_text = port.to_string();
    let certs = format!("--tls-certificates={}", pki.join("server").display());
    let mut args = vec!["-i", "127.0.0.1", "-p", &port_text, "--tls=require", &certs];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["memory", "64M"]);
    (Server::nbdkit(dir, &args), port)
}

/// The kernel's TLS (tls.ko) is loaded: only then can a TLS connection be handed on.
/// This host's kernel may have none; the VM tests serve a device over TLS for real.
fn kernel_tls() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp")
        .is_ok_and(|ulps| ulps.split_whitespace().any(|u| u == "tls"))
}

/// Connects over TLS; what is asserted is that the export was negotiated inside TLS:
/// the connection is handed to the kernel's TLS, or, on a host without it, only that
/// last step fails, naming `modprobe tls`.
fn connected_over_tls(uri: &NbdUri) {
    match nbd::connect(uri, Replies::Structured, TIMEOUT) {
        Ok((socket, info)) => {
            assert!(kernel_tls(), "handed to a kernel TLS that is not listed as loaded");
            assert_eq!(info.size, 64 << 20);
            nbd::disconnect(socket, info.tls);
        }
        Err(error) => {
            let text = error.to_string();
            eprintln!("{uri}: {text}");
            assert!(
                !kernel_tls()
                    && matches!(error, NbdError::KernelTls { .. })
                    && text.contains("TCP_ULP")
                    && text.contains("modprobe tls"),
                "{uri}: {text}"
            );
        }
    }
}

#[test]
fn a_tls_export_is_negotiated_inside_tls_with_or_without_a_client_certificate() {
    let dir = TempDir::new("tls");
    let pki = tls_certificates(&dir);
    let client = pki.join("client");
    let (_server, port) = nbdkit_tls(&dir, &pki, &[]);
    let uri = |query: &str| {
        NbdUri::parse(&format!("nbds://127.0.0.1:{port}/?tls-certificates={query}")).unwrap()
    };
    connected_over_tls(&uri(client.to_str().unwrap()));
    // The server's certificate names localhost too.
    connected_over_tls(&uri(&format!("{}&tls-hostname=localhost", client.display())));

    // The plain scheme meets the server's refusal, which says what to write instead.
    let plain = NbdUri::parse(&format!("nbd://127.0.0.1:{port}/")).unwrap();
    let error = refused(&plain, TIMEOUT);
    assert!(matches!(error, NbdError::TlsRequired { .. }), "{error}");
    assert!(error.to_string().contains("use an nbds:// URI"), "{error}");

    // A server that asks for a client certificate gets ublkd's.
    let dir2 = TempDir::new("tls-verify");
    let (_strict, port) = nbdkit_tls(&dir2, &pki, &["--tls-verify-peer"]);
    let strict =
        NbdUri::parse(&format!("nbds://127.0.0.1:{port}/?tls-certificates={}", client.display()))
            .unwrap();
    connected_over_tls(&strict);
}

#[test]
fn tls_with_the_wrong_authority_or_name_or_files_is_refused_with_what_to_check() {
    let dir = TempDir::new("tls-bad");
    let pki = tls_certificates(&dir);
    let (_server, port) = nbdkit_tls(&dir, &pki, &[]);
    let with = |query: String| {
        NbdUri::parse(&format!("nbds://127.0.0.1:{port}/?tls-certificates={query}")).unwrap()
    };

    // An authority that did not sign the server's certificate.
    let error = refused(&with(pki.join("other").display().to_string()), TIMEOUT);
    let text = error.to_string();
    assert!(matches!(error, NbdError::Tls { .. }), "{text}");
    assert!(text.contains("running the TLS handshake") && text.contains("UnknownIssuer"), "{text}");
    assert!(text.contains("ca-cert.pem"), "no hint in {text}");

    // The right authority, but a name the certificate does not carry.
    let error = refused(
        &with(format!("{}&tls-hostname=nbd.example", pki.join("client").display())),
        TIMEOUT,
    );
    assert!(matches!(error, NbdError::Tls { .. }), "{error}");

    // A directory without ca-cert.pem, and a client certificate without its key.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let error = refused(&with(empty.display().to_string()), TIMEOUT);
    assert!(error.to_string().contains("ca-cert.pem cannot be read"), "{error}");
    let half = dir.join("half");
    std::fs::create_dir_all(&half).unwrap();
    for file in ["ca-cert.pem", "client-cert.pem"] {
        std::fs::copy(pki.join("client").join(file), half.join(file)).unwrap();
    }
    let error = refused(&with(half.display().to_string()), TIMEOUT);
    assert!(error.to_string().contains("client-key.pem is missing"), "{error}");

    // A server that asks for a client certificate, from a client that has none.
    let dir2 = TempDir::new("tls-verify-bad");
    let (_strict, port) = nbdkit_tls(&dir2, &pki, &["--tls-verify-peer"]);
    let no_cert = dir.join("no-cert");
    std::fs::create_dir_all(&no_cert).unwrap();
    std::fs::copy(pki.join("client/ca-cert.pem"), no_cert.join("ca-cert.pem")).unwrap();
    let uri =
        NbdUri::parse(&format!("nbds://127.0.0.1:{port}/?tls-certificates={}", no_cert.display()))
            .unwrap();
    let error = refused(&uri, TIMEOUT);
    assert!(error.to_string().contains("it may want a client certificate"), "{error}");
}

#[test]
fn tls_asked_of_a_server_without_it_is_named() {
    let dir = TempDir::new("no-tls");
    let pki = tls_certificates(&dir);
    let port = free_port();
    let port_text = port.to_string();
    let _server = Server::nbdkit(&dir, &["-i", "127.0.0.1", "-p", &port_text, "memory", "1M"]);
    let uri = NbdUri::parse(&format!(
        "nbds://127.0.0.1:{port}/?tls-certificates={}",
        pki.join("client").display()
    ))
    .unwrap();
    let error = refused(&uri, TIMEOUT);
    assert!(matches!(error, NbdError::NoTls { .. }), "{error}");
    assert!(error.to_string().starts_with("the server does not offer TLS"), "{error}");
}
