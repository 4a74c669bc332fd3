//! Plumbing for the system tests that drive the real binaries inside the test VM: a
//! `ublkd` per test with its own socket, `ublkctl`, fio, and what the kernel and `/proc`
//! say is left behind. Every helper panics with the output of the command that failed.

// Each test binary uses a different part of these helpers.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use ublkd_proto::ctrl::CtrlClient;

/// How long `ublkd` may take to exit after SIGTERM, or to delete its devices and exit
/// after `ublkctl shutdown`.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// The system tests check machine-wide state (every ublk device, every worker
/// process): each holds this for its whole run, so a test binary's tests run one at a
/// time even without `--test-threads=1`.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The kernel's ublk feature mask (GET_FEATURES): what a test that depends on a
/// feature asks before it decides what to assert (a refusal where it is missing).
#[allow(dead_code)]
pub fn kernel_features() -> u64 {
    CtrlClient::open()
        .and_then(|c| c.get_features())
        .expect("GET_FEATURES must work: run these tests in the test VM")
}

/// Whether the kernel has `UBLK_F_BATCH_IO` (Linux >= 7.0), so ublkd serves its
/// devices with the batched data path and offers zero copy.
#[allow(dead_code)]
pub fn kernel_has_batch_io() -> bool {
    kernel_features() & ublkd_proto::uapi::UBLK_F_BATCH_IO != 0
}

/// A workspace binary: they sit two levels above this test binary (target/debug/deps).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(path.is_file(), "{} is missing: build the workspace first", path.display());
    path
}

/// Runs `cmd`, returning its output; panics only if it cannot be started.
pub fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs `cmd` for at most `limit`; past that it is SIGKILLed and the error says so,
/// with what it printed by then. For tests that must report a hang, not become one.
pub fn run_within(cmd: &mut Command, limit: Duration) -> Result<Output, String> {
    use std::io::Read;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let pid = child.id();
    let status = wait_exit(child, limit);
    let out = Output {
        status: status.unwrap_or_else(|| std::os::unix::process::ExitStatusExt::from_raw(9)),
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    };
    match status {
        Some(_) => Ok(out),
        None => Err(format!("{cmd:?} (pid {pid}) hung for {limit:?}:\n{}", describe(&out))),
    }
}

/// Runs `cmd` and asserts it exits 0; returns its stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{}", out.status, describe(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// Asserts that `what` (a command line) succeeded; a failure shows its output and then
/// `log`, a daemon's log or the journal, headed by `log_name`.
pub fn assert_succeeded(out: &Output, what: &str, log_name: &str, log: impl FnOnce() -> String) {
    if !out.status.success() {
        panic!("{what} failed ({}):\n{}\n--- {log_name}\n{}", out.status, describe(out), log());
    }
}

