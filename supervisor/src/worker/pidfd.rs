//! Other processes by pidfd: opening, signalling, waiting for and copying fds out of
//! a worker without ever reaching a process that reused its pid.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, poll};

use super::poll_timeout;

/// A process's start time, field 22 of `/proc/PID/stat` (after the command name,
/// which may hold spaces and parentheses: the last `)` ends it).
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name; 22 is the 20th.
    after_name.split_ascii_whitespace().nth(19)?.parse().ok()
}

pub(super) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new fd returned by pidfd_open, owned by nothing else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) })
}

/// SIGKILL through the pidfd: never a process that reused the pid.
pub(super) fn pidfd_kill(pidfd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: pidfd_send_signal takes a pidfd, a signal, a null siginfo and flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// A copy of the fd numbered `number` in the process behind `pidfd`.
pub(super) fn getfd(pidfd: BorrowedFd<'_>, number: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd, an fd number and flags (0), and returns a new
    // fd (close-on-exec) or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), number, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new fd returned by pidfd_getfd, owned by nothing else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw as i32) })
}

/// Whether the process behind `pidfd` exits within `limit` (the pidfd turns readable).
pub(super) fn exits_within(pidfd: BorrowedFd<'_>, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = [PollFd::new(pidfd, PollFlags::POLLIN)];
        match poll(&mut pfd, poll_timeout(left)) {
            Ok(n) => return n > 0,
            Err(Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::os::fd::AsFd;

    use super::*;

    pub(crate) fn own_pidfd() -> OwnedFd {
        pidfd_open(std::process::id()).expect("pidfd_open of this process")
    }

    #[test]
    fn a_process_start_time_is_read_after_its_name() {
        let own = process_start_time(std::process::id()).expect("our own start time");
        assert_eq!(process_start_time(std::process::id()), Some(own), "it changed");
        assert_eq!(process_start_time(u32::MAX), None);
    }

    #[test]
    fn an_own_fd_is_copied_and_an_exit_is_seen() {
        let null = std::fs::File::open("/dev/null").unwrap();
        assert!(getfd(own_pidfd().as_fd(), null.as_raw_fd()).is_ok());
        assert!(!exits_within(own_pidfd().as_fd(), Duration::ZERO));
        let mut child = std::process::Command::new("/bin/sleep").arg("10").spawn().unwrap();
        let pidfd = pidfd_open(child.id()).unwrap();
        pidfd_kill(pidfd.as_fd()).unwrap();
        assert!(exits_within(pidfd.as_fd(), Duration::from_secs(5)), "SIGKILL not seen");
        child.wait().unwrap();
    }
}
