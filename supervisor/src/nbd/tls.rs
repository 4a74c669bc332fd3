//! TLS for `nbds://` exports: the client's TLS session (rustls), set up after
//! `NBD_OPT_STARTTLS` and handed to the kernel (kTLS) once the export is chosen, so
//! that the worker's data path stays plain WRITEV and RECV on the same socket and the
//! worker never holds a key file.
//!
//! Only TLS 1.2 with AES-GCM is offered. The kernel's TLS receive path hands a plain
//! `recv` only application data and fails it with EIO on any other record; TLS 1.3
//! servers send records after the handshake (session tickets, key updates) that would
//! end the connection on the worker's first read. TLS 1.2 has none: the only record a
//! TLS 1.2 server sends besides data is an alert, which ends the session anyway.
//!
//! Certificates are read at every connect, so a renewed certificate is used from the
//! next reconnect on.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, ConnectionTrafficSecrets, RootCertStore};
use ublkd_config::NbdTls;

use super::NbdError;

/// The cipher suites offered: those of TLS 1.2 whose AEAD the kernel's TLS implements
/// in every Linux build that has it (AES-GCM; ChaCha20-Poly1305 is a separate kernel
/// option).
fn cipher_suites() -> Vec<rustls::SupportedCipherSuite> {
    use rustls::crypto::ring::cipher_suite::*;
    vec![
        TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    ]
}

