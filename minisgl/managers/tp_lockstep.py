"""Tensor parallelism, the process side (stage 3 with --tp-size N): N schedulers in lockstep.

Where it sits: around the Scheduler, in every rank's process. In: on rank 0, what the
TokenizerManager sent (or what the Engine hands over); on rank r > 0, TpBroadcastInput from
rank 0. Out: the same scheduler iteration on every rank. Owns: nothing but the broadcast.

With `--tp-size N` each rank holds 1/N of the model (docs/parallelism.md, "Model side") and
its own Scheduler, RadixCache and KV pool. Their forwards meet in collectives (all_reduce,
all_gather) that only work when every rank runs the same batch at the same time, so every
scheduler must take the same decisions. SGLang's way (scheduler.py recv_requests,
broadcast_pyobj), here:

    rank 0:  recv_requests (socket) --TpBroadcastInput--> broadcast_bytes, then process_input_requests, run_step, send
    rank r:                                               broadcast_bytes, then process_input_requests, run_step, drop outputs

Only rank 0 reads the socket, sends to the detokenizer, replies to the tokenizer and
publishes snapshots. Everything a scheduler decides from is either in those inputs, or
the same on every rank by construction (seeded RNGs, a logical clock in the radix tree,
identical logits), or agreed on here:

- a grammar compiles on each rank's own threads: it counts as ready once it is ready on
  every rank, and it times out by rank 0's clock alone (agree_on_ready_grammars; SGLang
  all_gathers the ready and failed sets in get_ready_grammar_requests);
- a stop_regex search runs out of its time budget on one rank and not another: one rank's
  timeout is every rank's (any_rank, from Req.check_finished);
- each broadcast carries rank 0's `lockstep_state` from before it, a checksum of every sampled
  token among it (fold_token_checksum); a rank whose own differs stops with an error naming
  both, instead of running a different batch into a collective. (Grammar steps, or every step
  with SYNC_TOKEN_IDS_ACROSS_TP=1, also sync the sampled ids: ModelRunner.sample.)

Idle: rank 0 blocks on its socket and the other ranks in the broadcast. So that an idle
server never reaches the collectives' timeout (--dist-timeout), rank 0 wakes every
heartbeat_interval() seconds and broadcasts an empty iteration (the Engine, which has no
loop, from a thread). A rank that dies breaks the others' next collective at once (gloo
sees the connection close); one that hangs is bounded by the timeout. A rank's process
itself (its start-up, the entry of ranks > 0) is tp_process.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

from minisgl.managers.io_struct import GetLoadReqInput, ProfileReq, TpBroadcastInput, decode, encode

logger = logging.getLogger("minisgl.scheduler")

# the longest an idle rank 0 stays silent; always well inside --dist-timeout (heartbeat_interval)
HEARTBEAT_S = 5.0
# what only rank 0's scheduler handles: both read (or record, for the profiler) rank 0's own state
# and change no decision, so the other ranks never see them (docs/parallelism.md: profiling is rank 0's)
RANK0_ONLY = (ProfileReq, GetLoadReqInput)
LOCKSTEP_FIELDS = (
    "forward_ct", "waiting", "grammar_queue", "running", "chunked", "free_kv_tokens", "evictable_tokens", "free_req_rows",
    "token_checksum",
)  # fmt: skip
_CHECKSUM_MOD = (1 << 61) - 1  # (a Mersenne prime: the checksum stays a small int on the wire)


class NestedBroadcastError(RuntimeError):
    """A broadcast started inside another one on the same thread (TpLeader._send says why)."""


def heartbeat_interval(dist_timeout_s: float) -> float:
    """Seconds an idle rank 0 waits before it broadcasts an empty iteration: a quarter of the
    collectives' timeout at most, so a busy machine's delays never let a follower time out."""
    return min(HEARTBEAT_S, dist_timeout_s / 4)


def threads_per_rank(num_threads: int, tp_size: int) -> int:
    """CPU threads of each rank: the ranks share the machine's cores (threads that outnumber
    the cores spin waiting for each other, docs/benchmarks.md)."""
    return max(1, num_threads // tp_size)


def lockstep_state(scheduler: Any) -> List[int]:
    """A few numbers that any two schedulers fed the same inputs agree on (LOCKSTEP_FIELDS)."""
    return [
        scheduler.forward_ct,
        len(scheduler.waiting_queue),
        len(scheduler.grammar_queue),
        len(scheduler.running_batch.reqs),
        int(scheduler.chunked_req is not None),
        scheduler.token_to_kv_pool_allocator.available_size(),
        scheduler.tree_cache.evictable_size(),
        scheduler.req_to_token_pool.available_size(),
        scheduler.token_checksum,
    ]


def fold_token_checksum(checksum: int, token_ids: Sequence[int]) -> int:
    """`checksum` with one step's sampled tokens (every row, in order) folded in.

    The ranks sample from bit-identical logits with identically seeded generators, so they draw
    the same tokens and never send them to each other; a rank that drew another one (a kernel that
    is not deterministic, a generator out of step) would feed it to the next forward and insert it
    into its radix tree, while its queues and pools still look the same. This sum, compared at
    every broadcast (LOCKSTEP_FIELDS), says so at the next step."""
    step = sum((i + 1) * t for i, t in enumerate(token_ids))  # (position-weighted: two tokens swapped show too)
    return (checksum * 1_000_003 + step) % _CHECKSUM_MOD


def agree_on_ready_grammars(group: Any, done: Sequence[bool], over_time: Sequence[bool]) -> Tuple[List[bool], List[bool]]:
    """Which requests of the grammar queue every rank moves on: (ready, timed_out), one flag each.

    `done`: this rank's compile finished (or failed); `over_time`: the request has waited past
    the grammar timeout by this rank's clock. Ready means done on every rank; timed out means
    over time by rank 0's clock and not ready. One all_reduce(MIN) on the CPU group decides
    both: row 0 holds the done flags, row 1 minus rank 0's over-time flags (0 elsewhere).
    """
    if group is None or group.world_size == 1 or not done:
        return list(done), [o and not d for d, o in zip(done, over_time)]
    import torch

    rank0 = group.is_first_rank
    flags = torch.tensor([[int(d) for d in done], [-int(o) if rank0 else 0 for o in over_time]], dtype=torch.int64)  # [2, n]
    _cpu_all_reduce(group, flags, "min")
    ready = [bool(x) for x in flags[0].tolist()]
    return ready, [not r and x < 0 for r, x in zip(ready, flags[1].tolist())]


def any_rank(group: Any, flag: bool) -> bool:
    """Whether `flag` is true on any rank: one all_reduce(MAX) on the CPU group, which every rank
    calls at the same point. For a decision one rank's clock makes: a stop_regex search that ran
    past its time budget (Req.check_finished) ends the request on every rank, or on none."""
    import torch

    return bool(_cpu_all_reduce(group, torch.tensor([int(flag)], dtype=torch.int64), "max").item())


def _cpu_all_reduce(group: Any, x: Any, op: str) -> Any:
    """all_reduce (min / max) of host integers on the group's CPU (gloo) group, in place: flags
    the schedulers agree on, even on CUDA, where the device group would copy them to the GPU."""
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    group.cpu_group.allreduce([x], opts).wait()
    return x


class TpLeader:
    """Rank 0's side of the lockstep: broadcast each iteration's inputs to the other ranks.

    The server's rank 0 calls `broadcast` once per loop iteration (an idle loop wakes for the
    heartbeat itself); the Engine calls it for each change it hands its scheduler and starts
    `start_heartbeat`, a thread that broadcasts an empty, step-less iteration when the Engine
    has been quiet for a heartbeat interval and no call of it is running.
    """

    def __init__(self, group: Any, scheduler: Any, heartbeat_s: float) -> None:
        self.group = group
        self.scheduler = scheduler
        self.heartbeat_s = heartbeat_s
        self.last_broadcast = time.monotonic()
        self.closed = False
        self._lock = threading.Lock()  # one broadcast at a time: the Engine's calls and its heartbeat
        self._sending = threading.local()  # .active: this thread is inside _send (see there)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def broadcast(self, recv_reqs: List[Any], run_step: bool = True, shutdown: bool = False) -> None:
        """Send rank 0's inputs of one iteration; call it before rank 0 processes them itself."""
        frame = TpBroadcastInput(
            [m for m in recv_reqs if not isinstance(m, RANK0_ONLY)], run_step, shutdown, lockstep_state(self.scheduler)
        )  # fmt: skip
        self._send(encode(frame))

    def in_send(self) -> bool:
        """Whether this thread is inside a broadcast (a finalizer the garbage collector runs there)."""
        return getattr(self._sending, "active", False)

    def _send(self, data: bytes) -> None:
        # The garbage collector can run a finalizer (a dropped stream's, a forgotten Engine's) in the
        # middle of a broadcast, on its thread: a broadcast from there would wait for the lock this
        # thread holds, for ever. Refused instead, with a message.
        if self.in_send():
            raise NestedBroadcastError(
                "a broadcast to the tensor-parallel ranks was started inside another one on the same thread (a "
                "finalizer run by the garbage collector mid-broadcast?); it would wait for itself"
            )
        with self._lock:
            if self.closed:
                raise RuntimeError("the tensor-parallel ranks were shut down")
            self._sending.active = True
            try:
                self.group.broadcast_bytes(data)
            finally:
                self._sending.active = False
            self.last_broadcast = time.monotonic()

    def start_heartbeat(self, turn: Callable[[], ContextManager[bool]]) -> None:
        """`turn()`: a context manager that yields whether the heartbeat may send now, held while it
        does (the Engine's `_heartbeat_turn`: its lock, taken without waiting, which its calls hold
        through each step). A broadcast in the middle of a step's grammar all_reduce, or of the
        forward's collectives on the same group, would be paired with the wrong operation on the
        other ranks."""
        self._thread = threading.Thread(target=self._beat, args=(turn,), name="minisgl-tp-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, turn: Callable[[], ContextManager[bool]]) -> None:
        # (no lockstep state: nothing runs on it, so there is nothing to check)
        beat = encode(TpBroadcastInput([], run_step=False))
        while not self._stop.wait(self.heartbeat_s / 4):
            if time.monotonic() - self.last_broadcast < self.heartbeat_s:
                continue
            with turn() as free:
                if not free:  # a call is running: it broadcasts at each step itself
                    continue
                if self._stop.is_set():  # (shut down while this thread waited for its turn)
                    return
                try:
                    self._send(beat)
                except Exception as e:  # a rank died: the Engine's next call finds it and says so
                    logger.warning("tensor-parallel heartbeat stopped: %s", e)
                    return

    def shutdown(self, notify: bool = True) -> None:
        """Stop the heartbeat and, with `notify`, tell the other ranks to leave their loop (best
        effort: a dead rank cannot hear it). No broadcast is possible afterwards."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if notify:
            state = lockstep_state(self.scheduler) if self.scheduler is not None else []
            try:
                self._send(encode(TpBroadcastInput([], run_step=False, shutdown=True, lockstep_state=state)))
            except Exception as e:  # (a rank already gone: joining it is what is left to do)
                logger.debug("shutdown broadcast failed: %s", e)
        self.closed = True
        self.scheduler = None  # (rank 0's model and KV pool go with the Engine's references)


def check_lockstep(scheduler: Any, frame: TpBroadcastInput, rank: int) -> None:
    """RuntimeError when this rank's scheduler no longer matches rank 0's as the frame found it."""
    if not frame.lockstep_state:  # (the Engine's heartbeat carries none)
        return
    mine = lockstep_state(scheduler)
    if mine != frame.lockstep_state:
        diff = ", ".join(f"{name} {a} here, {b} on rank 0" for name, a, b in zip(LOCKSTEP_FIELDS, mine, frame.lockstep_state) if a != b)
        raise RuntimeError(f"tensor-parallel rank {rank} fell out of lockstep with rank 0 ({diff}); stopping")


def apply_broadcast(scheduler: Any, frame: TpBroadcastInput, rank: int) -> None:
    """One follower iteration: rank 0's inputs, then the same step (its outputs are dropped:
    rank 0 sends them). RuntimeError when this rank's scheduler no longer matches rank 0's."""
    check_lockstep(scheduler, frame, rank)
    scheduler.process_input_requests(frame.recv_reqs)  # (the control replies are rank 0's to send)
    if frame.run_step:
        scheduler.run_step()
        scheduler.self_check_during_idle()
    scheduler.pop_outputs()
    scheduler.pop_control_replies()  # (a held unload's, answered by its step: rank 0's to send too)


def follower_loop(scheduler: Any, group: Any, watchdog_timeout: Optional[float] = None) -> None:
    """Rank r > 0 of the server or of an Engine: apply rank 0's broadcasts until it says shutdown.

    Waiting for the next broadcast is idle time for the hard watchdog (as rank 0's wait on its
    socket); a step that makes no progress for --watchdog-timeout ends the process."""
    from minisgl.managers.watchdog import HardWatchdog

    rank = group.rank_in_group
    watchdog = HardWatchdog(f"Scheduler TP{rank}", watchdog_timeout, lambda: f"forward_ct {scheduler.forward_ct}")
    scheduler.watchdogs_paused = watchdog.disable  # (reading a weight update's checkpoint: not a hung step)
    while True:
        with watchdog.disable():
            frame = decode(group.broadcast_bytes(None))
        if not isinstance(frame, TpBroadcastInput):
            raise TypeError(f"rank {rank} got a {type(frame).__name__} from rank 0, not a TpBroadcastInput")
        if frame.shutdown:  # (checked too: an Engine's ranks end where its rank 0 ended, or exit 1)
            check_lockstep(scheduler, frame, rank)
            return
        apply_broadcast(scheduler, frame, rank)
        watchdog.feed()
