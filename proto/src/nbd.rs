//! The NBD protocol's transmission phase as ublkd speaks it: the request a worker
//! sends for each ublk request and the simple reply it reads back
//! (<https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>, "Transmission").
//! The supervisor negotiates the connection (its `nbd` module) without structured
//! replies, so every reply is the 16-byte simple one, followed by the data of a
//! successful READ. Every integer on the wire is big-endian.

/// The magic of every request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// The magic of every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

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

/// A reply header that is not a simple reply: the connection cannot be trusted past it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the server sent a reply with magic {0:#010x}, not a simple reply's (structured replies were not negotiated)"
)]
pub struct BadReplyMagic(pub u32);

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

    /// The errno to complete the request with: NBD's error values are Linux errnos
    /// ("Error values"), of which a server may send only a few; anything else is EIO.
    pub fn errno(&self) -> i32 {
        const KNOWN: [i32; 7] = [
            libc::EPERM,
            libc::EIO,
            libc::ENOMEM,
            libc::EINVAL,
            libc::ENOSPC,
            libc::EOVERFLOW,
            libc::ENOTSUP,
        ];
        let e = i32::try_from(self.error).unwrap_or(libc::EIO);
        if KNOWN.contains(&e) { e } else { libc::EIO }
    }
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
}
