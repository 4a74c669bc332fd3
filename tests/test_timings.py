"""Unit tests of timings.py: how a test's time is read from libtest's output."""

import os
import tempfile
import unittest

import io
import json

from timings import FileSteps, TestClock, executables, report


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


class FileStepsTest(unittest.TestCase):
    def test_each_file_of_a_boot_is_a_step_from_its_marker_to_the_next(self):
        files = FileSteps(100.0)
        self.assertIsNone(files.line("running 3 tests\n", 101.0))
        # The boot counts to the first file.
        self.assertEqual(files.line("[vm-boot] file 7 chaos\n", 108.0), ("7 chaos", None))
        self.assertEqual(
            files.line("[vm-boot] file 7 nbd (2 of its tests)\n", 150.4),
            ("7 nbd", "step\t50\tVM 7: chaos.rs\n"),
        )
        self.assertEqual(files.finish(160.0), "step\t10\tVM 7: nbd.rs (2 of its tests)\n")

    def test_no_marker_no_step(self):
        files = FileSteps(0.0)
        self.assertIsNone(files.line("test a ... ok", 1.0))
        self.assertIsNone(files.finish(2.0))


class ExecutablesTest(unittest.TestCase):
    def test_only_test_targets_with_an_executable(self):
        lines = [
            {"reason": "compiler-artifact", "target": {"name": "nbd", "kind": ["test"]},
             "executable": "/t/deps/nbd-1"},
            {"reason": "compiler-artifact", "target": {"name": "tests", "kind": ["lib"]},
             "executable": None},
            {"reason": "build-finished", "success": True},
        ]
        stream = io.StringIO("\n".join(json.dumps(m) for m in lines) + "\nnot json\n")
        self.assertEqual(executables(stream), [("nbd", "/t/deps/nbd-1")])


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

    def test_steps_run_side_by_side_sum_to_more_than_the_wall_clock_total(self):
        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write("step\t5\tVM 7: a.rs\nstep\t4\t(beside) VM 7: b.rs\nwall\t6\n")
        try:
            table = report(f.name)
        finally:
            os.unlink(f.name)
        self.assertIn("| sum of the steps | 9 |\n| **total (wall clock)** | **6** |", table)


if __name__ == "__main__":
    unittest.main()
