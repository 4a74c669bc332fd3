//! Whether a device serves with zero copy: decided once, when it is made, from what
//! the kernel offers ([`decide_zero_copy`]), and read from its spec after
//! ([`zero_copy`]) by the device's flags, its workers' setup and its nbd connections.

use ublkd_config::{DeviceSpec, TargetSpec};
use ublkd_proto::msg::DataPath;
use ublkd_proto::uapi;

use crate::features::{KernelRelease, NBD_ZERO_COPY_RELEASE};
use crate::target::error::TargetError;

/// Whether `spec` (its zero copy decided) serves a loop file or an nbd export with zero
/// copy: its device has `UBLK_F_AUTO_BUF_REG` and its workers `WorkerSetup::zero_copy`.
/// An nbd device's workers then always get one connection per thread
/// ([`NbdLink::connections`]), each negotiated with simple replies
/// ([`crate::nbd::Replies::Simple`]). An nbd spec whose zero copy is unset copies, so
/// this holds before [`decide_zero_copy`] as well as after.
///
/// [`NbdLink::connections`]: crate::nbd::link::NbdLink::connections
pub fn zero_copy(spec: &DeviceSpec) -> bool {
    spec.target.zero_copy() == Some(true)
}

/// `spec` with its zero copy decided, on a kernel with `kernel_features` and `release`
/// (`None`: not known). Asked for, zero copy needs the kernel's AUTO_BUF_REG and the
/// batched data path (the per-I/O path copies: it is what kernels without BATCH_IO get,
/// and ublkd does not register buffers on it), and an nbd device also Linux >=
/// [`NBD_ZERO_COPY_RELEASE`]. Left unset, a loop device gets it where the kernel has
/// both and the device fits a ring's buffer table (zero copy is faster than copying
/// each request's data); an nbd device copies: its zero-copy worker receives each
/// reply's header on its own before the data, one more receive per READ, which costs
/// small reads, so it is the operator's choice.
pub fn decide_zero_copy(
    spec: &DeviceSpec,
    kernel_features: u64,
    release: Option<KernelRelease>,
) -> Result<DeviceSpec, TargetError> {
    let mut spec = spec.clone();
    let has = kernel_features & uapi::UBLK_F_AUTO_BUF_REG != 0
        && DataPath::for_kernel(kernel_features) == DataPath::Batch;
    let fits = spec.fits_zero_copy();
    match &mut spec.target {
        TargetSpec::Loop { zero_copy, .. } => match zero_copy {
            Some(true) if !has => return Err(TargetError::ZeroCopyUnsupported),
            Some(_) => {}
            None => *zero_copy = Some(has && fits),
        },
        TargetSpec::Nbd { zero_copy, .. } => match zero_copy {
            Some(true) if !has => return Err(TargetError::ZeroCopyUnsupported),
            Some(true) if release.is_none_or(|r| r < NBD_ZERO_COPY_RELEASE) => {
                return Err(TargetError::ZeroCopyNbdKernel { release });
            }
            Some(_) => {}
            None => *zero_copy = Some(false),
        },
        TargetSpec::Null | TargetSpec::Memory | TargetSpec::Rbd(_) => {}
    }
    Ok(spec)
}
