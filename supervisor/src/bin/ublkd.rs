//! `ublkd`: the privileged supervisor of ublk devices.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ublkd_config::Config;
use ublkd_proto::ctrl::CtrlClient;
use ublkd_supervisor::daemon::Daemon;
use ublkd_supervisor::{error_chain, exit, features};

/// ublkd: serve ublk block devices from sandboxed worker processes.
///
/// With no arguments it runs on built-in defaults (socket /run/ublkd/ublkd.sock, state
/// dir /run/ublkd) with no devices, ready for `ublkctl add`. SIGTERM or SIGINT stops
/// and deletes every device, then exits 0.
#[derive(Debug, Parser)]
#[command(name = "ublkd", version)]
struct Cli {
    /// The config file: daemon settings and the devices to create at start.
    #[arg(short, long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Only check that this kernel's ublk driver has every feature ublkd needs, then exit.
    #[arg(long)]
    check_kernel: bool,

    /// More logging (-v: debug, -vv: trace); UBLKD_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("UBLKD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .init();

    if cli.check_kernel {
        return check_kernel();
    }
    let config = match &cli.config {
        Some(path) => match Config::load(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("ublkd: {}", error_chain(&e));
                return code(exit::CONFIG);
            }
        },
        None => Config::default(),
    };
    let mut daemon = match Daemon::start(config, cli.config.clone()) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("ublkd: {}", error_chain(&e));
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
            eprintln!("ublkd: {}", error_chain(&e));
            code(e.exit_code())
        }
    }
}

fn check_kernel() -> ExitCode {
    let mask = match CtrlClient::open().and_then(|c| c.get_features()) {
        Ok(mask) => mask,
        Err(e) => {
            eprintln!("ublkd: {e}");
            let c = if matches!(e, ublkd_proto::ctrl::CtrlError::NoDriver { .. }) {
                exit::NO_UBLK
            } else {
                exit::FAILURE
            };
            return code(c);
        }
    };
    let missing = features::missing_required(mask);
    if !missing.is_empty() {
        eprintln!("ublkd: this kernel's ublk driver lacks {}", missing.join(", "));
        return code(exit::MISSING_FEATURE);
    }
    println!("ublkd: kernel ublk features {mask:#x}: everything ublkd needs is there");
    ExitCode::SUCCESS
}

fn code(c: i32) -> ExitCode {
    ExitCode::from(c as u8)
}
