//! The per-device shared-memory region between the supervisor and the device's worker.
//!
//! The supervisor creates it (a memfd), writes the header, and hands it to each worker
//! incarnation in turn; because the supervisor holds it, it outlives any worker. The
//! worker writes what it is doing there: per-thread heartbeats, per-tag in-flight
//! records, per-device counters and per-thread latency histograms. The supervisor reads them to tell a hung worker
//! from an idle one and to report status.
//!
//! Layout (version [`SHM_VERSION`]), all `#[repr(C)]`, native-endian:
//!
//! | offset                      | what                                   |
//! |-----------------------------|----------------------------------------|
//! | 0                           | [`ShmHeader`] (256 bytes)              |
//! | 256                         | `nr_threads` × [`ThreadSlot`] (64 B)   |
//! | after the threads           | `nr_queues × queue_depth` × [`TagSlot`] (32 B) |
//! | after the tags (64-aligned) | `nr_threads` × [`ThreadLatency`] (1280 B) |
//!
//! Every field another process writes is an atomic, accessed only through `&Atomic*`
//! (never a `&mut` over shared memory). Counters are single 64-bit atomics and cannot
//! tear; a tag record spans several words, so it is guarded by a sequence counter
//! (odd while being written) that readers check before and after.
//!
//! Trust: the worker is assumed compromised, and everything in the region is its to
//! scribble on. The supervisor computes the geometry from its own configuration and
//! never follows an offset or size read from the region; values it reads there are data
//! to report or compare (with wrapping or saturating arithmetic, never a panic), never
//! indexes. Before every activation it rewrites the whole header itself
//! ([`ShmRegion::prepare_activation`]), generation included, from its own copy: a
//! scribbled region is repaired by the next recovery.

use std::fs::File;
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::MmapRaw;

mod latency;
pub use latency::{
    DevLatency, LATENCY_BUCKETS, LATENCY_FINITE_BUCKETS, LATENCY_OPS, LatencyOp, LatencySnapshot,
    OpLatency, ThreadLatency, latency_bucket, latency_bucket_bound_us,
};

/// `"UBLKDSHM"` read as a big-endian u64.
pub const SHM_MAGIC: u64 = u64::from_be_bytes(*b"UBLKDSHM");
/// Bumped whenever the layout changes incompatibly.
pub const SHM_VERSION: u32 = 3;

const HEADER_BYTES: usize = 256;

/// Errors in creating, mapping or validating a region.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("cannot create the shared-memory region: {0}")]
    Create(#[source] std::io::Error),
    #[error("cannot map the shared-memory region: {0}")]
    Map(#[source] std::io::Error),
    #[error("the shared-memory region is {got} bytes, but its geometry needs {want}")]
    Size { got: usize, want: usize },
    #[error("the shared-memory region's {field} is {got:#x}, expected {want:#x}")]
    Mismatch { field: &'static str, got: u64, want: u64 },
    #[error("shared-memory geometry is invalid: {0}")]
    Geometry(String),
}

/// What the region is sized for: fixed for the device's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub dev_id: u32,
    pub nr_queues: u16,
    pub queue_depth: u16,
    pub nr_threads: u16,
}

impl Geometry {
    fn check(&self) -> Result<(), ShmError> {
        if self.nr_queues == 0 || self.queue_depth == 0 || self.nr_threads == 0 {
            return Err(ShmError::Geometry(format!("{self:?} has a zero dimension")));
        }
        Ok(())
    }

    fn threads_offset(&self) -> usize {
        HEADER_BYTES
    }

    fn tags_offset(&self) -> usize {
        self.threads_offset() + usize::from(self.nr_threads) * size_of::<ThreadSlot>()
    }

    fn nr_tags(&self) -> usize {
        usize::from(self.nr_queues) * usize::from(self.queue_depth)
    }

    fn latency_offset(&self) -> usize {
        (self.tags_offset() + self.nr_tags() * size_of::<TagSlot>())
            .next_multiple_of(align_of::<ThreadLatency>())
    }

    /// Bytes the region needs.
    pub fn region_bytes(&self) -> usize {
        self.latency_offset() + usize::from(self.nr_threads) * size_of::<ThreadLatency>()
    }
}

/// The region's header. Written once by the supervisor, except `generation` and the
/// counters.
#[repr(C)]
#[derive(Debug)]
pub struct ShmHeader {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub header_bytes: AtomicU32,
    pub dev_id: AtomicU32,
    pub nr_queues: AtomicU32,
    pub queue_depth: AtomicU32,
    pub nr_threads: AtomicU32,
    /// The worker incarnation the region belongs to; the supervisor bumps it before
    /// handing the region to a new worker, and the worker stamps it into its slots.
    pub generation: AtomicU64,
    pub counters: DevCounters,
}

/// Per-device I/O counters, each a single atomic (a reader never sees a torn value).
#[repr(C)]
#[derive(Debug, Default)]
pub struct DevCounters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub discards: AtomicU64,
    pub write_zeroes: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// I/Os completed with an error, of every operation.
    pub errors: AtomicU64,
    // Of `errors`, each operation's. After `errors`, in the header's room past the
    // older layout's counters, so the region's version stays 3: a worker of that layout
    // (adopted by a restarted ublkd, or still serving until `ublkctl upgrade`) leaves
    // these zero and counts only `errors`, which the supervisor still reads
    // ([`CounterSnapshot::unattributed_errors`]).
    pub read_errors: AtomicU64,
    pub write_errors: AtomicU64,
    pub flush_errors: AtomicU64,
    pub discard_errors: AtomicU64,
    pub write_zeroes_errors: AtomicU64,
}

