//! Telling a hung worker from a busy, idle or slow one.
//!
//! Two views are combined, and the kernel's is the one that decides:
//!
//! - the kernel's own, from `/sys/block/ublkbN/stat`: requests in flight and requests
//!   completed so far. I/O in flight and none completing is the sign of a hang,
//!   whatever the worker's heartbeats say, so a worker that keeps beating while it
//!   holds I/O is still found;
//! - the worker's word, from the shared region (untrusted: read as data, compared,
//!   never used as an index or in arithmetic that can fail): each queue thread's
//!   heartbeat, odd while the thread is working through a turn and even while it waits
//!   in the ring, and how many requests it has handed to its backend and waits for.
//!
//! A device is hung when
//! 1. a queue thread has been in the middle of one turn for the timeout while the
//!    kernel has I/O in flight (a thread stuck while others serve on), or
//! 2. the kernel has had I/O in flight and completed none for the timeout, and no
//!    thread says it waits for its backend (or the process is stopped, in which case
//!    nobody reaps what the backend completed).
//!
//! A thread that waits in its ring with requests at its backend is not hung: an
//! fdatasync may take longer than the timeout and still progress, and a new worker
//! would wait for the same backend. It is reported instead ([`Verdict::Backend`]). A
//! compromised worker can claim to wait for its backend to escape being killed; it
//! only stalls its own device, which it could do anyway.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ublkd_proto::shm::ShmRegion;

/// One queue thread's word, as read from its slot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThreadReading {
    pub heartbeat: u64,
    /// Requests the thread handed to its backend and has not seen complete.
    pub at_backend: u32,
}

impl ThreadReading {
    /// Odd heartbeat: the thread is between waking up and waiting again.
    fn in_turn(&self) -> bool {
        self.heartbeat & 1 == 1
    }
}

/// Every thread slot of `shm`, in thread order.
pub fn read_threads(shm: &ShmRegion) -> Vec<ThreadReading> {
    let mut readings = Vec::new();
    read_threads_into(shm, &mut readings);
    readings
}

/// [`read_threads`] into `readings` (cleared first): a scan reuses one buffer per
/// device rather than allocating one each time.
fn read_threads_into(shm: &ShmRegion, readings: &mut Vec<ThreadReading>) {
    readings.clear();
    readings.extend((0..usize::from(shm.geometry().nr_threads)).filter_map(|t| shm.thread(t)).map(
        |slot| ThreadReading {
            heartbeat: slot.heartbeat.load(Ordering::Relaxed),
            at_backend: slot.inflight.load(Ordering::Relaxed),
        },
    ));
}

/// What the kernel says of a block device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelStat {
    pub inflight: u64,
    /// Reads, writes, discards and flushes completed since the device appeared.
    pub completed: u64,
}

/// Parses `/sys/block/<dev>/stat` (Documentation/block/stat.rst): completed reads are
/// field 1, writes 5, in flight 9, discards 12, flushes 16. Anything unparsable counts
/// as nothing in flight: never a reason to kill a worker.
pub fn parse_stat(text: &[u8]) -> KernelStat {
    // Without allocating: a scan parses one of these per device.
    let mut fields = [0u64; 17];
    let mut parsed = 0;
    for word in text.split(u8::is_ascii_whitespace).filter(|w| !w.is_empty()) {
        let Some(field) = fields.get_mut(parsed) else { break };
        match std::str::from_utf8(word).ok().and_then(|w| w.parse::<u64>().ok()) {
            Some(n) => *field = n,
            None => break,
        }
        parsed += 1;
    }
    if parsed < 11 {
        return KernelStat::default();
    }
    let at = |i: usize| fields[i - 1];
    KernelStat {
        inflight: at(9),
        completed: at(1).wrapping_add(at(5)).wrapping_add(at(12)).wrapping_add(at(16)),
    }
}

/// Every ublk disk's numbers, from one read of `/proc/diskstats` per scan: the same
/// fields as each disk's `/sys/block/ublkbN/stat` (Documentation/admin-guide/
/// iostats.rst), without a file read per device, which was most of what a scan of
/// idle devices cost. A device missing from it is read from its own stat file.
#[derive(Debug, Default)]
pub struct DiskStats {
    file: Option<File>,
    text: Vec<u8>,
    by_id: HashMap<u32, KernelStat>,
}

