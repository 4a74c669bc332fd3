//! `ublkctl del`, `del -a` and `shutdown`: the devices are taken out of the table at
//! once and deleted on a thread of their own (STOP_DEV, the workers' exit within their
//! stop grace, DEL_DEV, each of which waits), so that the loop serves every other
//! client and device meanwhile; the client is answered when the thread is done
//! ([`PendingDelete`]). A `shutdown` ends the loop once its deletes are done.
//!
//! Unless forced, a delete takes no device whose disk is in use (`crate::in_use`): the
//! thread gives such a device back untouched, and it goes back into the table, served
//! as before, its record kept. A client whose delete is not done after
//! [`DELETE_ANSWER_BY`] is told where it stands; the delete goes on.

use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use ublkd_proto::ctrl::CtrlClient;
use ublkd_proto::msg::{CtlResponse, ErrorKind, Failure};

use super::Daemon;
use super::underway::{Standing, Underway, Wake, for_so_far};
use crate::control::Token;
use crate::device::{Deletion, Device, Refusal, Safety, Stages};

/// How often the loop looks whether a delete's thread is done.
pub(super) const DELETE_POLL: Duration = Duration::from_millis(20);

/// A client's delete not done by then is answered with where it stands (and goes on):
/// `ublkctl` gives up on an answer after 30 s.
pub(super) const DELETE_ANSWER_BY: Duration = Duration::from_secs(25);

/// How one device's delete ended, as the loop hears it.
#[derive(Debug)]
pub(super) enum Ended {
    Deleted,
    Failed(String),
    /// Not deleted, nothing done to it: back into the table, served as before.
    Kept(Box<Device>, Refusal),
}

impl From<Deletion> for Ended {
    fn from(d: Deletion) -> Ended {
        match d {
            Deletion::Deleted => Ended::Deleted,
            Deletion::Failed(e) => Ended::Failed(e.to_string()),
            Deletion::Kept(dev, why) => Ended::Kept(dev, why),
        }
    }
}

/// Each device's outcome, by id.
type Outcomes = Vec<(u32, Ended)>;

/// A delete under way, answered once its thread is done.
#[derive(Debug)]
pub(super) struct PendingDelete {
    for_whom: DeleteFor,
    done: mpsc::Receiver<Outcomes>,
    /// The devices being deleted, and since when.
    ids: Vec<u32>,
    began: Instant,
    /// Where each device's delete stands.
    stages: Stages,
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

/// What a client's delete was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Request {
    /// `del -n ID`: answered with its error, if any.
    One,
    /// `del -a`: answered with what was deleted and what failed.
    All,
    /// `shutdown`: as `del -a`; ublkd exits once every device is deleted.
    Shutdown,
}

/// Who a delete is for, and so who hears how it ended.
#[derive(Debug)]
pub(super) enum DeleteFor {
    Client {
        token: Token,
        request: Request,
        /// Adds under way given up by the same request (deleted before they were made).
        given_up: Vec<u32>,
    },
    /// A client's delete that took longer than [`DELETE_ANSWER_BY`]: the client has
    /// been told where it stood; the rest is logged.
    Answered,
    /// The devices a reload found gone from the config file, counted in its outcome.
    Reload,
}

impl Daemon {
    /// Deletes `devices` off the loop, for `for_whom`, as `safety` allows. A client is
    /// answered now (the answer returned) if there is nothing to delete or no thread to
    /// delete them on.
    pub(super) fn begin_delete(
        &mut self,
        for_whom: DeleteFor,
        devices: Vec<Device>,
        safety: Safety,
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
        let stages = Stages::default();
        let thread_stages = stages.clone();
        let spawned = std::thread::Builder::new().name("ublkd-delete".into()).spawn(move || {
            let devices =
                std::mem::take(&mut *for_thread.lock().unwrap_or_else(|p| p.into_inner()));
            let outcomes = match CtrlClient::open() {
                Ok(ctrl) => Device::delete_all(&ctrl, &state, devices, safety, &thread_stages)
                    .into_iter()
                    .map(|(id, d)| (id, Ended::from(d)))
                    .collect(),
                Err(e) => {
                    let why = format!("cannot open a control client to delete it: {e}");
                    let ids: Vec<u32> = devices.iter().map(Device::id).collect();
                    // Not deleted, not forgotten: left in the kernel and the state dir
                    // for the next ublkd, as a failed delete is.
                    devices.into_iter().map(Device::leave).for_each(|left| left.signal());
                    ids.into_iter().map(|id| (id, Ended::Failed(why.clone()))).collect()
                }
            };
            drop(tx.send(outcomes));
        });
        if let Err(e) = spawned {
            tracing::warn!("deleting on the loop: cannot start a thread: {e}");
            let devices = std::mem::take(&mut *queue.lock().unwrap_or_else(|p| p.into_inner()));
            let outcomes =
                Device::delete_all(&self.ctx.ctrl, &self.ctx.state, devices, safety, &stages)
                    .into_iter()
                    .map(|(id, d)| (id, Ended::from(d)))
                    .collect();
            return self.delete_done(for_whom, outcomes);
        }
        let began = Instant::now();
        self.pending_deletes.push(PendingDelete { for_whom, done, ids, began, stages });
        None
    }