/// A plain copy of [`DevCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CounterSnapshot {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub errors: u64,
    pub read_errors: u64,
    pub write_errors: u64,
    pub flush_errors: u64,
    pub discard_errors: u64,
    pub write_zeroes_errors: u64,
}

impl CounterSnapshot {
    /// Every I/O counted.
    pub fn ios(&self) -> u64 {
        self.reads
            .saturating_add(self.writes)
            .saturating_add(self.flushes)
            .saturating_add(self.discards)
            .saturating_add(self.write_zeroes)
    }

    /// Each operation's errors, in [`LatencyOp::ALL`]'s order (read, write, flush,
    /// discard, write zeroes).
    pub fn op_errors(&self) -> [u64; 5] {
        [
            self.read_errors,
            self.write_errors,
            self.flush_errors,
            self.discard_errors,
            self.write_zeroes_errors,
        ]
    }

    /// Errors counted without their operation: those of a worker of the older layout
    /// (which counted only `errors`), and of an operation outside the five. Saturating:
    /// the worker may have written anything.
    pub fn unattributed_errors(&self) -> u64 {
        let attributed = self.op_errors().into_iter().fold(0u64, u64::saturating_add);
        self.errors.saturating_sub(attributed)
    }
}

impl DevCounters {
    pub fn snapshot(&self) -> CounterSnapshot {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CounterSnapshot {
            reads: r(&self.reads),
            writes: r(&self.writes),
            flushes: r(&self.flushes),
            discards: r(&self.discards),
            write_zeroes: r(&self.write_zeroes),
            bytes_read: r(&self.bytes_read),
            bytes_written: r(&self.bytes_written),
            errors: r(&self.errors),
            read_errors: r(&self.read_errors),
            write_errors: r(&self.write_errors),
            flush_errors: r(&self.flush_errors),
            discard_errors: r(&self.discard_errors),
            write_zeroes_errors: r(&self.write_zeroes_errors),
        }
    }

    /// Adds `delta` (what one thread counted since it last added), touching only the
    /// counters that changed.
    pub fn add(&self, delta: &CounterSnapshot) {
        let add = |a: &AtomicU64, v: u64| {
            if v != 0 {
                a.fetch_add(v, Ordering::Relaxed);
            }
        };
        add(&self.reads, delta.reads);
        add(&self.writes, delta.writes);
        add(&self.flushes, delta.flushes);
        add(&self.discards, delta.discards);
        add(&self.write_zeroes, delta.write_zeroes);
        add(&self.bytes_read, delta.bytes_read);
        add(&self.bytes_written, delta.bytes_written);
        add(&self.errors, delta.errors);
        add(&self.read_errors, delta.read_errors);
        add(&self.write_errors, delta.write_errors);
        add(&self.flush_errors, delta.flush_errors);
        add(&self.discard_errors, delta.discard_errors);
        add(&self.write_zeroes_errors, delta.write_zeroes_errors);
    }
}

