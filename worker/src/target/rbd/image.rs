//! An RBD image opened through librbd, as the target and the probe use it: connecting
//! to the cluster with only what [`RbdSetup`] says (no Ceph file is read), opening the
//! image, what it is, its exclusive lock, and the refusals each step can meet, in
//! words that name what was wrong.

use std::ffi::{CStr, CString, c_char};
use std::ptr;
use std::sync::Mutex;

use ublkd_proto::errno::Errno;
use ublkd_proto::msg::rbd::{RbdProbe, RbdSetup, SECRET_OPTIONS};

use super::ffi::{self, Lib, LoadError};

/// Why the image cannot be opened: one line each, naming what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Library(#[from] LoadError),
    #[error("the {what} {value:?} contains a NUL byte")]
    Nul { what: &'static str, value: String },
    #[error("cannot create a RADOS client for client.{client}: {errno}")]
    Create { client: String, errno: Errno },
    #[error("Ceph refused the option {name} = {value}: {errno}")]
    Option { name: String, value: String, errno: Errno },
    #[error("the cluster refused client.{client}'s key")]
    KeyRefused { client: String },
    #[error("no monitor of the cluster answered within {secs} s (mon_host {mon_host})")]
    MonTimeout { secs: u32, mon_host: String },
    #[error("no monitor address is known: the setup has no mon_host")]
    NoMonHost,
    #[error(
        "cannot connect to the cluster as client.{client}: its key or mon_host ({mon_host}) is malformed"
    )]
    Malformed { client: String, mon_host: String },
    #[error("cannot connect to the cluster (mon_host {mon_host}) as client.{client}: {errno}")]
    Connect { client: String, mon_host: String, errno: Errno },
    #[error("pool {pool} does not exist")]
    NoPool { pool: String },
    #[error("cannot open pool {pool} as client.{client}: {errno}")]
    Pool { pool: String, client: String, errno: Errno },
    #[error("image {spec} does not exist")]
    NoImage { spec: String },
    #[error("image {image} has no snapshot {snapshot}, or does not exist")]
    NoSnapshot { image: String, snapshot: String },
    #[error("client.{client} may not open image {spec} (its caps: {errno})")]
    Denied { client: String, spec: String, errno: Errno },
    #[error("cannot open image {spec}: {errno}")]
    Open { spec: String, errno: Errno },
    #[error("cannot read {what} of image {spec}: {errno}")]
    Query { what: &'static str, spec: String, errno: Errno },
}

/// `-rc` as an [`Errno`] (librados and librbd return `-errno`).
fn errno(rc: impl Into<i64>) -> Errno {
    Errno(i32::try_from(rc.into().unsigned_abs()).unwrap_or(i32::MAX))
}

fn c_string(what: &'static str, value: &str) -> Result<CString, OpenError> {
    CString::new(value)
        .map_err(|_| OpenError::Nul { what, value: value.escape_debug().to_string() })
}

/// The value of option `name` in `setup` (the last one set wins, as with
/// `rados_conf_set`), Ceph's spellings of a name (`mon host`, `mon-host`) alike.
fn option<'a>(setup: &'a RbdSetup, name: &str) -> Option<&'a str> {
    let canonical = |n: &str| n.replace([' ', '-'], "_");
    setup.options.iter().rev().find(|(k, _)| canonical(k) == name).map(|(_, v)| v.as_str())
}

