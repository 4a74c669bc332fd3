"""One request's path at queue depth 1, read from an ftrace log (`bench/trace-qd1`).

At qd 1 requests follow each other: everything between fio's `block_rq_issue` of one
request and of the next is that request's path (the server's wake-up, its system
calls and ring operations, the peer's, the completion and fio's own turn). For every
kind of event (a switch to a task, a system call's entry or exit by a task, a ring
operation, a block event) this takes the first time it happens after each issue, and
prints the median of those offsets over all requests, in order: a timeline that two
clients' runs can be read against. Events seen in under half the requests (the host's
own housekeeping) are left out. One whole request is printed as a sample."""

import collections
import re
import statistics
import sys

LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+):\s+(\w+):\s*(.*)$")

# x86-64 system call numbers the timeline names (the rest print as "syscall N").
SYSCALLS = {0: "read", 1: "write", 44: "sendto", 45: "recvfrom", 46: "sendmsg",
            47: "recvmsg", 202: "futex", 228: "clock_gettime", 426: "io_uring_enter"}


def parse(lines):
    """Events as (time µs, comm, pid, cpu, name, rest)."""
    out = []
    for line in lines:
        m = LINE.match(line)
        if m:
            comm, pid, cpu, ts, name, rest = m.groups()
            out.append((float(ts) * 1e6, comm, int(pid), int(cpu), name, rest))
    return out


def kind(event):
    """What an event is, without the details that change from request to request."""
    _, comm, _, _, name, rest = event
    if name == "sched_switch":
        m = re.search(r"next_comm=(\S+)", rest)
        return f"switch to {m.group(1) if m else '?'}"
    if name == "sched_wakeup":
        m = re.search(r"comm=(\S+)", rest)
        return f"wake-up of {m.group(1) if m else '?'}"
    if name in ("sys_enter", "sys_exit"):
        m = re.search(r"NR (\d+)", rest)
        nr = int(m.group(1)) if m else -1
        call = SYSCALLS.get(nr, f"syscall {nr}")
        return f"{comm} {'enters' if name == 'sys_enter' else 'leaves'} {call}"
    if name == "io_uring_submit_req":
        m = re.search(r"opcode (\w+)", rest)
        return f"{comm} ring: {m.group(1) if m else '?'} issued"
    if name == "io_uring_complete":
        return f"{comm} ring: completion posted"
    if name == "io_uring_task_add":
        m = re.search(r"opcode (\w+)", rest)
        return f"{comm} ring: task work for {m.group(1) if m else '?'}"
    return f"{comm} {name}"


def issues(events, device):
    """Indexes of fio's block_rq_issue events on `device` ("MAJOR,MINOR")."""
    return [i for i, e in enumerate(events)
            if e[4] == "block_rq_issue" and e[5].startswith(device + " ")]


def timeline(events, device, skip=2, min_share=0.5):
    """[(median µs after the issue, share of requests, kind)], in time order, and the
    number of requests it was taken over; the first `skip` and the last request are
    left out (tracing began and ended inside them)."""
    idx = issues(events, device)
    spans = list(zip(idx, idx[1:]))[skip:-1] if len(idx) > skip + 2 else []
    offsets = collections.defaultdict(list)
    for start, end in spans:
        t0 = events[start][0]
        seen = set()
        for e in events[start:end]:
            k = kind(e)
            if k not in seen:
                seen.add(k)
                offsets[k].append(e[0] - t0)
        offsets["next request issued"].append(events[end][0] - t0)
    rows = [(statistics.median(v), len(v) / len(spans), k)
            for k, v in offsets.items() if spans and len(v) >= min_share * len(spans)]
    return sorted(rows), len(spans)


def sample(events, device, n=10):
    """The events of the n-th request, from its issue to the next one's."""
    idx = issues(events, device)
    if len(idx) < n + 2:
        return []
    t0 = events[idx[n]][0]
    return [(e[0] - t0, e[3], e[1], e[2], e[4], e[5]) for e in events[idx[n]:idx[n + 1] + 1]]


def main(path, device, label):
    with open(path) as f:
        events = parse(f)
    rows, n = timeline(events, device)
    print(f"{label}: {n} requests traced on {device}; median µs after the issue, share of requests:")
    if not rows:
        print("  (no requests in the trace: did fio start before tracing did?)")
        return
    for med, share, k in rows:
        print(f"  {med:8.1f}  {share:4.2f}  {k}")
    print(f"{label}: one request, every event:")
    for off, cpu, comm, pid, name, rest in sample(events, device):
        print(f"  {off:8.1f} [{cpu}] {comm[:14]:>14}-{pid:<5} {name}: {rest[:100]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
