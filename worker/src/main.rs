//! `ublkd-worker`: serves one ublk device's queues in a sandboxed process, started by
//! `ublkd` with the device's file descriptors. It is not meant to be run by hand.
//!
//! The data path (batched multishot PREP/FETCH/COMMIT) arrives with the end-to-end
//! issue; until then the binary only refuses to run, so nothing mistakes it for a
//! working server.

use std::process::ExitCode;

fn main() -> ExitCode {
    if std::env::args().any(|a| a == "--version" || a == "-V") {
        println!("ublkd-worker {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    eprintln!("ublkd-worker: started by ublkd only, and its data path is not built yet");
    ExitCode::from(2)
}