    /// A delete's end: the devices kept put back into the table, and a client's answer
    /// (returned, not sent), or the reload told.
    fn delete_done(&mut self, for_whom: DeleteFor, outcomes: Outcomes) -> Option<CtlResponse> {
        let mut ended = Vec::with_capacity(outcomes.len());
        let mut kept = Vec::new();
        for (id, outcome) in outcomes {
            match outcome {
                Ended::Kept(dev, why) => {
                    // Served as before: its workers' ends meanwhile are looked at now.
                    self.devices.insert(id, *dev);
                    self.devices.wake(id);
                    kept.push((id, why));
                }
                Ended::Deleted => ended.push((id, Ok(()))),
                Ended::Failed(e) => {
                    tracing::error!(dev_id = id, "delete failed: {e}");
                    ended.push((id, Err(e)));
                }
            }
        }
        kept.sort_unstable_by_key(|(id, _)| *id);
        for (id, why) in &kept {
            if let Some(what) = why.what() {
                tracing::warn!(dev_id = id, event = "delete_refused", "not deleted: {what}");
            }
        }
        match for_whom {
            DeleteFor::Client { request, given_up, .. } => {
                if request == Request::Shutdown && !kept.is_empty() {
                    // Nothing (or not everything) deleted: ublkd serves on.
                    self.shutting_down = false;
                    tracing::info!(event = "shutdown_refused", "shutdown refused: devices in use");
                }
                Some(response(ended, kept, request, given_up))
            }
            DeleteFor::Answered => {
                if !kept.is_empty() {
                    self.shutting_down = false;
                }
                None
            }
            DeleteFor::Reload => {
                self.reload_deletes_done(ended, kept);
                None
            }
        }
    }

