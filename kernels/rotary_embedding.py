"""rotary_embedding_inplace: rotate q and k by their token's position (RoPE), in place.

Where it sits: every attention layer, after the qkv projection and before the
attention backend, when the triton backend is on. In: q [N, Hq, D], k [N, Hkv, D],
positions [N] (ForwardBatch.positions), cos_sin_cache [max_pos, D] with cos(pos *
inv_freq) in the first D/2 columns and sin in the last D/2. Out: nothing; q and k
are overwritten.

For each head vector x and position p, with c = cos[p], s = sin[p] (each D/2 long):
- neox style (is_neox=True, Llama/Qwen/Mistral in HF): x1 = x[:D/2], x2 = x[D/2:]
      x[:D/2] = x1 * c - x2 * s;   x[D/2:] = x2 * c + x1 * s
- GPT-J style (is_neox=False): the same on interleaved pairs x1 = x[0::2], x2 = x[1::2].

Only full rotary (the rotated width equals head_dim) is supported. Positions must be
< max_pos; they are not checked on the host because that would need a device sync.

Bound: memory. It reads and writes q and k once (2 * N * (Hq + Hkv) * D elements) and
reads one cache row per token (N * D elements); 6 FLOPs per pair of elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, INDEX_DTYPES, check_tensor


def rotary_embedding_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: returns rotated copies of q and k (computed in fp32)."""
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions, :half].float()[:, None, :]  # [N, 1, D/2]
    sin = cos_sin_cache[positions, half:].float()[:, None, :]  # [N, 1, D/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = (xf[..., :half], xf[..., half:]) if is_neox else (xf[..., 0::2], xf[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # [N, H, D/2] each
        out = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
        return out.to(x.dtype)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(
    X,  # base pointer of this token's [num_heads, D] block of q or k
    stride_h,  # elements between heads
    cos,  # [HALF] fp32 cos of this token's position
    sin,  # [HALF] fp32 sin of this token's position
    num_heads,  # heads in this block
    BLOCK_H: tl.constexpr,  # next power of two >= num_heads
    HALF: tl.constexpr,  # D / 2
    IS_NEOX: tl.constexpr,  # halves (True) or interleaved pairs (False)
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    if IS_NEOX:
        idx1 = offs_d  # first half
        idx2 = offs_d + HALF  # second half
    else:
        idx1 = offs_d * 2  # even lanes
        idx2 = offs_d * 2 + 1  # odd lanes
    p1 = X + offs_h[:, None] * stride_h + idx1[None, :]  # [BLOCK_H, HALF]
    p2 = X + offs_h[:, None] * stride_h + idx2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(X.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos[None, :] + x1 * sin[None, :]).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,  # [N, Hq, D] queries, rotated in place
    K,  # [N, Hkv, D] keys, rotated in place
    Positions,  # [N] position of each token
    Cos_sin_cache,  # [max_pos, D] cos | sin per position
    stride_qn, stride_qh,  # Q strides (token, head); the last dim is contiguous
    stride_kn, stride_kh,  # K strides (token, head)
    stride_cache,  # Cos_sin_cache row stride
    num_q_heads,  # Hq
    num_kv_heads,  # Hkv
    BLOCK_HQ: tl.constexpr,  # next power of two >= Hq
    BLOCK_HK: tl.constexpr,  # next power of two >= Hkv
    HALF: tl.constexpr,  # D / 2 (a power of two)
    IS_NEOX: tl.constexpr,  # rotation layout, see the module docstring
):
    i = tl.program_id(0).to(tl.int64)  # one program per token: all its q and k heads
    pos = tl.load(Positions + i).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(Cos_sin_cache + pos * stride_cache + offs_d).to(tl.float32)  # [HALF]
    sin = tl.load(Cos_sin_cache + pos * stride_cache + HALF + offs_d).to(tl.float32)  # [HALF]
    _rotate_heads(Q + i * stride_qn, stride_qh, cos, sin, num_q_heads, BLOCK_HQ, HALF, IS_NEOX)
    _rotate_heads(K + i * stride_kn, stride_kh, cos, sin, num_kv_heads, BLOCK_HK, HALF, IS_NEOX)


def rotary_embedding_inplace(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    positions: torch.Tensor,  # [N] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    is_neox: bool = True,
) -> None:
    """Rotate q and k in place by RoPE at `positions`. q and k may be strided views (e.g. of a qkv tensor)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    N, Hq, D = q.shape
    check_tensor("k", k, 3, (q.dtype,), q.device, (N, None, D))
    check_tensor("positions", positions, 1, INDEX_DTYPES, q.device, (N,))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES, q.device)
    if cos_sin_cache.shape[1] != D:
        raise ValueError(
            f"cos_sin_cache has {cos_sin_cache.shape[1]} columns but head_dim is {D}: only full rotary is supported"
        )
    if D < 2 or (D // 2) & (D // 2 - 1):
        raise ValueError(f"head_dim / 2 must be a power of two, got head_dim {D}")
    if N == 0:
        return
    Hkv = k.shape[1]
    _rotary_kernel[(N,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), Hq, Hkv,
        BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hkv), HALF=D // 2, IS_NEOX=is_neox,
    )  # fmt: skip