impl DiskStats {
    /// Reads `/proc/diskstats` afresh; without it, every device is read on its own.
    pub fn refresh(&mut self) {
        self.by_id.clear();
        if self.file.is_none() {
            self.file = File::open("/proc/diskstats").ok();
        }
        let Some(file) = &mut self.file else { return };
        self.text.clear();
        if file.rewind().and_then(|()| file.read_to_end(&mut self.text)).is_err() {
            self.file = None;
            return;
        }
        parse_diskstats(&self.text, &mut self.by_id);
    }

    /// Forgets the last refresh's numbers: each device is then read on its own.
    pub fn forget(&mut self) {
        self.by_id.clear();
    }

    /// The last refresh's numbers of `/dev/ublkb<dev_id>`, if it had them.
    pub fn get(&self, dev_id: u32) -> Option<KernelStat> {
        self.by_id.get(&dev_id).copied()
    }
}

/// Parses `/proc/diskstats` into `out`, by ublk disk id: each line is the major and
/// minor numbers, the name, then the fields of [`parse_stat`]. Partitions
/// (`ublkb0p1`) and other disks are skipped.
pub fn parse_diskstats(text: &[u8], out: &mut HashMap<u32, KernelStat>) {
    for line in text.split(|&b| b == b'\n') {
        let Some(name) = line.split(u8::is_ascii_whitespace).filter(|w| !w.is_empty()).nth(2)
        else {
            continue;
        };
        let Some(id) = name
            .strip_prefix(b"ublkb")
            .filter(|digits| !digits.is_empty() && digits.iter().all(u8::is_ascii_digit))
            .and_then(|digits| std::str::from_utf8(digits).ok()?.parse::<u32>().ok())
        else {
            continue;
        };
        out.insert(id, parse_stat(after_words(line, 3)));
    }
}

/// `line` after its first `n` whitespace-separated words.
fn after_words(line: &[u8], n: usize) -> &[u8] {
    let mut rest = line;
    for _ in 0..n {
        let start = rest.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(rest.len());
        rest = &rest[start..];
        let end = rest.iter().position(u8::is_ascii_whitespace).unwrap_or(rest.len());
        rest = &rest[end..];
    }
    rest
}

/// Whether process `pid` is stopped (a SIGSTOP or a tracer): `/proc/PID/stat`'s state.
fn process_stopped(pid: u32) -> bool {
    let Ok(text) = std::fs::read(format!("/proc/{pid}/stat")) else { return false };
    // The state follows the command name's closing parenthesis (which may contain
    // anything, so search from the end).
    let Some(close) = text.iter().rposition(|&b| b == b')') else { return false };
    matches!(text.get(close + 2), Some(b'T' | b't'))
}

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Idle, or making progress.
    Fine,
    /// Kill the worker: why.
    Hung(String),
    /// No completion for this long, but the worker waits for its backend.
    Backend(Duration),
}

/// What one tick looks at: the time, the kernel's counts, each queue thread's slot,
/// and the timeout in force.
struct Look<'a> {
    now: Instant,
    kernel: KernelStat,
    threads: &'a [ThreadReading],
    timeout: Duration,
}

/// One tick's finding, before the no-completion rule's confirmation on the next tick.
enum Tick {
    Verdict(Verdict),
    /// Quiet past the limit with no backend wait: a hang if the next tick agrees.
    Quiet(String),
}

/// What the watch remembers between ticks.
#[derive(Debug)]
pub struct HangWatch {
    dev_id: u32,
    /// Per thread: its last heartbeat and since when it has been that.
    threads: Vec<(u64, Instant)>,
    completed: u64,
    /// Since when no request completed while some were in flight (or since the last
    /// progress).
    since: Instant,
    /// `/sys/block/ublkbN/stat`, opened once and re-read in place: an idle device's
    /// tick costs one pread.
    stat_file: Option<File>,
    /// The last tick found the device quiet past its limit with no thread waiting for
    /// its backend. The kernel's count and the worker's slots are read one after the
    /// other, so one tick can fall between a worker finishing a backend request (its
    /// slot says nothing is at the backend) and the kernel counting its COMMIT: a hang
    /// by the no-completion rule is declared on the second such tick in a row.
    suspected: bool,
    /// The last scan's reading of the worker's thread slots (kept to reuse its memory).
    readings: Vec<ThreadReading>,
    /// The last tick saw the kernel hold I/O for the device, or a queue thread in a
    /// turn: it is watched on every tick (see [`Self::watched`]).
    busy: bool,
}

