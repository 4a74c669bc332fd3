//! One ublk device's lifecycle: ADD_DEV → SET_PARAMS → shared region and target →
//! worker (PREP) → START_DEV, and STOP_DEV → worker exit → DEL_DEV.
//!
//! The supervisor opens `/dev/ublkcN` only to hand it to the worker and closes its own
//! copy at once: any copy it kept would keep the kernel from ever starting a recovery.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ublkd_config::{DeviceSpec, TargetSpec};
use ublkd_proto::ctrl::{AUTO_DEV_ID, CtrlClient, CtrlError};
use ublkd_proto::msg::{TargetSetup, WorkerSetup};
use ublkd_proto::shm::{Geometry, ShmError, ShmRegion};
use ublkd_proto::uapi::{self, UblkParamBasic, UblkParamDiscard, UblkParams, UblksrvCtrlDevInfo};

use crate::worker::{Worker, WorkerError};

/// The largest request, and so each tag's buffer in the worker.
pub const MAX_IO_BUF_BYTES: u32 = 512 * 1024;

/// The feature flags every ublkd device is created with.
pub const DEVICE_FLAGS: u64 =
    uapi::UBLK_F_BATCH_IO | uapi::UBLK_F_USER_RECOVERY | uapi::UBLK_F_USER_RECOVERY_REISSUE;

/// How long a worker may take to PREP every tag.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a worker may take to exit when asked.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Errors in a device's lifecycle. Each names the device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Ctrl(#[from] CtrlError),
    #[error("device {id}: {source}")]
    Shm { id: u32, source: ShmError },
    #[error("device {id}: cannot create its memory target ({size} bytes): {source}")]
    Memory { id: u32, size: u64, source: io::Error },
    #[error("device {id}: cannot open its backing file {}: {source}", path.display())]
    Backing { id: u32, path: PathBuf, source: io::Error },
    #[error("device {id}: {} did not appear: {source}", path.display())]
    CharDev { id: u32, path: PathBuf, source: io::Error },
    #[error("device {id}: {source}")]
    Worker { id: u32, source: WorkerError },
}

/// A device ublkd created and serves.
#[derive(Debug)]
pub struct Device {
    pub id: u32,
    pub spec: DeviceSpec,
    shm: ShmRegion,
    shm_fd: OwnedFd,
    /// The memory target's memfd or the loop target's file, held so it outlives workers.
    target_fd: Option<OwnedFd>,
    /// Whether the loop file really is O_DIRECT (a filesystem may refuse it).
    direct: bool,
    pub worker: Option<Worker>,
    /// Why the device is not being served, when it is not.
    pub note: Option<String>,
    pub recoveries: u64,
}

impl Device {
    /// Creates, hands over and starts a device described by `spec` (already validated).
    pub fn create(
        ctrl: &CtrlClient,
        spec: &DeviceSpec,
        worker_binary: &Path,
    ) -> Result<Device, DeviceError> {
        let info = UblksrvCtrlDevInfo {
            nr_hw_queues: spec.queues,
            queue_depth: spec.queue_depth,
            max_io_buf_bytes: MAX_IO_BUF_BYTES,
            dev_id: spec.id.unwrap_or(AUTO_DEV_ID),
            flags: DEVICE_FLAGS,
            ..UblksrvCtrlDevInfo::default()
        };
        let added = ctrl.add_dev(&info)?;
        let id = added.dev_id;
        // From here on, a failure deletes the half-made device.
        match Self::finish_create(ctrl, id, spec, worker_binary) {
            Ok(dev) => Ok(dev),
            Err(e) => {
                if let Err(del) = ctrl.del_dev(id) {
                    tracing::error!(dev_id = id, "cleanup after a failed create: {del}");
                }
                Err(e)
            }
        }
    }

