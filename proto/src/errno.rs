//! Names for the errno values the ublk driver returns, so that an error message can
//! say `EBUSY (Device or resource busy)` rather than a bare `-16`.

use std::fmt;

/// A positive errno value, printed as its symbolic name and the C library's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// The symbolic name (`EBUSY`), or `None` for a value not in the table.
    pub fn name(self) -> Option<&'static str> {
        let name = match self.0 {
            libc::EPERM => "EPERM",
            libc::ENOENT => "ENOENT",
            libc::ESRCH => "ESRCH",
            libc::EINTR => "EINTR",
            libc::EIO => "EIO",
            libc::ENXIO => "ENXIO",
            libc::E2BIG => "E2BIG",
            libc::EBADF => "EBADF",
            libc::EAGAIN => "EAGAIN",
            libc::ENOMEM => "ENOMEM",
            libc::EACCES => "EACCES",
            libc::EFAULT => "EFAULT",
            libc::EBUSY => "EBUSY",
            libc::EEXIST => "EEXIST",
            libc::ENODEV => "ENODEV",
            libc::EINVAL => "EINVAL",
            libc::ENOSPC => "ENOSPC",
            libc::ERANGE => "ERANGE",
            libc::ENOSYS => "ENOSYS",
            libc::ENOBUFS => "ENOBUFS",
            libc::EOPNOTSUPP => "EOPNOTSUPP",
            libc::ETIMEDOUT => "ETIMEDOUT",
            libc::EALREADY => "EALREADY",
            libc::ECANCELED => "ECANCELED",
            libc::EOVERFLOW => "EOVERFLOW",
            _ => return None,
        };
        Some(name)
    }

    /// The C library's description (`Device or resource busy`).
    pub fn description(self) -> String {
        let text = std::io::Error::from_raw_os_error(self.0).to_string();
        // std appends " (os error N)"; the name already identifies the value.
        match text.rfind(" (os error") {
            Some(cut) => text[..cut].to_string(),
            None => text,
        }
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.description()),
            None => write!(f, "errno {} ({})", self.0, self.description()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_errno_prints_name_and_text() {
        assert_eq!(Errno(libc::EBUSY).to_string(), "EBUSY (Device or resource busy)");
        assert_eq!(Errno(libc::EINVAL).to_string(), "EINVAL (Invalid argument)");
    }

    #[test]
    fn unknown_errno_prints_number() {
        assert!(Errno(4000).to_string().starts_with("errno 4000 ("));
    }
}
