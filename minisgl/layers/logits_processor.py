"""LogitsProcessor: final hidden states -> next-token logits (the LM head).

Where it sits: model (after the final norm) -> LogitsProcessor -> ModelRunner.sample.
In: hidden [N, H] for every token of the pass; out: LogitsProcessorOutput with
`next_token_logits [bs, V]` float32.

Tensor parallelism (`--tp-size N`): the LM head is split by vocabulary rows
(ParallelLMHead), so each rank's matmul gives its [M, V / N] columns of the logits;
`_get_logits` all_gathers them into [M, V] on every rank (SGLang's _get_logits) and cuts the
padding columns past V. Every rank then holds the same logits, bit for bit, and samples the
same tokens from them: the schedulers stay in step without sending a token to each other.

In an extend only the last token of each request needs logits (`last_token_indices()`),
so only bs rows go through the [H, V] matmul, not all N; a 2000-token prompt then costs
one LM-head row, not 2000. With `return_all_logits` (set only by the transformers parity
tests) every position is kept in `full_logits [N, V]` as well. A TARGET_VERIFY pass (speculative
decoding) needs every row: row j of a request scores its j-th draft token, so `next_token_logits`
is [N, V] there, one row per token of the pass.

Hidden states (a request of the pass asked for return_hidden_states, so the ForwardBatch's
`capture_hidden_mode` is FULL): `hidden_states` keeps the input [N, H] itself, the final-norm
hidden state of every token of the pass (SGLang's hidden_states_to_store): no copy, no work; the
scheduler reads each asking request's rows. NULL (every other pass) keeps nothing.

Prompt logprobs (a request with `logprob_start_len` >= 0): the rows the ForwardBatch names in
`input_logprob_indices` also go through the LM head, and `input_logprobs` holds log p(the next
prompt token) at each, with the top-k and the logprobs of the ids a request names
(`token_ids_logprob`). The distribution is the model's own: no temperature, no
penalties (they shape sampling; SGLang's default). The rows run in slices, so a long prompt
never holds all its [M, V] logits at once (a 4,000-token prompt at a 152k vocabulary: 2.4 GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn

import torch.nn.functional as F

from minisgl.distributed import GroupCoordinator
from minisgl.layers.linear import EXACT_PACKED_ROWS, linear, single_rank
from minisgl.model_executor.forward_batch_info import ForwardBatch


# float32 logits one slice of prompt-logprob rows may hold (64 MB): 4,096 rows at a 4k vocabulary
INPUT_LOGPROB_SLICE_ELEMENTS = 1 << 24


class InputLogprobs(NamedTuple):
    """Prompt logprobs of the rows a ForwardBatch names in `input_logprob_indices`."""

    token_logprobs: torch.Tensor  # [M] float32: log p(target id | the tokens before it)
    top_val: Optional[torch.Tensor]  # [M, k] float32, None when k == 0
    top_idx: Optional[torch.Tensor]  # [M, k] int64
    token_ids_val: Optional[torch.Tensor] = None  # [M, T] float32 at input_logprob_token_ids (padded rows too)


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [bs, V] float32: logits that pick each request's next token ([N, V] in TARGET_VERIFY)
    full_logits: Optional[torch.Tensor] = None  # [N, V] float32, only with return_all_logits
    input_logprobs: Optional[InputLogprobs] = None  # only when the batch asks for prompt logprobs
    # [N, H] in the model dtype: every token's final-norm hidden state, only with CaptureHiddenMode.FULL
    hidden_states: Optional[torch.Tensor] = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, tp_group: Optional[GroupCoordinator] = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_group = single_rank(tp_group)

    def _get_logits(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, lm_head_packed: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """hidden [M, H] -> float32 logits [M, V] over the whole vocabulary, on every rank."""
        logits = linear(hidden, lm_head_weight, packed=lm_head_packed)  # [M, V / N]: this rank's vocabulary rows
        if self.tp_group.world_size > 1:
            logits = self.tp_group.all_gather(logits, dim=-1)  # [M, V_padded], in rank order
            if logits.shape[-1] != self.vocab_size:
                logits = logits[:, : self.vocab_size].contiguous()  # [M, V]: the padding rows' zeros go
        return logits.float()

    def forward(
        self,
        hidden_states: torch.Tensor,  # [N, H]
        lm_head_weight: torch.Tensor,  # [V / N, H], this rank's vocabulary rows (empty once packed)
        forward_batch: ForwardBatch,
        lm_head_packed: Optional[torch.Tensor] = None,  # the oneDNN-packed head on CPU (linear.py)
    ) -> LogitsProcessorOutput:
        last = forward_batch.last_token_indices()  # [bs]
        input_logprobs = None
        if forward_batch.input_logprob_indices is not None:
            assert forward_batch.input_logprob_target_ids is not None
            input_logprobs = self.input_logprobs(
                hidden_states[forward_batch.input_logprob_indices],
                forward_batch.input_logprob_target_ids,
                forward_batch.input_logprob_top_k,
                lm_head_weight,
                lm_head_packed,
                forward_batch.input_logprob_token_ids,
            )
        # SGLang's _get_hidden_states_to_store, FULL mode: the hidden states as the model handed them
        # over, after its final norm (what transformers' output_hidden_states[-1] is)
        stored = hidden_states if forward_batch.capture_hidden_mode.is_full() else None  # [N, H]
        if forward_batch.return_all_logits:
            full = self._get_logits(hidden_states, lm_head_weight, lm_head_packed)  # [N, V]
            return LogitsProcessorOutput(
                next_token_logits=full[last], full_logits=full, input_logprobs=input_logprobs, hidden_states=stored
            )
        # (a verify pass samples at every row: nothing to prune)
        pruned = hidden_states if forward_batch.forward_mode.is_target_verify() else hidden_states[last]  # [bs or N, H]
        next_token_logits = self._get_logits(pruned, lm_head_weight, lm_head_packed)  # [bs, V]
        return LogitsProcessorOutput(next_token_logits=next_token_logits, input_logprobs=input_logprobs, hidden_states=stored)

    def input_logprobs(
        self,
        hidden: torch.Tensor,  # [M, H]: the rows whose next token is scored
        target_ids: torch.Tensor,  # [M] int64
        top_k: int,
        lm_head_weight: torch.Tensor,
        lm_head_packed: Optional[torch.Tensor],
        token_ids: Optional[torch.Tensor] = None,  # [M, T]: ids each row also reads (token_ids_logprob)
    ) -> InputLogprobs:
        """log_softmax over the vocabulary at each row, read at its target id (+ top-k, + the
        named ids), in slices."""
        rows_per_slice = max(1, INPUT_LOGPROB_SLICE_ELEMENTS // self.vocab_size)
        token_parts, val_parts, idx_parts, ids_parts = [], [], [], []
        for start in range(0, hidden.shape[0], rows_per_slice):
            rows = slice(start, start + rows_per_slice)
            x = hidden[rows]  # [m, H]
            n = x.shape[0]
            if lm_head_packed is not None and n > EXACT_PACKED_ROWS:
                # oneDNN keeps a primitive per row count it meets (layers.linear.packed_rows):
                # slices of every length made the scheduler grow by ~230 MB on the built-in
                # model. A power of two (at most a whole slice) leaves a handful of counts.
                x = F.pad(x, (0, 0, 0, min(1 << (n - 1).bit_length(), rows_per_slice) - n))
            logits = self._get_logits(x, lm_head_weight, lm_head_packed)[:n]  # [m, V]
            # clamped as the sampler's output logprobs: JSON has no -inf
            logprobs = torch.log_softmax(logits, dim=-1).clamp_(min=torch.finfo(torch.float32).min)  # [m, V]
            token_parts.append(logprobs.gather(-1, target_ids[rows, None]).squeeze(-1))
            if top_k > 0:
                values, indices = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)  # [m, k] each
                val_parts.append(values)
                idx_parts.append(indices)
            if token_ids is not None:
                ids_parts.append(logprobs.gather(-1, token_ids[rows]))  # [m, T]
        token_logprobs = torch.cat(token_parts) if token_parts else hidden.new_empty(0, dtype=torch.float32)
        named = torch.cat(ids_parts) if ids_parts else None
        if top_k == 0 or not val_parts:
            return InputLogprobs(token_logprobs, None, None, named)
        return InputLogprobs(token_logprobs, torch.cat(val_parts), torch.cat(idx_parts), named)
