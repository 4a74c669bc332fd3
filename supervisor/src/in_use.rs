//! Whether a device's disk (`/dev/ublkbN`) is in use, and by what: a safe delete
//! refuses a device that is open, naming what holds it.
//!
//! The test is an exclusive open (`O_EXCL` on a block device, without `O_CREAT`): the
//! kernel refuses it with `EBUSY` while anything holds the disk or one of its partitions
//! exclusively (a mounted filesystem, dm or md, swap, another `O_EXCL` opener), and,
//! held, keeps anything from doing so until it is closed. A plain open (a `dd`, a
//! reader) is not exclusive: `/proc/PID/fd` shows those. On kernels with
//! `UBLK_F_SAFE_STOP_DEV`, `TRY_STOP_DEV` checks every opener itself; this module then
//! only names them.
//!
//! What holds a disk is named, in this order: where it (or a partition) is mounted
//! (`/proc/self/mountinfo`), the kernel holder stacked on it (`/sys/block/ublkbN/holders`,
//! and each partition's), else a process that has it open (`/proc/PID/fd`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ublkd_proto::mountinfo;

/// A device number as `major:minor`.
pub type DevNum = (u32, u32);

/// What holds a device's disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// The disk or a partition of it is mounted here (the first mount found).
    Mount(PathBuf),
    /// A block device stacked on it (`dm-0`, `md0`), with its dm name if it has one.
    Stacked(String),
    /// A process that has it open.
    Process { pid: u32, comm: String },
    /// Open, but by nothing ublkd can name (a process in another pid namespace, a
    /// holder gone by the time ublkd looked).
    Unnamed,
}

impl Holder {
    /// Whether the hold is likely over in a moment: udev probing a new or just closed
    /// disk (blkid), or an opener gone by the time ublkd looked. A delete asks again
    /// for a little while before it refuses.
    pub fn transient(&self) -> bool {
        match self {
            Holder::Process { comm, .. } => comm.contains("udev"),
            Holder::Unnamed => true,
            Holder::Mount(_) | Holder::Stacked(_) => false,
        }
    }

    /// What the operator does to free the disk.
    pub fn remedy(&self) -> String {
        match self {
            Holder::Mount(_) => "unmount it".into(),
            Holder::Stacked(name) => format!("remove {name}"),
            Holder::Process { .. } => "close it".into(),
            Holder::Unnamed => "close it".into(),
        }
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Holder::Mount(at) => write!(f, "mounted at {}", at.display()),
            Holder::Stacked(name) => write!(f, "held by {name}"),
            Holder::Process { pid, comm } => write!(f, "open in process {pid} ({comm})"),
            Holder::Unnamed => f.write_str("open, by a holder ublkd cannot name"),
        }
    }
}

/// A device found in use: "device 0 is in use: mounted at /mnt".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InUse {
    pub id: u32,
    pub holder: Holder,
}

impl fmt::Display for InUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {} is in use: {}", self.id, self.holder)
    }
}

/// Where the kernel's views are (the real ones, or a test's fixtures).
#[derive(Debug, Clone)]
pub struct Roots {
    pub sys_block: PathBuf,
    pub proc: PathBuf,
}

impl Default for Roots {
    fn default() -> Self {
        Roots { sys_block: PathBuf::from("/sys/block"), proc: PathBuf::from("/proc") }
    }
}

/// The disk's name: `ublkb3`.
pub fn disk_name(id: u32) -> String {
    format!("ublkb{id}")
}

impl Roots {
    /// The device numbers of the disk and each of its partitions (empty if the disk is
    /// gone or never started).
    pub fn dev_nums(&self, id: u32) -> Vec<DevNum> {
        let disk = self.sys_block.join(disk_name(id));
        let mut nums: Vec<DevNum> = read_dev_num(&disk.join("dev")).into_iter().collect();
        for part in partitions(&disk) {
            nums.extend(read_dev_num(&part.join("dev")));
        }
        nums
    }

    /// What holds disk `id`, found in the mount table, its holders and the processes'
    /// fds (ublkd itself, `own_pid`, left out).
    pub fn holder(&self, id: u32, own_pid: u32) -> Holder {
        let nums = self.dev_nums(id);
        let mountinfo = fs::read_to_string(self.proc.join("self/mountinfo")).unwrap_or_default();
        if let Some(at) = mount_point(&mountinfo, &nums) {
            return Holder::Mount(at);
        }
        if let Some(name) = self.stacked(id) {
            return Holder::Stacked(name);
        }
        let wanted: BTreeSet<DevNum> = nums.iter().copied().collect();
        match self.openers(&wanted, own_pid).into_values().next() {
            Some((pid, comm)) => Holder::Process { pid, comm },
            None => Holder::Unnamed,
        }
    }

