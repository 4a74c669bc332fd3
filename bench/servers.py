"""The servers as the guest halves drive them: the one way a server process of ours
starts and stops (Daemon), ublkd with its own config (Ublkd; recovery.py, scale.py and
the NBD benchmark derive theirs from it), the peers driven by their command lines
(kublk and rublk as bench.py adds their devices), and nbdkit, the NBD benchmark's
server. Python 3 standard library only.
"""

import json
import os
import re
import signal
import subprocess
import time

from benchlib import fd_holders, log, sh, tail, wait_dev, wait_gone


class Daemon:
    """A server process of ours, its output appended to a log under /run: spawn() starts
    it and waits until it is ready, stop() ends it."""
    NAME = None
    # whether a daemon that SIGTERM did not stop (SIGKILLed instead) is an error
    MUST_STOP = True
    proc = None

    def spawn(self, cmd, logpath, ready, what, timeout, poll_s):
        """Starts `cmd` and returns once `ready()` is true; raises if the process exits
        first (with its log's last lines) or `what` is not there within `timeout` s."""
        with open(logpath, "a") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=logf,
                                         stdin=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.NAME} exited {self.proc.returncode} at start: "
                                   + tail(logpath))
            if time.monotonic() > end:
                raise RuntimeError(f"{what} did not appear within {timeout} s")
            time.sleep(poll_s)

    def stop(self):
        """SIGTERM, and SIGKILL if it is still there 20 s later."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                if self.MUST_STOP:
                    raise RuntimeError(f"{self.NAME} did not stop within 20 s of SIGTERM")
        self.proc = None


def stop(srv, what):
    """Stops a server (Daemon or Peer) at the end of its turn: a failure is logged,
    `what` first, and the run goes on."""
    try:
        srv.stop()
    except Exception as e:
        log(f"{what} stop failed: {e}")


class Ublkd(Daemon):
    """ublkd started with its own config (socket, state dir, log under /run), devices
    added and deleted with ublkctl."""
    NAME = "ublkd"
    SOCK = "/run/ublkd-bench.sock"
    CFG = "/run/ublkd-bench.toml"
    LOG = "/run/ublkd-bench.log"
    STATE_DIR = "/run/ublkd-bench"
    # log lines that are expected (a regex), not counted by log_problems
    EXPECTED = None

    def __init__(self, plan, copy=False, sandbox=True, fast_release=True, build="ublkd"):
        self.bindir = plan["paths"][build]
        self.prm = plan["params"]
        self.copy, self.sandbox, self.fast_release = copy, sandbox, fast_release
        self.proc = None

    def ctl(self, *a):
        return sh([os.path.join(self.bindir, "ublkctl"), "--socket", self.SOCK, *a])

    def config(self):
        text = f'[daemon]\nsocket = "{self.SOCK}"\nstate_dir = "{self.STATE_DIR}"\n'
        if not self.fast_release:
            text += "[recovery]\nfast_release = false\n"
        return text

    def start(self):
        with open(self.CFG, "w") as f:
            f.write(self.config())
        self.spawn([os.path.join(self.bindir, "ublkd"), "--config", self.CFG], self.LOG,
                   lambda: os.path.exists(self.SOCK), "ublkd's socket", 20, 0.05)

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

    @classmethod
    def log_problems(cls):
        """(how many, the last) of the WARN and ERROR lines in ublkd's log, but the
        EXPECTED ones; None if there are none."""
        if not os.path.exists(cls.LOG):
            return None
        errs = [ln for ln in open(cls.LOG, errors="replace")
                if re.search(r"\b(ERROR|WARN)\b", ln)
                and not (cls.EXPECTED and re.search(cls.EXPECTED, ln))]
        return (len(errs), errs[-1].strip()[:300]) if errs else None


class UblkdDevice(Ublkd):
    """ublkd serving one device at a time, as the NBD and RBD benchmarks attach their
    clients: add_device() adds it with ublkctl's `add` arguments and waits for
    /dev/ublkbN, detach() deletes it and waits until its workers are gone."""

    def __init__(self, plan):
        super().__init__(plan)
        self.dev_id = self.dev = None

    def add_device(self, *add_args):
        if not self.proc:
            self.start()
        out = self.ctl("add", *add_args).strip().splitlines()
        self.dev_id = int(out[-1].removeprefix("/dev/ublkb"))
        self.dev = wait_dev(self.dev_id)
        return self.dev

    def pids(self):
        return Ublkd.pids(self, self.dev_id)

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
            if not wait_gone(gone):
                log(f"ublkd's worker(s) {sorted(gone)} outlived the device by 10 s")

    def problems_note(self):
        """A line for a record: how many WARN/ERROR lines ublkd logged, and the last."""
        probs = self.log_problems()
        return (f"{probs[0]} WARN/ERROR lines in ublkd's log, the last: {probs[1]}"
                if probs else None)


class Peer:
    """A peer server driven by its command line, kublk or rublk (whose `add` prints the
    same "dev id N:" and "daemon pid P" lines): there is nothing to start or stop, its
    daemon lives as long as its device."""
    NEED_PID = False  # whether _parse refuses output without the daemon's pid

    def __init__(self, plan, peer="kublk"):
        self.bin = plan["paths"][peer]
        self.prm = plan["params"]
        self.daemon = {}

    def start(self):
        pass

    def stop(self):
        pass

    def _parse(self, out):
        """The device id in `add` (or `list`, `recover`) output; keeps its daemon pid."""
        m = re.search(r"dev id (\d+):", out)
        p = re.search(r"daemon pid (\d+)", out)
        if self.NEED_PID and not (m and p):
            raise RuntimeError(f"no 'dev id N:' / 'daemon pid P' in: {out.strip()[:300]}")
        if not m:
            raise RuntimeError(f"no 'dev id N:' in the add output: {out.strip()[:300]}")
        dev_id = int(m.group(1))
        if p:
            self.daemon[dev_id] = int(p.group(1))
        return dev_id

    def pids(self, dev_id):
        p = fd_holders(f"/dev/ublkc{dev_id}")
        if dev_id in self.daemon:
            p.add(self.daemon[dev_id])
        return p

    def delete(self, dev_id):
        sh([self.bin, "del", "-n", str(dev_id)])

    def log_problems(self):
        return None


class Kublk(Peer):
    """kublk as bench.py adds its devices: -b with `batch`, --auto_zc with `auto_zc`."""

    def __init__(self, plan, batch, auto_zc=False):
        super().__init__(plan)
        self.batch, self.auto_zc = batch, auto_zc

    def add(self, target):
        a = [self.bin, "add", "-t", target, "-q", str(self.prm["QUEUES"]),
             "-d", str(self.prm["QUEUE_DEPTH"])] + (["-b"] if self.batch else [])
        if self.auto_zc:
            a.append("--auto_zc")
        if target == "loop":
            a.append(self.prm["LOOP_FILE"])
        return self._parse(sh(a))


class Rublk(Peer):
    """rublk as bench.py adds its devices."""

    def __init__(self, plan):
        super().__init__(plan, "rublk")

    def add(self, target):
        a = [self.bin, "add", target, "-q", str(self.prm["QUEUES"]),
             "-d", str(self.prm["QUEUE_DEPTH"])]
        if target == "loop":
            a += ["-f", self.prm["LOOP_FILE"]]
        return self._parse(sh(a))


class Nbdkit(Daemon):
    """nbdkit -f --exit-with-parent -P PIDFILE -U SOCKET PLUGIN ARGS, its log in /run."""
    NAME = "nbdkit"
    MUST_STOP = False

    def __init__(self, sock, plugin_args, tag):
        self.sock, self.args = sock, plugin_args
        self.pidfile = f"/run/ublkd-bench-nbdkit-{tag}.pid"
        self.logpath = f"/run/ublkd-bench-nbdkit-{tag}.log"
        self.pid = None

    def start(self):
        for p in (self.sock, self.pidfile):
            if os.path.exists(p):
                os.unlink(p)
        self.spawn(["nbdkit", "-f", "--exit-with-parent", "-P", self.pidfile, "-U", self.sock,
                    *self.args], self.logpath, self._ready, "nbdkit's pid file", 30, 0.02)
        return self.pid

    def _ready(self):
        """Whether nbdkit wrote its pid file and listens (its pid kept)."""
        try:
            with open(self.pidfile) as f:
                txt = f.read().strip()
            if txt and os.path.exists(self.sock):
                self.pid = int(txt)
                return True
        except (OSError, ValueError):
            pass
        return False

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
