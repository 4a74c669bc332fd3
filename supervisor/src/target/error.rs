//! What can go wrong setting up a device's target: one error type for every target, so
//! that an add, a recovery and a reload report it alike. Its own module, below
//! `nbd::link` and `nbd::target`, which return it, and `target`, which re-exports it
//! with the rest of a device's target (`nbd::link` is in turn `target`'s).

use std::io;
use std::path::PathBuf;

use crate::features::{KernelRelease, NBD_ZERO_COPY_RELEASE};
use crate::nbd::NbdError;
use crate::rbd::{CephConfError, ProbeError};
use crate::state::StateError;

/// Errors in setting up a device's target. Each names the device.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("device {id}: {source}")]
    State { id: u32, source: StateError },
    #[error("device {id}: cannot open its backing file {}: {source}", path.display())]
    Backing { id: u32, path: PathBuf, source: io::Error },
    #[error("device {id}: {} did not appear: {source}", path.display())]
    CharDev { id: u32, path: PathBuf, source: io::Error },
    #[error(
        "zero_copy needs the kernel's UBLK_F_AUTO_BUF_REG with the batched data path \
         (UBLK_F_BATCH_IO, Linux >= 7.0), which it lacks; turn zero_copy off (--copy)"
    )]
    ZeroCopyUnsupported,
    #[error(
        "zero_copy for an nbd device needs Linux >= {NBD_ZERO_COPY_RELEASE} (io_uring's \
         socket send and receive into registered buffers), this kernel is {}; turn \
         zero_copy off (--copy) or leave it unset",
        release.map_or_else(|| "of a release ublkd cannot read".to_string(), |r| r.to_string())
    )]
    ZeroCopyNbdKernel { release: Option<KernelRelease> },
    #[error(
        "zero copy needs one connection per thread; the export {uri} does not allow \
         several connections (no NBD_FLAG_CAN_MULTI_CONN): set threads = 1 or turn \
         zero_copy off"
    )]
    ZeroCopyNbdOneConnection { uri: String },
    #[error(
        "the NBD server {uri} answered {got} of the {want} connections a zero-copy device \
         needs (one per thread), and it is never served over fewer: let the server take \
         {want} connections, or lower threads, or turn zero_copy off"
    )]
    ZeroCopyNbdConnections { uri: String, got: usize, want: u8 },
    #[error("cannot use the nbd export {uri}: {source}")]
    Nbd { uri: String, source: Box<NbdError> },
    #[error(
        "the nbd export {uri} is no longer what device {id} was made from: {what}; \
         the device waits (its I/O held) until the server offers it again"
    )]
    NbdChanged { id: u32, uri: String, what: String },
    #[error("cannot use the rbd image {image}: {source}")]
    RbdConf { image: String, source: CephConfError },
    #[error("cannot use the rbd image {image}: {source}")]
    RbdProbe { image: String, source: ProbeError },
}
