//! The rbd target through the real `ublkd`, `ublkctl` and kernel, against a real Ceph
//! cluster: one mon and one bluestore OSD started inside the test VM ([`Cluster::shared`]:
//! one per VM boot, about 10 s to start, shared by this file's tests). What must hold:
//! fio's verified data survives worker kills, an OSD restart and a ublkd restart, and
//! the image reads back as the device does; ext4 on an image survives an upgrade; bad
//! inputs are named in one line and make no device; a dead worker's client is fenced
//! (blocklisted) before its successor writes, so that a write the dead one left in
//! flight can never land over newer data; after a power loss a configured device
//! comes back by itself, the dead client's lock broken; an image that cannot be fenced
//! (no exclusive-lock) is served writable only where the config allows it; a device
//! grows with its image, by `ublkctl resize` and by `rbd resize` elsewhere; a
//! device connects as its own client, `client.ublkd`, unless told otherwise; with the
//! OSD stopped, `ublkctl del` and SIGTERM answer within their deadlines; a recovery
//! during an outage waits for the cluster, outside the restart budget; and no Ceph code
//! runs as root or opens more than stream TCP sockets (the image probe sandboxed as a
//! worker is, a worker's UDP socket refused).
//!
//! [`the_test_cluster_serves_an_image`] and
//! [`a_delayed_write_of_a_killed_client_lands_unless_it_is_fenced`] check the harness
//! alone (no ublkd): the cluster, its helpers, and that the fencing test's way of
//! keeping a write in flight works, so that the fencing test can fail.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use ublkd_proto::ctrl::CtrlClient;
use ublkd_proto::uapi::UBLK_F_UPDATE_SIZE;
use ublkd_tests::harness::ceph::{CLIENT_ID, Cluster, LoDelay, osd_ports, tcp_connections};
use ublkd_tests::harness::chaos::{self, BackgroundPasses};
use ublkd_tests::harness::machine::{
    block_dev, kernel_devices, kernel_features, pid_exists, serial, worker_pids,
};
use ublkd_tests::harness::process::{describe, hooked_worker, run, run_ok, signal};
use ublkd_tests::harness::storage::{Mount, pattern, sha256, write_file, write_files};
use ublkd_tests::harness::ublkd::Ublkd;

const MIB: u64 = 1 << 20;
const BLOCK: usize = 4096;

/// `ublkctl add` of an rbd device for `image` (`POOL/IMAGE`); its id, its node there.
fn add_rbd(ublkd: &Ublkd, cluster: &Cluster, image: &str) -> u32 {
    add_rbd_with(ublkd, cluster, image, &[])
}

/// [`add_rbd`] with `extra` arguments.
fn add_rbd_with(ublkd: &Ublkd, cluster: &Cluster, image: &str, extra: &[&str]) -> u32 {
    let args = cluster.add_args(image, extra);
    ublkd.add(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The sha256 of all of `dev`, read with O_DIRECT (past the page cache) into a file.
fn device_checksum(dev: &Path) -> String {
    let copy = PathBuf::from("/tmp/ublkd-test-rbd-device.img");
    run_ok(Command::new("dd").args([
        &format!("if={}", dev.display()),
        &format!("of={}", copy.display()),
        "bs=1M",
        "iflag=direct",
        "status=none",
    ]));
    let sum = sha256(&copy);
    let _ = std::fs::remove_file(&copy);
    sum
}

/// A page-aligned buffer of one block, for O_DIRECT.
#[repr(align(4096))]
struct Block([u8; BLOCK]);

fn write_block(dev: &Path, block: u64, data: &[u8]) {
    let mut buf = Block([0; BLOCK]);
    buf.0.copy_from_slice(data);
    let mut f =
        std::fs::OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(dev).unwrap();
    f.seek(SeekFrom::Start(block * BLOCK as u64)).unwrap();
    f.write_all(&buf.0).unwrap_or_else(|e| panic!("writing block {block} of {dev:?}: {e}"));
}

fn read_block(dev: &Path, block: u64) -> Vec<u8> {
    let mut buf = Block([0; BLOCK]);
    let mut f =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(dev).unwrap();
    f.seek(SeekFrom::Start(block * BLOCK as u64)).unwrap();
    f.read_exact(&mut buf.0).unwrap_or_else(|e| panic!("reading block {block} of {dev:?}: {e}"));
    buf.0.to_vec()
}

/// Writes `data` at `block` of `dev` with O_DIRECT in a child `dd` (it may be held).
fn start_block_write(dev: &Path, block: u64, data: &[u8]) -> Child {
    let src = PathBuf::from(format!("/tmp/ublkd-test-rbd-block-{block}-{}", data[0]));
    std::fs::write(&src, data).unwrap();
    Command::new("dd")
        .arg(format!("if={}", src.display()))
        .arg(format!("of={}", dev.display()))
        .args([&format!("bs={BLOCK}"), "count=1", &format!("seek={block}"), "oflag=direct"])
        .args(["conv=notrunc", "status=none"])
        .stdin(Stdio::null())
        .spawn()
        .expect("cannot run dd")
}

/// A block of one byte repeated, named by it in failure messages.
fn tagged(tag: u8) -> Vec<u8> {
    vec![tag; BLOCK]
}

/// What block `data` is, of the tags a test wrote.
fn which(data: &[u8], tags: &[(u8, &str)]) -> String {
    tags.iter()
        .find(|(t, _)| data.iter().all(|b| b == t))
        .map_or_else(|| format!("unknown data ({:?}…)", &data[..8]), |(_, name)| name.to_string())
}

/// The cluster alone (no ublkd): an image is made, written, read back and checksummed,
/// a snapshot of it too, and neither an OSD kill -9 and restart nor a mon restart loses
/// or changes anything; the lock owners and the blocklist can be listed.
#[test]
fn the_test_cluster_serves_an_image() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "harness";
    let size = 32 * MIB;
    cluster.create_image(image, size);
    assert!(cluster.images().contains(&image.to_string()), "{:?}", cluster.images());
    let data = pattern(1, 4 * MIB as usize);
    let written = Instant::now();
    cluster.write(image, 8 * MIB, &data);
    let write_time = written.elapsed();
    assert!(cluster.read(image, None, 8 * MIB + 4096, 4096) == data[4096..8192], "read back");
    // What the whole image must hold, checksummed as a file.
    let expected_file = PathBuf::from("/tmp/ublkd-test-rbd-expected.img");
    let mut expected = vec![0; size as usize];
    expected[8 * MIB as usize..12 * MIB as usize].copy_from_slice(&data);
    write_file(&expected_file, &expected);
    let expected = sha256(&expected_file);
    let summed = Instant::now();
    assert_eq!(cluster.export_checksum(image, None), expected, "the image's checksum");
    let sum_time = summed.elapsed();
    cluster.create_snapshot(image, "s1");
    cluster.write(image, 0, &pattern(2, BLOCK));
    assert_eq!(cluster.export_checksum(image, Some("s1")), expected, "the snapshot's checksum");

    let osd_time = cluster.restart_osd();
    assert_eq!(cluster.export_checksum(image, Some("s1")), expected, "after the OSD restart");
    assert!(cluster.read(image, None, 0, BLOCK) == pattern(2, BLOCK), "after the OSD restart");
    cluster.write(image, 0, &pattern(3, BLOCK));
    let mon_time = cluster.restart_mon();
    assert!(cluster.read(image, None, 0, BLOCK) == pattern(3, BLOCK), "after the mon restart");

    // Nobody holds the image open now: no lock owner; the blocklist can be read.
    assert_eq!(cluster.lock_owners(image), Vec::<String>::new());
    let blocklist = cluster.blocklist_ls();
    let osd = cluster.osd();
    assert_eq!(osd["up"], 1, "{osd}");
    let _ = std::fs::remove_file(&expected_file);
    cluster.remove_image(image);
    eprintln!(
        "ceph: 4 MiB written in {:.1} s, 32 MiB checksummed in {:.1} s; OSD restarted in \
         {:.1} s, mon in {:.1} s; blocklist {blocklist:?}",
        write_time.as_secs_f64(),
        sum_time.as_secs_f64(),
        osd_time.as_secs_f64(),
        mon_time.as_secs_f64()
    );
}

/// A client of the image in its own process (`/usr/bin/python3`, librbd), which takes
/// the exclusive lock, writes `block` with tag 1 and prints its address; then for each
/// line on its stdin (a tag's decimal value) starts a write of `block` with that tag
/// and prints "sent" (without waiting for its completion).
struct OldClient {
    child: Child,
    lines: std::io::BufReader<std::process::ChildStdout>,
}

impl OldClient {
    const SCRIPT: &str = r#"
import sys, rados, rbd
conf, image, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = rados.Rados(conffile=conf, rados_id="admin")
c.conf_set("rbd_cache", "false")
c.connect(timeout=60)
io = c.open_ioctx("rbd")
img = rbd.Image(io, image)
img.lock_acquire(rbd.RBD_LOCK_MODE_EXCLUSIVE)
img.write(bytes([1]) * 4096, block * 4096)
owners = [o["owner"] for o in img.lock_get_owners()]
print(owners[0], flush=True)
done = []
for line in sys.stdin:
    tag = int(line)
    img.aio_write(bytes([tag]) * 4096, block * 4096, lambda comp: done.append(comp))
    print("sent", flush=True)
"#;

    fn start(cluster: &Cluster, image: &str, block: u64) -> (OldClient, String) {
        let mut child = Command::new("/usr/bin/python3")
            .args(["-c", Self::SCRIPT])
            .arg(cluster.conf_path())
            .arg(image)
            .arg(block.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("cannot run /usr/bin/python3");
        let lines = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut client = OldClient { child, lines };
        let address = client.line();
        (client, address)
    }

    fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut line = String::new();
        self.lines.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "the old client exited: {:?}", self.child.try_wait());
        line.trim().to_string()
    }

    /// Starts a write of `tag` and returns once librbd has sent it on.
    fn write(&mut self, tag: u8) {
        writeln!(self.child.stdin.as_mut().unwrap(), "{tag}").unwrap();
        assert_eq!(self.line(), "sent");
    }
}

