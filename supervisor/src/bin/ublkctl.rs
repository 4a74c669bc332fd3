//! `ublkctl`: the operator's CLI for ublkd.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser;
use ublkd_config::{DeviceSettings, MAX_QUEUE_DEPTH, MAX_QUEUES, MIN_BLOCK_SIZE};
use ublkd_proto::ctrl::{CtrlClient, CtrlError};
use ublkd_proto::msg::{
    self, AddRequest, CtlRequest, CtlResponse, DataPath, ErrorKind, RbdAdd, TargetKind,
};
use ublkd_supervisor::cli::{DevRef, Target, UblkctlCli, UblkctlCommand as Command};
use ublkd_supervisor::daemon::spec_from_request;
use ublkd_supervisor::metrics::{self, Format};
use ublkd_supervisor::{exit, features, logging, render};

/// `--json`: output and errors as JSON objects (set once, before any output).
static JSON: AtomicBool = AtomicBool::new(false);

fn json() -> bool {
    JSON.load(Ordering::Relaxed)
}

fn main() -> ExitCode {
    // Like any CLI, end quietly when the reader of our output goes away (`| head`).
    // SAFETY: restoring the default action of SIGPIPE before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = UblkctlCli::parse();
    logging::init("ublkctl", cli.verbose);
    JSON.store(cli.json, Ordering::Relaxed);
    let request = match cli.command {
        Command::Features => return cmd_features(json()),
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
                        return fail(exit::BAD_ARGUMENT, &e);
                    }
                };
            let any_rbd =
                image.is_some() || ceph_conf.is_some() || ceph_id.is_some() || keyring.is_some();
            let rbd = any_rbd.then_some(RbdAdd { image, ceph_conf, ceph_id, keyring });
            let add = AddRequest {
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
            };
            if let Err(e) = check_add(&add) {
                return fail(exit::BAD_ARGUMENT, &e);
            }
            CtlRequest::Add(add)
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
                    let code = wait_for_exit(&cli.socket);
                    if json() {
                        println!("{}", render::deleted_json(&ids));
                    } else {
                        for id in ids {
                            eprintln!("deleted device {id}");
                        }
                    }
                    code
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
                    if json() {
                        println!("{}", render::metrics_json(&devs));
                    } else {
                        print!("{}", metrics::render(&devs, Format::OpenMetrics));
                    }
                    ExitCode::SUCCESS
                }
                Ok(other) => unexpected(other),
                Err(code) => code,
            };
        }
        Command::Status { id } => {
            let id = match resolve_opt(&cli.socket, id) {
                Ok(id) => id,
                Err(code) => return code,
            };
            return match call(&cli.socket, &CtlRequest::Status { id }) {
                Ok(CtlResponse::Status(devs)) => {
                    if json() {
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
    let json = json();
    match call(&cli.socket, &request) {
        Ok(CtlResponse::Added { id }) if json => println!("{}", render::added_json(id)),
        // The disk, which is what the operator uses next (`mkfs`, `mount`); scripts take
        // the id from its end.
        Ok(CtlResponse::Added { id }) => println!("/dev/ublkb{id}"),
        Ok(CtlResponse::Deleted { ids }) if json => println!("{}", render::deleted_json(&ids)),
        Ok(CtlResponse::Deleted { ids }) => {
            for id in ids {
                eprintln!("deleted device {id}");
            }
        }
        Ok(CtlResponse::List(devs)) => {
            // What backs each device, its name and size are ublkd's, not the kernel's:
            // every device's status, joined by id (one that went between the two
            // requests has none).
            let statuses = match call(&cli.socket, &CtlRequest::Status { id: None }) {
                Ok(CtlResponse::Status(s)) => s,
                _ => Vec::new(),
            };
            if json {
                println!("{}", render::listing_json(&devs, &statuses));
            } else {
                for d in &devs {
                    print!("{}", render::listing(d, render::identity_of(&statuses, d.id)));
                }
            }
        }
        Ok(CtlResponse::Recovered { id, message }) if json => {
            println!("{}", render::done_json(id, None, &message))
        }
        Ok(CtlResponse::Resized { id, size_bytes, message }) if json => {
            println!("{}", render::done_json(id, Some(size_bytes), &message))
        }
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

/// `add`'s arguments checked here, before ublkd is asked, by the very code ublkd runs
/// (`spec_from_request`, the config file's checks). ublkd fills what the command line
/// leaves out from its config's defaults, which ublkctl does not read: a request is
/// refused here only if it also fails with the most lenient settings any config can
/// give (every bound at its widest), so that only what no config makes right is
/// refused; ublkd checks the rest. The message is that of the built-in defaults (what
/// most ublkds run with), whose numbers (a block size of 4096) an operator expects.
fn check_add(add: &AddRequest) -> Result<(), String> {
    let Err(message) = spec_from_request(add, &DeviceSettings::default()) else {
        return Ok(());
    };
    let lenient = DeviceSettings {
        queues: MAX_QUEUES,
        queue_depth: MAX_QUEUE_DEPTH,
        block_size: MIN_BLOCK_SIZE,
        threads: 1,
        ..DeviceSettings::default()
    };
    match spec_from_request(add, &lenient) {
        Ok(_) => Ok(()),
        Err(_) => Err(message),
    }
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
            Err(fail(exit::NO_DEVICE, &format!("no device is named {name:?}: {known}")))
        }
        other => Err(unexpected(other)),
    }
}

fn resolve_opt(socket: &Path, dev: Option<DevRef>) -> Result<Option<u32>, ExitCode> {
    dev.map(|dev| resolve(socket, dev)).transpose()
}

/// Sends one request and returns the response, or the exit code of a failure (after
/// printing it). The request goes wrapped in [`CtlRequest::WithKinds`], so that an
/// error comes with its kind (the exit code); an older ublkd, which cannot decode that
/// and answers a bare `Error` having done nothing, is asked again with the request
/// bare (its errors exit 1).
fn call(socket: &Path, req: &CtlRequest) -> Result<CtlResponse, ExitCode> {
    match exchange(socket, &CtlRequest::WithKinds(Box::new(req.clone())))? {
        CtlResponse::Error { .. } => match exchange(socket, req)? {
            CtlResponse::Error { message } => Err(fail(exit::FAILURE, &message)),
            resp => Ok(resp),
        },
        resp => Ok(resp),
    }
}

/// One connection: `req` sent, the answer read. A `Failed` answer is the exit code of
/// its kind; a bare `Error` is returned to [`call`].
fn exchange(socket: &Path, req: &CtlRequest) -> Result<CtlResponse, ExitCode> {
    let mut stream = UnixStream::connect(socket).map_err(|e| {
        let (code, hint) = match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => (
                exit::NO_DAEMON,
                " (is ublkd running? start it with `ublkd` or `systemctl start ublkd`)",
            ),
            // ublkd runs: the socket's mode keeps us out.
            std::io::ErrorKind::PermissionDenied => (exit::PERMISSION, " (ublkctl needs root)"),
            _ => (exit::NO_DAEMON, ""),
        };
        fail(code, &format!("cannot reach ublkd at {}: {e}{hint}", socket.display()))
    })?;
    // Adding a device waits for its worker to PREP every tag; allow for a slow machine.
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    msg::write_frame(&mut stream, req)
        .map_err(|e| fail(exit::FAILURE, &format!("sending the request: {e}")))?;
    match msg::read_response(&mut stream) {
        Ok(CtlResponse::Failed { kind, message }) => Err(fail_kind(kind, &message)),
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
    let mut all = Vec::new();
    for id in ids {
        match call(socket, &CtlRequest::Upgrade { id: Some(id) }) {
            Ok(CtlResponse::Upgraded(outcomes)) if json() => {
                failed += outcomes.iter().filter(|o| !o.upgraded).count();
                all.extend(outcomes);
            }
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
    if json() {
        println!("{}", render::upgraded_json(&all));
    }
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::from(exit::FAILURE as u8) }
}

fn unexpected(resp: CtlResponse) -> ExitCode {
    fail(exit::FAILURE, &format!("ublkd answered with something unexpected: {resp:?}"))
}

/// Prints the error (under `--json`, one JSON object on stderr) and returns `code`.
fn fail(code: i32, message: &str) -> ExitCode {
    report(exit::kind_name(code), message);
    ExitCode::from(code as u8)
}

/// [`fail`] for an error answer of ublkd's, with its kind's code.
fn fail_kind(kind: ErrorKind, message: &str) -> ExitCode {
    report(kind.name(), message);
    ExitCode::from(exit::for_kind(kind) as u8)
}

fn report(kind: &str, message: &str) {
    if json() {
        eprintln!("{}", render::error_json(kind, message));
    } else {
        eprintln!("ublkctl: {message}");
    }
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
        println!("{}", render::features_json(mask));
    } else {
        print!("{}", features::render_text(mask));
        // Beside the list, not in it: stdout stays one feature name per line.
        eprintln!("data path: {}", DataPath::for_kernel(mask).describe());
    }
    ExitCode::SUCCESS
}
