//! A volume capability (how a pod uses the volume: a filesystem or a raw block device,
//! and who may write) checked and turned into what this driver does with it.

use crate::csi::VolumeCapability;
use crate::csi::volume_capability::{AccessType, access_mode::Mode};
use crate::mount;

/// Why a volume capability is not one this driver serves.
#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    #[error("the request has no volume_capability")]
    Missing,
    #[error("{0}")]
    Bad(String),
    #[error("the volume capability is not one this driver serves: {0}")]
    Unsupported(String),
}

/// How a volume is used, from its capability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    Block,
    Mount { fs: String, flags: Vec<String> },
}

/// The capability's access type and whether every user only reads.
pub fn access(cap: Option<&VolumeCapability>) -> Result<(Access, bool), CapabilityError> {
    let cap = cap.ok_or(CapabilityError::Missing)?;
    let access = match &cap.access_type {
        None => {
            return Err(CapabilityError::Bad("the volume capability has no access type".into()));
        }
        Some(AccessType::Block(_)) => Access::Block,
        Some(AccessType::Mount(m)) => {
            let fs = if m.fs_type.is_empty() { "ext4".to_string() } else { m.fs_type.clone() };
            if !mount::FILESYSTEMS.contains(&fs.as_str()) {
                return Err(CapabilityError::Unsupported(format!(
                    "filesystem {fs:?} (this driver makes {})",
                    mount::FILESYSTEMS.join(" and ")
                )));
            }
            Access::Mount { fs, flags: m.mount_flags.clone() }
        }
    };
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or(CapabilityError::Bad("the volume capability has no access mode".into()))?;
    let read_only = match Mode::try_from(mode.mode) {
        Ok(Mode::SingleNodeWriter | Mode::SingleNodeSingleWriter | Mode::SingleNodeMultiWriter) => {
            false
        }
        Ok(Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly) => true,
        Ok(m @ (Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter)) => {
            return Err(CapabilityError::Unsupported(format!(
                "access mode {}: a ublk device is one node's disk",
                m.as_str_name()
            )));
        }
        Ok(Mode::Unknown) | Err(_) => {
            return Err(CapabilityError::Bad(format!(
                "access mode {} is not a known one",
                mode.mode
            )));
        }
    };
    Ok((access, read_only))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::volume_capability::{AccessMode, BlockVolume, MountVolume};
    use crate::node::NodeError;
    use tonic::Code;

    fn cap(access_type: Option<AccessType>, mode: Mode) -> VolumeCapability {
        VolumeCapability { access_type, access_mode: Some(AccessMode { mode: mode.into() }) }
    }

    fn mount_cap(fs: &str, mode: Mode) -> VolumeCapability {
        let m = MountVolume { fs_type: fs.into(), ..Default::default() };
        cap(Some(AccessType::Mount(m)), mode)
    }

    #[test]
    fn capabilities_map_to_access_and_read_only() {
        let (a, ro) = access(Some(&mount_cap("", Mode::SingleNodeWriter))).unwrap();
        assert_eq!(a, Access::Mount { fs: "ext4".into(), flags: vec![] });
        assert!(!ro);
        let (a, ro) =
            access(Some(&cap(Some(AccessType::Block(BlockVolume {})), Mode::MultiNodeReaderOnly)))
                .unwrap();
        assert_eq!(a, Access::Block);
        assert!(ro);
    }

    #[test]
    fn wrong_capabilities_get_the_specs_codes() {
        let code = |c: Option<&VolumeCapability>| NodeError::from(access(c).unwrap_err()).code();
        assert_eq!(code(None), Code::InvalidArgument);
        assert_eq!(code(Some(&cap(None, Mode::SingleNodeWriter))), Code::InvalidArgument);
        assert_eq!(
            code(Some(&mount_cap("btrfs", Mode::SingleNodeWriter))),
            Code::FailedPrecondition
        );
        assert_eq!(
            code(Some(&mount_cap("ext4", Mode::MultiNodeMultiWriter))),
            Code::FailedPrecondition
        );
        assert_eq!(code(Some(&mount_cap("ext4", Mode::Unknown))), Code::InvalidArgument);
    }
}
