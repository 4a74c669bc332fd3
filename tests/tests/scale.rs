//! Many devices on one host (in the VM): ublkd adds [`DEVICES`] null devices, its
//! `status --json` lists them all (a reply far over one request's 64 KiB), `list`
//! shows them all LIVE, and `del -a` deletes them all side by side (at least
//! [`MIN_OVERLAP`] at a time on average) within [`DELETE_ALL_LIMIT`]. ublkd raised
//! its fd limit: it holds ~10 fds per device, over the default soft limit of 1024.
//! Before the delete, every worker is killed at once (as an OOM kill would): every
//! device recovers onto its standby within [`MASS_RECOVERY_LIMIT`].
//!
//! The devices are added from [`ADDERS`] threads, so that ublkctl's own start is not
//! added to each device's, and ublkd overlaps their workers' start-ups. Each device is as
//! small as a device gets (one queue, depth 4, 1 MiB): it still costs two worker
//! processes (active and standby), ~2 MiB of the VM's memory.
//!
//! An add never holds up the loop while its worker starts: with workers that take
//! [`SLOW_START`] each to start, [`CONCURRENT_ADDS`] adds issued together finish in
//! about one start-up rather than one after another, `status` answers meanwhile, and an
//! add whose worker never stands by fails after the worker timeout, leaving nothing
//! behind, while the others succeed; one under way when ublkd stops is given up.
//! Configured devices are created side by side too, and a recovery whose standby is
//! still starting waits for it without holding up `status` or an add.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ublkd_proto::msg::{self, AddRequest, CtlRequest, CtlResponse, TargetKind};
use ublkd_tests::harness::machine::{added_id, fd_targets, kernel_devices, serial, worker_pids};
use ublkd_tests::harness::process::{self, bin, describe};
use ublkd_tests::harness::ublkd::Ublkd;

/// How many devices the test adds: enough that ublkd needs more descriptors than the
/// default soft limit of 1024 (about 10 per device, asserted below) and that `status
/// --json` is over one request's 64 KiB (asserted too). 300 proved nothing more and
/// took twice as long (172 s under emulation).
const DEVICES: usize = 160;
/// The default soft RLIMIT_NOFILE, which ublkd must raise to serve [`DEVICES`].
const DEFAULT_SOFT_NOFILE: usize = 1024;
/// How many `ublkctl add` run at once.
const ADDERS: usize = 4;
/// How long `ublkctl del -a` may take for every device. Under emulation on a host
/// busy with other VMs it took 49 s (2.4 s per device, 16 at a time); one after
/// another it took 94-214 ms per device, 28-64 s.
const DELETE_ALL_LIMIT: Duration = Duration::from_secs(90);
/// How long every device may take to recover after all their workers were killed at
/// once. ublkd recovers them one after another (activation is not yet overlapped):
/// ~0.1 s each on an idle host under emulation, up to ~1.5 s on one crowded with
/// other VMs.
const MASS_RECOVERY_LIMIT: Duration = Duration::from_secs(600);
/// How many deletes must have run at once on average (16 did, 14.5 on average).
const MIN_OVERLAP: f64 = 4.0;

/// The VM's available memory in MiB, from /proc/meminfo.
fn mem_available_mib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

/// How long each device's delete took, from ublkd's `device deleted` lines (STOP_DEV,
/// the workers' exit, DEL_DEV).
fn delete_durations(log: &str) -> Vec<Duration> {
    log.lines()
        .filter(|l| l.contains("event=\"deleted\""))
        .map(|l| {
            let ms = |key: &str| -> u64 {
                let value =
                    l.split(&format!(" {key}=")).nth(1).unwrap_or_else(|| panic!("{key}? {l}"));
                value.split(' ').next().unwrap().parse().unwrap()
            };
            Duration::from_millis(ms("stop_ms") + ms("workers_ms") + ms("del_ms"))
        })
        .collect()
}

/// `pid`'s RLIMIT_NOFILE (soft, hard), from /proc/PID/limits.
fn nofile_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let mut values = line["Max open files".len()..].split_whitespace();
    (values.next().unwrap().to_string(), values.next().unwrap().to_string())
}

