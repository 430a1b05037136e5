"""decode_attention: one new query token per request against its paged K/V (flash-decoding).

Where it sits: attention backend (triton), decode mode. In: q of the B requests of a
decode batch, the layer's K/V buffers, and `req_to_token` + `req_pool_indices` +
`seq_lens` to find each request's KV slots (any page_size: the kernel reads one
slot id per position, so pages need not be contiguous). Out: o [B, Hq, D].

    o[b, h] = softmax(scaling * q[b, h] . K_b^T) V_b,   K_b = k_buffer[req_to_token[row_b, :seq_len_b], h // G]

with G = Hq / Hkv query heads sharing one KV head (grouped-query attention).

Why two stages: a decode batch has one query row per request, so B * Hkv programs
are too few to fill a GPU when B is small. Stage 1 also splits each request's KV
length into `num_kv_splits` chunks; each program computes a partial softmax over one
chunk (output and log-sum-exp). Stage 2 merges the chunks per (request, head) with
the log-sum-exp weights. All G query heads of a KV head share one program, so each
K/V row is read from memory once per group, not once per query head.

Bound: memory. It must read every cached K and V row once: 2 * sum(seq_len) * Hkv * D
* elem bytes (+ 8 bytes of slot id per position), and does 4 * sum(seq_len) * Hq * D
FLOPs (two dot products per position and head): about Hq/Hkv FLOPs per byte for
bf16, far below any GPU's compute-to-bandwidth ratio.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, INDEX_DTYPES, check_head_dim, check_tensor, is_interpreter


def decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L]
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    scaling: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Torch reference: gather each request's K/V through req_to_token, softmax in fp32."""
    B, Hq, D = q.shape
    G = Hq // k_buffer.shape[1]
    o = torch.empty_like(q)
    for b in range(B):
        slots = req_to_token[req_pool_indices[b], : int(seq_lens[b])]  # [L_b]
        k = k_buffer[slots].float().repeat_interleave(G, dim=1)  # [L_b, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(G, dim=1)  # [L_b, Hq, D]
        s = torch.einsum("hd,lhd->hl", q[b].float(), k) * scaling  # [Hq, L_b]
        o[b] = torch.einsum("hl,lhd->hd", s.softmax(dim=-1), v).to(q.dtype)
    return o


