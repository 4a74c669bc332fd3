//! Kernel TLS in the test VM's guest kernel: `tls.ko` and the AEAD modules behind it are
//! loaded on demand from the module tree the kernel cache keeps (tests/src/kernel.rs)
//! through `/lib/modules/$(uname -r)` (tests/vm/guest-init.sh), by `modprobe` and by the
//! kernel's own `request_module` (`tcp-ulp-tls`, `crypto-gcm(aes)`, ...). What must hold,
//! on a loopback TCP connection, for TLS 1.2 with AES-GCM-128 and AES-GCM-256: a sender
//! with kTLS TX and a receiver with kTLS RX (same key, salt, IV and record sequence)
//! carry 1 MiB unchanged; and what the sender puts on the wire is TLS records, not the
//! plaintext. A kernel that cannot set kTLS up fails the test, naming the step and the
//! errno. And the supervisor's close_notify (what ends an `nbds://` device's session) is
//! an alert record that a kTLS receiver decrypts as one. Runs inside the test VM.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::process::Command;

use ublkd_tests::harness::machine::serial;
use ublkd_tests::harness::process::run;
use ublkd_tests::harness::storage::pattern;

const MIB: usize = 1 << 20;
/// A TLS record's header: content type, version, length.
const RECORD_HEADER: usize = 5;
/// `application_data`, the content type of every record kTLS sends by default.
const APPLICATION_DATA: u8 = 0x17;
/// `alert`, the content type of close_notify's record.
const ALERT: u8 = 0x15;
/// What AES-GCM adds to each TLS 1.2 record's payload: the explicit nonce and the tag.
const GCM_OVERHEAD: usize = 8 + 16;

/// The TLS 1.2 ciphers under test.
#[derive(Debug, Clone, Copy)]
enum Cipher {
    AesGcm128,
    AesGcm256,
}

/// One end's kTLS direction.
#[derive(Debug, Clone, Copy)]
enum Direction {
    Tx,
    Rx,
}

impl Direction {
    fn optname(self) -> libc::c_int {
        match self {
            Self::Tx => libc::TLS_TX,
            Self::Rx => libc::TLS_RX,
        }
    }
}

/// A connected loopback TCP pair: (the connecting end, the accepted end).
fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().unwrap();
    let client = TcpStream::connect(addr).expect("connect to the loopback listener");
    let (server, _) = listener.accept().expect("accept the loopback connection");
    (client, server)
}

/// Why kTLS may be missing, for a failure message: the guest's module tree and what is
/// loaded.
fn module_state() -> String {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let dep = format!("/lib/modules/{}/modules.dep", release.trim());
    let loaded: Vec<String> = std::fs::read_to_string("/proc/modules")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    format!(
        "kernel {}, {dep} {}, loaded modules: [{}]",
        release.trim(),
        if std::path::Path::new(&dep).exists() { "present" } else { "MISSING" },
        loaded.join(" ")
    )
}

/// `setsockopt(fd, level, name, value)`, panicking with `step`, the errno and
/// [`module_state`] if the kernel refuses.
fn setsockopt<T>(sock: &TcpStream, level: libc::c_int, name: libc::c_int, value: &T, step: &str) {
    let len = libc::socklen_t::try_from(size_of_val(value)).unwrap();
    // SAFETY: `value` is a live reference to `len` readable bytes for the duration of
    // the call, and the fd is owned by `sock`, which outlives it.
    let rc = unsafe {
        libc::setsockopt(sock.as_raw_fd(), level, name, std::ptr::from_ref(value).cast(), len)
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        panic!(
            "{step}: setsockopt failed with errno {} ({err}); {}",
            err.raw_os_error().unwrap_or(0),
            module_state()
        );
    }
}

/// Attaches the `tls` upper-layer protocol to `sock` (loads `tls.ko` on first use,
/// through the kernel's `request_module("tcp-ulp-tls")`).
fn attach_tls(sock: &TcpStream, end: &str) {
    setsockopt(
        sock,
        libc::SOL_TCP,
        libc::TCP_ULP,
        b"tls",
        &format!("setsockopt(SOL_TCP, TCP_ULP, \"tls\") on the {end}"),
    );
}

