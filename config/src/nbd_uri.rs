//! NBD URIs: where an `nbd` device's export is and what it is called.
//!
//! The syntax is the NBD project's URI standard
//! (<https://github.com/NetworkBlockDevice/nbd/blob/master/doc/uri.md>), the subset
//! ublkd can serve today: `nbd://HOST[:PORT][/EXPORT]` over TCP (port 10809 when left
//! out) and `nbd+unix:///[EXPORT]?socket=PATH` over a unix socket. `nbds://` and
//! `nbds+unix://` are recognised and refused (ublkd has no TLS yet), as is anything the
//! standard allows but ublkd would silently ignore (a user name, TLS parameters, an
//! unknown query parameter): the standard asks a client to diagnose what it does not
//! understand rather than connect to something else than the operator meant.
//!
//! Parsing only: nothing here resolves a host name or touches the socket path.

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

/// Why a string is not an NBD URI ublkd can use. Every message quotes the URI.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdUriError {
    /// No `scheme://`.
    #[error(
        "{uri:?} is not an NBD URI; expected nbd://HOST[:PORT][/EXPORT] or \
         nbd+unix:///[EXPORT]?socket=PATH"
    )]
    NotAUri {
        /// The text.
        uri: String,
    },
    /// A scheme other than the NBD ones.
    #[error("{uri:?} has scheme {scheme:?}; an NBD URI starts with nbd:// or nbd+unix://")]
    UnknownScheme {
        /// The text.
        uri: String,
        /// The scheme as written.
        scheme: String,
    },
    /// `nbds://`, `nbds+unix://` or a `tls-*` parameter.
    #[error(
        "{uri:?} asks for TLS, which is not supported yet; use nbd:// or nbd+unix:// \
         over a trusted network or a local socket"
    )]
    TlsNotSupported {
        /// The text.
        uri: String,
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
        let unix = match scheme.to_ascii_lowercase().as_str() {
            "nbd" => false,
            "nbd+unix" => true,
            "nbds" | "nbds+unix" => return Err(NbdUriError::TlsNotSupported { uri: text.into() }),
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
        for (key, _) in &params {
            if key.starts_with("tls-") {
                return Err(NbdUriError::TlsNotSupported { uri: text.to_owned() });
            }
            if key != "socket" || !unix {
                let hint = if key == "socket" {
                    "; a unix socket needs the nbd+unix:// scheme".to_owned()
                } else if unix {
                    "; an nbd+unix URI takes only socket=PATH".to_owned()
                } else {
                    "; an nbd:// URI takes none".to_owned()
                };
                return Err(invalid(format!("unknown query parameter {key:?}{hint}")));
            }
        }
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
        Ok(NbdUri { transport, export, text: text.to_owned() })
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

/// The authority of an `nbd://` URI: `HOST`, `HOST:PORT`, `[V6]` or `[V6]:PORT`.
fn host_and_port(authority: &str) -> Result<(String, u16), String> {
    if authority.contains('@') {
        return Err("a user name (user@) is only for TLS authentication, which is not \
                    supported yet; remove it"
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
    fn tls_schemes_and_parameters_are_refused_as_not_supported_yet() {
        for text in [
            "nbds://example.com/disk",
            "NBDS+UNIX:///disk?socket=/run/x.sock",
            "nbd://example.com/disk?tls-type=x509",
        ] {
            let error = NbdUri::parse(text).unwrap_err();
            assert_eq!(error, NbdUriError::TlsNotSupported { uri: text.into() });
            assert!(error.to_string().contains("TLS, which is not supported yet"), "{error}");
        }
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
