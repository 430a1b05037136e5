"""Linear layers, split across tensor-parallel ranks as SGLang splits them (its layers/linear.py).

Where it sits: every matmul of the decoder. In: [N, in_features] (a row-parallel layer: this
rank's slice of it); out: [N, out_features] (a column-parallel layer: this rank's slice of it).

Tensor parallelism (`--tp-size N`, docs/parallelism.md): each of N ranks holds 1/N of every
large weight; the names and the split are SGLang's (Megatron-LM's pairing):
- `ColumnParallelLinear`: W [out, in] split by output rows; rank r computes its out / N
  columns of y from the whole x. No communication.
- `QKVParallelLinear`, `MergedColumnParallelLinear`: column-parallel layers over several
  fused checkpoint tensors (q, k, v; gate, up), each split on its own, so that rank r holds
  [q_r | k_r | v_r]: its own attention heads, whole. When N exceeds the KV heads, each rank
  keeps one KV head, kv head r * num_kv_heads // N, and ranks share it (SGLang's replicas).
- `RowParallelLinear`: W split by input columns; rank r multiplies its slice of x (what a
  column-parallel layer left on it: its heads, its intermediate columns) by its columns of
  W, a partial sum; `all_reduce` adds the N partial sums; the bias is added once, after.
- `ReplicatedLinear`: every rank holds the whole weight (the MoE router).
An attention block or an MLP is column -> local work -> row: one all_reduce per block.

SGLang fuses q/k/v into one `QKVParallelLinear` and gate/up into one
`MergedColumnParallelLinear`: one matmul instead of three (two), which also matters on a
CPU. The checkpoint still stores `q_proj`, `k_proj`, `v_proj` separately, so each layer has a
`weight_loader(param, loaded_weight, shard_id)` that narrows one full checkpoint tensor to
this rank's slice and copies it into its rows (shard_id None: a tensor the checkpoint
already stores fused, split the same way). With N = 1 every slice is the whole tensor.

Parameters are created with `torch.empty` (no random init): the loader overwrites all of
them, and initialising a large model first would cost seconds for nothing.

CPU float32: after loading, the ModelRunner calls `pack_for_cpu()` on every linear layer
(on each rank, on its own slice).
The weight is reordered once into oneDNN's blocked layout (`pack_weight_for_cpu`) and the
dense copy is released, so the weights still take their size once. torch's `F.linear`
re-reads the row-major weight through MKL's generic path on every call; the packed
weight is already in the order oneDNN's matmul kernel consumes. Measured on this
project's 2-core CPU over the 30M benchmark model's matmuls: 94 -> 194 GFLOP/s at 64 rows
(a decode step at batch 64), 28 -> 95 at 8 rows, 163 -> 208 at 512 rows (docs/model_execution.md).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import GroupCoordinator

ShardId = Union[str, int]


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter, casting its dtype (bf16 file -> fp32 model)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, refused unless exact (SGLang's divide asserts; here the message
    names the config value that does not split)."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def narrow_checked(loaded_weight: torch.Tensor, dim: int, full: int, start: int, size: int) -> torch.Tensor:
    """This rank's `size` rows (along `dim`) from `start` of a checkpoint tensor whose `dim` must be `full`."""
    if loaded_weight.dim() <= dim or loaded_weight.shape[dim] != full:
        raise ValueError(
            f"shape mismatch: checkpoint {tuple(loaded_weight.shape)}, the model expects {full} along dimension {dim}"
        )
    return loaded_weight.narrow(dim, start, size)


def single_rank(tp_group: Optional[GroupCoordinator]) -> GroupCoordinator:
    """The group a layer runs in: the given one, or a group of one rank (no communication)."""
    return tp_group if tp_group is not None else GroupCoordinator(0, 1)


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


class CpuPackedWeight:
    """The oneDNN packing of a [out, in] `weight` (mixed into the linear layers and ParallelLMHead)."""

    weight: nn.Parameter
    # oneDNN-blocked weight (CPU float32, after pack_for_cpu); the dense weight is then released
    packed_weight: Optional[torch.Tensor]

    def pack_for_cpu(self) -> bool:
        """Replace the dense weight by its packed copy; False (and no change) where unsupported."""
        packed = pack_weight_for_cpu(self.weight)
        if packed is None:
            return False
        self.packed_weight = packed
        # Release the dense copy so the weights are held once; packed.to_dense() recovers it.
        self.weight.data = self.weight.data.new_empty((0, self.weight.shape[1]))
        return True

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight (this rank's slice), whether or not it has been packed."""
        return self.packed_weight.to_dense() if self.packed_weight is not None else self.weight


class LinearBase(CpuPackedWeight, nn.Module):
    """y = x W^T (+ b) over this rank's weight [out_local, in_local]; subclasses say which slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_group: Optional[GroupCoordinator]) -> None:
        super().__init__()
        self.tp_group = single_rank(tp_group)
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.in_features = in_features  # this rank's
        self.out_features = out_features  # this rank's
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out_local, in_local]
        self.bias: Optional[nn.Parameter] = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight = None

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)  # [N, out_local]


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank: the MoE router and its shared-expert gate."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, None)


class ColumnParallelLinear(LinearBase):
    """W split by output rows: rank r holds rows [r * out / N, (r + 1) * out / N) and their bias.

    x [N, in] (whole, the same on every rank) -> y [N, out / N], this rank's columns of y."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_group: Optional[GroupCoordinator] = None
    ) -> None:
        tp_size = single_rank(tp_group).world_size
        super().__init__(in_features, divide(out_features, tp_size, "the output size"), bias, tp_group)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        size = param.shape[0]
        default_weight_loader(param, narrow_checked(loaded_weight, 0, size * self.tp_size, self.tp_rank * size, size))


