#!/usr/bin/env python3
"""Where run-tests' time went: each step's seconds and the slowest tests.

Two uses, both by ../run-tests:

  timings.py tee LABEL FILE     copies stdin to stdout unchanged and appends one
                                line per finished test to FILE: "test<TAB>LABEL<TAB>
                                seconds<TAB>name". libtest prints a test's result line
                                ("test NAME ... ok") when the test ends, and the VM
                                tests run one at a time (--test-threads=1), so a test
                                took the time from the previous result (or from libtest's
                                "running N tests") to its own.
                                Where several test files run in one VM boot, a line
                                "[vm-boot] file KERNEL NAME [NOTE]" starts each (the
                                boot's guest script prints it): tests are then labelled
                                "KERNEL NAME", and each file's seconds, from the marker
                                before (or the start: the boot counts to the first file)
                                to the next one (or the end), make a step line "VM
                                KERNEL: NAME.rs NOTE".
  timings.py report FILE        prints the table: every "step<TAB>seconds<TAB>name"
                                line of FILE in order, their sum, the run's own time
                                if a "wall<TAB>seconds" line gives it (steps that ran
                                side by side sum to more), then the ten slowest tests.
  timings.py executables        reads cargo's --message-format=json on stdin and prints
                                "NAME<TAB>PATH" for each test executable it built.

The file is plain text so that run-tests can append its step lines with printf.
"""

import re
import sys
import time

RUNNING = re.compile(r"^running \d+ tests?$")
# "test NAME ... ok", possibly with the result on a later line when something printed
# to the terminal between the name and the result.
RESULT = re.compile(r"^test (\S+) \.\.\. ?(.*)$")
OUTCOMES = ("ok", "FAILED", "ignored")
# A test file's start in a VM boot that runs several (run-tests' vm_boot).
FILE_MARK = re.compile(r"^\[vm-boot\] file (\S+) (\S+)(?: (.*))?$")


class TestClock:
    """Turns libtest's output lines, with the time each arrived, into test durations."""

    def __init__(self):
        self.mark = None
        self.pending = None

    def line(self, text, now):
        """The (name, seconds, outcome) of a test this line finished, else None."""
        text = text.rstrip("\r\n")
        if RUNNING.match(text):
            self.mark, self.pending = now, None
            return None
        found = RESULT.match(text)
        if found:
            self.pending = found.group(1)
            rest = found.group(2).strip()
        elif self.pending is not None:
            rest = text.strip()
        else:
            return None
        outcome = next((o for o in OUTCOMES if rest.startswith(o) or rest.endswith(o)), None)
        if outcome is None or self.mark is None:
            return None
        name, self.pending = self.pending, None
        took, self.mark = now - self.mark, now
        return name, took, outcome


class FileSteps:
    """The step lines of the test files that one VM boot runs, from their markers."""

    def __init__(self, now):
        self.started = now
        self.current = None

    def line(self, text, now):
        """(the new label, the finished file's step line or None) for a marker, else None."""
        found = FILE_MARK.match(text.rstrip("\r\n"))
        if not found:
            return None
        kernel, name, note = found.groups()
        finished = self.finish(now)
        self.current = f"VM {kernel}: {name}.rs" + (f" {note}" if note else "")
        return f"{kernel} {name}", finished

    def finish(self, now):
        """The step line of the file running until now, if any."""
        if self.current is None:
            return None
        took, self.started = now - self.started, now
        return f"step\t{round(took)}\t{self.current}\n"


def tee(label, path):
    clock = TestClock()
    files = FileSteps(time.monotonic())
    out = sys.stdout.buffer
    with open(path, "a", encoding="utf-8") as record:
        for raw in sys.stdin.buffer:
            out.write(raw)
            out.flush()
            text, now = raw.decode("utf-8", "replace"), time.monotonic()
            marked = files.line(text, now)
            if marked:
                label, finished = marked
                if finished:
                    record.write(finished)
                    record.flush()
                continue
            done = clock.line(text, now)
            if done:
                name, took, _ = done
                record.write(f"test\t{label}\t{took:.1f}\t{name}\n")
                record.flush()
        finished = files.finish(time.monotonic())
        if finished:
            record.write(finished)


def executables(stream):
    """(name, path) of each test executable in cargo's JSON messages."""
    import json

    found = []
    for line in stream:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        target = message.get("target") or {}
        if message.get("reason") == "compiler-artifact" and message.get("executable") and (
            "test" in target.get("kind", [])
        ):
            found.append((target["name"], message["executable"]))
    return found


def report(path, slowest=10):
    steps, tests, wall = [], [], None
    with open(path, encoding="utf-8") as record:
        for line in record:
            fields = line.rstrip("\n").split("\t")
            if fields[0] == "step" and len(fields) == 3:
                steps.append((int(fields[1]), fields[2]))
            elif fields[0] == "test" and len(fields) == 4:
                tests.append((float(fields[2]), fields[1], fields[3]))
            elif fields[0] == "wall" and len(fields) == 2:
                wall = int(fields[1])
    lines = ["Where the time went:", "", "| step | seconds |", "|---|---:|"]
    lines += [f"| {name} | {secs} |" for secs, name in steps]
    total = sum(s for s, _ in steps)
    if wall is None:
        lines.append(f"| **total** | **{total}** |")
    else:
        # Steps marked "(beside)" ran at the same time as others: their sum is more
        # than the time the run took.
        lines.append(f"| sum of the steps | {total} |")
        lines.append(f"| **total (wall clock)** | **{wall}** |")
    lines += ["", f"The {slowest} slowest tests:", "", "| seconds | where | test |", "|---:|---|---|"]
    for took, label, name in sorted(tests, reverse=True)[:slowest]:
        lines.append(f"| {took:.0f} | {label} | {name} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) == 4 and argv[1] == "tee":
        tee(argv[2], argv[3])
    elif len(argv) == 3 and argv[1] == "report":
        print(report(argv[2]))
    elif len(argv) == 2 and argv[1] == "executables":
        for name, path in executables(sys.stdin):
            print(f"{name}\t{path}")
    else:
        sys.exit("usage: timings.py tee LABEL FILE | timings.py report FILE | timings.py executables")


if __name__ == "__main__":
    main(sys.argv)
