#!/usr/bin/env python3
"""ublkd's nbd target beside the kernel's NBD client (nbd.ko + nbd-client), both on the
same nbdkit export, in one VM boot (issue 19, point 7).

Run through `bench/run nbd` (see bench/README.md). Three halves, one file:

  host    build ublkd, boot the VM, collect its records, write the results
  guest   (inside the VM) the two phases below
  report  re-print the table of an earlier results dir

Throughput: one nbdkit serves a RAM export (`nbdkit memory SIZE` on a unix socket),
filled with data once; each round attaches every client, runs each fio job on each
client's device in turn (the order rotated per job and round; measured as bench.py's
runs: fio's IOPS and latency, CPU from /proc in a window inside the run) and
detaches them.
Restart: per client a fresh nbdkit serving a tmpfs file; fio randrw with crc32c
verify; nbdkit is SIGKILLed during the run and started again on the same socket a few
seconds later; fio's errors, its longest completion latency and whether the device
works afterwards are recorded.

Python 3 standard library only; parameters in bench/params.py (the NBD_* block). The
guest's phases are in bench/nbdphases.py, the clients in bench/nbdclient.py, nbdkit
in bench/servers.py.
"""

import time

import benchlib as L
import cli
import params as P
from benchlib import log, die, emit, sh, stats, fmt_num, fms
from nbdclient import load_nbd
from nbdphases import REC, META, DONE, restart_one, throughput

CLIENTS = ("kernel-nbd", "ublkd", "ublkd-zc", "kernel-nbd-c2")


# ======================================================================================
# host
# ======================================================================================

# the flags of `host` (cli.py: the shared ones)
HOST_ARGS = {
    **cli.run_args("NBD_", "2 rounds, 2 s runs, 2 jobs, and the restart phase", "--clients",
                   CLIENTS),
    "--queues": cli.override("NBD_QUEUES", "ublkd -q"),
    "--threads": cli.override("NBD_THREADS", "ublkd --threads: one connection per thread "
                              "where the export allows multi-conn; compare 2 with kernel-nbd-c2"),
    "--baseline": {"help": "the client ublkd's ratios are against (default NBD_RATIO_BASELINE)"},
    "--no-restart": cli.flag("skip the restart phase"),
    "--no-throughput": cli.flag("only the restart phase"),
    "--out": cli.OUT,
    "--kernel": cli.KERNEL,
}


def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.startswith("NBD_")}
    prm["CACHE_DIR"] = P.CACHE_DIR
    if args.clients:
        prm["NBD_CLIENTS"] = args.clients.split(",")
    for c in prm["NBD_CLIENTS"] + prm["NBD_RESTART_CLIENTS"]:
        if c not in CLIENTS:
            die(f"unknown client {c!r}; known: {', '.join(CLIENTS)}", 2)
    cli.run_flags(prm, args, "NBD_")
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
    L.need_tools((("nbdkit", "nbdkit"), ("nbd-client", "nbd-client")))
    prm = effective_params(args)
    hr = L.HostRun(args, prm["CACHE_DIR"], "nbd.py", (REC, META, DONE), suffix="-nbd")
    est = estimate_s(prm)
    what = (f"{prm['NBD_ROUNDS']} rounds x {len(prm['NBD_CLIENTS'])} clients x "
            f"{len(prm['NBD_JOBS'])} jobs, restart phase for "
            f"{', '.join(prm['NBD_RESTART_CLIENTS']) or 'none'}; ")
    hr.run_and_finish(prm, what, est, int(1.6 * est + 180), prm["NBD_VM_MEM_MB"],
                      (summarize, table, None), "records it got", "runs or restarts")


# ======================================================================================
# summary and table
# ======================================================================================

QUIET_PCT = 20  # a run is on a quiet host if other work took at most this % of a CPU
METRICS = ["iops", "p50_us", "p99_us", "nbdkit_us_per_io", "client_us_per_io",
           "sys_cpu_us_per_io", "rest_us_per_io"]
