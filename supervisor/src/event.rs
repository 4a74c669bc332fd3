//! What happened last to ublkd's devices, as systemd's STATUS line ends with it
//! (`...; last: device 3 recovered in 41 ms`): one type for every such event, rendered
//! in one place ([`std::fmt::Display`]).

use std::fmt;
use std::time::Duration;

/// The last event of note, for the STATUS line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A recovery ended with the device LIVE, its I/O held for `stall`.
    Recovered { id: u32, stall: Duration },
    /// A recovery waits for its new worker to stand by.
    WaitsForWorker { id: u32 },
    /// A recovery waits for the kernel to let go of the dead worker's `/dev/ublkcN`.
    WaitsForRelease { id: u32 },
    /// An rbd device's recovery waits for its Ceph cluster, trying again after a
    /// backoff.
    WaitsForCluster { id: u32 },
    /// A recovery failed: the device waits for an operator.
    RecoveryFailed { id: u32 },
    /// The device's restart budget is spent: it waits for `ublkctl recover` (or fails
    /// its I/O, as configured).
    RestartLimit { id: u32 },
    /// A reload ended: what it did, or why it was rejected.
    Reload(String),
    /// A configured device could not be made at start.
    ConfiguredDeviceFailed { device: String, error: String },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Recovered { id, stall } => {
                write!(f, "device {id} recovered in {} ms", stall.as_millis())
            }
            Event::WaitsForWorker { id } => {
                write!(f, "device {id} waits for its new worker to start")
            }
            Event::WaitsForRelease { id } => {
                write!(f, "device {id} waits for the kernel to release it")
            }
            Event::WaitsForCluster { id } => write!(f, "device {id} waits for its Ceph cluster"),
            Event::RecoveryFailed { id } => write!(f, "device {id}: recovery failed"),
            Event::RestartLimit { id } => write!(f, "device {id} reached its restart limit"),
            Event::Reload(outcome) => f.write_str(outcome),
            Event::ConfiguredDeviceFailed { device, error } => {
                write!(f, "configured device {device} failed: {error}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_event_reads_as_the_status_line_says_it() {
        let stall = Duration::from_millis(41);
        assert_eq!(Event::Recovered { id: 3, stall }.to_string(), "device 3 recovered in 41 ms");
        assert_eq!(Event::RestartLimit { id: 1 }.to_string(), "device 1 reached its restart limit");
        assert_eq!(
            Event::Reload("reloaded: 1 device(s) added, 0 deleted".into()).to_string(),
            "reloaded: 1 device(s) added, 0 deleted"
        );
        let failed = Event::ConfiguredDeviceFailed { device: "null 1G".into(), error: "no".into() };
        assert_eq!(failed.to_string(), "configured device null 1G failed: no");
    }
}