/// Installs TLS 1.2 `cipher` keys for `direction` on `sock` (after [`attach_tls`]). Both
/// ends get the same key, salt, IV and record sequence, derived from `cipher`.
fn set_keys(sock: &TcpStream, direction: Direction, cipher: Cipher, end: &str) {
    let step = format!("setsockopt(SOL_TLS, {direction:?}, TLS 1.2 {cipher:?}) on the {end}");
    let bytes = |seed: u64, n: usize| pattern(seed, n);
    match cipher {
        Cipher::AesGcm128 => {
            let info = libc::tls12_crypto_info_aes_gcm_128 {
                info: libc::tls_crypto_info {
                    version: libc::TLS_1_2_VERSION,
                    cipher_type: libc::TLS_CIPHER_AES_GCM_128,
                },
                iv: bytes(1, 8).try_into().unwrap(),
                key: bytes(2, 16).try_into().unwrap(),
                salt: bytes(3, 4).try_into().unwrap(),
                rec_seq: bytes(4, 8).try_into().unwrap(),
            };
            setsockopt(sock, libc::SOL_TLS, direction.optname(), &info, &step);
        }
        Cipher::AesGcm256 => {
            let info = libc::tls12_crypto_info_aes_gcm_256 {
                info: libc::tls_crypto_info {
                    version: libc::TLS_1_2_VERSION,
                    cipher_type: libc::TLS_CIPHER_AES_GCM_256,
                },
                iv: bytes(5, 8).try_into().unwrap(),
                key: bytes(6, 32).try_into().unwrap(),
                salt: bytes(7, 4).try_into().unwrap(),
                rec_seq: bytes(8, 8).try_into().unwrap(),
            };
            setsockopt(sock, libc::SOL_TLS, direction.optname(), &info, &step);
        }
    }
}

/// Writes `data` to `sock` from a thread, then shuts the write side down; returns the
/// thread.
fn send_in_background(mut sock: TcpStream, data: Vec<u8>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        sock.write_all(&data).expect("write 1 MiB through the kTLS sender");
        sock.flush().unwrap();
        sock.shutdown(Shutdown::Write).expect("shut down the sender's write side");
    })
}

/// The first offset at which `a` and `b` differ (or the shorter length).
fn first_difference(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()))
}

/// kTLS TX on one end and kTLS RX on the other carry 1 MiB unchanged.
fn round_trip(cipher: Cipher, seed: u64) {
    let _serial = serial();
    let (sender, mut receiver) = tcp_pair();
    attach_tls(&sender, "sender");
    set_keys(&sender, Direction::Tx, cipher, "sender");
    attach_tls(&receiver, "receiver");
    set_keys(&receiver, Direction::Rx, cipher, "receiver");

    let data = pattern(seed, MIB);
    let writer = send_in_background(sender, data.clone());
    let mut got = vec![0; MIB];
    receiver.read_exact(&mut got).unwrap_or_else(|e| {
        panic!("read 1 MiB through kTLS RX ({cipher:?}): {e} (errno {:?})", e.raw_os_error())
    });
    writer.join().expect("the sender thread panicked");
    assert!(
        got == data,
        "kTLS {cipher:?} changed the data: first difference at byte {}",
        first_difference(&got, &data)
    );
    // Nothing after the 1 MiB: the sender's FIN reads as the end of the stream.
    let mut rest = Vec::new();
    receiver.read_to_end(&mut rest).expect("read to the end through kTLS RX");
    assert!(rest.is_empty(), "kTLS {cipher:?} delivered {} bytes more than sent", rest.len());
}

/// kTLS TX only: the receiver reads the raw stream, which must be TLS 1.2
/// application-data records whose payloads add up to the plaintext plus AES-GCM's
/// per-record overhead, and which must not contain the plaintext.
fn wire_is_records(cipher: Cipher, seed: u64) {
    let _serial = serial();
    let (sender, mut receiver) = tcp_pair();
    attach_tls(&sender, "sender");
    set_keys(&sender, Direction::Tx, cipher, "sender");

    let data = pattern(seed, MIB);
    let writer = send_in_background(sender, data.clone());
    let mut wire = Vec::with_capacity(MIB + MIB / 8);
    receiver.read_to_end(&mut wire).expect("read the raw stream");
    writer.join().expect("the sender thread panicked");

    assert!(
        wire.starts_with(&[APPLICATION_DATA, 0x03, 0x03]),
        "the raw stream does not start with a TLS 1.2 application-data record header: {:02x?}",
        &wire[..wire.len().min(8)]
    );
    // Walk the records: each is application data, TLS 1.2, and carries AES-GCM overhead.
    let (mut at, mut records, mut plaintext) = (0, 0, 0);
    while at < wire.len() {
        let header = &wire[at..(at + RECORD_HEADER).min(wire.len())];
        assert!(
            header.len() == RECORD_HEADER && header[..3] == [APPLICATION_DATA, 0x03, 0x03],
            "record {records} at byte {at} has the header {header:02x?}"
        );
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        assert!(len > GCM_OVERHEAD, "record {records} at byte {at} is {len} bytes long");
        at += RECORD_HEADER + len;
        plaintext += len - GCM_OVERHEAD;
        records += 1;
    }
    assert_eq!(at, wire.len(), "the last record runs past the end of the stream");
    assert_eq!(plaintext, MIB, "the {records} records carry {plaintext} bytes, not 1 MiB");
    assert_eq!(wire.len(), MIB + records * (RECORD_HEADER + GCM_OVERHEAD));
    // Ciphertext: no 64-byte window of the plaintext shows up on the wire.
    let probe = &data[4096..4096 + 64];
    assert!(!wire.windows(probe.len()).any(|w| w == probe), "the plaintext appears on the wire");
    let payload = &wire[RECORD_HEADER + 8..RECORD_HEADER + 8 + 256];
    assert_ne!(payload, &data[..256], "the first record's payload is the plaintext");
}

