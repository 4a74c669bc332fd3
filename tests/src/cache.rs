//! The cache directory: downloaded kernels, headers, initramfs images and per-run
//! directories.
//!
//! Layout under the root (env `UBLKD_VM_CACHE`, default `/var/cache/ublkd-vm`):
//!
//! ```text
//! current                      ABI of the kernel `run` boots by default (written by `fetch`)
//! current-6.12                 ABI of the kernel `run --kernel 6.12` boots
//! kernel/<abi>/                vmlinuz, config, ublk_drv.ko, overlay.ko, nbd.ko, manifest
//! kernel/<abi>/modules/lib/modules/<abi>/   the guest's /lib/modules/<abi>: kernel TLS's
//!                              modules (kernel/net/tls, kernel/crypto, ...), decompressed,
//!                              with modules.builtin*, modules.order and depmod's indexes
//! headers/<version>/usr/include/linux/ublk_cmd.h   sid's linux-libc-dev, unpacked
//! initramfs/<abi>-<hash>.cpio  rebuilt when busybox, the module or /init change
//! runs/<pid>-<n>/              one run: params, cmd.sh, sockets, console logs
//! tmp/                         downloads in progress
//! ```
//!
//! The root must be an absolute path without whitespace, quotes or commas: run
//! directories are passed to the guest on the kernel command line and to qemu in
//! `-chardev path=`.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use crate::kernel::Series;

/// The default cache root.
pub const DEFAULT_ROOT: &str = "/var/cache/ublkd-vm";
/// The environment variable that overrides [`DEFAULT_ROOT`].
pub const ENV_ROOT: &str = "UBLKD_VM_CACHE";

/// Errors of the cache directory.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The root path cannot be passed to the guest.
    #[error(
        "the cache directory {0:?} contains whitespace, a quote or a comma; set {ENV_ROOT} to a plain path"
    )]
    UnusablePath(PathBuf),
    /// The root path could not be made absolute.
    #[error("could not make the cache directory {0:?} absolute")]
    Absolute(PathBuf, #[source] io::Error),
    /// A directory could not be created.
    #[error("could not create the cache directory {0:?}")]
    CreateDir(PathBuf, #[source] io::Error),
    /// The lock file could not be opened or locked.
    #[error("could not lock the cache at {0:?}")]
    Lock(PathBuf, #[source] io::Error),
}

/// The cache directory.
#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
}

/// An exclusive lock on the cache, held while downloading or building; released on drop.
#[derive(Debug)]
pub struct CacheLock {
    _file: File,
}

impl Cache {
    /// The cache at `$UBLKD_VM_CACHE`, or [`DEFAULT_ROOT`].
    pub fn from_env() -> Result<Self, CacheError> {
        let root = std::env::var_os(ENV_ROOT)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_ROOT));
        Self::new(&root)
    }

    /// The cache at `root` (made absolute; not created yet).
    pub fn new(root: &Path) -> Result<Self, CacheError> {
        let root = std::path::absolute(root).map_err(|e| CacheError::Absolute(root.into(), e))?;
        let text = root.to_string_lossy();
        if text.chars().any(|c| c.is_whitespace() || "\"',".contains(c)) {
            return Err(CacheError::UnusablePath(root));
        }
        Ok(Self { root })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `kernel/`: one directory per kernel ABI.
    pub fn kernels(&self) -> PathBuf {
        self.root.join("kernel")
    }

    /// `headers/`: one unpacked `linux-libc-dev` per version.
    pub fn headers(&self) -> PathBuf {
        self.root.join("headers")
    }

    /// `initramfs/`: built images.
    pub fn initramfs(&self) -> PathBuf {
        self.root.join("initramfs")
    }

    /// `runs/`: per-run directories.
    pub fn runs(&self) -> PathBuf {
        self.root.join("runs")
    }

    /// `tmp/`: downloads in progress.
    pub fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// The file naming the ABI of the `series` kernel `run` boots: `current` for the
    /// default series (the name it has always had), `current-<series>` for the others.
    pub fn current(&self, series: Series) -> PathBuf {
        if series == Series::default() {
            self.root.join("current")
        } else {
            self.root.join(format!("current-{series}"))
        }
    }

    /// Creates `dir` (and its parents).
    pub fn create_dir(&self, dir: &Path) -> Result<(), CacheError> {
        fs::create_dir_all(dir).map_err(|e| CacheError::CreateDir(dir.into(), e))
    }

    /// Takes the cache's exclusive lock (blocking), for downloads and builds; concurrent
    /// `ublkd-vm` processes wait for each other here.
    pub fn lock(&self) -> Result<CacheLock, CacheError> {
        self.create_dir(&self.root)?;
        let path = self.root.join(".lock");
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| CacheError::Lock(path.clone(), e))?;
        file.lock().map_err(|e| CacheError::Lock(path, e))?;
        Ok(CacheLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_absolute_root_is_accepted() {
        let cache = Cache::new(Path::new("/var/cache/ublkd-vm")).unwrap();
        assert_eq!(cache.runs(), Path::new("/var/cache/ublkd-vm/runs"));
    }

    #[test]
    fn each_series_has_its_own_current_file_and_the_default_keeps_the_old_name() {
        let cache = Cache::new(Path::new("/c")).unwrap();
        assert_eq!(cache.current(Series::Newest), Path::new("/c/current"));
        assert_eq!(cache.current(Series::Lts6_12), Path::new("/c/current-6.12"));
    }

    #[test]
    fn root_with_space_or_comma_is_refused() {
        assert!(matches!(Cache::new(Path::new("/tmp/a b")), Err(CacheError::UnusablePath(_))));
        assert!(matches!(Cache::new(Path::new("/tmp/a,b")), Err(CacheError::UnusablePath(_))));
    }

    #[test]
    fn relative_root_is_made_absolute() {
        let cache = Cache::new(Path::new("rel-cache")).unwrap();
        assert!(cache.root().is_absolute());
    }
}
