//! The kernel's ublk feature mask: what `ublkctl features` shows (for people and for
//! scripts), which features ublkd requires (`ublkd --check-kernel`, and ublkd's start),
//! and which data path the kernel gets; and, for what the kernel offers without a
//! feature flag, its release ([`KernelRelease`]).

use serde::Serialize;
use ublkd_proto::msg::DataPath;
use ublkd_proto::uapi;

/// The JSON shape of `ublkctl features --json`.
#[derive(Debug, Serialize)]
struct FeaturesJson {
    /// The raw mask, as hex (`"0xfffff"`), so no reader loses bits to float parsing.
    mask: String,
    features: Vec<String>,
    /// [`DataPath::describe`] of the path ublkd serves this kernel's devices with.
    data_path: &'static str,
}

/// One supported feature name per line, in bit order (unknown bits as `BIT_n`).
pub fn render_text(mask: u64) -> String {
    uapi::features(mask).iter().map(|f| format!("{f}\n")).collect()
}

/// `{"mask":"0x…","features":["…",…],"data_path":"…"}`.
pub fn render_json(mask: u64) -> String {
    let json = FeaturesJson {
        mask: format!("{mask:#x}"),
        features: uapi::features(mask).iter().map(ToString::to_string).collect(),
        data_path: DataPath::for_kernel(mask).describe(),
    };
    serde_json::to_string(&json).expect("a struct of strings always serializes")
}

/// The oldest kernel ublkd serves on: the first with GET_FEATURES (6.5), which also
/// has every flag of [`REQUIRED`]. `UBLK_F_BATCH_IO` (7.0) is not required: without
/// it the device is served by the per-I/O commands ([`DataPath::PerIo`]).
pub const MIN_KERNEL: &str = "Linux 6.5";

/// The features ublkd requires of the kernel, with the reason each is needed.
pub const REQUIRED: [(u64, &str); 3] = [
    (uapi::UBLK_F_USER_RECOVERY, "crash recovery of a device when its worker dies"),
    (
        uapi::UBLK_F_USER_RECOVERY_REISSUE,
        "reissuing in-flight I/O to the new worker, so none fails",
    ),
    (uapi::UBLK_F_CMD_IOCTL_ENCODE, "the ioctl-encoded commands ublkd sends (UBLK_U_*)"),
];

/// What `ublkd --check-kernel` says of a kernel with every required feature.
pub fn summary(mask: u64) -> String {
    format!(
        "kernel ublk features {mask:#x}: everything ublkd needs is there; data path: {}",
        DataPath::for_kernel(mask).describe()
    )
}

/// The required features missing from `mask`, each with why ublkd needs it.
pub fn missing_required(mask: u64) -> Vec<String> {
    REQUIRED
        .iter()
        .filter(|(flag, _)| mask & flag == 0)
        .map(|(flag, why)| {
            let name = uapi::feature_names(*flag).first().copied().unwrap_or("?");
            format!("UBLK_F_{name} (needed for {why}; ublkd needs {MIN_KERNEL} or newer)")
        })
        .collect()
}

/// A Linux release, as `uname -r` gives it: its major and minor numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelRelease {
    pub major: u32,
    pub minor: u32,
}

/// The first release whose io_uring sends from and receives into a registered buffer
/// on a plain socket (kernel commit 57ed21fad402, "io_uring/net: support registered
/// buffer for plain send and recv"), as a zero-copy nbd worker does with the request
/// pages the kernel registered in its ring. The kernel has no feature flag for it: on
/// 7.0 and 7.1 the device would be made and its worker's first zero-copy receive fail,
/// so the release decides.
pub const NBD_ZERO_COPY_RELEASE: KernelRelease = KernelRelease { major: 7, minor: 2 };

