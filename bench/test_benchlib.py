"""Unit tests of the benchmark's arithmetic (run by ./run-tests's host unit tests):
how a ratio between two servers and its spread are made from paired rounds, and that
the tables render them."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as L  # noqa: E402
import qd1trace as Q  # noqa: E402


def runs(server, values, metric="iops"):
    return [{"round": i + 1, "server": server, "job": "j", metric: v}
            for i, v in enumerate(values)]


class PairedRatio(unittest.TestCase):
    def test_each_round_is_compared_with_the_same_round(self):
        # Both servers got slower in round 3 (a busy host): paired, the ratio stays 2.
        r = L.paired_ratio(runs("u", [200, 220, 100, 210, 190]),
                           runs("b", [100, 110, 50, 105, 95]), "iops")
        self.assertAlmostEqual(r["median"], 2.0)
        self.assertAlmostEqual(r["lo"], 2.0)
        self.assertAlmostEqual(r["hi"], 2.0)
        self.assertEqual(r["n"], 5)
        self.assertTrue(r["resolved"])

    def test_an_interval_that_holds_one_is_not_resolved(self):
        r = L.paired_ratio(runs("u", [90, 120, 100, 95, 110]),
                           runs("b", [100, 100, 100, 100, 100]), "iops")
        self.assertLessEqual(r["lo"], 1.0)
        self.assertGreaterEqual(r["hi"], 1.0)
        self.assertFalse(r["resolved"])
        self.assertTrue(L.fmt_ratio(r).endswith("not resolved"), L.fmt_ratio(r))

    def test_the_interval_holds_the_median_and_is_the_same_each_time(self):
        u, b = runs("u", [130, 118, 125, 140, 121, 119]), runs("b", [100] * 6)
        r = L.paired_ratio(u, b, "iops")
        self.assertLessEqual(r["lo"], r["median"])
        self.assertLessEqual(r["median"], r["hi"])
        self.assertEqual(r, L.paired_ratio(u, b, "iops"))
        self.assertTrue(r["resolved"])
        self.assertEqual(L.fmt_ratio(r), f"x{r['median']:.2f} [{r['lo']:.2f}-{r['hi']:.2f}, n=6]")

    def test_rounds_missing_a_side_or_a_value_are_left_out(self):
        u = runs("u", [200, 300, None])
        b = runs("b", [100, 0])  # round 2's zero cannot divide; round 3 has no b run
        r = L.paired_ratio(u, b, "iops")
        self.assertEqual(r["n"], 1)
        self.assertFalse(r["resolved"], "one round resolves nothing")
        self.assertIsNone(L.paired_ratio(u, [], "iops"))
        self.assertEqual(L.fmt_ratio(None), "-")


class MedianRatio(unittest.TestCase):
    def test_clearly_apart_samples_resolve_against_the_target(self):
        ours = [140, 150, 147, 160, 130, 155, 149, 145]
        theirs = [240, 250, 230, 260, 245, 235, 238, 242]
        r = L.median_ratio(ours, theirs, 0.35)
        self.assertAlmostEqual(r["median"], 148 / 241, places=3)
        self.assertLessEqual(r["lo"], r["median"])
        self.assertGreaterEqual(r["hi"], r["median"])
        self.assertTrue(r["resolved"], "well above 0.35 whatever the resampling")
        self.assertEqual(r, L.median_ratio(ours, theirs, 0.35), "the same each time")

    def test_a_target_inside_the_interval_is_not_resolved(self):
        ours = [50, 300, 60, 280, 70, 250]
        theirs = [200, 210, 190, 205]
        r = L.median_ratio(ours, theirs, 0.8)
        self.assertLess(r["lo"], 0.8)
        self.assertGreater(r["hi"], 0.8)
        self.assertFalse(r["resolved"])

    def test_an_empty_side_has_no_ratio(self):
        self.assertIsNone(L.median_ratio([], [1, 2], 0.35))
        self.assertIsNone(L.median_ratio([1, None], [None], 0.35))


if __name__ == "__main__":
    unittest.main()


class Qd1Trace(unittest.TestCase):
    """bench/qd1trace.py: a request's path is what lies between two issues."""

    TRACE = """# tracer: nop
             fio-10    [000] .....     1.000000: block_rq_issue: 259,0 R 4096 () 8 + 8 be,0,4 [fio]
             fio-10    [000] .....     1.000010: sched_wakeup: comm=ublkd-worker pid=20 prio=120 target_cpu=000
             fio-10    [000] .....     1.000020: sched_switch: prev_comm=fio prev_pid=10 prev_prio=120 prev_state=S ==> next_comm=ublkd-worker next_pid=20 next_prio=120
    ublkd-worker-20    [000] .....     1.000030: sys_exit: NR 426 = 1
    ublkd-worker-20    [000] .....     1.000040: sys_enter: NR 426 (4, 1, 1, 1, 0, 80)
    ublkd-worker-20    [000] .....     1.000045: sys_enter: NR 426 (4, 1, 1, 1, 0, 80)
             fio-10    [000] .....     1.000100: block_rq_issue: 259,0 R 4096 () 16 + 8 be,0,4 [fio]
             fio-10    [000] .....     1.000130: sched_switch: prev_comm=fio prev_pid=10 prev_prio=120 prev_state=S ==> next_comm=ublkd-worker next_pid=20 next_prio=120
    ublkd-worker-20    [000] .....     1.000150: sys_enter: NR 426 (4, 1, 1, 1, 0, 80)
             fio-10    [000] .....     1.000200: block_rq_issue: 259,0 R 4096 () 24 + 8 be,0,4 [fio]
             fio-10    [000] .....     1.000210: block_rq_issue: 259,1 R 4096 () 24 + 8 be,0,4 [fio]
             fio-10    [000] .....     1.000300: block_rq_issue: 259,0 R 4096 () 32 + 8 be,0,4 [fio]
""".splitlines()

    def test_first_occurrences_per_request_and_their_medians(self):
        rows, n = Q.timeline(Q.parse(self.TRACE), "259,0", skip=0, min_share=0.5)
        # Three requests on 259,0 after the last is dropped: 0-100, 100-200 (200-300
        # is the last); the other device's issue is not a request boundary.
        self.assertEqual(n, 2)
        got = {k: (round(med), share) for med, share, k in rows}
        self.assertEqual(got["switch to ublkd-worker"], (25, 1.0))
        # Entered twice in the first request: only its first time counts.
        self.assertEqual(got["ublkd-worker enters io_uring_enter"], (45, 1.0))
        self.assertEqual(got["next request issued"], (100, 1.0))
        # The wake-up happened in one request of two: kept at min_share 0.5.
        self.assertEqual(got["wake-up of ublkd-worker"], (10, 0.5))
        self.assertEqual([k for _, _, k in rows][0], "fio block_rq_issue")

    def test_a_trace_without_requests_gives_no_timeline(self):
        self.assertEqual(Q.timeline(Q.parse(self.TRACE), "8,0"), ([], 0))
