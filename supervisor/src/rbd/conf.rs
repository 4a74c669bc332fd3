//! Reading what an rbd worker needs from the operator's Ceph files: the config file's
//! options for the client (the monitors' addresses above all) and the client's key from
//! its keyring. ublkd reads both, as root, each time it starts a worker; the worker gets
//! the values in its setup message and never a path, so the key is in no file it can
//! read.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ublkd_config::RbdSpec;

/// The keyrings Ceph's clients look in when nothing names one (`keyring`'s default,
/// without the binary `keyring.bin`, which ublkd does not read).
const DEFAULT_KEYRINGS: &str =
    "/etc/ceph/$cluster.$name.keyring,/etc/ceph/$cluster.keyring,/etc/ceph/keyring";

/// The cluster name in metavariables: ublkd serves clusters named `ceph`, the name
/// every tool defaults to.
const CLUSTER: &str = "ceph";

/// The largest Ceph config file or keyring ublkd reads.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Why the Ceph files do not give what a worker needs.
#[derive(Debug, thiserror::Error)]
pub enum CephConfError {
    #[error("cannot read the Ceph config file {}: {source}", path.display())]
    Conf { path: PathBuf, source: std::io::Error },
    #[error(
        "the Ceph config file {} names no monitor: it needs mon_host (such as \
         mon_host = 10.0.0.1,10.0.0.2) in [global] or [client]",
        path.display()
    )]
    NoMonitors { path: PathBuf },
    #[error("cannot read the keyring {}: {source}", path.display())]
    Keyring { path: PathBuf, source: std::io::Error },
    #[error("the keyring {} holds no key for client.{id}", path.display())]
    NoKeyInKeyring { path: PathBuf, id: String },
    #[error(
        "no key for client.{id}: none of {tried} exists; name the keyring (--keyring or \
         keyring = in the device, or keyring = in the Ceph config file)"
    )]
    NoKeyring { id: String, tried: String },
    #[error("{} is larger than {MAX_FILE_BYTES} bytes; that is no Ceph file", path.display())]
    TooLarge { path: PathBuf },
    #[error(
        "mon_host names {name}, a host name, which a sandboxed rbd worker cannot resolve \
         (it reads no /etc/resolv.conf): give the monitors' addresses in mon_host"
    )]
    MonitorByName { name: String },
}

/// Whether every monitor in `options`' `mon_host` is named by address, as a sandboxed
/// worker needs them.
pub fn check_monitors_by_address(options: &[(String, String)]) -> Result<(), CephConfError> {
    let hosts = options.iter().rev().find(|(k, _)| k == "mon_host").map_or("", |(_, v)| v);
    for token in hosts.split([',', ' ', ';', '\t']) {
        if let Some(Err(name)) = monitor_address(token) {
            return Err(CephConfError::MonitorByName { name });
        }
    }
    Ok(())
}

/// What a worker is told: the Ceph options to set, in order, the key among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions(pub Vec<(String, String)>);

/// `key = value` lines by section, keys in Ceph's one spelling (`mon host`,
/// `mon-host` and `mon_host` are one option).
type Sections = BTreeMap<String, BTreeMap<String, String>>;

/// Ceph's INI dialect: `[section]`, `key = value`, comments after `#` or `;`.
fn parse_ini(text: &str) -> Sections {
    let mut sections = Sections::new();
    let mut current = String::from("global");
    for line in text.lines() {
        let line = match line.find(['#', ';']) {
            Some(at) => &line[..at],
            None => line,
        }
        .trim();
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = name.trim().to_owned();
            continue;
        }
        if let Some((key, value)) = line.split_once('=') {
            let key = normalize(key);
            let value = value.trim().trim_matches('"').to_owned();
            sections.entry(current.clone()).or_default().insert(key, value);
        }
    }
    sections
}

fn normalize(key: &str) -> String {
    key.trim().split([' ', '\t', '-', '_']).filter(|w| !w.is_empty()).collect::<Vec<_>>().join("_")
}

/// Whether the config file's option `key` is passed on to the worker. Options that name
/// files, sockets and logs are not: the worker has no filesystem, and ublkd sets the
/// few it needs itself ([`fixed_options`]); nor is the key's own source.
fn passed_on(key: &str) -> bool {
    const HELD_BACK: &[&str] =
        ["file", "path", "dir", "socket", "log", "key", "pid", "crash", "asok"].as_slice();
    !HELD_BACK.iter().any(|word| key.split('_').any(|part| part.starts_with(word)))
        && !matches!(key, "run_dir" | "chdir" | "daemonize" | "fsid_file")
}

