//! `ublkd-worker`: serves one ublk device's queues, started by `ublkd` (never by hand)
//! with a control socket on the fd given by `--control-fd`.
//!
//! Life of a worker: receive [`WorkerSetup`](msg::WorkerSetup) and its fds (the shared
//! region, the target's fd); map the region and the target, allocate the tags' buffers,
//! make every queue thread's ring (created disabled; the main thread is the first queue
//! thread), lock the sandbox down, and report [`FromWorker::Standby`]. A standby waits,
//! warm, until the supervisor activates it with the device (`/dev/ublkcN`): then it
//! maps the descriptor arrays, each thread registers the device in its ring, enables it
//! and PREPs its tags, the worker reports [`FromWorker::Ready`], and it serves until
//! the kernel closes the queues (device stopped) or the supervisor says
//! [`ToWorker::Shutdown`] (a control thread listens from then on). Everything that can
//! be done before the device is known is, and the main thread does the activation
//! itself, so a recovery waits for no process, thread or ring to start and for no
//! thread hand-off.
//!
//! Exit codes (see [`WorkerExit`]) tell the supervisor why a worker ended.
//!
//! An rbd worker is started with `--rbd`: it loads librbd before the sandbox empties
//! its filesystem. `ublkd-worker --probe-rbd` is the other mode: it opens the RBD image
//! its standard input describes and says what it is (see [`probe`]).

#[cfg(feature = "test-hooks")]
mod attack;
mod bufring;
mod device;
mod hooks;
mod probe;
mod queue;
mod sandbox;
mod standby;
mod sys;
mod target;
mod threads;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::process::ExitCode;
use std::sync::Arc;

use ublkd_proto::exit::WorkerExit;
use ublkd_proto::msg::{self, FromWorker, MsgError, SandboxLayer, ToWorker, UnknownLayer};

use crate::sandbox::SandboxError;
use crate::standby::{Standby, StandbyError};
use crate::threads::{ThreadError, ThreadSet};

/// Bad command-line arguments (the worker is started by ublkd only).
#[derive(Debug, thiserror::Error)]
enum ArgsError {
    #[error("{flag} needs a number")]
    NotANumber { flag: &'static str },
    #[error("--sandbox-optional needs a list of layers")]
    NoLayers,
    #[error("--sandbox-optional: {0}")]
    Layers(UnknownLayer),
    #[error("give --sandbox-uid and --sandbox-gid, or --no-sandbox")]
    Identity,
}

/// Why a worker gives up before serving; the text is what the supervisor is told
/// (`FromWorker::Failed`).
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("expected Setup, got {0:?}")]
    NotSetup(Box<ToWorker>),
    #[error("no setup message: {0}")]
    NoSetup(MsgError),
    #[error("setup came with {got} fds, expected {want}")]
    SetupFds { got: usize, want: usize },
    #[error("expected Activate with {fixed} to {} fds, got {msg:?} with {fds}", fixed + msg::MAX_HELD_FDS)]
    NotActivate { msg: Box<ToWorker>, fds: usize, fixed: usize },
    #[error(
        "Activate names {got} clients to fence, at most {} allowed",
        msg::rbd::MAX_FENCED_CLIENTS
    )]
    TooManyFenced { got: usize },
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Standby(#[from] StandbyError),
    #[error(transparent)]
    Threads(#[from] ThreadError),
}

impl Failure {
    /// The exit code that tells the supervisor what kind of failure it was.
    fn exit(&self) -> WorkerExit {
        match self {
            Failure::NotSetup(_)
            | Failure::NoSetup(_)
            | Failure::SetupFds { .. }
            | Failure::NotActivate { .. }
            | Failure::TooManyFenced { .. } => WorkerExit::Protocol,
            Failure::Sandbox(_) | Failure::Standby(_) | Failure::Threads(_) => WorkerExit::Setup,
        }
    }
}

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
    if args.iter().any(|a| a == "--probe-rbd") {
        return probe::run(&args);
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
    bound_malloc_arenas();
    // librbd must be in memory before the sandbox empties the filesystem; a failure
    // is kept and reported once the setup says this is an rbd device.
    let profile = if args.iter().any(|a| a == "--rbd") {
        let _ = target::rbd::ffi::preload();
        // Where the image's size changes are reported from librbd's threads.
        target::rbd::set_control_fd(fd);
        sandbox::Profile::Rbd
    } else {
        sandbox::Profile::Standard
    };
    let connect_ports = match connect_ports(&args) {
        Ok(ports) => ports,
        Err(e) => {
            eprintln!("ublkd-worker: --rbd-connect-ports: {e}");
            return ExitCode::from(WorkerExit::Protocol);
        }
    };
    // The sandbox goes up before the worker reads a single message.
    let report = match identity
        .map(|(id, optional)| sandbox::apply(id, &optional, fd, profile, &connect_ports))
        .transpose()
    {
        Ok(report) => report,
        Err(e) => return leave(profile, fail(control.as_fd(), e.into())),
    };
    let code = run(control, report, profile);
    leave(profile, code)
}

/// The exit code main returns; with librbd loaded, `_exit` instead: returning from
/// main runs `exit`, whose C++ static destructors would race with librados's threads,
/// still running (librados has no way to stop them all).
fn leave(profile: sandbox::Profile, code: WorkerExit) -> ExitCode {
    if profile == sandbox::Profile::Rbd {
        sys::exit_now(i32::from(code.code()));
    }
    ExitCode::from(code)
}

/// `--sandbox-uid U --sandbox-gid G [--sandbox-optional LAYER,…]`, or `--no-sandbox`.
type SandboxArgs = (sandbox::Identity, Vec<SandboxLayer>);

fn sandbox_identity(args: &[String]) -> Result<Option<SandboxArgs>, ArgsError> {
    let text = |flag: &str| args.iter().position(|a| a == flag).map(|at| args.get(at + 1));
    let value = |flag: &'static str| -> Result<Option<u32>, ArgsError> {
        match text(flag) {
            None => Ok(None),
            Some(v) => {
                v.and_then(|v| v.parse().ok()).map(Some).ok_or(ArgsError::NotANumber { flag })
            }
        }
    };
    let optional = match text("--sandbox-optional") {
        None => Vec::new(),
        Some(None) => return Err(ArgsError::NoLayers),
        Some(Some(list)) => SandboxLayer::parse_list(list).map_err(ArgsError::Layers)?,
    };
    match (
        value("--sandbox-uid")?,
        value("--sandbox-gid")?,
        args.iter().any(|a| a == "--no-sandbox"),
    ) {
        (Some(uid), Some(gid), false) => Ok(Some((sandbox::Identity { uid, gid }, optional))),
        (None, None, true) => Ok(None),
        _ => Err(ArgsError::Identity),
    }
}

