#!/usr/bin/env python3
"""ublkd's benchmark: ublkd against kublk (with and without -b) and rublk, in one VM boot.

Run through `bench/run` (see bench/README.md). Three halves, one file:

  host    build ublkd and the peers, boot the VM, collect its records, write the results
  guest   (inside the VM) the rounds: add a device per server, run fio, measure, delete
  report  re-render the table and the plot of an earlier results dir

Python 3 standard library only. The parameters are in bench/params.py; one run is
measured by bench/measure.py and plotted by bench/plot.py; what this shares with the
other benchmarks (builds, the VM run, the servers) is in bench/benchlib.py and the
modules it names.
"""

import os
import time

import benchlib as L
import builds
import cli
import params as P
import servers as S
from benchlib import REPO, log, die, run, stats, emit, fmt_num
from measure import idle_cpu, measure
from plot import svg_plot

REC, META, DONE = L.markers("BENCH")


# ======================================================================================
# host
# ======================================================================================

# the flags of `host` (cli.py: the shared ones)
HOST_ARGS = {
    **cli.run_args("", "2 rounds, 2 s runs, 3 jobs (~5 min)", "--servers", P.SERVERS,
                   {"help": "comma-separated subset of the jobs in params.py"}),
    "--out": cli.OUT,
    "--baseline": {"metavar": "REV",
                   "help": "also run ublkd built at git revision REV (as ublkd-base), "
                           "to measure a change in the same boot"},
    "--rebuild-peers": cli.flag("rebuild kublk and rublk even if cached"),
    "--kernel": cli.KERNEL,
}


def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.isupper()}
    if args.servers:
        prm["SERVERS"] = cli.pick(args.servers, P.SERVERS, "server")
    cli.run_flags(prm, args, "")
    return L.apply_kernel(prm, args.kernel, "SERVERS", args.servers)


def runs_job(prm, server, job):
    """Whether `server` runs `job` (SERVER_JOBS limits some variants to some jobs)."""
    only = prm.get("SERVER_JOBS", {}).get(server)
    return only is None or job in only


def estimate_s(prm):
    runs = prm["ROUNDS"] * sum(1 for s in prm["SERVERS"] for j in prm["JOBS"]
                               if runs_job(prm, s, j))
    return runs * (prm["RUNTIME_S"] + prm["RAMP_S"] + prm["OVERHEAD_PER_RUN_S"]) + 30


def build_baseline(rev):
    """Builds ublkd at git revision `rev` (a worktree under target/) for `--baseline`:
    the same jobs against the code before a change, in the same boot."""
    base = os.path.join(REPO, "target", "bench-baseline")
    src, tgt = os.path.join(base, "src"), os.path.join(base, "target")
    try:
        full = run(["git", "-C", REPO, "rev-parse", "--verify", rev + "^{commit}"]).strip()
    except RuntimeError as e:
        die(f"--baseline {rev}: not a commit of this repository: {e}", 2)
    if os.path.exists(src):
        run(["git", "-C", REPO, "worktree", "remove", "--force", src])
    run(["git", "-C", REPO, "worktree", "add", "--detach", src, full])
    log(f"building the baseline {full[:12]} (cargo build --release in {src})")
    try:
        run(["cargo", "build", "--release", "--workspace", "--bins"], cwd=src,
            env={**os.environ, "CARGO_TARGET_DIR": tgt})
    except RuntimeError as e:
        die(f"the baseline {rev} does not build: {e}")
    return os.path.join(tgt, "release"), full[:12]


def host(args):
    L.need_root()
    prm = effective_params(args)
    hr = L.HostRun(args, prm["CACHE_DIR"], "bench.py", (REC, META, DONE))
    if args.baseline:
        hr.paths["ublkd-base"], hr.versions["ublkd-base"] = build_baseline(args.baseline)
        prm["SERVERS"] = prm["SERVERS"] + ["ublkd-base"]
        # the change's own before/after, paired per round like the peers' ratios
        prm["RATIO_BASELINES"] = prm["RATIO_BASELINES"] + ["ublkd-base"]
    want = set(prm["SERVERS"])
    if any(s.startswith("kublk") for s in want):
        hr.build_peer("kublk", builds.build_kublk, args.rebuild_peers)
    if "rublk" in want:
        hr.build_peer("rublk", builds.build_rublk, args.rebuild_peers)
    servers = [s for s in prm["SERVERS"]
               if not (s.startswith("kublk") and "kublk" not in hr.paths)
               and not (s == "rublk" and "rublk" not in hr.paths)]
    prm["SERVERS"] = servers
    log(f"peers ready after {time.monotonic() - hr.t0:.0f} s")

    est = estimate_s(prm)
    what = f"{prm['ROUNDS']} rounds x {len(servers)} servers x {len(prm['JOBS'])} jobs, "
    hr.run_and_finish(prm, what, est, int(1.6 * est + 180), prm["VM_MEM_MB"],
                      (summarize, table, svg_plot), "runs it recorded", "runs")


