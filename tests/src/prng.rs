//! Seeded randomness for the kernel tests that strike at random (chaos, churn): each
//! prints its seed, and `UBLKD_CHAOS_SEED=N` replays a failure.

use std::time::Duration;

/// xorshift64*: small, seeded, reproducible.
#[derive(Debug)]
pub struct Prng(u64);

impl Prng {
    pub fn new(seed: u64) -> Prng {
        Prng(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[lo, hi]`, to the millisecond.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = (hi - lo).as_millis() as u64 + 1;
        lo + Duration::from_millis(self.next_u64() % span)
    }
}

/// The chaos seed: `UBLKD_CHAOS_SEED` if set (to replay a failure), else `default`.
pub fn chaos_seed(default: u64) -> u64 {
    match std::env::var("UBLKD_CHAOS_SEED") {
        Ok(s) => s.parse().unwrap_or_else(|e| panic!("UBLKD_CHAOS_SEED={s:?}: {e}")),
        Err(_) => default,
    }
}
