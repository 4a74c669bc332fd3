//! A restart of ublkd never breaks a device: SIGTERM (what `systemctl restart` sends)
//! leaves every device in the kernel, configured or added at run time, and its worker
//! serving; the next ublkd takes the workers over. Deleting is explicit: `ublkctl del`
//! or `ublkctl shutdown`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ublkd_tests::harness::fio::{Fio, assert_fio_clean, fio_args, fio_verify_args};
use ublkd_tests::harness::machine::{
    added_id, block_dev, kernel_devices, serial, wait_for_path, worker_pids,
};
use ublkd_tests::harness::process::{bin, describe, run, run_ok, signal};
use ublkd_tests::harness::storage::{Mount, pattern, sha256, sparse_file, write_file, write_files};
use ublkd_tests::harness::ublkd::{StatusProber, Ublkd, ask};

const MIB: u64 = 1 << 20;

/// Reads and writes device `id` has completed (`/sys/block/ublkbN/stat`, fields 1
/// and 5).
fn ios_completed(id: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/sys/block/ublkb{id}/stat")).unwrap();
    let field =
        |n: usize| -> u64 { stat.split_ascii_whitespace().nth(n).unwrap().parse().unwrap() };
    field(0) + field(4)
}

fn fsck_clean(dev: &Path) {
    let fsck = run(Command::new("fsck.ext4").arg("-fn").arg(dev));
    assert_eq!(fsck.status.code(), Some(0), "fsck.ext4 -fn found problems:\n{}", describe(&fsck));
}