/// A client session to `host` (or the URI's `tls-hostname=`), authenticated by the
/// files in `tls`'s certificates directory.
pub(super) fn client(tls: &NbdTls, host: &str) -> Result<ClientConnection, NbdError> {
    let ca_file = tls.ca_file();
    let mut roots = RootCertStore::empty();
    for cert in read_certs(&ca_file)? {
        roots.add(cert).map_err(|e| NbdError::TlsFile {
            path: ca_file.clone(),
            problem: format!("holds a certificate that cannot be an authority: {e}"),
        })?;
    }
    let provider = rustls::crypto::CryptoProvider {
        cipher_suites: cipher_suites(),
        ..rustls::crypto::ring::default_provider()
    };
    let builder = ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS12])
        .map_err(|e| NbdError::TlsSetup { problem: e.to_string() })?
        .with_root_certificates(roots);
    let (cert_file, key_file) = (tls.client_cert_file(), tls.client_key_file());
    let mut config = match (cert_file.exists(), key_file.exists()) {
        (false, false) => builder.with_no_client_auth(),
        (true, true) => {
            let chain = read_certs(&cert_file)?;
            let key = PrivateKeyDer::from_pem_file(&key_file).map_err(|e| NbdError::TlsFile {
                path: key_file.clone(),
                problem: format!("holds no usable private key: {e}"),
            })?;
            builder.with_client_auth_cert(chain, key).map_err(|e| NbdError::TlsFile {
                path: key_file.clone(),
                problem: format!("does not go with {}: {e}", cert_file.display()),
            })?
        }
        (cert, _) => {
            let (there, missing) =
                if cert { (&cert_file, &key_file) } else { (&key_file, &cert_file) };
            return Err(NbdError::TlsFile {
                path: missing.clone(),
                problem: format!(
                    "is missing while {} is there: a client certificate needs both",
                    there.display()
                ),
            });
        }
    };
    // The keys leave rustls for the kernel once the export is chosen.
    config.enable_secret_extraction = true;
    // Every connection is a new session: nothing is gained by resuming one, and a
    // ticket would outlive the keys the kernel holds.
    config.resumption = rustls::client::Resumption::disabled();
    let name = tls.hostname.as_deref().unwrap_or(host);
    let server_name = ServerName::try_from(name.to_owned()).map_err(|_| NbdError::TlsSetup {
        problem: format!("{name:?} cannot be checked against a certificate"),
    })?;
    ClientConnection::new(Arc::new(config), server_name)
        .map_err(|e| NbdError::TlsSetup { problem: e.to_string() })
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, NbdError> {
    let file_error = |problem: String| NbdError::TlsFile { path: path.to_owned(), problem };
    let iter = CertificateDer::pem_file_iter(path).map_err(|e| match e {
        rustls::pki_types::pem::Error::Io(e) => file_error(format!("cannot be read: {e}")),
        e => file_error(format!("is not PEM: {e}")),
    })?;
    let certs =
        iter.collect::<Result<Vec<_>, _>>().map_err(|e| file_error(format!("is not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(file_error("holds no certificate (-----BEGIN CERTIFICATE-----)".into()));
    }
    Ok(certs)
}

/// Runs the TLS handshake over `stream` to its end.
pub(super) fn handshake<S: Read + Write>(
    session: &mut ClientConnection,
    stream: &mut S,
    limit: std::time::Duration,
) -> Result<(), NbdError> {
    const STEP: &str = "running the TLS handshake";
    while session.is_handshaking() {
        session.complete_io(stream).map_err(|e| match NbdError::from_io(e, STEP, limit) {
            // rustls names what it refused; a server that refuses says nothing, so
            // say what it most likely refused.
            NbdError::Closed { .. } => NbdError::TlsSetup {
                problem: "the server ended the TLS handshake: it may want a client \
                          certificate (client-cert.pem and client-key.pem in \
                          tls-certificates=) or one it trusts, or more than TLS 1.2 with \
                          AES-GCM, which is what the kernel can carry"
                    .into(),
            },
            other => other,
        })?;
    }
    // The handshake's last flight can still be queued.
    while session.wants_write() {
        session.write_tls(stream).map_err(|e| NbdError::from_io(e, STEP, limit))?;
    }
    Ok(())
}

/// The TLS error behind an I/O error of a TLS stream, if there is one.
pub(super) fn tls_error(error: &io::Error) -> Option<&rustls::Error> {
    error.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

/// What an operator can do about a TLS error, if anything obvious.
pub(super) fn hint(error: &rustls::Error) -> &'static str {
    match error {
        rustls::Error::InvalidCertificate(_) => {
            "; check that the server's certificate is signed by an authority in ca-cert.pem \
             and names the URI's host (or tls-hostname=)"
        }
        rustls::Error::PeerIncompatible(_) | rustls::Error::AlertReceived(_) => {
            "; ublkd speaks TLS 1.2 with AES-GCM (the kernel carries the session), which the \
             server must allow, and sends client-cert.pem if the server asks for a \
             certificate"
        }
        _ => "",
    }
}

/// Turns on the kernel's TLS for `socket` (`TCP_ULP` "tls"), which takes no keys yet.
pub(super) fn kernel_tls(socket: BorrowedFd<'_>) -> Result<(), NbdError> {
    let ulp = b"tls";
    // SAFETY: `socket` is an open socket for the call; the option value is the three
    // bytes of `ulp`, whose length is passed.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_ULP,
            ulp.as_ptr().cast(),
            ulp.len() as libc::socklen_t,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let source = io::Error::last_os_error();
    let hint = if source.raw_os_error() == Some(libc::ENOENT) {
        "the kernel's TLS is not loaded: load it with `modprobe tls`, and list `tls` in \
         /etc/modules-load.d/ so that it is there at boot (under systemd, ublkd may not load \
         modules)"
    } else {
        "does the kernel have TLS (CONFIG_TLS)?"
    };
    Err(NbdError::KernelTls { step: "turning on the kernel's TLS (TCP_ULP)", source, hint })
}

/// Hands the session's keys to the kernel for `socket`, on which [`kernel_tls`] has
/// succeeded: from here, the kernel encrypts what is sent on it and decrypts what is
/// received. Fails if the server sent anything rustls has read but not handed out
/// (there is nothing the server may send between the export's acceptance and ublkd's
/// first request).
pub(super) fn to_kernel(
    mut session: ClientConnection,
    socket: BorrowedFd<'_>,
) -> Result<(), NbdError> {
    let state =
        session.process_new_packets().map_err(|e| NbdError::TlsSetup { problem: e.to_string() })?;
    if state.plaintext_bytes_to_read() != 0 || session.wants_write() {
        return Err(NbdError::Protocol {
            problem: "it sent data after accepting the export, before any request".into(),
        });
    }
    let secrets = session.dangerous_extract_secrets().map_err(|e| NbdError::TlsSetup {
        problem: format!("the session's keys cannot be handed to the kernel: {e}"),
    })?;
    let (tx_seq, tx) = secrets.tx;
    let (rx_seq, rx) = secrets.rx;
    set_keys(socket, libc::TLS_TX, tx_seq, tx, true)?;
    set_keys(socket, libc::TLS_RX, rx_seq, rx, false)
}

/// The TLS alert record that ends a session the client's way: level 1 (warning),
/// description 0 (close_notify), RFC 5246 7.2.1.
const CLOSE_NOTIFY_ALERT: [u8; 2] = [1, 0];

/// The TLS record type of an alert (RFC 5246 6.2.1).
const RECORD_TYPE_ALERT: u8 = 21;

/// Sends close_notify on a socket whose sending side the kernel's TLS holds: a record of
/// type alert, which the kernel seals with the session's next sequence number. Only
/// when nothing else sends on the socket (its worker has exited), or the alert could
/// land inside another record's bytes.
pub fn close_notify(socket: BorrowedFd<'_>) -> io::Result<()> {
    // One control message of one byte: `TLS_SET_RECORD_TYPE` = the alert type.
    // SAFETY: CMSG_SPACE is a pure computation on its argument.
    let space = unsafe { libc::CMSG_SPACE(1) } as usize;
    let mut control = vec![0u8; space];
    let mut payload = CLOSE_NOTIFY_ALERT;
    let mut part = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() };
    // SAFETY: msghdr is plain data; all-zero is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut part;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `control`, `space` bytes long, which CMSG_SPACE(1) sized
    // for one header and one byte of data: CMSG_FIRSTHDR is inside it, and CMSG_DATA
    // of that header has one byte of room.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_TLS;
        (*header).cmsg_type = libc::TLS_SET_RECORD_TYPE;
        (*header).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(header) = RECORD_TYPE_ALERT;
    }
    // SAFETY: `socket` is open for the call; `msg` and everything it points at
    // (`part` -> `payload`, `control`) live until it returns.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_DONTWAIT) };
    match sent {
        n if n == CLOSE_NOTIFY_ALERT.len() as isize => Ok(()),
        n if n < 0 => Err(io::Error::last_os_error()),
        n => Err(io::Error::other(format!("the kernel took {n} of the alert's 2 bytes"))),
    }
}

