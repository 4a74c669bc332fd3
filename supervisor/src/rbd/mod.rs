//! The `rbd` target, as the supervisor sees it: what an rbd device's workers are told
//! (the options and key read from the operator's Ceph files, [`conf`]), what the image
//! is before the device is made (a probe by a short-lived worker process, [`probe`]:
//! ublkd itself never loads librbd), and which RADOS clients its workers were, so that
//! each new worker breaks (and with it blocklists) the image's lock only if one of them
//! holds it ([`RbdTarget::fence_for`]).

pub mod conf;
pub mod probe;

use std::time::Duration;

use ublkd_config::{DeviceSpec, RbdSpec, TargetSpec};
use ublkd_proto::msg::rbd::{MAX_FENCED_CLIENTS, RbdSetup};

pub use conf::CephConfError;
pub use probe::{ProbeError, probe_image};

/// How long a worker (or the probe) may take to connect to the cluster before it gives
/// up with "no monitor answered": Ceph's own default is 300 s, far too long for an
/// `ublkctl add` to hang on a wrong address.
pub const CONNECT_TIMEOUT_SECS: u32 = 20;

/// An rbd device's target: its spec and its workers' clients.
#[derive(Debug, Clone)]
pub struct RbdTarget {
    spec: RbdSpec,
    /// The RADOS clients of the device's activated workers, oldest first, at most
    /// [`MAX_FENCED_CLIENTS`]: what a new worker may fence.
    clients: Vec<String>,
}

impl RbdTarget {
    /// The target of `spec`, if it is an rbd device.
    pub fn for_spec(spec: &DeviceSpec) -> Option<RbdTarget> {
        match &spec.target {
            TargetSpec::Rbd(rbd) => Some(RbdTarget { spec: rbd.clone(), clients: Vec::new() }),
            _ => None,
        }
    }

    /// What the next worker is told: read from the Ceph files now, so that a changed
    /// key or monitor list reaches the next worker. With `cluster_wait`
    /// (`recovery.rbd_cluster_wait_secs`), a request the cluster has not answered in
    /// that long fails (librados's `rados_osd_op_timeout`), and the device with EIO.
    pub fn worker_setup(&self, cluster_wait: Option<Duration>) -> Result<RbdSetup, CephConfError> {
        let mut setup = setup_for(&self.spec)?;
        if let Some(wait) = cluster_wait {
            setup.options.push(("rados_osd_op_timeout".into(), wait.as_secs().to_string()));
        }
        Ok(setup)
    }

    /// A worker whose RADOS client is `client` is being activated: records it (before
    /// the worker is told, so that a ublkd that dies now leaves it recorded in the
    /// worker's claim) and returns the clients it may fence: every earlier one.
    pub fn fence_for(&mut self, client: Option<&str>) -> Vec<String> {
        let earlier: Vec<String> =
            self.clients.iter().filter(|c| Some(c.as_str()) != client).cloned().collect();
        if let Some(client) = client
            && !self.clients.iter().any(|c| c == client)
        {
            self.clients.push(client.to_owned());
            let over = self.clients.len().saturating_sub(MAX_FENCED_CLIENTS);
            self.clients.drain(..over);
        }
        earlier
    }

    /// The image, as `POOL/IMAGE[@SNAP]`.
    pub fn image(&self) -> String {
        self.spec.image.to_string()
    }

    /// The clients recorded so far (for the worker's claim).
    pub fn clients(&self) -> &[String] {
        &self.clients
    }

    /// The clients a previous ublkd recorded (from its claim), those that look like
    /// RADOS addresses only.
    pub fn adopt_clients(&mut self, clients: &[String]) {
        let valid = clients.iter().filter(|c| crate::worker::rbd_client_name(c));
        self.clients = valid.take(MAX_FENCED_CLIENTS).cloned().collect();
    }
}

/// The setup message's part for `spec`'s image (for a worker, or the probe of an
/// add). A device that connects as `client.admin` is flagged in the journal each time:
/// its workers hold a key that can write every image and break every lock.
pub fn setup_for(spec: &RbdSpec) -> Result<RbdSetup, CephConfError> {
    let conf::ClientOptions(options) = conf::client_options(spec)?;
    if spec.uses_admin() {
        tracing::warn!(
            image = %spec.image,
            event = "rbd_admin_client",
            "image {} is reached as client.admin, whose key can write every image and \
             break every lock in the cluster; give the device a client of its own \
             (ceph_id, with `profile rbd` caps: see the operator's guide)",
            spec.image
        );
    }
    Ok(RbdSetup {
        pool: spec.image.pool.clone(),
        namespace: spec.image.namespace.clone(),
        image: spec.image.image.clone(),
        snapshot: spec.image.snapshot.clone(),
        client_id: spec.ceph_id().to_owned(),
        options,
        connect_timeout_secs: CONNECT_TIMEOUT_SECS,
        allow_unfenced: spec.allow_unfenced,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ublkd_config::RbdImage;

    fn target() -> RbdTarget {
        let spec = RbdSpec {
            image: RbdImage::parse("rbd/disk").unwrap(),
            ceph_conf: None,
            ceph_id: None,
            keyring: None,
            allow_unfenced: false,
        };
        RbdTarget { spec, clients: Vec::new() }
    }

    #[test]
    fn each_worker_may_fence_every_earlier_one_and_no_other() {
        let mut t = target();
        assert!(t.fence_for(Some("127.0.0.1:0/1")).is_empty());
        assert_eq!(t.fence_for(Some("127.0.0.1:0/2")), ["127.0.0.1:0/1"]);
        // An activation again of the same worker does not fence itself.
        assert_eq!(t.fence_for(Some("127.0.0.1:0/2")), ["127.0.0.1:0/1"]);
        assert_eq!(t.fence_for(None), ["127.0.0.1:0/1", "127.0.0.1:0/2"]);
    }

    #[test]
    fn the_list_keeps_the_newest_and_adoption_drops_what_is_no_address() {
        let mut t = target();
        for n in 0..MAX_FENCED_CLIENTS + 3 {
            t.fence_for(Some(&format!("127.0.0.1:0/{n}")));
        }
        assert_eq!(t.clients().len(), MAX_FENCED_CLIENTS);
        assert_eq!(t.clients()[0], "127.0.0.1:0/3");
        t.adopt_clients(&["127.0.0.1:0/9".into(), "client.admin; rm -rf".into()]);
        assert_eq!(t.clients(), ["127.0.0.1:0/9"]);
    }
}
