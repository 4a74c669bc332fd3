//! Learning an image's size and whether it may be written before its device is made,
//! without linking librbd into ublkd: the worker binary, started as
//! `ublkd-worker --probe-rbd`, connects and opens the image as a worker would, and
//! answers one line of JSON ([`RbdProbeAnswer`]). The setup, key included, goes to it
//! on a pipe. Run on a thread of its own (an add's), never on ublkd's loop.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ublkd_proto::msg::rbd::{RbdProbe, RbdProbeAnswer, RbdSetup, Unfenced, check_fenced};

/// The most bytes of answer read from the probe.
const MAX_ANSWER_BYTES: u64 = 64 << 10;

/// How much longer than its connect timeout the probe may take in all (opening the
/// image, the process's start and end).
const PROBE_SLACK: Duration = Duration::from_secs(10);

/// Why the image could not be probed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot start {} --probe-rbd: {source}", binary.display())]
    Start { binary: std::path::PathBuf, source: std::io::Error },
    #[error("{0}")]
    Refused(String),
    #[error("the probe of the image did not answer within {} s", .0.as_secs())]
    Timeout(Duration),
    #[error("the probe of the image gave no answer ({0})")]
    NoAnswer(String),
    #[error("the image's size {size} bytes is not a whole number of {block_size}-byte blocks")]
    Unaligned { size: u64, block_size: u32 },
    #[error("the image is empty (0 bytes); resize it with `rbd resize`")]
    Empty,
    #[error(transparent)]
    Unfenced(#[from] Unfenced),
}

/// Probes `setup`'s image with `worker_binary`; the image's facts, checked (they come
/// from another process): its size is a positive multiple of `block_size`, and a
/// writable device (not `device_read_only`) can be fenced ([`check_fenced`]), so that
/// `add` fails with the reason before any device or worker is made.
pub fn probe_image(
    worker_binary: &Path,
    setup: &RbdSetup,
    block_size: u32,
    device_read_only: bool,
) -> Result<RbdProbe, ProbeError> {
    let mut child = Command::new(worker_binary)
        .arg("--probe-rbd")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|source| ProbeError::Start { binary: worker_binary.to_path_buf(), source })?;
    let json = serde_json::to_vec(setup).expect("plain data always serializes");
    if let Some(mut stdin) = child.stdin.take() {
        // A probe that died at once is reported by its missing answer below.
        let _ = stdin.write_all(&json);
    }
    let limit = Duration::from_secs(setup.connect_timeout_secs.into()) + PROBE_SLACK;
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(ProbeError::Timeout(limit));
            }
            Err(e) => return Err(ProbeError::NoAnswer(e.to_string())),
        }
    };
    let mut text = String::new();
    if let Some(stdout) = child.stdout.take() {
        let _ = stdout.take(MAX_ANSWER_BYTES).read_to_string(&mut text);
    }
    let answer: RbdProbeAnswer = serde_json::from_str(text.trim()).map_err(|e| {
        ProbeError::NoAnswer(format!("it exited with {status} and said {:?}: {e}", shorten(&text)))
    })?;
    let probe =
        answer.map_err(|why| ProbeError::Refused(ublkd_proto::msg::untrusted_text(&why)))?;
    let probe = check(probe, block_size)?;
    check_fenced(&setup.image_spec(), &probe, device_read_only, setup.allow_unfenced)?;
    Ok(probe)
}

fn shorten(text: &str) -> String {
    ublkd_proto::msg::untrusted_text(text.trim())
}

/// The probe's answer, if a device can be made of it.
fn check(probe: RbdProbe, block_size: u32) -> Result<RbdProbe, ProbeError> {
    if probe.size_bytes == 0 {
        return Err(ProbeError::Empty);
    }
    if !probe.size_bytes.is_multiple_of(u64::from(block_size)) {
        return Err(ProbeError::Unaligned { size: probe.size_bytes, block_size });
    }
    Ok(probe)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(size_bytes: u64) -> RbdProbe {
        RbdProbe { size_bytes, object_size: 4 << 20, read_only: false, exclusive_lock: true }
    }

    #[test]
    fn an_answer_is_checked_before_a_device_is_made_of_it() {
        assert!(check(probe(1 << 30), 4096).is_ok());
        assert!(matches!(check(probe(0), 4096), Err(ProbeError::Empty)));
        let err = check(probe((1 << 30) + 512), 4096).unwrap_err().to_string();
        assert!(err.contains("not a whole number of 4096-byte blocks"), "{err}");
    }

    /// A fake probe: a shell script standing in for the worker binary.
    fn fake(name: &str, body: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("ublkd-probe-{}-{name}", std::process::id()));
        std::fs::write(&path, format!("#!/bin/sh\ncat >/dev/null\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        path
    }

    fn setup(timeout: u32) -> RbdSetup {
        RbdSetup {
            pool: "rbd".into(),
            namespace: String::new(),
            image: "disk".into(),
            snapshot: None,
            client_id: "admin".into(),
            options: vec![("key".into(), "secret".into())],
            connect_timeout_secs: timeout,
            allow_unfenced: false,
        }
    }

    #[test]
    fn the_probes_answer_or_refusal_or_silence_is_what_the_add_reports() {
        let ok = fake(
            "ok",
            r#"echo '{"Ok":{"size_bytes":1073741824,"object_size":4194304,"read_only":false,"exclusive_lock":true}}'"#,
        );
        assert_eq!(probe_image(&ok, &setup(5), 4096, false).unwrap().size_bytes, 1 << 30);
        let refused = fake("refused", r#"echo '{"Err":"image rbd/disk does not exist"}'"#);
        let err = probe_image(&refused, &setup(5), 4096, false).unwrap_err().to_string();
        assert_eq!(err, "image rbd/disk does not exist");
        let garbage = fake("garbage", "echo hello; exit 3");
        let err = probe_image(&garbage, &setup(5), 4096, false).unwrap_err().to_string();
        assert!(err.contains("gave no answer") && err.contains("hello"), "{err}");
    }

    #[test]
    fn a_writable_device_on_an_image_without_exclusive_lock_is_refused_unless_allowed() {
        let unlocked = fake(
            "unlocked",
            r#"echo '{"Ok":{"size_bytes":1073741824,"object_size":4194304,"read_only":false,"exclusive_lock":false}}'"#,
        );
        let err = probe_image(&unlocked, &setup(5), 4096, false).unwrap_err().to_string();
        assert!(err.contains("`rbd feature enable rbd/disk exclusive-lock`"), "{err}");
        assert!(probe_image(&unlocked, &setup(5), 4096, true).is_ok(), "a read-only device");
        let allowed = RbdSetup { allow_unfenced: true, ..setup(5) };
        assert!(probe_image(&unlocked, &allowed, 4096, false).is_ok(), "allow_unfenced");
    }
}
