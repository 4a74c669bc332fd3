#!/usr/bin/env python3
"""ublkd's benchmark: ublkd against kublk (with and without -b) and rublk, in one VM boot.

Run through `bench/run` (see bench/README.md). Three halves, one file:

  host    build ublkd and the peers, boot the VM, collect its records, write the results
  guest   (inside the VM) the rounds: add a device per server, run fio, measure, delete
  report  re-render the table and the plot of an earlier results dir

Python 3 standard library only. The parameters are in bench/params.py; what this
shares with recovery.py (builds, the VM run, the servers) is in bench/benchlib.py.
"""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import params as P  # noqa: E402
import benchlib as L  # noqa: E402
from benchlib import REPO, log, die, run, sh, stats, emit  # noqa: E402

REC = "@@UBLKD-BENCH-REC@@ "
META = "@@UBLKD-BENCH-META@@ "
DONE = "@@UBLKD-BENCH-DONE@@"


# ======================================================================================
# host
# ======================================================================================

def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.isupper()}
    if args.quick:
        for k, v in P.QUICK.items():
            prm[k] = v
    if isinstance(prm["JOBS"], list):
        prm["JOBS"] = {j: P.JOBS[j] for j in prm["JOBS"]}
    if args.rounds:
        prm["ROUNDS"] = args.rounds
    if args.runtime:
        prm["RUNTIME_S"] = args.runtime
    if args.servers:
        prm["SERVERS"] = args.servers.split(",")
        for s in prm["SERVERS"]:
            if s not in P.SERVERS:
                die(f"unknown server {s!r}; known: {', '.join(P.SERVERS)}", 2)
    if args.jobs:
        names = args.jobs.split(",")
        for j in names:
            if j not in P.JOBS:
                die(f"unknown job {j!r}; known: {', '.join(P.JOBS)}", 2)
        prm["JOBS"] = {j: P.JOBS[j] for j in names}
    prm.pop("QUICK", None)
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
    hr = L.HostRun(args, prm["CACHE_DIR"])
    if args.baseline:
        hr.paths["ublkd-base"], hr.versions["ublkd-base"] = build_baseline(args.baseline)
        prm["SERVERS"] = prm["SERVERS"] + ["ublkd-base"]
    want = set(prm["SERVERS"])
    if any(s.startswith("kublk") for s in want):
        hr.build_peer("kublk", L.build_kublk, args.rebuild_peers)
    if "rublk" in want:
        hr.build_peer("rublk", L.build_rublk, args.rebuild_peers)
    servers = [s for s in prm["SERVERS"]
               if not (s.startswith("kublk") and "kublk" not in hr.paths)
               and not (s == "rublk" and "rublk" not in hr.paths)]
    prm["SERVERS"] = servers
    log(f"peers ready after {time.monotonic() - hr.t0:.0f} s")

    plan_path = hr.write_plan(prm)
    est = estimate_s(prm)
    timeout = int(1.6 * est + 180)
    log(f"{prm['ROUNDS']} rounds x {len(servers)} servers x {len(prm['JOBS'])} jobs, "
        f"~{est / 60:.0f} min in the VM (timeout {timeout} s); results: {hr.outdir}")
    hr.run_and_finish(prm, plan_path, "bench.py", timeout, prm["VM_MEM_MB"],
                      (REC, META, DONE), (summarize, table, svg_plot), "latest",
                      "runs it recorded", "runs")


# ======================================================================================
# summary, table, plot
# ======================================================================================

METRICS = ["iops", "p50_us", "p99_us", "cpu_us_per_io", "sys_cpu_us_per_io", "server_cpu_pct",
           "window_iops"]


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


def fmt_num(v, unit=""):
    if v is None:
        return "-"
    if v >= 100_000:
        return f"{v / 1000:.0f}k{unit}"
    if v >= 10_000:
        return f"{v / 1000:.1f}k{unit}"
    if v >= 100:
        return f"{v:.0f}{unit}"
    if v >= 10:
        return f"{v:.1f}{unit}"
    return f"{v:.2f}{unit}"


def table(results):
    prm, summ = results["params"], results["summary"]
    lines = []
    head = (f"{'job':<24} {'server':<15} {'IOPS median [min-max]':<25} {'p50 us':>8} "
            f"{'p99 us':>8}  {'server CPU us/IO [min-max]':<27} {'srv CPU%':>8} "
            f"{'sys CPU us/IO':>13} {'n':>3}")
    lines.append(head)
    lines.append("-" * len(head))
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
                 "(fio and kernel included). Ratios are of medians; spreads min-max over rounds.")
    lines += L.footer(results)
    return "\n".join(lines)