#[test]
fn more_null_devices_than_the_default_fd_limit_are_added_listed_and_deleted_in_seconds() {
    let _serial = serial();
    let started = Instant::now();
    let ublkd = Ublkd::start("scale");
    let fds_before = fd_targets(ublkd.pid()).len();
    let (soft, hard) = nofile_limits(ublkd.pid());
    assert_eq!(soft, hard, "ublkd did not raise its soft RLIMIT_NOFILE to the hard limit");
    assert_ne!(soft, "1024", "ublkd kept the default soft RLIMIT_NOFILE");
    let mem_before = mem_available_mib();

    let ids = Mutex::new(Vec::with_capacity(DEVICES));
    let add_started = Instant::now();
    std::thread::scope(|s| {
        for adder in 0..ADDERS {
            let (ublkd, ids) = (&ublkd, &ids);
            s.spawn(move || {
                for _ in (adder..DEVICES).step_by(ADDERS) {
                    let out =
                        ublkd.ctl_ok(&["add", "-t", "null", "-s", "1M", "-q", "1", "-d", "4"]);
                    let id = added_id(&out);
                    ids.lock().unwrap().push(id);
                }
            });
        }
    });
    let add_took = add_started.elapsed();
    let mut ids = ids.into_inner().unwrap();
    ids.sort_unstable();
    let fds = fd_targets(ublkd.pid()).len();
    println!(
        "added {DEVICES} devices in {:.1} s ({:.0} ms per device, {ADDERS} at a time); \
         ublkd holds {fds} fds ({fds_before} before: {:.1} per device); {} MiB of memory \
         available ({mem_before} MiB before)",
        add_took.as_secs_f64(),
        add_took.as_secs_f64() * 1000.0 / DEVICES as f64,
        (fds - fds_before) as f64 / DEVICES as f64,
        mem_available_mib(),
    );
    assert_eq!(ids.len(), DEVICES);
    assert_eq!(kernel_devices().len(), DEVICES, "the kernel's devices");
    assert!(
        fds > DEFAULT_SOFT_NOFILE,
        "ublkd holds {fds} fds: {DEVICES} devices do not test its raised fd limit"
    );

    let status_started = Instant::now();
    let status = ublkd.status();
    let mut listed: Vec<u32> = status.iter().map(|d| d["id"].as_u64().unwrap() as u32).collect();
    listed.sort_unstable();
    assert_eq!(listed, ids, "`status --json` lists every device");
    let status_bytes = serde_json::to_string(&status).unwrap().len();
    assert!(status_bytes > 64 * 1024, "`status --json` is only {status_bytes} bytes");
    println!(
        "status --json: {} devices in {} ms",
        listed.len(),
        status_started.elapsed().as_millis()
    );

    let list = ublkd.ctl_ok(&["list"]);
    let live = list.lines().filter(|l| l.contains("state LIVE")).count();
    assert_eq!(live, DEVICES, "`list` shows every device LIVE:\n{list}");

    // A mass event (an OOM kill of every worker): each device recovers, once, onto its
    // standby; none is left failing I/O by a budget meant for one device's crash loop.
    let workers: Vec<u64> = status.iter().map(|d| d["worker_pid"].as_u64().unwrap()).collect();
    let kill_started = Instant::now();
    for pid in &workers {
        process::signal(*pid as u32, libc::SIGKILL);
    }
    // Watched in ublkd's log, not with `status` of every device, which would hold the
    // loop that is recovering them.
    let deadline = Instant::now() + MASS_RECOVERY_LIMIT;
    loop {
        let log = ublkd.log();
        let done = workers
            .iter()
            .filter(|pid| log.contains(&format!("device recovered (worker {pid} killed")))
            .count();
        if done == DEVICES {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{done} of {DEVICES} devices recovered {MASS_RECOVERY_LIMIT:?} after every worker \
             was killed:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    println!(
        "every worker killed at once: all {DEVICES} devices recovered after {:.1} s",
        kill_started.elapsed().as_secs_f64()
    );
    let recovered = ublkd.status();
    for d in &recovered {
        assert_eq!(d["state"], "LIVE", "{d}");
        assert_eq!(d["recoveries"], 1, "{d}");
        assert_eq!(d["failing_io"], false, "{d}");
    }
    for d in &recovered {
        assert!(!workers.contains(&d["worker_pid"].as_u64().unwrap()), "an old worker: {d}");
    }

    let del_started = Instant::now();
    let out = ublkd.ctl(&["del", "-a"]);
    let del_took = del_started.elapsed();
    println!(
        "del -a: {DEVICES} devices in {:.1} s ({:.0} ms per device)",
        del_took.as_secs_f64(),
        del_took.as_secs_f64() * 1000.0 / DEVICES as f64
    );
    assert!(out.status.success(), "del -a failed: {}\n{}", describe(&out), ublkd.log());
    let deleted = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.starts_with("deleted device"))
        .count();
    assert_eq!(deleted, DEVICES, "del -a names every device it deleted");
    assert!(kernel_devices().is_empty(), "devices left in the kernel: {:?}", kernel_devices());
    assert!(worker_pids().is_empty(), "workers left: {:?}", worker_pids());
    // Under emulation every delete is mostly CPU (workers exiting, the kernel tearing
    // devices down), so the time alone depends on how busy the host is; the deletes'
    // own durations, added up, show whether they ran side by side.
    let busy = delete_durations(&ublkd.log());
    assert_eq!(busy.len(), DEVICES, "`device deleted` log lines");
    let busy: Duration = busy.iter().sum();
    let overlap = busy.as_secs_f64() / del_took.as_secs_f64();
    println!(
        "del -a: the deletes took {:.1} s added up: {overlap:.1} at a time",
        busy.as_secs_f64()
    );
    assert!(overlap >= MIN_OVERLAP, "del -a deleted {overlap:.1} devices at a time");
    assert!(
        del_took < DELETE_ALL_LIMIT,
        "del -a took {del_took:?} for {DEVICES} devices, more than {DELETE_ALL_LIMIT:?}"
    );
    ublkd.stop();
    println!("the whole test took {:.1} s", started.elapsed().as_secs_f64());
}

/// How long each worker of [`adds_overlap_their_workers_start_ups`] sleeps before it
/// starts: one add's floor, whatever the host's load.
const SLOW_START: Duration = Duration::from_secs(4);
/// How many adds that test issues at once.
const CONCURRENT_ADDS: usize = 8;
/// The device id whose worker never stands by (it sleeps for an hour instead).
const SILENT_ID: u32 = 41;
/// The device id whose worker exits at once, before it stands by.
const FAILING_ID: u32 = 42;
/// ublkd's limit for a worker to stand by, set short (`recovery.worker_ready_timeout_secs`;
/// the default is 30 s) because the silent worker's add waits it out.
const WORKER_TIMEOUT: Duration = Duration::from_secs(15);

/// A worker binary that sleeps [`SLOW_START`] before it becomes the real worker, but
/// for device [`SILENT_ID`] (sleeps for an hour, never answering) and [`FAILING_ID`]
/// (exits 1).
fn slow_worker(path: &Path) {
    let script = format!(
        "#!/bin/sh\n\
         case \" $* \" in\n\
         *\" --dev-id {SILENT_ID} \"*) exec sleep 3600 ;;\n\
         *\" --dev-id {FAILING_ID} \"*) echo 'this worker will not start' >&2; exit 1 ;;\n\
         esac\n\
         sleep {} 3<&-\n\
         exec {} \"$@\"\n",
        SLOW_START.as_secs(),
        bin("ublkd-worker").display()
    );
    let new = path.with_extension("new");
    std::fs::write(&new, script).unwrap();
    std::fs::set_permissions(&new, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::rename(&new, path).unwrap();
}

/// `ublkctl add -t null -s 1M -q 1 -d 4`, as ublkctl sends it.
fn add_null() -> CtlRequest {
    CtlRequest::Add(AddRequest {
        id: None,
        target: TargetKind::Null,
        file: None,
        uri: None,
        size: Some(1 << 20),
        queues: Some(1),
        queue_depth: Some(4),
        threads: None,
        zero_copy: None,
        sandbox: None,
        sandbox_optional: None,
        rbd: None,
        name: None,
        read_only: false,
        partitions: false,
    })
}

/// Sends `request` to ublkd on a connection of its own, to be answered with [`answer`].
fn ask(socket: &Path, request: CtlRequest) -> UnixStream {
    let mut stream = UnixStream::connect(socket).unwrap();
    msg::write_frame(&mut stream, &request).unwrap();
    stream
}

/// ublkd's answer on `stream` (see [`ask`]).
fn answer(mut stream: UnixStream) -> CtlResponse {
    stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    msg::read_response(&mut stream).unwrap()
}

/// The pids of the processes whose command line contains `text`.
fn pids_running(text: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).replace('\0', " ").contains(text))
        })
        .collect()
}

