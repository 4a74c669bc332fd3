#!/usr/bin/env python3
"""ublkd's rbd target beside rbd-nbd and krbd on one image of a single-node Ceph
cluster, in one VM boot (issue 32, point 7).

Run through `bench/run rbd` (see bench/README.md). Three halves, one file:

  host    build ublkd, boot the VM, collect its records, write the results
  guest   (inside the VM) the cluster and the two phases below
  report  re-print the table of an earlier results dir

Throughput: tests/vm/ceph-single-node.sh's cluster (1 mon, 1 bluestore OSD, cephx), one
image filled once; each round every client in turn (rotated per round) maps it, runs
each fio job (measured as bench.py's runs: fio's IOPS and latency, CPU from /proc in a
window inside the run) and unmaps it.
Faults: per client a fresh image and fio randrw with crc32c verify; in its midst osd.0
is SIGKILLed and started again, or the client's process is (ublkd's worker, the rbd-nbd
daemon; krbd has none); fio's errors, its longest completion latency, the longest stall
and whether the device works afterwards are recorded.

Python 3 standard library only; parameters in bench/params.py (the RBD_* block). The
guest's cluster, clients and phases are in bench/rbdguest.py.
"""

import time

import benchlib as L
import cli
import params as P
from benchlib import log, emit, stats, fms
from rbdguest import REC, META, DONE, guest_phases

CLIENTS = ("ublkd", "rbd-nbd", "krbd", "rbd-nbd-nocache")


# ======================================================================================
# host
# ======================================================================================

HOST_ARGS = {
    **cli.run_args("RBD_", "1 round, 2 s runs, 2 jobs, and the fault phase", "--clients",
                   CLIENTS),
    "--no-faults": cli.flag("skip the fault phase"),
    "--no-throughput": cli.flag("only the fault phase"),
    "--out": cli.OUT,
    "--kernel": cli.KERNEL,
}


def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.startswith("RBD_")}
    if args.clients:
        prm["RBD_CLIENTS"] = cli.pick(args.clients, CLIENTS, "client")
        prm["RBD_FAULTS"] = {f: [c for c in cs if c in prm["RBD_CLIENTS"]]
                             for f, cs in prm["RBD_FAULTS"].items()}
    cli.run_flags(prm, args, "RBD_")
    if args.no_faults:
        prm["RBD_FAULT_ROUNDS"] = 0
    if args.no_throughput:
        prm["RBD_ROUNDS"] = 0
    prm["KERNEL"] = args.kernel
    return prm


def estimate_s(prm):
    runs = prm["RBD_ROUNDS"] * len(prm["RBD_CLIENTS"]) * len(prm["RBD_JOBS"])
    turns = prm["RBD_ROUNDS"] * len(prm["RBD_CLIENTS"])
    faults = prm["RBD_FAULT_ROUNDS"] * sum(len(c) for c in prm["RBD_FAULTS"].values())
    return (runs * (prm["RBD_RUNTIME_S"] + prm["RBD_RAMP_S"] + prm["RBD_OVERHEAD_PER_RUN_S"])
            + turns * 8 + faults * (prm["RBD_FAULT_RUNTIME_S"] + 30) + 180)


def host(args):
    L.need_root()
    L.need_tools((("ceph-osd", "ceph-osd"), ("ceph-mon", "ceph-mon"), ("rbd", "ceph-common"),
                  ("rbd-nbd", "rbd-nbd"), ("nbd-client", "nbd-client")))
    prm = effective_params(args)
    hr = L.HostRun(args, P.CACHE_DIR, "rbd.py", (REC, META, DONE), suffix="-rbd")
    est = estimate_s(prm)
    faults = ("; ".join(f"{f} for {', '.join(c)}" for f, c in prm["RBD_FAULTS"].items())
              if prm["RBD_FAULT_ROUNDS"] else "none")
    what = (f"{prm['RBD_ROUNDS']} rounds x {len(prm['RBD_CLIENTS'])} clients x "
            f"{len(prm['RBD_JOBS'])} jobs, fault phase: {faults}; ")
    hr.run_and_finish(prm, what, est, int(1.6 * est + 300), prm["RBD_VM_MEM_MB"],
                      (summarize, table, None), "records it got", "runs or faults")


# ======================================================================================
# summary and table
# ======================================================================================

