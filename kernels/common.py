"""Shared helpers for the kernel wrappers: argument checks and interpreter detection.

Every wrapper in kernels/ validates its tensors here before launching, so a wrong
shape, dtype, device or stride fails with a ValueError that names the argument,
instead of a silent out-of-bounds read inside a kernel.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)


def is_interpreter() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1).

    The interpreter's bf16 arithmetic is broken (docs/kernels.md), so kernels load
    tensors and cast them to fp32 before any math when this is true.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: Iterable[torch.dtype],
    device: Optional[torch.device] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    last_dim_contiguous: bool = True,
) -> None:
    """Raise ValueError naming `name` unless `t` has the rank, dtype, device and shape asked for.

    `shape` entries that are None are not checked. `last_dim_contiguous` asks for
    stride 1 on the last dim: kernels load rows as contiguous vectors.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all tensors must share a device)")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ValueError(f"{name} has shape {tuple(t.shape)}: dim {i} must be {want}")
    if last_dim_contiguous and t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 on its last dim, got strides {t.stride()}")


def check_head_dim(head_dim: int) -> None:
    """The attention kernels tile one head in registers: D must be a power of two >= 16."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton attention kernels, got {head_dim}")
