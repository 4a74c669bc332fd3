//! A worker that turns against the supervisor (in the VM): it scribbles over the shared
//! region it shares with ublkd, one of its queue threads stops mid-turn while the
//! others serve on, or it answers Ready without fetching its tags (so that START_DEV
//! or END_USER_RECOVERY would wait on it for ever). ublkd must stay up, find the fault, recover the device with its
//! data intact, and leave every other device alone.
//!
//! The faults come from the worker built with the test-only `test-hooks` feature
//! (worker/src/attack.rs), limited to one device by `UBLKD_WORKER_ATTACK_DEV`.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::thread::JoinHandle;

use ublkd_tests::harness::fio::{FioJob, assert_fio_clean, fio, fio_verify_args};
use ublkd_tests::harness::machine::{block_dev, kernel_devices, serial};
use ublkd_tests::harness::process::{self, hooked_worker, run_ok};
use ublkd_tests::harness::storage::{WriteThrottle, sha256, sparse_file};
use ublkd_tests::harness::ublkd::{Ublkd, ask};

const MIB: u64 = 1 << 20;

/// ublkd running the hooked worker, which makes `fault` on device `victim` only.
fn hostile(name: &str, fault: &str, victim: u32, recovery: &str) -> Ublkd {
    let extra = format!(
        "worker_binary = \"{}\"\nworker_user = \"nobody\"\n\n[recovery]\n{recovery}\n",
        hooked_worker().display()
    );
    let victim = victim.to_string();
    Ublkd::start_with(
        name,
        &extra,
        &[("UBLKD_WORKER_ATTACK", fault), ("UBLKD_WORKER_ATTACK_DEV", &victim)],
    )
}

/// fio writing `region` bytes at random over device `id`, then reading and verifying
/// every block (crc32c), in a thread.
fn verify_in_background(id: u32, region: u64) -> JoinHandle<Vec<FioJob>> {
    std::thread::spawn(move || {
        fio(&fio_verify_args(&format!("verify{id}"), &block_dev(id), "randwrite", 1, region))
    })
}

#[test]
fn a_worker_that_scribbles_over_its_region_and_dies_leaves_ublkd_up_and_data_intact() {
    let _s = serial();
    let mut ublkd = hostile("scribble", "scribble-region", 7, "");
    let bystander = ublkd.add(&["-n", "6", "-t", "memory", "-s", "64M"]);
    let victim = ublkd.add(&["-n", "7", "-t", "memory", "-s", "64M"]);
    let fio_victim = verify_in_background(victim, 32 * MIB);
    let fio_bystander = verify_in_background(bystander, 32 * MIB);
    ublkd.wait_until("the victim's recovery", || {
        ublkd.status_of(victim)["recoveries"].as_u64() == Some(1)
    });
    assert_fio_clean(&fio_victim.join().expect("fio on the victim"), 1);
    assert_fio_clean(&fio_bystander.join().expect("fio on the bystander"), 1);
    assert!(ublkd.alive(), "ublkd died:\n{}", ublkd.log());
    let log = ublkd.log();
    assert!(log.contains("attack scribble-region: region scribbled"), "{log}");
    let status = ublkd.status_of(victim);
    assert_eq!(status["state"], "LIVE", "{status}");
    assert_eq!(ublkd.status_of(bystander)["recoveries"], 0, "the bystander was touched");
    // Its latency histograms hold all-ones (kept across incarnations, like the
    // counters): they still render, as a valid histogram.
    let metrics = ublkd.ctl_ok(&["metrics"]);
    assert!(metrics.ends_with("# EOF\n"), "{metrics}");
    let count = format!(
        "ublkd_device_request_duration_seconds_count{{device=\"ublkb{victim}\",id=\"{victim}\",op=\"read\"}} "
    );
    assert!(metrics.contains(&count), "{metrics}");
    // The new incarnation's region was rewritten by ublkd: it validates again. (The
    // status polls above may have caught the scribbled region before the worker's
    // exit was seen; only what is logged after the recovery counts.)
    ublkd.status_of(victim);
    let log = ublkd.log();
    let after = log.split_once("device recovered").map(|(_, after)| after).unwrap_or("");
    assert!(!after.is_empty(), "no recovery logged:\n{log}");
    assert!(!after.contains("failed validation"), "the region was not repaired:\n{log}");
    ublkd.stop();
}

