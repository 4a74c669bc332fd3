//! The ublk kernel interface, written by hand from Linux 7.2's
//! `include/uapi/linux/ublk_cmd.h` (Debian `linux-libc-dev` 7.2.13-1).
//!
//! This module is the project's one source of truth for the kernel's structs and
//! constants. Every struct is `#[repr(C)]` with compile-time size and offset asserts
//! below it, and `proto/tests/uapi_header.rs` compiles a C program against the real
//! header and compares every size, offset and constant with the values here.
//!
//! Names follow the header (in Rust case) so that a reader can grep one against the
//! other. Only what ublkd uses, or may need to recognise in a feature mask, is here.

use std::mem::{offset_of, size_of};

// ---------------------------------------------------------------------------------------
// ioctl encoding (`_IOR`/`_IOWR` from asm-generic/ioctl.h), used for `UBLK_U_*` opcodes.

const IOC_NRBITS: u32 = 8;
const IOC_TYPEBITS: u32 = 8;
const IOC_SIZEBITS: u32 = 14;
const IOC_NRSHIFT: u32 = 0;
const IOC_TYPESHIFT: u32 = IOC_NRSHIFT + IOC_NRBITS;
const IOC_SIZESHIFT: u32 = IOC_TYPESHIFT + IOC_TYPEBITS;
const IOC_DIRSHIFT: u32 = IOC_SIZESHIFT + IOC_SIZEBITS;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

const fn ioc(dir: u32, ty: u8, nr: u8, size: usize) -> u32 {
    (dir << IOC_DIRSHIFT)
        | ((ty as u32) << IOC_TYPESHIFT)
        | ((nr as u32) << IOC_NRSHIFT)
        | ((size as u32) << IOC_SIZESHIFT)
}

const fn ior<T>(nr: u8) -> u32 {
    ioc(IOC_READ, b'u', nr, size_of::<T>())
}

const fn iowr<T>(nr: u8) -> u32 {
    ioc(IOC_READ | IOC_WRITE, b'u', nr, size_of::<T>())
}

// ---------------------------------------------------------------------------------------
// Control commands, issued on `/dev/ublk-control` as io_uring URING_CMD (SQE128).

/// Legacy command numbers; the `UBLK_U_CMD_*` opcodes below encode them.
pub const UBLK_CMD_GET_QUEUE_AFFINITY: u8 = 0x01;
pub const UBLK_CMD_GET_DEV_INFO: u8 = 0x02;
pub const UBLK_CMD_ADD_DEV: u8 = 0x04;
pub const UBLK_CMD_DEL_DEV: u8 = 0x05;
pub const UBLK_CMD_START_DEV: u8 = 0x06;
pub const UBLK_CMD_STOP_DEV: u8 = 0x07;
pub const UBLK_CMD_SET_PARAMS: u8 = 0x08;
pub const UBLK_CMD_GET_PARAMS: u8 = 0x09;
pub const UBLK_CMD_START_USER_RECOVERY: u8 = 0x10;
pub const UBLK_CMD_END_USER_RECOVERY: u8 = 0x11;
pub const UBLK_CMD_GET_DEV_INFO2: u8 = 0x12;

pub const UBLK_U_CMD_GET_QUEUE_AFFINITY: u32 = ior::<UblksrvCtrlCmd>(UBLK_CMD_GET_QUEUE_AFFINITY);
pub const UBLK_U_CMD_GET_DEV_INFO: u32 = ior::<UblksrvCtrlCmd>(UBLK_CMD_GET_DEV_INFO);
pub const UBLK_U_CMD_ADD_DEV: u32 = iowr::<UblksrvCtrlCmd>(UBLK_CMD_ADD_DEV);
pub const UBLK_U_CMD_DEL_DEV: u32 = iowr::<UblksrvCtrlCmd>(UBLK_CMD_DEL_DEV);
pub const UBLK_U_CMD_START_DEV: u32 = iowr::<UblksrvCtrlCmd>(UBLK_CMD_START_DEV);
pub const UBLK_U_CMD_STOP_DEV: u32 = iowr::<UblksrvCtrlCmd>(UBLK_CMD_STOP_DEV);
pub const UBLK_U_CMD_SET_PARAMS: u32 = iowr::<UblksrvCtrlCmd>(UBLK_CMD_SET_PARAMS);
pub const UBLK_U_CMD_GET_PARAMS: u32 = ior::<UblksrvCtrlCmd>(UBLK_CMD_GET_PARAMS);
pub const UBLK_U_CMD_START_USER_RECOVERY: u32 =
    iowr::<UblksrvCtrlCmd>(UBLK_CMD_START_USER_RECOVERY);
