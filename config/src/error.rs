//! Why a config file was refused: [`ConfigError`] and the [`Location`] it points at.
//! Every message starts with the file name and, where the key is in the file, ends
//! with its line and column.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// A position in the config file, both counted from 1 (column in characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Location {
    /// Line, from 1.
    pub line: usize,
    /// Column in characters, from 1.
    pub column: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}, column {}", self.line, self.column)
    }
}

/// Why a config file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read (missing, unreadable, not UTF-8).
    #[error("{}: cannot read the config file", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The text is not TOML.
    #[error("{origin}: not valid TOML: {message} ({location})")]
    Syntax {
        /// The file name, as given to [`Config::parse`](crate::Config::parse).
        origin: String,
        /// What is wrong.
        message: String,
        /// Where.
        location: Location,
    },
    /// A key is unknown, missing, of the wrong type, or its value breaks a rule.
    #[error("{origin}: {}{problem}{}", key_prefix(key), at(location))]
    Invalid {
        /// The file name, as given to [`Config::parse`](crate::Config::parse).
        origin: String,
        /// The key path, such as `device[2].queue_depth`; empty for the whole file.
        key: String,
        /// What is wrong and what would be right.
        problem: String,
        /// Where the key is, when it is in the file (an inherited default is not).
        location: Option<Location>,
    },
}

fn key_prefix(key: &str) -> String {
    if key.is_empty() { String::new() } else { format!("{key}: ") }
}

fn at(location: &Option<Location>) -> String {
    location.map_or_else(String::new, |location| format!(" ({location})"))
}

impl ConfigError {
    /// The key path the error is about (`device[2].queue_depth`), if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Invalid { key, .. } if !key.is_empty() => Some(key),
            _ => None,
        }
    }
}
