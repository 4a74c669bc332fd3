"""The benchmarks' results: statistics (a sample's quartiles, a ratio between two
servers and how sure it is), a table cell's formats, the parts of a table every
client table shares, and the output files (results.json, table.txt, plot.svg).

Nothing here runs anything: it is arithmetic and text, tested by test_benchlib.py.
Python 3 standard library only.
"""

import json
import os
import random
import statistics



def stats(vals):
    vals = sorted(v for v in vals if v is not None)
    if not vals:
        return None
    q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else [vals[0]] * 3
    return {"n": len(vals), "median": statistics.median(vals), "min": vals[0],
            "max": vals[-1], "q1": q[0], "q3": q[2]}


# How sure a ratio is: each round runs every server (or client) once, interleaved, so
# the ratio of one round's two runs leaves out what drifts between rounds (the host's
# other work, the guest's caches). The spread is a bootstrap interval of the median of
# those per-round ratios; a ratio whose interval holds 1.0 is "not resolved": the
# host's noise could have made it.
RATIO_CONFIDENCE = 0.90
RATIO_RESAMPLES = 2000


def paired_ratio(num_recs, den_recs, metric):
    """The ratio of `metric` between two servers' runs, paired by round: the median of
    the per-round ratios, its bootstrap interval, how many rounds had both, and whether
    the interval leaves out 1.0. None without a round that has both."""
    den = {r["round"]: r.get(metric) for r in den_recs}
    ratios = sorted(r[metric] / den[r["round"]] for r in num_recs
                    if r.get(metric) is not None and den.get(r["round"]))
    if not ratios:
        return None
    median = statistics.median(ratios)
    if len(ratios) < 3:
        lo, hi = ratios[0], ratios[-1]
    else:
        rng = random.Random(1)  # the same interval for the same records, run after run
        meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                      for _ in range(RATIO_RESAMPLES))
        tail = (1 - RATIO_CONFIDENCE) / 2
        lo = meds[int(tail * (RATIO_RESAMPLES - 1))]
        hi = meds[int((1 - tail) * (RATIO_RESAMPLES - 1))]
    resolved = len(ratios) >= 2 and (lo > 1.0 or hi < 1.0)
    return {"median": median, "lo": lo, "hi": hi, "n": len(ratios), "resolved": resolved}


def median_ratio(num, den, threshold=1.0):
    """The ratio of the medians of two unpaired samples (each server's kills are its
    own), with a bootstrap interval (each sample resampled on its own), and whether the
    interval leaves out `threshold` (a goal's ratio, or 1.0). None if either is empty."""
    num, den = [v for v in num if v is not None], [v for v in den if v is not None]
    if not num or not den or not statistics.median(den):
        return None
    median = statistics.median(num) / statistics.median(den)
    rng = random.Random(1)
    ratios = []
    for _ in range(RATIO_RESAMPLES):
        d = statistics.median(rng.choices(den, k=len(den)))
        if d:
            ratios.append(statistics.median(rng.choices(num, k=len(num))) / d)
    ratios.sort()
    tail = (1 - RATIO_CONFIDENCE) / 2
    lo = ratios[int(tail * (len(ratios) - 1))]
    hi = ratios[int((1 - tail) * (len(ratios) - 1))]
    resolved = len(num) >= 2 and len(den) >= 2 and (lo > threshold or hi < threshold)
    return {"median": median, "lo": lo, "hi": hi, "n": min(len(num), len(den)),
            "resolved": resolved}


def fmt_ratio(r):
    """`x1.22 [1.10-1.31]`, and `not resolved` where the interval holds 1.0."""
    if not r:
        return "-"
    verdict = "" if r["resolved"] else " not resolved"
    return f"x{r['median']:.2f} [{r['lo']:.2f}-{r['hi']:.2f}, n={r['n']}]{verdict}"


def fmt_num(v, unit=""):
    """A figure in a table cell: three significant digits or so, 12.3k above 10 000."""
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


def fms(v):
    """Milliseconds in a table cell."""
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def ruled(head):
    """A table's first lines: its head and a rule as long."""
    return [head, "-" * len(head)]


