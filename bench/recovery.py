#!/usr/bin/env python3
"""ublkd's recovery-stall benchmark: how long I/O stalls when the server is SIGKILLed,
ublkd (recovers by itself from a warm standby) beside kublk (`kill -9` of its daemon,
then at once `kublk recover`, as an operator's script would), in one VM boot.

Run through `bench/run recovery` (see bench/README.md). Three halves, one file:

  host    build ublkd and kublk, boot the VM, collect its records, write the results
  guest   (inside the VM) per server: a loop device, fio verifying on it, N kills
  report  re-print the table of an earlier results dir

The stall of one kill = from the kill(2) to the first I/O the device completes after
the killed process is gone (`/sys/block/ublkbN/stat`, reads + writes completed, polled
every RECOVERY_POLL_S). Python 3 standard library only; parameters in bench/params.py
(the RECOVERY_* block). What this shares with bench.py (builds, the VM run, the
servers) is in bench/benchlib.py.
"""

import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import params as P  # noqa: E402
import benchlib as L  # noqa: E402
from benchlib import log, die, emit, sh, stats  # noqa: E402

REC = "@@UBLKD-RECOVERY-REC@@ "
META = "@@UBLKD-RECOVERY-META@@ "
DONE = "@@UBLKD-RECOVERY-DONE@@"
# ublkd and kublk-b copy every request (the comparison: kublk -b); ublkd-zc and
# kublk-b-zc are the zero-copy pair (ublkd's default for loop devices, kublk --auto_zc).
# ublkd-deferred: ublkd (copying) with `recovery.fast_release = false`, whose recovery
# waits for the kernel to tear the dead worker's rings down, as kublk's does. kublk:
# kublk without -b, the per-I/O peer on 6.12 (no UBLK_F_BATCH_IO; ublkd's per-I/O path).
SERVERS = ("ublkd", "kublk-b", "ublkd-zc", "kublk-b-zc", "ublkd-deferred", "kublk")
PAIRS = (("ublkd", "kublk-b"), ("ublkd-zc", "kublk-b-zc"), ("ublkd-deferred", "kublk-b"),
         ("ublkd", "kublk"), ("ublkd-deferred", "kublk"))
NOTES = {"ublkd-zc": "zero copy: the dead server's ring also holds the requests' registered "
                     "pages",
         "ublkd-deferred": "recovery.fast_release = false: the kernel's teardown of the dead "
                           "worker's rings, as for kublk"}


def baseline(servers):
    """ublkd's peer for the target: kublk -b where it runs (7.x), else kublk (6.12)."""
    return "kublk-b" if "kublk-b" in servers else "kublk"


# ======================================================================================
# host
# ======================================================================================

def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.startswith("RECOVERY_")}
    prm["CACHE_DIR"] = P.CACHE_DIR
    prm["VM_MEM_MB"] = P.VM_MEM_MB
    if args.kills:
        prm["RECOVERY_KILLS"] = args.kills
    if args.rounds:
        prm["RECOVERY_ROUNDS"] = args.rounds
    if args.interval is not None:
        prm["RECOVERY_INTERVAL_S"] = args.interval
    if args.servers:
        prm["RECOVERY_SERVERS"] = args.servers.split(",")
    for s in prm["RECOVERY_SERVERS"]:
        if s not in SERVERS:
            die(f"unknown server {s!r}; known: {', '.join(SERVERS)}", 2)
    L.apply_kernel(prm, args.kernel, "RECOVERY_SERVERS", args.servers)
    if prm["RECOVERY_ROUNDS"] < 1 or prm["RECOVERY_KILLS"] < prm["RECOVERY_ROUNDS"]:
        die("need rounds >= 1 and kills >= rounds", 2)
    return prm


