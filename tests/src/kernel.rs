//! The guest kernel, fetched with apt into the [`Cache`] without installing anything.
//! Two [`Series`] of Debian's `*-cloud-amd64` kernels can be booted, each cached under
//! its own ABI with its own manifest:
//!
//! - [`Series::Newest`] (the default): Debian sid's newest kernel ≥ 7.0, which has
//!   `UBLK_F_BATCH_IO`. Its files are split over `linux-binary-<abi>`,
//!   `linux-modules-<abi>` and `linux-base-<abi>` (the config), all from sid.
//! - [`Series::Lts6_12`]: Debian's newest 6.12 LTS kernel, which fleets run (no batch
//!   commands). One package, `linux-image-<abi>`, holds `boot/vmlinuz-<abi>`,
//!   `boot/config-<abi>` and `lib/modules/<abi>`; it comes from whichever suite apt
//!   offers it in (Debian 12's `bookworm-security` ships `6.12.*+deb12`, Debian 13's
//!   `trixie` ships `6.12.*+deb13`).
//!
//! [`fetch`] asks apt (`apt-cache search --names-only`) for the series' cloud packages,
//! picks the newest ABI (refusing a "newest" older than 7.0), and — unless that ABI is
//! cached already — `apt-get download`s its packages and sid's `linux-libc-dev`, unpacks
//! them with `dpkg-deb -x` and keeps only what the VM needs, decompressed: `vmlinuz`,
//! `config`, `ublk_drv.ko` (no module dependencies), `overlay.ko` and `nbd.ko` (the
//! kernel's NBD client, for the benchmark beside it: `bench/run nbd`; loaded by the
//! guest command itself from `$UBLKD_VM_KERNEL_DIR`), a small module tree for the
//! guest's `/lib/modules` (below), plus the unpacked uapi headers. The kernel is refused
//! if its config lacks `CONFIG_BLK_DEV_UBLK`. Both
//! series share sid's `linux-libc-dev`: host programs are built once against the newest
//! uapi header (uapi only grows) and run on either kernel, which tells what it supports
//! through `UBLK_U_CMD_GET_FEATURES`.
//!
//! The module tree (where the config has `CONFIG_TLS=m`) is what kernel TLS needs and
//! little else of the package: `tls.ko` and the AEAD modules behind the ciphers kTLS
//! offers (gcm, ccm, chacha20poly1305, with their generic and x86 helpers), and `tc`'s
//! prio, netem and u32 for the rbd tests and krbd for the rbd benchmark (see
//! [`GUEST_MODULES`]), each with the modules
//! it depends on, decompressed and laid out as a kernel package lays them out, plus the
//! package's `modules.builtin`, `modules.builtin.modinfo` and `modules.order`, indexed by
//! the host's `depmod -b`:
//!
//! ```text
//! <cache>/kernel/<abi>/modules/lib/modules/<abi>/kernel/net/tls/tls.ko
//!                                               /kernel/crypto/gcm.ko ...
//!                                               /modules.dep, modules.alias, ...
//! ```
//!
//! The guest's `/init` (tests/vm/guest-init.sh) makes `/lib/modules/$(uname -r)` point
//! there, so that `modprobe tls` works and so does the kernel's own `request_module`
//! (`tcp-ulp-tls` on `setsockopt(TCP_ULP, "tls")`, `crypto-gcm(aes)` on `TLS_TX`). A
//! kernel directory without `modules/` boots the same, without them.
//!
//! [`current_or_fetch`] is what `run` uses: the kernel the last `fetch` of that series
//! chose (no apt call, so a run is quick and does not change kernel under a test
//! suite), or a fetch if there is none. `ublkd-vm fetch` moves on to a newer kernel
//! after `apt-get update`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::cache::{Cache, CacheError};
use crate::progress;

/// The oldest kernel release [`Series::Newest`] accepts: `UBLK_F_BATCH_IO` is new in 7.0.
pub const MIN_RELEASE: [u32; 2] = [7, 0];
/// The release [`Series::Lts6_12`] boots.
pub const LTS_RELEASE: [u32; 2] = [6, 12];
/// The kernel flavour the VM boots (virtio drivers built in, small).
pub const FLAVOUR_SUFFIX: &str = "-cloud-amd64";
/// The environment variable that selects the [`Series`] when `--kernel` is not given
/// (so that a cargo runner string can stay the same for both kernels).
pub const ENV_KERNEL: &str = "UBLKD_VM_KERNEL";
const HEADERS_PACKAGE: &str = "linux-libc-dev";
/// The suite sid's packages are asked for by (`apt-get download PKG/sid`).
const SID: &str = "sid";
const MANIFEST: &str = "manifest";
/// The layout of a cached kernel's directory, written into its manifest (`layout=N`).
/// A cached kernel of an older layout (fewer modules kept) is fetched again. 2: `nbd.ko`.
/// 3: `modules/`, the guest's module tree for kernel TLS. 4: `tc`'s prio, netem and u32
/// modules in that tree (tests/tests/rbd.rs delays a dead worker's TCP segments). 5: `rbd`
/// (krbd, the kernel's RBD client, beside ublkd's rbd target in `bench/run rbd`).
const MANIFEST_LAYOUT: u32 = 5;
/// The guest's module tree in a cached kernel's directory: `lib/modules/<abi>` below it,
/// as `depmod -b` and `modprobe -d` expect.
const MODULES_DIR: &str = "modules";
/// The modules kept for the guest's `/lib/modules` (each where the package has it, with
/// what it depends on): kernel TLS and the AEADs behind its ciphers, and the traffic
/// control that holds a process's TCP segments on loopback. Names as in
/// `modules.dep`, `-` and `_` alike. Which exist differs between kernels: 7.2 has
/// `chacha.ko` and GHASH in the library, 6.12 `chacha_generic.ko`, `ghash-generic.ko` and
/// the x86 ChaCha/Poly1305/GHASH glue.
pub const GUEST_MODULES: &[&str] = &[
    // kTLS itself (alias tcp-ulp-tls).
    "tls",
    // TLS_CIPHER_AES_GCM_*: gcm(aes) = ctr(aes) + ghash; AES-NI/PCLMUL where the CPU has them.
    "gcm",
    "ctr",
    "ghash-generic",
    "ghash-clmulni-intel",
    "gf128mul",
    "aesni-intel",
    "crypto_simd",
    "cryptd",
    // TLS_CIPHER_AES_CCM_128: ccm(aes).
    "ccm",
    // TLS_CIPHER_CHACHA20_POLY1305: rfc7539(chacha20,poly1305).
    "chacha20poly1305",
    "chacha",
    "chacha_generic",
    "chacha-x86_64",
    "poly1305_generic",
    "poly1305-x86_64",
    "libchacha",
    "libpoly1305",
    // IV generators an AEAD user may ask for by template.
    "seqiv",
    "echainiv",
    // `tc`: a prio qdisc on lo whose extra band is a netem delay, fed by u32 filters on
    // source ports (tests/src/harness/ceph.rs's LoDelay).
    "sch_prio",
    "sch_netem",
    "cls_u32",
    // krbd (with libceph): `rbd map`, the kernel's RBD client that `bench/run rbd`
    // measures ublkd's rbd target against.
    "rbd",
];
/// What the guest's `modprobe` reads beside `modules.dep`, copied from the package where
/// it has them.
const MODULE_INDEX_FILES: [&str; 3] =
    ["modules.builtin", "modules.builtin.modinfo", "modules.order"];