/// The options ublkd fixes for every rbd worker, after the operator's: no admin socket
/// and no log file (the worker can create no file; errors go to its stderr, which
/// ublkd relays to the journal); librbd's cache off, so that a write librbd completes
/// is on the OSDs (the device then needs no FLUSH, and none is lost with a worker);
/// and a broken lock's owner blocklisted, which is what fencing is (an operator's
/// `rbd_blocklist_on_break_lock = false` would let a dead worker's late write land).
fn fixed_options() -> [(&'static str, &'static str); 7] {
    [
        ("admin_socket", ""),
        ("log_file", ""),
        ("log_to_stderr", "false"),
        ("err_to_stderr", "true"),
        ("log_to_syslog", "false"),
        ("rbd_cache", "false"),
        ("rbd_blocklist_on_break_lock", "true"),
    ]
}

/// Where a cluster is, as its config file says: what a host's firewall (the systemd
/// unit's `IPAddressAllow=`) must let ublkd's workers reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterNetwork {
    /// The monitors named by address in `mon_host`.
    pub monitors: Vec<IpAddr>,
    /// `mon_host` entries that are host names (not resolved here).
    pub monitor_names: Vec<String>,
    /// `public_network`'s CIDRs, where the OSDs are (checked: `ADDR/PREFIX`).
    pub public_networks: Vec<String>,
}

/// The cluster's addresses from the config file at `path` (its `[global]` and
/// `[client]` sections).
pub fn cluster_network(path: &Path) -> Result<ClusterNetwork, CephConfError> {
    let text = read_small(path)
        .map_err(|source| CephConfError::Conf { path: path.to_path_buf(), source })?;
    let sections = parse_ini(&text);
    let get = |key: &str| {
        ["client", "global"].iter().find_map(|s| sections.get(*s).and_then(|s| s.get(key)))
    };
    let mut network = ClusterNetwork::default();
    let hosts = get("mon_host").ok_or(CephConfError::NoMonitors { path: path.to_path_buf() })?;
    for token in hosts.split([',', ' ', ';', '\t']).filter(|t| !t.is_empty()) {
        match monitor_address(token) {
            Some(Ok(ip)) if !network.monitors.contains(&ip) => network.monitors.push(ip),
            Some(Ok(_)) => {}
            Some(Err(name)) if !network.monitor_names.contains(&name) => {
                network.monitor_names.push(name);
            }
            Some(Err(_)) | None => {}
        }
    }
    for cidr in get("public_network").map_or("", String::as_str).split([',', ' ', ';']) {
        let valid = cidr.split_once('/').is_some_and(|(addr, prefix)| {
            addr.parse::<IpAddr>().is_ok() && prefix.parse::<u8>().is_ok_and(|p| p <= 128)
        });
        if valid {
            network.public_networks.push(cidr.to_owned());
        }
    }
    Ok(network)
}

/// One `mon_host` entry (`10.0.0.1`, `10.0.0.1:6789`, `v2:10.0.0.1:3300/0`,
/// `[v2:10.0.0.1:3300,v1:10.0.0.1:6789]`'s parts, `[fd00::1]:6789`, `mon.example`):
/// its address, or the host name it is; `None` for an empty one.
fn monitor_address(token: &str) -> Option<Result<IpAddr, String>> {
    let token = token.trim_matches(['[', ']']);
    let token = token.strip_prefix("v2:").or_else(|| token.strip_prefix("v1:")).unwrap_or(token);
    let token = token.split('/').next().unwrap_or(token);
    if token.is_empty() {
        return None;
    }
    if let Ok(ip) = token.trim_matches(['[', ']']).parse::<IpAddr>() {
        return Some(Ok(ip));
    }
    // `[ADDR]:PORT`, or `HOST:PORT` with no other colon.
    let host = match token.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host.trim_matches(['[', ']']),
        _ => token,
    };
    Some(host.parse::<IpAddr>().map_err(|_| host.to_owned()))
}

