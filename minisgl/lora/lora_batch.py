"""One forward pass's LoRA work: the pass's tokens grouped by adapter, and the delta each
projection adds.

Where it sits: the ModelRunner's LoRAManager (lora_manager.py) builds a LoRABatchInfo once per
pass with `build_lora_batch_info` (from the ForwardBatch's plain fields: each request's adapter
load, its lora_id, and token count) and sets it on `forward_batch.lora_batch_info`. DecoderAttention and
DecoderMLP (models/decoder.py) then call `apply_lora` after each projection. This module
imports no executor or model code, so the ForwardBatch can name LoRABatchInfo and the models can
apply it without importing the manager (no import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from minisgl.lora.lora_config import LoRAConfig


@dataclass
class LoRAAdapter:
    """One loaded adapter, the LoRAManager's record of it: its name and directory (what the
    answers to loads and unloads list), `pinned` as its load asked, its config and weights."""

    name: str
    path: str
    config: LoRAConfig
    # (layer id, fused module) -> (A [n * r, in], scaling * block-diagonal B [out, n * r])
    weights: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]]
    pinned: bool = False


@dataclass
class LoRABatchInfo:
    """One pass's tokens grouped by adapter: (adapter, rows of input_ids) per distinct adapter
    (base-model tokens are in no group: they get no delta)."""

    segments: List[Tuple[LoRAAdapter, torch.Tensor]]  # rows: [tokens of that adapter] int64


def build_lora_batch_info(
    lora_ids: Optional[Sequence[Optional[str]]],
    tokens_per_req: Sequence[int],
    adapters: Mapping[str, LoRAAdapter],
    device: torch.device,
) -> Optional[LoRABatchInfo]:
    """Group a pass's tokens by adapter. lora_ids: each request's adapter load, its lora_id (None:
    the base model); tokens_per_req: each request's tokens in the pass, in order (its extend length, or 1
    for a decode row). None when every request runs the base model."""
    if lora_ids is None or all(i is None for i in lora_ids):
        return None
    assert len(lora_ids) == len(tokens_per_req), (len(lora_ids), len(tokens_per_req))
    rows: Dict[str, List[int]] = {}
    start = 0
    for lora_id, n in zip(lora_ids, tokens_per_req):
        if lora_id is not None:
            rows.setdefault(lora_id, []).extend(range(start, start + n))
        start += n
    return LoRABatchInfo([(adapters[name], torch.tensor(r, dtype=torch.int64, device=device)) for name, r in rows.items()])


def apply_lora(info: Optional[LoRABatchInfo], layer_id: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y += scaling * B (A x) for each token of an adapter that targets (layer_id, module), in place.
    x: [N, in]; y: [N, out]; returns y."""
    if info is None:
        return y
    for adapter, rows in info.segments:
        w = adapter.weights.get((layer_id, module))
        if w is None:  # the adapter does not target this module
            continue
        a, b = w
        xa = x.index_select(0, rows) @ a.T  # [T, n * r]
        y.index_add_(0, rows, xa @ b.T)  # [T, out] added to its tokens' rows
    return y
