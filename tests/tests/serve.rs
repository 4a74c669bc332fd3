//! Serving block devices end to end: the real `ublkd`, `ublkctl` and `ublkd-worker`
//! against the real ublk driver, checked with fio, a filesystem and what is left behind.
//! These tests need `/dev/ublk-control` and root: they run inside the test VM
//! (`./run-tests` does that, with `ublkd-vm` as the cargo runner) and fail anywhere else.
//!
//! Each test starts its own `ublkd` on its own socket and ends by stopping it with
//! `ublkctl shutdown` and checking that no device, device node or worker is left.

use std::path::{Path, PathBuf};
use std::process::Command;

use ublkd_proto::uapi::{UBLK_F_AUTO_BUF_REG, UBLK_F_BATCH_IO};

use ublkd_tests::harness::fio::{FioJob, assert_fio_clean, fio, fio_args, fio_verify_args};
use ublkd_tests::harness::machine::{
    self, block_dev, fd_targets, holders, kernel_devices, kernel_features, pid_exists, serial,
    ublk_nodes, worker_pids,
};
use ublkd_tests::harness::process::{self, run, run_ok};
use ublkd_tests::harness::storage::{Mount, pattern, sha256, sparse_file, write_file};
use ublkd_tests::harness::ublkd::Ublkd;

const MIB: u64 = 1 << 20;

/// Two fio passes over `dev`, two jobs each on their own `region` bytes: random mixed
/// reads and writes verifying what they wrote, then random writes covering each region
/// followed by a verify pass over all of it.
fn fio_verify(dev: &Path, region: u64) {
    let jobs = fio(&fio_verify_args("randrw", dev, "randrw", 2, region));
    assert_fio_clean(&jobs, 2);
    let jobs = fio(&fio_verify_args("write-then-verify", dev, "randwrite", 2, region));
    assert_fio_clean(&jobs, 2);
    for job in &jobs {
        assert_eq!(job.write_bytes, region, "job {} did not write its region: {job:?}", job.name);
        assert_eq!(job.read_bytes, region, "job {} did not verify its region: {job:?}", job.name);
    }
}

/// After I/O: the device is LIVE, counted I/O and reported no error.
fn assert_served_without_errors(ublkd: &Ublkd, id: u32) {
    let dev = ublkd.status_of(id);
    assert_eq!(dev["state"], "LIVE", "{dev}");
    assert!(dev["ios"].as_u64().unwrap() > 0, "no I/O counted: {dev}");
    assert_eq!(dev["errors"], 0, "{dev}");
}

#[test]
fn memory_device_passes_fio_verify() {
    let _serial = serial();
    let ublkd = Ublkd::start("memory-verify");
    let id = ublkd.add(&["-t", "memory", "-s", "64M"]);

    fio_verify(&block_dev(id), 16 * MIB);

    assert_served_without_errors(&ublkd, id);
    ublkd.stop();
}

#[test]
fn loop_device_passes_fio_verify() {
    let _serial = serial();
    let backing = PathBuf::from("/tmp/serve-loop-verify.img");
    sparse_file(&backing, 256 * MIB);
    let ublkd = Ublkd::start("loop-verify");
    let id = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);
    // Where the kernel has AUTO_BUF_REG and BATCH_IO (7.x) a loop device is zero-copy
    // and batched by default; on 6.12 it is neither (the per-I/O path copies).
    let features = kernel_features();
    let zero_copy_and_batch = UBLK_F_AUTO_BUF_REG | UBLK_F_BATCH_IO;
    let expected =
        if features & zero_copy_and_batch == zero_copy_and_batch { zero_copy_and_batch } else { 0 };
    let flags = ublkd.kernel_flags(id);
    assert_eq!(
        flags & zero_copy_and_batch,
        expected,
        "device flags {flags:#x} on a kernel with features {features:#x}"
    );

    fio_verify(&block_dev(id), 16 * MIB);

    assert_served_without_errors(&ublkd, id);
    ublkd.stop();
    std::fs::remove_file(&backing).unwrap();
}

#[test]
fn null_device_serves_fio_without_errors() {
    let _serial = serial();
    let ublkd = Ublkd::start("null-fio");
    let id = ublkd.add(&["-t", "null", "-s", "1G"]);

    let jobs = fio(&fio_args("randrw", &block_dev(id), "randrw", 2, 64 * MIB));

    assert_fio_clean(&jobs, 2);
    assert_served_without_errors(&ublkd, id);
    ublkd.stop();
}

