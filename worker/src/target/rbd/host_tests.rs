//! The rbd target against a real Ceph cluster, without the kernel: requests started
//! and finished through a ring of the test's own, as a queue thread would, and the
//! fencing between two workers' clients. Built only with the `rbd-host-tests`
//! feature, and then never skipped: they need `UBLKD_TEST_RBD_SETUP`, the path of an
//! `RbdSetup` in JSON naming an image of at least 4 MiB that the tests overwrite.
//!
//! ```text
//! UBLKD_TEST_RBD_SETUP=/tmp/setup.json cargo test -p ublkd-worker \
//!     --features rbd-host-tests -- host_tests
//! ```

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use io_uring::{IoUring, types};
use ublkd_proto::msg::rbd::RbdSetup;
use ublkd_proto::uapi::{
    UBLK_IO_F_FUA, UBLK_IO_F_NOUNMAP, UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ,
    UBLK_IO_OP_WRITE, UBLK_IO_OP_WRITE_ZEROES,
};

use super::RbdTarget;
use crate::queue::user_data::UserData;
use crate::target::{IoReq, Reply, Step, Target, TargetWork};

/// The tests share one image: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const CHILD_ENV: &str = "UBLKD_TEST_RBD_CHILD";

fn setup() -> RbdSetup {
    let path = std::env::var("UBLKD_TEST_RBD_SETUP").expect(
        "the rbd host tests need UBLKD_TEST_RBD_SETUP: the path of an RbdSetup in JSON \
         (see host_tests.rs)",
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Stands in for queue thread 0: its ring, with the target's file registered.
struct Loop {
    ring: IoUring,
    work: TargetWork,
    /// Completions of the target's eventfd READ taken so far.
    wakes: usize,
}

impl Loop {
    fn new(target: &RbdTarget) -> Loop {
        let ring = IoUring::new(64).unwrap();
        let fd = target.fixed_file(0).expect("thread 0's eventfd").as_raw_fd();
        ring.submitter().register_files(&[fd]).unwrap();
        let mut l = Loop { ring, work: TargetWork::default(), wakes: 0 };
        target.arm(0, &mut l.work);
        l.push_work();
        l
    }

    fn push_work(&mut self) {
        for sqe in std::mem::take(&mut self.work.sqes) {
            // SAFETY: the target's READ points into its own completion list, which
            // outlives this ring (the ring is dropped first by every test).
            unsafe { self.ring.submission().push(&sqe) }.unwrap();
        }
    }

    fn req(op: u8, flags: u32, offset: u64, buf: &mut [u8], user_data: u64) -> IoReq {
        IoReq {
            op,
            flags,
            offset,
            len: buf.len() as u32,
            buf: buf.as_mut_ptr(),
            buf_index: None,
            reply: Reply { ring_fd: -1, user_data, thread: 0 },
        }
    }

    fn start(&mut self, target: &RbdTarget, req: &IoReq) {
        match target.start(req) {
            Step::Pending => {}
            other => panic!("start: {other:?}"),
        }
    }

    /// Waits until `n` requests finished (20 s at most): (user_data, result) of each.
    fn finished(&mut self, target: &RbdTarget, n: usize) -> Vec<(u64, i32)> {
        let mut all = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while all.len() < n {
            assert!(Instant::now() < deadline, "only {} of {n} finished: {all:?}", all.len());
            let timeout = types::Timespec::new().nsec(100_000_000);
            let args = types::SubmitArgs::new().timespec(&timeout);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
                Err(e) => panic!("{e}"),
            }
            let cqes: Vec<_> =
                self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (ud, res) in cqes {
                let Some(UserData::TargetOwn { key }) = UserData::decode(ud) else {
                    panic!("a completion the target did not ask for: {ud:#x}");
                };
                self.wakes += 1;
                target.on_own_cqe(0, key, res, &mut self.work);
                self.push_work();
                for (ud, res) in self.work.done.drain(..) {
                    // What the queue loop does with it: the target's `on_cqe`.
                    let req = Loop::req(0, 0, 0, &mut [], ud);
                    match target.on_cqe(&req, res, &mut 0) {
                        Step::Done(res) => all.push((ud, res)),
                        other => panic!("on_cqe: {other:?}"),
                    }
                }
            }
        }
        all
    }

    /// Runs one request to its end: its result.
    fn run(&mut self, target: &RbdTarget, op: u8, flags: u32, offset: u64, buf: &mut [u8]) -> i32 {
        let req = Loop::req(op, flags, offset, buf, 7);
        self.start(target, &req);
        let done = self.finished(target, 1);
        assert_eq!(done.len(), 1);
        done[0].1
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn requests_round_trip_through_librbd() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let target = RbdTarget::new(&setup(), 4 << 20, 1, false).unwrap();
    target.activate(Vec::new(), &[]).unwrap();
    let mut l = Loop::new(&target);
    const AT: u64 = 1 << 20;
    const LEN: usize = 64 << 10;

    let mut data = pattern(1, LEN);
    assert_eq!(l.run(&target, UBLK_IO_OP_WRITE, UBLK_IO_F_FUA, AT, &mut data), LEN as i32);
    assert_eq!(l.run(&target, UBLK_IO_OP_FLUSH, 0, 0, &mut []), 0);
    let mut back = vec![0u8; LEN];
    assert_eq!(l.run(&target, UBLK_IO_OP_READ, 0, AT, &mut back), LEN as i32);
    assert!(back == data, "read back other bytes than written");

    // DISCARD of a range inside one object reads back as zeroes.
    let mut range = vec![0u8; LEN];
    assert_eq!(l.run(&target, UBLK_IO_OP_DISCARD, 0, AT, &mut range), 0);
    back.fill(0xff);
    assert_eq!(l.run(&target, UBLK_IO_OP_READ, 0, AT, &mut back), LEN as i32);
    assert!(back.iter().all(|&b| b == 0), "a discarded range reads back non-zero");

    // WRITE_ZEROES, with and without NOUNMAP.
    for flags in [UBLK_IO_F_NOUNMAP, 0] {
        let mut data = pattern(2, LEN);
        assert_eq!(l.run(&target, UBLK_IO_OP_WRITE, 0, AT, &mut data), LEN as i32);
        assert_eq!(l.run(&target, UBLK_IO_OP_WRITE_ZEROES, flags, AT, &mut range), 0);
        back.fill(0xff);
        assert_eq!(l.run(&target, UBLK_IO_OP_READ, 0, AT, &mut back), LEN as i32);
        assert!(back.iter().all(|&b| b == 0), "WRITE_ZEROES (flags {flags:#x}) left data");
    }

    // A burst: 32 writes in flight at once, then 32 reads, each finished once.
    const N: usize = 32;
    let mut bufs: Vec<Vec<u8>> = (0..N).map(|i| pattern(i as u8, 4096)).collect();
    let wakes = l.wakes;
    for (i, buf) in bufs.iter_mut().enumerate() {
        let req = Loop::req(UBLK_IO_OP_WRITE, 0, (i as u64) << 12, buf, 100 + i as u64);
        l.start(&target, &req);
    }
    let mut done = l.finished(&target, N);
    done.sort_unstable();
    assert_eq!(done, (0..N).map(|i| (100 + i as u64, 4096)).collect::<Vec<_>>());
    let mut reads: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; 4096]).collect();
    for (i, buf) in reads.iter_mut().enumerate() {
        let req = Loop::req(UBLK_IO_OP_READ, 0, (i as u64) << 12, buf, 200 + i as u64);
        l.start(&target, &req);
    }
    let mut done = l.finished(&target, N);
    done.sort_unstable();
    assert_eq!(done, (0..N).map(|i| (200 + i as u64, 4096)).collect::<Vec<_>>());
    assert!(reads == bufs, "the burst read back other bytes");
    eprintln!("{} requests of the bursts took {} wakes", 2 * N, l.wakes - wakes);
    drop(l);
}

