//! The systemd generator's job (`ublkd --systemd-generator DIR`, run by
//! `/usr/lib/systemd/system-generators/ublkd-generator` at boot and at every
//! `systemctl daemon-reload`): open the packaged unit's network to exactly the NBD
//! servers the config names over TCP.
//!
//! The unit gives ublkd no network (`PrivateNetwork=yes`, `IPAddressDeny=any`,
//! `RestrictAddressFamilies=AF_UNIX`), which still reaches servers on unix sockets.
//! For an `nbd://` device whose host is an IP address, the drop-in written here lets
//! ublkd out of the private network namespace, allows AF_INET/AF_INET6 sockets, and
//! allows that address only (`IPAddressDeny=any` stays). The workers get nothing from
//! it: each runs in its own empty network namespace (see the worker's sandbox). A host
//! given by name cannot be allowed here (a generator must not resolve names): the
//! drop-in says so in a comment, and README.md says how to allow it by hand.
//!
//! An `nbds://` device also needs the kernel's TLS, which ublkd under the unit cannot
//! have the kernel load on demand (loading a TCP upper layer takes CAP_NET_ADMIN, which
//! the unit does not give): the drop-in has systemd load it first (`modprobe@tls`).

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ublkd_config::{Config, NbdTransport, TargetSpec};

/// Where in the generator's output directory the drop-in goes.
pub const DROP_IN: &str = "ublkd.service.d/50-nbd-network.conf";

/// The drop-in for `config`, or `None` if no device needs the network.
pub fn network_drop_in(config: &Config) -> Option<String> {
    let mut allowed: Vec<IpAddr> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut tls = false;
    for device in &config.devices {
        let TargetSpec::Nbd { uri } = &device.target else { continue };
        let NbdTransport::Tcp { host, .. } = &uri.transport else { continue };
        tls |= uri.tls.is_some();
        match host.parse::<IpAddr>() {
            Ok(ip) if !allowed.contains(&ip) => allowed.push(ip),
            Ok(_) => {}
            Err(_) if !names.contains(host) => names.push(host.clone()),
            Err(_) => {}
        }
    }
    if allowed.is_empty() && names.is_empty() {
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
/// "normal" output directory), or nothing if it needs none. Never fails the boot: a
/// config that cannot be read is reported and leaves the unit as it is.
pub fn generate(config_path: &Path, dir: &Path) -> Result<Option<PathBuf>, String> {
    let config = match Config::load(config_path) {
        Ok(config) => config,
        // No config: no devices, nothing to open.
        Err(ublkd_config::ConfigError::Read { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Ok(None);
        }
        Err(e) => {
            return Err(format!("{}; the unit's network stays closed", crate::error_chain(&e)));
        }
    };
    let Some(text) = network_drop_in(&config) else { return Ok(None) };
    let path = dir.join(DROP_IN);
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(path.parent().expect("DROP_IN has a directory"))?;
        std::fs::write(&path, text)
    };
    write().map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(uris: &[&str]) -> Config {
        let mut text = String::new();
        for uri in uris {
            text.push_str(&format!("[[device]]\ntarget = \"nbd\"\nuri = \"{uri}\"\n"));
        }
        text.push_str("[[device]]\ntarget = \"null\"\nsize = \"1G\"\n");
        Config::parse(&text, "test").unwrap()
    }

    #[test]
    fn only_tcp_servers_by_address_are_allowed_each_once() {
        assert_eq!(network_drop_in(&config(&["nbd+unix:///?socket=/run/n.sock"])), None);
        let text = network_drop_in(&config(&[
            "nbd://10.1.2.3/a",
            "nbd://10.1.2.3:10810/b",
            "nbd://[fd00::5]/c",
            "nbd://storage.example/d",
            "nbd+unix:///?socket=/run/n.sock",
        ]))
        .unwrap();
        assert!(text.contains("\nPrivateNetwork=no\n"), "{text}");
        assert!(text.contains("\nRestrictAddressFamilies=AF_INET AF_INET6\n"), "{text}");
        let allowed: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("IPAddressAllow=")).collect();
        assert_eq!(allowed, ["10.1.2.3", "fd00::5"]);
        assert!(text.contains("# storage.example: a host name"), "{text}");
        assert!(!text.contains("modprobe@tls"), "{text}");

        let text = network_drop_in(&config(&["nbds://10.1.2.3/a?tls-certificates=/etc/ublkd/pki"]))
            .unwrap();
        assert!(text.contains("[Unit]\n"), "{text}");
        assert!(text.contains("\nWants=modprobe@tls.service\nAfter=modprobe@tls.service\n"));
        assert!(text.contains("\n[Service]\n") && text.contains("IPAddressAllow=10.1.2.3"));
    }

    #[test]
    fn a_missing_config_writes_nothing_and_a_broken_one_says_why() {
        let dir = std::env::temp_dir().join(format!("ublkd-generator-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(generate(&dir.join("none.toml"), &dir), Ok(None));
        let broken = dir.join("broken.toml");
        std::fs::write(&broken, "[[device]]\ntarget = \"floppy\"\n").unwrap();
        let err = generate(&broken, &dir).unwrap_err();
        assert!(
            err.contains("floppy") && err.ends_with("the unit's network stays closed"),
            "{err}"
        );
        let good = dir.join("good.toml");
        std::fs::write(&good, "[[device]]\ntarget = \"nbd\"\nuri = \"nbd://127.0.0.1/x\"\n")
            .unwrap();
        let written = generate(&good, &dir).unwrap().unwrap();
        assert!(std::fs::read_to_string(written).unwrap().contains("IPAddressAllow=127.0.0.1"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
