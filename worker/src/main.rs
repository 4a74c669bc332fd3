//! `ublkd-worker`: serves one ublk device's queues, started by `ublkd` (never by hand)
//! with a control socket on the fd given by `--control-fd`.
//!
//! Life of a worker: receive [`WorkerSetup`] and its fds (the shared region, the
//! target's fd); map the region and the target, allocate the tags' buffers, make every
//! queue thread's ring (created disabled; the main thread is the first queue thread),
//! lock the sandbox down, and report [`FromWorker::Standby`]. A standby waits, warm,
//! until the supervisor activates it with the device (`/dev/ublkcN`): then it maps the
//! descriptor arrays, each thread registers the device in its ring, enables it and
//! PREPs its tags, the worker reports [`FromWorker::Ready`], and it serves until the
//! kernel closes the queues (device stopped) or the supervisor says
//! [`ToWorker::Shutdown`] (a control thread listens from then on). Everything that
//! can be done before the device is known is, and the main thread does the
//! activation itself, so a recovery waits for no process, thread or ring to start and
//! for no thread hand-off.
//!
//! Exit codes (see [`WorkerExit`]) tell the supervisor why a worker ended.

#[cfg(feature = "test-hooks")]
mod attack;
mod bufring;
mod device;
mod hooks;
mod queue;
mod sandbox;
mod target;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::process::ExitCode;
use std::sync::{Arc, Barrier, mpsc};

use ublkd_proto::exit::WorkerExit;
use ublkd_proto::msg::{self, FromWorker, SandboxLayer, ToWorker, WorkerSetup};
use ublkd_proto::shm::{Geometry, ShmRegion};

use crate::device::{DescArray, Device, TagBuffers};
use crate::queue::{QueueThread, StandbyRing, plan};

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("UBLKD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--version" || a == "-V") {
        println!("ublkd-worker {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let Some(fd) = control_fd(&args) else {
        eprintln!("ublkd-worker: started by ublkd only (usage: ublkd-worker --control-fd N)");
        return ExitCode::from(WorkerExit::Protocol);
    };
    let identity = match sandbox_identity(&args) {
        Ok(id) => id,
        Err(e) => {
            eprintln!("ublkd-worker: {e}");
            return ExitCode::from(WorkerExit::Protocol);
        }
    };
    // SAFETY: the supervisor placed the control socket at this fd for us alone; it is
    // not otherwise owned in this process.
    let control = unsafe { OwnedFd::from_raw_fd(fd) };
    hooks::before_sandbox();
    // The sandbox goes up before the worker reads a single message.
    let report = match identity.map(|(id, optional)| sandbox::apply(id, &optional, fd)).transpose()
    {
        Ok(report) => report,
        Err(e) => return ExitCode::from(fail(control.as_fd(), WorkerExit::Setup, e.to_string())),
    };
    ExitCode::from(run(control, report))
}

/// `--sandbox-uid U --sandbox-gid G [--sandbox-optional LAYER,…]`, or `--no-sandbox`.
type SandboxArgs = (sandbox::Identity, Vec<SandboxLayer>);

fn sandbox_identity(args: &[String]) -> Result<Option<SandboxArgs>, String> {
    let text = |flag: &str| args.iter().position(|a| a == flag).map(|at| args.get(at + 1));
    let value = |flag: &str| -> Result<Option<u32>, String> {
        match text(flag) {
            None => Ok(None),
            Some(v) => v
                .and_then(|v| v.parse().ok())
                .map(Some)
                .ok_or_else(|| format!("{flag} needs a number")),
        }
    };
    let optional = match text("--sandbox-optional") {
        None => Vec::new(),
        Some(None) => return Err("--sandbox-optional needs a list of layers".into()),
        Some(Some(list)) => {
            SandboxLayer::parse_list(list).map_err(|e| format!("--sandbox-optional: {e}"))?
        }
    };
    match (
        value("--sandbox-uid")?,
        value("--sandbox-gid")?,
        args.iter().any(|a| a == "--no-sandbox"),
    ) {
        (Some(uid), Some(gid), false) => Ok(Some((sandbox::Identity { uid, gid }, optional))),
        (None, None, true) => Ok(None),
        _ => Err("give --sandbox-uid and --sandbox-gid, or --no-sandbox".into()),
    }
}

fn control_fd(args: &[String]) -> Option<i32> {
    let at = args.iter().position(|a| a == "--control-fd")?;
    args.get(at + 1)?.parse().ok().filter(|fd| *fd >= 3)
}