#[test]
fn sigterm_keeps_every_device_and_the_next_ublkd_serves_them_with_no_io_error() {
    let _serial = serial();
    let name = "restart";
    let backing = PathBuf::from("/tmp/restart-loop.img");
    sparse_file(&backing, 64 * MIB);
    let mnt = PathBuf::from("/tmp/restart-mnt");
    let configured = "[[device]]\nid = 0\ntarget = \"memory\"\nsize = \"64M\"\n";
    let mut ublkd = Ublkd::start_with(name, configured, &[]);
    ublkd.wait_until("the configured device LIVE", || ublkd.status_of(0)["state"] == "LIVE");
    let fs_dev = block_dev(0);
    let added = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);

    // A filesystem with files on the configured device, mounted across the restarts.
    run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&fs_dev));
    let mount = Mount::new(&fs_dev, &mnt);
    let files = write_files(&mnt, 7);
    let sums =
        |root: &Path| -> Vec<String> { files.iter().map(|f| sha256(&root.join(f))).collect() };
    let written = sums(&mnt);

    // fio writing the runtime-added device at a bounded rate, so that its write phase
    // spans both restarts, then verifying every block.
    let fio_args = |name: &str| {
        let mut args = fio_verify_args(name, &block_dev(added), "randwrite", 1, 32 * MIB);
        args.push("--rate=2m".into());
        args
    };
    let args = fio_args("restart");
    let fio = std::thread::spawn(move || Fio::run(args));
    std::thread::sleep(Duration::from_secs(1));

    let workers = [ublkd.worker_pid(0), ublkd.worker_pid(added)];
    for (round, signal) in ["SIGTERM", "SIGINT"].into_iter().enumerate() {
        let sig = if signal == "SIGTERM" { libc::SIGTERM } else { libc::SIGINT };
        // While no ublkd runs, the workers serve: fio's I/O completes.
        ublkd.signal_and_restart(sig, || {
            let before = ios_completed(added);
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while ios_completed(added) <= before {
                assert!(std::time::Instant::now() < deadline, "no I/O completed without ublkd");
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        for id in [0, added] {
            ublkd.wait_until(&format!("device {id} LIVE after {signal}"), || {
                ublkd.status_of(id)["state"] == "LIVE"
            });
        }
        // More files while the device is served by the new ublkd.
        write_file(&mnt.join(format!("after-{round}")), &pattern(100 + round as u64, 777_777));
    }
    let job = fio.join().expect("fio thread").unwrap_or_else(|e| panic!("{e}\n{}", ublkd.log()));
    assert!(job.write_bytes > 0 && job.read_bytes > 0, "fio did no I/O: {job:?}");
    eprintln!("restart: longest fio completion across two restarts {:?}", job.clat_max);
    // Each new ublkd took the serving workers over: the same processes, no recovery.
    let log = ublkd.log();
    assert_eq!([ublkd.worker_pid(0), ublkd.worker_pid(added)], workers, "workers changed:\n{log}");
    for id in [0, added] {
        let status = ublkd.status_of(id);
        assert_eq!(status["recoveries"], 0, "device {id} was recovered:\n{log}");
        // What the worker reported of its sandbox survives the take-over.
        assert_eq!(status["sandbox"]["seccomp"], "filter", "{status}");
        assert!(status["sandbox"]["landlock"].as_str().unwrap().starts_with("ABI "), "{status}");
    }
    assert_eq!(log.matches("event=\"taken_over\"").count(), 4, "{log}");

    // Everything reads back from the device, not the page cache; the filesystem is clean.
    assert_eq!(sums(&mnt), written);
    run_ok(&mut Command::new("sync"));
    mount.umount();
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    fsck_clean(&fs_dev);
    let mount = Mount::new(&fs_dev, &mnt);
    assert_eq!(sums(&mnt), written, "files changed across the restarts");
    for round in 0..2u64 {
        let data = std::fs::read(mnt.join(format!("after-{round}"))).unwrap();
        assert!(data == pattern(100 + round, 777_777), "after-{round} changed");
    }
    mount.umount();
    let log = ublkd.log();
    assert!(!log.contains(" ERROR "), "ublkd logged an error:\n{log}");
    ublkd.stop();
}

#[test]
fn shutdown_deletes_every_device_and_stops_ublkd_and_del_stays_explicit() {
    let _serial = serial();
    let mut ublkd = Ublkd::start("shutdown");
    let a = ublkd.add(&["-t", "null", "-s", "16M"]);
    let b = ublkd.add(&["-t", "memory", "-s", "16M"]);
    // SIGTERM keeps both; `del` deletes exactly one.
    ublkd.signal_and_restart(libc::SIGTERM, || {});
    ublkd.wait_until("both devices LIVE", || {
        ublkd.status_of(a)["state"] == "LIVE" && ublkd.status_of(b)["state"] == "LIVE"
    });
    ublkd.del(a);
    assert_eq!(kernel_devices(), [b].into(), "del removed the wrong devices");
    // `shutdown` deletes the rest and ublkd exits 0 with nothing left (asserted by stop).
    let log = ublkd.stop();
    assert!(log.contains("shutdown requested: deleting 1 device(s), then exiting"), "{log}");
}

/// Copies `from` to `to` through a new file (a new inode, as a package upgrade's
/// rename leaves), executable.
fn install_binary(from: &Path, to: &Path) {
    let tmp = to.with_extension("new");
    std::fs::copy(from, &tmp).unwrap();
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, to).unwrap();
}

/// The inode of the file a process runs.
fn exe_inode(pid: u32) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(format!("/proc/{pid}/exe")).unwrap())
}

