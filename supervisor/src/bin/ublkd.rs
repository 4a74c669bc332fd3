//! `ublkd`: the privileged supervisor of ublk devices.

use std::process::ExitCode;

use clap::Parser;
use ublkd_config::Config;
use ublkd_proto::ctrl::CtrlClient;
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

/// `--systemd-generator DIR`: a generator must not fail the boot, nor log but to
/// stderr (the kernel log, at boot): any problem is said there, and the exit is 0.
fn systemd_generator(config: Option<&std::path::Path>, dir: &std::path::Path) -> ExitCode {
    let config = config.unwrap_or(std::path::Path::new("/etc/ublkd/ublkd.toml"));
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
