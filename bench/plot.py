"""bench.py's plot (plot.svg): IOPS and server CPU per I/O of each job and server,
relative to the first ratio baseline. Python 3 standard library only.
"""

from benchlib import fmt_num

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
