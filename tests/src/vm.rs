//! One VM run: boot the cached kernel under qemu, run a command inside, return its
//! exit status.
//!
//! Per run, under `<cache>/runs/<pid>-<time>/`:
//! 1. write `params` and `cmd.sh` ([`crate::script`]);
//! 2. start `virtiofsd` sharing the host's root (`-o sandbox=chroot`; the default
//!    namespace sandbox fails here with `pivot_root: Device or resource busy`);
//! 3. start qemu (`-M pc`, KVM if usable else TCG, memfd-backed shared memory for
//!    vhost-user-fs) with the [initramfs](crate::initramfs) and
//!    `ublkd.run=<dir> ublkd.nonce=<random>` on the kernel command line;
//! 4. stream the serial console to stdout while watching for the run's markers
//!    ([`crate::console`]): READY (then `guest-check`), CHECK-FAILED, EXIT.
//!
//! A boot that never reaches READY (qemu exits early, guest setup fails, or no READY
//! within [`READY_TIMEOUT`]) is retried once (on TCG if KVM was auto-selected); its
//! console log stays in the run directory. On timeout, failure or a signal, qemu and
//! virtiofsd are killed; both are also tied to this process with `PR_SET_PDEATHSIG`.
//! The run directory is removed afterwards except for the logs of failed boots; one left
//! behind by a SIGKILLed `ublkd-vm` is removed by the next run, failure logs after a week.
//!
//! With [`RunOptions::systemd`] the guest boots the host's systemd instead, on a writable
//! overlay of the host's root, and the command runs as its `ublkd-vm.service`.
//!
//! The guest covers `/tmp`, `/var/tmp` and `/run` with its own tmpfs, so a command,
//! cwd or `ublkd-vm` binary below those is refused up front.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::cache::{Cache, CacheError};
use crate::console::{ConsoleParser, Event, Marker};
use crate::exit;
use crate::kernel::{Kernel, Series};
use crate::progress;
use crate::script::{self, GuestCommand};

mod accel;
mod tied;

pub use accel::{Accel, cpuinfo_has_virt};
use tied::spawn_tied;

/// qemu 7.2's C virtiofsd (Debian's qemu-system-x86).
pub const VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";
/// The qemu binary, looked up in `PATH`.
pub const QEMU: &str = "qemu-system-x86_64";
/// Kernel command line before the run's own parameters.
pub const KERNEL_APPEND: &str = "console=ttyS0 panic=-1 oops=panic quiet loglevel=4";
/// Kernel parameters for a TCG guest. QEMU 7.2's TCG races cross-modifying code: a
/// static key flipped on one vCPU while another runs the patched function oopses on
/// a stale `int3`. Each sched_clock flip is such a patch: at boot (`sched_clock_init_late`
/// enabling the stable clock) and mid-run (the clocksource watchdog finding TCG's TSC
/// unstable). Seen as "Oops: int3 ... sched_clock_cpu" in 6 of 9 failed boots kept
/// here, one of them 93 s into a bench. Declaring the TSC unstable from the start
/// leaves sched_clock unstable for good, so neither flip happens.
pub const TCG_APPEND: &str = "tsc=unstable";
/// Default whole-run timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(900);
/// Env override of the timeout, in seconds.
pub const ENV_TIMEOUT: &str = "UBLKD_VM_TIMEOUT";
/// Env override of the accelerator (`kvm` or `tcg`).
pub const ENV_ACCEL: &str = "UBLKD_VM_ACCEL";
/// A boot without READY within this long is a failed boot (TCG boots in ~6 s).
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Default guest memory (the tmpfs mounts live in it).
pub const DEFAULT_MEM_MB: u32 = 2048;
/// Default vCPU count (1 vCPU boots slower under TCG).
pub const DEFAULT_CPUS: u32 = 2;
/// Directories the guest covers with its own mounts. (`/tmp` and `/var/tmp` are not
/// here: the guest overlays them, so the host's files stay visible.)
pub const GUEST_HIDDEN_DIRS: &[&str] = &["/run", "/proc", "/sys", "/dev"];
/// The virtiofs tag the guest mounts.
const FS_TAG: &str = "hostfs";
/// How long qemu may take to exit after the guest reported the command's status.
const POWEROFF_GRACE: Duration = Duration::from_secs(10);
/// How long virtiofsd may take to exit after qemu is gone.
const VIRTIOFSD_GRACE: Duration = Duration::from_secs(2);
/// How long the logs of failed runs are kept.
const KEEP_FAILURE_LOGS: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long virtiofsd may take to create its socket.
const SOCKET_WAIT: Duration = Duration::from_secs(10);

