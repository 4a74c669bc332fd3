//! Plumbing for the chaos tests: a `ublkd` with its own config, socket and state dir
//! that can be SIGKILLed and started again, `ublkctl` calls that threads can make
//! without panicking, fio runs and their JSON, a seeded PRNG, and the killer that
//! strikes a device's current worker and waits for the recovery.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use ublkd_proto::ctrl::CtrlClient;

pub use crate::common::{
    bin, block_dev, describe, kernel_devices, signal, sparse_file, terminate, wait_for_path,
    worker_pids,
};
use ublkd_proto::uapi::DevState;

pub const MIB: u64 = 1 << 20;

/// How long a struck worker may take to be replaced: a SIGSTOPped one is only noticed
/// after the hung timeout, and TCG makes everything slow.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long `ublkd` may take to stop and delete its devices after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// The `[recovery]` section of the test's config.
#[derive(Debug, Clone, Copy)]
pub struct Recovery {
    pub hung_timeout_secs: u32,
    pub restart_max: u32,
    pub restart_window_secs: u32,
    /// `on_restart_limit = "fail-io"` instead of the default `"quiesce"`.
    pub fail_io: bool,
}

/// `ublkctl --socket S …` for one daemon. Cloneable and panic-free, so that the killer
/// and fio threads can use it; [`Daemon`] adds the asserting variants.
#[derive(Debug, Clone)]
pub struct Ctl {
    pub socket: PathBuf,
}

impl Ctl {
    /// `ublkctl --socket <ours> ARGS…`, whatever its outcome.
    pub fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(bin("ublkctl"));
        cmd.arg("--socket").arg(&self.socket).args(args);
        cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
    }

    /// `ublkctl status --json`: the `devices` array.
    pub fn status(&self) -> Result<Vec<Value>, String> {
        let out = self.run(&["status", "--json"]);
        if !out.status.success() {
            return Err(format!(
                "ublkctl status --json failed ({}):\n{}",
                out.status,
                describe(&out)
            ));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| format!("`ublkctl status --json` is not JSON ({e}): {text}"))?;
        json["devices"].as_array().cloned().ok_or_else(|| format!("no devices array in {text}"))
    }

    /// One device's entry in `ublkctl status --json`.
    pub fn device(&self, id: u32) -> Result<Value, String> {
        find(&self.status()?, id)
    }
}

/// Device `id`'s entry in a `ublkctl status --json` device list.
fn find(devs: &[Value], id: u32) -> Result<Value, String> {
    devs.iter()
        .find(|d| d["id"] == id)
        .cloned()
        .ok_or_else(|| format!("device {id} is not in `ublkctl status --json`"))
}

/// Pids of the fio processes running now, so that a failing test can end them.
static FIO_PIDS: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

/// Whether a fio process this test started is running now.
pub fn fio_running() -> bool {
    !FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
}

