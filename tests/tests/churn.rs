//! Churn, as fleets of sandboxes and CI runners make it (in the VM): clients add a
//! memory device, write 1 MiB, read it back and delete the device, again and again,
//! while a killer SIGKILLs a random worker process (serving, standing by or starting)
//! every 0.7 s. Every add must succeed (a worker killed while its device is being
//! added is replaced, not reported to the client), no I/O may fail or return other
//! data, no command may hang, and afterwards no kernel device, worker process or
//! state-dir record may be left.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ublkd_tests::prng::{Prng, chaos_seed};

use common::{
    Ctl, Ublkd, block_dev, describe, kernel_devices, pattern, serial, signal, wait_for_path,
    worker_pids,
};

const CLIENTS: u64 = 3;
const ROUNDS: u64 = 100;
const MIB: usize = 1 << 20;
/// The longest one `ublkctl` command may take before it counts as hanging.
const HANGING: Duration = Duration::from_secs(30);

/// One client's rounds; what went wrong, one line each.
fn client(ctl: &Ctl, client: u64, failures: &Mutex<Vec<String>>) {
    let fail = |what: String| failures.lock().unwrap().push(format!("client {client}: {what}"));
    let input = PathBuf::from(format!("/tmp/ublkd-churn-{client}.in"));
    let output = PathBuf::from(format!("/tmp/ublkd-churn-{client}.out"));
    for round in 0..ROUNDS {
        let data = pattern(client << 32 | round, MIB);
        std::fs::write(&input, &data).unwrap();
        let asked = Instant::now();
        let added = ctl.run(&["add", "-t", "memory", "-s", "1M"]);
        if asked.elapsed() > HANGING {
            fail(format!("round {round}: add took {:?}", asked.elapsed()));
        }
        if !added.status.success() {
            fail(format!("round {round}: add failed: {}", describe(&added)));
            continue;
        }
        let id: u32 = String::from_utf8_lossy(&added.stdout).trim().parse().unwrap();
        let dev = block_dev(id);
        wait_for_path(&dev);
        let dd = |from: &PathBuf, to: &PathBuf, flag: &str| {
            common::run(Command::new("dd").args([
                &format!("if={}", from.display()),
                &format!("of={}", to.display()),
                "bs=1M",
                "count=1",
                flag,
            ]))
        };
        let wrote = dd(&input, &dev, "oflag=direct");
        let read = dd(&dev, &output, "iflag=direct");
        for (what, out) in [("write", &wrote), ("read", &read)] {
            if !out.status.success() {
                fail(format!("round {round}: device {id}: {what} failed: {}", describe(out)));
            }
        }
        if read.status.success() && std::fs::read(&output).unwrap() != data {
            fail(format!("round {round}: device {id} read back other data"));
        }
        let asked = Instant::now();
        let deleted = ctl.run(&["del", "-n", &id.to_string()]);
        if asked.elapsed() > HANGING {
            fail(format!("round {round}: del took {:?}", asked.elapsed()));
        }
        if !deleted.status.success() {
            fail(format!("round {round}: del {id} failed: {}", describe(&deleted)));
        }
    }
    let _ = std::fs::remove_file(&input);
    let _ = std::fs::remove_file(&output);
}

#[test]
fn clients_adding_and_deleting_devices_while_workers_are_killed_lose_nothing() {
    let _s = serial();
    let seed = chaos_seed(30);
    eprintln!("churn seed {seed} (UBLKD_CHAOS_SEED={seed} replays it)");
    // Deaths from the killer, not crashes: a budget that never runs out.
    let ublkd = Ublkd::start_with("churn", "\n[recovery]\nrestart_max = 1000\n", &[]);
    let done = Arc::new(AtomicBool::new(false));
    let kills = Arc::new(AtomicUsize::new(0));
    let killer = {
        let (done, kills) = (Arc::clone(&done), Arc::clone(&kills));
        std::thread::spawn(move || {
            let mut prng = Prng::new(seed);
            while !done.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(700));
                let pids = worker_pids();
                if pids.is_empty() {
                    continue;
                }
                let pid = pids[(prng.next_u64() % pids.len() as u64) as usize];
                if signal(pid, libc::SIGKILL) {
                    kills.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
    };
    let failures = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for c in 0..CLIENTS {
            let (ctl, failures) = (ublkd.ctl.clone(), &failures);
            scope.spawn(move || client(&ctl, c, failures));
        }
    });
    done.store(true, Ordering::SeqCst);
    killer.join().unwrap();
    let took = started.elapsed();
    let kills = kills.load(Ordering::SeqCst);
    let failures = failures.into_inner().unwrap();
    eprintln!(
        "{} rounds in {took:?}, {kills} workers killed, {} failures",
        CLIENTS * ROUNDS,
        failures.len()
    );
    assert!(failures.is_empty(), "{}\n--- ublkd log\n{}", failures.join("\n"), ublkd.log());
    assert!(kills >= 50, "only {kills} workers were killed: the churn proves little");
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