/// One worker thread's liveness.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct ThreadSlot {
    /// Bumped twice per turn of the thread's loop: to odd when the thread wakes with
    /// events to handle, back to even when it is about to wait in its ring again. A
    /// thread waiting for I/O does not bump it; one stuck in a turn stays odd.
    pub heartbeat: AtomicU64,
    /// Requests this thread has handed to its backend and waits for, as of the end of
    /// its last turn.
    pub inflight: AtomicU32,
    /// The thread's kernel tid, 0 before it starts.
    pub tid: AtomicU32,
    /// The generation the thread runs under.
    pub generation: AtomicU64,
}

/// Tag record states.
pub mod tag_state {
    /// Not fetched by this worker incarnation yet.
    pub const IDLE: u32 = 0;
    /// Fetched: the target is working on it.
    pub const IN_TARGET: u32 = 1;
    /// The target finished it and its result is committed (in this loop turn's COMMIT):
    /// from then on the kernel owns the tag until a FETCH delivers it again. Not reset
    /// to `IDLE` after the COMMIT: that would cost a pass over every COMMIT's elements.
    pub const COMMITTED: u32 = 2;
}

/// One tag's in-flight record, guarded by `seq` (odd while being written).
#[repr(C)]
#[derive(Debug, Default)]
pub struct TagSlot {
    pub seq: AtomicU32,
    pub state: AtomicU32,
    pub op: AtomicU32,
    pub nr_sectors: AtomicU32,
    pub start_sector: AtomicU64,
    /// Worker-monotonic milliseconds when the tag was fetched, at most: the queue loop's
    /// last clock read before it (a loop turn reads the clock only when one of its
    /// requests waits at the backend).
    pub since_ms: AtomicU64,
}

/// A consistent copy of a [`TagSlot`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TagRecord {
    pub state: u32,
    pub op: u32,
    pub nr_sectors: u32,
    pub start_sector: u64,
    pub since_ms: u64,
}

impl TagSlot {
    /// Writes a record. Only the one thread that owns the tag writes its slot.
    pub fn write(&self, rec: &TagRecord) {
        // Single writer: `seq` is even here.
        let s = self.seq.load(Ordering::Relaxed);
        self.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        self.state.store(rec.state, Ordering::Relaxed);
        self.op.store(rec.op, Ordering::Relaxed);
        self.nr_sectors.store(rec.nr_sectors, Ordering::Relaxed);
        self.start_sector.store(rec.start_sector, Ordering::Relaxed);
        self.since_ms.store(rec.since_ms, Ordering::Relaxed);
        self.seq.store(s.wrapping_add(2), Ordering::Release);
    }

    /// Only the state changes (the common case on the hot path).
    pub fn set_state(&self, state: u32) {
        self.state.store(state, Ordering::Release);
    }

    /// A consistent copy, or `None` if the writer kept changing it (after a few tries)
    /// — a reader in another process never waits on a writer.
    pub fn read(&self) -> Option<TagRecord> {
        for _ in 0..16 {
            let before = self.seq.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let rec = TagRecord {
                state: self.state.load(Ordering::Relaxed),
                op: self.op.load(Ordering::Relaxed),
                nr_sectors: self.nr_sectors.load(Ordering::Relaxed),
                start_sector: self.start_sector.load(Ordering::Relaxed),
                since_ms: self.since_ms.load(Ordering::Relaxed),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == before {
                return Some(rec);
            }
        }
        None
    }
}

const _: () = assert!(size_of::<ShmHeader>() <= HEADER_BYTES);
// Version 3's fields keep their offsets: the per-operation errors only follow them.
const _: () = assert!(std::mem::offset_of!(ShmHeader, counters) == 40);
const _: () = assert!(std::mem::offset_of!(DevCounters, errors) == 56);
const _: () = assert!(std::mem::offset_of!(DevCounters, read_errors) == 64);
const _: () = assert!(size_of::<OpLatency>() == 256);
const _: () = assert!(size_of::<ThreadLatency>() == 1280);
const _: () = assert!(size_of::<ThreadSlot>() == 64);
const _: () = assert!(size_of::<TagSlot>() == 32);

/// A mapping of a device's region.
#[derive(Debug)]
pub struct ShmRegion {
    map: MmapRaw,
    geometry: Geometry,
}

impl ShmRegion {
    /// Creates a new region in a fresh memfd for `geometry` and writes its header.
    /// Returns the region and the fd to hand to workers.
    pub fn create(geometry: Geometry) -> Result<(ShmRegion, OwnedFd), ShmError> {
        let name = c"ublkd-device-shm";
        // SAFETY: `name` is a valid NUL-terminated string; memfd_create has no other
        // memory-safety preconditions.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(ShmError::Create(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` was just returned by memfd_create and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Self::create_in(File::from(fd), geometry)
    }

