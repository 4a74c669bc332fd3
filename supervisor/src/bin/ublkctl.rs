//! `ublkctl`: the operator's CLI for ublkd.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ublkd_proto::ctrl::{CtrlClient, CtrlError};
use ublkd_supervisor::{exit, features};

/// Control ublkd, the ublk block device server.
#[derive(Debug, Parser)]
#[command(name = "ublkctl", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the ublk features this kernel supports, one per line (no daemon needed).
    Features {
        /// Print one JSON object: {"mask":"0x…","features":[…]}.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Features { json } => cmd_features(json),
    }
}

fn cmd_features(json: bool) -> ExitCode {
    let mask = match CtrlClient::open().and_then(|c| c.get_features()) {
        Ok(mask) => mask,
        Err(e) => return fail(&e),
    };
    if json {
        println!("{}", features::render_json(mask));
    } else {
        print!("{}", features::render_text(mask));
    }
    ExitCode::SUCCESS
}

fn fail(err: &CtrlError) -> ExitCode {
    eprintln!("ublkctl: {err}");
    let code = match err {
        CtrlError::NoDriver { .. } => exit::NO_UBLK,
        CtrlError::Open { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
            exit::PERMISSION
        }
        CtrlError::Kernel { errno, .. } if errno.0 == libc::EPERM => exit::PERMISSION,
        _ => exit::FAILURE,
    };
    ExitCode::from(code as u8)
}
