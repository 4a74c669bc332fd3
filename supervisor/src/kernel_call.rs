//! The kernel commands whose duration a worker decides, run off the loop: START_DEV
//! and END_USER_RECOVERY wait in the kernel until every tag of every queue has been
//! fetched (PREPed) by the device's new worker. A worker that answers its activation
//! without fetching them would hold the waiting thread for ever; on the loop, that is
//! every client and every other device's recovery. This module owns those calls: each
//! runs on a thread of its own with a control client of its own, the loop polls for its
//! end ([`KernelCall::poll`]), and past its deadline, or when the device goes away
//! (a delete, an upgrade, ublkd stopping), the call is interrupted and waited for
//! before anything else is done to the device (DEL_DEV, for one, would wait for it).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
use ublkd_proto::ctrl::{CtrlClient, CtrlCmd, CtrlError};
use ublkd_proto::msg::Activation;

use crate::worker::Worker;

/// How often the loop looks whether a call has ended: its thread has no fd to poll,
/// and a call usually ends within milliseconds of the worker's answer.
pub const POLL: Duration = Duration::from_millis(5);

/// How often an interrupted call's thread is signalled again until it ends: a signal
/// that came just before the thread entered its wait is not seen by that wait.
const RESIGNAL: Duration = Duration::from_millis(10);

/// How long an interrupted call may take to end before it is given up (its thread
/// left behind): io_uring interrupts the kernel's wait at once.
const INTERRUPT_WAIT: Duration = Duration::from_secs(2);

/// The signal that interrupts a call's thread. ublkd uses it for nothing else.
const SIGNAL: Signal = Signal::SIGUSR2;

/// Errors of a kernel call run off the loop.
#[derive(Debug, thiserror::Error)]
pub enum KernelCallError {
    #[error(transparent)]
    Ctrl(#[from] CtrlError),
    #[error("cannot start a thread for {cmd}: {source}")]
    Thread { cmd: CtrlCmd, source: std::io::Error },
    #[error(
        "worker {worker} answered its activation but did not fetch its tags within {secs} s \
         ({cmd} waited for them); it was killed"
    )]
    Unfetched { cmd: CtrlCmd, worker: u32, secs: u64 },
    #[error("worker {worker} ended before it fetched its tags ({cmd} waited for them)")]
    WorkerEnded { cmd: CtrlCmd, worker: u32 },
    #[error("{cmd} did not end when interrupted; its thread is left behind")]
    Stuck { cmd: CtrlCmd },
    #[error("the thread running {cmd} ended without an answer")]
    Lost { cmd: CtrlCmd },
}

/// A START_DEV or END_USER_RECOVERY running on its own thread, with the worker it
/// waits for and what that worker said of its activation. Dropped before it ended, it
/// interrupts the call and waits for its end.
#[derive(Debug)]
pub struct KernelCall {
    cmd: CtrlCmd,
    began: Instant,
    deadline: Instant,
    /// Its deadline's length, for messages.
    limit: Duration,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    done: mpsc::Receiver<Result<(), CtrlError>>,
    worker: Option<Worker>,
    activation: Option<Activation>,
}

