//! The command lines of `ublkd` and `ublkctl`, in the library so that their man pages
//! are generated from the very definitions the binaries parse (`cargo xtask man`).

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use ublkd_proto::msg::SandboxLayer;

/// Exit codes, files and environment: the end of both `--help` texts and man pages.
const UBLKD_AFTER_HELP: &str = "\
Exit status: 0 success, 1 failure, 2 usage, 3 no ublk driver, 4 a required kernel feature \
is missing, 5 permission denied, 6 bad config file, 7 the control socket is taken or cannot \
be created.

Files: /etc/ublkd/ublkd.toml (the packaged config; every key is documented in it), \
/run/ublkd/ (the state dir and the control socket).

Environment: UBLKD_LOG, else RUST_LOG: the log filter (e.g. debug, ublkd=trace). Under \
systemd (stderr is the journal, as JOURNAL_STREAM says) the log goes to the journal with \
the fields DEV_ID, WORKER_PID and EVENT: `journalctl -u ublkd DEV_ID=3`.

Signals: SIGTERM or SIGINT exit 0 leaving every device in the kernel and each LIVE \
device's worker serving, for the next ublkd to take over (`ublkctl shutdown` deletes \
them all and stops ublkd); SIGHUP \
reloads the config file (`systemctl reload ublkd`): devices added to it are created, devices removed \
are deleted, a file with errors is rejected whole.";

const UBLKCTL_AFTER_HELP: &str = "\
Exit status: 0 success, 1 failure, 2 usage or a bad argument, 3 no ublk driver, 4 not \
supported by this kernel, 5 permission denied, 8 ublkd is not reachable, 9 no such device, \
10 already exists (an id, name, file, export or image another device has), 11 busy (the \
device is in use), 12 try again later (the device is not LIVE, is being recovered, upgraded \
or resized, or ublkd is shutting down), 13 the device's worker failed to start.

JSON: with --json every command prints one JSON object on stdout, with a \"schema\" \
version; an error is one JSON object on stderr, {\"schema\":1,\"error\":{\"kind\":…,\
\"message\":…}}, with the same exit status (docs/json.md).

Environment: UBLKD_SOCKET: the control socket (default /run/ublkd/ublkd.sock).";

/// ublkd: serve ublk block devices from sandboxed worker processes.
///
/// With no arguments it runs on built-in defaults (socket /run/ublkd/ublkd.sock, state
/// dir /run/ublkd) with no devices, ready for `ublkctl add`, after adopting the devices
/// a previous ublkd left. SIGTERM or SIGINT exits 0 and keeps every device.
#[derive(Debug, Parser)]
#[command(name = "ublkd", version, after_help = UBLKD_AFTER_HELP)]
pub struct UblkdCli {
    /// The config file: daemon settings and the devices to create at start.
    #[arg(short, long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Only check that this kernel's ublk driver has every feature ublkd needs, then exit.
    #[arg(long)]
    pub check_kernel: bool,

    /// Only check the config file (FILE, else --config's, else the default path) as a
    /// start or a reload reads it, then exit (6 if it is bad); with a ublkd running
    /// (its socket answers), list what a reload would add, change and delete.
    #[arg(long, value_name = "FILE", num_args = 0..=1)]
    pub check_config: Option<Option<PathBuf>>,

    /// More logging (-v: debug, -vv: trace); UBLKD_LOG or RUST_LOG override.
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Run as the systemd generator: write into DIR the drop-in that opens the unit's
    /// network to the NBD servers the config names over TCP, then exit.
    #[arg(long, value_name = "DIR", hide = true)]
    pub systemd_generator: Option<PathBuf>,
}

/// Control ublkd, the ublk block device server.
///
/// Every error is one line on stderr naming what failed, with a non-zero exit.
#[derive(Debug, Parser)]
#[command(name = "ublkctl", version, after_help = UBLKCTL_AFTER_HELP)]
pub struct UblkctlCli {
    /// ublkd's control socket.
    #[arg(long, global = true, env = "UBLKD_SOCKET", default_value = ublkd_config::DEFAULT_SOCKET)]
    pub socket: PathBuf,

    /// More logging (-v: debug, -vv: trace); UBLKD_LOG or RUST_LOG override.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Print one JSON object (its schema versioned, see docs/json.md), errors too (on
    /// stderr).
    #[arg(long, global = true)]
    pub json: bool,

    #[command(subcommand)]
    pub command: UblkctlCommand,
}

