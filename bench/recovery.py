#!/usr/bin/env python3
"""ublkd's recovery-stall benchmark: how long I/O stalls when the server is SIGKILLed,
ublkd (recovers by itself from a warm standby) beside kublk (`kill -9` of its daemon,
then at once `kublk recover`, as an operator's script would), in one VM boot.

Run through `bench/run recovery` (see bench/README.md). Three halves, one file:

  host    build ublkd and kublk, boot the VM, collect its records, write the results
  guest   (inside the VM) per server: a loop device, fio verifying on it, N kills
  report  re-print the table of an earlier results dir

The stall of one kill = from the kill(2) to the first I/O the device completes after
the killed process is gone (`/sys/block/ublkbN/stat`, reads + writes completed, polled
every RECOVERY_POLL_S). Python 3 standard library only; parameters in bench/params.py
(the RECOVERY_* block). The kill and the servers killed are in bench/stall.py; what
this shares with the other benchmarks (builds, the VM run) is in bench/benchlib.py
and the modules it names.
"""

import os
import re
import statistics
import subprocess
import time

import benchlib as L
import builds
import cli
import params as P
import servers as S
from benchlib import log, die, emit, stats, fms
from stall import Counter, Kublk, Ublkd

REC, META, DONE = L.markers("RECOVERY")

# ublkd and kublk-b copy every request (the comparison: kublk -b); ublkd-zc and
# kublk-b-zc are the zero-copy pair (ublkd's default for loop devices, kublk --auto_zc).
# ublkd-deferred: ublkd (copying) with `recovery.fast_release = false`, whose recovery
# waits for the kernel to tear the dead worker's rings down, as kublk's does. kublk:
# kublk without -b, the per-I/O peer on 6.12 (no UBLK_F_BATCH_IO; ublkd's per-I/O path).
# ublkd-nosandbox: ublkd's device with --no-sandbox (what the sandbox's teardown costs).
SERVERS = ("ublkd", "kublk-b", "ublkd-zc", "kublk-b-zc", "ublkd-deferred", "kublk",
           "ublkd-nosandbox")
PAIRS = (("ublkd", "kublk-b"), ("ublkd-zc", "kublk-b-zc"), ("ublkd-deferred", "kublk-b"),
         ("ublkd", "kublk"), ("ublkd-deferred", "kublk"), ("ublkd-nosandbox", "kublk"),
         ("ublkd-nosandbox", "kublk-b"))
NOTES = {"ublkd-zc": "zero copy: the dead server's ring also holds the requests' registered "
                     "pages",
         "ublkd-deferred": "recovery.fast_release = false: the kernel's teardown of the dead "
                           "worker's rings, as for kublk",
         "ublkd-nosandbox": "--no-sandbox: the worker without its namespaces, seccomp and "
                            "landlock"}


def baseline(servers):
    """ublkd's peer for the target: kublk -b where it runs (7.x), else kublk (6.12)."""
    return "kublk-b" if "kublk-b" in servers else "kublk"


# ======================================================================================
# host
# ======================================================================================

# the flags of `host` (cli.py: the shared ones)
HOST_ARGS = {
    "--kills": cli.override("RECOVERY_KILLS", "per server"),
    "--rounds": cli.override("RECOVERY_ROUNDS"),
    "--interval": cli.override("RECOVERY_INTERVAL_S", type=float),
    "--servers": cli.subset(SERVERS),
    "--out": cli.OUT,
    "--rebuild-peers": cli.flag("rebuild kublk even if cached"),
    "--kernel": cli.KERNEL,
    "--rcu-expedited": cli.flag("a diagnostic: the guest's RCU grace periods expedited "
                                "(/sys/kernel/rcu_expedited = 1), to see what they cost"),
}


def effective_params(args):
    prm = {k: getattr(P, k) for k in dir(P) if k.startswith("RECOVERY_")}
    prm["CACHE_DIR"] = P.CACHE_DIR
    prm["VM_MEM_MB"] = P.VM_MEM_MB
    if args.kills:
        prm["RECOVERY_KILLS"] = args.kills
    if args.rounds:
        prm["RECOVERY_ROUNDS"] = args.rounds
    if args.interval is not None:
        prm["RECOVERY_INTERVAL_S"] = args.interval
    if args.servers:
        prm["RECOVERY_SERVERS"] = args.servers.split(",")
    prm["RECOVERY_RCU_EXPEDITED"] = bool(getattr(args, "rcu_expedited", False))
    for s in prm["RECOVERY_SERVERS"]:
        if s not in SERVERS:
            die(f"unknown server {s!r}; known: {', '.join(SERVERS)}", 2)
    L.apply_kernel(prm, args.kernel, "RECOVERY_SERVERS", args.servers)
    if prm["RECOVERY_ROUNDS"] < 1 or prm["RECOVERY_KILLS"] < prm["RECOVERY_ROUNDS"]:
        die("need rounds >= 1 and kills >= rounds", 2)
    return prm


