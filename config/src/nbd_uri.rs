//! NBD URIs: where an `nbd` device's export is and what it is called.
//!
//! The syntax is the NBD project's URI standard
//! (<https://github.com/NetworkBlockDevice/nbd/blob/master/doc/uri.md>), the subset
//! ublkd can serve: `nbd://HOST[:PORT][/EXPORT]` over TCP (port 10809 when left out),
//! `nbd+unix:///[EXPORT]?socket=PATH` over a unix socket, and
//! `nbds://HOST[:PORT][/EXPORT]?tls-certificates=DIR[&tls-hostname=NAME]` over TCP with
//! TLS (X.509 certificates: `DIR/ca-cert.pem`, and `DIR/client-cert.pem` with
//! `DIR/client-key.pem` for a client certificate, the layout nbdkit, qemu-nbd and libnbd
//! use). `nbds+unix://` is refused (ublkd hands TLS to the kernel, whose TLS runs on TCP
//! only), as are TLS-PSK and anything the standard allows but ublkd would silently ignore
//! (a user name, an unknown query parameter): the standard asks a client to diagnose what
//! it does not understand rather than connect to something else than the operator meant.
//!
//! Parsing only: nothing here resolves a host name, touches the socket path or reads a
//! certificate.

use std::fmt;
use std::path::PathBuf;

/// The IANA port for NBD, the default of `nbd://` URIs (uri.md, "NBD URI authority").
pub const NBD_DEFAULT_PORT: u16 = 10809;

/// Longest export name: the NBD protocol's bound on any string (proto.md,
/// "Conventions": strings "MUST be no longer than 4096 bytes").
pub const MAX_EXPORT_NAME_BYTES: usize = 4096;

/// Longest unix socket path: `sockaddr_un.sun_path` is 108 bytes, one of them the NUL.
pub const MAX_UNIX_SOCKET_PATH_BYTES: usize = 107;

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NbdUri {
    /// How to reach the server.
    pub transport: NbdTransport,
    /// The export's name, percent-decoded; empty for the server's default export.
    pub export: String,
    /// TLS, for an `nbds://` URI.
    pub tls: Option<NbdTls>,
    /// The URI as written, for messages.
    text: String,
}

/// How an [`NbdUri`] reaches its server.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NbdTransport {
    /// TCP to `host` (a name, an IPv4 address, or an IPv6 address without brackets).
    Tcp {
        /// Host name or address.
        host: String,
        /// TCP port.
        port: u16,
    },
    /// A unix socket at an absolute path.
    Unix {
        /// The socket's path.
        socket: PathBuf,
    },
}

/// How an `nbds://` URI's server is authenticated, and ublkd to it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NbdTls {
    /// The directory of PEM files (`tls-certificates=`): `ca-cert.pem`, the authorities
    /// the server's certificate must chain to; `client-cert.pem` and `client-key.pem`,
    /// ublkd's own certificate and key, if the server asks for one. Absolute.
    pub certificates: PathBuf,
    /// The name the server's certificate must carry (`tls-hostname=`), when it is not
    /// the URI's host.
    pub hostname: Option<String>,
}

impl NbdTls {
    /// The CA file: `ca-cert.pem` in [`Self::certificates`].
    pub fn ca_file(&self) -> PathBuf {
        self.certificates.join("ca-cert.pem")
    }

    /// The client certificate file: `client-cert.pem` in [`Self::certificates`].
    pub fn client_cert_file(&self) -> PathBuf {
        self.certificates.join("client-cert.pem")
    }

    /// The client key file: `client-key.pem` in [`Self::certificates`].
    pub fn client_key_file(&self) -> PathBuf {
        self.certificates.join("client-key.pem")
    }
}

/// Why a string is not an NBD URI ublkd can use. Every message quotes the URI.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdUriError {
    /// No `scheme://`.
    #[error(
        "{uri:?} is not an NBD URI; expected nbd://HOST[:PORT][/EXPORT], \
         nbd+unix:///[EXPORT]?socket=PATH or \
         nbds://HOST[:PORT][/EXPORT]?tls-certificates=DIR"
    )]
    NotAUri {
        /// The text.
        uri: String,
    },
    /// A scheme other than the NBD ones.
    #[error("{uri:?} has scheme {scheme:?}; an NBD URI starts with nbd://, nbd+unix:// or nbds://")]
    UnknownScheme {
        /// The text.
        uri: String,
        /// The scheme as written.
        scheme: String,
    },
    /// A URI ublkd cannot serve, and why.
    #[error("{uri:?}: {problem}")]
    Invalid {
        /// The text.
        uri: String,
        /// What is wrong and what would be right.
        problem: String,
    },
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for NbdUri {
    type Err = NbdUriError;

    fn from_str(text: &str) -> Result<Self, NbdUriError> {
        NbdUri::parse(text)
    }
}

