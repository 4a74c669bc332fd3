//! `ublkctl resize`: a memory and a loop device grown under a mounted ext4 (grown
//! online with `resize2fs`), their new size and every file kept through a worker kill,
//! a ublkd restart and an upgrade; a shrink refused without `--allow-shrink`; an nbd
//! device refused (its size is its export's).
//!
//! Kernel-specific: UPDATE_SIZE is Linux 6.16+. On 6.12 (`./run-tests` runs
//! `resize_is_refused_where_the_kernel_lacks_update_size` there) the refusal says why
//! and changes nothing; on 7.x the same test checks the resize it refuses on 6.12.
//! These tests need `/dev/ublk-control` and root: they run inside the test VM.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use ublkd_proto::uapi::UBLK_F_UPDATE_SIZE;

use ublkd_tests::harness::machine::{block_dev, kernel_features, serial, wait_for_path};
use ublkd_tests::harness::process::{run_ok, signal};
use ublkd_tests::harness::storage::{Mount, pattern, sha256, sparse_file, write_file};
use ublkd_tests::harness::ublkd::Ublkd;

const MIB: u64 = 1 << 20;

/// The size of `/dev/ublkbN` as the block layer has it now.
fn disk_size(id: u32) -> u64 {
    let out = run_ok(Command::new("blockdev").arg("--getsize64").arg(block_dev(id)));
    out.trim().parse().unwrap()
}

/// `ublkctl ARGS…`, which must fail; its stderr.
fn refused(ublkd: &Ublkd, args: &[&str]) -> String {
    let out = ublkd.ctl(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "`ublkctl {}` was accepted: {stderr}", args.join(" "));
    stderr
}

fn resize(ublkd: &Ublkd, id: u32, size: &str) -> String {
    ublkd.ctl_ok(&["resize", "-n", &id.to_string(), "-s", size])
}

/// One device under test: its mount, and the files written before and after growing
/// with their checksums.
struct Grown {
    id: u32,
    mount: Option<Mount>,
    files: Vec<(String, String)>,
}

impl Grown {
    /// The disk is `size` bytes, and the files read back from the device itself
    /// (unmounted, caches dropped, mounted again).
    fn check(&mut self, size: u64, when: &str) {
        assert_eq!(disk_size(self.id), size, "device {} after {when}", self.id);
        let mount = self.mount.take().expect("mounted");
        let dir = mount.dir.clone();
        mount.umount();
        std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
        self.mount = Some(Mount::new(&block_dev(self.id), &dir));
        for (name, sum) in &self.files {
            assert_eq!(&sha256(&dir.join(name)), sum, "{name} changed after {when}");
        }
    }
}

#[test]
fn memory_and_loop_devices_grow_under_ext4_and_keep_their_size_and_files() {
    let _serial = serial();
    assert_ne!(kernel_features() & UBLK_F_UPDATE_SIZE, 0, "this test needs Linux 6.16+");
    let mut ublkd = Ublkd::start("resize");
    let backing = PathBuf::from("/tmp/resize-loop.img");
    sparse_file(&backing, 16 * MIB);
    let memory = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let looped = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap()]);

    let mut devices = Vec::new();
    for id in [memory, looped] {
        let dev = block_dev(id);
        let mnt = PathBuf::from(format!("/tmp/resize-mnt-{id}"));
        run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&dev));
        let mount = Mount::new(&dev, &mnt);
        write_file(&mnt.join("before"), &pattern(id.into(), 3 * MIB as usize + 5));

        let said = resize(&ublkd, id, "40M");
        assert!(said.contains("resized from 16M to 40M"), "{said}");
        // The kernel was told before the answer: the disk is that size now.
        assert_eq!(disk_size(id), 40 * MIB);
        run_ok(Command::new("resize2fs").arg(&dev));
        // More than the old disk held: some of it lies past the old end.
        write_file(&mnt.join("after"), &pattern(u64::from(id) + 7, 20 * MIB as usize));
        run_ok(&mut Command::new("sync"));
        let files =
            ["before", "after"].iter().map(|f| (f.to_string(), sha256(&mnt.join(f)))).collect();
        devices.push(Grown { id, mount: Some(mount), files });
    }
    // The loop device's file grew to fit.
    assert!(std::fs::metadata(&backing).unwrap().len() >= 40 * MIB);

    for dev in &mut devices {
        ublkd.kill_worker(dev.id);
        dev.check(40 * MIB, "a worker kill");
    }
    // The new ublkd takes the size from its record; its workers from then on too.
    ublkd.signal_and_restart(libc::SIGTERM, || {});
    for dev in &mut devices {
        ublkd.wait_until("LIVE after the restart", || ublkd.status_of(dev.id)["state"] == "LIVE");
        assert_eq!(ublkd.status_of(dev.id)["size_bytes"], 40 * MIB);
        ublkd.kill_worker(dev.id);
        dev.check(40 * MIB, "a restart and a worker kill");
    }
    ublkd.ctl_ok(&["upgrade", "-a"]);
    for mut dev in devices {
        dev.check(40 * MIB, "an upgrade");
        dev.mount.take().expect("mounted").umount();
    }
    // The kills are logged as errors; nothing else is.
    let log = ublkd.log();
    let errors = log.lines().filter(|l| l.contains(" ERROR ") && !l.contains("worker_died"));
    assert_eq!(errors.count(), 0, "ublkd logged an error:\n{log}");
    assert_eq!(log.matches("event=\"resized\"").count(), 2, "{log}");
    ublkd.stop();
}