METRICS = ["iops", "bw_MiBps", "p50_us", "p99_us", "osd_us_per_io", "client_us_per_io",
           "sys_cpu_us_per_io"]
SPREAD_METRICS = ["iops", "p50_us", "sys_cpu_us_per_io"]


def summarize(results):
    prm, recs = results["params"], results["records"]
    out = {"jobs": {}, "faults": [], "attach_s": {}}
    for job in prm["RBD_JOBS"]:
        j = out["jobs"][job] = {"ratio": {}, "spread": {}}
        runs = {}
        for c in prm["RBD_CLIENTS"]:
            mine = [r for r in recs if r.get("kind") == "run" and r["job"] == job
                    and r["client"] == c]
            runs[c] = [r for r in mine if not r.get("error")]
            j[c] = {m: stats([r.get(m) for r in runs[c]]) for m in METRICS}
            j[c]["failed_runs"] = len(mine) - len(runs[c])
        for base in prm["RBD_RATIO_BASELINES"]:
            u, b = j.get("ublkd"), j.get(base)
            if u and b and u["iops"] and b["iops"]:
                j["ratio"][base] = {m: u[m]["median"] / b[m]["median"] for m in METRICS
                                    if u[m] and b[m] and b[m]["median"]}
                j["spread"][base] = {m: L.paired_ratio(runs["ublkd"], runs[base], m)
                                     for m in SPREAD_METRICS}
    for c in prm["RBD_CLIENTS"]:
        out["attach_s"][c] = stats([r.get("attach_s") for r in recs
                                    if r.get("kind") == "attach" and r["client"] == c])
    out["faults"] = [r for r in recs if r.get("kind") == "fault"]
    return out


def rbd_cells(c, s, med):
    """A client's row after its IOPS (L.client_rows)."""
    client = med("client_us_per_io") if c != "krbd" else "(kernel)"
    return (f"{med('bw_MiBps'):>6} {med('p50_us'):>7} {med('p99_us'):>7} "
            f"{med('osd_us_per_io'):>9} {client:>12} {med('sys_cpu_us_per_io'):>11} "
            f"{s['iops']['n']:>2}")


HEAD = (f"{'job':<18} {'client':<15} {'IOPS median [min-max]':<22} {'MiB/s':>6} "
        f"{'p50 us':>7} {'p99 us':>7} {'OSD us/IO':>9} {'client us/IO':>12} "
        f"{'guest us/IO':>11} {'n':>2}")


