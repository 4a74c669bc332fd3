#!/usr/bin/env python3
"""ublkd's benchmark: ublkd against kublk (with and without -b) and rublk, in one VM boot.

Run through `bench/run` (see bench/README.md). Three halves, one file:

  host    build ublkd and the peers, boot the VM, collect its records, write the results
  guest   (inside the VM) the rounds: add a device per server, run fio, measure, delete
  report  re-render the table and the plot of an earlier results dir

Python 3 standard library only. The parameters are in bench/params.py.
"""

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import params as P  # noqa: E402

REC = "@@UBLKD-BENCH-REC@@ "
META = "@@UBLKD-BENCH-META@@ "
DONE = "@@UBLKD-BENCH-DONE@@"


def log(msg):
    print(f"[bench] {msg}", flush=True)


def die(msg, code=1):
    print(f"bench: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


# ======================================================================================
# host: peers
# ======================================================================================

def run(cmd, **kw):
    """Run a command; on failure raise with its last output lines."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.STDOUT)
    kw.setdefault("text", True)
    p = subprocess.run(cmd, **kw)
    if p.returncode != 0:
        out = (p.stdout or "").strip().splitlines()
        tail = "\n    ".join(out[-15:])
        raise RuntimeError(f"`{' '.join(cmd)}` exited {p.returncode}:\n    {tail}")
    return p.stdout or ""


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
    against the same release's uapi headers and liburing (static), none installed."""
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
    """rublk from crates.io with `cargo install`, into the cache."""
    root = os.path.join(cache, "rublk")
    binp = os.path.join(root, "bin", "rublk")
    if os.path.exists(binp) and not rebuild:
        ver = run([binp, "--version"]).strip()
        return binp, {"rublk": ver}
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
    ver = run([binp, "--version"]).strip()
    return binp, {"rublk": ver}


# ======================================================================================
# host: the run
# ======================================================================================

def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.isupper()}
    if args.quick:
        for k, v in P.QUICK.items():
            prm[k] = v
    if isinstance(prm["JOBS"], list):
        prm["JOBS"] = {j: P.JOBS[j] for j in prm["JOBS"]}
    if args.rounds:
        prm["ROUNDS"] = args.rounds
    if args.runtime:
        prm["RUNTIME_S"] = args.runtime
    if args.servers:
        prm["SERVERS"] = args.servers.split(",")
        for s in prm["SERVERS"]:
            if s not in P.SERVERS:
                die(f"unknown server {s!r}; known: {', '.join(P.SERVERS)}", 2)
    if args.jobs:
        names = args.jobs.split(",")
        for j in names:
            if j not in P.JOBS:
                die(f"unknown job {j!r}; known: {', '.join(P.JOBS)}", 2)
        prm["JOBS"] = {j: P.JOBS[j] for j in names}
    prm.pop("QUICK", None)
    return prm


def runs_job(prm, server, job):
    """Whether `server` runs `job` (SERVER_JOBS limits some variants to some jobs)."""
    only = prm.get("SERVER_JOBS", {}).get(server)
    return only is None or job in only


def estimate_s(prm):
    runs = prm["ROUNDS"] * sum(1 for s in prm["SERVERS"] for j in prm["JOBS"]
                               if runs_job(prm, s, j))
    return runs * (prm["RUNTIME_S"] + prm["RAMP_S"] + prm["OVERHEAD_PER_RUN_S"]) + 30


def build_baseline(rev):
    """Builds ublkd at git revision `rev` (a worktree under target/) for `--baseline`:
    the same jobs against the code before a change, in the same boot."""
    base = os.path.join(REPO, "target", "bench-baseline")
    src, tgt = os.path.join(base, "src"), os.path.join(base, "target")
    try:
        full = run(["git", "-C", REPO, "rev-parse", "--verify", rev + "^{commit}"]).strip()
    except RuntimeError as e:
        die(f"--baseline {rev}: not a commit of this repository: {e}", 2)
    if os.path.exists(src):
        run(["git", "-C", REPO, "worktree", "remove", "--force", src])
    run(["git", "-C", REPO, "worktree", "add", "--detach", src, full])
    log(f"building the baseline {full[:12]} (cargo build --release in {src})")
    try:
        run(["cargo", "build", "--release", "--workspace", "--bins"], cwd=src,
            env={**os.environ, "CARGO_TARGET_DIR": tgt})
    except RuntimeError as e:
        die(f"the baseline {rev} does not build: {e}")
    return os.path.join(tgt, "release"), full[:12]


def git_rev():
    try:
        rev = run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]).strip()
        dirty = run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"])
        return rev + ("-dirty" if dirty.strip() else "")
    except Exception:
        return "unknown"


def host_sample(root):
    """(host busy CPU s, CPU s of `root`'s live process tree — the VM —, monotonic s)."""
    kids, cpu = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            kids.setdefault(int(rest[1]), []).append(int(d))
            cpu[int(d)] = (int(rest[11]) + int(rest[12])) / CLK_TCK
    tree, todo = 0.0, [root]
    while todo:
        p = todo.pop()
        tree += cpu.get(p, 0.0)
        todo.extend(kids.get(p, []))
    return sys_busy_s(), tree, time.monotonic()


