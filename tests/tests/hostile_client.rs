//! Clients and workers that try to hold up or mislead the supervisor (in the VM).
//!
//! - A root client that trickles its request into the control socket a byte at a time
//!   must not delay anyone else's `ublkctl`, nor the recovery of a device whose worker
//!   dies meanwhile; an oversized frame gets an error and ublkd stays up.
//! - A worker that floods its stderr (the test-only `stderr-flood` attack of a worker
//!   built with `test-hooks`) is relayed with its identity, rate-limited, and a line it
//!   forges in the supervisor's format is marked as the worker's.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ublkd_proto::msg::{self, CtlRequest, CtlResponse};
use ublkd_tests::harness::machine::{block_dev, serial};
use ublkd_tests::harness::process::{hooked_worker, signal};
use ublkd_tests::harness::ublkd::Ublkd;

/// A client that connects and sends a request one byte every 100 ms, never finishing
/// it; when ublkd drops it, it connects again and starts over.
struct Trickler {
    stop: Arc<AtomicBool>,
    dropped: Arc<AtomicU32>,
    thread: Option<JoinHandle<()>>,
}

impl Trickler {
    fn start(socket: &Path) -> Trickler {
        let stop = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(AtomicU32::new(0));
        let (socket, s, d) = (socket.to_path_buf(), Arc::clone(&stop), Arc::clone(&dropped));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok(mut conn) = UnixStream::connect(&socket) else {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                // A length prefix of 1000 bytes, then body bytes that never complete it.
                for byte in 1000u32.to_le_bytes().into_iter().chain(std::iter::repeat(0)) {
                    if s.load(Ordering::Relaxed) {
                        return;
                    }
                    if conn.write_all(&[byte]).is_err() {
                        d.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        });
        Trickler { stop, dropped, thread: Some(thread) }
    }

    /// How many times ublkd dropped this client so far.
    fn dropped(&self) -> u32 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl Drop for Trickler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long `ublkctl list` takes, checking it succeeds: the median of three (the
/// processes' start under emulation on a busy host varies by hundreds of ms).
fn timed_list(ublkd: &Ublkd) -> Duration {
    let mut took: Vec<Duration> = (0..3)
        .map(|_| {
            let t = Instant::now();
            let out = ublkd.ctl_ok(&["list"]);
            assert!(out.contains("state LIVE"), "{out}");
            t.elapsed()
        })
        .collect();
    took.sort();
    took[1]
}

/// The slowest of five list requests made from this process (no process start in the
/// measurement): what the daemon itself takes to answer.
fn slowest_request(ublkd: &Ublkd) -> Duration {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            let mut conn = UnixStream::connect(&ublkd.ctl.socket).unwrap();
            msg::write_frame(&mut conn, &CtlRequest::List { id: None }).unwrap();
            let answer = msg::read_response(&mut conn).unwrap();
            assert!(matches!(&answer, CtlResponse::List(l) if l.len() == 1), "{answer:?}");
            t.elapsed()
        })
        .max()
        .unwrap()
}

#[test]
fn trickling_clients_do_not_delay_ublkctl() {
    let _serial = serial();
    let ublkd = Ublkd::start("hostile-list");
    ublkd.add(&["-t", "null", "-s", "1G"]);
    ublkd.ctl_ok(&["list"]); // the first start of ublkctl reads it from the host
    let (alone, alone_req) = (timed_list(&ublkd), slowest_request(&ublkd));

    let one = Trickler::start(&ublkd.ctl.socket);
    std::thread::sleep(Duration::from_millis(500));
    let (beside_one, beside_one_req) = (timed_list(&ublkd), slowest_request(&ublkd));

    let more: Vec<Trickler> = (0..7).map(|_| Trickler::start(&ublkd.ctl.socket)).collect();
    std::thread::sleep(Duration::from_millis(500));
    let (beside_eight, beside_eight_req) = (timed_list(&ublkd), slowest_request(&ublkd));
    let ms = |d: Duration| d.as_millis();
    eprintln!(
        "ublkctl list (median of 3): {} ms alone, {} ms beside 1 trickling client, {} ms \
         beside 8; a list request from the test (slowest of 5): {} / {} / {} ms",
        ms(alone),
        ms(beside_one),
        ms(beside_eight),
        ms(alone_req),
        ms(beside_one_req),
        ms(beside_eight_req)
    );
    // The daemon's answer is what the clients could delay: well under a second.
    let second = Duration::from_secs(1);
    assert!(beside_one_req < second, "a request took {beside_one_req:?} beside one trickler");
    assert!(beside_eight_req < second, "a request took {beside_eight_req:?} beside eight");
    // ublkctl's own start alone takes 1-3 s in the VM on a busy host (2 shared cores,
    // emulated): its bound leaves room for that, and none for a daemon held by a
    // client (the 1000-byte request the clients trickle would take 100 s).
    let patience = alone + Duration::from_secs(5);
    assert!(beside_one < patience, "ublkctl list took {beside_one:?} beside one trickler");
    assert!(beside_eight < patience, "ublkctl list took {beside_eight:?} beside eight");

    // Past the request deadline every trickler has been dropped at least once.
    ublkd.wait_until("ublkd to drop the trickling clients", || {
        one.dropped() > 0 && more.iter().all(|t| t.dropped() > 0)
    });
    assert!(ublkd.log().contains("sent no complete request within"), "{}", ublkd.log());
    drop((one, more));
    ublkd.stop();
}

#[test]
fn an_oversized_frame_is_refused_and_ublkd_stays_up() {
    let _serial = serial();
    let ublkd = Ublkd::start("hostile-frame");
    let mut conn = UnixStream::connect(&ublkd.ctl.socket).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    conn.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let answer = msg::read_response(&mut conn).unwrap();
    match answer {
        CtlResponse::Error { message } => {
            assert!(message.starts_with("bad request: "), "{message}");
            assert!(message.contains("more than the limit"), "{message}");
        }
        other => panic!("an oversized frame was answered with {other:?}"),
    }
    // A frame of the right size that is not a request.
    let mut conn = UnixStream::connect(&ublkd.ctl.socket).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    conn.write_all(&[8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).unwrap();
    let answer = msg::read_response(&mut conn).unwrap();
    assert!(
        matches!(&answer, CtlResponse::Error { message } if message.starts_with("bad request: ")),
        "{answer:?}"
    );
    ublkd.ctl_ok(&["status"]);
    ublkd.stop();
}

/// Reads the first 4 KiB of `dev` with O_DIRECT (from the device, not the page cache).
fn read_block(dev: &Path) {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .unwrap_or_else(|e| panic!("open {}: {e}", dev.display()));
    let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!ptr.is_null());
    // SAFETY: `ptr` is a fresh, zeroed allocation of 4096 bytes, freed below.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, 4096) };
    let read = file.read_at(buf, 0);
    // SAFETY: allocated above with this layout; `buf` is not used after this.
    unsafe { std::alloc::dealloc(ptr, layout) };
    assert_eq!(read.unwrap_or_else(|e| panic!("read {}: {e}", dev.display())), 4096);
}

/// Kills device `id`'s worker and reads one block at once (the read waits for the
/// recovery): returns how long that read took from the kill, and the recovery's stall
/// as `ublkctl status` reports it.
fn kill_and_time(ublkd: &Ublkd, id: u32, recoveries: u64) -> (Duration, u64) {
    ublkd.wait_until("a standby", || !ublkd.status_of(id)["standby_pid"].is_null());
    let pid = ublkd.worker_pid(id);
    let dev = block_dev(id);
    let t = Instant::now();
    assert!(signal(pid, libc::SIGKILL), "worker {pid} was not there to kill");
    read_block(&dev);
    let io = t.elapsed();
    ublkd.wait_until("the recovery", || {
        ublkd.status_of(id)["recoveries"].as_u64() == Some(recoveries)
    });
    let stall = ublkd.status_of(id)["last_recovery_ms"].as_u64().expect("a recovery's stall");
    (io, stall)
}

#[test]
fn a_worker_kill_beside_trickling_clients_recovers_promptly() {
    let _serial = serial();
    let ublkd = Ublkd::start("hostile-kill");
    let id = ublkd.add(&["-t", "memory", "-s", "64M"]);
    let (io_alone, stall_alone) = kill_and_time(&ublkd, id, 1);

    let tricklers: Vec<Trickler> = (0..4).map(|_| Trickler::start(&ublkd.ctl.socket)).collect();
    std::thread::sleep(Duration::from_millis(500));
    let (io_beside, stall_beside) = kill_and_time(&ublkd, id, 2);
    eprintln!(
        "kill to first I/O: {} ms alone, {} ms beside 4 trickling clients; \
         recovery stall: {stall_alone} ms alone, {stall_beside} ms beside them",
        io_alone.as_millis(),
        io_beside.as_millis()
    );
    assert!(stall_beside < 1000, "the recovery stalled {stall_beside} ms beside the clients");
    assert!(io_beside < Duration::from_secs(1), "the first I/O after the kill took {io_beside:?}");
    assert_eq!(ublkd.status_of(id)["state"], "LIVE");
    drop(tricklers);
    ublkd.stop();
}

/// What the worker's `stderr-flood` attack writes after its forged line.
const FLOOD_LINES: u64 = 5000;

#[test]
fn a_flooding_worker_is_relayed_with_its_identity_and_rate_limited() {
    let _serial = serial();
    let extra =
        format!("worker_binary = \"{}\"\nworker_user = \"nobody\"\n", hooked_worker().display());
    let ublkd =
        Ublkd::start_with("hostile-flood", &extra, &[("UBLKD_WORKER_ATTACK", "stderr-flood")]);
    let id = ublkd.add(&["-t", "memory", "-s", "16M"]);
    let pid = ublkd.worker_pid(id);
    ublkd.wait_until("the flood", || ublkd.log().contains("flood line"));
    // Long enough for the flood to end and the bucket to refill: the worker's exit line
    // at the stop then passes and reports what was suppressed.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(ublkd.status_of(id)["recoveries"], 0, "the flood must not cost the worker");
    let log = ublkd.stop();

    let identity = [format!("dev_id={id}"), format!("worker_pid={pid}")];
    let flood: Vec<&str> = log.lines().filter(|l| l.contains("worker: flood line ")).collect();
    for line in &flood {
        assert!(identity.iter().all(|f| line.contains(f.as_str())), "no identity: {line}");
    }
    let suppressed: u64 = log
        .lines()
        .filter(|l| l.contains("worker: suppressed ") && l.contains(&identity[1]))
        .map(|l| {
            let n = l.split("worker: suppressed ").nth(1).unwrap().split(' ').next().unwrap();
            n.parse::<u64>().unwrap_or_else(|e| panic!("{e}: {l}"))
        })
        .sum();
    eprintln!("flood: {} lines relayed, {suppressed} suppressed", flood.len());
    assert!(suppressed > 0, "nothing was suppressed:\n{log}");
    assert!(flood.len() < 200, "{} flood lines relayed: no rate limit", flood.len());
    assert_eq!(flood.len() as u64 + suppressed, FLOOD_LINES, "every flood line is accounted for");

    let forged: Vec<&str> = log.lines().filter(|l| l.contains("forged supervisor line")).collect();
    assert_eq!(forged.len(), 1, "{log}");
    let forged = forged[0];
    assert!(!forged.starts_with("2026-01-01T00:00:00"), "passes for ublkd's: {forged}");
    assert!(forged.contains("::worker_log: worker: 2026-01-01"), "not marked: {forged}");
    assert!(identity.iter().all(|f| forged.contains(f.as_str())), "no identity: {forged}");
    assert!(forged.contains("\\r"), "the carriage return is not escaped: {forged:?}");
    assert!(!log.contains('\r'), "a raw carriage return reached the log");
}