impl Drop for OldClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How long [`LoDelay`] holds a dead client's segments in the harness-only check: the
/// next owner's take-over (open, break the lock, write) must finish within it, and took
/// 12.5 to 12.9 s of a 12 s hold on a loaded TCG host.
const CONTROL_DELAY: Duration = Duration::from_secs(16);

/// What the fencing test relies on, checked with librbd alone (no ublkd): a write that
/// a killed client left held on loopback ([`LoDelay`]) still reaches the OSD after the
/// client's death, so it lands over a newer write by the lock's next owner unless that
/// owner blocklisted the dead one when it broke its lock. Both ways are run: with
/// `rbd_blocklist_on_break_lock = false` the old data must win (else the fencing test
/// could not fail), with the default the new data must, and the OSD logs refusing the
/// old write.
#[test]
fn a_delayed_write_of_a_killed_client_lands_unless_it_is_fenced() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "delayed";
    cluster.create_image(image, 16 * MIB);
    let block = 7;
    let tags = [
        (1, "the old client's first write"),
        (2, "the old client's held write"),
        (3, "the new owner's write"),
    ];
    let mut outcomes = Vec::new();
    for fence in [false, true] {
        let (mut old, address) = OldClient::start(cluster, image, block);
        // Its connections to the OSD, held from now on.
        let pid = old.child.id();
        let osd = osd_ports(cluster);
        let ports: Vec<u16> = tcp_connections(pid)
            .into_iter()
            .filter(|(_, remote)| osd.contains(remote))
            .map(|(local, _)| local)
            .collect();
        assert!(!ports.is_empty(), "the old client has no connection to the OSD ({osd:?})");
        let log_from = osd_debug(cluster, true);
        let delay = LoDelay::new(&ports, CONTROL_DELAY);
        let held_from = Instant::now();
        old.write(2);
        wait_held(&delay, BLOCK as u64);
        std::thread::sleep(Duration::from_millis(500));
        drop(old);
        // The next owner breaks the dead one's lock (blocklisting it, or not) and writes.
        let answer = cluster
            .request(json!({
                "op": "take_over", "image": image, "offset": block * BLOCK as u64,
                "data": hex(&tagged(3)), "blocklist": fence
            }))
            .unwrap_or_else(|e| panic!("take over: {e}\n{}", cluster.log_tails()));
        let taken = held_from.elapsed();
        let (bytes, _, _) = delay.held();
        assert!(
            taken < CONTROL_DELAY && bytes >= BLOCK as u64,
            "the new owner wrote {taken:?} after the hold began, with {bytes} bytes still held: \
             the old write was not held until after it ({answer})"
        );
        wait_delivered(&delay, held_from);
        drop(delay);
        osd_debug(cluster, false);
        let refused = refused_by_osd(cluster, log_from, &address);
        let data = cluster.read(image, None, block * BLOCK as u64, BLOCK);
        let blocklisted = cluster.blocklist_ls().contains(&address);
        outcomes.push(format!(
            "blocklist on break {fence}: the block holds {}, {address} blocklisted: {blocklisted}",
            which(&data, &tags)
        ));
        if fence {
            assert!(data == tagged(3), "fenced: {}\n{}", which(&data, &tags), outcomes.join("\n"));
            assert!(blocklisted, "{address} not blocklisted: {:?}", cluster.blocklist_ls());
            assert!(refused, "the OSD refused no write of {address}: the held write never came");
        } else {
            assert!(
                data == tagged(2),
                "unfenced, the held write must land last, but the block holds {}: the fencing \
                 test could not fail\n{}",
                which(&data, &tags),
                outcomes.join("\n")
            );
            assert!(!blocklisted, "{address} was blocklisted without fencing");
        }
    }
    eprintln!("delayed writes ({CONTROL_DELAY:?} on loopback): {}", outcomes.join("; "));
    cluster.forget_image(image);
}

/// Sets osd.0's `debug_osd` to 10 (it then logs each op it refuses from a blocklisted
/// client) or back to its default; the length of its log before.
fn osd_debug(cluster: &Cluster, on: bool) -> usize {
    let level = if on { "10" } else { "1/5" };
    cluster.osd_admin(json!({"prefix": "config set", "var": "debug_osd", "val": [level]}));
    cluster.osd_log().len()
}

/// Whether osd.0 logged refusing an op of `address` (blocklisted) after `log_from`.
fn refused_by_osd(cluster: &Cluster, log_from: usize, address: &str) -> bool {
    let log = cluster.osd_log();
    log.get(log_from..)
        .unwrap_or_default()
        .lines()
        .any(|l| l.contains("is blocklisted") && l.contains(address))
}

fn hex(data: &[u8]) -> String {
    data.iter().map(|b| format!("{b:02x}")).collect()
}

