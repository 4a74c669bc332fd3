//! The device table: every device ublkd serves, by id, and which of them the loop must
//! visit on its next turn.
//!
//! A turn's cost must not grow with the devices (a thousand idle ones cost a recovery
//! nothing), so the loop does not visit every device each turn. It visits the *busy*
//! ones: a device is busy from the moment anything outside the loop's own visit gets
//! it mutably (a request, an add, an upgrade step, a reload: [`DeviceTable::get_mut`]
//! and [`DeviceTable::insert`] mark it) or the wait set names it (a worker of it
//! ended, its starting standby answered), until a visit finds that it waits for
//! nothing on a timer or a turn ([`Device::needs_turns`]). Everything else about an
//! idle device (hangs, the watchdog's count) is the tick's scan ([`DeviceTable::scan`]),
//! which visits all of them a few times per hung-worker timeout and sets the busy set
//! right again in case anything was missed.

use std::collections::{BTreeMap, BTreeSet};

use crate::device::Device;

/// What the table asks of what it holds: whether the loop must look at it on its next
/// turn even if nothing wakes it ([`Device::needs_turns`]).
pub(super) trait NeedsTurns {
    fn needs_turns(&self) -> bool;
}

impl NeedsTurns for Device {
    fn needs_turns(&self) -> bool {
        Device::needs_turns(self)
    }
}

/// The devices, `D` being [`Device`] but for this module's tests.
#[derive(Debug)]
pub(super) struct DeviceTable<D = Device> {
    devices: BTreeMap<u32, D>,
    /// Devices the loop visits every turn until they need no turn.
    busy: BTreeSet<u32>,
    /// Busy devices the wait set or a standby's socket named, not yet visited: the
    /// wait set names each ended worker once, so a device stays here until a visit
    /// has looked at its workers' ends.
    woken: BTreeSet<u32>,
    /// Whether a device was added, removed or touched since the status line was
    /// last counted.
    changed: bool,
}

impl<D> Default for DeviceTable<D> {
    fn default() -> Self {
        DeviceTable {
            devices: BTreeMap::new(),
            busy: BTreeSet::new(),
            woken: BTreeSet::new(),
            changed: false,
        }
    }
}

impl<D: NeedsTurns> DeviceTable<D> {
    pub(super) fn get(&self, id: u32) -> Option<&D> {
        self.devices.get(&id)
    }

    /// The device, marked busy: whatever the caller does to it, the loop looks at it on
    /// its next turns.
    pub(super) fn get_mut(&mut self, id: u32) -> Option<&mut D> {
        let dev = self.devices.get_mut(&id)?;
        self.busy.insert(id);
        self.changed = true;
        Some(dev)
    }

    pub(super) fn insert(&mut self, id: u32, dev: D) {
        self.busy.insert(id);
        self.changed = true;
        self.devices.insert(id, dev);
    }

    pub(super) fn remove(&mut self, id: u32) -> Option<D> {
        self.busy.remove(&id);
        self.woken.remove(&id);
        self.changed = true;
        self.devices.remove(&id)
    }

    /// Every device, out of the table.
    pub(super) fn take_all(&mut self) -> Vec<D> {
        self.busy.clear();
        self.woken.clear();
        self.changed = true;
        std::mem::take(&mut self.devices).into_values().collect()
    }