fn fail(control: BorrowedFd<'_>, code: WorkerExit, reason: String) -> WorkerExit {
    tracing::error!("{reason}");
    let _ = msg::send_packet(control, &FromWorker::Failed { reason }, &[]);
    code
}

fn run(control: OwnedFd, sandbox_report: Option<msg::SandboxReport>) -> WorkerExit {
    let sandboxed = sandbox_report.is_some();
    let (setup, mut fds) = match msg::recv_packet::<ToWorker>(control.as_fd()) {
        Ok((ToWorker::Setup(setup), fds)) => (setup, fds),
        Ok((other, _)) => {
            return fail(
                control.as_fd(),
                WorkerExit::Protocol,
                format!("expected Setup, got {other:?}"),
            );
        }
        Err(e) => {
            return fail(control.as_fd(), WorkerExit::Protocol, format!("no setup message: {e}"));
        }
    };
    if fds.len() != setup.fd_count() {
        let reason = format!("setup came with {} fds, expected {}", fds.len(), setup.fd_count());
        return fail(control.as_fd(), WorkerExit::Protocol, reason);
    }
    let target_fds = fds.split_off(1);
    let shm_fd = fds.pop().expect("one fd");
    // Everything that does not need the device itself is done now, while standing by:
    // mappings, the target, every thread and its ring.
    let standby = match Standby::prepare(&setup, shm_fd.as_fd(), target_fds) {
        Ok(s) => s,
        Err(reason) => return fail(control.as_fd(), WorkerExit::Setup, reason),
    };
    drop(shm_fd);
    let threads = match ThreadSet::start(&setup, standby.target.fixed_file(), &control, sandboxed) {
        Ok(t) => t,
        Err(reason) => return fail(control.as_fd(), WorkerExit::Setup, reason),
    };
    // Every ring and thread exists: from here on, none can be created (all threads).
    if sandboxed && let Err(e) = sandbox::lock_down() {
        return fail(control.as_fd(), WorkerExit::Setup, e.to_string());
    }
    let rings = if setup.fast_release { threads.ring_fds.clone() } else { Vec::new() };
    let standby_msg = FromWorker::Standby { sandbox: sandbox_report, rings };
    if let Err(e) = msg::send_packet(control.as_fd(), &standby_msg, &[]) {
        tracing::error!("cannot report standby: {e}");
        return WorkerExit::Orphaned;
    }
    let (generation, ublkc) = match msg::recv_packet::<ToWorker>(control.as_fd()) {
        Ok((ToWorker::Activate { generation }, mut fds)) if fds.len() == 1 => {
            (generation, fds.pop().expect("one fd"))
        }
        Ok((ToWorker::Shutdown, _)) => return WorkerExit::Clean,
        Ok((other, fds)) => {
            let reason = format!("expected Activate with 1 fd, got {other:?} with {}", fds.len());
            return fail(control.as_fd(), WorkerExit::Protocol, reason);
        }
        // The supervisor let a standby go (or died): nothing to do.
        Err(_) => return WorkerExit::Orphaned,
    };
    let activating = std::time::Instant::now();
    let dev = match standby.activate(ublkc.as_fd(), generation) {
        Ok(dev) => Arc::new(dev),
        Err(reason) => return fail(control.as_fd(), WorkerExit::Setup, reason),
    };
    let mapped = activating.elapsed();
    let (own, running) = match threads.activate(&dev, ublkc.as_raw_fd()) {
        Ok(t) => t,
        Err(reason) => return fail(control.as_fd(), WorkerExit::Setup, reason),
    };
    let prepped = activating.elapsed();
    let micros = |d: std::time::Duration| d.as_micros().min(u128::from(u32::MAX)) as u32;
    let ready = FromWorker::Ready(msg::Activation {
        map_us: micros(mapped),
        prep_us: micros(prepped - mapped),
    });
    if let Err(e) = msg::send_packet(control.as_fd(), &ready, &[]) {
        tracing::error!("cannot report ready: {e}");
        return WorkerExit::Orphaned;
    }
    // From here the control thread listens to the supervisor.
    let _ = running.control_go.send(generation);
    let _ = running.end_go.send(());
    // The main thread serves the first plan's queues itself: no thread hand-off on the
    // way from the supervisor's Activate to Ready.
    let result = own.run(&running.barrier).map_err(|e| e.to_string());
    let _ = running.done.send(result);
    // The end thread exits the process once every queue thread is done.
    loop {
        std::thread::park();
    }
}

