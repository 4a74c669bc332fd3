//! The guest's initramfs: static busybox, `ublk_drv.ko` and [`INIT_SCRIPT`], written as
//! a `newc` cpio archive by this module (no `cpio` tool, deterministic bytes).
//!
//! The image holds nothing per run: the run directory and the marker nonce come on the
//! kernel command line (`ublkd.run=DIR ublkd.nonce=HEX`; parameters with a dot are not
//! passed to init as arguments or environment, but `/proc/cmdline` shows them). It is
//! cached as `<cache>/initramfs/<abi>-<hash>.cpio`, where the hash covers every input,
//! so a changed busybox, module or init script builds a new image (and prunes that
//! kernel's images older than an hour, and those of kernels no longer cached; the other
//! cached kernel's images stay, since both are booted in turn).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::cache::{Cache, CacheError};
use crate::kernel::Kernel;

/// The static busybox the guest's init runs on (Debian's `busybox-static`).
pub const BUSYBOX: &str = "/bin/busybox";

/// Bump when the image layout changes in a way the hashed inputs do not show.
const LAYOUT_VERSION: u32 = 3;

/// The guest's `/init` (busybox `sh`).
///
/// It prints three kinds of marker lines, each on a line of its own after an empty
/// line (so that output without a final newline cannot swallow it):
/// `UBLKD-VM:<nonce>:SETUP-FAILED:<step>`, `UBLKD-VM:<nonce>:READY:<uname -r>`,
/// `UBLKD-VM:<nonce>:CHECK-FAILED:<status>` and `UBLKD-VM:<nonce>:EXIT:<status>`.
pub const INIT_SCRIPT: &str = include_str!("../vm/guest-init.sh");

