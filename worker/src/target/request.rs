//! A request as targets see it, and the one place a descriptor from the kernel is
//! checked: [`IoReq::from_desc`]. Every target relies on what it checks.

use ublkd_proto::uapi::{
    self, UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ, UBLK_IO_OP_WRITE,
    UBLK_IO_OP_WRITE_ZEROES,
};

/// One request, checked by [`IoReq::from_desc`]: `offset + len` is inside the device
/// and `len` fits the tag's buffer.
#[derive(Debug, Clone, Copy)]
pub struct IoReq {
    /// `UBLK_IO_OP_*`.
    pub op: u8,
    /// `UBLK_IO_F_*`.
    pub flags: u32,
    /// Byte offset on the device.
    pub offset: u64,
    /// Bytes.
    pub len: u32,
    /// The tag's buffer, `len` bytes valid (at least): WRITE data is in it, READ data
    /// goes into it. Null with zero copy.
    pub buf: *mut u8,
    /// Zero copy: the request's own pages, registered by the kernel at this index of
    /// the ring's buffer table (address 0 is their start); READ_FIXED/WRITE_FIXED move
    /// the data.
    pub buf_index: Option<u16>,
    /// Where a target that finishes the request from another thread posts its result
    /// (see [`super::Step::Pending`]).
    pub reply: Reply,
}

/// The completion a queue thread waits for to finish a pending request: `user_data`
/// posted into the ring `ring_fd` (`IORING_OP_MSG_RING`), with the result as `res`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    pub ring_fd: std::os::fd::RawFd,
    pub user_data: u64,
    /// The queue thread's number (its plan's index).
    pub thread: u16,
}

impl Reply {
    /// Set by the queue loop before the target sees the request.
    pub const UNSET: Reply = Reply { ring_fd: -1, user_data: 0, thread: 0 };
}

/// What a request is checked against.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The device's size.
    pub size_bytes: u64,
    /// The size of each tag's buffer: the most one READ or WRITE may move.
    pub buf_bytes: u64,
}

/// A descriptor the worker does not serve: outside the device, larger than a tag's
/// buffer, or an operation it does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("request outside the device or unsupported: op {op}, {len_bytes} bytes at {offset}")]
pub struct BadRequest {
    pub op: u8,
    pub offset: u64,
    pub len_bytes: u64,
}

impl BadRequest {
    /// The result to COMMIT for it: EIO for a READ or WRITE, EOPNOTSUPP otherwise.
    pub fn result(&self) -> i32 {
        if matches!(self.op, UBLK_IO_OP_READ | UBLK_IO_OP_WRITE) {
            -libc::EIO
        } else {
            -libc::EOPNOTSUPP
        }
    }
}

impl IoReq {
    /// The request `desc` describes, with its data in `buf` (copy) or at `buf_index`
    /// of the ring's buffer table (zero copy), if it passes every check a target
    /// relies on.
    pub fn from_desc(
        desc: &uapi::UblksrvIoDesc,
        bounds: Bounds,
        buf: *mut u8,
        buf_index: Option<u16>,
    ) -> Result<IoReq, BadRequest> {
        let op = desc.op();
        let len_bytes = u64::from(desc.nr_sectors) << 9;
        let offset = desc.start_sector.saturating_mul(512);
        let inside = || offset.checked_add(len_bytes).is_some_and(|end| end <= bounds.size_bytes);
        let valid = match op {
            UBLK_IO_OP_READ | UBLK_IO_OP_WRITE => len_bytes <= bounds.buf_bytes && inside(),
            UBLK_IO_OP_DISCARD | UBLK_IO_OP_WRITE_ZEROES => {
                inside() && len_bytes <= u64::from(u32::MAX)
            }
            UBLK_IO_OP_FLUSH => true,
            _ => false,
        };
        if !valid {
            return Err(BadRequest { op, offset, len_bytes });
        }
        Ok(IoReq {
            op,
            flags: desc.flags(),
            offset,
            len: len_bytes as u32,
            buf,
            buf_index,
            reply: Reply::UNSET,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds { size_bytes: 1 << 20, buf_bytes: 64 << 10 };

    fn desc(op: u8, start_sector: u64, nr_sectors: u32) -> uapi::UblksrvIoDesc {
        uapi::UblksrvIoDesc { op_flags: u32::from(op), nr_sectors, start_sector, addr: 0 }
    }

    fn check(d: uapi::UblksrvIoDesc) -> Result<IoReq, BadRequest> {
        IoReq::from_desc(&d, BOUNDS, std::ptr::null_mut(), None)
    }

    #[test]
    fn a_read_inside_the_device_and_the_buffer_passes_in_bytes() {
        let req = check(desc(UBLK_IO_OP_READ, 8, 16)).unwrap();
        assert_eq!((req.op, req.offset, req.len), (UBLK_IO_OP_READ, 4096, 8192));
    }

    #[test]
    fn flags_are_kept_in_place() {
        let mut d = desc(UBLK_IO_OP_WRITE, 0, 8);
        d.op_flags |= uapi::UBLK_IO_F_FUA;
        assert_eq!(check(d).unwrap().flags, uapi::UBLK_IO_F_FUA);
    }

    #[test]
    fn a_transfer_past_the_end_or_the_buffer_fails_with_eio() {
        let last = (BOUNDS.size_bytes >> 9) - 8;
        assert!(check(desc(UBLK_IO_OP_WRITE, last, 8)).is_ok());
        for d in [
            desc(UBLK_IO_OP_WRITE, last, 16),
            desc(UBLK_IO_OP_READ, 0, (BOUNDS.buf_bytes >> 9) as u32 + 1),
            desc(UBLK_IO_OP_READ, u64::MAX, 1),
        ] {
            let bad = check(d).unwrap_err();
            assert_eq!(bad.result(), -libc::EIO, "{bad}");
        }
    }

    #[test]
    fn a_discard_may_exceed_the_buffer_but_not_the_device() {
        let all = (BOUNDS.size_bytes >> 9) as u32;
        assert_eq!(check(desc(UBLK_IO_OP_DISCARD, 0, all)).unwrap().len, 1 << 20);
        let bad = check(desc(UBLK_IO_OP_WRITE_ZEROES, 1, all)).unwrap_err();
        assert_eq!(bad.result(), -libc::EOPNOTSUPP);
    }

    #[test]
    fn a_flush_always_passes_and_an_unknown_op_never_does() {
        assert!(check(desc(UBLK_IO_OP_FLUSH, u64::MAX, u32::MAX)).is_ok());
        let bad = check(desc(0xfe, 0, 1)).unwrap_err();
        assert_eq!((bad.op, bad.result()), (0xfe, -libc::EOPNOTSUPP));
    }
}