def run_guest(cmd, outdir, markers):
    """Runs `cmd` (the VM with a guest script) and follows its console: every line goes
    to outdir/console.log, progress and errors to the terminal, and the guest's records
    (`markers` = (record, meta, done) prefixes) are collected, each record with the
    host's load and the CPU the host spent on other work than the VM meanwhile.
    Returns (records, meta, exit status, whether the guest said it was done)."""
    rec, meta_marker, done_marker = markers
    records, meta, done = [], {}, False
    console = open(os.path.join(outdir, "console.log"), "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", bufsize=1)
    prev = host_sample(proc.pid)
    try:
        for line in proc.stdout:
            console.write(line)
            console.flush()
            for marker in (rec, meta_marker):
                i = line.find(marker)
                if i >= 0:
                    try:
                        obj = json.loads(line[i + len(marker):])
                    except ValueError:
                        print(f"bench: a record line was garbled on the console, dropped: "
                              f"{line.strip()[:200]}", flush=True)
                        break
                    if marker == rec:
                        obj["host_load1"] = os.getloadavg()[0]
                        cur = host_sample(proc.pid)
                        if cur[2] > prev[2]:
                            obj["host_other_cpu_pct"] = round(
                                100 * ((cur[0] - prev[0]) - (cur[1] - prev[1]))
                                / (cur[2] - prev[2]), 1)
                        prev = cur
                        records.append(obj)
                    else:
                        meta.update(obj)
                    break
            else:
                if done_marker in line:
                    done = True
                    continue
                m = re.match(r"\[vm\] booting (\S+) \((\w+), (\d+) vCPU", line)
                if m:
                    meta.setdefault("accel", m.group(2))
                if (line.startswith(("[bench]", "[vm]", "install-host-deps"))
                        or "error" in line.lower() or "panic" in line.lower()):
                    print(line.rstrip("\n"), flush=True)
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait()
    console.close()
    return records, meta, rc, done


def link_latest(outdir, name):
    """Points results/<name> at `outdir`, unless something else than a link is there."""
    latest = os.path.join(os.path.dirname(outdir), name)
    if os.path.islink(latest) or not os.path.exists(latest):
        if os.path.islink(latest):
            os.unlink(latest)
        os.symlink(os.path.basename(outdir), latest)


def host(args):
    if os.geteuid() != 0:
        die("needs root (the VM harness, apt-get download, the cache dir)")
    prm = effective_params(args)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    outdir = os.path.abspath(os.path.join(args.out or os.path.join(HERE, "results"), stamp))
    os.makedirs(outdir)
    cache = prm["CACHE_DIR"]
    os.makedirs(cache, exist_ok=True)
    t0 = time.monotonic()

    log("building ublkd: cargo build --release --workspace --bins")
    try:
        run(["cargo", "build", "--release", "--workspace", "--bins"], cwd=REPO)
    except RuntimeError as e:
        die(f"ublkd does not build: {e}")
    bindir = os.path.join(REPO, "target", "release")

    paths, versions, peer_errors = {"ublkd": bindir}, {"ublkd": git_rev()}, {}
    if args.baseline:
        paths["ublkd-base"], versions["ublkd-base"] = build_baseline(args.baseline)
        prm["SERVERS"] = prm["SERVERS"] + ["ublkd-base"]
    want = set(prm["SERVERS"])
    if any(s.startswith("kublk") for s in want):
        try:
            paths["kublk"], v = build_kublk(cache, args.rebuild_peers)
            versions["kublk"] = v
            log(f"kublk: {paths['kublk']}")
        except Exception as e:
            peer_errors["kublk"] = str(e)
            log(f"kublk unavailable, continuing without it: {e}")
    if "rublk" in want:
        try:
            paths["rublk"], v = build_rublk(cache, args.rebuild_peers)
            versions["rublk"] = v["rublk"]
            log(f"rublk: {paths['rublk']} ({v['rublk']})")
        except Exception as e:
            peer_errors["rublk"] = str(e)
            log(f"rublk unavailable, continuing without it: {e}")
    servers = [s for s in prm["SERVERS"]
               if not (s.startswith("kublk") and "kublk" not in paths)
               and not (s == "rublk" and "rublk" not in paths)]
    prm["SERVERS"] = servers
    log(f"peers ready after {time.monotonic() - t0:.0f} s")

    plan = {"params": prm, "paths": paths, "versions": versions,
            "peer_errors": peer_errors, "outdir": outdir}
    plan_path = os.path.join(outdir, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f, indent=1)

    est = estimate_s(prm)
    timeout = int(1.6 * est + 180)
    log(f"{prm['ROUNDS']} rounds x {len(servers)} servers x {len(prm['JOBS'])} jobs, "
        f"~{est / 60:.0f} min in the VM (timeout {timeout} s); results: {outdir}")
    cmd = [os.path.join(REPO, "tests", "vm", "run"), "--timeout", str(timeout),
           "--mem", str(prm["VM_MEM_MB"]), "--",
           "python3", "-u", os.path.join(HERE, "bench.py"), "guest", plan_path]
    records, meta, rc, done = run_guest(cmd, outdir, (REC, META, DONE))

    results = {"meta": {**meta, "date": stamp, "host_elapsed_s": round(time.monotonic() - t0),
                        "vm_exit": rc, "complete": done},
               "params": prm, "versions": {**versions, **meta.get("versions", {})},
               "peer_errors": peer_errors, "records": records}
    results["summary"] = summarize(results)
    write_outputs(results, outdir)
    link_latest(outdir, "latest")
    if not done or rc != 0:
        die(f"the VM run did not finish (exit {rc}; see {outdir}/console.log); "
            f"the table above holds the {len(records)} runs it recorded", 1)
    errs = [r for r in records if r.get("error")]
    if errs:
        print(f"bench: {len(errs)} of {len(records)} runs failed; see results.json", flush=True)
        sys.exit(1)