    /// Answers the deletes whose threads are done, and those of clients past
    /// [`DELETE_ANSWER_BY`] with where they stand; with `wait`, waits for every one
    /// (ublkd is stopping: a delete cut short would leave a device half deleted).
    pub(super) fn finish_deletes(&mut self, wait: bool) {
        let now = Instant::now();
        for mut pending in std::mem::take(&mut self.pending_deletes) {
            let outcomes = match pending.done.try_recv() {
                Ok(outcomes) => outcomes,
                Err(mpsc::TryRecvError::Empty) if !wait => {
                    if let DeleteFor::Client { token, .. } = &pending.for_whom
                        && now.saturating_duration_since(pending.began) >= DELETE_ANSWER_BY
                    {
                        let message = not_done_yet(&pending.stages, now - pending.began);
                        tracing::warn!(event = "delete_slow", "{message}");
                        self.control.respond(*token, &CtlResponse::Error { message }, now);
                        pending.for_whom = DeleteFor::Answered;
                    }
                    self.pending_deletes.push(pending);
                    continue;
                }
                Err(mpsc::TryRecvError::Empty) => pending.done.recv().unwrap_or_default(),
                Err(mpsc::TryRecvError::Disconnected) => Vec::new(),
            };
            let token = match &pending.for_whom {
                DeleteFor::Client { token, .. } => Some(*token),
                DeleteFor::Answered | DeleteFor::Reload => None,
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

/// The answer to a client whose delete is not done after `so_far`: where each device's
/// delete stands.
fn not_done_yet(stages: &Stages, so_far: Duration) -> String {
    let each: Vec<String> =
        stages.now().iter().map(|(id, what)| format!("device {id}: {what}")).collect();
    format!(
        "the delete is not done after {} s ({}); ublkd goes on with it by itself, and \
         `ublkctl status` shows the devices until they are deleted",
        so_far.as_secs(),
        if each.is_empty() { "starting".to_string() } else { each.join("; ") }
    )
}

/// The answer to a delete: the ids deleted (with `given_up`), or what failed (a device
/// whose delete failed is no longer served, and stays in the kernel for the next ublkd
/// to adopt), or what was kept, in use, and why.
fn response(
    mut ended: Vec<(u32, Result<(), String>)>,
    kept: Vec<(u32, Refusal)>,
    request: Request,
    given_up: Vec<u32>,
) -> CtlResponse {
    ended.sort_unstable_by_key(|(id, _)| *id);
    let mut deleted = Vec::new();
    let mut failed = Vec::new();
    for (id, outcome) in ended {
        match outcome {
            Ok(()) => deleted.push(id),
            Err(e) => failed.push((id, e)),
        }
    }
    if request == Request::One
        && let Some((_, e)) = failed.pop()
    {
        return CtlResponse::Error { message: e };
    }
    deleted.extend(given_up);
    deleted.sort_unstable();
    if !kept.is_empty() {
        let message = refused(&kept, &deleted, &failed, request);
        // Kept because a disk is in use (or could not be checked: then not known free).
        return Failure::new(ErrorKind::Busy, message).into();
    }
    if failed.is_empty() {
        return CtlResponse::Deleted { ids: deleted };
    }
    let failed: Vec<String> = failed.iter().map(|(id, e)| format!("device {id}: {e}")).collect();
    CtlResponse::Error {
        message: format!("delete failed: {} (deleted: {})", failed.join("; "), list(&deleted)),
    }
}

/// "0, 3", or "none".
fn list(ids: &[u32]) -> String {
    if ids.is_empty() {
        return "none".into();
    }
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
}

/// Why a delete kept the devices in `kept`, and what else it did:
/// `device 0 is in use: mounted at /mnt (unmount it, or delete with --force)`.
pub(super) fn refused(
    kept: &[(u32, Refusal)],
    deleted: &[u32],
    failed: &[(u32, String)],
    request: Request,
) -> String {
    let whys: Vec<(String, String)> =
        kept.iter().filter_map(|(_, r)| Some((r.what()?, r.remedy()))).collect();
    let remedy = match whys.as_slice() {
        [(_, remedy)] => remedy.clone(),
        _ => "free them".into(),
    };
    let force = match request {
        Request::Shutdown => "shut down with --force",
        Request::One | Request::All => "delete with --force",
    };
    let what: Vec<&str> = whys.iter().map(|(what, _)| what.as_str()).collect();
    let mut message = format!("{} ({remedy}, or {force})", what.join("; "));
    let nothing_done = deleted.is_empty() && failed.is_empty();
    match request {
        Request::One => {}
        Request::All if nothing_done => message = format!("nothing deleted: {message}"),
        Request::Shutdown if nothing_done => {
            message = format!("ublkd not shut down, nothing deleted: {message}");
        }
        Request::All | Request::Shutdown => {
            let kept: Vec<u32> = kept.iter().map(|(id, _)| *id).collect();
            message =
                format!("{message}; deleted: {}; still served: {}", list(deleted), list(&kept));
            for (id, e) in failed {
                message.push_str(&format!("; device {id}: delete failed: {e}"));
            }
        }
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::in_use::{Holder, InUse};

    fn mounted(id: u32, at: &str) -> (u32, Refusal) {
        (id, Refusal::InUse(InUse { id, holder: Holder::Mount(at.into()) }))
    }

    #[test]
    fn a_refused_del_names_the_mount_point_and_the_way_out() {
        let kept = [mounted(0, "/mnt")];
        assert_eq!(
            refused(&kept, &[], &[], Request::One),
            "device 0 is in use: mounted at /mnt (unmount it, or delete with --force)"
        );
    }

    #[test]
    fn a_refused_del_all_lists_each_busy_device_and_deletes_nothing() {
        let process = Holder::Process { pid: 7, comm: "dd".into() };
        let kept = [
            mounted(0, "/mnt"),
            (1, Refusal::Others),
            (2, Refusal::InUse(InUse { id: 2, holder: process })),
        ];
        assert_eq!(
            refused(&kept, &[], &[], Request::All),
            "nothing deleted: device 0 is in use: mounted at /mnt; device 2 is in use: open \
             in process 7 (dd) (free them, or delete with --force)"
        );
        let response = response(Vec::new(), kept.to_vec(), Request::All, Vec::new());
        assert!(
            matches!(response, CtlResponse::Failed { kind: ErrorKind::Busy, .. }),
            "{response:?}"
        );
    }

    #[test]
    fn a_refused_shutdown_says_ublkd_serves_on() {
        assert_eq!(
            refused(&[mounted(3, "/srv")], &[], &[], Request::Shutdown),
            "ublkd not shut down, nothing deleted: device 3 is in use: mounted at /srv \
             (unmount it, or shut down with --force)"
        );
    }

    #[test]
    fn a_device_found_busy_after_others_were_deleted_says_what_was_done() {
        let message = refused(&[mounted(1, "/mnt")], &[0, 2], &[], Request::All);
        assert_eq!(
            message,
            "device 1 is in use: mounted at /mnt (unmount it, or delete with --force); \
             deleted: 0, 2; still served: 1"
        );
    }

    #[test]
    fn a_delete_with_nothing_kept_answers_the_ids() {
        let ended = vec![(2, Ok(())), (0, Ok(()))];
        let answer = response(ended, Vec::new(), Request::All, vec![5]);
        assert_eq!(answer, CtlResponse::Deleted { ids: vec![0, 2, 5] });
    }

    #[test]
    fn a_slow_delete_says_where_each_device_stands() {
        let stages = Stages::default();
        let message = not_done_yet(&stages, Duration::from_secs(25));
        assert!(message.starts_with("the delete is not done after 25 s (starting)"), "{message}");
    }
}