impl KernelRelease {
    /// The major and minor numbers at the front of a release string (`7.2.0-rc3`,
    /// `6.12.48+deb13-amd64`, `7.2`), or `None` if it does not start with them.
    pub fn parse(release: &str) -> Option<KernelRelease> {
        let mut numbers = release.splitn(3, '.');
        let major = numbers.next()?.parse().ok()?;
        let minor: String = numbers.next()?.chars().take_while(char::is_ascii_digit).collect();
        Some(KernelRelease { major, minor: minor.parse().ok()? })
    }

    /// The running kernel's (uname), if it reads as a release.
    pub fn running() -> Option<KernelRelease> {
        let uts = nix::sys::utsname::uname().ok()?;
        KernelRelease::parse(uts.release().to_str()?)
    }
}

impl std::fmt::Display for KernelRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lists_one_feature_per_line_in_bit_order() {
        let mask = uapi::UBLK_F_USER_RECOVERY | uapi::UBLK_F_BATCH_IO;
        assert_eq!(render_text(mask), "USER_RECOVERY\nBATCH_IO\n");
        assert_eq!(render_text(0), "");
    }

    #[test]
    fn json_has_the_mask_and_the_names() {
        let mask = uapi::UBLK_F_BATCH_IO | (1 << 63);
        assert_eq!(
            render_json(mask),
            r#"{"mask":"0x8000000000008000","features":["BATCH_IO","BIT_63"],"data_path":"batched (BATCH_IO)"}"#
        );
    }

    #[test]
    fn json_and_summary_name_the_per_io_path_without_batch_io() {
        let mask_6_12 = 0xfc | uapi::UBLK_F_CMD_IOCTL_ENCODE;
        assert!(missing_required(mask_6_12).is_empty());
        assert!(render_json(mask_6_12).ends_with(r#""data_path":"per-I/O"}"#));
        assert!(summary(mask_6_12).ends_with("data path: per-I/O"), "{}", summary(mask_6_12));
        let mask_7 = mask_6_12 | uapi::UBLK_F_BATCH_IO;
        assert!(summary(mask_7).ends_with("data path: batched (BATCH_IO)"));
    }

    #[test]
    fn missing_required_names_each_absent_flag() {
        let all = REQUIRED.iter().fold(0, |m, (f, _)| m | f);
        assert!(missing_required(all).is_empty());
        assert!(missing_required(all & !uapi::UBLK_F_BATCH_IO).is_empty());
        let missing = missing_required(all & !uapi::UBLK_F_USER_RECOVERY_REISSUE);
        assert_eq!(missing.len(), 1);
        assert!(missing[0].starts_with("UBLK_F_USER_RECOVERY_REISSUE (needed for"), "{missing:?}");
        assert!(missing[0].ends_with("ublkd needs Linux 6.5 or newer)"), "{missing:?}");
    }

    #[test]
    fn a_kernel_release_reads_as_its_major_and_minor_numbers() {
        let release = |major, minor| Some(KernelRelease { major, minor });
        assert_eq!(KernelRelease::parse("7.2.0"), release(7, 2));
        assert_eq!(KernelRelease::parse("7.2"), release(7, 2));
        assert_eq!(KernelRelease::parse("7.2-rc3"), release(7, 2));
        assert_eq!(KernelRelease::parse("7.10.1-arch1-1"), release(7, 10));
        assert_eq!(KernelRelease::parse("6.12.48+deb13-amd64"), release(6, 12));
        for bad in ["", "7", "7.", "x.2.0", "7.x", "-7.2"] {
            assert_eq!(KernelRelease::parse(bad), None, "{bad:?}");
        }
        // Minor numbers compare as numbers: 7.10 is after 7.2.
        assert!(KernelRelease { major: 7, minor: 10 } >= NBD_ZERO_COPY_RELEASE);
        assert!(KernelRelease { major: 6, minor: 99 } < NBD_ZERO_COPY_RELEASE);
        assert!(KernelRelease { major: 8, minor: 0 } >= NBD_ZERO_COPY_RELEASE);
        assert_eq!(NBD_ZERO_COPY_RELEASE.to_string(), "7.2");
    }
}
