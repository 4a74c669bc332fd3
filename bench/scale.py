#!/usr/bin/env python3
"""ublkd's scale benchmark: what N devices cost (issue 18), in one VM boot.

Run through `bench/run scale` (see bench/README.md). Per count N of SCALE_COUNTS, a
fresh ublkd adds N null devices one `ublkctl add` after another, then the table reports:
add time per device, memory per idle device (PSS of ublkd and all its processes, divided
by N), ublkd's idle CPU (and its workers'), how long `status --json` of every device,
`status -n` of one, `list` and `metrics` take, the recovery stall of device 0 (SIGKILL of
its worker, stall = kill -> first I/O completed after) while fio reads from 9 of the
others, and `del -a` per device.

  host    build ublkd, boot the VM, collect its records, write the results
  guest   (inside the VM) the counts of a plan
  report  re-print the table of an earlier results dir

Python 3 standard library only; parameters in bench/params.py (the SCALE_* block).
"""

import json
import os
import resource
import signal
import statistics
import subprocess
import time

import benchlib as L
import cli
import params as P
import servers as S
from benchlib import log, emit
from stall import kill_and_watch

REC, META, DONE = L.markers("SCALE")
FIO_STOP = "/run/ublkd-bench-scale.stop"
# The baseline: two processes of ~1.8 MiB PSS each per idle device (round 1).
BEFORE_KIB = 3.6 * 1024


# ======================================================================================
# host
# ======================================================================================

# the flags of `host` (cli.py: the shared ones)
HOST_ARGS = {
    "--counts": {"help": "comma-separated device counts (default SCALE_COUNTS)"},
    "--kills": cli.override("SCALE_KILLS"),
    "--timeout": {"type": int,
                  "help": "the VM run's timeout in s (default: twice the estimate)"},
    "--out": cli.OUT,
}


def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.isupper()}
    if args.counts:
        prm["SCALE_COUNTS"] = [int(c) for c in args.counts.split(",")]
    if args.kills is not None:
        prm["SCALE_KILLS"] = args.kills
    return prm


def host(args):
    L.need_root()
    prm = effective_params(args)
    hr = L.HostRun(args, prm["CACHE_DIR"], "scale.py", (REC, META, DONE), prefix="scale-")
    # ~0.5-1 s per add and ~0.2 s per delete under TCG, plus the fixed parts.
    est = sum(1.2 * n + 120 for n in prm["SCALE_COUNTS"])
    timeout = int(2 * est + 300) if not args.timeout else args.timeout
    hr.run_and_finish(prm, f"counts {prm['SCALE_COUNTS']}, ", est, timeout,
                      prm["SCALE_VM_MEM_MB"], (summarize, table, None), "counts it got", "counts")


def summarize(results):
    return {str(r["n"]): {k: r.get(k) for k in ("pss_kib_per_dev", "add_ms_mean", "stall_ms_median",
                                                 "kills_cpu_pct_ublkd")}
            for r in results["records"] if not r.get("error")}


def growth(results):
    """The most devices against the fewest: ublkd's CPU in the kill phase and the median
    stall, as ratios (the goal: at most 1.5, a turn's cost not growing with devices)."""
    ok = [r for r in results["records"] if not r.get("error") and r.get("stalls_ms")]
    if len(ok) < 2:
        return []
    lo, hi = min(ok, key=lambda r: r["n"]), max(ok, key=lambda r: r["n"])
    out = []
    for key, what in (("kills_cpu_pct_ublkd", "ublkd CPU while killing"),
                      ("stall_ms_median", "median recovery stall")):
        if lo.get(key) and hi.get(key) is not None:
            out.append(f"{what}: {hi[key]:.2f} at {hi['n']} devices / {lo[key]:.2f} at "
                       f"{lo['n']} = x{hi[key] / lo[key]:.2f}")
    return out


def fmt(v, nd=0):
    return "-" if v is None else f"{v:.{nd}f}"


