"""The hard watchdog ends the process when a loop iteration hangs (the soft one, which only
logs, is tested with the detokenizer in test_detokenizer.py).

The hard watchdog is the scheduler's --watchdog-timeout: a hung forward must turn into
a dead child (which makes the server exit non-zero), never a server that hangs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time


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
    assert "(> --watchdog-timeout 0.2s)" in proc.stderr  # its own flag (it named the soft one)
    assert "still alive" not in proc.stdout


def test_a_timeout_past_what_a_thread_can_wait_still_watches() -> None:
    """--watchdog-timeout 1e11 ("never") passed the checks, then every watchdog thread died
    with OverflowError: timestamp out of range for platform time_t."""
    import threading

    from minisgl.managers.watchdog import SoftWatchdog

    errors: list = []
    previous, threading.excepthook = threading.excepthook, lambda args: errors.append(args.exc_value)
    try:
        dog = SoftWatchdog("test", timeout=1e11, describe=lambda: "")
        time.sleep(0.3)
        assert dog._thread is not None and dog._thread.is_alive() and errors == []
        dog.stop()
    finally:
        threading.excepthook = previous