mod series;
pub use series::{Series, UnknownSeries};

/// Errors of fetching and loading the guest kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The cache directory failed.
    #[error("the kernel cache is unusable")]
    Cache(#[from] CacheError),
    /// A host tool could not be started.
    #[error("could not run `{0}` (is it installed? see tests/vm/install-host-deps.sh)")]
    Spawn(String, #[source] io::Error),
    /// A host tool failed.
    #[error("`{cmd}` failed ({status}): {stderr}")]
    ToolFailed {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The end of its stderr.
        stderr: String,
    },
    /// apt knows no cloud kernel of the series.
    #[error("apt knows no {} package; {}", no_kernel_packages(*.0), no_kernel_hint(*.0))]
    NoCloudKernel(Series),
    /// The newest cloud kernel is older than 7.0.
    #[error(
        "the newest Debian sid cloud kernel is {0}, but ublkd's tests need Linux ≥ 7.0 (UBLK_F_BATCH_IO)"
    )]
    TooOld(String),
    /// The kernel's config lacks ublk.
    #[error(
        "kernel {0}'s config lacks CONFIG_BLK_DEV_UBLK (ublk is neither built in nor a module)"
    )]
    NoUblk(String),
    /// `apt-cache show PKG[/suite]` listed nothing.
    #[error("apt-cache lists no {0}")]
    NotInApt(String),
    /// An unpacked package lacks a file the VM needs.
    #[error("the unpacked packages of kernel {abi} have no {what}")]
    MissingFile {
        /// The kernel ABI.
        abi: String,
        /// What is missing.
        what: String,
    },
    /// A file operation in the cache failed.
    #[error("could not {0} {1:?}")]
    Io(&'static str, PathBuf, #[source] io::Error),
    /// A cached kernel's manifest is unreadable.
    #[error("the cached kernel manifest {0:?} is malformed; delete its directory and fetch again")]
    BadManifest(PathBuf),
}

impl KernelError {
    /// Whether this is the kernel refusing (too old, no ublk) rather than a setup failure.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::NoCloudKernel(_) | Self::TooOld(_) | Self::NoUblk(_))
    }
}

fn no_kernel_packages(series: Series) -> String {
    match series {
        Series::Newest => format!("linux-binary-*{FLAVOUR_SUFFIX}"),
        Series::Lts6_12 => format!("linux-image-6.12.*{FLAVOUR_SUFFIX}"),
    }
}

fn no_kernel_hint(series: Series) -> &'static str {
    match series {
        Series::Newest => {
            "run tests/vm/install-host-deps.sh (it adds Debian sid) and apt-get update"
        }
        Series::Lts6_12 => {
            "Debian 12's bookworm-security and Debian 13 (trixie) ship it: apt-get update, or add one of those suites"
        }
    }
}

/// The version in a kernel ABI string such as `7.2.13+deb14-cloud-amd64`, ordered so
/// that newer is greater: release numbers, then final release above `-rcN`, then the
/// Debian ABI revision numbers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct AbiVersion {
    release: Vec<u32>,
    is_final: bool,
    revision: Vec<u32>,
}

impl AbiVersion {
    /// Parses the part of `abi` before the flavour (`7.2.13+deb14`, `6.1.0-28`,
    /// `7.3-rc5+deb14`). `None` if it does not start with a dotted release number.
    pub fn parse(abi: &str) -> Option<Self> {
        let end = abi.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(abi.len());
        let (release_text, rest) = abi.split_at(end);
        let release =
            release_text.split('.').map(|n| n.parse().ok()).collect::<Option<Vec<u32>>>()?;
        let is_final = !rest.contains("-rc") && !rest.contains("~rc");
        let revision = rest
            .split(|c: char| !c.is_ascii_digit())
            .filter(|n| !n.is_empty())
            .filter_map(|n| n.parse().ok())
            .collect();
        Some(Self { release, is_final, revision })
    }