/// The signal that interrupted the run (0: none).
static SIGNAL: AtomicUsize = AtomicUsize::new(0);

/// Errors of a VM run.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The cache failed.
    #[error("the run directory could not be set up")]
    Cache(#[from] CacheError),
    /// A path the guest needs is hidden by the guest's own mounts.
    #[error("{0:?} is below {1}, which the guest covers with its own mount; use a path elsewhere")]
    HiddenInGuest(PathBuf, &'static str),
    /// The accelerator override is invalid.
    #[error("{ENV_ACCEL}={0:?} is invalid: expected kvm or tcg")]
    BadAccel(String),
    /// A run-directory file could not be written.
    #[error("could not write {0:?}")]
    Write(PathBuf, #[source] io::Error),
    /// virtiofsd or qemu could not be started.
    #[error("could not start {0} (install it with tests/vm/install-host-deps.sh)")]
    Spawn(&'static str, #[source] io::Error),
    /// virtiofsd exited before it created its socket.
    #[error("virtiofsd exited ({0}) before creating its socket; its log is {1:?}")]
    VirtiofsdExited(ExitStatus, PathBuf),
    /// virtiofsd did not create its socket in time.
    #[error("virtiofsd did not create its socket within {secs} s; its log is {0:?}", secs = SOCKET_WAIT.as_secs())]
    VirtiofsdNoSocket(PathBuf),
    /// Signal handlers could not be installed.
    #[error("could not install the signal handlers")]
    Signals(#[source] io::Error),
    /// The guest never became ready, in every boot.
    #[error("the guest never became ready in {0} boots; console logs are kept in {1:?}")]
    NotReady(u32, PathBuf),
    /// The run exceeded its timeout.
    #[error(
        "timed out after {0} s; qemu and virtiofsd were killed; the console log is kept in {1:?}"
    )]
    Timeout(u64, PathBuf),
    /// The guest died after READY without an exit status.
    #[error(
        "the guest died without reporting the command's exit status{0}; the console log is kept in {1:?}"
    )]
    GuestDied(&'static str, PathBuf),
    /// The guest kernel lacks a feature its series must have (`UBLK_F_BATCH_IO` on 7.x);
    /// the guest's console names it.
    #[error(
        "kernel {0}'s ublk lacks a feature the --kernel {1} VM needs (see the guest-check line above)"
    )]
    MissingFeature(String, Series),
    /// `guest-check` failed otherwise.
    #[error(
        "the guest's ublk feature check (ublkd-vm guest-check) exited {0} on kernel {1}; see the console output above"
    )]
    CheckFailed(u8, String),
    /// A signal interrupted the run.
    #[error("interrupted by signal {0}; qemu and virtiofsd were killed")]
    Interrupted(i32),
}

impl VmError {
    /// The process exit code for this failure ([`crate::exit`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::NotReady(..) => exit::BOOT_FAILED,
            Self::Timeout(..) => exit::TIMEOUT,
            Self::GuestDied(..) => exit::GUEST_DIED,
            Self::MissingFeature(..) | Self::CheckFailed(..) => exit::FEATURE_MISSING,
            Self::Interrupted(sig) => 128u8.saturating_add(*sig as u8),
            _ => exit::SETUP_FAILED,
        }
    }
}

