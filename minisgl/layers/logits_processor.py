"""LogitsProcessor: final hidden states -> next-token logits (the LM head).

Where it sits: model (after the final norm) -> LogitsProcessor -> ModelRunner.sample.
In: hidden [N, H] for every token of the pass; out: LogitsProcessorOutput with
`next_token_logits [bs, V]` float32.

In an extend only the last token of each request needs logits (`last_token_indices()`),
so only bs rows go through the [H, V] matmul, not all N; a 2000-token prompt then costs
one LM-head row, not 2000. With `return_all_logits` (set only by the transformers parity
tests: minisgl computes no prompt logprobs) every position is kept in `full_logits [N, V]` as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from minisgl.layers.linear import linear
from minisgl.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [bs, V] float32: logits that pick each request's next token
    full_logits: Optional[torch.Tensor] = None  # [N, V] float32, only with return_all_logits


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self,
        hidden_states: torch.Tensor,  # [N, H]
        lm_head_weight: torch.Tensor,  # [V, H] (empty once packed)
        forward_batch: ForwardBatch,
        lm_head_packed: Optional[torch.Tensor] = None,  # the oneDNN-packed head on CPU (linear.py)
    ) -> LogitsProcessorOutput:
        last = forward_batch.last_token_indices()  # [bs]
        if forward_batch.return_all_logits:
            full = linear(hidden_states, lm_head_weight, packed=lm_head_packed).float()  # [N, V]
            return LogitsProcessorOutput(next_token_logits=full[last], full_logits=full)
        pruned = hidden_states[last]  # [bs, H]
        return LogitsProcessorOutput(next_token_logits=linear(pruned, lm_head_weight, packed=lm_head_packed).float())