# ======================================================================================
# summary and table (the plot: plot.py)
# ======================================================================================

METRICS = ["iops", "p50_us", "p99_us", "cpu_us_per_io", "sys_cpu_us_per_io", "server_cpu_pct",
           "window_iops"]
# the ratios reported with their spread and verdict (see benchlib.paired_ratio)
SPREAD_METRICS = ["iops", "p50_us", "cpu_us_per_io"]


# the table's column heads
HEAD = (f"{'job':<24} {'server':<15} {'IOPS median [min-max]':<25} {'p50 us':>8} "
        f"{'p99 us':>8}  {'server CPU us/IO [min-max]':<27} {'srv CPU%':>8} "
        f"{'sys CPU us/IO':>13} {'n':>3}")


def summarize(results):
    prm = results["params"]
    out = {}
    for job in prm["JOBS"]:
        out[job] = {}
        for srv in prm["SERVERS"]:
            if not runs_job(prm, srv, job):
                continue
            rs = [r for r in results["records"]
                  if r["job"] == job and r["server"] == srv and not r.get("error")]
            fails = sum(1 for r in results["records"]
                        if r["job"] == job and r["server"] == srv and r.get("error"))
            out[job][srv] = {m: stats([r.get(m) for r in rs]) for m in METRICS}
            out[job][srv]["failed_runs"] = fails
        out[job]["ratios"] = {}
        u = out[job].get("ublkd")
        for base in prm["RATIO_BASELINES"]:
            b = out[job].get(base)
            if not u or not b:
                continue
            r = {}
            for m in METRICS:
                if u[m] and b[m] and b[m]["median"]:
                    r[m] = u[m]["median"] / b[m]["median"]
            out[job]["ratios"][f"ublkd/{base}"] = r
            runs = {s: [x for x in results["records"]
                        if x["job"] == job and x["server"] == s and not x.get("error")]
                    for s in ("ublkd", base)}
            out[job].setdefault("spreads", {})[f"ublkd/{base}"] = {
                m: L.paired_ratio(runs["ublkd"], runs[base], m) for m in SPREAD_METRICS}
        # Each side's best mode by median IOPS, and their ratio.
        best = {}
        for side, modes in prm.get("BEST_OF", {}).items():
            cands = [(out[job][m]["iops"]["median"], m) for m in modes
                     if m in out[job] and out[job][m]["iops"]]
            if cands:
                best[side] = max(cands)
        if "ublkd" in best and "kublk" in best and best["kublk"][0]:
            out[job]["best"] = {"ublkd": best["ublkd"][1], "kublk": best["kublk"][1],
                                "iops_ratio": best["ublkd"][0] / best["kublk"][0]}
    out["idle_cpu_pct"] = {
        srv: stats([r["idle_cpu_pct"] for r in results["records"]
                    if r["job"] == "idle" and r["server"] == srv])
        for srv in prm["SERVERS"]}
    return out


