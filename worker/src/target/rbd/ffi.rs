//! librbd and librados, loaded at run time: the C types and the signatures of exactly
//! the functions the rbd target calls, restated by hand from Ceph's headers
//! (`rbd/librbd.h` of librbd 1.16.0 and `rados/librados.h`, Ceph 16 Pacific). Nothing
//! links them at build time, so a host without Ceph builds the worker and runs every
//! other target; an rbd worker there fails with [`LoadError::Missing`].
//!
//! The libraries are opened once per process ([`preload`], from `main` before the
//! sandbox empties the filesystem) and never closed: every function pointer here is
//! valid for the process's life.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

/// `rados_t`: a cluster handle.
pub type Rados = *mut c_void;
/// `rados_ioctx_t`: a pool (and namespace) handle.
pub type Ioctx = *mut c_void;
/// `rbd_image_t`: an open image.
pub type Image = *mut c_void;
/// `rbd_completion_t`: one asynchronous request's completion.
pub type Completion = *mut c_void;
/// `rbd_callback_t`: called once per completion, on one of librbd's threads.
pub type Callback = unsafe extern "C" fn(c: Completion, arg: *mut c_void);

/// `rbd_update_callback_t`: called on one of librbd's threads after the image's
/// header changed (its size, among others), as `rbd_update_watch` registered it.
pub type UpdateCallback = unsafe extern "C" fn(arg: *mut c_void);

/// `rbd_lock_mode_t` (a C enum: an `int`).
pub type LockMode = c_int;
/// `RBD_LOCK_MODE_EXCLUSIVE`.
pub const LOCK_MODE_EXCLUSIVE: LockMode = 0;

/// `RBD_FEATURE_EXCLUSIVE_LOCK` (`rbd/features.h`).
pub const FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;

/// `RBD_WRITE_ZEROES_FLAG_THICK_PROVISION`: the zeroed range stays allocated (what
/// `UBLK_IO_F_NOUNMAP` asks for); without it librbd may deallocate it.
pub const WRITE_ZEROES_FLAG_THICK_PROVISION: c_int = 1;

/// `rbd_image_info_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ImageInfo {
    pub size: u64,
    pub obj_size: u64,
    pub num_objs: u64,
    pub order: c_int,
    pub block_name_prefix: [c_char; 24],
    pub parent_pool: i64,
    pub parent_name: [c_char; 96],
}

// Checked against the header with a C compiler (sizeof and offsetof).
const _: () = assert!(size_of::<ImageInfo>() == 160);
const _: () = assert!(core::mem::offset_of!(ImageInfo, order) == 24);
const _: () = assert!(core::mem::offset_of!(ImageInfo, parent_pool) == 56);
const _: () = assert!(core::mem::offset_of!(ImageInfo, parent_name) == 64);

/// `rbd_image_watcher_t`: one client watching the image's header (every client that
/// has it open does; a crashed one stops once the OSD's watch timeout passes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ImageWatcher {
    /// The client's address, as `rbd_lock_get_owners` names a lock owner.
    pub addr: *mut c_char,
    pub id: i64,
    pub cookie: u64,
}

// A pointer and two 64-bit integers, as the header declares them (Ceph 13 Mimic on).
const _: () = assert!(size_of::<ImageWatcher>() == 24);
const _: () = assert!(core::mem::offset_of!(ImageWatcher, cookie) == 16);

/// The shared object files, by their sonames.
pub const LIBRBD: &str = "librbd.so.1";
pub const LIBRADOS: &str = "librados.so.2";

/// Why librbd cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    #[error("the rbd target needs {what} ({file}): install Debian's {package} package ({cause})")]
    Missing { what: &'static str, file: &'static str, package: &'static str, cause: String },
    #[error("{file} has no {symbol}: this Ceph client library is too old for the rbd target")]
    Symbol { file: &'static str, symbol: &'static str },
    #[error(
        "librbd was not loaded before the sandbox went up: ublkd starts an rbd worker \
         with --rbd"
    )]
    NotPreloaded,
}

/// Declares [`Lib`], the functions the rbd target calls, and `resolve`, which looks
/// each of them up in its library: one list, in which a function is named once, with
/// the signature its header declares.
macro_rules! functions {
    ($($library:ident in $file:ident { $($name:ident: $signature:ty,)* })*) => {
        /// The functions the rbd target calls, resolved once.
        #[derive(Debug)]
        pub struct Lib {
            $($(pub $name: $signature,)*)*
            /// Kept open for the process's life: the pointers above point into them.
            _libraries: [Library; 2],
        }

        fn resolve($($library: Library),*) -> Result<Lib, LoadError> {
            Ok(Lib {
                $($(
                    // SAFETY: the field's type is the function's signature as the header
                    // declares it (stated once, in the list `Lib` is declared from).
                    $name: unsafe { symbol(&$library, $file, stringify!($name))? },
                )*)*
                _libraries: [$($library),*],
            })
        }
    };
}