/// The queue threads (the main thread serves the first plan itself), started while
/// standing by, each with its ring made and waiting for the device.
struct ThreadSet {
    own: StandbyRing,
    /// Every thread's ring, the main thread's first.
    ring_fds: Vec<RawFd>,
    activate: Vec<mpsc::Sender<(Arc<Device>, RawFd)>>,
    prepped: mpsc::Receiver<Result<(), String>>,
    running: Running,
}

/// What the main thread needs once it serves.
struct Running {
    barrier: Arc<Barrier>,
    done: mpsc::Sender<Result<(), String>>,
    /// Tells the control thread (with the generation) that the device is being served.
    control_go: mpsc::Sender<u64>,
    /// Tells the end thread the same.
    end_go: mpsc::Sender<()>,
}

impl ThreadSet {
    /// Makes the main thread's ring, starts one thread per other plan entry and waits
    /// until each has its ring (`restricted` for a sandboxed worker), starts the control
    /// thread (idle until activation), and the thread that ends the worker when the
    /// queue threads end (the queues closed, or the data path failed).
    fn start(
        setup: &WorkerSetup,
        target_file: Option<BorrowedFd<'_>>,
        control: &OwnedFd,
        restricted: bool,
    ) -> Result<Self, String> {
        let mut plans = plan(setup.nr_threads, setup.nr_queues);
        let nr_threads = plans.len();
        let barrier = Arc::new(Barrier::new(nr_threads));
        let target_fd = target_file.map(|f| f.as_raw_fd());
        let (ring_tx, ring_rx) = mpsc::channel::<Result<RawFd, String>>();
        let (prepped_tx, prepped) = mpsc::channel::<Result<(), String>>();
        let (done_tx, done_rx) = mpsc::channel::<Result<(), String>>();
        // Each queue thread on its own CPU, spread by device and thread number.
        let cpus = queue::allowed_cpus();
        let cpu_of = |thread: usize| queue::cpu_of(&cpus, setup.dev_id, thread);
        let own = StandbyRing::new(plans.remove(0), setup, target_fd, cpu_of(0), restricted)
            .map_err(|e| e.to_string())?;
        let mut activate = Vec::with_capacity(nr_threads);
        for p in plans {
            let (activate_tx, activate_rx) = mpsc::channel::<(Arc<Device>, RawFd)>();
            activate.push(activate_tx);
            let (barrier, ring_tx, prepped_tx, done_tx) =
                (Arc::clone(&barrier), ring_tx.clone(), prepped_tx.clone(), done_tx.clone());
            let index = p.index;
            let cpu = cpu_of(index);
            let setup = setup.clone();
            std::thread::Builder::new()
                .name(format!("ublk-q{index}"))
                .spawn(move || {
                    let standby = match StandbyRing::new(p, &setup, target_fd, cpu, restricted) {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = ring_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let _ = ring_tx.send(Ok(standby.ring_fd()));
                    // No device: the standby was let go and the process is exiting.
                    let Ok((dev, ublkc)) = activate_rx.recv() else { return };
                    match standby.activate(dev, ublkc).and_then(|mut t| t.prep().map(|()| t)) {
                        Ok(t) => {
                            let _ = prepped_tx.send(Ok(()));
                            let _ = done_tx.send(t.run(&barrier).map_err(|e| e.to_string()));
                        }
                        Err(e) => {
                            let _ = prepped_tx.send(Err(e.to_string()));
                        }
                    }
                })
                .map_err(|e| format!("cannot start thread {index}: {e}"))?;
        }
        drop((ring_tx, prepped_tx));
        let mut ring_fds = vec![own.ring_fd()];
        for _ in 1..nr_threads {
            match ring_rx.recv() {
                Ok(Ok(fd)) => ring_fds.push(fd),
                Ok(Err(reason)) => return Err(reason),
                Err(_) => return Err("a queue thread died".into()),
            }
        }
        let dev_id = setup.dev_id;
        let (end_go, end_go_rx) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("ublk-end".into())
            .spawn(move || {
                // Only a serving worker ends here. A standby that is let go (or fails to
                // activate) ends through the main thread with its own exit code; its
                // queue threads end without a result then, which is no data-path error.
                if end_go_rx.recv().is_err() {
                    return;
                }
                for _ in 0..nr_threads {
                    match done_rx.recv() {
                        Ok(Ok(())) => {}
                        Ok(Err(reason)) => {
                            tracing::error!("data path failed: {reason}");
                            std::process::exit(i32::from(WorkerExit::DataPath.code()));
                        }
                        Err(_) => std::process::exit(i32::from(WorkerExit::DataPath.code())),
                    }
                }
                tracing::info!(dev_id, "queues closed, exiting");
                std::process::exit(i32::from(WorkerExit::Clean.code()));
            })
            .map_err(|e| format!("cannot start the worker's end thread: {e}"))?;
        let (control_go, go) = mpsc::channel::<u64>();
        let control_raw = control.as_raw_fd();
        std::thread::Builder::new()
            .name("ublk-control".into())
            .spawn(move || {
                // A standby that is let go never gets here: the main thread reads the
                // socket until activation, then hands it over.
                let Ok(generation) = go.recv() else { return };
                hooks::on_serving(generation);
                // SAFETY: the control socket is owned by `main`'s frame, which never
                // returns while the worker serves (it parks), so the fd stays open.
                let control = unsafe { BorrowedFd::borrow_raw(control_raw) };
                let code = match msg::recv_packet::<ToWorker>(control) {
                    Ok((ToWorker::Shutdown, _)) => WorkerExit::Clean,
                    Ok(_) => WorkerExit::Protocol,
                    Err(_) => WorkerExit::Orphaned,
                };
                std::process::exit(i32::from(code.code()));
            })
            .map_err(|e| format!("cannot start the worker's control thread: {e}"))?;
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
    fn activate(self, dev: &Arc<Device>, ublkc: RawFd) -> Result<(QueueThread, Running), String> {
        for tx in &self.activate {
            tx.send((Arc::clone(dev), ublkc)).map_err(|_| "a queue thread died".to_string())?;
        }
        let mut own = self.own.activate(Arc::clone(dev), ublkc).map_err(|e| e.to_string())?;
        own.prep().map_err(|e| e.to_string())?;
        for _ in 0..self.activate.len() {
            match self.prepped.recv() {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => return Err(reason),
                Err(_) => return Err("a queue thread died".into()),
            }
        }
        Ok((own, self.running))
    }
}

/// A worker set up for a device but not yet serving it.
struct Standby {
    setup: WorkerSetup,
    shm: ShmRegion,
    bufs: TagBuffers,
    target: Box<dyn target::Target>,
}

impl Standby {
    fn prepare(
        setup: &WorkerSetup,
        shm_fd: BorrowedFd<'_>,
        target_fds: Vec<OwnedFd>,
    ) -> Result<Standby, String> {
        if setup.nr_queues == 0 || setup.queue_depth == 0 || setup.nr_threads == 0 {
            return Err(format!("setup has a zero dimension: {setup:?}"));
        }
        let page = device::page_size();
        let buf_bytes = setup.max_io_buf_bytes as usize;
        if buf_bytes == 0 || !buf_bytes.is_multiple_of(page) {
            return Err(format!(
                "max_io_buf_bytes {buf_bytes} is not a positive multiple of the page"
            ));
        }
        let geometry = Geometry {
            dev_id: setup.dev_id,
            nr_queues: setup.nr_queues,
            queue_depth: setup.queue_depth,
            nr_threads: setup.nr_threads,
        };
        let shm = ShmRegion::open(shm_fd, geometry).map_err(|e| e.to_string())?;
        let bufs = TagBuffers::new(setup.nr_queues, setup.queue_depth, buf_bytes, !setup.zero_copy)
            .map_err(|e| format!("cannot allocate tag buffers: {e}"))?;
        let target = target::build(&setup.target, setup.size_bytes, target_fds)
            .map_err(|e| e.to_string())?;
        Ok(Standby { setup: setup.clone(), shm, bufs, target })
    }

    /// Maps the device's descriptor arrays: from here on this process is the
    /// device's server (the kernel lets one address space map them per incarnation).
    fn activate(self, ublkc: BorrowedFd<'_>, generation: u64) -> Result<Device, String> {
        let setup = &self.setup;
        let mut descs = Vec::with_capacity(usize::from(setup.nr_queues));
        for q_id in 0..setup.nr_queues {
            descs.push(
                DescArray::map(ublkc, q_id, setup.queue_depth)
                    .map_err(|e| format!("cannot map queue {q_id}'s descriptors: {e}"))?,
            );
        }
        Ok(Device {
            dev_id: setup.dev_id,
            nr_queues: setup.nr_queues,
            depth: setup.queue_depth,
            size_bytes: setup.size_bytes,
            descs,
            bufs: self.bufs,
            shm: self.shm,
            target: self.target,
            generation,
            zero_copy: setup.zero_copy,
        })
    }
}
