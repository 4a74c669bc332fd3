//! The `rbd` target's spec: which image of which Ceph cluster, and with which client's
//! credentials. Only names and paths: the supervisor reads the Ceph config file and the
//! keyring when it starts a worker (the worker reads neither), and the image's size
//! comes from the cluster.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The Ceph config file used when a device names none, as Ceph's own tools do.
pub const DEFAULT_CEPH_CONF: &str = "/etc/ceph/ceph.conf";

/// The cephx id used when a device names none: `client.ublkd`, a dedicated client
/// with only `profile rbd` caps (the operator's guide gives the `ceph auth
/// get-or-create` line), never Ceph's own default `client.admin`, whose key opens and
/// writes every image and breaks every lock in the cluster: a compromised worker holds
/// its client's key.
pub const DEFAULT_CEPH_ID: &str = "ublkd";

/// Ceph's all-powerful client id: a device that connects as it is flagged in the
/// journal each time one of its workers starts (see [`RbdSpec::uses_admin`]).
pub const ADMIN_CEPH_ID: &str = "admin";

/// The longest pool, namespace, image, snapshot or client id ublkd accepts. Ceph
/// allows longer pool names, but names this long are mistakes.
pub const MAX_RBD_NAME_BYTES: usize = 128;

/// An image as Ceph's tools name one: `POOL/IMAGE`, `POOL/NAMESPACE/IMAGE`, each with an
/// optional `@SNAPSHOT`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RbdImage {
    pub pool: String,
    /// Empty for the pool's default namespace.
    pub namespace: String,
    pub image: String,
    pub snapshot: Option<String>,
}

/// Why a text is not an image spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RbdImageError {
    #[error(
        "{0:?} names no pool; write POOL/IMAGE (such as rbd/{0}), as `rbd ls` lists \
         images by pool"
    )]
    NoPool(String),
    #[error("{text:?} has an empty {part}; expected POOL/IMAGE[@SNAPSHOT]")]
    Empty { text: String, part: &'static str },
    #[error("{text:?} has too many parts; expected POOL/IMAGE or POOL/NAMESPACE/IMAGE")]
    TooManyParts { text: String },
    #[error("{text:?}: the {part} {name:?} is longer than {MAX_RBD_NAME_BYTES} bytes")]
    TooLong { text: String, part: &'static str, name: String },
    #[error(
        "{text:?}: the {part} {name:?} holds {bad:?}; names are letters, digits and \
         . _ - + only"
    )]
    BadCharacter { text: String, part: &'static str, name: String, bad: char },
}

impl RbdImage {
    pub fn parse(text: &str) -> Result<RbdImage, RbdImageError> {
        let (path, snapshot) = match text.split_once('@') {
            Some((path, snap)) => (path, Some(snap)),
            None => (text, None),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (pool, namespace, image) = match parts.as_slice() {
            [_] => return Err(RbdImageError::NoPool(text.to_owned())),
            [pool, image] => (*pool, "", *image),
            [pool, namespace, image] => (*pool, *namespace, *image),
            _ => return Err(RbdImageError::TooManyParts { text: text.to_owned() }),
        };
        let check = |part: &'static str, name: &str, may_be_empty: bool| {
            if name.is_empty() && !may_be_empty {
                return Err(RbdImageError::Empty { text: text.to_owned(), part });
            }
            check_name(name).map_err(|problem| match problem {
                NameProblem::TooLong => {
                    RbdImageError::TooLong { text: text.to_owned(), part, name: name.to_owned() }
                }
                NameProblem::Bad(bad) => RbdImageError::BadCharacter {
                    text: text.to_owned(),
                    part,
                    name: name.to_owned(),
                    bad,
                },
            })
        };
        check("pool", pool, false)?;
        check("namespace", namespace, parts.len() == 2)?;
        check("image", image, false)?;
        if let Some(snap) = snapshot {
            check("snapshot", snap, false)?;
        }
        Ok(RbdImage {
            pool: pool.to_owned(),
            namespace: namespace.to_owned(),
            image: image.to_owned(),
            snapshot: snapshot.map(str::to_owned),
        })
    }

    /// The same image, without a snapshot: what two devices must not both write.
    pub fn without_snapshot(&self) -> RbdImage {
        RbdImage { snapshot: None, ..self.clone() }
    }
}

impl fmt::Display for RbdImage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.pool)?;
        if !self.namespace.is_empty() {
            write!(f, "/{}", self.namespace)?;
        }
        write!(f, "/{}", self.image)?;
        if let Some(snap) = &self.snapshot {
            write!(f, "@{snap}")?;
        }
        Ok(())
    }
}

enum NameProblem {
    TooLong,
    Bad(char),
}