#[test]
fn adds_overlap_their_workers_start_ups() {
    let _serial = serial();
    let wrapper = PathBuf::from("/tmp/ublkd-test-slow-worker");
    slow_worker(&wrapper);
    let extra = format!(
        "worker_binary = \"{}\"\n[recovery]\nworker_ready_timeout_secs = {}\n",
        wrapper.display(),
        WORKER_TIMEOUT.as_secs()
    );
    let ublkd = Ublkd::start_with("slow-start", &extra, &[]);
    let add = |args: &[&str]| {
        Command::new(bin("ublkctl"))
            .arg("--socket")
            .arg(&ublkd.ctl.socket)
            .arg("add")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let small = ["-t", "null", "-s", "1M", "-q", "1", "-d", "4"];
    // The first worker's start reads its binary into the page cache (seconds under
    // emulation, over virtiofs): not what is measured.
    let mut ids = vec![ublkd.add(&small)];
    // Sent on sockets of their own rather than by ublkctl processes, whose start under
    // emulation (up to seconds, 8 at once) would be measured too.
    let started = Instant::now();
    let adds: Vec<_> = (0..CONCURRENT_ADDS).map(|_| ask(&ublkd.ctl.socket, add_null())).collect();
    // Once ublkd has begun every add (each device is in the kernel, its worker
    // starting), `status` is answered at once, not after the adds.
    let begun_by = started + SLOW_START * CONCURRENT_ADDS as u32 * 2;
    while kernel_devices().len() < 1 + CONCURRENT_ADDS {
        assert!(Instant::now() < begun_by, "the adds were not all begun: {:?}", kernel_devices());
        std::thread::sleep(Duration::from_millis(20));
    }
    let begun = started.elapsed();
    let asked = Instant::now();
    let during = answer(ask(&ublkd.ctl.socket, CtlRequest::Status { id: None }));
    let status_took = asked.elapsed();
    let CtlResponse::Status(during) = during else { panic!("status answered {during:?}") };
    // The adds under way are listed (ADDING), so no device asked for is missing.
    let adding = during.iter().filter(|d| d.state == "ADDING").count();
    assert_eq!(during.len(), 1 + CONCURRENT_ADDS, "status during the adds: {during:?}");
    assert!(adding >= 1, "no add under way shown as ADDING: {during:?}");
    for add in adds {
        match answer(add) {
            CtlResponse::Added { id } => ids.push(id),
            other => panic!("an add failed: {other:?}\n{}", ublkd.log()),
        }
    }
    let adds_took = started.elapsed();
    println!(
        "{CONCURRENT_ADDS} adds at once, each worker starting in {SLOW_START:?} or more: all \
         begun after {:.2} s, all LIVE after {:.2} s (one after another: {:.0} s or more); \
         `status` then answered in {} ms, listing {} devices",
        begun.as_secs_f64(),
        adds_took.as_secs_f64(),
        (SLOW_START * CONCURRENT_ADDS as u32).as_secs_f64(),
        status_took.as_millis(),
        during.len()
    );
    assert!(
        status_took < SLOW_START / 4,
        "`status` took {status_took:?} while adds were under way: it waited for them"
    );
    assert!(
        adds_took < SLOW_START * CONCURRENT_ADDS as u32 / 2,
        "{CONCURRENT_ADDS} adds took {adds_took:?}: their workers did not start side by side"
    );
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), CONCURRENT_ADDS + 1, "each add made its own device");

    // A worker that never stands by, and one that exits at once: each fails its own
    // add only, with the same errors as ever, and leaves no device and no process
    // behind; an add and `status` meanwhile are answered as if they were not there.
    let started = Instant::now();
    let silent = add(&[&small[..], &["-n", &SILENT_ID.to_string()]].concat());
    let failing = add(&[&small[..], &["-n", &FAILING_ID.to_string()]].concat());
    std::thread::sleep(Duration::from_millis(500));
    let asked = Instant::now();
    ublkd.status();
    let another = ublkd.add(&small);
    let meanwhile = asked.elapsed();
    println!("while a worker never stood by: `status` and an add took {meanwhile:?}");
    assert!(meanwhile < SLOW_START * 3, "`status` and an add took {meanwhile:?}");
    ids.push(another);
    ids.sort_unstable();
    let out = failing.wait_with_output().unwrap();
    assert!(!out.status.success(), "the failing worker's add succeeded: {}", describe(&out));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("exited before it was ready")
            || said.contains("cannot send the worker its setup"),
        "{}",
        describe(&out)
    );
    let out = silent.wait_with_output().unwrap();
    let silent_took = started.elapsed();
    assert!(!out.status.success(), "the silent worker's add succeeded: {}", describe(&out));
    let said = String::from_utf8_lossy(&out.stderr);
    let limit = format!("did not answer within {} s", WORKER_TIMEOUT.as_secs());
    assert!(said.contains(&limit), "{}", describe(&out));
    assert!(silent_took >= WORKER_TIMEOUT, "the silent add failed after {silent_took:?}");
    println!("the silent worker's add failed after {:.1} s", silent_took.as_secs_f64());
    let kernel: Vec<u32> = kernel_devices().into_iter().collect();
    assert_eq!(kernel, ids, "the kernel's devices are the added ones");
    assert!(pids_running("sleep 3600").is_empty(), "the silent worker is left running");
    let listed = ublkd.status().len();
    assert_eq!(listed, ids.len(), "devices in status");
    // Every standby started (each takes SLOW_START), so shutdown has none to wait for.
    ublkd.wait_until("every device has a standby", || {
        ublkd.status().iter().all(|d| d["standby_pid"].is_u64())
    });
    // An add under way is in `status` as ADDING, and `del -a` takes it too: its device
    // deleted, its worker ended, its client told; nothing comes up afterwards.
    let doomed = add(&[&small[..], &["-n", &SILENT_ID.to_string()]].concat());
    ublkd.wait_until("the doomed add begun", || kernel_devices().contains(&SILENT_ID));
    let shown = ublkd.status_of(SILENT_ID);
    assert_eq!(shown["state"], "ADDING", "{shown}");
    assert!(ublkd.status().iter().any(|d| d["id"] == SILENT_ID), "not in status of all");
    let deleted = ublkd.ctl_ok(&["del", "-a"]);
    let out = doomed.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an add under way at del -a succeeded: {}", describe(&out));
    assert!(
        said.contains("deleted by `ublkctl del -a` before the device was made"),
        "{}",
        describe(&out)
    );
    println!("del -a with an add under way: {:?}", deleted.trim());
    assert!(kernel_devices().is_empty(), "left after del -a: {:?}", kernel_devices());
    assert!(pids_running("sleep 3600").is_empty(), "the doomed add's worker is left running");
    assert!(ublkd.status().is_empty(), "status after del -a: {:?}", ublkd.status());

    // An add under way when ublkd is shut down (`ublkctl shutdown`, as `stop` does) is
    // given up: its device deleted, its worker ended, its client told.
    let last = add(&[&small[..], &["-n", &SILENT_ID.to_string()]].concat());
    ublkd.wait_until("the last add begun", || kernel_devices().contains(&SILENT_ID));
    ublkd.stop();
    let out = last.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an add under way at shutdown succeeded: {}", describe(&out));
    assert!(said.contains("ublkd was shut down before the device was made"), "{}", describe(&out));
    assert!(pids_running("sleep 3600").is_empty(), "the last add's worker is left running");
    let _ = std::fs::remove_file(&wrapper);
}

