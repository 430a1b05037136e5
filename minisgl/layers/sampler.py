"""Sampler: penalised logits -> next token ids (+ logprobs). sglang-facts.md §11.3.

Where it sits: ModelRunner.sample -> SamplingBatchInfo.apply_logits_bias (penalties,
min_new_tokens, the grammars' vocab mask, logit_bias) -> custom logit processors
(sampling/custom_logit_processor.py; the first step of SGLang's Sampler.forward) -> Sampler.forward. In: logits [bs, V] float32; out: SampleOutput.

Order, as SGLang's pytorch sampling backend:
1. all greedy (every top_k == 1): argmax, no softmax;
2. otherwise temperature -> softmax -> top-k -> top-p -> min-p -> sample:
   - top-k: ranks >= top_k are dropped;
   - top-p: a token is dropped when the mass *before* it already exceeds top_p (exclusive
     cumsum over the unfiltered sorted probabilities), so the token that crosses top_p stays;
   - min-p: tokens with p < p_max * min_p are dropped;
   - the kept probabilities are sampled without renormalising (sampling does not need it).
Greedy requests inside a sampled batch have top_k 1, so only their argmax survives.

Seeds: a request with `seed` samples by Gumbel-max, argmax(log p + G), where the Gumbel
noise G of (seed, position, token id) comes from a counter-based hash (murmur3's
finaliser), as SGLang's `multinomial_with_seed`. The draw then depends on nothing but the
request itself: the same seed gives the same text in any batch, at any batch position.
Requests without a seed draw from the ModelRunner's own torch.Generator, seeded once from
--random-seed (each Engine its own: the process's global RNG is the user's).

Logprobs (when some request asks): log_softmax of the logits after penalties, the grammar
mask, logit_bias, the custom logit processors and temperature (greedy rows have temperature 1), i.e. the distribution before top-k/top-p/
min-p truncation. top_logprobs are the request's `top_logprobs_num` best of those;
token_ids_logprobs those of the ids the request names (`token_ids_logprob`, SGLang's).
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional

import torch
from torch import nn

from minisgl.sampling.sampling_batch_info import SamplingBatchInfo

_MASK32 = 0xFFFFFFFF


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [bs] int64
    next_token_logprobs: Optional[torch.Tensor]  # [bs] float32, None when no request asked
    top_logprobs_val: Optional[List[List[float]]]  # per request, top_logprobs_num values
    top_logprobs_idx: Optional[List[List[int]]]  # per request, their token ids
    token_ids_logprobs: Optional[List[Optional[List[float]]]] = None  # per request, at its token_ids_logprob
    # {row: message} of the rows whose custom logit processor failed (ModelRunner.sample fills it)
    custom_logit_processor_errors: Optional[Dict[int, str]] = None


class Sampler(nn.Module):
    def forward(
        self, logits: torch.Tensor, sampling_info: SamplingBatchInfo, generator: Optional[torch.Generator] = None,
        sync_token_ids: Optional[Callable[[torch.Tensor], None]] = None,
    ) -> SampleOutput:  # fmt: skip
        """logits [bs, V] float32, already penalised; `generator` draws unseeded rows (torch's global RNG if None).

        `sync_token_ids` (--tp-size N, when ModelRunner.sample asks): makes the sampled ids [bs] the
        same on every rank, in place, before the logprobs read them (SGLang's _sync_token_ids_across_tp)."""
        if sampling_info.is_all_greedy:
            next_token_ids = torch.argmax(logits, dim=-1)  # [bs]
            logprobs = torch.log_softmax(logits, dim=-1) if sampling_info.return_logprob else None
        else:
            logits = logits / sampling_info.temperatures  # [bs, V]
            logprobs = torch.log_softmax(logits, dim=-1) if sampling_info.return_logprob else None
            probs = torch.softmax(logits, dim=-1)  # [bs, V]
            if sampling_info.need_top_k_sampling or sampling_info.need_top_p_sampling or sampling_info.need_min_p_sampling:
                probs = top_k_top_p_min_p_filter(probs, sampling_info)
            next_token_ids = sample_from_probs(probs, sampling_info, generator)
        if sync_token_ids is not None:
            sync_token_ids(next_token_ids)
        return _with_logprobs(next_token_ids, logprobs, sampling_info)


def top_k_top_p_min_p_filter(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities top-k, then top-p, then min-p drop; returns [bs, V] in vocab order."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)  # [bs, V] each
    probs_sum = torch.cumsum(probs_sort, dim=-1)  # [bs, V], inclusive
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]  # [1, V]
    probs_sort = probs_sort.masked_fill(ranks >= info.top_ks[:, None], 0.0)
    # exclusive cumsum (mass strictly before this token) > top_p: the crossing token survives
    probs_sort = probs_sort.masked_fill((probs_sum - probs_sort) > info.top_ps[:, None], 0.0)
    if info.need_min_p_sampling:
        min_p_thresholds = probs_sort[:, :1] * info.min_ps[:, None]  # [bs, 1], the top prob is never dropped
        probs_sort = probs_sort.masked_fill(probs_sort < min_p_thresholds, 0.0)
    return torch.zeros_like(probs).scatter_(-1, probs_idx, probs_sort)  # back to vocab order


def sample_from_probs(probs: torch.Tensor, info: SamplingBatchInfo, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of (unnormalised) probs [bs, V]: seeded rows by Gumbel-max, others multinomial."""
    next_token_ids = multinomial_inverse_cdf(probs, generator)  # [bs]
    if info.seeds is None or info.has_seed is None:
        return next_token_ids
    rows = torch.nonzero(info.has_seed).squeeze(-1)  # [S]
    gumbel = gumbel_noise(info.seeds[rows], info.positions[rows], probs.shape[-1])  # [S, V] float64
    seeded = torch.argmax(torch.log(probs[rows].double()) + gumbel, dim=-1)  # [S]
    return next_token_ids.index_put((rows,), seeded)


def multinomial_inverse_cdf(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One draw per row of unnormalised probs [bs, V] from `generator` (torch's global RNG if None):
    the first token whose CDF passes u.

    The distribution of torch.multinomial(probs, 1), which on CPU draws V exponentials per
    row (5 ms for 64 x 4,096 on this project's CPU, 6% of a decode step); this draws one
    uniform per row and binary-searches the row's running sum (~0.3 ms). Up to the running
    sum's float32 rounding: a token whose probability is below the sum's spacing (~6e-8 of
    the total) adds nothing to it and is never drawn (at a 152k vocabulary ~0.1% of the mass
    in total variation; at the built-in 4k vocabulary none in practice).
    """
    cdf = torch.cumsum(probs, dim=-1)  # [bs, V]
    u = torch.rand((probs.shape[0], 1), dtype=cdf.dtype, device=probs.device, generator=generator)
    u = u * cdf[:, -1:]  # [bs, 1] in [0, total)
    # right=True: the first index with cdf > u, so a zero-probability token (flat cdf) is never chosen
    ids = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # [bs]
    return ids.clamp_(max=probs.shape[-1] - 1)  # u rounding up to the total would point past the end


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values < 2**32 (products wrap, then masked)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [S, V] that is a pure function of (seed, position, token id)."""
    columns = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)[None, :]  # [1, V]
    h = _fmix32((seeds[:, None] & _MASK32) ^ _fmix32((positions[:, None] * 0x9E3779B1) & _MASK32))  # [S, 1]
    h = _fmix32(h ^ _fmix32((columns * 0x27D4EB2F + 0x165667B1) & _MASK32))  # [S, V]
    uniform = (h.double() + 0.5) / float(1 << 32)  # [S, V] in (0, 1)
    return -torch.log(-torch.log(uniform))


def _with_logprobs(next_token_ids: torch.Tensor, logprobs: Optional[torch.Tensor], info: SamplingBatchInfo) -> SampleOutput:
    if logprobs is None:
        return SampleOutput(next_token_ids, None, None, None)
    # As SGLang's sampler: clamped, not -inf. A token masked by min_new_tokens has logprob
    # -inf, which JSON cannot carry (/generate answered a 400 after the whole generation,
    # a stream sent the invalid literal -Infinity).
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    token_logprobs = logprobs.gather(-1, next_token_ids[:, None]).squeeze(-1)  # [bs]
    # a handful of ids per asking row (class labels): one small gather each
    token_ids = None
    if any(ids for ids in info.token_ids_logprobs):
        token_ids = [logprobs[i, ids].tolist() if ids else None for i, ids in enumerate(info.token_ids_logprobs)]
    k = min(max(info.top_logprobs_nums, default=0), logprobs.shape[-1])
    if k == 0:
        return SampleOutput(next_token_ids, token_logprobs, None, None, token_ids)
    values, indices = logprobs.topk(k, dim=-1)  # [bs, k] each
    values_list, indices_list = values.tolist(), indices.tolist()
    top_val = [row[:n] for row, n in zip(values_list, info.top_logprobs_nums)]
    top_idx = [row[:n] for row, n in zip(indices_list, info.top_logprobs_nums)]
    return SampleOutput(next_token_ids, token_logprobs, top_val, top_idx, token_ids)