/// A running `ublkd` with its own config, socket and state dir under `/run`, logging at
/// `info` into a file under `/tmp`.
///
/// [`Daemon::stop`] is the normal end: SIGTERM, exit 0, nothing left behind. If a test
/// fails first, `Drop` prints ublkd's log, kills the test's fio processes, stops ublkd
/// (SIGTERM, then SIGKILL), kills any worker left and deletes any ublk device still in
/// the kernel, so the next test starts clean.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    pub ctl: Ctl,
    pub config: PathBuf,
    run_dir: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Writes `name`'s config and starts `ublkd` on it.
    pub fn start(name: &str, recovery: Recovery) -> Daemon {
        let run_dir = PathBuf::from(format!("/run/ublkd-chaos-{name}"));
        let _ = std::fs::remove_dir_all(&run_dir);
        let socket = run_dir.join("ublkd.sock");
        let config = PathBuf::from(format!("/tmp/ublkd-chaos-{name}.toml"));
        let Recovery { hung_timeout_secs, restart_max, restart_window_secs, fail_io } = recovery;
        let on_limit = if fail_io { "fail-io" } else { "quiesce" };
        std::fs::write(
            &config,
            format!(
                "[daemon]\nsocket = \"{}\"\nstate_dir = \"{}\"\n\n[recovery]\n\
                 hung_timeout_secs = {hung_timeout_secs}\nrestart_max = {restart_max}\n\
                 restart_window_secs = {restart_window_secs}\n\
                 on_restart_limit = \"{on_limit}\"\n",
                socket.display(),
                run_dir.join("state").display()
            ),
        )
        .unwrap();
        let log = PathBuf::from(format!("/tmp/ublkd-chaos-{name}.log"));
        File::create(&log).unwrap();
        let mut daemon = Daemon { child: None, ctl: Ctl { socket }, config, run_dir, log };
        daemon.spawn();
        daemon
    }

    /// Starts another `ublkd` on the same config (after the previous one died); its log
    /// goes on after the previous one's.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "ublkd is still running");
        self.spawn();
    }

    fn spawn(&mut self) {
        let log = OpenOptions::new().append(true).open(&self.log).unwrap();
        let child = Command::new(bin("ublkd"))
            .arg("--config")
            .arg(&self.config)
            .env("UBLKD_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("cannot start ublkd");
        self.child = Some(child);
        // Ready once it answers a request: it is then in its loop, signal handlers set.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.ctl.run(&["status"]).status.success() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("ublkd exited at start ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "ublkd did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What ublkd wrote so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `ublkctl ARGS…`, which must succeed; returns its stdout.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl.run(args);
        assert!(
            out.status.success(),
            "ublkctl {} failed ({}):\n{}",
            args.join(" "),
            out.status,
            describe(&out)
        );
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

    /// One device's entry in `ublkctl status --json`, which must be there.
    pub fn device(&self, id: u32) -> Value {
        self.ctl.device(id).unwrap()
    }

    /// SIGKILLs ublkd and reaps it.
    pub fn sigkill(&mut self) {
        let mut child = self.child.take().expect("ublkd is not running");
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), None, "ublkd exited by itself ({status}) before SIGKILL");
    }

    /// SIGTERM, then waits for the exit (at most [`STOP_TIMEOUT`]).
    fn terminate(&mut self) -> Option<ExitStatus> {
        terminate(self.child.take()?, STOP_TIMEOUT)
    }

    /// Stops ublkd with SIGTERM and asserts it exits 0 leaving no device and no worker.
    pub fn stop(mut self) {
        let status = self.terminate();
        let log = self.log();
        match status {
            Some(s) => assert!(s.success(), "ublkd exited with {s} after SIGTERM:\n{log}"),
            None => panic!("ublkd did not exit within {STOP_TIMEOUT:?} of SIGTERM:\n{log}"),
        }
        assert_eq!(kernel_devices(), BTreeSet::new(), "ublk devices left in the kernel:\n{log}");
        assert_eq!(worker_pids(), Vec::<u32>::new(), "ublkd-worker processes left:\n{log}");
    }
}