impl KernelCall {
    /// Runs `cmd` for device `id`, served by this process (its workers' pid namespace
    /// parent), on a thread of its own; `worker` is the one it waits for, given up
    /// `limit` from now. If no thread can be started, the worker is killed.
    pub fn begin(
        cmd: CtrlCmd,
        id: u32,
        worker: Worker,
        activation: Activation,
        limit: Duration,
    ) -> Result<KernelCall, KernelCallError> {
        install_handler();
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, done) = mpsc::channel();
        let for_thread = Arc::clone(&stop);
        let spawned = std::thread::Builder::new().name(format!("ublk-{cmd}")).spawn(move || {
            unblock_signal();
            let pid = std::process::id() as i32;
            let result = CtrlClient::open()
                .and_then(|ctrl| ctrl.run_interruptible(cmd, id, pid, &for_thread));
            let _ = tx.send(result);
        });
        let thread = match spawned {
            Ok(thread) => thread,
            Err(source) => {
                let mut worker = worker;
                worker.kill();
                worker.reap(Duration::ZERO);
                return Err(KernelCallError::Thread { cmd, source });
            }
        };
        let began = Instant::now();
        Ok(KernelCall {
            cmd,
            began,
            deadline: began + limit,
            limit,
            stop,
            thread: Some(thread),
            done,
            worker: Some(worker),
            activation: Some(activation),
        })
    }

    /// When the call was begun.
    pub fn began(&self) -> Instant {
        self.began
    }

    /// What status says of the device while the call runs.
    pub fn note(&self) -> String {
        let pid = self.worker.as_ref().map_or(0, Worker::pid);
        format!(
            "{} waits for worker {pid} to fetch its tags (at most {} s)",
            self.cmd,
            self.limit.as_secs()
        )
    }

    /// When the loop should look again: soon, or at the deadline.
    pub fn next_look(&self, now: Instant) -> Instant {
        (now + POLL).min(self.deadline)
    }

    /// The worker the call waits for.
    pub fn worker(&self) -> Option<&Worker> {
        self.worker.as_ref()
    }

    /// `None` while the call runs and its deadline is ahead; else its outcome, with the
    /// worker and its activation. Past the deadline, or once the worker has ended, the
    /// call is interrupted (and waited for): the worker answered Ready without fetching
    /// its tags, and is killed.
    #[allow(clippy::type_complexity)]
    pub fn poll(
        &mut self,
        now: Instant,
    ) -> Option<(Worker, Activation, Result<(), KernelCallError>)> {
        let cmd = self.cmd;
        let outcome = match self.done.try_recv() {
            Ok(result) => result.map_err(KernelCallError::from),
            Err(mpsc::TryRecvError::Disconnected) => Err(KernelCallError::Lost { cmd }),
            Err(mpsc::TryRecvError::Empty) => {
                let ended = self.worker.as_ref().is_some_and(Worker::has_exited);
                if now < self.deadline && !ended {
                    return None;
                }
                let pid = self.worker.as_ref().map_or(0, Worker::pid);
                if let Some(worker) = &self.worker {
                    worker.kill();
                }
                match self.interrupt() {
                    // It ended on its own meanwhile.
                    Some(Ok(())) => Ok(()),
                    Some(Err(_)) if ended => Err(KernelCallError::WorkerEnded { cmd, worker: pid }),
                    Some(Err(_)) => Err(KernelCallError::Unfetched {
                        cmd,
                        worker: pid,
                        secs: self.limit.as_secs(),
                    }),
                    None => Err(KernelCallError::Stuck { cmd }),
                }
            }
        };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let worker = self.worker.take()?;
        let activation = self.activation.take()?;
        Some((worker, activation, outcome))
    }

    /// Interrupts the call and waits for its end (at most [`INTERRUPT_WAIT`]): its
    /// outcome, or `None` if it did not end (its thread is then left behind).
    fn interrupt(&mut self) -> Option<Result<(), CtrlError>> {
        let thread = self.thread.as_ref()?;
        self.stop.store(true, Ordering::SeqCst);
        let pthread = std::os::unix::thread::JoinHandleExt::as_pthread_t(thread);
        let until = Instant::now() + INTERRUPT_WAIT;
        loop {
            // The thread has not been joined or detached (its JoinHandle is held), so
            // its pthread_t is valid even if it has already returned.
            let _ = nix::sys::pthread::pthread_kill(pthread, SIGNAL);
            match self.done.recv_timeout(RESIGNAL) {
                Ok(result) => return Some(result),
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < until => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    tracing::error!("{} did not end when interrupted", self.cmd);
                    // Left running: joining it would hold the loop for ever.
                    self.thread.take();
                    return None;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Some(Err(CtrlError::Protocol {
                        cmd: self.cmd,
                        dev: ublkd_proto::ctrl::DevTarget::Driver,
                        what: "its thread ended without an answer".into(),
                    }));
                }
            }
        }
    }

    /// Gives the call up (the device is being deleted, upgraded, or ublkd stops):
    /// interrupts it, waits for its end, and hands back its worker, not killed.
    pub fn into_worker(mut self) -> Option<Worker> {
        self.give_up();
        self.worker.take()
    }

    fn give_up(&mut self) {
        if self.thread.is_some() {
            if self.done.try_recv().is_err() {
                self.interrupt();
            }
            if let Some(thread) = self.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

impl Drop for KernelCall {
    fn drop(&mut self) {
        self.give_up();
        if let Some(worker) = &self.worker {
            worker.kill();
        }
    }
}

/// The handler of [`SIGNAL`]: it does nothing; its being there is what makes the
/// signal interrupt the call's wait (an ignored signal would not).
extern "C" fn on_signal(_: libc::c_int) {}

/// Installs the no-op handler of [`SIGNAL`], once. Without `SA_RESTART`: the waiting
/// `io_uring_enter` must return EINTR to its caller, which then cancels the command,
/// rather than be restarted by the C library and wait on.
fn install_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let action =
            SigAction::new(SigHandler::Handler(on_signal), SaFlags::empty(), SigSet::empty());
        // SAFETY: the handler is async-signal-safe (it does nothing), and no other
        // handler of SIGNAL exists to be replaced.
        if let Err(e) = unsafe { sigaction(SIGNAL, &action) } {
            tracing::error!("cannot install the handler that interrupts kernel calls: {e}");
        }
    });
}

/// Lets [`SIGNAL`] reach the calling thread, whatever mask it inherited.
fn unblock_signal() {
    let _ = SigSet::from(SIGNAL).thread_unblock();
}
