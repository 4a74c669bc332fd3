//! Files ublkd writes, as root, into a directory it does not own (the metrics file in
//! node_exporter's textfile directory, which the prometheus user often may write).
//!
//! Whatever another user planted there must not turn ublkd's write into theirs: the
//! data goes into a new file under a random name, created with `O_CREAT | O_EXCL |
//! O_NOFOLLOW` (never opened through a symlink, never a FIFO that would hold the
//! writer), made readable with `fchmod` on that file (never `chmod` through a path),
//! and renamed over the target name inside the same directory fd (a rename replaces a
//! link planted at that name; it never writes through it). The directory itself is
//! checked first: a directory every user may write could be emptied and refilled
//! under ublkd between two writes, so it is refused with the reason.

use std::ffi::{OsStr, OsString};
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

/// Why a file could not be replaced.
#[derive(Debug, thiserror::Error)]
pub enum ReplaceError {
    #[error("{} has no file name", path.display())]
    NoFileName { path: PathBuf },
    #[error("cannot open the directory {}: {source}", dir.display())]
    OpenDir { dir: PathBuf, source: io::Error },
    #[error(
        "the directory {} may be written by every user (mode {mode:04o}): anyone could \
         plant a link there; make it writable only by its owner and group",
        dir.display()
    )]
    WorldWritable { dir: PathBuf, mode: u32 },
    #[error("cannot write {}: {step}: {source}", path.display())]
    Io { path: PathBuf, step: &'static str, source: io::Error },
}

/// What stood at the target name before ublkd replaced it, if it was not a regular
/// file of root's (something another user planted, or a file someone else wrote).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planted {
    pub kind: &'static str,
    pub uid: u32,
}

/// Opens `dir` (no symlink at its last component) and checks that not every user may
/// write it.
pub fn open_dir(dir: &Path) -> Result<OwnedFd, ReplaceError> {
    let open_err = |source| ReplaceError::OpenDir { dir: dir.to_path_buf(), source };
    let flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC;
    let fd = nix::fcntl::open(dir, flags, Mode::empty()).map_err(|e| open_err(e.into()))?;
    let st = nix::sys::stat::fstat(&fd).map_err(|e| open_err(e.into()))?;
    let mode = st.st_mode & 0o7777;
    if mode & 0o002 != 0 {
        return Err(ReplaceError::WorldWritable { dir: dir.to_path_buf(), mode });
    }
    Ok(fd)
}

/// Replaces `path` with `data`, readable by all (`mode`), as the module doc says; a
/// reader sees the old file or the new one, never a part. Returns what stood at `path`
/// before if it was not a regular file of root's.
pub fn replace(path: &Path, data: &[u8], mode: u32) -> Result<Option<Planted>, ReplaceError> {
    let name = path.file_name().ok_or_else(|| ReplaceError::NoFileName { path: path.into() })?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let dir_fd = open_dir(dir)?;
    let io_err = |step| move |source| ReplaceError::Io { path: path.to_path_buf(), step, source };
    let (tmp, file) = create_unique(&dir_fd, name).map_err(io_err("creating a temporary file"))?;
    let written = (|| {
        nix::sys::stat::fchmod(&file, Mode::from_bits_truncate(mode))
            .map_err(io::Error::from)
            .map_err(io_err("setting its mode"))?;
        let mut file = std::fs::File::from(file);
        file.write_all(data).map_err(io_err("writing it"))?;
        let planted = planted_at(&dir_fd, name);
        nix::fcntl::renameat(&dir_fd, tmp.as_os_str(), &dir_fd, name)
            .map_err(io::Error::from)
            .map_err(io_err("renaming it into place"))?;
        Ok(planted)
    })();
    if written.is_err() {
        let _ = nix::unistd::unlinkat(
            &dir_fd,
            tmp.as_os_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
    written
}

/// Creates `.NAME.RANDOM.tmp` in `dir`, a new file (never one already there, never
/// through a link); a name taken is tried again with another random part.
fn create_unique(dir: &OwnedFd, name: &OsStr) -> io::Result<(OsString, OwnedFd)> {
    let mut last = io::Error::from(io::ErrorKind::AlreadyExists);
    for _ in 0..8 {
        let mut tmp = OsString::from(".");
        tmp.push(name);
        tmp.push(format!(".{:016x}.tmp", random_u64()?));
        let flags =
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_WRONLY | OFlag::O_CLOEXEC;
        match nix::fcntl::openat(dir, tmp.as_os_str(), flags, Mode::from_bits_truncate(0o600)) {
            Ok(fd) => return Ok((tmp, fd)),
            Err(Errno::EEXIST) => last = io::Error::from(Errno::EEXIST),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last)
}

/// What stands at `name` in `dir` (not followed), if it is not a regular file of root's.
fn planted_at(dir: &OwnedFd, name: &OsStr) -> Option<Planted> {
    let st = nix::sys::stat::fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).ok()?;
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG if st.st_uid == 0 => return None,
        libc::S_IFREG => "a file",
        libc::S_IFLNK => "a symlink",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFDIR => "a directory",
        libc::S_IFSOCK => "a socket",
        _ => "a device node",
    };
    Some(Planted { kind, uid: st.st_uid })
}

fn random_u64() -> io::Result<u64> {
    let mut bytes = [0u8; 8];
    crate::sys::getrandom(&mut bytes)?;
    Ok(u64::from_ne_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ublkd-replace-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    #[test]
    fn a_link_or_fifo_planted_at_the_name_is_replaced_never_written_through() {
        let dir = scratch("planted");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"secret").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        let path = dir.join("ublkd.prom");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        // The old fixed temporary name, and a FIFO at another name ublkd never opens.
        std::os::unix::fs::symlink(&victim, dir.join(".ublkd.prom.tmp")).unwrap();
        nix::unistd::mkfifo(&dir.join(".ublkd.prom.fifo.tmp"), Mode::from_bits_truncate(0o644))
            .unwrap();
        let planted = replace(&path, b"metrics\n", 0o644).unwrap();
        assert_eq!(planted.map(|p| p.kind), Some("a symlink"));
        assert_eq!(std::fs::read(&victim).unwrap(), b"secret");
        assert_eq!(std::fs::metadata(&victim).unwrap().mode() & 0o777, 0o600);
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_file());
        assert_eq!(meta.mode() & 0o777, 0o644);
        assert_eq!(std::fs::read(&path).unwrap(), b"metrics\n");
        assert_eq!(replace(&path, b"again\n", 0o644).unwrap(), None, "its own file is no plant");
        let left = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(left, 4, "a temporary file was left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_every_user_may_write_is_refused() {
        let dir = scratch("open");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = replace(&dir.join("ublkd.prom"), b"x", 0o644).unwrap_err();
        assert!(matches!(e, ReplaceError::WorldWritable { mode: 0o1777, .. }), "{e}");
        assert!(e.to_string().contains("may be written by every user"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_symlink_in_place_of_the_directory_is_refused() {
        let dir = scratch("linked");
        let link = dir.join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = replace(&link.join("ublkd.prom"), b"x", 0o644).unwrap_err();
        assert!(matches!(e, ReplaceError::OpenDir { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
