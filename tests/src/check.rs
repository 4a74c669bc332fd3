//! `ublkd-vm guest-check --kernel SERIES`: run by the guest's `/init` (after the switch
//! into the host's root, as the host's `ublkd-vm` binary) before the command. Reads the
//! ublk feature mask with `UBLK_U_CMD_GET_FEATURES` through `ublkd-proto`'s control
//! client, prints it, and fails if a feature the booted [`Series`] must have is missing
//! (see [`required`]): so that a test never runs on a kernel other than the one it
//! was meant for.

use ublkd_proto::ctrl::CtrlClient;
use ublkd_proto::uapi::{
    UBLK_F_BATCH_IO, UBLK_F_CMD_IOCTL_ENCODE, UBLK_F_USER_COPY, UBLK_F_USER_RECOVERY,
    UBLK_F_USER_RECOVERY_REISSUE, feature_names,
};

use crate::exit;
use crate::kernel::Series;

/// What every ublkd kernel must have: ioctl-encoded commands (the only opcodes
/// ublkd-proto sends), and recovery that re-issues in-flight I/O (what crash recovery
/// is built on).
const BASELINE: u64 = UBLK_F_CMD_IOCTL_ENCODE | UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE;

/// The features a kernel of `series` must report: the baseline (ioctl encoding,
/// recovery with reissue), plus `BATCH_IO` on the newest series (ublkd's batch data
/// path) and `USER_COPY` on 6.12 (there since 6.5, one of the things issue 20 counts on
/// the LTS kernels having for a data path without batch commands).
pub fn required(series: Series) -> u64 {
    match series {
        Series::Newest => BASELINE | UBLK_F_BATCH_IO,
        Series::Lts6_12 => BASELINE | UBLK_F_USER_COPY,
    }
}

/// The feature-check line for `mask`.
pub fn describe(mask: u64) -> String {
    format!("ublk features 0x{mask:x}: {}", feature_names(mask).join(" "))
}

/// The `UBLK_F_*` names of the features `series` requires and `mask` lacks.
pub fn missing(series: Series, mask: u64) -> Vec<String> {
    feature_names(required(series) & !mask).iter().map(|n| format!("UBLK_F_{n}")).collect()
}

/// Runs the check for `series`; returns the process exit status (0, or
/// [`exit::GUEST_CHECK_MISSING_FEATURE`], or [`exit::GUEST_CHECK_ERROR`]).
pub fn guest_check(series: Series) -> u8 {
    let kernel = kernel_release();
    let mask = match CtrlClient::open().and_then(|ctrl| ctrl.get_features()) {
        Ok(mask) => mask,
        Err(e) => {
            eprintln!("ublkd-vm guest-check: could not read kernel {kernel}'s ublk features: {e}");
            return exit::GUEST_CHECK_ERROR;
        }
    };
    println!("[guest] {}", describe(mask));
    let missing = missing(series, mask);
    if !missing.is_empty() {
        eprintln!(
            "ublkd-vm guest-check: kernel {kernel}'s ublk lacks {}, which the --kernel {series} VM needs{}",
            missing.join(", "),
            if required(series) & UBLK_F_BATCH_IO & !mask != 0 {
                " (UBLK_F_BATCH_IO is new in Linux 7.0)"
            } else {
                ""
            }
        );
        return exit::GUEST_CHECK_MISSING_FEATURE;
    }
    0
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "(unknown)".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Read with `UBLK_U_CMD_GET_FEATURES` in the VM (notes/vm.md, notes/kernel-6.12.md).
    const MASK_7_2: u64 = 0xfffff;
    const MASK_6_12: u64 = 0x1fe;

    #[test]
    fn describe_names_batch_io() {
        let line = describe(UBLK_F_BATCH_IO);
        assert!(line.starts_with("ublk features 0x8000: "), "{line}");
        assert!(line.contains("BATCH_IO"), "{line}");
    }

    #[test]
    fn each_kernel_passes_its_own_check() {
        assert!(missing(Series::Newest, MASK_7_2).is_empty());
        assert!(missing(Series::Lts6_12, MASK_6_12).is_empty());
        assert!(missing(Series::Lts6_12, MASK_7_2).is_empty());
    }

    #[test]
    fn a_612_kernel_booted_as_the_newest_lacks_exactly_batch_io() {
        assert_eq!(missing(Series::Newest, MASK_6_12), ["UBLK_F_BATCH_IO"]);
    }

    #[test]
    fn a_kernel_without_reissue_fails_either_check() {
        let mask = MASK_6_12 & !UBLK_F_USER_RECOVERY_REISSUE;
        assert_eq!(missing(Series::Lts6_12, mask), ["UBLK_F_USER_RECOVERY_REISSUE"]);
        assert!(missing(Series::Newest, mask).contains(&"UBLK_F_USER_RECOVERY_REISSUE".into()));
    }
}