/// How many configured devices [`configured_devices_are_created_side_by_side_at_start`]
/// gives ublkd.
const CONFIGURED: u32 = 6;

#[test]
fn configured_devices_are_created_side_by_side_at_start() {
    let _serial = serial();
    let wrapper = PathBuf::from("/tmp/ublkd-test-slow-worker-configured");
    slow_worker(&wrapper);
    let mut extra = format!("worker_binary = \"{}\"\n", wrapper.display());
    let ids: Vec<u32> = (10..10 + CONFIGURED).collect();
    for id in &ids {
        extra.push_str(&format!(
            "\n[[device]]\nid = {id}\ntarget = \"null\"\nsize = \"1M\"\nqueues = 1\n\
             queue_depth = 4\n"
        ));
    }
    // ublkd answers once every configured device is LIVE (or failed).
    let started = Instant::now();
    let ublkd = Ublkd::start_with("slow-configured", &extra, &[]);
    let took = started.elapsed();
    let status = ublkd.status();
    let mut live: Vec<u32> = status
        .iter()
        .filter(|d| d["state"] == "LIVE")
        .map(|d| d["id"].as_u64().unwrap() as u32)
        .collect();
    live.sort_unstable();
    assert_eq!(live, ids, "the configured devices LIVE:\n{}", ublkd.log());
    println!(
        "{CONFIGURED} configured devices, each worker starting in {SLOW_START:?} or more: \
         ublkd answered after {:.2} s (one after another: {:.0} s or more)",
        took.as_secs_f64(),
        (SLOW_START * CONFIGURED).as_secs_f64()
    );
    assert!(
        took < SLOW_START * CONFIGURED * 3 / 4,
        "{CONFIGURED} configured devices took {took:?}: not created side by side"
    );
    ublkd.wait_until("every device has a standby", || {
        ublkd.status().iter().all(|d| d["standby_pid"].is_u64())
    });
    ublkd.stop();
    let _ = std::fs::remove_file(&wrapper);
}

