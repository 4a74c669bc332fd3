"""One fio run on a device, measured (bench.py's runs, and the NBD benchmark's
throughput runs): fio's IOPS and latency over its measured period, and the server's
CPU, all CPUs' busy time and the device's I/Os in a window inside it. Also the
server's CPU with its device idle. Python 3 standard library only.
"""

import subprocess
import time

import benchlib as L


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
    jb = L.fio_job(out)
    if jb.get("error"):
        raise RuntimeError(f"fio job error {jb['error']}")
    d = jb["write" if "write" in rw else "read"]
    pct = d["clat_ns"].get("percentile", {})
    return {"iops": d["iops"], "bw_MiBps": d["bw_bytes"] / 2**20,
            "p50_us": pct.get("50.000000", 0) / 1000, "p99_us": pct.get("99.000000", 0) / 1000,
            "clat_mean_us": d["clat_ns"]["mean"] / 1000, "fio_ios": d["total_ios"]}


def sample(pids, dev):
    return ({p: L.proc_cpu_s(p) for p in pids}, L.sys_busy_s(), L.disk_ios(dev),
            time.monotonic())


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
    d_start = L.disk_ios(dev)
    proc = subprocess.Popen(fio_cmd(dev, job, spec, prm), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t_launch = time.monotonic()
    deadline = t_launch + prm["RUNTIME_S"] + prm["RAMP_S"] + 120
    note = None
    try:
        while L.disk_ios(dev) == d_start and proc.poll() is None:
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
