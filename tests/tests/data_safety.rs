//! Data safety across a recovery: a write that a dead worker left in flight to the
//! backing store must never land there after the re-issued write and newer writes to
//! the same block.
//!
//! The hazard. A loop worker writes the backing file with O_DIRECT through io_uring: the
//! write becomes a bio, and its SQE completes only when the bio does. When the worker
//! dies, the kernel does not wait for such writes. Its exit (`do_exit` →
//! `io_uring_files_cancel` → `io_uring_cancel_generic(false)`, io_uring/cancel.c) only
//! waits for *tracked* requests (`REQ_F_INFLIGHT`: those on io_uring fds), then
//! `io_uring_clean_tctx` → `io_wq_put_and_exit` waits for the io-wq threads, which only
//! *submit* an O_DIRECT write and return: the process is reaped, and its pidfd readable,
//! while its bios are still queued below. What then decides is when `/dev/ublkcN` is
//! released, because its release (`ublk_ch_release_work_fn`) re-queues the requests
//! the dead worker owned (`__ublk_fail_req` → `blk_mq_requeue_request` with REISSUE):
//!
//! - Without `recovery.fast_release`, the ring's last fd goes with the worker; the
//!   ring's teardown (`io_ring_exit_work`) waits for every request (`ctx->ref_comp`)
//!   before `io_ring_ctx_free` drops its file table and with it `/dev/ublkcN`. Safe.
//! - With zero copy, the in-flight `WRITE_FIXED` holds the request's auto-registered
//!   buffer; `ublk_check_and_reset_active_ref` makes the release wait (rescheduling
//!   itself every jiffy) until that buffer is let go, i.e. until the write completed.
//!   Safe, with or without the fast release.
//! - With the fast release in copy mode, ublkd unregisters the dead rings' files and
//!   closes its copies of them: `/dev/ublkcN` goes as soon as the ring's FETCH commands
//!   are cancelled, while the copy-mode write (holding only the backing file's node and
//!   pinned user pages) is still in flight. The kernel re-issues the request, the new
//!   worker serves it, the application sees it complete and writes newer data, and
//!   then the old write lands with stale data. That is why ublkd uses the fast release
//!   only where the kernel itself holds the re-issue back (zero copy), or where no
//!   target write can outlive the worker (null, memory, buffered loop files).
//!
//! The test. Storage normally completes such a write within milliseconds, so the test
//! makes it stall: the backing store is another ublk device (a memory one), and the
//! worker about to be killed is moved into a cgroup whose `io.max` lets no write to it
//! through (blk-throttle queues the bio, as a slow disk, a failing path or a busy
//! cgroup would). The new worker is not in that cgroup, so the re-issued and newer
//! writes overtake the old one if the recovery lets them. The test writes the old
//! data, kills the worker while that write is held, waits for either the re-issued
//! write to complete (the hazard's precondition: then it writes newer data) or a few
//! seconds without a recovery (the release waits, as it must), lifts the throttle, lets
//! the old write land, and checks that the block holds the newer data. With the fast
//! release in copy mode (before ublkd excluded it) it fails: the block held the old data.
//! To see that again, make `Device::fast_release_is_safe` (supervisor/src/device.rs)
//! return true: the copy-mode test then reports "the OLD data" (the path it took and the
//! recovery stall are printed either way; with the release waiting, the stall includes
//! the test's [`HOLD`]).
//!
//! Each test holds the write for [`HOLD`]. While the release waits, ublkd goes on
//! serving its other work (the waiting is its loop's, retried on later turns): the test
//! asks it for the device's status then. (Stacking a loop device on another ublk device
//! also means deleting the loop device first: ublkd holds its backing device open.)

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ublkd_tests::harness::machine::{self, block_dev, serial};
use ublkd_tests::harness::process::{run, signal};
use ublkd_tests::harness::storage::{WriteThrottle, pattern};
use ublkd_tests::harness::ublkd::Ublkd;

const BLOCK: usize = 4096;
/// The block the test writes (any will do; not the first, which other things read).
const BLOCK_NO: u64 = 100;
/// How long the test waits for the re-issued write to complete while the old write is
/// held, before it concludes that the release waits for the old write. A recovery
/// takes under a second in the VM.
const HOLD: Duration = Duration::from_secs(5);

/// Writes `data` at [`BLOCK_NO`] of `dev` with O_DIRECT, in a child (it may be held).
fn start_write(dev: &Path, data: &[u8]) -> Child {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let src = std::env::temp_dir().join(format!("data-safety-{}-{n}", std::process::id()));
    std::fs::write(&src, data).unwrap();
    Command::new("dd")
        .arg(format!("if={}", src.display()))
        .arg(format!("of={}", dev.display()))
        .args([&format!("bs={BLOCK}"), "count=1", &format!("seek={BLOCK_NO}"), "oflag=direct"])
        .args(["conv=notrunc", "status=none"])
        .stdin(Stdio::null())
        .spawn()
        .expect("cannot run dd")
}

fn write_block(dev: &Path, data: &[u8]) {
    let status = start_write(dev, data).wait().unwrap();
    assert!(status.success(), "dd to {} failed: {status}", dev.display());
}