# ======================================================================================
# summary, table, plot
# ======================================================================================

METRICS = ["iops", "p50_us", "p99_us", "cpu_us_per_io", "sys_cpu_us_per_io", "server_cpu_pct",
           "window_iops"]


def stats(vals):
    vals = sorted(v for v in vals if v is not None)
    if not vals:
        return None
    q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else [vals[0]] * 3
    return {"n": len(vals), "median": statistics.median(vals), "min": vals[0],
            "max": vals[-1], "q1": q[0], "q3": q[2]}


def summarize(results):
    prm = results["params"]
    out = {}
    for job in prm["JOBS"]:
        out[job] = {}
        for srv in prm["SERVERS"]:
            if not runs_job(prm, srv, job):
                continue
            rs = [r for r in results["records"]
                  if r["job"] == job and r["server"] == srv and not r.get("error")]
            fails = sum(1 for r in results["records"]
                        if r["job"] == job and r["server"] == srv and r.get("error"))
            out[job][srv] = {m: stats([r.get(m) for r in rs]) for m in METRICS}
            out[job][srv]["failed_runs"] = fails
        out[job]["ratios"] = {}
        u = out[job].get("ublkd")
        for base in prm["RATIO_BASELINES"]:
            b = out[job].get(base)
            if not u or not b:
                continue
            r = {}
            for m in METRICS:
                if u[m] and b[m] and b[m]["median"]:
                    r[m] = u[m]["median"] / b[m]["median"]
            out[job]["ratios"][f"ublkd/{base}"] = r
        # Each side's best mode by median IOPS, and their ratio.
        best = {}
        for side, modes in prm.get("BEST_OF", {}).items():
            cands = [(out[job][m]["iops"]["median"], m) for m in modes
                     if m in out[job] and out[job][m]["iops"]]
            if cands:
                best[side] = max(cands)
        if "ublkd" in best and "kublk" in best and best["kublk"][0]:
            out[job]["best"] = {"ublkd": best["ublkd"][1], "kublk": best["kublk"][1],
                                "iops_ratio": best["ublkd"][0] / best["kublk"][0]}
    out["idle_cpu_pct"] = {
        srv: stats([r["idle_cpu_pct"] for r in results["records"]
                    if r["job"] == "idle" and r["server"] == srv])
        for srv in prm["SERVERS"]}
    return out


def fmt_num(v, unit=""):
    if v is None:
        return "-"
    if v >= 100_000:
        return f"{v / 1000:.0f}k{unit}"
    if v >= 10_000:
        return f"{v / 1000:.1f}k{unit}"
    if v >= 100:
        return f"{v:.0f}{unit}"
    if v >= 10:
        return f"{v:.1f}{unit}"
    return f"{v:.2f}{unit}"


