//! ublkd's own `RLIMIT_NOFILE`: raised at start from the soft limit it was given
//! (1024 by default, since select(2) cannot take larger fd numbers) to the hard limit,
//! because ublkd holds about ten fds per device and has no use for select.
//!
//! Workers are started with the soft limit ublkd itself was given, not the raised
//! one ([`inherited_nofile`]): a worker holds a handful of fds (the sandbox lowers its
//! limit to `policy::MAX_FDS` anyway), and a program started with a huge soft limit is
//! what systemd's own services are protected from.

use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::resource::{Resource, getrlimit, setrlimit};

/// The soft limit ublkd was started with (0: not raised, workers keep what ublkd has).
static INHERITED_SOFT: AtomicU64 = AtomicU64::new(0);
/// The hard limit, which ublkd leaves as it is.
static HARD: AtomicU64 = AtomicU64::new(0);

/// `RLIMIT_NOFILE` before and after [`raise_nofile`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nofile {
    /// The soft limit ublkd was started with.
    pub was: u64,
    /// The soft limit now: the hard limit.
    pub now: u64,
    pub hard: u64,
}

/// Errors in raising the limit.
#[derive(Debug, thiserror::Error)]
pub enum RlimitError {
    #[error("cannot read RLIMIT_NOFILE: {0}")]
    Get(#[source] nix::Error),
    #[error(
        "cannot raise RLIMIT_NOFILE's soft limit from {soft} to its hard limit {hard}: {source}"
    )]
    Set { soft: u64, hard: u64, source: nix::Error },
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, and remembers the soft limit
/// it was for the workers ([`inherited_nofile`]).
pub fn raise_nofile() -> Result<Nofile, RlimitError> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(RlimitError::Get)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(|source| RlimitError::Set {
            soft,
            hard,
            source,
        })?;
        HARD.store(hard, Ordering::Relaxed);
        INHERITED_SOFT.store(soft, Ordering::Relaxed);
    }
    Ok(Nofile { was: soft, now: hard, hard })
}

/// The `RLIMIT_NOFILE` (soft, hard) a worker is to be started with, if ublkd raised
/// its own ([`raise_nofile`]); `None`: the worker inherits ublkd's.
pub fn inherited_nofile() -> Option<(u64, u64)> {
    let soft = INHERITED_SOFT.load(Ordering::Relaxed);
    (soft > 0).then(|| (soft, HARD.load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one_and_the_old_one_kept_for_workers() {
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        // Under a soft limit already at the hard one, lowered first (to a limit still
        // far above what the other tests of this process open meanwhile).
        let low = if soft < hard { soft } else { hard / 2 };
        setrlimit(Resource::RLIMIT_NOFILE, low, hard).unwrap();
        let raised = raise_nofile().unwrap();
        assert_eq!(raised, Nofile { was: low, now: hard, hard });
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (hard, hard));
        assert_eq!(inherited_nofile(), Some((low, hard)));
        setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    }
}
