"""Sparse mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral): the MLP of a MoE layer.

Where it sits: decoder layer -> post_attention_layernorm -> SparseMoeBlock (in place of the
dense DecoderMLP on the layers MoeConfig.sparse_layers names) -> residual add.
In: [N, hidden], every token of the batch (extend and decode alike); out: [N, hidden].
Owns: the router (`gate`), the experts' stacked weights and, for Qwen2-MoE, the shared expert.

Per token x (transformers' math; SGLang's select_experts + fused_experts):
    probs = softmax(gate(x)) in float32                            # [E]
    w, ids = topk(probs, k); w = w / sum(w) when renormalize       # [k] each
    out = sum_j w_j * down[ids_j] @ (silu(gate_proj[ids_j] x) * up_proj[ids_j] x)
    out += sigmoid(shared_expert_gate(x)) * shared_expert(x)       # Qwen2-MoE only

Weights: `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
`experts.down_proj` [E, H, I], the names and shapes transformers 5 holds in memory (SGLang
calls them w13_weight and w2_weight). Hub checkpoints store one tensor per expert
(`experts.{e}.gate_proj.weight`, ...; Mixtral's w1/w3/w2): `MoeExperts.weight_loader` copies
each into its slice; a checkpoint that stores them stacked loads whole.

Tensor parallelism (`--tp-size N`, SGLang's MoE TP without expert parallelism): every rank
holds every expert, each expert's intermediate dimension split N ways, as a dense MLP's is:
gate_up_proj [E, 2I/N, H] (column-parallel: the rank's gate rows, then its up rows) and
down_proj [E, H, I/N] (row-parallel). The router is replicated, so every rank picks the same
experts for a token; each rank adds its partial sums of the chosen experts' outputs, the
shared expert adds its own (its down_proj does not reduce), and ONE all_reduce after the
weighted combine sums the ranks: a routing weight and the shared expert's sigmoid gate are
the same on every rank, so scaling the partial sums scales their total.

`run_experts` is the plain torch path, used on the CPU and on CUDA: the N*k (token, expert)
pairs are sorted by expert, every expert that got a token runs its two matmuls once on its
rows, and the outputs are added back to their tokens, weighted. There is no fused MoE kernel
and no expert parallelism (docs/model_execution.md).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import GroupCoordinator
from minisgl.layers.activation import SiluAndMul
from minisgl.layers.linear import ReplicatedLinear, default_weight_loader, divide, narrow_checked, single_rank

# (expert, half): half 0 = the gate rows, 1 = the up rows of gate_up_proj; None = all of down_proj[expert]
ExpertShard = Tuple[int, Optional[int]]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each token's k most probable experts, and their routing weights.

    router_logits [N, E] (model dtype) -> (topk_weights [N, k] float32, topk_ids [N, k] int64).
    The softmax runs in float32 over all E experts, before the top-k (transformers' routers and
    SGLang's select_experts with softmax scoring); `renormalize` (norm_topk_prob; Mixtral always)
    then divides the k chosen probabilities by their sum.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [N, k] each
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)  # [N, k]
    return topk_weights, topk_ids


def run_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: nn.Module,
) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), one matmul pair per active expert.

    x [N, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; topk_weights, topk_ids [N, k]; act_fn
    maps [M, 2I] (gate | up) to [M, I]. Returns [N, H] in x's dtype.
    """
    num_experts, k = gate_up_proj.shape[0], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)  # [N*k]: pair p is token p // k's choice p % k
    order = torch.argsort(flat_ids, stable=True)  # [N*k] pairs grouped by expert, tokens ascending within
    pair_token = order // k  # [N*k] the token of each sorted pair
    pair_weight = topk_weights.reshape(-1)[order]  # [N*k] float32
    # how many pairs each expert got: the one host read per layer (a GPU sync), to slice the groups
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    out = torch.zeros_like(x)  # [N, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue  # an expert no token chose costs nothing
        rows = pair_token[start : start + count]  # [c] token ids (a token appears once per expert)
        h = act_fn(F.linear(x[rows], gate_up_proj[expert]))  # [c, 2I] -> [c, I]
        h = F.linear(h, down_proj[expert])  # [c, H]
        # weighted in float32, as Mixtral's float32 router weights do, then back to x's dtype
        out.index_add_(0, rows, (h.float() * pair_weight[start : start + count, None]).to(out.dtype))
        start += count
    return out


class MoeExperts(nn.Module):
    """E gated-SiLU experts, stacked: gate_up_proj [E, 2I/N, H], down_proj [E, H, I/N] (this rank's I/N columns)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, kernels: str = "torch",
        tp_group: Optional[GroupCoordinator] = None,
    ) -> None:  # fmt: skip
        super().__init__()
        group = single_rank(tp_group)
        self.tp_rank, self.tp_size = group.rank_in_group, group.world_size
        self.num_experts, self.intermediate_size = num_experts, intermediate_size  # I, every rank's experts' width
        self.local_intermediate_size = divide(intermediate_size, self.tp_size, "each expert's intermediate size")
        i = self.local_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size))  # [E, 2I/N, H]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, i))  # [E, H, I/N]
        self.act_fn = SiluAndMul(kernels)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Optional[ExpertShard]) -> None:
        """Copy this rank's slice of one expert's checkpoint tensor (shard_id None: of the whole stacked tensor)."""
        full, local, start = self.intermediate_size, self.local_intermediate_size, self.tp_rank * self.local_intermediate_size
        if shard_id is None:  # stacked [E, 2I, H] or [E, H, I]: the same slices, every expert at once
            if param is self.down_proj:
                default_weight_loader(param, narrow_checked(loaded_weight, 2, full, start, local))
                return
            for half in (0, 1):  # gate rows, then up rows, each narrowed to this rank's
                rows = narrow_checked(loaded_weight, 1, 2 * full, half * full + start, local)
                default_weight_loader(param.data.narrow(1, half * local, local), rows)
            return
        expert, half = shard_id
        if not 0 <= expert < self.num_experts:  # checked here too: a negative index would wrap
            raise ValueError(f"there is no expert {expert}: the config has num_experts={self.num_experts}")
        target = param.data[expert]  # [2I/N, H] or [H, I/N]
        if half is None:  # down [H, I]: this rank's input columns
            default_weight_loader(target, narrow_checked(loaded_weight, 1, full, start, local))
            return
        rows = narrow_checked(loaded_weight, 0, full, start, local)  # gate or up [I, H]: this rank's rows
        default_weight_loader(target.narrow(0, half * local, local), rows)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return run_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.act_fn)  # [N, H]


class SparseMoeBlock(nn.Module):
    """Router + experts (+ a shared expert and its sigmoid gate: Qwen2-MoE). [N, H] -> [N, H].

    On N > 1 ranks the shared expert must leave its sum unreduced (DecoderMLP with
    reduce_results=False): the block reduces once, experts and shared expert together."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        kernels: str = "torch",
        shared_expert: Optional[nn.Module] = None,
        tp_group: Optional[GroupCoordinator] = None,
    ) -> None:
        super().__init__()
        self.tp_group = single_rank(tp_group)
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)  # the router: [E, H], no bias in any family
        self.experts = MoeExperts(num_experts, hidden_size, intermediate_size, kernels, tp_group)
        self.shared_expert = shared_expert  # a dense gated MLP every token runs
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [N, E]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)  # [N, k] each
        out = self.experts(x, topk_weights, topk_ids)  # [N, H] (N > 1 ranks: this rank's partial sum)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [N, 1] * [N, H]
        return self.tp_group.all_reduce(out)  # [N, H]: one reduce per block (a no-op on one rank)
