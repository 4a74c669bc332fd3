//! The supervisor crate: `ublkd`, which owns every ublk device's lifecycle, and
//! `ublkctl`, the operator's CLI.
//!
//! - [`cli`]: both command lines (the binaries parse them, `cargo xtask man` documents them).
//! - [`daemon`]: the running supervisor: devices, the control socket, signals.
//! - [`control`]: the `ublkctl` socket's connections, served without blocking the loop.
//! - [`device`]: one device's lifecycle (ADD → PARAMS → worker → START, STOP → DEL).
//! - [`device_state`]: a device's state and the transitions allowed between states.
//! - [`target`]: a device's flags, kernel parameters and target files.
//! - [`worker`]: starting, talking to and reaping worker processes.
//! - [`worker_log`]: workers' stderr, relayed into the log with their identity, rate-limited.
//! - [`features`]: rendering the kernel's ublk feature mask.
//! - [`in_use`]: whether a device's disk is open, and what holds it (a safe delete's check).
//! - [`inspect`]: a worker's sandbox as `/proc` shows it.
//! - [`recovery`]: recovery policy: the restart budget, hang verdicts, standby timing.
//! - [`logging`]: the log, to the journal under systemd, else to stderr.
//! - [`metrics`]: every device's numbers as OpenMetrics text, and the metrics file.
//! - [`render`]: `ublkctl`'s output formats.
//! - [`systemd`]: readiness, status, reload and watchdog notifications.
//! - [`state`]: what survives a supervisor crash (device records, regions, memory data).
//! - [`exit`]: the exit codes of both binaries.
//! - [`rlimit`]: ublkd's own fd limit, raised for a thousand devices.

pub mod cli;
pub mod control;
pub mod daemon;
pub mod device;
pub mod device_state;
pub mod event;
pub mod exit;
pub mod features;
pub mod generator;
pub mod hang;
pub mod in_use;
pub mod inspect;
pub mod kernel_call;
pub mod logging;
pub mod metrics;
pub mod nbd;
pub mod rbd;
pub mod recovery;
pub mod render;
pub mod replace_file;
pub mod rlimit;
pub mod state;
pub mod sys;
pub mod systemd;
pub mod target;
pub mod worker;
pub mod worker_log;

/// An error and its sources, as one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let text = src.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = src.source();
    }
    s
}
