//! The NBD protocol's transmission phase as ublkd speaks it: the request a worker
//! sends for each ublk request and the replies it reads back
//! (<https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>, "Transmission"):
//! the 16-byte simple reply (followed by the data of a successful READ), and, where the
//! supervisor negotiated them (its `nbd` module asks every server), structured replies:
//! chunks of data, holes (read as zeroes, not sent) and errors, the last one marked
//! done. Every integer on the wire is big-endian.

pub mod handshake;

/// The magic of every request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// The magic of every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// The magic of every structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// "Structured reply flags" and "types".
/// The request's last chunk.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Types with this bit are errors, known or not.
pub const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_ERROR_BIT | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_ERROR_BIT | 2;

// "Request types".
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
/// The client's soft disconnect: no reply; the server closes the connection.
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

// "Command flags".
/// Forced unit access: the write is durable before it is answered.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// WRITE_ZEROES must allocate (not punch a hole).
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Bytes of a request header.
pub const REQUEST_BYTES: usize = 28;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Bytes of a structured reply chunk's header.
pub const CHUNK_HEADER_BYTES: usize = 20;
/// The most payload of a chunk that carries no READ data which a client reads: an
/// error's message is a protocol string of at most 4096 bytes, plus its fixed fields.
pub const MAX_CHUNK_META_BYTES: u32 = 4096 + 16;

/// One request's header: `length` bytes at `offset`, answered with `cookie`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// A simple reply's header: `error` is the server's NBD error (0 for success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
}

/// A reply header that is neither a simple reply nor a structured chunk: the
/// connection cannot be trusted past it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the server sent a reply with magic {0:#010x}, neither a simple nor a structured reply's")]
pub struct BadReplyMagic(pub u32);

/// What a reply header's magic says it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    /// [`SIMPLE_REPLY_BYTES`] of header.
    Simple,
    /// [`CHUNK_HEADER_BYTES`] of header.
    Chunk,
}

impl ReplyKind {
    pub fn of_magic(magic: [u8; 4]) -> Result<ReplyKind, BadReplyMagic> {
        match u32::from_be_bytes(magic) {
            SIMPLE_REPLY_MAGIC => Ok(ReplyKind::Simple),
            STRUCTURED_REPLY_MAGIC => Ok(ReplyKind::Chunk),
            other => Err(BadReplyMagic(other)),
        }
    }

    pub fn header_bytes(self) -> usize {
        match self {
            ReplyKind::Simple => SIMPLE_REPLY_BYTES,
            ReplyKind::Chunk => CHUNK_HEADER_BYTES,
        }
    }
}

/// A structured reply chunk's header: `length` bytes of payload follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub length: u32,
}

/// What one chunk says, from its header and the start of its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Nothing (only as the last chunk).
    None,
    /// `len` bytes of the READ's data at device offset `offset` follow.
    Data { offset: u64, len: u32 },
    /// `len` bytes at `offset` read as zeroes; nothing follows.
    Hole { offset: u64, len: u32 },
    /// The request failed with NBD error `error`.
    Error { error: u32 },
}

/// A chunk that breaks the protocol: the connection cannot be trusted past it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("the server sent a chunk of unknown type {0:#06x}")]
    UnknownType(u16),
    #[error(
        "the server sent a chunk of type {kind:#06x} with {length} bytes of payload, which that type cannot have"
    )]
    BadLength { kind: u16, length: u32 },
    #[error("the server sent an NBD_REPLY_TYPE_NONE chunk that is not the last")]
    NoneNotDone,
}

impl ChunkHeader {
    pub fn decode(b: &[u8; CHUNK_HEADER_BYTES]) -> Result<ChunkHeader, BadReplyMagic> {
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != STRUCTURED_REPLY_MAGIC {
            return Err(BadReplyMagic(magic));
        }
        let mut cookie = [0u8; 8];
        cookie.copy_from_slice(&b[8..16]);
        Ok(ChunkHeader {
            flags: u16::from_be_bytes([b[4], b[5]]),
            kind: u16::from_be_bytes([b[6], b[7]]),
            cookie: u64::from_be_bytes(cookie),
            length: u32::from_be_bytes([b[16], b[17], b[18], b[19]]),
        })
    }

    pub fn done(&self) -> bool {
        self.flags & REPLY_FLAG_DONE != 0
    }

