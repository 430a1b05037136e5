"""Penalties that depend on what a request has generated so far (sglang-facts.md §11.2).

Where it sits: Scheduler -> SamplingBatchInfo.from_reqs -> BatchedPenalizerOrchestrator;
ModelRunner.sample -> SamplingBatchInfo.apply_logits_bias -> `apply(logits)` before the
Sampler. In: next-token logits [bs, V]; out: the same tensor, penalised in place.

As in SGLang, penalties look at **generated output tokens only** (never the prompt):
- frequency:  logits -= frequency_penalty * count(token)
- presence:   logits -= presence_penalty * [count(token) > 0]
- repetition: for seen tokens, logits < 0 ? logits * p : logits / p
- min_new_tokens: while len(output_ids) < min_new_tokens, the request's stop ids
  (stop_token_ids and EOS, see `stop_token_set`) get -inf, so it cannot stop early.
The orchestrator exists only when some request in the batch needs one of these.

Unlike SGLang's orchestrator of the same name (long-lived penalizer objects that
`cumulate_output_tokens` updates after every step, and `filter`/`merge` keep in step with
the batch), this one is rebuilt from the requests' `output_ids` for every forward: one
[bs, V] count per pass, which at minisgl's batch and vocabulary sizes costs less than
keeping state in step with every filter, merge and retraction would be to get right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Set

import torch

from minisgl.sampling.sampling_params import stop_token_set


@dataclass
class BatchedPenalizerOrchestrator:
    output_counts: torch.Tensor  # [bs, V] float32, how often each token was generated
    frequency_penalties: torch.Tensor  # [bs, 1]
    presence_penalties: torch.Tensor  # [bs, 1]
    repetition_penalties: torch.Tensor  # [bs, 1]
    min_new_tokens_mask: Optional[torch.Tensor]  # [bs, V] bool: stop ids blocked this step

    @classmethod
    def from_reqs(
        cls, reqs: Sequence[Any], vocab_size: int, device: str, eos_token_ids: Set[int]
    ) -> Optional["BatchedPenalizerOrchestrator"]:
        """None when no request uses a penalty or min_new_tokens (the common case costs nothing)."""
        params = [r.sampling_params for r in reqs]
        uses_penalty = any(
            p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1 for p in params
        )
        blocked = [_blocked_stop_ids(r, eos_token_ids, vocab_size) for r in reqs]
        if not uses_penalty and not any(blocked):
            return None
        bs = len(reqs)
        counts = torch.zeros((bs, vocab_size), dtype=torch.float32, device=device)
        if uses_penalty:
            rows = [i for i, r in enumerate(reqs) for _ in r.output_ids]
            tokens = [t for r in reqs for t in r.output_ids]
            if tokens:
                counts.index_put_(
                    (torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                    torch.ones(len(tokens), device=device),
                    accumulate=True,
                )
        mask = None
        if any(blocked):
            mask = torch.zeros((bs, vocab_size), dtype=torch.bool, device=device)
            for i, ids in enumerate(blocked):
                mask[i, ids] = True

        def column(values: List[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]  # [bs, 1]

        return cls(
            output_counts=counts,
            frequency_penalties=column([p.frequency_penalty for p in params]),
            presence_penalties=column([p.presence_penalty for p in params]),
            repetition_penalties=column([p.repetition_penalty for p in params]),
            min_new_tokens_mask=mask,
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise logits [bs, V] (float32) in place."""
        seen = self.output_counts > 0  # [bs, V]
        logits -= self.frequency_penalties * self.output_counts
        logits -= self.presence_penalties * seen
        p = self.repetition_penalties  # [bs, 1]
        penalised = torch.where(logits < 0, logits * p, logits / p)  # [bs, V]
        logits.copy_(torch.where(seen, penalised, logits))
        if self.min_new_tokens_mask is not None:
            logits.masked_fill_(self.min_new_tokens_mask, float("-inf"))


def _blocked_stop_ids(req: Any, eos_token_ids: Set[int], vocab_size: int) -> List[int]:
    """Stop ids to mask for this request now: only while it is below min_new_tokens, and never
    the whole vocabulary (stop_token_ids covering every token: an all -inf row samples an
    arbitrary token with a NaN logprob; unmasked, the request stops at its first token)."""
    if len(req.output_ids) >= req.sampling_params.min_new_tokens:
        return []
    blocked = sorted(t for t in stop_token_set(req.sampling_params, eos_token_ids) if 0 <= t < vocab_size)
    return [] if len(blocked) == vocab_size else blocked