pub const UBLK_U_CMD_END_USER_RECOVERY: u32 = iowr::<UblksrvCtrlCmd>(UBLK_CMD_END_USER_RECOVERY);
pub const UBLK_U_CMD_GET_DEV_INFO2: u32 = ior::<UblksrvCtrlCmd>(UBLK_CMD_GET_DEV_INFO2);
pub const UBLK_U_CMD_GET_FEATURES: u32 = ior::<UblksrvCtrlCmd>(0x13);
pub const UBLK_U_CMD_DEL_DEV_ASYNC: u32 = ior::<UblksrvCtrlCmd>(0x14);
pub const UBLK_U_CMD_UPDATE_SIZE: u32 = iowr::<UblksrvCtrlCmd>(0x15);
pub const UBLK_U_CMD_QUIESCE_DEV: u32 = iowr::<UblksrvCtrlCmd>(0x16);
pub const UBLK_U_CMD_TRY_STOP_DEV: u32 = iowr::<UblksrvCtrlCmd>(0x17);

/// Length of the feature mask GET_FEATURES writes.
pub const UBLK_FEATURES_LEN: usize = 8;

// ---------------------------------------------------------------------------------------
// I/O commands, issued on `/dev/ublkcN`.

pub const UBLK_IO_FETCH_REQ: u8 = 0x20;
pub const UBLK_IO_COMMIT_AND_FETCH_REQ: u8 = 0x21;
pub const UBLK_IO_NEED_GET_DATA: u8 = 0x22;

pub const UBLK_U_IO_FETCH_REQ: u32 = iowr::<UblksrvIoCmd>(UBLK_IO_FETCH_REQ);
pub const UBLK_U_IO_COMMIT_AND_FETCH_REQ: u32 = iowr::<UblksrvIoCmd>(UBLK_IO_COMMIT_AND_FETCH_REQ);
pub const UBLK_U_IO_NEED_GET_DATA: u32 = iowr::<UblksrvIoCmd>(UBLK_IO_NEED_GET_DATA);
pub const UBLK_U_IO_REGISTER_IO_BUF: u32 = iowr::<UblksrvIoCmd>(0x23);
pub const UBLK_U_IO_UNREGISTER_IO_BUF: u32 = iowr::<UblksrvIoCmd>(0x24);
/// Batch PREP: hand the kernel every tag (with its buffer) before START/END_USER_RECOVERY.
pub const UBLK_U_IO_PREP_IO_CMDS: u32 = iowr::<UblkBatchIo>(0x25);
/// Batch COMMIT: CQE `res` is the number of element BYTES processed (partial commits).
pub const UBLK_U_IO_COMMIT_IO_CMDS: u32 = iowr::<UblkBatchIo>(0x26);
/// Multishot FETCH into a provided buffer ring: each CQE carries an array of `u16` tags.
pub const UBLK_U_IO_FETCH_IO_CMDS: u32 = iowr::<UblkBatchIo>(0x27);

pub const UBLK_IO_RES_OK: i32 = 0;
pub const UBLK_IO_RES_NEED_GET_DATA: i32 = 1;
pub const UBLK_IO_RES_ABORT: i32 = -libc::ENODEV;

pub const UBLKSRV_CMD_BUF_OFFSET: u64 = 0;
pub const UBLKSRV_IO_BUF_OFFSET: u64 = 0x8000_0000;