/// Waits (at most 30 s) until `delay` holds at least `bytes`: a write is queued there.
fn wait_held(delay: &LoDelay, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while delay.held().0 < bytes {
        assert!(Instant::now() < deadline, "no write held on loopback: {:?}", delay.held());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `delay` has delivered all it held since `from` (its delay after
/// `from`, and nothing left), then a little longer for the OSD to act on it.
fn wait_delivered(delay: &LoDelay, from: Instant) {
    let deadline = from + delay.delay + Duration::from_secs(60);
    while from.elapsed() < delay.delay || delay.held().1 > 0 {
        assert!(Instant::now() < deadline, "still held: {:?}", delay.held());
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
}

/// fio writes and verifies an rbd device (4k–128k random reads and writes, crc32c on
/// every 4 KiB, pass after pass) while its worker is SIGKILLed three times, the OSD is
/// killed -9 and restarted, and ublkd is restarted (SIGTERM; the next ublkd takes the
/// worker over): every pass exits 0, every block of the region verifies after, and the
/// image read from the cluster is what the device reads.
#[test]
fn fio_verify_survives_worker_kills_an_osd_restart_and_a_ublkd_restart() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "fio";
    let size = 64 * MIB;
    let region = 16 * MIB;
    cluster.create_image(image, size);
    let mut ublkd = Ublkd::start_with("rbd-fio", "", &[("UBLKD_LOG", "info")]);
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let dev = ublkd.status_of(id);
    assert_eq!((dev["state"].as_str(), dev["target"].as_str()), (Some("LIVE"), Some("rbd")));
    assert_eq!(dev["size_bytes"].as_u64(), Some(size), "{dev}");
    let node = block_dev(id);
    chaos::prefill(&node, region);

    let fio = BackgroundPasses::start(&node, region, 0x7b0);
    let mut events = Vec::new();
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    events.push(format!("worker {} killed", ublkd.kill_worker(id)));
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    let took = cluster.restart_osd();
    events.push(format!("OSD restarted ({:.1} s)", took.as_secs_f64()));
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    events.push(format!("worker {} killed", ublkd.kill_worker(id)));
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    let serving = ublkd.worker_pid(id);
    // With its spare standing by (an open image, watched): the stopping ublkd asks the
    // spare to exit rather than killing it, so that it closes the image. A killed
    // spare's watch stays for the cluster's 30 s, which the check after the delete
    // below sees. (In CI that watch also held the deleted worker's close past its 5 s
    // grace, so that the worker was killed and left its own watch too.)
    ublkd.wait_until("the spare standing by", || ublkd.status_of(id)["standby_pid"].is_u64());
    ublkd.signal_and_restart(libc::SIGTERM, || {});
    ublkd.wait_until("the device LIVE after ublkd's restart", || {
        ublkd.status_of(id)["state"] == "LIVE"
    });
    let dev = ublkd.status_of(id);
    assert_eq!(dev["worker_pid"].as_u64(), Some(u64::from(serving)), "not taken over: {dev}");
    // The new ublkd counts its own recoveries: none, if it took the worker over.
    assert_eq!(dev["recoveries"], 0, "ublkd's restart cost a recovery: {dev}");
    events.push("ublkd restarted".into());
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    events.push(format!("worker {} killed", ublkd.kill_worker(id)));
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    let passes = fio.finish().unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    chaos::verify_region(&node, region)
        .unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    let dev = ublkd.status_of(id);
    assert_eq!(dev["state"], "LIVE", "{dev}");
    assert_eq!(dev["errors"].as_u64(), Some(0), "{dev}");
    // The device reads what the cluster stores.
    let on_device = device_checksum(&node);
    assert_eq!(
        cluster.export_checksum(image, None),
        on_device,
        "the image differs from the device"
    );
    eprintln!(
        "rbd fio: {} passes clean across {}; {} recoveries, last stall {} ms",
        passes.len(),
        events.join(", "),
        dev["recoveries"],
        dev["last_recovery_ms"]
    );
    ublkd.del(id);
    // A deleted device's workers closed the image: no watch of theirs is left for the
    // cluster to time out, so the image can be removed at once.
    let watchers = cluster.watchers(image);
    assert!(watchers.is_empty(), "watchers left after `ublkctl del`: {watchers:?}");
    cluster.remove_image(image);
    ublkd.stop();
}

/// How long the cluster stays away: many times the hang limit the test sets
/// ([`AWAY_HUNG_TIMEOUT_SECS`]), and past librados' own 10 s after which an
/// operation counts as laggy (`objecter_timeout`).
const AWAY_FOR: Duration = Duration::from_secs(15);
/// `recovery.hung_timeout_secs` while the cluster is away: short, so that waiting for
/// the cluster is shown to be no hang in a short outage.
const AWAY_HUNG_TIMEOUT_SECS: u64 = 2;

/// The whole cluster away for [`AWAY_FOR`] (monitor and OSD killed, then started
/// again) under fio verify: the device holds its I/O and keeps its worker (waiting for
/// the cluster is no hang, past the hang limit many times), `ublkctl status` says what
/// it waits for, and fio goes on without an error once the cluster is back. Then, on a
/// device of a ublkd with `recovery.rbd_cluster_wait_secs = 4`, a read the cluster
/// (away again) does not answer fails with EIO in about that long.
#[test]
fn the_whole_cluster_away_holds_io_past_the_hang_limit_and_says_why() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "away";
    let region = 16 * MIB;
    cluster.create_image(image, 64 * MIB);
    let hung = format!("[recovery]\nhung_timeout_secs = {AWAY_HUNG_TIMEOUT_SECS}\n");
    let ublkd = Ublkd::start_with("rbd-away", &hung, &[("UBLKD_LOG", "info")]);
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let node = block_dev(id);
    chaos::prefill(&node, region);
    let worker = ublkd.worker_pid(id);
    let fio = BackgroundPasses::start(&node, region, 0xa3a);
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    let mut note = None;
    let away = Instant::now();
    cluster.away(|| {
        while away.elapsed() < AWAY_FOR {
            let dev = ublkd.status_of(id);
            assert_eq!(dev["worker_pid"].as_u64(), Some(u64::from(worker)), "replaced: {dev}");
            if let Some(text) = dev["note"].as_str() {
                note = Some(text.to_owned());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    });
    let back = away.elapsed();
    let note = note.unwrap_or_else(|| panic!("status never said why no I/O completed"));
    assert!(note.contains("waits for the Ceph cluster (image rbd/away)"), "{note}");
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    let passes = fio.finish().unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    chaos::verify_region(&node, region)
        .unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    let dev = ublkd.status_of(id);
    assert_eq!((dev["errors"].as_u64(), dev["recoveries"].as_u64()), (Some(0), Some(0)), "{dev}");
    assert!(ublkd.log().contains("backend_slow"), "the journal never said it waited");
    ublkd.del(id);
    ublkd.stop();

    // Those who prefer EIO to waiting.
    let ublkd = Ublkd::start_with(
        "rbd-away-eio",
        "[recovery]\nrbd_cluster_wait_secs = 4\n",
        &[("UBLKD_LOG", "info")],
    );
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let node = block_dev(id);
    // The cluster killed: no OSD answers the read at all.
    let mut read = None;
    let mut waited = Duration::ZERO;
    cluster.away(|| {
        let asked = Instant::now();
        read = Some(
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&node)
                .and_then(|f| {
                    let mut buf = Block([0; BLOCK]);
                    std::os::unix::fs::FileExt::read_at(&f, &mut buf.0, 8 * MIB)
                }),
        );
        waited = asked.elapsed();
    });
    let read = read.expect("the read was made");
    let err = read.expect_err("a read the cluster could not answer succeeded");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        (Duration::from_secs(3)..Duration::from_secs(30)).contains(&waited),
        "failed after {waited:?}, not about 4 s"
    );
    eprintln!(
        "rbd cluster away {:.0} s: {} fio passes clean, the worker kept, status said \"{note}\"; \
         with rbd_cluster_wait_secs = 4 a read failed with EIO after {:.1} s",
        back.as_secs_f64(),
        passes.len(),
        waited.as_secs_f64()
    );
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(image);
}

/// An rbd worker keeps the host's network (it is its own Ceph client), but its
/// sandbox lets it connect only to the cluster's ports: a hooked worker that tries a
/// port where something else listens on the same host is refused by Landlock (EACCES)
/// and serves on; the listener sees no connection.
#[test]
fn an_rbd_worker_reaches_the_clusters_ports_only() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "sandboxed";
    cluster.create_image(image, 16 * MIB);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let attack = "tcp-connect-elsewhere";
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let ublkd = Ublkd::start_with(
        "rbd-sandboxed",
        &extra,
        &[("UBLKD_WORKER_ATTACK", attack), ("UBLKD_WORKER_ATTACK_PORT", &port)],
    );
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let line = format!("attack {attack}: blocked");
    ublkd.wait_until("the attack's outcome", || {
        ublkd.log().contains(&line) || ublkd.log().contains("ESCAPED")
    });
    let log = ublkd.log();
    assert!(!log.contains("ESCAPED"), "the rbd worker reached port {port}:\n{log}");
    let outcome = log.lines().find(|l| l.contains(&line)).unwrap().to_owned();
    assert!(outcome.contains("Permission denied"), "{outcome}");
    assert!(listener.accept().is_err(), "port {port} saw a connection");
    let node = block_dev(id);
    write_block(&node, 3, &tagged(0x5a));
    assert_eq!(read_block(&node, 3), tagged(0x5a));
    let dev = ublkd.status_of(id);
    assert_eq!(dev["recoveries"], 0, "{dev}");
    assert!(dev["sandbox"]["landlock"].as_str().is_some(), "{dev}");
    eprintln!("rbd sandbox: {outcome}");
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(image);
}

/// The pid of a process whose command line holds `--probe-rbd`, and its
/// `/proc/PID/status`, if one runs now.
fn probe_status() -> Option<(u32, String)> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
        if !cmdline.split(|&b| b == 0).any(|arg| arg == b"--probe-rbd") {
            return None;
        }
        Some((pid, std::fs::read_to_string(entry.path().join("status")).ok()?))
    })
}