/// A command's stdout and stderr, for failure messages.
pub fn describe(out: &Output) -> String {
    format!(
        "--- stdout\n{}--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `ublkctl --socket S …` for one daemon. Cloneable and panic-free, so that killer and
/// fio threads can use it; [`Ublkd`] adds the asserting variants.
#[derive(Debug, Clone)]
pub struct Ctl {
    pub socket: PathBuf,
}

impl Ctl {
    /// `ublkctl --socket <ours> ARGS…`, whatever its outcome.
    pub fn run(&self, args: &[&str]) -> Output {
        run(Command::new(bin("ublkctl")).arg("--socket").arg(&self.socket).args(args))
    }

    /// `ublkctl ARGS…` for at most `limit` (see `run_within`).
    pub fn run_within(&self, args: &[&str], limit: Duration) -> Result<Output, String> {
        run_within(Command::new(bin("ublkctl")).arg("--socket").arg(&self.socket).args(args), limit)
    }

    /// `ublkctl status --json`: the `devices` array.
    pub fn status(&self) -> Result<Vec<serde_json::Value>, String> {
        let out = self.run(&["status", "--json"]);
        if !out.status.success() {
            return Err(format!(
                "ublkctl status --json failed ({}):\n{}",
                out.status,
                describe(&out)
            ));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("`ublkctl status --json` is not JSON ({e}): {text}"))?;
        json["devices"].as_array().cloned().ok_or_else(|| format!("no devices array in {text}"))
    }

    /// One device's entry in `ublkctl status --json`.
    pub fn device(&self, id: u32) -> Result<serde_json::Value, String> {
        find_device(&self.status()?, id)
    }
}

/// Device `id`'s entry in a `ublkctl status --json` device list.
pub fn find_device(devs: &[serde_json::Value], id: u32) -> Result<serde_json::Value, String> {
    devs.iter()
        .find(|d| d["id"] == id)
        .cloned()
        .ok_or_else(|| format!("device {id} is not in `ublkctl status --json`"))
}

/// A running `ublkd` with its own config, socket and state dir under `/run`.
///
/// [`Ublkd::stop`] is the normal end: `ublkctl shutdown`, exit 0, and nothing left
/// behind. If a test fails first, `Drop` stops it anyway (SIGTERM, then SIGKILL) and
/// deletes any ublk device still in the kernel (SIGTERM leaves them), so the next test
/// starts clean; it also prints ublkd's log.
#[derive(Debug)]
pub struct Ublkd {
    child: Option<Child>,
    pub ctl: Ctl,
    run_dir: PathBuf,
    log: PathBuf,
    config: PathBuf,
    /// ublkd's extra environment, for a restart.
    env: Vec<(String, String)>,
    /// What ublkd's command line runs under (see [`Ublkd::start_wrapped`]).
    wrapper: Vec<String>,
}

impl Ublkd {
    /// Starts `ublkd --config` with `name`'s socket, and waits until it answers.
    pub fn start(name: &str) -> Ublkd {
        Self::start_with(name, "", &[])
    }

    /// Like [`Ublkd::start`], with `extra` TOML appended to the `[daemon]` table (and
    /// any tables after it) and `env` set for ublkd (and so its workers).
    pub fn start_with(name: &str, extra: &str, env: &[(&str, &str)]) -> Ublkd {
        Self::start_wrapped(name, extra, env, &[])
    }

    /// Like [`Ublkd::start_with`], with ublkd's command line after `wrapper` (a
    /// program that ends by exec'ing its arguments, so ublkd keeps its pid), e.g. to
    /// run it inside a chroot.
    pub fn start_wrapped(name: &str, extra: &str, env: &[(&str, &str)], wrapper: &[&str]) -> Ublkd {
        let run_dir = PathBuf::from(format!("/run/ublkd-test-{name}"));
        let _ = std::fs::remove_dir_all(&run_dir);
        let socket = run_dir.join("ublkd.sock");
        let config = PathBuf::from(format!("/tmp/ublkd-test-{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[daemon]\nsocket = \"{}\"\nstate_dir = \"{}\"\n{extra}\n",
                socket.display(),
                run_dir.join("state").display()
            ),
        )
        .unwrap();
        let log = PathBuf::from(format!("/tmp/ublkd-test-{name}.log"));
        File::create(&log).unwrap();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let wrapper = wrapper.iter().map(|a| a.to_string()).collect();
        let mut daemon =
            Ublkd { child: None, ctl: Ctl { socket }, run_dir, log, config, env, wrapper };
        daemon.spawn();
        daemon
    }

    /// Starts ublkd on this config, its log going on after what is there, and waits
    /// until it answers a request: it is then in its loop, signal handlers set.
    fn spawn(&mut self) {
        let log_file = OpenOptions::new().append(true).open(&self.log).unwrap();
        let ublkd = bin("ublkd");
        let mut cmd = match self.wrapper.split_first() {
            None => Command::new(&ublkd),
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&ublkd);
                cmd
            }
        };
        let child = cmd
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("cannot start ublkd");
        self.child = Some(child);
        // A wrapper gets as long again (the chroot one starts a process per bind mount,
        // slow under emulation on a loaded host).
        let limit = Duration::from_secs(if self.wrapper.is_empty() { 30 } else { 60 });
        let deadline = Instant::now() + limit;
        // Connecting first (cheap) keeps this loop from exec'ing ublkctl every 20 ms
        // while ublkd starts: under the VM's emulation that alone takes a CPU from the
        // devices' workers, and a restart's I/O latency is measured meanwhile.
        while std::os::unix::net::UnixStream::connect(&self.ctl.socket).is_err()
            || !self.ctl(&["status"]).status.success()
        {
            if let Some(status) = self.child().try_wait().unwrap() {
                panic!("ublkd exited at start ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "ublkd did not listen within {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs ublkd and reaps it (its serving workers serve on, for the next ublkd to
    /// take over).
    pub fn sigkill(&mut self) {
        let mut child = self.child.take().expect("ublkd is not running");
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), None, "ublkd exited by itself ({status}) before SIGKILL");
    }

    /// Replaces what follows the `[daemon]` table's socket and state dir in ublkd's
    /// config (the `extra` of [`Self::start_with`]), then has ublkd reload it (SIGHUP)
    /// and waits for the reload's outcome line in the log, which it returns.
    pub fn reload_with(&self, extra: &str) -> String {
        let config = std::fs::read_to_string(&self.config).unwrap();
        let header: String = config.lines().take(3).map(|l| format!("{l}\n")).collect();
        std::fs::write(&self.config, format!("{header}{extra}\n")).unwrap();
        // The outcome's line, not a device's error logged on the way.
        let is_outcome = |l: &&str| {
            ["reloaded: ", "reload rejected", "reload: ublkd runs"].iter().any(|o| l.contains(o))
        };
        let outcomes = |log: &str| log.lines().filter(is_outcome).count();
        let before = outcomes(&self.log());
        assert!(signal(self.pid(), libc::SIGHUP), "SIGHUP to ublkd");
        self.wait_until("the reload's outcome", || outcomes(&self.log()) > before);
        self.log().lines().filter(is_outcome).nth(before).unwrap().to_string()
    }

    /// Starts a new ublkd on the same config and state dir (after this one died).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "ublkd is still running");
        self.spawn();
    }

    /// Sends `sig` (SIGTERM or SIGINT) to ublkd and asserts it exits 0 within
    /// [`STOP_TIMEOUT`] leaving every device in the kernel (neither signal deletes one);
    /// then `meanwhile`, then [`Self::restart`].
    pub fn signal_and_restart(&mut self, sig: libc::c_int, meanwhile: impl FnOnce()) {
        let before = kernel_devices();
        let child = self.child.take().expect("ublkd is not running");
        signal(child.id(), sig);
        let status = wait_exit(child, STOP_TIMEOUT);
        let log = self.log();
        match status {
            Some(s) => assert!(s.success(), "ublkd exited with {s} after signal {sig}:\n{log}"),
            None => panic!("ublkd did not exit within {STOP_TIMEOUT:?} of signal {sig}:\n{log}"),
        }
        assert_eq!(kernel_devices(), before, "signal {sig} changed the kernel's devices:\n{log}");
        meanwhile();
        self.restart();
    }

    /// [`Self::sigkill`], then `meanwhile`, then [`Self::restart`].
    pub fn sigkill_and_restart(&mut self, meanwhile: impl FnOnce()) {
        self.sigkill();
        meanwhile();
        self.restart();
    }

    /// Whether this ublkd process is still running.
    pub fn alive(&mut self) -> bool {
        self.child().try_wait().unwrap().is_none()
    }

    fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("ublkd was already stopped")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("ublkd was already stopped").id()
    }

    /// What ublkd wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to 60 s for `done`, failing with `what` and ublkd's log.
    pub fn wait_until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\n--- ublkd log\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `ublkctl --socket <ours> ARGS…`, whatever its outcome.
    pub fn ctl(&self, args: &[&str]) -> Output {
        self.ctl.run(args)
    }

    /// `ublkctl ARGS…`, which must succeed; returns its stdout.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert_succeeded(&out, &format!("ublkctl {}", args.join(" ")), "ublkd log", || self.log());
        String::from_utf8(out.stdout).unwrap()
    }

    /// `ublkctl add ARGS…`: the new device's id, once its block device node exists.
    pub fn add(&self, args: &[&str]) -> u32 {
        let mut full = vec!["add"];
        full.extend_from_slice(args);
        let out = self.ctl_ok(&full);
        let id: u32 =
            out.trim().parse().unwrap_or_else(|e| panic!("`ublkctl add` printed {out:?}: {e}"));
        wait_for_path(&block_dev(id));
        id
    }

    /// `ublkctl del -n ID`, which must succeed.
    pub fn del(&self, id: u32) {
        self.ctl_ok(&["del", "-n", &id.to_string()]);
    }

    /// `ublkctl status --json`: the `devices` array.
    pub fn status(&self) -> Vec<serde_json::Value> {
        self.ctl.status().unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", self.log()))
    }

    /// One device's entry in `ublkctl status --json`.
    pub fn status_of(&self, id: u32) -> serde_json::Value {
        self.ctl.device(id).unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", self.log()))
    }

    /// The stall of the recovery from worker `pid`'s kill, as ublkd logged it.
    pub fn stall_after_kill(&self, pid: u32) -> u64 {
        let log = self.log();
        let line = log
            .lines()
            .find(|l| l.contains(&format!("device recovered (worker {pid} killed")))
            .unwrap_or_else(|| panic!("no recovery from killing worker {pid}:\n{log}"));
        let at = line.find("stall_ms=").expect("a stall") + "stall_ms=".len();
        line[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
    }

    /// The worker pid `ublkctl status --json` reports for `id`.
    pub fn worker_pid(&self, id: u32) -> u32 {
        let dev = self.status_of(id);
        dev["worker_pid"].as_u64().unwrap_or_else(|| panic!("device {id} has no worker: {dev}"))
            as u32
    }

    /// SIGTERM, then waits for the exit (at most [`STOP_TIMEOUT`]).
    fn terminate(&mut self) -> Option<ExitStatus> {
        terminate(self.child.take()?, STOP_TIMEOUT)
    }

    /// Stops ublkd with `ublkctl shutdown` and asserts it exits 0 leaving no device, no
    /// device node, no worker process and no ublkd process behind. Returns ublkd's log.
    pub fn stop(mut self) -> String {
        let pid = self.pid();
        let out = self.ctl(&["shutdown"]);
        assert!(out.status.success(), "ublkctl shutdown: {}\n{}", describe(&out), self.log());
        let status = wait_exit(self.child.take().expect("ublkd is running"), STOP_TIMEOUT);
        let log = self.log();
        match status {
            Some(s) => assert!(s.success(), "ublkd exited with {s} after shutdown:\n{log}"),
            None => panic!("ublkd did not exit within {STOP_TIMEOUT:?} of shutdown:\n{log}"),
        }
        assert!(!pid_exists(pid), "ublkd (pid {pid}) is still there after it exited");
        assert_eq!(ublk_nodes(), BTreeSet::new(), "device nodes left after ublkd exited:\n{log}");
        assert_eq!(kernel_devices(), BTreeSet::new(), "ublk devices left in the kernel:\n{log}");
        assert_eq!(worker_pids(), Vec::<u32>::new(), "ublkd-worker processes left:\n{log}");
        assert!(!self.ctl.socket.exists(), "ublkd left its socket {}", self.ctl.socket.display());
        log
    }
}

impl Drop for Ublkd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- ublkd log ({})\n{}--- end of ublkd log", self.log.display(), self.log());
        }
        for pid in FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            signal(*pid, libc::SIGKILL);
        }
        if self.child.is_some() && self.terminate().is_none() {
            eprintln!("ublkd did not stop on SIGTERM; killed it");
        }
        // Serving workers outlive ublkd (for the next one to take over): killed here.
        for pid in worker_pids() {
            signal(pid, libc::SIGKILL);
        }
        // A ublkd that was killed leaves its devices in the kernel: delete them, so a
        // failing test does not fail the ones after it.
        if !kernel_devices().is_empty()
            && let Ok(ctrl) = CtrlClient::open()
        {
            for id in kernel_devices() {
                let _ = ctrl.stop_dev(id);
                let _ = ctrl.del_dev(id);
            }
        }
        let _ = std::fs::remove_file(&self.config);
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

