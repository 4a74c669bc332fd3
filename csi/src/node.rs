//! The CSI Node service: a volume's life on this node. Stage adds the volume's ublkd
//! device (named for the volume id), waits for it to be LIVE, makes a filesystem on a
//! blank disk and mounts it at the staging path; publish bind-mounts that (or, for a
//! raw block volume, the device node) into a pod; expand, stats and the volume's
//! condition come from ublkd's own view. Unstage deletes the device with ublkd's safe
//! delete, which refuses a disk still in use.
//!
//! The node's state is the kernel's and ublkd's, never the driver's: which device is a
//! volume's comes from ublkd's status (the device's name), what is mounted where from
//! mountinfo; so a driver killed at any point, restarted, finds every volume as it is,
//! and every call is idempotent. This module owns the checks of each request and the
//! mapping of every failure onto the spec's codes.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::{Code, Request, Response, Status};
use ublkd_proto::msg::DevStatus;

use crate::capability::{Access, CapabilityError, access};
use crate::csi::node_server::Node;
use crate::csi::node_service_capability::{Rpc, rpc};
use crate::csi::{
    NodeExpandVolumeRequest, NodeExpandVolumeResponse, NodeGetCapabilitiesRequest,
    NodeGetCapabilitiesResponse, NodeGetInfoRequest, NodeGetInfoResponse,
    NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse, NodePublishVolumeRequest,
    NodePublishVolumeResponse, NodeServiceCapability, NodeStageVolumeRequest,
    NodeStageVolumeResponse, NodeUnpublishVolumeRequest, NodeUnpublishVolumeResponse,
    NodeUnstageVolumeRequest, NodeUnstageVolumeResponse, VolumeCondition, VolumeUsage,
    node_service_capability, volume_usage,
};
use crate::ctl::{Ctl, CtlError};
use crate::mount::{self, MountError};
use crate::volume::{self, VolumeError};

/// How long stage waits for a device just added (or found) to be LIVE: a recovery's
/// worst stall under the test VM's emulation is a few seconds; ublkd's restart budget
/// holds a device longer only when it needs an operator.
const LIVE_WITHIN: Duration = Duration::from_secs(60);

