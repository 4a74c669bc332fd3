//! `rbd`: an RBD image of a Ceph cluster, through librbd, which the worker loads at
//! run time ([`ffi`]).
//!
//! - **Standing by.** The worker connects as the setup's client with only the options
//!   the setup carries (it reads no Ceph file), opens the image ([`image`]), and
//!   reports its client's address (`FromWorker::Standby`'s `client`), by which a later
//!   worker of the device may fence it.
//! - **Fencing or nothing.** A writable device on an image without the
//!   exclusive-lock feature is refused at standby ([`check_fenced`]), unless its
//!   config allows it (`allow_unfenced`): nothing could fence a dead worker's writes.
//!   ublkd refuses it at the probe already; the worker checks again what it opened.
//! - **Activation.** Unless the image is a snapshot, the device read-only or the
//!   image without the exclusive-lock feature (allowed, above), the worker breaks the lock of each owner that is one of the device's
//!   earlier workers or that no longer watches the image (dead: a crash or a power
//!   loss), which blocklists it: a write it still has in flight can never land. It
//!   refuses any other owner ([`fence`]), and takes the lock in exclusive mode, which
//!   librbd then gives to no one who asks.
//! - **Size changes.** Once serving, the worker watches the image (librbd's
//!   `rbd_update_watch`): when its size changes (an `rbd resize` anywhere, which
//!   librbd has this worker, the lock's owner, carry out), it tells ublkd
//!   (`FromWorker::ImageResized`), which checks the size and resizes the device as
//!   `ublkctl resize` does, with a worker set up with the new size. A worker set up
//!   with a size larger than the image (the device was resized) grows the image first.
//! - **Requests.** Each request is one librbd call (`rbd_aio_read`, `_write`,
//!   `_flush`, `_discard`, `_write_zeroes`) straight on the tag's buffer, then
//!   [`Step::Pending`]. librbd finishes it on a thread of its own, which hands it back
//!   to the queue thread that started it ([`completion`]): a list per queue thread and
//!   an eventfd read by that thread's ring.
//! - **Durability.** ublkd turns librbd's cache off (and the worker again, after the
//!   setup's options), so a completed write is on the OSDs: FUA needs nothing more,
//!   and FLUSH is passed on as `rbd_aio_flush`, which then has nothing to write back.
//! - **Failures hold I/O.** librbd waits for an OSD for as long as it takes
//!   (`rados_osd_op_timeout` 0). A request refused because this client was
//!   blocklisted (`ESHUTDOWN`, a newer worker fenced it) is not completed: the worker
//!   ends with [`WorkerExit::Fenced`] and the kernel re-issues what it held.
//! - **A delete never waits on the cluster.** Told that its device is being deleted
//!   and its stop waits on held requests (`ToWorker::GiveUpHeld`), the worker fails
//!   every request librbd holds with EIO at once, and every new one
//!   ([`Completions::give_up`]): the kernel's stop then goes on.

mod completion;
mod fence;
pub mod ffi;
#[cfg(all(test, feature = "rbd-host-tests"))]
mod host_tests;
pub mod image;

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::time::Instant;

use ublkd_proto::errno::Errno;
use ublkd_proto::exit::WorkerExit;
use ublkd_proto::msg::FromWorker;
use ublkd_proto::msg::rbd::{RbdSetup, Unfenced, check_fenced};
use ublkd_proto::uapi::{
    UBLK_IO_F_NOUNMAP, UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ, UBLK_IO_OP_WRITE,
    UBLK_IO_OP_WRITE_ZEROES,
};

use self::completion::Completions;
use self::fence::LockedByOther;
use self::ffi::Lib;
use self::image::{OpenError, RbdImage};
use super::{IoReq, Step, Target, TargetError, TargetWork};

/// The key of a queue thread's READ of its eventfd (the target has no other SQE).
const KEY_WAKE: u32 = 1;

