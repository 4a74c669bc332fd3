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
  timings.py report FILE        prints the table: every "step<TAB>seconds<TAB>name"
                                line of FILE in order, then the ten slowest tests.

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


def tee(label, path):
    clock = TestClock()
    out = sys.stdout.buffer
    with open(path, "a", encoding="utf-8") as record:
        for raw in sys.stdin.buffer:
            out.write(raw)
            out.flush()
            done = clock.line(raw.decode("utf-8", "replace"), time.monotonic())
            if done:
                name, took, _ = done
                record.write(f"test\t{label}\t{took:.1f}\t{name}\n")
                record.flush()


def report(path, slowest=10):
    steps, tests = [], []
    with open(path, encoding="utf-8") as record:
        for line in record:
            fields = line.rstrip("\n").split("\t")
            if fields[0] == "step" and len(fields) == 3:
                steps.append((int(fields[1]), fields[2]))
            elif fields[0] == "test" and len(fields) == 4:
                tests.append((float(fields[2]), fields[1], fields[3]))
    lines = ["Where the time went:", "", "| step | seconds |", "|---|---:|"]
    lines += [f"| {name} | {secs} |" for secs, name in steps]
    lines.append(f"| **total** | **{sum(s for s, _ in steps)}** |")
    lines += ["", f"The {slowest} slowest tests:", "", "| seconds | where | test |", "|---:|---|---|"]
    for took, label, name in sorted(tests, reverse=True)[:slowest]:
        lines.append(f"| {took:.0f} | {label} | {name} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) == 4 and argv[1] == "tee":
        tee(argv[2], argv[3])
    elif len(argv) == 3 and argv[1] == "report":
        print(report(argv[2]))
    else:
        sys.exit("usage: timings.py tee LABEL FILE | timings.py report FILE")


if __name__ == "__main__":
    main(sys.argv)