impl HangWatch {
    pub fn new(dev_id: u32) -> HangWatch {
        HangWatch {
            dev_id,
            threads: Vec::new(),
            completed: 0,
            since: Instant::now(),
            stat_file: None,
            suspected: false,
            readings: Vec::new(),
            busy: false,
        }
    }

    /// Starts watching afresh (a new worker took over).
    pub fn reset(&mut self, shm: &ShmRegion) {
        let now = Instant::now();
        self.threads = read_threads(shm).iter().map(|t| (t.heartbeat, now)).collect();
        self.completed = self.kernel_stat().completed;
        self.since = now;
        self.suspected = false;
    }

    fn kernel_stat(&mut self) -> KernelStat {
        if self.stat_file.is_none() {
            self.stat_file = File::open(format!("/sys/block/ublkb{}/stat", self.dev_id)).ok();
        }
        let Some(file) = &self.stat_file else { return KernelStat::default() };
        // A sysfs attribute read from offset 0 is generated afresh.
        let mut buf = [0u8; 256];
        match file.read_at(&mut buf, 0) {
            Ok(n) => parse_stat(&buf[..n]),
            Err(_) => {
                self.stat_file = None; // reopened on the next tick
                KernelStat::default()
            }
        }
    }

    /// One tick's check, at `now`, of the worker `pid` serving `shm`; the kernel's
    /// numbers from the scan's `disks`, else from the device's own stat file.
    pub fn check(
        &mut self,
        now: Instant,
        disks: &DiskStats,
        shm: &ShmRegion,
        pid: u32,
        timeout: Duration,
    ) -> Verdict {
        let kernel = disks.get(self.dev_id).unwrap_or_else(|| self.kernel_stat());
        let mut threads = std::mem::take(&mut self.readings);
        read_threads_into(shm, &mut threads);
        let verdict = self.judge(now, kernel, &threads, || process_stopped(pid), timeout);
        self.readings = threads;
        verdict
    }

    /// The decision, apart from where its inputs come from.
    fn judge(
        &mut self,
        now: Instant,
        kernel: KernelStat,
        threads: &[ThreadReading],
        stopped: impl FnOnce() -> bool,
        timeout: Duration,
    ) -> Verdict {
        let look = Look { now, kernel, threads, timeout };
        match self.judge_tick(look, stopped) {
            Tick::Quiet(_) if !self.suspected => {
                self.suspected = true;
                Verdict::Fine
            }
            Tick::Quiet(why) => {
                self.suspected = false;
                Verdict::Hung(why)
            }
            Tick::Verdict(v) => {
                self.suspected = false;
                v
            }
        }
    }

