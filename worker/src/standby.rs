//! A worker set up for a device but not yet serving it: the shared region mapped, the
//! tags' buffers allocated and the target built while standing by; activation maps the
//! device's descriptor arrays and yields the [`Device`] the queue threads share.

use std::os::fd::{BorrowedFd, OwnedFd};

use ublkd_proto::msg::{DataPath, WorkerSetup};
use ublkd_proto::shm::{Geometry, ShmError, ShmRegion};

use crate::device::{self, DescArray, Device, TagBuffers};
use crate::target::{self, TargetError};

/// Why a worker cannot stand by for, or activate, the device its setup describes.
#[derive(Debug, thiserror::Error)]
pub enum StandbyError {
    #[error("setup has a zero dimension: {0:?}")]
    ZeroDimension(Box<WorkerSetup>),
    #[error("zero copy needs the batched data path; this device is served per-I/O")]
    ZeroCopyPerIo,
    #[error("max_io_buf_bytes {0} is not a positive multiple of the page")]
    BufBytes(usize),
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error("cannot allocate tag buffers: {0}")]
    TagBuffers(std::io::Error),
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error("cannot map queue {q_id}'s descriptors: {source}")]
    Descriptors { q_id: u16, source: std::io::Error },
}

/// A worker set up for a device but not yet serving it.
pub struct Standby {
    setup: WorkerSetup,
    shm: ShmRegion,
    bufs: TagBuffers,
    target: Box<dyn target::Target>,
}

impl Standby {
    /// Maps the shared region, allocates the tags' buffers and builds the target from
    /// `target_fds`.
    pub fn prepare(
        setup: &WorkerSetup,
        shm_fd: BorrowedFd<'_>,
        target_fds: Vec<OwnedFd>,
    ) -> Result<Standby, StandbyError> {
        if setup.nr_queues == 0 || setup.queue_depth == 0 || setup.nr_threads == 0 {
            return Err(StandbyError::ZeroDimension(Box::new(setup.clone())));
        }
        // The per-I/O commands name a buffer address, never a buffer index.
        if setup.zero_copy && setup.data_path == DataPath::PerIo {
            return Err(StandbyError::ZeroCopyPerIo);
        }
        let page = device::page_size();
        let buf_bytes = setup.max_io_buf_bytes as usize;
        if buf_bytes == 0 || !buf_bytes.is_multiple_of(page) {
            return Err(StandbyError::BufBytes(buf_bytes));
        }
        let geometry = Geometry {
            dev_id: setup.dev_id,
            nr_queues: setup.nr_queues,
            queue_depth: setup.queue_depth,
            nr_threads: setup.nr_threads,
        };
        let shm = ShmRegion::open(shm_fd, geometry)?;
        let bufs = TagBuffers::new(setup.nr_queues, setup.queue_depth, buf_bytes)
            .map_err(StandbyError::TagBuffers)?;
        let target = target::build(setup, target_fds)?;
        Ok(Standby { setup: setup.clone(), shm, bufs, target })
    }

    /// The target's file that queue thread `thread`'s ring registers (see
    /// `Target::fixed_file`).
    pub fn target_file(&self, thread: usize) -> Option<BorrowedFd<'_>> {
        self.target.fixed_file(thread)
    }

    /// The target's client identity in its backend (see `Target::client_identity`).
    pub fn client_identity(&self) -> Option<String> {
        self.target.client_identity()
    }

    /// Maps the device's descriptor arrays: from here on this process is the
    /// device's server (the kernel lets one address space map them per incarnation).
    /// `target_fds` are the target's fds that come with the device (an NBD socket);
    /// `fence` the earlier workers' clients the target may fence (rbd).
    pub fn activate(
        self,
        ublkc: BorrowedFd<'_>,
        target_fds: Vec<OwnedFd>,
        fence: &[String],
        generation: u64,
    ) -> Result<Device, StandbyError> {
        let setup = &self.setup;
        self.target.activate(target_fds, fence)?;
        let mut descs = Vec::with_capacity(usize::from(setup.nr_queues));
        for q_id in 0..setup.nr_queues {
            descs.push(
                DescArray::map(ublkc, q_id, setup.queue_depth)
                    .map_err(|source| StandbyError::Descriptors { q_id, source })?,
            );
        }
        Ok(Device {
            dev_id: setup.dev_id,
            nr_queues: setup.nr_queues,
            depth: setup.queue_depth,
            size_bytes: setup.size_bytes,
            descs,
            bufs: self.bufs,
            shm: self.shm,
            target: self.target,
            generation,
            zero_copy: setup.zero_copy,
            data_path: setup.data_path,
        })
    }
}
