"""What the benchmark scripts (bench.py, recovery.py, scale.py, nbd.py) share: a host
run (results dir, ublkd built, the plan, the VM and its console, the outputs) and the
guest's measurement helpers; the results' statistics, formats and files are
tables.py's (imported here, so `benchlib.stats` still works).

Each benchmark keeps its own parameters, jobs, summary and table; this module knows
none of them. The peers' builds are in builds.py, the servers in servers.py, the
command line in cli.py. Python 3 standard library only.
"""

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time

import params as P
# The results' arithmetic and text live in tables.py; the scripts find them here too.
from tables import (  # noqa: F401
    stats, RATIO_CONFIDENCE, RATIO_RESAMPLES, paired_ratio, median_ratio, fmt_ratio, fmt_num, fms,
    ruled, client_table, client_rows, footer, client_table_end, write_outputs, report,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def log(msg):
    print(f"[bench] {msg}", flush=True)


def die(msg, code=1):
    print(f"bench: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def markers(name):
    """The console markers of a benchmark's guest half, (record, meta, done): each
    record and meta line is the marker and a JSON object."""
    return (f"@@UBLKD-{name}-REC@@ ", f"@@UBLKD-{name}-META@@ ", f"@@UBLKD-{name}-DONE@@")


# ======================================================================================
# host: commands
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


def git_rev():
    try:
        rev = run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]).strip()
        dirty = run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"])
        return rev + ("-dirty" if dirty.strip() else "")
    except Exception:
        return "unknown"


# ======================================================================================
# host: the run
# ======================================================================================

def need_root():
    if os.geteuid() != 0:
        die("needs root (the VM harness, apt-get download, the cache dir)")


def need_tools(tools):
    """Dies unless every (tool, package) of `tools` is installed on the host: the guest
    runs the host's."""
    for tool, pkg in tools:
        if not any(os.access(os.path.join(d, tool), os.X_OK)
                   for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")):
            die(f"{tool} is not installed (the guest runs the host's): apt-get install {pkg}, "
                f"or tests/vm/install-host-deps.sh")


def apply_kernel(prm, kernel, servers_key, chosen):
    """Fits `prm` to `kernel`: on 6.12 the KERNEL_6_12 lists replace the default ones
    (the server list `servers_key` only if `chosen`, the --servers list, is None);
    a server that cannot run there (REFUSED_6_12) dies with the reason."""
    prm["KERNEL"] = kernel
    if kernel != "6.12":
        return prm
    for k, v in P.KERNEL_6_12.items():
        if k in prm and not (k == servers_key and chosen):
            prm[k] = v
    bad = [s for s in prm[servers_key] if s in P.REFUSED_6_12]
    if bad:
        die("on kernel 6.12 " + "; ".join(f"{s}: {P.REFUSED_6_12[s]}" for s in bad), 2)
    return prm


class HostRun:
    """One run on the host: its results dir, ublkd and the peers built, the plan, the
    VM and its records, the outputs."""

    def __init__(self, args, cache, script, markers, prefix="", suffix=""):
        """Creates bench/results/<prefix><date><suffix>/ (or under --out) and the peer
        cache, and builds ublkd. `script` (bench.py, nbd.py, ...) is what the VM runs,
        its guest half, whose records come with `markers` (REC, META, DONE). The
        newest results are linked as results/latest, or latest-KIND where the prefix or
        suffix names a KIND (recovery-, -nbd)."""
        self.script, self.markers = script, markers
        kind = (prefix + suffix).strip("-")
        self.latest = f"latest-{kind}" if kind else "latest"
        self.stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        parent = os.path.abspath(args.out or os.path.join(HERE, "results"))
        self.outdir = os.path.join(parent, prefix + self.stamp + suffix)
        os.makedirs(self.outdir)
        self.cache = cache
        os.makedirs(cache, exist_ok=True)
        self.t0 = time.monotonic()
        # --kernel (bench.py, recovery.py); None: tests/vm/run's own default
        self.kernel = getattr(args, "kernel", None)

        log("building ublkd: cargo build --release --workspace --bins")
        try:
            run(["cargo", "build", "--release", "--workspace", "--bins"], cwd=REPO)
        except RuntimeError as e:
            die(f"ublkd does not build: {e}")
        self.paths = {"ublkd": os.path.join(REPO, "target", "release")}
        self.versions = {"ublkd": git_rev()}
        self.peer_errors = {}

    def build_peer(self, name, build, rebuild):
        """Builds a peer with `build` (build_kublk, build_rublk); one that fails is left
        out, its reason kept for the table's footer. Returns whether it is there."""
        try:
            self.paths[name], v = build(self.cache, rebuild)
            self.versions[name] = v
        except Exception as e:
            self.peer_errors[name] = str(e)
            log(f"{name} unavailable, continuing without it: {e}")
            return False
        # a version string is short enough for the line; kublk's is a dict of three
        log(f"{name}: {self.paths[name]}" + (f" ({v})" if isinstance(v, str) else ""))
        return True

    def write_plan(self, prm):
        """The plan the guest half runs: outdir/plan.json; returns its path."""
        plan = {"params": prm, "paths": self.paths, "versions": self.versions,
                "peer_errors": self.peer_errors, "outdir": self.outdir}
        plan_path = os.path.join(self.outdir, "plan.json")
        with open(plan_path, "w") as f:
            json.dump(plan, f, indent=1)
        return plan_path

    def run_vm(self, plan_path, timeout, mem_mb):
        """Boots the test VM running `SCRIPT guest PLAN`; returns run_guest's answer."""
        kernel = ["--kernel", P.KERNELS[self.kernel]] if self.kernel else []
        cmd = [os.path.join(REPO, "tests", "vm", "run"), "--timeout", str(timeout),
               "--mem", str(mem_mb), *kernel, "--",
               "python3", "-u", os.path.join(HERE, self.script), "guest", plan_path]
        return run_guest(cmd, self.outdir, self.markers)

    def run_and_finish(self, prm, what, est, timeout, mem_mb, outputs, recorded, failed):
        """Writes the plan, logs `what` the VM will run (the line's start; the rest is
        the time: `est` s, the VM's `timeout`) and runs it (run_vm), then finishes with
        `outputs` = (summarize, render_table, render_plot); exits 1 if any record
        failed (`failed` names them in the message)."""
        plan_path = self.write_plan(prm)
        log(f"{what}~{est / 60:.0f} min in the VM (timeout {timeout} s); results: {self.outdir}")
        vm = self.run_vm(plan_path, timeout, mem_mb)
        bad = self.finish(prm, vm, *outputs, recorded)
        if bad:
            print(f"bench: {len(bad)} of {len(vm[0])} {failed} failed; see results.json",
                  flush=True)
            sys.exit(1)

    def finish(self, prm, vm, summarize, render_table, render_plot, recorded):
        """Writes the outputs from the VM's records (`vm`: run_vm's answer), points
        results/latest(-KIND) at them, and dies if the VM did not finish (`recorded` names
        what the table then holds). Returns the records that failed."""
        records, meta, rc, done = vm
        results = {"meta": {**meta, "date": self.stamp,
                            "host_elapsed_s": round(time.monotonic() - self.t0),
                            "vm_exit": rc, "complete": done},
                   "params": prm, "versions": {**self.versions, **meta.get("versions", {})},
                   "peer_errors": self.peer_errors, "records": records}
        results["summary"] = summarize(results)
        write_outputs(results, self.outdir, render_table, render_plot)
        link_latest(self.outdir, self.latest)
        if not done or rc != 0:
            die(f"the VM run did not finish (exit {rc}; see {self.outdir}/console.log); "
                f"the table above holds the {len(records)} {recorded}", 1)
        return [r for r in records if r.get("error")]


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


def tail(path, n=8):
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-n:])
    except OSError:
        return ""