/// What serves a device added with `ublkctl add`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Target {
    /// Completes every request at once (writes are discarded).
    Null,
    /// A RAM disk whose data survives worker and ublkd restarts.
    Memory,
    /// A backing file or block device.
    Loop,
    /// An NBD server's export (--uri); its size, block sizes and flags are the
    /// export's.
    Nbd,
    /// An RBD image in a Ceph cluster (--image); its size is the image's, and a
    /// snapshot's device is read-only.
    Rbd,
}

/// `ublkctl`'s subcommands.
#[derive(Debug, Subcommand)]
pub enum UblkctlCommand {
    /// Add a device; prints its disk (/dev/ublkbN).
    Add {
        /// What serves the device.
        #[arg(short, long, value_enum)]
        target: Target,
        /// Backing file or block device (loop).
        #[arg(short, long)]
        file: Option<PathBuf>,
        /// The export's NBD URI (nbd): nbd://HOST:PORT/EXPORT (port 10809 and the
        /// default export when left out), nbd+unix:///EXPORT?socket=PATH, or with TLS
        /// nbds://HOST:PORT/EXPORT?tls-certificates=DIR (DIR: ca-cert.pem, and
        /// client-cert.pem + client-key.pem for a client certificate).
        #[arg(long, value_name = "URI")]
        uri: Option<String>,
        /// The RBD image (rbd): POOL/IMAGE, POOL/NAMESPACE/IMAGE, or either with
        /// @SNAPSHOT for a read-only device.
        #[arg(long, value_name = "SPEC")]
        image: Option<String>,
        /// The Ceph config file (rbd): the monitors' addresses, the keyring's path
        /// (default /etc/ceph/ceph.conf). ublkd reads it, the worker never does.
        #[arg(long, value_name = "FILE")]
        ceph_conf: Option<PathBuf>,
        /// The cephx id to connect as, without "client." (rbd; default ublkd, a client with `profile rbd` caps).
        #[arg(long, value_name = "ID")]
        ceph_id: Option<String>,
        /// The keyring holding the id's key (rbd; default: the config file's keyring,
        /// then Ceph's usual places such as /etc/ceph/ceph.client.ID.keyring).
        #[arg(long, value_name = "FILE")]
        keyring: Option<PathBuf>,
        /// Size in bytes or with K/M/G/T (binary); a loop device defaults to its file's
        /// size; an nbd device's is its export's, an rbd device's its image's.
        #[arg(short, long, value_parser = parse_size)]
        size: Option<u64>,
        /// Hardware queues.
        #[arg(short, long)]
        queues: Option<u16>,
        /// Requests in flight per queue.
        #[arg(short = 'd', long = "depth")]
        depth: Option<u16>,
        /// Worker threads serving the device's queues.
        #[arg(long)]
        threads: Option<u16>,
        /// Zero copy (loop, nbd): the worker reads and writes the file, or sends and
        /// receives the export's data, straight from the request's pages, lent by the
        /// kernel, instead of copying them. Without --zero-copy or --copy: a loop device
        /// has zero copy where the kernel has it (Linux >= 7.0) and queues x depth fit
        /// io_uring's buffer table (16384); an nbd device copies. An nbd device with
        /// zero copy needs Linux >= 7.2 and one connection per thread (an export with
        /// multi-conn, or --threads 1).
        #[arg(long, conflicts_with = "copy")]
        zero_copy: bool,
        /// No zero copy (loop, nbd): the kernel copies every request through the worker.
        #[arg(long)]
        copy: bool,
        /// Run this device's worker without its sandbox (the daemon's default is to
        /// sandbox): for measuring what the sandbox costs.
        #[arg(long)]
        no_sandbox: bool,
        /// Sandbox layers this device's worker may run without where they cannot be
        /// applied (comma-separated: user-namespace, namespaces, empty-root, landlock,
        /// landlock-tcp); it then runs weaker and status and the journal say which layer
        /// is missing.
        /// Without it: the daemon's default (defaults.sandbox_optional), and a worker
        /// missing any other layer refuses to run.
        #[arg(long, value_name = "LAYERS", value_parser = parse_layers, conflicts_with = "no_sandbox")]
        sandbox_optional: Option<LayerList>,
        /// Device id (default: the kernel picks one).
        #[arg(short = 'n', long = "id")]
        id: Option<u32>,
        /// A name for the device, unique among ublkd's devices: every command's -n
        /// takes it instead of the id, and udev links /dev/disk/by-id/ublk-NAME to the
        /// disk. 1 to 64 characters of A-Z a-z 0-9 . _ -, not starting with . or -, not
        /// all digits.
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
        /// A read-only disk: the kernel refuses writes, and the worker refuses any
        /// request that would change data before it reaches the target.
        #[arg(long)]
        read_only: bool,
        /// Let the kernel scan the disk for partitions (/dev/ublkbNpM). Needs
        /// --no-sandbox: the kernel never scans a disk whose server lacks
        /// CAP_SYS_ADMIN. Without it, an unsandboxed device is not scanned where the
        /// kernel has UBLK_F_NO_AUTO_PART_SCAN (Linux >= 7.0); 6.12 scans regardless.
        #[arg(long)]
        partitions: bool,
    },
    /// Delete a device (-n ID) or all of them (-a). A device in use (its filesystem
    /// mounted, held by dm or md, open in a process) is not deleted: the command fails
    /// naming what holds it (the mount point, the holder, or the process), and the
    /// device serves on unchanged; with -a, if any device is in use, none is deleted.
    /// Where the kernel has UBLK_F_SAFE_STOP_DEV (Linux >= 7.0) it refuses the stop
    /// itself while the disk is open; elsewhere ublkd holds the disk open exclusively
    /// across the stop. A delete that is not done after 25 s fails saying where it
    /// stands, and ublkd finishes it by itself.
    Del {
        /// The device's id or name.
        #[arg(
            short = 'n',
            long = "id",
            value_name = "ID|NAME",
            conflicts_with = "all",
            required_unless_present = "all"
        )]
        id: Option<DevRef>,
        /// Every device ublkd serves.
        #[arg(short, long)]
        all: bool,
        /// Delete devices in use too. A mounted filesystem loses what it had not
        /// written, and its users get I/O errors.
        #[arg(long)]
        force: bool,
    },
    /// List devices: the kernel selftests' two lines, then target, size, read-only, name
    /// and backing.
    List {
        /// Only this device (its id or name).
        #[arg(short = 'n', long = "id", value_name = "ID|NAME")]
        id: Option<DevRef>,
    },
    /// Devices' state, worker and I/O counters.
    Status {
        /// Only this device (its id or name).
        #[arg(short = 'n', long = "id", value_name = "ID|NAME")]
        id: Option<DevRef>,
    },
    /// Every device's I/O counters, errors, in-flight requests, recoveries, worker
    /// restarts and latency histograms (per operation, time at the backend in the
    /// worker) as OpenMetrics text, ending in `# EOF`.
    Metrics {
        /// Only this device (its id or name).
        #[arg(short = 'n', long = "id", value_name = "ID|NAME")]
        id: Option<DevRef>,
    },
    /// Recover a device now (after fixing what made its worker fail), resetting its
    /// restart budget; on a LIVE device it says so and does nothing. Exits 0 once the
    /// device is served again. If the recovery waits on something outside ublkd (the
    /// old worker's I/O still in a slow backend, an NBD server away) or takes over a
    /// minute, it fails saying where the recovery stands, and ublkd finishes it by
    /// itself; `ublkctl status` shows when.
    Recover {
        /// The device's id or name.
        #[arg(
            value_name = "ID|NAME",
            required_unless_present = "id_flag",
            conflicts_with = "id_flag"
        )]
        id: Option<DevRef>,
        /// The device's id or name (same as the positional one).
        #[arg(short = 'n', long = "id", id = "id_flag", value_name = "ID|NAME")]
        id_flag: Option<DevRef>,
    },
    /// Move devices to the worker binary now on disk (after a package upgrade), one at
    /// a time, each serving throughout: a new standby from the binary, then a planned
    /// handover, printing each device's stall. A binary that fails to start leaves the
    /// old worker serving and says why.
    Upgrade {
        /// The device's id or name.
        #[arg(
            short = 'n',
            long = "id",
            value_name = "ID|NAME",
            conflicts_with = "all",
            required_unless_present = "all"
        )]
        id: Option<DevRef>,
        /// Every device ublkd serves.
        #[arg(short, long)]
        all: bool,
    },
    /// Change a device's size while it serves (Linux 6.16+): a memory device's memory
    /// or a loop device's file grows to fit (a loop device on a block device only as
    /// far as that device goes), then the device moves to a worker serving the new
    /// size, as in an upgrade, and the disk's users see it (grow the filesystem with,
    /// e.g., `resize2fs`). nbd and rbd devices take their size from their server.
    Resize {
        /// The device's id or name.
        #[arg(short = 'n', long = "id", value_name = "ID|NAME")]
        id: DevRef,
        /// The new size in bytes, or with a suffix: K, M, G, T (powers of 1024); a
        /// multiple of the device's block size.
        #[arg(short, long, value_parser = parse_size)]
        size: u64,
        /// Allow a smaller size: the data past the new end is cut off from the device
        /// (shrink what is on it first).
        #[arg(long)]
        allow_shrink: bool,
    },
    /// Delete every device, then stop ublkd (what removing the package does). A stop
    /// or restart of ublkd (SIGTERM, `systemctl stop`) keeps the devices; this does not.
    /// If any device is in use (as for del), nothing is deleted and ublkd serves on:
    /// the command fails listing each busy device and what holds it.
    Shutdown {
        /// Delete devices in use too (their filesystems lose what they had not
        /// written).
        #[arg(long)]
        force: bool,
    },
    /// List the ublk features this kernel supports, one per line (no daemon needed),
    /// and on stderr the data path its devices get: "batched (BATCH_IO)" or "per-I/O".
    Features,
}

