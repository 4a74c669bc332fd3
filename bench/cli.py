"""The command line of every benchmark script: `host` (the default) with the script's
flags, `guest PLAN` (inside the VM) and `report DIR`, and the one main that parses and
runs them. The flags more than one script has are made here, so that they read the
same everywhere; a script lists its own in a dict, flag: add_argument's keywords, in
the order --help shows them. Python 3 standard library only.
"""

import argparse
import sys

import benchlib as L
import params as P

OUT = {"help": "results parent dir (default bench/results)"}
KERNEL = {"choices": list(P.KERNELS), "default": P.KERNEL,
          "help": f"the guest kernel (default {P.KERNEL}); 6.12 has no "
                  "UBLK_F_BATCH_IO: ublkd's per-I/O path, kublk without -b"}


def flag(help):
    """A flag without a value."""
    return {"action": "store_true", "help": help}


def override(param, what=None, type=int):
    """`--x N`, which overrides `param` of params.py (`what`: what it is)."""
    return {"type": type, "help": f"override {param}" + (f" ({what})" if what else "")}


def subset(names):
    """`--x A,B`: a comma-separated subset of `names`."""
    return {"help": "comma-separated subset of " + ",".join(names)}


def run_args(prefix, quick, names_flag, names, jobs=None):
    """The flags that run_flags applies, for bench.py, nbd.py and rbd.py (whose parameters'
    names start with `prefix`): --quick (`quick` says what it runs), --rounds, --runtime,
    `names_flag` (--servers or --clients) for a subset of `names`, and --jobs (`jobs`: its
    add_argument keywords; by default a subset of the {prefix}JOBS)."""
    return {
        "--quick": flag(f"smoke check: {quick}"),
        "--rounds": override(prefix + "ROUNDS"),
        "--runtime": override(prefix + "RUNTIME_S", "seconds per fio run"),
        names_flag: subset(names),
        "--jobs": jobs or subset(getattr(P, prefix + "JOBS")),
    }


def run_flags(prm, args, prefix):
    """Applies to `prm` the flags of bench.py, nbd.py and rbd.py (whose parameters' names start
    with `prefix`) that shape their fio runs: --quick (the {prefix}QUICK set), --rounds,
    --runtime and --jobs; the job list becomes a dict, name: spec."""
    jobs = getattr(P, prefix + "JOBS")
    if args.quick:
        prm.update(getattr(P, prefix + "QUICK"))
    prm.pop(prefix + "QUICK", None)
    if isinstance(prm[prefix + "JOBS"], list):
        prm[prefix + "JOBS"] = {j: jobs[j] for j in prm[prefix + "JOBS"]}
    if args.rounds:
        prm[prefix + "ROUNDS"] = args.rounds
    if args.runtime:
        prm[prefix + "RUNTIME_S"] = args.runtime
    if args.jobs:
        prm[prefix + "JOBS"] = {j: jobs[j] for j in pick(args.jobs, jobs, "job")}
    return prm


def pick(csv, known, what):
    """The names of the comma-separated `csv`; dies (exit 2) at one not in `known`."""
    names = csv.split(",")
    for n in names:
        if n not in known:
            L.die(f"unknown {what} {n!r}; known: {', '.join(known)}", 2)
    return names


def main(prog, doc, host_args, host, guest, outputs, guest_runs):
    """Parses the command line and runs `host(args)`, `guest(args)` or, for `report`,
    benchlib.report with `outputs` = (summarize, render_table, render_plot or None).
    `host_args`: the host's flags (see above); `guest_runs`: what the guest runs of a
    plan, for --help; a command line without a command is the host's."""
    guest_help = f"(inside the VM) run the {guest_runs} of a plan"
    report_help = ("re-render the table and plot of a results dir" if outputs[2]
                   else "re-print the table of a results dir")
    ap = argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    h = sub.add_parser("host", help="build, run the VM, write the results (the default)")
    for name, kw in host_args.items():
        h.add_argument(name, **kw)
    g = sub.add_parser("guest", help=guest_help)
    g.add_argument("plan")
    r = sub.add_parser("report", help=report_help)
    r.add_argument("dir")
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("host", "guest", "report", "-h", "--help"):
        argv = ["host"] + argv
    args = ap.parse_args(argv)
    commands = {"host": host, "guest": guest,
                "report": lambda a: L.report(a, *outputs)}
    commands[args.cmd](args)