impl NbdUri {
    /// Parses `text` (see the module docs for what is accepted).
    ///
    /// ```
    /// use ublkd_config::{NbdTransport, NbdUri};
    ///
    /// let uri = NbdUri::parse("nbd://[::1]:10810/disk%201")?;
    /// assert_eq!(uri.export, "disk 1");
    /// assert_eq!(uri.transport, NbdTransport::Tcp { host: "::1".into(), port: 10810 });
    /// # Ok::<(), ublkd_config::NbdUriError>(())
    /// ```
    pub fn parse(text: &str) -> Result<NbdUri, NbdUriError> {
        let invalid = |problem: String| NbdUriError::Invalid { uri: text.to_owned(), problem };
        let Some((scheme, rest)) = text.split_once("://") else {
            return Err(NbdUriError::NotAUri { uri: text.to_owned() });
        };
        // RFC 3986: schemes are case-insensitive.
        let (unix, tls) = match scheme.to_ascii_lowercase().as_str() {
            "nbd" => (false, false),
            "nbd+unix" => (true, false),
            "nbds" => (false, true),
            "nbds+unix" => {
                return Err(invalid(
                    "TLS over a unix socket is not supported: ublkd hands the TLS session to \
                     the kernel, whose TLS runs on TCP only; a local socket needs none, so \
                     use nbd+unix://"
                        .into(),
                ));
            }
            _ => {
                return Err(NbdUriError::UnknownScheme {
                    uri: text.to_owned(),
                    scheme: scheme.to_owned(),
                });
            }
        };
        if rest.contains('#') {
            return Err(invalid("a fragment (#...) means nothing in an NBD URI; remove it".into()));
        }
        let (before_query, query) = match rest.split_once('?') {
            Some((before, query)) => (before, Some(query)),
            None => (rest, None),
        };
        let (authority, path) = match before_query.find('/') {
            Some(at) => before_query.split_at(at),
            None => (before_query, ""),
        };
        // uri.md: the export is the path without its leading `/`.
        let export = percent_decode(path.strip_prefix('/').unwrap_or(path))
            .map_err(|problem| invalid(format!("the export name {problem}")))?;
        let export = String::from_utf8(export)
            .map_err(|_| invalid("the export name is not UTF-8, as NBD strings must be".into()))?;
        if export.contains('\0') {
            return Err(invalid("the export name contains a NUL byte, which NBD forbids".into()));
        }
        if export.len() > MAX_EXPORT_NAME_BYTES {
            return Err(invalid(format!(
                "the export name is {} bytes long; NBD allows at most {MAX_EXPORT_NAME_BYTES}",
                export.len()
            )));
        }
        let params = parse_query(query).map_err(invalid)?;
        let mut certificates = None;
        let mut hostname = None;
        for (key, value) in &params {
            match key.as_str() {
                "socket" if unix => {}
                "tls-certificates" if tls => {
                    if certificates.replace(value).is_some() {
                        return Err(invalid("tls-certificates= is given more than once".into()));
                    }
                }
                "tls-hostname" if tls => {
                    let name = String::from_utf8(value.clone())
                        .ok()
                        .filter(|n| !n.is_empty() && n.bytes().all(is_host_byte))
                        .ok_or_else(|| {
                            invalid("tls-hostname= is not a host name or address".into())
                        })?;
                    if hostname.replace(name).is_some() {
                        return Err(invalid("tls-hostname= is given more than once".into()));
                    }
                }
                "tls-psk-file" | "tls-username" if tls => {
                    return Err(invalid(format!(
                        "{key}=: TLS with a pre-shared key is not supported (ublkd's TLS \
                         library has no TLS-PSK); use certificates, tls-certificates=DIR"
                    )));
                }
                "tls-verify-peer" if tls => {
                    return Err(invalid(
                        "tls-verify-peer=: ublkd always verifies the server's certificate; \
                         remove it"
                            .into(),
                    ));
                }
                _ if key.starts_with("tls-") && !tls => {
                    return Err(invalid(format!(
                        "{key}= is a TLS parameter, which needs the nbds:// scheme"
                    )));
                }
                _ => {
                    let hint = if key == "socket" {
                        "; a unix socket needs the nbd+unix:// scheme".to_owned()
                    } else if unix {
                        "; an nbd+unix URI takes only socket=PATH".to_owned()
                    } else if tls {
                        "; an nbds:// URI takes tls-certificates=DIR and tls-hostname=NAME"
                            .to_owned()
                    } else {
                        "; an nbd:// URI takes none".to_owned()
                    };
                    return Err(invalid(format!("unknown query parameter {key:?}{hint}")));
                }
            }
        }
        let tls = if tls {
            let Some(dir) = certificates else {
                return Err(invalid(
                    "an nbds:// URI needs tls-certificates=DIR, a directory with ca-cert.pem \
                     (the authority that signed the server's certificate) and, for a client \
                     certificate, client-cert.pem and client-key.pem"
                        .into(),
                ));
            };
            Some(NbdTls { certificates: certificates_dir(dir).map_err(invalid)?, hostname })
        } else {
            None
        };
        let transport = if unix {
            if !authority.is_empty() {
                return Err(invalid(format!(
                    "an nbd+unix URI has no host, this one has {authority:?}; write \
                     nbd+unix:///EXPORT?socket=PATH (three slashes)"
                )));
            }
            let socket = match params.as_slice() {
                [(_, socket)] => socket,
                [] => {
                    return Err(invalid(
                        "an nbd+unix URI needs ?socket=PATH, the server's socket".into(),
                    ));
                }
                _ => return Err(invalid("socket= is given more than once".into())),
            };
            unix_socket_path(socket).map_err(invalid)?
        } else {
            let (host, port) = host_and_port(authority).map_err(invalid)?;
            NbdTransport::Tcp { host, port }
        };
        Ok(NbdUri { transport, export, tls, text: text.to_owned() })
    }
}