/// Writes 16 MiB of random data over `dev` (past the page cache); their sha256.
fn fill_random(dev: &std::path::Path) -> String {
    run_ok(std::process::Command::new("dd").args([
        "if=/dev/urandom",
        &format!("of={}", dev.display()),
        "bs=1M",
        "count=16",
        "oflag=direct",
    ]));
    sha256(dev)
}

/// The region file of device `id` in the test's state dir.
fn region_file(name: &str, id: u32) -> PathBuf {
    PathBuf::from(format!("/run/ublkd-test-{name}/state/devices/{id}/shm"))
}

#[test]
fn a_new_ublkd_adopts_a_device_whose_region_generation_was_scribbled() {
    let _s = serial();
    let mut ublkd = Ublkd::start("adopt-scribbled");
    let id = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let dev = block_dev(id);
    let before = fill_random(&dev);
    // What a worker could have left: a valid header but for a generation (and
    // counters) at their maximum, which the next activation must not overflow.
    ublkd.sigkill_and_restart(|| {
        let region = std::fs::OpenOptions::new()
            .write(true)
            .open(region_file("adopt-scribbled", id))
            .expect("the device's region file");
        // The header: magic, version, sizes, geometry (32 bytes), then the generation
        // and the eight counters.
        region.write_all_at(&[0xff; 72], 32).unwrap();
    });
    ublkd.wait_until("the adopted device LIVE", || ublkd.status_of(id)["state"] == "LIVE");
    assert!(ublkd.alive(), "the new ublkd died:\n{}", ublkd.log());
    assert_eq!(sha256(&dev), before, "the device's data changed across the adoption");
    ublkd.stop();
}

#[test]
fn a_queue_thread_stuck_mid_turn_is_found_while_another_serves_on() {
    let _s = serial();
    let ublkd = hostile("stuck-thread", "stall-thread", 0, "hung_timeout_secs = 3");
    // One queue, two threads: either may take any of its requests.
    let id = ublkd.add(&["-t", "memory", "-s", "64M", "-q", "1", "--threads", "2"]);
    assert_eq!(id, 0, "the fault is aimed at device 0");
    let fio = verify_in_background(id, 32 * MIB);
    ublkd.wait_until("the stuck worker's recovery", || {
        ublkd.status_of(id)["recoveries"].as_u64() >= Some(1)
    });
    assert_fio_clean(&fio.join().expect("fio"), 1);
    let log = ublkd.log();
    let said = "attack stall-thread: queue thread ";
    let at = log.find(said).unwrap_or_else(|| panic!("no thread stopped:\n{log}")) + said.len();
    let thread: String = log[at..].chars().take_while(char::is_ascii_digit).collect();
    // The first recovery is the stuck thread's (under emulation on a busy host a later
    // one may follow).
    let first = log.lines().find(|l| l.contains("device recovered (")).unwrap_or_default();
    assert!(
        first.contains(&format!("queue thread {thread} has been stuck in one turn")),
        "recovered for another reason: {first}\n{log}"
    );
    assert_eq!(ublkd.status_of(id)["state"], "LIVE");
    ublkd.stop();
}

#[test]
fn a_worker_stopped_and_continued_briefly_serves_on() {
    let _s = serial();
    // What an operator's `kill -STOP`/`-CONT` or a debugger's attach does, for less than
    // the hung timeout: no recovery, no error, and no system call the sandbox refuses
    // when the kernel restarts the ones the stop interrupted.
    let ublkd = Ublkd::start("stop-cont");
    let id = ublkd.add(&["-t", "memory", "-s", "64M", "-q", "2", "--threads", "2"]);
    let worker = ublkd.worker_pid(id);
    let fio = verify_in_background(id, 48 * MIB);
    for _ in 0..5 {
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(process::signal(worker, libc::SIGSTOP));
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(process::signal(worker, libc::SIGCONT));
    }
    assert_fio_clean(&fio.join().expect("fio"), 1);
    let status = ublkd.status_of(id);
    assert_eq!(status["recoveries"], 0, "the worker was replaced: {status}\n{}", ublkd.log());
    assert_eq!(ublkd.worker_pid(id), worker);
    ublkd.stop();
}

