//! The control-plane client for `/dev/ublk-control`.
//!
//! Every command is an io_uring `URING_CMD` on a ring created with `IORING_SETUP_SQE128`,
//! with an ioctl-encoded opcode and a [`UblksrvCtrlCmd`] in the SQE's command area.
//! Commands run one at a time per client and synchronously: several of them sleep in
//! the kernel (START_DEV waits until every tag is PREPed), so a caller that must not
//! block on one device opens a client per thread.
//!
//! Every kernel refusal becomes a [`CtrlError::Kernel`] naming the command, the device
//! and the errno (name and meaning), with a hint where the cause is well known.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use io_uring::{IoUring, cqueue, opcode, squeue, types};

use crate::errno::Errno;
use crate::uapi::{
    self, AsBytes, UBLK_FEATURES_LEN, UblkParams, UblksrvCtrlCmd, UblksrvCtrlDevInfo,
};

/// Where the ublk driver's control device lives.
pub const CONTROL_PATH: &str = "/dev/ublk-control";

/// `dev_id` for ADD_DEV meaning "the kernel picks the id".
pub const AUTO_DEV_ID: u32 = u32::MAX;

/// `queue_id` for commands that are not about one queue.
const NO_QUEUE: u16 = u16::MAX;

/// The control commands this client sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtrlCmd {
    GetFeatures,
    AddDev,
    DelDev,
    StartDev,
    StopDev,
    TryStopDev,
    SetParams,
    GetParams,
    GetDevInfo,
    StartUserRecovery,
    EndUserRecovery,
    QuiesceDev,
    UpdateSize,
}

impl CtrlCmd {
    /// The ioctl-encoded opcode (`UBLK_U_CMD_*`).
    pub const fn opcode(self) -> u32 {
        match self {
            CtrlCmd::GetFeatures => uapi::UBLK_U_CMD_GET_FEATURES,
            CtrlCmd::AddDev => uapi::UBLK_U_CMD_ADD_DEV,
            CtrlCmd::DelDev => uapi::UBLK_U_CMD_DEL_DEV,
            CtrlCmd::StartDev => uapi::UBLK_U_CMD_START_DEV,
            CtrlCmd::StopDev => uapi::UBLK_U_CMD_STOP_DEV,
            CtrlCmd::TryStopDev => uapi::UBLK_U_CMD_TRY_STOP_DEV,
            CtrlCmd::SetParams => uapi::UBLK_U_CMD_SET_PARAMS,
            CtrlCmd::GetParams => uapi::UBLK_U_CMD_GET_PARAMS,
            CtrlCmd::GetDevInfo => uapi::UBLK_U_CMD_GET_DEV_INFO,
            CtrlCmd::StartUserRecovery => uapi::UBLK_U_CMD_START_USER_RECOVERY,
            CtrlCmd::EndUserRecovery => uapi::UBLK_U_CMD_END_USER_RECOVERY,
            CtrlCmd::QuiesceDev => uapi::UBLK_U_CMD_QUIESCE_DEV,
            CtrlCmd::UpdateSize => uapi::UBLK_U_CMD_UPDATE_SIZE,
        }
    }

    /// The kernel's name for the command.
    pub const fn name(self) -> &'static str {
        match self {
            CtrlCmd::GetFeatures => "GET_FEATURES",
            CtrlCmd::AddDev => "ADD_DEV",
            CtrlCmd::DelDev => "DEL_DEV",
            CtrlCmd::StartDev => "START_DEV",
            CtrlCmd::StopDev => "STOP_DEV",
            CtrlCmd::TryStopDev => "TRY_STOP_DEV",
            CtrlCmd::SetParams => "SET_PARAMS",
            CtrlCmd::GetParams => "GET_PARAMS",
            CtrlCmd::GetDevInfo => "GET_DEV_INFO",
            CtrlCmd::StartUserRecovery => "START_USER_RECOVERY",
            CtrlCmd::EndUserRecovery => "END_USER_RECOVERY",
            CtrlCmd::QuiesceDev => "QUIESCE_DEV",
            CtrlCmd::UpdateSize => "UPDATE_SIZE",
        }
    }
}

impl fmt::Display for CtrlCmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which device a command was about, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevTarget {
    /// A driver-wide command (GET_FEATURES).
    Driver,
    /// ADD_DEV with the id left to the kernel.
    NewAuto,
    Id(u32),
}

