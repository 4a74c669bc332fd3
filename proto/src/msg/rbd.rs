//! What an `rbd` worker is told about its Ceph cluster and image, and what it reports
//! back: the contract between the supervisor, which reads the operator's Ceph config
//! and keyring, and the worker, which links librbd and never reads either file.

use serde::{Deserialize, Serialize};

/// The Ceph options that carry a secret: never printed (see [`RbdSetup`]'s `Debug`).
pub const SECRET_OPTIONS: &[&str] = &["key"];

/// The longest an image, pool, namespace, snapshot or client name may be. Ceph's own
/// limits are lower; this bounds what a message may carry.
pub const MAX_NAME_BYTES: usize = 256;

/// The most client identities an activation is told it may fence
/// (`ToWorker::Activate`'s `fence`).
pub const MAX_FENCED_CLIENTS: usize = 16;

/// An RBD image and how to reach it: the worker sets each option with
/// `rados_conf_set` (the supervisor read them from the Ceph config file and keyring
/// the device names), connects as `client.<client_id>`, and opens the image.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RbdSetup {
    pub pool: String,
    /// The pool's RADOS namespace; empty for the default.
    pub namespace: String,
    pub image: String,
    /// A snapshot to serve, read-only.
    pub snapshot: Option<String>,
    /// The cephx id, without `client.`.
    pub client_id: String,
    /// Ceph options in the order they are set: `mon_host`, `key` (the secret), and
    /// what the config file says for the client, then the ones ublkd fixes (no admin
    /// socket, no log file, librbd's cache off so that a completed write is on the
    /// OSDs).
    pub options: Vec<(String, String)>,
    /// How long connecting to the cluster may take before the worker gives up, in
    /// seconds (also librados's `client_mount_timeout`).
    pub connect_timeout_secs: u32,
    /// The device's config allows serving an image without the exclusive-lock feature
    /// writable (`allow_unfenced`; see [`check_fenced`]). Last: the codec is
    /// positional.
    #[serde(default)]
    pub allow_unfenced: bool,
}

impl std::fmt::Debug for RbdSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let options: Vec<(&str, &str)> = self
            .options
            .iter()
            .map(|(k, v)| {
                let v = if SECRET_OPTIONS.contains(&k.as_str()) { "<secret>" } else { v.as_str() };
                (k.as_str(), v)
            })
            .collect();
        f.debug_struct("RbdSetup")
            .field("pool", &self.pool)
            .field("namespace", &self.namespace)
            .field("image", &self.image)
            .field("snapshot", &self.snapshot)
            .field("client_id", &self.client_id)
            .field("options", &options)
            .field("connect_timeout_secs", &self.connect_timeout_secs)
            .field("allow_unfenced", &self.allow_unfenced)
            .finish()
    }
}

impl RbdSetup {
    /// `POOL[/NAMESPACE]/IMAGE[@SNAP]`, as Ceph's tools print an image spec.
    pub fn image_spec(&self) -> String {
        let mut spec = self.pool.clone();
        if !self.namespace.is_empty() {
            spec.push('/');
            spec.push_str(&self.namespace);
        }
        spec.push('/');
        spec.push_str(&self.image);
        if let Some(snap) = &self.snapshot {
            spec.push('@');
            spec.push_str(snap);
        }
        spec
    }
}

/// What `ublkd-worker --probe-rbd` answers (JSON on its stdout) after opening the
/// image: what the supervisor needs to create the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RbdProbe {
    /// The image's (or snapshot's) size in bytes.
    pub size_bytes: u64,
    /// The RADOS object size: the largest request that stays in one object.
    pub object_size: u64,
    /// A snapshot, or an image the client may only read.
    pub read_only: bool,
    /// The image has the exclusive-lock feature, which fencing relies on.
    pub exclusive_lock: bool,
}

/// A writable device on an image without the exclusive-lock feature, which its
/// config did not allow: nothing could fence a dead worker, so a write it still had
/// in flight (in its socket buffers, or held by the network) could land after its
/// successor's newer data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "image {spec} has no exclusive-lock feature, so nothing could fence a dead worker's \
     writes still in flight from landing after its successor's; enable it with `rbd \
     feature enable {spec} exclusive-lock`, make the device read-only, or set \
     allow_unfenced = true in the device's config to serve it writable without that \
     guarantee"
)]
pub struct Unfenced {
    pub spec: String,
}

/// Whether a device may serve `image` (its facts as the probe or the worker learnt
/// them): a writable device needs the exclusive-lock feature, which fencing relies on,
/// unless its config allows it unfenced. A snapshot (`image.read_only`) or a read-only
/// device (`device_read_only`) writes nothing and needs no lock. The supervisor asks
/// this of the probe's answer (so that `add` fails with the reason) and the worker
/// again of what it opened: each trusts its own facts.
pub fn check_fenced(
    spec: &str,
    image: &RbdProbe,
    device_read_only: bool,
    allow_unfenced: bool,
) -> Result<(), Unfenced> {
    if image.exclusive_lock || image.read_only || device_read_only || allow_unfenced {
        Ok(())
    } else {
        Err(Unfenced { spec: spec.to_owned() })
    }
}

/// What the probe prints: the image's facts, or one line saying why not (the image
/// does not exist, the key was refused, the cluster did not answer in time).
pub type RbdProbeAnswer = Result<RbdProbe, String>;

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> RbdSetup {
        RbdSetup {
            pool: "rbd".into(),
            namespace: String::new(),
            image: "disk".into(),
            snapshot: Some("before".into()),
            client_id: "ublkd".into(),
            options: vec![
                ("mon_host".into(), "[v2:10.0.0.1:3300]".into()),
                ("key".into(), "AQBsecretsecretsecret==".into()),
            ],
            connect_timeout_secs: 30,
            allow_unfenced: false,
        }
    }

    #[test]
    fn only_a_writable_device_on_an_image_without_exclusive_lock_is_unfenced() {
        let image = |exclusive_lock, read_only| RbdProbe {
            size_bytes: 1 << 30,
            object_size: 4 << 20,
            read_only,
            exclusive_lock,
        };
        let err = check_fenced("rbd/d", &image(false, false), false, false).unwrap_err();
        let said = err.to_string();
        assert!(said.contains("`rbd feature enable rbd/d exclusive-lock`"), "{said}");
        assert!(said.contains("allow_unfenced = true"), "{said}");
        assert!(check_fenced("rbd/d", &image(true, false), false, false).is_ok());
        assert!(check_fenced("rbd/d@s", &image(false, true), false, false).is_ok());
        assert!(check_fenced("rbd/d", &image(false, false), true, false).is_ok());
        assert!(check_fenced("rbd/d", &image(false, false), false, true).is_ok());
    }

    #[test]
    fn debug_never_shows_the_key() {
        let shown = format!("{:?}", setup());
        assert!(!shown.contains("AQBsecret"), "{shown}");
        assert!(shown.contains("<secret>") && shown.contains("10.0.0.1"), "{shown}");
    }

    #[test]
    fn image_spec_is_what_ceph_tools_print() {
        let mut s = setup();
        assert_eq!(s.image_spec(), "rbd/disk@before");
        s.namespace = "ns".into();
        s.snapshot = None;
        assert_eq!(s.image_spec(), "rbd/ns/disk");
    }

    #[test]
    fn a_setup_survives_the_codec() {
        let bytes = crate::codec::encode(&setup()).unwrap();
        let back: RbdSetup = crate::codec::decode(&bytes).unwrap();
        assert_eq!(back, setup());
    }
}
