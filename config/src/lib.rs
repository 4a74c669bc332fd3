//! ublkd's config file: its schema, its defaults, and every check on it.
//!
//! This crate owns the TOML file the daemon reads at start (`[daemon]`, `[recovery]`,
//! `[defaults]`, `[[device]]`; `ublkd.example.toml` next to this crate documents every
//! key) and turns it into a [`Config`] whose values are all resolved and within their
//! limits, so the rest of ublkd never re-checks them. It also owns the rules ublkctl
//! reuses for a device given on the command line ([`DeviceSpec::validate`],
//! [`parse_size`]).
//!
//! It does not create devices, open sockets or drop privileges; the only system access
//! is reading the config file and inspecting loop backing files (metadata, and opening
//! a block device read-only to learn its size).
//!
//! Rules beyond the schema's types, each with its reason at its constant: device ids
//! `0..=`[`MAX_DEVICE_ID`], unique; queues `1..=`[`MAX_QUEUES`]; queue depth
//! `1..=`[`MAX_QUEUE_DEPTH`]; block size a power of two in
//! [`MIN_BLOCK_SIZE`]`..=`[`MAX_BLOCK_SIZE`]; threads `1..=`[`MAX_THREADS`] and at most
//! queues × queue depth; size non-zero, a multiple of the block size, at most
//! [`MAX_SIZE_BYTES`]; a loop file absolute, existing, a regular file or block device,
//! at least `size` long and backing one device only; daemon paths absolute, the socket
//! at most [`MAX_SOCKET_PATH_BYTES`].
//!
//! Errors: every [`ConfigError`] message starts with the file name, names the key
//! (`device[2].queue_depth`), says what is wrong and what would be right, and gives the
//! line when the key is in the file. Messages never repeat a `#[source]` error; print
//! the chain (`{:#}` with anyhow) to see it.

mod check;
mod daemon;
mod device;
mod error;
mod locate;
mod nbd_uri;
mod overrides;
mod raw;
mod rbd;
mod recovery;
mod size;

use std::path::Path;

pub use daemon::{
    DEFAULT_METRICS_INTERVAL_SECS, DEFAULT_SOCKET, DEFAULT_STATE_DIR, DEFAULT_WORKER_NAME,
    DaemonConfig, MAX_METRICS_INTERVAL_SECS, MAX_SOCKET_PATH_BYTES, MAX_USER_NAME_BYTES,
    PACKAGED_WORKER_BINARY,
};
pub use device::{
    DeviceAttrs, DeviceSettings, DeviceSpec, FieldError, MAX_BLOCK_SIZE, MAX_DEVICE_ID,
    MAX_NAME_LEN, MAX_QUEUE_DEPTH, MAX_QUEUES, MAX_SIZE_BYTES, MAX_THREADS, MAX_ZERO_COPY_SLOTS,
    MIN_BLOCK_SIZE, TargetSpec, backing_file_size, check_name,
};
pub use error::{ConfigError, Location};
pub use nbd_uri::{
    MAX_EXPORT_NAME_BYTES, MAX_UNIX_SOCKET_PATH_BYTES, NBD_DEFAULT_PORT, NbdTls, NbdTransport,
    NbdUri, NbdUriError,
};
pub use rbd::{
    ADMIN_CEPH_ID, DEFAULT_CEPH_CONF, DEFAULT_CEPH_ID, MAX_RBD_NAME_BYTES, RbdImage, RbdImageError,
    RbdSpec, check_ceph_id,
};
pub use recovery::{
    MAX_HUNG_TIMEOUT_SECS, MAX_NBD_HANDSHAKE_TIMEOUT_SECS, MAX_RBD_CLUSTER_RETRY_SECS,
    MAX_WORKER_READY_TIMEOUT_SECS, OnRestartLimit, RecoveryConfig,
};
pub use size::{SizeError, format_size, parse_size};

/// The whole config file, resolved: defaults applied, every value within its limits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Config {
    /// `[daemon]`.
    pub daemon: DaemonConfig,
    /// `[recovery]`.
    pub recovery: RecoveryConfig,
    /// `[defaults]`: kept so that devices added later (ublkctl `add`) get them too.
    pub defaults: DeviceSettings,
    /// `[[device]]`, in file order, each with the defaults applied.
    pub devices: Vec<DeviceSpec>,
}

/// The largest config file ublkd reads (a config of 1,000 devices is about 100 KiB).
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// `path`'s text, if it is a regular file of at most `limit` bytes. Opened with
/// O_NONBLOCK, since a FIFO's open would wait for a writer; the type is checked on the
/// opened file, so a link swapped in between cannot change what is read.
fn read_regular_file(path: &Path, limit: u64) -> std::io::Result<String> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.len() > limit {
        return Err(std::io::Error::other(format!(
            "{} bytes, more than a config file may have ({limit})",
            meta.len()
        )));
    }
    let mut text = String::new();
    file.take(limit).read_to_string(&mut text)?;
    Ok(text)
}

impl Config {
    /// Reads and checks the config file at `path`; messages name it as given.
    ///
    /// The file is opened without blocking and must be a regular file of at most
    /// [`MAX_CONFIG_BYTES`]: ublkd loads it on its event loop (a reload, `ublkd
    /// --check-config` asking the running ublkd), where a FIFO or a device planted at
    /// the path would otherwise hold up every device's recovery.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let read = |source| ConfigError::Read { path: path.to_owned(), source };
        let text = read_regular_file(path, MAX_CONFIG_BYTES).map_err(read)?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Checks config `text`; `origin` names it in messages (usually the file name).
    ///
    /// Loop devices' backing files are inspected (they must exist), nothing else
    /// touches the system.
    ///
    /// ```
    /// use ublkd_config::{Config, TargetSpec};
    ///
    /// let text = "[defaults]\nqueues = 2\n\n[[device]]\ntarget = \"memory\"\nsize = \"1G\"\n";
    /// let config = Config::parse(text, "ublkd.toml")?;
    /// assert_eq!(config.devices[0].target, TargetSpec::Memory);
    /// assert_eq!(config.devices[0].settings.queues, 2);
    ///
    /// let error = Config::parse("[[device]]\ntarget = \"null\"\nsize = 1000\n", "ublkd.toml");
    /// assert_eq!(
    ///     error.map_err(|e| e.to_string()).err().as_deref(),
    ///     Some("ublkd.toml: device[0].size: 1000 is not a multiple of block_size 4096; \
    ///           use 4096 or more (line 3, column 1)")
    /// );
    /// # Ok::<(), ublkd_config::ConfigError>(())
    /// ```
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        check::parse(text, origin)
    }
}