/// Why an rbd target cannot stand by or activate.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(
        "image {spec} is {got} bytes, smaller than the device's {want}, and a snapshot or \
         a read-only device cannot grow it"
    )]
    TooSmall { spec: String, got: u64, want: u64 },
    #[error("cannot grow image {spec} from {from} to {to} bytes, the device's size: {errno}")]
    Grow { spec: String, from: u64, to: u64, errno: Errno },
    #[error("cannot read this worker's Ceph client address: {0}")]
    Address(Errno),
    #[error("cannot make queue thread {thread}'s completion eventfd: {source}")]
    Eventfd { thread: usize, source: std::io::Error },
    #[error(transparent)]
    LockedByOther(#[from] LockedByOther),
    #[error(transparent)]
    Unfenced(#[from] Unfenced),
    #[error("cannot list the owners of image {spec}'s lock: {errno}")]
    LockOwners { spec: String, errno: Errno },
    #[error(
        "cannot list the clients watching image {spec} (which tells a dead lock owner \
         from a live one): {errno}"
    )]
    Watchers { spec: String, errno: Errno },
    #[error(
        "cannot break client {owner}'s lock on image {spec} (which blocklists it; \
         this client's mon caps need `profile rbd`): {errno}"
    )]
    Break { spec: String, owner: String, errno: Errno },
    #[error("cannot take image {spec}'s exclusive lock: {errno}")]
    Acquire { spec: String, errno: Errno },
}

/// The control socket (`--control-fd`), open for the process's life: where
/// [`on_update`] reports a size change from librbd's thread. -1: not an rbd worker.
static CONTROL_FD: AtomicI32 = AtomicI32::new(-1);

/// Records the worker's control socket (`main`, for a worker started with `--rbd`).
pub fn set_control_fd(fd: RawFd) {
    CONTROL_FD.store(fd, Ordering::Relaxed);
}

/// What librbd's update callback needs: the image, and the size last reported (or
/// served), so that only a change is reported. Leaked once per worker: librbd may call
/// back until the image is closed, which happens only as the process ends.
struct SizeWatch {
    lib: &'static Lib,
    image: ffi::Image,
    spec: String,
    size: AtomicU64,
}

// SAFETY: librbd's image handle may be used from any thread (see `RbdImage`); the rest
// is plain data and an atomic.
unsafe impl Send for SizeWatch {}
// SAFETY: as above.
unsafe impl Sync for SizeWatch {}

impl SizeWatch {
    /// The image's size now; if it changed, tells ublkd.
    fn check(&self) {
        let mut size = 0u64;
        // SAFETY: the image stays open while librbd calls back (see `SizeWatch`).
        let rc = unsafe { (self.lib.rbd_get_size)(self.image, &mut size) };
        if rc < 0 {
            tracing::warn!(
                image = self.spec.as_str(),
                "cannot read the image's size after a change of its header: {}",
                std::io::Error::from_raw_os_error(-rc)
            );
            return;
        }
        let was = self.size.swap(size, Ordering::Relaxed);
        if was == size {
            return;
        }
        tracing::info!(
            image = self.spec.as_str(),
            event = "rbd_image_resized",
            "the image was resized from {was} to {size} bytes; telling ublkd"
        );
        let fd = CONTROL_FD.load(Ordering::Relaxed);
        if fd < 0 {
            return;
        }
        // SAFETY: the control socket is open for the process's life (`main` owns it in
        // a frame that never returns while the worker serves).
        let control = unsafe { BorrowedFd::borrow_raw(fd) };
        // Never waits: ublkd reads these on its ticks, and one lost leaves the device
        // at its old size, which the next change (or `ublkctl resize`) sets right.
        if let Err(e) = ublkd_proto::msg::try_send_packet(
            control,
            &FromWorker::ImageResized { size_bytes: size },
            &[],
        ) {
            tracing::warn!(image = self.spec.as_str(), "cannot tell ublkd of the new size: {e}");
        }
    }
}

/// librbd's update callback: on one of librbd's threads, after the image's header
/// changed.
///
/// # Safety
///
/// `arg` is the leaked [`SizeWatch`] that [`RbdTarget::watch_size`] registered.
unsafe extern "C" fn on_update(arg: *mut c_void) {
    // SAFETY: the caller's promise: a `SizeWatch` that is never freed.
    let watch = unsafe { &*arg.cast::<SizeWatch>() };
    watch.check();
}

/// An open image and, per queue thread, where librbd's completions go.
#[derive(Debug)]
pub struct RbdTarget {
    image: RbdImage,
    /// This worker's Ceph client address (see `FromWorker::Standby`'s `client`).
    client: String,
    /// The image is a snapshot, or the device read-only (its writes never reach
    /// the target, see `ReadOnlyTarget`): no lock is taken.
    read_only: bool,
    exclusive_lock: bool,
    /// One per queue thread, by its plan's index.
    threads: Vec<Arc<Completions>>,
}