def table(results):
    rows = [("devices", "add ms/dev", "PSS KiB/dev", "vs 3.6 MiB", "ublkd idle CPU %",
             "workers idle CPU %", "status all ms", "status -n ms", "list ms", "metrics ms",
             "stall ms median (max)", "ublkd CPU % killing", "del -a ms/dev")]
    for r in results["records"]:
        if r.get("error"):
            rows.append((str(r["n"]), f"failed: {r['error'][:100]}"))
            continue
        rows.append((
            str(r["n"]), fmt(r["add_ms_mean"]), fmt(r["pss_kib_per_dev"]),
            fmt(r["pss_kib_per_dev"] / BEFORE_KIB, 2) + "x",
            fmt(r["idle_cpu_pct_ublkd"], 2), fmt(r["idle_cpu_pct_workers"], 2),
            fmt(r["status_all_ms"]), fmt(r["status_one_ms"]), fmt(r["list_ms"]),
            fmt(r["metrics_ms"]),
            f"{fmt(r['stall_ms_median'])} ({fmt(r['stall_ms_max'])})" if r.get("stalls_ms") else "-",
            fmt(r.get("kills_cpu_pct_ublkd"), 2), fmt(r["del_ms_per_dev"])))
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(widths[i]) for i, c in enumerate(row)) for row in rows]
    for r in results["records"]:
        for hung in r.get("fio_hung", []):
            lines.append(f"{r['n']} devices: {hung}")
    meta = results.get("meta", {})
    lines += ["", f"null devices ({results['params']['SCALE_SIZE']}, -q 1 -d 128), added one "
              f"`ublkctl add` after another; kernel {meta.get('kernel', '?')}, "
              f"{meta.get('cpus', '?')} vCPU ({meta.get('accel', '?')}); ublkd "
              f"{results['versions'].get('ublkd', '?')} (release build).",
              "PSS: ublkd and every worker and standby (smaps_rollup), divided by the devices; "
              "3.6 MiB is round 1's ~1.8 MiB per process, two per device.",
              f"stall: SIGKILL of device 0's worker -> first I/O completed after, with fio "
              f"reading 4k at {results['params']['SCALE_BYSTANDER_IOPS']} IOPS spread over "
              f"the other devices; {results['params']['SCALE_KILLS']} kills, about one a second "
              "(each after the last recovery, then 1 s); ublkd CPU % killing: its CPU over "
              "that phase."]
    lines += growth(results)
    lines += L.footer(results)
    return "\n".join(lines)


# ======================================================================================
# guest
# ======================================================================================

class Ublkd(S.Ublkd):
    CFG = "/run/ublkd-bench-scale.toml"
    LOG = "/run/ublkd-bench-scale.log"
    EXPECTED = r"killed by signal 9\b|the worker user ublkd-worker does not exist"

    def config(self):
        # The kills come about one a second: never the restart limit (5 in 60 s by
        # default), which would hold device 0's I/O until `ublkctl recover`.
        text = super().config()
        if "[recovery]" not in text:
            text += "[recovery]\n"
        return text + f'restart_max = {self.prm["RECOVERY_RESTART_MAX"]}\n'