def estimate_s(prm):
    per_kill = prm["RECOVERY_INTERVAL_S"] + 3.0        # stall + status queries, TCG
    per_series = 2 * prm["RECOVERY_FIO_SETTLE_S"] + 12  # add, fio start-up, del
    return (len(prm["RECOVERY_SERVERS"]) * (prm["RECOVERY_KILLS"] * per_kill
            + prm["RECOVERY_ROUNDS"] * per_series) + 30)


def host(args):
    L.need_root()
    prm = effective_params(args)
    hr = L.HostRun(args, prm["CACHE_DIR"], prefix="recovery-")
    if any(s.startswith("kublk") for s in prm["RECOVERY_SERVERS"]):
        if not hr.build_peer("kublk", L.build_kublk, args.rebuild_peers):
            prm["RECOVERY_SERVERS"] = [s for s in prm["RECOVERY_SERVERS"]
                                       if not s.startswith("kublk")]

    plan_path = hr.write_plan(prm)
    est = estimate_s(prm)
    timeout = int(2 * est + 180)
    log(f"{prm['RECOVERY_KILLS']} kills x {len(prm['RECOVERY_SERVERS'])} servers in "
        f"{prm['RECOVERY_ROUNDS']} rounds, ~{est / 60:.0f} min in the VM (timeout "
        f"{timeout} s); results: {hr.outdir}")
    hr.run_and_finish(prm, plan_path, "recovery.py", timeout, prm["VM_MEM_MB"],
                      (REC, META, DONE), (summarize, table, None), "latest-recovery",
                      "records it got", "kills or series")


# ======================================================================================
# summary and table
# ======================================================================================

def summarize(results):
    prm, recs = results["params"], results["records"]
    out = {}
    for srv in prm["RECOVERY_SERVERS"]:
        kills = [r for r in recs if r.get("kind") == "kill" and r["server"] == srv]
        ok = [r for r in kills if not r.get("error")]
        series = [r for r in recs if r.get("kind") == "series" and r["server"] == srv]
        out[srv] = {
            "kills": len(ok), "failed_kills": len(kills) - len(ok),
            "stall_ms": stats([r["stall_ms"] for r in ok]),
            "death_ms": stats([r.get("death_ms") for r in ok]),
            "poll_ms": stats([r.get("poll_ms") for r in ok]),
            "last_recovery_ms": stats([r.get("last_recovery_ms") for r in ok]),
            "recover_cmd_ms": stats([r.get("recover_cmd_ms") for r in ok]),
            "recover_attempts": stats([r.get("recover_attempts") for r in ok]),
            # ublkd's own phases, and what is left of the stall after them: the worker's
            # death, noticing it, and the first I/O after LIVE
            **{k: stats([r.get(k) for r in ok])
               for k in ("detect_ms", "release_ms", "activate_ms", "map_ms", "prep_ms",
                         "end_ms", "rest_ms")},
            "series": len(series),
            "series_ok": sum(1 for r in series if not r.get("error")),
            "fio_ios": sum(r.get("fio_ios", 0) for r in series),
        }
    base = baseline(prm["RECOVERY_SERVERS"])
    for ours, theirs in PAIRS:
        u, k = out.get(ours), out.get(theirs)
        if u and k and u["stall_ms"] and k["stall_ms"] and k["stall_ms"]["median"]:
            r = u["stall_ms"]["median"] / k["stall_ms"]["median"]
            if ours == "ublkd" and theirs == base:
                out["ratio_ublkd_kublk"] = r
                out["target_met"] = r <= prm["RECOVERY_TARGET_RATIO"]
            elif ours != "ublkd":
                out[f"ratio_{ours}_{theirs}"] = r
    return out


