//! What survives a crash of the supervisor: one directory per device under the state
//! dir (`/run/ublkd/devices/<id>/`, on tmpfs), holding
//!
//! - `device.json`: the device's description ([`DeviceRecord`]), written before the
//!   device is started and removed after it is deleted;
//! - `shm`: its shared-memory region (a file, not a memfd, so it outlives the process);
//! - `memory`: the memory target's data.
//!
//! A new supervisor adopts a device only if its record is here AND the kernel's
//! `ublksrv_flags` for that id carry [`OWNER_TAG`]: devices of other servers are never
//! touched.
//!
//! The directory is root's alone: ublkd refuses to start on a state dir that is a
//! symlink, not its own or writable by others ([`StateDir::check`]), opens nothing in it
//! through a symlink (`O_NOFOLLOW`, and each device's directory checked), creates its
//! temporary files exclusively, and reads records of a bounded size.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use ublkd_config::{
    DeviceAttrs, DeviceSettings, DeviceSpec, NbdUri, RbdSpec, TargetSpec, check_name,
};

use crate::nbd::{BlockSizes, ExportInfo};
use crate::worker::AttachClaim;
use ublkd_proto::msg::{LayerSet, SandboxLayer};

/// Stored in each device's `ublksrv_flags` (kept verbatim by the kernel): "ublkd",
/// then the record format version.
pub const OWNER_TAG: u64 = u64::from_be_bytes(*b"ublkd\0\0\x01");

/// Errors reading or writing the state dir.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot write {}: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{} is not a valid device record: {what}", path.display())]
    Corrupt { path: PathBuf, what: String },
    #[error("not enough room in {} for a {size}-byte memory device ({free} bytes free)", dir.display())]
    NoRoom { dir: PathBuf, size: u64, free: u64 },
    #[error(
        "{} is not safe for ublkd's state: {why} (it must be a directory owned by uid {uid}, \
         writable by it alone; fix it, or set daemon.state_dir)",
        path.display()
    )]
    Unsafe { path: PathBuf, why: String, uid: u32 },
}

/// The largest device record read (a real one is a few hundred bytes).
pub const MAX_RECORD_BYTES: u64 = 64 * 1024;

/// Why `path` is not a directory of this process's user that only it may write, if so.
fn unsafe_dir(path: &Path) -> Option<String> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) => return Some(format!("cannot inspect it: {e}")),
    };
    let me = nix::unistd::geteuid().as_raw();
    if meta.file_type().is_symlink() {
        Some("it is a symbolic link".into())
    } else if !meta.is_dir() {
        Some("it is not a directory".into())
    } else if meta.uid() != me {
        Some(format!("it is owned by uid {}", meta.uid()))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!("its mode {:o} lets others write to it", meta.mode() & 0o7777))
    } else {
        None
    }
}

fn unsafe_error(path: &Path, why: String) -> StateError {
    StateError::Unsafe { path: path.to_path_buf(), why, uid: nix::unistd::geteuid().as_raw() }
}

/// A named device's udev properties (`UBLKD_NAME=NAME`), in its directory: the
/// package's udev rule (`packaging/60-ublkd.rules`) imports it when the disk appears
/// and links `/dev/disk/by-id/ublk-NAME`. A file rather than a sysfs attribute: ublk
/// has no attribute the server may set, and the record is written before START_DEV
/// makes the disk, so the file is there for the disk's first uevent, and for every
/// later one (`udevadm trigger`) while the device lives, whatever ublkd does.
pub const UDEV_FILE: &str = "udev.env";