def table(results):
    prm, summ = results["params"], results["summary"]
    lines = L.ruled(HEAD)
    for job in prm["JOBS"]:
        first = True
        for srv in prm["SERVERS"]:
            if srv not in summ[job]:
                continue
            s = summ[job][srv]
            name = job if first else ""
            first = False
            n = s["iops"]["n"] if s["iops"] else 0
            fails = f" ({s['failed_runs']} failed)" if s["failed_runs"] else ""
            if not s["iops"]:
                lines.append(f"{name:<24} {srv:<15} no successful run{fails}")
                continue
            io, cpu = s["iops"], s["cpu_us_per_io"]
            iops = f"{fmt_num(io['median'])} [{fmt_num(io['min'])}-{fmt_num(io['max'])}]"
            cpus = (f"{fmt_num(cpu['median'])} [{fmt_num(cpu['min'])}-{fmt_num(cpu['max'])}]"
                    if cpu else "-")
            p50 = fmt_num(s["p50_us"]["median"]) if s["p50_us"] else "-"
            p99 = fmt_num(s["p99_us"]["median"]) if s["p99_us"] else "-"
            sysc = fmt_num(s["sys_cpu_us_per_io"]["median"]) if s["sys_cpu_us_per_io"] else "-"
            pct = fmt_num(s["server_cpu_pct"]["median"]) if s["server_cpu_pct"] else "-"
            lines.append(f"{name:<24} {srv:<15} {iops:<25} {p50:>8} {p99:>8}  {cpus:<27} "
                         f"{pct:>8} {sysc:>13} {n:>3}{fails}")
        for rname, r in summ[job]["ratios"].items():
            def x(m):
                return f"x{r[m]:.2f}" if m in r else "-"
            lines.append(f"{'':<24} {rname:<15} {x('iops'):<25} {x('p50_us'):>8} "
                         f"{x('p99_us'):>8}  {x('cpu_us_per_io'):<27} "
                         f"{x('server_cpu_pct'):>8} {x('sys_cpu_us_per_io'):>13}")
        for rname, sp in summ[job].get("spreads", {}).items():
            cells = [f"{m} {L.fmt_ratio(sp[m])}" for m in SPREAD_METRICS if sp.get(m)]
            if cells:
                lines.append(f"{'':<24} {rname} per round: " + "; ".join(cells))
        b = summ[job].get("best")
        if b:
            lines.append(f"{'':<24} best ublkd mode ({b['ublkd']}) / best kublk mode "
                         f"({b['kublk']}): x{b['iops_ratio']:.2f} IOPS")
        lines.append("")
    idle = summ.get("idle_cpu_pct", {})
    if any(idle.values()):
        lines.append("server CPU with its device idle (no I/O), % of one CPU, median [min-max]: "
                     + ", ".join(f"{s} {fmt_num(v['median'])} [{fmt_num(v['min'])}-"
                                 f"{fmt_num(v['max'])}]" for s, v in idle.items() if v))
        lines.append("")
    m = results["meta"]
    lines.append(
        f"{prm['ROUNDS']} rounds, fio {prm['RUNTIME_S']} s + {prm['RAMP_S']} s ramp per run; "
        f"kernel {m.get('kernel', '?')}, {m.get('cpus', '?')} vCPU ({m.get('accel', 'VM')}); "
        f"ublkd {results['versions'].get('ublkd', '?')}.")
    lines.append("IOPS, p50, p99: fio (completion latency). server CPU = utime+stime of the "
                 "server's processes (all threads) per I/O the device completed, in a window "
                 "inside the fio run;")
    lines.append("srv CPU% = the same in % of one CPU; sys CPU = all CPUs' busy time per I/O "
                 "(fio and kernel included). Ratios are of medians; spreads min-max over rounds;")
    lines.append("per round: the median of each round's ratio (servers interleaved in a round) "
                 f"and its {L.RATIO_CONFIDENCE:.0%} bootstrap interval; \"not resolved\": the "
                 "interval holds 1.0.")
    lines += L.footer(results)
    return "\n".join(lines)


# ======================================================================================
# guest: the servers (servers.py) by name, and the rounds
# ======================================================================================

Ublkd = S.Ublkd


def make_server(name, plan):
    return {"ublkd": lambda: Ublkd(plan),
            "ublkd-copy": lambda: Ublkd(plan, copy=True),
            "ublkd-deferred": lambda: Ublkd(plan, fast_release=False),
            "ublkd-nosandbox": lambda: Ublkd(plan, sandbox=False),
            "ublkd-base": lambda: Ublkd(plan, build="ublkd-base"),
            "kublk-b": lambda: S.Kublk(plan, True),
            "kublk-b-zc": lambda: S.Kublk(plan, True, auto_zc=True),
            "kublk": lambda: S.Kublk(plan, False), "rublk": lambda: S.Rublk(plan)}[name]()


