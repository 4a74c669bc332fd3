"""Unit tests of the benchmark's arithmetic (run by ./run-tests's host unit tests):
how a ratio between two servers and its spread are made from paired rounds, and that
the tables render them."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as L  # noqa: E402


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
