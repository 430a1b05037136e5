"""SchedulerProfilerMixin (stage 3, observability). In: ProfileReq (POST /start_profile and
/stop_profile through the TokenizerManager, or Engine.start_profile / stop_profile). Out:
ProfileReqOutput, and a Chrome trace `<output_dir>/[<profile_prefix>-]<profile_id>-TP-0.trace.json.gz`
(SGLang's file name; open it in https://ui.perfetto.dev). Owns: the torch.profiler while one
records, and the named ranges of a scheduler step (`trace_range`).

Mixed into `Scheduler` as in SGLang's scheduler_profiler_mixin.py. The profiler runs in the
scheduler's process, so the trace shows what that process does: receive requests, pick the
next batch, build it, run the model, sample, process the results, send the outputs. Each of
those stages is a range named after its function (docs/scheduler.md, "Profiling a step").

Profiling never breaks serving: a bad request is answered with success false and a message
(the route's 400), and a trace that cannot be written ends the profile with a logged error;
neither raises into the step that was running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, Optional, Tuple

from minisgl.managers.io_struct import ProfileReq, ProfileReqOutput, ProfileReqType

logger = logging.getLogger("minisgl.scheduler")

# SGLang's trace names carry the tensor-parallel rank; with --tp-size N only rank 0 profiles
# (ProfileReq is not broadcast: docs/parallelism.md), so ours say 0
TP_RANK = 0
ACTIVITIES = ("CPU", "GPU", "MEM")
# SGLang's other activities, each refused with the reason (an accepted name that did nothing
# would be a silently ignored parameter)
UNSUPPORTED_ACTIVITIES = {
    "RPD": "it is ROCm's tracer, and minisgl runs on CPU and CUDA",
    "XPU": "it profiles Intel GPUs, and minisgl runs on CPU and CUDA",
    "CUDA_PROFILER": "it only marks a window for an outside profiler (cudaProfilerStart/Stop); "
    "run the server under `nsys profile` instead",
}
# SGLang's limit on the CUDA allocator's recorded events (MEM)
MEM_HISTORY_MAX_ENTRIES = 100_000

# The range every stage is wrapped in when nothing records: one shared do-nothing context.
# torch.profiler.record_function costs about 6 us per range even with no profiler running
# (it enters a RecordFunction in C++ each time); a step has about ten ranges, which is 60 us
# on a tiny model's 0.8 ms decode step. Behind this flag a range costs about 0.2 us.
_NO_RANGE: ContextManager[Any] = contextlib.nullcontext()


@dataclass(frozen=True)
class ProfileSettings:
    """A start request with every default filled in and every value checked."""

    output_dir: str  # absolute
    num_steps: Optional[int]
    activities: Tuple[str, ...]
    with_stack: bool
    record_shapes: bool
    profile_prefix: Optional[str]


def _all_threads_config() -> Any:
    """torch.profiler's option to record every thread (torch >= 2.9), or None on a torch without it."""
    import torch

    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def _env_flag(name: str, default: bool = True) -> bool:
    """SGLang's get_bool_env_var: "true" or "1" (any case) is true."""
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("true", "1")