COLORS = {"ublkd": "#d62728", "ublkd-copy": "#ff7f0e",
          "ublkd-nosandbox": "#f4a6a6", "ublkd-deferred": "#8c564b",
          "kublk-b": "#1f77b4", "kublk-b-zc": "#17becf", "kublk": "#7fb3e0",
          "rublk": "#2ca02c", "ublkd-base": "#9467bd"}


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def svg_plot(results):
    """Two panels, IOPS and server CPU per I/O, each job's bars relative to the first
    ratio baseline's median (absolute baseline value printed under the job), with the
    min-max whisker and one dot per round."""
    prm, summ, recs = results["params"], results["summary"], results["records"]
    jobs, servers = list(prm["JOBS"]), prm["SERVERS"]
    base = next((b for b in prm["RATIO_BASELINES"] if b in servers), None)
    bw, gap, left, top, ph = 20, 30, 110, 66, 230
    gw = len(servers) * bw + gap
    width = max(720, left + len(jobs) * gw + 20)
    panels = [("iops", "IOPS", "higher is better"),
              ("cpu_us_per_io", "server CPU time per I/O", "lower is better")]
    height = top + len(panels) * (ph + 110) + 40
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'font-family="sans-serif" font-size="11">',
         '<rect width="100%" height="100%" fill="white"/>',
         f'<text x="10" y="20" font-size="14" font-weight="bold">ublkd benchmark '
         f'{esc(results["meta"].get("date", ""))}: {prm["ROUNDS"]} rounds, '
         f'{prm["RUNTIME_S"]} s runs, {esc(results["meta"].get("kernel", ""))} '
         f'({esc(results["meta"].get("accel", "VM"))})</text>',
         f'<text x="10" y="36">bars: median relative to {esc(base or "the best median")}\'s '
         f'median in each job (its absolute value under the job); whiskers: min-max; '
         f'dots: rounds</text>']
    lx = left
    for s in servers:
        o.append(f'<rect x="{lx}" y="46" width="10" height="10" fill="{COLORS.get(s, "#888")}"/>'
                 f'<text x="{lx + 14}" y="55">{esc(s)}</text>')
        lx += 14 + 7 * len(s) + 20
    for pi, (metric, title, hint) in enumerate(panels):
        y0 = top + pi * (ph + 110) + 20
        norms = {}
        for j in jobs:
            if base and base in summ[j] and summ[j][base][metric]:
                norms[j] = summ[j][base][metric]["median"]
            else:
                meds = [summ[j][s][metric]["median"] for s in servers
                        if s in summ[j] and summ[j][s][metric]]
                norms[j] = max(meds) if meds else None
        ymax = 0.0
        for j in jobs:
            for s in servers:
                st = summ[j].get(s, {}).get(metric)
                if st and norms[j]:
                    ymax = max(ymax, st["max"] / norms[j])
        ymax = max(1.2, ymax * 1.05)

        def ypos(v):
            return y0 + ph - (v / ymax) * ph
        o.append(f'<text x="{left}" y="{y0 - 6}" font-size="12" font-weight="bold">'
                 f'{esc(title)} ({esc(hint)})</text>')
        o.append(f'<text x="14" y="{y0 + ph / 2:.0f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {y0 + ph / 2:.0f})">relative to '
                 f'{esc(base or "best")}</text>')
        step = 0.25 if ymax <= 2 else 0.5 if ymax <= 4 else 1.0
        t = 0.0
        while t <= ymax + 1e-9:
            y = ypos(t)
            o.append(f'<line x1="{left}" x2="{width - 20}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="{"#444" if abs(t - 1) < 1e-9 else "#ddd"}" stroke-width="1"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{t:.2f}</text>')
            t += step
        for ji, j in enumerate(jobs):
            gx = left + ji * gw + gap / 2
            for si, s in enumerate(servers):
                if s not in summ[j]:
                    continue  # a variant that does not run this job
                st = summ[j][s][metric]
                x = gx + si * bw
                if not st or not norms[j]:
                    o.append(f'<text x="{x + bw / 2:.1f}" y="{ypos(0) - 4:.1f}" '
                             f'text-anchor="middle" fill="#999">x</text>')
                    continue
                n = norms[j]
                yb = ypos(st["median"] / n)
                o.append(f'<rect x="{x + 1:.1f}" y="{yb:.1f}" width="{bw - 2}" '
                         f'height="{ypos(0) - yb:.1f}" fill="{COLORS.get(s, "#888")}">'
                         f'<title>{esc(j)} {esc(s)}: median {st["median"]:.4g}, '
                         f'min {st["min"]:.4g}, max {st["max"]:.4g}, n {st["n"]}</title></rect>')
                cx = x + bw / 2
                o.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{ypos(st["min"] / n):.1f}" '
                         f'y2="{ypos(st["max"] / n):.1f}" stroke="black"/>')
                for r in recs:
                    if r["job"] == j and r["server"] == s and r.get(metric) is not None \
                            and not r.get("error"):
                        o.append(f'<circle cx="{cx:.1f}" cy="{ypos(r[metric] / n):.1f}" '
                                 f'r="1.6" fill="black" fill-opacity="0.6"/>')
            lx, ly = gx + len(servers) * bw / 2, ypos(0) + 13
            absval = fmt_num(norms[j]) + (" IOPS" if metric == "iops" else " us/IO")
            o.append(f'<text x="{lx:.1f}" y="{ly:.1f}" text-anchor="middle" '
                     f'fill="#555">{esc(absval)}</text>')
            o.append(f'<text x="{lx + 8:.1f}" y="{ly + 14:.1f}" text-anchor="end" '
                     f'transform="rotate(-30 {lx + 8:.1f} {ly + 14:.1f})">{esc(j)}</text>')
    o.append("</svg>")
    return "\n".join(o) + "\n"


