//! One device as the daemon will create it, its limits, and their checks.
//!
//! [`DeviceSpec`] is the resolved form: every default applied, the size known. It comes
//! from a `[[device]]` table (see [`crate::Config`]) or from ublkctl's `add` flags; both
//! end in [`DeviceSpec::validate`], so the two paths accept exactly the same devices.

use std::fs::{File, Metadata};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use ublkd_proto::msg::{LayerSet, MAX_NBD_CONNECTIONS, SandboxLayer};

use crate::nbd_uri::NbdUri;
use crate::rbd::RbdSpec;
use crate::size::format_size;

/// Largest device id ublkd accepts: the kernel's `UBLK_MAX_UBLKS - 1`, where
/// `UBLK_MAX_UBLKS = UBLK_MINORS = 1 << MINORBITS` (`drivers/block/ublk_drv.c`,
/// *reading*); ADD_DEV refuses larger ids with `-EINVAL`. Also a sane cap on its own:
/// `/dev/ublkbN` names stay short.
pub const MAX_DEVICE_ID: u32 = (1 << 20) - 1;
/// Most queues per device ublkd accepts. The kernel allows more (`UBLK_MAX_NR_QUEUES`);
/// each queue costs a ring and buffers in the worker, and 64 covers any disk's
/// parallelism.
pub const MAX_QUEUES: u16 = 64;
/// Deepest queue: the kernel's `UBLK_MAX_QUEUE_DEPTH` (`include/uapi/linux/ublk_cmd.h`).
pub const MAX_QUEUE_DEPTH: u16 = 4096;
/// Smallest logical block size: the sector size.
pub const MIN_BLOCK_SIZE: u32 = 512;
/// Largest logical block size: the page size on the machines ublkd runs on (the block
/// layer refuses logical blocks above `PAGE_SIZE`).
pub const MAX_BLOCK_SIZE: u32 = 4096;
/// Most worker threads per device.
pub const MAX_THREADS: u16 = 64;
/// Largest device: 2^63 bytes, so byte offsets fit an `i64` (`off_t`) everywhere.
pub const MAX_SIZE_BYTES: u64 = 1 << 63;
/// Most request slots (queues × queue_depth) of a zero-copy device: each slot has its
/// own entry in every worker ring's buffer table, which io_uring caps at 2^14.
pub const MAX_ZERO_COPY_SLOTS: u32 = 1 << 14;

/// What serves a device's I/O.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TargetSpec {
    /// Completes every request at once: writes are dropped, reads return undefined
    /// data (the target touches no data, so it measures the server alone).
    Null,
    /// A RAM disk whose data lives in the state dir, so it outlives workers and ublkd
    /// restarts; it is gone when the device is deleted.
    Memory,
    /// A backing file or block device.
    Loop {
        /// Absolute path of a regular file or block device.
        file: PathBuf,
        /// Open with `O_DIRECT`, bypassing the page cache.
        direct: bool,
        /// Zero copy: the kernel lends each request's pages to the worker's ring
        /// (`UBLK_F_AUTO_BUF_REG`), which reads and writes the backing file straight
        /// from them, instead of copying every request through the worker's memory.
        /// `None`: on where the kernel has it and the device fits its buffer table
        /// (see [`MAX_ZERO_COPY_SLOTS`]); the supervisor decides at creation.
        zero_copy: Option<bool>,
    },
    /// An export of an NBD server. Its size, block sizes and what it supports come from
    /// the server when ublkd connects, so a spec holds only where it is, and how its
    /// data moves.
    Nbd {
        /// Where the export is.
        uri: NbdUri,
        /// Zero copy: the kernel lends each request's pages to the worker's ring
        /// (`UBLK_F_AUTO_BUF_REG`), which sends WRITE data from them and receives READ
        /// data into them, instead of copying every request through the worker's
        /// memory. Opt-in (`None` is off): the worker then receives each reply's header
        /// on its own before its data, one more receive per READ, which costs small
        /// reads. It needs one connection per queue thread (at most
        /// [`MAX_NBD_CONNECTIONS`]) and simple replies; the supervisor decides the rest
        /// at creation.
        zero_copy: Option<bool>,
    },
    /// An RBD image in a Ceph cluster. Its size comes from the image when ublkd
    /// connects; a snapshot is served read-only.
    Rbd(RbdSpec),
}

