//! Churn, as fleets of sandboxes and CI runners make it (in the VM): clients add a
//! memory device, write 1 MiB, read it back and delete the device, again and again,
//! while a killer SIGKILLs a random worker process (serving, standing by or starting)
//! every 0.7 s, until the killer has struck [`KILLS`] times and every client has done
//! [`MIN_ROUNDS`] rounds. Every add must succeed (a worker killed while its device is being
//! added is replaced, not reported to the client), no I/O may fail or return other
//! data, no command may hang, and afterwards no kernel device, worker process or
//! state-dir record may be left.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ublkd_tests::prng::{Prng, chaos_seed};

use ublkd_tests::harness::machine::{
    added_id, block_dev, kernel_devices, serial, wait_for_path, worker_pids,
};
use ublkd_tests::harness::process::{self, describe, signal};
use ublkd_tests::harness::storage::pattern;
use ublkd_tests::harness::ublkd::{Ctl, Ublkd};

const CLIENTS: u64 = 3;
/// The churn ends once the killer has struck this often (a worker of every kind:
/// serving, standing by, starting) ...
const KILLS: usize = 80;
/// ... and every client has added, used and deleted this many devices. Past KILLS,
/// more rounds only repeat what was shown: the count of rounds was fixed before (102
/// in all), and took twice as long for the same kills.
const MIN_ROUNDS: u64 = 10;
/// A bound only: the churn ends at KILLS, long before this many rounds.
const MAX_ROUNDS: u64 = 200;
const MIB: usize = 1 << 20;
/// The longest one `ublkctl` command may take before it counts as hanging.
const HANGING: Duration = Duration::from_secs(30);
/// The longest one command (`ublkctl`, `dd`) may take before it is killed and the
/// client stops: a hang is reported, with what the machine looked like, rather than
/// run into the VM's timeout.
const HUNG: Duration = Duration::from_secs(90);
/// The longest the whole churn may take (about a minute in a TCG VM).
const WHOLE: Duration = Duration::from_secs(600);

/// What a hang looked like: status, the workers, the kernel's devices, the processes
/// blocked in the kernel, and the tail of ublkd's log.
fn snapshot(ctl: &Ctl, log: &str) -> String {
    let status = match ctl.run_within(&["status"], Duration::from_secs(10)) {
        Ok(out) => describe(&out),
        Err(e) => e,
    };
    let blocked: Vec<String> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let state = stat.rsplit(") ").next()?.chars().next()?;
            (state == 'D').then(|| {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                let wchan =
                    std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
                format!("{pid} {} in {wchan}", comm.trim_end())
            })
        })
        .collect();
    let tail: Vec<&str> =
        log.lines().rev().take(150).collect::<Vec<_>>().into_iter().rev().collect();
    format!(
        "--- status\n{status}\n--- workers {:?}\n--- kernel devices {:?}\n--- blocked (D) {blocked:?}\n--- ublkd log (tail)\n{}",
        worker_pids(),
        kernel_devices(),
        tail.join("\n")
    )
}

/// One client's rounds; what went wrong, one line each. A command that hangs ends
/// the client's rounds.
fn client(
    ctl: &Ctl,
    client: u64,
    enough: &AtomicBool,
    failures: &Mutex<Vec<String>>,
    log: &dyn Fn() -> String,
) -> u64 {
    let fail = |what: String| failures.lock().unwrap().push(format!("client {client}: {what}"));
    let hung = |round: u64, e: String| {
        fail(format!("round {round}: {e}\n{}", snapshot(ctl, &log())));
    };
    let input = PathBuf::from(format!("/tmp/ublkd-churn-{client}.in"));
    let output = PathBuf::from(format!("/tmp/ublkd-churn-{client}.out"));
    let mut rounds = 0;
    for round in 0..MAX_ROUNDS {
        if round >= MIN_ROUNDS && enough.load(Ordering::SeqCst) {
            break;
        }
        rounds = round + 1;
        let data = pattern(client << 32 | round, MIB);
        std::fs::write(&input, &data).unwrap();
        let asked = Instant::now();
        let added = match ctl.run_within(&["add", "-t", "memory", "-s", "1M"], HUNG) {
            Ok(out) => out,
            Err(e) => {
                hung(round, e);
                return rounds;
            }
        };
        if asked.elapsed() > HANGING {
            fail(format!("round {round}: add took {:?}", asked.elapsed()));
        }
        if !added.status.success() {
            fail(format!("round {round}: add failed: {}", describe(&added)));
            continue;
        }
        let id = added_id(&String::from_utf8_lossy(&added.stdout));
        let dev = block_dev(id);
        wait_for_path(&dev);
        let dd = |from: &PathBuf, to: &PathBuf, flag: &str| {
            process::run_within(
                Command::new("dd").args([
                    &format!("if={}", from.display()),
                    &format!("of={}", to.display()),
                    "bs=1M",
                    "count=1",
                    flag,
                ]),
                HUNG,
            )
        };
        let wrote = match dd(&input, &dev, "oflag=direct") {
            Ok(out) => out,
            Err(e) => {
                hung(round, format!("device {id}: write: {e}"));
                return rounds;
            }
        };
        let read = match dd(&dev, &output, "iflag=direct") {
            Ok(out) => out,
            Err(e) => {
                hung(round, format!("device {id}: read: {e}"));
                return rounds;
            }
        };
        for (what, out) in [("write", &wrote), ("read", &read)] {
            if !out.status.success() {
                fail(format!("round {round}: device {id}: {what} failed: {}", describe(out)));
            }
        }
        if read.status.success() && std::fs::read(&output).unwrap() != data {
            fail(format!("round {round}: device {id} read back other data"));
        }
        let asked = Instant::now();
        let deleted = match ctl.run_within(&["del", "-n", &id.to_string()], HUNG) {
            Ok(out) => out,
            Err(e) => {
                hung(round, format!("del {id}: {e}"));
                return rounds;
            }
        };
        if asked.elapsed() > HANGING {
            fail(format!("round {round}: del took {:?}", asked.elapsed()));
        }
        if !deleted.status.success() {
            fail(format!("round {round}: del {id} failed: {}", describe(&deleted)));
        }
    }
    let _ = std::fs::remove_file(&input);
    let _ = std::fs::remove_file(&output);
    rounds
}

