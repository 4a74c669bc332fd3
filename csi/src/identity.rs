//! The CSI Identity service: the plugin's name and version, its capabilities, and its
//! readiness, which is ublkd's (the driver can do nothing without it).

use tonic::{Request, Response, Status};

use crate::csi::identity_server::Identity;
use crate::csi::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, ProbeRequest, ProbeResponse,
};
use crate::ctl::Ctl;

/// The driver's name, as a CSIDriver object and the kubelet know it.
pub const DRIVER_NAME: &str = "ublk.csi.ublkd.io";

#[derive(Debug, Clone)]
pub struct IdentityService {
    ctl: Ctl,
}

impl IdentityService {
    pub fn new(ctl: Ctl) -> IdentityService {
        IdentityService { ctl }
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    /// None: there is no Controller service yet (volumes are static: a
    /// PersistentVolume's volume context names what backs it), and every volume is
    /// reachable from any node that has ublkd and the backing.
    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse { capabilities: Vec::new() }))
    }

    /// Ready when ublkd answers on its control socket; not ready (an answer, not an
    /// error: the plugin itself is fine) when it does not.
    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        let ctl = self.ctl.clone();
        let ready = tokio::task::spawn_blocking(move || ctl.ready())
            .await
            .map_err(|e| Status::internal(format!("the probe's thread failed: {e}")))?;
        if let Err(e) = &ready {
            tracing::warn!("probe: not ready: {e}");
        }
        Ok(Response::new(ProbeResponse { ready: Some(ready.is_ok()) }))
    }
}
