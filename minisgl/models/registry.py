"""Architecture adapters: how each supported Hugging Face architecture maps onto the generic decoder.

Where it sits: ModelRunner -> ModelConfig.from_pretrained -> get_arch_spec(config.json["architectures"])
-> ARCHITECTURES[name] -> the flags the generic decoder (decoder.py) is built with.

Llama, Qwen2, Qwen3 and Mistral are the same decoder (RMSNorm, RoPE, grouped-query
attention, gated SiLU MLP). They differ only in these flags, so each architecture is a
few lines of data here, not a copied model file (STYLE.md habit 12):
- Llama: biases on q/k/v/o when `attention_bias`, on the MLP when `mlp_bias`;
- Qwen2: q/k/v always carry a bias, o_proj never;
- Qwen3: an RMSNorm per head on q and k before RoPE; biases when `attention_bias`;
- Mistral: no biases; a sliding window (handled by capping the context, see model_config).
Qwen2/3 configs carry a window too, used only with `use_sliding_window` (off by default
in transformers); Llama has none.

The sparse mixture-of-experts models are the same decoder with a MoE block in place of
the MLP on some layers (layers/moe.py); `MoeConfig` says which layers and how they route:
- Qwen3MoE: Qwen3's attention; experts of `moe_intermediate_size`, top-k renormalised
  when `norm_topk_prob`; layers in `mlp_only_layers` or off `decoder_sparse_step` are dense;
- Qwen2MoE: Qwen2's attention (q/k/v bias from `qkv_bias`, default on) and Qwen3MoE's
  routing, plus a shared expert scaled by sigmoid(shared_expert_gate(x)) on every MoE layer;
- Mixtral: Mistral's attention (window default: none); every layer MoE, experts of
  `intermediate_size`, top-k always renormalised; checkpoints say `block_sparse_moe` and w1/w3/w2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

HFConfig = Dict[str, Any]


def _flag(key: str, default: bool = False) -> Callable[[HFConfig], bool]:
    return lambda cfg: bool(cfg.get(key, default))


def _const(value: bool) -> Callable[[HFConfig], bool]:
    return lambda cfg: value


def _window(cfg: HFConfig) -> Optional[int]:
    # a missing key is transformers' class default (Mistral, Qwen2, Qwen3: 4096); null is none
    return cfg.get("sliding_window", 4096) or None


def _layers_from_max_window_layers(cfg: HFConfig, layer: int) -> bool:
    return layer >= int(cfg.get("max_window_layers", 28))  # Qwen2Config / Qwen3Config: from there on


def _even_layers_below_max_window_layers(cfg: HFConfig, layer: int) -> bool:
    return layer % 2 == 0 and layer < int(cfg.get("max_window_layers", 28))  # Qwen2MoeConfig's rule


def _every_layer(cfg: HFConfig, layer: int) -> bool:
    return True  # Qwen3MoeConfig: no per-layer types, the window applies to all layers


def _window_if_used(slides: Callable[[HFConfig, int], bool]) -> Callable[[HFConfig], Optional[int]]:
    """Qwen2/Qwen3 and their MoE twins: a window only with use_sliding_window (transformers'
    default: off) and only if some layer slides: `layer_types`, else the config class's rule."""

    def window(cfg: HFConfig) -> Optional[int]:
        if not cfg.get("use_sliding_window", False):
            return None
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            n = int(cfg["num_hidden_layers"])
            layer_types = ["sliding_attention" if slides(cfg, i) else "full_attention" for i in range(n)]
        return _window(cfg) if "sliding_attention" in layer_types else None

    return window


def _window_default_none(cfg: HFConfig) -> Optional[int]:
    return cfg.get("sliding_window") or None  # MixtralConfig: no window unless config.json names one


def _no_window(cfg: HFConfig) -> Optional[int]:
    return None


