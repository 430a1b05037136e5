"""The token embedding and the LM head, split by vocabulary rows across tensor-parallel ranks.

Where it sits: first and last layer of the decoder. `VocabParallelEmbedding`: input ids [N]
-> hidden [N, H] (DecoderModel.embed_tokens). `ParallelLMHead`: the [V, H] weight the
LogitsProcessor multiplies the final hidden states by (its all_gather puts the vocabulary
back together). SGLang's names and split (its layers/vocab_parallel_embedding.py).

Split (`--tp-size N`, docs/parallelism.md): rank r holds vocabulary rows
[r * V_r, (r + 1) * V_r), V_r = ceil(V / N). When N does not divide V, the last rank's
table ends with zero rows past V (padding): their logits are 0, and the LogitsProcessor
cuts them off before anything samples. SGLang pads V to a multiple of 64 first (GPU-friendly
shapes) and adds LoRA's extra vocabulary; minisgl pads only what the split needs.

Lookup on N > 1 ranks: each rank looks up the ids that fall in its rows, writes zeros for
the others, and an all_reduce adds the N partial tables: every id's row comes from exactly
one rank, the other N - 1 add zeros, so the result has the bits of a whole-table lookup.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import GroupCoordinator
from minisgl.layers.linear import CpuPackedWeight, ShardId, single_rank


class VocabParallelEmbedding(nn.Module):
    """Embedding table [V, H] split by rows: this rank holds [V_r, H] (zero rows past V)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: Optional[GroupCoordinator] = None) -> None:
        super().__init__()
        self.tp_group = single_rank(tp_group)
        tp_rank, tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.org_vocab_size = num_embeddings  # V, the model's vocabulary
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)  # V_r = ceil(V / N)
        self.num_embeddings_padded = self.num_embeddings_per_partition * tp_size
        # this rank's ids: [vocab_start_index, vocab_end_index); the rest of its rows are padding
        self.vocab_start_index = min(tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))  # [V_r, H]

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Optional[ShardId] = None) -> None:
        """Copy this rank's rows of the full [V, H] checkpoint tensor; zero the padding rows."""
        expected = (self.org_vocab_size, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"shape mismatch: parameter {expected} (split across ranks) vs checkpoint {tuple(loaded_weight.shape)}")
        n = self.vocab_end_index - self.vocab_start_index
        param.data[:n].copy_(loaded_weight[self.vocab_start_index : self.vocab_end_index])
        param.data[n:].zero_()  # padding: a zero logit, cut before sampling

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [V, H] tensor (to compare a tied checkpoint's head with)."""
        return full[self.vocab_start_index : self.vocab_end_index]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return F.embedding(input_ids, self.weight)  # [N, H]
        mine = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)  # [N]
        local_ids = torch.where(mine, input_ids - self.vocab_start_index, torch.zeros_like(input_ids))  # [N]
        out = F.embedding(local_ids, self.weight)  # [N, H]
        out.masked_fill_(~mine[:, None], 0)  # ids another rank holds: that rank adds their rows
        return self.tp_group.all_reduce(out)  # [N, H], the whole-table lookup on every rank


class ParallelLMHead(CpuPackedWeight, VocabParallelEmbedding):
    """The untied LM head [V, H], split by vocabulary rows like the embedding.

    It is a weight, not a forward: the LogitsProcessor multiplies by it (through the oneDNN
    packing on the CPU) and gathers the ranks' logits (SGLang's ParallelLMHead does the same)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: Optional[GroupCoordinator] = None) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_group)
        self.packed_weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is a weight: the LogitsProcessor multiplies the hidden states by it")
