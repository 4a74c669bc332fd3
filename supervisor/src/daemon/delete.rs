//! `ublkctl del`, `del -a` and `shutdown`: the devices are taken out of the table at
//! once and deleted on a thread of their own (STOP_DEV, the workers' exit within their
//! stop grace, DEL_DEV, each of which waits), so that the loop serves every other
//! client and device meanwhile; the client is answered when the thread is done
//! ([`PendingDelete`]). A `shutdown` ends the loop once its deletes are done.

use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use ublkd_proto::ctrl::CtrlClient;
use ublkd_proto::msg::CtlResponse;

use super::Daemon;
use super::underway::{Standing, Underway, Wake, for_so_far};
use crate::control::Token;
use crate::device::Device;

/// How often the loop looks whether a delete's thread is done.
pub(super) const DELETE_POLL: Duration = Duration::from_millis(20);

/// Each device's outcome, by id.
type Outcomes = Vec<(u32, Result<(), String>)>;

/// A delete under way, answered once its thread is done.
#[derive(Debug)]
pub(super) struct PendingDelete {
    for_whom: DeleteFor,
    done: mpsc::Receiver<Outcomes>,
    /// The devices being deleted, and since when.
    ids: Vec<u32>,
    began: Instant,
}

impl Underway for PendingDelete {
    /// A thread's end has no fd to poll.
    fn wake(&self) -> Wake {
        Wake::at(Instant::now() + DELETE_POLL)
    }

    fn progress(&self, now: Instant) -> Standing {
        let what = format!("being deleted ({})", for_so_far(self.began, now));
        Standing { devices: self.ids.clone(), what }
    }
}

/// Who a delete is for, and so who hears how it ended.
#[derive(Debug)]
pub(super) enum DeleteFor {
    Client {
        token: Token,
        /// `del -n ID` (answered with its error, if any), or many (`del -a`, `shutdown`:
        /// answered with what was deleted and what failed).
        one: bool,
        /// Adds under way given up by the same request (deleted before they were made).
        given_up: Vec<u32>,
    },
    /// The devices a reload found gone from the config file, counted in its outcome.
    Reload,
}

impl Daemon {
    /// Deletes `devices` off the loop, for `for_whom`. A client is answered now (the
    /// answer returned) if there is nothing to delete or no thread to delete them on.
    pub(super) fn begin_delete(
        &mut self,
        for_whom: DeleteFor,
        devices: Vec<Device>,
    ) -> Option<CtlResponse> {
        if devices.is_empty() {
            return self.delete_done(for_whom, Vec::new());
        }
        let ids: Vec<u32> = devices.iter().map(Device::id).collect();
        let (tx, done) = mpsc::channel();
        // Shared, so that the devices come back if no thread can be had.
        let queue = Arc::new(Mutex::new(devices));
        let for_thread = Arc::clone(&queue);
        let state = self.ctx.state.clone();
        let spawned = std::thread::Builder::new().name("ublkd-delete".into()).spawn(move || {
            let devices =
                std::mem::take(&mut *for_thread.lock().unwrap_or_else(|p| p.into_inner()));
            let outcomes = match CtrlClient::open() {
                Ok(ctrl) => Device::destroy_each(&ctrl, &state, devices)
                    .into_iter()
                    .map(|(id, outcome)| (id, outcome.map_err(|e| e.to_string())))
                    .collect(),
                Err(e) => {
                    let why = format!("cannot open a control client to delete it: {e}");
                    let ids: Vec<u32> = devices.iter().map(Device::id).collect();
                    // Not deleted, not forgotten: left in the kernel and the state dir
                    // for the next ublkd, as a failed delete is.
                    devices.into_iter().map(Device::leave).for_each(|left| left.signal());
                    ids.into_iter().map(|id| (id, Err(why.clone()))).collect()
                }
            };
            drop(tx.send(outcomes));
        });
        if let Err(e) = spawned {
            tracing::warn!("deleting on the loop: cannot start a thread: {e}");
            let devices = std::mem::take(&mut *queue.lock().unwrap_or_else(|p| p.into_inner()));
            let outcomes = Device::destroy_all(&self.ctx, devices)
                .into_iter()
                .map(|(id, outcome)| (id, outcome.map_err(|e| e.to_string())))
                .collect();
            return self.delete_done(for_whom, outcomes);
        }
        let began = Instant::now();
        self.pending_deletes.push(PendingDelete { for_whom, done, ids, began });
        None
    }

    /// A delete's end: a client's answer (returned, not sent), or the reload told.
    fn delete_done(&mut self, for_whom: DeleteFor, outcomes: Outcomes) -> Option<CtlResponse> {
        match for_whom {
            DeleteFor::Client { one, given_up, .. } => Some(response(outcomes, one, given_up)),
            DeleteFor::Reload => {
                self.reload_deletes_done(outcomes);
                None
            }
        }
    }

    /// Answers the deletes whose threads are done; with `wait`, waits for every one
    /// (ublkd is stopping: a delete cut short would leave a device half deleted).
    pub(super) fn finish_deletes(&mut self, wait: bool) {
        for pending in std::mem::take(&mut self.pending_deletes) {
            let outcomes = match pending.done.try_recv() {
                Ok(outcomes) => outcomes,
                Err(mpsc::TryRecvError::Empty) if !wait => {
                    self.pending_deletes.push(pending);
                    continue;
                }
                Err(mpsc::TryRecvError::Empty) => pending.done.recv().unwrap_or_default(),
                Err(mpsc::TryRecvError::Disconnected) => Vec::new(),
            };
            let token = match &pending.for_whom {
                DeleteFor::Client { token, .. } => Some(*token),
                DeleteFor::Reload => None,
            };
            if let (Some(reply), Some(token)) =
                (self.delete_done(pending.for_whom, outcomes), token)
            {
                self.control.respond(token, &reply, Instant::now());
            }
        }
    }

    /// Whether deletes are under way (the loop then looks every [`DELETE_POLL`]).
    pub(super) fn deleting(&self) -> bool {
        !self.pending_deletes.is_empty()
    }
}

/// The answer to a delete: the ids deleted (with `given_up`), or what failed (a device
/// whose delete failed is no longer served, and stays in the kernel for the next ublkd
/// to adopt).
fn response(mut outcomes: Outcomes, one: bool, given_up: Vec<u32>) -> CtlResponse {
    outcomes.sort_unstable_by_key(|(id, _)| *id);
    let mut deleted = Vec::new();
    let mut failed = Vec::new();
    for (id, outcome) in outcomes {
        match outcome {
            Ok(()) => deleted.push(id),
            Err(e) => {
                tracing::error!(dev_id = id, "delete failed: {e}");
                failed.push((id, e));
            }
        }
    }
    if one && let Some((_, e)) = failed.pop() {
        return CtlResponse::Error { message: e };
    }
    deleted.extend(given_up);
    deleted.sort_unstable();
    if failed.is_empty() {
        return CtlResponse::Deleted { ids: deleted };
    }
    let failed: Vec<String> = failed.iter().map(|(id, e)| format!("device {id}: {e}")).collect();
    let deleted: Vec<String> = deleted.iter().map(u32::to_string).collect();
    CtlResponse::Error {
        message: format!(
            "delete failed: {} (deleted: {})",
            failed.join("; "),
            if deleted.is_empty() { "none".to_string() } else { deleted.join(", ") }
        ),
    }
}