def table(results):
    prm, summ = results["params"], results["summary"]
    lines = []
    head = (f"{'job':<24} {'server':<15} {'IOPS median [min-max]':<25} {'p50 us':>8} "
            f"{'p99 us':>8}  {'server CPU us/IO [min-max]':<27} {'srv CPU%':>8} "
            f"{'sys CPU us/IO':>13} {'n':>3}")
    lines.append(head)
    lines.append("-" * len(head))
    for job in prm["JOBS"]:
        first = True
        for srv in prm["SERVERS"]:
            if srv not in summ[job]:
                continue
            s = summ[job][srv]
            name = job if first else ""
            first = False
            n = s["iops"]["n"] if s["iops"] else 0
            fails = f" ({s['failed_runs']} failed)" if s["failed_runs"] else ""
            if not s["iops"]:
                lines.append(f"{name:<24} {srv:<15} no successful run{fails}")
                continue
            io, cpu = s["iops"], s["cpu_us_per_io"]
            iops = f"{fmt_num(io['median'])} [{fmt_num(io['min'])}-{fmt_num(io['max'])}]"
            cpus = (f"{fmt_num(cpu['median'])} [{fmt_num(cpu['min'])}-{fmt_num(cpu['max'])}]"
                    if cpu else "-")
            p50 = fmt_num(s["p50_us"]["median"]) if s["p50_us"] else "-"
            p99 = fmt_num(s["p99_us"]["median"]) if s["p99_us"] else "-"
            sysc = fmt_num(s["sys_cpu_us_per_io"]["median"]) if s["sys_cpu_us_per_io"] else "-"
            pct = fmt_num(s["server_cpu_pct"]["median"]) if s["server_cpu_pct"] else "-"
            lines.append(f"{name:<24} {srv:<15} {iops:<25} {p50:>8} {p99:>8}  {cpus:<27} "
                         f"{pct:>8} {sysc:>13} {n:>3}{fails}")
        for rname, r in summ[job]["ratios"].items():
            def x(m):
                return f"x{r[m]:.2f}" if m in r else "-"
            lines.append(f"{'':<24} {rname:<15} {x('iops'):<25} {x('p50_us'):>8} "
                         f"{x('p99_us'):>8}  {x('cpu_us_per_io'):<27} "
                         f"{x('server_cpu_pct'):>8} {x('sys_cpu_us_per_io'):>13}")
        b = summ[job].get("best")
        if b:
            lines.append(f"{'':<24} best ublkd mode ({b['ublkd']}) / best kublk mode "
                         f"({b['kublk']}): x{b['iops_ratio']:.2f} IOPS")
        lines.append("")
    idle = summ.get("idle_cpu_pct", {})
    if any(idle.values()):
        lines.append("server CPU with its device idle (no I/O), % of one CPU, median [min-max]: "
                     + ", ".join(f"{s} {fmt_num(v['median'])} [{fmt_num(v['min'])}-"
                                 f"{fmt_num(v['max'])}]" for s, v in idle.items() if v))
        lines.append("")
    m = results["meta"]
    lines.append(
        f"{prm['ROUNDS']} rounds, fio {prm['RUNTIME_S']} s + {prm['RAMP_S']} s ramp per run; "
        f"kernel {m.get('kernel', '?')}, {m.get('cpus', '?')} vCPU ({m.get('accel', 'VM')}); "
        f"ublkd {results['versions'].get('ublkd', '?')}.")
    lines.append("IOPS, p50, p99: fio (completion latency). server CPU = utime+stime of the "
                 "server's processes (all threads) per I/O the device completed, in a window "
                 "inside the fio run;")
    lines.append("srv CPU% = the same in % of one CPU; sys CPU = all CPUs' busy time per I/O "
                 "(fio and kernel included). Ratios are of medians; spreads min-max over rounds.")
    other = [r["host_other_cpu_pct"] for r in results["records"] if "host_other_cpu_pct" in r]
    if other:
        med = statistics.median(other)
        lines.append(f"host CPU used by other work than this VM during the run: median "
                     f"{med:.0f}%, max {max(other):.0f}% of one CPU"
                     + (" -- the host was busy: these numbers are noisier than usual"
                        if med > 20 else ""))
    for peer, err in results.get("peer_errors", {}).items():
        lines.append(f"{peer} was left out: {err.splitlines()[0]}")
    return "\n".join(lines)


COLORS = {"ublkd": "#d62728", "ublkd-copy": "#ff7f0e",
          "ublkd-nosandbox": "#f4a6a6", "ublkd-deferred": "#8c564b",
          "kublk-b": "#1f77b4", "kublk-b-zc": "#17becf", "kublk": "#7fb3e0",
          "rublk": "#2ca02c", "ublkd-base": "#9467bd"}


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def svg_plot(results):
    """Two panels, IOPS and server CPU per I/O, each job's bars relative to the first
    ratio baseline's median (absolute baseline value printed under the job), with the
    min-max whisker and one dot per round."""
    prm, summ, recs = results["params"], results["summary"], results["records"]
    jobs, servers = list(prm["JOBS"]), prm["SERVERS"]
    base = next((b for b in prm["RATIO_BASELINES"] if b in servers), None)
    bw, gap, left, top, ph = 20, 30, 110, 66, 230
    gw = len(servers) * bw + gap
    width = max(720, left + len(jobs) * gw + 20)
    panels = [("iops", "IOPS", "higher is better"),
              ("cpu_us_per_io", "server CPU time per I/O", "lower is better")]
    height = top + len(panels) * (ph + 110) + 40
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'font-family="sans-serif" font-size="11">',
         f'<rect width="100%" height="100%" fill="white"/>',
         f'<text x="10" y="20" font-size="14" font-weight="bold">ublkd benchmark '
         f'{esc(results["meta"].get("date", ""))}: {prm["ROUNDS"]} rounds, '
         f'{prm["RUNTIME_S"]} s runs, {esc(results["meta"].get("kernel", ""))} '
         f'({esc(results["meta"].get("accel", "VM"))})</text>',
         f'<text x="10" y="36">bars: median relative to {esc(base or "the best median")}\'s '
         f'median in each job (its absolute value under the job); whiskers: min-max; '
         f'dots: rounds</text>']
    lx = left
    for s in servers:
        o.append(f'<rect x="{lx}" y="46" width="10" height="10" fill="{COLORS.get(s, "#888")}"/>'
                 f'<text x="{lx + 14}" y="55">{esc(s)}</text>')
        lx += 14 + 7 * len(s) + 20
    for pi, (metric, title, hint) in enumerate(panels):
        y0 = top + pi * (ph + 110) + 20
        norms = {}
        for j in jobs:
            if base and base in summ[j] and summ[j][base][metric]:
                norms[j] = summ[j][base][metric]["median"]
            else:
                meds = [summ[j][s][metric]["median"] for s in servers
                        if s in summ[j] and summ[j][s][metric]]
                norms[j] = max(meds) if meds else None
        ymax = 0.0
        for j in jobs:
            for s in servers:
                st = summ[j].get(s, {}).get(metric)
                if st and norms[j]:
                    ymax = max(ymax, st["max"] / norms[j])
        ymax = max(1.2, ymax * 1.05)

        def ypos(v):
            return y0 + ph - (v / ymax) * ph
        o.append(f'<text x="{left}" y="{y0 - 6}" font-size="12" font-weight="bold">'
                 f'{esc(title)} ({esc(hint)})</text>')
        o.append(f'<text x="14" y="{y0 + ph / 2:.0f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {y0 + ph / 2:.0f})">relative to '
                 f'{esc(base or "best")}</text>')
        step = 0.25 if ymax <= 2 else 0.5 if ymax <= 4 else 1.0
        t = 0.0
        while t <= ymax + 1e-9:
            y = ypos(t)
            o.append(f'<line x1="{left}" x2="{width - 20}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="{"#444" if abs(t - 1) < 1e-9 else "#ddd"}" stroke-width="1"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{t:.2f}</text>')
            t += step
        for ji, j in enumerate(jobs):
            gx = left + ji * gw + gap / 2
            for si, s in enumerate(servers):
                if s not in summ[j]:
                    continue  # a variant that does not run this job
                st = summ[j][s][metric]
                x = gx + si * bw
                if not st or not norms[j]:
                    o.append(f'<text x="{x + bw / 2:.1f}" y="{ypos(0) - 4:.1f}" '
                             f'text-anchor="middle" fill="#999">x</text>')
                    continue
                n = norms[j]
                yb = ypos(st["median"] / n)
                o.append(f'<rect x="{x + 1:.1f}" y="{yb:.1f}" width="{bw - 2}" '
                         f'height="{ypos(0) - yb:.1f}" fill="{COLORS.get(s, "#888")}">'
                         f'<title>{esc(j)} {esc(s)}: median {st["median"]:.4g}, '
                         f'min {st["min"]:.4g}, max {st["max"]:.4g}, n {st["n"]}</title></rect>')
                cx = x + bw / 2
                o.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{ypos(st["min"] / n):.1f}" '
                         f'y2="{ypos(st["max"] / n):.1f}" stroke="black"/>')
                for r in recs:
                    if r["job"] == j and r["server"] == s and r.get(metric) is not None \
                            and not r.get("error"):
                        o.append(f'<circle cx="{cx:.1f}" cy="{ypos(r[metric] / n):.1f}" '
                                 f'r="1.6" fill="black" fill-opacity="0.6"/>')
            lx, ly = gx + len(servers) * bw / 2, ypos(0) + 13
            absval = fmt_num(norms[j]) + (" IOPS" if metric == "iops" else " us/IO")
            o.append(f'<text x="{lx:.1f}" y="{ly:.1f}" text-anchor="middle" '
                     f'fill="#555">{esc(absval)}</text>')
            o.append(f'<text x="{lx + 8:.1f}" y="{ly + 14:.1f}" text-anchor="end" '
                     f'transform="rotate(-30 {lx + 8:.1f} {ly + 14:.1f})">{esc(j)}</text>')
    o.append("</svg>")
    return "\n".join(o) + "\n"


