//! Workers' stderr, relayed into ublkd's log: each worker (and standby) writes into a
//! pipe of its own, never into ublkd's stderr (the journal, under systemd), and one
//! relay thread reads every pipe with epoll and logs each line as an event of its own
//! with the worker's identity as fields (`dev_id`, `worker_pid`) and the text after
//! `worker: `, so that no line a worker writes can pass for one of the supervisor's.
//!
//! Bounds, per worker: lines of at most [`MAX_LINE`] bytes (the rest of a longer line is
//! cut and counted); at most [`LINES_PER_SEC`] lines a second after a burst of
//! [`BURST`] (a token bucket). Lines over the rate are read and dropped (never left in
//! the pipe: a worker blocked on a full stderr would stall its I/O), and the next line
//! that passes, or the pipe's end, is preceded by `worker: suppressed K lines`.
//! Control characters are escaped, so a line cannot rewrite a terminal either.
//!
//! One thread for all workers, not one each: a host may run a thousand devices.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

/// The longest line relayed whole, in bytes.
pub const MAX_LINE: usize = 1024;
/// Lines a second a worker may log once its burst is spent.
pub const LINES_PER_SEC: u32 = 10;
/// Lines a worker may log at once.
pub const BURST: u32 = 50;
/// The most bytes read from one pipe per wake-up, so that one flooding worker cannot
/// keep the relay from the others.
const READ_BUDGET: usize = 64 * 1024;

/// The relay: an epoll set of pipes, and the thread that reads them.
#[derive(Debug)]
pub struct Relay {
    epoll: Epoll,
    /// Pipes handed over but not yet taken by the relay thread.
    pending: Mutex<Vec<(u64, Pipe)>>,
    next_key: AtomicU64,
    /// Pipes handed over and not yet at their end.
    open: AtomicUsize,
}

