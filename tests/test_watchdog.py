"""Watchdogs: the soft one logs a stalled loop iteration, the hard one ends the process.

The hard watchdog is the scheduler's --watchdog-timeout: a hung forward must turn into
a dead child (which makes the server exit non-zero), never a server that hangs.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import pytest

from minisgl.managers.watchdog import SoftWatchdog


def test_soft_watchdog_logs_a_stalled_iteration_once_and_not_idle_time(caplog: pytest.LogCaptureFixture) -> None:
    wd = SoftWatchdog("Loop", 0.1, describe=lambda: "working on rid-7")
    try:
        with caplog.at_level(logging.WARNING, logger="minisgl"):
            with wd.disable():
                time.sleep(0.4)  # waiting for input is not a stall
            assert wd.num_timeouts == 0
            time.sleep(0.45)  # one slow iteration
            wd.feed()
        assert wd.num_timeouts == 1
        assert "Loop watchdog timeout" in caplog.text and "working on rid-7" in caplog.text
    finally:
        wd.stop()


def test_hard_watchdog_exits_the_process_when_an_iteration_hangs() -> None:
    code = textwrap.dedent(
        """
        import logging, time
        from minisgl.managers.watchdog import HardWatchdog
        logging.basicConfig(level=logging.INFO)
        wd = HardWatchdog("Scheduler", 0.2, describe=lambda: "rids: [hung]")
        for _ in range(3):      # healthy iterations
            time.sleep(0.05)
            wd.feed()
        time.sleep(30)          # a hung forward
        print("still alive")
        """
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 1
    assert time.monotonic() - start < 10
    assert "Scheduler watchdog timeout" in proc.stderr and "rids: [hung]" in proc.stderr
    assert "still alive" not in proc.stdout
