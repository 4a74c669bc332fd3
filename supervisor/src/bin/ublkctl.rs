//! `ublkctl`: the operator's CLI for ublkd.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ublkd_proto::ctrl::{CtrlClient, CtrlError};
use ublkd_proto::msg::{self, AddRequest, CtlRequest, CtlResponse, DataPath, RbdAdd, TargetKind};
use ublkd_supervisor::cli::{DevRef, Target, UblkctlCli, UblkctlCommand as Command};
use ublkd_supervisor::metrics::{self, Format};
use ublkd_supervisor::{exit, features, logging, render};

fn main() -> ExitCode {
    // Like any CLI, end quietly when the reader of our output goes away (`| head`).
    // SAFETY: restoring the default action of SIGPIPE before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = UblkctlCli::parse();
    logging::init("ublkctl", cli.verbose);
    let request = match cli.command {
        Command::Features { json } => return cmd_features(json),
        Command::Add {
            target,
            file,
            uri,
            image,
            ceph_conf,
            ceph_id,
            keyring,
            size,
            queues,
            depth,
            threads,
            zero_copy,
            copy,
            no_sandbox,
            sandbox_optional,
            id,
            name,
            read_only,
            partitions,
        } => {
            let [file, ceph_conf, keyring] =
                match [file, ceph_conf, keyring].map(|f| f.map(|f| absolute(&f)).transpose()) {
                    [Ok(file), Ok(conf), Ok(keyring)] => [file, conf, keyring],
                    [Err(e), ..] | [_, Err(e), _] | [.., Err(e)] => {
                        return fail(exit::FAILURE, &e);
                    }
                };
            let any_rbd =
                image.is_some() || ceph_conf.is_some() || ceph_id.is_some() || keyring.is_some();
            let rbd = any_rbd.then_some(RbdAdd { image, ceph_conf, ceph_id, keyring });
            CtlRequest::Add(AddRequest {
                id,
                target: match target {
                    Target::Null => TargetKind::Null,
                    Target::Memory => TargetKind::Memory,
                    Target::Loop => TargetKind::Loop,
                    Target::Nbd => TargetKind::Nbd,
                    Target::Rbd => TargetKind::Rbd,
                },
                file,
                uri,
                size,
                queues,
                queue_depth: depth,
                threads,
                zero_copy: if zero_copy { Some(true) } else { copy.then_some(false) },
                sandbox: no_sandbox.then_some(false),
                sandbox_optional: sandbox_optional.map(|l| l.0),
                rbd,
                name,
                read_only,
                partitions,
            })
        }
        // Unforced, the request old daemons know (which delete regardless).
        Command::Del { id, all: _, force } => {
            let id = match resolve_opt(&cli.socket, id) {
                Ok(id) => id,
                Err(code) => return code,
            };
            if force { CtlRequest::DelForce { id } } else { CtlRequest::Del { id } }
        }
        Command::Recover { id, id_flag } => {
            match resolve(&cli.socket, id.or(id_flag).expect("clap requires one")) {
                Ok(id) => CtlRequest::Recover { id },
                Err(code) => return code,
            }
        }
        Command::List { id } => match resolve_opt(&cli.socket, id) {
            Ok(id) => CtlRequest::List { id },
            Err(code) => return code,
        },
        Command::Resize { id, size, allow_shrink } => match resolve(&cli.socket, id) {
            Ok(id) => CtlRequest::Resize { id, size_bytes: size, allow_shrink },
            Err(code) => return code,
        },
        Command::Upgrade { id, all: _ } => match resolve_opt(&cli.socket, id) {
            Ok(id) => return cmd_upgrade(&cli.socket, id),
            Err(code) => return code,
        },
        Command::Shutdown { force } => {
            let request = if force { CtlRequest::ShutdownForce } else { CtlRequest::Shutdown };
            return match call(&cli.socket, &request) {
                Ok(CtlResponse::Deleted { ids }) => {
                    for id in ids {
                        eprintln!("deleted device {id}");
                    }
                    wait_for_exit(&cli.socket)
                }
                Ok(other) => unexpected(other),
                Err(code) => code,
            };
        }
        Command::Metrics { id } => {
            let id = match resolve_opt(&cli.socket, id) {
                Ok(id) => id,
                Err(code) => return code,
            };
            return match call(&cli.socket, &CtlRequest::Metrics { id }) {
                Ok(CtlResponse::Metrics(devs)) => {
                    print!("{}", metrics::render(&devs, Format::OpenMetrics));
                    ExitCode::SUCCESS
                }
                Ok(other) => unexpected(other),
                Err(code) => code,
            };
        }
        Command::Status { id, json } => {
            let id = match resolve_opt(&cli.socket, id) {
                Ok(id) => id,
                Err(code) => return code,
            };
            return match call(&cli.socket, &CtlRequest::Status { id }) {
                Ok(CtlResponse::Status(devs)) => {
                    if json {
                        println!("{}", render::status_json(&devs));
                    } else {
                        print!("{}", render::status_text(&devs));
                    }
                    ExitCode::SUCCESS
                }
                Ok(other) => unexpected(other),
                Err(code) => code,
            };
        }
    };
    match call(&cli.socket, &request) {
        // The disk, which is what the operator uses next (`mkfs`, `mount`); scripts take
        // the id from its end.
        Ok(CtlResponse::Added { id }) => println!("/dev/ublkb{id}"),
        Ok(CtlResponse::Deleted { ids }) => {
            for id in ids {
                eprintln!("deleted device {id}");
            }
        }
        Ok(CtlResponse::List(devs)) => devs.iter().for_each(|d| print!("{}", render::listing(d))),
        Ok(CtlResponse::Recovered { message, .. } | CtlResponse::Resized { message, .. }) => {
            println!("{message}")
        }
        Ok(other) => return unexpected(other),
        Err(code) => return code,
    }
    ExitCode::SUCCESS
}