/// The kernel gives a device at most one queue per CPU (ADD_DEV lowers `nr_hw_queues`
/// to `nr_cpu_ids`). Asking for more must either work with the kernel's count or be
/// refused up front, in one line that says why; never a half-made device.
#[test]
fn more_queues_than_cpus_are_served_or_refused_clearly() {
    let _serial = serial();
    let cpus = std::thread::available_parallelism().unwrap().get() as u64;
    let asked = cpus + 2;
    let ublkd = Ublkd::start("many-queues");
    let out = ublkd.ctl(&["add", "-t", "memory", "-s", "16M", "-q", &asked.to_string()]);
    if out.status.success() {
        let id = machine::added_id(&String::from_utf8_lossy(&out.stdout));
        machine::wait_for_path(&block_dev(id));
        let list = ublkd.ctl_ok(&["list", "-n", &id.to_string()]);
        assert!(list.contains(&format!(" nr_hw_queues {cpus} ")), "{list}");
        assert_eq!(ublkd.status_of(id)["queues"], cpus, "status disagrees with the kernel");
        assert_fio_clean(&fio(&fio_verify_args("randrw", &block_dev(id), "randrw", 2, 4 * MIB)), 2);
        assert_served_without_errors(&ublkd, id);
    } else {
        let line = assert_one_line_error(&out, 1, "");
        assert!(line.to_lowercase().contains("cpu"), "the error does not say why: {line}");
        assert_eq!(kernel_devices(), Default::default(), "a refused add left a device");
        assert_eq!(worker_pids(), Vec::<u32>::new(), "a refused add left a worker");
    }
    ublkd.stop();
}

#[test]
fn ext4_on_a_loop_device_survives_umount_fsck_and_remount() {
    let _serial = serial();
    let backing = PathBuf::from("/tmp/serve-ext4.img");
    sparse_file(&backing, 128 * MIB);
    let mnt = PathBuf::from("/tmp/serve-ext4-mnt");
    let ublkd = Ublkd::start("ext4");
    let id = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);
    let dev = block_dev(id);
    run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&dev));

    // Files of awkward sizes, some in a subdirectory, with random content.
    let mount = Mount::new(&dev, &mnt);
    std::fs::create_dir(mnt.join("dir")).unwrap();
    let sizes = [0, 1, 511, 4096, 4097, 65_537, MIB as usize, 3 * MIB as usize + 123];
    let mut files = Vec::new();
    for (i, size) in sizes.into_iter().enumerate() {
        let name = if i % 2 == 0 { format!("f{i}") } else { format!("dir/f{i}") };
        write_file(&mnt.join(&name), &pattern(i as u64 + 1, size));
        files.push(name);
    }
    let sums =
        |root: &Path| -> Vec<String> { files.iter().map(|f| sha256(&root.join(f))).collect() };
    let written = sums(&mnt);
    run_ok(&mut Command::new("sync"));
    mount.umount();

    let fsck = run(Command::new("fsck.ext4").arg("-fn").arg(&dev));
    assert_eq!(
        fsck.status.code(),
        Some(0),
        "fsck.ext4 -fn found problems:\n{}",
        process::describe(&fsck)
    );

    // Read the files back from the device, not from the page cache.
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    let mount = Mount::new(&dev, &mnt);
    assert_eq!(sums(&mnt), written, "file contents changed across umount and mount");
    mount.umount();

    // The backing file alone holds the filesystem: a new device over it serves the same.
    ublkd.del(id);
    let fsck = run(Command::new("fsck.ext4").arg("-fn").arg(&backing));
    assert_eq!(
        fsck.status.code(),
        Some(0),
        "the backing file is not a clean ext4:\n{}",
        process::describe(&fsck)
    );
    let id = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);
    let mount = Mount::new(&block_dev(id), &mnt);
    assert_eq!(sums(&mnt), written, "file contents changed on a new device over the same file");
    mount.umount();

    assert_served_without_errors(&ublkd, id);
    ublkd.stop();
    std::fs::remove_file(&backing).unwrap();
}

