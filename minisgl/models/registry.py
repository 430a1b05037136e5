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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

HFConfig = Dict[str, Any]


def _flag(key: str) -> Callable[[HFConfig], bool]:
    return lambda cfg: bool(cfg.get(key, False))


def _const(value: bool) -> Callable[[HFConfig], bool]:
    return lambda cfg: value


def _window(cfg: HFConfig) -> Optional[int]:
    # a missing key is transformers' class default (Mistral, Qwen2, Qwen3: 4096); null is none
    return cfg.get("sliding_window", 4096) or None


def _window_if_used(cfg: HFConfig) -> Optional[int]:
    """Qwen2/Qwen3: a window only with use_sliding_window (transformers' default: off) and only
    if some layer slides: `layer_types`, else the layers from `max_window_layers` on."""
    if not cfg.get("use_sliding_window", False):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = int(cfg.get("max_window_layers", 28))  # Qwen2Config's default
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(int(cfg["num_hidden_layers"]))]
    return _window(cfg) if "sliding_attention" in layer_types else None


def _no_window(cfg: HFConfig) -> Optional[int]:
    return None


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: Callable[[HFConfig], bool]
    o_bias: Callable[[HFConfig], bool]
    mlp_bias: Callable[[HFConfig], bool]
    qk_norm: bool
    sliding_window: Callable[[HFConfig], Optional[int]]  # the window attention uses, or None
    head_dim: Optional[int] = None  # the config class's default when config.json has no head_dim


ARCHITECTURES: Dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(
        qkv_bias=_flag("attention_bias"), o_bias=_flag("attention_bias"), mlp_bias=_flag("mlp_bias"), qk_norm=False,
        sliding_window=_no_window,
    ),
    "Qwen2ForCausalLM": ArchSpec(
        qkv_bias=_const(True), o_bias=_const(False), mlp_bias=_const(False), qk_norm=False,
        sliding_window=_window_if_used,
    ),
    "Qwen3ForCausalLM": ArchSpec(
        qkv_bias=_flag("attention_bias"), o_bias=_flag("attention_bias"), mlp_bias=_const(False), qk_norm=True,
        sliding_window=_window_if_used, head_dim=128,  # Qwen3Config's default, not hidden / heads
    ),
    "MistralForCausalLM": ArchSpec(
        qkv_bias=_const(False), o_bias=_const(False), mlp_bias=_const(False), qk_norm=False, sliding_window=_window,
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
