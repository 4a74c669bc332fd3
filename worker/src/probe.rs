//! `ublkd-worker --probe-rbd`: opens the RBD image an [`RbdSetup`] (JSON, on standard
//! input) names, exactly as an rbd worker does, and answers what ublkd needs to make
//! its device: one line of JSON, an [`RbdProbeAnswer`], on standard output. A cluster
//! or image that cannot be opened is an answer too (`{"Err": "…"}`, one line naming
//! what was wrong); only input that is no setup exits non-zero. ublkd runs it on a
//! thread of its own with a deadline, since a cluster may take its time to answer.
//!
//! The probe runs librados and librbd, which parse what the cluster sends, so it is
//! sandboxed as an rbd worker is ([`crate::sandbox`], profile `Rbd`): ublkd starts it
//! with the same `--sandbox-uid`/`--sandbox-gid`/`--sandbox-optional` and
//! `--rbd-connect-ports` as the device's workers, in a pid namespace of its own, its
//! stderr into the workers' log relay. It loads librbd, applies steps 1–10 (keeping
//! stdin, stdout and stderr), and only then reads the setup (the key among it) and
//! connects. It never stands by, so seccomp's stage 2 is never needed: it exits once it
//! has answered.

use std::io::{Read, Write};
use std::process::ExitCode;

use ublkd_proto::exit::WorkerExit;
use ublkd_proto::msg::rbd::{MAX_NAME_BYTES, RbdProbeAnswer, RbdSetup};

use crate::sandbox::Profile;

use crate::target::rbd::image::RbdImage;

/// The most standard input read: a setup is names and a few options.
const MAX_INPUT_BYTES: u64 = 64 << 10;

/// Sandboxes itself as `args` say, reads the setup, opens the image, answers, closes it.
pub fn run(args: &[String]) -> ExitCode {
    let sandbox = match crate::sandbox_identity(args) {
        Ok(identity) => identity,
        Err(e) => {
            eprintln!("ublkd-worker --probe-rbd: {e}");
            return ExitCode::from(WorkerExit::Protocol);
        }
    };
    let connect_ports = match crate::connect_ports(args) {
        Ok(ports) => ports,
        Err(e) => {
            eprintln!("ublkd-worker --probe-rbd: --rbd-connect-ports: {e}");
            return ExitCode::from(WorkerExit::Protocol);
        }
    };
    if let Some((identity, optional)) = sandbox {
        // librbd must be in memory before the sandbox empties the filesystem; a failure
        // is kept and answered when the image is opened.
        let _ = crate::target::rbd::ffi::preload();
        crate::bound_malloc_arenas();
        // Standard input, output and error are all the probe keeps (fd 2 and below).
        match crate::sandbox::apply(identity, &optional, 2, Profile::Rbd, &connect_ports) {
            Ok(report) => {
                for missing in &report.missing {
                    tracing::warn!(
                        "the probe runs without the sandbox layer {}: {}",
                        missing.layer,
                        missing.cause
                    );
                }
            }
            // Answered, so that the add names why: no Ceph code runs unsandboxed.
            Err(e) => return answer(&Err(format!("the probe's sandbox: {e}"))),
        }
    }
    crate::hooks::on_probe_sandboxed();
    let setup = match read_setup(std::io::stdin().lock()) {
        Ok(setup) => setup,
        Err(e) => {
            eprintln!("ublkd-worker --probe-rbd: {e}");
            return ExitCode::from(WorkerExit::Protocol);
        }
    };
    let answer = probe(&setup);
    if let Err(e) = &answer {
        tracing::debug!("probe of {}: {e}", setup.image_spec());
    }
    self::answer(&answer)
}

/// Writes `answer` as one line on standard output and exits at once.
fn answer(answer: &RbdProbeAnswer) -> ExitCode {
    let mut line = serde_json::to_string(answer).expect("an answer always serializes");
    line.push('\n');
    let mut out = std::io::stdout().lock();
    let code = match out.write_all(line.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => 0,
        Err(_) => WorkerExit::Orphaned.code(),
    };
    // librados's threads may outlive the image's close: no C++ destructor may run
    // under them (see `crate::sys::exit_now`). The answer is flushed above.
    crate::sys::exit_now(i32::from(code))
}

/// Why standard input holds no setup.
#[derive(Debug, thiserror::Error)]
enum InputError {
    #[error("cannot read the setup from standard input: {0}")]
    Read(std::io::Error),
    #[error("standard input is not an RbdSetup in JSON: {0}")]
    Json(serde_json::Error),
    #[error("the setup's {what} is longer than {MAX_NAME_BYTES} bytes")]
    TooLong { what: &'static str },
}

fn read_setup(input: impl Read) -> Result<RbdSetup, InputError> {
    let mut text = String::new();
    input.take(MAX_INPUT_BYTES).read_to_string(&mut text).map_err(InputError::Read)?;
    let setup: RbdSetup = serde_json::from_str(&text).map_err(InputError::Json)?;
    let names = [
        ("pool", &setup.pool),
        ("namespace", &setup.namespace),
        ("image", &setup.image),
        ("client id", &setup.client_id),
    ];
    let snapshot = setup.snapshot.iter().map(|s| ("snapshot", s));
    if let Some((what, _)) =
        names.into_iter().chain(snapshot).find(|(_, n)| n.len() > MAX_NAME_BYTES)
    {
        return Err(InputError::TooLong { what });
    }
    Ok(setup)
}

/// Opens the image as the target would and says what it is; closes it again.
fn probe(setup: &RbdSetup) -> RbdProbeAnswer {
    let image = RbdImage::open(setup).map_err(|e| e.to_string())?;
    image.describe().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETUP: &str = r#"{"pool":"rbd","namespace":"","image":"x","snapshot":null,
        "client_id":"ublkd","options":[["mon_host","127.0.0.1:1"]],"connect_timeout_secs":3}"#;

    #[test]
    fn a_json_setup_is_read() {
        let setup = read_setup(SETUP.as_bytes()).unwrap();
        assert_eq!((setup.image_spec(), setup.connect_timeout_secs), ("rbd/x".into(), 3));
        assert_eq!(setup.options, vec![("mon_host".into(), "127.0.0.1:1".into())]);
    }

    #[test]
    fn anything_else_is_refused() {
        for input in ["", "{}", "not json", r#"{"pool":"rbd"}"#] {
            assert!(read_setup(input.as_bytes()).is_err(), "{input:?}");
        }
        let long = SETUP.replace(r#""image":"x""#, &format!(r#""image":"{}""#, "x".repeat(300)));
        assert!(matches!(read_setup(long.as_bytes()), Err(InputError::TooLong { what: "image" })));
    }

    #[test]
    fn an_answer_is_one_line_of_json() {
        let answer: RbdProbeAnswer = Err("image rbd/x does not exist".into());
        let line = serde_json::to_string(&answer).unwrap();
        assert_eq!(line, r#"{"Err":"image rbd/x does not exist"}"#);
        let back: RbdProbeAnswer = serde_json::from_str(&line).unwrap();
        assert_eq!(back, answer);
    }
}
