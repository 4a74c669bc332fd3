//! The CSI node plugin (`ublkd-csi`) as a test runs it: started on its own socket
//! beside a test's ublkd, SIGKILLed and started again, its log printed if the test
//! fails. The test itself plays the kubelet over the socket (tonic, in the test).

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::process::{bin, terminate};

/// How long the plugin may take to listen (its start under emulation).
const LISTEN_WITHIN: Duration = Duration::from_secs(30);

/// A running `ublkd-csi --endpoint SOCKET --ublkd-socket …`.
#[derive(Debug)]
pub struct CsiPlugin {
    child: Option<Child>,
    pub endpoint: PathBuf,
    ublkd_socket: PathBuf,
    log: PathBuf,
}

impl CsiPlugin {
    /// Starts the plugin for the ublkd on `ublkd_socket`, and waits for its socket.
    pub fn start(name: &str, ublkd_socket: &Path) -> CsiPlugin {
        let log = PathBuf::from(format!("/tmp/ublkd-csi-{name}.log"));
        File::create(&log).unwrap();
        let mut plugin = CsiPlugin {
            child: None,
            endpoint: PathBuf::from(format!("/run/ublkd-csi-{name}/csi.sock")),
            ublkd_socket: ublkd_socket.to_path_buf(),
            log,
        };
        plugin.spawn();
        plugin
    }

    fn spawn(&mut self) {
        let log = OpenOptions::new().append(true).open(&self.log).unwrap();
        let child = Command::new(bin("ublkd-csi"))
            .arg("--endpoint")
            .arg(&self.endpoint)
            .arg("--ublkd-socket")
            .arg(&self.ublkd_socket)
            .args(["--node-id", "test-node"])
            .env("UBLKD_CSI_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("cannot start ublkd-csi");
        self.child = Some(child);
        let deadline = Instant::now() + LISTEN_WITHIN;
        while std::os::unix::net::UnixStream::connect(&self.endpoint).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("ublkd-csi exited at start ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "ublkd-csi did not listen within {LISTEN_WITHIN:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("ublkd-csi is running").id()
    }

    /// SIGKILLs the plugin (it gets no chance to clean up: its socket stays) and starts
    /// it again.
    pub fn sigkill_and_restart(&mut self) {
        let mut child = self.child.take().expect("ublkd-csi is running");
        child.kill().unwrap();
        child.wait().unwrap();
        self.spawn();
    }

    /// Stops the plugin with SIGTERM; asserts it exits 0.
    pub fn stop(mut self) {
        let status = terminate(self.child.take().expect("ublkd-csi is running"), LISTEN_WITHIN);
        let log = self.log();
        assert!(status.is_some_and(|s| s.success()), "ublkd-csi exited with {status:?}:\n{log}");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for CsiPlugin {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- ublkd-csi log ({})\n{}--- end of ublkd-csi log",
                self.log.display(),
                self.log()
            );
        }
        if let Some(child) = self.child.take() {
            terminate(child, LISTEN_WITHIN);
        }
    }
}