    fn finish_create(
        ctrl: &CtrlClient,
        id: u32,
        spec: &DeviceSpec,
        worker_binary: &Path,
    ) -> Result<Device, DeviceError> {
        ctrl.set_params(id, &params(spec))?;
        let geometry = Geometry {
            dev_id: id,
            nr_queues: spec.queues,
            queue_depth: spec.queue_depth,
            nr_threads: spec.threads,
        };
        let (shm, shm_fd) =
            ShmRegion::create(geometry).map_err(|source| DeviceError::Shm { id, source })?;
        let (target_fd, direct) = open_target(id, spec)?;
        let mut dev = Device {
            id,
            spec: spec.clone(),
            shm,
            shm_fd,
            target_fd,
            direct,
            worker: None,
            note: None,
            recoveries: 0,
        };
        let worker = dev.hand_over(worker_binary)?;
        // The kernel records the process that opened /dev/ublkcN (the supervisor, which
        // then handed the fd over) as the device's server and checks START_DEV's pid
        // against it. The worker's pid is reported separately (`ublkctl status`).
        ctrl.start_dev(id, std::process::id() as i32)?;
        tracing::info!(
            dev_id = id,
            worker_pid = worker.pid(),
            target = spec.target.name(),
            "device LIVE"
        );
        dev.worker = Some(worker);
        Ok(dev)
    }

    /// Starts a worker, gives it the device, and waits until it has PREPed every tag.
    /// The supervisor's copy of `/dev/ublkcN` is closed before this returns.
    fn hand_over(&mut self, worker_binary: &Path) -> Result<Worker, DeviceError> {
        let id = self.id;
        let generation = self.shm.bump_generation();
        self.shm.reset_worker_state();
        let ublkc = open_char_dev(id)?;
        let mut worker = Worker::spawn(worker_binary, id)
            .map_err(|source| DeviceError::Worker { id, source })?;
        let setup = WorkerSetup {
            dev_id: id,
            size_bytes: self.spec.size_bytes,
            nr_queues: self.spec.queues,
            queue_depth: self.spec.queue_depth,
            max_io_buf_bytes: MAX_IO_BUF_BYTES,
            nr_threads: self.spec.threads,
            generation,
            target: match &self.spec.target {
                TargetSpec::Null => TargetSetup::Null,
                TargetSpec::Memory => TargetSetup::Memory,
                TargetSpec::Loop { .. } => TargetSetup::Loop { direct: self.direct },
            },
            block_size: self.spec.block_size,
        };
        let mut fds: Vec<BorrowedFd<'_>> = vec![ublkc.as_fd(), self.shm_fd.as_fd()];
        if let Some(fd) = &self.target_fd {
            fds.push(fd.as_fd());
        }
        let sent = worker.send_setup(&setup, &fds);
        // Close our copy now: only the worker may hold /dev/ublkcN.
        drop(fds);
        drop(ublkc);
        let ready = sent.and_then(|()| worker.wait_ready(READY_TIMEOUT));
        if let Err(source) = ready {
            let how = worker.reap(Duration::from_millis(100));
            tracing::error!(dev_id = id, "worker failed ({how}): {source}");
            return Err(DeviceError::Worker { id, source });
        }
        Ok(worker)
    }

    /// Stops and deletes the device: STOP_DEV, the worker's exit, DEL_DEV (which waits
    /// for `/dev/ublkcN` to be released).
    pub fn destroy(mut self, ctrl: &CtrlClient) -> Result<(), DeviceError> {
        let id = self.id;
        let stopped = ctrl.stop_dev(id);
        if let Some(worker) = self.worker.take() {
            let pid = worker.pid();
            let how = worker.stop(STOP_GRACE);
            tracing::info!(dev_id = id, worker_pid = pid, "worker ended: {how}");
        }
        let deleted = ctrl.del_dev(id);
        stopped?;
        deleted?;
        tracing::info!(dev_id = id, "device deleted");
        Ok(())
    }

    pub fn shm(&self) -> &ShmRegion {
        &self.shm
    }

    /// Whether the worker exited, reaping it and recording why.
    pub fn check_worker(&mut self) {
        if let Some(w) = &mut self.worker
            && let Some(how) = w.exited()
        {
            tracing::error!(dev_id = self.id, worker_pid = w.pid(), "worker exited: {how}");
            self.note = Some(format!("worker {} exited ({how})", w.pid()));
            self.worker = None;
        }
    }
}