/// The TCP ports an rbd worker may connect to, as its `--rbd-connect-ports` says them
/// (`3300,6789,6800-7568`): each monitor's port from `mon_host` (both of Ceph's, 3300
/// and 6789, where an entry names none), and the range the OSDs bind in
/// (`ms_bind_port_min`..`ms_bind_port_max`, Ceph's defaults 6800..7568).
pub fn connect_ports(options: &[(String, String)]) -> String {
    let get = |key: &str| options.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    let mut ports: Vec<u16> = Vec::new();
    for token in get("mon_host").unwrap_or("").split([',', ' ', ';', '\t']) {
        let token = token.trim_matches(['[', ']']);
        let token =
            token.strip_prefix("v2:").or_else(|| token.strip_prefix("v1:")).unwrap_or(token);
        let token = token.split('/').next().unwrap_or(token);
        if token.is_empty() {
            continue;
        }
        let port = match token.rsplit_once(':') {
            // `ADDR:PORT` or `[V6]:PORT`; a bare IPv6 address has no port.
            Some((host, port)) if token.parse::<IpAddr>().is_err() && !host.is_empty() => {
                port.parse::<u16>().ok()
            }
            _ => None,
        };
        let wanted: &[u16] = match &port {
            Some(port) => std::slice::from_ref(port),
            None => &[3300, 6789],
        };
        for &p in wanted {
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
    }
    let bound = |key: &str, default: u16| get(key).and_then(|v| v.parse().ok()).unwrap_or(default);
    let (low, high) = (bound("ms_bind_port_min", 6800), bound("ms_bind_port_max", 7568));
    let mut list: Vec<String> = ports.iter().map(u16::to_string).collect();
    if low <= high {
        list.push(format!("{low}-{high}"));
    }
    list.join(",")
}

/// Replaces Ceph's metavariables that a client's keyring path uses.
fn expand(path: &str, id: &str) -> String {
    path.replace("$cluster", CLUSTER)
        .replace("$name", &format!("client.{id}"))
        .replace("$type", "client")
        .replace("$id", id)
}

/// Reads a Ceph file (config or keyring) that ublkd trusts with a cluster's key: a
/// regular file, owned by root (or by the user ublkd runs as) and writable by no one
/// else, of at most [`MAX_FILE_BYTES`]. Opened without waiting (`O_NONBLOCK`): a FIFO
/// planted where a Ceph file is looked for would otherwise hold ublkd's loop until
/// someone writes to it; it is refused, as is a device node. A symlink is followed (a
/// config manager may link /etc/ceph/ceph.conf), and what it leads to is checked.
fn read_small(path: &Path) -> Result<String, std::io::Error> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    let refused = |why: String| std::io::Error::new(std::io::ErrorKind::PermissionDenied, why);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)?;
    let meta = file.metadata()?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_block_device() || kind.is_char_device() {
            "a device node"
        } else {
            "a directory"
        };
        return Err(refused(format!("it is {what}, not a regular file")));
    }
    let own = nix::unistd::geteuid().as_raw();
    if meta.uid() != 0 && meta.uid() != own {
        return Err(refused(format!(
            "it is owned by uid {}, not by root: ublkd reads a cluster's key only from files              that root owns",
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(refused(format!(
            "its mode {:04o} lets others than its owner write it: `chmod go-w {}`",
            meta.mode() & 0o7777,
            path.display()
        )));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "too large"));
    }
    let mut text = String::new();
    file.take(MAX_FILE_BYTES).read_to_string(&mut text)?;
    Ok(text)
}

