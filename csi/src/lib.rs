//! ublkd-csi: a Kubernetes CSI driver whose volumes are ublkd's devices. It serves the
//! CSI v1 Identity and Node services on a unix socket and drives ublkd only through
//! ublkd's control socket; it never opens a device itself, so killing, restarting or
//! upgrading the driver leaves every volume's data path as it was (see docs/csi.md).
//!
//! - [`identity`]: plugin info, capabilities, Probe (ublkd's readiness).
//! - [`node`]: stage, publish, expand, stats and condition of a volume on this node.
//! - [`volume`]: a volume id's device name, and its volume context's add request.
//! - [`ctl`]: the requests to ublkd's control socket.
//! - [`mount`]: mounts, filesystems and usage on the node.
//! - [`client`]: connecting to the driver's socket (tests, health checks).

pub mod capability;
pub mod client;
pub mod ctl;
pub mod identity;
pub mod mount;
pub mod node;
pub mod volume;

/// The CSI v1 messages and services, generated from proto/csi.proto.
#[allow(missing_debug_implementations, unused_qualifications, clippy::all)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}