/// A device as `-n` names it: all digits is an id, anything else a name (a name is
/// never all digits, see `ublkd_config::check_name`), which ublkctl looks up in
/// ublkd's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DevRef {
    Id(u32),
    Name(String),
}

impl std::str::FromStr for DevRef {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
            return text.parse().map(DevRef::Id).map_err(|e| format!("{text:?}: {e}"));
        }
        ublkd_config::check_name(text).map_err(|e| e.problem)?;
        Ok(DevRef::Name(text.to_string()))
    }
}

/// Sandbox layers as `--sandbox-optional` lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerList(pub Vec<SandboxLayer>);

fn parse_layers(text: &str) -> Result<LayerList, String> {
    SandboxLayer::parse_list(text).map(LayerList).map_err(|e| e.to_string())
}

fn parse_size(s: &str) -> Result<u64, String> {
    ublkd_config::parse_size(s).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn both_command_lines_are_consistent() {
        UblkdCli::command().debug_assert();
        UblkctlCli::command().debug_assert();
    }

    #[test]
    fn ublkctl_add_takes_zero_copy_or_copy_for_an_nbd_device() {
        for (flag, want) in [("--zero-copy", (true, false)), ("--copy", (false, true))] {
            let cli = UblkctlCli::try_parse_from([
                "ublkctl",
                "add",
                "-t",
                "nbd",
                "--uri",
                "nbd://127.0.0.1/disk",
                flag,
            ])
            .unwrap();
            let UblkctlCommand::Add { zero_copy, copy, .. } = cli.command else {
                panic!("not an add: {:?}", cli.command);
            };
            assert_eq!((zero_copy, copy), want, "{flag}");
        }
        let both = ["ublkctl", "add", "-t", "nbd", "--uri", "nbd://h/", "--zero-copy", "--copy"];
        assert!(UblkctlCli::try_parse_from(both).is_err(), "--zero-copy and --copy conflict");
    }

    #[test]
    fn del_and_shutdown_take_force() {
        let cli = UblkctlCli::try_parse_from(["ublkctl", "del", "-a", "--force"]).unwrap();
        assert!(matches!(cli.command, UblkctlCommand::Del { all: true, force: true, .. }));
        let cli = UblkctlCli::try_parse_from(["ublkctl", "del", "-n", "0"]).unwrap();
        assert!(matches!(
            cli.command,
            UblkctlCommand::Del { id: Some(DevRef::Id(0)), force: false, .. }
        ));
        let cli = UblkctlCli::try_parse_from(["ublkctl", "shutdown", "--force"]).unwrap();
        assert!(matches!(cli.command, UblkctlCommand::Shutdown { force: true }));
    }

    #[test]
    fn n_takes_an_id_or_a_name_and_refuses_what_no_name_can_be() {
        let cli = UblkctlCli::try_parse_from(["ublkctl", "status", "-n", "db-1"]).unwrap();
        let want = Some(DevRef::Name("db-1".into()));
        assert!(matches!(cli.command, UblkctlCommand::Status { id, .. } if id == want));
        let cli = UblkctlCli::try_parse_from(["ublkctl", "recover", "7"]).unwrap();
        let want = Some(DevRef::Id(7));
        assert!(matches!(cli.command, UblkctlCommand::Recover { id, .. } if id == want));
        for bad in ["a/b", "99999999999", ""] {
            assert!(UblkctlCli::try_parse_from(["ublkctl", "del", "-n", bad]).is_err(), "{bad}");
        }
        let cli = UblkctlCli::try_parse_from([
            "ublkctl",
            "add",
            "-t",
            "null",
            "-s",
            "1M",
            "--name",
            "x",
            "--read-only",
            "--partitions",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            UblkctlCommand::Add { name: Some(_), read_only: true, partitions: true, .. }
        ));
    }

    #[test]
    fn ublkctl_takes_verbose_after_the_subcommand_too() {
        let cli = UblkctlCli::try_parse_from(["ublkctl", "list", "-vv"]).unwrap();
        assert_eq!(cli.verbose, 2);
    }
}