/// A device as it was created, enough to serve it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    pub id: u32,
    pub target: String,
    pub file: Option<PathBuf>,
    pub direct: bool,
    /// Loop and nbd, as decided at creation; absent in records written before zero
    /// copy existed (those devices copy). Records of nbd devices made before nbd had
    /// zero copy carry `false`, which is what they do: the format needs no new version.
    #[serde(default)]
    pub zero_copy: bool,
    pub size_bytes: u64,
    pub queues: u16,
    pub queue_depth: u16,
    pub block_size: u32,
    pub threads: u16,
    pub sandbox: bool,
    #[serde(default)]
    pub sandbox_optional: Vec<SandboxLayer>,
    /// An nbd device's export, as its URI.
    #[serde(default)]
    pub uri: Option<String>,
    /// What an nbd device's export was when the device was made (the kernel was told
    /// of its features and limits): a later ublkd refuses a server that comes back
    /// without them, as this one does. Absent in older records and for other targets.
    #[serde(default)]
    pub export: Option<ExportRecord>,
    /// An rbd device's image and credentials' places.
    #[serde(default)]
    pub rbd: Option<RbdSpec>,
    /// The RADOS clients of an rbd device's workers, newest last (at most
    /// `MAX_FENCED_CLIENTS`): a later worker, of this ublkd or the next, may break
    /// the image's lock only if one of these holds it.
    #[serde(default)]
    pub rbd_clients: Vec<String>,
    /// The device's name (`DeviceAttrs`), kept so that a restarted ublkd knows the
    /// device by it. Absent in older records, as are the two below (then off, which is
    /// what those devices were).
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub partitions: bool,
}

/// The part of an NBD export's description that the kernel device was made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportRecord {
    pub size: u64,
    pub transmission_flags: u16,
    /// Minimum, preferred and maximum, if the server advertised them.
    pub block_sizes: Option<[u32; 3]>,
}

impl From<&ExportInfo> for ExportRecord {
    fn from(info: &ExportInfo) -> Self {
        ExportRecord {
            size: info.size,
            transmission_flags: info.transmission_flags,
            block_sizes: info.block_sizes.map(|b| [b.min, b.preferred, b.max]),
        }
    }
}

impl ExportRecord {
    /// The export as a reconnection compares it (what the session negotiated beyond
    /// these, structured replies and TLS, is learnt again at each connection).
    pub fn info(&self) -> ExportInfo {
        ExportInfo {
            size: self.size,
            transmission_flags: self.transmission_flags,
            block_sizes: self.block_sizes.map(|[min, preferred, max]| BlockSizes {
                min,
                preferred,
                max,
            }),
            structured_replies: false,
            tls: false,
            export_name_option: false,
        }
    }
}

impl DeviceRecord {
    pub fn new(id: u32, spec: &DeviceSpec) -> Self {
        let (file, direct) = match &spec.target {
            TargetSpec::Loop { file, direct, .. } => (Some(file.clone()), *direct),
            _ => (None, false),
        };
        // Decided by then (`target::decide_zero_copy`): unset reads as copying.
        let zero_copy = spec.target.zero_copy().unwrap_or(false);
        DeviceRecord {
            id,
            target: spec.target.name().to_string(),
            file,
            direct,
            zero_copy,
            size_bytes: spec.size_bytes,
            queues: spec.settings.queues,
            queue_depth: spec.settings.queue_depth,
            block_size: spec.settings.block_size,
            threads: spec.settings.threads,
            sandbox: spec.settings.sandbox,
            sandbox_optional: spec.settings.sandbox_optional.layers(),
            uri: crate::nbd::export_uri(spec).map(ToString::to_string),
            export: None,
            rbd: match &spec.target {
                TargetSpec::Rbd(rbd) => Some(rbd.clone()),
                _ => None,
            },
            rbd_clients: Vec::new(),
            name: spec.attrs.name.clone(),
            read_only: spec.attrs.read_only,
            partitions: spec.attrs.partitions,
        }
    }