def estimate_s(prm):
    per_kill = prm["RECOVERY_INTERVAL_S"] + 3.0        # stall + status queries, TCG
    per_series = 2 * prm["RECOVERY_FIO_SETTLE_S"] + 12  # add, fio start-up, del
    return (len(prm["RECOVERY_SERVERS"]) * (prm["RECOVERY_KILLS"] * per_kill
            + prm["RECOVERY_ROUNDS"] * per_series) + 30)


def host(args):
    L.need_root()
    prm = effective_params(args)
    hr = L.HostRun(args, prm["CACHE_DIR"], "recovery.py", (REC, META, DONE), prefix="recovery-")
    if any(s.startswith("kublk") for s in prm["RECOVERY_SERVERS"]):
        if not hr.build_peer("kublk", builds.build_kublk, args.rebuild_peers):
            prm["RECOVERY_SERVERS"] = [s for s in prm["RECOVERY_SERVERS"]
                                       if not s.startswith("kublk")]

    est = estimate_s(prm)
    what = (f"{prm['RECOVERY_KILLS']} kills x {len(prm['RECOVERY_SERVERS'])} servers in "
            f"{prm['RECOVERY_ROUNDS']} rounds, ")
    hr.run_and_finish(prm, what, est, int(2 * est + 180), prm["VM_MEM_MB"],
                      (summarize, table, None), "records it got", "kills or series")


# ======================================================================================
# summary and table
# ======================================================================================

# the table's column heads
HEAD = (f"{'server':<10} {'kills':>5}  {'stall ms: min':>13} {'median':>7} {'max':>7}   "
        f"{'death ms':>8}  {'ublkd last_recovery_ms':>22}  {'kublk recover':>14}  "
        f"{'fio (exit 0, 0 errors)':<24}")


def summarize(results):
    prm, recs = results["params"], results["records"]
    out = {}
    stalls = {}
    for srv in prm["RECOVERY_SERVERS"]:
        kills = [r for r in recs if r.get("kind") == "kill" and r["server"] == srv]
        ok = [r for r in kills if not r.get("error")]
        stalls[srv] = [r["stall_ms"] for r in ok]
        series = [r for r in recs if r.get("kind") == "series" and r["server"] == srv]
        out[srv] = {
            "kills": len(ok), "failed_kills": len(kills) - len(ok),
            "stall_ms": stats([r["stall_ms"] for r in ok]),
            "death_ms": stats([r.get("death_ms") for r in ok]),
            "poll_ms": stats([r.get("poll_ms") for r in ok]),
            "last_recovery_ms": stats([r.get("last_recovery_ms") for r in ok]),
            "recover_cmd_ms": stats([r.get("recover_cmd_ms") for r in ok]),
            "recover_attempts": stats([r.get("recover_attempts") for r in ok]),
            # ublkd's own phases, and what is left of the stall after them: the worker's
            # death, noticing it, and the first I/O after LIVE
            **{k: stats([r.get(k) for r in ok])
               for k in ("detect_ms", "release_ms", "activate_ms", "map_ms", "prep_ms",
                         "end_ms", "rest_ms")},
            "series": len(series),
            "series_ok": sum(1 for r in series if not r.get("error")),
            "fio_ios": sum(r.get("fio_ios", 0) for r in series),
        }
    base = baseline(prm["RECOVERY_SERVERS"])
    for ours, theirs in PAIRS:
        u, k = out.get(ours), out.get(theirs)
        if u and k and u["stall_ms"] and k["stall_ms"] and k["stall_ms"]["median"]:
            r = u["stall_ms"]["median"] / k["stall_ms"]["median"]
            # The spread of that ratio: the two servers' kills resampled on their own;
            # "resolved" where the interval leaves out the target.
            spread = L.median_ratio(stalls[ours], stalls[theirs], prm["RECOVERY_TARGET_RATIO"])
            if ours == "ublkd" and theirs == base:
                out["ratio_ublkd_kublk"] = r
                out["ratio_ublkd_kublk_spread"] = spread
                out["target_met"] = r <= prm["RECOVERY_TARGET_RATIO"]
            elif ours != "ublkd":
                out[f"ratio_{ours}_{theirs}"] = r
                out[f"ratio_{ours}_{theirs}_spread"] = spread
    return out


