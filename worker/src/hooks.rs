//! Where the test-only attacks of `attack` (`src/attack.rs`) attach to the worker: one
//! call per hook point. Without the `test-hooks` feature every hook is an empty inline
//! function and the attack module is not compiled, so release builds carry none of it.

use io_uring::squeue;

/// What a queue thread does for a test hook before its first turn.
#[derive(Debug, Default)]
pub struct ThreadStart {
    /// An SQE to submit, with [`UserData::Attack`](crate::queue::user_data::UserData::Attack); its
    /// completion goes to [`on_attack_cqe`].
    pub sqe: Option<squeue::Entry>,
    /// Tags of the thread's first queue to COMMIT though the kernel never gave them.
    pub unowned_tags: Vec<u16>,
}

#[cfg(feature = "test-hooks")]
mod imp {
    use std::os::fd::RawFd;
    use std::sync::OnceLock;

    use super::ThreadStart;
    use crate::attack;

    /// On the per-I/O path (Linux 6.12), how long the attacks wait once the worker
    /// serves before they end it: seen in the 6.12 VM, a device whose server dies while
    /// START_DEV runs stays LIVE without a server and is never released for recovery,
    /// and these attacks would otherwise end the worker exactly then. A real crash in
    /// that window is the kernel's limitation (docs/troubleshooting.md, "Known kernel limits").
    const PER_IO_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);
    use crate::device::Device;
    use crate::queue::user_data::UserData;
    use ublkd_proto::uapi;

    /// The attack to make once serving, and the supervisor's pid.
    static ATTACK: OnceLock<(&'static str, i32)> = OnceLock::new();

    /// Before the sandbox goes up: notes the supervisor's pid, which the sandbox then
    /// forbids asking for.
    pub fn before_sandbox() {
        let supervisor = nix::unistd::getppid().as_raw();
        if let Some(name) = attack::requested() {
            ATTACK.get_or_init(|| (name, supervisor));
        }
    }

    /// In `--probe-rbd`, once its sandbox is up: [`attack::probe_pause`].
    pub fn on_probe_sandboxed() {
        attack::probe_pause();
    }

    /// When the worker receives its activation (device `dev_id`, `generation`): with
    /// [`attack::SILENT_ACTIVATION`], the second incarnation (a recovery's) of the
    /// targeted device never answers it.
    pub fn on_activate(dev_id: u32, generation: u64) {
        if attack::requested() == Some(attack::SILENT_ACTIVATION)
            && generation == 2
            && attack::targets(dev_id)
        {
            attack::say(format!(
                "attack {}: generation {generation} will not answer",
                attack::SILENT_ACTIVATION
            ));
            loop {
                std::thread::park();
            }
        }
    }

    /// Whether the worker answers its activation of device `dev_id` (`generation`)
    /// without fetching its tags ([`attack::READY_NO_FETCH`]): it says so first.
    pub fn skips_fetch(dev_id: u32, generation: u64) -> bool {
        let skips = attack::skips_fetch(dev_id, generation);
        if skips {
            let name = attack::requested().unwrap_or_default();
            attack::say(format!(
                "attack {name}: generation {generation} answers Ready without fetching its tags"
            ));
        }
        skips
    }

    /// On the control thread once the device `generation` is served (`per_io`: on the
    /// per-I/O path): the first incarnation makes the requested process-level attack.
    /// `control`: the worker's end of its control socket; `held`: the fds it holds for
    /// its supervisor's successor (ublkd's end of that socket first).
    pub fn on_serving(generation: u64, per_io: bool, control: RawFd, held: &[RawFd]) {
        if let Some(&(name, supervisor)) = ATTACK.get()
            && generation == 1
        {
            if per_io {
                std::thread::sleep(PER_IO_SETTLE);
            }
            if name == attack::FILL_CONTROL {
                attack::fill_control(control, held);
            }
            attack::run(name, supervisor);
        }
    }

    /// Before queue thread `thread`'s first turn on its ring `ring_fd`: the ring-level
    /// attacks and faults, made by thread 0 of the first incarnation.
    pub fn on_thread_start(dev: &Device, thread: usize, ring_fd: RawFd) -> ThreadStart {
        let mut start = ThreadStart::default();
        if dev.generation != 1 || thread != 0 {
            return start;
        }
        if attack::requested().is_some() && dev.data_path == ublkd_proto::msg::DataPath::PerIo {
            std::thread::sleep(PER_IO_SETTLE);
        }
        match attack::requested() {
            // Ask the ring to open a host file: its restrictions must refuse.
            Some(attack::URING_OPENAT) => {
                let path = c"/etc/passwd";
                let at = io_uring::types::Fd(libc::AT_FDCWD);
                let sqe = io_uring::opcode::OpenAt::new(at, path.as_ptr()).build();
                start.sqe = Some(sqe.user_data(UserData::Attack.encode()));
            }
            // Socket operations and a command by raw descriptor, on the ring's own fd
            // (any descriptor would do: the ring must refuse before it looks at it).
            Some(attack::URING_SENDMSG) => {
                // Never read if refused; a zeroed msghdr (no data, no control) if not.
                let msg: &'static libc::msghdr = Box::leak(Box::new(
                    // SAFETY: msghdr is plain data; all zeroes is a valid empty one.
                    unsafe { std::mem::zeroed() },
                ));
                let sqe = io_uring::opcode::SendMsg::new(io_uring::types::Fd(ring_fd), msg).build();
                start.sqe = Some(sqe.user_data(UserData::Attack.encode()));
            }
            Some(attack::URING_SENDMSG_RIGHTS) => {
                start.sqe = Some(sendmsg_passing(ring_fd).user_data(UserData::Attack.encode()));
            }
            Some(attack::URING_RECV) => {
                let sqe = io_uring::opcode::Recv::new(
                    io_uring::types::Fd(ring_fd),
                    std::ptr::null_mut(),
                    0,
                )
                .build();
                start.sqe = Some(sqe.user_data(UserData::Attack.encode()));
            }
            Some(attack::URING_CMD_RAW_FD) => {
                let sqe =
                    io_uring::opcode::UringCmd16::new(io_uring::types::Fd(ring_fd), 0).build();
                start.sqe = Some(sqe.user_data(UserData::Attack.encode()));
            }
            // Give the enabled ring this thread's credentials as a personality: its
            // register restrictions must refuse.
            Some(attack::URING_REGISTER_PERSONALITY) => {
                let rc = register_without_argument(ring_fd, uapi::IORING_REGISTER_PERSONALITY);
                attack::outcome(attack::URING_REGISTER_PERSONALITY, rc);
            }
            Some(attack::DROP_ZERO_COPY_BUFFERS)
                if dev.zero_copy && attack::targets(dev.dev_id) =>
            {
                let rc = register_without_argument(ring_fd, uapi::IORING_UNREGISTER_BUFFERS);
                let what = if rc == 0 {
                    "done".to_string()
                } else {
                    format!("refused ({})", std::io::Error::last_os_error())
                };
                attack::say(format!(
                    "attack {}: buffer table dropped: {what}",
                    attack::DROP_ZERO_COPY_BUFFERS
                ));
            }
            // The highest tags: blk-mq hands out the lowest first, so these are idle.
            Some(attack::COMMIT_UNOWNED) => start.unowned_tags = vec![dev.depth - 1],
            Some(attack::COMMIT_UNOWNED_BATCH) => {
                start.unowned_tags = vec![dev.depth - 1, dev.depth - 2];
            }
            _ => {}
        }
        start
    }

    /// A SENDMSG on `fd` of one byte and an `SCM_RIGHTS` message passing `fd` itself.
    /// The message and what it points at are leaked: the ring may read them any time
    /// until the SQE completes.
    fn sendmsg_passing(fd: RawFd) -> io_uring::squeue::Entry {
        let space = {
            // SAFETY: CMSG_SPACE is arithmetic on its argument.
            unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) as usize }
        };
        let control: &'static mut [u64] = vec![0u64; space.div_ceil(8)].leak();
        let byte: &'static mut [u8; 1] = Box::leak(Box::new([0u8]));
        let iov: &'static mut libc::iovec =
            Box::leak(Box::new(libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 }));
        let msg: &'static mut libc::msghdr = Box::leak(Box::new(
            // SAFETY: msghdr is plain data; all zeroes is a valid empty one.
            unsafe { std::mem::zeroed() },
        ));
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` has a control buffer of CMSG_SPACE(one fd) bytes, 8-aligned, so
        // its first header and that header's data are inside it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        }
        io_uring::opcode::SendMsg::new(io_uring::types::Fd(fd), msg).build()
    }

    /// `io_uring_register(ring_fd, opcode, NULL, 0)`: the register operations these
    /// hooks make take no argument.
    fn register_without_argument(ring_fd: RawFd, opcode: u32) -> libc::c_long {
        // SAFETY: io_uring_register with a null argument and no entries reads no memory;
        // the ring fd is the calling queue thread's own.
        unsafe {
            libc::syscall(
                libc::SYS_io_uring_register,
                ring_fd,
                opcode,
                std::ptr::null::<libc::c_void>(),
                0,
            )
        }
    }

    /// After each turn of queue thread `thread`: `turn` counts its turns, `handled`
    /// says whether this one handled requests.
    pub fn after_turn(dev: &Device, thread: usize, turn: u64, handled: bool) {
        attack::after_turn(dev, thread, turn, handled);
    }

    /// The completion of a hook's SQE (see [`ThreadStart::sqe`]).
    pub fn on_attack_cqe(res: i32) {
        let name = attack::requested().unwrap_or(attack::URING_OPENAT);
        if res < 0 {
            let err = std::io::Error::from_raw_os_error(-res);
            attack::say(format!("attack {name}: blocked ({err})"));
        } else {
            attack::say(format!("attack {name}: ESCAPED (result {res})"));
            std::process::exit(99);
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
mod imp {
    use std::os::fd::RawFd;

    use super::ThreadStart;
    use crate::device::Device;

    #[inline(always)]
    pub fn before_sandbox() {}

    #[inline(always)]
    pub fn on_probe_sandboxed() {}

    #[inline(always)]
    pub fn on_activate(_dev_id: u32, _generation: u64) {}

    #[inline(always)]
    pub fn skips_fetch(_dev_id: u32, _generation: u64) -> bool {
        false
    }

    #[inline(always)]
    pub fn on_serving(_generation: u64, _per_io: bool, _control: RawFd, _held: &[RawFd]) {}

    #[inline(always)]
    pub fn on_thread_start(_dev: &Device, _thread: usize, _ring_fd: RawFd) -> ThreadStart {
        ThreadStart::default()
    }

    #[inline(always)]
    pub fn after_turn(_dev: &Device, _thread: usize, _turn: u64, _handled: bool) {}

    #[inline(always)]
    pub fn on_attack_cqe(_res: i32) {}
}

pub use imp::*;
