//! Handing a worker its device: `Activate` sent with `/dev/ublkcN`, its target's
//! connections and the fds it holds for ublkd's successor, and its `Ready` taken once it
//! answers, on a later turn of the loop ([`Activating`]), never waited for.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use ublkd_proto::msg::{Activation, FromWorker, ToWorker};

use super::{Worker, WorkerError};

impl Worker {
    /// Hands the worker the device (`/dev/ublkcN`) and its target's connections, if it
    /// has any (an nbd worker: `target`, see [`TargetSetup::activation_fds`]), without
    /// waiting for its answer: it maps the device and PREPs every tag (a few
    /// milliseconds), then says Ready on its control socket, which the loop watches
    /// ([`Self::has_answered`]) before it takes the answer ([`Self::activation_answer`]).
    pub fn begin_activation(
        &mut self,
        generation: u64,
        ublkc: BorrowedFd<'_>,
        target: &[OwnedFd],
        fence: &[String],
    ) -> Result<(), WorkerError> {
        let mut fds = vec![ublkc];
        fds.extend(target.iter().map(AsFd::as_fd));
        if fds.len() != 1 + self.target.activation_fds() {
            let what =
                format!("activation with {} target fds for {:?}", fds.len() - 1, self.target);
            return Err(WorkerError::Protocol { pid: self.pid, what });
        }
        let fixed = fds.len();
        fds.push(self.control.as_fd());
        fds.extend(self.stderr_copy.as_ref().map(AsFd::as_fd));
        self.send(&ToWorker::Activate { generation, fence: fence.to_vec() }, &fds)?;
        self.held_sent = fds.len() - fixed;
        // The worker has its own copy now.
        self.stderr_copy = None;
        Ok(())
    }

    /// The worker's answer to its activation ([`Self::begin_activation`]), once it has
    /// answered ([`Self::has_answered`]: this then does not wait), or within `timeout`.
    pub fn activation_answer(&mut self, timeout: Duration) -> Result<Activation, WorkerError> {
        match self.receive(timeout)? {
            (FromWorker::Ready(activation), _) => {
                if activation.held.len() != self.held_sent {
                    let what = format!(
                        "held {} fds of the {} sent",
                        activation.held.len(),
                        self.held_sent
                    );
                    return Err(WorkerError::Protocol { pid: self.pid, what });
                }
                self.held.clone_from(&activation.held);
                self.activated = Some(Instant::now());
                Ok(activation)
            }
            (other, _) => self.unexpected("Ready", other),
        }
    }
}

/// A worker being handed its device (`Device::begin_activation`): the loop watches its
/// control socket and ends the activation (`Device::end_activation`) once it answers or
/// at its deadline, never waiting for it.
#[derive(Debug)]
pub struct Activating {
    worker: Worker,
    generation: u64,
    /// When the worker must have answered.
    deadline: Instant,
}

impl Activating {
    /// `worker`, sent its activation for `generation`, to answer by `deadline`.
    pub fn new(worker: Worker, generation: u64, deadline: Instant) -> Activating {
        Activating { worker, generation, deadline }
    }

    /// The worker, and the generation it was activated for.
    pub fn into_parts(self) -> (Worker, u64) {
        (self.worker, self.generation)
    }

    /// Whether the activation can end now: the worker answered (or hung up), or its
    /// time is up.
    pub fn due(&self, now: Instant) -> bool {
        now >= self.deadline || self.worker.has_answered()
    }

    /// The socket on which the worker answers.
    pub fn control(&self) -> BorrowedFd<'_> {
        self.worker.control()
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The worker being activated.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Gives the activation up: its worker, to be killed with the device's others.
    pub fn into_worker(self) -> Worker {
        self.worker
    }
}
