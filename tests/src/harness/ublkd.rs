//! A `ublkd` per test, with its own config, socket and state dir: starting, reloading,
//! signalling, restarting and stopping it, asserting that it leaves nothing behind, and
//! `ublkctl` (and the control socket itself) against it.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use ublkd_proto::ctrl::CtrlClient;
use ublkd_proto::uapi::{UBLK_F_AUTO_BUF_REG, UBLK_F_BATCH_IO};

use super::fio;
use super::machine::{
    block_dev, kernel_devices, pid_exists, ublk_nodes, wait_for_path, worker_pids,
};
use super::process::{
    assert_succeeded, bin, describe, run, run_within, signal, terminate, wait_exit,
};

/// How long `ublkd` may take to exit after SIGTERM, or to delete its devices and exit
/// after `ublkctl shutdown`.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// `ublkctl --socket S …` for one daemon. Cloneable and panic-free, so that killer and
/// fio threads can use it; [`Ublkd`] adds the asserting variants.
#[derive(Debug, Clone)]
pub struct Ctl {
    /// ublkd's control socket.
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

    /// `ublkctl status --json`: the `devices` array. Asked on the control socket and
    /// rendered with ublkctl's own code, so the JSON is what `ublkctl status --json`
    /// prints, without exec'ing ublkctl at every poll (under emulation that start
    /// costs more than ublkd's answer).
    pub fn status(&self) -> Result<Vec<serde_json::Value>, String> {
        let devs = match ask(&self.socket, &ublkd_proto::msg::CtlRequest::Status { id: None })? {
            ublkd_proto::msg::CtlResponse::Status(devs) => devs,
            other => return Err(format!("ublkd answered status with {other:?}")),
        };
        let text = ublkd_supervisor::render::status_json(&devs);
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
pub(crate) fn find_device(
    devs: &[serde_json::Value],
    id: u32,
) -> Result<serde_json::Value, String> {
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

    /// Waits until device `id` is LIVE with a worker other than `old` and more than
    /// `recoveries` recoveries.
    pub fn wait_replaced(&self, id: u32, old: u32, recoveries: u64) {
        self.wait_until(&format!("device {id} recovered from worker {old}"), || {
            let dev = self.status_of(id);
            dev["state"] == "LIVE"
                && dev["worker_pid"].as_u64().is_some_and(|p| p != u64::from(old))
                && dev["recoveries"].as_u64() > Some(recoveries)
        });
    }

    /// SIGKILLs device `id`'s worker and waits for its recovery; the killed pid.
    pub fn kill_worker(&self, id: u32) -> u32 {
        let dev = self.status_of(id);
        let pid = self.worker_pid(id);
        assert!(signal(pid, libc::SIGKILL), "worker {pid} is gone");
        self.wait_replaced(id, pid, dev["recoveries"].as_u64().unwrap_or(0));
        pid
    }

    /// Waits until device `id` has served `n` more requests (`ios`) than when called:
    /// the event a time-based fio is stopped after, once what it brackets happened.
    pub fn wait_for_ios(&self, id: u32, n: u64) {
        let ios = || self.status_of(id)["ios"].as_u64().unwrap_or(0);
        let from = ios();
        self.wait_until(&format!("{n} more requests on device {id}"), || ios() >= from + n);
    }

    /// ublkd's config file (`--config`), which [`Self::reload_with`] rewrites.
    pub fn config_path(&self) -> &Path {
        &self.config
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

    /// Whether the kernel lacks what zero copy needs (`UBLK_F_AUTO_BUF_REG` and the
    /// batched data path: 6.12), and if so that `ublkctl add ARGS…` (which ask for it)
    /// is refused, naming `reason`, with no device left behind.
    pub fn zero_copy_refused(&self, args: &[&str], reason: &str) -> bool {
        let needed = UBLK_F_AUTO_BUF_REG | UBLK_F_BATCH_IO;
        if super::machine::kernel_features() & needed == needed {
            return false;
        }
        let before = kernel_devices();
        let out = self.ctl(&["add"].iter().chain(args).copied().collect::<Vec<_>>());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--zero-copy was accepted without the kernel's support");
        assert!(stderr.contains(reason), "the refusal does not say why: {stderr}");
        assert_eq!(kernel_devices(), before, "a refused device was left");
        true
    }

    /// The kernel's flags of device `id` (`UBLK_F_*`, from `ublkctl list`).
    pub fn kernel_flags(&self, id: u32) -> u64 {
        let list = self.ctl_ok(&["list", "-n", &id.to_string()]);
        let hex = list
            .split_whitespace()
            .skip_while(|w| *w != "flags")
            .nth(1)
            .unwrap_or_else(|| panic!("no flags in `ublkctl list`: {list}"));
        u64::from_str_radix(hex.trim_start_matches("0x"), 16).unwrap()
    }

    /// `ublkctl add ARGS…`: the new device's id, once its block device node exists.
    pub fn add(&self, args: &[&str]) -> u32 {
        let mut full = vec!["add"];
        full.extend_from_slice(args);
        let out = self.ctl_ok(&full);
        let id = super::machine::added_id(&out);
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
        fio::kill_running();
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

/// ublkd asked for every device's status every 100 ms on a thread of its own, each
/// answer checked, for as long as a test's operation goes on: how long ublkd kept a
/// client waiting. Asked on its socket as `ublkctl status` asks (not by running
/// ublkctl, whose start under emulation is the test's cost, not ublkd's).
#[derive(Debug)]
pub struct StatusProber {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Duration>,
}

impl StatusProber {
    /// Starts asking the ublkd behind `ctl`.
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