/// Errors of building the initramfs.
#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    /// The cache directory failed.
    #[error("the initramfs cache is unusable")]
    Cache(#[from] CacheError),
    /// An input file could not be read.
    #[error("could not read the initramfs input {0:?} (busybox comes from busybox-static)")]
    Read(PathBuf, #[source] io::Error),
    /// The image could not be written.
    #[error("could not write the initramfs {0:?}")]
    Write(PathBuf, #[source] io::Error),
}

/// A `newc` (SVR4, no CRC) cpio archive being written into memory.
#[derive(Debug, Default)]
pub struct Cpio {
    out: Vec<u8>,
    next_ino: u32,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

impl Cpio {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a directory.
    pub fn dir(&mut self, name: &str, perm: u32) {
        self.entry(name, S_IFDIR | perm, 2, (0, 0), &[]);
    }

    /// Adds a regular file.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, S_IFREG | perm, 1, (0, 0), data);
    }

    /// Adds a character device node.
    pub fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) {
        self.entry(name, S_IFCHR | perm, 1, (major, minor), &[]);
    }

    /// Appends the trailer and returns the archive.
    pub fn finish(mut self) -> Vec<u8> {
        self.next_ino = 0;
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[]);
        self.out
    }

    fn entry(&mut self, name: &str, mode: u32, nlink: u32, rdev: (u32, u32), data: &[u8]) {
        self.next_ino += 1;
        let name_size = name.len() + 1;
        let fields = [
            self.next_ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime: fixed, so the bytes depend only on the inputs
            data.len() as u32,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            name_size as u32,
            0, // check
        ];
        self.out.extend_from_slice(b"070701");
        for field in fields {
            self.out.extend_from_slice(format!("{field:08X}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }
}

/// The initramfs for `busybox` and the optional `ublk_drv.ko`.
pub fn image(busybox: &[u8], ublk_module: Option<&[u8]>) -> Vec<u8> {
    let mut cpio = Cpio::new();
    for dir in ["bin", "dev", "proc", "sys", "host", "sbin", "usr", "usr/bin", "usr/sbin"] {
        cpio.dir(dir, 0o755);
    }
    cpio.char_dev("dev/console", 0o600, 5, 1);
    cpio.char_dev("dev/null", 0o666, 1, 3);
    cpio.file("bin/busybox", 0o755, busybox);
    cpio.file("init", 0o755, INIT_SCRIPT.as_bytes());
    if let Some(ko) = ublk_module {
        cpio.file("ublk_drv.ko", 0o644, ko);
    }
    cpio.finish()
}

/// 64-bit FNV-1a, for the cache key (stable across builds and toolchains).
fn fnv1a(hash: u64, data: &[u8]) -> u64 {
    data.iter().fold(hash, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// The cached initramfs for `kernel`, built if its inputs changed.
pub fn ensure(cache: &Cache, kernel: &Kernel) -> Result<PathBuf, InitramfsError> {
    let read = |p: &Path| fs::read(p).map_err(|e| InitramfsError::Read(p.into(), e));
    let busybox = read(Path::new(BUSYBOX))?;
    let module = kernel.ublk_module().map(|p| read(&p)).transpose()?;
    let mut hash = 0xcbf2_9ce4_8422_2325;
    hash = fnv1a(hash, &LAYOUT_VERSION.to_le_bytes());
    for part in [Some(&busybox[..]), module.as_deref(), Some(INIT_SCRIPT.as_bytes())] {
        let part = part.unwrap_or_default();
        hash = fnv1a(hash, &(part.len() as u64).to_le_bytes());
        hash = fnv1a(hash, part);
    }
    let dir = cache.initramfs();
    let path = dir.join(format!("{}-{hash:016x}.cpio", kernel.abi));
    if path.exists() {
        return Ok(path);
    }
    cache.create_dir(&dir)?;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, image(&busybox, module.as_deref()))
        .map_err(|e| InitramfsError::Write(tmp.clone(), e))?;
    fs::rename(&tmp, &path).map_err(|e| InitramfsError::Write(path.clone(), e))?;
    prune(cache, &kernel.abi, &path);
    Ok(path)
}

/// The kernel ABI an image file name `<abi>-<hash>.cpio` was built for.
pub fn image_abi(file_name: &str) -> Option<&str> {
    let (abi, hash) = file_name.strip_suffix(".cpio")?.rsplit_once('-')?;
    (hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit())).then_some(abi)
}

/// Removes images other than `keep` that are older than an hour (qemu reads its initrd
/// at startup, so no running boot needs them any more) and were built for kernel `abi`
/// or for a kernel that is no longer cached.
fn prune(cache: &Cache, abi: &str, keep: &Path) {
    let Ok(entries) = fs::read_dir(cache.initramfs()) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(image) = entry.file_name().to_str().and_then(image_abi).map(str::to_owned) else {
            continue;
        };
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(3600));
        let unused = image == abi || !cache.kernels().join(&image).is_dir();
        if path != keep && old && unused {
            let _ = fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, mode, rdev, data) of one archive entry.
    type Entry = (String, u32, (u32, u32), Vec<u8>);

    /// Reads back the entries of a newc archive.
    fn entries(mut bytes: &[u8]) -> Vec<Entry> {
        let mut out = Vec::new();
        let mut offset = 0usize;
        loop {
            assert_eq!(&bytes[..6], b"070701", "bad magic at {offset}");
            let field = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&bytes[6 + 8 * i..14 + 8 * i]).unwrap(), 16)
                    .unwrap()
            };
            let (mode, size, rdev, name_size) =
                (field(1), field(6) as usize, (field(9), field(10)), field(11) as usize);
            let name = std::str::from_utf8(&bytes[110..110 + name_size - 1]).unwrap().to_owned();
            let data_start = (110 + name_size).next_multiple_of(4);
            let data = bytes[data_start..data_start + size].to_vec();
            let next = (data_start + size).next_multiple_of(4);
            offset += next;
            bytes = &bytes[next..];
            if name == "TRAILER!!!" {
                assert!(bytes.is_empty());
                return out;
            }
            out.push((name, mode, rdev, data));
        }
    }

    #[test]
    fn image_round_trips_with_init_busybox_module_and_console() {
        let img = image(b"BUSYBOX", Some(b"KO"));
        assert_eq!(img.len() % 4, 0);
        let entries = entries(&img);
        let get = |n: &str| entries.iter().find(|e| e.0 == n).unwrap_or_else(|| panic!("{n}"));
        assert_eq!(get("init").3, INIT_SCRIPT.as_bytes());
        assert_eq!(get("init").1, S_IFREG | 0o755);
        assert_eq!(get("bin/busybox").3, b"BUSYBOX");
        assert_eq!(get("ublk_drv.ko").3, b"KO");
        assert_eq!(get("dev/console").1, S_IFCHR | 0o600);
        assert_eq!(get("dev/console").2, (5, 1));
        assert_eq!(get("host").1, S_IFDIR | 0o755);
    }

    #[test]
    fn image_names_give_their_kernel_abi() {
        assert_eq!(
            image_abi("6.12.117+deb12-cloud-amd64-0123456789abcdef.cpio"),
            Some("6.12.117+deb12-cloud-amd64")
        );
        assert_eq!(image_abi("7.2.13+deb14-cloud-amd64-0123456789abcdef.tmp-12"), None);
        assert_eq!(image_abi("7.2.13+deb14-cloud-amd64.cpio"), None);
        assert_eq!(image_abi("x-0123456789abcdeg.cpio"), None);
    }

    #[test]
    fn image_without_module_has_no_ko_and_is_deterministic() {
        let a = image(b"BB", None);
        assert!(!entries(&a).iter().any(|e| e.0 == "ublk_drv.ko"));
        assert_eq!(a, image(b"BB", None));
    }

    #[test]
    fn the_systemd_guest_reports_like_the_plain_one_and_masks_the_tree_walkers() {
        let (_, systemd) = INIT_SCRIPT.split_once("if [ -n \"$SYSTEMD\" ]; then").unwrap();
        let (systemd, plain) = systemd.split_once("\nfi\n").unwrap();
        // Both modes run the one guest_body, which prints every marker.
        assert!(systemd.contains("guest_body \"uname -r\""));
        assert!(plain.contains("guest_body \"$S/busybox uname -r\""));
        assert!(
            systemd.contains("exec switch_root $R /lib/systemd/systemd --unit=ublkd-vm.target")
        );
        assert!(systemd.contains("systemd-tmpfiles-setup.service"), "tmpfiles would clean /tmp");
        assert!(systemd.contains("usr/sbin/policy-rc.d"), "packages could not start services");
    }

    #[test]
    fn init_prints_every_marker_on_its_own_line() {
        for kind in ["SETUP-FAILED", "READY", "CHECK-FAILED", "EXIT"] {
            assert!(INIT_SCRIPT.contains(&format!("echo; echo \"$M:{kind}:")), "{kind}");
        }
        assert!(INIT_SCRIPT.contains("guest-check --kernel \"$CHECK_KERNEL\""));
        assert!(INIT_SCRIPT.contains("poweroff -f"));
    }
}