impl TargetSpec {
    /// The target's name as the config file spells it: `null`, `memory`, `loop`, `nbd`
    /// or `rbd`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Memory => "memory",
            Self::Loop { .. } => "loop",
            Self::Nbd { .. } => "nbd",
            Self::Rbd(_) => "rbd",
        }
    }

    /// What the spec says of zero copy, for the targets that have it (loop and nbd):
    /// `None` where it is unset (before the supervisor decides) or the target has none.
    pub fn zero_copy(&self) -> Option<bool> {
        match self {
            Self::Loop { zero_copy, .. } | Self::Nbd { zero_copy, .. } => *zero_copy,
            Self::Null | Self::Memory | Self::Rbd(_) => None,
        }
    }
}

/// The settings every device has. The config file's `[defaults]` are one set; a
/// device's own table or ublkctl's flags override them field by field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceSettings {
    /// Hardware queues.
    pub queues: u16,
    /// Requests in flight per queue.
    pub queue_depth: u16,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Worker threads.
    pub threads: u16,
    /// Run the worker in the sandbox.
    pub sandbox: bool,
    /// Sandbox layers the worker may run without where they cannot be applied (a
    /// chroot, a kernel that refuses user namespaces or lacks Landlock): it then runs
    /// weaker and says so. Any other layer it cannot apply makes it refuse to run.
    pub sandbox_optional: LayerSet,
}

impl Default for DeviceSettings {
    fn default() -> Self {
        Self {
            queues: 1,
            queue_depth: 128,
            block_size: 4096,
            threads: 1,
            sandbox: true,
            sandbox_optional: LayerSet::EMPTY,
        }
    }
}

impl DeviceSettings {
    /// Checks each value against its limit. Whether threads fit queues × queue_depth is
    /// checked per device, where overrides may change either side.
    pub fn validate(&self) -> Result<(), FieldError> {
        check_queues(self.queues)?;
        check_queue_depth(self.queue_depth)?;
        check_block_size(self.block_size)?;
        check_threads(self.threads)?;
        Ok(())
    }
}

/// One device, fully resolved.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceSpec {
    /// The kernel device id (`/dev/ublkbN`), or `None` to let the kernel pick.
    pub id: Option<u32>,
    /// What serves the I/O.
    pub target: TargetSpec,
    /// Capacity in bytes: a multiple of `settings.block_size`, at most
    /// [`MAX_SIZE_BYTES`]. For an nbd target, 0: the export's size is learnt from the
    /// server when ublkd connects, never written down ahead of it.
    pub size_bytes: u64,
    /// Queues, threads, block size and sandbox.
    pub settings: DeviceSettings,
    /// Its name, whether it is read-only and whether its partitions are scanned.
    pub attrs: DeviceAttrs,
}

/// Longest device name: short enough for a udev symlink (`/dev/disk/by-id/ublk-NAME`)
/// and a journal field, long enough for a host name plus a purpose.
pub const MAX_NAME_LEN: usize = 64;

/// What a device is besides its data path: set at add time, kept for its life (and
/// across ublkd restarts, in its record).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DeviceAttrs {
    /// The operator's name for the device (`name = "..."`, `ublkctl add --name`),
    /// unique among the devices: commands take it instead of the id, and udev links
    /// `/dev/disk/by-id/ublk-NAME` to the disk. Checked by [`check_name`].
    pub name: Option<String>,
    /// The kernel makes the disk read-only (`UBLK_ATTR_READ_ONLY`) and the worker
    /// refuses every request that would change data, whatever the kernel sends.
    pub read_only: bool,
    /// The kernel scans the disk for partitions (`/dev/ublkbNpM`). Off by default:
    /// where the kernel has `UBLK_F_NO_AUTO_PART_SCAN` (Linux 7.0+) the device is made
    /// with it, so a device's content never makes the kernel parse a partition table.
    /// Only for an unsandboxed worker: the kernel never scans a disk whose server lacks
    /// CAP_SYS_ADMIN (it calls such a server unprivileged), so a sandboxed worker's
    /// disk has no partitions on any kernel.
    pub partitions: bool,
}

