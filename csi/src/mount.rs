//! The node's filesystem side of a volume: what is mounted where (read from
//! `/proc/self/mountinfo`), finding and making a filesystem, mounting, bind mounts,
//! unmounting, growing a filesystem and its usage. This module owns the commands it
//! runs (blkid, mkfs, mount, umount, resize2fs, xfs_growfs): the kernel opens the disk
//! for them; the driver itself never reads or writes a volume.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use ublkd_proto::mountinfo;

/// The filesystems the driver makes and grows.
pub const FILESYSTEMS: [&str; 2] = ["ext4", "xfs"];

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: io::Error },
    #[error("cannot run {program}: {source}")]
    Spawn { program: String, source: io::Error },
    #[error("{command} failed ({status}): {stderr}")]
    Failed { command: String, status: String, stderr: String },
    #[error("{} is not a block device", .0.display())]
    NotBlock(PathBuf),
}

/// One line of `/proc/self/mountinfo`, the fields the driver uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// The filesystem's device (`major:minor`, as `st_rdev` packs it).
    pub dev: u64,
    /// The path inside the filesystem that is mounted (`/` but for bind mounts of a
    /// part of it, or of a device node: then its path in devtmpfs).
    pub root: String,
    pub mount_point: PathBuf,
    /// Mounted read-only (this mount's own options).
    pub read_only: bool,
    pub fs_type: String,
}

/// The block device number of the device node `node`.
pub fn block_dev(node: &Path) -> Result<u64, MountError> {
    let meta = std::fs::metadata(node).map_err(|source| MountError::Io {
        what: "cannot stat",
        path: node.into(),
        source,
    })?;
    if !meta.file_type().is_block_device() {
        return Err(MountError::NotBlock(node.into()));
    }
    Ok(meta.rdev())
}

/// The device number a path's node stands for (for a bind-mounted device node, the
/// device's), or `None` if the path does not exist or is no device node.
pub fn node_dev(path: &Path) -> Option<u64> {
    let meta = std::fs::metadata(path).ok()?;
    meta.file_type().is_block_device().then(|| meta.rdev())
}

/// What is mounted at `path` (the top of any stack of mounts there), if anything.
pub fn mounted_at(path: &Path) -> Result<Option<MountEntry>, MountError> {
    // The table names the path as the kernel resolved it.
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok(mounts()?.into_iter().rfind(|m| m.mount_point == path))
}

/// Where the disk `node` (device number `rdev`) is mounted, or its node bind-mounted,
/// other than at `except`.
pub fn mounted_elsewhere(
    node: &Path,
    rdev: u64,
    except: &Path,
) -> Result<Vec<PathBuf>, MountError> {
    let except = std::fs::canonicalize(except).unwrap_or_else(|_| except.to_path_buf());
    let node_name = node.file_name().map(|n| format!("/{}", n.to_string_lossy()));
    Ok(mounts()?
        .into_iter()
        .filter(|m| m.mount_point != except)
        .filter(|m| {
            m.dev == rdev || (m.fs_type == "devtmpfs" && Some(&m.root) == node_name.as_ref())
        })
        .map(|m| m.mount_point)
        .collect())
}

fn mounts() -> Result<Vec<MountEntry>, MountError> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").map_err(|source| {
        MountError::Io { what: "cannot read", path: "/proc/self/mountinfo".into(), source }
    })?;
    Ok(parse_mountinfo(&table))
}

fn parse_mountinfo(table: &str) -> Vec<MountEntry> {
    table
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let (major, minor) = fields.get(2)?.split_once(':')?;
            let dev = libc::makedev(major.parse().ok()?, minor.parse().ok()?);
            let root = mountinfo::unescape(fields.get(3)?);
            let mount_point = PathBuf::from(mountinfo::unescape(fields.get(4)?));
            let read_only = fields.get(5)?.split(',').any(|o| o == "ro");
            let sep = fields.iter().position(|f| *f == "-")?;
            let fs_type = fields.get(sep + 1)?.to_string();
            Some(MountEntry { dev, root, mount_point, read_only, fs_type })
        })
        .collect()
}

/// The filesystem on `node` as blkid finds it by probing the disk, `None` if it finds
/// none (a blank volume).
pub fn fs_type(node: &Path) -> Result<Option<String>, MountError> {
    let mut cmd = Command::new("blkid");
    cmd.args(["-p", "-o", "value", "-s", "TYPE"]).arg(node);
    let out = output(&mut cmd)?;
    match out.status.code() {
        Some(0) => Ok(Some(String::from_utf8_lossy(&out.stdout).trim().to_string())),
        // blkid's code for "nothing found".
        Some(2) => Ok(None),
        _ => Err(failed(&cmd, &out)),
    }
}