pub const UBLK_MAX_QUEUE_DEPTH: u32 = 4096;

pub const UBLK_IO_BUF_OFF: u32 = 0;
pub const UBLK_IO_BUF_BITS: u32 = 25;
pub const UBLK_IO_BUF_BITS_MASK: u64 = (1 << UBLK_IO_BUF_BITS) - 1;
pub const UBLK_TAG_OFF: u32 = UBLK_IO_BUF_BITS;
pub const UBLK_TAG_BITS: u32 = 16;
pub const UBLK_TAG_BITS_MASK: u64 = (1 << UBLK_TAG_BITS) - 1;
pub const UBLK_QID_OFF: u32 = UBLK_TAG_OFF + UBLK_TAG_BITS;
pub const UBLK_QID_BITS: u32 = 12;
pub const UBLK_QID_BITS_MASK: u64 = (1 << UBLK_QID_BITS) - 1;
pub const UBLK_MAX_NR_QUEUES: u32 = 1 << UBLK_QID_BITS;
pub const UBLKSRV_IO_BUF_TOTAL_BITS: u32 = UBLK_QID_OFF + UBLK_QID_BITS;
pub const UBLKSRV_IO_BUF_TOTAL_SIZE: u64 = 1 << UBLKSRV_IO_BUF_TOTAL_BITS;

/// The offset on `/dev/ublkcN` at which `UBLK_F_USER_COPY` reads or writes the data of
/// request `tag` of queue `q_id`, `offset` bytes into it.
pub const fn user_copy_offset(q_id: u16, tag: u16, offset: u32) -> u64 {
    UBLKSRV_IO_BUF_OFFSET
        + (((q_id as u64) & UBLK_QID_BITS_MASK) << UBLK_QID_OFF)
        + (((tag as u64) & UBLK_TAG_BITS_MASK) << UBLK_TAG_OFF)
        + ((offset as u64) & UBLK_IO_BUF_BITS_MASK)
}

/// Bytes of one queue's mmapped descriptor array (`__ublk_queue_cmd_buf_size`):
/// `depth` descriptors rounded up to whole pages.
pub const fn queue_desc_bytes(depth: u16, page_size: usize) -> usize {
    (depth as usize * size_of::<UblksrvIoDesc>()).div_ceil(page_size) * page_size
}

/// The mmap offset of queue `q_id`'s descriptor array on `/dev/ublkcN`: queues are
/// spaced by the array size of a maximal-depth queue (`ublk_max_cmd_buf_size`).
pub const fn queue_desc_offset(q_id: u16, page_size: usize) -> u64 {
    UBLKSRV_CMD_BUF_OFFSET
        + q_id as u64 * queue_desc_bytes(UBLK_MAX_QUEUE_DEPTH as u16, page_size) as u64
}

// The io_uring constants ublkd needs beyond the `io-uring` crate's: `uring.rs`.
mod uring;
pub use uring::*;

// The feature flags, with their names: `features.rs`.
mod features;
pub use features::*;

// ---------------------------------------------------------------------------------------
// Device states (`ublksrv_ctrl_dev_info.state`).

pub const UBLK_S_DEV_DEAD: u16 = 0;
pub const UBLK_S_DEV_LIVE: u16 = 1;
pub const UBLK_S_DEV_QUIESCED: u16 = 2;
pub const UBLK_S_DEV_FAIL_IO: u16 = 3;

/// A device's state as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevState {
    Dead,
    Live,
    Quiesced,
    FailIo,
    /// A value this module does not know (a newer kernel).
    Other(u16),
}

impl DevState {
    pub fn from_raw(raw: u16) -> Self {
        match raw {
            UBLK_S_DEV_DEAD => DevState::Dead,
            UBLK_S_DEV_LIVE => DevState::Live,
            UBLK_S_DEV_QUIESCED => DevState::Quiesced,
            UBLK_S_DEV_FAIL_IO => DevState::FailIo,
            other => DevState::Other(other),
        }
    }
}

