"""GroupCoordinator: the collectives tensor-parallel layers and schedulers rely on, across two real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any, Dict

import pytest
import torch

from minisgl.distributed import GroupCoordinator, init_tensor_parallel_group


def _rank_main(rank: int, store_path: str, results: Any) -> None:
    torch.set_num_threads(1)
    group = init_tensor_parallel_group(rank, 2, store_path, timeout_s=60)
    out: Dict[str, Any] = {}
    x = torch.arange(4, dtype=torch.float32) + 10 * rank  # rank 0: 0..3, rank 1: 10..13
    out["sum"] = group.all_reduce(x.clone()).tolist()
    out["min"] = group.all_reduce(torch.tensor([5 - rank], dtype=torch.int64), op="min").tolist()
    out["gather"] = group.all_gather(torch.full((2, 1), float(rank)), dim=-1).tolist()
    out["bytes"] = group.broadcast_bytes(b"hello \x00 ranks" if rank == 0 else None)
    out["empty"] = group.broadcast_bytes(b"" if rank == 0 else None)
    out["from1"] = group.broadcast_bytes(b"one" if rank == 1 else None, src=1)
    group.destroy()
    group.destroy()  # (idempotent)
    try:
        group.all_reduce(x)
    except RuntimeError as e:
        out["after_destroy"] = str(e)
    results.put((rank, out))


def test_two_ranks_agree_on_every_collective(tmp_path: Any) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(str(tmp_path), "store")
    procs = [ctx.Process(target=_rank_main, args=(r, store, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank in (0, 1):
        out = got[rank]
        assert out["sum"] == [10.0, 12.0, 14.0, 16.0]
        assert out["min"] == [4]
        assert out["gather"] == [[0.0, 1.0], [0.0, 1.0]]  # rank order along the last dim
        assert out["bytes"] == b"hello \x00 ranks"
        assert out["empty"] == b""
        assert out["from1"] == b"one"
        assert "group was destroyed" in out["after_destroy"]


def test_single_rank_group_is_the_identity() -> None:
    group = init_tensor_parallel_group(0, 1, "/nonexistent/unused")
    assert isinstance(group, GroupCoordinator) and group.world_size == 1 and group.is_first_rank
    x = torch.ones(3)
    assert group.all_reduce(x) is x and group.all_gather(x) is x
    assert group.broadcast_bytes(b"abc") == b"abc"


def test_bad_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="outside 0..1"):
        init_tensor_parallel_group(2, 2, "/tmp/unused")
