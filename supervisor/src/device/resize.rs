//! `ublkctl resize`: a device's size changed while it serves, with the kernel's
//! UPDATE_SIZE (Linux 6.16+, for a device created with `UBLK_F_UPDATE_SIZE`).
//!
//! A worker serves the size it was set up with (it refuses a request past it, and a
//! memory worker maps the memory file as long as it was), so the kernel is told of a
//! larger size only once a worker set up with it serves: the target's data is grown
//! and the record rewritten first ([`Device::begin_resize`]), then the device is handed
//! to a new worker as an upgrade hands it (the daemon's part), then the kernel learns
//! the size ([`Device::finish_resize`]). A smaller size goes to the kernel first, so
//! that nothing past the new end reaches a worker afterwards. Each step is safe to
//! repeat: a resize cut short (a worker killed, ublkd stopped) is finished by running
//! it again, and every worker started after the record's rewrite serves the new size.
//!
//! An rbd device's image is resized by its workers, never by ublkd (which runs no Ceph
//! code): a worker set up with a size larger than the image grows the image to it
//! before it stands by (librbd has the lock's owner, the serving worker, carry that
//! out). A smaller size shrinks the device only: the image keeps what lies past its
//! end, as a loop device's file does.
//!
//! An image resized elsewhere (`rbd resize`) reaches the device by itself: its serving
//! worker watches the image and reports its new size (`FromWorker::ImageResized`),
//! which ublkd reads on its ticks ([`Device::image_resized`]) and checks
//! ([`check_image_size`]: a growth to a whole number of blocks, at most the largest
//! device; a worker's word is never trusted further) before resizing the device by
//! the same steps as `ublkctl resize`. A shrunk image is not followed: shrinking a
//! device under its filesystem loses data, so only `ublkctl resize --allow-shrink`
//! does it, and meanwhile requests past the image's end fail.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;

use ublkd_config::{FieldError, MAX_SIZE_BYTES, TargetSpec, format_size};
use ublkd_proto::ctrl::CtrlError;
use ublkd_proto::msg::{self, ErrorKind, FromWorker};
use ublkd_proto::uapi;

use super::{Context, Device};
use crate::features::KernelRelease;
use crate::state::{DeviceRecord, StateError};

/// Why a resize was refused or failed. Each names the device (but the kernel's).
#[derive(Debug, thiserror::Error)]
pub enum ResizeError {
    #[error(
        "this kernel ({}) has no UBLK_F_UPDATE_SIZE (Linux 6.16+): a device's size cannot \
         change while it serves; nothing was changed",
        release.map_or_else(|| "of a release ublkd cannot read".to_string(), |r| r.to_string())
    )]
    KernelLacksUpdateSize { release: Option<KernelRelease> },
    #[error(
        "device {id} was created without UBLK_F_UPDATE_SIZE (by an older ublkd or on an \
         older kernel), and a device keeps its flags: it cannot be resized; nothing was \
         changed"
    )]
    CreatedWithout { id: u32 },
    #[error(
        "device {id} is an nbd device: its size is its export's, which the server gives \
         at connection (a server that comes back with another size is refused); nothing \
         was changed"
    )]
    Nbd { id: u32 },
    #[error(
        "device {id} serves {image} read-only (a snapshot or a read-only device), and \
         its worker does not resize the image; nothing was changed"
    )]
    RbdReadOnly { id: u32, image: String },
    #[error(
        "device {id} is {} ({current} bytes), and {} is smaller: shrinking cuts off the \
         data past the new end; shrink what is on it first, then pass --allow-shrink",
        format_size(*current),
        format_size(*wanted)
    )]
    Shrink { id: u32, current: u64, wanted: u64 },
    #[error("device {id}: {source}")]
    Size { id: u32, source: FieldError },
    #[error(
        "device {id}: its backing file {} is a block device of {have} bytes, and a loop \
         device on a block device grows only as far as the block device does: grow it \
         first ({wanted} bytes asked); nothing was changed",
        path.display()
    )]
    BlockDeviceTooSmall { id: u32, path: PathBuf, have: u64, wanted: u64 },
    #[error("device {id}: cannot grow its backing file {}: {source}", path.display())]
    Grow { id: u32, path: PathBuf, source: io::Error },
    #[error("device {id}: cannot grow its memory file: {source}")]
    GrowMemory { id: u32, source: io::Error },
    #[error("device {id}: cannot record its new size: {source}; nothing was changed")]
    Record { id: u32, source: StateError },
    #[error("{0}")]
    Kernel(#[from] CtrlError),
}

