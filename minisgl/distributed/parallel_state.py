"""Tensor-parallel groups: which rank this process is, and the collectives its layers call.

Where it sits: under the ModelRunner, beside the model. With `--tp-size N`, N scheduler
processes (one per rank) each hold 1/N of every large weight; the layers that split a
matmul call `all_reduce` / `all_gather` here to put the pieces back together, and the
schedulers use `broadcast_bytes` to see the same requests in the same order (rank 0
receives them from the TokenizerManager).

SGLang keeps these groups in module globals (`get_tp_group()`); minisgl builds a
`GroupCoordinator` object and hands it down explicitly (STYLE.md habit 6), so two
Engines, or a test's ranks, can live in one process without resetting anything. The
process groups are built straight from a store (`ProcessGroupGloo(store, rank, size)`),
never through `torch.distributed.init_process_group`, which would set the process-wide
default group.

Rendezvous goes through a `FileStore` in the server's private temp dir (DESIGN.md:
nothing listens on TCP but the HTTP server); gloo's own transport then connects the
ranks over loopback only. On CUDA, tensors go through NCCL and Python bytes through a
second, gloo group, as SGLang's `device_group` / `cpu_group` pair; NCCL's bootstrap is
kept on loopback too (NCCL_SOCKET_IFNAME=lo, unless set), and its communicator is made
here, by a first all_reduce, so that its GPU buffers exist before the ModelRunner reads the
free memory it sizes the KV pool from.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist


class GroupCoordinator:
    """One tensor-parallel group, seen from one rank (SGLang's GroupCoordinator, TP only).

    `world_size == 1` is a valid group with no process group behind it: every collective
    returns its input, so the single-rank path runs the same layer code.
    """

    def __init__(
        self, rank: int, world_size: int, device: str = "cpu", device_group: Optional[object] = None,
        cpu_group: Optional[object] = None,
    ) -> None:  # fmt: skip
        self.rank_in_group = rank
        self.world_size = world_size
        self.device = device
        self.device_group = device_group  # tensors: gloo on the CPU, NCCL on CUDA
        self.cpu_group = cpu_group  # Python bytes (broadcast_bytes): always gloo

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or min / max) `x` over the ranks, in place; returns `x`.

        Every rank ends with the same bits: gloo's and NCCL's ring reduce each element once
        and copy the result, so ranks that feed identical logits to the sampler stay in step.
        """
        if self.world_size == 1:
            return x
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        self._live(self.device_group).allreduce([x], opts).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x`, concatenated along `dim` in rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts: List[torch.Tensor] = [torch.empty_like(x) for _ in range(self.world_size)]
        self._live(self.device_group).allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast_bytes(self, data: Optional[bytes], src: int = 0) -> bytes:
        """Rank `src`'s bytes, on every rank (the others pass None).

        Two broadcasts: the length, then the payload. Messages cross as bytes the sender
        encoded (io_struct.encode), never as pickles (STYLE.md habit 4).
        """
        if self.world_size == 1:
            assert data is not None
            return data
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        mine = self.rank_in_group == src
        size = torch.tensor([len(data) if mine and data is not None else 0], dtype=torch.int64)
        self._live(self.cpu_group).broadcast([size], opts).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine and data else torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            self._live(self.cpu_group).broadcast([buf], opts).wait()
        return bytes(buf.numpy()) if not mine else (data or b"")

    def destroy(self) -> None:
        """The rank's orderly end: shut the process groups down and join their worker threads, before
        the interpreter finalizes. Idempotent; no collective runs afterwards.

        Why it is needed: gloo runs each collective on a C++ worker thread that lets go of the
        collective's tensors only after wait() has returned here. A tensor Python has dropped by then
        needs the GIL to be freed; if the interpreter is finalizing, Python ends that thread with
        pthread_exit, whose unwinding through a C++ destructor aborts the process ("terminate called
        without an active exception", exit code -6; rare, on a loaded machine). Dropping the last
        reference runs the group's destructor (torch's binding releases the GIL first), which waits
        for its queue to drain and joins its threads. shutdown() first, as torch.distributed's
        destroy_process_group: it ends NCCL's communicators and threads (a no-op for gloo).
        """
        groups = {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}  # (one object on the CPU)
        self.device_group = self.cpu_group = None
        while groups:
            _, group = groups.popitem()
            if hasattr(group, "shutdown"):  # (an older torch's may have none)
                group.shutdown()
            del group  # the last reference: its destructor joins the threads now

    def _live(self, group: Optional[object]) -> Any:
        if group is None:
            raise RuntimeError("this tensor-parallel group was destroyed (GroupCoordinator.destroy): no collective can run on it")
        return group


def _gloo_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> object:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # loopback only
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def init_tensor_parallel_group(
    rank: int, world_size: int, store_path: str, device: str = "cpu", timeout_s: float = 1800.0,
    cancelled: Optional[threading.Event] = None,
) -> GroupCoordinator:  # fmt: skip
    """Join the group of `world_size` ranks that rendezvous at the file `store_path`.

    Every rank calls this with the same path; it returns once all have joined. `timeout_s`
    bounds the wait for them and every later collective: a rank that waits longer for the
    others raises instead of hanging forever (the schedulers keep talking while idle,
    docs/parallelism.md). `cancelled`: set by whoever started the ranks when one of them
    failed, so that the wait for it ends now (RuntimeError), not at the timeout.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is outside 0..{world_size - 1}")
    if world_size == 1:
        return GroupCoordinator(0, 1, device)
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed: --tp-size must be 1")
    timeout = timedelta(seconds=timeout_s)
    store = dist.FileStore(store_path, world_size)
    _wait_for_every_rank(store, rank, world_size, timeout_s, cancelled)
    cpu_group = _gloo_group(dist.PrefixStore("cpu", store), rank, world_size, timeout)
    if device == "cuda":
        torch.cuda.set_device(rank)  # rank r runs on cuda:r (the ModelRunner's choice, SGLang's gpu_id)
        # the ranks share this machine: NCCL's bootstrap and socket fallback stay on loopback, as gloo's
        # do (its explicit 127.0.0.1 device above); a user's own choice wins
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        device_group: object = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, world_size, opts)
        # NCCL builds its communicator, and allocates its buffers on the GPU, at the first collective:
        # this one, so that the ModelRunner's free-memory reading (the KV pool's size) already counts them
        warm_up = torch.zeros(1, device=torch.device("cuda", rank))
        device_group.allreduce([warm_up], dist.AllreduceOptions()).wait()  # type: ignore[attr-defined]
        torch.cuda.synchronize(rank)
    else:
        device_group = cpu_group
    return GroupCoordinator(rank, world_size, device, device_group, cpu_group)


def _wait_for_every_rank(store: dist.Store, rank: int, world_size: int, timeout_s: float, cancelled: Optional[threading.Event]) -> None:
    """Check in, then poll until every rank has (gloo's own rendezvous blocks in C++ until the
    timeout, with no way to stop it: a launcher that saw a rank fail would leave it there)."""
    store.set(f"joined/{rank}", b"1")
    keys = [f"joined/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        if cancelled is not None and cancelled.is_set():  # (first: the store's file may be gone next)
            raise RuntimeError("the tensor-parallel rendezvous was cancelled: another rank failed to start")
        if store.check(keys):
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
            raise RuntimeError(f"tensor-parallel rank(s) {missing} did not join within {timeout_s:.0f} s (--dist-timeout)")
        time.sleep(0.02)