    /// Whether the release is at least `major.minor`.
    pub fn at_least(&self, [major, minor]: [u32; 2]) -> bool {
        self.release.as_slice() >= [major, minor].as_slice()
    }
}

/// A kernel apt offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// `linux-binary-<abi>` or `linux-image-<abi>`: the package named after the ABI.
    pub package: String,
    /// `7.2.13+deb14-cloud-amd64`.
    pub abi: String,
    /// The parsed version of `abi`.
    pub version: AbiVersion,
}

/// The `series` cloud kernels in `apt-cache search --names-only` output (`NAME -
/// description` lines). Other flavours, `*-unsigned`, `*-dbg`, meta packages and, for
/// 6.12, other releases are ignored; a [`Series::Newest`] kernel older than 7.0 is
/// kept (so that [`select_kernel`] can name it).
pub fn cloud_candidates(series: Series, search_output: &str) -> Vec<Candidate> {
    search_output
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter_map(|package| {
            let abi = package.strip_prefix(series.package_prefix())?;
            if !abi.ends_with(FLAVOUR_SUFFIX) || !abi.starts_with(|c: char| c.is_ascii_digit()) {
                return None;
            }
            let version = AbiVersion::parse(abi)?;
            let wanted = match series {
                Series::Newest => true,
                Series::Lts6_12 => series.accepts(&version),
            };
            wanted.then(|| Candidate { package: package.to_owned(), abi: abi.to_owned(), version })
        })
        .collect()
}

/// The newest `series` cloud kernel in `search_output`; for [`Series::Newest`],
/// refused if it is older than [`MIN_RELEASE`].
pub fn select_kernel(series: Series, search_output: &str) -> Result<Candidate, KernelError> {
    let newest = cloud_candidates(series, search_output)
        .into_iter()
        .max_by(|a, b| a.version.cmp(&b.version).then_with(|| a.abi.cmp(&b.abi)))
        .ok_or(KernelError::NoCloudKernel(series))?;
    if !series.accepts(&newest.version) {
        return Err(KernelError::TooOld(newest.abi));
    }
    Ok(newest)
}

/// How a kernel config has ublk: `Some('y')`, `Some('m')`, or `None`.
pub fn config_ublk(config: &str) -> Option<char> {
    config_tristate(config, "CONFIG_BLK_DEV_UBLK")
}

/// How a kernel config has the tristate `option`: `Some('y')`, `Some('m')`, or `None`.
pub fn config_tristate(config: &str, option: &str) -> Option<char> {
    config.lines().find_map(|line| match line.trim().strip_prefix(option)?.strip_prefix('=')? {
        "y" => Some('y'),
        "m" => Some('m'),
        _ => None,
    })
}

/// One stanza of `apt-cache show`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageInfo {
    /// Package name.
    pub package: String,
    /// Debian version (`7.2.13-1`).
    pub version: String,
    /// Size of the .deb in bytes.
    pub size: u64,
}

/// Parses `apt-cache show` output into its stanzas (those with all three fields).
pub fn parse_show(output: &str) -> Vec<PackageInfo> {
    output
        .split("\n\n")
        .filter_map(|stanza| {
            let field = |name: &str| {
                stanza.lines().find_map(|l| {
                    l.strip_prefix(name).and_then(|v| v.strip_prefix(':')).map(str::trim)
                })
            };
            Some(PackageInfo {
                package: field("Package")?.to_owned(),
                version: field("Version")?.to_owned(),
                size: field("Size")?.parse().ok()?,
            })
        })
        .collect()
}

/// A cached guest kernel.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// `7.2.13+deb14-cloud-amd64`.
    pub abi: String,
    /// Debian version of the packages (`7.2.13-1`).
    pub version: String,
    /// `<cache>/kernel/<abi>`.
    pub dir: PathBuf,
    /// `<cache>/headers/<version>/usr/include` (has `linux/ublk_cmd.h`).
    pub include_dir: PathBuf,
}

impl Kernel {
    /// The kernel image.
    pub fn vmlinuz(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }

    /// The kernel's config.
    pub fn config(&self) -> PathBuf {
        self.dir.join("config")
    }

    /// `ublk_drv.ko`, or `None` if ublk is built in.
    pub fn ublk_module(&self) -> Option<PathBuf> {
        Some(self.dir.join("ublk_drv.ko")).filter(|p| p.exists())
    }

    /// `overlay.ko`, if the kernel has overlayfs as a module.
    pub fn overlay_module(&self) -> Option<PathBuf> {
        Some(self.dir.join("overlay.ko")).filter(|p| p.exists())
    }

    /// `nbd.ko`, if the kernel has its NBD client as a module (the manifest's `nbd=`
    /// says `y` where it is built in, `n` where it is missing).
    pub fn nbd_module(&self) -> Option<PathBuf> {
        Some(self.dir.join("nbd.ko")).filter(|p| p.exists())
    }

    /// The guest's module tree (`depmod -b`'s base: `lib/modules/<abi>` below it), if
    /// the kernel has one (the manifest's `tls=` says why not: `y` built in, `n` missing).
    pub fn modules_base(&self) -> Option<PathBuf> {
        Some(self.dir.join(MODULES_DIR))
            .filter(|p| p.join("lib/modules").join(&self.abi).join("modules.dep").exists())
    }