    /// Makes `file` (empty or stale) a new region for `geometry`: sizes it, clears it
    /// and writes the header. A file on tmpfs outlives the supervisor, which is how a
    /// restarted supervisor finds a device's region again.
    pub fn create_in(file: File, geometry: Geometry) -> Result<(ShmRegion, OwnedFd), ShmError> {
        geometry.check()?;
        file.set_len(0).map_err(ShmError::Create)?;
        file.set_len(geometry.region_bytes() as u64).map_err(ShmError::Create)?;
        let map = MmapRaw::map_raw(&file).map_err(ShmError::Map)?;
        let region = ShmRegion { map, geometry };
        region.write_header(0);
        Ok((region, file.into()))
    }

    /// Maps an existing region and checks that its header describes `geometry`.
    pub fn open(fd: BorrowedFd<'_>, geometry: Geometry) -> Result<ShmRegion, ShmError> {
        geometry.check()?;
        let file = File::from(fd.try_clone_to_owned().map_err(ShmError::Map)?);
        let len = file.metadata().map_err(ShmError::Map)?.len() as usize;
        let want = geometry.region_bytes();
        if len != want {
            return Err(ShmError::Size { got: len, want });
        }
        let map = MmapRaw::map_raw(&file).map_err(ShmError::Map)?;
        let region = ShmRegion { map, geometry };
        region.validate()?;
        Ok(region)
    }

