"""Soft watchdog: notice a loop iteration that takes too long, and say so in the log.

Where it sits: a long-running loop shell (DetokenizerManager.event_loop, and the
scheduler's event_loop_normal, which also has a HardWatchdog) owns one `SoftWatchdog`. The loop
waits for input inside `with watchdog.disable():` (an idle process is not a stuck
one), does its work, then calls `watchdog.feed()`. A daemon thread checks every
`timeout / 2` seconds; when one iteration has been running for more than `timeout`
seconds it logs "{name} watchdog timeout" once for that iteration, with the loop's
own description of what it is working on (e.g. the rids of the current batch) and
the stack of the watched thread, so a stuck detokenizer is visible (seed 004).

"Soft" means it only logs; it never kills anything (SGLang's soft watchdog).
`HardWatchdog` is the scheduler's `--watchdog-timeout`: a forward that makes no progress
for that long is a hung process, so it logs the same line and exits with status 1; the
HTTP process sees its child die and exits non-zero instead of hanging (DESIGN.md).
With `timeout=None` the watchdog starts no thread and `feed` / `disable` cost next to
nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

logger = logging.getLogger("minisgl.watchdog")  # (its own name: a tensor-parallel rank > 0 keeps its warnings)

# How many innermost frames of the stuck thread go into the log line.
_STACK_FRAMES = 6


class SoftWatchdog:
    flag = "--soft-watchdog-timeout"  # the setting its timeout comes from, named in the report

    def __init__(
        self,
        debug_name: str,
        timeout: Optional[float],
        describe: Optional[Callable[[], str]] = None,
    ) -> None:
        """`describe()` is called from the watchdog thread at timeout; it must only read state."""
        if timeout is not None and timeout <= 0:
            raise ValueError(f"soft watchdog timeout must be > 0 seconds, got {timeout}")
        self.debug_name = debug_name
        self.timeout = timeout
        self.describe = describe
        self.num_timeouts = 0  # how many stalled iterations were reported (read by the tests)
        self._lock = threading.Lock()
        # One "iteration" = from the end of the wait (or the previous feed) to the next feed.
        self._iteration = 0
        self._iteration_start = time.monotonic()
        self._active = True
        self._reported_iteration = -1
        self._watched_thread_id = threading.get_ident()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if timeout is not None:
            self._thread = threading.Thread(target=self._watch, name=f"{debug_name}-watchdog", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ loop side
    def feed(self) -> None:
        """The loop made progress: a new iteration starts now."""
        if self._thread is None:
            return
        with self._lock:
            self._iteration += 1
            self._iteration_start = time.monotonic()

    @contextmanager
    def disable(self) -> Iterator[None]:
        """Do not count the time spent inside (blocking on a socket is idle, not stuck)."""
        if self._thread is None:
            yield
            return
        with self._lock:
            self._active = False
        try:
            yield
        finally:
            with self._lock:
                self._active = True
                self._iteration += 1
                self._iteration_start = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ watchdog thread
    def _watch(self) -> None:
        assert self.timeout is not None
        period = min(self.timeout / 2, threading.TIMEOUT_MAX)  # (a wait past TIMEOUT_MAX is an OverflowError)
        while not self._stop.wait(period):
            with self._lock:
                elapsed = time.monotonic() - self._iteration_start
                stalled = self._active and elapsed > self.timeout and self._reported_iteration != self._iteration
                if stalled:
                    self._reported_iteration = self._iteration
            if stalled:
                self._report(elapsed)

    def _report(self, elapsed: float) -> None:
        self.num_timeouts += 1
        what = self.describe() if self.describe is not None else ""
        frame = sys._current_frames().get(self._watched_thread_id)
        stack = "".join(traceback.format_stack(frame)[-_STACK_FRAMES:]) if frame is not None else "(thread gone)\n"
        logger.warning(
            f"{self.debug_name} watchdog timeout: one iteration has run {elapsed:.2f}s "
            f"(> {self.flag} {self.timeout}s); {what}\nStack of the stuck loop:\n{stack}"
        )


class HardWatchdog(SoftWatchdog):
    """Like SoftWatchdog, but a stalled iteration ends the process (exit status 1)."""

    flag = "--watchdog-timeout"

    def _report(self, elapsed: float) -> None:
        super()._report(elapsed)
        logger.error(f"{self.debug_name} watchdog: no progress for {elapsed:.2f}s, exiting")
        logging.shutdown()
        os._exit(1)
