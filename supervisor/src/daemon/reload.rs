//! SIGHUP: the config file read again and compared with the running one; devices
//! added to it are created (and configured devices deleted with `ublkctl del` created
//! anew), devices removed from it deleted, both from later turns of the loop
//! ([`PendingReload`]), never holding it. A device with a fixed id whose description
//! changed serves on as it is, and the outcome says how to make it anew: a restart
//! would not (the next ublkd adopts the device as the kernel has it).

use std::collections::VecDeque;
use std::time::Instant;

use std::path::Path;

use ublkd_config::{Config, DeviceSpec};
use ublkd_proto::msg::{CtlResponse, ErrorKind, Failure};

use super::Daemon;
use super::adds::{AddFor, PendingAdd};
use super::delete::DeleteFor;
use super::event_loop::CREATING_AT_ONCE;
use super::handlers::describe_spec;
use super::underway::{Standing, Underway, Wake};
use crate::device::{Refusal, Safety};

/// A device as `--check-config` lists it: its target, id and name.
fn describe(spec: &DeviceSpec) -> String {
    match &spec.attrs.name {
        Some(name) => format!("{} named {name:?}", describe_spec(spec)),
        None => describe_spec(spec),
    }
}

/// What a reload to a config would do (see [`Daemon::plan_reload`]).
#[derive(Debug, Default)]
pub(super) struct ReloadPlan {
    /// Configured devices the config describes as they are.
    pub kept: Vec<(DeviceSpec, u32)>,
    /// Configured devices with a fixed id the config describes otherwise: they serve
    /// on as they are ([`changed_but_served`]).
    pub changed: Vec<(DeviceSpec, u32)>,
    /// Configured devices gone from the config: deleted (unless in use).
    pub dropped: Vec<(DeviceSpec, u32)>,
    /// Devices new in the config: created.
    pub added: Vec<DeviceSpec>,
    /// `[daemon]` differs: applied only at the next restart.
    pub daemon_changed: bool,
}

pub(super) const DAEMON_CHANGED: &str = "changed, applied at the next restart: [daemon] settings";

/// A reload under way: its deletes run on a thread and its adds as `ublkctl add`s do,
/// while the loop serves every client and device (and feeds the watchdog). systemd
/// hears READY once it is done, so `systemctl reload` returns with the devices made.
#[derive(Debug, Default)]
pub(super) struct PendingReload {
    /// What the outcome says after its counts: devices served as they are, settings
    /// applied at the next restart.
    notes: Vec<String>,
    added: usize,
    removed: usize,
    /// The devices gone from the file are being deleted (the adds begin after).
    deleting: bool,
    /// Those devices, with the config's description of each: one found in use is kept,
    /// configured as before, so that a later reload deletes it once it is free.
    dropping: Vec<(DeviceSpec, u32)>,
    /// Devices new in the file, not yet begun ([`CREATING_AT_ONCE`] are made at once).
    queued: VecDeque<DeviceSpec>,
    /// Adds begun and not yet ended.
    adding: usize,
}

impl Underway for PendingReload {
    /// Its deletes and adds wake the loop for it.
    fn wake(&self) -> Wake {
        Wake::default()
    }

    fn progress(&self, _now: Instant) -> Standing {
        let stage = if self.deleting {
            "deleting the devices gone from the config file".to_string()
        } else {
            format!("adding {} device(s), {} more to begin", self.adding, self.queued.len())
        };
        Standing { devices: Vec::new(), what: format!("reloading the config file: {stage}") }
    }
}

impl Daemon {
    /// SIGHUP: re-reads the config file. Devices added to it are created, devices removed
    /// from it deleted; a changed device with a fixed id is reported as served on
    /// unchanged, a changed daemon setting as needing a restart. A config with errors
    /// is rejected whole and nothing changes. The deletes and adds go on from later
    /// turns; the outcome is logged, and systemd told READY, once they are done.
    pub(super) fn reload(&mut self) {
        self.notifier.reloading();
        match &self.config_path {
            None => {
                let msg = "reload: ublkd runs on built-in defaults, without a config file";
                tracing::info!(event = "reloaded", "{msg}");
                self.reload_ended(msg.to_string());
            }
            Some(path) => match Config::load(path) {
                Err(e) => {
                    let msg =
                        format!("reload rejected, nothing changed: {}", crate::error_chain(&e));
                    tracing::error!(event = "reload_rejected", "{msg}");
                    self.reload_ended(msg);
                }
                Ok(new) => self.begin_reload(new),
            },
        }
    }