    /// How much of the payload [`ChunkHeader::chunk`] needs: a data chunk's offset,
    /// else all of it (bounded by [`MAX_CHUNK_META_BYTES`], checked there).
    pub fn meta_bytes(&self) -> u32 {
        if self.kind == REPLY_TYPE_OFFSET_DATA { 8 } else { self.length }
    }

    /// What the chunk says, given the first [`ChunkHeader::meta_bytes`] of its payload.
    pub fn chunk(&self, meta: &[u8]) -> Result<Chunk, ChunkError> {
        let bad = || ChunkError::BadLength { kind: self.kind, length: self.length };
        let word =
            |at: usize| u32::from_be_bytes([meta[at], meta[at + 1], meta[at + 2], meta[at + 3]]);
        let offset = || {
            let mut o = [0u8; 8];
            o.copy_from_slice(&meta[..8]);
            u64::from_be_bytes(o)
        };
        if self.kind != REPLY_TYPE_OFFSET_DATA && self.length > MAX_CHUNK_META_BYTES {
            return Err(bad());
        }
        if meta.len() < self.meta_bytes().min(self.length) as usize {
            return Err(bad());
        }
        match self.kind {
            REPLY_TYPE_NONE if self.length != 0 => Err(bad()),
            REPLY_TYPE_NONE if !self.done() => Err(ChunkError::NoneNotDone),
            REPLY_TYPE_NONE => Ok(Chunk::None),
            REPLY_TYPE_OFFSET_DATA if self.length <= 8 => Err(bad()),
            REPLY_TYPE_OFFSET_DATA => Ok(Chunk::Data { offset: offset(), len: self.length - 8 }),
            REPLY_TYPE_OFFSET_HOLE if self.length != 12 => Err(bad()),
            REPLY_TYPE_OFFSET_HOLE => Ok(Chunk::Hole { offset: offset(), len: word(8) }),
            kind if kind & REPLY_TYPE_ERROR_BIT != 0 => {
                // The error, the message's length, the message (and for ERROR_OFFSET the
                // offset after it): the lengths must add up for the known types.
                if self.length < 6 {
                    return Err(bad());
                }
                let message = u32::from(u16::from_be_bytes([meta[4], meta[5]]));
                let fixed = if kind == REPLY_TYPE_ERROR_OFFSET { 14 } else { 6 };
                let known = matches!(kind, REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET);
                if known && self.length != fixed + message {
                    return Err(bad());
                }
                Ok(Chunk::Error { error: word(0) })
            }
            kind => Err(ChunkError::UnknownType(kind)),
        }
    }
}

impl SimpleReply {
    pub fn decode(b: &[u8; SIMPLE_REPLY_BYTES]) -> Result<SimpleReply, BadReplyMagic> {
        let word = |at: usize| u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let magic = word(0);
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(BadReplyMagic(magic));
        }
        let mut cookie = [0u8; 8];
        cookie.copy_from_slice(&b[8..16]);
        Ok(SimpleReply { error: word(4), cookie: u64::from_be_bytes(cookie) })
    }

    /// The errno to complete the request with (see [`errno`]).
    pub fn errno(&self) -> i32 {
        errno(self.error)
    }
}

