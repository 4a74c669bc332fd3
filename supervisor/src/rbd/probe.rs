//! Learning an image's size and whether it may be written before its device is made,
//! without linking librbd into ublkd: the worker binary, started as
//! `ublkd-worker --probe-rbd`, connects and opens the image as a worker would, and
//! answers one line of JSON ([`RbdProbeAnswer`]). The setup, key included, goes to it
//! on a pipe. Run on a thread of its own (an add's), never on ublkd's loop.
//!
//! The probe runs Ceph's code, so it is started as the device's workers are
//! ([`crate::worker::spawn`]): sandboxed (the device's `sandbox` and
//! `sandbox_optional`, the worker user, the cluster's TCP ports) as the first process of
//! a pid namespace of its own, its stderr into the workers' log relay
//! ([`crate::worker_log`]), never into ublkd's. Running it in the device's standby
//! worker instead would mean starting that worker, with its region and rings, before
//! the device's size is known, and taking it down again on every refused add; a short
//! process under the same sandbox is the smaller change, and what it runs is the same.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use ublkd_proto::msg::rbd::{RbdProbe, RbdProbeAnswer, RbdSetup, Unfenced, check_fenced};
use ublkd_proto::msg::{LayerSet, SandboxLayer};

use crate::worker::WorkerIdentity;
use crate::worker::spawn::{SpawnError, SpawnSpec, spawn};

/// Who a sandboxed probe runs as: the workers' user, set once at ublkd's start.
static WORKER_IDENTITY: OnceLock<WorkerIdentity> = OnceLock::new();

/// Sets who sandboxed probes run as (ublkd's start, with the workers' user).
pub fn set_worker_identity(identity: WorkerIdentity) {
    let _ = WORKER_IDENTITY.set(identity);
}

/// The most bytes of answer read from the probe.
const MAX_ANSWER_BYTES: u64 = 64 << 10;

/// How much longer than its connect timeout the probe may take in all (opening the
/// image, the process's start and end).
const PROBE_SLACK: Duration = Duration::from_secs(10);

/// Why the image could not be probed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot start {} --probe-rbd: {source}", binary.display())]
    Start { binary: std::path::PathBuf, source: SpawnError },
    #[error("cannot make the probe's pipes: {0}")]
    Pipe(nix::Error),
    #[error("the probe's sandbox has no worker user (ublkd sets it at its start)")]
    NoWorkerUser,
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

/// Probes `setup`'s image with `worker_binary`, sandboxed unless `sandbox` is `None`
/// (else the layers it may run without; `dev_id` names it in the log); the image's
/// facts, checked (they come from another process): its size is a positive multiple of
/// `block_size`, and a writable device (not `device_read_only`) can be fenced
/// ([`check_fenced`]), so that `add` fails with the reason before any device or worker
/// is made.
pub fn probe_image(
    worker_binary: &Path,
    setup: &RbdSetup,
    block_size: u32,
    device_read_only: bool,
    sandbox: Option<LayerSet>,
    dev_id: u32,
) -> Result<RbdProbe, ProbeError> {
    let ports = crate::rbd::conf::connect_ports(&setup.options);
    let args = probe_args(sandbox, &ports, WORKER_IDENTITY.get().copied())?;
    let pipe = || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(ProbeError::Pipe);
    let (stdin_read, stdin_write) = pipe()?;
    let (stdout_read, stdout_write) = pipe()?;
    let relay = crate::worker_log::Relay::get();
    let stderr = match relay {
        Some(_) => Some(pipe()?),
        None => None,
    };
    let mut fds = vec![(stdin_read.as_fd(), 0), (stdout_write.as_fd(), 1)];
    if let Some((_, write)) = &stderr {
        fds.push((write.as_fd(), 2));
    }
    let spec = SpawnSpec {
        binary: worker_binary,
        args,
        fds,
        nofile: crate::rlimit::inherited_nofile()
            .map(|(soft, hard)| libc::rlimit { rlim_cur: soft, rlim_max: hard }),
        new_pid_namespace: sandbox.is_some(),
    };
    let start_err = |source| ProbeError::Start { binary: worker_binary.to_path_buf(), source };
    let spawned = match spawn(&spec) {
        // As for a worker: without its pid namespace only where the device allows
        // running without the namespaces layer.
        Err(SpawnError::Clone(e))
            if sandbox.is_some_and(|s| s.contains(SandboxLayer::Namespaces)) =>
        {
            tracing::warn!(dev_id, "the rbd probe runs without its pid namespace: {e}");
            spawn(&SpawnSpec { new_pid_namespace: false, ..spec })
        }
        other => other,
    }
    .map_err(start_err)?;
    let (mut child, pidfd) = (spawned.child, spawned.pidfd);
    // Only the probe's ends stay open in it: its output ends when it does.
    drop((stdin_read, stdout_write));
    if let (Some(relay), Some((read, write))) = (relay, stderr) {
        drop(write);
        relay.watch(read, dev_id, child.id());
    }
    let json = serde_json::to_vec(setup).expect("plain data always serializes");
    // A probe that died at once is reported by its missing answer below.
    let _ = std::fs::File::from(stdin_write).write_all(&json);
    let limit = Duration::from_secs(setup.connect_timeout_secs.into()) + PROBE_SLACK;
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            // The first process of its pid namespace: SIGKILL from here still ends it,
            // and everything it started with it. Never left running unwatched.
            Ok(None) => {
                let _ = crate::sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
                let _ = child.wait();
                return Err(ProbeError::Timeout(limit));
            }
            Err(e) => {
                let _ = crate::sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
                let _ = child.wait();
                return Err(ProbeError::NoAnswer(e.to_string()));
            }
        }
    };
    let text = read_answer(stdout_read);
    let answer: RbdProbeAnswer = serde_json::from_str(text.trim()).map_err(|e| {
        ProbeError::NoAnswer(format!("it exited with {status} and said {:?}: {e}", shorten(&text)))
    })?;
    let probe =
        answer.map_err(|why| ProbeError::Refused(ublkd_proto::msg::untrusted_text(&why)))?;
    let probe = check(probe, block_size)?;
    check_fenced(&setup.image_spec(), &probe, device_read_only, setup.allow_unfenced)?;
    Ok(probe)
}

