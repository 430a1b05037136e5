"""ForwardBatch: the tensors of one forward pass, passed down explicitly (no globals).

Where it sits: Scheduler -> ScheduleBatch.get_forward_batch() -> ForwardBatch ->
ModelRunner.forward -> model -> layers -> attention backend. Every layer that needs
positions, KV slots or sequence lengths reads them from the ForwardBatch argument,
never from a module-level context (STYLE.md habit 6).

Vocabulary (SGLang's):
- extend: the tokens of a request computed in this pass; `prefix` = tokens whose K/V
  are already in the pool (radix hit or an earlier chunk).
- `seq_lens[i] = extend_prefix_lens[i] + extend_seq_lens[i]` for extend; for decode it
  is the length *including* the token fed in this step.
- `out_cache_loc`: one KV slot per token of `input_ids`, where this pass writes K/V.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

import torch

if TYPE_CHECKING:
    from minisgl.lora.lora_batch import LoRABatchInfo
    from minisgl.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill / chunked prefill: several tokens per request
    DECODE = 2  # one token per request
    MIXED = 3  # extend batch with decoding requests riding as 1-token extends (--enable-mixed-chunk)
    IDLE = 4  # nothing to run
    # speculative decoding (--speculative-algorithm): each running request's last sampled token and
    # its draft tokens, an extend over its own KV; every row's logits are kept (SGLang's name)
    TARGET_VERIFY = 5

    def is_extend(self) -> bool:
        """MIXED runs through the extend path: a decode row is an extend of length 1."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_extend_or_verify(self) -> bool:
        """The passes with extend-shaped tensors (several tokens per request over a prefix): the
        attention backends run these through their extend path."""
        return self.is_extend() or self.is_target_verify()


class CaptureHiddenMode(enum.IntEnum):
    """Which final-norm hidden states a pass hands back (SGLang's enum, forward_batch_info.py).
    FULL, every token's, when a request of the batch asked for return_hidden_states; NULL
    otherwise, and then the pass keeps nothing. (SGLang's LAST = 1, the last token's only, is for
    speculative decoding's draft model, which minisgl does not have.)"""

    NULL = 0
    FULL = 2

    def need_capture(self) -> bool:
        return self != CaptureHiddenMode.NULL

    def is_full(self) -> bool:
        return self == CaptureHiddenMode.FULL


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each token
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot written for each token
    req_pool_indices: torch.Tensor  # [bs] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [bs] int64, total tokens with K/V after this pass
    seq_lens_cpu: List[int]  # same, on the host (no device sync to read it)
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool"
    # an AttentionBackend (layers/attention/base.py); typed Any so this module, which the
    # backends import, does not import them back
    attn_backend: Any
    # extend only ([bs] each; None for decode)
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    # logits for every position, not only the last (the transformers parity tests; no request sets it)
    return_all_logits: bool = False
    # prompt logprobs (extend only; None when no request of the pass asks for them): the rows of
    # input_ids whose logits score the next prompt token, and that token
    input_logprob_indices: Optional[torch.Tensor] = None  # [M] int64, rows of input_ids
    input_logprob_target_ids: Optional[torch.Tensor] = None  # [M] int64, the prompt token each row predicts
    input_logprob_top_k: int = 0  # the largest top_logprobs_num of those requests
    # [M, T] int64: each row's request's token_ids_logprob, padded with 0 to the longest (None: no one asks)
    input_logprob_token_ids: Optional[torch.Tensor] = None
    # --is-embedding: each request's Matryoshka `dimensions` (None: the whole embedding); None when
    # no request of the pass asked (the Pooler then cuts nothing)
    dimensions: Optional[List[Optional[int]]] = None
    # FULL when a request of the pass asked for return_hidden_states: the LogitsProcessor then hands
    # back the final-norm hidden state of every token of the pass (LogitsProcessorOutput.hidden_states)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # LoRA: each request's adapter, its lora_id (None: the base model; the list None when no request
    # of the pass names one), and, set by the ModelRunner's LoRAManager.prepare_lora_batch once per
    # pass, the tokens grouped by adapter that DecoderAttention / DecoderMLP add the deltas of
    lora_ids: Optional[List[Optional[str]]] = None
    lora_batch_info: Optional["LoRABatchInfo"] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        """Index into input_ids of each request's last token: the only rows that reach the LM head
        (in a TARGET_VERIFY pass every row does: LogitsProcessor)."""
        if self.forward_mode.is_decode():
            return torch.arange(self.batch_size, device=self.input_ids.device)
        assert self.extend_seq_lens is not None
        return torch.cumsum(self.extend_seq_lens, dim=0) - 1  # [bs]