#[test]
fn loop_backing_file_holds_exactly_what_was_written() {
    let _serial = serial();
    let size = 32 * MIB as usize;
    let backing = PathBuf::from("/tmp/serve-exact.img");
    sparse_file(&backing, size as u64);
    // Copy mode (zero copy has its own exact read-back test), and the workers' rings
    // with DEFER_TASKRUN: a recovery waits for the kernel to tear them down.
    let ublkd = Ublkd::start_with("exact", "[recovery]\nfast_release = false", &[]);
    let own_rings = io_urings(ublkd.pid());
    let id = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap(), "--copy"]);
    assert_eq!(ublkd.kernel_flags(id) & UBLK_F_AUTO_BUF_REG, 0, "--copy gave zero copy");
    assert_eq!(io_urings(ublkd.pid()), own_rings, "ublkd copied rings without fast_release");
    let dev = block_dev(id);

    // The whole device in 1 MiB writes (split into the device's largest requests), then
    // 1 MiB of it again in 4 KiB writes at 5 MiB.
    let mut expected = pattern(0xb10c, size);
    let whole = PathBuf::from("/tmp/serve-exact-whole.bin");
    write_file(&whole, &expected);
    let patch = pattern(0x5eed, MIB as usize);
    let patch_file = PathBuf::from("/tmp/serve-exact-patch.bin");
    write_file(&patch_file, &patch);
    expected[5 * MIB as usize..6 * MIB as usize].copy_from_slice(&patch);
    let expected_file = PathBuf::from("/tmp/serve-exact-expected.bin");
    write_file(&expected_file, &expected);
    dd_to(&whole, &dev, &["bs=1M"]);
    // A recovery between the two writes.
    assert!(process::signal(ublkd.worker_pid(id), libc::SIGKILL));
    ublkd.wait_until("the recovery", || {
        let st = ublkd.status_of(id);
        st["recoveries"] == 1 && st["state"] == "LIVE"
    });
    dd_to(&patch_file, &dev, &["bs=4k", &format!("seek={}", 5 * MIB / 4096)]);

    let readback = PathBuf::from("/tmp/serve-exact-readback.bin");
    dd_from(&dev, &readback, &["bs=1M", "iflag=direct"]);
    let want = sha256(&expected_file);
    assert_eq!(sha256(&readback), want, "the device does not read back what was written");
    let dev_status = ublkd.status_of(id);
    assert!(dev_status["bytes_written"].as_u64().unwrap() >= (size as u64 + MIB), "{dev_status}");

    ublkd.del(id);
    assert_eq!(std::fs::metadata(&backing).unwrap().len(), size as u64, "backing file resized");
    assert_eq!(sha256(&backing), want, "the backing file does not hold what was written");

    ublkd.stop();
    for f in [&backing, &whole, &patch_file, &expected_file, &readback] {
        std::fs::remove_file(f).unwrap();
    }
}

#[test]
fn zero_copy_loop_device_verifies_reads_back_exactly_and_recovers() {
    let _serial = serial();
    let size = 64 * MIB;
    let backing = PathBuf::from("/tmp/serve-zero-copy.img");
    sparse_file(&backing, size);
    let ublkd = Ublkd::start("zero-copy");
    let own_rings = io_urings(ublkd.pid());
    // More threads than queues: a tag may come back through another thread's ring, so
    // every ring must have the same buffer table layout.
    let args =
        ["-t", "loop", "-f", backing.to_str().unwrap(), "--zero-copy", "-q", "2", "--threads", "3"];
    // Zero copy needs AUTO_BUF_REG and the batched path (7.x): elsewhere (6.12) the
    // device is refused, saying why, and nothing is left behind.
    let reason = "zero_copy needs the kernel's UBLK_F_AUTO_BUF_REG with the batched data path \
                  (UBLK_F_BATCH_IO";
    if ublkd.zero_copy_refused(&args, reason) {
        ublkd.stop();
        std::fs::remove_file(&backing).unwrap();
        return;
    }
    let id = ublkd.add(&args);
    assert_ne!(ublkd.kernel_flags(id) & UBLK_F_AUTO_BUF_REG, 0, "not a zero-copy device");
    // recovery.fast_release (the default): ublkd holds a copy of each of the worker's
    // three rings (and of its standby's, once that is up), to take the device and the
    // registered pages out of them when the worker dies.
    let rings = io_urings(ublkd.pid()) - own_rings;
    assert!((3..=6).contains(&rings), "ublkd holds {rings} io_urings of workers, not 3 or 6");
    let dev = block_dev(id);

    fio_verify(&dev, 16 * MIB);

    // Large requests (1 MiB writes split at the device's 512 KiB limit: many pages per
    // registered request), then exact read-back through the device and the file.
    let data = pattern(0x2e80, (32 * MIB) as usize);
    let src = PathBuf::from("/tmp/serve-zero-copy-src.bin");
    write_file(&src, &data);
    dd_to(&src, &dev, &["bs=1M"]);
    let want = sha256(&src);
    let read_back = |what: &str| {
        let out = PathBuf::from("/tmp/serve-zero-copy-back.bin");
        dd_from(&dev, &out, &["bs=256k", "count=128", "iflag=direct"]);
        assert_eq!(sha256(&out), want, "{what}: the device does not read back what was written");
        std::fs::remove_file(&out).unwrap();
    };
    read_back("before the kill");

    // The new worker serves zero copy too: kill the worker, read everything back.
    let worker = ublkd.worker_pid(id);
    assert!(process::signal(worker, libc::SIGKILL));
    ublkd.wait_until("the recovery", || {
        let st = ublkd.status_of(id);
        st["recoveries"] == 1 && st["state"] == "LIVE"
    });
    read_back("after a recovery");
    assert_served_without_errors(&ublkd, id);

    ublkd.del(id);
    let head = PathBuf::from("/tmp/serve-zero-copy-head.bin");
    dd_from(&backing, &head, &["bs=1M", "count=32"]);
    assert_eq!(sha256(&head), want, "the backing file does not hold what was written");
    ublkd.stop();
    for f in [&backing, &src, &head] {
        std::fs::remove_file(f).unwrap();
    }
}

