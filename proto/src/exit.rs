//! The worker's exit codes: the one place their values and meanings are written down.
//!
//! The worker exits with one of these; the supervisor reads them back (with
//! [`describe`]) to tell an operator why a worker ended. Values follow sysexits(3)
//! where one fits, so a code seen in a shell means something there too.

use std::fmt;

/// Why a worker process ended, as its exit code says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum WorkerExit {
    /// The device's queues were closed by the kernel, or the supervisor asked.
    Clean = 0,
    /// Bad arguments or a malformed setup message: a supervisor/worker mismatch.
    Protocol = 64,
    /// Setting the device up failed (mapping, PREP, the target's fd).
    Setup = 65,
    /// The kernel refused a COMMIT or sent a malformed FETCH: recover the device.
    DataPath = 70,
    /// The supervisor went away.
    Orphaned = 71,
    /// The target's connection broke (an NBD server closed it, or answered nonsense):
    /// recover the device, which connects afresh; the kernel re-issues the requests
    /// that were in flight.
    BackendLost = 72,
    /// The rbd target's client was blocklisted: a newer worker broke its lock on the
    /// image. It ends without completing the requests it held (the cluster refuses
    /// them), so that the kernel re-issues them to the worker that has the image.
    Fenced = 73,
    /// A test hook ended the worker on purpose (test builds only).
    TestHook = 97,
    /// The worker made a system call outside its seccomp policy and was stopped.
    Seccomp = 159,
}

impl WorkerExit {
    /// Every code, for lookups.
    pub const ALL: [WorkerExit; 9] = [
        Self::Clean,
        Self::Protocol,
        Self::Setup,
        Self::DataPath,
        Self::Orphaned,
        Self::BackendLost,
        Self::Fenced,
        Self::TestHook,
        Self::Seccomp,
    ];

    /// The exit code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The cause an exit code stands for, if it is one of ours.
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|e| i32::from(e.code()) == code)
    }

    /// What the code means, for an operator.
    pub const fn meaning(self) -> &'static str {
        match self {
            Self::Clean => "exited cleanly",
            Self::Protocol => "protocol mismatch with the supervisor",
            Self::Setup => "device setup failed",
            Self::DataPath => "data path error: the kernel refused a COMMIT or sent a bad FETCH",
            Self::Orphaned => "lost its supervisor",
            Self::BackendLost => "lost its connection to the NBD server",
            Self::Fenced => "fenced: its Ceph client was blocklisted by a newer worker",
            Self::TestHook => "ended by a test hook",
            Self::Seccomp => "made a system call outside its seccomp policy",
        }
    }
}

impl From<WorkerExit> for std::process::ExitCode {
    fn from(e: WorkerExit) -> Self {
        std::process::ExitCode::from(e.code())
    }
}

impl fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Clean => f.write_str(self.meaning()),
            _ => write!(f, "exited {} ({})", self.code(), self.meaning()),
        }
    }
}

/// How a worker ended, in words an operator can act on.
pub fn describe(status: &std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        return match nix::sys::signal::Signal::try_from(sig) {
            Ok(s) => format!("killed by signal {sig} ({s})"),
            Err(_) => format!("killed by signal {sig}"),
        };
    }
    match status.code() {
        Some(c) => match WorkerExit::from_code(c) {
            Some(e) => e.to_string(),
            None => format!("exited {c}"),
        },
        None => "ended".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn codes_are_distinct_and_round_trip() {
        for e in WorkerExit::ALL {
            assert_eq!(WorkerExit::from_code(i32::from(e.code())), Some(e));
        }
        assert_eq!(WorkerExit::from_code(1), None);
    }

    #[test]
    fn descriptions_name_the_code_and_the_cause() {
        assert_eq!(describe(&ExitStatus::from_raw(0)), "exited cleanly");
        assert_eq!(
            describe(&ExitStatus::from_raw(159 << 8)),
            "exited 159 (made a system call outside its seccomp policy)"
        );
        assert_eq!(describe(&ExitStatus::from_raw(3 << 8)), "exited 3");
        assert_eq!(describe(&ExitStatus::from_raw(9)), "killed by signal 9 (SIGKILL)");
    }

    use std::process::ExitStatus;
}
