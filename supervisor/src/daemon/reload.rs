//! SIGHUP: the config file read again and compared with the running one; devices
//! added to it are created, devices removed from it deleted, and any other change is
//! reported as waiting for a restart.

use ublkd_config::{Config, DeviceSpec};

use super::Daemon;
use super::handlers::describe_spec;
use crate::device::Device;

impl Daemon {
    /// SIGHUP: re-reads the config file. Devices added to it are created, devices removed
    /// from it deleted; a changed device or daemon setting is reported as needing a
    /// restart. A config with errors is rejected whole and nothing changes.
    pub(super) fn reload(&mut self) {
        self.notifier.reloading();
        let outcome = match &self.config_path {
            None => "reload: ublkd runs on built-in defaults, without a config file".to_string(),
            Some(path) => match Config::load(path) {
                Err(e) => {
                    let msg =
                        format!("reload rejected, nothing changed: {}", crate::error_chain(&e));
                    tracing::error!(event = "reload_rejected", "{msg}");
                    msg
                }
                Ok(new) => {
                    let msg = self.apply_config(new);
                    tracing::info!(event = "reloaded", "{msg}");
                    msg
                }
            },
        };
        self.last_event = Some(outcome);
        let status = self.summary();
        self.notifier.ready(&status);
    }

    fn apply_config(&mut self, new: Config) -> String {
        let mut restart_needed = Vec::new();
        if new.daemon != self.config.daemon {
            restart_needed.push("[daemon] settings".to_string());
        }
        let old_specs: Vec<DeviceSpec> = self.configured.iter().map(|(s, _)| s.clone()).collect();
        let mut added = 0;
        let mut removed = 0;
        // Removed (or changed) devices, deleted together once all are known.
        let mut dropped = Vec::new();
        for (spec, id) in std::mem::take(&mut self.configured) {
            if new.devices.contains(&spec) {
                self.configured.push((spec, id));
                continue;
            }
            let changed = spec.id.is_some() && new.devices.iter().any(|d| d.id == spec.id);
            if changed {
                restart_needed.push(format!("device {id}"));
                self.configured.push((spec, id));
                continue;
            }
            if let Some(dev) = self.devices.remove(&id) {
                dropped.push(dev);
            }
        }
        for (id, outcome) in Device::destroy_all(&self.ctx, dropped) {
            match outcome {
                Ok(()) => removed += 1,
                Err(e) => tracing::error!(dev_id = id, "reload: delete failed: {e}"),
            }
        }
        // New devices, created side by side.
        let fresh: Vec<DeviceSpec> = new
            .devices
            .iter()
            .filter(|spec| {
                !old_specs.contains(spec)
                    && !spec.id.is_some_and(|id| self.devices.contains_key(&id))
            })
            .cloned()
            .collect();
        for (spec, made) in fresh.iter().zip(self.create_all(&fresh, false)) {
            match made {
                Ok(id) => {
                    self.configured.push((spec.clone(), id));
                    added += 1;
                }
                Err(e) => tracing::error!("reload: configured device {}: {e}", describe_spec(spec)),
            }
        }
        let daemon = self.config.daemon.clone();
        self.ctx.fast_release = new.recovery.fast_release;
        self.ctx.nbd_server_wait = new.recovery.nbd_server_wait;
        self.config = new;
        // Socket, state dir and worker settings only change with a restart.
        self.config.daemon = daemon;
        let mut msg = format!("reloaded: {added} device(s) added, {removed} deleted");
        if !restart_needed.is_empty() {
            msg.push_str(&format!(
                "; changed, applied at the next restart: {}",
                restart_needed.join(", ")
            ));
        }
        msg
    }
}