#[test]
fn a_shrink_needs_allow_shrink_and_an_nbd_device_is_not_resized() {
    let _serial = serial();
    assert_ne!(kernel_features() & UBLK_F_UPDATE_SIZE, 0, "this test needs Linux 6.16+");
    let ublkd = Ublkd::start("resize-refused");
    let id = ublkd.add(&["-t", "memory", "-s", "32M"]);
    let n = id.to_string();
    let said = refused(&ublkd, &["resize", "-n", &n, "-s", "16M"]);
    assert!(said.contains("is 32M (33554432 bytes), and 16M is smaller"), "{said}");
    assert!(said.contains("--allow-shrink"), "{said}");
    assert_eq!(disk_size(id), 32 * MIB);
    let said = ublkd.ctl_ok(&["resize", "-n", &n, "-s", "16M", "--allow-shrink"]);
    assert!(said.contains("resized from 32M to 16M"), "{said}");
    assert_eq!(disk_size(id), 16 * MIB);
    // Not a multiple of the block size.
    let said = refused(&ublkd, &["resize", "-n", &n, "-s", "1000"]);
    assert!(said.contains("size"), "{said}");

    let image = Path::new("/tmp/resize-nbd.img");
    sparse_file(image, 16 * MIB);
    let socket = "/tmp/resize-nbd.sock";
    let mut nbdkit = nbdkit(socket, image);
    let uri = format!("nbd+unix:///?socket={socket}");
    let nbd = ublkd.add(&["-t", "nbd", "--uri", &uri]);
    let said = refused(&ublkd, &["resize", "-n", &nbd.to_string(), "-s", "32M"]);
    assert!(said.contains("its size is its export's"), "{said}");
    assert_eq!(disk_size(nbd), 16 * MIB);
    ublkd.del(nbd);
    signal(nbdkit.id(), libc::SIGTERM);
    let _ = nbdkit.wait();
    let log = ublkd.log();
    assert!(!log.contains(" ERROR "), "ublkd logged an error:\n{log}");
    ublkd.stop();
}

/// nbdkit serving `image` on the unix socket `socket`, once it listens.
fn nbdkit(socket: &str, image: &Path) -> Child {
    let _ = std::fs::remove_file(socket);
    let pid_file = format!("{socket}.pid");
    let _ = std::fs::remove_file(&pid_file);
    let child = Command::new("nbdkit")
        .args(["-U", socket, "-f", "--exit-with-parent", "--threads=1", "-P", &pid_file])
        .arg("file")
        .arg(format!("file={}", image.display()))
        .stdout(Stdio::null())
        .spawn()
        .expect("nbdkit runs");
    // nbdkit writes its pid file once it listens.
    wait_for_path(Path::new(&pid_file));
    child
}

#[test]
fn resize_is_refused_where_the_kernel_lacks_update_size() {
    let _serial = serial();
    let ublkd = Ublkd::start("resize-kernel");
    let id = ublkd.add(&["-t", "null", "-s", "16M"]);
    if kernel_features() & UBLK_F_UPDATE_SIZE != 0 {
        // 7.x: what 6.12 refuses.
        let said = resize(&ublkd, id, "32M");
        assert!(said.contains("resized from 16M to 32M"), "{said}");
        assert_eq!(disk_size(id), 32 * MIB);
    } else {
        let said = refused(&ublkd, &["resize", "-n", &id.to_string(), "-s", "32M"]);
        assert!(said.contains("has no UBLK_F_UPDATE_SIZE (Linux 6.16+)"), "{said}");
        assert_eq!(
            ublkd.ctl(&["resize", "-n", &id.to_string(), "-s", "32M"]).status.code(),
            Some(4)
        );
        assert!(said.contains("nothing was changed"), "{said}");
        assert_eq!(disk_size(id), 16 * MIB);
        assert_eq!(ublkd.status_of(id)["size_bytes"], 16 * MIB);
    }
    ublkd.stop();
}
