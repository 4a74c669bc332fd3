"""A recovery stall, as recovery.py and scale.py measure it: SIGKILL a server's process
and watch its device until I/O completes again (kill_and_watch); and the servers as
recovery.py kills them, ublkd (which recovers by itself) and kublk (`kublk recover`
run at once), each with kill_once(). Python 3 standard library only.
"""

import json
import os
import re
import select
import signal
import subprocess
import time

import benchlib as L
import servers as S
from benchlib import sh


# ======================================================================================
# the kill, and the device watched until its I/O resumes
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


# ======================================================================================
# the servers as recovery.py kills them
# ======================================================================================

class Ublkd(S.Ublkd):
    """servers.Ublkd with its own config, log and loop device, and what a kill asks of it."""
    name = "ublkd"
    CFG = "/run/ublkd-bench-recovery.toml"
    LOG = "/run/ublkd-bench-recovery.log"
    # the kills themselves are logged as errors: count only the other lines
    EXPECTED = r"killed by signal 9\b"

    def __init__(self, plan, zero_copy=False, fast_release=True, sandbox=True):
        super().__init__(plan, fast_release=fast_release, sandbox=sandbox)
        self.zero_copy = zero_copy

    def config(self):
        return (f'[daemon]\nsocket = "{self.SOCK}"\nstate_dir = "/run/ublkd-bench"\n'
                f'worker_user = "nobody"\n\n[recovery]\n'
                f'restart_max = {self.prm["RECOVERY_RESTART_MAX"]}\n'
                f'fast_release = {"true" if self.fast_release else "false"}\n')

    def add(self):
        out = self.ctl("add", "-t", "loop", "-f", self.prm["RECOVERY_LOOP_FILE"],
                       "--zero-copy" if self.zero_copy else "--copy",
                       "-q", "1", "-d", "128",
                       *([] if self.sandbox else ["--no-sandbox"])).strip().splitlines()
        return int(out[-1].removeprefix("/dev/ublkb"))

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


class Kublk(S.Peer):
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
