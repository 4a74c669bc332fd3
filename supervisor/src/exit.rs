//! Exit codes of `ublkd` and `ublkctl`, one per fatal cause, so that scripts and
//! systemd (`RestartPreventExitStatus=`) can tell them apart. Code 2, bad command-line
//! usage, is clap's own.

/// Any failure without a more specific code.
pub const FAILURE: i32 = 1;
/// The kernel has no ublk driver (`/dev/ublk-control` is missing).
pub const NO_UBLK: i32 = 3;
/// The kernel's ublk driver lacks a feature ublkd needs.
pub const MISSING_FEATURE: i32 = 4;
/// Not permitted (not root / no CAP_SYS_ADMIN).
pub const PERMISSION: i32 = 5;
/// The config file is invalid (systemd: `RestartPreventExitStatus=6`).
pub const CONFIG: i32 = 6;
/// The control socket is taken by a running ublkd, or cannot be created.
pub const SOCKET: i32 = 7;
/// `ublkctl` cannot reach the daemon.
pub const NO_DAEMON: i32 = 8;
