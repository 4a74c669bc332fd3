//! Talking to systemd (`sd_notify`): READY only once every configured device is LIVE or
//! has failed clearly, STATUS with a one-line summary, RELOADING around a config reload,
//! STOPPING, EXTEND_TIMEOUT while a slow start runs, and WATCHDOG only while every
//! served device's worker shows progress or is idle. Outside systemd (no
//! `NOTIFY_SOCKET`) every call is a no-op.

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
        self.send(&[NotifyState::Stopping, NotifyState::Status("stopping: deleting devices")]);
    }

    /// How often the loop must wake to keep the watchdog fed, if it is on.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog.map(|w| w / 3)
    }

    /// Pets the watchdog if `healthy` and it is due.
    pub fn watchdog(&mut self, healthy: bool) {
        let Some(interval) = self.watchdog_interval() else { return };
        if !healthy {
            return;
        }
        if self.last_ping.is_none_or(|t| t.elapsed() >= interval) {
            self.send(&[NotifyState::Watchdog]);
            self.last_ping = Some(Instant::now());
        }
    }
}

impl Default for Notifier {
    fn default() -> Self {
        Self::new()
    }
}

/// The STATUS line: device counts by state and the last event.
pub fn summary(live: usize, recovering: usize, waiting: usize, last_event: Option<&str>) -> String {
    let mut s = format!("{} device(s): {live} live", live + recovering + waiting);
    if recovering > 0 {
        s.push_str(&format!(", {recovering} recovering"));
    }
    if waiting > 0 {
        s.push_str(&format!(", {waiting} waiting for `ublkctl recover`"));
    }
    if let Some(event) = last_event {
        s.push_str("; last: ");
        s.push_str(event);
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
            summary(1, 1, 1, Some("device 3 recovered in 410 ms")),
            "3 device(s): 1 live, 1 recovering, 1 waiting for `ublkctl recover`; last: device 3 recovered in 410 ms"
        );
    }

    #[test]
    fn without_systemd_nothing_is_sent_and_nothing_fails() {
        // SAFETY-free: the test process has no NOTIFY_SOCKET (cargo does not set one).
        let mut n = Notifier::new();
        n.ready("x");
        n.status("y");
        n.watchdog(true);
        n.stopping();
        assert_eq!(n.last_status, "y");
    }
}