def wait_dev(dev_id, timeout=20):
    path = f"/dev/ublkb{dev_id}"
    end = time.monotonic() + timeout
    while not (os.path.exists(path) and os.path.exists(f"/sys/block/ublkb{dev_id}/stat")):
        if time.monotonic() > end:
            raise RuntimeError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)
    return f"ublkb{dev_id}"


def fio_job(out):
    """The first job of fio's --output-format=json output (which may follow other
    lines); ValueError where there is no json."""
    return json.loads(out[out.index("{"):])["jobs"][0]


# ======================================================================================
# guest: the run
# ======================================================================================

def emit(marker, obj):
    print(marker + json.dumps(obj, separators=(",", ":")), flush=True)


def fail_jobs(marker, base, jobs, error):
    """Emits a failed record for each of `jobs` that could not run (`base` with the
    job and `error`: the server did not start, the device did not attach) and returns
    how many, for the count of runs."""
    for job in jobs:
        emit(marker, {**base, "job": job, "error": error})
    return len(jobs)


def read_plan(path):
    with open(path) as f:
        return json.load(f)


def guest_meta():
    """What the host's results record of the guest: its kernel, CPUs and fio."""
    return {"kernel": os.uname().release, "cpus": os.cpu_count(),
            "fio": sh(["fio", "--version"]).strip()}


def guest_start(args, **meta):
    """A guest half's start: the plan at `args.plan`, its params, the time it started
    (monotonic) and the record of the guest, guest_meta() with `meta` added."""
    plan = read_plan(args.plan)
    return plan, plan["params"], time.monotonic(), {**guest_meta(), **meta}


def check_kernel(prm):
    """Dies unless the guest runs the series the plan asked for (--kernel)."""
    want = prm.get("KERNEL")
    rel = os.uname().release
    if want == "6.12" and not rel.startswith("6.12."):
        die(f"the plan is for kernel 6.12, the guest runs {rel}")
    if want and want != "6.12" and rel.startswith("6."):
        die(f"the plan is for kernel {want}, the guest runs {rel}")


def zero_file(path, mb):
    """A loop target's backing file of `mb` MiB of zeros (in the guest's tmpfs)."""
    sh(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "status=none"],
       timeout=600)


def rotated(servers, rnd):
    """Round `rnd`'s order: each round starts one server later."""
    return servers[rnd % len(servers):] + servers[:rnd % len(servers)]