impl fmt::Display for DevTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DevTarget::Driver => f.write_str("the ublk driver"),
            DevTarget::NewAuto => f.write_str("a new device (id chosen by the kernel)"),
            DevTarget::Id(id) => write!(f, "device {id}"),
        }
    }
}

/// Errors from the control plane.
#[derive(Debug, thiserror::Error)]
pub enum CtrlError {
    #[error(
        "{} does not exist: this kernel has no ublk driver. Build the kernel with \
         CONFIG_BLK_DEV_UBLK or load the module with `modprobe ublk_drv`; on a machine \
         without it, run the command inside the project's test VM: \
         `tests/vm/run -- <command>` (see README.md)",
        path.display()
    )]
    NoDriver { path: PathBuf },
    #[error("cannot open {}: {source}{}", path.display(), open_hint(source))]
    Open { path: PathBuf, source: io::Error },
    #[error("cannot set up the io_uring that carries ublk control commands: {0}")]
    Ring(#[source] io::Error),
    #[error("{cmd} for {dev} failed: {errno}{}", kernel_hint(*cmd, *errno))]
    Kernel { cmd: CtrlCmd, dev: DevTarget, errno: Errno },
    #[error("{cmd} for {dev}: {what}")]
    Protocol { cmd: CtrlCmd, dev: DevTarget, what: String },
}

impl CtrlError {
    /// The errno the kernel answered with, if this is a kernel refusal.
    pub fn errno(&self) -> Option<i32> {
        match self {
            CtrlError::Kernel { errno, .. } => Some(errno.0),
            _ => None,
        }
    }
}

fn open_hint(err: &io::Error) -> &'static str {
    match err.kind() {
        io::ErrorKind::PermissionDenied => " (ublk control needs root or CAP_SYS_ADMIN)",
        _ => "",
    }
}

fn kernel_hint(cmd: CtrlCmd, errno: Errno) -> &'static str {
    match (cmd, errno.0) {
        (_, libc::EPERM) => "; privileged ublk devices need CAP_SYS_ADMIN",
        (CtrlCmd::AddDev, libc::EEXIST) => "; that device id is already in use",
        (CtrlCmd::AddDev, libc::EINVAL) => {
            "; the kernel refused the device description (queue count 1..=4096, depth \
             1..=4096, and a valid combination of feature flags)"
        }
        (CtrlCmd::AddDev, libc::EOPNOTSUPP) => "; this kernel lacks a requested feature flag",
        (CtrlCmd::GetFeatures, _) => "",
        (_, libc::ENODEV) => "; no ublk device has that id",
        (CtrlCmd::StartUserRecovery, libc::EBUSY) => {
            "; the device is not quiesced yet, or its old server has not released /dev/ublkcN"
        }
        (CtrlCmd::StartDev, libc::EEXIST) => "; the device is already started",
        (CtrlCmd::TryStopDev, libc::EBUSY) => "; the device's disk is open",
        (CtrlCmd::UpdateSize, libc::EACCES | libc::EINVAL | libc::EOPNOTSUPP) => {
            "; the device was not created with UBLK_F_UPDATE_SIZE, or this kernel lacks it \
             (Linux 6.16+)"
        }
        _ => "",
    }
}

/// A client of `/dev/ublk-control`.
#[derive(Debug)]
pub struct CtrlClient {
    file: File,
    ring: Mutex<Ring>,
}

struct Ring {
    uring: IoUring<squeue::Entry128, cqueue::Entry>,
    next_user_data: u64,
}

impl fmt::Debug for Ring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring").field("next_user_data", &self.next_user_data).finish()
    }
}

