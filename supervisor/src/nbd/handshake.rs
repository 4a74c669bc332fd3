//! The client's side of the NBD newstyle handshake, over any byte stream: the
//! greeting and the flags ([`greet`]), `NBD_OPT_STARTTLS` for a TLS export
//! ([`start_tls`]; the caller runs TLS and goes on inside it), then
//! `NBD_OPT_STRUCTURED_REPLY` (taken where offered, unless the caller wants simple
//! replies only: [`Replies`]) and `NBD_OPT_GO` with `NBD_INFO_EXPORT` and
//! `NBD_INFO_BLOCK_SIZE` asked for ([`choose_export`]). It ends in the transmission
//! phase with what the server said about the export.
//!
//! Servers older than `NBD_OPT_GO` are met with `NBD_OPT_EXPORT_NAME`: a server
//! without fixed newstyle gets nothing else (it may drop the connection on an option it
//! does not know), a fixed newstyle one gets it after refusing `NBD_OPT_GO` as
//! unsupported. Such an export has no advertised block sizes, and a server that refuses
//! it can only close the connection.
//!
//! The server is not trusted: every length it sends is checked against a bound before
//! anything is read or allocated for it, and every reply is checked against what was
//! asked. Timeouts are the stream's business (see `super::Timed`); a stream that times
//! out surfaces here as an I/O error of kind `TimedOut` or `WouldBlock`.

use std::io::{self, Read, Write};
use std::time::Duration;

use super::{BlockSizes, ExportInfo, NbdError, Replies};
use ublkd_proto::nbd::handshake::*;

/// The longest option reply ublkd reads: an `NBD_REP_INFO` carrying a name or an
/// error carrying a message, each a protocol string (at most 4096 bytes), plus its type.
const MAX_REPLY_BYTES: u32 = MAX_STRING_BYTES as u32 + 16;

/// The most replies to one option: `NBD_OPT_GO` gets one `NBD_REP_INFO` per
/// information type (four are defined) and a final reply; a server that sends more
/// than this is looping.
const MAX_REPLIES: usize = 32;

/// Negotiates `export` over `stream`, which has just connected, without TLS: [`greet`]
/// then [`choose_export`].
#[cfg(test)]
pub(super) fn negotiate<S: Read + Write>(
    stream: &mut S,
    export: &str,
    replies: Replies,
    limit: Duration,
) -> Result<ExportInfo, NbdError> {
    let greeting = greet(stream, limit)?;
    choose_export(stream, greeting, export, replies, limit)
}

/// What the server's greeting offered, which decides how the export is chosen.
#[derive(Debug, Clone, Copy)]
pub(super) struct Greeting {
    /// Fixed newstyle: options beyond `NBD_OPT_EXPORT_NAME`, each answered.
    pub fixed_newstyle: bool,
    /// Both sides agreed to leave out the zeroes after `NBD_OPT_EXPORT_NAME`'s reply.
    pub no_zeroes: bool,
}

/// Reads the server's greeting and sends the client's flags, on a stream that has just
/// connected.
pub(super) fn greet<S: Read + Write>(
    stream: &mut S,
    limit: Duration,
) -> Result<Greeting, NbdError> {
    Client { stream, limit }.greet()
}

/// `NBD_OPT_STARTTLS`: on success the server starts its TLS handshake, which the caller
/// runs before any further option.
pub(super) fn start_tls<S: Read + Write>(stream: &mut S, limit: Duration) -> Result<(), NbdError> {
    let mut client = Client { stream, limit };
    client.start_tls().inspect_err(|error| {
        if error.server_refused() {
            client.abort();
        }
    })
}

