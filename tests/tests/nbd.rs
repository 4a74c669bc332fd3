//! The nbd target as far as issue 19's part 1 goes, through the real `ublkd` and
//! `ublkctl`: ublkd connects to the export and negotiates, then refuses the device with
//! the export's size and flags (or the handshake's error), and makes no kernel device.
//! The NBD server is nbdkit (installed by `tests/vm/install-host-deps.sh`, seen by the
//! guest through the shared host root). Runs inside the test VM, like every test here.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Ublkd, describe, kernel_devices, serial};

/// nbdkit serving a 1 GiB RAM disk on `socket`, killed on drop.
struct Nbdkit(Child);

impl Nbdkit {
    fn start(socket: &Path) -> Nbdkit {
        let _ = std::fs::remove_file(socket);
        // nbdkit writes its pid file once it listens: the readiness signal.
        let pid_file = socket.with_extension("pid");
        let _ = std::fs::remove_file(&pid_file);
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-P"])
            .arg(&pid_file)
            .arg("-U")
            .arg(socket)
            .args(["memory", "1G"])
            .stdin(Stdio::null())
            .spawn()
            .expect("cannot run nbdkit: install it with tests/vm/install-host-deps.sh");
        let mut server = Nbdkit(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read(&pid_file).is_ok_and(|pid| pid.ends_with(b"\n")) {
            if let Ok(Some(status)) = server.0.try_wait() {
                panic!("nbdkit exited before it listened: {status}");
            }
            assert!(Instant::now() < deadline, "nbdkit did not listen within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn an_nbd_device_is_checked_then_refused_without_a_kernel_device() {
    let _serial = serial();
    let socket = Path::new("/tmp/ublkd-test-nbd.sock");
    let _nbdkit = Nbdkit::start(socket);
    let uri = format!("nbd+unix:///?socket={}", socket.display());
    // A configured nbd device takes the same path as `ublkctl add`, at start.
    let ublkd = Ublkd::start_with(
        "nbd",
        &format!("\n[[device]]\ntarget = \"nbd\"\nuri = \"{uri}\"\n"),
        &[],
    );
    let before = kernel_devices();

    let out = ublkd.ctl(&["add", "-t", "nbd", "--uri", &uri]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ublkctl add -t nbd succeeded: {}", describe(&out));
    assert!(
        stderr.contains("the nbd target's data path is not built yet (issue 19)")
            && stderr.contains(&format!("{uri} works, it is 1G (1073741824 bytes)"))
            && stderr.contains("multi-conn, structured replies; no device was created"),
        "{}",
        describe(&out)
    );

    let missing = "nbd+unix:///?socket=/tmp/ublkd-test-nbd-missing.sock";
    let out = ublkd.ctl(&["add", "-t", "nbd", "--uri", missing]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains(&format!("cannot use the nbd export {missing}: there is no socket")),
        "{}",
        describe(&out)
    );

    assert!(ublkd.status().is_empty(), "ublkd serves a device: {:?}", ublkd.status());
    assert_eq!(kernel_devices(), before, "a kernel device was made");
    let log = ublkd.stop();
    assert!(
        log.contains("configured device nbd: the nbd target's data path is not built yet"),
        "the configured nbd device's refusal is not in the log:\n{log}"
    );
}
