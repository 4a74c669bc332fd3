//! Safe delete: `ublkctl del`, `del -a`, `shutdown` and a reload that drops a device
//! refuse a device whose disk is in use (a mounted filesystem, another process's open),
//! naming what holds it, and change nothing: the device serves on, its data intact.
//! `--force` deletes anyway; once the disk is free, a plain delete succeeds.
//!
//! Kernel-specific: on a kernel with `UBLK_F_SAFE_STOP_DEV` (7.x) devices get the flag
//! and the kernel's TRY_STOP_DEV refuses the stop; on 6.12 ublkd's exclusive open of the
//! disk does. Both runs check the same outcomes (`./run-tests` runs this file on both).
//! These tests need `/dev/ublk-control` and root: they run inside the test VM.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Command;

use ublkd_proto::uapi::UBLK_F_SAFE_STOP_DEV;

use ublkd_tests::harness::machine::{block_dev, kernel_devices, kernel_features, serial};
use ublkd_tests::harness::process::run_ok;
use ublkd_tests::harness::storage::{Mount, pattern, write_file};
use ublkd_tests::harness::ublkd::Ublkd;

/// A memory device with a fixed id, as the config file lists it.
fn configured_memory(id: u32, size: &str) -> String {
    format!("\n[[device]]\nid = {id}\ntarget = \"memory\"\nsize = \"{size}\"\n")
}

/// `ublkctl ARGS…`, which must fail; its stderr.
fn refused(ublkd: &Ublkd, args: &[&str]) -> String {
    let out = ublkd.ctl(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "`ublkctl {}` was not refused: {stderr}", args.join(" "));
    stderr
}

fn assert_says(text: &str, part: &str, what: &str) {
    assert!(text.contains(part), "{what} does not say {part:?}: {text}");
}

/// The device is still served as before: LIVE, in the kernel, its node there.
fn assert_served(ublkd: &Ublkd, id: u32) {
    assert_eq!(ublkd.status_of(id)["state"], "LIVE", "device {id} is not LIVE");
    assert!(kernel_devices().contains(&id), "device {id} left the kernel");
    assert!(block_dev(id).exists(), "/dev/ublkb{id} is gone");
}

/// Whether devices get (and are stopped with) the kernel's safe stop here, as the
/// kernel's flags of device `id` show.
fn safe_stop(ublkd: &Ublkd, id: u32) -> bool {
    let kernel = kernel_features() & UBLK_F_SAFE_STOP_DEV != 0;
    let device = ublkd.kernel_flags(id) & UBLK_F_SAFE_STOP_DEV != 0;
    assert_eq!(device, kernel, "device {id}'s SAFE_STOP_DEV differs from the kernel's");
    eprintln!("safe stop: {}", if kernel { "TRY_STOP_DEV" } else { "ublkd's O_EXCL open" });
    kernel
}

/// A mounted ext4 filesystem on configured device 0 stops every delete but `--force`,
/// each naming the mount point, and its file reads back unchanged; unmounted, it is
/// deleted. Device 1, free, is deleted by neither the refused `del -a` nor `shutdown`.
#[test]
fn a_mounted_device_is_refused_by_every_delete_until_unmounted() {
    let _serial = serial();
    let ublkd = Ublkd::start_with("lifecycle-mounted", &configured_memory(0, "64M"), &[]);
    let free = ublkd.add(&["-t", "memory", "-s", "16M", "-n", "1"]);
    safe_stop(&ublkd, 0);
    run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(block_dev(0)));
    let mount = Mount::new(&block_dev(0), Path::new("/tmp/lifecycle-mnt-0"));
    let file = mount.dir.join("data");
    let data = pattern(45, 1 << 20);
    write_file(&file, &data);
    run_ok(&mut Command::new("sync"));

    let holder = "device 0 is in use: mounted at /tmp/lifecycle-mnt-0";
    let err = refused(&ublkd, &["del", "-n", "0"]);
    assert_says(&err, &format!("{holder} (unmount it, or delete with --force)"), "del -n 0");
    assert_served(&ublkd, 0);

    let err = refused(&ublkd, &["del", "-a"]);
    assert_says(&err, &format!("nothing deleted: {holder}"), "del -a");
    assert_served(&ublkd, 0);
    assert_served(&ublkd, free);

    let err = refused(&ublkd, &["shutdown"]);
    assert_says(&err, &format!("ublkd not shut down, nothing deleted: {holder}"), "shutdown");
    assert_says(&err, "shut down with --force", "shutdown");
    assert_served(&ublkd, 0);
    assert_served(&ublkd, free);

    let outcome = ublkd.reload_with("");
    assert_says(&outcome, &format!("kept: {holder} (unmount it, then reload again)"), "reload");
    assert_says(&outcome, "0 deleted", "reload");
    assert_served(&ublkd, 0);

    // Served throughout: what was written reads back from the device, and more can be.
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert!(std::fs::read(&file).unwrap() == data, "the file changed under the refusals");
    write_file(&mount.dir.join("more"), &pattern(46, 1 << 16));
    run_ok(&mut Command::new("sync"));

    mount.umount();
    // The reload kept it configured: the next one deletes it, now that it is free.
    let outcome = ublkd.reload_with("");
    assert_says(&outcome, "1 deleted", "the reload after umount");
    assert!(!kernel_devices().contains(&0), "device 0 is still in the kernel");
    ublkd.del(free);
    ublkd.stop();
}