/// Sizes are rounded up to this, a multiple of every block size ublkd serves.
const SIZE_ALIGN: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("the request has no {0}")]
    Missing(&'static str),
    #[error(transparent)]
    Volume(#[from] VolumeError),
    #[error(transparent)]
    Capability(#[from] CapabilityError),
    #[error("volume {0:?} is not on this node (ublkd has no device named \"{prefix}{0}\")", prefix = volume::NAME_PREFIX)]
    UnknownVolume(String),
    #[error("{} does not exist", path.display())]
    NoPath { path: PathBuf },
    #[error("{0}")]
    Incompatible(String),
    #[error(
        "the request has no staging_target_path; this driver stages every volume \
         (STAGE_UNSTAGE_VOLUME)"
    )]
    NoStagingPath,
    #[error("volume {id:?} is not staged at {}: stage it first", path.display())]
    NotStaged { id: String, path: PathBuf },
    #[error("volume {id:?} is still mounted at {}: unpublish it first", list(paths))]
    InUse { id: String, paths: Vec<PathBuf> },
    #[error("another call on volume {0:?} is in progress")]
    Busy(String),
    #[error("device {id} ({name}) is not LIVE after {secs} s: {state}", secs = LIVE_WITHIN.as_secs())]
    NotLive { id: u32, name: String, state: String },
    #[error("the capacity range asks for {required} bytes, more than its limit of {limit}")]
    Range { required: i64, limit: i64 },
    #[error(transparent)]
    Ctl(#[from] CtlError),
    #[error(transparent)]
    Mount(#[from] MountError),
    #[error("the call's thread failed: {0}")]
    Thread(String),
}

impl NodeError {
    pub(crate) fn code(&self) -> Code {
        match self {
            NodeError::Missing(_)
            | NodeError::Volume(_)
            | NodeError::Capability(CapabilityError::Missing | CapabilityError::Bad(_)) => {
                Code::InvalidArgument
            }
            NodeError::Capability(CapabilityError::Unsupported(_))
            | NodeError::NoStagingPath
            | NodeError::NotStaged { .. }
            | NodeError::InUse { .. } => Code::FailedPrecondition,
            NodeError::UnknownVolume(_) | NodeError::NoPath { .. } => Code::NotFound,
            NodeError::Incompatible(_) => Code::AlreadyExists,
            NodeError::Busy(_) => Code::Aborted,
            NodeError::NotLive { .. } => Code::Unavailable,
            NodeError::Range { .. } => Code::OutOfRange,
            // ublkd said no (a disk in use, a size it cannot serve, a backing it cannot
            // open): the node's state does not allow the call.
            NodeError::Ctl(CtlError::Refused(_)) => Code::FailedPrecondition,
            NodeError::Ctl(CtlError::Unreachable { .. } | CtlError::Send(_)) => Code::Unavailable,
            NodeError::Ctl(_) | NodeError::Mount(_) | NodeError::Thread(_) => Code::Internal,
        }
    }
}

impl From<NodeError> for Status {
    fn from(e: NodeError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

fn list(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

fn need<'a>(value: &'a str, what: &'static str) -> Result<&'a str, NodeError> {
    if value.is_empty() { Err(NodeError::Missing(what)) } else { Ok(value) }
}

/// The device node of ublkd's device `id`.
fn device_node(id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/ublkb{id}"))
}

/// Whether ublkd's view of a device is a healthy one, and what it says if not.
fn condition(dev: &DevStatus) -> VolumeCondition {
    let abnormal = dev.state != "LIVE" || dev.failing_io || dev.note.is_some();
    let mut message = dev.state.clone();
    if dev.failing_io {
        message.push_str(", failing I/O");
    }
    if let Some(note) = &dev.note {
        message.push_str(": ");
        message.push_str(note);
    }
    VolumeCondition { abnormal, message }
}

#[derive(Debug)]
struct Inner {
    ctl: Ctl,
    node_id: String,
    /// Volumes a call is working on: a second call on one of them is refused with
    /// ABORTED, as the spec asks, rather than racing the first.
    busy: Mutex<HashSet<String>>,
}

/// The Node service; clones share their state.
#[derive(Debug, Clone)]
pub struct NodeService {
    inner: Arc<Inner>,
}

/// A volume claimed for one call; dropping it releases the volume.
struct Claim<'a> {
    busy: &'a Mutex<HashSet<String>>,
    id: String,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.busy.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}

impl NodeService {
    pub fn new(ctl: Ctl, node_id: String) -> NodeService {
        NodeService { inner: Arc::new(Inner { ctl, node_id, busy: Mutex::default() }) }
    }

    fn claim(&self, id: &str) -> Result<Claim<'_>, NodeError> {
        let mut busy = self.inner.busy.lock().unwrap_or_else(|e| e.into_inner());
        if !busy.insert(id.to_string()) {
            return Err(NodeError::Busy(id.to_string()));
        }
        Ok(Claim { busy: &self.inner.busy, id: id.to_string() })
    }

    /// Runs `call` on a blocking thread (it talks to ublkd and runs commands).
    async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(&NodeService) -> Result<T, NodeError> + Send + 'static,
    ) -> Result<T, Status> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || call(&me))
            .await
            .map_err(|e| NodeError::Thread(e.to_string()))?
            .map_err(|e| {
                tracing::warn!("{e}");
                Status::from(e)
            })
    }

    /// ublkd's device of volume `id`, if it has one.
    fn device(&self, id: &str) -> Result<Option<DevStatus>, NodeError> {
        let name = volume::device_name(id)?;
        Ok(self.inner.ctl.find(&name)?)
    }

    fn wait_live(&self, dev: DevStatus) -> Result<DevStatus, NodeError> {
        let deadline = Instant::now() + LIVE_WITHIN;
        let mut dev = dev;
        loop {
            if dev.state == "LIVE" && !dev.failing_io {
                return Ok(dev);
            }
            if Instant::now() > deadline {
                return Err(NodeError::NotLive {
                    id: dev.id,
                    name: dev.name.clone().unwrap_or_default(),
                    state: condition(&dev).message,
                });
            }
            std::thread::sleep(Duration::from_millis(100));
            dev =
                self.inner.ctl.status_of(dev.id)?.ok_or_else(|| {
                    NodeError::UnknownVolume(dev.name.clone().unwrap_or_default())
                })?;
        }
    }

    fn stage(&self, req: NodeStageVolumeRequest) -> Result<(), NodeError> {
        let id = need(&req.volume_id, "volume_id")?;
        let staging = PathBuf::from(need(&req.staging_target_path, "staging_target_path")?);
        let (access, read_only) = access(req.volume_capability.as_ref())?;
        // Checked before anything is added: a bad context adds nothing.
        let add = volume::add_request(id, &req.volume_context, read_only)?;
        let _claim = self.claim(id)?;
        let dev = match self.device(id)? {
            Some(dev) if dev.target != add.target.name() => {
                return Err(NodeError::Incompatible(format!(
                    "volume {id:?} is staged as a {} device ({}), not {}",
                    dev.target,
                    dev.id,
                    add.target.name()
                )));
            }
            Some(dev) => dev,
            None => {
                let new = self.inner.ctl.add(add)?;
                tracing::info!("volume {id:?}: added device {new}");
                self.inner.ctl.status_of(new)?.ok_or_else(|| NodeError::UnknownVolume(id.into()))?
            }
        };
        let dev = self.wait_live(dev)?;
        let node = device_node(dev.id);
        wait_for_node(&node)?;
        let Access::Mount { fs, flags } = access else {
            // A raw block volume: the device node is what publish hands out.
            return Ok(());
        };
        let rdev = mount::block_dev(&node)?;
        if let Some(m) = mount::mounted_at(&staging)? {
            if m.dev == rdev && m.fs_type == fs {
                return Ok(());
            }
            return Err(NodeError::Incompatible(format!(
                "{} has another mount ({} of device {}:{})",
                staging.display(),
                m.fs_type,
                libc::major(m.dev),
                libc::minor(m.dev)
            )));
        }
        if !staging.is_dir() {
            return Err(NodeError::NoPath { path: staging });
        }
        match mount::fs_type(&node)? {
            None if read_only => {
                return Err(NodeError::Capability(CapabilityError::Unsupported(format!(
                    "volume {id:?} is blank and asked for read-only: no filesystem to mount"
                ))));
            }
            None => {
                tracing::info!("volume {id:?}: blank, making {fs} on {}", node.display());
                mount::mkfs(&fs, &node)?;
            }
            Some(found) if found == fs => {}
            Some(found) => {
                return Err(NodeError::Capability(CapabilityError::Unsupported(format!(
                    "volume {id:?} holds {found}, not the {fs} asked for"
                ))));
            }
        }
        mount::mount_fs(&node, &staging, &fs, &flags, read_only)?;
        Ok(())
    }

    fn unstage(&self, req: NodeUnstageVolumeRequest) -> Result<(), NodeError> {
        let id = need(&req.volume_id, "volume_id")?;
        let staging = PathBuf::from(need(&req.staging_target_path, "staging_target_path")?);
        volume::device_name(id)?;
        let _claim = self.claim(id)?;
        let dev = self.device(id)?;
        if let Some(dev) = &dev {
            let node = device_node(dev.id);
            if let Ok(rdev) = mount::block_dev(&node) {
                if let Some(m) = mount::mounted_at(&staging)?
                    && m.dev != rdev
                {
                    return Err(NodeError::Incompatible(format!(
                        "{} holds another volume's mount, not volume {id:?}'s",
                        staging.display()
                    )));
                }
                // Refused before anything changes: the volume stays staged and usable.
                let elsewhere = mount::mounted_elsewhere(&node, rdev, &staging)?;
                if !elsewhere.is_empty() {
                    return Err(NodeError::InUse { id: id.into(), paths: elsewhere });
                }
            }
        }
        mount::umount_all(&staging)?;
        // Nothing there: unstaged already (the spec's idempotent OK).
        if let Some(dev) = dev {
            self.inner.ctl.delete(dev.id)?;
            tracing::info!("volume {id:?}: deleted device {}", dev.id);
        }
        Ok(())
    }

    fn publish(&self, req: NodePublishVolumeRequest) -> Result<(), NodeError> {
        let id = need(&req.volume_id, "volume_id")?;
        let target = PathBuf::from(need(&req.target_path, "target_path")?);
        let (access, reader_only) = access(req.volume_capability.as_ref())?;
        if req.staging_target_path.is_empty() {
            // The spec's code for this one (STAGE_UNSTAGE_VOLUME is advertised).
            return Err(NodeError::NoStagingPath);
        }
        let staging = PathBuf::from(&req.staging_target_path);
        let read_only = req.readonly || reader_only;
        let _claim = self.claim(id)?;
        let dev = self.device(id)?.ok_or_else(|| NodeError::UnknownVolume(id.into()))?;
        let node = device_node(dev.id);
        let rdev = mount::block_dev(&node)?;
        match access {
            Access::Block => {
                if let Some(m) = mount::mounted_at(&target)? {
                    return if mount::node_dev(&target) == Some(rdev) && m.read_only == read_only {
                        Ok(())
                    } else {
                        Err(NodeError::Incompatible(format!(
                            "{} has another mount, or this volume's with another read-only flag",
                            target.display()
                        )))
                    };
                }
                if let Some(parent) = target.parent() {
                    create_dir(parent)?;
                }
                if !target.exists() {
                    std::fs::File::create(&target).map_err(|source| MountError::Io {
                        what: "cannot create",
                        path: target.clone(),
                        source,
                    })?;
                }
                mount::bind(&node, &target, read_only)?;
            }
            Access::Mount { .. } => {
                match mount::mounted_at(&staging)? {
                    Some(m) if m.dev == rdev => {}
                    _ => return Err(NodeError::NotStaged { id: id.into(), path: staging }),
                }
                if let Some(m) = mount::mounted_at(&target)? {
                    return if m.dev == rdev && m.read_only == read_only {
                        Ok(())
                    } else {
                        Err(NodeError::Incompatible(format!(
                            "{} has another mount, or this volume's with another read-only flag",
                            target.display()
                        )))
                    };
                }
                create_dir(&target)?;
                mount::bind(&staging, &target, read_only)?;
            }
        }
        Ok(())
    }

    fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<(), NodeError> {
        let id = need(&req.volume_id, "volume_id")?;
        let target = PathBuf::from(need(&req.target_path, "target_path")?);
        volume::device_name(id)?;
        let _claim = self.claim(id)?;
        mount::umount_all(&target)?;
        // The driver made the target (a directory, or a file for a raw block volume):
        // it removes it. Gone already is the idempotent case.
        let removed = match std::fs::symlink_metadata(&target) {
            Ok(meta) if meta.is_dir() => std::fs::remove_dir(&target),
            Ok(_) => std::fs::remove_file(&target),
            Err(_) => Ok(()),
        };
        removed.map_err(|source| MountError::Io { what: "cannot remove", path: target, source })?;
        Ok(())
    }

    fn expand(&self, req: NodeExpandVolumeRequest) -> Result<i64, NodeError> {
        let id = need(&req.volume_id, "volume_id")?;
        let path = PathBuf::from(need(&req.volume_path, "volume_path")?);
        let range = req.capacity_range.unwrap_or_default();
        if range.limit_bytes > 0 && range.required_bytes > range.limit_bytes {
            return Err(NodeError::Range {
                required: range.required_bytes,
                limit: range.limit_bytes,
            });
        }
        let block = match req.volume_capability.as_ref() {
            Some(cap) => access(Some(cap))?.0 == Access::Block,
            None => false,
        };
        let _claim = self.claim(id)?;
        let dev = self.device(id)?.ok_or_else(|| NodeError::UnknownVolume(id.into()))?;
        if !path.exists() {
            return Err(NodeError::NoPath { path });
        }
        let required =
            u64::try_from(range.required_bytes).unwrap_or(0).next_multiple_of(SIZE_ALIGN);
        let size = if required > dev.size_bytes {
            let size = self.inner.ctl.resize(dev.id, required)?;
            tracing::info!("volume {id:?}: device {} grown to {size} bytes", dev.id);
            size
        } else {
            dev.size_bytes
        };
        let node = device_node(dev.id);
        let rdev = mount::block_dev(&node)?;
        if !block && let Some(m) = mount::mounted_at(&path)? {
            if m.dev != rdev {
                return Err(NodeError::Incompatible(format!(
                    "{} is not volume {id:?}'s mount",
                    path.display()
                )));
            }
            mount::grow(&m.fs_type, &node, &path)?;
        }
        Ok(i64::try_from(size).unwrap_or(i64::MAX))
    }

    fn stats(
        &self,
        req: NodeGetVolumeStatsRequest,
    ) -> Result<NodeGetVolumeStatsResponse, NodeError> {
        let id = need(&req.volume_id, "volume_id")?;
        let path = PathBuf::from(need(&req.volume_path, "volume_path")?);
        // No claim: stats only read, and a kubelet polls them while other calls run.
        let dev = self.device(id)?.ok_or_else(|| NodeError::UnknownVolume(id.into()))?;
        if !path.exists() {
            return Err(NodeError::NoPath { path });
        }
        let rdev = mount::block_dev(&device_node(dev.id)).ok();
        let mount = mount::mounted_at(&path)?;
        let usage = match mount {
            Some(m) if Some(m.dev) == rdev => {
                let u = mount::usage(&path)?;
                let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                vec![
                    VolumeUsage {
                        available: i(u.available_bytes),
                        total: i(u.total_bytes),
                        used: i(u.used_bytes),
                        unit: volume_usage::Unit::Bytes.into(),
                    },
                    VolumeUsage {
                        available: i(u.free_inodes),
                        total: i(u.total_inodes),
                        used: i(u.total_inodes.saturating_sub(u.free_inodes)),
                        unit: volume_usage::Unit::Inodes.into(),
                    },
                ]
            }
            _ if mount::node_dev(&path).is_some() && mount::node_dev(&path) == rdev => {
                vec![VolumeUsage {
                    available: 0,
                    total: i64::try_from(dev.size_bytes).unwrap_or(i64::MAX),
                    used: 0,
                    unit: volume_usage::Unit::Bytes.into(),
                }]
            }
            _ => {
                return Err(NodeError::NotStaged { id: id.into(), path });
            }
        };
        Ok(NodeGetVolumeStatsResponse { usage, volume_condition: Some(condition(&dev)) })
    }
}

