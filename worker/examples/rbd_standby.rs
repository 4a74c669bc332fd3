//! Plays the supervisor for one rbd worker, as far as a host without ublk allows:
//! starts `ublkd-worker --rbd` (sandboxed with `--sandbox`, as root), sends it the
//! setup of the `RbdSetup` in the JSON file given, and prints its Standby (with its
//! Ceph client address) or its failure. With `--activate [--fence ADDR]…` it then
//! sends Activate with `/dev/null` for the device: the worker fences and takes the
//! image's lock (the part of activation that needs no kernel device), then fails to
//! map the device's descriptors, which it reports; without it, Shutdown.
//!
//! ```text
//! cargo build -p ublkd-worker --examples
//! target/debug/examples/rbd_standby target/debug/ublkd-worker setup.json --sandbox \
//!     --activate --fence 127.0.0.1:0/123
//! ```

use std::error::Error;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use ublkd_proto::msg::rbd::RbdSetup;
use ublkd_proto::msg::{self, DataPath, FromWorker, TargetSetup, ToWorker, WorkerSetup};
use ublkd_proto::shm::{Geometry, ShmRegion};

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [worker, setup_path, ..] = &args[..] else {
        return Err(
            "usage: rbd_standby WORKER SETUP.json [--sandbox] [--activate [--fence ADDR]…]".into(),
        );
    };
    let rbd: RbdSetup = serde_json::from_str(&std::fs::read_to_string(setup_path)?)?;
    let sandbox = args.iter().any(|a| a == "--sandbox");
    let activate = args.iter().any(|a| a == "--activate");
    let fence: Vec<String> =
        args.windows(2).filter(|w| w[0] == "--fence").map(|w| w[1].clone()).collect();

    let geometry = Geometry { dev_id: 990, nr_queues: 1, queue_depth: 16, nr_threads: 2 };
    let (_region, shm) = ShmRegion::create(geometry)?;
    let (ours, theirs) =
        socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
    let mut command = Command::new(worker);
    command.args(["--control-fd", "3", "--rbd"]);
    if sandbox {
        command.args(["--sandbox-uid", "65534", "--sandbox-gid", "65534"]);
    } else {
        command.arg("--no-sandbox");
    }
    let fd = theirs.as_raw_fd();
    // SAFETY: between fork and exec the child only calls dup2, which is
    // async-signal-safe, on an fd it inherited.
    unsafe {
        command.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let started = Instant::now();
    let mut child = command.spawn()?;
    drop(theirs);
    let setup = WorkerSetup {
        dev_id: geometry.dev_id,
        size_bytes: 4 << 20,
        nr_queues: geometry.nr_queues,
        queue_depth: geometry.queue_depth,
        max_io_buf_bytes: 128 << 10,
        nr_threads: geometry.nr_threads,
        target: TargetSetup::Rbd,
        block_size: 512,
        zero_copy: false,
        fast_release: true,
        data_path: DataPath::PerIo,
        rbd: Some(rbd),
        read_only: false,
    };
    msg::send_packet(ours.as_fd(), &ToWorker::Setup(setup), &[shm.as_fd()])?;
    let (answer, _) = msg::recv_packet::<FromWorker>(ours.as_fd())?;
    println!("after {} ms: {answer:?}", started.elapsed().as_millis());
    if let FromWorker::Standby { .. } = answer {
        if activate {
            let device = std::fs::File::open("/dev/null")?;
            let started = Instant::now();
            let go = ToWorker::Activate { generation: 1, fence };
            msg::send_packet(ours.as_fd(), &go, &[device.as_fd()])?;
            let (answer, _) = msg::recv_packet::<FromWorker>(ours.as_fd())?;
            println!("activation after {} ms: {answer:?}", started.elapsed().as_millis());
        } else {
            msg::send_packet(ours.as_fd(), &ToWorker::Shutdown, &[])?;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            child.kill()?;
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    println!("worker {}", ublkd_proto::exit::describe(&status));
    Ok(())
}
