//! The io_uring SQEs of ublk's I/O commands on `/dev/ublkcN`: the batch commands PREP
//! and COMMIT (the batch header in the command area, the elements at `addr`) and the
//! multishot FETCH, whose two flags the `io-uring` crate cannot set (`uring_cmd_flags`
//! and `buf_group`), so they are written into the SQE's bytes here, at the offsets of
//! the kernel's `struct io_uring_sqe`; and the per-I/O commands FETCH_REQ and
//! COMMIT_AND_FETCH_REQ (a `struct ublksrv_io_cmd` in the command area).

use io_uring::{opcode, squeue, types};

use crate::batch::MAX_TAGS_PER_FETCH;
use crate::uapi::{self, AsBytes, UblkBatchIo, UblksrvIoCmd};

// `struct io_uring_sqe` offsets of the two fields set by hand.
const SQE_URING_CMD_FLAGS: usize = 28;
const SQE_BUF_GROUP: usize = 40;
const _: () = assert!(size_of::<squeue::Entry>() == 64);

fn command_area(header: UblkBatchIo) -> [u8; 16] {
    let mut cmd = [0u8; 16];
    cmd.copy_from_slice(header.as_bytes());
    cmd
}

/// A PREP or COMMIT on the registered file `ublkc` (`cmd_op`:
/// `UBLK_U_IO_PREP_IO_CMDS` or `UBLK_U_IO_COMMIT_IO_CMDS`). The kernel reads `elems`
/// while the command runs: it must stay valid until the command's CQE.
pub fn batch_cmd(ublkc: u32, cmd_op: u32, header: UblkBatchIo, elems: &[u8]) -> squeue::Entry {
    opcode::UringCmd16::new(types::Fixed(ublkc), cmd_op)
        .cmd(command_area(header))
        .addr(Some(elems.as_ptr() as u64))
        .build()
}

/// A per-I/O command (`cmd_op`: `UBLK_U_IO_FETCH_REQ` or
/// `UBLK_U_IO_COMMIT_AND_FETCH_REQ`) on the registered file `ublkc`. Everything the
/// kernel needs is in the command area: nothing outside the SQE must stay alive.
pub fn io_cmd(ublkc: u32, cmd_op: u32, cmd: UblksrvIoCmd) -> squeue::Entry {
    let mut area = [0u8; 16];
    area.copy_from_slice(cmd.as_bytes());
    opcode::UringCmd16::new(types::Fixed(ublkc), cmd_op).cmd(area).build()
}

/// A multishot FETCH for queue `q_id` (of depth `depth`) on the registered file
/// `ublkc`, taking its tag buffers from provided-buffer group `bgid`.
pub fn fetch(ublkc: u32, q_id: u16, depth: u16, bgid: u16) -> squeue::Entry {
    let header = UblkBatchIo {
        q_id,
        flags: 0,
        nr_elem: depth.min(MAX_TAGS_PER_FETCH as u16),
        elem_bytes: 2,
        ..UblkBatchIo::default()
    };
    let entry = opcode::UringCmd16::new(types::Fixed(ublkc), uapi::UBLK_U_IO_FETCH_IO_CMDS)
        .cmd(command_area(header))
        .build()
        .flags(squeue::Flags::BUFFER_SELECT);
    // SAFETY: `squeue::Entry` is a `#[repr(C)]` wrapper of the kernel's 64-byte
    // `io_uring_sqe` (size asserted above), made of integers and unions of integers:
    // every byte is initialised and any byte pattern is a valid value, so it can be
    // viewed as bytes and back.
    let mut raw: [u8; 64] = unsafe { std::mem::transmute(entry) };
    let flags = u32::from_ne_bytes(
        raw[SQE_URING_CMD_FLAGS..SQE_URING_CMD_FLAGS + 4].try_into().expect("4 bytes"),
    ) | uapi::IORING_URING_CMD_MULTISHOT;
    raw[SQE_URING_CMD_FLAGS..SQE_URING_CMD_FLAGS + 4].copy_from_slice(&flags.to_ne_bytes());
    raw[SQE_BUF_GROUP..SQE_BUF_GROUP + 2].copy_from_slice(&bgid.to_ne_bytes());
    // SAFETY: as above.
    unsafe { std::mem::transmute::<[u8; 64], squeue::Entry>(raw) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(e: squeue::Entry) -> [u8; 64] {
        // SAFETY: see `fetch`.
        unsafe { std::mem::transmute(e) }
    }

    #[test]
    fn fetch_sets_multishot_buffer_group_and_header() {
        let raw = bytes(fetch(0, 3, 256, 9));
        assert_eq!(raw[0], opcode::UringCmd16::CODE);
        assert_eq!(
            u32::from_ne_bytes(raw[28..32].try_into().unwrap()),
            uapi::IORING_URING_CMD_MULTISHOT
        );
        assert_eq!(u16::from_ne_bytes([raw[40], raw[41]]), 9);
        assert_ne!(raw[1] & (1 << 5), 0, "IOSQE_BUFFER_SELECT");
        assert_eq!(u16::from_ne_bytes([raw[48], raw[49]]), 3, "q_id in the command area");
        assert_eq!(u16::from_ne_bytes([raw[52], raw[53]]), 128, "nr_elem capped at one CQE's tags");
        assert_eq!(raw[54], 2, "elem_bytes: one u16 tag");
    }

    #[test]
    fn io_cmd_carries_queue_tag_result_and_buffer_in_the_command_area() {
        let cmd = UblksrvIoCmd { q_id: 2, tag: 17, result: -5, addr: 0x7f00_1000 };
        let raw = bytes(io_cmd(1, uapi::UBLK_U_IO_COMMIT_AND_FETCH_REQ, cmd));
        assert_eq!(raw[0], opcode::UringCmd16::CODE);
        assert_ne!(raw[1] & 1, 0, "IOSQE_FIXED_FILE");
        assert_eq!(i32::from_ne_bytes(raw[4..8].try_into().unwrap()), 1, "the fixed file");
        assert_eq!(
            u32::from_ne_bytes(raw[8..12].try_into().unwrap()),
            uapi::UBLK_U_IO_COMMIT_AND_FETCH_REQ
        );
        assert_eq!(u16::from_ne_bytes([raw[48], raw[49]]), 2);
        assert_eq!(u16::from_ne_bytes([raw[50], raw[51]]), 17);
        assert_eq!(i32::from_ne_bytes(raw[52..56].try_into().unwrap()), -5);
        assert_eq!(u64::from_ne_bytes(raw[56..64].try_into().unwrap()), 0x7f00_1000);
    }

    #[test]
    fn batch_cmd_points_at_the_elements() {
        let elems = [0u8; 32];
        let header = UblkBatchIo { q_id: 1, nr_elem: 2, elem_bytes: 16, ..Default::default() };
        let raw = bytes(batch_cmd(0, uapi::UBLK_U_IO_COMMIT_IO_CMDS, header, &elems));
        assert_eq!(
            u32::from_ne_bytes(raw[8..12].try_into().unwrap()),
            uapi::UBLK_U_IO_COMMIT_IO_CMDS
        );
        assert_eq!(u64::from_ne_bytes(raw[16..24].try_into().unwrap()), elems.as_ptr() as u64);
        assert_eq!(raw[54], 16);
    }
}