/// What [`RbdImage::open`] sets after the setup's own options, so that they hold whatever
/// the options said: connecting gives up after `connect_timeout_secs`; librbd's cache
/// is off, so that a completed write is on the OSDs (which makes FUA free and FLUSH
/// cheap); and no keyring file is looked for (the key comes in the options).
fn fixed_options(setup: &RbdSetup) -> [(&'static str, String); 4] {
    let timeout = setup.connect_timeout_secs.max(1).to_string();
    [
        ("client_mount_timeout", timeout.clone()),
        ("rados_mon_op_timeout", timeout),
        ("rbd_cache", "false".into()),
        ("keyring", String::new()),
    ]
}

/// What `rados_connect`'s `rc` means for `setup`.
pub fn connect_error(setup: &RbdSetup, rc: i32) -> OpenError {
    let client = setup.client_id.clone();
    let Some(mon_host) = option(setup, "mon_host").map(str::to_string) else {
        return OpenError::NoMonHost;
    };
    match -rc {
        libc::EACCES | libc::EPERM => OpenError::KeyRefused { client },
        libc::EINVAL => OpenError::Malformed { client, mon_host },
        libc::ETIMEDOUT => {
            OpenError::MonTimeout { secs: setup.connect_timeout_secs.max(1), mon_host }
        }
        _ => OpenError::Connect { client, mon_host, errno: errno(rc) },
    }
}

/// What `rados_ioctx_create`'s `rc` means for `setup`.
pub fn pool_error(setup: &RbdSetup, rc: i32) -> OpenError {
    let pool = setup.pool.clone();
    match -rc {
        libc::ENOENT => OpenError::NoPool { pool },
        _ => OpenError::Pool { pool, client: setup.client_id.clone(), errno: errno(rc) },
    }
}

/// What `rbd_open`'s `rc` means for `setup`.
pub fn open_error(setup: &RbdSetup, rc: i32) -> OpenError {
    let spec = setup.image_spec();
    match (-rc, &setup.snapshot) {
        (libc::ENOENT, None) => OpenError::NoImage { spec },
        (libc::ENOENT, Some(snapshot)) => {
            let image = RbdSetup { snapshot: None, ..setup.clone() }.image_spec();
            OpenError::NoSnapshot { image, snapshot: snapshot.clone() }
        }
        (libc::EACCES | libc::EPERM, _) => {
            OpenError::Denied { client: setup.client_id.clone(), spec, errno: errno(rc) }
        }
        _ => OpenError::Open { spec, errno: errno(rc) },
    }
}

/// A RADOS client, shut down when dropped.
struct Cluster {
    lib: &'static Lib,
    handle: ffi::Rados,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: `handle` came from rados_create2 and is shut down once, here, after
        // everything opened through it (the pool handle, the image) was closed: those
        // are dropped first (see `RbdImage`'s fields).
        unsafe { (self.lib.rados_shutdown)(self.handle) };
    }
}

/// A pool handle, destroyed when dropped.
struct Pool {
    lib: &'static Lib,
    handle: ffi::Ioctx,
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: `handle` came from rados_ioctx_create and is destroyed once, here,
        // after the image opened in it was closed (see `RbdImage`'s fields).
        unsafe { (self.lib.rados_ioctx_destroy)(self.handle) };
    }
}

/// An open image, its pool and its cluster connection; closed in that order when
/// dropped.
pub struct RbdImage {
    lib: &'static Lib,
    handle: ffi::Image,
    // Dropped after `handle` is closed (in `drop`), in this order.
    _pool: Pool,
    cluster: Cluster,
    spec: String,
    read_only: bool,
    /// Whether `handle` was closed ([`RbdImage::close`]); held while the lock is given
    /// back, so that a close on one thread and a release on another do not overlap.
    closed: Mutex<bool>,
}

// SAFETY: librbd's image and librados's client handles are made to be used from any
// thread, and from several at once: the target submits requests on every queue
// thread, and librbd completes them on its own.
unsafe impl Send for RbdImage {}
// SAFETY: as above.
unsafe impl Sync for RbdImage {}

impl std::fmt::Debug for RbdImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdImage").field("spec", &self.spec).finish_non_exhaustive()
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        let closed = self.closed.get_mut().unwrap_or_else(|p| p.into_inner());
        if !*closed {
            // SAFETY: `handle` came from rbd_open and was not closed (`closed`); it is
            // closed once, here; librbd waits for the requests in flight first.
            unsafe { (self.lib.rbd_close)(self.handle) };
        }
    }
}

