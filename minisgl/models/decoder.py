"""The generic decoder: one model class for Llama, Qwen2, Qwen3, Mistral and their MoE kin.

Where it sits: ModelRunner.forward(forward_batch) -> DecoderForCausalLM.forward(input_ids,
positions, forward_batch) -> LogitsProcessorOutput. In: the flattened tokens of a batch
(every request's extend tokens, or one token per request in decode); out: next-token
logits per request (and, for a batch that asked, every token's final-norm hidden state), or
with `get_embedding` (an embedding model, --is-embedding) the Pooler's embedding per request.
K/V go into the paged pool through RadixAttention and the backend.

Per layer (pre-norm, residual stream carried beside the hidden states):
    h, residual = input_layernorm(h, residual)            # residual += h; h = norm(residual)
    h = o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))  # q_norm/k_norm: Qwen3 only
    h, residual = post_attention_layernorm(h, residual)
    h = down_proj(silu(gate) * up)                         # or, on a MoE layer, SparseMoeBlock(h)
The per-architecture differences are flags on ModelConfig (models/registry.py); Qwen3-MoE,
Qwen2-MoE and Mixtral put a SparseMoeBlock (layers/moe.py) in place of the MLP on the layers
`config.moe.sparse_layers` names.
Tensor parallelism (`--tp-size N`, docs/parallelism.md): the model takes its rank's
GroupCoordinator. qkv_proj / gate_up_proj are column-parallel (this rank's heads, its
intermediate columns), o_proj / down_proj row-parallel (one all_reduce each), the embedding
and the LM head split by vocabulary rows; attention runs on this rank's heads only, against
a KV pool that holds only its KV heads. Norms, rotary tables and q/k norms are whole on
every rank (they act per head or on the whole hidden state, which every rank holds).
Parameter names match the Hugging Face checkpoint, except the fused `qkv_proj` and
`gate_up_proj`, which `load_weights` fills from q/k/v_proj and gate/up_proj, and the stacked
`experts.gate_up_proj` / `experts.down_proj`, filled from each expert's tensors.
"""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Set, Tuple, Union

import torch
from torch import nn

from minisgl.distributed import GroupCoordinator
from minisgl.layers.activation import SiluAndMul
from minisgl.layers.layernorm import RMSNorm
from minisgl.layers.linear import (
    CpuPackedWeight,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    pack_weight_for_cpu,
    single_rank,
)
from minisgl.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from minisgl.layers.moe import SparseMoeBlock
from minisgl.layers.pooler import EmbeddingPoolerOutput, Pooler
from minisgl.layers.radix_attention import RadixAttention
from minisgl.layers.rotary_embedding import RotaryEmbedding
from minisgl.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.lora.lora_batch import LoRABatchInfo, apply_lora
from minisgl.model_executor.forward_batch_info import ForwardBatch
from minisgl.models.model_config import ModelConfig
from minisgl.models.registry import MoeConfig


class DecoderAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, kernels: str, rotary_emb: RotaryEmbedding, tp_group: GroupCoordinator
    ) -> None:
        super().__init__()
        tp = tp_group.world_size
        # this rank's heads (all of them on one rank)
        self.num_heads, self.num_kv_heads = config.get_num_attention_heads(tp), config.get_num_kv_heads(tp)
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, config.qkv_bias, tp_group
        )
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, config.o_bias, tp_group)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if config.qk_norm else None
        self.rotary_emb = rotary_emb  # one cos/sin table for the whole model (DecoderModel)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id)
        self.layer_id = layer_id

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        n, d = hidden_states.shape[0], self.head_dim
        lora = forward_batch.lora_batch_info  # (None: no request of the pass uses an adapter)
        qkv = self.qkv_proj(hidden_states)  # [N, (Hq + 2 * Hkv) * D], this rank's heads
        apply_lora(lora, self.layer_id, "qkv_proj", hidden_states, qkv)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, d))[0]  # [N * Hq, D], normalised per head
            k = self.k_norm(k.reshape(-1, d))[0]  # [N * Hkv, D]
        # contiguous copies: RoPE rotates them in place, and the kernel wants dense rows
        q = q.reshape(n, self.num_heads, d).contiguous()  # [N, Hq, D]
        k = k.reshape(n, self.num_kv_heads, d).contiguous()  # [N, Hkv, D]
        v = v.reshape(n, self.num_kv_heads, d)  # [N, Hkv, D]
        self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, forward_batch).reshape(n, self.num_heads * d)  # [N, Hq * D]
        return apply_lora(lora, self.layer_id, "o_proj", out, self.o_proj(out))  # [N, hidden], summed over ranks


