//! Targets: what a device's I/O is served from.
//!
//! The interface is small on purpose: a target starts a request and either finishes it
//! at once or asks the queue loop to submit one io_uring SQE for it, and is told that
//! SQE's result. A target whose I/O is not one SQE per request (`nbd`: a stream
//! shared by many requests) submits SQEs of its own through the same ring
//! ([`Target::arm`], [`Target::before_wait`]), is told their results
//! ([`Target::on_own_cqe`]), and hands back the requests they finished
//! ([`TargetWork`]). Adding a target means adding a module here and a `TargetSetup`
//! variant in proto; the queue loop does not change.

mod fail;
mod loopback;
mod memory;
mod nbd;
mod null;
pub mod rbd;
mod read_only;
mod request;

use std::os::fd::{BorrowedFd, OwnedFd};

use io_uring::squeue;
use ublkd_proto::msg::{TargetSetup, WorkerSetup};

pub use fail::FailTarget;
pub use loopback::LoopTarget;
pub use memory::MemoryTarget;
pub use nbd::NbdTarget;
pub use null::NullTarget;
pub use rbd::RbdTarget;
pub use read_only::ReadOnlyTarget;
pub use request::{Bounds, IoReq, Reply};

/// Index of the target's file in each ring's registered files (1 is `/dev/ublkcN`).
pub const TARGET_FIXED_FD: u32 = 0;

/// What to do next with a request.
#[derive(Debug)]
pub enum Step {
    /// Finished: commit this result (bytes, or `-errno`).
    Done(i32),
    /// Submit this SQE (the loop sets its user data) and call `on_cqe` with its result.
    Submit(squeue::Entry),
    /// The target finishes the request later: through [`TargetWork::done`] on this
    /// thread, or by posting its completion into the ring named by [`IoReq::reply`]
    /// from another; the loop calls `on_cqe` with it.
    Pending,
}

/// What a target's own completion led to, for the queue loop to carry out: SQEs to
/// submit (their user data made by [`own_user_data`]), and requests of this thread
/// finished, as (their [`Reply::user_data`], result). Reused from turn to turn.
#[derive(Debug, Default)]
pub struct TargetWork {
    pub sqes: Vec<squeue::Entry>,
    pub done: Vec<(u64, i32)>,
    /// Of `sqes`, how many usually complete while they are submitted (`nbd`: a send,
    /// which the socket takes at once): the loop's wait counts their completions in,
    /// as it does a COMMIT's, so that they do not end its sleep by themselves (at qd 1
    /// that was a third wake-up per request).
    pub inline: usize,
}

/// The user data of an SQE the target makes for itself: its completion comes back to
/// [`Target::on_own_cqe`] with `key`.
pub fn own_user_data(key: u32) -> u64 {
    crate::queue::user_data::UserData::TargetOwn { key }.encode()
}

/// A device's backend.
pub trait Target: Send + Sync {
    /// Starts `req`.
    fn start(&self, req: &IoReq) -> Step;

    /// The SQE of `req` completed with `res`; `done` is the bytes finished before it
    /// (for resubmitting the rest of a short transfer), kept by the loop per tag.
    fn on_cqe(&self, req: &IoReq, res: i32, done: &mut u32) -> Step;

    /// SQEs of the target's own that queue thread `thread` submits before its first
    /// turn (`nbd`: the first RECV of the connection that thread reads).
    fn arm(&self, _thread: usize, _work: &mut TargetWork) {}

    /// Queue thread `thread` is about to submit what its turn queued and wait: the
    /// target's own SQEs that should go with it (`nbd`: the turn's requests, sent
    /// together). Called every turn, so it must be cheap when there is nothing to do.
    fn before_wait(&self, _thread: usize, _work: &mut TargetWork) {}

    /// An SQE of the target's own, submitted by queue thread `thread` with
    /// [`own_user_data`]`(key)`, completed with `res`.
    fn on_own_cqe(&self, _thread: usize, _key: u32, _res: i32, _work: &mut TargetWork) {}

    /// The file to register at [`TARGET_FIXED_FD`] in queue thread `thread`'s ring,
    /// if any (`loop`: the backing file, the same in every ring; `rbd`: the thread's
    /// own eventfd).
    fn fixed_file(&self, thread: usize) -> Option<BorrowedFd<'_>>;

