//! What a volume is to ublkd: the device's name derived from the volume id, and the
//! `ublkctl add` request its volume context describes. This module owns the context's
//! keys (docs/csi.md lists them) and their checks; nothing here talks to ublkd.

use std::collections::HashMap;
use std::path::PathBuf;

use ublkd_proto::msg::{AddRequest, RbdAdd, TargetKind};

/// Every device the driver adds is named this followed by the volume id, so that the
/// driver (restarted, or after ublkd restarted) finds a staged volume again in ublkd's
/// status, and tells its devices from an operator's.
pub const NAME_PREFIX: &str = "csi-";

/// The context keys a volume may have (besides keys with a `/`, which Kubernetes and
/// its sidecars add and this driver ignores).
pub const KEYS: [&str; 9] =
    ["target", "size", "file", "uri", "image", "ceph-conf", "ceph-id", "keyring", "queues"];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VolumeError {
    #[error(
        "volume id {id:?} cannot name a ublkd device: {problem} (the device is named \
         \"{NAME_PREFIX}\" and the id)"
    )]
    BadId { id: String, problem: String },
    #[error("the volume context has no \"target\"; give one of memory, loop, nbd, rbd")]
    NoTarget,
    #[error("the volume context's target {0:?} is not one of memory, loop, nbd, rbd")]
    UnknownTarget(String),
    #[error("the volume context's key {0:?} is not one this driver knows ({known})", known = KEYS.join(", "))]
    UnknownKey(String),
    #[error("the volume context's {key:?} is {value:?}: {problem}")]
    BadValue { key: &'static str, value: String, problem: String },
    #[error("a {target} volume needs {key:?} in its volume context")]
    Missing { target: &'static str, key: &'static str },
    #[error("{key:?} does not apply to a {target} volume")]
    DoesNotApply { target: &'static str, key: &'static str },
}

/// The ublkd device name of volume `id`.
pub fn device_name(id: &str) -> Result<String, VolumeError> {
    let name = format!("{NAME_PREFIX}{id}");
    ublkd_config::check_name(&name)
        .map_err(|e| VolumeError::BadId { id: id.to_string(), problem: e.problem })?;
    Ok(name)
}