#[test]
fn upgrade_moves_every_device_to_the_binary_on_disk_while_fio_verifies() {
    let _serial = serial();
    let name = "upgrade";
    let worker = PathBuf::from("/tmp/upgrade-worker/ublkd-worker");
    std::fs::create_dir_all(worker.parent().unwrap()).unwrap();
    install_binary(&bin("ublkd-worker"), &worker);
    let backing = PathBuf::from("/tmp/upgrade-loop.img");
    sparse_file(&backing, 32 * MIB);
    let extra = format!("worker_binary = \"{}\"\n", worker.display());
    let ublkd = Ublkd::start_with(name, &extra, &[]);
    let memory = ublkd.add(&["-t", "memory", "-s", "32M"]);
    let looped = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);

    // A broken binary on disk: the upgrade fails, says why, and changes nothing.
    std::fs::write(worker.with_extension("new"), "#!/bin/sh\nexit 1\n").unwrap();
    std::fs::set_permissions(
        worker.with_extension("new"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::rename(worker.with_extension("new"), &worker).unwrap();
    let before = [ublkd.worker_pid(memory), ublkd.worker_pid(looped)];
    let out = ublkd.ctl(&["upgrade", "-n", &memory.to_string()]);
    let text = describe(&out);
    assert_eq!(out.status.code(), Some(1), "a broken binary was not refused: {text}");
    assert!(text.contains("did not start") && text.contains("the old worker serves on"), "{text}");
    assert_eq!(ublkd.worker_pid(memory), before[0], "a failed upgrade replaced the worker");
    assert_eq!(ublkd.status_of(memory)["state"], "LIVE");

    // The real binary, as a new file: every device moves to it under fio verify.
    install_binary(&bin("ublkd-worker"), &worker);
    let new_inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&worker).unwrap());
    let fios: Vec<_> = [memory, looped]
        .into_iter()
        .map(|id| {
            let mut args =
                fio_verify_args(&format!("up{id}"), &block_dev(id), "randwrite", 1, 16 * MIB);
            args.push("--rate=2m".into());
            std::thread::spawn(move || Fio::run(args))
        })
        .collect();
    // A third device whose worker is killed while the first is being upgraded: ublkd
    // recovers it between two devices of the upgrade, not after all of them.
    let bystander = ublkd.add(&["-t", "null", "-s", "16M"]);
    let victim = ublkd.worker_pid(bystander);
    std::thread::sleep(Duration::from_secs(2));
    // Killed as soon as the first device's new worker appears: mid-upgrade of device 0.
    let known = worker_pids();
    let killer = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while worker_pids().iter().all(|p| known.contains(p)) {
            assert!(std::time::Instant::now() < deadline, "no new worker within 20 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        signal(victim, libc::SIGKILL)
    });
    let out = ublkd.ctl(&["upgrade", "-a"]);
    let text = describe(&out);
    assert!(out.status.success(), "ublkctl upgrade -a failed: {text}\n{}", ublkd.log());
    assert!(killer.join().unwrap(), "the bystander's worker was gone before the kill");
    eprintln!("upgrade: {text}");
    for id in [memory, looped, bystander] {
        assert!(text.contains(&format!("device {id}: upgraded to")), "{text}");
    }
    let log = ublkd.log();
    let recovered = log
        .lines()
        .position(|l| l.contains(&format!("device recovered (worker {victim} killed")))
        .unwrap_or_else(|| panic!("no recovery from the kill:\n{log}"));
    // Before the next device's upgrade, not during the upgrade of its own device.
    let next = log
        .lines()
        .position(|l| l.contains("event=\"upgraded\"") && l.contains(&format!("dev_id={looped} ")))
        .unwrap_or_else(|| panic!("no upgrade of device {looped}:\n{log}"));
    assert!(recovered < next, "the dead worker waited for the upgrade of the rest:\n{log}");
    for fio in fios {
        let job =
            fio.join().expect("fio thread").unwrap_or_else(|e| panic!("{e}\n{}", ublkd.log()));
        eprintln!("upgrade: fio {}: longest completion {:?}", job.name, job.clat_max);
    }
    for id in [memory, looped, bystander] {
        let status = ublkd.status_of(id);
        assert_eq!(status["state"], "LIVE", "{status}");
        let pid = ublkd.worker_pid(id);
        assert_eq!(exe_inode(pid), new_inode, "device {id}'s worker {pid} runs an old binary");
    }
    ublkd.stop();
}