/// How many io_uring instances process `pid` holds.
fn io_urings(pid: u32) -> usize {
    fd_targets(pid).iter().filter(|t| *t == "anon_inode:[io_uring]").count()
}

/// `dd if=SRC of=OUT ARGS…`.
fn dd_from(src: &Path, out: &Path, args: &[&str]) {
    run_ok(
        Command::new("dd")
            .arg(format!("if={}", src.display()))
            .arg(format!("of={}", out.display()))
            .args(args)
            .arg("status=none"),
    );
}

/// `dd if=SRC of=DEV ARGS… oflag=direct conv=notrunc,fsync`.
fn dd_to(src: &Path, dev: &Path, args: &[&str]) {
    let args: Vec<&str> =
        args.iter().copied().chain(["oflag=direct", "conv=notrunc,fsync"]).collect();
    dd_from(src, dev, &args);
}

/// A device of the multi-device test: how it is added and what it must look like.
struct Shape<'a> {
    name: &'static str,
    target: &'static str,
    size: u64,
    queues: u64,
    depth: u64,
    threads: u64,
    /// `-s SIZE` or `-f FILE`.
    extra: [&'a str; 2],
}

impl Shape<'_> {
    fn add_args(&self) -> Vec<String> {
        let (q, d, t) = (self.queues.to_string(), self.depth.to_string(), self.threads.to_string());
        let args = ["-t", self.target, "-q", &q, "-d", &d, "--threads", &t];
        args.iter().chain(&self.extra).map(|s| s.to_string()).collect()
    }
}