/// What librbd's callback needs of one request, boxed and handed to librbd as its
/// completion's argument at submission, and taken back once in [`on_complete`].
struct InFlight {
    lib: &'static Lib,
    thread: Arc<Completions>,
    user_data: u64,
    op: u8,
    len: u32,
}

impl RbdTarget {
    /// Connects, opens the image (see [`RbdImage::open`]) and makes a completion list
    /// for each of `nr_threads` queue threads; the image must hold `size` bytes, and a
    /// writable device (not `device_read_only`) needs the exclusive-lock feature unless
    /// the setup allows it unfenced.
    pub fn new(
        setup: &RbdSetup,
        size: u64,
        nr_threads: u16,
        device_read_only: bool,
    ) -> Result<Self, RbdError> {
        let started = Instant::now();
        let image = RbdImage::open(setup)?;
        let facts = image.describe()?;
        check_fenced(image.spec(), &facts, device_read_only, setup.allow_unfenced)?;
        if facts.size_bytes < size {
            let spec = image.spec().to_string();
            if facts.read_only || device_read_only {
                return Err(RbdError::TooSmall { spec, got: facts.size_bytes, want: size });
            }
            // The device was resized (`ublkctl resize`, whose record ublkd rewrote
            // before starting this worker): the image grows to it before it is served.
            // A smaller device never shrinks the image: what lies past its end stays,
            // as a loop device's file keeps it.
            let started = Instant::now();
            image.resize(size).map_err(|errno| RbdError::Grow {
                spec: spec.clone(),
                from: facts.size_bytes,
                to: size,
                errno,
            })?;
            tracing::info!(
                image = spec.as_str(),
                event = "rbd_image_grown",
                "grew the image from {} to {} bytes, the device's size ({} ms)",
                facts.size_bytes,
                size,
                started.elapsed().as_millis()
            );
        }
        let client = image.client_address().map_err(RbdError::Address)?;
        let threads = (0..usize::from(nr_threads.max(1)))
            .map(|thread| {
                Completions::new()
                    .map(Arc::new)
                    .map_err(|source| RbdError::Eventfd { thread, source })
            })
            .collect::<Result<_, _>>()?;
        tracing::info!(
            image = image.spec(),
            client = client.as_str(),
            "opened in {} ms ({} bytes, objects of {} bytes{})",
            started.elapsed().as_millis(),
            facts.size_bytes,
            facts.object_size,
            if facts.read_only { ", read-only" } else { "" }
        );
        Ok(RbdTarget {
            image,
            client,
            read_only: facts.read_only || device_read_only,
            exclusive_lock: facts.exclusive_lock,
            threads,
        })
    }

    /// Takes the image's exclusive lock, first breaking (so blocklisting) every owner
    /// that `fence` names; any other owner refuses the activation.
    fn take_lock(&self, fence: &[String]) -> Result<(), RbdError> {
        let spec = self.image.spec();
        if self.read_only {
            return Ok(());
        }
        if !self.exclusive_lock {
            // Only where the config allowed it (`new` refused it otherwise).
            tracing::warn!(
                image = spec,
                "serving without the exclusive-lock feature, as allow_unfenced allows: \
                 nothing fences an earlier worker's writes still in flight (`rbd feature \
                 enable {spec} exclusive-lock`)"
            );
            return Ok(());
        }
        let (mode, owners) = self
            .image
            .lock_owners()
            .map_err(|errno| RbdError::LockOwners { spec: spec.to_string(), errno })?;
        // Only asked when someone holds the lock: who of them is still alive.
        let watchers = if owners.is_empty() {
            Vec::new()
        } else {
            self.image
                .watchers()
                .map_err(|errno| RbdError::Watchers { spec: spec.to_string(), errno })?
        };
        for owner in fence::owners_to_break(spec, &owners, fence, &watchers)? {
            let whose = if fence.iter().any(|f| f == owner) {
                "an earlier worker's client"
            } else {
                "a client that no longer watches the image (it crashed or lost power)"
            };
            let started = Instant::now();
            self.image.break_lock(mode, owner).map_err(|errno| RbdError::Break {
                spec: spec.to_string(),
                owner: owner.to_string(),
                errno,
            })?;
            tracing::info!(
                image = spec,
                event = "rbd_fenced",
                "broke the lock of {whose}, {owner}, which blocklisted it ({} ms)",
                started.elapsed().as_millis()
            );
        }
        self.image
            .acquire_exclusive()
            .map_err(|errno| RbdError::Acquire { spec: spec.to_string(), errno })
    }