#[test]
fn a_worker_waiting_for_a_slow_backend_is_not_killed_as_hung() {
    let _s = serial();
    // A loop device whose backing store (a memory device) takes its writes at 16 KiB/s:
    // each 64 KiB write waits ~4 s at the backend, longer than two hung timeouts, and
    // still completes. The worker waits for it, holding the request: not a hang.
    let ublkd = Ublkd::start_with("slow-backend", "\n[recovery]\nhung_timeout_secs = 1\n", &[]);
    let backing_id = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let backing = block_dev(backing_id);
    let id = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);
    let slow = WriteThrottle::new("ublkd-slow-backend", &backing, 16 * 1024);
    let worker = ublkd.worker_pid(id);
    slow.hold(worker);
    let started = std::time::Instant::now();
    run_ok(std::process::Command::new("dd").args([
        "if=/dev/urandom",
        &format!("of={}", block_dev(id).display()),
        "bs=64k",
        "count=2",
        "oflag=direct",
    ]));
    let took = started.elapsed();
    slow.release();
    assert!(took.as_secs() >= 6, "the backend was not slow ({took:?}): the test proves nothing");
    let status = ublkd.status_of(id);
    assert_eq!(status["recoveries"], 0, "a slow backend cost a recovery: {status}");
    assert_eq!(ublkd.worker_pid(id), worker);
    let log = ublkd.log();
    assert!(log.contains("the worker waits for its backend"), "{log}");
    assert!(log.contains("the backend completed I/O again"), "{log}");
    // The loop device goes before its backing device (it holds it open).
    ublkd.del(id);
    ublkd.stop();
}

/// The kernel could not register a request's pages in the worker's ring (zero copy):
/// what happens when a FETCH still delivers into a killed worker's ring after ublkd's
/// fast release dropped its buffer table. Made on purpose here: the worker drops its
/// own table before its first turn. The request must be delivered (the fallback flag),
/// not failed with EIO; the worker ends and the device recovers, with fio clean.
/// Without the fallback flag (`worker/src/queue/ring.rs`) fio gets EIO at once.
#[test]
fn a_request_whose_pages_cannot_be_registered_is_reissued_not_failed() {
    let _s = serial();
    let ublkd = hostile("zc-buffers", "drop-zero-copy-buffers", 7, "");
    let backing = PathBuf::from("/tmp/ublkd-zc-buffers.img");
    sparse_file(&backing, 64 * MIB);
    let victim = ublkd.add(&["-n", "7", "-t", "loop", "-f", backing.to_str().unwrap()]);
    let fio_victim = verify_in_background(victim, 32 * MIB);
    ublkd.wait_until("the victim's recovery", || {
        ublkd.status_of(victim)["recoveries"].as_u64() == Some(1)
    });
    assert_fio_clean(&fio_victim.join().expect("fio on the victim"), 1);
    let log = ublkd.log();
    assert!(log.contains("attack drop-zero-copy-buffers: buffer table dropped: done"), "{log}");
    assert!(log.contains("could not register the pages"), "{log}");
    assert_eq!(ublkd.status_of(victim)["state"], "LIVE");
    let _ = std::fs::remove_file(&backing);
    ublkd.stop();
}