    fn judge_tick(&mut self, look: Look<'_>, stopped: impl FnOnce() -> bool) -> Tick {
        let Look { now, kernel, threads, timeout } = look;
        if self.threads.len() != threads.len() {
            self.threads = threads.iter().map(|t| (t.heartbeat, now)).collect();
        }
        let mut stuck_thread = None;
        for (index, (reading, (beat, since))) in
            threads.iter().zip(self.threads.iter_mut()).enumerate()
        {
            if reading.heartbeat != *beat {
                *beat = reading.heartbeat;
                *since = now;
            } else if reading.in_turn() && stuck_thread.is_none() {
                let stuck = now.saturating_duration_since(*since);
                if stuck >= timeout {
                    stuck_thread = Some((index, stuck));
                }
            }
        }
        let was_busy = std::mem::replace(
            &mut self.busy,
            kernel.inflight > 0 || threads.iter().any(ThreadReading::in_turn),
        );
        if kernel.inflight == 0 {
            self.completed = kernel.completed;
            self.since = now;
            return Tick::Verdict(Verdict::Fine);
        }
        if !was_busy {
            // Idle at its last look, which may be two ticks back (an idle device is
            // looked at on every other tick only): its I/O is counted from at most one
            // tick (a quarter of the timeout) ago, as if it had been looked at on each.
            let tick_ago = now.checked_sub(timeout / 4).unwrap_or(now);
            self.since = self.since.max(tick_ago);
        }
        if let Some((index, stuck)) = stuck_thread {
            return Tick::Verdict(Verdict::Hung(format!(
                "worker hung: queue thread {index} has been stuck in one turn for {:.1} s \
                 with I/O in flight",
                stuck.as_secs_f64()
            )));
        }
        if kernel.completed != self.completed {
            self.completed = kernel.completed;
            self.since = now;
            return Tick::Verdict(Verdict::Fine);
        }
        let quiet = now.saturating_duration_since(self.since);
        // Threads that kept turning while nothing completed get a second timeout: a
        // turn is some sign of life, and a host too busy to run the worker for a while
        // should not cost a recovery; holding I/O for good is still found.
        let turning = self.threads.iter().any(|(_, since)| *since > self.since);
        let limit = if turning { timeout.saturating_mul(2) } else { timeout };
        if quiet < limit {
            return Tick::Verdict(Verdict::Fine);
        }
        let at_backend = threads.iter().any(|t| t.at_backend > 0);
        if at_backend && !stopped() {
            return Tick::Verdict(Verdict::Backend(quiet));
        }
        let how = if turning { "while its threads kept turning" } else { "and no thread turned" };
        Tick::Quiet(format!(
            "worker hung: I/O in flight and none completed for {:.1} s {how}",
            quiet.as_secs_f64()
        ))
    }

    /// Whether the device must be looked at on the next tick: the last one saw the
    /// kernel hold I/O for it, a queue thread in a turn, or it suspects a hang. An idle
    /// one is looked at on every other tick, when the scan reads every disk's numbers
    /// at once (`/proc/diskstats`, whose cost is the kernel's, in proportion to the
    /// disks).
    pub fn watched(&self) -> bool {
        self.busy || self.suspected
    }

    /// For the watchdog and status: how long the device has had I/O in flight and
    /// none completed, as of `now` (zero while it progresses or is idle).
    pub fn quiet_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    use proptest::prelude::*;
    use ublkd_proto::shm::Geometry;

    const T: Duration = Duration::from_secs(1);

    fn stat(inflight: u64, completed: u64) -> KernelStat {
        KernelStat { inflight, completed }
    }

    fn waiting(heartbeat: u64, at_backend: u32) -> ThreadReading {
        ThreadReading { heartbeat, at_backend }
    }

    #[test]
    fn diskstats_gives_each_ublk_disk_the_fields_of_its_stat_file() {
        let text = b"   7       0 loop0 5 0 10 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n\
 259       0 ublkb12 1200 0 9600 300 3400 0 27200 1100 5 900 1400 7 0 56 2 9 30\n\
 259       1 ublkb12p1 1 0 8 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n\
 259       2 ublkb3 1 0 8 0 2 0 0 0 0 0 0\n\
 259       3 ublkbx 1 0 8 0 2 0 0 0 0 0 0 0 0 0 0 0 0\n\
 259       4 ublkb4 garbage\n";
        let mut out = HashMap::new();
        parse_diskstats(text, &mut out);
        assert_eq!(out.len(), 3, "{out:?}");
        assert_eq!(out[&12], stat(5, 1200 + 3400 + 7 + 9));
        assert_eq!(out[&3], KernelStat { inflight: 0, completed: 3 });
        assert_eq!(out[&4], KernelStat::default());
        assert_eq!(after_words(b"  a bb  ccc rest of it", 3), b" rest of it");
        assert_eq!(after_words(b"a", 3), b"");
    }

    #[test]
    fn the_kernels_stat_file_is_read_by_field() {
        let text = b"    1200        0    9600     300     3400        0   27200    1100        5     900    1400       7        0      56       2       9       30\n";
        assert_eq!(parse_stat(text), stat(5, 1200 + 3400 + 7 + 9));
        assert_eq!(parse_stat(b"garbage"), KernelStat::default());
        assert_eq!(parse_stat(b"1 2 3"), KernelStat::default());
        assert_eq!(parse_stat(&[0xff, b' ', b'1']), KernelStat::default());
    }