functions! {
    rados in LIBRADOS {
        rados_create2: unsafe extern "C" fn(*mut Rados, *const c_char, *const c_char, u64) -> c_int,
        rados_conf_set: unsafe extern "C" fn(Rados, *const c_char, *const c_char) -> c_int,
        rados_connect: unsafe extern "C" fn(Rados) -> c_int,
        rados_shutdown: unsafe extern "C" fn(Rados),
        rados_getaddrs: unsafe extern "C" fn(Rados, *mut *mut c_char) -> c_int,
        rados_buffer_free: unsafe extern "C" fn(*mut c_char),
        rados_ioctx_create: unsafe extern "C" fn(Rados, *const c_char, *mut Ioctx) -> c_int,
        rados_ioctx_destroy: unsafe extern "C" fn(Ioctx),
        rados_ioctx_set_namespace: unsafe extern "C" fn(Ioctx, *const c_char),
    }
    rbd in LIBRBD {
        rbd_open: unsafe extern "C" fn(Ioctx, *const c_char, *mut Image, *const c_char) -> c_int,
        rbd_open_read_only:
            unsafe extern "C" fn(Ioctx, *const c_char, *mut Image, *const c_char) -> c_int,
        rbd_close: unsafe extern "C" fn(Image) -> c_int,
        rbd_stat: unsafe extern "C" fn(Image, *mut ImageInfo, usize) -> c_int,
        rbd_get_features: unsafe extern "C" fn(Image, *mut u64) -> c_int,
        rbd_get_size: unsafe extern "C" fn(Image, *mut u64) -> c_int,
        rbd_resize: unsafe extern "C" fn(Image, u64) -> c_int,
        rbd_update_watch:
            unsafe extern "C" fn(Image, *mut u64, UpdateCallback, *mut c_void) -> c_int,
        rbd_lock_acquire: unsafe extern "C" fn(Image, LockMode) -> c_int,
        rbd_lock_release: unsafe extern "C" fn(Image) -> c_int,
        rbd_lock_get_owners:
            unsafe extern "C" fn(Image, *mut LockMode, *mut *mut c_char, *mut usize) -> c_int,
        rbd_lock_get_owners_cleanup: unsafe extern "C" fn(*mut *mut c_char, usize),
        rbd_lock_break: unsafe extern "C" fn(Image, LockMode, *const c_char) -> c_int,
        rbd_watchers_list: unsafe extern "C" fn(Image, *mut ImageWatcher, *mut usize) -> c_int,
        rbd_watchers_list_cleanup: unsafe extern "C" fn(*mut ImageWatcher, usize),
        rbd_aio_create_completion:
            unsafe extern "C" fn(*mut c_void, Callback, *mut Completion) -> c_int,
        rbd_aio_get_return_value: unsafe extern "C" fn(Completion) -> isize,
        rbd_aio_release: unsafe extern "C" fn(Completion),
        rbd_aio_read: unsafe extern "C" fn(Image, u64, usize, *mut c_char, Completion) -> c_int,
        rbd_aio_write: unsafe extern "C" fn(Image, u64, usize, *const c_char, Completion) -> c_int,
        rbd_aio_flush: unsafe extern "C" fn(Image, Completion) -> c_int,
        rbd_aio_discard: unsafe extern "C" fn(Image, u64, u64, Completion) -> c_int,
        rbd_aio_write_zeroes:
            unsafe extern "C" fn(Image, u64, usize, Completion, c_int, c_int) -> c_int,
    }
}

static LIB: OnceLock<Result<Lib, LoadError>> = OnceLock::new();

/// Opens librados and librbd now, if not yet (`main`, for a worker started with
/// `--rbd`, before the sandbox; the probe). A failure is kept and reported by
/// [`lib`].
pub fn preload() -> Result<&'static Lib, LoadError> {
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// The loaded libraries. Loads them now where that is still possible (an unsandboxed
/// worker); a sandboxed worker must have preloaded them, since its filesystem is
/// empty (and opening a file would trap).
pub fn lib() -> Result<&'static Lib, LoadError> {
    match LIB.get() {
        Some(loaded) => loaded.as_ref().map_err(Clone::clone),
        None if crate::sandbox::applied() => Err(LoadError::NotPreloaded),
        None => preload(),
    }
}

fn open(
    file: &'static str,
    what: &'static str,
    package: &'static str,
) -> Result<Library, LoadError> {
    // SAFETY: loading a Ceph client library runs its initialisers (C++ static
    // constructors), which set up the library's own state and start no thread; the
    // library is never unloaded, so nothing it registers outlives it.
    unsafe { Library::open(Some(file), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| LoadError::Missing {
        what,
        file,
        package,
        cause: e.to_string(),
    })
}

/// Resolves `name` in `library` as a `T`.
///
/// # Safety
///
/// `T` must be the function pointer type of the C function `name` as its header
/// declares it.
unsafe fn symbol<T: Copy>(
    library: &Library,
    file: &'static str,
    name: &'static str,
) -> Result<T, LoadError> {
    let mut c_name = Vec::with_capacity(name.len() + 1);
    c_name.extend_from_slice(name.as_bytes());
    c_name.push(0);
    // SAFETY: the caller promises that `T` is the symbol's type.
    let symbol = unsafe { library.get::<T>(&c_name) };
    symbol.map(|s| *s).map_err(|_| LoadError::Symbol { file, symbol: name })
}

fn load() -> Result<Lib, LoadError> {
    let rados = open(LIBRADOS, "librados", "librados2")?;
    let rbd = open(LIBRBD, "librbd", "librbd1")?;
    resolve(rados, rbd)
}