impl Drop for Daemon {
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
        // Workers die with ublkd (PDEATHSIG); a stopped or stuck one is killed here.
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

/// The kernel's state of device `id` (`LIVE`, `QUIESCED`, …).
pub fn kernel_state(id: u32) -> String {
    let info = CtrlClient::open().unwrap().get_dev_info(id).unwrap();
    DevState::from_raw(info.state).to_string()
}

/// Polls `check` every 50 ms until it yields a value or fails, at most `timeout`.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check()? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(format!("timed out after {timeout:?} waiting for {what}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until every device in `ids` has served some I/O since now: fio is running.
pub fn wait_for_io(ctl: &Ctl, ids: &[u32]) {
    let ios = |id: u32| ctl.device(id).map(|d| d["ios"].as_u64().unwrap_or(0));
    let start: Vec<u64> = ids.iter().map(|&id| ios(id).unwrap()).collect();
    wait_for("fio's I/O to reach the devices", Duration::from_secs(60), || {
        for (&id, &before) in ids.iter().zip(&start) {
            if ios(id)? < before + 100 {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .unwrap();
}

/// xorshift64*: small, seeded, reproducible.
#[derive(Debug)]
pub struct Prng(u64);

impl Prng {
    pub fn new(seed: u64) -> Prng {
        Prng(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[lo, hi]`, to the millisecond.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = (hi - lo).as_millis() as u64 + 1;
        lo + Duration::from_millis(self.next_u64() % span)
    }
}

/// The chaos seed: `UBLKD_CHAOS_SEED` if set (to replay a failure), else `default`.
pub fn chaos_seed(default: u64) -> u64 {
    match std::env::var("UBLKD_CHAOS_SEED") {
        Ok(s) => s.parse().unwrap_or_else(|e| panic!("UBLKD_CHAOS_SEED={s:?}: {e}")),
        Err(_) => default,
    }
}

/// Sets the flag when dropped, also while a panic unwinds: it tells fio loops and
/// killers to end.
#[derive(Debug)]
pub struct SetOnDrop(pub Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// One fio job from `--output-format=json`.
#[derive(Debug, Clone)]
pub struct FioJob {
    pub error: i64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub iops: f64,
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
            .current_dir("/tmp")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start fio");
        FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).insert(child.id());
        Fio { child, args }
    }

    /// Waits for fio; its jobs if it exited 0 and every job reported error 0.
    pub fn wait(self) -> Result<Vec<FioJob>, String> {
        let pid = self.child.id();
        let out = self.child.wait_with_output().unwrap();
        FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).remove(&pid);
        let cmd = format!("fio {}", self.args.join(" "));
        if !out.status.success() {
            return Err(format!("{cmd} failed ({}):\n{}", out.status, describe(&out)));
        }
        // fio may print notes before the JSON object.
        let stdout = String::from_utf8_lossy(&out.stdout);
        let json = stdout.find('{').map(|at| &stdout[at..]).ok_or(format!("{cmd}: no JSON"))?;
        let report: Value =
            serde_json::from_str(json).map_err(|e| format!("{cmd}: bad JSON ({e}):\n{stdout}"))?;
        let jobs: Vec<FioJob> = report["jobs"]
            .as_array()
            .ok_or(format!("{cmd}: no jobs in:\n{stdout}"))?
            .iter()
            .map(|j| FioJob {
                error: j["error"].as_i64().unwrap_or(-1),
                read_bytes: j["read"]["io_bytes"].as_u64().unwrap_or(0),
                write_bytes: j["write"]["io_bytes"].as_u64().unwrap_or(0),
                iops: j["read"]["iops"].as_f64().unwrap_or(0.0)
                    + j["write"]["iops"].as_f64().unwrap_or(0.0),
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

/// Every write carries a crc32c header per 4 KiB (`verify_interval`), so any 4 KiB of
/// the region can be checked on its own later: magic, length, offset, checksum.
const VERIFY: [&str; 4] =
    ["--verify=crc32c", "--verify_interval=4k", "--verify_fatal=1", "--verify_state_save=0"];

fn fio_base(name: &str, dev: &Path, region: u64) -> Vec<String> {
    let mut args: Vec<String> = [
        format!("--name={name}"),
        format!("--filename={}", dev.display()),
        format!("--size={region}"),
        "--direct=1".into(),
        "--ioengine=io_uring".into(),
        "--iodepth=32".into(),
        "--eta=never".into(),
        "--output-format=json".into(),
    ]
    .into();
    args.extend(VERIFY.map(String::from));
    args
}

/// Writes all of `region` sequentially with verify headers, so that a later read-only
/// pass can check every block.
pub fn prefill(dev: &Path, region: u64) {
    let mut args = fio_base("prefill", dev, region);
    args.extend(["--rw=write", "--bs=128k", "--do_verify=0"].map(String::from));
    let job = Fio::run(args).unwrap();
    assert_eq!(job.write_bytes, region, "prefill did not write the region: {job:?}");
}

/// Re-reads all of `region` and checks every 4 KiB header and checksum.
pub fn verify_region(dev: &Path, region: u64) -> Result<(), String> {
    let mut args = fio_base("verify-all", dev, region);
    args.extend(["--rw=read", "--bs=128k"].map(String::from));
    let job = Fio::run(args)?;
    if job.read_bytes != region {
        return Err(format!("the verify pass read {} of {region} bytes", job.read_bytes));
    }
    Ok(())
}

/// fio's arguments for one pass of random reads and writes over `region`, not time
/// based, with fio's verify phase after it: that phase reads back every block the pass
/// wrote and checks its header, including the per-write random seed (`seed` makes
/// each pass's differ), so stale data (a lost write) fails it as well as a torn or
/// misplaced block. Blocks of 4k–128k.
pub fn randrw_pass_args(dev: &Path, region: u64, seed: u64) -> Vec<String> {
    let mut args = fio_base("randrw-pass", dev, region);
    args.extend(["--rw=randrw".into(), "--bsrange=4k-128k".into(), format!("--randseed={seed}")]);
    args
}

/// Checks a finished [`randrw_pass_args`] job. The pass moves `region` bytes (reads
/// plus writes, the random map touching each block once), and the verify phase then
/// reads back all it wrote: so the reads add up to the region exactly when everything
/// written was verified.
pub fn check_pass(job: FioJob, region: u64) -> Result<FioJob, String> {
    if job.read_bytes != region || job.write_bytes == 0 {
        return Err(format!("the pass did not verify everything it wrote: {job:?}"));
    }
    Ok(job)
}

/// Runs passes of 4k–128k random reads and writes ([`randrw_pass_args`]) with fresh
/// seeds until `stop` is set, at least one. Returns the passes, or the first failure.
pub fn randrw_passes(
    dev: &Path,
    region: u64,
    seed: u64,
    stop: &AtomicBool,
) -> Result<Vec<FioJob>, String> {
    let mut passes = Vec::new();
    loop {
        let seed = seed + passes.len() as u64;
        let args = randrw_pass_args(dev, region, seed);
        passes.push(check_pass(Fio::run(args)?, region)?);
        if stop.load(Ordering::SeqCst) {
            return Ok(passes);
        }
    }
}

/// fio's arguments for `secs` seconds of 4k random reads and writes over `region`,
/// checking what it wrote as it goes (`verify_backlog`): an IOPS figure.
pub fn timed_randrw_args(dev: &Path, region: u64, secs: u64) -> Vec<String> {
    let mut args = fio_base("timed-randrw", dev, region);
    args.extend(
        ["--rw=randrw", "--bs=4k", "--time_based", "--verify_backlog=256"].map(String::from),
    );
    args.push(format!("--runtime={secs}"));
    args
}

/// What to do to a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blow {
    /// SIGKILL: the worker dies; its pidfd tells ublkd at once.
    Kill,
    /// SIGSTOP: the worker hangs with I/O in flight; ublkd notices after the hung timeout.
    Stop,
}

impl Blow {
    pub fn signal(self) -> libc::c_int {
        match self {
            Blow::Kill => libc::SIGKILL,
            Blow::Stop => libc::SIGSTOP,
        }
    }
}

/// One blow that hit a live worker, and the recovery it caused.
#[derive(Debug)]
pub struct Strike {
    pub pid: u32,
    /// ublkd's `last_recovery_ms`: from the start of the recovery to LIVE.
    pub stall_ms: u64,
    /// From the signal to `ublkctl status` showing the recovery (ublkd answers
    /// nothing while it starts the next standby worker).
    pub seen_ms: u64,
    pub reason: String,
    /// The watched device's I/O count (and when) at the strike and when the recovery
    /// showed.
    pub watched: Option<[(Instant, u64); 2]>,
}

/// What a killer did.
#[derive(Debug, Default)]
pub struct Strikes {
    pub hits: Vec<Strike>,
    /// Signals that found no process.
    pub misses: u32,
}

impl Strikes {
    /// min, median, max of the recovery stalls.
    pub fn stall_stats(&self) -> (u64, u64, u64) {
        min_median_max(self.hits.iter().map(|s| s.stall_ms).collect())
    }

    /// The watched device's IOPS while the struck one recovered (from each strike to its
    /// recovery showing) and between recoveries (from one recovery showing to the next
    /// strike), in the windows that ended by `until`. The two kinds of window alternate,
    /// so a noisy host weighs on both alike.
    pub fn watched_iops(&self, until: Instant) -> Option<(f64, f64)> {
        let windows: Vec<[(Instant, u64); 2]> = self
            .hits
            .iter()
            .map(|h| h.watched)
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .filter(|w| w[1].0 <= until)
            .collect();
        if windows.len() < 3 {
            return None;
        }
        let sum = |pairs: &mut dyn Iterator<Item = ((Instant, u64), (Instant, u64))>| {
            let (mut n, mut t) = (0, 0.0);
            for (from, to) in pairs {
                n += to.1 - from.1;
                t += to.0.duration_since(from.0).as_secs_f64();
            }
            n as f64 / t
        };
        let recovering = sum(&mut windows.iter().map(|w| (w[0], w[1])));
        let between = sum(&mut windows.windows(2).map(|p| (p[0][1], p[1][0])));
        Some((recovering, between))
    }

    /// min, median, max of the times from the signal to the recovery in `ublkctl status`.
    pub fn seen_stats(&self) -> (u64, u64, u64) {
        min_median_max(self.hits.iter().map(|s| s.seen_ms).collect())
    }
}

fn min_median_max(mut v: Vec<u64>) -> (u64, u64, u64) {
    v.sort_unstable();
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// `n` pauses of 0.5–3 s from `prng`, one before each strike.
pub fn pauses(prng: &mut Prng, n: usize) -> Vec<Duration> {
    (0..n).map(|_| prng.between(Duration::from_millis(500), Duration::from_secs(3))).collect()
}

/// Strikes device `id`'s current worker (from `ublkctl status --json`) once per pause,
/// each pause counted from the previous strike, and after each strike waits until
/// `ublkctl status` shows its recovery (a new worker, one more recovery, LIVE) and
/// samples `last_recovery_ms`: strikes come every 0.5–3 s, or as soon as the previous
/// recovery shows if it takes longer. A signal that finds no process is a miss. Reads
/// device `watch`'s I/O count at each strike and recovery. Ends early, with an error,
/// when `abort` is set.
pub fn strike(
    ctl: &Ctl,
    id: u32,
    blow: Blow,
    pauses: &[Duration],
    watch: Option<u32>,
    abort: &AtomicBool,
) -> Result<Strikes, String> {
    let mut strikes = Strikes::default();
    let mut last = Instant::now();
    for pause in pauses {
        while last.elapsed() < *pause {
            if abort.load(Ordering::SeqCst) {
                return Err("aborted".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let devs = ctl.status()?;
        last = Instant::now();
        let dev = find(&devs, id)?;
        if dev["state"] != "LIVE" {
            return Err(format!("device {id} is not LIVE before a strike: {dev}"));
        }
        let pid = dev["worker_pid"].as_u64().ok_or(format!("no worker: {dev}"))? as u32;
        let recoveries = dev["recoveries"].as_u64().unwrap_or(0);
        let watched = match watch {
            Some(w) => Some((last, find(&devs, w)?["ios"].as_u64().unwrap_or(0))),
            None => None,
        };
        if signal(pid, blow.signal()) {
            let (mut hit, devs) = recovered(ctl, id, blow, pid, recoveries, last)?;
            if let (Some(before), Some(w)) = (watched, watch) {
                let after = find(&devs, w)?["ios"].as_u64().unwrap_or(0);
                hit.watched = Some([before, (last + Duration::from_millis(hit.seen_ms), after)]);
            }
            strikes.hits.push(hit);
        } else {
            strikes.misses += 1;
        }
    }
    Ok(strikes)
}

/// Waits until device `id` has recovered from the strike of worker `pid` at `at`, which
/// found `recoveries` recoveries before it. Returns the strike and the status that
/// showed the recovery.
fn recovered(
    ctl: &Ctl,
    id: u32,
    blow: Blow,
    pid: u32,
    recoveries: u64,
    at: Instant,
) -> Result<(Strike, Vec<Value>), String> {
    let what = format!("device {id} to recover from {blow:?} of worker {pid}");
    let (dev, devs) = wait_for(&what, RECOVERY_TIMEOUT, || {
        let devs = ctl.status()?;
        let dev = find(&devs, id)?;
        let replaced = dev["worker_pid"].as_u64().is_some_and(|p| p != u64::from(pid));
        let counted = dev["recoveries"].as_u64() == Some(recoveries + 1);
        Ok((replaced && counted && dev["state"] == "LIVE").then_some((dev, devs)))
    })?;
    let strike = Strike {
        pid,
        stall_ms: dev["last_recovery_ms"].as_u64().ok_or(format!("no stall: {dev}"))?,
        seen_ms: at.elapsed().as_millis() as u64,
        reason: dev["last_recovery_reason"].as_str().unwrap_or("").to_string(),
        watched: None,
    };
    Ok((strike, devs))
}