/// Checks a device name: 1 to [`MAX_NAME_LEN`] characters of `A-Z a-z 0-9 . _ -`, not
/// starting with `.` or `-` and not all digits. Why so narrow: the name becomes a
/// path component under `/dev/disk/by-id/` (no `/`, no `..`), a journal field and a
/// command-line argument (no leading `-`), and an all-digit name would be read as an
/// id by `-n`.
pub fn check_name(name: &str) -> Result<(), FieldError> {
    let problem = if name.is_empty() {
        "is empty; a name has 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'".to_string()
    } else if name.len() > MAX_NAME_LEN {
        format!("{name:?} is {} characters long; the limit is {MAX_NAME_LEN}", name.len())
    } else if let Some(c) =
        name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        format!("{name:?} has {c:?}; a name may have only A-Z, a-z, 0-9, '.', '_' and '-'")
    } else if name.starts_with(['.', '-']) {
        format!("{name:?} starts with {:?}; start it with a letter, digit or '_'", &name[..1])
    } else if name.bytes().all(|b| b.is_ascii_digit()) {
        format!("{name:?} is all digits, which reads as a device id; add a letter")
    } else {
        return Ok(());
    };
    Err(FieldError::new("name", problem))
}

/// A device setting that breaks a rule: which field, and what is wrong with it.
///
/// `field` is the config file's key (`queue_depth`), so the config file can prefix it
/// with `device[2].` and ublkctl can map it to its flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct FieldError {
    /// The key, as the config file spells it.
    pub field: &'static str,
    /// What is wrong and what would be right.
    pub problem: String,
}

impl FieldError {
    pub(crate) fn new(field: &'static str, problem: impl Into<String>) -> Self {
        Self { field, problem: problem.into() }
    }
}

impl DeviceSpec {
    /// Whether the device's request slots fit a worker ring's buffer table, as zero
    /// copy needs (see [`MAX_ZERO_COPY_SLOTS`]).
    pub fn fits_zero_copy(&self) -> bool {
        u32::from(self.settings.queues) * u32::from(self.settings.queue_depth)
            <= MAX_ZERO_COPY_SLOTS
    }