/// The kernel parameters for `spec`.
pub fn params(spec: &DeviceSpec) -> UblkParams {
    let bs_shift = spec.block_size.trailing_zeros() as u8;
    let mut types = uapi::UBLK_PARAM_TYPE_BASIC | uapi::UBLK_PARAM_TYPE_DISCARD;
    // A loop file has a write-back cache (the page cache, or the disk's own): FLUSH and
    // FUA must reach the target. RAM and null have nothing to flush.
    let attrs = match spec.target {
        TargetSpec::Loop { .. } => uapi::UBLK_ATTR_VOLATILE_CACHE | uapi::UBLK_ATTR_FUA,
        TargetSpec::Null | TargetSpec::Memory => 0,
    };
    let max_sectors = MAX_IO_BUF_BYTES >> 9;
    let discard = UblkParamDiscard {
        discard_alignment: 0,
        discard_granularity: spec.block_size,
        max_discard_sectors: max_sectors,
        max_write_zeroes_sectors: max_sectors,
        max_discard_segments: 1,
        reserved0: 0,
    };
    if discard.max_discard_sectors == 0 {
        types &= !uapi::UBLK_PARAM_TYPE_DISCARD;
    }
    UblkParams {
        len: 0,
        types,
        basic: UblkParamBasic {
            attrs,
            logical_bs_shift: bs_shift,
            physical_bs_shift: bs_shift.max(12),
            io_opt_shift: 12,
            io_min_shift: bs_shift,
            max_sectors,
            chunk_sectors: 0,
            dev_sectors: spec.size_bytes >> 9,
            virt_boundary_mask: 0,
        },
        discard,
        ..UblkParams::default()
    }
}

/// Opens the target's data: a sized memfd for `memory`, the backing file for `loop`
/// (O_DIRECT when asked and the filesystem allows it). Returns the fd and whether the
/// file is in direct mode.
fn open_target(id: u32, spec: &DeviceSpec) -> Result<(Option<OwnedFd>, bool), DeviceError> {
    match &spec.target {
        TargetSpec::Null => Ok((None, false)),
        TargetSpec::Memory => {
            let size = spec.size_bytes;
            let memory_err = |source| DeviceError::Memory { id, size, source };
            let name = c"ublkd-memory-target";
            // SAFETY: `name` is NUL-terminated; memfd_create has no other preconditions.
            let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
            if raw < 0 {
                return Err(memory_err(io::Error::last_os_error()));
            }
            // SAFETY: `raw` was just created and is owned by nothing else.
            let file = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
            file.set_len(size).map_err(memory_err)?;
            Ok((Some(file.into()), false))
        }
        TargetSpec::Loop { file, direct } => {
            let open = |flags: i32| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(flags | libc::O_CLOEXEC)
                    .open(file)
            };
            let backing_err = |source| DeviceError::Backing { id, path: file.clone(), source };
            if *direct {
                match open(libc::O_DIRECT) {
                    Ok(f) => return Ok((Some(f.into()), true)),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        tracing::warn!(
                            dev_id = id,
                            file = %file.display(),
                            "the filesystem refuses O_DIRECT; using buffered I/O"
                        );
                    }
                    Err(e) => return Err(backing_err(e)),
                }
            }
            Ok((Some(open(0).map_err(backing_err)?.into()), false))
        }
    }
}

/// Opens `/dev/ublkcN`, waiting briefly for the node to appear (udev or devtmpfs).
fn open_char_dev(id: u32) -> Result<File, DeviceError> {
    let path = PathBuf::from(format!("/dev/ublkc{id}"));
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut delay = Duration::from_millis(1);
    loop {
        match OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(&path) {
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_millis(100));
            }
            Err(source) => return Err(DeviceError::CharDev { id, path, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(target: TargetSpec, block_size: u32) -> DeviceSpec {
        DeviceSpec {
            id: None,
            target,
            size_bytes: 1 << 30,
            queues: 2,
            queue_depth: 64,
            block_size,
            threads: 1,
            sandbox: true,
        }
    }

    #[test]
    fn params_describe_size_block_size_and_request_limit() {
        let p = params(&spec(TargetSpec::Memory, 512));
        assert_eq!(p.basic.dev_sectors, (1 << 30) >> 9);
        assert_eq!(p.basic.logical_bs_shift, 9);
        assert_eq!(p.basic.physical_bs_shift, 12);
        assert_eq!(p.basic.max_sectors, MAX_IO_BUF_BYTES >> 9);
        assert_eq!(p.basic.attrs, 0);
        assert_ne!(p.types & uapi::UBLK_PARAM_TYPE_DISCARD, 0);
    }

    #[test]
    fn loop_devices_declare_a_volatile_cache_and_fua() {
        let p = params(&spec(TargetSpec::Loop { file: "/x".into(), direct: true }, 4096));
        assert_eq!(p.basic.attrs, uapi::UBLK_ATTR_VOLATILE_CACHE | uapi::UBLK_ATTR_FUA);
        assert_eq!(p.basic.logical_bs_shift, 12);
    }
}
