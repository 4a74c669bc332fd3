//! From the text to a [`Config`]: TOML syntax and serde errors turned into
//! [`ConfigError`]s that name the key and its line, then every table resolved
//! (defaults applied) and checked against its limits, and the devices against each
//! other (ids and backing files used once).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use serde::Deserialize;
use toml::de::DeTable;
use ublkd_proto::msg::LayerSet;

use crate::daemon::check_user_name;
use crate::device::{
    DeviceAttrs, backing_file_metadata, check_absolute, check_device_id, in_range,
    parse_sandbox_optional,
};
use crate::locate::{self, KeyPath};
use crate::overrides::Overrides;
use crate::raw::{IntOrString, RawDaemon, RawDefaults, RawDevice, RawFile, RawRecovery, RawTarget};
use crate::{
    Config, ConfigError, DEFAULT_SOCKET, DEFAULT_STATE_DIR, DaemonConfig, DeviceSettings,
    DeviceSpec, FieldError, MAX_DEVICE_ID, MAX_HUNG_TIMEOUT_SECS, MAX_METRICS_INTERVAL_SECS,
    MAX_NBD_HANDSHAKE_TIMEOUT_SECS, MAX_RBD_CLUSTER_RETRY_SECS, MAX_SIZE_BYTES,
    MAX_SOCKET_PATH_BYTES, MAX_WORKER_READY_TIMEOUT_SECS, NbdUri, RbdImage, RbdSpec,
    RecoveryConfig, TargetSpec, check_ceph_id, parse_size,
};

/// Checks config `text`; `origin` names it in messages. See [`Config::parse`].
pub(crate) fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let doc = DeTable::parse(text).map_err(|error| syntax_error(text, origin, &error))?;
    let checker = Checker { origin, text, doc: doc.get_ref() };
    let raw = RawFile::deserialize(toml::de::Deserializer::from(doc.clone()))
        .map_err(|error| checker.decode_error(&error))?;
    checker.resolve(raw)
}

fn syntax_error(text: &str, origin: &str, error: &toml::de::Error) -> ConfigError {
    let offset = error.span().map_or(0, |span| span.start);
    let mut message = error.message().trim_end().to_owned();
    // "duplicate key" alone does not say which one.
    if let Some(span) = error.span()
        && let Some(found) = text.get(span.clone())
        && !found.is_empty()
        && found.len() <= 64
        && !found.contains('\n')
        && !message.contains('`')
    {
        message = format!("{message} `{found}`");
    }
    ConfigError::Syntax {
        origin: origin.to_owned(),
        message,
        location: locate::location(text, offset),
    }
}

/// Turns the raw file into a [`Config`], turning each problem into a [`ConfigError`]
/// that names the key and its line.
struct Checker<'a> {
    origin: &'a str,
    text: &'a str,
    doc: &'a DeTable<'a>,
}