    /// Has librbd report the image's size changes to ublkd from now on ([`SizeWatch`]),
    /// from the size the image has now (a change before this is the device's own,
    /// which the worker was set up with). A snapshot's size never changes. Without the
    /// watch the device still serves, at the size it has.
    fn watch_size(&self) {
        if self.image.is_snapshot() {
            return;
        }
        let spec = self.image.spec().to_string();
        let size = match self.image.size() {
            Ok(size) => size,
            Err(errno) => {
                tracing::warn!(image = spec.as_str(), "cannot read the image's size: {errno}");
                return;
            }
        };
        let watch = Box::leak(Box::new(SizeWatch {
            lib: self.image.lib(),
            image: self.image.handle(),
            spec: spec.clone(),
            size: AtomicU64::new(size),
        }));
        let arg: *mut SizeWatch = watch;
        // SAFETY: `watch` is leaked, so valid for the process's life; `on_update` only
        // reads it and the open image, from any thread.
        if let Err(errno) = unsafe { self.image.update_watch(on_update, arg.cast()) } {
            tracing::warn!(
                image = spec.as_str(),
                "cannot watch the image for size changes ({errno}): an `rbd resize` reaches \
                 the device only through `ublkctl resize`"
            );
        }
    }

    /// Starts `req` in librbd, to be finished by [`on_complete`]; `Err` with the
    /// result to commit if librbd did not take it.
    fn submit(&self, req: &IoReq, thread: &Arc<Completions>) -> Result<(), i32> {
        let lib = self.image.lib();
        let image = self.image.handle();
        // Held from here (a callback may come before librbd's call returns), unless the
        // held requests were given up: the device is being deleted.
        if !thread.hand_over(req.reply.user_data) {
            return Err(-libc::EIO);
        }
        let in_flight = Box::into_raw(Box::new(InFlight {
            lib,
            thread: Arc::clone(thread),
            user_data: req.reply.user_data,
            op: req.op,
            len: req.len,
        }));
        let mut c: ffi::Completion = std::ptr::null_mut();
        // SAFETY: `in_flight` is a live allocation handed to librbd as the callback's
        // argument; `on_complete` has the callback's signature; `c` is written on
        // success.
        let rc = unsafe { (lib.rbd_aio_create_completion)(in_flight.cast(), on_complete, &mut c) };
        if rc < 0 {
            thread.refused(req.reply.user_data);
            // SAFETY: librbd did not take the argument: it is still ours, freed once.
            drop(unsafe { Box::from_raw(in_flight) });
            return Err(rc);
        }
        let (offset, len) = (req.offset, req.len as usize);
        // SAFETY: an open image and a fresh completion. A READ's or WRITE's `req.buf`
        // holds `len` bytes (`IoReq::from_desc` checked `len` against the tag's
        // buffer, and `start` refused a null one) and belongs to the request until its
        // result is committed, which only `on_complete` leads to, after librbd is done
        // with the buffer.
        let rc = unsafe {
            match req.op {
                UBLK_IO_OP_READ => (lib.rbd_aio_read)(image, offset, len, req.buf.cast(), c),
                UBLK_IO_OP_WRITE => (lib.rbd_aio_write)(image, offset, len, req.buf.cast(), c),
                UBLK_IO_OP_FLUSH => (lib.rbd_aio_flush)(image, c),
                UBLK_IO_OP_DISCARD => (lib.rbd_aio_discard)(image, offset, len as u64, c),
                _ => (lib.rbd_aio_write_zeroes)(image, offset, len, c, zero_flags(req.flags), 0),
            }
        };
        if rc < 0 {
            // librbd refused the request up front and will not call back (its C API
            // reports every failure through the completion once it took the request).
            thread.refused(req.reply.user_data);
            // SAFETY: the completion is ours again, released once; so is the argument.
            unsafe { (lib.rbd_aio_release)(c) };
            // SAFETY: as above.
            drop(unsafe { Box::from_raw(in_flight) });
            return Err(rc);
        }
        Ok(())
    }
}