/// `ublkctl upgrade -a` of 50 devices, some under fio, is steps the loop takes between
/// its other work: `ublkctl status` answers within a second throughout, and a
/// bystander's worker killed mid-upgrade is recovered with its usual stall, not after
/// the upgrade of the devices before it.
#[test]
fn upgrading_fifty_devices_holds_up_neither_status_nor_a_recovery() {
    use std::time::Instant;
    let _serial = serial();
    const DEVICES: usize = 50;
    let ublkd = Ublkd::start("upgrade-fifty");
    let ids: Vec<u32> = std::thread::scope(|scope| {
        let adders: Vec<_> = (0..5)
            .map(|_| {
                let ctl = ublkd.ctl.clone();
                scope.spawn(move || {
                    (0..DEVICES / 5)
                        .map(|_| {
                            let out = ctl.run(&["add", "-t", "null", "-s", "16M", "-q", "1"]);
                            assert!(out.status.success(), "add: {}", describe(&out));
                            added_id(&String::from_utf8_lossy(&out.stdout))
                        })
                        .collect::<Vec<u32>>()
                })
            })
            .collect();
        adders.into_iter().flat_map(|a| a.join().unwrap()).collect()
    });
    assert_eq!(ids.len(), DEVICES);
    let bystander = *ids.iter().max().unwrap();
    // Its usual stall, before the upgrade.
    ublkd.wait_until("the bystander's standby", || {
        ublkd.status_of(bystander)["standby_pid"].as_u64().is_some()
    });
    let first = ublkd.worker_pid(bystander);
    signal(first, libc::SIGKILL);
    ublkd.wait_until("the bystander's first recovery", || {
        ublkd.status_of(bystander)["recoveries"] == 1
    });
    let usual = ublkd.stall_after_kill(first);
    let mut fios: Vec<Fio> = ids[..3]
        .iter()
        .map(|&id| {
            let mut args = fio_args(&format!("fifty{id}"), &block_dev(id), "randrw", 1, 16 * MIB);
            // Steady I/O that leaves the emulated CPUs room: status measures ublkd's
            // loop, not a starved ublkctl.
            args.extend(["--time_based".into(), "--runtime=600".into(), "--rate_iops=200".into()]);
            Fio::spawn(args)
        })
        .collect();
    ublkd.wait_until("the bystander's new standby", || {
        ublkd.status_of(bystander)["standby_pid"].as_u64().is_some()
    });
    // What status takes under this load without an upgrade, for the log.
    let baseline = (0..5)
        .map(|_| {
            let asked = Instant::now();
            let all = ublkd_proto::msg::CtlRequest::Status { id: None };
            ask(&ublkd.ctl.socket, &all).expect("status");
            let took = asked.elapsed();
            std::thread::sleep(Duration::from_millis(100));
            took
        })
        .max()
        .unwrap();
    let prober = StatusProber::start(&ublkd.ctl);
    // Killed once a few devices are upgraded (their upgrades are logged).
    let victim = ublkd.worker_pid(bystander);
    let killer = {
        let log_path = PathBuf::from("/tmp/ublkd-test-upgrade-fifty.log");
        let socket = ublkd.ctl.socket.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while std::fs::read_to_string(&log_path)
                .unwrap_or_default()
                .matches("upgraded to")
                .count()
                < 5
            {
                assert!(Instant::now() < deadline, "no upgrade logged within 120 s");
                std::thread::sleep(Duration::from_millis(20));
            }
            // Status says which device is being upgraded, and how far it is.
            let all = ublkd_proto::msg::CtlRequest::Status { id: None };
            let mut upgrading = None;
            for _ in 0..200 {
                let Ok(ublkd_proto::msg::CtlResponse::Status(devs)) = ask(&socket, &all) else {
                    continue;
                };
                upgrading = devs.into_iter().find_map(|d| {
                    d.note.filter(|n| n.contains("being upgraded: ")).map(|n| (d.id, n))
                });
                if upgrading.is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            (signal(victim, libc::SIGKILL), upgrading)
        })
    };
    let started = Instant::now();
    let out = ublkd.ctl(&["upgrade", "-a"]);
    let took = started.elapsed();
    let slowest = prober.finish();
    let (killed, upgrading) = killer.join().unwrap();
    assert!(killed, "the bystander's worker was gone before the kill");
    let (id, note) = upgrading.expect("no device's status said it was being upgraded");
    eprintln!("mid-upgrade, device {id}'s status said: {note}");
    let text = describe(&out);
    assert!(out.status.success(), "ublkctl upgrade -a failed: {text}\n{}", ublkd.log());
    assert_eq!(text.matches(": upgraded to").count(), DEVICES, "{text}");
    let stall = ublkd.stall_after_kill(victim);
    eprintln!(
        "upgrade -a of {DEVICES} devices took {took:?}; status took {slowest:?} at most \
         ({baseline:?} without an upgrade); the bystander's stall {stall} ms mid-upgrade, \
         {usual} ms before"
    );
    // Where the longest turns of ublkd's loop went, for whoever tunes it.
    let log = ublkd.log();
    let mut slow: Vec<(u64, &str)> = log
        .lines()
        .filter(|l| l.contains("event=\"slow_turn\""))
        .map(|l| {
            let ms = l.split("a loop turn took ").nth(1).unwrap_or_default();
            (ms.split(' ').next().unwrap_or_default().parse().unwrap_or(0), l)
        })
        .collect();
    slow.sort_unstable();
    let shown: Vec<&str> = slow.iter().rev().take(5).map(|(_, l)| *l).collect();
    eprintln!("{} loop turns over 100 ms, the longest:\n{}", slow.len(), shown.join("\n"));
    assert!(slowest < Duration::from_secs(1), "status took {slowest:?} during the upgrade");
    assert!(
        stall <= 2 * usual + 500,
        "the bystander's recovery stalled {stall} ms mid-upgrade, {usual} ms before"
    );
    for fio in fios.drain(..) {
        let jobs = fio.interrupt().unwrap_or_else(|e| panic!("{e}\n{}", ublkd.log()));
        assert_fio_clean(&jobs, 1);
    }
    for &id in &ids {
        assert_eq!(ublkd.status_of(id)["state"], "LIVE");
    }
    ublkd.stop();
}

