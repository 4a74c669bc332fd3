"""The guest half of the RBD benchmark (rbd.py): the single-node Ceph cluster it runs
against, the three clients of one image (ublkd's rbd target, rbd-nbd, krbd), and the
two phases, throughput and faults, each emitting its records.
Python 3 standard library only (the cluster's own requests go through
tests/vm/ceph-agent.py, run by /usr/bin/python3, whose rados and rbd modules come with
ceph-common).
"""

import json
import os
import signal
import subprocess
import time

import benchlib as L
import servers as S
from benchlib import log, emit, sh, fms
from nbdclient import load_nbd
from nbdphases import FaultShape, kernel_log_tail, measure_run, verify_under_fault

REC, META, DONE = L.markers("RBD")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL = "rbd"
CLIENT_ID = "rbdtest"
# the kernel messages a fault record keeps: nbd's, ublk's, krbd's and libceph's
DRIVERS = r"\bnbd\d|ublk|\brbd\d*:|libceph"


# ======================================================================================
# the cluster
# ======================================================================================

class Cluster:
    """tests/vm/ceph-single-node.sh's cluster (1 mon, 1 bluestore OSD, cephx) in
    RBD_CEPH_DIR, and one ceph-agent.py process for its requests."""

    def __init__(self, prm):
        self.dir = prm["RBD_CEPH_DIR"]
        self.conf = os.path.join(self.dir, "ceph.conf")
        self.keyring = os.path.join(self.dir, f"client.{CLIENT_ID}.keyring")
        self.osd_size = prm["RBD_OSD_SIZE"]
        self.agent = None

    def start(self):
        sh(["ip", "link", "set", "lo", "up"])
        env = {**os.environ, "CEPH_DIR": self.dir, "CEPH_OSD_SIZE": self.osd_size,
               "CEPH_STORE": "bluestore"}
        env.pop("CEPH_CONF", None)
        t = time.monotonic()
        p = subprocess.run(["bash", os.path.join(REPO, "tests/vm/ceph-single-node.sh"),
                            "start"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError("ceph-single-node.sh start failed: "
                               + " | ".join(p.stdout.strip().splitlines()[-6:]))
        # the clients' CLIs (rbd, rbd-nbd) find the cluster through CEPH_CONF
        os.environ["CEPH_CONF"] = self.conf
        self.agent = subprocess.Popen(
            ["/usr/bin/python3", os.path.join(REPO, "tests/vm/ceph-agent.py"), self.conf, POOL],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(os.path.join(self.dir, "log/agent.stderr"), "w"), text=True)
        self._answer()
        return time.monotonic() - t

    def _answer(self):
        line = self.agent.stdout.readline()
        if not line:
            raise RuntimeError("ceph-agent.py exited: "
                               + L.tail(os.path.join(self.dir, "log/agent.stderr")))
        a = json.loads(line)
        if "err" in a:
            raise RuntimeError(a["err"])
        return a["ok"]

    def call(self, op, **kw):
        self.agent.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.agent.stdin.flush()
        return self._answer()

    def create_image(self, name, mb):
        self.call("create_image", name=name, size=mb << 20)

    def remove_image(self, name):
        """Removes `name`; a dead client's watch (up to 30 s) makes that fail: logged."""
        try:
            self.call("remove_image", name=name)
        except RuntimeError as e:
            log(f"rbd image {name} left behind: {str(e)[:200]}")

    def fill(self, name, mb):
        """Writes the whole image once (4 MiB sequential writes), so that no read hits
        an object that does not exist and no write creates one."""
        sh(["rbd", "--id", "admin", "bench", "--io-type", "write", "--io-size", "4M",
            "--io-threads", "4", "--io-total", f"{mb}M", "--io-pattern", "seq",
            f"{POOL}/{name}"], timeout=600)

    def daemon_pid(self, name):
        with open(os.path.join(self.dir, "run", f"{name}.pid")) as f:
            return int(f.read().strip())

    def osd_pid(self):
        return self.daemon_pid("osd.0")

    def restart_osd(self):
        """kill -9 of osd.0, marked down at once (a lone OSD's death has nobody to
        report it), started again; returns the seconds until it is up in a new
        incarnation and a write to the pool has succeeded (as the tests' harness)."""
        before = self.call("osd")["up_from"]
        t = time.monotonic()
        pid = self.osd_pid()
        os.kill(pid, signal.SIGKILL)
        if not L.wait_gone([pid], 30):
            raise RuntimeError(f"osd.0 (pid {pid}) outlived SIGKILL by 30 s")
        self.call("mon", cmd={"prefix": "osd down", "ids": ["0"]})
        with open(os.path.join(self.dir, "log/osd.0.stderr"), "a") as err:
            subprocess.run(["ceph-osd", "-i", "0"], env={**os.environ, "CEPH_CONF": self.conf},
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                           check=True, timeout=120)
        end = time.monotonic() + 180
        while True:
            o = self.call("osd")
            if o["up"] == 1 and o["up_from"] > before:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"osd.0 not up again within 180 s: {o}")
            time.sleep(0.2)
        self.call("write_check")
        return time.monotonic() - t

    def stop(self):
        if self.agent:
            self.agent.stdin.close()
            try:
                self.agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.agent.kill()
        subprocess.run(["bash", os.path.join(REPO, "tests/vm/ceph-single-node.sh"), "stop"],
                       env={**os.environ, "CEPH_DIR": self.dir}, timeout=120)


# ======================================================================================
# the clients: attach(image) -> block device name, pids(), kill() (the client's
# process, where it has one), detach()
# ======================================================================================

class UblkdRbd(S.UblkdDevice):
    """ublkd with `ublkctl add -t rbd --image rbd/IMAGE --ceph-conf --ceph-id --keyring`."""
    name = "ublkd"
    SOCK = "/run/ublkd-bench-rbd.sock"
    CFG = "/run/ublkd-bench-rbd.toml"
    LOG = "/run/ublkd-bench-rbd.log"

    def __init__(self, plan, cluster):
        super().__init__(plan)
        self.cluster = cluster

    def attach(self, image):
        return self.add_device("-t", "rbd", "--image", f"{POOL}/{image}",
                               "--ceph-conf", self.cluster.conf, "--ceph-id", CLIENT_ID,
                               "--keyring", self.cluster.keyring,
                               "-q", str(self.prm["RBD_QUEUES"]),
                               "-d", str(self.prm["RBD_QUEUE_DEPTH"]))

    def kill(self):
        """SIGKILLs the device's worker; ublkd hands the device to its standby."""
        st = self.status()
        if not st or not st.get("worker_pid"):
            raise RuntimeError(f"ublkd's device {self.dev_id} has no worker")
        pid = int(st["worker_pid"])
        os.kill(pid, signal.SIGKILL)
        return f"ublkd's worker (pid {pid}) SIGKILLed"


class RbdNbd:
    """rbd-nbd: librbd in a daemon of its own behind the kernel's NBD client
    (`rbd-nbd --id rbdtest map rbd/IMAGE`, which forks the daemon and exits); with
    `options`, Ceph options on its command line (rbd-nbd-nocache: `--rbd_cache=false`,
    as ublkd's workers run librbd)."""

    def __init__(self, name, options=()):
        self.name, self.options = name, list(options)
        self.dev = self.pid = None

    def attach(self, image):
        out = sh(["rbd-nbd", "--id", CLIENT_ID, *self.options, "map", f"{POOL}/{image}"],
                 timeout=120)
        dev = out.strip().splitlines()[-1]
        if not dev.startswith("/dev/nbd"):
            raise RuntimeError(f"rbd-nbd map printed no /dev/nbdN: {out.strip()[:200]}")
        self.dev = dev[len("/dev/"):]
        self.pid = self._daemon(image)
        return self.dev

    @staticmethod
    def _daemon(image):
        """The pid of the rbd-nbd daemon that serves `image`."""
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if (argv and os.path.basename(argv[0]) == b"rbd-nbd"
                    and f"{POOL}/{image}".encode() in argv):
                return int(d)
        raise RuntimeError(f"no rbd-nbd process serves {POOL}/{image}")

    def pids(self):
        return {self.pid} if self.pid and L.alive(self.pid) else set()

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        return f"rbd-nbd (pid {self.pid}) SIGKILLed"

    def detach(self):
        if not self.dev:
            return
        dev, self.dev = self.dev, None
        try:
            sh(["rbd-nbd", "unmap", f"/dev/{dev}"], timeout=60)
        except Exception:
            # rbd-nbd is gone (killed): the kernel's NBD client still holds the device
            sh(["nbd-client", "-d", f"/dev/{dev}"], timeout=60)
        if self.pid and not L.wait_gone([self.pid], 30):
            log(f"rbd-nbd (pid {self.pid}) outlived its unmap by 30 s")


class Krbd:
    """krbd, the kernel's own RBD client (`rbd map -o noudev`: the VM has no udevd)."""
    name = "krbd"

    def __init__(self):
        self.dev = None

    def attach(self, image):
        out = sh(["rbd", "--id", CLIENT_ID, "map", "-o", "noudev", f"{POOL}/{image}"],
                 timeout=120)
        dev = out.strip().splitlines()[-1]
        if not dev.startswith("/dev/rbd"):
            raise RuntimeError(f"rbd map printed no /dev/rbdN: {out.strip()[:200]}")
        self.dev = dev[len("/dev/"):]
        return self.dev

    def pids(self):
        return set()

    def kill(self):
        raise RuntimeError("krbd has no process to kill")

    def detach(self):
        if self.dev:
            dev, self.dev = self.dev, None
            sh(["rbd", "unmap", "-o", "noudev", f"/dev/{dev}"], timeout=120)


def make_client(name, ublkd):
    if name == "ublkd":
        return ublkd
    if name == "rbd-nbd":
        return RbdNbd(name)
    if name == "rbd-nbd-nocache":
        return RbdNbd(name, ["--rbd_cache=false"])
    return Krbd()


# ======================================================================================
# guest: the throughput phase
# ======================================================================================

def throughput(plan, cluster, ublkd, meta):
    """Each round, each client in turn (the order rotated per round) maps the one
    filled image, runs every job and unmaps it: the image's exclusive lock is one
    client's at a time."""
    prm = plan["params"]
    jobs, nrounds = prm["RBD_JOBS"], prm["RBD_ROUNDS"]
    clients = [c for c in prm["RBD_CLIENTS"] if c not in meta["skipped"]]
    mprm = {"RUNTIME_S": prm["RBD_RUNTIME_S"], "RAMP_S": prm["RBD_RAMP_S"]}
    image = prm["RBD_IMAGE"]
    t = time.monotonic()
    cluster.create_image(image, prm["RBD_IMAGE_MB"])
    cluster.fill(image, prm["RBD_IMAGE_MB"])
    log(f"image {POOL}/{image}: {prm['RBD_IMAGE_MB']} MiB, created and filled in "
        f"{time.monotonic() - t:.1f} s")
    osd = _OsdPids(cluster)
    total, count = nrounds * len(clients) * len(jobs), 0
    for rnd in range(nrounds):
        for cname in L.rotated(clients, rnd):
            cl = make_client(cname, ublkd)
            base = {"round": rnd + 1, "client": cname}
            try:
                t = time.monotonic()
                dev = cl.attach(image)
                with open(f"/sys/block/{dev}/size") as f:
                    dsize = int(f.read()) * 512
                emit(REC, {**base, "kind": "attach", "dev": dev, "size": dsize,
                           "attach_s": round(time.monotonic() - t, 2)})
                log(f"round {rnd + 1}/{nrounds} {cname}: /dev/{dev}, {dsize >> 20} MiB, "
                    f"attached in {time.monotonic() - t:.1f} s")
            except Exception as e:
                log(f"round {rnd + 1}/{nrounds} {cname}: attach failed: {e}")
                count += L.fail_jobs(REC, {**base, "kind": "run"}, jobs, f"attach: {e}")
                continue
            for job, spec in jobs.items():
                count += 1
                rec = {**base, "kind": "run", "job": job}
                log(f"round {rnd + 1}/{nrounds}  [{count}/{total}]  {cname:<8} {job}")
                try:
                    # measure_run's "nbdkit" is the server: here the OSD
                    res = measure_run(cl, cname, dev, job, spec, osd, mprm)
                    res["osd_us_per_io"] = res.pop("nbdkit_us_per_io", None)
                    res["osd_cpu_s"] = res.pop("nbdkit_cpu_s", None)
                    rec.update(res)
                except Exception as e:
                    rec["error"] = str(e)
                    log(f"    FAILED: {e}")
                emit(REC, rec)
            try:
                cl.detach()
            except Exception as e:
                log(f"round {rnd + 1}/{nrounds} {cname}: detach failed: {e}")
    cluster.remove_image(image)


class _OsdPids:
    """What measure_run asks of its server: the OSD's pid (it may change: restarts)."""

    def __init__(self, cluster):
        self.cluster = cluster

    @property
    def pid(self):
        return self.cluster.osd_pid()


# ======================================================================================
# guest: the fault phase
# ======================================================================================

def fault_one(plan, cluster, ublkd, cname, fault, rnd):
    """A verifying fio on a fresh image through `cname`, and `fault` in its midst:
    "osd-restart" (osd.0 SIGKILLed, marked down, started again) or "client-kill"
    (the client's process SIGKILLed: ublkd's worker, the rbd-nbd daemon)."""
    prm = plan["params"]
    rec = {"kind": "fault", "client": cname, "fault": fault, "round": rnd}
    image = f"{prm['RBD_IMAGE']}-{fault}-{cname}-{rnd}"
    shape = FaultShape(prm["RBD_FAULT_IODEPTH"], prm["RBD_FAULT_VERIFY_BACKLOG"],
                       prm["RBD_FAULT_RUNTIME_S"], prm["RBD_FAULT_AFTER_S"],
                       prm["RBD_FAULT_HANG_S"])
    what = f"{fault} {cname}"
    cl = make_client(cname, ublkd)
    _, klines = kernel_log_tail(0, DRIVERS)

    def inject():
        if fault == "osd-restart":
            rec["osd_restart_s"] = round(cluster.restart_osd(), 2)
            log(f"{what}: osd.0 SIGKILLed and up again in {rec['osd_restart_s']} s")
        else:
            log(f"{what}: {cl.kill()}")

    try:
        cluster.create_image(image, prm["RBD_FAULT_IMAGE_MB"])
        rec["dev"] = cl.attach(image)
        verify_under_fault(rec["dev"], shape, inject, cl.detach, rec, what)
    except Exception as e:
        rec["error"] = str(e)[:500]
    rec["kernel_log"], _ = kernel_log_tail(klines, DRIVERS)
    if cname == "ublkd" and ublkd.problems_note():
        rec["client_log"] = ublkd.problems_note()
    try:
        cl.detach()
    except Exception as e:
        rec["detach_error"] = str(e)[:300]
    cluster.remove_image(image)
    log(f"{what}: fio exit {rec.get('fio_rc')}, {rec.get('fio_errors')} errors (first: "
        f"{rec.get('first_error', '-')}), clat max {fms(rec.get('clat_max_ms'))} ms, longest "
        f"stall {fms(rec.get('stall_ms'))} ms, {rec.get('fio_ios')} I/Os; device after: "
        f"{rec.get('device_after')}" + (f"; {rec['error']}" if rec.get("error") else ""))
    emit(REC, rec)


def guest_phases(plan, meta):
    """Starts the cluster and ublkd, runs both phases, stops both."""
    prm = plan["params"]
    how, why = load_nbd()
    meta["nbd_module"] = how or f"unavailable: {why}"
    if not how:
        meta["skipped"]["rbd-nbd"] = why
    try:
        sh(["modprobe", "rbd"])
        meta["rbd_module"] = "modprobe rbd"
    except Exception as e:
        meta["skipped"]["krbd"] = f"modprobe rbd failed: {e}"
    cluster = Cluster(prm)
    meta["cluster_start_s"] = round(cluster.start(), 1)
    meta["ceph"] = sh(["ceph-osd", "--version"]).strip()
    emit(META, meta)
    log(f"cluster ready in {meta['cluster_start_s']} s ({meta['ceph']}); nbd.ko: "
        f"{meta['nbd_module']}; krbd: {meta.get('rbd_module', 'no')}")
    ublkd = UblkdRbd(plan, cluster)
    try:
        if prm["RBD_ROUNDS"]:
            try:
                throughput(plan, cluster, ublkd, meta)
            except Exception as e:
                emit(REC, {"kind": "phase", "client": "-", "error": f"throughput phase: {e}"})
                log(f"throughput phase FAILED: {e}")
        for rnd in range(prm["RBD_FAULT_ROUNDS"]):
            for fault, clients in prm["RBD_FAULTS"].items():
                for cname in L.rotated(clients, rnd):
                    if cname not in meta["skipped"]:
                        fault_one(plan, cluster, ublkd, cname, fault, rnd + 1)
    finally:
        S.stop(ublkd, "ublkd")
        cluster.stop()