    /// The cached kernel `abi`, or `None` if it is not (completely) cached, or cached
    /// in an older layout ([`MANIFEST_LAYOUT`]).
    pub fn load(cache: &Cache, abi: &str) -> Result<Option<Self>, KernelError> {
        let dir = cache.kernels().join(abi);
        let manifest = dir.join(MANIFEST);
        let text = match fs::read_to_string(&manifest) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(KernelError::Io("read", manifest, e)),
        };
        let field = |name: &str| {
            text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix('=')).map(str::to_owned)
        };
        let (Some(version), Some(headers)) = (field("version"), field("headers")) else {
            return Err(KernelError::BadManifest(manifest));
        };
        if field("abi").as_deref() != Some(abi) {
            return Err(KernelError::BadManifest(manifest));
        }
        let kernel = Self {
            abi: abi.to_owned(),
            version,
            include_dir: cache.headers().join(headers).join("usr/include"),
            dir,
        };
        let layout = field("layout").and_then(|l| l.parse::<u32>().ok()).unwrap_or(1);
        let complete = layout >= MANIFEST_LAYOUT
            && kernel.vmlinuz().exists()
            && kernel.include_dir.join("linux/ublk_cmd.h").exists();
        Ok(complete.then_some(kernel))
    }
}

/// The `series` kernel the last [`fetch`] of that series chose, or a [`fetch`] if none
/// is cached.
pub fn current_or_fetch(cache: &Cache, series: Series) -> Result<Kernel, KernelError> {
    if let Ok(abi) = fs::read_to_string(cache.current(series))
        && let Some(kernel) = Kernel::load(cache, abi.trim())?
        && AbiVersion::parse(&kernel.abi).is_some_and(|v| series.accepts(&v))
    {
        return Ok(kernel);
    }
    fetch(cache, series)
}

/// Resolves the newest `series` cloud kernel and makes sure it and its headers are
/// cached; records it as the series' current kernel.
pub fn fetch(cache: &Cache, series: Series) -> Result<Kernel, KernelError> {
    let search = run_tool(Command::new("apt-cache").args([
        "search",
        "--names-only",
        series.search_pattern(),
    ]))?;
    let candidate = select_kernel(series, &search)?;
    if let Some(kernel) = Kernel::load(cache, &candidate.abi)? {
        set_current(cache, series, &kernel)?;
        progress!("kernel cached: {} ({})", kernel.abi, kernel.dir.display());
        return Ok(kernel);
    }

    let _lock = cache.lock()?;
    // Another ublkd-vm may have fetched it while this one waited for the lock.
    if let Some(kernel) = Kernel::load(cache, &candidate.abi)? {
        set_current(cache, series, &kernel)?;
        progress!("kernel cached: {} ({})", kernel.abi, kernel.dir.display());
        return Ok(kernel);
    }
    let started = Instant::now();
    let tmp = cache.tmp().join(format!("fetch-{}", std::process::id()));
    remove_dir_if_exists(&tmp)?;
    cache.create_dir(&tmp)?;
    let result = download_and_unpack(cache, series, &candidate, &tmp);
    let cleanup = remove_dir_if_exists(&tmp);
    let kernel = result?;
    cleanup?;
    set_current(cache, series, &kernel)?;
    progress!(
        "kernel cached: {} ({}, fetched in {:.1} s)",
        kernel.abi,
        kernel.dir.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(kernel)
}

/// `NAME/suite`, or `NAME` for apt's candidate.
fn apt_spec(name: &str, suite: Option<&str>) -> String {
    match suite {
        Some(suite) => format!("{name}/{suite}"),
        None => name.to_owned(),
    }
}

fn download_and_unpack(
    cache: &Cache,
    series: Series,
    candidate: &Candidate,
    tmp: &Path,
) -> Result<Kernel, KernelError> {
    let abi = &candidate.abi;
    let wanted = series.packages(abi);
    let headers_wanted = (HEADERS_PACKAGE.to_owned(), Some(SID));
    // --no-all-versions: one stanza per package, the version `apt-get download` takes.
    let show = run_tool(
        Command::new("apt-cache")
            .args(["show", "--no-all-versions"])
            .args(wanted.iter().chain([&headers_wanted]).map(|(n, suite)| apt_spec(n, *suite))),
    )?;
    let infos = parse_show(&show);
    let info = |(name, suite): &(String, Option<&'static str>)| {
        infos
            .iter()
            .find(|i| &i.package == name)
            .cloned()
            .ok_or_else(|| KernelError::NotInApt(apt_spec(name, *suite)))
    };
    let headers = info(&headers_wanted)?;
    // The package named after the ABI gives the kernel's version.
    let version = infos
        .iter()
        .find(|i| i.package == candidate.package)
        .map(|i| i.version.clone())
        .ok_or_else(|| KernelError::NotInApt(candidate.package.clone()))?;
    if headers.version != version {
        progress!(
            "note: kernel {abi} is {version}; its uapi headers are sid's {HEADERS_PACKAGE} {}",
            headers.version,
        );
    }

    let root = tmp.join("root");
    for entry in &wanted {
        let deb = download(&info(entry)?, entry.1, tmp)?;
        unpack(&deb, &root)?;
    }
    let headers_dir = cache.headers().join(&headers.version);
    if !headers_dir.join("usr/include/linux/ublk_cmd.h").exists() {
        let deb = download(&headers, headers_wanted.1, tmp)?;
        let unpacked = tmp.join("headers");
        unpack(&deb, &unpacked)?;
        if !unpacked.join("usr/include/linux/ublk_cmd.h").exists() {
            return Err(KernelError::MissingFile {
                abi: abi.clone(),
                what: format!(
                    "usr/include/linux/ublk_cmd.h in {HEADERS_PACKAGE} {}",
                    headers.version
                ),
            });
        }
        cache.create_dir(&cache.headers())?;
        remove_dir_if_exists(&headers_dir)?;
        rename(&unpacked, &headers_dir)?;
    }

    let missing = |what: &str| KernelError::MissingFile { abi: abi.clone(), what: what.to_owned() };
    let moddir = [root.join("usr/lib/modules").join(abi), root.join("lib/modules").join(abi)]
        .into_iter()
        .find(|d| d.is_dir())
        .ok_or_else(|| missing("modules directory"))?;
    let vmlinuz = [moddir.join("vmlinuz"), root.join(format!("boot/vmlinuz-{abi}"))]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| missing("vmlinuz"))?;
    let config = [moddir.join("config"), root.join(format!("boot/config-{abi}"))]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| missing("kernel config"))?;
    let config_text =
        fs::read_to_string(&config).map_err(|e| KernelError::Io("read", config.clone(), e))?;
    let ublk = config_ublk(&config_text).ok_or_else(|| KernelError::NoUblk(abi.clone()))?;

    let out = tmp.join("kernel");
    cache.create_dir(&out)?;
    copy(&vmlinuz, &out.join("vmlinuz"))?;
    copy(&config, &out.join("config"))?;
    if ublk == 'm' {
        let ko = find_module(&moddir, "ublk_drv")?.ok_or_else(|| missing("ublk_drv.ko"))?;
        decompress_module(&ko, &out.join("ublk_drv.ko"))?;
    }
    if let Some(ko) = find_module(&moddir, "overlay")? {
        decompress_module(&ko, &out.join("overlay.ko"))?;
    }
    // The kernel's NBD client: optional (bench/run nbd says so where it is missing).
    let nbd = config_tristate(&config_text, "CONFIG_BLK_DEV_NBD").unwrap_or('n');
    if nbd == 'm'
        && let Some(ko) = find_module(&moddir, "nbd")?
    {
        decompress_module(&ko, &out.join("nbd.ko"))?;
    }
    // Kernel TLS's modules for the guest's /lib/modules.
    let tls = config_tristate(&config_text, "CONFIG_TLS").unwrap_or('n');
    let guest_modules = if tls == 'm' {
        keep_guest_modules(&moddir, abi, &out.join(MODULES_DIR))?
    } else {
        Vec::new()
    };
    let mut manifest = String::new();
    let _ = writeln!(manifest, "layout={MANIFEST_LAYOUT}");
    let _ = writeln!(manifest, "abi={abi}");
    let _ = writeln!(manifest, "series={series}");
    let _ = writeln!(manifest, "version={version}");
    let _ = writeln!(manifest, "headers={}", headers.version);
    let _ = writeln!(manifest, "ublk={ublk}");
    let _ = writeln!(manifest, "nbd={nbd}");
    let _ = writeln!(manifest, "tls={tls}");
    let _ = writeln!(manifest, "modules={}", guest_modules.join(","));
    write(&out.join(MANIFEST), manifest.as_bytes())?;

    let dir = cache.kernels().join(abi);
    cache.create_dir(&cache.kernels())?;
    remove_dir_if_exists(&dir)?;
    rename(&out, &dir)?;
    Kernel::load(cache, abi)?.ok_or_else(|| missing("complete cache entry after unpacking"))
}