class _FusedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel layer whose rows are several checkpoint tensors, each split on its own.

    `shard_sizes`: each checkpoint tensor's full row count, in output order. This rank's output
    is [shard 0's slice | shard 1's slice | ...]; `shard_block` says which block of a
    shard's rows (of its local size) this rank takes."""

    def __init__(
        self, in_features: int, shard_sizes: Dict[ShardId, int], bias: bool, tp_group: Optional[GroupCoordinator]
    ) -> None:
        tp_size = single_rank(tp_group).world_size
        local = {shard_id: self.local_size(shard_id, size, tp_size) for shard_id, size in shard_sizes.items()}
        super().__init__(in_features, sum(local.values()) * tp_size, bias, tp_group)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: Dict[ShardId, Tuple[int, int]] = {}  # shard -> (first row in this rank's output, rows)
        offset = 0
        for shard_id, size in local.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def local_size(self, shard_id: ShardId, full: int, tp_size: int) -> int:
        return divide(full, tp_size, "the output size")

    def shard_block(self, shard_id: ShardId) -> int:
        return self.tp_rank

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        if shard_id is None:  # a checkpoint that stores the fused tensor: split it into its shards
            full = sum(self.shard_sizes.values())
            start = 0
            for sid, size in self.shard_sizes.items():
                self.weight_loader(param, narrow_checked(loaded_weight, 0, full, start, size), sid)
                start += size
            return
        offset, size = self.shard_offsets[shard_id]
        rows = narrow_checked(loaded_weight, 0, self.shard_sizes[shard_id], self.shard_block(shard_id) * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), rows)


class QKVParallelLinear(_FusedColumnParallelLinear):
    """q, k and v projections in one matmul: out = [q (Hq*D) | k (Hkv*D) | v (Hkv*D)] of this rank's heads.

    Rank r holds q heads [r * Hq / N, (r + 1) * Hq / N). KV heads split the same way when N
    divides them; when N exceeds them (N a multiple of them), each rank holds one, kv head
    r * Hkv // N, shared by N / Hkv ranks: the head its q heads read (SGLang's num_kv_head_replicas)."""

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False,
        tp_group: Optional[GroupCoordinator] = None,
    ) -> None:  # fmt: skip
        tp_size = single_rank(tp_group).world_size
        self.head_dim, self.total_num_kv_heads = head_dim, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")  # this rank's
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads != 0:  # (ranks share whole KV heads, the same number each)
                raise ValueError(
                    f"num_key_value_heads ({total_num_kv_heads}) must divide the tensor-parallel size {tp_size} "
                    "when it is smaller"
                )
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        sizes = {"q": total_num_heads * head_dim, "k": total_num_kv_heads * head_dim, "v": total_num_kv_heads * head_dim}
        super().__init__(hidden_size, sizes, bias, tp_group)
        self.q_size, self.kv_size = self.shard_offsets["q"][1], self.shard_offsets["k"][1]  # this rank's

    def local_size(self, shard_id: ShardId, full: int, tp_size: int) -> int:
        return self.num_heads * self.head_dim if shard_id == "q" else self.num_kv_heads * self.head_dim

    def shard_block(self, shard_id: ShardId) -> int:
        if shard_id == "q":
            return self.tp_rank
        return self.tp_rank * self.total_num_kv_heads // self.tp_size if self.tp_size >= self.total_num_kv_heads else self.tp_rank


class MergedColumnParallelLinear(_FusedColumnParallelLinear):
    """gate and up projections in one matmul: out = [gate (I / N) | up (I / N)], shards 0 and 1."""

    def __init__(
        self, in_features: int, output_sizes: List[int], bias: bool = False, tp_group: Optional[GroupCoordinator] = None
    ) -> None:
        super().__init__(in_features, dict(enumerate(output_sizes)), bias, tp_group)


class RowParallelLinear(LinearBase):
    """W split by input columns: rank r holds W[:, r * in / N : (r + 1) * in / N]; the bias whole.

    x [N, in / N] (this rank's slice: a column-parallel layer's output) -> y [N, out], the sum
    over ranks (all_reduce) plus the bias. `reduce_results=False` leaves the partial sum for
    the caller to reduce (a MoE block's shared expert, reduced once with the experts)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_group: Optional[GroupCoordinator] = None,
        reduce_results: bool = True,
    ) -> None:  # fmt: skip
        if bias and not reduce_results:  # (SGLang's rule) every rank would add it to its partial sum
            raise ValueError("a RowParallelLinear with a bias must reduce its results: the bias is added once, after the sum")
        tp_size = single_rank(tp_group).world_size
        super().__init__(divide(in_features, tp_size, "the input size"), out_features, bias, tp_group)
        self.reduce_results = reduce_results

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        if param is self.bias:  # not split: every rank holds it, and adds it after the all_reduce
            default_weight_loader(param, loaded_weight)
            return
        size = param.shape[1]
        default_weight_loader(param, narrow_checked(loaded_weight, 1, size * self.tp_size, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # one rank: the bias rides in the matmul, as before tensor parallelism
            return linear(x, self.weight, self.bias, self.packed_weight)  # [N, out]
        y = linear(x, self.weight, None, self.packed_weight)  # [N, out]: this rank's partial sum
        if not self.reduce_results:
            return y
        y = self.tp_group.all_reduce(y)  # [N, out]: the same bits on every rank
        # once, after the sum (SGLang adds it in rank 0's matmul instead: the same sum, one add apart)
        return y + self.bias if self.bias is not None else y