def table(results):
    prm, summ, m = results["params"], results["summary"], results["meta"]
    lines = []

    def ratio_lines(job):
        out = []
        for base, r in summ["jobs"][job]["ratio"].items():
            sp = summ["jobs"][job]["spread"].get(base, {})

            def x(k, r=r):
                return f"x{r[k]:.2f}" if k in r else "-"
            out.append(f"{'':<18} ublkd/{base:<15} IOPS {L.fmt_ratio(sp.get('iops'))}; "
                       f"p50 {x('p50_us')}, p99 {x('p99_us')}, guest us/IO "
                       f"{x('sys_cpu_us_per_io')}")
        return out
    if prm["RBD_ROUNDS"]:
        lines += L.client_table(HEAD, prm, "RBD_", summ["jobs"], 15, 22, rbd_cells, ratio_lines)
        att = ", ".join(f"{c} {s['median']:.1f} s" for c, s in summ["attach_s"].items() if s)
        lines.append(f"map/add until the device is there, median: {att}")
        lines.append(
            f"{prm['RBD_ROUNDS']} rounds (each client in turn maps the image, runs every job "
            f"and unmaps it; the order rotated per round), fio {prm['RBD_RUNTIME_S']} s + "
            f"{prm['RBD_RAMP_S']} s ramp per run, direct=1 io_uring, over the whole "
            f"{prm['RBD_IMAGE_MB']} MiB image (filled once with 4 MiB writes); ublkd -q "
            f"{prm['RBD_QUEUES']} -d {prm['RBD_QUEUE_DEPTH']}; rbd-nbd and krbd with their "
            f"defaults.")
        lines.append(
            "CPU per I/O the device completed, in a window inside each run: OSD = ceph-osd's "
            "utime+stime; client = ublkd's processes (supervisor, worker, standby) or "
            "rbd-nbd's daemon (krbd runs in the kernel); guest = all vCPUs' busy time (fio, "
            "kernel, mon, OSD, client). The cluster shares the guest's vCPUs with the "
            "client, so a client that costs less CPU leaves more to the OSD.")
        lines.append(
            "ublkd/X IOPS: the median of each round's ratio and its "
            f"{L.RATIO_CONFIDENCE:.0%} bootstrap interval; \"not resolved\": the interval "
            "holds 1.0.")
        lines.append("")
    fl = summ["faults"]
    if fl:
        lines += L.ruled(f"{'fault':<12} {'client':<9} {'fio exit':>8} {'errors':>7}  "
                         f"{'first error':<24} {'clat max ms':>11} {'stall ms':>9} "
                         f"{'I/Os':>7} {'stuck':>5}  {'device after':<12}")
        for r in fl:
            head = f"{r['fault']:<12} {r['client']:<9}"
            if r.get("error") and r.get("fio_rc") is None:
                lines.append(f"{head} FAILED: {r['error'][:200]}")
                continue
            errs = r.get("fio_errors")
            lines.append(
                f"{head} {str(r.get('fio_rc', '-')):>8} "
                f"{str(errs if errs is not None else '-'):>7}  "
                f"{(r.get('first_error') or '-')[:24]:<24} {fms(r.get('clat_max_ms')):>11} "
                f"{fms(r.get('stall_ms')):>9} {str(r.get('fio_ios', '-')):>7} "
                f"{'yes' if r.get('hung') else 'no':>5}  {r.get('device_after', '-'):<12}")
            notes = []
            if r.get("osd_restart_s") is not None:
                notes.append(f"osd.0 up again {r['osd_restart_s']} s after its kill")
            if r.get("hung"):
                notes.append(f"I/O stuck {prm['RBD_FAULT_HANG_S']} s after fio's runtime; "
                             "the unmap released it"
                             + (f" in {r['released_after_detach_s']} s"
                                if r.get("released_after_detach_s") is not None else " not"))
            if r.get("device_after_why"):
                notes.append(f"device after: {r['device_after_why'][:150]}")
            for k in ("error", "kernel_log", "client_log"):
                if r.get(k):
                    notes.append(f"{k.replace('_', ' ')}: {r[k][:400]}")
            for n in notes:
                lines.append(f"{'':<22} {n}")
        lines.append(
            f"fio randrw 4k qd{prm['RBD_FAULT_IODEPTH']} direct io_uring verify=crc32c "
            f"verify_backlog={prm['RBD_FAULT_VERIFY_BACKLOG']} continue_on_error=all, "
            f"{prm['RBD_FAULT_RUNTIME_S']} s on a fresh {prm['RBD_FAULT_IMAGE_MB']} MiB image; "
            f"{prm['RBD_FAULT_AFTER_S']} s into the I/O: osd-restart = osd.0 SIGKILLed, "
            "marked down and started again; client-kill = the client's process SIGKILLed "
            "(ublkd's worker: ublkd recovers by itself; the rbd-nbd daemon: nothing restarts "
            "it, as in ceph-csi's node plugin restart).")
        lines.append(
            "errors = fio's total_err (failed I/Os and verify failures); clat max = fio's "
            "longest completion of an I/O that succeeded; stall = the longest time I/O was "
            "in flight on the device and none completed (/sys/block/DEV/inflight and stat); "
            "device after = a 4k direct read and write after fio ended.")
        lines.append("")
    peers = f"{m.get('ceph', '?')}; cluster ready in {m.get('cluster_start_s', '?')} s"
    lines += L.client_table_end(results, peers, "fault")
    return "\n".join(lines)


# ======================================================================================

def guest(args):
    plan, prm, t_start, meta = L.guest_start(args, skipped={})
    L.check_kernel(prm)
    try:
        guest_phases(plan, meta)
    except Exception as e:
        emit(REC, {"kind": "phase", "client": "-", "error": f"setup: {e}"})
        log(f"FAILED: {e}")
    emit(META, meta)
    log(f"done in {time.monotonic() - t_start:.0f} s in the VM")
    print(DONE, flush=True)


if __name__ == "__main__":
    cli.main("bench/run rbd", __doc__, HOST_ARGS, host, guest, (summarize, table, None),
             "phases")
