"""Unit tests of timings.py: how a test's time is read from libtest's output."""

import os
import tempfile
import unittest

from timings import TestClock, report


class TestClockTest(unittest.TestCase):
    def test_a_test_took_the_time_since_the_previous_result(self):
        clock = TestClock()
        self.assertIsNone(clock.line("running 2 tests\n", 10.0))
        self.assertEqual(clock.line("test a ... ok\n", 13.5), ("a", 3.5, "ok"))
        self.assertEqual(clock.line("test b ... FAILED\n", 20.0), ("b", 6.5, "FAILED"))

    def test_a_result_after_interleaved_output_still_counts(self):
        clock = TestClock()
        clock.line("running 1 test", 0.0)
        self.assertIsNone(clock.line("test slow ... [vm] a line from a child", 1.0))
        self.assertIsNone(clock.line("more output", 2.0))
        self.assertEqual(clock.line("ok", 4.0), ("slow", 4.0, "ok"))

    def test_lines_before_running_and_summaries_are_not_tests(self):
        clock = TestClock()
        self.assertIsNone(clock.line("test result: ok. 3 passed; 0 failed", 1.0))
        self.assertIsNone(clock.line("test early ... ok", 2.0))


class ReportTest(unittest.TestCase):
    def test_steps_in_order_their_total_and_the_slowest_tests_first(self):
        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write("step\t5\tbuild\nstep\t7\tVM 7.x: a.rs\n")
            f.write("test\t7.x a\t1.0\tquick\ntest\t7.x a\t6.0\tslow\n")
        try:
            table = report(f.name, slowest=1)
        finally:
            os.unlink(f.name)
        self.assertIn("| build | 5 |\n| VM 7.x: a.rs | 7 |\n| **total** | **12** |", table)
        self.assertIn("| 6 | 7.x a | slow |", table)
        self.assertNotIn("quick", table)


if __name__ == "__main__":
    unittest.main()