def fms(v):
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def table(results):
    prm, summ = results["params"], results["summary"]
    lines = []
    head = (f"{'server':<10} {'kills':>5}  {'stall ms: min':>13} {'median':>7} {'max':>7}   "
            f"{'death ms':>8}  {'ublkd last_recovery_ms':>22}  {'kublk recover':>14}  "
            f"{'fio (exit 0, 0 errors)':<24}")
    lines.append(head)
    lines.append("-" * len(head))
    for srv in prm["RECOVERY_SERVERS"]:
        s = summ[srv]
        st = s["stall_ms"]
        fails = f" ({s['failed_kills']} failed)" if s["failed_kills"] else ""
        lr = fms(s["last_recovery_ms"]["median"]) + " (median)" if s["last_recovery_ms"] else "-"
        rc = "-"
        if s["recover_cmd_ms"]:
            rc = (f"{fms(s['recover_cmd_ms']['median'])} ms, "
                  f"{s['recover_attempts']['max']:.0f}x max")
        fio = f"{s['series_ok']}/{s['series']} series ok, {s['fio_ios']} I/Os"
        if not st:
            lines.append(f"{srv:<10} {s['kills']:>5}  no successful kill{fails}   {fio}")
            continue
        death = fms(s["death_ms"]["median"]) if s["death_ms"] else "-"
        lines.append(f"{srv:<10} {s['kills']:>5}  {fms(st['min']):>13} {fms(st['median']):>7} "
                     f"{fms(st['max']):>7}   {death:>8}  {lr:>22}  {rc:>14}  {fio}{fails}")
    for name in ("ublkd", "ublkd-zc", "ublkd-deferred"):
        u = summ.get(name)
        if not (u and u.get("release_ms") and u["stall_ms"]):
            continue
        lines.append(
            f"{name}'s stall by phase, medians in ms: death (kill -> pidfd readable) "
            f"{fms(u['death_ms']['median'])}, detect (pidfd readable -> recovery starts) "
            f"{fms(u['detect_ms']['median'])}, release (START_USER_RECOVERY's EBUSY) "
            f"{fms(u['release_ms']['median'])}, activate (Activate -> Ready) "
            f"{fms(u['activate_ms']['median'])} (of which the worker's map "
            f"{fms(u['map_ms']['median'])} and prep {fms(u['prep_ms']['median'])}), end "
            f"(END_USER_RECOVERY) {fms(u['end_ms']['median'])}; the rest (waking ublkd, the "
            f"first I/O after LIVE) {fms(u['rest_ms']['median'])}.")
    lines.append("")
    if "ratio_ublkd_kublk" in summ:
        r = summ["ratio_ublkd_kublk"]
        lines.append(f"median stall ublkd / {baseline(prm['RECOVERY_SERVERS'])} = {r:.3f}  "
                     f"(target <= {prm['RECOVERY_TARGET_RATIO']}: "
                     f"{'met' if summ['target_met'] else 'NOT met'})")
    for ours, theirs in PAIRS:
        # (ublkd's own pair is the line above: its key, ratio_ublkd_kublk, is the same)
        if ours != "ublkd" and f"ratio_{ours}_{theirs}" in summ:
            lines.append(f"median stall {ours} / {theirs} = "
                         f"{summ[f'ratio_{ours}_{theirs}']:.3f}  ({NOTES[ours]})")
    if len(lines) and lines[-1]:
        lines.append("")
    m = results["meta"]
    polls = [summ[s]["poll_ms"]["median"] for s in prm["RECOVERY_SERVERS"]
             if summ[s]["poll_ms"]]
    lines.append(
        f"{prm['RECOVERY_KILLS']} kills per server in {prm['RECOVERY_ROUNDS']} rounds, "
        f"~{prm['RECOVERY_INTERVAL_S']} s after each recovery; loop device on a "
        f"{prm['RECOVERY_LOOP_FILE_MB']} MiB tmpfs file, -q 1 -d 128; fio randrw 4k qd32 "
        f"direct io_uring, verify=crc32c verify_fatal=1; kernel {m.get('kernel', '?')}, "
        f"{m.get('cpus', '?')} vCPU ({m.get('accel', 'VM')}); ublkd "
        f"{results['versions'].get('ublkd', '?')}.")
    lines.append("stall = kill(2) -> first I/O completed (/sys/block/ublkbN/stat reads+writes) "
                 "after the killed process is gone; death = kill(2) -> its pidfd readable; "
                 "stat polled every ~"
                 + (f"{statistics.median(polls):.2f}" if polls else "?") + " ms.")
    lines.append("ublkd: kill -9 of the device's worker, ublkd recovers by itself (warm "
                 "standby); last_recovery_ms = its own death-detected -> LIVE figure.")
    lines.append("kublk-b: kublk add -t loop -b -r 1 -i 1 (kublk: the same without -b); kill -9 "
                 "of its daemon, then at once `kublk recover -n ID` with the add's arguments, "
                 "re-run until it succeeds (recover: kill -> the successful command's exit; "
                 "Nx = attempts).")
    lines += L.footer(results)
    errs = [r for r in results["records"] if r.get("error")]
    for r in errs[:10]:
        what = f"kill {r['kill']}" if r.get("kind") == "kill" else f"series {r.get('round')}"
        lines.append(f"FAILED {r['server']} {what}: {r['error'][:300]}")
    return "\n".join(lines)