class DecoderMLP(nn.Module):
    """down(silu(gate x) * up x); on N ranks each holds I / N of the intermediate columns.
    `reduce_results=False`: the output is this rank's partial sum (a MoE block's shared expert)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, kernels: str = "torch", layer_id: int = -1,
        tp_group: Optional[GroupCoordinator] = None, reduce_results: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp_group, reduce_results)
        self.act_fn = SiluAndMul(kernels)
        self.layer_id = layer_id  # (-1: a MoE block's shared expert, which no adapter targets)

    def forward(self, x: torch.Tensor, lora: Optional[LoRABatchInfo] = None) -> torch.Tensor:
        gate_up = apply_lora(lora, self.layer_id, "gate_up_proj", x, self.gate_up_proj(x))  # [N, 2 * I / N_tp]
        h = self.act_fn(gate_up)  # [N, I / N_tp]
        return apply_lora(lora, self.layer_id, "down_proj", h, self.down_proj(h))  # [N, hidden]


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, kernels: str, rotary_emb: RotaryEmbedding, tp_group: GroupCoordinator
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, kernels, rotary_emb, tp_group)
        self.mlp = _make_mlp(config, layer_id, kernels, tp_group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: Optional[torch.Tensor],
        forward_batch: ForwardBatch,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)  # [N, hidden] each
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        if isinstance(self.mlp, DecoderMLP):  # (a MoE block takes no adapter: LoRAManager refuses MLP targets there)
            return self.mlp(hidden_states, forward_batch.lora_batch_info), residual
        return self.mlp(hidden_states), residual


def _make_mlp(config: ModelConfig, layer_id: int, kernels: str, tp_group: GroupCoordinator) -> nn.Module:
    """The layer's dense MLP, or its SparseMoeBlock when config.moe names the layer sparse."""
    moe = config.moe
    if moe is None or layer_id not in moe.sparse_layers:
        return DecoderMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, kernels, layer_id, tp_group)
    shared = None
    if moe.shared_expert_intermediate_size is not None:  # (unreduced: the block reduces it with the experts)
        shared = DecoderMLP(
            config.hidden_size, moe.shared_expert_intermediate_size, config.mlp_bias, kernels, tp_group=tp_group,
            reduce_results=False,
        )  # fmt: skip
    return SparseMoeBlock(
        config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize, kernels, shared, tp_group
    )


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, kernels: str, tp_group: GroupCoordinator) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group)
        # Shared by every layer (as transformers' model-level rotary_emb): one [context_len, D]
        # table, not one per layer (32 x 128k positions of an 8B model would be 2 GiB).
        # The scheduler keeps every position below context_len (init_req_max_new_tokens).
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.context_len, config.rope_theta, config.rope_scaling, kernels)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, i, kernels, self.rotary_emb, tp_group) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [N, hidden]
        residual: Optional[torch.Tensor] = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, forward_batch)
        return self.norm(hidden_states, residual)[0]  # [N, hidden]


# checkpoint name fragment -> (fused parameter fragment, shard id)
STACKED_PARAMS = (
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
)
# A Hub checkpoint's per-expert tensor: model.layers.N.mlp.experts.E.<gate|up|down name>.weight
EXPERT_TENSOR = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")
# Buffers some checkpoints carry that the model recomputes.
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
# checkpoint_target's answer for a tied model's lm_head.weight: the embedding table (or a copy of it)
TIED_HEAD = ("model.embed_tokens.weight", "tied")


class DecoderForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, kernels: str = "torch", is_embedding: bool = False,
        tp_group: Optional[GroupCoordinator] = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.is_embedding = is_embedding
        self.tp_group = group = single_rank(tp_group)  # this rank's place among --tp-size ranks
        config.check_tensor_parallel(group.world_size)
        self.model = DecoderModel(config, kernels, group)
        # Tied: the LM head reuses the embedding table (no lm_head.weight in the checkpoint), split alike.
        # An embedding model has no LM head at all: its checkpoint often stores none (Qwen3-Embedding's)
        self.lm_head = (
            None if config.tie_word_embeddings or is_embedding else ParallelLMHead(config.vocab_size, config.hidden_size, group)
        )
        self.logits_processor = LogitsProcessor(config.vocab_size, group)
        # --is-embedding's head instead of the LM head: last token, L2-normalised (SGLang's Qwen3/Llama)
        self.pooler = Pooler(normalize=True)
        # Tied and packed: the embedding lookup keeps the dense table; the head multiplies a packed copy.
        self.tied_lm_head_packed: Optional[torch.Tensor] = None
        # every parameter's name (checkpoint_target looks each checkpoint tensor's target up here)
        self.param_names = frozenset(n for n, _ in self.named_parameters())

    def pack_linear_weights_for_cpu(self) -> int:
        """Pack every matmul weight for oneDNN (CPU float32, linear.py); returns how many were packed."""
        packed = sum(m.pack_for_cpu() for m in self.modules() if isinstance(m, CpuPackedWeight))
        if self.lm_head is None and not self.is_embedding:
            self.tied_lm_head_packed = pack_weight_for_cpu(self.model.embed_tokens.weight)
            packed += self.tied_lm_head_packed is not None
        return packed

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch, get_embedding: bool = False
    ) -> Union[LogitsProcessorOutput, EmbeddingPoolerOutput]:
        """Next-token logits, or with `get_embedding` (an embedding model's pass, SGLang's
        argument) each request's embedding: the pooled final-norm hidden state, no LM head."""
        hidden_states = self.model(input_ids, positions, forward_batch)  # [N, hidden]
        if get_embedding:
            return self.pooler(hidden_states, forward_batch)
        assert not self.is_embedding, "an embedding model has no LM head: forward it with get_embedding"
        if self.lm_head is None:
            weight, packed = self.model.embed_tokens.weight, self.tied_lm_head_packed
        else:
            weight, packed = self.lm_head.weight, self.lm_head.packed_weight
        return self.logits_processor(hidden_states, weight, forward_batch, packed)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        loaded: Set[Tuple[str, object]] = set()  # (parameter, shard id) pairs filled so far
        tied_head: Optional[torch.Tensor] = None
        for name, tensor in weights:
            where = self.checkpoint_target(name)
            if where is None:
                continue
            if where == TIED_HEAD:
                tied_head = tensor  # tied checkpoints may store a copy of the embedding (checked below)
                continue
            target, shard_id = where
            self.load_tensor(name, target, params[target], tensor, shard_id)
            loaded.update(self.shards_filled(target, shard_id))
        if tied_head is not None:
            self._load_tied_head(tied_head, loaded)
        missing = self.missing_tensors(loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def checkpoint_target(self, name: str) -> Optional[Tuple[str, object]]:
        """Where the checkpoint tensor `name` goes: (parameter name, shard id), shard id None when it
        fills the parameter; TIED_HEAD for a tied model's lm_head.weight (the embedding, or a copy
        of it); None for a tensor the model does not use. ValueError: a name with no place here.
        (The start-up load, the weight updates and get_weights_by_name share this mapping.)"""
        if name.endswith(IGNORED_WEIGHT_SUFFIXES):
            return None
        if name == "lm_head.weight" and self.is_embedding:
            return None  # (the pooler reads the hidden states; a causal LM's head is not used)
        if name == "lm_head.weight" and self.lm_head is None:
            return TIED_HEAD
        name = _with_model_prefix(name)
        target, shard_id = _param_of(name, self.config.moe)
        if target not in self.param_names:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
        if isinstance(shard_id, tuple):  # one expert's tensor: the stacked parameter has num_experts rows
            num_experts = self.config.moe.num_experts  # type: ignore[union-attr]  (an expert shard: a MoE model)
            if shard_id[0] >= num_experts:  # (checked here, before any layer indexes the stacked tensor)
                raise ValueError(
                    f"checkpoint tensor {name!r} names expert {shard_id[0]}, but the config has "
                    f"num_experts={num_experts} (experts 0..{num_experts - 1})"
                )
        return target, shard_id

    def load_tensor(self, name: str, target: str, param: torch.Tensor, tensor: torch.Tensor, shard_id: object) -> None:
        """Copy checkpoint tensor `name` (this rank's slice of it) into `param`, the parameter `target`."""
        # the layer that owns the parameter narrows the full tensor to this rank's slice
        owner = self.get_submodule(target.rsplit(".", 1)[0])
        try:
            if hasattr(owner, "weight_loader"):
                owner.weight_loader(param, tensor, shard_id)
            else:  # (norms: whole on every rank)
                default_weight_loader(param, tensor)
        except ValueError as e:  # name the tensor (as the model knows it): a config that disagrees with its weights
            raise ValueError(f"checkpoint tensor {_with_model_prefix(name)!r} does not fit {target!r}: {e}") from None

    def shards_filled(self, target: str, shard_id: object) -> Set[Tuple[str, object]]:
        """The (parameter, shard id) pairs one tensor fills: a tensor stored fused (qkv_proj,
        gate_up_proj, stacked experts) fills every shard of its parameter."""
        return {(target, s) for s in (self._shards_of(target) if shard_id is None else (shard_id,))}

    def missing_tensors(self, loaded: Set[Tuple[str, object]]) -> List[str]:
        """The checkpoint names (the Hub's layout) of every parameter shard not in `loaded`."""
        expected = {(n, s) for n, _ in self.named_parameters() for s in self._shards_of(n)}
        return sorted(_checkpoint_name(target, shard, self.config.moe) for target, shard in expected - loaded)

    def _shards_of(self, param_name: str) -> Tuple[object, ...]:
        """The shard ids that together fill a parameter ((None,): it loads whole)."""
        if param_name.endswith(".experts.gate_up_proj") or param_name.endswith(".experts.down_proj"):
            assert self.config.moe is not None
            halves: Tuple[Optional[int], ...] = (0, 1) if param_name.endswith("gate_up_proj") else (None,)
            return tuple((e, h) for e in range(self.config.moe.num_experts) for h in halves)
        if ".qkv_proj." in param_name:
            return ("q", "k", "v")
        if ".gate_up_proj." in param_name:
            return (0, 1)
        return (None,)

    def check_tied_head_shape(self, head: torch.Tensor, what: str) -> None:
        """A tied model's lm_head.weight must be the whole [V, H] embedding table (`what` names the
        tensor's source in the error). Checked first, on every rank alike: a rank compares only its
        rows of the embedding, and a head one row short would match them (the last rank's short by one)."""
        embedding = self.model.embed_tokens
        expected = (embedding.org_vocab_size, embedding.embedding_dim)
        if tuple(head.shape) != expected:
            raise ValueError(
                f"{what} 'lm_head.weight' does not fit 'model.embed_tokens.weight' (tie_word_embeddings): "
                f"shape mismatch: parameter {expected} vs checkpoint {tuple(head.shape)}"
            )

    def _load_tied_head(self, head: torch.Tensor, loaded: Set[Tuple[str, object]]) -> None:
        """A tied model's lm_head.weight: the embedding itself when the checkpoint stores only
        the head's name, else a copy that must equal it. A different matrix would be dropped
        without a word (transformers 5 unties the two instead): refused, naming the fix."""
        embedding = self.model.embed_tokens
        self.check_tied_head_shape(head, "checkpoint tensor")
        key = ("model.embed_tokens.weight", None)
        if key not in loaded:
            embedding.weight_loader(embedding.weight, head)
            loaded.add(key)
            return
        # each rank holds its rows of the embedding only: it compares those, and the ranks agree
        # (a min over them) so that all refuse together, none left waiting in a collective
        rows = embedding.rows_of(head).to(device=embedding.weight.device, dtype=embedding.weight.dtype)
        same = torch.tensor([int(torch.equal(embedding.weight.data[: rows.shape[0]], rows))], device=rows.device)
        if not self.tp_group.all_reduce(same, op="min").item():
            raise ValueError(
                "tie_word_embeddings is true, but the checkpoint's lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings to false in config.json to use the stored head"
            )


def _with_model_prefix(name: str) -> str:
    """A checkpoint of the bare decoder (Qwen3Model: Qwen3-Embedding's, saved without the causal
    LM's "model." prefix) holds the same tensors: prefixed, as SGLang prefixes them."""
    return name if name.startswith(("model.", "lm_head.")) else "model." + name


def _param_of(name: str, moe: Optional[MoeConfig]) -> Tuple[str, object]:
    """A checkpoint tensor's (parameter name, shard id); shard id None: the tensor fills the parameter."""
    if moe is not None:
        if moe.checkpoint_module != "mlp":  # Mixtral's block_sparse_moe is our mlp (as transformers 5 renames it)
            name = name.replace(f".{moe.checkpoint_module}.", ".mlp.")
        m = EXPERT_TENSOR.fullmatch(name)
        if m is not None and m.group(3) in moe.checkpoint_expert_names:
            prefix, expert, part = m.group(1), int(m.group(2)), moe.checkpoint_expert_names.index(m.group(3))
            if part == 2:  # down
                return f"{prefix}.down_proj", (expert, None)
            return f"{prefix}.gate_up_proj", (expert, part)  # gate rows (0) or up rows (1)
    for ckpt_part, param_part, sid in STACKED_PARAMS:
        if ckpt_part in name:
            return name.replace(ckpt_part, param_part), sid
    return name, None


def _checkpoint_name(target: str, shard: object, moe: Optional[MoeConfig]) -> str:
    """(parameter, shard id) -> the tensor name the checkpoint should have held (the Hub's layout)."""
    name = target
    if isinstance(shard, tuple) and moe is not None:  # one expert's tensor
        expert, half = shard
        part = moe.checkpoint_expert_names[2 if half is None else half]
        name = f"{target.rsplit('.', 1)[0]}.{expert}.{part}.weight"
    else:
        for ckpt_part, param_part, sid in STACKED_PARAMS:
            if param_part in target and sid == shard:
                name = target.replace(param_part, ckpt_part)
                break
    if moe is not None and moe.checkpoint_module != "mlp":  # (only Mixtral, whose every mlp is sparse)
        name = name.replace(".mlp.", f".{moe.checkpoint_module}.")
    return name