/// The block at [`BLOCK_NO`] of `dev`, read with O_DIRECT.
fn read_block(dev: &Path) -> Vec<u8> {
    let out = run(Command::new("dd")
        .arg(format!("if={}", dev.display()))
        .args([&format!("bs={BLOCK}"), "count=1", &format!("skip={BLOCK_NO}"), "iflag=direct"])
        .arg("status=none"));
    assert!(out.status.success(), "dd from {} failed", dev.display());
    out.stdout
}

/// Writes in flight on `dev`, from `/sys/class/block/<dev>/inflight`.
fn writes_in_flight(dev: &Path) -> u64 {
    let name = dev.file_name().unwrap().to_str().unwrap();
    let text = std::fs::read_to_string(format!("/sys/class/block/{name}/inflight")).unwrap();
    text.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Whether `child` exits within `limit`.
fn wait_child(child: &mut Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// The kernel stacks of the writer's and the workers' threads and the block devices' counters, for a failure.
fn stacks(writer: u32) -> String {
    let mut out = String::new();
    for pid in [writer].into_iter().chain(machine::worker_pids()) {
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
            let p = task.path();
            let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
            let stack = std::fs::read_to_string(p.join("stack")).unwrap_or_default();
            out += &format!("{} {comm}{stack}", p.display());
        }
    }
    for d in ["ublkb0", "ublkb1"] {
        let f =
            std::fs::read_to_string(format!("/sys/class/block/{d}/inflight")).unwrap_or_default();
        out += &format!("{d} inflight {f}");
    }
    out
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn held_write_never_lands_after_newer_writes(mode: &str) {
    let _serial = serial();
    let name = format!("data-safety{mode}");
    let ublkd = Ublkd::start(&name);
    let backing = block_dev(ublkd.add(&["-t", "memory", "-s", "16M"]));
    let id = ublkd.add(&["-t", "loop", "-f", backing.to_str().unwrap(), mode]);
    let dev = block_dev(id);
    let (old, new) = (pattern(1, BLOCK), pattern(2, BLOCK));
    // The standby must be up, so that the recovery could be quick if allowed.
    ublkd.wait_until("a standby", || ublkd.status_of(id)["standby_pid"].is_u64());
    // 1 byte/s: a 4 KiB write waits over an hour.
    let stall = WriteThrottle::new(&name, &backing, 1);
    let worker = ublkd.worker_pid(id);
    stall.hold(worker);

    let mut held = start_write(&dev, &old);
    wait_for("the write to reach the worker", Duration::from_secs(20), || {
        writes_in_flight(&dev) == 1
    });
    // The worker submits it at once; give it time to reach blk-throttle.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(writes_in_flight(&dev), 1, "the write was not held");
    assert!(signal(worker, libc::SIGKILL), "worker {worker} is gone already");

    // Either the re-issued write completes (the fast path: then newer data follows
    // while the old write is still held), or the release waits for the old write.
    let overtaken = wait_child(&mut held, HOLD);
    if overtaken {
        write_block(&dev, &new);
    } else {
        // ublkd waits for the release without holding up its loop: it answers now,
        // while the old write is still held (it used to block here up to 15 s).
        let asked = Instant::now();
        let waiting = ublkd.status_of(id);
        let took = asked.elapsed();
        assert!(took < Duration::from_secs(5), "ublkd answered after {took:?} while releasing");
        assert!(waiting["worker_pid"].is_null(), "a worker serves already: {waiting}");
    }
    stall.release();
    assert!(
        overtaken || wait_child(&mut held, Duration::from_secs(30)),
        "the first write did not complete once the throttle was lifted:\n{}",
        stacks(held.id())
    );
    let status = held.wait().unwrap();
    assert!(status.success(), "the first write failed: {status}");
    if !overtaken {
        write_block(&dev, &new);
    }
    // The old write is dispatched once the throttle is lifted (counted in io.stat);
    // then it completes on the memory device.
    wait_for("the old write to be let go", Duration::from_secs(20), || {
        stall.written() >= BLOCK as u64
    });
    wait_for("the backing device to finish its writes", Duration::from_secs(20), || {
        writes_in_flight(&backing) == 0
    });

    let dev_status = ublkd.status_of(id);
    println!(
        "{mode}: {} the held write; recovery stall {} ms",
        if overtaken { "recovered before" } else { "waited for" },
        dev_status["last_recovery_ms"]
    );
    assert_eq!(dev_status["recoveries"], 1, "{dev_status}");
    let landed = read_block(&backing);
    let through = read_block(&dev);
    drop(stall);
    // The loop device first (also when the checks below fail): ublkd holds its backing
    // device open, and deleting a ublk device waits until nothing holds it.
    ublkd.del(id);
    assert!(
        landed == new,
        "block {BLOCK_NO} of {} holds {} after the dead worker's write landed",
        backing.display(),
        if landed == old {
            "the OLD data: the stale write overtook the newer one"
        } else {
            "neither write's data"
        }
    );
    assert_eq!(through, new, "reading through {} differs", dev.display());
    ublkd.stop();
}

#[test]
fn a_dead_copy_mode_workers_held_write_never_lands_after_newer_writes() {
    held_write_never_lands_after_newer_writes("--copy");
}

#[test]
fn a_dead_zero_copy_workers_held_write_never_lands_after_newer_writes() {
    held_write_never_lands_after_newer_writes("--zero-copy");
}
