"""RadixAttention: the attention layer the model calls; the backend does the work.

Where it sits: decoder layer -> attention module -> RadixAttention -> 
`forward_batch.attn_backend.forward(q, k, v, layer_id, scaling, forward_batch)`.
In: q [N, Hq, D], k/v [N, Hkv, D] of the tokens of this pass; out: [N, Hq, D].
The layer holds only its shape and layer id (which K/V buffer of the pool is its own);
which backend runs (cpu, torch or triton) is chosen by the ModelRunner, not the model.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return forward_batch.attn_backend.forward(q, k, v, self.layer_id, self.scaling, forward_batch)  # [N, Hq, D]
