//! `ublkd-vm guest-check`: run by the guest's `/init` (after the switch into the host's root, as the host's
//! `ublkd-vm` binary) before the command. Reads the ublk feature mask with
//! `UBLK_U_CMD_GET_FEATURES` through `ublkd-proto`'s control client, prints it, and
//! fails if `UBLK_F_BATCH_IO` is missing — ublkd's data path needs it.

use ublkd_proto::ctrl::CtrlClient;
use ublkd_proto::uapi::{UBLK_F_BATCH_IO, feature_names};

use crate::exit;

/// The feature-check line for `mask`.
pub fn describe(mask: u64) -> String {
    format!("ublk features 0x{mask:x}: {}", feature_names(mask).join(" "))
}

/// Runs the check; returns the process exit status (0, or
/// [`exit::GUEST_CHECK_NO_BATCH_IO`], or [`exit::GUEST_CHECK_ERROR`]).
pub fn guest_check() -> u8 {
    let kernel = kernel_release();
    let mask = match CtrlClient::open().and_then(|ctrl| ctrl.get_features()) {
        Ok(mask) => mask,
        Err(e) => {
            eprintln!("ublkd-vm guest-check: could not read kernel {kernel}'s ublk features: {e}");
            return exit::GUEST_CHECK_ERROR;
        }
    };
    println!("[guest] {}", describe(mask));
    if mask & UBLK_F_BATCH_IO == 0 {
        eprintln!(
            "ublkd-vm guest-check: kernel {kernel}'s ublk lacks UBLK_F_BATCH_IO (needs Linux ≥ 7.0)"
        );
        return exit::GUEST_CHECK_NO_BATCH_IO;
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

    #[test]
    fn describe_names_batch_io() {
        let line = describe(UBLK_F_BATCH_IO);
        assert!(line.starts_with("ublk features 0x8000: "), "{line}");
        assert!(line.contains("BATCH_IO"), "{line}");
    }
}