def report(args):
    L.report(args, summarize, table)


# ======================================================================================
# guest: servers
# ======================================================================================

class Counter:
    """Reads + writes completed of /sys/block/DEV/stat, through one open fd."""

    def __init__(self, dev):
        self.fd = os.open(f"/sys/block/{dev}/stat", os.O_RDONLY)

    def read(self):
        v = os.pread(self.fd, 512, 0).split()
        return int(v[0]) + int(v[4])

    def close(self):
        os.close(self.fd)


def wait_pidfd(pidfd, timeout_s):
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(int(timeout_s * 1000)))


def watch_resume(ctr, t0, pidfd, prm, on_poll=None):
    """After kill(2) at t0: wait until the process is gone, then poll the counter until
    it moves. Returns (t_dead, t_io, polls); t_io None on timeout."""
    limit = prm["RECOVERY_TIMEOUT_S"]
    if not wait_pidfd(pidfd, limit):
        raise RuntimeError(f"the killed process was still there after {limit} s")
    t_dead = time.monotonic()
    base = ctr.read()
    polls = 0
    poll_s = prm["RECOVERY_POLL_S"]
    while True:
        polls += 1
        if ctr.read() != base:
            return t_dead, time.monotonic(), polls
        now = time.monotonic()
        if now - t0 > limit:
            return t_dead, None, polls
        if on_poll:
            on_poll(now)
        time.sleep(poll_s)


def kill_and_watch(pid, ctr, prm, after_kill=None, on_poll=None):
    """SIGKILLs `pid`, runs `after_kill`, and watches the device resume (watch_resume).
    Returns (t0: the kill's time, the kill's record so far: pid, death_ms, polls, and
    stall_ms and poll_ms to add once the server is checked, or None if no I/O completed
    within RECOVERY_TIMEOUT_S)."""
    pidfd = os.pidfd_open(pid)
    try:
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        if after_kill:
            after_kill()
        t_dead, t_io, polls = watch_resume(ctr, t0, pidfd, prm, on_poll)
    finally:
        os.close(pidfd)
    res = {"pid": pid, "death_ms": (t_dead - t0) * 1e3, "polls": polls}
    if t_io is None:
        return t0, res, None
    return t0, res, {"stall_ms": (t_io - t0) * 1e3, "poll_ms": (t_io - t_dead) * 1e3 / polls}


