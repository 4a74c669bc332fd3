#!/usr/bin/env python3
"""ublkd's nbd target beside the kernel's NBD client (nbd.ko + nbd-client), both on the
same nbdkit export, in one VM boot (issue 19, point 7).

Run through `bench/run nbd` (see bench/README.md). Three halves, one file:

  host    build ublkd, boot the VM, collect its records, write the results
  guest   (inside the VM) the two phases below
  report  re-print the table of an earlier results dir

Throughput: one nbdkit serves a RAM export (`nbdkit memory SIZE` on a unix socket),
filled with data once; each round attaches every client, runs each fio job on each
client's device in turn (the order rotated per job and round; bench.py's measure():
fio's IOPS and latency, CPU from /proc in a window inside the run) and detaches them.
Restart: per client a fresh nbdkit serving a tmpfs file; fio randrw with crc32c
verify; nbdkit is SIGKILLed during the run and started again on the same socket a few
seconds later; fio's errors, its longest completion latency and whether the device
works afterwards are recorded.

Python 3 standard library only; parameters in bench/params.py (the NBD_* block).
"""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import params as P  # noqa: E402
import benchlib as L  # noqa: E402
import bench as B  # noqa: E402  (measure(), fio_parse(), fmt_num(): the same runs as bench.py's)
from benchlib import log, die, emit, sh, stats  # noqa: E402

REC = "@@UBLKD-NBD-REC@@ "
META = "@@UBLKD-NBD-META@@ "
DONE = "@@UBLKD-NBD-DONE@@"
CLIENTS = ("kernel-nbd", "ublkd", "kernel-nbd-c2")
fmt_num = B.fmt_num


# ======================================================================================
# host
# ======================================================================================

def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.startswith("NBD_")}
    prm["CACHE_DIR"] = P.CACHE_DIR
    if args.quick:
        prm.update(P.NBD_QUICK)
    prm.pop("NBD_QUICK", None)
    if isinstance(prm["NBD_JOBS"], list):
        prm["NBD_JOBS"] = {j: P.NBD_JOBS[j] for j in prm["NBD_JOBS"]}
    if args.rounds:
        prm["NBD_ROUNDS"] = args.rounds
    if args.runtime:
        prm["NBD_RUNTIME_S"] = args.runtime
    if args.clients:
        prm["NBD_CLIENTS"] = args.clients.split(",")
    for c in prm["NBD_CLIENTS"] + prm["NBD_RESTART_CLIENTS"]:
        if c not in CLIENTS:
            die(f"unknown client {c!r}; known: {', '.join(CLIENTS)}", 2)
    if args.jobs:
        names = args.jobs.split(",")
        for j in names:
            if j not in P.NBD_JOBS:
                die(f"unknown job {j!r}; known: {', '.join(P.NBD_JOBS)}", 2)
        prm["NBD_JOBS"] = {j: P.NBD_JOBS[j] for j in names}
    if args.queues:
        prm["NBD_QUEUES"] = args.queues
    if args.threads:
        prm["NBD_THREADS"] = args.threads
    if args.baseline:
        if args.baseline not in prm["NBD_CLIENTS"]:
            die(f"--baseline {args.baseline} is not one of the clients", 2)
        prm["NBD_RATIO_BASELINE"] = args.baseline
    if args.no_restart:
        prm["NBD_RESTART_CLIENTS"] = []
    if args.no_throughput:
        prm["NBD_ROUNDS"] = 0
    return L.apply_kernel(prm, args.kernel, "NBD_CLIENTS", args.clients)


def estimate_s(prm):
    runs = prm["NBD_ROUNDS"] * len(prm["NBD_CLIENTS"]) * len(prm["NBD_JOBS"])
    turns = prm["NBD_ROUNDS"] * len(prm["NBD_CLIENTS"])
    restarts = prm["NBD_RESTART_ROUNDS"] * len(prm["NBD_RESTART_CLIENTS"])
    return (runs * (prm["NBD_RUNTIME_S"] + prm["NBD_RAMP_S"] + prm["NBD_OVERHEAD_PER_RUN_S"])
            + turns * 5 + restarts * (prm["NBD_RESTART_RUNTIME_S"] + 25) + 90)


