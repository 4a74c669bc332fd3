//! ublkd's test VM: boots Debian sid's 7.x cloud kernel (which has ublk with
//! `UBLK_F_BATCH_IO`) — or, with `--kernel 6.12` / `UBLKD_VM_KERNEL=6.12`, Debian's 6.12
//! LTS cloud kernel (ublk without batch commands) — under qemu and runs a host program
//! inside it, so that kernel-dependent tests run on hosts whose own kernel has no ublk
//! driver.
//!
//! The design (the VM and its timings: docs/testing.md, "The test VM"):
//!
//! - [`kernel`]: `apt-get download`s the kernel of the chosen [`kernel::Series`] — sid's
//!   newest `linux-binary-<abi>` / `linux-modules-<abi>` for a `*-cloud-amd64` ABI ≥ 7.0,
//!   or the newest `linux-image-6.12.*-cloud-amd64` — and sid's `linux-libc-dev`, and
//!   unpacks them into the [`cache`] with `dpkg-deb -x` (nothing is installed). Both
//!   kernels stay cached side by side.
//! - [`initramfs`]: a small cpio with static busybox, `ublk_drv.ko` and an `/init` that
//!   loads ublk, mounts the host's root read-only over virtiofs (with writable overlays on
//!   `/tmp` and `/var/tmp`), switch_roots into it and runs the command.
//! - [`script`]: what the guest runs: the command, its cwd and the forwarded environment,
//!   written as a shell script into a per-run directory the guest sees through virtiofs.
//! - [`console`]: the guest's serial console, split into program output and the
//!   harness's marker lines (which carry a per-run nonce and are matched only as whole
//!   lines, because kernel warnings interleave with program output).
//! - [`vm`]: one run — virtiofsd, qemu, timeouts, one retry of a failed boot, cleanup.
//! - [`check`]: `ublkd-vm guest-check`, run inside the guest before the command: the
//!   kernel must offer what its series promises (`UBLK_F_BATCH_IO` on 7.x).
//! - [`exit`]: the exit codes of `ublkd-vm`'s own failures.
//!
//! What the system tests in `tests/tests/` use inside the VM:
//!
//! - [`harness`]: a `ublkd` per test, `ublkctl`, fio, processes and the machine-wide
//!   state a test checks, and the chaos tests' worker killer.
//! - [`prng`]: seeded randomness for the chaos and churn tests.
//! - [`proxy`]: a hostile NBD peer in front of nbdkit.
//!
//! `ublkd-vm run -- CMD` is also a cargo runner:
//! `CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="target/debug/ublkd-vm run --" cargo test`
//! runs every test binary inside the VM (the host paths are valid in the guest);
//! `UBLKD_VM_KERNEL=6.12` in front of it runs them on the 6.12 kernel instead, and the
//! tests see `UBLKD_VM_KERNEL` (`7` or `6.12`) to know which one they run on.

pub mod cache;
pub mod check;
pub mod console;
pub mod exit;
pub mod harness;
pub mod initramfs;
pub mod kernel;
pub mod prng;
pub mod proxy;
pub mod script;
pub mod vm;

/// Prints one `[vm] …` progress line on stderr.
pub(crate) fn print_progress(msg: std::fmt::Arguments<'_>) {
    eprintln!("[vm] {msg}");
}

/// `progress!("…", args)`: one `[vm] …` line on stderr.
macro_rules! progress {
    ($($arg:tt)*) => { $crate::print_progress(format_args!($($arg)*)) };
}
pub(crate) use progress;

/// The repository's root (this crate is `tests/`), for the host tests that read the
/// tree (docs, monitoring).
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate has a parent directory")
        .canonicalize()
        .expect("the repository root resolves")
}
