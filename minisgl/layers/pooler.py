"""Pooler: final hidden states -> one embedding per request (an embedding model's head).

Where it sits: model (after the final norm) -> Pooler -> Scheduler, in place of the
LogitsProcessor and the sampler when the server runs with `--is-embedding` (SGLang's
layers/pooler.py). In: hidden [N, H] for every token of an extend pass; out:
`EmbeddingPoolerOutput.embeddings`, one float32 row per request.

LAST pooling, SGLang's for decoder embedding models (Qwen3-Embedding and the like): a
causal model's last prompt token is the only one that has read the whole prompt. Then,
as SGLang's Pooler: cut each row to the request's Matryoshka `dimensions` (if it asked),
and L2-normalise, so that a dot product of two embeddings is their cosine similarity.
Only the last token of each request goes through the head, as in the LogitsProcessor; in
a chunked prefill every chunk gives a row, and the scheduler keeps only the final chunk's.
"""

from __future__ import annotations

from typing import List, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.model_executor.forward_batch_info import ForwardBatch


class EmbeddingPoolerOutput(NamedTuple):
    # [bs, H] float32; a list of [d_i] rows when the requests asked for different dimensions
    embeddings: Union[torch.Tensor, List[torch.Tensor]]


class Pooler(nn.Module):
    """LAST pooling, optional Matryoshka cut, L2 normalisation (no parameters)."""

    def __init__(self, normalize: bool = True) -> None:
        super().__init__()
        self.normalize = normalize

    def forward(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> EmbeddingPoolerOutput:
        # float32 before the norm: a bf16 model's rows are summed in float32, and clients read float32
        pooled = hidden_states[forward_batch.last_token_indices()].float()  # [bs, H]
        dims = forward_batch.dimensions
        if dims is None:
            return EmbeddingPoolerOutput(self._normalized(pooled))
        # per request: its first d numbers (d None: all of them), then normalised on their own
        rows = [self._normalized(row[:d]) for row, d in zip(pooled, dims)]  # [d_i] each
        return EmbeddingPoolerOutput(rows)

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2, dim=-1) if self.normalize else x
