"""Tensor parallelism, a rank's process (--tp-size N): what a scheduler rank sets up before it
schedules, on rank 0 and on the others alike.

Where it sits: the entry of each scheduler process. In: ServerArgs, the rank, the rendezvous
store's path, the pipe to the launcher (the server's http_server, or an Engine's EngineTpRanks).
Out: a rank ready to follow rank 0 (scheduler.run_tp_follower_process, then tp_lockstep.follower_loop),
or one message on the pipe saying why it could not start. Owns nothing after start-up.

What is the same on every rank is set the same way here: its share of the CPU threads
(set_threads_per_rank), the float32 matmul switches an Engine's rank 0 has from its caller
(torch_math_settings), and what it reports when its start fails (start_up_reported: the
message and the time, so the launcher can tell a rank's own failure from the echo it causes
on the others). Ranks > 0 log only the warnings that are their own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from typing import Any, Dict, Iterator, Optional

from minisgl.managers.tp_lockstep import threads_per_rank

logger = logging.getLogger("minisgl.scheduler")


@contextlib.contextmanager
def start_up_reported(pipe_writer: Any, name: str) -> Iterator[None]:
    """A scheduler rank's start-up (`name`: "Scheduler", "Scheduler TP1"): an error is logged,
    said on its pipe with the time it happened, and the process exits 1. With --tp-size N a rank
    that fails makes the others fail after it (their collective breaks): the launcher reports
    the failure that came first (http_server._wait_ready, EngineTpRanks.raise_rank_failure)."""
    try:
        yield
    except Exception as e:
        if isinstance(e, ValueError):  # a setting or a model minisgl refuses: the message says what to change
            logger.error("%s failed to start: %s", name, e)
        else:
            logger.exception("%s failed to start", name)
        with contextlib.suppress(OSError):  # (the parent is gone: nobody to tell)
            pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}", "failed_at": time.time()})
        sys.exit(1)


def set_threads_per_rank(tp_size: int, threads: Optional[int] = None, note: str = "") -> int:
    """This rank's torch CPU threads: `threads`, or threads_per_rank(its current count); set and
    logged (`note` ends the line). Returns the count."""
    import torch

    n = threads if threads is not None else threads_per_rank(torch.get_num_threads(), tp_size)
    torch.set_num_threads(n)
    logging.getLogger("minisgl").info("tp_size=%d: %d CPU thread(s) per rank%s", tp_size, n, note)
    return n


# torch's float32 switches: the legacy ones (None where torch refuses to read one, after the new API
# was used), then the new API's per-backend and per-op precisions (torch >= 2.9), the general first
_LEGACY_MATH = {
    "float32_matmul_precision": ("", "float32_matmul_precision"),
    "cuda.matmul.allow_tf32": ("cuda.matmul", "allow_tf32"),
    "cudnn.allow_tf32": ("cudnn", "allow_tf32"),
}
_FP32_PRECISION_KNOBS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _backend(path: str) -> Any:
    import torch

    return functools.reduce(getattr, [p for p in path.split(".") if p], torch.backends)


def torch_math_settings() -> Dict[str, Any]:
    """The process-wide switches of torch's float32 matmuls (TF32 on CUDA; at "medium", bfloat16 in
    oneDNN on the CPU). An Engine's rank 0 is the caller's process, with the caller's; its other
    ranks start with torch's defaults and take these (scheduler.run_tp_follower_process)."""
    import torch

    settings: Dict[str, Any] = {}
    for name, (path, attr) in _LEGACY_MATH.items():
        try:
            settings[name] = torch.get_float32_matmul_precision() if not path else getattr(_backend(path), attr)
        except RuntimeError:  # (torch: "you have used mix of the legacy and new APIs")
            settings[name] = None
    for path in _FP32_PRECISION_KNOBS:
        if hasattr(_backend(path), "fp32_precision"):
            settings[f"{path or 'backends'}.fp32_precision"] = _backend(path).fp32_precision
    return settings


def apply_torch_math_settings(settings: Dict[str, Any]) -> None:
    """Reach `settings` from torch's defaults. The legacy setters first, each only where it changes
    something (they also move the new API's values, not always back), then the new API's."""
    import torch

    if settings["float32_matmul_precision"] is not None:
        torch.set_float32_matmul_precision(settings["float32_matmul_precision"])
    for name, (path, attr) in _LEGACY_MATH.items():
        if path and settings[name] is not None and torch_math_settings()[name] != settings[name]:
            setattr(_backend(path), attr, settings[name])
    for path in _FP32_PRECISION_KNOBS:
        key = f"{path or 'backends'}.fp32_precision"
        if key in settings and _backend(path).fp32_precision != settings[key]:
            _backend(path).fp32_precision = settings[key]


# a rank > 0's warnings that are its own (a watchdog's: its timing), kept beside its errors
RANK_OWN_WARNING_LOGGERS = ("minisgl.watchdog",)


class RankOwnWarningsOnly(logging.Filter):
    """Rank > 0: the warnings every rank would log alike (a retraction, a full queue, a context
    capped at start) are rank 0's to say; its own and every error stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.WARNING or record.name in RANK_OWN_WARNING_LOGGERS


def exit_when_parent_exits(parent_pid: int) -> None:
    """An Engine's rank may outlive the thread that started it (prctl's parent-death signal
    follows that thread, not the process): watch the parent process instead."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="minisgl-parent-watch", daemon=True).start()