def write_outputs(results, outdir, render_table=None, render_plot=None):
    """Writes results.json, table.txt and (where there is one) plot.svg into `outdir`
    and prints the table. `render_table` and `render_plot` default to this benchmark's;
    recovery.py passes its own table and no plot."""
    render_table = render_table or table
    if render_plot is None and render_table is table:
        render_plot = svg_plot
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = render_table(results)
    with open(os.path.join(outdir, "table.txt"), "w") as f:
        f.write(text + "\n")
    names = ["results.json", "table.txt"]
    if render_plot:
        with open(os.path.join(outdir, "plot.svg"), "w") as f:
            f.write(render_plot(results))
        names.append("plot.svg")
    print()
    print(text)
    print()
    print(f"results: {outdir}/{', '.join(names + ['console.log'])}", flush=True)


def report(args, summarize_fn=None, render_table=None):
    """`report DIR`: re-renders an earlier run's outputs from its results.json."""
    path = args.dir
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    with open(path) as f:
        results = json.load(f)
    results["summary"] = (summarize_fn or summarize)(results)
    write_outputs(results, os.path.dirname(os.path.abspath(path)), render_table)


# ======================================================================================
# guest: measurement helpers
# ======================================================================================

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_s(pid):
    """utime+stime of the whole process (every thread, live or exited), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    if rest[0] == "Z":
        return None
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def sys_busy_s():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / CLK_TCK  # all but idle and iowait


def disk_ios(dev):
    with open(f"/sys/block/{dev}/stat") as f:
        v = [int(x) for x in f.read().split()]
    return v[0] + v[4]  # reads + writes completed


def fd_holders(path):
    """Pids of the processes that have `path` open."""
    pids = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                try:
                    if os.readlink(f"/proc/{d}/fd/{fd}") == path:
                        pids.add(int(d))
                        break
                except OSError:
                    pass
        except OSError:
            pass
    return pids


def alive(pid):
    return proc_cpu_s(pid) is not None


def wait_gone(pids, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def sh(cmd, timeout=60):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"`{' '.join(map(str, cmd))}` exited {p.returncode}: "
                           + " | ".join(p.stdout.strip().splitlines()[-6:]))
    return p.stdout


# ======================================================================================
# guest: servers
# ======================================================================================

class Ublkd:
    SOCK = "/run/ublkd-bench.sock"
    CFG = "/run/ublkd-bench.toml"
    LOG = "/run/ublkd-bench.log"

    def __init__(self, plan, copy=False, sandbox=True, fast_release=True, build="ublkd"):
        self.bindir = plan["paths"][build]
        self.prm = plan["params"]
        self.copy, self.sandbox, self.fast_release = copy, sandbox, fast_release
        self.proc = None

    def ctl(self, *a):
        return sh([os.path.join(self.bindir, "ublkctl"), "--socket", self.SOCK, *a])

    def config(self):
        text = f'[daemon]\nsocket = "{self.SOCK}"\nstate_dir = "/run/ublkd-bench"\n'
        if not self.fast_release:
            text += "[recovery]\nfast_release = false\n"
        return text

    def start(self):
        with open(self.CFG, "w") as f:
            f.write(self.config())
        logf = open(self.LOG, "a")
        self.proc = subprocess.Popen([os.path.join(self.bindir, "ublkd"), "--config", self.CFG],
                                     stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
        end = time.monotonic() + 20
        while not os.path.exists(self.SOCK):
            if self.proc.poll() is not None:
                raise RuntimeError(f"ublkd exited {self.proc.returncode} at start: "
                                   + tail(self.LOG))
            if time.monotonic() > end:
                raise RuntimeError("ublkd's socket did not appear within 20 s")
            time.sleep(0.05)

    def add(self, target):
        a = ["add", "-q", str(self.prm["QUEUES"]), "-d", str(self.prm["QUEUE_DEPTH"])]
        if target == "null":
            a += ["-t", "null", "-s", self.prm["NULL_SIZE"]]
        else:
            a += ["-t", "loop", "-f", self.prm["LOOP_FILE"]]
            if self.copy:
                a.append("--copy")
        if not self.sandbox:
            a.append("--no-sandbox")
        out = self.ctl(*a).strip().splitlines()
        return int(out[-1])

    def pids(self, dev_id):
        pids = {self.proc.pid}
        st = json.loads(self.ctl("status", "--json"))
        for d in st.get("devices", []):
            if d.get("id") == dev_id:
                for k in ("worker_pid", "standby_pid"):
                    if d.get(k):
                        pids.add(int(d[k]))
        return pids | fd_holders(f"/dev/ublkc{dev_id}")

    def delete(self, dev_id):
        self.ctl("del", "-n", str(dev_id))

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError("ublkd did not stop within 20 s of SIGTERM")
        self.proc = None


class Kublk:
    def __init__(self, plan, batch, auto_zc=False):
        self.bin = plan["paths"]["kublk"]
        self.prm = plan["params"]
        self.batch, self.auto_zc = batch, auto_zc
        self.daemon = {}

    def start(self):
        pass

    def stop(self):
        pass

    def _parse(self, out):
        m = re.search(r"dev id (\d+):", out)
        if not m:
            raise RuntimeError(f"no 'dev id N:' in the add output: {out.strip()[:300]}")
        dev_id = int(m.group(1))
        p = re.search(r"daemon pid (\d+)", out)
        if p:
            self.daemon[dev_id] = int(p.group(1))
        return dev_id

    def add(self, target):
        a = [self.bin, "add", "-t", target, "-q", str(self.prm["QUEUES"]),
             "-d", str(self.prm["QUEUE_DEPTH"])] + (["-b"] if self.batch else [])
        if self.auto_zc:
            a.append("--auto_zc")
        if target == "loop":
            a.append(self.prm["LOOP_FILE"])
        return self._parse(sh(a))

    def pids(self, dev_id):
        p = fd_holders(f"/dev/ublkc{dev_id}")
        if dev_id in self.daemon:
            p.add(self.daemon[dev_id])
        return p

    def delete(self, dev_id):
        sh([self.bin, "del", "-n", str(dev_id)])


class Rublk(Kublk):
    def __init__(self, plan):
        self.bin = plan["paths"]["rublk"]
        self.prm = plan["params"]
        self.daemon = {}

    def add(self, target):
        a = [self.bin, "add", target, "-q", str(self.prm["QUEUES"]),
             "-d", str(self.prm["QUEUE_DEPTH"])]
        if target == "loop":
            a += ["-f", self.prm["LOOP_FILE"]]
        return self._parse(sh(a))


def make_server(name, plan):
    return {"ublkd": lambda: Ublkd(plan),
            "ublkd-copy": lambda: Ublkd(plan, copy=True),
            "ublkd-deferred": lambda: Ublkd(plan, fast_release=False),
            "ublkd-nosandbox": lambda: Ublkd(plan, sandbox=False),
            "ublkd-base": lambda: Ublkd(plan, build="ublkd-base"),
            "kublk-b": lambda: Kublk(plan, True),
            "kublk-b-zc": lambda: Kublk(plan, True, auto_zc=True),
            "kublk": lambda: Kublk(plan, False), "rublk": lambda: Rublk(plan)}[name]()


def tail(path, n=8):
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-n:])
    except OSError:
        return ""


# ======================================================================================
# guest: the rounds
# ======================================================================================

def fio_cmd(dev, job, spec, prm):
    target, rw, bs, qd, nj = spec
    cmd = ["fio", f"--name={job}", f"--filename=/dev/{dev}", f"--rw={rw}", f"--bs={bs}",
           "--ioengine=io_uring", "--direct=1", f"--iodepth={qd}", f"--numjobs={nj}",
           "--thread", "--group_reporting", "--time_based", f"--runtime={prm['RUNTIME_S']}",
           f"--ramp_time={prm['RAMP_S']}", "--norandommap", "--randrepeat=0",
           "--percentile_list=50:99", "--output-format=json"]
    if target == "null":
        cmd.append(f"--size={prm['NULL_SIZE']}")
    return cmd


def fio_parse(out, rw):
    data = json.loads(out[out.index("{"):])
    jb = data["jobs"][0]
    if jb.get("error"):
        raise RuntimeError(f"fio job error {jb['error']}")
    d = jb["write" if "write" in rw else "read"]
    pct = d["clat_ns"].get("percentile", {})
    return {"iops": d["iops"], "bw_MiBps": d["bw_bytes"] / 2**20,
            "p50_us": pct.get("50.000000", 0) / 1000, "p99_us": pct.get("99.000000", 0) / 1000,
            "clat_mean_us": d["clat_ns"]["mean"] / 1000, "fio_ios": d["total_ios"]}


def wait_dev(dev_id, timeout=20):
    path = f"/dev/ublkb{dev_id}"
    end = time.monotonic() + timeout
    while not (os.path.exists(path) and os.path.exists(f"/sys/block/ublkb{dev_id}/stat")):
        if time.monotonic() > end:
            raise RuntimeError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)
    return f"ublkb{dev_id}"


def emit(marker, obj):
    print(marker + json.dumps(obj, separators=(",", ":")), flush=True)


def sample(pids, dev):
    return {p: proc_cpu_s(p) for p in pids}, sys_busy_s(), disk_ios(dev), time.monotonic()


def window(pids, a, b):
    """Server CPU, all-CPU busy time, I/Os and seconds between two samples."""
    (c0, s0, d0, t0), (c1, s1, d1, t1) = a, b
    gone = [p for p in pids if c0[p] is None or c1[p] is None]
    if gone:
        raise RuntimeError(f"server process(es) {gone} vanished during the run")
    return (sum(c1[p] - c0[p] for p in pids), s1 - s0, d1 - d0, t1 - t0,
            {str(p): round(c1[p] - c0[p], 3) for p in pids})


def idle_cpu(srv, dev_id, dev, secs):
    """The server's CPU use with its device idle, in percent of one CPU."""
    pids = srv.pids(dev_id)
    a = sample(pids, dev)
    time.sleep(secs)
    cpu, _, _, dt, _ = window(pids, a, sample(pids, dev))
    return 100 * cpu / dt