/// The query's `key=value` pairs, percent-decoded.
fn parse_query(query: Option<&str>) -> Result<Vec<(String, Vec<u8>)>, String> {
    let Some(query) = query else { return Ok(Vec::new()) };
    let mut params = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = String::from_utf8(percent_decode(key)?)
            .map_err(|_| "a query parameter's name is not UTF-8".to_owned())?;
        params.push((key, percent_decode(value)?));
    }
    Ok(params)
}

/// A `socket=` value as an absolute path a `sockaddr_un` can hold.
fn unix_socket_path(raw: &[u8]) -> Result<NbdTransport, String> {
    use std::os::unix::ffi::OsStrExt;
    if raw.first() == Some(&0) {
        return Err("abstract unix sockets (socket=%00...) are not supported; use a path".into());
    }
    if raw.contains(&0) {
        return Err("the socket path contains a NUL byte".into());
    }
    let socket = PathBuf::from(std::ffi::OsStr::from_bytes(raw));
    if !socket.is_absolute() {
        return Err(format!(
            "the socket path {} is not absolute; ublkd runs from / as a service, so give \
             the full path, such as /run/nbd/disk.sock",
            socket.display()
        ));
    }
    if raw.len() > MAX_UNIX_SOCKET_PATH_BYTES {
        return Err(format!(
            "the socket path is {} bytes long; a unix socket path holds at most \
             {MAX_UNIX_SOCKET_PATH_BYTES}",
            raw.len()
        ));
    }
    Ok(NbdTransport::Unix { socket })
}

/// A `tls-certificates=` value as an absolute directory path.
fn certificates_dir(raw: &[u8]) -> Result<PathBuf, String> {
    use std::os::unix::ffi::OsStrExt;
    if raw.is_empty() || raw.contains(&0) {
        return Err("tls-certificates= is empty or contains a NUL byte".into());
    }
    let dir = PathBuf::from(std::ffi::OsStr::from_bytes(raw));
    if !dir.is_absolute() {
        return Err(format!(
            "the certificates directory {} is not absolute; ublkd runs from / as a \
             service, so give the full path, such as /etc/ublkd/pki",
            dir.display()
        ));
    }
    Ok(dir)
}

