//! The supervisor crate: `ublkd`, which owns every ublk device's lifecycle, and
//! `ublkctl`, the operator's CLI.
//!
//! - [`features`]: rendering the kernel's ublk feature mask for `ublkctl features`.
//! - [`exit`]: the exit codes of both binaries.

pub mod exit;
pub mod features;