impl std::fmt::Display for DevState {
    /// The spelling the kernel selftests parse (`state LIVE`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DevState::Dead => f.write_str("DEAD"),
            DevState::Live => f.write_str("LIVE"),
            DevState::Quiesced => f.write_str("QUIESCED"),
            DevState::FailIo => f.write_str("FAIL_IO"),
            DevState::Other(v) => write!(f, "UNKNOWN({v})"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Structs.

/// The payload of every control command, in the SQE's command area.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblksrvCtrlCmd {
    /// The device the command is for (`u32::MAX` for "any": ADD_DEV's auto id).
    pub dev_id: u32,
    /// Must be `u16::MAX` (-1) unless the command is for one queue.
    pub queue_id: u16,
    /// Length of the buffer at `addr`.
    pub len: u16,
    pub addr: u64,
    /// Inline argument (a pid for START_DEV and END_USER_RECOVERY).
    pub data: [u64; 1],
    /// Only for `UBLK_F_UNPRIVILEGED_DEV` and GET_DEV_INFO2.
    pub dev_path_len: u16,
    pub pad: u16,
    pub reserved: u32,
}

/// A device's description: sent with ADD_DEV, returned by GET_DEV_INFO.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblksrvCtrlDevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub pad0: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub pad1: u32,
    pub flags: u64,
    /// Kept verbatim by the kernel across recovery: free for the server's own use.
    pub ublksrv_flags: u64,
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub reserved1: u64,
    pub reserved2: u64,
}

pub const UBLK_IO_OP_READ: u8 = 0;
pub const UBLK_IO_OP_WRITE: u8 = 1;
pub const UBLK_IO_OP_FLUSH: u8 = 2;
pub const UBLK_IO_OP_DISCARD: u8 = 3;
pub const UBLK_IO_OP_WRITE_SAME: u8 = 4;
pub const UBLK_IO_OP_WRITE_ZEROES: u8 = 5;
pub const UBLK_IO_OP_ZONE_OPEN: u8 = 10;
pub const UBLK_IO_OP_ZONE_CLOSE: u8 = 11;
pub const UBLK_IO_OP_ZONE_FINISH: u8 = 12;
pub const UBLK_IO_OP_ZONE_APPEND: u8 = 13;
pub const UBLK_IO_OP_ZONE_RESET_ALL: u8 = 14;
pub const UBLK_IO_OP_ZONE_RESET: u8 = 15;
pub const UBLK_IO_OP_REPORT_ZONES: u8 = 18;

pub const UBLK_IO_F_FAILFAST_DEV: u32 = 1 << 8;
pub const UBLK_IO_F_FAILFAST_TRANSPORT: u32 = 1 << 9;
pub const UBLK_IO_F_FAILFAST_DRIVER: u32 = 1 << 10;
pub const UBLK_IO_F_META: u32 = 1 << 11;
pub const UBLK_IO_F_FUA: u32 = 1 << 13;
pub const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;
pub const UBLK_IO_F_SWAP: u32 = 1 << 16;
pub const UBLK_IO_F_NEED_REG_BUF: u32 = 1 << 17;
pub const UBLK_IO_F_INTEGRITY: u32 = 1 << 18;
pub const UBLK_IO_F_SHMEM_ZC: u32 = 1 << 19;

/// One request, as the kernel writes it into the mmapped descriptor array of
/// `/dev/ublkcN` (indexed by tag) before delivering the tag.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblksrvIoDesc {
    /// Operation in bits 0–7, `UBLK_IO_F_*` flags above.
    pub op_flags: u32,
    /// Sectors (or zones, for REPORT_ZONES: the header's union).
    pub nr_sectors: u32,
    pub start_sector: u64,
    /// Buffer address in the server's address space (copy mode).
    pub addr: u64,
}

impl UblksrvIoDesc {
    pub const fn op(&self) -> u8 {
        (self.op_flags & 0xff) as u8
    }