/// A byte of a host name or address (IPv6 ones hold `:`).
fn is_host_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b':'
}

/// The authority of an `nbd://` URI: `HOST`, `HOST:PORT`, `[V6]` or `[V6]:PORT`.
fn host_and_port(authority: &str) -> Result<(String, u16), String> {
    if authority.contains('@') {
        return Err("a user name (user@) is only for TLS-PSK authentication, which is not \
                    supported; remove it"
            .into());
    }
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let Some((v6, after)) = bracketed.split_once(']') else {
            return Err("an IPv6 address opened with [ is not closed with ]".into());
        };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("[{v6}] is not an IPv6 address"));
        }
        match after {
            "" => (v6, None),
            _ => match after.strip_prefix(':') {
                Some(port) => (v6, Some(port)),
                None => return Err(format!("unexpected {after:?} after [{v6}]")),
            },
        }
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("an nbd:// URI needs a host, such as nbd://localhost/EXPORT; for a \
                    unix socket use nbd+unix:///EXPORT?socket=PATH"
            .into());
    }
    let host_ok = host.contains(':')
        || host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !host_ok {
        return Err(format!("{host:?} is not a host name or address"));
    }
    let port = match port {
        None => NBD_DEFAULT_PORT,
        Some(port) => match port.parse::<u16>() {
            Ok(p) if p != 0 && port.bytes().all(|b| b.is_ascii_digit()) => p,
            _ => return Err(format!("port {port:?} is not a port number (1..=65535)")),
        },
    };
    Ok((host.to_owned(), port))
}

