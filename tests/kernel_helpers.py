"""Paged inputs shared by the kernel tests (Triton kernels and the CPU decode kernel).

KV slots come from the real allocators with requests allocated in interleaved chunks,
so each request's slots are non-contiguous and (page_size 16) its pages are scattered.
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Tuple

import torch

from minisgl.mem_cache.allocator import make_allocator
from minisgl.mem_cache.memory_pool import ReqToTokenPool


@functools.lru_cache(maxsize=None)
def cpu_kernels_unavailable() -> Optional[str]:
    """Why the C kernels cannot be built on this machine (None if they can): no compiler, or
    one that cannot build them (Apple clang rejects -fopenmp). Tests of the `cpu` backend skip
    with this reason, as the engine falls back to the torch backend."""
    from minisgl.kernels import cpu_build

    try:
        cpu_build.load_all_cpu_kernels()
    except cpu_build.CpuKernelUnavailable as e:
        return f"the C kernels cannot be built here: {e}"
    return None


def paged_req_to_token(
    lens: List[int], page_size: int, device: str
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Slot table for requests of `lens` tokens, filled in interleaved chunks of 5 tokens.

    Returns (req_to_token [R, L], req_pool_indices [B], pool size S). Requests use
    rows in reverse order, so row != batch index; slot 0 is never handed out.
    """
    P = page_size
    size = sum(math.ceil(n / P) + 1 for n in lens) * P + 4 * P
    allocator = make_allocator(size, page_size, "cpu")
    pool = ReqToTokenPool(len(lens) + 1, max(lens) + 8, "cpu")
    rows = list(range(len(lens), 0, -1))
    filled = [0] * len(lens)
    while filled != lens:
        for b, (row, n) in enumerate(zip(rows, lens)):
            take = min(5, n - filled[b])
            if take == 0:
                continue
            last = int(pool.req_to_token[row, filled[b] - 1]) if filled[b] else -1
            loc = allocator.alloc_extend([filled[b]], [filled[b] + take], [last], take)
            assert loc is not None
            pool.write(row, filled[b], loc)
            filled[b] += take
    r2t = pool.req_to_token.to(device)
    return r2t, torch.tensor(rows, dtype=torch.int64, device=device), size + P


def kv_buffers(S: int, Hkv: int, D: int, dtype: torch.dtype, device: str) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(S, Hkv, D, generator=g).to(dtype).to(device)
    v = torch.randn(S, Hkv, D, generator=g).to(dtype).to(device)
    return k, v