/// `rbd_aio_write_zeroes`'s flags for a WRITE_ZEROES with `flags`: with
/// `UBLK_IO_F_NOUNMAP` the range must stay allocated (thick-provisioned), else librbd
/// may deallocate it.
fn zero_flags(flags: u32) -> libc::c_int {
    if flags & UBLK_IO_F_NOUNMAP != 0 { ffi::WRITE_ZEROES_FLAG_THICK_PROVISION } else { 0 }
}

/// The result to commit for a request of `op` over `len` bytes that librbd finished
/// with `ret`: a READ is whole only if librbd read all of it (a short read would
/// return stale bytes); a WRITE reports its bytes; the rest 0; an error its `-errno`,
/// but for a request the cluster did not answer within `rados_osd_op_timeout`
/// (`recovery.rbd_cluster_wait_secs`): EIO, as a disk that gave up says it (the block
/// layer would pass ETIMEDOUT through).
fn result(op: u8, len: u32, ret: isize) -> i32 {
    if ret == -(libc::ETIMEDOUT as isize) {
        return -libc::EIO;
    }
    if ret < 0 {
        return i32::try_from(ret).unwrap_or(-libc::EIO);
    }
    match op {
        UBLK_IO_OP_READ if ret == len as isize => len as i32,
        UBLK_IO_OP_READ => -libc::EIO,
        UBLK_IO_OP_WRITE => len as i32,
        _ => 0,
    }
}

/// Whether librbd's `ret` means this client was blocklisted (`EBLOCKLISTED`, which
/// Ceph defines as `ESHUTDOWN`).
fn fenced(ret: isize) -> bool {
    ret == -(libc::ESHUTDOWN as isize)
}

/// Ends the worker at once, without completing anything more: `_exit`, not `exit`,
/// since librados's threads keep running while C++ destructors would run at `exit`.
fn end(code: WorkerExit) -> ! {
    crate::sys::exit_now(i32::from(code.code()))
}

/// librbd's callback: on one of librbd's threads, once per request.
///
/// # Safety
///
/// `arg` is the `InFlight` that [`RbdTarget::submit`] boxed for completion `c`, and
/// librbd calls this once for it.
unsafe extern "C" fn on_complete(c: ffi::Completion, arg: *mut c_void) {
    // SAFETY: the caller's promise: `arg` is our box, given back once.
    let in_flight = unsafe { Box::from_raw(arg.cast::<InFlight>()) };
    let lib = in_flight.lib;
    // SAFETY: a completion librbd has completed; released once, after its value was
    // read.
    let ret = unsafe { (lib.rbd_aio_get_return_value)(c) };
    // SAFETY: as above.
    unsafe { (lib.rbd_aio_release)(c) };
    if fenced(ret) {
        tracing::error!(
            event = "rbd_fenced",
            "this worker's Ceph client was blocklisted (a newer worker of the device took \
             the image): ending without completing its requests, which the kernel \
             re-issues"
        );
        end(WorkerExit::Fenced);
    }
    let res = result(in_flight.op, in_flight.len, ret);
    in_flight.thread.push((in_flight.user_data, res));
}

impl Target for RbdTarget {
    fn start(&self, req: &IoReq) -> Step {
        match req.op {
            UBLK_IO_OP_READ | UBLK_IO_OP_WRITE if req.buf.is_null() => {
                // Zero copy is never set up for rbd devices.
                return Step::Done(-libc::EIO);
            }
            UBLK_IO_OP_READ
            | UBLK_IO_OP_WRITE
            | UBLK_IO_OP_FLUSH
            | UBLK_IO_OP_DISCARD
            | UBLK_IO_OP_WRITE_ZEROES => {}
            _ => return Step::Done(-libc::EOPNOTSUPP),
        }
        let Some(thread) = self.threads.get(usize::from(req.reply.thread)) else {
            return Step::Done(-libc::EIO);
        };
        match self.submit(req, thread) {
            Ok(()) => Step::Pending,
            Err(rc) => Step::Done(rc),
        }
    }

