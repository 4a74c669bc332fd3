//! The config file exactly as written: serde types that mirror the TOML, before
//! defaults and limits. Integers are kept wide (`i128`) so an out-of-range value gets
//! the range message from validation instead of serde's "expected u16".

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use crate::OnRestartLimit;

#[derive(Debug, Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a table with [daemon], [recovery], [defaults] and [[device]] sections"
)]
pub(crate) struct RawFile {
    pub daemon: RawDaemon,
    pub recovery: RawRecovery,
    pub defaults: RawDefaults,
    pub device: RawDevices,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "a table ([daemon])")]
pub(crate) struct RawDaemon {
    pub socket: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub worker_binary: Option<PathBuf>,
    pub worker_user: Option<String>,
    pub metrics_file: Option<PathBuf>,
    pub metrics_interval_secs: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default, expecting = "a table ([recovery])")]
pub(crate) struct RawRecovery {
    pub hung_timeout_secs: Option<Int>,
    pub restart_max: Option<Int>,
    pub restart_window_secs: Option<Int>,
    pub on_restart_limit: Option<OnRestartLimit>,
    pub fast_release: Option<bool>,
    pub nbd_server_wait_secs: Option<Int>,
    pub rbd_cluster_wait_secs: Option<Int>,
    pub rbd_cluster_retry_secs: Option<Int>,
    pub nbd_request_timeout_secs: Option<Int>,
    pub nbd_handshake_timeout_secs: Option<Int>,
    pub worker_ready_timeout_secs: Option<Int>,
}

/// `[defaults]` and `[[device]]`, the keys they share written once: `RawDevice` gets
/// every field of `RawDefaults` after its own, and [`RawDevice::settings`], which
/// copies them out of a device's table. (`#[serde(flatten)]` would say as much, but it
/// does not go with `deny_unknown_fields`.)
macro_rules! defaults_and_device {
    (
        $(#[$defaults_meta:meta])*
        pub(crate) struct RawDefaults { $(pub $key:ident: $ty:ty,)* }
        $(#[$device_meta:meta])*
        pub(crate) struct RawDevice { $(pub $own:ident: $own_ty:ty,)* }
    ) => {
        $(#[$defaults_meta])*
        pub(crate) struct RawDefaults {
            $(pub $key: $ty,)*
        }

        $(#[$device_meta])*
        pub(crate) struct RawDevice {
            $(pub $own: $own_ty,)*
            $(pub $key: $ty,)*
        }

        impl RawDevice {
            /// The keys a `[[device]]` table shares with `[defaults]`.
            pub fn settings(&self) -> RawDefaults {
                RawDefaults { $($key: self.$key.clone(),)* }
            }
        }
    };
}

defaults_and_device! {
    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields, default, expecting = "a table ([defaults])")]
    pub(crate) struct RawDefaults {
        pub queues: Option<Int>,
        pub queue_depth: Option<Int>,
        pub block_size: Option<Int>,
        pub threads: Option<Int>,
        pub sandbox: Option<bool>,
        pub sandbox_optional: Option<Vec<String>>,
    }

    /// A device's own keys; those of `RawDefaults` follow.
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields, expecting = "a table ([[device]])")]
    pub(crate) struct RawDevice {
        pub id: Option<Id>,
        pub target: RawTarget,
        pub size: Option<Size>,
        pub file: Option<PathBuf>,
        pub direct: Option<bool>,
        pub zero_copy: Option<bool>,
        pub uri: Option<String>,
        pub image: Option<String>,
        pub ceph_conf: Option<PathBuf>,
        pub ceph_id: Option<String>,
        pub keyring: Option<PathBuf>,
        pub allow_unfenced: Option<bool>,
        pub name: Option<String>,
        pub read_only: Option<bool>,
        pub partitions: Option<bool>,
    }
}

/// The `[[device]]` array; its own type for a readable "expected" in type errors.
#[derive(Debug, Default)]
pub(crate) struct RawDevices(pub Vec<RawDevice>);