def spread_note(r):
    """` [0.52-0.71]`, the ratio's bootstrap interval, and `, not resolved` where it
    holds the target."""
    if not r:
        return ""
    return f" [{r['lo']:.3f}-{r['hi']:.3f}{'' if r['resolved'] else ', not resolved'}]"


def table(results):
    prm, summ = results["params"], results["summary"]
    lines = L.ruled(HEAD)
    for srv in prm["RECOVERY_SERVERS"]:
        s = summ[srv]
        st = s["stall_ms"]
        fails = f" ({s['failed_kills']} failed)" if s["failed_kills"] else ""
        lr = fms(s["last_recovery_ms"]["median"]) + " (median)" if s["last_recovery_ms"] else "-"
        rc = "-"
        if s["recover_cmd_ms"]:
            rc = (f"{fms(s['recover_cmd_ms']['median'])} ms, "
                  f"{s['recover_attempts']['max']:.0f}x max")
        fio = f"{s['series_ok']}/{s['series']} series ok, {s['fio_ios']} I/Os"
        if not st:
            lines.append(f"{srv:<10} {s['kills']:>5}  no successful kill{fails}   {fio}")
            continue
        death = fms(s["death_ms"]["median"]) if s["death_ms"] else "-"
        lines.append(f"{srv:<10} {s['kills']:>5}  {fms(st['min']):>13} {fms(st['median']):>7} "
                     f"{fms(st['max']):>7}   {death:>8}  {lr:>22}  {rc:>14}  {fio}{fails}")
    for name in ("ublkd", "ublkd-zc", "ublkd-deferred", "ublkd-nosandbox"):
        u = summ.get(name)
        if not (u and u.get("release_ms") and u["stall_ms"]):
            continue
        lines.append(
            f"{name}'s stall by phase, medians in ms: death (kill -> pidfd readable) "
            f"{fms(u['death_ms']['median'])}, detect (pidfd readable -> recovery starts) "
            f"{fms(u['detect_ms']['median'])}, release (START_USER_RECOVERY's EBUSY) "
            f"{fms(u['release_ms']['median'])}, activate (Activate -> Ready) "
            f"{fms(u['activate_ms']['median'])} (of which the worker's map "
            f"{fms(u['map_ms']['median'])} and prep {fms(u['prep_ms']['median'])}), end "
            f"(END_USER_RECOVERY) {fms(u['end_ms']['median'])}; the rest (waking ublkd, the "
            f"first I/O after LIVE) {fms(u['rest_ms']['median'])}.")
    lines.append("")
    if "ratio_ublkd_kublk" in summ:
        r = summ["ratio_ublkd_kublk"]
        lines.append(f"median stall ublkd / {baseline(prm['RECOVERY_SERVERS'])} = {r:.3f}"
                     f"{spread_note(summ.get('ratio_ublkd_kublk_spread'))}  "
                     f"(target <= {prm['RECOVERY_TARGET_RATIO']}: "
                     f"{'met' if summ['target_met'] else 'NOT met'})")
    for ours, theirs in PAIRS:
        # (ublkd's own pair is the line above: its key, ratio_ublkd_kublk, is the same)
        if ours != "ublkd" and f"ratio_{ours}_{theirs}" in summ:
            lines.append(f"median stall {ours} / {theirs} = "
                         f"{summ[f'ratio_{ours}_{theirs}']:.3f}"
                         f"{spread_note(summ.get(f'ratio_{ours}_{theirs}_spread'))}  "
                         f"({NOTES[ours]})")
    if len(lines) and lines[-1]:
        lines.append("")
    m = results["meta"]
    polls = [summ[s]["poll_ms"]["median"] for s in prm["RECOVERY_SERVERS"]
             if summ[s]["poll_ms"]]
    lines.append(
        f"{prm['RECOVERY_KILLS']} kills per server in {prm['RECOVERY_ROUNDS']} rounds, "
        f"~{prm['RECOVERY_INTERVAL_S']} s after each recovery; loop device on a "
        f"{prm['RECOVERY_LOOP_FILE_MB']} MiB tmpfs file, -q 1 -d 128; fio randrw 4k qd32 "
        f"direct io_uring, verify=crc32c verify_fatal=1; kernel {m.get('kernel', '?')}, "
        f"{m.get('cpus', '?')} vCPU ({m.get('accel', 'VM')}); ublkd "
        f"{results['versions'].get('ublkd', '?')}.")
    lines.append("stall = kill(2) -> first I/O completed (/sys/block/ublkbN/stat reads+writes) "
                 "after the killed process is gone; death = kill(2) -> its pidfd readable; "
                 "stat polled every ~"
                 + (f"{statistics.median(polls):.2f}" if polls else "?") + " ms.")
    lines.append("ublkd: kill -9 of the device's worker, ublkd recovers by itself (warm "
                 "standby); last_recovery_ms = its own death-detected -> LIVE figure.")
    lines.append("kublk-b: kublk add -t loop -b -r 1 -i 1 (kublk: the same without -b); kill -9 "
                 "of its daemon, then at once `kublk recover -n ID` with the add's arguments, "
                 "re-run until it succeeds (recover: kill -> the successful command's exit; "
                 "Nx = attempts).")
    if prm.get("RECOVERY_RCU_EXPEDITED"):
        lines.append("DIAGNOSTIC: the guest's RCU grace periods were expedited "
                     "(--rcu-expedited: /sys/kernel/rcu_expedited = 1).")
    lines += L.footer(results)
    errs = [r for r in results["records"] if r.get("error")]
    for r in errs[:10]:
        what = f"kill {r['kill']}" if r.get("kind") == "kill" else f"series {r.get('round')}"
        lines.append(f"FAILED {r['server']} {what}: {r['error'][:300]}")
    return "\n".join(lines)