@dataclass(frozen=True)
class MoeConfig:
    """How a sparse MoE model routes, and how its checkpoint spells the experts."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k probabilities divided by their sum (norm_topk_prob; Mixtral always)
    # None: no shared expert; Qwen2-MoE has one on every MoE layer, even of width 0 (transformers builds
    # it, and save_pretrained writes its [0, H] tensors and its gate)
    shared_expert_intermediate_size: Optional[int]
    sparse_layers: FrozenSet[int]  # layers with a MoE block; the others run a dense MLP of intermediate_size
    checkpoint_module: str = "mlp"  # the block's name in the checkpoint ("block_sparse_moe": Mixtral)
    checkpoint_expert_names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down


def _positive(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json's {key} must be a positive integer, got {value!r}")
    return value


def _checked(moe: MoeConfig) -> MoeConfig:
    """Refuse, naming the key, what transformers would fail on deep inside its forward."""
    if moe.sparse_layers and not 1 <= moe.top_k <= moe.num_experts:
        raise ValueError(
            f"config.json's num_experts_per_tok ({moe.top_k}) must be between 1 and the number of experts "
            f"({moe.num_experts})"
        )
    return moe


def _qwen_moe(defaults: Dict[str, Any], shared_expert: bool) -> Callable[[HFConfig], MoeConfig]:
    """Qwen2-MoE (shared_expert) / Qwen3-MoE: `defaults` are the config class's, for keys
    config.json leaves out."""

    def parse(cfg: HFConfig) -> MoeConfig:
        def get(key: str) -> Any:
            return cfg.get(key, defaults[key])

        num_experts = int(_num_experts(cfg, defaults["num_experts"]))
        step = _positive("decoder_sparse_step", get("decoder_sparse_step"))
        dense = set(cfg.get("mlp_only_layers") or [])
        n = int(cfg["num_hidden_layers"])
        # transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer rule
        sparse = frozenset(i for i in range(n) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        return _checked(MoeConfig(
            num_experts=num_experts,
            top_k=int(get("num_experts_per_tok")),
            intermediate_size=int(get("moe_intermediate_size")),
            renormalize=bool(get("norm_topk_prob")),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")) if shared_expert else None,
            sparse_layers=sparse,
        ))  # fmt: skip

    return parse


def _num_experts(cfg: HFConfig, default: int) -> Any:
    # Qwen3MoeConfig and MixtralConfig map num_experts onto num_local_experts (the name their
    # save_pretrained writes); Qwen2MoeConfig and Hub Qwen3-MoE configs say num_experts
    return cfg.get("num_experts", cfg.get("num_local_experts", default))


def _mixtral_moe(cfg: HFConfig) -> MoeConfig:
    return _checked(MoeConfig(
        num_experts=int(_num_experts(cfg, 8)),  # MixtralConfig's defaults
        top_k=int(cfg.get("num_experts_per_tok", 2)),
        intermediate_size=int(cfg.get("intermediate_size", 14336)),
        renormalize=True,  # MixtralTopKRouter always divides by the top-k sum
        shared_expert_intermediate_size=None,
        sparse_layers=frozenset(range(int(cfg["num_hidden_layers"]))),
        checkpoint_module="block_sparse_moe",
        checkpoint_expert_names=("w1", "w3", "w2"),
    ))  # fmt: skip


QWEN3_MOE_DEFAULTS = dict(
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
    decoder_sparse_step=1,
)  # fmt: skip
QWEN2_MOE_DEFAULTS = dict(
    num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, norm_topk_prob=False,
    decoder_sparse_step=1, shared_expert_intermediate_size=5632,
)  # fmt: skip


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: Callable[[HFConfig], bool]
    o_bias: Callable[[HFConfig], bool]
    mlp_bias: Callable[[HFConfig], bool]
    qk_norm: bool
    sliding_window: Callable[[HFConfig], Optional[int]]  # the window attention uses, or None
    head_dim: Optional[int] = None  # the config class's default when config.json has no head_dim
    moe: Optional[Callable[[HFConfig], MoeConfig]] = None  # sparse MoE models only
    # the config class's defaults where they differ from minisgl's fallbacks (rope_theta 10000,
    # rms_norm_eps 1e-6, max_position_embeddings 2048), for keys config.json leaves out
    config_defaults: Dict[str, Any] = field(default_factory=dict)


ARCHITECTURES: Dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(
        qkv_bias=_flag("attention_bias"), o_bias=_flag("attention_bias"), mlp_bias=_flag("mlp_bias"), qk_norm=False,
        sliding_window=_no_window,
    ),
    "Qwen2ForCausalLM": ArchSpec(
        qkv_bias=_const(True), o_bias=_const(False), mlp_bias=_const(False), qk_norm=False,
        sliding_window=_window_if_used(_layers_from_max_window_layers),
        config_defaults={"max_position_embeddings": 32768},
    ),
    "Qwen3ForCausalLM": ArchSpec(
        qkv_bias=_flag("attention_bias"), o_bias=_flag("attention_bias"), mlp_bias=_const(False), qk_norm=True,
        sliding_window=_window_if_used(_layers_from_max_window_layers), head_dim=128,  # Qwen3Config's, not hidden / heads
        config_defaults={"max_position_embeddings": 32768},
    ),
    "MistralForCausalLM": ArchSpec(
        qkv_bias=_const(False), o_bias=_const(False), mlp_bias=_const(False), qk_norm=False, sliding_window=_window,
        config_defaults={"max_position_embeddings": 131072},
    ),
    "Qwen2MoeForCausalLM": ArchSpec(
        qkv_bias=_flag("qkv_bias", True), o_bias=_const(False), mlp_bias=_const(False), qk_norm=False,
        sliding_window=_window_if_used(_even_layers_below_max_window_layers), moe=_qwen_moe(QWEN2_MOE_DEFAULTS, shared_expert=True),
        config_defaults={"max_position_embeddings": 32768, "intermediate_size": 5632},
    ),
    "Qwen3MoeForCausalLM": ArchSpec(
        qkv_bias=_flag("attention_bias"), o_bias=_flag("attention_bias"), mlp_bias=_const(False), qk_norm=True,
        sliding_window=_window_if_used(_every_layer), moe=_qwen_moe(QWEN3_MOE_DEFAULTS, shared_expert=False),  # head_dim: hidden / heads
        config_defaults={"max_position_embeddings": 32768, "intermediate_size": 6144},
    ),
    "MixtralForCausalLM": ArchSpec(
        qkv_bias=_const(False), o_bias=_const(False), mlp_bias=_const(False), qk_norm=False,
        sliding_window=_window_default_none, moe=_mixtral_moe,
        config_defaults={"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "intermediate_size": 14336},
    ),
}  # fmt: skip


def get_arch_spec(hf_config: HFConfig) -> tuple[str, ArchSpec]:
    """The first supported entry of `architectures`, or a ValueError naming the supported ones."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    raise ValueError(
        f"Unsupported model architecture {names or '(none in config.json)'}; "
        f"minisgl supports {sorted(ARCHITECTURES)}"
    )
