//! Exit codes of `ublkd` and `ublkctl`, one per cause a script or systemd
//! (`RestartPreventExitStatus=`) tells apart. Code 2 is clap's for bad usage, and
//! `ublkctl`'s for a bad argument (its own check or ublkd's).

use ublkd_proto::msg::ErrorKind;

/// Any failure without a more specific code.
pub const FAILURE: i32 = 1;
/// Bad command-line usage (clap's), or an argument ublkctl or ublkd refuses.
pub const BAD_ARGUMENT: i32 = 2;
/// The kernel has no ublk driver (`/dev/ublk-control` is missing).
pub const NO_UBLK: i32 = 3;
/// The kernel's ublk driver lacks a feature ublkd needs, or the request needs.
pub const MISSING_FEATURE: i32 = 4;
/// Not permitted (not root / no CAP_SYS_ADMIN, or the control socket refuses us).
pub const PERMISSION: i32 = 5;
/// The config file is invalid (systemd: `RestartPreventExitStatus=6`).
pub const CONFIG: i32 = 6;
/// The control socket is taken by a running ublkd, or cannot be created.
pub const SOCKET: i32 = 7;
/// `ublkctl` cannot reach the daemon.
pub const NO_DAEMON: i32 = 8;
/// No device has the id or name given.
pub const NO_DEVICE: i32 = 9;
/// The id, name, file, export or image given is another device's.
pub const EXISTS: i32 = 10;
/// The device is in use (mounted, held, open), and the request would take it away.
pub const BUSY: i32 = 11;
/// Not now (after sysexits' EX_TEMPFAIL, "try again later"): the device is not in a
/// state that allows the request (not LIVE, being recovered, upgraded or resized), or
/// ublkd is shutting down.
pub const TRY_AGAIN: i32 = 12;
/// The device's worker failed to start or to take the device (its backend could not
/// be opened, its sandbox refused it, it did not answer in time).
pub const WORKER_FAILED: i32 = 13;

/// `ublkctl`'s exit code for an error answer of ublkd's.
pub const fn for_kind(kind: ErrorKind) -> i32 {
    match kind {
        ErrorKind::Other => FAILURE,
        ErrorKind::NoSuchDevice => NO_DEVICE,
        ErrorKind::AlreadyExists => EXISTS,
        ErrorKind::Busy => BUSY,
        ErrorKind::NotSupported => MISSING_FEATURE,
        ErrorKind::BadArgument => BAD_ARGUMENT,
        ErrorKind::PermissionDenied => PERMISSION,
        ErrorKind::TryAgain => TRY_AGAIN,
        ErrorKind::WorkerFailed => WORKER_FAILED,
    }
}

/// The `"kind"` of an error under `--json` for exit `code` (docs/json.md).
pub const fn kind_name(code: i32) -> &'static str {
    match code {
        BAD_ARGUMENT => "bad_argument",
        NO_UBLK => "no_ublk_driver",
        MISSING_FEATURE => "not_supported",
        PERMISSION => "permission_denied",
        CONFIG => "bad_config",
        SOCKET => "socket",
        NO_DAEMON => "ublkd_unreachable",
        NO_DEVICE => "no_such_device",
        EXISTS => "already_exists",
        BUSY => "busy",
        TRY_AGAIN => "try_again",
        WORKER_FAILED => "worker_failed",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_own_code_and_the_same_name() {
        let kinds = ErrorKind::ALL;
        let mut codes: Vec<i32> = kinds.iter().map(|k| for_kind(*k)).collect();
        for (kind, code) in kinds.iter().zip(&codes) {
            assert_eq!(kind_name(*code), kind.name(), "{kind:?}");
        }
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), kinds.len());
        assert_eq!(for_kind(ErrorKind::Other), FAILURE);
    }
}
