//! Step 8 of the sandbox: Landlock, which takes every filesystem access right from the
//! worker, and from an rbd worker every TCP right but connecting to the ports ublkd
//! names (`--rbd-connect-ports`: its cluster's monitors and OSDs).

use super::{Profile, SandboxError};
use crate::sys;

/// TCP ports, both ends included: where an rbd worker may connect (`--rbd-connect-ports`).
pub type PortRange = (u16, u16);

/// The most ports a connect rule list may name (Landlock takes one rule per port).
const MAX_CONNECT_PORTS: usize = 4096;

/// `3300,6789,6800-7568`: the ports of `--rbd-connect-ports`.
pub fn parse_port_ranges(list: &str) -> Result<Vec<PortRange>, String> {
    let port = |p: &str| p.parse::<u16>().map_err(|_| format!("{p:?} is not a TCP port"));
    let mut ranges = Vec::new();
    let mut count = 0usize;
    for item in list.split(',').filter(|i| !i.is_empty()) {
        let (low, high) = match item.split_once('-') {
            Some((low, high)) => (port(low)?, port(high)?),
            None => (port(item)?, port(item)?),
        };
        if low > high || low == 0 {
            return Err(format!("{item:?} is not a range of TCP ports"));
        }
        count += usize::from(high - low) + 1;
        if count > MAX_CONNECT_PORTS {
            return Err(format!("more than {MAX_CONNECT_PORTS} ports"));
        }
        ranges.push((low, high));
    }
    Ok(ranges)
}

/// Landlock: no file access at all; for an rbd worker also TCP, which it may use only
/// to connect to `connect_ports` (the cluster's monitors and OSDs) and never to bind
/// (kernels from Landlock ABI 4, Linux 6.7; older ones enforce the file part only).
pub(super) fn apply_landlock(
    profile: Profile,
    connect_ports: &[PortRange],
) -> Result<Option<u8>, SandboxError> {
    use landlock::{
        ABI, Access, AccessFs, AccessNet, NetPort, Ruleset, RulesetAttr, RulesetCreatedAttr,
        RulesetStatus,
    };
    let abi = ABI::V5;
    let ruleset = Ruleset::default().handle_access(AccessFs::from_all(abi));
    let status = match profile {
        Profile::Standard => ruleset.and_then(|r| r.create()),
        Profile::Rbd => ruleset
            .and_then(|r| r.handle_access(AccessNet::from_all(abi)))
            .and_then(|r| r.create())
            .and_then(|r| {
                r.add_rules(connect_ports.iter().flat_map(|&(low, high)| {
                    (low..=high).map(|port| Ok(NetPort::new(port, AccessNet::ConnectTcp)))
                }))
            }),
    }
    .and_then(|r| r.restrict_self())
    .map_err(SandboxError::Landlock)?;
    Ok(match status.ruleset {
        RulesetStatus::NotEnforced => None,
        RulesetStatus::FullyEnforced | RulesetStatus::PartiallyEnforced => {
            Some(sys::landlock_abi())
        }
    })
}

/// The first Landlock ABI with TCP rules (Linux 6.7).
const TCP_ABI: u8 = 4;

/// Why a worker under `profile` on a kernel of Landlock ABI `abi` has no TCP rules
/// (`None`: it has them, or needs none).
pub(super) fn tcp_missing(profile: Profile, abi: u8) -> Option<String> {
    (profile == Profile::Rbd && abi < TCP_ABI).then(|| {
        format!("the kernel's Landlock ABI {abi} has no TCP control (ABI {TCP_ABI}, Linux 6.7)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_rbd_worker_misses_its_tcp_rules_below_abi_4_only() {
        for abi in 1..TCP_ABI {
            let cause = tcp_missing(Profile::Rbd, abi).expect("missing");
            assert!(cause.contains(&format!("ABI {abi} has no TCP control")), "{cause}");
            assert_eq!(tcp_missing(Profile::Standard, abi), None, "a worker without network");
        }
        for abi in TCP_ABI..=7 {
            assert_eq!(tcp_missing(Profile::Rbd, abi), None);
        }
    }

    #[test]
    fn connect_ports_are_ports_and_ranges_and_not_too_many() {
        assert_eq!(
            parse_port_ranges("3300,6789,6800-7568"),
            Ok(vec![(3300, 3300), (6789, 6789), (6800, 7568)])
        );
        assert_eq!(parse_port_ranges(""), Ok(Vec::new()));
        assert!(parse_port_ranges("7568-6800").unwrap_err().contains("not a range"));
        assert!(parse_port_ranges("0").unwrap_err().contains("not a range"));
        assert!(parse_port_ranges("http").unwrap_err().contains("not a TCP port"));
        assert!(parse_port_ranges("1-65535").unwrap_err().contains("more than"));
    }
}