impl RbdImage {
    /// Connects to the cluster as `client.<client_id>` with exactly the setup's
    /// options (then the fixed ones) and opens the image, read-only for a snapshot.
    pub fn open(setup: &RbdSetup) -> Result<RbdImage, OpenError> {
        let lib = ffi::lib()?;
        let name = c_string("client id", &format!("client.{}", setup.client_id))?;
        let mut handle: ffi::Rados = ptr::null_mut();
        // SAFETY: `handle` is written on success; both strings are NUL-terminated and
        // live across the call.
        let rc = unsafe { (lib.rados_create2)(&mut handle, c"ceph".as_ptr(), name.as_ptr(), 0) };
        if rc < 0 {
            return Err(OpenError::Create { client: setup.client_id.clone(), errno: errno(rc) });
        }
        let cluster = Cluster { lib, handle };
        let fixed = fixed_options(setup);
        let options = setup
            .options
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(fixed.iter().map(|(k, v)| (*k, v.as_str())));
        for (key, value) in options {
            let (c_key, c_value) = (c_string("option", key)?, c_string("option value", value)?);
            // SAFETY: a live cluster handle not yet connected, and two NUL-terminated
            // strings that live across the call (librados copies them).
            let rc = unsafe { (lib.rados_conf_set)(handle, c_key.as_ptr(), c_value.as_ptr()) };
            if rc < 0 {
                let shown = if SECRET_OPTIONS.contains(&key) { "<secret>" } else { value };
                let (name, value) = (key.to_string(), shown.to_string());
                return Err(OpenError::Option { name, value, errno: errno(rc) });
            }
        }
        // SAFETY: a configured cluster handle, connected once.
        let rc = unsafe { (lib.rados_connect)(handle) };
        if rc < 0 {
            return Err(connect_error(setup, rc));
        }
        let pool_name = c_string("pool", &setup.pool)?;
        let mut io: ffi::Ioctx = ptr::null_mut();
        // SAFETY: a connected cluster handle; `io` is written on success; the name is
        // NUL-terminated and lives across the call.
        let rc = unsafe { (lib.rados_ioctx_create)(handle, pool_name.as_ptr(), &mut io) };
        if rc < 0 {
            return Err(pool_error(setup, rc));
        }
        let pool = Pool { lib, handle: io };
        let namespace = c_string("namespace", &setup.namespace)?;
        // SAFETY: a live pool handle and a NUL-terminated name (empty: the default
        // namespace), which librados copies.
        unsafe { (lib.rados_ioctx_set_namespace)(io, namespace.as_ptr()) };
        let image_name = c_string("image", &setup.image)?;
        let snapshot = setup.snapshot.as_deref().map(|s| c_string("snapshot", s)).transpose()?;
        let snap_ptr = snapshot.as_ref().map_or(ptr::null(), |s| s.as_ptr());
        let open = if snapshot.is_some() { lib.rbd_open_read_only } else { lib.rbd_open };
        let mut image: ffi::Image = ptr::null_mut();
        // SAFETY: a live pool handle; `image` is written on success; the names are
        // NUL-terminated (the snapshot's, or null for the image's head) and live
        // across the call.
        let rc = unsafe { open(io, image_name.as_ptr(), &mut image, snap_ptr) };
        if rc < 0 {
            return Err(open_error(setup, rc));
        }
        Ok(RbdImage {
            lib,
            handle: image,
            _pool: pool,
            cluster,
            spec: setup.image_spec(),
            read_only: setup.snapshot.is_some(),
            closed: Mutex::new(false),
        })
    }