    /// `ublkd --check-config`: what reloading `path` would do ([`Self::plan_reload`]).
    pub(super) fn reload_plan_answer(&self, path: &Path) -> Result<CtlResponse, Failure> {
        let new = Config::load(path)
            .map_err(|e| Failure::new(ErrorKind::BadArgument, crate::error_chain(&e)))?;
        let plan = self.plan_reload(&new);
        let device = |(spec, id): &(DeviceSpec, u32)| format!("device {id}: {}", describe(spec));
        let mut notes = Vec::new();
        if plan.daemon_changed {
            notes.push(DAEMON_CHANGED.to_string());
        }
        Ok(CtlResponse::ReloadPlan {
            reloads: self.config_path.clone(),
            add: plan.added.iter().map(describe).collect(),
            change: plan.changed.iter().map(device).collect(),
            remove: plan.dropped.iter().map(device).collect(),
            notes,
        })
    }

    /// Whether a reload is under way (a SIGHUP meanwhile waits for it to end).
    pub(super) fn reloading(&self) -> bool {
        self.pending_reload.is_some()
    }

    fn reload_ended(&mut self, outcome: String) {
        self.last_event = Some(crate::event::Event::Reload(outcome));
        let status = self.summary();
        self.notifier.ready(&status);
    }

    /// What a reload to `new` would do, deciding nothing: what [`Self::begin_reload`]
    /// does, and what `ublkd --check-config` lists.
    pub(super) fn plan_reload(&self, new: &Config) -> ReloadPlan {
        let mut plan = ReloadPlan::default();
        // A configured device deleted since (`ublkctl del`) is configured no more: if
        // the config still lists it, it is made again, like a new one.
        let configured = self.configured.iter().filter(|(_, id)| self.devices.contains(*id));
        let mut old_specs = Vec::new();
        for (spec, id) in configured.cloned() {
            old_specs.push(spec.clone());
            if new.devices.contains(&spec) {
                plan.kept.push((spec, id));
            } else if spec.id.is_some() && new.devices.iter().any(|d| d.id == spec.id) {
                plan.changed.push((spec, id));
            } else {
                plan.dropped.push((spec, id));
            }
        }
        plan.added = new
            .devices
            .iter()
            .filter(|spec| {
                !old_specs.contains(spec) && !spec.id.is_some_and(|id| self.devices.contains(id))
            })
            .cloned()
            .collect();
        plan.daemon_changed = new.daemon != self.config.daemon;
        plan
    }

    fn begin_reload(&mut self, new: Config) {
        let mut reload = PendingReload::default();
        let plan = self.plan_reload(&new);
        self.configured = plan.kept;
        for (spec, id) in plan.changed {
            reload.notes.push(changed_but_served(id));
            self.configured.push((spec, id));
        }
        // Removed devices, deleted together once all are known.
        let mut dropped = Vec::new();
        for (spec, id) in plan.dropped {
            if let Some(dev) = self.devices.remove(id) {
                dropped.push(dev);
                reload.dropping.push((spec, id));
            }
        }
        reload.queued = plan.added.into();
        if plan.daemon_changed {
            reload.notes.push(DAEMON_CHANGED.into());
        }
        let daemon = self.config.daemon.clone();
        self.ctx.fast_release = new.recovery.fast_release;
        self.ctx.nbd_server_wait = new.recovery.nbd_server_wait;
        self.ctx.rbd_cluster_wait = new.recovery.rbd_cluster_wait;
        self.ctx.nbd_handshake_timeout = new.recovery.nbd_handshake_timeout;
        self.ctx.worker_ready_timeout = new.recovery.worker_ready_timeout;
        self.config = new;
        // Socket, state dir and worker settings only change with a restart.
        self.config.daemon = daemon;
        reload.deleting = !dropped.is_empty();
        self.pending_reload = Some(reload);
        // The devices gone from the file first: a new one may need what an old one
        // held (its file, its export's connections).
        if !dropped.is_empty() {
            self.begin_delete(DeleteFor::Reload, dropped, Safety::Each);
        }
        self.advance_reload();
    }

