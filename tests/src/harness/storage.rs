//! What a test writes and checks on files and block devices: sparse backing files,
//! reproducible data patterns and their checksums, an ext4 mount, and a cgroup that
//! throttles writes to a device.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::process::run_ok;

/// A sparse file of `size` bytes (a loop device's backing file).
pub fn sparse_file(path: &Path, size: u64) {
    let _ = std::fs::remove_file(path);
    File::create(path).unwrap().set_len(size).unwrap();
}

/// `len` pseudo-random bytes from `seed` (xorshift64*): reproducible, incompressible.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Creates (or truncates) the file at `path` with `data`.
pub fn write_file(path: &Path, data: &[u8]) {
    let mut f = File::create(path).unwrap();
    f.write_all(data).unwrap();
}

/// Files of awkward sizes (empty, one byte, just past a page, 1 MiB, just past 3 MiB)
/// under `root`, some in a subdirectory, each [`pattern`]ed from `seed`; their names.
pub fn write_files(root: &Path, seed: u64) -> Vec<String> {
    const MIB: usize = 1 << 20;
    std::fs::create_dir_all(root.join("dir")).unwrap();
    let sizes = [0, 1, 4097, 65_537, MIB, 3 * MIB + 123];
    let mut files = Vec::new();
    for (i, size) in sizes.into_iter().enumerate() {
        let name = if i % 2 == 0 { format!("f{i}") } else { format!("dir/f{i}") };
        write_file(&root.join(&name), &pattern(i as u64 + seed, size));
        files.push(name);
    }
    files
}

/// The sha256 of a file (or a whole block device), by `sha256sum`.
pub fn sha256(path: &Path) -> String {
    let out = run_ok(Command::new("sha256sum").arg(path));
    out.split_whitespace().next().unwrap().to_string()
}

/// A mounted filesystem, unmounted (lazily, if need be) when dropped.
#[derive(Debug)]
pub struct Mount {
    pub dir: PathBuf,
    mounted: bool,
}

impl Mount {
    /// Mounts the ext4 filesystem on `dev` at `dir` (created if missing).
    pub fn new(dev: &Path, dir: &Path) -> Mount {
        std::fs::create_dir_all(dir).unwrap();
        run_ok(Command::new("mount").args(["-t", "ext4"]).arg(dev).arg(dir));
        Mount { dir: dir.to_path_buf(), mounted: true }
    }

    /// Unmounts it now, which must succeed (not lazily, as a drop does).
    pub fn umount(mut self) {
        run_ok(Command::new("umount").arg(&self.dir));
        self.mounted = false;
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// A cgroup whose `io.max` limits writes to one block device to `wbps` bytes a second
/// (1: stopped): a process moved into it has its writes queued in blk-throttle, as a
/// slow disk, a failing path or a busy cgroup would, until [`Self::release`].
#[derive(Debug)]
pub struct WriteThrottle {
    dir: PathBuf,
    dev: String,
}

impl WriteThrottle {
    /// The cgroup `name`, limiting writes to the block device `backing` to `wbps` bytes a
    /// second; mounts cgroup2 and enables its io controller first if need be.
    pub fn new(name: &str, backing: &Path, wbps: u64) -> WriteThrottle {
        let root = Path::new("/sys/fs/cgroup");
        if !root.join("cgroup.controllers").exists() {
            run_ok(Command::new("mount").args(["-t", "cgroup2", "none"]).arg(root));
        }
        std::fs::write(root.join("cgroup.subtree_control"), "+io")
            .expect("enable the io controller");
        let dir = root.join(name);
        let _ = std::fs::create_dir(&dir);
        let sysfs =
            format!("/sys/class/block/{}/dev", backing.file_name().unwrap().to_str().unwrap());
        let dev = std::fs::read_to_string(&sysfs).unwrap().trim().to_string();
        std::fs::write(dir.join("io.max"), format!("{dev} wbps={wbps}")).expect("set io.max");
        WriteThrottle { dir, dev }
    }

    /// Moves process `pid` (all its threads) into the cgroup.
    pub fn hold(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).expect("move into cgroup");
    }

    /// Lifts the limit.
    pub fn release(&self) {
        std::fs::write(self.dir.join("io.max"), format!("{} wbps=max", self.dev)).unwrap();
    }

    /// Bytes written to the device by the cgroup's processes that blk-throttle let go.
    pub fn written(&self) -> u64 {
        let stat = std::fs::read_to_string(self.dir.join("io.stat")).unwrap_or_default();
        stat.lines()
            .filter(|l| l.starts_with(&format!("{} ", self.dev)))
            .flat_map(|l| l.split_whitespace())
            .find_map(|kv| kv.strip_prefix("wbytes=")?.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for WriteThrottle {
    fn drop(&mut self) {
        // The device may be gone by now; then so is its limit.
        let _ = std::fs::write(self.dir.join("io.max"), format!("{} wbps=max", self.dev));
        let _ = std::fs::remove_dir(&self.dir);
    }
}