/// What to run and how.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The command (host paths; the guest sees the host's root).
    pub argv: Vec<OsString>,
    /// The guest command's working directory.
    pub cwd: PathBuf,
    /// The forwarded environment ([`script::forwarded_env`]).
    pub env: Vec<(String, OsString)>,
    /// Whole-run timeout, both boots included.
    pub timeout: Duration,
    /// Guest memory.
    pub mem_mb: u32,
    /// vCPUs.
    pub cpus: u32,
    /// Forced accelerator, or `None` to [detect](Accel::detect).
    pub accel: Option<Accel>,
    /// The `ublkd-vm` binary the guest runs `guest-check` with.
    pub check_bin: PathBuf,
    /// The series of the kernel booted, for `guest-check --kernel`.
    pub series: Series,
    /// Boot the host's systemd as PID 1 on a writable overlay of the host's root and
    /// run the command as a service of it (see [`crate::initramfs::INIT_SCRIPT`]).
    pub systemd: bool,
}

/// The guest directory `path` is hidden by, if any.
pub fn hidden_in_guest(path: &Path) -> Option<&'static str> {
    GUEST_HIDDEN_DIRS.iter().copied().find(|dir| path.starts_with(dir) && path != Path::new(dir))
}

/// Runs `opts.argv` in a VM booting `kernel` with `initrd`; returns its exit status.
pub fn run(
    cache: &Cache,
    kernel: &Kernel,
    initrd: &Path,
    opts: &RunOptions,
) -> Result<u8, VmError> {
    let program = opts.argv.first().map(PathBuf::from).unwrap_or_default();
    for path in [&opts.check_bin, &opts.cwd, &program] {
        if let Some(dir) = hidden_in_guest(path) {
            return Err(VmError::HiddenInGuest(path.clone(), dir));
        }
    }
    for sig in
        [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP]
    {
        signal_hook::flag::register_usize(sig, &SIGNAL, sig as usize).map_err(VmError::Signals)?;
    }

    let mut run_dir = RunDir::create(cache)?;
    let mut env = opts.env.clone();
    script::set_var(&mut env, script::KERNEL_DIR_VAR, &kernel.dir.to_string_lossy());
    let cmd = GuestCommand { argv: opts.argv.clone(), cwd: opts.cwd.clone(), env };
    run_dir.write("params", &script::params_script(&opts.check_bin, opts.series))?;
    run_dir.write("cmd.sh", &script::command_script(&cmd))?;

    let deadline = Instant::now() + opts.timeout;
    let mut accel = opts.accel.unwrap_or_else(Accel::detect);
    // Three, because a TCG boot still races its other boot-time static keys now and
    // then (an oops within the first 3 s, cheap to retry).
    const BOOTS: u32 = 3;
    for attempt in 1..=BOOTS {
        let boot = Boot { kernel, initrd, opts, accel, attempt, deadline };
        match boot.run(&mut run_dir)? {
            BootOutcome::Exited(status) => return Ok(status),
            BootOutcome::NotReady(reason) => {
                progress!(
                    "boot {attempt} failed: {reason}; its console log is kept in {}",
                    run_dir.path.join(format!("attempt-{attempt}.console.log")).display()
                );
                if attempt < BOOTS {
                    if accel == Accel::Kvm && opts.accel.is_none() {
                        accel = Accel::Tcg;
                    }
                    progress!("retrying the boot ({})", accel.name());
                }
            }
        }
    }
    Err(VmError::NotReady(BOOTS, run_dir.path.clone()))
}

/// The per-run directory; on drop, everything but the kept logs is removed.
#[derive(Debug)]
struct RunDir {
    path: PathBuf,
    keep: Vec<PathBuf>,
}

impl RunDir {
    fn create(cache: &Cache) -> Result<Self, VmError> {
        let runs = cache.runs();
        cache.create_dir(&runs)?;
        Self::sweep_stale(&runs);
        let nanos =
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
        let path = runs.join(format!("{}-{nanos:x}", std::process::id()));
        fs::create_dir(&path).map_err(|e| CacheError::CreateDir(path.clone(), e))?;
        Ok(Self { path, keep: Vec::new() })
    }