    /// The `UBLK_IO_F_*` flags, in place (not shifted).
    pub const fn flags(&self) -> u32 {
        self.op_flags & !0xff
    }
}

/// The legacy per-I/O command (`FETCH_REQ`, `COMMIT_AND_FETCH_REQ`, and the buffer
/// register commands, which batch mode still uses).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblksrvIoCmd {
    pub q_id: u16,
    pub tag: u16,
    pub result: i32,
    /// Buffer address, or the zone append LBA (the header's union).
    pub addr: u64,
}

pub const UBLK_AUTO_BUF_REG_FALLBACK: u8 = 1 << 0;
pub const UBLK_AUTO_BUF_REG_F_MASK: u8 = UBLK_AUTO_BUF_REG_FALLBACK;

/// Auto buffer registration data, carried in `sqe->addr` for `UBLK_F_AUTO_BUF_REG`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkAutoBufReg {
    pub index: u16,
    pub flags: u8,
    pub reserved0: u8,
    pub reserved1: u32,
}

impl UblkAutoBufReg {
    pub const fn to_sqe_addr(&self) -> u64 {
        self.index as u64
            | (self.flags as u64) << 16
            | (self.reserved0 as u64) << 24
            | (self.reserved1 as u64) << 32
    }
}

/// The fixed part of every batch element.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkElemHeader {
    pub tag: u16,
    /// Only meaningful with `UBLK_F_AUTO_BUF_REG`.
    pub buf_index: u16,
    /// The I/O's result (COMMIT only): bytes, or `-errno`.
    pub result: i32,
}

pub const UBLK_BATCH_F_HAS_ZONE_LBA: u16 = 1 << 0;
pub const UBLK_BATCH_F_HAS_BUF_ADDR: u16 = 1 << 1;
pub const UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK: u16 = 1 << 2;

/// The batch command header, in the SQE's command area (fits a 64-byte SQE).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkBatchIo {
    pub q_id: u16,
    /// `UBLK_BATCH_F_*`.
    pub flags: u16,
    pub nr_elem: u16,
    /// 8, 16 or 24, matching `flags`; 2 (one `u16` tag) for FETCH.
    pub elem_bytes: u8,
    pub reserved: u8,
    pub reserved2: u64,
}

