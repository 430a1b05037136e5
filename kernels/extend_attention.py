"""extend_attention: the new tokens of each request attend to its cached prefix and causally to each other.

Where it sits: attention backend (triton), EXTEND and MIXED modes (a decoding request
in a MIXED batch is an extend of length 1). In: q of the N new tokens of a ragged
batch (request b owns rows extend_start_loc[b] .. + extend_lens[b]), the layer's K/V
buffers, and req_to_token + req_pool_indices to find each request's KV slots.
Out: o [N, Hq, D].

Choice: the backend stores the new K/V (store_kv) *before* calling this kernel, so
the kernel reads the whole sequence (prefix and new tokens alike) through
req_to_token[row, 0 : prefix_len + extend_len]. One loop, one code path, any
page_size. (SGLang's kernel instead reads the prefix from the pool and the new
tokens from the k/v tensors in a second loop, saving the slot lookups for them.)

For the token at extend index i of request b (absolute position prefix_len_b + i):

    o[i, h] = softmax_j(scaling * q[i, h] . K_b[j, h // G]),  j <= prefix_len_b + i

Bound: for one request with prefix P and extend E, the FLOPs are about
4 * Hq * D * E * (P + E/2) (QK^T and PV over the causal region). The bytes it must
move are q and o (2 * E * Hq * D elements) and the request's K/V once
(2 * (P + E) * Hkv * D elements); this kernel re-reads K/V once per (query tile,
head), i.e. ceil(E / BLOCK_M) * G times more, and relies on the L2 cache for that.
Long extends are compute-bound; short ones (decodes riding in a MIXED batch) are
bandwidth-bound like decode_attention.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, is_interpreter
from .decode_attention import _check_paged_args


def extend_attention_ref(
    q: torch.Tensor,  # [N, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L]
    req_pool_indices: torch.Tensor,  # [B]
    prefix_lens: torch.Tensor,  # [B]
    extend_lens: torch.Tensor,  # [B]
    scaling: float,
) -> torch.Tensor:  # [N, Hq, D]
    """Torch reference: per request, gather its K/V and apply a causal mask offset by the prefix."""
    Hq = q.shape[1]
    G = Hq // k_buffer.shape[1]
    o = torch.empty_like(q)
    start = 0
    for b in range(len(extend_lens)):
        P, E = int(prefix_lens[b]), int(extend_lens[b])
        slots = req_to_token[req_pool_indices[b], : P + E]  # [P+E]
        k = k_buffer[slots].float().repeat_interleave(G, dim=1)  # [P+E, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(G, dim=1)  # [P+E, Hq, D]
        qb = q[start : start + E].float()  # [E, Hq, D]
        s = torch.einsum("ihd,jhd->hij", qb, k) * scaling  # [Hq, E, P+E]
        pos_q = P + torch.arange(E, device=q.device)[:, None]  # [E, 1]
        s = s.masked_fill(torch.arange(P + E, device=q.device)[None, :] > pos_q, float("-inf"))
        o[start : start + E] = torch.einsum("hij,jhd->ihd", s.softmax(dim=-1), v).to(q.dtype)
        start += E
    return o


@triton.jit
def _extend_attention_kernel(
    Q,  # [N, Hq, D] queries of the new tokens, requests concatenated
    K_Buffer,  # [S, Hkv, D] the layer's keys (new tokens already stored)
    V_Buffer,  # [S, Hkv, D] the layer's values
    O,  # [N, Hq, D] out
    Req_to_token,  # [R, L] KV slot of (request row, position)
    Req_pool_indices,  # [B] row of each request in Req_to_token
    Prefix_lens,  # [B] tokens already cached before this pass
    Extend_lens,  # [B] new tokens in this pass
    Extend_start_loc,  # [B] first row of each request in Q and O
    scaling,  # softmax scale, usually 1/sqrt(D)
    stride_qn, stride_qh,  # Q strides (token, head); the last dim is contiguous
    stride_on, stride_oh,  # O strides (token, head)
    stride_bs, stride_bh,  # K/V buffer strides (slot, head)
    stride_rt,  # Req_to_token row stride
    GROUP: tl.constexpr,  # G = Hq // Hkv query heads per KV head
    HEAD_DIM: tl.constexpr,  # D (a power of two)
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # KV positions per loop step
    UPCAST: tl.constexpr,  # cast loads to fp32 before the dots (interpreter: bf16 math is broken)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    extend_len = tl.load(Extend_lens + b).to(tl.int32)
    if m_block * BLOCK_M >= extend_len:
        return  # the grid is sized for the longest extend; shorter requests have idle tiles
    prefix_len = tl.load(Prefix_lens + b).to(tl.int32)
    q_start = tl.load(Extend_start_loc + b).to(tl.int64)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    kv_head = h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] extend index of each query row
    mask_m = offs_m < extend_len
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + (q_start + offs_m[:, None]) * stride_qn + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None], other=0.0)  # [BLOCK_M, D]
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(K_Buffer.dtype.element_ty)  # tl.dot needs both operands in one dtype
    pos_q = prefix_len + offs_m  # [BLOCK_M] absolute position of each query

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # causal: the last query row of this tile sees positions < prefix_len + its index + 1
    kv_end = tl.minimum(prefix_len + (m_block + 1) * BLOCK_M, prefix_len + extend_len)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the request
        mask_n = offs_n < kv_end
        slots = tl.load(Req_to_token + row * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_Buffer + slots[None, :] * stride_bs + kv_head * stride_bh + offs_d[:, None],
                    mask=mask_n[None, :], other=0.0)  # [D, BLOCK_N] (K^T)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * scaling  # [BLOCK_M, BLOCK_N]
        # invariant: position 0 is visible to every row, so no row is all -inf after the first step
        visible = mask_n[None, :] & (offs_n[None, :] <= pos_q[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        v = tl.load(V_Buffer + slots[:, None] * stride_bs + kv_head * stride_bh + offs_d[None, :],
                    mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D]
        if UPCAST:
            v = v.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = O + (q_start + offs_m[:, None]) * stride_on + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_m[:, None])


def extend_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [B]
    prefix_lens: torch.Tensor,  # [B]
    extend_lens: torch.Tensor,  # [B]
    scaling: float,
    max_extend_len: Optional[int] = None,
    extend_start_loc: Optional[torch.Tensor] = None,  # [B]
) -> torch.Tensor:  # [N, Hq, D]
    """Ragged-batch causal attention over paged K/V; returns a new tensor like q.

    `max_extend_len` sizes the grid; pass it from the host-side lengths
    (ForwardBatch.extend_seq_lens_cpu) to avoid a device sync. `extend_start_loc`
    (exclusive cumsum of extend_lens) is computed here when not given.
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    N, Hq, D = q.shape
    check_tensor("extend_lens", extend_lens, 1, INDEX_DTYPES, q.device)
    B = extend_lens.shape[0]
    _check_paged_args(q, k_buffer, v_buffer, req_to_token, req_pool_indices, B)
    check_tensor("prefix_lens", prefix_lens, 1, INDEX_DTYPES, q.device, (B,))
    o = torch.empty_like(q)
    if B == 0 or N == 0:
        return o
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max().item())  # device sync: callers should pass it
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_lens, dim=0) - extend_lens  # [B]
    check_tensor("extend_start_loc", extend_start_loc, 1, INDEX_DTYPES, q.device, (B,))
    Hkv = k_buffer.shape[1]
    block_m = 32 if is_interpreter() else 64
    block_n = 32 if is_interpreter() else 64
    grid = (B, Hq, triton.cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_start_loc, scaling,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=is_interpreter(),
        num_stages=pipeline_stages(block_m, block_n, D, k_buffer.element_size(), shared_memory_bytes(q.device)),
    )  # fmt: skip
    return o


