"""The peers as the host builds them, into the cache dir outside the repository: kublk
from Debian's linux-source, rublk with `cargo install`. Each build returns its path and
its versions; bench.py and recovery.py hand them to HostRun.build_peer, which leaves a
peer that fails out of the run. Python 3 standard library only.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile

import params as P
from benchlib import log, run


def apt_version(pkg, release):
    out = run(["apt-cache", "show", "--no-all-versions", f"{pkg}/{release}"])
    m = re.search(r"^Version: (\S+)", out, re.M)
    if not m:
        raise RuntimeError(f"apt has no {pkg} in {release} (try `apt-get update`)")
    return m.group(1)


def pick_linux_source():
    if P.KUBLK_SOURCE_PACKAGE != "auto":
        return P.KUBLK_SOURCE_PACKAGE
    names = run(["apt-cache", "pkgnames", "linux-source-"]).split()
    best = None
    for n in names:
        m = re.fullmatch(r"linux-source-(\d+)\.(\d+)", n)
        if m and (best is None or (int(m[1]), int(m[2])) > best[0]):
            best = ((int(m[1]), int(m[2])), n)
    if not best:
        raise RuntimeError("apt knows no linux-source-X.Y package (try `apt-get update`)")
    return best[1]


def build_kublk(cache, rebuild):
    """kublk, the kernel's ublk selftest server, from Debian's linux-source, compiled
    against the same release's uapi headers and liburing (static), none installed.
    Returns (path, its versions: a dict)."""
    rel = P.KUBLK_RELEASE
    src = pick_linux_source()
    vsrc = apt_version(src, rel)
    vlibc = apt_version("linux-libc-dev", rel)
    vuring = apt_version("liburing-dev", rel)
    m = re.match(r"(\d+)\.(\d+)", vuring)
    if not m or (int(m[1]), int(m[2])) < P.LIBURING_MIN:
        raise RuntimeError(f"liburing-dev/{rel} is {vuring}, need >= "
                           + ".".join(map(str, P.LIBURING_MIN)))
    versions = {"source": f"{src} {vsrc}", "linux-libc-dev": vlibc, "liburing-dev": vuring}
    key = f"{src}_{vsrc}+libc_{vlibc}+uring_{vuring}".replace(":", "_")
    out = os.path.join(cache, "kublk", key, "kublk")
    if os.path.exists(out) and not rebuild:
        return out, versions
    log(f"building kublk from {src} {vsrc} ({rel}), liburing {vuring}, headers {vlibc}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    work = tempfile.mkdtemp(prefix="build-", dir=os.path.join(cache, "kublk"))
    try:
        os.chmod(work, 0o755)  # lets apt's _apt user write there (else a warning)
        run(["apt-get", "download", "-q", f"{src}/{rel}", f"linux-libc-dev/{rel}",
             f"liburing-dev/{rel}"], cwd=work)
        x = os.path.join(work, "x")
        for deb in glob.glob(os.path.join(work, "*.deb")):
            run(["dpkg-deb", "-x", deb, x])
        tarball = glob.glob(os.path.join(x, "usr/src/linux-source-*.tar.*"))
        if not tarball:
            raise RuntimeError(f"{src} holds no usr/src/linux-source-*.tar.*")
        run(["tar", "-xf", tarball[0], "-C", work, "--wildcards",
             "*/tools/testing/selftests/ublk/*"])
        srcdir = glob.glob(os.path.join(work, "*/tools/testing/selftests/ublk"))[0]
        sources = sorted(f for f in glob.glob(os.path.join(srcdir, "*.c"))
                         if os.path.basename(f) != "metadata_size.c")
        triplet = run(["gcc", "-print-multiarch"]).strip() or "x86_64-linux-gnu"
        inc = os.path.join(x, "usr/include")
        run(["gcc", "-O3", "-Wall", "-D_GNU_SOURCE", "-I", inc,
             "-I", os.path.join(inc, triplet), "-o", out + ".tmp", *sources,
             os.path.join(x, "usr/lib", triplet, "liburing.a"), "-lpthread", "-lm"])
        os.rename(out + ".tmp", out)
        with open(os.path.join(os.path.dirname(out), "versions.json"), "w") as f:
            json.dump(versions, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out, versions


def build_rublk(cache, rebuild):
    """rublk from crates.io with `cargo install`, into the cache. Returns (path, its
    version: a string)."""
    root = os.path.join(cache, "rublk")
    binp = os.path.join(root, "bin", "rublk")
    if os.path.exists(binp) and not rebuild:
        return binp, run([binp, "--version"]).strip()
    if subprocess.run(["dpkg", "-s", "libclang-dev"], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode != 0:
        log("installing libclang-dev (rublk's bindgen needs it)")
        run(["apt-get", "install", "-y", "-q", "-t", "bookworm",
             "--no-install-recommends", "libclang-dev"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    spec = ["rublk"] + (["--version", P.RUBLK_VERSION] if P.RUBLK_VERSION else [])
    log(f"building rublk with cargo install (a few minutes) into {root}")
    cmd = ["cargo", "install", *spec, "--locked", "--force", "--root", root]
    env = {**os.environ, "CARGO_TARGET_DIR": os.path.join(cache, "rublk-target")}
    try:
        # cwd = the cache: the repository's rust-toolchain.toml must not apply.
        run(cmd, cwd=cache, env=env, timeout=P.RUBLK_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`cargo install rublk` took over {P.RUBLK_BUILD_TIMEOUT_S} s")
    return binp, run([binp, "--version"]).strip()