    fn on_cqe(&self, _req: &IoReq, res: i32, _done: &mut u32) -> Step {
        // The request's result, as `on_complete` computed it.
        Step::Done(res)
    }

    fn arm(&self, thread: usize, work: &mut TargetWork) {
        if let Some(completions) = self.threads.get(thread) {
            work.sqes.push(completions.wait_sqe(KEY_WAKE));
        }
    }

    fn on_own_cqe(&self, thread: usize, _key: u32, res: i32, work: &mut TargetWork) {
        let Some(completions) = self.threads.get(thread) else { return };
        if res < 0 && res != -libc::EINTR {
            tracing::error!(
                thread,
                "cannot wait for librbd's completions: {}",
                std::io::Error::from_raw_os_error(-res)
            );
            end(WorkerExit::DataPath);
        }
        completions.take_into(&mut work.done);
        work.sqes.push(completions.wait_sqe(KEY_WAKE));
    }

    fn fixed_file(&self, thread: usize) -> Option<BorrowedFd<'_>> {
        self.threads.get(thread).map(|c| c.wake_fd())
    }

    fn activate(&self, fds: Vec<OwnedFd>, fence: &[String]) -> Result<(), TargetError> {
        if !fds.is_empty() {
            return Err(TargetError::Fds { target: "rbd", want: 0, got: fds.len() });
        }
        self.take_lock(fence)?;
        self.watch_size();
        Ok(())
    }

    fn client_identity(&self) -> Option<String> {
        Some(self.client.clone())
    }

    fn give_up_held(&self) -> usize {
        let given_up: usize = self.threads.iter().map(|t| t.give_up()).sum();
        tracing::warn!(
            image = self.image.spec(),
            event = "rbd_held_given_up",
            "the device is being deleted: failed the {given_up} request(s) the Ceph cluster \
             has not answered with EIO, and fail every new one"
        );
        given_up
    }

    fn release(&self) {
        if self.read_only || !self.exclusive_lock {
            return;
        }
        match self.image.release_lock() {
            Ok(()) => tracing::info!(image = self.image.spec(), "exclusive lock released"),
            Err(errno) => tracing::warn!(
                image = self.image.spec(),
                "cannot release the exclusive lock ({errno}); the next user breaks it"
            ),
        }
    }

    unsafe fn close(&self) {
        // SAFETY: the caller's promise (see `Target::close`): no queue thread submits a
        // request to the image any more.
        unsafe { self.image.close() };
        tracing::info!(image = self.image.spec(), "image closed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_is_whole_or_an_error() {
        assert_eq!(result(UBLK_IO_OP_READ, 4096, 4096), 4096);
        assert_eq!(result(UBLK_IO_OP_READ, 4096, 512), -libc::EIO);
        assert_eq!(result(UBLK_IO_OP_READ, 4096, -(libc::EIO as isize)), -libc::EIO);
    }

    #[test]
    fn a_write_reports_its_bytes_and_the_rest_zero() {
        assert_eq!(result(UBLK_IO_OP_WRITE, 8192, 0), 8192);
        for op in [UBLK_IO_OP_FLUSH, UBLK_IO_OP_DISCARD, UBLK_IO_OP_WRITE_ZEROES] {
            assert_eq!(result(op, 8192, 0), 0);
        }
    }

    #[test]
    fn errors_pass_through_and_an_absurd_one_is_eio() {
        assert_eq!(result(UBLK_IO_OP_WRITE, 512, -(libc::ENOSPC as isize)), -libc::ENOSPC);
        assert_eq!(result(UBLK_IO_OP_FLUSH, 0, isize::MIN), -libc::EIO);
        assert_eq!(result(UBLK_IO_OP_READ, 4096, -(libc::ETIMEDOUT as isize)), -libc::EIO);
    }

    #[test]
    fn only_eshutdown_means_fenced() {
        assert!(fenced(-108));
        assert!(!fenced(-(libc::EROFS as isize)));
        assert!(!fenced(-(libc::ETIMEDOUT as isize)));
        assert!(!fenced(0));
    }

    #[test]
    fn nounmap_keeps_zeroed_blocks_allocated() {
        assert_eq!(zero_flags(UBLK_IO_F_NOUNMAP), ffi::WRITE_ZEROES_FLAG_THICK_PROVISION);
        assert_eq!(zero_flags(0), 0);
    }
}