/// The value of `field` in a `/proc/PID/status` text.
fn status_field<'a>(status: &'a str, field: &str) -> &'a str {
    status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')).map_or("", str::trim)
}

/// No Ceph code runs as root: the probe that opens the image at `add` runs in the
/// worker's sandbox (a hooked worker pauses it once sandboxed, and its `/proc` status is
/// read meanwhile: seccomp filtering, no capability, the worker user), its stderr
/// reaches ublkd's log through the workers' relay; and the worker that then serves the
/// image may make TCP sockets only: its UDP socket fails with EPERM, and it serves on.
#[test]
fn an_rbd_probe_runs_sandboxed_and_a_worker_gets_no_udp_socket() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "probed";
    cluster.create_image(image, 16 * MIB);
    let attack = "udp-socket";
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let ublkd = Ublkd::start_with(
        "rbd-probe-sandboxed",
        &extra,
        &[("UBLKD_WORKER_ATTACK", attack), ("UBLKD_WORKER_PROBE_PAUSE_MS", "3000")],
    );
    // Watched from a thread while the add waits on the probe.
    let watch = std::thread::spawn(|| {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut seen = None;
        while Instant::now() < deadline {
            if let Some((pid, status)) = probe_status() {
                let sandboxed = status_field(&status, "Seccomp") == "2";
                seen = Some((pid, status));
                if sandboxed {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        seen
    });
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let (pid, status) = watch.join().unwrap().expect("no --probe-rbd process was seen");
    assert_eq!(status_field(&status, "Seccomp"), "2", "probe {pid}:\n{status}");
    assert_eq!(status_field(&status, "NoNewPrivs"), "1", "probe {pid}:\n{status}");
    for caps in ["CapEff", "CapPrm", "CapBnd"] {
        assert_eq!(status_field(&status, caps), "0000000000000000", "probe {pid}:\n{status}");
    }
    let uids: Vec<&str> = status_field(&status, "Uid").split_whitespace().collect();
    assert!(uids.len() == 4 && uids.iter().all(|u| *u != "0"), "probe {pid}:\n{status}");
    // The first process of a pid namespace of its own, as a worker is.
    let nspid: Vec<&str> = status_field(&status, "NSpid").split_whitespace().collect();
    assert_eq!(nspid, [pid.to_string().as_str(), "1"], "probe {pid}:\n{status}");
    let log = ublkd.log();
    let paused = log
        .lines()
        .find(|l| l.contains("probe: sandboxed, pausing"))
        .unwrap_or_else(|| panic!("the probe's stderr never reached ublkd's log:\n{log}"));
    assert!(paused.contains("worker:"), "not relayed as a worker's line: {paused}");
    // The worker's attack, once it serves.
    let line = format!("attack {attack}: blocked");
    ublkd.wait_until("the attack's outcome", || {
        ublkd.log().contains(&line) || ublkd.log().contains("ESCAPED")
    });
    let log = ublkd.log();
    assert!(!log.contains("ESCAPED"), "the rbd worker made a UDP socket:\n{log}");
    let outcome = log.lines().find(|l| l.contains(&line)).unwrap().to_owned();
    assert!(outcome.contains("Operation not permitted"), "{outcome}");
    let node = block_dev(id);
    write_block(&node, 5, &tagged(0x6b));
    assert_eq!(read_block(&node, 5), tagged(0x6b));
    let dev = ublkd.status_of(id);
    assert_eq!(dev["recoveries"], 0, "{dev}");
    eprintln!(
        "rbd probe {pid}: Seccomp 2, CapEff 0, Uid {}; worker: {outcome}",
        uids.first().unwrap_or(&"?")
    );
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(image);
}

/// ext4 made on an rbd device, mounted, files written; `ublkctl upgrade` moves the device
/// to a new worker under the mounted filesystem (the new one takes the image's lock over
/// from the old); the files read back from the device, more are written, and after an
/// unmount fsck finds the filesystem clean.
#[test]
fn ext4_on_an_rbd_device_survives_an_upgrade() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "ext4";
    cluster.create_image(image, 128 * MIB);
    let ublkd = Ublkd::start("rbd-ext4");
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let node = block_dev(id);
    let mnt = PathBuf::from("/tmp/ublkd-test-rbd-mnt");
    run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&node));
    let mount = Mount::new(&node, &mnt);
    let files = write_files(&mnt, 11);
    let sums =
        |root: &Path| -> Vec<String> { files.iter().map(|f| sha256(&root.join(f))).collect() };
    let written = sums(&mnt);
    run_ok(&mut Command::new("sync"));

    let old = ublkd.worker_pid(id);
    let owners = cluster.lock_owners(image);
    let upgraded = Instant::now();
    let out = ublkd.ctl(&["upgrade", "-n", &id.to_string()]);
    let took = upgraded.elapsed();
    let text = describe(&out);
    assert!(out.status.success(), "upgrade failed: {text}\n{}", ublkd.log());
    assert!(text.contains(&format!("device {id}: upgraded to")), "{text}");
    let new = ublkd.worker_pid(id);
    assert_ne!(new, old, "the upgrade left the old worker serving");
    assert_ne!(cluster.lock_owners(image), owners, "the lock did not move to the new worker");

    // Read from the device, not the page cache.
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert_eq!(sums(&mnt), written, "files changed across the upgrade");
    write_file(&mnt.join("after"), &pattern(99, 2_345_678));
    run_ok(&mut Command::new("sync"));
    mount.umount();
    let fsck = run(Command::new("fsck.ext4").arg("-fn").arg(&node));
    assert_eq!(fsck.status.code(), Some(0), "fsck.ext4 -fn found problems:\n{}", describe(&fsck));
    let mount = Mount::new(&node, &mnt);
    assert_eq!(sums(&mnt), written);
    assert!(std::fs::read(mnt.join("after")).unwrap() == pattern(99, 2_345_678), "after");
    mount.umount();
    eprintln!(
        "rbd upgrade in {:.1} s: {}",
        took.as_secs_f64(),
        String::from_utf8_lossy(&out.stdout).trim()
    );
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(image);
}

/// `ublkctl list`'s output.
fn listed(ublkd: &Ublkd) -> String {
    ublkd.ctl_ok(&["list"])
}

/// Each bad input makes `ublkctl add` fail with one line that names the problem (all of
/// `words`, case-insensitively), within `limit`, and no device.
fn assert_refused(ublkd: &Ublkd, args: &[String], words: &[&str], limit: Duration) -> String {
    let before = (listed(ublkd), kernel_devices());
    let mut full = vec!["add"];
    full.extend(args.iter().map(String::as_str));
    let asked = Instant::now();
    let out = ublkd
        .ctl
        .run_within(&full, limit)
        .unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    let took = asked.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(!out.status.success(), "`ublkctl {}` succeeded: {}", full.join(" "), describe(&out));
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr:?}");
    let lower = stderr.to_lowercase();
    for word in words {
        assert!(lower.contains(&word.to_lowercase()), "{word:?} not in {stderr:?}");
    }
    assert_eq!((listed(ublkd), kernel_devices()), before, "a device was made: {stderr}");
    format!("{:.1} s: {stderr}", took.as_secs_f64())
}