/// The probe's command line: `--probe-rbd`, the cluster's ports, and its sandbox as a
/// worker's (`sandbox`: the layers it may run without) or `--no-sandbox`.
fn probe_args(
    sandbox: Option<LayerSet>,
    ports: &str,
    identity: Option<WorkerIdentity>,
) -> Result<Vec<String>, ProbeError> {
    let mut args: Vec<String> =
        vec!["--probe-rbd".into(), "--rbd-connect-ports".into(), ports.into()];
    match sandbox {
        Some(optional) => {
            let id = identity.ok_or(ProbeError::NoWorkerUser)?;
            args.extend(["--sandbox-uid".into(), id.uid.to_string()]);
            args.extend(["--sandbox-gid".into(), id.gid.to_string()]);
            if !optional.is_empty() {
                args.push("--sandbox-optional".into());
                args.push(SandboxLayer::join(&optional.layers()));
            }
        }
        None => args.push("--no-sandbox".into()),
    }
    Ok(args)
}

/// At most [`MAX_ANSWER_BYTES`] of what the (exited) probe wrote.
fn read_answer(stdout: OwnedFd) -> String {
    let mut bytes = Vec::new();
    let _ = std::fs::File::from(stdout).take(MAX_ANSWER_BYTES).read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).into_owned()
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
        assert_eq!(probe_image(&ok, &setup(5), 4096, false, None, 0).unwrap().size_bytes, 1 << 30);
        let refused = fake("refused", r#"echo '{"Err":"image rbd/disk does not exist"}'"#);
        let err = probe_image(&refused, &setup(5), 4096, false, None, 0).unwrap_err().to_string();
        assert_eq!(err, "image rbd/disk does not exist");
        let garbage = fake("garbage", "echo hello; exit 3");
        let err = probe_image(&garbage, &setup(5), 4096, false, None, 0).unwrap_err().to_string();
        assert!(err.contains("gave no answer") && err.contains("hello"), "{err}");
    }

    #[test]
    fn a_writable_device_on_an_image_without_exclusive_lock_is_refused_unless_allowed() {
        let unlocked = fake(
            "unlocked",
            r#"echo '{"Ok":{"size_bytes":1073741824,"object_size":4194304,"read_only":false,"exclusive_lock":false}}'"#,
        );
        let err = probe_image(&unlocked, &setup(5), 4096, false, None, 0).unwrap_err().to_string();
        assert!(err.contains("`rbd feature enable rbd/disk exclusive-lock`"), "{err}");
        assert!(
            probe_image(&unlocked, &setup(5), 4096, true, None, 0).is_ok(),
            "a read-only device"
        );
        let allowed = RbdSetup { allow_unfenced: true, ..setup(5) };
        assert!(probe_image(&unlocked, &allowed, 4096, false, None, 0).is_ok(), "allow_unfenced");
    }

    #[test]
    fn a_sandboxed_probe_is_started_as_a_worker_is() {
        let id = WorkerIdentity { uid: 65534, gid: 65534 };
        let optional = LayerSet::of(&[SandboxLayer::Landlock]);
        let args = probe_args(Some(optional), "3300,6800-7568", Some(id)).unwrap();
        assert_eq!(
            args.join(" "),
            "--probe-rbd --rbd-connect-ports 3300,6800-7568 --sandbox-uid 65534 \
             --sandbox-gid 65534 --sandbox-optional landlock"
        );
        let plain = probe_args(None, "3300", None).unwrap();
        assert_eq!(plain.last().map(String::as_str), Some("--no-sandbox"));
        let err = probe_args(Some(LayerSet::EMPTY), "3300", None).unwrap_err().to_string();
        assert!(err.contains("no worker user"), "{err}");
    }
}