#[test]
fn clients_adding_and_deleting_devices_while_workers_are_killed_lose_nothing() {
    let _s = serial();
    let seed = chaos_seed(30);
    eprintln!("churn seed {seed} (UBLKD_CHAOS_SEED={seed} replays it)");
    // Deaths from the killer, not crashes: a budget that never runs out.
    let ublkd = Ublkd::start_with("churn", "\n[recovery]\nrestart_max = 1000\n", &[]);
    let done = Arc::new(AtomicBool::new(false));
    let enough = Arc::new(AtomicBool::new(false));
    let kills = Arc::new(AtomicUsize::new(0));
    let killer = {
        let (done, enough, kills) = (Arc::clone(&done), Arc::clone(&enough), Arc::clone(&kills));
        std::thread::spawn(move || {
            let mut prng = Prng::new(seed);
            // Once KILLS are struck the killer stops: the clients still short of
            // MIN_ROUNDS finish them alone, and a killer left with one client's workers
            // to pick from would kill each of its adds' workers in turn (its 10
            // attempts spent in a few seconds on a loaded machine), which proves
            // nothing about churn.
            while !done.load(Ordering::SeqCst) && !enough.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(700));
                let pids = worker_pids();
                if pids.is_empty() {
                    continue;
                }
                let pid = pids[(prng.next_u64() % pids.len() as u64) as usize];
                if signal(pid, libc::SIGKILL) && kills.fetch_add(1, Ordering::SeqCst) + 1 >= KILLS {
                    enough.store(true, Ordering::SeqCst);
                }
            }
        })
    };
    let failures = Mutex::new(Vec::new());
    let started = Instant::now();
    let log = || ublkd.log();
    let clients_done = AtomicBool::new(false);
    let mut rounds = 0;
    std::thread::scope(|scope| {
        // Past WHOLE, what the machine looks like is printed and the test process
        // ends: the VM's own timeout would tell nothing.
        scope.spawn(|| {
            while !clients_done.load(Ordering::SeqCst) {
                if started.elapsed() > WHOLE {
                    let so_far = failures.lock().unwrap().clone();
                    eprintln!(
                        "churn still running after {WHOLE:?}; {} failures so far:\n{}\n{}",
                        so_far.len(),
                        so_far.join("\n"),
                        snapshot(&ublkd.ctl, &ublkd.log())
                    );
                    std::process::exit(101);
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        });
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let (ctl, enough, failures, log) = (ublkd.ctl.clone(), &enough, &failures, &log);
                scope.spawn(move || client(&ctl, c, enough, failures, log))
            })
            .collect();
        for c in clients {
            rounds += c.join().unwrap_or(0);
        }
        clients_done.store(true, Ordering::SeqCst);
    });
    done.store(true, Ordering::SeqCst);
    killer.join().unwrap();
    let took = started.elapsed();
    let kills = kills.load(Ordering::SeqCst);
    let failures = failures.into_inner().unwrap();
    eprintln!("{rounds} rounds in {took:?}, {kills} workers killed, {} failures", failures.len());
    assert!(failures.is_empty(), "{}\n--- ublkd log\n{}", failures.join("\n"), ublkd.log());
    assert!(kills >= KILLS, "only {kills} workers were killed: the churn proves little");
    assert!(rounds >= CLIENTS * MIN_ROUNDS, "only {rounds} rounds: a client stopped early");
    let listed = ublkd.ctl_ok(&["list"]);
    assert!(listed.trim().is_empty(), "devices left listed:\n{listed}");
    assert!(kernel_devices().is_empty(), "kernel devices left: {:?}", kernel_devices());
    let records =
        std::fs::read_dir("/run/ublkd-test-churn/state/devices").map(|d| d.count()).unwrap_or(0);
    assert_eq!(records, 0, "state-dir records left");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !worker_pids().is_empty() {
        assert!(Instant::now() < deadline, "worker processes left: {:?}", worker_pids());
        std::thread::sleep(Duration::from_millis(50));
    }
    ublkd.stop();
}