/// The kernel's record of one direction's AES-GCM keys (`struct tls12_crypto_info_*`
/// of `<linux/tls.h>`), for a key of `N` bytes.
#[repr(C)]
struct CryptoInfo<const N: usize> {
    version: u16,
    cipher_type: u16,
    iv: [u8; 8],
    key: [u8; N],
    salt: [u8; 4],
    rec_seq: [u8; 8],
}

impl<const N: usize> CryptoInfo<N> {
    /// TLS 1.2 keys: `key` is `N` bytes long (the caller matched on its length).
    fn new(cipher_type: u16, key: &[u8], iv: [u8; 8], salt: [u8; 4], seq: u64) -> Self {
        CryptoInfo {
            version: libc::TLS_1_2_VERSION,
            cipher_type,
            iv,
            key: key.try_into().expect("a key of the length matched"),
            salt,
            rec_seq: seq.to_be_bytes(),
        }
    }
}

const _: () = {
    assert!(size_of::<CryptoInfo<16>>() == size_of::<libc::tls12_crypto_info_aes_gcm_128>());
    assert!(size_of::<CryptoInfo<32>>() == size_of::<libc::tls12_crypto_info_aes_gcm_256>());
    assert!(std::mem::offset_of!(CryptoInfo<16>, key) == 12);
    assert!(std::mem::offset_of!(CryptoInfo<32>, salt) == 44);
    assert!(std::mem::offset_of!(CryptoInfo<32>, rec_seq) == 48);
};

