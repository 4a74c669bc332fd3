//! Where `ublkd`'s and `ublkctl`'s log goes: to the journal, with structured fields,
//! when systemd connected stderr to it; to stderr as text otherwise.
//!
//! systemd tells a service that its stderr is the journal with `JOURNAL_STREAM=DEV:INO`,
//! the device and inode of that stream; the variable is inherited, so it counts only
//! while stderr still is that very stream (`ublkd 2>log` run from a unit's shell is not
//! logging to the journal). Then each event goes to journald natively: `MESSAGE`, the
//! level as `PRIORITY`, and every field of the event as a journal field of its own, in
//! upper case without a prefix, so that
//!
//! ```sh
//! journalctl -u ublkd DEV_ID=3            # everything about device 3
//! journalctl -u ublkd EVENT=recovered     # every recovery
//! ```
//!
//! work. The supervisor's fields: `DEV_ID` (the kernel device id), `WORKER_PID`,
//! `EVENT` (a short name of what happened, on the events worth filtering for), plus
//! `STALL_MS`, `FILE`, `SOCKET` where they apply. (`TARGET` is the crate's: the Rust
//! module that logged; a device's target kind logged as `target` joins it there.)
//! Levels map to syslog priorities as syslog means them: error 3, warn 4, info 6,
//! debug and trace 7.
//!
//! The level: `UBLKD_LOG`, else `RUST_LOG` (both in `EnvFilter` syntax, e.g.
//! `ublkd=debug`), else `info`, `debug` or `trace` for no, one or more `-v`.

use std::io::IsTerminal;
use std::os::fd::{AsFd, BorrowedFd};

use tracing_journald::{Priority, PriorityMappings};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The variables that set the level, first match wins.
pub const LEVEL_VARS: [&str; 2] = ["UBLKD_LOG", "RUST_LOG"];

/// Where the log went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    /// journald, natively (structured fields).
    Journal,
    /// Text on stderr.
    Stderr,
}

/// Sets up logging for `program` (the journal's `SYSLOG_IDENTIFIER`) with `verbose`
/// `-v` flags; call once, first thing in `main`.
pub fn init(program: &str, verbose: u8) -> Sink {
    let filter = filter(verbose, |name| std::env::var(name).ok());
    let journal = stderr_is_journal(std::env::var("JOURNAL_STREAM").ok().as_deref())
        .then(tracing_journald::layer)
        .map(|layer| {
            layer.map(|l| {
                l.with_field_prefix(None)
                    .with_syslog_identifier(program.to_string())
                    .with_priority_mappings(priorities())
            })
        });
    match journal {
        Some(Ok(layer)) => {
            tracing_subscriber::registry().with(filter).with(layer).init();
            Sink::Journal
        }
        Some(Err(e)) => {
            init_stderr(filter);
            tracing::warn!(
                "stderr is the journal but journald's socket refused us ({e}); logging to stderr"
            );
            Sink::Stderr
        }
        None => {
            init_stderr(filter);
            Sink::Stderr
        }
    }
}

/// syslog's meaning of the levels: routine events (a device LIVE, a recovery) are
/// `info` (6), so that `journalctl -p notice` shows only what needs a look; the crate's
/// default would log them at `notice` (5).
fn priorities() -> PriorityMappings {
    PriorityMappings {
        error: Priority::Error,
        warn: Priority::Warning,
        info: Priority::Informational,
        debug: Priority::Debug,
        trace: Priority::Debug,
    }
}

fn init_stderr(filter: EnvFilter) {
    let stderr = std::io::stderr();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(stderr.is_terminal())
        .with_env_filter(filter)
        .init();
}

/// The filter from the first of [`LEVEL_VARS`] that is set and valid, else from
/// `verbose`. `var` reads a variable (the environment, or a test's table).
fn filter(verbose: u8, var: impl Fn(&str) -> Option<String>) -> EnvFilter {
    for name in LEVEL_VARS {
        if let Some(value) = var(name).filter(|v| !v.is_empty()) {
            match EnvFilter::try_new(&value) {
                Ok(f) => return f,
                Err(e) => eprintln!("ignoring {name}={value:?}: {e}"),
            }
        }
    }
    EnvFilter::new(match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    })
}

/// Whether stderr is the journal stream systemd announced in `journal_stream` (the
/// value of `JOURNAL_STREAM`).
pub fn stderr_is_journal(journal_stream: Option<&str>) -> bool {
    journal_stream.is_some_and(|v| is_stream(v, std::io::stderr().as_fd()))
}

/// Whether `fd` is the `DEV:INO` stream (both decimal, as systemd writes them).
fn is_stream(journal_stream: &str, fd: BorrowedFd<'_>) -> bool {
    let Some((dev, ino)) = journal_stream.split_once(':') else { return false };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else { return false };
    nix::sys::stat::fstat(fd).is_ok_and(|st| st.st_dev == dev && st.st_ino == ino)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn stream_of(file: &std::fs::File) -> String {
        let st = nix::sys::stat::fstat(file.as_fd()).unwrap();
        format!("{}:{}", st.st_dev, st.st_ino)
    }

    #[test]
    fn the_announced_stream_is_recognised_and_only_it() {
        let dir = std::env::temp_dir();
        let a = tempfile_in(&dir, "a");
        let b = tempfile_in(&dir, "b");
        assert!(is_stream(&stream_of(&a), a.as_fd()));
        assert!(!is_stream(&stream_of(&a), b.as_fd()), "another file is not the journal");
        for bad in ["", "1", "x:y", "1:", ":2", "-1:2"] {
            assert!(!is_stream(bad, a.as_fd()), "{bad:?} is not a stream");
        }
    }

    fn tempfile_in(dir: &std::path::Path, tag: &str) -> std::fs::File {
        let path = dir.join(format!("ublkd-logging-test-{}-{tag}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    fn ublkd_log_wins_over_rust_log_which_wins_over_verbose() {
        let env = |pairs: &[(&str, &str)]| {
            let map: HashMap<String, String> =
                pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            move |name: &str| map.get(name).cloned()
        };
        let both = env(&[("UBLKD_LOG", "warn"), ("RUST_LOG", "trace")]);
        assert_eq!(filter(2, both).to_string(), "warn");
        let rust_only = env(&[("RUST_LOG", "ublkd=debug")]);
        assert_eq!(filter(0, rust_only).to_string(), "ublkd=debug");
        assert_eq!(filter(0, env(&[])).to_string(), "info");
        assert_eq!(filter(1, env(&[])).to_string(), "debug");
        assert_eq!(filter(5, env(&[("UBLKD_LOG", "")])).to_string(), "trace");
    }
}
