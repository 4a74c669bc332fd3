//! A worker's io_uring instances, copied into the supervisor: so that when the worker
//! dies, the supervisor can unregister their files and buffers, and the kernel lets go
//! of `/dev/ublkcN` at once (see [`super::Worker::release_device`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use ublkd_proto::uapi;

use super::WorkerError;
use super::pidfd::getfd;

/// The most rings a worker may name: one per queue thread.
pub(super) const MAX_RINGS: usize = ublkd_config::MAX_THREADS as usize;

/// Copies a worker's rings (fd numbers in the worker) into the supervisor, each
/// checked to be an io_uring. Where the kernel does not let the supervisor copy them
/// (EPERM: no CAP_SYS_PTRACE, or Yama's ptrace_scope 3), the worker serves as well and
/// only its recovery waits longer: that is logged, not refused.
pub(super) fn copy_rings(
    pidfd: BorrowedFd<'_>,
    pid: u32,
    numbers: &[i32],
) -> Result<Vec<OwnedFd>, WorkerError> {
    if numbers.len() > MAX_RINGS {
        let what = format!("named {} rings, more than {MAX_RINGS}", numbers.len());
        return Err(WorkerError::Protocol { pid, what });
    }
    let mut rings = Vec::with_capacity(numbers.len());
    for &number in numbers {
        let ring = match getfd(pidfd, number) {
            Ok(ring) => ring,
            Err(source) if source.raw_os_error() == Some(libc::EPERM) => {
                tracing::warn!(
                    worker_pid = pid,
                    "cannot copy the worker's rings ({source}): its device's recoveries \
                     will wait for the kernel to tear the rings down"
                );
                return Ok(Vec::new());
            }
            Err(source) => return Err(WorkerError::Rings { pid, number, source }),
        };
        if let Some(what) = not_an_io_uring(ring.as_fd()) {
            let what = format!("named its fd {number} as a ring, but that is {what}");
            return Err(WorkerError::Protocol { pid, what });
        }
        rings.push(ring);
    }
    Ok(rings)
}

/// Unregisters every ring's buffers, then its files; returns how many calls the
/// kernel refused (ENXIO, nothing of that kind registered, is not a refusal).
pub(super) fn unregister_files_and_buffers(rings: &[OwnedFd]) -> usize {
    let mut refused = 0;
    // Buffers first: with zero copy they hold the requests' pages, and ublk's release
    // waits for those before it lets the device go.
    for opcode in [uapi::IORING_UNREGISTER_BUFFERS, uapi::IORING_UNREGISTER_FILES] {
        for ring in rings {
            let rc = crate::sys::io_uring_unregister(ring.as_fd(), opcode);
            if rc.is_err_and(|e| e.raw_os_error() != Some(libc::ENXIO)) {
                refused += 1;
            }
        }
    }
    refused
}

/// Why `fd` is not an io_uring instance, if it is not.
fn not_an_io_uring(fd: BorrowedFd<'_>) -> Option<String> {
    match std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        Ok(target) if target.as_os_str() == "anon_inode:[io_uring]" => None,
        Ok(target) => Some(format!("an fd to {}", target.display())),
        Err(e) => Some(format!("an fd it cannot inspect ({e})")),
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io;
    use std::os::fd::RawFd;

    use super::*;
    use crate::worker::pidfd::tests::own_pidfd;

    fn io_uring_register(ring: RawFd, opcode: u32, arg: *const libc::c_void, n: u32) -> i64 {
        // SAFETY: `arg` points to `n` fds (or is null with `n` 0) for the call's duration.
        unsafe { libc::syscall(libc::SYS_io_uring_register, ring, opcode, arg, n) }
    }

    #[test]
    fn a_named_fd_that_is_not_a_ring_is_refused_naming_what_it_is() {
        let null = File::open("/dev/null").unwrap();
        let err = copy_rings(own_pidfd().as_fd(), 7, &[null.as_raw_fd()]).unwrap_err();
        assert!(matches!(err, WorkerError::Protocol { pid: 7, .. }), "{err:?}");
        assert!(err.to_string().contains("/dev/null"), "{err}");
    }

    #[test]
    fn a_named_fd_that_does_not_exist_is_refused() {
        let err = copy_rings(own_pidfd().as_fd(), 7, &[-1]).unwrap_err();
        assert!(matches!(err, WorkerError::Rings { number: -1, .. }), "{err:?}");
    }

    #[test]
    fn more_rings_than_threads_are_refused() {
        let err = copy_rings(own_pidfd().as_fd(), 7, &[0; MAX_RINGS + 1]).unwrap_err();
        assert!(err.to_string().contains(&format!("more than {MAX_RINGS}")), "{err}");
    }

    #[test]
    fn a_copied_ring_loses_its_files_and_buffers() {
        let mut params = [0u8; 120]; // struct io_uring_params, zeroed: defaults
        // SAFETY: io_uring_setup reads and writes `params` (120 bytes, its size).
        let raw = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4, params.as_mut_ptr()) };
        assert!(raw >= 0, "io_uring_setup: {}", io::Error::last_os_error());
        // SAFETY: `raw` is a new fd owned by nothing else.
        let ring = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) };
        let null = File::open("/dev/null").unwrap();
        let fds = [null.as_raw_fd()];
        const IORING_REGISTER_FILES: u32 = 2;
        let rc = io_uring_register(ring.as_raw_fd(), IORING_REGISTER_FILES, fds.as_ptr().cast(), 1);
        assert_eq!(rc, 0, "register files: {}", io::Error::last_os_error());

        let rings = copy_rings(own_pidfd().as_fd(), 7, &[ring.as_raw_fd()]).unwrap();
        assert_eq!(rings.len(), 1);
        assert_eq!(unregister_files_and_buffers(&rings), 0, "no buffers is not a refusal");
        let rc =
            io_uring_register(ring.as_raw_fd(), uapi::IORING_UNREGISTER_FILES, std::ptr::null(), 0);
        assert_eq!(
            (rc, io::Error::last_os_error().raw_os_error()),
            (-1, Some(libc::ENXIO)),
            "the ring still had files"
        );
    }
}