    /// The first block device stacked on the disk or a partition of it, by name (with
    /// its dm name, if it has one: `dm-0 (vg-data)`).
    pub fn stacked(&self, id: u32) -> Option<String> {
        let disk = self.sys_block.join(disk_name(id));
        let mut dirs = vec![disk.join("holders")];
        dirs.extend(partitions(&disk).into_iter().map(|p| p.join("holders")));
        let name = dirs.iter().find_map(|dir| sorted_names(dir).into_iter().next())?;
        match fs::read_to_string(self.sys_block.join(&name).join("dm/name")) {
            Ok(dm) if !dm.trim().is_empty() => Some(format!("{name} ({})", dm.trim())),
            _ => Some(name),
        }
    }

    /// For each of `wanted` that some process other than `own_pid` has open, the first
    /// such process and its name. One pass over every process's fds.
    pub fn openers(
        &self,
        wanted: &BTreeSet<DevNum>,
        own_pid: u32,
    ) -> BTreeMap<DevNum, (u32, String)> {
        let mut found = BTreeMap::new();
        if wanted.is_empty() {
            return found;
        }
        let Ok(procs) = fs::read_dir(&self.proc) else { return found };
        let mut pids: Vec<u32> = procs
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter(|pid| *pid != own_pid)
            .collect();
        pids.sort_unstable();
        for pid in pids {
            let dir = self.proc.join(pid.to_string());
            let Ok(fds) = fs::read_dir(dir.join("fd")) else { continue };
            for fd in fds.flatten() {
                // The fd's file itself (the link followed): a block device's number.
                let Ok(meta) = fs::metadata(fd.path()) else { continue };
                if !meta.file_type().is_block_device() {
                    continue;
                }
                let num = split_dev(meta.rdev());
                if wanted.contains(&num) && !found.contains_key(&num) {
                    let comm = fs::read_to_string(dir.join("comm")).unwrap_or_default();
                    let comm = ublkd_proto::msg::untrusted_text_within(comm.trim(), 64);
                    found.insert(num, (pid, comm));
                }
            }
            if found.len() == wanted.len() {
                break;
            }
        }
        found
    }
}

/// `st_rdev` as `major:minor` (glibc's encoding, which the kernel's `new_encode_dev`
/// matches).
fn split_dev(rdev: u64) -> DevNum {
    let major = ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0x0000_0fff);
    let minor = ((rdev >> 12) & 0xffff_ff00) | (rdev & 0x0000_00ff);
    (major as u32, minor as u32)
}

/// `259:3` from a sysfs `dev` file.
fn read_dev_num(path: &Path) -> Option<DevNum> {
    parse_dev_num(fs::read_to_string(path).ok()?.trim())
}

fn parse_dev_num(text: &str) -> Option<DevNum> {
    let (major, minor) = text.split_once(':')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The disk's partitions' sysfs directories (`ublkb0/ublkb0p1`), in order.
fn partitions(disk: &Path) -> Vec<PathBuf> {
    let Some(name) = disk.file_name().and_then(|n| n.to_str()) else { return Vec::new() };
    let prefix = format!("{name}p");
    sorted_names(disk)
        .into_iter()
        .filter(|n| n.strip_prefix(&prefix).is_some_and(|rest| rest.parse::<u32>().is_ok()))
        .map(|n| disk.join(n))
        .collect()
}

/// The names in `dir`, sorted (none if it cannot be read).
fn sorted_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    let mut names: Vec<String> =
        entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    names.sort();
    names
}

/// The first mount point in `mountinfo` (`/proc/PID/mountinfo`'s text) of a filesystem
/// on one of `nums`, unescaped (`\040` is a space).
pub fn mount_point(mountinfo: &str, nums: &[DevNum]) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let mut fields = line.split(' ');
        let num = parse_dev_num(fields.nth(2)?)?;
        let at = fields.nth(1)?;
        nums.contains(&num).then(|| PathBuf::from(mountinfo::unescape(at)))
    })
}