    /// The spec again. Limits are not rechecked against the file (it may be missing
    /// now, which the recovery then reports), only the shape.
    pub fn spec(&self) -> Result<DeviceSpec, String> {
        let target = match (self.target.as_str(), &self.file) {
            ("null", None) => TargetSpec::Null,
            ("memory", None) => TargetSpec::Memory,
            ("nbd", None) => {
                let text = self.uri.as_deref().ok_or("an nbd device without its uri")?;
                let uri = NbdUri::parse(text).map_err(|e| format!("its uri: {e}"))?;
                TargetSpec::Nbd { uri, zero_copy: Some(self.zero_copy) }
            }
            ("rbd", None) => {
                TargetSpec::Rbd(self.rbd.clone().ok_or("an rbd device without its image")?)
            }
            ("loop", Some(file)) => TargetSpec::Loop {
                file: file.clone(),
                direct: self.direct,
                zero_copy: Some(self.zero_copy),
            },
            (t, f) => return Err(format!("target {t:?} with file {f:?} is not a valid pair")),
        };
        if self.queues == 0 || self.queue_depth == 0 || self.threads == 0 || self.size_bytes == 0 {
            return Err("a zero queue count, depth, thread count or size".into());
        }
        // A record is the supervisor's own, but the state dir outlives versions: the
        // name is checked as an add's would be.
        if let Some(name) = &self.name {
            check_name(name).map_err(|e| format!("its {e}"))?;
        }
        Ok(DeviceSpec {
            id: Some(self.id),
            target,
            size_bytes: self.size_bytes,
            settings: DeviceSettings {
                queues: self.queues,
                queue_depth: self.queue_depth,
                block_size: self.block_size,
                threads: self.threads,
                sandbox: self.sandbox,
                sandbox_optional: LayerSet::of(&self.sandbox_optional),
            },
            attrs: DeviceAttrs {
                name: self.name.clone(),
                read_only: self.read_only,
                partitions: self.partitions,
            },
        })
    }
}