def guest(args):
    plan, prm, t_start, meta = L.guest_start(args, versions={})
    emit(META, meta)
    L.check_kernel(prm)

    jobs = prm["JOBS"]
    targets = [t for t in ("null", "loop") if any(s[0] == t for s in jobs.values())]
    if "loop" in targets:
        log(f"creating the loop target's backing file {prm['LOOP_FILE']} "
            f"({prm['LOOP_FILE_MB']} MiB, tmpfs)")
        L.zero_file(prm["LOOP_FILE"], prm["LOOP_FILE_MB"])

    servers = prm["SERVERS"]
    nrounds = prm["ROUNDS"]
    total = nrounds * sum(1 for s in servers for j in jobs if runs_job(prm, s, j))
    count = 0
    for rnd in range(nrounds):
        for sname in L.rotated(servers, rnd):
            srv = make_server(sname, plan)
            try:
                srv.start()
            except Exception as e:
                log(f"round {rnd + 1}/{nrounds} {sname}: start failed: {e}")
                count += L.fail_jobs(REC, {"round": rnd + 1, "server": sname},
                                     [j for j in jobs if runs_job(prm, sname, j)], f"start: {e}")
                continue
            for target in targets:
                tjobs = [j for j, s in jobs.items() if s[0] == target
                         and runs_job(prm, sname, j)]
                if not tjobs:
                    continue
                dev_id, err = None, None
                try:
                    dev_id = srv.add(target)
                    dev = L.wait_dev(dev_id)
                except Exception as e:
                    err = f"add {target}: {e}"
                    log(f"round {rnd + 1}/{nrounds} {sname}: {err}")
                # (the variants that run some jobs only are not measured idle)
                if not err and target == targets[0] and prm["IDLE_S"] > 0 \
                        and sname not in prm.get("SERVER_JOBS", {}):
                    try:
                        pct = idle_cpu(srv, dev_id, dev, prm["IDLE_S"])
                        emit(REC, {"round": rnd + 1, "server": sname, "job": "idle",
                                   "idle_cpu_pct": pct})
                        log(f"round {rnd + 1}/{nrounds}  {sname:<8} idle {target} device: "
                            f"server uses {pct:.1f}% of a CPU")
                    except Exception as e:
                        log(f"round {rnd + 1}/{nrounds} {sname}: idle measurement: {e}")
                for job in tjobs:
                    count += 1
                    rec = {"round": rnd + 1, "server": sname, "job": job}
                    if err:
                        emit(REC, {**rec, "error": err})
                        continue
                    log(f"round {rnd + 1}/{nrounds}  [{count}/{total}]  {sname:<8} {job}")
                    try:
                        res = measure(srv, dev_id, dev, job, jobs[job], prm)
                        rec.update(res)
                        log(f"    {fmt_num(res['iops'])} IOPS  p50 {fmt_num(res['p50_us'])} us"
                            f"  p99 {fmt_num(res['p99_us'])} us  server "
                            f"{fmt_num(res['cpu_us_per_io'])} us/IO  "
                            f"(sys {fmt_num(res['sys_cpu_us_per_io'])} us/IO)  server "
                            f"{fmt_num(res['server_cpu_pct'])}% CPU"
                            + (f"  [{res['note']}]" if res.get("note") else ""))
                    except Exception as e:
                        rec["error"] = str(e)
                        log(f"    FAILED: {e}")
                    emit(REC, rec)
                if dev_id is not None:
                    try:
                        pids = srv.pids(dev_id) - ({srv.proc.pid} if isinstance(srv, Ublkd)
                                                   else set())
                        srv.delete(dev_id)
                        if not L.wait_gone(pids):
                            log(f"round {rnd + 1}/{nrounds} {sname}: its processes "
                                f"{sorted(pids)} outlived the device by 10 s")
                    except Exception as e:
                        log(f"round {rnd + 1}/{nrounds} {sname}: delete failed: {e}")
            S.stop(srv, f"round {rnd + 1}/{nrounds} {sname}:")
    log(f"done: {count} runs in {time.monotonic() - t_start:.0f} s in the VM")
    probs = Ublkd.log_problems() if "ublkd" in servers else None
    if probs:
        log(f"ublkd logged {probs[0]} warnings/errors; the last: {probs[1]}")
    print(DONE, flush=True)


if __name__ == "__main__":
    cli.main("bench/run", __doc__, HOST_ARGS, host, guest, (summarize, table, svg_plot),
             "rounds")
