"""Model loader: a directory or hub id -> a DecoderForCausalLM with its weights, on a device.

Where it sits: ModelRunner.__init__ -> resolve_model_path -> ModelConfig.from_pretrained ->
load_model. In: `--model-path`; out: the model, in `--dtype`, on `--device`.

- A local directory is used as is. Anything else is a hub id: `snapshot_download` fetches
  it (or finds it in the Hugging Face cache when offline).
- Weights come from safetensors: one `model.safetensors`, or the shards listed in
  `model.safetensors.index.json`. A tqdm bar counts tensors as they load.
- Files store any dtype (the built-in model ships bf16); each tensor is cast to the
  parameter's dtype as it is copied in.
- With --tp-size N, each rank reads every tensor and its layers' weight_loaders keep this
  rank's slice (decoder.load_weights): N ranks read the checkpoint N times, simple and
  what SGLang's default loader does too.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator, List, Optional, Tuple

import torch

from minisgl.distributed import GroupCoordinator
from minisgl.models.decoder import DecoderForCausalLM
from minisgl.models.model_config import ModelConfig
from minisgl.server_args import is_missing_local_dir

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


def resolve_model_path(model_path: str) -> str:
    """A local directory for `model_path`: itself, or the hub snapshot (downloaded or cached)."""
    if os.path.isdir(model_path):
        return model_path
    if is_missing_local_dir(model_path):
        raise ValueError(f"Model directory {model_path!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=model_path, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # offline and not cached, unknown repo, gated repo, ...
        raise ValueError(
            f"Cannot find model {model_path!r}: it is not a local directory, and it could not be downloaded from the "
            f"Hugging Face hub nor found in the local cache ({type(e).__name__}: {e}). Fix: connect to the network, "
            f"or run `hf download {model_path}` (older huggingface_hub: `huggingface-cli download {model_path}`) "
            "on a machine that can, or pass --model-path <local dir>."
        ) from e


def safetensors_files(model_dir: str) -> List[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise ValueError(f"No *.safetensors weights in {model_dir} (minisgl does not load .bin checkpoints)")
    return [os.path.join(model_dir, f) for f in found]


def iterate_weights(model_dir: str, show_progress: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, on the CPU, with a progress bar."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(model_dir)
    handles = [safe_open(path, framework="pt", device="cpu") for path in files]
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not show_progress) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters are created as torch.empty in the target dtype; restore the global default after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    config: ModelConfig, device: str, dtype: torch.dtype, kernels: str = "torch", show_progress: bool = True,
    is_embedding: bool = False, tp_group: Optional[GroupCoordinator] = None,
) -> DecoderForCausalLM:
    """The model of `config` with its weights, on `device`; on one of --tp-size N ranks
    (`tp_group`), with this rank's slice of each split weight (every rank reads the whole
    checkpoint and keeps its part, as SGLang's default loader does)."""
    with _default_dtype(dtype), torch.device(device):
        model = DecoderForCausalLM(config, kernels=kernels, is_embedding=is_embedding, tp_group=tp_group)
    with torch.no_grad():
        model.load_weights(iterate_weights(config.model_path, show_progress))
    return model.eval()
