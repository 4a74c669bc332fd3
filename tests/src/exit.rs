//! Exit codes of `ublkd-vm`.
//!
//! `ublkd-vm run` exits with the guest command's own status (0–255; a command killed by
//! a signal reports 128 + the signal, as a shell does). Failures of the harness itself
//! use 120–125, chosen to be unlikely to collide with a test's status, so that CI can
//! tell "the test failed" from "the VM could not run the test":
//!
//! | code | meaning |
//! |------|---------|
//! | 120  | setup failed: cache, apt, download, initramfs, virtiofsd or qemu could not start |
//! | 121  | kernel refused: no cloud kernel of the chosen series (sid ≥ 7.0, or 6.12), or its config lacks `CONFIG_BLK_DEV_UBLK` |
//! | 122  | the guest kernel's ublk lacks a feature its series must have (`BATCH_IO` on 7.x), or its features could not be read |
//! | 123  | the guest never became ready (boot or guest setup failed twice) |
//! | 124  | timeout: qemu and virtiofsd were killed |
//! | 125  | the guest died after it became ready, without reporting the command's status |
//! | 2    | usage error (from the argument parser) |
//! | 130, 143, 129 | interrupted by SIGINT, SIGTERM, SIGHUP (children are killed) |

/// Setup failed: cache, apt, download, initramfs, virtiofsd or qemu could not start.
pub const SETUP_FAILED: u8 = 120;
/// No cloud kernel of the chosen series is available, or its config lacks
/// `CONFIG_BLK_DEV_UBLK`.
pub const KERNEL_REFUSED: u8 = 121;
/// The guest kernel's ublk lacks a feature its series must have
/// ([`crate::check::required`]), or the feature check failed.
pub const FEATURE_MISSING: u8 = 122;
/// The guest never printed its READY marker, in every boot tried (three).
pub const BOOT_FAILED: u8 = 123;
/// The run exceeded its timeout.
pub const TIMEOUT: u8 = 124;
/// The guest died (panic, qemu exit) after READY without reporting the command's status.
pub const GUEST_DIED: u8 = 125;

/// Exit status of `ublkd-vm guest-check` when the kernel lacks a required feature.
/// Only between the guest's `/init` and the harness, which turns it into
/// [`FEATURE_MISSING`].
pub const GUEST_CHECK_MISSING_FEATURE: u8 = 3;
/// Exit status of `ublkd-vm guest-check` when the feature mask could not be read.
pub const GUEST_CHECK_ERROR: u8 = 4;

/// The exit-code table for `--help`.
pub const HELP: &str = "\
Exit status of `run`: the guest command's status (0-255; 128+N if it died of signal N).
Harness failures:
  120  setup failed (cache, apt, download, initramfs, virtiofsd or qemu)
  121  kernel refused (no cloud kernel of the series, or no CONFIG_BLK_DEV_UBLK)
  122  the guest kernel's ublk lacks a feature its series needs (BATCH_IO on 7.x)
  123  the guest never became ready (boot or guest setup failed twice; logs are kept)
  124  timeout (qemu and virtiofsd killed; console log kept)
  125  the guest died after READY without reporting the command's status
  129/130/143  interrupted by SIGHUP/SIGINT/SIGTERM
Environment: UBLKD_VM_CACHE (default /var/cache/ublkd-vm), UBLKD_VM_TIMEOUT (seconds,
default 900), UBLKD_VM_ACCEL (kvm|tcg; default: kvm if usable, else tcg),
UBLKD_VM_KERNEL (7|6.12, when --kernel is not given; default 7: sid's newest >= 7.0).
The guest command sees UBLKD_VM_KERNEL set to the series it was booted with.
Forwarded into the guest: PATH HOME TERM RUST_BACKTRACE RUST_LOG CARGO_* RUST_* UBLKD_*
(TERM=dumb instead when stdout is not a terminal); the guest also sets UBLKD_VM_GUEST=1
and UBLKD_VM_KERNEL_DIR (the booted kernel's cache dir, with optional modules: nbd.ko, and modules/, the module tree /lib/modules/<release> points at: kernel TLS and its ciphers).
The guest sees the host's root read-only, with fresh tmpfs on /tmp, /var/tmp and /run.
As a cargo runner: CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=\"/abs/path/ublkd-vm run --\"";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_lists_every_harness_code() {
        for code in
            [SETUP_FAILED, KERNEL_REFUSED, FEATURE_MISSING, BOOT_FAILED, TIMEOUT, GUEST_DIED]
        {
            assert!(HELP.contains(&format!("  {code}  ")), "{code} missing");
        }
    }
}
