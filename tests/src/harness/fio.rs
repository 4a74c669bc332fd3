//! fio, the I/O load of the system tests: running it (with the processes a test started
//! tracked, so that a failing test can end them), reading its JSON report into
//! [`FioJob`]s, and the argument lists for the tests' I/O shapes with and without
//! verification.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::process::{describe, signal};

/// Pids of the fio processes running now, so that a failing test can end them.
static FIO_PIDS: std::sync::Mutex<BTreeSet<u32>> = std::sync::Mutex::new(BTreeSet::new());

/// Whether a fio process this test started is running now.
pub fn fio_running() -> bool {
    !FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
}

/// SIGKILLs every fio process this test started that is still running (a failing
/// test's [`super::ublkd::Ublkd`] does, on drop).
pub(crate) fn kill_running() {
    for pid in FIO_PIDS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        signal(*pid, libc::SIGKILL);
    }
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