/// RFC 3986 percent-decoding: `%XX` is the byte 0xXX; any other `%` is an error.
fn percent_decode(text: &str) -> Result<Vec<u8>, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                Some(byte) => out.push(byte),
                None => {
                    return Err(format!(
                        "has a % not followed by two hex digits (at byte {i}); write %25 \
                         for a literal %"
                    ));
                }
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16) -> NbdTransport {
        NbdTransport::Tcp { host: host.into(), port }
    }

    #[test]
    fn good_uris_parse_to_their_transport_and_export() {
        let cases: [(&str, NbdTransport, &str); 10] = [
            ("nbd://example.com", tcp("example.com", 10809), ""),
            ("nbd://example.com/", tcp("example.com", 10809), ""),
            ("nbd://example.com/disk", tcp("example.com", 10809), "disk"),
            ("nbd://example.com//disk", tcp("example.com", 10809), "/disk"),
            ("nbd://example.com/hello%20world", tcp("example.com", 10809), "hello world"),
            ("NBD://127.0.0.1:10900/a/b", tcp("127.0.0.1", 10900), "a/b"),
            ("nbd://[::1]", tcp("::1", 10809), ""),
            ("nbd://[fe80::1]:1/x", tcp("fe80::1", 1), "x"),
            (
                "nbd+unix:///disk?socket=/run/nbd.sock",
                NbdTransport::Unix { socket: "/run/nbd.sock".into() },
                "disk",
            ),
            (
                "nbd+unix://?socket=/tmp/a%20b.sock",
                NbdTransport::Unix { socket: "/tmp/a b.sock".into() },
                "",
            ),
        ];
        for (text, transport, export) in cases {
            let uri = NbdUri::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(uri.transport, transport, "{text}");
            assert_eq!(uri.export, export, "{text}");
            assert_eq!(uri.to_string(), text);
        }
    }

    #[test]
    fn nbds_uris_carry_their_certificates_directory_and_hostname() {
        let uri =
            NbdUri::parse("nbds://10.0.0.1:10900/disk?tls-certificates=/etc/ublkd/pki").unwrap();
        assert_eq!(uri.transport, tcp("10.0.0.1", 10900));
        assert_eq!(uri.export, "disk");
        let tls = uri.tls.unwrap();
        assert_eq!(tls.certificates, PathBuf::from("/etc/ublkd/pki"));
        assert_eq!(tls.hostname, None);
        assert_eq!(tls.ca_file(), PathBuf::from("/etc/ublkd/pki/ca-cert.pem"));
        assert_eq!(tls.client_cert_file(), PathBuf::from("/etc/ublkd/pki/client-cert.pem"));
        assert_eq!(tls.client_key_file(), PathBuf::from("/etc/ublkd/pki/client-key.pem"));

        let uri = NbdUri::parse("NBDS://[::1]/?tls-hostname=nbd.example&tls-certificates=/a%20b")
            .unwrap();
        assert_eq!(uri.transport, tcp("::1", 10809));
        let tls = uri.tls.unwrap();
        assert_eq!(tls.certificates, PathBuf::from("/a b"));
        assert_eq!(tls.hostname.as_deref(), Some("nbd.example"));
        assert!(NbdUri::parse("nbd://h/x").unwrap().tls.is_none());
    }

    /// Each bad URI and a part of its message that says what is wrong.
    #[test]
    fn bad_uris_are_refused_with_what_is_wrong() {
        let long_socket = format!("nbd+unix:///?socket=/{}", "s".repeat(107));
        let long_export = format!("nbd://h/{}", "e".repeat(4097));
        let cases: Vec<(&str, &str)> = vec![
            ("example.com:10809", "is not an NBD URI"),
            ("http://example.com/", "has scheme \"http\""),
            ("nbd+vsock://1/", "has scheme \"nbd+vsock\""),
            ("nbd:///disk", "needs a host"),
            ("nbd://:10809/disk", "needs a host"),
            ("nbd://h:0/", "port \"0\" is not a port number"),
            ("nbd://h:65536/", "port \"65536\""),
            ("nbd://h:+1/", "port \"+1\""),
            ("nbd://h:/", "port \"\""),
            ("nbd://[::1/", "not closed with ]"),
            ("nbd://[nope]/", "[nope] is not an IPv6 address"),
            ("nbd://[::1]x/", "unexpected \"x\""),
            ("nbd://user@h/", "a user name (user@)"),
            ("nbd://h_x/", "\"h_x\" is not a host name"),
            ("nbd://h/a%2", "% not followed by two hex digits"),
            ("nbd://h/a%zz", "% not followed by two hex digits"),
            ("nbd://h/a%00b", "NUL byte"),
            ("nbd://h/%ff", "not UTF-8"),
            (&long_export, "4097 bytes long"),
            ("nbd://h/x#frag", "fragment"),
            ("nbd://h/x?socket=/s", "needs the nbd+unix:// scheme"),
            ("nbd://h/x?foo=1", "unknown query parameter \"foo\""),
            ("nbd+unix:///x", "needs ?socket=PATH"),
            ("nbd+unix://host/x?socket=/s", "has no host"),
            ("nbd+unix:///x?socket=/a&socket=/b", "more than once"),
            ("nbd+unix:///x?socket=rel.sock", "is not absolute"),
            ("nbd+unix:///x?socket=%00abs", "abstract unix sockets"),
            ("nbd+unix:///x?socket=/s&x-debug=1", "takes only socket=PATH"),
            (&long_socket, "108 bytes long"),
            ("nbds://h/x", "needs tls-certificates=DIR"),
            ("nbds://h/x?tls-certificates=pki", "is not absolute"),
            ("nbds://h/x?tls-certificates=", "is empty"),
            ("nbds://h/x?tls-certificates=/a&tls-certificates=/b", "more than once"),
            ("nbds://h/x?tls-certificates=/a&tls-hostname=a_b", "tls-hostname= is not a host"),
            ("nbds://h/x?tls-psk-file=/k", "pre-shared key is not supported"),
            ("nbds://h/x?tls-certificates=/a&tls-verify-peer=false", "always verifies"),
            ("nbds://h/x?tls-certificates=/a&socket=/s", "needs the nbd+unix:// scheme"),
            ("nbds://h/x?tls-certificates=/a&tls-type=x", "an nbds:// URI takes"),
            ("nbds+unix:///x?socket=/s", "TLS over a unix socket is not supported"),
            ("nbd://h/x?tls-certificates=/a", "needs the nbds:// scheme"),
            ("nbd+unix:///x?socket=/s&tls-hostname=h", "needs the nbds:// scheme"),
        ];
        for (text, part) in cases {
            match NbdUri::parse(text) {
                Ok(uri) => panic!("{text} parsed as {uri:?}"),
                Err(error) => {
                    let message = error.to_string();
                    assert!(message.contains(part), "{text}: {message}");
                    assert!(message.contains(&format!("{text:?}")), "{message}");
                }
            }
        }
    }
}
