"""Req and ScheduleBatch (stage 3, the scheduler's data; sglang-facts.md §6).

Where it sits: `Scheduler.handle_generate_request` (`handle_embedding_request` with
--is-embedding) turns a TokenizedGenerateReqInput into a `Req`; the PrefillAdder picks
requests into a `ScheduleBatch`, which allocates request rows and KV slots
(`prepare_for_extend` / `prepare_for_decode`) and builds the `ForwardBatch` the ModelRunner
consumes. Results come back as token ids that the Scheduler appends to `Req.output_ids`, after
which `Req.check_finished` decides (an embedding request's result is its `Req.embedding`).

Length vocabulary (SGLang's, one word per concept):
    fill_ids          = origin_input_ids + output_ids, cut at the chunk end when chunked
    prefix_indices    = KV slots of the part of fill_ids already in the pool (radix hit,
                        or the earlier chunks of this request)
    extend_input_len  = len(fill_ids) - len(prefix_indices): tokens computed this pass
    kv_committed_len  = tokens of this request whose K/V are in the pool
Owns: nothing global; a ScheduleBatch borrows the pools, the allocator and the tree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from minisgl.mem_cache.allocator import ceil_paged_tokens, decode_starts_page, new_page_slots
from minisgl.mem_cache.namespace import namespace
from minisgl.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from minisgl.sampling import stop_regex
from minisgl.sampling.sampling_params import SamplingParams, stop_token_set
from minisgl.speculative.ngram_worker import NGRAMWorker

if TYPE_CHECKING:
    import numpy as np

    from minisgl.mem_cache.allocator import TokenToKVPoolAllocator
    from minisgl.mem_cache.memory_pool import ReqToTokenPool

# SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: the reservation for one request's future
# output is clipped so a huge max_new_tokens does not block admission forever.
CLIP_MAX_NEW_TOKENS = 4096
# SGLANG_RETRACT_DECODE_STEPS: decode steps of headroom freed per kept request on retract.
RETRACT_DECODE_STEPS = 20
# Prompt tokens sent to the detokenizer as left context on a request's first emission.
INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5


# --------------------------------------------------------------------------- finish reasons
class BaseFinishReason(ABC):
    @abstractmethod
    def to_json(self) -> Dict[str, Any]:
        """SGLang's JSON form, sent to the detokenizer and shown to clients."""


@dataclass
class FINISH_MATCHED_TOKEN(BaseFinishReason):
    matched: int

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FINISH_MATCHED_STR(BaseFinishReason):
    matched: str

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FINISHED_MATCHED_REGEX(BaseFinishReason):
    """A stop regex matched; `matched` is the pattern, as SGLang reports it (not the text it matched)."""

    matched: str

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FINISH_LENGTH(BaseFinishReason):
    length: int

    def to_json(self) -> Dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass
class FINISH_ABORT(BaseFinishReason):
    message: str = "Aborted"
    status_code: Optional[int] = None
    err_type: Optional[str] = None
    param: Optional[str] = None  # the request field it is about (/generate's name), where the scheduler knows it

    def to_json(self) -> Dict[str, Any]:
        reason = {"type": "abort", "message": self.message, "status_code": self.status_code, "err_type": self.err_type}
        if self.param is not None:  # (minisgl's: SGLang's abort has no param; the routes name the field by it)
            reason["param"] = self.param
        return reason


# --------------------------------------------------------------------------- time stats
@dataclass
class ReqTimeStats:
    """time.perf_counter() stamps of one request's trip through the scheduler (§9.1)."""

    scheduler_recv_time: float = 0.0
    wait_queue_entry_time: float = 0.0  # the first time: the TTFT split measures from it
    last_wait_queue_entry_time: float = 0.0  # every time, retractions too: how long it has waited now
    forward_entry_time: float = 0.0
    prefill_finished_time: float = 0.0
    completion_time: float = 0.0

    def to_ms_dict(self) -> Dict[str, Optional[float]]:
        """The TTFT split of seed 002 (docs/snapshot.md). Every key is always present; a part
        not reached is None (a request aborted while waiting has queue_ms and e2e_ms only)."""

        def ms(later: float, earlier: float) -> Optional[float]:
            return (later - earlier) * 1e3 if later and earlier else None

        return {
            "queue_ms": ms(self.wait_queue_entry_time, self.scheduler_recv_time),
            "schedule_ms": ms(self.forward_entry_time, self.wait_queue_entry_time),
            "forward_ms": ms(self.prefill_finished_time, self.forward_entry_time),
            "ttft_ms": ms(self.prefill_finished_time, self.scheduler_recv_time),
            "e2e_ms": ms(self.completion_time, self.scheduler_recv_time),
        }


def _empty_indices() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


# --------------------------------------------------------------------------- Req
# --enable-priority-scheduling: a request without a priority gets the least important one
# (SGLang's default), times the scheduler's order (+1: lower values first, -1: higher ones)
LEAST_PRIORITY = sys.maxsize


def named_priority(priority: Optional[int]) -> Optional[int]:
    """The priority a request named, or None (none given: the scheduler's default, or the flag off)."""
    return None if priority is None or abs(priority) == LEAST_PRIORITY else priority


def priority_text(priority: Optional[int]) -> str:
    """A priority for events and logs: "none" for a request that named none (not 9223372036854775807)."""
    named = named_priority(priority)
    return "none" if named is None else str(named)