    pub fn lib(&self) -> &'static Lib {
        self.lib
    }

    /// The open image's handle, for requests.
    pub fn handle(&self) -> ffi::Image {
        self.handle
    }

    /// Whether a snapshot is open (read-only).
    pub fn is_snapshot(&self) -> bool {
        self.read_only
    }

    /// `POOL[/NAMESPACE]/IMAGE[@SNAP]`.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// This client's address, as the cluster names it (and as `rbd_lock_get_owners`
    /// names a lock's owner): e.g. `127.0.0.1:0/2961794808`.
    pub fn client_address(&self) -> Result<String, Errno> {
        let mut addrs: *mut c_char = ptr::null_mut();
        // SAFETY: a connected cluster handle; `addrs` is written with a string
        // librados allocated on success.
        let rc = unsafe { (self.lib.rados_getaddrs)(self.cluster.handle, &mut addrs) };
        if rc < 0 || addrs.is_null() {
            return Err(errno(rc.min(-libc::EIO)));
        }
        // SAFETY: librados returned a NUL-terminated string, read before it is freed.
        let text = unsafe { CStr::from_ptr(addrs) }.to_string_lossy().into_owned();
        // SAFETY: the string came from rados_getaddrs and is freed once.
        unsafe { (self.lib.rados_buffer_free)(addrs) };
        Ok(text)
    }

    /// The image's size, object size and features, as the probe reports them.
    pub fn describe(&self) -> Result<RbdProbe, OpenError> {
        let query =
            |what, rc: i32| OpenError::Query { what, spec: self.spec.clone(), errno: errno(rc) };
        let mut info = std::mem::MaybeUninit::<ffi::ImageInfo>::zeroed();
        let size = size_of::<ffi::ImageInfo>();
        // SAFETY: an open image and a buffer of exactly `size` bytes for the struct.
        let rc = unsafe { (self.lib.rbd_stat)(self.handle, info.as_mut_ptr(), size) };
        if rc < 0 {
            return Err(query("the size", rc));
        }
        // SAFETY: zeroed (a valid ImageInfo: integers and arrays), then filled by
        // rbd_stat.
        let info = unsafe { info.assume_init() };
        let features = self.features().map_err(|e| query("the features", -e.0))?;
        Ok(RbdProbe {
            size_bytes: info.size,
            object_size: info.obj_size,
            read_only: self.read_only,
            exclusive_lock: features & ffi::FEATURE_EXCLUSIVE_LOCK != 0,
        })
    }

    /// `RBD_FEATURE_*` of the image.
    pub fn features(&self) -> Result<u64, Errno> {
        let mut features = 0u64;
        // SAFETY: an open image; `features` is written on success.
        let rc = unsafe { (self.lib.rbd_get_features)(self.handle, &mut features) };
        if rc < 0 { Err(errno(rc)) } else { Ok(features) }
    }

    /// The image's size in bytes now (librbd refreshes it after a resize elsewhere).
    pub fn size(&self) -> Result<u64, Errno> {
        let mut size = 0u64;
        // SAFETY: an open image; `size` is written on success.
        let rc = unsafe { (self.lib.rbd_get_size)(self.handle, &mut size) };
        if rc < 0 { Err(errno(rc)) } else { Ok(size) }
    }

    /// Resizes the image to `size` bytes. While another client holds the exclusive
    /// lock, librbd asks that owner to do it (a maintenance operation is carried out by
    /// the lock's owner).
    pub fn resize(&self, size: u64) -> Result<(), Errno> {
        // SAFETY: an open image.
        let rc = unsafe { (self.lib.rbd_resize)(self.handle, size) };
        if rc < 0 { Err(errno(rc)) } else { Ok(()) }
    }

    /// Has librbd call `callback(arg)` on one of its threads whenever the image's
    /// header changes (a resize by any client among others), until the image is closed,
    /// which ends the watch.
    ///
    /// # Safety
    ///
    /// `arg` must stay valid, and `callback` safe to call with it from any thread, for
    /// as long as the image is open.
    pub unsafe fn update_watch(
        &self,
        callback: ffi::UpdateCallback,
        arg: *mut std::ffi::c_void,
    ) -> Result<(), Errno> {
        let mut handle = 0u64;
        // SAFETY: an open image; `handle` is written on success; the caller's promise
        // covers `callback` and `arg`.
        let rc = unsafe { (self.lib.rbd_update_watch)(self.handle, &mut handle, callback, arg) };
        if rc < 0 { Err(errno(rc)) } else { Ok(()) }
    }

    /// Who holds the image's exclusive lock (none: empty), and in which mode.
    pub fn lock_owners(&self) -> Result<(ffi::LockMode, Vec<String>), Errno> {
        let mut room = 4usize;
        loop {
            let mut owners: Vec<*mut c_char> = vec![ptr::null_mut(); room];
            let mut mode: ffi::LockMode = ffi::LOCK_MODE_EXCLUSIVE;
            let mut count = room;
            // SAFETY: an open image; `owners` has room for `count` pointers, which
            // librbd fills with strings it allocates (and sets `count` to how many),
            // or sets `count` to the room it needs (ERANGE).
            let rc = unsafe {
                (self.lib.rbd_lock_get_owners)(
                    self.handle,
                    &mut mode,
                    owners.as_mut_ptr(),
                    &mut count,
                )
            };
            match -rc {
                0 => {
                    let count = count.min(room);
                    let names = owners[..count]
                        .iter()
                        .filter(|p| !p.is_null())
                        // SAFETY: librbd wrote NUL-terminated strings, read before
                        // they are freed below.
                        .map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
                        .collect();
                    // SAFETY: the `count` strings librbd allocated, freed once.
                    unsafe { (self.lib.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), count) };
                    return Ok((mode, names));
                }
                libc::ENOENT => return Ok((mode, Vec::new())),
                libc::ERANGE if count > room && count <= 1024 => room = count,
                _ => return Err(errno(rc.min(-libc::EIO))),
            }
        }
    }

    /// The addresses of the clients watching the image's header: every client that has
    /// it open, this one included, and a dead one until the OSD's watch timeout
    /// (`osd_client_watch_timeout`, 30 s by default) has passed.
    pub fn watchers(&self) -> Result<Vec<String>, Errno> {
        let empty = ffi::ImageWatcher { addr: ptr::null_mut(), id: 0, cookie: 0 };
        let mut room = 8usize;
        loop {
            let mut list = vec![empty; room];
            let mut count = room;
            // SAFETY: an open image; `list` has room for `count` watchers, which
            // librbd fills (allocating each address) and sets `count` to how many, or
            // sets `count` to the room it needs (ERANGE).
            let rc =
                unsafe { (self.lib.rbd_watchers_list)(self.handle, list.as_mut_ptr(), &mut count) };
            match -rc {
                0 => {
                    let count = count.min(room);
                    let addrs = list[..count]
                        .iter()
                        .filter(|w| !w.addr.is_null())
                        // SAFETY: librbd wrote NUL-terminated strings, read before they
                        // are freed below.
                        .map(|w| unsafe { CStr::from_ptr(w.addr) }.to_string_lossy().into_owned())
                        .collect();
                    // SAFETY: the `count` watchers librbd filled, freed once.
                    unsafe { (self.lib.rbd_watchers_list_cleanup)(list.as_mut_ptr(), count) };
                    return Ok(addrs);
                }
                libc::ERANGE if count > room && count <= 1024 => room = count,
                _ => return Err(errno(rc.min(-libc::EIO))),
            }
        }
    }

    /// Breaks `owner`'s lock, which blocklists it first: a request it still has in
    /// flight can never land.
    pub fn break_lock(&self, mode: ffi::LockMode, owner: &str) -> Result<(), Errno> {
        let owner = CString::new(owner).map_err(|_| Errno(libc::EINVAL))?;
        // SAFETY: an open image and a NUL-terminated owner that lives across the call.
        let rc = unsafe { (self.lib.rbd_lock_break)(self.handle, mode, owner.as_ptr()) };
        if rc < 0 { Err(errno(rc)) } else { Ok(()) }
    }

    /// Takes the image's exclusive lock and keeps it: librbd hands it to no one who
    /// asks (another client then gets EROFS).
    pub fn acquire_exclusive(&self) -> Result<(), Errno> {
        // SAFETY: an open image.
        let rc = unsafe { (self.lib.rbd_lock_acquire)(self.handle, ffi::LOCK_MODE_EXCLUSIVE) };
        if rc < 0 { Err(errno(rc)) } else { Ok(()) }
    }

    /// Gives the exclusive lock back, so that the image's next user finds it free
    /// rather than held by a client that no longer exists.
    pub fn release_lock(&self) -> Result<(), Errno> {
        let closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        if *closed {
            return Ok(()); // closing gave the lock back
        }
        // SAFETY: an open image (not `closed`, which cannot change while we hold it).
        let rc = unsafe { (self.lib.rbd_lock_release)(self.handle) };
        if rc < 0 { Err(errno(rc)) } else { Ok(()) }
    }

    /// Closes the image now rather than when it is dropped (librbd waits for the
    /// requests in flight, gives the exclusive lock back and ends its watch on the
    /// image's header); the cluster connection stays until the drop.
    ///
    /// # Safety
    ///
    /// No thread may submit a request to the image from now on: a request on a closed
    /// image is a use after free in librbd.
    pub unsafe fn close(&self) {
        let mut closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        if !*closed {
            // SAFETY: an open image (not `closed`), which no thread uses for requests
            // any more (the caller's promise); marked closed under the same lock.
            unsafe { (self.lib.rbd_close)(self.handle) };
            *closed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> RbdSetup {
        RbdSetup {
            pool: "rbd".into(),
            namespace: String::new(),
            image: "x".into(),
            snapshot: None,
            client_id: "ublkd".into(),
            options: vec![
                ("mon host".into(), "[v2:127.0.0.1:3300]".into()),
                ("key".into(), "AQBsecret==".into()),
            ],
            connect_timeout_secs: 3,
            allow_unfenced: false,
        }
    }

    #[test]
    fn a_refused_key_names_the_client() {
        for rc in [-libc::EACCES, -libc::EPERM] {
            assert_eq!(
                connect_error(&setup(), rc).to_string(),
                "the cluster refused client.ublkd's key"
            );
        }
    }

    #[test]
    fn an_unreachable_cluster_names_the_wait_and_the_monitors() {
        assert_eq!(
            connect_error(&setup(), -libc::ETIMEDOUT).to_string(),
            "no monitor of the cluster answered within 3 s (mon_host [v2:127.0.0.1:3300])"
        );
    }

    #[test]
    fn another_connect_failure_says_its_errno_and_never_the_key() {
        let text = connect_error(&setup(), -libc::ECONNREFUSED).to_string();
        assert!(text.contains("Connection refused") && text.contains("client.ublkd"), "{text}");
        let text = connect_error(&setup(), -libc::EINVAL).to_string();
        assert!(text.contains("malformed") && !text.contains("AQBsecret"), "{text}");
        let no_mon = RbdSetup { options: Vec::new(), ..setup() };
        assert_eq!(
            connect_error(&no_mon, -libc::ENOENT).to_string(),
            "no monitor address is known: the setup has no mon_host"
        );
    }

    #[test]
    fn a_missing_image_pool_or_snapshot_is_named() {
        assert_eq!(open_error(&setup(), -libc::ENOENT).to_string(), "image rbd/x does not exist");
        assert_eq!(pool_error(&setup(), -libc::ENOENT).to_string(), "pool rbd does not exist");
        let snap = RbdSetup { snapshot: Some("s1".into()), ..setup() };
        assert_eq!(
            open_error(&snap, -libc::ENOENT).to_string(),
            "image rbd/x has no snapshot s1, or does not exist"
        );
        let denied = open_error(&setup(), -libc::EPERM).to_string();
        assert!(denied.starts_with("client.ublkd may not open image rbd/x"), "{denied}");
    }

    #[test]
    fn the_fixed_options_come_last_and_bound_the_connect() {
        let fixed = fixed_options(&RbdSetup { connect_timeout_secs: 0, ..setup() });
        assert_eq!(fixed[0], ("client_mount_timeout", "1".to_string()));
        assert_eq!(fixed[1], ("rados_mon_op_timeout", "1".to_string()));
        assert!(fixed.contains(&("rbd_cache", "false".to_string())));
    }

    #[test]
    fn an_option_is_found_by_any_of_its_spellings_the_last_one_winning() {
        let mut s = setup();
        s.options.push(("mon-host".into(), "10.0.0.9".into()));
        assert_eq!(option(&s, "mon_host"), Some("10.0.0.9"));
        assert_eq!(option(&s, "keyring"), None);
    }
}