/// A missing image, a wrong key, a cluster that does not answer, a missing snapshot and
/// an image without a pool: each `ublkctl add` fails with one line naming it, and no
/// device is made.
#[test]
fn bad_rbd_inputs_are_named() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "bad-inputs";
    cluster.create_image(image, 16 * MIB);
    let ublkd = Ublkd::start("rbd-bad-inputs");
    let quick = Duration::from_secs(60);
    let mut said = Vec::new();

    let args = cluster.add_args(&Cluster::spec("no-such-image"), &[]);
    said.push(assert_refused(&ublkd, &args, &["no-such-image", "does not exist"], quick));

    // A keyring for the same client with another key (a valid one: cephx refuses it).
    let wrong = PathBuf::from("/tmp/ublkd-test-rbd-wrong.keyring");
    std::fs::write(
        &wrong,
        format!("[client.{CLIENT_ID}]\n\tkey = AQDj1I1nAAAAABAAcm9uZy1rZXktd3Jvbmc0Mg==\n"),
    )
    .unwrap();
    let mut args = cluster.add_args(&Cluster::spec(image), &[]);
    let at = args.iter().position(|a| a == "--keyring").unwrap();
    args[at + 1] = wrong.display().to_string();
    said.push(assert_refused(&ublkd, &args, &["key"], quick));

    // A cluster whose mon is not there: a closed port, and a short mount timeout (what
    // librados waits for a mon; ublkd's own deadline applies if it is shorter).
    let unreachable = PathBuf::from("/tmp/ublkd-test-rbd-unreachable.conf");
    std::fs::write(
        &unreachable,
        "[global]\nmon_host = [v2:127.0.0.1:1,v1:127.0.0.1:2]\nclient_mount_timeout = 5\n\
         auth_client_required = cephx\n",
    )
    .unwrap();
    let mut args = cluster.add_args(&Cluster::spec(image), &[]);
    let at = args.iter().position(|a| a == "--ceph-conf").unwrap();
    args[at + 1] = unreachable.display().to_string();
    said.push(assert_refused(&ublkd, &args, &["answered"], Duration::from_secs(180)));

    let args = cluster.add_args(&format!("{}@no-such-snap", Cluster::spec(image)), &[]);
    said.push(assert_refused(&ublkd, &args, &["no-such-snap", "does not exist"], quick));

    let args = cluster.add_args(image, &[]);
    said.push(assert_refused(&ublkd, &args, &["pool"], quick));

    // Another client holds the image's lock: ublkd does not take it from a client it
    // did not start (breaking it would blocklist that client).
    let holder = cluster.request(json!({"op": "hold_lock", "image": image})).unwrap();
    let holder = holder.as_str().unwrap_or_default().to_owned();
    let args = cluster.add_args(&Cluster::spec(image), &[]);
    said.push(assert_refused(&ublkd, &args, &["locked by another client", &holder], quick));
    cluster.request(json!({"op": "release_lock", "image": image})).unwrap();
    assert!(!cluster.blocklist_ls().contains(&holder), "ublkd blocklisted {holder}");

    eprintln!("rbd bad inputs:\n  {}", said.join("\n  "));
    for file in [wrong, unreachable] {
        let _ = std::fs::remove_file(file);
    }
    ublkd.stop();
    cluster.forget_image(image);
}

/// An image without the exclusive-lock feature cannot fence a dead worker: `ublkctl
/// add` of a writable device on it fails in one line naming the `rbd feature enable`
/// command and `allow_unfenced`, and makes no device; a read-only device on it is
/// served (it writes nothing, so needs no lock), and so is a configured device with
/// `allow_unfenced = true`, writable, its writes reaching the image.
#[test]
fn an_image_without_exclusive_lock_is_served_writable_only_where_allowed() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let (refused, allowed, id) = ("unfenced", "unfenced-allowed", 7);
    cluster.create_image_without_lock(refused, 16 * MIB);
    cluster.create_image_without_lock(allowed, 16 * MIB);
    let configured = format!(
        "\n[[device]]\nid = {id}\ntarget = \"rbd\"\nimage = \"{}\"\nceph_conf = \"{}\"\n\
         ceph_id = \"{CLIENT_ID}\"\nkeyring = \"{}\"\nallow_unfenced = true\n",
        Cluster::spec(allowed),
        cluster.conf_path().display(),
        cluster.keyring_path().display()
    );
    let ublkd = Ublkd::start_with("rbd-unfenced", &configured, &[("UBLKD_LOG", "info")]);
    ublkd.wait_until("the configured unfenced device LIVE", || {
        ublkd.ctl.device(id).is_ok_and(|d| d["state"] == "LIVE")
    });

    let spec = Cluster::spec(refused);
    let command = format!("rbd feature enable {spec} exclusive-lock");
    let args = cluster.add_args(&spec, &[]);
    let said = assert_refused(
        &ublkd,
        &args,
        &["no exclusive-lock feature", &command, "allow_unfenced = true"],
        Duration::from_secs(60),
    );
    eprintln!("writable, no exclusive-lock: {said}");

    // Read-only: served (it writes nothing, so needs no lock). The kernel's disk is
    // read-only, a write is refused, and the image keeps its data.
    cluster.write(refused, 0, &tagged(3));
    let ro = add_rbd_with(&ublkd, cluster, &spec, &["--read-only"]);
    let node = block_dev(ro);
    assert_eq!(read_block(&node, 0), tagged(3), "the read-only device's data");
    let getro = run_ok(Command::new("blockdev").arg("--getro").arg(&node));
    assert_eq!(getro.trim(), "1", "{} is not read-only to the kernel", node.display());
    let refused_write = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&node)
        .and_then(|mut f| f.write_all(&Block([0xee; BLOCK]).0).and_then(|()| f.sync_all()));
    let errno = refused_write.as_ref().err().and_then(|e| e.raw_os_error());
    assert!(
        [libc::EROFS, libc::EPERM, libc::EACCES].map(Some).contains(&errno),
        "a write to the read-only rbd device: {refused_write:?}"
    );
    let status = ublkd.status_of(ro);
    assert_eq!((&status["read_only"], &status["writes"]), (&json!(true), &json!(0)), "{status}");
    assert_eq!(status["backing"], spec.as_str(), "{status}");
    assert_eq!(cluster.read(refused, None, 0, BLOCK), tagged(3), "the image changed");
    ublkd.del(ro);
    // Nor does a read-only device take the lock of an image that has the feature.
    let locked = "read-only-locked";
    cluster.create_image(locked, 16 * MIB);
    let ro = add_rbd_with(&ublkd, cluster, &Cluster::spec(locked), &["--read-only"]);
    assert!(cluster.lock_owners(locked).is_empty(), "a read-only device took the lock");
    ublkd.del(ro);
    cluster.forget_image(locked);

    // Allowed: writable, and a write reaches the image.
    let node = block_dev(id);
    write_block(&node, 1, &tagged(4));
    assert_eq!(cluster.read(allowed, None, BLOCK as u64, BLOCK), tagged(4));
    assert!(
        ublkd.log().contains("as allow_unfenced allows"),
        "the worker did not warn that it serves unfenced:\n{}",
        ublkd.log()
    );
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(refused);
    cluster.forget_image(allowed);
}

/// Least privilege: a device that names no cephx id connects as ublkd's own client,
/// `client.ublkd`, with only the caps the operator's guide documents (`profile rbd`),
/// and serves; one that connects as `client.admin` serves too, and is flagged in the
/// journal.
#[test]
fn a_device_connects_as_its_own_client_and_admin_is_flagged() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "own-client";
    cluster.create_image(image, 16 * MIB);
    let ublkd = Ublkd::start_with("rbd-own-client", "", &[("UBLKD_LOG", "info")]);
    let spec = Cluster::spec(image);
    // No --ceph-id and no --keyring: the id is the default, and its key is found
    // through the Ceph config file's `keyring = .../$name.keyring`.
    let conf = cluster.conf_path().display().to_string();
    let id = ublkd.add(&["-t", "rbd", "--image", &spec, "--ceph-conf", &conf]);
    write_block(&block_dev(id), 2, &tagged(5));
    assert_eq!(cluster.read(image, None, 2 * BLOCK as u64, BLOCK), tagged(5));
    assert_eq!(cluster.lock_owners(image).len(), 1, "the default client took the lock");
    let flag = "is reached as client.admin";
    assert!(!ublkd.log().contains(flag), "flagged without admin:\n{}", ublkd.log());
    ublkd.del(id);

    let admin_keyring = cluster.dir().join("client.admin.keyring").display().to_string();
    let args = ["--ceph-id", "admin", "--keyring", admin_keyring.as_str()];
    let id =
        ublkd.add(&[&["-t", "rbd", "--image", &spec, "--ceph-conf", &conf][..], &args].concat());
    write_block(&block_dev(id), 3, &tagged(6));
    assert_eq!(cluster.read(image, None, 3 * BLOCK as u64, BLOCK), tagged(6));
    let log = ublkd.log();
    assert!(
        log.lines().any(|l| l.contains(flag) && l.contains("event=\"rbd_admin_client\"")),
        "a device connecting as admin is not flagged:\n{log}"
    );
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(image);
}

/// The size of `/dev/ublkbN` as the block layer has it now (`/sys/block/ublkbN/size`).
fn disk_size(id: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/sys/block/ublkb{id}/size")).unwrap();
    text.trim().parse::<u64>().unwrap() << 9
}

