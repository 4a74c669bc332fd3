//! What a device is made of besides its worker: the flags and kernel parameters it is
//! created with (among them its data path: batched where the kernel has
//! `UBLK_F_BATCH_IO`, per-I/O otherwise), whether it uses zero copy, and the files its
//! workers are given (the target's data and `/dev/ublkcN`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ublkd_config::{DeviceSpec, TargetSpec};
use ublkd_proto::msg::DataPath;
use ublkd_proto::uapi::{self, UblkParamBasic, UblkParamDiscard, UblkParams};

use ublkd_proto::msg::rbd::RbdProbe;

pub mod error;
pub mod zero_copy;

pub use error::TargetError;
pub use zero_copy::{decide_zero_copy, zero_copy};

use crate::nbd::ExportInfo;
use crate::state::StateDir;

/// What an add learnt of its target before the device is made, on a thread of its own:
/// an nbd export connected and negotiated, or an rbd image probed.
#[derive(Debug)]
pub enum Reached {
    Nbd(Option<NbdLink>),
    Rbd(RbdProbe),
}

/// Reaches `spec`'s target before its device is made, on a thread of its own: an nbd
/// export connected and negotiated ([`connect_export`]), an rbd image probed
/// ([`probe_rbd`]), nothing for the others. `nbd_handshake`: each NBD connection's limit.
pub fn reach(
    worker_binary: &Path,
    spec: &DeviceSpec,
    data_path: DataPath,
    nbd_handshake: Duration,
) -> Result<Reached, TargetError> {
    match &spec.target {
        TargetSpec::Rbd(_) => probe_rbd(worker_binary, spec).map(Reached::Rbd),
        _ => connect_export(spec, data_path, nbd_handshake).map(Reached::Nbd),
    }
}

/// Whether [`reach`] takes time for `spec` (and so a thread).
pub fn reach_takes_time(spec: &DeviceSpec) -> bool {
    matches!(spec.target, TargetSpec::Nbd { .. } | TargetSpec::Rbd(_))
}

/// Probes `spec`'s rbd image (see [`crate::rbd::probe`]): on an add's thread.
pub fn probe_rbd(worker_binary: &Path, spec: &DeviceSpec) -> Result<RbdProbe, TargetError> {
    let TargetSpec::Rbd(rbd) = &spec.target else {
        unreachable!("probe_rbd is called for rbd devices only")
    };
    let image = rbd.image.to_string();
    let conf_err = |source| TargetError::RbdConf { image: image.clone(), source };
    let setup = crate::rbd::setup_for(rbd).map_err(conf_err)?;
    if spec.settings.sandbox {
        crate::rbd::conf::check_monitors_by_address(&setup.options).map_err(conf_err)?;
    }
    let sandbox = spec.settings.sandbox.then_some(spec.settings.sandbox_optional);
    let (block_size, read_only) = (spec.settings.block_size, spec.attrs.read_only);
    // The probe's log lines carry the device's id; an add that lets the kernel pick
    // has none yet (u32::MAX, which no device has).
    let dev_id = spec.id.unwrap_or(u32::MAX);
    crate::rbd::probe_image(worker_binary, &setup, block_size, read_only, sandbox, dev_id)
        .map_err(|source| TargetError::RbdProbe { image, source })
}

pub use crate::nbd::link::{NBD_DRAIN_TIMEOUT, NbdLink, connect_export, nbd_poll_connect};

/// The largest request, and so each tag's buffer in the worker.
pub const MAX_IO_BUF_BYTES: u32 = 512 * 1024;

/// The feature flags every ublkd device is created with. Not NEED_GET_DATA: WRITE
/// data is copied into the tag's buffer before the request is delivered.
pub const DEVICE_FLAGS: u64 = uapi::UBLK_F_USER_RECOVERY | uapi::UBLK_F_USER_RECOVERY_REISSUE;

