//! [`DataPath`]: which of ublk's two sets of I/O commands a device is served with,
//! chosen by the supervisor from the kernel's features and told to every worker.

use serde::{Deserialize, Serialize};

use crate::uapi;

/// Which ublk I/O commands serve a device: fixed when the device is created, from
/// what the kernel offers, and the same for every worker of that device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataPath {
    /// `UBLK_F_BATCH_IO` (Linux >= 7.0): PREP once, a multishot FETCH per queue, COMMIT
    /// in batches; any thread may serve any tag.
    Batch,
    /// The per-I/O commands every ublk kernel has: `FETCH_REQ` per tag, then one
    /// `COMMIT_AND_FETCH_REQ` per request, each from the one task that serves the
    /// tag's queue (the kernel binds a queue to the task of its first FETCH_REQ).
    PerIo,
}

impl DataPath {
    /// The path a kernel with feature mask `features` gets: batched where it has
    /// `UBLK_F_BATCH_IO`, per-I/O otherwise.
    pub const fn for_kernel(features: u64) -> DataPath {
        if features & uapi::UBLK_F_BATCH_IO != 0 { DataPath::Batch } else { DataPath::PerIo }
    }

    /// How `ublkd --check-kernel` and `ublkctl features` name it.
    pub const fn describe(self) -> &'static str {
        match self {
            DataPath::Batch => "batched (BATCH_IO)",
            DataPath::PerIo => "per-I/O",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_with_batch_io_get_the_batched_path_others_the_per_io_one() {
        let mask_6_12 = uapi::UBLK_F_USER_RECOVERY | uapi::UBLK_F_USER_RECOVERY_REISSUE;
        assert_eq!(DataPath::for_kernel(mask_6_12), DataPath::PerIo);
        assert_eq!(DataPath::for_kernel(mask_6_12 | uapi::UBLK_F_BATCH_IO), DataPath::Batch);
        assert_eq!(DataPath::Batch.describe(), "batched (BATCH_IO)");
        assert_eq!(DataPath::PerIo.describe(), "per-I/O");
    }
}
