//! `[daemon]`: where the daemon listens and keeps state, which worker executable it
//! starts and as whom, with the defaults and limits of those keys.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::FieldError;

/// Where ublkctl finds the daemon when the config file does not say.
pub const DEFAULT_SOCKET: &str = "/run/ublkd/ublkd.sock";
/// Where per-device state lives when the config file does not say.
pub const DEFAULT_STATE_DIR: &str = "/run/ublkd";
/// The worker executable's file name, looked up next to the ublkd executable when
/// `daemon.worker_binary` is not set.
pub const DEFAULT_WORKER_NAME: &str = "ublkd-worker";
/// Where the Debian package installs the worker (not on `PATH`: only ublkd runs it).
/// Used when `daemon.worker_binary` is not set and there is no worker next to ublkd.
pub const PACKAGED_WORKER_BINARY: &str = "/usr/libexec/ublkd/ublkd-worker";
/// Longest unix socket path: `sun_path` is 108 bytes including the terminating NUL.
pub const MAX_SOCKET_PATH_BYTES: usize = 107;
/// Longest `daemon.worker_user`: the usual limit of `useradd`.
pub const MAX_USER_NAME_BYTES: usize = 32;
/// `daemon.metrics_interval_secs` when the config file does not say: as often as a
/// Prometheus server typically scrapes node_exporter.
pub const DEFAULT_METRICS_INTERVAL_SECS: u32 = 15;
/// The longest `daemon.metrics_interval_secs`: an hour-old file is no metric any more.
pub const MAX_METRICS_INTERVAL_SECS: u32 = 3600;

/// `[daemon]`: where the daemon listens and keeps state, and how it starts workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonConfig {
    /// ublkctl's unix socket (`daemon.socket`), absolute.
    pub socket: PathBuf,
    /// Per-device state that survives a supervisor restart (`daemon.state_dir`),
    /// absolute.
    pub state_dir: PathBuf,
    /// The worker executable (`daemon.worker_binary`), absolute; `None` means
    /// [`DEFAULT_WORKER_NAME`] next to the ublkd executable (see
    /// [`DaemonConfig::worker_binary_path`]).
    pub worker_binary: Option<PathBuf>,
    /// The user sandboxed workers run as (`daemon.worker_user`); `None` leaves the
    /// choice to the supervisor.
    pub worker_user: Option<String>,
    /// Where ublkd writes its metrics for node_exporter's textfile collector
    /// (`daemon.metrics_file`), absolute; `None`: nowhere.
    pub metrics_file: Option<PathBuf>,
    /// How often it writes them (`daemon.metrics_interval_secs`).
    pub metrics_interval: Duration,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            worker_binary: None,
            worker_user: None,
            metrics_file: None,
            metrics_interval: Duration::from_secs(DEFAULT_METRICS_INTERVAL_SECS.into()),
        }
    }
}

impl DaemonConfig {
    /// The worker executable: `worker_binary` if set, else [`DEFAULT_WORKER_NAME`] in
    /// the directory of the running executable (a build tree), else the packaged
    /// [`PACKAGED_WORKER_BINARY`] if it exists; else the path next to the executable
    /// again, so that the error names where a source build expects it.
    pub fn worker_binary_path(&self) -> io::Result<PathBuf> {
        if let Some(path) = &self.worker_binary {
            return Ok(path.clone());
        }
        let exe = std::env::current_exe()?;
        let dir = exe
            .parent()
            .ok_or_else(|| io::Error::other("the running executable has no parent directory"))?;
        Ok(pick_worker(dir.join(DEFAULT_WORKER_NAME), Path::new(PACKAGED_WORKER_BINARY)))
    }
}

/// `beside` (next to ublkd) if it exists, else `packaged` if that exists, else `beside`.
pub(crate) fn pick_worker(beside: PathBuf, packaged: &Path) -> PathBuf {
    if !beside.exists() && packaged.exists() { packaged.to_path_buf() } else { beside }
}

/// A portable user name: `[A-Za-z0-9._-]`, not starting with `-`, not all digits (a
/// uid would be ambiguous), at most [`MAX_USER_NAME_BYTES`].
pub(crate) fn check_user_name(user: &str) -> Result<(), FieldError> {
    let problem = if user.is_empty() {
        Some("is empty; expected a user name such as \"ublkd-worker\"".to_owned())
    } else if user.len() > MAX_USER_NAME_BYTES {
        Some(format!("is {} bytes long; a user name has at most {MAX_USER_NAME_BYTES}", user.len()))
    } else if !user.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        || user.starts_with('-')
    {
        Some(format!(
            "{user:?} is not a user name; use letters, digits, '.', '_' and '-', not \
             starting with '-'"
        ))
    } else if user.chars().all(|c| c.is_ascii_digit()) {
        Some(format!("{user:?} is a number; expected a user name, not a uid"))
    } else {
        None
    };
    match problem {
        Some(problem) => Err(FieldError::new("worker_user", problem)),
        None => Ok(()),
    }
}
