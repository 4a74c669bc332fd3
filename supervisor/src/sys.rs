//! The system calls ublkd makes that neither std nor nix wraps (or wraps in a form the
//! loop cannot use), each as a safe function with its one SAFETY argument. Everything
//! else goes through std or nix.
//!
//! Not here: starting a worker (`clone` and what the child does before `execve`,
//! `worker/spawn.rs`, where the child's async-signal-safe steps must stay together) and
//! the kernel TLS hand-over's socket options and control message (`nbd/tls.rs`, whose
//! layouts are the kernel's TLS uapi).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// `poll(2)` over raw `pollfd`s: the loop gathers fds from many owners each turn, which
/// nix's borrowed `PollFd`s cannot hold across its own mutations. Returns how many are
/// ready; EINTR is an error the caller retries on its next turn.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: `fds` is a valid, writable array of `fds.len()` pollfds for the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// Whether `fd` is readable (or hung up) right now.
pub fn readable_now(fd: BorrowedFd<'_>) -> bool {
    wait_readable(fd, Duration::ZERO).unwrap_or(false)
}

/// Waits up to `timeout` (rounded up to a millisecond, at most `i32::MAX` of them) for
/// `fd` to turn readable (or hung up); whether it did.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    let mut fds = [libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
    poll(&mut fds, ms).map(|n| n > 0)
}

/// `preadv2(fd, buf, -1, RWF_NOWAIT)`: reads what is there without waiting, whatever
/// the open file's `O_NONBLOCK` (which another process holding the file can change).
/// EOPNOTSUPP where the kernel or the file does not take the flag.
pub fn read_nowait(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: `iov` describes `buf`, writable and alive for the call; offset -1 reads
    // at the file's position, as read does (a pipe has none).
    let n = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// A new fd from a system call that returns one (or -1).
fn new_fd(raw: libc::c_long) -> io::Result<OwnedFd> {
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the call returned a new fd, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw as i32) })
}

/// `pidfd_open(pid, 0)`.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    new_fd(unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) })
}

/// `pidfd_send_signal(pidfd, signal, NULL, 0)`: never a process that reused the pid.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: i32) -> io::Result<()> {
    // SAFETY: pidfd_send_signal takes a pidfd, a signal, a null siginfo and flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// `pidfd_getfd(pidfd, number, 0)`: a copy (close-on-exec) of the fd numbered `number`
/// in the process behind `pidfd`.
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, number: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd, an fd number and flags (0), and returns a new
    // fd or -1.
    new_fd(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), number, 0) })
}

/// `io_uring_register(ring, opcode, NULL, 0)`: the unregister operations, which take no
/// argument.
pub fn io_uring_unregister(ring: BorrowedFd<'_>, opcode: u32) -> io::Result<()> {
    // SAFETY: io_uring_register with a null argument and no entries only reads its
    // scalar arguments; `ring` is an open fd.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring.as_raw_fd(),
            opcode,
            std::ptr::null::<libc::c_void>(),
            0,
        )
    };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// `waitpid(pid, WNOHANG)` of a child of ublkd's: `None` while it runs, else its raw
/// wait status.
pub fn waitpid_nohang(pid: u32) -> io::Result<Option<i32>> {
    waitpid(pid, libc::WNOHANG)
}

/// `waitpid(pid, flags)` of a child of ublkd's: `None` if WNOHANG found it running,
/// else its raw wait status.
pub fn waitpid(pid: u32, flags: i32) -> io::Result<Option<i32>> {
    let mut status = 0;
    // SAFETY: waitpid writes only `status`.
    match unsafe { libc::waitpid(pid as libc::pid_t, &mut status, flags) } {
        0 => Ok(None),
        n if n > 0 => Ok(Some(status)),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Fills `buf` from the kernel's random pool (`getrandom(buf, 0)`), or fails.
pub fn getrandom(buf: &mut [u8]) -> io::Result<()> {
    // SAFETY: `buf` is writable for its length across the call.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != buf.len() {
        return Err(io::Error::other("getrandom returned fewer bytes than asked"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_pipe_is_readable_now_once_written() {
        let (read, write) = nix::unistd::pipe().unwrap();
        assert!(!readable_now(read.as_fd()));
        nix::unistd::write(&write, b"x").unwrap();
        assert!(readable_now(read.as_fd()));
        let mut buf = [0u8; 4];
        assert_eq!(read_nowait(read.as_fd(), &mut buf).unwrap(), 1);
        let e = read_nowait(read.as_fd(), &mut buf).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EAGAIN), "{e}");
    }

    #[test]
    fn a_child_is_waited_for_without_blocking() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let pid = child.id();
        assert_eq!(waitpid_nohang(pid).unwrap(), None);
        let pidfd = pidfd_open(pid).unwrap();
        pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = waitpid_nohang(pid).unwrap() {
                break status;
            }
            assert!(std::time::Instant::now() < deadline, "the killed child did not end");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL);
        // Reaped above: std's own wait finds nothing left (ECHILD), which is the point.
        assert!(child.wait().is_err());
    }
}