/// After `shutdown`: waits for ublkd to remove its socket, the last thing it does.
fn wait_for_exit(socket: &Path) -> ExitCode {
    const LIMIT: Duration = Duration::from_secs(30);
    let deadline = std::time::Instant::now() + LIMIT;
    while socket.exists() {
        if std::time::Instant::now() >= deadline {
            return fail(
                exit::FAILURE,
                &format!("ublkd deleted its devices but had not exited after {LIMIT:?}"),
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("ublkd stopped");
    ExitCode::SUCCESS
}

/// The daemon runs elsewhere: relative paths are made absolute here.
fn absolute(path: &Path) -> Result<PathBuf, String> {
    std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The id of the device `dev` names: an id as it is, a name looked up in ublkd's
/// status (one request more; names live in ublkd, which keeps them unique).
fn resolve(socket: &Path, dev: DevRef) -> Result<u32, ExitCode> {
    let name = match dev {
        DevRef::Id(id) => return Ok(id),
        DevRef::Name(name) => name,
    };
    match call(socket, &CtlRequest::Status { id: None })? {
        CtlResponse::Status(devs) => {
            if let Some(dev) = devs.iter().find(|d| d.name.as_deref() == Some(name.as_str())) {
                return Ok(dev.id);
            }
            let mut names: Vec<&str> = devs.iter().filter_map(|d| d.name.as_deref()).collect();
            names.sort_unstable();
            let known = if names.is_empty() {
                "ublkd has no named device".to_string()
            } else {
                format!("ublkd's names are {}", names.join(", "))
            };
            Err(fail(exit::FAILURE, &format!("no device is named {name:?}: {known}")))
        }
        other => Err(unexpected(other)),
    }
}

fn resolve_opt(socket: &Path, dev: Option<DevRef>) -> Result<Option<u32>, ExitCode> {
    dev.map(|dev| resolve(socket, dev)).transpose()
}

/// Sends one request and returns the response, or the exit code of a failure (after
/// printing it).
fn call(socket: &Path, req: &CtlRequest) -> Result<CtlResponse, ExitCode> {
    let mut stream = UnixStream::connect(socket).map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
                " (is ublkd running? start it with `ublkd` or `systemctl start ublkd`)"
            }
            std::io::ErrorKind::PermissionDenied => " (ublkctl needs root)",
            _ => "",
        };
        fail(exit::NO_DAEMON, &format!("cannot reach ublkd at {}: {e}{hint}", socket.display()))
    })?;
    // Adding a device waits for its worker to PREP every tag; allow for a slow machine.
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    msg::write_frame(&mut stream, req)
        .map_err(|e| fail(exit::FAILURE, &format!("sending the request: {e}")))?;
    match msg::read_response(&mut stream) {
        Ok(CtlResponse::Error { message }) => Err(fail(exit::FAILURE, &message)),
        Ok(resp) => Ok(resp),
        Err(e) => Err(fail(exit::FAILURE, &format!("reading ublkd's answer: {e}"))),
    }
}

/// `ublkctl upgrade`: device `id`, or every device one request at a time, each
/// outcome printed as it comes (an upgrade takes a worker's start per device: with many
/// devices, minutes, and between two requests ublkd tends the others).
fn cmd_upgrade(socket: &Path, id: Option<u32>) -> ExitCode {
    use std::io::Write;
    let ids = match id {
        Some(id) => vec![id],
        None => match call(socket, &CtlRequest::List { id: None }) {
            Ok(CtlResponse::List(devices)) => devices.iter().map(|d| d.id).collect(),
            Ok(other) => return unexpected(other),
            Err(code) => return code,
        },
    };
    let mut failed = 0;
    for id in ids {
        match call(socket, &CtlRequest::Upgrade { id: Some(id) }) {
            Ok(CtlResponse::Upgraded(outcomes)) => {
                for o in outcomes {
                    if o.upgraded {
                        println!("{}", o.message);
                        let _ = std::io::stdout().flush();
                    } else {
                        eprintln!("ublkctl: {}", o.message);
                        failed += 1;
                    }
                }
            }
            Ok(other) => return unexpected(other),
            Err(code) => return code,
        }
    }
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::from(exit::FAILURE as u8) }
}

fn unexpected(resp: CtlResponse) -> ExitCode {
    fail(exit::FAILURE, &format!("ublkd answered with something unexpected: {resp:?}"))
}

fn fail(code: i32, message: &str) -> ExitCode {
    eprintln!("ublkctl: {message}");
    ExitCode::from(code as u8)
}

fn cmd_features(json: bool) -> ExitCode {
    let mask = match CtrlClient::open().and_then(|c| c.get_features()) {
        Ok(mask) => mask,
        Err(e) => {
            let code = match &e {
                CtrlError::NoDriver { .. } => exit::NO_UBLK,
                CtrlError::Open { source, .. }
                    if source.kind() == std::io::ErrorKind::PermissionDenied =>
                {
                    exit::PERMISSION
                }
                CtrlError::Kernel { errno, .. } if errno.0 == libc::EPERM => exit::PERMISSION,
                _ => exit::FAILURE,
            };
            return fail(code, &e.to_string());
        }
    };
    if json {
        println!("{}", features::render_json(mask));
    } else {
        print!("{}", features::render_text(mask));
        // Beside the list, not in it: stdout stays one feature name per line.
        eprintln!("data path: {}", DataPath::for_kernel(mask).describe());
    }
    ExitCode::SUCCESS
}