impl Relay {
    /// The process's relay, started on first use; `None` if it could not be started
    /// (workers then share ublkd's stderr, as the log says).
    pub fn get() -> Option<&'static Relay> {
        static RELAY: OnceLock<Option<Relay>> = OnceLock::new();
        let relay = RELAY.get_or_init(|| match Relay::new() {
            Ok(relay) => Some(relay),
            Err(e) => {
                tracing::error!("cannot relay workers' stderr ({e}): workers log to ublkd's");
                None
            }
        });
        let relay = relay.as_ref()?;
        static THREAD: OnceLock<bool> = OnceLock::new();
        let started = *THREAD.get_or_init(|| {
            let spawned =
                std::thread::Builder::new().name("worker-stderr".into()).spawn(|| relay.run());
            if let Err(e) = &spawned {
                tracing::error!(
                    "cannot start the workers' stderr relay ({e}): workers log to ublkd's"
                );
            }
            spawned.is_ok()
        });
        started.then_some(relay)
    }

    fn new() -> io::Result<Relay> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        Ok(Relay {
            epoll,
            pending: Mutex::new(Vec::new()),
            next_key: AtomicU64::new(0),
            open: AtomicUsize::new(0),
        })
    }

    /// Relays `pipe` (the read end of a worker's stderr) as worker `worker_pid`'s of
    /// device `dev_id`, until the worker closes it.
    pub fn watch(&self, pipe: OwnedFd, dev_id: u32, worker_pid: u32) -> PipeEnd {
        let end = PipeEnd(Arc::new(AtomicBool::new(false)));
        if let Err(e) = set_nonblocking(&pipe) {
            tracing::warn!(dev_id, worker_pid, "cannot make the worker's stderr nonblocking: {e}");
        }
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        // Added before it is queued: an event the thread sees before it has taken the
        // pipe from the queue comes again on its next wait (the set is level-triggered).
        if let Err(e) = self.epoll.add(&pipe, EpollEvent::new(EpollFlags::EPOLLIN, key)) {
            end.0.store(true, Ordering::Release);
            tracing::error!(
                dev_id,
                worker_pid,
                "cannot watch the worker's stderr ({e}): its lines are lost"
            );
            return end;
        }
        self.open.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).push((
            key,
            Pipe {
                fd: pipe,
                dev_id,
                worker_pid,
                lines: Lines::default(),
                bucket: Bucket::new(),
                end: PipeEnd(Arc::clone(&end.0)),
            },
        ));
        end
    }

    /// Waits up to `limit` for every pipe but `serving_on` to reach its end (their
    /// workers gone) and its last lines to be logged: ublkd calls it before it exits, so
    /// that the workers' last words are not lost with the relay thread. The pipes of
    /// the `serving_on` workers left serving never end (they hold a copy of the read
    /// end for the next ublkd), so they are not waited for.
    pub fn flush(&self, limit: Duration, serving_on: usize) {
        let deadline = Instant::now() + limit;
        while self.open.load(Ordering::Acquire) > serving_on && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn run(&self) {
        let mut pipes: HashMap<u64, Pipe> = HashMap::new();
        let mut events = [EpollEvent::empty(); 64];
        loop {
            let n = match self.epoll.wait(&mut events, EpollTimeout::NONE) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    tracing::error!("the workers' stderr relay failed: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            pipes.extend(self.pending.lock().unwrap_or_else(|p| p.into_inner()).drain(..));
            for event in &events[..n] {
                let key = event.data();
                let Some(pipe) = pipes.get_mut(&key) else { continue };
                if !pipe.pump(Instant::now()) {
                    // Dropping the pipe closes it, which takes it out of the epoll set.
                    if let Some(pipe) = pipes.remove(&key) {
                        drop(pipe.fd);
                        pipe.end.0.store(true, Ordering::Release);
                    }
                    self.open.fetch_sub(1, Ordering::Release);
                }
            }
        }
    }
}

/// Says when a worker's stderr has been read to its end, logged and closed.
#[derive(Debug)]
pub struct PipeEnd(Arc<AtomicBool>);

impl PipeEnd {
    /// Waits up to `limit` for the end (the worker has exited, or is about to).
    pub fn wait(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !self.0.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

/// One worker's stderr.
#[derive(Debug)]
struct Pipe {
    fd: OwnedFd,
    dev_id: u32,
    worker_pid: u32,
    lines: Lines,
    bucket: Bucket,
    end: PipeEnd,
}

impl Pipe {
    /// Reads what the pipe holds (up to [`READ_BUDGET`]) and relays its lines; false at
    /// the pipe's end.
    fn pump(&mut self, now: Instant) -> bool {
        let mut buf = [0u8; 8192];
        let mut budget = READ_BUDGET;
        let open = loop {
            let n = match read_nowait(&self.fd, &mut buf) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => break true,
                Err(_) => break false,
            };
            if n == 0 {
                break false;
            }
            let Pipe { lines, bucket, dev_id, worker_pid, .. } = self;
            lines.feed(&buf[..n], |line, cut| {
                relay_line(*dev_id, *worker_pid, bucket, now, line, cut)
            });
            budget = budget.saturating_sub(n);
            if budget == 0 {
                break true; // the rest on the next wake-up (epoll is level-triggered)
            }
        };
        if !open {
            let Pipe { lines, bucket, dev_id, worker_pid, .. } = self;
            lines.finish(|line, cut| relay_line(*dev_id, *worker_pid, bucket, now, line, cut));
            if bucket.suppressed > 0 {
                report_suppressed(*dev_id, *worker_pid, std::mem::take(&mut bucket.suppressed));
            }
        }
        open
    }
}

fn relay_line(
    dev_id: u32,
    worker_pid: u32,
    bucket: &mut Bucket,
    now: Instant,
    line: &[u8],
    cut: usize,
) {
    let Some(suppressed) = bucket.admit(now) else { return };
    if suppressed > 0 {
        report_suppressed(dev_id, worker_pid, suppressed);
    }
    let text = sanitize(line);
    let cut = if cut > 0 { format!(" [{cut} more bytes cut]") } else { String::new() };
    if worker_says_routine(line) {
        tracing::info!(dev_id, worker_pid, "worker: {text}{cut}");
    } else {
        tracing::warn!(dev_id, worker_pid, "worker: {text}{cut}");
    }
}

fn report_suppressed(dev_id: u32, worker_pid: u32, lines: u64) {
    tracing::warn!(
        dev_id,
        worker_pid,
        suppressed = lines,
        "worker: suppressed {lines} lines (over {LINES_PER_SEC} lines/s after a burst of {BURST})"
    );
}

/// Whether the worker's own log tagged the line INFO, DEBUG or TRACE (its tracing
/// format puts the level after the timestamp): relayed as info, everything else (its
/// warnings and errors, and untagged lines such as a fatal error or the sandbox's
/// report) as a warning. A worker can lower its lines' level this way, never raise it
/// past warning.
fn worker_says_routine(line: &[u8]) -> bool {
    let head = &line[..line.len().min(48)];
    [&b" INFO "[..], b" DEBUG ", b" TRACE "]
        .iter()
        .any(|tag| head.windows(tag.len()).any(|w| w == *tag))
}

/// The line as text, invalid UTF-8 replaced and control characters (but tab) escaped;
/// its length is bounded already (cut at [`MAX_LINE`] bytes by the reader).
fn sanitize(line: &[u8]) -> String {
    ublkd_proto::msg::untrusted_text_within(&String::from_utf8_lossy(line), usize::MAX)
}

/// Splits a byte stream into lines of at most [`MAX_LINE`] bytes.
#[derive(Debug, Default)]
struct Lines {
    buf: Vec<u8>,
    /// Bytes dropped from the current line past [`MAX_LINE`].
    cut: usize,
}

impl Lines {
    /// Feeds `data`; calls `line(text, bytes_cut)` for every line it completes.
    fn feed(&mut self, mut data: &[u8], mut line: impl FnMut(&[u8], usize)) {
        while !data.is_empty() {
            let end = data.iter().position(|&b| b == b'\n');
            let chunk = &data[..end.unwrap_or(data.len())];
            let room = MAX_LINE - self.buf.len();
            let take = chunk.len().min(room);
            self.buf.extend_from_slice(&chunk[..take]);
            self.cut += chunk.len() - take;
            match end {
                Some(end) => {
                    line(&self.buf, self.cut);
                    self.buf.clear();
                    self.cut = 0;
                    data = &data[end + 1..];
                }
                None => data = &[],
            }
        }
    }

    /// The pipe ended: the last line, if it had no newline.
    fn finish(&mut self, mut line: impl FnMut(&[u8], usize)) {
        if !self.buf.is_empty() || self.cut > 0 {
            line(&self.buf, self.cut);
        }
        self.buf.clear();
        self.cut = 0;
    }
}

/// A token bucket of lines: [`BURST`] at once, then [`LINES_PER_SEC`].
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Option<Instant>,
    /// Lines dropped since the last one that passed.
    suppressed: u64,
}

impl Bucket {
    fn new() -> Bucket {
        Bucket { tokens: f64::from(BURST), last: None, suppressed: 0 }
    }

    /// Whether a line at `now` passes: `Some(lines suppressed before it)`, or `None`
    /// (dropped and counted).
    fn admit(&mut self, now: Instant) -> Option<u64> {
        if let Some(last) = self.last {
            let refill =
                now.saturating_duration_since(last).as_secs_f64() * f64::from(LINES_PER_SEC);
            self.tokens = (self.tokens + refill).min(f64::from(BURST));
        }
        self.last = Some(now);
        if self.tokens < 1.0 {
            self.suppressed += 1;
            return None;
        }
        self.tokens -= 1.0;
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// Reads without waiting, whatever the pipe's O_NONBLOCK says: that flag belongs to
/// the pipe's open file, which a serving worker shares (it holds a copy of this read
/// end) and may clear, then drain the pipe between epoll's word and this read, to
/// block the relay and with it every other worker's stderr. RWF_NOWAIT is the call's
/// own; a kernel whose pipes lack it (EOPNOTSUPP, before 5.x) gets the plain read.
fn read_nowait(fd: &OwnedFd, buf: &mut [u8]) -> nix::Result<usize> {
    match crate::sys::read_nowait(fd.as_fd(), buf) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => nix::unistd::read(fd, buf),
        Err(e) => Err(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))),
        Ok(n) => Ok(n),
    }
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    let flags = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_pipe_whose_nonblocking_flag_was_cleared_does_not_hold_the_relay() {
        let (read, write) = nix::unistd::pipe().unwrap();
        set_nonblocking(&read).unwrap();
        // What a worker holding a copy of the read end can do to the shared flags.
        nix::fcntl::fcntl(&read, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()))
            .unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(read_nowait(&read, &mut buf), Err(Errno::EAGAIN));
        nix::unistd::write(&write, b"line\n").unwrap();
        assert_eq!(read_nowait(&read, &mut buf), Ok(5));
        drop(write);
        assert_eq!(read_nowait(&read, &mut buf), Ok(0), "the end is still seen");
    }

    fn split(chunks: &[&[u8]]) -> Vec<(String, usize)> {
        let mut lines = Lines::default();
        let mut out = Vec::new();
        for chunk in chunks {
            lines.feed(chunk, |l, cut| out.push((String::from_utf8_lossy(l).into_owned(), cut)));
        }
        lines.finish(|l, cut| out.push((String::from_utf8_lossy(l).into_owned(), cut)));
        out
    }

    #[test]
    fn lines_are_split_across_reads_and_the_last_one_is_kept() {
        let got = split(&[b"ab", b"c\nde", b"f\n\ng"]);
        let want = [("abc", 0), ("def", 0), ("", 0), ("g", 0)];
        assert_eq!(got, want.map(|(l, c)| (l.to_string(), c)));
    }

    #[test]
    fn a_long_line_is_cut_at_the_bound_and_says_how_much() {
        let long = vec![b'x'; MAX_LINE + 300];
        let got = split(&[&long[..700], &long[700..], b"\nnext\n"]);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!((got[0].0.len(), got[0].1), (MAX_LINE, 300));
        assert_eq!(got[1], ("next".to_string(), 0));
    }

    #[test]
    fn the_bucket_passes_a_burst_then_the_rate_and_counts_the_rest() {
        let mut b = Bucket::new();
        let t0 = Instant::now();
        let passed = (0..1000).filter(|_| b.admit(t0).is_some()).count();
        assert_eq!(passed, BURST as usize);
        assert_eq!(b.suppressed, 1000 - u64::from(BURST));
        // One second later: LINES_PER_SEC more, the first saying what was dropped.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.admit(t1), Some(1000 - u64::from(BURST)));
        let more = (1..1000).filter(|_| b.admit(t1).is_some()).count();
        assert_eq!(more + 1, LINES_PER_SEC as usize);
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(sanitize(b"a\rb\x1b[2Jc\td"), "a\\rb\\u{1b}[2Jc\td");
        assert_eq!(sanitize(&[b'a', 0xff, b'b']), "a\u{fffd}b");
    }

    #[test]
    fn only_the_workers_routine_levels_lower_a_line_to_info() {
        assert!(worker_says_routine(b"2026-12-01T18:00:00.000000Z  INFO ublkd_worker: x"));
        assert!(!worker_says_routine(b"2026-12-01T18:00:00.000000Z ERROR ublkd_worker: x"));
        assert!(!worker_says_routine(b"ublkd-worker: sandbox: blocked system call 0231"));
    }
}
