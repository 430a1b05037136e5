"""decode_attention_cpu: one query token per request against its paged K/V, on the CPU, in place.

Where it sits: attention backend `cpu` (minisgl/layers/attention/cpu_backend.py), decode mode;
one call per layer per decode step. The kernel is C (csrc/decode_attention_cpu.c), built once
per machine by cpu_build.py and called through ctypes with the tensors' data pointers.
Same contract as the Triton `decode_attention` and its torch reference `decode_attention_ref`
(decode_attention.py), which the tests compare it against:

    o[b, h] = softmax(scaling * q[b, h] . K_b^T) V_b,   K_b = k_buffer[req_to_token[row_b, :seq_len_b], h // G]

Why: the torch backend gathers each request's K/V out of the pool into a contiguous copy
before SDPA, on every layer of every decode step: it moves the KV history three times
(read, write the copy, read the copy). This kernel reads each cached row once, where it
lies (any page_size, scattered slots). On this project's 2-core CPU, 64 requests of
64-512 (+30 decoded) tokens: see docs/kernels.md for the measured times.

Bound: memory. Bytes 2 * sum(seq_len) * Hkv * D * 4 (+ 8 per position for the slot id);
FLOPs 4 * sum(seq_len) * Hq * D. q, out and all arithmetic are float32; the K/V pool may be
float32 or bfloat16 (`--kv-cache-dtype bfloat16`: 2 bytes per element instead of 4, which is
what bounds this kernel; each element is widened to float32 as it is read).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from .common import check_tensor
from .cpu_build import load_cpu_library

_LIB_NAME = "decode_attention_cpu"
# The pool's dtypes the kernel reads: the model's float32, or bfloat16 (--kv-cache-dtype bfloat16).
KV_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The C entry point with its argument types declared (built on first use)."""
    fn = load_cpu_library(_LIB_NAME).decode_attention_cpu_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr, i64, i64,  # q and its strides
        ptr, ptr, ctypes.c_int,  # k_buffer, v_buffer, kv_bf16
        ptr, i64, ptr, ptr,  # req_to_token, its stride, req_pool_indices, seq_lens
        ptr, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int,  # out, B, Hq, Hkv, D, scaling, num_threads
    ]  # fmt: skip
    fn.restype = ctypes.c_int
    return fn


def decode_attention_cpu(
    q: torch.Tensor,  # [B, Hq, D] float32, rows may be strided (a view of the qkv projection)
    k_buffer: torch.Tensor,  # [S, Hkv, D] float32 or bfloat16, contiguous: this layer's keys by KV slot
    v_buffer: torch.Tensor,  # [S, Hkv, D] same dtype, contiguous: this layer's values
    req_to_token: torch.Tensor,  # [R, max_context_len] int64: KV slot of each position
    req_pool_indices: torch.Tensor,  # [B] int64: req_to_token row of each request
    seq_lens: torch.Tensor,  # [B] int64: positions each request attends to (this token included)
    scaling: float,
    out: Optional[torch.Tensor] = None,  # [B, Hq, D] float32, contiguous; allocated if None
    num_threads: Optional[int] = None,  # OpenMP threads; default torch.get_num_threads()
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query per request over its paged K/V; every slot id must be < S."""
    cpu = torch.device("cpu")
    check_tensor("q", q, 3, (torch.float32,), cpu)
    B, Hq, D = q.shape
    check_tensor("k_buffer", k_buffer, 3, KV_DTYPES, cpu, (None, None, D))
    check_tensor("v_buffer", v_buffer, 3, (k_buffer.dtype,), cpu, tuple(k_buffer.shape))
    if not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError("k_buffer and v_buffer must be contiguous [S, Hkv, D] tensors")
    Hkv = k_buffer.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads, not a multiple of the {Hkv} KV heads")
    check_tensor("req_to_token", req_to_token, 2, (torch.int64,), cpu)
    check_tensor("req_pool_indices", req_pool_indices, 1, (torch.int64,), cpu, (B,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int64,), cpu, (B,))
    if out is None:
        out = torch.empty((B, Hq, D), dtype=torch.float32)
    check_tensor("out", out, 3, (torch.float32,), cpu, (B, Hq, D))
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if B == 0:
        return out
    # The kernel trusts these to stay inside req_to_token; both are [B], so checking is cheap.
    if int(seq_lens.max()) > req_to_token.shape[1] or int(seq_lens.min()) < 1:
        raise ValueError(f"seq_lens must lie in [1, {req_to_token.shape[1]}] (req_to_token's width)")
    if int(req_pool_indices.max()) >= req_to_token.shape[0] or int(req_pool_indices.min()) < 0:
        raise ValueError(f"req_pool_indices must lie in [0, {req_to_token.shape[0]})")
    failed = _kernel()(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_buffer.data_ptr(), v_buffer.data_ptr(), int(k_buffer.dtype == torch.bfloat16),
        req_to_token.data_ptr(), req_to_token.stride(0),
        req_pool_indices.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), B, Hq, Hkv, D, scaling,
        num_threads if num_threads is not None else torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("decode_attention_cpu could not allocate its scratch buffers")
    return out