    /// Checks every limit: ranges, block size, threads against queues × queue_depth,
    /// size, and for a loop target that the file is an absolute path to an existing
    /// regular file or block device at least `size_bytes` long.
    ///
    /// Reads the loop file's metadata (and opens a block device to learn its size);
    /// nothing else touches the system.
    pub fn validate(&self) -> Result<(), FieldError> {
        if let Some(id) = self.id {
            check_device_id(i128::from(id))?;
        }
        if let Some(name) = &self.attrs.name {
            check_name(name)?;
        }
        // Measured on 7.2: a sandboxed worker's disk got no partitions, and BLKRRPART
        // on it failed with EINVAL.
        if self.attrs.partitions && self.settings.sandbox {
            return Err(FieldError::new(
                "partitions",
                "needs the device's worker unsandboxed (sandbox = false): the kernel \
                 scans the partitions of a disk only when its server has CAP_SYS_ADMIN, \
                 and a sandboxed worker has none; or leave partitions off and map them \
                 with kpartx",
            ));
        }
        check_queues(self.settings.queues)?;
        check_queue_depth(self.settings.queue_depth)?;
        check_block_size(self.settings.block_size)?;
        check_threads(self.settings.threads)?;
        let slots = u32::from(self.settings.queues) * u32::from(self.settings.queue_depth);
        if u32::from(self.settings.threads) > slots {
            return Err(FieldError::new(
                "threads",
                format!(
                    "{} is more than queues × queue_depth = {slots}; a thread with no \
                     request slot idles, use at most {slots}",
                    self.settings.threads
                ),
            ));
        }
        match (&self.target, self.size_bytes) {
            (TargetSpec::Nbd { .. } | TargetSpec::Rbd(_), 0) => {}
            (TargetSpec::Rbd(_), _) => {
                return Err(FieldError::new(
                    "size",
                    "an rbd device's size is its image's, which ublkd reads from the \
                     cluster; remove size (resize the image with `rbd resize`)",
                ));
            }
            (TargetSpec::Nbd { .. }, _) => {
                return Err(FieldError::new(
                    "size",
                    "an nbd device's size is its export's, which the server gives at \
                     connection; remove size",
                ));
            }
            _ => check_size(self.size_bytes, self.settings.block_size)?,
        }
        if self.target.zero_copy() == Some(true) && !self.fits_zero_copy() {
            return Err(FieldError::new(
                "zero_copy",
                format!(
                    "needs queues × queue_depth <= {MAX_ZERO_COPY_SLOTS} (one registered \
                     buffer per request slot), this device has {slots}; lower queues or \
                     queue_depth, or turn zero_copy off"
                ),
            ));
        }
        // A zero-copy nbd worker reads each connection from the one thread that fetched
        // its requests (their pages are registered in that thread's ring): one
        // connection per thread, and a worker takes at most MAX_NBD_CONNECTIONS.
        if matches!(self.target, TargetSpec::Nbd { zero_copy: Some(true), .. })
            && self.settings.threads > u16::from(MAX_NBD_CONNECTIONS)
        {
            return Err(FieldError::new(
                "threads",
                format!(
                    "{} is more than {MAX_NBD_CONNECTIONS}: a zero-copy nbd device has one \
                     connection per thread, and at most {MAX_NBD_CONNECTIONS}; lower threads \
                     or turn zero_copy off",
                    self.settings.threads
                ),
            ));
        }
        if let TargetSpec::Loop { file, .. } = &self.target {
            let file_size = backing_file_size(file)?;
            if self.size_bytes > file_size {
                return Err(FieldError::new(
                    "size",
                    format!(
                        "{} ({} bytes) is larger than {} ({file_size} bytes); grow the \
                         file first or leave size out to use the whole file",
                        format_size(self.size_bytes),
                        self.size_bytes,
                        file.display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The size of a loop device that sets no `size`: the whole file, which must be
    /// non-empty and a whole number of `block_size` blocks.
    pub fn loop_size_from_file(file: &Path, block_size: u32) -> Result<u64, FieldError> {
        let bytes = backing_file_size(file)?;
        if bytes == 0 {
            return Err(FieldError::new(
                "file",
                format!(
                    "{} is empty; a loop device needs a non-empty file (grow it with \
                     truncate -s)",
                    file.display()
                ),
            ));
        }
        if bytes % u64::from(block_size.max(1)) != 0 {
            return Err(FieldError::new(
                "file",
                format!(
                    "{} is {bytes} bytes, not a multiple of block_size {block_size}; set \
                     size to a multiple of {block_size} to use part of it",
                    file.display()
                ),
            ));
        }
        Ok(bytes)
    }
}

/// Checks that `file` is an absolute path to a regular file or block device and returns
/// its size in bytes. A block device is opened read-only to learn its size (its
/// metadata says 0).
pub fn backing_file_size(file: &Path) -> Result<u64, FieldError> {
    let metadata = backing_file_metadata(file)?;
    if metadata.file_type().is_block_device() {
        let unreadable = |error: io::Error| {
            FieldError::new(
                "file",
                format!(
                    "cannot open block device {} to read its size ({error}); check its \
                     permissions",
                    file.display()
                ),
            )
        };
        let mut device = File::open(file).map_err(unreadable)?;
        device.seek(SeekFrom::End(0)).map_err(unreadable)
    } else {
        Ok(metadata.len())
    }
}

/// Checks that `file` is an absolute path to a regular file or block device and returns
/// its metadata (symlinks followed).
pub(crate) fn backing_file_metadata(file: &Path) -> Result<Metadata, FieldError> {
    check_absolute("file", file, "/var/lib/ublkd/disk.img")?;
    let metadata = std::fs::metadata(file).map_err(|error| {
        let problem = match error.kind() {
            io::ErrorKind::NotFound => format!(
                "{} does not exist; expected an existing regular file or block device",
                file.display()
            ),
            io::ErrorKind::NotADirectory => format!(
                "{} does not exist (a parent is not a directory); expected an existing \
                 regular file or block device",
                file.display()
            ),
            _ => format!(
                "cannot inspect {} ({error}); expected an existing regular file or block \
                 device",
                file.display()
            ),
        };
        FieldError::new("file", problem)
    })?;
    let file_type = metadata.file_type();
    let kind = if file_type.is_file() || file_type.is_block_device() {
        return Ok(metadata);
    } else if file_type.is_dir() {
        "a directory"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(FieldError::new(
        "file",
        format!("{} is {kind}; expected a regular file or block device", file.display()),
    ))
}

/// Checks that `path` is absolute and usable as a path (no NUL byte).
pub(crate) fn check_absolute(
    field: &'static str,
    path: &Path,
    example: &str,
) -> Result<(), FieldError> {
    if path.as_os_str().as_encoded_bytes().contains(&0) {
        return Err(FieldError::new(field, format!("{path:?} contains a NUL byte; a path cannot")));
    }
    if !path.is_absolute() {
        return Err(FieldError::new(
            field,
            format!("{path:?} is not an absolute path; use one such as {example}"),
        ));
    }
    Ok(())
}

/// Checks `value` against `lo..=hi` and returns it narrowed to `T`.
pub(crate) fn in_range<T>(field: &'static str, value: i128, lo: T, hi: T) -> Result<T, FieldError>
where
    T: Copy + Into<i128> + TryFrom<i128> + std::fmt::Display,
{
    let out_of_range =
        || FieldError::new(field, format!("{value} is out of range; expected {lo}..={hi}"));
    if value < lo.into() || value > hi.into() {
        return Err(out_of_range());
    }
    T::try_from(value).map_err(|_| out_of_range())
}

pub(crate) fn check_device_id(id: i128) -> Result<u32, FieldError> {
    in_range("id", id, 0, MAX_DEVICE_ID).map_err(|mut e| {
        e.problem.push_str(" (the kernel's limit) or \"auto\"");
        e
    })
}

fn check_queues(queues: u16) -> Result<u16, FieldError> {
    in_range("queues", queues.into(), 1, MAX_QUEUES)
}

fn check_queue_depth(depth: u16) -> Result<u16, FieldError> {
    in_range("queue_depth", depth.into(), 1, MAX_QUEUE_DEPTH)
}

fn check_threads(threads: u16) -> Result<u16, FieldError> {
    in_range("threads", threads.into(), 1, MAX_THREADS)
}

fn check_block_size(block_size: u32) -> Result<u32, FieldError> {
    check_block_size_wide(block_size.into())
}

/// Checks a block size as written (any integer) and returns it as a `u32`.
pub(crate) fn check_block_size_wide(block_size: i128) -> Result<u32, FieldError> {
    match u32::try_from(block_size) {
        Ok(size) if size.is_power_of_two() && (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&size) => {
            Ok(size)
        }
        _ => Err(FieldError::new(
            "block_size",
            format!("{block_size} is not a valid block size; expected 512, 1024, 2048 or 4096"),
        )),
    }
}

fn check_size(size: u64, block_size: u32) -> Result<(), FieldError> {
    let block = u64::from(block_size.max(1));
    if size == 0 {
        return Err(FieldError::new(
            "size",
            format!("0 is too small; a device needs at least one block ({block} bytes)"),
        ));
    }
    if size > MAX_SIZE_BYTES {
        return Err(FieldError::new(
            "size",
            format!(
                "{size} is too large; the largest device is {MAX_SIZE_BYTES} bytes ({})",
                format_size(MAX_SIZE_BYTES)
            ),
        ));
    }
    let remainder = size % block;
    if remainder != 0 {
        let down = size - remainder;
        // `size < 2^63` here and `block <= 2^12`, so `up` cannot overflow.
        let up = down + block;
        let hint = if down == 0 {
            format!("; use {up} or more")
        } else {
            format!("; round it to {down} or {up}")
        };
        return Err(FieldError::new(
            "size",
            format!("{size} is not a multiple of block_size {block_size}{hint}"),
        ));
    }
    Ok(())
}

/// `sandbox_optional` as written: each name a [`SandboxLayer`].
pub fn parse_sandbox_optional(names: &[String]) -> Result<LayerSet, FieldError> {
    let layers = names
        .iter()
        .map(|n| SandboxLayer::from_name(n))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| FieldError { field: "sandbox_optional", problem: e.to_string() })?;
    Ok(LayerSet::of(&layers))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 1 GiB null device with the built-in defaults (the config tests' too).
    pub(crate) fn null_device() -> DeviceSpec {
        DeviceSpec {
            id: None,
            target: TargetSpec::Null,
            size_bytes: 1 << 30,
            settings: DeviceSettings::default(),
            attrs: DeviceAttrs::default(),
        }
    }

    #[test]
    fn a_name_of_the_safe_charset_passes_and_others_say_why() {
        for good in ["db", "db-01.prod", "_x", "a".repeat(MAX_NAME_LEN).as_str(), "0x1"] {
            assert_eq!(check_name(good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("", "is empty"),
            ("a/b", "'/'"),
            ("..", "starts with"),
            ("-n", "starts with"),
            ("a b", "' '"),
            ("é", "'é'"),
            ("12", "all digits"),
        ] {
            let e = check_name(bad).unwrap_err();
            assert!(e.field == "name" && e.problem.contains(says), "{bad:?}: {e}");
        }
        assert!(check_name(&"a".repeat(MAX_NAME_LEN + 1)).unwrap_err().problem.contains("limit"));
        let named = DeviceSpec {
            attrs: DeviceAttrs { name: Some("a/b".into()), ..DeviceAttrs::default() },
            ..null_device()
        };
        assert_eq!(field_of(&named), Some("name"));
    }

    #[test]
    fn partitions_need_an_unsandboxed_worker() {
        let mut spec = null_device();
        spec.attrs.partitions = true;
        assert_eq!(field_of(&spec), Some("partitions"));
        spec.settings.sandbox = false;
        assert_eq!(spec.validate(), Ok(()));
    }

    /// [`null_device`] with `change` made to its settings.
    fn null_device_with(change: impl FnOnce(&mut DeviceSettings)) -> DeviceSpec {
        let mut spec = null_device();
        change(&mut spec.settings);
        spec
    }

    fn field_of(spec: &DeviceSpec) -> Option<&'static str> {
        spec.validate().err().map(|e| e.field)
    }

    #[test]
    fn validate_accepts_limits_at_both_ends() {
        let mut spec = null_device();
        spec.id = Some(MAX_DEVICE_ID);
        spec.settings.queues = MAX_QUEUES;
        spec.settings.queue_depth = MAX_QUEUE_DEPTH;
        spec.settings.threads = MAX_THREADS;
        spec.size_bytes = MAX_SIZE_BYTES;
        assert_eq!(spec.validate(), Ok(()));
        let spec = DeviceSpec {
            id: Some(0),
            size_bytes: 512,
            ..null_device_with(|s| (s.block_size, s.queue_depth) = (512, 1))
        };
        assert_eq!(spec.validate(), Ok(()));
    }

    #[test]
    fn validate_names_the_field_that_breaks_a_limit() {
        let cases: [(DeviceSpec, &str); 9] = [
            (DeviceSpec { id: Some(MAX_DEVICE_ID + 1), ..null_device() }, "id"),
            (null_device_with(|s| s.queues = 0), "queues"),
            (null_device_with(|s| s.queues = 65), "queues"),
            (null_device_with(|s| s.queue_depth = 4097), "queue_depth"),
            (null_device_with(|s| s.block_size = 1000), "block_size"),
            (null_device_with(|s| s.block_size = 8192), "block_size"),
            (null_device_with(|s| (s.threads, s.queue_depth) = (3, 2)), "threads"),
            (DeviceSpec { size_bytes: 0, ..null_device() }, "size"),
            (DeviceSpec { size_bytes: MAX_SIZE_BYTES + 4096, ..null_device() }, "size"),
        ];
        for (spec, field) in cases {
            assert_eq!(field_of(&spec), Some(field), "{spec:?}");
        }
    }

    #[test]
    fn validate_checks_loop_file_exists_and_is_not_a_directory() {
        let missing = DeviceSpec {
            target: TargetSpec::Loop {
                file: PathBuf::from("/nonexistent/ublkd-config-test.img"),
                direct: true,
                zero_copy: None,
            },
            ..null_device()
        };
        let error = missing.validate().err();
        assert!(
            matches!(&error, Some(e) if e.field == "file" && e.problem.contains("does not exist"))
        );
        let directory = DeviceSpec {
            target: TargetSpec::Loop { file: std::env::temp_dir(), direct: true, zero_copy: None },
            ..null_device()
        };
        let error = directory.validate().err();
        assert!(
            matches!(&error, Some(e) if e.field == "file" && e.problem.contains("is a directory"))
        );
    }

    #[test]
    fn size_hint_suggests_neighbouring_multiples() {
        let error = check_size(5000, 4096).err().map(|e| e.problem);
        assert_eq!(
            error.as_deref(),
            Some("5000 is not a multiple of block_size 4096; round it to 4096 or 8192")
        );
    }
}