def report(args):
    L.report(args, summarize, table, svg_plot)


# ======================================================================================
# guest: servers
# ======================================================================================

Ublkd = L.Ublkd


class Kublk(L.Peer):
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


class Rublk(L.Peer):
    def __init__(self, plan):
        super().__init__(plan, "rublk")

    def add(self, target):
        a = [self.bin, "add", target, "-q", str(self.prm["QUEUES"]),
             "-d", str(self.prm["QUEUE_DEPTH"])]
        if target == "loop":
            a += ["-f", self.prm["LOOP_FILE"]]
        return self._parse(sh(a))


def make_server(name, plan):
    return {"ublkd": lambda: Ublkd(plan),
            "ublkd-copy": lambda: Ublkd(plan, copy=True),
            "ublkd-deferred": lambda: Ublkd(plan, fast_release=False),
            "ublkd-nosandbox": lambda: Ublkd(plan, sandbox=False),
            "ublkd-base": lambda: Ublkd(plan, build="ublkd-base"),
            "kublk-b": lambda: Kublk(plan, True),
            "kublk-b-zc": lambda: Kublk(plan, True, auto_zc=True),
            "kublk": lambda: Kublk(plan, False), "rublk": lambda: Rublk(plan)}[name]()


# ======================================================================================
# guest: the rounds
# ======================================================================================

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


def guest(args):
    plan = L.read_plan(args.plan)
    prm = plan["params"]
    t_start = time.monotonic()
    emit(META, {**L.guest_meta(), "versions": {}})
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
                for job in jobs:
                    if runs_job(prm, sname, job):
                        count += 1
                        emit(REC, {"round": rnd + 1, "server": sname, "job": job,
                                   "error": f"start: {e}"})
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
            try:
                srv.stop()
            except Exception as e:
                log(f"round {rnd + 1}/{nrounds} {sname}: stop failed: {e}")
    log(f"done: {count} runs in {time.monotonic() - t_start:.0f} s in the VM")
    probs = Ublkd.log_problems() if "ublkd" in servers else None
    if probs:
        log(f"ublkd logged {probs[0]} warnings/errors; the last: {probs[1]}")
    print(DONE, flush=True)


# ======================================================================================

def host_args(h):
    h.add_argument("--quick", action="store_true",
                   help="smoke check: 2 rounds, 2 s runs, 3 jobs (~5 min)")
    h.add_argument("--rounds", type=int, help="override ROUNDS")
    h.add_argument("--runtime", type=int, help="override RUNTIME_S (seconds per fio run)")
    h.add_argument("--servers", help="comma-separated subset of " + ",".join(P.SERVERS))
    h.add_argument("--jobs", help="comma-separated subset of the jobs in params.py")
    h.add_argument("--out", help="results parent dir (default bench/results)")
    h.add_argument("--baseline", metavar="REV",
                   help="also run ublkd built at git revision REV (as ublkd-base), "
                        "to measure a change in the same boot")
    h.add_argument("--rebuild-peers", action="store_true",
                   help="rebuild kublk and rublk even if cached")
    L.add_kernel_arg(h)


if __name__ == "__main__":
    L.main("bench/run", __doc__, host_args, {"host": host, "guest": guest, "report": report},
           guest_help="(inside the VM) run the rounds of a plan",
           report_help="re-render the table and plot of a results dir")
