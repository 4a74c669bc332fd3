//! How soon ublkd connects to an NBD server again after a worker lost its connection:
//! at once after a connection that served a while (a server restart), but after a
//! growing wait after each connection that broke within [`QUICK_BREAK`] of being
//! handed to a worker. A server that accepts connections and negotiates, then breaks
//! each one at its first request, would otherwise make ublkd start a sandboxed worker
//! for each, without end (tried: 162 in 20 s); with this it gets one per step of the
//! backoff (1 s, doubling, up to [`MAX_WAIT`]), and the device's I/O stays held.

use std::time::{Duration, Instant};

/// A connection that breaks sooner than this after its worker got it counts as a
/// failed connect.
pub const QUICK_BREAK: Duration = Duration::from_secs(5);
/// The wait after the first connection that broke quickly.
pub const FIRST_WAIT: Duration = Duration::from_secs(1);
/// The longest wait between two connections.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

/// One device's connections that broke quickly, one after another.
#[derive(Debug, Default)]
pub struct Backoff {
    quick_breaks: u32,
    not_before: Option<Instant>,
}

impl Backoff {
    /// A worker lost its connection after serving for `served` (`None`: not known, a
    /// worker taken over from a previous ublkd). Returns how long the next connection
    /// waits, if it waits.
    pub fn broke(&mut self, served: Option<Duration>, now: Instant) -> Option<Duration> {
        if served.is_none_or(|served| served >= QUICK_BREAK) {
            *self = Backoff::default();
            return None;
        }
        self.quick_breaks = self.quick_breaks.saturating_add(1);
        let doublings = (self.quick_breaks - 1).min(16);
        let wait = FIRST_WAIT.saturating_mul(1 << doublings).min(MAX_WAIT);
        self.not_before = Some(now + wait);
        Some(wait)
    }

    /// Until when the next connection waits, if it still does at `now`.
    pub fn waiting_until(&self, now: Instant) -> Option<Instant> {
        self.not_before.filter(|&at| at > now)
    }

    /// How many connections in a row broke quickly.
    pub fn quick_breaks(&self) -> u32 {
        self.quick_breaks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_breaks_double_the_wait_up_to_its_bound_and_a_lasting_connection_resets_it() {
        let now = Instant::now();
        let mut backoff = Backoff::default();
        let quick = Some(Duration::from_millis(300));
        let waits: Vec<u64> =
            (0..8).map(|_| backoff.broke(quick, now).unwrap().as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(backoff.quick_breaks(), 8);
        assert_eq!(backoff.waiting_until(now), Some(now + MAX_WAIT));
        assert_eq!(backoff.waiting_until(now + MAX_WAIT), None, "the wait ends");
        assert_eq!(backoff.broke(Some(QUICK_BREAK), now), None, "a lasting connection");
        assert_eq!((backoff.quick_breaks(), backoff.waiting_until(now)), (0, None));
        assert_eq!(backoff.broke(quick, now), Some(FIRST_WAIT), "starts over");
        assert_eq!(backoff.broke(None, now), None, "a taken-over worker's is not judged");
    }
}