impl ResizeError {
    /// The kind `ublkctl resize` exits with for this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ResizeError::KernelLacksUpdateSize { .. } => ErrorKind::NotSupported,
            ResizeError::Shrink { .. } | ResizeError::Size { .. } => ErrorKind::BadArgument,
            _ => ErrorKind::Other,
        }
    }
}

/// A resize of one device, from the size the kernel gives its disk now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResizePlan {
    pub id: u32,
    pub from: u64,
    pub to: u64,
}

impl ResizePlan {
    pub fn grows(&self) -> bool {
        self.to > self.from
    }
}

impl Device {
    /// What resizing this device to `to` bytes takes, or why it cannot be; `None`: it
    /// is that size already, in the kernel and in its record. Changes nothing.
    pub fn plan_resize(
        &self,
        ctx: &Context,
        to: u64,
        allow_shrink: bool,
    ) -> Result<Option<ResizePlan>, ResizeError> {
        let id = self.id;
        if ctx.kernel_features & uapi::UBLK_F_UPDATE_SIZE == 0 {
            return Err(ResizeError::KernelLacksUpdateSize { release: ctx.kernel_release });
        }
        match &self.spec.target {
            TargetSpec::Nbd { .. } => return Err(ResizeError::Nbd { id }),
            TargetSpec::Rbd(rbd) if rbd.image.snapshot.is_some() || self.spec.attrs.read_only => {
                let image = rbd.image.to_string();
                return Err(ResizeError::RbdReadOnly { id, image });
            }
            TargetSpec::Rbd(_)
            | TargetSpec::Null
            | TargetSpec::Memory
            | TargetSpec::Loop { .. } => {}
        }
        if ctx.ctrl.get_dev_info(id)?.flags & uapi::UBLK_F_UPDATE_SIZE == 0 {
            return Err(ResizeError::CreatedWithout { id });
        }
        // What the disk is now, as its users see it (the record may be ahead of it,
        // after a resize cut short).
        let from = ctx.ctrl.get_params(id)?.basic.dev_sectors << 9;
        let mut wanted = self.spec.clone();
        wanted.size_bytes = to;
        if let TargetSpec::Loop { file, .. } = &self.spec.target {
            // A regular file is grown to fit (`begin_resize`); a block device is not.
            let meta = std::fs::metadata(file).map_err(|source| ResizeError::Grow {
                id,
                path: file.clone(),
                source,
            })?;
            if meta.file_type().is_block_device() {
                let have = ublkd_config::backing_file_size(file)
                    .map_err(|source| ResizeError::Size { id, source })?;
                if to > have {
                    let path = file.clone();
                    return Err(ResizeError::BlockDeviceTooSmall { id, path, have, wanted: to });
                }
            } else {
                // The checks but the file's length, which grows.
                wanted.target = TargetSpec::Null;
            }
        }
        if let TargetSpec::Rbd(_) = &self.spec.target {
            // The checks but the target's: an rbd spec's size is the image's, which the
            // next worker grows to this one (`begin_resize`).
            wanted.target = TargetSpec::Null;
        }
        wanted.validate().map_err(|source| ResizeError::Size { id, source })?;
        if to < from && !allow_shrink {
            return Err(ResizeError::Shrink { id, current: from, wanted: to });
        }
        if to == from && to == self.spec.size_bytes {
            return Ok(None);
        }
        Ok(Some(ResizePlan { id, from, to }))
    }