/// `--rbd-connect-ports LIST`: the TCP ports an rbd worker (or probe) may connect to.
fn connect_ports(args: &[String]) -> Result<Vec<sandbox::PortRange>, String> {
    match args.iter().position(|a| a == "--rbd-connect-ports") {
        None => Ok(Vec::new()),
        Some(at) => sandbox::parse_port_ranges(args.get(at + 1).map_or("", String::as_str)),
    }
}

fn control_fd(args: &[String]) -> Option<i32> {
    let at = args.iter().position(|a| a == "--control-fd")?;
    args.get(at + 1)?.parse().ok().filter(|fd| *fd >= 3)
}

/// Tells the supervisor (and the log) why the worker gives up; returns its exit code.
fn fail(control: BorrowedFd<'_>, failure: Failure) -> WorkerExit {
    let reason = failure.to_string();
    tracing::error!("{reason}");
    let _ = msg::send_packet(control, &FromWorker::Failed { reason }, &[]);
    failure.exit()
}

/// Fixes glibc's limit on malloc arenas now, while files can be opened: left unset,
/// glibc computes it the first time a ninth arena is wanted (a worker with eight queue
/// threads or more), by reading `/sys/devices/system/cpu/online`, an `openat` the
/// sandbox refuses (the worker was killed for it, seen with `--threads 8`). Eight per
/// CPU the worker may run on: glibc's own default on 64-bit hosts.
fn bound_malloc_arenas() {
    let cpus = queue::allowed_cpus().len().clamp(1, 64) as libc::c_int;
    // SAFETY: mallopt only sets a tunable of the allocator; no memory is touched.
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, cpus * 8) } != 1 {
        tracing::warn!("cannot bound malloc's arenas; a worker with many threads may be refused");
    }
}