# the ratios reported with their spread and verdict (see benchlib.paired_ratio)
SPREAD_METRICS = ["iops", "p50_us", "sys_cpu_us_per_io"]


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
        # each ublkd client against the baseline ("ratio", "spread": plain ublkd's)
        j["ratios"], j["spreads"] = {}, {}
        runs = {c: [r for r in recs if r.get("kind") == "run" and r["job"] == job
                    and r["client"] == c and not r.get("error")] for c in clients}
        for c in ublkd_clients(clients):
            u, b, ratio = j.get(c), j.get(base), {}
            if u and b:
                for m in METRICS:
                    if u[m] and b[m] and b[m]["median"]:
                        ratio[m] = u[m]["median"] / b[m]["median"]
            j["ratios"][c] = ratio
            j["spreads"][c] = {m: L.paired_ratio(runs[c], runs.get(base, []), m)
                               for m in SPREAD_METRICS}
        j["ratio"] = j["ratios"].get("ublkd", {})
        j["spread"] = j["spreads"].get("ublkd", {})
    for c in clients:
        out["connections"][c] = sorted({r["connections"] for r in recs
                                        if r.get("kind") == "attach" and r["client"] == c
                                        and r.get("connections") is not None})
    for c in prm["NBD_RESTART_CLIENTS"]:
        out["restart"][c] = [r for r in recs if r.get("kind") == "restart" and r["client"] == c]
    return out


def ublkd_clients(clients):
    """The clients that are ublkd (`ublkd`, `ublkd-zc`), in order."""
    return [c for c in clients if c.startswith("ublkd")]


def nbd_cells(c, s, med):
    """A client's row after its IOPS (L.client_rows)."""
    cl = med("client_us_per_io") if c.startswith("ublkd") else "(kernel)"
    return (f"{med('p50_us'):>7} {med('p99_us'):>7}  {med('nbdkit_us_per_io'):>12} {cl:>11} "
            f"{med('sys_cpu_us_per_io'):>11} {s['iops']['n']:>3} {s.get('busy_runs', 0):>4}")


HEAD = (f"{'job':<18} {'client':<14} {'IOPS median [min-max]':<24} {'p50 us':>7} "
        f"{'p99 us':>7}  {'nbdkit us/IO':>12} {'ublkd us/IO':>11} {'guest us/IO':>11} "
        f"{'n':>3} {'busy':>4}")


def table(results):
    prm, summ = results["params"], results["summary"]
    m = results["meta"]
    base = prm["NBD_RATIO_BASELINE"]
    lines = []

    def ratio_lines(job):
        out, js = [], summ["jobs"][job]
        for c in ublkd_clients(prm["NBD_CLIENTS"]):
            r = js.get("ratios", {"ublkd": js.get("ratio")}).get(c)
            if r:
                def x(k, r=r):
                    return f"x{r[k]:.2f}" if k in r else "-"
                out.append(f"{'':<18} {c + '/' + base:<14} {x('iops'):<24} "
                           f"{x('p50_us'):>7} {x('p99_us'):>7}  "
                           f"{x('nbdkit_us_per_io'):>12} {'':>11} "
                           f"{x('sys_cpu_us_per_io'):>11}")
            sp = js.get("spreads", {"ublkd": js.get("spread")}).get(c) or {}
            cells = [f"{k} {L.fmt_ratio(sp[k])}" for k in SPREAD_METRICS if sp.get(k)]
            if cells:
                out.append(f"{'':<18} {c} per round: " + "; ".join(cells))
        return out
    if prm["NBD_ROUNDS"]:
        lines += L.client_table(HEAD, prm, "NBD_", summ["jobs"], 14, 24, nbd_cells, ratio_lines)
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
            for c in ublkd_clients(prm["NBD_CLIENTS"]):
                u, b = qj.get(c, {}).get("iops"), qj.get(base, {}).get("iops")
                if u and b and b["median"]:
                    cells.append(f"{c}/{base} x{u['median'] / b['median']:.2f}")
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
        lines.append(
            "per round: the median of each round's ublkd/" + base + " ratio (the clients "
            f"take turns within a round) and its {L.RATIO_CONFIDENCE:.0%} bootstrap "
            "interval; \"not resolved\": the interval holds 1.0, so the host's noise could "
            "have made the figure.")
        lines.append("")
    rs = [(c, r) for c, lst in summ["restart"].items() for r in lst]
    if rs:
        lines += L.ruled(f"{'restart':<14} {'fio exit':>8} {'errors':>8}  "
                         f"{'first error':<28} {'clat max ms':>11} {'stall ms':>9} "
                         f"{'I/Os':>8} {'stuck':>5}  {'device after':<14}")
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
    lines += L.client_table_end(results, f"{m.get('nbdkit', '?')}; {m.get('nbd_client', '?')}",
                                "restart")
    return "\n".join(lines)


# ======================================================================================

def guest(args):
    plan, prm, t_start, meta = L.guest_start(args, skipped={})
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


if __name__ == "__main__":
    cli.main("bench/run nbd", __doc__, HOST_ARGS, host, guest, (summarize, table, None),
             "phases")
