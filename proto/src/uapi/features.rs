//! The ublk feature flags (`ublksrv_ctrl_dev_info.flags`, and the mask GET_FEATURES
//! writes), written by hand from Linux 7.2's `include/uapi/linux/ublk_cmd.h` and
//! re-exported by [`crate::uapi`]; with their names, so that a mask can be shown and a
//! flag named (`ublkctl features`, `ublkd --check-kernel`).

pub const UBLK_F_SUPPORT_ZERO_COPY: u64 = 1 << 0;
pub const UBLK_F_URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
pub const UBLK_F_NEED_GET_DATA: u64 = 1 << 2;
pub const UBLK_F_USER_RECOVERY: u64 = 1 << 3;
pub const UBLK_F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
pub const UBLK_F_UNPRIVILEGED_DEV: u64 = 1 << 5;
pub const UBLK_F_CMD_IOCTL_ENCODE: u64 = 1 << 6;
pub const UBLK_F_USER_COPY: u64 = 1 << 7;
pub const UBLK_F_ZONED: u64 = 1 << 8;
pub const UBLK_F_USER_RECOVERY_FAIL_IO: u64 = 1 << 9;
pub const UBLK_F_UPDATE_SIZE: u64 = 1 << 10;
pub const UBLK_F_AUTO_BUF_REG: u64 = 1 << 11;
pub const UBLK_F_QUIESCE: u64 = 1 << 12;
pub const UBLK_F_PER_IO_DAEMON: u64 = 1 << 13;
pub const UBLK_F_BUF_REG_OFF_DAEMON: u64 = 1 << 14;
pub const UBLK_F_BATCH_IO: u64 = 1 << 15;
pub const UBLK_F_INTEGRITY: u64 = 1 << 16;
pub const UBLK_F_SAFE_STOP_DEV: u64 = 1 << 17;
pub const UBLK_F_NO_AUTO_PART_SCAN: u64 = 1 << 18;
pub const UBLK_F_SHMEM_ZC: u64 = 1 << 19;

/// Every feature flag this module knows, with its name without the `UBLK_F_` prefix,
/// in bit order.
pub const FEATURES: [(u64, &str); 20] = [
    (UBLK_F_SUPPORT_ZERO_COPY, "SUPPORT_ZERO_COPY"),
    (UBLK_F_URING_CMD_COMP_IN_TASK, "URING_CMD_COMP_IN_TASK"),
    (UBLK_F_NEED_GET_DATA, "NEED_GET_DATA"),
    (UBLK_F_USER_RECOVERY, "USER_RECOVERY"),
    (UBLK_F_USER_RECOVERY_REISSUE, "USER_RECOVERY_REISSUE"),
    (UBLK_F_UNPRIVILEGED_DEV, "UNPRIVILEGED_DEV"),
    (UBLK_F_CMD_IOCTL_ENCODE, "CMD_IOCTL_ENCODE"),
    (UBLK_F_USER_COPY, "USER_COPY"),
    (UBLK_F_ZONED, "ZONED"),
    (UBLK_F_USER_RECOVERY_FAIL_IO, "USER_RECOVERY_FAIL_IO"),
    (UBLK_F_UPDATE_SIZE, "UPDATE_SIZE"),
    (UBLK_F_AUTO_BUF_REG, "AUTO_BUF_REG"),
    (UBLK_F_QUIESCE, "QUIESCE"),
    (UBLK_F_PER_IO_DAEMON, "PER_IO_DAEMON"),
    (UBLK_F_BUF_REG_OFF_DAEMON, "BUF_REG_OFF_DAEMON"),
    (UBLK_F_BATCH_IO, "BATCH_IO"),
    (UBLK_F_INTEGRITY, "INTEGRITY"),
    (UBLK_F_SAFE_STOP_DEV, "SAFE_STOP_DEV"),
    (UBLK_F_NO_AUTO_PART_SCAN, "NO_AUTO_PART_SCAN"),
    (UBLK_F_SHMEM_ZC, "SHMEM_ZC"),
];

/// One supported feature: a known name, or the bit number of a flag newer than this
/// module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    Known(&'static str),
    Unknown(u32),
}

impl std::fmt::Display for Feature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Feature::Known(name) => f.write_str(name),
            Feature::Unknown(bit) => write!(f, "BIT_{bit}"),
        }
    }
}

/// The features set in `mask`, in bit order; bits this module does not know are kept
/// (as `BIT_n`) rather than dropped, so a newer kernel's mask is shown whole.
pub fn features(mask: u64) -> Vec<Feature> {
    (0..64)
        .filter(|bit| mask & (1u64 << bit) != 0)
        .map(|bit| {
            let flag = 1u64 << bit;
            FEATURES
                .iter()
                .find(|(f, _)| *f == flag)
                .map_or(Feature::Unknown(bit), |(_, name)| Feature::Known(name))
        })
        .collect()
}

/// The names of the known features set in `mask` (unknown bits are left out; see
/// [`features`] to keep them).
pub fn feature_names(mask: u64) -> Vec<&'static str> {
    FEATURES.iter().filter(|(flag, _)| mask & flag != 0).map(|(_, name)| *name).collect()
}

/// The flag called `name` (with or without the `UBLK_F_` prefix, any case).
pub fn feature_by_name(name: &str) -> Option<u64> {
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("UBLK_F_").unwrap_or(&upper);
    FEATURES.iter().find(|(_, n)| *n == bare).map(|(f, _)| *f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_names_known_bits_and_keeps_unknown_ones() {
        let mask = UBLK_F_BATCH_IO | UBLK_F_USER_RECOVERY | (1 << 40);
        let got: Vec<String> = features(mask).iter().map(ToString::to_string).collect();
        assert_eq!(got, ["USER_RECOVERY", "BATCH_IO", "BIT_40"]);
        assert_eq!(feature_names(mask), ["USER_RECOVERY", "BATCH_IO"]);
    }

    #[test]
    fn feature_table_is_in_bit_order_without_gaps() {
        for (bit, (flag, _)) in FEATURES.iter().enumerate() {
            assert_eq!(*flag, 1u64 << bit, "FEATURES[{bit}] is out of order");
        }
    }

    #[test]
    fn feature_by_name_accepts_prefix_and_any_case() {
        assert_eq!(feature_by_name("batch_io"), Some(UBLK_F_BATCH_IO));
        assert_eq!(
            feature_by_name("UBLK_F_USER_RECOVERY_REISSUE"),
            Some(UBLK_F_USER_RECOVERY_REISSUE)
        );
        assert_eq!(feature_by_name("NOPE"), None);
    }
}
