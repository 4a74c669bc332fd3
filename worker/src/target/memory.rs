//! `memory`: a RAM disk whose pages live in a memfd the supervisor created and holds,
//! so the data outlives any worker. The worker maps it shared and copies between it and
//! the tags' buffers.

use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};

use memmap2::MmapRaw;
use ublkd_proto::uapi::{
    UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ, UBLK_IO_OP_WRITE,
    UBLK_IO_OP_WRITE_ZEROES,
};

use super::{IoReq, Step, Target, TargetError};

#[derive(Debug)]
pub struct MemoryTarget {
    map: MmapRaw,
    size: u64,
}

impl MemoryTarget {
    pub fn new(fd: OwnedFd, size: u64) -> Result<Self, TargetError> {
        let file = File::from(fd);
        let got = file.metadata()?.len();
        if got < size {
            return Err(TargetError::MemoryTooSmall { got, want: size });
        }
        let map = MmapRaw::map_raw(&file)?;
        Ok(MemoryTarget { map, size })
    }

    /// The device range `[offset, offset+len)` in the mapping. `IoReq::from_desc`
    /// checked it against the device size, which `new` checked against the mapping.
    fn range(&self, req: &IoReq) -> *mut u8 {
        debug_assert!(req.offset + u64::from(req.len) <= self.size);
        self.map.as_mut_ptr().wrapping_add(req.offset as usize)
    }
}

impl Target for MemoryTarget {
    fn start(&self, req: &IoReq) -> Step {
        let len = req.len as usize;
        match req.op {
            UBLK_IO_OP_READ => {
                // SAFETY: both ranges are `len` bytes inside live mappings (the device
                // range: see `range`; the tag buffer: `IoReq`'s contract) and cannot
                // overlap (different mappings). Only this thread touches this tag's
                // buffer and, for this request, this device range.
                unsafe { std::ptr::copy_nonoverlapping(self.range(req), req.buf, len) };
                Step::Done(req.len as i32)
            }
            UBLK_IO_OP_WRITE => {
                // SAFETY: as for READ, in the other direction.
                unsafe { std::ptr::copy_nonoverlapping(req.buf, self.range(req), len) };
                Step::Done(req.len as i32)
            }
            UBLK_IO_OP_DISCARD | UBLK_IO_OP_WRITE_ZEROES => {
                // SAFETY: the device range is `len` bytes inside the mapping.
                unsafe { std::ptr::write_bytes(self.range(req), 0, len) };
                Step::Done(0)
            }
            UBLK_IO_OP_FLUSH => Step::Done(0),
            _ => Step::Done(-libc::EOPNOTSUPP),
        }
    }

    fn on_cqe(&self, _req: &IoReq, res: i32, _done: &mut u32) -> Step {
        Step::Done(res)
    }

    fn fixed_file(&self, _thread: usize) -> Option<BorrowedFd<'_>> {
        None
    }
}