/// Receives one record's plaintext through kTLS RX with `recvmsg`, which hands over
/// records other than application data too, with their type in a control message:
/// (the record type, its bytes).
fn receive_record(sock: &TcpStream) -> (u8, Vec<u8>) {
    let mut data = [0u8; 64];
    let mut part = libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: data.len() };
    let mut control = [0u8; 64];
    // SAFETY: msghdr is plain data; all-zero is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut part;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: `sock` is open; `msg` points at `part` -> `data` and at `control`, which
    // outlive the call, with their lengths.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, 0) };
    assert!(n >= 0, "recvmsg through kTLS RX: {}", std::io::Error::last_os_error());
    // SAFETY: the kernel filled `control` up to `msg_controllen`; CMSG_FIRSTHDR reads
    // within it, and a header it returns has at least one byte of data for the type.
    let record_type = unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        assert!(!header.is_null(), "kTLS RX gave no record type");
        assert_eq!(
            ((*header).cmsg_level, (*header).cmsg_type),
            (libc::SOL_TLS, libc::TLS_GET_RECORD_TYPE)
        );
        *libc::CMSG_DATA(header)
    };
    (record_type, data[..n as usize].to_vec())
}

#[test]
fn the_supervisors_close_notify_is_an_alert_that_ktls_rx_decrypts() {
    let _serial = serial();
    let (mut sender, receiver) = tcp_pair();
    attach_tls(&sender, "sender");
    set_keys(&sender, Direction::Tx, Cipher::AesGcm128, "sender");
    attach_tls(&receiver, "receiver");
    set_keys(&receiver, Direction::Rx, Cipher::AesGcm128, "receiver");

    // Data first, so that the alert must carry the next record sequence number to
    // decrypt.
    sender.write_all(b"NBD_CMD_DISC").expect("write through kTLS TX");
    ublkd_supervisor::nbd::close_notify(sender.as_fd()).expect("close_notify through kTLS TX");
    assert_eq!(receive_record(&receiver), (APPLICATION_DATA, b"NBD_CMD_DISC".to_vec()));
    // Level 1 (warning), description 0 (close_notify).
    assert_eq!(receive_record(&receiver), (ALERT, vec![1, 0]));
}

#[test]
fn aes_gcm_128_carries_1_mib_from_ktls_tx_to_ktls_rx() {
    round_trip(Cipher::AesGcm128, 0x128);
}

#[test]
fn aes_gcm_256_carries_1_mib_from_ktls_tx_to_ktls_rx() {
    round_trip(Cipher::AesGcm256, 0x256);
}

#[test]
fn aes_gcm_128_puts_tls_records_not_plaintext_on_the_wire() {
    wire_is_records(Cipher::AesGcm128, 0x1280);
}

#[test]
fn aes_gcm_256_puts_tls_records_not_plaintext_on_the_wire() {
    wire_is_records(Cipher::AesGcm256, 0x2560);
}

/// `modprobe tls` finds the module in the guest's `/lib/modules/$(uname -r)` (loaded
/// already by an earlier test or not), and so do the AEAD modules kTLS asks for.
#[test]
fn modprobe_finds_tls_and_gcm_in_the_guest_module_tree() {
    let _serial = serial();
    for module in ["tls", "gcm"] {
        let out = run(Command::new("modprobe").arg(module));
        assert!(
            out.status.success(),
            "modprobe {module}: {}; {}",
            String::from_utf8_lossy(&out.stderr).trim(),
            module_state()
        );
        assert!(
            std::path::Path::new("/sys/module").join(module).exists(),
            "modprobe {module} succeeded but /sys/module/{module} is missing; {}",
            module_state()
        );
    }
    // What kTLS pulled in, for the log (`--nocapture`).
    println!("{}", module_state());
}
