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

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use ublkd_config::{DeviceSpec, TargetSpec};
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
}

/// A device as it was created, enough to serve it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    pub id: u32,
    pub target: String,
    pub file: Option<PathBuf>,
    pub direct: bool,
    /// Loop only, as decided at creation; absent in records written before zero copy
    /// existed (those devices copy).
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
}

impl DeviceRecord {
    pub fn new(id: u32, spec: &DeviceSpec) -> Self {
        let (file, direct, zero_copy) = match &spec.target {
            TargetSpec::Loop { file, direct, zero_copy } => {
                (Some(file.clone()), *direct, zero_copy.unwrap_or(false))
            }
            _ => (None, false, false),
        };
        DeviceRecord {
            id,
            target: spec.target.name().to_string(),
            file,
            direct,
            zero_copy,
            size_bytes: spec.size_bytes,
            queues: spec.queues,
            queue_depth: spec.queue_depth,
            block_size: spec.block_size,
            threads: spec.threads,
            sandbox: spec.sandbox,
            sandbox_optional: spec.sandbox_optional.layers(),
        }
    }

    /// The spec again. Limits are not rechecked against the file (it may be missing
    /// now, which the recovery then reports), only the shape.
    pub fn spec(&self) -> Result<DeviceSpec, String> {
        let target = match (self.target.as_str(), &self.file) {
            ("null", None) => TargetSpec::Null,
            ("memory", None) => TargetSpec::Memory,
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
        Ok(DeviceSpec {
            id: Some(self.id),
            target,
            size_bytes: self.size_bytes,
            queues: self.queues,
            queue_depth: self.queue_depth,
            block_size: self.block_size,
            threads: self.threads,
            sandbox: self.sandbox,
            sandbox_optional: LayerSet::of(&self.sandbox_optional),
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

    fn make_dir(&self, id: u32) -> Result<PathBuf, StateError> {
        let dir = self.dir(id);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|source| StateError::Write { path: dir.clone(), source })?;
        Ok(dir)
    }

    /// Writes the record atomically (a temp file renamed over the old one).
    pub fn write_record(&self, rec: &DeviceRecord) -> Result<(), StateError> {
        let dir = self.make_dir(rec.id)?;
        let path = dir.join("device.json");
        let tmp = dir.join("device.json.tmp");
        let text = serde_json::to_string_pretty(rec).expect("plain data always serializes");
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| StateError::Write { path, source })
    }

    /// Every record in the state dir (a corrupt one is an error in its place).
    pub fn records(&self) -> Vec<Result<DeviceRecord, StateError>> {
        let Ok(entries) = std::fs::read_dir(self.devices()) else { return Vec::new() };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path().join("device.json");
            if !path.exists() {
                continue;
            }
            let rec = std::fs::read_to_string(&path)
                .map_err(|source| StateError::Read { path: path.clone(), source })
                .and_then(|text| {
                    serde_json::from_str::<DeviceRecord>(&text).map_err(|e| StateError::Corrupt {
                        path: path.clone(),
                        what: e.to_string(),
                    })
                })
                .and_then(|rec| {
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
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|source| StateError::Write { path, source })
    }

    /// The device's shared-region file (created empty if missing).
    pub fn shm_file(&self, id: u32) -> Result<File, StateError> {
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
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: `st` is a plain struct of integers, valid zeroed.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is a valid out-pointer for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail.saturating_mul(st.f_frsize))
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
            queues: 1,
            queue_depth: 16,
            block_size: 4096,
            threads: 1,
            sandbox: true,
            // Kept in the record: an adopted device keeps its opt-in.
            sandbox_optional: LayerSet::of(&[SandboxLayer::UserNamespace]),
        }
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
    }
}