class Req:
    """One request inside the scheduler, from arrival to finish (and back, on retraction)."""

    def __init__(
        self,
        rid: str,
        origin_input_text: Optional[str],
        origin_input_ids: List[int],
        sampling_params: SamplingParams,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        eos_token_ids: Optional[Set[int]] = None,
        token_ids_logprob: Optional[List[int]] = None,
        vocab_size: Optional[int] = None,
        tokenizer: Any = None,
        priority: Optional[int] = None,
        require_reasoning: bool = False,
        return_hidden_states: bool = False,
        lora_id: Optional[str] = None,
        cache_key: Optional[str] = None,
    ) -> None:
        self.rid = rid
        # the LoRA adapter this request runs with, the id of its load (SGLang's lora_id; the adapter's
        # name, or NAME#k for a name loaded again, lora/lora_registry.py), None: the base model; it
        # also namespaces the radix tree (extra_key), so adapters (and loads) never share KV
        self.lora_id = lora_id
        # the request's own namespace (TokenizedGenerateReqInput.extra_key: /generate's extra_key, the
        # OpenAI routes' cache_salt + extra_key), None: none; extra_key below folds it with lora_id
        self.cache_key = cache_key or None
        self.origin_input_text = origin_input_text
        self.origin_input_ids = list(origin_input_ids)
        # the detokenizer's left context comes from the prompt as the user sent it
        self.origin_input_ids_unpadded = list(origin_input_ids)
        self.output_ids: List[int] = []
        self.fill_ids: List[int] = []
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = list(token_ids_logprob) if token_ids_logprob else None  # SGLang's: ids scored at every position
        self.stream = stream
        self.eos_token_ids: Set[int] = set(eos_token_ids or ())
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        # --enable-priority-scheduling: how important the request is (the scheduler fills in the default)
        self.priority = priority
        # the model thinks before it answers: a grammar holds only after the thinking (ReasonerGrammar)
        self.require_reasoning = require_reasoning
        self._special_stops: Optional[List[str]] = None  # (_stops_spelling_special_tokens, once)
        # --tp-size N, a request with stop_regex (set by the scheduler): timed_out_here -> whether the
        # search timed out on any rank (tp_lockstep.any_rank): its budget is time, which ranks measure apart
        self.stop_regex_timed_out_anywhere: Optional[Callable[[bool], bool]] = None
        # structured output: where the output stands in its grammar (constrained/xgrammar_backend.py),
        # advanced by the output processor with every token; None without json_schema/regex/ebnf
        self.grammar: Any = None
        self.grammar_future: Any = None  # (its compile, while the request is in the grammar queue)
        # a custom logit processor (sampling/custom_logit_processor.py), set by the scheduler when it
        # loads one: SGLang's string (the batch groups rows by it), the instance, and what its rows
        # get as params, custom_params + {"__req__": self} (here, never on sampling_params: those
        # cross process boundaries as JSON)
        self.custom_logit_processor: Optional[str] = None
        self.custom_logit_processor_instance: Any = None
        self.custom_params: Optional[Dict[str, Any]] = None
        # an embedding model's request (--is-embedding): the Matryoshka cut it asked for, and its
        # embedding once the last chunk of its prompt ran (SGLang's Req.embedding)
        self.dimensions: Optional[int] = None
        self.embedding: Optional[List[float]] = None

        # memory and prefix state
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = _empty_indices()  # [prefix_len] int64 KV slots
        self.extend_input_len = 0
        self.last_node: Any = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.is_chunked = 0  # non-final chunks scheduled whose result is not yet processed
        self.num_chunks_done = 0  # extend passes of the current prefill round (for snapshots)
        # Of the current extend's prefix, the tokens this prefill round found in the radix tree;
        # the rest are this round's own earlier chunks (for snapshots: only these are a cache hit)
        self.prefix_hit_len = 0

        # finish state; to_finish is applied at the next check_finished, never mid-loop
        self.finished_reason: Optional[BaseFinishReason] = None
        self.to_finish: Optional[BaseFinishReason] = None
        self.finished_len: Optional[int] = None
        self.finished_output = False

        # retraction and cache accounting
        self.is_retracted = False
        self.retracted_stain = False
        self.retraction_count = 0
        self.cached_tokens = 0
        self.already_computed = 0

        # speculative decoding (--speculative-algorithm NGRAM; speculative/ngram_worker.py): the request's
        # n-gram index, built at its first draft; its decoding passes (decode or verify: SGLang's
        # spec_verify_ct, completion tokens / this = its accept length); the running share of its
        # drafted tokens that were accepted (too low: it drafts on probe passes only)
        self.ngram_index: Any = None
        self.spec_verify_ct = 0
        self.spec_hit_rate = NGRAMWorker.HIT_RATE_START

        # streaming state (§6.8)
        self.surr_offset: Optional[int] = None
        self.read_offset: Optional[int] = None
        self.surr_and_decode_ids: List[int] = []
        self.cur_decode_ids_len = 0
        self.send_token_offset = 0
        self.send_decode_id_offset = 0
        self.stream_checked_len = 0  # len(output_ids) when the output processor last asked whether to stream

        # prompt logprobs (SGLang's layout): for origin_input_ids[logprob_start_len:], the first
        # entry None (the token before it is not scored), then log p(token | the tokens before
        # it). Gathered chunk by chunk while the prompt is prefilled (None first once complete),
        # then sent with the request's first output.
        self.input_token_logprobs_val: List[Optional[float]] = []
        self.input_token_logprobs_idx: List[int] = []
        self.input_top_logprobs_val: List[Optional[List[float]]] = []
        self.input_top_logprobs_idx: List[Optional[List[int]]] = []
        self.input_token_ids_logprobs_val: List[Optional[List[float]]] = []
        self.input_token_ids_logprobs_idx: List[Optional[List[int]]] = []
        self.input_logprobs_done = False  # the prompt's last chunk was processed (any request)
        self.input_logprobs_sent = False

        # logprobs of output tokens, aligned with output_ids
        self.output_token_logprobs_val: List[float] = []
        self.output_token_logprobs_idx: List[int] = []
        self.output_top_logprobs_val: List[List[float]] = []
        self.output_top_logprobs_idx: List[List[int]] = []
        self.output_token_ids_logprobs_val: List[List[float]] = []
        self.output_token_ids_logprobs_idx: List[List[int]] = []

        # return_hidden_states (SGLang's Req.hidden_states): the final-norm hidden state of every
        # position the model computed for this request, float32 numpy rows. Entry 0 holds the prompt's
        # rows (a list of [k, H] blocks, one per pass: the positions its prefill computed, every
        # chunk's, from the end of its radix hit), then one [H] entry per decoded position (output_ids[k]'s, fed back at step k + 1). hidden_states_len: the
        # position after the last one recorded (a retracted request's re-prefill skips those before);
        # send_hidden_states_offset: the entries already sent to the detokenizer.
        self.return_hidden_states = return_hidden_states
        self.hidden_states: List[Any] = []
        self.hidden_states_len = 0
        self.send_hidden_states_offset = 0

        self.time_stats = ReqTimeStats(scheduler_recv_time=time.perf_counter())
        # built once: every match and insert passes this one string, and the tree's nodes share it
        # (built per call, each new leaf held its own copy of the key)
        self._extra_key = namespace(self.lora_id, self.cache_key)

    @property
    def extra_key(self) -> Optional[str]:
        """The radix tree's namespace of this request's tokens (SGLang's RadixKey.extra_key, into which
        it folds lora_id): K/V computed under one (adapter, key) pair is never reused under another."""
        return self._extra_key

    # ------------------------------------------------------------------ lengths
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_extend_input_len(self, extend_input_len: int) -> None:
        self.extend_input_len = extend_input_len

    def init_next_round_input(self, tree_cache: Any = None) -> None:
        """fill_ids = origin + output; with a tree, match the longest cached prefix (§6.2).

        At least one token is always left to compute, because its logits are needed.
        """
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            match = tree_cache.match_prefix(self.max_prefix_ids(), self.extra_key)
            self.prefix_indices = match.device_indices
            self.last_node = match.last_device_node
            self.cache_protected_len = len(self.prefix_indices)
        self.set_extend_input_len(len(self.fill_ids) - len(self.prefix_indices))

    def max_prefix_ids(self) -> List[int]:
        """What a prefix match may cover (SGLang's adjust_max_prefix_ids, used by the policy's
        matches too): all of origin + output but the last token, whose logits are needed, and,
        while prompt logprobs are still to compute, nothing past logprob_start_len (a cached
        token's logits are gone). A retracted request's re-prefill needs them no more."""
        fill_ids = self.origin_input_ids + self.output_ids
        max_prefix_len = len(fill_ids) - 1
        if self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done:
            max_prefix_len = min(max_prefix_len, self.logprob_start_len)
        return fill_ids[: max(max_prefix_len, 0)]

    # ------------------------------------------------------------------ prompt logprobs
    def input_logprob_positions(self, prefix_len: int, end: int) -> range:
        """The positions of this extend, [prefix_len, end), whose logits score a prompt token:
        from logprob_start_len to the prompt's second-to-last token (the last one's logits pick
        the first output token, and are not a prompt logprob)."""
        if not self.return_logprob or self.input_logprobs_done or self.logprob_start_len < 0:
            return range(0)
        return range(max(self.logprob_start_len, prefix_len), min(len(self.origin_input_ids) - 1, end))

    def add_input_logprobs(
        self,
        values: List[float],
        top_vals: Optional[List[List[float]]],
        top_idxs: Optional[List[List[int]]],
        token_ids_vals: Optional[List[List[float]]],
    ) -> None:
        """One extend's prompt logprobs, in position order (input_logprob_positions); rows of
        the batch's widest top-k and longest token_ids_logprob, cut to this request's."""
        self.input_token_logprobs_val.extend(values)
        if self.top_logprobs_num > 0 and top_vals is not None and top_idxs is not None:
            self.input_top_logprobs_val.extend(row[: self.top_logprobs_num] for row in top_vals)
            self.input_top_logprobs_idx.extend(row[: self.top_logprobs_num] for row in top_idxs)
        if self.token_ids_logprob and token_ids_vals is not None:
            n = len(self.token_ids_logprob)
            self.input_token_ids_logprobs_val.extend(row[:n] for row in token_ids_vals)
            self.input_token_ids_logprobs_idx.extend(list(self.token_ids_logprob) for _ in token_ids_vals)

    def finish_input_logprobs(self) -> None:
        """The prompt's last chunk is done: SGLang's layout, origin_input_ids[logprob_start_len:]
        with None first (nothing scored the token at logprob_start_len)."""
        if self.input_logprobs_done:
            return
        self.input_logprobs_done = True
        start = self.logprob_start_len
        if not self.return_logprob or not 0 <= start < len(self.origin_input_ids):
            return
        self.input_token_logprobs_val.insert(0, None)
        self.input_token_logprobs_idx = self.origin_input_ids[start:]
        if self.top_logprobs_num > 0:
            self.input_top_logprobs_val.insert(0, None)
            self.input_top_logprobs_idx.insert(0, None)
        if self.token_ids_logprob:
            self.input_token_ids_logprobs_val.insert(0, None)
            self.input_token_ids_logprobs_idx.insert(0, None)

    # ------------------------------------------------------------------ hidden states
    def add_hidden_states(self, first_position: int, rows: np.ndarray) -> None:
        """One pass's rows of this request ([count, H] float32, positions first_position,
        first_position + 1, ...) into SGLang's layout: prompt positions extend entry 0 (a list of
        per-pass [k, H] blocks, joined when sent), each output position is an entry of its own ([H]).

        SGLang appends what each pass computed: its prompt entry is the rows of the uncached tokens
        (a radix hit's prefix was never computed, so it has no rows), and a chunked prompt keeps its
        last chunk's rows only; here every chunk's rows join entry 0, so chunking never changes the
        answer. Positions already recorded are skipped: a retracted request's re-prefill recomputes
        its prompt and output (SGLang would append them all again)."""
        skip = max(self.hidden_states_len - first_position, 0) if self.hidden_states else 0
        first = first_position + skip
        rows = rows[skip:]
        n_prompt = min(max(len(self.origin_input_ids) - first, 0), len(rows))  # rows at prompt positions
        if n_prompt:
            if not self.hidden_states:
                self.hidden_states.append([])
            self.hidden_states[0].append(rows[:n_prompt])
        self.hidden_states.extend(rows[n_prompt:])
        if len(rows):
            self.hidden_states_len = first + len(rows)

    # ------------------------------------------------------------------ finishing
    def set_finish_with_abort(self, error_msg: str, param: Optional[str] = None) -> None:
        """Reject before running: a one-token prefill carries the abort out the normal path.
        `param`: the field the error is about (a grammar's key), when known."""
        self.origin_input_ids = [0]
        self.return_logprob = False
        self.return_hidden_states = False  # (token 0's row is nobody's hidden state)
        self.logprob_start_len = -1
        self.to_finish = FINISH_ABORT(error_msg, 400, "BadRequestError", param)

    def check_finished(self) -> None:
        """Decide whether the token just appended ends the request (0.5.23 order, §6.3).

        Stop strings, stop regexes and stop tokens come before length, as in SGLang 0.5.23: a
        stop the last allowed token completes is a stop (trimmed), not a length finish that
        would hand the stop string to the user.
        """
        if self.finished():
            return
        if self.to_finish is not None:
            self.finished_reason, self.to_finish = self.to_finish, None
            # The token sampled in this step was produced after the abort was asked for:
            # it is not part of the answer.
            self.finished_len = max(len(self.output_ids) - 1, 0)
            if self.return_hidden_states:  # that token's row goes too: k tokens returned, k entries
                extra = len(self.hidden_states) - max(self.finished_len, 1)
                if extra > 0:
                    del self.hidden_states[-extra:]
                    self.hidden_states_len -= extra
            return
        last_token = self.output_ids[-1]
        if self.vocab_size is not None and not 0 <= last_token < self.vocab_size:
            self.finished_reason = FINISH_MATCHED_STR(matched="NaN happened")
            return
        params = self.sampling_params
        if params.stop_strs or params.stop_regex_strs:
            tail = self.tail_str()
            # (start, -length, stop, is a regex) of every stop in the tail
            found: List[Tuple[int, int, str, bool]] = [(tail.find(s), -len(s), s, False) for s in params.stop_strs if s in tail]
            timed_out = False
            try:
                found += [(start, start - end, pattern, True) for start, end, pattern in stop_regex.first_match(params.stop_regex_strs, tail)]
            except stop_regex.StopRegexTimeout:
                timed_out = True
            if params.stop_regex_strs and self.stop_regex_timed_out_anywhere is not None:
                timed_out = self.stop_regex_timed_out_anywhere(timed_out)  # (every rank ends it alike)
            if timed_out:  # its own request pays, once; nobody else waits again
                self.finished_reason = FINISH_ABORT(stop_regex.timeout_message(), 400, "BadRequestError")
                self.finished_len = len(self.output_ids)
                return
            special_stops = self._stops_spelling_special_tokens()
            if not found and special_stops:
                # "<|im_end|>" as a stop, which the text the user sees skips: SGLang matches its
                # stops against a decode that keeps special tokens, so it stops here too
                raw = self.tail_str(skip_special_tokens=False)
                found = [(raw.find(s), -len(s), s, False) for s in special_stops if s in raw]
            if found:
                # the stop that starts first in the text (then the longest), whatever its place in
                # the list: the detokenizer cuts the text there
                _, _, matched, is_regex = min(found)
                self.finished_reason = FINISHED_MATCHED_REGEX(matched=matched) if is_regex else FINISH_MATCHED_STR(matched=matched)
                self.finished_len = len(self.output_ids)
                return
        if last_token in self._stop_token_ids() or (self.grammar is not None and self.grammar.is_terminated()):
            # (a grammar ends after it accepts a stop token: that token, as SGLang reports it,
            # even under ignore_eos, which only lets the grammar's output run on inside it)
            self.finished_reason = FINISH_MATCHED_TOKEN(matched=last_token)
            self.finished_len = len(self.output_ids)
            return
        max_new_tokens = self.sampling_params.max_new_tokens
        if len(self.output_ids) >= max_new_tokens:
            self.finished_reason = FINISH_LENGTH(length=max_new_tokens)
            self.finished_len = max_new_tokens

    def _stops_spelling_special_tokens(self) -> List[str]:
        """The stop strings that contain an added token's text ("<|im_end|>"), when special tokens
        are skipped from the text: only a decode that keeps them can match those (once per request)."""
        if self._special_stops is None:
            added = list(self.tokenizer.get_added_vocab()) if self.sampling_params.skip_special_tokens and self.tokenizer else []
            self._special_stops = [s for s in self.sampling_params.stop_strs if any(tok in s for tok in added)]
        return self._special_stops

    def _stop_token_ids(self) -> Set[int]:
        return stop_token_set(self.sampling_params, self.eos_token_ids)  # eos_token_ids: the scheduler's, tokenizer's included

    def tail_str(self, skip_special_tokens: Optional[bool] = None) -> str:
        """Decoded tail of the output tokens only: a stop string never matches the prompt.

        Decoded as the detokenizer decodes, so a stop matches the text the user sees: with
        special tokens skipped ("b<|endoftext|>c" reads "bc"), and after a few ids of left
        context. Decoded alone, a SentencePiece tail loses its leading space (" 42" reads
        "42"), and one that starts inside a character spelled in byte tokens (Llama-2,
        Mistral) decodes as U+FFFD throughout that run of bytes, a stop inside it unseen.
        """
        out = self.output_ids
        tail_len = min(self.sampling_params.stop_tail_len + 2, len(out))
        if tail_len == 0:
            return ""
        if self.tokenizer is None:
            raise ValueError("stop strings need the scheduler to hold a tokenizer")
        skip = self.sampling_params.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        spaces = self.sampling_params.spaces_between_special_tokens  # (read by slow tokenizers only)

        def decode(ids: List[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)

        # the tail starts on a character boundary: back over at most 3 ids (an unfinished
        # UTF-8 character has at most 3 more bytes), output ids only
        start = len(out) - tail_len
        for _ in range(3):
            if start == 0 or not decode(out[start:]).startswith("\ufffd"):
                break
            start -= 1
        # left context: the ids before the tail (the prompt's, early on), from a boundary too
        ctx = out[max(start - INIT_INCREMENTAL_DETOKENIZATION_OFFSET, 0) : start]
        if len(ctx) < INIT_INCREMENTAL_DETOKENIZATION_OFFSET:
            prompt = self.origin_input_ids_unpadded
            ctx = prompt[max(len(prompt) - INIT_INCREMENTAL_DETOKENIZATION_OFFSET + len(ctx), 0) :] + ctx
        ctx_text = decode(ctx)
        while ctx and ctx_text.startswith("\ufffd"):
            ctx = ctx[1:]
            ctx_text = decode(ctx)
        return decode(ctx + out[start:])[len(ctx_text) :]

    def check_match_stop_str_prefix(self) -> bool:
        """True while the tail contains a stop string or ends with a prefix of one (hold back)."""
        if not self.sampling_params.stop_strs or not self.output_ids:
            return False
        tail = self.tail_str()
        for stop_str in self.sampling_params.stop_strs:
            if stop_str in tail:
                return True
            # only a prefix no longer than the tail can end it (SGLang's bound): a long stop string
            # that never matches cost len(stop)^2 per step, enough to stall every request
            if any(tail.endswith(stop_str[:i]) for i in range(1, min(len(stop_str), len(tail) + 1))):
                return True
        return False

    @property
    def output_ids_through_stop(self) -> List[int]:
        if self.finished_len is not None:
            return self.output_ids[: self.finished_len]
        return self.output_ids

    def init_incremental_detokenize(self) -> tuple[List[int], int]:
        """The detokenizer's id window: up to 5 prompt tokens of left context, then the output."""
        output_ids = self.output_ids_through_stop
        if self.read_offset is None or self.surr_offset is None:
            self.read_offset = len(self.origin_input_ids_unpadded)
            self.surr_offset = max(self.read_offset - INIT_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
            self.surr_and_decode_ids = self.origin_input_ids_unpadded[self.surr_offset :] + list(output_ids)
        else:
            self.surr_and_decode_ids.extend(output_ids[self.cur_decode_ids_len :])
        self.cur_decode_ids_len = len(output_ids)
        return self.surr_and_decode_ids, self.read_offset - self.surr_offset

    # ------------------------------------------------------------------ retraction
    def reset_for_retract(self) -> None:
        """Back to the waiting queue; output_ids are kept and re-prefilled with the prompt."""
        self.prefix_indices = _empty_indices()
        self.last_node = None
        self.extend_input_len = 0
        self.is_chunked = 0
        self.num_chunks_done = 0
        self.cache_protected_len = 0
        self.req_pool_idx = None
        self.is_retracted = True
        self.retracted_stain = True
        self.retraction_count += 1
        self.kv_committed_len = 0

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input_len={len(self.origin_input_ids)}, output_len={len(self.output_ids)})"


# --------------------------------------------------------------------------- memory helpers
def release_kv_cache(req: Req, tree_cache: Any, req_to_token_pool: "ReqToTokenPool", is_insert: bool = True) -> None:
    """A request leaves the pool: its KV goes into the tree (or is freed), its row is freed."""
    tree_cache.cache_finished_req(req, is_insert=is_insert)
    if req.req_pool_idx is not None:
        req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None


# --------------------------------------------------------------------------- ScheduleBatch
class ScheduleBatch:
    """The requests of one forward pass, plus the running (decode) batch between passes.

    Per-pass arrays (input_ids, seq_lens, out_cache_loc, ...) are rebuilt by
    prepare_for_extend / prepare_for_decode / mix_with_running; between passes only
    `reqs` matters, so filter_batch and merge_batch only edit the request list.
    """

    def __init__(
        self,
        reqs: List[Req],
        req_to_token_pool: "ReqToTokenPool",
        token_to_kv_pool_allocator: "TokenToKVPoolAllocator",
        tree_cache: Any,
        chunked_req: Optional[Req] = None,
    ) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.chunked_req = chunked_req
        self.page_size = token_to_kv_pool_allocator.page_size
        self.forward_mode = ForwardMode.IDLE
        self.batch_is_full = False
        # decode requests riding in a MIXED batch (they skip cache_unfinished_req)
        self.decoding_reqs: Optional[List[Req]] = None
        self.prefill_stats: Optional[Dict[str, Any]] = None
        self._reset_pass_arrays()

    @classmethod
    def init_new(
        cls,
        reqs: List[Req],
        req_to_token_pool: "ReqToTokenPool",
        token_to_kv_pool_allocator: "TokenToKVPoolAllocator",
        tree_cache: Any,
        chunked_req: Optional[Req] = None,
    ) -> "ScheduleBatch":
        return cls(reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, chunked_req)

    def _reset_pass_arrays(self) -> None:
        self.input_ids: List[int] = []
        self.positions: List[int] = []
        self.seq_lens: List[int] = []
        self.prefix_lens: List[int] = []
        self.extend_lens: List[int] = []
        self.out_cache_loc: torch.Tensor = _empty_indices()
        # prompt logprobs of this extend: rows of input_ids, the prompt token each row scores,
        # and how many rows each request has (in request order)
        self.input_logprob_rows: List[int] = []
        self.input_logprob_targets: List[int] = []
        self.input_logprob_counts: List[int] = []
        self.input_logprob_token_ids: List[List[int]] = []  # per row: its request's token_ids_logprob, or []
        self.draft_token_ids: List[List[int]] = []  # TARGET_VERIFY: each request's drafts (after its last token)
        # TARGET_VERIFY: the drafts each request took, filled by process_batch_result_decode (the snapshot's accepted_len)
        self.accepted_draft_lens: List[int] = []

    def is_empty(self) -> bool:
        return len(self.reqs) == 0

    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def return_logprob(self) -> bool:
        return any(r.return_logprob for r in self.reqs)

    @property
    def return_hidden_states(self) -> bool:
        """A request of the batch asked: the pass keeps every token's hidden state (CaptureHiddenMode.FULL)."""
        return any(r.return_hidden_states for r in self.reqs)

    def is_prefill_only(self) -> bool:
        return all(r.sampling_params.max_new_tokens == 0 for r in self.reqs)

    # ------------------------------------------------------------------ allocation
    def _alloc_token_slots(self, alloc_fn: Any, num_tokens: int, *args: Any) -> torch.Tensor:
        self.tree_cache.evict_if_needed(num_tokens)
        out = alloc_fn(*args)
        if out is None:
            raise RuntimeError(
                f"KV cache out of memory: need {num_tokens} tokens, "
                f"available {self.token_to_kv_pool_allocator.available_size()}, "
                f"evictable {self.tree_cache.evictable_size()}"
            )
        return out

    def _pages_needed_for_extend(self) -> int:
        """Slots the allocator must hand out: extend tokens, rounded to whole new pages."""
        return sum(new_page_slots(p, s, self.page_size) for p, s in zip(self.prefix_lens, self.seq_lens))

    def _alloc_req_rows(self) -> None:
        """A new request takes a row; the chunked request keeps the row it already holds."""
        new_reqs = [r for r in self.reqs if r.req_pool_idx is None]
        rows = self.req_to_token_pool.alloc(len(new_reqs))
        if rows is None:
            raise RuntimeError("req_to_token_pool is out of request rows: the request-slot check was skipped")
        for req, row in zip(new_reqs, rows):
            req.req_pool_idx = row

    def prepare_for_extend(self) -> None:
        """Rows + KV slots for every extend token; req_to_token gets prefix and new slots (§6.4)."""
        self.forward_mode = ForwardMode.EXTEND
        self._reset_pass_arrays()
        for req in self.reqs:
            prefix_len = len(req.prefix_indices)
            assert len(req.fill_ids) - prefix_len == req.extend_input_len
            positions = req.input_logprob_positions(prefix_len, len(req.fill_ids))
            row0 = len(self.input_ids) - prefix_len  # the row of position p is row0 + p
            self.input_logprob_rows.extend(row0 + p for p in positions)
            self.input_logprob_targets.extend(req.origin_input_ids[p + 1] for p in positions)
            self.input_logprob_counts.append(len(positions))
            self.input_logprob_token_ids.extend([req.token_ids_logprob or []] * len(positions))
            self.input_ids.extend(req.fill_ids[prefix_len:])
            self.positions.extend(range(prefix_len, len(req.fill_ids)))
            self.prefix_lens.append(prefix_len)
            self.seq_lens.append(len(req.fill_ids))
            self.extend_lens.append(req.extend_input_len)
            # kv_committed_len is still the end of this round's previous chunk: a later chunk's
            # prefix is that chunk's own KV, plus whatever more another request put in the tree
            already = req.kv_committed_len if req.num_chunks_done else 0
            req.prefix_hit_len = (req.prefix_hit_len if req.num_chunks_done else 0) + max(prefix_len - already, 0)
        self._alloc_req_rows()
        pool = self.req_to_token_pool
        last_loc = []
        for req, prefix_len in zip(self.reqs, self.prefix_lens):
            pool.write(req.req_pool_idx, 0, req.prefix_indices)
            last_loc.append(int(req.prefix_indices[-1]) if prefix_len > 0 else -1)
        allocator = self.token_to_kv_pool_allocator
        extend_num_tokens = sum(self.extend_lens)
        self.out_cache_loc = self._alloc_token_slots(
            allocator.alloc_extend, self._pages_needed_for_extend(), self.prefix_lens, self.seq_lens, last_loc, extend_num_tokens
        )  # [extend_num_tokens] int64
        offset = 0
        for req, prefix_len, seq_len in zip(self.reqs, self.prefix_lens, self.seq_lens):
            pool.write(req.req_pool_idx, prefix_len, self.out_cache_loc[offset : offset + seq_len - prefix_len])
            offset += seq_len - prefix_len
            req.kv_committed_len = seq_len
            # Earlier chunks of this request are not cache hits; a retracted request's
            # re-prefill is not counted either (it was computed once already).
            if not req.retracted_stain:
                req.cached_tokens += prefix_len - req.already_computed
                req.already_computed = seq_len
            req.is_retracted = False
            req.num_chunks_done += 1

    def mix_with_running(self, running_batch: "ScheduleBatch") -> None:
        """--enable-mixed-chunk: decoding requests join this extend pass as 1-token extends."""
        assert running_batch.forward_mode.is_decode()
        self.forward_mode = ForwardMode.MIXED
        self.input_ids.extend(running_batch.input_ids)
        self.positions.extend(running_batch.positions)
        self.prefix_lens.extend(s - 1 for s in running_batch.seq_lens)
        self.seq_lens.extend(running_batch.seq_lens)
        self.extend_lens.extend([1] * running_batch.batch_size())
        self.input_logprob_counts.extend([0] * running_batch.batch_size())  # prompts long done
        self.out_cache_loc = torch.cat([self.out_cache_loc, running_batch.out_cache_loc])  # [num_tokens]
        self.decoding_reqs = list(running_batch.reqs)
        self.reqs = self.reqs + running_batch.reqs

    def new_tokens_required_next_decode(self, reqs: Optional[List[Req]] = None) -> int:
        """One slot per request; with pages, a whole page for each request that starts one."""
        reqs = self.reqs if reqs is None else reqs
        if self.page_size == 1:
            return len(reqs)
        return sum(self.page_size for r in reqs if decode_starts_page(r.kv_committed_len, self.page_size))

    def check_decode_mem(self, selected_indices: Optional[List[int]] = None) -> bool:
        """Evict from the tree if needed, then: is there room for one more token each?"""
        reqs = self.reqs if selected_indices is None else [self.reqs[i] for i in selected_indices]
        num_tokens = self.new_tokens_required_next_decode(reqs)
        self.tree_cache.evict_if_needed(num_tokens)
        return self.token_to_kv_pool_allocator.available_size() >= num_tokens

    def prepare_for_decode(self) -> None:
        """Feed each request its last sampled token; one new KV slot per request (§6.5)."""
        self.forward_mode = ForwardMode.DECODE
        self._reset_pass_arrays()
        pool = self.req_to_token_pool
        # invariant (no overlap): the last sampled token has no K/V yet
        old_lens = [r.kv_committed_len for r in self.reqs]
        assert all(n == r.seqlen - 1 for n, r in zip(old_lens, self.reqs))
        self.input_ids = [r.output_ids[-1] for r in self.reqs]
        self.positions = list(old_lens)
        self.seq_lens = [n + 1 for n in old_lens]
        self.prefix_lens = list(old_lens)
        self.extend_lens = [1] * len(self.reqs)
        # whole-batch reads and writes of req_to_token: per request, each was a GPU->CPU sync or a
        # one-element copy, every step
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64, device=pool.device)
        cols = torch.tensor(old_lens, dtype=torch.int64, device=pool.device)
        # the slot of each request's last token: only pages need it (the next slot of the same page)
        last_loc = pool.req_to_token[rows, cols - 1].tolist() if self.page_size > 1 else [-1] * len(self.reqs)
        allocator = self.token_to_kv_pool_allocator
        self.out_cache_loc = self._alloc_token_slots(
            allocator.alloc_decode, self.new_tokens_required_next_decode(), self.seq_lens, last_loc
        )  # [bs] int64
        pool.req_to_token[rows, cols] = self.out_cache_loc
        for req in self.reqs:
            req.kv_committed_len += 1

    def room_for_drafts(self, drafts: List[List[int]]) -> bool:
        """Evict from the tree if needed, then: is there room for each request's last token and
        its drafts? (The caller made room for the last tokens; drafts are only a bonus.)"""
        lens = [r.kv_committed_len for r in self.reqs]
        need = sum(new_page_slots(n, n + 1 + len(d), self.page_size) for n, d in zip(lens, drafts))
        if self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size() < need:
            return False  # (evicting first would empty the cache for drafts that then do not run)
        self.tree_cache.evict_if_needed(need)
        return self.token_to_kv_pool_allocator.available_size() >= need

    def prepare_for_verify(self, drafts: List[List[int]]) -> None:
        """Speculative decoding's pass (TARGET_VERIFY): each request extends its own KV by its last
        sampled token and its drafts, and every row is sampled. K/V slots are taken for all of them;
        process_batch_result_decode gives back those of the drafts that were not accepted
        (release_unaccepted)."""
        self.forward_mode = ForwardMode.TARGET_VERIFY
        self._reset_pass_arrays()
        self.draft_token_ids = [list(d) for d in drafts]
        pool = self.req_to_token_pool
        for req, draft in zip(self.reqs, self.draft_token_ids):
            n = req.kv_committed_len  # (as in a decode step, the last sampled token has no K/V yet)
            assert n == req.seqlen - 1
            self.input_ids += [req.output_ids[-1], *draft]
            self.positions.extend(range(n, n + 1 + len(draft)))
            self.prefix_lens.append(n)
            self.seq_lens.append(n + 1 + len(draft))
            self.extend_lens.append(1 + len(draft))
        self.input_logprob_counts = [0] * len(self.reqs)  # (no prompt rows)
        # whole-batch reads and writes of req_to_token, as prepare_for_decode's (row r, position p) per token
        rows = torch.tensor([r.req_pool_idx for r, k in zip(self.reqs, self.extend_lens) for _ in range(k)], dtype=torch.int64, device=pool.device)
        cols = torch.tensor(self.positions, dtype=torch.int64, device=pool.device)
        if self.page_size > 1:  # the slot of each request's position n - 1 (its first row's column - 1)
            firsts = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64, device=pool.device)
            last_loc = pool.req_to_token[firsts, torch.tensor(self.prefix_lens, device=pool.device) - 1].tolist()
        else:
            last_loc = [-1] * len(self.reqs)
        allocator = self.token_to_kv_pool_allocator
        self.out_cache_loc = self._alloc_token_slots(
            allocator.alloc_extend, self._pages_needed_for_extend(), self.prefix_lens, self.seq_lens, last_loc, len(self.input_ids)
        )  # [num_tokens] int64
        pool.req_to_token[rows, cols] = self.out_cache_loc
        for req, seq_len in zip(self.reqs, self.seq_lens):
            req.kv_committed_len = seq_len

    def release_unaccepted(self, req: Req, committed_len: int) -> None:
        """After a verify pass: the request keeps K/V for positions [0, committed_len); the slots
        its rejected drafts (and, when it finished early, its accepted ones) took go back. With
        pages, only whole pages past committed_len: the partial page stays the request's, and its
        next decode step writes the slot after committed_len - 1 in it, as always."""
        end = req.kv_committed_len
        start = ceil_paged_tokens(committed_len, self.page_size)
        if start < end:
            self.token_to_kv_pool_allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end].clone())
        req.kv_committed_len = committed_len

    def row_reqs(self) -> List[Req]:
        """The request of each sampled row: one per request, or, in a verify pass, one per token."""
        if not self.forward_mode.is_target_verify():
            return self.reqs
        return [r for r, count in zip(self.reqs, self.extend_lens) for _ in range(count)]

    # ------------------------------------------------------------------ membership
    def filter_batch(self, chunked_req_to_exclude: Optional[Set[Req]] = None, keep_indices: Optional[List[int]] = None) -> None:
        """Drop finished (and excluded) requests. Frees nothing: finishing already did."""
        if keep_indices is None:
            exclude = chunked_req_to_exclude or set()
            keep_indices = [i for i, r in enumerate(self.reqs) if not r.finished() and r not in exclude]
        self.reqs = [self.reqs[i] for i in keep_indices]
        self._reset_pass_arrays()

    def merge_batch(self, other: "ScheduleBatch") -> None:
        self.reqs.extend(other.reqs)
        self._reset_pass_arrays()

    def release_req(self, idx: int, remaining_count: int) -> None:
        """Retract one request: free its KV without inserting it, then make decode headroom."""
        req = self.reqs[idx]
        release_kv_cache(req, self.tree_cache, self.req_to_token_pool, is_insert=False)
        self.tree_cache.evict_if_needed(remaining_count * RETRACT_DECODE_STEPS)
        req.reset_for_retract()

    def retract_decode(self, priority_order: Optional[int] = None) -> tuple[List[Req], float]:
        """Free memory by sending requests back to the queue (§1.7).

        Order: fewest output tokens first, ties the longest prompt first; with `priority_order`
        (--retraction-policy priority: +1 when lower values are more important, -1 when higher
        ones are) the least important first, then that order. At least one request is
        retracted and at least one kept. Returns (retracted, new_token_ratio).
        """

        def keep_first(i: int) -> tuple:  # (the most worth keeping sorts first; retraction pops from the end)
            req = self.reqs[i]
            length = (len(req.output_ids), -len(req.origin_input_ids))
            return length if priority_order is None else (-priority_order * req.priority, *length)

        sorted_indices = sorted(range(len(self.reqs)), key=keep_first, reverse=True)
        retracted: List[Req] = []
        first_iter = True
        while first_iter or not self.check_decode_mem(selected_indices=sorted_indices):
            if len(sorted_indices) == 1:
                if not self.check_decode_mem(selected_indices=sorted_indices):
                    raise RuntimeError("Out of memory even after retracting all other requests in the decode batch.")
                break
            first_iter = False
            idx = sorted_indices.pop()
            retracted.append(self.reqs[idx])
            self.release_req(idx, remaining_count=len(sorted_indices))
        self.filter_batch(keep_indices=sorted(sorted_indices))
        total_decoded = sum(len(r.output_ids) for r in self.reqs)
        total_max_new = sum(r.sampling_params.max_new_tokens for r in self.reqs)
        new_ratio = min(1.0, (total_decoded + RETRACT_DECODE_STEPS * len(self.reqs)) / (total_max_new + 1))
        return retracted, new_ratio

    # ------------------------------------------------------------------ to the model
    def get_forward_batch(self, model_runner: Any) -> ForwardBatch:
        """The tensors of this pass, on the model's device (extend and MIXED share a layout)."""
        device = model_runner.device

        def as_tensor(values: List[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        is_extend = self.forward_mode.is_extend_or_verify()  # (the extend-shaped fields)
        scored = [r for r, n in zip(self.reqs, self.input_logprob_counts) if n > 0]
        named = max((len(ids) for ids in self.input_logprob_token_ids), default=0)
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=len(self.reqs),
            input_ids=as_tensor(self.input_ids),  # [num_tokens]
            positions=as_tensor(self.positions),  # [num_tokens]
            out_cache_loc=self.out_cache_loc.to(device),  # [num_tokens]
            req_pool_indices=as_tensor([r.req_pool_idx for r in self.reqs]),  # [bs]
            seq_lens=as_tensor(self.seq_lens),  # [bs]
            seq_lens_cpu=list(self.seq_lens),
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
            extend_prefix_lens=as_tensor(self.prefix_lens) if is_extend else None,  # [bs]
            extend_seq_lens=as_tensor(self.extend_lens) if is_extend else None,  # [bs]
            extend_prefix_lens_cpu=list(self.prefix_lens) if is_extend else None,
            extend_seq_lens_cpu=list(self.extend_lens) if is_extend else None,
            input_logprob_indices=as_tensor(self.input_logprob_rows) if scored else None,  # [M]
            input_logprob_target_ids=as_tensor(self.input_logprob_targets) if scored else None,  # [M]
            input_logprob_top_k=max((r.top_logprobs_num for r in scored), default=0),
            # [M, T], padded with id 0 (read, then cut off per request)
            input_logprob_token_ids=as_tensor([ids + [0] * (named - len(ids)) for ids in self.input_logprob_token_ids])
            if named
            else None,
            dimensions=[r.dimensions for r in self.reqs] if any(r.dimensions is not None for r in self.reqs) else None,
            capture_hidden_mode=CaptureHiddenMode.FULL if self.return_hidden_states else CaptureHiddenMode.NULL,
            lora_ids=[r.lora_id for r in self.reqs] if any(r.lora_id is not None for r in self.reqs) else None,
        )

    def get_sampling_info(self, vocab_size: int, device: str, eos_token_ids: Set[int]) -> Any:
        """SamplingBatchInfo of this pass (penalties read output_ids, so it is rebuilt per pass).
        A verify pass has a row per token: row j of a request samples position seqlen + j, so a
        seeded request draws there what its decode step at that position would."""
        from minisgl.sampling.sampling_batch_info import SamplingBatchInfo

        info = SamplingBatchInfo.from_reqs(self.row_reqs(), vocab_size, device, eos_token_ids)
        if self.forward_mode.is_target_verify():
            info.positions = torch.tensor(self.positions, dtype=torch.int64, device=device) + 1  # [N]: the token each row samples
        return info