/// `apt-get download NAME[/suite]` into `dir`; returns the .deb's path.
fn download(
    package: &PackageInfo,
    suite: Option<&str>,
    dir: &Path,
) -> Result<PathBuf, KernelError> {
    progress!(
        "downloading {} {} ({:.1} MB)",
        package.package,
        package.version,
        package.size as f64 / 1e6
    );
    run_tool(
        Command::new("apt-get")
            .current_dir(dir)
            .args(["download", "-q", "-o", "APT::Sandbox::User=root"])
            .arg(apt_spec(&package.package, suite)),
    )?;
    let prefix = format!("{}_", package.package);
    let entries = fs::read_dir(dir).map_err(|e| KernelError::Io("list", dir.into(), e))?;
    entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
        })
        .ok_or_else(|| KernelError::MissingFile {
            abi: package.package.clone(),
            what: format!("{prefix}*.deb after apt-get download"),
        })
}

fn unpack(deb: &Path, into: &Path) -> Result<(), KernelError> {
    run_tool(Command::new("dpkg-deb").arg("-x").arg(deb).arg(into)).map(drop)
}

/// Finds `<name>.ko.xz` or `<name>.ko` under `dir`.
fn find_module(dir: &Path, name: &str) -> Result<Option<PathBuf>, KernelError> {
    let mut index = BTreeMap::new();
    index_modules(dir, dir, &mut index)?;
    Ok(index.remove(&module_name(name)).map(|rel| dir.join(rel)))
}

/// Decompresses [`GUEST_MODULES`] and what they depend on from the package's module
/// directory `moddir` into `base/lib/modules/<abi>/` (same relative paths), copies the
/// package's [`MODULE_INDEX_FILES`] and runs `depmod -b base abi`. Returns the modules
/// kept, by name.
fn keep_guest_modules(moddir: &Path, abi: &str, base: &Path) -> Result<Vec<String>, KernelError> {
    let mut index = BTreeMap::new();
    index_modules(moddir, moddir, &mut index)?;
    let tree = base.join("lib/modules").join(abi);
    let modinfo = kmod_tool("modinfo");
    let kept = module_closure(GUEST_MODULES, |name| -> Result<_, KernelError> {
        let Some(rel) = index.get(&module_name(name)) else { return Ok(None) };
        let to = tree.join(rel.with_extension("").with_extension("ko"));
        let parent = to.parent().unwrap_or(&tree);
        fs::create_dir_all(parent).map_err(|e| KernelError::Io("create", parent.into(), e))?;
        decompress_module(&moddir.join(rel), &to)?;
        let depends = run_tool(Command::new(&modinfo).args(["-F", "depends"]).arg(&to))?;
        Ok(Some(parse_depends(&depends)))
    })?;
    for name in MODULE_INDEX_FILES {
        let from = moddir.join(name);
        if from.is_file() {
            copy(&from, &tree.join(name))?;
        }
    }
    run_tool(Command::new(kmod_tool("depmod")).arg("-b").arg(base).arg(abi))?;
    if !tree.join("modules.dep").is_file() {
        return Err(KernelError::MissingFile {
            abi: abi.to_owned(),
            what: format!("{} after depmod", tree.join("modules.dep").display()),
        });
    }
    Ok(kept)
}