/// Unmounts `mount`, drops the caches and mounts `dev` again: the files read back from
/// the device itself.
fn remount(mount: Mount, dev: &Path) -> Mount {
    let dir = mount.dir.clone();
    mount.umount();
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    Mount::new(dev, &dir)
}

/// An rbd device grows with its image either way. `ublkctl resize` grows the image
/// (through the device's workers: ublkd runs no Ceph code) under a mounted ext4, grown
/// online with `resize2fs`; a file written past the old end reads back after a worker
/// kill. Then `rbd resize` with the Ceph CLI elsewhere reaches the device by itself:
/// its disk takes the image's size (the worker's update watch tells ublkd), its record
/// too, and ext4 grows on it again.
#[test]
fn an_rbd_device_grows_with_its_image_either_way() {
    let _serial = serial();
    assert_ne!(kernel_features() & UBLK_F_UPDATE_SIZE, 0, "this test needs Linux 6.16+");
    let cluster = Cluster::shared();
    let image = "grows";
    cluster.create_image(image, 16 * MIB);
    let ublkd = Ublkd::start_with("rbd-resize", "", &[("UBLKD_LOG", "info")]);
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let dev = block_dev(id);
    run_ok(Command::new("mkfs.ext4").args(["-F", "-q"]).arg(&dev));
    let mut mount = Mount::new(&dev, Path::new("/tmp/rbd-resize-mnt"));
    let mnt = mount.dir.clone();
    write_file(&mnt.join("before"), &pattern(1, 3 * MIB as usize + 5));

    let said = ublkd.ctl_ok(&["resize", "-n", &id.to_string(), "-s", "40M"]);
    assert!(said.contains("resized from 16M to 40M"), "{said}\n{}", ublkd.log());
    assert_eq!(disk_size(id), 40 * MIB);
    assert_eq!(cluster.image_size(image), 40 * MIB, "the image did not grow with the device");
    run_ok(Command::new("resize2fs").arg(&dev));
    // More than the old disk held: some of it lies past the old end.
    write_file(&mnt.join("after"), &pattern(2, 20 * MIB as usize));
    run_ok(&mut Command::new("sync"));
    let mut files: Vec<(&str, String)> =
        ["before", "after"].into_iter().map(|f| (f, sha256(&mnt.join(f)))).collect();
    ublkd.kill_worker(id);
    mount = remount(mount, &dev);
    assert_eq!(disk_size(id), 40 * MIB, "after a worker kill");
    for (name, sum) in &files {
        assert_eq!(&sha256(&mnt.join(name)), sum, "{name} after a worker kill");
    }

    // Elsewhere: the Ceph CLI, while the device's worker holds the image's lock.
    let asked = Instant::now();
    cluster.rbd_resize(image, 64 * MIB);
    let deadline = Instant::now() + Duration::from_secs(120);
    while disk_size(id) != 64 * MIB {
        assert!(
            Instant::now() < deadline,
            "the disk is {} bytes 120 s after `rbd resize` to 64M\n{}",
            disk_size(id),
            ublkd.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("`rbd resize` reached the disk in {:.1} s", asked.elapsed().as_secs_f64());
    assert_eq!(ublkd.status_of(id)["size_bytes"], 64 * MIB, "the record keeps the old size");
    run_ok(Command::new("resize2fs").arg(&dev));
    write_file(&mnt.join("later"), &pattern(3, 20 * MIB as usize));
    run_ok(&mut Command::new("sync"));
    files.push(("later", sha256(&mnt.join("later"))));
    ublkd.kill_worker(id);
    mount = remount(mount, &dev);
    assert_eq!(disk_size(id), 64 * MIB, "after a worker kill");
    for (name, sum) in &files {
        assert_eq!(&sha256(&mnt.join(name)), sum, "{name} after the second worker kill");
    }
    mount.umount();
    let log = ublkd.log();
    assert_eq!(log.matches("event=\"resized\"").count(), 2, "{log}");
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(image);
}

/// How long the fencing test holds the old worker's write on loopback: past the kill,
/// the recovery (the new worker connects, breaks the old one's lock, which blocklists
/// it, and takes the lock), the re-issued write and the newer one.
const FENCE_DELAY: Duration = Duration::from_secs(20);

/// The fence, tested where it matters: a write the dead worker left in flight reaches
/// the OSD only after the next worker has written newer data to the same block.
///
/// ublkd never lets the old worker live past its replacement: a hung worker is
/// SIGKILLed (`recovery::kill_if_hung`) and the recovery begins once its death is seen,
/// so a write parked inside the old process (e.g. by `ceph osd pause`) dies with it and
/// proves nothing. What can outlive the process is what it handed to the kernel: here
/// its TCP segments to the OSD, held for [`FENCE_DELAY`] on loopback ([`LoDelay`], a
/// netem qdisc filtered by the old worker's source ports), as a slow network would
/// hold them. The test writes block A (old data), holds the old worker's OSD
/// connections, starts a write of OLD to the block (it goes out and is held), SIGKILLs
/// the worker; ublkd recovers the device with a new worker, the kernel re-issues the
/// write to it, then the test writes NEW. All this must happen while the old write is
/// still held (checked: netem still holds it). When netem lets it go, the OSD must
/// refuse it ("is blocklisted" in its log at debug_osd 10) and the block must hold NEW;
/// the old worker's address must be in `ceph osd blocklist ls`.
///
/// With fencing off (a worker that breaks the lock without blocklisting, e.g. with
/// `rbd_blocklist_on_break_lock = false`), the held write lands last and the block
/// holds OLD: [`a_delayed_write_of_a_killed_client_lands_unless_it_is_fenced`] shows
/// that with librbd alone, so this test can fail.
#[test]
fn the_dead_workers_client_is_fenced_before_the_next_one_writes() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "fence";
    cluster.create_image(image, 16 * MIB);
    let ublkd = Ublkd::start_with("rbd-fence", "", &[("UBLKD_LOG", "info")]);
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let node = block_dev(id);
    let block = 5;
    let tags = [(0xa1, "A (before)"), (0xb2, "OLD (the dead worker's held write)"), (0xc3, "NEW")];
    write_block(&node, block, &tagged(0xa1));
    let old = ublkd.worker_pid(id);
    let owners = cluster.lock_owners(image);
    assert_eq!(owners.len(), 1, "the worker does not hold the image's lock: {owners:?}");
    let old_address = owners[0].clone();
    let osd = osd_ports(cluster);
    let ports: Vec<u16> = tcp_connections(old)
        .into_iter()
        .filter(|(_, remote)| osd.contains(remote))
        .map(|(local, _)| local)
        .collect();
    assert!(!ports.is_empty(), "worker {old} has no connection to the OSD ({osd:?})");
    let log_from = osd_debug(cluster, true);

    let delay = LoDelay::new(&ports, FENCE_DELAY);
    let held_from = Instant::now();
    let mut old_write = start_block_write(&node, block, &tagged(0xb2));
    wait_held(&delay, BLOCK as u64);
    std::thread::sleep(Duration::from_secs(1));
    let recoveries = ublkd.status_of(id)["recoveries"].as_u64().unwrap_or(0);
    assert!(signal(old, libc::SIGKILL), "worker {old} is gone");
    ublkd.wait_replaced(id, old, recoveries);
    // The re-issued write completes through the new worker; then the newer data.
    let status = old_write.wait().unwrap();
    assert!(status.success(), "the write the dead worker held failed: {status}");
    write_block(&node, block, &tagged(0xc3));
    let written = held_from.elapsed();
    let (bytes, packets, _) = delay.held();
    assert!(
        written < FENCE_DELAY && bytes >= BLOCK as u64,
        "NEW written {written:?} after the hold began, with {bytes} bytes ({packets} packets) \
         still held: the old write was not in flight while the new worker wrote (raise \
         FENCE_DELAY if the recovery was slow)\n{}",
        ublkd.log()
    );
    assert!(!pid_exists(old), "the old worker {old} is alive");
    wait_delivered(&delay, held_from);
    drop(delay);
    osd_debug(cluster, false);

    let on_device = read_block(&node, block);
    let stored = cluster.read(image, None, block * BLOCK as u64, BLOCK);
    let blocklist = cluster.blocklist_ls();
    let refused = refused_by_osd(cluster, log_from, &old_address);
    eprintln!(
        "fence: the block holds {} (device) / {} (cluster); the old worker {old_address} \
         blocklisted: {}; the OSD refused its held write: {refused}; NEW written {:.1} s into the hold",
        which(&on_device, &tags),
        which(&stored, &tags),
        blocklist.contains(&old_address),
        written.as_secs_f64()
    );
    assert!(stored == tagged(0xc3), "the cluster holds {}", which(&stored, &tags));
    assert!(on_device == tagged(0xc3), "the device reads {}", which(&on_device, &tags));
    assert!(blocklist.contains(&old_address), "{old_address} not in {blocklist:?}");
    assert!(
        refused,
        "the OSD did not refuse a write of {old_address}: the held write never reached it, \
         so the test proved nothing"
    );
    let owners = cluster.lock_owners(image);
    assert!(owners.len() == 1 && owners[0] != old_address, "lock owners: {owners:?}");
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(image);
}

/// The OSD's watch timeout while [`a_configured_device_comes_back_after_a_power_loss`]
/// runs: how long the cluster keeps a dead client's watch (30 s by default), which is
/// what a reboot must outlast for the dead client to count as dead.
const POWER_LOSS_WATCH_TIMEOUT_SECS: u32 = 5;

/// Sets osd.0's `osd_client_watch_timeout` (a watch registered after it takes it).
fn set_watch_timeout(cluster: &Cluster, secs: u32) {
    cluster.osd_admin(json!({
        "prefix": "config set", "var": "osd_client_watch_timeout", "val": [secs.to_string()]
    }));
}

/// A power loss: a configured rbd device under fio, ublkd and every worker SIGKILLed,
/// the kernel's devices and ublkd's /run directory gone as a reboot leaves them. Once
/// the dead clients' watches have lapsed (a reboot outlasts them), the ublkd started
/// afresh, which knows none of its predecessor's workers, breaks the dead client's
/// lock (blocklisting it) and serves the device again, with no `rbd lock rm`; every
/// block fio wrote reads back intact. (A live client's lock is still refused by name:
/// [`bad_rbd_inputs_are_named`].)
#[test]
fn a_configured_device_comes_back_after_a_power_loss() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "powerloss";
    let (id, size, region) = (9, 32 * MIB, 8 * MIB);
    cluster.create_image(image, size);
    // Set before the workers open the image: their watches take it.
    set_watch_timeout(cluster, POWER_LOSS_WATCH_TIMEOUT_SECS);
    struct Restore<'a>(&'a Cluster);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            set_watch_timeout(self.0, 30);
        }
    }
    let _restore = Restore(cluster);
    let configured = format!(
        "\n[[device]]\nid = {id}\ntarget = \"rbd\"\nimage = \"{}\"\nceph_conf = \"{}\"\n\
         ceph_id = \"{CLIENT_ID}\"\nkeyring = \"{}\"\n",
        Cluster::spec(image),
        cluster.conf_path().display(),
        cluster.keyring_path().display()
    );
    let mut ublkd = Ublkd::start_with("rbd-powerloss", &configured, &[("UBLKD_LOG", "info")]);
    ublkd.wait_until("the configured device LIVE", || {
        ublkd.ctl.device(id).is_ok_and(|d| d["state"] == "LIVE")
    });
    let node = block_dev(id);
    chaos::prefill(&node, region);
    let fio = BackgroundPasses::start(&node, region, 0x90e);
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    let dead_owners = cluster.lock_owners(image);
    assert_eq!(dead_owners.len(), 1, "the serving worker holds the lock: {dead_owners:?}");

    // The power goes.
    ublkd.sigkill();
    for pid in worker_pids() {
        signal(pid, libc::SIGKILL);
    }
    // What the reboot takes with it: the kernel's devices (fio's I/O in flight fails
    // with them, as it would with the machine) and /run.
    let ctrl = CtrlClient::open().expect("/dev/ublk-control");
    for dev in kernel_devices() {
        let _ = ctrl.stop_dev(dev);
        ctrl.del_dev(dev).unwrap_or_else(|e| panic!("deleting ublk device {dev}: {e}"));
    }
    // Its I/O failed with the devices: what the passes say is of no interest.
    let _ = fio.finish();
    std::fs::remove_dir_all("/run/ublkd-test-rbd-powerloss").expect("wiping ublkd's /run");
    assert_eq!(cluster.lock_owners(image), dead_owners, "the dead client's lock is left");
    // The reboot outlasts the dead clients' watches.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cluster.watchers(image).is_empty() {
        assert!(
            Instant::now() < deadline,
            "dead clients still watch: {:?}",
            cluster.watchers(image)
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    ublkd.restart();
    ublkd.wait_until("the configured device LIVE after the reboot", || {
        ublkd.ctl.device(id).is_ok_and(|d| d["state"] == "LIVE")
    });
    let owners = cluster.lock_owners(image);
    assert!(
        owners.len() == 1 && owners != dead_owners,
        "the new worker should hold the lock: {owners:?} (dead: {dead_owners:?})"
    );
    let blocklist = cluster.blocklist_ls();
    assert!(
        blocklist.iter().any(|b| b.contains(&dead_owners[0])),
        "the dead client {} is not blocklisted: {blocklist:?}",
        dead_owners[0]
    );
    assert!(
        ublkd.log().contains("no longer watches the image"),
        "the log does not say why the lock was broken:\n{}",
        ublkd.log()
    );
    chaos::verify_region(&node, region)
        .unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    ublkd.del(id);
    cluster.remove_image(image);
    ublkd.stop();
}

