//! Other processes by pidfd: opening, signalling, waiting for and copying fds out of
//! a worker without ever reaching a process that reused its pid.

use std::io;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

/// A process's start time, field 22 of `/proc/PID/stat` (after the command name,
/// which may hold spaces and parentheses: the last `)` ends it).
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name; 22 is the 20th.
    after_name.split_ascii_whitespace().nth(19)?.parse().ok()
}

pub(super) use crate::sys::{pidfd_getfd as getfd, pidfd_open};

/// SIGKILL through the pidfd: never a process that reused the pid.
pub(super) fn pidfd_kill(pidfd: BorrowedFd<'_>) -> io::Result<()> {
    crate::sys::pidfd_send_signal(pidfd, libc::SIGKILL)
}

/// Whether the process behind `pidfd` exits within `limit` (the pidfd turns readable).
pub(super) fn exits_within(pidfd: BorrowedFd<'_>, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match crate::sys::wait_readable(pidfd, left) {
            Ok(ended) => return ended,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::os::fd::{AsFd, AsRawFd, OwnedFd};

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