/// `name` as `modules.dep` and `modinfo`'s `depends=` spell it: `-` becomes `_`.
fn module_name(name: &str) -> String {
    name.replace('-', "_")
}

/// The module names in `modinfo -F depends` output (`a,b` or nothing).
fn parse_depends(output: &str) -> Vec<String> {
    output.split([',', '\n']).map(str::trim).filter(|n| !n.is_empty()).map(module_name).collect()
}

/// `seeds` and everything they depend on, in the order first reached, each visited once.
/// `depends(name)` keeps the module and returns what it depends on, or `None` if the
/// kernel has no such module (a seed of another kernel version: skipped).
fn module_closure<E>(
    seeds: &[&str],
    mut depends: impl FnMut(&str) -> Result<Option<Vec<String>>, E>,
) -> Result<Vec<String>, E> {
    let mut seen = BTreeSet::new();
    let mut kept = Vec::new();
    let mut queue: VecDeque<String> = seeds.iter().map(|s| module_name(s)).collect();
    while let Some(name) = queue.pop_front() {
        if !seen.insert(name.clone()) {
            continue;
        }
        if let Some(deps) = depends(&name)? {
            kept.push(name);
            queue.extend(deps);
        }
    }
    Ok(kept)
}

/// Every module below `dir`, by [`module_name`], with its path relative to `root`.
fn index_modules(
    root: &Path,
    dir: &Path,
    index: &mut BTreeMap<String, PathBuf>,
) -> Result<(), KernelError> {
    let entries = fs::read_dir(dir).map_err(|e| KernelError::Io("list", dir.into(), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| KernelError::Io("list", dir.into(), e))?;
        let path = entry.path();
        let file_type = entry.file_type().map_err(|e| KernelError::Io("stat", path.clone(), e))?;
        if file_type.is_dir() {
            index_modules(root, &path, index)?;
            continue;
        }
        let file = entry.file_name();
        let file = file.to_string_lossy();
        if let Some(stem) = file.strip_suffix(".ko.xz").or_else(|| file.strip_suffix(".ko"))
            && let Ok(rel) = path.strip_prefix(root)
        {
            index.insert(module_name(stem), rel.to_owned());
        }
    }
    Ok(())
}