def pss_kib(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], list(kids.get(root, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def timed_ms(fn, reps):
    vals = []
    for _ in range(reps):
        t = time.monotonic()
        fn()
        vals.append((time.monotonic() - t) * 1e3)
    return statistics.median(vals)


class Counter:
    def __init__(self, dev):
        self.dev = dev

    def read(self):
        return L.disk_ios(self.dev)


def one_count(n, plan):
    prm = plan["params"]
    u = Ublkd(plan)
    rec = {"n": n}
    u.start()
    bystander = None
    try:
        adds = []
        for i in range(n):
            t = time.monotonic()
            u.ctl("add", "-t", "null", "-s", prm["SCALE_SIZE"], "-q", "1", "-d", "128")
            adds.append((time.monotonic() - t) * 1e3)
            if (i + 1) % 50 == 0:
                log(f"{n} devices: {i + 1} added, {statistics.mean(adds):.0f} ms each so far")
        rec["add_ms_mean"] = statistics.mean(adds)
        rec["add_ms_max"] = max(adds)
        time.sleep(prm["SCALE_SETTLE_S"])
        procs = descendants(u.proc.pid)
        rec["processes"] = len(procs)
        rec["ublkd_pss_kib"] = pss_kib(u.proc.pid)
        total = rec["ublkd_pss_kib"] + sum(pss_kib(p) for p in procs)
        rec["pss_kib_per_dev"] = total / n
        # Idle CPU: ublkd alone, and its workers and standbys together.
        c0 = L.proc_cpu_s(u.proc.pid)
        w0 = sum(L.proc_cpu_s(p) or 0 for p in procs)
        t0 = time.monotonic()
        time.sleep(prm["SCALE_IDLE_S"])
        dt = time.monotonic() - t0
        rec["idle_cpu_pct_ublkd"] = 100 * (L.proc_cpu_s(u.proc.pid) - c0) / dt
        rec["idle_cpu_pct_workers"] = 100 * (sum(L.proc_cpu_s(p) or 0 for p in procs) - w0) / dt
        reps = prm["SCALE_STATUS_REPS"]
        rec["status_all_ms"] = timed_ms(lambda: u.ctl("status", "--json"), reps)
        rec["status_one_ms"] = timed_ms(lambda: u.ctl("status", "-n", str(n // 2)), reps)
        rec["list_ms"] = timed_ms(lambda: u.ctl("list"), reps)
        rec["metrics_ms"] = timed_ms(lambda: u.ctl("metrics"), reps)
        log(f"{n} devices: {rec['pss_kib_per_dev']:.0f} KiB each, status of all "
            f"{rec['status_all_ms']:.0f} ms; starting fio and the kills")
        c0, t0 = L.proc_cpu_s(u.proc.pid), time.monotonic()
        rec["stalls_ms"], hung = kills(u, n, prm)
        # ublkd's CPU over the kill phase: one kill about every second, with the
        # recoveries, the bystanders' fio and every other device on its loop.
        rec["kills_cpu_pct_ublkd"] = 100 * (L.proc_cpu_s(u.proc.pid) - c0) / (time.monotonic() - t0)
        if hung:
            rec["fio_hung"] = hung
        if rec["stalls_ms"]:
            rec["stall_ms_median"] = statistics.median(rec["stalls_ms"])
            rec["stall_ms_max"] = max(rec["stalls_ms"])
        t = time.monotonic()
        u.ctl("del", "-a")
        rec["del_ms_per_dev"] = (time.monotonic() - t) * 1e3 / n
        problems = Ublkd.log_problems()
        if problems:
            rec["log_problems"] = problems
    except Exception as e:  # recorded, the next count still runs
        rec["error"] = str(e)
        log(f"{n} devices failed: {e}")
    finally:
        if bystander:
            bystander.kill()
        try:
            u.ctl("shutdown")
        except Exception:
            pass
        u.stop()
    return rec


def bystanders(n, count):
    """`count` device ids spread evenly over 1..n-1 (all of them if there are fewer)."""
    if n - 1 <= count:
        return list(range(1, n))
    return sorted({1 + (k * (n - 1)) // count for k in range(count)})


def kills(u, n, prm):
    """SIGKILLs device 0's worker SCALE_KILLS times while fio reads from device 0 and,
    at a bounded rate, from SCALE_BYSTANDERS others spread over the rest (one fio, the
    same load at every N: the other devices are idle, as the control-plane issue's
    comparison asks); the stalls in ms."""
    if prm["SCALE_KILLS"] == 0:
        return [], []
    # One stop file per fio (fio deletes the file it triggered on).
    groups = [bystanders(n, prm["SCALE_BYSTANDERS"])]
    groups = [g for g in groups if g]
    stops = [f"{FIO_STOP}.dev0"] + [f"{FIO_STOP}.others{g}" for g in range(len(groups))]
    for stop in stops:
        if os.path.exists(stop):
            os.unlink(stop)
    common = ["--ioengine=io_uring", "--direct=1", "--bs=4k", "--rw=randread", "--time_based",
              "--runtime=600", "--output-format=json"]
    fios = [subprocess.Popen(["fio", "--name=dev0", "--filename=/dev/ublkb0", "--iodepth=32",
                              f"--trigger-file={stops[0]}", *common],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    for g, group in enumerate(groups):
        files = ":".join(f"/dev/ublkb{i}" for i in group)
        rate = prm["SCALE_BYSTANDER_IOPS"]
        fios.append(subprocess.Popen(
            ["fio", f"--name=others{g}", f"--filename={files}", "--iodepth=4",
             "--file_service_type=random", f"--rate_iops={rate}",
             f"--trigger-file={stops[g + 1]}", *common],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    stalls = []
    try:
        # fio opens every device first: hundreds take it seconds under emulation.
        time.sleep(3 + n / 50)
        for f in fios:
            if f.poll() is not None:
                _, err = f.communicate()
                raise RuntimeError(f"a fio exited {f.returncode} at start: {err.strip()[-300:]}")
        ctr = Counter("ublkb0")
        kprm = {"RECOVERY_TIMEOUT_S": prm["SCALE_RECOVERY_TIMEOUT_S"], "RECOVERY_POLL_S": 0.0002}
        for k in range(prm["SCALE_KILLS"]):
            pid = worker_of(u, 0)
            log(f"{n} devices: kill {k + 1} of device 0's worker {pid}")
            _, _, res = kill_and_watch(pid, ctr, kprm)
            if res is None:
                raise RuntimeError("device 0's I/O did not resume within "
                                   f"{prm['SCALE_RECOVERY_TIMEOUT_S']} s of a kill")
            stalls.append(res["stall_ms"])
            log(f"{n} devices: I/O resumed {res['stall_ms']:.0f} ms after the kill")
            wait_live(u, 0, pid)
            time.sleep(1)
    finally:
        log(f"{n} devices: stopping fio")
        for stop in stops:
            open(stop, "w").close()
        hung = fio_stop_all(fios)
    return stalls, hung


def stuck_io():
    """The ublk devices with I/O in flight (/sys/block/ublkbN/inflight), as 'N:R/W'."""
    out = []
    for name in sorted(os.listdir("/sys/block")):
        if not name.startswith("ublkb"):
            continue
        try:
            with open(f"/sys/block/{name}/inflight") as fh:
                r, w = fh.read().split()
        except OSError:
            continue
        if r != "0" or w != "0":
            out.append(f"{name[5:]}:{r}/{w}")
    return out


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/wchan") as fh:
            wchan = fh.read().strip()
        with open(f"/proc/{pid}/status") as fh:
            state = next((l.split(None, 1)[1].strip() for l in fh if l.startswith("State:")), "?")
        return f"{state}, wchan {wchan or '-'}"
    except OSError as e:
        return str(e)


def fio_stop_all(fios):
    """Waits for fios told to stop by their trigger files, all together: those that have
    not stopped within 60 s (fio over hundreds of files can be slow to) get SIGINT, and
    those still running 60 s later are described (their state, the devices with I/O in
    flight), SIGKILLed, and their descriptions returned, so that the count's other
    figures (del -a) are still measured. Raises if a job reported an error: what counts
    is that no I/O failed, not how fio ended."""
    outputs = {}

    def reap(deadline):
        for f in fios:
            if f in outputs:
                continue
            try:
                outputs[f] = f.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    reap(time.monotonic() + 60)
    for f in fios:
        if f not in outputs:
            f.send_signal(signal.SIGINT)
    reap(time.monotonic() + 60)
    hung = []
    stuck = stuck_io()
    for f in fios:
        if f in outputs:
            continue
        what = (f"fio {' '.join(a for a in f.args if a.startswith('--name'))} did not "
                f"stop within 60 s of SIGINT: {proc_state(f.pid)}; devices with I/O in "
                f"flight: {', '.join(stuck[:20]) or 'none'}"
                f"{' (+%d more)' % (len(stuck) - 20) if len(stuck) > 20 else ''}")
        log(what)
        f.kill()
        try:
            f.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            what += "; it did not exit within 30 s of SIGKILL either"
            log(what)
        hung.append(what)
    for f, (out, err) in outputs.items():
        at = out.find("{")
        if at < 0:
            raise RuntimeError(f"fio exited {f.returncode} without a report: {err.strip()[-300:]}")
        jobs = json.loads(out[at:]).get("jobs", [])
        failed = [j for j in jobs if j.get("error")]
        if not jobs or failed:
            raise RuntimeError(f"fio reported errors: {failed or 'no jobs'}; {err.strip()[-300:]}")
    return hung


def worker_of(u, dev_id):
    st = json.loads(u.ctl("status", "-n", str(dev_id), "--json"))
    devs = st.get("devices", st if isinstance(st, list) else [])
    return int(devs[0]["worker_pid"])


def wait_live(u, dev_id, old_pid, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if worker_of(u, dev_id) != old_pid:
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"device {dev_id} had no new worker {timeout} s after a kill")


def guest(args):
    plan = L.read_plan(args.plan)
    prm = plan["params"]
    resource.setrlimit(resource.RLIMIT_NOFILE, (prm["SCALE_NOFILE"], prm["SCALE_NOFILE"]))
    emit(META, L.guest_meta())
    t_start = time.monotonic()
    for n in prm["SCALE_COUNTS"]:
        log(f"{n} devices")
        emit(REC, one_count(n, plan))
    log(f"done in {time.monotonic() - t_start:.0f} s in the VM")
    print(DONE, flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    cli.main("bench/run scale", __doc__, HOST_ARGS, host, guest, (summarize, table, None),
             "counts")