    /// Checks the header against the geometry this mapping was made for. The
    /// supervisor calls it before trusting anything else in the region.
    pub fn validate(&self) -> Result<(), ShmError> {
        let h = self.header();
        let g = &self.geometry;
        let checks: [(&'static str, u64, u64); 7] = [
            ("magic", h.magic.load(Ordering::Acquire), SHM_MAGIC),
            ("version", u64::from(h.version.load(Ordering::Relaxed)), u64::from(SHM_VERSION)),
            ("header size", u64::from(h.header_bytes.load(Ordering::Relaxed)), HEADER_BYTES as u64),
            ("device id", u64::from(h.dev_id.load(Ordering::Relaxed)), u64::from(g.dev_id)),
            ("queue count", u64::from(h.nr_queues.load(Ordering::Relaxed)), u64::from(g.nr_queues)),
            (
                "queue depth",
                u64::from(h.queue_depth.load(Ordering::Relaxed)),
                u64::from(g.queue_depth),
            ),
            (
                "thread count",
                u64::from(h.nr_threads.load(Ordering::Relaxed)),
                u64::from(g.nr_threads),
            ),
        ];
        for (field, got, want) in checks {
            if got != want {
                return Err(ShmError::Mismatch { field, got, want });
            }
        }
        Ok(())
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The fd-independent address of byte `offset`, checked against the mapping.
    fn at<T>(&self, offset: usize) -> &T {
        assert!(offset + size_of::<T>() <= self.map.len(), "shm offset out of range");
        assert!(offset.is_multiple_of(align_of::<T>()), "shm offset misaligned");
        // SAFETY: the range is inside the live mapping (asserted above; the mapping
        // lives as long as `self`), suitably aligned (asserted; the mapping is page
        // aligned), and `T` is one of this module's `#[repr(C)]` structs made only of
        // atomics, for which every bit pattern is valid and shared mutation through
        // `&T` is sound. No `&mut` to this memory is ever created.
        unsafe { &*self.map.as_ptr().wrapping_add(offset).cast::<T>() }
    }

    pub fn header(&self) -> &ShmHeader {
        self.at(0)
    }

    pub fn counters(&self) -> &DevCounters {
        &self.header().counters
    }

    pub fn generation(&self) -> u64 {
        self.header().generation.load(Ordering::Acquire)
    }

    /// Makes the region ready for a new worker incarnation (supervisor only, before
    /// the worker takes over): rewrites every header field but the counters from the
    /// geometry and `generation` (the supervisor's own count, never read back from the
    /// region), and clears every thread slot and tag record. Whatever a previous worker
    /// wrote over the header is gone afterwards, so [`Self::validate`] passes again.
    pub fn prepare_activation(&self, generation: u64) {
        self.write_header(generation);
        self.reset_worker_state();
    }

    fn write_header(&self, generation: u64) {
        let h = self.header();
        let g = &self.geometry;
        h.magic.store(SHM_MAGIC, Ordering::Relaxed);
        h.version.store(SHM_VERSION, Ordering::Relaxed);
        h.header_bytes.store(HEADER_BYTES as u32, Ordering::Relaxed);
        h.dev_id.store(g.dev_id, Ordering::Relaxed);
        h.nr_queues.store(u32::from(g.nr_queues), Ordering::Relaxed);
        h.queue_depth.store(u32::from(g.queue_depth), Ordering::Relaxed);
        h.nr_threads.store(u32::from(g.nr_threads), Ordering::Relaxed);
        h.generation.store(generation, Ordering::Release);
    }

    /// Thread slot `index`, or `None` past the geometry's thread count.
    pub fn thread(&self, index: usize) -> Option<&ThreadSlot> {
        (index < usize::from(self.geometry.nr_threads))
            .then(|| self.at(self.geometry.threads_offset() + index * size_of::<ThreadSlot>()))
    }

    /// The in-flight record of `tag` on queue `q_id`, or `None` outside the geometry.
    pub fn tag(&self, q_id: u16, tag: u16) -> Option<&TagSlot> {
        let g = &self.geometry;
        if q_id >= g.nr_queues || tag >= g.queue_depth {
            return None;
        }
        let index = usize::from(q_id) * usize::from(g.queue_depth) + usize::from(tag);
        Some(self.at(g.tags_offset() + index * size_of::<TagSlot>()))
    }

    /// Thread `index`'s latency histograms, or `None` past the geometry's thread count.
    pub fn latency(&self, index: usize) -> Option<&ThreadLatency> {
        (index < usize::from(self.geometry.nr_threads))
            .then(|| self.at(self.geometry.latency_offset() + index * size_of::<ThreadLatency>()))
    }

    /// The device's latency histograms, every thread's added up (saturating: the
    /// worker may have written anything there).
    pub fn latency_snapshot(&self) -> DevLatency {
        let mut dev = DevLatency::default();
        for t in 0..usize::from(self.geometry.nr_threads) {
            if let Some(thread) = self.latency(t) {
                for op in LatencyOp::ALL {
                    dev.ops[op as usize].add(&thread.snapshot(op));
                }
            }
        }
        dev
    }

    /// Requests the worker's threads say wait at their backend, added up and capped at
    /// the device's tag count (no more can be in flight; the worker may write anything).
    pub fn inflight(&self) -> u64 {
        let total = (0..usize::from(self.geometry.nr_threads))
            .filter_map(|t| self.thread(t))
            .fold(0u64, |sum, slot| {
                sum.saturating_add(u64::from(slot.inflight.load(Ordering::Relaxed)))
            });
        total.min(self.geometry.nr_tags() as u64)
    }

    /// Clears every tag record and thread slot (between worker incarnations: the
    /// kernel owns every tag again after a recovery).
    fn reset_worker_state(&self) {
        for t in 0..usize::from(self.geometry.nr_threads) {
            if let Some(slot) = self.thread(t) {
                slot.heartbeat.store(0, Ordering::Relaxed);
                slot.inflight.store(0, Ordering::Relaxed);
                slot.tid.store(0, Ordering::Relaxed);
                slot.generation.store(0, Ordering::Relaxed);
            }
        }
        for q in 0..self.geometry.nr_queues {
            for tag in 0..self.geometry.queue_depth {
                if let Some(slot) = self.tag(q, tag) {
                    // Not `write`: its sequence protocol trusts `seq` to be even, and a
                    // scribbled one need not be.
                    slot.seq.store(0, Ordering::Relaxed);
                    slot.state.store(tag_state::IDLE, Ordering::Relaxed);
                    slot.op.store(0, Ordering::Relaxed);
                    slot.nr_sectors.store(0, Ordering::Relaxed);
                    slot.start_sector.store(0, Ordering::Relaxed);
                    slot.since_ms.store(0, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn geom() -> Geometry {
        Geometry { dev_id: 7, nr_queues: 2, queue_depth: 4, nr_threads: 3 }
    }

    #[test]
    fn create_then_open_sees_the_same_memory() {
        let (a, fd) = ShmRegion::create(geom()).unwrap();
        let b = ShmRegion::open(fd.as_fd(), geom()).unwrap();
        a.counters().reads.fetch_add(5, Ordering::Relaxed);
        assert_eq!(b.counters().snapshot().reads, 5);
        b.thread(2).unwrap().heartbeat.store(9, Ordering::Relaxed);
        assert_eq!(a.thread(2).unwrap().heartbeat.load(Ordering::Relaxed), 9);
        b.tag(1, 3).unwrap().write(&TagRecord {
            state: 1,
            op: 1,
            nr_sectors: 8,
            start_sector: 64,
            since_ms: 3,
        });
        assert_eq!(a.tag(1, 3).unwrap().read().unwrap().start_sector, 64);
    }

    #[test]
    fn open_with_other_geometry_is_refused() {
        let (_a, fd) = ShmRegion::create(geom()).unwrap();
        let mut other = geom();
        other.nr_threads = 4;
        assert!(matches!(ShmRegion::open(fd.as_fd(), other), Err(ShmError::Size { .. })));
        let mut other = geom();
        other.dev_id = 8;
        let err = ShmRegion::open(fd.as_fd(), other).unwrap_err();
        assert_eq!(err.to_string(), "the shared-memory region's device id is 0x7, expected 0x8");
    }

    #[test]
    fn a_scribbled_header_fails_validation() {
        let (a, _fd) = ShmRegion::create(geom()).unwrap();
        a.header().magic.store(0, Ordering::Relaxed);
        assert!(matches!(a.validate(), Err(ShmError::Mismatch { field: "magic", .. })));
    }

    #[test]
    fn out_of_range_slots_are_none() {
        let (a, _fd) = ShmRegion::create(geom()).unwrap();
        assert!(a.thread(3).is_none());
        assert!(a.tag(2, 0).is_none());
        assert!(a.tag(0, 4).is_none());
        assert!(a.tag(1, 3).is_some());
    }

    #[test]
    fn zero_dimensions_are_refused() {
        let mut g = geom();
        g.queue_depth = 0;
        assert!(matches!(ShmRegion::create(g), Err(ShmError::Geometry(_))));
    }

    #[test]
    fn tag_records_are_never_torn_under_a_concurrent_writer() {
        let (a, fd) = ShmRegion::create(geom()).unwrap();
        let b = ShmRegion::open(fd.as_fd(), geom()).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    // Every field derives from i: a torn read would mix two values.
                    a.tag(0, 0).unwrap().write(&TagRecord {
                        state: (i % 3) as u32,
                        op: i as u32,
                        nr_sectors: i as u32,
                        start_sector: i,
                        since_ms: i,
                    });
                }
            })
        };
        let mut seen = 0;
        for _ in 0..200_000 {
            if let Some(r) = b.tag(0, 0).unwrap().read() {
                assert_eq!(u64::from(r.op), r.start_sector & 0xffff_ffff);
                assert_eq!(r.start_sector, r.since_ms);
                seen += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert!(seen > 0);
    }

    #[test]
    fn latency_buckets_are_powers_of_two_microseconds_rounded_up() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(1000), 0);
        assert_eq!(latency_bucket(1001), 1);
        assert_eq!(latency_bucket(2000), 1);
        assert_eq!(latency_bucket(2001), 2);
        assert_eq!(latency_bucket(16_000), 4);
        assert_eq!(latency_bucket(16_001), 5);
        assert_eq!(latency_bucket((1 << 23) * 1000), LATENCY_FINITE_BUCKETS - 1);
        assert_eq!(latency_bucket((1 << 23) * 1000 + 1), LATENCY_FINITE_BUCKETS);
        assert_eq!(latency_bucket(u64::MAX), LATENCY_FINITE_BUCKETS);
        for i in 0..LATENCY_FINITE_BUCKETS {
            let bound_ns = latency_bucket_bound_us(i).unwrap() * 1000;
            assert_eq!(latency_bucket(bound_ns), i, "bound of bucket {i}");
            assert_eq!(latency_bucket(bound_ns + 1), i + 1, "just past bucket {i}");
        }
        assert_eq!(latency_bucket_bound_us(LATENCY_FINITE_BUCKETS), None);
    }

    #[test]
    fn latency_is_summed_over_threads_and_kept_across_activations() {
        let (a, fd) = ShmRegion::create(geom()).unwrap();
        let b = ShmRegion::open(fd.as_fd(), geom()).unwrap();
        b.latency(0).unwrap().record(LatencyOp::Read, 3_000);
        b.latency(2).unwrap().record(LatencyOp::Read, 3_500);
        b.latency(2).unwrap().record(LatencyOp::Flush, 20_000_000_000);
        assert!(b.latency(3).is_none());
        a.prepare_activation(1);
        let lat = a.latency_snapshot();
        let read = lat.op(LatencyOp::Read);
        assert_eq!(read.buckets[2], 2);
        assert_eq!(read.count(), 2);
        assert_eq!(read.sum_ns, 6_500);
        assert_eq!(lat.op(LatencyOp::Flush).buckets[LATENCY_FINITE_BUCKETS], 1);
        assert_eq!(lat.merged().count(), 3);
        assert_eq!(lat.op(LatencyOp::Write).count(), 0);
    }

    #[test]
    fn scribbled_latency_counts_saturate_and_stay_monotone() {
        let (a, _fd) = ShmRegion::create(geom()).unwrap();
        for t in 0..3 {
            let h = &a.latency(t).unwrap().ops[0];
            h.buckets[1].store(u64::MAX - 1, Ordering::Relaxed);
            h.buckets[5].store(7, Ordering::Relaxed);
        }
        let read = *a.latency_snapshot().op(LatencyOp::Read);
        assert_eq!(read.buckets[1], u64::MAX);
        let cumulative = read.cumulative();
        assert!(cumulative.windows(2).all(|w| w[0] <= w[1]), "{cumulative:?}");
        assert_eq!(read.count(), u64::MAX);
    }

    #[test]
    fn quantiles_are_the_bucket_reaching_the_rank() {
        let mut h = LatencySnapshot::default();
        assert_eq!(h.quantile_bucket(0.5), None);
        h.buckets[3] = 98;
        h.buckets[7] = 2;
        assert_eq!(h.quantile_bucket(0.5), Some(3));
        assert_eq!(h.quantile_bucket(0.98), Some(3));
        assert_eq!(h.quantile_bucket(0.99), Some(7));
        h.buckets[LATENCY_FINITE_BUCKETS] = u64::MAX;
        assert_eq!(h.quantile_bucket(0.5), Some(LATENCY_FINITE_BUCKETS));
    }

    #[test]
    fn inflight_is_capped_at_the_tag_count() {
        let (a, _fd) = ShmRegion::create(geom()).unwrap();
        a.thread(0).unwrap().inflight.store(3, Ordering::Relaxed);
        assert_eq!(a.inflight(), 3);
        a.thread(1).unwrap().inflight.store(u32::MAX, Ordering::Relaxed);
        a.thread(2).unwrap().inflight.store(u32::MAX, Ordering::Relaxed);
        assert_eq!(a.inflight(), 8);
    }

    #[test]
    fn counters_add_a_threads_delta() {
        let c = DevCounters::default();
        let delta = CounterSnapshot {
            reads: 3,
            bytes_read: 12288,
            errors: 1,
            read_errors: 1,
            ..Default::default()
        };
        c.add(&delta);
        c.add(&CounterSnapshot { writes: 2, bytes_written: 8192, ..Default::default() });
        c.add(&delta);
        let want = CounterSnapshot {
            reads: 6,
            writes: 2,
            bytes_read: 24576,
            bytes_written: 8192,
            errors: 2,
            read_errors: 2,
            ..Default::default()
        };
        assert_eq!(c.snapshot(), want);
        assert_eq!(c.snapshot().unattributed_errors(), 0);
    }

    #[test]
    fn errors_of_a_worker_of_the_older_layout_stay_counted_without_their_op() {
        let (a, _fd) = ShmRegion::create(geom()).unwrap();
        // What a version-3 worker does: only the total.
        a.counters().errors.fetch_add(3, Ordering::Relaxed);
        // Then a worker of this layout, after an upgrade: the total and the op.
        a.prepare_activation(1);
        a.counters().add(&CounterSnapshot { errors: 2, write_errors: 2, ..Default::default() });
        let c = a.counters().snapshot();
        assert_eq!(c.op_errors(), [0, 2, 0, 0, 0]);
        assert_eq!(c.unattributed_errors(), 3);
        // Scribbled: more by op than in all never underflows.
        a.counters().read_errors.store(u64::MAX, Ordering::Relaxed);
        assert_eq!(a.counters().snapshot().unattributed_errors(), 0);
    }
}