/// The earlier worker of the fencing test, in a process of its own (it is ended by
/// being fenced): takes the lock, says its client, and writes until it is fenced.
#[test]
#[ignore = "run by a_foreign_lock_is_refused_and_an_earlier_worker_is_fenced"]
fn earlier_worker_writes_until_fenced() {
    assert!(std::env::var_os(CHILD_ENV).is_some(), "started by the fencing test only");
    let target = RbdTarget::new(&setup(), 4 << 20, 1, false).unwrap();
    target.activate(Vec::new(), &[]).unwrap();
    let mut l = Loop::new(&target);
    println!("CLIENT {}", target.client_identity().unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut data = pattern(9, 4096);
    while Instant::now() < deadline {
        // Fenced, librbd fails this write with ESHUTDOWN and the target ends the
        // process (exit 73) before it is finished.
        let res = l.run(&target, UBLK_IO_OP_WRITE, 0, 0, &mut data);
        assert_eq!(res, 4096, "the earlier worker's write failed instead of ending it");
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("never fenced");
}

#[test]
fn a_foreign_lock_is_refused_and_an_earlier_worker_is_fenced() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "target::rbd::host_tests::earlier_worker_writes_until_fenced",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let earlier = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find_map(|line| line.strip_prefix("CLIENT ").map(str::to_string))
        .expect("the earlier worker said its client");

    let target = RbdTarget::new(&setup(), 4 << 20, 1, false).unwrap();
    let mine = target.client_identity().unwrap();
    assert_ne!(mine, earlier);
    // Not named in the fence list: another client's lock, left alone.
    let refused = target.activate(Vec::new(), &[]).unwrap_err().to_string();
    assert!(refused.contains(&format!("is locked by another client ({earlier})")), "{refused}");

    let started = Instant::now();
    target.activate(Vec::new(), &["10.9.9.9:0/1".into(), earlier.clone()]).unwrap();
    let fenced_in = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the fenced worker did not end");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(i32::from(ublkd_proto::exit::WorkerExit::Fenced.code())));

    // The new worker writes, and what it wrote stays.
    let mut l = Loop::new(&target);
    let mut data = pattern(5, 4096);
    assert_eq!(l.run(&target, UBLK_IO_OP_WRITE, 0, 0, &mut data), 4096);
    let mut back = vec![0u8; 4096];
    assert_eq!(l.run(&target, UBLK_IO_OP_READ, 0, 0, &mut back), 4096);
    assert!(back == data);
    eprintln!("fenced {earlier} and took the lock in {} ms", fenced_in.as_millis());
    drop(l);
}
