//! A device's attributes, set at add time: read-only (the kernel's attribute and the
//! worker's own refusal), partitions scanned only when asked, and names that every
//! command takes and that outlive a ublkd restart. These tests need `/dev/ublk-control`
//! and root: they run inside the test VM and fail anywhere else.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ublkd_proto::uapi::UBLK_F_NO_AUTO_PART_SCAN;

use ublkd_tests::harness::machine::{block_dev, kernel_features, serial, wait_for_path};
use ublkd_tests::harness::process::run_ok;
use ublkd_tests::harness::storage::{pattern, sha256, write_file};
use ublkd_tests::harness::ublkd::Ublkd;

const MIB: usize = 1 << 20;
const SIZE: usize = 16 * MIB;

/// Writes one block at the start of `dev`, past the page cache: the error, if it
/// fails (at the open, as the kernel may refuse a read-only disk there, or at the
/// write).
fn write_error(dev: &Path) -> Option<std::io::Error> {
    let mut file = match OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(dev) {
        Ok(f) => f,
        Err(e) => return Some(e),
    };
    let block = AlignedBlock::new();
    file.write_all(block.bytes()).and_then(|()| file.sync_all()).err()
}

/// The first `len` bytes of `dev`, past the page cache.
fn read_start(dev: &Path, len: usize) -> Vec<u8> {
    let mut file = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(dev).unwrap();
    let mut out = Vec::with_capacity(len);
    let mut block = AlignedBlock::new();
    while out.len() < len {
        file.read_exact(block.bytes_mut()).unwrap();
        out.extend_from_slice(block.bytes());
    }
    out.truncate(len);
    out
}

/// 64 KiB aligned for O_DIRECT.
struct AlignedBlock(Box<[u8]>, usize);

impl AlignedBlock {
    const LEN: usize = 64 << 10;

    fn new() -> Self {
        let raw = vec![0xa5u8; Self::LEN + 4096].into_boxed_slice();
        let offset = raw.as_ptr().align_offset(4096);
        AlignedBlock(raw, offset)
    }

    fn bytes(&self) -> &[u8] {
        &self.0[self.1..self.1 + Self::LEN]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0[self.1..self.1 + Self::LEN]
    }
}

/// `blockdev --getro`: whether the kernel has the disk read-only.
fn kernel_read_only(dev: &Path) -> bool {
    run_ok(Command::new("blockdev").arg("--getro").arg(dev)).trim() == "1"
}

/// nbdkit's file plugin serving `image` on a unix socket (`-r`: a read-only export),
/// once it listens (it writes its pid file then).
struct Nbdkit {
    child: Child,
    uri: String,
}