/// The worker built with the test-only `test-hooks` feature (attacks on its own
/// sandbox, hostile behaviour towards ublkd; see worker/src/attack.rs).
pub fn hooked_worker() -> PathBuf {
    // target/debug/deps/<test>-… → target/test-hooks/debug/ublkd-worker
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().unwrap().parent().unwrap().parent().unwrap();
    let worker = target.join("test-hooks/debug/ublkd-worker");
    assert!(
        worker.is_file(),
        "{} is missing: build it with `cargo build -p ublkd-worker --features test-hooks \
         --target-dir target/test-hooks` (run-tests does)",
        worker.display()
    );
    worker
}

/// A cgroup whose `io.max` limits writes to one block device to `wbps` bytes a second
/// (1: stopped): a process moved into it has its writes queued in blk-throttle, as a
/// slow disk, a failing path or a busy cgroup would, until [`Self::release`].
pub struct WriteThrottle {
    dir: PathBuf,
    dev: String,
}

impl WriteThrottle {
    pub fn new(name: &str, backing: &Path, wbps: u64) -> WriteThrottle {
        let root = Path::new("/sys/fs/cgroup");
        if !root.join("cgroup.controllers").exists() {
            run_ok(Command::new("mount").args(["-t", "cgroup2", "none"]).arg(root));
        }
        std::fs::write(root.join("cgroup.subtree_control"), "+io")
            .expect("enable the io controller");
        let dir = root.join(name);
        let _ = std::fs::create_dir(&dir);
        let sysfs =
            format!("/sys/class/block/{}/dev", backing.file_name().unwrap().to_str().unwrap());
        let dev = std::fs::read_to_string(&sysfs).unwrap().trim().to_string();
        std::fs::write(dir.join("io.max"), format!("{dev} wbps={wbps}")).expect("set io.max");
        WriteThrottle { dir, dev }
    }

