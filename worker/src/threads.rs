//! The worker's threads: the queue threads (the main thread serves the first plan
//! itself), started while standing by, each with its ring made and waiting for the
//! device; the control thread, which listens to the supervisor once the device is
//! served; and the end thread, which ends the worker when the queue threads end.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Barrier, mpsc};

use ublkd_proto::exit::WorkerExit;
use ublkd_proto::msg::{self, FromWorker, MsgError, ToWorker, WorkerSetup};

use crate::device::Device;
use crate::hooks;
use crate::queue::{self, LoopError, QueueThread, StandbyRing, plan_for};

/// Why the worker's threads cannot be started or activated.
#[derive(Debug, thiserror::Error)]
pub enum ThreadError {
    #[error(transparent)]
    Loop(#[from] LoopError),
    #[error("cannot start {what}: {source}")]
    Spawn { what: String, source: std::io::Error },
    #[error("a queue thread died")]
    Died,
}

/// The queue threads (the main thread serves the first plan itself), started while
/// standing by, each with its ring made and waiting for the device.
pub struct ThreadSet {
    own: StandbyRing,
    /// Every thread's ring, the main thread's first.
    pub ring_fds: Vec<RawFd>,
    activate: Vec<mpsc::Sender<(Arc<Device>, RawFd)>>,
    prepped: mpsc::Receiver<Result<(), LoopError>>,
    running: Running,
}

/// What the main thread needs once it serves.
pub struct Running {
    pub barrier: Arc<Barrier>,
    pub done: mpsc::Sender<Result<(), LoopError>>,
    /// Tells the control thread (with the generation, and the fds held for a successor)
    /// that the device is being served.
    /// The generation, the held fds and the activated device, for the control thread.
    pub control_go: mpsc::Sender<(u64, Vec<RawFd>, Arc<Device>)>,
    /// Tells the end thread the same.
    /// The activated device, for the end thread to release its target on a clean end.
    pub end_go: mpsc::Sender<Arc<Device>>,
}

impl ThreadSet {
    /// Makes the main thread's ring, starts one thread per other plan entry and waits
    /// until each has its ring (`restricted` for a sandboxed worker), starts the control
    /// thread (idle until activation), and the thread that ends the worker when the
    /// queue threads end (the queues closed, or the data path failed). `target_file`
    /// names the target's file each thread's ring registers (by the thread's number);
    /// `client` is the target's client identity, for `Attached`.
    pub fn start<'a>(
        setup: &WorkerSetup,
        target_file: impl Fn(usize) -> Option<BorrowedFd<'a>>,
        control: &OwnedFd,
        restricted: bool,
        client: Option<String>,
    ) -> Result<Self, ThreadError> {
        let mut plans = plan_for(setup.data_path, setup.nr_threads, setup.nr_queues);
        if plans.len() < usize::from(setup.nr_threads) {
            tracing::info!(
                dev_id = setup.dev_id,
                "per-I/O data path: {} threads asked, {} serve (one per queue)",
                setup.nr_threads,
                plans.len()
            );
        }
        let nr_threads = plans.len();
        let barrier = Arc::new(Barrier::new(nr_threads));
        let (ring_tx, ring_rx) = mpsc::channel::<Result<RawFd, LoopError>>();
        let (prepped_tx, prepped) = mpsc::channel::<Result<(), LoopError>>();
        let (done_tx, done_rx) = mpsc::channel::<Result<(), LoopError>>();
        // Each queue thread on its own CPU, spread by device and thread number.
        let cpus = queue::allowed_cpus();
        let cpu_of = |thread: usize| queue::cpu_of(&cpus, setup.dev_id, thread);
        let target_fd = |thread: usize| target_file(thread).map(|f| f.as_raw_fd());
        let own = StandbyRing::new(plans.remove(0), setup, target_fd(0), cpu_of(0), restricted)?;
        let mut activate = Vec::with_capacity(nr_threads);
        for p in plans {
            let (activate_tx, activate_rx) = mpsc::channel::<(Arc<Device>, RawFd)>();
            activate.push(activate_tx);
            let (barrier, ring_tx, prepped_tx, done_tx) =
                (Arc::clone(&barrier), ring_tx.clone(), prepped_tx.clone(), done_tx.clone());
            let index = p.index;
            let cpu = cpu_of(index);
            let target_fd = target_fd(index);
            let setup = setup.clone();
            std::thread::Builder::new()
                .name(format!("ublk-q{index}"))
                .spawn(move || {
                    let standby = match StandbyRing::new(p, &setup, target_fd, cpu, restricted) {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = ring_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ring_tx.send(Ok(standby.ring_fd()));
                    // No device: the standby was let go and the process is exiting.
                    let Ok((dev, ublkc)) = activate_rx.recv() else { return };
                    match standby.activate(dev, ublkc).and_then(|mut t| t.prep().map(|()| t)) {
                        Ok(t) => {
                            let _ = prepped_tx.send(Ok(()));
                            let _ = done_tx.send(t.run(&barrier));
                        }
                        Err(e) => {
                            let _ = prepped_tx.send(Err(e));
                        }
                    }
                })
                .map_err(|source| ThreadError::Spawn { what: format!("thread {index}"), source })?;
        }
        drop((ring_tx, prepped_tx));
        let mut ring_fds = vec![own.ring_fd()];
        for _ in 1..nr_threads {
            match ring_rx.recv() {
                Ok(Ok(fd)) => ring_fds.push(fd),
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(ThreadError::Died),
            }
        }
        let dev_id = setup.dev_id;
        let (end_go, end_go_rx) = mpsc::channel::<Arc<Device>>();
        let queues_ended = QueuesEnded::new();
        let queues_ended_tx = Arc::clone(&queues_ended);
        std::thread::Builder::new()
            .name("ublk-end".into())
            .spawn(move || {
                // Only a serving worker ends here. A standby that is let go (or fails to
                // activate) ends through the main thread with its own exit code; its
                // queue threads end without a result then, which is no data-path error.
                let Ok(dev) = end_go_rx.recv() else { return };
                for _ in 0..nr_threads {
                    match done_rx.recv() {
                        Ok(Ok(())) => {}
                        Ok(Err(reason)) => {
                            tracing::error!("data path failed: {reason}");
                            crate::sys::exit_now(i32::from(WorkerExit::DataPath.code()));
                        }
                        Err(_) => crate::sys::exit_now(i32::from(WorkerExit::DataPath.code())),
                    }
                }
                tracing::info!(dev_id, "queues closed, exiting");
                queues_ended_tx.ended();
                dev.target.report();
                dev.target.release();
                // SAFETY: every queue thread has ended (each sent its result above), so
                // nothing uses the target for I/O any more.
                unsafe { dev.target.close() };
                crate::sys::exit_now(i32::from(WorkerExit::Clean.code()));
            })
            .map_err(|source| ThreadError::Spawn {
                what: "the worker's end thread".into(),
                source,
            })?;
        let (control_go, go) = mpsc::channel::<(u64, Vec<RawFd>, Arc<Device>)>();
        let per_io = setup.data_path == msg::DataPath::PerIo;
        let control_raw = control.as_raw_fd();
        let rings = if setup.fast_release { ring_fds.clone() } else { Vec::new() };
        std::thread::Builder::new()
            .name("ublk-control".into())
            .spawn(move || {
                // A standby that is let go never gets here: the main thread reads the
                // socket until activation, then hands it over.
                let Ok((generation, held, dev)) = go.recv() else { return };
                hooks::on_serving(generation, per_io, control_raw, &held);
                // SAFETY: the control socket is owned by `main`'s frame, which never
                // returns while the worker serves (it parks), so the fd stays open.
                let control = unsafe { BorrowedFd::borrow_raw(control_raw) };
                // The worker holds its supervisor's end of the socket (see
                // `ToWorker::Activate`), so the socket does not end when the supervisor
                // does: a serving worker serves on and answers whichever supervisor
                // takes it over.
                let code = loop {
                    match msg::recv_packet::<ToWorker>(control) {
                        Ok((ToWorker::Shutdown, _)) => {
                            // Asked to end (its device deleted, or handed to another
                            // worker). The device is stopped first, so the queues end
                            // soon: the end thread then gives back and closes what the
                            // target holds outside, and exits. Only if they do not
                            // (the stop failed) is the lock given back here, and the
                            // target left open: a queue thread may still use it.
                            if queues_ended.wait(QUEUES_END_WAIT) {
                                loop {
                                    std::thread::park();
                                }
                            }
                            dev.target.release();
                            break WorkerExit::Clean;
                        }
                        Ok((ToWorker::GiveUpHeld, _)) => {
                            // Its device is being deleted; the queue threads commit
                            // what the target gives up as they wake.
                            dev.target.give_up_held();
                        }
                        Ok((ToWorker::Attach, _)) => {
                            let (rings, client) = (rings.clone(), client.clone());
                            let attached =
                                FromWorker::Attached { dev_id, generation, rings, client };
                            if let Err(e) = msg::send_packet(control, &attached, &[]) {
                                tracing::warn!("cannot answer a supervisor's Attach: {e}");
                            }
                        }
                        Ok(_) => break WorkerExit::Protocol,
                        // Not held (an activation that held nothing): nobody can take
                        // this worker over, and its supervisor is gone.
                        Err(MsgError::Closed) => break WorkerExit::Orphaned,
                        Err(e) => {
                            tracing::error!("unreadable message from the supervisor: {e}");
                            break WorkerExit::Protocol;
                        }
                    }
                };
                crate::sys::exit_now(i32::from(code.code()));
            })
            .map_err(|source| ThreadError::Spawn {
                what: "the worker's control thread".into(),
                source,
            })?;
        Ok(ThreadSet {
            own,
            ring_fds,
            activate,
            prepped,
            running: Running { barrier, done: done_tx, control_go, end_go },
        })
    }

    /// Gives every thread the device, activates and PREPs the main thread's own ring,
    /// and waits until every other thread has PREPed its queues. Returns the main
    /// thread's loop, to run once Ready is sent.
    pub fn activate(
        self,
        dev: &Arc<Device>,
        ublkc: RawFd,
    ) -> Result<(QueueThread, Running), ThreadError> {
        for tx in &self.activate {
            tx.send((Arc::clone(dev), ublkc)).map_err(|_| ThreadError::Died)?;
        }
        let mut own = self.own.activate(Arc::clone(dev), ublkc)?;
        own.prep()?;
        for _ in 0..self.activate.len() {
            match self.prepped.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(ThreadError::Died),
            }
        }
        Ok((own, self.running))
    }
}

/// How long a worker asked to end waits for its queue threads to end (they do once the
/// device is stopped, which the supervisor does first), so that the end thread closes
/// the target before the process exits.
const QUEUES_END_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether every queue thread of a serving worker has ended: set by the end thread,
/// waited for by the control thread when it is asked to end.
#[derive(Debug, Default)]
struct QueuesEnded {
    ended: std::sync::Mutex<bool>,
    changed: std::sync::Condvar,
}

impl QueuesEnded {
    fn new() -> Arc<QueuesEnded> {
        Arc::new(QueuesEnded::default())
    }

    fn ended(&self) {
        *self.ended.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.changed.notify_all();
    }

    /// Whether they ended within `timeout`.
    fn wait(&self, timeout: std::time::Duration) -> bool {
        let ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        let (ended, _) = self
            .changed
            .wait_timeout_while(ended, timeout, |ended| !*ended)
            .unwrap_or_else(|p| p.into_inner());
        *ended
    }
}
