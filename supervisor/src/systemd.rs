//! Talking to systemd (`sd_notify`): READY only once every configured device is LIVE or
//! has failed clearly, STATUS with a one-line summary, RELOADING around a config reload,
//! STOPPING, EXTEND_TIMEOUT while a slow start runs, and WATCHDOG from every turn of
//! the supervisor's loop: the watchdog tracks the loop's own liveness, not the
//! devices'. A hung worker is ublkd's to kill and replace; having systemd restart ublkd
//! for it would interrupt every other device and unstick nothing (a worker stuck in
//! the kernel after SIGKILL stays stuck). Outside systemd (no `NOTIFY_SOCKET`) every
//! call is a no-op.

use std::time::{Duration, Instant};

use sd_notify::NotifyState;

/// The daemon's link to systemd.
#[derive(Debug)]
pub struct Notifier {
    watchdog: Option<Duration>,
    last_ping: Option<Instant>,
    last_status: String,
}

impl Notifier {
    pub fn new() -> Self {
        Notifier {
            watchdog: sd_notify::watchdog_enabled(),
            last_ping: None,
            last_status: String::new(),
        }
    }

    fn send(&self, states: &[NotifyState<'_>]) {
        if let Err(e) = sd_notify::notify(states) {
            tracing::warn!("cannot notify systemd: {e}");
        }
    }

    /// Startup is done.
    pub fn ready(&mut self, status: &str) {
        self.last_status = status.to_string();
        self.send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }

    /// The one-line summary changed.
    pub fn status(&mut self, status: &str) {
        if status != self.last_status {
            self.last_status = status.to_string();
            self.send(&[NotifyState::Status(status)]);
        }
    }

    /// A slow step (creating or recovering a device) is under way: give it `more`.
    pub fn extend_timeout(&self, more: Duration) {
        self.send(&[NotifyState::ExtendTimeoutUsec(
            more.as_micros().min(u128::from(u32::MAX)) as u32
        )]);
    }

    pub fn reloading(&self) {
        match NotifyState::monotonic_usec_now() {
            Ok(now) => self.send(&[NotifyState::Reloading, now]),
            Err(_) => self.send(&[NotifyState::Reloading]),
        }
    }

    pub fn stopping(&self) {
        self.send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    }

    /// How often the loop must wake to keep the watchdog fed, if it is on.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog.map(|w| w / 3)
    }

    /// Pets the watchdog if it is due; called on every turn of the loop, which is what
    /// it vouches for. `hung_devices` (devices whose worker holds I/O without progress)
    /// never hold the ping back (see the module's doc); they are only logged with it.
    /// Returns whether a ping was sent.
    pub fn watchdog(&mut self, now: Instant, hung_devices: usize) -> bool {
        let Some(interval) = self.watchdog_interval() else { return false };
        if self.last_ping.is_some_and(|t| now.saturating_duration_since(t) < interval) {
            return false;
        }
        if hung_devices > 0 {
            tracing::debug!(
                hung_devices,
                "petting the watchdog: the loop runs; hung workers are ublkd's to replace"
            );
        }
        self.send(&[NotifyState::Watchdog]);
        self.last_ping = Some(now);
        true
    }
}

impl Default for Notifier {
    fn default() -> Self {
        Self::new()
    }
}

/// The STATUS line: device counts by state and the last event.
pub fn summary(
    live: usize,
    recovering: usize,
    waiting: usize,
    last_event: Option<&crate::event::Event>,
) -> String {
    let mut s = format!("{} device(s): {live} live", live + recovering + waiting);
    if recovering > 0 {
        s.push_str(&format!(", {recovering} recovering"));
    }
    if waiting > 0 {
        s.push_str(&format!(", {waiting} waiting for `ublkctl recover`"));
    }
    if let Some(event) = last_event {
        s.push_str(&format!("; last: {event}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_counts_and_the_last_event() {
        assert_eq!(summary(2, 0, 0, None), "2 device(s): 2 live");
        assert_eq!(
            summary(
                1,
                1,
                1,
                Some(&crate::event::Event::Recovered { id: 3, stall: Duration::from_millis(410) })
            ),
            "3 device(s): 1 live, 1 recovering, 1 waiting for `ublkctl recover`; last: device 3 recovered in 410 ms"
        );
    }

    fn with_watchdog(secs: u64) -> Notifier {
        Notifier { watchdog: Some(Duration::from_secs(secs)), ..Notifier::new() }
    }

    #[test]
    fn a_hung_device_does_not_stop_the_pet() {
        let mut n = with_watchdog(30);
        let t0 = Instant::now();
        assert!(n.watchdog(t0, 1), "the first turn with one hung device must pet");
        let later = t0 + Duration::from_secs(11);
        assert!(n.watchdog(later, 1), "a later turn with the device still hung must pet");
        let much_later = later + Duration::from_secs(11);
        assert!(n.watchdog(much_later, 1000), "nor do a thousand hung devices stop it");
    }

    #[test]
    fn the_pet_is_sent_at_most_once_per_interval() {
        let mut n = with_watchdog(30);
        let t0 = Instant::now();
        assert!(n.watchdog(t0, 0));
        assert!(!n.watchdog(t0 + Duration::from_secs(9), 0), "within a third of 30 s");
        assert!(n.watchdog(t0 + Duration::from_secs(10), 0), "a third of 30 s later");
    }

    #[test]
    fn without_systemd_nothing_is_sent_and_nothing_fails() {
        // SAFETY-free: the test process has no NOTIFY_SOCKET (cargo does not set one).
        let mut n = Notifier::new();
        n.ready("x");
        n.status("y");
        assert!(!n.watchdog(Instant::now(), 0), "no watchdog without systemd");
        n.stopping();
        assert_eq!(n.last_status, "y");
    }
}
