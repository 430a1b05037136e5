"""LoRAManager: every served adapter's weights, and their deltas added to the decoder's projections.

Where it sits: the ModelRunner builds one LoRAManager at start when LoRA is on (--lora-paths,
--enable-lora) and loads the --lora-paths adapters. While serving, the Scheduler hands it
/load_lora_adapter's and /unload_lora_adapter's messages (`load_lora_adapter`,
`unload_lora_adapter`); it keys adapters by `lora_id`, the id of each load (lora_registry.py).
Per forward pass, ModelRunner.forward_eager calls `prepare_lora_batch`
with the ForwardBatch's plain fields (its `lora_ids`, one adapter lora_id or None per request, and
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
from minisgl.lora.lora_registry import LoRARef, LoRARegistry

if TYPE_CHECKING:
    from minisgl.models.model_config import ModelConfig
    from minisgl.server_args import ServerArgs

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
    def __init__(
        self,
        lora_paths: Dict[str, str],
        model_config: "ModelConfig",
        device: str,
        dtype: torch.dtype,
        max_lora_rank: Optional[int] = None,
        target_modules: Optional[Sequence[str]] = None,
    ) -> None:
        self.model_config = model_config
        self.device, self.dtype = device, dtype
        # lora_id -> the adapter (name, directory, config, weights): what the scheduler asks about
        # and each pass reads
        self.adapters: Dict[str, LoRAAdapter] = {}
        # --lora-paths: ids as the LoRARegistry of the HTTP process (or the Engine) mints them, so
        # that both sides name each start-up adapter alike without a message between them
        for ref in LoRARegistry(lora_paths.items()).refs():
            self.adapters[ref.lora_id] = self._load(ref.lora_name, ref.lora_path)
        self.init_lora_shapes(max_lora_rank, target_modules)
        for a in self.adapters.values():
            logger.info("LoRA adapter %s: r=%d, scaling=%.4g, targets %s", a.name, a.config.r, a.config.scaling, ",".join(a.config.target_modules))

    @classmethod
    def from_server_args(cls, args: "ServerArgs", model_config: "ModelConfig", device: str, dtype: torch.dtype) -> Optional["LoRAManager"]:
        """The ModelRunner's manager: None when LoRA is off (no --lora-paths, no --enable-lora)."""
        if not args.enable_lora:
            return None
        return cls(dict(args.lora_adapters or ()), model_config, device, dtype, args.max_lora_rank, args.lora_target_modules)

    def init_lora_shapes(self, max_lora_rank: Optional[int], target_modules: Optional[Sequence[str]]) -> None:
        """SGLang's: what a later load may use. Each not given is inferred from the --lora-paths
        adapters (the largest rank, every module one of them targets); each given must hold them.
        minisgl stores each adapter at its own rank (no pool sized by them): the two are limits on
        what a load may add, kept so a server refuses what SGLang's refuses."""
        loaded = list(self.adapters.values())
        self._inferred = {"rank": max_lora_rank is None, "targets": target_modules is None}  # (said in refusals)
        self.max_lora_rank = max_lora_rank if max_lora_rank is not None else max((a.config.r for a in loaded), default=0)
        self.target_modules = (
            frozenset(target_modules) if target_modules is not None else frozenset(t for a in loaded for t in a.config.target_modules)
        )
        for a in loaded:  # (a start-up adapter outside the flags given fails the start, naming the flag)
            self._check_shape(a.name, a.config)
        logger.info("LoRA: adapters loaded later may have rank <= %d and target %s", self.max_lora_rank, ",".join(sorted(self.target_modules)) or "nothing")

    def _check_shape(self, name: str, config: LoRAConfig) -> None:
        """An adapter's rank and targets against --max-lora-rank and --lora-target-modules."""
        if config.r > self.max_lora_rank:
            where = " (not given: the largest rank of --lora-paths)" if self._inferred["rank"] else ""
            raise ValueError(
                f"LoRA adapter {name!r} has rank {config.r}, above --max-lora-rank {self.max_lora_rank}{where}: "
                f"restart the server with --max-lora-rank {config.r} or more"
            )
        outside = sorted(set(config.target_modules) - self.target_modules)
        if outside:
            wanted = " ".join(sorted(self.target_modules | set(outside)))
            where = " (not given: the modules --lora-paths target)" if self._inferred["targets"] else ""
            raise ValueError(
                f"LoRA adapter {name!r} targets {outside}, outside --lora-target-modules "
                f"{sorted(self.target_modules)}{where}: restart the server with --lora-target-modules {wanted} (or all)"
            )

    # ------------------------------------------------------------------ load and unload while serving
    def load_lora_adapter(self, ref: LoRARef) -> None:
        """Read, check and keep one adapter under its new lora_id (SGLang's load_lora_adapter +
        validate_new_adapter). ValueError says why it was refused; then nothing changed."""
        if ref.lora_id in self.adapters:  # (the registry mints a new id per load: a bug if not)
            raise ValueError(f"LoRA adapter id {ref.lora_id!r} is loaded already")
        if any(a.name == ref.lora_name for a in self.adapters.values()):
            raise ValueError(f"Failed to load LoRA adapter {ref.lora_name!r} because it is already loaded")
        if not isinstance(ref.lora_path, str) or not os.path.isdir(ref.lora_path):
            raise ValueError(f"LoRA adapter {ref.lora_name!r}: {ref.lora_path!r} is not a directory (a PEFT save_pretrained directory)")
        config = LoRAConfig.from_dir(ref.lora_path)
        self._check_shape(ref.lora_name, config)  # (before reading the weights)
        for other in self.adapters.values():
            if other.path == ref.lora_path:  # (SGLang warns too: two names, two copies)
                logger.warning("LoRA adapter %s is loaded from %s, which adapter %s was loaded from too", ref.lora_name, ref.lora_path, other.name)
        self.adapters[ref.lora_id] = self._load(ref.lora_name, ref.lora_path, config, ref.pinned)
        logger.info("LoRA adapter %s loaded (id %s, r=%d, targets %s)%s", ref.lora_name, ref.lora_id, config.r,
                    ",".join(config.target_modules), "; pinned: minisgl keeps every adapter resident" if ref.pinned else "")  # fmt: skip

    def unload_lora_adapter(self, lora_id: str) -> None:
        """Drop one load's weights (the Scheduler first waits until no request uses it)."""
        adapter = self.adapters.pop(lora_id, None)
        if adapter is None:
            raise ValueError(f"LoRA adapter id {lora_id!r} is not loaded")
        logger.info("LoRA adapter %s unloaded (id %s)", adapter.name, lora_id)

    def loaded_adapters(self) -> Dict[str, str]:
        """Name -> directory of every loaded adapter (LoRAUpdateOutput.loaded_adapters)."""
        return {a.name: a.path for a in self.adapters.values()}

    # ------------------------------------------------------------------ loading
    def _load(self, name: str, path: str, config: Optional[LoRAConfig] = None, pinned: bool = False) -> LoRAAdapter:
        config = config if config is not None else LoRAConfig.from_dir(path)
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
        return LoRAAdapter(name, path, config, weights, pinned)

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