#[test]
fn a_recovery_waiting_for_its_new_worker_holds_up_nothing_else() {
    let _serial = serial();
    let wrapper = PathBuf::from("/tmp/ublkd-test-slow-worker-recovery");
    slow_worker(&wrapper);
    let extra = format!("worker_binary = \"{}\"\n", wrapper.display());
    let ublkd = Ublkd::start_with("slow-recovery", &extra, &[]);
    let small = ["-t", "null", "-s", "1M", "-q", "1", "-d", "4"];
    let id = ublkd.add(&small);
    // Its standby has just begun its start (SLOW_START): the recovery must wait for it.
    let killed = ublkd.worker_pid(id);
    assert!(process::signal(killed, libc::SIGKILL));
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    let status = answer(ask(&ublkd.ctl.socket, CtlRequest::Status { id: None }));
    let status_took = asked.elapsed();
    assert!(matches!(status, CtlResponse::Status(_)), "status answered {status:?}");
    let other = ublkd.add(&small);
    let add_took = asked.elapsed();
    ublkd.wait_until("the device recovered", || {
        let d = ublkd.status_of(id);
        d["state"] == "LIVE" && d["recoveries"] == 1
    });
    let recovered = ublkd.log().lines().find(|l| l.contains("device recovered")).map(String::from);
    println!(
        "a recovery waiting for its new worker ({SLOW_START:?} to start): `status` meanwhile \
         answered in {} ms, an add in {:.2} s; {}",
        status_took.as_millis(),
        add_took.as_secs_f64(),
        recovered.unwrap_or_default()
    );
    assert!(
        status_took < SLOW_START / 4,
        "`status` took {status_took:?} while a recovery waited for its worker"
    );
    assert_ne!(ublkd.worker_pid(id), killed);
    assert_eq!(ublkd.status_of(other)["state"], "LIVE");
    ublkd.wait_until("every device has a standby", || {
        ublkd.status().iter().all(|d| d["standby_pid"].is_u64())
    });
    ublkd.stop();
    let _ = std::fs::remove_file(&wrapper);
}