    /// The first half of `plan`: a smaller size told to the kernel, a larger one given
    /// room in the target's data (an rbd image: by the next worker), and the record
    /// rewritten, so that every worker
    /// started from now on serves the new size. The caller then hands the device to a
    /// new worker and calls [`Self::finish_resize`].
    pub fn begin_resize(&mut self, ctx: &Context, plan: ResizePlan) -> Result<(), ResizeError> {
        let id = self.id;
        if plan.grows() {
            self.grow_data(plan.to)?;
        }
        let old = self.spec.size_bytes;
        self.spec.size_bytes = plan.to;
        let record = DeviceRecord::new(id, &self.spec);
        if let Err(source) = ctx.state.write_record(&record) {
            self.spec.size_bytes = old;
            return Err(ResizeError::Record { id, source });
        }
        if !plan.grows() {
            // Before any worker set up with the smaller size serves: the kernel sends
            // nothing past the new end from here on.
            ctx.ctrl.update_size(id, plan.to >> 9)?;
        }
        tracing::info!(
            dev_id = id,
            event = "resizing",
            from = plan.from,
            to = plan.to,
            "resizing from {} to {}",
            format_size(plan.from),
            format_size(plan.to)
        );
        Ok(())
    }

    /// The second half of `plan`, once a worker set up with the new size serves: a
    /// larger size told to the kernel (the disk's users see it now), a memory device's
    /// memory past a smaller end given back. A loop device's file keeps what lies past
    /// a smaller end: ublkd never cuts an operator's file.
    pub fn finish_resize(&mut self, ctx: &Context, plan: ResizePlan) -> Result<(), ResizeError> {
        let id = self.id;
        if plan.grows() {
            ctx.ctrl.update_size(id, plan.to >> 9)?;
        } else if let (TargetSpec::Memory, Some(fd)) = (&self.spec.target, &self.target_fd) {
            // Only workers set up with the smaller size are left, none of which maps
            // past it.
            let file = std::fs::File::from(
                fd.try_clone().map_err(|source| ResizeError::GrowMemory { id, source })?,
            );
            file.set_len(plan.to).map_err(|source| ResizeError::GrowMemory { id, source })?;
        }
        tracing::info!(
            dev_id = id,
            event = "resized",
            size_bytes = plan.to,
            "resized to {}",
            format_size(plan.to)
        );
        Ok(())
    }

