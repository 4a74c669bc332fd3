//! io_uring constants ublkd needs that the `io-uring` crate does not define, written by
//! hand from Linux 7.2's `include/uapi/linux/io_uring.h` and re-exported by
//! [`crate::uapi`]; `proto/tests/uapi_header.rs` checks each against the real header.

/// io_uring's `IORING_URING_CMD_MULTISHOT` (`sqe->uring_cmd_flags`), which the
/// `io-uring` crate does not define; FETCH_IO_CMDS requires it.
pub const IORING_URING_CMD_MULTISHOT: u32 = 1 << 1;

/// io_uring's `IORING_RECVSEND_FIXED_BUF` (`sqe->ioprio`), which the `io-uring` crate
/// does not define: a SEND or RECV moves the data of the ring's registered buffer at
/// `buf_index` (plain SEND and RECV from Linux 7.2 on, 57ed21fad402 "io_uring/net:
/// support registered buffer for plain send and recv"); a zero-copy nbd worker's.
pub const IORING_RECVSEND_FIXED_BUF: u16 = 1 << 2;

/// io_uring_register(2) opcodes the supervisor uses on a dead worker's rings (see
/// `Worker::release_device`): drop the ring's registered buffers and files.
pub const IORING_UNREGISTER_BUFFERS: u32 = 1;
pub const IORING_UNREGISTER_FILES: u32 = 3;
/// io_uring_register(2): replace registered files (a worker puts `/dev/ublkcN` into its
/// rings with it at activation).
pub const IORING_REGISTER_FILES_UPDATE: u32 = 6;
/// io_uring_register(2): give the ring a personality (the caller's credentials) that
/// requests may run with. No worker ring allows it.
pub const IORING_REGISTER_PERSONALITY: u32 = 9;