    /// Moves process `pid` (all its threads) into the cgroup.
    pub fn hold(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).expect("move into cgroup");
    }

    /// Lifts the limit.
    pub fn release(&self) {
        std::fs::write(self.dir.join("io.max"), format!("{} wbps=max", self.dev)).unwrap();
    }

    /// Bytes written to the device by the cgroup's processes that blk-throttle let go.
    pub fn written(&self) -> u64 {
        let stat = std::fs::read_to_string(self.dir.join("io.stat")).unwrap_or_default();
        stat.lines()
            .filter(|l| l.starts_with(&format!("{} ", self.dev)))
            .flat_map(|l| l.split_whitespace())
            .find_map(|kv| kv.strip_prefix("wbytes=")?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for WriteThrottle {
    fn drop(&mut self) {
        // The device may be gone by now; then so is its limit.
        let _ = std::fs::write(self.dir.join("io.max"), format!("{} wbps=max", self.dev));
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `/dev/ublkbN`.
pub fn block_dev(id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/ublkb{id}"))
}

/// Waits (at most 10 s) for `path` to appear: devtmpfs creates nodes asynchronously.
pub fn wait_for_path(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} did not appear within 10 s", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The `/dev/ublkb*` and `/dev/ublkc*` nodes there are now.
pub fn ublk_nodes() -> BTreeSet<String> {
    std::fs::read_dir("/dev")
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.starts_with("ublkb") || n.starts_with("ublkc"))
        .collect()
}

/// The ids of the ublk devices the kernel has now.
pub fn kernel_devices() -> BTreeSet<u32> {
    std::fs::read_dir("/sys/class/ublk-char")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Sends SIGTERM to `child` and waits up to `timeout` for its exit status; past that,
/// SIGKILL and `None`.
pub fn terminate(child: Child, timeout: Duration) -> Option<ExitStatus> {
    signal(child.id(), libc::SIGTERM);
    wait_exit(child, timeout)
}

/// Waits up to `timeout` for `child`'s exit status; past that, SIGKILLs and reaps it
/// and returns `None`.
pub fn wait_exit(mut child: Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Sends `sig` to `pid`; true if it was delivered to a process that existed.
pub fn signal(pid: u32, sig: libc::c_int) -> bool {
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is a process this test
    // started (ublkd, a worker ublkd reported, or fio).
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}

pub fn pid_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The pids of every process whose name is `ublkd-worker`.
pub fn worker_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim_end() == "ublkd-worker")
        })
        .collect()
}

/// Where process `pid`'s open fds point (`readlink /proc/PID/fd/*`), sorted.
pub fn fd_targets(pid: u32) -> Vec<String> {
    let mut targets: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    targets.sort();
    targets
}

/// The pids of every process that has `path` open.
pub fn holders(path: &Path) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
                fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).any(|t| t == path)
            })
        })
        .collect()
}