/// The flags of a device on a kernel with `kernel_features`: [`DEVICE_FLAGS`],
/// `UBLK_F_BATCH_IO` where the kernel has it (the batched data path, see
/// [`DataPath::for_kernel`]), `UBLK_F_SAFE_STOP_DEV` where the kernel has it (a delete
/// then stops the device with `TRY_STOP_DEV`, which the kernel refuses while the disk
/// is open), `UBLK_F_UPDATE_SIZE` where the kernel has it (`ublkctl resize`: the
/// kernel takes UPDATE_SIZE only for a device created with it, and a device's flags
/// never change), `UBLK_F_NO_AUTO_PART_SCAN` where the kernel has it and the device did
/// not ask for partitions (a device's content, which may come from anywhere, then never
/// makes the kernel parse a partition table; older kernels scan, see the operator's
/// guide), and automatic buffer registration for a zero-copy loop or nbd device.
pub fn device_flags(spec: &DeviceSpec, kernel_features: u64) -> u64 {
    let mut flags = DEVICE_FLAGS;
    if DataPath::for_kernel(kernel_features) == DataPath::Batch {
        flags |= uapi::UBLK_F_BATCH_IO;
    }
    flags |= kernel_features & (uapi::UBLK_F_SAFE_STOP_DEV | uapi::UBLK_F_UPDATE_SIZE);
    if !spec.attrs.partitions {
        flags |= kernel_features & uapi::UBLK_F_NO_AUTO_PART_SCAN;
    }
    if zero_copy(spec) {
        flags |= uapi::UBLK_F_AUTO_BUF_REG;
    }
    flags
}

/// Whether a device served with `path` may use `recovery.fast_release` (ublkd
/// unregistering `/dev/ublkcN` from its copy of a dead worker's rings). Only on the
/// batched path: the per-I/O path runs on older kernels (6.12), whose io_uring makes
/// that unregistration wait for every command still in the ring, and a dead worker's
/// FETCH_REQs stay there for as long as ublkd holds the ring, so ublkd's loop would
/// block for good (seen in the test VM: ublkd stuck in `io_rsrc_ref_quiesce`). Those
/// devices are released by the rings' teardown instead.
pub fn fast_release_supported(path: DataPath) -> bool {
    path == DataPath::Batch
}

/// The kernel parameters for `spec`; for an nbd device, `export` is what its server
/// said, which decides its cache, FUA, discard, write-zeroes, read-only and request
/// size limits.
pub fn params(spec: &DeviceSpec, export: Option<&ExportInfo>) -> UblkParams {
    let bs_shift = spec.settings.block_size.trailing_zeros() as u8;
    let types = uapi::UBLK_PARAM_TYPE_BASIC | uapi::UBLK_PARAM_TYPE_DISCARD;
    let mut max_sectors = MAX_IO_BUF_BYTES >> 9;
    let (mut max_discard, mut max_write_zeroes) = (max_sectors, max_sectors);
    // A loop file has a write-back cache (the page cache, or the disk's own): FLUSH and
    // FUA must reach the target. RAM and null have nothing to flush. An nbd export has
    // what its flags say, and no more: the kernel sends nothing the server refuses.
    let attrs = match (&spec.target, export) {
        (TargetSpec::Loop { .. }, _) => uapi::UBLK_ATTR_VOLATILE_CACHE | uapi::UBLK_ATTR_FUA,
        (TargetSpec::Nbd { .. }, Some(info)) => {
            let mut attrs = 0;
            if info.can_flush() {
                attrs |= uapi::UBLK_ATTR_VOLATILE_CACHE;
                if info.can_fua() {
                    attrs |= uapi::UBLK_ATTR_FUA;
                }
            }
            if info.read_only() {
                attrs |= uapi::UBLK_ATTR_READ_ONLY;
            }
            if info.rotational() {
                attrs |= uapi::UBLK_ATTR_ROTATIONAL;
            }
            if let Some(b) = info.block_sizes {
                // At least a page: a smaller maximum is refused at the handshake.
                max_sectors = max_sectors.min(b.max >> 9);
            }
            max_discard = if info.can_trim() { max_sectors } else { 0 };
            max_write_zeroes = if info.can_write_zeroes() { max_sectors } else { 0 };
            attrs
        }
        // Not reached: an nbd device is made after its handshake. Flushing is the
        // safe assumption.
        (TargetSpec::Nbd { .. }, None) => uapi::UBLK_ATTR_VOLATILE_CACHE,
        // librbd's cache is off (`rbd::conf`): a write it completes is on the OSDs, so
        // there is no cache to flush. A snapshot is read-only.
        (TargetSpec::Rbd(rbd), _) if rbd.image.snapshot.is_some() => uapi::UBLK_ATTR_READ_ONLY,
        (TargetSpec::Null | TargetSpec::Memory | TargetSpec::Rbd(_), _) => 0,
    };
    // Asked for, on any target; the worker refuses writes too (`WorkerSetup::read_only`).
    let attrs = if spec.attrs.read_only { attrs | uapi::UBLK_ATTR_READ_ONLY } else { attrs };
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
        discard: UblkParamDiscard {
            discard_alignment: 0,
            discard_granularity: spec.settings.block_size,
            max_discard_sectors: max_discard,
            max_write_zeroes_sectors: max_write_zeroes,
            max_discard_segments: 1,
            reserved0: 0,
        },
        ..UblkParams::default()
    }
}