fn run(
    control: OwnedFd,
    sandbox_report: Option<msg::SandboxReport>,
    profile: sandbox::Profile,
) -> WorkerExit {
    let sandboxed = sandbox_report.is_some();
    let (setup, mut fds) = match msg::recv_packet::<ToWorker>(control.as_fd()) {
        Ok((ToWorker::Setup(setup), fds)) => (setup, fds),
        Ok((other, _)) => return fail(control.as_fd(), Failure::NotSetup(Box::new(other))),
        Err(e) => return fail(control.as_fd(), Failure::NoSetup(e)),
    };
    if fds.len() != setup.fd_count() {
        let failure = Failure::SetupFds { got: fds.len(), want: setup.fd_count() };
        return fail(control.as_fd(), failure);
    }
    let target_fds = fds.split_off(1);
    let shm_fd = fds.pop().expect("one fd");
    // Everything that does not need the device itself is done now, while standing by:
    // mappings, the target, every thread and its ring.
    let standby = match Standby::prepare(&setup, shm_fd.as_fd(), target_fds) {
        Ok(s) => s,
        Err(e) => return fail(control.as_fd(), e.into()),
    };
    drop(shm_fd);
    let client = standby.client_identity();
    let target_file = |thread| standby.target_file(thread);
    let threads = match ThreadSet::start(&setup, target_file, &control, sandboxed, client.clone()) {
        Ok(t) => t,
        Err(e) => return fail(control.as_fd(), e.into()),
    };
    // Every ring and thread exists: from here on, none can be created (all threads),
    // but by an rbd worker's librados and librbd (see `sandbox::policy::RBD_ALWAYS`).
    if sandboxed && let Err(e) = sandbox::lock_down(profile) {
        return fail(control.as_fd(), e.into());
    }
    let rings = if setup.fast_release { threads.ring_fds.clone() } else { Vec::new() };
    let standby_msg = FromWorker::Standby { sandbox: sandbox_report, rings, client };
    if let Err(e) = msg::send_packet(control.as_fd(), &standby_msg, &[]) {
        tracing::error!("cannot report standby: {e}");
        return WorkerExit::Orphaned;
    }
    // `/dev/ublkcN`, the target's (an NBD socket), then the fds held for a successor.
    let fixed = 1 + setup.target.activation_fds();
    let (generation, fence, ublkc, target_fds, held) =
        match msg::recv_packet::<ToWorker>(control.as_fd()) {
            Ok((ToWorker::Activate { generation, fence }, mut fds))
                if (fixed..=fixed + msg::MAX_HELD_FDS).contains(&fds.len()) =>
            {
                if fence.len() > msg::rbd::MAX_FENCED_CLIENTS {
                    return fail(control.as_fd(), Failure::TooManyFenced { got: fence.len() });
                }
                let held = fds.split_off(fixed);
                let target_fds = fds.split_off(1);
                (generation, fence, fds.pop().expect("one fd"), target_fds, held)
            }
            Ok((ToWorker::Shutdown, _)) => return WorkerExit::Clean,
            Ok((other, fds)) => {
                let failure = Failure::NotActivate { msg: Box::new(other), fds: fds.len(), fixed };
                return fail(control.as_fd(), failure);
            }
            // The supervisor let a standby go (or died): nothing to do.
            Err(_) => return WorkerExit::Orphaned,
        };
    hooks::on_activate(setup.dev_id, generation);
    let activating = std::time::Instant::now();
    let dev = match standby.activate(ublkc.as_fd(), target_fds, &fence, generation) {
        Ok(dev) => Arc::new(dev),
        Err(e) => return fail(control.as_fd(), e.into()),
    };
    let mapped = activating.elapsed();
    if hooks::skips_fetch(setup.dev_id, generation) {
        // Ready, with not one tag fetched: the kernel's START_DEV or END_USER_RECOVERY
        // waits on this worker until ublkd gives it up.
        let held = held.iter().map(AsRawFd::as_raw_fd).collect();
        let ready = FromWorker::Ready(msg::Activation { map_us: 0, prep_us: 0, held });
        let _ = msg::send_packet(control.as_fd(), &ready, &[]);
        loop {
            std::thread::park();
        }
    }
    let (own, running) = match threads.activate(&dev, ublkc.as_raw_fd()) {
        Ok(t) => t,
        Err(e) => return fail(control.as_fd(), e.into()),
    };
    let prepped = activating.elapsed();
    let micros = |d: std::time::Duration| d.as_micros().min(u128::from(u32::MAX)) as u32;
    let ready = FromWorker::Ready(msg::Activation {
        map_us: micros(mapped),
        prep_us: micros(prepped - mapped),
        held: held.iter().map(AsRawFd::as_raw_fd).collect(),
    });
    if let Err(e) = msg::send_packet(control.as_fd(), &ready, &[]) {
        tracing::error!("cannot report ready: {e}");
        return WorkerExit::Orphaned;
    }
    // From here the control thread listens to the supervisor. `held` stays open in
    // this frame, which never returns, for as long as the worker serves.
    let held_fds = held.iter().map(AsRawFd::as_raw_fd).collect();
    let _ = running.control_go.send((generation, held_fds, Arc::clone(&dev)));
    let _ = running.end_go.send(Arc::clone(&dev));
    // The main thread serves the first plan's queues itself: no thread hand-off on the
    // way from the supervisor's Activate to Ready.
    let _ = running.done.send(own.run(&running.barrier));
    // The end thread exits the process once every queue thread is done.
    loop {
        std::thread::park();
    }
}