class Ublkd(L.Ublkd):
    """The throughput benchmark's ublkd, with its own config, log and loop device."""
    name = "ublkd"
    CFG = "/run/ublkd-bench-recovery.toml"
    LOG = "/run/ublkd-bench-recovery.log"
    # the kills themselves are logged as errors: count only the other lines
    EXPECTED = r"killed by signal 9\b"

    def __init__(self, plan, zero_copy=False, fast_release=True):
        super().__init__(plan, fast_release=fast_release)
        self.zero_copy = zero_copy

    def config(self):
        return (f'[daemon]\nsocket = "{self.SOCK}"\nstate_dir = "/run/ublkd-bench"\n'
                f'worker_user = "nobody"\n\n[recovery]\n'
                f'restart_max = {self.prm["RECOVERY_RESTART_MAX"]}\n'
                f'fast_release = {"true" if self.fast_release else "false"}\n')

    def add(self):
        out = self.ctl("add", "-t", "loop", "-f", self.prm["RECOVERY_LOOP_FILE"],
                       "--zero-copy" if self.zero_copy else "--copy",
                       "-q", "1", "-d", "128").strip().splitlines()
        return int(out[-1])

    def status(self, dev_id):
        st = json.loads(self.ctl("status", "--json"))
        for d in st.get("devices", []):
            if d.get("id") == dev_id:
                return d
        raise RuntimeError(f"device {dev_id} is not in ublkctl status")

    def ready(self, dev_id, old_pid=None, recoveries=None, timeout=None):
        """Wait until the device is LIVE, served by a worker other than old_pid, with a
        standby waiting (and `recoveries` moved past the given count). Returns status."""
        end = time.monotonic() + (timeout or self.prm["RECOVERY_TIMEOUT_S"])
        last = None
        while time.monotonic() < end:
            d = last = self.status(dev_id)
            if (d.get("state") == "LIVE" and d.get("worker_pid")
                    and d.get("worker_pid") != old_pid and d.get("standby_pid")
                    and (recoveries is None or d.get("recoveries", 0) > recoveries)):
                return d
            time.sleep(0.05)
        raise RuntimeError(f"device {dev_id} not recovered with a standby within the timeout; "
                           f"last status: {json.dumps(last)[:400]}")

    def kill_once(self, dev_id, ctr):
        d = self.ready(dev_id)
        pid, rec0 = int(d["worker_pid"]), d.get("recoveries", 0)
        t0, res, stall = kill_and_watch(pid, ctr, self.prm)
        if stall is None:
            res["error"] = (f"no I/O completed within {self.prm['RECOVERY_TIMEOUT_S']} s of "
                            f"the kill; status: {json.dumps(self.status(dev_id))[:400]}")
            return res
        res.update(stall)
        d = self.ready(dev_id, old_pid=pid, recoveries=rec0)
        res["ready_ms"] = (time.monotonic() - t0) * 1e3
        res["last_recovery_ms"] = d.get("last_recovery_ms")
        res["recoveries"] = d.get("recoveries")
        res["new_pid"] = d.get("worker_pid")
        res["reason"] = d.get("last_recovery_reason")
        res.update(self.phases(res["new_pid"]))
        if res["last_recovery_ms"] is not None:
            res["rest_ms"] = res["stall_ms"] - res["death_ms"] - res["last_recovery_ms"]
        return res

    PHASES = ("detect_us", "release_us", "activate_us", "map_us", "prep_us", "end_us")

    def phases(self, worker_pid):
        """Where ublkd's own recovery went (its `device recovered` log line for the worker
        that took over): release (kernel releasing the old file), activate (standby
        mapping and PREPing, map and prep as the worker reports them), end
        (END_USER_RECOVERY), and detect (from the death seen to the recovery starting),
        in ms."""
        try:
            lines = open(self.LOG, errors="replace").read().splitlines()
        except OSError:
            return {}
        for ln in reversed(lines):
            if "device recovered" in ln and f"worker_pid={worker_pid} " in ln:
                got = {}
                for k in self.PHASES:
                    m = re.search(rf"\b{k}=(\d+)", ln)
                    if m:
                        got[k[:-3] + "_ms"] = int(m.group(1)) / 1e3
                return got
        return {}