/// Asks for structured replies (if `replies` says so) and for `export`, as far as
/// `greeting` allows. On success the stream is in the transmission phase.
pub(super) fn choose_export<S: Read + Write>(
    stream: &mut S,
    greeting: Greeting,
    export: &str,
    replies: Replies,
    limit: Duration,
) -> Result<ExportInfo, NbdError> {
    let mut client = Client { stream, limit };
    match client.choose_export(greeting, export, replies) {
        Ok(info) => Ok(info),
        Err(error) => {
            // The protocol asks a client that gives up during option haggling for a
            // soft disconnect; a server that broke the protocol or went away gets none.
            if error.server_refused() {
                client.abort();
            }
            Err(error)
        }
    }
}

/// What `NBD_OPT_GO` learnt: the export's size, its transmission flags, its block sizes.
type Chosen = (u64, u16, Option<BlockSizes>);

struct Client<'a, S> {
    stream: &'a mut S,
    limit: Duration,
}

/// One option reply: its type and its data.
struct Reply {
    kind: u32,
    data: Vec<u8>,
}

impl<S: Read + Write> Client<'_, S> {
    fn greet(&mut self) -> Result<Greeting, NbdError> {
        const GREETING: &str = "reading the server's greeting";
        if self.read_u64(GREETING)? != NBDMAGIC {
            return Err(NbdError::NotNbd);
        }
        match self.read_u64(GREETING)? {
            IHAVEOPT => {}
            CLISERV_MAGIC => return Err(NbdError::Oldstyle),
            other => {
                return Err(NbdError::Protocol {
                    problem: format!(
                        "its greeting has {other:#018x} after NBDMAGIC, neither IHAVEOPT \
                         (newstyle) nor the oldstyle magic"
                    ),
                });
            }
        }
        let server_flags = self.read_u16(GREETING)?;
        let greeting = Greeting {
            fixed_newstyle: server_flags & FLAG_FIXED_NEWSTYLE != 0,
            no_zeroes: server_flags & FLAG_NO_ZEROES != 0,
        };
        let mut client_flags = 0;
        if greeting.fixed_newstyle {
            client_flags |= FLAG_C_FIXED_NEWSTYLE;
        }
        if greeting.no_zeroes {
            client_flags |= FLAG_C_NO_ZEROES;
        }
        self.send(&client_flags.to_be_bytes(), "sending the client flags")?;
        Ok(greeting)
    }

    fn start_tls(&mut self) -> Result<(), NbdError> {
        const STEP: &str = "asking for TLS (NBD_OPT_STARTTLS)";
        self.send_option(OPT_STARTTLS, &[], STEP)?;
        let reply = self.read_reply(OPT_STARTTLS, STEP)?;
        match reply.kind {
            REP_ACK if reply.data.is_empty() => Ok(()),
            kind if kind & REP_FLAG_ERROR != 0 => {
                Err(NbdError::NoTls { reply: reply_name(kind), message: message(&reply.data) })
            }
            kind => Err(NbdError::Protocol {
                problem: format!(
                    "it answered NBD_OPT_STARTTLS with {} and {} bytes",
                    reply_name(kind),
                    reply.data.len()
                ),
            }),
        }
    }

    fn choose_export(
        &mut self,
        greeting: Greeting,
        export: &str,
        replies: Replies,
    ) -> Result<ExportInfo, NbdError> {
        let name = export.as_bytes();
        if name.len() > MAX_STRING_BYTES {
            return Err(NbdError::Protocol {
                problem: format!("export name of {} bytes is too long", name.len()),
            });
        }
        let mut info = ExportInfo {
            size: 0,
            transmission_flags: 0,
            block_sizes: None,
            structured_replies: false,
            tls: false,
            export_name_option: false,
        };
        if greeting.fixed_newstyle {
            // Not asked, the server must answer with simple replies only (the
            // protocol forbids structured ones without the option).
            if replies == Replies::Structured {
                info.structured_replies = self.structured_replies()?;
            }
            if let Some((size, flags, block_sizes)) = self.go(export)? {
                (info.size, info.transmission_flags, info.block_sizes) = (size, flags, block_sizes);
                check_block_sizes(&info)?;
                return Ok(info);
            }
        }
        // Structured replies, if agreed, hold whichever option chose the export.
        (info.size, info.transmission_flags) = self.export_name(export, greeting.no_zeroes)?;
        info.export_name_option = true;
        Ok(info)
    }

    /// `NBD_OPT_EXPORT_NAME` for `export`: the export's size and flags, then (unless
    /// `no_zeroes` was agreed) 124 zero bytes. A server that will not serve the export
    /// closes the connection, the only refusal this option has.
    fn export_name(&mut self, export: &str, no_zeroes: bool) -> Result<(u64, u16), NbdError> {
        const STEP: &str = "choosing the export (NBD_OPT_EXPORT_NAME)";
        self.send_option(OPT_EXPORT_NAME, export.as_bytes(), STEP)?;
        let size = match self.read_u64(STEP) {
            Err(NbdError::Closed { .. }) => {
                return Err(NbdError::ExportNameRefused { export: export.to_owned() });
            }
            other => other?,
        };
        let flags = self.read_u16(STEP)?;
        if !no_zeroes {
            let mut zeroes = [0; EXPORT_NAME_ZEROES];
            self.read(&mut zeroes, STEP)?;
        }
        Ok((size, flags))
    }

    /// `NBD_OPT_STRUCTURED_REPLY`: whether the server will answer in chunks (READ data
    /// and holes at their offsets, errors with messages; the worker reads both kinds).
    /// A server that declines is served with simple replies.
    fn structured_replies(&mut self) -> Result<bool, NbdError> {
        const STEP: &str = "asking for structured replies (NBD_OPT_STRUCTURED_REPLY)";
        self.send_option(OPT_STRUCTURED_REPLY, &[], STEP)?;
        let reply = self.read_reply(OPT_STRUCTURED_REPLY, STEP)?;
        match reply.kind {
            REP_ACK => Ok(true),
            // Unsupported, refused by policy, or TLS first: the answer to the option
            // is no; NBD_OPT_GO then says whatever else the server has to say.
            kind if kind & REP_FLAG_ERROR != 0 => Ok(false),
            kind => Err(NbdError::Protocol {
                problem: format!("it answered NBD_OPT_STRUCTURED_REPLY with {}", reply_name(kind)),
            }),
        }
    }

    /// `NBD_OPT_GO` for `export`, asking for its size and flags and its block sizes
    /// (which commits ublkd to honour them, as the data path will). `None` if the server
    /// does not support the option.
    fn go(&mut self, export: &str) -> Result<Option<Chosen>, NbdError> {
        const STEP: &str = "asking for the export (NBD_OPT_GO)";
        let name = export.as_bytes();
        let mut data = Vec::with_capacity(4 + name.len() + 6);
        data.extend_from_slice(&(name.len() as u32).to_be_bytes());
        data.extend_from_slice(name);
        data.extend_from_slice(&2u16.to_be_bytes());
        data.extend_from_slice(&INFO_EXPORT.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        self.send_option(OPT_GO, &data, STEP)?;

        let mut export_info = None;
        let mut block_sizes = None;
        for _ in 0..MAX_REPLIES {
            let reply = self.read_reply(OPT_GO, STEP)?;
            match reply.kind {
                REP_INFO => {
                    let Some((kind, payload)) = split_u16(&reply.data) else {
                        return Err(NbdError::Protocol {
                            problem: format!(
                                "an NBD_REP_INFO of {} bytes has no information type",
                                reply.data.len()
                            ),
                        });
                    };
                    match kind {
                        INFO_EXPORT => {
                            let [s0, s1, s2, s3, s4, s5, s6, s7, f0, f1] = *payload else {
                                return Err(bad_info_length("NBD_INFO_EXPORT", 12, &reply.data));
                            };
                            let size = u64::from_be_bytes([s0, s1, s2, s3, s4, s5, s6, s7]);
                            export_info = Some((size, u16::from_be_bytes([f0, f1])));
                        }
                        INFO_BLOCK_SIZE => {
                            let [a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3] = *payload else {
                                return Err(bad_info_length(
                                    "NBD_INFO_BLOCK_SIZE",
                                    14,
                                    &reply.data,
                                ));
                            };
                            block_sizes = Some(BlockSizes {
                                min: u32::from_be_bytes([a0, a1, a2, a3]),
                                preferred: u32::from_be_bytes([b0, b1, b2, b3]),
                                max: u32::from_be_bytes([c0, c1, c2, c3]),
                            });
                        }
                        // ublkd does not use the canonical name or the description,
                        // and the protocol says to ignore types a client does not know.
                        INFO_NAME | INFO_DESCRIPTION => {}
                        _ => {}
                    }
                }
                REP_ACK => {
                    let Some((size, flags)) = export_info else {
                        return Err(NbdError::Protocol {
                            problem: "it accepted NBD_OPT_GO without sending NBD_INFO_EXPORT \
                                      (the export's size and flags), which the protocol requires"
                                .into(),
                        });
                    };
                    return Ok(Some((size, flags, block_sizes)));
                }
                REP_ERR_UNKNOWN => {
                    return Err(NbdError::UnknownExport {
                        export: export.to_owned(),
                        message: message(&reply.data),
                    });
                }
                REP_ERR_TLS_REQD => {
                    return Err(NbdError::TlsRequired { message: message(&reply.data) });
                }
                REP_ERR_SHUTDOWN => {
                    return Err(NbdError::ShuttingDown { message: message(&reply.data) });
                }
                // Only before an NBD_REP_INFO: a server that sent one knows the option.
                REP_ERR_UNSUP if export_info.is_none() && block_sizes.is_none() => {
                    return Ok(None);
                }
                kind if kind & REP_FLAG_ERROR != 0 => {
                    return Err(NbdError::Refused {
                        option: "NBD_OPT_GO",
                        reply: reply_name(kind),
                        message: message(&reply.data),
                    });
                }
                kind => {
                    return Err(NbdError::Protocol {
                        problem: format!("it answered NBD_OPT_GO with {}", reply_name(kind)),
                    });
                }
            }
        }
        Err(NbdError::Protocol {
            problem: format!("it sent more than {MAX_REPLIES} replies to NBD_OPT_GO"),
        })
    }

    fn send_option(
        &mut self,
        option: u32,
        data: &[u8],
        step: &'static str,
    ) -> Result<(), NbdError> {
        let mut message = Vec::with_capacity(16 + data.len());
        message.extend_from_slice(&IHAVEOPT.to_be_bytes());
        message.extend_from_slice(&option.to_be_bytes());
        message.extend_from_slice(&(data.len() as u32).to_be_bytes());
        message.extend_from_slice(data);
        self.send(&message, step)
    }

    /// Reads one reply to `option`, its data bounded by [`MAX_REPLY_BYTES`].
    fn read_reply(&mut self, option: u32, step: &'static str) -> Result<Reply, NbdError> {
        let magic = self.read_u64(step)?;
        if magic != OPTION_REPLY_MAGIC {
            return Err(NbdError::Protocol {
                problem: format!("an option reply starts with {magic:#018x}, not the reply magic"),
            });
        }
        let replied_to = self.read_u32(step)?;
        if replied_to != option {
            return Err(NbdError::Protocol {
                problem: format!("it replied to option {replied_to} while ublkd asked {option}"),
            });
        }
        let kind = self.read_u32(step)?;
        let len = self.read_u32(step)?;
        if len > MAX_REPLY_BYTES {
            return Err(NbdError::Protocol {
                problem: format!(
                    "an option reply claims {len} bytes of data; no reply ublkd asks for is \
                     longer than {MAX_REPLY_BYTES}"
                ),
            });
        }
        let mut data = vec![0; len as usize];
        self.read(&mut data, step)?;
        Ok(Reply { kind, data })
    }

    /// Best effort `NBD_OPT_ABORT`, without waiting for the server's ACK (the protocol
    /// lets either side close right after).
    fn abort(&mut self) {
        let _ = self.send_option(OPT_ABORT, &[], "aborting");
    }

    fn send(&mut self, bytes: &[u8], step: &'static str) -> Result<(), NbdError> {
        let limit = self.limit;
        self.stream
            .write_all(bytes)
            .and_then(|()| self.stream.flush())
            .map_err(|e| NbdError::from_io(e, step, limit))
    }

    fn read(&mut self, buf: &mut [u8], step: &'static str) -> Result<(), NbdError> {
        let limit = self.limit;
        self.stream.read_exact(buf).map_err(|e| NbdError::from_io(e, step, limit))
    }

    fn read_u16(&mut self, step: &'static str) -> Result<u16, NbdError> {
        let mut b = [0; 2];
        self.read(&mut b, step)?;
        Ok(u16::from_be_bytes(b))
    }

    fn read_u32(&mut self, step: &'static str) -> Result<u32, NbdError> {
        let mut b = [0; 4];
        self.read(&mut b, step)?;
        Ok(u32::from_be_bytes(b))
    }

    fn read_u64(&mut self, step: &'static str) -> Result<u64, NbdError> {
        let mut b = [0; 8];
        self.read(&mut b, step)?;
        Ok(u64::from_be_bytes(b))
    }
}

