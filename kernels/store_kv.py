"""store_kv: write the new K and V of one forward pass into a layer's paged KV buffers.

Where it sits: attention backend (triton) -> store_kv -> k_buffer/v_buffer of
MHATokenToKVPool. In: k, v of the N tokens of this pass and `loc` (= ForwardBatch
.out_cache_loc, one KV slot per token). Out: nothing; rows `loc` of the buffers are
overwritten and every other row (slot 0, the padding slot, in particular) is untouched.

    k_buffer[loc[i]] = k[i];  v_buffer[loc[i]] = v[i]      for i in 0..N-1

Bound: pure data movement. It reads N * Hkv * D elements of k and of v and writes
the same amount into the buffers (+ N * 8 bytes of loc): 4 * N * Hkv * D * elem bytes
in all, zero FLOPs, so its speed is the device's copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, INDEX_DTYPES, check_tensor


def store_kv_ref(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Torch reference: an indexed copy (what MHATokenToKVPool.set_kv_buffer does)."""
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)


@triton.jit
def _store_kv_kernel(
    K_Buffer,  # [S, Hkv, D] destination for keys
    V_Buffer,  # [S, Hkv, D] destination for values
    Loc,  # [N] KV slot of each new token
    K,  # [N, Hkv, D] new keys
    V,  # [N, Hkv, D] new values
    stride_buf_s,  # elements between consecutive slots of the buffers (rows are Hkv*D contiguous)
    stride_k_n,  # elements between consecutive tokens of K
    stride_k_h,  # elements between consecutive heads of K
    stride_v_n,  # elements between consecutive tokens of V
    stride_v_h,  # elements between consecutive heads of V
    HEAD_DIM: tl.constexpr,  # D
    ROW: tl.constexpr,  # Hkv * D, the elements of one token's K (or V)
    BLOCK: tl.constexpr,  # next power of two >= ROW
):
    # one program per token: copy its whole [Hkv, D] row of K and of V
    i = tl.program_id(0)
    slot = tl.load(Loc + i).to(tl.int64)  # int64: slot * stride may exceed 2^31 on a big pool
    offs = tl.arange(0, BLOCK)  # [BLOCK] flat index into the [Hkv, D] row
    mask = offs < ROW
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(K + i * stride_k_n + head * stride_k_h + dim, mask=mask)
    v = tl.load(V + i * stride_v_n + head * stride_v_h + dim, mask=mask)
    # the store casts to the buffer's dtype (e.g. fp32 activations into a bf16 pool)
    tl.store(K_Buffer + slot * stride_buf_s + offs, k.to(K_Buffer.dtype.element_ty), mask=mask)
    tl.store(V_Buffer + slot * stride_buf_s + offs, v.to(V_Buffer.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [N] int64
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
) -> None:
    """Write k, v at rows `loc` of k_buffer, v_buffer (in place). Checks every argument first."""
    check_tensor("k_buffer", k_buffer, 3, FLOAT_DTYPES)
    S, Hkv, D = k_buffer.shape
    dev = k_buffer.device
    check_tensor("v_buffer", v_buffer, 3, (k_buffer.dtype,), dev, (S, Hkv, D))
    if not (k_buffer.is_contiguous() and v_buffer.is_contiguous()):
        raise ValueError("k_buffer and v_buffer must be contiguous (one [Hkv*D] row per slot)")
    check_tensor("loc", loc, 1, INDEX_DTYPES, dev)
    N = loc.shape[0]
    check_tensor("k", k, 3, FLOAT_DTYPES, dev, (N, Hkv, D))
    check_tensor("v", v, 3, FLOAT_DTYPES, dev, (N, Hkv, D))
    if N == 0:
        return
    row = Hkv * D
    _store_kv_kernel[(N,)](
        k_buffer, v_buffer, loc, k, v,
        k_buffer.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEAD_DIM=D, ROW=row, BLOCK=triton.next_power_of_2(row),
    )  # fmt: skip
