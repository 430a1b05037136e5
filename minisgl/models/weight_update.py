"""New weights into a served model, in place (the model side of SGLang's update_weights_from_disk,
update_weights_from_tensor and get_weights_by_name).

Where it sits: Scheduler.update_weights_from_* -> ModelRunner.update_weights_from_* ->
stage_weights (here) -> the ranks agree -> commit_weights (here). In: (name, tensor) pairs in the
checkpoint's (Hugging Face) names; out: the same parameter objects holding the new values.

Two phases, so that a bad checkpoint never leaves a half-updated model:

1. stage_weights: each tensor goes through the start-up load's own mapping and weight_loaders
   (q/k/v into qkv_proj, gate/up into gate_up_proj, each expert into the stacked experts, this
   rank's slice with --tp-size N), into a CPU copy of its parameter: a dense copy (a oneDNN-packed
   CPU weight is unpacked first), taken before any tensor lands, so that a tensor holding part of
   a fused parameter (q_proj alone) keeps the rest of it. Any error (a name with no place here, a
   shape that does not fit, a tensor a whole checkpoint must hold and lacks) ends here, with the
   live model untouched.
2. commit_weights: each staged copy goes into the live parameter in place (`copy_`: the tensors
   CUDA graphs captured read the new values at their next replay), then what derives from the
   parameters is rebuilt: the oneDNN-packed CPU weights, the tied LM head's packed copy.

The staging copies live in host memory, not on the GPU, where the KV pool left little room: a
whole-model update holds one more copy of this rank's weights in RAM while it runs. The tensors
come without copies where they can (the Engine's own at tp_size 1; safetensors bytes, never base64,
across processes): measured, ~2x the weights' bytes of peak RSS for a whole update from tensors,
~1.6x from disk (docs/model_execution.md, "What an update costs in RAM").
"""

from __future__ import annotations

import base64
import contextlib
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from minisgl.layers.linear import (
    CpuPackedWeight, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, pack_weight_for_cpu,
)  # fmt: skip
from minisgl.layers.moe import MoeExperts
from minisgl.layers.vocab_parallel_embedding import VocabParallelEmbedding
from minisgl.models.decoder import TIED_HEAD, DecoderForCausalLM
from minisgl.models.model_config import ModelConfig

# parameter name -> its new value on this rank (dense, on the CPU, in the parameter's dtype)
StagedWeights = Dict[str, torch.Tensor]
EMBEDDING = "model.embed_tokens.weight"


