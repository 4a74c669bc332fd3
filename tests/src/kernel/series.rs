//! Which Debian kernel line the VM boots, and where apt finds its packages.

use super::{AbiVersion, ENV_KERNEL, LTS_RELEASE, MIN_RELEASE, SID};

/// Which Debian kernel line the VM boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Series {
    /// Debian sid's newest cloud kernel ≥ 7.0 ([`MIN_RELEASE`]): the one ublkd's batch
    /// data path needs. Named `7` (also `7.x`, `newest`).
    #[default]
    Newest,
    /// Debian's newest 6.12 LTS cloud kernel ([`LTS_RELEASE`]): no `UBLK_F_BATCH_IO`.
    /// Named `6.12`.
    Lts6_12,
}

/// A `--kernel` or `UBLKD_VM_KERNEL` value that names no [`Series`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown kernel {0:?}: expected 7 (Debian sid's newest >= 7.0, the default) or 6.12 (Debian's 6.12 LTS)"
)]
pub struct UnknownSeries(pub String);

impl Series {
    /// Every series, the default first.
    pub const ALL: [Self; 2] = [Self::Newest, Self::Lts6_12];

    /// The name `--kernel` takes and the guest is told (`7`, `6.12`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Newest => "7",
            Self::Lts6_12 => "6.12",
        }
    }

    /// The series `$UBLKD_VM_KERNEL` names, `None` if it is unset or empty.
    pub fn from_env() -> Result<Option<Self>, UnknownSeries> {
        match std::env::var(ENV_KERNEL) {
            Ok(v) if !v.is_empty() => v.parse().map(Some),
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => {
                Err(UnknownSeries(v.to_string_lossy().into_owned()))
            }
        }
    }

    /// The `apt-cache search --names-only` pattern for the series' cloud kernels.
    pub(super) fn search_pattern(self) -> &'static str {
        match self {
            Self::Newest => "^linux-binary-[0-9].*-cloud-amd64$",
            Self::Lts6_12 => "^linux-image-6\\.12\\.[0-9].*-cloud-amd64$",
        }
    }

    /// The prefix of the package whose name carries the ABI.
    pub(super) fn package_prefix(self) -> &'static str {
        match self {
            Self::Newest => "linux-binary-",
            Self::Lts6_12 => "linux-image-",
        }
    }

    /// Whether a kernel of version `version` belongs to this series. (A 6.12 ABI must
    /// have a patch level: `linux-image-6.12-cloud-amd64` is the meta package.)
    pub fn accepts(self, version: &AbiVersion) -> bool {
        match self {
            Self::Newest => version.at_least(MIN_RELEASE),
            Self::Lts6_12 => version.release.len() >= 3 && version.release[..2] == LTS_RELEASE[..],
        }
    }

    /// The packages holding kernel `abi`'s files, each with the suite to take it from
    /// (`None`: apt's candidate, from whichever suite has it).
    pub(super) fn packages(self, abi: &str) -> Vec<(String, Option<&'static str>)> {
        match self {
            Self::Newest => ["linux-binary-", "linux-modules-", "linux-base-"]
                .iter()
                .map(|prefix| (format!("{prefix}{abi}"), Some(SID)))
                .collect(),
            Self::Lts6_12 => vec![(format!("linux-image-{abi}"), None)],
        }
    }
}

impl std::fmt::Display for Series {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Series {
    type Err = UnknownSeries;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "7" | "7.x" | "newest" => Ok(Self::Newest),
            "6.12" | "6.12.x" => Ok(Self::Lts6_12),
            _ => Err(UnknownSeries(s.to_owned())),
        }
    }
}