/// osd.0 SIGSTOPped until dropped (then SIGCONTed), so that a failing test leaves the
/// shared cluster running.
struct StoppedOsd(u32);

impl StoppedOsd {
    fn stop(cluster: &Cluster) -> StoppedOsd {
        let file = cluster.dir().join("run/osd.0.pid");
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        let pid: u32 = text.trim().parse().unwrap_or_else(|e| panic!("{file:?}: {text:?}: {e}"));
        assert!(signal(pid, libc::SIGSTOP), "osd.0 (pid {pid}) is not running");
        StoppedOsd(pid)
    }
}

impl Drop for StoppedOsd {
    fn drop(&mut self) {
        signal(self.0, libc::SIGCONT);
    }
}

/// The requests the kernel has in flight on device `id` (`/sys/block/ublkbN/inflight`:
/// reads and writes).
fn in_flight(id: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/sys/block/ublkb{id}/inflight")).unwrap();
    text.split_whitespace().map(|n| n.parse::<u64>().unwrap()).sum()
}

/// Asks ublkd's socket for `ublkctl list`'s answer in a loop (the request alone: the
/// ublkctl binary's start takes 1-2 s under emulation) until `stop`; each answer's time.
fn time_lists(socket: &Path, stop: &std::sync::atomic::AtomicBool) -> Vec<Duration> {
    use ublkd_proto::msg::{CtlRequest, CtlResponse};
    let mut times = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let asked = Instant::now();
        let answer = ublkd_tests::harness::ublkd::ask(socket, &CtlRequest::List { id: None });
        assert!(matches!(answer, Ok(CtlResponse::List(_))), "list: {answer:?}");
        times.push(asked.elapsed());
        std::thread::sleep(Duration::from_millis(50));
    }
    times
}

/// How long `ublkctl del` may take with the OSD stopped: below the 25 s after which
/// ublkd answers that the delete is not done yet (and ublkctl's own 30 s).
const DEL_DEADLINE: Duration = Duration::from_secs(20);
/// How long ublkd may take to exit on SIGTERM with the OSD stopped.
const SIGTERM_DEADLINE: Duration = Duration::from_secs(10);