impl Checker<'_> {
    fn invalid(&self, path: &KeyPath, problem: impl Into<String>) -> ConfigError {
        let location =
            locate::span_of(self.doc, path).map(|span| locate::location(self.text, span.start));
        ConfigError::Invalid {
            origin: self.origin.to_owned(),
            key: path.to_string(),
            problem: problem.into(),
            location,
        }
    }

    fn field(&self, table: &KeyPath, error: FieldError) -> ConfigError {
        self.invalid(&table.key(error.field), error.problem)
    }

    /// A table's `sandbox_optional` list, if it has one.
    fn sandbox_optional(
        &self,
        table: &KeyPath,
        names: Option<&[String]>,
    ) -> Result<Option<LayerSet>, ConfigError> {
        names.map(parse_sandbox_optional).transpose().map_err(|e| self.field(table, e))
    }

    /// A serde error from toml: unknown key, wrong type, missing key.
    fn decode_error(&self, error: &toml::de::Error) -> ConfigError {
        let offset = error.span().map_or(0, |span| span.start);
        let mut path = locate::path_at(self.doc, offset);
        let message = error.message().trim_end();
        let location = Some(locate::location(self.text, offset));
        let problem =
            match message.strip_prefix("missing field `").and_then(|rest| rest.strip_suffix('`')) {
                Some(missing) => {
                    path = path.key(missing);
                    match missing {
                        "target" => "missing; every device needs a target: \"null\", \"memory\", \
                                 \"loop\", \"nbd\" or \"rbd\""
                            .to_owned(),
                        _ => "missing; this key is required".to_owned(),
                    }
                }
                None => message.to_owned(),
            };
        ConfigError::Invalid {
            origin: self.origin.to_owned(),
            key: path.to_string(),
            problem,
            location: if path.is_root() { None } else { location },
        }
    }

    fn resolve(&self, raw: RawFile) -> Result<Config, ConfigError> {
        let daemon = self.daemon(raw.daemon)?;
        let recovery = self.recovery(raw.recovery)?;
        let defaults = self.defaults(raw.defaults)?;
        let mut devices = Vec::with_capacity(raw.device.0.len());
        for (index, device) in raw.device.0.iter().enumerate() {
            devices.push(self.device(index, device, &defaults)?);
        }
        self.check_unique(&devices)?;
        Ok(Config { daemon, recovery, defaults, devices })
    }

    fn daemon(&self, raw: RawDaemon) -> Result<DaemonConfig, ConfigError> {
        let table = KeyPath::root().key("daemon");
        let defaults = DaemonConfig::default();
        let socket = raw.socket.unwrap_or(defaults.socket);
        check_absolute("socket", &socket, DEFAULT_SOCKET).map_err(|e| self.field(&table, e))?;
        let length = socket.as_os_str().len();
        if length > MAX_SOCKET_PATH_BYTES {
            return Err(self.invalid(
                &table.key("socket"),
                format!(
                    "{} is {length} bytes long; a unix socket path must be at most \
                     {MAX_SOCKET_PATH_BYTES} bytes",
                    socket.display()
                ),
            ));
        }
        let state_dir = raw.state_dir.unwrap_or(defaults.state_dir);
        check_absolute("state_dir", &state_dir, DEFAULT_STATE_DIR)
            .map_err(|e| self.field(&table, e))?;
        if let Some(binary) = &raw.worker_binary {
            check_absolute("worker_binary", binary, "/usr/libexec/ublkd/ublkd-worker")
                .map_err(|e| self.field(&table, e))?;
        }
        if let Some(user) = &raw.worker_user {
            check_user_name(user).map_err(|e| self.field(&table, e))?;
        }
        const METRICS_EXAMPLE: &str = "/var/lib/prometheus/node-exporter/ublkd.prom";
        if let Some(file) = &raw.metrics_file {
            check_absolute("metrics_file", file, METRICS_EXAMPLE)
                .map_err(|e| self.field(&table, e))?;
            if file.file_name().is_none() || file.as_os_str().as_encoded_bytes().ends_with(b"/") {
                return Err(self.invalid(
                    &table.key("metrics_file"),
                    format!(
                        "{} names a directory; use a file such as {METRICS_EXAMPLE}",
                        file.display()
                    ),
                ));
            }
        }
        let mut metrics_interval = defaults.metrics_interval;
        if let Some(secs) = raw.metrics_interval_secs {
            let secs = in_range("metrics_interval_secs", secs.0, 1, MAX_METRICS_INTERVAL_SECS)
                .map_err(|e| self.field(&table, e))?;
            metrics_interval = Duration::from_secs(secs.into());
        }
        Ok(DaemonConfig {
            socket,
            state_dir,
            worker_binary: raw.worker_binary,
            worker_user: raw.worker_user,
            metrics_file: raw.metrics_file,
            metrics_interval,
        })
    }

    fn recovery(&self, raw: RawRecovery) -> Result<RecoveryConfig, ConfigError> {
        let table = KeyPath::root().key("recovery");
        let defaults = RecoveryConfig::default();
        let mut recovery = defaults;
        if let Some(secs) = raw.hung_timeout_secs {
            let secs = in_range("hung_timeout_secs", secs.0, 1, MAX_HUNG_TIMEOUT_SECS)
                .map_err(|e| self.field(&table, e))?;
            recovery.hung_timeout = Duration::from_secs(secs.into());
        }
        if let Some(max) = raw.restart_max {
            recovery.restart_max =
                in_range("restart_max", max.0, 0, u32::MAX).map_err(|e| self.field(&table, e))?;
        }
        if let Some(secs) = raw.restart_window_secs {
            let secs = in_range("restart_window_secs", secs.0, 1, u32::MAX).map_err(|mut e| {
                if secs.0 == 0 {
                    e.problem.push_str("; to turn automatic recovery off, set restart_max = 0");
                }
                self.field(&table, e)
            })?;
            recovery.restart_window = Duration::from_secs(secs.into());
        }
        if let Some(policy) = raw.on_restart_limit {
            recovery.on_restart_limit = policy;
        }
        if let Some(fast) = raw.fast_release {
            recovery.fast_release = fast;
        }
        if let Some(secs) = raw.nbd_server_wait_secs {
            let secs = in_range("nbd_server_wait_secs", secs.0, 0, u32::MAX)
                .map_err(|e| self.field(&table, e))?;
            recovery.nbd_server_wait = (secs > 0).then(|| Duration::from_secs(secs.into()));
        }
        if let Some(secs) = raw.rbd_cluster_wait_secs {
            let secs = in_range("rbd_cluster_wait_secs", secs.0, 0, u32::MAX)
                .map_err(|e| self.field(&table, e))?;
            recovery.rbd_cluster_wait = (secs > 0).then(|| Duration::from_secs(secs.into()));
        }
        if let Some(secs) = raw.rbd_cluster_retry_secs {
            let secs = in_range("rbd_cluster_retry_secs", secs.0, 1, MAX_RBD_CLUSTER_RETRY_SECS)
                .map_err(|e| self.field(&table, e))?;
            recovery.rbd_cluster_retry = Duration::from_secs(secs.into());
        }
        if let Some(secs) = raw.nbd_request_timeout_secs {
            let secs = in_range("nbd_request_timeout_secs", secs.0, 0, u32::MAX)
                .map_err(|e| self.field(&table, e))?;
            recovery.nbd_request_timeout = (secs > 0).then(|| Duration::from_secs(secs.into()));
        }
        if let Some(secs) = raw.nbd_handshake_timeout_secs {
            let secs =
                in_range("nbd_handshake_timeout_secs", secs.0, 1, MAX_NBD_HANDSHAKE_TIMEOUT_SECS)
                    .map_err(|e| self.field(&table, e))?;
            recovery.nbd_handshake_timeout = Duration::from_secs(secs.into());
        }
        if let Some(secs) = raw.worker_ready_timeout_secs {
            let secs =
                in_range("worker_ready_timeout_secs", secs.0, 1, MAX_WORKER_READY_TIMEOUT_SECS)
                    .map_err(|e| self.field(&table, e))?;
            recovery.worker_ready_timeout = Duration::from_secs(secs.into());
        }
        Ok(recovery)
    }

    /// The settings `table` (`[defaults]` or a `[[device]]`) sets itself.
    fn overrides(&self, table: &KeyPath, raw: &RawDefaults) -> Result<Overrides, ConfigError> {
        Ok(Overrides {
            queues: raw.queues.map(|v| v.0),
            queue_depth: raw.queue_depth.map(|v| v.0),
            block_size: raw.block_size.map(|v| v.0),
            threads: raw.threads.map(|v| v.0),
            sandbox: raw.sandbox,
            sandbox_optional: self.sandbox_optional(table, raw.sandbox_optional.as_deref())?,
        })
    }

    fn defaults(&self, raw: RawDefaults) -> Result<DeviceSettings, ConfigError> {
        let table = KeyPath::root().key("defaults");
        let builtin = DeviceSettings::default();
        let overridden =
            self.overrides(&table, &raw)?.apply(&builtin).map_err(|e| self.field(&table, e))?;
        overridden.validate().map_err(|e| self.field(&table, e))?;
        Ok(overridden)
    }

    fn device(
        &self,
        index: usize,
        raw: &RawDevice,
        defaults: &DeviceSettings,
    ) -> Result<DeviceSpec, ConfigError> {
        let table = KeyPath::root().key("device").index(index);
        let overrides = self.overrides(&table, &raw.settings())?;
        let settings = overrides.apply(defaults).map_err(|e| self.field(&table, e))?;

        let id = match raw.id.as_ref().map(|id| &id.0) {
            None => None,
            Some(IntOrString::String(s)) if s == "auto" => None,
            Some(IntOrString::String(s)) => {
                return Err(self.invalid(
                    &table.key("id"),
                    format!(
                        "{s:?} is not a device id; expected an integer in \
                         0..={MAX_DEVICE_ID} or \"auto\""
                    ),
                ));
            }
            Some(IntOrString::Int(id)) => {
                Some(check_device_id(*id).map_err(|e| self.field(&table, e))?)
            }
        };

        let size = match raw.size.as_ref().map(|size| &size.0) {
            None => None,
            Some(IntOrString::Int(bytes)) => Some(u64::try_from(*bytes).map_err(|_| {
                let problem = if *bytes < 0 {
                    format!(
                        "{bytes} is negative; expected a number of bytes such as 4096 or \"4G\""
                    )
                } else {
                    format!("{bytes} is too large; the largest device is {MAX_SIZE_BYTES} bytes")
                };
                self.invalid(&table.key("size"), problem)
            })?),
            Some(IntOrString::String(text)) => Some(
                parse_size(text).map_err(|e| self.invalid(&table.key("size"), e.to_string()))?,
            ),
        };

        if raw.uri.is_some() && !matches!(raw.target, RawTarget::Nbd) {
            return Err(self.invalid(
                &table.key("uri"),
                "only an nbd target has a uri; remove uri or set target = \"nbd\"",
            ));
        }
        if !matches!(raw.target, RawTarget::Rbd) {
            for (key, present) in [
                ("image", raw.image.is_some()),
                ("ceph_conf", raw.ceph_conf.is_some()),
                ("ceph_id", raw.ceph_id.is_some()),
                ("keyring", raw.keyring.is_some()),
                ("allow_unfenced", raw.allow_unfenced.is_some()),
            ] {
                if present {
                    return Err(self.invalid(
                        &table.key(key),
                        format!(
                            "only an rbd target has {key}; remove {key} or set target = \"rbd\""
                        ),
                    ));
                }
            }
        }
        let (target, size_bytes) = match raw.target {
            RawTarget::Rbd => (self.rbd(&table, raw)?, 0),
            RawTarget::Nbd => {
                for (key, present) in [
                    ("file", raw.file.is_some()),
                    ("direct", raw.direct.is_some()),
                    ("size", raw.size.is_some()),
                ] {
                    if present {
                        let why = if key == "size" {
                            "an nbd device's size is its export's, which the server gives \
                             at connection"
                        } else {
                            "only a loop target has a backing file"
                        };
                        return Err(self.invalid(
                            &table.key(key),
                            format!("{why}; remove {key} from this nbd device"),
                        ));
                    }
                }
                let Some(text) = &raw.uri else {
                    return Err(self.invalid(
                        &table.key("uri"),
                        "missing; an nbd device needs uri = the export's NBD URI, such as \
                         \"nbd://host/export\" or \"nbd+unix:///export?socket=/run/nbd.sock\"",
                    ));
                };
                let uri = NbdUri::parse(text)
                    .map_err(|e| self.invalid(&table.key("uri"), e.to_string()))?;
                (TargetSpec::Nbd { uri, zero_copy: raw.zero_copy }, 0)
            }
            RawTarget::Null | RawTarget::Memory => {
                let target = if matches!(raw.target, RawTarget::Null) {
                    TargetSpec::Null
                } else {
                    TargetSpec::Memory
                };
                for (key, present) in
                    [("file", raw.file.is_some()), ("direct", raw.direct.is_some())]
                {
                    if present {
                        return Err(self.invalid(
                            &table.key(key),
                            format!(
                                "only a loop target has a backing file, this one is {}; \
                                 remove {key} or set target = \"loop\"",
                                target.name()
                            ),
                        ));
                    }
                }
                if raw.zero_copy.is_some() {
                    return Err(self.invalid(
                        &table.key("zero_copy"),
                        format!(
                            "only a loop or nbd target has zero copy, this one is {}; \
                             remove zero_copy",
                            target.name()
                        ),
                    ));
                }
                let Some(size) = size else {
                    return Err(self.invalid(
                        &table.key("size"),
                        format!(
                            "missing; a {} device needs a size, such as size = \"1G\"",
                            target.name()
                        ),
                    ));
                };
                (target, size)
            }
            RawTarget::Loop => {
                let Some(file) = raw.file.clone() else {
                    return Err(self.invalid(
                        &table.key("file"),
                        "missing; a loop device needs file = the absolute path of a \
                         regular file or block device",
                    ));
                };
                let size = match size {
                    Some(size) => size,
                    None => DeviceSpec::loop_size_from_file(&file, settings.block_size)
                        .map_err(|e| self.field(&table, e))?,
                };
                let direct = raw.direct.unwrap_or(true);
                (TargetSpec::Loop { file, direct, zero_copy: raw.zero_copy }, size)
            }
        };

        let attrs = DeviceAttrs {
            name: raw.name.clone(),
            read_only: raw.read_only.unwrap_or(false),
            partitions: raw.partitions.unwrap_or(false),
        };
        let spec = DeviceSpec { id, target, size_bytes, settings, attrs };
        spec.validate().map_err(|mut e| {
            if overrides.inherits(e.field) {
                e.problem.push_str(&format!(" (the value comes from defaults.{})", e.field));
            }
            self.field(&table, e)
        })?;
        Ok(spec)
    }

    /// An rbd device's image and credentials, from its table.
    fn rbd(&self, table: &KeyPath, raw: &RawDevice) -> Result<TargetSpec, ConfigError> {
        for (key, present, why) in [
            ("file", raw.file.is_some(), "only a loop target has a backing file"),
            ("direct", raw.direct.is_some(), "only a loop target has a backing file"),
            ("zero_copy", raw.zero_copy.is_some(), "only a loop or nbd target has zero copy"),
            ("uri", raw.uri.is_some(), "only an nbd target has a uri"),
            (
                "size",
                raw.size.is_some(),
                "an rbd device's size is its image's, which ublkd reads from the cluster \
                 (resize the image with `rbd resize`)",
            ),
        ] {
            if present {
                return Err(self.invalid(
                    &table.key(key),
                    format!("{why}; remove {key} from this rbd device"),
                ));
            }
        }
        let Some(text) = &raw.image else {
            return Err(self.invalid(
                &table.key("image"),
                "missing; an rbd device needs image = \"POOL/IMAGE\" (or \"POOL/IMAGE@SNAPSHOT\" \
                 for a read-only device)",
            ));
        };
        let image =
            RbdImage::parse(text).map_err(|e| self.invalid(&table.key("image"), e.to_string()))?;
        if let Some(id) = &raw.ceph_id {
            check_ceph_id(id).map_err(|e| self.invalid(&table.key("ceph_id"), e))?;
        }
        for (key, path) in [("ceph_conf", &raw.ceph_conf), ("keyring", &raw.keyring)] {
            if let Some(path) = path
                && !path.is_absolute()
            {
                return Err(self.invalid(
                    &table.key(key),
                    format!("{} is relative; give an absolute path", path.display()),
                ));
            }
        }
        Ok(TargetSpec::Rbd(RbdSpec {
            image,
            ceph_conf: raw.ceph_conf.clone(),
            ceph_id: raw.ceph_id.clone(),
            keyring: raw.keyring.clone(),
            allow_unfenced: raw.allow_unfenced.unwrap_or(false),
        }))
    }

    /// Device ids and loop backing files are each used at most once.
    fn check_unique(&self, devices: &[DeviceSpec]) -> Result<(), ConfigError> {
        let mut ids = HashMap::new();
        let mut files = HashMap::new();
        let mut exports = HashMap::new();
        let mut images = HashMap::new();
        let mut names = HashMap::new();
        for (index, device) in devices.iter().enumerate() {
            let table = KeyPath::root().key("device").index(index);
            if let Some(id) = device.id
                && let Some(first) = ids.insert(id, index)
            {
                return Err(self.invalid(
                    &table.key("id"),
                    format!(
                        "{id} is already used by device[{first}]; give each device its \
                         own id or use \"auto\""
                    ),
                ));
            }
            if let Some(name) = &device.attrs.name
                && let Some(first) = names.insert(name, index)
            {
                return Err(self.invalid(
                    &table.key("name"),
                    format!(
                        "{name:?} is already the name of device[{first}]; give each device \
                         its own name"
                    ),
                ));
            }
            // A snapshot is read-only: any number of devices may serve it.
            if let TargetSpec::Rbd(rbd) = &device.target
                && rbd.image.snapshot.is_none()
                && let Some(first) = images.insert(rbd.image.without_snapshot(), index)
            {
                return Err(self.invalid(
                    &table.key("image"),
                    format!(
                        "{} is already the image of device[{first}]; each would take the \
                         image's lock from the other",
                        rbd.image
                    ),
                ));
            }
            // The same export written two ways (a host name and its address) is not
            // caught; the server is the one to refuse a second writer.
            if let TargetSpec::Nbd { uri, .. } = &device.target
                && let Some(first) = exports.insert((&uri.transport, &uri.export), index)
            {
                return Err(self.invalid(
                    &table.key("uri"),
                    format!(
                        "{uri} is already the export of device[{first}]; two devices \
                         writing one export corrupt it"
                    ),
                ));
            }
            if let TargetSpec::Loop { file, .. } = &device.target {
                let metadata = backing_file_metadata(file).map_err(|e| self.field(&table, e))?;
                if let Some(first) = files.insert((metadata.dev(), metadata.ino()), index) {
                    return Err(self.invalid(
                        &table.key("file"),
                        format!(
                            "{} is already the backing file of device[{first}]; two \
                             devices writing one file corrupt it",
                            file.display()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}