/// The options for `spec`'s client: the key, the config file's `[global]`, `[client]`
/// and `[client.ID]` options in that order (a later section wins), then
/// [`fixed_options`].
pub fn client_options(spec: &RbdSpec) -> Result<ClientOptions, CephConfError> {
    let conf_path = spec.ceph_conf();
    let text = read_small(&conf_path).map_err(|source| match source.kind() {
        std::io::ErrorKind::InvalidData => CephConfError::TooLarge { path: conf_path.clone() },
        _ => CephConfError::Conf { path: conf_path.clone(), source },
    })?;
    let sections = parse_ini(&text);
    let id = spec.ceph_id();
    let mut merged = BTreeMap::new();
    for name in ["global".to_owned(), "client".to_owned(), format!("client.{id}")] {
        if let Some(section) = sections.get(&name) {
            merged.extend(section.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
    }
    if !merged.contains_key("mon_host") {
        return Err(CephConfError::NoMonitors { path: conf_path });
    }
    let key = match merged.get("key") {
        Some(inline) => inline.clone(),
        None => key_from_keyrings(spec, &merged)?,
    };
    // The key first: librados looks for it again at each auth option set, and says
    // "no keyring found ..., disabling cephx" for every one set before it.
    let mut options = vec![("key".to_owned(), key)];
    options.extend(merged.into_iter().filter(|(k, _)| passed_on(k)));
    options.extend(fixed_options().iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    Ok(ClientOptions(options))
}

/// The client's key from the first keyring that exists: the device's, else the config
/// file's `keyfile` (a key alone) or `keyring` list, else Ceph's default places.
fn key_from_keyrings(
    spec: &RbdSpec,
    conf: &BTreeMap<String, String>,
) -> Result<String, CephConfError> {
    let id = spec.ceph_id();
    if spec.keyring.is_none()
        && let Some(keyfile) = conf.get("keyfile")
    {
        let path = PathBuf::from(expand(keyfile, id));
        let text = read_small(&path).map_err(|source| CephConfError::Keyring { path, source })?;
        return Ok(text.trim().to_owned());
    }
    let candidates: Vec<PathBuf> = match &spec.keyring {
        Some(path) => vec![path.clone()],
        None => conf
            .get("keyring")
            .map_or(DEFAULT_KEYRINGS, String::as_str)
            .split([',', ' ', ';', '\t'])
            .filter(|p| !p.is_empty())
            .map(|p| PathBuf::from(expand(p, id)))
            .collect(),
    };
    for path in &candidates {
        let text = match read_small(path) {
            Ok(text) => text,
            // Only the places Ceph looks by default may be missing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && spec.keyring.is_none() => {
                continue;
            }
            Err(source) => return Err(CephConfError::Keyring { path: path.clone(), source }),
        };
        let sections = parse_ini(&text);
        return sections
            .get(&format!("client.{id}"))
            .and_then(|s| s.get("key"))
            .cloned()
            .ok_or_else(|| CephConfError::NoKeyInKeyring { path: path.clone(), id: id.into() });
    }
    let tried = candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
    Err(CephConfError::NoKeyring { id: id.into(), tried })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ublkd_config::RbdImage;

    fn spec(dir: &Path, keyring: Option<PathBuf>) -> RbdSpec {
        RbdSpec {
            image: RbdImage::parse("rbd/disk").unwrap(),
            ceph_conf: Some(dir.join("ceph.conf")),
            ceph_id: Some("ublk".into()),
            keyring,
            allow_unfenced: false,
        }
    }

    fn dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ublkd-cephconf-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_fifo_a_file_others_may_write_and_a_foreign_owners_file_are_refused_unread() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir().join("unsafe");
        std::fs::create_dir_all(&d).unwrap();
        // A FIFO: refused at once, never waited on (no writer ever comes).
        let fifo = d.join("fifo.conf");
        let _ = std::fs::remove_file(&fifo);
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = read_small(&fifo).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("a FIFO, not a regular file"), "{e}");
        // A directory.
        assert!(read_small(&d).unwrap_err().to_string().contains("a directory"));
        // Writable by the group: refused, naming the fix.
        let open = d.join("open.conf");
        std::fs::write(&open, "[global]\n").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o664)).unwrap();
        let e = read_small(&open).unwrap_err().to_string();
        assert!(e.contains("mode 0664") && e.contains("chmod go-w"), "{e}");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(read_small(&open).unwrap(), "[global]\n");
        // Owned by another user (only root can give a file away).
        if nix::unistd::geteuid().is_root() {
            let theirs = d.join("theirs.keyring");
            std::fs::write(&theirs, KEYRING).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            let e = read_small(&theirs).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534, not by root"), "{e}");
        }
        // Through client_options, the path is named.
        let conf = d.join("ceph.conf");
        let _ = std::fs::remove_file(&conf);
        nix::unistd::mkfifo(&conf, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = client_options(&spec(&d, None)).unwrap_err().to_string();
        assert!(e.contains(&conf.display().to_string()) && e.contains("a FIFO"), "{e}");
    }

    const KEYRING: &str = "[client.other]\n\tkey = AQBother==\n[client.ublk]\n\tkey = AQBmine==\n\tcaps mon = \"profile rbd\"\n";

    #[test]
    fn options_come_from_global_then_client_then_the_id_and_files_stay_behind() {
        let d = dir();
        std::fs::write(d.join("k"), KEYRING).unwrap();
        let conf = format!(
            "[global]\nfsid = 1234\nmon host = [v2:10.0.0.1:3300]\nlog file = /var/log/x\n\
             ms_bind_ipv6 = false ; trailing comment\n\
             [client]\nkeyring = {}\nadmin socket = /run/ceph/$name.asok\nrbd-cache = true\n\
             [client.ublk]\nms_bind_ipv6 = true\n[osd]\nosd_data = /x\n",
            d.join("k").display()
        );
        std::fs::write(d.join("ceph.conf"), conf).unwrap();
        let ClientOptions(options) = client_options(&spec(&d, None)).unwrap();
        let get = |k: &str| options.iter().rev().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        assert_eq!(get("mon_host"), Some("[v2:10.0.0.1:3300]"));
        assert_eq!(get("fsid"), Some("1234"));
        assert_eq!(get("ms_bind_ipv6"), Some("true"), "[client.ID] wins");
        assert_eq!(get("key"), Some("AQBmine=="));
        // ublkd's own come last, over the operator's.
        assert_eq!(get("rbd_cache"), Some("false"));
        assert_eq!(get("rbd_blocklist_on_break_lock"), Some("true"));
        assert_eq!(get("admin_socket"), Some(""));
        assert_eq!(get("log_file"), Some(""));
        assert!(options.iter().all(|(k, _)| k != "keyring" && k != "osd_data"), "{options:?}");
        assert!(!options.iter().any(|(_, v)| v.contains("/var/log")), "{options:?}");
    }

    #[test]
    fn the_devices_keyring_and_metavariables_are_honoured() {
        let d = dir();
        std::fs::write(d.join("ceph.client.ublk.keyring"), KEYRING).unwrap();
        let conf = format!(
            "[global]\nmon_host = 10.0.0.1\nkeyring = {}/$cluster.$name.keyring\n",
            d.display()
        );
        std::fs::write(d.join("ceph.conf"), conf).unwrap();
        let ClientOptions(options) = client_options(&spec(&d, None)).unwrap();
        assert!(options.contains(&("key".into(), "AQBmine==".into())));
        // A keyring the device names must exist.
        let err = client_options(&spec(&d, Some(d.join("missing")))).unwrap_err().to_string();
        assert!(err.starts_with("cannot read the keyring") && err.contains("missing"), "{err}");
    }

    #[test]
    fn the_cluster_network_is_every_monitor_and_the_public_network() {
        let d = dir();
        let conf = d.join("net.conf");
        std::fs::write(
            &conf,
            "[global]\nmon_host = [v2:10.0.0.1:3300,v1:10.0.0.1:6789], 10.0.0.2:6789 \
             [fd00::3]:6789 mon4.example\npublic network = 10.0.0.0/24, bogus\n",
        )
        .unwrap();
        let net = cluster_network(&conf).unwrap();
        let ips: Vec<String> = net.monitors.iter().map(ToString::to_string).collect();
        assert_eq!(ips, ["10.0.0.1", "10.0.0.2", "fd00::3"]);
        assert_eq!(net.monitor_names, ["mon4.example"]);
        assert_eq!(net.public_networks, ["10.0.0.0/24"]);
    }

    #[test]
    fn a_worker_may_connect_to_the_monitors_ports_and_the_osds_range() {
        let opts = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
        };
        let mons = "[v2:127.0.0.1:3300,v1:127.0.0.1:6789]";
        assert_eq!(connect_ports(&opts(&[("mon_host", mons)])), "3300,6789,6800-7568");
        let o = opts(&[
            ("mon_host", "10.0.0.1:4000 [fd00::3]:4001 fd00::4 mon.example"),
            ("ms_bind_port_min", "7000"),
            ("ms_bind_port_max", "7100"),
        ]);
        assert_eq!(connect_ports(&o), "4000,4001,3300,6789,7000-7100");
    }

    #[test]
    fn a_sandboxed_worker_needs_the_monitors_by_address() {
        let opts = |hosts: &str| vec![("mon_host".to_owned(), hosts.to_owned())];
        assert!(check_monitors_by_address(&opts("[v2:10.0.0.1:3300,v1:10.0.0.1:6789]")).is_ok());
        assert!(check_monitors_by_address(&opts("[fd00::1]:6789, 10.0.0.2")).is_ok());
        let err = check_monitors_by_address(&opts("10.0.0.1 mon2.example:6789")).unwrap_err();
        assert!(err.to_string().contains("mon_host names mon2.example"), "{err}");
    }

    #[test]
    fn what_is_missing_is_named() {
        let d = dir();
        std::fs::write(d.join("ceph.conf"), "[global]\nfsid = 1\n").unwrap();
        let err = client_options(&spec(&d, None)).unwrap_err().to_string();
        assert!(err.contains("names no monitor"), "{err}");
        std::fs::write(
            d.join("ceph.conf"),
            format!("[global]\nmon_host=1.2.3.4\nkeyring = {}/none\n", d.display()),
        )
        .unwrap();
        let err = client_options(&spec(&d, None)).unwrap_err().to_string();
        assert!(err.contains("no key for client.ublk") && err.contains("/none"), "{err}");
        std::fs::write(d.join("k"), "[client.other]\nkey = x\n").unwrap();
        let err = client_options(&spec(&d, Some(d.join("k")))).unwrap_err().to_string();
        assert!(err.contains("holds no key for client.ublk"), "{err}");
        let err = client_options(&RbdSpec { ceph_conf: Some(d.join("nope")), ..spec(&d, None) })
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("cannot read the Ceph config file"), "{err}");
    }
}