/// A sparse file of `size` bytes (a loop device's backing file).
pub fn sparse_file(path: &Path, size: u64) {
    let _ = std::fs::remove_file(path);
    File::create(path).unwrap().set_len(size).unwrap();
}

/// `len` pseudo-random bytes from `seed` (xorshift64*): reproducible, incompressible.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn write_file(path: &Path, data: &[u8]) {
    let mut f = File::create(path).unwrap();
    f.write_all(data).unwrap();
}

/// The sha256 of a file (or a whole block device), by `sha256sum`.
pub fn sha256(path: &Path) -> String {
    let out = run_ok(Command::new("sha256sum").arg(path));
    out.split_whitespace().next().unwrap().to_string()
}

/// A mounted filesystem, unmounted (lazily, if need be) when dropped.
#[derive(Debug)]
pub struct Mount {
    pub dir: PathBuf,
    mounted: bool,
}

impl Mount {
    pub fn new(dev: &Path, dir: &Path) -> Mount {
        std::fs::create_dir_all(dir).unwrap();
        run_ok(Command::new("mount").args(["-t", "ext4"]).arg(dev).arg(dir));
        Mount { dir: dir.to_path_buf(), mounted: true }
    }

    pub fn umount(mut self) {
        run_ok(Command::new("umount").arg(&self.dir));
        self.mounted = false;
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// Pids of the fio processes running now, so that a failing test can end them.
static FIO_PIDS: std::sync::Mutex<BTreeSet<u32>> = std::sync::Mutex::new(BTreeSet::new());

/// Whether a fio process this test started is running now.
pub fn fio_running() -> bool {
    !FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
}

/// One job of a fio run, from `--output-format=json`.
#[derive(Debug, Clone)]
pub struct FioJob {
    pub name: String,
    pub error: i64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub iops: f64,
    /// The longest completion latency of any of its I/Os (reads or writes).
    pub clat_max: Duration,
}

/// A fio process, started with `--output-format=json` in `/tmp` (the guest's cwd is
/// read-only, and fio may save its verify state there).
#[derive(Debug)]
pub struct Fio {
    child: Child,
    args: Vec<String>,
}

impl Fio {
    pub fn spawn(args: Vec<String>) -> Fio {
        let child = Command::new("fio")
            .args(&args)
            .arg("--output-format=json")
            .current_dir("/tmp")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start fio");
        FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).insert(child.id());
        Fio { child, args }
    }

    /// Whether fio is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for fio; its jobs if it exited 0 and every job reported error 0.
    pub fn wait(self) -> Result<Vec<FioJob>, String> {
        self.finish(false)
    }

    /// Ends a time-based fio now (SIGINT: fio stops its jobs and reports them, with a
    /// nonzero exit); its jobs if every job reported error 0.
    pub fn interrupt(self) -> Result<Vec<FioJob>, String> {
        signal(self.child.id(), libc::SIGINT);
        self.finish(true)
    }

    fn finish(self, interrupted: bool) -> Result<Vec<FioJob>, String> {
        let pid = self.child.id();
        let out = self.child.wait_with_output().unwrap();
        FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).remove(&pid);
        let cmd = format!("fio {}", self.args.join(" "));
        if !out.status.success() && !interrupted {
            return Err(format!("{cmd} failed ({}):\n{}", out.status, describe(&out)));
        }
        // fio may print notes before the JSON object.
        let stdout = String::from_utf8_lossy(&out.stdout);
        let json = stdout.find('{').map(|at| &stdout[at..]).ok_or(format!("{cmd}: no JSON"))?;
        let report: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("{cmd}: bad JSON ({e}):\n{stdout}"))?;
        let jobs: Vec<FioJob> = report["jobs"]
            .as_array()
            .ok_or(format!("{cmd}: no jobs in:\n{stdout}"))?
            .iter()
            .map(|j| FioJob {
                name: j["jobname"].as_str().unwrap_or("?").to_string(),
                error: j["error"].as_i64().unwrap_or(-1),
                read_bytes: j["read"]["io_bytes"].as_u64().unwrap_or(0),
                write_bytes: j["write"]["io_bytes"].as_u64().unwrap_or(0),
                iops: j["read"]["iops"].as_f64().unwrap_or(0.0)
                    + j["write"]["iops"].as_f64().unwrap_or(0.0),
                clat_max: Duration::from_nanos(
                    ["read", "write"]
                        .iter()
                        .filter_map(|rw| j[rw]["clat_ns"]["max"].as_u64())
                        .max()
                        .unwrap_or(0),
                ),
            })
            .collect();
        if jobs.is_empty() || jobs.iter().any(|j| j.error != 0) {
            return Err(format!("{cmd}: a job failed: {jobs:?}\n{}", describe(&out)));
        }
        Ok(jobs)
    }

    /// Runs fio to the end; its one job.
    pub fn run(args: Vec<String>) -> Result<FioJob, String> {
        let jobs = Fio::spawn(args).wait()?;
        match <[FioJob; 1]>::try_from(jobs) {
            Ok([job]) => Ok(job),
            Err(jobs) => Err(format!("expected one fio job, got {jobs:?}")),
        }
    }
}