# ======================================================================================
# guest: the series
# ======================================================================================

FIO_STOP = "/tmp/ublkd-bench-fio-stop"


def fio_cmd(dev, prm, runtime):
    # Stopped by creating FIO_STOP (--trigger-file): fio then ends its jobs and exits 0
    # (SIGINT would make it exit 128). --runtime is only a safety cap.
    return ["fio", "--name=recovery", f"--filename=/dev/{dev}", "--rw=randrw", "--bs=4k",
            "--ioengine=io_uring", "--direct=1", "--iodepth=32", "--verify=crc32c",
            "--verify_fatal=1", f"--verify_backlog={prm['RECOVERY_VERIFY_BACKLOG']}",
            "--verify_state_save=0", "--time_based", f"--runtime={runtime}",
            f"--trigger-file={FIO_STOP}", "--output-format=json"]


def fio_check(rc, out, err):
    """fio's result: raises unless it exited 0 with no error; returns its I/O counts."""
    tail = " | ".join((err or "").strip().splitlines()[-4:])
    if rc != 0:
        raise RuntimeError(f"fio exited {rc}: {tail}")
    try:
        jb = L.fio_job(out)
    except ValueError:
        raise RuntimeError(f"fio printed no json: {tail} {out[:200]}")
    if jb.get("error"):
        raise RuntimeError(f"fio job error {jb['error']}: {tail}")
    bad = [ln for ln in (err or "").splitlines()
           if re.search(r"verify|io_u error|error=", ln, re.I)]
    if bad:
        raise RuntimeError(f"fio reported: {' | '.join(bad[:4])}")
    r, w = jb["read"]["total_ios"], jb["write"]["total_ios"]
    if not r or not w:
        raise RuntimeError(f"fio did {r} reads and {w} writes")
    return {"fio_reads": r, "fio_writes": w, "fio_ios": r + w,
            "fio_runtime_ms": jb.get("job_runtime")}


