//! SIGHUP: the config file read again and compared with the running one; devices
//! added to it are created (and configured devices deleted with `ublkctl del` created
//! anew), devices removed from it deleted. A device with a fixed id whose description
//! changed serves on as it is, and the outcome says how to make it anew: a restart
//! would not (the next ublkd adopts the device as the kernel has it).

use ublkd_config::{Config, DeviceSpec};

use super::Daemon;
use super::handlers::describe_spec;
use crate::device::Device;

impl Daemon {
    /// SIGHUP: re-reads the config file. Devices added to it are created, devices removed
    /// from it deleted; a changed device with a fixed id is reported as served on
    /// unchanged, a changed daemon setting as needing a restart. A config with errors
    /// is rejected whole and nothing changes.
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
        let mut served_as_is = Vec::new();
        // A configured device deleted since (`ublkctl del`) is configured no more: if
        // the config still lists it, it is made again below, like a new one.
        self.configured.retain(|(_, id)| self.devices.contains(*id));
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
                served_as_is.push(id);
                self.configured.push((spec, id));
                continue;
            }
            if let Some(dev) = self.devices.remove(id) {
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
                    && !spec.id.is_some_and(|id| self.devices.contains(id))
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
        for id in served_as_is {
            msg.push_str(&format!("; {}", changed_but_served(id)));
        }
        if !restart_needed.is_empty() {
            msg.push_str(&format!(
                "; changed, applied at the next restart: {}",
                restart_needed.join(", ")
            ));
        }
        msg
    }
}

/// What ublkd says of configured device `id`, whose description in the config is not
/// the device's: it is not changed under its users (a change needs a new device, and a
/// memory device's data would go with the old one), so it serves on as it is.
pub(super) fn changed_but_served(id: u32) -> String {
    format!(
        "device {id} differs from the config and serves on as it is: to make it as \
         configured, delete it (ublkctl del -n {id}; what it holds is lost), then reload"
    )
}