/// The information type at the front of an `NBD_REP_INFO`'s data, and the rest.
fn split_u16(data: &[u8]) -> Option<(u16, &[u8])> {
    match data {
        [a, b, rest @ ..] => Some((u16::from_be_bytes([*a, *b]), rest)),
        _ => None,
    }
}

fn bad_info_length(what: &str, want: usize, data: &[u8]) -> NbdError {
    NbdError::Protocol {
        problem: format!("its {what} is {} bytes long, the protocol says {want}", data.len()),
    }
}

/// A server's error message, for a one-line error of ours: at most 200 characters,
/// control characters (a newline in particular) replaced.
fn message(data: &[u8]) -> String {
    let text = String::from_utf8_lossy(data);
    let mut out: String =
        text.trim().chars().map(|c| if c.is_control() { '?' } else { c }).take(200).collect();
    if text.trim().chars().count() > 200 {
        out.push('…');
    }
    out
}

/// The protocol's rules for advertised block sizes ("Block size constraints"); a
/// server that breaks them cannot be trusted to mean what it says.
fn check_block_sizes(info: &ExportInfo) -> Result<(), NbdError> {
    let Some(b) = info.block_sizes else { return Ok(()) };
    let problem = if !b.min.is_power_of_two() || b.min > MAX_MIN_BLOCK_SIZE {
        format!("its minimum block size {} is not a power of two up to 65536", b.min)
    } else if !b.preferred.is_power_of_two() || b.preferred < b.min.max(512) {
        format!(
            "its preferred block size {} is not a power of two at least the minimum ({}) \
             and 512",
            b.preferred, b.min
        )
    } else if b.max != BLOCK_SIZE_UNLIMITED
        && (!b.max.is_multiple_of(b.min)
            || u64::from(b.max) < u64::from(b.preferred).min(info.size))
    {
        format!(
            "its maximum block size {} is not a multiple of the minimum ({}) at least the \
             preferred ({}) or the export's size",
            b.max, b.min, b.preferred
        )
    } else {
        return Ok(());
    };
    Err(NbdError::Protocol { problem })
}

impl NbdError {
    /// An I/O error at `step`, as the operator should read it.
    pub(super) fn from_io(error: io::Error, step: &'static str, limit: Duration) -> NbdError {
        if let Some(tls) = super::tls::tls_error(&error) {
            return NbdError::Tls { step, error: tls.clone(), hint: super::tls::hint(tls) };
        }
        match error.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
                NbdError::Timeout { step, secs: limit.as_secs_f64() }
            }
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe => NbdError::Closed { step },
            _ => NbdError::Io { step, source: error },
        }
    }
}

#[cfg(test)]
#[path = "handshake_tests.rs"]
mod tests;