def stage_weights(
    model: DecoderForCausalLM, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool
) -> StagedWeights:
    """This rank's new value of every parameter `weights` touch; the model is not changed.

    `require_all`: the tensors must fill every parameter (a whole checkpoint, as at start-up);
    otherwise they may be any subset (SGLang's update_weights_from_tensor sends buckets).
    ValueError says which tensor does not fit, or which are missing."""
    params = dict(model.named_parameters())
    staged: StagedWeights = {}
    loaded: Set[Tuple[str, object]] = set()
    tied_head: Optional[torch.Tensor] = None
    with torch.no_grad():
        for name, tensor in weights:
            where = model.checkpoint_target(name)
            if where is None:
                continue
            if not tensor.is_floating_point():  # (copy_ would cast an int or bool tensor without a word)
                raise ValueError(
                    f"tensor {name!r} has dtype {tensor.dtype}: weights must be floating point (float32, bfloat16, float16)"
                )
            if where == TIED_HEAD:
                tied_head = tensor
                continue
            target, shard_id = where
            param = params[target]
            if target not in staged:
                staged[target] = _dense_cpu_copy(model, target, param)
            with _loading_into(param, staged[target]):
                model.load_tensor(name, target, param, tensor, shard_id)
            loaded |= model.shards_filled(target, shard_id)
        if tied_head is not None:
            _stage_tied_head(model, tied_head, params[EMBEDDING], staged, loaded)
    if require_all:
        missing = model.missing_tensors(loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return staged


def _owner(model: DecoderForCausalLM, target: str) -> torch.nn.Module:
    return model.get_submodule(target.rsplit(".", 1)[0])


def _packed(owner: torch.nn.Module, target: str) -> bool:
    """Whether `target` is a weight held only as its oneDNN packing (CPU float32; linear.py)."""
    return isinstance(owner, CpuPackedWeight) and target.endswith(".weight") and owner.packed_weight is not None


def _dense_cpu_copy(model: DecoderForCausalLM, target: str, param: torch.Tensor) -> torch.Tensor:
    owner = _owner(model, target)
    if _packed(owner, target):
        assert isinstance(owner, CpuPackedWeight)
        return owner.dense_weight().clone()  # [out, in]: the live .weight is an empty [0, in]
    return param.detach().to("cpu", copy=True)


@contextlib.contextmanager
def _loading_into(param: torch.nn.Parameter, staged: torch.Tensor) -> Iterator[None]:
    """The layers' weight_loaders write into `param` (and tell a weight from its bias by identity),
    so `param` lends them its identity with the staged tensor as its data for one call, and gets
    its own data back before anything else (a forward, a CUDA graph) can see it."""
    live = param.data
    param.data = staged
    try:
        yield
    finally:
        param.data = live


def _stage_tied_head(
    model: DecoderForCausalLM, head: torch.Tensor, embedding_param: torch.nn.Parameter, staged: StagedWeights,
    loaded: Set[Tuple[str, object]],
) -> None:
    """A tied model's lm_head.weight: the embedding itself when the tensors hold no
    embed_tokens.weight, else a copy that must equal it (decoder._load_tied_head's rule; the
    ranks' agreement comes after staging, for every error alike)."""
    embedding = model.model.embed_tokens
    model.check_tied_head_shape(head, "tensor")
    if (EMBEDDING, None) not in loaded:
        staged[EMBEDDING] = _dense_cpu_copy(model, EMBEDDING, embedding_param)
        with _loading_into(embedding_param, staged[EMBEDDING]):
            embedding.weight_loader(embedding_param, head)
        loaded.add((EMBEDDING, None))
        return
    rows = embedding.rows_of(head).to(staged[EMBEDDING].dtype)
    if not torch.equal(staged[EMBEDDING][: rows.shape[0]], rows):
        raise ValueError(
            "tie_word_embeddings is true, but the new lm_head.weight differs from model.embed_tokens.weight: "
            "a tied model's head is its embedding table (send the same tensor for both, or the embedding alone)"
        )


def commit_weights(model: DecoderForCausalLM, staged: StagedWeights) -> None:
    """Put the staged values into the live parameters and rebuild what derives from them."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for target, value in staged.items():
            owner, param = _owner(model, target), params[target]
            if _packed(owner, target):
                assert isinstance(owner, CpuPackedWeight)
                packed = pack_weight_for_cpu(value)
                if packed is None:  # (the probe refused it now: the layer runs F.linear on the dense weight)
                    param.data = value
                owner.packed_weight = packed
            else:
                param.data.copy_(value)  # in place: CUDA graphs and every view keep reading this storage
        if EMBEDDING in staged and model.tied_lm_head_packed is not None:
            model.tied_lm_head_packed = pack_weight_for_cpu(model.model.embed_tokens.weight)


def get_weights_by_name(model: DecoderForCausalLM, name: str, truncate_size: int) -> List[object]:
    """SGLang's get_weights_by_name: the parameter of checkpoint tensor `name` as a float list, cut
    to its first `truncate_size` entries along its first dimension (rows of a matrix, values of a
    vector), the value `param.tolist()[:truncate_size]` gives.

    With --tp-size N, SGLang's answer: a row-parallel weight (o_proj, down_proj) is gathered
    whole from every rank (an all_gather every rank must call); any other is this rank's slice
    (rank 0 answers: its heads, its intermediate rows, its vocabulary rows, which are the tensor's
    first rows). ValueError: a name the model has no parameter for."""
    hint = "use the checkpoint's (Hugging Face) names, e.g. 'model.layers.0.self_attn.q_proj.weight' or 'model.norm.weight'"
    try:
        where = model.checkpoint_target(name)
    except ValueError as e:  # (no such parameter, or no such expert: its own words, then the hint)
        raise ValueError(f"{name!r} names no parameter of this {model.config.architecture} model ({e}); {hint}") from None
    if where is None:
        raise ValueError(f"{name!r} names no parameter of this {model.config.architecture} model (it is not used); {hint}")
    target, shard_id = (EMBEDDING, None) if where == TIED_HEAD else where
    owner, param = _owner(model, target), dict(model.named_parameters())[target]
    assert isinstance(owner, torch.nn.Module)
    value = owner.dense_weight() if _packed(owner, target) else param.data  # type: ignore[attr-defined]
    if isinstance(owner, (QKVParallelLinear, MergedColumnParallelLinear)) and shard_id is not None:
        offset, size = owner.shard_offsets[shard_id]  # q, k or v (gate or up): its rows of the fused weight
        value = value.narrow(0, offset, size)
    elif isinstance(owner, MoeExperts) and isinstance(shard_id, tuple):
        expert, half = shard_id
        value = value[expert]  # [2I/N, H] or [H, I/N]
        if half is not None:
            local = owner.local_intermediate_size
            value = value.narrow(0, half * local, local)
    elif isinstance(owner, VocabParallelEmbedding):
        value = value[: owner.vocab_end_index - owner.vocab_start_index]  # (not the padding rows)
    row_parallel = (isinstance(owner, RowParallelLinear) and value.dim() == 2) or (
        isinstance(owner, MoeExperts) and target.endswith(".down_proj")
    )
    if row_parallel:  # split by input columns: every rank's columns, in rank order (SGLang's all_gather)
        value = model.tp_group.all_gather(value, dim=-1)
    return value[:truncate_size].float().cpu().tolist()


# ModelConfig fields that make two checkpoints the same model: a change in any of them cannot be
# loaded into the parameters (shapes) or would be ignored by them (norms' eps, RoPE): refused
SAME_MODEL_FIELDS = (
    "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias",
    "qk_norm", "moe",
)  # fmt: skip


def check_same_model(served: ModelConfig, new: ModelConfig) -> None:
    """ValueError naming every field of the new checkpoint's config.json that differs from the
    served model's: an update changes the weights, never the model they belong to."""
    diffs = [f"{name} {getattr(new, name)!r} (served: {getattr(served, name)!r})" for name in SAME_MODEL_FIELDS
             if getattr(new, name) != getattr(served, name)]  # fmt: skip
    if diffs:
        raise ValueError(
            f"the checkpoint at {new.model_path} is not the served model: its config.json has {'; '.join(diffs)}. "
            "Updating the weights keeps the model; start a new server to serve another one"
        )


def named_tensors_to_bytes(named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> bytes:
    """(name, tensor) pairs -> one safetensors file, in memory: what crosses a process boundary
    (the HTTP process -> the scheduler, rank 0 -> the other ranks) as raw bytes (io_struct)."""
    from safetensors.torch import save

    tensors: Dict[str, torch.Tensor] = {}
    storages: Set[int] = set()
    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:  # (a state_dict's tied head shares the embedding's storage: safetensors refuses that)
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    return save(tensors)


def serialize_named_tensors(named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """/update_weights_from_tensor's wire format, for a client: the tensors as one safetensors
    file, base64 text (JSON carries no bytes). One entry of serialized_named_tensors.

    SGLang sends pickles (MultiprocessingSerializer, CUDA IPC handles); minisgl never unpickles
    what it receives (STYLE.md habit 4), and safetensors reads back nothing but named tensors."""
    return base64.b64encode(named_tensors_to_bytes(named_tensors)).decode("ascii")


def deserialize_named_tensors(files: Sequence[bytes]) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of these safetensors files, in order. ValueError: an entry
    that is not a safetensors file."""
    from safetensors.torch import load

    for i, data in enumerate(files):
        try:
            tensors = load(bytes(data))
        except Exception as e:  # (safetensors' own error type: a header that is not its JSON, a short file)
            raise ValueError(f"serialized_named_tensors[{i}] is not a safetensors file ({type(e).__name__}: {e})") from None
        yield from tensors.items()
