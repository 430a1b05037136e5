"""silu_and_mul_cpu: out = silu(gate) * up for the gated MLP, float32 on the CPU (C through ctypes).

Where it sits: SiluAndMul (minisgl/layers/activation.py) when the `cpu` attention backend is
on: every decoder layer's MLP, between gate_up_proj and down_proj. In: x [N, 2I] (gate and
up side by side, as the merged projection writes them); out: [N, I]. The kernel is
csrc/silu_and_mul_cpu.c (its exp is cpu_math.h's polynomial), built once per machine by
cpu_build.py; `silu_and_mul_ref` below is the torch reference the tests compare it against.

Why: torch runs chunk + silu + mul, two passes and a temporary; at decode sizes the dispatch
of those ops costs more than the arithmetic.
Bound: memory, 3 * N * I floats moved.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from .common import check_tensor
from .cpu_build import load_cpu_library


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: x [N, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.lru_cache(maxsize=None)
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The C entry point with its argument types declared (built on first use)."""
    fn = load_cpu_library("silu_and_mul_cpu").silu_and_mul_cpu_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_int]
    fn.restype = None
    return fn


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:  # x [N, 2I] float32, rows may be strided -> [N, I]
    check_tensor("x", x, 2, (torch.float32,), torch.device("cpu"))
    N, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x must hold gate and up side by side (an even width), got {two_i} columns")
    out = torch.empty((N, two_i // 2), dtype=torch.float32)
    if N:
        _kernel()(x.data_ptr(), x.stride(0), out.data_ptr(), N, two_i // 2, torch.get_num_threads())
    return out