/// Runs fio with `args` to the end, asserting it exits 0 with every job clean; its jobs.
pub fn fio(args: &[String]) -> Vec<FioJob> {
    Fio::spawn(args.to_vec()).wait().unwrap_or_else(|e| panic!("{e}"))
}

/// Asserts every job finished without error and both read and wrote something.
pub fn assert_fio_clean(jobs: &[FioJob], expected_jobs: usize) {
    assert_eq!(jobs.len(), expected_jobs, "fio jobs: {jobs:?}");
    for job in jobs {
        assert_eq!(job.error, 0, "fio job {} failed: {job:?}", job.name);
        assert!(job.read_bytes > 0, "fio job {} read nothing: {job:?}", job.name);
        assert!(job.write_bytes > 0, "fio job {} wrote nothing: {job:?}", job.name);
    }
}

/// fio's arguments for `jobs` jobs of `rw` on `dev` with the I/O shape (4k–128k
/// blocks, depth 32, direct, io_uring), each job on its own `region` bytes, so that
/// jobs never overwrite each other's verified data, and each on its own CPU as far as
/// there are CPUs, so that a device's queues all get I/O.
pub fn fio_args(name: &str, dev: &Path, rw: &str, jobs: u32, region: u64) -> Vec<String> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    [
        format!("--name={name}"),
        format!("--filename={}", dev.display()),
        format!("--rw={rw}"),
        "--bsrange=4k-128k".into(),
        "--iodepth=32".into(),
        format!("--numjobs={jobs}"),
        format!("--size={region}"),
        format!("--offset_increment={region}"),
        "--direct=1".into(),
        "--ioengine=io_uring".into(),
        format!("--cpus_allowed=0-{}", cpus - 1),
        "--cpus_allowed_policy=split".into(),
    ]
    .into()
}

