"""The served model in Ollama's shapes (stage 1, the Ollama API). In: the model directory
(config.json, the safetensors files' headers). Out: the entries of GET /api/tags and /api/ps and
the body of POST /api/show.

Every field is read from what is served, never made up: `size` the weights' bytes on disk,
`parameter_size` and `quantization_level` the tensors' element count and dtype (from the
safetensors headers, a few KiB read per file), `family` and `model_info` the config.json
(Ollama's GGUF keys `<arch>.context_length`, `<arch>.block_count`, ...), `modified_at` the
config's mtime. Two fields have no minisgl counterpart and are filled so that clients can
parse them: `digest` (Ollama's CLI prints digest[:12]) is the sha256 of the served name, the
model path and the weight version, an identity of what is served, not a content hash of the
weights (hashing gigabytes per listing would be too slow); `expires_at` (/api/ps) is far in the
future: the model is never unloaded (docs/server.md, keep_alive).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import struct
from collections import Counter
from functools import lru_cache
from typing import Any, Dict, List, NamedTuple, Optional

from minisgl.models.loader import HUB_PATTERNS, safetensors_files

# /api/ps' expires_at: the model stays loaded for the server's life (Ollama writes a date as far
# off for keep_alive < 0)
NEVER_EXPIRES = "2318-01-01T00:00:00Z"
# safetensors dtype -> Ollama's quantization_level words for unquantized weights
_LEVELS = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F8_E4M3": "F8_E4M3", "F8_E5M2": "F8_E5M2"}


class Weights(NamedTuple):
    size: int  # bytes on disk, every safetensors file
    parameter_count: int  # elements of every tensor
    dtype: Optional[str]  # the dtype most of the elements have (safetensors' name: BF16, F32, ...)


def read_weights(model_dir: str) -> Weights:
    """The weights' size, element count and main dtype, from the safetensors headers alone."""
    size, count, by_dtype = 0, 0, Counter()  # type: ignore[var-annotated]
    try:
        files = safetensors_files(model_dir)
    except (OSError, ValueError):  # (a hub id, or no weights there)
        return Weights(0, 0, None)
    for path in files:
        size += os.path.getsize(path)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in entry["shape"]:
                n *= dim
            count += n
            by_dtype[entry["dtype"]] += n
    return Weights(size, count, by_dtype.most_common(1)[0][0] if by_dtype else None)


def human_count(n: int) -> str:
    """A parameter count as Ollama writes it ("7.6B", "596.0M", "3.1M")."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _config(model_dir: str) -> Dict[str, Any]:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _modified_at(model_dir: str) -> str:
    try:
        mtime = os.path.getmtime(os.path.join(model_dir, "config.json"))
    except OSError:
        mtime = 0.0
    return datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def local_dir(model_path: str) -> str:
    """The directory the loader read `model_path` from: itself, or for a hub id the snapshot in the
    Hugging Face cache that loading it downloaded (looked up in the cache only, never on the
    network: this runs on the event loop); the id itself when there is none."""
    if os.path.isdir(model_path) or not model_path:
        return model_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=model_path, allow_patterns=HUB_PATTERNS, local_files_only=True)
    except Exception:  # (not in the cache: nothing to read, the fields say "unknown")
        return model_path


class ServedModel:
    """What /api/tags, /api/show and /api/ps say about the served model."""

    def __init__(self, name: str, model_path: str, weight_version: str, context_len: int) -> None:
        model_dir = local_dir(model_path)
        self.name, self.model_dir, self.context_len = name, model_dir, context_len
        self.config = _config(model_dir)
        self.weights = read_weights(model_dir)
        self.digest = hashlib.sha256(f"{name}\n{model_path}\n{weight_version}".encode()).hexdigest()
        self.modified_at = _modified_at(model_dir)

    @property
    def family(self) -> str:
        return str(self.config.get("model_type") or "unknown")

    def details(self) -> Dict[str, Any]:
        """Ollama's ModelDetails."""
        return {"parent_model": "", "format": "safetensors", "family": self.family, "families": [self.family],
                "parameter_size": human_count(self.weights.parameter_count) if self.weights.parameter_count else "unknown",
                "quantization_level": _LEVELS.get(self.weights.dtype or "", self.weights.dtype or "unknown")}  # fmt: skip

    def tags_entry(self) -> Dict[str, Any]:
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.weights.size,
                "digest": self.digest, "details": self.details()}  # fmt: skip

    def ps_entry(self, on_gpu: bool) -> Dict[str, Any]:
        """/api/ps' entry: size_vram all of it on a GPU, 0 on a CPU (Ollama's CLI prints "100% GPU" / "100% CPU")."""
        return {"name": self.name, "model": self.name, "size": self.weights.size, "digest": self.digest, "details": self.details(),
                "expires_at": NEVER_EXPIRES, "size_vram": self.weights.size if on_gpu else 0, "context_length": self.context_len}  # fmt: skip

    def model_info(self) -> Dict[str, Any]:
        """Ollama's model_info keys (GGUF's names), those the config holds."""
        c, arch = self.config, self.family
        info: Dict[str, Any] = {"general.architecture": arch, "general.parameter_count": self.weights.parameter_count,
                                f"{arch}.context_length": self.context_len}  # fmt: skip
        keys = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
                "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
                "rope.freq_base": "rope_theta", "vocab_size": "vocab_size"}  # fmt: skip
        for key, name in keys.items():
            if c.get(name) is not None:
                info[f"{arch}.{key}"] = c[name]
        return info

    def show_body(self, template: Optional[str], defaults: Dict[str, Any], capabilities: List[str]) -> Dict[str, Any]:
        """POST /api/show: `template` the chat template (Jinja: minisgl's, not Ollama's Go
        templates), `parameters` the model's default sampling (generation_config.json) in
        Ollama's "name value" lines, `modelfile` those as a Modelfile FROM the model directory."""
        names = {"repetition_penalty": "repeat_penalty"}
        parameters = "\n".join(f"{names.get(k, k):<30} {v}" for k, v in sorted(defaults.items()))
        modelfile = "".join([f"# minisgl serves {self.name}\nFROM {self.model_dir}\n"] +
                            [f"PARAMETER {names.get(k, k)} {v}\n" for k, v in sorted(defaults.items())])  # fmt: skip
        return {"modelfile": modelfile, "parameters": parameters, "template": template or "", "details": self.details(),
                "model_info": self.model_info(), "capabilities": capabilities, "modified_at": self.modified_at}  # fmt: skip


@lru_cache(maxsize=4)
def served_model(name: str, model_path: str, weight_version: str, context_len: int) -> ServedModel:
    """The ServedModel of what is served, read once per (model, weight version): every shard's
    header is read on the event loop, so not on each /api/tags, /api/ps, /api/show; a weight update
    (a new model_path or weight_version) reads it again."""
    return ServedModel(name, model_path, weight_version, context_len)