/// Opens the target's data: the memory file in the state dir for `memory`, the
/// backing file for `loop` (O_DIRECT when asked and the filesystem allows it). Returns
/// the fd and whether the file is in direct mode.
pub fn open_target(
    state: &StateDir,
    id: u32,
    spec: &DeviceSpec,
) -> Result<(Option<OwnedFd>, bool), TargetError> {
    match &spec.target {
        TargetSpec::Null => Ok((None, false)),
        TargetSpec::Memory => {
            let file = state
                .memory_file(id, spec.size_bytes)
                .map_err(|source| TargetError::State { id, source })?;
            Ok((Some(file.into()), false))
        }
        TargetSpec::Loop { file, direct, .. } => open_backing(id, file, *direct),
        // Its connection is made for each worker (`nbd_socket`); an rbd worker
        // connects to its cluster itself.
        TargetSpec::Nbd { .. } | TargetSpec::Rbd(_) => Ok((None, false)),
    }
}

/// Opens a loop device's backing file, O_DIRECT if `direct` and the filesystem allows
/// it. Returns the fd and whether the file is in direct mode.
fn open_backing(
    id: u32,
    file: &Path,
    direct: bool,
) -> Result<(Option<OwnedFd>, bool), TargetError> {
    let open = |flags: i32| {
        OpenOptions::new().read(true).write(true).custom_flags(flags | libc::O_CLOEXEC).open(file)
    };
    let backing_err = |source| TargetError::Backing { id, path: file.to_path_buf(), source };
    if direct {
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

/// Opens `/dev/ublkcN`, waiting briefly for the node to appear (udev or devtmpfs).
pub fn open_char_dev(id: u32) -> Result<File, TargetError> {
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
            Err(source) => return Err(TargetError::CharDev { id, path, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::features::{KernelRelease, NBD_ZERO_COPY_RELEASE};

    fn spec(target: TargetSpec, block_size: u32) -> DeviceSpec {
        DeviceSpec {
            id: None,
            target,
            size_bytes: 1 << 30,
            settings: ublkd_config::DeviceSettings {
                queues: 2,
                queue_depth: 64,
                block_size,
                ..Default::default()
            },
            attrs: ublkd_config::DeviceAttrs::default(),
        }
    }

    #[test]
    fn partitions_are_not_scanned_unless_asked_where_the_kernel_can_say_so() {
        let no_scan = uapi::UBLK_F_NO_AUTO_PART_SCAN;
        let plain = loop_spec(Some(false));
        assert_eq!(device_flags(&plain, DEVICE_FLAGS | no_scan) & no_scan, no_scan);
        assert_eq!(device_flags(&plain, DEVICE_FLAGS) & no_scan, 0, "6.12 has no such flag");
        let mut scanned = plain;
        scanned.attrs.partitions = true;
        assert_eq!(device_flags(&scanned, DEVICE_FLAGS | no_scan) & no_scan, 0);
    }

    #[test]
    fn a_read_only_device_of_any_target_is_read_only_to_the_kernel() {
        let uri = ublkd_config::NbdUri::parse("nbd://127.0.0.1/x").unwrap();
        for target in
            [TargetSpec::Null, TargetSpec::Memory, TargetSpec::Nbd { uri, zero_copy: None }]
        {
            let mut spec = spec(target, 4096);
            spec.attrs.read_only = true;
            let ro = params(&spec, None).basic.attrs;
            assert_eq!(ro & uapi::UBLK_ATTR_READ_ONLY, uapi::UBLK_ATTR_READ_ONLY, "{spec:?}");
        }
        let mut lp = loop_spec(None);
        lp.attrs.read_only = true;
        assert_eq!(
            params(&lp, None).basic.attrs,
            uapi::UBLK_ATTR_READ_ONLY | uapi::UBLK_ATTR_VOLATILE_CACHE | uapi::UBLK_ATTR_FUA
        );
    }

    fn loop_spec(zero_copy: Option<bool>) -> DeviceSpec {
        spec(TargetSpec::Loop { file: "/x".into(), direct: true, zero_copy }, 4096)
    }

    fn decided(spec: &DeviceSpec, features: u64) -> Option<bool> {
        decide_zero_copy(spec, features, Some(NBD_ZERO_COPY_RELEASE)).unwrap().target.zero_copy()
    }

    fn nbd_spec(zero_copy: Option<bool>) -> DeviceSpec {
        let uri = ublkd_config::NbdUri::parse("nbd://127.0.0.1/x").unwrap();
        DeviceSpec { size_bytes: 0, ..spec(TargetSpec::Nbd { uri, zero_copy }, 4096) }
    }

    #[test]
    fn an_nbd_device_copies_unless_asked_and_zero_copy_needs_linux_7_2() {
        let all = uapi::UBLK_F_AUTO_BUF_REG | uapi::UBLK_F_BATCH_IO;
        assert_eq!(decided(&nbd_spec(None), all), Some(false), "opt-in: unset copies");
        assert_eq!(decided(&nbd_spec(Some(false)), all), Some(false));
        assert_eq!(decided(&nbd_spec(Some(true)), all), Some(true));
        assert!(!zero_copy(&nbd_spec(None)));
        assert!(zero_copy(&nbd_spec(Some(true))));
        let zc = uapi::UBLK_F_AUTO_BUF_REG;
        assert_eq!(device_flags(&nbd_spec(Some(true)), all) & zc, zc);
        assert_eq!(device_flags(&nbd_spec(Some(false)), all) & zc, 0);
        // Without AUTO_BUF_REG, or without the batched path.
        for features in [uapi::UBLK_F_BATCH_IO, uapi::UBLK_F_AUTO_BUF_REG] {
            let refused = decide_zero_copy(&nbd_spec(Some(true)), features, None).unwrap_err();
            assert!(matches!(refused, TargetError::ZeroCopyUnsupported), "{refused}");
        }
        // Before 7.2, or a release ublkd cannot read.
        let old = KernelRelease { major: 7, minor: 1 };
        let refused = decide_zero_copy(&nbd_spec(Some(true)), all, Some(old)).unwrap_err();
        assert!(
            refused.to_string().starts_with(
                "zero_copy for an nbd device needs Linux >= 7.2 (io_uring's socket send and \
                 receive into registered buffers), this kernel is 7.1; turn zero_copy off"
            ),
            "{refused}"
        );
        let refused = decide_zero_copy(&nbd_spec(Some(true)), all, None).unwrap_err();
        assert!(refused.to_string().contains("of a release ublkd cannot read"), "{refused}");
        // The release does not matter to a copying nbd device, nor to a loop device.
        assert!(decide_zero_copy(&nbd_spec(None), all, Some(old)).is_ok());
        assert!(decide_zero_copy(&loop_spec(Some(true)), all, Some(old)).is_ok());
    }

    #[test]
    fn zero_copy_by_default_only_where_the_kernel_has_it_and_the_device_fits() {
        let all = uapi::UBLK_F_AUTO_BUF_REG | uapi::UBLK_F_BATCH_IO;
        assert_eq!(decided(&loop_spec(None), all), Some(true));
        assert_eq!(decided(&loop_spec(None), 0), Some(false));
        let mut big = loop_spec(None);
        (big.settings.queues, big.settings.queue_depth) = (8, 4096);
        assert_eq!(decided(&big, all), Some(false));
        assert_eq!(decided(&loop_spec(Some(false)), all), Some(false));
        assert_eq!(decided(&loop_spec(Some(true)), all), Some(true));
        assert!(matches!(
            decide_zero_copy(&loop_spec(Some(true)), 0, None),
            Err(TargetError::ZeroCopyUnsupported)
        ));
        let zc = uapi::UBLK_F_AUTO_BUF_REG;
        assert_eq!(device_flags(&loop_spec(Some(true)), all) & zc, zc);
        assert_eq!(device_flags(&loop_spec(Some(false)), all) & zc, 0);
    }

    #[test]
    fn without_batch_io_devices_get_the_per_io_path_and_no_zero_copy() {
        // Linux 6.16+: AUTO_BUF_REG without BATCH_IO.
        let features = uapi::UBLK_F_AUTO_BUF_REG | DEVICE_FLAGS;
        assert_eq!(decided(&loop_spec(None), features), Some(false));
        let refused = decide_zero_copy(&loop_spec(Some(true)), features, None).unwrap_err();
        assert!(refused.to_string().contains("UBLK_F_BATCH_IO"), "{refused}");
        let flags = device_flags(&loop_spec(Some(false)), features);
        assert_eq!(flags, DEVICE_FLAGS, "{flags:#x}");
        let batched = device_flags(&loop_spec(Some(false)), features | uapi::UBLK_F_BATCH_IO);
        assert_eq!(batched, DEVICE_FLAGS | uapi::UBLK_F_BATCH_IO);
        assert!(!fast_release_supported(DataPath::for_kernel(features)));
        assert!(fast_release_supported(DataPath::for_kernel(features | uapi::UBLK_F_BATCH_IO)));
    }

    #[test]
    fn devices_get_safe_stop_where_the_kernel_has_it() {
        let safe = uapi::UBLK_F_SAFE_STOP_DEV;
        assert_eq!(device_flags(&loop_spec(Some(false)), DEVICE_FLAGS) & safe, 0);
        assert_eq!(device_flags(&loop_spec(Some(false)), DEVICE_FLAGS | safe) & safe, safe);
    }

    #[test]
    fn devices_can_be_resized_where_the_kernel_has_update_size() {
        let update = uapi::UBLK_F_UPDATE_SIZE;
        assert_eq!(device_flags(&loop_spec(Some(false)), DEVICE_FLAGS) & update, 0);
        assert_eq!(device_flags(&loop_spec(Some(false)), DEVICE_FLAGS | update) & update, update);
    }

    #[test]
    fn params_describe_size_block_size_and_request_limit() {
        let p = params(&spec(TargetSpec::Memory, 512), None);
        assert_eq!(p.basic.dev_sectors, (1 << 30) >> 9);
        assert_eq!(p.basic.logical_bs_shift, 9);
        assert_eq!(p.basic.physical_bs_shift, 12);
        assert_eq!(p.basic.max_sectors, MAX_IO_BUF_BYTES >> 9);
        assert_eq!(p.basic.attrs, 0);
        assert_ne!(p.types & uapi::UBLK_PARAM_TYPE_DISCARD, 0);
    }

    #[test]
    fn an_nbd_device_offers_the_kernel_exactly_what_its_export_does() {
        use crate::nbd::BlockSizes;
        let uri = ublkd_config::NbdUri::parse("nbd://127.0.0.1/x").unwrap();
        let nbd = spec(TargetSpec::Nbd { uri, zero_copy: None }, 4096);
        let export = |flags: u16, max: u32| ExportInfo {
            size: 1 << 30,
            transmission_flags: flags,
            block_sizes: Some(BlockSizes { min: 512, preferred: 4096, max }),
            structured_replies: true,
            tls: false,
            export_name_option: false,
        };
        // Flush, FUA, trim and write-zeroes, 64 KiB requests at most.
        let p = params(&nbd, Some(&export(0b0110_1101, 65536)));
        assert_eq!(p.basic.attrs, uapi::UBLK_ATTR_VOLATILE_CACHE | uapi::UBLK_ATTR_FUA);
        assert_eq!(p.basic.max_sectors, 128);
        assert_eq!((p.discard.max_discard_sectors, p.discard.max_write_zeroes_sectors), (128, 128));
        // Read-only, rotational, nothing else: no cache, no discard, no write zeroes; a
        // maximum above ublkd's own request size does not raise it.
        let p = params(&nbd, Some(&export(0b0001_0011, u32::MAX)));
        assert_eq!(p.basic.attrs, uapi::UBLK_ATTR_READ_ONLY | uapi::UBLK_ATTR_ROTATIONAL);
        assert_eq!(p.basic.max_sectors, MAX_IO_BUF_BYTES >> 9);
        assert_eq!((p.discard.max_discard_sectors, p.discard.max_write_zeroes_sectors), (0, 0));
        // FUA without flush means nothing to the kernel: no cache, no FUA.
        assert_eq!(params(&nbd, Some(&export(0b0000_1001, 65536))).basic.attrs, 0);
    }

    #[test]
    fn loop_devices_declare_a_volatile_cache_and_fua() {
        let p = params(
            &spec(TargetSpec::Loop { file: "/x".into(), direct: true, zero_copy: None }, 4096),
            None,
        );
        assert_eq!(p.basic.attrs, uapi::UBLK_ATTR_VOLATILE_CACHE | uapi::UBLK_ATTR_FUA);
        assert_eq!(p.basic.logical_bs_shift, 12);
    }
}
