"""SamplingBatchInfo: the sampling knobs of a batch, as tensors (one row per request).

Where it sits: Scheduler (ScheduleBatch) -> SamplingBatchInfo.from_reqs(reqs, ...) ->
ModelRunner.sample(logits_output, sampling_info) -> apply_logits_bias, the custom logit
processors (sampling/custom_logit_processor.py), Sampler.
Built afresh for every forward from the batch's requests (SGLang's `from_schedule_batch`
is kept and filtered/merged with the batch instead; see penalties.py for why not here).
In: the batch's Reqs (reads `sampling_params`, `output_ids`, `origin_input_ids`,
`return_logprob`, `top_logprobs_num`, `logit_bias`, `grammar`, `custom_logit_processor` with its
`custom_logit_processor_instance` and `custom_params`, `is_chunked`);
out: tensors the sampler reads, and the rows of each custom logit processor.

`SamplingParams.normalize` already mapped greedy (temperature ~0) to temperature 1 with
top_k 1 and top_k -1 to "all"; here top_k is clipped to the vocabulary.
Per-request seeds: `positions[i] = len(origin_input_ids) + len(output_ids)`, the position
of the token being sampled, so a seeded request draws the same token at the same
position whatever batch it is in (see layers/sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

from minisgl.constrained.xgrammar_backend import allocate_vocab_mask, apply_vocab_mask
from minisgl.sampling.custom_logit_processor import LogitProcessorGroup
from minisgl.sampling.penalties import BatchedPenalizerOrchestrator


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64, in [1, V]
    min_ps: torch.Tensor  # [bs] float32
    is_all_greedy: bool  # every request has top_k == 1: argmax, no softmax
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool
    seeds: Optional[torch.Tensor]  # [bs] int64, or None when no request has a seed
    has_seed: Optional[torch.Tensor]  # [bs] bool
    positions: torch.Tensor  # [bs] int64, position of the token being sampled
    return_logprob: bool  # some request wants logprobs
    top_logprobs_nums: List[int]  # [bs]
    token_ids_logprobs: List[Optional[List[int]]]  # [bs]: the ids whose logprobs a request asks for, or None
    vocab_size: int
    penalizer_orchestrator: Optional[BatchedPenalizerOrchestrator] = None
    logit_bias: Optional[torch.Tensor] = None  # [bs, V] float32, None when no request has a logit_bias
    # [bs, ceil(V / 32)] int32 bitmask of the tokens each request's grammar allows next (all
    # bits set in rows without one), None when no request has a grammar; the rows with one
    vocab_mask: Optional[torch.Tensor] = None
    vocab_mask_rows: Optional[List[int]] = None
    # the rows of each custom logit processor, grouped by its string (SGLang's grouping); None
    # when no request has one (ModelRunner.sample runs them after apply_logits_bias)
    custom_logit_processor: Optional[List[LogitProcessorGroup]] = None

    @classmethod
    def from_reqs(
        cls, reqs: Sequence[Any], vocab_size: int, device: str, eos_token_ids: Optional[Set[int]] = None
    ) -> "SamplingBatchInfo":
        params = [r.sampling_params for r in reqs]
        top_ks = [min(max(p.top_k, 1), vocab_size) for p in params]
        seeds = [p.seed for p in params]
        any_seed = any(s is not None for s in seeds)
        grammar_rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
        vocab_mask = _vocab_mask(reqs, grammar_rows, vocab_size, device) if grammar_rows else None
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)[:, None],
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            is_all_greedy=all(k == 1 for k in top_ks),
            need_top_p_sampling=any(p.top_p < 1.0 for p in params),
            need_top_k_sampling=any(k < vocab_size for k in top_ks),
            need_min_p_sampling=any(p.min_p > 0 for p in params),
            # The Gumbel hash reads a seed's low 32 bits; masking here also keeps any Python int
            # (OpenAI's seed has no range, and n > 1 adds j to it) inside int64.
            seeds=torch.tensor([(s or 0) & 0xFFFFFFFF for s in seeds], dtype=torch.int64, device=device)
            if any_seed
            else None,
            has_seed=torch.tensor([s is not None for s in seeds], device=device) if any_seed else None,
            positions=torch.tensor(
                [len(r.origin_input_ids) + len(r.output_ids) for r in reqs], dtype=torch.int64, device=device
            ),
            return_logprob=any(bool(r.return_logprob) for r in reqs),
            top_logprobs_nums=[int(r.top_logprobs_num or 0) if r.return_logprob else 0 for r in reqs],
            token_ids_logprobs=[r.token_ids_logprob if r.return_logprob else None for r in reqs],
            vocab_size=vocab_size,
            penalizer_orchestrator=BatchedPenalizerOrchestrator.from_reqs(reqs, vocab_size, device, eos_token_ids or set()),
            logit_bias=_logit_bias_rows(params, vocab_size, device),
            vocab_mask=vocab_mask,
            vocab_mask_rows=grammar_rows or None,
            custom_logit_processor=_processor_groups(reqs),
        )

    @property
    def needs_logits_bias(self) -> bool:
        """Whether apply_logits_bias changes anything (otherwise the sampler reads the model's logits as they are)."""
        return self.penalizer_orchestrator is not None or self.logit_bias is not None or self.vocab_mask is not None

    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """Penalties and min_new_tokens, then the grammars' vocab mask, then logit_bias, in place
        on logits [bs, V] (SGLang's order, sglang-facts.md §11.1)."""
        if self.penalizer_orchestrator is not None:
            self.penalizer_orchestrator.apply(logits)
        if self.vocab_mask is not None and self.vocab_mask_rows:
            apply_vocab_mask(logits, self.vocab_mask, self.vocab_mask_rows)
        if self.logit_bias is not None:
            logits += self.logit_bias  # (-inf from min_new_tokens or a grammar stays -inf: biases are finite)


def _processor_groups(reqs: Sequence[Any]) -> Optional[List[LogitProcessorGroup]]:
    """The batch's rows by custom logit processor string, each with the instance the scheduler
    loaded for the first of them and every row's params; None when no request has one."""
    groups: Dict[str, LogitProcessorGroup] = {}
    for i, r in enumerate(reqs):
        key = getattr(r, "custom_logit_processor", None)  # (getattr: tests build batches of stand-in requests)
        # (a prompt's chunk before its last: its sampled token is thrown away, and a processor
        # that counts its calls must not see it)
        if key is None or getattr(r, "is_chunked", 0) > 0:
            continue
        group = groups.get(key)
        if group is None:
            group = groups[key] = LogitProcessorGroup(r.custom_logit_processor_instance, [], [])
        group.rows.append(i)
        group.params.append(r.custom_params)
    return list(groups.values()) or None


def _logit_bias_rows(params: Sequence[Any], vocab_size: int, device: str) -> Optional[torch.Tensor]:
    """[bs, V] of each request's logit_bias (zeros elsewhere), or None when no request has one."""
    if not any(p.logit_bias for p in params):
        return None
    bias = torch.zeros((len(params), vocab_size), dtype=torch.float32, device=device)
    for i, p in enumerate(params):
        if p.logit_bias:  # (ids checked against the vocabulary; parsed once per request)
            ids, values = p.logit_bias_tensors(device)
            bias[i, ids] = values
    return bias


def _vocab_mask(reqs: Sequence[Any], rows: List[int], vocab_size: int, device: str) -> torch.Tensor:
    """The batch's grammar bitmask [bs, ceil(V / 32)] (constrained/xgrammar_backend.py): each
    grammar row filled by its matcher, the others left all ones.

    Filled on the CPU (xgrammar's matchers write host memory), then moved: a few bytes per
    row. A request whose grammar has terminated has finished, so it is not in a batch.
    """
    mask = allocate_vocab_mask(vocab_size, len(reqs))  # [bs, ceil(V / 32)]
    for i in rows:
        if not reqs[i].grammar.is_terminated():  # (SGLang's guard: a terminated matcher raises)
            reqs[i].grammar.fill_vocab_mask(mask, i)
    return mask.to(device)
