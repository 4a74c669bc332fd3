//! `ublkd`: the privileged supervisor of ublk devices.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ublkd_config::Config;
use ublkd_proto::ctrl::CtrlClient;
use ublkd_proto::msg::{self, CtlRequest, CtlResponse};
use ublkd_supervisor::cli::UblkdCli;
use ublkd_supervisor::daemon::Daemon;
use ublkd_supervisor::{error_chain, exit, features, logging, rlimit};

fn main() -> ExitCode {
    let cli = UblkdCli::parse();
    if let Some(dir) = &cli.systemd_generator {
        return systemd_generator(cli.config.as_deref(), dir);
    }
    let sink = logging::init("ublkd", cli.verbose);

    if cli.check_kernel {
        return check_kernel();
    }
    if let Some(file) = &cli.check_config {
        let path = file.clone().or_else(|| cli.config.clone());
        return check_config(&path.unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG)));
    }
    let config = match &cli.config {
        Some(path) => match Config::load(path) {
            Ok(c) => c,
            Err(e) => {
                fatal(sink, &error_chain(&e));
                return code(exit::CONFIG);
            }
        },
        None => Config::default(),
    };
    tracing::info!("ublkd {} starting", env!("CARGO_PKG_VERSION"));
    match rlimit::raise_nofile() {
        Ok(n) => tracing::info!(
            "RLIMIT_NOFILE: soft limit {} (was {}), hard limit {}",
            n.now,
            n.was,
            n.hard
        ),
        // ublkd still serves, only fewer devices: `add` then fails with EMFILE, naming it.
        Err(e) => tracing::warn!("{e}"),
    }
    let mut daemon = match Daemon::start(config, cli.config.clone()) {
        Ok(d) => d,
        Err(e) => {
            fatal(sink, &error_chain(&e));
            return code(e.exit_code());
        }
    };
    let adopted = daemon.adopt_previous();
    if adopted > 0 {
        tracing::info!("adopted {adopted} device(s) from a previous ublkd");
    }
    let failed = daemon.create_configured();
    if failed > 0 {
        tracing::error!("{failed} configured device(s) could not be created (see above)");
    }
    daemon.notify_ready();
    match daemon.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            fatal(sink, &error_chain(&e));
            code(e.exit_code())
        }
    }
}

/// The packaged config file: what `--check-config` checks when given no file.
const DEFAULT_CONFIG: &str = "/etc/ublkd/ublkd.toml";

/// `--check-config`: `path` read as a start or a reload reads it (`Config::load`), its
/// first error named with its line (exit 6); then, if a ublkd answers on the file's
/// socket (or the default one), what a reload to this file would add, change and
/// delete, as that ublkd's reload decides it.
fn check_config(path: &Path) -> ExitCode {
    let config = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ublkd: {}", error_chain(&e));
            return code(exit::CONFIG);
        }
    };
    println!("{}: valid, {} device(s)", path.display(), config.devices.len());
    let mut sockets = vec![config.daemon.socket.clone()];
    if config.daemon.socket != Path::new(ublkd_config::DEFAULT_SOCKET) {
        sockets.push(PathBuf::from(ublkd_config::DEFAULT_SOCKET));
    }
    let Some((socket, stream)) =
        sockets.into_iter().find_map(|s| UnixStream::connect(&s).ok().map(|c| (s, c)))
    else {
        println!("no ublkd answers on this host: nothing to compare with");
        return ExitCode::SUCCESS;
    };
    let config = match std::path::absolute(path) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("ublkd: {}: {e}", path.display());
            return code(exit::FAILURE);
        }
    };
    let request =
        CtlRequest::WithKinds(Box::new(CtlRequest::ReloadPlan { config: config.clone() }));
    match ask(stream, &request) {
        Ok(CtlResponse::ReloadPlan { reloads, add, change, remove, notes }) => {
            match reloads {
                Some(own) if std::path::absolute(&own).is_ok_and(|own| own == config) => {
                    println!("the ublkd at {} reloads this file; a reload would:", socket.display())
                }
                Some(own) => println!(
                    "the ublkd at {} reloads {}, not this file; were this its file, a reload would:",
                    socket.display(),
                    own.display()
                ),
                None => println!(
                    "the ublkd at {} runs without a config file (a reload changes nothing); \
                     started with this file, a reload would:",
                    socket.display()
                ),
            }
            let nothing = add.is_empty() && change.is_empty() && remove.is_empty();
            for line in add {
                println!("  add {line}");
            }
            for line in change {
                println!("  change {line} (it serves on as it is until deleted)");
            }
            for line in remove {
                println!("  remove {line}");
            }
            if nothing {
                println!("  change no device");
            }
            for note in notes {
                println!("  note: {note}");
            }
            ExitCode::SUCCESS
        }
        Ok(CtlResponse::Failed { message, .. } | CtlResponse::Error { message }) => {
            eprintln!("ublkd: the running ublkd cannot say what a reload would do: {message}");
            code(exit::FAILURE)
        }
        Ok(other) => {
            eprintln!("ublkd: the running ublkd answered something unexpected: {other:?}");
            code(exit::FAILURE)
        }
        Err(e) => {
            eprintln!("ublkd: asking the ublkd at {}: {e}", socket.display());
            code(exit::FAILURE)
        }
    }
}

/// One request to a running ublkd, its answer.
fn ask(mut stream: UnixStream, request: &CtlRequest) -> Result<CtlResponse, msg::MsgError> {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    msg::write_frame(&mut stream, request)?;
    msg::read_response(&mut stream)
}

/// `--systemd-generator DIR`: a generator must not fail the boot, nor log but to
/// stderr (the kernel log, at boot): any problem is said there, and the exit is 0.
fn systemd_generator(config: Option<&Path>, dir: &Path) -> ExitCode {
    let config = config.unwrap_or(Path::new(DEFAULT_CONFIG));
    match ublkd_supervisor::generator::generate(config, dir) {
        Ok(_) => {}
        Err(e) => eprintln!("ublkd-generator: {e}"),
    }
    ExitCode::SUCCESS
}

fn check_kernel() -> ExitCode {
    let mask = match CtrlClient::open().and_then(|c| c.get_features()) {
        Ok(mask) => mask,
        Err(e) => {
            let c = match e {
                ublkd_proto::ctrl::CtrlError::NoDriver { .. } => exit::NO_UBLK,
                // GET_FEATURES came with Linux 6.5, ublkd's oldest kernel.
                ublkd_proto::ctrl::CtrlError::Kernel { .. } => {
                    eprintln!("ublkd: {e}: ublkd needs {} or newer", features::MIN_KERNEL);
                    return code(exit::MISSING_FEATURE);
                }
                _ => exit::FAILURE,
            };
            eprintln!("ublkd: {e}");
            return code(c);
        }
    };
    let missing = features::missing_required(mask);
    if !missing.is_empty() {
        eprintln!("ublkd: this kernel's ublk driver lacks {}", missing.join(", "));
        return code(exit::MISSING_FEATURE);
    }
    println!("ublkd: {}", features::summary(mask));
    ExitCode::SUCCESS
}

/// Why ublkd cannot go on: an error in the journal (so that `systemctl status` shows it
/// as one), else a plain line on stderr.
fn fatal(sink: logging::Sink, message: &str) {
    match sink {
        logging::Sink::Journal => tracing::error!(event = "fatal", "{message}"),
        logging::Sink::Stderr => eprintln!("ublkd: {message}"),
    }
}

fn code(c: i32) -> ExitCode {
    ExitCode::from(c as u8)
}