SMEM_HEADROOM_BYTES = 8 * 1024  # left to the compiler's own use (reductions, barriers)


@functools.lru_cache(maxsize=None)
def shared_memory_bytes(device: torch.device) -> int:
    """Shared memory one program may take on `device` (~99 KB on consumer GPUs, 163 KB on an
    A100, 227 KB on an H100/H200); a consumer part's where torch cannot say."""
    if device.type != "cuda":
        return 99 * 1024  # (the interpreter ignores num_stages)
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 99 * 1024))


def pipeline_stages(block_m: int, block_n: int, head_dim: int, elem_bytes: int, smem_bytes: int) -> int:
    """How many K/V tiles the loop may prefetch. Triton's default of 3 takes 3 K and 3 V tiles
    besides Q: 112 KB for 64x128 bf16 tiles (over a consumer GPU's 99 KB), 224 KB for 64x256
    bf16 or 64x128 float32 (over an A100's 163 KB): a launch error, "out of resources". SGLang
    runs its extend kernel with fewer stages for the same reason. The most of 3, 2, 1 that fit."""
    q_tile = block_m * head_dim * elem_bytes
    kv_tiles = 2 * block_n * head_dim * elem_bytes  # one K and one V tile per stage
    budget = smem_bytes - SMEM_HEADROOM_BYTES
    return next((s for s in (3, 2) if q_tile + s * kv_tiles <= budget), 1)