/// A kmod tool by its path in `/usr/sbin` or `/sbin` (root's PATH may lack both), else
/// by name.
fn kmod_tool(name: &str) -> PathBuf {
    ["/usr/sbin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

fn decompress_module(ko: &Path, to: &Path) -> Result<(), KernelError> {
    if ko.extension().is_some_and(|e| e == "xz") {
        let out = File::create(to).map_err(|e| KernelError::Io("create", to.into(), e))?;
        run_tool(Command::new("xz").arg("-dc").arg(ko).stdout(out)).map(drop)
    } else {
        copy(ko, to)
    }
}

fn set_current(cache: &Cache, series: Series, kernel: &Kernel) -> Result<(), KernelError> {
    let current = cache.current(series);
    if fs::read_to_string(&current).is_ok_and(|c| c.trim() == kernel.abi) {
        return Ok(());
    }
    cache.create_dir(cache.root())?;
    let tmp = current.with_extension(format!("tmp-{}", std::process::id()));
    write(&tmp, format!("{}\n", kernel.abi).as_bytes())?;
    rename(&tmp, &current)
}

/// Runs a host tool, returning its stdout; a failure carries the end of its stderr.
fn run_tool(cmd: &mut Command) -> Result<String, KernelError> {
    let line = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let output = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| KernelError::Spawn(line.clone(), e))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        return Err(KernelError::ToolFailed {
            cmd: line,
            status: output.status,
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join(" / "),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn remove_dir_if_exists(dir: &Path) -> Result<(), KernelError> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(KernelError::Io("remove", dir.into(), e))
        }
        _ => Ok(()),
    }
}

fn rename(from: &Path, to: &Path) -> Result<(), KernelError> {
    fs::rename(from, to).map_err(|e| KernelError::Io("rename into place", to.into(), e))
}

fn copy(from: &Path, to: &Path) -> Result<(), KernelError> {
    fs::copy(from, to).map(drop).map_err(|e| KernelError::Io("copy", from.into(), e))
}

fn write(path: &Path, data: &[u8]) -> Result<(), KernelError> {
    fs::write(path, data).map_err(|e| KernelError::Io("write", path.into(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEARCH: &str = "\
linux-binary-unsigned-7.2.13+deb14-cloud-amd64 - Linux 7.2.13 for x86-64 cloud (unsigned kernel image)
linux-binary-7.2.13+deb14-cloud-amd64 - Linux 7.2.13 for x86-64 cloud (kernel image)
linux-binary-7.3.1+deb14-amd64 - Linux 7.3.1 for 64-bit PCs (kernel image)
linux-binary-7.3.1+deb14-rt-amd64 - Linux 7.3.1 for 64-bit PCs (kernel image)
linux-binary-7.10.2+deb14-cloud-amd64 - Linux 7.10.2 for x86-64 cloud (kernel image)
linux-binary-7.9.20+deb14-cloud-amd64 - Linux 7.9.20 for x86-64 cloud (kernel image)
";

    /// `apt-cache search --names-only '^linux-image-6\.12\.[0-9].*-cloud-amd64$'` on Debian 12
    /// (bookworm-security), with a trixie ABI and the neighbours the pattern cannot rule
    /// out added.
    const SEARCH_612: &str = "\
linux-image-6.12.100+deb12-cloud-amd64 - Linux 6.12 for x86-64 cloud (signed)
linux-image-6.12.117+deb12-cloud-amd64 - Linux 6.12 for x86-64 cloud (signed)
linux-image-6.12.117+deb12-cloud-amd64-unsigned - Linux 6.12 for x86-64 cloud
linux-image-6.12.117+deb12-cloud-amd64-dbg - Debug symbols for linux-image-6.12.117+deb12-cloud-amd64
linux-image-6.12.9+deb12-cloud-amd64 - Linux 6.12 for x86-64 cloud (signed)
linux-image-6.12-cloud-amd64 - Linux for x86-64 cloud (meta-package)
linux-image-6.12.117+deb12-amd64 - Linux 6.12 for 64-bit PCs (signed)
linux-image-6.1.0-47-cloud-amd64 - Linux 6.1 for x86-64 cloud (signed)
linux-image-6.13.2+deb12-cloud-amd64 - Linux 6.13 (made up: another release)
";

    #[test]
    fn newest_612_cloud_image_wins_and_meta_unsigned_dbg_and_other_releases_are_ignored() {
        let abis: Vec<String> =
            cloud_candidates(Series::Lts6_12, SEARCH_612).into_iter().map(|c| c.abi).collect();
        assert_eq!(
            abis,
            [
                "6.12.100+deb12-cloud-amd64",
                "6.12.117+deb12-cloud-amd64",
                "6.12.9+deb12-cloud-amd64"
            ]
        );
        let chosen = select_kernel(Series::Lts6_12, SEARCH_612).unwrap();
        assert_eq!(chosen.abi, "6.12.117+deb12-cloud-amd64");
        assert_eq!(chosen.package, "linux-image-6.12.117+deb12-cloud-amd64");
    }

    #[test]
    fn a_trixie_612_build_beats_bookworm_s_at_the_same_patch_level() {
        let search = "linux-image-6.12.117+deb12-cloud-amd64 - Linux\n\
                      linux-image-6.12.117+deb13-cloud-amd64 - Linux\n\
                      linux-image-6.12.48+deb13-cloud-amd64 - Linux\n";
        let chosen = select_kernel(Series::Lts6_12, search).unwrap();
        assert_eq!(chosen.abi, "6.12.117+deb13-cloud-amd64");
    }

    #[test]
    fn no_612_cloud_image_is_refused_naming_the_packages() {
        let err = select_kernel(Series::Lts6_12, SEARCH).unwrap_err();
        assert!(matches!(err, KernelError::NoCloudKernel(Series::Lts6_12)));
        assert!(err.to_string().contains("linux-image-6.12.*-cloud-amd64"), "{err}");
        assert!(err.is_refusal());
    }

    #[test]
    fn the_series_searches_do_not_see_each_other_s_packages() {
        // sid's linux-binary-* are not 6.12 images, and 6.12 images are not linux-binary-*.
        assert!(cloud_candidates(Series::Lts6_12, SEARCH).is_empty());
        assert!(cloud_candidates(Series::Newest, SEARCH_612).is_empty());
    }

    #[test]
    fn series_names_parse_and_print() {
        for series in Series::ALL {
            assert_eq!(series.name().parse::<Series>(), Ok(series));
            assert_eq!(series.to_string(), series.name());
        }
        assert_eq!("7.x".parse(), Ok(Series::Newest));
        assert_eq!("newest".parse(), Ok(Series::Newest));
        assert_eq!(" 6.12 ".parse(), Ok(Series::Lts6_12));
        assert_eq!(Series::default(), Series::Newest);
        for bad in ["", "6", "6.1", "6.13", "7.2", "latest-lts"] {
            let err = bad.parse::<Series>().unwrap_err();
            assert_eq!(err, UnknownSeries(bad.to_owned()));
            assert!(err.to_string().contains("6.12"), "{err}");
        }
    }

    #[test]
    fn each_series_accepts_only_its_releases() {
        let v = |s| AbiVersion::parse(s).unwrap();
        assert!(Series::Lts6_12.accepts(&v("6.12.117+deb12-cloud-amd64")));
        assert!(!Series::Lts6_12.accepts(&v("6.12-cloud-amd64")));
        assert!(!Series::Lts6_12.accepts(&v("6.1.0-47-cloud-amd64")));
        assert!(!Series::Lts6_12.accepts(&v("7.2.13+deb14-cloud-amd64")));
        assert!(Series::Newest.accepts(&v("7.2.13+deb14-cloud-amd64")));
        assert!(!Series::Newest.accepts(&v("6.12.117+deb12-cloud-amd64")));
    }

    #[test]
    fn the_612_image_is_one_package_from_apt_s_candidate_and_sid_s_are_three() {
        assert_eq!(
            Series::Lts6_12.packages("6.12.117+deb12-cloud-amd64"),
            [("linux-image-6.12.117+deb12-cloud-amd64".to_owned(), None)]
        );
        let sid = Series::Newest.packages("7.2.13+deb14-cloud-amd64");
        assert_eq!(sid.len(), 3);
        assert!(sid.iter().all(|(_, suite)| *suite == Some("sid")));
        assert_eq!(apt_spec("linux-libc-dev", Some("sid")), "linux-libc-dev/sid");
        assert_eq!(apt_spec("linux-image-x", None), "linux-image-x");
    }

    #[test]
    fn newest_cloud_kernel_wins_numerically() {
        let chosen = select_kernel(Series::Newest, SEARCH).unwrap();
        assert_eq!(chosen.abi, "7.10.2+deb14-cloud-amd64");
        assert_eq!(chosen.package, "linux-binary-7.10.2+deb14-cloud-amd64");
    }

    #[test]
    fn other_flavours_and_unsigned_images_are_ignored() {
        let abis: Vec<String> =
            cloud_candidates(Series::Newest, SEARCH).into_iter().map(|c| c.abi).collect();
        assert_eq!(
            abis,
            ["7.2.13+deb14-cloud-amd64", "7.10.2+deb14-cloud-amd64", "7.9.20+deb14-cloud-amd64"]
        );
    }

    #[test]
    fn only_kernel_older_than_7_is_refused_naming_it() {
        let search = "linux-binary-6.19.4+deb14-cloud-amd64 - Linux\n\
                      linux-binary-7.1.0+deb14-amd64 - Linux (not cloud)\n";
        let err = select_kernel(Series::Newest, search).unwrap_err();
        assert!(matches!(&err, KernelError::TooOld(abi) if abi == "6.19.4+deb14-cloud-amd64"));
        assert!(err.to_string().contains("6.19.4+deb14-cloud-amd64"));
        assert!(err.is_refusal());
    }

    #[test]
    fn no_cloud_kernel_at_all_is_refused() {
        let err =
            select_kernel(Series::Newest, "linux-binary-7.2.13+deb14-amd64 - Linux\n").unwrap_err();
        assert!(matches!(err, KernelError::NoCloudKernel(Series::Newest)));
    }

    #[test]
    fn seven_point_zero_is_accepted() {
        let search = "linux-binary-7.0.1+deb14-cloud-amd64 - Linux\n";
        assert_eq!(select_kernel(Series::Newest, search).unwrap().abi, "7.0.1+deb14-cloud-amd64");
    }

    #[test]
    fn final_release_is_newer_than_its_rc_and_revisions_order() {
        let v = |s| AbiVersion::parse(s).unwrap();
        assert!(v("7.3-rc5+deb14-cloud-amd64") < v("7.3+deb14-cloud-amd64"));
        assert!(v("7.3-rc5+deb14-cloud-amd64") < v("7.3-rc6+deb14-cloud-amd64"));
        assert!(v("6.1.0-28-cloud-amd64") < v("6.1.0-30-cloud-amd64"));
        assert!(v("7.2.13+deb14-cloud-amd64") < v("7.2.13+deb15-cloud-amd64"));
        assert!(AbiVersion::parse("cloud-amd64").is_none());
    }

    #[test]
    fn config_ublk_reads_module_builtin_and_absent() {
        assert_eq!(config_ublk("CONFIG_A=y\nCONFIG_BLK_DEV_UBLK=m\n"), Some('m'));
        assert_eq!(config_ublk("CONFIG_BLK_DEV_UBLK=y\n"), Some('y'));
        assert_eq!(config_ublk("# CONFIG_BLK_DEV_UBLK is not set\n"), None);
        assert_eq!(config_ublk("CONFIG_BLK_DEV_UBLK_LEGACY_OPCODES=y\n"), None);
        assert_eq!(config_tristate("CONFIG_BLK_DEV_NBD=m\n", "CONFIG_BLK_DEV_NBD"), Some('m'));
        assert_eq!(config_tristate("CONFIG_BLK_DEV_NBDX=m\n", "CONFIG_BLK_DEV_NBD"), None);
    }

    #[test]
    fn guest_modules_are_the_seeds_present_and_their_dependencies_once_each() {
        // 6.12's shape: gcm needs crypto_null, ghash-generic gf128mul; 7.2's chacha.ko is absent.
        let deps = BTreeMap::from([
            ("tls", ""),
            ("gcm", "crypto_null"),
            ("ghash_generic", "gf128mul"),
            ("gf128mul", ""),
            ("crypto_null", ""),
            ("chacha20poly1305", "libpoly1305,libchacha"),
            ("libpoly1305", ""),
            ("libchacha", ""),
        ]);
        let mut asked = Vec::new();
        let kept = module_closure::<()>(
            &["tls", "gcm", "ghash-generic", "chacha", "chacha20poly1305", "gf128mul"],
            |name| {
                asked.push(name.to_owned());
                Ok(deps.get(name).map(|d| parse_depends(d)))
            },
        )
        .unwrap();
        assert_eq!(
            kept,
            [
                "tls",
                "gcm",
                "ghash_generic",
                "chacha20poly1305",
                "gf128mul",
                "crypto_null",
                "libpoly1305",
                "libchacha"
            ]
        );
        assert_eq!(asked.iter().filter(|n| *n == "gf128mul").count(), 1);
        assert!(asked.contains(&"chacha".to_owned()));
    }

    #[test]
    fn modinfo_depends_output_is_split_and_spelt_like_modules_dep() {
        assert_eq!(parse_depends("\n"), Vec::<String>::new());
        assert_eq!(parse_depends("crypto_null\n"), ["crypto_null"]);
        assert_eq!(parse_depends("libpoly1305,crypto-simd\n"), ["libpoly1305", "crypto_simd"]);
        assert_eq!(module_name("ghash-clmulni-intel"), "ghash_clmulni_intel");
    }

    #[test]
    fn apt_cache_show_stanzas_are_parsed() {
        let out = "Package: linux-libc-dev\nSource: linux\nVersion: 7.2.13-1\nSize: 2034488\n\n\
                   Package: linux-binary-7.2.13+deb14-cloud-amd64\nVersion: 7.2.13-1\nSize: 13717736\n";
        let infos = parse_show(out);
        assert_eq!(infos.len(), 2);
        assert_eq!(infos[1].package, "linux-binary-7.2.13+deb14-cloud-amd64");
        assert_eq!(infos[1].size, 13_717_736);
        assert_eq!(infos[0].version, "7.2.13-1");
    }
}