/// The errno to complete a request with for NBD error `error`: NBD's error values are
/// Linux errnos ("Error values"), of which a server may send only a few; anything else
/// (0 in an error chunk included) is EIO.
pub fn errno(error: u32) -> i32 {
    const KNOWN: [i32; 7] = [
        libc::EPERM,
        libc::EIO,
        libc::ENOMEM,
        libc::EINVAL,
        libc::ENOSPC,
        libc::EOVERFLOW,
        libc::ENOTSUP,
    ];
    let e = i32::try_from(error).unwrap_or(libc::EIO);
    if KNOWN.contains(&e) { e } else { libc::EIO }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_laid_out_as_the_protocol_says() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: 4096,
            length: 512,
        };
        let b = r.encode();
        assert_eq!(&b[0..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(&b[4..8], &[0, 1, 0, 1]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[16..24], &[0, 0, 0, 0, 0, 0, 0x10, 0]);
        assert_eq!(&b[24..28], &[0, 0, 2, 0]);
    }

    #[test]
    fn a_simple_reply_decodes_and_maps_its_error() {
        let mut b = [0u8; SIMPLE_REPLY_BYTES];
        b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&28u32.to_be_bytes());
        b[8..16].copy_from_slice(&7u64.to_be_bytes());
        let r = SimpleReply::decode(&b).unwrap();
        assert_eq!((r.error, r.cookie, r.errno()), (28, 7, libc::ENOSPC));
        // ESHUTDOWN (108) is the server going away; the request still fails as EIO.
        assert_eq!(SimpleReply { error: 108, cookie: 0 }.errno(), libc::EIO);
        b[0] = 0x66;
        assert!(SimpleReply::decode(&b).unwrap_err().to_string().contains("0x66446698"));
    }

    fn chunk_header(flags: u16, kind: u16, length: u32) -> ChunkHeader {
        let mut b = [0u8; CHUNK_HEADER_BYTES];
        b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&flags.to_be_bytes());
        b[6..8].copy_from_slice(&kind.to_be_bytes());
        b[8..16].copy_from_slice(&9u64.to_be_bytes());
        b[16..20].copy_from_slice(&length.to_be_bytes());
        assert_eq!(ReplyKind::of_magic([b[0], b[1], b[2], b[3]]), Ok(ReplyKind::Chunk));
        let h = ChunkHeader::decode(&b).unwrap();
        assert_eq!((h.flags, h.kind, h.cookie, h.length), (flags, kind, 9, length));
        h
    }

    #[test]
    fn chunks_decode_to_what_they_say() {
        let mut meta = 4096u64.to_be_bytes().to_vec();
        let data = chunk_header(0, REPLY_TYPE_OFFSET_DATA, 8 + 512);
        assert_eq!(data.meta_bytes(), 8);
        assert_eq!(data.chunk(&meta), Ok(Chunk::Data { offset: 4096, len: 512 }));
        meta.extend_from_slice(&1024u32.to_be_bytes());
        let hole = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, 12);
        assert!(hole.done());
        assert_eq!(hole.chunk(&meta), Ok(Chunk::Hole { offset: 4096, len: 1024 }));
        let none = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        assert_eq!(none.chunk(&[]), Ok(Chunk::None));
        let mut error = 28u32.to_be_bytes().to_vec();
        error.extend_from_slice(&3u16.to_be_bytes());
        error.extend_from_slice(b"full");
        let e = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 9);
        assert_eq!(e.chunk(&error), Ok(Chunk::Error { error: 28 }));
        assert_eq!(errno(28), libc::ENOSPC);
        assert_eq!(errno(0), libc::EIO);
        // An unknown error type is an error all the same.
        let odd = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR_BIT | 77, 10);
        assert_eq!(odd.chunk(&error), Ok(Chunk::Error { error: 28 }));
    }

    #[test]
    fn chunks_that_break_the_protocol_are_refused() {
        let meta = [0u8; 16];
        let cases = [
            (chunk_header(0, REPLY_TYPE_NONE, 0), ChunkError::NoneNotDone),
            (
                chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 4),
                ChunkError::BadLength { kind: 0, length: 4 },
            ),
            (
                chunk_header(0, REPLY_TYPE_OFFSET_DATA, 8),
                ChunkError::BadLength { kind: 1, length: 8 },
            ),
            (
                chunk_header(0, REPLY_TYPE_OFFSET_HOLE, 16),
                ChunkError::BadLength { kind: 2, length: 16 },
            ),
            // The message's length does not add up.
            (
                chunk_header(0, REPLY_TYPE_ERROR, 7),
                ChunkError::BadLength { kind: REPLY_TYPE_ERROR, length: 7 },
            ),
            (
                chunk_header(0, REPLY_TYPE_ERROR, MAX_CHUNK_META_BYTES + 1),
                ChunkError::BadLength { kind: REPLY_TYPE_ERROR, length: MAX_CHUNK_META_BYTES + 1 },
            ),
            (chunk_header(0, 5, 0), ChunkError::UnknownType(5)),
        ];
        for (h, want) in cases {
            assert_eq!(h.chunk(&meta), Err(want.clone()), "{h:?}");
        }
        assert_eq!(ReplyKind::of_magic([1, 2, 3, 4]), Err(BadReplyMagic(0x0102_0304)));
    }
}