/// Configured device `id`: a memory device of `size`.
fn configured_memory(id: u32, size: &str) -> String {
    format!("\n[[device]]\nid = {id}\ntarget = \"memory\"\nsize = \"{size}\"\n")
}

/// A configured device whose description changes is never changed under its users: a
/// reload says it serves on as it is and how to make it anew; a restart adopts it as it
/// is (not a failed add of its id); after `ublkctl del`, a reload makes it as
/// configured.
#[test]
fn a_changed_configured_device_serves_on_as_it_is_until_deleted_and_reloaded() {
    let _serial = serial();
    let mut ublkd = Ublkd::start_with("reload-changed", &configured_memory(3, "16M"), &[]);
    let dev = block_dev(3);
    wait_for_path(&dev);
    let data = pattern(3, MIB as usize);
    write_file(&dev, &data);
    run_ok(&mut Command::new("sync"));
    assert_eq!(ublkd_size(&ublkd, 3), 16 * MIB);

    let outcome = ublkd.reload_with(&configured_memory(3, "32M"));
    for part in ["device 3 differs from the config and serves on as it is", "ublkctl del -n 3"] {
        assert!(outcome.contains(part), "{part:?} missing from the reload's outcome: {outcome}");
    }
    assert_eq!(ublkd_size(&ublkd, 3), 16 * MIB, "the reload changed the device");

    ublkd.signal_and_restart(libc::SIGTERM, || {});
    let log = ublkd.log();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("device 3 differs from the config and serves on as it is")),
        "the restarted ublkd does not say device 3 differs:\n{log}"
    );
    assert!(!log.contains("configured device"), "the restart tried to add device 3 again:\n{log}");
    assert_eq!(ublkd_size(&ublkd, 3), 16 * MIB);
    assert_eq!(ublkd.status_of(3)["state"], "LIVE");
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    let mut read = vec![0u8; data.len()];
    std::io::Read::read_exact(&mut std::fs::File::open(&dev).unwrap(), &mut read).unwrap();
    assert!(read == data, "device 3's data changed across the restart");

    ublkd.del(3);
    let outcome = ublkd.reload_with(&configured_memory(3, "32M"));
    assert!(outcome.contains("1 device(s) added"), "{outcome}");
    wait_for_path(&dev);
    assert_eq!(ublkd_size(&ublkd, 3), 32 * MIB, "the reload did not make device 3 as configured");
    ublkd.stop();
}

/// Device `id`'s size as status gives it.
fn ublkd_size(ublkd: &Ublkd, id: u32) -> u64 {
    ublkd.status_of(id)["size_bytes"].as_u64().unwrap()
}
