//! The control plane against the real ublk driver. These tests need
//! `/dev/ublk-control` and root: they run inside the test VM (`./run-tests` does
//! that, with `ublkd-vm` as the cargo runner) and fail anywhere else.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use ublkd_proto::ctrl::{AUTO_DEV_ID, CtrlClient, CtrlCmd, CtrlError, DevTarget};
use ublkd_proto::uapi::{
    self, UBLK_PARAM_TYPE_BASIC, UblkParamBasic, UblkParams, UblksrvCtrlDevInfo,
};
use ublkd_tests::harness::machine::serial;

const RECOVERY_FLAGS: u64 =
    uapi::UBLK_F_BATCH_IO | uapi::UBLK_F_USER_RECOVERY | uapi::UBLK_F_USER_RECOVERY_REISSUE;

fn client() -> CtrlClient {
    CtrlClient::open().expect("/dev/ublk-control must exist: run these tests in the test VM")
}

/// The ublk devices the kernel has now, by their char-device nodes.
fn ublk_devices() -> BTreeSet<String> {
    std::fs::read_dir("/sys/class/ublk-char")
        .map(|dir| {
            dir.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default()
}

fn dev_info(queues: u16, depth: u16, dev_id: u32) -> UblksrvCtrlDevInfo {
    UblksrvCtrlDevInfo {
        nr_hw_queues: queues,
        queue_depth: depth,
        max_io_buf_bytes: 512 * 1024,
        dev_id,
        flags: RECOVERY_FLAGS,
        ..UblksrvCtrlDevInfo::default()
    }
}

fn assert_kernel_error(err: &CtrlError, cmd: CtrlCmd, errno: i32) {
    match err {
        CtrlError::Kernel { cmd: c, errno: e, .. } => {
            assert_eq!((*c, e.0), (cmd, errno), "unexpected error: {err}");
        }
        other => panic!("expected {cmd} to fail with errno {errno}, got: {other}"),
    }
    let msg = err.to_string();
    assert!(msg.starts_with(cmd.name()), "message does not name the command: {msg}");
}

#[test]
fn features_include_batch_io_and_recovery_with_reissue() {
    let mask = client().get_features().unwrap();
    for flag in
        [uapi::UBLK_F_BATCH_IO, uapi::UBLK_F_USER_RECOVERY, uapi::UBLK_F_USER_RECOVERY_REISSUE]
    {
        assert_ne!(mask & flag, 0, "feature mask {mask:#x} lacks {:?}", uapi::feature_names(flag));
    }
}

#[test]
fn ublkctl_features_lists_batch_io_in_text_and_json() {
    // The workspace's binaries sit two levels above this test binary (target/debug/deps).
    let exe = std::env::current_exe().unwrap();
    let ublkctl: PathBuf = exe.parent().unwrap().parent().unwrap().join("ublkctl");
    assert!(ublkctl.is_file(), "{} is missing: build the workspace first", ublkctl.display());

    let out = Command::new(&ublkctl).arg("features").output().unwrap();
    assert!(
        out.status.success(),
        "ublkctl features failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    for name in ["BATCH_IO", "USER_RECOVERY", "USER_RECOVERY_REISSUE"] {
        assert!(lines.contains(&name), "`ublkctl features` lacks {name}:\n{text}");
    }
    println!("ublkctl features (in the VM):\n{text}");

    let out = Command::new(&ublkctl).args(["features", "--json"]).output().unwrap();
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mask = json["mask"].as_str().unwrap();
    let mask = u64::from_str_radix(mask.trim_start_matches("0x"), 16).unwrap();
    assert_eq!(mask, client().get_features().unwrap());
    assert!(json["features"].as_array().unwrap().iter().any(|f| f == "BATCH_IO"));
}

#[test]
fn add_set_params_get_info_del_round_trip_leaves_no_device() {
    let _serial = serial();
    let ctrl = client();
    let before = ublk_devices();

    let added = ctrl.add_dev(&dev_info(2, 64, AUTO_DEV_ID)).unwrap();
    let id = added.dev_id;
    assert_ne!(id, AUTO_DEV_ID, "the kernel must choose an id");
    assert_eq!(added.flags & RECOVERY_FLAGS, RECOVERY_FLAGS, "flags {:#x}", added.flags);
    assert!(ublk_devices().contains(&format!("ublkc{id}")), "no ublkc{id} after ADD_DEV");

    let size: u64 = 256 << 20;
    let params = UblkParams {
        types: UBLK_PARAM_TYPE_BASIC,
        basic: UblkParamBasic {
            logical_bs_shift: 9,
            physical_bs_shift: 12,
            io_opt_shift: 12,
            io_min_shift: 9,
            max_sectors: (512 * 1024) >> 9,
            dev_sectors: size >> 9,
            ..UblkParamBasic::default()
        },
        ..UblkParams::default()
    };
    ctrl.set_params(id, &params).unwrap();
    let got = ctrl.get_params(id).unwrap();
    assert_ne!(got.types & UBLK_PARAM_TYPE_BASIC, 0);
    assert_eq!(got.basic.dev_sectors, size >> 9);
    assert_eq!(got.basic.logical_bs_shift, 9);
    assert_eq!(got.basic.max_sectors, 1024);

    let info = ctrl.get_dev_info(id).unwrap();
    assert_eq!((info.dev_id, info.nr_hw_queues, info.queue_depth), (id, 2, 64));
    assert_eq!(uapi::DevState::from_raw(info.state), uapi::DevState::Dead, "never started");
    assert_eq!(info.flags & RECOVERY_FLAGS, RECOVERY_FLAGS);

    ctrl.del_dev(id).unwrap();
    let err = ctrl.get_dev_info(id).unwrap_err();
    assert_kernel_error(&err, CtrlCmd::GetDevInfo, libc::ENODEV);
    assert_eq!(ublk_devices(), before, "DEL_DEV left a device behind");
}

#[test]
fn add_with_an_id_in_use_is_eexist_and_keeps_the_first_device() {
    let _serial = serial();
    let ctrl = client();
    let before = ublk_devices();
    let first = ctrl.add_dev(&dev_info(1, 32, AUTO_DEV_ID)).unwrap();

    let err = ctrl.add_dev(&dev_info(1, 32, first.dev_id)).unwrap_err();
    assert_kernel_error(&err, CtrlCmd::AddDev, libc::EEXIST);
    assert!(matches!(err, CtrlError::Kernel { dev: DevTarget::Id(id), .. } if id == first.dev_id));
    assert!(err.to_string().contains(&format!("device {}", first.dev_id)), "{err}");
    assert_eq!(ctrl.get_dev_info(first.dev_id).unwrap().queue_depth, 32);

    ctrl.del_dev(first.dev_id).unwrap();
    assert_eq!(ublk_devices(), before);
}

#[test]
fn queue_depth_zero_is_einval_and_adds_nothing() {
    let _serial = serial();
    let before = ublk_devices();
    let err = client().add_dev(&dev_info(1, 0, AUTO_DEV_ID)).unwrap_err();
    assert_kernel_error(&err, CtrlCmd::AddDev, libc::EINVAL);
    assert!(err.to_string().contains("EINVAL (Invalid argument)"), "{err}");
    assert_eq!(ublk_devices(), before);
}

#[test]
fn absurd_queue_count_is_einval_and_adds_nothing() {
    let _serial = serial();
    let before = ublk_devices();
    let queues = (uapi::UBLK_MAX_NR_QUEUES + 1) as u16;
    let err = client().add_dev(&dev_info(queues, 64, AUTO_DEV_ID)).unwrap_err();
    assert_kernel_error(&err, CtrlCmd::AddDev, libc::EINVAL);
    assert_eq!(ublk_devices(), before);
}

#[test]
fn del_of_a_missing_id_is_enodev_naming_the_id() {
    let _serial = serial();
    let before = ublk_devices();
    let err = client().del_dev(4242).unwrap_err();
    assert_kernel_error(&err, CtrlCmd::DelDev, libc::ENODEV);
    assert_eq!(
        err.to_string(),
        "DEL_DEV for device 4242 failed: ENODEV (No such device); no ublk device has that id"
    );
    assert_eq!(ublk_devices(), before);
}

#[test]
fn start_user_recovery_on_a_never_started_device_is_ebusy() {
    let _serial = serial();
    let ctrl = client();
    let before = ublk_devices();
    let dev = ctrl.add_dev(&dev_info(1, 16, AUTO_DEV_ID)).unwrap();
    // A never-started device is DEAD, not QUIESCED: not recoverable.
    let err = ctrl.start_user_recovery(dev.dev_id).unwrap_err();
    assert_kernel_error(&err, CtrlCmd::StartUserRecovery, libc::EBUSY);
    assert!(err.to_string().contains("not quiesced yet"), "{err}");
    ctrl.del_dev(dev.dev_id).unwrap();
    assert_eq!(ublk_devices(), before);
}