@triton.jit
def _decode_stage1_kernel(
    Q,  # [B, Hq, D] one query per request
    K_Buffer,  # [S, Hkv, D] the layer's keys, indexed by KV slot
    V_Buffer,  # [S, Hkv, D] the layer's values
    Req_to_token,  # [R, L] KV slot of (request row, position)
    Req_pool_indices,  # [B] row of each request in Req_to_token
    Seq_lens,  # [B] positions with K/V per request (including this step's token)
    Mid_O,  # [B, Hq, NUM_SPLITS, D] fp32 out: softmax-normalised output of each split
    Mid_Lse,  # [B, Hq, NUM_SPLITS] fp32 out: log-sum-exp of each split's scores (-inf if empty)
    scaling,  # softmax scale, usually 1/sqrt(D)
    stride_qb, stride_qh,  # Q strides (batch, head); the last dim is contiguous
    stride_bs, stride_bh,  # K/V buffer strides (slot, head)
    stride_rt,  # Req_to_token row stride
    stride_mo_b, stride_mo_h, stride_mo_s,  # Mid_O strides (batch, head, split)
    stride_ml_b, stride_ml_h,  # Mid_Lse strides (batch, head)
    GROUP: tl.constexpr,  # G = Hq // Hkv query heads per KV head
    HEAD_DIM: tl.constexpr,  # D (a power of two)
    NUM_SPLITS: tl.constexpr,  # chunks each request's KV length is cut into
    BLOCK_H: tl.constexpr,  # >= max(GROUP, 16): query heads per tile (tl.dot needs >= 16 rows)
    BLOCK_N: tl.constexpr,  # KV positions per loop step
    UPCAST: tl.constexpr,  # cast loads to fp32 before the dots (interpreter: bf16 math is broken)
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)  # [BLOCK_H] query head within the group
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # [BLOCK_H] absolute query heads
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(K_Buffer.dtype.element_ty)  # tl.dot needs both operands in one dtype

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max score per head
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)  # running sum of exp(score - m_i) * v
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the request
        mask_n = offs_n < end
        slots = tl.load(Req_to_token + row * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_off = slots[None, :] * stride_bs + kv_head * stride_bh + offs_d[:, None]  # [D, BLOCK_N]
        k = tl.load(K_Buffer + kv_off, mask=mask_n[None, :], other=0.0)  # [D, BLOCK_N] (K^T)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * scaling  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the chunk has >= 1 valid position
        alpha = tl.exp(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        v_off = slots[:, None] * stride_bs + kv_head * stride_bh + offs_d[None, :]  # [BLOCK_N, D]
        v = tl.load(V_Buffer + v_off, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D]
        if UPCAST:
            v = v.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # an empty split (seq_len < NUM_SPLITS) leaves l_i == 0: lse -inf gives it weight 0 in stage 2
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    mo = Mid_O + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :]
    tl.store(mo, out, mask=mask_g[:, None])
    tl.store(Mid_Lse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_g)


@triton.jit
def _decode_stage2_kernel(
    Mid_O,  # [B, Hq, NUM_SPLITS, D] fp32 partial outputs from stage 1
    Mid_Lse,  # [B, Hq, NUM_SPLITS] fp32 log-sum-exp per split
    O,  # [B, Hq, D] out, in q's dtype
    stride_mo_b, stride_mo_h, stride_mo_s,  # Mid_O strides (batch, head, split)
    stride_ml_b, stride_ml_h,  # Mid_Lse strides (batch, head)
    stride_ob, stride_oh,  # O strides (batch, head)
    HEAD_DIM: tl.constexpr,  # D
    NUM_SPLITS: tl.constexpr,  # number of stage-1 splits
    BLOCK_S: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(Mid_Lse + b * stride_ml_b + h * stride_ml_h + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0 (all splits empty): output zeros, not NaN
    w = tl.exp(lse - m)  # [BLOCK_S] each split's share of the total softmax mass
    mo = Mid_O + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :]
    part = tl.load(mo, mask=mask_s[:, None], other=0.0)  # [BLOCK_S, D]
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty))


def _check_paged_args(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, B: int,
) -> None:
    """Checks shared by decode and extend: q heads vs KV heads, buffers, slot table."""
    _, Hq, D = q.shape
    check_tensor("k_buffer", k_buffer, 3, FLOAT_DTYPES, q.device, (None, None, D))
    check_tensor("v_buffer", v_buffer, 3, (k_buffer.dtype,), q.device, tuple(k_buffer.shape))
    if k_buffer.stride() != v_buffer.stride() or k_buffer.stride(1) != D:
        raise ValueError("k_buffer and v_buffer must be contiguous with the same strides")
    Hkv = k_buffer.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads, not a multiple of the {Hkv} KV heads")
    check_head_dim(D)
    check_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES, q.device)
    check_tensor("req_pool_indices", req_pool_indices, 1, INDEX_DTYPES, q.device, (B,))


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    req_to_token: torch.Tensor,  # [R, L] int64
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    scaling: float,
    num_kv_splits: int = 8,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query per request over its paged K/V; returns a new tensor like q."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    B, Hq, D = q.shape
    _check_paged_args(q, k_buffer, v_buffer, req_to_token, req_pool_indices, B)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, q.device, (B,))
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    o = torch.empty_like(q)
    if B == 0:
        return o
    Hkv = k_buffer.shape[1]
    group = Hq // Hkv
    mid_o = torch.empty((B, Hq, num_kv_splits, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B, Hq, num_kv_splits), dtype=torch.float32, device=q.device)
    _decode_stage1_kernel[(B, Hkv, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, scaling,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=D, NUM_SPLITS=num_kv_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=32 if is_interpreter() else 64,
        UPCAST=is_interpreter(),
    )  # fmt: skip
    _decode_stage2_kernel[(B, Hq)](
        mid_o, mid_lse, o,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=D, NUM_SPLITS=num_kv_splits, BLOCK_S=triton.next_power_of_2(num_kv_splits),
    )  # fmt: skip
    return o
