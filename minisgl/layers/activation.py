"""SiluAndMul: the gate of the gated SiLU MLP (Llama, Qwen, Mistral).

Where it sits: decoder layer -> MLP: gate_up_proj -> SiluAndMul -> down_proj.
In: [N, 2 * intermediate] (gate and up concatenated by one matmul); out: [N, intermediate].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self, kernels: str = "torch") -> None:
        super().__init__()
        self.kernels = kernels  # "cpu": the C kernel minisgl.kernels.silu_and_mul_cpu; otherwise torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "cpu":
            from minisgl.kernels.silu_and_mul_cpu import silu_and_mul_cpu

            return silu_and_mul_cpu(x)  # [N, I]
        gate, up = x.chunk(2, dim=-1)  # [N, I] each
        return F.silu(gate) * up  # [N, I]