/// Sets one direction's keys. `seq` is the next record's sequence number.
///
/// The sending side needs care: in TLS 1.2 AES-GCM the nonce is the key block's
/// 4-byte salt and an 8-byte explicit part the sender picks, which must never repeat
/// under one key. rustls sent record `i` with the explicit part `E ^ i` (E from the key
/// block); the kernel sends its `k`-th record with `X + k`, for the `X` it is given. With
/// `X = E ^ 2^63` the kernel's parts differ from all of rustls's (which share E's top
/// bit) for 2^62 records and more, whatever E is. The receiving side reads the explicit
/// part from each record, so its `iv` is unused.
fn set_keys(
    socket: BorrowedFd<'_>,
    direction: libc::c_int,
    seq: u64,
    secrets: ConnectionTrafficSecrets,
    sending: bool,
) -> Result<(), NbdError> {
    let (cipher_type, key, iv) = match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (libc::TLS_CIPHER_AES_GCM_128, key, iv),
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (libc::TLS_CIPHER_AES_GCM_256, key, iv),
        _ => {
            return Err(NbdError::TlsSetup {
                problem: "the session's cipher is not AES-GCM, which alone was offered".into(),
            });
        }
    };
    let iv = iv.as_ref();
    let salt: [u8; 4] = iv[..4].try_into().expect("a GCM nonce is 12 bytes");
    let mut explicit: [u8; 8] = iv[4..12].try_into().expect("a GCM nonce is 12 bytes");
    if sending {
        explicit[0] ^= 0x80;
    }
    let result = match key.as_ref().len() {
        16 => set_crypto_info(
            socket,
            direction,
            &CryptoInfo::<16>::new(cipher_type, key.as_ref(), explicit, salt, seq),
        ),
        32 => set_crypto_info(
            socket,
            direction,
            &CryptoInfo::<32>::new(cipher_type, key.as_ref(), explicit, salt, seq),
        ),
        n => {
            return Err(NbdError::TlsSetup { problem: format!("an AES-GCM key of {n} bytes") });
        }
    };
    result.map_err(|source| NbdError::KernelTls {
        step: if sending {
            "giving the kernel the sending keys (TLS_TX)"
        } else {
            "giving the kernel the receiving keys (TLS_RX)"
        },
        source,
        hint: "does the kernel have AES-GCM (CONFIG_CRYPTO_GCM)?",
    })
}

fn set_crypto_info<const N: usize>(
    socket: BorrowedFd<'_>,
    direction: libc::c_int,
    info: &CryptoInfo<N>,
) -> io::Result<()> {
    // SAFETY: `socket` is open for the call; the value is `info`, a live `repr(C)`
    // struct of the layout the kernel expects for its cipher type (asserted above
    // against libc's), whose size is passed.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_TLS,
            direction,
            (info as *const CryptoInfo<N>).cast(),
            size_of::<CryptoInfo<N>>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_and_broken_certificate_files_are_named() {
        let dir = std::env::temp_dir().join(format!("ublkd-tls-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let tls = NbdTls { certificates: dir.clone(), hostname: None };
        let error = client(&tls, "localhost").unwrap_err().to_string();
        assert!(error.contains("ca-cert.pem cannot be read"), "{error}");

        std::fs::write(tls.ca_file(), "not a certificate\n").unwrap();
        let error = client(&tls, "localhost").unwrap_err().to_string();
        assert!(error.contains("ca-cert.pem holds no certificate"), "{error}");

        let _ = std::fs::remove_dir_all(&dir);
    }
}