/// The buffer a command's `addr` points at.
enum Payload<'a> {
    None,
    /// The kernel reads from it.
    In(&'a [u8]),
    /// The kernel reads it (ADD_DEV) and writes into it.
    InOut(&'a mut [u8]),
}

impl CtrlClient {
    /// Opens [`CONTROL_PATH`].
    pub fn open() -> Result<Self, CtrlError> {
        Self::open_path(Path::new(CONTROL_PATH))
    }

    /// Opens the control device at `path`.
    pub fn open_path(path: &Path) -> Result<Self, CtrlError> {
        let file =
            OpenOptions::new().read(true).write(true).open(path).map_err(|source| match source
                .kind()
            {
                io::ErrorKind::NotFound => CtrlError::NoDriver { path: path.to_path_buf() },
                _ => CtrlError::Open { path: path.to_path_buf(), source },
            })?;
        let uring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .build(4)
            .map_err(CtrlError::Ring)?;
        Ok(CtrlClient { file, ring: Mutex::new(Ring { uring, next_user_data: 1 }) })
    }

    /// The kernel's supported `UBLK_F_*` mask.
    pub fn get_features(&self) -> Result<u64, CtrlError> {
        let mut out = [0u8; UBLK_FEATURES_LEN];
        self.run(CtrlCmd::GetFeatures, DevTarget::Driver, 0, Payload::InOut(&mut out))?;
        Ok(u64::from_ne_bytes(out))
    }

    /// Adds a device described by `info` (`dev_id` = [`AUTO_DEV_ID`] lets the kernel
    /// choose) and returns the kernel's view of it, with its id.
    pub fn add_dev(&self, info: &UblksrvCtrlDevInfo) -> Result<UblksrvCtrlDevInfo, CtrlError> {
        let dev = match info.dev_id {
            AUTO_DEV_ID => DevTarget::NewAuto,
            id => DevTarget::Id(id),
        };
        let mut out = *info;
        self.run(CtrlCmd::AddDev, dev, 0, Payload::InOut(out.as_bytes_mut()))?;
        Ok(out)
    }

    /// Deletes device `id`. The kernel waits until its `/dev/ublkcN` is released.
    pub fn del_dev(&self, id: u32) -> Result<(), CtrlError> {
        self.run(CtrlCmd::DelDev, DevTarget::Id(id), 0, Payload::None).map(drop)
    }

    /// Starts device `id`, served by process `server_pid` (as seen from this process's
    /// pid namespace). Blocks until every tag of every queue has been PREPed.
    pub fn start_dev(&self, id: u32, server_pid: i32) -> Result<(), CtrlError> {
        let data = pid_arg(CtrlCmd::StartDev, id, server_pid)?;
        self.run(CtrlCmd::StartDev, DevTarget::Id(id), data, Payload::None).map(drop)
    }

    /// [`Self::start_dev`] or [`Self::end_user_recovery`] (`cmd`), given up once `stop`
    /// is set and the calling thread is then interrupted by a signal that has a handler
    /// (installed without `SA_RESTART`): the kernel runs both on an io_uring worker
    /// thread (they may sleep, so the first, non-blocking issue answers EAGAIN), which
    /// no signal of ours reaches, so the interrupted wait asks the ring to cancel the
    /// command; io_uring then interrupts its worker's wait and the command ends with
    /// EINTR. Without `stop` set, an interrupted wait goes on waiting.
    pub fn run_interruptible(
        &self,
        cmd: CtrlCmd,
        id: u32,
        server_pid: i32,
        stop: &AtomicBool,
    ) -> Result<(), CtrlError> {
        let data = pid_arg(cmd, id, server_pid)?;
        self.run_until(cmd, DevTarget::Id(id), data, Payload::None, Some(stop)).map(drop)
    }

    pub fn stop_dev(&self, id: u32) -> Result<(), CtrlError> {
        self.run(CtrlCmd::StopDev, DevTarget::Id(id), 0, Payload::None).map(drop)
    }

    /// Stops device `id` only if nobody has its disk (`/dev/ublkbN`, or a partition of
    /// it) open: `EBUSY` otherwise, the device left as it was. The kernel checks the
    /// disk's openers and blocks new opens (`ENXIO`) under the disk's open mutex, so no
    /// mount slips in between the check and the stop. Kernels with
    /// `UBLK_F_SAFE_STOP_DEV` (Linux 7.0+) have it; older ones answer `EOPNOTSUPP`.
    pub fn try_stop_dev(&self, id: u32) -> Result<(), CtrlError> {
        self.run(CtrlCmd::TryStopDev, DevTarget::Id(id), 0, Payload::None).map(drop)
    }

    pub fn set_params(&self, id: u32, params: &UblkParams) -> Result<(), CtrlError> {
        let mut p = *params;
        p.len = size_of::<UblkParams>() as u32;
        self.run(CtrlCmd::SetParams, DevTarget::Id(id), 0, Payload::In(p.as_bytes())).map(drop)
    }

    pub fn get_params(&self, id: u32) -> Result<UblkParams, CtrlError> {
        let mut out = UblkParams { len: size_of::<UblkParams>() as u32, ..UblkParams::default() };
        self.run(CtrlCmd::GetParams, DevTarget::Id(id), 0, Payload::InOut(out.as_bytes_mut()))?;
        Ok(out)
    }

    pub fn get_dev_info(&self, id: u32) -> Result<UblksrvCtrlDevInfo, CtrlError> {
        let mut out = UblksrvCtrlDevInfo::default();
        self.run(CtrlCmd::GetDevInfo, DevTarget::Id(id), 0, Payload::InOut(out.as_bytes_mut()))?;
        Ok(out)
    }

    /// Begins recovery of a QUIESCED or FAIL_IO device. `EBUSY` until the old server's
    /// `/dev/ublkcN` is released (asynchronously): callers retry with a backoff.
    pub fn start_user_recovery(&self, id: u32) -> Result<(), CtrlError> {
        self.run(CtrlCmd::StartUserRecovery, DevTarget::Id(id), 0, Payload::None).map(drop)
    }

    /// Ends recovery: the device goes LIVE, served by `server_pid`. Blocks until every
    /// tag has been PREPed by the new server.
    pub fn end_user_recovery(&self, id: u32, server_pid: i32) -> Result<(), CtrlError> {
        let data = pid_arg(CtrlCmd::EndUserRecovery, id, server_pid)?;
        self.run(CtrlCmd::EndUserRecovery, DevTarget::Id(id), data, Payload::None).map(drop)
    }

    /// Quiesces a running device, waiting up to `timeout_ms` for in-flight I/O.
    pub fn quiesce_dev(&self, id: u32, timeout_ms: u64) -> Result<(), CtrlError> {
        self.run(CtrlCmd::QuiesceDev, DevTarget::Id(id), timeout_ms, Payload::None).map(drop)
    }

    /// Changes device `id`'s capacity to `sectors` (512-byte), telling the block layer
    /// and anyone watching the disk (`set_capacity_and_notify`). Needs a device added
    /// with `UBLK_F_UPDATE_SIZE` (Linux 6.16+). The kernel keeps the new size in the
    /// device's params, so a recovery's next server sees it too.
    pub fn update_size(&self, id: u32, sectors: u64) -> Result<(), CtrlError> {
        self.run(CtrlCmd::UpdateSize, DevTarget::Id(id), sectors, Payload::None).map(drop)
    }

    /// Sends one command and waits for its completion.
    fn run(
        &self,
        cmd: CtrlCmd,
        dev: DevTarget,
        data: u64,
        payload: Payload<'_>,
    ) -> Result<i32, CtrlError> {
        self.run_until(cmd, dev, data, payload, None)
    }

    /// [`Self::run`], the command cancelled if `stop` is set when a signal interrupts
    /// the wait (see [`Self::run_interruptible`]).
    fn run_until(
        &self,
        cmd: CtrlCmd,
        dev: DevTarget,
        data: u64,
        payload: Payload<'_>,
        stop: Option<&AtomicBool>,
    ) -> Result<i32, CtrlError> {
        // The kernel uses the buffer while the command runs; it lives on the heap, owned
        // here, so that it can outlive this call if waiting for the completion fails.
        let buffer: Box<[u8]> = match &payload {
            Payload::None => Box::new([]),
            Payload::In(b) => Box::from(*b),
            Payload::InOut(b) => Box::from(&**b),
        };
        let (addr, len) = match buffer.len() {
            0 => (0, 0),
            n => (buffer.as_ptr() as u64, n),
        };
        let header = UblksrvCtrlCmd {
            dev_id: match dev {
                DevTarget::Id(id) => id,
                DevTarget::Driver | DevTarget::NewAuto => AUTO_DEV_ID,
            },
            queue_id: NO_QUEUE,
            // Payloads are the kernel's fixed-size structs, far below u16::MAX.
            len: len as u16,
            addr,
            data: [data],
            ..UblksrvCtrlCmd::default()
        };
        let mut area = [0u8; 80];
        area[..size_of::<UblksrvCtrlCmd>()].copy_from_slice(header.as_bytes());

        let mut ring = self.ring.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let user_data = ring.next_user_data;
        ring.next_user_data = ring.next_user_data.wrapping_add(1);
        let sqe = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), cmd.opcode())
            .cmd(area)
            .build()
            .user_data(user_data);
        // SAFETY: the SQE references `buffer` (through `addr`), owned by this call; we do
        // not release it until the CQE for this `user_data` has been reaped, and if
        // waiting fails for good it is leaked below rather than freed while the kernel
        // may still write it.
        let pushed = unsafe { ring.uring.submission().push(&sqe) };
        if pushed.is_err() {
            return Err(CtrlError::Protocol {
                cmd,
                dev,
                what: "the control ring's submission queue is unexpectedly full".into(),
            });
        }
        let mut cancelled = false;
        let res = loop {
            match ring.uring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {
                    if !cancelled && stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
                        // Its completion (the cancel's own result) is dropped below as
                        // a leftover; the command's comes once its wait is interrupted.
                        let cancel = opcode::AsyncCancel::new(user_data)
                            .build()
                            .user_data(ring.next_user_data);
                        ring.next_user_data = ring.next_user_data.wrapping_add(1);
                        // SAFETY: a cancel SQE references no memory, only `user_data`.
                        cancelled = unsafe { ring.uring.submission().push(&cancel.into()) }.is_ok();
                    }
                    continue;
                }
                Err(e) => {
                    // The command may still be in flight: never free its buffer.
                    Box::leak(buffer);
                    return Err(CtrlError::Ring(e));
                }
            }
            // A completion for another request can only be a leftover of an earlier call
            // whose wait failed; it is of no use now, so it is dropped.
            if let Some(cqe) = ring.uring.completion().find(|c| c.user_data() == user_data) {
                break cqe.result();
            }
        };
        if res < 0 {
            return Err(CtrlError::Kernel { cmd, dev, errno: Errno(-res) });
        }
        if let Payload::InOut(out) = payload {
            out.copy_from_slice(&buffer);
        }
        Ok(res)
    }
}