/// Makes filesystem `fs` (one of [`FILESYSTEMS`]) on `node`.
pub fn mkfs(fs: &str, node: &Path) -> Result<(), MountError> {
    let mut cmd = Command::new(format!("mkfs.{fs}"));
    cmd.args(if fs == "xfs" { ["-q", "-f"] } else { ["-q", "-F"] }).arg(node);
    run(&mut cmd)
}

/// Mounts the filesystem `fs` on `node` at `dir`, with the capability's mount flags.
pub fn mount_fs(
    node: &Path,
    dir: &Path,
    fs: &str,
    flags: &[String],
    read_only: bool,
) -> Result<(), MountError> {
    let mut options: Vec<&str> = flags.iter().map(String::as_str).collect();
    if read_only {
        options.push("ro");
    }
    let mut cmd = Command::new("mount");
    cmd.args(["-t", fs]);
    if !options.is_empty() {
        cmd.arg("-o").arg(options.join(","));
    }
    run(cmd.arg(node).arg(dir))
}

/// Bind-mounts `source` (a directory, or a device node) at `target`, read-only if
/// asked (a second step: a bind mount takes `ro` only on a remount).
pub fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), MountError> {
    run(Command::new("mount").arg("--bind").arg(source).arg(target))?;
    if read_only {
        run(Command::new("mount").args(["-o", "remount,bind,ro"]).arg(target))?;
    }
    Ok(())
}

/// Unmounts everything stacked at `path`; nothing mounted there is not an error.
pub fn umount_all(path: &Path) -> Result<(), MountError> {
    while mounted_at(path)?.is_some() {
        run(Command::new("umount").arg(path))?;
    }
    Ok(())
}

/// Grows the filesystem `fs` on `node`, mounted at `dir`, to the disk's size.
pub fn grow(fs: &str, node: &Path, dir: &Path) -> Result<(), MountError> {
    match fs {
        "xfs" => run(Command::new("xfs_growfs").arg(dir)),
        _ => run(Command::new("resize2fs").arg(node)),
    }
}

/// A mounted filesystem's size and use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub total_bytes: u64,
    pub available_bytes: u64,
    pub used_bytes: u64,
    pub total_inodes: u64,
    pub free_inodes: u64,
}

pub fn usage(dir: &Path) -> Result<Usage, MountError> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(|e| MountError::Io {
        what: "cannot statvfs",
        path: dir.into(),
        source: e.into(),
    })?;
    let frag = st.fragment_size();
    let total_bytes = st.blocks() * frag;
    Ok(Usage {
        total_bytes,
        available_bytes: st.blocks_available() * frag,
        used_bytes: total_bytes.saturating_sub(st.blocks_free() * frag),
        total_inodes: st.files(),
        free_inodes: st.files_free(),
    })
}

fn output(cmd: &mut Command) -> Result<std::process::Output, MountError> {
    cmd.output().map_err(|source| MountError::Spawn {
        program: cmd.get_program().to_string_lossy().into_owned(),
        source,
    })
}

fn run(cmd: &mut Command) -> Result<(), MountError> {
    let out = output(cmd)?;
    if out.status.success() { Ok(()) } else { Err(failed(cmd, &out)) }
}

fn failed(cmd: &Command, out: &std::process::Output) -> MountError {
    let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    MountError::Failed {
        command: format!("{} {}", cmd.get_program().to_string_lossy(), args.join(" ")),
        status: out.status.to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_give_device_path_options_and_type() {
        let table = "36 35 259:0 / /var/lib/k/staging\\040dir rw,noatime shared:1 - ext4 /dev/ublkb0 rw\n\
                     37 36 259:0 / /pods/p1 ro,relatime - ext4 /dev/ublkb0 rw\n\
                     garbage line\n";
        let entries = parse_mountinfo(table);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].mount_point, PathBuf::from("/var/lib/k/staging dir"));
        assert_eq!(entries[0].dev, libc::makedev(259, 0));
        assert!(!entries[0].read_only);
        assert!(entries[1].read_only);
        assert_eq!(entries[1].fs_type, "ext4");
        assert_eq!(entries[1].root, "/");
    }
}