/// `ublkctl ARGS…` (a forced delete of a mounted device), the filesystem unmounted
/// (lazily) once the device's disk is gone, as its operator would: the kernel's DEL_DEV
/// waits for the mount's hold on the disk to end. Must succeed.
fn forced(ublkd: &Ublkd, args: &[&str], id: u32, mount: Mount) {
    let disk = format!("/sys/block/ublkb{id}");
    let out = std::thread::scope(|scope| {
        let ctl = scope.spawn(|| ublkd.ctl(args));
        ublkd.wait_until("the forced delete's stop", || !Path::new(&disk).exists());
        drop(mount);
        ctl.join().unwrap()
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "`ublkctl {}`: {stderr}\n{}", args.join(" "), ublkd.log());
    assert!(!kernel_devices().contains(&id), "device {id} is still in the kernel");
}

/// `--force` deletes a device in use, as before safe delete: `del --force` one, then
/// `shutdown --force` with another mounted.
#[test]
fn force_deletes_a_mounted_device() {
    let _serial = serial();
    let mut ublkd = Ublkd::start("lifecycle-force");
    let id = ublkd.add(&["-t", "memory", "-s", "32M", "-n", "4"]);
    run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(block_dev(id)));
    let mount = Mount::new(&block_dev(id), Path::new("/tmp/lifecycle-mnt-4"));
    refused(&ublkd, &["del", "-n", "4"]);
    forced(&ublkd, &["del", "-n", "4", "--force"], id, mount);

    let id = ublkd.add(&["-t", "memory", "-s", "32M", "-n", "5"]);
    run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(block_dev(id)));
    let mount = Mount::new(&block_dev(id), Path::new("/tmp/lifecycle-mnt-5"));
    refused(&ublkd, &["shutdown"]);
    forced(&ublkd, &["shutdown", "--force"], id, mount);
    // ublkctl returned once ublkd removed its socket, the last thing it does.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ublkd.alive() {
        assert!(std::time::Instant::now() < deadline, "ublkd did not exit after shutdown");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Another process's exclusive open (what mount, dm and md do) and a plain one (a
/// reader) both keep a device from being deleted, naming the process; closed, the
/// device is deleted.
#[test]
fn a_device_open_in_a_process_is_refused_naming_it() {
    let _serial = serial();
    let ublkd = Ublkd::start("lifecycle-open");
    let id = ublkd.add(&["-t", "memory", "-s", "16M", "-n", "2"]);
    safe_stop(&ublkd, id);
    let holder = format!("device 2 is in use: open in process {} (", std::process::id());
    for exclusive in [true, false] {
        let flags = if exclusive { libc::O_EXCL } else { 0 };
        let open = OpenOptions::new().read(true).custom_flags(flags).open(block_dev(id)).unwrap();
        let err = refused(&ublkd, &["del", "-n", "2"]);
        assert_says(&err, &holder, "del -n 2");
        assert_says(&err, "(close it, or delete with --force)", "del -n 2");
        let err = refused(&ublkd, &["del", "-a"]);
        assert_says(&err, &format!("nothing deleted: {holder}"), "del -a");
        assert_served(&ublkd, id);
        drop(open);
    }
    ublkd.del(id);
    assert!(!kernel_devices().contains(&id), "device 2 is still in the kernel");
    ublkd.stop();
}

/// The kernel's side, asked directly: where it has `UBLK_F_SAFE_STOP_DEV`, TRY_STOP_DEV
/// on a device whose disk is open fails with EBUSY and leaves the device as it was;
/// without it (6.12), the command is unknown (EOPNOTSUPP) and ublkd checks by itself.
#[test]
fn try_stop_dev_refuses_an_open_disk_where_the_kernel_has_it() {
    let _serial = serial();
    let ublkd = Ublkd::start("lifecycle-try-stop");
    let id = ublkd.add(&["-t", "null", "-s", "16M", "-n", "3"]);
    let ctrl = ublkd_proto::ctrl::CtrlClient::open().unwrap();
    let open = OpenOptions::new().read(true).open(block_dev(id)).unwrap();
    let errno = ctrl.try_stop_dev(id).unwrap_err().errno();
    if kernel_features() & UBLK_F_SAFE_STOP_DEV != 0 {
        assert_eq!(errno, Some(libc::EBUSY), "TRY_STOP_DEV on an open disk");
    } else {
        assert_eq!(errno, Some(libc::EOPNOTSUPP), "TRY_STOP_DEV without SAFE_STOP_DEV");
    }
    drop(open);
    assert_served(&ublkd, id);
    ublkd.del(id);
    ublkd.stop();
}
