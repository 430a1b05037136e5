"""AttentionBackend: the interface every attention implementation fills (cpu, torch, triton).

Where it sits: model -> RadixAttention layer -> `forward_batch.attn_backend.forward(...)`.
The backend first stores the new K/V of this pass at `forward_batch.out_cache_loc`
(through `forward_batch.token_to_kv_pool.set_kv_buffer` or a kernel), then attends:
- extend (and MIXED): the new tokens of each request attend to the request's cached
  prefix (read from the paged pool through req_to_token) and causally to each other;
- decode: one query per request attends to its whole sequence in the pool.
Switching backends changes no scheduler or model code (issue: Triton kernels).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute per-batch indices once, before the layers run (optional)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer_id: int,
        scaling: float,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