    /// Activation: the target's fds that come with the device
    /// (`TargetSetup::activation_fds`: none but for `nbd`, whose sockets they are),
    /// and the clients of the device's earlier workers it may fence (`rbd`, see
    /// `ToWorker::Activate`; empty for the others).
    fn activate(&self, fds: Vec<OwnedFd>, _fence: &[String]) -> Result<(), TargetError> {
        if fds.is_empty() {
            Ok(())
        } else {
            Err(TargetError::Fds { target: "this", want: 0, got: fds.len() })
        }
    }

    /// The target's client identity in its backend, which the device's later workers
    /// may fence (`rbd`: its Ceph client's address; see `FromWorker::Standby`).
    /// The device is being deleted and its stop waits on what the backend holds
    /// (`ToWorker::GiveUpHeld`): fail every request held now with EIO, and every new
    /// one at once. How many were held (`rbd` only: the others answer by themselves).
    fn give_up_held(&self) -> usize {
        0
    }

    fn client_identity(&self) -> Option<String> {
        None
    }

    /// Every queue thread has ended (a serving worker's clean end): logs what the
    /// target's traffic with its backend was (`nbd`: requests per send and per
    /// receive), for whoever tunes its batching.
    fn report(&self) {}

    /// The device was stopped and every queue thread has ended, the worker is about to
    /// exit cleanly: gives back what the target holds outside this process (an rbd
    /// image's exclusive lock), so that the next user does not find it held by a client
    /// that is gone.
    fn release(&self) {}

    /// After [`Self::release`], every queue thread having ended, just before the worker
    /// exits cleanly: closes what the target has open in its backend, so that nothing of
    /// this worker lingers there (an rbd image's watch on its header, which the cluster
    /// would keep until its 30 s timeout, the image "busy" to `rbd rm` meanwhile).
    ///
    /// # Safety
    ///
    /// No thread may use the target for I/O from now on: every queue thread has ended.
    unsafe fn close(&self) {}

    /// Whether this target fails requests by design (`fail-io`): its failures are not
    /// logged one by one.
    fn fails_on_purpose(&self) -> bool {
        false
    }
}

/// Errors setting a target up.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("target {target} needs {want} file descriptor(s), got {got}")]
    Fds { target: &'static str, want: usize, got: usize },
    #[error("the memory target's memfd is {got} bytes, smaller than the device's {want}")]
    MemoryTooSmall { got: u64, want: u64 },
    #[error("the loop target's backing file is {got} bytes, smaller than the device's {want}")]
    LoopTooSmall { got: u64, want: u64 },
    #[error(
        "a zero-copy nbd device needs one connection per queue thread (a request's pages \
         are registered in the ring of the thread that fetched it, which must move its \
         data), and this worker got {connections} connection(s) for {threads} thread(s)"
    )]
    NbdZeroCopyConnections { connections: u8, threads: usize },
    #[error("the rbd target has no image: its setup came without `rbd`")]
    NoRbdSetup,
    #[error(transparent)]
    Rbd(#[from] rbd::RbdError),
    #[error("cannot map or inspect the target's file: {0}")]
    Io(#[from] std::io::Error),
}

/// Builds the target `setup` describes from the fds that came with it.
pub fn build(setup: &WorkerSetup, mut fds: Vec<OwnedFd>) -> Result<Box<dyn Target>, TargetError> {
    let size = setup.size_bytes;
    let want = setup.target.target_fds();
    if fds.len() != want {
        let target = match setup.target {
            TargetSetup::Null => "null",
            TargetSetup::Memory => "memory",
            TargetSetup::Loop => "loop",
            TargetSetup::FailIo => "fail-io",
            TargetSetup::Nbd { .. } => "nbd",
            TargetSetup::Rbd => "rbd",
        };
        return Err(TargetError::Fds { target, want, got: fds.len() });
    }
    let target: Box<dyn Target> = match setup.target {
        TargetSetup::Null => Box::new(NullTarget),
        TargetSetup::Memory => Box::new(MemoryTarget::new(fds.remove(0), size)?),
        TargetSetup::Loop => Box::new(LoopTarget::new(fds.remove(0), size)?),
        TargetSetup::FailIo => Box::new(FailTarget),
        TargetSetup::Nbd { connections } => {
            Box::new(NbdTarget::new(connections, setup.zero_copy, usize::from(setup.nr_threads))?)
        }
        TargetSetup::Rbd => {
            let rbd = setup.rbd.as_ref().ok_or(TargetError::NoRbdSetup)?;
            Box::new(RbdTarget::new(rbd, size, setup.nr_threads, setup.read_only)?)
        }
    };
    // `fail-io` fails every request anyway.
    Ok(if setup.read_only && setup.target != TargetSetup::FailIo {
        Box::new(ReadOnlyTarget::new(target))
    } else {
        target
    })
}
