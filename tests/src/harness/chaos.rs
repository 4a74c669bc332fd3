//! The chaos tests' plumbing, on top of [`super::ublkd`] and [`super::fio`]: the
//! recovery settings, the fio passes that verify a region, and the killer that strikes
//! a device's current worker (at pauses from a seeded [`Prng`]) and waits for the
//! recovery.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use ublkd_proto::ctrl::CtrlClient;
use ublkd_proto::uapi::DevState;

use super::fio::{Fio, FioJob};
use super::process::signal;
use super::ublkd::{Ctl, Ublkd, find_device};
use crate::prng::Prng;

/// A mebibyte, for region and device sizes.
pub const MIB: u64 = 1 << 20;

/// How long a struck worker may take to be replaced: a SIGSTOPped one is only noticed
/// after the hung timeout, and TCG makes everything slow.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// The `[recovery]` section of the test's config.
#[derive(Debug, Clone, Copy)]
pub struct Recovery {
    pub hung_timeout_secs: u32,
    pub restart_max: u32,
    pub restart_window_secs: u32,
    /// `on_restart_limit = "fail-io"` instead of the default `"quiesce"`.
    pub fail_io: bool,
}

impl Recovery {
    /// The config's `[recovery]` table.
    pub fn toml(&self) -> String {
        let Recovery { hung_timeout_secs, restart_max, restart_window_secs, fail_io } = *self;
        let on_limit = if fail_io { "fail-io" } else { "quiesce" };
        format!(
            "\n[recovery]\nhung_timeout_secs = {hung_timeout_secs}\nrestart_max = {restart_max}\n\
             restart_window_secs = {restart_window_secs}\non_restart_limit = \"{on_limit}\"\n"
        )
    }
}

/// A `ublkd` for a chaos test, logging at `info`, its devices recovered per `recovery`.
pub fn start(name: &str, recovery: Recovery) -> Ublkd {
    Ublkd::start_with(&format!("chaos-{name}"), &recovery.toml(), &[("UBLKD_LOG", "info")])
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

/// Sets the flag when dropped, also while a panic unwinds: it tells fio loops and
/// killers to end.
#[derive(Debug)]
pub struct SetOnDrop(pub Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// [`randrw_passes`] on a thread of its own, stopped by [`Self::finish`] (or when
/// dropped, also while a panic unwinds).
#[derive(Debug)]
pub struct BackgroundPasses {
    stop: SetOnDrop,
    thread: std::thread::JoinHandle<Result<Vec<FioJob>, String>>,
}

impl BackgroundPasses {
    pub fn start(dev: &Path, region: u64, seed: u64) -> BackgroundPasses {
        let stop = Arc::new(AtomicBool::new(false));
        let (dev, flag) = (dev.to_path_buf(), Arc::clone(&stop));
        let thread = std::thread::spawn(move || randrw_passes(&dev, region, seed, &flag));
        BackgroundPasses { stop: SetOnDrop(stop), thread }
    }

    /// Ends the passes after the one under way; the passes, or the first failure.
    pub fn finish(self) -> Result<Vec<FioJob>, String> {
        self.stop.0.store(true, Ordering::SeqCst);
        self.thread.join().expect("the fio thread")
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
fn randrw_pass_args(dev: &Path, region: u64, seed: u64) -> Vec<String> {
    let mut args = fio_base("randrw-pass", dev, region);
    args.extend(["--rw=randrw".into(), "--bsrange=4k-128k".into(), format!("--randseed={seed}")]);
    args
}

/// Checks a finished [`randrw_pass_args`] job. The pass moves `region` bytes (reads
/// plus writes, the random map touching each block once), and the verify phase then
/// reads back all it wrote: so the reads add up to the region exactly when everything
/// written was verified.
fn check_pass(job: FioJob, region: u64) -> Result<FioJob, String> {
    if job.read_bytes != region || job.write_bytes == 0 {
        return Err(format!("the pass did not verify everything it wrote: {job:?}"));
    }
    Ok(job)
}

/// Runs passes of 4k–128k random reads and writes (`randrw_pass_args`) with fresh
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

/// `n` pauses of 0.2–1.2 s from `prng`, one before each strike: they put the strikes
/// at random points of fio's passes; what the device serves between two strikes is
/// [`IOS_BETWEEN_STRIKES`]'s to ensure, not the clock's.
pub fn pauses(prng: &mut Prng, n: usize) -> Vec<Duration> {
    (0..n).map(|_| prng.between(Duration::from_millis(200), Duration::from_millis(1200))).collect()
}

/// Requests the struck device serves after a recovery shows before the next strike:
/// each new worker serves verified I/O before it dies in turn.
pub const IOS_BETWEEN_STRIKES: u64 = 50;
/// How long after a strike the struck device may take to serve them.
const IOS_BETWEEN_STRIKES_LIMIT: Duration = Duration::from_secs(30);

/// Strikes device `id`'s current worker (from `ublkctl status --json`) once per pause,
/// each pause counted from the previous strike, and after each strike waits until
/// `ublkctl status` shows its recovery (a new worker, one more recovery, LIVE) and
/// samples `last_recovery_ms`: strikes come every 0.2–1.2 s, or later when the previous
/// recovery takes longer or the new worker has not yet served
/// [`IOS_BETWEEN_STRIKES`] requests. A signal that finds no process is a miss. Reads
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
    // The struck device's requests when its last recovery showed (none yet: fio's I/O
    // is flowing when the strikes begin).
    let mut served_from: Option<u64> = None;
    let ios = |devs: &[Value]| -> Result<u64, String> {
        Ok(find_device(devs, id)?["ios"].as_u64().unwrap_or(0))
    };
    for pause in pauses {
        loop {
            if abort.load(Ordering::SeqCst) {
                return Err("aborted".into());
            }
            if last.elapsed() >= *pause {
                let Some(from) = served_from else { break };
                let served = ios(&ctl.status()?)? - from;
                if served >= IOS_BETWEEN_STRIKES {
                    break;
                }
                // fio failed, or the new worker serves nothing: say so, rather than wait.
                if last.elapsed() > IOS_BETWEEN_STRIKES_LIMIT {
                    return Err(format!(
                        "device {id} served {served} requests in the {:?} since its last \
                         recovery",
                        last.elapsed()
                    ));
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let devs = ctl.status()?;
        last = Instant::now();
        let dev = find_device(&devs, id)?;
        if dev["state"] != "LIVE" {
            return Err(format!("device {id} is not LIVE before a strike: {dev}"));
        }
        let pid = dev["worker_pid"].as_u64().ok_or(format!("no worker: {dev}"))? as u32;
        let recoveries = dev["recoveries"].as_u64().unwrap_or(0);
        let watched = match watch {
            Some(w) => Some((last, find_device(&devs, w)?["ios"].as_u64().unwrap_or(0))),
            None => None,
        };
        if signal(pid, blow.signal()) {
            let (mut hit, devs) = recovered(ctl, id, blow, pid, recoveries, last)?;
            served_from = Some(ios(&devs)?);
            if let (Some(before), Some(w)) = (watched, watch) {
                let after = find_device(&devs, w)?["ios"].as_u64().unwrap_or(0);
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
        let dev = find_device(&devs, id)?;
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
