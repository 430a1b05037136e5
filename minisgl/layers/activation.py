"""SiluAndMul: the gate of the gated SiLU MLP (Llama, Qwen, Mistral).

Where it sits: decoder layer -> MLP: gate_up_proj -> SiluAndMul -> down_proj.
In: [N, 2 * intermediate] (gate and up concatenated by one matmul); out: [N, intermediate].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [N, I] each
        return F.silu(gate) * up  # [N, I]