    /// The reload's deletes are done; the devices `kept` (in use) stay configured and
    /// served, and the outcome says so.
    pub(super) fn reload_deletes_done(
        &mut self,
        outcomes: Vec<(u32, Result<(), String>)>,
        kept: Vec<(u32, Refusal)>,
    ) {
        let Some(reload) = &mut self.pending_reload else { return };
        for (id, outcome) in outcomes {
            match outcome {
                Ok(()) => reload.removed += 1,
                Err(e) => tracing::error!(dev_id = id, "reload: delete failed: {e}"),
            }
        }
        for (id, why) in kept {
            if let Some(at) = reload.dropping.iter().position(|(_, d)| *d == id) {
                self.configured.push(reload.dropping.swap_remove(at));
            }
            reload.notes.push(kept_in_use(&why));
        }
        reload.deleting = false;
        self.advance_reload();
    }

    /// One of the reload's adds ended: the device made from `spec`, or why not.
    pub(super) fn reload_add_done(&mut self, spec: DeviceSpec, outcome: Result<u32, String>) {
        let made = match outcome {
            Ok(id) => {
                self.configured.push((spec, id));
                true
            }
            Err(e) => {
                tracing::error!("reload: configured device {}: {e}", describe_spec(&spec));
                false
            }
        };
        if let Some(reload) = &mut self.pending_reload {
            reload.adding = reload.adding.saturating_sub(1);
            reload.added += usize::from(made);
        }
        self.advance_reload();
    }

    /// Begins the reload's next adds, once its deletes are done, [`CREATING_AT_ONCE`]
    /// at a time; ends the reload when nothing is left.
    fn advance_reload(&mut self) {
        let Some(mut reload) = self.pending_reload.take() else { return };
        while !reload.deleting && reload.adding < CREATING_AT_ONCE {
            let Some(spec) = reload.queued.pop_front() else { break };
            if self.shutting_down {
                tracing::error!(
                    "reload: configured device {}: ublkd is shutting down",
                    describe_spec(&spec)
                );
                continue;
            }
            if let Some(taken) = self.name_taken(&spec) {
                tracing::error!("reload: configured device {}: name {taken}", describe_spec(&spec));
                continue;
            }
            let mut attempts = 1;
            match self.first_add_stage(&spec, &mut attempts) {
                Ok(stage) => {
                    let for_whom = AddFor::Reload(Box::new(spec.clone()));
                    let began = Instant::now();
                    let add = PendingAdd { for_whom, spec, stage, attempts, began };
                    self.pending_adds.push(add);
                    reload.adding += 1;
                }
                Err(e) => {
                    tracing::error!("reload: configured device {}: {e}", describe_spec(&spec));
                }
            }
        }
        if reload.deleting || reload.adding > 0 || !reload.queued.is_empty() {
            self.pending_reload = Some(reload);
            return;
        }
        let mut msg =
            format!("reloaded: {} device(s) added, {} deleted", reload.added, reload.removed);
        for note in &reload.notes {
            msg.push_str(&format!("; {note}"));
        }
        tracing::info!(event = "reloaded", "{msg}");
        self.reload_ended(msg);
    }
}

/// What a reload says of a device gone from the config file that it did not delete:
/// `kept: device 0 is in use: mounted at /mnt (unmount it, then reload again)`.
pub(super) fn kept_in_use(why: &Refusal) -> String {
    let what = why.what().unwrap_or_else(|| "a device gone from the config file".into());
    format!("kept: {what} ({}, then reload again)", why.remedy())
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
