//! The region's latency histograms: per queue thread and operation, from FETCH to
//! COMMIT, written by one thread each and summed by the supervisor (see the parent
//! module for the region's layout and trust model).

use std::sync::atomic::{AtomicU64, Ordering};

/// The operations a latency histogram is kept for, in the order of
/// [`ThreadLatency::ops`]: the ones [`DevCounters`](super::DevCounters) counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatencyOp {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
}

/// How many [`LatencyOp`]s there are.
pub const LATENCY_OPS: usize = 5;

impl LatencyOp {
    pub const ALL: [LatencyOp; LATENCY_OPS] =
        [Self::Read, Self::Write, Self::Flush, Self::Discard, Self::WriteZeroes];

    /// The name metrics label it with.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Flush => "flush",
            Self::Discard => "discard",
            Self::WriteZeroes => "write_zeroes",
        }
    }

    /// The class of a ublk request op (`UBLK_IO_OP_*`), if it is one that is counted.
    pub const fn of_ublk_op(op: u8) -> Option<LatencyOp> {
        match op {
            crate::uapi::UBLK_IO_OP_READ => Some(Self::Read),
            crate::uapi::UBLK_IO_OP_WRITE => Some(Self::Write),
            crate::uapi::UBLK_IO_OP_FLUSH => Some(Self::Flush),
            crate::uapi::UBLK_IO_OP_DISCARD => Some(Self::Discard),
            crate::uapi::UBLK_IO_OP_WRITE_ZEROES => Some(Self::WriteZeroes),
            _ => None,
        }
    }
}

/// Finite latency buckets: bucket `i` counts requests that took at most 2^i µs (and
/// more than bucket `i - 1`'s bound), 1 µs to 2^23 µs (8.39 s). Powers of two keep the
/// bucket a request falls in one leading-zeros count away, with no table or search on
/// the data path, and give p50/p99 within a factor of two.
pub const LATENCY_FINITE_BUCKETS: usize = 24;
/// The finite buckets and the one for everything slower (`+Inf`).
pub const LATENCY_BUCKETS: usize = LATENCY_FINITE_BUCKETS + 1;

/// The bucket a request that took `ns` nanoseconds is counted in.
#[inline]
pub fn latency_bucket(ns: u64) -> usize {
    // Whole microseconds, rounded up: a request in bucket i took at most 2^i µs.
    let us = ns.div_ceil(1000);
    // ceil(log2(us)), 0 for us <= 1.
    let log2 = (u64::BITS - us.saturating_sub(1).leading_zeros()) as usize;
    log2.min(LATENCY_FINITE_BUCKETS)
}

/// Bucket `i`'s upper bound in microseconds; `None` for the last (`+Inf`) bucket.
pub const fn latency_bucket_bound_us(i: usize) -> Option<u64> {
    if i < LATENCY_FINITE_BUCKETS { Some(1 << i) } else { None }
}

/// One operation's latency histogram: a count per bucket (not cumulative: each request
/// adds to one bucket) and the sum of the latencies. Only one thread writes it.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct OpLatency {
    pub buckets: [AtomicU64; LATENCY_BUCKETS],
    /// Nanoseconds, wrapping (after centuries of summed latency).
    pub sum_ns: AtomicU64,
    _reserved: [AtomicU64; 6],
}

/// One queue thread's latency histograms, one per [`LatencyOp`]. Per thread, not per
/// device: each is written by one thread only, with a plain load and store (no locked
/// read-modify-write), and no cache line is shared between two queue threads' hot
/// paths. The supervisor sums the threads when it reads them. They are kept across
/// worker incarnations (thread `i` of the next worker goes on counting in slot `i`), so
/// that they only grow, like the device counters.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct ThreadLatency {
    pub ops: [OpLatency; LATENCY_OPS],
}

impl ThreadLatency {
    /// Counts one request of `op` that took `ns` nanoseconds. Only the thread that owns
    /// this slot calls it: load and store need no atomic read-modify-write.
    #[inline]
    pub fn record(&self, op: LatencyOp, ns: u64) {
        let h = &self.ops[op as usize];
        let add = |a: &AtomicU64, v: u64| {
            a.store(a.load(Ordering::Relaxed).wrapping_add(v), Ordering::Relaxed);
        };
        add(&h.buckets[latency_bucket(ns)], 1);
        add(&h.sum_ns, ns);
    }

    /// A plain copy of `op`'s histogram.
    pub fn snapshot(&self, op: LatencyOp) -> LatencySnapshot {
        let h = &self.ops[op as usize];
        let mut snap =
            LatencySnapshot { sum_ns: h.sum_ns.load(Ordering::Relaxed), ..Default::default() };
        for (to, from) in snap.buckets.iter_mut().zip(&h.buckets) {
            *to = from.load(Ordering::Relaxed);
        }
        snap
    }
}

/// A plain copy of an [`OpLatency`] (or several added up): per-bucket counts, not
/// cumulative. Read from the region, so any value at all: users add with saturation
/// and never index or size anything by it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LatencySnapshot {
    pub buckets: [u64; LATENCY_BUCKETS],
    pub sum_ns: u64,
}

impl LatencySnapshot {
    /// Adds `other` in, saturating (`sum_ns` wraps, as in the region).
    pub fn add(&mut self, other: &LatencySnapshot) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a = a.saturating_add(*b);
        }
        self.sum_ns = self.sum_ns.wrapping_add(other.sum_ns);
    }

    /// Cumulative counts, bucket by bucket (what OpenMetrics' `le` buckets are):
    /// saturating, so they never decrease whatever the region held.
    pub fn cumulative(&self) -> [u64; LATENCY_BUCKETS] {
        let mut out = [0; LATENCY_BUCKETS];
        let mut total = 0u64;
        for (o, b) in out.iter_mut().zip(&self.buckets) {
            total = total.saturating_add(*b);
            *o = total;
        }
        out
    }

    /// Requests counted (saturating).
    pub fn count(&self) -> u64 {
        self.cumulative()[LATENCY_BUCKETS - 1]
    }

    /// The bucket that holds quantile `q` (0 < q <= 1, to a basis point) of the
    /// requests counted, or `None` with none counted: the first bucket whose cumulative
    /// count reaches `ceil(q × count)`.
    pub fn quantile_bucket(&self, q: f64) -> Option<usize> {
        let count = self.count();
        if count == 0 {
            return None;
        }
        // In integers: 0.99 × 100 is 99.00000000000001 in floating point, whose ceiling
        // would be the 100th request instead of the 99th.
        let basis_points = (q.clamp(0.0, 1.0) * 10_000.0).round() as u128;
        // At least 1: the smallest rank that is a request.
        let rank = (u128::from(count) * basis_points).div_ceil(10_000).max(1);
        self.cumulative().iter().position(|&c| u128::from(c) >= rank)
    }
}

/// A device's latency, one histogram per [`LatencyOp`], all threads added up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DevLatency {
    pub ops: [LatencySnapshot; LATENCY_OPS],
}

impl DevLatency {
    pub fn op(&self, op: LatencyOp) -> &LatencySnapshot {
        &self.ops[op as usize]
    }

    /// Every operation in one histogram.
    pub fn merged(&self) -> LatencySnapshot {
        let mut all = LatencySnapshot::default();
        for h in &self.ops {
            all.add(h);
        }
        all
    }
}