class Kublk(L.Peer):
    """kublk (-b unless `batch` is false) with USER_RECOVERY|REISSUE; recovery is
    `kublk recover` run by us."""
    NEED_PID = True

    def __init__(self, plan, auto_zc=False, batch=True):
        super().__init__(plan)
        self.auto_zc, self.batch = auto_zc, batch
        self.outf = "/run/ublkd-bench-kublk-recover.out"

    def args(self):
        return (["-t", "loop", "-q", "1", "-d", "128"] + (["-b"] if self.batch else [])
                + ["-r", "1", "-i", "1"] + (["--auto_zc"] if self.auto_zc else []))

    def add(self):
        return self._parse(sh([self.bin, "add", *self.args(),
                                 self.prm["RECOVERY_LOOP_FILE"]]))

    def ready(self, dev_id):
        out = sh([self.bin, "list", "-n", str(dev_id)])
        if "state LIVE" not in out:
            raise RuntimeError(f"kublk device {dev_id} is not LIVE: {out.strip()[:300]}")
        self._parse(out)

    def recover_cmd(self, dev_id):
        return [self.bin, "recover", *self.args(), "-n", str(dev_id),
                self.prm["RECOVERY_LOOP_FILE"]]

    def kill_once(self, dev_id, ctr):
        pid = self.daemon[dev_id]
        holders = L.fd_holders(f"/dev/ublkc{dev_id}")
        if holders != {pid}:
            raise RuntimeError(f"/dev/ublkc{dev_id} is held by {sorted(holders)}, "
                               f"kublk's daemon pid is {pid}")
        cmd = self.recover_cmd(dev_id)
        state = {"proc": None, "attempts": 0, "t_ok": None, "last_err": "", "t_start": 0}

        def launch():
            state["attempts"] += 1
            state["out"] = open(self.outf, "w")
            state["proc"] = subprocess.Popen(cmd, stdout=state["out"],
                                             stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)

        def check(now):
            """Between polls: re-run a recover that failed (e.g. -EBUSY, the old
            daemon's file not yet released), as `until kublk recover ...` would."""
            p = state["proc"]
            if state["t_ok"] is not None or p.poll() is None:
                return
            state["out"].close()
            if p.returncode == 0:
                state["t_ok"] = now
                return
            state["last_err"] = L.tail(self.outf, 3)
            if state["attempts"] >= self.prm["RECOVERY_KUBLK_MAX_ATTEMPTS"]:
                return
            time.sleep(0.01)
            launch()

        t0, res, stall = kill_and_watch(pid, ctr, self.prm, after_kill=launch, on_poll=check)
        # the recover command's exit (LIVE) may come after the first I/O
        end = t0 + self.prm["RECOVERY_TIMEOUT_S"]
        while state["t_ok"] is None and time.monotonic() < end:
            p = state["proc"]
            if p.poll() is None:
                time.sleep(0.005)
                continue
            if p.returncode != 0 and state["attempts"] >= self.prm["RECOVERY_KUBLK_MAX_ATTEMPTS"]:
                state["out"].close()
                state["last_err"] = L.tail(self.outf, 3)
                break
            check(time.monotonic())
        res["recover_attempts"] = state["attempts"]
        if state["t_ok"] is None:
            if state["proc"].poll() is None:
                state["proc"].kill()
                state["proc"].wait()
            res["error"] = (f"`{' '.join(cmd)}` did not succeed in {state['attempts']} "
                            f"attempts; last output: {state['last_err']}")
            return res
        res["recover_cmd_ms"] = (state["t_ok"] - t0) * 1e3
        with open(self.outf) as f:
            out = f.read()
        try:
            self._parse(out)
        except RuntimeError:
            self.ready(dev_id)
        res["new_pid"] = self.daemon[dev_id]
        if stall is None:
            res["error"] = (f"no I/O completed within {self.prm['RECOVERY_TIMEOUT_S']} s of "
                            f"the kill (recover succeeded after {res['recover_cmd_ms']:.0f} ms)")
            return res
        res.update(stall)
        return res


