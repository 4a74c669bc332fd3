//! ublkd-csi, the CSI node plugin, driven as the kubelet drives it (over its unix
//! socket, with the CSI gRPC client) beside a real ublkd: a memory and a loop volume
//! staged (ext4 made), published, written; fio verifying on a published path while the
//! plugin is SIGKILLed and started again twice (no I/O error: the devices are
//! ublkd's); every call repeated answers OK; usage and the volume's condition from
//! ublkd's view (abnormal while a device waits for an operator, normal once
//! recovered); an online expand that grows the filesystem; unpublish and unstage,
//! which delete the devices; the loop volume staged again with its file; and the
//! spec's codes for unknown volumes, missing arguments and wrong capabilities.
//! These tests need `/dev/ublk-control` and root: they run inside the test VM.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use tonic::{Code, Status};
use ublkd_csi::csi::identity_client::IdentityClient;
use ublkd_csi::csi::node_client::NodeClient;
use ublkd_csi::csi::node_service_capability::{self, rpc};
use ublkd_csi::csi::volume_capability::access_mode::Mode;
use ublkd_csi::csi::volume_capability::{AccessMode, AccessType, MountVolume};
use ublkd_csi::csi::{
    CapacityRange, GetPluginInfoRequest, NodeExpandVolumeRequest, NodeGetCapabilitiesRequest,
    NodeGetInfoRequest, NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse,
    NodePublishVolumeRequest, NodeStageVolumeRequest, NodeUnpublishVolumeRequest,
    NodeUnstageVolumeRequest, ProbeRequest, VolumeCapability, volume_usage,
};

use ublkd_tests::harness::chaos::BackgroundPasses;
use ublkd_tests::harness::csi::CsiPlugin;
use ublkd_tests::harness::machine::serial;
use ublkd_tests::harness::process::{run, run_ok, signal};
use ublkd_tests::harness::storage::sparse_file;
use ublkd_tests::harness::ublkd::Ublkd;

const MIB: u64 = 1 << 20;
const ROOT: &str = "/tmp/csi-test";

/// The kubelet's side of the socket: the Identity and Node clients, called one at a
/// time from the test's thread.
struct Kubelet {
    rt: tokio::runtime::Runtime,
    identity: IdentityClient<Channel>,
    node: NodeClient<Channel>,
}

impl Kubelet {
    fn connect(plugin: &CsiPlugin) -> Kubelet {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let channel = rt
            .block_on(ublkd_csi::client::connect(plugin.endpoint.clone()))
            .unwrap_or_else(|e| panic!("cannot connect to ublkd-csi: {e}\n{}", plugin.log()));
        Kubelet {
            rt,
            identity: IdentityClient::new(channel.clone()),
            node: NodeClient::new(channel),
        }
    }

    fn ready(&mut self) -> bool {
        let probe = self.rt.block_on(self.identity.probe(ProbeRequest {})).unwrap();
        probe.into_inner().ready == Some(true)
    }

    fn stage(&mut self, req: NodeStageVolumeRequest) -> Result<(), Status> {
        self.rt.block_on(self.node.node_stage_volume(req)).map(drop)
    }

    fn unstage(&mut self, id: &str, staging: &Path) -> Result<(), Status> {
        let req = NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: path_str(staging),
        };
        self.rt.block_on(self.node.node_unstage_volume(req)).map(drop)
    }

    fn publish(&mut self, req: NodePublishVolumeRequest) -> Result<(), Status> {
        self.rt.block_on(self.node.node_publish_volume(req)).map(drop)
    }

    fn unpublish(&mut self, id: &str, target: &Path) -> Result<(), Status> {
        let req =
            NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: path_str(target) };
        self.rt.block_on(self.node.node_unpublish_volume(req)).map(drop)
    }

    fn stats(&mut self, id: &str, path: &Path) -> Result<NodeGetVolumeStatsResponse, Status> {
        let req = NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path_str(path),
            staging_target_path: String::new(),
        };
        self.rt.block_on(self.node.node_get_volume_stats(req)).map(|r| r.into_inner())
    }

    fn expand(&mut self, id: &str, path: &Path, bytes: u64) -> Result<i64, Status> {
        let req = NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path_str(path),
            capacity_range: Some(CapacityRange { required_bytes: bytes as i64, limit_bytes: 0 }),
            ..Default::default()
        };
        self.rt.block_on(self.node.node_expand_volume(req)).map(|r| r.into_inner().capacity_bytes)
    }
}

fn path_str(path: &Path) -> String {
    path.to_str().unwrap().to_string()
}

fn ext4(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode { mode: mode.into() }),
    }
}