/// The OSD stopped (SIGSTOP) with a write held on each of two devices: a safe
/// `ublkctl del` of one is refused at once (its disk is open by the writer), a forced
/// one answers "deleted" well within its deadline (ublkd kills the worker whose
/// requests wait on the cluster, and the kernel fails them with EIO), `ublkctl list`
/// answers in under 1 s throughout; then SIGTERM stops ublkd within its deadline with
/// the other device's write still held. The OSD back (SIGCONT), the next ublkd takes
/// the other device over, its held write lands, and neither its earlier data nor a
/// third image's is lost.
#[test]
fn a_delete_and_sigterm_never_wait_on_a_stopped_osd() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let (held, kept, other) = ("held", "kept", "bystander");
    for image in [held, kept, other] {
        cluster.create_image(image, 16 * MIB);
    }
    cluster.write(other, 0, &tagged(9));
    let mut ublkd = Ublkd::start_with("rbd-held", "", &[("UBLKD_LOG", "info")]);
    let gone = add_rbd(&ublkd, cluster, &Cluster::spec(held));
    let stays = add_rbd(&ublkd, cluster, &Cluster::spec(kept));
    write_block(&block_dev(stays), 3, &tagged(7));

    let osd = StoppedOsd::stop(cluster);
    let mut writes = [
        start_block_write(&block_dev(gone), 5, &tagged(1)),
        start_block_write(&block_dev(stays), 6, &tagged(2)),
    ];
    ublkd.wait_until("both writes held", || in_flight(gone) > 0 && in_flight(stays) > 0);

    let stop = std::sync::atomic::AtomicBool::new(false);
    let (refused, forced, lists) = std::thread::scope(|scope| {
        let lists = scope.spawn(|| time_lists(&ublkd.ctl.socket, &stop));
        let asked = Instant::now();
        let refused = (ublkd.ctl(&["del", "-n", &gone.to_string()]), asked.elapsed());
        let asked = Instant::now();
        let forced = (ublkd.ctl(&["del", "--force", "-n", &gone.to_string()]), asked.elapsed());
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        (refused, forced, lists.join().unwrap())
    });
    let log = ublkd.log();
    let (out, took) = &refused;
    assert!(
        !out.status.success(),
        "a safe delete of a device in use went through: {}",
        describe(out)
    );
    assert!(describe(out).contains("in use"), "{}", describe(out));
    assert!(*took < DEL_DEADLINE, "the refusal took {took:?}");
    let (out, took) = &forced;
    assert!(out.status.success(), "ublkctl del --force: {}\n{log}", describe(out));
    assert!(*took < DEL_DEADLINE, "the forced delete took {took:?}:\n{log}");
    assert!(log.contains("delete_held_io"), "no held I/O was given up:\n{log}");
    assert!(log.contains("rbd_held_given_up"), "the worker did not give up:\n{log}");
    let slowest = lists.iter().max().copied().unwrap_or_default();
    assert!(slowest < Duration::from_secs(1), "a list took {slowest:?}:\n{log}");
    assert!(!kernel_devices().contains(&gone), "device {gone} is still in the kernel");
    let status = writes[0].wait().unwrap();
    assert!(!status.success(), "the write held on the deleted device succeeded");

    let asked = Instant::now();
    let mut stopped_in = Duration::ZERO;
    ublkd.signal_and_restart(libc::SIGTERM, || {
        stopped_in = asked.elapsed();
        drop(osd);
    });
    assert!(stopped_in < SIGTERM_DEADLINE, "ublkd took {stopped_in:?} to stop on SIGTERM");
    ublkd.wait_until("the kept device LIVE again", || ublkd.status_of(stays)["state"] == "LIVE");
    let status = writes[1].wait().unwrap();
    assert!(status.success(), "the held write on the kept device failed: {status}");
    let node = block_dev(stays);
    let tags = [(7, "the write before"), (2, "the held write"), (0, "zeros")];
    assert_eq!(which(&read_block(&node, 3), &tags), "the write before");
    assert_eq!(which(&read_block(&node, 6), &tags), "the held write");
    // The cluster is healthy: it answers a write and a read, of an image ublkd never had.
    cluster.write(other, BLOCK as u64, &tagged(8));
    assert_eq!(cluster.read(other, None, 0, 2 * BLOCK), [tagged(9), tagged(8)].concat());
    eprintln!(
        "rbd OSD stopped: safe del refused in {:.1} s, forced del in {:.1} s, slowest of {} \
         lists {} ms, SIGTERM in {:.1} s",
        refused.1.as_secs_f64(),
        forced.1.as_secs_f64(),
        lists.len(),
        slowest.as_millis(),
        stopped_in.as_secs_f64()
    );
    ublkd.del(stays);
    ublkd.stop();
    cluster.forget_image(held);
    for image in [kept, other] {
        cluster.remove_image(image);
    }
}

/// The restart budget while [`a_recovery_waits_for_the_cluster_outside_the_budget`]
/// runs: 2 recoveries in 10 s, fewer than the new workers the test kills in any 10 s of
/// the outage, which lasts longer than the window ([`WAIT_AWAY_FOR`]).
const WAIT_BUDGET: &str = "[recovery]\nrestart_max = 2\nrestart_window_secs = 10\n\
                           worker_ready_timeout_secs = 10\nrbd_cluster_retry_secs = 2\n";
/// How long the cluster stays away in that test: longer than the budget's window.
const WAIT_AWAY_FOR: Duration = Duration::from_secs(16);

/// The whole cluster away under fio verify while the serving worker is killed, then
/// every new worker the recovery starts (more of them in the budget's window than the
/// budget allows, over longer than the window): the recovery waits for the cluster,
/// trying again after a backoff (status, text and JSON, says it waits for the Ceph
/// cluster) and never reaches the restart limit; once the cluster is back the device
/// is LIVE by itself, fio verifies clean, and the budget is intact (one more kill is
/// recovered).
#[test]
fn a_recovery_waits_for_the_cluster_outside_the_budget() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let image = "waited";
    let region = 16 * MIB;
    cluster.create_image(image, 64 * MIB);
    let ublkd = Ublkd::start_with("rbd-wait", WAIT_BUDGET, &[("UBLKD_LOG", "info")]);
    let id = add_rbd(&ublkd, cluster, &Cluster::spec(image));
    let node = block_dev(id);
    chaos::prefill(&node, region);
    ublkd.wait_until("the spare standing by", || ublkd.status_of(id)["standby_pid"].is_u64());
    let serving = ublkd.worker_pid(id);
    let fio = BackgroundPasses::start(&node, region, 0x3a1);
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    let mut killed = vec![serving];
    let (mut note, mut text) = (None, None);
    let away = Instant::now();
    cluster.away(|| {
        assert!(signal(serving, libc::SIGKILL), "worker {serving} is gone");
        while away.elapsed() < WAIT_AWAY_FOR {
            for pid in worker_pids() {
                if !killed.contains(&pid) {
                    signal(pid, libc::SIGKILL);
                    killed.push(pid);
                }
            }
            let dev = ublkd.status_of(id);
            if let Some(said) = dev["note"].as_str()
                && said.contains("waiting for the Ceph cluster")
                && note.is_none()
            {
                note = Some(said.to_owned());
                text = Some(describe(&ublkd.ctl(&["status"])));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let log = ublkd.log();
    let note = note.unwrap_or_else(|| panic!("status never said it waits for the cluster:\n{log}"));
    assert!(note.contains(&format!("(image {})", Cluster::spec(image))), "{note}");
    let text = text.unwrap();
    assert!(text.contains("waiting for the Ceph cluster"), "`ublkctl status` said: {text}");
    // More new workers lost within the window than the budget allows, had they counted.
    assert!(killed.len() > 3, "only workers {killed:?} were killed:\n{log}");
    // status's state is the kernel's, LIVE as soon as END_USER_RECOVERY returns on its
    // thread; the journal's line comes once the loop has taken that result, a moment
    // later (seconds on a loaded machine). The wait is for both; a journal that never
    // says it fails the wait.
    ublkd.wait_until("the device LIVE and the journal saying the cluster is back", || {
        ublkd.status_of(id)["state"] == "LIVE" && ublkd.log().contains("rbd_cluster_back")
    });
    let log = ublkd.log();
    assert!(!log.contains("restart_limit"), "the outage spent the restart budget:\n{log}");
    chaos::wait_for_io(&ublkd.ctl, &[id]);
    let passes = fio.finish().unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    chaos::verify_region(&node, region)
        .unwrap_or_else(|e| panic!("{e}\n--- ublkd log\n{}", ublkd.log()));
    let dev = ublkd.status_of(id);
    assert_eq!(dev["errors"].as_u64(), Some(0), "{dev}");
    let recoveries = dev["recoveries"].as_u64().unwrap_or(0);
    // The budget is intact: a kill now is recovered, not left for an operator.
    ublkd.kill_worker(id);
    eprintln!(
        "rbd cluster away {:.0} s: {} workers killed, status said \"{note}\"; LIVE again, {} \
         fio passes clean, {} recoveries, and one more after",
        WAIT_AWAY_FOR.as_secs_f64(),
        killed.len(),
        passes.len(),
        recoveries
    );
    ublkd.del(id);
    ublkd.stop();
    cluster.forget_image(image);
}