#[test]
fn several_devices_with_queues_and_threads_serve_fio_at_once() {
    let _serial = serial();
    let backing = PathBuf::from("/tmp/serve-several.img");
    sparse_file(&backing, 64 * MIB);
    let shapes = [
        Shape {
            name: "memory-q2-t2",
            target: "memory",
            size: 64 * MIB,
            queues: 2,
            depth: 64,
            threads: 2,
            extra: ["-s", "64M"],
        },
        Shape {
            name: "loop-q1-t2",
            target: "loop",
            size: 64 * MIB,
            queues: 1,
            depth: 32,
            threads: 2,
            extra: ["-f", backing.to_str().unwrap()],
        },
        Shape {
            name: "null-q2-t1",
            target: "null",
            size: 256 * MIB,
            queues: 2,
            depth: 16,
            threads: 1,
            extra: ["-s", "256M"],
        },
    ];
    let ublkd = Ublkd::start("several");
    let ids: Vec<u32> = shapes
        .iter()
        .map(|s| ublkd.add(&s.add_args().iter().map(String::as_str).collect::<Vec<_>>()))
        .collect();

    // `ublkctl list`: the kernel's view of each device.
    let list = ublkd.ctl_ok(&["list"]);
    for (shape, id) in shapes.iter().zip(&ids) {
        let first = format!(
            "dev id {id}: nr_hw_queues {} queue_depth {} block size 4096 dev_capacity {}",
            shape.queues,
            shape.depth,
            shape.size / 512
        );
        assert!(list.lines().any(|l| l == first), "{}: no line {first:?} in:\n{list}", shape.name);
        let second = list
            .lines()
            .skip_while(|l| *l != first)
            .nth(1)
            .unwrap_or_else(|| panic!("{}: no second line in:\n{list}", shape.name));
        assert!(second.starts_with("\tmax rq size "), "{}: {second:?}", shape.name);
        assert!(second.ends_with(" state LIVE"), "{}: not LIVE: {second:?}", shape.name);
    }

    // `ublkctl status --json`: each device has its own live worker with its threads.
    let mut pids = Vec::new();
    for (shape, &id) in shapes.iter().zip(&ids) {
        let dev = ublkd.status_of(id);
        assert_eq!(dev["state"], "LIVE", "{}: {dev}", shape.name);
        assert_eq!(
            (dev["queues"].as_u64(), dev["queue_depth"].as_u64(), dev["threads"].as_u64()),
            (Some(shape.queues), Some(shape.depth), Some(shape.threads)),
            "{}: {dev}",
            shape.name
        );
        let pid = ublkd.worker_pid(id);
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .unwrap_or_else(|e| panic!("{}: worker {pid} does not exist: {e}", shape.name));
        assert_eq!(comm.trim_end(), "ublkd-worker", "{}: pid {pid}", shape.name);
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count() as u64;
        assert!(tasks >= shape.threads, "{}: worker {pid} has {tasks} threads", shape.name);
        pids.push(pid);
    }
    let mut distinct = pids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), pids.len(), "devices share a worker: {pids:?}");

    // One fio run with two jobs per device, on all devices at once.
    let mut args = Vec::new();
    for (shape, &id) in shapes.iter().zip(&ids) {
        let region = 8 * MIB;
        // null discards data: nothing to verify.
        args.extend(if shape.target != "null" {
            fio_verify_args(shape.name, &block_dev(id), "randrw", 2, region)
        } else {
            fio_args(shape.name, &block_dev(id), "randrw", 2, region)
        });
    }
    let jobs: Vec<FioJob> = fio(&args);
    assert_fio_clean(&jobs, 2 * shapes.len());
    for shape in &shapes {
        let n = jobs.iter().filter(|j| j.name == shape.name).count();
        assert_eq!(n, 2, "{}: {n} fio jobs reported: {jobs:?}", shape.name);
    }

    for ((shape, &id), pid) in shapes.iter().zip(&ids).zip(&pids) {
        assert_served_without_errors(&ublkd, id);
        assert_eq!(ublkd.worker_pid(id), *pid, "{}: the worker changed", shape.name);
    }
    ublkd.stop();
    std::fs::remove_file(&backing).unwrap();
}

#[test]
fn del_and_sigterm_leave_no_device_node_worker_or_open_file() {
    let _serial = serial();
    let backing = PathBuf::from("/tmp/serve-cleanup.img");
    sparse_file(&backing, 16 * MIB);
    let ublkd = Ublkd::start("cleanup");
    // ublkd's open files before and after each add: a delete must close what its add
    // opened (memory, shared region, backing file, worker sockets, copies of the
    // workers' rings, …), taken once the device's standby is ready (with its rings).
    let standing_by = |id: u32| {
        ublkd.wait_until("the standby", || !ublkd.status_of(id)["standby_pid"].is_null());
        fd_targets(ublkd.pid())
    };
    let null = ublkd.add(&["-t", "null", "-s", "16M"]);
    let with_null = standing_by(null);
    let memory = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let with_memory = standing_by(memory);
    let lo = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);
    let (null_pid, memory_pid, loop_pid) =
        (ublkd.worker_pid(null), ublkd.worker_pid(memory), ublkd.worker_pid(lo));
    assert!(!holders(&backing).is_empty(), "no process has the loop device's backing file open");

    ublkd.del(lo);
    assert_device_gone(lo, loop_pid);
    assert_eq!(holders(&backing), Vec::<u32>::new(), "the deleted device's file is still open");
    assert_eq!(fd_targets(ublkd.pid()), with_memory, "ublkd's open files after deleting loop");
    for (id, pid) in [(null, null_pid), (memory, memory_pid)] {
        assert!(block_dev(id).exists() && pid_exists(pid), "device {id} went with the other");
        assert_eq!(ublkd.status_of(id)["state"], "LIVE");
    }

    ublkd.del(memory);
    assert_device_gone(memory, memory_pid);
    assert_eq!(fd_targets(ublkd.pid()), with_null, "ublkd's open files after deleting memory");
    let ids: Vec<u64> = ublkd.status().iter().filter_map(|d| d["id"].as_u64()).collect();
    assert_eq!(ids, [u64::from(null)], "`ublkctl status` after two deletions");

    // `shutdown` deletes the null device, stops its worker and exits 0 (`stop` checks).
    let pid = ublkd.pid();
    let log = ublkd.stop();
    assert!(!pid_exists(null_pid) && !pid_exists(pid));
    // Every worker, serving or standing by, ended cleanly: a delete is no failure.
    let ended: Vec<&str> = log.lines().filter(|l| l.contains("worker ended:")).collect();
    assert!(ended.len() >= 6, "3 devices, each with a worker and a standby:\n{log}");
    for line in ended {
        assert!(line.contains("exited cleanly"), "a worker did not end cleanly: {line}\n{log}");
    }
    std::fs::remove_file(&backing).unwrap();
}