def client_table(head, prm, prefix, summaries, cwidth, iwidth, cells, ratio_lines):
    """The throughput part of a table of clients (nbd.py's, rbd.py's, whose parameters'
    names start with `prefix`): `head` and its rule, then per job its rows (client_rows;
    `summaries`: job: its summary), the lines `ratio_lines(job)` gives, and an empty
    line."""
    lines = ruled(head)
    for job in prm[prefix + "JOBS"]:
        lines += client_rows(job, prm[prefix + "CLIENTS"], summaries[job], cwidth, iwidth,
                             cells)
        lines += ratio_lines(job)
        lines.append("")
    return lines


def client_rows(job, clients, job_summary, cwidth, iwidth, cells):
    """The rows of one job in a table of clients (nbd.py's, rbd.py's): the job's name on
    its first row, "no successful run" where a client has none, else the client, its
    IOPS median [min-max] and `cells(client, its summary, med)`, where med(metric) is
    the metric's median as a table cell."""
    lines, first = [], True
    for c in clients:
        s = job_summary.get(c)
        if s is None:
            continue
        name = job if first else ""
        first = False
        fails = f" ({s['failed_runs']} failed)" if s["failed_runs"] else ""
        if not s["iops"]:
            lines.append(f"{name:<18} {c:<{cwidth}} no successful run{fails}")
            continue
        io = s["iops"]

        def med(k, s=s):
            return fmt_num(s[k]["median"]) if s[k] else "-"
        iops = f"{fmt_num(io['median'])} [{fmt_num(io['min'])}-{fmt_num(io['max'])}]"
        lines.append(f"{name:<18} {c:<{cwidth}} {iops:<{iwidth}} {cells(c, s, med)}{fails}")
    return lines


def footer(results):
    """The table's last lines: how busy the host was with other work, and the peers
    left out."""
    lines = []
    other = [r["host_other_cpu_pct"] for r in results["records"] if "host_other_cpu_pct" in r]
    if other:
        med = statistics.median(other)
        lines.append(f"host CPU used by other work than this VM during the run: median "
                     f"{med:.0f}%, max {max(other):.0f}% of one CPU"
                     + (" -- the host was busy: these numbers are noisier than usual"
                        if med > 20 else ""))
    for peer, err in results.get("peer_errors", {}).items():
        lines.append(f"{peer} was left out: {err.splitlines()[0]}")
    return lines


def client_table_end(results, peers, phase_kind):
    """The last lines of nbd.py's and rbd.py's tables: the guest's kernel and CPUs,
    ublkd's version and `peers` (what else ran), the clients left out and why, the
    footer, and the records that failed outside the phase `phase_kind` (whose own
    table shows its failures)."""
    m = results["meta"]
    lines = [f"kernel {m.get('kernel', '?')}, {m.get('cpus', '?')} vCPU "
             f"({m.get('accel', 'VM')}); ublkd {results['versions'].get('ublkd', '?')}; "
             f"{peers}; nbd.ko: {m.get('nbd_module', '?')}."]
    for c, why in m.get("skipped", {}).items():
        lines.append(f"{c} left out: {why}")
    lines += footer(results)
    errs = [r for r in results["records"] if r.get("error") and r.get("kind") != phase_kind]
    for r in errs[:10]:
        lines.append(f"FAILED {r.get('client')} {r.get('job', r.get('kind'))} round "
                     f"{r.get('round')}: {r['error'][:300]}")
    return lines


def write_outputs(results, outdir, render_table, render_plot=None):
    """Writes results.json, table.txt and (with `render_plot`) plot.svg into `outdir`
    and prints the table."""
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = render_table(results)
    with open(os.path.join(outdir, "table.txt"), "w") as f:
        f.write(text + "\n")
    names = ["results.json", "table.txt"]
    if render_plot:
        with open(os.path.join(outdir, "plot.svg"), "w") as f:
            f.write(render_plot(results))
        names.append("plot.svg")
    print()
    print(text)
    print()
    print(f"results: {outdir}/{', '.join(names + ['console.log'])}", flush=True)


def report(args, summarize, render_table, render_plot=None):
    """`report DIR`: re-renders an earlier run's outputs from its results.json."""
    path = args.dir
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    with open(path) as f:
        results = json.load(f)
    results["summary"] = summarize(results)
    write_outputs(results, os.path.dirname(os.path.abspath(path)), render_table, render_plot)
