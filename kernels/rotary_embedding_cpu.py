"""rotary_embedding_cpu: rotate q and k by their token's position (RoPE, NeoX layout) in place,
float32 on the CPU (C through ctypes).

Where it sits: RotaryEmbedding (minisgl/layers/rotary_embedding.py) when the `cpu` attention
backend is on: every attention layer, after the qkv projection. The kernel is
csrc/rotary_embedding_cpu.c, built once per machine by cpu_build.py. Same contract as the
Triton `rotary_embedding_inplace(..., is_neox=True)` and its torch reference
`rotary_embedding_ref` (rotary_embedding.py), which the tests compare it against. Only
full rotary (cos_sin_cache has head_dim columns), as the Triton kernel.

Why: in torch, RoPE slices, casts, multiplies, concatenates and copies back, about a dozen
passes (4.9 ms for a 2,300-token prefill layer on this project's CPU).
Bound: memory, q and k read and written once, N * D floats of the cache read.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .common import check_tensor
from .cpu_build import load_cpu_library


@functools.lru_cache(maxsize=None)
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The C entry point with its argument types declared (built on first use)."""
    fn = load_cpu_library("rotary_embedding_cpu").rotary_embedding_cpu_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
    fn.restype = None
    return fn


def rotary_embedding_cpu(
    q: torch.Tensor,  # [N, Hq, D] float32, rotated in place (may be a strided view)
    k: torch.Tensor,  # [N, Hkv, D] float32, rotated in place
    positions: torch.Tensor,  # [N] int64, each < max_pos
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32, contiguous
) -> None:
    cpu = torch.device("cpu")
    check_tensor("q", q, 3, (torch.float32,), cpu)
    N, Hq, D = q.shape
    check_tensor("k", k, 3, (torch.float32,), cpu, (N, None, D))
    check_tensor("positions", positions, 1, (torch.int64,), cpu, (N,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, (torch.float32,), cpu)
    if cos_sin_cache.shape[1] != D or not cos_sin_cache.is_contiguous():
        raise ValueError(
            f"cos_sin_cache must be a contiguous [max_pos, {D}] tensor (full rotary), got {tuple(cos_sin_cache.shape)}"
        )
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if N == 0:
        return
    # The kernel indexes the cache by position; out-of-range positions would read past it.
    if int(positions.max()) >= cos_sin_cache.shape[0] or int(positions.min()) < 0:
        raise ValueError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (the cache's max_pos)")
    _kernel()(
        positions.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        cos_sin_cache.data_ptr(), N, Hq, k.shape[1], D, torch.get_num_threads(),
    )  # fmt: skip
