"""LoRAManager: every served adapter's weights, and their deltas added to the decoder's projections.

Where it sits: the ModelRunner builds one LoRAManager at start (--lora-paths; every adapter is
loaded then, none later). Per forward pass, ModelRunner.forward_eager calls `prepare_lora_batch`
with the ForwardBatch's plain fields (its `lora_ids`, one adapter name or None per request, and
each request's token count) and sets `forward_batch.lora_batch_info`: for each distinct adapter of
the pass, the rows of its tokens. DecoderAttention and DecoderMLP then call lora_batch.apply_lora
after each projection (lora_batch.py holds the per-pass half, so neither imports this module).

The math (PEFT's): for a linear layer y = W x, an adapter adds scaling * B (A x), with
A [r, in], B [out, r] and scaling = alpha / r (alpha / sqrt(r) with use_rslora). Each token
gets its own request's adapter, or none (the base model).

Fused layers: minisgl computes q/k/v in one qkv_proj and gate/up in one gate_up_proj. An
adapter's A matrices of the slices are stacked ([n * r, in]) and its B matrices placed
block-diagonally ([out, n * r], zero where a slice is not targeted), so every layer's delta is
the same two matmuls; scaling is folded into B once at load.

Batching, the simple way: for each distinct adapter of the pass, index_select the rows of its
tokens, two small matmuls, index_add_ into y. SGLang (S-LoRA / Punica) instead sorts the tokens
by adapter into segments and runs one segment-GEMM kernel (lora/backend: triton or csgmv) over
all adapters at once, reading each segment's A/B from a GPU memory pool of
max_loras_per_batch slots (lora/mem_pool.py), into which adapters are swapped per batch. That
launches O(1) kernels per layer whatever the number of adapters; here it is O(adapters), which
at max_loras_per_batch (8 by default) and on a CPU costs little, and every step reads as the
formula above.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

from minisgl.lora.lora_batch import LoRAAdapter, LoRABatchInfo, build_lora_batch_info
from minisgl.lora.lora_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MLP_MODULES, SUPPORTED_TARGET_MODULES, LoRAConfig

if TYPE_CHECKING:
    from minisgl.models.model_config import ModelConfig

logger = logging.getLogger("minisgl")

# fused module -> the PEFT modules it holds, in output-column order
FUSED_MODULES: Dict[str, Tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's saved names)
_LORA_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def module_shapes(mc: "ModelConfig") -> Dict[str, Tuple[int, int]]:
    """PEFT module -> (in_features, out_features) of the base model's linear layer."""
    q, kv, h, i = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.hidden_size, mc.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip


class LoRAManager:
    def __init__(self, lora_paths: Dict[str, str], model_config: "ModelConfig", device: str, dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.device, self.dtype = device, dtype
        self.adapters: Dict[str, LoRAAdapter] = {name: self._load(name, path) for name, path in lora_paths.items()}
        for a in self.adapters.values():
            logger.info("LoRA adapter %s: r=%d, scaling=%.4g, targets %s", a.name, a.config.r, a.config.scaling, ",".join(a.config.target_modules))

    # ------------------------------------------------------------------ loading
    def _load(self, name: str, path: str) -> LoRAAdapter:
        config = LoRAConfig.from_dir(path)
        mc = self.model_config
        if mc.moe is not None and set(config.target_modules) & set(MLP_MODULES):
            raise ValueError(f"LoRA adapter {name!r} targets MLP modules of a mixture-of-experts model (its experts); "
                             "only attention modules (q/k/v/o_proj) are supported there")  # fmt: skip
        tensors = self._read_tensors(name, path, config)
        weights: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(mc.num_layers):
            for fused, parts in FUSED_MODULES.items():
                if set(parts) & set(config.target_modules):
                    a, b = self._fuse(name, config, tensors, layer, parts)
                    weights[(layer, fused)] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        return LoRAAdapter(name, config, weights)

    def _read_tensors(self, name: str, path: str, config: LoRAConfig) -> Dict[Tuple[int, str, str], torch.Tensor]:
        """adapter_model.safetensors -> {(layer, module, "A" or "B"): weight}; any other tensor is refused."""
        from safetensors.torch import load_file

        weights_file = os.path.join(path, ADAPTER_WEIGHTS)
        if not os.path.isfile(weights_file):
            raise ValueError(f"LoRA adapter {name!r} has no {ADAPTER_WEIGHTS} in {path!r}")
        tensors: Dict[Tuple[int, str, str], torch.Tensor] = {}
        for key, tensor in load_file(weights_file).items():
            m = _LORA_TENSOR.fullmatch(key)
            if m is None or m.group(2) not in SUPPORTED_TARGET_MODULES:
                raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a supported module "
                                 "(q/k/v/o/gate/up/down_proj of a decoder layer)")  # fmt: skip
            if m.group(2) not in config.target_modules:  # (served, it would be silently dropped)
                raise ValueError(
                    f"LoRA adapter {name!r}: tensor {key!r} is for {m.group(2)}, which its {ADAPTER_CONFIG}'s target_modules "
                    f"{list(config.target_modules)} does not list: the config and the weights disagree; add {m.group(2)} "
                    "to target_modules if it was trained, or re-save the adapter with PEFT"
                )
            layer = int(m.group(1))
            if layer >= self.model_config.num_layers:
                raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, the base model has {self.model_config.num_layers}")
            tensors[(layer, m.group(2), m.group(3))] = tensor
        return tensors

    def _fuse(
        self, name: str, config: LoRAConfig, tensors: Dict[Tuple[int, str, str], torch.Tensor], layer: int, parts: Tuple[str, ...]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One fused module's (A [n * r, in], scaling * block-diagonal B [out, n * r]), float32 on the CPU.
        Slice j's B sits in its output rows and in columns [j * r, (j + 1) * r), where its A's rows land."""
        shapes, r = module_shapes(self.model_config), config.r
        a_rows: List[torch.Tensor] = []
        b = torch.zeros(sum(shapes[p][1] for p in parts), len(parts) * r)  # [out, n * r]
        row = 0
        for j, part in enumerate(parts):
            d_in, d_out = shapes[part]
            if part not in config.target_modules:
                a_rows.append(torch.zeros(r, d_in))  # (its B block stays zero: no delta)
                row += d_out
                continue
            a_w, b_w = tensors.get((layer, part, "A")), tensors.get((layer, part, "B"))
            if a_w is None or b_w is None:
                raise ValueError(f"LoRA adapter {name!r} lacks layer {layer}'s {part} lora_A/lora_B weights")
            if tuple(a_w.shape) != (r, d_in) or tuple(b_w.shape) != (d_out, r):
                raise ValueError(
                    f"LoRA adapter {name!r}: layer {layer} {part} has lora_A {tuple(a_w.shape)} and lora_B "
                    f"{tuple(b_w.shape)}, the base model needs ({r}, {d_in}) and ({d_out}, {r}): "
                    "the adapter was trained for another base model"
                )
            a_rows.append(a_w.float())
            b[row : row + d_out, j * r : (j + 1) * r] = b_w.float() * config.scaling
            row += d_out
        return torch.cat(a_rows), b  # [n * r, in], [out, n * r]

    # ------------------------------------------------------------------ per pass
    def prepare_lora_batch(self, lora_ids: Optional[Sequence[Optional[str]]], tokens_per_req: Sequence[int], device: torch.device) -> Optional[LoRABatchInfo]:
        """Group the pass's tokens by adapter (None when every request runs the base model)."""
        return build_lora_batch_info(lora_ids, tokens_per_req, self.adapters, device)
