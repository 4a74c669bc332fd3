"""The guest half of the NBD benchmark (nbd.py): its two phases, throughput (one nbdkit,
every client attached for a round, fio runs measured as bench.py's) and restart (nbdkit
SIGKILLed and started again under a verifying fio), each emitting its records.
Python 3 standard library only.
"""

import os
import re
import subprocess
import threading
import time

import benchlib as L
import servers as S
from benchlib import log, emit, fmt_num, fms
from measure import measure
from nbdclient import (NBD_FLAG_CAN_MULTI_CONN, UblkdNbd, make_client, nbd_connect, nbd_fill,
                       unix_connections)
from servers import Nbdkit

REC, META, DONE = L.markers("NBD")


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
    ublkds = {}  # one ublkd per ublkd client for the whole phase, its device per round
    for rnd in range(nrounds):
        # Every client is attached for the whole round and the clients take turns per
        # job (A B C, then B C A for the next job...): each job's runs lie within a
        # minute of each other, so a burst of other work on the host hits them alike.
        order = L.rotated(clients, rnd)
        attached = {}
        for cname in order:
            if cname.startswith("ublkd"):
                cl = ublkds[cname] = ublkds.get(cname) or make_client(cname, plan)
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
                count += L.fail_jobs(REC, {**base, "kind": "run"}, jobs, f"attach: {e}")
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
    for cname, ublkd in ublkds.items():
        S.stop(ublkd, cname)
        probs = ublkd.log_problems()
        if probs:
            log(f"{cname} logged {probs[0]} warnings/errors in the throughput phase; the "
                f"last: {probs[1]}")
    kit.stop()


def measure_run(cl, cname, dev, job, spec, kit, mprm):
    """One fio run with measure() (bench.py's), its server CPU split into the server's
    (`kit`: nbdkit, or the RBD benchmark's OSD) and the client's processes' (ublkd's, or
    rbd-nbd's; the kernel's clients have none)."""
    client_pids = cl.pids()
    kit_pid = kit.pid
    res = measure(_PidsOf(client_pids | {kit_pid}), None, dev, job, tuple(spec), mprm)
    ios = res["window_ios"]
    kit_s = res["per_pid_cpu_s"].get(str(kit_pid), 0.0)
    res["nbdkit_cpu_s"] = kit_s
    res["client_cpu_s"] = res["server_cpu_s"] - kit_s if client_pids else None
    if ios:
        res["nbdkit_us_per_io"] = kit_s / ios * 1e6
        res["client_us_per_io"] = (res["client_cpu_s"] / ios * 1e6
                                   if res["client_cpu_s"] is not None else None)
        res["rest_us_per_io"] = res["sys_cpu_us_per_io"] - res["server_cpu_s"] / ios * 1e6
    res.pop("cpu_us_per_io", None)  # nbdkit + client: split above
    log(f"    {fmt_num(res['iops'])} IOPS  p50 {fmt_num(res['p50_us'])} us  "
        f"p99 {fmt_num(res['p99_us'])} us  server {fmt_num(res.get('nbdkit_us_per_io'))} us/IO  "
        + (f"{cname} {fmt_num(res.get('client_us_per_io'))} us/IO  " if client_pids else "")
        + f"guest {fmt_num(res['sys_cpu_us_per_io'])} us/IO"
        + (f"  [{res['note']}]" if res.get("note") else ""))
    return res


class _PidsOf:
    """What measure() asks of a server: its pids."""

    def __init__(self, pids):
        self._pids = pids

    def pids(self, _dev_id):
        return self._pids


# ======================================================================================
# guest: the restart phase
# ======================================================================================

