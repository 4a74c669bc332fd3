//! The queue loop's clock: read at most once per loop turn, and only when something
//! in the turn needs it.
//!
//! Where the clocksource has no vDSO (the test VM's HPET, booted `tsc=unstable`) a read
//! is a system call and an emulated device access: 4.4 µs there, against the 70-90 µs of
//! CPU one request costs at queue depth 1. The loop read it twice per request (when the
//! turn began and when its COMMIT went out); without those reads null devices took 11%
//! more requests at queue depth 1 (bench/results/history.md, "The clock"). A request
//! that the target answers in the turn that fetched it (null, memory, a refused request)
//! spent no time at the backend and needs no read at all; one that waits is timed from
//! the turn that fetched it to the turn that finished it.

use std::time::Instant;

/// Nanoseconds since the queue thread started, read lazily once per loop turn.
#[derive(Debug)]
pub struct TurnClock {
    started: Instant,
    now_ns: u64,
    /// `now_ns` was read in this turn.
    fresh: bool,
}

impl TurnClock {
    pub fn new() -> Self {
        TurnClock { started: Instant::now(), now_ns: 0, fresh: false }
    }

    /// A new loop turn begins: the next [`Self::now`] reads the clock.
    pub fn next_turn(&mut self) {
        self.fresh = false;
    }

    /// This turn's time: read at its first use in the turn, the same for the rest of it.
    pub fn now(&mut self) -> u64 {
        if !self.fresh {
            self.now_ns = self.started.elapsed().as_nanos() as u64;
            self.fresh = true;
        }
        self.now_ns
    }

    /// The last time read, in this turn or an earlier one: at or before now, and free.
    pub fn known(&self) -> u64 {
        self.now_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_reads_the_clock_once_and_the_next_turn_afresh() {
        let mut clock = TurnClock::new();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(clock.known(), 0, "known() read the clock");
        let first = clock.now();
        assert!(first >= 2_000_000, "{first}");
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(clock.now(), first, "a second read in the same turn");
        clock.next_turn();
        assert_eq!(clock.known(), first);
        let second = clock.now();
        assert!(second >= first + 2_000_000, "{first} then {second}");
    }
}