/// The add request for volume `id` from its volume context; `read_only` for a volume
/// every user of which reads only.
pub fn add_request(
    id: &str,
    context: &HashMap<String, String>,
    read_only: bool,
) -> Result<AddRequest, VolumeError> {
    let name = device_name(id)?;
    if let Some(key) = context.keys().find(|k| !k.contains('/') && !KEYS.contains(&k.as_str())) {
        return Err(VolumeError::UnknownKey(key.clone()));
    }
    let get = |key: &str| context.get(key).map(String::as_str);
    let target = match get("target") {
        None => return Err(VolumeError::NoTarget),
        Some("memory") => TargetKind::Memory,
        Some("loop") => TargetKind::Loop,
        Some("nbd") => TargetKind::Nbd,
        Some("rbd") => TargetKind::Rbd,
        Some(other) => return Err(VolumeError::UnknownTarget(other.to_string())),
    };
    let tname = target.name();
    let only = |key: &'static str, allowed: &[TargetKind]| -> Result<(), VolumeError> {
        if get(key).is_some() && !allowed.contains(&target) {
            return Err(VolumeError::DoesNotApply { target: tname, key });
        }
        Ok(())
    };
    let need = |key: &'static str| get(key).ok_or(VolumeError::Missing { target: tname, key });
    only("size", &[TargetKind::Memory, TargetKind::Loop])?;
    only("file", &[TargetKind::Loop])?;
    only("uri", &[TargetKind::Nbd])?;
    for key in ["image", "ceph-conf", "ceph-id", "keyring"] {
        only(key, &[TargetKind::Rbd])?;
    }
    let size = get("size")
        .map(|v| {
            ublkd_config::parse_size(v).map_err(|e| VolumeError::BadValue {
                key: "size",
                value: v.to_string(),
                problem: e.to_string(),
            })
        })
        .transpose()?;
    let queues = get("queues")
        .map(|v| {
            v.parse::<u16>().map_err(|e| VolumeError::BadValue {
                key: "queues",
                value: v.to_string(),
                problem: e.to_string(),
            })
        })
        .transpose()?;
    let absolute = |key: &'static str, v: &str| -> Result<PathBuf, VolumeError> {
        let path = PathBuf::from(v);
        if path.is_absolute() {
            Ok(path)
        } else {
            Err(VolumeError::BadValue {
                key,
                value: v.to_string(),
                problem: "not an absolute path".into(),
            })
        }
    };
    let file = match target {
        TargetKind::Loop => Some(absolute("file", need("file")?)?),
        _ => None,
    };
    let uri = match target {
        TargetKind::Nbd => Some(need("uri")?.to_string()),
        _ => None,
    };
    if target == TargetKind::Memory {
        need("size")?;
    }
    let rbd = match target {
        TargetKind::Rbd => Some(RbdAdd {
            image: Some(need("image")?.to_string()),
            ceph_conf: get("ceph-conf").map(|v| absolute("ceph-conf", v)).transpose()?,
            ceph_id: get("ceph-id").map(str::to_string),
            keyring: get("keyring").map(|v| absolute("keyring", v)).transpose()?,
        }),
        _ => None,
    };
    Ok(AddRequest {
        id: None,
        target,
        file,
        uri,
        size,
        queues,
        queue_depth: None,
        threads: None,
        zero_copy: None,
        sandbox: None,
        sandbox_optional: None,
        rbd,
        name: Some(name),
        read_only,
        partitions: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn a_memory_volume_is_a_named_memory_device() {
        let req = add_request("pvc-1", &context(&[("target", "memory"), ("size", "64M")]), false)
            .unwrap();
        assert_eq!(req.target, TargetKind::Memory);
        assert_eq!(req.size, Some(64 << 20));
        assert_eq!(req.name.as_deref(), Some("csi-pvc-1"));
    }

    #[test]
    fn a_loop_volume_needs_an_absolute_file() {
        let ctx = context(&[("target", "loop"), ("file", "/srv/v.img")]);
        let req = add_request("v", &ctx, true).unwrap();
        assert_eq!(req.file, Some(PathBuf::from("/srv/v.img")));
        assert!(req.read_only);
        assert_eq!(
            add_request("v", &context(&[("target", "loop")]), false),
            Err(VolumeError::Missing { target: "loop", key: "file" })
        );
        let relative = add_request("v", &context(&[("target", "loop"), ("file", "v.img")]), false);
        assert!(matches!(relative, Err(VolumeError::BadValue { key: "file", .. })));
    }

    #[test]
    fn nbd_and_rbd_take_their_own_keys_only() {
        let nbd = context(&[("target", "nbd"), ("uri", "nbd://10.0.0.1/disk")]);
        assert_eq!(
            add_request("v", &nbd, false).unwrap().uri.as_deref(),
            Some("nbd://10.0.0.1/disk")
        );
        let rbd = context(&[("target", "rbd"), ("image", "rbd/img"), ("ceph-id", "csi")]);
        let req = add_request("v", &rbd, false).unwrap();
        assert_eq!(req.rbd.unwrap().image.as_deref(), Some("rbd/img"));
        let wrong = context(&[("target", "nbd"), ("uri", "nbd://h/x"), ("size", "1G")]);
        assert_eq!(
            add_request("v", &wrong, false),
            Err(VolumeError::DoesNotApply { target: "nbd", key: "size" })
        );
    }

    #[test]
    fn bad_contexts_are_refused_naming_the_key() {
        assert_eq!(add_request("v", &context(&[]), false), Err(VolumeError::NoTarget));
        assert_eq!(
            add_request("v", &context(&[("target", "null")]), false),
            Err(VolumeError::UnknownTarget("null".into()))
        );
        let typo = context(&[("target", "memory"), ("size", "1G"), ("sise", "2G")]);
        assert_eq!(add_request("v", &typo, false), Err(VolumeError::UnknownKey("sise".into())));
        // Kubernetes' own keys are not the driver's business.
        let k8s =
            context(&[("target", "memory"), ("size", "1G"), ("csi.storage.k8s.io/pv/name", "x")]);
        assert!(add_request("v", &k8s, false).is_ok());
        let size = context(&[("target", "memory"), ("size", "lots")]);
        assert!(matches!(
            add_request("v", &size, false),
            Err(VolumeError::BadValue { key: "size", .. })
        ));
    }

    #[test]
    fn a_volume_id_that_cannot_be_a_name_is_refused() {
        assert_eq!(device_name("pvc-0f1e").unwrap(), "csi-pvc-0f1e");
        assert!(matches!(device_name("a/b"), Err(VolumeError::BadId { .. })));
        assert!(matches!(device_name(&"x".repeat(61)), Err(VolumeError::BadId { .. })));
    }
}
