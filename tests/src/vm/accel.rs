//! Which accelerator qemu uses: KVM where the host really has it, else TCG.

use std::fs::{self, File};

use super::{ENV_ACCEL, VmError};

/// The accelerator qemu uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation (`-accel kvm -cpu host`).
    Kvm,
    /// qemu's emulator.
    Tcg,
}

impl Accel {
    /// `kvm` or `tcg`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Tcg => "tcg",
        }
    }

    /// The `UBLKD_VM_ACCEL` override, if set.
    pub fn from_env() -> Result<Option<Self>, VmError> {
        match std::env::var(ENV_ACCEL).ok().filter(|v| !v.is_empty()).as_deref() {
            None => Ok(None),
            Some("kvm") => Ok(Some(Self::Kvm)),
            Some("tcg") => Ok(Some(Self::Tcg)),
            Some(other) => Err(VmError::BadAccel(other.to_owned())),
        }
    }

    /// KVM if `/dev/kvm` opens read-write and the CPU has vmx or svm, else TCG. (On
    /// PVM hosts `/dev/kvm` exists without vmx/svm, and KVM guests die in the kernel
    /// decompressor.)
    pub fn detect() -> Self {
        let dev = File::options().read(true).write(true).open("/dev/kvm").is_ok();
        let cpu = fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| cpuinfo_has_virt(&c));
        if dev && cpu { Self::Kvm } else { Self::Tcg }
    }
}

/// Whether a `/proc/cpuinfo` `flags` line lists `vmx` or `svm`.
pub fn cpuinfo_has_virt(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .flat_map(|l| l.split_whitespace())
        .any(|f| f == "vmx" || f == "svm")
}
