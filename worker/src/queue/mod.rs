//! The worker's queue threads: which queues each serves ([`plan`](mod@plan)), its ring
//! made while standing by ([`ring`]), and its io_uring loop ([`thread`], timed by
//! [`clock`]), which runs
//! the target for every request the kernel delivers, with one of two sets of ublk
//! commands (the device's [`DataPath`](ublkd_proto::msg::DataPath)):
//! - [`batched`] (`UBLK_F_BATCH_IO`, Linux >= 7.0): PREP its queues, keep a multishot
//!   FETCH armed on each queue it serves, and COMMIT results in batches (one COMMIT per
//!   queue per loop turn); any thread may serve any queue;
//! - [`per_io`] (every other kernel): a FETCH_REQ per tag, then a COMMIT_AND_FETCH_REQ
//!   per request, each queue served by one thread.
//!
//! A COMMIT the kernel refuses (even partly) means the worker and the kernel disagree
//! about who owns a tag. The loop does not guess: it fails, the worker exits, and the
//! supervisor recovers the device, whose in-flight I/O the kernel reissues (REISSUE) to
//! the next worker, so no I/O fails.

pub mod batched;
pub mod clock;
pub mod per_io;
pub mod plan;
pub mod ring;
pub mod thread;
pub mod user_data;

use ublkd_proto::batch;
use ublkd_proto::errno::Errno;

pub use plan::{allowed_cpus, cpu_of, plan_for};
pub use ring::StandbyRing;
pub use thread::QueueThread;

/// Errors that end a thread (and so the worker).
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("cannot set up thread {thread}'s io_uring: {source}")]
    Ring { thread: usize, source: std::io::Error },
    #[error("PREP of queue {q_id} failed: {}", Errno(-res))]
    Prep { q_id: u16, res: i32 },
    #[error("the kernel refused FETCH_REQ of queue {q_id} (tag {tag}): {errno}")]
    FetchReq { q_id: u16, tag: u16, errno: Errno },
    #[error("the kernel refused a COMMIT on queue {q_id} (tag {tag}): {what}")]
    Commit { q_id: u16, tag: u16, what: CommitRefusal },
    #[error("FETCH on queue {q_id} delivered a malformed batch: {source}")]
    Fetch { q_id: u16, source: batch::BatchError },
    #[error("io_uring wait failed in thread {thread}: {source}")]
    Wait { thread: usize, source: std::io::Error },
    /// Zero copy: the kernel could not register a request's pages in this ring (its
    /// slot taken, or no memory) and delivered it unregistered. This worker cannot
    /// move its data, and failing it would be an I/O error: it exits instead, leaving
    /// the request to the kernel, which re-issues it to the next worker, whose rings
    /// are fresh.
    #[error(
        "the kernel could not register the pages of queue {q_id}'s request {tag} in this \
         worker's ring (zero copy); ending so that a fresh worker serves it"
    )]
    PagesNotRegistered { q_id: u16, tag: u16 },
}

/// How a COMMIT went wrong.
#[derive(Debug, thiserror::Error)]
pub enum CommitRefusal {
    #[error("{0}")]
    Errno(Errno),
    #[error("unexpected completion {0}")]
    Unexpected(i32),
    #[error(transparent)]
    Batch(#[from] batch::BatchError),
    #[error("only {done} of {sent} elements were taken")]
    Partial { done: usize, sent: usize },
}