def run_series(sname, plan, rnd, nkills, first_kill, total):
    prm = plan["params"]
    zc = sname.endswith("-zc")
    srv = (Ublkd(plan, zc, fast_release=sname != "ublkd-deferred",
                 sandbox=sname != "ublkd-nosandbox") if sname.startswith("ublkd")
           else Kublk(plan, zc, batch=sname.startswith("kublk-b")))
    tag = f"round {rnd}/{prm['RECOVERY_ROUNDS']} {sname:<8}"
    series = {"kind": "series", "server": sname, "round": rnd}
    dev_id = fio = ctr = None
    ok = 0
    try:
        srv.start()
        dev_id = srv.add()
        dev = L.wait_dev(dev_id)
        srv.ready(dev_id)
        ctr = Counter(dev)
        runtime = int(nkills * (prm["RECOVERY_INTERVAL_S"] + 30) + 120)
        c_start = ctr.read()
        if os.path.exists(FIO_STOP):
            os.unlink(FIO_STOP)
        fio = subprocess.Popen(fio_cmd(dev, prm, runtime), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd="/tmp")
        end = time.monotonic() + 120
        while ctr.read() == c_start:
            if fio.poll() is not None or time.monotonic() > end:
                raise RuntimeError("fio did no I/O on the device")
            time.sleep(0.02)
        time.sleep(prm["RECOVERY_FIO_SETTLE_S"])
        log(f"{tag} /dev/{dev}: fio verifying, {nkills} kills")
        for i in range(nkills):
            k = first_kill + i
            rec = {"kind": "kill", "server": sname, "round": rnd, "kill": k + 1}
            if fio.poll() is not None:
                raise RuntimeError(f"fio ended before kill {k + 1} (exit {fio.returncode})")
            try:
                rec.update(srv.kill_once(dev_id, ctr))
            except Exception as e:
                rec["error"] = str(e)
            emit(REC, rec)
            if rec.get("error"):
                log(f"{sname:<8} kill {k + 1}/{total}: FAILED: {rec['error'][:300]}")
                raise RuntimeError(f"kill {k + 1} failed; the series stops")
            ok += 1
            extra = (f"ublkd last_recovery {rec['last_recovery_ms']} ms"
                     if sname.startswith("ublkd") else
                     f"recover ok after {rec['recover_cmd_ms']:.0f} ms, "
                     f"{rec['recover_attempts']} attempt(s)")
            log(f"{sname:<8} kill {k + 1}/{total}: pid {rec['pid']} -> {rec['new_pid']}, "
                f"stall {rec['stall_ms']:.0f} ms (dead after {rec['death_ms']:.0f} ms), "
                f"{extra}")
            time.sleep(prm["RECOVERY_INTERVAL_S"])
        time.sleep(prm["RECOVERY_FIO_SETTLE_S"])
        if fio.poll() is not None:
            raise RuntimeError(f"fio ended early (exit {fio.returncode})")
        open(FIO_STOP, "w").close()
        out, err = fio.communicate(timeout=120)
        series.update(fio_check(fio.returncode, out, err))
        log(f"{tag} fio: exit 0, no errors, {series['fio_reads']} reads + "
            f"{series['fio_writes']} writes verified with crc32c")
    except Exception as e:
        series["error"] = str(e)
        log(f"{tag} FAILED: {e}")
        if fio and fio.poll() is None:
            fio.kill()
            fio.wait()
    series["kills_ok"] = ok
    if ctr:
        ctr.close()
    if dev_id is not None:
        try:
            srv.delete(dev_id)
        except Exception as e:
            log(f"{tag} delete failed: {e}")
    S.stop(srv, tag)
    probs = srv.log_problems()
    if probs:
        series["server_log_problems"] = probs[0]
        log(f"{tag} ublkd logged {probs[0]} warnings/errors (besides the kills) so far; "
            f"the last: {probs[1]}")
    emit(REC, series)
    return ok


def guest(args):
    plan, prm, t_start, meta = L.guest_start(args)
    emit(META, meta)
    L.check_kernel(prm)
    if prm.get("RECOVERY_RCU_EXPEDITED"):
        with open("/sys/kernel/rcu_expedited", "w") as f:
            f.write("1")
        log("RCU grace periods expedited (/sys/kernel/rcu_expedited = 1): a diagnostic")
    log(f"creating the loop file {prm['RECOVERY_LOOP_FILE']} "
        f"({prm['RECOVERY_LOOP_FILE_MB']} MiB, tmpfs)")
    L.zero_file(prm["RECOVERY_LOOP_FILE"], prm["RECOVERY_LOOP_FILE_MB"])
    servers, rounds, total = prm["RECOVERY_SERVERS"], prm["RECOVERY_ROUNDS"], prm["RECOVERY_KILLS"]
    done = {s: 0 for s in servers}
    for rnd in range(rounds):
        for sname in L.rotated(servers, rnd):
            n = total * (rnd + 1) // rounds - total * rnd // rounds
            run_series(sname, plan, rnd + 1, n, done[sname], total)
            done[sname] += n
    log(f"done in {time.monotonic() - t_start:.0f} s in the VM")
    print(DONE, flush=True)


if __name__ == "__main__":
    cli.main("bench/run recovery", __doc__, HOST_ARGS, host, guest, (summarize, table, None),
             "series")
