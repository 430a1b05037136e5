"""fused_add_rmsnorm_cpu: residual add and RMSNorm in one pass, float32 on the CPU (C through ctypes).

Where it sits: RMSNorm (minisgl/layers/layernorm.py) when the `cpu` attention backend is on:
every decoder layer twice, per head on q/k (Qwen3), and after the last layer. The kernel is
csrc/fused_add_rmsnorm_cpu.c, built once per machine by cpu_build.py. Same contract as the
Triton `fused_add_rmsnorm` and its torch reference `fused_add_rmsnorm_ref`
(fused_add_rmsnorm.py), which the tests compare it against:

    residual_out = x + residual          (x itself when residual is None)
    out = residual_out / sqrt(mean(residual_out^2) + eps) * weight

Why: torch runs this as six ops, each a pass over the rows plus its dispatch cost; at decode
sizes the dispatch dominates (8 layers x 4 norms per step).
Bound: memory, 4 * N * H floats moved (3 without a residual), ~4 FLOPs per element.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional, Tuple

import torch

from .common import check_tensor
from .cpu_build import load_cpu_library


@functools.lru_cache(maxsize=None)
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The C entry point with its argument types declared (built on first use)."""
    fn = load_cpu_library("fused_add_rmsnorm_cpu").fused_add_rmsnorm_cpu_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = None
    return fn


def fused_add_rmsnorm_cpu(
    x: torch.Tensor,  # [N, H] float32, rows may be strided, H contiguous
    residual: Optional[torch.Tensor],  # [N, H] float32 or None (first layer)
    weight: torch.Tensor,  # [H] float32
    eps: float,
) -> Tuple[torch.Tensor, torch.Tensor]:  # (out [N, H], residual_out [N, H]), both new unless residual is None
    cpu = torch.device("cpu")
    check_tensor("x", x, 2, (torch.float32,), cpu)
    N, H = x.shape
    check_tensor("weight", weight, 1, (torch.float32,), cpu, (H,))
    if residual is not None:
        check_tensor("residual", residual, 2, (torch.float32,), cpu, (N, H))
    out = torch.empty((N, H), dtype=torch.float32)
    residual_out = x if residual is None else torch.empty((N, H), dtype=torch.float32)
    if N == 0:
        return out, residual_out
    _kernel()(
        x.data_ptr(), x.stride(0),
        None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        weight.data_ptr(), out.data_ptr(), residual_out.data_ptr(), N, H, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, residual_out
