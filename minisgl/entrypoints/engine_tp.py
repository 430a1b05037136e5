"""The Engine's tensor-parallel ranks (`Engine(tp_size=N)`): ranks 1..N-1 as child processes.

Where it sits: beside the Engine, which stays rank 0 in the caller's process (its scheduler
steps in the caller's thread, as with one rank). Each other rank is a spawned process running
scheduler.run_tp_follower_process: its own ModelRunner (1/N of the model) and Scheduler,
following rank 0's broadcasts. The Engine hands every change of its scheduler to `broadcast`
first (requests, aborts, flushes, each step), so the followers step with it; shutdown() (or
the garbage collector, when the caller forgets it) tells them to stop and joins them. A
shutdown frame is sent only with the Engine's lock held (no step of another thread runs, whose
collectives it would meet) and never from a broken Engine or at the interpreter's exit: there
the ranks are terminated. A rank that dies makes the Engine's next call raise RuntimeError
naming it.

CPU threads: the ranks share the machine's cores, so each gets threads_per_rank(the caller's
torch thread count at start); rank 0's count is the caller's process's own, set here for the
Engine's life and put back by close() (docs/engine.md).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, TypeVar

from minisgl.managers.scheduler import run_tp_follower_process
from minisgl.managers.tp_lockstep import NestedBroadcastError, TpLeader, heartbeat_interval, threads_per_rank
from minisgl.managers.tp_process import set_threads_per_rank, torch_math_settings

logger = logging.getLogger("minisgl")
T = TypeVar("T")

READY_TIMEOUT_S = 600.0  # loading a real model on the CPU can take minutes (the server's limit)
JOIN_TIMEOUT_S = 10.0  # how long close() waits for a rank to leave its loop before it terminates it
LOCK_TIMEOUT_S = 5.0  # how long close() waits for a call of another thread to end before it terminates the ranks


class RankDiedError(RuntimeError):
    """A tensor-parallel rank of an Engine exited; the Engine cannot step without it.

    `failed_at`: when the rank's own start-up failure happened (time.time(), from its message);
    None for a rank that died without one."""

    def __init__(self, message: str, failed_at: Optional[float] = None) -> None:
        super().__init__(message)
        self.failed_at = failed_at


class EngineTpRanks:
    """Ranks 1..N-1 of one Engine: start them (`__init__`, then `wait_ready` once rank 0's own
    ModelRunner is built), `broadcast` rank 0's inputs to them, `close` them."""

    def __init__(self, server_args: Any, engine_lock: Any) -> None:
        import torch

        self.tp_size = server_args.tp_size
        self.engine_lock = engine_lock  # held by every Engine call (and its steps); close() takes it too
        self.leader: Optional[TpLeader] = None
        self.user_threads: Optional[int] = None  # the caller's torch thread count, put back by close()
        self.closed = False
        self.broken = False  # a call failed half-way (Engine._guarded): the ranks may sit in its collectives
        self.cancelled = threading.Event()  # set by close(): rank 0's rendezvous stops waiting for the others
        self.helpers: List[threading.Thread] = []  # while_watching's threads (close() lets the rendezvous end)
        num_threads = None
        if server_args.device == "cpu":
            self.user_threads = torch.get_num_threads()
            note = f", this process's included, until shutdown() (it had {self.user_threads})"
            num_threads = set_threads_per_rank(self.tp_size, threads_per_rank(self.user_threads, self.tp_size), note)
        # the caller's float32 matmul switches are rank 0's (this process): the other ranks take them
        self.torch_math = torch_math_settings()
        self.dir = tempfile.mkdtemp(prefix="minisgl-tp-")  # (the rendezvous file: private to this Engine)
        store_path = os.path.join(self.dir, "tp-store")
        ctx = mp.get_context("spawn")  # (fork would copy the caller's threads and CUDA state)
        # the ranks log as this process's minisgl loggers do (warnings only, unless the caller asked for more)
        log_level = logging.getLevelName(logger.getEffectiveLevel()).lower()
        self.procs: List[Any] = []
        self.readers: List[Any] = []
        self.ready: Set[int] = set()  # ranks that said ready
        try:
            for rank in range(1, self.tp_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=run_tp_follower_process,
                    args=(server_args, rank, store_path, writer, num_threads, os.getpid(), log_level, self.torch_math),
                    name=f"minisgl-engine-tp{rank}", daemon=True,
                )  # fmt: skip
                proc.start()
                writer.close()
                self.procs.append(proc)
                self.readers.append(reader)
            self.group = self._join(server_args, store_path)
        except BaseException:
            self.close()
            raise
        self.heartbeat_s = heartbeat_interval(server_args.dist_timeout)
        atexit.register(self._close_at_exit)  # (not the Engine's finalizer: this one knows it is the exit)

    def _join(self, server_args: Any, store_path: str) -> Any:
        """Rank 0's place in the group. The rendezvous waits for every rank up to --dist-timeout."""
        from minisgl.distributed import init_tensor_parallel_group

        args = (0, self.tp_size, store_path, server_args.device, server_args.dist_timeout, self.cancelled)
        return self.while_watching(lambda: init_tensor_parallel_group(*args), "minisgl-tp-join")

    def while_watching(self, fn: Callable[[], T], name: str) -> T:
        """fn() run in a helper thread while this one watches the other ranks: one that fails or
        exits meanwhile is RankDiedError at once (its own message), not after rank 0's collective
        times out. What rank 0 does at start waits in collectives on them: the rendezvous, the
        KV pool's min over ranks (on CUDA, NCCL notices a dead peer only at --dist-timeout).
        After a failure the helper thread ends when its collective fails (the ranks are
        terminated then), or at that timeout (a daemon thread)."""
        result: Dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = fn()
            except BaseException as e:  # (re-raised in the caller's thread)
                result["error"] = e

        helper = threading.Thread(target=run, name=name, daemon=True)
        self.helpers.append(helper)
        helper.start()
        while helper.is_alive():
            helper.join(timeout=0.05)
            try:
                self._poll_ranks()
            except RankDiedError:
                # a setting every rank refuses: rank 0's own ValueError, a moment later, says it as
                # with one rank (the Engine's rule at start); anything else is the rank's failure
                helper.join(timeout=1.0)
                if isinstance(result.get("error"), ValueError):
                    raise result["error"] from None
                raise
        if "error" in result:
            raise result["error"]
        return result["value"]

    def _poll_ranks(self) -> None:
        """Read the ranks' start-up messages that came; RankDiedError for a failure or an exit."""
        for rank, reader in enumerate(self.readers, start=1):
            if rank in self.ready:
                continue
            if reader.poll():
                try:
                    info = reader.recv()
                except EOFError:
                    raise RankDiedError(self._exit_text(rank)) from None
                if info.get("status") != "ready":
                    raise RankDiedError(f"tensor-parallel rank {rank} failed to start: {info.get('message', info)}", info.get("failed_at"))
                if info.get("torch_math") != self.torch_math:  # (it set them first thing: a difference is a bug to see)
                    raise RankDiedError(f"tensor-parallel rank {rank} runs with {info.get('torch_math')}, rank 0 with {self.torch_math}")
                self.ready.add(rank)
            elif not self.procs[rank - 1].is_alive():
                raise RankDiedError(self._exit_text(rank))

    def wait_ready(self, scheduler: Any, heartbeat_turn: Any) -> None:
        """Every rank's ready message (RankDiedError with the first failure's), then the broadcasts
        can start: the heartbeat keeps idle ranks inside --dist-timeout from here on, sending only
        in its `heartbeat_turn` (the Engine's lock: never in the middle of a step's collectives)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self._poll_ranks()
            if len(self.ready) == len(self.procs):
                break
            if time.monotonic() > deadline:
                waiting = sorted(set(range(1, self.tp_size)) - self.ready)
                raise RankDiedError(f"tensor-parallel rank(s) {waiting} not ready after {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        self.leader = TpLeader(self.group, scheduler, self.heartbeat_s)
        self.leader.start_heartbeat(heartbeat_turn)

    def _exit_text(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        proc.join(timeout=1)  # (its exit code)
        return f"tensor-parallel rank {rank} of this Engine exited (exit code {proc.exitcode}); its log is above"

    def raise_rank_failure(self, rank0_failed_at: float, wait_s: float = 1.0) -> None:
        """After rank 0 failed to start (at `rank0_failed_at`, time.time()): RankDiedError with a
        rank's own message when that rank failed first, or died: rank 0's error is then its echo
        (gloo's "Connection closed by peer"). Waits up to `wait_s` for it (its message may come a
        moment after the broken collective it caused on rank 0). Nothing when every rank is up,
        or when rank 0 failed first (a rank's error is then the echo)."""
        deadline = time.monotonic() + wait_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        try:
            self._poll_ranks()
        except RankDiedError as e:
            if e.failed_at is None or e.failed_at <= rank0_failed_at:
                raise

    def check_alive(self) -> None:
        """RankDiedError naming the first rank that is gone (a cheap waitpid per rank)."""
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise RankDiedError(self._exit_text(rank))

    def broadcast(self, recv_reqs: List[Any], run_step: bool) -> None:
        """Hand rank 0's inputs (and a step) to every other rank, before rank 0 runs them itself."""
        assert self.leader is not None, "wait_ready() first"
        self.check_alive()
        try:
            self.leader.broadcast(recv_reqs, run_step)
        except NestedBroadcastError:  # (no rank is at fault: the message says what happened)
            raise
        except Exception as e:
            self.raise_if_a_rank_died(e)
            raise RankDiedError(f"the broadcast to the tensor-parallel ranks failed: {e}") from e

    def raise_if_a_rank_died(self, error: BaseException) -> None:
        """After a broadcast or a step of rank 0 failed: RankDiedError naming a rank that exited,
        from `error`; nothing when every rank is up. A collective's error (a RuntimeError: gloo's
        "Connection closed by peer") gives the rank a moment to be gone: closing its connection is
        how a dying rank is first seen."""
        if isinstance(error, RuntimeError):
            deadline = time.monotonic() + 2.0
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        try:
            self.check_alive()
        except RankDiedError as died:
            raise died from error

    def close(self, at_exit: bool = False) -> None:
        """Stop the ranks, put the caller's thread count back. Idempotent; also the Engine's
        finalizer (no reference to it) and, `at_exit`, the interpreter's exit hook.

        A shutdown frame, then a join (terminating what does not leave), only when it is safe: no
        rank gone, the Engine not broken half-way through a step, not the exit (another thread
        may be inside a call, and nothing there must wait), not from inside a broadcast of this
        thread (a finalizer run mid-beat), and with the Engine's lock, so that no step of another
        thread is running whose collectives the frame would meet. Otherwise the ranks are
        terminated at once: they hold nothing that needs a clean exit."""
        if self.closed:
            return
        self.closed = True
        self.cancelled.set()
        atexit.unregister(self._close_at_exit)
        if self.leader is not None:
            notify = not (at_exit or self.broken or self.leader.in_send()) and all(p.is_alive() for p in self.procs)
            locked = notify and self.engine_lock.acquire(timeout=LOCK_TIMEOUT_S)
            if notify and not locked:
                logger.warning("tensor-parallel ranks: a call of another thread still runs after %.0f s; terminating them", LOCK_TIMEOUT_S)
            try:
                self.leader.shutdown(notify=locked)
            finally:
                if locked:
                    self.engine_lock.release()
            if locked:
                deadline = time.monotonic() + JOIN_TIMEOUT_S
                for proc in self.procs:
                    proc.join(timeout=max(0.1, deadline - time.monotonic()))
                    if proc.is_alive():
                        logger.warning("tensor-parallel rank process %s did not stop; terminating it", proc.pid)
                # rank 0's gloo threads joined now, as the ranks' own (run_tp_follower_process), not left to
                # the caller's exit; only here, where no call of another thread can be inside a collective
                self.group.destroy()
        for proc in self.procs:  # (never started following, as when the start failed: they go now)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)
        for reader in self.readers:
            reader.close()
        for helper in self.helpers:  # (a cancelled rendezvous ends within its poll; then its store file can go)
            helper.join(timeout=1.0)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.user_threads is not None:
            import torch

            torch.set_num_threads(self.user_threads)

    def _close_at_exit(self) -> None:
        self.close(at_exit=True)