FIO_OUT = "/tmp/ublkd-bench-nbd-fio"


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
    process stuck on the device's I/O cannot exit), with the why. A device whose size
    went to 0 (the kernel's NBD client after its connection died) "fails": a read
    there finds the end at once."""
    try:
        with open(f"/sys/block/{dev}/size") as f:
            if int(f.read()) == 0:
                return "fails", "its size is 0 now"
    except (OSError, ValueError) as e:
        return "fails", f"/sys/block/{dev}/size: {e}"
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


def verify_fio_cmd(dev, shape):
    """fio randrw 4k with crc32c verify on /dev/DEV for `shape` (a FaultShape)."""
    return ["fio", "--name=verify-under-fault", f"--filename=/dev/{dev}", "--rw=randrw",
            "--bs=4k", "--ioengine=io_uring", "--direct=1", f"--iodepth={shape.iodepth}",
            "--verify=crc32c", f"--verify_backlog={shape.verify_backlog}",
            "--verify_state_save=0", "--continue_on_error=all", "--time_based",
            f"--runtime={shape.runtime_s}", "--output-format=json",
            f"--output={FIO_OUT}.json"]


class FaultShape:
    """How a verifying fio meets a fault: its queue depth, verify backlog and runtime,
    the seconds of I/O before the fault, and how long its I/O may stay stuck after its
    runtime before the device is probed and detached."""

    def __init__(self, iodepth, verify_backlog, runtime_s, fault_after_s, hang_s):
        self.iodepth, self.verify_backlog = iodepth, verify_backlog
        self.runtime_s, self.fault_after_s, self.hang_s = runtime_s, fault_after_s, hang_s


def verify_under_fault(dev, shape, fault, detach, rec, what):
    """Runs fio (verify_fio_cmd) on /dev/DEV, calls `fault()` `shape.fault_after_s` into
    its I/O and waits for fio. I/O still stuck `shape.hang_s` after fio's runtime: the
    device is probed and `detach()`ed (which fails what is stuck), so that fio exits
    and reports its errors. Fills `rec` with fio's exit, errors and longest completion
    latency, the longest stall (GapWatch), whether I/O hung, and whether the device
    works afterwards; `what` prefixes the log lines. Raises where fio did no I/O."""
    for p in (FIO_OUT + ".json", FIO_OUT + ".err"):
        if os.path.exists(p):
            os.unlink(p)
    watch = GapWatch(dev)
    watch.start()
    fio = None
    try:
        errf = open(FIO_OUT + ".err", "w")
        d0 = L.disk_ios(dev)
        fio = subprocess.Popen(verify_fio_cmd(dev, shape), stdout=subprocess.DEVNULL,
                               stderr=errf, cwd="/tmp")
        errf.close()
        t_fio = time.monotonic()
        while L.disk_ios(dev) == d0:
            if fio.poll() is not None or time.monotonic() - t_fio > 120:
                raise RuntimeError("fio did no I/O on the device: " + L.tail(FIO_OUT + ".err"))
            time.sleep(0.02)
        time.sleep(shape.fault_after_s)
        fault()
        t_end = t_fio + shape.runtime_s + shape.hang_s
        try:
            rc = fio.wait(timeout=max(1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            rec["hung"] = True
            rec["stall_ms"] = watch.finish(stuck=True)
            rec["device_after"], why = device_works(dev, timeout=10)
            rec["device_after_why"] = why
            log(f"{what}: fio's I/O still stuck {shape.hang_s} s after its runtime; the "
                f"device {rec['device_after']}; detaching it")
            t_det = time.monotonic()
            try:
                detach()
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
        if not rec.get("hung"):
            rec["device_after"], why = device_works(dev)
            if why:
                rec["device_after_why"] = why
        errtail = L.tail(FIO_OUT + ".err", 2)
        if errtail:
            rec["fio_stderr"] = errtail[:300]
    except BaseException:
        if fio and fio.poll() is None:
            fio.kill()
            try:
                fio.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        watch.stop_ev.set()
        raise


def restart_one(plan, cname, rnd):
    prm = plan["params"]
    rec = {"kind": "restart", "client": cname, "round": rnd}
    sock = prm["NBD_SOCKET"]
    L.zero_file(prm["NBD_RESTART_FILE"], prm["NBD_RESTART_FILE_MB"])
    kit = Nbdkit(sock, ["file", prm["NBD_RESTART_FILE"]], "file")
    cl = make_client(cname, plan, restart=True)
    shape = FaultShape(prm["NBD_RESTART_IODEPTH"], prm["NBD_RESTART_VERIFY_BACKLOG"],
                       prm["NBD_RESTART_RUNTIME_S"], prm["NBD_RESTART_KILL_AFTER_S"],
                       prm["NBD_RESTART_HANG_S"])
    _, klines = kernel_log_tail(0)

    def restart_nbdkit():
        old = kit.pid
        kit.kill()
        t_kill = time.monotonic()
        log(f"restart {cname}: nbdkit (pid {old}) SIGKILLed")
        time.sleep(prm["NBD_RESTART_DOWN_S"])
        kit.start()
        rec["down_s"] = round(time.monotonic() - t_kill, 2)
        log(f"restart {cname}: nbdkit restarted (pid {kit.pid}) after {rec['down_s']} s")

    try:
        kit.start()
        dev = cl.attach(sock)
        rec["dev"] = dev
        time.sleep(0.3)
        rec["connections"] = len(unix_connections(sock))
        verify_under_fault(dev, shape, restart_nbdkit, cl.detach, rec, f"restart {cname}")
        rec["connections_after"] = len(unix_connections(sock))
    except Exception as e:
        rec["error"] = str(e)
    rec["kernel_log"], _ = kernel_log_tail(klines)
    if isinstance(cl, UblkdNbd):
        try:
            st = cl.status() if cl.dev_id is not None else None
            if st:
                rec["ublkd_status"] = st
        except Exception as e:
            rec["ublkd_status"] = f"ublkctl status failed: {e}"
        if cl.problems_note():
            rec["client_log"] = cl.problems_note()
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


def kernel_log_tail(since_lines, drivers=r"\bnbd\d|ublk"):
    """The kernel's messages after its first `since_lines` lines, summarized: the
    messages `drivers` matches (by default nbd's and ublk's), distinct ones (timestamps,
    request addresses and long numbers masked, each once with its count) and the number
    of "I/O error" lines. Returns (summary, the log's line count now)."""
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
        elif re.search(drivers, msg):
            key = re.sub(r"\b[0-9a-f]{8,16}\b|\d{5,}", "N", msg)
            seen[key] = seen.get(key, 0) + 1
    parts = [f"{k} (x{n})" if n > 1 else k for k, n in seen.items()]
    if ioerr:
        parts.append(f"{ioerr} 'I/O error' lines")
    return " | ".join(parts)[:700], len(out)