def measure(srv, dev_id, dev, job, spec, prm):
    """One fio run. fio's own numbers cover its whole measured period; the CPU numbers
    cover a window inside it: from RAMP_S after the device sees its first I/O to
    RUNTIME_S - 0.3 s later, so fio's start-up (~2 s under TCG) and exit are left out."""
    pids = srv.pids(dev_id)
    d_start = disk_ios(dev)
    proc = subprocess.Popen(fio_cmd(dev, job, spec, prm), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t_launch = time.monotonic()
    deadline = t_launch + prm["RUNTIME_S"] + prm["RAMP_S"] + 120
    note = None
    try:
        while disk_ios(dev) == d_start and proc.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError("fio did no I/O within the deadline")
            time.sleep(0.02)
        t_io = time.monotonic()
        time.sleep(prm["RAMP_S"])
        a = sample(pids, dev)
        time.sleep(max(0.5, prm["RUNTIME_S"] - 0.3))
        b = sample(pids, dev)
        if proc.poll() is not None:
            note = "fio ended before the CPU window closed"
        out, err = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"fio exited {proc.returncode}: "
                           + " | ".join((err or out).strip().splitlines()[-4:]))
    res = fio_parse(out, spec[1])
    cpu, busy, ios, dt, per_pid = window(pids, a, b)
    res.update({"window_ios": ios, "window_s": round(dt, 3),
                "window_iops": ios / dt if dt else None, "server_cpu_s": cpu,
                "server_cpu_pct": 100 * cpu / dt if dt else None,
                "cpu_us_per_io": cpu / ios * 1e6 if ios else None,
                "sys_cpu_us_per_io": busy / ios * 1e6 if ios else None,
                "fio_startup_s": round(t_io - t_launch, 2),
                "fio_elapsed_s": round(time.monotonic() - t_launch, 2),
                "pids": sorted(pids), "per_pid_cpu_s": per_pid})
    if note:
        res["note"] = note
    return res