pub const UBLK_ATTR_READ_ONLY: u32 = 1 << 0;
pub const UBLK_ATTR_ROTATIONAL: u32 = 1 << 1;
pub const UBLK_ATTR_VOLATILE_CACHE: u32 = 1 << 2;
pub const UBLK_ATTR_FUA: u32 = 1 << 3;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamBasic {
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamDiscard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

/// Read-only: filled by the kernel once the device is started.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamDevt {
    pub char_major: u32,
    pub char_minor: u32,
    pub disk_major: u32,
    pub disk_minor: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamZoned {
    pub max_open_zones: u32,
    pub max_active_zones: u32,
    pub max_zone_append_sectors: u32,
    pub reserved: [u8; 20],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamDmaAlign {
    pub alignment: u32,
    pub pad: [u8; 4],
}

pub const UBLK_MIN_SEGMENT_SIZE: u32 = 4096;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamSegment {
    pub seg_boundary_mask: u64,
    pub max_segment_size: u32,
    pub max_segments: u16,
    pub pad: [u8; 2],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParamIntegrity {
    pub flags: u32,
    pub max_integrity_segments: u16,
    pub interval_exp: u8,
    pub metadata_size: u8,
    pub pi_offset: u8,
    pub csum_type: u8,
    pub tag_size: u8,
    pub pad: [u8; 5],
}

pub const UBLK_PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const UBLK_PARAM_TYPE_DISCARD: u32 = 1 << 1;
pub const UBLK_PARAM_TYPE_DEVT: u32 = 1 << 2;
pub const UBLK_PARAM_TYPE_ZONED: u32 = 1 << 3;
pub const UBLK_PARAM_TYPE_DMA_ALIGN: u32 = 1 << 4;
pub const UBLK_PARAM_TYPE_SEGMENT: u32 = 1 << 5;
pub const UBLK_PARAM_TYPE_INTEGRITY: u32 = 1 << 6;

/// SET_PARAMS / GET_PARAMS payload; `len` must be set for both.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkParams {
    pub len: u32,
    /// `UBLK_PARAM_TYPE_*`: which of the parts below are meant.
    pub types: u32,
    pub basic: UblkParamBasic,
    pub discard: UblkParamDiscard,
    pub devt: UblkParamDevt,
    pub zoned: UblkParamZoned,
    pub dma: UblkParamDmaAlign,
    pub seg: UblkParamSegment,
    pub integrity: UblkParamIntegrity,
}

// ---------------------------------------------------------------------------------------
// Layout asserts: the sizes and offsets of Linux 7.2's header. The header test checks
// the same numbers against the C compiler's view of the real header.

macro_rules! assert_layout {
    ($ty:ty, size = $size:expr, { $($field:ident = $off:expr),* $(,)? }) => {
        const _: () = assert!(size_of::<$ty>() == $size);
        $(const _: () = assert!(offset_of!($ty, $field) == $off);)*
    };
}

assert_layout!(UblksrvCtrlCmd, size = 32, {
    dev_id = 0, queue_id = 4, len = 6, addr = 8, data = 16, dev_path_len = 24, pad = 26,
    reserved = 28,
});
assert_layout!(UblksrvCtrlDevInfo, size = 64, {
    nr_hw_queues = 0, queue_depth = 2, state = 4, pad0 = 6, max_io_buf_bytes = 8,
    dev_id = 12, ublksrv_pid = 16, pad1 = 20, flags = 24, ublksrv_flags = 32,
    owner_uid = 40, owner_gid = 44, reserved1 = 48, reserved2 = 56,
});
assert_layout!(UblksrvIoDesc, size = 24, {
    op_flags = 0, nr_sectors = 4, start_sector = 8, addr = 16,
});
assert_layout!(UblksrvIoCmd, size = 16, { q_id = 0, tag = 2, result = 4, addr = 8 });
assert_layout!(UblkAutoBufReg, size = 8, {
    index = 0, flags = 2, reserved0 = 3, reserved1 = 4,
});
assert_layout!(UblkElemHeader, size = 8, { tag = 0, buf_index = 2, result = 4 });
assert_layout!(UblkBatchIo, size = 16, {
    q_id = 0, flags = 2, nr_elem = 4, elem_bytes = 6, reserved = 7, reserved2 = 8,
});
assert_layout!(UblkParamBasic, size = 32, {
    attrs = 0, logical_bs_shift = 4, physical_bs_shift = 5, io_opt_shift = 6,
    io_min_shift = 7, max_sectors = 8, chunk_sectors = 12, dev_sectors = 16,
    virt_boundary_mask = 24,
});
assert_layout!(UblkParamDiscard, size = 20, {
    discard_alignment = 0, discard_granularity = 4, max_discard_sectors = 8,
    max_write_zeroes_sectors = 12, max_discard_segments = 16, reserved0 = 18,
});
assert_layout!(UblkParamDevt, size = 16, {
    char_major = 0, char_minor = 4, disk_major = 8, disk_minor = 12,
});
assert_layout!(UblkParamZoned, size = 32, {
    max_open_zones = 0, max_active_zones = 4, max_zone_append_sectors = 8, reserved = 12,
});
assert_layout!(UblkParamDmaAlign, size = 8, { alignment = 0, pad = 4 });
assert_layout!(UblkParamSegment, size = 16, {
    seg_boundary_mask = 0, max_segment_size = 8, max_segments = 12, pad = 14,
});
assert_layout!(UblkParamIntegrity, size = 16, {
    flags = 0, max_integrity_segments = 4, interval_exp = 6, metadata_size = 7,
    pi_offset = 8, csum_type = 9, tag_size = 10, pad = 11,
});
assert_layout!(UblkParams, size = 152, {
    len = 0, types = 4, basic = 8, discard = 40, devt = 60, zoned = 76, dma = 108,
    seg = 120, integrity = 136,
});

// The opcodes of Linux 7.2, as `_IOR`/`_IOWR` print them; a wrong size in a struct
// above would show here too.
const _: () = assert!(UBLK_U_CMD_ADD_DEV == 0xc020_7504);
const _: () = assert!(UBLK_U_CMD_GET_FEATURES == 0x8020_7513);
const _: () = assert!(UBLK_U_IO_PREP_IO_CMDS == 0xc010_7525);

/// Views of the kernel structs as bytes, for the SQE's command area and for the
/// buffers the kernel reads or fills.
///
/// Implemented only for the `#[repr(C)]` structs above that are made of integers with
/// no padding (their size asserts equal the sum of their fields, which the header test
/// confirms), so every byte is initialised and every byte pattern is a valid value.
pub trait AsBytes: Copy {
    fn as_bytes(&self) -> &[u8];
    fn as_bytes_mut(&mut self) -> &mut [u8];
}

macro_rules! impl_as_bytes {
    ($($ty:ty),*) => {$(
        impl AsBytes for $ty {
            fn as_bytes(&self) -> &[u8] {
                // SAFETY: per the trait's contract `$ty` has no padding, so all its
                // `size_of` bytes are initialised; the slice borrows `self`.
                unsafe {
                    std::slice::from_raw_parts((self as *const $ty).cast::<u8>(), size_of::<$ty>())
                }
            }

            fn as_bytes_mut(&mut self) -> &mut [u8] {
                // SAFETY: as above, and `$ty` is plain integers, so any bytes written
                // through the slice leave a valid `$ty`; the slice borrows `self` mutably.
                unsafe {
                    std::slice::from_raw_parts_mut((self as *mut $ty).cast::<u8>(), size_of::<$ty>())
                }
            }
        }
    )*};
}

impl_as_bytes!(
    UblksrvCtrlCmd,
    UblksrvCtrlDevInfo,
    UblkParams,
    UblkBatchIo,
    UblksrvIoCmd,
    UblksrvIoDesc
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_copy_offset_places_queue_tag_and_offset() {
        let off = user_copy_offset(3, 7, 512);
        assert_eq!(off - UBLKSRV_IO_BUF_OFFSET, (3 << 41) | (7 << 25) | 512);
    }

    #[test]
    fn descriptor_arrays_are_page_rounded_and_spaced_by_the_max_depth() {
        assert_eq!(queue_desc_bytes(128, 4096), 4096);
        assert_eq!(queue_desc_bytes(256, 4096), 8192);
        assert_eq!(queue_desc_offset(0, 4096), 0);
        assert_eq!(queue_desc_offset(2, 4096), 2 * 98304);
    }

    #[test]
    fn io_desc_splits_op_and_flags() {
        let d = UblksrvIoDesc {
            op_flags: u32::from(UBLK_IO_OP_WRITE) | UBLK_IO_F_FUA,
            ..Default::default()
        };
        assert_eq!(d.op(), UBLK_IO_OP_WRITE);
        assert_eq!(d.flags(), UBLK_IO_F_FUA);
    }

    #[test]
    fn dev_state_prints_the_selftests_spelling() {
        assert_eq!(DevState::from_raw(1).to_string(), "LIVE");
        assert_eq!(DevState::from_raw(2).to_string(), "QUIESCED");
        assert_eq!(DevState::from_raw(3).to_string(), "FAIL_IO");
        assert_eq!(DevState::from_raw(0).to_string(), "DEAD");
        assert_eq!(DevState::from_raw(9), DevState::Other(9));
    }

    #[test]
    fn auto_buf_reg_packs_into_sqe_addr() {
        let r = UblkAutoBufReg { index: 0x1234, flags: 1, reserved0: 0, reserved1: 0 };
        assert_eq!(r.to_sqe_addr(), 0x1_1234);
    }
}