fn assert_device_gone(id: u32, worker_pid: u32) {
    for node in [format!("/dev/ublkb{id}"), format!("/dev/ublkc{id}")] {
        assert!(!Path::new(&node).exists(), "{node} is still there after `ublkctl del`");
    }
    assert!(!kernel_devices().contains(&id), "the kernel still has device {id}");
    assert!(!pid_exists(worker_pid), "worker {worker_pid} of device {id} is still there");
    assert!(!worker_pids().contains(&worker_pid));
}

/// Asserts `out` is a failure with exit code `code` and exactly one line on stderr,
/// `ublkctl: …`, that contains `needle`; returns that line.
fn assert_one_line_error(out: &std::process::Output, code: i32, needle: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{}", process::describe(out));
    assert!(out.stdout.is_empty(), "output on stdout: {}", process::describe(out));
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "not one line on stderr: {stderr:?}");
    assert!(lines[0].starts_with("ublkctl: "), "{stderr:?}");
    assert!(lines[0].contains(needle), "{stderr:?} does not mention {needle:?}");
    lines[0].to_string()
}

#[test]
fn bad_requests_fail_with_one_line_and_leave_nothing_behind() {
    let _serial = serial();
    let ublkd = Ublkd::start("bad-input");
    // Exit 2: a bad argument; 9: no such device.
    let cases: [(&[&str], &str, i32); 4] = [
        (&["add", "-t", "loop", "-f", "/nonexistent"], "/nonexistent", 2),
        (&["add", "-t", "memory"], "size", 2),
        (&["add", "-t", "memory", "-s", "1000"], "multiple of", 2),
        (&["del", "-n", "99"], "99", 9),
    ];
    for (args, needle, code) in cases {
        let out = ublkd.ctl(args);
        let line = assert_one_line_error(&out, code, needle);
        println!("ublkctl {}: {line}", args.join(" "));
        assert_eq!(ublk_nodes(), Default::default(), "ublkctl {}", args.join(" "));
        assert_eq!(kernel_devices(), Default::default(), "ublkctl {}", args.join(" "));
        assert_eq!(worker_pids(), Vec::<u32>::new(), "ublkctl {}", args.join(" "));
        assert_eq!(ublkd.status(), Vec::<serde_json::Value>::new(), "ublkctl {}", args.join(" "));
    }

    // ublkd still serves after the bad requests.
    let id = ublkd.add(&["-t", "memory", "-s", "4M"]);
    assert_eq!(ublkd.status_of(id)["state"], "LIVE");
    ublkd.stop();
}

#[test]
fn status_without_a_running_ublkd_exits_8_saying_it_is_unreachable() {
    let _serial = serial();
    let ublkd = Ublkd::start("no-daemon");
    let socket = ublkd.ctl.socket.clone();
    ublkd.stop();

    let ublkctl = |args: &[&str]| {
        run(Command::new(process::bin("ublkctl")).arg("--socket").arg(&socket).args(args))
    };
    let line = assert_one_line_error(&ublkctl(&["status"]), 8, "cannot reach ublkd");
    assert!(line.contains(socket.to_str().unwrap()), "the socket is not named: {line}");
    // Under --json the one line is a JSON object (docs/json.md), the exit code the same.
    let out = ublkctl(&["status", "--json"]);
    assert_eq!(out.status.code(), Some(8), "{}", process::describe(&out));
    let error: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(error["error"]["kind"], "ublkd_unreachable", "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains(socket.to_str().unwrap()), "the socket is not named: {message}");
}
