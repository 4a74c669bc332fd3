//! `loop`: a file or block device, read and written through io_uring on the backing
//! fd the supervisor opened (O_DIRECT unless the filesystem refused it). FLUSH is
//! `fdatasync`; DISCARD and WRITE_ZEROES punch a hole (reads of it return zeroes, on
//! files and block devices alike).

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use io_uring::{opcode, types};
use ublkd_proto::uapi::{
    UBLK_IO_F_FUA, UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ, UBLK_IO_OP_WRITE,
    UBLK_IO_OP_WRITE_ZEROES,
};

use super::{IoReq, Step, TARGET_FIXED_FD, Target, TargetError};

#[derive(Debug)]
pub struct LoopTarget {
    file: File,
}

impl LoopTarget {
    pub fn new(fd: OwnedFd, size: u64) -> Result<Self, TargetError> {
        let file = File::from(fd);
        let got = backing_size(&file)?;
        if got < size {
            return Err(TargetError::LoopTooSmall { got, want: size });
        }
        Ok(LoopTarget { file })
    }

    /// The SQE that moves the part of `req` after its first `done` bytes.
    fn transfer(req: &IoReq, done: u32) -> Step {
        let fd = types::Fixed(TARGET_FIXED_FD);
        let buf = req.buf.wrapping_add(done as usize);
        let len = req.len - done;
        let offset = req.offset + u64::from(done);
        // Forced unit access: this write is durable before it completes.
        let rw_flags = if req.flags & UBLK_IO_F_FUA != 0 { libc::RWF_DSYNC } else { 0 };
        let sqe = match (req.op == UBLK_IO_OP_READ, req.buf_index) {
            (true, None) => opcode::Read::new(fd, buf, len).offset(offset).build(),
            (false, None) => {
                opcode::Write::new(fd, buf, len).offset(offset).rw_flags(rw_flags).build()
            }
            // Zero copy: the address is an offset into the registered request.
            (true, Some(index)) => opcode::ReadFixed::new(
                fd,
                std::ptr::without_provenance_mut(done as usize),
                len,
                index,
            )
            .offset(offset)
            .build(),
            (false, Some(index)) => {
                opcode::WriteFixed::new(fd, std::ptr::without_provenance(done as usize), len, index)
                    .offset(offset)
                    .rw_flags(rw_flags)
                    .build()
            }
        };
        Step::Submit(sqe)
    }
}

/// Size in bytes of a regular file or a block device.
fn backing_size(file: &File) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    // A block device's size is where its end is.
    let mut f = file.try_clone()?;
    f.seek(SeekFrom::End(0))
}

impl Target for LoopTarget {
    fn start(&self, req: &IoReq) -> Step {
        let fd = types::Fixed(TARGET_FIXED_FD);
        match req.op {
            UBLK_IO_OP_READ | UBLK_IO_OP_WRITE => Self::transfer(req, 0),
            UBLK_IO_OP_FLUSH => {
                Step::Submit(opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build())
            }
            UBLK_IO_OP_DISCARD | UBLK_IO_OP_WRITE_ZEROES => Step::Submit(
                opcode::Fallocate::new(fd, u64::from(req.len))
                    .offset(req.offset)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build(),
            ),
            _ => Step::Done(-libc::EOPNOTSUPP),
        }
    }

    fn on_cqe(&self, req: &IoReq, res: i32, done: &mut u32) -> Step {
        match req.op {
            UBLK_IO_OP_READ | UBLK_IO_OP_WRITE => {
                if res < 0 {
                    return Step::Done(res);
                }
                if res == 0 {
                    // End of file inside the device: the backing file shrank.
                    return Step::Done(-libc::EIO);
                }
                *done += res as u32;
                if *done >= req.len {
                    Step::Done(req.len as i32)
                } else {
                    Self::transfer(req, *done)
                }
            }
            _ => Step::Done(res.min(0)),
        }
    }

    fn fixed_file(&self, _thread: usize) -> Option<BorrowedFd<'_>> {
        Some(self.file.as_fd())
    }
}
