"""RMSNorm, with the residual add fused in (SGLang's `RMSNorm.forward(x, residual)`).

Where it sits: model -> decoder layer -> RMSNorm, before attention, before the MLP, at the
end of the stack, and per head on q/k (Qwen3). In: hidden states; out: normalised hidden
states and the running residual stream.

Contract shared with the Triton kernel `minisgl.kernels.fused_add_rmsnorm.fused_add_rmsnorm`
(x [N, H], residual [N, H] | None, weight [H], eps) -> (out, residual_out):
    residual_out = x + residual   (or x when residual is None)
    out          = rmsnorm(residual_out) * weight
The torch path below is the reference those kernels are tested against.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn


def rmsnorm_reference(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of fused_add_rmsnorm. Statistics in float32, like transformers."""
    residual_out = x if residual is None else x + residual  # [N, H], in the model dtype
    h = residual_out.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)  # [N, H] float32
    # transformers casts back to the input dtype before the weight multiply; so do we.
    return weight * h.to(x.dtype), residual_out


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: str = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.kernels = kernels  # "torch" (the reference below), "triton" or "cpu" (minisgl.kernels)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [N, H], residual [N, H] | None -> (out [N, H], residual_out [N, H])."""
        if self.kernels == "triton":
            from minisgl.kernels.fused_add_rmsnorm import fused_add_rmsnorm

            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if self.kernels == "cpu":
            from minisgl.kernels.fused_add_rmsnorm_cpu import fused_add_rmsnorm_cpu

            return fused_add_rmsnorm_cpu(x, residual, self.weight, self.eps)
        return rmsnorm_reference(x, residual, self.weight, self.eps)
