//! The system calls the worker makes that neither std nor nix wraps, each as a safe
//! function with its one SAFETY argument. Each makes exactly the system call it names
//! (the sandbox's seccomp policy lists system calls, not functions).

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// A raw system call's result: `-1` with errno set, or a value.
fn check(rc: libc::c_long) -> io::Result<libc::c_long> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// An fd the kernel just returned as `rc`, owned from here on.
fn owned(rc: libc::c_long) -> io::Result<OwnedFd> {
    let fd = check(rc)? as RawFd;
    // SAFETY: the kernel just returned this fd to this call; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `close_range(first, ~0U, 0)`: closes every fd from `first` up.
pub fn close_from(first: RawFd) -> io::Result<()> {
    // SAFETY: close_range takes integers and only closes fds of this process; the
    // caller owns every fd from `first` up (nothing else in the process uses them).
    check(unsafe {
        libc::syscall(libc::SYS_close_range, first as libc::c_uint, libc::c_uint::MAX, 0)
    })
    .map(drop)
}

/// `landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)`: the kernel's
/// Landlock ABI version, 0 if it has none.
pub fn landlock_abi() -> u8 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with the VERSION flag, landlock_create_ruleset reads no memory.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    u8::try_from(v).unwrap_or(0)
}

/// `fsopen(fs_name, flags)`: a new filesystem context.
pub fn fsopen(fs_name: &CStr, flags: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated filesystem name that lives across the call, and flags.
    owned(unsafe { libc::syscall(libc::SYS_fsopen, fs_name.as_ptr(), flags) })
}

/// `fsconfig(fs, FSCONFIG_SET_STRING, key, value, 0)`.
pub fn fsconfig_set_string(fs: BorrowedFd<'_>, key: &CStr, value: &CStr) -> io::Result<()> {
    const FSCONFIG_SET_STRING: libc::c_uint = 1;
    // SAFETY: an fd and two NUL-terminated strings that live across the call.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_SET_STRING,
            key.as_ptr(),
            value.as_ptr(),
            0,
        )
    })
    .map(drop)
}

/// `fsconfig(fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0)`: creates the filesystem.
pub fn fsconfig_create(fs: BorrowedFd<'_>) -> io::Result<()> {
    const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
    // SAFETY: an fd and null pointers, which this command does not read.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    })
    .map(drop)
}

/// `fsmount(fs, flags, attr_flags)`: a mount of the created filesystem, attached
/// nowhere.
pub fn fsmount(
    fs: BorrowedFd<'_>,
    flags: libc::c_uint,
    attr_flags: libc::c_uint,
) -> io::Result<OwnedFd> {
    // SAFETY: an fd and flags only.
    owned(unsafe { libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), flags, attr_flags) })
}

/// `eventfd2(0, flags)`: a new eventfd with a count of 0.
pub fn eventfd(flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: integers only; the kernel returns a new fd.
    owned(unsafe { libc::syscall(libc::SYS_eventfd2, 0, flags) })
}

/// `write(fd, &n, 8)` on an eventfd: adds `n` to its count, waking its readers.
pub fn eventfd_add(fd: BorrowedFd<'_>, n: u64) -> io::Result<()> {
    let bytes = n.to_ne_bytes();
    // SAFETY: writes 8 bytes from `bytes`, which lives across the call.
    let rc = unsafe { libc::write(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
    check(rc as libc::c_long).map(drop)
}

/// `_exit(code)`: ends the process at once, running no `atexit` handler and no C++
/// destructor (which would race with the threads a C++ library still runs).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit takes an integer and does not return; nothing of this process is
    // used after it.
    unsafe { libc::_exit(code) }
}