impl Nbdkit {
    fn start(name: &str, image: &Path, read_only: bool) -> Nbdkit {
        let socket = format!("/run/ublkd-test-attrs-{name}.sock");
        let pid_file = PathBuf::from(format!("{socket}.pid"));
        let _ = std::fs::remove_file(&pid_file);
        let mut cmd = Command::new("nbdkit");
        cmd.args(["-U", &socket, "-f", "--exit-with-parent", "--threads=1", "-P"]).arg(&pid_file);
        if read_only {
            cmd.arg("-r");
        }
        cmd.arg("file").arg(format!("file={}", image.display()));
        let child = cmd.stdin(Stdio::null()).spawn().expect("nbdkit");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read(&pid_file).is_ok_and(|pid| pid.ends_with(b"\n")) {
            assert!(Instant::now() < deadline, "nbdkit did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        Nbdkit { child, uri: format!("nbd+unix:///?socket={socket}") }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A file of [`SIZE`] bytes of `pattern(seed)`.
fn image(name: &str, seed: u64) -> (PathBuf, Vec<u8>) {
    let path = PathBuf::from(format!("/tmp/ublkd-test-attrs-{name}.img"));
    let data = pattern(seed, SIZE);
    write_file(&path, &data);
    (path, data)
}

#[test]
fn a_read_only_device_of_every_target_refuses_writes_and_serves_its_data() {
    let _serial = serial();
    let ublkd = Ublkd::start("attrs-read-only");
    let (loop_file, loop_data) = image("loop", 1);
    let (nbd_file, nbd_data) = image("nbd", 2);
    let (ro_export_file, ro_export_data) = image("nbd-ro", 3);
    let nbd = Nbdkit::start("rw", &nbd_file, false);
    let ro_export = Nbdkit::start("ro", &ro_export_file, true);
    let sums: Vec<String> = [&loop_file, &nbd_file, &ro_export_file].map(|f| sha256(f)).to_vec();

    let memory = ublkd.add(&["-t", "memory", "-s", "16M", "--read-only"]);
    let lp = ublkd.add(&["-t", "loop", "-f", loop_file.to_str().unwrap(), "--read-only"]);
    let nb = ublkd.add(&["-t", "nbd", "--uri", &nbd.uri, "--read-only"]);
    // No flag: the export says read-only, and so is the device.
    let ro = ublkd.add(&["-t", "nbd", "--uri", &ro_export.uri]);

    for (id, data, backing) in [
        (memory, vec![0; SIZE], None),
        (lp, loop_data, Some(loop_file.display().to_string())),
        (nb, nbd_data, Some(nbd.uri.clone())),
        (ro, ro_export_data, Some(ro_export.uri.clone())),
    ] {
        let dev = block_dev(id);
        assert!(kernel_read_only(&dev), "{} is not read-only to the kernel", dev.display());
        let err = write_error(&dev).unwrap_or_else(|| panic!("{} took a write", dev.display()));
        let errno = err.raw_os_error();
        assert!(
            [libc::EROFS, libc::EPERM, libc::EACCES].map(Some).contains(&errno),
            "{}: {err}",
            dev.display()
        );
        assert!(read_start(&dev, SIZE) == data, "{} reads other data", dev.display());
        let status = ublkd.status_of(id);
        assert_eq!(status["read_only"], true, "{status}");
        assert_eq!(status["backing"].as_str().map(String::from), backing, "{status}");
        assert_eq!(status["writes"], 0, "a write reached the worker: {status}");
    }
    let after: Vec<String> = [&loop_file, &nbd_file, &ro_export_file].map(|f| sha256(f)).to_vec();
    assert_eq!(after, sums, "a backing file changed");
    ublkd.stop();
}

#[test]
fn a_name_stands_for_the_device_in_every_command_and_outlives_a_restart() {
    let _serial = serial();
    let mut ublkd = Ublkd::start("attrs-names");
    let id = ublkd.add(&["-t", "memory", "-s", "16M", "--name", "db-1"]);

    let dup = ublkd.ctl(&["add", "-t", "memory", "-s", "16M", "--name", "db-1"]);
    let said = String::from_utf8_lossy(&dup.stderr);
    assert!(!dup.status.success(), "a second db-1 was added");
    assert!(said.contains(&format!("already the name of device {id}")), "{said}");
    let bad = ublkd.ctl(&["add", "-t", "memory", "-s", "16M", "--name", "../x"]);
    assert!(!bad.status.success(), "a name with '/' was taken");

    let json = ublkd.ctl_ok(&["status", "-n", "db-1", "--json"]);
    let status: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(status["devices"][0]["id"], id, "{status}");
    assert_eq!(status["devices"][0]["name"], "db-1", "{status}");
    assert!(status["devices"][0]["backing"].is_null(), "{status}");
    let unknown = ublkd.ctl(&["status", "-n", "nope"]);
    let said = String::from_utf8_lossy(&unknown.stderr);
    assert!(!unknown.status.success() && said.contains("no device is named \"nope\""), "{said}");

    ublkd.signal_and_restart(libc::SIGTERM, || {});
    ublkd
        .wait_until("the device adopted", || ublkd.ctl(&["status", "-n", "db-1"]).status.success());
    assert_eq!(ublkd.status_of(id)["name"], "db-1");
    let recovered = ublkd.ctl_ok(&["recover", "-n", "db-1"]);
    assert!(recovered.contains(&id.to_string()), "{recovered}");
    let upgraded = ublkd.ctl_ok(&["upgrade", "-n", "db-1"]);
    assert!(!upgraded.trim().is_empty(), "upgrade said nothing");
    // A config file's device may not take the name either.
    let outcome =
        ublkd.reload_with("[[device]]\ntarget = \"memory\"\nsize = \"16M\"\nname = \"db-1\"\n");
    assert!(outcome.contains("0 device(s) added"), "{outcome}");
    let refusal = format!("name \"db-1\" is already the name of device {id}");
    assert!(ublkd.log().contains(&refusal), "the reload did not say why:\n{}", ublkd.log());
    assert_eq!(ublkd.status().len(), 1, "a second db-1 was made");
    ublkd.ctl_ok(&["del", "-n", "db-1"]);
    assert!(ublkd.status().is_empty(), "the device is still there after del -n db-1");
    ublkd.stop();
}

/// A 16 MiB image with an MBR naming one Linux partition from 1 MiB to 9 MiB.
fn partitioned(name: &str) -> PathBuf {
    let path = PathBuf::from(format!("/tmp/ublkd-test-attrs-{name}.img"));
    let mut data = vec![0u8; SIZE];
    let entry = &mut data[446..462];
    entry[4] = 0x83; // Linux
    entry[8..12].copy_from_slice(&2048u32.to_le_bytes()); // first sector
    entry[12..16].copy_from_slice(&16384u32.to_le_bytes()); // sectors
    data[510] = 0x55;
    data[511] = 0xaa;
    write_file(&path, &data);
    path
}

/// The kernel scans a disk only if its server has CAP_SYS_ADMIN: the devices here run
/// unsandboxed, so that what decides is ublkd's flag (and a sandboxed device asking for
/// partitions is refused, saying why).
#[test]
fn partitions_are_scanned_only_when_asked_where_the_kernel_can_be_told() {
    let _serial = serial();
    let ublkd = Ublkd::start("attrs-partitions");
    let plain_file = partitioned("plain");
    let scanned_file = partitioned("scanned");
    let can_refuse = kernel_features() & UBLK_F_NO_AUTO_PART_SCAN != 0;

    let sandboxed =
        ublkd.ctl(&["add", "-t", "loop", "-f", plain_file.to_str().unwrap(), "--partitions"]);
    let said = String::from_utf8_lossy(&sandboxed.stderr);
    assert!(!sandboxed.status.success() && said.contains("--partitions: needs"), "{said}");
    let plain = ublkd.add(&["-t", "loop", "-f", plain_file.to_str().unwrap(), "--no-sandbox"]);
    let scanned = ublkd.add(&[
        "-t",
        "loop",
        "-f",
        scanned_file.to_str().unwrap(),
        "--partitions",
        "--no-sandbox",
    ]);
    // The second device's scan comes after the first's would have: once its
    // partition is there, the first device's absence is an answer.
    wait_for_path(Path::new(&format!("/dev/ublkb{scanned}p1")));
    let plain_part = PathBuf::from(format!("/dev/ublkb{plain}p1"));
    assert_eq!(
        ublkd.kernel_flags(plain) & UBLK_F_NO_AUTO_PART_SCAN != 0,
        can_refuse,
        "NO_AUTO_PART_SCAN is set exactly where the kernel has it"
    );
    assert_eq!(ublkd.kernel_flags(scanned) & UBLK_F_NO_AUTO_PART_SCAN, 0);
    if can_refuse {
        assert!(!plain_part.exists(), "{} was made without --partitions", plain_part.display());
    } else {
        // Older kernels (6.12) scan every disk whose server has CAP_SYS_ADMIN.
        wait_for_path(&plain_part);
    }
    ublkd.stop();
}