def guest(args):
    with open(args.plan) as f:
        plan = json.load(f)
    prm = plan["params"]
    t_start = time.monotonic()
    meta = {"kernel": os.uname().release, "cpus": os.cpu_count(),
            "fio": sh(["fio", "--version"]).strip(), "versions": {}}
    emit(META, meta)

    jobs = prm["JOBS"]
    targets = [t for t in ("null", "loop") if any(s[0] == t for s in jobs.values())]
    if "loop" in targets:
        log(f"creating the loop target's backing file {prm['LOOP_FILE']} "
            f"({prm['LOOP_FILE_MB']} MiB, tmpfs)")
        sh(["dd", "if=/dev/zero", f"of={prm['LOOP_FILE']}", "bs=1M",
            f"count={prm['LOOP_FILE_MB']}", "status=none"], timeout=600)

    servers = prm["SERVERS"]
    nrounds = prm["ROUNDS"]
    total = nrounds * sum(1 for s in servers for j in jobs if runs_job(prm, s, j))
    count = 0
    for rnd in range(nrounds):
        order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
        for sname in order:
            srv = make_server(sname, plan)
            try:
                srv.start()
            except Exception as e:
                log(f"round {rnd + 1}/{nrounds} {sname}: start failed: {e}")
                for job in jobs:
                    if runs_job(prm, sname, job):
                        count += 1
                        emit(REC, {"round": rnd + 1, "server": sname, "job": job,
                                   "error": f"start: {e}"})
                continue
            for target in targets:
                tjobs = [j for j, s in jobs.items() if s[0] == target
                         and runs_job(prm, sname, j)]
                if not tjobs:
                    continue
                dev_id, err = None, None
                try:
                    dev_id = srv.add(target)
                    dev = wait_dev(dev_id)
                except Exception as e:
                    err = f"add {target}: {e}"
                    log(f"round {rnd + 1}/{nrounds} {sname}: {err}")
                # (the variants that run some jobs only are not measured idle)
                if not err and target == targets[0] and prm["IDLE_S"] > 0 \
                        and sname not in prm.get("SERVER_JOBS", {}):
                    try:
                        pct = idle_cpu(srv, dev_id, dev, prm["IDLE_S"])
                        emit(REC, {"round": rnd + 1, "server": sname, "job": "idle",
                                   "idle_cpu_pct": pct})
                        log(f"round {rnd + 1}/{nrounds}  {sname:<8} idle {target} device: "
                            f"server uses {pct:.1f}% of a CPU")
                    except Exception as e:
                        log(f"round {rnd + 1}/{nrounds} {sname}: idle measurement: {e}")
                for job in tjobs:
                    count += 1
                    rec = {"round": rnd + 1, "server": sname, "job": job}
                    if err:
                        emit(REC, {**rec, "error": err})
                        continue
                    log(f"round {rnd + 1}/{nrounds}  [{count}/{total}]  {sname:<8} {job}")
                    try:
                        res = measure(srv, dev_id, dev, job, jobs[job], prm)
                        rec.update(res)
                        log(f"    {fmt_num(res['iops'])} IOPS  p50 {fmt_num(res['p50_us'])} us"
                            f"  p99 {fmt_num(res['p99_us'])} us  server "
                            f"{fmt_num(res['cpu_us_per_io'])} us/IO  "
                            f"(sys {fmt_num(res['sys_cpu_us_per_io'])} us/IO)  server "
                            f"{fmt_num(res['server_cpu_pct'])}% CPU"
                            + (f"  [{res['note']}]" if res.get("note") else ""))
                    except Exception as e:
                        rec["error"] = str(e)
                        log(f"    FAILED: {e}")
                    emit(REC, rec)
                if dev_id is not None:
                    try:
                        pids = srv.pids(dev_id) - ({srv.proc.pid} if isinstance(srv, Ublkd)
                                                   else set())
                        srv.delete(dev_id)
                        if not wait_gone(pids):
                            log(f"round {rnd + 1}/{nrounds} {sname}: its processes "
                                f"{sorted(pids)} outlived the device by 10 s")
                    except Exception as e:
                        log(f"round {rnd + 1}/{nrounds} {sname}: delete failed: {e}")
            try:
                srv.stop()
            except Exception as e:
                log(f"round {rnd + 1}/{nrounds} {sname}: stop failed: {e}")
    log(f"done: {count} runs in {time.monotonic() - t_start:.0f} s in the VM")
    if os.path.exists(Ublkd.LOG) and "ublkd" in servers:
        errs = [ln for ln in open(Ublkd.LOG, errors="replace")
                if re.search(r"\b(ERROR|WARN)\b", ln)]
        if errs:
            log(f"ublkd logged {len(errs)} warnings/errors; the last: {errs[-1].strip()[:300]}")
    print(DONE, flush=True)