def resolve_profile_args(req: ProfileReq, device: str) -> ProfileSettings:
    """The settings of a start request on this device; ValueError says what to change.

    SGLang's defaults: output_dir is $SGLANG_TORCH_PROFILER_DIR, else /tmp; activities are CPU
    and GPU (here GPU only on a CUDA server, where it exists); with_stack and record_shapes are
    on unless the request or $SGLANG_PROFILE_WITH_STACK / $SGLANG_PROFILE_RECORD_SHAPES turn
    them off (the stack is what maps a slow range back to a line of code)."""
    num_steps = req.num_steps
    if num_steps is not None and (type(num_steps) is not int or num_steps < 1):
        raise ValueError(f"num_steps must be a positive integer (leave it out to profile until stop_profile), got {num_steps!r}")
    activities = req.activities if req.activities is not None else (["CPU", "GPU"] if device == "cuda" else ["CPU"])
    if not isinstance(activities, list) or not activities or not all(isinstance(a, str) for a in activities):
        raise ValueError(f"activities must be a non-empty list of names from {', '.join(ACTIVITIES)}, got {activities!r}")
    for activity in activities:
        if activity in UNSUPPORTED_ACTIVITIES:
            raise ValueError(f"Profiling activity {activity!r} is not supported by minisgl: {UNSUPPORTED_ACTIVITIES[activity]}")
        if activity not in ACTIVITIES:
            raise ValueError(f"Unknown profiling activity {activity!r}: choose from {', '.join(ACTIVITIES)} (upper case)")
        if activity in ("GPU", "MEM") and device != "cuda":
            what = "CUDA kernels" if activity == "GPU" else "the CUDA allocator's history"
            raise ValueError(f"Profiling activity {activity!r} records {what}, and this server runs on {device}: "
                             "use activities [\"CPU\"]")  # fmt: skip
    flags = {}
    for name, env in (("with_stack", "SGLANG_PROFILE_WITH_STACK"), ("record_shapes", "SGLANG_PROFILE_RECORD_SHAPES")):
        value = getattr(req, name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        flags[name] = value is not False and _env_flag(env)
    output_dir = req.output_dir if req.output_dir is not None else os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
    if not isinstance(output_dir, str) or not output_dir:
        raise ValueError(f"output_dir must be a directory path, got {output_dir!r}")
    prefix = req.profile_prefix
    if prefix is not None and (not isinstance(prefix, str) or not prefix or "/" in prefix or os.sep in prefix):
        raise ValueError(f"profile_prefix must be a non-empty file name part without '/', got {prefix!r}")
    return ProfileSettings(
        output_dir=os.path.abspath(output_dir), num_steps=num_steps, activities=tuple(dict.fromkeys(activities)),
        with_stack=flags["with_stack"], record_shapes=flags["record_shapes"], profile_prefix=prefix,
    )  # fmt: skip


def refuse_unsupported_profile_args(
    start_step: Optional[int] = None, profile_by_stage: Optional[bool] = False, merge_profiles: Optional[bool] = False,
    profile_stages: Optional[List[str]] = None,
) -> None:  # fmt: skip
    """SGLang's ProfileReqInput fields that minisgl does not implement: left at their defaults
    they ask for nothing; set, each is a ValueError that says why (/start_profile's 400)."""
    if start_step is not None:
        raise ValueError("start_step is not supported by minisgl: it counts the scheduler's forward passes since the "
                         "server started, which nothing shows; start profiling once the warm-up is over, and give "
                         "num_steps for how long")  # fmt: skip
    if profile_by_stage or profile_stages is not None:
        raise ValueError("profile_by_stage and profile_stages (a trace per prefill and decode stage) are not supported by "
                         "minisgl: its one trace holds both, told apart by the forward_extend and forward_decode ranges")  # fmt: skip
    if merge_profiles:
        raise ValueError("merge_profiles is not supported by minisgl: it merges the traces of several ranks, and minisgl "
                         "profiles rank 0 alone (with --tp-size N too), whose one trace is already whole")  # fmt: skip


def _check_writable(directory: str) -> Optional[str]:
    """None if a file can be written in `directory` (made if missing), else why not. Checked at
    start: a directory found unwritable at stop would lose the whole recording."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"output_dir {directory!r} cannot be written: {e.strerror or e}"
    return None


class SchedulerProfilerMixin:
    def init_profiler(self) -> None:
        self.torch_profiler: Any = None  # torch.profiler.profile while CPU or GPU activity records
        self.profile_in_progress = False
        self.profile_settings: Optional[ProfileSettings] = None
        self.profile_id: Optional[str] = None
        self.profile_steps_done = 0  # steps that ran a batch since the start
        self.last_profile_paths: List[str] = []  # what the last stop wrote (an automatic one too)
        # torch.profiler.record_function while a profiler records, else None (trace_range's flag)
        self._record_function: Optional[Callable[[str], ContextManager[Any]]] = None
        # the thread that started the profiler, when this torch records that thread only (see _start_recording)
        self._profiled_thread: Optional[int] = None

    def trace_range(self, name: str) -> ContextManager[Any]:
        """`with self.trace_range("run_batch"):` a range named `name` in the trace while
        torch.profiler records, and a shared do-nothing context otherwise (_NO_RANGE: why)."""
        record_function = self._record_function
        return record_function(name) if record_function is not None else _NO_RANGE

    # ------------------------------------------------------------------ requests
    def profile(self, recv_req: ProfileReq) -> ProfileReqOutput:
        """SGLang's Scheduler.profile: start or stop, answered with success and a message."""
        if recv_req.type == ProfileReqType.START_PROFILE:
            return self.start_profile(recv_req)
        if recv_req.type == ProfileReqType.STOP_PROFILE:
            return self.stop_profile()
        return ProfileReqOutput(False, f"Unknown ProfileReq type {recv_req.type!r}")

    def start_profile(self, recv_req: ProfileReq) -> ProfileReqOutput:
        if self.profile_in_progress:  # (SGLang's words)
            return ProfileReqOutput(False, "Profiling is already in progress. Call /stop_profile first.")
        try:
            settings = resolve_profile_args(recv_req, self.server_args.device)
        except ValueError as e:
            return ProfileReqOutput(False, str(e))
        error = _check_writable(settings.output_dir)
        if error is not None:
            return ProfileReqOutput(False, error)
        profile_id = str(time.time())  # (SGLang's profile id: the start time)
        try:
            self._start_recording(settings)
        except Exception as e:  # e.g. the caller of an Engine runs its own torch.profiler
            logger.exception("torch.profiler failed to start")
            self._reset_profiler()
            if "MEM" in settings.activities:  # (it may have started before the failure)
                with contextlib.suppress(Exception):
                    import torch

                    torch.cuda.memory._record_memory_history(enabled=None)
            return ProfileReqOutput(False, f"The profiler failed to start: {type(e).__name__}: {e}")
        self.profile_in_progress, self.profile_settings, self.profile_id = True, settings, profile_id
        self.profile_steps_done = 0
        logger.info("Profiling starts. Traces will be saved to: %s (with profile id: %s)", settings.output_dir, profile_id)
        until = f"after {settings.num_steps} steps that run a batch" if settings.num_steps else "at stop_profile"
        return ProfileReqOutput(True, f"Start profiling. {', '.join(self._profile_paths())} will be written {until}.")

    def _start_recording(self, settings: ProfileSettings) -> None:
        import torch

        if torch._C._autograd._profiler_enabled():
            # (torch would start ours anyway, and its stop would end the other one's session)
            raise RuntimeError("another torch.profiler records in this process; stop it first (one at a time)")
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}
        torch_activities = [kinds[a] for a in settings.activities if a in kinds]
        if "MEM" in settings.activities:
            torch.cuda.memory._record_memory_history(max_entries=MEM_HISTORY_MAX_ENTRIES)
        if torch_activities:
            # every thread's ops: the Engine's steps may run in executor threads (async_generate, a
            # generate() in a thread). torch records only the starting thread by default, and a stop
            # from another thread then crashed the process in export_chrome_trace.
            all_threads = _all_threads_config()
            profiler = torch.profiler.profile(
                activities=torch_activities, with_stack=settings.with_stack, record_shapes=settings.record_shapes,
                **({"experimental_config": all_threads} if all_threads is not None else {}),
            )  # fmt: skip
            profiler.start()
            self.torch_profiler = profiler
            self._record_function = torch.profiler.record_function
            self._profiled_thread = None if all_threads is not None else threading.get_ident()

    def _profile_paths(self) -> List[str]:
        """The files this profile writes at its stop: the trace (CPU / GPU), MEM's snapshot."""
        settings = self.profile_settings
        assert settings is not None and self.profile_id is not None
        stem = os.path.join(settings.output_dir, f"{settings.profile_prefix}-" if settings.profile_prefix else "")
        stem += f"{self.profile_id}-TP-{TP_RANK}"
        paths = [stem + ".trace.json.gz"] if set(settings.activities) & {"CPU", "GPU"} else []
        return paths + ([stem + "-memory.pickle"] if "MEM" in settings.activities else [])

    def stop_profile(self) -> ProfileReqOutput:
        """Stop recording and write the files. Every range must be closed (between stages):
        the callers are process_input_requests, count_profiled_step and Engine.shutdown."""
        if not self.profile_in_progress:  # (SGLang's words)
            return ProfileReqOutput(False, "Profiling is not in progress. Call /start_profile first.")
        if self._profiled_thread is not None and self._profiled_thread != threading.get_ident():
            return ProfileReqOutput(False, "This torch's profiler records only the thread that started it, and cannot be "
                                    "stopped from another: stop it from that thread (torch >= 2.9 records every thread)")  # fmt: skip
        logger.info("Stop profiling...")
        paths = self._profile_paths()
        try:
            self._stop_recording(paths)
        except Exception as e:  # (a full disk, a directory removed since the start)
            logger.exception("Profiling stopped, but its files could not be written")
            for path in paths:  # (a half-written trace would not open)
                with contextlib.suppress(OSError):
                    os.remove(path)
            return ProfileReqOutput(False, f"Profiling stopped, but {', '.join(paths)} could not be written: {type(e).__name__}: {e}")
        finally:
            self._reset_profiler()
        logger.info("Profiling done. Traces are saved to: %s", ", ".join(paths))
        self.last_profile_paths = paths
        return ProfileReqOutput(True, f"Stop profiling. Wrote {', '.join(paths)}.", paths)

    def _stop_recording(self, paths: List[str]) -> None:
        import torch

        profiler, self.torch_profiler, self._record_function = self.torch_profiler, None, None
        try:
            if profiler is not None:
                # (the shell's watchdogs paused: a long profile takes seconds to minutes to write)
                with self.watchdogs_paused():
                    profiler.stop()
                    # (a .gz name: torch writes it gzipped); under a temporary name until whole, so a
                    # write cut short (a full disk, a killed process) never leaves a truncated trace
                    # under the name the answer gives
                    part = paths[0][: -len(".json.gz")] + ".part.json.gz"
                    profiler.export_chrome_trace(part)
                    os.replace(part, paths[0])
        finally:
            if "MEM" in self.profile_settings.activities:  # (stopped even when the trace failed)
                try:
                    torch.cuda.memory._dump_snapshot(paths[-1])
                finally:
                    torch.cuda.memory._record_memory_history(enabled=None)

    def _reset_profiler(self) -> None:
        profiler = self.torch_profiler
        self.torch_profiler, self._record_function = None, None
        if profiler is not None:  # (start failed half-way: leave no profiler running in the process)
            with contextlib.suppress(Exception):
                profiler.stop()
        self.profile_in_progress, self.profile_settings, self.profile_id = False, None, None

    def count_profiled_step(self) -> None:
        """After a step that ran a batch (run_step, once its ranges are closed): with num_steps,
        stop once that many were recorded. SGLang counts forwards too; its check runs before the
        forward, so its last step is cut short, and here every counted step is whole."""
        settings = self.profile_settings
        if not self.profile_in_progress or settings is None or settings.num_steps is None:
            return
        self.profile_steps_done += 1
        if self.profile_steps_done >= settings.num_steps:
            if self._profiled_thread is not None and self._profiled_thread != threading.get_ident():
                return  # (this torch cannot stop it here: the next step on the starting thread does)
            out = self.stop_profile()
            if not out.success:  # (nobody waits for this answer: the log is where it goes)
                logger.error("Profiling after %d steps: %s", self.profile_steps_done, out.message)