fn context(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A volume the test stages and publishes: its id, context, staging and target paths.
struct Volume {
    id: &'static str,
    context: HashMap<String, String>,
    staging: PathBuf,
    target: PathBuf,
}

impl Volume {
    fn new(id: &'static str, context: HashMap<String, String>) -> Volume {
        let staging = PathBuf::from(format!("{ROOT}/staging/{id}"));
        // The kubelet makes the staging directory and the target's parent.
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::create_dir_all(format!("{ROOT}/pods/p1")).unwrap();
        Volume { id, context, staging, target: PathBuf::from(format!("{ROOT}/pods/p1/{id}")) }
    }

    fn stage_req(&self) -> NodeStageVolumeRequest {
        NodeStageVolumeRequest {
            volume_id: self.id.into(),
            staging_target_path: path_str(&self.staging),
            volume_capability: Some(ext4(Mode::SingleNodeWriter)),
            volume_context: self.context.clone(),
            ..Default::default()
        }
    }

    fn publish_req(&self, readonly: bool) -> NodePublishVolumeRequest {
        NodePublishVolumeRequest {
            volume_id: self.id.into(),
            staging_target_path: path_str(&self.staging),
            target_path: path_str(&self.target),
            volume_capability: Some(ext4(Mode::SingleNodeWriter)),
            readonly,
            ..Default::default()
        }
    }
}

fn is_mountpoint(path: &Path) -> bool {
    run(Command::new("mountpoint").arg("-q").arg(path)).status.success()
}

/// The id of ublkd's device named `name`, if it has one.
fn device_named(ublkd: &Ublkd, name: &str) -> Option<u32> {
    ublkd.status().iter().find(|d| d["name"] == name).map(|d| d["id"].as_u64().unwrap() as u32)
}

/// The filesystem's size at `dir`, as df sees it.
fn fs_size(dir: &Path) -> u64 {
    let out = run_ok(Command::new("df").args(["-B1", "--output=size"]).arg(dir));
    out.lines().last().unwrap().trim().parse().unwrap()
}

fn code<T: std::fmt::Debug>(result: Result<T, Status>) -> Code {
    result.expect_err("the call succeeded").code()
}

/// Polls the volume's condition until `abnormal` is `want`; its message.
fn wait_condition(kubelet: &mut Kubelet, vol: &Volume, want: bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = kubelet.stats(vol.id, &vol.target).unwrap();
        let condition = stats.volume_condition.expect("a volume condition");
        if condition.abnormal == want {
            return condition.message;
        }
        assert!(Instant::now() < deadline, "condition still {condition:?} after 30 s");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn volumes_are_staged_published_and_outlive_the_plugin() {
    let _serial = serial();
    let _ = std::fs::remove_dir_all(ROOT);
    // One restart allowed: a second worker kill leaves the device waiting for an
    // operator, the abnormal condition the test reads.
    let recovery = "\n[recovery]\nrestart_max = 1\nrestart_window_secs = 600\n";
    let ublkd = Ublkd::start_with("csi", recovery, &[]);
    let mut plugin = CsiPlugin::start("csi", &ublkd.ctl.socket);
    let mut kubelet = Kubelet::connect(&plugin);

    // Identity and the node's capabilities.
    let info = kubelet.rt.block_on(kubelet.identity.get_plugin_info(GetPluginInfoRequest {}));
    let info = info.unwrap().into_inner();
    assert_eq!(info.name, "ublk.csi.ublkd.io");
    assert!(!info.vendor_version.is_empty());
    assert!(kubelet.ready(), "Probe: not ready with ublkd running");
    let caps =
        kubelet.rt.block_on(kubelet.node.node_get_capabilities(NodeGetCapabilitiesRequest {}));
    let caps: Vec<i32> = caps
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(node_service_capability::Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect();
    for want in [
        rpc::Type::StageUnstageVolume,
        rpc::Type::ExpandVolume,
        rpc::Type::GetVolumeStats,
        rpc::Type::VolumeCondition,
    ] {
        assert!(caps.contains(&(want as i32)), "{want:?} missing from {caps:?}");
    }
    let node = kubelet.rt.block_on(kubelet.node.node_get_info(NodeGetInfoRequest {}));
    assert_eq!(node.unwrap().into_inner().node_id, "test-node");

    // Stage and publish a memory and a loop volume.
    let backing = PathBuf::from("/tmp/csi-loop.img");
    let _ = std::fs::remove_file(&backing);
    sparse_file(&backing, 64 * MIB);
    let mem = Volume::new("mem-1", context(&[("target", "memory"), ("size", "64M")]));
    let lop =
        Volume::new("loop-1", context(&[("target", "loop"), ("file", backing.to_str().unwrap())]));
    for vol in [&mem, &lop] {
        kubelet
            .stage(vol.stage_req())
            .unwrap_or_else(|e| panic!("stage {}: {e}\n{}", vol.id, plugin.log()));
        assert!(
            is_mountpoint(&vol.staging),
            "{} is not mounted after stage",
            vol.staging.display()
        );
        let id = device_named(&ublkd, &format!("csi-{}", vol.id))
            .expect("a device named for the volume");
        let fs = run_ok(
            Command::new("blkid")
                .args(["-o", "value", "-s", "TYPE"])
                .arg(format!("/dev/ublkb{id}")),
        );
        assert_eq!(fs.trim(), "ext4", "stage made no ext4 on volume {}", vol.id);
        kubelet
            .publish(vol.publish_req(false))
            .unwrap_or_else(|e| panic!("publish {}: {e}", vol.id));
        assert!(is_mountpoint(&vol.target));
        std::fs::write(vol.target.join("hello.txt"), format!("written to {}", vol.id)).unwrap();
    }
    // Every call repeated: OK, and nothing new.
    let devices = ublkd.status().len();
    for vol in [&mem, &lop] {
        kubelet.stage(vol.stage_req()).unwrap();
        kubelet.publish(vol.publish_req(false)).unwrap();
    }
    assert_eq!(ublkd.status().len(), devices, "a repeated stage added a device");
    // The same target asked for read-only: incompatible with the publish it has.
    assert_eq!(code(kubelet.publish(mem.publish_req(true))), Code::AlreadyExists);

    // fio verifying on a published path (passes of random reads and writes, each
    // checked, back to back) while the plugin is killed and started again, twice: the
    // plugin is no part of the data path.
    let passes = BackgroundPasses::start(&mem.target.join("fio.dat"), 16 * MIB, 47);
    for round in 1..=2 {
        let old = plugin.pid();
        plugin.sigkill_and_restart();
        assert_ne!(plugin.pid(), old);
        kubelet = Kubelet::connect(&plugin);
        assert!(kubelet.ready(), "Probe after restart {round}");
        // The new plugin finds the volume through ublkd's status.
        let stats = kubelet.stats(mem.id, &mem.target).unwrap();
        assert!(!stats.volume_condition.unwrap().abnormal);
        kubelet.publish(mem.publish_req(false)).unwrap();
    }
    let passes =
        passes.finish().unwrap_or_else(|e| panic!("fio across the plugin's restarts: {e}"));
    assert!(!passes.is_empty());
    assert!(passes.iter().all(|p| p.error == 0), "{passes:?}");

    // Usage and condition: the loop volume's file is counted; a device waiting for an
    // operator is abnormal, and normal again once recovered.
    let stats = kubelet.stats(lop.id, &lop.target).unwrap();
    let bytes = stats.usage.iter().find(|u| u.unit == volume_usage::Unit::Bytes as i32).unwrap();
    assert!(bytes.total > 50 * MIB as i64 && bytes.used > 0 && bytes.available > 0, "{bytes:?}");
    assert!(!stats.volume_condition.unwrap().abnormal);
    let mem_dev = device_named(&ublkd, "csi-mem-1").unwrap();
    ublkd.kill_worker(mem_dev);
    let pid = ublkd.worker_pid(mem_dev);
    assert!(signal(pid, libc::SIGKILL));
    let message = wait_condition(&mut kubelet, &mem, true);
    assert!(message.contains("QUIESCED") || message.contains("operator"), "condition: {message}");
    ublkd.ctl_ok(&["recover", &mem_dev.to_string()]);
    wait_condition(&mut kubelet, &mem, false);

    // Expand the loop volume online: the device and the mounted ext4 grow.
    let before = fs_size(&lop.target);
    let capacity =
        kubelet.expand(lop.id, &lop.target, 128 * MIB).unwrap_or_else(|e| panic!("expand: {e}"));
    assert_eq!(capacity, 128 * MIB as i64);
    let after = fs_size(&lop.target);
    assert!(after > before + 50 * MIB, "ext4 did not grow: {before} -> {after}");
    assert_eq!(std::fs::metadata(&backing).unwrap().len(), 128 * MIB, "the loop file did not grow");
    // Repeated: OK, the same size.
    assert_eq!(kubelet.expand(lop.id, &lop.target, 128 * MIB).unwrap(), 128 * MIB as i64);

    // Unpublish and unstage, each twice: the mounts, targets and devices are gone.
    for vol in [&mem, &lop] {
        for _ in 0..2 {
            kubelet.unpublish(vol.id, &vol.target).unwrap();
        }
        assert!(!vol.target.exists(), "{} left behind", vol.target.display());
        for _ in 0..2 {
            kubelet
                .unstage(vol.id, &vol.staging)
                .unwrap_or_else(|e| panic!("unstage {}: {e}", vol.id));
        }
        assert!(!is_mountpoint(&vol.staging));
        assert_eq!(device_named(&ublkd, &format!("csi-{}", vol.id)), None);
    }
    assert!(ublkd.status().is_empty(), "devices left: {:?}", ublkd.status());

    // The loop volume staged again: its filesystem and file are there (not made anew).
    kubelet.stage(lop.stage_req()).unwrap();
    let hello = std::fs::read_to_string(lop.staging.join("hello.txt")).unwrap();
    assert_eq!(hello, "written to loop-1");
    assert_eq!(fs_size(&lop.staging), after, "the grown filesystem's size");
    kubelet.unstage(lop.id, &lop.staging).unwrap();

    drop(kubelet);
    plugin.stop();
    ublkd.stop();
}

#[test]
fn bad_calls_get_the_specs_codes() {
    let _serial = serial();
    let _ = std::fs::remove_dir_all(ROOT);
    let ublkd = Ublkd::start("csi-codes");
    let plugin = CsiPlugin::start("csi-codes", &ublkd.ctl.socket);
    let mut kubelet = Kubelet::connect(&plugin);
    let vol = Volume::new("codes-1", context(&[("target", "memory"), ("size", "16M")]));

    // Missing arguments: INVALID_ARGUMENT, and nothing added.
    let mut no_id = vol.stage_req();
    no_id.volume_id.clear();
    assert_eq!(code(kubelet.stage(no_id)), Code::InvalidArgument);
    let mut no_path = vol.stage_req();
    no_path.staging_target_path.clear();
    assert_eq!(code(kubelet.stage(no_path)), Code::InvalidArgument);
    let mut no_cap = vol.stage_req();
    no_cap.volume_capability = None;
    assert_eq!(code(kubelet.stage(no_cap)), Code::InvalidArgument);
    let mut typo = vol.stage_req();
    typo.volume_context.insert("sise".into(), "1G".into());
    let status = kubelet.stage(typo).unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("sise"), "{}", status.message());
    // A capability the volume cannot have: FAILED_PRECONDITION.
    let mut shared = vol.stage_req();
    shared.volume_capability = Some(ext4(Mode::MultiNodeMultiWriter));
    assert_eq!(code(kubelet.stage(shared)), Code::FailedPrecondition);
    assert!(ublkd.status().is_empty(), "a refused stage added a device");

    // An unknown volume: NOT_FOUND for publish, stats and expand; unpublish and
    // unstage of what is not there are the idempotent OK.
    assert_eq!(code(kubelet.publish(vol.publish_req(false))), Code::NotFound);
    assert_eq!(code(kubelet.stats(vol.id, &vol.staging)), Code::NotFound);
    assert_eq!(code(kubelet.expand(vol.id, &vol.staging, 32 * MIB)), Code::NotFound);
    kubelet.unpublish(vol.id, &vol.target).unwrap();
    kubelet.unstage(vol.id, &vol.staging).unwrap();

    // Staged: publish without a staging path is FAILED_PRECONDITION, without a target
    // INVALID_ARGUMENT.
    kubelet.stage(vol.stage_req()).unwrap();
    let mut unstaged = vol.publish_req(false);
    unstaged.staging_target_path.clear();
    assert_eq!(code(kubelet.publish(unstaged)), Code::FailedPrecondition);
    let mut no_target = vol.publish_req(false);
    no_target.target_path.clear();
    assert_eq!(code(kubelet.publish(no_target)), Code::InvalidArgument);
    // Staged as memory, asked for as loop: ALREADY_EXISTS.
    let mut other = vol.stage_req();
    other.volume_context = context(&[("target", "loop"), ("file", "/tmp/csi-loop.img")]);
    assert_eq!(code(kubelet.stage(other)), Code::AlreadyExists);
    kubelet.publish(vol.publish_req(false)).unwrap();
    // Unstage while published: FAILED_PRECONDITION, and the volume as it was.
    let status = kubelet.unstage(vol.id, &vol.staging).unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{}", status.message());
    assert!(is_mountpoint(&vol.staging) && is_mountpoint(&vol.target));
    kubelet.unpublish(vol.id, &vol.target).unwrap();
    kubelet.unstage(vol.id, &vol.staging).unwrap();
    assert!(ublkd.status().is_empty());
    drop(kubelet);
    plugin.stop();
    ublkd.stop();
}