# ======================================================================================

def main():
    ap = argparse.ArgumentParser(prog="bench/run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    h = sub.add_parser("host", help="build, run the VM, write the results (the default)")
    h.add_argument("--quick", action="store_true",
                   help="smoke check: 2 rounds, 2 s runs, 3 jobs (~5 min)")
    h.add_argument("--rounds", type=int, help="override ROUNDS")
    h.add_argument("--runtime", type=int, help="override RUNTIME_S (seconds per fio run)")
    h.add_argument("--servers", help="comma-separated subset of " + ",".join(P.SERVERS))
    h.add_argument("--jobs", help="comma-separated subset of the jobs in params.py")
    h.add_argument("--out", help="results parent dir (default bench/results)")
    h.add_argument("--baseline", metavar="REV",
                   help="also run ublkd built at git revision REV (as ublkd-base), "
                        "to measure a change in the same boot")
    h.add_argument("--rebuild-peers", action="store_true",
                   help="rebuild kublk and rublk even if cached")
    g = sub.add_parser("guest", help="(inside the VM) run the rounds of a plan")
    g.add_argument("plan")
    r = sub.add_parser("report", help="re-render the table and plot of a results dir")
    r.add_argument("dir")
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("host", "guest", "report", "-h", "--help"):
        argv = ["host"] + argv
    args = ap.parse_args(argv)
    {"host": host, "guest": guest, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