# ======================================================================================
# guest: the series
# ======================================================================================

FIO_STOP = "/tmp/ublkd-bench-fio-stop"


def fio_cmd(dev, prm, runtime):
    # Stopped by creating FIO_STOP (--trigger-file): fio then ends its jobs and exits 0
    # (SIGINT would make it exit 128). --runtime is only a safety cap.
    return ["fio", "--name=recovery", f"--filename=/dev/{dev}", "--rw=randrw", "--bs=4k",
            "--ioengine=io_uring", "--direct=1", "--iodepth=32", "--verify=crc32c",
            "--verify_fatal=1", f"--verify_backlog={prm['RECOVERY_VERIFY_BACKLOG']}",
            "--verify_state_save=0", "--time_based", f"--runtime={runtime}",
            f"--trigger-file={FIO_STOP}", "--output-format=json"]


def fio_check(rc, out, err):
    """fio's result: raises unless it exited 0 with no error; returns its I/O counts."""
    tail = " | ".join((err or "").strip().splitlines()[-4:])
    if rc != 0:
        raise RuntimeError(f"fio exited {rc}: {tail}")
    try:
        jb = L.fio_job(out)
    except ValueError:
        raise RuntimeError(f"fio printed no json: {tail} {out[:200]}")
    if jb.get("error"):
        raise RuntimeError(f"fio job error {jb['error']}: {tail}")
    bad = [ln for ln in (err or "").splitlines()
           if re.search(r"verify|io_u error|error=", ln, re.I)]
    if bad:
        raise RuntimeError(f"fio reported: {' | '.join(bad[:4])}")
    r, w = jb["read"]["total_ios"], jb["write"]["total_ios"]
    if not r or not w:
        raise RuntimeError(f"fio did {r} reads and {w} writes")
    return {"fio_reads": r, "fio_writes": w, "fio_ios": r + w,
            "fio_runtime_ms": jb.get("job_runtime")}