/// The Ceph config files of `text`'s `[[device]]` tables whose `target` is `"rbd"`
/// (each device's `ceph_conf`, else [`DEFAULT_CEPH_CONF`]), each once, and nothing
/// else of the file checked: as [`nbd_uris`], for the systemd generator. Fails only if
/// `text` is not TOML.
pub fn rbd_ceph_confs(text: &str) -> Result<Vec<std::path::PathBuf>, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.message().to_owned())?;
    let devices = match table.get("device") {
        Some(toml::Value::Array(devices)) => devices.as_slice(),
        _ => &[],
    };
    let mut confs = Vec::new();
    for device in devices {
        if device.get("target").and_then(toml::Value::as_str) != Some("rbd") {
            continue;
        }
        let conf =
            device.get("ceph_conf").and_then(toml::Value::as_str).unwrap_or(DEFAULT_CEPH_CONF);
        let conf = std::path::PathBuf::from(conf);
        if !confs.contains(&conf) {
            confs.push(conf);
        }
    }
    Ok(confs)
}

/// The NBD URIs of `text`'s `[[device]]` tables whose `target` is `"nbd"`, in file
/// order, each parsed or with why not, and nothing else of the file checked: what the
/// systemd generator needs at boot, when loop devices' files and block devices may not
/// be there yet (a full [`Config::parse`] would refuse the whole file for them). Fails
/// only if `text` is not TOML.
pub fn nbd_uris(text: &str) -> Result<Vec<Result<NbdUri, NbdUriError>>, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.message().to_owned())?;
    let devices = match table.get("device") {
        Some(toml::Value::Array(devices)) => devices.as_slice(),
        _ => &[],
    };
    Ok(devices
        .iter()
        .filter(|d| d.get("target").and_then(toml::Value::as_str) == Some("nbd"))
        .filter_map(|d| d.get("uri").and_then(toml::Value::as_str))
        .map(NbdUri::parse)
        .collect())
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_config_path_that_is_no_regular_file_is_refused_without_waiting() {
        let dir = std::env::temp_dir().join(format!("ublkd-config-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("ublkd.toml");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        for path in [fifo.as_path(), Path::new("/dev/null"), dir.as_path()] {
            let error = Config::load(path).unwrap_err();
            let cause = std::error::Error::source(&error).map(|e| e.to_string());
            assert_eq!(cause.as_deref(), Some("not a regular file"), "{}: {error}", path.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    use std::fs::File;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use proptest::prelude::*;
    use ublkd_proto::msg::LayerSet;

    use super::*;
    use crate::daemon::pick_worker;

    const ORIGIN: &str = "bad.toml";

    /// A file under the temp dir with a unique name, removed on drop.
    struct TempFile {
        path: PathBuf,
    }

    impl TempFile {
        fn with_len(name: &str, len: u64) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "ublkd-config-test-{}-{}-{name}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            let file = File::create(&path).expect("create temp file");
            file.set_len(len).expect("size temp file");
            Self { path }
        }

        /// The path as a TOML basic string's content.
        fn toml(&self) -> String {
            self.path.display().to_string()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// A loop device on `backing`, with every other setting left to its default.
    fn loop_device(backing: &TempFile) -> String {
        format!("[[device]]\ntarget = \"loop\"\nfile = \"{}\"\n", backing.toml())
    }

    fn assert_mentions(message: &str, parts: &[&str]) {
        assert!(parts.iter().all(|p| message.contains(p)), "{message}");
    }

    fn error_message(text: &str) -> String {
        match Config::parse(text, ORIGIN) {
            Ok(config) => panic!("expected an error, got {config:#?}"),
            Err(error) => error.to_string(),
        }
    }

    const NULL_1G: &str = "target = \"null\"\nsize = \"1G\"\n";

    /// Each malformed config and the part of its message that names the key and the
    /// problem; every message must also start with the origin.
    #[test]
    fn malformed_configs_are_refused_with_origin_key_and_problem() {
        let dir = std::env::temp_dir();
        let dir = dir.display();
        let long_socket = format!("/run/{}/s.sock", "x".repeat(120));
        let cases: Vec<(String, &str)> = vec![
            // Unknown keys.
            (
                "[daemon]\nsockt = \"/x\"\n".into(),
                "daemon.sockt: unknown field `sockt`, expected one of `socket`",
            ),
            (format!("[[device]]\n{NULL_1G}qeues = 2\n"), "device[0].qeues: unknown field `qeues`"),
            ("[daemons]\n".into(), "daemons: unknown field `daemons`"),
            (
                "[recovery]\nrestart_max = 1\nhung = 3\n".into(),
                "recovery.hung: unknown field `hung`",
            ),
            (
                format!("[[device]]\n{NULL_1G}[[device]]\n{NULL_1G}extra.key = 1\n"),
                "device[1].extra: unknown field `extra`",
            ),
            // Wrong types.
            (
                format!("[[device]]\n{NULL_1G}queue_depth = \"64\"\n"),
                "device[0].queue_depth: invalid type: string \"64\", expected an integer",
            ),
            (
                "[defaults]\nsandbox = \"yes\"\n".into(),
                "defaults.sandbox: invalid type: string \"yes\", expected a boolean",
            ),
            (
                format!("[[device]]\n{NULL_1G}sandbox_optional = [\"userns\"]\n"),
                "device[0].sandbox_optional: \"userns\" is not a sandbox layer; expected \
                 user-namespace, namespaces, empty-root, landlock or landlock-tcp",
            ),
            (
                "[defaults]\nsandbox_optional = \"landlock\"\n".into(),
                "defaults.sandbox_optional: invalid type: string \"landlock\", expected a sequence",
            ),
            ("[daemon]\nsocket = 5\n".into(), "daemon.socket: invalid type: integer `5`"),
            (
                format!("[[device]]\n{NULL_1G}queues = 1.5\n"),
                "device[0].queues: invalid type: floating point `1.5`, expected an integer",
            ),
            (
                "[[device]]\ntarget = \"null\"\nsize = true\n".into(),
                "device[0].size: invalid type: boolean `true`, expected a size",
            ),
            (
                format!("[[device]]\n{NULL_1G}id = 1.0\n"),
                "device[0].id: invalid type: floating point `1.0`, expected a device id: an integer or \"auto\"",
            ),
            (
                "device = 5\n".into(),
                "device: invalid type: integer `5`, expected an array of tables",
            ),
            ("daemon = \"x\"\n".into(), "daemon: invalid type: string \"x\", expected a table"),
            // Missing or unknown enum values.
            (
                "[[device]]\nsize = \"1G\"\n".into(),
                "device[0].target: missing; every device needs a target",
            ),
            (
                "[[device]]\ntarget = \"nul\"\n".into(),
                "device[0].target: \"nul\" is not a target; expected \"null\", \"memory\", \"loop\", \"nbd\" or \"rbd\"",
            ),
            (
                "[recovery]\non_restart_limit = 3\n".into(),
                "recovery.on_restart_limit: invalid type: integer `3`, expected a policy: \"quiesce\" or \"fail-io\"",
            ),
            (
                "[[device]]\ntarget = [\"null\"]\n".into(),
                "device[0].target: invalid type: sequence, expected a target: \"null\", \"memory\", \"loop\", \"nbd\" or \"rbd\"",
            ),
            (
                "[recovery]\nfast_release = \"yes\"\n".into(),
                "recovery.fast_release: invalid type: string \"yes\", expected a boolean",
            ),
            (
                "[recovery]\non_restart_limit = \"reboot\"\n".into(),
                "recovery.on_restart_limit: \"reboot\" is not a policy; expected \"quiesce\" or \"fail-io\"",
            ),
            // [daemon] rules.
            (
                "[daemon]\nsocket = \"ublkd.sock\"\n".into(),
                "daemon.socket: \"ublkd.sock\" is not an absolute path; use one such as /run/ublkd/ublkd.sock",
            ),
            (format!("[daemon]\nsocket = \"{long_socket}\"\n"), "daemon.socket: /run/xxx"),
            (
                "[daemon]\nstate_dir = \"run/ublkd\"\n".into(),
                "daemon.state_dir: \"run/ublkd\" is not an absolute path",
            ),
            (
                "[daemon]\nworker_binary = \"ublkd-worker\"\n".into(),
                "daemon.worker_binary: \"ublkd-worker\" is not an absolute path",
            ),
            (
                "[daemon]\nmetrics_file = \"ublkd.prom\"\n".into(),
                "daemon.metrics_file: \"ublkd.prom\" is not an absolute path; use one such as \
                 /var/lib/prometheus/node-exporter/ublkd.prom",
            ),
            (
                "[daemon]\nmetrics_file = \"/var/lib/prometheus/\"\n".into(),
                "daemon.metrics_file: /var/lib/prometheus/ names a directory",
            ),
            (
                "[daemon]\nmetrics_interval_secs = 0\n".into(),
                "daemon.metrics_interval_secs: 0 is out of range; expected 1..=3600",
            ),
            (
                "[daemon]\nmetrics_interval_secs = 3601\n".into(),
                "daemon.metrics_interval_secs: 3601 is out of range; expected 1..=3600",
            ),
            (
                "[daemon]\nsocket = \"/run/a\\u0000b\"\n".into(),
                "daemon.socket: \"/run/a\\0b\" contains a NUL byte",
            ),
            (
                "[daemon]\nworker_user = \"ublkd worker\"\n".into(),
                "daemon.worker_user: \"ublkd worker\" is not a user name",
            ),
            (
                "[daemon]\nworker_user = \"1000\"\n".into(),
                "daemon.worker_user: \"1000\" is a number; expected a user name, not a uid",
            ),
            ("[daemon]\nworker_user = \"\"\n".into(), "daemon.worker_user: is empty"),
            // [recovery] rules.
            (
                "[recovery]\nhung_timeout_secs = 0\n".into(),
                "recovery.hung_timeout_secs: 0 is out of range; expected 1..=300",
            ),
            (
                "[recovery]\nhung_timeout_secs = 301\n".into(),
                "recovery.hung_timeout_secs: 301 is out of range; expected 1..=300",
            ),
            (
                "[recovery]\nrestart_window_secs = 0\n".into(),
                "recovery.restart_window_secs: 0 is out of range; expected 1..=4294967295; to turn automatic recovery off, set restart_max = 0",
            ),
            (
                "[recovery]\nrestart_max = -1\n".into(),
                "recovery.restart_max: -1 is out of range; expected 0..=4294967295",
            ),
            (
                "[recovery]\nnbd_handshake_timeout_secs = 0\n".into(),
                "recovery.nbd_handshake_timeout_secs: 0 is out of range; expected 1..=300",
            ),
            (
                "[recovery]\nnbd_handshake_timeout_secs = 301\n".into(),
                "recovery.nbd_handshake_timeout_secs: 301 is out of range; expected 1..=300",
            ),
            (
                "[recovery]\nworker_ready_timeout_secs = 0\n".into(),
                "recovery.worker_ready_timeout_secs: 0 is out of range; expected 1..=600",
            ),
            (
                "[recovery]\nworker_ready_timeout_secs = 601\n".into(),
                "recovery.worker_ready_timeout_secs: 601 is out of range; expected 1..=600",
            ),
            // [defaults] rules.
            (
                "[defaults]\nqueue_depth = 5000\n".into(),
                "defaults.queue_depth: 5000 is out of range; expected 1..=4096",
            ),
            (
                "[defaults]\nblock_size = 1000\n".into(),
                "defaults.block_size: 1000 is not a valid block size; expected 512, 1024, 2048 or 4096",
            ),
            (
                "[defaults]\nqueues = 0\n".into(),
                "defaults.queues: 0 is out of range; expected 1..=64",
            ),
            // rbd devices.
            (
                "[[device]]\ntarget = \"rbd\"\n".into(),
                "device[0].image: missing; an rbd device needs image = \"POOL/IMAGE\"",
            ),
            (
                "[[device]]\ntarget = \"rbd\"\nimage = \"disk\"\n".into(),
                "device[0].image: \"disk\" names no pool; write POOL/IMAGE (such as rbd/disk)",
            ),
            (
                "[[device]]\ntarget = \"rbd\"\nimage = \"rbd/disk\"\nsize = \"1G\"\n".into(),
                "device[0].size: an rbd device's size is its image's",
            ),
            (
                "[[device]]\ntarget = \"rbd\"\nimage = \"rbd/d\"\nceph_id = \"client.x\"\n".into(),
                "device[0].ceph_id: \"client.x\": give the id without \"client.\"",
            ),
            (
                "[[device]]\ntarget = \"rbd\"\nimage = \"rbd/d\"\nkeyring = \"k\"\n".into(),
                "device[0].keyring: k is relative; give an absolute path",
            ),
            (
                format!("[[device]]\n{NULL_1G}image = \"rbd/d\"\n"),
                "device[0].image: only an rbd target has image; remove image or set target = \"rbd\"",
            ),
            (
                "[[device]]\ntarget = \"rbd\"\nimage = \"rbd/d\"\n\
                 [[device]]\ntarget = \"rbd\"\nimage = \"rbd/d\"\n"
                    .into(),
                "device[1].image: rbd/d is already the image of device[0]",
            ),
            // nbd devices.
            (
                "[[device]]\ntarget = \"nbd\"\n".into(),
                "device[0].uri: missing; an nbd device needs uri = the export's NBD URI",
            ),
            (
                "[[device]]\ntarget = \"nbd\"\nuri = \"nbd://h/x\"\nsize = \"1G\"\n".into(),
                "device[0].size: an nbd device's size is its export's, which the server gives at \
                 connection; remove size from this nbd device (line 4, column 1)",
            ),
            (
                "[[device]]\ntarget = \"nbd\"\nuri = \"nbd://h/x\"\nfile = \"/x\"\n".into(),
                "device[0].file: only a loop target has a backing file; remove file from this nbd",
            ),
            (
                format!("[[device]]\n{NULL_1G}uri = \"nbd://h/x\"\n"),
                "device[0].uri: only an nbd target has a uri; remove uri or set target = \"nbd\"",
            ),
            (
                "[[device]]\ntarget = \"nbd\"\nuri = \"nbd://h/x\"\nzero_copy = true\n\
                 threads = 9\nqueues = 2\n"
                    .into(),
                "device[0].threads: 9 is more than 8: a zero-copy nbd device has one connection \
                 per thread, and at most 8; lower threads or turn zero_copy off",
            ),
            (
                "[[device]]\ntarget = \"nbd\"\nuri = \"nbds://h/x\"\n".into(),
                "device[0].uri: \"nbds://h/x\": an nbds:// URI needs tls-certificates=DIR",
            ),
            (
                "[[device]]\ntarget = \"nbd\"\nuri = \"nbd+unix:///x\"\n".into(),
                "device[0].uri: \"nbd+unix:///x\": an nbd+unix URI needs ?socket=PATH, the \
                 server's socket (line 3, column 1)",
            ),
            (
                "[[device]]\ntarget = \"nbd\"\nuri = \"nbd://h/x\"\n\
                 [[device]]\ntarget = \"nbd\"\nuri = \"nbd://h:10809/x\"\n"
                    .into(),
                "device[1].uri: nbd://h:10809/x is already the export of device[0]",
            ),
            // Device limits.
            (
                format!("[[device]]\n{NULL_1G}queues = 65\n"),
                "device[0].queues: 65 is out of range; expected 1..=64",
            ),
            (
                format!("[[device]]\n{NULL_1G}queue_depth = 0\n"),
                "device[0].queue_depth: 0 is out of range; expected 1..=4096",
            ),
            (
                format!("[[device]]\n{NULL_1G}queue_depth = 99999999999999999999\n"),
                "device[0].queue_depth: 99999999999999999999 is out of range; expected 1..=4096",
            ),
            (
                format!("[[device]]\n{NULL_1G}block_size = 8192\n"),
                "device[0].block_size: 8192 is not a valid block size",
            ),
            (
                format!("[[device]]\n{NULL_1G}block_size = 768\n"),
                "device[0].block_size: 768 is not a valid block size",
            ),
            (
                format!("[[device]]\n{NULL_1G}threads = 65\n"),
                "device[0].threads: 65 is out of range; expected 1..=64",
            ),
            (
                format!("[[device]]\n{NULL_1G}threads = 5\nqueue_depth = 4\n"),
                "device[0].threads: 5 is more than queues × queue_depth = 4",
            ),
            (
                format!(
                    "[defaults]\nthreads = 8\n[[device]]\n{NULL_1G}queue_depth = 2\nqueues = 2\n"
                ),
                "device[0].threads: 8 is more than queues × queue_depth = 4; a thread with no request slot idles, use at most 4 (the value comes from defaults.threads)",
            ),
            // Sizes.
            (
                format!("[[device]]\n{NULL_1G}[[device]]\ntarget = \"null\"\nsize = 1000\n"),
                "device[1].size: 1000 is not a multiple of block_size 4096; use 4096 or more",
            ),
            (
                "[[device]]\ntarget = \"memory\"\nsize = 5000\nblock_size = 512\n".into(),
                "device[0].size: 5000 is not a multiple of block_size 512; round it to 4608 or 5120",
            ),
            (
                "[[device]]\ntarget = \"null\"\nsize = 0\n".into(),
                "device[0].size: 0 is too small; a device needs at least one block (4096 bytes)",
            ),
            (
                "[[device]]\ntarget = \"null\"\nsize = \"4X\"\n".into(),
                "device[0].size: \"4X\" has an unknown suffix \"X\"",
            ),
            (
                "[[device]]\ntarget = \"null\"\nsize = \"\"\n".into(),
                "device[0].size: the size is empty",
            ),
            (
                "[[device]]\ntarget = \"null\"\nsize = -4096\n".into(),
                "device[0].size: -4096 is negative",
            ),
            (
                "[[device]]\ntarget = \"null\"\nsize = \"16777216T\"\n".into(),
                "device[0].size: \"16777216T\" is too large; a size must be below 16777216T",
            ),
            (
                "[[device]]\ntarget = \"null\"\nsize = \"8388609T\"\n".into(),
                "device[0].size: 9223373136366403584 is too large; the largest device is 9223372036854775808 bytes (8388608T)",
            ),
            (
                "[[device]]\ntarget = \"null\"\nsize = 18446744073709551615\n".into(),
                "device[0].size: 18446744073709551615 is too large",
            ),
            (
                "[[device]]\ntarget = \"null\"\n".into(),
                "device[0].size: missing; a null device needs a size, such as size = \"1G\"",
            ),
            (
                "[[device]]\ntarget = \"memory\"\n".into(),
                "device[0].size: missing; a memory device needs a size",
            ),
            // Loop-only keys and loop files.
            (
                format!("[[device]]\n{NULL_1G}file = \"/tmp/x\"\n"),
                "device[0].file: only a loop target has a backing file, this one is null; remove file or set target = \"loop\"",
            ),
            (
                "[[device]]\ntarget = \"memory\"\nsize = \"1G\"\ndirect = false\n".into(),
                "device[0].direct: only a loop target has a backing file, this one is memory; remove direct",
            ),
            (
                format!("[[device]]\n{NULL_1G}zero_copy = true\n"),
                "device[0].zero_copy: only a loop or nbd target has zero copy, this one is null; \
                 remove zero_copy",
            ),
            (
                "[[device]]\ntarget = \"rbd\"\nimage = \"rbd/d\"\nzero_copy = false\n".into(),
                "device[0].zero_copy: only a loop or nbd target has zero copy; remove zero_copy \
                 from this rbd device",
            ),
            (
                "[[device]]\ntarget = \"loop\"\n".into(),
                "device[0].file: missing; a loop device needs file =",
            ),
            (
                "[[device]]\ntarget = \"loop\"\nfile = \"/nonexistent/ublkd/disk.img\"\n".into(),
                "device[0].file: /nonexistent/ublkd/disk.img does not exist; expected an existing regular file or block device",
            ),
            (
                format!("[[device]]\ntarget = \"loop\"\nfile = '{dir}'\n"),
                "is a directory; expected a regular file or block device",
            ),
            (
                format!("[[device]]\ntarget = \"loop\"\nsize = \"1G\"\nfile = '{dir}'\n"),
                "is a directory",
            ),
            (
                "[[device]]\ntarget = \"loop\"\nfile = \"disk.img\"\n".into(),
                "device[0].file: \"disk.img\" is not an absolute path",
            ),
            (
                "[[device]]\ntarget = \"loop\"\nfile = \"/dev/null\"\n".into(),
                "device[0].file: /dev/null is a character device",
            ),
            // Ids.
            (
                format!("[[device]]\n{NULL_1G}id = 1048576\n"),
                "device[0].id: 1048576 is out of range; expected 0..=1048575 (the kernel's limit) or \"auto\"",
            ),
            (format!("[[device]]\n{NULL_1G}id = -1\n"), "device[0].id: -1 is out of range"),
            (
                format!("[[device]]\n{NULL_1G}id = \"first\"\n"),
                "device[0].id: \"first\" is not a device id; expected an integer in 0..=1048575 or \"auto\"",
            ),
            (
                format!(
                    "[[device]]\n{NULL_1G}id = 3\n[[device]]\n{NULL_1G}[[device]]\n{NULL_1G}id = 3\n"
                ),
                "device[2].id: 3 is already used by device[0]",
            ),
            // Not TOML at all.
            ("[daemon\n".into(), "not valid TOML: unclosed table, expected `]` (line 1, column 8)"),
            ("a = 1\na = 2\n".into(), "not valid TOML: duplicate key `a` (line 2, column 1)"),
            ("[[device]]\ntarget = null\n".into(), "not valid TOML"),
        ];
        assert!(cases.len() >= 25);
        let mut failures = Vec::new();
        for (text, expected) in &cases {
            let message = error_message(text);
            if !message.starts_with(&format!("{ORIGIN}: ")) || !message.contains(expected) {
                failures.push(format!(
                    "{message:?}\n  should contain {expected:?}\n  config: {text:?}"
                ));
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} cases failed:\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
    }

    #[test]
    fn spec_example_message_is_exact() {
        let text = "[[device]]\ntarget = \"null\"\nsize = \"1G\"\n\n[[device]]\ntarget = \"null\"\nsize = 1000\n";
        let message = error_message(text);
        assert!(
            message
                .starts_with("bad.toml: device[1].size: 1000 is not a multiple of block_size 4096"),
            "{message}"
        );
    }

    #[test]
    fn errors_point_at_the_line_of_the_key() {
        let text = "[defaults]\nthreads = 2\n\n[[device]]\ntarget = \"null\"\nsize = 1000\n";
        let error = Config::parse(text, ORIGIN).err();
        let Some(ConfigError::Invalid { key, location, .. }) = &error else {
            panic!("expected Invalid, got {error:?}");
        };
        assert_eq!(key, "device[0].size");
        assert_eq!(*location, Some(Location { line: 6, column: 1 }));

        // An inherited value is not in the device table: point at its header.
        let text = "[defaults]\nthreads = 8\n\n[[device]]\ntarget = \"null\"\nsize = \"1G\"\nqueue_depth = 2\n";
        let error = Config::parse(text, ORIGIN).err();
        let Some(ConfigError::Invalid { key, location, .. }) = &error else {
            panic!("expected Invalid, got {error:?}");
        };
        assert_eq!(key, "device[0].threads");
        assert_eq!(location.map(|l| l.line), Some(4));

        let message = error_message("[daemon]\n\n  sockett = 1\n");
        assert!(message.ends_with("(line 3, column 3)"), "{message}");
    }

    #[test]
    fn error_key_accessor_returns_the_key_path() {
        let error = Config::parse("[recovery]\nhung_timeout_secs = 0\n", ORIGIN).err();
        assert_eq!(error.as_ref().and_then(ConfigError::key), Some("recovery.hung_timeout_secs"));
    }

    #[test]
    fn empty_config_is_the_builtin_default() {
        let config = Config::parse("", ORIGIN).expect("empty config is valid");
        assert_eq!(config, Config::default());
        assert_eq!(config.daemon.socket, Path::new(DEFAULT_SOCKET));
        assert_eq!(config.daemon.state_dir, Path::new(DEFAULT_STATE_DIR));
        assert_eq!(config.recovery.hung_timeout, Duration::from_secs(10));
        assert_eq!(config.recovery.restart_max, 5);
        assert_eq!(config.recovery.restart_window, Duration::from_secs(60));
        assert_eq!(config.recovery.on_restart_limit, OnRestartLimit::Quiesce);
        assert_eq!(config.recovery.nbd_handshake_timeout, Duration::from_secs(10));
        assert_eq!(config.recovery.worker_ready_timeout, Duration::from_secs(30));
        assert!(config.devices.is_empty());
    }

    #[test]
    fn minimal_device_gets_builtin_defaults() {
        let config =
            Config::parse("[[device]]\ntarget = \"null\"\nsize = \"1G\"\n", ORIGIN).expect("valid");
        assert_eq!(config.devices, vec![device::tests::null_device()]);
    }

    #[test]
    fn full_config_sets_every_field() {
        let backing = TempFile::with_len("full.img", 8 << 20);
        let text = format!(
            r#"
            [daemon]
            socket = "/run/test/ctl.sock"
            state_dir = "/var/lib/test"
            worker_binary = "/opt/ublkd/worker"
            worker_user = "ublk_worker-1"
            metrics_file = "/var/lib/test/ublkd.prom"
            metrics_interval_secs = 3600

            [recovery]
            hung_timeout_secs = 300
            restart_max = 0
            restart_window_secs = 1
            on_restart_limit = "fail-io"
            fast_release = false
            nbd_server_wait_secs = 30
            nbd_request_timeout_secs = 0
            rbd_cluster_wait_secs = 45
            rbd_cluster_retry_secs = 5
            nbd_handshake_timeout_secs = 300
            worker_ready_timeout_secs = 600

            [defaults]
            queues = 4
            queue_depth = 256
            block_size = 1024
            threads = 2
            sandbox = false

            [[device]]
            id = 0
            target = "memory"
            size = "64M"

            [[device]]
            id = "auto"
            target = "loop"
            file = "{}"
            direct = false
            zero_copy = false
            size = "4MiB"
            queues = 64
            queue_depth = 4096
            block_size = 512
            threads = 64
            sandbox = true
            "#,
            backing.toml()
        );
        let config = Config::parse(&text, ORIGIN).expect("full config is valid");
        assert_eq!(
            config.daemon,
            DaemonConfig {
                socket: "/run/test/ctl.sock".into(),
                state_dir: "/var/lib/test".into(),
                worker_binary: Some("/opt/ublkd/worker".into()),
                worker_user: Some("ublk_worker-1".into()),
                metrics_file: Some("/var/lib/test/ublkd.prom".into()),
                metrics_interval: Duration::from_secs(3600),
            }
        );
        assert_eq!(
            config.recovery,
            RecoveryConfig {
                hung_timeout: Duration::from_secs(300),
                restart_max: 0,
                restart_window: Duration::from_secs(1),
                on_restart_limit: OnRestartLimit::FailIo,
                fast_release: false,
                nbd_server_wait: Some(Duration::from_secs(30)),
                nbd_request_timeout: None,
                rbd_cluster_wait: Some(Duration::from_secs(45)),
                rbd_cluster_retry: Duration::from_secs(5),
                nbd_handshake_timeout: Duration::from_secs(300),
                worker_ready_timeout: Duration::from_secs(600),
            }
        );
        assert!(!config.recovery.automatic_recovery());
        assert_eq!(
            config.defaults,
            DeviceSettings {
                queues: 4,
                queue_depth: 256,
                block_size: 1024,
                threads: 2,
                sandbox: false,
                sandbox_optional: LayerSet::EMPTY,
            }
        );
        assert_eq!(
            config.devices,
            vec![
                DeviceSpec {
                    id: Some(0),
                    target: TargetSpec::Memory,
                    size_bytes: 64 << 20,
                    settings: config.defaults,
                    attrs: Default::default(),
                },
                DeviceSpec {
                    id: None,
                    target: TargetSpec::Loop {
                        file: backing.path.clone(),
                        direct: false,
                        zero_copy: Some(false),
                    },
                    size_bytes: 4 << 20,
                    settings: DeviceSettings {
                        queues: 64,
                        queue_depth: 4096,
                        block_size: 512,
                        threads: 64,
                        sandbox: true,
                        sandbox_optional: LayerSet::EMPTY,
                    },
                    attrs: Default::default(),
                },
            ]
        );
    }

    #[test]
    fn sandbox_optional_defaults_to_none_and_a_device_may_override_the_default() {
        use ublkd_proto::msg::SandboxLayer;
        let text = "[defaults]\nsandbox_optional = [\"user-namespace\", \"landlock\"]\n\n\
                    [[device]]\ntarget = \"null\"\nsize = 4096\n\n\
                    [[device]]\ntarget = \"null\"\nsize = 4096\nsandbox_optional = []\n";
        let config = Config::parse(text, ORIGIN).expect("valid");
        assert_eq!(
            config.devices[0].settings.sandbox_optional.layers(),
            [SandboxLayer::UserNamespace, SandboxLayer::Landlock]
        );
        assert!(config.devices[1].settings.sandbox_optional.is_empty());
        let plain = Config::parse("[[device]]\ntarget = \"null\"\nsize = 4096\n", ORIGIN).unwrap();
        assert!(
            plain.devices[0].settings.sandbox_optional.is_empty(),
            "every layer is required by default"
        );
    }

    #[test]
    fn device_overrides_win_over_defaults_field_by_field() {
        let text = "[defaults]\nqueues = 4\nqueue_depth = 32\nsandbox = false\n\n\
                    [[device]]\ntarget = \"null\"\nsize = 4096\nqueue_depth = 8\n";
        let config = Config::parse(text, ORIGIN).expect("valid");
        let device = &config.devices[0];
        assert_eq!(
            (
                device.settings.queues,
                device.settings.queue_depth,
                device.settings.block_size,
                device.settings.threads,
                device.settings.sandbox
            ),
            (4, 8, 4096, 1, false)
        );
    }

    #[test]
    fn loop_size_defaults_to_the_file_size() {
        let backing = TempFile::with_len("loop.img", 3 << 20);
        let text = loop_device(&backing);
        let config = Config::parse(&text, ORIGIN).expect("valid");
        assert_eq!(config.devices[0].size_bytes, 3 << 20);
        assert_eq!(
            config.devices[0].target,
            TargetSpec::Loop { file: backing.path.clone(), direct: true, zero_copy: None }
        );
    }

    #[test]
    fn loop_file_size_must_fit_the_block_size_and_not_be_empty() {
        let odd = TempFile::with_len("odd.img", 4096 + 512);
        let text = loop_device(&odd);
        let message = error_message(&text);
        assert_mentions(
            &message,
            &["device[0].file: ", "is 4608 bytes, not a multiple of block_size 4096"],
        );
        // The same file is fine with a block size that divides it, or a size that fits.
        let text = format!("{text}block_size = 512\n");
        assert_eq!(Config::parse(&text, ORIGIN).map(|c| c.devices[0].size_bytes).ok(), Some(4608));

        let empty = TempFile::with_len("empty.img", 0);
        let text = loop_device(&empty);
        let message = error_message(&text);
        assert_mentions(&message, &["device[0].file: ", "is empty"]);
    }

    #[test]
    fn loop_size_larger_than_the_file_is_refused() {
        let backing = TempFile::with_len("small.img", 1 << 20);
        let text = format!("{}size = \"2M\"\n", loop_device(&backing));
        let message = error_message(&text);
        assert_mentions(
            &message,
            &["device[0].size: 2M (2097152 bytes) is larger than", "(1048576 bytes)"],
        );
    }

    #[test]
    fn one_backing_file_for_two_devices_is_refused() {
        let backing = TempFile::with_len("shared.img", 1 << 20);
        let device = loop_device(&backing);
        let message = error_message(&format!("{device}{device}"));
        assert_mentions(
            &message,
            &["device[1].file: ", "is already the backing file of device[0]"],
        );
    }

    #[test]
    fn load_names_the_path_when_the_file_is_missing() {
        let path = Path::new("/nonexistent/ublkd/ublkd.toml");
        let error = Config::load(path).err();
        assert!(matches!(&error, Some(ConfigError::Read { .. })), "{error:?}");
        assert_eq!(
            error.map(|e| e.to_string()).as_deref(),
            Some("/nonexistent/ublkd/ublkd.toml: cannot read the config file")
        );
    }

    fn example_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("ublkd.example.toml")
    }

    /// The config the package installs (packaging/ublkd.toml) is the example with a
    /// header of its own and its `[[device]]` tables commented out: made from the
    /// example here, it must match to the byte, so the prose is written once.
    #[test]
    fn an_nbd_device_keeps_its_uri_and_leaves_the_size_to_the_export() {
        let text = "[[device]]\nid = 4\ntarget = \"nbd\"\n\
                    uri = \"nbd+unix:///disk?socket=/run/nbd.sock\"\nqueues = 2\n";
        let config = Config::parse(text, ORIGIN).unwrap();
        let device = &config.devices[0];
        let TargetSpec::Nbd { uri, zero_copy: None } = &device.target else {
            panic!("not an nbd target with zero copy unset: {device:?}");
        };
        assert_eq!(uri.export, "disk");
        assert_eq!(uri.transport, NbdTransport::Unix { socket: "/run/nbd.sock".into() });
        assert_eq!(device.size_bytes, 0);
        assert_eq!(device.settings.queues, 2);
        assert_eq!(device.id, Some(4));
    }

    #[test]
    fn an_nbd_device_may_ask_for_zero_copy_or_copy() {
        for (value, want) in [("true", Some(true)), ("false", Some(false))] {
            let text =
                format!("[[device]]\ntarget = \"nbd\"\nuri = \"nbd://h/x\"\nzero_copy = {value}\n");
            let config = Config::parse(&text, ORIGIN).unwrap();
            assert!(
                matches!(&config.devices[0].target, TargetSpec::Nbd { zero_copy, .. } if *zero_copy == want),
                "{value}: {:?}",
                config.devices[0].target
            );
        }
    }

    #[test]
    fn the_packaged_config_is_the_example_without_devices() {
        let example = std::fs::read_to_string(example_path()).unwrap();
        let packaged_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/ublkd.toml");
        let packaged = std::fs::read_to_string(&packaged_path).unwrap();
        let marker = "# One [[device]] table per device, created when ublkd starts.\n";
        let (settings, devices) = example.split_once(marker).expect("the example's device part");
        let mut want = String::from(
            "# /etc/ublkd/ublkd.toml: ublkd's config (installed by the package).\n\
             # Reload with `systemctl reload ublkd`: devices added here are created, devices\n\
             # removed are deleted.\n\n",
        );
        want.push_str(settings);
        want.push_str(
            "# One [[device]] table per device, created when ublkd starts. No devices by \
             default:\n# uncomment and adapt one, or use `ublkctl add`.\n",
        );
        for line in devices.lines() {
            if line.is_empty() || line.starts_with('#') {
                want.push_str(line);
            } else {
                want.push_str("# ");
                want.push_str(line);
            }
            want.push('\n');
        }
        if packaged != want && std::env::var_os("UBLKD_BLESS").is_some() {
            std::fs::write(&packaged_path, &want).unwrap();
        } else {
            assert!(
                packaged == want,
                "{} is not config/ublkd.example.toml with its devices commented out: edit the \
                 example, then run `UBLKD_BLESS=1 cargo test -p ublkd-config packaged`",
                packaged_path.display()
            );
        }
        let config = Config::parse(&want, "packaging/ublkd.toml").unwrap();
        assert!(config.devices.is_empty());
    }

    #[test]
    fn example_config_loads_and_its_stated_defaults_are_the_real_ones() {
        let config = Config::load(&example_path()).expect("the example config is valid");
        // The example says each of these is the default: keep it honest.
        assert_eq!(config.daemon.socket, Path::new(DEFAULT_SOCKET));
        assert_eq!(config.daemon.state_dir, Path::new(DEFAULT_STATE_DIR));
        assert_eq!(
            config.daemon.worker_binary.as_deref(),
            Some(Path::new("/usr/libexec/ublkd/ublkd-worker"))
        );
        assert_eq!(config.daemon.worker_user.as_deref(), Some("ublkd-worker"));
        assert_eq!(config.daemon.metrics_file, None);
        assert_eq!(config.daemon.metrics_interval, DaemonConfig::default().metrics_interval);
        assert_eq!(config.recovery, RecoveryConfig::default());
        assert_eq!(config.defaults, DeviceSettings::default());
        assert_eq!(config.devices.len(), 2);
        assert_eq!(config.devices[0].id, Some(3));
        assert_eq!(config.devices[0].size_bytes, 1 << 30);
        assert_eq!(config.devices[1].target, TargetSpec::Memory);
        assert_eq!(config.devices[1].size_bytes, 256 << 20);
    }

    /// The example with the commented-out block that starts at the line starting with
    /// `intro` uncommented, each line passed through `edit`.
    fn uncomment_example_block(intro: &str, edit: impl Fn(&str) -> String) -> String {
        let text = std::fs::read_to_string(example_path()).expect("read the example");
        let mut out = String::new();
        let mut in_block = false;
        let mut uncommented = 0;
        for line in text.lines() {
            if line.starts_with(intro) {
                in_block = true;
            } else if in_block && line.trim().is_empty() {
                in_block = false;
            } else if in_block && let Some(rest) = line.strip_prefix("#   ") {
                out.push_str(&edit(rest));
                out.push('\n');
                uncommented += 1;
                continue;
            }
            out.push_str(line);
            out.push('\n');
        }
        assert!(uncommented >= 3, "the example's block after {intro:?} was not found");
        out
    }

    #[test]
    fn example_config_commented_loop_device_is_valid_too() {
        let backing = TempFile::with_len("example.img", 1 << 30);
        // Uncomment the loop block and point it at a real file.
        let out = uncomment_example_block("# A loop device takes", |line| {
            line.replace("/var/lib/ublkd/disk.img", &backing.toml())
        });
        let config = Config::parse(&out, "ublkd.example.toml").expect("the loop example is valid");
        let device = config.devices.last().expect("the loop device");
        assert_eq!(
            device.target,
            TargetSpec::Loop { file: backing.path.clone(), direct: true, zero_copy: Some(true) }
        );
        assert_eq!(device.size_bytes, 1 << 30);
    }

    #[test]
    fn example_config_commented_nbd_device_is_valid_too() {
        let out = uncomment_example_block("# An nbd device", str::to_owned);
        let config = Config::parse(&out, "ublkd.example.toml").expect("the nbd example is valid");
        let device = config.devices.last().expect("the nbd device");
        assert_eq!(device.target.name(), "nbd");
        assert_eq!(device.size_bytes, 0);
    }

    #[test]
    fn deeply_nested_input_is_refused_without_overflowing_the_stack() {
        for text in [
            format!("a = {}", "[".repeat(100_000)),
            format!("a = {}1{}", "{b=".repeat(10_000), "}".repeat(10_000)),
            format!("[daemon]\n{}a = 1", "a.".repeat(100_000)),
        ] {
            let message = error_message(&text);
            assert!(message.starts_with("bad.toml: not valid TOML: "), "{message}");
        }
    }

    #[test]
    fn worker_binary_path_defaults_to_the_executables_directory() {
        let daemon = DaemonConfig::default();
        let path = daemon.worker_binary_path().expect("current_exe works in tests");
        assert_eq!(path.file_name(), Some(DEFAULT_WORKER_NAME.as_ref()));
        let set = DaemonConfig { worker_binary: Some("/opt/w".into()), ..DaemonConfig::default() };
        assert_eq!(set.worker_binary_path().ok(), Some(PathBuf::from("/opt/w")));
    }

    #[test]
    fn a_worker_next_to_ublkd_wins_over_the_packaged_one_which_wins_over_nothing() {
        let dir = std::env::temp_dir().join(format!("ublkd-pick-worker-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let beside = dir.join("beside");
        let packaged = dir.join("packaged");
        assert_eq!(pick_worker(beside.clone(), &packaged), beside, "neither: name the build's");
        std::fs::write(&packaged, "").unwrap();
        assert_eq!(pick_worker(beside.clone(), &packaged), packaged);
        std::fs::write(&beside, "").unwrap();
        assert_eq!(pick_worker(beside.clone(), &packaged), beside);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every key the schema knows, by section.
    const SECTIONS: [(&str, &[&str]); 6] = [
        (
            "[daemon]",
            &[
                "socket",
                "state_dir",
                "worker_binary",
                "worker_user",
                "metrics_file",
                "metrics_interval_secs",
            ],
        ),
        (
            "[recovery]",
            &[
                "hung_timeout_secs",
                "restart_max",
                "restart_window_secs",
                "on_restart_limit",
                "fast_release",
                "nbd_server_wait_secs",
                "rbd_cluster_wait_secs",
                "rbd_cluster_retry_secs",
                "nbd_request_timeout_secs",
                "nbd_handshake_timeout_secs",
                "worker_ready_timeout_secs",
            ],
        ),
        (
            "[defaults]",
            &["queues", "queue_depth", "block_size", "threads", "sandbox", "sandbox_optional"],
        ),
        (
            "[[device]]",
            &[
                "id",
                "target",
                "size",
                "size",
                "size",
                "file",
                "direct",
                "zero_copy",
                "queues",
                "queue_depth",
                "block_size",
                "threads",
                "sandbox",
                "sandbox_optional",
            ],
        ),
        ("[device]", &["target", "size"]),
        ("[unknown]", &["a.b", "\"quoted key\""]),
    ];

    /// Values that fit `key` most of the time, and anything some of the time.
    fn value_for(key: &'static str) -> BoxedStrategy<String> {
        let plausible: &[&str] = match key {
            "socket" | "state_dir" | "worker_binary" | "metrics_file" => {
                &["\"/run/u/s.sock\"", "\"/run/ublkd\"", "\"/x\"", "\"relative\"", "\"\""]
            }
            "worker_user" => &["\"ublkd-worker\"", "\"nobody\"", "\"bad user\"", "\"1000\""],
            "on_restart_limit" => &["\"quiesce\"", "\"fail-io\"", "\"other\""],
            "target" => &["\"null\"", "\"null\"", "\"memory\"", "\"loop\"", "\"nul\""],
            "size" => &[
                "\"1G\"",
                "4096",
                "\"4k\"",
                "\"1 MiB\"",
                "8192",
                "1000",
                "0",
                "\"8388608T\"",
                "\"16777216T\"",
            ],
            "file" => &["\"/dev/null\"", "\"/\"", "\"/nonexistent\"", "\"rel.img\""],
            "id" => &["\"auto\"", "0", "3", "1048575", "1048576", "\"x\""],
            "block_size" => &["512", "1024", "2048", "4096", "8192", "768"],
            "sandbox" | "direct" | "zero_copy" | "fast_release" => &["true", "false"],
            "sandbox_optional" => &["[]", "[\"user-namespace\"]", "[\"landlock\", \"x\"]"],
            _ => &["1", "1", "2", "4", "8", "64", "0", "65", "300", "4096", "4097"],
        };
        prop_oneof![
            20 => prop::sample::select(plausible).prop_map(str::to_owned),
            1 => any::<i64>().prop_map(|v| v.to_string()),
            1 => prop::sample::select(vec![
                "99999999999999999999", "-1", "1.5", "true", "[]", "[1, 2]", "{}",
                "{ a = 1 }", "1979-05-27", "nan", "\"\\u0000\"",
            ])
            .prop_map(str::to_owned),
            1 => "[ -~]{0,12}".prop_map(|s| format!("{s:?}")),
        ]
        .boxed()
    }

    /// One section of `SECTIONS`: its header and distinct keys, mostly its own.
    fn section(index: usize) -> impl Strategy<Value = String> {
        let (header, keys) = SECTIONS[index % SECTIONS.len()];
        let any_key: Vec<&'static str> =
            SECTIONS.iter().flat_map(|(_, keys)| keys.iter().copied()).collect();
        let key = prop_oneof![
            30 => prop::sample::select(keys),
            1 => prop::sample::select(any_key),
        ];
        let entry = key.prop_flat_map(|key| (Just(key), value_for(key)));
        // A device without a target is refused at once: give most of them one.
        let target = if header == "[[device]]" {
            prop::option::weighted(0.95, value_for("target")).boxed()
        } else {
            Just(None).boxed()
        };
        (target, prop::collection::vec(entry, 0..8)).prop_map(move |(target, entries)| {
            let mut text = format!("{header}\n");
            let mut seen = std::collections::BTreeSet::new();
            let target = target.map(|value| ("target", value));
            for (key, value) in target.into_iter().chain(entries) {
                if seen.insert(key) {
                    text.push_str(&format!("{key} = {value}\n"));
                }
            }
            text
        })
    }

    /// TOML-ish documents: well-formed sections with right and wrong keys and values,
    /// sometimes a stray section or a line of noise.
    fn tomlish() -> impl Strategy<Value = String> {
        let extra =
            prop_oneof![section(4), section(5), "[ -~]{0,20}".prop_map(|s| format!("{s}\n")),];
        (
            prop::option::weighted(0.6, section(0)),
            prop::option::weighted(0.6, section(1)),
            prop::option::weighted(0.6, section(2)),
            prop::collection::vec(section(3), 0..4),
            prop::option::weighted(0.15, extra),
        )
            .prop_map(|(daemon, recovery, defaults, devices, extra)| {
                let mut text = String::new();
                for part in [daemon, recovery, defaults].into_iter().flatten() {
                    text.push_str(&part);
                }
                text.push_str(&devices.concat());
                text.push_str(&extra.unwrap_or_default());
                text
            })
    }

    /// A `[[device]]` table within every limit, and the spec it must resolve to.
    fn valid_device() -> impl Strategy<Value = (String, DeviceSpec)> {
        (
            1..=MAX_QUEUES,
            1..=MAX_QUEUE_DEPTH,
            prop::sample::select(vec![512u32, 1024, 2048, 4096]),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_flat_map(
                |(queues, queue_depth, block_size, memory, sandbox, size_as_text)| {
                    let slots = u32::from(queues) * u32::from(queue_depth);
                    let max_threads = u32::from(MAX_THREADS).min(slots) as u16;
                    let max_blocks = MAX_SIZE_BYTES / u64::from(block_size);
                    (1..=max_threads, 1..=max_blocks).prop_map(move |(threads, blocks)| {
                        let size_bytes = blocks * u64::from(block_size);
                        let target = if memory { TargetSpec::Memory } else { TargetSpec::Null };
                        let size = if size_as_text {
                            format!("\"{}\"", format_size(size_bytes))
                        } else if let Ok(size) = i64::try_from(size_bytes) {
                            size.to_string()
                        } else {
                            format!("\"{size_bytes}\"")
                        };
                        let text = format!(
                            "[[device]]\ntarget = \"{}\"\nsize = {size}\nqueues = {queues}\n\
                         queue_depth = {queue_depth}\nblock_size = {block_size}\n\
                         threads = {threads}\nsandbox = {sandbox}\n",
                            target.name()
                        );
                        let spec = DeviceSpec {
                            id: None,
                            target,
                            size_bytes,
                            settings: DeviceSettings {
                                queues,
                                queue_depth,
                                block_size,
                                threads,
                                sandbox,
                                sandbox_optional: LayerSet::EMPTY,
                            },
                            attrs: Default::default(),
                        };
                        (text, spec)
                    })
                },
            )
    }

    proptest! {
        #[test]
        fn parse_never_panics_on_arbitrary_text(text in any::<String>()) {
            let _ = Config::parse(&text, "fuzz.toml");
        }

        #[test]
        fn parse_size_never_panics_and_round_trips(text in any::<String>()) {
            if let Ok(bytes) = parse_size(&text) {
                prop_assert_eq!(parse_size(&format_size(bytes)), Ok(bytes));
            }
        }

        #[test]
        fn every_device_within_the_limits_is_accepted_as_written(
            devices in prop::collection::vec(valid_device(), 1..4)
        ) {
            let text: String = devices.iter().map(|(text, _)| text.as_str()).collect();
            let expected: Vec<DeviceSpec> = devices.into_iter().map(|(_, spec)| spec).collect();
            let config = Config::parse(&text, "gen.toml");
            prop_assert_eq!(config.map(|c| c.devices).map_err(|e| e.to_string()), Ok(expected));
        }

        #[test]
        fn parse_on_tomlish_text_never_panics_and_accepts_only_valid_devices(
            text in tomlish()
        ) {
            match Config::parse(&text, "fuzz.toml") {
                Ok(config) => {
                    for device in &config.devices {
                        prop_assert_eq!(device.validate(), Ok(()));
                    }
                    prop_assert_eq!(config.defaults.validate(), Ok(()));
                }
                Err(error) => {
                    let message = error.to_string();
                    prop_assert!(message.starts_with("fuzz.toml: "), "{}", message);
                }
            }
        }
    }
}
