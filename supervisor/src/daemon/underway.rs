//! What every operation that takes time has in common, as the loop sees it between
//! turns: an add (its export negotiated on a thread, its first worker starting, then
//! handed the device), a recover answered once its recovery ends, an upgrade, a delete
//! on its thread, a reload. Each is a state machine the loop moves on from its turns
//! (`adds.rs`, `upgrade.rs`, `delete.rs`, `reload.rs`), never waiting for it; here is
//! what the loop asks of each ([`Underway`]): what wakes it for the operation (an fd
//! that becomes readable, a time: [`Wake`]), and where the operation stands, in one
//! line, which `ublkctl status` shows on the device's entry ([`Daemon::underway_notes`],
//! the one place that renders them). A device's own recovery is its state's
//! (`device_state::Release`), shown through its state's note.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::time::Instant;

use ublkd_proto::msg::DevStatus;

use super::Daemon;

/// What wakes the loop for an operation under way: its fd becoming readable, or a time.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Wake {
    pub fd: Option<RawFd>,
    pub at: Option<Instant>,
}

impl Wake {
    pub fn at(at: Instant) -> Wake {
        Wake { fd: None, at: Some(at) }
    }
}

/// Where an operation stands: the devices it is about, and what to say of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Standing {
    pub devices: Vec<u32>,
    pub what: String,
}

/// An operation under way, moved on by the loop.
pub(super) trait Underway {
    /// What wakes the loop for it.
    fn wake(&self) -> Wake;
    /// Where it stands at `now`.
    fn progress(&self, now: Instant) -> Standing;
}

impl Daemon {
    /// Every operation under way.
    pub(super) fn underway(&self) -> impl Iterator<Item = &dyn Underway> {
        let adds = self.pending_adds.iter().map(|p| p as &dyn Underway);
        let recovers = self.pending_recovers.iter().map(|p| p as &dyn Underway);
        let upgrades = self.pending_upgrades.iter().map(|p| p as &dyn Underway);
        let deletes = self.pending_deletes.iter().map(|p| p as &dyn Underway);
        let reload = self.pending_reload.iter().map(|p| p as &dyn Underway);
        adds.chain(recovers).chain(upgrades).chain(deletes).chain(reload)
    }

    /// Adds to each status in `statuses` what the operations under way on its device
    /// say, after its own note, if any.
    pub(super) fn underway_notes(&self, statuses: &mut [DevStatus]) {
        let now = Instant::now();
        let mut by_device: HashMap<u32, Vec<String>> = HashMap::new();
        for op in self.underway() {
            let standing = op.progress(now);
            for id in standing.devices {
                by_device.entry(id).or_default().push(standing.what.clone());
            }
        }
        for status in statuses {
            let Some(what) = by_device.remove(&status.id) else { continue };
            let notes: Vec<String> = status.note.take().into_iter().chain(what).collect();
            status.note = Some(notes.join("; "));
        }
    }
}

/// "2.4 s" since `since`, for a progress line.
pub(super) fn for_so_far(since: Instant, now: Instant) -> String {
    format!("{:.1} s so far", now.saturating_duration_since(since).as_secs_f64())
}
