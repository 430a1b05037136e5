"""Linear layers whose weights load from Hugging Face shards (tensor parallel size 1).

Where it sits: every matmul of the decoder. In: [N, in_features]; out: [N, out_features].

SGLang fuses q/k/v into one `QKVParallelLinear` and gate/up into one
`MergedColumnParallelLinear`: one matmul instead of three (two), which also matters on a
CPU. The checkpoint still stores `q_proj`, `k_proj`, `v_proj` separately, so each fused
layer has a `weight_loader(param, loaded_weight, shard_id)` that copies one checkpoint
tensor into its rows. minisgl runs one rank, so the names drop "Parallel".

Parameters are created with `torch.empty` (no random init): the loader overwrites all of
them, and initialising a large model first would cost seconds for nothing.

CPU float32: after loading, the ModelRunner calls `pack_for_cpu()` on every linear layer.
The weight is reordered once into oneDNN's blocked layout (`pack_weight_for_cpu`) and the
dense copy is released, so the weights still take their size once. torch's `F.linear`
re-reads the row-major weight through MKL's generic path on every call; the packed
weight is already in the order oneDNN's matmul kernel consumes. Measured on this
project's 2-core CPU over the 30M benchmark model's matmuls: 94 -> 194 GFLOP/s at 64 rows
(a decode step at batch 64), 28 -> 95 at 8 rows, 163 -> 208 at 512 rows (docs/model_execution.md).
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


# The packing depends a little on the expected row count; decode batches of tens of rows
# are where it matters most (measured: one packing serves 1..2,048 rows within 5% of the best).
_PACK_ROWS_HINT = 64


def pack_weight_for_cpu(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The [out, in] float32 CPU weight reordered for oneDNN's matmul, or None where unsupported.

    None (keep using F.linear) when the weight is not float32 on the CPU, when this torch
    build lacks oneDNN, or when a probe multiply through the packed weight disagrees with
    F.linear.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        probe = weight.new_ones((2, weight.shape[1])) / weight.shape[1]  # [2, in]
        ok = torch.allclose(linear(probe, weight, packed=packed), F.linear(probe, weight), rtol=1e-4, atol=1e-5)
    except (RuntimeError, AttributeError):  # op missing from this build, or no kernel for this CPU
        return None
    return packed if ok else None


EXACT_PACKED_ROWS = 64


def packed_rows(n: int) -> int:
    """The row count a packed multiply of n rows runs at.

    oneDNN builds a primitive for every distinct row count and keeps it (0.6-4 MB each, in a
    cache of 1,024): fed every prefill size a server meets, the scheduler grew by GBs (1.2 GB
    after 600 prompt lengths). Decode-sized counts (up to 64) stay exact; above, the rows are
    padded with zeros to a multiple of 8 (to 256) or of 64, so a server meets ~100 counts at
    most, for at most 7 (or 63) rows of extra work on a 65-256 (or 257+) row multiply."""
    if n <= EXACT_PACKED_ROWS:
        return n
    step = 8 if n <= 256 else 64
    return -(-n // step) * step


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, packed: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x W^T (+ b) through the packed weight when there is one, else F.linear. x: [N, in]."""
    if packed is None:
        return F.linear(x, weight, bias)  # [N, out]
    n = x.shape[0]
    if n <= EXACT_PACKED_ROWS:  # decode sizes: as they come (the common, per-token path)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [N, out]
    rows = packed_rows(n)
    if rows != n:
        x = F.pad(x, (0, 0, 0, rows - n))  # [rows, in]: zero rows, dropped again below
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:n]  # [N, out]


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b). Used for o_proj, down_proj and an untied lm_head."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # oneDNN-blocked weight (CPU float32, after pack_for_cpu); the dense weight is then released
        self.packed_weight: Optional[torch.Tensor] = None

    def pack_for_cpu(self) -> bool:
        """Replace the dense weight by its packed copy; False (and no change) where unsupported."""
        packed = pack_weight_for_cpu(self.weight)
        if packed is None:
            return False
        self.packed_weight = packed
        # Release the dense copy so the weights are held once; packed.to_dense() recovers it.
        self.weight.data = self.weight.data.new_empty((0, self.in_features))
        return True

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight, whether or not it has been packed."""
        return self.packed_weight.to_dense() if self.packed_weight is not None else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)  # [N, out]


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
