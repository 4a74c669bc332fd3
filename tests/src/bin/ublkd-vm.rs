//! `ublkd-vm`: runs commands inside ublkd's test VM (Debian sid's 7.x cloud kernel with
//! ublk, or Debian's 6.12 LTS one with `--kernel 6.12`, under qemu), also as a cargo
//! runner. See the `ublkd_tests` crate docs.

use std::ffi::OsString;
use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use ublkd_tests::cache::Cache;
use ublkd_tests::kernel::{self, Series};
use ublkd_tests::vm::{self, Accel, RunOptions};
use ublkd_tests::{check, exit, initramfs, script};

#[derive(Debug, Parser)]
#[command(
    name = "ublkd-vm",
    about = "Run commands inside ublkd's test VM: Debian sid's 7.x cloud kernel with ublk (or Debian's 6.12 LTS with --kernel 6.12), under qemu.",
    after_help = exit::HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// `--kernel`, shared by the subcommands that pick a kernel.
#[derive(Debug, clap::Args)]
struct KernelArg {
    /// The kernel: 7 (Debian sid's newest cloud kernel >= 7.0) or 6.12 (Debian's newest
    /// 6.12 LTS cloud kernel) [default: $UBLKD_VM_KERNEL, else 7].
    #[arg(long, value_name = "SERIES")]
    kernel: Option<Series>,
}

impl KernelArg {
    /// `--kernel`, else `$UBLKD_VM_KERNEL`, else the default series.
    fn series(&self) -> anyhow::Result<Series> {
        if let Some(series) = self.kernel {
            return Ok(series);
        }
        let from_env = Series::from_env().context(kernel::ENV_KERNEL)?;
        Ok(from_env.unwrap_or_default())
    }
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Download (if not cached) the newest cloud kernel of the series (sid's >= 7.0:
    /// linux-binary, -modules, -base; 6.12: linux-image) and sid's linux-libc-dev into
    /// the cache; make it the kernel `run` boots for that series. Without --kernel (and
    /// $UBLKD_VM_KERNEL), both series: the tests run on both.
    Fetch {
        #[command(flatten)]
        kernel: KernelArg,
    },
    /// Print the include directory with the uapi headers (linux/ublk_cmd.h) programs
    /// are built against (sid's linux-libc-dev, for either series), fetching first if
    /// needed.
    UapiInclude {
        #[command(flatten)]
        kernel: KernelArg,
    },
    /// Boot the VM, run CMD inside it (host root read-only, same cwd, forwarded env),
    /// stream its console to stdout, and exit with CMD's status.
    #[command(after_help = exit::HELP)]
    Run {
        /// Whole-run timeout in seconds [default: $UBLKD_VM_TIMEOUT, else 900].
        #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
        timeout: Option<u64>,
        /// Guest memory in MB.
        #[arg(long, value_name = "MB", default_value_t = vm::DEFAULT_MEM_MB,
              value_parser = clap::value_parser!(u32).range(256..))]
        mem: u32,
        /// Number of vCPUs.
        #[arg(long, value_name = "N", default_value_t = vm::DEFAULT_CPUS,
              value_parser = clap::value_parser!(u32).range(1..=64))]
        cpus: u32,
        /// Boot the host's systemd as PID 1 (on a writable overlay of the host's root,
        /// changes kept in guest RAM) and run CMD as its ublkd-vm.service, after
        /// basic.target; CMD sees UBLKD_VM_SYSTEMD=1.
        #[arg(long)]
        systemd: bool,
        #[command(flatten)]
        kernel: KernelArg,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true, value_name = "CMD")]
        cmd: Vec<OsString>,
    },
    /// (Run by the guest before CMD.) Print the kernel's ublk feature mask; fail if it
    /// lacks a feature the series must have (UBLK_F_BATCH_IO on 7).
    GuestCheck {
        /// The series the guest was booted as.
        #[arg(long, value_name = "SERIES", default_value_t = Series::default())]
        kernel: Series,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Fetch { kernel } => {
            // Neither --kernel nor $UBLKD_VM_KERNEL: every series.
            let series = if kernel.kernel.is_none() && matches!(Series::from_env(), Ok(None)) {
                Series::ALL.to_vec()
            } else {
                match kernel.series() {
                    Ok(s) => vec![s],
                    Err(e) => return fail(exit::SETUP_FAILED, &e),
                }
            };
            let cache = match Cache::from_env() {
                Ok(c) => c,
                Err(e) => return fail_kernel(e.into()),
            };
            for s in series {
                if let Err(e) = kernel::fetch(&cache, s) {
                    return fail_kernel(e);
                }
            }
            ExitCode::SUCCESS
        }
        Cmd::UapiInclude { kernel } => {
            let series = match kernel.series() {
                Ok(s) => s,
                Err(e) => return fail(exit::SETUP_FAILED, &e),
            };
            match Cache::from_env()
                .map_err(Into::into)
                .and_then(|c| kernel::current_or_fetch(&c, series))
            {
                Ok(k) => {
                    println!("{}", k.include_dir.display());
                    ExitCode::SUCCESS
                }
                Err(e) => fail_kernel(e),
            }
        }
        Cmd::GuestCheck { kernel } => ExitCode::from(check::guest_check(kernel)),
        Cmd::Run { timeout, mem, cpus, systemd, kernel, cmd } => {
            run(timeout, mem, cpus, systemd, &kernel, cmd)
        }
    }
}