/// The state dir.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: &Path) -> Self {
        StateDir { root: root.to_path_buf() }
    }

    fn devices(&self) -> PathBuf {
        self.root.join("devices")
    }

    fn dir(&self, id: u32) -> PathBuf {
        self.devices().join(id.to_string())
    }

    /// Where deletes under way keep the directories they set aside.
    fn deleting(&self) -> PathBuf {
        self.root.join("deleting")
    }

    /// Moves device `id`'s directory out of the id's place, just before the device is
    /// deleted from the kernel (which may then give the id to a new device at once): a
    /// delete that finishes after a new device took the id must neither remove that
    /// device's record nor make its creation find the old one. `None` if there was no
    /// directory; an error leaves it in place.
    pub fn set_aside(&self, id: u32) -> Result<Option<PathBuf>, StateError> {
        let from = self.dir(id);
        if std::fs::symlink_metadata(&from).is_err() {
            return Ok(None);
        }
        let deleting = self.deleting();
        match std::fs::DirBuilder::new().mode(0o700).create(&deleting) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(StateError::Write { path: deleting, source }),
        }
        if let Some(why) = unsafe_dir(&deleting) {
            return Err(unsafe_error(&deleting, why));
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let to = deleting.join(format!("{id}.{nanos}"));
        std::fs::rename(&from, &to)
            .map_err(|source| StateError::Write { path: to.clone(), source })?;
        Ok(Some(to))
    }

    /// Puts a directory [`Self::set_aside`] moved back in device `id`'s place (its
    /// delete failed: the device stays, and so must its record).
    pub fn put_back(&self, aside: &Path, id: u32) {
        if let Err(e) = std::fs::rename(aside, self.dir(id)) {
            tracing::error!(
                dev_id = id,
                "cannot put device {id}'s record back from {}: {e}",
                aside.display()
            );
        }
    }

    /// Removes a directory [`Self::set_aside`] moved (its device is deleted).
    pub fn forget_aside(&self, aside: &Path) {
        let _ = std::fs::remove_dir_all(aside);
    }

    /// At start: the directories of deletes a previous ublkd did not finish (it died
    /// between setting one aside and its end). One whose id's place is free goes back
    /// there, so that its device (if the kernel still has it) is adopted as any other:
    /// the operator's delete is lost, never the device. One whose id a newer device
    /// has taken is stale and removed. Returns the ids put back.
    pub fn recover_set_aside(&self) -> Vec<u32> {
        let Ok(entries) = std::fs::read_dir(self.deleting()) else { return Vec::new() };
        let mut back = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let id = name.split('.').next().and_then(|id| id.parse::<u32>().ok());
            match id {
                Some(id) if std::fs::symlink_metadata(self.dir(id)).is_err() => {
                    if std::fs::rename(&path, self.dir(id)).is_ok() {
                        back.push(id);
                    }
                }
                _ => self.forget_aside(&path),
            }
        }
        back
    }

    /// Checks (at start) that the state dir and its `devices` directory are this user's
    /// alone, creating `devices` if missing.
    pub fn check(&self) -> Result<(), StateError> {
        if let Some(why) = unsafe_dir(&self.root) {
            return Err(unsafe_error(&self.root, why));
        }
        let devices = self.devices();
        match std::fs::DirBuilder::new().mode(0o700).create(&devices) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(StateError::Write { path: devices, source }),
        }
        match unsafe_dir(&devices) {
            Some(why) => Err(unsafe_error(&devices, why)),
            None => Ok(()),
        }
    }

    fn make_dir(&self, id: u32) -> Result<PathBuf, StateError> {
        let dir = self.dir(id);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|source| StateError::Write { path: dir.clone(), source })?;
        // A directory planted in its place (a symlink out of the state dir) is refused.
        if let Some(why) = unsafe_dir(&dir) {
            return Err(unsafe_error(&dir, why));
        }
        Ok(dir)
    }

    /// Writes the record atomically (a temp file, created exclusively, renamed over the
    /// old one), and beside it what udev reads of a named device ([`UDEV_FILE`]).
    pub fn write_record(&self, rec: &DeviceRecord) -> Result<(), StateError> {
        self.write_json(rec.id, "device.json", rec)?;
        match &rec.name {
            // `check_name`'s charset: nothing in it needs quoting for udev.
            Some(name) => self.write_file(rec.id, UDEV_FILE, format!("UBLKD_NAME={name}\n")),
            None => {
                let _ = std::fs::remove_file(self.dir(rec.id).join(UDEV_FILE));
                Ok(())
            }
        }
    }

    /// Records the worker that serves device `claim.dev_id`, for the next ublkd to take
    /// over (see [`crate::worker::Worker::attach`]).
    pub fn write_worker_claim(&self, claim: &AttachClaim) -> Result<(), StateError> {
        self.write_json(claim.dev_id, "worker.json", claim)
    }

    /// The last worker recorded for device `id`, if any: it may have ended since.
    pub fn worker_claim(&self, id: u32) -> Result<Option<AttachClaim>, StateError> {
        let path = self.devices().join(id.to_string()).join("worker.json");
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok(None);
        }
        let claim: AttachClaim = Self::read_json(&path)?;
        if claim.dev_id != id {
            let what = format!("it names device {} in device {id}'s directory", claim.dev_id);
            return Err(StateError::Corrupt { path, what });
        }
        Ok(Some(claim))
    }

    /// Writes `name` in device `id`'s directory, whole or not at all.
    fn write_json(&self, id: u32, name: &str, value: &impl Serialize) -> Result<(), StateError> {
        let text = serde_json::to_string_pretty(value).expect("plain data always serializes");
        self.write_file(id, name, text)
    }

    /// Writes `text` as `name` in device `id`'s directory, whole or not at all.
    fn write_file(&self, id: u32, name: &str, text: String) -> Result<(), StateError> {
        let dir = self.make_dir(id)?;
        let path = dir.join(name);
        let tmp = dir.join(format!("{name}.tmp"));
        // A stale temp file (or anything planted under its name) goes first: unlink
        // never follows a symlink.
        let _ = std::fs::remove_file(&tmp);
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| StateError::Write { path, source })
    }

    /// Reads one JSON file: never through a symlink, never more than
    /// [`MAX_RECORD_BYTES`].
    fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, StateError> {
        let read_err = |source| StateError::Read { path: path.to_path_buf(), source };
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(read_err)?;
        let mut text = String::new();
        file.take(MAX_RECORD_BYTES + 1).read_to_string(&mut text).map_err(read_err)?;
        let corrupt = |what: String| StateError::Corrupt { path: path.to_path_buf(), what };
        if text.len() as u64 > MAX_RECORD_BYTES {
            return Err(corrupt(format!("it is larger than {MAX_RECORD_BYTES} bytes")));
        }
        serde_json::from_str::<T>(&text).map_err(|e| corrupt(e.to_string()))
    }

    /// Every record in the state dir (a corrupt one is an error in its place).
    pub fn records(&self) -> Vec<Result<DeviceRecord, StateError>> {
        let Ok(entries) = std::fs::read_dir(self.devices()) else { return Vec::new() };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path().join("device.json");
            if let Some(why) = unsafe_dir(&entry.path()) {
                out.push(Err(unsafe_error(&entry.path(), why)));
                continue;
            }
            if std::fs::symlink_metadata(&path).is_err() {
                continue;
            }
            let rec = Self::read_json::<DeviceRecord>(&path).and_then(|rec| {
                let named = entry.file_name().to_string_lossy() == rec.id.to_string();
                if named {
                    Ok(rec)
                } else {
                    Err(StateError::Corrupt {
                        path: path.clone(),
                        what: format!(
                            "it describes device {} but sits in another device's directory",
                            rec.id
                        ),
                    })
                }
            });
            out.push(rec);
        }
        out
    }

    fn open(&self, id: u32, name: &str) -> Result<File, StateError> {
        let path = self.make_dir(id)?.join(name);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|source| StateError::Write { path, source })
    }

    /// The device's shared-region file (created empty if missing).
    pub fn shm_file(&self, id: u32) -> Result<File, StateError> {
        self.open(id, "shm")
    }

    /// A new, empty shared-region file in place of the device's old one, which is
    /// unlinked, not truncated: a worker of an older ublkd may still have the old one
    /// mapped and write its own layout there until it is killed, and those writes
    /// must not land in the new region.
    pub fn fresh_shm_file(&self, id: u32) -> Result<File, StateError> {
        let path = self.make_dir(id)?.join("shm");
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(StateError::Write { path, source }),
        }
        self.open(id, "shm")
    }

    /// The memory target's data file, `size` bytes (sparse; created if missing, kept
    /// if it exists: that is the data of a device being adopted).
    pub fn memory_file(&self, id: u32, size: u64) -> Result<File, StateError> {
        let path = self.dir(id).join("memory");
        if !path.exists() {
            let free = free_bytes(&self.root).unwrap_or(u64::MAX);
            if free < size {
                return Err(StateError::NoRoom { dir: self.root.clone(), size, free });
            }
        }
        let file = self.open(id, "memory")?;
        let len = file
            .metadata()
            .map_err(|source| StateError::Read { path: path.clone(), source })?
            .len();
        if len != size {
            file.set_len(size).map_err(|source| StateError::Write { path, source })?;
        }
        Ok(file)
    }

    /// Forgets a deleted device.
    pub fn remove(&self, id: u32) {
        let _ = std::fs::remove_dir_all(self.dir(id));
    }
}

