//! The system tests' harness: what the tests in `tests/tests/` use inside the test VM
//! to drive the real binaries (a `ublkd` per test with its own socket, `ublkctl`, fio)
//! and to check what the kernel and `/proc` say is left behind. Every helper panics
//! with the output of the command that failed.
//!
//! - [`ublkd`]: a `ublkd` per test, `ublkctl` and the control socket against it.
//! - [`fio`]: fio runs, their reports and argument lists.
//! - [`process`]: the binaries under test, running commands, signalling processes.
//! - [`machine`]: machine-wide state: the lock that serializes a test binary's tests,
//!   the kernel's ublk devices and nodes, processes in `/proc`.
//! - [`storage`]: backing files, data patterns and checksums, mounts, a write throttle.
//! - [`csi`]: the CSI node plugin (`ublkd-csi`) beside a test's ublkd, killed and
//!   started again.
//! - [`ceph`]: a single-node Ceph cluster in the guest for the rbd tests, its images,
//!   checksums, lock owners and blocklist, daemon restarts, and delayed TCP on loopback.
//! - [`chaos`]: the chaos tests' recovery settings, verifying fio passes and worker
//!   killer.
//!
//! These need the VM (`/dev/ublk-control`, root), so only the tests built with the
//! `in-vm` feature use them; the library builds them regardless, so
//! that a build without features checks them too.

pub mod ceph;
pub mod chaos;
pub mod csi;
pub mod fio;
pub mod machine;
pub mod process;
pub mod storage;
pub mod ublkd;