/// Ceph names are freer than this, but a name that reaches a Ceph option, a log line
/// and `ublkctl status` is kept to what needs no quoting anywhere.
fn check_name(name: &str) -> Result<(), NameProblem> {
    if name.len() > MAX_RBD_NAME_BYTES {
        return Err(NameProblem::TooLong);
    }
    match name.chars().find(|c| !(c.is_ascii_alphanumeric() || "._-+".contains(*c))) {
        Some(bad) => Err(NameProblem::Bad(bad)),
        None => Ok(()),
    }
}

/// A cephx id (`client.ID` without `client.`), as `--id` takes it in Ceph's tools.
pub fn check_ceph_id(id: &str) -> Result<(), String> {
    if let Some(rest) = id.strip_prefix("client.") {
        return Err(format!(
            "{id:?}: give the id without \"client.\" (ceph_id = \"{rest}\"), as Ceph's --id \
             takes it"
        ));
    }
    if id.is_empty() {
        return Err("empty; expected a cephx id such as \"ublkd\"".into());
    }
    check_name(id).map_err(|problem| match problem {
        NameProblem::TooLong => format!("{id:?} is longer than {MAX_RBD_NAME_BYTES} bytes"),
        NameProblem::Bad(bad) => {
            format!("{id:?} holds {bad:?}; ids are letters, digits and . _ - + only")
        }
    })
}

/// An `rbd` device's image and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RbdSpec {
    pub image: RbdImage,
    /// The Ceph config file (the monitors' addresses, the keyring's path, client
    /// options); `None`: [`DEFAULT_CEPH_CONF`].
    pub ceph_conf: Option<PathBuf>,
    /// The cephx id; `None`: [`DEFAULT_CEPH_ID`].
    pub ceph_id: Option<String>,
    /// The keyring holding the id's key; `None`: what the config file says, else
    /// Ceph's default places (`/etc/ceph/ceph.client.ID.keyring`, ...).
    pub keyring: Option<PathBuf>,
    /// Serve the image writable even without the exclusive-lock feature (`allow_unfenced
    /// = true`): without it a dead worker cannot be fenced, so a write it still had in
    /// flight may land after its successor's. Off: such a device is refused, naming the
    /// `rbd feature enable` command. Default for records written before it existed.
    #[serde(default)]
    pub allow_unfenced: bool,
}

impl RbdSpec {
    pub fn ceph_conf(&self) -> PathBuf {
        self.ceph_conf.clone().unwrap_or_else(|| DEFAULT_CEPH_CONF.into())
    }

    pub fn ceph_id(&self) -> &str {
        self.ceph_id.as_deref().unwrap_or(DEFAULT_CEPH_ID)
    }

    /// Whether the device connects as `client.admin`, whose key can do anything in the
    /// cluster: least privilege is a dedicated client with `profile rbd` caps.
    pub fn uses_admin(&self) -> bool {
        self.ceph_id() == ADMIN_CEPH_ID
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_as_ceph_tools_write_them() {
        let img = RbdImage::parse("rbd/disk").unwrap();
        assert_eq!(
            (img.pool.as_str(), img.namespace.as_str(), img.image.as_str()),
            ("rbd", "", "disk")
        );
        assert_eq!(img.snapshot, None);
        let img = RbdImage::parse("pool/ns/disk@snap1").unwrap();
        assert_eq!(img.namespace, "ns");
        assert_eq!(img.snapshot.as_deref(), Some("snap1"));
        assert_eq!(img.to_string(), "pool/ns/disk@snap1");
        assert_eq!(img.without_snapshot().to_string(), "pool/ns/disk");
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (text, says) in [
            ("disk", "names no pool"),
            ("/disk", "empty pool"),
            ("rbd/", "empty image"),
            ("rbd//disk", "empty namespace"),
            ("rbd/disk@", "empty snapshot"),
            ("a/b/c/d", "too many parts"),
            ("rbd/dis k", "holds ' '"),
            ("rbd/disk@a\"b", "holds '\"'"),
        ] {
            let err = RbdImage::parse(text).unwrap_err().to_string();
            assert!(err.contains(says), "{text}: {err}");
        }
        let long = format!("rbd/{}", "x".repeat(MAX_RBD_NAME_BYTES + 1));
        assert!(RbdImage::parse(&long).unwrap_err().to_string().contains("longer than"));
    }

    #[test]
    fn the_default_client_is_a_dedicated_one_and_admin_is_flagged() {
        let mut spec = RbdSpec {
            image: RbdImage::parse("rbd/d").unwrap(),
            ceph_conf: None,
            ceph_id: None,
            keyring: None,
            allow_unfenced: false,
        };
        assert_eq!((spec.ceph_id(), spec.uses_admin()), ("ublkd", false));
        spec.ceph_id = Some("admin".into());
        assert!(spec.uses_admin());
    }

    #[test]
    fn ceph_ids_are_given_without_client() {
        assert!(check_ceph_id("rbdtest").is_ok());
        assert!(check_ceph_id("client.rbdtest").unwrap_err().contains("without \"client.\""));
        assert!(check_ceph_id("").is_err());
        assert!(check_ceph_id("a b").unwrap_err().contains("holds ' '"));
    }
}
