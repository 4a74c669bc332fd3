//! The supervisor crate: `ublkd`, which owns every ublk device's lifecycle, and
//! `ublkctl`, the operator's CLI.
//!
//! - [`daemon`]: the running supervisor: devices, the control socket, signals.
//! - [`device`]: one device's lifecycle (ADD → PARAMS → worker → START, STOP → DEL).
//! - [`worker`]: starting, talking to and reaping worker processes.
//! - [`features`]: rendering the kernel's ublk feature mask.
//! - [`inspect`]: a worker's sandbox as `/proc` shows it.
//! - [`render`]: `ublkctl`'s output formats.
//! - [`state`]: what survives a supervisor crash (device records, regions, memory data).
//! - [`exit`]: the exit codes of both binaries.

pub mod daemon;
pub mod device;
pub mod exit;
pub mod features;
pub mod inspect;
pub mod render;
pub mod state;
pub mod worker;
