//! The systemd generator's job (`ublkd --systemd-generator DIR`, run by
//! `/usr/lib/systemd/system-generators/ublkd-generator` at boot and at every
//! `systemctl daemon-reload`): open the packaged unit's network to exactly the NBD
//! servers the config names over TCP, and to the Ceph clusters its rbd devices use
//! (their monitors and public network, from each device's Ceph config file; without a
//! public network the monitors only, and a comment saying that the OSDs need a
//! drop-in).
//!
//! The unit gives ublkd no network (`PrivateNetwork=yes`, `IPAddressDeny=any`,
//! `RestrictAddressFamilies=AF_UNIX`), which still reaches servers on unix sockets.
//! For an `nbd://` device whose host is an IP address, the drop-in written here lets
//! ublkd out of the private network namespace, allows AF_INET/AF_INET6 sockets, and
//! allows that address only (`IPAddressDeny=any` stays). The workers get nothing from
//! it: each runs in its own empty network namespace (see the worker's sandbox). A host
//! given by name cannot be allowed here (a generator must not resolve names): the
//! drop-in says so in a comment, and docs/operators-guide.md ("NBD under systemd") says how to allow it by hand.
//!
//! An `nbds://` device also needs the kernel's TLS, which ublkd under the unit cannot
//! have the kernel load on demand (loading a TCP upper layer takes CAP_NET_ADMIN, which
//! the unit does not give): the drop-in has systemd load it first (`modprobe@tls`).

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ublkd_config::{NbdTransport, NbdUri};

use crate::rbd::conf::{ClusterNetwork, cluster_network};

/// Where in the generator's output directory the drop-in goes.
pub const DROP_IN: &str = "ublkd.service.d/50-nbd-network.conf";