fn free_bytes(path: &Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(path).ok()?;
    Some(st.blocks_available().saturating_mul(st.fragment_size()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp() -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "ublkd-state-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
        ));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    fn spec() -> DeviceSpec {
        DeviceSpec {
            id: None,
            target: TargetSpec::Memory,
            size_bytes: 1 << 20,
            settings: DeviceSettings {
                queues: 1,
                queue_depth: 16,
                block_size: 4096,
                threads: 1,
                sandbox: true,
                // Kept in the record: an adopted device keeps its opt-in.
                sandbox_optional: LayerSet::of(&[SandboxLayer::UserNamespace]),
            },
            attrs: DeviceAttrs::default(),
        }
    }

    /// A restarted ublkd knows a device by its name, read-only and partitions as made;
    /// a record from before they existed reads as a device without them; a record
    /// with a name no add would take is refused.
    #[test]
    fn a_name_and_the_attributes_round_trip_and_older_records_have_none() {
        let mut named = spec();
        named.attrs = DeviceAttrs { name: Some("db-1".into()), read_only: true, partitions: true };
        let rec = DeviceRecord::new(3, &named);
        let text = serde_json::to_string(&rec).unwrap();
        let back: DeviceRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(back.spec().unwrap().attrs, named.attrs);
        let mut older: serde_json::Value = serde_json::from_str(&text).unwrap();
        for key in ["name", "read_only", "partitions"] {
            older.as_object_mut().unwrap().remove(key);
        }
        let older: DeviceRecord = serde_json::from_value(older).unwrap();
        assert_eq!(older.spec().unwrap().attrs, DeviceAttrs::default());
        // What udev reads, there while the device is named.
        let root = tmp();
        let state = StateDir::new(&root);
        state.write_record(&rec).unwrap();
        let udev = root.join("devices/3").join(UDEV_FILE);
        assert_eq!(std::fs::read_to_string(&udev).unwrap(), "UBLKD_NAME=db-1\n");
        state.write_record(&DeviceRecord::new(3, &spec())).unwrap();
        assert!(!udev.exists(), "an unnamed device's udev file is left");
        let _ = std::fs::remove_dir_all(root);
        let bad = DeviceRecord { name: Some("../x".into()), ..rec };
        assert!(bad.spec().unwrap_err().contains("name"), "{:?}", bad.spec());
    }

    #[test]
    fn a_fresh_region_file_is_not_written_through_the_old_ones_handle() {
        let root = tmp();
        let state = StateDir::new(&root);
        let mut old = state.shm_file(3).unwrap();
        old.write_all(b"old layout").unwrap();
        let fresh = state.fresh_shm_file(3).unwrap();
        assert_eq!(fresh.metadata().unwrap().len(), 0, "the old region's bytes are in the new");
        // An old worker writing on through its mapping of the old file.
        old.write_all(b" and more").unwrap();
        assert_eq!(std::fs::read(state.dir(3).join("shm")).unwrap(), b"");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_worker_claim_round_trips_and_one_in_another_devices_directory_is_refused() {
        let root = tmp();
        let state = StateDir::new(&root);
        assert_eq!(state.worker_claim(3).unwrap(), None);
        let sandbox = ublkd_proto::msg::SandboxReport {
            namespaces: vec!["user".into(), "net".into()],
            missing: Vec::new(),
            landlock_abi: Some(6),
        };
        let claim = AttachClaim {
            dev_id: 3,
            pid: 42,
            start_time: 7,
            generation: 2,
            held: vec![9, 10],
            sandbox: Some(sandbox),
            rbd_clients: vec!["127.0.0.1:0/7".into()],
        };
        state.write_worker_claim(&claim).unwrap();
        assert_eq!(state.worker_claim(3).unwrap(), Some(claim.clone()));
        // A claim from before the sandbox was recorded still reads, without one.
        std::fs::write(
            root.join("devices/3/worker.json"),
            r#"{"dev_id":3,"pid":42,"start_time":7,"generation":2,"held":[9,10]}"#,
        )
        .unwrap();
        assert_eq!(
            state.worker_claim(3).unwrap(),
            Some(AttachClaim { sandbox: None, rbd_clients: Vec::new(), ..claim.clone() })
        );
        std::fs::create_dir_all(root.join("devices/4")).unwrap();
        std::fs::copy(root.join("devices/3/worker.json"), root.join("devices/4/worker.json"))
            .unwrap();
        let err = state.worker_claim(4).unwrap_err().to_string();
        assert!(err.contains("it names device 3 in device 4's directory"), "{err}");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn records_round_trip_and_come_back_with_their_id() {
        let root = tmp();
        let state = StateDir::new(&root);
        let rec = DeviceRecord::new(5, &spec());
        state.write_record(&rec).unwrap();
        let got: Vec<DeviceRecord> = state.records().into_iter().map(Result::unwrap).collect();
        assert_eq!(got, std::slice::from_ref(&rec));
        assert_eq!(rec.spec().unwrap().id, Some(5));
        state.remove(5);
        assert!(state.records().is_empty());
        let _ = std::fs::remove_dir_all(root);
    }

    /// An nbd device's record keeps its export's description for the next ublkd; a
    /// record written before it existed still reads, with none.
    #[test]
    fn an_export_description_round_trips_and_older_records_have_none() {
        let root = tmp();
        let state = StateDir::new(&root);
        let info = ExportInfo {
            size: 1 << 30,
            transmission_flags: 0x4d,
            block_sizes: Some(BlockSizes { min: 512, preferred: 4096, max: 1 << 25 }),
            structured_replies: true,
            tls: false,
            export_name_option: false,
        };
        let rec = DeviceRecord {
            export: Some(ExportRecord::from(&info)),
            ..DeviceRecord::new(6, &spec())
        };
        state.write_record(&rec).unwrap();
        let got = state.records().pop().unwrap().unwrap();
        let back = got.export.expect("the export's description").info();
        assert_eq!(
            (back.size, back.transmission_flags, back.block_sizes),
            (info.size, info.transmission_flags, info.block_sizes)
        );
        let text = serde_json::to_string(&DeviceRecord::new(6, &spec())).unwrap();
        let older = text.replace(",\"export\":null", "");
        assert!(!older.contains("export"), "{older}");
        let older: DeviceRecord = serde_json::from_str(&older).unwrap();
        assert_eq!(older.export, None);
        let _ = std::fs::remove_dir_all(root);
    }

    /// A delete sets its device's directory aside before the kernel may reuse the id:
    /// a new device with that id then finds its place free, and the old delete's end
    /// never touches it; a failed delete puts the record back; one cut short by a
    /// crash is put back at the next start, unless the id's place is taken.
    #[test]
    fn a_delete_sets_its_record_aside_so_a_new_device_may_take_the_id() {
        let root = tmp();
        let state = StateDir::new(&root);
        state.write_record(&DeviceRecord::new(3, &spec())).unwrap();
        let aside = state.set_aside(3).unwrap().expect("a directory to set aside");
        assert!(state.records().is_empty());
        // The kernel gave id 3 to a new device meanwhile.
        let newer = DeviceRecord { size_bytes: 2 << 20, ..DeviceRecord::new(3, &spec()) };
        state.write_record(&newer).unwrap();
        state.forget_aside(&aside);
        let left: Vec<DeviceRecord> = state.records().into_iter().map(Result::unwrap).collect();
        assert_eq!(left, std::slice::from_ref(&newer));

        // A failed delete: the record goes back.
        let aside = state.set_aside(3).unwrap().unwrap();
        state.put_back(&aside, 3);
        assert_eq!(state.records().len(), 1);
        assert_eq!(state.set_aside(9).unwrap(), None, "nothing to set aside");

        // Cut short by a crash: back at the next start if the place is free, else
        // forgotten.
        let aside = state.set_aside(3).unwrap().unwrap();
        assert_eq!(state.recover_set_aside(), [3]);
        assert!(!aside.exists());
        let stale = state.set_aside(3).unwrap().unwrap();
        state.write_record(&DeviceRecord::new(3, &spec())).unwrap();
        assert_eq!(state.recover_set_aside(), Vec::<u32>::new());
        assert!(!stale.exists(), "a stale set-aside directory was kept");
        assert_eq!(state.records().len(), 1);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_corrupt_or_misplaced_record_is_reported_not_adopted() {
        let root = tmp();
        let state = StateDir::new(&root);
        std::fs::create_dir_all(root.join("devices/3")).unwrap();
        std::fs::write(root.join("devices/3/device.json"), "{not json").unwrap();
        let mut rec = DeviceRecord::new(4, &spec());
        state.write_record(&rec).unwrap();
        rec.id = 9;
        std::fs::write(root.join("devices/4/device.json"), serde_json::to_string(&rec).unwrap())
            .unwrap();
        let results = state.records();
        assert_eq!(results.len(), 2);
        assert!(results.iter().all(Result::is_err), "{results:?}");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn symlinks_and_oversized_records_in_the_state_dir_are_refused() {
        let root = tmp();
        let state = StateDir::new(&root);
        state.check().unwrap();
        // A device directory that is a symlink out of the state dir.
        let elsewhere = tmp();
        std::os::unix::fs::symlink(&elsewhere, root.join("devices/2")).unwrap();
        assert!(matches!(state.shm_file(2), Err(StateError::Unsafe { .. })));
        assert!(matches!(
            state.write_record(&DeviceRecord::new(2, &spec())),
            Err(StateError::Unsafe { .. })
        ));
        assert!(!elsewhere.join("device.json").exists(), "a record was written through it");
        // A region file that is a symlink.
        std::fs::create_dir_all(root.join("devices/3")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", root.join("devices/3/shm")).unwrap();
        assert!(state.shm_file(3).is_err(), "opened a region through a symlink");
        // A huge record.
        std::fs::create_dir_all(root.join("devices/4")).unwrap();
        std::fs::write(root.join("devices/4/device.json"), vec![b' '; 100_000]).unwrap();
        // devices/2 (a symlink) and devices/4 (too large); devices/3 has no record.
        let results = state.records();
        assert_eq!(results.len(), 2, "{results:?}");
        assert!(results.iter().all(Result::is_err), "{results:?}");
        let text = format!("{results:?}");
        assert!(text.contains("larger than 65536 bytes"), "{text}");
        let _ = std::fs::remove_dir_all(root);
        let _ = std::fs::remove_dir_all(elsewhere);
    }

    #[test]
    fn a_state_dir_others_may_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let root = tmp();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = StateDir::new(&root).check().unwrap_err().to_string();
        assert!(err.contains("its mode 777 lets others write to it"), "{err}");
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
        StateDir::new(&root).check().unwrap();
        let link = root.with_extension("link");
        std::os::unix::fs::symlink(&root, &link).unwrap();
        let err = StateDir::new(&link).check().unwrap_err().to_string();
        assert!(err.contains("it is a symbolic link"), "{err}");
        let _ = std::fs::remove_file(link);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn memory_data_is_kept_across_reopen() {
        let root = tmp();
        let state = StateDir::new(&root);
        let f = state.memory_file(1, 8192).unwrap();
        std::os::unix::fs::FileExt::write_at(&f, b"hello", 4096).unwrap();
        drop(f);
        let f = state.memory_file(1, 8192).unwrap();
        let mut buf = [0u8; 5];
        std::os::unix::fs::FileExt::read_at(&f, &mut buf, 4096).unwrap();
        assert_eq!(&buf, b"hello");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_record_with_an_impossible_shape_is_refused() {
        let mut rec = DeviceRecord::new(1, &spec());
        rec.file = Some("/x".into());
        assert!(rec.spec().is_err());
        let mut rec = DeviceRecord::new(1, &spec());
        rec.queue_depth = 0;
        assert!(rec.spec().is_err());
        let mut rec = DeviceRecord::new(1, &spec());
        rec.target = "nbd".into();
        assert_eq!(rec.spec().unwrap_err(), "an nbd device without its uri");
        rec.uri = Some("nbds://host/x".into());
        assert!(rec.spec().unwrap_err().contains("needs tls-certificates=DIR"));
    }

    #[test]
    fn an_nbd_record_keeps_its_export() {
        let mut spec = spec();
        let uri = NbdUri::parse("nbd+unix:///disk?socket=/run/nbd.sock").unwrap();
        spec.target = TargetSpec::Nbd { uri: uri.clone(), zero_copy: Some(false) };
        let rec = DeviceRecord::new(6, &spec);
        assert_eq!(rec.uri.as_deref(), Some("nbd+unix:///disk?socket=/run/nbd.sock"));
        assert_eq!(rec.spec().unwrap().target, spec.target);
    }

    /// A zero-copy nbd device's record says so, through a write and a read; a record
    /// without `zero_copy` (written before zero copy existed) reads as copying.
    #[test]
    fn an_nbd_records_zero_copy_round_trips_and_older_records_copy() {
        let root = tmp();
        let state = StateDir::new(&root);
        let uri = NbdUri::parse("nbd://127.0.0.1/disk").unwrap();
        let mut spec = spec();
        spec.target = TargetSpec::Nbd { uri: uri.clone(), zero_copy: Some(true) };
        state.write_record(&DeviceRecord::new(7, &spec)).unwrap();
        let got = state.records().pop().unwrap().unwrap();
        assert!(got.zero_copy);
        assert_eq!(got.spec().unwrap().target, spec.target);

        let text = serde_json::to_string(&DeviceRecord::new(7, &spec)).unwrap();
        let older = text.replace(",\"zero_copy\":true", "");
        assert!(!older.contains("zero_copy"), "{older}");
        let older: DeviceRecord = serde_json::from_str(&older).unwrap();
        assert_eq!(older.spec().unwrap().target, TargetSpec::Nbd { uri, zero_copy: Some(false) });
        let _ = std::fs::remove_dir_all(root);
    }
}
