"""LoRA adapter configs: `--lora-paths` parsed, and a PEFT adapter_config.json read and checked.

Where it sits: ServerArgs checks `--lora-paths` with `parse_lora_paths` (names, directories)
before any process starts, and resolve_server_args keeps its ((name, path), ...) as
`ServerArgs.lora_adapters`, the adapters loaded at start; the ModelRunner's LoRAManager (lora_manager.py) then reads each
adapter's `LoRAConfig.from_dir` and its weights. No torch here: ServerArgs imports this module.

What minisgl serves of PEFT's LoraConfig: rank `r`, `lora_alpha`, `use_rslora` (scaling
alpha / sqrt(r) instead of alpha / r) and `target_modules` given as a list of the decoder's
linear layers (q/k/v/o_proj, gate/up/down_proj). Every other setting that changes what the
adapter computes is refused with a ValueError naming the field, never silently dropped; so are
adapters whose init_lora_weights (PiSSA, OLoRA, CorDA, LoftQ) also rewrote the base weights.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

# the decoder's linear layers an adapter may target (PEFT's names: the checkpoint's)
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT fields whose non-default values change what the adapter computes, with why minisgl refuses them
_REFUSED_FIELDS: Tuple[Tuple[str, Any, str], ...] = (
    ("use_dora", False, "DoRA's magnitude vector is not implemented"),
    ("modules_to_save", None, "fully trained copies of base modules are not loaded"),
    ("fan_in_fan_out", False, "transposed (Conv1D-style) weights are not supported"),
    ("layers_to_transform", None, "adapters on a subset of layers are not supported"),
    ("layers_pattern", None, "adapters on a subset of layers are not supported"),
    ("rank_pattern", {}, "per-module ranks are not supported"),
    ("alpha_pattern", {}, "per-module alphas are not supported"),
    ("exclude_modules", None, "excluded modules are not supported"),
    ("trainable_token_indices", None, "trained embedding rows are not loaded"),
    ("target_parameters", None, "adapters on parameters (MoE experts) are not supported"),
    ("lora_bias", False, "LoRA biases are not supported"),
    ("layer_replication", None, "layer replication is not supported"),
    ("use_qalora", False, "QALoRA is not supported"),
)


def parse_lora_paths(entries: Sequence[str]) -> Tuple[Tuple[str, str], ...]:
    """`--lora-paths NAME=PATH [NAME=PATH ...]` (SGLang's; a bare PATH names itself) -> ((name, path), ...)
    in the order given. Refuses duplicate names and missing directories, so a typo fails the start."""
    out: Dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"--lora-paths entries are NAME=PATH or PATH strings, got {entry!r}")
        name, sep, path = entry.partition("=")
        if not sep:
            name = path = entry
        if not name or not path:
            raise ValueError(f"--lora-paths entry {entry!r} needs a name and a path: NAME=PATH")
        if "\0" in name:  # (mem_cache/namespace.py: the NUL separates an adapter from a request's cache key)
            raise ValueError(f"--lora-paths adapter name {name!r} holds a NUL character; name it without one")
        if name in out:
            raise ValueError(f"--lora-paths names adapter {name!r} twice; give each adapter its own name")
        if not os.path.isdir(path):
            raise ValueError(f"--lora-paths: adapter {name!r} directory {path!r} does not exist")
        out[name] = path
    return tuple(out.items())


@dataclass(frozen=True)
class LoRAConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: Tuple[str, ...]

    @property
    def scaling(self) -> float:
        """PEFT's: the delta B A x is multiplied by alpha / r, or alpha / sqrt(r) with use_rslora."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_dir(cls, path: str) -> "LoRAConfig":
        config_file = os.path.join(path, ADAPTER_CONFIG)
        if not os.path.isfile(config_file):
            raise ValueError(f"LoRA adapter {path!r} has no {ADAPTER_CONFIG} (a PEFT save_pretrained directory)")
        with open(config_file) as f:
            return cls.from_dict(json.load(f), path)

    @classmethod
    def from_dict(cls, cfg: Dict[str, Any], path: str = "<dict>") -> "LoRAConfig":
        where = f"LoRA adapter {path!r}"
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
        for name, default, why in _REFUSED_FIELDS:
            value = cfg.get(name, default)
            if value not in (default, None) and value != [] and value != {}:
                raise ValueError(f"{where}: {name}={value!r} is not supported ({why})")
        init = cfg.get("init_lora_weights", True)
        if isinstance(init, str) and (init.lower().startswith(("pissa", "corda")) or init.lower() in ("olora", "loftq")):
            # these inits change the base weights too (PiSSA/OLoRA/CorDA subtract the adapter's initial
            # part, LoftQ quantizes them): the saved A and B only hold on that modified base model
            raise ValueError(
                f"{where}: init_lora_weights={init!r} adapters only match the base model they modified; convert the "
                "adapter with PEFT first (save_pretrained(..., path_initial_model_for_weight_conversion=<the saved "
                "initial adapter>)), which makes it a plain LoRA adapter of the original base model"
            )
        if cfg.get("bias", "none") != "none":
            raise ValueError(f"{where}: bias={cfg['bias']!r} is not supported (trained biases are not loaded); use bias='none'")
        targets = cfg.get("target_modules")
        if not isinstance(targets, list) or not targets:
            raise ValueError(
                f"{where}: target_modules={targets!r}; give it as a list of module names "
                f"(a subset of {', '.join(SUPPORTED_TARGET_MODULES)}); PEFT's regex form is not supported"
            )
        bad = [t for t in targets if t not in SUPPORTED_TARGET_MODULES]
        if bad:
            raise ValueError(
                f"{where}: target_modules {bad} are not supported; LoRA applies to {', '.join(SUPPORTED_TARGET_MODULES)} "
                "(not to embeddings, lm_head or MoE experts)"
            )
        r, alpha = cfg.get("r"), cfg.get("lora_alpha")
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"{where}: r must be an integer >= 1, got {r!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
        return cls(r=r, lora_alpha=float(alpha), use_rslora=bool(cfg.get("use_rslora", False)), target_modules=tuple(sorted(set(targets))))
