//! `ublkctl features`: the kernel's ublk feature mask, for people and for scripts.

use serde::Serialize;
use ublkd_proto::uapi;

/// The JSON shape of `ublkctl features --json`.
#[derive(Debug, Serialize)]
struct FeaturesJson {
    /// The raw mask, as hex (`"0xfffff"`), so no reader loses bits to float parsing.
    mask: String,
    features: Vec<String>,
}

/// One supported feature name per line, in bit order (unknown bits as `BIT_n`).
pub fn render_text(mask: u64) -> String {
    uapi::features(mask).iter().map(|f| format!("{f}\n")).collect()
}

/// `{"mask":"0x…","features":["…",…]}`.
pub fn render_json(mask: u64) -> String {
    let json = FeaturesJson {
        mask: format!("{mask:#x}"),
        features: uapi::features(mask).iter().map(ToString::to_string).collect(),
    };
    serde_json::to_string(&json).expect("a struct of strings always serializes")
}

/// The features ublkd requires of the kernel, with the reason each is needed.
pub const REQUIRED: [(u64, &str); 3] = [
    (uapi::UBLK_F_BATCH_IO, "the batched multishot data path (Linux >= 7.0)"),
    (uapi::UBLK_F_USER_RECOVERY, "crash recovery of a device when its worker dies"),
    (
        uapi::UBLK_F_USER_RECOVERY_REISSUE,
        "reissuing in-flight I/O to the new worker, so none fails",
    ),
];

/// The required features missing from `mask`, each with why ublkd needs it.
pub fn missing_required(mask: u64) -> Vec<String> {
    REQUIRED
        .iter()
        .filter(|(flag, _)| mask & flag == 0)
        .map(|(flag, why)| {
            let name = uapi::feature_names(*flag).first().copied().unwrap_or("?");
            format!("UBLK_F_{name} (needed for {why})")
        })
        .collect()
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
            r#"{"mask":"0x8000000000008000","features":["BATCH_IO","BIT_63"]}"#
        );
    }

    #[test]
    fn missing_required_names_each_absent_flag() {
        let all = REQUIRED.iter().fold(0, |m, (f, _)| m | f);
        assert!(missing_required(all).is_empty());
        let missing = missing_required(all & !uapi::UBLK_F_BATCH_IO);
        assert_eq!(missing.len(), 1);
        assert!(missing[0].starts_with("UBLK_F_BATCH_IO (needed for"), "{missing:?}");
    }
}
