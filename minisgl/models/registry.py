"""Architecture adapters: how each supported Hugging Face architecture maps onto the generic decoder.

Where it sits: loader -> ModelConfig.from_pretrained reads `config.json["architectures"]`
-> ARCHITECTURES[name] -> the flags the generic decoder (decoder.py) is built with.

Llama, Qwen2, Qwen3 and Mistral are the same decoder (RMSNorm, RoPE, grouped-query
attention, gated SiLU MLP). They differ only in these flags, so each architecture is a
few lines of data here, not a copied model file (STYLE.md habit 12):
- Llama: biases on q/k/v/o when `attention_bias`, on the MLP when `mlp_bias`;
- Qwen2: q/k/v always carry a bias, o_proj never;
- Qwen3: an RMSNorm per head on q and k before RoPE; biases when `attention_bias`;
- Mistral: no biases; a sliding window (handled by capping the context, see model_config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

HFConfig = Dict[str, Any]


def _flag(key: str) -> Callable[[HFConfig], bool]:
    return lambda cfg: bool(cfg.get(key, False))


def _const(value: bool) -> Callable[[HFConfig], bool]:
    return lambda cfg: value


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: Callable[[HFConfig], bool]
    o_bias: Callable[[HFConfig], bool]
    mlp_bias: Callable[[HFConfig], bool]
    qk_norm: bool


ARCHITECTURES: Dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(
        qkv_bias=_flag("attention_bias"), o_bias=_flag("attention_bias"), mlp_bias=_flag("mlp_bias"), qk_norm=False
    ),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=_const(True), o_bias=_const(False), mlp_bias=_const(False), qk_norm=False),
    "Qwen3ForCausalLM": ArchSpec(
        qkv_bias=_flag("attention_bias"), o_bias=_flag("attention_bias"), mlp_bias=_const(False), qk_norm=True
    ),
    "MistralForCausalLM": ArchSpec(qkv_bias=_const(False), o_bias=_const(False), mlp_bias=_const(False), qk_norm=False),
}


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