/// Waits for udev (devtmpfs) to create a device's node, which follows the add.
fn wait_for_node(node: &Path) -> Result<(), NodeError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !node.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    mount::block_dev(node)?;
    Ok(())
}

fn create_dir(path: &Path) -> Result<(), NodeError> {
    std::fs::create_dir_all(path).map_err(|source| {
        NodeError::Mount(MountError::Io { what: "cannot create", path: path.into(), source })
    })
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.blocking(move |n| n.stage(req)).await?;
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.blocking(move |n| n.unstage(req)).await?;
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.blocking(move |n| n.publish(req)).await?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.blocking(move |n| n.unpublish(req)).await?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        Ok(Response::new(self.blocking(move |n| n.stats(req)).await?))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let capacity_bytes = self.blocking(move |n| n.expand(req)).await?;
        Ok(Response::new(NodeExpandVolumeResponse { capacity_bytes }))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let capabilities = [
            rpc::Type::StageUnstageVolume,
            rpc::Type::ExpandVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::VolumeCondition,
        ]
        .into_iter()
        .map(|t| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(Rpc { r#type: t.into() })),
        })
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.inner.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_condition_is_abnormal_unless_live_and_quiet() {
        let mut dev = DevStatus {
            id: 0,
            state: "LIVE".into(),
            target: "memory".into(),
            worker_pid: None,
            size_bytes: 0,
            queues: 1,
            queue_depth: 1,
            threads: 1,
            recoveries: 0,
            last_recovery_ms: None,
            last_recovery_reason: None,
            standby_pid: None,
            sandbox: None,
            counters: Default::default(),
            note: None,
            failing_io: false,
            latency: Default::default(),
            name: None,
            read_only: false,
            backing: None,
        };
        assert!(!condition(&dev).abnormal);
        dev.failing_io = true;
        assert!(condition(&dev).abnormal);
        assert!(condition(&dev).message.contains("failing I/O"));
        dev.failing_io = false;
        dev.state = "QUIESCED".into();
        dev.note = Some("waiting for an operator".into());
        let c = condition(&dev);
        assert!(c.abnormal);
        assert_eq!(c.message, "QUIESCED: waiting for an operator");
    }
}