#[derive(Debug, Clone, Copy)]
pub(crate) enum RawTarget {
    Null,
    Memory,
    Loop,
    Nbd,
    Rbd,
}

/// A TOML integer, any width TOML can carry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Int(pub i128);

/// A value that may be an integer or a string.
#[derive(Debug, Clone)]
pub(crate) enum IntOrString {
    Int(i128),
    String(String),
}

/// A device id: `3` or `"auto"`.
#[derive(Debug, Clone)]
pub(crate) struct Id(pub IntOrString);

/// A size: `4096` or `"4G"`.
#[derive(Debug, Clone)]
pub(crate) struct Size(pub IntOrString);

impl<'de> Deserialize<'de> for RawDevices {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DevicesVisitor;

        impl<'de> Visitor<'de> for DevicesVisitor {
            type Value = RawDevices;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of tables ([[device]])")
            }

            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<RawDevices, A::Error> {
                let mut devices = Vec::new();
                while let Some(device) = seq.next_element()? {
                    devices.push(device);
                }
                Ok(RawDevices(devices))
            }
        }

        deserializer.deserialize_seq(DevicesVisitor)
    }
}

/// Accepts integers of any width; `accept_strings` also takes strings.
struct ScalarVisitor {
    expecting: &'static str,
    accept_strings: bool,
}

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = IntOrString;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<IntOrString, E> {
        Ok(IntOrString::Int(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<IntOrString, E> {
        Ok(IntOrString::Int(v.into()))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<IntOrString, E> {
        Ok(IntOrString::Int(v))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<IntOrString, E> {
        i128::try_from(v).map(IntOrString::Int).map_err(|_| {
            E::custom(format!("integer {v} is out of range; expected {}", self.expecting))
        })
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<IntOrString, E> {
        if self.accept_strings {
            Ok(IntOrString::String(v.to_owned()))
        } else {
            Err(E::invalid_type(de::Unexpected::Str(v), &self))
        }
    }
}

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let visitor = ScalarVisitor { expecting: "an integer", accept_strings: false };
        match deserializer.deserialize_any(visitor)? {
            IntOrString::Int(v) => Ok(Self(v)),
            // The visitor refuses strings, so this arm is never taken.
            IntOrString::String(s) => {
                Err(de::Error::invalid_type(de::Unexpected::Str(&s), &"an integer"))
            }
        }
    }
}

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(ScalarVisitor {
                expecting: "a device id: an integer or \"auto\"",
                accept_strings: true,
            })
            .map(Self)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(ScalarVisitor {
                expecting: "a size: a number of bytes or a string such as \"4G\"",
                accept_strings: true,
            })
            .map(Self)
    }
}

/// Accepts one of a few strings, with messages that list them.
struct ChoiceVisitor<T: 'static> {
    what: &'static str,
    choices: &'static [(&'static str, T)],
}

impl<T: 'static> ChoiceVisitor<T> {
    fn list(&self) -> String {
        let quoted: Vec<String> =
            self.choices.iter().map(|(name, _)| format!("{name:?}")).collect();
        match quoted.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        }
    }
}

impl<'de, T: Copy + 'static> Visitor<'de> for ChoiceVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a {}: {}", self.what, self.list())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        self.choices.iter().find(|(name, _)| *name == v).map(|(_, value)| *value).ok_or_else(|| {
            E::custom(format!("{v:?} is not a {}; expected {}", self.what, self.list()))
        })
    }
}

impl<'de> Deserialize<'de> for RawTarget {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ChoiceVisitor {
            what: "target",
            choices: &[
                ("null", Self::Null),
                ("memory", Self::Memory),
                ("loop", Self::Loop),
                ("nbd", Self::Nbd),
                ("rbd", Self::Rbd),
            ],
        })
    }
}

impl<'de> Deserialize<'de> for OnRestartLimit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ChoiceVisitor {
            what: "policy",
            choices: &[("quiesce", Self::Quiesce), ("fail-io", Self::FailIo)],
        })
    }
}