fn pid_arg(cmd: CtrlCmd, id: u32, pid: i32) -> Result<u64, CtrlError> {
    u64::try_from(pid).ok().filter(|p| *p > 0).ok_or_else(|| CtrlError::Protocol {
        cmd,
        dev: DevTarget::Id(id),
        what: format!("server pid {pid} is not a valid process id"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_control_device_names_the_driver_and_the_vm() {
        let err = CtrlClient::open_path(Path::new("/nonexistent/ublk-control")).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, CtrlError::NoDriver { .. }), "{msg}");
        assert!(msg.contains("CONFIG_BLK_DEV_UBLK"), "{msg}");
        assert!(msg.contains("modprobe ublk_drv"), "{msg}");
        assert!(msg.contains("tests/vm/run"), "{msg}");
    }

    #[test]
    fn a_path_that_is_not_a_ublk_device_is_an_open_error_not_no_driver() {
        let err = CtrlClient::open_path(Path::new("/proc/self/nonexistent-dir/x")).unwrap_err();
        assert!(matches!(err, CtrlError::NoDriver { .. }));
        let err = CtrlClient::open_path(Path::new("/proc")).unwrap_err();
        assert!(matches!(err, CtrlError::Open { .. }), "{err}");
    }

    #[test]
    fn kernel_errors_name_command_device_and_errno() {
        let e = CtrlError::Kernel {
            cmd: CtrlCmd::DelDev,
            dev: DevTarget::Id(42),
            errno: Errno(libc::ENODEV),
        };
        assert_eq!(
            e.to_string(),
            "DEL_DEV for device 42 failed: ENODEV (No such device); no ublk device has that id"
        );
        let e = CtrlError::Kernel {
            cmd: CtrlCmd::AddDev,
            dev: DevTarget::NewAuto,
            errno: Errno(libc::EINVAL),
        };
        assert!(
            e.to_string()
                .starts_with("ADD_DEV for a new device (id chosen by the kernel) failed: EINVAL")
        );
        assert_eq!(e.errno(), Some(libc::EINVAL));
    }

    #[test]
    fn opcodes_match_the_uapi() {
        assert_eq!(CtrlCmd::GetFeatures.opcode(), uapi::UBLK_U_CMD_GET_FEATURES);
        assert_eq!(CtrlCmd::EndUserRecovery.opcode(), uapi::UBLK_U_CMD_END_USER_RECOVERY);
        assert_eq!(CtrlCmd::UpdateSize.opcode(), uapi::UBLK_U_CMD_UPDATE_SIZE);
    }

    #[test]
    fn pid_argument_must_be_positive() {
        assert!(pid_arg(CtrlCmd::StartDev, 1, 0).is_err());
        assert!(pid_arg(CtrlCmd::StartDev, 1, -5).is_err());
        assert_eq!(pid_arg(CtrlCmd::StartDev, 1, 77).unwrap(), 77);
    }
}