def run_series(sname, plan, rnd, nkills, first_kill, total):
    prm = plan["params"]
    zc = sname.endswith("-zc")
    srv = (Ublkd(plan, zc, fast_release=sname != "ublkd-deferred") if sname.startswith("ublkd")
           else Kublk(plan, zc, batch=sname.startswith("kublk-b")))
    tag = f"round {rnd}/{prm['RECOVERY_ROUNDS']} {sname:<8}"
    series = {"kind": "series", "server": sname, "round": rnd}
    dev_id = fio = ctr = None
    ok = 0
    try:
        srv.start()
        dev_id = srv.add()
        dev = L.wait_dev(dev_id)
        srv.ready(dev_id)
        ctr = Counter(dev)
        runtime = int(nkills * (prm["RECOVERY_INTERVAL_S"] + 30) + 120)
        c_start = ctr.read()
        if os.path.exists(FIO_STOP):
            os.unlink(FIO_STOP)
        fio = subprocess.Popen(fio_cmd(dev, prm, runtime), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd="/tmp")
        end = time.monotonic() + 120
        while ctr.read() == c_start:
            if fio.poll() is not None or time.monotonic() > end:
                raise RuntimeError("fio did no I/O on the device")
            time.sleep(0.02)
        time.sleep(prm["RECOVERY_FIO_SETTLE_S"])
        log(f"{tag} /dev/{dev}: fio verifying, {nkills} kills")
        for i in range(nkills):
            k = first_kill + i
            rec = {"kind": "kill", "server": sname, "round": rnd, "kill": k + 1}
            if fio.poll() is not None:
                raise RuntimeError(f"fio ended before kill {k + 1} (exit {fio.returncode})")
            try:
                rec.update(srv.kill_once(dev_id, ctr))
            except Exception as e:
                rec["error"] = str(e)
            emit(REC, rec)
            if rec.get("error"):
                log(f"{sname:<8} kill {k + 1}/{total}: FAILED: {rec['error'][:300]}")
                raise RuntimeError(f"kill {k + 1} failed; the series stops")
            ok += 1
            extra = (f"ublkd last_recovery {rec['last_recovery_ms']} ms"
                     if sname.startswith("ublkd") else
                     f"recover ok after {rec['recover_cmd_ms']:.0f} ms, "
                     f"{rec['recover_attempts']} attempt(s)")
            log(f"{sname:<8} kill {k + 1}/{total}: pid {rec['pid']} -> {rec['new_pid']}, "
                f"stall {rec['stall_ms']:.0f} ms (dead after {rec['death_ms']:.0f} ms), "
                f"{extra}")
            time.sleep(prm["RECOVERY_INTERVAL_S"])
        time.sleep(prm["RECOVERY_FIO_SETTLE_S"])
        if fio.poll() is not None:
            raise RuntimeError(f"fio ended early (exit {fio.returncode})")
        open(FIO_STOP, "w").close()
        out, err = fio.communicate(timeout=120)
        series.update(fio_check(fio.returncode, out, err))
        log(f"{tag} fio: exit 0, no errors, {series['fio_reads']} reads + "
            f"{series['fio_writes']} writes verified with crc32c")
    except Exception as e:
        series["error"] = str(e)
        log(f"{tag} FAILED: {e}")
        if fio and fio.poll() is None:
            fio.kill()
            fio.wait()
    series["kills_ok"] = ok
    if ctr:
        ctr.close()
    if dev_id is not None:
        try:
            srv.delete(dev_id)
        except Exception as e:
            log(f"{tag} delete failed: {e}")
    try:
        srv.stop()
    except Exception as e:
        log(f"{tag} stop failed: {e}")
    probs = srv.log_problems()
    if probs:
        series["server_log_problems"] = probs[0]
        log(f"{tag} ublkd logged {probs[0]} warnings/errors (besides the kills) so far; "
            f"the last: {probs[1]}")
    emit(REC, series)
    return ok


def guest(args):
    plan = L.read_plan(args.plan)
    prm = plan["params"]
    t_start = time.monotonic()
    emit(META, L.guest_meta())
    L.check_kernel(prm)
    log(f"creating the loop file {prm['RECOVERY_LOOP_FILE']} "
        f"({prm['RECOVERY_LOOP_FILE_MB']} MiB, tmpfs)")
    L.zero_file(prm["RECOVERY_LOOP_FILE"], prm["RECOVERY_LOOP_FILE_MB"])
    servers, rounds, total = prm["RECOVERY_SERVERS"], prm["RECOVERY_ROUNDS"], prm["RECOVERY_KILLS"]
    done = {s: 0 for s in servers}
    for rnd in range(rounds):
        for sname in L.rotated(servers, rnd):
            n = total * (rnd + 1) // rounds - total * rnd // rounds
            run_series(sname, plan, rnd + 1, n, done[sname], total)
            done[sname] += n
    log(f"done in {time.monotonic() - t_start:.0f} s in the VM")
    print(DONE, flush=True)


# ======================================================================================

def host_args(h):
    h.add_argument("--kills", type=int, help="override RECOVERY_KILLS (per server)")
    h.add_argument("--rounds", type=int, help="override RECOVERY_ROUNDS")
    h.add_argument("--interval", type=float, help="override RECOVERY_INTERVAL_S")
    h.add_argument("--servers", help="comma-separated subset of " + ",".join(SERVERS))
    h.add_argument("--out", help="results parent dir (default bench/results)")
    h.add_argument("--rebuild-peers", action="store_true", help="rebuild kublk even if cached")
    L.add_kernel_arg(h)


if __name__ == "__main__":
    L.main("bench/run recovery", __doc__, host_args,
           {"host": host, "guest": guest, "report": report},
           guest_help="(inside the VM) run the series of a plan",
           report_help="re-print the table of a results dir")