/// A worker that tries to make ublkd wait on it: once serving, it fills its own control
/// socket's queue through the copy of ublkd's end it holds, fills ublkd's queue, steals
/// its stderr, and never reads again (`fill-control`), while its queue threads serve on.
/// ublkd's sends to it must never block: clients are answered meanwhile, the device is
/// deleted within its stop grace, and a new ublkd takes the other device over (the
/// worker killed, the device recovered) with its data intact.
#[test]
fn a_worker_that_stuffs_its_control_socket_cannot_make_ublkd_wait() {
    use std::time::{Duration, Instant};
    let _s = serial();
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let mut ublkd =
        Ublkd::start_with("fill-control", &extra, &[("UBLKD_WORKER_ATTACK", "fill-control")]);
    let kept = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let deleted = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let dev = block_dev(kept);
    let before = fill_random(&dev);
    ublkd.wait_until("both workers' attacks", || {
        ublkd.log().matches("attack fill-control: queued").count() == 2
    });
    let log = ublkd.log();
    let line = log.lines().find(|l| l.contains("attack fill-control: queued")).unwrap();
    assert!(!line.contains("queued 0 packets to itself"), "nothing was stuffed: {line}");
    for _ in 0..5 {
        let asked = Instant::now();
        ublkd.status();
        let took = asked.elapsed();
        assert!(took < Duration::from_secs(1), "status took {took:?}:\n{}", ublkd.log());
    }
    // `del` sends the worker Shutdown: a send that would block kills it instead.
    let asked = Instant::now();
    ublkd.del(deleted);
    let took = asked.elapsed();
    const STOP_GRACE: Duration = Duration::from_secs(5);
    assert!(took < STOP_GRACE + Duration::from_millis(1500), "del took {took:?}:\n{}", ublkd.log());
    assert!(ublkd.log().contains("does not take ublkd's messages"), "{}", ublkd.log());
    assert!(!kernel_devices().contains(&deleted), "device {deleted} is still in the kernel");
    // A new ublkd's takeover sends Attach to the stuffed worker.
    let signalled = Instant::now();
    ublkd.signal_and_restart(libc::SIGTERM, || {});
    loop {
        let out = ublkd.ctl(&["list"]);
        let listed = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && listed.contains("state LIVE") {
            break;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(10),
            "the device was not LIVE within 10 s of SIGTERM ({listed}):\n{}",
            ublkd.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = ublkd.status_of(kept);
    assert_eq!(status["state"], "LIVE", "{status}");
    assert!(status["recoveries"].as_u64() >= Some(1), "the stuffed worker was kept: {status}");
    assert_eq!(sha256(&dev), before, "the device's data changed");
    ublkd.stop();
}

/// A worker that takes its activation and never answers it (`silent-activation`: the
/// worker a recovery hands one device to). ublkd waits for it on no turn: clients are
/// answered in under 1 s throughout, another device's worker kill recovers with its
/// usual stall, and once the activation's time is up (`worker_ready_timeout_secs`, set
/// short here: the default 30 s is only waited out) the device waits for an operator,
/// whose `ublkctl recover` serves it again with its data intact.
#[test]
fn a_worker_that_never_answers_its_activation_holds_up_nothing_else() {
    use std::time::{Duration, Instant};
    use ublkd_tests::harness::ublkd::StatusProber;
    const READY_TIMEOUT: Duration = Duration::from_secs(10);
    let _s = serial();
    let limit = format!("worker_ready_timeout_secs = {}", READY_TIMEOUT.as_secs());
    let mut ublkd = hostile("silent-activation", "silent-activation", 3, &limit);
    let bystander = ublkd.add(&["-n", "2", "-t", "memory", "-s", "16M"]);
    let victim = ublkd.add(&["-n", "3", "-t", "memory", "-s", "16M"]);
    let dev = block_dev(victim);
    let before = fill_random(&dev);
    let prober = StatusProber::start(&ublkd.ctl);
    let killed = Instant::now();
    assert!(process::signal(ublkd.worker_pid(victim), libc::SIGKILL));
    ublkd.wait_until("the silent worker", || {
        ublkd.log().contains("attack silent-activation: generation 2 will not answer")
    });
    // Another device's recovery goes on while the silent worker is awaited.
    let pid = ublkd.worker_pid(bystander);
    assert!(process::signal(pid, libc::SIGKILL));
    ublkd.wait_until("the bystander's recovery", || {
        ublkd.status_of(bystander)["recoveries"].as_u64() == Some(1)
    });
    let stall = ublkd.stall_after_kill(pid);
    assert!(stall < 2_000, "the bystander's recovery stalled {stall} ms:\n{}", ublkd.log());
    assert!(
        killed.elapsed() < READY_TIMEOUT,
        "the bystander recovered only after the silent worker's deadline"
    );
    let status = ublkd.status_of(victim);
    assert_ne!(status["state"], "LIVE", "the silent worker serves? {status}");
    // At its deadline the activation ends, and the device waits for an operator.
    ublkd.wait_until("the activation's deadline", || {
        ublkd.status_of(victim)["note"].as_str().is_some_and(|n| n.contains("did not answer"))
    });
    let waited = killed.elapsed();
    assert!(waited >= READY_TIMEOUT, "the activation ended after {waited:?}");
    let slowest = prober.finish();
    assert!(slowest < Duration::from_secs(1), "status took {slowest:?}:\n{}", ublkd.log());
    ublkd.ctl_ok(&["recover", &victim.to_string()]);
    let status = ublkd.status_of(victim);
    assert_eq!(status["state"], "LIVE", "{status}");
    assert_eq!(sha256(&dev), before, "the device's data changed");
    assert!(ublkd.alive(), "ublkd died:\n{}", ublkd.log());
    ublkd.stop();
}

/// While a kernel call waits on a hostile worker: `ublkctl list`'s request asked in a
/// loop on ublkd's socket (each answer's time kept: the request itself, as starting the
/// ublkctl binary alone takes 1-2 s under emulation) and a bystander device written and
/// synced in a loop (each round's time kept), until stopped.
struct Meanwhile {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    lists: JoinHandle<Vec<std::time::Duration>>,
    ios: JoinHandle<Vec<std::time::Duration>>,
}

impl Meanwhile {
    fn start(ublkd: &Ublkd, bystander: u32) -> Meanwhile {
        use std::sync::atomic::Ordering;
        use std::time::{Duration, Instant};
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (socket, done) = (ublkd.ctl.socket.clone(), std::sync::Arc::clone(&stop));
        let lists = std::thread::spawn(move || {
            use ublkd_proto::msg::{CtlRequest, CtlResponse};
            let mut times = Vec::new();
            while !done.load(Ordering::SeqCst) {
                let asked = Instant::now();
                let answer = ask(&socket, &CtlRequest::List { id: None });
                assert!(matches!(answer, Ok(CtlResponse::List(_))), "list: {answer:?}");
                times.push(asked.elapsed());
                std::thread::sleep(Duration::from_millis(50));
            }
            times
        });
        let done = std::sync::Arc::clone(&stop);
        let ios = std::thread::spawn(move || {
            let dev = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(block_dev(bystander))
                .expect("open the bystander");
            let mut times = Vec::new();
            let mut round: u64 = 0;
            while !done.load(Ordering::SeqCst) {
                let began = Instant::now();
                let block = [(round % 251) as u8; 4096];
                let at = (round % 1024) * 4096;
                dev.write_all_at(&block, at).expect("write the bystander");
                dev.sync_data().expect("sync the bystander");
                let mut back = [0u8; 4096];
                dev.read_exact_at(&mut back, at).expect("read the bystander");
                assert_eq!(back, block, "the bystander read back other data");
                times.push(began.elapsed());
                round += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            times
        });
        Meanwhile { stop, lists, ios }
    }

    /// Stops both loops and checks them: every list answered in under 1 s,
    /// and the bystander's I/O went on (`at_least` rounds, none over 2 s).
    fn finish(self, ublkd: &Ublkd, at_least: usize) {
        use std::time::Duration;
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let lists = self.lists.join().expect("the list loop failed");
        let ios = self.ios.join().expect("the bystander's I/O failed");
        let slowest = lists.iter().max().copied().unwrap_or_default();
        assert!(lists.len() >= at_least, "ublkd answered {} lists", lists.len());
        assert!(
            slowest < Duration::from_secs(1),
            "a list took {slowest:?} (of {} asked):\n{}",
            lists.len(),
            ublkd.log()
        );
        let slowest_io = ios.iter().max().copied().unwrap_or_default();
        assert!(ios.len() >= at_least, "the bystander did {} rounds of I/O", ios.len());
        assert!(slowest_io < Duration::from_secs(2), "a bystander round took {slowest_io:?}");
    }
}

/// A worker that answers its activation Ready without fetching a tag
/// (`ready-no-fetch`: the first worker of an added device). START_DEV waits in the
/// kernel until every tag is fetched; ublkd runs it off its loop, so `ublkctl list`
/// answers in under 1 s throughout and another device's I/O goes on; at the deadline
/// (`worker_ready_timeout_secs`) the worker is killed, START_DEV interrupted, and the
/// add refused naming the worker and what it failed to do, its device deleted.
#[test]
fn a_worker_that_never_fetches_its_tags_cannot_hold_up_ublkd_while_its_device_is_added() {
    use std::time::{Duration, Instant};
    const READY_TIMEOUT: Duration = Duration::from_secs(10);
    let _s = serial();
    let limit = format!("worker_ready_timeout_secs = {}", READY_TIMEOUT.as_secs());
    let mut ublkd = hostile("ready-no-fetch", "ready-no-fetch", 5, &limit);
    let bystander = ublkd.add(&["-n", "4", "-t", "memory", "-s", "16M"]);
    let meanwhile = Meanwhile::start(&ublkd, bystander);
    let asked = Instant::now();
    let ctl = ublkd.ctl.clone();
    let add = std::thread::spawn(move || {
        ctl.run_within(&["add", "-n", "5", "-t", "memory", "-s", "16M"], Duration::from_secs(90))
    });
    // While START_DEV waits, status says so.
    ublkd.wait_until("START_DEV waiting on the worker", || {
        ublkd.ctl.device(5).is_ok_and(|d| {
            d["note"].as_str().is_some_and(|n| n.contains("START_DEV waits for its first worker"))
        })
    });
    // ublkctl itself answers meanwhile (its own start is not timed: see `Meanwhile`).
    assert!(ublkd.ctl_ok(&["list"]).contains("dev id 4"), "the bystander is not listed");
    let out = add.join().expect("the add's thread").expect("ublkctl add");
    let took = asked.elapsed();
    meanwhile.finish(&ublkd, 20);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the add succeeded: {out:?}");
    assert!(
        stderr.contains("answered its activation but did not fetch its tags within 10 s"),
        "{stderr}\n{}",
        ublkd.log()
    );
    assert!(stderr.contains("START_DEV"), "{stderr}");
    assert!(took >= READY_TIMEOUT, "refused after {took:?}");
    let log = ublkd.log();
    assert!(log.contains("attack ready-no-fetch: generation 1 answers Ready"), "{log}");
    assert!(!kernel_devices().contains(&5), "the refused device is left in the kernel");
    assert!(ublkd.ctl.device(5).is_err(), "the refused device is still listed");
    assert_eq!(ublkd.status_of(bystander)["state"], "LIVE");
    assert!(ublkd.alive(), "ublkd died:\n{log}");
    ublkd.stop();
}

/// The same worker as a recovery's (`ready-no-fetch-recovery`: the second worker of
/// one device). END_USER_RECOVERY waits for its tags off the loop, status saying so;
/// at the deadline the worker is killed and the recovery starts over with a new worker,
/// which serves the device with its data intact. Clients and another device are served
/// throughout.
#[test]
fn a_recovery_whose_worker_never_fetches_its_tags_starts_over_and_recovers() {
    use std::time::Duration;
    const READY_TIMEOUT: Duration = Duration::from_secs(10);
    let _s = serial();
    let limit = format!("worker_ready_timeout_secs = {}", READY_TIMEOUT.as_secs());
    let mut ublkd = hostile("ready-no-fetch-recovery", "ready-no-fetch-recovery", 7, &limit);
    let bystander = ublkd.add(&["-n", "6", "-t", "memory", "-s", "16M"]);
    let victim = ublkd.add(&["-n", "7", "-t", "memory", "-s", "16M"]);
    let dev = block_dev(victim);
    let before = fill_random(&dev);
    let meanwhile = Meanwhile::start(&ublkd, bystander);
    let killed = ublkd.worker_pid(victim);
    assert!(process::signal(killed, libc::SIGKILL));
    ublkd.wait_until("END_USER_RECOVERY waiting on the worker", || {
        ublkd.status_of(victim)["note"]
            .as_str()
            .is_some_and(|n| n.contains("END_USER_RECOVERY waits for worker"))
    });
    assert!(ublkd.ctl_ok(&["list"]).contains("dev id 6"), "the bystander is not listed");
    ublkd.wait_until("the recovery with a new worker", || {
        let status = ublkd.status_of(victim);
        status["state"] == "LIVE" && status["recoveries"].as_u64() == Some(1)
    });
    meanwhile.finish(&ublkd, 20);
    let log = ublkd.log();
    assert!(log.contains("attack ready-no-fetch-recovery: generation 2 answers Ready"), "{log}");
    assert!(
        log.contains(
            "answered its activation but did not fetch its tags within 10 s \
             (END_USER_RECOVERY waited for them)"
        ),
        "{log}"
    );
    let status = ublkd.status_of(victim);
    assert_ne!(status["worker_pid"].as_u64(), Some(u64::from(killed)), "{status}");
    assert_eq!(sha256(&dev), before, "the device's data changed");
    assert_eq!(ublkd.status_of(bystander)["recoveries"], 0, "the bystander was touched");
    assert!(ublkd.alive(), "ublkd died:\n{log}");
    ublkd.stop();
}
