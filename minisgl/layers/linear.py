"""Linear layers whose weights load from Hugging Face shards (tensor parallel size 1).

Where it sits: every matmul of the decoder. In: [N, in_features]; out: [N, out_features].

SGLang fuses q/k/v into one `QKVParallelLinear` and gate/up into one
`MergedColumnParallelLinear`: one matmul instead of three (two), which also matters on a
CPU. The checkpoint still stores `q_proj`, `k_proj`, `v_proj` separately, so each fused
layer has a `weight_loader(param, loaded_weight, shard_id)` that copies one checkpoint
tensor into its rows. minisgl runs one rank, so the names drop "Parallel".

Parameters are created with `torch.empty` (no random init): the loader overwrites all of
them, and initialising a large model first would cost seconds for nothing.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

ShardId = Union[str, int]


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter, casting its dtype (bf16 file -> fp32 model)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b). Used for o_proj, down_proj and an untied lm_head."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [N, out]


class _ShardedLinear(ReplicatedLinear):
    """A linear layer whose output rows are the concatenation of named checkpoint shards."""

    def __init__(self, in_features: int, shard_sizes: Dict[ShardId, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: Dict[ShardId, Tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Optional[ShardId]) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            default_weight_loader(param, loaded_weight)
            return
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(_ShardedLinear):
    """q, k and v projections in one matmul: out = [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden_size, sizes, bias)
        self.q_size, self.kv_size = sizes["q"], sizes["k"]


class MergedColumnLinear(_ShardedLinear):
    """gate and up projections in one matmul: out = [gate (I) | up (I)], shards 0 and 1."""

    def __init__(self, in_features: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__(in_features, {0: intermediate_size, 1: intermediate_size}, bias)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab, hidden]; also the LM head weight when embeddings are tied."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))  # [V, H]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [N, H]