/// [`fio_args`] plus crc32c verification of everything written, fatal on a mismatch.
pub fn fio_verify_args(name: &str, dev: &Path, rw: &str, jobs: u32, region: u64) -> Vec<String> {
    let mut args = fio_args(name, dev, rw, jobs, region);
    args.extend(["--verify=crc32c", "--verify_fatal=1", "--do_verify=1"].map(String::from));
    args
}

/// ublkd asked for every device's status every 100 ms on a thread of its own, each
/// answer checked, for as long as a test's operation goes on: how long ublkd kept a
/// client waiting. Asked on its socket as `ublkctl status` asks (not by running
/// ublkctl, whose start under emulation is the test's cost, not ublkd's).
pub struct StatusProber {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Duration>,
}

impl StatusProber {
    pub fn start(ctl: &Ctl) -> StatusProber {
        use std::sync::atomic::Ordering;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ctl, stop) = (ctl.clone(), std::sync::Arc::clone(&done));
        let thread = std::thread::spawn(move || {
            let mut slowest = Duration::ZERO;
            while !stop.load(Ordering::SeqCst) {
                let asked = Instant::now();
                let answer = ask(&ctl.socket, &ublkd_proto::msg::CtlRequest::Status { id: None });
                assert!(
                    matches!(answer, Ok(ublkd_proto::msg::CtlResponse::Status(_))),
                    "status: {answer:?}"
                );
                slowest = slowest.max(asked.elapsed());
                std::thread::sleep(Duration::from_millis(100));
            }
            slowest
        });
        StatusProber { done, thread }
    }

    /// Stops asking; the longest answer.
    pub fn finish(self) -> Duration {
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.join().expect("the status prober failed")
    }
}

/// One request on ublkd's control socket at `socket`, and its answer.
pub fn ask(
    socket: &Path,
    request: &ublkd_proto::msg::CtlRequest,
) -> Result<ublkd_proto::msg::CtlResponse, String> {
    let mut stream = std::os::unix::net::UnixStream::connect(socket)
        .map_err(|e| format!("connect {}: {e}", socket.display()))?;
    ublkd_proto::msg::write_frame(&mut stream, request).map_err(|e| e.to_string())?;
    ublkd_proto::msg::read_response(&mut stream).map_err(|e| e.to_string())
}
