//! One device of each target in one VM boot, each worker SIGKILLed under fio verify:
//! the smallest run that still proves ublkd's main job on every target (memory, loop,
//! null, nbd against nbdkit, rbd against the single-node Ceph cluster).
//!
//! `./run-tests --quick` runs it on 7.x (the edit-test loop); the full suite runs it on
//! 6.12, where it is the check that every target serves the per-I/O data path (the
//! other files' target tests run on 7.x: docs/testing.md, "What runs where").

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use ublkd_tests::harness::ceph::Cluster;
use ublkd_tests::harness::chaos::{prefill, timed_randrw_args, verify_region};
use ublkd_tests::harness::fio::{Fio, fio_args};
use ublkd_tests::harness::machine::{block_dev, kernel_devices, serial, wait_for_path};
use ublkd_tests::harness::storage::{sha256, sparse_file};
use ublkd_tests::harness::ublkd::Ublkd;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;
/// What fio verifies on each device: all of it.
const REGION: u64 = SIZE;
/// fio's cap; it is stopped long before, once the kills are over and I/O followed.
const FIO_CAP_SECS: u64 = 600;
/// Requests each device serves before its worker is killed: fio is mid-run.
const IOS_BEFORE: u64 = 200;
/// Requests each device serves after its recovery before fio is stopped: the writes
/// around the kill are then behind fio's verify backlog (256 writes) twice over.
const IOS_AFTER: u64 = 600;

/// nbdkit's file plugin on a unix socket, killed when dropped (and when the test
/// process ends: `--exit-with-parent`).
struct Nbdkit(Child);

impl Nbdkit {
    fn serve(file: &Path, socket: &str) -> Nbdkit {
        let pid_file = format!("{socket}.pid");
        for stale in [socket, &pid_file] {
            let _ = std::fs::remove_file(stale);
        }
        let child = Command::new("nbdkit")
            .args(["-U", socket, "-P", &pid_file, "-f", "--exit-with-parent", "--threads=1"])
            .arg("file")
            .arg(format!("file={}", file.display()))
            .stdin(Stdio::null())
            .spawn()
            .expect("cannot run nbdkit: install it with tests/vm/install-host-deps.sh");
        wait_for_path(Path::new(&pid_file));
        Nbdkit(child)
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_target_keeps_fio_verify_clean_across_a_worker_kill() {
    let _serial = serial();
    let started = Instant::now();
    let cluster = Cluster::shared();
    let image = "quick";
    cluster.create_image(image, SIZE);
    let loop_file = PathBuf::from("/tmp/ublkd-quick-loop.img");
    let nbd_file = PathBuf::from("/tmp/ublkd-quick-nbd.img");
    sparse_file(&loop_file, SIZE);
    sparse_file(&nbd_file, SIZE);
    let socket = "/tmp/ublkd-quick-nbdkit.sock";
    let nbdkit = Nbdkit::serve(&nbd_file, socket);
    let before = kernel_devices();

    let ublkd = Ublkd::start("quick");
    let size = SIZE.to_string();
    let uri = format!("nbd+unix:///?socket={socket}");
    let rbd = cluster.add_args(&Cluster::spec(image), &[]);
    let adds: [(&str, Vec<&str>); 5] = [
        ("memory", vec!["-t", "memory", "-s", &size]),
        ("loop", vec!["-t", "loop", "-f", loop_file.to_str().unwrap()]),
        ("null", vec!["-t", "null", "-s", &size]),
        ("nbd", vec!["-t", "nbd", "--uri", &uri]),
        ("rbd", rbd.iter().map(String::as_str).collect()),
    ];
    let devices: Vec<(&str, u32)> =
        adds.iter().map(|(target, args)| (*target, ublkd.add(args))).collect();
    for (target, id) in &devices {
        let dev = ublkd.status_of(*id);
        assert_eq!((dev["state"].as_str(), dev["target"].as_str()), (Some("LIVE"), Some(*target)));
    }

    // One device after another (under emulation, five fios at once starve each other):
    // fio verifying random reads and writes over a prefilled region (on null, which
    // keeps no data, plain random reads and writes); once I/O flows, the worker is
    // killed; once the device recovered and served on, fio is stopped and the whole
    // region verified.
    let mut killed = Vec::new();
    for &(target, id) in &devices {
        let node = block_dev(id);
        let args = if target == "null" {
            let mut args = fio_args("quick-null", &node, "randrw", 1, REGION);
            args.extend(["--time_based".into(), format!("--runtime={FIO_CAP_SECS}")]);
            args
        } else {
            prefill(&node, REGION);
            timed_randrw_args(&node, REGION, FIO_CAP_SECS)
        };
        let fio = Fio::spawn(args);
        ublkd.wait_for_ios(id, IOS_BEFORE);
        killed.push(format!("{target} (worker {})", ublkd.kill_worker(id)));
        ublkd.wait_for_ios(id, IOS_AFTER);
        let jobs = fio.interrupt().unwrap_or_else(|e| panic!("{target}: {e}\n{}", ublkd.log()));
        assert!(jobs.iter().all(|j| j.read_bytes > 0 && j.write_bytes > 0), "{target}: {jobs:?}");
        let dev = ublkd.status_of(id);
        assert_eq!(
            (dev["recoveries"].as_u64(), dev["errors"].as_u64()),
            (Some(1), Some(0)),
            "{dev}"
        );
        if target != "null" {
            verify_region(&node, REGION).unwrap_or_else(|e| panic!("{target}: {e}"));
        }
    }

    // What the backends hold is what the devices read.
    let node = |target: &str| block_dev(devices.iter().find(|d| d.0 == target).unwrap().1);
    assert_eq!(sha256(&node("loop")), sha256(&loop_file), "the loop file");
    assert_eq!(sha256(&node("nbd")), sha256(&nbd_file), "nbdkit's file");
    assert_eq!(sha256(&node("rbd")), cluster.export_checksum(image, None), "the rbd image");

    for (_, id) in &devices {
        ublkd.del(*id);
    }
    ublkd.stop();
    assert_eq!(kernel_devices(), before, "devices left behind");
    drop(nbdkit);
    cluster.remove_image(image);
    for file in [&loop_file, &nbd_file] {
        let _ = std::fs::remove_file(file);
    }
    eprintln!(
        "quick: memory, loop, null, nbd and rbd served fio verify across a kill of each \
         worker ({}), in {:.0} s",
        killed.join(", "),
        started.elapsed().as_secs_f64()
    );
}
