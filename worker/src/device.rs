//! The state every thread of a worker shares: the device's geometry, the kernel's
//! descriptor arrays, the tags' data buffers, the shared region and the target.
//!
//! Data modes:
//! - copy (`UBLK_BATCH_F_HAS_BUF_ADDR`), every target but a zero-copy loop device: each
//!   tag has a fixed buffer in the worker, given to the kernel at PREP and again at each
//!   COMMIT; the kernel copies WRITE data into it before delivering the tag and copies
//!   READ data out of it while processing the COMMIT. The buffers are plain worker
//!   memory, lost with the worker, which costs nothing: the kernel re-issues (REISSUE)
//!   every request a dead worker owned. It needs no extra fds, syscalls or io_uring
//!   opcodes beyond the batch commands.
//! - zero copy (`UBLK_F_AUTO_BUF_REG`), loop devices where the kernel has it: a tag
//!   has a buffer index instead of an address; the kernel registers each request's
//!   pages in the fetching ring at that index, and the target reads and writes the
//!   backing file from them with fixed-buffer opcodes, saving the copy.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use ublkd_proto::shm::ShmRegion;
use ublkd_proto::uapi::{self, UblksrvIoDesc};

use crate::target::Target;

/// A read-only mapping of one queue's descriptor array (kernel-written).
#[derive(Debug)]
pub struct DescArray {
    base: NonNull<UblksrvIoDesc>,
    depth: u16,
}

// SAFETY: the mapping is read-only and lives for the process; reading it from any
// thread is as safe as from one (each read is a volatile copy).
unsafe impl Send for DescArray {}
// SAFETY: as above.
unsafe impl Sync for DescArray {}

impl DescArray {
    /// Maps queue `q_id`'s descriptors from `/dev/ublkcN`. The mapping is never
    /// unmapped: it must stay valid for the process's life (the kernel accepts one mm
    /// per incarnation, and the worker is that incarnation).
    pub fn map(ublkc: BorrowedFd<'_>, q_id: u16, depth: u16) -> io::Result<DescArray> {
        let page = page_size();
        let len = uapi::queue_desc_bytes(depth, page);
        let offset = uapi::queue_desc_offset(q_id, page);
        // SAFETY: a new shared read-only mapping of the ublk char device at the offset
        // the driver defines for this queue; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                ublkc.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<UblksrvIoDesc>()).expect("mmap never returns null");
        Ok(DescArray { base, depth })
    }

    /// A copy of tag `tag`'s descriptor, or `None` past the queue's depth.
    pub fn get(&self, tag: u16) -> Option<UblksrvIoDesc> {
        if tag >= self.depth {
            return None;
        }
        // SAFETY: `tag` < depth, so the descriptor lies inside the mapping (the mapping
        // covers `depth` descriptors rounded up to a page); the kernel writes it before
        // delivering the tag, and a volatile read copies whatever is there without
        // assuming it is stable.
        Some(unsafe { std::ptr::read_volatile(self.base.as_ptr().wrapping_add(usize::from(tag))) })
    }
}

/// The tags' data buffers: one anonymous mapping, `buf_bytes` per tag, page aligned
/// (O_DIRECT needs it), populated on first touch.
#[derive(Debug)]
pub struct TagBuffers {
    base: NonNull<u8>,
    depth: u16,
    nr_queues: u16,
    buf_bytes: usize,
}

// SAFETY: the mapping lives for the process; each tag's buffer is used by one thread
// at a time (the thread that fetched the tag), handed over through the kernel.
unsafe impl Send for TagBuffers {}
// SAFETY: as above.
unsafe impl Sync for TagBuffers {}

impl TagBuffers {
    /// Maps the buffers, populated on first touch. Huge pages are turned off for the
    /// mapping: after a recovery the kernel copies the requeued WRITE data into a new
    /// worker's buffers during the first FETCH, and each first touch of a huge page
    /// zeroed 2 MiB inside the stall. Nothing is faulted in ahead: one page per tag
    /// made every idle worker and standby 512 KiB larger (at depth 128), half of an
    /// idle device's memory, for no stall measurable within the recovery benchmark's
    /// noise (medians 87 and 201 ms with it, 128 and 127 ms without, on a busy host).
    pub fn new(nr_queues: u16, depth: u16, buf_bytes: usize) -> io::Result<TagBuffers> {
        let total = usize::from(nr_queues) * usize::from(depth) * buf_bytes;
        let base = map_anonymous(total, libc::MAP_NORESERVE)?;
        // SAFETY: advice on the mapping just made, of its exact length; it changes how
        // the kernel backs the pages, not their contents.
        unsafe { libc::madvise(base.as_ptr().cast(), total, libc::MADV_NOHUGEPAGE) };
        Ok(TagBuffers { base, depth, nr_queues, buf_bytes })
    }

    pub fn buf_bytes(&self) -> usize {
        self.buf_bytes
    }

    /// The buffer of tag `tag` of queue `q_id`, or `None` outside the geometry.
    pub fn get(&self, q_id: u16, tag: u16) -> Option<*mut u8> {
        if q_id >= self.nr_queues || tag >= self.depth {
            return None;
        }
        let index = usize::from(q_id) * usize::from(self.depth) + usize::from(tag);
        Some(self.base.as_ptr().wrapping_add(index * self.buf_bytes))
    }
}

/// A new private anonymous read-write mapping of `len` bytes (page aligned), with
/// extra `flags` (`MAP_POPULATE`, `MAP_NORESERVE`). It is never unmapped by this
/// crate: its users live as long as the worker.
pub fn map_anonymous(len: usize, flags: libc::c_int) -> io::Result<NonNull<u8>> {
    // SAFETY: a new anonymous private mapping with no address hint affects no existing
    // memory; the result is checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(NonNull::new(ptr.cast::<u8>()).expect("mmap never returns null"))
}

/// The system page size.
pub fn page_size() -> usize {
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE);
    page.ok().flatten().and_then(|p| usize::try_from(p).ok()).unwrap_or(4096)
}

/// Everything the queue threads share.
pub struct Device {
    pub dev_id: u32,
    pub nr_queues: u16,
    pub depth: u16,
    pub size_bytes: u64,
    pub descs: Vec<DescArray>,
    pub bufs: TagBuffers,
    pub shm: ShmRegion,
    pub target: Box<dyn Target>,
    pub generation: u64,
    /// `UBLK_F_AUTO_BUF_REG`: requests' pages arrive registered in the fetching ring
    /// (see `WorkerSetup::zero_copy`); `bufs` is not used for their data.
    pub zero_copy: bool,
    /// The ublk commands the queue threads use (see `queue`).
    pub data_path: ublkd_proto::msg::DataPath,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("dev_id", &self.dev_id)
            .field("nr_queues", &self.nr_queues)
            .field("depth", &self.depth)
            .finish_non_exhaustive()
    }
}