    /// Room for `to` bytes in the target's data: the memory file or a loop device's
    /// regular file made that long if shorter (`ftruncate`: sparse, the blocks come as
    /// they are written). Never shortens.
    fn grow_data(&self, to: u64) -> Result<(), ResizeError> {
        let id = self.id;
        match (&self.spec.target, &self.target_fd) {
            (TargetSpec::Memory, Some(fd)) => {
                let err = |source| ResizeError::GrowMemory { id, source };
                let file = std::fs::File::from(fd.try_clone().map_err(err)?);
                if file.metadata().map_err(err)?.len() < to {
                    file.set_len(to).map_err(err)?;
                }
            }
            (TargetSpec::Loop { file: path, .. }, Some(fd)) => {
                let err = |source| ResizeError::Grow { id, path: path.clone(), source };
                let file = std::fs::File::from(fd.try_clone().map_err(err)?);
                let meta = file.metadata().map_err(err)?;
                if meta.is_file() && meta.len() < to {
                    file.set_len(to).map_err(err)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// The most messages read from one worker per tick: a worker that floods its socket
/// does not hold the loop.
const MAX_REPORTS_PER_TICK: usize = 8;

/// What ublkd makes of an rbd worker's report that its image is now `reported` bytes,
/// for a device of `current` bytes with `block_size`-byte blocks: the size to resize
/// the device to, `Ok(None)` if it is that size, or why the report is not followed.
pub fn check_image_size(
    reported: u64,
    current: u64,
    block_size: u32,
) -> Result<Option<u64>, String> {
    if reported == current {
        return Ok(None);
    }
    if reported < current {
        return Err(format!(
            "the image shrank to {reported} bytes under the device ({current} bytes); ublkd \
             follows an image's growth only (requests past the image's end now fail): grow \
             the image back, or shrink what is on the device and run `ublkctl resize \
             --allow-shrink`"
        ));
    }
    if !reported.is_multiple_of(u64::from(block_size)) {
        return Err(format!(
            "the image grew to {reported} bytes, not a whole number of {block_size}-byte \
             blocks; the device keeps its size"
        ));
    }
    if reported > MAX_SIZE_BYTES {
        return Err(format!(
            "the image grew to {reported} bytes, more than the largest device \
             ({MAX_SIZE_BYTES} bytes); the device keeps its size"
        ));
    }
    Ok(Some(reported))
}

impl Device {
    /// A LIVE rbd device's serving worker's reports of its image's new size, read
    /// without waiting (at most [`MAX_REPORTS_PER_TICK`]): the newest size to resize
    /// the device to, if the newest report is one ublkd follows ([`check_image_size`]).
    /// Anything else the worker says here is not part of the protocol, and logged.
    pub fn image_resized(&self) -> Option<u64> {
        let TargetSpec::Rbd(_) = &self.spec.target else { return None };
        if self.state().kind() != crate::device_state::StateKind::Live {
            return None;
        }
        let worker = self.worker()?;
        let mut newest = None;
        for _ in 0..MAX_REPORTS_PER_TICK {
            if !worker.has_answered() {
                break;
            }
            match msg::try_recv_packet::<FromWorker>(worker.control()) {
                Ok((FromWorker::ImageResized { size_bytes }, _)) => newest = Some(size_bytes),
                Ok((other, _)) => tracing::warn!(
                    dev_id = self.id,
                    worker_pid = worker.pid(),
                    "the serving worker said something out of turn, ignored: {}",
                    msg::untrusted_text(&format!("{other:?}"))
                ),
                // Nothing more, or its end (its death is handled as any other).
                Err(_) => break,
            }
        }
        let reported = newest?;
        match check_image_size(reported, self.spec.size_bytes, self.spec.settings.block_size) {
            Ok(size) => size,
            Err(why) => {
                tracing::warn!(dev_id = self.id, event = "rbd_image_resized", "{why}");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reported_image_size_is_followed_only_when_it_grows_to_whole_blocks() {
        assert_eq!(check_image_size(2 << 30, 1 << 30, 4096), Ok(Some(2 << 30)));
        assert_eq!(check_image_size(1 << 30, 1 << 30, 4096), Ok(None));
        let shrank = check_image_size(1 << 29, 1 << 30, 4096).unwrap_err();
        assert!(shrank.contains("growth only") && shrank.contains("--allow-shrink"), "{shrank}");
        let odd = check_image_size((1 << 30) + 512, 1 << 30, 4096).unwrap_err();
        assert!(odd.contains("not a whole number of 4096-byte blocks"), "{odd}");
        let huge = check_image_size(u64::MAX - 4095, 1 << 30, 4096).unwrap_err();
        assert!(huge.contains("more than the largest device"), "{huge}");
    }

    #[test]
    fn a_shrink_refused_names_the_current_size_and_the_flag() {
        let e = ResizeError::Shrink { id: 3, current: 64 << 20, wanted: 32 << 20 };
        let msg = e.to_string();
        assert!(msg.starts_with("device 3 is 64M (67108864 bytes), and 32M is smaller"), "{msg}");
        assert!(msg.contains("--allow-shrink"), "{msg}");
    }

    #[test]
    fn a_read_only_rbd_device_is_not_resized_and_says_why() {
        let e = ResizeError::RbdReadOnly { id: 2, image: "rbd/disk@snap".into() };
        let msg = e.to_string();
        assert!(msg.contains("rbd/disk@snap read-only"), "{msg}");
        assert!(msg.ends_with("nothing was changed"), "{msg}");
    }

    #[test]
    fn the_kernel_refusal_names_its_release_and_the_one_needed() {
        let release = Some(KernelRelease { major: 6, minor: 12 });
        let msg = ResizeError::KernelLacksUpdateSize { release }.to_string();
        assert!(msg.starts_with("this kernel (6.12) has no UBLK_F_UPDATE_SIZE (Linux 6.16+)"));
        assert!(msg.ends_with("nothing was changed"), "{msg}");
    }

    #[test]
    fn a_plan_grows_only_to_a_larger_size() {
        assert!(ResizePlan { id: 0, from: 1, to: 2 }.grows());
        assert!(!ResizePlan { id: 0, from: 2, to: 1 }.grows());
        assert!(!ResizePlan { id: 0, from: 2, to: 2 }.grows());
    }
}
