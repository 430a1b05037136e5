"""ModelConfig: the model's shape, read once from config.json and generation_config.json.

Where it sits: ModelRunner -> ModelConfig.from_pretrained(model_dir) -> decoder, KV pool
sizing, the scheduler (context_len, vocab_size, hf_eos_token_ids). With --tp-size N it also
says what one rank holds (get_num_attention_heads, get_num_kv_heads) and refuses a model
that N ranks cannot split (check_tensor_parallel).

Handles both config spellings: transformers >= 5 writes `rope_parameters`
({"rope_type", "rope_theta", ...}); older files write `rope_theta` and `rope_scaling`
({"type" | "rope_type", "factor", ...}). Both become (rope_theta, rope_scaling).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Set, Tuple

from minisgl.layers.rotary_embedding import SUPPORTED_ROPE_TYPES
from minisgl.models.registry import MoeConfig, get_arch_spec
from minisgl.sampling.sampling_params import GENERATION_CONFIG_SAMPLING_KEYS

logger = logging.getLogger("minisgl")

# what compute_inv_freq reads for each scaled rope type
ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # the model's; one rank of --tp-size N holds get_num_attention_heads(N)
    num_kv_heads: int  # the model's; one rank holds get_num_kv_heads(N)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]  # None = plain RoPE
    max_position_embeddings: int
    context_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    moe: Optional[MoeConfig] = None  # sparse MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral); None: dense
    hf_eos_token_ids: Set[int] = field(default_factory=set)
    # Matryoshka embeddings (SGLang's ModelConfig): a model trained so that the first d numbers of its
    # embedding are an embedding too says so in config.json, with `matryoshka_dimensions` (the d it
    # was trained for) or `is_matryoshka: true` (any d); only then may a request ask for `dimensions`
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[Tuple[int, ...]] = None
    # generation_config.json's sampling keys: the defaults of a chat request that leaves them out
    default_sampling_params: Dict[str, Any] = field(default_factory=dict)
    hf_config: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_pretrained(cls, model_dir: str, context_length: Optional[int] = None) -> "ModelConfig":
        cfg = _read_json(os.path.join(model_dir, "config.json"), required=True)
        gen_cfg = _read_json(os.path.join(model_dir, "generation_config.json"), required=False)
        architecture, spec = get_arch_spec(cfg)
        quant = cfg.get("quantization_config")
        if quant:  # its weights are packed integers or fp8 with scales: nothing here can multiply them
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
            raise ValueError(
                f"Quantized checkpoints are not supported (quantization_config.quant_method={method!r}); "
                "use the model's unquantized (bf16/fp16/fp32) checkpoint"
            )
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' "swish" is SiLU
            raise ValueError(f"Unsupported hidden_act {cfg['hidden_act']!r}; minisgl's MLP is gated SiLU")
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg["head_dim"] if "head_dim" in cfg else spec.head_dim  # absent: the config class's default
        defaults = spec.config_defaults
        rope_theta, rope_scaling = parse_rope(cfg, defaults.get("rope_theta", 10000.0))
        max_pos = int(cfg.get("max_position_embeddings", defaults.get("max_position_embeddings", 2048)))
        return cls(
            model_path=model_dir,
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(_required(cfg, "intermediate_size", defaults)),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim or cfg["hidden_size"] // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            context_len=_context_len(spec.sliding_window(cfg), derived_context_len(max_pos, rope_scaling), context_length),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=spec.qkv_bias(cfg),
            o_bias=spec.o_bias(cfg),
            mlp_bias=spec.mlp_bias(cfg),
            qk_norm=spec.qk_norm,
            moe=spec.moe(cfg) if spec.moe is not None else None,
            hf_eos_token_ids=_as_id_set(cfg.get("eos_token_id")) | _as_id_set(gen_cfg.get("eos_token_id")),
            is_matryoshka=cfg.get("matryoshka_dimensions") is not None or bool(cfg.get("is_matryoshka", False)),
            matryoshka_dimensions=_matryoshka_dimensions(cfg.get("matryoshka_dimensions")),
            default_sampling_params=default_sampling_params(gen_cfg),
            hf_config=cfg,
        )

    # ------------------------------------------------------------------ tensor parallelism
    def get_num_attention_heads(self, tp_size: int) -> int:
        """Query heads one of `tp_size` ranks holds (SGLang's get_num_attention_heads)."""
        return max(1, self.num_heads // tp_size)

    def get_num_kv_heads(self, tp_size: int) -> int:
        """KV heads one of `tp_size` ranks holds (SGLang's get_num_kv_heads): its share, or one
        head shared with other ranks when there are fewer KV heads than ranks."""
        return max(1, self.num_kv_heads // tp_size)

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Refuse, before any weight loads, a model whose heads or MLP widths `tp_size` ranks
        cannot split evenly (docs/parallelism.md); the message says what to change."""
        if tp_size == 1:
            return
        fix = "use a --tp-size that divides it, or --tp-size 1"
        if self.num_heads % tp_size != 0:
            raise ValueError(
                f"--tp-size {tp_size} splits the attention heads across ranks, but num_attention_heads "
                f"({self.num_heads}) is not divisible by it; {fix}"
            )
        kv = self.num_kv_heads
        if kv % tp_size != 0 and tp_size % kv != 0:
            raise ValueError(
                f"--tp-size {tp_size} and num_key_value_heads ({kv}): each rank holds num_key_value_heads / tp_size "
                "KV heads, or one shared by tp_size / num_key_value_heads ranks, so one must divide the other; "
                f"use a --tp-size that divides {kv} or is a multiple of it, or --tp-size 1"
            )
        widths = []
        if self.moe is None or len(self.moe.sparse_layers) < self.num_layers:  # a dense MLP somewhere
            widths.append(("intermediate_size", self.intermediate_size))
        if self.moe is not None and self.moe.sparse_layers:
            widths.append(("each expert's intermediate size (moe_intermediate_size; Mixtral: intermediate_size)", self.moe.intermediate_size))
            if self.moe.shared_expert_intermediate_size is not None:
                widths.append(("shared_expert_intermediate_size", self.moe.shared_expert_intermediate_size))
        for name, width in widths:
            if width % tp_size != 0:
                raise ValueError(
                    f"--tp-size {tp_size} splits the MLP's intermediate columns across ranks, but {name} ({width}) "
                    f"is not divisible by it; {fix}"
                )


def default_sampling_params(gen_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """SGLang's get_default_sampling_params: the sampling keys generation_config.json sets.

    Hugging Face's top_k 0 means "no top-k", which is SGLang's -1; a key whose value is not
    a number is left out (the built-in default applies) rather than failing every request.
    """
    defaults: Dict[str, Any] = {}
    for key in GENERATION_CONFIG_SAMPLING_KEYS:
        value = gen_cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key == "top_k":
            defaults[key] = -1 if int(value) == 0 else int(value)
        else:
            defaults[key] = float(value)
    return defaults


def _matryoshka_dimensions(value: Any) -> Optional[Tuple[int, ...]]:
    """config.json's matryoshka_dimensions: None, or a list of positive ints (refused otherwise:
    every `dimensions` a request asks for is checked against it)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(d) is int and d > 0 for d in value):
        raise ValueError(f"config.json's matryoshka_dimensions must be a list of positive integers, got {value!r}")
    return tuple(value)


def _required(cfg: Dict[str, Any], key: str, defaults: Dict[str, Any]) -> Any:
    """config.json's `key`, else the MoE config class's default (a MoE layer reads the experts'
    widths, so its dense width may be absent); a dense model must state it."""
    if key in cfg:
        return cfg[key]
    if key in defaults:
        return defaults[key]
    raise ValueError(f"config.json has no {key}; a dense decoder needs it")


def _read_json(path: str, required: bool) -> Dict[str, Any]:
    if not os.path.exists(path):
        if required:
            raise ValueError(f"{path} not found: a model directory needs a Hugging Face config.json")
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_id_set(value: Any) -> Set[int]:
    """eos_token_id may be absent, one int or a list of ints."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def parse_rope(cfg: Dict[str, Any], default_theta: float = 10000.0) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, rope_scaling or None) from either config spelling.

    As in transformers 5, `rope_scaling` wins over `rope_parameters` when both are there
    (a config saved by transformers 5 always has `rope_parameters`; users add
    `rope_scaling` to extend the context), and rope_theta comes from that dict, else the
    top level, else the config class's `default_theta` (10000; Mixtral's is 1e6).
    """
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if params and "full_attention" in params and "rope_type" not in params:
        params = params["full_attention"]  # per-layer-type form; every supported model is full attention
    scaling: Optional[Dict[str, Any]] = dict(params) if params else None
    theta = float((scaling or {}).pop("rope_theta", cfg.get("rope_theta", default_theta)))
    partial = (scaling or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and partial != 1.0:  # None: transformers' full rotary
        raise ValueError(f"partial_rotary_factor={partial} is not supported (minisgl rotates the whole head)")
    if scaling is None:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Unsupported rope_type {rope_type!r}; minisgl supports {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    scaling = {**scaling, "rope_type": rope_type}
    if rope_type == "llama3":  # as transformers' standardize_rope_params (and SGLang's Llama):
        if "original_max_position_embeddings" in cfg:  # the top-level value wins over the dict's
            scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        else:
            scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    missing = [k for k in ROPE_REQUIRED_KEYS[rope_type] if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs {missing} in config.json")
    return theta, scaling


def derived_context_len(max_pos: int, rope_scaling: Optional[Dict[str, Any]]) -> int:
    """SGLang's get_context_length: max_position_embeddings, times a scaled rope's factor unless
    the scaling names its own original length (llama3 always does, here)."""
    if rope_scaling and "original_max_position_embeddings" not in rope_scaling:
        return int(max_pos * float(rope_scaling.get("factor", 1.0)))
    return max_pos


def _context_len(window: Optional[int], derived: int, requested: Optional[int]) -> int:
    """--context-length, else the model's derived context; never past a sliding window.

    minisgl attends over the whole sequence. That equals sliding-window attention as long
    as no sequence is longer than the window, so the context is capped at the window.
    """
    context_len = requested or derived
    if requested and requested > derived:
        # SGLang's rule: positions past what the model was trained on give garbage, so a longer
        # context is refused unless the user says they know (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN)
        if os.environ.get("MINISGL_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "0") not in ("1", "true", "True"):
            raise ValueError(
                f"--context-length {requested} is longer than the model's context ({derived}: its "
                "max_position_embeddings, times its rope scaling's factor if it has one), which may give incorrect "
                "outputs; use a shorter one, or set MINISGL_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 to allow it"
            )
        logger.warning("context_length %d exceeds the model's context %d", requested, derived)
    if window and window < context_len:
        logger.warning("capping context_len %d to the model's sliding_window %d", context_len, window)
        context_len = int(window)
    return int(context_len)
