//! `ublkd`: the privileged supervisor of ublk devices.
//!
//! For now it checks that the kernel can host ublkd's devices (a ublk driver with
//! every feature ublkd needs) and says so; creating and serving devices is the next
//! step (the end-to-end data path issue).

use std::process::ExitCode;

use clap::Parser;
use ublkd_proto::ctrl::{CtrlClient, CtrlError};
use ublkd_supervisor::{exit, features};

/// ublkd: serve ublk block devices from sandboxed worker processes.
#[derive(Debug, Parser)]
#[command(name = "ublkd", version)]
struct Cli {
    /// Only check that this kernel's ublk driver has every feature ublkd needs, then exit.
    #[arg(long)]
    check_kernel: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mask = match CtrlClient::open().and_then(|c| c.get_features()) {
        Ok(mask) => mask,
        Err(e @ CtrlError::NoDriver { .. }) => {
            eprintln!("ublkd: {e}");
            return ExitCode::from(exit::NO_UBLK as u8);
        }
        Err(e) => {
            eprintln!("ublkd: {e}");
            return ExitCode::from(exit::FAILURE as u8);
        }
    };
    let missing = features::missing_required(mask);
    if !missing.is_empty() {
        eprintln!("ublkd: this kernel's ublk driver lacks {}", missing.join(", "));
        return ExitCode::from(exit::MISSING_FEATURE as u8);
    }
    if cli.check_kernel {
        println!("ublkd: kernel ublk features {mask:#x}: everything ublkd needs is there");
        return ExitCode::SUCCESS;
    }
    eprintln!("ublkd: serving devices is not built yet (see the end-to-end data path issue)");
    ExitCode::from(exit::FAILURE as u8)
}