fn run(
    timeout: Option<u64>,
    mem_mb: u32,
    cpus: u32,
    systemd: bool,
    kernel_arg: &KernelArg,
    argv: Vec<OsString>,
) -> ExitCode {
    let setup = || -> anyhow::Result<(RunOptions, Cache)> {
        let series = kernel_arg.series()?;
        let timeout = match timeout {
            Some(secs) => Duration::from_secs(secs),
            None => match std::env::var(vm::ENV_TIMEOUT) {
                Ok(v) if !v.is_empty() => {
                    v.parse().ok().filter(|&s: &u64| s > 0).map(Duration::from_secs).with_context(
                        || format!("{}={v:?} is not a positive number of seconds", vm::ENV_TIMEOUT),
                    )?
                }
                _ => vm::DEFAULT_TIMEOUT,
            },
        };
        let mut env = script::forwarded_env(std::env::vars_os());
        script::fit_term(&mut env, std::io::stdout().is_terminal());
        script::set_var(&mut env, kernel::ENV_KERNEL, series.name());
        let opts = RunOptions {
            argv,
            cwd: std::env::current_dir().context("could not read the current directory")?,
            env,
            timeout,
            mem_mb,
            cpus,
            accel: Accel::from_env()?,
            check_bin: std::env::current_exe()
                .context("could not find the path of the running ublkd-vm binary")?,
            systemd,
            series,
        };
        Ok((opts, Cache::from_env()?))
    };
    let (opts, cache) = match setup() {
        Ok(v) => v,
        Err(e) => return fail(exit::SETUP_FAILED, &e),
    };
    let kernel = match kernel::current_or_fetch(&cache, opts.series) {
        Ok(k) => k,
        Err(e) => return fail_kernel(e),
    };
    let initrd = match initramfs::ensure(&cache, &kernel) {
        Ok(p) => p,
        Err(e) => return fail(exit::SETUP_FAILED, &e.into()),
    };
    match vm::run(&cache, &kernel, &initrd, &opts) {
        Ok(status) => ExitCode::from(status),
        Err(e) => fail(e.exit_code(), &e.into()),
    }
}

fn fail_kernel(e: kernel::KernelError) -> ExitCode {
    let code = if e.is_refusal() { exit::KERNEL_REFUSED } else { exit::SETUP_FAILED };
    fail(code, &e.into())
}

fn fail(code: u8, e: &anyhow::Error) -> ExitCode {
    eprintln!("[vm] error: {e:#}");
    ExitCode::from(code)
}
