//! ublkd's contracts: everything two of its parts, or a part and the kernel, must agree on.
//!
//! - [`uapi`]: the ublk kernel interface (Linux 7.2 `include/uapi/linux/ublk_cmd.h`),
//!   the one place the kernel's structs and constants are written down.
//! - [`batch`]: typed encoding and decoding of `UBLK_F_BATCH_IO` element buffers.
//! - [`sqe`]: the io_uring SQEs of the batch PREP, COMMIT and multishot FETCH.
//! - [`ctrl`]: the control-plane client for `/dev/ublk-control`.
//! - [`codec`]: the one wire codec for messages between processes, with size limits.
//! - [`msg`]: the supervisor↔worker and ctl↔supervisor messages and their transport.
//! - [`exit`]: the worker's exit codes and what each means.
//! - [`shm`]: the versioned shared-memory region a device's supervisor and worker share.
//!
//! The supervisor and the worker both import this crate and never each other.

pub mod batch;
pub mod codec;
pub mod ctrl;
pub mod errno;
pub mod exit;
pub mod mountinfo;
pub mod msg;
pub mod nbd;
pub mod shm;
pub mod sqe;
pub mod uapi;