    #[test]
    fn an_idle_device_is_never_hung() {
        let mut w = HangWatch::new(0);
        let t0 = Instant::now();
        for s in 0..100 {
            let v = w.judge(t0 + T * s, stat(0, 5), &[waiting(2, 0)], || false, T);
            assert_eq!(v, Verdict::Fine);
        }
    }

    #[test]
    fn io_first_seen_after_a_skipped_tick_counts_from_one_tick_back_not_from_the_last_look() {
        let mut w = HangWatch::new(0);
        let t0 = Instant::now();
        assert_eq!(w.judge(t0, stat(0, 5), &[waiting(2, 0)], || false, T), Verdict::Fine);
        assert!(!w.watched(), "an idle device is watched");
        // Not looked at on the tick at t0 + T/4; I/O seen at t0 + T/2 is counted as if
        // it began a tick before, at t0 + T/4.
        assert_eq!(w.judge(t0 + T / 2, stat(2, 5), &[waiting(2, 0)], || false, T), Verdict::Fine);
        assert!(w.watched(), "a device with I/O in flight is not watched");
        assert_eq!(w.quiet_for(t0 + T / 2), T / 4);
        assert_eq!(w.judge(t0 + T, stat(2, 5), &[waiting(2, 0)], || false, T), Verdict::Fine);
        // Quiet for T from t0 + T/4: suspected, then declared on the next tick.
        let v = w.judge(t0 + T * 5 / 4, stat(2, 5), &[waiting(2, 0)], || false, T);
        assert_eq!(v, Verdict::Fine);
        let v = w.judge(t0 + T * 3 / 2, stat(2, 5), &[waiting(2, 0)], || false, T);
        assert!(matches!(v, Verdict::Hung(ref why) if why.contains("for 1.2 s")), "{v:?}");
    }

    #[test]
    fn io_in_flight_and_none_completing_is_a_hang_even_while_heartbeats_move() {
        let mut w = HangWatch::new(0);
        let t0 = Instant::now();
        assert_eq!(w.judge(t0, stat(3, 10), &[waiting(2, 0)], || false, T), Verdict::Fine);
        // The worker keeps beating but completes nothing.
        let v = w.judge(t0 + T / 2, stat(3, 10), &[waiting(4, 0)], || false, T);
        assert_eq!(v, Verdict::Fine);
        // One timeout is not enough while the threads turn; two are.
        let v = w.judge(t0 + T * 3 / 2, stat(3, 10), &[waiting(6, 0)], || false, T);
        assert_eq!(v, Verdict::Fine);
        // Past the limit: suspected on this tick, declared on the next.
        let v = w.judge(t0 + T * 2, stat(3, 10), &[waiting(8, 0)], || false, T);
        assert_eq!(v, Verdict::Fine);
        let v = w.judge(t0 + T * 9 / 4, stat(3, 10), &[waiting(10, 0)], || false, T);
        assert!(
            matches!(v, Verdict::Hung(ref why) if why.contains("none completed for 2.2 s while its threads kept turning")),
            "{v:?}"
        );
    }

    #[test]
    fn io_in_flight_and_no_turn_and_no_completion_is_a_hang_after_one_timeout() {
        let mut w = HangWatch::new(0);
        let t0 = Instant::now();
        assert_eq!(w.judge(t0, stat(3, 10), &[waiting(2, 0)], || false, T), Verdict::Fine);
        assert_eq!(w.judge(t0 + T, stat(3, 10), &[waiting(2, 0)], || false, T), Verdict::Fine);
        let v = w.judge(t0 + T * 5 / 4, stat(3, 10), &[waiting(2, 0)], || false, T);
        assert!(matches!(v, Verdict::Hung(ref why) if why.contains("no thread turned")), "{v:?}");
    }

    #[test]
    fn completions_are_progress() {
        let mut w = HangWatch::new(0);
        let t0 = Instant::now();
        for s in 0..10u64 {
            let v = w.judge(t0 + T * s as u32, stat(3, 10 + s), &[waiting(2, 0)], || false, T);
            assert_eq!(v, Verdict::Fine);
        }
    }