/// The drop-in for the NBD URIs a config names and the Ceph clusters its rbd devices
/// use (each as its config file says, or why it could not be read), or `None` if none
/// needs the network.
pub fn network_drop_in<'a>(
    uris: impl IntoIterator<Item = &'a NbdUri>,
    clusters: &[(PathBuf, Result<ClusterNetwork, String>)],
) -> Option<String> {
    let mut allowed: Vec<String> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut tls = false;
    for uri in uris {
        let NbdTransport::Tcp { host, .. } = &uri.transport else { continue };
        tls |= uri.tls.is_some();
        match host.parse::<IpAddr>() {
            Ok(ip) if !allowed.contains(&ip.to_string()) => allowed.push(ip.to_string()),
            Ok(_) => {}
            Err(_) if !names.contains(host) => names.push(host.clone()),
            Err(_) => {}
        }
    }
    // An rbd device's worker talks to the monitors and to every OSD, whose addresses
    // only the cluster knows: the config file's public network holds them. Its
    // cluster_network is not allowed: OSDs replicate among themselves there, and a
    // client never reaches an OSD on it. Without a public network only the monitors
    // are allowed, never `any`: an OSD elsewhere is the operator's to allow, as the
    // drop-in says.
    for (conf, network) in clusters {
        let network = match network {
            Ok(network) => network,
            Err(e) => {
                notes.push(format!("{}: {e}; its rbd devices get no network", conf.display()));
                continue;
            }
        };
        for ip in &network.monitors {
            if !allowed.contains(&ip.to_string()) {
                allowed.push(ip.to_string());
            }
        }
        for name in &network.monitor_names {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        if network.public_networks.is_empty() {
            notes.push(format!(
                "{}: no public_network, so the OSDs' addresses are unknown here: only its \
                 monitors are allowed; set public_network, or allow the OSDs' addresses in \
                 a drop-in of your own (IPAddressAllow=)",
                conf.display()
            ));
        }
        for cidr in &network.public_networks {
            if !allowed.contains(cidr) {
                allowed.push(cidr.clone());
            }
        }
    }
    if allowed.is_empty() && names.is_empty() && notes.is_empty() {
        return None;
    }
    let mut text = String::from(
        "# Written by ublkd's systemd generator from /etc/ublkd/ublkd.toml: the NBD servers\n\
         # its nbd:// devices name. Rewritten at every `systemctl daemon-reload`; takes\n\
         # effect at ublkd's next start.\n",
    );
    if tls {
        text.push_str(
            "[Unit]\n# nbds:// devices: the kernel's TLS carries their sessions.\n\
             Wants=modprobe@tls.service\nAfter=modprobe@tls.service\n",
        );
    }
    text.push_str("[Service]\n");
    for note in &notes {
        let _ = writeln!(text, "# {note}");
    }
    for name in &names {
        let _ = writeln!(
            text,
            "# {name}: a host name, which a generator cannot resolve; allow its addresses in \
             a drop-in of your own (IPAddressAllow=)"
        );
    }
    text.push_str("PrivateNetwork=no\nRestrictAddressFamilies=AF_INET AF_INET6\n");
    for ip in &allowed {
        let _ = writeln!(text, "IPAddressAllow={ip}");
    }
    Some(text)
}

/// Writes the drop-in for the config at `config_path` under `dir` (the generator's
/// "normal" output directory), or nothing if it needs none. Only the config's NBD URIs
/// are read (at boot a loop device's file may not be mounted yet): a device that is
/// not NBD, or whose URI does not parse, is ublkd's to refuse when it starts, not the
/// generator's. Never fails the boot: a config that is not TOML at all is reported and
/// leaves the unit as it is (ublkd, started, says what is wrong with it).
pub fn generate(config_path: &Path, dir: &Path) -> Result<Option<PathBuf>, String> {
    let text = match std::fs::read_to_string(config_path) {
        Ok(text) => text,
        // No config: no devices, nothing to open.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(format!(
                "cannot read {}: {e}; the unit's network stays closed",
                config_path.display()
            ));
        }
    };
    let uris = ublkd_config::nbd_uris(&text)
        .map_err(|e| format!("{}: {e}; the unit's network stays closed", config_path.display()))?;
    let confs = ublkd_config::rbd_ceph_confs(&text)
        .map_err(|e| format!("{}: {e}; the unit's network stays closed", config_path.display()))?;
    let clusters: Vec<_> = confs
        .into_iter()
        .map(|conf| {
            let network = cluster_network(&conf).map_err(|e| e.to_string());
            (conf, network)
        })
        .collect();
    let Some(text) = network_drop_in(uris.iter().flatten(), &clusters) else { return Ok(None) };
    let path = dir.join(DROP_IN);
    std::fs::create_dir_all(path.parent().expect("DROP_IN has a directory"))
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    // systemd's generator directories are root's alone, but the write is the same as
    // every other file ublkd replaces: never through a link, never half-written.
    crate::replace_file::replace(&path, text.as_bytes(), 0o644)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(uris: &[&str]) -> Vec<NbdUri> {
        uris.iter().map(|u| NbdUri::parse(u).unwrap()).collect()
    }

    #[test]
    fn only_tcp_servers_by_address_are_allowed_each_once() {
        assert_eq!(network_drop_in(&parsed(&["nbd+unix:///?socket=/run/n.sock"]), &[]), None);
        let text = network_drop_in(
            &parsed(&[
                "nbd://10.1.2.3/a",
                "nbd://10.1.2.3:10810/b",
                "nbd://[fd00::5]/c",
                "nbd://storage.example/d",
                "nbd+unix:///?socket=/run/n.sock",
            ]),
            &[],
        )
        .unwrap();
        assert!(text.contains("\nPrivateNetwork=no\n"), "{text}");
        assert!(text.contains("\nRestrictAddressFamilies=AF_INET AF_INET6\n"), "{text}");
        let allowed: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("IPAddressAllow=")).collect();
        assert_eq!(allowed, ["10.1.2.3", "fd00::5"]);
        assert!(text.contains("# storage.example: a host name"), "{text}");
        assert!(!text.contains("modprobe@tls"), "{text}");

        let text =
            network_drop_in(&parsed(&["nbds://10.1.2.3/a?tls-certificates=/etc/ublkd/pki"]), &[])
                .unwrap();
        assert!(text.contains("[Unit]\n"), "{text}");
        assert!(text.contains("\nWants=modprobe@tls.service\nAfter=modprobe@tls.service\n"));
        assert!(text.contains("\n[Service]\n") && text.contains("IPAddressAllow=10.1.2.3"));
    }

    #[test]
    fn an_rbd_cluster_is_reached_at_its_monitors_and_public_network() {
        let net = |mons: &[&str], public: &[&str]| ClusterNetwork {
            monitors: mons.iter().map(|m| m.parse().unwrap()).collect(),
            monitor_names: Vec::new(),
            public_networks: public.iter().map(ToString::to_string).collect(),
        };
        let clusters = [
            ("/etc/ceph/a.conf".into(), Ok(net(&["10.0.0.1", "10.0.0.2"], &["10.0.0.0/24"]))),
            ("/etc/ceph/b.conf".into(), Err("cannot read it".to_string())),
        ];
        let text = network_drop_in(&parsed(&["nbd://10.0.0.1/x"]), &clusters).unwrap();
        let allowed: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("IPAddressAllow=")).collect();
        assert_eq!(allowed, ["10.0.0.1", "10.0.0.2", "10.0.0.0/24"]);
        assert!(
            text.contains("# /etc/ceph/b.conf: cannot read it; its rbd devices get no network")
        );
        // Without a public network the OSDs could be anywhere: said, and only the
        // monitors allowed, never every address.
        let clusters = [("/etc/ceph/c.conf".into(), Ok(net(&["10.0.0.1", "::1"], &[])))];
        let text = network_drop_in(&parsed(&[]), &clusters).unwrap();
        let allowed: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("IPAddressAllow=")).collect();
        assert_eq!(allowed, ["10.0.0.1", "::1"], "{text}");
        assert!(!text.contains("any"), "{text}");
        assert!(
            text.contains(
                "# /etc/ceph/c.conf: no public_network, so the OSDs' addresses are unknown \
                 here: only its monitors are allowed; set public_network, or allow the OSDs' \
                 addresses in a drop-in of your own (IPAddressAllow=)"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_missing_config_writes_nothing_and_a_broken_one_says_why() {
        let dir = std::env::temp_dir().join(format!("ublkd-generator-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(generate(&dir.join("none.toml"), &dir), Ok(None));
        let broken = dir.join("broken.toml");
        std::fs::write(&broken, "[[device]\ntarget = \"nbd\"\n").unwrap();
        let err = generate(&broken, &dir).unwrap_err();
        assert!(
            err.starts_with(&broken.display().to_string())
                && err.ends_with("the unit's network stays closed"),
            "{err}"
        );
        let good = dir.join("good.toml");
        std::fs::write(&good, "[[device]]\ntarget = \"nbd\"\nuri = \"nbd://127.0.0.1/x\"\n")
            .unwrap();
        let written = generate(&good, &dir).unwrap().unwrap();
        assert!(std::fs::read_to_string(written).unwrap().contains("IPAddressAllow=127.0.0.1"));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// At boot a loop device's file may not be mounted yet, and a device the generator
    /// does not need may be wrong in ways only ublkd should judge: neither keeps the
    /// NBD server out.
    #[test]
    fn devices_the_generator_does_not_need_never_keep_a_server_out() {
        let dir = std::env::temp_dir().join(format!("ublkd-generator-lax-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("ublkd.toml");
        std::fs::write(
            &config,
            "[daemon]\nfuture_key = 1\n\n\
             [[device]]\ntarget = \"loop\"\nfile = \"/srv/not-mounted-yet/disk.img\"\n\n\
             [[device]]\ntarget = \"floppy\"\n\n\
             [[device]]\ntarget = \"nbd\"\nuri = \"not a uri\"\n\n\
             [[device]]\ntarget = \"nbd\"\nuri = \"nbd://127.0.0.2/export\"\nqueues = 0\n",
        )
        .unwrap();
        let written = generate(&config, &dir).unwrap().expect("a drop-in");
        let text = std::fs::read_to_string(written).unwrap();
        let allowed: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("IPAddressAllow=")).collect();
        assert_eq!(allowed, ["127.0.0.2"], "{text}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