/// The outcome of claiming a device's disk for a delete.
#[derive(Debug)]
pub enum Claim {
    /// Nobody holds it. `Some`: ublkd's exclusive open, which keeps anyone from
    /// mounting it until dropped (after STOP_DEV; before DEL_DEV, which waits for it).
    Free(Option<File>),
    /// In use.
    Busy(Holder),
    /// The disk could not be opened to check (the error): ublkd cannot tell.
    Unchecked(io::Error),
}

/// Claims the disk of each of `ids` for a delete: an exclusive open (kept for those in
/// `hold`, closed at once for the others), then one pass over the processes' fds for
/// plain openers of the disks so opened. A disk that does not exist (a device never
/// started) is free.
pub fn claim_all(roots: &Roots, ids: &[u32], hold: &BTreeSet<u32>) -> BTreeMap<u32, Claim> {
    let own_pid = std::process::id();
    let mut claims = BTreeMap::new();
    for &id in ids {
        let path = Path::new("/dev").join(disk_name(id));
        let opened = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(&path);
        let claim = match opened {
            Ok(file) => Claim::Free(Some(file)),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                Claim::Busy(roots.holder(id, own_pid))
            }
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENXIO | libc::ENODEV)) =>
            {
                Claim::Free(None)
            }
            Err(e) => Claim::Unchecked(e),
        };
        claims.insert(id, claim);
    }
    // Plain openers of the disks claimed (ublkd's own open is left out).
    let mut by_num: BTreeMap<DevNum, u32> = BTreeMap::new();
    for (&id, claim) in &claims {
        if matches!(claim, Claim::Free(Some(_))) {
            by_num.extend(roots.dev_nums(id).into_iter().map(|n| (n, id)));
        }
    }
    let wanted: BTreeSet<DevNum> = by_num.keys().copied().collect();
    for (num, (pid, comm)) in roots.openers(&wanted, own_pid) {
        if let Some(id) = by_num.get(&num) {
            claims.insert(*id, Claim::Busy(Holder::Process { pid, comm }));
        }
    }
    for (id, claim) in &mut claims {
        if !hold.contains(id) && matches!(claim, Claim::Free(Some(_))) {
            *claim = Claim::Free(None);
        }
    }
    claims
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
35 22 259:0 / /mnt/data\\040disk rw,relatime shared:9 - ext4 /dev/ublkb0 rw
36 22 259:2 / /srv rw,relatime shared:10 - xfs /dev/ublkb1p1 rw
";

    #[test]
    fn a_mounted_disk_is_found_by_its_number_and_its_mount_point_unescaped() {
        assert_eq!(mount_point(MOUNTINFO, &[(259, 0)]), Some(PathBuf::from("/mnt/data disk")));
    }

    #[test]
    fn a_mounted_partition_names_its_mount_point() {
        assert_eq!(mount_point(MOUNTINFO, &[(259, 1), (259, 2)]), Some(PathBuf::from("/srv")));
    }

    #[test]
    fn a_disk_mounted_nowhere_has_no_mount_point() {
        assert_eq!(mount_point(MOUNTINFO, &[(259, 7)]), None);
        assert_eq!(mount_point("garbage\n\n1 2 x", &[(259, 7)]), None);
    }

    #[test]
    fn device_numbers_split_as_glibc_encodes_them() {
        assert_eq!(split_dev(libc::makedev(259, 3)), (259, 3));
        assert_eq!(split_dev(libc::makedev(8, 300)), (8, 300));
        assert_eq!(split_dev(libc::makedev(4095, 1 << 20)), (4095, 1 << 20));
    }

    /// A fake /sys/block and /proc under a temporary directory.
    struct Fixture {
        root: PathBuf,
        roots: Roots,
    }

    impl Fixture {
        fn new(name: &str) -> Fixture {
            let root =
                std::env::temp_dir().join(format!("ublkd-in-use-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&root);
            let roots = Roots { sys_block: root.join("sys/block"), proc: root.join("proc") };
            fs::create_dir_all(roots.proc.join("self")).unwrap();
            Fixture { root, roots }
        }

        fn disk(&self, id: u32, dev: &str, parts: &[(&str, &str)]) {
            let disk = self.roots.sys_block.join(disk_name(id));
            fs::create_dir_all(disk.join("holders")).unwrap();
            fs::write(disk.join("dev"), format!("{dev}\n")).unwrap();
            for (name, dev) in parts {
                fs::create_dir_all(disk.join(name).join("holders")).unwrap();
                fs::write(disk.join(name).join("dev"), format!("{dev}\n")).unwrap();
            }
        }

        fn write(&self, rel: &str, text: &str) {
            let path = self.root.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.root);
        }
    }

    #[test]
    fn a_mount_is_named_before_anything_else() {
        let f = Fixture::new("mount");
        f.disk(1, "259:1", &[("ublkb1p1", "259:2")]);
        f.write("proc/self/mountinfo", MOUNTINFO);
        f.write("sys/block/ublkb1/holders/dm-0", "");
        assert_eq!(f.roots.holder(1, 0), Holder::Mount(PathBuf::from("/srv")));
        assert_eq!(f.roots.dev_nums(1), vec![(259, 1), (259, 2)]);
    }

    #[test]
    fn a_stacked_device_is_named_with_its_dm_name() {
        let f = Fixture::new("stacked");
        f.disk(3, "259:5", &[("ublkb3p1", "259:6")]);
        f.write("proc/self/mountinfo", MOUNTINFO);
        f.write("sys/block/ublkb3/ublkb3p1/holders/dm-2", "");
        f.write("sys/block/dm-2/dm/name", "vg-data\n");
        assert_eq!(f.roots.holder(3, 0), Holder::Stacked("dm-2 (vg-data)".into()));
        let md = Fixture::new("md");
        md.disk(4, "259:7", &[]);
        md.write("sys/block/ublkb4/holders/md0", "");
        assert_eq!(md.roots.holder(4, 0), Holder::Stacked("md0".into()));
    }

    #[test]
    fn an_open_disk_held_by_nothing_named_is_unnamed() {
        let f = Fixture::new("unnamed");
        f.disk(5, "259:9", &[]);
        f.write("proc/self/mountinfo", MOUNTINFO);
        f.write("proc/42/comm", "sleep\n");
        assert_eq!(f.roots.holder(5, 0), Holder::Unnamed);
        assert_eq!(f.roots.holder(6, 0), Holder::Unnamed, "a disk that is gone");
    }

    #[test]
    fn a_process_with_the_disk_open_is_named_and_ublkd_itself_is_not() {
        // The fixture's "disk" is whatever block device this host has, if any: the
        // process's fd is a link to its node.
        let f = Fixture::new("proc");
        let Some((path, num)) = any_block_device() else { return };
        f.write("proc/77/comm", "fsck\n");
        fs::create_dir_all(f.roots.proc.join("77/fd")).unwrap();
        std::os::unix::fs::symlink(&path, f.roots.proc.join("77/fd/3")).unwrap();
        let wanted = BTreeSet::from([num]);
        let found = f.roots.openers(&wanted, 0);
        assert_eq!(found.get(&num), Some(&(77, "fsck".to_string())));
        assert!(f.roots.openers(&wanted, 77).is_empty(), "ublkd's own fds are left out");
    }

    /// A block device node of this host and its number, if it has one.
    fn any_block_device() -> Option<(PathBuf, DevNum)> {
        fs::read_dir("/dev").ok()?.flatten().find_map(|e| {
            let meta = fs::metadata(e.path()).ok()?;
            meta.file_type().is_block_device().then(|| (e.path(), split_dev(meta.rdev())))
        })
    }

    #[test]
    fn messages_name_the_device_the_holder_and_the_remedy() {
        let mounted = InUse { id: 0, holder: Holder::Mount("/mnt".into()) };
        assert_eq!(mounted.to_string(), "device 0 is in use: mounted at /mnt");
        assert_eq!(mounted.holder.remedy(), "unmount it");
        let process = InUse { id: 2, holder: Holder::Process { pid: 9, comm: "dd".into() } };
        assert_eq!(process.to_string(), "device 2 is in use: open in process 9 (dd)");
        assert_eq!(Holder::Stacked("dm-0".into()).to_string(), "held by dm-0");
        assert_eq!(Holder::Stacked("dm-0".into()).remedy(), "remove dm-0");
    }

    #[test]
    fn only_udev_and_unnamed_holds_count_as_transient() {
        assert!(Holder::Process { pid: 1, comm: "systemd-udevd".into() }.transient());
        assert!(Holder::Unnamed.transient());
        assert!(!Holder::Process { pid: 1, comm: "dd".into() }.transient());
        assert!(!Holder::Mount("/mnt".into()).transient());
    }
}
