//! The state dir (`daemon.state_dir`) against a hostile or broken host (in the VM):
//! ublkd refuses a state dir others may write to, and a device its previous self left
//! half-created is deleted at adoption, not leaked as a kernel id nobody serves.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use ublkd_proto::ctrl::{AUTO_DEV_ID, CtrlClient};
use ublkd_proto::uapi::{self, UblksrvCtrlDevInfo};
use ublkd_supervisor::state::StateDir;
use ublkd_supervisor::worker::{AttachClaim, process_start_time};
use ublkd_tests::harness::machine::{kernel_devices, serial, wait_for_path};
use ublkd_tests::harness::process::{bin, describe, run};
use ublkd_tests::harness::ublkd::Ublkd;

/// ublkd's tag in `ublksrv_flags` (supervisor/src/state.rs's OWNER_TAG).
const OWNER_TAG: u64 = u64::from_be_bytes(*b"ublkd\0\0\x01");

#[test]
fn a_state_dir_that_others_may_write_is_refused_at_start() {
    let _s = serial();
    let dir = std::path::PathBuf::from("/run/ublkd-test-open-state");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("state")).unwrap();
    std::fs::set_permissions(dir.join("state"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let config = dir.join("ublkd.toml");
    std::fs::write(
        &config,
        format!(
            "[daemon]\nsocket = \"{}\"\nstate_dir = \"{}\"\n",
            dir.join("ublkd.sock").display(),
            dir.join("state").display()
        ),
    )
    .unwrap();
    let out = run(Command::new(bin("ublkd")).arg("--config").arg(&config));
    let text = describe(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("/run/ublkd-test-open-state/state is not safe for ublkd's state"),
        "{text}"
    );
    assert!(text.contains("its mode 777 lets others write to it"), "{text}");
    assert!(!dir.join("ublkd.sock").exists(), "ublkd listened anyway");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_device_left_half_created_is_deleted_at_adoption_not_leaked() {
    let _s = serial();
    // The first ublkd only makes the state dir; the device is made by hand the way a
    // ublkd killed between its first worker's activation and START_DEV leaves one:
    // added, tagged, recorded, never started, and a recorded worker still holding
    // /dev/ublkcN (here a shell holding it open). Deleting the device under it would
    // wait for it, and the worker would outlive its device: it is killed first.
    let mut ublkd = Ublkd::start("half-created");
    let mut holder = None;
    ublkd.sigkill_and_restart(|| {
        let ctrl = CtrlClient::open().unwrap();
        let info = UblksrvCtrlDevInfo {
            nr_hw_queues: 1,
            queue_depth: 16,
            max_io_buf_bytes: 512 * 1024,
            dev_id: AUTO_DEV_ID,
            flags: uapi::UBLK_F_USER_RECOVERY | uapi::UBLK_F_USER_RECOVERY_REISSUE,
            ublksrv_flags: OWNER_TAG,
            ..UblksrvCtrlDevInfo::default()
        };
        let id = ctrl.add_dev(&info).unwrap().dev_id;
        let dir = format!("/run/ublkd-test-half-created/state/devices/{id}");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            format!("{dir}/device.json"),
            format!(
                "{{\"id\":{id},\"target\":\"null\",\"file\":null,\"direct\":false,\
                 \"size_bytes\":1048576,\"queues\":1,\"queue_depth\":16,\"block_size\":512,\
                 \"threads\":1,\"sandbox\":true}}"
            ),
        )
        .unwrap();
        assert!(kernel_devices().contains(&id));
        let cdev = format!("/dev/ublkc{id}");
        wait_for_path(Path::new(&cdev));
        let child = Command::new("sh")
            .args(["-c", &format!("exec 3<>{cdev}; echo held; exec sleep 600")])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut child = child;
        let mut said = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut said,
        )
        .unwrap();
        assert_eq!(said, "held\n", "the shell could not open {cdev}");
        let pid = child.id();
        // Recorded as ublkd records an activated worker.
        let claim = AttachClaim {
            dev_id: id,
            pid,
            start_time: process_start_time(pid).unwrap(),
            generation: 1,
            held: Vec::new(),
            sandbox: None,
            rbd_clients: Vec::new(),
        };
        StateDir::new(Path::new("/run/ublkd-test-half-created/state"))
            .write_worker_claim(&claim)
            .unwrap();
        holder = Some(child);
    });
    let mut holder = holder.unwrap();
    let ended = holder.try_wait().unwrap();
    assert!(
        ended.is_some_and(|s| std::os::unix::process::ExitStatusExt::signal(&s) == Some(9)),
        "the recorded worker was not killed before its device was deleted: {ended:?}"
    );
    // The restarted ublkd answers only after adoption: the device is gone by now.
    assert!(kernel_devices().is_empty(), "a half-created device was left:\n{}", ublkd.log());
    assert!(
        ublkd.log().contains("never started (a create cut short): deleted it"),
        "{}",
        ublkd.log()
    );
    assert!(ublkd.status().is_empty());
    ublkd.stop();
}