    #[test]
    fn a_thread_stuck_in_a_turn_is_found_while_another_serves() {
        let mut w = HangWatch::new(0);
        let t0 = Instant::now();
        let mut v = Verdict::Fine;
        for s in 0..4u32 {
            // Thread 0 stuck mid-turn (odd heartbeat, unchanged); thread 1 completes I/O.
            let threads = [waiting(7, 0), waiting(2 * u64::from(s), 0)];
            v = w.judge(t0 + T * s / 2, stat(4, 10 + u64::from(s)), &threads, || false, T);
            if v != Verdict::Fine {
                break;
            }
        }
        assert!(matches!(v, Verdict::Hung(ref why) if why.contains("queue thread 0")), "{v:?}");
    }

    /// A watch that has seen one request at the backend for five timeouts, no hang.
    fn waiting_five_timeouts_for_the_backend() -> (HangWatch, Instant) {
        let mut w = HangWatch::new(0);
        let t0 = Instant::now();
        w.judge(t0, stat(1, 10), &[waiting(8, 1)], || false, T);
        let v = w.judge(t0 + T * 5, stat(1, 10), &[waiting(8, 1)], || false, T);
        assert_eq!(v, Verdict::Backend(T * 5));
        (w, t0)
    }

    #[test]
    fn a_thread_waiting_for_a_slow_backend_is_not_hung() {
        let (mut w, t0) = waiting_five_timeouts_for_the_backend();
        // The same worker stopped: nobody reaps what the backend completes (declared
        // on the second tick, as every no-completion hang is).
        let v = w.judge(t0 + T * 6, stat(1, 10), &[waiting(8, 1)], || true, T);
        assert_eq!(v, Verdict::Fine);
        let v = w.judge(t0 + T * 25 / 4, stat(1, 10), &[waiting(8, 1)], || true, T);
        assert!(matches!(v, Verdict::Hung(_)), "{v:?}");
    }

    #[test]
    fn a_tick_between_a_backend_completion_and_its_commit_is_not_a_hang() {
        let (mut w, t0) = waiting_five_timeouts_for_the_backend();
        // The worker finished the request (its slot says nothing is at the backend);
        // the kernel has not counted its COMMIT yet.
        let v = w.judge(t0 + T * 21 / 4, stat(1, 10), &[waiting(10, 0)], || false, T);
        assert_eq!(v, Verdict::Fine);
        // The next tick sees the completion.
        let v = w.judge(t0 + T * 11 / 2, stat(1, 11), &[waiting(10, 0)], || false, T);
        assert_eq!(v, Verdict::Fine);
    }

    fn region() -> (ShmRegion, File) {
        let g = Geometry { dev_id: 3, nr_queues: 2, queue_depth: 8, nr_threads: 3 };
        let (shm, fd) = ShmRegion::create(g).unwrap();
        (shm, File::from(fd))
    }

    proptest! {
        /// Whatever a worker writes into its region, reading it never panics, and
        /// preparing the next activation makes the region valid again.
        #[test]
        fn any_region_contents_are_read_without_panic_and_repaired(
            bytes in proptest::collection::vec(any::<u8>(), 0..1200),
            offset in 0u64..1024,
            inflight in any::<u64>(),
            completed in any::<u64>(),
        ) {
            let (shm, file) = region();
            let len = shm.geometry().region_bytes() as u64;
            let offset = offset.min(len);
            let n = bytes.len().min((len - offset) as usize);
            file.write_all_at(&bytes[..n], offset).unwrap();
            let _ = shm.validate();
            let _ = shm.counters().snapshot().ios();
            let mut w = HangWatch::new(3);
            let threads = read_threads(&shm);
            prop_assert_eq!(threads.len(), 3);
            let t0 = Instant::now();
            for s in 0..3 {
                let _ = w.judge(t0 + T * s, stat(inflight, completed), &threads, || false, T);
            }
            shm.prepare_activation(u64::MAX);
            prop_assert!(shm.validate().is_ok());
            prop_assert_eq!(shm.generation(), u64::MAX);
            prop_assert!(read_threads(&shm).iter().all(|t| *t == ThreadReading::default()));
        }
    }
}
