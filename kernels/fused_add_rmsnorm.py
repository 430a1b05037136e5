"""fused_add_rmsnorm: residual add and RMSNorm in one pass over the hidden states.

Where it sits: every decoder layer, twice (before attention and before the MLP), when
the triton backend is on. In: x [N, H] (the sublayer output), the running residual
[N, H] or None (first layer), weight [H]. Out: (out, residual_out), new tensors:

    residual_out = x + residual          (x when residual is None)
    out = residual_out / sqrt(mean(residual_out^2) + eps) * weight

computed in fp32 and stored in x.dtype. To match Hugging Face's LlamaRMSNorm bit for
bit in bf16, the kernel rounds where HF does: the sum to x.dtype before the norm,
and the normalised row to x.dtype before the weight multiply.

Bound: memory. Unfused, torch reads x and residual, writes the sum, reads it back for
the norm and writes the output: 5 * N * H elements. Fused, each row is read once and
both outputs written once: 4 * N * H elements (3 when residual is None) plus H for
the weight, and only ~4 FLOPs per element.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_tensor


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: HF's LlamaRMSNorm after the residual add (statistics in fp32)."""
    residual_out = x if residual is None else (x.float() + residual.float()).to(x.dtype)  # [N, H]
    h = residual_out.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)  # [N, H]
    return (normed.float() * weight.float()).to(x.dtype), residual_out


@triton.jit
def _fused_add_rmsnorm_kernel(
    X,  # [N, H] sublayer output
    Residual,  # [N, H] running residual (ignored when HAS_RESIDUAL is False)
    Weight,  # [H] RMSNorm scale
    Out,  # [N, H] out: normalised hidden states
    Residual_out,  # [N, H] out: x + residual
    stride_x,  # X row stride
    stride_r,  # Residual row stride
    stride_o,  # Out row stride
    stride_ro,  # Residual_out row stride
    H,  # hidden size
    eps,  # added to the mean square before the rsqrt
    HAS_RESIDUAL: tl.constexpr,  # False for the first layer: residual_out = x
    BLOCK: tl.constexpr,  # next power of two >= H: one program holds a whole row
):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    h = tl.load(X + i * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if HAS_RESIDUAL:
        h += tl.load(Residual + i * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h = h.to(Residual_out.dtype.element_ty)  # round the sum to the model dtype, as HF does
    tl.store(Residual_out + i * stride_ro + offs, h, mask=mask)
    h = h.to(tl.float32)
    # masked lanes hold 0, so the sum over BLOCK is the sum over H
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    normed = (h * rstd).to(Out.dtype.element_ty).to(tl.float32)  # HF rounds before the weight
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + i * stride_o + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def fused_add_rmsnorm(
    x: torch.Tensor,  # [N, H]
    residual: Optional[torch.Tensor],  # [N, H] or None
    weight: torch.Tensor,  # [H]
    eps: float,
) -> Tuple[torch.Tensor, torch.Tensor]:  # ([N, H], [N, H])
    """Return (rmsnorm(x + residual) * weight, x + residual), both new tensors in x.dtype."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    N, H = x.shape
    if residual is not None:
        check_tensor("residual", residual, 2, FLOAT_DTYPES, x.device, (N, H))
    check_tensor("weight", weight, 1, FLOAT_DTYPES, x.device, (H,))
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    if N == 0:
        return out, residual_out
    block = triton.next_power_of_2(H)
    _fused_add_rmsnorm_kernel[(N,)](
        x, x if residual is None else residual, weight, out, residual_out,
        x.stride(0), x.stride(0) if residual is None else residual.stride(0),
        out.stride(0), residual_out.stride(0), H, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),  # wide rows: more warps, fewer registers per thread
    )  # fmt: skip
    return out, residual_out