def host(args):
    L.need_root()
    for tool, pkg in (("nbdkit", "nbdkit"), ("nbd-client", "nbd-client")):
        if not any(os.access(os.path.join(d, tool), os.X_OK)
                   for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")):
            die(f"{tool} is not installed (the guest runs the host's): apt-get install {pkg}, "
                f"or tests/vm/install-host-deps.sh")
    prm = effective_params(args)
    hr = L.HostRun(args, prm["CACHE_DIR"], suffix="-nbd")
    plan_path = hr.write_plan(prm)
    est = estimate_s(prm)
    timeout = int(1.6 * est + 180)
    log(f"{prm['NBD_ROUNDS']} rounds x {len(prm['NBD_CLIENTS'])} clients x "
        f"{len(prm['NBD_JOBS'])} jobs, restart phase for "
        f"{', '.join(prm['NBD_RESTART_CLIENTS']) or 'none'}; ~{est / 60:.0f} min in the VM "
        f"(timeout {timeout} s); results: {hr.outdir}")
    hr.run_and_finish(prm, plan_path, "nbd.py", timeout, prm["NBD_VM_MEM_MB"],
                      (REC, META, DONE), (summarize, table, None), "latest-nbd",
                      "records it got", "runs or restarts")


# ======================================================================================
# summary and table
# ======================================================================================

QUIET_PCT = 20  # a run is on a quiet host if other work took at most this % of a CPU
METRICS = ["iops", "p50_us", "p99_us", "nbdkit_us_per_io", "client_us_per_io",
           "sys_cpu_us_per_io", "rest_us_per_io"]


def summarize(results):
    prm, recs = results["params"], results["records"]
    out = {"jobs": {}, "restart": {}, "connections": {}}
    clients = prm["NBD_CLIENTS"]
    base = prm["NBD_RATIO_BASELINE"]
    for job in prm["NBD_JOBS"]:
        j = out["jobs"][job] = {}
        for c in clients:
            rs = [r for r in recs if r.get("kind") == "run" and r["job"] == job
                  and r["client"] == c and not r.get("error")]
            fails = sum(1 for r in recs if r.get("kind") == "run" and r["job"] == job
                        and r["client"] == c and r.get("error"))
            j[c] = {m: stats([r.get(m) for r in rs]) for m in METRICS}
            j[c]["failed_runs"] = fails
            # runs during which the host's other work took more than 20% of a CPU
            j[c]["busy_runs"] = sum(1 for r in rs if r.get("host_other_cpu_pct", 0) > QUIET_PCT)
        # the same over the runs on a quiet host only (other work <= 20% of a CPU)
        j["quiet"] = {}
        for c in clients:
            q = [r for r in recs if r.get("kind") == "run" and r["job"] == job
                 and r["client"] == c and not r.get("error")
                 and r.get("host_other_cpu_pct", 0) <= QUIET_PCT]
            j["quiet"][c] = {m: stats([r.get(m) for r in q]) for m in ("iops", "nbdkit_us_per_io",
                                                                    "client_us_per_io",
                                                                    "sys_cpu_us_per_io")}
        u, b = j.get("ublkd"), j.get(base)
        j["ratio"] = {}
        if u and b:
            for m in METRICS:
                if u[m] and b[m] and b[m]["median"]:
                    j["ratio"][m] = u[m]["median"] / b[m]["median"]
    for c in clients:
        out["connections"][c] = sorted({r["connections"] for r in recs
                                        if r.get("kind") == "attach" and r["client"] == c
                                        and r.get("connections") is not None})
    for c in prm["NBD_RESTART_CLIENTS"]:
        out["restart"][c] = [r for r in recs if r.get("kind") == "restart" and r["client"] == c]
    return out


def fms(v):
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def table(results):
    prm, summ = results["params"], results["summary"]
    m = results["meta"]
    base = prm["NBD_RATIO_BASELINE"]
    lines = []
    if prm["NBD_ROUNDS"]:
        head = (f"{'job':<18} {'client':<14} {'IOPS median [min-max]':<24} {'p50 us':>7} "
                f"{'p99 us':>7}  {'nbdkit us/IO':>12} {'ublkd us/IO':>11} "
                f"{'guest us/IO':>11} {'n':>3} {'busy':>4}")
        lines.append(head)
        lines.append("-" * len(head))
        for job in prm["NBD_JOBS"]:
            first = True
            for c in prm["NBD_CLIENTS"]:
                s = summ["jobs"][job].get(c)
                if s is None:
                    continue
                name = job if first else ""
                first = False
                fails = f" ({s['failed_runs']} failed)" if s["failed_runs"] else ""
                if not s["iops"]:
                    lines.append(f"{name:<18} {c:<14} no successful run{fails}")
                    continue
                io = s["iops"]

                def med(k):
                    return fmt_num(s[k]["median"]) if s[k] else "-"
                iops = f"{fmt_num(io['median'])} [{fmt_num(io['min'])}-{fmt_num(io['max'])}]"
                cl = med("client_us_per_io") if c == "ublkd" else "(kernel)"
                lines.append(f"{name:<18} {c:<14} {iops:<24} {med('p50_us'):>7} "
                             f"{med('p99_us'):>7}  {med('nbdkit_us_per_io'):>12} {cl:>11} "
                             f"{med('sys_cpu_us_per_io'):>11} {io['n']:>3} "
                             f"{s.get('busy_runs', 0):>4}{fails}")
            r = summ["jobs"][job]["ratio"]
            if r:
                def x(k):
                    return f"x{r[k]:.2f}" if k in r else "-"
                lines.append(f"{'':<18} {'ublkd/' + base:<14} {x('iops'):<24} "
                             f"{x('p50_us'):>7} {x('p99_us'):>7}  {x('nbdkit_us_per_io'):>12} "
                             f"{'':>11} {x('sys_cpu_us_per_io'):>11}")
            lines.append("")
        qlines = []
        for job in prm["NBD_JOBS"]:
            qj = summ["jobs"][job].get("quiet", {})
            cells = []
            for c in prm["NBD_CLIENTS"]:
                st = qj.get(c, {})
                if st.get("iops"):
                    g = st["sys_cpu_us_per_io"]
                    cells.append(f"{c} {fmt_num(st['iops']['median'])} IOPS "
                                 f"({fmt_num(g['median']) if g else '-'} guest us/IO, "
                                 f"n={st['iops']['n']})")
            u, b = qj.get("ublkd", {}).get("iops"), qj.get(base, {}).get("iops")
            if u and b and b["median"]:
                cells.append(f"ublkd/{base} x{u['median'] / b['median']:.2f}")
            if cells:
                qlines.append(f"  {job:<18} " + "; ".join(cells))
        if qlines:
            lines.append(f"the same on a quiet host only (runs during which other work took "
                         f"<= {QUIET_PCT}% of a host CPU), medians:")
            lines += qlines
            lines.append("")
        conns = ", ".join(f"{c} {'/'.join(map(str, v)) or '?'}"
                          for c, v in summ["connections"].items())
        lines.append(f"connections to nbdkit per client (counted in /proc/net/unix): {conns}")
        lines.append(
            f"{prm['NBD_ROUNDS']} rounds (every client attached for the round, taking turns "
            f"per job, the order rotated per job and round), fio {prm['NBD_RUNTIME_S']} s "
            f"+ {prm['NBD_RAMP_S']} s ramp per run, direct=1 io_uring; nbdkit memory "
            f"{prm['NBD_EXPORT_SIZE']} (filled once) on a unix socket; ublkd -q "
            f"{prm['NBD_QUEUES']} --threads {prm.get('NBD_THREADS', 1)} -d "
            f"{prm['NBD_QUEUE_DEPTH']}.")
        lines.append(
            "CPU per I/O the device completed, in a window inside each fio run: nbdkit = the "
            "server's utime+stime (all threads); ublkd = its supervisor, worker and standby "
            "(the kernel's client runs in the kernel: no process of its own, only in the "
            "total); guest = all vCPUs' busy time (fio, kernel, nbdkit, client). busy = "
            "the runs during which other work on the host took > 20% of a CPU (under TCG "
            "that slows the vCPUs and inflates their CPU time: compare those runs with "
            "care, see results.json's host_other_cpu_pct).")
        lines.append("")
    rs = [(c, r) for c, lst in summ["restart"].items() for r in lst]
    if rs:
        head = (f"{'restart':<14} {'fio exit':>8} {'errors':>8}  {'first error':<28} "
                f"{'clat max ms':>11} {'stall ms':>9} {'I/Os':>8} {'stuck':>5}  "
                f"{'device after':<14}")
        lines.append(head)
        lines.append("-" * len(head))
        for c, r in rs:
            if r.get("error") and r.get("fio_rc") is None:
                lines.append(f"{c:<14} FAILED: {r['error'][:200]}")
                continue
            first = (r.get("first_error") or "-")[:28]
            errs = r.get("fio_errors")
            lines.append(
                f"{c:<14} {str(r.get('fio_rc', '-')):>8} {str(errs if errs is not None else '-'):>8}"
                f"  {first:<28} {fms(r.get('clat_max_ms')):>11} {fms(r.get('stall_ms')):>9} "
                f"{str(r.get('fio_ios', '-')):>8} {'yes' if r.get('hung') else 'no':>5}  "
                f"{r.get('device_after', '-'):<14}")
            if r.get("device_after_why"):
                lines.append(f"{'':<14} device after: {r['device_after_why'][:200]}")
            if r.get("hung"):
                lines.append(f"{'':<14} fio's I/O was still stuck {prm['NBD_RESTART_HANG_S']} s "
                             f"after its runtime; the detach released it "
                             + (f"in {r['released_after_detach_s']} s (fio's numbers include "
                                f"the failed and released I/O)"
                                if r.get("released_after_detach_s") is not None else "not"))
            if r.get("error"):
                lines.append(f"{'':<14} note: {r['error'][:300]}")
            for k in ("client_log", "kernel_log"):
                if r.get(k):
                    lines.append(f"{'':<14} {k.replace('_', ' ')}: {r[k][:700]}")
        lines.append(
            f"fio randrw 4k qd{prm['NBD_RESTART_IODEPTH']} direct io_uring verify=crc32c "
            f"verify_backlog={prm['NBD_RESTART_VERIFY_BACKLOG']} continue_on_error=all, "
            f"{prm['NBD_RESTART_RUNTIME_S']} s; nbdkit file plugin on a "
            f"{prm['NBD_RESTART_FILE_MB']} MiB tmpfs file, SIGKILLed "
            f"{prm['NBD_RESTART_KILL_AFTER_S']} s into the I/O and started again "
            f"{prm['NBD_RESTART_DOWN_S']} s later on the same socket.")
        lines.append(
            "errors = fio's total_err (failed I/Os and verify failures); I/Os = fio's, "
            "failed ones included; clat max = fio's longest completion latency of a read or "
            "write that succeeded (fio does not time failed I/O); stall = the longest time "
            "I/O was in flight on the device (/sys/block/DEV/inflight) and none completed "
            "(/sys/block/DEV/stat; I/O the kernel fails before sending it does not show in "
            "either), measured up to the probe if I/O was stuck; stuck = fio's I/O still not done "
            f"{prm['NBD_RESTART_HANG_S']} s after its runtime (the device is then probed "
            "and detached, which ends the stuck I/O); device after = a 4k direct read and "
            "write after fio ended (or while stuck).")
        lines.append("")
    lines.append(f"kernel {m.get('kernel', '?')}, {m.get('cpus', '?')} vCPU "
                 f"({m.get('accel', 'VM')}); ublkd {results['versions'].get('ublkd', '?')}; "
                 f"{m.get('nbdkit', '?')}; {m.get('nbd_client', '?')}; "
                 f"nbd.ko: {m.get('nbd_module', '?')}.")
    for c, why in m.get("skipped", {}).items():
        lines.append(f"{c} left out: {why}")
    lines += L.footer(results)
    errs = [r for r in results["records"] if r.get("error") and r.get("kind") != "restart"]
    for r in errs[:10]:
        lines.append(f"FAILED {r.get('client')} {r.get('job', r.get('kind'))} round "
                     f"{r.get('round')}: {r['error'][:300]}")
    return "\n".join(lines)


def report(args):
    L.report(args, summarize, table)


# ======================================================================================
# guest: nbdkit and a minimal NBD client (the export's flags, the fill)
# ======================================================================================

NBD_FLAG_CAN_MULTI_CONN = 1 << 8
IHAVEOPT = 0x49484156454F5054


def recvn(s, n):
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise RuntimeError("the NBD server closed the connection")
        buf += got
    return buf


def nbd_connect(path):
    """Fixed-newstyle handshake with NBD_OPT_GO on the default export; returns (socket
    in transmission, export size, transmission flags)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(path)
    hdr = recvn(s, 18)
    if hdr[:8] != b"NBDMAGIC" or struct.unpack(">Q", hdr[8:16])[0] != IHAVEOPT:
        raise RuntimeError(f"not a newstyle NBD server: {hdr!r}")
    hflags = struct.unpack(">H", hdr[16:])[0]
    s.sendall(struct.pack(">I", 1 | (hflags & 2)))  # FIXED_NEWSTYLE, NO_ZEROES if offered
    data = struct.pack(">I", 0) + struct.pack(">H", 0)  # name "", no info requests
    s.sendall(struct.pack(">QII", IHAVEOPT, 7, len(data)) + data)  # NBD_OPT_GO
    size = flags = None
    while True:
        _magic, _opt, rtype, ln = struct.unpack(">QIII", recvn(s, 20))
        body = recvn(s, ln)
        if rtype == 1:  # NBD_REP_ACK
            break
        if rtype == 3 and struct.unpack(">H", body[:2])[0] == 0:  # NBD_INFO_EXPORT
            size, flags = struct.unpack(">QH", body[2:12])
        elif rtype & (1 << 31):
            raise RuntimeError(f"NBD_OPT_GO refused ({rtype:#x}): {body[4:]!r}")
    return s, size, flags


def nbd_fill(path, size, chunk):
    """Writes non-zero data over the whole export, `chunk` bytes per NBD_CMD_WRITE."""
    s, _, _ = nbd_connect(path)
    data = (os.urandom(4096) * (chunk // 4096 + 1))[:chunk]
    handle = 0
    for off in range(0, size, chunk):
        n = min(chunk, size - off)
        handle += 1
        s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 1, handle, off, n) + data[:n])
        magic, err, h = struct.unpack(">IIQ", recvn(s, 16))
        if magic != 0x67446698 or err or h != handle:
            raise RuntimeError(f"NBD write at {off} failed: error {err}")
    s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 2, handle + 1, 0, 0))  # NBD_CMD_DISC
    s.close()


def unix_connections(path):
    """Connections accepted on the listening unix socket `path` and still open: the
    inodes of the entries of /proc/net/unix with that path in the connected state (a
    client's own end is unbound, so it does not show the path)."""
    inodes = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            v = line.split()
            if len(v) >= 8 and v[7] == path and v[5] == "03":
                inodes.add(v[6])
    return inodes


class Nbdkit:
    """nbdkit -f --exit-with-parent -P PIDFILE -U SOCKET PLUGIN ARGS, its log in /run."""

    def __init__(self, sock, plugin_args, tag):
        self.sock, self.args = sock, plugin_args
        self.pidfile = f"/run/ublkd-bench-nbdkit-{tag}.pid"
        self.logpath = f"/run/ublkd-bench-nbdkit-{tag}.log"
        self.proc = None
        self.pid = None

    def start(self):
        for p in (self.sock, self.pidfile):
            if os.path.exists(p):
                os.unlink(p)
        logf = open(self.logpath, "a")
        self.proc = subprocess.Popen(["nbdkit", "-f", "--exit-with-parent", "-P", self.pidfile,
                                      "-U", self.sock, *self.args],
                                     stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
        logf.close()
        end = time.monotonic() + 30
        while True:
            try:
                with open(self.pidfile) as f:
                    txt = f.read().strip()
                if txt and os.path.exists(self.sock):
                    self.pid = int(txt)
                    break
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"nbdkit exited {self.proc.returncode} at start: "
                                   + L.tail(self.logpath))
            if time.monotonic() > end:
                raise RuntimeError("nbdkit's pid file did not appear within 30 s")
            time.sleep(0.02)
        return self.pid

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


# ======================================================================================
# guest: the clients
# ======================================================================================

def load_nbd():
    """Loads the kernel's NBD client; returns (how, None) or (None, why not)."""
    if os.path.isdir("/sys/module/nbd"):
        return "built in or loaded", None
    kdir = os.environ.get("UBLKD_VM_KERNEL_DIR", "")
    ko = os.path.join(kdir, "nbd.ko")
    if kdir and os.path.exists(ko):
        sh(["insmod", ko, f"nbds_max={P.NBD_NBDS_MAX}"])
        return f"insmod {ko}", None
    manifest = os.path.join(kdir, "manifest")
    nbd = None
    if os.path.exists(manifest):
        for ln in open(manifest):
            if ln.startswith("nbd="):
                nbd = ln.strip()[4:]
    if nbd == "n":
        return None, "the guest kernel has no NBD client (CONFIG_BLK_DEV_NBD unset)"
    if not kdir:
        return None, ("UBLKD_VM_KERNEL_DIR is not set: tests/vm/run is older than the "
                      "nbd.ko support (rebuild ublkd-vm)")
    return None, (f"no nbd.ko in {kdir} (a kernel cache of an older layout? "
                  f"`target/debug/ublkd-vm fetch` fetches it again)")


class KernelNbd:
    """The kernel's client, configured by nbd-client over netlink (which then exits:
    the kernel holds the sockets); each attach takes a fresh /dev/nbdN."""
    next_index = 0

    def __init__(self, name, connections):
        self.name, self.connections = name, connections
        self.dev = None

    def attach(self, sock):
        idx = KernelNbd.next_index
        KernelNbd.next_index += 1
        if idx >= P.NBD_NBDS_MAX:
            raise RuntimeError(f"out of /dev/nbdN (nbds_max={P.NBD_NBDS_MAX})")
        dev = f"nbd{idx}"
        cmd = ["nbd-client", "-unix", sock, f"/dev/{dev}", "-N", ""]
        if self.connections > 1:
            cmd += ["-C", str(self.connections)]
        out = sh(cmd, timeout=60)
        end = time.monotonic() + 20
        while True:
            try:
                with open(f"/sys/block/{dev}/size") as f:
                    if int(f.read()) > 0:
                        break
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"/dev/{dev} has no size 20 s after nbd-client: {out.strip()}")
            time.sleep(0.05)
        self.dev = dev
        return dev

    def pids(self):
        return set()

    def detach(self):
        if self.dev:
            sh(["nbd-client", "-d", f"/dev/{self.dev}"], timeout=60)
            self.dev = None

    def stop(self):
        pass

    def log_problems(self):
        return None


class UblkdNbd(L.Ublkd):
    """ublkd with `ublkctl add -t nbd --uri nbd+unix:///?socket=SOCKET`."""
    name = "ublkd"
    CFG = "/run/ublkd-bench-nbd.toml"
    LOG = "/run/ublkd-bench-nbd.log"

    def __init__(self, plan):
        super().__init__(plan)
        self.dev_id = None
        self.dev = None

    def attach(self, sock):
        if not self.proc:
            self.start()
        out = self.ctl("add", "-t", "nbd", "--uri", f"nbd+unix:///?socket={sock}",
                       "-q", str(self.prm["NBD_QUEUES"]),
                       "--threads", str(self.prm.get("NBD_THREADS", 1)),
                       "-d", str(self.prm["NBD_QUEUE_DEPTH"])).strip().splitlines()
        self.dev_id = int(out[-1])
        self.dev = L.wait_dev(self.dev_id)
        return self.dev

    def pids(self):
        return L.Ublkd.pids(self, self.dev_id)

    def status(self):
        """The device's entry in `ublkctl status --json`, or None."""
        for d in json.loads(self.ctl("status", "--json")).get("devices", []):
            if d.get("id") == self.dev_id:
                return d
        return None

    def detach(self):
        if self.dev_id is not None:
            gone = self.pids() - {self.proc.pid}
            self.delete(self.dev_id)
            self.dev_id = self.dev = None
            if not L.wait_gone(gone):
                log(f"ublkd's worker(s) {sorted(gone)} outlived the device by 10 s")


class UblkdNbdRestart(UblkdNbd):
    """The restart phase's ublkd: its own log, whose WARN/ERROR lines the table shows."""
    LOG = "/run/ublkd-bench-nbd-restart.log"


def make_client(name, plan, restart=False):
    if name == "ublkd":
        return UblkdNbdRestart(plan) if restart else UblkdNbd(plan)
    return KernelNbd(name, 2 if name.endswith("-c2") else 1)


def kernel_log_tail(since_lines):
    """The kernel's messages after its first `since_lines` lines, summarized: the nbd
    and ublk drivers' distinct messages (timestamps, request addresses and long numbers
    masked, each once with its count) and the number of "I/O error" lines. Returns
    (summary, the log's line count now)."""
    try:
        out = subprocess.run(["dmesg"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, timeout=10).stdout.splitlines()
    except Exception:
        return "", 0
    seen, ioerr = {}, 0
    for ln in out[since_lines:]:
        msg = re.sub(r"^\[\s*[\d.]+\]\s*", "", ln).strip()
        if "I/O error" in msg:
            ioerr += 1
        elif re.search(r"\bnbd\d|ublk", msg):
            key = re.sub(r"\b[0-9a-f]{8,16}\b|\d{5,}", "N", msg)
            seen[key] = seen.get(key, 0) + 1
    parts = [f"{k} (x{n})" if n > 1 else k for k, n in seen.items()]
    if ioerr:
        parts.append(f"{ioerr} 'I/O error' lines")
    return " | ".join(parts)[:700], len(out)


# ======================================================================================
# guest: the throughput phase
# ======================================================================================

def throughput(plan, meta):
    prm = plan["params"]
    jobs, nrounds = prm["NBD_JOBS"], prm["NBD_ROUNDS"]
    clients = [c for c in prm["NBD_CLIENTS"] if c not in meta["skipped"]]
    mprm = {"RUNTIME_S": prm["NBD_RUNTIME_S"], "RAMP_S": prm["NBD_RAMP_S"]}
    sock = prm["NBD_SOCKET"]
    kit = Nbdkit(sock, ["memory", prm["NBD_EXPORT_SIZE"]], "memory")
    kit.start()
    s, size, flags = nbd_connect(sock)
    s.close()
    multi = bool(flags & NBD_FLAG_CAN_MULTI_CONN)
    emit(META, {"export_size": size, "export_flags": flags, "export_multi_conn": multi})
    log(f"nbdkit memory {prm['NBD_EXPORT_SIZE']} (pid {kit.pid}): {size} bytes, flags "
        f"{flags:#x}, multi-conn {'yes' if multi else 'no'}")
    if not multi and "kernel-nbd-c2" in clients:
        clients.remove("kernel-nbd-c2")
        meta["skipped"]["kernel-nbd-c2"] = "the export does not advertise multi-conn"
        emit(META, {"skipped": meta["skipped"]})
    t = time.monotonic()
    nbd_fill(sock, size, prm["NBD_FILL_CHUNK_MB"] << 20)
    log(f"filled the export in {time.monotonic() - t:.1f} s")
    total = nrounds * len(clients) * len(jobs)
    count = 0
    ublkd = None  # one ublkd for the whole phase, its device added and deleted per round
    for rnd in range(nrounds):
        # Every client is attached for the whole round and the clients take turns per
        # job (A B C, then B C A for the next job...): each job's runs lie within a
        # minute of each other, so a burst of other work on the host hits them alike.
        order = L.rotated(clients, rnd)
        attached = {}
        for cname in order:
            if cname == "ublkd":
                ublkd = ublkd or UblkdNbd(plan)
                cl = ublkd
            else:
                cl = make_client(cname, plan)
            base = {"round": rnd + 1, "client": cname}
            try:
                before = unix_connections(sock)
                dev = cl.attach(sock)
                time.sleep(0.3)
                # (the new ones: a detached client's may still be closing)
                conns = len(unix_connections(sock) - before)
                with open(f"/sys/block/{dev}/queue/logical_block_size") as f:
                    lbs = int(f.read())
                with open(f"/sys/block/{dev}/size") as f:
                    dsize = int(f.read()) * 512
                emit(REC, {**base, "kind": "attach", "dev": dev, "connections": conns,
                           "logical_block_size": lbs, "size": dsize})
                log(f"round {rnd + 1}/{nrounds} {cname}: /dev/{dev}, {conns} connection(s) "
                    f"to nbdkit, {dsize >> 20} MiB, logical block {lbs}")
                attached[cname] = (cl, dev)
            except Exception as e:
                log(f"round {rnd + 1}/{nrounds} {cname}: attach failed: {e}")
                for job in jobs:
                    count += 1
                    emit(REC, {**base, "kind": "run", "job": job, "error": f"attach: {e}"})
        for ji, (job, spec) in enumerate(jobs.items()):
            for cname in L.rotated(order, ji):
                if cname not in attached:
                    continue
                cl, dev = attached[cname]
                count += 1
                rec = {"round": rnd + 1, "client": cname, "kind": "run", "job": job}
                log(f"round {rnd + 1}/{nrounds}  [{count}/{total}]  {cname:<13} {job}")
                try:
                    rec.update(measure_run(cl, cname, dev, job, spec, kit, mprm))
                except Exception as e:
                    rec["error"] = str(e)
                    log(f"    FAILED: {e}")
                emit(REC, rec)
        for cname, (cl, _dev) in attached.items():
            try:
                cl.detach()
            except Exception as e:
                log(f"round {rnd + 1}/{nrounds} {cname}: detach failed: {e}")
    if ublkd:
        try:
            ublkd.stop()
        except Exception as e:
            log(f"ublkd stop failed: {e}")
        probs = ublkd.log_problems()
        if probs:
            log(f"ublkd logged {probs[0]} warnings/errors in the throughput phase; the "
                f"last: {probs[1]}")
    kit.stop()


def measure_run(cl, cname, dev, job, spec, kit, mprm):
    """One fio run with bench.py's measure(), its server CPU split into nbdkit's and the
    client's (ublkd's processes; the kernel's client has none)."""
    res = B.measure(_PidsOf(cl.pids() | {kit.pid}), None, dev, job, tuple(spec), mprm)
    ios = res["window_ios"]
    kit_s = res["per_pid_cpu_s"].get(str(kit.pid), 0.0)
    res["nbdkit_cpu_s"] = kit_s
    res["client_cpu_s"] = res["server_cpu_s"] - kit_s if cname == "ublkd" else None
    if ios:
        res["nbdkit_us_per_io"] = kit_s / ios * 1e6
        res["client_us_per_io"] = (res["client_cpu_s"] / ios * 1e6
                                   if res["client_cpu_s"] is not None else None)
        res["rest_us_per_io"] = res["sys_cpu_us_per_io"] - res["server_cpu_s"] / ios * 1e6
    res.pop("cpu_us_per_io", None)  # nbdkit + client: split above
    log(f"    {fmt_num(res['iops'])} IOPS  p50 {fmt_num(res['p50_us'])} us  "
        f"p99 {fmt_num(res['p99_us'])} us  nbdkit {fmt_num(res.get('nbdkit_us_per_io'))} us/IO  "
        + (f"ublkd {fmt_num(res.get('client_us_per_io'))} us/IO  " if cname == "ublkd" else "")
        + f"guest {fmt_num(res['sys_cpu_us_per_io'])} us/IO"
        + (f"  [{res['note']}]" if res.get("note") else ""))
    return res


class _PidsOf:
    """What bench.measure() asks of a server: its pids."""

    def __init__(self, pids):
        self._pids = pids

    def pids(self, _dev_id):
        return self._pids


# ======================================================================================
# guest: the restart phase
# ======================================================================================

FIO_OUT = "/tmp/ublkd-bench-nbd-fio"


def restart_fio_cmd(dev, prm):
    return ["fio", "--name=nbd-restart", f"--filename=/dev/{dev}", "--rw=randrw",
            "--bs=4k", "--ioengine=io_uring", "--direct=1",
            f"--iodepth={prm['NBD_RESTART_IODEPTH']}", "--verify=crc32c",
            f"--verify_backlog={prm['NBD_RESTART_VERIFY_BACKLOG']}", "--verify_state_save=0",
            "--continue_on_error=all", "--time_based",
            f"--runtime={prm['NBD_RESTART_RUNTIME_S']}", "--output-format=json",
            f"--output={FIO_OUT}.json"]


class GapWatch(threading.Thread):
    """Polls /sys/block/DEV/stat (reads + writes completed) and /sys/block/DEV/inflight
    every ~5 ms; keeps the longest stall: a stretch in which I/O was in flight and
    none completed (ending at a completion, or at finish() if I/O is still stuck)."""

    def __init__(self, dev):
        super().__init__(daemon=True)
        self.dev, self.stop_ev = dev, threading.Event()
        self.longest = 0.0
        self.since = None  # when the current stall began (the last completion), or None

    def inflight(self):
        with open(f"/sys/block/{self.dev}/inflight") as f:
            return sum(int(x) for x in f.read().split())

    def run(self):
        last_val = L.disk_ios(self.dev)
        last_t = time.monotonic()
        while not self.stop_ev.is_set():
            v, busy, now = L.disk_ios(self.dev), self.inflight(), time.monotonic()
            if v != last_val:
                if self.since is not None:
                    self.longest = max(self.longest, now - self.since)
                last_val, last_t = v, now
                self.since = last_t if busy else None
            elif busy and self.since is None:
                self.since = last_t
            elif not busy:
                self.since = None
            time.sleep(0.005)

    def finish(self, stuck):
        """Stops polling; with `stuck` a stall still going on counts up to now.
        Returns the longest stall in ms."""
        self.stop_ev.set()
        self.join()
        if stuck and self.since is not None:
            self.longest = max(self.longest, time.monotonic() - self.since)
        return self.longest * 1e3


def device_works(dev, timeout=20):
    """A 4k direct read at 0 and the same 4k written back: "works", "fails" (an error)
    or "hangs" (not done within `timeout` s: dd is killed but not waited for, as a
    process stuck on the device's I/O cannot exit), with the why."""
    for cmd in (["dd", f"if=/dev/{dev}", f"of={FIO_OUT}.blk", "bs=4096", "count=1",
                 "iflag=direct", "status=none"],
                ["dd", f"if={FIO_OUT}.blk", f"of=/dev/{dev}", "bs=4096", "count=1",
                 "oflag=direct", "conv=notrunc", "status=none"]):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return "hangs", f"a 4k direct {'read' if 'iflag=direct' in cmd else 'write'} " \
                            f"did not finish within {timeout} s"
        if p.returncode != 0:
            return "fails", p.stderr.read().strip()[:200]
    return "works", None


def fio_restart_result(rc, path):
    """fio's exit status, errors and longest completion latency from its json."""
    out = {"fio_rc": rc}
    try:
        with open(path) as f:
            jb = L.fio_job(f.read())
    except (OSError, ValueError) as e:
        out["error"] = f"no fio json: {e}"
        return out
    out["fio_errors"] = jb.get("total_err", 0)
    if jb.get("first_error"):
        out["first_error"] = f"errno {jb['first_error']} ({os.strerror(jb['first_error'])})"
    elif jb.get("error"):
        out["first_error"] = f"errno {jb['error']} ({os.strerror(jb['error'])})"
    r, w = jb["read"], jb["write"]
    out["fio_ios"] = r["total_ios"] + w["total_ios"]
    out["fio_reads"], out["fio_writes"] = r["total_ios"], w["total_ios"]
    cmax = max(r["clat_ns"].get("max", 0), w["clat_ns"].get("max", 0))
    out["clat_max_ms"] = cmax / 1e6
    return out


def restart_one(plan, cname, rnd):
    prm = plan["params"]
    rec = {"kind": "restart", "client": cname, "round": rnd}
    sock = prm["NBD_SOCKET"]
    L.zero_file(prm["NBD_RESTART_FILE"], prm["NBD_RESTART_FILE_MB"])
    kit = Nbdkit(sock, ["file", prm["NBD_RESTART_FILE"]], "file")
    cl = make_client(cname, plan, restart=True)
    fio = watch = None
    _, klines = kernel_log_tail(0)
    try:
        kit.start()
        dev = cl.attach(sock)
        rec["dev"] = dev
        time.sleep(0.3)
        rec["connections"] = len(unix_connections(sock))
        for p in (FIO_OUT + ".json", FIO_OUT + ".err"):
            if os.path.exists(p):
                os.unlink(p)
        watch = GapWatch(dev)
        watch.start()
        errf = open(FIO_OUT + ".err", "w")
        d0 = L.disk_ios(dev)
        fio = subprocess.Popen(restart_fio_cmd(dev, prm), stdout=subprocess.DEVNULL,
                               stderr=errf, cwd="/tmp")
        errf.close()
        t_fio = time.monotonic()
        while L.disk_ios(dev) == d0:
            if fio.poll() is not None or time.monotonic() - t_fio > 120:
                raise RuntimeError("fio did no I/O on the device: " + L.tail(FIO_OUT + ".err"))
            time.sleep(0.02)
        time.sleep(prm["NBD_RESTART_KILL_AFTER_S"])
        old = kit.pid
        kit.kill()
        t_kill = time.monotonic()
        log(f"restart {cname}: nbdkit (pid {old}) SIGKILLed; fio running "
            f"{t_kill - t_fio:.1f} s")
        time.sleep(prm["NBD_RESTART_DOWN_S"])
        kit.start()
        rec["down_s"] = round(time.monotonic() - t_kill, 2)
        log(f"restart {cname}: nbdkit restarted (pid {kit.pid}) after {rec['down_s']} s")
        # fio ends RUNTIME after its start unless I/O is stuck; NBD_RESTART_HANG_S later
        # the device is probed and detached (which fails what is stuck), so that fio
        # exits and reports its errors.
        t_end = t_fio + prm["NBD_RESTART_RUNTIME_S"] + prm["NBD_RESTART_HANG_S"]
        try:
            rc = fio.wait(timeout=max(1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            rec["hung"] = True
            rec["stall_ms"] = watch.finish(stuck=True)
            rec["device_after"], why = device_works(dev, timeout=10)
            rec["device_after_why"] = why
            log(f"restart {cname}: fio's I/O still stuck {prm['NBD_RESTART_HANG_S']} s after "
                f"its runtime; the device {rec['device_after']}; detaching it")
            t_det = time.monotonic()
            try:
                cl.detach()
            except Exception as e:
                rec["detach_error"] = str(e)[:300]
            try:
                rc = fio.wait(timeout=60)
                rec["released_after_detach_s"] = round(time.monotonic() - t_det, 2)
            except subprocess.TimeoutExpired:
                fio.kill()
                try:
                    rc = fio.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    rc = None  # stuck on I/O that never completes: left behind
                rc = f"killed ({rc})"
                rec["error"] = "fio did not exit within 60 s of the detach: killed"
        if not rec.get("hung"):
            rec["stall_ms"] = watch.finish(stuck=False)
        rec["fio_elapsed_s"] = round(time.monotonic() - t_fio, 1)
        res = fio_restart_result(rc, FIO_OUT + ".json")
        if res.pop("error", None) and not rec.get("error"):
            rec["error"] = "fio wrote no json: " + L.tail(FIO_OUT + ".err", 3)
        rec.update(res)
        rec["connections_after"] = len(unix_connections(sock))
        if not rec.get("hung"):
            rec["device_after"], why = device_works(dev)
            if why:
                rec["device_after_why"] = why
        errtail = L.tail(FIO_OUT + ".err", 2)
        if errtail:
            rec["fio_stderr"] = errtail[:300]
    except Exception as e:
        rec["error"] = str(e)
        if fio and fio.poll() is None:
            fio.kill()
            try:
                fio.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if watch:
            watch.stop_ev.set()
    rec["kernel_log"], _ = kernel_log_tail(klines)
    if isinstance(cl, UblkdNbd):
        try:
            st = cl.status() if cl.dev_id is not None else None
            if st:
                rec["ublkd_status"] = st
        except Exception as e:
            rec["ublkd_status"] = f"ublkctl status failed: {e}"
        probs = cl.log_problems()
        if probs:
            rec["client_log"] = f"{probs[0]} WARN/ERROR lines in ublkd's log, the last: {probs[1]}"
    try:
        cl.detach()
    except Exception as e:
        rec["detach_error"] = str(e)[:300]
    try:
        cl.stop()
    except Exception as e:
        rec["stop_error"] = str(e)[:300]
    kit.stop()
    os.unlink(prm["NBD_RESTART_FILE"])
    log(f"restart {cname}: fio exit {rec.get('fio_rc')}, {rec.get('fio_errors')} errors "
        f"(first: {rec.get('first_error', '-')}), clat max "
        f"{fms(rec.get('clat_max_ms'))} ms, longest stall {fms(rec.get('stall_ms'))} ms, "
        f"{rec.get('fio_ios')} I/Os; device after: {rec.get('device_after')}"
        + (f"; {rec['error']}" if rec.get("error") else ""))
    emit(REC, rec)


# ======================================================================================

def guest(args):
    plan = L.read_plan(args.plan)
    prm = plan["params"]
    t_start = time.monotonic()
    meta = {**L.guest_meta(), "skipped": {}}
    meta["nbdkit"] = sh(["nbdkit", "--version"]).strip().splitlines()[0]
    try:
        meta["nbd_client"] = sh(["nbd-client", "-V"]).strip().splitlines()[0]
    except Exception as e:
        meta["nbd_client"] = f"nbd-client -V failed: {e}"
    L.check_kernel(prm)
    how, why = load_nbd()
    meta["nbd_module"] = how or f"unavailable: {why}"
    if not how:
        for c in CLIENTS:
            if c.startswith("kernel-"):
                meta["skipped"][c] = why
    emit(META, meta)
    log(f"nbd.ko: {meta['nbd_module']}; {meta['nbdkit']}; {meta['nbd_client']}")
    if prm["NBD_ROUNDS"]:
        try:
            throughput(plan, meta)
        except Exception as e:
            emit(REC, {"kind": "phase", "client": "-", "error": f"throughput phase: {e}"})
            log(f"throughput phase FAILED: {e}")
    for rnd in range(prm["NBD_RESTART_ROUNDS"]):
        for cname in prm["NBD_RESTART_CLIENTS"]:
            if cname in meta["skipped"]:
                continue
            restart_one(plan, cname, rnd + 1)
    log(f"done in {time.monotonic() - t_start:.0f} s in the VM")
    print(DONE, flush=True)


# ======================================================================================

def host_args(h):
    h.add_argument("--quick", action="store_true",
                   help="smoke check: 2 rounds, 2 s runs, 2 jobs, and the restart phase")
    h.add_argument("--rounds", type=int, help="override NBD_ROUNDS")
    h.add_argument("--runtime", type=int, help="override NBD_RUNTIME_S (seconds per fio run)")
    h.add_argument("--clients", help="comma-separated subset of " + ",".join(CLIENTS))
    h.add_argument("--jobs", help="comma-separated subset of " + ",".join(P.NBD_JOBS))
    h.add_argument("--queues", type=int, help="override NBD_QUEUES (ublkd -q)")
    h.add_argument("--threads", type=int,
                   help="override NBD_THREADS (ublkd --threads: one connection per thread "
                        "where the export allows multi-conn; compare 2 with kernel-nbd-c2)")
    h.add_argument("--baseline", help="the client ublkd's ratios are against "
                                      "(default NBD_RATIO_BASELINE)")
    h.add_argument("--no-restart", action="store_true", help="skip the restart phase")
    h.add_argument("--no-throughput", action="store_true", help="only the restart phase")
    h.add_argument("--out", help="results parent dir (default bench/results)")
    L.add_kernel_arg(h)


if __name__ == "__main__":
    L.main("bench/run nbd", __doc__, host_args,
           {"host": host, "guest": guest, "report": report},
           guest_help="(inside the VM) run the phases of a plan",
           report_help="re-print the table of a results dir")