    pub(super) fn contains(&self, id: u32) -> bool {
        self.devices.contains_key(&id)
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.devices.keys().copied()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &D> {
        self.devices.values()
    }

    /// Every device, mutably, each marked busy: for startup, which visits all of them.
    pub(super) fn all_mut(&mut self) -> impl Iterator<Item = (u32, &mut D)> {
        self.busy.extend(self.devices.keys().copied());
        self.changed = true;
        self.devices.iter_mut().map(|(&id, dev)| (id, dev))
    }

    /// The tick's scan: `look` at every device (true if it changed one), then marks busy
    /// each that needs turns, setting the busy set right in case anything was missed.
    pub(super) fn scan(&mut self, mut look: impl FnMut(&mut D) -> bool) {
        for (&id, dev) in &mut self.devices {
            self.changed |= look(dev);
            if dev.needs_turns() {
                self.busy.insert(id);
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        self.devices.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Marks `id` woken and busy (the wait set or its standby's socket named it), if
    /// it is in the table.
    pub(super) fn wake(&mut self, id: u32) {
        if self.devices.contains_key(&id) {
            self.busy.insert(id);
            self.woken.insert(id);
        }
    }

    /// Marks every device woken: without a wait set, each worker's pidfd is polled, and
    /// any of them may be the one that woke the loop.
    pub(super) fn wake_all(&mut self) {
        self.busy.extend(self.devices.keys().copied());
        self.woken.extend(self.devices.keys().copied());
    }

    /// Whether `id` was woken since its last visit; clears it.
    pub(super) fn take_woken(&mut self, id: u32) -> bool {
        self.woken.remove(&id)
    }

    /// Whether a woken device waits for its visit (a turn's share ran out first).
    pub(super) fn any_woken(&self) -> bool {
        !self.woken.is_empty()
    }

    /// The busy devices' ids, in order.
    pub(super) fn busy_ids(&self) -> Vec<u32> {
        self.busy.iter().copied().collect()
    }

    /// The busy devices.
    pub(super) fn busy(&self) -> impl Iterator<Item = &D> {
        self.busy.iter().filter_map(|id| self.devices.get(id))
    }

    /// The busy device `id`, mutably, for the loop's own visit (not marking anything).
    pub(super) fn visit(&mut self, id: u32) -> Option<&mut D> {
        self.changed = true;
        self.devices.get_mut(&id)
    }

    /// Ends `id`'s busy spell if it waits for nothing the loop must look at.
    pub(super) fn settle(&mut self, id: u32) {
        if self.woken.contains(&id) {
            return;
        }
        if self.devices.get(&id).is_none_or(|dev| !dev.needs_turns()) {
            self.busy.remove(&id);
        }
    }

    /// Whether the status line must be counted again; clears it.
    pub(super) fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device that needs turns while `turns` says so.
    #[derive(Debug)]
    struct Fake {
        turns: bool,
    }

    impl NeedsTurns for Fake {
        fn needs_turns(&self) -> bool {
            self.turns
        }
    }

    fn table(ids: &[u32]) -> DeviceTable<Fake> {
        let mut table = DeviceTable::default();
        for &id in ids {
            table.insert(id, Fake { turns: false });
        }
        for &id in ids {
            table.settle(id);
        }
        assert!(table.busy_ids().is_empty(), "settled devices stay busy");
        table
    }

    #[test]
    fn a_new_device_is_busy_until_a_visit_finds_it_needs_no_turn() {
        let mut table = DeviceTable::default();
        table.insert(3, Fake { turns: true });
        assert_eq!(table.busy_ids(), [3]);
        table.settle(3);
        assert_eq!(table.busy_ids(), [3], "it still needs turns");
        table.visit(3).unwrap().turns = false;
        table.settle(3);
        assert!(table.busy_ids().is_empty());
    }

    #[test]
    fn getting_a_device_mutably_marks_only_it_busy_and_reading_marks_none() {
        let mut table = table(&[1, 2, 3]);
        assert!(table.get(2).is_some());
        assert!(table.busy_ids().is_empty());
        table.get_mut(2).unwrap();
        assert_eq!(table.busy_ids(), [2]);
        assert!(table.get_mut(9).is_none());
        assert_eq!(table.busy_ids(), [2]);
    }

    #[test]
    fn a_woken_device_stays_busy_until_its_visit_takes_the_wake() {
        let mut table = table(&[1, 2]);
        table.wake(2);
        table.wake(7); // not in the table: nothing
        assert_eq!(table.busy_ids(), [2]);
        assert!(table.any_woken());
        table.settle(2);
        assert_eq!(table.busy_ids(), [2], "settled before its visit looked");
        assert!(table.take_woken(2));
        assert!(!table.take_woken(2));
        table.settle(2);
        assert!(table.busy_ids().is_empty());
        assert!(!table.any_woken());
    }

    #[test]
    fn the_scan_visits_every_device_and_marks_busy_those_that_need_turns() {
        let mut table = table(&[1, 2, 3]);
        table.take_changed();
        let mut seen = Vec::new();
        table.scan(|dev| {
            seen.push(dev.turns);
            dev.turns = seen.len() == 2;
            false
        });
        assert_eq!(seen.len(), 3);
        assert_eq!(table.busy_ids(), [2]);
        assert!(!table.take_changed(), "the scan changed nothing it said");
        table.scan(|_| true);
        assert!(table.take_changed());
    }

    #[test]
    fn removing_a_device_forgets_its_busy_and_woken_marks() {
        let mut table = table(&[1, 2]);
        table.wake(1);
        assert!(table.remove(1).is_some());
        assert!(table.busy_ids().is_empty());
        assert!(!table.any_woken());
        assert!(table.busy().next().is_none());
        table.wake_all();
        assert_eq!(table.busy_ids(), [2]);
        assert_eq!(table.take_all().len(), 1);
        assert!(table.is_empty() && table.busy_ids().is_empty() && !table.any_woken());
    }
}