    /// Removes the run directories of `ublkd-vm` processes that died without cleaning
    /// up (SIGKILL): their `cmd.sh` is still there and their pid is gone. Directories
    /// that hold only kept failure logs have no `cmd.sh` and stay for
    /// [`KEEP_FAILURE_LOGS`].
    fn sweep_stale(runs: &Path) {
        let Ok(entries) = fs::read_dir(runs) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
            else {
                continue;
            };
            let alive = Path::new("/proc").join(pid.to_string()).exists();
            let expired = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > KEEP_FAILURE_LOGS);
            if !alive && (expired || entry.path().join("cmd.sh").exists()) {
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    }

    fn write(&self, name: &str, data: &[u8]) -> Result<(), VmError> {
        let path = self.path.join(name);
        fs::write(&path, data).map_err(|e| VmError::Write(path, e))
    }

    fn keep(&mut self, path: PathBuf) {
        self.keep.push(path);
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if self.keep.is_empty() {
            let _ = fs::remove_dir_all(&self.path);
            return;
        }
        if let Ok(entries) = fs::read_dir(&self.path) {
            for entry in entries.flatten() {
                if !self.keep.contains(&entry.path()) {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
    }
}

fn random_nonce() -> String {
    let mut bytes = [0u8; 8];
    let filled = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if filled.is_err() {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default();
        bytes = (nanos ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Escapes a value for a qemu `-object`/`-chardev` option list.
fn qemu_opt(value: &Path) -> String {
    value.to_string_lossy().replace(',', ",,")
}

/// Why the console loop stopped.
enum Stop {
    /// qemu closed the console (normally: the guest powered off).
    ConsoleEnded,
    /// Timeout or signal.
    Failed(VmError),
    /// No READY within [`READY_TIMEOUT`].
    NoReady,
}

enum BootOutcome {
    Exited(u8),
    NotReady(String),
}

/// One boot attempt.
struct Boot<'a> {
    kernel: &'a Kernel,
    initrd: &'a Path,
    opts: &'a RunOptions,
    accel: Accel,
    attempt: u32,
    deadline: Instant,
}

/// What the console said so far.
#[derive(Default)]
struct Seen {
    ready: Option<String>,
    setup_failed: Option<String>,
    check_failed: Option<u8>,
    exit: Option<(u8, Instant)>,
    panic: bool,
}

impl Boot<'_> {
    fn run(&self, run_dir: &mut RunDir) -> Result<BootOutcome, VmError> {
        let n = self.attempt;
        let sock = run_dir.path.join(format!("vfs-{n}.sock"));
        let vfs_log = run_dir.path.join(format!("attempt-{n}.virtiofsd.log"));
        let console_log = run_dir.path.join(format!("attempt-{n}.console.log"));

        let vfs_log_file =
            File::create(&vfs_log).map_err(|e| VmError::Write(vfs_log.clone(), e))?;
        // cache=always: the guest keeps a file's page cache across opens. With
        // cache=auto every open drops it, so exec'ing a worker unmapped the code of
        // the workers already running from the same binary, and they faulted it back
        // in through virtiofs: 0.7-1.0 s of stalled I/O at each standby's start, an
        // artefact no host with its binaries on a local disk has. The share is
        // read-only to the guest and the host changes nothing under it during a run.
        let mut virtiofsd = spawn_tied(
            Command::new(VIRTIOFSD)
                .arg(format!("--socket-path={}", sock.display()))
                .args(["-o", "source=/", "-o", "sandbox=chroot", "-o", "cache=always"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(vfs_log_file),
            "virtiofsd",
        )?;
        let socket_wait = Instant::now() + SOCKET_WAIT;
        while !sock.exists() {
            if let Ok(Some(status)) = virtiofsd.0.try_wait() {
                run_dir.keep(vfs_log.clone());
                return Err(VmError::VirtiofsdExited(status, vfs_log));
            }
            if Instant::now() > socket_wait {
                run_dir.keep(vfs_log.clone());
                return Err(VmError::VirtiofsdNoSocket(vfs_log));
            }
            thread::sleep(Duration::from_millis(10));
        }

        let nonce = random_nonce();
        let mem = self.opts.mem_mb;
        let mut qemu_cmd = Command::new(QEMU);
        qemu_cmd.args(["-M", "pc", "-accel", self.accel.name()]);
        if self.accel == Accel::Kvm {
            qemu_cmd.args(["-cpu", "host"]);
        }
        qemu_cmd
            .args(["-smp", &self.opts.cpus.to_string(), "-m", &mem.to_string()])
            .args(["-nodefaults", "-no-user-config", "-display", "none"])
            .args(["-serial", "stdio", "-no-reboot"])
            .arg("-object")
            .arg(format!("memory-backend-memfd,id=mem,size={mem}M,share=on"))
            .args(["-numa", "node,memdev=mem"])
            .arg("-chardev")
            .arg(format!("socket,id=vfs,path={}", qemu_opt(&sock)))
            .arg("-device")
            .arg(format!("vhost-user-fs-pci,chardev=vfs,tag={FS_TAG}"))
            .arg("-kernel")
            .arg(self.kernel.vmlinuz())
            .arg("-initrd")
            .arg(self.initrd)
            .arg("-append")
            .arg(format!(
                "{KERNEL_APPEND}{} ublkd.run={} ublkd.nonce={nonce}{}",
                if self.accel == Accel::Tcg { format!(" {TCG_APPEND}") } else { String::new() },
                run_dir.path.display(),
                if self.opts.systemd { " ublkd.systemd=1" } else { "" }
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        progress!(
            "booting {} ({}, {} vCPU, {mem} MB{})",
            self.kernel.abi,
            self.accel.name(),
            self.opts.cpus,
            if self.opts.systemd { ", systemd as PID 1" } else { "" }
        );
        let started = Instant::now();
        let mut qemu = spawn_tied(&mut qemu_cmd, "qemu-system-x86_64")?;
        let console = qemu.0.stdout.take().expect("stdout is piped");
        let log_file =
            File::create(&console_log).map_err(|e| VmError::Write(console_log.clone(), e))?;
        let (tx, rx) = mpsc::channel();
        let reader = thread::spawn(move || read_console(console, log_file, &nonce, &tx));

        let ready_deadline = (started + READY_TIMEOUT).min(self.deadline);
        let mut seen = Seen::default();
        let mut stdout = io::stdout();
        let stop = loop {
            let signal = SIGNAL.load(Ordering::SeqCst);
            if signal != 0 {
                break Stop::Failed(VmError::Interrupted(signal as i32));
            }
            let now = Instant::now();
            if now >= self.deadline {
                break Stop::Failed(VmError::Timeout(
                    self.opts.timeout.as_secs(),
                    console_log.clone(),
                ));
            }
            if seen.ready.is_none() && now >= ready_deadline {
                break Stop::NoReady;
            }
            if let Some((_, at)) = seen.exit
                && now >= at + POWEROFF_GRACE
            {
                let _ = qemu.0.kill(); // the console then ends
            }
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Event::Output(line)) => {
                    seen.panic |= line.windows(12).any(|w| w == b"Kernel panic");
                    // The kernel's own last words after the command's status are noise.
                    if seen.exit.is_some() && line.ends_with(b"reboot: Power down\n") {
                        continue;
                    }
                    let _ = stdout.write_all(&line).and_then(|()| stdout.flush());
                }
                Ok(Event::Marker(marker)) => {
                    let secs = started.elapsed().as_secs_f64();
                    match marker {
                        Marker::Ready(release) => {
                            progress!("guest ready after {secs:.1} s (uname -r: {release})");
                            seen.ready = Some(release);
                        }
                        Marker::SetupFailed(step) => seen.setup_failed = Some(step),
                        Marker::CheckFailed(status) => seen.check_failed = Some(status),
                        Marker::Exit(status) => {
                            progress!("guest exited {status} after {secs:.1} s");
                            seen.exit = Some((status, Instant::now()));
                        }
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break Stop::ConsoleEnded,
            }
        };

        // After the console ended qemu is exiting anyway; otherwise kill both now.
        let (qemu_grace, vfs_grace) = match stop {
            Stop::ConsoleEnded => (POWEROFF_GRACE, VIRTIOFSD_GRACE),
            Stop::Failed(_) | Stop::NoReady => (Duration::ZERO, Duration::ZERO),
        };
        let qemu_status = qemu.stop(qemu_grace);
        virtiofsd.stop(vfs_grace);
        let _ = reader.join();

        match stop {
            Stop::Failed(err) => {
                run_dir.keep(console_log);
                return Err(err);
            }
            Stop::NoReady => {
                run_dir.keep(console_log);
                run_dir.keep(vfs_log);
                return Ok(BootOutcome::NotReady(format!(
                    "no READY within {} s",
                    READY_TIMEOUT.as_secs()
                )));
            }
            Stop::ConsoleEnded => {}
        }
        if let Some((status, _)) = seen.exit {
            return Ok(BootOutcome::Exited(status));
        }
        let release = seen.ready.clone();
        let Some(release) = release else {
            run_dir.keep(console_log);
            run_dir.keep(vfs_log);
            let reason = match (seen.setup_failed, qemu_status) {
                (Some(step), _) => format!("guest setup failed: {step}"),
                (None, Some(status)) => {
                    format!("qemu exited ({status}) before the guest was ready")
                }
                (None, None) => "the console ended before the guest was ready".to_owned(),
            };
            return Ok(BootOutcome::NotReady(reason));
        };
        run_dir.keep(console_log.clone());
        Err(match seen.check_failed {
            Some(exit::GUEST_CHECK_MISSING_FEATURE) => {
                VmError::MissingFeature(release, self.opts.series)
            }
            Some(status) => VmError::CheckFailed(status, release),
            None if seen.panic => VmError::GuestDied(" (the kernel panicked)", console_log),
            None => VmError::GuestDied("", console_log),
        })
    }
}

/// Reader thread: console bytes → log file + events, until qemu closes its stdout.
fn read_console(mut console: impl Read, log: File, nonce: &str, tx: &mpsc::Sender<Event>) {
    let mut log = io::BufWriter::new(log);
    let mut parser = ConsoleParser::new(nonce);
    let mut buf = [0u8; 8192];
    loop {
        let n = match console.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let _ = log.write_all(&buf[..n]).and_then(|()| log.flush());
        for event in parser.feed(&buf[..n]) {
            if tx.send(event).is_err() {
                return;
            }
        }
    }
    for event in parser.finish() {
        let _ = tx.send(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virt_flags_are_found_only_in_flags_lines() {
        assert!(cpuinfo_has_virt("processor : 0\nflags\t\t: fpu vme vmx sse\n"));
        assert!(cpuinfo_has_virt("flags : fpu svm\n"));
        assert!(!cpuinfo_has_virt("flags : fpu vmxx sse\nmodel name : svm\n"));
    }

    #[test]
    fn paths_below_guest_mounts_are_hidden_but_the_mount_points_are_not() {
        // /tmp is overlaid in the guest, not covered: a checkout there stays visible.
        assert_eq!(hidden_in_guest(Path::new("/tmp/x/test")), None);
        assert_eq!(hidden_in_guest(Path::new("/run/user/0/bin")), Some("/run"));
        assert_eq!(hidden_in_guest(Path::new("/run")), None);
        assert_eq!(hidden_in_guest(Path::new("/tmpfoo/bin")), None);
        assert_eq!(hidden_in_guest(Path::new("/work/main/target/debug/ublkd-vm")), None);
        assert_eq!(hidden_in_guest(Path::new("uname")), None);
    }

    #[test]
    fn qemu_option_values_escape_commas() {
        assert_eq!(qemu_opt(Path::new("/a,b/s.sock")), "/a,,b/s.sock");
    }

    #[test]
    fn exit_codes_map_failures() {
        assert_eq!(VmError::Timeout(5, "x".into()).exit_code(), exit::TIMEOUT);
        assert_eq!(VmError::NotReady(2, "x".into()).exit_code(), exit::BOOT_FAILED);
        assert_eq!(
            VmError::MissingFeature("6.12.117".into(), Series::Newest).exit_code(),
            exit::FEATURE_MISSING
        );
        assert_eq!(VmError::GuestDied("", "x".into()).exit_code(), exit::GUEST_DIED);
        assert_eq!(VmError::Interrupted(15).exit_code(), 143);
        assert_eq!(VmError::BadAccel("x".into()).exit_code(), exit::SETUP_FAILED);
    }
}
